"""The benchmarks run (tiny mode): behaviour only, no timing assertions."""

import contextlib
import os
import re
import signal
import subprocess
import sys

import pytest

from conftest import REPO, clean_env


@contextlib.contextmanager
def time_limit(seconds):
    """For a bench's main() run in this process: past `seconds` (a hang) the test fails, as a timeout
    on its subprocess made it fail; subprocess.run kills the run the bench was waiting on."""

    def hung(*_):
        raise TimeoutError(f"the bench still ran after {seconds} s (a hang?)")

    previous = signal.signal(signal.SIGALRM, hung)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def test_compare_reference_tiny_mode_prints_the_table(fashion_dir, capsys):
    # main() in this process, which only starts the runs (launched as users launch them) and times the
    # floors; three of the four paths: ours_fp32 is ours_bf16's launch with another --mixed_precision
    from bench import compare_reference

    with time_limit(600):
        compare_reference.main(["--tiny", "--paths", "reference,ours_bf16,raw_bf16"])
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| ")]
    paths = [r for r in rows if "recipe" in r or "train/mnist.py" in r or "raw DDP" in r]
    assert len(paths) == 3, rows  # reference, ours bf16, raw DDP
    assert sum("compute-only floor" in r for r in rows) == 2  # fp32 and bf16
    assert all("| 200 |" in r for r in paths)  # every path evaluated the tiny copy's 200 test samples
    for ratio in ("ours_bf16/reference epoch time", "ours_bf16 throughput / raw DDP throughput"):
        assert re.search(rf"RATIO {re.escape(ratio)} = \d+\.\d+", out), ratio
    assert "ours_fp32/reference" not in out
    assert re.search(r"per repeat: median \d+\.\d+, range \d+\.\d+-\d+\.\d+", out)


def test_compare_reference_refuses_an_unknown_path(capsys):
    from bench import compare_reference

    with pytest.raises(SystemExit) as exit:
        compare_reference.main(["--tiny", "--paths", "ours_bf16,raw"])
    assert exit.value.code == 2
    assert (
        "--paths takes names from reference,ours_fp32,ours_bf16,raw_bf16, got 'ours_bf16,raw'"
        in capsys.readouterr().err
    )


def test_time_to_accuracy_tiny_mode_reports_runs_and_target(fashion_dir, capsys):
    # main() in this process: it only runs `make train-only` and prints what it left
    from bench import time_to_accuracy

    with time_limit(600):
        time_to_accuracy.main(["--tiny", "--seeds", "3"])
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| 1 |")]
    assert len(rows) == 1 and rows[0].startswith("| 1 | 3 |") and rows[0].endswith("| 500 |"), rows
    assert (
        "run: `make train-only EPOCHS=1 'EXTRA=--max_train_samples 1280 --max_eval_samples 500 --seed 3'`" in out
    )  # the command the table ran
    assert re.search(r"TARGET >= 91\.00% within 60 s: met by [01] of 1 runs", out)


def test_time_to_accuracy_pairs_each_seed_with_its_baseline_in_alternating_order(monkeypatch, capsys):
    # the pairing alone, in this process: the real run is the test above (a launch per run)
    from bench import time_to_accuracy

    made = []

    def fake_run(out, make_vars, seed):
        made.append((os.path.basename(out), make_vars, seed))
        baseline = "MODEL=convnet_fast" in make_vars
        return {
            "command": "make train-only " + " ".join(make_vars),
            "precision": "no",
            "seed": seed,
            "wall": 30.0 if baseline else 33.0,
            "accuracy": 0.9 if baseline else 0.92,
            "per_epoch": [0.9],
            "eval_samples": 500,
            "epoch_seconds": [1.0],
        }

    monkeypatch.setattr(time_to_accuracy, "make_run", fake_run)
    time_to_accuracy.main(
        ["MIXED_PRECISION=no", "--tiny", "--seeds", "3", "4", "5", "--baseline", "MODEL=convnet_fast"]
    )
    tiny = ["EPOCHS=1", "EXTRA=--max_train_samples 1280 --max_eval_samples 500"]
    run, baseline = ["MIXED_PRECISION=no", *tiny], ["MIXED_PRECISION=no", "MODEL=convnet_fast", *tiny]
    # A/B, then B/A: the host's drift hits both variants alike; the baseline adds its variables to the run's
    assert made == [
        ("run0", run, 3),
        ("baseline0", baseline, 3),
        ("baseline1", baseline, 4),
        ("run1", run, 4),
        ("run2", run, 5),
        ("baseline2", baseline, 5),
    ]
    out = capsys.readouterr().out
    assert (
        "\nbaseline: `make train-only MIXED_PRECISION=no MODEL=convnet_fast EPOCHS=1 EXTRA=--max_train_samples "
        "1280 --max_eval_samples 500` and other seeds, 3 run(s) (tiny)" in out
    )  # the command its table ran
    assert "RATIO wall / baseline wall = 1.100 (per pair: 1.100, 1.100, 1.100); accuracy 0.9200 against 0.9000" in out
    assert re.findall(r"TARGET >= 91\.00% within 60 s: met by (\d) of 3 runs", out) == ["3", "0"]


def test_loop_overhead_tiny_mode_runs_its_loops_in_two_processes(fashion_dir):
    proc = subprocess.run(
        [sys.executable, "bench/loop_overhead.py", "--tiny"],
        cwd=REPO,
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    # 1 warm-up + 19 turns = 20 steps each (10 an epoch), and every 20th is logged, as train/mnist.py does
    assert "world size 2" in proc.stdout
    assert "logged steps: ours 20..20 (1 records), raw_logged 20..20 (1 records)" in proc.stdout
    rows = [line.split(" | ")[0] for line in proc.stdout.splitlines() if line.startswith("| ")]
    assert rows[1:] == ["| raw", "| raw_logged", "| ours"], rows
    for name, base in (
        ("raw_logged", "raw DDP"),
        ("ours", "raw DDP"),
        ("ours", r"raw_logged \(accelerate's cost alone\)"),
    ):
        assert re.search(
            rf"RATIO {name} throughput / {base} throughput = \d+\.\d+ \(median of turns \d+\.\d+\)", proc.stdout
        ), (name, base)


def test_step_phases_tiny_mode_times_every_phase_on_both_ranks(fashion_dir):
    proc = subprocess.run(
        [sys.executable, "bench/step_phases.py", "--tiny"],
        cwd=REPO,
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    # `auto`: bf16 on a CPU with native bf16, fp32 here (tests/conftest.py limits oneDNN to AVX2)
    assert "20 steps of each loop, alternating, world size 2, mixed_precision=no," in proc.stdout
    table = {
        cells[0]: cells[1:]
        for cells in (
            line.strip("| ").split(" | ")
            for line in proc.stdout.splitlines()
            if line.startswith("| ") and not line.startswith("| phase")
        )
    }
    # the real TrainingLoop's bookkeeping is one public call, after_batch, timed whole (no hook to split it)
    assert list(table) == ["data", "forward", "backward", "step", "zero_grad", "after_batch", "total"]
    us = {phase: list(map(float, cells[:4])) for phase, cells in table.items()}  # raw, ours rank 0; raw, ours rank 1
    for phase in ("data", "forward", "backward", "step", "zero_grad", "total"):
        assert min(us[phase]) > 0, (phase, us[phase])
    assert us["after_batch"][0] == us["after_batch"][2] == 0 < min(us["after_batch"][1], us["after_batch"][3])
    # 20 steps: the loop logged at step 20 (its --logging_steps) on both ranks, and only then
    assert re.search(
        r"after_batch of ours, µs per call: rank 0: logging steps 1 x \d+\.\d, other steps 19 x \d+\.\d; "
        r"rank 1: logging steps 1 x \d+\.\d, other steps 19 x \d+\.\d$",
        proc.stdout,
        re.M,
    ), proc.stdout


def test_ddp_comm_tiny_mode_times_the_step_with_and_without_its_all_reduce(fashion_dir):
    proc = subprocess.run(
        [sys.executable, "bench/ddp_comm.py", "--tiny"],
        cwd=REPO,
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    # tiny: turns of 2 steps (the full bench's are 20)
    assert "2 processes (gloo), 64 samples per process, mixed_precision=no, 2 turns of 2 steps each" in proc.stdout
    rows = {
        line.split(" | ")[0].strip("| "): float(line.split(" | ")[1])
        for line in proc.stdout.splitlines()
        if line.startswith("| with") or line.startswith("| without")
    }
    assert list(rows) == ["with all-reduce", "without"] and min(rows.values()) > 0, proc.stdout
    # the hook really kept the gradients local: only the model with the all-reduce stayed in step
    assert "the processes' weights after training: with all-reduce the same, without different" in proc.stdout
    assert re.search(r"all_reduce alone, 1 number: \d+\.\d\d ms", proc.stdout)
    assert re.search(
        r"RATIO steps/s without the all-reduce / with it = \d+\.\d+ \(median of turns \d+\.\d+\)", proc.stdout
    )


def test_lm_throughput_tiny_mode_runs_both_loops_in_two_processes(tmp_path):
    from data.prepare import main as prepare_main

    words = "the of and a to in is was he for it with as his on be at by had not are but from or".split()
    (tmp_path / "text.txt").write_text(
        "\n".join(" ".join(words[(i * 7 + j) % len(words)] for j in range(12)) for i in range(300)) + "\n"
    )
    prepare_main(
        [
            "--train_file",
            str(tmp_path / "text.txt"),
            "--validation_split_percentage",
            "10",
            "--tokenizer",
            "bytes",
            "--block_size",
            "32",
            "--output_dir",
            str(tmp_path / "shards"),
        ]
    )
    proc = subprocess.run(
        [sys.executable, "bench/lm_throughput.py", "--tiny", "--dataset_dir", str(tmp_path / "shards")],
        cwd=REPO,
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    # 1 warm-up + 6 turns each; 4 windows of 32 tokens per process, 2 processes
    assert (
        "world size 2 on cpu" in proc.stdout
        and "(256 tokens per step), 0 reading workers for lm.py; steps taken: raw 7, lm.py 7" in proc.stdout
    )
    rows = [line.split(" | ") for line in proc.stdout.splitlines() if line.startswith("| ")]
    assert [r[0] for r in rows[1:3]] == ["| raw", "| lm.py"], rows
    # where each step went: the phases between the clocks, then the wait for the turn's end, which no
    # phase can exceed (the turn's clock encloses them)
    phases = {r[0][2:]: [float(v) for v in r[1:3]] for r in rows[4:]}
    assert list(phases) == ["data", "forward", "backward", "clip", "optimizer", "after", "wait"], rows
    assert all(v >= 0 for values in phases.values() for v in values[:2]) and phases["forward"][0] > 0, phases
    # each timed phase's median step beside the mean, and lm.py's slowest step, which no median exceeds
    steps = {r[0][2:]: [float(v.strip(" |")) for v in r[4:7]] for r in rows[4:-1]}
    assert all(
        raw_median >= 0 and 0 <= lm_median <= lm_slowest for raw_median, lm_median, lm_slowest in steps.values()
    ), rows
    assert re.search(r"RATIO lm\.py tokens/s / raw DDP tokens/s = \d+\.\d+ \(median of turns \d+\.\d+\)", proc.stdout)
    for name in ("raw", "lm.py"):
        assert (
            0 < float(re.search(rf"MFU {re.escape(name)} = (\d+\.\d+) of the measured matmul peak", proc.stdout)[1]) < 1
        )


def test_lm_throughput_without_shards_says_how_to_make_them(tmp_path):
    proc = subprocess.run(
        [sys.executable, "bench/lm_throughput.py", "--dataset_dir", str(tmp_path)],
        cwd=REPO,
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 1 and proc.stderr.strip().splitlines() == [
        f"error: {tmp_path} holds no token shards; run `make train-lm` once (it writes the demo's) or pass "
        "--dataset_dir with shards of python -m data.prepare --tokenizer ..."
    ]


def test_checkpoint_save_tiny_mode_measures_both_formats_under_ddp():
    # tiny runs one launch, DDP's: the full bench adds FSDP2's, whose row comes from the same worker and
    # table code (FSDP2's sharded and asynchronous saves themselves: tests/test_fsdp2.py)
    proc = subprocess.run(
        [sys.executable, "bench/checkpoint_save.py", "--tiny"],
        cwd=REPO,
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [line.split(" | ") for line in proc.stdout.splitlines() if line.startswith(("| MULTI_CPU", "| FSDP2"))]
    assert [r[0] for r in rows] == ["| MULTI_CPU"], proc.stdout
    for row in rows:
        full, sharded = ([float(x) for x in cell.strip(" |").split(" / ")] for cell in row[-2:])
        # full: the main process writes the model and optimizer; sharded: each writes about half
        assert full[0] > 1 and full[1] < 0.1 and min(sharded) > 0.3 * full[0], row
    assert re.search(r"^RATIO MULTI_CPU small sharded/full save seconds = \d+\.\d+$", proc.stdout, re.M), proc.stdout
    assert re.search(r"^RATIO MULTI_CPU small async blocking/sharded save seconds = \d+\.\d+$", proc.stdout, re.M)


def test_image_pipeline_times_both_data_paths_and_the_step(tmp_path, capsys):
    # one process, no launch: main() in this process
    import numpy as np
    from PIL import Image

    from bench import image_pipeline

    rng = np.random.default_rng(0)
    for n in range(64):
        os.makedirs(tmp_path / "ab"[n % 2], exist_ok=True)
        Image.fromarray(rng.integers(0, 255, (28, 28), dtype=np.uint8)).save(tmp_path / "ab"[n % 2] / f"{n}.png")
    image_pipeline.main(["--train_dir", str(tmp_path), "--images", "64", "--batch_size", "16"])
    out = capsys.readouterr().out
    rows = [line.split(" | ")[0] for line in out.splitlines() if line.startswith("| ")]
    assert rows[1:] == [
        "| before: decode + transforms every epoch",
        "| now: kept pixels, own generator",
        "| the model's step alone",
    ], rows
    assert re.search(r"RATIO images/s now / before = \d+\.\d+ \(data path alone: \d+\.\dx\)", out)


def test_lm_vs_nanogpt_runs_both_programs_at_nanogpts_cpu_shapes(tmp_path):
    # a stand-in for a nanoGPT checkout: it checks what the bench hands nanoGPT's train.py (the config
    # file, the shapes, the data files in its working folder, configurator.py beside them) and prints
    # iterations as nanoGPT does; train/lm.py runs for real
    fake = tmp_path / "nanogpt"
    (fake / "config").mkdir(parents=True)
    (fake / "config" / "train_shakespeare_char.py").write_text("gradient_accumulation_steps = 1\n")
    (fake / "configurator.py").write_text("")
    (fake / "train.py").write_text(
        "import os, pickle, sys\n"
        "args = sys.argv[1:]\n"
        "assert args[0].endswith('config/train_shakespeare_char.py') and os.path.isfile('configurator.py'), args\n"
        "for shape in ('--block_size=64', '--batch_size=12', '--n_layer=4', '--n_head=4', '--n_embd=128',\n"
        "              '--device=cpu', '--compile=False', '--dataset=bytes', '--dtype=float32'):\n"
        "    assert shape in args, shape\n"
        "assert pickle.load(open('data/bytes/meta.pkl', 'rb')) == {'vocab_size': 257}\n"
        "assert os.path.getsize('data/bytes/train.bin') > os.path.getsize('data/bytes/val.bin') > 0\n"
        "steps = int([a for a in args if a.startswith('--max_iters=')][0].split('=')[1])\n"
        "for i in range(steps + 1):\n"
        "    print(f'iter {i}: loss 2.0000, time {50 + i % 3}.00ms, mfu 1.00%')\n"
    )
    text = tmp_path / "text.txt"
    text.write_text("the quick brown fox jumps over the lazy dog.\n" * 400)
    proc = subprocess.run(
        [
            sys.executable,
            "bench/lm_vs_nanogpt.py",
            "--nanogpt_dir",
            str(fake),
            "--text_file",
            str(text),
            "--steps",
            "30",
            "--repeats",
            "1",
        ],
        cwd=REPO,
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    # the fewest steps the bench takes: one block of 10 after the first 20 iterations, whose times
    # (50 + i % 3 ms) give 51.1 (all 31 printed iterations would give 51.0)
    assert "| nanoGPT train.py | 51.1 |" in proc.stdout
    assert re.search(r"\| train/lm\.py \| \d+\.\d+ \| \d+\.\d+ \|", proc.stdout), proc.stdout
    assert re.search(r"RATIO train/lm\.py steps/s / nanoGPT steps/s = \d+\.\d+", proc.stdout)


def test_lm_vs_nanogpt_refuses_a_folder_that_is_not_a_nanogpt_checkout(tmp_path):
    (tmp_path / "train.py").write_text("")
    proc = subprocess.run(
        [sys.executable, "bench/lm_vs_nanogpt.py", "--nanogpt_dir", str(tmp_path)],
        cwd=REPO,
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2 and proc.stderr.strip().splitlines()[-1].endswith(
        f"--nanogpt_dir {tmp_path} holds no configurator.py, config/train_shakespeare_char.py; pass a checkout of "
        "nanoGPT"
    )


def test_text_reference_gives_the_reference_sentence_csvs_and_an_offline_accuracy(tmp_path):
    # the parts the bench adds around the two programs, in this process: a real comparison launches
    # six fine-tuning runs (minutes), so the suite does not run one
    import importlib.util

    from bench.text_reference import EVALUATE_STAND_IN, write_sentence_csv

    (tmp_path / "in.csv").write_text("text,label\nan owl,animal\na fir,plant\na cat,animal\n")
    assert write_sentence_csv(tmp_path / "in.csv", tmp_path / "out.csv", "text", "label", max_rows=2, seed=0) == 2
    lines = (tmp_path / "out.csv").read_text().splitlines()
    assert lines[0] == "sentence,label" and len(lines) == 3  # the reference reads its text from the first column
    assert set(lines[1:]) <= {"an owl,animal", "a fir,plant", "a cat,animal"}
    (tmp_path / "evaluate.py").write_text(EVALUATE_STAND_IN)
    spec = importlib.util.spec_from_file_location("evaluate_stand_in", tmp_path / "evaluate.py")
    evaluate = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(evaluate)
    metric = evaluate.load("accuracy")
    metric.add_batch(predictions=[1, 2, 3], references=[1, 0, 3])
    metric.add_batch(predictions=[0], references=[0])
    assert metric.compute() == {"accuracy": 0.75}

    proc = subprocess.run(
        [
            sys.executable,
            "bench/text_reference.py",
            "--reference",
            str(tmp_path / "none.py"),
            "--train_file",
            "t.csv",
            "--validation_file",
            "v.csv",
        ],
        cwd=REPO,
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2 and proc.stderr.strip().splitlines()[-1].endswith(
        f"--reference {tmp_path / 'none.py'} is not a file; pass transformers' "
        "examples/pytorch/text-classification/run_glue_no_trainer.py"
    )


def test_host_overhead_tiny_mode_prints_extra_ms_per_loop(fashion_dir, capsys, fresh_accelerate_state):
    # one process, no launch: main() in this process
    from bench import host_overhead

    host_overhead.main(["--tiny", "--data_dir", fashion_dir])
    out = capsys.readouterr().out
    for task in ("lm", "mnist"):  # every variant timed, the breakdown printed, then the one line per loop
        table = out.split(f"\n{task}: ms per step")[1]
        rows = re.findall(r"^\| (\w+) \| \d+\.\d+ \| [+-]\d+\.\d+ \| [+-]\d+\.\d+ \|$", table, re.M)
        assert rows[:6] == ["raw", "reader", "accelerate", "after_batch", "after_batch_nolog", "ours"], out
        assert re.search(
            rf"^breakdown {task}: reading [+-]\d+\.\d+, accelerate's wrappers [+-]\d+\.\d+, after_batch "
            r"[+-]\d+\.\d+ \(of which logging [+-]\d+\.\d+\) ms per step$",
            out,
            re.M,
        )
        calls = re.search(rf"^accelerate's calls {task}: (.*) µs per step", out, re.M).group(1)
        assert re.findall(r"(\w+) [+-]\d+", calls) == ["accumulate", "forward", "backward", "clip", "step", "zero_grad"]
    extra = re.findall(r"^EXTRA_MS (\w+) = (-?\d+\.\d+)$", out, re.M)  # the last lines, numbers
    assert [task for task, _ in extra] == ["lm", "mnist"] and out.rstrip().endswith(extra[-1][1]), out


def test_dpo_reference_runs_ours_and_trls_dpo_trainer_in_two_processes(tmp_path, capsys):
    """One turn of train/dpo.py and TRL's DPOTrainer (its reference precomputed) on a tiny GPT-2 and 48 pairs:
    both launched as the bench runs them, the table and the ratio printed."""
    import json
    import random

    from bench import dpo_reference
    from hf_models import WORDS, tiny_causal_lm

    rng = random.Random(0)
    for split, n in (("train", 48), ("validation", 9)):
        pairs = [
            {"prompt": f"define {w}\n", "chosen": f"{w} means {rng.choice(WORDS)}", "rejected": f"{v} is a {w}"}
            for w, v in (rng.sample(WORDS, 2) for _ in range(n))
        ]
        (tmp_path / f"{split}.jsonl").write_text("".join(json.dumps(p) + "\n" for p in pairs))
    dpo_reference.main(
        [
            "--model_name_or_path",
            tiny_causal_lm(tmp_path / "gpt2"),
            "--train_file",
            str(tmp_path / "train.jsonl"),
            "--validation_file",
            str(tmp_path / "validation.jsonl"),
            "--turns",
            "1",
            "--per_device_train_batch_size",
            "4",
            "--programs",
            "ours",
            "trl_precompute",
        ]
    )
    out = capsys.readouterr().out
    assert "| train/dpo.py |" in out and "| DPOTrainer, precompute_ref_log_probs |" in out, out
    assert "RATIO ours / trl_precompute = " in out and "reward accuracy" in out


def test_sft_reference_runs_ours_and_trls_sft_trainer_padded_and_packed(tmp_path, capsys):
    """One turn of train/sft.py and TRL's SFTTrainer, each padded and packed, on a tiny GPT-2 and 48 pairs:
    launched as the bench runs them, the table, the scored losses and the ratios printed."""
    import json
    import random

    from bench import sft_reference
    from hf_models import WORDS, tiny_causal_lm

    rng = random.Random(0)
    for split, n in (("train", 48), ("validation", 9)):
        pairs = [
            {"prompt": f"define {w}\n", "response": f"{w} means " + " ".join(rng.choices(WORDS, k=rng.randint(1, 12)))}
            for w in rng.choices(WORDS, k=n)
        ]
        (tmp_path / f"{split}.jsonl").write_text("".join(json.dumps(p) + "\n" for p in pairs))
    sft_reference.main(
        [
            "--preset",
            "small_gpt",
            "--model_name_or_path",
            tiny_causal_lm(tmp_path / "gpt2"),
            "--train_file",
            str(tmp_path / "train.jsonl"),
            "--validation_file",
            str(tmp_path / "validation.jsonl"),
            "--turns",
            "1",
            "--per_device_train_batch_size",
            "4",
            "--max_seq_length",
            "32",
            "--num_warmup_steps",
            "2",
        ]
    )
    out = capsys.readouterr().out
    rows = {line.split(" | ")[0][2:]: line for line in out.splitlines() if line.startswith("| ")}
    for program in ("train/sft.py", "train/sft.py --packing", "SFTTrainer", "SFTTrainer, packing bfd"):
        assert program in rows, out
    assert "it counted" not in out, out  # ours' count of response tokens is the bench's
    assert "RATIO padded ours / TRL = " in out and "RATIO packed ours / TRL = " in out, out
    # ours' own validation loss is the one the bench scores from its saved model
    for line in out.splitlines():
        if line.startswith("turn 1: train/sft.py"):
            scored, own = re.search(r"validation loss (\d+\.\d+) \(its own: (\d+\.\d+)\)", line).groups()
            assert abs(float(scored) - float(own)) < 1e-3, line


@pytest.mark.parametrize("order, ours, trl", [("grouped", "true", "group_by_length"), ("random", "false", "random")])
def test_sft_reference_order_sets_both_programs_padded_batches_alike(order, ours, trl):
    """--order grouped: each program's own length-grouped sampler; random: both shuffled (the loss
    comparison of docs/speed.md). Packed runs take neither flag. TRL's driver takes the value it is given."""
    from bench import sft_reference

    args = sft_reference.parse_args(["--score", "unused", "--order", order])
    data = {"train": "t.jsonl", "validation": "v.jsonl"}
    commands = {name: sft_reference.command(name, args, data, "run", "out") for name in sft_reference.PROGRAMS}
    flag = lambda cmd, name: cmd[cmd.index(name) + 1] if name in cmd else None  # noqa: E731
    assert flag(commands["ours"], "--group_by_length") == ours
    assert flag(commands["trl"], "--train_sampling_strategy") == trl
    assert "--group_by_length" not in commands["ours_packed"]
    assert "--train_sampling_strategy" not in commands["trl_packed"]
    driver = subprocess.run(
        [sys.executable, "bench/reference/trl_sft.py", "--help"], cwd=REPO, capture_output=True, text=True
    ).stdout
    assert "--train_sampling_strategy {group_by_length,random}" in driver, driver


def test_sft_reference_presets_fill_what_is_not_given_and_conversations_become_template_pairs(
    tmp_path, monkeypatch, capsys
):
    """--preset smollm2 where make smollm2's folder is, else small_gpt; each fills the model, data, rows,
    learning rate, warmup and pairs the command line leaves out, a flag given wins, and a missing model
    names the make target. A conversation becomes the prompt the model's chat template opens the
    assistant's turn with, and that turn's text: what the template writes for the whole conversation
    starts with the two."""
    import json

    from transformers import AutoTokenizer

    from bench import sft_reference
    from hf_models import tiny_causal_lm

    monkeypatch.setattr(sft_reference, "REPO", str(tmp_path))
    assert sft_reference.default_preset() == "small_gpt"
    with pytest.raises(SystemExit):
        sft_reference.parse_args([])
    assert "runs/lm holds no model: make sft-data (it trains runs/lm first)" in capsys.readouterr().err
    folder = tmp_path / "runs" / "models" / "SmolLM2-135M-Instruct"
    tiny_causal_lm(folder, "llama", chat=True)
    assert sft_reference.default_preset() == "smollm2"
    sums = tmp_path / "runs" / "sft" / "sums"
    sums.mkdir(parents=True)
    rows = [
        {"messages": [{"role": "user", "content": f"What is {a} + 1?"}, {"role": "assistant", "content": str(a + 1)}]}
        for a in range(5)
    ]
    for split in ("train", "validation"):
        (sums / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    args = sft_reference.parse_args(["--learning_rate", "3e-4"])
    chosen = (args.preset, args.model_name_or_path, args.per_device_train_batch_size, args.learning_rate)
    assert chosen == ("smollm2", "runs/models/SmolLM2-135M-Instruct", 8, 3e-4)
    assert (args.num_warmup_steps, args.max_train_samples, args.train_file) == (0, 1024, "runs/sft/sums/train.jsonl")
    small = sft_reference.parse_args(
        ["--preset", "small_gpt", "--model_name_or_path", str(folder)]
        + [f"--{split}_file={sums / f'{split}.jsonl'}" for split in ("train", "validation")]
    )
    assert (small.per_device_train_batch_size, small.learning_rate, small.num_warmup_steps) == (16, 2e-3, 30)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    pairs = sft_reference.copy_pairs(sums / "train.jsonl", tmp_path / "pairs.jsonl", tokenizer=tokenizer)
    for row, (prompt, completion) in zip(rows, pairs, strict=True):
        assert completion == row["messages"][1]["content"]
        assert prompt == tokenizer.apply_chat_template(row["messages"][:1], add_generation_prompt=True, tokenize=False)
        assert tokenizer.apply_chat_template(row["messages"], tokenize=False).startswith(prompt + completion)
    written = [json.loads(line) for line in open(tmp_path / "pairs.jsonl")]
    assert written == [{"prompt": p, "completion": c} for p, c in pairs]


def test_shape_memory_runs_each_case_at_two_step_counts(tmp_path, capsys):
    """bench/shape_memory.py on a tiny GPT-2 and BERT: each case run at 2 and 4 steps in a process of its
    own, a peak and a speed per run, and the ratio line per case."""
    import json

    from bench import shape_memory
    from hf_models import WORDS, tiny_bert, tiny_causal_lm

    pairs = tmp_path / "pairs"
    pairs.mkdir()
    for split in ("train", "validation"):
        rows = [{"prompt": f"Define: {w}\n", "response": " ".join(WORDS[i : i + 5])} for i, w in enumerate(WORDS)]
        (pairs / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    shape_memory.main(
        [
            "--steps",
            "2",
            "4",
            "--mixed_precision",
            "no",
            "--model_name_or_path",
            tiny_causal_lm(tmp_path / "gpt2"),
            "--pairs_dir",
            str(pairs),
            "--text_model",
            tiny_bert(tmp_path / "bert"),
        ]
    )
    out = capsys.readouterr().out
    for case in ("sft_demo", "sft_varied", "text_varied"):
        assert f"RESULT {case}: peak at 4 / at 2 steps = " in out, out
        assert f"| {case} | 2 | " in out and f"| {case} | 4 | " in out, out


def test_recipe_phases_times_each_tree_by_phase_and_counts_collections(fashion_dir, capsys):
    """bench/recipe_phases.py on a 30-step recipe: this checkout and a worktree of its commit, one
    round, the phases adding up to the run, and with --gc the main process's collections recorded."""
    from bench import recipe_phases

    with time_limit(600):
        rows = recipe_phases.main(
            ["--trees", "HEAD", "HEAD~0", "--rounds", "1", "--gc", "--extra", "--max_train_steps 30"]
        )
    out = capsys.readouterr().out
    for tree in ("HEAD", "HEAD~0"):
        assert re.search(rf"^\| {re.escape(tree)} \| 1( \| \d+\.\d\d s){{8}} \|$", out, re.M), out
        (run,) = rows[tree]
        assert sum(run[phase] for phase in recipe_phases.PHASES) == pytest.approx(run["launch to exit"])
        assert 0 < run["gc"] <= run["gc in run"] and 0 < run["exit"] < run["end"]
    worktrees = subprocess.run(["git", "worktree", "list"], cwd=REPO, capture_output=True, text=True).stdout
    assert "recipe_phases_" not in worktrees


def test_grpo_reference_runs_ours_and_trls_grpo_trainer_in_two_processes(tmp_path, capsys):
    """One round of train/grpo.py and TRL's GRPOTrainer on a tiny chat Llama: 2 steps of 2 sums x 4 answers
    of 8 tokens, both launched as the bench runs them; the report holds both, the same completions counted
    on each side, a reward per step and a positive ratio."""
    import json

    from bench import grpo_reference
    from hf_models import tiny_causal_lm

    report = grpo_reference.main(
        [
            "--model_name_or_path",
            tiny_causal_lm(tmp_path / "llama", "llama", chat=True),
            "--max_train_steps",
            "2",
            "--prompts_per_step",
            "2",
            "--num_generations",
            "4",
            "--max_completion_length",
            "8",
            "--output",
            str(tmp_path / "report.json"),
        ]
    )
    assert json.loads((tmp_path / "report.json").read_text()) == json.loads(json.dumps(report))
    assert list(report["runs"]) == ["ours", "trl"], report
    for name, runs in report["runs"].items():
        (run,) = runs  # one round
        assert run["steps"] == 2 and run["completions"] == 2 * 2 * 4, (name, run)  # steps x sums x answers
        assert len(run["rewards"]) == 2 and all(0 <= r <= 1.5 for r in run["rewards"]), (name, run)
        assert 0 < run["training_seconds"] < run["wall_seconds"] and run["peak_rss_mb"] > 0, (name, run)
    assert report["ratio_ours_over_trl"]["completions_per_second"] > 0
    out = capsys.readouterr().out
    assert "| train/grpo.py |" in out and "| GRPOTrainer (transformers generation) |" in out, out
    assert re.search(r"RATIO ours / TRL completions per second = \d+\.\d+", out), out
