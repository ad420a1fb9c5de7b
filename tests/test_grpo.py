"""train/grpo.py: online RL with verifiable rewards on tiny random causal LMs (tests/hf_models.py), in
real processes.

The promise tested first: 1 process with 8 completions per device, 2 processes with 2 x 2 accumulation
steps and 2 FSDP2 processes with 4 take the same optimizer steps (a group's answers depend only on the
seed, the step, the prompt and the weights; each loss type's normaliser is the whole step's), with a
KL to the reference and two passes over each step's answers; the evaluation is exact over the
validation prompts. Then: the first pass's ratio is exactly 1, equal rewards teach nothing and are
counted, each loss type's micro-batch shares add up to the step's loss, SIGKILL and SIGTERM resumes
are bit-identical, LoRA's reference is the model with its adapters off, the folder answers --prompt,
and bad input is one line each. The formulas against TRL's: tests/test_grpo_trl.py."""

import json
import random
import shutil

import pytest
import torch

from cases_probe import check_crash_case, check_sigterm_case, crash_case, launch_cases, run_case, sigterm_case
from conftest import launch, output_of, run_as_script, run_main
from hf_models import WORDS, tiny_bert, tiny_causal_lm
from test_checkpointing import identical, largest_difference, weights

N_VALIDATION = 7  # odd: fills no evaluation batch of any size used here
REWARDS = '''
def mentions(completions, answer, **kwargs):
    """1 when the answer names the prompt's first word."""
    return [float(a in c) for c, a in zip(completions, answer)]


def brevity(completions, **kwargs):
    """Shorter is better; None for an empty answer (not applicable)."""
    return [None if not c else 1 - len(c) / 40 for c in completions]


def constant(completions, **kwargs):
    return [1.0] * len(completions)


def raises(prompts, **kwargs):
    raise KeyError("no such thing")


def too_few(completions, **kwargs):
    return [0.0]
'''
STEPS = [
    "--max_train_steps",
    4,
    "--num_iterations",
    2,
    "--checkpointing_steps",
    2,
    "--eval_steps",
    2,
    "--logging_steps",
    1,
    "--num_generations",
    4,
    "--max_completion_length",
    10,
    "--mixed_precision",
    "no",
    "--learning_rate",
    5e-3,
    "--beta",
    0.1,
    "--per_device_eval_batch_size",
    3,
]


def prompts(n, seed):
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        words = rng.sample(WORDS, 3)
        rows.append({"prompt": " ".join(words), "answer": words[0]})
    return rows


def write_jsonl(path, records):
    with open(path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)
    return str(path)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("grpo")
    rewards = root / "rewards.py"
    rewards.write_text(REWARDS)
    chat = [{"prompt": [{"role": "user", "content": r["prompt"]}], "answer": r["answer"]} for r in prompts(24, 3)]
    return {
        "gpt2": tiny_causal_lm(root / "gpt2"),
        "llama": tiny_causal_lm(root / "llama", "llama", chat=True),
        "train": write_jsonl(root / "train.jsonl", prompts(48, 0)),
        "validation": write_jsonl(root / "validation.jsonl", prompts(N_VALIDATION, 1)),
        "chat": write_jsonl(root / "chat.jsonl", chat),
        "rewards": f"{rewards}:mentions,brevity",
        "file": str(rewards),
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
        "--reward_funcs",
        data["rewards"],
        *STEPS,
        *extra,
    ]


def grpo_run(config, data, out, *extra, model="gpt2"):
    proc = launch(config, "grpo", *args_for(data, *extra, model=model), "--output_dir", out)
    assert proc.returncode == 0, output_of(proc)
    return proc


ACCUMULATED = ["--per_device_train_batch_size", 2, "--gradient_accumulation_steps", 2]
TOGETHER = ["--generation_batch_size", 8]  # a step's two groups in one batch (the prompts padded to one length)


@pytest.fixture(scope="module")
def one(data):
    """1 process x 8 completions, in this process: the reference of the tests below."""
    out = data["root"] / "one"
    run_main(
        "grpo",
        *args_for(data, "--per_device_train_batch_size", 8, "--eval_on_start", *TOGETHER),
        "--output_dir",
        out,
        through_run=True,
    )
    return out


@pytest.fixture(scope="module")
def ddp_launch(data):
    """The 2-process DDP runs of this file that succeed, as cases of one launch (tests/cases_probe.py) with
    2 restarts: the uninterrupted 2 x 2 x 2 run, the SIGTERM test's uninterrupted reference (one pass
    per step), the SIGTERM run (stopped at step 1, resumed by the first restart) and LoRA's SIGKILL
    during a save (resumed by the second). Returns the launch."""
    root = data["root"]
    (root / "sigterm").mkdir()
    (root / "lora").mkdir()
    lora = ["--per_device_train_batch_size", 4, "--lora_r", 4, "--learning_rate", 2e-2]
    cases = [
        run_case("accumulated", "grpo", root / "accumulated", *args_for(data, *ACCUMULATED, *TOGETHER)),
        run_case("reference", "grpo", root / "reference", *args_for(data, *ACCUMULATED, "--num_iterations", 1)),
        sigterm_case(
            "sigterm",
            "grpo",
            root / "sigterm",
            *args_for(data, *ACCUMULATED, "--num_iterations", 1, "--max_train_steps", 4),
        ),
        crash_case("lora", "grpo", 4, root / "lora", *args_for(data, *lora, model="llama")),
    ]
    proc = launch_cases("cpu_2proc", cases, max_restarts=2)
    assert proc.returncode == 0, output_of(proc)
    return proc


@pytest.fixture(scope="module")
def accumulated(data, ddp_launch):
    """2 processes x 2 completions x 2 accumulation steps, uninterrupted (the first case of ddp_launch)."""
    return data["root"] / "accumulated"


def records(path):
    return [json.loads(line) for line in open(path)]


def test_one_process_and_two_with_accumulation_take_the_same_steps(data, one, accumulated, capsys):
    start = weights(data["gpt2"])
    moved = largest_difference(weights(one), {k: start[k] for k in weights(one)})
    difference = largest_difference(weights(one), weights(accumulated))
    with capsys.disabled():
        print(f"\nlargest weight change {moved:.2e}; 1x8 vs 2x2x2 {difference:.2e}")
    assert moved > 1e-3 and difference < 2e-5, (moved, difference)
    results = [json.load(open(folder / "all_results.json")) for folder in (one, accumulated)]
    assert all(r["eval_samples"] == N_VALIDATION for r in results)  # every validation prompt once
    for metric in ("eval_reward", "eval_rewards/mentions/mean", "eval_rewards/brevity/mean"):
        assert results[1][metric] == pytest.approx(results[0][metric], abs=1e-6), metric
    assert "eval_reward_before" in results[0] and len(results[0]["history"]) == 2
    # the step's metrics, as TRL names them, logged at every step of both runs alike
    logs = [[r for r in records(f / "metrics.jsonl") if "reward" in r] for f in (one, accumulated)]
    assert [r["step"] for r in logs[0]] == [1, 2, 3, 4] == [r["step"] for r in logs[1]]
    for a, b in zip(*logs, strict=True):
        for key in ("reward", "reward_std", "frac_reward_zero_std", "completions/mean_length", "rewards/brevity/std"):
            assert a[key] == pytest.approx(b[key], abs=1e-6), key
        for key in ("kl", "entropy", "clip_ratio/region_mean"):
            assert a[key] == pytest.approx(b[key], abs=1e-4), key
    assert logs[0][0]["kl"] == 0.0 and logs[0][2]["kl"] > 0  # the policy is the reference before its first step
    # every answer of every logged step, with its reward and advantage; each group's advantages sum to 0
    answers = records(one / "completions.jsonl")
    assert len(answers) == 4 * 8 and {"prompt", "completion", "reward", "advantage", "mentions"} <= set(answers[0])
    for g in range(0, len(answers), 4):
        assert abs(sum(a["advantage"] for a in answers[g : g + 4])) < 1e-4
    assert answers == records(accumulated / "completions.jsonl")  # the same answers on either layout
    evaluated = records(one / "eval_completions.jsonl")
    assert len(evaluated) == 3 * N_VALIDATION and {r["step"] for r in evaluated} == {0, 2, 4}


def test_fsdp2_takes_the_steps_of_one_process(data, one, tmp_path, capsys):
    out = tmp_path / "fsdp2"
    proc = grpo_run("fsdp2_cpu_2proc", data, out, "--per_device_train_batch_size", 4, *TOGETHER)
    assert "fsdp2: fully_shard over 2 CPU processes" in proc.stdout
    difference = largest_difference(weights(out), weights(one))
    with capsys.disabled():
        print(f"\n1x8 vs FSDP2 2x4 {difference:.2e}")
    assert difference < 2e-5, difference
    results = [json.load(open(folder / "all_results.json")) for folder in (one, out)]
    assert results[1]["eval_reward"] == pytest.approx(results[0]["eval_reward"], abs=1e-6)


# ------------------------------------------------------------------------------------ the step's arithmetic


def test_the_first_pass_ratio_is_exactly_one_and_equal_rewards_teach_nothing(data, tmp_path):
    from transformers import AutoModelForCausalLM

    from train.grpo import logps_and_mask, padded_rows

    model = AutoModelForCausalLM.from_pretrained(data["gpt2"]).eval()
    rows = padded_rows([[1, 2, 3], [4, 5]], [[6, 7, 8, 9], [10]], pad=0)
    with torch.no_grad():  # the policy that sampled, and the same policy in the step: the same numbers
        first, mask, _ = logps_and_mask(model, rows, 0.7)
        again, _, _ = logps_and_mask(model, rows, 0.7)
    assert torch.equal(first, again) and mask.sum() == 5
    assert torch.equal(torch.exp(again - first)[mask], torch.ones(5))
    # each completion token's log-probability given everything before it, as a model reads it one step at a time
    with torch.no_grad():
        for row, (prompt, completion) in enumerate([([1, 2, 3], [6, 7, 8, 9]), ([4, 5], [10])]):
            for j, token in enumerate(completion):
                logits = model(torch.tensor([prompt + completion[:j]])).logits[0, -1] / 0.7
                expected = torch.log_softmax(logits, -1)[token]
                assert first[row][mask[row]][j] == pytest.approx(expected.item(), abs=1e-5), (row, j)
    out = tmp_path / "constant"
    run_main(
        "grpo",
        *args_for(data, "--per_device_train_batch_size", 8, "--beta", 0),
        "--reward_funcs",
        f"{data['file']}:constant",
        "--output_dir",
        out,
        through_run=True,
    )
    assert identical(weights(out), weights(data["gpt2"]))  # every advantage 0, no KL: no gradient
    logged = [r for r in records(out / "metrics.jsonl") if "reward" in r]
    assert all(r["frac_reward_zero_std"] == 1.0 and r["reward_std"] == 0.0 for r in logged)


@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "bnpo", "dr_grpo"])
def test_micro_batch_shares_add_up_to_the_steps_loss(loss_type):
    """The step's loss computed whole, and as the sum of its micro-batches' shares (any split, rows of
    different lengths): equal, as the gradient of a step on any layout needs."""
    from train.grpo import normalised_sum

    torch.manual_seed(0)
    token_loss, mask = torch.randn(8, 6), (torch.rand(8, 6) > 0.3).float()
    token_loss = token_loss * mask
    answers, tokens = 8, int(mask.sum())
    whole = normalised_sum(token_loss, mask, loss_type, answers, tokens, 6)
    for split in ([4, 4], [2, 2, 2, 2], [1] * 8):
        parts = zip(token_loss.split(split), mask.split(split), strict=True)
        shares = sum(normalised_sum(t, m, loss_type, answers, tokens, 6) for t, m in parts)
        assert shares == pytest.approx(whole.item(), rel=1e-6), split
    expected = {
        "grpo": (token_loss.sum(1) / mask.sum(1).clamp(min=1)).mean(),
        "dapo": token_loss.sum() / tokens,
        "bnpo": token_loss.sum() / tokens,
        "dr_grpo": token_loss.sum() / (answers * 6),
    }[loss_type]
    assert whole.item() == pytest.approx(expected.item(), rel=1e-6)


def test_a_groups_answers_depend_on_its_seed_alone(data):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from train.models.rollout import end_ids, sample_groups

    model = AutoModelForCausalLM.from_pretrained(data["gpt2"]).eval()
    tokenizer = AutoTokenizer.from_pretrained(data["gpt2"])
    eos = end_ids(model, tokenizer)
    prompts = [tokenizer("quick brown")["input_ids"], tokenizer("water")["input_ids"]]

    def draw(seeds, which=prompts):
        return sample_groups(model, which, 4, 12, eos, eos[0], 1.0, seeds)

    first = draw([7, 8])
    draw([1, 2], [tokenizer("another one")["input_ids"]] * 2)  # in between
    torch.manual_seed(123)  # the global generator plays no part
    assert draw([7, 8]) == first
    assert len({tuple(ids) for ids, _ in first[:4]}) > 1  # sampled: a group's answers differ
    assert draw([7, 9])[:4] == first[:4] and draw([7, 9])[4:] != first[4:]  # each group's noise is its own


# ------------------------------------------------------------------------------------ resume, LoRA, the folder


def test_sigterm_saves_at_one_step_and_the_resume_is_bit_identical(data, ddp_launch):
    """Against the uninterrupted reference with one pass per step, a case of the same launch."""
    reference = data["root"] / "reference"
    out = check_sigterm_case(ddp_launch, "sigterm", data["root"] / "sigterm", 4)
    assert identical(weights(out), weights(reference))
    for name in ("completions.jsonl", "eval_completions.jsonl"):  # each step's lines once, as uninterrupted
        assert records(out / name) == records(reference / name), name


@pytest.fixture(scope="module")
def lora(data, ddp_launch):
    """LoRA on the Llama under 2 processes (KL to the adapters-off model), SIGKILLed as it publishes
    checkpoint 4 and resumed from 2 (the last case of ddp_launch)."""
    return ddp_launch, check_crash_case(ddp_launch, data["root"] / "lora", 4)


def test_sigkill_then_resume_is_bit_identical_with_lora_whose_reference_is_the_base(data, lora):
    proc, crashed = lora
    assert f"resumed from {crashed}/checkpoints/step_00000002" in proc.stdout
    saved = weights(crashed / "checkpoints" / "step_00000004")
    assert saved and all("lora_" in k for k in saved), sorted(saved)[:4]
    logged = [r for r in records(crashed / "metrics.jsonl") if "kl" in r]
    assert logged[-1]["kl"] > 0  # the adapters moved away from the base, the reference


def test_conversations_train_and_the_folder_answers_a_user_turn(data, tmp_path, capsys):
    out = tmp_path / "chat"
    proc = run_as_script(
        capsys,
        "grpo",
        "--model_name_or_path",
        data["llama"],
        "--train_file",
        data["chat"],
        "--reward_funcs",
        data["rewards"],
        *STEPS,
        "--output_dir",
        out,
    )
    assert proc.returncode == 0 and "; chat template" in proc.stdout, output_of(proc)
    answer = records(out / "completions.jsonl")[0]
    assert answer["prompt"][0]["role"] == "user" and isinstance(answer["completion"], str)
    assert json.load(open(out / "args.json"))["conversational"] is True
    proc = run_as_script(capsys, "grpo", "--output_dir", out, "--prompt", "quick animal")
    assert proc.returncode == 0 and proc.stdout.startswith("quick animal\t"), output_of(proc)


# ------------------------------------------------------------------------------------ bad input, one line each


def bad(capsys, *args, code=1):
    proc = run_as_script(capsys, "grpo", *args)
    lines = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode == code and len(lines) == 1, output_of(proc)
    return lines[0]


def test_bad_input_is_one_line(data, tmp_path, capsys):
    from transformers import AutoTokenizer

    out = tmp_path / "out"
    common = ["--output_dir", out, "--max_train_steps", 1, "--max_completion_length", 4]
    gpt2 = ["--model_name_or_path", data["gpt2"], "--train_file", data["train"]]
    rewards = ["--reward_funcs", data["rewards"]]
    line = bad(capsys, *gpt2, *rewards, "--num_generations", 1, *common, code=2)
    assert "--num_generations 1: an answer alone has no group" in line, line
    line = bad(capsys, *gpt2, *rewards, "--num_generations", 3, *common)
    assert "8 completions per step" in line and "whole groups of --num_generations 3" in line, line
    line = bad(capsys, *gpt2, *rewards, "--prompt_column", "question", *common)
    assert "no column 'question'" in line and "(columns: prompt, answer)" in line, line
    line = bad(capsys, *gpt2, "--reward_funcs", "nowhere.py:f", *common)
    assert "no such file nowhere.py" in line, line
    line = bad(capsys, *gpt2, "--reward_funcs", f"{data['file']}:missing", *common)
    assert "defines no function missing (its functions: brevity, constant, mentions, raises, too_few)" in line, line
    line = bad(capsys, *gpt2, "--reward_funcs", "correctness", *common)
    assert "neither FILE.py:NAME nor a built-in reward" in line, line
    line = bad(capsys, *gpt2, "--reward_funcs", f"{data['file']}:brevity,constant", "--reward_weights", 1, *common)
    assert "--reward_weights has 1 value(s) for 2 reward function(s) (brevity, constant)" in line, line
    line = bad(capsys, *gpt2, *rewards, "--max_prompt_length", 2, "--long_examples", "error", *common)
    assert "tokens, over --max_prompt_length 2; pass a larger one" in line, line
    no_system = tmp_path / "no_system"  # Gemma's kind: its template refuses a system turn
    shutil.copytree(data["llama"], no_system)
    tokenizer = AutoTokenizer.from_pretrained(no_system)
    tokenizer.chat_template = "{% if messages[0]['role'] == 'system' %}{{ raise_exception('no system') }}{% endif %}"
    tokenizer.save_pretrained(no_system)
    turns = [{"prompt": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}], "answer": "a"}]
    system = write_jsonl(tmp_path / "system.jsonl", turns * 8)
    line = bad(capsys, "--model_name_or_path", no_system, "--train_file", system, *rewards, *common)
    assert "the model's chat template refuses the train prompt 'hi' (no system)" in line, line
    bert = ["--model_name_or_path", tiny_bert(tmp_path / "bert"), "--train_file", data["train"]]
    line = bad(capsys, *bert, *rewards, *common)
    assert "not a causal language model" in line, line
    line = bad(capsys, *gpt2, "--reward_funcs", f"{data['file']}:raises", *common)
    assert "reward function raises raised KeyError: 'no such thing' (on the prompt '" in line, line
    line = bad(capsys, *gpt2, "--reward_funcs", f"{data['file']}:too_few", *common)
    assert "reward function too_few returned 1 value(s) for 8 completions" in line, line
    assert not (out / "all_results.json").exists()


def test_a_reward_that_fails_on_one_rank_is_named_on_every_rank(data, tmp_path):
    proc = launch(
        "cpu_2proc",
        "grpo",
        *args_for(data, "--per_device_train_batch_size", 4),
        "--reward_funcs",
        f"{data['file']}:raises",
        "--output_dir",
        tmp_path / "out",
    )
    lines = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode != 0 and lines, output_of(proc)
    assert all("reward function raises raised KeyError" in line for line in lines), lines
    assert "lost contact" not in output_of(proc)


def test_the_recipe_and_the_sweep_file_pass_the_scripts_own_parser(monkeypatch):
    from conftest import REPO
    from train import grpo
    from train.study.space import check_against_script, load_script, read_sweep

    monkeypatch.chdir(REPO)
    args = grpo.parse_args(["--config", "train/configs/grpo_sums.yaml"])
    assert args.reward_funcs == ["answer_match"] and args.num_generations == 8 and args.eval_on_start
    sweep = read_sweep("train/configs/sweep_grpo_sums.yaml", {"n_trials": None})
    check_against_script(sweep, load_script(sweep["script"]))
    assert sweep["metric"] == "eval_reward" and sweep["direction"] == "maximize"
