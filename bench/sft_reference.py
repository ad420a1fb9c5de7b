"""train/sft.py beside TRL's SFTTrainer: end-to-end speed, peak memory and the validation loss each reaches.

    python bench/sft_reference.py                            # SmolLM2 on 1,024 sums (make smollm2 chat-data), 2 turns
    python bench/sft_reference.py --preset small_gpt         # make train-lm's GPT on make sft-data's pairs
    python bench/sft_reference.py --max_train_samples 256 --turns 1     # a quick check

Four programs take turns (A/B/C/D, then D/C/B/A, ...), each `python -m accelerate.commands.launch
--config_file accelerate_configs/cpu_2proc.yaml`, TRL's through bench/reference/trl_sft.py (TRL is
installed by requirements.txt for the tests). Padded: ours as it is (rows padded, batches grouped by
length) and SFTTrainer with padding_free=False, packing=False and transformers' length-grouped sampler.
Packed: ours with --packing and SFTTrainer with packing=True, packing_strategy 'bfd': both place whole
examples into rows of the max sequence length by best-fit decreasing and keep them apart by position_ids
restarting at 0 ('wrapped' would cut examples and let attention cross them); TRL flattens a batch's rows
into one (padding-free), ours keeps --packed_batch_size rows; TRL draws its packed rows at random.

Equal: the model and the pairs (--preset, below), copied with the columns prompt and completion (ours
reads them with --response_column completion; a conversation rendered once, here, with the model's chat
template), rows per process, epochs, learning rate, linear schedule after the same
warmup, max sequence length (ours: --max_seq_length, TRL: max_length; default the model's limit, at most
1,024; longer examples cut at the end), seed, clipping at 1.0, no weight decay, fp32 (ours:
--mixed_precision no; TRL: bf16=False, fp16=False, as SFTConfig turns bf16 on), the loss on the
response's tokens and end-of-text only, per token over each optimizer step (TRL:
completion_only_loss=True and average_tokens_across_devices), no gradient checkpointing (SFTConfig's
default is on), ddp_find_unused_parameters=False (as accelerate's DDP), evaluation in batches of 32 at
each epoch's end, and the last weights saved (ours: --metric_for_best_model none). Every run gets fresh
folders (its output, HF_DATASETS_CACHE, our --cache_dir), so each tokenizes afresh. ACCELERATE_USE_CPU=1,
as bench/text_reference.py explains; a run at another world size than 2 is refused. Not equal, by
design: the order of padded batches under --order grouped (each program's own length-grouped sampler:
transformers' sorts each group of up to 50 batches longest-first and runs it in that order, ours sorts
50 steps at a time and shuffles the steps; --order random shuffles both); ours stores an example of n
tokens as n - 1 positions (inputs beside their shifted labels), TRL as n, so TRL's packed rows hold a
little less and its packed epoch takes a few percent more steps.

--preset smollm2 (the default once make smollm2 has written its folder): SmolLM2-135M-Instruct on 1,024
of make chat-data's sums, 8 rows per process, learning rate 1e-4, no warmup. --preset small_gpt: make
train-lm's GPT (runs/lm) on every pair of make sft-data's runs/sft/gcide, 16 rows, 2e-3, 30 warmup steps.
A flag given on the command line wins over its preset's value.

Per run: the wall time from launch to exit (start-up, tokenizing, packing, evaluation and saving
included, alike for all); response tokens/s = the training set's response tokens x epochs / wall seconds,
the response tokens counted once here with the model's tokenizer (the tokens of prompt + response after
those of the prompt alone, and end-of-text, up to the max sequence length): one figure for all four.
Peak RSS: os.wait4's ru_maxrss of the launch, the largest of the launcher and the processes it waited
for, i.e. the largest training process up to its exit (TRL's processes also report their own at the end
of main(), printed per turn, ~0.1 GB lower: the torch library pages that interpreter exit touches).
Validation loss: nats per response token over the whole validation set, of the saved model, scored
after the run (untimed) by this file in one process, alike for all four (one scoring process for the
whole bench, started after the first run and idle during the others); beside it each program's own
figure: ours' eval_loss is the same measure; TRL's evaluate() averages its batches' per-token means, and
under group_by_length transformers groups the evaluation batches by length too, which pulls that figure
below the per-token one (~0.1 nats on 256 of the demo's pairs). The goal: ours at least 1.25x TRL's
response tokens/s in the same mode at an equal (within --loss_tolerance) or lower scored validation loss.
"""

import argparse
import json
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.harness import CPU_2PROC, REPO, child_env, reference_env, run_measured, turn_order

PROGRAMS = {
    "ours": "train/sft.py",
    "ours_packed": "train/sft.py --packing",
    "trl": "SFTTrainer",
    "trl_packed": "SFTTrainer, packing bfd",
}
MODES = {"padded": ("ours", "trl"), "packed": ("ours_packed", "trl_packed")}  # (ours, TRL's)
GOAL = 1.25  # ours' response tokens/s over TRL's, at an equal or lower validation loss
SAMPLING = {"grouped": "group_by_length", "random": "random"}  # --order: TRL's train_sampling_strategy
MAX_LENGTH = 1024  # the default --max_seq_length's cap, as train/sft.py's
# What the programs train and with what, unless a flag says otherwise: a model people fine-tune when make
# smollm2 has written it (SmolLM2-135M-Instruct on make chat-data's sums, at a rate and batch that suit a
# pretrained 135M model: the docs/sft.md comparison's), else make train-lm's 3.4M-parameter GPT on GCIDE
PRESETS = {
    "smollm2": {
        "model_name_or_path": "runs/models/SmolLM2-135M-Instruct",
        "train_file": "runs/sft/sums/train.jsonl",
        "validation_file": "runs/sft/sums/validation.jsonl",
        "per_device_train_batch_size": 8,
        "learning_rate": 1e-4,
        "num_warmup_steps": 0,
        "max_train_samples": 1024,
        "make": "make smollm2 chat-data",
    },
    "small_gpt": {
        "model_name_or_path": "runs/lm",
        "train_file": "runs/sft/gcide/train.jsonl",
        "validation_file": "runs/sft/gcide/validation.jsonl",
        "per_device_train_batch_size": 16,
        "learning_rate": 2e-3,
        "num_warmup_steps": 30,
        "max_train_samples": None,
        "make": "make sft-data (it trains runs/lm first)",
    },
}


def default_preset():
    """smollm2 where make smollm2 has written its folder, else small_gpt."""
    folder = os.path.join(REPO, PRESETS["smollm2"]["model_name_or_path"])
    return "smollm2" if os.path.isfile(os.path.join(folder, "config.json")) else "small_gpt"


# ---------------------------------------------------------------------------------- the data
def copy_pairs(src, dst, max_rows=None, seed=0, tokenizer=None):
    """src's rows as prompt/completion (TRL's names), the head of them shuffled with `seed` when max_rows:
    [(prompt, completion)]. A row is prompt/response, or a conversation ("messages"), rendered with
    `tokenizer`'s chat template: the prompt is every turn before the last (an assistant's) with the
    template's opening of the assistant's turn, the completion that turn's text; both programs then add
    the end of text (a chat model's end of turn), so both read the same strings."""
    with open(src, encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    if max_rows:
        random.Random(seed).shuffle(rows)
        rows = rows[:max_rows]
    pairs = []
    for row in rows:
        if "messages" not in row:
            pairs.append((row["prompt"], row["response"]))
            continue
        *before, last = row["messages"]
        if last["role"] != "assistant" or tokenizer is None:
            raise SystemExit(f"error: {src}: a conversation must end with an assistant's turn, read with a chat model")
        prompt = tokenizer.apply_chat_template(before, add_generation_prompt=True, tokenize=False)
        pairs.append((prompt, last["content"]))
    with open(dst, "w", encoding="utf-8") as f:
        f.writelines(json.dumps({"prompt": p, "completion": c}) + "\n" for p, c in pairs)
    return pairs


def scored_examples(tokenizer, pairs, max_length):
    """Per pair: the tokens of prompt + completion and end-of-text, cut at max_length, and their labels:
    -100 on the prompt's tokens (those tokenizing the prompt alone gives, as a prefix)."""
    prompts = tokenizer([p for p, _ in pairs])["input_ids"]
    wholes = tokenizer([p + c for p, c in pairs])["input_ids"]
    examples = []
    for prompt, whole in zip(prompts, wholes, strict=True):
        ids = (whole + [tokenizer.eos_token_id])[:max_length]
        context = 0
        while context < min(len(prompt), len(ids)) and prompt[context] == ids[context]:
            context += 1
        examples.append((ids, [-100] * context + ids[context:]))
    return examples


def response_tokens(tokenizer, pairs, max_length):
    return sum(sum(label != -100 for label in labels) for _, labels in scored_examples(tokenizer, pairs, max_length))


def model_limit(model):
    """The model's longest sequence from its config.json (at most MAX_LENGTH), as train/sft.py's default."""
    with open(os.path.join(model, "config.json")) as f:
        config = json.load(f)
    limits = [config[k] for k in ("n_positions", "max_position_embeddings", "n_ctx") if isinstance(config.get(k), int)]
    return min([MAX_LENGTH, *limits])


def score(model, validation_file, max_length, batch_size=32):
    """Nats per response token of the model in folder `model` over every pair of validation_file (the
    hidden --score mode: one process, fp32)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with open(validation_file, encoding="utf-8") as f:
        pairs = [(row["prompt"], row["completion"]) for row in map(json.loads, filter(str.strip, f))]
    tokenizer = AutoTokenizer.from_pretrained(model)
    net = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    examples = scored_examples(tokenizer, pairs, max_length)
    nats, tokens = 0.0, 0
    for i in range(0, len(examples), batch_size):
        batch = examples[i : i + batch_size]
        width = max(len(ids) for ids, _ in batch)
        pad = width - torch.tensor([len(ids) for ids, _ in batch])
        input_ids = torch.tensor([ids + [0] * (width - len(ids)) for ids, _ in batch])
        labels = torch.tensor([labels + [-100] * (width - len(labels)) for _, labels in batch])
        attention_mask = (torch.arange(width)[None] < (width - pad)[:, None]).long()
        with torch.no_grad():
            logits = net(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits
        nats += torch.nn.functional.cross_entropy(
            logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(), ignore_index=-100, reduction="sum"
        ).item()
        tokens += int((labels[:, 1:] != -100).sum())
    return {"loss": nats / tokens, "tokens": tokens}


# ---------------------------------------------------------------------------------- one run
def command(name, args, data, run_dir, out):
    """The launch of program `name` (accelerate launch, 2 CPU processes) with the bench's settings."""
    packed = name.endswith("_packed")
    common = [
        "--model_name_or_path",
        args.model_name_or_path,
        "--train_file",
        data["train"],
        "--validation_file",
        data["validation"],
        "--per_device_train_batch_size",
        str(args.packed_batch_size if packed else args.per_device_train_batch_size),
        "--per_device_eval_batch_size",
        "32",
        "--num_train_epochs",
        str(args.num_train_epochs),
        "--learning_rate",
        str(args.learning_rate),
        "--num_warmup_steps",
        str(args.num_warmup_steps),
        "--seed",
        str(args.seed),
        "--output_dir",
        out,
    ]
    if name.startswith("trl"):
        script = "bench/reference/trl_sft.py"
        extra = ["--max_length", str(args.max_seq_length)]
        extra += ["--packing"] if packed else ["--train_sampling_strategy", SAMPLING[args.order]]
    else:
        script = "train/sft.py"
        extra = [
            "--max_seq_length",
            str(args.max_seq_length),
            "--response_column",
            "completion",
            "--lr_scheduler_type",
            "linear",
            "--weight_decay",
            "0",
            "--max_grad_norm",
            "1.0",
            "--mixed_precision",
            "no",
            "--metric_for_best_model",
            "none",
            "--cache_dir",
            os.path.join(run_dir, "tokens"),
            *(["--packing"] if packed else ["--group_by_length", "true" if args.order == "grouped" else "false"]),
        ]
    return [sys.executable, "-m", "accelerate.commands.launch", "--config_file", CPU_2PROC, script, *common, *extra]


def launch(name, args, data, scratch, scorer):
    """One run of program `name` in fresh folders, then its model scored (by `scorer`, a Scorer): a dict
    of wall seconds, peak RSS MB, the scored validation loss, the program's own loss and its optimizer steps."""
    run_dir = tempfile.mkdtemp(prefix=name + "_", dir=scratch)
    out = os.path.join(run_dir, "out")
    cmd = command(name, args, data, run_dir, out)
    log = os.path.join(run_dir, "log.txt")
    code, wall, rss_mb = run_measured(cmd, log, reference_env(run_dir))
    with open(log, encoding="utf-8", errors="replace") as f:
        output = f.read()
    results = os.path.join(out, "all_results.json")
    if code != 0 or not os.path.isfile(results):
        tail = "\n".join(output.splitlines()[-40:])
        raise SystemExit(f"error: {PROGRAMS[name]} failed (exit {code}); its last lines:\n{tail}")
    with open(results) as f:
        results = json.load(f)
    if results["world_size"] != 2:
        raise SystemExit(f"error: {PROGRAMS[name]} ran with world size {results['world_size']}, not 2")
    counted = re.search(r"train ([\d,]+) examples, ([\d,]+) response tokens", output)  # ours' data line
    scored = scorer(out)
    return {
        "wall": wall,
        "rss_mb": rss_mb,
        "rank_rss_mb": results.get("peak_rss_mb"),
        "loss": scored["loss"],
        "own_loss": results["eval_loss"],
        "steps": results["step"],
        "response_tokens": int(counted.group(2).replace(",", "")) if counted else None,
    }


class Scorer:
    """score() in a process of its own (this file with --score -), so this one never imports torch (a
    child's os.wait4 peak RSS can count its parent's). One such process scores every run's model, one
    folder per line on its stdin, a SCORE line back for each: started at the first run's end, idle
    (waiting on its stdin) while the others run, closed by close()."""

    def __init__(self, validation_file, max_length):
        self.cmd = [sys.executable, os.path.abspath(__file__), "--score", "-", "--validation_file", validation_file]
        self.cmd += ["--max_seq_length", str(max_length)]
        self.proc = self.errors = None

    def __call__(self, model):
        if self.proc is None:
            self.errors = tempfile.TemporaryFile("w+")
            env = {**child_env(), "HF_HUB_OFFLINE": "1"}
            self.proc = subprocess.Popen(
                self.cmd,
                cwd=REPO,
                env=env,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=self.errors,
                text=True,
            )
        lines = []
        try:
            self.proc.stdin.write(model + "\n")
            self.proc.stdin.flush()
        except BrokenPipeError:  # it already ended: its output says why
            pass
        for line in self.proc.stdout:
            if line.startswith("SCORE "):
                return json.loads(line[len("SCORE ") :])
            lines.append(line)
        self.proc.wait()
        self.errors.seek(0)
        raise SystemExit(f"error: scoring {model} failed:\n{(''.join(lines) + self.errors.read())[-3000:]}")

    def close(self):
        if self.proc is not None:
            self.proc.stdin.close()
            self.proc.wait()
            self.errors.close()
            self.proc = self.errors = None


def describe(run, tokens):
    """One run's line: wall time, steps, peak RSS, the scored and the program's own validation loss."""
    ranks = run["rank_rss_mb"]
    line = f"{run['wall']:.1f} s, {run['steps']} steps, peak RSS {run['rss_mb']:,.0f} MB"
    if ranks:
        line += f" (each process at the end of main(): {', '.join(f'{mb:,.0f}' for mb in ranks)})"
    line += f", validation loss {run['loss']:.4f} (its own: {run['own_loss']:.4f})"
    if run["response_tokens"] is not None and run["response_tokens"] != tokens:
        line += f"; it counted {run['response_tokens']:,} response tokens"
    return line


# ---------------------------------------------------------------------------------- the bench
def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--preset",
        choices=tuple(PRESETS),
        default=None,
        help="The model, data, rows per process, learning rate, warmup and pairs below, unless given: smollm2 "
        "(make smollm2's SmolLM2-135M-Instruct on make chat-data's sums; the default where it is there) or "
        "small_gpt (make train-lm's GPT on make sft-data's GCIDE pairs).",
    )
    parser.add_argument("--model_name_or_path", default=None, help="A causal LM folder.")
    parser.add_argument("--train_file", default=None, help="jsonl rows: prompt, response; or conversations (messages).")
    parser.add_argument("--validation_file", default=None)
    parser.add_argument("--turns", type=int, default=2, help="Runs of each program, in alternating order.")
    parser.add_argument("--num_train_epochs", type=int, default=1)
    parser.add_argument("--per_device_train_batch_size", type=int, default=None, help="Padded rows per process.")
    parser.add_argument(
        "--packed_batch_size", type=int, default=2, help="Packed rows of --max_seq_length tokens per process."
    )
    parser.add_argument("--learning_rate", type=float, default=None)
    parser.add_argument("--num_warmup_steps", type=int, default=None)
    parser.add_argument(
        "--max_seq_length",
        type=int,
        default=None,
        help="Tokens per example, TRL's max_length (default: the model's limit, at most 1024).",
    )
    parser.add_argument(
        "--max_train_samples",
        type=int,
        default=None,
        help="Train on this many pairs: the head of the training pairs shuffled with --seed.",
    )
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument(
        "--order",
        choices=tuple(SAMPLING),
        default="grouped",
        help="Padded runs' batches: grouped by length, each program by its own sampler (the default), or "
        "random (ours --group_by_length false, TRL's train_sampling_strategy random), for a loss "
        "comparison in which neither order favours one side.",
    )
    parser.add_argument(
        "--loss_tolerance",
        type=float,
        default=0.01,
        help="The goal's 'equal' validation loss: ours at most this many nats above TRL's.",
    )
    parser.add_argument("--programs", nargs="+", choices=PROGRAMS, default=list(PROGRAMS))
    # a model folder to score, then exit; `-`: one folder per line of stdin, each scored as it comes
    parser.add_argument("--score", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.score:
        return args
    args.preset = args.preset or default_preset()
    preset = PRESETS[args.preset]
    for key, value in preset.items():
        if key != "make" and getattr(args, key) is None:
            setattr(args, key, value)
    model = os.path.join(REPO, args.model_name_or_path)
    if not os.path.isfile(os.path.join(model, "config.json")):
        parser.error(f"{args.model_name_or_path} holds no model: {preset['make']} (or pass --model_name_or_path)")
    for path in (args.train_file, args.validation_file):
        if not os.path.isfile(os.path.join(REPO, path)):
            parser.error(f"{path} is missing: {preset['make']} (or pass --train_file and --validation_file)")
    args.max_seq_length = args.max_seq_length or model_limit(model)
    return args


def main(argv=None):
    args = parse_args(argv)
    if args.score:
        for model in sys.stdin if args.score == "-" else [args.score]:
            result = score(model.rstrip("\n"), args.validation_file, args.max_seq_length)
            print("SCORE " + json.dumps(result), flush=True)
        return

    with tempfile.TemporaryDirectory() as scratch:
        data = {"train": os.path.join(scratch, "train.jsonl"), "validation": os.path.join(scratch, "validation.jsonl")}
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(os.path.join(REPO, args.model_name_or_path))
        train_file, validation_file = (os.path.join(REPO, f) for f in (args.train_file, args.validation_file))
        pairs = copy_pairs(train_file, data["train"], args.max_train_samples, args.seed, tokenizer)
        validation = copy_pairs(validation_file, data["validation"], tokenizer=tokenizer)
        tokens = response_tokens(tokenizer, pairs, args.max_seq_length)
        print(
            f"{len(pairs):,} training pairs ({tokens:,} response tokens) x {args.num_train_epochs} epoch(s), "
            f"{len(validation):,} validation pairs; padded: {args.per_device_train_batch_size} rows per process, "
            f"packed: {args.packed_batch_size} rows of {args.max_seq_length} tokens per process; 2 CPU processes, "
            f"fp32, learning rate {args.learning_rate}; model {args.model_name_or_path} (--preset {args.preset})",
            flush=True,
        )
        programs = {name: PROGRAMS[name] for name in args.programs}
        runs = {name: [] for name in programs}
        scorer = Scorer(data["validation"], args.max_seq_length)
        try:
            for turn in range(args.turns):
                for name in turn_order(programs, turn):  # the host's drift hits all alike
                    runs[name].append(launch(name, args, data, scratch, scorer))
                    print(f"turn {turn + 1}: {PROGRAMS[name]}: {describe(runs[name][-1], tokens)}", flush=True)
        finally:
            scorer.close()

    med = {
        name: {key: statistics.median(run[key] for run in rs) for key in ("wall", "rss_mb", "loss", "own_loss")}
        for name, rs in runs.items()
    }
    speed = {
        name: statistics.median(tokens * args.num_train_epochs / run["wall"] for run in rs) for name, rs in runs.items()
    }
    theirs = {ours: trl for ours, trl in MODES.values()} | {trl: trl for _, trl in MODES.values()}
    print(
        "\n| program | response tokens/s (x TRL, same mode) | peak RSS MB per process | "
        "validation loss (its own figure) | wall s |\n|---|---|---|---|---|"
    )
    for name in runs:
        ratio = f" ({speed[name] / speed[theirs[name]]:.2f}x)" if theirs[name] in speed else ""
        m = med[name]
        print(
            f"| {PROGRAMS[name]} | {speed[name]:,.{0 if speed[name] >= 100 else 2}f}{ratio} | {m['rss_mb']:,.0f} | "
            f"{m['loss']:.4f} ({m['own_loss']:.4f}) | {m['wall']:.1f} |"
        )
    for mode, (ours, trl) in MODES.items():
        if ours in speed and trl in speed:
            ratio, loss, trl_loss = speed[ours] / speed[trl], med[ours]["loss"], med[trl]["loss"]
            met = ratio >= GOAL and loss <= trl_loss + args.loss_tolerance
            print(
                f"RATIO {mode} ours / TRL = {ratio:.2f}; validation loss {loss:.4f} vs {trl_loss:.4f}: goal "
                f"(>= {GOAL}x at a loss at most {args.loss_tolerance} above TRL's) {'met' if met else 'NOT met'}"
            )


if __name__ == "__main__":
    main()
