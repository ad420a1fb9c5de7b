"""train/grpo.py's advantages, loss, gradients and metrics against TRL 1.16's GRPOTrainer, in one
process in fp32: the same tiny Llama, prompts, completions and rewards go through TRL's own code
(its advantages from _generate_and_score_completions, its loss from compute_loss) and through our
functions put together as main() puts them, for every --loss_type and --scale_rewards, with and
without beta and with and without the sampling policy's log-probs (--num_iterations > 1: a ratio
that is not 1). With one process and one micro-batch per step the step is the micro-batch, so both
must agree to float rounding; the one normaliser that differs on purpose (bnpo under accumulation)
is measured in its own test."""

import pytest
import torch

from conftest import reset_accelerate_state
from hf_models import tiny_causal_lm
from train.core.rewards import answer_texts, rewards_of, score
from train.grpo import (
    LOSS_TYPES,
    SCALE_REWARDS,
    StepMetrics,
    group_advantages,
    logps_and_mask,
    normalised_sum,
    padded_rows,
    policy_loss,
)

GROUP = 4  # --num_generations
MAX_COMPLETION = 6  # --max_completion_length
TEMPERATURE, EPSILON, EPSILON_HIGH, BETA = 0.7, 0.2, 0.28, 0.04
WEIGHTS = [1.0, 0.5]
# Two reward functions' scores for 3 prompts x 4 answers: a spread group, a group whose rewards are all
# equal (std 0), and a group with an answer no function scored (reward NaN, advantage 0) and one that
# only the first scored (TRL's nansum)
SCORES = {
    "first": [1.0, 2.0, 3.0, 4.0, 1.0, 1.0, 1.0, 1.0, None, 2.0, 5.0, 0.5],
    "second": [0.0, 1.0, 0.0, 1.0, 2.0, 2.0, 2.0, 2.0, None, None, 1.0, 3.0],
}
PROMPT_TEXTS = ["the a", "of and", "music number letter"]
# The fabricated answers: lengths with the end-of-text last, except row 0 (cut at MAX_COMPLETION, no
# end-of-text); rows 0-5 hold 21 tokens, rows 6-11 29, so two micro-batches of 6 differ in tokens
LENGTHS = [6, 4, 1, 3, 5, 2, 6, 5, 3, 6, 5, 4]
PROMPT_LENGTHS = [2, 4, 3]  # TRL left-pads the shorter prompts, we right-pad whole rows
PAD = 0  # our right padding: any id, it comes after every scored token


def first(completions, **kwargs):
    return SCORES["first"]


def second(completions, **kwargs):
    return SCORES["second"]


FUNCS = [("first", first), ("second", second)]


@pytest.fixture(scope="module")
def trl_grpo(tmp_path_factory):
    """(TRL's GRPOTrainer, its tokenizer, our copy of the same weights): one trainer for the module; each
    test sets the attributes _compute_loss reads at call time (loss_type, beta, scale_rewards)."""
    trl = pytest.importorskip("trl")
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = tiny_causal_lm(tmp_path_factory.mktemp("grpo_trl") / "llama", "llama")
    tokenizer = AutoTokenizer.from_pretrained(folder)
    config = trl.GRPOConfig(
        output_dir=str(tmp_path_factory.mktemp("trl_out")),
        per_device_train_batch_size=len(LENGTHS),
        num_generations=GROUP,
        max_completion_length=MAX_COMPLETION,
        temperature=TEMPERATURE,
        epsilon=EPSILON,
        epsilon_high=EPSILON_HIGH,
        beta=BETA,  # loads TRL's reference model; tests set trainer.beta to 0 or BETA
        reward_weights=WEIGHTS,
        # TRL's config turns bf16 on by default, on CPU too: its LM head then rounds the logits to bf16
        bf16=False,
        gradient_checkpointing=False,  # the same values, only slower
        use_cpu=True,
        report_to="none",
        save_strategy="no",
        seed=0,
    )
    # the model as a folder: with beta, TRL loads its reference model from the policy's name or path
    trainer = trl.GRPOTrainer(
        model=folder,
        reward_funcs=[first, second],
        args=config,
        train_dataset=Dataset.from_dict({"prompt": PROMPT_TEXTS}),
        processing_class=tokenizer,
    )
    trainer.model.train()
    ours = AutoModelForCausalLM.from_pretrained(folder).train()
    theirs = dict(trainer.model.named_parameters())
    assert all(torch.equal(p, theirs[name]) for name, p in ours.named_parameters())
    yield trainer, tokenizer, ours
    reset_accelerate_state()


@pytest.fixture(scope="module")
def trl_rollouts(trl_grpo):
    """Per --scale_rewards mode: the output of TRL's own advantage code and its logged rollout metrics.
    TRL computes advantages inline in _generate_and_score_completions (no function of their own), so
    that private method is called, on 3 prompts x 4 sampled answers scored by SCORES."""
    trainer, _, _ = trl_grpo
    out = {}
    for mode in SCALE_REWARDS:
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(trainer, "scale_rewards", mode)
            trainer._metrics["train"].clear()
            rows = [{"prompt": text} for text in PROMPT_TEXTS for _ in range(GROUP)]
            generated = trainer._generate_and_score_completions(rows)
            out[mode] = generated, {k: v[-1] for k, v in trainer._metrics["train"].items()}
    return out


def our_rewards(tokenizer, completions):
    """main()'s rollout(): the reward functions' scores, weighted: (rewards, answers x functions table)."""
    prompts = [text for text in PROMPT_TEXTS for _ in range(GROUP)]
    scores = score(FUNCS, prompts, answer_texts(tokenizer, completions, False), completions, {})
    return rewards_of(WEIGHTS, scores)


@pytest.mark.parametrize("scale_rewards", SCALE_REWARDS)
def test_advantages_and_rollout_metrics_equal_trls(trl_grpo, trl_rollouts, scale_rewards):
    """TRL's advantages of SCORES equal group_advantages', and the rollout metrics it logs (rewards, their
    std, lengths) StepMetrics'."""
    trainer, tokenizer, _ = trl_grpo
    generated, theirs = trl_rollouts[scale_rewards]
    completions = [
        ids[: int(n)].tolist()
        for ids, n in zip(generated["completion_ids"], generated["completion_mask"].sum(1), strict=True)
    ]
    terminated = [c[-1] == tokenizer.eos_token_id for c in completions]
    rewards, table = our_rewards(tokenizer, completions)
    advantages, group_std = group_advantages(rewards, GROUP, scale_rewards)
    assert rewards[8].isnan() and group_std[1] == 0  # the cases named in SCORES
    torch.testing.assert_close(advantages, generated["advantages"], rtol=1e-6, atol=1e-6)

    logged = StepMetrics(trainer.accelerator, FUNCS)
    logged.rollout(rewards, table, group_std, completions, terminated)
    ours = logged.last
    assert set(theirs) - set(ours) == {"num_tokens"}, sorted(theirs)
    for name, value in ours.items():
        if name == "frac_reward_zero_std" and scale_rewards == "batch":
            # TRL counts the answers whose scaling std is 0, the whole step's here; we count the groups
            # whose own std is 0 whatever the scaling (1 group in 3 here)
            assert (theirs[name], value) == (0.0, pytest.approx(1 / 3)), name
            continue
        assert value == pytest.approx(theirs[name], rel=1e-6, abs=1e-6), (name, value, theirs[name])


# ---------------------------------------------------------------------------------------------- the loss


@pytest.fixture(scope="module")
def batch(trl_grpo):
    """3 prompts (2, 4, 3 tokens) x 4 answers of LENGTHS, as TRL's inputs (left-padded prompts,
    right-padded completions) and as our lists; with log-probs for the sampling policy and the reference
    near the model's own (so some ratios clip low, some high), in TRL's layout."""
    _, tokenizer, ours = trl_grpo
    eos = tokenizer.eos_token_id
    generator = torch.Generator().manual_seed(1)
    vocab = ours.config.vocab_size

    def tokens(n):
        return torch.randint(3, vocab, (n,), generator=generator).tolist()

    prompt_of = [tokens(n) for n in PROMPT_LENGTHS]
    prompts = [prompt_of[i // GROUP] for i in range(len(LENGTHS))]
    completions = [tokens(n - 1) + [eos] for n in LENGTHS]
    completions[0] = tokens(MAX_COMPLETION)  # cut at --max_completion_length: no end-of-text
    width = max(PROMPT_LENGTHS)
    trl_inputs = {
        "prompt_ids": torch.tensor([[tokenizer.pad_token_id] * (width - len(p)) + p for p in prompts]),
        "prompt_mask": torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts]),
        "completion_ids": torch.tensor([c + [tokenizer.pad_token_id] * (MAX_COMPLETION - len(c)) for c in completions]),
        "completion_mask": torch.tensor([[1] * len(c) + [0] * (MAX_COMPLETION - len(c)) for c in completions]),
        "num_items_in_batch": torch.tensor(sum(LENGTHS)),  # the generation batch's completion tokens
    }
    with torch.no_grad():  # the model's own log-probs, in TRL's layout, computed apart from our code
        ids = torch.cat([trl_inputs["prompt_ids"], trl_inputs["completion_ids"]], 1)
        attention = torch.cat([trl_inputs["prompt_mask"], trl_inputs["completion_mask"]], 1)
        logits = ours(input_ids=ids, attention_mask=attention).logits[:, -MAX_COMPLETION - 1 : -1] / TEMPERATURE
        current = torch.log_softmax(logits, -1).gather(-1, trl_inputs["completion_ids"].unsqueeze(-1)).squeeze(-1)
    mask = trl_inputs["completion_mask"]
    old = (current + 0.3 * torch.randn(current.shape, generator=generator)) * mask
    ref = (current + 0.5 * torch.randn(current.shape, generator=generator)) * mask
    return {"prompts": prompts, "completions": completions, "trl": trl_inputs, "old": old, "ref": ref}


def our_logps(model, prompts, completions):
    """main()'s logps_of: (log-probs, completion-token mask, logits) of our padded rows."""
    return logps_and_mask(model, padded_rows(prompts, completions, PAD), TEMPERATURE)


def our_layout(x, prompts, completions, width):
    """(rows, MAX_COMPLETION) in TRL's layout -> (rows, width - 1) in ours: logps_and_mask's position t
    holds the log-probability of token t + 1, so answer token j of row i is at len(prompt) - 1 + j."""
    out = torch.zeros(len(prompts), width - 1)
    for i, (p, c) in enumerate(zip(prompts, completions, strict=True)):
        out[i, len(p) - 1 : len(p) - 1 + len(c)] = x[i, : len(c)]
    return out


def our_micro_batch(model, batch, rows, advantages, loss_type, beta, with_old):
    """main()'s inner loop for the micro-batch `rows` of a step of all of batch's answers: (loss, logits,
    mask, stats)."""
    prompts = [batch["prompts"][i] for i in rows]
    completions = [batch["completions"][i] for i in rows]
    logps, mask, logits = our_logps(model, prompts, completions)
    width = logps.shape[1] + 1
    old = our_layout(batch["old"][rows], prompts, completions, width) if with_old else logps.detach()
    ref = our_layout(batch["ref"][rows], prompts, completions, width) if beta else None
    token_loss, stats = policy_loss(logps, old, ref, advantages[rows], mask.float(), beta, EPSILON, EPSILON_HIGH)
    step_answers = len(batch["completions"])
    step_tokens = sum(len(c) for c in batch["completions"])
    share = normalised_sum(token_loss, mask.float(), loss_type, step_answers, step_tokens, MAX_COMPLETION)
    return share, logits, mask, stats


def trl_micro_batch(trainer, batch, rows, advantages, beta, with_old):
    """TRL's compute_loss on the micro-batch `rows`, and the metrics it logged."""
    inputs = {k: (v if v.dim() == 0 else v[rows]) for k, v in batch["trl"].items()}
    inputs["advantages"] = advantages[rows]
    if with_old:
        inputs["old_per_token_logps"] = batch["old"][rows]
    if beta:
        inputs["ref_per_token_logps"] = batch["ref"][rows]
    trainer._metrics["train"].clear()
    loss = trainer.compute_loss(trainer.model, inputs)
    return loss, {k: v[-1] for k, v in trainer._metrics["train"].items()}


def difference(ours, theirs):
    """|ours - theirs| relative to theirs, or to 0.1 below it: on policy without KL grpo's loss is minus
    the mean advantage, 0 up to the rounding of terms near 1; a micro-batch's share and a clipped
    fraction can be small."""
    return abs(ours - theirs) / max(abs(theirs), 0.1)


def gradients(model, loss):
    model.zero_grad(set_to_none=True)
    loss.backward()
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("with_old", [False, True], ids=["on_policy", "old_logps"])
@pytest.mark.parametrize("beta", [0.0, BETA], ids=["beta0", "beta"])
@pytest.mark.parametrize("scale_rewards", SCALE_REWARDS)
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_loss_gradients_and_metrics_equal_trls(
    trl_grpo, trl_rollouts, batch, monkeypatch, loss_type, scale_rewards, beta, with_old
):
    """One step of 12 answers in one micro-batch: each side's own advantages (TRL's from its rollout code,
    ours from group_advantages), TRL's loss, parameter gradients and logged token metrics equal ours."""
    trainer, tokenizer, ours = trl_grpo
    monkeypatch.setattr(trainer, "loss_type", loss_type)
    monkeypatch.setattr(trainer, "beta", beta)
    monkeypatch.setattr(trainer, "current_gradient_accumulation_steps", 1, raising=False)
    rows = list(range(len(LENGTHS)))
    rewards, table = our_rewards(tokenizer, batch["completions"])
    advantages, group_std = group_advantages(rewards, GROUP, scale_rewards)

    theirs, trl_metrics = trl_micro_batch(
        trainer, batch, rows, trl_rollouts[scale_rewards][0]["advantages"], beta, with_old
    )
    loss, logits, mask, stats = our_micro_batch(ours, batch, rows, advantages, loss_type, beta, with_old)
    loss_difference = difference(loss.item(), theirs.item())

    trl_gradients, our_gradients = gradients(trainer.model, theirs), gradients(ours, loss)
    assert trl_gradients.keys() == our_gradients.keys()
    largest = max(g.abs().max().item() for g in trl_gradients.values())
    gradient_difference = max((our_gradients[k] - g).abs().max().item() for k, g in trl_gradients.items()) / largest

    logged = StepMetrics(trainer.accelerator, FUNCS)
    ended = [c[-1] == tokenizer.eos_token_id for c in batch["completions"]]
    logged.rollout(rewards, table, group_std, batch["completions"], ended)
    logged.tokens(logits, mask, stats, TEMPERATURE)
    record = logged.flush(1)
    names = ["entropy", "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean"]
    names += ["kl"] if beta else []
    assert ("kl" in trl_metrics) == bool(beta)
    metric_difference = max(difference(record[k], trl_metrics[k]) for k in names)
    print(
        f"{loss_type} {scale_rewards} beta={beta} old={with_old}: loss {theirs.item():+.6f} rel diff "
        f"{loss_difference:.1e}, gradient rel diff {gradient_difference:.1e}, metrics diff {metric_difference:.1e}"
    )
    if with_old:  # the fabricated sampling policy clips both ways
        assert trl_metrics["clip_ratio/low_mean"] > 0 and trl_metrics["clip_ratio/high_mean"] > 0, trl_metrics
    assert loss_difference < 2e-6
    assert gradient_difference < 5e-6
    assert metric_difference < 1e-6


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_two_micro_batches_differ_from_trl_only_in_bnpos_normaliser(
    trl_grpo, trl_rollouts, batch, monkeypatch, capsys, loss_type
):
    """The same 12 answers as 2 accumulated micro-batches of 6 (21 and 29 tokens). TRL's grpo, dr_grpo and
    dapo (with steps_per_generation = accumulation, its default) divide each micro-batch as we do, so
    the shares match one by one; TRL's bnpo divides micro-batch m by accumulation x its own tokens
    (2 x 21, 2 x 29), we by the step's (50), so the step's losses differ."""
    trainer, tokenizer, ours = trl_grpo
    monkeypatch.setattr(trainer, "loss_type", loss_type)
    monkeypatch.setattr(trainer, "beta", BETA)
    monkeypatch.setattr(trainer, "current_gradient_accumulation_steps", 2, raising=False)
    monkeypatch.setattr(trainer.args, "steps_per_generation", 2)
    rewards, _ = our_rewards(tokenizer, batch["completions"])
    advantages, _ = group_advantages(rewards, GROUP, "group")
    trl_advantages = trl_rollouts["group"][0]["advantages"]
    halves = [list(range(6)), list(range(6, 12))]
    theirs = [trl_micro_batch(trainer, batch, rows, trl_advantages, BETA, True)[0].item() for rows in halves]
    with torch.no_grad():
        mine = [our_micro_batch(ours, batch, rows, advantages, loss_type, BETA, True)[0].item() for rows in halves]
    if loss_type != "bnpo":
        assert max(difference(m, t) for m, t in zip(mine, theirs, strict=True)) < 2e-6, (mine, theirs)
        return
    tokens = [sum(LENGTHS[i] for i in rows) for rows in halves]
    step_tokens = sum(tokens)
    # the same token sums, divided differently: TRL's share x 2 x its tokens / the step's tokens is ours
    rescaled = [t * 2 * n / step_tokens for t, n in zip(theirs, tokens, strict=True)]
    assert max(difference(m, r) for m, r in zip(mine, rescaled, strict=True)) < 2e-6, (mine, rescaled)
    with capsys.disabled():
        print(
            f"\nbnpo, 2 micro-batches of {tokens[0]} and {tokens[1]} tokens: TRL divides them by {2 * tokens[0]} and "
            f"{2 * tokens[1]}, we by {step_tokens}: step loss TRL {sum(theirs):+.6f}, ours {sum(mine):+.6f} "
            f"(ratio {sum(theirs) / sum(mine):.4f})"
        )
    assert abs(sum(theirs) - sum(mine)) > 1e-3 * abs(sum(mine))
