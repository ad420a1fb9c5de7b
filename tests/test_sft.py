"""train/sft.py: tiny random causal LMs of two architectures (GPT-2 and Llama, tests/hf_models.py)
fine-tuned on prompt/response pairs of very different lengths, in real processes.

The promise tested first: 1 process with batch 8, 2 processes with batch 2 x 2 accumulation steps
and 2 FSDP2 processes with batch 4 take the same optimizer steps (the loss of a step is the sum over
its response tokens divided by their count, counted before the backward passes), and evaluate
exactly the validation set's response tokens. Then: the output folder loads with from_pretrained and
generates; SIGKILL (LoRA) and SIGTERM (full, with accumulation) then resume are bit-identical; FSDP2's
sharded checkpoint resumes in 1 process; packing keeps examples apart; chat turns render with the
template and only assistant turns are scored; with --reward_funcs every validation prompt is answered
and scored once per evaluation, the same on 1 and 2 processes, and a resume cuts the answers back to
its checkpoint; bad input is one line each."""

import json
import os
import random
import re

import numpy as np
import pytest
import torch

from cases_probe import check_crash_case, check_sigterm_case, crash_case, launch_cases, run_case, sigterm_case
from conftest import launch, output_of, run_as_script, run_main
from data.errors import DataError
from data.prompt_response import CausalBatch, chat_segments, encode, pack, prompt_response_segments
from data.sharding import BatchPlan
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
]


def pairs(n, seed):
    """Prompts of 1-20 words and responses of 1-40: lengths that differ up to 20x within a batch."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        word = rng.choice(WORDS)
        context = " ".join(rng.choice(WORDS) for _ in range(rng.randint(0, 19)))
        out.append(
            {
                "prompt": f"define {word} {context}\n",
                "response": f"{word} means " + " ".join(rng.choice(WORDS) for _ in range(rng.randint(0, 38))),
            }
        )
    return out


def conversations(n, seed):
    rng = random.Random(seed)
    say = lambda k: " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, k)))  # noqa: E731
    return [
        {
            "messages": [
                {"role": "system", "content": say(5)},
                {"role": "user", "content": say(8)},
                {"role": "assistant", "content": say(12)},
                {"role": "user", "content": say(8)},
                {"role": "assistant", "content": say(12)},
            ]
        }
        for _ in range(n)
    ]


REWARDS = """
def names_the_word(prompts, completions, response, **kwargs):
    # each prompt comes with its own row's columns: its response defines the prompt's word
    words = [prompt.split()[1] for prompt in prompts]
    assert all(r.startswith(w + " means") for w, r in zip(words, response, strict=True)), (prompts, response)
    return [float(w in c.split()) for w, c in zip(words, completions, strict=True)]


def characters(completions, **kwargs):
    return [float(len(c)) for c in completions]


def length(completion_ids, **kwargs):
    return [float(len(ids)) for ids in completion_ids]


def turn_words(prompts, completions, **kwargs):
    # conversations: the turns before the last assistant turn, and an assistant turn back
    assert all(p[-1]["role"] == "user" and c[0]["role"] == "assistant" for p, c in zip(prompts, completions))
    return [float(len(c[0]["content"].split())) for c in completions]
"""


def write_jsonl(path, records):
    with open(path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)
    return str(path)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("sft")
    return {
        "gpt2": tiny_causal_lm(root / "gpt2"),
        "llama": tiny_causal_lm(root / "llama", "llama", chat=True),
        "train": write_jsonl(root / "train.jsonl", pairs(96, 0)),
        "validation": write_jsonl(root / "validation.jsonl", pairs(N_VALIDATION, 1)),
        "chat": write_jsonl(root / "chat.jsonl", conversations(48, 2)),
        "cache": str(root / "tokens"),
        "rewards": write_text(root / "rewards.py", REWARDS),
        "root": root,
    }


def write_text(path, text):
    path.write_text(text)
    return str(path)


def scored(data, *names):
    """--reward_funcs of the module's reward file, greedy answers of 6 tokens at most."""
    return ["--reward_funcs", f"{data['rewards']}:{','.join(names)}", "--max_new_tokens", 6]


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
        "--learning_rate",
        3e-3,
        *STEPS,
        *extra,
    ]


def sft_run(config, data, out, *extra, model="gpt2"):
    proc = launch(config, "sft", *args_for(data, *extra, model=model), "--output_dir", out)
    assert proc.returncode == 0, output_of(proc)
    return proc


ACCUMULATED = ["--per_device_train_batch_size", 2, "--gradient_accumulation_steps", 2]
# the two runs' answers too, from the start: the sigterm run below, which has none, must train the same
SCORED = lambda data: [*scored(data, "names_the_word", "characters"), "--reward_weights", 1, 0.01, "--eval_on_start"]  # noqa: E731


@pytest.fixture(scope="module")
def ddp_launch(data):
    """Every 2-process DDP run of this file, as cases of one launch (tests/cases_probe.py) with 2 restarts:
    the uninterrupted 2 x 2 x 2 run, the SIGTERM run (stopped at step 1, resumed by the first restart)
    and LoRA's SIGKILL during a save (resumed by the second). Returns the launch."""
    root = data["root"]
    (root / "sigterm").mkdir()
    (root / "lora").mkdir()
    lora = ["--per_device_train_batch_size", 4, "--lora_r", 4, "--lora_dropout", 0.1, *scored(data, "length")]
    cases = [
        run_case("accumulated", "sft", root / "accumulated", *args_for(data, *ACCUMULATED, *SCORED(data))),
        sigterm_case("sigterm", "sft", root / "sigterm", *args_for(data, *ACCUMULATED)),
        crash_case("lora", "sft", 6, root / "lora", *args_for(data, *lora, model="llama")),
    ]
    proc = launch_cases("cpu_2proc", cases, max_restarts=2)
    assert proc.returncode == 0, output_of(proc)
    return proc


@pytest.fixture(scope="module")
def accumulated(data, ddp_launch):
    """2 processes x 2 rows x 2 accumulation steps: the reference of the tests below (2 processes
    without accumulation: the FSDP2 run, 2 x 4); the first case of ddp_launch."""
    return data["root"] / "accumulated"


@pytest.fixture(scope="module")
def one(data):
    """1 process x 8, in this process: the same 6 steps."""
    out = data["root"] / "one"
    run_main(
        "sft", *args_for(data, "--per_device_train_batch_size", 8, *SCORED(data)), "--output_dir", out, through_run=True
    )
    return out


def test_one_process_and_two_with_accumulation_take_the_same_steps(data, one, accumulated):
    start = weights(data["gpt2"])
    moved = largest_difference(weights(one), {k: start[k] for k in weights(one)})
    difference = largest_difference(weights(one), weights(accumulated))
    print(f"largest weight change {moved:.2e}; 1x8 vs 2x2x2 {difference:.2e}")
    assert moved > 1e-3 and difference < 2e-5, (moved, difference)  # fp32 rounding; a per-batch mean: 1e-2
    results = [json.load(open(folder / "all_results.json")) for folder in (one, accumulated)]
    scored = sum(row["targets"] for row in encoded(data, "validation"))
    assert all(r["eval_tokens"] == scored for r in results)  # every validation response token once
    assert abs(results[1]["eval_loss"] - results[0]["eval_loss"]) < 1e-5
    history = [h["eval_loss"] for h in results[0]["history"]]
    assert len(history) == 2 and history[-1] < history[0]  # the mid-run evaluation's loss, then a lower one


def test_answers_are_scored_once_each_and_the_same_on_one_process_and_two(data, one, accumulated, capsys):
    """--reward_funcs: every validation prompt answered once per evaluation (--eval_on_start's included),
    in the validation file's order; the metrics are the means of the answers' rewards in
    eval_completions.jsonl; before any step (the same weights) 1 and 2 processes answer alike."""
    prompts = [r["prompt"] for r in records(data["validation"])]
    results, answers = {}, {}
    for name, folder in (("one", one), ("two", accumulated)):
        result = results[name] = json.load(open(folder / "all_results.json"))
        before = {k.removesuffix("_before"): v for k, v in result.items() if k.endswith("_before")}
        evaluations = [{"step": 0, **before}] + result["history"]
        lines = answers[name] = records(folder / "eval_completions.jsonl")
        assert [(r["step"], r["prompt"]) for r in lines] == [(e["step"], p) for e in evaluations for p in prompts]
        for e in evaluations:
            mine = [r for r in lines if r["step"] == e["step"]]
            reward = mean_of(mine, lambda r: r["names_the_word"] + 0.01 * r["characters"])
            assert e["eval_reward"] == pytest.approx(reward)
            assert e["eval_rewards/names_the_word/mean"] == pytest.approx(mean_of(mine, lambda r: r["names_the_word"]))
            assert e["eval_rewards/characters/mean"] == pytest.approx(mean_of(mine, lambda r: r["characters"]))
            assert 0 < e["eval_completions/mean_length"] <= 6  # --max_new_tokens
        assert result["eval_samples"] == N_VALIDATION and "eval_loss_before" in result
        logged = [r for r in records(folder / "metrics.jsonl") if "eval_reward" in r]
        assert [r["eval_reward"] for r in logged] == [e["eval_reward"] for e in result["history"]]
    start = [{k: r[k] for k in ("prompt", "completion", "ended")} for r in answers["one"] if r["step"] == 0]
    assert start == [{k: r[k] for k in ("prompt", "completion", "ended")} for r in answers["two"] if r["step"] == 0]
    assert results["one"]["eval_reward_before"] == results["two"]["eval_reward_before"]
    later = [a["completion"] != b["completion"] for a, b in zip(answers["one"], answers["two"], strict=True)]
    with capsys.disabled():
        print(
            f"\neval_reward before/after: 1 process {results['one']['eval_reward_before']:.4f}/"
            f"{results['one']['eval_reward']:.4f}, 2 processes {results['two']['eval_reward_before']:.4f}/"
            f"{results['two']['eval_reward']:.4f}; {sum(later)} of {len(later)} answers differ"
        )
    assert results["one"]["eval_reward"] == results["two"]["eval_reward"]


def mean_of(lines, value):
    return sum(value(r) for r in lines) / len(lines)


def test_the_usual_mean_per_micro_batch_would_take_another_step(data, capsys):
    """The same AdamW step over 8 pairs as one batch and as 4 micro-batches of 2: equal with the loss
    weighted by the step's token count, not with each micro-batch's mean averaged (what the launched
    runs above would show if the script did that)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from train.models.gpt import next_token_loss

    tokenizer = AutoTokenizer.from_pretrained(data["gpt2"])
    rows, _ = encode(
        tokenizer,
        prompt_response_segments(_dataset(pairs(8, 0)), "train", "prompt", "response"),
        128,
        "truncate",
        "train",
        chat=False,
    )
    collate, total = CausalBatch(tokenizer.eos_token_id), sum(rows["targets"])

    def step(groups, weighted):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_pretrained(data["gpt2"])
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        for group in groups:
            batch = collate({k: [rows[k][i] for i in group] for k in ("input_ids", "labels")})
            nats = next_token_loss(
                model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits,
                batch["labels"],
                reduction="sum",
            )
            (nats / total if weighted else nats / (batch["labels"] != -100).sum() / len(groups)).backward()
        optimizer.step()
        return model.state_dict()

    one = step([range(8)], True)
    ours, mean = (
        largest_difference(one, step([[0, 1], [2, 3], [4, 5], [6, 7]], weighted)) for weighted in (True, False)
    )
    with capsys.disabled():
        print(f"\none batch vs 4 micro-batches: token-weighted {ours:.1e}, mean per micro-batch {mean:.1e}")
    assert ours < 1e-5 < 1e-4 < mean


def encoded(data, split, newest=False):
    """The tokenized `split` of the module's training data: its first folder, or the newest one."""
    import datasets

    found = [os.path.join(data["cache"], f) for f in os.listdir(data["cache"]) if f.startswith("train-")]
    folder = max(found, key=os.path.getmtime) if newest else min(found)
    return datasets.load_from_disk(os.path.join(folder, split))


def test_the_output_folder_loads_with_from_pretrained_and_generates(data, accumulated, capsys):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = accumulated
    assert {"config.json", "model.safetensors", "tokenizer.json", "all_results.json"} <= set(os.listdir(folder))
    model, tokenizer = AutoModelForCausalLM.from_pretrained(folder), AutoTokenizer.from_pretrained(folder)
    ids = tokenizer("define water\n", return_tensors="pt")["input_ids"]
    expected = tokenizer.decode(
        model.generate(ids, max_new_tokens=5, do_sample=False)[0, ids.shape[1] :], skip_special_tokens=True
    ).strip()
    proc = run_as_script(
        capsys, "sft", "--output_dir", folder, "--prompt", "define water\\n", "define stone\\n", "--max_new_tokens", 5
    )
    lines = proc.stdout.strip().splitlines()
    assert proc.returncode == 0 and len(lines) == 2 and lines[0] == f"define water\t{expected}", output_of(proc)


def test_sigkill_then_resume_is_bit_identical_with_lora(data, ddp_launch):
    """LoRA on the Llama, with adapter dropout: its draws must come back too (the last case of
    ddp_launch). The full fine-tuning's resume: after SIGTERM, below."""
    proc, crashed = ddp_launch, check_crash_case(ddp_launch, data["root"] / "lora", 6)
    assert f"resumed from {crashed}/checkpoints/step_00000003" in proc.stdout
    # the killed attempt had answered at step 6 too: the resume cut those answers, then answered again
    assert [r["step"] for r in records(crashed / "eval_completions.jsonl")] == [3] * N_VALIDATION + [6] * N_VALIDATION
    # checkpoints hold the adapters only; the folder holds the merged model and the adapter
    saved = weights(crashed / "checkpoints" / "step_00000006")
    assert saved and all("lora_" in k for k in saved), sorted(saved)[:4]
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    merged = AutoModelForCausalLM.from_pretrained(crashed)
    adapted = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(data["llama"]), crashed / "adapter")
    ids = torch.tensor([[1, 5, 9, 30, 7]])
    assert torch.allclose(merged(ids).logits, adapted.eval()(ids).logits, atol=1e-5)


def test_fsdp2_takes_the_same_steps_and_its_checkpoint_resumes_in_one_process(data, one, tmp_path, capsys):
    """2 FSDP2 processes x 4, without accumulation: the steps of 1 process x 8."""
    out = tmp_path / "fsdp"
    proc = sft_run("fsdp2_cpu_2proc", data, out, "--per_device_train_batch_size", 4)
    line = next(line for line in proc.stdout.splitlines() if line.startswith("fsdp2: "))
    assert "units: 2 GPT2Block" in line, line  # the model's own _no_split_modules
    difference = largest_difference(weights(out), weights(one))
    with capsys.disabled():
        print(f"\n1x8 vs FSDP2 2x4 {difference:.2e}")
    assert difference < 2e-5
    results = [json.load(open(folder / "all_results.json")) for folder in (one, out)]
    assert results[1]["eval_tokens"] == results[0]["eval_tokens"]
    assert abs(results[1]["eval_loss"] - results[0]["eval_loss"]) < 1e-5
    resumed = resume_copy(out, 3, str(tmp_path / "one"))
    proc = run_as_script(
        capsys,
        "sft",
        *args_for(data, "--per_device_train_batch_size", 8, "--checkpoint_format", "sharded"),
        "--output_dir",
        resumed,
        "--resume_from_checkpoint",
        "latest",
    )
    assert proc.returncode == 0 and "saved with 2 processes" in proc.stdout, output_of(proc)
    assert largest_difference(weights(resumed), weights(out)) < 2e-5


def test_sigterm_saves_at_one_step_on_every_rank_and_the_resume_is_bit_identical(data, ddp_launch, accumulated):
    """Stopped and saved at step 1 (after its 2 accumulated micro-batches) on every rank, restarted,
    it ends where the module's uninterrupted 2 x 2 x 2 run (a case of the same launch) ended."""
    out = check_sigterm_case(ddp_launch, "sigterm", data["root"] / "sigterm", 6)
    assert identical(weights(out), weights(accumulated))


# ------------------------------------------------------------------------------------ packing, chat, Llama


def test_packed_rows_score_each_example_as_alone(data):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(data["llama"])
    model = AutoModelForCausalLM.from_pretrained(data["llama"]).eval()
    rows, _ = encode(
        tokenizer,
        prompt_response_segments(_dataset(pairs(12, 3)), "train", "prompt", "response"),
        64,
        "truncate",
        "train",
        chat=False,
    )
    packed = pack(rows, 64)
    assert len(packed["length"]) < 12 and sum(packed["targets"]) == sum(rows["targets"])
    assert max(packed["length"]) <= 64 and sorted(sum(packed["input_ids"], [])) == sorted(sum(rows["input_ids"], []))

    def nats(batch):
        inputs = {k: batch[k] for k in ("input_ids", "attention_mask", "position_ids") if k in batch}
        logits = model(**inputs, use_cache=False).logits
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), reduction="sum")

    collate = CausalBatch(tokenizer.eos_token_id)
    with torch.no_grad():
        padded, packed_sum = nats(collate(rows)), nats(collate(packed))
    assert torch.allclose(padded, packed_sum, rtol=1e-5), (padded, packed_sum)


def _dataset(records):
    import datasets

    return datasets.Dataset.from_list(records)


def test_llama_trains_packed_and_on_chat_turns(data, tmp_path, capsys):
    out = tmp_path / "packed"
    proc = run_as_script(capsys, "sft", *args_for(data, "--packing", model="llama"), "--output_dir", out)
    assert proc.returncode == 0 and "packed into" in proc.stdout, output_of(proc)
    assert "filled; text without the chat template (--apply_chat_template uses it)" in proc.stdout
    chat = tmp_path / "chat"
    proc = run_as_script(
        capsys,
        "sft",
        "--model_name_or_path",
        data["llama"],
        "--train_file",
        data["chat"],
        "--messages_column",
        "messages",
        "--cache_dir",
        data["cache"],
        *STEPS,
        *scored(data, "turn_words"),
        "--eval_on_start",
        "--metric_for_best_model",
        "eval_reward",
        "--output_dir",
        chat,
    )
    assert proc.returncode == 0, output_of(proc)
    # the held-out conversations answered once per evaluation, the one before any step included
    held_out = int(re.search(r"validation \(10% of --train_file held out\) (\d+) examples", proc.stdout)[1])
    result = json.load(open(chat / "all_results.json"))
    assert result["eval_samples"] == held_out and result["best_model"]["metric"] == "eval_reward"
    steps = [r["step"] for r in records(chat / "eval_completions.jsonl")]
    assert steps == [s for s in [0] + [h["step"] for h in result["history"]] for _ in range(held_out)], steps
    assert re.search(r"^before fine-tuning: eval_loss=\S+ eval_perplexity=\S+ eval_reward=", proc.stdout, re.M)
    proc = run_as_script(capsys, "sft", "--output_dir", chat, "--prompt", "quick animal", "--max_new_tokens", 3)
    assert proc.returncode == 0 and proc.stdout.startswith("quick animal\t"), output_of(proc)


def test_a_base_model_given_a_chat_template_learns_text_pairs_as_turns_and_stops_at_the_end_of_turn(
    data, tmp_path, capsys
):
    """A model whose tokenizer has ChatML's tokens but no template (a base model's) and an end-of-text that
    is not <|im_end|>: --chat_template_path gives it ChatML, --apply_chat_template makes each text pair a
    user turn and the assistant's; the scored tokens are the response and <|im_end|>, the validation
    prompts are asked as user turns, and the output folder keeps the template and stops at <|im_end|>."""
    from transformers import AutoTokenizer, GenerationConfig

    from hf_models import CHATML

    base = tiny_causal_lm(tmp_path / "base", "llama", chat=True)
    os.remove(os.path.join(base, "chat_template.jinja"))
    template = tmp_path / "chatml.jinja"
    template.write_text(CHATML)
    args = ["--model_name_or_path", base, *args_for(data)[2:], "--output_dir", tmp_path / "out"]
    line = bad(capsys, *args, "--apply_chat_template")
    assert line.endswith(
        "--apply_chat_template: " + base + "'s tokenizer has no chat template; give it one (--chat_template_path "
        "FILE.jinja), or leave the flag out to train on the text as it is"
    ), line
    (tmp_path / "empty.jinja").write_text("  \n")
    line = bad(capsys, *args, "--chat_template_path", tmp_path / "empty.jinja")
    assert "--chat_template_path " + str(tmp_path / "empty.jinja") + " holds no chat template" in line, line

    out = tmp_path / "out"
    proc = run_as_script(
        capsys, "sft", *args, "--chat_template_path", template, "--apply_chat_template", *scored(data, "characters")
    )
    assert proc.returncode == 0 and "tokens per example; chat template\n" in proc.stdout, output_of(proc)
    tokenizer = AutoTokenizer.from_pretrained(out)
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert tokenizer.chat_template == CHATML and end != tokenizer.eos_token_id
    assert end in GenerationConfig.from_pretrained(out).eos_token_id  # generate() stops at the end of the turn
    rows = encoded(data, "train", newest=True)
    pair = {r["prompt"]: r["response"] for r in records(data["train"])}
    for ids, labels in zip(rows["input_ids"][:5], rows["labels"][:5], strict=True):
        text = tokenizer.decode(ids)  # the template's last newline is never scored, so no row holds it
        prompt = text.split("<|im_start|>user\n")[1].split("<|im_end|>")[0]
        assert text == f"<|im_start|>user\n{prompt}<|im_end|>\n<|im_start|>assistant\n{pair[prompt]}<|im_end|>"
        assert tokenizer.decode([t for t in labels if t != -100]) == f"{pair[prompt]}<|im_end|>"
    asked = [r["prompt"] for r in records(out / "eval_completions.jsonl")]
    assert asked[: len(records(data["validation"]))] == [r["prompt"] for r in records(data["validation"])]
    assert json.load(open(out / "args.json"))["apply_chat_template"] is True
    proc = run_as_script(capsys, "sft", "--output_dir", out, "--prompt", "quick animal", "--max_new_tokens", 3)
    assert proc.returncode == 0 and proc.stdout.startswith("quick animal\t"), output_of(proc)


def test_only_the_assistant_turns_are_scored(data):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(data["llama"])
    talks = conversations(3, 5)
    rows, counts = encode(
        tokenizer, chat_segments(_dataset(talks), "train", "messages", tokenizer), 128, "error", "train", chat=True
    )
    for talk, ids, labels in zip(talks, rows["input_ids"], rows["labels"], strict=True):
        whole = tokenizer.apply_chat_template(talk["messages"], tokenize=False)
        assert tokenizer.decode(ids) + "\n" == whole  # the rendering, less its last newline (never scored)
        scored = tokenizer.decode([t for t in labels if t != -100])
        # each turn up to its <|im_end|>: the template's newline after it is not the answer's
        assert scored == "".join(f"{m['content']}<|im_end|>" for m in talk["messages"] if m["role"] == "assistant")


def boundary_pairs(n, seed):
    """Prompts ending in a newline, a colon and a space, a question mark and a space, or a space alone;
    responses starting with a capital or not: the boundaries where tokenizing the two apart goes wrong."""
    rng = random.Random(seed)
    say = lambda k: " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, k)))  # noqa: E731
    ends = ["\n", ": ", "? ", " "]
    return [
        {
            "prompt": f"Define: {say(6)}{rng.choice(ends)}",
            "response": (say(10).capitalize() if rng.random() < 0.5 else say(10)) + ".",
        }
        for _ in range(n)
    ]


def tokenizer_of(kind, folder):
    """A tokenizer of each kind the scripts meet, saved into folder: SentencePiece-style (Metaspace, <s>),
    byte-level (with <s>, and with <s> and end-of-text after each text: bos, bos_and_end), WordPiece."""
    from transformers import AutoTokenizer

    from hf_models import metaspace_tokenizer, minilm_folder, tiny_tokenizer

    return {
        "sentencepiece": lambda: metaspace_tokenizer(folder),
        "byte_level": lambda: tiny_tokenizer(folder),
        "bos": lambda: tiny_tokenizer(folder, bos=True),
        "bos_and_end": lambda: tiny_tokenizer(folder, bos=True, end=True),
        "wordpiece": lambda: AutoTokenizer.from_pretrained(minilm_folder()),
    }[kind]()


def training_rows(tokenizer, examples):
    """The training rows of prompt/response `examples`, as sft.py stores them."""
    segments = prompt_response_segments(_dataset(examples), "train", "prompt", "response")
    return encode(tokenizer, segments, 512, "error", "train", chat=False)[0]


@pytest.mark.parametrize("kind", ["sentencepiece", "byte_level", "wordpiece"])
def test_an_example_is_tokenized_whole_and_only_its_response_is_scored(kind, tmp_path):
    """For a SentencePiece-style (Metaspace), a byte-level (a space joined to the next word) and a WordPiece
    tokenizer: the stored tokens are tokenizer(prompt + response) and end-of-text, as the model meets the
    text at inference, and the scored ones decode to the response. Tokenized apart, the pieces differ."""
    tokenizer = tokenizer_of(kind, tmp_path)
    examples = boundary_pairs(200, 7)
    rows = training_rows(tokenizer, examples)
    apart = 0
    for example, ids, labels in zip(examples, rows["input_ids"], rows["labels"], strict=True):
        whole = tokenizer(example["prompt"] + example["response"])["input_ids"]
        ending = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []  # BERT's [SEP] ends it
        assert ids + labels[-1:] == whole + ending
        scored = tokenizer.decode([t for t in labels if t != -100], skip_special_tokens=True)
        assert (
            scored.strip()
            == tokenizer.decode(tokenizer(example["response"])["input_ids"], skip_special_tokens=True).strip()
        )
        pieces = [tokenizer(example[k], add_special_tokens=False)["input_ids"] for k in ("prompt", "response")]
        apart += (
            pieces[0] + pieces[1]
            != tokenizer(example["prompt"] + example["response"], add_special_tokens=False)["input_ids"]
        )
    print(f"{kind}: tokenized apart, {apart} of {len(examples)} examples get other tokens")
    assert apart > 0 if kind != "wordpiece" else apart == 0  # WordPiece cuts at spaces and punctuation anyway


def test_long_examples_are_cut_dropped_or_refused(data):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(data["gpt2"])
    examples = prompt_response_segments(_dataset(pairs(40, 6)), "train", "prompt", "response")
    full, _ = encode(tokenizer, examples, 1000, "error", "train", chat=False)
    limit = sorted(full["length"])[20]
    rows, counts = encode(tokenizer, examples, limit, "truncate", "train", chat=False)
    longer = sum(n > limit for n in full["length"])
    assert counts["cut"] == longer > 0 and max(rows["length"]) == limit and len(rows["length"]) == 40
    rows, counts = encode(tokenizer, examples, limit, "drop", "train", chat=False)
    assert counts["dropped"] == longer and len(rows["length"]) == 40 - longer
    with pytest.raises(DataError, match="longer than --max_seq_length"):
        encode(tokenizer, examples, limit, "error", "train", chat=False)
    with pytest.raises(DataError, match="its prompt alone is"):
        encode(tokenizer, examples, 2, "truncate", "train", chat=False)


@pytest.mark.parametrize("accumulation", [1, 2, 3])
@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_each_batch_knows_its_steps_response_tokens(world_size, accumulation):
    rng = random.Random(world_size * 10 + accumulation)
    targets = [rng.randint(1, 50) for _ in range(203)]
    plans = [
        BatchPlan([203], 4 * world_size, world_size, rank, seed=1, lengths=targets, accumulation_steps=accumulation)
        for rank in range(world_size)
    ]
    totals = plans[0].step_totals(0, np.asarray(targets))
    batches = [list(plan.rank_batches(0)) for plan in plans]
    steps = {}
    for per_rank in batches:
        for index, ids, _ in per_rank:
            steps.setdefault(index // accumulation, []).extend(ids.tolist())
    for index in range(len(totals)):
        assert totals[index] == sum(targets[i] for i in steps[index // accumulation])
    # the rows of a step do not depend on how it is split into processes and accumulation steps
    one = BatchPlan([203], 4 * world_size * accumulation, 1, 0, seed=1, lengths=targets)
    assert [sorted(ids.tolist()) for _, ids, _ in one.rank_batches(0)] == [
        sorted(rows) for _, rows in sorted(steps.items())
    ][: len(list(one.rank_batches(0)))]


# ------------------------------------------------------------------------------------ bad input, one line each


def bad(capsys, *args):
    proc = run_as_script(capsys, "sft", *args)
    lines = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode == 1 and len(lines) == 1, output_of(proc)
    return lines[0]


def test_bad_input_is_one_line_and_writes_no_run(data, tmp_path, capsys):
    from transformers import OPTConfig, OPTForCausalLM

    out = tmp_path / "out"
    common = ["--cache_dir", data["cache"], "--output_dir", out]
    gpt2 = ["--model_name_or_path", data["gpt2"], "--train_file", data["train"]]
    line = bad(capsys, "--model_name_or_path", tiny_bert(tmp_path / "bert"), "--train_file", data["train"], *common)
    assert "is a bert model (BertModel), not a causal language model" in line, line
    line = bad(capsys, *gpt2, "--response_column", "answer", *common)
    assert "no column 'answer'" in line and "(columns: prompt, response)" in line, line
    line = bad(capsys, *gpt2, "--messages_column", "messages", *common)
    assert "no column 'messages'" in line, line
    # TRL's dataset formats: the flag that takes them
    completions = write_jsonl(
        tmp_path / "pc.jsonl", [{"prompt": p["prompt"], "completion": p["response"]} for p in pairs(9, 1)]
    )
    line = bad(capsys, "--model_name_or_path", data["gpt2"], "--train_file", completions, *common)
    assert line.endswith(
        "no column 'response' in the train data (columns: prompt, completion); pass --response_column completion"
    ), line
    turns = [{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yes"}]}] * 9
    line = bad(
        capsys, "--model_name_or_path", data["gpt2"], "--train_file", write_jsonl(tmp_path / "m.jsonl", turns), *common
    )
    assert line.endswith("(columns: messages); pass --messages_column messages"), line
    line = bad(
        capsys,
        "--model_name_or_path",
        data["gpt2"],
        "--train_file",
        data["chat"],
        "--messages_column",
        "messages",
        *common,
    )
    assert "has no chat template" in line, line
    assert "its prompt alone is" in bad(capsys, *gpt2, "--max_seq_length", 3, *common)
    empty = write_jsonl(tmp_path / "empty.jsonl", pairs(10, 7) + [{"prompt": "define tree\n", "response": " "}])
    line = bad(
        capsys,
        "--model_name_or_path",
        data["gpt2"],
        "--train_file",
        empty,
        "--validation_file",
        data["validation"],
        *common,
    )
    assert "1 row(s) with an empty 'response' (the first: 'define tree')" in line, line
    opt = tmp_path / "opt"
    OPTForCausalLM(
        OPTConfig(
            vocab_size=400,
            hidden_size=16,
            num_hidden_layers=1,
            num_attention_heads=2,
            ffn_dim=32,
            word_embed_proj_dim=16,
            max_position_embeddings=128,
        )
    ).save_pretrained(opt)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (opt / name).write_bytes(open(os.path.join(data["gpt2"], name), "rb").read())
    line = bad(capsys, "--model_name_or_path", opt, "--train_file", data["train"], "--packing", *common)
    assert "--packing: OPTForCausalLM does not keep packed examples apart" in line, line
    assert "is more than" in bad(capsys, *gpt2, "--max_seq_length", 1000, *common)
    line = bad(capsys, *gpt2, "--packing", "--per_device_train_batch_size", 64, *common)
    assert "row(s) once packed, fewer than one batch of 64" in line, line
    assert "--train_file nope.jsonl: no such file or folder" in bad(
        capsys, "--model_name_or_path", data["gpt2"], "--train_file", "nope.jsonl", *common
    )
    line = bad(capsys, *gpt2, "--reward_funcs", "nope.py:right", *common)
    assert line.endswith(
        "--reward_funcs nope.py:right: no such file nope.py; pass FILE.py:NAME of a Python file that defines NAME"
    ), line
    line = bad(capsys, *gpt2, *scored(data, "names_the_word", "length"), "--reward_weights", 1, *common)
    assert "--reward_weights has 1 value(s) for 2 reward function(s) (names_the_word, length)" in line, line
    assert not out.exists() or not (out / "all_results.json").exists()


def test_the_recipe_and_the_sweep_file_pass_the_scripts_own_parser(monkeypatch):
    from conftest import REPO
    from train import sft
    from train.study.space import check_against_script, load_script, read_sweep

    monkeypatch.chdir(REPO)
    args = sft.parse_args(["--config", "train/configs/sft_gcide.yaml"])
    assert args.model_name_or_path == "runs/lm" and args.eval_on_start and args.learning_rate == 2e-3
    chat = sft.parse_args(["--config", "train/configs/sft_sums.yaml"])  # make train-chat's, on SmolLM2
    assert chat.messages_column == "messages" and chat.reward_funcs == ["answer_match"]
    assert chat.metric_for_best_model == "eval_reward"
    sweep = read_sweep("train/configs/sweep_sft_gcide.yaml", {"n_trials": None})
    check_against_script(sweep, load_script(sweep["script"]))
    assert sweep["metric"] == "eval_loss" and sweep["direction"] == "minimize"


@pytest.mark.parametrize("kind", ["byte_level", "bos", "bos_and_end", "sentencepiece", "wordpiece"])
def test_a_prompt_is_read_as_training_reads_it_with_no_end_of_text_after_it(kind, tmp_path):
    """--prompt's ids are the start of a training example's: what the tokenizer puts before a text
    (<s>, [CLS]) stays, what it puts after one (end-of-text, [SEP]) does not: training puts those only
    after a response."""
    from data.prompt_response import context_ids

    tokenizer = tokenizer_of(kind, tmp_path)
    examples = pairs(30, 5)
    rows = training_rows(tokenizer, examples)
    ends = {tokenizer.eos_token_id, tokenizer.sep_token_id} - {None}
    for example, ids in zip(examples, rows["input_ids"], strict=True):
        context = context_ids(tokenizer, example["prompt"])
        assert ids[: len(context)] == context and context[-1] not in ends
        assert tokenizer.decode(context, skip_special_tokens=True).strip() == example["prompt"].strip()
        if kind in ("bos", "bos_and_end"):
            assert context[0] == tokenizer.bos_token_id
    # an empty prompt: only what comes before any text (<s>, [CLS]), no end-of-text
    starts = {"bos": [tokenizer.bos_token_id], "bos_and_end": [tokenizer.bos_token_id]}
    starts |= {"sentencepiece": [tokenizer.bos_token_id], "wordpiece": [tokenizer.cls_token_id]}
    assert context_ids(tokenizer, "") == starts.get(kind, [])


def test_generation_reads_no_end_of_text_after_the_prompt_though_the_tokenizer_adds_one(tmp_path, capsys):
    """A tokenizer that ends every text with end-of-text (its post-processor's "$A <eos>"): --prompt
    continues the prompt alone, as training presented it, not the prompt and an end."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = tiny_causal_lm(tmp_path / "run", end=True)
    for name in ("args.json", "all_results.json"):  # as a finished train/sft.py run leaves them
        with open(os.path.join(folder, name), "w") as f:
            json.dump({}, f)
    model, tokenizer = AutoModelForCausalLM.from_pretrained(folder), AutoTokenizer.from_pretrained(folder)
    with_end = tokenizer("the river", return_tensors="pt")["input_ids"]
    assert with_end[0, -1] == tokenizer.eos_token_id

    def continuation(ids):
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False)
        return tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True).strip()

    expected = continuation(with_end[:, :-1])
    assert expected != continuation(with_end)  # else this test could not tell the two apart
    proc = run_as_script(capsys, "sft", "--output_dir", folder, "--prompt", "the river", "--max_new_tokens", 8)
    assert expected and proc.returncode == 0 and proc.stdout.strip() == f"the river\t{expected}", output_of(proc)


@pytest.mark.parametrize("script", ["sft", "dpo"])
def test_generation_refuses_a_finished_run_of_a_classifier_in_one_line(script, tmp_path, capsys):
    """text_classification.py's output is a finished run too: its head is no language model's."""
    folder = tiny_bert(tmp_path / "classifier", num_labels=2)
    for name in ("args.json", "all_results.json"):
        with open(os.path.join(folder, name), "w") as f:
            json.dump({}, f)
    proc = run_as_script(capsys, script, "--output_dir", folder, "--prompt", "the river")
    assert proc.returncode == 1 and proc.stdout == "", output_of(proc)
    assert proc.stderr.strip() == (
        f"error: --output_dir {folder} holds a BertForSequenceClassification, not a causal language model: "
        f"train/{script}.py --prompt continues text; pass the output folder of a train/sft.py or train/dpo.py run"
    )
