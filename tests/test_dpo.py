"""train/dpo.py: tiny random causal LMs (tests/hf_models.py) tuned on preference pairs whose sides differ
in length and content, in real processes.

The promise tested first: 1 process with batch 8, 2 processes with batch 2 x 2 accumulation steps and
2 FSDP2 processes with batch 4 take the same optimizer steps (the loss of a step is the mean over its
pairs, counted before the backward passes), and the metrics are exact over the validation pairs. The
reference's log-probabilities are computed once and found again by the restart; LoRA's reference is
the model with its adapters off, under DDP and FSDP2. The formulas equal TRL's DPOTrainer's on one
batch (sigmoid, ipo, robust). Before any step every reward is exactly 0 in every precision and layout
(the models ship dropout, off by default); two models that differ in a middle layer are told apart.
Then: SIGTERM and SIGKILL resumes are bit-identical, conversations score only the last assistant turn,
the folder generates (in batches too), bad input is one line each."""

import json
import math
import os
import random

import pytest
import torch

from cases_probe import (
    case_output,
    check_crash_case,
    check_sigterm_case,
    crash_case,
    launch_cases,
    run_case,
    sigterm_case,
)
from conftest import output_of, run_as_script, run_main
from data.errors import DataError
from data.preferences import PairBatch, encode_pairs, pair_segments
from hf_models import WORDS, tiny_bert, tiny_causal_lm
from test_checkpointing import identical, largest_difference, resume_copy, weights

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


REWARDS = """
def names_the_word(prompts, completions, chosen, **kwargs):
    # the chosen response's first word (the prompt's word) in the answer: the data's other columns by name
    return [float(c.split()[:1] == ch.split()[:1]) for c, ch in zip(completions, chosen)]


def characters(completions, **kwargs):
    return [float(len(c)) for c in completions]
"""


def write_jsonl(path, records):
    with open(path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)
    return str(path)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("dpo")
    (root / "rewards.py").write_text(REWARDS)
    return {
        # both ship dropout (GPT-2's layers, Llama's attention_dropout number): --disable_dropout's default removes it
        "gpt2": tiny_causal_lm(root / "gpt2", dropout=0.1),
        "llama": tiny_causal_lm(root / "llama", "llama", dropout=0.1, chat=True),
        "train": write_jsonl(root / "train.jsonl", preferences(96, 0)),
        "validation": write_jsonl(root / "validation.jsonl", preferences(N_VALIDATION, 1)),
        "chat": write_jsonl(root / "chat.jsonl", conversations(40, 2)),
        "cache": str(root / "tokens"),
        "rewards": str(root / "rewards.py"),
        "root": root,
    }


# greedy answers to the validation prompts at each evaluation, scored by two functions of the data's columns
def scored(data):
    return ["--reward_funcs", f"{data['rewards']}:names_the_word,characters", "--reward_weights", 1, 0.01]


def records(path):
    return [json.loads(line) for line in open(path)]


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


ACCUMULATED = ["--per_device_train_batch_size", 2, "--gradient_accumulation_steps", 2]


def assert_rewards_start_at_0(results):
    """An --eval_on_start run's all_results.json: before any step the policy is the reference, so every
    reward is exactly 0 (no rounding of another precision, mode or batch shape), no pair is won (a tie,
    as TRL counts it) and each pair's loss is log 2."""
    for name in ("chosen", "rejected", "margins", "accuracies"):
        assert results[f"eval_rewards/{name}_before"] == 0.0, (name, results)
    assert results["eval_loss_before"] == pytest.approx(math.log(2), abs=1e-6)


def first_step_loss(out):
    """The training loss of step 1, as metrics.jsonl logs it (--logging_steps 1)."""
    with open(out / "metrics.jsonl") as f:
        return next(json.loads(line)["train_loss"] for line in f if '"train_loss"' in line)


@pytest.fixture(scope="module")
def one(data):
    """1 process x 8, in this process: the reference of the tests below."""
    out = data["root"] / "one"
    run_main(
        "dpo",
        *args_for(data, "--per_device_train_batch_size", 8, "--eval_on_start", *scored(data), "--max_new_tokens", 6),
        "--output_dir",
        out,
        through_run=True,
    )
    return out


# the start's bf16 cases (test_before_any_step_every_reward_is_0_in_every_precision), in the launch of their config
BF16 = {
    "ddp-bf16-autocast": ("cpu_2proc", "gpt2", ["--mixed_precision", "bf16"]),
    "fsdp2-bf16": ("fsdp2_cpu_2proc", "gpt2", ["--mixed_precision", "bf16"]),
    "ddp-bf16-lora": ("cpu_2proc", "llama", ["--mixed_precision", "bf16", "--lora_r", 4]),
}


def start_case(data, name):
    config, model, extra = BF16[name]
    out = data["root"] / f"start_{name}"
    return run_case(
        name, "dpo", out, *args_for(data, "--per_device_train_batch_size", 4, *ONE_STEP, *extra, model=model)
    )


@pytest.fixture(scope="module")
def ddp_launch(data):
    """Every 2-process DDP run of this file, as cases of one launch (tests/cases_probe.py) with 2 restarts:
    the uninterrupted 2 x 2 x 2 run, the start's bf16 cases, the SIGTERM run (stopped at step 1 and
    resumed by the first restart; its own token cache) and LoRA's SIGKILL during a save (resumed by
    the second). Returns the launch."""
    root = data["root"]
    sigterm = [*args_for(data, *ACCUMULATED)]
    sigterm[sigterm.index("--cache_dir") + 1] = root / "sigterm" / "tokens"
    (root / "sigterm").mkdir()
    (root / "lora").mkdir()
    cases = [
        run_case(
            "accumulated",
            "dpo",
            root / "accumulated",
            *args_for(data, *ACCUMULATED, "--eval_on_start", *scored(data), "--max_new_tokens", 6),
        ),
        *(start_case(data, name) for name, (config, _, _) in BF16.items() if config == "cpu_2proc"),
        sigterm_case("sigterm", "dpo", root / "sigterm", *sigterm),
        crash_case("lora", "dpo", 6, root / "lora", *args_for(data, *lora_args(data), model="llama")),
    ]
    proc = launch_cases("cpu_2proc", cases, max_restarts=2)
    assert proc.returncode == 0, output_of(proc)
    return proc


@pytest.fixture(scope="module")
def accumulated(data, ddp_launch):
    """2 processes x 2 pairs x 2 accumulation steps, uninterrupted (the first case of ddp_launch)."""
    return data["root"] / "accumulated"


def case_printed(proc, name):
    """What rank 0 printed (stdout and stderr) during the case NAME of a cases_probe launch."""
    return case_output(proc.stdout, name) + case_output(proc.stderr, name)


def test_answers_are_scored_once_each_and_the_same_on_one_process_and_two(data, one, accumulated):
    """--reward_funcs: every validation prompt answered greedily once per evaluation (--eval_on_start's
    too), scored with the data's other columns; the metrics are the means of eval_completions.jsonl's
    rewards, and equal on 1 process and on 2 with accumulation."""
    prompts = [r["prompt"] for r in records(data["validation"])]
    results = {}
    for name, folder in (("one", one), ("two", accumulated)):
        result = results[name] = json.load(open(folder / "all_results.json"))
        before = {k.removesuffix("_before"): v for k, v in result.items() if k.endswith("_before")}
        evaluations = [{"step": 0, **before}] + result["history"]
        lines = records(folder / "eval_completions.jsonl")
        assert [(r["step"], r["prompt"]) for r in lines] == [(e["step"], p) for e in evaluations for p in prompts]
        for e in evaluations:
            mine = [r for r in lines if r["step"] == e["step"]]
            assert e["eval_reward"] == pytest.approx(
                sum(r["names_the_word"] + 0.01 * r["characters"] for r in mine) / len(mine)
            )
            assert e["eval_rewards/names_the_word/mean"] == pytest.approx(
                sum(r["names_the_word"] for r in mine) / len(mine)
            )
        assert e["eval_samples"] == N_VALIDATION and "eval_rewards/accuracies" in e  # beside DPO's own metrics
    for key in ("eval_reward_before", "eval_reward", "eval_rewards/characters/mean"):
        assert results["one"][key] == results["two"][key], key


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
    for result in results:  # the policy is the reference: every reward 0, the loss log 2
        assert_rewards_start_at_0(result)
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


@pytest.mark.parametrize(
    "loss_type, label_smoothing, loss_weights",
    [("sigmoid", 0.0, None), ("ipo", 0.0, None), ("robust", 0.1, None), (["sigmoid", "sft"], 0.0, [1.0, 0.5])],
)
def test_loss_and_metrics_equal_trls_dpo_trainer(data, loss_type, label_smoothing, loss_weights, tmp_path):
    """On one batch of 12 pairs, a policy and another model as the reference (so the rewards are not 0):
    our loss and TRL's metrics of the same batch, as DPOTrainer.evaluate reports them, agree to float
    rounding. bf16=False: TRL's DPOConfig turns bf16 on by default, and its reference model is then
    computed under bf16 autocast where its policy is not (1e-4 apart here). RPO (sigmoid + sft): TRL's
    sft term is the mean over a batch's chosen tokens, ours each pair's own, so TRL evaluates one pair
    per batch there and the means over the pairs compare."""
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
        for k, v in pair_metrics(*logps, batch["targets"], loss_type, 0.3, label_smoothing, loss_weights).items()
    }
    config = trl.DPOConfig(
        output_dir=str(tmp_path / "trl"),
        beta=0.3,
        loss_type=[loss_type] if isinstance(loss_type, str) else loss_type,
        loss_weights=loss_weights,
        label_smoothing=label_smoothing,
        per_device_eval_batch_size=12 if isinstance(loss_type, str) else 1,
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


def test_sigterm_saves_at_one_step_and_the_resume_finds_the_reference_and_is_bit_identical(
    data, ddp_launch, accumulated
):
    """Its own token cache: the first attempt computes the reference's log-probabilities, the restart finds
    them and ends where the uninterrupted 2 x 2 x 2 run ended (a case of the same launch)."""
    out = check_sigterm_case(ddp_launch, "sigterm", data["root"] / "sigterm", 6)
    printed = case_printed(ddp_launch, "sigterm")
    assert printed.count("pairs computed once") == 1 and printed.count("found in") == 1, printed
    assert identical(weights(out), weights(accumulated))


def lora_args(data):
    return ["--per_device_train_batch_size", 4, "--lora_r", 4, "--lora_dropout", 0.1, "--learning_rate", 1e-2]


@pytest.fixture(scope="module")
def lora(data, ddp_launch):
    """LoRA on the Llama under 2 processes, SIGKILLed as it publishes checkpoint 6 and resumed from 3 (the
    last case of ddp_launch)."""
    return ddp_launch, check_crash_case(ddp_launch, data["root"] / "lora", 6)


def test_sigkill_then_resume_is_bit_identical_with_lora_whose_reference_is_the_base(data, lora):
    proc, crashed = lora
    assert f"resumed from {crashed}/checkpoints/step_00000003" in proc.stdout
    assert "reference:" not in case_output(proc.stdout, "lora")  # no precompute: the base with the adapters off
    saved = weights(crashed / "checkpoints" / "step_00000006")
    assert saved and all("lora_" in k for k in saved), sorted(saved)[:4]
    results = json.load(open(crashed / "all_results.json"))
    assert results["eval_rewards/margins"] > 0 and results["eval_samples"] == N_VALIDATION


@pytest.fixture(scope="module")
def fsdp2_launch(data):
    """Every FSDP2 run of this file, as cases of one launch: the full model x 4 (the precomputed
    reference) and LoRA x 4 (the adapters-off reference), both from --eval_on_start, and the start's
    bf16 case."""
    root = data["root"]
    cases = [
        run_case(
            "full", "dpo", root / "fsdp2_full", *args_for(data, "--per_device_train_batch_size", 4, "--eval_on_start")
        ),
        run_case(
            "lora", "dpo", root / "fsdp2_lora", *args_for(data, *lora_args(data), "--eval_on_start", model="llama")
        ),
        *(start_case(data, name) for name, (config, _, _) in BF16.items() if config == "fsdp2_cpu_2proc"),
    ]
    proc = launch_cases("fsdp2_cpu_2proc", cases)
    assert proc.returncode == 0, output_of(proc)
    return proc


def test_fsdp2_takes_the_steps_of_one_process_with_either_reference(data, one, lora, fsdp2_launch, capsys):
    """2 FSDP2 processes x 4: the steps of 1 process x 8 with the precomputed reference, and LoRA's steps
    under DDP (the run above) with the adapters-off reference."""
    full, adapters = data["root"] / "fsdp2_full", data["root"] / "fsdp2_lora"
    # the reference computed by the sharded model
    assert "no autocast, FSDP2, eval mode" in case_output(fsdp2_launch.stdout, "full")
    assert "fsdp2: fully_shard over 2 CPU processes" in case_output(fsdp2_launch.stdout, "lora")
    for out in (full, adapters):
        assert_rewards_start_at_0(json.load(open(out / "all_results.json")))
    differences = [
        largest_difference(weights(full), weights(one)),
        largest_difference(weights(adapters), weights(lora[1])),
    ]
    with capsys.disabled():
        print(f"\n1x8 vs FSDP2 2x4 {differences[0]:.2e}; LoRA DDP vs FSDP2 {differences[1]:.2e}")
    assert max(differences) < 2e-5, differences


# ------------------------------------------------------------------------------------ the start: every reward 0

ONE_STEP = ["--max_train_steps", 1, "--logging_steps", 1, "--eval_on_start"]


@pytest.mark.parametrize("case", [*BF16, "pure-bf16"])
def test_before_any_step_every_reward_is_0_in_every_precision(data, case, request, tmp_path):
    """bf16 autocast under DDP and under FSDP2 (bf16 parameters in the forward), LoRA (its reference the
    base in the step), pure bf16 weights; fp32 under DDP and FSDP2, with and without LoRA, is checked by
    the runs above. The models ship dropout: with it off (the default) the first step's loss, on
    training batches of other shapes, is log 2 as well. The bf16 cases are runs of their config's launch
    (ddp_launch, fsdp2_launch)."""
    if case in BF16:
        config = BF16[case][0]
        proc = request.getfixturevalue("fsdp2_launch" if config.startswith("fsdp2") else "ddp_launch")
        out = data["root"] / f"start_{case}"
        printed = case_output(proc.stdout, case)
        assert "mixed_precision=bf16" in printed, output_of(proc)
        assert ("fsdp2: fully_shard" in printed) == config.startswith("fsdp2"), output_of(proc)
    else:  # one process; --mixed_precision no: bf16 weights compute in bf16
        out = tmp_path / "out"
        extra = ["--torch_dtype", "bfloat16", "--pure_low_precision"]
        args = [*args_for(data, "--per_device_train_batch_size", 4, *ONE_STEP, *extra), "--output_dir", out]
        run_main("dpo", *args, through_run=True)
    assert_rewards_start_at_0(json.load(open(out / "all_results.json")))
    assert first_step_loss(out) == pytest.approx(math.log(2), abs=2e-4)


def test_with_dropout_kept_the_header_says_so_and_the_first_step_is_noise(data, tmp_path, capsys):
    """--disable_dropout false: the reference (eval mode) and the policy (dropout) differ from the first
    training step on, and the header says why; evaluation, in eval mode, still starts at 0."""
    out = tmp_path / "out"
    proc = run_as_script(capsys, "dpo", *args_for(data, *ONE_STEP, "--disable_dropout", "false"), "--output_dir", out)
    assert proc.returncode == 0, output_of(proc)
    assert "dropout on (--disable_dropout false)" in proc.stdout and "reference is taken without dropout" in proc.stdout
    assert_rewards_start_at_0(json.load(open(out / "all_results.json")))
    assert abs(first_step_loss(out) - math.log(2)) > 5e-4, first_step_loss(out)


def test_the_dropout_the_config_holds_is_off_too():
    """Llama's attention_dropout and OPT's dropouts are numbers its modules read in training, which
    no nn.Dropout carries: without_dropout sets them (sub-configs' too) to 0; the model's own config stays."""
    from transformers import LlamaConfig, OPTConfig

    from train.models.causal_lm import without_dropout

    llama = LlamaConfig(attention_dropout=0.1)
    config, names = without_dropout(llama)
    assert names == ["attention_dropout"] and config.attention_dropout == 0.0 and llama.attention_dropout == 0.1
    config, names = without_dropout(
        OPTConfig(dropout=0.1, attention_dropout=0.1, activation_dropout=0.1, layerdrop=0.1)
    )
    assert sorted(names) == ["activation_dropout", "attention_dropout", "dropout", "layerdrop"], names


# ------------------------------------------------------------------------------------ which model: its fingerprint


def wide_llama(folder, middle=None):
    """A 6-layer Llama whose weights file is a few MiB (so its first and last MiB leave the middle layers
    out), with the tiny tokenizer; `middle`: a number added to one weight matrix of layer 2."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from hf_models import tiny_tokenizer

    tokenizer = tiny_tokenizer(folder)
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=1024,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config)
    if middle is not None:
        with torch.no_grad():
            model.model.layers[2].mlp.gate_proj.weight.add_(middle)
    model.save_pretrained(folder)
    return str(folder)


def test_two_models_that_differ_in_a_middle_layer_have_two_references_and_a_resume_is_refused(data, tmp_path, capsys):
    """Two folders alike but for layer 2 (a LoRA merged into one MLP, say): the same weights file size,
    header, first and last MiB. Each run computes its own reference; a resume onto the other is refused."""
    a, b = wide_llama(tmp_path / "a"), wide_llama(tmp_path / "b", middle=1e-3)
    first, second = (open(os.path.join(m, "model.safetensors"), "rb").read() for m in (a, b))
    mib = 1 << 20
    assert len(first) == len(second) > 3 * mib and first != second
    assert first[:mib] == second[:mib] and first[-mib:] == second[-mib:]  # what the old fingerprint read
    tokens = tmp_path / "tokens"
    common = [*args_for(data, "--max_train_steps", 1, "--checkpointing_steps", 1), "--cache_dir", tokens]
    for model in (a, b):
        out = tmp_path / f"out_{os.path.basename(model)}"
        proc = run_as_script(capsys, "dpo", *common, "--model_name_or_path", model, "--output_dir", out)
        assert proc.returncode == 0 and "pairs computed once" in proc.stdout, output_of(proc)
    references = [f for _, _, files in os.walk(tokens) for f in files if f.startswith("reference-")]
    assert len(references) == 2, references
    resumed = resume_copy(tmp_path / "out_a", 1, str(tmp_path / "resumed"))
    line = bad(
        capsys, *common, "--model_name_or_path", b, "--output_dir", resumed, "--resume_from_checkpoint", "latest"
    )
    assert f"another pretrained model than --model_name_or_path {b}" in line, line


def test_a_weights_files_hash_is_taken_once_and_again_when_the_file_changes(tmp_path, monkeypatch):
    """model_fingerprint remembers each weights file's sha256 in CACHE_DIR/model_fingerprints.json by its
    path and stat: a second start reads no weights; a file written again is hashed again."""
    from train.models import fingerprint

    folder = wide_llama(tmp_path / "model")
    read = []
    sha256 = fingerprint._sha256
    monkeypatch.setattr(fingerprint, "_sha256", lambda path: read.append(path) or sha256(path))
    cache = tmp_path / "cache"
    first = fingerprint.model_fingerprint(folder, folder, cache)
    assert fingerprint.model_fingerprint(folder, folder, cache) == first and len(read) == 1
    assert json.load(open(cache / fingerprint.FINGERPRINTS))  # whole JSON, written through a temporary file
    weights_file = os.path.join(folder, "model.safetensors")
    content = open(weights_file, "rb").read()
    with open(weights_file, "wb") as f:  # the same bytes written again: another mtime and ctime
        f.write(content)
    assert fingerprint.model_fingerprint(folder, folder, cache) == first and len(read) == 2
    assert fingerprint.model_fingerprint(folder, folder) == first and len(read) == 3  # no cache: hashed each time


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
            assert tokenizer.decode(ids) + "\n" == whole  # the rendering, less its last newline (never scored)
            scored = tokenizer.decode([t for t in labels if t != -100])
            # the earlier assistant turn is prompt; the template's newline after <|im_end|> is not the answer's
            assert scored == f"{talk[side][-1]['content']}<|im_end|>"


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


def test_the_folders_tokenizer_pads_on_the_left_so_batched_generation_continues_each_prompt(one):
    """generate() on a batch of prompts of different lengths, padded by the output folder's tokenizer,
    scores each prompt's next token as that prompt alone does; padded on the right it would not."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(one)
    model = AutoModelForCausalLM.from_pretrained(one).eval()
    assert tokenizer.padding_side == "left"
    prompts = ["define water", "define a quick small animal of the river stone"]

    def next_token_scores(*texts):
        inputs = tokenizer(list(texts), return_tensors="pt", padding=True)
        with torch.no_grad():
            out = model.generate(
                **inputs,
                max_new_tokens=1,
                do_sample=False,
                output_scores=True,
                return_dict_in_generate=True,
                pad_token_id=tokenizer.pad_token_id,
            )
        return out.scores[0]

    alone = torch.cat([next_token_scores(p) for p in prompts])
    assert (next_token_scores(*prompts) - alone).abs().max() < 1e-5
    tokenizer.padding_side = "right"  # the training batches' side: a pad token would come before the answer
    assert (next_token_scores(*prompts) - alone).abs().max() > 1e-2


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
    assert "every pair of the train data is longer than --max_seq_length 3 (" in line, line
    assert "of them in its prompt alone) and was left out; raise --max_seq_length" in line, line
    line = bad(capsys, "--model_name_or_path", tiny_bert(tmp_path / "bert"), "--train_file", data["train"], *common)
    assert "is a bert model (BertModel), not a causal language model" in line, line
    line = bad(capsys, *gpt2, "--train_file", data["train"], "--beta", 0, *common, code=2)
    assert "--beta: must be a positive number, got 0" in line, line
    line = bad(capsys, *gpt2, "--train_file", data["chat"], *common)
    assert "the preference data are conversations: the model's tokenizer has no chat template" in line, line
    assert not out.exists() or not (out / "all_results.json").exists()


def test_the_recipe_and_the_sweep_file_pass_the_scripts_own_parser(monkeypatch):
    from conftest import REPO
    from train import dpo
    from train.study.space import check_against_script, load_script, read_sweep

    monkeypatch.chdir(REPO)
    args = dpo.parse_args(["--config", "train/configs/dpo_gcide.yaml"])
    assert args.model_name_or_path == "runs/sft" and args.eval_on_start and args.beta == 0.5
    chat = dpo.parse_args(["--config", "train/configs/dpo_sums.yaml"])  # make train-dpo's, on make train-chat's
    assert chat.model_name_or_path == "runs/chat" and chat.reward_funcs == ["answer_match"]
    sweep = read_sweep("train/configs/sweep_dpo_gcide.yaml", {"n_trials": None})
    check_against_script(sweep, load_script(sweep["script"]))
    assert sweep["metric"] == "eval_loss" and sweep["direction"] == "minimize"


def test_a_pair_without_a_prompt_column_is_refused_unless_conversations():
    with pytest.raises(DataError, match=r"no column 'prompt' .* pass --prompt_column NAME"):
        pair_segments(_dataset([{"chosen": "a", "rejected": "b"}]), "train", COLUMNS, tokenizer=None)


def test_label_smoothing_is_refused_where_the_loss_has_none_and_at_half_or_more(data, tmp_path, capsys):
    common = ["--model_name_or_path", data["gpt2"], "--train_file", data["train"], "--output_dir", tmp_path / "out"]
    for loss in ("ipo", "hinge"):
        line = bad(capsys, *common, "--loss_type", loss, "--label_smoothing", 0.1, code=2)
        assert f"the {loss} loss has no label smoothing (sigmoid and robust have)" in line, line
    for loss in ("sigmoid", "robust"):
        line = bad(capsys, *common, "--loss_type", loss, "--label_smoothing", 0.5, code=2)
        assert "0.5 or more turns the preference around; pass less than 0.5" in line, line
    from train import dpo

    assert dpo.parse_args([*map(str, common), "--label_smoothing", "0.2"]).label_smoothing == 0.2
    line = bad(capsys, *common, "--loss_type", "sigmoid", "sft", "--loss_weights", 1, code=2)
    assert "--loss_weights has 1 value(s) for 2 --loss_type(s) (sigmoid sft); pass one weight per loss" in line, line
    line = bad(capsys, *common, "--loss_type", "sft", code=2)
    assert "--loss_type sft alone learns no preference; pass it beside one that does (sigmoid sft)" in line, line
    line = bad(capsys, *common, "--loss_type", "sigmoid", "ipo", "--label_smoothing", 0.1, code=2)
    assert "the ipo loss has no label smoothing" in line, line


def test_a_prompt_that_fills_the_length_leaves_its_pair_out_under_truncate_and_drop(data):
    """Under truncate only the pair whose prompt alone fills --max_seq_length is left out, and counted;
    the other long pairs are cut. Under drop those are dropped, and the prompt's pair counted apart."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(data["gpt2"])
    records = preferences(30, 8)
    wordy = {"prompt": "define " + " ".join(["water"] * 80) + "\n", "chosen": "a drink", "rejected": "a stone"}
    pairs, chat = pair_segments(_dataset([*records, wordy]), "train", COLUMNS, tokenizer)
    full, _ = encode_pairs(tokenizer, pairs[:-1], 1000, "error", "train", chat)
    prompts = [next(i for i, t in enumerate(labels) if t != -100) + 1 for labels in full["chosen_labels"]]
    limit = max(prompts) + 2  # room for every other prompt and a response token or two
    longer = sum(n > limit for n in full["length"])
    assert longer > 0 and len(tokenizer(wordy["prompt"])["input_ids"]) > limit + 1
    rows, counts = encode_pairs(tokenizer, pairs, limit, "truncate", "train", chat)
    assert counts["long_prompts"] == 1 and counts["cut"] == longer and counts["rows"] == 30 == len(rows["length"])
    assert max(rows["length"]) == limit and counts["dropped"] == 0
    rows, counts = encode_pairs(tokenizer, pairs, limit, "drop", "train", chat)
    assert counts["long_prompts"] == 1 and counts["dropped"] == longer and counts["rows"] == 30 - longer
    with pytest.raises(DataError, match="longer than --max_seq_length"):
        encode_pairs(tokenizer, pairs, limit, "error", "train", chat)


def test_pairs_whose_chosen_is_the_rejected_are_left_out_and_counted(data):
    """Their loss is log 2 whatever the model does: no gradient, only a smaller share of the step for
    the others."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(data["gpt2"])
    records = preferences(10, 9)
    for k in (3, 7):
        records[k]["rejected"] = records[k]["chosen"]
    pairs, chat = pair_segments(_dataset(records), "train", COLUMNS, tokenizer)
    rows, counts = encode_pairs(tokenizer, pairs, 256, "truncate", "train", chat)
    assert counts["same"] == 2 and counts["rows"] == 8 == len(rows["length"])
    assert all(c != r for c, r in zip(rows["chosen_input_ids"], rows["rejected_input_ids"], strict=True))


def test_a_tokenizer_without_end_of_text_and_a_prompt_of_the_other_kind_are_one_line_each(data):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(data["gpt2"])
    tokenizer.eos_token = None
    pairs, chat = pair_segments(_dataset(preferences(4, 10)), "train", COLUMNS, tokenizer)
    with pytest.raises(DataError, match=r"no end-of-text token \(eos_token\) and ends a text with nothing"):
        encode_pairs(tokenizer, pairs, 256, "truncate", "train", chat)
    chat_tokenizer = AutoTokenizer.from_pretrained(data["llama"])
    talks = [{**talk, "prompt": "hello there"} for talk in conversations(3, 5)]
    with pytest.raises(DataError, match="'prompt' holds text and 'chosen' conversations; pass the prompt as a list"):
        pair_segments(_dataset(talks), "train", COLUMNS, chat_tokenizer)
    chat_tokenizer.eos_token = None  # conversations: the chat template ends each turn
    pairs, chat = pair_segments(_dataset(conversations(3, 5)), "train", COLUMNS, chat_tokenizer)
    assert encode_pairs(chat_tokenizer, pairs, 256, "truncate", "train", chat)[1]["rows"] == 3
