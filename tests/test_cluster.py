"""accelerate_configs/slurm/train.sbatch on a real SLURM cluster (`make cluster`: two hosts in network
namespaces, slurmctld, one slurmd per host; docs/cluster.md): 2 nodes x 2 CPU processes run to the
end; the time limit's signal saves, requeues and resumes bit for bit; a lost node ends the survivors
in seconds with one line, and the job goes on at world size 2, requeued by SLURM or by torchrun's
elastic rendezvous, to the weights of the uninterrupted run. Skipped without the cluster, unless
REQUIRE_CLUSTER=1 (CI) makes its absence a failure."""

import os
import re
import signal
import subprocess
import time

import pytest

from conftest import CONFIGS, REPO, clean_env, cluster_exports
from test_checkpointing import largest_difference, weights

EXPORTS = cluster_exports()  # skips the module without the cluster (fails under REQUIRE_CLUSTER=1)

SBATCH = os.path.join(CONFIGS, "slurm", "train.sbatch")
CLUSTER = os.path.join(CONFIGS, "slurm", "local_cluster.sh")
# 320 steps of 32 on 4 processes, eval every epoch, checkpoints every 50 steps, the last step's weights.
# Where a test waits on SLURM (its time-limit check comes every 30 s) or on the other job, a job's ranks
# are frozen (SIGSTOP) meanwhile, so the job cannot finish first on a fast machine, and they burn no CPU
ARGS = [
    "train/regression.py",
    "--global_batch_size",
    32,
    "--num_train_epochs",
    10,
    "--checkpointing_steps",
    50,
    "--metric_for_best_model",
    "none",
    "--mixed_precision",
    "no",
    "--seed",
    11,
]


def slurm_env(**extra):
    return clean_env(SLURM_CONF=EXPORTS["SLURM_CONF"], PROCESSES_PER_NODE="2", **extra)


def sbatch(out, *options, script_args=(), **env):
    """Submits train.sbatch from the repo (its working folder) with the CPU settings; the job's id."""
    cmd = [
        "sbatch",
        "--parsable",
        "--gpus-per-node",
        "0",
        "--cpus-per-task",
        "2",
        "--time",
        "10",
        "--output",
        f"{out}.log",
        *options,
        SBATCH,
        *map(str, ARGS),
        *map(str, script_args),
        "--output_dir",
        str(out),
    ]
    return (
        subprocess.run(cmd, cwd=REPO, env=slurm_env(**env), check=True, capture_output=True, text=True)
        .stdout.strip()
        .split(";")[0]
    )


def job(job_id):
    """scontrol's fields of the job (JobState, Restarts, NodeList, ...)."""
    text = subprocess.run(
        ["scontrol", "-o", "show", "job", job_id], env=slurm_env(), capture_output=True, text=True
    ).stdout
    return dict(re.findall(r"(\w+)=(\S*)", text))


def wait_for(condition, timeout, what):
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout} s: {what}")
        time.sleep(0.2)


def finished(job_id):
    return job(job_id).get("JobState") in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL")


def slurm_processes(node, job_id=None):
    """Pids in the node's namespace that SLURM runs: slurmd, slurmstepd, and every process of a job
    (they carry SLURM_JOB_ID), or only job_id's."""
    pids = subprocess.run(["ip", "netns", "pids", node], capture_output=True, text=True).stdout.split()
    found = []
    for pid in pids:
        try:
            cmd = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")[0]
            environ = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
        except OSError:  # gone meanwhile
            continue
        ids = [e.split(b"=", 1)[1].decode() for e in environ if e.startswith(b"SLURM_JOB_ID=")]
        if (job_id is None and (os.path.basename(cmd) in (b"slurmd", b"slurmstepd") or ids)) or job_id in ids:
            found.append(int(pid))
    return found


def send(pids, number):
    for pid in pids:
        try:
            os.kill(pid, number)
        except ProcessLookupError:
            pass


def ranks_of(node, job_id):
    """The job's training processes on the node (`python -u train/regression.py ...`), not its launchers."""

    def is_rank(pid):
        try:
            argv = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")
        except OSError:
            return False
        return (
            os.path.basename(argv[0]).startswith(b"python")
            and b"train/regression.py" in argv
            and b"-m" not in argv
            and b"launch" not in argv
        )

    return [pid for pid in slurm_processes(node, job_id) if is_rank(pid)]


def launchers_of(node, job_id):
    """The job's launchers on the node (`python -m train.core.launch accelerate launch ...`)."""

    def is_launcher(pid):
        try:
            return b"train.core.launch" in open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")
        except OSError:
            return False

    return [pid for pid in slurm_processes(node, job_id) if is_launcher(pid)]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The reference: the same job, never interrupted, 2 nodes x 2 processes."""
    subprocess.run(["bash", CLUSTER, "up"], check=True)  # both nodes up, whatever an earlier run left
    out = tmp_path_factory.mktemp("cluster") / "uninterrupted"
    job_id = sbatch(out, "--nodes", "2")
    return job_id, out


def reference(uninterrupted):
    job_id, out = uninterrupted
    wait_for(lambda: finished(job_id), 600, f"job {job_id} finishing")
    info, log = job(job_id), open(f"{out}.log", errors="replace").read()
    assert info["JobState"] == "COMPLETED" and info["NodeList"] == "node[1-2]", (info, log[-3000:])
    assert log.count("world_size=4 ") == 2, log[-3000:]  # one header per node, one world of 4
    accounted = subprocess.run(
        ["sacct", "-n", "-X", "-P", "-j", job_id, "-o", "State,NodeList"],
        env=slurm_env(),
        capture_output=True,
        text=True,
    ).stdout
    assert accounted.split() == ["COMPLETED|node[1-2]"], accounted  # slurmdbd's record
    return out


def test_time_limit_saves_requeues_and_resumes_bit_for_bit(uninterrupted, tmp_path):
    """The job's own `#SBATCH --signal=B:USR1@120`: once its limit is under 2 minutes away slurmctld
    signals the batch script, which has every rank save at one step, requeues the job, and the
    requeued job (SLURM_RESTART_COUNT=1) resumes from that checkpoint to the uninterrupted weights."""
    out = tmp_path / "run"
    job_id = sbatch(out, "--nodes", "2")
    wait_for(lambda: (out / "checkpoints" / "step_00000050").is_dir(), 300, "the first checkpoint")
    ranks = ranks_of("node1", job_id) + ranks_of("node2", job_id)
    assert len(ranks) == 4, ranks
    send(ranks, signal.SIGSTOP)  # the SIGTERM it asks for waits for them
    subprocess.run(["scontrol", "update", f"JobId={job_id}", "TimeLimit=2"], env=slurm_env(), check=True)
    t0 = time.monotonic()
    wait_for(lambda: "time limit in 120 s" in open(f"{out}.log", errors="replace").read(), 120, "the signal")
    signalled = time.monotonic() - t0
    send(ranks, signal.SIGCONT)
    wait_for(lambda: job(job_id).get("Restarts") == "1", 240, "the requeue")
    requeued = time.monotonic() - t0
    # the requeued job keeps the short limit; a real one has hours: give it back its 10 minutes
    subprocess.run(["scontrol", "update", f"JobId={job_id}", "TimeLimit=10"], env=slurm_env(), check=True)
    wait_for(lambda: finished(job_id), 420, "the requeued job finishing")
    log = open(f"{out}.log", errors="replace").read()
    assert job(job_id)["JobState"] == "COMPLETED", log[-3000:]
    stopped = re.findall(r"stopped on SIGTERM at step (\d+)", log)
    assert len(stopped) == 2 and len(set(stopped)) == 1, log[-3000:]  # each node's first process, one step
    step = int(stopped[0])
    assert f"requeueing job {job_id}" in log and f"resumed from {out}/checkpoints/step_{step:08d}" in log
    assert 50 <= step < 320 and "DataLoader worker" not in log
    # in SLURM's terms, and the ranks' lines without the launchers' tracebacks
    assert f"SLURM job {job_id} goes on from there when requeued" in log, log[-3000:]
    assert f"by hand: sbatch {SBATCH} train/regression.py --global_batch_size 32 " in log, log[-3000:]
    assert "Traceback" not in log and "SignalException" not in log, log[-3000:]
    print(
        f"\ntime limit: signal {signalled:.0f} s after the update, save at step {step}, requeue {requeued:.0f} s after"
    )
    assert largest_difference(weights(out), weights(reference(uninterrupted))) == 0.0


def log_text(out):
    return open(f"{out}.log", errors="replace").read() if os.path.exists(f"{out}.log") else ""


def signalled_before_any_step(job_id, out):
    """Until the job ends, in every start: its launchers stopped from the moment they appear, and once
    both nodes' are, the batch script signalled as slurmctld signals it ahead of the time limit
    (`--signal=B:USR1`: the batch shell alone, `scancel --batch`); they go on once it has said so, so
    every start's ranks get the SIGTERM before any step. The number of starts."""
    frozen, signalled_starts, starts = set(), 0, 0

    def hold():
        nonlocal starts, signalled_starts
        said = log_text(out).count("time limit in 120 s")
        starts = int(job(job_id).get("Restarts") or 0) + 1
        if said < starts:
            launchers = launchers_of("node1", job_id) + launchers_of("node2", job_id)
            frozen.update(launchers)
            send(frozen, signal.SIGSTOP)
            if signalled_starts < starts and len(launchers) == 2:
                scancel = ["scancel", "--batch", "--signal", "USR1", job_id]
                subprocess.run(scancel, env=slurm_env(), check=True)
                signalled_starts = starts
        else:
            send(frozen, signal.SIGCONT)
            frozen.clear()
        return finished(job_id)

    try:
        wait_for(hold, 300, "the job ending")
    finally:
        send(frozen, signal.SIGCONT)
    return starts


def test_a_time_limit_that_leaves_no_time_to_train_ends_the_job_after_two_starts(tmp_path):
    """A job whose time limit's signal comes before its first step (here: the signal sent as soon as
    its launchers appear, and they are frozen until it is handled; the real limit's signal is the test
    above's) saves nothing. The first such start is requeued once more, the second ends the job failed
    with one line saying why and what to change, instead of requeueing without end."""
    out = tmp_path / "run"
    job_id = sbatch(out, "--nodes", "2")
    starts = signalled_before_any_step(job_id, out)
    log = log_text(out)
    assert starts == 2 and job(job_id)["JobState"] == "FAILED", (starts, job(job_id), log[-3000:])
    assert log.count("time limit in 120 s") == 2 and log.count("requeueing job") == 1, log[-3000:]
    assert f"job {job_id}: start 1 trained no step before the signal; requeueing it once more" in log
    assert (
        f"error: job {job_id} started twice in a row from the same checkpoint and trained no step: its time limit "
        "leaves no time to train past start-up; submit it again with a longer --time or a smaller --signal offset"
    ) in log, log[-3000:]
    assert not (out / "checkpoints").exists() and "Traceback" not in log, log[-3000:]


def test_a_lost_node_ends_the_survivors_and_the_job_goes_on_with_the_node_left(uninterrupted, tmp_path):
    """Two jobs on both nodes, then every SLURM process of node2 is SIGKILLed (slurmd, slurmstepd, the
    ranks): a node gone at once. The static job's ranks on node1 end within seconds with one line
    naming node2 and publish nothing; the user resubmits it on the node left (`--nodes 1`, the same
    --global_batch_size, --resume_from_checkpoint latest): world size 2, the same steps. The elastic
    job (MIN_NODES=1, --no-kill) goes on by itself: torchrun's agent on node1 restarts its workers in
    a 1-node round. (--no-requeue: whether SLURM requeues the job itself depends on whether it
    declares the node down before srun gives up on it; docs/cluster.md.)"""
    reference_weights = weights(reference(uninterrupted))  # done before the kill, which would end it too
    static, elastic = tmp_path / "static", tmp_path / "elastic"
    static_id = sbatch(static, "--nodes", "2", "--no-requeue")
    elastic_id = sbatch(
        elastic, "--nodes", "2", "--no-kill", MIN_NODES="1", script_args=["--resume_from_checkpoint", "latest"]
    )  # what restarted workers need
    frozen = {}
    try:
        # each job frozen once it has a checkpoint (its ranks on node1 stopped: node2's wait on them), so
        # neither can finish before the kill, however fast this machine

        def freeze_those_with_a_checkpoint():
            for out, job_id in ((static, static_id), (elastic, elastic_id)):
                if job_id not in frozen and (out / "checkpoints" / "step_00000100").is_dir():
                    frozen[job_id] = ranks_of("node1", job_id)
                    send(frozen[job_id], signal.SIGSTOP)
            return len(frozen) == 2

        wait_for(freeze_those_with_a_checkpoint, 300, "a checkpoint of both jobs")
        assert [len(ranks) for ranks in frozen.values()] == [2, 2], frozen
        assert job(static_id)["NodeList"] == "node[1-2]" and job(elastic_id)["NodeList"] == "node[1-2]"
        survivors = frozen[static_id] + frozen[elastic_id]
        send(slurm_processes("node2"), signal.SIGKILL)
        send(survivors, signal.SIGCONT)
        killed = time.monotonic()
        # the static job's ranks on node1 end: not after --ddp_timeout (300 s), in seconds
        wait_for(lambda: not ranks_of("node1", static_id), 60, "the survivors ending")
        survivors_ended = time.monotonic() - killed
        wait_for(lambda: finished(static_id), 120, "the job ending")
        log = open(f"{static}.log", errors="replace").read()
        assert "error: lost contact with node2 (10.88.0.12) in a collective" in log, log[-3000:]
        assert not (static / "model.safetensors").exists() and not (static / "all_results.json").exists()
        assert job(static_id)["JobState"] == "FAILED"
        ended = time.monotonic() - killed
        resumed_id = sbatch(static, "--nodes", "1", script_args=["--resume_from_checkpoint", "latest"])
        wait_for(lambda: finished(resumed_id) and finished(elastic_id), 420, "both runs finishing")
        assert job(resumed_id)["JobState"] == "COMPLETED"
        # the elastic job's run finishes on node1; SLURM still counts node2's lost task as a failed step
        for out, job_id in ((static, resumed_id), (elastic, elastic_id)):
            info, log = job(job_id), open(f"{out}.log", errors="replace").read()
            assert (out / "all_results.json").exists() and "world_size=2 " in log, (info, log[-3000:])
            assert re.search(rf"resumed from {out}/checkpoints/step_\d+ \(step \d+, saved with 4 ", log), log[-3000:]
        assert job(resumed_id)["NodeList"] == "node1"
        print(f"\nlost node: survivors ended {survivors_ended:.1f} s after the kill, the job {ended:.0f} s after")
        for out in (static, elastic):
            difference = largest_difference(weights(out), reference_weights)
            print(
                f"{out.name}: 4 -> 2 processes, largest weight difference from the uninterrupted run {difference:.1e}"
            )
            assert difference < 1e-5
    finally:
        send([pid for ranks in frozen.values() for pid in ranks], signal.SIGCONT)  # a failure before the kill
        subprocess.run(["bash", CLUSTER, "node-up", "node2"], check=True)
