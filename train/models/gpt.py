"""A decoder-only transformer (GPT) for train/lm.py: pre-norm blocks, causal
`scaled_dot_product_attention`, GELU MLP, learned positions, the output layer tied to the token
embedding. Written here so the project needs no `transformers`; sizes come from the flags.
"""

import math
from dataclasses import asdict, dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint


@dataclass
class GPTConfig:
    vocab_size: int
    block_size: int = 256
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 256
    dropout: float = 0.0

    def check(self):
        """One line per problem, for cli.run to print."""
        if self.n_embd % self.n_head:
            nearest = max(h for h in range(1, self.n_head + 1) if self.n_embd % h == 0)
            raise ValueError(
                f"--n_embd {self.n_embd} is not divisible by --n_head {self.n_head}; pick e.g. --n_head {nearest}"
            )
        if min(self.n_layer, self.n_head, self.n_embd, self.block_size) < 1 or not 0 <= self.dropout < 1:
            raise ValueError("--n_layer, --n_head, --n_embd and --block_size must be positive and --dropout in [0, 1)")
        return self


class Block(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.n_head, self.dropout = c.n_head, c.dropout
        self.ln_1, self.ln_2 = nn.LayerNorm(c.n_embd), nn.LayerNorm(c.n_embd)
        self.qkv, self.proj = nn.Linear(c.n_embd, 3 * c.n_embd), nn.Linear(c.n_embd, c.n_embd)
        self.fc, self.fc_out = nn.Linear(c.n_embd, 4 * c.n_embd), nn.Linear(4 * c.n_embd, c.n_embd)
        self.drop = nn.Dropout(c.dropout)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln_1(x)).view(b, t, 3, self.n_head, d // self.n_head).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0)
        x = x + self.drop(self.proj(y.transpose(1, 2).reshape(b, t, d)))
        return x + self.drop(self.fc_out(F.gelu(self.fc(self.ln_2(x)))))


class GPT(nn.Module):
    _no_split_modules = [
        "Block"
    ]  # FSDP's unit (accelerate's TRANSFORMER_BASED_WRAP), as transformers models name theirs

    def __init__(self, config):
        super().__init__()
        self.config = config.check()
        self.gradient_checkpointing = False
        self.wte, self.wpe = (
            nn.Embedding(config.vocab_size, config.n_embd),
            nn.Embedding(config.block_size, config.n_embd),
        )
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # tied: one matrix for reading and writing tokens
        self.apply(self._init)
        for name, p in self.named_parameters():  # GPT-2: residual projections scaled by depth
            if name.endswith(("proj.weight", "fc_out.weight")):
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * config.n_layer))

    @staticmethod
    def _init(module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, input_ids):
        t = input_ids.shape[1]
        x = self.drop(self.wte(input_ids) + self.wpe(torch.arange(t, device=input_ids.device)))
        for block in self.blocks:
            # recompute each block's activations in backward: memory for ~1/3 more compute
            x = checkpoint(block, x, use_reentrant=False) if self.gradient_checkpointing and self.training else block(x)
        return self.lm_head(self.ln_f(x))

    def param_groups(self, weight_decay):
        """AdamW groups: decay on the matrices of linear layers only, none on norms, biases, embeddings."""
        decay = [p for n, p in self.named_parameters() if p.dim() == 2 and not n.startswith(("wte", "wpe"))]
        rest = [p for n, p in self.named_parameters() if not (p.dim() == 2 and not n.startswith(("wte", "wpe")))]
        return [{"params": decay, "weight_decay": weight_decay}, {"params": rest, "weight_decay": 0.0}]

    def flops_per_token(self):
        """Training FLOPs per token, forward and backward (PaLM appendix B): 6 N + 12 L d T, N the
        parameters in matmuls (the tied embedding counted once, as the output layer)."""
        c = self.config
        matmul_params = sum(p.numel() for n, p in self.named_parameters() if p.dim() == 2 and n != "wpe.weight")
        return 6 * matmul_params + 12 * c.n_layer * c.n_embd * c.block_size

    @torch.no_grad()
    def generate(self, ids, max_new_tokens, temperature=1.0, top_k=None, generator=None):
        """Append max_new_tokens sampled tokens to ids [1, t] (greedy when temperature is 0)."""
        for _ in range(max_new_tokens):
            logits = self(ids[:, -self.config.block_size :])[:, -1, :]
            if temperature == 0:
                next_id = logits.argmax(-1, keepdim=True)
            else:
                logits = logits / temperature
                if top_k:
                    kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, -1:]
                    logits = logits.masked_fill(logits < kth, float("-inf"))
                next_id = torch.multinomial(logits.softmax(-1), 1, generator=generator)
            ids = torch.cat([ids, next_id], dim=1)
        return ids


def config_dict(config):
    return asdict(config)


# logits per piece of the loss on a CPU: 2 MB, so each pass over a piece stays in cache
CPU_LOSS_CHUNK = 2**19


class _PiecewiseCrossEntropy(torch.autograd.Function):
    """Per-row cross-entropy of logits [N, V] against labels [N] (-100: 0, no gradient), computed
    over pieces of `rows` rows in both directions. Autograd over split pieces (the way before this)
    saved every piece's log-softmax and joined the pieces' gradients with one more copy of the whole
    tensor; here the backward writes softmax - one-hot straight into the gradient, piece by piece,
    from the logits and each row's log-sum-exp."""

    @staticmethod
    def forward(ctx, logits, labels, rows):
        scored = labels != -100
        targets = torch.where(scored, labels, 0)[:, None]
        losses = torch.empty(len(logits), dtype=torch.float32, device=logits.device)
        row_max, log_sum = torch.empty_like(losses), torch.empty_like(losses)
        for start in range(0, len(logits), rows):
            piece = logits[start : start + rows].float()
            log_probs = torch.log_softmax(piece, -1)  # one fused kernel; faster here than torch.logsumexp
            losses[start : start + rows] = -log_probs.gather(1, targets[start : start + rows])[:, 0]
            # log-sum-exp = max + log(sum(exp(x - max))), kept as its two terms so the backward subtracts
            # them one after the other, as log-softmax does (one sum loses precision for large logits);
            # the second is minus the log-probability of the largest logit, never far from 0
            row_max[start : start + rows] = piece.amax(-1)
            log_sum[start : start + rows] = -log_probs.amax(-1)
        ctx.save_for_backward(logits, targets, scored, row_max, log_sum)
        ctx.rows = rows
        return losses.masked_fill_(~scored, 0.0)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_losses):
        logits, targets, scored, row_max, log_sum = ctx.saved_tensors
        grad = torch.empty_like(logits)
        # where, not a product: an unscored row gets 0 even if its incoming gradient is inf or nan
        # (a mean over no scored token), as F.cross_entropy gives it
        weights = torch.where(scored, grad_losses, 0.0)[:, None]
        fp32 = logits.dtype == torch.float32  # else each piece in fp32 beside, then rounded into the gradient
        for start in range(0, len(logits), ctx.rows):
            end = start + ctx.rows
            piece = grad[start:end] if fp32 else torch.empty_like(logits[start:end], dtype=torch.float32)
            torch.sub(logits[start:end], row_max[start:end, None], out=piece).sub_(log_sum[start:end, None])
            piece.exp_().mul_(weights[start:end])
            piece.scatter_add_(1, targets[start:end], -weights[start:end])  # softmax - one-hot, times the weight
            if not fp32:
                grad[start:end] = piece
        return grad, None, None


def next_token_loss(logits, labels, reduction="mean"):
    """Cross-entropy of each position's logits against the next token, in fp32 (under bf16 autocast
    the logits are bf16); label -100 (padding, masked repeats) is not scored. On a CPU, over pieces
    of CPU_LOSS_CHUNK logits: at the demo's 2,048 tokens x 8,192 words, one call makes several passes
    over 64 MB in memory, where pieces stay in cache (docs/lm.md); the loss and its gradient equal
    F.cross_entropy's to float rounding."""
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"reduction {reduction!r}: pass 'mean', 'sum' or 'none'")
    logits, labels = logits.flatten(0, 1), labels.flatten()
    rows = max(1, CPU_LOSS_CHUNK // logits.shape[-1])
    if logits.device.type != "cpu" or logits.shape[0] <= rows:  # a GPU's kernels stream it: one call
        return F.cross_entropy(logits.float(), labels, ignore_index=-100, reduction=reduction)
    losses = _PiecewiseCrossEntropy.apply(logits, labels, rows)
    if reduction == "none":
        return losses
    total = losses.sum()
    return total if reduction == "sum" else total / (labels != -100).sum()
