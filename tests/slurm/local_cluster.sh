#!/usr/bin/env bash
# A one-node SLURM cluster on this machine (loopback only), to try jobs/slurm_multinode.sh before
# taking it to a real cluster, and for the tests marked `slurm`.
#
#   tests/slurm/local_cluster.sh start [DIR]    # write DIR/slurm.conf, start munged, slurmctld, slurmd
#   export SLURM_CONF=DIR/slurm.conf             # what `start` prints: sbatch, squeue, scancel use it
#   tests/slurm/local_cluster.sh stop [DIR]     # cancel its jobs, stop exactly the daemons it started
#   tests/slurm/local_cluster.sh status [DIR]   # which of its daemons run (exit 1 unless all three)
#   tests/slurm/local_cluster.sh config [DIR]   # only write DIR/slurm.conf (enough for `scontrol show hostnames`)
#
# Needs Debian/Ubuntu's `slurm-wlm` and `munge` (apt-get install slurm-wlm munge) and root: slurmd
# starts jobs as the user who submitted them. Nothing outside DIR is touched: the daemons use their own
# munge key and socket, state, logs and pid files under DIR (default /tmp/extract-slurm) and ports
# $SLURMCTLD_PORT / $SLURMD_PORT (default 16817 / 16818, away from a real cluster's 6817 / 6818), so a
# system munged or slurmd keeps running undisturbed. `start` is idempotent: daemons already running
# from DIR are left alone. The node has this machine's CPUs (`nproc`) and 90% of its memory, and one
# partition, `local`; a job's processes are tracked by their parent (proctrack/linuxproc), no cgroups.
set -euo pipefail

command=${1:-}
dir=${2:-${EXTRACT_SLURM_DIR:-/tmp/extract-slurm}}
ctld_port=${SLURMCTLD_PORT:-16817}
slurmd_port=${SLURMD_PORT:-16818}
node=$(hostname -s)
conf=$dir/slurm.conf
socket=$dir/munge/munge.socket

die() {
    echo "local_cluster.sh: $*" >&2
    exit 1
}

# The pid in DIR/NAME.pid if that process is alive and was started from DIR (a recycled pid is not ours).
ours() {
    local pid
    pid=$(cat "$dir/$1.pid" 2>/dev/null) || return 1
    [[ $pid =~ ^[0-9]+$ ]] && tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null | grep -qF -- "$dir/" || return 1
    echo "$pid"
}

write_config() {
    mkdir -p "$dir"/{munge,ctld,spool,log}
    chmod 755 "$dir" "$dir/munge" # users other than root reach munged's socket; the key stays 0600
    local memory_mib
    memory_mib=$(awk '/^MemTotal:/ {print int($2 / 1024 * 0.9)}' /proc/meminfo)
    cat >"$conf.new" <<EOF
# Written by tests/slurm/local_cluster.sh: one node on loopback, for trying jobs locally.
ClusterName=extract-local
SlurmctldHost=$node(127.0.0.1)
SlurmctldPort=$ctld_port
SlurmdPort=$slurmd_port
SlurmUser=$(id -un)
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$socket
StateSaveLocation=$dir/ctld
SlurmdSpoolDir=$dir/spool
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd.pid
SlurmctldLogFile=$dir/log/slurmctld.log
SlurmdLogFile=$dir/log/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
SwitchType=switch/none
MpiDefault=none
JobCompType=jobcomp/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
ReturnToService=2
# The node is what this file says: the CPUs this process may use (nproc, which OMP_NUM_THREADS would lower).
SlurmdParameters=config_overrides
NodeName=$node NodeAddr=127.0.0.1 NodeHostname=$node CPUs=$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc) RealMemory=$memory_mib State=UNKNOWN
PartitionName=local Nodes=$node Default=YES MaxTime=INFINITE State=UP
EOF
    mv "$conf.new" "$conf"
}

start() {
    command -v munged >/dev/null && command -v slurmctld >/dev/null && command -v slurmd >/dev/null ||
        die "munged, slurmctld and slurmd are needed: apt-get install slurm-wlm munge"
    [[ $(id -u) == 0 ]] || die "run as root (slurmd starts jobs as the user who submitted them)"
    if ! ours slurmctld >/dev/null; then
        write_config # a running controller keeps the configuration it started with
    fi
    if ! ours munged >/dev/null; then
        [[ -s $dir/munge/munge.key ]] || (umask 077 && head -c 1024 /dev/urandom >"$dir/munge/munge.key")
        munged --socket="$socket" --key-file="$dir/munge/munge.key" --pid-file="$dir/munged.pid" \
            --log-file="$dir/log/munged.log" --seed-file="$dir/munge/munged.seed" --force
    fi
    ours slurmctld >/dev/null || slurmctld -f "$conf"
    ours slurmd >/dev/null || slurmd -f "$conf" -N "$node"
    # Ready once the node has registered with the controller and can take jobs.
    local state=""
    for _ in $(seq 100); do
        state=$(SLURM_CONF=$conf sinfo -h -n "$node" -o %T 2>/dev/null || true)
        [[ $state == idle || $state == mixed || $state == allocated ]] && break
        sleep 0.2
    done
    [[ $state == idle || $state == mixed || $state == allocated ]] ||
        die "the node did not come up (state '${state:-unknown}'); see $dir/log/"
    echo "export SLURM_CONF=$conf"
}

stop() {
    local pid name alive
    if ours slurmctld >/dev/null; then
        # Jobs first, while slurmd can still end their steps (it leaves them running if it goes first).
        SLURM_CONF=$conf scancel --full --quiet --state=PENDING,RUNNING,SUSPENDED --user="$(id -un)" 2>/dev/null || true
        for _ in $(seq 50); do
            [[ -z $(SLURM_CONF=$conf squeue -h -o %i 2>/dev/null) ]] && break
            sleep 0.2
        done
    fi
    local pids=()
    for name in slurmd slurmctld munged; do
        pid=$(ours "$name") && kill "$pid" && pids+=("$pid")
    done
    for _ in $(seq 100); do # up to 10 s for a clean exit (slurmctld saves its state)
        alive=0
        for pid in "${pids[@]}"; do kill -0 "$pid" 2>/dev/null && alive=1; done
        ((alive)) || break
        sleep 0.1
    done
    for pid in "${pids[@]}"; do kill -0 "$pid" 2>/dev/null && kill -KILL "$pid"; done
    rm -f "$dir"/{slurmd,slurmctld,munged}.pid
    return 0
}

status() {
    local name missing=0
    for name in munged slurmctld slurmd; do
        if pid=$(ours "$name"); then echo "$name: running (pid $pid)"; else echo "$name: stopped" && missing=1; fi
    done
    return $missing
}

case $command in
start) start ;;
stop) stop ;;
status) status ;;
config) write_config && echo "export SLURM_CONF=$conf" ;;
*) die "usage: $0 start|stop|status|config [DIR]" ;;
esac
