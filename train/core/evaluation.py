"""Evaluation that counts every held-out sample exactly once, whatever the number of processes."""

import math

import torch
import torch.nn.functional as F

from train.core.confusion import confusion_metrics
from train.models.gpt import next_token_loss


def average_buffers(accelerator, model):
    """Set floating-point buffers (BatchNorm running statistics) to their mean over ranks, so every
    rank evaluates and saves the same model, with statistics from all ranks' data."""
    if accelerator.num_processes > 1:
        with torch.no_grad():
            for buffer in accelerator.unwrap_model(model).buffers():
                if buffer.is_floating_point():
                    buffer.copy_(accelerator.reduce(buffer, reduction="mean"))


def evaluate_rows(accelerator, model, loader, per_row):
    """The mean over exactly the evaluation set of each metric that per_row(batch) returns as one
    value per row ({"loss": tensor of shape [rows], ...}), as {"eval_loss": ..., "eval_samples": N}.
    Both kinds of loader repeat rows so every process gets the same number of batches: a prepared
    map-style loader's repeats are dropped by gather_for_metrics, a sharded loader's by its `valid`
    mask; the caller needs to know neither. BatchNorm statistics are averaged over ranks first."""
    average_buffers(accelerator, model)
    model.eval()
    sums, count = {}, 0
    with torch.no_grad():
        for batch in loader:
            rows = {name: value.float() for name, value in per_row(batch).items()}
            some = next(iter(rows.values()))
            valid = (
                batch.get("valid", torch.ones_like(some, dtype=torch.bool))
                if isinstance(batch, dict)
                else torch.ones_like(some, dtype=torch.bool)
            )
            rows, valid = accelerator.gather_for_metrics((rows, valid))
            for name, value in rows.items():
                sums[name] = sums.get(name, 0) + (value * valid).sum()
            count += valid.sum()
    model.train()
    count = int(count)
    return {**{f"eval_{name}": (total / count).item() for name, total in sums.items()}, "eval_samples": count}


def evaluate_classifier(accelerator, model, loader, to_inputs=lambda images: images):
    """Accuracy and mean cross-entropy over exactly the evaluation set (batches of {"image", "label"})."""

    def per_row(batch):
        logits = model(to_inputs(batch["image"]))
        return {
            "accuracy": logits.argmax(-1) == batch["label"],
            "loss": F.cross_entropy(logits.float(), batch["label"], reduction="none"),
        }

    return evaluate_rows(accelerator, model, loader, per_row)


def evaluate_confusion(accelerator, model, loader, num_labels, logits_of):
    """{"eval_accuracy", "eval_f1" (macro), "eval_loss", "eval_samples", "eval_confusion" (a list of
    rows, true class by predicted)} over exactly the evaluation set for any process count, from a
    sharded loader's batches ("labels", and "valid" marking its padded repeats); logits_of(batch)
    gives the logits. Each rank counts its own rows; one reduce adds the counts, exact integers."""
    average_buffers(accelerator, model)
    model.eval()
    counts = torch.zeros(num_labels * num_labels, dtype=torch.long, device=accelerator.device)
    nats = torch.zeros((), dtype=torch.float64, device=accelerator.device)
    with torch.no_grad():
        for batch in loader:
            logits, labels, valid = logits_of(batch).float(), batch["labels"], batch["valid"]
            counts += torch.bincount(labels[valid] * num_labels + logits.argmax(-1)[valid], minlength=num_labels**2)
            nats += F.cross_entropy(logits[valid], labels[valid], reduction="sum").double()
    model.train()
    counts, nats = accelerator.reduce(counts, reduction="sum"), accelerator.reduce(nats, reduction="sum")
    confusion = counts.view(num_labels, num_labels).tolist()
    samples = sum(map(sum, confusion))
    metrics = {f"eval_{name}": value for name, value in confusion_metrics(confusion).items()}
    return {**metrics, "eval_loss": nats.item() / max(samples, 1), "eval_samples": samples, "eval_confusion": confusion}


def token_loss(accelerator, model, loader, logits_of):
    """(nats, tokens): the next-token loss summed over every scored label (not -100) of the evaluation
    set once, for any process count: the sharded loader's padded repeats (valid=False) are left out,
    and one reduce adds every rank's sums. logits_of(batch) gives the logits, of every position or of
    the last ones (response_logits), which are then scored against the last labels."""
    model.eval()
    totals = torch.zeros(2, dtype=torch.float64, device=accelerator.device)
    with torch.no_grad():
        for batch in loader:
            labels = batch["labels"].masked_fill(~batch["valid"][:, None], -100)
            logits = logits_of(batch)  # the last positions' only, where it leaves out a prompt's
            labels = labels[:, labels.shape[1] - logits.shape[1] :]
            nats = next_token_loss(logits, labels, reduction="sum")
            totals += torch.stack([nats.double(), (labels != -100).sum().double()])
    model.train()
    nats, tokens = accelerator.reduce(totals, reduction="sum").tolist()
    return nats, tokens


def evaluate_language_model(accelerator, model, loader, split):
    """Loss and bits per byte over every target of the validation windows once, for any process
    count (token_loss; the last window's padding is labelled -100). `split` is the manifest's record
    of the split (data/text.py): its UTF-8 bytes over its scored tokens turn nats per token into bits
    per byte, which compare across tokenizers."""
    nats, tokens = token_loss(accelerator, model, loader, lambda batch: model(batch["input_ids"]))
    scored_bytes = split["text_bytes"] * tokens / split["scored_tokens"]
    return {
        "eval_loss": nats / tokens,
        "eval_bpb": nats / math.log(2) / scored_bytes,
        "eval_perplexity": math.exp(min(nats / tokens, 50)),
        "eval_tokens": int(tokens),
    }


def evaluate_responses(accelerator, model, loader, logits_of):
    """Loss (nats per response token) and perplexity over every response token of the validation set
    once, for any process count; each token weighs the same, whatever example or batch it is in."""
    nats, tokens = token_loss(accelerator, model, loader, logits_of)
    return {"eval_loss": nats / tokens, "eval_perplexity": math.exp(min(nats / tokens, 50)), "eval_tokens": int(tokens)}
