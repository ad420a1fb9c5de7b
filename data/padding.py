"""How long a padded batch is: a few lengths per doubling, so a run makes a bounded set of shapes.

A batch padded to exactly its longest row has a new shape for almost every batch when lengths vary,
and on a CPU every new shape keeps memory: oneDNN caches kernels per shape, and the allocator keeps
the blocks of each size it has seen, so a long run's peak memory grows with the number of distinct
lengths it met (docs/sft.md measures it). Rounding the longest row up to the next bucket bounds the
set: multiples of 8 up to 64 (at most 7 tokens more), then eight buckets per doubling (72, 80, ...,
128, 144, ..., 256, ...), less than an eighth more: 40 lengths from 1 to 1,024 tokens. Right padding
is masked (or, in packed rows, a sequence of its own) and never scored, so the numbers a model
computes for the real tokens do not change, only the shape they are computed in. GPUs gain too:
fewer shapes to tune kernels for or compile.
"""


def padded_length(longest, limit=None):
    """The length to pad a batch whose longest row has `longest` tokens to, never beyond `limit`
    (the run's maximum length, which the model's positions allow)."""
    if longest <= 0:
        return longest
    step = max(8, 1 << max(0, (longest - 1).bit_length() - 4))
    length = -(-longest // step) * step
    return min(length, max(limit, longest)) if limit else length
