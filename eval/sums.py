"""The scoring of eval/sums.yaml: the project's own answer_match (train/core/rewards.py), so that lm_eval's
exact_match on a question is the reward train/grpo.py and train/sft.py give the same answer."""

import os
import sys

# lm_eval imports this file by its path: the repository root is not on sys.path
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from train.core.rewards import answer_match  # noqa: E402


def process_results(doc, results):
    """{"exact_match": 1.0 when the answer's last number is the sum, else 0.0}."""
    return {"exact_match": answer_match(results[:1], [doc["answer"]])[0]}
