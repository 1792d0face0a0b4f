#!/usr/bin/env bash
# Run the test suite: builds (once) a test venv with a CPU torch, numpy, psutil, pytest,
# pytest-xdist, hypothesis, ruff, prometheus_client (the metrics' parser), selenium (the page
# in a real browser) and kubernetes-validate with PyYAML (the k8s/ manifests, offline), then runs
# pytest over tests/ on TEST_WORKERS parallel workers.
#   tests/run.sh                          the whole suite
#   tests/run.sh tests/test_hangs.py -x   just that file (any file, directory or node id given as
#                                         an argument replaces tests/); other arguments go to pytest
# Output: a line per test as it ends ([gwN] PASSED tests/...), the skip and failure reasons (-ra),
# the slowest tests. The session's temporary files live in a directory of its own under $TMPDIR
# (tests/conftest.py), removed at its end.
# Knobs (environment):
#   AIV_TEST_ENV     where the test venv lives          (default: .venv-test in the repo)
#   PYTHON           interpreter that creates it         (default: python3)
#   TEST_TORCH_SPEC  torch to test against               (default: torch==2.13.0; a CPU build where
#                    pip's index serves one, e.g. PIP_INDEX_URL=https://download.pytorch.org/whl/cpu)
#   TEST_WORKERS     pytest-xdist workers                (default: 4, measured best on 2 cores: many
#                    tests wait out a bound with their CPU idle, and a fourth worker fills what 3
#                    leave (92% of the CPU busy instead of 80%); 0 runs in this process, without xdist)
#   TEST_DURATIONS   how many of the slowest tests to list at the end (default: 15; 0 lists all)
# Each worker that runs tests/test_slurm.py brings up a Slurm test cluster of its own (tests/slurm_cluster.sh
# keeps several apart, each in namespaces of its own); each worker gets a share of equal cost, its waits
# spread out, and an idle worker takes over half of a busy one's queue (--dist worksteal; conftest.py).
# The Slurm tests (tests/test_slurm.py) run only as root with slurmctld/slurmd installed and
# skip with a reason otherwise; .ci/run installs Slurm so that they always run in CI.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
AIV_TEST_ENV=${AIV_TEST_ENV:-.venv-test}
PYTHON=${PYTHON:-python3}
TEST_TORCH_SPEC=${TEST_TORCH_SPEC:-torch==2.13.0}
TEST_WORKERS=${TEST_WORKERS:-4}
TEST_DURATIONS=${TEST_DURATIONS:-15}
py="$AIV_TEST_ENV/bin/python"
if ! "$py" -c 'import torch, numpy, psutil, pytest, xdist, hypothesis, prometheus_client, selenium, kubernetes_validate, yaml' >/dev/null 2>&1; then
  echo "tests/run.sh: building the test venv at $AIV_TEST_ENV ($TEST_TORCH_SPEC)"
  "$PYTHON" -m venv "$AIV_TEST_ENV"
  "$py" -m pip install -q --upgrade pip
  "$py" -m pip install -q "$TEST_TORCH_SPEC" numpy psutil pytest pytest-xdist hypothesis ruff prometheus_client selenium \
    kubernetes-validate pyyaml
fi

# tests/ unless an argument names what to run (a path, or a node id path::test)
where=(tests)
for a in "$@"; do
  if [[ $a != -* && -e ${a%%::*} ]]; then
    where=()
    break
  fi
done
parallel=()
if [ "$TEST_WORKERS" != 0 ]; then
  parallel=(-n "$TEST_WORKERS" --dist worksteal)
fi
exec "$py" -m pytest "${parallel[@]}" -v -ra --durations="$TEST_DURATIONS" "${where[@]}" "$@"
