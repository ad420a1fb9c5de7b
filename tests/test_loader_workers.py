"""DataLoader workers start from a single-threaded server, not by forking the training process:
CPython before 3.12 can hang a child forked while another thread (gloo's, freeing a collective)
creates its Python thread state (data.loader.loader_workers, docs/data.md)."""
import json
import os
import sys
import time

import torch

from conftest import REPO, clean_env, run_or_dump
from data import loader
from data.loader import loader_workers

PROBE = os.path.join(REPO, "tests", "worker_start_probe.py")


def probe(*args):
    proc = run_or_dump([sys.executable, PROBE, *map(str, args)], 180, env=clean_env(), forked_workers=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1]), proc.stderr


def test_workers_start_from_a_server_that_ignores_sigterm_while_c_threads_take_the_gil():
    # 30 epochs, a new worker each, while a native thread creates thread states without a pause:
    # forked from the probe, such workers hang within a few hundred forks on CPython 3.11.7
    report, stderr = probe(30)
    assert report["method"] == "forkserver" and "RuntimeWarning" not in stderr, stderr
    workers = report["workers"]
    assert len(workers) == 60 and len({w["pid"] for w in workers}) == 30  # 2 samples an epoch, a worker each
    servers = {w["parent"] for w in workers}
    assert len(servers) == 1 and report["pid"] not in servers  # one server, and not the training process
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
    if loader.FORK_CAN_HANG:
        assert "WhoAmI cannot be pickled" in stderr and "Fix: keep the dataset's state picklable" in stderr, stderr


def test_a_script_without_a_main_guard_gets_forked_workers(tmp_path):
    # every worker imports the script: one that trains at import would train again in each
    script = tmp_path / "unguarded.py"
    script.write_text(f"import sys\nsys.path.insert(0, {REPO!r})\nimport torch\nfrom data.loader import loader_workers\n"
                      "kwargs = loader_workers(1, torch.arange(4))\n"
                      "print(kwargs['multiprocessing_context'].get_start_method())\n")
    proc = run_or_dump([sys.executable, str(script)], 120, env=clean_env(), forked_workers=True)
    assert proc.returncode == 0 and proc.stdout.split() == ["fork"], proc.stderr[-3000:]
    if loader.FORK_CAN_HANG:
        assert 'has no `if __name__ == "__main__":`' in proc.stderr, proc.stderr


def test_what_the_workers_are_sent_is_checked_without_copying_its_tensors(monkeypatch):
    images = torch.zeros(1000, 1024, dtype=torch.uint8)
    assert loader._pickle_problem([images, images[:10], len]) is None
    assert loader._pickle_problem([lambda: None])[0].startswith("function cannot be pickled")

    class Free:  # 1 MiB of shared memory left: the 1,000 images (~1 MiB) need half of it at most
        f_bavail, f_frsize = 256, 4096

    monkeypatch.setattr(os, "statvfs", lambda path: Free)
    problem = loader._pickle_problem([images])
    assert "do not fit in the free shared memory" in problem[0] and "--shm-size" in problem[1]


def test_no_workers_take_no_start_method():
    assert loader_workers(0, torch.arange(4)) == {"num_workers": 0}
