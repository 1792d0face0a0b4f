#!/usr/bin/env bash
# The GPU affinity faults, launched by hand as srun would, with their printed verdicts:
#   1. two ranks forced onto one GPU (both see CUDA_VISIBLE_DEVICES=0)   -> exit 1, gpu-affinity
#   2. LOCAL_RANK beyond the visible GPUs (3 ranks, 2 GPUs)             -> exit 1, device
# Usage: bash bench/gpu_faults.sh   (PY: python with torch + NCCL, default python3)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY=${PY:-python3}
TIMEOUT=${TIMEOUT:-60}
run() {  # $1 label, $2 world size, $3 CUDA_VISIBLE_DEVICES
  local label=$1 world=$2 cvd=$3 port r rc pids=()
  port=$("$PY" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
  echo "== $label: WORLD_SIZE=$world CUDA_VISIBLE_DEVICES=$cvd"
  local t0=$SECONDS
  for ((r = 0; r < world; r++)); do
    RANK=$r LOCAL_RANK=$r WORLD_SIZE=$world MASTER_ADDR=127.0.0.1 MASTER_PORT=$port CUDA_VISIBLE_DEVICES=$cvd \
      "$PY" ddp_mesh_ping.py --timeout "$TIMEOUT" > "/tmp/aiv-fault-$label-$r.log" 2>&1 &
    pids+=($!)
  done
  for ((r = 0; r < world; r++)); do
    rc=0
    wait "${pids[$r]}" || rc=$?
    echo "rank $r exit $rc"
  done
  echo "verdict after $((SECONDS - t0)) s; rank 0 says:"
  grep -E '^(FAILURE|SUCCESS|Verdict)|rendezvous: .*checked in' "/tmp/aiv-fault-$label-0.log" || true
  if grep -l Traceback /tmp/aiv-fault-"$label"-*.log; then echo "(traceback found above)"; fi
  rm -f /tmp/aiv-fault-"$label"-*.log
}
run two-ranks-one-gpu 2 0
run local-rank-beyond-gpus 3 0,1
