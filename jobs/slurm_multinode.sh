#!/bin/bash
# Extraction under SLURM: one `accelerate launch` per node, each starting that node's processes
# (one per GPU, or CPU processes on a CPU-only partition; a job of one process runs extract without a
# launcher). The store (--out) must be on a filesystem every node sees. Arguments are extract's flags:
#
#   sbatch jobs/slurm_multinode.sh --model resnet50 --layers layer3 layer4 \
#       --data imagefolder:/data/imagenet/train --out /shared/features/train.zarr
#
# Adapt it with sbatch flags, which override the #SBATCH lines below (sbatch --nodes=2 --time=2:00:00 ...):
# - GPUs: --gpus-per-node=G starts G processes per node, one per GPU (GPUS_PER_NODE=G in the
#   environment overrides what SLURM allocated, e.g. where SLURM does not export it).
# - CPU-only partitions: --gpus-per-node=0 (or GPUS_PER_NODE=0) starts one process per CPU of
#   --cpus-per-task (one per node without it); PROCESSES_PER_NODE=P sets P instead, each process
#   getting cpus-per-task / P threads. Try it on this machine first: docs/distributed.md, "SLURM".
# - Time limit: --time. SIGTERM reaches every process of the job's steps --signal's lead time (120 s
#   here) before the limit; each process finishes its current batch, writes and marks done the chunks
#   it completed, and exits 143 (under a launcher a rank also gets the launcher's copy of the signal,
#   and a second signal stops it at once: complete chunks stay marked done, the batch in flight is
#   redone by the next run). Make the lead time exceed one batch plus writing a chunk per layer,
#   with a margin: SLURM checks limits every 30 s and may signal up to 60 s early. Past the limit
#   SLURM sends SIGTERM then, KillWait seconds later (a cluster setting, often 30 s), SIGKILL.
#   Keep the signal on the steps: `B:TERM@...` would signal only this shell, not the extraction.
# - Preemption and resuming: `scancel -s TERM JOBID` stops the job like the time signal (plain
#   `scancel` also sends SIGTERM first). `scontrol requeue JOBID` (allowed by --requeue, which also
#   lets SLURM requeue after a node failure) or submitting the same command again resumes: chunks
#   marked done are kept, and the summary line counts them as reused.
# - MAIN_PORT: the rendezvous port on the first node (default derived from the job id, so jobs sharing
#   a node do not collide). EXTRACT_SLURM_DRY_RUN=1 prints each node's launcher command and exits,
#   given SLURM_JOB_NODELIST (and SLURM_CPUS_PER_TASK, GPUS_PER_NODE...) in the environment.
#
#SBATCH --job-name=extract
#SBATCH --nodes=4
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=64
#SBATCH --time=12:00:00
#SBATCH --requeue
#SBATCH --signal=TERM@120
set -euo pipefail

# Processes per node: one per GPU (SLURM_GPUS_PER_NODE may name a type, as in a100:8); without GPUs,
# one per CPU of the task.
gpus=${GPUS_PER_NODE:-${SLURM_GPUS_ON_NODE:-${SLURM_GPUS_PER_NODE:-0}}}
gpus=${gpus##*:}
if ((gpus > 0)); then per_node=$gpus; else per_node=${SLURM_CPUS_PER_TASK:-1}; fi
per_node=${PROCESSES_PER_NODE:-$per_node}

nodes=$(scontrol show hostnames "$SLURM_JOB_NODELIST")
num_nodes=$(wc -l <<<"$nodes")
main_node=$(head -n 1 <<<"$nodes")
main_port=${MAIN_PORT:-$((20000 + ${SLURM_JOB_ID:-0} % 20000))}
total=$((num_nodes * per_node))

if ((total == 1)); then
    # One process: extract itself, with no launcher. accelerate's single-process launcher dies at
    # SIGTERM; SLURM then ends the step, signalling extract a second time, which stops it at once
    # instead of after its batch (measured: "interrupted;" instead of "interrupted by SIGTERM: N chunks").
    command=(python -m extract "$@")
else
    # --multi_gpu on CPU nodes too: accelerate then starts real processes on gloo (--cpu starts one).
    command=(accelerate launch --multi_gpu --num_processes "$total" --num_machines "$num_nodes"
        --machine_rank @NODEID@ --main_process_ip "$main_node" --main_process_port "$main_port"
        --mixed_precision no --dynamo_backend no)
    # Threads per process from the CPUs SLURM gave the task (accelerate would divide the whole machine's).
    if ((${SLURM_CPUS_PER_TASK:-0} >= per_node)); then
        command+=(--num_cpu_threads_per_process $((SLURM_CPUS_PER_TASK / per_node)))
    fi
    command+=(-m extract "$@")
fi

# What runs on each node: the command, its SLURM_NODEID (set there by srun) in place of @NODEID@.
on_node='args=(); for a; do [[ $a == @NODEID@ ]] && a=$SLURM_NODEID; args+=("$a"); done; exec "${args[@]}"'

if [[ -n ${EXTRACT_SLURM_DRY_RUN:-} ]]; then
    rank=0
    for node in $nodes; do
        printf 'node %s %s:' "$rank" "$node"
        SLURM_NODEID=$rank bash -c "$on_node" node printf ' %q' "${command[@]}"
        echo
        rank=$((rank + 1))
    done
    exit 0
fi

echo "extract: $num_nodes node(s) x $per_node process(es), main node $main_node:$main_port"
srun --kill-on-bad-exit=1 --nodes="$num_nodes" --ntasks="$num_nodes" bash -c "$on_node" node "${command[@]}"
