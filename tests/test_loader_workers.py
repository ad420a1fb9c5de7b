"""DataLoader workers start from a server process, not by forking the training process: CPython
before 3.11.10 and 3.12 can hang a child forked while another thread (gloo's, freeing a collective)
creates its Python thread state (data.workers.loader_workers, docs/data.md)."""

import json
import multiprocessing
import os
import subprocess
import sys
import time

import pytest
import torch

from conftest import REPO, clean_env, run_or_dump
from data import workers
from data.workers import loader_workers

PROBE = os.path.join(REPO, "tests", "worker_start_probe.py")


def probe(*args, module=False):
    """worker_start_probe.py run as a script, or with -m (multiprocessing then imports it by name)."""
    how = ["-m", "tests.worker_start_probe"] if module else [PROBE]
    proc = run_or_dump([sys.executable, *how, *map(str, args)], 180, env=clean_env(), forked_workers=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1]), proc.stderr


@pytest.mark.parametrize("module,epochs", [(False, 30), (True, 3)], ids=["script", "module"])
def test_workers_start_from_a_server_that_ignores_sigterm_while_c_threads_take_the_gil(module, epochs):
    # a new worker every epoch while a native thread creates thread states without a pause: forked
    # from the probe, such workers hang within a few hundred forks on CPython 3.11.7
    report, stderr = probe(epochs, module=module)
    assert report["method"] == "forkserver" and "RuntimeWarning" not in stderr, stderr
    workers = report["workers"]
    assert len(workers) == 2 * epochs and len({w["pid"] for w in workers}) == epochs  # 2 samples, a worker an epoch
    servers = {w["parent"] for w in workers}
    assert len(servers) == 1 and report["pid"] not in servers  # one server, and not the training process
    assert {w["body_ran_in"] for w in workers} == servers  # the server imported the script, no worker again
    assert all(w["argv"] == [str(epochs)] for w in workers)  # as the training process was started
    assert all(w["own_init_ran"] for w in workers)  # a worker_init_fn of the caller's runs too
    assert all(w["parent_ignores_sigterm"] for w in workers)  # torch elastic's killpg must not end the server
    assert not any(w["ignores_sigterm"] for w in workers)  # a worker takes its rank's SIGTERM
    assert all(w["group"] == w["pid"] for w in workers)  # and nobody else's: a process group of its own


def test_a_rank_killed_midway_leaves_neither_its_workers_nor_their_server():
    # torch's workers watch their parent, the server; the server lives while a worker does
    proc = run_or_dump([sys.executable, PROBE, "--sigkill_midway"], 120, env=clean_env())
    assert proc.returncode == -9, proc.stderr[-3000:]
    worker = json.loads(proc.stdout.strip().splitlines()[-1])
    left, deadline = [worker["pid"], worker["parent"]], time.time() + 15
    while left and time.time() < deadline:
        left = [pid for pid in left if alive(pid)]
        time.sleep(0.2)
    assert not left, f"still running 15 s after their rank's SIGKILL: {left}"


def alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has exited
    except FileNotFoundError:
        return False


def test_an_unpicklable_dataset_gets_forked_workers_and_a_warning_that_names_the_fix():
    report, stderr = probe(2, "--unpicklable")
    assert report["method"] == "fork" and {w["parent"] for w in report["workers"]} == {report["pid"]}
    if workers.FORK_CAN_HANG:
        assert "WhoAmI cannot be pickled" in stderr and "Fix: keep the dataset's state picklable" in stderr, stderr


@pytest.mark.parametrize("guard", ["none", "elsewhere"])
def test_a_script_that_builds_its_loader_outside_a_main_guard_gets_forked_workers(tmp_path, guard):
    # the worker server runs the script's code outside the guard once more: it would build (and train) too
    script = tmp_path / "unguarded.py"
    script.write_text(
        f"import sys\nsys.path.insert(0, {REPO!r})\n"
        "import torch\nfrom data.workers import loader_workers\n"
        "kwargs = loader_workers(1, torch.arange(4))\n"
        "print(kwargs['multiprocessing_context'].get_start_method())\n"
        + ('if __name__ == "__main__":\n    pass\n' if guard == "elsewhere" else "")
    )
    proc = run_or_dump([sys.executable, str(script)], 120, env=clean_env(), forked_workers=True)
    assert proc.returncode == 0 and proc.stdout.split() == ["fork"], proc.stderr[-3000:]
    if workers.FORK_CAN_HANG:
        said = {"none": 'has no `if __name__ == "__main__":`', "elsewhere": "builds the DataLoader outside"}[guard]
        assert said in proc.stderr, proc.stderr


COUNT_EVERY_ROW = f"""import sys
sys.path.insert(0, {REPO!r})
import torch
from data import TensorSource
from data.loader import sharded_loader
loader = sharded_loader(TensorSource({{"x": torch.arange(1000)}}), 10, rank=0, world_size=1,
                        device=torch.device("cpu"), seed=0, train=True, num_workers=2)

print(sum(len(batch["x"]) for batch in loader))
"""


@pytest.mark.parametrize("how", ["stdin", "-c", "interactive"])
def test_code_from_standard_input_python_c_or_an_interactive_session_gets_working_workers(how):
    # no script file for a worker server to import (a notebook kernel's __main__ has none either): forked
    cmd = {"stdin": ["-"], "-c": ["-c", COUNT_EVERY_ROW], "interactive": ["-i"]}[how]
    proc = subprocess.run(
        [sys.executable, *cmd],
        input=None if how == "-c" else COUNT_EVERY_ROW,
        cwd=REPO,
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0 and proc.stdout.split()[-1:] == ["1000"], proc.stderr[-3000:]
    if workers.FORK_CAN_HANG:
        assert "has no script file to start them from" in proc.stderr, proc.stderr


def test_what_the_workers_are_sent_is_checked_without_moving_or_copying_its_tensors(monkeypatch):
    monkeypatch.setattr(workers, "_shared_memory_planned", 0)
    images = torch.zeros(1000, 1024, dtype=torch.uint8)
    shared_at_start = [multiprocessing.get_context("forkserver").Queue(), multiprocessing.Value("i", 0)]
    assert workers._pickle_problem([images, images[:10], len, torch.eye(3).to_sparse(), shared_at_start]) is None
    assert not images.is_shared()  # counted, not moved to shared memory
    assert workers._pickle_problem([lambda: None])[0].startswith("function cannot be pickled")
    # each tensor reaches a worker as a file descriptor; a worker's start passes at most 252
    assert "would each take a file descriptor" in workers._pickle_problem([[torch.zeros(1) for _ in range(300)]])[0]
    monkeypatch.setattr(workers, "MAX_PICKLED", 1000)  # pickled state is copied to each worker at every epoch
    assert "pickles to" in workers._pickle_problem([bytes(2000)])[0]

    class Free:  # 1 MiB of shared memory left: the 1,000 images (~1 MiB) may take half of it at most
        f_bavail, f_frsize = 256, 4096

    monkeypatch.setattr(os, "statvfs", lambda path: Free)
    problem = workers._pickle_problem([images])
    assert "do not fit in the free shared memory" in problem[0] and "--shm-size" in problem[1]


def test_no_workers_take_no_start_method():
    assert loader_workers(0, torch.arange(4)) == {"num_workers": 0}
