"""train/models/gpt.py: causality, weight tying, activation checkpointing that changes nothing but memory,
the AdamW groups, the FLOPs count behind mfu, and sampling; train/models/gpt_hf.py: the model and its
tokenizer as a Hugging Face GPT-2 folder that transformers loads with the same logits and ids."""

import os

import pytest
import torch
import torch.nn.functional as F

from conftest import reset_accelerate_state
from train.models.gpt import CPU_LOSS_CHUNK, GPT, GPTConfig, next_token_loss


def tiny(**kwargs):
    torch.manual_seed(0)
    return GPT(GPTConfig(**{"vocab_size": 50, "block_size": 16, "n_layer": 2, "n_head": 2, "n_embd": 16, **kwargs}))


def test_a_position_sees_only_itself_and_earlier_tokens():
    model = tiny().eval()
    ids = torch.randint(0, 50, (2, 16))
    changed = ids.clone()
    changed[:, 9] = (ids[:, 9] + 1) % 50
    a, b = model(ids), model(changed)
    assert torch.equal(a[:, :9], b[:, :9]) and not torch.allclose(a[:, 9:], b[:, 9:])


def test_the_output_layer_is_the_token_embedding():
    model = tiny()
    assert model.lm_head.weight is model.wte.weight
    assert len(list(model.parameters())) == len(model.state_dict()) - 1  # one tensor, two names in the state dict
    model(torch.tensor([[3]])).sum().backward()
    assert model.wte.weight.grad.abs().sum(1).count_nonzero() == 50  # every row, through the output layer


@pytest.mark.parametrize("dropout", [0.0, 0.2])
def test_gradient_checkpointing_gives_the_same_loss_and_gradients(dropout):
    ids = torch.randint(0, 50, (3, 16))
    grads = []
    for checkpointing in (False, True):
        model = tiny(dropout=dropout).train()
        model.gradient_checkpointing = checkpointing
        torch.manual_seed(1)  # the same dropout masks: recomputation replays the saved RNG state
        loss = F.cross_entropy(model(ids[:, :-1]).flatten(0, 1), ids[:, 1:].flatten())
        loss.backward()
        grads.append((loss.detach(), [p.grad for p in model.parameters()]))
    (loss_a, grads_a), (loss_b, grads_b) = grads
    assert torch.equal(loss_a, loss_b)
    assert all(torch.allclose(a, b, rtol=1e-5, atol=1e-7) for a, b in zip(grads_a, grads_b, strict=True))


def test_weight_decay_falls_on_the_linear_matrices_only():
    model = tiny()
    decay, rest = model.param_groups(0.1)
    names = {id(p): n for n, p in model.named_parameters()}
    assert decay["weight_decay"] == 0.1 and rest["weight_decay"] == 0.0
    assert sorted(names[id(p)] for p in decay["params"] + rest["params"]) == sorted(names.values())
    decayed = {names[id(p)] for p in decay["params"]}
    assert decayed == {f"blocks.{i}.{m}.weight" for i in range(2) for m in ("qkv", "proj", "fc", "fc_out")}


@pytest.mark.parametrize("vocab", [257, 8192, 50257])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_loss_in_pieces_is_cross_entropy_with_its_gradients(vocab, dtype):
    torch.manual_seed(0)
    logits = torch.randn(3, 200, vocab, dtype=dtype, requires_grad=True)  # bf16: the logits under autocast
    labels = torch.randint(0, vocab, (3, 200))
    labels[0, :50] = -100  # padding is not scored, and the mean is over the scored tokens
    pieces = -(-600 // max(1, CPU_LOSS_CHUNK // vocab))
    assert (pieces > 1) == (vocab > 257)
    for reduction in ("mean", "sum", "none"):
        ours = next_token_loss(logits, labels, reduction)
        whole = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=-100, reduction=reduction)
        assert ours.dtype == torch.float32 and ours.shape == whole.shape
        assert torch.allclose(ours, whole, rtol=1e-6, atol=1e-6)
        # a weight per row, so the backward's scaling of each row is checked, not only the sum's
        weights = torch.rand(whole.shape) if reduction == "none" else torch.tensor(2.5)
        (grad,) = torch.autograd.grad((ours * weights).sum(), logits)
        (expected,) = torch.autograd.grad((whole * weights).sum(), logits)
        assert grad.dtype == dtype and not grad[0, :50].any()  # no gradient into unscored positions
        tolerance = {"rtol": 1e-5, "atol": 1e-9} if dtype == torch.float32 else {"rtol": 1e-2, "atol": 1e-5}
        assert torch.allclose(grad.float(), expected.float(), **tolerance)


def test_the_loss_in_pieces_keeps_cross_entropys_edge_cases(monkeypatch):
    import train.models.gpt as gpt

    monkeypatch.setattr(gpt, "CPU_LOSS_CHUNK", 2 * 64)  # pieces of 2 rows at a vocabulary of 64
    logits = torch.randn(1, 7, 64, dtype=torch.float64) * 30
    logits[0, 1, 5] -= 1e6  # a label far below its row: its loss is large, its gradient still exact
    logits[0, 2, 0] = float("-inf")  # an unscored row's placeholder target and a scored -inf label
    logits[0, 3, 9] = float("-inf")
    labels = torch.tensor([[3, 5, -100, 9, -100, -100, 2]])
    ours_in, whole_in = logits.float().requires_grad_(), logits.float().requires_grad_()
    ours = next_token_loss(ours_in, labels, "none")
    whole = F.cross_entropy(whole_in.flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="none")
    assert torch.equal(ours, whole)  # the same log-softmax per row: inf where the label's logit is -inf
    finite = torch.isfinite(whole)
    (grad,) = torch.autograd.grad(ours[finite].sum(), ours_in)
    (expected,) = torch.autograd.grad(whole[finite].sum(), whole_in)
    assert torch.isfinite(grad).all() and torch.allclose(grad, expected, rtol=1e-5, atol=1e-9)
    # a mean over no scored token is nan, as F.cross_entropy's, and its gradient 0, not nan
    unscored = torch.randn(2, 5, 64, requires_grad=True)
    loss = next_token_loss(unscored, torch.full((2, 5), -100))
    assert loss.isnan() and torch.equal(torch.autograd.grad(loss, unscored)[0], torch.zeros(2, 5, 64))


def test_flops_per_token_counts_six_per_matmul_weight_and_the_attention():
    d, layers, vocab, block = 16, 2, 50, 16
    matmul_weights = vocab * d + layers * (3 * d * d + d * d + 4 * d * d + 4 * d * d)  # wte once, as lm_head
    assert tiny().flops_per_token() == 6 * matmul_weights + 12 * layers * d * block


def test_sampling_extends_the_prompt_and_top_k_1_is_greedy():
    model = tiny().eval()
    prompt = torch.tensor([[1, 2, 3]])
    greedy = model.generate(prompt, 20, temperature=0)
    assert greedy.shape == (1, 23) and torch.equal(greedy[:, :3], prompt)  # past block_size: the last 16 tokens
    generator = torch.Generator().manual_seed(0)
    assert torch.equal(model.generate(prompt, 20, temperature=1.0, top_k=1, generator=generator), greedy)
    sampled = model.generate(prompt, 20, temperature=1.0, generator=torch.Generator().manual_seed(0))
    again = model.generate(prompt, 20, temperature=1.0, generator=torch.Generator().manual_seed(0))
    assert torch.equal(sampled, again) and int(sampled.max()) < 50


def test_torch_compile_through_accelerate_matches_eager(fresh_accelerate_state):
    """--torch_compile: accelerate's dynamo plugin (inductor) compiles the model; loss and gradients
    agree with eager within float tolerance."""
    from accelerate import Accelerator
    from accelerate.utils import is_compiled_module

    ids = torch.randint(0, 50, (2, 16))
    results = []
    for backend in ("no", "inductor"):
        model = tiny()
        prepared = Accelerator(cpu=True, dynamo_backend=backend).prepare(model)
        loss = F.cross_entropy(prepared(ids[:, :-1]).flatten(0, 1), ids[:, 1:].flatten())
        loss.backward()
        results.append((prepared, loss.detach(), [p.grad for p in model.parameters()]))
        reset_accelerate_state()
    (eager, loss_a, grads_a), (compiled, loss_b, grads_b) = results
    assert not is_compiled_module(eager) and is_compiled_module(compiled)
    assert torch.allclose(loss_a, loss_b, rtol=1e-5)
    assert all(torch.allclose(a, b, rtol=1e-4, atol=1e-6) for a, b in zip(grads_a, grads_b, strict=True))


# ---------------------------------------------------------------------------------------- the Hugging Face folder


def loads_quietly(folder):
    """AutoModelForCausalLM and AutoTokenizer from `folder`, asserting that transformers reported
    nothing (its load report of missing or unexpected keys is a logger warning) and warned nothing."""
    import logging
    import warnings

    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    class Records(logging.Handler):
        def __init__(self):
            super().__init__(logging.WARNING)
            self.messages = []

        def emit(self, record):
            self.messages.append(record.getMessage())

    records, verbosity = Records(), hf_logging.get_verbosity()
    hf_logging.set_verbosity_warning()  # another test's quiet_transformers() would hide the report
    logging.getLogger("transformers").addHandler(records)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model, info = AutoModelForCausalLM.from_pretrained(folder, output_loading_info=True)
            tokenizer = AutoTokenizer.from_pretrained(folder)
    finally:
        logging.getLogger("transformers").removeHandler(records)
        hf_logging.set_verbosity(verbosity)
    assert not any(info.values()), info
    assert not records.messages and not [str(w.message) for w in caught], (records.messages, caught)
    return model.eval(), tokenizer


def test_the_gpt_saves_as_a_gpt2_folder_that_transformers_loads_with_the_same_logits_and_greedy_tokens(tmp_path):
    import json

    from safetensors.torch import load_file

    from data.text import ByteTokenizer
    from train.core.checkpoint import model_weights
    from train.models.gpt_hf import from_gpt2, save_gpt2_folder, to_gpt2

    model = tiny(vocab_size=257, n_embd=32, n_head=4, dropout=0.1)
    with torch.no_grad():  # larger weights than the initialisation's, so greedy tokens vary
        for p in model.parameters():
            p.normal_(std=0.2) if p.dim() == 2 else p.normal_(std=0.1)
    model.eval()
    ours = model_weights(model)
    assert {k: v.shape for k, v in from_gpt2(to_gpt2(ours)).items()} == {k: v.shape for k, v in ours.items()}
    assert all(torch.equal(from_gpt2(to_gpt2(ours))[k], v) for k, v in ours.items())
    save_gpt2_folder(ours, tmp_path, model.config, ByteTokenizer())
    assert {
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    } <= set(os.listdir(tmp_path))
    config = json.load(open(tmp_path / "config.json"))
    assert config["architectures"] == ["GPT2LMHeadModel"] and config["activation_function"] == "gelu"
    assert (config["n_positions"], config["n_embd"], config["n_layer"], config["n_head"], config["vocab_size"]) == (
        16,
        32,
        2,
        4,
        257,
    )
    assert config["resid_pdrop"] == config["embd_pdrop"] == config["attn_pdrop"] == 0.1
    assert config["bos_token_id"] == config["eos_token_id"] == 256 and config["tie_word_embeddings"]
    saved = load_file(tmp_path / "model.safetensors")  # GPT-2's names; Conv1D weights [in, out]; lm_head tied
    assert "lm_head.weight" not in saved and saved["transformer.h.0.attn.c_attn.weight"].shape == (32, 96)
    assert torch.equal(saved["transformer.h.1.mlp.c_proj.weight"], ours["blocks.1.fc_out.weight"].t())

    hf, tokenizer = loads_quietly(tmp_path)
    ids = torch.randint(0, 257, (3, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        difference = (hf(ids).logits - model(ids)).abs().max().item()
    assert difference < 1e-5, difference
    prompt = torch.tensor([[72, 101, 108]])
    greedy = model.generate(prompt, 13, temperature=0)
    assert len(set(greedy[0, 3:].tolist())) > 2  # tokens that vary: a real comparison
    assert torch.equal(hf.generate(prompt, max_new_tokens=13, do_sample=False), greedy)
    assert tokenizer.eos_token == tokenizer.bos_token == "<|endoftext|>" and tokenizer.eos_token_id == 256


@pytest.mark.parametrize("kind", ["bytes", "bpe"])
def test_the_folders_tokenizer_gives_our_ids(kind, tmp_path):
    from data.text import ByteTokenizer, train_bpe
    from train.models.gpt_hf import hf_tokenizer

    texts = [
        "Naïve café, déjà vu — 日本語 and emoji 🙂.",
        "  two  spaces\tand a tab\n",
        "Ünïcödé ß æ ø å",
        "plain ascii text, repeated: the the the",
    ]
    ours = ByteTokenizer() if kind == "bytes" else train_bpe(texts * 20, 300)
    hf_tokenizer(ours, 16).save_pretrained(tmp_path)
    from transformers import AutoTokenizer

    loaded = AutoTokenizer.from_pretrained(tmp_path)
    assert loaded.eos_token == loaded.bos_token == "<|endoftext|>" and loaded.eos_token_id == ours.eot_id
    assert len(loaded) == ours.vocab_size
    for text in texts:
        ids = ours.encode_batch([text])[0]
        assert loaded(text)["input_ids"] == ids, text
        assert loaded.decode(ids) == ours.decode(ids) == text
    if kind == "bytes":
        assert ours.encode_batch(["é"])[0] == [195, 169] == loaded("é")["input_ids"]
