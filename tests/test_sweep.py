"""Sweeps (train/sweep.py): an Optuna study whose trials are real `accelerate launch` runs, pruned
from their evaluations, resumed after a SIGKILL or a Ctrl-C without running any trial twice, shared by two
sweep processes, and bad sweep files refused in one line before any trial runs."""

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from conftest import REPO, clean_env, descendants
from data.errors import UserError

# one process per trial and a few seconds of training each: what is tested is the bookkeeping
ARGS = {"num_train_epochs": 3, "num_train_samples": 2048, "per_device_train_batch_size": 16}


def sweep_file(tmp_path, n_trials, space=None, **extra):
    import yaml

    path = tmp_path / "sweep.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "script": "train/regression.py",
                "accelerate_config": "accelerate_configs/cpu.yaml",
                "args": ARGS,
                "n_trials": n_trials,
                "seed": 0,
                "space": space or {"learning_rate": {"low": 0.001, "high": 0.3, "log": True}},
                **extra,
            }
        )
    )
    return path


def start(path, out, **kwargs):
    return subprocess.Popen(
        [sys.executable, "train/sweep.py", str(path), "--output_dir", str(out)],
        cwd=REPO,
        env=clean_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        **kwargs,
    )


def sweep_here(path, out):
    """What `python train/sweep.py PATH --output_dir OUT` does, in this process (no interpreter and torch to
    start), its Ctrl-C and SIGTERM handlers put back after."""
    from train import sweep

    handlers = {signum: signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGTERM)}
    try:
        sweep.main(sweep.parse_args([str(path), "--output_dir", str(out)]))
    finally:
        for signum, handler in handlers.items():
            signal.signal(signum, handler)


def finish(proc, timeout=600):
    out, _ = proc.communicate(timeout=timeout)
    return proc.returncode, out


def study_of(out):
    import optuna
    from optuna.storages.journal import JournalFileBackend, JournalStorage

    return optuna.load_study(study_name="sweep", storage=JournalStorage(JournalFileBackend(str(out / "study.log"))))


def enqueue(out, trials):
    """Trials in a known order (a study made ahead of the sweep command, as a user may)."""
    import optuna
    from optuna.storages.journal import JournalFileBackend, JournalStorage

    out.mkdir(parents=True, exist_ok=True)
    study = optuna.create_study(
        study_name="sweep", direction="minimize", storage=JournalStorage(JournalFileBackend(str(out / "study.log")))
    )
    for params in trials:
        study.enqueue_trial(params)


def hold_at_checkpoint(sweep, out, trial, after=0):
    """SIGSTOP the trial's processes (its launcher, then the rank below it) as soon as it publishes a
    checkpoint past step `after`: a trial of a few seconds is then still training whenever the test
    signals the sweep. Returns them, for release()."""
    checkpoints, deadline = out / "trials" / f"trial_{trial:04d}" / "checkpoints", time.monotonic() + 300
    while not (
        checkpoints.is_dir()
        and any(p.name.startswith("step_") and int(p.name[5:]) > after for p in checkpoints.iterdir())
    ):
        assert sweep.poll() is None and time.monotonic() < deadline, finish(sweep)[1]
        time.sleep(0.01)
    held = descendants(sweep.pid)
    for pid in held:
        os.kill(pid, signal.SIGSTOP)
    assert len(held) >= 2 and not (checkpoints.parent / "all_results.json").exists(), "the trial ended unheld"
    return held


def sigterm_waiting(pid):
    with open(f"/proc/{pid}/status") as f:
        fields = dict(line.split(":", 1) for line in f)
    return any(int(fields[name], 16) >> (signal.SIGTERM - 1) & 1 for name in ("SigPnd", "ShdPnd"))


def release(held):
    """SIGCONT a held trial's launcher and, once a SIGTERM waits for its rank (the sweep's, or the kernel's
    for a dead launcher), the rank: a stopped process takes its signals when continued, so the rank's
    next step is its stop, and it saves where it stood."""
    launcher, rank, *below = held
    os.kill(launcher, signal.SIGCONT)
    deadline = time.monotonic() + 60
    while not sigterm_waiting(rank):
        assert time.monotonic() < deadline, "no SIGTERM reached the held trial's rank"
        time.sleep(0.05)
    for pid in (rank, *below):
        os.kill(pid, signal.SIGCONT)


def launched_log(out, trial):
    return (out / "logs" / f"trial_{trial:04d}.log").read_text()


def stopped_at(out, trial, count):
    """The step of the trial's `count`-th stop on SIGTERM, once its log says it saved there."""
    deadline = time.monotonic() + 120
    while len(steps := re.findall(r"stopped on SIGTERM at step (\d+)", launched_log(out, trial))) < count:
        assert time.monotonic() < deadline, launched_log(out, trial)
        time.sleep(0.1)
    return int(steps[count - 1])


def launches(out, trial):
    text = launched_log(out, trial)
    return text.count("starting fresh"), text.count("resumed from ")


def test_a_sweep_sigkilled_then_stopped_with_ctrl_c_goes_on_with_every_trial_run_once(tmp_path, capsys):
    out = tmp_path / "sweep"
    # trial 1 (0.03, the best) is interrupted twice, held (SIGSTOP) from a checkpoint on each time: the first
    # sweep is SIGKILLed, the second gets a Ctrl-C once it resumed the trial, the third finishes it. Trial 2
    # is the one the second sweep must still run, before the queued resume: at its first evaluation it is
    # far worse than trial 0 (eval_mse 15.9 against 3.7), so the median pruner stops it
    enqueue(out, [{"learning_rate": lr} for lr in (0.003, 0.03, 0.0002)])
    # 6 epochs of 128 steps, a checkpoint at each: from either hold's checkpoint (128, 256) at least 512 steps
    # are left, which the test's 10 ms poll beats with a wide margin on any machine
    path = sweep_file(
        tmp_path,
        3,
        {"learning_rate": {"low": 0.0001, "high": 0.3, "log": True}},
        pruner={"name": "median", "n_startup_trials": 1},
        args={**ARGS, "num_train_epochs": 6},
    )

    first = start(path, out, start_new_session=True)
    held = hold_at_checkpoint(first, out, 1)
    deadline = time.monotonic() + 60
    while 128 not in study_of(out).trials[1].intermediate_values:  # the sweep has read the first evaluation
        assert time.monotonic() < deadline, "the sweep never reported trial 1's first evaluation"
        time.sleep(0.2)
    first.send_signal(signal.SIGKILL)
    first.wait()
    release(held)  # the kernel's SIGTERM for its dead parent waits for the launcher
    # it reached the launcher, whose rank then got its own: the trial saved where it stood
    killed_at = stopped_at(out, 1, 1)
    assert not (out / "logs" / "trial_0002.log").exists()  # never started before the kill

    second = start(path, out)
    held = hold_at_checkpoint(second, out, 1, after=killed_at)  # the resumed trial's next checkpoint
    second.send_signal(signal.SIGINT)
    release(held)  # once the sweep has passed on its SIGTERM
    code, text = finish(second)
    assert code == 130 and "sweep stopped; the interrupted trial saved a checkpoint" in text, text
    assert "trial 1: its sweep process is gone; queued to resume from its latest checkpoint" in text, text
    assert "trial 2: pruned" in text and "trial 1: learning_rate=0.03 (resuming)" in text, text
    assert stopped_at(out, 1, 2) > killed_at

    code, text = finish(start(path, out))  # the trial the Ctrl-C left RUNNING is resumed, as after the kill
    assert code == 0 and "trial 1: its sweep process is gone" in text and "trial 1: complete" in text, text
    study = study_of(out)
    states = {t.number: t.state.name for t in study.get_trials()}
    assert [n for n, state in states.items() if state == "FAIL"] == [1, 3]  # the interrupted attempts alone
    assert sorted(t.user_attrs.get("folder", t.number) for t in study.get_trials() if t.state.name != "FAIL") == list(
        range(3)
    )
    assert states[2] == "PRUNED", text
    for trial in range(3):  # each started from step 0 once; trial 1 twice more, from its checkpoints
        assert launches(out, trial) == ((1, 2) if trial == 1 else (1, 0)), trial
    with open(out / "trials" / "trial_0001" / "all_results.json") as f:
        assert "/checkpoints/step_" in json.load(f)["resumed_from"]
    assert "| 1 | 0.03 |" in text and "complete (resumed)" in text and "pruned at step 128" in text, text
    assert (out / "optimization_history.png").is_file() and (out / "param_importances.png").is_file()
    capsys.readouterr()
    sweep_here(path, out)  # a finished study: nothing more runs
    assert "trial 5" not in capsys.readouterr().out and len(study_of(out).get_trials()) == 5  # 3 and two retries
    assert os.listdir(out / "workers") == []  # the dead, the stopped and the finished sweeps' lock files are gone


def test_two_sweep_processes_share_one_study_and_count_a_failing_trial(tmp_path):
    out = tmp_path / "sweep"
    # trial 0's batch is larger than the training set: it fails, with its log kept, and counts as one of the
    # study's 2 trials (that a sweep goes on after a failed trial: the test of three failures below)
    enqueue(out, [{"learning_rate": 0.01, "per_device_train_batch_size": b} for b in (100000, 16)])
    space = {"learning_rate": {"low": 0.001, "high": 0.3, "log": True}, "per_device_train_batch_size": [16, 100000]}
    path = sweep_file(tmp_path, 2, space, pruner="none", args={"num_train_epochs": 1, "num_train_samples": 512})
    results = [finish(p) for p in [start(path, out), start(path, out)]]
    assert all(code == 0 for code, _ in results), results
    ran = [
        [line.split(":")[0] for line in text.splitlines() if line.endswith((": complete", ": failed"))]
        for _, text in results
    ]
    assert sorted(ran[0] + ran[1]) == ["trial 0", "trial 1"], results  # each trial by one process
    for n in range(2):
        assert (out / "logs" / f"trial_{n:04d}.log").read_text().count("accelerate.commands.launch") == 1
    assert "smaller than one global batch" in (out / "logs" / "trial_0000.log").read_text()
    assert [t.state.name for t in study_of(out).get_trials()] == ["FAIL", "COMPLETE"]
    assert "fail: error: the training set is smaller than one global batch" in (out / "results.md").read_text()


def test_three_failures_in_a_row_stop_the_sweep_with_the_last_error(tmp_path, monkeypatch, capsys):
    from train import sweep

    # the sweep's counting, in this process; each trial a process that fails as a real one does, its
    # error the last line of its log (a real failing launch: the test of two sweep processes above)
    monkeypatch.setattr(
        sweep,
        "trial_command",
        lambda *_: [
            sys.executable,
            "-c",
            "print('error: the training set is smaller than one global batch'); raise SystemExit(1)",
        ],
    )
    path = sweep_file(
        tmp_path,
        5,
        {"per_device_train_batch_size": [100000, 200000]},
        args={"num_train_epochs": 1, "num_train_samples": 512},
    )
    with pytest.raises(UserError) as raised:
        sweep_here(path, tmp_path / "sweep")
    assert capsys.readouterr().out.count(": failed") == 3
    assert str(raised.value).startswith(
        "3 trials in a row failed, the last with: error: the training set is smaller than one global batch"
    ), raised.value


def test_a_sweep_folder_belongs_to_one_study(tmp_path):
    from train import sweep

    out = tmp_path / "out"
    sweep.claim_folder(sweep.parse_args(["x.yaml", "--output_dir", str(out)]))
    sweep.claim_folder(sweep.parse_args(["x.yaml", "--output_dir", str(out)]))  # the same study again
    with pytest.raises(UserError, match="holds the trials of study 'sweep'"):
        sweep.claim_folder(sweep.parse_args(["x.yaml", "--output_dir", str(out), "--study_name", "other"]))
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("a user's file")
    with pytest.raises(UserError, match="not a sweep's folder"):
        sweep.claim_folder(sweep.parse_args(["x.yaml", "--output_dir", str(tmp_path / "mine")]))
    assert os.listdir(tmp_path / "mine") == ["notes.txt"]  # refused before any lock file of ours went in


def claim_in_rounds(barrier, root, rounds, results):
    """One sweep command's start, `rounds` times: claim ROOT/round_N as soon as every claimer is ready,
    then create what main() creates next (trials/, logs/, the study's journal), as the racing commands do."""
    from train import sweep

    for n in range(rounds):
        out = os.path.join(root, f"round_{n}")
        barrier.wait()
        try:
            sweep.claim_folder(sweep.parse_args(["x.yaml", "--output_dir", out]))
            for folder in ("trials", "logs"):
                os.makedirs(os.path.join(out, folder), exist_ok=True)
            with sweep.claim_lock(out), open(os.path.join(out, "study.log"), "a"):
                pass
            results.put("claimed")
        except Exception as e:  # a refusal, or a crash (two writers of one temporary file): the round goes on
            results.put(f"{type(e).__name__}: {e}")


def test_sweep_commands_started_together_all_claim_the_folder(tmp_path):
    """8 sweep commands released at once by a barrier, 50 times: each claim succeeds (the second used to see
    the first's logs/ and refuse a 'foreign' folder), and one sweep.json names the study."""
    import multiprocessing

    context = multiprocessing.get_context("fork")
    claimers, rounds = 8, 50
    barrier, results = context.Barrier(claimers), context.Queue()
    processes = [
        context.Process(target=claim_in_rounds, args=(barrier, str(tmp_path), rounds, results)) for _ in range(claimers)
    ]
    for p in processes:
        p.start()
    outcomes = [results.get(timeout=120) for _ in range(claimers * rounds)]
    for p in processes:
        p.join(timeout=60)
    refused = [o for o in outcomes if o != "claimed"]
    assert not refused, f"{len(refused)} of {len(outcomes)} claims refused, e.g. {refused[0]}"
    assert all(
        json.loads((tmp_path / f"round_{n}" / "sweep.json").read_text())["study_name"] == "sweep" for n in range(rounds)
    )


@pytest.mark.parametrize(
    "change, expected",
    [
        (
            {"space": {"learnin_rate": {"low": 0.1, "high": 0.2}}},
            "unknown key 'learnin_rate' (did you mean --learning_rate?)",
        ),
        ({"space": {"learning_rate": {"low": 0.2, "high": 0.1}}}, "space.learning_rate is an empty range"),
        ({"space": {"learning_rate": {"low": 0, "high": 0.1, "log": True}}}, "log: true, so low must be above 0"),
        ({"space": {"learning_rate": []}}, "space.learning_rate is an empty list of choices"),
        (
            {"space": {"learning_rate": {"low": -1.0, "high": 0.1}}},
            "learning_rate: must be a positive number, got -1.0",
        ),
        ({"space": {"output_dir": ["a", "b"]}}, "output_dir is set by the sweep for each trial"),
        ({"trials": 3}, "unknown key(s) trials"),
        (
            {"space": {"model": ["linear"]}},
            "train/regression.py refuses the sweep file's space.model = 'linear': unknown key "
            "'model'; regression.py --help lists the flags",
        ),
        ({"pruner": "percentile"}, "pruner 'percentile' is not one of median, hyperband, none"),
        ({"pruner": {"name": "median", "n_warmup": 3}}, "pruner median: "),
        ({"metric": "eval_acc"}, "metric eval_acc: train/regression.py evaluates eval_mse"),
        ({"script": "train/nope.py"}, "script train/nope.py does not exist"),
    ],
)
def test_a_bad_sweep_file_is_one_line_before_any_trial(tmp_path, change, expected):
    from train import sweep

    path = sweep_file(
        tmp_path,
        2,
        **{k: v for k, v in change.items() if k != "space"},
        **({"space": change["space"]} if "space" in change else {}),
    )
    with pytest.raises(UserError) as e:
        sweep.main(sweep.parse_args([str(path), "--output_dir", str(tmp_path / "out")]))
    assert expected in str(e.value), str(e.value)
    assert not (tmp_path / "out" / "trials").exists() or not any((tmp_path / "out" / "trials").iterdir())


def test_a_second_sweep_with_another_space_is_refused_on_the_same_study(tmp_path):
    from train import sweep
    from train.study.space import check_against_script, load_script, read_sweep

    def definition(path):
        found = read_sweep(path, {})
        check_against_script(found, load_script(found["script"]))
        return found

    out = tmp_path / "out"
    out.mkdir()
    args = sweep.parse_args([str(sweep_file(tmp_path, 2)), "--output_dir", str(out)])
    sweep.make_study(args, definition(args.sweep_file))
    sweep.make_study(args, definition(args.sweep_file))  # the same sweep joins
    other = definition(sweep_file(tmp_path, 2, {"learning_rate": {"low": 0.01, "high": 0.3}}))
    with pytest.raises(UserError, match="was started with another sweep"):
        sweep.make_study(args, other)


def test_a_sweep_ending_while_another_clears_dead_workers_files_is_no_traceback(tmp_path):
    """Sweep A ends (its worker lock file removed, then released) while sweep B clears the files of
    sweep processes that are gone (reclaim_interrupted), 300 rounds: B used to find the file free
    once A had removed it, remove it again and crash with FileNotFoundError."""
    import fcntl
    import random

    from races import race
    from train import sweep
    from train.study.trials import WorkerLock

    class NoTrials:
        def get_trials(self, deepcopy=False, states=None):
            return []

    def slow_flock(fd, operation, flock=fcntl.flock):  # a network file system's round trip
        time.sleep(0.0002)
        flock(fd, operation)

    def end(n, barrier):
        worker = WorkerLock(str(tmp_path / f"round_{n}"))
        barrier.wait()
        time.sleep(random.random() * 0.003)  # somewhere in B's clearing
        worker.release(remove=True)
        return "ended"

    def clear(n, barrier):
        fcntl.flock = slow_flock  # in this process only
        barrier.wait()
        for _ in range(20):
            sweep.reclaim_interrupted(NoTrials(), str(tmp_path / f"round_{n}"))
        return "cleared"

    rounds = 300
    ended, cleared = race([end, clear], rounds)
    crashed = [o for o in ended + cleared if o not in ("ended", "cleared")]
    assert not crashed, f"{len(crashed)} of {rounds} rounds crashed, e.g. {crashed[0]}"


def study_with(trials):
    """An in-memory study of `trials` finished trials whose learning rate varies."""
    import optuna
    from optuna.distributions import FloatDistribution

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(direction="minimize")
    for i in range(trials):
        study.add_trial(
            optuna.trial.create_trial(
                params={"learning_rate": 0.01 * (i + 1)},
                value=1.0 / (i + 1),
                distributions={"learning_rate": FloatDistribution(1e-4, 1)},
            )
        )
    return study


REPORTED = {"script": "train/regression.py", "direction": "minimize", "metric": "eval_mse"}


def test_two_sweeps_ending_together_each_write_a_whole_results_md(tmp_path, monkeypatch, capsys):
    """Two sweep commands end at once and write SWEEP_DIR/results.md, one knowing 40 trials and the
    other 30, 1000 rounds: the file must be one of the two, not the shorter one with the longer's tail."""
    from races import race
    from train.study import report

    def ending(trials):
        study = study_with(trials)

        def end(n, barrier):
            report.plots = lambda study, sweep_dir: []  # in this process only: the plots have their own test
            os.chdir(tmp_path)  # relative, so that the files compare with those written alone below
            os.makedirs(f"round_{n}", exist_ok=True)
            report.report(study, f"round_{n}", REPORTED)
            return "reported"

        return end

    rounds = 1000
    race([ending(40), ending(30)], rounds)
    monkeypatch.setattr(report, "plots", lambda study, sweep_dir: [])
    alone = {}
    for trials in (40, 30):
        monkeypatch.chdir(tmp_path / "round_0")  # any other folder
        os.makedirs(f"round_{trials}/round_0")
        monkeypatch.chdir(f"round_{trials}")
        report.report(study_with(trials), "round_0", REPORTED)
        alone[trials] = open("round_0/results.md").read()
    capsys.readouterr()
    mixed = [
        n
        for n in range(rounds)
        if (tmp_path / f"round_{n}" / "results.md").read_text().replace(f"round_{n}/", "round_0/") not in alone.values()
    ]
    assert not mixed, f"{len(mixed)} of {rounds} rounds left a results.md that neither sweep wrote"


def test_a_sweep_looking_at_the_plots_while_another_draws_them_sees_whole_pngs(tmp_path):
    """One sweep command redraws SWEEP_DIR's plots while another (or a user) reads them, each PNG's
    writing and the reading released together, 10 rounds: every read must be a whole PNG (the old
    one or the new), never the file just emptied or half written."""
    from PIL import Image

    from races import race
    from train.study import report

    study, names = study_with(5), ("optimization_history.png", "param_importances.png")
    report.plots(study, str(tmp_path))

    def draw(n, barrier):
        save = Image.Image.save  # what matplotlib's savefig calls to write a PNG, once drawn
        Image.Image.save = lambda image, *args, **kwargs: (barrier.wait(), save(image, *args, **kwargs))
        try:
            return len(report.plots(study, str(tmp_path)))
        finally:
            Image.Image.save = save

    def look(n, barrier):
        broken = 0
        for name in names:
            barrier.wait()
            deadline = time.monotonic() + 0.05
            while time.monotonic() < deadline:
                data = (tmp_path / name).read_bytes()
                broken += data.count(b"IEND") != 1 or not data.endswith(b"IEND\xaeB`\x82")
        return broken

    rounds = 10
    drawn, broken = race([draw, look], rounds)
    assert drawn == [2] * rounds, drawn
    assert not sum(broken), f"{sum(b > 0 for b in broken)} of {rounds} rounds read a PNG that was not whole"
    for name in names:
        Image.open(tmp_path / name).load()
