#!/usr/bin/env bash
# The torch compatibility run: for each torch version, a venv of its own (built once, then kept), the
# README's local run in it (ddp_mesh_ping.py in local mode: 2 gloo ranks on CPU, or one per GPU) and the
# multi-process tests that exercise the store, one file at a time. One markdown row per version
# (bench/RESULTS.md keeps the last run's table), and the path of each run's log.
#   bash bench/torch_compat.sh                    the floor, a middle and the newest (VERSIONS)
#   VERSIONS="2.3.1" bash bench/torch_compat.sh   below the floor: the local run ends with one FAILURE line
# Knobs (environment):
#   VERSIONS    torch versions, from pip's index   (default: 2.4.1 2.8.0 2.14.1: the floor, TORCH_FLOOR in
#               aiv/checks/collect.py, a middle one, and the newest that installs from PyPI here)
#   VENV_ROOT   where the venvs live, outside the repo (default: $HOME/aiv-torch-venvs; torch-X in it; PyPI's
#               Linux wheels are CUDA builds, about 4.5 GB and 90 s each)
#   TESTS       test files run in each venv        (default: tests/test_torch_compat.py, the table of docs/install.md
#               against that torch, tests/test_multiproc.py tests/test_side_channel.py
#               tests/test_torchrun.py tests/test_runtime.py)
#   LOG_DIR     each run's output                  (default: a new directory under ${TMPDIR:-/tmp})
# A test file that fails is run once more for its failed tests only (a timeout under load is re-run once
# before it counts); the row shows both. Exit 0 when every version's local run and tests passed, else 1.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
VERSIONS=${VERSIONS:-2.4.1 2.8.0 2.14.1}
VENV_ROOT=${VENV_ROOT:-$HOME/aiv-torch-venvs}
TESTS=${TESTS:-tests/test_torch_compat.py tests/test_multiproc.py tests/test_side_channel.py tests/test_torchrun.py tests/test_runtime.py}
LOG_DIR=${LOG_DIR:-$(mktemp -d "${TMPDIR:-/tmp}/torch_compat.XXXXXX")}
mkdir -p "$VENV_ROOT" "$LOG_DIR"
# what tests/run.sh imports before it uses a venv as it is (else it would build its own torch into it)
TEST_DEPS=(numpy psutil pytest pytest-xdist hypothesis prometheus_client selenium kubernetes-validate pyyaml)

venv_for() {  # $1 version -> the venv's path, built when its torch is not that version
  local v=$1 venv="$VENV_ROOT/torch-$1"
  if ! "$venv/bin/python" -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '$v')" 2>/dev/null; then
    echo "torch_compat: building $venv (torch==$v)" >&2
    python3 -m venv "$venv"
    "$venv/bin/python" -m pip install -q --upgrade pip >&2
    "$venv/bin/python" -m pip install -q "torch==$v" "${TEST_DEPS[@]}" >&2
  fi
  echo "$venv"
}

# $1 pytest log -> "P passed, F failed[, S skipped]" (pytest's last summary line)
summary() {
  local p f s
  p=$(tail -n 3 "$1" | grep -Eo '[0-9]+ passed' | grep -Eo '[0-9]+' || true)
  f=$(tail -n 3 "$1" | grep -Eo '[0-9]+ (failed|errors?)' | awk '{n += $1} END {print n + 0}')
  s=$(tail -n 3 "$1" | grep -Eo '[0-9]+ skipped' | grep -Eo '[0-9]+' || true)
  echo "${p:-0} passed, ${f:-0} failed${s:+, $s skipped}"
}

all_ok=1
rows=()
for v in $VERSIONS; do
  venv=$(venv_for "$v")
  got=$("$venv/bin/python" -c 'import torch; print(torch.__version__)')
  log="$LOG_DIR/local-$v.log"
  t0=$(date +%s%N)
  set +e
  "$venv/bin/python" ddp_mesh_ping.py >"$log" 2>&1
  rc=$?
  set -e
  secs=$(awk -v a="$t0" -v b="$(date +%s%N)" 'BEGIN {print (b - a) / 1e9}')
  if [ "$rc" = 0 ] && grep -qx 'SUCCESS: DDP Multi-Node AllReduce Ring Complete!' "$log"; then
    local_run=$(printf 'SUCCESS, exit 0, %.1f s' "$secs")
  else
    local_run=$(printf 'exit %s, %.1f s: %s' "$rc" "$secs" "$(grep -m1 '^FAILURE' "$log" || tail -n 1 "$log")")
    all_ok=0
  fi
  cells=()
  for t in $TESTS; do
    tlog="$LOG_DIR/$(basename "$t" .py)-$v.log"
    set +e
    AIV_TEST_ENV="$venv" TEST_WORKERS=0 TEST_DURATIONS=0 tests/run.sh "$t" -p no:cacheprovider >"$tlog" 2>&1
    trc=$?
    set -e
    cell="$(summary "$tlog")"
    if [ "$trc" != 0 ]; then
      mapfile -t failed < <(grep -Eo '^(FAILED|ERROR) tests/[^ ]+' "$tlog" | awk '{print $2}' | sort -u)
      if [ "${#failed[@]}" -gt 0 ]; then
        set +e
        AIV_TEST_ENV="$venv" TEST_WORKERS=0 TEST_DURATIONS=0 tests/run.sh "${failed[@]}" -p no:cacheprovider \
          >"$tlog.again" 2>&1
        trc=$?
        set -e
        cell="$cell; again: $(summary "$tlog.again")"
      fi
      [ "$trc" = 0 ] || all_ok=0
    fi
    cells+=("$cell")
  done
  row="| $got | $local_run |"
  for c in "${cells[@]}"; do
    row="$row $c |"
  done
  rows+=("$row")
  echo "torch_compat: torch $got done (logs in $LOG_DIR)" >&2
done

header="| torch | local run (2 CPU ranks, gloo) |"
rule="|---|---|"
for t in $TESTS; do
  header="$header $(basename "$t") |"
  rule="$rule---|"
done
echo "$header"
echo "$rule"
printf '%s\n' "${rows[@]}"
echo "logs: $LOG_DIR" >&2
[ "$all_ok" = 1 ]
