"""The floor under `make train-only CONFIG=accelerate_configs/1gpu.yaml`'s epoch: the recipe's step with
nothing around it, on one GPU, beside train/mnist.py's own epoch.

    python bench/gpu_step_floor.py [--mixed_precision bf16|no] [--steps 937]

The recipe's model (convnet_mlp, channels_last), fused AdamW, cross-entropy with label smoothing, under
bf16 autocast or fp32, on batches of 64 already on the GPU (random pixels and labels: the time of a
step does not depend on them). Three timings, each the median of 5 runs of --steps steps (an epoch
of 60,000 samples at 64 per step is 937), synchronised at the end only:

- step: forward, backward, fused AdamW, zero_grad(set_to_none=True), as train/mnist.py steps;
- forward+backward: without the optimizer;
- replay: the whole step captured once in a CUDA graph and replayed, which takes the launch cost of
  every kernel away: what the GPU itself needs. A graph needs its own optimizer (capturable, its
  step count on the GPU) and gradients that stay where they are (zeroed in place), so it steps a
  copy of the model.

The first version (2026-11-26, the H200 figures of docs/gpu.md) timed `step` with the graph's
optimizer and in-place zeroing, a little more work than train/mnist.py's step.

If `step` is far above `replay`, the epoch is bound by launching kernels from Python, not by the GPU;
train/mnist.py cannot be faster than `step` per step without capturing graphs or compiling.
"""

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mixed_precision", choices=["bf16", "no"], default="bf16")
    parser.add_argument("--steps", type=int, default=937)
    parser.add_argument("--batch_size", type=int, default=64)
    args = parser.parse_args()

    import torch
    import torch.nn.functional as F

    from train.mnist import MODELS, ConvNet

    if not torch.cuda.is_available():
        raise SystemExit("error: this bench needs a CUDA GPU (bench/step_phases.py is its CPU counterpart)")
    device = torch.device("cuda")
    images = torch.randn(args.batch_size, 1, 28, 28, device=device).contiguous(memory_format=torch.channels_last)
    labels = torch.randint(0, 10, (args.batch_size,), device=device)
    dtype = torch.bfloat16 if args.mixed_precision == "bf16" else None

    def recipe(capturable):
        torch.manual_seed(0)
        model = ConvNet(**MODELS["convnet_mlp"]).to(device, memory_format=torch.channels_last)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True, capturable=capturable)

    def forward_backward(model, cache=True):
        # a graph must not capture autocast's cache of casted weights (torch's graph docs)
        with torch.autocast("cuda", dtype=dtype, enabled=dtype is not None, cache_enabled=cache):
            loss = F.cross_entropy(model(images), labels, label_smoothing=0.1)
        loss.backward()

    model, optimizer = recipe(capturable=False)

    def step():
        forward_backward(model)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    graph_model, graph_optimizer = recipe(capturable=True)

    def graph_step():
        forward_backward(graph_model, cache=False)
        graph_optimizer.step()
        graph_optimizer.zero_grad(set_to_none=False)  # the graph reads and writes the same gradient tensors

    def timed(fn):
        runs = []
        for _ in range(5):
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(args.steps):
                fn()
            torch.cuda.synchronize()
            runs.append(time.perf_counter() - start)
        return statistics.median(runs)

    # warm-up on a side stream, as torch's graph capture asks, then capture one whole step
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(5):
            graph_step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graph_step()

    results = {
        "step": timed(step),
        "forward+backward": timed(lambda: forward_backward(model)),
        "replay": timed(graph.replay),
    }
    print(
        f"{torch.cuda.get_device_name()}, torch {torch.__version__}, mixed_precision={args.mixed_precision}, "
        f"batch {args.batch_size}, {args.steps} steps per run (median of 5)"
    )
    print("| what | seconds per epoch | µs per step |")
    print("|---|---|---|")
    for name, seconds in results.items():
        print(f"| {name} | {seconds:.3f} | {seconds / args.steps * 1e6:.0f} |")


if __name__ == "__main__":
    main()
