"""Shared fixtures: paths, an `accelerate launch` runner, and accelerate state isolation for
in-process runs of the scripts' main()."""

import os
import re
import shutil
import signal
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = os.path.join(REPO, "accelerate_configs")
FASHION_DIR = "/usr/share/datasets/fashion-mnist"

# The suite asserts fp32 numerics (1 process = 2 processes to 1e-6, say) of runs that leave
# --mixed_precision at `auto`, which picks bf16 on CPUs with native bf16. Limiting oneDNN to AVX2
# makes `auto` pick fp32 on every CPU, here and in every process the tests start; the tests of
# `auto` itself set what they need.
os.environ.setdefault("ONEDNN_MAX_CPU_ISA", "AVX2")
# One intra-op thread per process, as each rank of a multi-process launch already has (torchrun's
# default): the in-process runs and 1-process launches took a thread per core, and beside the other
# xdist worker's runs those threads waited on each other, several times slower on 2 cores.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# No test reaches the Hugging Face Hub: a Hub id resolves through a cache the test builds on disk, and the
# scripts never set offline mode themselves (the user's HF_HUB_OFFLINE decides)
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def pytest_xdist_auto_num_workers(config):
    """Workers for `-n auto` (pytest.ini): most tests here wait on launched runs of 2 to 4 processes,
    and a file's tests on one another, so two workers keep a 2-core machine busy where one left it
    a third idle (measured). More cores take more workers, at most 4: each launched run is 2-4
    processes of about 600 MB, and the timing a few tests bound (a Ctrl-C answered within 10 s)
    must hold under load."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return min(4, max(2, cores // 2))


# The longest files first (most of them launch many multi-process runs). With `--dist loadfile` a worker
# takes one whole file at a time in collection order, so a long file collected late runs alone at the
# end while the other worker idles (5 of 22 minutes in one clean-clone run): these go first. The cluster
# files mostly wait on SLURM and the rendezvous, beside the other worker's runs.
LONGEST_FIRST = (
    "test_cluster.py",
    "test_cluster_sweep.py",
    "test_bench.py",
    "test_sweep.py",
    "test_fsdp2.py",
    "test_image_classification.py",
    "test_text_classification.py",
    "test_sft.py",
    "test_dpo.py",
    "test_grpo.py",
    "test_lm_eval.py",
    "test_start_checks.py",
    "test_pretrained.py",
    "test_checkpointing.py",
    "test_first_hour.py",
    "test_sharding.py",
    "test_multinode.py",
    "test_lm.py",
    "test_mnist.py",
    "test_readme_script.py",
    "test_run_folder.py",
    "test_exits.py",
    "test_sharded_launch.py",
    "test_experiments.py",
)


# The files of multi-process runs, clusters, benches and lm-eval: `make test-fast` (pytest -m "not slow") leaves
# them out for the quick loop while working; `make test` and CI run everything.
SLOW = set(LONGEST_FIRST) | {
    "test_sample_pairs.py",
    "test_loader_workers.py",
    "test_tracking.py",
    "test_data_integrity.py",
    "test_regression.py",
    "test_gpu.py",
}


def pytest_collection_modifyitems(items):
    for item in items:
        if os.path.basename(str(item.fspath)) in SLOW:
            item.add_marker(pytest.mark.slow)
    order = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(
        key=lambda item: order.get(os.path.basename(str(item.fspath)), len(order))
    )  # stable: files keep their order


def clean_env(**extra):
    """The environment a user's shell would have: no PYTHONPATH help, no leftover launcher state."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k != "PYTHONPATH" and not k.startswith(("ACCELERATE_", "LOCAL_RANK", "RANK", "WORLD_SIZE", "MASTER_"))
    }
    env.update(PYTHONUNBUFFERED="1", **extra)
    return env


def launch(config, script, *args, timeout=300, launch_args=(), **env):
    """`accelerate launch --config_file accelerate_configs/CONFIG.yaml [LAUNCH_ARGS] train/SCRIPT.py ARGS`
    from the repo root, as users run it. The timeout is the failure mode of a hang: see run_or_dump."""
    cmd = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        os.path.join(CONFIGS, config + ".yaml"),
        *launch_args,
        os.path.join("train", script + ".py"),
        *map(str, args),
    ]
    return run_or_dump(cmd, timeout, env=clean_env(**env))


def descendants(pid):
    """Every process below pid (ranks, their DataLoader workers), parents first, from /proc."""
    children = {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat") as f:
                parent = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(parent, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        below = children.get(todo.pop(0), [])
        found += below
        todo += below
    return found


def run_or_dump(cmd, timeout, env, forked_workers=False):
    """subprocess.run(cmd, capture_output=True, text=True) from the repo root; past the timeout (a
    hang), the test fails with the Python and native stacks of every process of the run (py-spy,
    from requirements.txt) and its output's tail, and the whole process tree is killed, not the
    launcher alone, whose orphaned ranks would hold the machine for the rest of the suite. A run whose
    DataLoader workers fell back to a fork fails too, unless `forked_workers`."""
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
        # DataLoader workers start from their server, never forked from a training process (docs/data.md)
        assert forked_workers or "DataLoader workers are forked" not in stderr, stderr[-3000:]
        return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)
    except subprocess.TimeoutExpired:
        tree = [proc.pid] + descendants(proc.pid)
        stacks = [stack_of(pid) for pid in tree]
        for pid in reversed(tree):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        stdout, stderr = proc.communicate()
    except BaseException:  # Ctrl-C, as subprocess.run does
        proc.kill()
        proc.wait()
        raise
    pytest.fail(
        f"timed out after {timeout} s (a hang?): {' '.join(cmd)}\n"
        + "\n".join(stacks)
        + f"\n--- stdout (tail)\n{stdout[-3000:]}\n--- stderr (tail)\n{stderr[-3000:]}",
        pytrace=False,
    )


def stack_of(pid):
    """What a process of a hung run is doing: its command line and every thread's stack."""
    try:
        with open(f"/proc/{pid}/cmdline") as f:
            what = f.read().replace("\0", " ")[:160]
    except OSError:
        return f"--- pid {pid}: gone"
    if not shutil.which("py-spy"):
        return f"--- pid {pid}: {what}\n(py-spy is not installed: pip install -r requirements.txt)"
    for native in (["--native"], []):  # native frames where py-spy can unwind them (it cannot always)
        try:
            dump = subprocess.run(
                ["py-spy", "dump", *native, "--pid", str(pid)], capture_output=True, text=True, timeout=60
            )
        except subprocess.TimeoutExpired:
            continue
        if dump.returncode == 0:
            return f"--- pid {pid}: {what}\n{dump.stdout}"
    return f"--- pid {pid}: {what}\n(py-spy could not read its stacks)"


def probe(config, fault, *args, timeout=240, script="regression"):
    """tests/fault_probe.py (a fault injected into train/SCRIPT.py) under accelerate launch (config) or
    as one plain process (config None)."""
    cmd = [sys.executable]
    if config:
        cmd += ["-m", "accelerate.commands.launch", "--config_file", os.path.join(CONFIGS, config + ".yaml")]
    cmd += [os.path.join("tests", "fault_probe.py"), script, *map(str, fault), "--", *map(str, args)]
    return run_or_dump(cmd, timeout, env=clean_env())


def run_script(script, *args, timeout=120, **env):
    """`python train/SCRIPT.py ARGS` in one process, without accelerate launch (`env`: more variables)."""
    cmd = [sys.executable, os.path.join("train", script + ".py"), *map(str, args)]
    return run_or_dump(cmd, timeout, env=clean_env(**env))


def run_as_script(capsys, script, *args):
    """What `python train/SCRIPT.py ARGS` does, run in this process (the script's own `__main__`
    block, through runpy) to spare a cold interpreter and torch import per case: for one-process
    bad-input checks. Returns what run_script does: returncode, stdout, stderr."""
    import runpy
    import types

    capsys.readouterr()
    argv, cwd, code = sys.argv, os.getcwd(), 0
    sys.argv = [os.path.join("train", script + ".py"), *map(str, args)]
    os.chdir(REPO)
    try:
        runpy.run_path(os.path.join(REPO, "train", script + ".py"), run_name="__main__")
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    finally:
        sys.argv = argv
        os.chdir(cwd)
        reset_accelerate_state()
    out, err = capsys.readouterr()
    return types.SimpleNamespace(returncode=code, stdout=out, stderr=err)


def run_together(commands, timeout=240):
    """Start every (cmd, env) at once, as the nodes of one job, and wait for all of them.
    Returns (exit codes, combined outputs). A rendezvous that never completes hits the timeout."""
    procs = [
        subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for cmd, env in commands
    ]
    try:
        outputs = [p.communicate(timeout=timeout)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    return [p.returncode for p in procs], outputs


def checksums(folder):
    """{relative path: sha256} of every file under folder: what "not one byte changed" compares."""
    import hashlib

    found = {}
    for root, _, files in os.walk(folder):
        for name in files:
            path = os.path.join(root, name)
            with open(path, "rb") as f:
                found[os.path.relpath(path, folder)] = hashlib.sha256(f.read()).hexdigest()
    return found


def output_of(proc):
    return proc.stdout + proc.stderr


@pytest.fixture(scope="session")
def fashion_dir():
    if not os.path.isdir(FASHION_DIR):
        pytest.fail(f"{FASHION_DIR} is missing: apt-get install dataset-fashion-mnist (make setup does it)")
    return FASHION_DIR


def reset_accelerate_state():
    """accelerate keeps process-wide singletons; reset them so in-process runs do not leak into each other."""
    from accelerate.state import AcceleratorState, GradientState, PartialState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    PartialState._reset_state()


def run_main(script, *args, through_run=False):
    """train/SCRIPT.py's main(parse_args(ARGS)) in this process, accelerate's state reset after (what a
    module fixture's in-process run needs; a test can use fresh_accelerate_state). Returns main's result.
    through_run: through train.core.run.run and its teardown, as the script's __main__ calls main."""
    import importlib

    from train.core.run import run

    module = importlib.import_module(f"train.{script}")
    args = module.parse_args([str(a) for a in args])
    try:
        return run(module.main, args) if through_run else module.main(args)
    finally:
        reset_accelerate_state()


@pytest.fixture
def fresh_accelerate_state():
    yield
    reset_accelerate_state()


def cluster_exports():
    """What runs/cluster/env.sh exports (SLURM_CONF, CLUSTER_NODES, CLUSTER_DATABASE), read from the file,
    not this process's environment. Without the cluster of `make cluster` the test is skipped, or
    fails under REQUIRE_CLUSTER=1 (CI, which starts the cluster)."""
    path = os.path.join(REPO, "runs", "cluster", "env.sh")
    if not os.path.isfile(path):
        message = "the local cluster is not up (make cluster writes runs/cluster/env.sh)"
        if os.environ.get("REQUIRE_CLUSTER") == "1":
            pytest.fail(message + " and REQUIRE_CLUSTER=1", pytrace=False)
        pytest.skip(message, allow_module_level=True)
    import shlex

    return {
        name: " ".join(shlex.split(value))
        for name, value in re.findall(r"^export (\w+)=(.*)$", open(path).read(), re.M)
    }
