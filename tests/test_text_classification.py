"""train/text_classification.py: a tiny random BERT (tests/hf_models.py) with MiniLM's real tokenizer
on labelled text of varied lengths: 2 real processes evaluate every validation row once; 1 process
takes the steps 2 take, and (in this process) learns and writes a folder from_pretrained loads and
that scores what the run said; SIGKILL (LoRA) and SIGTERM (full) then resume are bit-identical;
FSDP2 (LoRA) shards the BERT layers, takes DDP's steps and its sharded checkpoint resumes in 1
process; bad input is one line. The data side (tokenized once, padding, grouping by length) is
tested in one process."""

import json
import os
import random

import numpy as np
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
from conftest import launch, output_of, run_as_script, run_main
from data.labelled_text import TokenBatch, first_words, label_names, prepare_labelled_text
from data.sharding import BatchPlan
from data.splits import DataInputs
from hf_models import tiny_bert
from test_checkpointing import (
    identical,
    largest_difference,
    resume_copy,
    weights,
)
from train.core.confusion import confusion_metrics

TOPICS = {
    "sport": "goal match team ball score coach league",
    "food": "bread soup cheese apple sugar bake dish",
    "music": "song guitar drum melody choir piano band",
    "space": "planet orbit star rocket comet moon galaxy",
}
FILLER = "the a of and to in is was for on with as by that it at from this".split()
N_VALIDATION = 101  # odd: fills no batch of any size used here


def rows(n, seed):
    """Texts of 3 to 60 words: a few words of the topic among filler words; the label is the topic."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        label = rng.choice(sorted(TOPICS))
        words = [
            rng.choice(TOPICS[label].split()) if rng.random() < 0.3 else rng.choice(FILLER)
            for _ in range(rng.randint(3, 60))
        ]
        words[rng.randrange(len(words))] = rng.choice(TOPICS[label].split())
        out.append({"text": " ".join(words), "label": label})
    return out


def write_csv(path, records, text="text", label="label"):
    import csv

    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, [text, label])
        writer.writeheader()
        writer.writerows({text: r["text"], label: r["label"]} for r in records)
    return str(path)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("text")
    # with dropout: the LoRA resume test checks the dropout draws come back too
    return {
        "model": tiny_bert(root / "bert"),
        "dropout_model": tiny_bert(root / "bert_dropout", dropout=0.1),
        "train": write_csv(root / "train.csv", rows(384, 0)),
        "validation": write_csv(root / "validation.csv", rows(N_VALIDATION, 1)),
        "cache": str(root / "tokens"),
        "root": root,
    }


def args_for(data, *extra):
    return [
        "--model_name_or_path",
        data["model"],
        "--train_file",
        data["train"],
        "--validation_file",
        data["validation"],
        "--cache_dir",
        data["cache"],
        "--learning_rate",
        5e-3,
        "--logging_steps",
        4,
        *extra,
    ]


def text_run(config, data, out, *extra):
    proc = launch(config, "text_classification", *args_for(data, *extra), "--output_dir", out)
    assert proc.returncode == 0, output_of(proc)
    return proc


# grouped by length (the default); evaluated at steps 4 and 8, no best model kept: the runs below compare
# the last step's weights (at lr 5e-3 step 4's loss is the lower one)
SHORT = ["--max_train_steps", 8, "--checkpointing_steps", 3, "--eval_steps", 4, "--metric_for_best_model", "none"]


@pytest.fixture(scope="module")
def ddp_launch(data):
    """Every 2-process DDP run of this file, as cases of one launch (tests/cases_probe.py) with 2 restarts:
    the uninterrupted 2 x 8 run, the SIGTERM run (stopped at step 1, resumed by the first restart)
    and LoRA's SIGKILL during a save (resumed by the second). Returns the launch."""
    root = data["root"]
    (root / "sigterm").mkdir()
    (root / "lora").mkdir()
    cases = [
        run_case(
            "two", "text_classification", root / "two", *args_for(data, *SHORT, "--per_device_train_batch_size", 8)
        ),
        sigterm_case(
            "sigterm",
            "text_classification",
            root / "sigterm",
            *args_for(data, *SHORT, "--per_device_train_batch_size", 8),
        ),
        crash_case("lora", "text_classification", 6, root / "lora", *args_for(data, *SHORT, *lora_args(data))),
    ]
    proc = launch_cases("cpu_2proc", cases, max_restarts=2)
    assert proc.returncode == 0, output_of(proc)
    return proc


@pytest.fixture(scope="module")
def two_launch(data, ddp_launch):
    """The uninterrupted 2 x 8 run: ddp_launch's first case, and what its rank 0 printed."""
    return case_output(ddp_launch.stdout, "two"), data["root"] / "two"


@pytest.fixture(scope="module")
def two(two_launch):
    """2 processes x 8 rows, the reference of the tests below."""
    return two_launch[1]


def test_two_processes_count_every_validation_row_once_in_each_evaluation(two_launch):
    printed, out = two_launch
    assert "world_size=2 " in printed
    assert (
        printed.count(
            f"384 train, {N_VALIDATION} validation rows (--validation_file), 4 labels (food, music, space, sport)"
        )
        == 1
    )
    results = json.load(open(out / "all_results.json"))
    assert [(h["step"], h["eval_samples"]) for h in results["history"]] == [(4, N_VALIDATION), (8, N_VALIDATION)]
    assert "best_model" not in results and results["eval_accuracy"] == results["history"][-1]["eval_accuracy"]
    confusion = results["confusion_matrix"]  # the last evaluation's
    assert sum(map(sum, confusion)) == N_VALIDATION and results["labels"] == ["food", "music", "space", "sport"]
    assert confusion_metrics(confusion)["accuracy"] == pytest.approx(results["eval_accuracy"])
    assert (out / "confusion.png").stat().st_size > 0 and (out / "curves.png").stat().st_size > 0


def test_one_process_takes_the_steps_two_take(data, two, capsys):
    one = data["root"] / "one"
    proc = run_as_script(
        capsys, "text_classification", *args_for(data, *SHORT, "--per_device_train_batch_size", 16), "--output_dir", one
    )
    assert proc.returncode == 0, output_of(proc)
    assert (
        largest_difference(weights(one), weights(two)) < 1e-5
    )  # each rank pads its own rows: the same to float rounding


@pytest.fixture(scope="module")
def trained(data):
    """The steps of 2 processes x 16 as drawn (1 x 32: the same steps, above), 4 epochs, in this process."""
    out = data["root"] / "trained"
    run_main(
        "text_classification",
        *args_for(
            data,
            "--num_train_epochs",
            4,
            "--per_device_train_batch_size",
            32,
            "--group_by_length",
            "false",
            "--metric_for_best_model",
            "f1",
            "--checkpointing_steps",
            "epoch",
            "--output_dir",
            out,
        ),
        through_run=True,
    )
    return out


def test_it_learns_and_keeps_the_best_evaluation_on_f1(trained):
    results = json.load(open(trained / "all_results.json"))
    assert [h["eval_samples"] for h in results["history"]] == [N_VALIDATION] * 4
    assert results["eval_accuracy"] > 0.6, results  # chance is about 0.25
    assert results["best_model"]["metric"] == "eval_f1"
    best = results["best_model"]["metrics"]  # the saved model's evaluation, and its matrix
    assert confusion_metrics(results["confusion_matrix"])["accuracy"] == pytest.approx(best["eval_accuracy"])


@pytest.mark.parametrize("run", ["trained", "two"])
def test_the_output_is_a_hugging_face_folder_that_scores_what_the_run_said(run, request, data, capsys):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    out = request.getfixturevalue(run)  # the trained run's folder, and the 2-process run's
    model = AutoModelForSequenceClassification.from_pretrained(out).eval()
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert model.config.id2label == {0: "food", 1: "music", 2: "space", 3: "sport"}
    validation = rows(N_VALIDATION, 1)
    with torch.no_grad():
        inputs = tokenizer([r["text"] for r in validation], padding=True, truncation=True, return_tensors="pt")
        predicted = model(**inputs).logits.argmax(-1).tolist()
    correct = sum(model.config.id2label[p] == r["label"] for p, r in zip(predicted, validation, strict=True))
    results = json.load(open(out / "all_results.json"))
    said = results["best_model"]["metrics"] if run == "trained" else results  # the saved weights' evaluation
    assert correct == round(said["eval_accuracy"] * N_VALIDATION)
    lines = data["root"] / f"lines_{run}.txt"
    lines.write_text("".join(r["text"] + "\n" for r in validation[:5]))
    proc = run_as_script(capsys, "text_classification", "--predict", lines, "--output_dir", out)
    assert proc.returncode == 0, output_of(proc)
    printed = [line.split("\t") for line in proc.stdout.splitlines()]
    assert [p[1] for p in printed] == [model.config.id2label[p] for p in predicted[:5]]
    assert all(0.25 <= float(p[2]) <= 1 for p in printed)
    assert "no such file" in bad(capsys, "--predict", "typo/lines.txt", "--output_dir", out)
    from train import text_classification  # the run's args.json reruns it: every key it records is accepted

    again = text_classification.parse_args(["--config", str(out / "args.json"), "--output_dir", "elsewhere"])
    assert again.model_fingerprint == json.load(open(out / "args.json"))["model_fingerprint"]


def lora_args(data):
    """LoRA on the BERT with dropout: its draws (the body's and the adapters') must come back too."""
    return [
        "--per_device_train_batch_size",
        8,
        "--model_name_or_path",
        data["dropout_model"],
        "--lora_r",
        4,
        "--lora_dropout",
        0.1,
        "--lora_target_modules",
        "query,key,value,dense",
    ]


@pytest.fixture(scope="module")
def lora(data, ddp_launch):
    """LoRA under 2 processes, SIGKILLed as it publishes checkpoint 6 and resumed from 3 (the reference of
    LoRA under FSDP2, below): the last case of ddp_launch."""
    return ddp_launch, check_crash_case(ddp_launch, data["root"] / "lora", 6)


def test_sigkill_then_resume_is_bit_identical_with_lora(data, lora, tmp_path, capsys):
    """The full fine-tuning's resume: after SIGTERM, below."""
    proc, crashed = lora
    extra = lora_args(data)
    assert f"resumed from {crashed}/checkpoints/step_00000003" in proc.stdout
    assert (crashed / "confusion.png").exists()
    # checkpoints hold the adapters and the head only; the adapter loads with peft
    from peft import PeftModel
    from transformers import AutoModelForSequenceClassification

    saved = weights(crashed / "checkpoints" / "step_00000006")
    assert saved and all("lora_" in k or "modules_to_save" in k for k in saved), sorted(saved)[:4]
    base = AutoModelForSequenceClassification.from_pretrained(data["dropout_model"], num_labels=4)
    assert isinstance(PeftModel.from_pretrained(base, crashed / "adapter"), PeftModel)
    # the frozen body comes from --model_name_or_path: another model there is refused, not trained on
    other = resume_copy(crashed, 3, str(tmp_path / "other_base"))
    line = bad(
        capsys,
        *args_for(data, *SHORT, *extra),
        "--model_name_or_path",
        tiny_bert(tmp_path / "other", seed=1),
        "--output_dir",
        other,
        "--resume_from_checkpoint",
        "latest",
    )
    assert f"another pretrained model than --model_name_or_path {tmp_path / 'other'} (a Hub model" in line, line
    assert line.endswith(f"; pass --model_name_or_path {data['dropout_model']}, or start a new run"), line


def test_fsdp2_with_lora_shards_the_bert_layers_takes_ddps_steps_and_resumes_in_one_process(
    data, lora, tmp_path, capsys
):
    """LoRA's frozen body and its adapters in the same FSDP2 units, with dropout: the steps of the LoRA
    run above (its merged weights). Full fine-tuning under FSDP2: tests/test_sft.py (a GPT-2). 1 process
    draws other dropout masks than 2: its resume from the sharded checkpoint 6 is compared with its
    resume from the LoRA run's unsharded checkpoint 6."""
    out = tmp_path / "fsdp"
    proc = text_run("fsdp2_cpu_2proc", data, out, *SHORT, *lora_args(data))
    line = next(line for line in proc.stdout.splitlines() if line.startswith("fsdp2: "))
    assert "units: 2 BertLayer, 1 BertEmbeddings" in line, line
    assert largest_difference(weights(out), weights(lora[1])) < 1e-5
    step = out / "checkpoints" / "step_00000006"
    assert json.load(open(step / "meta.json"))["checkpoint_format"] == "sharded"
    resumed = []
    for run, checkpoint_format in ((out, "sharded"), (lora[1], "full")):
        one = resume_copy(run, 6, str(tmp_path / f"one_{checkpoint_format}"))
        proc = run_as_script(
            capsys,
            "text_classification",
            *args_for(data, *SHORT, *lora_args(data)),
            "--per_device_train_batch_size",
            16,
            "--checkpoint_format",
            checkpoint_format,
            "--output_dir",
            one,
            "--resume_from_checkpoint",
            "latest",
        )
        assert proc.returncode == 0 and "saved with 2 processes" in proc.stdout, output_of(proc)
        assert f"resumed from {one}/checkpoints/step_00000006" in proc.stdout, output_of(proc)
        resumed.append(weights(one))
    assert largest_difference(*resumed) < 1e-5


def test_sigterm_saves_at_one_step_on_every_rank_and_the_resume_is_bit_identical(data, ddp_launch, two):
    """Stopped and saved at step 1 on every rank, restarted, it ends where the module's
    uninterrupted 2 x 8 run (a case of the same launch) ended."""
    out = check_sigterm_case(ddp_launch, "sigterm", data["root"] / "sigterm", 8)
    assert identical(weights(out), weights(two))
    finished = [json.load(open(folder / "all_results.json")) for folder in (out, two)]
    assert finished[0]["confusion_matrix"] == finished[1]["confusion_matrix"] and (out / "confusion.png").exists()


# ------------------------------------------------------------------------------------ bad input, one line each


def bad(capsys, *args):
    proc = run_as_script(capsys, "text_classification", *args)
    lines = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode == 1 and len(lines) == 1, output_of(proc)
    return lines[0]


def test_bad_input_is_one_line_and_writes_no_run(data, tmp_path, capsys):
    out = tmp_path / "out"
    common = ["--cache_dir", data["cache"], "--output_dir", out]
    train = data["train"]
    line = bad(capsys, "--model_name_or_path", "bert-base-uncased", "--train_file", train, *common)
    assert "bert-base-uncased is neither a local folder nor a model in the Hugging Face cache" in line, line
    empty = tmp_path / "empty_model"
    empty.mkdir()
    assert "has no config.json" in bad(capsys, "--model_name_or_path", empty, "--train_file", train, *common)
    (empty / "config.json").write_text(open(os.path.join(data["model"], "config.json")).read())
    assert "has no weights" in bad(capsys, "--model_name_or_path", empty, "--train_file", train, *common)
    no_tokenizer = tiny_bert(tmp_path / "no_tokenizer")
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json"):
        os.remove(os.path.join(no_tokenizer, name))
    assert "has no tokenizer (none of tokenizer.json" in bad(
        capsys, "--model_name_or_path", no_tokenizer, "--train_file", train, *common
    )
    model = ["--model_name_or_path", data["model"]]
    line = bad(capsys, *model, "--train_file", train, "--text_column", "sentence", *common)
    assert "no text column 'sentence'" in line and "(columns: text, label)" in line
    assert "no label column 'category'" in bad(
        capsys, *model, "--train_file", train, "--label_column", "category", *common
    )
    unseen = write_csv(tmp_path / "unseen.csv", rows(10, 2) + [{"text": "a new kind", "label": "weather"}])
    assert "never seen in training: weather" in bad(
        capsys, *model, "--train_file", train, "--validation_file", unseen, *common
    )
    (tmp_path / "empty.csv").write_text("")
    assert "is empty" in bad(capsys, *model, "--train_file", tmp_path / "empty.csv", *common)
    (tmp_path / "header.csv").write_text("text,label\n")
    line = bad(capsys, *model, "--train_file", train, "--validation_file", tmp_path / "header.csv", *common)
    assert line.endswith(f"--validation_file {tmp_path / 'header.csv'} has no rows; pass a file with data"), line
    line = bad(capsys, *model, "--train_file", train, "--lora_r", 4, "--lora_target_modules", "q_proj,v_proj", *common)
    assert "peft cannot adapt" in line and "query" in line
    assert "is more than" in bad(capsys, *model, "--train_file", train, "--max_seq_length", 1000, *common)
    scores = write_csv(
        tmp_path / "scores.csv", [{"text": r["text"], "label": i / 3} for i, r in enumerate(rows(20, 4))]
    )
    assert "numbers with decimals" in bad(capsys, *model, "--train_file", scores, *common)
    assert not out.exists() or not (out / "all_results.json").exists()


def test_a_checkpoint_with_another_number_of_labels_is_one_line(data, two, tmp_path, capsys):
    three = [r for r in rows(400, 3) if r["label"] != "space"]
    crashed = resume_copy(two, 3, str(tmp_path / "other_labels"))
    line = bad(
        capsys,
        "--model_name_or_path",
        data["model"],
        "--train_file",
        write_csv(tmp_path / "three.csv", three),
        "--cache_dir",
        data["cache"],
        *SHORT,
        "--per_device_train_batch_size",
        16,
        "--output_dir",
        crashed,
        "--resume_from_checkpoint",
        "latest",
    )
    assert "does not fit this model" in line, line


# ------------------------------------------------------------------------------------ the data side, one process


def test_tokenized_once_then_found_again(data, tmp_path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(data["model"])
    calls = []

    def counting(*texts, **kwargs):
        calls.append(len(texts[0]))
        return tokenizer(*texts, **kwargs)

    counting.model_input_names = tokenizer.model_input_names
    files = DataInputs([data["train"]], [data["validation"]])
    made = [
        prepare_labelled_text(files, data["model"], counting, ["text"], "label", 128, str(tmp_path)) for _ in range(2)
    ]
    assert made[0] == made[1] and calls == [384, N_VALIDATION]  # the second found the first's folder
    folder, info = made[0]
    assert info["labels"] == ["food", "music", "space", "sport"] and info["splits"]["train"]["rows"] == 384
    other = prepare_labelled_text(files, data["model"], counting, ["text"], "label", 32, str(tmp_path))
    assert other[0] != folder and info["splits"]["train"]["at_max_seq_length"] == 0
    assert other[1]["splits"]["train"]["at_max_seq_length"] > 0  # rows of up to 60 words reach 32 tokens


def write_in_pieces(tmp):
    """What save_to_disk does for two splits, slowly enough for a second writer to meet it."""
    import time

    for split in ("train", "validation"):
        os.makedirs(os.path.join(tmp, split))
        with open(os.path.join(tmp, split, "data.arrow"), "wb") as f:
            for _ in range(10):
                f.write(b"x" * 20_000)
                time.sleep(0.0005)
    return {"rows": 1}


def same_pid_writer(root, barrier, results):
    """A run on another host (or container) sharing the token cache, with the same process id as its peer."""
    from data.labelled_text import cached_folder

    real, os.getpid = os.getpid, lambda: 4242  # two hosts' runs can have one pid
    barrier.wait()
    try:
        cached_folder(root, "train", {"k": 1}, write_in_pieces)
        outcome = "ok"
    except Exception as e:
        outcome = f"{type(e).__name__}: {e}"
    os.getpid = real  # multiprocessing's queue needs the real one
    results.put(outcome)


def test_two_hosts_writing_the_same_tokens_at_once_both_get_a_whole_folder(tmp_path):
    """Two writers of one token folder released together, 40 times, with the same pid: each gets the
    folder, and the folder that appears is whole (a pid-named temporary folder was shared and torn)."""
    import multiprocessing

    context = multiprocessing.get_context("fork")
    outcomes = []
    for n in range(40):
        root = str(tmp_path / str(n))
        barrier, results = context.Barrier(2), context.Queue()
        writers = [context.Process(target=same_pid_writer, args=(root, barrier, results)) for _ in range(2)]
        for w in writers:
            w.start()
        outcomes += [results.get(timeout=60) for _ in writers]
        for w in writers:
            w.join()
        published = [name for name in os.listdir(root) if ".tmp-" not in name]
        assert len(published) == 1 and all(
            os.path.getsize(os.path.join(root, published[0], split, "data.arrow")) == 200_000
            for split in ("train", "validation")
        ), os.listdir(root)
    assert outcomes == ["ok"] * 80, [o for o in outcomes if o != "ok"][:3]


def test_sentence_pairs_and_a_saved_datasets_folder(data, tmp_path):
    import datasets
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(data["model"])
    pairs = datasets.DatasetDict(
        {
            split: datasets.Dataset.from_dict(
                {
                    "question": [f"is it {i}" for i in range(n)],
                    "passage": [f"it is {i % 3}" for i in range(n)],
                    "answer": [i % 3 == i % 5 for i in range(n)],
                }
            )
            for split, n in (("train", 40), ("validation", 11))
        }
    )
    pairs.save_to_disk(tmp_path / "pairs")
    folder, info = prepare_labelled_text(
        DataInputs([str(tmp_path / "pairs")]),
        data["model"],
        tokenizer,
        ["question", "passage"],
        "answer",
        64,
        str(tmp_path / "tokens"),
    )
    assert info["labels"] == ["False", "True"] and info["splits"]["validation"]["rows"] == 11
    train = datasets.load_from_disk(os.path.join(folder, "train"))
    assert 1 in train[0]["token_type_ids"] and train[0]["input_ids"].count(tokenizer.sep_token_id) == 2


def test_labels_as_integers_keep_their_order():
    import datasets

    train = datasets.Dataset.from_dict({"label": [10, 2, 2, 33]})
    names, ids = label_names(train, datasets.Dataset.from_dict({"label": [33]}), "label")
    assert names == ["2", "10", "33"] and ids == {"train": [1, 0, 0, 2], "validation": [2]}
    kinds = datasets.ClassLabel(names=["neg", "pos"])  # a ClassLabel column keeps its own names
    train = datasets.Dataset.from_dict({"label": [1, 0, 1]}, features=datasets.Features({"label": kinds}))
    names, ids = label_names(train, train, "label")
    assert names == ["neg", "pos"] and ids["train"] == [1, 0, 1]


@pytest.mark.parametrize("side", ["right", "left"])
def test_token_batch_pads_each_batch_to_the_bucket_of_its_longest_row(side):
    batch = TokenBatch(0, side)(
        {"input_ids": [[5, 6, 7], [8]], "token_type_ids": [[0, 1, 1], [0]], "label": torch.tensor([1, 0])}
    )
    assert batch["input_ids"].shape == (2, 8) and batch["labels"].tolist() == [1, 0]  # 3 -> 8 (data/padding.py)
    expected = [[1] * 3 + [0] * 5, [1] + [0] * 7] if side == "right" else [[0] * 5 + [1] * 3, [0] * 7 + [1]]
    assert batch["attention_mask"].tolist() == expected
    assert batch["input_ids"][1].tolist() == ([8] + [0] * 7 if side == "right" else [0] * 7 + [8])
    same = TokenBatch(0, side, max_length=2)(
        {"input_ids": torch.tensor([[5, 6], [7, 8]]), "label": torch.tensor([1, 0])}
    )
    assert same["input_ids"].tolist() == [[5, 6], [7, 8]] and same["attention_mask"].tolist() == [[1, 1], [1, 1]]


@pytest.mark.parametrize("shuffle", [True, False], ids=["train", "evaluation"])
def test_grouping_by_length_keeps_every_promise_and_pads_less(shuffle):
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 100, 1037)
    policy = "drop" if shuffle else "pad"

    def global_batches(world_size, grouped=True):
        per_rank = [
            list(
                BatchPlan(
                    [1] * 1037,
                    32,
                    world_size,
                    r,
                    seed=3,
                    shuffle=shuffle,
                    policy=policy,
                    lengths=lengths if grouped else None,
                ).rank_batches(2)
            )
            for r in range(world_size)
        ]
        return [torch.cat([per_rank[r][b][1] for r in range(world_size)]) for b in range(len(per_rank[0]))], [
            torch.cat([per_rank[r][b][2] for r in range(world_size)]) for b in range(len(per_rank[0]))
        ]

    batches, valid = global_batches(1)
    for world_size in (2, 4):  # the same global batches for any process count
        assert all(torch.equal(a, b) for a, b in zip(global_batches(world_size)[0], batches, strict=True))
    ids = torch.cat(batches)[torch.cat(valid)].tolist()
    assert len(ids) == len(set(ids)) and (shuffle or sorted(ids) == list(range(1037)))

    def padding(batches):
        return sum(int(lengths[b.numpy()].max()) * len(b) - int(lengths[b.numpy()].sum()) for b in batches)

    assert padding(batches) * 5 < padding(global_batches(1, grouped=False)[0])
    if shuffle:  # another epoch, another order of batches
        other = BatchPlan([1] * 1037, 32, 1, 0, seed=3, lengths=lengths)
        assert not torch.equal(next(other.rank_batches(3))[1], batches[0])


def test_the_recipe_and_the_sweep_file_pass_the_scripts_own_parser(monkeypatch):
    from conftest import REPO
    from train import text_classification
    from train.study.space import check_against_script, load_script, read_sweep

    monkeypatch.chdir(REPO)
    args = text_classification.parse_args(["--config", "train/configs/text_wordnet.yaml"])
    assert args.max_seq_length == 64 and args.group_by_length and args.learning_rate == 1e-4
    sweep = read_sweep("train/configs/sweep_text_wordnet.yaml", {"n_trials": None})
    check_against_script(sweep, load_script(sweep["script"]))
    assert sweep["metric"] == "eval_f1" and sweep["direction"] == "maximize"


def test_predict_takes_a_pair_model_s_texts_as_pairs_and_refuses_one_without_its_tab(tmp_path, capsys):
    """A model trained on sentence pairs (args.json's text_column names two) reads each text as
    FIRST<TAB>SECOND, as it trained, and prints both; a text without the TAB is refused in one line."""
    folder = tiny_bert(tmp_path / "pairs", num_labels=2)
    for name, content in (("args.json", {"text_column": "question,passage"}), ("all_results.json", {})):
        with open(os.path.join(folder, name), "w") as f:
            json.dump(content, f)
    proc = run_as_script(capsys, "text_classification", "--output_dir", folder, "--predict", "is it 1\tit is 1")
    fields = proc.stdout.strip().split("\t")
    assert proc.returncode == 0 and fields[:2] == ["is it 1", "it is 1"] and len(fields) == 4, output_of(proc)
    for text, tabs in (("is it", "no TABs"), ("is it\tit is\t1", "2 TABs")):
        proc = run_as_script(capsys, "text_classification", "--output_dir", folder, "--predict", "is it\tit is", text)
        assert proc.returncode == 1 and proc.stdout == "", output_of(proc)
        assert proc.stderr.strip() == (
            f"error: --output_dir {folder} was trained on sentence pairs (question,passage); give each text as "
            f"FIRST<TAB>SECOND: {first_words(text)} has {tabs}"
        )
