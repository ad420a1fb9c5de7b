"""Whether a checkpoint may resume this run: it must go on with the run that was saved."""

from data.errors import fail


def check_same_run(path, meta, global_batch, train_samples, model_fingerprint=None, model_name=None):
    """The same batches per step (any process count whose per-process batch keeps the batch of one
    micro-step), the same training data and the same pretrained model (`model_fingerprint` of
    --model_name_or_path `model_name`: what a checkpoint without the frozen parameters needs back) as
    the run saved at `path` (its meta.json as `meta`)."""
    saved_args = meta.get("args") or {}
    saved_model, saved_name = saved_args.get("model_fingerprint"), saved_args.get("model_name_or_path")
    if model_fingerprint and saved_model and saved_model != model_fingerprint:
        if saved_name == model_name:
            fail(
                f"{path} was saved fine-tuning {saved_name}, whose config or weights have changed since; resume "
                "with the model as it was then, or start a new run"
            )
        fail(
            f"{path} was saved fine-tuning {saved_name}, another pretrained model than --model_name_or_path "
            f"{model_name} (a Hub model is known by its commit, a folder by its config and weights, so a Hub "
            f"model's copy in a folder counts as another); pass --model_name_or_path {saved_name}, or start a new run"
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
