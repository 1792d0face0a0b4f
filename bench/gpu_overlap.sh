#!/usr/bin/env bash
# What the screen costs on the critical path, on one GPU (NCCL, one rank): ROUNDS interleaved rounds of
# the DDP floor program (bench/floor_ddp.py: import torch, NCCL init, one DDP step), the tool with the
# screen, and the tool with --skip-screen; medians, ratios to the floor, and the screen phases' share of
# the wall time (bench/time_to_verdict.py). Targets: tool with the screen <= 1.0x the floor, share < 5%.
# Usage: OUT=results bash bench/gpu_overlap.sh
#   PY       python with torch + NCCL   (default: python3)
#   ROUNDS   interleaved rounds         (default: 5)
#   CUDA_VISIBLE_DEVICES  the GPU       (default: 0)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY=${PY:-python3}
OUT=${OUT:-gpu-overlap-results}
ROUNDS=${ROUNDS:-5}
export CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0} PYTHONUNBUFFERED=1
mkdir -p "$OUT"
{
  date -u
  nvidia-smi -L || true
  "$PY" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda)'
  BENCH_PYTHON="$PY" "$PY" bench/time_to_verdict.py --nproc 1 --reps "$ROUNDS" --only ddp,ours,skip \
    --log "$OUT/rank0.log"
} 2>&1 | tee "$OUT/gpu_overlap.txt"
grep -h "screen-gpu:\|^Verdict:" "$OUT/rank0.log" | tee "$OUT/screen_lines.txt"
