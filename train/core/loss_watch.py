"""The training loss between two logs, and the guard that a run's numbers are still numbers.

Losses are kept detached on the device and only looked at when the run syncs anyway (a log, an
evaluation, a checkpoint, the end), so the guard costs no sync per step. A non-finite loss stops the
run on every rank at the same point with one line, before anything of the bad model is saved; with
--nonfinite_loss skip, an optimizer step whose gradients are not finite on some rank changes
nothing instead (that check is a sync per step, which is why it is not the default).
"""

import torch
from accelerate.utils import gather_object

from data.errors import fail
from train.core.output_dir import list_checkpoints


class LossWatch:
    def __init__(self, accelerator, optimizer, mode, output_dir):
        self.accelerator, self.mode, self.output_dir = accelerator, mode, output_dir
        self.losses, self.steps = [], []  # since the last log, with the optimizer step each belongs to
        self.skipped_steps = 0
        self._hook = optimizer.optimizer.register_step_pre_hook(self._skip_step) if mode == "skip" else None

    def add(self, loss, step):
        self.losses.append(loss.detach())
        self.steps.append(step)

    def mean(self):
        """Mean of every process's losses since the last log, which it then forgets (non-finite ones,
        which only `skip` lets through, are left out)."""
        losses = self._stacked()
        finite = torch.isfinite(losses)
        total = self.accelerator.reduce(
            torch.stack([torch.where(finite, losses, 0.0).sum(), finite.sum().float(), (~finite).sum().float()]),
            reduction="sum",
        ).tolist()
        if total[2] and self.mode == "stop":
            self._stop_nonfinite(losses)
        self.losses, self.steps = [], []
        return total[0] / total[1] if total[1] else float("nan")

    def check(self, model=None, step=None):
        """Before an evaluation, a checkpoint or the final model: every loss since the last log is
        finite (and every parameter of `model`), on every rank; one collective."""
        device = self.accelerator.device
        losses = self._stacked() if self.losses else None
        bad_loss = (
            (~torch.isfinite(losses)).sum().float()
            if losses is not None and self.mode == "stop"
            else torch.zeros((), device=device)
        )
        bad_weights = torch.zeros((), device=device)
        for p in model.parameters() if model is not None else ():
            p = p.detach()
            p = p.to_local() if hasattr(p, "to_local") else p  # FSDP2: this rank's shard; the reduce adds the rest
            bad_weights = bad_weights + (~torch.isfinite(p)).sum().float().to(device)
        bad = self.accelerator.reduce(torch.stack([bad_loss.to(device), bad_weights]), reduction="sum").tolist()
        if bad[0]:
            self._stop_nonfinite(losses)
        if bad[1]:
            self._stop(f"the model's weights are no longer finite at step {step}", skip_hint=False)

    # ------------------------------------------------------------------------------ checkpoints
    def state_dict(self):
        """Every rank's losses since the last log (a collective): the first log after a resume
        averages the same steps as the uninterrupted run's."""
        values = [float(x) for x in self._stacked().tolist()] if self.losses else []
        return {"values": gather_object([values]), "steps": self.steps, "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state):
        """With the same process count each rank takes its own losses back (the log then equals an
        uninterrupted run's bit for bit); with another the main process takes them all (the same
        mean, up to rounding)."""
        if not state:
            return
        self.skipped_steps = state.get("skipped_steps", 0)
        values, steps = state["values"], state["steps"]
        if len(values) == self.accelerator.num_processes:
            mine = values[self.accelerator.process_index]
        elif self.accelerator.is_main_process:
            mine, steps = [v for rank in values for v in rank], steps * len(values)
        else:
            mine, steps = [], []
        # strict JSON stored a non-finite loss as null
        self.losses = [torch.tensor(float("nan") if v is None else v, device=self.accelerator.device) for v in mine]
        self.steps = list(steps)

    def close(self):
        if self._hook is not None:
            self._hook.remove()

    # ------------------------------------------------------------------------------ internals
    def _stacked(self):
        return torch.stack([loss.float() for loss in self.losses])

    def _stop_nonfinite(self, losses):
        # the first non-finite loss over all ranks: its step, and its value where this rank saw it
        steps = torch.tensor(self.steps, device=losses.device, dtype=torch.float64)
        first = torch.where(torch.isfinite(losses), torch.inf, steps).min().reshape(1)
        step = int(self.accelerator.gather(first).min().item())
        local = losses[~torch.isfinite(losses)]
        self._stop(
            f"the training loss became non-finite at step {step}" + (f" ({local[0].item()})" if len(local) else "")
        )

    def _stop(self, what, skip_hint=True):
        found = list_checkpoints(self.output_dir)
        kept = f"the last checkpoint, {found[-1]}, was saved before it" if found else "no checkpoint was saved"
        fail(
            f"{what}: stopping, with no final model written; {kept}. Usual causes: a learning rate too high "
            "for this model and batch (--learning_rate), fp16 overflow (bf16 or fp32 avoid it), NaN or infinite "
            "values in the data" + (". To skip such steps instead, pass --nonfinite_loss skip" if skip_hint else "")
        )

    def _skip_step(self, optimizer, args, kwargs):
        """An optimizer pre-step hook: gradients that are not finite on some rank are dropped on every
        rank, so the optimizer skips every parameter, moments and weight decay included."""
        grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        bad = torch.zeros((), device=self.accelerator.device)
        if grads:
            bad = (~torch.isfinite(torch.nn.utils.get_total_norm(grads))).float().to(bad.device)
        if self.accelerator.reduce(bad, reduction="sum").item():
            for group in optimizer.param_groups:
                for p in group["params"]:
                    p.grad = None
            self.skipped_steps += 1
