"""FSDP2 on CPU processes, so the sharded path runs (and is tested) without a GPU.

accelerate 1.15 runs an FSDP config only on GPUs: with CPU processes it builds plain DDP (MULTI_CPU).
torch 2.15's `fully_shard` runs on a CPU device mesh over gloo, so when the launch's config asks for
FSDP2 and accelerate would run MULTI_CPU, the Accelerator of train/core/accelerator.py shards the
model here, in `prepare`, the way accelerate's FSDP2 plugin shards it on GPUs: the same plugin read
from the same config, the same auto-wrap policy (accelerate's own function), the final norm in a
group that stays gathered after forward, then the root. On GPUs accelerate does all of this itself
and this module does nothing, so a model is never wrapped twice.
"""

import os

import torch
from accelerate.utils import DistributedType

from data.errors import fail


def fsdp_launch():
    """Whether the launch's accelerate config asks for FSDP (run by accelerate on GPUs, here on CPUs)."""
    return os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true"


def cpu_fsdp2_plugin(accelerator):
    """accelerate's FullyShardedDataParallelPlugin, read from the launch's config, when that config asks
    for FSDP2 and accelerate runs this launch as CPU processes (MULTI_CPU); else None."""
    if not fsdp_launch() or os.environ.get("FSDP_VERSION") != "2":
        return None
    if accelerator.distributed_type != DistributedType.MULTI_CPU:
        return None
    from accelerate.utils import FullyShardedDataParallelPlugin

    plugin = FullyShardedDataParallelPlugin()
    if plugin.activation_checkpointing or plugin.ignored_modules is not None:
        fail(
            "fsdp_activation_checkpointing and fsdp_ignored_modules are applied by accelerate on GPUs only; on CPU "
            "processes leave them out of the accelerate config (train/lm.py has --gradient_checkpointing)"
        )
    return plugin


def mixed_precision_policy(accelerator):
    """bf16 compute over fp32 master weights, gradients reduced and accumulated in fp32, as under DDP
    with autocast (torchtitan's default too; accelerate's GPU default reduces in bf16). fp16 is not
    active on CPUs in accelerate (no autocast, no loss scaler), so it stays fp32 here as under DDP."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if accelerator.mixed_precision != "bf16":
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def _final_norm(model):
    # accelerate's FSDP2 path gives the last norm among the model's direct children a group of its
    # own that stays gathered after forward (backward starts with it at once)
    norms = [m for _, m in model.named_children() if "Norm" in type(m).__name__]
    return norms[-1] if norms else None


def keeps_running_stats(module):
    """BatchNorm (and InstanceNorm with track_running_stats): fp32 running statistics that FSDP2 never
    casts, which the CPU kernel refuses beside bf16 weights ("expected scalar type BFloat16 but found
    Float"). Such a module is a unit of its own whose parameters stay fp32; its input stays as it
    comes (bf16 from the autocast layer before it), which the kernel takes. FSDP1 keeps BatchNorm in
    full precision the same way by default."""
    return getattr(module, "track_running_stats", False) and getattr(module, "running_mean", None) is not None


def shard_model(plugin, model, world_size, mp_policy):
    """Apply fully_shard to `model` in place, units first, on a CPU mesh of world_size processes;
    return a one-line description of the units."""
    from accelerate.utils.fsdp_utils import fsdp2_prepare_auto_wrap_policy
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    try:
        policy = fsdp2_prepare_auto_wrap_policy(plugin, model)
    except ValueError as e:  # a class named in fsdp_transformer_layer_cls_to_wrap that this model has not
        fail(
            f"the accelerate config's FSDP settings do not fit {type(model).__name__}: {e} Its classes: "
            f"{', '.join(sorted({type(m).__name__ for m in model.modules()}))}; set fsdp_transformer_layer_cls_to_wrap "
            "to one of them, or leave it out to use the model's _no_split_modules"
        )
    if mp_policy.param_dtype is not None:  # fp32 master weights under bf16, as accelerate upcasts them
        for p in model.parameters():
            if p.requires_grad and p.dtype != torch.float32:
                p.data = p.data.float()
    kwargs = {
        "mesh": init_device_mesh("cpu", (world_size,)),
        "reshard_after_forward": plugin.reshard_after_forward,
        "mp_policy": mp_policy,
    }
    full_precision = {
        **kwargs,
        "mp_policy": MixedPrecisionPolicy(reduce_dtype=torch.float32, cast_forward_inputs=False),
    }
    units, root = [], type(model).__name__
    # reversed pre-order: every module comes after its descendants, so units nest from the inside out
    for module in list(model.modules())[:0:-1]:
        if isinstance(module, FSDPModule):
            continue
        if mp_policy.param_dtype is not None and keeps_running_stats(module):
            units.append(type(module).__name__)
            fully_shard(module, **full_precision)
        elif policy is not None and policy(module):
            units.append(type(module).__name__)
            fully_shard(module, **kwargs)
    norm = _final_norm(model)
    if norm is not None and not isinstance(norm, FSDPModule):
        units.append(type(norm).__name__)
        fully_shard([norm], **{**kwargs, "reshard_after_forward": False})
    fully_shard(model, **{k: v for k, v in kwargs.items() if k != "reshard_after_forward"})
    counts = {name: units.count(name) for name in dict.fromkeys(units)}
    return ", ".join([*(f"{n} {name}" for name, n in counts.items()), f"the root {root}"])


def swap_optimizer_params(optimizer, old_names, model):
    """Point a fresh optimizer at the model's sharded parameters: fully_shard replaced each parameter
    by a DTensor holding this rank's shard, and the optimizer must step those, by name."""
    if optimizer.state:
        fail(
            "the optimizer has taken steps before accelerator.prepare; under FSDP2 create it and prepare it "
            "before training"
        )
    new = dict(model.named_parameters())
    for group in optimizer.param_groups:
        group["params"] = [new[old_names[id(p)]] if id(p) in old_names else p for p in group["params"]]


def local_share(model):
    """The fraction of the model's parameter elements this rank holds."""
    total = sum(p.numel() for p in model.parameters())
    held = sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel() for p in model.parameters())
    return held / max(total, 1)


def is_sharded(model):
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)
