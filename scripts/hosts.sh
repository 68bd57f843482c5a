#!/usr/bin/env bash
# Test hosts on one machine: N Linux network namespaces, each with its own hostname (a UTS
# namespace of its own), joined by veth pairs to a bridge that lives in a namespace of its
# own. Every address is inside those namespaces; the machine's own interfaces, routes and
# files are not touched (the hosts' names resolve through /etc/netns/HOST/hosts, which the
# agent binds over /etc/hosts for the commands it runs). Needs root.
#
#   bash scripts/hosts.sh up 2            # refdl-h1, refdl-h2 (10.213.0.11, .12)
#   bash scripts/hosts.sh agent refdl-h2 CMD ...   # run CMD on a host (mpirun's ssh)
#   bash scripts/hosts.sh shell refdl-h1  # a shell on a host
#   bash scripts/hosts.sh cut refdl-h2    # take its link down (a lost host; the agent
#                                         # then refuses it, as ssh would: status 255)
#   bash scripts/hosts.sh mend refdl-h2   # bring its link back up
#   bash scripts/hosts.sh kill refdl-h2   # SIGKILL every process on it (a lost host)
#   bash scripts/hosts.sh list            # the hosts and their addresses
#   bash scripts/hosts.sh down            # remove hosts, bridge, processes, files
#
# `agent` behaves as ssh does for mpirun: options before the host name's command are
# skipped, the command's words are joined and run by sh in the current directory.
set -euo pipefail

PREFIX="refdl-h"
NET="refdl-net"                    # the namespace holding the bridge
SUBNET="10.213.0"                  # host i is $SUBNET.$((10 + i))
STATE="/run/refdl-hosts"           # UTS namespaces (bind mounts) and the host count
MAX=16

die() { echo "hosts.sh: $*" >&2; exit 2; }
need_root() { [ "$(id -u)" = 0 ] || die "needs root (network namespaces)"; }
hosts() { ip netns list 2>/dev/null | awk '{print $1}' | grep -E "^${PREFIX}[0-9]+$" | sort -V || true; }
# SIGKILL every process on a test host at once (a host's processes die together), then
# remove the Open MPI session folders of a killed launcher or daemon (/tmp/ompi.PID,
# /tmp/prted.PID), as their own exits would have.
kill_all() {
  local pids; pids="$(ip netns pids "$1" 2>/dev/null || true)"
  for pid in $pids; do kill -9 "$pid" 2>/dev/null || true; done
  for pid in $pids; do rm -rf "${TMPDIR:-/tmp}/ompi.$pid" "${TMPDIR:-/tmp}/prted.$pid"; done
}
addr_of() { echo "$SUBNET.$((10 + ${1#"$PREFIX"}))"; }

up() {
  need_root
  local n="${1:-}"
  [[ "$n" =~ ^[0-9]+$ ]] && [ "$n" -ge 1 ] && [ "$n" -le "$MAX" ] ||
    die "up takes a host count from 1 to $MAX (got '${n}')"
  if [ -n "$(hosts)" ]; then
    [ "$(hosts | wc -l)" = "$n" ] && [ -f "$STATE/count" ] &&
      { echo "hosts.sh: already up: $(hosts | tr '\n' ' ')" >&2; return 0; }
    die "other test hosts are up ($(hosts | tr '\n' ' ')); run: bash scripts/hosts.sh down"
  fi
  mkdir -p "$STATE/uts"
  # a private bind mount, so the UTS namespaces can be kept as files in it
  mountpoint -q "$STATE" || { mount --bind "$STATE" "$STATE"; mount --make-private "$STATE"; }
  ip netns add "$NET"
  ip -n "$NET" link add br0 type bridge
  ip -n "$NET" link set br0 up
  local table="127.0.0.1 localhost"$'\n'
  for i in $(seq 1 "$n"); do table+="$(addr_of "$PREFIX$i") $PREFIX$i"$'\n'; done
  for i in $(seq 1 "$n"); do
    local h="$PREFIX$i"
    ip netns add "$h"
    # the pair is made inside the bridge's namespace, its far end moved straight to the host
    ip -n "$NET" link add "h$i" type veth peer name eth0 netns "$h"
    ip -n "$NET" link set "h$i" master br0 up
    ip -n "$h" addr add "$(addr_of "$h")/24" dev eth0
    ip -n "$h" link set lo up
    ip -n "$h" link set eth0 up
    touch "$STATE/uts/$h"
    unshare --uts="$STATE/uts/$h" hostname "$h"
    mkdir -p "/etc/netns/$h"
    printf '%s' "$table" > "/etc/netns/$h/hosts"
  done
  echo "$n" > "$STATE/count"
  echo "hosts.sh: up: $(hosts | tr '\n' ' ')(bridge in namespace $NET, $SUBNET.0/24)" >&2
}

down() {
  need_root
  for h in $(hosts); do
    kill_all "$h"
  done
  sleep 0.2
  for h in $(hosts); do
    ip netns del "$h" 2>/dev/null || true
    umount "$STATE/uts/$h" 2>/dev/null || true
    rm -rf "/etc/netns/$h"
  done
  if ip netns list 2>/dev/null | grep -qx "$NET\( .*\)\?"; then
    for pid in $(ip netns pids "$NET" 2>/dev/null); do kill -9 "$pid" 2>/dev/null || true; done
    ip netns del "$NET"
  fi
  if [ -d "$STATE" ]; then
    for f in "$STATE"/uts/*; do [ -e "$f" ] && umount "$f" 2>/dev/null || true; done
    mountpoint -q "$STATE" && umount "$STATE"
    rm -rf "$STATE"
  fi
  rmdir /etc/netns 2>/dev/null || true
  echo "hosts.sh: down" >&2
}

on_host() {  # on_host HOST CMD...: exec CMD in the host's network and UTS namespaces
  local h="$1"; shift
  hosts | grep -qx "$h" || die "no test host '$h' (up: $(hosts | tr '\n' ' '))"
  # In a mount namespace of its own, the host's files are bound over /etc/hosts (and
  # /etc/slurm, when scripts/slurm_hosts.sh made one); unlike `ip netns exec`, /sys stays
  # the machine's, with its cgroups (slurmd needs them).
  exec nsenter --net="/run/netns/$h" --uts="$STATE/uts/$h" -- \
    unshare --mount --propagation private -- sh -c '
      mount --bind "$1/hosts" /etc/hosts || exit 111
      if [ -d "$1/slurm" ] && [ -d /etc/slurm ]; then mount --bind "$1/slurm" /etc/slurm; fi
      shift; exec "$@"' sh "/etc/netns/$h" "$@"
}

agent() {
  [ $# -ge 1 ] || die "agent takes a host and a command"
  while [ $# -gt 0 ] && [[ "$1" == -* ]]; do shift; done  # ssh options (e.g. -x)
  local h="$1"; shift
  [ $# -ge 1 ] || die "agent: no command for $h"
  # A cut host is out of reach, as it would be for ssh (whose status for that is 255); the
  # elastic launcher's probe of a lost host relies on it.
  if hosts | grep -qx "$h" && ! ip -n "$NET" -o link show "h${h#"$PREFIX"}" 2>/dev/null |
      grep -q '[<,]UP[,>]'; then
    echo "hosts.sh: agent: $h is cut off (its link is down)" >&2; exit 255
  fi
  # The hosts share this machine's cores: MPI ranks that busy-wait would keep the kernel
  # from moving their packets across the bridge (a 1 KiB message took 8 ms, 36 us when
  # the ranks yield; docs/distributed.md). Real hosts have cores of their own.
  on_host "$h" sh -c "export OMPI_MCA_mpi_yield_when_idle=\${OMPI_MCA_mpi_yield_when_idle:-1}; cd $(printf '%q' "$PWD") 2>/dev/null; $*"
}

case "${1:-}" in
  up) up "${2:-}" ;;
  down) down ;;
  agent) shift; agent "$@" ;;
  shell) on_host "${2:?hosts.sh: shell takes a host}" bash -i ;;
  cut|mend|kill)
    need_root
    h="${2:-}"
    hosts | grep -qx "$h" || die "$1 takes a test host (up: $(hosts | tr '\n' ' '))"
    case "$1" in
      cut) ip -n "$NET" link set "h${h#"$PREFIX"}" down ;;
      mend) ip -n "$NET" link set "h${h#"$PREFIX"}" up ;;
      kill) kill_all "$h" ;;
    esac ;;
  list) for h in $(hosts); do echo "$h $(addr_of "$h")"; done ;;
  *) die "usage: hosts.sh up N | down | agent HOST CMD... | shell HOST | cut|mend|kill HOST | list" ;;
esac
