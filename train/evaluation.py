"""Evaluation that counts every held-out sample exactly once, whatever the number of processes."""
import math

import torch
import torch.nn.functional as F

from train.accelerator import average_buffers
from train.gpt import next_token_loss


def evaluate_classifier(accelerator, model, loader, to_inputs=lambda images: images):
    """Accuracy and mean cross-entropy over exactly the evaluation set (batches of {"image", "label"}),
    with BatchNorm statistics averaged over ranks first. Both kinds of loader repeat samples so every
    process gets the same number of batches: gather_for_metrics drops them for a prepared map-style
    loader, the `valid` mask for a sharded one."""
    average_buffers(accelerator, model)
    model.eval()
    correct = loss_sum = count = 0
    with torch.no_grad():
        for batch in loader:
            logits = model(to_inputs(batch["image"]))
            losses = F.cross_entropy(logits.float(), batch["label"], reduction="none")
            valid = batch.get("valid", torch.ones_like(losses, dtype=torch.bool))
            preds, labels, losses, valid = accelerator.gather_for_metrics(
                (logits.argmax(-1), batch["label"], losses, valid))
            correct += ((preds == labels) & valid).sum()
            loss_sum += (losses * valid).sum()
            count += valid.sum()
    model.train()
    count = int(count)
    return {"eval_accuracy": (correct / count).item(), "eval_loss": (loss_sum / count).item(), "eval_samples": count}


def evaluate_language_model(accelerator, model, loader, split):
    """Loss and bits per byte over every target of the validation windows once, for any process
    count: the sharded loader's padded repeats (valid=False) and the last window's padding (label
    -100) are left out of both sums. `split` is the manifest's record of the split (data/text.py):
    its UTF-8 bytes over its scored tokens turn nats per token into bits per byte, which compare
    across tokenizers."""
    model.eval()
    totals = torch.zeros(2, dtype=torch.float64, device=accelerator.device)
    with torch.no_grad():
        for batch in loader:
            labels = batch["labels"].masked_fill(~batch["valid"][:, None], -100)
            nats = next_token_loss(model(batch["input_ids"]), labels, reduction="sum")
            totals += torch.stack([nats.double(), (labels != -100).sum().double()])
    model.train()
    nats, tokens = accelerator.reduce(totals, reduction="sum").tolist()
    scored_bytes = split["text_bytes"] * tokens / split["scored_tokens"]
    return {"eval_loss": nats / tokens, "eval_bpb": nats / math.log(2) / scored_bytes,
            "eval_perplexity": math.exp(min(nats / tokens, 50)), "eval_tokens": int(tokens)}
