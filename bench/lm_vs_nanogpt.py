"""train/lm.py beside nanoGPT's train.py at nanoGPT's own CPU shapes: optimizer steps per second.

    python bench/lm_vs_nanogpt.py --nanogpt_dir PATH/TO/nanoGPT            # ~5 minutes on 2 cores
    python bench/lm_vs_nanogpt.py --nanogpt_dir DIR --steps 60 --repeats 1  # a quick check

nanoGPT's README trains its character-level Shakespeare model on a CPU with its
config/train_shakespeare_char.py and `--device=cpu --compile=False --block_size=64 --batch_size=12
--n_layer=4 --n_head=4 --n_embd=128 --dropout=0.0`. Both programs train that shape here, on the same
tokens: the GCIDE text (or --text_file) as UTF-8 bytes, a vocabulary of 257 (256 bytes and
end-of-text), written once as nanoGPT's train.bin/val.bin/meta.pkl and as train/lm.py's window
shards. One process each on the CPU, fp32 for both (--dtype=float32; --cpu --mixed_precision no),
no compile, torch's default threads; the runs alternate (nanoGPT, ours, then ours, nanoGPT, ...) so
the host's drift hits both. The optimizers differ as the programs ship: ours is a fused AdamW,
nanoGPT fuses only on CUDA and loops over the tensors on a CPU.

Each program's own clock is read: nanoGPT prints every iteration's milliseconds, train/lm.py logs
samples/s every 10 steps to metrics.jsonl. Per run: the median over blocks of 10 steps after the first
20, which leaves out start-up, nanoGPT's evaluation at step 0 and ours at the end. Nothing of nanoGPT
is copied: the bench runs the checkout it is given, from a scratch folder that holds its data, its
output and a link to its configurator.py (which it reads from the working folder).
"""

import argparse
import json
import os
import pickle
import re
import shlex
import statistics
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.harness import REPO, child_env

SHAPES = {"block_size": 64, "batch_size": 12, "n_layer": 4, "n_head": 4, "n_embd": 128}
BLOCK, SKIP = 10, 20  # steps per timed block; steps left out at the start
NANOGPT_FILES = ("train.py", "configurator.py", os.path.join("config", "train_shakespeare_char.py"))


def write_text(path, text_file, megabytes):
    """The training text: --text_file, or the first MEGABYTES of the GCIDE dictionary's entries."""
    if text_file:
        with open(text_file, encoding="utf-8", errors="replace") as f:
            text = f.read()
    else:
        from data.text import gcide_documents

        text = "\n\n".join(gcide_documents()[0])[: megabytes * 10**6]
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
    return text


def write_nanogpt_data(folder, text):
    """train.bin/val.bin (uint16 token ids) and meta.pkl (the vocabulary size), as nanoGPT's prepare
    scripts write them; the tokens are the UTF-8 bytes, as train/lm.py's --tokenizer bytes makes them."""
    import numpy as np

    ids = np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.uint16)
    split = int(len(ids) * 0.95)
    os.makedirs(folder, exist_ok=True)
    ids[:split].tofile(os.path.join(folder, "train.bin"))
    ids[split:].tofile(os.path.join(folder, "val.bin"))
    with open(os.path.join(folder, "meta.pkl"), "wb") as f:
        pickle.dump({"vocab_size": 257}, f)


def blocks(ms_per_step):
    """ms per step over consecutive blocks of BLOCK steps, after the first SKIP."""
    kept = ms_per_step[SKIP:]
    return [sum(kept[i : i + BLOCK]) / BLOCK for i in range(0, len(kept) - BLOCK + 1, BLOCK)]


def run_nanogpt(nanogpt_dir, scratch, steps):
    cmd = [
        sys.executable,
        os.path.join(nanogpt_dir, "train.py"),
        os.path.join(nanogpt_dir, "config", "train_shakespeare_char.py"),
        "--device=cpu",
        "--compile=False",
        "--dtype=float32",
        "--dataset=bytes",
        "--dropout=0.0",
        "--eval_iters=1",
        "--eval_interval=1000000",
        "--log_interval=1",
        f"--max_iters={steps}",
        f"--lr_decay_iters={steps}",
        f"--out_dir={os.path.join(scratch, 'nanogpt_out')}",
        *[f"--{k}={v}" for k, v in SHAPES.items()],
    ]
    proc = subprocess.run(cmd, cwd=scratch, env=child_env(), capture_output=True, text=True)
    ms = [float(x) for x in re.findall(r"^iter \d+: loss [\d.]+, time ([\d.]+)ms", proc.stdout, re.M)]
    if proc.returncode != 0 or len(ms) < SKIP + BLOCK:
        raise SystemExit(f"error: nanoGPT's train.py failed:\n{(proc.stdout + proc.stderr)[-3000:]}")
    return statistics.median(blocks(ms))


def run_ours(scratch, steps, extra=()):
    out = os.path.join(scratch, "ours_out")
    cmd = [
        sys.executable,
        "train/lm.py",
        "--train_file",
        os.path.join(scratch, "text.txt"),
        "--tokenizer",
        "bytes",
        "--dataset_dir",
        os.path.join(scratch, "tokens"),
        "--block_size",
        str(SHAPES["block_size"]),
        "--per_device_train_batch_size",
        str(SHAPES["batch_size"]),
        "--n_layer",
        str(SHAPES["n_layer"]),
        "--n_head",
        str(SHAPES["n_head"]),
        "--n_embd",
        str(SHAPES["n_embd"]),
        "--dropout",
        "0",
        "--max_train_steps",
        str(steps),
        "--logging_steps",
        str(BLOCK),
        "--cpu",
        "--mixed_precision",
        "no",
        "--output_dir",
        out,
        "--overwrite_output_dir",
        *extra,
    ]
    proc = subprocess.run(cmd, cwd=REPO, env=child_env(), capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"error: train/lm.py failed:\n{(proc.stdout + proc.stderr)[-3000:]}")
    with open(os.path.join(out, "metrics.jsonl")) as f:
        logged = [json.loads(line) for line in f]
    per_block = [1000 * SHAPES["batch_size"] / r["samples_per_second"] for r in logged if "samples_per_second" in r]
    return statistics.median(per_block[SKIP // BLOCK :])


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--nanogpt_dir",
        required=True,
        help="A checkout of nanoGPT (its train.py, model.py, configurator.py and config/).",
    )
    parser.add_argument("--text_file", help="Train on this text (default: the GCIDE dictionary, make gcide).")
    parser.add_argument("--megabytes", type=int, default=4, help="Without --text_file: this much GCIDE text.")
    parser.add_argument("--steps", type=int, default=300, help="Optimizer steps per run.")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--ours",
        nargs="+",
        default=[""],
        metavar="FLAGS",
        help="train/lm.py's runs: one per string of extra flags (default: one, with none), e.g. "
        "--ours '' '--dataloader_num_workers 1' to time both beside nanoGPT. argparse takes "
        "a string that is one bare flag for an option: write it with a trailing space.",
    )
    args = parser.parse_args(argv)
    missing = [f for f in NANOGPT_FILES if not os.path.isfile(os.path.join(args.nanogpt_dir, f))]
    if missing:
        parser.error(f"--nanogpt_dir {args.nanogpt_dir} holds no {', '.join(missing)}; pass a checkout of nanoGPT")
    if args.steps < SKIP + BLOCK:
        parser.error(f"--steps must be at least {SKIP + BLOCK}: the first {SKIP} are not timed")

    with tempfile.TemporaryDirectory() as scratch:
        text = write_text(os.path.join(scratch, "text.txt"), args.text_file, args.megabytes)
        write_nanogpt_data(os.path.join(scratch, "data", "bytes"), text)
        os.symlink(
            os.path.join(os.path.abspath(args.nanogpt_dir), "configurator.py"), os.path.join(scratch, "configurator.py")
        )
        print(
            f"{len(text.encode('utf-8')):,} bytes of text; shapes {SHAPES}, vocab 257, {args.steps} steps per run, "
            f"1 process each, fp32, {os.cpu_count()} CPUs",
            flush=True,
        )
        programs = [("nanoGPT", None)] + [(f"ours {flags}".strip(), shlex.split(flags)) for flags in args.ours]
        results = {name: [] for name, _ in programs}
        for repeat in range(args.repeats):
            # the order reversed every other repeat, so the host's drift does not favour the first program
            for name, flags in programs[:: 1 if repeat % 2 == 0 else -1]:
                results[name].append(
                    run_nanogpt(os.path.abspath(args.nanogpt_dir), scratch, args.steps)
                    if flags is None
                    else run_ours(scratch, args.steps, flags)
                )
                print(f"repeat {repeat + 1}: {name} {results[name][-1]:.1f} ms/step", flush=True)

    print("\n| program | ms/step (median of runs) | steps/s | runs |\n|---|---|---|---|")
    for name, ms in results.items():
        shown = "nanoGPT train.py" if name == "nanoGPT" else f"train/lm.py{name[4:]}"
        print(
            f"| {shown} | {statistics.median(ms):.1f} | {1000 / statistics.median(ms):.2f} | "
            f"{', '.join(f'{r:.1f}' for r in ms)} |"
        )
    theirs = results["nanoGPT"]
    for name, ms in list(results.items())[1:]:
        pairs = [t / o for t, o in zip(theirs, ms, strict=True)]
        print(
            f"\nRATIO train/lm.py{name[4:]} steps/s / nanoGPT steps/s = "
            f"{statistics.median(theirs) / statistics.median(ms):.3f} "
            f"(per repeat: {', '.join(f'{p:.3f}' for p in pairs)})"
        )


if __name__ == "__main__":
    main()
