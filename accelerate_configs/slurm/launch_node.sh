#!/bin/bash
# Run by srun on every node of a SLURM job: derive this node's accelerate launch command from SLURM's
# variables and run it. DRY_RUN=1 prints the command instead (the tests use that).
#   SLURM_JOB_NODELIST  -> head node (first host): main_process_ip
#   SLURM_JOB_ID        -> main_process_port, 20000 + job id mod 20000, so jobs sharing a head node differ
#   SLURM_NNODES        -> num_machines;  SLURM_NODEID -> machine_rank
#   GPUS_PER_NODE, else SLURM_GPUS_ON_NODE, else nvidia-smi's count -> processes per node
# ACCELERATE_CONFIG picks the base config (default: the static 2-node template); its per-node keys
# are all overridden here.
set -euo pipefail
: "${SLURM_JOB_NODELIST:?not inside a SLURM job (SLURM_JOB_NODELIST is unset)}"
: "${SLURM_NNODES:?SLURM_NNODES is unset}"
: "${SLURM_NODEID:?SLURM_NODEID is unset: start this with srun, one task per node}"
# Not `| head -n 1`: head exits after one line, scontrol dies of SIGPIPE writing the rest, and
# pipefail turns that into exit 141 at random (always, for a long node list).
hosts=$(scontrol show hostnames "$SLURM_JOB_NODELIST")
head_node=${hosts%%$'\n'*}
# Count "GPU n:" lines only: without devices nvidia-smi prints "No devices were found", and MIG
# slices add indented lines. `|| true`: a failing nvidia-smi (no driver) or grep (no match) would
# otherwise end the script under pipefail, before the clear error below.
gpus_per_node=${GPUS_PER_NODE:-${SLURM_GPUS_ON_NODE:-$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ' || true)}}
gpus_per_node=${gpus_per_node%%(*}  # SLURM may write e.g. "8(x2)"
if [ "${gpus_per_node:-0}" -lt 1 ]; then
  echo "error: no GPUs found on $(hostname); set GPUS_PER_NODE or request --gpus-per-node" >&2
  exit 1
fi
port=$((20000 + ${SLURM_JOB_ID:-0} % 20000))
cmd=(accelerate launch
  --config_file "${ACCELERATE_CONFIG:-accelerate_configs/2node_8gpu.yaml}"
  --num_machines "$SLURM_NNODES"
  --num_processes "$((SLURM_NNODES * gpus_per_node))"
  --machine_rank "$SLURM_NODEID"
  --main_process_ip "$head_node"
  --main_process_port "$port"
  "$@")
if [ "${DRY_RUN:-0}" = 1 ]; then
  printf '%q ' "${cmd[@]}"; echo
else
  exec "${cmd[@]}"
fi
