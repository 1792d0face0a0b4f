#!/usr/bin/env bash
# The node gate (--node-check) on one GPU host, no network, each step a real run with its printed verdict:
#   1. health on the idle host                           -> PASS within the budget (the wall time is the number)
#   2. a matmul hog (a second process looping bf16 matmuls on GPU 0), then
#      prolog of a job given GPU 0 (SLURM_JOB_GPUS=0)    -> exit 1: gpu-procs FAIL naming GPU 0 and the hog's pid
#      health beside it                                  -> exit 0: GPU 0 "busy, not judged", nothing drained
#                                                           (one GPU: none judged, NOT ASSESSED, never a PASS)
#      npd beside it                                     -> exit 0 (one GPU: 2, unknown)
#   3. the SDC injector (tests/sdc) on GPU 1 (GPU 0 with one GPU): npd and prolog
#      two or more GPUs                                   -> exit 1: numerics FAIL naming GPU 1 (reference/majority)
#      one GPU                                            -> exit 0 / npd 2: off the reference alone is "everyone"
#   4. npd with a python whose torch does not import     -> exit 2, NOT ASSESSED
# Usage: bash bench/gpu_node_gate.sh   (PY: python with torch + NCCL, default python3; OUT: where the JSON
# verdicts, the metrics and a results table go, default a new temporary directory; BUDGET: --node-budget, 25)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY=${PY:-python3}
OUT=${OUT:-$(mktemp -d /tmp/aiv-node-gate.XXXX)}
BUDGET=${BUDGET:-25}
NODE=${NODE:-$(hostname -s)}
mkdir -p "$OUT"
RESULTS=$OUT/results.txt
: >"$RESULTS"
NGPU=$(nvidia-smi --query-gpu=index --format=csv,noheader | wc -l)
say() { echo "$*" | tee -a "$RESULTS"; }
say "host $NODE: $NGPU GPU(s): $(nvidia-smi --query-gpu=name --format=csv,noheader | sort | uniq -c | tr -s ' ' | tr '\n' ';')"
say "torch: $("$PY" -c 'import torch; print(torch.__version__, torch.version.cuda)')"

check() {  # check LABEL WANT_RC [ENV=VALUE ...] -- ARGS...: one --node-check run, its wall time and verdict
  local label=$1 want=$2 envs=() t0 t1 rc=0
  shift 2
  while [ $# -gt 0 ] && [ "$1" != -- ]; do envs+=("$1"); shift; done
  shift
  t0=$(date +%s.%N)
  env SLURMD_NODENAME="$NODE" "${envs[@]}" "$PY" ddp_mesh_ping.py --node-check "$@" --node-budget "$BUDGET" \
    --json "$OUT/$label.json" --metrics "$OUT/$label.prom" >"$OUT/$label.out" 2>"$OUT/$label.err" || rc=$?
  t1=$(date +%s.%N)
  say "== $label: exit $rc (want $want) in $(awk -v a="$t0" -v b="$t1" 'BEGIN{printf "%.1f", b-a}') s"
  say "   $(cat "$OUT/$label.out")"
  grep -E '^(FAILURE|WARNING|NOTE):' "$OUT/$label.err" | cut -c1-400 | sed 's/^/   /' | tee -a "$RESULTS" || true
  if grep -q Traceback "$OUT/$label.err"; then say "   (traceback in $OUT/$label.err)"; fi
  [ "$rc" = "$want" ] || say "   UNEXPECTED exit $rc"
}

check health-idle 0 -- health
"$PY" - "$OUT/health-idle.json" <<'PY' | tee -a "$RESULTS"
import json, sys
d = json.load(open(sys.argv[1]))
print("   phases:", d["phases"], "elapsed", d["elapsed_s"], "of", d["budget_s"], "; skipped:", d["skipped"] or "nothing")
for i, m in sorted(d["measured"].items()):
    s = m.get("speed") or {}
    print(f"   GPU {i}: {s.get('tflops')} TFLOPS, {s.get('hbm_gbps')} GB/s, pcie x{s.get('pcie_width')} {s.get('pcie_speed')} GT/s")
if d.get("allreduce"):
    print("   all-reduce:", d["allreduce"])
PY

# a second process looping bf16 matmuls on GPU 0: a previous job's leftover, as far as a prolog can tell
"$PY" -c '
import time, torch
a = torch.randn(8192, 8192, device="cuda:0", dtype=torch.bfloat16)
t = time.time()
while time.time() - t < 300:
    a @ a
    torch.cuda.synchronize()
' &
HOG=$!
trap 'kill $HOG 2>/dev/null || true' EXIT
for _ in $(seq 60); do
  nvidia-smi --query-compute-apps=pid --format=csv,noheader | grep -qx "$HOG" && break
  sleep 0.5
done
say "hog: pid $HOG on GPU 0: $(nvidia-smi --query-compute-apps=pid,used_memory,gpu_uuid --format=csv,noheader | grep "^$HOG," || echo 'not listed')"
check prolog-hog 1 SLURM_JOB_ID=4242 SLURM_JOB_GPUS=0 SLURM_SCRIPT_CONTEXT=prolog_slurmd --
if grep -q "held by pid $HOG" "$OUT/prolog-hog.out"; then say "   names GPU 0's foreign pid $HOG: yes"
else say "   UNEXPECTED: pid $HOG not named"; fi
check health-hog 0 -- health
if grep -Eq "busy, not judged: GPU 0|every GPU busy, none judged" "$OUT/health-hog.out"; then
  say "   GPU 0 busy, not judged: yes"
else say "   UNEXPECTED: not said busy"; fi
if [ "$NGPU" -ge 2 ]; then check npd-hog 0 -- npd; else check npd-hog 2 -- npd; fi
kill "$HOG" 2>/dev/null || true
wait "$HOG" 2>/dev/null || true
trap - EXIT

BAD=1
[ "$NGPU" -ge 2 ] || BAD=0
if [ "$NGPU" -ge 2 ]; then
  check npd-sdc 1 PYTHONPATH="$PWD/tests/sdc" NUMERICS_FAULT_LOCAL_RANK=$BAD -- npd
  check prolog-sdc 1 PYTHONPATH="$PWD/tests/sdc" NUMERICS_FAULT_LOCAL_RANK=$BAD SLURM_JOB_ID=4243 \
    SLURM_JOB_GPUS="$(seq -s, 0 $((NGPU - 1)))" -- prolog
else
  check npd-sdc 2 PYTHONPATH="$PWD/tests/sdc" NUMERICS_FAULT_LOCAL_RANK=$BAD -- npd
fi
mkdir -p "$OUT/notorch/torch"
echo "raise ImportError('torch broken (bench)')" >"$OUT/notorch/torch/__init__.py"
check npd-notorch 2 PYTHONPATH="$OUT/notorch" -- npd
say "results in $OUT"
