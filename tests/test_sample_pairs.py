"""train/sample_pairs.py: preference pairs from a model's own sampled answers (tiny random causal LMs of
tests/hf_models.py). Each pair is the best and the worst of a prompt's answers by the reward
functions, their rewards as the functions give them; prompts whose answers all score alike give
none; 1 process and 2 write the same pairs; chat prompts give assistant turns that dpo.py reads."""

import json

import pytest

from conftest import launch, output_of, run_as_script
from data.preferences import pair_segments
from hf_models import WORDS, tiny_causal_lm

REWARDS = """
def length(completions, **kwargs):
    text = lambda c: c[0]["content"] if isinstance(c, list) else c
    return [float(len(text(c))) for c in completions]


def same(completions, **kwargs):
    return [1.0 for _ in completions]
"""


def write_jsonl(path, records):
    with open(path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)
    return str(path)


def records(path):
    return [json.loads(line) for line in open(path)]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("pairs")
    (root / "rewards.py").write_text(REWARDS)
    prompts = [{"prompt": f"define {w}", "answer": w} for w in WORDS[:14]]
    turns = [
        {"messages": [{"role": "user", "content": f"define {w}"}, {"role": "assistant", "content": w}]}
        for w in WORDS[:6]
    ]
    return {
        "gpt2": tiny_causal_lm(root / "gpt2"),
        "llama": tiny_causal_lm(root / "llama", "llama", chat=True),
        "train": write_jsonl(root / "train.jsonl", prompts[:10]),
        "validation": write_jsonl(root / "validation.jsonl", prompts[10:]),
        "chat": write_jsonl(root / "chat.jsonl", turns),
        "rewards": str(root / "rewards.py"),
        "root": root,
    }


def args_for(data, out, *extra):
    return [
        "--model_name_or_path", data["gpt2"], "--train_file", data["train"], "--validation_file", data["validation"],
        "--reward_funcs", f"{data['rewards']}:length", "--num_generations", 4, "--max_new_tokens", 6,
        "--batch_size", 3, "--output_dir", out, *extra,
    ]  # fmt: skip


def test_pairs_are_the_best_and_worst_answers_the_same_on_one_process_and_two(data, capsys):
    one, two = data["root"] / "one", data["root"] / "two"
    proc = run_as_script(capsys, "sample_pairs", *args_for(data, one))
    assert proc.returncode == 0, output_of(proc)
    made = {split: records(one / f"{split}.jsonl") for split in ("train", "validation")}
    for split, asked in (("train", records(data["train"])), ("validation", records(data["validation"]))):
        pairs = made[split]
        order = [p["prompt"] for p in asked]
        assert pairs and [order.index(p["prompt"]) for p in pairs] == sorted(order.index(p["prompt"]) for p in pairs)
        for pair in pairs:  # the functions' own values, the best above the worst, the row's columns along
            assert pair["chosen_reward"] == len(pair["chosen"]) > pair["rejected_reward"] == len(pair["rejected"])
            assert pair["answer"] == pair["prompt"].split()[1]
        assert f"{split}: {len(pairs):,} pairs from {len(asked):,} prompts x 4 answers on 1 process(es)" in proc.stdout
    launched = launch("cpu_2proc", "sample_pairs", *args_for(data, two))
    # the prompts shared out between the two (each alone would write the same pairs, answering every prompt)
    assert launched.returncode == 0 and "answers on 2 process(es)" in launched.stdout, output_of(launched)
    assert launched.stdout.count("train: ") == 1, output_of(launched)  # said once, by the main process
    assert all(records(two / f"{s}.jsonl") == made[s] for s in made)


def test_answers_that_all_score_alike_give_no_pair_and_chat_prompts_give_turns_dpo_reads(data, tmp_path, capsys):
    import datasets
    from transformers import AutoTokenizer

    proc = run_as_script(
        capsys, "sample_pairs", *args_for(data, tmp_path / "same", "--reward_funcs", f"{data['rewards']}:same")
    )
    assert proc.returncode == 0 and "train: 0 pairs from 10 prompts" in proc.stdout, output_of(proc)
    out = tmp_path / "chat"
    proc = run_as_script(
        capsys, "sample_pairs", "--model_name_or_path", data["llama"], "--train_file", data["chat"],
        "--reward_funcs", f"{data['rewards']}:length", "--num_generations", 4, "--max_new_tokens", 6,
        "--output_dir", out,
    )  # fmt: skip
    assert proc.returncode == 0, output_of(proc)
    pairs = records(out / "train.jsonl")
    assert pairs and all(p["prompt"][-1]["role"] == "user" and p["chosen"][0]["role"] == "assistant" for p in pairs)
    columns = {"prompt": "prompt", "chosen": "chosen", "rejected": "rejected"}
    tokenizer = AutoTokenizer.from_pretrained(data["llama"])
    segments, chat = pair_segments(datasets.Dataset.from_list(pairs), "train", columns, tokenizer)
    assert chat and len(segments) == len(pairs)


def test_bad_input_is_one_line(data, tmp_path, capsys):
    proc = run_as_script(
        capsys,
        "sample_pairs",
        *args_for(data, tmp_path / "x", "--prompt_column", "question", "--messages_column", "turns"),
    )
    assert proc.returncode == 1 and proc.stderr.strip().endswith(
        "no column 'question' or 'turns' in the train data (columns: prompt, answer); pass --prompt_column NAME or "
        "--messages_column NAME"
    ), output_of(proc)
    proc = run_as_script(capsys, "sample_pairs", *args_for(data, tmp_path / "x", "--reward_funcs", "nope.py:f"))
    assert proc.returncode == 1 and "no such file nope.py" in proc.stderr, output_of(proc)
    proc = run_as_script(capsys, "sample_pairs", *args_for(data, tmp_path / "x", "--num_generations", 1))
    assert proc.returncode == 2 and "--num_generations must be 2 or more" in proc.stderr, output_of(proc)
