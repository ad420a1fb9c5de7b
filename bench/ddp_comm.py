"""How much of a DDP training step is the gradient all-reduce: `make train`'s step with it and without.

    python bench/ddp_comm.py             # about a minute on 2 cores
    python bench/ddp_comm.py --tiny      # seconds; what the test suite runs

Two copies of the recipe's model (train/configs/fashion_mnist.yaml: convnet_mlp, 64 samples per
process, fused AdamW, the precision `auto` picks) live in the same processes of
accelerate_configs/cpu_2proc.yaml, both prepared by the accelerator as train/mnist.py prepares its
own. One trains as DDP does; the other has a communication hook that hands each gradient bucket back
untouched, so it runs DDP's bookkeeping but sends nothing (its processes drift apart: timing only).
They take turns of 20 steps (A/B, then B/A) on the same batches. The step without the all-reduce is
what a process computes; the difference is what the all-reduce costs, waiting for the slower process
included. The same processes then time all_reduce alone: of one number (the latency) and of a
tensor the size of the model's gradients.
"""

import argparse
import gc
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.harness import FASHION_DIR, add_worker_flags, flag, print_result, ratio_line, run_workers, time_turns

STEPS_PER_TURN = 20
TINY_STEPS_PER_TURN = 2  # --tiny: a step already moves the weights of the model without the all-reduce apart


def worker(args):
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.utils.data import DataLoader

    from bench.harness import Batches
    from data import identity_collate, load_mnist, normalize_images
    from train import mnist
    from train.core.accelerator import make_accelerator

    script_args = mnist.parse_args(
        [
            "--config",
            "train/configs/fashion_mnist.yaml",
            "--output_dir",
            args.log_dir,
            "--mixed_precision",
            args.mixed_precision,
        ]
    )
    accelerator = make_accelerator(script_args)
    train_set, _, _ = load_mnist("fashion_mnist", args.data_dir)
    if args.tiny:
        train_set = train_set.subset(2000)
    batch = script_args.per_device_train_batch_size
    steps_per_turn = TINY_STEPS_PER_TURN if args.tiny else STEPS_PER_TURN

    def to_inputs(images):
        return normalize_images(images, train_set.mean, train_set.std).contiguous(memory_format=torch.channels_last)

    def setup(skip_all_reduce):
        torch.manual_seed(0)  # the same initial weights for both
        model = mnist.ConvNet(**mnist.MODELS[script_args.model]).to(memory_format=torch.channels_last)
        optimizer = torch.optim.AdamW(model.parameters(), lr=script_args.learning_rate, fused=True)
        loader = DataLoader(train_set, batch_size=batch, shuffle=True, drop_last=True, collate_fn=identity_collate)
        model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
        if skip_all_reduce:

            def keep_local(state, bucket):  # DDP's hook signature: a Future of the bucket's reduced gradients
                done = torch.futures.Future()
                done.set_result(bucket.buffer())
                return done

            model.register_comm_hook(None, keep_local)
        batches = Batches(loader, loader.set_epoch)

        def turn():
            for _ in range(steps_per_turn):
                data = batches.next()
                loss = F.cross_entropy(
                    model(to_inputs(data["image"])), data["label"], label_smoothing=script_args.label_smoothing
                )
                accelerator.backward(loss)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)

        return model, turn

    model, with_all_reduce = setup(False)
    local_model, without = setup(True)
    turns = 2 if args.tiny else args.turns
    for turn in (with_all_reduce, without):  # warm-up: first steps allocate and pick kernels
        turn()
    ms = time_turns(
        {"with all-reduce": with_all_reduce, "without": without},
        turns,
        accelerator.wait_for_everyone,
        steps_per_turn=steps_per_turn,
    )

    def latency_ms(tensor, repeats):
        for _ in range(5):
            dist.all_reduce(tensor)
        accelerator.wait_for_everyone()
        start = time.perf_counter()
        for _ in range(repeats):
            dist.all_reduce(tensor)
        return 1000 * (time.perf_counter() - start) / repeats

    def same_on_every_process(m):  # the weights' checksum, compared across processes
        total = torch.stack([p.detach().double().sum() for p in m.parameters()]).sum().reshape(1)
        return len(set(accelerator.gather(total).tolist())) == 1

    in_step = {"with all-reduce": same_on_every_process(model), "without": same_on_every_process(local_model)}
    numel = sum(p.numel() for p in model.parameters())
    repeats = 20 if args.tiny else 300
    alone = {
        "1 number": latency_ms(torch.zeros(1), repeats),
        f"{numel:,} numbers (the gradients)": latency_ms(torch.zeros(numel), repeats),
    }
    result = {
        "ms": ms,
        "alone": alone,
        "in_step": in_step,
        "precision": accelerator.mixed_precision,
        "processes": accelerator.num_processes,
        "batch": batch,
        "backend": dist.get_backend(),
        "steps_per_turn": steps_per_turn,
    }
    if accelerator.is_main_process:
        print_result(result)
    # DDP's reducers hold gloo state: every reference (the accelerator keeps its own) goes before the group
    del model, local_model, with_all_reduce, without
    accelerator.free_memory()
    gc.collect()
    accelerator.end_training()


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data_dir", default=FASHION_DIR)
    parser.add_argument("--turns", type=int, default=24, help="Turns of 20 steps for each of the two.")
    parser.add_argument(
        "--tiny",
        action="store_true",
        help=f"2000 samples, 2 turns of {TINY_STEPS_PER_TURN} steps: checks the bench runs",
    )
    parser.add_argument("--mixed_precision", choices=["auto", "no", "bf16"], default="auto")
    add_worker_flags(parser)
    args = parser.parse_args(argv)
    if args.worker:
        return worker(args)
    result = run_workers(
        __file__,
        [
            "--data_dir",
            args.data_dir,
            "--mixed_precision",
            args.mixed_precision,
            "--turns",
            str(args.turns),
            *flag("tiny", args.tiny),
        ],
    )
    ms = result["ms"]
    print(
        f"{result['processes']} processes ({result['backend']}), {result['batch']} samples per process, "
        f"mixed_precision={result['precision']}, {len(ms['without'])} turns of {result['steps_per_turn']} steps each"
    )
    print("\n| step | ms per step (median of turns) | turns |\n|---|---|---|")
    for name, values in ms.items():
        print(f"| {name} | {statistics.median(values):.2f} | {', '.join(f'{v:.1f}' for v in values)} |")
    cost = statistics.median(ms["with all-reduce"]) - statistics.median(ms["without"])
    print(
        f"\nthe all-reduce: {cost:.2f} ms per step, "
        f"{100 * cost / statistics.median(ms['with all-reduce']):.0f}% of the step"
    )
    print(
        "the processes' weights after training: "
        + ", ".join(f"{name} {'the same' if same else 'different'}" for name, same in result["in_step"].items())
    )
    for name, value in result["alone"].items():
        print(f"all_reduce alone, {name}: {value:.2f} ms")
    print(ratio_line("steps/s without the all-reduce / with it", ms, "without", "with all-reduce"))


if __name__ == "__main__":
    main()
