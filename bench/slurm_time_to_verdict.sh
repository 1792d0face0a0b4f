#!/usr/bin/env bash
# Time to PASS under real Slurm at NODES x RPN gloo ranks (the test cluster of tests/slurm_cluster.sh: each
# node its own network namespace on this machine) against the DDP floor program (bench/floor_ddp.py:
# import torch, init, one all_reduce, one DDP step on nn.Linear(10, 10)) launched the same way: one srun
# step per run, ROUNDS interleaved rounds, wall time of the srun command. Prints each run, the medians,
# the ratio, and the tool's per-phase medians from rank 0's "Verdict: ... phases=" line.
# Usage (root): OUT=results bash bench/slurm_time_to_verdict.sh
#   PY       python with torch (a venv of tests/run.sh)   (default: .venv-test/bin/python)
#   NODES    nodes                                        (default: 8)
#   RPN      ranks per node                               (default: 2)
#   ROUNDS   interleaved rounds                           (default: 3)
#   ONLY     which runs, in order: floor, ours, skip       (default: floor,ours)
#   AIV_SLURM_DIR  the cluster's state (default: a new temporary directory, removed at the end)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
ROOT=$PWD
PY=${PY:-$ROOT/.venv-test/bin/python}
NODES=${NODES:-8}
RPN=${RPN:-2}
ROUNDS=${ROUNDS:-3}
ONLY=${ONLY:-floor,ours}
OUT=${OUT:-slurm-time-results}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
own_dir=0
if [[ -z "${AIV_SLURM_DIR:-}" ]]; then
  AIV_SLURM_DIR=$(mktemp -d /tmp/aiv-bench-slurm.XXXXXX)
  own_dir=1
fi
export AIV_SLURM_DIR
cluster() { bash "$ROOT/tests/slurm_cluster.sh" "$@"; }
finish() {
  cluster down || true
  if [[ $own_dir == 1 ]]; then rm -rf "$AIV_SLURM_DIR"; fi
}
SLURM_NODES=$NODES NODE_CPUS=$((RPN * 2)) NODE_GPUS=0 cluster up
trap finish EXIT

# one srun step; the ranks see srun's variables (the floor maps them to torch's, the tool reads them itself)
step() {
  local what=$1 port=$2
  case $what in
    floor) cluster exec srun -N "$NODES" --ntasks-per-node="$RPN" --time=10 bash -c \
      "RANK=\$SLURM_PROCID LOCAL_RANK=\$SLURM_LOCALID WORLD_SIZE=\$SLURM_NTASKS MASTER_ADDR=node1 \
       MASTER_PORT=$port exec $PY $ROOT/bench/floor_ddp.py" ;;
    ours) cluster exec srun -N "$NODES" --ntasks-per-node="$RPN" --time=10 \
      "$PY" "$ROOT/ddp_mesh_ping.py" --backend gloo --timeout 120 ;;
    skip) cluster exec srun -N "$NODES" --ntasks-per-node="$RPN" --time=10 \
      "$PY" "$ROOT/ddp_mesh_ping.py" --backend gloo --timeout 120 --skip-screen ;;
  esac
}

: >"$OUT/runs.txt"
IFS=, read -r -a runs <<<"$ONLY"
for ((r = 1; r <= ROUNDS; r++)); do
  for what in "${runs[@]}"; do
    t0=$(date +%s.%N)
    rc=0
    step "$what" $((29500 + r)) >"$OUT/$what-$r.log" 2>&1 || rc=$?
    secs=$(awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN{printf "%.2f", b-a}')
    echo "round $r $what ${secs}s exit=$rc" | tee -a "$OUT/runs.txt"
  done
done
"$PY" - "$OUT" "${runs[@]}" <<'PYEOF' | tee "$OUT/summary.txt"
import re, statistics, sys, pathlib
out, runs = pathlib.Path(sys.argv[1]), sys.argv[2:]
rows = [ln.split() for ln in (out / "runs.txt").read_text().splitlines()]
secs = {w: [float(r[3][:-1]) for r in rows if r[2] == w] for w in runs}
med = {w: statistics.median(v) for w, v in secs.items() if v}
for w, v in secs.items():
    print(f"{w:6s} median {med[w]:6.2f}s  min {min(v):6.2f}s  max {max(v):6.2f}s  (exit codes: "
          f"{sorted({r[4] for r in rows if r[2] == w})})")
for w in ("ours", "skip"):
    if w in med and "floor" in med:
        print(f"{w} / floor = {med[w] / med['floor']:.3f}")
for w in ("ours", "skip"):
    phases = []
    for log in sorted(out.glob(f"{w}-*.log")):
        m = re.search(r"^Verdict: .* phases=(.*)$", log.read_text(errors="replace"), re.M)
        if m:
            phases.append({k: float(v) for k, v in re.findall(r"([\w-]+)=([\d.]+)", m.group(1))})
    if phases:
        print(f"\n{w}: phase medians (s)")
        for k in phases[0]:
            print(f"  {k:15s} {statistics.median(p.get(k, 0.0) for p in phases):7.2f}")
PYEOF
