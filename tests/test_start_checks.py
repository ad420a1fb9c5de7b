"""What would fail at a run's end fails at its start, and what fails at the end anyway loses nothing.

Before the first step, one line each: a model whose config carries a quantization method (GGUF,
bitsandbytes, GPTQ: transformers refuses to save it), a tokenizer that cannot be saved, a chat
template that refuses a row, a read-only output folder, a disk too small for the final model and the
checkpoints kept (simulated: shutil.disk_usage). A final write that fails after training anyway
leaves a checkpoint of the last step, and the resume the line gives writes the same model as an
uninterrupted run, bit for bit. When one rank of two raises, the other's line names it and its
error; a rank SIGKILLed is still "lost contact"."""

import errno
import json
import os
import re
import shutil
import sys
import time
import types

import pytest

from conftest import CONFIGS, clean_env, output_of, run_as_script, run_or_dump
from hf_models import tiny_bert, tiny_causal_lm
from test_checkpointing import identical, weights

STEPS = ["--max_train_steps", 4, "--eval_steps", 2, "--logging_steps", 2, "--mixed_precision", "no"]


def jsonl(path, rows):
    with open(path, "w") as f:
        f.writelines(json.dumps(row) + "\n" for row in rows)
    return str(path)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("start_checks")
    pairs = [{"prompt": f"define {w}\n", "response": f"{w} means the small light"} for w in ("tree", "river") * 16]
    chat = [
        {"messages": [{"role": "user", "content": "the river"}, {"role": "assistant", "content": "water light"}]}
    ] * 16
    return {
        "gpt2": tiny_causal_lm(root / "gpt2"),
        "llama": tiny_causal_lm(root / "llama", "llama", chat=True),
        "train": jsonl(root / "train.jsonl", pairs),
        "chat": jsonl(root / "chat.jsonl", chat),
        "cache": str(root / "tokens"),
        "root": root,
    }


def sft_args(data, out, *extra, model=None, train=None):
    return [
        "--model_name_or_path",
        model or data["gpt2"],
        "--train_file",
        train or data["train"],
        "--cache_dir",
        data["cache"],
        "--per_device_train_batch_size",
        4,
        "--learning_rate",
        3e-3,
        *STEPS,
        "--output_dir",
        out,
        *extra,
    ]


def one_line(proc):
    """The run's only error line, after checking it stopped with exit 1 and no traceback."""
    output = output_of(proc)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode == 1 and len(errors) == 1, output[-3000:]
    assert "Traceback" not in output, output[-3000:]
    return errors[0]


def launch_probe(tmp_path, probe, *fault):
    """tests/PROBE regression FAULT -- --max_train_steps 40 ... under 2 processes (FAULT may end with
    '--' and more of the script's arguments)."""
    fault, extra = (fault[: fault.index("--")], fault[fault.index("--") + 1 :]) if "--" in fault else (fault, ())
    cmd = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        os.path.join(CONFIGS, "cpu_2proc.yaml"),
        os.path.join("tests", probe),
        "regression",
        *map(str, fault),
        "--",
        "--max_train_steps",
        "40",
        "--output_dir",
        str(tmp_path / "run"),
        *map(str, extra),
    ]
    return run_or_dump(cmd, 300, env=clean_env())


def quantized_copy(source, folder, quantization):
    shutil.copytree(source, folder)
    with open(os.path.join(folder, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = quantization
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f)
    return str(folder)


# ---------------------------------------------------------------------------------------------- at the start


@pytest.mark.parametrize(
    "quantization",
    [
        {"quant_method": "gguf"},
        {"quant_method": "bitsandbytes", "load_in_4bit": True, "bnb_4bit_quant_type": "nf4"},
        {"quant_method": "gptq", "bits": 4, "group_size": 128},
    ],
    ids=lambda q: q["quant_method"],
)
def test_a_quantized_model_is_refused_before_the_first_step(data, tmp_path, capsys, quantization):
    """sft.py on a folder whose config.json keeps a quantization_config (what save_pretrained of a model
    read from a GGUF file writes): refused at the start, not after training, with what to do."""
    model = quantized_copy(data["gpt2"], tmp_path / "model", quantization)
    out = tmp_path / "out"
    line = one_line(run_as_script(capsys, "sft", *sft_args(data, out, model=model)))
    method = quantization["quant_method"]
    assert line.startswith(f"error: --model_name_or_path {model} is quantized ({method}: "), line
    assert "transformers refuses to save a model loaded with it" in line and "pass a dequantized copy" in line
    assert ("train.models.gguf_import" in line) == (method == "gguf"), line
    assert not out.exists()  # nothing trained, nothing written


def test_a_quantized_classifier_is_refused_too(tmp_path, capsys):
    model = quantized_copy(tiny_bert(tmp_path / "bert"), tmp_path / "model", {"quant_method": "gguf"})
    rows = jsonl(tmp_path / "rows.jsonl", [{"text": "the river", "label": i % 2} for i in range(16)])
    out = tmp_path / "out"
    proc = run_as_script(
        capsys, "text_classification", "--model_name_or_path", model, "--train_file", rows, "--output_dir", out
    )
    assert one_line(proc).startswith(f"error: --model_name_or_path {model} is quantized (gguf: "), output_of(proc)
    assert not out.exists()


def test_a_tokenizer_that_cannot_be_saved_is_refused(data):
    from transformers import AutoConfig

    from data.errors import UserError
    from train.models.saving import check_savable

    config = AutoConfig.from_pretrained(data["gpt2"])

    def save_pretrained(folder):
        raise TypeError("Object of type set is not JSON serializable")

    with pytest.raises(UserError) as refused:
        check_savable(data["gpt2"], config, types.SimpleNamespace(save_pretrained=save_pretrained))
    assert str(refused.value) == (
        f"--model_name_or_path {data['gpt2']}: its tokenizer cannot be saved (TypeError: Object of type set is not "
        "JSON serializable), so this run could not write its output folder; fix its tokenizer files, or pass a "
        "model whose tokenizer saves"
    )


def test_a_chat_template_that_refuses_a_row_is_one_line(data, tmp_path, capsys):
    model = tmp_path / "model"
    shutil.copytree(data["llama"], model)
    template = (model / "chat_template.jinja").read_text()
    refusal = "{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}"
    (model / "chat_template.jinja").write_text(refusal + template)
    system = [
        {
            "messages": [
                {"role": "system", "content": "be brief"},
                {"role": "user", "content": "the river"},
                {"role": "assistant", "content": "water"},
            ]
        }
    ] * 4
    validation = jsonl(tmp_path / "validation.jsonl", system)
    args = sft_args(
        data,
        tmp_path / "out",
        "--messages_column",
        "messages",
        "--validation_file",
        validation,
        model=model,
        train=data["chat"],
    )
    line = one_line(run_as_script(capsys, "sft", *args))
    assert line == (
        "error: the model's chat template refuses the validation (--validation_file) conversation 'be brief' "
        "(System role not supported); drop or fix such rows, or pass a model whose template takes them"
    ), line


def test_a_read_only_output_folder_is_one_line_before_the_model_loads(data, tmp_path, capsys, monkeypatch):
    """Simulated (tests/test_exits.py mounts a real read-only tmpfs where it may): the first write into
    the folder meets EROFS."""
    import tempfile

    def read_only(*args, **kwargs):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), kwargs.get("dir"))

    monkeypatch.setattr(tempfile, "TemporaryFile", read_only)
    out = tmp_path / "out"
    proc = run_as_script(capsys, "sft", *sft_args(data, out))
    assert one_line(proc) == f"error: read-only file system: cannot write {out}; pass another --output_dir"
    assert "world_size=" not in proc.stdout


def test_a_disk_too_small_for_the_model_and_its_checkpoints_is_one_line_before_the_first_step(
    data, tmp_path, capsys, monkeypatch
):
    """The tiny GPT-2 is 164 kB of float32 weights: the final model, the best model's file and 2
    checkpoints kept (weights and AdamW's two moments) make about 1.3 MB; the disk has 1 MB."""
    real = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage", lambda path: real(path)._replace(free=1_000_000))
    out = tmp_path / "out"
    proc = run_as_script(
        capsys, "sft", *sft_args(data, out, "--checkpointing_steps", 1, "--checkpoints_total_limit", 2)
    )
    line = one_line(proc)
    assert re.fullmatch(
        rf"error: --output_dir {out}: its disk has 1\.0 MB free, and this run writes about 1\.3 MB there \(the "
        r"final model, 163\.\d kB, the best model's weights, 163\.\d kB, 2 checkpoint\(s\) of 491\.\d kB\); free "
        r"space or pass another --output_dir \(or keep fewer checkpoints: --checkpoints_total_limit\)",
        line,
    ), line
    assert "epochs=" not in proc.stdout  # before the loop's first line, so before any step
    monkeypatch.setattr(shutil, "disk_usage", lambda path: real(path)._replace(free=3_000_000))
    assert run_as_script(capsys, "sft", *sft_args(data, out)).returncode == 0  # room enough: it trains


def test_the_start_checks_of_smollm2_cost_under_a_second():
    """The largest demo model (make smollm2): its config and tokenizer checked (the tokenizer saved to a
    scratch folder) well under a second."""
    folder = os.path.join(os.path.dirname(CONFIGS), "runs", "models", "SmolLM2-135M-Instruct")
    if not os.path.isfile(os.path.join(folder, "config.json")):
        pytest.skip("no runs/models/SmolLM2-135M-Instruct (make smollm2 writes it)")
    from transformers import AutoConfig, AutoTokenizer

    from train.models.saving import check_savable

    config, tokenizer = AutoConfig.from_pretrained(folder), AutoTokenizer.from_pretrained(folder)
    start = time.perf_counter()
    check_savable(folder, config, tokenizer)
    assert time.perf_counter() - start < 1.0


# ---------------------------------------------------------------------------------------------- at the end


def test_a_model_that_fails_to_save_after_training_is_kept_and_the_resume_writes_it(
    data, tmp_path, capsys, monkeypatch
):
    """The issue's run: no --checkpointing_steps, and the Hugging Face folder refuses to be written once
    training is over. The run saves a checkpoint of its last step, removes the half-written folder's
    files and says how to finish; that command writes the folder an uninterrupted run writes."""
    import train.models.causal_lm

    real = train.models.causal_lm.save_model_folder

    def refuses(weights, out, *args):
        with open(os.path.join(out, "config.json"), "w") as f:  # half a folder, as a failed save_pretrained leaves
            f.write("{}")
        raise ValueError("The model is quantized with gguf and is not serializable - check out the warnings")

    monkeypatch.setattr(train.models.causal_lm, "save_model_folder", refuses)
    out = tmp_path / "out"
    line = one_line(run_as_script(capsys, "sft", *sft_args(data, out)))
    checkpoint = out / "checkpoints" / "step_00000004"
    assert line.startswith(
        f"error: trained to step 4, but writing the model into {out} failed (ValueError: The model is quantized "
        f"with gguf and is not serializable - check out the warnings); the run's weights are in {checkpoint}; fix "
        "the cause, then finish with this command, which trains nothing and writes the model: python "
    ), line
    assert "train/sft.py --model_name_or_path " in line, line
    assert line.endswith(" --resume_from_checkpoint latest"), line
    assert not (out / "config.json").exists() and not (out / "all_results.json").exists()

    monkeypatch.setattr(train.models.causal_lm, "save_model_folder", real)
    resumed = run_as_script(capsys, "sft", *sft_args(data, out, "--resume_from_checkpoint", "latest"))
    assert resumed.returncode == 0, output_of(resumed)
    assert f"resumed from {checkpoint} (step 4" in resumed.stdout
    straight = tmp_path / "straight"
    assert run_as_script(capsys, "sft", *sft_args(data, straight)).returncode == 0
    assert identical(weights(out), weights(straight))


def test_a_full_disk_at_the_end_keeps_the_weights_and_the_resume_writes_them(tmp_path, capsys, monkeypatch):
    """train/regression.py (the loop writes model.safetensors itself): ENOSPC on the final weights."""
    import train.core.loop

    real = train.core.loop.save_weights

    def full(tensors, path):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)

    monkeypatch.setattr(train.core.loop, "save_weights", full)
    out, args = tmp_path / "out", ["--max_train_steps", 12, "--metric_for_best_model", "none"]
    line = one_line(run_as_script(capsys, "regression", *args, "--output_dir", out))
    assert line.startswith(
        f"error: trained to step 12, but writing the model into {out} failed (No space left on device: "
        f"{out}/model.safetensors); the run's weights are in {out}/checkpoints/step_00000012; "
    ), line
    monkeypatch.setattr(train.core.loop, "save_weights", real)
    proc = run_as_script(capsys, "regression", *args, "--output_dir", out, "--resume_from_checkpoint", "latest")
    assert proc.returncode == 0, output_of(proc)
    assert run_as_script(capsys, "regression", *args, "--output_dir", tmp_path / "straight").returncode == 0
    assert identical(weights(out), weights(tmp_path / "straight"))


def test_under_two_processes_a_full_disk_at_the_end_stops_both_with_the_checkpoint_of_the_last_step(tmp_path):
    """The issue's layout: rank 0 fails to write the model while rank 1 waits for it. Both save the
    last step's checkpoint and stop with the same line, printed once; no traceback, no 'lost contact'."""
    proc = launch_probe(tmp_path, "fault_probe.py", "--full_at_the_end", "--", "--metric_for_best_model", "none")
    output, out = output_of(proc), tmp_path / "run"
    assert proc.returncode == 1, output[-3000:]
    lines = [line for line in output.splitlines() if line.startswith(("error:", "[local rank"))]
    assert len(lines) == 1 and lines[0].startswith(
        f"error: trained to step 40, but writing the model into {out} failed (No space left on device: "
        f"{out}/model.safetensors); the run's weights are in {out}/checkpoints/step_00000040; "
    ), output[-3000:]
    assert "[rank0]: Traceback" not in output and "[rank1]: Traceback" not in output, output[-3000:]
    assert "lost contact" not in output
    assert (out / "checkpoints" / "step_00000040" / "meta.json").is_file() and not (out / "all_results.json").exists()


# ---------------------------------------------------------------------------------------------- naming the rank


def test_the_line_names_a_rank_that_failed_and_not_one_that_vanished(tmp_path, monkeypatch, capsys):
    """In one process: run()'s line for gloo's 'closed by peer', with and without a failure in the store."""
    from torch.distributed import HashStore

    from train.core import failures
    from train.core.run import run

    closed = "[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:29500"

    def main(args):
        raise RuntimeError(closed)

    monkeypatch.setattr(failures, "_board", [])
    failures.use_store(HashStore())
    failures.record_failure(1, "ValueError: planted")
    failures.record_failure(0, "a later failure, not the cause")
    args = types.SimpleNamespace(output_dir=str(tmp_path))
    with pytest.raises(SystemExit):
        run(main, args)
    assert capsys.readouterr().err.startswith("error: rank 1 failed: ValueError: planted; stopped without saving; ")
    monkeypatch.setattr(failures, "_board", [])
    failures.use_store(HashStore())
    with pytest.raises(SystemExit):
        run(main, args)
    assert capsys.readouterr().err.startswith("error: lost contact with ")


@pytest.mark.parametrize(
    "env, ignored",
    [
        ({"LOCAL_RANK": "0", "TORCHELASTIC_RUN_ID": "x"}, True),
        ({"LOCAL_RANK": "1", "TORCHELASTIC_RUN_ID": "x"}, False),
        ({"LOCAL_RANK": "0"}, False),
        ({}, False),
    ],
    ids=["first_under_agent", "other_rank", "no_agent", "no_launcher"],
)
def test_a_loop_ending_in_an_error_leaves_sigterm_ignored_in_the_first_process_under_the_agent_only(
    monkeypatch, env, ignored
):
    """The test below's race, without the race: the agent's SIGTERM can reach rank 0 between the loop's end
    and its line, so the first process under torch elastic ignores it from the loop's error on; any other
    process gets back the handler it had before the loop."""
    import signal

    from train.core.preemption import Preemption

    for name in ("LOCAL_RANK", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    before = signal.getsignal(signal.SIGTERM)
    try:
        preemption = Preemption(accelerator=None)
        assert signal.getsignal(signal.SIGTERM) == preemption._on_signal
        preemption.failed()
        assert signal.getsignal(signal.SIGTERM) == (signal.SIG_IGN if ignored else before)
    finally:
        signal.signal(signal.SIGTERM, before)


@pytest.mark.parametrize("kind", ["exception", "user_error", "sigkill"])
def test_rank_0_names_rank_1_that_raised_and_says_lost_contact_for_one_killed(tmp_path, kind):
    """2 processes, rank 1 fails at its 3rd step: a ValueError (its own traceback stays), one of the
    project's one-line errors (its own output is that line), or SIGKILL (nothing said: lost contact)."""
    if kind == "sigkill":
        proc = launch_probe(tmp_path, "kill_at_step.py", "--rank", 1, "--step", 3, "--marker", tmp_path / "killed")
    else:
        proc = launch_probe(
            tmp_path, "fault_probe.py", "--raise_at", 3, "--rank", 1, *(["--user_error"] * (kind == "user_error"))
        )
    output = output_of(proc)
    assert proc.returncode == 1, output[-3000:]
    ours = [line for line in output.splitlines() if line.startswith(("error:", "[local rank"))]
    rank_0 = [line for line in ours if line.startswith("error:")]
    assert len(rank_0) == 1, output[-3000:]
    if kind == "sigkill":
        assert rank_0[0].startswith("error: lost contact with "), output[-3000:]
        assert "failed:" not in rank_0[0]
        return
    said = (
        "planted user error at loss 3; nothing to fix"
        if kind == "user_error"
        else "ValueError: planted failure at loss 3"
    )
    assert rank_0[0].startswith(f"error: rank 1 failed: {said}; stopped without saving; "), output[-3000:]
    assert "lost contact" not in output
    if kind == "user_error":  # rank 1's own output: its one line, no traceback
        assert "[rank1]: Traceback" not in output and f"[local rank 1] error: {said}" in ours, output[-3000:]
    else:
        assert "[rank1]: ValueError: planted failure at loss 3" in output, output[-3000:]
