"""Answers of a causal LM to prompts, drawn so that they depend only on what they should: the prompts
generated together, the weights and a seed, never on which process generated them.

A generation batch (the groups of a fixed run of a step's prompts, n answers each) is the same batch
on any layout, so its shapes and therefore its arithmetic are too. Each answer's tokens are drawn by
the Gumbel-max trick from a generator seeded for its group: argmax(logits / temperature + g), with
g standard Gumbel noise, is a draw from softmax(logits / temperature), the distribution whose
log-probabilities the loss then uses. top_k and top_p narrow the draw first (transformers' own
warpers); the log-probabilities stay those of the whole tempered distribution, as TRL computes
them, so with either the importance ratio is taken against a slightly different distribution than
the one that sampled (docs/grpo.md). Greedy answers (evaluation) are the plain argmax.

transformers' generate() does the decoding (caches, positions, padding, stopping at end-of-text for
any model family); with `synced` (FSDP2: every forward is a collective) every process steps until
all are done, as generate's synced_gpus does.
"""

import math

import torch


class GumbelSampler:
    """A logits processor for generate(do_sample=False): each row's next token becomes a draw from
    its tempered (and top-k/top-p narrowed) distribution, by noise from its group's generator alone
    (`generators`: one per block of `rows_each` consecutive rows)."""

    def __init__(self, temperature, generators, rows_each, top_k=0, top_p=1.0):
        from transformers import TopKLogitsWarper, TopPLogitsWarper

        self.temperature, self.generators, self.rows_each = temperature, generators, rows_each
        self.warpers = ([TopKLogitsWarper(top_k)] if top_k else []) + ([TopPLogitsWarper(top_p)] if top_p < 1 else [])

    def __call__(self, input_ids, scores):
        scores = scores.float() / self.temperature
        for warp in self.warpers:
            scores = warp(input_ids, scores)
        shape = (self.rows_each, scores.shape[1])
        uniform = torch.cat([torch.rand(shape, generator=g, device=g.device) for g in self.generators])
        gumbel = -torch.log(-torch.log(uniform.clamp(min=1e-20, max=1 - 1e-7)))
        return scores + gumbel


def group_seed(seed, *keys):
    """A 63-bit seed of `seed` and `keys` (the step, the prompt's row): the same on every process."""
    import hashlib

    digest = hashlib.blake2b(repr((seed, *keys)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def end_ids(model, tokenizer):
    """Every token id that ends an answer: the tokenizer's end-of-text and the model's generation config's."""
    ids = model.generation_config.eos_token_id
    ids = set(ids if isinstance(ids, list) else [ids] if ids is not None else [])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return sorted(ids)


def complete(model, prompts, max_new_tokens, eos, pad, sampler=None, synced=False):
    """Answers to `prompts` (lists of token ids), as (ids, terminated) per prompt: the answer's ids up to
    and with its first end-of-text id (in `eos`), and whether it ended there (else it was cut at
    `max_new_tokens`). Without `sampler`: greedy. The prompts are left-padded with `pad`."""
    from transformers import GenerationConfig, LogitsProcessorList

    device = next(model.parameters()).device
    width = max(len(p) for p in prompts)
    input_ids = torch.tensor([[pad] * (width - len(p)) + list(p) for p in prompts], device=device)
    attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    config = GenerationConfig(
        max_new_tokens=max_new_tokens,
        do_sample=False,
        num_beams=1,
        eos_token_id=eos,
        pad_token_id=pad,
        temperature=None,
        top_k=None,
        top_p=None,
    )
    was_training = model.training
    model.eval()  # no dropout while answering (and none in training with --disable_dropout)
    with torch.no_grad():
        out = model.generate(
            input_ids=input_ids,
            attention_mask=attention_mask,
            generation_config=config,
            logits_processor=LogitsProcessorList([sampler]) if sampler is not None else None,
            synced_gpus=synced,
        )
    model.train(was_training)
    answers = []
    stop = set(eos)
    for row in out[:, width:].tolist():
        end = next((i for i, t in enumerate(row) if t in stop), None)
        answers.append((row[: end + 1], True) if end is not None else (row, False))
    return answers


def sample_groups(model, prompts, n, max_new_tokens, eos, pad, temperature, seeds, top_k=0, top_p=1.0, synced=False):
    """`n` answers to each of `prompts` (their ids), generated as one batch, each group's drawn with a
    generator of its seed (in `seeds`) alone: n copies of the first prompt's answers, then the next's."""
    device = next(model.parameters()).device
    generators = [torch.Generator(device=device).manual_seed(seed) for seed in seeds]
    sampler = GumbelSampler(temperature, generators, n, top_k, top_p)
    rows = [prompt for prompt in prompts for _ in range(n)]
    return complete(model, rows, max_new_tokens, eos, pad, sampler, synced)


def round_robin(count, accelerator):
    """The indices of 0..count-1 this process takes (every world_size-th from its rank), in rounds; with
    synced generation every process runs the same number of rounds: None is a round with nothing, in
    which a process generates something to discard, in step with the others."""
    rank, world = accelerator.process_index, accelerator.num_processes
    return [i if (i := k * world + rank) < count else None for k in range(math.ceil(count / world))]


def synced_generation(accelerator):
    """Whether every forward is a collective (FSDP2 shards the weights): then every process generates in step."""
    return accelerator.distributed_type.value == "FSDP" and accelerator.num_processes > 1
