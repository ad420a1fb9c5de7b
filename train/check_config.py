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
import sys

import yaml

SECTIONS = ("fsdp_config", "deepspeed_config", "megatron_lm_config", "dynamo_config", "fp8_config",
            "parallelism_config", "mpirun_config")
GPU_TYPES = ("MULTI_GPU", "FSDP", "DEEPSPEED", "MEGATRON_LM")


def known_keys():
    from accelerate.commands.config.config_args import ClusterConfig

    return {f.name for f in dataclasses.fields(ClusterConfig)}


def problems(path, machine_rank=None, gpu_count=None):
    """Every problem with the config at `path` on this machine, as one-line strings."""
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
            found.append(f"{key} is the boolean False: YAML reads an unquoted NO as False; write {key}: 'NO'"
                         if key == "distributed_type" else
                         f"{key} is the boolean False: YAML reads an unquoted no as False; write {key}: 'no'")
    allowed = known_keys()
    for key in raw:
        if key not in allowed:
            close = difflib.get_close_matches(key, allowed, n=1)
            found.append(f"unknown key {key!r}" + (f"; did you mean {close[0]!r}?" if close else
                                                   "; accelerate rejects unknown keys, remove it"))
    if found:
        return found

    dtype = str(raw.get("distributed_type", "NO")).upper()
    machines = int(raw.get("num_machines", 1) or 1)
    processes = int(raw.get("num_processes", 1) or 1)
    rank = machine_rank if machine_rank is not None else raw.get("machine_rank")
    if machines > 1:
        if not raw.get("main_process_ip"):
            found.append(f"num_machines is {machines} but main_process_ip is not set; set it to node 0's address, "
                         "reachable from every node")
        if rank is None:
            found.append("num_machines > 1 but machine_rank is not set; 0 on the main node, 1.. on the others "
                         "(or pass --machine_rank to accelerate launch)")
        elif not 0 <= int(rank) < machines:
            found.append(f"machine_rank {rank} is outside 0..{machines - 1}")
        if processes % machines:
            found.append(f"num_processes {processes} is not divisible by num_machines {machines}; num_processes is "
                         "the total over all machines")
        if not raw.get("main_process_port"):
            found.append("main_process_port is unset or 0 on a multi-node config; auto-picking a port only works on "
                         "one node, set a fixed free port such as 29500")
    if raw.get("rdzv_backend") == "c10d" and raw.get("same_network") is True:
        found.append("rdzv_backend is c10d but same_network is true: accelerate then passes a static master "
                     "address and c10d is not used; set same_network: false")
    if dtype == "FSDP":
        fsdp = raw.get("fsdp_config") or {}
        if fsdp.get("fsdp_version") == 2 and not isinstance(fsdp.get("fsdp_reshard_after_forward", True), bool):
            found.append("fsdp_reshard_after_forward must be true or false with fsdp_version: 2 (FSDP1's "
                         f"{fsdp.get('fsdp_reshard_after_forward')!r} is not accepted)")
    wants_gpus = dtype in GPU_TYPES or (dtype == "NO" and raw.get("gpu_ids") not in (None, "", "all"))
    if wants_gpus and not raw.get("use_cpu"):
        if gpu_count is None:
            import torch
            gpu_count = torch.cuda.device_count()
        per_machine = processes // machines
        if gpu_count == 0:
            found.append(f"this config is for GPUs ({dtype}, use_cpu: false) but this machine has none; use "
                         "accelerate_configs/cpu.yaml or cpu_2proc.yaml here")
        elif gpu_count < per_machine:
            found.append(f"{per_machine} processes per machine but only {gpu_count} GPU(s) here; set num_processes "
                         f"to {gpu_count * machines} (one per GPU on each machine)")
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
    with open(args.config_file) as f:
        raw = yaml.safe_load(f)
    print(f"ok: {args.config_file}: {raw.get('distributed_type')}, {raw.get('num_processes', 1)} process(es) on "
          f"{raw.get('num_machines', 1)} machine(s), mixed_precision={raw.get('mixed_precision', 'no')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
