"""Evaluation that counts every held-out sample exactly once, whatever the number of processes."""
import torch
import torch.nn.functional as F

from train.accelerator import average_buffers


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
