"""TRL's DPOTrainer on preference pairs in jsonl files, for bench/dpo_reference.py: a minimal driver with
the flags that bench passes to train/dpo.py too, launched the same way (accelerate launch, 2 CPU
processes). TRL is what most users run for DPO; this file only feeds it, every computation is TRL's.

    accelerate launch --config_file accelerate_configs/cpu_2proc.yaml bench/reference/trl_dpo.py \
        --model_name_or_path runs/sft --train_file runs/dpo/gcide/train.jsonl \
        --validation_file runs/dpo/gcide/validation.jsonl --output_dir /tmp/trl_dpo

Writes OUTPUT_DIR/all_results.json: the final evaluation (eval_rewards/accuracies, ...) and the world size.
"""

import argparse
import gc
import json
import os


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model_name_or_path", required=True)
    parser.add_argument("--train_file", required=True)
    parser.add_argument("--validation_file", required=True)
    parser.add_argument("--output_dir", required=True)
    parser.add_argument("--per_device_train_batch_size", type=int, default=16)
    parser.add_argument("--per_device_eval_batch_size", type=int, default=32)
    parser.add_argument("--num_train_epochs", type=int, default=1)
    parser.add_argument("--learning_rate", type=float, default=1e-4)
    parser.add_argument("--num_warmup_steps", type=int, default=10)
    parser.add_argument("--beta", type=float, default=0.1)
    parser.add_argument("--max_length", type=int, default=128)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument(
        "--precompute_ref_log_probs",
        action="store_true",
        help="TRL's reference log-probabilities once before training (else a reference model's "
        "forward pass in every step)",
    )
    args = parser.parse_args()

    import datasets
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import DPOConfig, DPOTrainer

    data = datasets.load_dataset("json", data_files={"train": args.train_file, "validation": args.validation_file})
    tokenizer = AutoTokenizer.from_pretrained(args.model_name_or_path)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    config = DPOConfig(
        output_dir=args.output_dir,
        per_device_train_batch_size=args.per_device_train_batch_size,
        per_device_eval_batch_size=args.per_device_eval_batch_size,
        num_train_epochs=args.num_train_epochs,
        learning_rate=args.learning_rate,
        lr_scheduler_type="linear",
        warmup_steps=args.num_warmup_steps,
        weight_decay=0.0,
        max_grad_norm=1.0,
        beta=args.beta,
        loss_type=["sigmoid"],
        max_length=args.max_length,
        seed=args.seed,
        bf16=False,
        use_cpu=True,
        report_to=[],
        save_strategy="no",
        eval_strategy="no",
        logging_steps=50,
        precompute_ref_log_probs=args.precompute_ref_log_probs,
        dataloader_num_workers=0,
    )
    trainer = DPOTrainer(
        model=AutoModelForCausalLM.from_pretrained(args.model_name_or_path, dtype="float32"),
        args=config,
        processing_class=tokenizer,
        train_dataset=data["train"],
        eval_dataset=data["validation"],
    )
    trainer.train()
    results = trainer.evaluate()
    if trainer.accelerator.is_main_process:
        with open(os.path.join(args.output_dir, "all_results.json"), "w") as f:
            json.dump({**results, "world_size": trainer.accelerator.num_processes}, f, indent=1)
    # DDP's reducer holds gloo state: freed at interpreter exit, after the process group, it can abort the
    # finished run (SIGABRT); so the trainer goes first, then the group (as bench/reference/trl_sft.py)
    del trainer
    gc.collect()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
