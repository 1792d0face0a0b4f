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
#   TEST_TORCH_SPEC  torch to test against               (default: torch==2.13.0+cpu, a CPU build: about
#                    250 MB; only a CPU index or a wheelhouse has it, so no CUDA build comes instead)
#   TEST_TORCH_INDEX where that build comes from, an extra index beside pip's own (default:
#                    https://download.pytorch.org/whl/cpu). Unreachable, and no wheelhouse of pip's
#                    configuration has it: the venv takes TEST_TORCH_FALLBACK from pip's own index
#                    instead, and says so (on Linux that is a CUDA build, about 3 GB)
#   TEST_TORCH_FALLBACK                                  (default: the spec without its +cpu label)
#   TEST_PIP_RETRIES, TEST_PIP_TIMEOUT  pip's --retries and --timeout while building the venv (default:
#                    1 and 15 s: an unreachable index costs seconds, not pip's 5 retries per package)
#   TEST_WORKERS     pytest-xdist workers                (default: 6, on 2 cores: most of the suite's
#                    time is tests waiting out a bound with their CPU idle, and with 5 workers the
#                    CPU was 70% busy; 0 runs in this process, without xdist)
#   TEST_DURATIONS   how many of the slowest tests to list at the end (default: 15; 0 lists all)
#   TEST_TIMELINE    a file: each test's worker, start and end appended as a JSON line (unset: none), and as
#                    root the CPU seconds it and what it started used; python3 bench/suite_timeline.py FILE
#                    says where the time went
#   AIV_TEST_FORK    1 (default): the tests' runs of the tool are forked from a fork server per pytest process,
#                    which imported torch once (tests/fork_server.py), instead of each importing torch itself,
#                    and a forked run's local launcher forks its ranks in place; a Kubernetes pod's run forks
#                    into namespaces of its own, and a Slurm job's ranks and node gates into their node's
#                    (tests/fork_task.py); a start a fork cannot reproduce is still a plain process.
#                    0: every run a plain process (a pod's under unshare)
#   TEST_SCREEN_RUNS how many times the 4-node healthy screen runs on Slurm (default: 1; more, to see
#                    that no run on a loaded machine names a healthy node)
#   TEST_FORK_LOG    a file: a JSON line for each run of the tool started as a plain process, and why (unset: none)
# Each worker that runs tests/test_slurm.py brings up a Slurm test cluster of its own (tests/slurm_cluster.sh
# keeps several apart, each in namespaces of its own); each worker gets a share of equal cost, its waits
# spread out, and an idle worker takes over half of a busy one's queue (--dist worksteal; conftest.py).
# The Slurm tests (tests/test_slurm.py) run only as root with slurmctld/slurmd installed and
# skip with a reason otherwise; .ci/run installs Slurm so that they always run in CI.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
AIV_TEST_ENV=${AIV_TEST_ENV:-.venv-test}
PYTHON=${PYTHON:-python3}
TEST_TORCH_SPEC=${TEST_TORCH_SPEC:-torch==2.13.0+cpu}
TEST_TORCH_INDEX=${TEST_TORCH_INDEX:-https://download.pytorch.org/whl/cpu}
TEST_TORCH_FALLBACK=${TEST_TORCH_FALLBACK:-${TEST_TORCH_SPEC%+*}}
TEST_PIP_RETRIES=${TEST_PIP_RETRIES:-1}
TEST_PIP_TIMEOUT=${TEST_PIP_TIMEOUT:-15}
TEST_WORKERS=${TEST_WORKERS:-6}
TEST_DURATIONS=${TEST_DURATIONS:-15}
py="$AIV_TEST_ENV/bin/python"
if ! "$py" -c 'import torch, numpy, psutil, pytest, xdist, hypothesis, prometheus_client, selenium, kubernetes_validate, yaml' >/dev/null 2>&1; then
  echo "tests/run.sh: building the test venv at $AIV_TEST_ENV ($TEST_TORCH_SPEC)"
  "$PYTHON" -m venv "$AIV_TEST_ENV"
  pip_opts=(-q --retries "$TEST_PIP_RETRIES" --timeout "$TEST_PIP_TIMEOUT")
  t0=$SECONDS
  "$py" -m pip install "${pip_opts[@]}" --upgrade pip
  if ! "$py" -m pip install "${pip_opts[@]}" --extra-index-url "$TEST_TORCH_INDEX" "$TEST_TORCH_SPEC"; then
    echo "tests/run.sh: $TEST_TORCH_SPEC is not to be had from $TEST_TORCH_INDEX (unreachable?) or pip's own" \
      "sources after $((SECONDS - t0)) s; taking $TEST_TORCH_FALLBACK from pip's own index instead (on Linux a" \
      "CUDA build, about 3 GB)" >&2
    "$py" -m pip install "${pip_opts[@]}" "$TEST_TORCH_FALLBACK"
  fi
  "$py" -m pip install "${pip_opts[@]}" numpy psutil pytest pytest-xdist hypothesis ruff prometheus_client selenium \
    kubernetes-validate pyyaml
  echo "tests/run.sh: test venv built in $((SECONDS - t0)) s ($("$py" -c 'import torch; print("torch", torch.__version__)'))"
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
