"""Drive `accelerate config` as a person would at a terminal: its menus need a real tty, so it runs
in a pseudo-terminal and each question is answered when its text appears."""

import os
import pty
import re
import select
import subprocess
import sys
import time

ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def run_wizard(config_file, answers, timeout=90):
    """answers: (regex, keys) pairs, in the order the questions come; a question matching none gets
    Enter (the default). Returns (exit code, the screen text)."""
    master, slave = pty.openpty()
    proc = subprocess.Popen(
        [sys.executable, "-m", "accelerate.commands.accelerate_cli", "config", "--config_file", str(config_file)],
        stdin=slave,
        stdout=slave,
        stderr=slave,
        close_fds=True,
        env={**os.environ, "TERM": "dumb"},
    )
    os.close(slave)
    pending, screen, unanswered, quiet = list(answers), [], "", 0
    deadline = time.time() + timeout
    while time.time() < deadline and proc.poll() is None:
        ready, _, _ = select.select([master], [], [], 0.2)
        if ready:
            try:
                data = os.read(master, 4096).decode(errors="replace")
            except OSError:
                break
            screen.append(data)
            unanswered += data
            quiet = 0
            continue
        quiet += 1
        text = ANSI.sub("", unanswered).strip()
        if quiet < 3 or not text:  # 0.6 s without output: the wizard waits for an answer
            continue
        keys = "\r"
        if pending and re.search(pending[0][0], text):
            keys = pending.pop(0)[1]
        os.write(master, keys.encode())
        unanswered, quiet = "", 0
    if proc.poll() is None:
        proc.kill()
    proc.wait()
    os.close(master)
    assert not pending, f"questions never asked: {pending}\n{ANSI.sub('', ''.join(screen))[-2000:]}"
    return proc.returncode, ANSI.sub("", "".join(screen))
