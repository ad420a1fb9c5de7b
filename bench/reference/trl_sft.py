"""TRL's SFTTrainer on prompt/completion pairs in jsonl files, for bench/sft_reference.py: a minimal driver
with the flags that bench passes to train/sft.py too, launched the same way (accelerate launch, 2 CPU
processes). TRL is what most users run for supervised fine-tuning; this file only feeds it, every
computation is TRL's.

    accelerate launch --config_file accelerate_configs/cpu_2proc.yaml bench/reference/trl_sft.py \
        --model_name_or_path runs/lm --train_file pairs.jsonl --validation_file validation.jsonl \
        --max_length 256 --output_dir /tmp/trl_sft [--packing]

The rows are {"prompt": ..., "completion": ...}: TRL's prompt-completion format, end-of-text appended
to each completion, the loss on the completion's tokens only (completion_only_loss=True). Padded (the
default): padding_free=False, batches of rows of similar length (train_sampling_strategy=
"group_by_length", transformers 5's name for group_by_length=True; it groups the evaluation too; or
--train_sampling_strategy random, a plain shuffle). --packing:
packing_strategy 'bfd', best-fit decreasing into rows of --max_length that keep each example whole
(longer ones cut at the end), which TRL then trains padding-free, each example's position_ids starting
at 0 so the model's attention stays inside it; the validation rows are not packed (eval_packing=False).
Evaluation at the end of each epoch; the trained model is saved into OUTPUT_DIR.

Writes OUTPUT_DIR/all_results.json: TRL's last evaluation (eval_loss: the mean over its evaluation
batches of each batch's loss per completion token), the optimizer steps, the world size and each
process's peak resident memory so far (ru_maxrss, MB) at the end of main().
"""

import argparse
import gc
import json
import os
import resource


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model_name_or_path", required=True)
    parser.add_argument("--train_file", required=True)
    parser.add_argument("--validation_file", required=True)
    parser.add_argument("--output_dir", required=True)
    parser.add_argument("--per_device_train_batch_size", type=int, default=16)
    parser.add_argument("--per_device_eval_batch_size", type=int, default=32)
    parser.add_argument("--num_train_epochs", type=int, default=1)
    parser.add_argument("--learning_rate", type=float, default=2e-3)
    parser.add_argument("--num_warmup_steps", type=int, default=30)
    parser.add_argument("--max_length", type=int, required=True)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--packing", action="store_true", help="Pack rows ('bfd', padding-free), else pad them.")
    parser.add_argument(
        "--train_sampling_strategy",
        choices=("group_by_length", "random"),
        default="group_by_length",
        help="Padded rows' order: transformers' length-grouped sampler (the default) or a plain shuffle.",
    )
    args = parser.parse_args()

    import datasets
    import torch
    from accelerate.utils import gather_object
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    data = datasets.load_dataset("json", data_files={"train": args.train_file, "validation": args.validation_file})
    tokenizer = AutoTokenizer.from_pretrained(args.model_name_or_path)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    layout = (
        {"packing": True, "packing_strategy": "bfd", "eval_packing": False}
        if args.packing
        else {"packing": False, "padding_free": False, "train_sampling_strategy": args.train_sampling_strategy}
    )
    config = SFTConfig(
        output_dir=args.output_dir,
        per_device_train_batch_size=args.per_device_train_batch_size,
        per_device_eval_batch_size=args.per_device_eval_batch_size,
        num_train_epochs=args.num_train_epochs,
        learning_rate=args.learning_rate,
        lr_scheduler_type="linear",
        warmup_steps=args.num_warmup_steps,
        weight_decay=0.0,
        max_grad_norm=1.0,
        max_length=args.max_length,
        completion_only_loss=True,
        seed=args.seed,
        bf16=False,  # SFTConfig turns it on by default
        fp16=False,
        gradient_checkpointing=False,  # SFTConfig's default is True; train/sft.py keeps activations too
        ddp_find_unused_parameters=False,  # every weight gets a gradient, as accelerate's DDP assumes
        use_cpu=True,
        report_to=[],
        save_strategy="no",
        eval_strategy="epoch",  # as train/sft.py, which evaluates at each epoch's end
        logging_steps=50,
        dataloader_num_workers=0,
        **layout,
    )
    trainer = SFTTrainer(
        model=AutoModelForCausalLM.from_pretrained(args.model_name_or_path, dtype="float32"),
        args=config,
        processing_class=tokenizer,
        train_dataset=data["train"],
        eval_dataset=data["validation"],
    )
    trainer.train()
    trainer.save_model(args.output_dir)
    evaluation = [log for log in trainer.state.log_history if "eval_loss" in log][-1]
    peak_rss_mb = gather_object([resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024])  # Linux: kB
    if trainer.accelerator.is_main_process:
        with open(os.path.join(args.output_dir, "all_results.json"), "w") as f:
            json.dump(
                {
                    **evaluation,
                    "step": trainer.state.global_step,
                    "world_size": trainer.accelerator.num_processes,
                    "peak_rss_mb": peak_rss_mb,
                },
                f,
                indent=1,
            )
    # DDP's reducer holds gloo state: freed at interpreter exit, after the process group, it can abort the
    # finished run (SIGABRT, seen in 1 of 3 tiny runs); so the trainer goes first, then the group
    del trainer
    gc.collect()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
