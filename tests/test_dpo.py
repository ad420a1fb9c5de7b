"""train/dpo.py: tiny random causal LMs (tests/hf_models.py) tuned on preference pairs whose sides differ
in length and content, in real processes.

The promise tested first: 1 process with batch 8, 2 processes with batch 2 x 2 accumulation steps and
2 FSDP2 processes with batch 4 take the same optimizer steps (the loss of a step is the mean over its
pairs, counted before the backward passes), and the metrics are exact over the validation pairs. The
reference's log-probabilities are computed once and found again by the restart; LoRA's reference is
the model with its adapters off, under DDP and FSDP2. The formulas equal TRL's DPOTrainer's on one
batch (sigmoid, ipo, robust). Then: SIGTERM and SIGKILL resumes are bit-identical, conversations score
only the last assistant turn, the folder generates, bad input is one line each."""

import json
import random

import pytest
import torch

from conftest import launch, output_of, run_as_script, run_main
from data.errors import DataError
from data.preferences import PairBatch, encode_pairs, pair_segments
from hf_models import WORDS, tiny_bert, tiny_causal_lm
from test_checkpointing import (
    crash_during_save_and_resume,
    identical,
    largest_difference,
    sigterm_at_step_one_and_resume,
    weights,
)

N_VALIDATION = 21  # odd: fills no batch of any size used here
STEPS = [
    "--max_train_steps",
    6,
    "--checkpointing_steps",
    3,
    "--eval_steps",
    3,
    "--logging_steps",
    2,
    "--mixed_precision",
    "no",
    "--learning_rate",
    2e-3,
    "--beta",
    0.2,
]
COLUMNS = {"prompt": "prompt", "chosen": "chosen", "rejected": "rejected"}


def say(rng, most):
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, most)))


def preferences(n, seed):
    """Prompts of 1-12 words; the chosen response names the prompt's word, the rejected one another word;
    each 1 to 30 words long, so a batch's sides differ up to 30x in length."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        word, other = rng.sample(WORDS, 2)
        out.append(
            {
                "prompt": f"define {word} {say(rng, 11)}\n",
                "chosen": f"{word} means {say(rng, 28)}",
                "rejected": f"{other} is {say(rng, 28)}",
            }
        )
    return out


def conversations(n, seed):
    """TRL's conversational format with an implicit prompt: the two sides share their first turns."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        shared = [
            {"role": "user", "content": say(rng, 6)},
            {"role": "assistant", "content": say(rng, 6)},
            {"role": "user", "content": say(rng, 6)},
        ]
        out.append(
            {
                "chosen": shared + [{"role": "assistant", "content": say(rng, 9)}],
                "rejected": shared + [{"role": "assistant", "content": say(rng, 9)}],
            }
        )
    return out


def write_jsonl(path, records):
    with open(path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)
    return str(path)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("dpo")
    return {
        "gpt2": tiny_causal_lm(root / "gpt2"),
        "llama": tiny_causal_lm(root / "llama", "llama", chat=True),
        "train": write_jsonl(root / "train.jsonl", preferences(96, 0)),
        "validation": write_jsonl(root / "validation.jsonl", preferences(N_VALIDATION, 1)),
        "chat": write_jsonl(root / "chat.jsonl", conversations(40, 2)),
        "cache": str(root / "tokens"),
        "root": root,
    }


def args_for(data, *extra, model="gpt2"):
    return [
        "--model_name_or_path",
        data[model],
        "--train_file",
        data["train"],
        "--validation_file",
        data["validation"],
        "--cache_dir",
        data["cache"],
        *STEPS,
        *extra,
    ]


def dpo_run(config, data, out, *extra, model="gpt2"):
    proc = launch(config, "dpo", *args_for(data, *extra, model=model), "--output_dir", out)
    assert proc.returncode == 0, output_of(proc)
    return proc


ACCUMULATED = ["--per_device_train_batch_size", 2, "--gradient_accumulation_steps", 2]


@pytest.fixture(scope="module")
def one(data):
    """1 process x 8, in this process: the reference of the tests below."""
    out = data["root"] / "one"
    run_main(
        "dpo",
        *args_for(data, "--per_device_train_batch_size", 8, "--eval_on_start"),
        "--output_dir",
        out,
        through_run=True,
    )
    return out


@pytest.fixture(scope="module")
def accumulated(data):
    """2 processes x 2 pairs x 2 accumulation steps, uninterrupted."""
    out = data["root"] / "accumulated"
    dpo_run("cpu_2proc", data, out, *ACCUMULATED)
    return out


def test_one_process_and_two_with_accumulation_take_the_same_steps(data, one, accumulated, capsys):
    start = weights(data["gpt2"])
    moved = largest_difference(weights(one), {k: start[k] for k in weights(one)})
    difference = largest_difference(weights(one), weights(accumulated))
    with capsys.disabled():
        print(f"\nlargest weight change {moved:.2e}; 1x8 vs 2x2x2 {difference:.2e}")
    assert moved > 1e-3 and difference < 2e-5, (moved, difference)
    results = [json.load(open(folder / "all_results.json")) for folder in (one, accumulated)]
    assert all(r["eval_samples"] == N_VALIDATION for r in results)  # every validation pair once
    for metric in ("eval_loss", "eval_rewards/margins", "eval_logps/chosen", "eval_rewards/accuracies"):
        assert abs(results[1][metric] - results[0][metric]) < 1e-4, metric
    assert results[0]["eval_loss_before"] == pytest.approx(0.6931, abs=1e-4)  # log 2: the policy is the reference
    history = [h["eval_loss"] for h in results[0]["history"]]
    assert len(history) == 2 and history[-1] < history[0] < 0.6931  # the chosen side gains on the rejected one
    assert results[0]["eval_rewards/accuracies"] > 0.6, results[0]


def test_the_usual_mean_per_micro_batch_would_take_another_step(data, capsys):
    """One AdamW step over 8 pairs as one batch and as 4 micro-batches of 2: the same step with the loss a
    mean over the step's pairs (what the runs above take), another one with uneven micro-batches' means
    averaged (micro-batches of 1, 3, 1 and 3 pairs)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from train.dpo import preference_loss, sequence_logps

    tokenizer = AutoTokenizer.from_pretrained(data["gpt2"])
    pairs, chat = pair_segments(_dataset(preferences(8, 0)), "train", COLUMNS, tokenizer)
    rows, _ = encode_pairs(tokenizer, pairs, 128, "error", "train", chat)
    reference = AutoModelForCausalLM.from_pretrained(data["gpt2"])

    def step(groups, per_pair):
        model = AutoModelForCausalLM.from_pretrained(data["gpt2"])
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        for group in groups:
            batch = PairBatch(tokenizer.eos_token_id)({k: [v[i] for i in group] for k, v in rows.items()})
            with torch.no_grad():
                ref = sequence_logps(reference(input_ids=batch["input_ids"]).logits, batch["labels"])
            logps = sequence_logps(
                model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits, batch["labels"]
            )
            losses, _, _ = preference_loss(logps, ref + 0.5, batch["targets"], "sigmoid", 0.5)
            (losses.sum() / 8 if per_pair else losses.mean() / len(groups)).backward()
        optimizer.step()
        return model.state_dict()

    whole = step([range(8)], True)
    ours, mean = (
        largest_difference(whole, step([[0], [1, 2, 3], [4], [5, 6, 7]], per_pair)) for per_pair in (True, False)
    )
    with capsys.disabled():
        print(f"\none batch vs 4 micro-batches: per pair {ours:.1e}, mean per micro-batch {mean:.1e}")
    assert ours < 1e-5 < 1e-4 < mean


def _dataset(records):
    import datasets

    return datasets.Dataset.from_list(records)


@pytest.mark.parametrize("loss_type, label_smoothing", [("sigmoid", 0.0), ("ipo", 0.0), ("robust", 0.1)])
def test_loss_and_metrics_equal_trls_dpo_trainer(data, loss_type, label_smoothing, tmp_path):
    """On one batch of 12 pairs, a policy and another model as the reference (so the rewards are not 0):
    our loss and TRL's metrics of the same batch, as DPOTrainer.evaluate reports them, agree to float
    rounding. bf16=False: TRL's DPOConfig turns bf16 on by default, and its reference model is then
    computed under bf16 autocast where its policy is not (1e-4 apart here)."""
    trl = pytest.importorskip("trl")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from train.dpo import pair_metrics, sequence_logps

    policy, other = data["gpt2"], tiny_causal_lm(tmp_path / "reference", seed=1)
    tokenizer = AutoTokenizer.from_pretrained(policy)
    records = preferences(12, 3)
    pairs, chat = pair_segments(_dataset(records), "train", COLUMNS, tokenizer)
    rows, _ = encode_pairs(tokenizer, pairs, 512, "error", "train", chat)
    batch = PairBatch(tokenizer.eos_token_id)(rows)
    with torch.no_grad():
        logps = [
            sequence_logps(
                AutoModelForCausalLM.from_pretrained(folder)
                .eval()(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
                .logits,
                batch["labels"],
            )
            for folder in (policy, other)
        ]
    ours = {
        k: v.float().mean().item()
        for k, v in pair_metrics(*logps, batch["targets"], loss_type, 0.3, label_smoothing).items()
    }
    config = trl.DPOConfig(
        output_dir=str(tmp_path / "trl"),
        beta=0.3,
        loss_type=[loss_type],
        label_smoothing=label_smoothing,
        per_device_eval_batch_size=12,
        report_to=[],
        use_cpu=True,
        bf16=False,
        max_length=None,
    )
    trainer = trl.DPOTrainer(
        model=AutoModelForCausalLM.from_pretrained(policy),
        ref_model=AutoModelForCausalLM.from_pretrained(other),
        args=config,
        processing_class=tokenizer,
        train_dataset=_dataset(records),
        eval_dataset=_dataset(records),
    )
    theirs = trainer.evaluate()
    assert 0 < ours["rewards/accuracies"] < 1 and abs(ours["rewards/margins"]) > 1e-3, ours  # not a trivial batch
    for name, value in ours.items():
        assert value == pytest.approx(theirs[f"eval_{name}"], abs=2e-5, rel=1e-5), (name, value, theirs)


# ------------------------------------------------------------------------------------ the reference and resume


def test_sigterm_saves_at_one_step_and_the_resume_finds_the_reference_and_is_bit_identical(data, accumulated, tmp_path):
    """Its own token cache: the first attempt computes the reference's log-probabilities, the restart finds
    them and ends where the uninterrupted 2 x 2 x 2 run ended."""
    args = args_for(data, *ACCUMULATED)
    args[args.index("--cache_dir") + 1] = tmp_path / "tokens"
    proc, out = sigterm_at_step_one_and_resume("cpu_2proc", "dpo", 6, tmp_path, *args)
    printed = output_of(proc)
    assert printed.count("pairs computed once") == 1 and printed.count("found in") == 1, printed
    assert identical(weights(out), weights(accumulated))


def lora_args(data):
    return ["--per_device_train_batch_size", 4, "--lora_r", 4, "--lora_dropout", 0.1, "--learning_rate", 1e-2]


@pytest.fixture(scope="module")
def lora(data, tmp_path_factory):
    """LoRA on the Llama under 2 processes, SIGKILLed as it publishes checkpoint 6 and resumed from 3."""
    folder = tmp_path_factory.mktemp("lora")
    return crash_during_save_and_resume("cpu_2proc", "dpo", 6, folder, *args_for(data, *lora_args(data), model="llama"))


def test_sigkill_then_resume_is_bit_identical_with_lora_whose_reference_is_the_base(data, lora):
    proc, crashed = lora
    assert f"resumed from {crashed}/checkpoints/step_00000003" in proc.stdout
    assert "reference:" not in proc.stdout  # no precompute: the base with the adapters off
    saved = weights(crashed / "checkpoints" / "step_00000006")
    assert saved and all("lora_" in k for k in saved), sorted(saved)[:4]
    results = json.load(open(crashed / "all_results.json"))
    assert results["eval_rewards/margins"] > 0 and results["eval_samples"] == N_VALIDATION


def test_fsdp2_takes_the_steps_of_one_process_with_either_reference(data, one, lora, tmp_path, capsys):
    """2 FSDP2 processes x 4: the steps of 1 process x 8 with the precomputed reference, and LoRA's steps
    under DDP (the run above) with the adapters-off reference."""
    full = tmp_path / "full"
    dpo_run("fsdp2_cpu_2proc", data, full, "--per_device_train_batch_size", 4)
    adapters = tmp_path / "lora"
    proc = dpo_run("fsdp2_cpu_2proc", data, adapters, *lora_args(data), model="llama")
    assert "fsdp2: fully_shard over 2 CPU processes" in proc.stdout
    differences = [
        largest_difference(weights(full), weights(one)),
        largest_difference(weights(adapters), weights(lora[1])),
    ]
    with capsys.disabled():
        print(f"\n1x8 vs FSDP2 2x4 {differences[0]:.2e}; LoRA DDP vs FSDP2 {differences[1]:.2e}")
    assert max(differences) < 2e-5, differences


# ------------------------------------------------------------------------------------ conversations, outputs


def test_conversations_score_only_the_last_assistant_turn(data):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(data["llama"])
    talks = conversations(3, 5)
    pairs, chat = pair_segments(_dataset(talks), "train", COLUMNS, tokenizer)
    rows, _ = encode_pairs(tokenizer, pairs, 256, "error", "train", chat)
    assert chat
    for k, talk in enumerate(talks):
        for side in ("chosen", "rejected"):
            whole = tokenizer.apply_chat_template(talk[side], tokenize=False)
            ids, labels = rows[f"{side}_input_ids"][k], rows[f"{side}_labels"][k]
            assert tokenizer.decode(ids + [labels[-1]]) == whole  # the rendering, shifted by one
            scored = tokenizer.decode([t for t in labels if t != -100])
            assert scored == f"{talk[side][-1]['content']}<|im_end|>\n"  # the earlier assistant turn is prompt


def test_llama_tunes_on_conversations_and_its_folder_answers_a_user_turn(data, tmp_path, capsys):
    out = tmp_path / "chat"
    proc = run_as_script(
        capsys,
        "dpo",
        "--model_name_or_path",
        data["llama"],
        "--train_file",
        data["chat"],
        "--cache_dir",
        data["cache"],
        *STEPS,
        "--output_dir",
        out,
    )
    assert proc.returncode == 0 and "validation (10% of --train_file held out) 4 pairs" in proc.stdout, output_of(proc)
    assert json.load(open(out / "args.json"))["conversational"] is True
    proc = run_as_script(capsys, "dpo", "--output_dir", out, "--prompt", "quick animal", "--max_new_tokens", 3)
    assert proc.returncode == 0 and proc.stdout.startswith("quick animal\t"), output_of(proc)
    from transformers import AutoModelForCausalLM

    assert AutoModelForCausalLM.from_pretrained(out).config.model_type == "llama"
    from train import dpo  # the run's args.json reruns it: every key it records is accepted

    again = dpo.parse_args(["--config", str(out / "args.json"), "--output_dir", "elsewhere"])
    assert again.conversational is True and again.beta == 0.2


# ------------------------------------------------------------------------------------ bad input, one line each


def bad(capsys, *args, code=1):
    proc = run_as_script(capsys, "dpo", *args)
    lines = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode == code and len(lines) == 1, output_of(proc)
    return lines[0]


def test_bad_input_is_one_line_and_writes_no_run(data, tmp_path, capsys):
    out = tmp_path / "out"
    common = ["--cache_dir", data["cache"], "--output_dir", out]
    gpt2 = ["--model_name_or_path", data["gpt2"]]
    line = bad(capsys, *gpt2, "--train_file", data["train"], "--rejected_column", "worse", *common)
    assert "no column 'worse'" in line and "(columns: prompt, chosen, rejected)" in line, line
    same = write_jsonl(tmp_path / "same.jsonl", [{**r, "rejected": r["chosen"]} for r in preferences(20, 4)])
    line = bad(capsys, *gpt2, "--train_file", same, *common)
    assert "the chosen response is the rejected one: nothing to prefer" in line, line
    empty = write_jsonl(
        tmp_path / "empty.jsonl",
        preferences(10, 5) + [{"prompt": "define tree\n", "chosen": "", "rejected": "a stone"}],
    )
    line = bad(capsys, *gpt2, "--train_file", empty, "--validation_file", data["validation"], *common)
    assert "the train pair 'define tree' has an empty chosen response" in line, line
    line = bad(capsys, *gpt2, "--train_file", data["train"], "--max_seq_length", 3, *common)
    assert "its prompt alone is" in line, line
    line = bad(capsys, "--model_name_or_path", tiny_bert(tmp_path / "bert"), "--train_file", data["train"], *common)
    assert "is a bert model (BertModel), not a causal language model" in line, line
    line = bad(capsys, *gpt2, "--train_file", data["train"], "--beta", 0, *common, code=2)
    assert "--beta: must be a positive number, got 0" in line, line
    line = bad(capsys, *gpt2, "--train_file", data["chat"], *common)
    assert "has no chat template to render them" in line, line
    assert not out.exists() or not (out / "all_results.json").exists()


def test_the_recipe_and_the_sweep_file_pass_the_scripts_own_parser(monkeypatch):
    from conftest import REPO
    from train import dpo
    from train.study.space import check_against_script, load_script, read_sweep

    monkeypatch.chdir(REPO)
    args = dpo.parse_args(["--config", "train/configs/dpo_gcide.yaml"])
    assert args.model_name_or_path == "runs/sft" and args.eval_on_start and args.beta == 0.5
    sweep = read_sweep("train/configs/sweep_dpo_gcide.yaml", {"n_trials": None})
    check_against_script(sweep, load_script(sweep["script"]))
    assert sweep["metric"] == "eval_loss" and sweep["direction"] == "minimize"


def test_a_pair_without_a_prompt_column_is_refused_unless_conversations():
    with pytest.raises(DataError, match=r"no column 'prompt' .* pass --prompt_column NAME"):
        pair_segments(_dataset([{"chosen": "a", "rejected": "b"}]), "train", COLUMNS, tokenizer=None)
