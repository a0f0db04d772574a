#!/usr/bin/env bash
# A single-node SLURM cluster for tests: Debian's slurm-wlm and munge, run as root, all state under
# one directory. Used by tests/test_multiprocess.py's sbatch test (which skips, saying why, where it
# cannot start).
#
#   scripts/slurm_cluster.sh install        # apt-get install slurm-wlm munge (root, Debian/Ubuntu)
#   scripts/slurm_cluster.sh start DIR      # munged + slurmctld + slurmd; prints SLURM_CONF=DIR/slurm.conf
#   scripts/slurm_cluster.sh stop DIR
#
# Clients (sbatch, srun, squeue, scontrol) need SLURM_CONF=DIR/slurm.conf in their environment.
set -euo pipefail

install() {
    if command -v slurmctld >/dev/null && command -v munged >/dev/null; then return 0; fi
    if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
        echo "slurm_cluster: slurm-wlm is not installed and this is not root on a Debian-like system" >&2
        return 1
    fi
    local get="apt-get install -y -q --no-install-recommends slurm-wlm munge"
    # without package lists (a fresh image) the install fails at once: fetch them, then try again
    DEBIAN_FRONTEND=noninteractive $get >/dev/null 2>&1 || {
        timeout 300 apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive timeout 300 $get >/dev/null
    }
}

free_port() { python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }

start() {
    local dir=$1
    if [ "$(id -u)" != 0 ]; then echo "slurm_cluster: needs root (daemons run as root here)" >&2; return 1; fi
    command -v slurmctld >/dev/null || { echo "slurm_cluster: slurm-wlm is not installed (run: $0 install)" >&2; return 1; }
    trap 'stop "$dir"' ERR  # a start that fails leaves no daemon behind
    mkdir -p "$dir"/{munge,state,spool,log}
    chmod 700 "$dir/munge"
    dd if=/dev/urandom of="$dir/munge/munge.key" bs=1024 count=1 status=none
    chmod 400 "$dir/munge/munge.key"
    munged --force --key-file="$dir/munge/munge.key" --socket="$dir/munge/munge.sock" \
        --pid-file="$dir/munge/munged.pid" --log-file="$dir/log/munged.log" --seed-file="$dir/munge/seed"
    local host cpus mem
    host=$(hostname)
    cpus=$(nproc)
    mem=$(($(awk '/MemTotal/ {print $2}' /proc/meminfo) / 1024 / 2))
    cat >"$dir/slurm.conf" <<CONF
ClusterName=meshlm
SlurmctldHost=$host
SlurmUser=root
SlurmdUser=root
SlurmctldPort=$(free_port)
SlurmdPort=$(free_port)
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$dir/munge/munge.sock
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd.pid
SlurmctldLogFile=$dir/log/slurmctld.log
SlurmdLogFile=$dir/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
JobRequeue=1
KillWait=60
NodeName=$host CPUs=$cpus RealMemory=$mem State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
CONF
    export SLURM_CONF=$dir/slurm.conf
    slurmctld -f "$SLURM_CONF"
    slurmd -f "$SLURM_CONF"
    for _ in $(seq 1 60); do
        if sinfo -h -o %T 2>/dev/null | grep -q idle; then
            trap - ERR
            echo "SLURM_CONF=$SLURM_CONF"
            return 0
        fi
        sleep 0.5
    done
    echo "slurm_cluster: the node did not become idle within 30 s; logs in $dir/log" >&2
    sinfo >&2 || true
    stop "$dir"
    return 1
}

stop() {
    # jobs first (their steps and training processes), then the daemons; waits until they are gone
    local dir=$1 pids=()
    if [ -f "$dir/slurm.conf" ]; then
        SLURM_CONF=$dir/slurm.conf scancel --full --signal=KILL --user=root 2>/dev/null || true
        sleep 1
    fi
    for pid in "$dir/slurmd.pid" "$dir/slurmctld.pid" "$dir/munge/munged.pid"; do
        if [ -f "$pid" ]; then
            pids+=("$(cat "$pid")")
            kill "${pids[-1]}" 2>/dev/null || true
        fi
    done
    for _ in $(seq 1 50); do
        local alive=0
        for p in "${pids[@]}"; do kill -0 "$p" 2>/dev/null && alive=1; done
        [ "$alive" = 0 ] && return 0
        sleep 0.2
    done
    for p in "${pids[@]}"; do kill -9 "$p" 2>/dev/null || true; done
}

case "${1:-}" in
    install) install ;;
    start) start "${2:?usage: $0 start DIR}" ;;
    stop) stop "${2:?usage: $0 stop DIR}" ;;
    *) echo "usage: $0 install | start DIR | stop DIR" >&2; exit 2 ;;
esac
