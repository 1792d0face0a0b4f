#!/usr/bin/env bash
# Verdicts on real GPUs, 2 ranks over NCCL, launched by hand as srun would:
#   pass            no fault (twice: the run must pass every time)
#   die-collective  AIV_FAILPOINT=die:collective:1   rank 1 SIGKILLs itself at the all_reduce
#   hang-collective AIV_FAILPOINT=hang:collective:1  rank 1 SIGSTOPs itself at the all_reduce
#   die-ddp / hang-ddp                               the same at the DDP step
#   kill-after-init / stop-after-init                SIGKILL / SIGSTOP of rank 1 from outside, once rank 0
#                                                    prints "init: nccl process group of 2 ready"
# Each fault run is judged: rank 0's exit code (1 dead, 3 frozen), one FAILURE line naming rank 1 and
# its host, the report and Verdict line, the JSON's failed_hosts, the seconds from the start of the
# phase that hung to the verdict (rank 0's own clock), and how long after rank 0 the other rank ended.
# Usage: OUT=dir bash bench/gpu_trust.sh        (PY: python with torch + NCCL; TIMEOUT: --timeout, 20)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT=${OUT:-gpu-trust}
PY=${PY:-python3}
TIMEOUT=${TIMEOUT:-20}
export PYTHONUNBUFFERED=1
mkdir -p "$OUT/logs"

run() { # $1 label, $2 failpoint ('' for none), $3 external signal ('' or KILL or STOP)
  local label=$1 fp=$2 sig=$3 port r t0 pids=() rc0=0 rc1=0 end0 end1
  port=$("$PY" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
  rm -f "$OUT/logs/$label.json"
  t0=$(date +%s.%N)
  for r in 0 1; do
    RANK=$r LOCAL_RANK=$r WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=$port AIV_FAILPOINT=$fp \
      "$PY" ddp_mesh_ping.py --timeout "$TIMEOUT" --json "$OUT/logs/$label.json" \
      >"$OUT/logs/$label.r$r.log" 2>"$OUT/logs/$label.r$r.err" &
    pids+=($!)
  done
  if [ -n "$sig" ]; then
    for _ in $(seq 600); do
      grep -q 'init: nccl process group of 2 ready' "$OUT/logs/$label.r0.log" && break
      sleep 0.05
    done
    kill -"$sig" "${pids[1]}"
  fi
  wait "${pids[0]}" || rc0=$?
  end0=$(date +%s.%N)
  if [[ $fp == hang:* ]] || [ "$sig" = STOP ]; then
    sleep 12 # the frozen rank cannot exit; give the batch file's grace, then clean up
    kill -KILL "${pids[1]}" 2>/dev/null || true
  fi
  wait "${pids[1]}" || rc1=$?
  end1=$(date +%s.%N)
  "$PY" - "$label" "$OUT/logs" "$rc0" "$rc1" "$t0" "$end0" "$end1" <<'PY'
import json, re, sys
label, d, rc0, rc1, t0, end0, end1 = sys.argv[1:]
log = open(f"{d}/{label}.r0.log").read()
fails = [ln for ln in log.splitlines() if ln.startswith("FAILURE:")]
try:
    js = json.load(open(f"{d}/{label}.json"))
except (OSError, ValueError):
    js = {}
t = {k: float(v) for v, k in re.findall(r"^\[\s*([\d.]+)s\] (\w+):", log, re.M)}
start = max((v for k, v in t.items() if k not in ("verdict",) and v <= t.get("verdict", 0)), default=0)
print(f"{label}: rank0 exit {rc0} rank1 exit {rc1}; wall {float(end0) - float(t0):.1f}s; "
      f"verdict {t.get('verdict', -1) - start:.2f}s after the last progress line; rank 1 ended "
      f"{float(end1) - float(end0):.1f}s after rank 0; failed_hosts={js.get('failed_hosts')} "
      f"report={'FINDINGS' in log} verdict_line={[ln for ln in log.splitlines() if ln.startswith('Verdict:')][:1]}")
for ln in fails:
    print("    " + ln)
if "SUCCESS: DDP Multi-Node AllReduce Ring Complete!" in log:
    print("    SUCCESS line present")
PY
}

{
  date -u
  nvidia-smi -L || true
  "$PY" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "nccl", torch.cuda.nccl.version(), "gpus", torch.cuda.device_count())'
  run pass-1 "" ""
  run die-collective die:collective:1 ""
  run hang-collective hang:collective:1 ""
  run die-ddp die:ddp:1 ""
  run hang-ddp hang:ddp:1 ""
  run kill-after-init "" KILL
  run stop-after-init "" STOP
  run pass-2 "" ""
} 2>&1 | tee "$OUT/trust.txt"
