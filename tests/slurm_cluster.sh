#!/usr/bin/env bash
# A throwaway multi-node Slurm 22.05 cluster on ONE Linux machine, for testing
# submit_smoke_test.sbatch end to end (sbatch -> batch script -> srun -> ranks on 2+ "nodes").
#
#   bash tests/slurm_cluster.sh up                 # start: 1 slurmctld + SLURM_NODES slurmd
#   bash tests/slurm_cluster.sh exec sinfo -N      # run a Slurm client command against it
#   bash tests/slurm_cluster.sh exec-node node1 CMD...   # run CMD in node1's network/UTS namespace
#   bash tests/slurm_cluster.sh status
#   bash tests/slurm_cluster.sh env                # prints the export lines (also in $AIV_SLURM_DIR/env.sh)
#   bash tests/slurm_cluster.sh down               # stop everything it started, by PID
#
# Layout (nothing outside the namespaces it creates is touched):
#   * one "hub" holder process in a private mount namespace + a new network namespace.
#     In that mount namespace /etc/hosts (and /etc/nsswitch.conf) are bind-mounted private copies
#     that name the nodes; the host's files are never modified.  The hub network namespace holds a
#     bridge aivbr0 with ${AIV_SLURM_SUBNET}.1/24 and slurmctld.  The host's own network namespace
#     gets no interface, address or route, so the subnet cannot clash with a real network.
#   * per node one holder process with its own network + UTS namespace (hostname nodeN,
#     interface eth0 = ${AIV_SLURM_SUBNET}.(10+N), a veth into the hub's bridge) running slurmd -N nodeN.
#     slurmd is started with nsenter, not "ip netns exec" (that remounts /sys and slurmd dies).
#   * Slurm client commands reach the cluster only through "exec" (it enters the hub's mount and
#     network namespaces and sets SLURM_CONF).  Job steps run inside the node namespaces, so
#     MASTER_ADDR=node1 resolves and traffic between ranks crosses the veths.
#   * authentication is auth/none + cred/none: no munged, no /etc/munge key, nothing shared with a
#     real cluster.  Good enough for a private test cluster that only root on this machine can reach.
#   * fake GPUs: NODE_GPUS character devices made with mknod (same numbers as /dev/null) under
#     $AIV_SLURM_DIR/dev, declared as gres/gpu.  Nothing is created under /dev.
#   * "down" stops the daemons by PID, then every process in these namespaces, the holders last; it
#     holds each namespace open while it does, so that an id freed on the way is not taken for a
#     namespace of someone else's (a pod's, another test cluster's) that the kernel gave it to next.
#   * all configuration, state, logs and PID files live in $AIV_SLURM_DIR
#     (default ${TMPDIR:-/tmp}/aiv-slurm); SLURM_CONF points there.
#
# Knobs (environment): AIV_SLURM_DIR, SLURM_NODES (2), NODE_CPUS (4), NODE_GPUS (2),
#   NODE_MEM_MB (8000), AIV_SLURM_SUBNET (10.77.0), SLURM_CONF_EXTRA (lines appended to slurm.conf
#   before the node lines, e.g. Prolog=, HealthCheckProgram=), AIV_SLURM_INSTALL=1 (apt-get install the
#   Debian packages slurmd slurmctld slurm-client when slurmctld is missing; default: the caller
#   installs them, nothing is installed behind your back).
# Requires: root, Slurm 22.05 binaries (slurmctld, slurmd, sbatch, srun, scontrol, sinfo),
#   util-linux (unshare, nsenter, setsid), iproute2 (ip), a kernel with veth + bridge.
# Exit codes: 0 ok, 1 error, 2 usage, 3 refused (a Slurm daemon that no cluster of this script started
#   is running, or its own cluster is already up).
set -euo pipefail

DIR=${AIV_SLURM_DIR:-${TMPDIR:-/tmp}/aiv-slurm}
SLURM_NODES=${SLURM_NODES:-2}
NODE_CPUS=${NODE_CPUS:-4}
NODE_GPUS=${NODE_GPUS:-2}
NODE_MEM_MB=${NODE_MEM_MB:-8000}
CONF_EXTRA=${SLURM_CONF_EXTRA:-}
SUBNET=${AIV_SLURM_SUBNET:-10.77.0}
MARK=.aiv-slurm-cluster
BR=aivbr0
CTL_ADDR=$SUBNET.1
REPLACE=0 # 1: exec/exec-node replace this shell (the caller's PID becomes the command's PID)

die() { echo "slurm_cluster: ERROR: $*" >&2; exit 1; }
say() { echo "slurm_cluster: $*" >&2; }

is_uint() { case $1 in '' | *[!0-9]*) return 1 ;; *) return 0 ;; esac; }

pid_of() { # pid_of FILE -> prints the PID stored in FILE if it is a plain number
  local p=""
  [ -s "$1" ] && read -r p <"$1"
  is_uint "$p" && echo "$p"
}

# alive FILE COMM...: the PID in FILE runs and its /proc/PID/comm is one of COMM
# (guards against a recycled PID).
alive() {
  local f=$1 p c want
  shift
  p=$(pid_of "$f") || return 1
  c=$(cat "/proc/$p/comm" 2>/dev/null) || return 1
  for want in "$@"; do [ "$c" = "$want" ] && return 0; done
  return 1
}

hub_pid() { alive "$DIR/run/hub.pid" sleep && pid_of "$DIR/run/hub.pid"; }
node_ns_pid() { alive "$DIR/run/$1.ns.pid" sleep && pid_of "$DIR/run/$1.ns.pid"; }

node_names() {
  local i
  for ((i = 1; i <= SLURM_NODES; i++)); do echo "node$i"; done
}

# Run a command in the hub (private mount namespace + hub network namespace) with SLURM_CONF set.
in_hub() {
  local h
  h=$(hub_pid) || die "cluster is not up (no hub process; AIV_SLURM_DIR=$DIR)"
  local args=(--mount="/proc/$h/ns/mnt" --net="/proc/$h/ns/net" --wdns="$PWD" -- env SLURM_CONF="$DIR/etc/slurm.conf")
  if [ "$REPLACE" = 1 ]; then exec nsenter "${args[@]}" "$@"; fi
  nsenter "${args[@]}" "$@"
}

# Run a command in NODE's network + UTS namespace (and the hub's mount namespace).
in_node() {
  local node=$1 h n
  shift
  h=$(hub_pid) || die "cluster is not up (no hub process; AIV_SLURM_DIR=$DIR)"
  n=$(node_ns_pid "$node") || die "no namespace holder for node '$node'"
  local args=(--mount="/proc/$h/ns/mnt" --net="/proc/$n/ns/net" --uts="/proc/$n/ns/uts" --wdns="$PWD" -- env SLURM_CONF="$DIR/etc/slurm.conf")
  if [ "$REPLACE" = 1 ]; then exec nsenter "${args[@]}" "$@"; fi
  nsenter "${args[@]}" "$@"
}

# Slurm daemons running on this machine that are neither ours nor another cluster made by this
# script (several can run side by side, one per test worker: each lives in namespaces of its own, so
# their addresses, ports and /etc/hosts never meet). Another such cluster's daemon is known by its
# SLURM_CONF, DIR/etc/slurm.conf, in a DIR that carries this script's marker.
foreign_daemons() {
  local p c pid conf envs i ours=" "
  for f in "$DIR"/run/slurmctld.pid "$DIR"/run/slurmd-*.pid; do
    pid=$(pid_of "$f" 2>/dev/null) && ours="$ours$pid "
  done
  for p in /proc/[0-9]*; do
    c=$(cat "$p/comm" 2>/dev/null) || continue
    case $c in
      slurmctld | slurmctld-wlm | slurmd | slurmd-wlm | slurmdbd | slurmdbd-wlm)
        case $ours in *" ${p#/proc/} "*) continue ;; esac
        # a process on its way out (a zombie: a daemon's parent after the fork, not yet reaped; or one whose
        # memory, its environment with it, is already gone: another cluster's daemon or its forked child ending)
        # holds nothing: looked at again for up to 2 s before it is called foreign
        for i in 1 2 3 4 5 6 7 8 9 10; do
          [ -e "$p" ] || continue 2
          [ "$(sed -n 's/^State:[[:space:]]*\([A-Z]\).*/\1/p' "$p/status" 2>/dev/null)" = Z ] && continue 2
          envs=$(tr '\0' '\n' 2>/dev/null <"$p/environ") || envs=""
          conf=$(sed -n 's/^SLURM_CONF=//p' <<<"$envs" | head -n 1)
          case $conf in
            */etc/slurm.conf) [ -e "${conf%/etc/slurm.conf}/$MARK" ] && continue 2 ;;
          esac
          [ -n "$envs" ] && break  # an environment without our SLURM_CONF: foreign
          sleep 0.2
        done
        echo "${p#/proc/}($c)"
        ;;
    esac
  done
}

# Namespace ids (e.g. "net:[4026532301]") of a holder process, recorded at "up" time so that
# "down" finds the namespaces' members even if a holder has died.
record_ns() { # record_ns PID KIND...
  local p=$1 k
  shift
  for k in "$@"; do readlink "/proc/$p/ns/$k" >>"$DIR/run/ns.ids"; done
}

# pin_ns: an open descriptor on each namespace recorded at "up" whose holder still runs in it. A namespace
# lives while a descriptor holds it, so its id is not given to a new namespace (a pod's, another test
# cluster's: the kernel reuses a freed id at once) while "down" stops its members and then the holders;
# without the pin, a scan after the holders died named the processes of whoever got the id next.
PIN_IDS=()
pin_ns() {
  local f p k id fd
  [ -s "$DIR/run/ns.ids" ] || return 0
  for f in "$DIR/run/hub.pid" "$DIR"/run/*.ns.pid; do
    alive "$f" sleep || continue
    p=$(pid_of "$f")
    for k in mnt net; do
      id=$(readlink "/proc/$p/ns/$k" 2>/dev/null) || continue
      grep -qxF "$id" "$DIR/run/ns.ids" || continue
      exec {fd}<"/proc/$p/ns/$k" || continue
      # the descriptor holds what was read (the holder could have ended between the two)
      if [ "$(readlink "/proc/$$/fd/$fd")" = "$id" ]; then PIN_IDS+=("$id"); else exec {fd}<&-; fi
    done
  done
  [ ${#PIN_IDS[@]} -gt 0 ] || say "no namespace holder runs: the namespaces' members are not looked for"
}

# PIDs of every live process inside the pinned namespaces (hub mount ns, hub/node net ns), except the
# caller and the machine's own namespaces. A zombie holds nothing (its links do not read) and is not listed.
ns_members() {
  local args=() id own
  own=" $(readlink /proc/$$/ns/mnt) $(readlink /proc/$$/ns/net) "
  for id in "${PIN_IDS[@]}"; do
    case $own in *" $id "*) continue ;; esac
    id=${id//[/\\[}
    args+=(-o -lname "${id//]/\\]}")
  done
  [ ${#args[@]} -gt 0 ] || return 0
  find /proc/[0-9]*/ns -maxdepth 1 \( "${args[@]:1}" \) -printf '%h\n' 2>/dev/null |
    sed -n 's|^/proc/\([0-9]*\)/ns$|\1|p' | sort -un | grep -vx "$$" || true
}

# stop_pids SECONDS PID...: SIGTERM, wait up to SECONDS, then SIGKILL the rest.
stop_pids() {
  local wait_s=$1 p k any
  shift
  [ $# -gt 0 ] || return 0
  kill "$@" 2>/dev/null || true
  for ((k = 0; k < wait_s * 10; k++)); do
    any=0
    for p in "$@"; do [ -d "/proc/$p" ] && any=1; done
    [ $any = 0 ] && return 0
    sleep 0.1
  done
  for p in "$@"; do
    if [ -d "/proc/$p" ]; then
      say "SIGKILL $p ($(cat "/proc/$p/comm" 2>/dev/null || echo gone))"
      kill -9 "$p" 2>/dev/null || true
    fi
  done
}

write_config() {
  local i nodes_line last=$((NODE_GPUS - 1))
  mkdir -p "$DIR/etc"
  {
    cat <<CONF
# Generated by tests/slurm_cluster.sh -- private test cluster, removed by "down".
ClusterName=aivtest
SlurmctldHost=localhost($CTL_ADDR)
SlurmUser=root
SlurmdUser=root
SlurmctldPort=6817
SlurmdPort=6818
AuthType=auth/none
CredType=cred/none
StateSaveLocation=$DIR/ctld
SlurmdSpoolDir=$DIR/spool/%n
SlurmctldPidFile=$DIR/run/slurmctld.pid
SlurmdPidFile=$DIR/run/slurmd-%n.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
PlugStackConfig=$DIR/etc/plugstack.conf
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
SchedulerParameters=batch_sched_delay=0,sched_min_interval=0,sched_interval=1
MpiDefault=none
SwitchType=switch/none
ReturnToService=2
SlurmdParameters=config_overrides
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/filetxt
JobCompLoc=$DIR/log/jobcomp.txt
GresTypes=gpu
# Slurm's default KillWait, as on the clusters the tool runs on. After a cancel, srun relays the ranks'
# output for KillWait + 2 s ("Job step aborted: Waiting up to N seconds"); rank 0's "interrupted" verdict
# comes within 5 s of the SIGTERM, which KillWait=5 left no margin for on a loaded test machine
KillWait=30
MinJobAge=600
InactiveLimit=0
SlurmdTimeout=60
MailProg=/bin/true
CONF
    [ -z "$CONF_EXTRA" ] || printf '%s\n' "$CONF_EXTRA"
    for ((i = 1; i <= SLURM_NODES; i++)); do
      echo "NodeName=node$i NodeHostname=node$i NodeAddr=$SUBNET.$((10 + i)) CPUs=$NODE_CPUS RealMemory=$NODE_MEM_MB Gres=gpu:$NODE_GPUS State=UNKNOWN"
    done
    echo "PartitionName=debug Nodes=node[1-$SLURM_NODES] Default=YES MaxTime=INFINITE State=UP"
  } >"$DIR/etc/slurm.conf"
  : >"$DIR/etc/plugstack.conf"
  nodes_line="node[1-$SLURM_NODES]"
  {
    echo "AutoDetect=off"
    if [ "$NODE_GPUS" -gt 0 ]; then
      if [ "$NODE_GPUS" -eq 1 ]; then
        echo "NodeName=$nodes_line Name=gpu File=$DIR/dev/nvidia0"
      else
        echo "NodeName=$nodes_line Name=gpu File=$DIR/dev/nvidia[0-$last]"
      fi
    fi
  } >"$DIR/etc/gres.conf"
  # Our names first: the first match in /etc/hosts wins, and a real login node may know "node1".
  {
    echo "# private copy used inside the test cluster's mount namespace only"
    echo "$CTL_ADDR aiv-slurmctl"
    for ((i = 1; i <= SLURM_NODES; i++)); do echo "$SUBNET.$((10 + i)) node$i"; done
    cat /etc/hosts
  } >"$DIR/etc/hosts"
  if [ -r /etc/nsswitch.conf ]; then
    sed -E 's/^hosts:.*/hosts: files dns/' /etc/nsswitch.conf >"$DIR/etc/nsswitch.conf"
  else
    echo "hosts: files dns" >"$DIR/etc/nsswitch.conf"
  fi
  cat >"$DIR/env.sh" <<ENV
# source this file, then run Slurm commands through: bash tests/slurm_cluster.sh exec <cmd>
export AIV_SLURM_DIR=$DIR
export SLURM_CONF=$DIR/etc/slurm.conf
ENV
}

cmd_up() {
  local t0 cmd i h n c node
  t0=$(date +%s.%N)
  [ "$(id -u)" = 0 ] || die "must run as root (namespaces, mknod, daemons)"
  if ! is_uint "$SLURM_NODES" || [ "$SLURM_NODES" -lt 1 ] || [ "$SLURM_NODES" -gt 200 ]; then die "SLURM_NODES must be 1..200"; fi
  if ! is_uint "$NODE_CPUS" || [ "$NODE_CPUS" -lt 1 ]; then die "NODE_CPUS must be a positive integer"; fi
  is_uint "$NODE_GPUS" || die "NODE_GPUS must be an integer >= 0"
  is_uint "$NODE_MEM_MB" || die "NODE_MEM_MB must be an integer"
  case $SUBNET in *[!0-9.]* | '') die "AIV_SLURM_SUBNET must look like 10.77.0" ;; esac

  if ! command -v slurmctld >/dev/null 2>&1 && [ "${AIV_SLURM_INSTALL:-0}" = 1 ]; then
    say "installing slurmd slurmctld slurm-client with apt-get"
    apt-get update -q >/dev/null
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends slurmd slurmctld slurm-client >/dev/null
  fi
  for cmd in slurmctld slurmd sbatch srun scontrol sinfo scancel unshare nsenter setsid ip mknod; do
    command -v "$cmd" >/dev/null 2>&1 || die "'$cmd' not found (install slurmd slurmctld slurm-client, util-linux, iproute2; or set AIV_SLURM_INSTALL=1)"
  done

  if hub_pid >/dev/null; then
    say "a cluster is already up in $DIR; run 'down' first"
    exit 3
  fi
  local foreign
  foreign=$(foreign_daemons | tr '\n' ' ')
  if [ -n "$foreign" ]; then
    say "refusing to start: Slurm daemons not started by this script are running: $foreign"
    exit 3
  fi

  # Fresh state directory.  Only a directory that is empty or carries our marker is wiped.
  if [ -e "$DIR" ]; then
    [ -d "$DIR" ] || die "$DIR exists and is not a directory"
    if [ -e "$DIR/$MARK" ]; then
      rm -rf "${DIR:?}/ctld" "${DIR:?}/spool" "${DIR:?}/run" "${DIR:?}/log" "${DIR:?}/dev" "${DIR:?}/etc"
    elif [ -n "$(ls -A "$DIR")" ]; then
      die "$DIR is not empty and was not made by this script; choose another AIV_SLURM_DIR"
    fi
  fi
  mkdir -p "$DIR"
  chmod 755 "$DIR"
  : >"$DIR/$MARK"
  mkdir -p "$DIR/ctld" "$DIR/run" "$DIR/log" "$DIR/dev"
  # from here on, a failed "up" undoes itself
  trap 'say "up failed; cleaning up"; cmd_down >/dev/null 2>&1 || true' EXIT
  for node in $(node_names); do mkdir -p "$DIR/spool/$node"; done
  for ((i = 0; i < NODE_GPUS; i++)); do mknod "$DIR/dev/nvidia$i" c 1 3; done
  write_config

  # Hub holder: private mount namespace + new network namespace. setsid: survives the caller's ^C.
  # shellcheck disable=SC2016  # $$ / $1 expand in the inner shell
  setsid -f unshare --mount --propagation private --net -- \
    sh -c 'echo $$ >"$1.tmp" && mv "$1.tmp" "$1" && exec sleep infinity' sh "$DIR/run/hub.pid" \
    </dev/null >/dev/null 2>&1
  for ((i = 0; i < 100; i++)); do hub_pid >/dev/null && break; sleep 0.05; done
  h=$(hub_pid) || die "hub namespace holder did not start"
  record_ns "$h" mnt net
  nsenter --mount="/proc/$h/ns/mnt" -- mount --bind "$DIR/etc/hosts" /etc/hosts
  nsenter --mount="/proc/$h/ns/mnt" -- mount --bind "$DIR/etc/nsswitch.conf" /etc/nsswitch.conf
  # a name-service cache daemon would answer from the host's view: hide its socket in our namespace
  for c in /run/nscd /var/run/nscd; do
    if [ -d "$c" ]; then
      mkdir -p "$DIR/run/empty"
      nsenter --mount="/proc/$h/ns/mnt" -- mount --bind "$DIR/run/empty" "$c"
    fi
  done
  nsenter --net="/proc/$h/ns/net" -- sh -c "ip link set lo up && ip link add $BR type bridge && ip addr add $CTL_ADDR/24 dev $BR && ip link set $BR up"

  # Node holders: own network + UTS namespace each, hostname nodeN, eth0 on the hub's bridge.
  for ((i = 1; i <= SLURM_NODES; i++)); do
    node=node$i
    # shellcheck disable=SC2016
    setsid -f nsenter --mount="/proc/$h/ns/mnt" -- unshare --net --uts -- \
      sh -c 'hostname "$2" && echo $$ >"$1.tmp" && mv "$1.tmp" "$1" && exec sleep infinity' sh "$DIR/run/$node.ns.pid" "$node" \
      </dev/null >/dev/null 2>&1
    for ((c = 0; c < 100; c++)); do node_ns_pid "$node" >/dev/null && break; sleep 0.05; done
    n=$(node_ns_pid "$node") || die "namespace holder for $node did not start"
    record_ns "$n" net
    nsenter --net="/proc/$h/ns/net" -- ip link add "veth-aiv$i" type veth peer name eth0 netns "$n"
    nsenter --net="/proc/$h/ns/net" -- ip link set "veth-aiv$i" master "$BR" up
    nsenter --net="/proc/$n/ns/net" -- sh -c "ip addr add $SUBNET.$((10 + i))/24 dev eth0 && ip link set eth0 up && ip link set lo up"
  done

  # Daemons (each daemonizes and writes its PID file into $DIR/run).
  in_hub slurmctld </dev/null >>"$DIR/log/start-slurmctld.err" 2>&1 || die "slurmctld failed to start: $(tail -n 5 "$DIR/log/start-slurmctld.err" "$DIR/log/slurmctld.log" 2>/dev/null)"
  for node in $(node_names); do
    in_node "$node" slurmd -N "$node" </dev/null >>"$DIR/log/start-slurmd-$node.err" 2>&1 || die "slurmd $node failed to start: $(tail -n 5 "$DIR/log/start-slurmd-$node.err" 2>/dev/null)"
  done

  # Wait (max ~30 s) for every node to be idle; fail fast when a daemon died.
  local idle=0 f st=""
  for ((c = 0; c < 300; c++)); do
    st=$(in_hub timeout 5 sinfo -h -N -o '%N %T' 2>/dev/null || true)
    idle=$(grep -c ' idle$' <<<"$st" || true)
    [ "$idle" = "$SLURM_NODES" ] && break
    for f in "$DIR"/run/slurmctld.pid "$DIR"/run/slurmd-*.pid; do
      if [ -s "$f" ] && ! alive "$f" slurmctld slurmctld-wlm slurmd slurmd-wlm; then
        say "daemon of $f died; last log lines:"
        tail -n 8 "$DIR"/log/*.log >&2 || true
        exit 1
      fi
    done
    sleep 0.1
  done
  if [ "$idle" != "$SLURM_NODES" ]; then
    say "nodes not idle after 30 s: $st"
    tail -n 8 "$DIR"/log/*.log >&2 || true
    exit 1
  fi
  trap - EXIT
  say "up in $(awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN{printf "%.1f", b-a}') s: $SLURM_NODES nodes x $NODE_CPUS CPUs x $NODE_GPUS fake GPUs; state in $DIR"
  say "run client commands with: bash $0 exec sinfo -N   (they must run inside the cluster's namespaces)"
  cat "$DIR/env.sh"
}

cmd_down() {
  local pids=() p f h
  if [ ! -e "$DIR/$MARK" ]; then
    say "no cluster state in $DIR; nothing to do"
    return 0
  fi
  # cancel jobs first so slurmstepd cleans up (only with a live controller: scancel hangs otherwise)
  if alive "$DIR/run/slurmctld.pid" slurmctld slurmctld-wlm && hub_pid >/dev/null; then
    in_hub timeout 10 scancel --full --user=root >/dev/null 2>&1 || true
    sleep 1
  fi
  for f in "$DIR"/run/slurmd-*.pid "$DIR"/run/slurmctld.pid; do
    [ -e "$f" ] || continue
    if alive "$f" slurmctld slurmctld-wlm slurmd slurmd-wlm; then pids+=("$(pid_of "$f")"); fi
  done
  [ ${#pids[@]} -eq 0 ] || stop_pids 10 "${pids[@]}"
  pin_ns
  # everything else still inside our namespaces (slurmstepd, job tasks, helpers), then the holders
  mapfile -t pids < <(ns_members)
  local others=()
  for p in "${pids[@]}"; do
    [ "$(cat "/proc/$p/comm" 2>/dev/null)" = sleep ] && continue
    others+=("$p")
  done
  [ ${#others[@]} -eq 0 ] || stop_pids 5 "${others[@]}"
  # a process that forked as its parent was stopped (a health check's workers starting) is caught by a later pass
  for _pass in 1 2 3; do
    mapfile -t pids < <(ns_members)
    [ ${#pids[@]} -eq 0 ] && break
    stop_pids 5 "${pids[@]}"
  done
  # the namespaces, veths, bridge and bind mounts vanish with their last process and the pins (at exit)
  h=$(ns_members | tr '\n' ' ')
  [ -z "$h" ] || die "processes left in the cluster's namespaces: $h"
  rm -f "$DIR"/run/*.pid "$DIR/run/ns.ids"
  say "down (logs kept in $DIR/log)"
}

cmd_status() {
  local f st=0
  if ! hub_pid >/dev/null; then
    echo "down (AIV_SLURM_DIR=$DIR)"
    return 1
  fi
  echo "up: AIV_SLURM_DIR=$DIR SLURM_CONF=$DIR/etc/slurm.conf"
  for f in "$DIR"/run/*.pid; do
    if alive "$f" slurmctld slurmctld-wlm slurmd slurmd-wlm sleep; then
      echo "  $(basename "$f" .pid): pid $(pid_of "$f")"
    else
      echo "  $(basename "$f" .pid): DEAD"
      st=1
    fi
  done
  in_hub timeout 10 sinfo -N || st=1
  return $st
}

usage() {
  sed -n '2,10p' "$0" | sed 's/^# \{0,1\}//' >&2
  exit 2
}

[ $# -ge 1 ] || usage
sub=$1
shift
case $sub in
  up) cmd_up ;;
  down) cmd_down ;;
  status) cmd_status ;;
  env)
    [ -e "$DIR/env.sh" ] || die "no cluster state in $DIR"
    cat "$DIR/env.sh"
    ;;
  exec)
    [ $# -ge 1 ] || usage
    REPLACE=1
    in_hub "$@"
    ;;
  exec-node)
    [ $# -ge 2 ] || usage
    REPLACE=1
    in_node "$@"
    ;;
  -h | --help | help) usage ;;
  *) usage ;;
esac
