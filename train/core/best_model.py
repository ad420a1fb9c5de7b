"""The best evaluation of a run, and stopping when evaluations stop improving.

--metric_for_best_model picks the metric (default: the script's headline metric), its direction
from its name unless --greater_is_better says; each evaluation better than the best so far writes
the weights to OUTPUT_DIR/best_model.safetensors, and at the end they become the run's
model.safetensors. --early_stopping_patience N ends the run after N evaluations in a row that do
not beat the best by more than --early_stopping_threshold (as HF's EarlyStoppingCallback: the
threshold decides patience only, the best weights are always the best).

Exact under any process count: the main process decides and every rank follows (the weights are a
collective under FSDP2), so all ranks write, stop and save at the same step. Resumable: every
checkpoint records the best so far and holds a hard link to its weights (no copy), because the
working file may already hold a later best of the run that was interrupted; a resume puts the
checkpoint's back.
"""

import difflib
import os
import shutil

from data.errors import fail
from train.core.tracking import atomic_write, save_weights

BEST_FILE = "best_model.safetensors"
# lower is better for these; HF's Trainer decides on "loss" alone, which gets perplexity wrong
LOWER_IS_BETTER = ("loss", "mse", "mae", "error", "perplexity", "bpb")


def lower_is_better(metric):
    """From the metric's name: rewards (eval_reward, eval_rewards/NAME/mean, DPO's eval_rewards/margins) are
    higher-is-better whatever a reward function is called (`format_error`, `length_loss`); else a loss-like
    word in the name means lower is better."""
    if metric.removeprefix("eval_").split("/")[0] in ("reward", "rewards"):
        return False
    return any(word in metric for word in LOWER_IS_BETTER)


def resolve_metric(name, headline, metrics):
    """--metric_for_best_model as the evaluation names it: 'accuracy' means 'eval_accuracy' (as in
    HF's Trainer); 'none' keeps no best model. One line naming what there is if it is neither."""
    if name is None:
        return headline
    if name == "none":
        return None
    for candidate in (name, f"eval_{name}"):
        if candidate in metrics:
            return candidate
    close = difflib.get_close_matches(name, metrics, n=1)
    fail(
        f"--metric_for_best_model {name}: the evaluation reports {', '.join(metrics)}"
        f"{f' (did you mean {close[0]}?)' if close else ''}; or pass none to keep the last step's weights"
    )


def link_or_copy(source, target):
    """target as a new name of source's file (atomic; a copy where the file system has no hard links)."""

    def write(tmp):
        try:
            os.link(source, tmp)
        except OSError:
            shutil.copyfile(source, tmp)

    if os.path.lexists(target + ".tmp"):
        os.remove(target + ".tmp")
    atomic_write(target, write)


class BestModel:
    def __init__(self, accelerator, output_dir, metric, greater_is_better=None, patience=None, threshold=0.0):
        if patience is not None and metric is None:
            fail("--early_stopping_patience needs a metric to watch; pass --metric_for_best_model (not none)")
        self.accelerator, self.path, self.metric = accelerator, os.path.join(output_dir, BEST_FILE), metric
        self.greater = (not lower_is_better(metric or "")) if greater_is_better is None else greater_is_better
        self.patience, self.threshold = patience, threshold
        self.step, self.value, self.metrics, self.bad_evaluations = None, None, None, 0

    def _beats(self, value, by=0.0):
        if self.value is None:
            return True
        return value > self.value + by if self.greater else value < self.value - by

    @property
    def stopped(self):
        """Whether patience ran out; restored on resume, so a run resumed from the checkpoint of its
        stopping step trains no more."""
        return self.patience is not None and self.bad_evaluations >= self.patience

    def update(self, metrics, step, weights):
        """After an evaluation (on every rank): keep these weights if they are the best so far
        (`weights()` gathers them: a collective under FSDP2); return True when the run should stop."""
        if self.metric is None:
            return False
        if self.metric not in metrics:
            fail(f"--metric_for_best_model {self.metric}: this evaluation reported {', '.join(metrics)}")
        value = metrics[self.metric]
        improved, enough = self._beats(value), self._beats(value, self.threshold)
        if self.accelerator.num_processes > 1:  # one decision, the main process's, whatever each rank computed
            from accelerate.utils import broadcast_object_list

            improved, enough = broadcast_object_list([improved, enough])
        self.bad_evaluations = 0 if enough else self.bad_evaluations + 1
        if improved:
            self.step, self.value, self.metrics = step, value, dict(metrics)
            state = weights()
            if self.accelerator.is_main_process:
                save_weights(state, self.path)
        return self.stopped

    def stop_message(self):
        direction = "higher" if self.greater else "lower"
        return (
            f"early stopping: {self.metric} has not improved ({direction} is better) for {self.bad_evaluations} "
            f"evaluations; best {self.value:.4f} at step {self.step}"
        )

    # ------------------------------------------------------------------------------ checkpoints
    def state_dict(self):
        return {
            "metric": self.metric,
            "greater_is_better": self.greater,
            "step": self.step,
            "value": self.value,
            "metrics": self.metrics,
            "bad_evaluations": self.bad_evaluations,
        }

    def save_into(self, folder):
        """On the main process, into a checkpoint being written: the best weights so far."""
        if self.step is not None:
            link_or_copy(self.path, os.path.join(folder, BEST_FILE))

    def load(self, state, checkpoint):
        """After loading `checkpoint` (on every rank): its best so far, and its weights back in place
        of whatever the interrupted run wrote later. A checkpoint kept for another metric starts anew."""
        main = self.accelerator.is_main_process
        if main and os.path.lexists(self.path):
            os.remove(self.path)
        if not state or state.get("step") is None or self.metric is None:
            return
        if (state["metric"], state["greater_is_better"]) != (self.metric, self.greater):
            self.accelerator.print(
                f"the checkpoint tracked the best {state['metric']}, this run {self.metric}: "
                "the best model is tracked from here on"
            )
            return
        if main:
            link_or_copy(os.path.join(checkpoint, BEST_FILE), self.path)
        self.step, self.value, self.metrics = state["step"], state["value"], state["metrics"]
        self.bad_evaluations = state["bad_evaluations"]

    # ------------------------------------------------------------------------------ the end
    def finish(self, output_dir):
        """On the main process: the best weights become model.safetensors. False without a best model
        (the caller then writes the last step's weights)."""
        if self.step is None:
            return False
        final = os.path.join(output_dir, "model.safetensors")
        link_or_copy(self.path, final)
        os.remove(self.path)
        return True

    def read(self):
        """On the main process: the best weights, read back (for a script that writes its model itself).
        Their file stays until drop(): should that write fail, the checkpoint saved then holds them."""
        from safetensors.torch import load_file

        return load_file(self.path)

    def drop(self):
        """On the main process, once the model written from read()'s weights is in place."""
        if self.step is not None and os.path.lexists(self.path):
            os.remove(self.path)

    def results(self):
        if self.step is None:
            return {}
        return {
            "best_model": {
                "metric": self.metric,
                "greater_is_better": self.greater,
                "step": self.step,
                "value": self.value,
                "metrics": self.metrics,
            }
        }
