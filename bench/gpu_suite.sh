#!/usr/bin/env bash
# The GPU measurements in one pass on a multi-GPU node (results in $OUT):
#   tests/test_gpu.py, a reference run in local mode, the time-to-verdict benchmark and the
#   busbw comparison. Usage: OUT=results REPS=5 bash bench/gpu_suite.sh
#   PY      python with torch + NCCL            (default: python3)
#   REPS    time-to-verdict rounds              (default: 5)
#   STEPS   which steps: tests,reference,faults,ttv,busbw (default: all)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT=${OUT:-gpu-results}
PY=${PY:-python3}
REPS=${REPS:-5}
STEPS=${STEPS:-tests,reference,faults,ttv,busbw}
export PYTHONUNBUFFERED=1 BENCH_PYTHON="$PY"
mkdir -p "$OUT"
has() { case ",$STEPS," in *",$1,"*) return 0 ;; *) return 1 ;; esac; }
{
  date -u
  nvidia-smi -L || true
  nvidia-smi topo -m || true
  "$PY" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "nccl", torch.cuda.nccl.version(), "gpus", torch.cuda.device_count())'
} 2>&1 | tee "$OUT/machine.txt"
if has tests; then
  "$PY" -m pytest -v -p no:cacheprovider tests/test_gpu.py 2>&1 | tee "$OUT/test_gpu.txt" || true
fi
if has reference; then
  rc=0
  "$PY" ddp_mesh_ping.py --json "$OUT/reference.json" > "$OUT/reference_output.log" 2> "$OUT/reference_output.err" || rc=$?
  echo "reference run exit $rc"
  tail -n 3 "$OUT/reference_output.log"
fi
if has faults; then
  PY="$PY" bash bench/gpu_faults.sh 2>&1 | tee "$OUT/faults.txt"
fi
if has ttv; then
  "$PY" bench/time_to_verdict.py --reps "$REPS" --log "$OUT/ttv_rank0.log" 2>&1 | tee "$OUT/time_to_verdict.txt"
fi
if has busbw; then
  "$PY" bench/busbw.py --reps 3 2>&1 | tee "$OUT/busbw.txt"
fi
