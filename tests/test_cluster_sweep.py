"""A study shared by the two hosts of the local cluster (accelerate_configs/slurm/local_cluster.sh) in
its PostgreSQL database: one sweep process per host; one host's sweep and its trial are SIGKILLed
mid-trial, as when a host dies, and the other host's sweep resumes that trial from its latest
checkpoint; every trial runs once, the URL's password is never shown, and optuna-dashboard serves the
study from the same URL. Skipped when the cluster is not up, failed then if REQUIRE_CLUSTER=1."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

from conftest import REPO, clean_env, cluster_exports, descendants
from data.errors import UserError

SECRET = "pw-never-shown"  # the database trusts the cluster's subnet, so any password connects
# 768 steps, a checkpoint every epoch (128 steps): from the held trial's first checkpoint 640 steps are
# left, which the test's 10 ms poll beats with a wide margin on any machine
ARGS = {"num_train_epochs": 6, "num_train_samples": 2048, "per_device_train_batch_size": 16}


def cluster_database():
    return cluster_exports()["CLUSTER_DATABASE"]


def sweep_file(tmp_path, n_trials):
    import yaml

    path = tmp_path / "sweep.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "script": "train/regression.py",
                "accelerate_config": "accelerate_configs/cpu.yaml",
                "args": ARGS,
                "n_trials": n_trials,
                "pruner": "none",
                "space": {"learning_rate": {"low": 0.001, "high": 0.3, "log": True}},
            }
        )
    )
    return path


def on_host(node, *command):
    """`ip netns exec NODE COMMAND` under the host's own hostname (the one worker lock files record);
    every exec keeps one process, so the Popen's pid is the command's."""
    return [
        "ip",
        "netns",
        "exec",
        node,
        "unshare",
        "--uts",
        "sh",
        "-c",
        f'hostname {node} && exec "$@"',
        "sh",
        *map(str, command),
    ]


def kill_tree(pid):
    """SIGKILL a process and everything below it, the leaves first: a host that dies saves nothing."""
    for each in reversed([pid] + descendants(pid)):
        try:
            os.kill(each, signal.SIGKILL)
        except ProcessLookupError:
            pass


def get_json(url):
    with urllib.request.urlopen(url, timeout=10) as response:
        return json.load(response)


def launches(out, trial):
    text = (out / "logs" / f"trial_{trial:04d}.log").read_text()
    return text.count("starting fresh"), text.count("resumed from ")


def test_two_hosts_share_a_study_and_one_takes_over_the_trial_of_a_host_killed_mid_trial(tmp_path):
    import optuna
    from sqlalchemy.engine import make_url

    url = make_url(cluster_database()).set(password=SECRET).render_as_string(hide_password=False)
    name = f"test-cluster-sweep-{os.getpid()}-{int(time.time())}"
    out, path = tmp_path / "sweep", sweep_file(tmp_path, 2)
    study = optuna.create_study(storage=url, study_name=name, direction="minimize")
    procs, logs = {}, {}
    try:
        for lr in (0.03, 0.01):  # known settings: neither diverges
            study.enqueue_trial({"learning_rate": lr})
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        dashboard = procs["dashboard"] = subprocess.Popen(
            [
                os.path.join(os.path.dirname(sys.executable), "optuna-dashboard"),
                url,
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
            ],
            cwd=REPO,
            env=clean_env(),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for node in ("node1", "node2"):
            logs[node] = tmp_path / f"{node}.out"
            with open(logs[node], "w") as log:
                procs[node] = subprocess.Popen(
                    on_host(
                        node,
                        sys.executable,
                        "train/sweep.py",
                        path,
                        "--output_dir",
                        out,
                        "--storage",
                        url,
                        "--study_name",
                        name,
                    ),
                    cwd=REPO,
                    env=clean_env(),
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )

        def wait_for(done, what):
            deadline = time.monotonic() + 300
            while not done():
                assert all(procs[n].poll() is None for n in ("node1", "node2")) and time.monotonic() < deadline, (
                    what,
                    {n: logs[n].read_text() for n in logs},
                )
                time.sleep(0.01)

        # trial 0 (the first claimed) is held (SIGSTOP) at its first checkpoint, so it is still mid-trial
        # however long the other host takes to claim trial 1
        wait_for((out / "trials" / "trial_0000.yaml").exists, "trial 0 claimed")
        worker = study.trials[0].user_attrs["worker"]  # workers/HOST-PID-RANDOM.lock
        killed = worker.split("/")[1].split("-")[0]
        survivor = "node2" if killed == "node1" else "node1"
        assert worker.split("-")[1] == str(procs[killed].pid), worker
        checkpoints = out / "trials" / "trial_0000" / "checkpoints"
        wait_for(
            lambda: checkpoints.is_dir() and any(p.name.startswith("step_") for p in checkpoints.iterdir()),
            "a checkpoint of trial 0",
        )
        for pid in descendants(procs[killed].pid):  # its launcher and rank
            os.kill(pid, signal.SIGSTOP)
        wait_for((out / "trials" / "trial_0001.yaml").exists, "trial 1 claimed by the other host")
        kill_tree(procs[killed].pid)
        procs[killed].wait()
        assert not (out / "trials" / "trial_0000" / "all_results.json").exists()  # killed mid-trial
        assert procs[survivor].wait(timeout=300) == 0, logs[survivor].read_text()
        text = logs[survivor].read_text()
        assert "trial 0: its sweep process is gone; queued to resume from its latest checkpoint" in text, text
        assert "trial 0: learning_rate=0.03 (resuming)" in text and "trial 0: complete" in text, text
        assert "trial 1: complete" in text and "trial 1: complete" not in logs[killed].read_text()

        trials = optuna.load_study(study_name=name, storage=url).trials
        assert [t.state.name for t in trials] == ["FAIL", "COMPLETE", "COMPLETE"], trials  # 0, 1, 0 resumed
        assert [t.user_attrs.get("folder", t.number) for t in trials] == [0, 1, 0]
        assert all(t.user_attrs["worker"].startswith(f"workers/{survivor}-") for t in trials[1:])
        for trial in (0, 1):  # each trained from step 0 once; trial 0 once more, from its checkpoint
            assert launches(out, trial) == ((1, 1) if trial == 0 else (1, 0)), trial
        with open(out / "trials" / "trial_0000" / "all_results.json") as f:
            assert "/checkpoints/step_" in json.load(f)["resumed_from"]
        assert os.listdir(out / "workers") == []  # the killed sweep's lock file too

        with open(out / "sweep.json") as f:  # the password masked wherever the sweep writes or prints
            assert json.load(f)["storage"] == url.replace(SECRET, "***")
        written = [logs[n].read_text() for n in logs] + [p.read_text() for p in (out / "logs").iterdir()]
        assert not any(SECRET in each for each in written)

        deadline = time.monotonic() + 60
        while True:  # the dashboard, started with the sweeps, answers once it has imported
            try:
                studies = get_json(f"http://127.0.0.1:{port}/api/studies")["study_summaries"]
                break
            except OSError:
                assert dashboard.poll() is None and time.monotonic() < deadline, "optuna-dashboard did not start"
                time.sleep(0.5)
        study_id = next(s["study_id"] for s in studies if s["study_name"] == name)
        shown = get_json(f"http://127.0.0.1:{port}/api/studies/{study_id}")["trials"]
        assert [t["state"] for t in shown] == ["Fail", "Complete", "Complete"], shown
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                kill_tree(proc.pid)
                proc.wait()
        optuna.delete_study(study_name=name, storage=url)


def test_a_database_that_does_not_answer_is_one_line_without_its_password(tmp_path):
    from train import sweep

    out = tmp_path / "sweep"
    args = sweep.parse_args(
        [
            str(sweep_file(tmp_path, 1)),
            "--output_dir",
            str(out),
            "--storage",
            f"postgresql://user:{SECRET}@127.0.0.1:1/optuna",
        ]
    )
    with pytest.raises(UserError) as e:
        sweep.main(args)
    assert str(e.value).startswith("cannot open the study's storage postgresql://user:***@127.0.0.1:1/optuna: "), (
        e.value
    )
    assert SECRET not in str(e.value)
    assert not out.exists()  # no sweep.json binds the folder to a storage that never answered
