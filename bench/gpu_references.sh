#!/usr/bin/env bash
# What the peers cannot see, on one GPU (no peers, no floors, no manifest): the per-model table and the soak.
#   clean   no load but ours                                   -> PASS, the GPU judged against the table
#   hog     a second process looping bf16 matmuls on GPU 0    -> FAIL gpu-perf naming the GPU against the table
#   soak    --soak SOAK_S on the clean GPU                    -> PASS, clocks, temperatures and power reported
# Each step's log, stderr and JSON are kept in $OUT; $OUT/summary.txt has one line per step: label, exit
# code, seconds, failed_hosts, the first FAILURE line (or the success line).
# Usage: OUT=dir bash bench/gpu_references.sh
#   PY      python with torch + CUDA          (default: python3)
#   SOAK_S  the soak's length in seconds      (default: 30)
#   STEPS   which steps: clean,hog,soak        (default: all)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT=${OUT:-gpu-references}
PY=${PY:-python3}
SOAK_S=${SOAK_S:-30}
STEPS=${STEPS:-clean,hog,soak}
export PYTHONUNBUFFERED=1
mkdir -p "$OUT"
: >"$OUT/summary.txt"
has() { case ",$STEPS," in *",$1,"*) return 0 ;; *) return 1 ;; esac; }

step() { # $1 label, then the tool's arguments
  local label=$1 rc=0 t0
  shift
  t0=$(date +%s.%N)
  "$PY" ddp_mesh_ping.py --json "$OUT/$label.json" "$@" >"$OUT/$label.log" 2>"$OUT/$label.err" || rc=$?
  "$PY" - "$label" "$rc" "$t0" "$OUT/$label.json" "$OUT/$label.log" >>"$OUT/summary.txt" <<'PY'
import json, sys, time
label, rc, t0, js, log = sys.argv[1:6]
try:
    hosts = json.load(open(js)).get("failed_hosts")
except (OSError, ValueError):
    hosts = "no JSON"
lines = open(log).read().splitlines()
first = next((ln for ln in lines if ln.startswith(("FAILURE:", "SUCCESS:"))), "-").strip()
print(f"{label}\texit={rc}\t{time.time() - float(t0):.1f}s\tfailed_hosts={hosts}\t{first[:300]}")
PY
  tail -n 1 "$OUT/summary.txt"
}

if has clean; then
  step clean
fi
if has hog; then
  # the hog: 8192^3 bf16 matmuls in a loop on GPU 0 until killed; it says when it runs at full speed
  ready="$OUT/hog.ready"
  rm -f "$ready"
  "$PY" - "$ready" >"$OUT/hog.out" 2>&1 <<'PY' &
import sys, time, torch
a = torch.randn(8192, 8192, device="cuda:0", dtype=torch.bfloat16)
b = torch.randn_like(a)
for _ in range(20):
    a @ b
torch.cuda.synchronize()
open(sys.argv[1], "w").close()
while True:
    for _ in range(50):
        a @ b
    torch.cuda.synchronize()
PY
  hog=$!
  for _ in $(seq 1 300); do [ -e "$ready" ] && break; sleep 0.1; done
  step hog
  kill "$hog" 2>/dev/null || true
  wait "$hog" 2>/dev/null || true
fi
if has soak; then
  step soak --soak "$SOAK_S"
fi
cat "$OUT/summary.txt"
