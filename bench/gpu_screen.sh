#!/usr/bin/env bash
# The performance screen on a host with 2 GPUs (local mode, NCCL, one rank per GPU); results in $OUT.
#   1. cost: ROUNDS rounds, each a run with the screen and a run with --skip-screen (order alternating
#      round by round); per run the phase times from its JSON, then the medians: the screen's four
#      phases together (target: at most 3 s on 2x H200) and the whole run with and without it.
#   2. a loaded GPU: a second process runs bf16 matmuls on GPU 1 (started before the run, killed
#      after it) while a run screens: rank 1 with GPU 1's UUID must be named under gpu-perf (FAIL);
#      the same run without the load must PASS.
# Exit 0 when both expectations hold and the screen's median is within TARGET_S, else 1.
# Usage: OUT=results bash bench/gpu_screen.sh
#   PY        python with torch + NCCL                          (default: python3)
#   ROUNDS    rounds of part 1                                  (default: 5)
#   TIMEOUT   --timeout of every run                            (default: 60)
#   LOAD_S    seconds the second process keeps GPU 1 busy at most (default: 60)
#   TARGET_S  the screen's median budget                        (default: 3)
#   CUDA_VISIBLE_DEVICES  the two GPUs                          (default: 0,1)
# The second process shares GPU 1 with rank 1: a GPU in EXCLUSIVE_PROCESS compute mode refuses it.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY=${PY:-python3}
OUT=${OUT:-gpu-screen-results}
ROUNDS=${ROUNDS:-5}
TIMEOUT=${TIMEOUT:-60}
LOAD_S=${LOAD_S:-60}
TARGET_S=${TARGET_S:-3}
export CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0,1} PYTHONUNBUFFERED=1
mkdir -p "$OUT"
{
  date -u
  nvidia-smi -L || true
  "$PY" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "nccl", torch.cuda.nccl.version(), "gpus", torch.cuda.device_count())'
} 2>&1 | tee "$OUT/machine.txt"

preflight() { # preflight NAME [ARGS...]: one local-mode run; its log and JSON under $OUT; prints its exit code
  local name=$1 rc=0
  shift
  "$PY" ddp_mesh_ping.py --timeout "$TIMEOUT" --json "$OUT/$name.json" "$@" > "$OUT/$name.log" 2>&1 || rc=$?
  echo "$rc"
}

# ---- 1. cost: interleaved rounds
for ((i = 1; i <= ROUNDS; i++)); do
  if ((i % 2)); then order="screen skip"; else order="skip screen"; fi
  for kind in $order; do
    if [ "$kind" = screen ]; then rc=$(preflight "screen-$i"); else rc=$(preflight "skip-$i" --skip-screen); fi
    echo "round $i $kind: exit $rc"
  done
done 2>&1 | tee "$OUT/cost_runs.txt"

"$PY" - "$OUT" "$ROUNDS" "$TARGET_S" <<'PYEOF' 2>&1 | tee "$OUT/cost.txt"
import json, os, statistics, sys
sys.path.insert(0, os.getcwd())
from ddp_mesh_ping import SCREEN_PHASES as SCREEN, _phase_times
out, rounds, target = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
def load(name):
    path = os.path.join(out, name + ".json")
    return json.load(open(path)) if os.path.exists(path) else None
screen_s, with_s, without_s = [], [], []
for i in range(1, rounds + 1):
    for kind in ("screen", "skip"):
        d = load(f"{kind}-{i}")
        if d is None:
            print(f"round {i} {kind}: no JSON")
            continue
        ph = d.get("phases") or {}
        own = sum(ph.get(p, 0.0) for p in SCREEN)
        print(f"round {i} {kind:6s} verdict={d['verdict']} elapsed={d['elapsed_s']:.2f}s " + _phase_times(ph)
              + (f" screen={own:.2f}" if kind == "screen" else ""))
        if kind == "screen":
            screen_s.append(own)
            with_s.append(d["elapsed_s"])
            for g in (d.get("screen") or {}).get("gpu") or []:
                facts = {k: g[k] for k in ("pcie_width", "pcie_speed", "sm_mhz", "throttle", "temp_c", "power_w") if k in g}
                print(f"    rank {g['rank']} {g.get('uuid')}: {g['tflops']:.1f} TFLOPS, {g['hbm_gbps']:.0f} GB/s {facts}")
            for g in (d.get("screen") or {}).get("intra") or []:
                print(f"    intra {g['host']}: busbw {g['busbw']:.1f} GB/s")
        else:
            without_s.append(d["elapsed_s"])
med = lambda v: statistics.median(v) if v else float("nan")
print(f"median screen phases {med(screen_s):.2f}s over {len(screen_s)} run(s) (target <= {target:g}s); "
      f"median run {med(with_s):.2f}s with the screen, {med(without_s):.2f}s without")
print("COST", "OK" if screen_s and med(screen_s) <= target else "OVER")
PYEOF

# ---- 2. a loaded GPU 1
rm -f "$OUT/load.ready"
"$PY" - "$LOAD_S" "$OUT/load.ready" <<'PYEOF' > "$OUT/load.txt" 2>&1 &
import sys, time, torch
dev = torch.device("cuda", 1)
a = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
b = torch.randn_like(a)
torch.mm(a, b)
torch.cuda.synchronize(dev)
open(sys.argv[2], "w").write("ready\n")
end, n = time.monotonic() + float(sys.argv[1]), 0
while time.monotonic() < end:
    for _ in range(20):
        torch.mm(a, b)
    torch.cuda.synchronize(dev)
    n += 20
print(f"load: {n} bf16 matmuls on GPU 1")
PYEOF
load_pid=$!
k=0
while [ ! -e "$OUT/load.ready" ] && [ "$k" -lt 600 ]; do
  sleep 0.1
  k=$((k + 1))
done
loaded_rc=$(preflight loaded)
kill "$load_pid" 2>/dev/null || true
wait "$load_pid" 2>/dev/null || true
unloaded_rc=$(preflight unloaded)
echo "loaded run exit $loaded_rc, unloaded run exit $unloaded_rc" | tee "$OUT/load_result.txt"

"$PY" - "$OUT" <<'PYEOF' 2>&1 | tee -a "$OUT/load_result.txt"
import json, os, sys
out = sys.argv[1]
def load(name):
    path = os.path.join(out, name + ".json")
    return json.load(open(path)) if os.path.exists(path) else {}
d, u = load("loaded"), load("unloaded")
uuid = next((r["gpu"]["uuid"] for r in d.get("ranks") or [] if r["rank"] == 1 and r.get("gpu")), None)
perf = [f for f in d.get("findings") or [] if f["check"] == "gpu-perf" and f["status"] != "PASS"]
for f in perf:
    print(f"loaded: [{f['status']}] gpu-perf: {f['reason']}")
named = any(f["status"] == "FAIL" and f["ranks"] == [1] and uuid and uuid in f["reason"] for f in perf)
others = [f for f in perf if f["ranks"] != [1] and f["status"] == "FAIL"]
print(f"loaded: verdict {d.get('verdict')}, GPU 1 (rank 1, {uuid}) named under gpu-perf: {'yes' if named else 'NO'}; "
      f"other GPUs failed: {len(others)}")
for f in u.get("findings") or []:
    if f["status"] != "PASS":
        print(f"unloaded: [{f['status']}] {f['check']}: {f['reason']}")
print(f"unloaded: verdict {u.get('verdict')}")
print("LOAD", "OK" if named and not others and u.get("verdict") == "PASS" else "NOT MET")
PYEOF

if grep -q "^COST OK" "$OUT/cost.txt" && grep -q "^LOAD OK" "$OUT/load_result.txt"; then
  echo "gpu_screen: expectations met (results in $OUT)"
else
  echo "gpu_screen: expectations NOT met (results in $OUT)"
  exit 1
fi
