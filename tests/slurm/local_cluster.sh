#!/usr/bin/env bash
# A real two-node Slurm cluster on this one machine, for the launch-script tests (Debian's slurm-wlm 22.05).
#   tests/slurm/local_cluster.sh start DIR   # installs the packages if missing, starts munged, slurmctld, 2 slurmd
#   tests/slurm/local_cluster.sh stop DIR    # stops every daemon it started and any job process left behind
# Clients need SLURM_CONF=DIR/slurm.conf. No systemd: munged gets its own socket (AuthInfo=socket=...).
set -euo pipefail
cmd=${1:?start|stop}
dir=$(realpath -m "${2:?state directory}")

stop() {
  for f in "$dir"/*.pid; do
    [[ -f $f ]] || continue
    kill "$(cat "$f")" 2>/dev/null || true
  done
  sleep 1
  for f in "$dir"/*.pid; do
    [[ -f $f ]] || continue
    kill -9 "$(cat "$f")" 2>/dev/null || true
    rm -f "$f"
  done
  # linuxproc tracking: processes orphaned by a killed job outlive it; nothing of ours may survive the cluster
  pkill -9 -f "slurmstepd" 2>/dev/null || true
  pkill -9 -f "dsgrpo.train" 2>/dev/null || true
}

if [[ $cmd == stop ]]; then
  stop
  exit 0
fi

if ! command -v slurmctld >/dev/null || ! command -v munged >/dev/null; then
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends slurmctld slurmd slurm-client munge >/dev/null
fi

mkdir -p "$dir"/state "$dir"/spool/node1 "$dir"/spool/node2 "$dir"/munge
host=$(hostname -s)
grep -qE '^127\.0\.0\.1\s.*\bnode1\b' /etc/hosts || echo "127.0.0.1 node1 node2" >> /etc/hosts

# munge: its own key, socket and files
[[ -f $dir/munge/munge.key ]] || { dd if=/dev/urandom of="$dir/munge/munge.key" bs=1024 count=1 status=none; chmod 400 "$dir/munge/munge.key"; }
munged --force --socket="$dir/munge/munge.socket" --key-file="$dir/munge/munge.key" \
  --pid-file="$dir/munged.pid" --log-file="$dir/munge/munged.log" --seed-file="$dir/munge/munged.seed"

cpus=$(nproc)
cat > "$dir/slurm.conf" <<CONF
ClusterName=dsgrpo-test
SlurmctldHost=$host(127.0.0.1)
SlurmctldPort=16817
AuthType=auth/munge
AuthInfo=socket=$dir/munge/munge.socket
CredType=cred/munge
SlurmUser=root
SlurmdUser=root
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
ReturnToService=2
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool/%n
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd-%n.pid
SlurmctldLogFile=$dir/slurmctld.log
SlurmdLogFile=$dir/slurmd-%n.log
SlurmctldTimeout=30
SlurmdTimeout=30
KillWait=5
NodeName=node[1-2] NodeHostname=$host NodeAddr=127.0.0.1 Port=[17001-17002] CPUs=$cpus RealMemory=4000 State=UNKNOWN
PartitionName=debug Nodes=node[1-2] Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4
CONF
export SLURM_CONF=$dir/slurm.conf
slurmctld -f "$SLURM_CONF" -c   # -c: a clean start, no state from an earlier cluster
for n in node1 node2; do slurmd -f "$SLURM_CONF" -N "$n"; done
for _ in $(seq 1 60); do
  if [[ $(sinfo -h -o '%t' 2>/dev/null | grep -cE '^(idle|mix)') -ge 1 ]] && \
     [[ $(sinfo -h -N -o '%N %t' 2>/dev/null | grep -cE 'idle|mix') -eq 2 ]]; then
    echo "slurm up: $(sinfo -h -N -o '%N %t' | tr '\n' ' ')"
    exit 0
  fi
  sleep 0.5
done
echo "slurm did not come up; logs in $dir" >&2
sinfo -N >&2 || true
exit 1
