"""train/lm.py end to end on a small text under real processes: exact evaluation counts, the same
steps from 1 and 2 processes, SIGKILL + resume bit-identical, sampling, bad input in one line."""

import json
import os
import random
import re
import shutil

import pytest
import torch

from conftest import output_of, run_as_script
from data.prepare import main as prepare_main
from data.sharding import ShardedIterableDataset
from data.shards import shards_in
from data.sources import ParquetSource
from data.text import decode_windows
from test_checkpointing import crash_during_save_and_resume, largest_difference, resume_copy, weights

WORDS = (
    "the of and a to in is was he for it with as his on be at by had not are but from or have an they which "
    "one you were her all she there would their we him been has when who will more no if out so said"
).split()
TINY = [
    "--block_size",
    32,
    "--n_layer",
    2,
    "--n_head",
    2,
    "--n_embd",
    32,
    "--per_device_train_batch_size",
    4,
    "--per_device_eval_batch_size",
    8,
    "--num_warmup_steps",
    2,
    "--logging_steps",
    4,
]


@pytest.fixture(scope="module")
def text(tmp_path_factory):
    folder = tmp_path_factory.mktemp("text")
    rng = random.Random(0)
    lines = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 20))) for _ in range(400)]
    (folder / "train.txt").write_text("\n".join(lines[:360]) + "\n")
    (folder / "validation.txt").write_text("\n".join(lines[360:]) + "\n")
    shards = str(folder / "shards")
    prepare_main(
        [
            "--train_file",
            str(folder / "train.txt"),
            "--validation_file",
            str(folder / "validation.txt"),
            "--tokenizer",
            "bytes",
            "--block_size",
            "32",
            "--output_dir",
            shards,
            "--rows_per_group",
            "4",
        ]
    )
    return folder, shards


def results(out):
    return json.load(open(os.path.join(out, "all_results.json")))


@pytest.mark.parametrize("world,workers", [(1, 0), (2, 2), (3, 1)])
def test_every_window_once_per_epoch_and_ranks_read_their_own_row_groups(text, world, workers):
    _, shards = text
    manifest = json.load(open(os.path.join(shards, "manifest.json")))
    seen, reads = [], []
    for rank in range(world):
        source = ParquetSource(shards_in(shards, "train"), decode=decode_windows(manifest["token_dtype"]))
        ds = ShardedIterableDataset(source, 4 * world, rank, world, seed=3)
        loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=workers)
        for batch in loader:
            assert batch["input_ids"].shape == (4, 32) and (batch["labels"] != -100).all()
            assert torch.equal(batch["input_ids"][:, 1:], batch["labels"][:, :-1])  # targets are the next tokens
            seen += batch["index"].tolist()
        reads.append(source.rows_read if workers == 0 else None)
    windows = manifest["text"]["train"]["windows"]
    # `drop` leaves out the epoch's last windows % (4 W) in shuffled order; the rest come once each
    assert len(seen) == len(set(seen)) == windows - windows % (4 * world) and set(seen) <= set(range(windows))
    if workers == 0:
        assert reads == [len(seen) // world] * world  # row groups of 4 windows: no rank reads another's


# the 2-process run several tests read
RUN = [*TINY, "--max_train_steps", 12, "--eval_steps", 6, "--checkpointing_steps", 4, "--with_tracking"]


@pytest.fixture(scope="module")
def two_process_run(text, tmp_path_factory):
    """One launch, whose rank 0 is SIGKILLed as checkpoint 8 is about to be published (its finished
    files kept aside: the uninterrupted run's state there); torch elastic's restart resumes from
    step 4 and runs to the end, in the folder the other tests read. Returns (folder, launch, root)."""
    folder, shards = text
    root = tmp_path_factory.mktemp("lm2")
    proc, out = crash_during_save_and_resume("cpu_2proc", "lm", 8, root, "--dataset_dir", shards, *RUN)
    return out, proc, root


def test_two_processes_score_every_validation_token_once_and_report_the_run(text, two_process_run, capsys):
    _, shards = text
    out, proc, _ = two_process_run
    manifest, got = json.load(open(os.path.join(shards, "manifest.json"))), results(out)
    assert got["world_size"] == 2 and got["eval_tokens"] == manifest["text"]["validation"]["scored_tokens"]
    assert [h["step"] for h in got["history"]] == [6, 12] and got["history"][-1]["eval_loss"] < got["history"][0][
        "eval_loss"
    ]
    assert 0 < got["eval_bpb"] < 8 and got["train_tokens_per_second"] > 0 and 0 < got["mfu"] < 1
    assert got["peak_memory_mb"] > 0 and "eval_bpb=" in proc.stdout
    model_line = [line for line in proc.stdout.splitlines() if line.startswith("model: GPT, ")]
    assert len(model_line) == 2 and model_line[0].startswith(  # by rank 0 alone, once in each attempt
        f"model: GPT, {got['parameters'] / 1e6:.2f}M parameters, 2 layers, 2 heads, width 32, context 32, vocab "
    ), proc.stdout[-2000:]
    assert "too few for the model to learn much" not in proc.stdout  # 12 steps, as asked
    events = [f for _, _, files in os.walk(out / "tensorboard") for f in files if f.startswith("events.out.tfevents")]
    assert events, "--with_tracking wrote no TensorBoard events"  # lm.py once took the flag and wrote none
    final = weights(out)  # GPT-2's names, the tied output layer once (transformers' save), without a warning
    assert "transformer.wte.weight" in final and "lm_head.weight" not in final
    assert "shared tensor" not in output_of(proc)
    sampled = run_as_script(capsys, "lm", "--output_dir", out, "--prompt", "the man", "--max_new_tokens", 40)
    assert sampled.returncode == 0 and sampled.stdout.startswith("the man") and len(sampled.stdout) > len("the man")


def test_the_run_is_a_hugging_face_folder_and_an_older_runs_folder_still_samples(
    text, two_process_run, tmp_path, capsys
):
    """The final folder loads with AutoModelForCausalLM + AutoTokenizer, quietly, with our GPT's
    logits and tokens; --prompt reads the folder's own tokenizer (no token shards needed), and a run
    saved before (our names, the shape and the shards in all_results.json) still samples."""
    from test_gpt import loads_quietly
    from train.lm import trained_model
    from train.models.gpt import GPT
    from train.models.gpt_hf import from_gpt2

    out, _, _ = two_process_run
    assert {
        "config.json",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "all_results.json",
        "args.json",
        "metrics.jsonl",
        "curves.png",
    } <= set(os.listdir(out))
    hf, tokenizer = loads_quietly(out)
    config, ours, _ = trained_model(str(out))
    model = GPT(config).eval()
    model.load_state_dict(ours)
    ids = tokenizer("the man was", return_tensors="pt")["input_ids"]
    assert ids[0].tolist() == list(b"the man was")  # --tokenizer bytes: byte values as ids
    with torch.no_grad():
        assert (hf(ids).logits - model(ids)).abs().max() < 1e-5
    assert torch.equal(hf.generate(ids, max_new_tokens=20, do_sample=False), model.generate(ids, 20, temperature=0))

    def prompt(folder):
        proc = run_as_script(capsys, "lm", "--output_dir", folder, "--prompt", "the man", "--max_new_tokens", 30)
        assert proc.returncode == 0, output_of(proc)
        return proc.stdout

    moved = tmp_path / "moved"  # the folder alone, its shards gone
    shutil.copytree(out, moved, ignore=shutil.ignore_patterns("checkpoints", "tensorboard"))
    finished = results(moved)
    json.dump({**finished, "dataset_dir": str(tmp_path / "gone")}, open(moved / "all_results.json", "w"))
    expected = prompt(moved)
    assert expected == prompt(out)
    older = tmp_path / "older"  # as train/lm.py wrote it before: our names, no config.json, no tokenizer
    shutil.copytree(moved, older)
    for name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        os.remove(older / name)
    from safetensors.torch import save_file

    save_file({k: v for k, v in from_gpt2(weights(out)).items() if k != "lm_head.weight"}, older / "model.safetensors")
    json.dump(finished, open(older / "all_results.json", "w"))  # its shards named there, as they were
    assert prompt(older) == expected


def test_sft_fine_tunes_the_exported_gpt(two_process_run, tmp_path, capsys):
    """train/sft.py takes lm.py's folder as any causal LM: its tokenizer (bytes, end-of-text 256), its positions."""
    out, _, _ = two_process_run
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text(
        "".join(json.dumps({"prompt": f"the {w} is\n", "response": f"{w} and {w}."}) + "\n" for w in WORDS[:40])
    )
    proc = run_as_script(
        capsys,
        "sft",
        "--model_name_or_path",
        out,
        "--train_file",
        pairs,
        "--max_train_steps",
        4,
        "--per_device_train_batch_size",
        4,
        "--cache_dir",
        tmp_path / "tokens",
        "--output_dir",
        tmp_path / "sft",
    )
    held_out = "validation (10% of --train_file held out) 4 examples"
    assert proc.returncode == 0 and held_out in proc.stdout, output_of(proc)
    assert "max_seq_length 32;" in proc.stdout and results(tmp_path / "sft")["eval_loss"] > 0


def test_reading_workers_follow_the_runs_device_not_the_machine():
    from train import image_classification, lm
    from train.core.flags import reading_workers

    # left open at parse time: `--cpu` on a GPU machine is a CPU run, with no workers
    assert lm.parse_args(["--output_dir", "x"]).dataloader_num_workers is None
    assert image_classification.parse_args(["--train_dir", "x", "--output_dir", "x"]).dataloader_num_workers is None
    assert reading_workers(None, torch.device("cuda", 0), on_gpu=2) == 2
    assert reading_workers(None, torch.device("cpu"), on_gpu=2) == 0
    assert reading_workers(3, torch.device("cpu"), on_gpu=2) == 3
    assert reading_workers(0, torch.device("cuda", 0), on_gpu=4) == 0


def test_a_short_text_says_what_to_try(text, tmp_path, capsys):
    _, shards = text
    args = [a if a != 4 else 32 for a in TINY]  # one epoch of the small text: about 18 steps
    proc = run_as_script(capsys, "lm", "--dataset_dir", shards, *args, "--output_dir", tmp_path / "short")
    assert proc.returncode == 0, output_of(proc)
    steps = results(tmp_path / "short")["step"]
    assert (
        steps < 100
        and proc.stdout.count(
            f"training windows make {steps} optimizer steps in 1 epoch(s), too few "
            "for the model to learn much; try --max_train_steps 500"
        )
        == 1
    )


def test_one_process_takes_the_same_steps_as_two_with_the_same_global_batch(text, two_process_run, tmp_path, capsys):
    _, shards = text
    out, _, _ = two_process_run
    args = [a if a != 4 else 8 for a in TINY]  # one process, twice the per-device batch
    proc = run_as_script(
        capsys,
        "lm",
        "--dataset_dir",
        shards,
        *args,
        "--max_train_steps",
        12,
        "--eval_steps",
        6,
        "--output_dir",
        tmp_path / "one",
    )
    assert proc.returncode == 0, output_of(proc)
    one, two = results(tmp_path / "one"), results(out)
    assert one["eval_tokens"] == two["eval_tokens"]
    for a, b in zip(one["history"], two["history"], strict=True):
        assert a["eval_loss"] == pytest.approx(b["eval_loss"], rel=1e-5, abs=1e-6)


def test_sigkill_and_resume_is_bit_identical_and_resumes_at_another_process_count(
    text, two_process_run, tmp_path, capsys
):
    _, shards = text
    args = ["--dataset_dir", shards, *RUN]
    full, proc, root = two_process_run
    assert any(s in output_of(proc) for s in ("SIGKILL", "exitcode: -9", "Signal 9")), output_of(proc)[-3000:]
    # rank 1, waiting in step 9's all-reduce for a rank that is gone, is ended by the launcher's agent,
    # which restarts both: the second attempt's rank 0 writes TensorBoard events within a minute of the kill
    pids = re.findall(r"^process 0/2 pid=(\d+) ", proc.stdout, re.M)
    began = [
        int(m)
        for _, _, files in os.walk(full / "tensorboard")
        for f in files
        for m in re.findall(rf"^events\.out\.tfevents\.(\d+)\..*\.{pids[-1]}\.\d+$", f)
    ]
    assert len(pids) == 2 and began, (pids, began)
    assert min(began) - os.path.getmtime(root / "killed") < 60, "the survivor took a minute or more to exit"
    # the restart resumed from step 4 (the unpublished step 8 is no checkpoint) and saved step 8 as
    # the uninterrupted run had (compared by crash_during_save_and_resume, with the first attempt's start)
    assert f"resumed from {full}/checkpoints/step_00000004 (step 4, saved with 2 processes)" in proc.stdout
    evaluated = re.findall(r"step 6: (eval_loss=\S+ eval_bpb=\S+)", proc.stdout)  # before the kill, after the restart
    assert len(evaluated) == 2 and evaluated[0] == evaluated[1], evaluated

    # the same checkpoint resumed by 1 process with the same global batch (8 windows a step) takes
    # the same steps on the same windows: equal to float rounding (the 2-process run sums its
    # gradients in another order), where a wrong data position would be a different trajectory
    one = resume_copy(full, 4, str(tmp_path / "one"))
    proc = run_as_script(
        capsys,
        "lm",
        *args,
        "--per_device_train_batch_size",
        8,
        "--output_dir",
        one,
        "--resume_from_checkpoint",
        "latest",
    )
    assert proc.returncode == 0, output_of(proc)
    assert "world_size=1 " in proc.stdout and f"resumed from {one}/checkpoints/step_00000004" in proc.stdout
    assert largest_difference(weights(one), weights(full)) < 1e-5
    assert results(one)["eval_loss"] == pytest.approx(results(full)["eval_loss"], rel=1e-6)


def test_bad_input_is_one_line(text, two_process_run, tmp_path, capsys):
    folder, shards = text
    (tmp_path / "short.txt").write_text("tiny\n")

    def fails(args, message):
        proc = run_as_script(capsys, "lm", *args, "--output_dir", tmp_path / "out")
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode != 0 and len(lines) == 1 and message in lines[0], output_of(proc)

    fails(["--n_embd", 30, "--n_head", 4], "--n_embd 30 is not divisible by --n_head 4; pick e.g. --n_head 3")
    fails(["--dataset_dir", shards, "--block_size", 64], "holds windows of 32 tokens, not --block_size 64")
    fails(
        [
            "--train_file",
            folder / "train.txt",
            "--validation_file",
            tmp_path / "short.txt",
            "--block_size",
            32,
            "--dataset_dir",
            tmp_path / "cache",
        ],
        "the validation split has 5 tokens, not enough for one window",
    )
    fails(["--dataset_dir", tmp_path], "holds no token shards")
    fails(["--prompt", "hello"], "holds no finished train/lm.py run")
    damaged = tmp_path / "damaged"  # a finished run whose weights file was cut short
    shutil.copytree(two_process_run[0], damaged)
    with open(damaged / "model.safetensors", "r+b") as f:
        f.truncate(100)
    proc = run_as_script(capsys, "lm", "--prompt", "hello", "--output_dir", damaged)
    assert proc.returncode != 0 and proc.stderr.strip().splitlines() == [proc.stderr.strip()], output_of(proc)
    assert "holds no finished train/lm.py run" in proc.stderr, output_of(proc)
    bpe = tmp_path / "bpe"
    prepare_main(
        [
            "--train_file",
            str(folder / "train.txt"),
            "--validation_split_percentage",
            "10",
            "--tokenizer",
            "bpe",
            "--vocab_size",
            "300",
            "--block_size",
            "32",
            "--output_dir",
            str(bpe),
        ]
    )
    mismatched = tmp_path / "mismatched"  # shards of one tokenizer, tokenizer.json of another
    os.makedirs(mismatched)
    for name in os.listdir(bpe):
        os.link(bpe / name, mismatched / name)
    os.remove(mismatched / "tokenizer.json")
    prepare_main(
        [
            "--train_file",
            str(folder / "train.txt"),
            "--validation_split_percentage",
            "10",
            "--tokenizer",
            "bpe",
            "--vocab_size",
            "280",
            "--block_size",
            "32",
            "--output_dir",
            str(tmp_path / "other"),
        ]
    )
    os.link(tmp_path / "other" / "tokenizer.json", mismatched / "tokenizer.json")
    fails(["--dataset_dir", mismatched, "--block_size", 32], "has 280 tokens but its shards were written with 300")
