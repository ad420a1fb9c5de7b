"""Models and data as users have them (train/text_classification.py, train/sft.py): a Hub id resolved
through a Hugging Face cache on disk (the layout huggingface_hub writes, filled here with tiny models,
HF_HUB_OFFLINE=1), a dataset by name (a local dataset folder such as a cloned Hub repository: data
files and a README naming its configs), labels as datasets define them (ClassLabel order, -1 for "no
label", a benchmark's hidden test split), checkpoints saved in bfloat16 trained in float32 and saved
back in bfloat16, the flags of transformers' scripts, and a main process that tokenizes for longer
than --ddp_timeout."""

import json
import os
import random

import pytest
import torch
from safetensors.torch import load_file

from conftest import launch, output_of, probe, run_as_script, run_main, run_script
from data.errors import DataError
from data.labelled_text import label_names, without_missing_labels
from data.splits import DataInputs, load_splits
from hf_models import WORDS, into_hub_cache, tiny_bert, tiny_causal_lm
from test_checkpointing import largest_difference, weights

MOODS = {"positive": "good great happy fine bright", "negative": "bad sad awful dark poor"}


def reviews(n, seed):
    """Texts of 3 to 30 words, a few of them saying the mood; label 0 positive, 1 negative (ClassLabel order)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        label = rng.randrange(2)
        mood = MOODS[["positive", "negative"][label]].split()
        words = [rng.choice(mood) if rng.random() < 0.3 else rng.choice(WORDS) for _ in range(rng.randint(3, 30))]
        out.append({"text": " ".join(words), "label": label})
    return out


def dataset_folder(root, splits, configs=None):
    """A dataset as a cloned Hub repository holds it: data/SPLIT.parquet (ClassLabel names in the parquet
    metadata, as datasets writes them) and a README whose YAML names the configs and their files."""
    import datasets

    features = datasets.Features(
        {"text": datasets.Value("string"), "label": datasets.ClassLabel(names=["positive", "negative"])}
    )
    os.makedirs(os.path.join(root, "data"))
    for split, records in splits.items():
        datasets.Dataset.from_list(records, features=features).to_parquet(
            os.path.join(root, "data", f"{split}.parquet")
        )
    configs = configs or {"default": {split: split for split in splits}}  # config: {its split: the file's}
    lines = ["---", "configs:"]
    for name, files in configs.items():
        lines += [f"- config_name: {name}", "  data_files:"]
        lines += [f"  - split: {split}\n    path: data/{file}.parquet" for split, file in files.items()]
    (root / "README.md").write_text("\n".join(lines) + "\n---\n# a dataset\n")
    return str(root)


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    """HF_HOME with a tiny BERT (org/tiny-bert) and a tiny GPT-2 saved in bfloat16 with its own generation
    config (org/tiny-gpt2-bf16), as a user's cache holds what they downloaded."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    root = tmp_path_factory.mktemp("hub")
    home = root / "hf_home"
    into_hub_cache(home, "org/tiny-bert", tiny_bert(root / "bert"))
    gpt2 = tiny_causal_lm(root / "gpt2")
    AutoModelForCausalLM.from_pretrained(gpt2, dtype=torch.bfloat16).save_pretrained(gpt2)
    GenerationConfig(max_new_tokens=7, repetition_penalty=1.3, eos_token_id=0).save_pretrained(gpt2)
    into_hub_cache(home, "org/tiny-gpt2-bf16", gpt2)
    return {"home": str(home), "root": root}


def test_a_hub_id_and_a_dataset_folder_with_a_hidden_test_split(hub, tmp_path):
    """2 processes: the model by its Hub id from the cache, the data by --dataset_name (a folder whose test
    split has no labels, datasets' -1 throughout): validation is held out of train instead, the header says
    so, and the labels keep the ClassLabel's order (positive before negative)."""
    hidden = [{"text": r["text"], "label": -1} for r in reviews(16, 2)]
    folder = dataset_folder(tmp_path / "moods", {"train": reviews(200, 1), "test": hidden})
    out = tmp_path / "out"
    proc = launch(
        "cpu_2proc",
        "text_classification",
        "--model_name_or_path",
        "org/tiny-bert",
        "--dataset_name",
        folder,
        "--cache_dir",
        tmp_path / "tokens",
        "--max_train_steps",
        4,
        "--learning_rate",
        1e-3,
        "--output_dir",
        out,
        HF_HOME=hub["home"],
    )
    assert proc.returncode == 0, output_of(proc)
    assert (
        "180 train, 20 validation rows (10% of the dataset's train split held out; the dataset's test split has "
        "no labels), 2 labels (positive, negative)"
    ) in proc.stdout, proc.stdout
    assert json.load(open(out / "all_results.json"))["eval_samples"] == 20
    assert json.load(open(out / "config.json"))["id2label"] == {"0": "positive", "1": "negative"}
    fingerprint = json.load(open(out / "args.json"))["model_fingerprint"]
    assert fingerprint and len(fingerprint) == 24


def test_a_revision_missing_from_the_cache_is_named(hub):
    """org/tiny-bert is cached at main only: asking for v2 offline names v2, in the fix too."""
    import subprocess
    import sys

    from conftest import REPO, clean_env

    code = (
        "from data.errors import UserError\nfrom train.models.pretrained import resolve_model\n"
        "try:\n    resolve_model('org/tiny-bert', revision='v2')\nexcept UserError as e:\n    print(e)"
    )
    env = clean_env(HF_HOME=hub["home"], HF_HUB_OFFLINE="1", PYTHONPATH=REPO)  # read when huggingface_hub loads
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=REPO)
    line = proc.stdout.strip()
    assert line.startswith("--model_name_or_path org/tiny-bert at revision v2 is neither a local folder"), line
    assert "(hf download org/tiny-bert --revision v2, with HF_HOME" in line, line


def test_sft_takes_a_hub_id_and_saves_in_its_dtype_with_its_generation_config(hub, tmp_path):
    """A bfloat16 checkpoint by Hub id, fine-tuned with float32 master weights and written back in bfloat16
    with the source's generation_config.json; its output generates with that config."""
    from hf_models import tiny_tokenizer  # noqa: F401  (the tokenizer came with the model)

    data = tmp_path / "pairs"
    data.mkdir()
    for split, n, seed in (("train", 48, 0), ("validation", 9, 1)):
        rng = random.Random(seed)
        with open(data / f"{split}.jsonl", "w") as f:
            f.writelines(
                json.dumps({"prompt": f"define {w}\n", "response": f"{w} means {rng.choice(WORDS)}"}) + "\n"
                for w in (rng.choice(WORDS) for _ in range(n))
            )
    out = tmp_path / "sft"
    proc = run_script(
        "sft",
        "--model_name_or_path",
        "org/tiny-gpt2-bf16",
        "--dataset_name",
        data,
        "--cache_dir",
        tmp_path / "tokens",
        "--max_train_steps",
        3,
        "--mixed_precision",
        "no",
        "--learning_rate",
        1e-3,
        "--output_dir",
        out,
        HF_HOME=hub["home"],
    )
    assert proc.returncode == 0, output_of(proc)
    assert "validation (the dataset's validation split) 9 examples" in proc.stdout, proc.stdout
    assert "training weights float32" in proc.stdout and "frozen" not in proc.stdout
    assert json.load(open(out / "config.json"))["dtype"] == "bfloat16"
    assert {t.dtype for t in weights(out).values()} == {torch.bfloat16}
    umask = os.umask(0)
    os.umask(umask)
    assert os.stat(out / "model.safetensors").st_mode & 0o777 == 0o666 & ~umask  # a team can load it
    generation = json.load(open(out / "generation_config.json"))
    assert generation["max_new_tokens"] == 7 and generation["repetition_penalty"] == 1.3
    proc = run_script("sft", "--output_dir", out, "--prompt", "define water\\n", "--max_new_tokens", 2)
    assert proc.returncode == 0 and proc.stdout.startswith("define water\t"), output_of(proc)


@pytest.fixture(scope="module")
def precisions(tmp_path_factory):
    """A tiny BERT saved in bfloat16, and its exact float32 copy (every value the same number)."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    root = tmp_path_factory.mktemp("precisions")
    source = tiny_bert(root / "source", num_labels=2, seed=3)
    paths = {}
    for name, dtype in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
        model = AutoModelForSequenceClassification.from_pretrained(source, dtype=torch.bfloat16).to(dtype)
        model.save_pretrained(root / name)
        AutoTokenizer.from_pretrained(source).save_pretrained(root / name)
        paths[name] = str(root / name)
    folder = dataset_folder(root / "moods", {"train": reviews(160, 4), "validation": reviews(24, 5)})
    return {**paths, "data": folder, "root": root}


def short_run(precisions, model, out, *extra):
    return run_main(
        "text_classification",
        "--model_name_or_path",
        precisions[model],
        "--dataset_name",
        precisions["data"],
        "--cache_dir",
        precisions["root"] / "tokens",
        "--max_train_steps",
        4,
        "--learning_rate",
        1e-4,
        "--mixed_precision",
        "no",
        "--per_device_train_batch_size",
        8,
        "--output_dir",
        out,
        *extra,
    )


def test_a_bfloat16_checkpoint_takes_the_steps_of_its_float32_copy(precisions, tmp_path, capsys):
    """Trained with float32 master weights (the default), the bfloat16 checkpoint and its float32 copy take
    the same 4 steps; each output is written in its source's dtype. Updating the bfloat16 weights as they
    are (--pure_low_precision with --torch_dtype auto) takes other steps."""
    short_run(precisions, "fp32", tmp_path / "fp32")
    short_run(precisions, "bf16", tmp_path / "bf16", "--save_dtype", "float32")
    same = largest_difference(weights(tmp_path / "fp32"), weights(tmp_path / "bf16"))
    short_run(
        precisions,
        "bf16",
        tmp_path / "pure",
        "--torch_dtype",
        "auto",
        "--pure_low_precision",
        "--save_dtype",
        "float32",
    )
    pure = largest_difference(weights(tmp_path / "fp32"), weights(tmp_path / "pure"))
    with capsys.disabled():
        print(f"bfloat16 checkpoint vs its float32 copy after 4 steps: {same:.1e}; trained in bfloat16: {pure:.1e}")
    assert same == 0 and pure > 1e-5, (same, pure)
    assert {t.dtype for t in weights(tmp_path / "fp32").values()} == {torch.float32}
    short_run(precisions, "bf16", tmp_path / "auto")  # --save_dtype auto: the source's bfloat16
    assert {t.dtype for t in weights(tmp_path / "auto").values()} == {torch.bfloat16}
    assert "training weights float32" in capsys.readouterr().out


def test_lora_keeps_a_bfloat16_base_frozen_and_its_best_model_file_holds_only_what_trains(precisions, tmp_path, capsys):
    out = tmp_path / "lora"
    lora = [
        "--lora_r",
        4,
        "--torch_dtype",
        "bfloat16",
        "--max_train_steps",
        6,
        "--eval_steps",
        2,
        "--checkpointing_steps",
        2,
        "--metric_for_best_model",
        "loss",
        "--learning_rate",
        1e-3,
    ]
    with pytest.raises(DataError.__base__, match="frozen weights are bfloat16 .* pass --mixed_precision bf16"):
        short_run(precisions, "bf16", tmp_path / "refused", *lora)  # the new head is float32, the body bfloat16
    short_run(precisions, "bf16", out, *lora, "--mixed_precision", "bf16")
    printed = capsys.readouterr().out
    assert "training weights float32, frozen bfloat16" in printed, printed
    best = [load_file(out / "checkpoints" / c / "best_model.safetensors") for c in os.listdir(out / "checkpoints")]
    assert best and all(k for b in best for k in b)
    assert all("lora_" in k or "modules_to_save" in k or "classifier" in k for b in best for k in b), sorted(best[0])
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(out)  # the merged model, in the source's dtype
    assert model.dtype == torch.bfloat16 and (out / "adapter" / "adapter_model.safetensors").exists()


def test_the_main_process_may_tokenize_for_longer_than_ddp_timeout(tmp_path):
    """Rank 0 prepares the data 8 s longer than usual, past --ddp_timeout 3: rank 1 waits for it
    instead of failing in its collective."""
    folder = tmp_path / "model"
    tiny_causal_lm(folder)
    rows = [{"prompt": f"define {w}\n", "response": f"{w} means water"} for w in WORDS]
    (tmp_path / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    proc = probe(
        "cpu_2proc",
        ["--slow_prepare", 8],
        "--model_name_or_path",
        folder,
        "--train_file",
        tmp_path / "pairs.jsonl",
        "--cache_dir",
        tmp_path / "tokens",
        "--max_train_steps",
        2,
        "--per_device_train_batch_size",
        2,
        "--ddp_timeout",
        3,
        "--output_dir",
        tmp_path / "out",
        script="sft",
    )
    assert proc.returncode == 0 and "world_size=2" in proc.stdout, output_of(proc)


def test_a_classifier_keeps_its_head_for_its_own_labels_and_gets_a_new_one_for_others(tmp_path, capsys):
    """A pretrained classifier of animal, food, weather. On data of the same labels (in another order)
    its head goes on as it was, in its own order; on food, weather, zoo its rows would mean animal,
    food, weather under the new names, so the head is drawn anew and the header says so."""
    from transformers import AutoConfig

    pretrained = tiny_bert(tmp_path / "classifier", num_labels=3)
    config = AutoConfig.from_pretrained(pretrained)
    config.id2label = {0: "animal", 1: "food", 2: "weather"}
    config.label2id = {v: k for k, v in config.id2label.items()}
    config.save_pretrained(pretrained)
    before = weights(pretrained)

    def fine_tune(labels, name):
        rng = random.Random(0)
        for split, n in (("train", 24), ("validation", 9)):
            with open(tmp_path / f"{name}_{split}.csv", "w") as f:
                f.write("text,label\n")
                f.writelines(f"{' '.join(rng.sample(WORDS, 5))},{labels[i % 3]}\n" for i in range(n))
        proc = run_as_script(
            capsys,
            "text_classification",
            "--model_name_or_path",
            pretrained,
            "--train_file",
            tmp_path / f"{name}_train.csv",
            "--validation_file",
            tmp_path / f"{name}_validation.csv",
            "--max_train_steps",
            1,
            "--per_device_train_batch_size",
            8,
            "--learning_rate",
            1e-12,
            "--mixed_precision",
            "no",
            "--cache_dir",
            tmp_path / "tokens",
            "--output_dir",
            tmp_path / name,
        )
        assert proc.returncode == 0, output_of(proc)
        return proc.stdout, weights(tmp_path / name), json.load(open(tmp_path / name / "config.json"))["id2label"]

    out, after, id2label = fine_tune(["weather", "animal", "food"], "same")
    assert "new: nothing;" in out and id2label == {"0": "animal", "1": "food", "2": "weather"}
    assert largest_difference(after, before) < 1e-6

    out, after, id2label = fine_tune(["food", "weather", "zoo"], "other")
    assert "new: classifier (the pretrained head's labels were animal, food, weather);" in out, out
    assert id2label == {"0": "food", "1": "weather", "2": "zoo"}
    assert (after["classifier.weight"] - before["classifier.weight"]).abs().max() > 1e-3
    body = [k for k in after if k.startswith("bert.")]
    assert body and largest_difference({k: after[k] for k in body}, {k: before[k] for k in body}) < 1e-6


# ------------------------------------------------------------------------------------ labels and splits, one process


def test_a_classlabel_keeps_its_order_and_a_pretrained_heads_order_is_kept_when_it_fits():
    import datasets

    kinds = datasets.ClassLabel(names=["positive", "negative"])
    train = datasets.Dataset.from_dict({"label": [1, 0, 1]}, features=datasets.Features({"label": kinds}))
    names, ids = label_names(train, train, "label")
    assert names == ["positive", "negative"] and ids["train"] == [1, 0, 1]
    names, ids = label_names(train, train, "label", preferred=["negative", "positive"])  # the head's own order
    assert names == ["negative", "positive"] and ids["train"] == [0, 1, 0]
    names, _ = label_names(train, train, "label", preferred=["LABEL_0", "LABEL_1", "LABEL_2"])  # not these labels
    assert names == ["positive", "negative"]


def test_rows_without_a_label_are_refused_naming_them_or_left_out_and_counted():
    import datasets

    kinds = datasets.ClassLabel(names=["a", "b"])
    train = datasets.Dataset.from_dict(
        {"text": list("pqrstu"), "label": [0, -1, 1, 1, -1, 0]},
        features=datasets.Features({"text": datasets.Value("string"), "label": kinds}),
    )
    names, ids = label_names(train, train, "label")
    assert ids["train"] == [0, None, 1, 1, None, 0]  # -1 is "no label", never the last class
    with pytest.raises(DataError, match=r"2 row\(s\) without a 'label' \(row 1, 4; .*--missing_labels drop"):
        without_missing_labels(train, ids["train"], "label", "train", "error")
    # named by their text: a held-out split's row numbers are not the file's
    with pytest.raises(DataError, match=r"2 row\(s\) without a 'label' \('q', 't'; empty, or"):
        without_missing_labels(train, ids["train"], "label", "train", "error", "text")
    kept, labels, dropped = without_missing_labels(train, ids["train"], "label", "train", "drop")
    assert kept["text"] == list("prsu") and labels == [0, 1, 1, 0] and dropped == 2
    strings = datasets.Dataset.from_dict({"label": ["x", None, "", "y"]})
    assert label_names(strings, strings, "label")[1]["train"] == [0, None, None, 1]


def test_dataset_splits_by_name_config_and_fallback(tmp_path):
    labelled = {"train": reviews(50, 0), "test": reviews(10, 1)}
    folder = dataset_folder(
        tmp_path / "d",
        {**labelled, "other": reviews(30, 2)},
        configs={"default": {"train": "train", "test": "test"}, "small": {"train": "other"}},
    )
    splits, where = load_splits(DataInputs(dataset_name=folder), "label")
    assert where == "the dataset's test split" and len(splits["validation"]) == 10  # labelled: it evaluates
    splits, where = load_splits(DataInputs(dataset_name=folder, dataset_config_name="small"), "label")
    assert len(splits["train"]) + len(splits["validation"]) == 30 and len(splits["validation"]) == 3
    assert where == "10% of the dataset's train split held out"
    with pytest.raises(DataError, match="--dataset_name takes its splits from the dataset; leave out --train_file"):
        load_splits(DataInputs(train_file=["x.csv"], dataset_name=folder))
    with pytest.raises(DataError, match="--dataset_name no-such/dataset does not load: .*offline"):
        load_splits(DataInputs(dataset_name="no-such/dataset"))


def test_a_plain_integer_test_split_of_minus_ones_is_hidden_and_elsewhere_minus_one_is_a_class(tmp_path):
    """A benchmark exported without its ClassLabel (plain integers): its test split, -1 throughout, is
    a hidden split, not a class of its own; -1 among other values (-1/0/1 sentiment) is a class."""
    import datasets

    os.makedirs(tmp_path / "d" / "data")
    rng = random.Random(3)
    records = {
        "train": [{"text": " ".join(rng.sample(WORDS, 4)), "label": rng.choice([-1, 0, 1])} for _ in range(40)],
        "test": [{"text": " ".join(rng.sample(WORDS, 4)), "label": -1} for _ in range(8)],
    }
    for split, rows in records.items():
        datasets.Dataset.from_list(rows).to_parquet(str(tmp_path / "d" / "data" / f"{split}.parquet"))
    splits, where = load_splits(DataInputs(dataset_name=str(tmp_path / "d")), "label")
    assert where == "10% of the dataset's train split held out; the dataset's test split has no labels"
    assert len(splits["train"]) == 36 and len(splits["validation"]) == 4
    names, ids = label_names(splits["train"], splits["validation"], "label")
    assert names == ["-1", "0", "1"] and None not in ids["train"]


def test_a_save_to_disk_folder_validates_and_a_validation_file_is_named_as_one(tmp_path):
    """--validation_file takes a save_to_disk folder (a Dataset, or a DatasetDict's validation split or
    only split), beside files or a folder to train on; its faults name --validation_file."""
    import datasets

    rows = reviews(30, 4)
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[:20]))
    datasets.Dataset.from_list(rows[20:]).save_to_disk(str(tmp_path / "validation"))
    datasets.DatasetDict({"test": datasets.Dataset.from_list(rows[20:])}).save_to_disk(str(tmp_path / "dict"))
    datasets.Dataset.from_list(rows[:20]).save_to_disk(str(tmp_path / "train_folder"))
    for train in (str(tmp_path / "train.jsonl"), str(tmp_path / "train_folder")):
        for validation in ("validation", "dict"):
            splits, where = load_splits(DataInputs([train], [str(tmp_path / validation)]), "label")
            assert where == "--validation_file" and (len(splits["train"]), len(splits["validation"])) == (20, 10)
    (tmp_path / "header.csv").write_text("text,label\n")
    with pytest.raises(DataError, match=f"^--validation_file {tmp_path / 'header.csv'} has no rows"):
        load_splits(DataInputs([str(tmp_path / "train_folder")], [str(tmp_path / "header.csv")]), "label")


# ------------------------------------------------------------------------------------ flags users know


def test_transformers_schedules_by_name_and_a_warmup_ratio():
    from transformers import get_scheduler

    from train.core.schedule import make_scheduler, warmup_steps

    assert warmup_steps(0, 0.1, 95) == 10 and warmup_steps(7, 0.1, 95) == 7  # steps win, as in transformers

    def lrs(scheduler):
        out = []
        for _ in range(20):
            out.append(scheduler.get_last_lr()[0])
            scheduler.optimizer.step()
            scheduler.step()
        return out

    def optimizer():
        return torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)

    for name, kwargs in (
        ("polynomial", {"power": 2.0}),
        ("cosine_with_min_lr", {"min_lr_rate": 0.1}),
        ("constant_with_warmup", None),
    ):
        ours = lrs(make_scheduler(optimizer(), name, 4, 20, kwargs))
        theirs = lrs(get_scheduler(name, optimizer(), 4, 20, scheduler_specific_kwargs=kwargs or {}))
        assert ours == theirs, name


def test_a_mistyped_folder_is_not_taken_for_a_hub_name(tmp_path, capsys):
    """tests/ is a folder here, so tests/no_such_model was meant as a folder, not as Hub id org/name."""
    rows = reviews(20, 0)
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    common = ["--cache_dir", tmp_path / "tokens", "--output_dir", tmp_path / "out"]
    for flags, expected in (
        (
            ["--model_name_or_path", "tests/no_such_model", "--train_file", tmp_path / "train.jsonl"],
            "--model_name_or_path tests/no_such_model is not a folder",
        ),
        (
            ["--model_name_or_path", tiny_bert(tmp_path / "model"), "--dataset_name", "tests/no_such_data"],
            "--dataset_name tests/no_such_data: no such folder",
        ),
    ):
        proc = run_as_script(capsys, "text_classification", *flags, *common)
        lines = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
        assert proc.returncode == 1 and len(lines) == 1 and expected in lines[0], output_of(proc)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "flags, code, expected",
    [
        (["--push_to_hub"], 2, "--push_to_hub: this project never uploads"),
        (["--report_to", "wandb", "--with_tracking"], 1, "--report_to wandb: the wandb package is not installed"),
        (["--lr_scheduler_type", "cosine_with_min_lr"], 1, "--lr_scheduler_type cosine_with_min_lr: "),
        (["--torch_dtype", "bfloat8"], 2, "argument --torch_dtype: invalid choice: 'bfloat8'"),
    ],
)
def test_flags_we_do_not_take_are_one_line(flags, code, expected, tmp_path, capsys):
    import importlib.util

    if "wandb" in flags and importlib.util.find_spec("wandb"):
        pytest.skip("wandb is installed here")
    model = tiny_bert(tmp_path / "model")
    rows = reviews(40, 0)
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    proc = run_as_script(
        capsys,
        "text_classification",
        "--model_name_or_path",
        model,
        "--train_file",
        tmp_path / "train.jsonl",
        "--cache_dir",
        tmp_path / "tokens",
        "--max_train_steps",
        1,
        "--output_dir",
        tmp_path / "out",
        *flags,
    )
    lines = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode == code and len(lines) == 1 and expected in lines[0], output_of(proc)
    assert not (tmp_path / "out" / "all_results.json").exists()


def test_max_length_is_sft_s_max_seq_length_and_text_classification_checkpoints_activations(precisions, tmp_path):
    from train import sft

    assert sft.parse_args(["--train_file", "x.jsonl", "--max_length", "77"]).max_seq_length == 77
    short_run(precisions, "fp32", tmp_path / "plain")
    short_run(precisions, "fp32", tmp_path / "checkpointed", "--gradient_checkpointing")
    assert largest_difference(weights(tmp_path / "plain"), weights(tmp_path / "checkpointed")) < 1e-6
