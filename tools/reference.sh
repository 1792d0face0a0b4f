#!/usr/bin/env bash
# tools/reference.sh -- regenerate the reference logs from the current code, in local mode (no launcher).
#
#   GPU machine (torch sees a GPU): reference_output.log and reference_output.json at the top level:
#     backend nccl, one rank per GPU, every GPU the machine has (NPROC to use fewer).
#   CPU machine: tests/reference_cpu.log and tests/reference_cpu.json: backend gloo, 2 CPU ranks.
#
# Each run must end in a clean PASS that --verify-log accepts (and, for the GPU log, say "backend nccl"
# and name an NVIDIA GPU); only then are the files replaced. A run that does not is left beside them
# as <name>.new.log / <name>.new.json and the script exits 1. tests/test_reference.py holds both logs
# to the code: a change of the output must be carried into them by running this again.
#
#   tools/reference.sh                                  # what this machine can make (MODE=auto)
#   PYTHON=python3 tools/reference.sh                   # a GPU machine whose system python has torch
#   MODE=cpu PYTHON=$HOME/aiv-env/bin/python tools/reference.sh
#
# Knobs (environment):
#   PYTHON  a python with torch (the venv bootstrap_env.sh builds, or a system python)  [python3]
#   MODE    gpu, cpu or auto (gpu when torch sees a GPU, else cpu)                   [auto]
#   NPROC   ranks of the GPU run                                  [every GPU torch sees]
# The run itself gets no AIV_* variable and no launch variable (RANK, WORLD_SIZE, SLURM_*, ...) from
# the caller's environment: the reference is the tool's defaults, in local mode.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PYTHON=${PYTHON:-python3}
MODE=${MODE:-auto}
NPROC=${NPROC:-}

die() {
  printf 'tools/reference.sh: %s\n' "$*" >&2
  exit 2
}

# the defaults, in local mode: nothing of the caller's launch or AIV_* settings reaches the run
for v in $(compgen -e); do
  case $v in
    AIV_* | RANK | WORLD_SIZE | LOCAL_RANK | LOCAL_WORLD_SIZE | MASTER_ADDR | MASTER_PORT | SLURM_* | \
      TORCHELASTIC_* | OMPI_COMM_WORLD_* | PMI_*) unset "$v" ;;
  esac
done
export PYTHONUNBUFFERED=1

gpus=$("$PYTHON" -c 'import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)') ||
  die "PYTHON=$PYTHON cannot import torch"
case $MODE in
  auto) if [ "$gpus" -gt 0 ]; then MODE=gpu; else MODE=cpu; fi ;;
  gpu) [ "$gpus" -gt 0 ] || die "MODE=gpu, but torch in $PYTHON sees no GPU" ;;
  cpu) ;;
  *) die "MODE must be gpu, cpu or auto, not '$MODE'" ;;
esac

if [ "$MODE" = gpu ]; then
  base=reference_output
  args=(--backend nccl --nproc "${NPROC:-$gpus}")
else
  base=tests/reference_cpu
  args=(--backend gloo --nproc 2)
fi
echo "tools/reference.sh: $MODE run: $PYTHON ddp_mesh_ping.py ${args[*]} --json $base.json > $base.log"
rc=0
"$PYTHON" ddp_mesh_ping.py "${args[@]}" --json "$base.new.json" >"$base.new.log" || rc=$?

problems=()
[ "$rc" -eq 0 ] || problems+=("the run exited $rc")
world=$(sed -n 's/^Total Execution Ranks: \([0-9]*\)$/\1/p' "$base.new.log" | head -n 1)
[ -n "$world" ] || problems+=("no 'Total Execution Ranks: N' line")
if ! out=$("$PYTHON" ddp_mesh_ping.py --verify-log "$base.new.log" ${world:+--expect-world-size "$world"} 2>&1); then
  problems+=("--verify-log refused it: $(printf '%s' "$out" | tail -n 1)")
fi
if [ "$MODE" = gpu ]; then
  grep -q '] local: backend nccl, device cuda' "$base.new.log" || problems+=("no 'local: backend nccl, device cuda' line")
  grep -Eq '^    rank=0 .* gpu="?NVIDIA ' "$base.new.log" || problems+=("rank 0 names no NVIDIA GPU")
fi
if [ ${#problems[@]} -gt 0 ]; then
  grep -E '^FAILURE:' "$base.new.log" >&2 || true
  printf 'tools/reference.sh: %s; kept as %s.new.log and %s.new.json, the reference is unchanged\n' \
    "$(IFS=';'; printf '%s' "${problems[*]}")" "$base" "$base" >&2
  exit 1
fi
mv -f "$base.new.json" "$base.json"
mv -f "$base.new.log" "$base.log"
echo "tools/reference.sh: wrote $base.log and $base.json ($world rank(s), $MODE); now run: tests/run.sh tests/test_reference.py"
