#!/usr/bin/env bash
# What the screen costs on the critical path, on one GPU (NCCL, one rank): ROUNDS interleaved rounds of
# the DDP floor program (bench/floor_ddp.py: import torch, NCCL init, one DDP step), the tool with the
# screen, the tool with --skip-screen and, with BEFORE, another version of the tool; medians, ratios to
# the floor, per-phase medians and the screen phases' share of the wall time (bench/time_to_verdict.py).
# Targets: the tool with the screen <= 1.0x the floor, the screen phases under 5% of the wall.
# Usage: OUT=results bash bench/gpu_overlap.sh
#   PY       python with torch + NCCL                      (default: python3)
#   ROUNDS   interleaved rounds                            (default: 5)
#   BEFORE   another ddp_mesh_ping.py to time beside ours  (default: none)
#   CUDA_VISIBLE_DEVICES  the GPU                          (default: 0)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY=${PY:-python3}
OUT=${OUT:-gpu-overlap-results}
ROUNDS=${ROUNDS:-5}
BEFORE=${BEFORE:-}
export CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0} PYTHONUNBUFFERED=1
mkdir -p "$OUT"
only=ddp,ours,skip
before=()
if [[ -n "$BEFORE" ]]; then
  only+=,before
  before=(--before "$BEFORE")
fi
{
  date -u
  nvidia-smi -L || true
  "$PY" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda)'
  BENCH_PYTHON="$PY" "$PY" bench/time_to_verdict.py --nproc 1 --reps "$ROUNDS" --only "$only" \
    --log "$OUT/rank0.log" "${before[@]}"
} 2>&1 | tee "$OUT/gpu_overlap.txt"
grep -h "screen-gpu:\|^Verdict:" "$OUT/rank0.log" | tee "$OUT/screen_lines.txt"
