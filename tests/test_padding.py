"""data/padding.py: batches padded to a bounded set of lengths, with the same numbers for the real tokens."""

import pytest
import torch

from data.padding import padded_length
from data.prompt_response import CausalBatch


def test_a_bounded_set_of_lengths_with_little_padding():
    lengths = [padded_length(n) for n in range(1, 4097)]
    assert all(b >= a for a, b in zip(lengths, lengths[1:], strict=False))  # longer rows never pad shorter
    assert all(length >= n for n, length in enumerate(lengths, 1))
    assert all(length - n <= 7 for n, length in enumerate(lengths[:64], 1))
    assert all((length - n) / n < 1 / 8 for n, length in enumerate(lengths, 1) if n > 64)
    assert len(set(lengths[:1024])) == 40 and len(set(lengths)) == 56  # eight per doubling past 64
    assert padded_length(0) == 0 and padded_length(1000, limit=1000) == 1000  # never beyond the run's limit
    assert padded_length(990, limit=1000) == 1000 and padded_length(250, limit=256) == 256


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_the_longer_padding_leaves_every_real_token_s_loss_as_it_was(packed):
    """GPT-2's summed loss over the scored tokens of a batch padded to its bucket (40 for 33 tokens)
    equals the loss of the same rows padded to exactly the longest (by hand), to float rounding."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=64, n_embd=32, n_layer=2, n_head=2)).eval()
    rows = {"input_ids": [list(range(1, 34)), list(range(5, 25))], "labels": [list(range(1, 34)), [-100] * 10]}
    rows["labels"][1] += list(range(15, 25))
    if packed:
        rows["position_ids"] = [list(range(33)), list(range(10)) + list(range(10))]
    batch = CausalBatch(0, max_length=64)(rows)
    assert batch["input_ids"].shape == (2, 40)
    exact = {k: v[:, :33] for k, v in batch.items()}

    def nats(b):
        inputs = {k: b[k] for k in ("input_ids", "attention_mask", "position_ids") if k in b}
        logits = model(**inputs, use_cache=False).logits[:, :-1]
        return torch.nn.functional.cross_entropy(
            logits.flatten(0, 1), b["labels"][:, 1:].flatten(), reduction="sum", ignore_index=-100
        )

    with torch.no_grad():
        assert torch.allclose(nats(batch), nats(exact), rtol=1e-6, atol=1e-5)
