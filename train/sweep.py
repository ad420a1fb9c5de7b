"""Find the best settings of any training script: an Optuna study whose trials are real
`accelerate launch` runs, pruned from their evaluations as they are written, resumable anywhere.

    python train/sweep.py train/configs/sweep_fashion_mnist.yaml --output_dir runs/sweeps/fashion_mnist

The sweep file names the script, its fixed flags and the search space (train/study/space.py). Each
trial gets SWEEP_DIR/trials/trial_NNNN/ (the run's output folder), trial_NNNN.yaml (its --config)
and SWEEP_DIR/logs/trial_NNNN.log. The study lives in SWEEP_DIR/study.log (Optuna's journal file)
or in --storage (a database URL or another journal file): sweep commands on other machines that
share SWEEP_DIR and the storage work on the same study. Stopped anywhere (Ctrl-C, SIGTERM, SIGKILL),
the same command goes on: finished trials are kept and the interrupted one resumes from its latest
checkpoint. At the end: SWEEP_DIR/results.md (the table), optimization_history.png,
param_importances.png; `optuna-dashboard SWEEP_DIR/study.log` shows the study live.
"""

import argparse
import os
import random
import shlex
import signal
import sys
import time
import warnings

if __package__ in (None, ""):  # run as a file: Python put train/ on sys.path, not the repo root
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from data.errors import UserError, fail
from train.core.tracking import write_json
from train.study.report import report
from train.study.space import check_against_script, definition, load_script, read_sweep
from train.study.trials import TrialRun, WorkerLock, owner_gone, wait_until_free

FAILURES_IN_A_ROW = 3  # then the search space or the script is broken, not one trial
CLAIM_LOCK = ".claim.lock"  # in the sweep folder: held while a command claims it, asks for a trial, ...


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "), allow_abbrev=False)
    parser.add_argument("sweep_file", help="YAML: script, args, space, metric, n_trials, ... (train/study/space.py)")
    parser.add_argument("--output_dir", required=True, help="The sweep's folder: trials, logs, study, results.")
    parser.add_argument(
        "--n_trials",
        type=int,
        help="Trials in the study, all sweep commands together (overrides the file's; default 10).",
    )
    parser.add_argument(
        "--storage",
        help="Optuna storage: a database URL (postgresql://, mysql://, sqlite:///) or a "
        "journal file path (default: OUTPUT_DIR/study.log).",
    )
    parser.add_argument("--study_name", default="sweep", help="The study's name in the storage.")
    parser.add_argument(
        "--accelerate_config", help="accelerate launch --config_file for every trial (overrides the file's)."
    )
    return parser.parse_args(argv)


def shown(storage):
    """A storage as printed and recorded in sweep.json: a database URL's password masked."""
    if storage and "://" in storage:
        from sqlalchemy.engine import make_url

        return make_url(storage).render_as_string(hide_password=True)
    return storage


def reach(storage):
    """A database must answer before the folder is claimed for it: a wrong URL, a missing driver or a
    database that is down is one line, and sweep.json never records a storage that did not work."""
    import sqlalchemy

    try:
        engine = sqlalchemy.create_engine(storage)
        engine.connect().close()
        engine.dispose()
    except (ImportError, sqlalchemy.exc.SQLAlchemyError) as e:
        hint = " (pip install -r requirements.txt: psycopg for postgresql://)" if isinstance(e, ImportError) else ""
        fail(f"cannot open the study's storage {shown(storage)}: {str(e).splitlines()[0]}{hint}")


def make_study(args, sweep):
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    storage = args.storage or os.path.join(args.output_dir, "study.log")
    if "://" not in storage:  # a journal file: safe for processes and machines sharing a file system
        from optuna.storages.journal import JournalFileBackend, JournalStorage

        storage = JournalStorage(JournalFileBackend(storage))
    study = optuna.create_study(
        storage=storage,
        study_name=args.study_name,
        direction=sweep["direction"],
        pruner=sweep["pruner"],
        load_if_exists=True,
    )
    mine, theirs = definition(sweep), study.user_attrs.get("definition")
    if theirs is None:
        study.set_user_attr("definition", mine)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # optuna marks it experimental
            study.set_metric_names([sweep["metric"]])  # what the dashboard and plots call the objective
    elif theirs != mine:
        fail(
            f"study {args.study_name!r} in {shown(args.storage) or storage} was started with another sweep (script, "
            f"args, space, metric or pruner differ: {theirs}); pass the same sweep file, or another --output_dir"
        )
    # the seed reproduces the study's first command; every later or parallel one draws its own numbers,
    # or it would replay the same settings (a sampler's random draws restart with each process)
    seed = sweep.get("seed")
    if seed is not None and (theirs is not None or study.get_trials(deepcopy=False)):
        seed = random.SystemRandom().randrange(2**31)
    study.sampler = optuna.samplers.TPESampler(seed=seed)
    return study


def claim_folder(args):
    """The sweep folder holds one study's trials (trial_0000 of another study would collide):
    SWEEP_DIR/sweep.json names it, written by the first sweep command.

    Checked and written under the folder's claim lock, so sweep commands started at the same moment
    (on one host or several sharing the folder) make one claim: whatever the first has already
    created (the lock, its study, trials/, logs/) is never mistaken for a foreign folder. A folder
    that is foreign before any lock is taken is refused without one of our files left in it."""
    import json

    marker = os.path.join(args.output_dir, "sweep.json")
    mine = {"study_name": args.study_name, "storage": shown(args.storage) or "study.log"}

    def foreign():  # what is there that no sweep wrote before its sweep.json (trials/, logs/ come after it)
        names = os.listdir(args.output_dir) if os.path.isdir(args.output_dir) else []
        # a study made ahead of the sweep in its default storage, study.log (and its lock), is welcome, and so
        # is sweep.json's temporary file, there while another command writes it
        return "sweep.json" not in names and not all(
            n.startswith(("study.log", CLAIM_LOCK, "sweep.json")) for n in names
        )

    def refuse():
        fail(
            f"{args.output_dir} is not empty and holds no sweep.json, so it is not a sweep's folder; pass another "
            "--output_dir"
        )

    if foreign():  # one listing: sweep.json appears (renamed into place) before anything else of a sweep's
        refuse()
    os.makedirs(args.output_dir, exist_ok=True)
    with claim_lock(args.output_dir):
        if os.path.isfile(marker):
            with open(marker) as f:
                theirs = json.load(f)
            if theirs != mine:
                fail(
                    f"{args.output_dir} holds the trials of study {theirs['study_name']!r} in {theirs['storage']}; "
                    "pass another --output_dir for another study"
                )
            return
        if foreign():  # a user's file that appeared meanwhile
            refuse()
        write_json(marker, mine)


def claim_lock(sweep_dir):
    from filelock import FileLock

    return FileLock(os.path.join(sweep_dir, CLAIM_LOCK))


def counts(study):
    """Trials finished (completed, pruned, or failed on their own), running, and queued."""
    from optuna.trial import TrialState

    trials = study.get_trials(deepcopy=False)
    done = sum(
        t.state in (TrialState.COMPLETE, TrialState.PRUNED)
        or (t.state == TrialState.FAIL and "failure" in t.user_attrs)
        for t in trials
    )
    return done, sum(t.state == TrialState.RUNNING for t in trials), sum(t.state == TrialState.WAITING for t in trials)


def reclaim_interrupted(study, sweep_dir):
    """RUNNING trials whose sweep process is gone: each ends as FAIL (without a "failure", so it does
    not count) and is queued again with its parameters, to resume in the same folder."""
    from optuna.trial import TrialState

    for trial in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        worker = trial.user_attrs.get("worker")
        # asked and given its worker under the claim lock that is held now: without one, its sweep died in between
        if worker is not None and not owner_gone(os.path.join(sweep_dir, worker)):
            continue
        root = trial.user_attrs.get("folder", trial.number)
        study.tell(trial.number, state=TrialState.FAIL, skip_if_finished=True)
        study.enqueue_trial(trial.params, user_attrs={"folder": root, "resumes": trial.number})
        print(f"trial {root}: its sweep process is gone; queued to resume from its latest checkpoint", flush=True)
    # the lock files of sweep processes that are gone and own no running trial any more
    folder = os.path.join(sweep_dir, "workers")
    owners = {t.user_attrs.get("worker") for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))}
    for name in os.listdir(folder) if os.path.isdir(folder) else []:
        if os.path.join("workers", name) not in owners and owner_gone(os.path.join(folder, name)):
            try:
                os.remove(os.path.join(folder, name))
            except FileNotFoundError:  # a sweep ending removes its own, outside the claim lock: gone since we looked
                pass


def trial_command(args, sweep, config, output_dir):
    launch = [sys.executable, "-m", "accelerate.commands.launch"]
    accelerate_config = args.accelerate_config or sweep.get("accelerate_config")
    if accelerate_config:
        launch += ["--config_file", accelerate_config]
    return [
        *launch,
        sweep["script"],
        "--config",
        config,
        "--output_dir",
        output_dir,
        "--resume_from_checkpoint",
        "latest",
        "--metric_for_best_model",
        sweep["metric"],
        "--greater_is_better",
        str(sweep["direction"] == "maximize").lower(),
    ]


def run_trial(args, sweep, study, trial, stopping):
    """One trial to its end: COMPLETE with the run's best metric, PRUNED, FAIL with its log's last
    line, or left RUNNING when the sweep is stopped (the next sweep command resumes it)."""
    import yaml
    from optuna.trial import TrialState

    root = trial.user_attrs.get("folder", trial.number)
    name = f"trial_{root:04d}"
    output_dir = os.path.join(args.output_dir, "trials", name)
    config = os.path.join(args.output_dir, "trials", name + ".yaml")
    # a trial checkpoints every epoch unless the sweep file says otherwise: what a resume starts from
    values = {"checkpointing_steps": "epoch", "checkpoints_total_limit": 1, **sweep["args"], **trial.params}
    if "resumes" not in trial.user_attrs and os.path.exists(output_dir):
        message = (
            f"{output_dir} exists, but trial {root} is new in this study: that folder is another study's; "
            "move it away or pass another --output_dir"
        )
        trial.set_user_attr("failure", message)
        study.tell(trial, state=TrialState.FAIL)  # failed, not interrupted: nothing resumes into that folder
        fail(message)
    with open(config, "w") as f:
        yaml.safe_dump(values, f, sort_keys=True)
    if not wait_until_free(output_dir):
        fail(f"{output_dir} is still held by the interrupted run's processes after 300 s; stop them, then rerun")
    print(
        f"trial {root}: {' '.join(f'{k}={v}' for k, v in trial.params.items())}"
        + (" (resuming)" if "resumes" in trial.user_attrs else ""),
        flush=True,
    )
    run = TrialRun(
        trial_command(args, sweep, config, output_dir), output_dir, os.path.join(args.output_dir, "logs", name + ".log")
    )
    reported, pruned = set(), False
    while run.poll() is None:
        if stopping and not pruned:
            run.stop(signal.SIGTERM)
            run.wait()
            return None
        for step, value in run.evaluations(sweep["metric"]):
            if step not in reported and not pruned:
                reported.add(step)
                trial.report(value, step)
                if trial.should_prune():
                    pruned = True
                    run.stop(signal.SIGINT)
        time.sleep(0.2)
    code = run.wait()
    if stopping and not pruned and code != 0:
        return None
    trial.set_user_attr("seconds", round(run.seconds(), 1))
    results = os.path.join(output_dir, "all_results.json")
    if pruned:
        study.tell(trial, state=TrialState.PRUNED)
        return "pruned"
    if code == 0 and os.path.isfile(results):
        import json

        with open(results) as f:
            value = json.load(f).get("best_model", {}).get("value")
        if value is not None:
            study.tell(trial, value)
            return "complete"
    trial.set_user_attr("failure", run.last_line())
    study.tell(trial, state=TrialState.FAIL)
    return "failed"


def main(args):
    sweep = read_sweep(args.sweep_file, {"n_trials": args.n_trials})
    check_against_script(sweep, load_script(sweep["script"]))
    if args.storage and "://" in args.storage:
        reach(args.storage)
    claim_folder(args)
    for folder in ("trials", "logs"):
        os.makedirs(os.path.join(args.output_dir, folder), exist_ok=True)
    with claim_lock(args.output_dir):  # two first commands at once: one sets the definition, one sees it
        study = make_study(args, sweep)
    n_trials = sweep.get("n_trials", 10)
    with claim_lock(args.output_dir):  # made and locked while no other sweep looks for dead owners' files
        worker = WorkerLock(args.output_dir)
    stopping = []  # a list, so the handler can set it from inside run_trial's loop

    def on_signal(signum, frame):
        stopping.append(signum)
        if len(stopping) > 1:  # asked twice: stop waiting (the trial still saves: its launcher gets SIGTERM)
            raise KeyboardInterrupt

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    failures, running_mine = 0, False  # whether a trial of this process is RUNNING in the study
    try:
        while not stopping:
            with claim_lock(args.output_dir):
                reclaim_interrupted(study, args.output_dir)
                done, running, queued = counts(study)
                if not queued and done + running >= n_trials:  # a queued trial (a resume, say) always runs
                    break
                trial = study.ask(sweep["space"])
                trial.set_user_attr("worker", worker.name)
                running_mine = True
            outcome = run_trial(args, sweep, study, trial, stopping)
            running_mine = outcome is None  # None: stopped, left RUNNING for the next command to resume
            failures = failures + 1 if outcome == "failed" else 0
            if outcome:
                print(f"trial {trial.user_attrs.get('folder', trial.number)}: {outcome}", flush=True)
            if failures >= FAILURES_IN_A_ROW:
                report(study, args.output_dir, sweep)
                fail(
                    f"{failures} trials in a row failed, the last with: {trial.user_attrs.get('failure')}; see "
                    f"{args.output_dir}/logs/"
                )
    finally:
        worker.release(remove=not running_mine)
    report(study, args.output_dir, sweep)
    if stopping:
        argv = [a.replace(args.storage, shown(args.storage)) if args.storage else a for a in sys.argv]
        print(
            f"sweep stopped; the interrupted trial saved a checkpoint. Rerun the same command to go on: "
            f"python {shlex.join(argv)}",
            flush=True,
        )
        sys.exit(128 + stopping[0])
    running = counts(study)[1]
    if running:
        print(f"{running} trial(s) still running in other sweep processes", flush=True)


if __name__ == "__main__":
    try:
        main(parse_args())
    except UserError as e:
        sys.stderr.write(f"error: {e}\n")
        sys.exit(1)
    except KeyboardInterrupt:
        sys.stderr.write(
            "stopped without waiting for the trial; it saves a checkpoint on its own. Rerun the same command to go on\n"
        )
        sys.exit(130)
