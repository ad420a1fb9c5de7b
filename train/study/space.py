"""A sweep's definition: which script, which fixed flags, which search space, which metric; read
from a small YAML file and checked against the script's own flags before any trial runs.

    script: train/mnist.py
    accelerate_config: accelerate_configs/cpu_2proc.yaml   # optional: accelerate launch --config_file
    args: {num_train_epochs: 2}                            # flags every trial gets (as --config takes them)
    space:
      learning_rate: {low: 1.0e-3, high: 3.0e-2, log: true}
      num_warmup_steps: {low: 0, high: 300, step: 50}      # ints when low, high and step are ints
      model: [convnet_fast, convnet_wide]                  # a list: choices
    metric: eval_accuracy        # default: the script's headline metric (its METRICS[0])
    direction: maximize          # default: from the metric's name
    n_trials: 8
    pruner: median               # median (default), hyperband or none; or with Optuna's arguments:
                                 # {name: median, n_startup_trials: 3, n_warmup_steps: 400}
    seed: 0                      # the sampler's (TPE)
"""

import contextlib
import importlib.util
import io
import json
import os
import tempfile

from data.errors import fail
from train.core.best_model import lower_is_better

KEYS = {"script", "accelerate_config", "args", "space", "metric", "direction", "n_trials", "pruner", "seed"}
# flags the sweep decides for every trial: where it writes, how it resumes, what it reports
SWEEP_OWNS = {
    "output_dir",
    "resume_from_checkpoint",
    "overwrite_output_dir",
    "metric_for_best_model",
    "greater_is_better",
    "config",
}


def load_script(path):
    """The script as a module (its parse_args and METRICS), imported from its file as launch runs it."""
    if not os.path.isfile(path):
        fail(f"script {path} does not exist; name a training script, e.g. train/mnist.py")
    spec = importlib.util.spec_from_file_location("sweep_target_" + os.path.basename(path)[:-3], path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if not hasattr(module, "parse_args"):
        fail(f"{path} has no parse_args(argv): a sweep needs the scripts' command line (README: your own script)")
    return module


def read_sweep(path, overrides):
    """The sweep file as a dict, with `overrides` (the sweep command's own flags) on top, checked."""
    import yaml

    try:
        with open(path) as f:
            sweep = yaml.safe_load(f) or {}
    except OSError as e:
        fail(f"cannot read the sweep file {path} ({e.strerror})")
    except yaml.YAMLError as e:
        fail(f"{path} is not valid YAML ({' '.join(str(e).split())[:160]})")
    if not isinstance(sweep, dict):
        fail(f"{path}: expected a mapping with script, space, ...; see train/sweep.py --help")
    unknown = set(sweep) - KEYS
    if unknown:
        fail(f"{path}: unknown key(s) {', '.join(sorted(unknown))}; a sweep file has {', '.join(sorted(KEYS))}")
    sweep.update({k: v for k, v in overrides.items() if v is not None})
    for key in ("script", "space"):
        if not sweep.get(key):
            fail(f"{path}: no {key}; a sweep names its script and at least one flag to search")
    if not isinstance(sweep["space"], dict):
        fail(f"{path}: space must map flag names to ranges or lists of choices")
    sweep.setdefault("args", {})
    if not isinstance(sweep["args"], dict):
        fail(f"{path}: args must map flag names to values")
    taken = (set(sweep["space"]) | set(sweep["args"])) & SWEEP_OWNS
    if taken:
        fail(f"{path}: {', '.join(sorted(taken))} is set by the sweep for each trial; leave it out")
    both = set(sweep["space"]) & set(sweep["args"])
    if both:
        fail(f"{path}: {', '.join(sorted(both))} is both searched (space) and fixed (args); keep one")
    sweep["space"] = {name: _distribution(path, name, spec) for name, spec in sweep["space"].items()}
    sweep["pruner_spec"] = sweep.get("pruner", "median")
    sweep["pruner"] = _pruner(path, sweep["pruner_spec"])
    if sweep.get("direction") not in (None, "maximize", "minimize"):
        fail(f"{path}: direction {sweep['direction']!r} is not maximize or minimize")
    return sweep


PRUNERS = {"median": "MedianPruner", "hyperband": "HyperbandPruner", "none": "NopPruner"}


def _pruner(path, spec):
    """The Optuna pruner the sweep file names, with its arguments. Median by default, after 3 finished
    trials: with 2, a median of two early curves stopped 6 of 8 trials of the README's sweep."""
    import optuna

    options = dict(spec) if isinstance(spec, dict) else {"name": spec}
    name = options.pop("name", None)
    if name not in PRUNERS:
        fail(
            f"{path}: pruner {name!r} is not one of {', '.join(PRUNERS)} (a name, or a mapping with name: and the "
            "pruner's arguments)"
        )
    if name == "median":
        options.setdefault("n_startup_trials", 3)
    try:
        return getattr(optuna.pruners, PRUNERS[name])(**options)
    except (TypeError, ValueError) as e:
        fail(f"{path}: pruner {name}: {e}")


def _distribution(path, name, spec):
    """One flag's range as an optuna distribution; one line naming the flag if it is empty or unclear."""
    from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution

    if isinstance(spec, list):
        if not spec:
            fail(f"{path}: space.{name} is an empty list of choices")
        return CategoricalDistribution(spec)
    if not isinstance(spec, dict) or not {"low", "high"} <= set(spec) or set(spec) - {"low", "high", "log", "step"}:
        fail(
            f"{path}: space.{name} must be a list of choices or {{low: A, high: B}} with optional log: true or "
            f"step: S, got {spec!r}"
        )
    try:
        low, high = (float(spec[k]) if isinstance(spec[k], str) else spec[k] for k in ("low", "high"))
        step, log = spec.get("step"), bool(spec.get("log", False))
        if not low < high:
            fail(f"{path}: space.{name} is an empty range (low {low} is not below high {high})")
        if log and low <= 0:
            fail(f"{path}: space.{name} has log: true, so low must be above 0 (got {low})")
        if all(isinstance(v, int) and not isinstance(v, bool) for v in (low, high, step or 1)):
            return IntDistribution(low, high, log=log, step=step or 1)
        return FloatDistribution(float(low), float(high), log=log, step=None if step is None else float(step))
    except (TypeError, ValueError) as e:
        fail(f"{path}: space.{name}: {e}")


def check_against_script(sweep, module):
    """Every fixed flag and the ends of every range go through the script's own parser: a flag the
    script does not have, or a value it refuses, is one line before the first trial."""
    from optuna.distributions import CategoricalDistribution

    _parse(module, sweep["script"], sweep["args"], "args")
    for name, dist in sweep["space"].items():
        for value in dist.choices if isinstance(dist, CategoricalDistribution) else (dist.low, dist.high):
            _parse(module, sweep["script"], {**sweep["args"], name: value}, f"space.{name} = {value!r}")
    metrics = getattr(module, "METRICS", None)
    metric = sweep.get("metric") or (metrics[0] if metrics else None)
    if metric is None:
        fail(f"{sweep['script']} has no METRICS list; name the metric to optimize with metric: in the sweep file")
    if metrics and metric not in metrics and f"eval_{metric}" in metrics:
        metric = f"eval_{metric}"
    if metrics and metric not in metrics:
        fail(f"metric {metric}: {sweep['script']} evaluates {', '.join(metrics)}")
    sweep["metric"] = metric
    sweep["direction"] = sweep.get("direction") or ("minimize" if lower_is_better(metric) else "maximize")


def _parse(module, script, values, what):
    """`values` through the script's parser, as a trial's --config; `what` names them in the error."""
    import sys

    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(values, f)
    err, argv0 = io.StringIO(), sys.argv[0]
    sys.argv[0] = script  # the parser names the script in its messages ("train/mnist.py --help")
    try:
        with contextlib.redirect_stderr(err):
            module.parse_args(["--config", f.name])
    except SystemExit:
        message = err.getvalue().strip().splitlines()[-1] if err.getvalue().strip() else "refused"
        message = message.replace(f"error: --config {f.name}: ", "")
        fail(f"{script} refuses the sweep file's {what}: {message}")
    finally:
        sys.argv[0] = argv0
        os.remove(f.name)


def definition(sweep):
    """What makes two sweep commands the same study (compared when a second one joins)."""
    return json.dumps(
        {
            "script": os.path.normpath(sweep["script"]),
            "args": sweep["args"],
            "metric": sweep["metric"],
            "pruner": sweep["pruner_spec"],
            "direction": sweep["direction"],
            "space": {k: repr(v) for k, v in sorted(sweep["space"].items())},
        },
        sort_keys=True,
    )
