"""Preflight: check an accelerate config against this machine before launching anything.

    python -m train.check_config accelerate_configs/4gpu.yaml [--machine_rank 1]

Prints one line per problem, naming the key and the fix, and exits 1; or one `ok:` line and exits 0.
It catches what otherwise shows up as a hang or a traceback minutes into a multi-node launch:
YAML errors, unknown keys, an unquoted NO read as False, more processes than GPUs, multi-node
without an address or rank, c10d with same_network: true, FSDP2 options of the wrong type.
"""

import argparse
import dataclasses
import difflib
import os
import sys

import yaml

SECTIONS = (
    "fsdp_config",
    "deepspeed_config",
    "megatron_lm_config",
    "dynamo_config",
    "fp8_config",
    "parallelism_config",
    "mpirun_config",
)
GPU_TYPES = ("MULTI_GPU", "FSDP", "DEEPSPEED", "MEGATRON_LM")


def known_keys():
    from accelerate.commands.config.config_args import ClusterConfig

    return {f.name for f in dataclasses.fields(ClusterConfig)}


def problems(path, machine_rank=None, gpu_count=None):
    """Every problem with the config at `path` on this machine, as one-line strings."""
    # one check after another, in the order a user meets them (file, keys, layout, machine): long, but
    # read top to bottom; split into helpers it would hide the order that makes the messages make sense
    try:
        with open(path) as f:
            raw = yaml.safe_load(f)
    except OSError as e:
        return [f"{path}: cannot read it ({e.strerror})"]
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark else ""
        return [f"{path}{where}: not valid YAML ({getattr(e, 'problem', None) or e}); check indentation and quotes"]
    if not isinstance(raw, dict):
        return [f"{path}: expected key: value pairs, got {type(raw).__name__}"]

    found = []
    for key in ("distributed_type", "mixed_precision", "dynamo_backend"):
        if raw.get(key) is False:
            found.append(
                f"{key} is the boolean False: YAML reads an unquoted NO as False; write {key}: 'NO'"
                if key == "distributed_type"
                else f"{key} is the boolean False: YAML reads an unquoted no as False; write {key}: 'no'"
            )
    allowed = known_keys()
    for key in raw:
        if key not in allowed:
            close = difflib.get_close_matches(key, allowed, n=1)
            found.append(
                f"unknown key {key!r}"
                + (f"; did you mean {close[0]!r}?" if close else "; accelerate rejects unknown keys, remove it")
            )
    if found:
        return found

    dtype = str(raw.get("distributed_type", "NO")).upper()
    machines = int(raw.get("num_machines", 1) or 1)
    processes = int(raw.get("num_processes", 1) or 1)
    rank = machine_rank if machine_rank is not None else raw.get("machine_rank")
    if machines > 1:
        if not raw.get("main_process_ip"):
            found.append(
                f"num_machines is {machines} but main_process_ip is not set; set it to node 0's address, "
                "reachable from every node"
            )
        if rank is None:
            found.append(
                "num_machines > 1 but machine_rank is not set; 0 on the main node, 1.. on the others "
                "(or pass --machine_rank to accelerate launch)"
            )
        elif not 0 <= int(rank) < machines:
            found.append(f"machine_rank {rank} is outside 0..{machines - 1}")
        if processes % machines:
            found.append(
                f"num_processes {processes} is not divisible by num_machines {machines}; num_processes is "
                "the total over all machines"
            )
        if not raw.get("main_process_port"):
            found.append(
                "main_process_port is unset or 0 on a multi-node config; auto-picking a port only works on "
                "one node, set a fixed free port such as 29500"
            )
    if raw.get("rdzv_backend") == "c10d" and raw.get("same_network") is True:
        found.append(
            "rdzv_backend is c10d but same_network is true: accelerate then passes a static master "
            "address and c10d is not used; set same_network: false"
        )
    if dtype == "FSDP":
        fsdp = raw.get("fsdp_config") or {}
        if fsdp.get("fsdp_version") == 2 and not isinstance(fsdp.get("fsdp_reshard_after_forward", True), bool):
            found.append(
                "fsdp_reshard_after_forward must be true or false with fsdp_version: 2 (FSDP1's "
                f"{fsdp.get('fsdp_reshard_after_forward')!r} is not accepted)"
            )
    per_machine = processes // machines
    if dtype == "MULTI_CPU" and per_machine > 1 and not (raw.get("mpirun_config") or {}).get("mpirun_hostfile"):
        found.append(
            f"distributed_type MULTI_CPU with {per_machine} processes per machine runs as ONE process "
            "(world size 1): accelerate launch starts MULTI_CPU through mpirun only, with "
            "mpirun_config.mpirun_hostfile set; for CPU processes on this machine use distributed_type: "
            "MULTI_GPU (the wizard's multi-GPU answer), which our scripts run on the CPU when there is no GPU, "
            "as accelerate_configs/cpu_2proc.yaml does"
        )
    wants_gpus = dtype in GPU_TYPES or (dtype == "NO" and raw.get("gpu_ids") not in (None, "", "all"))
    if wants_gpus and not raw.get("use_cpu"):
        if gpu_count is None:
            import torch

            gpu_count = torch.cuda.device_count()
        if gpu_count == 0 and dtype == "FSDP" and (raw.get("fsdp_config") or {}).get("fsdp_version") != 2:
            found.append(
                "FSDP version 1 needs GPUs and this machine has none; set fsdp_version: 2 in fsdp_config "
                "(our scripts run FSDP2 on CPU processes), as accelerate_configs/fsdp2_cpu_2proc.yaml does"
            )
        elif gpu_count == 0 and dtype not in ("MULTI_GPU", "NO", "FSDP"):
            found.append(
                f"distributed_type {dtype} needs GPUs and this machine has none (accelerate would run it "
                "as plain data parallel on the CPU); use accelerate_configs/cpu_2proc.yaml here"
            )
        elif gpu_count and gpu_count < per_machine:
            found.append(
                f"{per_machine} processes per machine but only {gpu_count} GPU(s) here; set num_processes "
                f"to {gpu_count * machines} (one per GPU on each machine)"
            )
    if not found:
        try:  # accelerate's own validation, for whatever is left
            from accelerate.commands.config.config_args import load_config_from_file

            load_config_from_file(path)
        except Exception as e:  # accelerate raises ValueError, KeyError or TypeError here
            found.append(f"accelerate rejects it: {' '.join(str(e).split())[:300]}")
    return found


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("config_file")
    parser.add_argument("--machine_rank", type=int, default=None, help="As you will pass it to accelerate launch.")
    args = parser.parse_args(argv)
    found = problems(args.config_file, args.machine_rank)
    for line in found:
        print(f"error: {args.config_file}: {line}", file=sys.stderr)
    if found:
        return 1
    print(f"ok: {args.config_file}: {summary(args.config_file)}")
    return 0


def summary(path, gpu_count=None):
    """What a config that passed problems() runs here, in words."""
    with open(path) as f:
        raw = yaml.safe_load(f)
    dtype = str(raw.get("distributed_type", "NO")).upper()
    processes, machines = int(raw.get("num_processes", 1) or 1), int(raw.get("num_machines", 1) or 1)
    text = f"{dtype}, {processes} process(es) on {machines} machine(s), " + (
        f"mixed_precision={raw['mixed_precision']}"
        if raw.get("mixed_precision") is not None
        else "mixed_precision unset (the script's --mixed_precision decides; auto: bf16 where native)"
    )
    if gpu_count is None:
        import torch

        gpu_count = torch.cuda.device_count()
    if dtype in ("MULTI_GPU", "NO", "FSDP") and (gpu_count == 0 or raw.get("use_cpu")):
        text += (
            f"; no GPU used here: our scripts run it as {processes // machines} CPU process(es) per machine"
            + (" (gloo)" if processes > 1 else "")
            + (", sharded with FSDP2" if dtype == "FSDP" else "")
        )
        if processes // machines > (os.cpu_count() or 1):
            text += f"; warning: more processes than the {os.cpu_count()} CPU cores here"
        if raw.get("mixed_precision") == "bf16":
            from train.core.accelerator import cpu_has_native_bf16

            native, what = cpu_has_native_bf16()
            if not native:
                text += f"; warning: bf16 is emulated on this CPU ({what}), 7-10x slower than mixed_precision: 'no'"
    return text


if __name__ == "__main__":
    sys.exit(main())
