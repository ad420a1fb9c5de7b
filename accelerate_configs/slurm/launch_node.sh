#!/bin/bash
# Run by srun on every node of a SLURM job: derive this node's accelerate launch command from SLURM's
# variables and run it. DRY_RUN=1 prints the command instead (the tests use that).
#   SLURM_JOB_NODELIST  -> head node (first host): main_process_ip
#   SLURM_JOB_ID        -> main_process_port, 20000 + job id mod 20000, so jobs sharing a head node differ
#   SLURM_NNODES        -> num_machines;  SLURM_NODEID -> machine_rank
#   GPUS_PER_NODE, else SLURM_GPUS_ON_NODE, else nvidia-smi's count -> processes per node
#   PROCESSES_PER_NODE=N -> N processes per node whatever the GPUs; on a node without GPUs they run
#     on its CPU (the scripts pick the CPU when there is no GPU; not `--cpu`, which makes accelerate
#     start one process): `sbatch --gpus-per-node 0 --cpus-per-task 2
#     --export=ALL,PROCESSES_PER_NODE=2 ...`. GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME, exported before
#     sbatch, pick the network interface when a node has several (sbatch passes the environment on).
#   MIN_NODES=K -> elastic: torchrun --nnodes K:SLURM_NNODES (c10d), the job goes on with the nodes left
# ACCELERATE_CONFIG picks the base config (default: the static 2-node template); its per-node keys
# are all overridden here. The launcher runs through train/core/launch.py: the SIGTERM of a stop
# reaches it too, and the job's log then shows the ranks' lines, not torch elastic's traceback.
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
processes_per_node=${PROCESSES_PER_NODE:-$gpus_per_node}
if [ "${processes_per_node:-0}" -lt 1 ]; then
  echo "error: no GPUs found on $(hostname); set GPUS_PER_NODE or request --gpus-per-node (or PROCESSES_PER_NODE=N for N CPU processes)" >&2
  exit 1
fi
port=$((20000 + ${SLURM_JOB_ID:-0} % 20000))
if [ -n "${MIN_NODES:-}" ]; then
  # elastic: torchrun's c10d rendezvous, hosted by the head node's agent. When a node is lost the
  # agents left restart their workers (up to MAX_RESTARTS times) in a new round of MIN_NODES or more
  # nodes; pass --resume_from_checkpoint latest (and --global_batch_size) so they go on from the
  # newest checkpoint at the same global batch. accelerate launch has no node range, hence torchrun.
  cmd=(python -m train.core.launch torchrun
    --nnodes "$MIN_NODES:$SLURM_NNODES"
    --nproc_per_node "$processes_per_node"
    --rdzv_backend c10d
    --rdzv_endpoint "$head_node:$port"
    --rdzv_id "${SLURM_JOB_ID:-0}"
    --max_restarts "${MAX_RESTARTS:-3}"
    "$@")
else
  cmd=(python -m train.core.launch accelerate launch
    --config_file "${ACCELERATE_CONFIG:-accelerate_configs/2node_8gpu.yaml}"
    --num_machines "$SLURM_NNODES"
    --num_processes "$((SLURM_NNODES * processes_per_node))"
    --machine_rank "$SLURM_NODEID"
    --main_process_ip "$head_node"
    --main_process_port "$port"
    "$@")
fi
if [ "${DRY_RUN:-0}" = 1 ]; then
  printf '%q ' "${cmd[@]}"; echo
else
  exec "${cmd[@]}"
fi
