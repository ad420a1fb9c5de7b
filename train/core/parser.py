"""The machinery of every train/ script's command line: the argument parser (flags in --help groups,
each with its default; no abbreviations; errors as one line with a did-you-mean, printed once per
launch; `--config FILE` read under the command line), and the value types its flags take. Which flags
the scripts share is train/core/flags.py."""

import argparse
import difflib
import json
import math
import sys

from train.core.process import exit_once, first_local_process

GROUPS = (
    ("data", "data"),
    ("model", "model"),
    ("optimization", "optimization"),
    ("checkpoints", "output and checkpoints"),
    ("tracking", "logging and tracking"),
    ("hardware", "hardware and precision"),
)


def positive_int(text):
    """argparse type: an int >= 1, so `--per_device_train_batch_size 0` fails at parse time."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def _finite_float(text, zero_ok):
    """argparse type behind positive_float and non_negative_float: a finite number (nan and inf are
    refused), above 0, or at least 0 with `zero_ok`."""
    what = "a number >= 0" if zero_ok else "a positive number"
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
    if not (value >= 0 if zero_ok else value > 0) or not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be {what}, got {text}")
    return value


def positive_float(text):
    return _finite_float(text, zero_ok=False)


def non_negative_float(text):
    return _finite_float(text, zero_ok=True)


def true_or_false(text):
    if str(text).lower() in ("true", "1", "yes"):
        return True
    if str(text).lower() in ("false", "0", "no"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def fraction(text):
    """argparse type: a number in [0, 1)."""
    value = non_negative_float(text)
    if value >= 1:
        raise argparse.ArgumentTypeError(f"must be below 1, got {value}")
    return value


def json_object(text):
    """argparse type: a JSON object, as a dict (a --config file may give the mapping itself)."""
    try:
        value = json.loads(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a JSON object such as '{{\"name\": 1}}', got {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object such as '{{\"name\": 1}}', got {text!r}")
    return value


def steps_or_epoch(text):
    return "epoch" if text == "epoch" else positive_int(text)


# what other scripts call our flags: `--lr` is too far from `--learning_rate` for a spelling match
ALIASES = {
    "--lr": "--learning_rate",
    "--epochs": "--num_train_epochs",
    "--num_epochs": "--num_train_epochs",
    "--batch_size": "--per_device_train_batch_size",
    "--train_batch_size": "--per_device_train_batch_size",
    "--eval_batch_size": "--per_device_eval_batch_size",
    "--warmup_steps": "--num_warmup_steps",
    "--max_steps": "--max_train_steps",
    "--num_workers": "--dataloader_num_workers",
    "--resume": "--resume_from_checkpoint",
    "--fp16": "--mixed_precision",
    "--bf16": "--mixed_precision",
}


# flags of transformers' and TRL's scripts that users try here, and why there are none
NEVER_UPLOADS = (
    "this project never uploads; when the run is done, upload OUTPUT_DIR yourself: hf upload ORG/NAME OUTPUT_DIR"
)
UNSUPPORTED = {
    "--push_to_hub": NEVER_UPLOADS,
    "--hub_model_id": NEVER_UPLOADS,
    "--hub_token": NEVER_UPLOADS,
    "--hub_strategy": NEVER_UPLOADS,
    "--hub_private_repo": NEVER_UPLOADS,
}


class _HelpFormatter(argparse.HelpFormatter):
    """Shows each flag's default, except for switches and unset values, where it says nothing."""

    def _get_help_string(self, action):
        if action.default in (None, True, False, argparse.SUPPRESS) or "%(default)" in (action.help or ""):
            return action.help
        return f"{action.help} (default: %(default)s)"


# what a run records in args.json but a config file does not decide: where this invocation resumes
# from, whether it replaces a run, and which file it read
PER_INVOCATION = ("config", "resume_from_checkpoint", "overwrite_output_dir")


class Parser(argparse.ArgumentParser):
    """argparse with the flags grouped (`parser.groups["data"]`, ...), defaults in --help, no
    abbreviations (`--lr` must not silently mean `--lr_scheduler_type`), errors as one line, and
    `--config FILE`: a YAML or JSON mapping of flag names to values, under the command line's own."""

    def __init__(self, doc):
        super().__init__(description=doc.split("\n")[0], allow_abbrev=False, formatter_class=_HelpFormatter)
        self.add_argument(
            "--config",
            type=str,
            default=None,
            help="YAML or JSON file of flag values (keys are flag names without --); flags on the "
            "command line override it. A run's args.json reruns that run.",
        )
        self.groups = {key: self.add_argument_group(title) for key, title in GROUPS}
        self.recorded = set()  # values a script derives after parsing and records in args.json (not flags)

    def error(self, message):
        if message.startswith("unrecognized arguments:"):
            for word in message.split(":", 1)[1].split():
                if word.split("=")[0] in UNSUPPORTED:
                    exit_once(f"error: {word.split('=')[0]}: {UNSUPPORTED[word.split('=')[0]]}", 2)
                close = self._did_you_mean(word.split("=")[0]) if word.startswith("--") else ""
                if close:
                    message += close
                    break
        exit_once(f"error: {message}; see {self.prog} --help", 2)

    def _did_you_mean(self, flag):
        known = [s for action in self._actions for s in action.option_strings if s not in ("-h", "--help")]
        close = [ALIASES[flag]] if ALIASES.get(flag) in known else difflib.get_close_matches(flag, known, 1, 0.75)
        return f" (did you mean {close[0]}?)" if close else ""

    def parse_args(self, args=None, namespace=None):
        argv = sys.argv[1:] if args is None else list(args)
        path = None  # the last --config, as argparse records it; without a value argparse says so
        for i, a in enumerate(argv):
            if a.startswith("--config="):
                path = a.split("=", 1)[1]
            elif a == "--config" and i + 1 < len(argv):
                path = argv[i + 1]
        if path:
            self.set_defaults(**self._read_config(path))
        return super().parse_args(argv, namespace)

    def _read_config(self, path):
        """The file's values, each checked as its flag would check it on the command line."""

        def bad(message):
            exit_once(f"error: --config {path}: {message}", 2)

        try:
            with open(path) as f:
                text = f.read()
        except OSError as e:
            bad(f"cannot read it ({e.strerror}); pass a YAML or JSON file of flag values")
        import yaml  # YAML 1.1 reads JSON too

        try:
            values = json.loads(text) if path.endswith(".json") else yaml.safe_load(text)
        except (ValueError, yaml.YAMLError) as e:  # both say where
            bad(f"not valid {'JSON' if path.endswith('.json') else 'YAML'} ({' '.join(str(e).split())[:160]})")
        if values is None:
            return {}
        if not isinstance(values, dict):
            bad("expected a mapping of flag names to values, e.g. learning_rate: 0.001")
        by_dest = {a.dest: a for a in self._actions if a.option_strings}
        by_flag = {s[2:]: a for a in self._actions for s in a.option_strings if s.startswith("--")}
        out, ignored = {}, []
        for key, value in values.items():
            key = str(key).lstrip("-").replace("-", "_")
            if key in PER_INVOCATION or key in ("help",):
                if value not in (None, False) and key != "config":
                    ignored.append(key)
                continue
            if key in self.recorded:
                out[key] = value
                continue
            action = by_dest.get(key) or by_flag.get(key)
            if action is None:
                bad(f"unknown key {key!r}{self._did_you_mean('--' + key)}; {self.prog} --help lists the flags")
            out[action.dest] = self._config_value(action, key, value, bad)
        if ignored and first_local_process():
            print(
                f"note: --config {path} sets {', '.join(ignored)}; a config file does not resume or replace a "
                "run, pass those on the command line",
                flush=True,
            )
        return out

    @staticmethod
    def _config_value(action, key, value, bad):
        if action.nargs == 0:  # a switch: store_true, or --no_X storing False into X
            if not isinstance(value, bool):
                bad(f"{key} takes true or false, got {value!r}")
            return value if action.dest == key else (action.const if value else action.default)
        if action.type is true_or_false and isinstance(value, bool):
            return value
        if action.type is json_object and isinstance(value, dict):  # a mapping in the file itself
            return value
        if value is None:
            if action.default is not None:
                bad(f"{key} cannot be null; leave it out for its default ({action.default})")
            return None
        if isinstance(value, (dict, bool)) or (isinstance(value, list) and action.nargs in (None, "?")):
            bad(f"{key} takes {'a list of values' if action.nargs else 'one value'}, got {value!r}")
        if action.nargs in ("+", "*") and not isinstance(value, list):
            value = [value]  # train_file: notes.txt means [notes.txt], as on the command line
        items = value if isinstance(value, list) else [value]
        try:
            items = [action.type(str(v)) if action.type else str(v) for v in items]
        except (argparse.ArgumentTypeError, ValueError, TypeError) as e:
            bad(
                f"{key}: {e}"
                if isinstance(e, argparse.ArgumentTypeError)
                else f"{key} expects {getattr(action.type, '__name__', 'a value')}, got {value!r}"
            )
        for v in items:
            if action.choices is not None and v not in action.choices:
                bad(f"{key}: {v!r} is not one of {', '.join(map(str, action.choices))}")
        return items if action.nargs in ("+", "*") else items[0]
