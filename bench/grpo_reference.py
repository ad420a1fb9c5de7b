"""train/grpo.py beside TRL's GRPOTrainer: end-to-end time, completions per second, peak memory and the
reward curve each gives on the same prompts.

    python bench/grpo_reference.py                    # make smollm2's model, 10 steps of 4 sums x 8 answers
    python bench/grpo_reference.py --rounds 2 --output runs/bench/grpo_reference.json

Two programs take turns over --rounds (A/B, then B/A, ...), each `python -m accelerate.commands.launch
--config_file accelerate_configs/cpu_2proc.yaml`: train/grpo.py, and TRL 1.16's GRPOTrainer with
transformers' generation (no vLLM), driven by this file's own --worker half (TRL is installed by
requirements.txt for the tests). Equal: the model (default make smollm2's runs/models/SmolLM2-135M-Instruct),
the prompts (python -m data.arithmetic's two-digit sums as chat turns, exactly --max_train_steps x
--prompts_per_step of them, so each side answers every prompt once, in its own order), the rewards
(train/core/rewards.py's answer_match x 1 + number_only x 0.5, the same functions passed to TRL), answers
per prompt, completions per process generated in one batch (TRL's per_device_train_batch_size counts completions
too; ours --generation_batch_size, a whole number of groups), tokens per
answer, temperature, learning rate with a constant schedule and no warmup, loss type dapo, beta 0 (no
reference model), epsilon 0.2, one pass per step's answers, clipping at 1.0, no weight decay, fused AdamW,
seed, 2 processes, fp32 (ours: --mixed_precision no; TRL: bf16=False, which GRPOConfig turns on), no
gradient checkpointing (GRPOConfig's default is on), dropout off (ours' default; TRL: disable_dropout=True),
ddp_find_unused_parameters=False (as accelerate's DDP), metrics logged every step, nothing saved mid-run.
Every run gets fresh folders (its output, HF_DATASETS_CACHE). ACCELERATE_USE_CPU=1, as
bench/text_reference.py explains; a run at another world size than 2 is refused. Not equal, by design:
ours evaluates once at the end (greedy answers to the 8 validation sums: it always does) and saves the
model, TRL does neither; both are in the launch-to-exit time, neither in the training time.

Per run: launch-to-exit seconds and the peak RSS of the launch's largest process (bench/harness.py's
run_measured, alike for both). Training seconds: from the start of the training loop's first epoch to the
end of its last optimizer step, by each program's clock in its training processes: ours all_results.json's
epoch_seconds (its loop's own timer, evaluations left out), TRL's a TrainerCallback's time.perf_counter()
at on_epoch_begin and at the last on_step_end (rank 0). Both spans hold the same work: every step's
generation, rewards, loss, backward, optimizer step and log, and neither start-up (imports, model load,
prompts, DDP) nor the end. Completions per second = completions x steps / training seconds, the
completions counted, not assumed: ours' lines of completions.jsonl (every step's answers at
--logging_steps 1), TRL's answers its reward function was called on, summed over processes. The reward
curve: the mean reward per step, ours from metrics.jsonl, TRL's from its log history (logging_steps 1).
Prints a Markdown table and RATIO ours / TRL completions per second; writes the whole as JSON (--output).
"""

import argparse
import json
import os
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.harness import CPU_2PROC, REPO, reference_env, run_measured, turn_order

PROGRAMS = {"ours": "train/grpo.py", "trl": "GRPOTrainer (transformers generation)"}
WORLD = 2  # processes of accelerate_configs/cpu_2proc.yaml
DEFAULT_MODEL = "runs/models/SmolLM2-135M-Instruct"
REWARDS = {"answer_match": 1.0, "number_only": 0.5}  # make train-grpo's: the right sum, the number alone
VALIDATION_ROWS = 8  # ours evaluates at its end in any case: a small set keeps that out of the way


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--model_name_or_path", default=DEFAULT_MODEL, help="A causal LM folder with a chat template (make smollm2's)."
    )
    parser.add_argument("--rounds", type=int, default=1, help="Runs of each program, in alternating order.")
    parser.add_argument("--max_train_steps", type=int, default=10, help="Optimizer steps of each run.")
    parser.add_argument("--prompts_per_step", type=int, default=4, help="Sums answered per step (both processes).")
    parser.add_argument("--num_generations", type=int, default=8, help="Answers per prompt: the group.")
    parser.add_argument("--max_completion_length", type=int, default=24, help="Tokens per answer at most.")
    parser.add_argument("--learning_rate", type=float, default=1e-5)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--output", default="runs/bench/grpo_reference.json", help="The JSON report.")
    # the --worker half: TRL's run, started by launch() under accelerate launch with these too
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--train_file", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--output_dir", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    completions = args.prompts_per_step * args.num_generations
    if completions % WORLD:
        parser.error(f"--prompts_per_step x --num_generations = {completions} completions: not a multiple of {WORLD}")
    args.per_device_train_batch_size = completions // WORLD
    if not args.worker and not os.path.isfile(os.path.join(REPO, args.model_name_or_path, "config.json")):
        raise SystemExit(
            f"error: {args.model_name_or_path} holds no model; `make smollm2` writes {DEFAULT_MODEL} "
            "(or pass --model_name_or_path)"
        )
    return args


# ---------------------------------------------------------------------------------- TRL's side (--worker)
def trl_worker(args):
    """One process of TRL's run: GRPOTrainer with the bench's settings on --train_file, then, from the main
    process, OUTPUT_DIR/trl_results.json: the log history, the training clock, the completions scored and
    the world size."""
    import functools
    import gc
    import time

    import datasets
    import torch
    from accelerate.utils import gather_object
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from train.core.rewards import BUILT_IN

    class Clock(TrainerCallback):
        """perf_counter at the first epoch's start and at each optimizer step's end."""

        def __init__(self):
            self.start, self.step_ends = None, []

        def on_epoch_begin(self, args, state, control, **kwargs):
            self.start = self.start or time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            self.step_ends.append(time.perf_counter())

    scored = [0]  # answers the first reward function was called on, in this process

    def counted(func):
        @functools.wraps(func)  # TRL names the logged rewards/NAME/mean by __name__
        def reward(completions, **kwargs):
            scored[0] += len(completions)
            return func(completions=completions, **kwargs)

        return reward

    funcs = [BUILT_IN[name] for name in REWARDS]
    funcs[0] = counted(funcs[0])
    config = GRPOConfig(
        output_dir=args.output_dir,
        per_device_train_batch_size=args.per_device_train_batch_size,
        num_generations=args.num_generations,
        max_completion_length=args.max_completion_length,
        temperature=args.temperature,
        learning_rate=args.learning_rate,
        lr_scheduler_type="constant",
        weight_decay=0.0,
        max_grad_norm=1.0,
        loss_type="dapo",
        beta=0.0,
        reward_weights=list(REWARDS.values()),
        max_steps=args.max_train_steps,
        seed=args.seed,
        bf16=False,  # GRPOConfig turns it on, on a CPU too
        gradient_checkpointing=False,  # GRPOConfig's default is on; train/grpo.py keeps activations
        disable_dropout=True,  # train/grpo.py's default
        ddp_find_unused_parameters=False,  # every weight gets a gradient, as accelerate's DDP assumes
        use_cpu=True,
        report_to="none",
        save_strategy="no",
        logging_steps=1,
        dataloader_num_workers=0,
    )
    clock = Clock()
    trainer = GRPOTrainer(
        model=AutoModelForCausalLM.from_pretrained(args.model_name_or_path, dtype=torch.float32),
        reward_funcs=funcs,
        args=config,
        train_dataset=datasets.load_dataset("json", data_files=args.train_file, split="train"),
        processing_class=AutoTokenizer.from_pretrained(args.model_name_or_path),
        callbacks=[clock],
    )
    trainer.train()
    completions = sum(gather_object([scored[0]]))
    if trainer.accelerator.is_main_process:
        with open(os.path.join(args.output_dir, "trl_results.json"), "w") as f:
            json.dump(
                {
                    "log_history": trainer.state.log_history,
                    "training_seconds": clock.step_ends[-1] - clock.start,
                    "steps": trainer.state.global_step,
                    "completions": completions,
                    "world_size": trainer.accelerator.num_processes,
                },
                f,
                indent=1,
            )
    # DDP's reducer holds gloo state: freed at interpreter exit, after the process group, it can abort the
    # finished run (SIGABRT); so the trainer goes first, then the group (as bench/reference/trl_sft.py)
    del trainer
    gc.collect()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


# ---------------------------------------------------------------------------------- one run
def command(name, args, data, out):
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", CPU_2PROC]
    common = [
        "--model_name_or_path",
        args.model_name_or_path,
        "--train_file",
        data["train"],
        "--max_train_steps",
        str(args.max_train_steps),
        "--num_generations",
        str(args.num_generations),
        "--max_completion_length",
        str(args.max_completion_length),
        "--learning_rate",
        str(args.learning_rate),
        "--temperature",
        str(args.temperature),
        "--seed",
        str(args.seed),
        "--output_dir",
        out,
    ]
    if name == "trl":
        worker = [os.path.abspath(__file__), "--worker", "--prompts_per_step", str(args.prompts_per_step)]
        return [*launch, *worker, *common]
    return [
        *launch,
        "train/grpo.py",
        *common,
        "--validation_file",
        data["validation"],
        "--per_device_train_batch_size",
        str(args.per_device_train_batch_size),
        # each process generates its completions in one batch, as TRL does (whole groups: checked at parse)
        "--generation_batch_size",
        str(args.per_device_train_batch_size),
        "--per_device_eval_batch_size",
        str(VALIDATION_ROWS // WORLD),
        "--reward_funcs",
        *REWARDS,
        "--reward_weights",
        *map(str, REWARDS.values()),
        "--loss_type",
        "dapo",
        "--beta",
        "0",
        "--lr_scheduler_type",
        "constant",
        "--weight_decay",
        "0",
        "--max_grad_norm",
        "1.0",
        "--mixed_precision",
        "no",
        "--metric_for_best_model",
        "none",
        "--logging_steps",
        "1",
    ]


def read_jsonl(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def launch(name, args, data, scratch):
    """One run of program `name` in fresh folders: launch-to-exit and training seconds, the completions
    it scored, completions per second, the peak RSS of its largest process and its reward per step."""
    run_dir = tempfile.mkdtemp(prefix=name + "_", dir=scratch)
    out = os.path.join(run_dir, "out")
    log = os.path.join(run_dir, "log.txt")
    code, wall, rss_mb = run_measured(command(name, args, data, out), log, reference_env(run_dir))
    results = os.path.join(out, "trl_results.json" if name == "trl" else "all_results.json")
    if code != 0 or not os.path.isfile(results):
        with open(log, encoding="utf-8", errors="replace") as f:
            tail = "\n".join(f.read().splitlines()[-40:])
        raise SystemExit(f"error: {PROGRAMS[name]} failed (exit {code}); its last lines:\n{tail}")
    with open(results) as f:
        results = json.load(f)
    if results["world_size"] != WORLD:
        raise SystemExit(f"error: {PROGRAMS[name]} ran with world size {results['world_size']}, not {WORLD}")
    if name == "trl":
        logs = [r for r in results["log_history"] if "reward" in r]
        steps, seconds, completions = results["steps"], results["training_seconds"], results["completions"]
    else:
        logs = [r for r in read_jsonl(os.path.join(out, "metrics.jsonl")) if "reward" in r]
        steps, seconds = results["step"], sum(results["epoch_seconds"])
        completions = len(read_jsonl(os.path.join(out, "completions.jsonl")))
    return {
        "wall_seconds": wall,
        "training_seconds": seconds,
        "steps": steps,
        "completions": completions,
        "completions_per_second": completions / seconds,
        "peak_rss_mb": rss_mb,
        "rewards": [r["reward"] for r in sorted(logs, key=lambda r: r["step"])],
    }


# ---------------------------------------------------------------------------------- the bench
def main(argv=None):
    args = parse_args(argv)
    if args.worker:
        trl_worker(args)
        return None
    from data.arithmetic import write  # the standard library only: this process never imports torch

    per_step = args.prompts_per_step * args.num_generations
    settings = {
        "model": args.model_name_or_path,
        "steps": args.max_train_steps,
        "prompts_per_step": args.prompts_per_step,
        "num_generations": args.num_generations,
        "completions_per_step": per_step,
        "max_completion_length": args.max_completion_length,
        "learning_rate": args.learning_rate,
        "temperature": args.temperature,
        "loss_type": "dapo",
        "beta": 0.0,
        "rewards": REWARDS,
        "processes": WORLD,
        "precision": "fp32",
        "rounds": args.rounds,
        "seed": args.seed,
    }
    print(
        f"{args.max_train_steps} steps of {args.prompts_per_step} sums x {args.num_generations} answers "
        f"({per_step} completions, {args.per_device_train_batch_size} per process) of at most "
        f"{args.max_completion_length} tokens; {WORLD} CPU processes, fp32, dapo, beta 0, learning rate "
        f"{args.learning_rate}, temperature {args.temperature}; model {args.model_name_or_path}",
        flush=True,
    )
    runs = {name: [] for name in PROGRAMS}
    with tempfile.TemporaryDirectory() as scratch:
        folder = os.path.join(scratch, "sums")
        write(folder, args.max_train_steps * args.prompts_per_step, VALIDATION_ROWS, seed=args.seed)
        data = {split: os.path.join(folder, f"{split}.jsonl") for split in ("train", "validation")}
        for turn in range(args.rounds):
            for name in turn_order(PROGRAMS, turn):  # the host's drift hits both alike
                run = launch(name, args, data, scratch)
                runs[name].append(run)
                print(
                    f"round {turn + 1}: {PROGRAMS[name]}: {run['wall_seconds']:.1f} s launch to exit, "
                    f"{run['training_seconds']:.1f} s training, {run['completions']} completions in "
                    f"{run['steps']} steps, peak RSS {run['peak_rss_mb']:,.0f} MB",
                    flush=True,
                )

    keys = ("wall_seconds", "training_seconds", "completions_per_second", "peak_rss_mb")
    median = {name: {k: statistics.median(run[k] for run in rs) for k in keys} for name, rs in runs.items()}
    ratio = {k: median["ours"][k] / median["trl"][k] for k in keys}
    print(
        "\n| program | launch to exit s | training s | completions | completions/s | peak RSS MB per process | "
        "reward per step (first round) |\n|---|---|---|---|---|---|---|"
    )
    for name, rs in runs.items():
        m = median[name]
        print(
            f"| {PROGRAMS[name]} | {m['wall_seconds']:.1f} | {m['training_seconds']:.1f} | {rs[0]['completions']} | "
            f"{m['completions_per_second']:.2f} | {m['peak_rss_mb']:,.0f} | "
            f"{' '.join(f'{r:.3f}' for r in rs[0]['rewards'])} |"
        )
    print(
        f"RATIO ours / TRL completions per second = {ratio['completions_per_second']:.2f} "
        f"(launch to exit ours / TRL = {ratio['wall_seconds']:.2f}, peak RSS ours / TRL = {ratio['peak_rss_mb']:.2f})"
    )
    report = {
        "settings": settings,
        "definitions": {
            "training_seconds": "from the start of the training loop's first epoch to the end of its last "
            "optimizer step, each program's clock (ours: all_results.json epoch_seconds; TRL: a TrainerCallback, "
            "on_epoch_begin to the last on_step_end, rank 0)",
            "completions_per_second": "completions counted (ours: completions.jsonl lines; TRL: answers scored by "
            "its reward function, all processes) / training seconds",
            "wall_seconds": "launch to exit of `accelerate launch`, as the bench started it",
            "peak_rss_mb": "ru_maxrss of the launch's largest process (bench/harness.py run_measured)",
        },
        "programs": PROGRAMS,
        "runs": runs,
        "median": median,
        "ratio_ours_over_trl": ratio,
    }
    output = os.path.join(REPO, args.output)
    os.makedirs(os.path.dirname(output), exist_ok=True)
    with open(output, "w") as f:
        json.dump(report, f, indent=1)
    print(f"report: {args.output}")
    return report


if __name__ == "__main__":
    main()
