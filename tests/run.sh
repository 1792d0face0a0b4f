#!/usr/bin/env bash
# Run the test suite: builds (once) a test venv with a CPU torch, numpy, psutil, pytest,
# hypothesis, ruff, prometheus_client (the metrics' parser) and selenium (the page in a real
# browser), then runs pytest over tests/. Extra arguments go to pytest.
#   AIV_TEST_ENV     where the test venv lives          (default: .venv-test in the repo)
#   PYTHON           interpreter that creates it         (default: python3)
#   TEST_TORCH_SPEC  torch to test against               (default: torch==2.13.0; a CPU build where
#                    pip's index serves one, e.g. PIP_INDEX_URL=https://download.pytorch.org/whl/cpu)
# The Slurm tests (tests/test_slurm.py) run only as root with slurmctld/slurmd installed and
# skip with a reason otherwise; .ci/run installs Slurm so that they always run in CI.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
AIV_TEST_ENV=${AIV_TEST_ENV:-.venv-test}
PYTHON=${PYTHON:-python3}
TEST_TORCH_SPEC=${TEST_TORCH_SPEC:-torch==2.13.0}
py="$AIV_TEST_ENV/bin/python"
if ! "$py" -c 'import torch, numpy, psutil, pytest, hypothesis, prometheus_client, selenium' >/dev/null 2>&1; then
  echo "tests/run.sh: building the test venv at $AIV_TEST_ENV ($TEST_TORCH_SPEC)"
  "$PYTHON" -m venv "$AIV_TEST_ENV"
  "$py" -m pip install -q --upgrade pip
  "$py" -m pip install -q "$TEST_TORCH_SPEC" numpy psutil pytest hypothesis ruff prometheus_client selenium
fi
exec "$py" -m pytest tests "$@"
