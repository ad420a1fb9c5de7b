"""Our train/mnist.py beside the plain DDP recipe it replaces, on the same data and layout.

    python bench/compare_reference.py --epochs 1 --repeats 3     # ~5 minutes on 2 cores
    python bench/compare_reference.py --tiny                      # seconds; what the test suite runs

Both sides: Fashion-MNIST, the same ConvNet, global batch 100 (50 per process), Adam(W) lr 1e-3 with
no decay and no schedule, 2 CPU processes. The reference (bench/reference/seed_ddp_mnist.py, a copy
of the team's seed recipe) is torchrun + DDP + DistributedSampler + torchvision per-sample
transforms; ours is `accelerate launch --config_file accelerate_configs/cpu_2proc.yaml train/mnist.py`.
Ours runs twice, in fp32 and with `--mixed_precision bf16` (both channels_last, fused AdamW).
A third path, bench/reference/raw_ddp_mnist.py, is our bf16 hot loop written against
torch.distributed alone (DistributedSampler + DDP, same data path and model): ours/raw shows what
accelerate and our loop cost on top. Runs alternate A/B/C/D, D/C/B/A, ... so drift and run order hit
all alike; the table gives medians of training seconds per epoch (no start-up, no evaluation) and the
ratios; ours/raw also per repeat, from the two neighbouring runs (--paths ours_bf16,raw_bf16 runs
only those two).
The floors are the same model's forward/backward/step as ours runs it (channels_last, fused AdamW)
over one epoch of in-memory batches of 100 in one process with all cores, no data loading and no
communication, in fp32 and bf16.
"""

import argparse
import gzip
import json
import os
import shutil
import statistics
import struct
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.harness import FASHION_DIR, REPO, child_env, turn_order

# --tiny's samples: 2 steps of the global batch of 100, then 100 test samples per process; bf16 is emulated (slow)
# on a CPU without native bf16, and the tiny run only checks that every path runs and the table and ratios come out
TINY_TRAIN, TINY_TEST = 200, 200
STEMS = ("train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")


def write_idx(path, tensor):
    """uint8 idx file (the format's 0x08 type), for the tiny copy the reference recipe reads."""
    with open(path, "wb") as f:
        f.write(struct.pack(">I", 0x0800 + tensor.dim()) + b"".join(struct.pack(">I", d) for d in tensor.shape))
        f.write(tensor.contiguous().numpy().tobytes())


def torchvision_layout(root, tiny):
    """root/FashionMNIST/raw/ with the four uncompressed idx files (what torchvision's class reads)."""
    raw = os.path.join(root, "FashionMNIST", "raw")
    os.makedirs(raw, exist_ok=True)
    if tiny:
        from data.mnist import load_mnist

        train, test, _ = load_mnist("fashion_mnist")
        for stem, t in zip(
            STEMS,
            (
                train.images[:TINY_TRAIN],
                train.labels[:TINY_TRAIN].byte(),
                test.images[:TINY_TEST],
                test.labels[:TINY_TEST].byte(),
            ),
            strict=True,
        ):
            write_idx(os.path.join(raw, stem), t)
    else:
        for stem in STEMS:
            with gzip.open(os.path.join(FASHION_DIR, stem + ".gz")) as src, open(os.path.join(raw, stem), "wb") as dst:
                shutil.copyfileobj(src, dst)
    return root


def run(cmd, env, accept=None):
    """Run cmd from the repo root; fail unless it exits 0 or `accept(proc)` says its output is complete."""
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    if proc.returncode != 0 and not (accept and accept(proc)):
        raise SystemExit(f"error: {' '.join(cmd[:6])}... failed:\n{(proc.stdout + proc.stderr)[-3000:]}")
    return proc, time.perf_counter() - start


def reference(data_root, epochs, env):
    # The recipe destroys its gloo group without a barrier and sometimes aborts in teardown
    # (SIGABRT, "terminate called without an active exception") after printing every result; such
    # a run is complete and counted, and the aborts are reported.
    complete = lambda proc: proc.stdout.count("RESULT ") == epochs  # noqa: E731
    proc, wall = run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node",
            "2",
            "bench/reference/seed_ddp_mnist.py",
            "--data",
            data_root,
            "--epochs",
            str(epochs),
        ],
        env,
        complete,
    )
    last = [
        dict(kv.split("=") for kv in line.split()[1:]) for line in proc.stdout.splitlines() if line.startswith("RESULT")
    ][-1]
    return {
        "epoch_seconds": float(last["train_s"]) / epochs,
        "accuracy": float(last["acc"]),
        "wall": wall,
        "eval_samples": int(last["n_eval"]),
        "teardown_abort": proc.returncode != 0,
    }


def raw_ddp(data_root, epochs, env):
    complete = lambda proc: proc.stdout.count("RESULT ") == epochs  # noqa: E731  (teardown aborts, as above)
    proc, wall = run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node",
            "2",
            "bench/reference/raw_ddp_mnist.py",
            "--data_dir",
            data_root,
            "--epochs",
            str(epochs),
        ],
        env,
        complete,
    )
    results = [
        dict(kv.split("=") for kv in line.split()[1:]) for line in proc.stdout.splitlines() if line.startswith("RESULT")
    ]
    return {
        "epoch_seconds": statistics.mean(float(r["epoch_s"]) for r in results),
        "accuracy": float(results[-1]["acc"]),
        "wall": wall,
        "eval_samples": int(results[-1]["n_eval"]),
        "teardown_abort": proc.returncode != 0,
    }


def ours(data_root, epochs, env, out, mixed_precision):
    shutil.rmtree(out, ignore_errors=True)
    _, wall = run(
        [
            sys.executable,
            "-m",
            "accelerate.commands.launch",
            "--config_file",
            "accelerate_configs/cpu_2proc.yaml",
            "train/mnist.py",
            "--data_dir",
            data_root,
            "--num_train_epochs",
            str(epochs),
            "--per_device_train_batch_size",
            "50",
            "--learning_rate",
            "1e-3",
            "--weight_decay",
            "0",
            "--lr_scheduler_type",
            "constant",
            "--mixed_precision",
            mixed_precision,
            "--output_dir",
            out,
        ],
        env,
    )
    results = json.load(open(os.path.join(out, "all_results.json")))
    return {
        "epoch_seconds": statistics.mean(results["epoch_seconds"]),
        "accuracy": results["eval_accuracy"],
        "wall": wall,
        "eval_samples": results["eval_samples"],
    }


def compute_floor(data_root, bf16):
    """Seconds per epoch of forward/backward/step alone, one process, all cores, batches of 100."""
    import torch
    import torch.nn.functional as F

    from data.mnist import load_mnist, normalize_images
    from train.mnist import ConvNet

    train, _, _ = load_mnist("fashion_mnist", os.path.join(data_root, "FashionMNIST", "raw"))
    torch.manual_seed(0)
    model = ConvNet().to(memory_format=torch.channels_last)
    images = normalize_images(train.images, train.mean, train.std).contiguous(memory_format=torch.channels_last)
    optimizer = torch.optim.AdamW(model.parameters(), 1e-3, weight_decay=0.0, fused=True)
    start = time.perf_counter()
    for i in range(0, len(images) - 99, 100):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            logits = model(images[i : i + 100]).float()
        loss = F.cross_entropy(logits, train.labels[i : i + 100])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return time.perf_counter() - start


PATHS = {
    "reference": "plain DDP recipe (torchrun)",
    "ours_fp32": "train/mnist.py (accelerate), fp32",
    "ours_bf16": "train/mnist.py (accelerate), bf16",
    "raw_bf16": "our bf16 loop on raw DDP (no accelerate)",
}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--tiny",
        action="store_true",
        help=f"{TINY_TRAIN} training and {TINY_TEST} test samples, 1 repeat: checks the bench runs",
    )
    parser.add_argument(
        "--paths",
        default=",".join(PATHS),
        help=f"Comma-separated subset of {','.join(PATHS)} (e.g. ours_bf16,raw_bf16 for the "
        "framework-overhead ratio alone, with more repeats in the same time).",
    )
    args = parser.parse_args(argv)
    chosen = args.paths.split(",")
    if not chosen or any(name not in PATHS for name in chosen):
        parser.error(f"--paths takes names from {','.join(PATHS)}, got {args.paths!r}")
    if args.tiny:
        args.repeats, args.epochs = 1, 1
    env = child_env()
    with tempfile.TemporaryDirectory() as tmp:
        data_root = torchvision_layout(os.path.join(tmp, "data"), args.tiny)
        out = os.path.join(tmp, "out")
        paths = {
            "reference": lambda: reference(data_root, args.epochs, env),
            "ours_fp32": lambda: ours(data_root, args.epochs, env, out, "no"),
            "ours_bf16": lambda: ours(data_root, args.epochs, env, out, "bf16"),
            "raw_bf16": lambda: raw_ddp(data_root, args.epochs, env),
        }
        paths = {name: path for name, path in paths.items() if name in chosen}
        runs = {name: [] for name in paths}
        for repeat in range(args.repeats):  # A/B/C/D, D/C/B/A, ...: drift and run order hit every path alike
            for name in turn_order(paths, repeat):
                runs[name].append(paths[name]())
            print(
                f"repeat {repeat + 1}: "
                + ", ".join(f"{name} {rs[-1]['epoch_seconds']:.2f}" for name, rs in runs.items())
                + " s/epoch",
                flush=True,
            )
        floors = {"fp32": compute_floor(data_root, False), "bf16": compute_floor(data_root, True)}
    median = {name: statistics.median(r["epoch_seconds"] for r in rs) for name, rs in runs.items()}
    print(
        f"\n{args.repeats} alternating repeats of {args.epochs} epoch(s), 2 CPU processes, global batch 100"
        f"{f' (tiny: {TINY_TRAIN} training, {TINY_TEST} test samples)' if args.tiny else ''}"
    )
    print("| path | train s/epoch (median) | test accuracy | eval samples | wall s (median) | vs reference |")
    print("|---|---|---|---|---|---|")

    def versus(seconds):  # speed-up over the reference, when it ran
        return f"{median['reference'] / seconds:.2f}x" if "reference" in median else ""

    for name, rs in runs.items():
        print(
            f"| {PATHS[name]} | {median[name]:.2f} | {rs[-1]['accuracy']:.4f} | {rs[-1]['eval_samples']} | "
            f"{statistics.median(r['wall'] for r in rs):.1f} | {versus(median[name])} |"
        )
    for precision, floor in floors.items():
        print(
            f"| compute-only floor, {precision} (1 process, 2 threads, no data loading) | {floor:.2f} | | | | "
            f"{versus(floor)} |"
        )
    for name in ("reference", "raw_bf16"):
        if name in runs:
            aborts = sum(r["teardown_abort"] for r in runs[name])
            print(f"{name} runs that aborted in gloo teardown after finishing: {aborts} of {len(runs[name])}")
    for name in ("ours_fp32", "ours_bf16"):
        if name in median and "reference" in median:
            print(f"RATIO {name}/reference epoch time = {median[name] / median['reference']:.3f}")
    if "ours_bf16" in runs and "raw_bf16" in runs:
        # Each repeat's two runs are neighbours in time, so their ratio cancels most of the host's drift.
        paired = [
            raw["epoch_seconds"] / ours["epoch_seconds"]
            for ours, raw in zip(runs["ours_bf16"], runs["raw_bf16"], strict=True)
        ]
        print(
            f"RATIO ours_bf16 throughput / raw DDP throughput = {median['raw_bf16'] / median['ours_bf16']:.3f} "
            f"(medians); per repeat: median {statistics.median(paired):.3f}, "
            f"range {min(paired):.3f}-{max(paired):.3f}"
        )


if __name__ == "__main__":
    main()
