"""Whether a checkpoint may resume this run: it must go on with the run that was saved."""

from data.errors import fail


def check_same_run(path, meta, global_batch, train_samples, model_fingerprint=None):
    """The same batches per step (any process count whose per-process batch keeps the batch of one
    micro-step), the same training data and the same pretrained model (`model_fingerprint`: what a
    checkpoint without the frozen parameters needs back) as the run saved at `path` (its meta.json
    as `meta`)."""
    saved_model = (meta.get("args") or {}).get("model_fingerprint")
    if model_fingerprint and saved_model and saved_model != model_fingerprint:
        fail(
            f"{path} was saved fine-tuning another pretrained model than --model_name_or_path "
            f"{(meta.get('args') or {}).get('model_name_or_path')} holds now (its config or weights differ); resume "
            "with the model folder it was saved with, or start a new run"
        )
    saved, now = meta.get("global_batch"), global_batch

    def describe(b):
        return (
            f"{b['per_device_train_batch_size']} per process x {b['num_processes']} processes x "
            f"{b['gradient_accumulation_steps']} accumulation steps"
        )

    if saved and (
        saved["per_device_train_batch_size"] * saved["num_processes"]
        != now["per_device_train_batch_size"] * now["num_processes"]
        or saved["gradient_accumulation_steps"] != now["gradient_accumulation_steps"]
    ):
        fail(
            f"{path} was saved with a global batch of {describe(saved)}; this run has {describe(now)}, so its "
            "steps and data position would not be the saved run's. Resume with --per_device_train_batch_size "
            "x processes and --gradient_accumulation_steps as saved, or start a new run"
        )
    samples = meta.get("train_samples")
    if samples is not None and train_samples is not None and samples != train_samples:
        fail(
            f"{path} was saved training on {samples} samples per epoch; this run has {train_samples}: "
            "resume with the same data (and --max_train_samples), or start a new run"
        )
