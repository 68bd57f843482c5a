#!/usr/bin/env bash
# A real Slurm cluster on the test hosts of scripts/hosts.sh: munged and slurmctld on
# refdl-h1, slurmd on every host, from Debian's packages (installed with apt-get when
# missing). Its files live in /run/refdl-hosts/slurm; inside the hosts /etc/slurm is
# /etc/netns/HOST/slurm (bound there by hosts.sh's agent), so srun and sbatch work there
# with no flags, and the machine's own /etc/slurm and munge are left alone. Needs root.
#
#   bash scripts/slurm_hosts.sh up 2      # hosts refdl-h1..2 (made if not up) + Slurm
#   bash scripts/hosts.sh agent refdl-h1 srun -N 2 --ntasks-per-node 2 hostname
#   bash scripts/slurm_hosts.sh down      # stop Slurm and munge (the hosts stay up)
#
# srun's default MPI plugin is PMIx (MpiDefault=pmix), so an srun task is an MPI rank of
# the job, as under mpirun.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
HOSTS="$here/hosts.sh"
STATE="/run/refdl-hosts/slurm"
MUNGE="/run/refdl-hosts/munge"
SUBNET="10.213.0"

die() { echo "slurm_hosts.sh: $*" >&2; exit 2; }
[ "$(id -u)" = 0 ] || die "needs root"
hosts() { ip netns list 2>/dev/null | awk '{print $1}' | grep -E '^refdl-h[0-9]+$' | sort -V || true; }
on() { local h="$1"; shift; bash "$HOSTS" agent "$h" "$@"; }

# Slurm's PMIx plugin opens the unversioned libpmix.so, which only libpmix-dev ships.
PACKAGES="slurm-wlm munge libpmix-dev"
install() {
  command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v munged >/dev/null &&
    dpkg -s libpmix-dev >/dev/null 2>&1 && return 0
  echo "slurm_hosts.sh: installing Debian's $PACKAGES" >&2
  export DEBIAN_FRONTEND=noninteractive
  # shellcheck disable=SC2086
  apt-get install -y -q $PACKAGES >/dev/null ||
    { apt-get update -q >/dev/null && apt-get install -y -q $PACKAGES >/dev/null; }
}

conf() {  # conf N: slurm.conf for hosts 1..N
  local n="$1"
  cat <<EOF
ClusterName=refdl
SlurmctldHost=refdl-h1($SUBNET.11)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket=$MUNGE/munge.socket
CredType=cred/munge
MpiDefault=pmix
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
ReturnToService=2
SlurmctldPidFile=$STATE/slurmctld.pid
SlurmctldLogFile=$STATE/slurmctld.log
StateSaveLocation=$STATE/ctld
SlurmdPidFile=$STATE/slurmd-%n.pid
SlurmdLogFile=$STATE/slurmd-%n.log
SlurmdSpoolDir=$STATE/slurmd-%n
SlurmctldPort=6817
SlurmdPort=6818
InactiveLimit=0
KillWait=5
MinJobAge=60
EOF
  for i in $(seq 1 "$n"); do
    echo "NodeName=refdl-h$i NodeAddr=$SUBNET.$((10 + i)) CPUs=8 State=UNKNOWN"
  done
  echo "PartitionName=test Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES"
}

up() {
  local n="${1:-}"
  [[ "$n" =~ ^[0-9]+$ ]] && [ "$n" -ge 1 ] || die "up takes a host count (got '${n}')"
  install
  [ -n "$(hosts)" ] || bash "$HOSTS" up "$n"
  [ "$(hosts | wc -l)" = "$n" ] || die "$(hosts | wc -l) test hosts are up, not $n; run: bash scripts/hosts.sh down"
  [ ! -e "$STATE/slurmctld.pid" ] || die "Slurm is already up; run: bash scripts/slurm_hosts.sh down"
  mkdir -p "$STATE/ctld" "$MUNGE"
  chmod 755 "$MUNGE"
  head -c 1024 /dev/urandom > "$MUNGE/munge.key"
  chmod 400 "$MUNGE/munge.key"
  for h in $(hosts); do
    mkdir -p "/etc/netns/$h/slurm" "$STATE/slurmd-$h" "$STATE/pmix-$h"
    conf "$n" > "/etc/netns/$h/slurm/slurm.conf"
    # the hosts share /tmp: each slurmd's PMIx client folders go apart
    echo "PMIxCliTmpDirBase=$STATE/pmix-$h" > "/etc/netns/$h/slurm/mpi.conf"
  done
  on refdl-h1 munged --force --socket="$MUNGE/munge.socket" --key-file="$MUNGE/munge.key" \
    --pid-file="$MUNGE/munged.pid" --log-file="$MUNGE/munged.log" --seed-file="$MUNGE/seed"
  on refdl-h1 slurmctld
  for h in $(hosts); do on "$h" slurmd; done
  local ready=""
  for _ in $(seq 1 60); do  # the nodes register with slurmctld
    if on refdl-h1 sinfo -h -o %T 2>/dev/null | grep -qvE 'idle|mixed|alloc'; then sleep 0.5; continue; fi
    [ "$(on refdl-h1 sinfo -h -N -o %N 2>/dev/null | sort -u | wc -l)" = "$n" ] && { ready=1; break; }
    sleep 0.5
  done
  [ -n "$ready" ] || die "the nodes did not register with slurmctld in 30 s (logs: $STATE/*.log)"
  on refdl-h1 "sinfo -N -o '%N %T %c'" >&2
  echo "slurm_hosts.sh: up on $(hosts | tr '\n' ' ')(srun/sbatch inside the hosts: bash scripts/hosts.sh agent refdl-h1 srun ...)" >&2
}

daemons() {  # the Slurm and munge processes on the test hosts
  for h in $(hosts); do
    for pid in $(ip netns pids "$h" 2>/dev/null); do
      case "$(cat "/proc/$pid/comm" 2>/dev/null)" in
        slurmd|slurmctld|slurmstepd|munged) echo "$pid" ;;
      esac
    done
  done
}

down() {
  for pid in $(daemons); do kill "$pid" 2>/dev/null || true; done
  for _ in $(seq 1 20); do [ -z "$(daemons)" ] && break; sleep 0.25; done
  for pid in $(daemons); do kill -9 "$pid" 2>/dev/null || true; done
  for h in $(hosts); do rm -rf "/etc/netns/$h/slurm"; done
  rm -rf "$STATE" "$MUNGE"
  echo "slurm_hosts.sh: down" >&2
}

case "${1:-}" in
  up) up "${2:-}" ;;
  down) down ;;
  *) die "usage: slurm_hosts.sh up N | down" ;;
esac
