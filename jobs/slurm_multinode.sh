#!/bin/bash
# Multi-node extraction: one `accelerate launch` per node, GPUS_PER_NODE processes each.
# The store (--out) must be on a filesystem every node sees. Resubmitting the same script after a
# preemption resumes: chunks already marked done are skipped.
#
#   sbatch jobs/slurm_multinode.sh --model resnet50 --layers layer3 layer4 \
#       --data imagefolder:/data/imagenet/train --out /shared/features/train.zarr
#
#SBATCH --job-name=extract
#SBATCH --nodes=4
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=64
#SBATCH --time=12:00:00
#SBATCH --requeue
#SBATCH --signal=TERM@120   # to every task: each rank writes its finished chunks and exits; a requeue resumes
set -euo pipefail

GPUS_PER_NODE=${GPUS_PER_NODE:-8}
MAIN_NODE=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
MAIN_PORT=${MAIN_PORT:-29500}
EXTRACT_ARGS=$(printf ' %q' "$@")

# srun starts one launcher per node; each learns its machine rank from SLURM_NODEID.
srun --kill-on-bad-exit=1 bash -c "accelerate launch \
    --multi_gpu \
    --num_machines $SLURM_NNODES \
    --num_processes $((SLURM_NNODES * GPUS_PER_NODE)) \
    --machine_rank \$SLURM_NODEID \
    --main_process_ip $MAIN_NODE \
    --main_process_port $MAIN_PORT \
    --mixed_precision no --dynamo_backend no \
    -m extract $EXTRACT_ARGS"
