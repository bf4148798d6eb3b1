#!/usr/bin/env bash
# Tear down the cluster scripts/slurm-up.sh started in STATE_DIR: cancel its jobs, stop slurmd,
# slurmctld and munged (by their pid files, never by name: other clusters may run here), wait
# until they are gone, and remove STATE_DIR. Safe to run twice or on a half-started cluster.
set -uo pipefail
STATE="${1:?usage: slurm-down.sh STATE_DIR}"
[ -d "$STATE" ] || exit 0
STATE="$(cd "$STATE" && pwd)"
if [ -e "$STATE/slurmctld.pid" ] && [ -e "$STATE/slurm.conf" ]; then
    export SLURM_CONF="$STATE/slurm.conf"
    timeout 10 scancel --full --quiet --user="$(id -un)" 2>/dev/null
    # slurmd ends the jobs' processes: it must outlive them, or they are left behind.
    for _ in $(seq 1 100); do
        [ -z "$(timeout 5 squeue -h -o %i 2>/dev/null)" ] && break
        sleep 0.2
    done
fi
stop() {  # pid file: TERM, then KILL after 10 s
    local pid
    [ -e "$1" ] || return 0
    pid="$(cat "$1")"
    [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null || return 0
    kill -TERM "$pid" 2>/dev/null
    for _ in $(seq 1 100); do kill -0 "$pid" 2>/dev/null || return 0; sleep 0.1; done
    kill -KILL "$pid" 2>/dev/null
}
stop "$STATE/slurmd.pid"
stop "$STATE/slurmctld.pid"
stop "$STATE/munged.pid"
rm -rf "$STATE"
