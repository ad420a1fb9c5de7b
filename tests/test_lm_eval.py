"""eval/sums.yaml: lm-evaluation-harness (pip's lm-eval) scores a model folder on make sums' validation
questions as train/grpo.py and train/sft.py do (eval_reward with answer_match): per question the same
greedy answer, character for character, and the same right or wrong, so the same mean; with the chat
template and without, the tokenizer's BOS included where ours is (a tiny GPT-2 without one, a tiny Llama
with one, and make smollm2's real SmolLM2-135M-Instruct). Our side is train/core/answers.py's
evaluate_answers on the prompt ids grpo.py reads; lm-eval's is its Python API, and once the command of
docs/evaluation.md, whose results file must say how its number was made."""

import glob
import importlib.metadata
import json
import os
import subprocess
import sys

import pytest

from conftest import REPO, clean_env, reset_accelerate_state
from hf_models import tiny_causal_lm
from train.models import gguf_import

pytest.importorskip("lm_eval")

QUESTIONS = 24  # make sums' first validation questions: a few seconds of answers on the tiny models
MAX_NEW_TOKENS = 32  # eval/sums.yaml's max_gen_toks, grpo_sums.yaml's --max_completion_length
BATCH_SIZE = 16  # grpo_sums.yaml's --per_device_eval_batch_size; lm_eval's --batch_size
TASKS = os.path.join(REPO, "eval")


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """A folder where lm_eval runs: the questions at eval/sums.yaml's path (runs/grpo/sums/validation.jsonl)."""
    from data import arithmetic

    root = tmp_path_factory.mktemp("lm_eval")
    arithmetic.write(root / "runs" / "grpo" / "sums", train_rows=1, validation_rows=QUESTIONS)
    return root


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """Tiny GPT-2 (no BOS) and Llama (<s> before each text) folders with ChatML tokenizers, as an output folder."""
    root = tmp_path_factory.mktemp("tiny")
    return {arch: tiny_causal_lm(root / arch, arch=arch, chat=True) for arch in ("gpt2", "llama")}


def questions(workdir):
    with open(workdir / "runs" / "grpo" / "sums" / "validation.jsonl") as f:
        return [json.loads(line) for line in f]


def ours(folder, rows, chat, path):
    """(eval_reward, [(completion, answer_match)] per question) of the project's evaluation: the prompt
    ids of grpo.py (a conversation through the chat template; without `chat`, the question's text as
    sft.py and grpo.py read a text prompt), greedy answers in chunks of BATCH_SIZE, answer_match."""
    import torch
    from accelerate import Accelerator
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from data.prompt_response import prompt_ids
    from train.core.answers import Prompts, Scoring, evaluate_answers
    from train.core.rewards import answer_match

    tokenizer = AutoTokenizer.from_pretrained(folder)
    if tokenizer.pad_token is None:  # as the scripts' tokenizer (causal_lm_tokenizer)
        tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    prompts = [row["prompt"] if chat else row["prompt"][-1]["content"] for row in rows]
    ids = [prompt_ids(tokenizer, prompt, chat) for prompt in prompts]
    try:
        metrics = evaluate_answers(
            Accelerator(cpu=True),
            model,
            tokenizer,
            Prompts(ids, prompts, {"answer": [row["answer"] for row in rows]}, chat),
            Scoring([("answer_match", answer_match)], [1.0], str(path)),
            MAX_NEW_TOKENS,
            BATCH_SIZE,
        )
    finally:
        reset_accelerate_state()
    with open(path) as f:
        answers = [json.loads(line) for line in f]
    return metrics["eval_reward"], [(a["completion"], a["answer_match"]) for a in answers]


def model_args(folder, chat):
    """docs/evaluation.md's --model_args: float32 as the scripts load a model; with the chat template no
    BOS added (the template writes what it wants, as grpo.py and sft.py read it); without, the tokenizer's own."""
    return f"pretrained={folder},dtype=float32" + (",add_bos_token=False" if chat else "")


def theirs(folder, chat, workdir, monkeypatch):
    """(exact_match, [(answer, exact_match)] per question) of lm_eval.simple_evaluate on eval/sums.yaml."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    monkeypatch.chdir(workdir)  # the task's data path is relative to where lm_eval runs
    results = lm_eval.simple_evaluate(
        model="hf",
        model_args=model_args(folder, chat),
        tasks=["sums"],
        # our task alone: indexing lm_eval's ~14,000 built-in task files takes most of a minute
        task_manager=TaskManager(include_path=TASKS, include_defaults=False),
        apply_chat_template=chat,
        batch_size=BATCH_SIZE,
        device="cpu",
        log_samples=True,
    )
    samples = sorted(results["samples"]["sums"], key=lambda s: s["doc_id"])
    return results["results"]["sums"]["exact_match,none"], [(s["resps"][0][0], s["exact_match"]) for s in samples]


def check_same(folder, chat, workdir, tmp_path, monkeypatch):
    reward, our_answers = ours(folder, questions(workdir), chat, tmp_path / "ours.jsonl")
    exact_match, their_answers = theirs(folder, chat, workdir, monkeypatch)
    assert len(their_answers) == len(our_answers) == QUESTIONS
    for i, (a, b) in enumerate(zip(our_answers, their_answers, strict=True)):
        assert a == b, f"question {i}: ours {a}, lm-eval's {b}"
    assert exact_match == pytest.approx(reward, abs=1e-6)
    return reward


@pytest.mark.parametrize("chat", [True, False], ids=["chat_template", "text"])
@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_lm_eval_answers_and_scores_each_question_as_we_do(tiny, arch, chat, workdir, tmp_path, monkeypatch):
    check_same(tiny[arch], chat, workdir, tmp_path, monkeypatch)


@pytest.fixture(scope="module")
def smollm2():
    """make smollm2's folder, written first if the wheel is here and the folder not (as tests/test_smollm2.py)."""
    try:
        importlib.metadata.distribution(gguf_import.PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        pytest.skip(f"pip's {gguf_import.PACKAGE} is not installed: `make smollm2` installs it (make test runs it)")
    folder = os.path.join(REPO, gguf_import.DEFAULT_OUTPUT_DIR)
    gguf_import.main(["--output_dir", folder])
    return folder


def test_lm_eval_scores_the_real_smollm2_as_we_do(smollm2, workdir, tmp_path, monkeypatch):
    """Through its chat template, as the demos ask it (without, it answers the bare text with nothing)."""
    reward = check_same(smollm2, True, workdir, tmp_path, monkeypatch)
    assert 0 < reward < 1  # some right and some wrong: the equality above compared both kinds


def test_the_documented_command_writes_how_its_number_was_made(tiny, workdir, tmp_path):
    """docs/evaluation.md's command, as a user runs it: its results file names the model's arguments (dtype,
    BOS), the chat template it applied, the stop and the token limit, beside exact_match."""
    out = tmp_path / "lm_eval"
    command = [
        sys.executable,
        "-m",
        "lm_eval",
        "run",
        "--model",
        "hf",
        "--model_args",
        model_args(tiny["gpt2"], chat=True),
        "--include_path",
        TASKS,
        "--tasks",
        "sums",
        "--apply_chat_template",
        "--batch_size",
        str(BATCH_SIZE),
        "--device",
        "cpu",
        "--log_samples",
        "--output_path",
        str(out),
    ]
    proc = subprocess.run(command, cwd=workdir, env=clean_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (path,) = glob.glob(str(out / "*" / "results_*.json"))
    with open(path) as f:
        results = json.load(f)
    assert results["config"]["model_args"] == {"pretrained": tiny["gpt2"], "dtype": "float32", "add_bos_token": False}
    assert results["chat_template"] and results["chat_template_sha"]
    kwargs = results["configs"]["sums"]["generation_kwargs"]
    assert (kwargs["until"], kwargs["max_gen_toks"], kwargs["do_sample"]) == ([], MAX_NEW_TOKENS, False)
    assert results["tokenizer_eos_token"][0] == "<|endoftext|>"  # the stop lm_eval adds to `until`
    assert 0 <= results["results"]["sums"]["exact_match,none"] <= 1
