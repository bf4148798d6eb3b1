#!/usr/bin/env bash
# Bring up a private one-node Slurm cluster (munged, slurmctld, slurmd) whose every file lives
# in STATE_DIR, and wait until its node is idle. Prints `export SLURM_CONF=...`: srun, sbatch,
# scancel and squeue find the cluster through it. Tear it down with scripts/slurm-down.sh.
#
#   eval "$(scripts/slurm-up.sh /tmp/slurm)"; srun -n 2 --mpi=pmi2 hostname
#
# Private on purpose: munge's socket and key, the daemons' ports (free ones, picked here) and
# spool directories are STATE_DIR's, so a system Slurm or another engineer's test cluster on the
# same machine is never met. Needs root (slurmd starts jobs as their submitting user).
# CPUS (default 8) is what the node offers; SlurmdParameters=config_overrides lets a 2-core
# machine offer more, so that 4 ranks can share 2 cores (OverSubscribe=FORCE).
set -euo pipefail
STATE="${1:?usage: slurm-up.sh STATE_DIR}"
CPUS="${CPUS:-8}"
mkdir -p "$STATE"
STATE="$(cd "$STATE" && pwd)"
chmod 700 "$STATE"
for bin in munged slurmctld slurmd srun; do
    command -v "$bin" >/dev/null || { echo "slurm-up: $bin not found; run scripts/install-slurm.sh" >&2; exit 2; }
done
if [ -e "$STATE/slurmctld.pid" ]; then
    echo "slurm-up: $STATE already holds a cluster; run scripts/slurm-down.sh $STATE first" >&2
    exit 2
fi

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
CTLD_PORT="$(free_port)"; SLURMD_PORT="$(free_port)"
NODE="$(hostname -s)"
# MPICH's shared-memory segments appear to be keyed by the PMI job id (SLURM_JOB_ID.STEP): clusters that
# all start at job 1 (every test session's) would meet each other's segments, live or left in
# /dev/shm by a killed job, and MPI_Init hangs or mixes messages. A real cluster never reuses ids.
FIRST_JOB=$(( $(od -An -N4 -tu4 /dev/urandom) % 60000000 + 1000 ))

# munge: its own key and socket (--force: the temp dir's parents are not munge's to vet).
dd if=/dev/urandom of="$STATE/munge.key" bs=1024 count=1 status=none
chmod 400 "$STATE/munge.key"
munged --force --key-file="$STATE/munge.key" --socket="$STATE/munge.sock" \
    --pid-file="$STATE/munged.pid" --log-file="$STATE/munged.log" --seed-file="$STATE/munge.seed"

mkdir -p "$STATE/ctld" "$STATE/spool"
cat >"$STATE/slurm.conf" <<CONF
ClusterName=labavg
FirstJobId=$FIRST_JOB
SlurmctldHost=$NODE(127.0.0.1)
SlurmctldPort=$CTLD_PORT
SlurmdPort=$SLURMD_PORT
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$STATE/munge.sock
StateSaveLocation=$STATE/ctld
SlurmdSpoolDir=$STATE/spool
SlurmctldPidFile=$STATE/slurmctld.pid
SlurmdPidFile=$STATE/slurmd.pid
SlurmctldLogFile=$STATE/slurmctld.log
SlurmdLogFile=$STATE/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
ReturnToService=2
MpiDefault=none
KillWait=5
InactiveLimit=0
MinJobAge=30
NodeName=$NODE NodeAddr=127.0.0.1 CPUs=$CPUS State=UNKNOWN
PartitionName=debug Nodes=$NODE Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4
CONF

export SLURM_CONF="$STATE/slurm.conf"
slurmctld -i -f "$SLURM_CONF"
slurmd -f "$SLURM_CONF"
for _ in $(seq 1 150); do
    state="$(sinfo -h -N -o '%t' 2>/dev/null | head -1 || true)"
    [ "$state" = "idle" ] && { echo "export SLURM_CONF=$SLURM_CONF"; exit 0; }
    sleep 0.2
done
echo "slurm-up: node $NODE not idle after 30 s (state '${state:-none}'); see $STATE/*.log" >&2
exit 1
