#!/usr/bin/env bash
# End-to-end check of submit_smoke_test.sbatch under a real Slurm 22.05 on ONE host with 2 NVIDIA GPUs.
#
#   DEB_DIR=.debs OUT=/tmp/gpu-slurm-out bash tests/gpu_slurm/run_gpu_slurm.sh      (as root, from the repo root)
#
# The Debian 12 Slurm packages (tests/gpu_slurm/fetch_debs.sh downloads them) are unpacked with dpkg -x under
# $STATE_DIR (/tmp/aiv-gpu-slurm); nothing is installed and no file outside /tmp is changed.  Everything runs in a
# private mount namespace (a private /etc/hosts, /run/netns) and a private "hub" network namespace that holds a
# bridge and slurmctld; node1 and node2 each get their own network + UTS namespace (hostname nodeN, eth0 =
# 10.77.0.1N) with one slurmd, and one GPU each as gres/gpu (File=/dev/nvidiaN).  The repo's unmodified
# submit_smoke_test.sbatch is submitted once per scenario, 2 nodes x 1 rank x 1 GPU, NCCL over eth0 (sockets):
#   raw     plain gres.conf, task/none.  Slurm 22.05 numbers the GPUs per node, so both ranks get
#           CUDA_VISIBLE_DEVICES=0 = the same physical GPU.  Expected: FAILED 1:0 with
#           "FAILURE: gpu-affinity: rank 0 (node1) and rank 1 (node2) share one GPU GPU-...".
#   fixed   same, plus a TaskProlog that maps the node-local index to the UUID of the GPU the node owns.
#           Expected: COMPLETED 0:0, the SUCCESS line, transport=NET/Socket in the NETWORK section.
#   cgroup  task/cgroup + ConstrainDevices=yes (the other node's GPU is declared as an unrequested gres/nic so that
#           the device cgroup denies it).  Expected: as "fixed", with CUDA_VISIBLE_DEVICES=0 on both nodes.
# NVLink multicast stays off in every job: NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1.
#
# Output in $OUT: summary.txt (one SCENARIO line per job + details), <scenario>.txt (configs, scontrol, job
# .log/.err/.json, daemon logs), run.log (the console).  Exit: 0 every scenario as expected, 1 some not,
# 2 setup failed, 124 the time limit was hit.  Daemons are stopped by PID, namespaces vanish with their processes.
#
# Knobs (environment):
#   DEB_DIR (.debs)  OUT (/tmp/aiv-gpu-slurm-out)  STATE_DIR (/tmp/aiv-gpu-slurm)  SCENARIOS ("raw fixed cgroup die hang")
#   PYTHON (python3 on PATH: the interpreter with torch; the jobs see it as $STATE_DIR/pyenv/bin/python)
#   TIME_LIMIT_S (400: hard stop of the cluster part, teardown included; the whole script ends at most ~45 s later)
#   JOB_WAIT_S (150: per job)  JOB_AIV_TIMEOUT (60: AIV_TIMEOUT of the preflight)  NODE_CPUS (4)
#   LAYOUTS ("bridge routed": tried in order)  CARRIED_IP (auto: the system's ip if present; 1: always the unpacked one)
# Rehearsal on a CPU-only machine (fake GPU device nodes, gloo, same cluster and jobs):
#   FAKE_GPUS=1 BACKEND=gloo PYTHON=/path/to/venv/bin/python DEB_DIR=.debs OUT=/tmp/reh bash tests/gpu_slurm/run_gpu_slurm.sh
set -uo pipefail
export LC_ALL=C

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
SELF=$REPO/tests/gpu_slurm/run_gpu_slurm.sh
S=${STATE_DIR:-/tmp/aiv-gpu-slurm}
R=$S/sroot
SB=$R/usr/sbin
BIN=$R/usr/bin
PLUG=$R/usr/lib/x86_64-linux-gnu/slurm-wlm
SUBNET=10.77.0
CTL=$SUBNET.1
BR=aivgbr0

now_ms() { local t=${EPOCHREALTIME//[.,]/}; echo $((t / 1000)); }
secs() { printf '%d.%d' $(($1 / 1000)) $(($1 % 1000 / 100)); } # ms -> "12.3"
T0=${T0_MS:-$(now_ms)}
log() { echo "[$(date +%T) +$(secs $(($(now_ms) - T0)))s] $*"; }

# ----------------------------------------------------------------------------- process / cgroup helpers
# Processes whose mount namespace has inode $1 (except this shell), into MEMBERS.
ns_members() {
  MEMBERS=()
  local ino path pid
  [ -n "$1" ] || return 0
  stat -L -c '%i %n' /proc/[0-9]*/ns/mnt >"$S/ns.scan" 2>/dev/null
  while read -r ino path; do
    [ "$ino" = "$1" ] || continue
    pid=${path#/proc/}
    pid=${pid%%/*}
    [ "$pid" = "$$" ] && continue
    [ -d "/proc/$pid" ] && MEMBERS+=("$pid")
  done <"$S/ns.scan"
}

# stop_pids SECONDS PID...: SIGTERM, wait up to SECONDS, then SIGKILL what is left.
stop_pids() {
  local w=$1 p k any
  shift
  [ $# -gt 0 ] || return 0
  kill "$@" 2>/dev/null
  for ((k = 0; k < w * 10; k++)); do
    any=0
    for p in "$@"; do [ -d "/proc/$p" ] && any=1; done
    [ $any = 0 ] && return 0
    sleep 0.1
  done
  for p in "$@"; do
    if [ -d "/proc/$p" ]; then
      echo "  SIGKILL $p ($(cat "/proc/$p/comm" 2>/dev/null))"
      kill -9 "$p" 2>/dev/null
    fi
  done
  return 0
}

# reap_ns INO [known]: stop every process in that mount namespace, in rounds (a slurmstepd may still be starting
# children, and it blocks SIGTERM until killed); "known": only processes with names this harness starts.
# Sets REAPED to the number of processes stopped.
reap_ns() {
  local r p sel
  REAPED=0
  for ((r = 0; r < 4; r++)); do
    ns_members "$1"
    sel=()
    for p in "${MEMBERS[@]}"; do
      if [ "${2:-}" = known ]; then
        case $(cat "/proc/$p/comm" 2>/dev/null) in
          slurm* | python* | bash | sh | sleep | srun | timeout | tail) ;;
          *) continue ;;
        esac
      fi
      sel+=("$p")
    done
    [ ${#sel[@]} -gt 0 ] || return 0
    REAPED=$((REAPED + ${#sel[@]}))
    stop_pids 3 "${sel[@]}"
  done
}

# cgroup directories Slurm may create (v2: system.slice/<node>_slurmstepd.scope, v1: <controller>/slurm_<node>)
cg_list() { find /sys/fs/cgroup -maxdepth 3 -type d \( -name '*slurm*' -o -name system.slice \) 2>/dev/null | sort; }
# remove the ones that were not there before this run ($1=1: also system.slice)
cg_cleanup() {
  local all=${1:-0} d k new
  [ -f "$S/cgroup.before" ] || return 0
  for k in 1 2 3; do
    while read -r d; do
      [ -d "$d" ] || continue
      grep -qxF "$d" "$S/cgroup.before" && continue
      [ "$all" = 1 ] || [ "$(basename "$d")" != system.slice ] || continue
      find "$d" -depth -type d -exec rmdir {} \; 2>/dev/null
    done < <(cg_list)
    new=$(comm -13 "$S/cgroup.before" <(cg_list) | grep -v '/system.slice$')
    [ -n "$new" ] || break
    sleep 0.3
  done
  if [ "$all" = 1 ]; then
    local left
    left=$(comm -13 "$S/cgroup.before" <(cg_list) | tr '\n' ' ')
    [ -z "$left" ] || echo "  WARNING: cgroup directories left: $left"
  fi
  return 0
}

# ============================================================================= outer part (root namespaces)
outer() {
  local c p rc ipid tpid pyabs debdir
  [ "$(id -u)" = 0 ] || { echo "run_gpu_slurm: must run as root" >&2; exit 2; }
  for c in unshare nsenter dpkg timeout mount hostname ldconfig awk stat find tail; do
    command -v "$c" >/dev/null || { echo "run_gpu_slurm: '$c' not found" >&2; exit 2; }
  done
  debdir=${DEB_DIR:-.debs}
  [ -d "$debdir" ] || debdir=$REPO/${DEB_DIR:-.debs}
  debdir=$(cd "$debdir" 2>/dev/null && pwd) || { echo "run_gpu_slurm: DEB_DIR ${DEB_DIR:-.debs} not found (run tests/gpu_slurm/fetch_debs.sh)" >&2; exit 2; }
  compgen -G "$debdir/slurmd_*.deb" >/dev/null || { echo "run_gpu_slurm: no slurmd_*.deb in $debdir" >&2; exit 2; }
  OUT=${OUT:-/tmp/aiv-gpu-slurm-out}
  mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd) || exit 2
  pyabs=${PYTHON:-$(command -v python3)}
  if [ -z "$pyabs" ] || [ ! -x "$pyabs" ]; then
    echo "run_gpu_slurm: no python3 (set PYTHON)" >&2
    exit 2
  fi
  case $pyabs in /*) ;; *) pyabs=$(command -v "$pyabs") ;; esac
  FAKE_GPUS=${FAKE_GPUS:-0}
  if [ "$FAKE_GPUS" = 1 ]; then BACKEND=${BACKEND:-gloo}; else BACKEND=${BACKEND:-nccl}; fi

  # a previous run on this machine that did not finish: stop what is left of it (by PID, known names only)
  if [ -s "$S/mntns.ino" ]; then
    reap_ns "$(cat "$S/mntns.ino")" known
    [ "$REAPED" = 0 ] || echo "run_gpu_slurm: stopped $REAPED process(es) left by a previous run"
    cg_cleanup 1
    [ -f "$S/created_run_netns" ] && rmdir /run/netns 2>/dev/null
  fi
  # Slurm daemons not started by this script: their cgroup directories could carry the same names as ours
  local foreign=""
  for p in /proc/[0-9]*; do
    case $(cat "$p/comm" 2>/dev/null) in
      slurmd | slurmctld | slurmd-wlm | slurmctld-wlm) foreign+=" ${p#/proc/}($(cat "$p/comm"))" ;;
    esac
  done
  if [ -n "$foreign" ]; then
    echo "run_gpu_slurm: refusing to start: other Slurm daemons are running:$foreign" >&2
    exit 3
  fi
  rm -rf "$S"
  mkdir -p "$S"
  rm -f "$OUT/summary.txt" "$OUT/run.log" "$OUT"/raw.txt "$OUT"/fixed.txt "$OUT"/cgroup.txt
  cg_list >"$S/cgroup.before"

  export DEB_DIR=$debdir OUT PYTHON=$pyabs FAKE_GPUS BACKEND T0_MS=$T0
  TIME_LIMIT_S=${TIME_LIMIT_S:-400}
  export TIME_LIMIT_S
  timeout --signal=TERM --kill-after=30 "$TIME_LIMIT_S" \
    unshare --mount --propagation private --net -- bash "$SELF" __inner >"$OUT/run.log" 2>&1 </dev/null &
  ipid=$!
  tail -n +1 -f --pid="$ipid" "$OUT/run.log" &
  tpid=$!
  trap 'kill -TERM "$ipid" 2>/dev/null' INT TERM HUP
  while :; do
    wait "$ipid"
    rc=$?
    [ -d "/proc/$ipid" ] || break # a trapped signal interrupted wait: keep waiting for the cluster part
  done
  trap - INT TERM HUP
  wait "$tpid" 2>/dev/null
  [ "$rc" = 124 ] || [ "$rc" = 137 ] && { echo "run_gpu_slurm: the cluster part was stopped (time limit ${TIME_LIMIT_S}s or a signal; rc=$rc)" | tee -a "$OUT/summary.txt"; rc=124; }

  # belt and braces: nothing of ours may survive (processes in our mount namespace, cgroup directories)
  local left=""
  if [ -s "$S/mntns.ino" ]; then
    reap_ns "$(cat "$S/mntns.ino")"
    [ "$REAPED" = 0 ] || left="$REAPED process(es) stopped after the run"
  fi
  cg_cleanup 1
  [ -f "$S/created_run_netns" ] && rmdir /run/netns 2>/dev/null # only when empty
  ns_members "$(cat "$S/mntns.ino" 2>/dev/null)"
  if [ ${#MEMBERS[@]} -gt 0 ]; then
    echo "teardown: NOT clean: processes still running: ${MEMBERS[*]}" | tee -a "$OUT/summary.txt"
  else
    echo "teardown: clean${left:+ ($left)}: no daemons, namespaces or mounts left; unpacked files stay in $S" | tee -a "$OUT/summary.txt"
  fi
  echo "---- $OUT/summary.txt"
  cat "$OUT/summary.txt"
  exit "$rc"
}

# ============================================================================= inner part (private namespaces)
summary() { echo "$*" | tee -a "$OUT/summary.txt"; }

alive_pidfile() { # alive_pidfile FILE: the PID in FILE runs a Slurm daemon
  local p
  [ -s "$1" ] || return 1
  read -r p <"$1"
  case $(cat "/proc/$p/comm" 2>/dev/null) in slurmd | slurmctld | slurmd-wlm | slurmctld-wlm) return 0 ;; esac
  return 1
}

stop_daemons() {
  local f p pids=()
  if alive_pidfile "$S/run/slurmctld.pid"; then
    timeout 5 "$BIN/scancel" --user=root >/dev/null 2>&1
    sleep 1
  fi
  for f in "$S/run/slurmd-node1.pid" "$S/run/slurmd-node2.pid" "$S/run/slurmctld.pid"; do
    if alive_pidfile "$f"; then
      read -r p <"$f"
      pids+=("$p")
    fi
  done
  stop_pids 8 "${pids[@]}"
  rm -f "$S"/run/*.pid
  # job steps left behind (slurmstepd, ranks): everything else in our mount namespace
  reap_ns "$MNTINO"
}

TEARDOWN_DONE=0
# shellcheck disable=SC2317  # teardown and on_signal run from traps
teardown() {
  [ "$TEARDOWN_DONE" = 1 ] && return 0
  TEARDOWN_DONE=1
  local t
  t=$(now_ms)
  log "== teardown"
  stop_daemons
  for i in 1 2; do
    "$IP" link del "aivg-v$i" 2>/dev/null
    "$IP" netns del "aivg-n$i" 2>/dev/null
  done
  cg_cleanup 0
  log "teardown done in $(secs $(($(now_ms) - t)))s (the hub network and mount namespaces end with this script)"
}

# shellcheck disable=SC2317
on_signal() {
  log "interrupted (signal or time limit): tearing down"
  exit 124
}

net_up() { # $1 = bridge | routed
  local i
  "$IP" link set lo up || return 1
  case $1 in
    bridge)
      "$IP" link add "$BR" type bridge && "$IP" addr add "$CTL/24" dev "$BR" && "$IP" link set "$BR" up || return 1
      for i in 1 2; do
        "$IP" netns add "aivg-n$i" && "$IP" link add "aivg-v$i" type veth peer name eth0 netns "aivg-n$i" &&
          "$IP" link set "aivg-v$i" master "$BR" up && "$IP" -n "aivg-n$i" addr add "$SUBNET.1$i/24" dev eth0 &&
          "$IP" -n "aivg-n$i" link set eth0 up && "$IP" -n "aivg-n$i" link set lo up || return 1
      done
      N1=$SUBNET.11 N2=$SUBNET.12
      ;;
    routed) # no bridge support: one veth pair per node, routed through the hub namespace
      echo 1 >/proc/sys/net/ipv4/ip_forward || return 1
      CTL=10.77.1.1
      for i in 1 2; do
        "$IP" netns add "aivg-n$i" && "$IP" link add "aivg-v$i" type veth peer name eth0 netns "aivg-n$i" &&
          "$IP" addr add "10.77.$i.1/24" dev "aivg-v$i" && "$IP" link set "aivg-v$i" up &&
          "$IP" -n "aivg-n$i" addr add "10.77.$i.1$i/24" dev eth0 && "$IP" -n "aivg-n$i" link set eth0 up &&
          "$IP" -n "aivg-n$i" link set lo up && "$IP" -n "aivg-n$i" route add default via "10.77.$i.1" || return 1
      done
      N1=10.77.1.11 N2=10.77.2.12
      ;;
    *) return 1 ;;
  esac
}

net_down() {
  local i
  for i in 1 2; do
    "$IP" link del "aivg-v$i" 2>/dev/null
    "$IP" netns del "aivg-n$i" 2>/dev/null
  done
  "$IP" link del "$BR" 2>/dev/null
  CTL=$SUBNET.1
  return 0
}

write_conf() { # $1 = scenario
  local sc=$1 task proctrack gres ngres prolog="" first
  case $sc in raw) first=100 ;; fixed) first=200 ;; cgroup) first=300 ;; die) first=400 ;; hang) first=500 ;; *) first=900 ;; esac
  mkdir -p "$S/log/$sc"
  if [ "$sc" = cgroup ]; then
    task=task/cgroup proctrack=proctrack/cgroup gres=gpu,nic ngres=gpu:1,nic:1
    printf 'CgroupPlugin=autodetect\nIgnoreSystemd=yes\nConstrainDevices=yes\nConstrainCores=no\nConstrainRAMSpace=no\n' >"$S/etc/cgroup.conf"
    {
      echo "AutoDetect=off"
      echo "NodeName=node1 Name=gpu File=$GPU0"
      echo "NodeName=node1 Name=nic File=$GPU1"
      echo "NodeName=node2 Name=gpu File=$GPU1"
      echo "NodeName=node2 Name=nic File=$GPU0"
    } >"$S/etc/gres.conf"
  else
    task=task/none proctrack=proctrack/linuxproc gres=gpu ngres=gpu:1
    case $sc in fixed | die | hang) prolog="TaskProlog=$S/etc/taskprolog.sh" ;; esac
    printf 'CgroupPlugin=autodetect\nIgnoreSystemd=yes\n' >"$S/etc/cgroup.conf"
    printf 'AutoDetect=off\nNodeName=node1 Name=gpu File=%s\nNodeName=node2 Name=gpu File=%s\n' "$GPU0" "$GPU1" >"$S/etc/gres.conf"
  fi
  cat >"$S/etc/slurm.conf" <<CONF
# private test cluster of tests/gpu_slurm/run_gpu_slurm.sh (scenario $sc)
ClusterName=aivgpu
SlurmctldHost=localhost($CTL)
PluginDir=$PLUG
SlurmUser=root
SlurmdUser=root
SlurmctldPort=6817
SlurmdPort=6818
AuthType=auth/none
CredType=cred/none
StateSaveLocation=$S/ctld
SlurmdSpoolDir=$S/spool/%n
SlurmctldPidFile=$S/run/slurmctld.pid
SlurmdPidFile=$S/run/slurmd-%n.pid
SlurmctldLogFile=$S/log/$sc/slurmctld.log
SlurmdLogFile=$S/log/$sc/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=$proctrack
TaskPlugin=$task
$prolog
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
SchedulerParameters=batch_sched_delay=0,sched_min_interval=0
MpiDefault=none
SwitchType=switch/none
ReturnToService=2
SlurmdParameters=config_overrides
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/filetxt
JobCompLoc=$S/log/$sc/jobcomp.txt
FirstJobId=$first
GresTypes=$gres
KillWait=5
MinJobAge=600
InactiveLimit=0
SlurmdTimeout=60
MailProg=/bin/true
NodeName=node1 NodeHostname=node1 NodeAddr=$N1 CPUs=$NODE_CPUS RealMemory=8000 Gres=$ngres State=UNKNOWN
NodeName=node2 NodeHostname=node2 NodeAddr=$N2 CPUs=$NODE_CPUS RealMemory=8000 Gres=$ngres State=UNKNOWN
PartitionName=debug Nodes=node[1-2] Default=YES MaxTime=INFINITE State=UP
CONF
}

start_daemons() { # $1 = scenario; waits until both nodes are idle
  local sc=$1 i k f st="" idle
  rm -rf "$S/ctld" "$S/spool" "$S"/run/*.pid
  mkdir -p "$S/ctld" "$S/spool/node1" "$S/spool/node2" "$S/run"
  "$SB/slurmctld" </dev/null >>"$S/log/$sc/start-slurmctld.err" 2>&1 || log "slurmctld start rc=$?"
  for i in 1 2; do
    # nsenter, not "ip netns exec" (that remounts /sys and slurmd loses /sys/fs/cgroup)
    # shellcheck disable=SC2016  # expanded by the inner sh
    nsenter --net="/run/netns/aivg-n$i" -- unshare --uts -- sh -c \
      'hostname "$1" 2>/dev/null || echo "$1" >/proc/sys/kernel/hostname; exec "$2" -N "$1" -d "$3"' \
      sh "node$i" "$SB/slurmd" "$SB/slurmstepd" </dev/null >>"$S/log/$sc/start-slurmd-node$i.err" 2>&1 ||
      log "slurmd node$i start rc=$?"
  done
  for ((k = 0; k < 300; k++)); do
    st=$(timeout 5 "$BIN/sinfo" -h -N -o '%N %T' 2>/dev/null | tr '\n' ' ')
    idle=$(grep -o ' idle' <<<"$st" | wc -l)
    [ "$idle" = 2 ] && return 0
    for f in "$S/run/slurmctld.pid" "$S/run/slurmd-node1.pid" "$S/run/slurmd-node2.pid"; do
      if [ -s "$f" ] && ! alive_pidfile "$f"; then
        log "daemon of $(basename "$f") died"
        return 1
      fi
    done
    if [ $k -gt 20 ] && grep -q -E 'fatal|initialization failed' "$S/log/$sc"/*.log "$S/log/$sc"/start-*.err 2>/dev/null; then
      log "fatal error in a daemon log"
      return 1
    fi
    sleep 0.1
  done
  log "nodes not idle after 30 s: $st"
  return 1
}

dump_daemon_logs() { # $1 = scenario, $2 = lines
  local f
  for f in "$S/etc/slurm.conf" "$S/etc/gres.conf" "$S/etc/cgroup.conf"; do
    echo "### $(basename "$f")"
    cat "$f" 2>/dev/null
  done
  for f in "$S/log/$1"/start-*.err "$S/log/$1"/slurmctld.log "$S/log/$1"/slurmd-node*.log; do
    [ -s "$f" ] || continue
    echo "### $(basename "$f") (last $2 lines)"
    tail -n "$2" "$f"
  done
}

# cgroup v2 without systemd: slurmd 22.05 always loads a cgroup plugin; with IgnoreSystemd=yes it mkdirs
# <cgroupfs>/system.slice/<node>_slurmstepd.scope (not -p), so system.slice must exist with controllers enabled.
cg_prepare() {
  CGT=$(stat -fc %T /sys/fs/cgroup 2>/dev/null)
  if [ "$CGT" = sysfs ] || [ -z "$CGT" ]; then
    log "no cgroup filesystem at /sys/fs/cgroup: mounting cgroup2 (private mount namespace)"
    mount -t cgroup2 none /sys/fs/cgroup
    CGT=$(stat -fc %T /sys/fs/cgroup 2>/dev/null)
  fi
  if [ "$CGT" = cgroup2fs ]; then
    mkdir -p /sys/fs/cgroup/system.slice || log "cannot create /sys/fs/cgroup/system.slice"
    local c
    for c in cpuset cpu memory pids; do
      echo "+$c" >/sys/fs/cgroup/system.slice/cgroup.subtree_control 2>/dev/null || log "note: cannot enable $c in system.slice"
    done
  fi
  log "cgroup filesystem: $CGT"
}

cg_v1_fallback() { # slurmd's cgroup/v2 init failed: give this mount namespace a named v1 hierarchy only
  log "cgroup fallback: tmpfs on /sys/fs/cgroup + named v1 hierarchy (private mount namespace; device cgroups unavailable)"
  mount -t tmpfs aivg-cgroup /sys/fs/cgroup && mkdir -p /sys/fs/cgroup/systemd &&
    mount -t cgroup -o none,name=systemd cgroup /sys/fs/cgroup/systemd && CGFB=1
}

write_eval() {
  cat >"$S/eval.py" <<'PYEOF'
"""Judge one scenario's job against its expectation. Prints lines; exit 0 when as expected."""
import json
import re
import sys

sc, backend, state, code, log_path, json_path, g1, g2 = sys.argv[1:9]


def read(p):
    try:
        with open(p, errors="replace") as f:
            return f.read()
    except OSError:
        return ""


log = read(log_path)
try:
    js = json.loads(read(json_path))
except ValueError:
    js = None
ranks = sorted((r for r in ((js or {}).get("ranks") or []) if isinstance(r, dict)), key=lambda r: r.get("rank", 0))
fails = [ln.strip() for ln in log.splitlines() if ln.strip().startswith("FAILURE:")]
success = "SUCCESS: DDP Multi-Node AllReduce Ring Complete!" in log
net = log.split("NETWORK INTERCONNECT & FABRIC STATUS", 1)[1] if "NETWORK INTERCONNECT & FABRIC STATUS" in log else ""
transports = re.findall(r"^\s*node=(\S+) .*?\btransport=(\S+)", net, re.M)
node_gpu = {"node1": g1, "node2": g2}
def uuid(r):
    return (r.get("gpu") or {}).get("uuid") or "-"


problems = []
info = ["verdict=%s exit_code=%s" % ((js or {}).get("verdict", "no-json"), (js or {}).get("exit_code", "-")),
        "ranks: " + ("; ".join(f"{r.get('rank')}@{r.get('host')} cvd={r.get('cvd')} gpu={uuid(r)}" for r in ranks) or "-"),
        "transport: " + (" ".join(f"{h}={t}" for h, t in transports) or "-")]
info += fails

if js is None:
    problems.append("no verdict JSON")
if sorted(r.get("host") for r in ranks) != ["node1", "node2"]:
    problems.append("ranks not on node1 + node2: %s" % [r.get("host") for r in ranks])
if sc == "raw" and backend == "nccl":
    if (state, code) != ("FAILED", "1:0"):
        problems.append(f"job {state} {code}, expected FAILED 1:0")
    aff = [ln for ln in fails if ln.startswith("FAILURE: gpu-affinity:")]
    if not aff:
        problems.append("no 'FAILURE: gpu-affinity:' line")
    elif not ("rank 0" in aff[0] and "rank 1" in aff[0]):
        problems.append("gpu-affinity line does not name rank 0 and rank 1")
    else:
        m = re.search(r"GPU-[0-9a-fA-F-]{8,}", aff[0])
        if not m:
            problems.append("gpu-affinity line names no GPU UUID")
        elif m.group(0).lower() not in (g1.lower(), g2.lower()):
            problems.append(f"gpu-affinity names {m.group(0)}, not one of this host's GPUs")
    if success:
        problems.append("SUCCESS line printed although both ranks share a GPU")
elif sc in ("die", "hang"):
    want_code = "1" if sc == "die" else "3"
    word = "dead (process gone)" if sc == "die" else "frozen (process stopped)"
    if (state, code) != ("FAILED", want_code + ":0"):
        problems.append(f"job {state} {code}, expected FAILED {want_code}:0")
    if not any(ln.startswith("FAILURE: collective:") and f"rank 1 (node2) {word}" in ln for ln in fails):
        problems.append(f"no 'FAILURE: collective:' line naming rank 1 (node2) {word}")
    if js is not None and (js.get("failed_hosts") != ["node2"] or str(js.get("exit_code")) != want_code):
        problems.append(f"JSON failed_hosts={js.get('failed_hosts')} exit_code={js.get('exit_code')}")
    if f"Verdict: FAIL exit={want_code}" not in log or "FINDINGS" not in log:
        problems.append("no report and Verdict line")
    t = {k: float(v) for v, k in re.findall(r"^\[\s*([\d.]+)s\] (telemetry|verdict):", log, re.M)}
    limit = float((js or {}).get("deadlines", {}).get("collective", 0)) + 5
    if len(t) < 2 or t["verdict"] - t["telemetry"] > limit:
        problems.append(f"verdict not within --timeout + 5 s of the collective's start: {t}")
    info.append("verdict %.2fs after the collective began (bound %.0fs)" % (t.get("verdict", -1) - t.get("telemetry", 0), limit))
    if success:
        problems.append("SUCCESS line printed")
else:
    if (state, code) != ("COMPLETED", "0:0"):
        problems.append(f"job {state} {code}, expected COMPLETED 0:0")
    if not success:
        problems.append("no SUCCESS line")
    if js is not None and js.get("verdict") != "PASS":
        problems.append(f"verdict {js.get('verdict')}")
    if backend == "nccl":
        if not transports or not all("NET/Socket" in t for _, t in transports):
            problems.append("NETWORK section does not report transport NET/Socket on every node")
        for r in ranks:
            want = node_gpu.get(r.get("host"), "?")
            if uuid(r).lower() != want.lower():
                problems.append(f"rank {r.get('rank')} on {r.get('host')} ran on {uuid(r)}, expected {want}")
# what the tasks saw in CUDA_VISIBLE_DEVICES: Slurm's node-local index, or the remapped UUID
for r in ranks:
    want = node_gpu.get(r.get("host"), "?") if sc in ("fixed", "die", "hang") else "0"
    if r.get("cvd") != want:
        problems.append(f"rank {r.get('rank')} on {r.get('host')}: CUDA_VISIBLE_DEVICES={r.get('cvd')}, expected {want}")

print("expected=yes" if not problems else "expected=NO")
for p in problems:
    print("  PROBLEM: " + p)
for i in info:
    print("  " + i)
sys.exit(1 if problems else 0)
PYEOF
}

run_scenario() { # $1 = scenario; appends to summary, writes $OUT/<scenario>.txt
  local sc=$1 W rem wait_s t0 j="" st="" ec="" dt line f ev evrc=1 try
  local out=$OUT/$sc.txt
  rem=$(((SOFT_END - $(now_ms)) / 1000))
  if [ "$rem" -lt 45 ]; then
    summary "SCENARIO $sc: state=SKIPPED (time budget: ${rem}s left)"
    return 1
  fi
  log "== scenario $sc"
  write_conf "$sc"
  for try in 1 2; do
    start_daemons "$sc" && break
    log "cluster did not come up for scenario $sc (try $try)"
    if [ "$try" = 1 ] && [ "$CGFB" = 0 ] && grep -qiE '(error|fatal).*cgroup|cgroup.*(error|fail)' "$S/log/$sc"/slurmd-node*.log "$S/log/$sc"/start-*.err 2>/dev/null; then
      stop_daemons
      cg_v1_fallback && continue
    fi
    { echo "### scenario $sc: the cluster did not come up"; dump_daemon_logs "$sc" 80; } >"$out"
    stop_daemons
    summary "SCENARIO $sc: state=NOT_RUN (cluster did not come up; see $sc.txt)"
    return 1
  done
  log "cluster up ($(timeout 5 "$BIN/sinfo" -h -N -o '%N:%T:%G' | tr '\n' ' '))"

  W=$S/work/$sc
  mkdir -p "$W"
  ln -sf "$REPO/ddp_mesh_ping.py" "$W/ddp_mesh_ping.py" # the batch file's default AIV_SCRIPT
  local exports="ALL,PYTORCH_ENV=$S/pyenv,NCCL_SOCKET_IFNAME=eth0,GLOO_SOCKET_IFNAME=eth0"
  exports+=",NCCL_NVLS_ENABLE=0,TORCH_SYMM_MEM_DISABLE_MULTICAST=1,NVSHMEM_DISABLE_NVLS=1,AIV_TIMEOUT=$JOB_AIV_TIMEOUT"
  [ "$BACKEND" = gloo ] && exports+=",AIV_BACKEND=gloo"
  # die / hang: as fixed, and rank 1 (node2) is SIGKILLed / SIGSTOPped when it reaches the all_reduce
  case $sc in die | hang) exports+=",AIV_FAILPOINT=$sc:collective:1" ;; esac
  local cmd=("$BIN/sbatch" --parsable --nodes=2 --ntasks-per-node=1 --gpus-per-node=1 --cpus-per-task=2 --time=5
    "--export=$exports" "$REPO/submit_smoke_test.sbatch")
  t0=$(now_ms)
  j=$(cd "$W" && timeout 20 "${cmd[@]}" 2>"$S/log/$sc/sbatch.err") || j=""
  j=${j%%;*}
  if [ -z "$j" ]; then
    { echo "### scenario $sc: sbatch failed"; cat "$S/log/$sc/sbatch.err"; dump_daemon_logs "$sc" 80; } >"$out"
    stop_daemons
    summary "SCENARIO $sc: state=NOT_RUN (sbatch failed: $(head -n1 "$S/log/$sc/sbatch.err"))"
    return 1
  fi
  log "submitted job $j: ${cmd[*]}"
  rem=$(((SOFT_END - $(now_ms)) / 1000))
  wait_s=$JOB_WAIT_S
  [ "$wait_s" -gt "$rem" ] && wait_s=$rem
  local until=$(($(now_ms) + wait_s * 1000))
  while [ "$(now_ms)" -lt "$until" ]; do
    line=$(timeout 5 "$BIN/scontrol" show job "$j" 2>/dev/null)
    st=$(grep -oP '\bJobState=\K\S+' <<<"$line")
    case $st in PENDING | CONFIGURING | RUNNING | COMPLETING | SUSPENDED | "") sleep 0.25 ;; *) break ;; esac
  done
  dt=$(($(now_ms) - t0))
  ec=$(grep -oP '\bExitCode=\K\S+' <<<"$line")
  case $st in
    PENDING | CONFIGURING | RUNNING | COMPLETING | SUSPENDED | "")
      log "job $j still ${st:-unknown} after ${wait_s}s: cancelling"
      timeout 5 "$BIN/scancel" "$j" 2>/dev/null
      st="HARNESS_TIMEOUT(${st:-unknown})"
      ;;
  esac
  f=$W/ai_infra_smoke_test_$j
  ev=$("$PYTHON" "$S/eval.py" "$sc" "$BACKEND" "$st" "$ec" "$f.log" "$f.json" "$(cat "$S/etc/gpumap.node1")" "$(cat "$S/etc/gpumap.node2")" 2>&1)
  evrc=$?
  summary "SCENARIO $sc: state=$st exit=${ec:--} sbatch_to_end=$(secs "$dt")s job=$j $(head -n1 <<<"$ev")"
  tail -n +2 <<<"$ev" | tee -a "$OUT/summary.txt"
  {
    echo "### scenario $sc, backend $BACKEND, job $j: state=$st exit=${ec:--} sbatch_to_end=$(secs "$dt")s"
    echo "### evaluation"
    echo "$ev"
    echo "### sbatch command (run in $W)"
    echo "${cmd[*]}"
    [ "$sc" = fixed ] && {
      echo "### taskprolog.sh"
      cat "$S/etc/taskprolog.sh"
      echo "### gpumap: node1=$(cat "$S/etc/gpumap.node1") node2=$(cat "$S/etc/gpumap.node2")"
    }
    echo "### scontrol show job -d $j"
    timeout 5 "$BIN/scontrol" show job -d "$j" 2>&1
    echo "### jobcomp"
    cat "$S/log/$sc/jobcomp.txt" 2>/dev/null
    for x in log err json; do
      echo "### $(basename "$f").$x"
      cat "$f.$x" 2>/dev/null || echo "(missing)"
    done
    dump_daemon_logs "$sc" 150
  } >"$out" 2>&1
  log "scenario $sc done; stopping the daemons"
  stop_daemons
  cg_cleanup 0
  return "$evrc"
}

inner() {
  local i c t
  MNTINO=$(stat -L -c %i /proc/self/ns/mnt)
  echo "$MNTINO" >"$S/mntns.ino"
  trap teardown EXIT
  trap on_signal TERM INT HUP
  CGFB=0
  SOFT_END=$((T0 + (TIME_LIMIT_S - 45) * 1000))
  SCENARIOS=${SCENARIOS:-raw fixed cgroup die hang}
  JOB_WAIT_S=${JOB_WAIT_S:-150}
  JOB_AIV_TIMEOUT=${JOB_AIV_TIMEOUT:-60}
  NODE_CPUS=${NODE_CPUS:-4}
  LAYOUTS=${LAYOUTS:-bridge routed}
  IP=ip

  # the caller's Slurm / launcher / preflight variables would change what the jobs do
  for c in $(compgen -e); do
    case $c in
      SLURM_* | SBATCH_* | SRUN_* | SALLOC_* | AIV_* | MASTER_ADDR | MASTER_PORT | RANK | WORLD_SIZE | LOCAL_RANK | PYTORCH_ENV | VIRTUAL_ENV | CUDA_VISIBLE_DEVICES) unset "$c" ;;
    esac
  done
  export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 # NVLink multicast stays off

  log "== ai-infra-validator GPU Slurm harness: backend=$BACKEND fake_gpus=$FAKE_GPUS scenarios='$SCENARIOS' limit=${TIME_LIMIT_S}s"
  echo "  host: $(uname -srm); $(grep -m1 PRETTY_NAME /etc/os-release 2>/dev/null); cpus=$(nproc); python=$PYTHON"
  echo "  env: $(env | grep -E '^(NCCL|NVSHMEM|TORCH_SYMM|NVIDIA_VISIBLE)' | sort | tr '\n' ' ')"
  "$PYTHON" -c 'import importlib.util, sys; sys.exit(importlib.util.find_spec("torch") is None)' ||
    { summary "SETUP: $PYTHON cannot import torch"; exit 2; }

  # ---- a Slurm installed on this machine must not be used: hide it in this mount namespace
  mkdir -p "$S/empty"
  for c in /usr/lib/x86_64-linux-gnu/slurm-wlm /usr/lib/x86_64-linux-gnu/slurm /etc/slurm /etc/slurm-llnl; do
    [ -d "$c" ] && mount --bind "$S/empty" "$c" && echo "  hidden for this run: $c"
  done
  for c in /usr/sbin/slurmd /usr/sbin/slurmctld /usr/sbin/slurmstepd /usr/sbin/slurmd-wlm /usr/sbin/slurmctld-wlm \
    /usr/sbin/slurmstepd-wlm /usr/bin/sbatch /usr/bin/srun /usr/bin/scontrol /usr/bin/sinfo /usr/bin/scancel /usr/bin/squeue; do
    [ -e "$c" ] && mount --bind /dev/null "$c" && echo "  hidden for this run: $c"
  done

  # ---- unpack the debs (never installed)
  t=$(now_ms)
  mkdir -p "$R" "$S/etc" "$S/log" "$S/run" "$S/missing"
  for c in "$DEB_DIR"/*.deb; do dpkg -x "$c" "$R" || { summary "SETUP: dpkg -x failed for $c"; exit 2; }; done
  # a library from the debs is used only where the system has no library of that name
  for c in "$R"/lib/x86_64-linux-gnu/*.so.* "$R"/usr/lib/x86_64-linux-gnu/*.so.*; do
    [ -e "$c" ] || continue
    case ${c##*/} in *.so.[0-9] | *.so.[0-9][0-9]) ;; *) continue ;; esac
    ldconfig -p | grep -q "^[[:space:]]${c##*/} (" || cp -L "$c" "$S/missing/"
  done
  for c in slurmd slurmctld slurmstepd; do ln -sf "$c-wlm" "$SB/$c"; done
  export LD_LIBRARY_PATH=$PLUG:$S/missing${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  export PATH=$BIN:$SB:$PATH
  export SLURM_CONF=$S/etc/slurm.conf
  log "unpacked $(find "$DEB_DIR" -maxdepth 1 -name '*.deb' | wc -l) debs into $R in $(secs $(($(now_ms) - t)))s; libraries taken from the debs: $(find "$S/missing" -mindepth 1 -printf '%f ')"
  for c in "$SB"/slurmd-wlm "$SB"/slurmctld-wlm "$SB"/slurmstepd-wlm "$BIN"/sbatch "$BIN"/srun "$BIN"/scontrol "$BIN"/sinfo \
    "$PLUG"/{auth_none,cred_none,gres_gpu,gres_nic,select_cons_tres,cgroup_v1,cgroup_v2,proctrack_linuxproc,proctrack_cgroup,task_none,task_cgroup,jobcomp_filetxt,sched_backfill}.so; do
    [ -e "$c" ] || { echo "  MISSING: $c"; continue; }
    i=$(ldd "$c" 2>&1 | grep 'not found' | tr -s ' \t\n' ' ')
    [ -z "$i" ] || echo "  LDD: $(basename "$c") lacks:$i"
  done
  "$SB/slurmd" -V || { summary "SETUP: the unpacked slurmd does not run"; exit 2; }
  if [ "${CARRIED_IP:-auto}" = 1 ] || ! command -v ip >/dev/null; then
    for c in "$R/bin/ip" "$R/sbin/ip" "$R/usr/bin/ip" "$R/usr/sbin/ip"; do [ -x "$c" ] && IP=$c && break; done
  fi
  "$IP" -V >/dev/null 2>&1 || { summary "SETUP: no working ip tool ($IP)"; exit 2; }
  log "slurm binaries: $SB, $BIN; plugins: $PLUG; ip: $IP"

  # ---- GPUs: node1 owns the GPU with the lowest /dev/nvidiaN minor, node2 the next one
  if [ "$FAKE_GPUS" = 1 ]; then
    mkdir -p "$S/dev"
    mknod "$S/dev/nvidia0" c 1 7 && mknod "$S/dev/nvidia1" c 1 11 # numbers of /dev/full and /dev/kmsg: harmless to deny
    GPU0=$S/dev/nvidia0 GPU1=$S/dev/nvidia1
    echo GPU-fake-0 >"$S/etc/gpumap.node1"
    echo GPU-fake-1 >"$S/etc/gpumap.node2"
  else
    local gl=()
    for c in /proc/driver/nvidia/gpus/*/information; do
      [ -r "$c" ] || continue
      gl+=("$(awk -F':[ \t]*' '/^Device Minor/{m=$2} /^GPU UUID/{u=$2} END{gsub(/[ \t]/,"",m); gsub(/[ \t]/,"",u); print m","u}' "$c")")
    done
    mapfile -t gl < <(printf '%s\n' "${gl[@]}" | grep -E '^[0-9]+,GPU-' | sort -t, -k1,1n)
    if [ ${#gl[@]} -lt 2 ]; then
      summary "SETUP: fewer than 2 GPUs in /proc/driver/nvidia/gpus/*/information (found ${#gl[@]})"
      exit 2
    fi
    GPU0=/dev/nvidia${gl[0]%%,*} GPU1=/dev/nvidia${gl[1]%%,*}
    echo "${gl[0]#*,}" >"$S/etc/gpumap.node1"
    echo "${gl[1]#*,}" >"$S/etc/gpumap.node2"
    for c in "$GPU0" "$GPU1"; do [ -c "$c" ] || { summary "SETUP: $c is not a character device"; exit 2; }; done
  fi
  log "GPUs: node1=$GPU0 $(cat "$S/etc/gpumap.node1")  node2=$GPU1 $(cat "$S/etc/gpumap.node2")"

  # TaskProlog of the "fixed" scenario (slurmstepd runs it after the gres plugin has set the task's environment)
  cat >"$S/etc/taskprolog.sh" <<TP
#!/bin/sh
# Slurm TaskProlog for a test cluster whose "nodes" share one host.  Without device cgroups Slurm 22.05 numbers
# each node's GPUs 0..n-1 in gres.conf order, so every node's task gets CUDA_VISIBLE_DEVICES=0, i.e. the host's
# first GPU.  Replace each node-local index with the UUID of the GPU this node owns (gpumap.<node>: one UUID per
# line, in gres.conf order), which is what a device cgroup achieves on a real node.
m=$S/etc/gpumap.\$SLURMD_NODENAME
[ -r "\$m" ] && [ -n "\${CUDA_VISIBLE_DEVICES:-}" ] || exit 0
out=
for i in \$(echo "\$CUDA_VISIBLE_DEVICES" | tr ',' ' '); do
  case \$i in *[!0-9]*) exit 0 ;; esac
  p=\$(sed -n "\$((i + 1))p" "\$m")
  [ -n "\$p" ] || exit 0
  out=\${out:+\$out,}\$p
done
echo "export SLURM_CVD_ORIG=\$CUDA_VISIBLE_DEVICES"
echo "export CUDA_VISIBLE_DEVICES=\$out"
TP
  chmod 755 "$S/etc/taskprolog.sh"

  # PYTORCH_ENV for the batch file: a directory whose bin/python runs $PYTHON.  A wrapper, not a symlink: a
  # symlink would hide the venv that $PYTHON belongs to (Python looks for pyvenv.cfg next to the path it was
  # started as) and torch would not import.
  mkdir -p "$S/pyenv/bin"
  printf '#!/bin/sh\nexec %s "$@"\n' "$PYTHON" >"$S/pyenv/bin/python"
  chmod 755 "$S/pyenv/bin/python"
  write_eval

  cg_prepare

  # ---- network: hub namespace (this one) with a bridge; node1/node2 namespaces with eth0.  The namespace names
  # (ip netns) live in a tmpfs private to this mount namespace, so nothing is left in /run/netns.
  if [ ! -d /run/netns ]; then
    mkdir -p /run/netns && : >"$S/created_run_netns"
  fi
  mount -t tmpfs -o mode=755,size=1m aivg-netns /run/netns ||
    log "note: no private tmpfs on /run/netns; the namespace files there are removed at teardown"
  LAYOUT=""
  for c in $LAYOUTS; do
    t=$(now_ms)
    if net_up "$c"; then
      LAYOUT=$c
      break
    fi
    log "network layout $c failed; cleaning up"
    net_down
  done
  [ -n "$LAYOUT" ] || { summary "SETUP: no network layout worked ($LAYOUTS)"; exit 2; }
  log "network: layout=$LAYOUT controller=$CTL node1=$N1 node2=$N2 (eth0 in each node namespace) in $(secs $(($(now_ms) - t)))s"

  # ---- private /etc/hosts (our names first) and nsswitch (files first); only inside this mount namespace
  {
    echo "# private copy for the test cluster of tests/gpu_slurm/run_gpu_slurm.sh"
    echo "$CTL slurmctl"
    echo "$N1 node1"
    echo "$N2 node2"
    cat /etc/hosts 2>/dev/null
  } >"$S/etc/hosts"
  if [ -r /etc/nsswitch.conf ]; then
    sed -E 's/^hosts:.*/hosts: files dns/' /etc/nsswitch.conf >"$S/etc/nsswitch.conf"
    mount --bind "$S/etc/nsswitch.conf" /etc/nsswitch.conf
  fi
  for c in /run/nscd /var/run/nscd; do [ -d "$c" ] && mount --bind "$S/empty" "$c"; done
  mount --bind "$S/etc/hosts" /etc/hosts || { summary "SETUP: cannot bind-mount a private /etc/hosts"; exit 2; }

  summary "ai-infra-validator GPU Slurm harness: backend=$BACKEND fake_gpus=$FAKE_GPUS slurm=$("$SB/slurmd" -V | awk '{print $2}') layout=$LAYOUT cgroupfs=$CGT host=$(uname -r)"
  summary "GPUs: node1=$GPU0 $(cat "$S/etc/gpumap.node1")  node2=$GPU1 $(cat "$S/etc/gpumap.node2")"
  local n=0 ok=0
  for c in $SCENARIOS; do
    n=$((n + 1))
    run_scenario "$c" && ok=$((ok + 1))
  done
  if [ "$ok" = "$n" ]; then
    summary "RESULT: PASS ($ok/$n scenarios as expected) total=$(secs $(($(now_ms) - T0)))s"
    exit 0
  fi
  summary "RESULT: FAIL ($ok/$n scenarios as expected) total=$(secs $(($(now_ms) - T0)))s"
  exit 1
}

if [ "${1:-}" = __inner ]; then
  inner
else
  outer
fi
