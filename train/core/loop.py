"""What every training loop in train/ repeats, kept in one place: where the run stands (resume from
a checkpoint, data position), the batches it has left, step counting, the learning-rate schedule,
logging, evaluation at each epoch's end, checkpoints, and the run's outputs.

A script keeps its own loop in view: `for batch in loop.batches()`, its own step,
`loop.after_batch(loss)`, and `return loop.finish()` (the README's skeleton, which
tests/test_readme_script.py runs; SIGTERM is the loop's too: train/core/preemption.py).

One path for the end of an epoch and the end of the run (nanochat's `last_step`): each evaluates,
records and, when due, saves after the evaluation. A run resumed from its final checkpoint trains
no batch and goes down the same path, so it evaluates once and writes the same outputs.
"""

import math
import os
import time

from tqdm.auto import tqdm

from data.errors import fail
from data.loader import ShardedLoader, check_loader, own_worker_seed
from train.core.accelerator import gather_patiently
from train.core.best_model import BestModel, resolve_metric
from train.core.checkpoint import (
    CheckpointWriter,
    data_position,
    find_checkpoint,
    load_checkpoint,
    model_weights,
    sharded_checkpoints,
)
from train.core.failures import error_line
from train.core.loss_watch import LossWatch
from train.core.output_dir import (
    check_room,
    drop_replaced_run,
    release_output_dir,
    remove_written_since,
    size_in_words,
)
from train.core.preemption import Preempted, Preemption
from train.core.process import after_a_stop, on_teardown, resume_command
from train.core.resume import check_same_run
from train.core.schedule import make_scheduler, plan_steps, warmup_steps
from train.core.tracking import (
    MetricsLog,
    format_metrics,
    plot_metrics,
    readable_by_others,
    save_final,
    save_weights,
)


class TrainingLoop:
    """The state of one run and what happens between optimizer steps; the step itself is the script's.

    `args` is the script's parsed command line: the loop reads the shared flags (make_parser's) and,
    with schedule=True, add_optimizer_args' schedule flags; it records all of them in checkpoints
    and args.json. Without a schedule the optimizer keeps its learning rate. `metrics`: the names
    evaluate() returns that --metric_for_best_model may pick (default: the headline alone).
    `steps_per_batch`: each loader batch holds the data of that many whole optimizer steps (online
    RL: a step's prompts, whose answers the script generates and trains on in micro-batches); the
    loop then saves and stops only between two batches, where the data position is exact."""

    def __init__(
        self,
        accelerator,
        args,
        task,
        model,
        optimizer,
        train_loader,
        evaluate,
        headline="eval_loss",
        schedule=True,
        metrics=None,
        steps_per_batch=None,
    ):
        self.accelerator, self.args, self.task = accelerator, args, task
        self.model, self.optimizer, self.loader = model, optimizer, train_loader
        model.train()  # from_pretrained hands back a model in eval mode: no dropout until the first evaluation
        # LoRA: the best model's file and the final weights handed to save_model hold what trains, not the base
        self.frozen = any(not p.requires_grad for p in model.parameters())
        self.evaluate, self.headline = evaluate, headline
        self.output_dir, self.logging_steps, self.eval_steps = args.output_dir, args.logging_steps, args.eval_steps
        self.checkpointing_steps, self.keep_last = args.checkpointing_steps, args.checkpoints_total_limit
        self.writer = CheckpointWriter(
            accelerator, sharded_checkpoints(args.checkpoint_format, accelerator), args.checkpoint_async
        )
        check_loader(train_loader)
        own_worker_seed(train_loader)  # a resumed run's iterator draws nothing from dropout's generator
        self.sharded = isinstance(train_loader, ShardedLoader)  # keeps its own position; else set_epoch + skip
        self.global_batch_size = (
            args.per_device_train_batch_size * accelerator.num_processes * args.gradient_accumulation_steps
        )
        self.batches_per_epoch = len(train_loader)  # per process; before a resume shortens the sharded loader
        self.steps_per_batch = steps_per_batch
        self.max_train_steps, self.num_train_epochs = plan_steps(
            self.batches_per_epoch * (steps_per_batch or 1),
            1 if steps_per_batch else args.gradient_accumulation_steps,
            args.num_train_epochs,
            args.max_train_steps,
        )
        # stepped here once per optimizer step, so its state does not depend on the process count
        self.lr_scheduler = (
            accelerator.prepare(
                make_scheduler(
                    optimizer,
                    args.lr_scheduler_type,
                    warmup_steps(args.num_warmup_steps, args.warmup_ratio, self.max_train_steps),
                    self.max_train_steps,
                    args.lr_scheduler_kwargs,
                )
            )
            if schedule
            else None
        )
        self.t_start = self._t_log = time.perf_counter()  # _t_log: a bench may call after_batch alone
        self.train_seconds = 0.0
        self.step, self.epoch, self.batches_done, self.history, self.epoch_seconds = 0, 0, 0, [], []
        self.resumed_from = None
        self._resumed_seconds = 0.0  # the interrupted epoch's training time before the save
        self.losses = LossWatch(accelerator, optimizer, args.nonfinite_loss, args.output_dir)
        self._stop_at_epoch_end = False
        self._last_save = (None, None)  # (step, path)
        self.best = BestModel(
            accelerator,
            args.output_dir,
            resolve_metric(args.metric_for_best_model, headline, metrics or [headline]),
            args.greater_is_better,
            args.early_stopping_patience,
            args.early_stopping_threshold,
        )
        if path := find_checkpoint(accelerator, args.resume_from_checkpoint, args.output_dir):
            meta = load_checkpoint(accelerator, path, task, model, optimizer, self.lr_scheduler)
            check_same_run(
                path,
                meta,
                self._global_batch(),
                self._train_samples(),
                getattr(args, "model_fingerprint", None),
                getattr(args, "model_name_or_path", None),
            )
            self.losses.load_state_dict(meta.get("losses"))
            # a checkpoint of its early-stopping step comes back with best.stopped: the run only finishes
            self.best.load(meta.get("best"), path)
            self.resumed_from, self.step, self.history = path, meta["step"], meta.get("history", [])
            self.epoch_seconds, self._resumed_seconds = meta.get("epoch_seconds", []), meta.get("epoch_elapsed", 0.0)
            self.epoch, self.batches_done = meta["data"]["epoch"], meta["data"]["next_batch"]
            if self.sharded:
                train_loader.load_state_dict(meta["data"])
        self.first_step = self.step  # where this start began: a stop before any step trained nothing
        self._check_room()
        self.metrics = MetricsLog(accelerator, args.output_dir, args.with_tracking)
        self.metrics.start(task, vars(args), self.step)
        self.preemption = Preemption(accelerator)  # last: a failed resume above leaves SIGTERM as it was
        steps_per_epoch = (
            self.batches_per_epoch * steps_per_batch
            if steps_per_batch
            else math.ceil(self.batches_per_epoch / args.gradient_accumulation_steps)
        )
        accelerator.print(
            f"epochs={self.num_train_epochs} steps={self.max_train_steps} steps_per_epoch={steps_per_epoch}"
            + (f" resuming at step {self.step}" if self.resumed_from else "")
        )
        self.progress = tqdm(
            total=self.max_train_steps * self.global_batch_size,
            initial=self.step * self.global_batch_size,
            unit="samples",
            unit_scale=True,
            disable=not accelerator.is_local_main_process,
            dynamic_ncols=True,
            mininterval=0.5,
        )  # tqdm's default 0.1 s redraws cost a measurable part of a CPU step (docs/speed.md)

    def _check_room(self):
        """The disk holds what this run will write, before its first step (output_dir.check_room). An
        estimate from the model as it trains: the final model is every weight; a checkpoint the
        weights that train and AdamW's two moments of each (best_model.safetensors, linked into
        checkpoints, counts once)."""
        params = list(self.model.parameters())
        model_bytes = sum(p.numel() * p.element_size() for p in params)
        trained_bytes = sum(p.numel() * p.element_size() for p in params if p.requires_grad)
        every = self.checkpointing_steps
        if isinstance(every, int):
            planned = self.max_train_steps // every - self.step // every
        else:
            planned = self.num_train_epochs - self.epoch if every == "epoch" else 0
        kept = min(planned, self.keep_last) if self.keep_last else planned
        parts = [(f"the final model, {size_in_words(model_bytes)}", model_bytes)]
        if self.best.metric is not None:
            parts.append((f"the best model's weights, {size_in_words(trained_bytes)}", trained_bytes))
        if kept:
            parts.append((f"{kept} checkpoint(s) of {size_in_words(3 * trained_bytes)}", kept * 3 * trained_bytes))
        hint = " (or keep fewer checkpoints: --checkpoints_total_limit)" if kept > 1 else ""
        check_room(self.accelerator, self.output_dir, parts, hint)

    # ------------------------------------------------------------------------------ the batches
    def batches(self):
        """Every micro-batch the run has left, epoch after epoch, from where it stands: a new shuffle
        per epoch (the same on every rank), and after a resume exactly the batches not yet trained."""
        try:
            yield from self._batches()
        except BaseException:  # end the progress bar's line, so an error message starts on its own
            self.progress.close()
            self.preemption.failed()  # SIGTERM as before, but for the first process's line under a launcher
            raise

    def _batches(self):
        first_epoch, t_train = self.epoch, time.perf_counter()
        for epoch in range(first_epoch, self.num_train_epochs):
            if self.step >= self.max_train_steps or self.best.stopped:
                break
            self.loader.set_epoch(epoch)
            if not self.sharded and hasattr(self.loader.dataset, "set_epoch"):
                # accelerate hands the epoch to the sampler only; augmentations seeded by (epoch, sample) need it too
                self.loader.dataset.set_epoch(epoch)
            skip = self.batches_done if epoch == first_epoch else 0
            epoch_loader = self.loader
            if skip and not self.sharded:  # after set_epoch, so the skipped batches are this epoch's
                epoch_loader = self.accelerator.skip_first_batches(self.loader, skip)
            self.epoch, self.batches_done = epoch, skip
            # a resumed epoch counts its time before the checkpoint too, so its seconds and samples/s
            # describe the same work as an uninterrupted run's
            self._t_epoch = time.perf_counter() - (self._resumed_seconds if epoch == first_epoch else 0.0)
            self._t_log = time.perf_counter()
            for batch in epoch_loader:
                self.batches_done += 1
                yield batch
                if self.step >= self.max_train_steps or self.best.stopped:
                    break
            self.epoch_seconds.append(time.perf_counter() - self._t_epoch)
            if not self.best.stopped:  # else it stopped at a step's evaluation: nothing new to evaluate
                self._evaluate_and_save(epoch + 1, self.epoch_seconds[-1])
        if not self.history or self.history[-1]["step"] != self.step:  # resumed from a checkpoint at the last step
            self._evaluate_and_save(self.num_train_epochs, 0.0)
        self.train_seconds = time.perf_counter() - t_train

    def after_batch(self, loss):
        """Call after every micro-batch; returns True when it completed an optimizer step."""
        self.losses.add(loss, self.step + 1)
        if not self.accelerator.sync_gradients:
            return False
        self.step += 1
        lr = self.optimizer.param_groups[0]["lr"]  # the rate this step used
        if self.lr_scheduler is not None and not self.accelerator.optimizer_step_was_skipped:
            self.lr_scheduler.step()  # fp16 overflow: no step, no schedule tick
        self.progress.update(self.global_batch_size)
        if self.step % self.logging_steps == 0:  # mean loss of all processes since the last log
            train_loss = self.losses.mean()
            samples_per_second = self.logging_steps * self.global_batch_size / (time.perf_counter() - self._t_log)
            record = {"step": self.step, "train_loss": train_loss, "lr": lr, "samples_per_second": samples_per_second}
            skipped = self.losses.skipped_steps
            self.metrics.log({**record, **({"skipped_steps": skipped} if skipped else {})})
            self.progress.set_postfix(loss=f"{train_loss:.4f}", lr=f"{lr:.2e}", refresh=False)
            self._t_log = time.perf_counter()
        every = self.eval_steps  # mid-epoch evaluations, for runs shorter than an epoch
        if (
            every
            and self.step % every == 0
            and self.step < self.max_train_steps
            and self.batches_done < self.batches_per_epoch
        ):
            t_eval = time.perf_counter()
            self._record_evaluation(
                f"step {self.step}", {"epoch": round(self.epoch + self.batches_done / self.batches_per_epoch, 4)}
            )
            self._t_epoch += time.perf_counter() - t_eval  # the epoch's seconds are training seconds
        if not self._between_batches():  # a batch of several steps: its data position is exact only at its end
            return True
        if self._save_due() and self.batches_done < self.batches_per_epoch:  # at an epoch's end: after evaluating
            self.save()
        # the last step, or one that stopped early, just finishes the run
        if self.preemption.agreed(self.step) and self.step < self.max_train_steps and not self.best.stopped:
            if self.batches_done < self.batches_per_epoch:
                self._preempt()
            self._stop_at_epoch_end = True  # after the epoch's evaluation, as an uninterrupted run has it
        return True

    def _between_batches(self):
        return not self.steps_per_batch or self.step % self.steps_per_batch == 0

    def finished(self):
        """Whether the run has taken its last step (or stopped early): a script that takes several steps
        per batch stops its own inner loop here."""
        return self.step >= self.max_train_steps or self.best.stopped

    # ------------------------------------------------------------------------------ evaluation, checkpoints
    def _save_due(self):
        every = self.checkpointing_steps
        return isinstance(every, int) and self.step % every == 0

    def _record_evaluation(self, label, where, suffix=""):
        """Evaluate now; put the metrics in the history, metrics.jsonl and the trackers, and one line."""
        self.losses.check()
        metrics = self.evaluate()
        self.history.append({**where, "step": self.step, **metrics})
        self.metrics.log({"step": self.step, "epoch": where["epoch"], **metrics})
        self.best.update(metrics, self.step, lambda: model_weights(self.model, trainable_only=self.frozen))
        if self.accelerator.is_main_process:
            best = " (best so far)" if self.best.step == self.step and len(self.history) > 1 else ""
            self.progress.write(f"{label}: {format_metrics(metrics)}{suffix}{best}")
            if self.best.stopped:
                self.progress.write(self.best.stop_message())
        self._t_log = time.perf_counter()  # evaluation time is not training throughput

    def _evaluate_and_save(self, epoch, train_seconds):
        # --max_train_steps can end a run inside an epoch (an LM's usually does): say so
        label = f"epoch {epoch}"
        if self.batches_done < self.batches_per_epoch:
            label = (
                f"step {self.step} (end of the run, {self.batches_done} of epoch {epoch}'s "
                f"{self.batches_per_epoch} batches)"
            )
        self._record_evaluation(
            label, {"epoch": epoch, "train_seconds": train_seconds}, f" epoch_seconds={train_seconds:.1f}"
        )
        trained = train_seconds > 0  # not the evaluation of a run resumed at its end: nothing new to save
        if trained and (
            self.checkpointing_steps == "epoch" or (self._save_due() and self.batches_done >= self.batches_per_epoch)
        ):
            self.save()
        if self._stop_at_epoch_end and not self.best.stopped:
            self._preempt()

    def position(self):
        """Where the data stands, as checkpoints store it: valid for any world size when sharded."""
        if self.sharded:
            return self.loader.state_dict()
        return data_position(self.epoch, self.batches_done, self.batches_per_epoch)

    def save(self):
        self.losses.check(self.model, self.step)  # a checkpoint is only ever written of a sound model
        mid_epoch = self.batches_done < self.batches_per_epoch
        elapsed = time.perf_counter() - self._t_epoch if mid_epoch else 0.0
        meta = {
            "script": self.task,
            "data": self.position(),
            "args": vars(self.args),
            "history": self.history,
            "epoch_seconds": self.epoch_seconds,
            "epoch_elapsed": elapsed,
            "global_batch": self._global_batch(),
            "train_samples": self._train_samples(),
            "losses": self.losses.state_dict(),
            "best": self.best.state_dict(),
        }
        path = self.writer.save(
            self.output_dir,
            self.step,
            self.model,
            self.optimizer,
            self.lr_scheduler,
            meta,
            self.keep_last,
            self.best.save_into,
        )
        self._last_save = (self.step, path)
        return path

    def _preempt(self):
        """Every rank, at the same step: save here (unless this step was just saved), then stop."""
        self.progress.close()
        path = self._last_save[1] if self._last_save[0] == self.step else self.save()
        self.writer.wait()
        self.preemption.stopping()
        release_output_dir(self.output_dir)  # a clean stop: the resume takes a free folder, not a dead run's
        next_steps = after_a_stop(self.step > self.first_step, self.accelerator.is_local_main_process)
        raise Preempted(f"stopped on SIGTERM at step {self.step} of {self.max_train_steps}, saved {path}; {next_steps}")

    # ------------------------------------------------------------------------------ resume: the same run
    def _global_batch(self):
        return {
            "per_device_train_batch_size": self.args.per_device_train_batch_size,
            "num_processes": self.accelerator.num_processes,
            "gradient_accumulation_steps": self.args.gradient_accumulation_steps,
        }

    def _train_samples(self):
        if self.sharded:
            return self.loader.dataset.plan.num_samples
        dataset = getattr(self.loader, "dataset", None)
        return len(dataset) if dataset is not None and hasattr(dataset, "__len__") else None

    # ------------------------------------------------------------------------------ the end
    def samples_per_second(self):
        """Training samples per second of training time (evaluations and start-up left out)."""
        return self.step * self.global_batch_size / max(sum(self.epoch_seconds), 1e-9)

    def finish(self, extra=None, save_model=None):
        """Write model.safetensors, all_results.json (the last evaluation, timings, history and
        `extra`), args.json and curves.png; print the summary line; close the trackers and hand the
        folder back; return the results. `save_model(weights, output_dir)` writes the model instead
        (a Hugging Face folder, say), on the main process, before all_results.json marks the run
        finished; a model with frozen weights (LoRA) must have one, and it gets the weights that train. The
        process group goes in run(), once the script's objects are gone."""
        self.progress.close()
        self.writer.close()  # the last checkpoint written before the run counts as finished
        self.losses.check(self.model, self.step)  # no final model of a run whose numbers went bad
        # wall: since the loop was built, as printed below; train: from the first batch to the last
        # evaluation of this invocation; each epoch's training alone: epoch_seconds and history
        results = {
            **self.history[-1],
            "world_size": self.accelerator.num_processes,
            "global_batch_size": self.global_batch_size,
            "epoch_seconds": self.epoch_seconds,
            "wall_seconds": time.perf_counter() - self.t_start,
            "train_seconds": self.train_seconds,
            "history": self.history,
            "resumed_from": self.resumed_from,
            "train_samples_per_second": self.samples_per_second(),
            **({"skipped_steps": self.losses.skipped_steps} if self.losses.skipped_steps else {}),
            **({"stopped_early": True} if self.best.stopped else {}),
            **self.best.results(),
            **(extra or {}),
        }
        if self.frozen and save_model is None:
            raise ValueError("a model with frozen weights needs save_model: the run's weights hold only what trains")
        # the best evaluation's weights (already on disk) or the last step's (a collective under FSDP2)
        weights = model_weights(self.model, trainable_only=self.frozen) if self.best.step is None else None
        failed = self._write_model(weights, save_model) if self.accelerator.is_main_process else None
        # every rank waits for the main process's write, however long a large model takes, and hears how it went
        failed = gather_patiently(self.accelerator, failed)[0]
        if failed is not None:
            self._keep_what_trained(failed)
        save_final(self.accelerator, None, self.output_dir, results, vars(self.args))
        if self.accelerator.is_main_process:
            drop_replaced_run(self.output_dir)
            plot_metrics(self.output_dir, self.headline)  # on the main process only: a warning prints once
        headline = {k: results[k] for k in (self.headline, "eval_samples") if k in results}
        best = results.get("best_model", {"step": self.step})
        model = (
            "" if best["step"] == self.step else f" model=step {best['step']}'s ({best['metric']}={best['value']:.4f})"
        )
        self.accelerator.print(
            f"final {format_metrics(headline)}{model} wall_seconds={results['wall_seconds']:.1f} "
            f"(training {self.train_seconds:.1f}) samples_per_second="
            f"{results['train_samples_per_second']:.0f} -> {self.output_dir}"
        )
        self.accelerator.wait_for_everyone()
        self.metrics.finish()
        self._release()
        state = self.accelerator.state  # not the accelerator: it holds each model prepare() took
        on_teardown(lambda: (state.wait_for_everyone(), state.destroy_process_group()))
        return results

    def _write_model(self, weights, save_model):
        """On the main process: the run's model into output_dir, by `save_model` (a Hugging Face folder,
        say) or as model.safetensors. None when written; else the error's line, and what the failed
        write added to the folder is gone."""
        before = os.listdir(self.output_dir)
        try:
            if save_model is not None:
                save_model(self.best.read() if weights is None else weights, self.output_dir)
                readable_by_others(self.output_dir)  # the model folder's weights, whoever wrote them
                self.best.drop()
            elif weights is None:
                self.best.finish(self.output_dir)
            else:
                save_weights(weights, os.path.join(self.output_dir, "model.safetensors"))
        except Exception as e:  # whatever it is: the weights in memory must not go with it
            remove_written_since(self.output_dir, before)
            return error_line(e)
        return None

    def _keep_what_trained(self, failed):
        """Writing the model failed after training (a full disk, a model that refuses to be saved):
        every rank saves a checkpoint of this last step, unless there is one already, and stops
        with one line that says how to finish. That resume trains nothing; it writes the model from
        the checkpoint, bit for bit what this run would have written."""
        path = self._last_save[1] if self._last_save[0] == self.step else self.save()
        self.writer.wait()
        self.preemption.close()  # the agent's SIGTERM after the first process exits ends the others quietly
        fail(
            f"trained to step {self.step}, but writing the model into {self.output_dir} failed ({failed}); "
            f"the run's weights are in {path}; fix the cause, then finish with this command, which trains "
            f"nothing and writes the model: {resume_command()}"
        )

    def _release(self):
        """DDP's reducer holds gloo state: left for interpreter exit, it can abort a finished run
        (SIGABRT, "terminate called without an active exception"), so every reference to the prepared
        model must go before the process group does. The loop drops its own here; the script's, and the
        accelerator, which holds each model prepare() took, go with its main(). run() then collects
        them all in one full collection (each is slow once torch._dynamo and datasets are imported:
        docs/speed.md) and ends the group."""
        self.losses.close()
        self.preemption.close()
        self.model = self.optimizer = self.lr_scheduler = self.evaluate = None
        release_output_dir(self.output_dir)

    def close(self):
        """For code that drives the loop without finish() and run() (the benches): once it has deleted
        its own references to the prepared model, end here, the process group included. The accelerator
        lives on in the caller, so free_memory() empties its lists before its collection."""
        self._release()
        self.accelerator.free_memory()
        self.accelerator.wait_for_everyone()
        self.accelerator.end_training()
