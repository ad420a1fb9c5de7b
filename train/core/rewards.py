"""Reward functions: the user's code that scores a model's answers, called as TRL calls them.

`--reward_funcs rewards.py:name[,name2] builtin ...` names them: a Python file and the functions in it,
or one of the built-ins below. Each is called with keyword arguments, as TRL's GRPOTrainer calls its
reward functions: `prompts` and `completions` (lists of one entry per answer: strings, or for
conversational prompts the turns and a one-turn list [{"role": "assistant", "content": ...}]),
`completion_ids` (lists of token ids), and every other column of the data set by name, one value
per answer (an `answer` column, say); a function that takes `**kwargs` ignores what it does not use.
It returns one float per answer, or None where it does not apply (counted as missing, not as 0).

A function that raises, or returns the wrong count or a non-number, ends the run with one line naming
it and the prompt; nothing trained is lost (checkpoints stay).
"""

import importlib.util
import inspect
import math
import os
import re

import torch

from data.errors import fail
from data.labelled_text import first_words

NUMBER = re.compile(r"-?\d+(?:[.,]\d+)*")


def _text(completion):
    """A completion's text: a string as it is, a conversation's last turn's content."""
    if isinstance(completion, list):
        return completion[-1]["content"] if completion else ""
    return completion


def _number(text):
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return None


def answer_match(completions, answer, **kwargs):
    """1.0 when the answer's last number (or, for an answer that is not a number, its text after
    stripping) equals the `answer` column; 0.0 otherwise."""
    out = []
    for completion, expected in zip(completions, answer, strict=True):
        text, expected = _text(completion).strip(), str(expected).strip()
        numbers = NUMBER.findall(text)
        if _number(expected) is not None:
            out.append(float(bool(numbers) and _number(numbers[-1]) == _number(expected)))
        else:
            out.append(float(text == expected))
    return out


def number_only(completions, **kwargs):
    """1.0 when the answer is one number and nothing else (a full stop after it allowed): the form a
    verifiable task asks for."""
    return [float(NUMBER.fullmatch(_text(c).strip().removesuffix(".")) is not None) for c in completions]


BUILT_IN = {"answer_match": answer_match, "number_only": number_only}


def load_reward_funcs(specs, flag="--reward_funcs"):
    """[(name, function)] of `specs`: each FILE.py:NAME[,NAME...] or a built-in name; one line for a
    file or a function that does not exist."""
    funcs = []
    for spec in specs:
        if ":" not in spec:
            if spec not in BUILT_IN:
                fail(
                    f"{flag} {spec}: neither FILE.py:NAME nor a built-in reward ({', '.join(BUILT_IN)}); pass "
                    "your own as rewards.py:my_reward"
                )
            funcs.append((spec, BUILT_IN[spec]))
            continue
        path, names = spec.rsplit(":", 1)
        if not os.path.isfile(path):
            fail(f"{flag} {spec}: no such file {path}; pass FILE.py:NAME of a Python file that defines NAME")
        module_name = "reward_funcs_" + re.sub(r"\W", "_", os.path.abspath(path))
        loader = importlib.util.spec_from_file_location(module_name, path)
        module = importlib.util.module_from_spec(loader)
        try:
            loader.loader.exec_module(module)
        except Exception as e:  # the user's file: any error in it is theirs to fix
            fail(f"{flag} {spec}: {path} fails to import ({type(e).__name__}: {' '.join(str(e).split())[:150]})")
        for name in (n.strip() for n in names.split(",") if n.strip()):
            func = getattr(module, name, None)
            if not callable(func):
                defined = sorted(n for n, v in vars(module).items() if inspect.isfunction(v) and not n.startswith("_"))
                functions = ", ".join(defined) or "none"
                fail(f"{flag} {spec}: {path} defines no function {name} (its functions: {functions})")
            funcs.append((name, func))
    names = [n for n, _ in funcs]
    if len(set(names)) != len(names):
        fail(f"{flag}: a reward named twice ({', '.join(names)}); each metric is named after its function")
    return funcs


def reward_weights(funcs, weights, flag="--reward_weights"):
    """The weight of each of `funcs` (load_reward_funcs'): `weights` (1 each where None), or one line unless
    there is one per function, counted once loaded (a.py:f,g is two)."""
    if weights is None:
        return [1.0] * len(funcs)
    if len(weights) != len(funcs):
        names = ", ".join(n for n, _ in funcs) or "no --reward_funcs"
        fail(f"{flag} has {len(weights)} value(s) for {len(funcs)} reward function(s) ({names}); pass one per function")
    return list(weights)


def score(funcs, prompts, completions, completion_ids, columns):
    """Per function, one float per completion (NaN where it returned None). Raises RewardError with the
    one line to show when a function raises or answers in the wrong shape."""
    scores = []
    for name, func in funcs:
        try:
            values = func(prompts=prompts, completions=completions, completion_ids=completion_ids, **columns)
        except Exception as e:  # the user's code: whatever it raises is named, with the prompt
            raise RewardError(
                f"reward function {name} raised {type(e).__name__}: {' '.join(str(e).split())[:150]} (on the prompt "
                f"{first_words(_text(prompts[0]))})"
            ) from e
        try:
            values = [math.nan if v is None else float(v) for v in values]
        except (TypeError, ValueError):
            raise RewardError(
                f"reward function {name} returned {first_words(repr(values))}, not one number (or None) per "
                f"completion (on the prompt {first_words(_text(prompts[0]))})"
            ) from None
        if len(values) != len(completions):
            raise RewardError(
                f"reward function {name} returned {len(values)} value(s) for {len(completions)} completions (on the "
                f"prompt {first_words(_text(prompts[0]))}); return one number (or None) per completion"
            )
        scores.append(values)
    return scores


class RewardError(Exception):
    """A reward function's failure, as one line; raised where it happened, shown on every rank."""


def scored_everywhere(accelerator, parts):
    """Every process's `parts` (a list of scored answers, or a RewardError's line), gathered in rank order
    on every process; a reward function's failure on any process becomes the same one line on all of them,
    instead of the others waiting in a collective for a process that is gone."""
    from train.core.accelerator import gather_patiently

    gathered = gather_patiently(accelerator, parts)
    for part in gathered:
        if isinstance(part, str):
            fail(part)
    return [item for part in gathered for item in part]


def answer_texts(tokenizer, ids, conversational):
    """The completions as reward functions take them: text, or for conversational prompts an assistant turn."""
    texts = [tokenizer.decode(i, skip_special_tokens=True) for i in ids]
    return [[{"role": "assistant", "content": t}] for t in texts] if conversational else texts


def rewards_of(weights, scores):
    """(reward per answer, answers x functions table) of score()'s lists: the weighted sum over the
    functions, missing values skipped (TRL's nansum); NaN where no function applied."""
    table = torch.tensor(scores, dtype=torch.float32).T
    rewards = torch.nansum(table * torch.tensor(weights), dim=1)
    return torch.where(table.isnan().all(dim=1), torch.nan, rewards), table


def nanstd(x, dim):
    """The unbiased standard deviation of the values that are not NaN, along `dim` (as TRL's nanstd)."""
    valid = ~x.isnan()
    count = valid.sum(dim=dim)
    mean = x.nanmean(dim=dim, keepdim=True)
    squares = torch.where(valid, (x - mean) ** 2, torch.zeros_like(x)).sum(dim=dim)
    return (squares / (count - 1)).sqrt()
