"""Train a GPT language model from scratch on text with Hugging Face Accelerate.

    make train-lm          # GCIDE (offline English dictionary text), BPE, 2 CPU processes
    accelerate launch --config_file accelerate_configs/cpu_2proc.yaml train/lm.py \
        --train_file notes.txt --tokenizer bpe --max_train_steps 2000 --output_dir runs/my_lm
    python train/lm.py --output_dir runs/my_lm --prompt "Serendipity, n." --max_new_tokens 200

Text is tokenized once (on the main process) into window shards of --block_size + 1 tokens, cached
in --dataset_dir and streamed through the exactly-once sharded path (data/text.py). Every
validation token is scored once for any process count: eval_loss (nats per token) and eval_bpb
(bits per UTF-8 byte, comparable across tokenizers). The final OUTPUT_DIR is a Hugging Face GPT-2
folder (config.json, model.safetensors, tokenizer.json): AutoModelForCausalLM.from_pretrained(OUTPUT_DIR)
and AutoTokenizer.from_pretrained(OUTPUT_DIR) load it (docs/lm.md).
"""

import json
import math
import os
import sys

if __package__ in (None, ""):  # run as a file: Python put train/ on sys.path, not the repo root
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch

from data.errors import DataError, fail
from data.loader import sharded_loader
from data.shards import read_manifest, shards_in
from data.sources import ParquetSource
from data.text import ByteTokenizer, decode_windows, load_tokenizer, prepare_gcide, prepare_text
from train.core.accelerator import main_process_first
from train.core.evaluation import evaluate_language_model
from train.core.flags import add_data_files_args, add_optimizer_args, make_parser, reading_workers
from train.core.loop import TrainingLoop
from train.core.parser import positive_int
from train.core.run import run, start_run
from train.core.tracking import matmul_peak, peak_memory_mb
from train.models.gpt import GPT, GPTConfig, next_token_loss
from train.models.gpt_hf import from_gpt2, gpt_config, save_gpt2_folder

TASK = "lm"  # the run's name in its checkpoints: another task's checkpoint is refused
FEW_STEPS = 100  # a run shorter than this says what to try (the GCIDE demo takes 340)
METRICS = ["eval_bpb", "eval_loss", "eval_perplexity"]  # its evaluation's metrics, the headline first


def parse_args(argv=None):
    parser = make_parser(__doc__)
    data, model = parser.groups["data"], parser.groups["model"]
    add_data_files_args(
        parser,
        "Text: .txt, or .json/.jsonl/.csv/.parquet with --text_column (default: the GCIDE dictionary).",
        split_percentage=5,
    )
    data.add_argument("--text_column", default="text", help="The column holding the text.")
    data.add_argument(
        "--tokenizer", default="bytes", help="bytes, bpe (trained on the training text), or a tokenizer.json."
    )
    data.add_argument("--vocab_size", type=positive_int, default=8192, help="--tokenizer bpe: vocabulary size.")
    data.add_argument(
        "--dataset_dir",
        help="Prepared window shards (python -m data.prepare --tokenizer ...); "
        "the cache for --train_file (default: runs/tokens/NAME-TOKENIZER-bBLOCK, e.g. gcide-bpe8192-b256).",
    )
    data.add_argument(
        "--dataloader_num_workers",
        type=int,
        default=None,
        help="Processes reading shards per rank (default 2 on a GPU, 0 on a CPU).",
    )
    model.add_argument("--block_size", type=positive_int, default=256, help="Tokens of context.")
    model.add_argument("--n_layer", type=positive_int, default=4)
    model.add_argument("--n_head", type=positive_int, default=4)
    model.add_argument("--n_embd", type=positive_int, default=256)
    model.add_argument("--dropout", type=float, default=0.0)
    model.add_argument("--gradient_checkpointing", action="store_true", help="Recompute activations in backward.")
    model.add_argument("--prompt", help="Instead of training: continue this text with the model in --output_dir.")
    model.add_argument("--max_new_tokens", type=positive_int, default=200)
    model.add_argument("--temperature", type=float, default=0.8)
    model.add_argument("--top_k", type=positive_int, default=50)
    add_optimizer_args(parser, learning_rate=1e-3, train_batch_size=16, eval_batch_size=16, weight_decay=0.1)
    opt = parser.groups["optimization"]
    opt.add_argument("--max_grad_norm", type=float, default=1.0, help="Clip the gradient norm (0: no clipping).")
    parser.set_defaults(output_dir="runs/lm", num_train_epochs=1, num_warmup_steps=100)
    parser.recorded.update(("gcide", "dataset_dir_derived"))  # derived below and recorded in args.json
    args = parser.parse_args(argv)
    if args.prompt is None:
        try:
            GPTConfig(1, args.block_size, args.n_layer, args.n_head, args.n_embd, args.dropout).check()
        except ValueError as e:
            parser.error(str(e))
        name = os.path.splitext(os.path.basename(args.train_file[0]))[0] if args.train_file else "gcide"
        # the vocabulary is in the name, so a run with another one prepares beside this cache, not over it
        tokenizer = {"bytes": "bytes", "bpe": f"bpe{args.vocab_size}"}.get(args.tokenizer, "file")
        # a run's args.json records the folder it derived; unless the command line names one, derive it again
        # from these flags (--block_size 128 over that file must not read the 256-token windows)
        if getattr(args, "dataset_dir_derived", False) and args.dataset_dir == parser.get_default("dataset_dir"):
            args.dataset_dir = None
        args.gcide = not args.train_file and args.dataset_dir is None  # the default corpus, prepared on first use
        args.dataset_dir_derived = args.dataset_dir is None
        args.dataset_dir = args.dataset_dir or os.path.join("runs", "tokens", f"{name}-{tokenizer}-b{args.block_size}")
    return args


def prepare_data(args):
    """The window shards' manifest, written first if --dataset_dir has none (main process only)."""
    if args.train_file:
        prepare_text(
            args.train_file,
            args.dataset_dir,
            args.tokenizer,
            args.block_size,
            args.validation_file,
            None if args.validation_file else (args.validation_split_percentage or 5),
            args.text_column,
            args.vocab_size,
            seed=args.seed,
        )
    elif args.gcide:
        prepare_gcide(args.dataset_dir, args.tokenizer, args.block_size, args.vocab_size)
    manifest = read_manifest(args.dataset_dir)
    if manifest is None or "block_size" not in manifest:
        raise DataError(
            f"--dataset_dir {args.dataset_dir} holds no token shards; write them with python -m "
            "data.prepare --tokenizer ... or pass --train_file"
        )
    if manifest["block_size"] != args.block_size:
        raise DataError(
            f"--dataset_dir {args.dataset_dir} holds windows of {manifest['block_size']} tokens, not "
            f"--block_size {args.block_size}; pass --block_size {manifest['block_size']} or prepare again"
        )
    tokenizer = lm_tokenizer(args.dataset_dir, manifest)
    if tokenizer.vocab_size != manifest["vocab_size"]:
        raise DataError(
            f"the tokenizer in {args.dataset_dir} has {tokenizer.vocab_size} tokens but its shards were "
            f"written with {manifest['vocab_size']}; prepare the shards again"
        )
    return manifest


def lm_tokenizer(folder, manifest):
    return (
        ByteTokenizer() if manifest["tokenizer"] == "bytes" else load_tokenizer(os.path.join(folder, "tokenizer.json"))
    )


def main(args):
    accelerator = start_run(args, TASK)
    # a GPU step waits on an in-process read that two workers hide (docs/gpu.md); on a small CPU a worker
    # takes a core from the step instead (docs/lm.md)
    args.dataloader_num_workers = reading_workers(args.dataloader_num_workers, accelerator.device, on_gpu=2)

    # ---------------------------------------------------------------- data: tokenized once, then streamed
    manifest = main_process_first(accelerator, lambda: prepare_data(args), share=True)
    decode = decode_windows(manifest["token_dtype"])
    train_loader = sharded_loader(
        ParquetSource(shards_in(args.dataset_dir, "train"), decode=decode),
        args.per_device_train_batch_size,
        rank=accelerator.process_index,
        world_size=accelerator.num_processes,
        device=accelerator.device,
        seed=args.seed,
        train=True,
        num_workers=args.dataloader_num_workers,
    )
    eval_loader = sharded_loader(
        ParquetSource(shards_in(args.dataset_dir, "validation"), decode=decode),
        args.per_device_eval_batch_size,
        rank=accelerator.process_index,
        world_size=accelerator.num_processes,
        device=accelerator.device,
        seed=args.seed,
        train=False,
        num_workers=args.dataloader_num_workers,
    )
    accelerator.print(
        f"data: {args.dataset_dir} ({manifest['tokenizer']}, vocab {manifest['vocab_size']}): "
        f"{manifest['text']['train']['windows']} train windows, {manifest['text']['validation']['scored_tokens']}"
        f" validation tokens"
    )

    # ---------------------------------------------------------------- model, optimizer, schedule
    config = GPTConfig(manifest["vocab_size"], args.block_size, args.n_layer, args.n_head, args.n_embd, args.dropout)
    model = GPT(config)
    model.gradient_checkpointing = args.gradient_checkpointing
    # what a user comparing runs needs first; parameters() yields the tied embedding once
    accelerator.print(
        f"model: GPT, {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters, "
        f"{config.n_layer} layers, {config.n_head} heads, width {config.n_embd}, context "
        f"{config.block_size}, vocab {config.vocab_size}, {model.flops_per_token() / 1e6:.1f} MFLOPs "
        "per token (training)"
    )
    # fused: one kernel for all parameters instead of a loop over tensors (measured in docs/lm.md)
    optimizer = torch.optim.AdamW(
        model.param_groups(args.weight_decay), lr=args.learning_rate, betas=(0.9, 0.95), fused=True
    )
    model, optimizer = accelerator.prepare(model, optimizer)  # the loaders are sharded already

    steps = math.ceil(len(train_loader) / args.gradient_accumulation_steps) * args.num_train_epochs
    if steps < FEW_STEPS and args.max_train_steps is None:  # a short text in the default single epoch
        accelerator.print(
            f"note: {manifest['text']['train']['windows']:,} training windows make {steps} optimizer "
            f"steps in {args.num_train_epochs} epoch(s), too few for the model to learn much; try "
            f"--max_train_steps {FEW_STEPS * 5} (repeating the text), or a smaller --block_size"
        )

    # ---------------------------------------------------------------- train
    loop = TrainingLoop(
        accelerator,
        args,
        TASK,
        model,
        optimizer,
        train_loader,
        headline=METRICS[0],
        metrics=METRICS,
        evaluate=lambda: evaluate_language_model(accelerator, model, eval_loader, manifest["text"]["validation"]),
    )
    for batch in loop.batches():
        with accelerator.accumulate(model):
            loss = next_token_loss(model(batch["input_ids"]), batch["labels"])
            accelerator.backward(loss)
            if accelerator.sync_gradients and args.max_grad_norm > 0:
                accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        loop.after_batch(loss)
    tokens_per_second = loop.samples_per_second() * args.block_size  # a sample is one window of block_size targets
    peak = matmul_peak(accelerator)
    # the final folder is a Hugging Face GPT-2 model (train/models/gpt_hf.py); checkpoints keep our names
    results = loop.finish(
        {
            "model_config": vars(config),
            "dataset_dir": args.dataset_dir,
            "tokenizer": manifest["tokenizer"],
            "parameters": sum(p.numel() for p in accelerator.unwrap_model(model).parameters()),
            "train_tokens_per_second": tokens_per_second,
            "matmul_peak_flops": peak,
            "mfu": tokens_per_second * accelerator.unwrap_model(model).flops_per_token() / peak,
            "peak_memory_mb": peak_memory_mb(accelerator),
        },
        save_model=lambda weights, out: save_gpt2_folder(
            weights, out, config, lm_tokenizer(args.dataset_dir, manifest)
        ),
    )
    accelerator.print(
        f"train_tokens_per_second={tokens_per_second:.0f} mfu={results['mfu']:.1%} "
        f"peak_memory_mb={results['peak_memory_mb']:.0f}"
    )
    return results


def trained_model(output_dir):
    """(GPTConfig, weights in our names, tokenizer) of the run in output_dir. A Hugging Face GPT-2
    folder (its weights named transformer.*) carries its config.json and tokenizer.json; an older
    run's model.safetensors holds our names, its shape is all_results.json's model_config and its
    tokenizer is beside the token shards it names (dataset_dir)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        weights = load_file(os.path.join(output_dir, "model.safetensors"))
        dataset_dir = None
        if "transformer.wte.weight" in weights:
            with open(os.path.join(output_dir, "config.json")) as f:
                config, weights = gpt_config(json.load(f)), from_gpt2(weights)
        else:
            with open(os.path.join(output_dir, "all_results.json")) as f:
                trained = json.load(f)
            config, dataset_dir = GPTConfig(**trained["model_config"]), trained["dataset_dir"]
    except (OSError, ValueError, KeyError, TypeError, SafetensorError) as e:
        fail(
            f"--output_dir {output_dir} holds no finished train/lm.py run ({' '.join(str(e).split())[:120]}); "
            "train one there first"
        )
    if os.path.isfile(os.path.join(output_dir, "tokenizer.json")):  # the folder's own: no token shards needed
        return config, weights, load_tokenizer(os.path.join(output_dir, "tokenizer.json"))
    if dataset_dir is None:
        fail(f"--output_dir {output_dir} has no tokenizer.json; copy the run's tokenizer.json there")
    manifest = read_manifest(dataset_dir)
    if manifest is None:
        fail(f"the run's token shards ({dataset_dir}) are gone: its tokenizer is there; prepare them again")
    return config, weights, lm_tokenizer(dataset_dir, manifest)


def sample(args):
    """Continue --prompt with the model trained in --output_dir."""
    config, weights, tokenizer = trained_model(args.output_dir)
    model = GPT(config)
    try:
        missing, unexpected = model.load_state_dict(weights, strict=False)
    except RuntimeError:  # a tensor of another shape
        missing, unexpected = [], ["(shapes)"]
    if unexpected or set(missing) - {"lm_head.weight"}:  # older runs hold the tied layer once, as wte
        fail(f"model.safetensors in {args.output_dir} does not fit its config; train the run again")
    if tokenizer.vocab_size != config.vocab_size:
        fail(
            f"the tokenizer in {args.output_dir} has {tokenizer.vocab_size} tokens, its model {config.vocab_size}; "
            "train the run again"
        )
    torch.manual_seed(args.seed)
    ids = torch.tensor([tokenizer.encode_batch([args.prompt])[0] or [tokenizer.eot_id]])
    out = model.eval().generate(ids, args.max_new_tokens, args.temperature, args.top_k)[0].tolist()
    print(tokenizer.decode(out))


if __name__ == "__main__":
    arguments = parse_args()
    run(sample if arguments.prompt is not None else main, arguments)
