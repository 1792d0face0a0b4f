#!/usr/bin/env bash
# Benign disturbances on real GPUs, one rank per GPU over NCCL, launched by hand as srun would: the
# verdict names no host. Each line of $OUT/summary.txt: label, rank 0's exit code, the seconds from
# the signal to rank 0's exit, failed_hosts from the JSON, the first FAILURE line.
#   pass             no fault: PASS, exit 0
#   term-<phase>     rank 0 paused inside <phase> (pause failpoint), SIGTERM to every rank: exit 5
#   raise-<phase>    the tool's own error at <phase> on rank 0 (raise failpoint): exit 4
# Usage: OUT=dir bash bench/gpu_blame.sh   (PY: python with torch + NCCL; NPROC: ranks, default the GPUs)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT=${OUT:-gpu-blame}
PY=${PY:-python3}
NPROC=${NPROC:-$(nvidia-smi -L | wc -l)}
export PYTHONUNBUFFERED=1
mkdir -p "$OUT/logs"
: >"$OUT/summary.txt"

run() { # $1 label, $2 failpoint ('' for none), $3 'term' to SIGTERM every rank once the mark exists
  local label=$1 fp=$2 action=$3 port r t0 t1 pids=() rc0=0 mark
  port=$("$PY" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
  mark="$OUT/logs/$label.mark"
  rm -f "$OUT/logs/$label.json" "$mark"
  for ((r = 0; r < NPROC; r++)); do
    RANK=$r LOCAL_RANK=$r WORLD_SIZE=$NPROC MASTER_ADDR=127.0.0.1 MASTER_PORT=$port AIV_FAILPOINT=$fp \
      AIV_FAILPOINT_MARK=$mark "$PY" ddp_mesh_ping.py --timeout 30 --json "$OUT/logs/$label.json" \
      >"$OUT/logs/$label.r$r.log" 2>"$OUT/logs/$label.r$r.err" &
    pids+=($!)
  done
  t0=$(date +%s.%N)
  if [ "$action" = term ]; then
    for _ in $(seq 1 600); do [ -e "$mark" ] && break; sleep 0.1; done
    sleep 0.3
    t0=$(date +%s.%N)
    kill -TERM "${pids[@]}" 2>/dev/null || true
  fi
  wait "${pids[0]}" || rc0=$?
  t1=$(date +%s.%N)
  for p in "${pids[@]:1}"; do wait "$p" || true; done
  "$PY" - "$label" "$rc0" "$t0" "$t1" "$OUT/logs/$label.json" "$OUT/logs/$label.r0.log" >>"$OUT/summary.txt" <<'PY'
import json, sys
label, rc, t0, t1, js, log = sys.argv[1:7]
try:
    hosts = json.load(open(js)).get("failed_hosts")
except (OSError, ValueError):
    hosts = "no JSON"
first = next((ln for ln in open(log) if ln.startswith("FAILURE:")), "-").strip()
print(f"{label}\texit={rc}\t{float(t1) - float(t0):.2f}s\tfailed_hosts={hosts}\t{first[:200]}")
PY
}

run pass "" ""
for phase in screen-gpu collective ddp; do
  run "term-$phase" "pause=60:$phase:0" term
done
for phase in init screen-gpu final report; do
  run "raise-$phase" "raise:$phase:0" ""
done
cat "$OUT/summary.txt"
