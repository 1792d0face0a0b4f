#!/usr/bin/env bash
# bootstrap_env.sh -- build the shared Python venv that ddp_mesh_ping.py runs from on every node.
#
# Run it once, on any node that mounts the shared filesystem (a login node is fine), as a user who
# can write to PYTORCH_ENV.  Every node then runs the preflight with that venv's python, so
# PYTORCH_ENV must be on a filesystem mounted at the same path on all nodes, and so must the
# interpreter it is built from (PYTHON: a venv links to it): the same Python version at the same
# path on every node, readable by every user who runs the preflight (a python under a private
# home directory, e.g. pyenv's, is not; the script warns about that).
#
#   bash bootstrap_env.sh
#   PYTORCH_ENV=$HOME/pytorch_env bash bootstrap_env.sh
#   bash bootstrap_env.sh --index-url https://download.pytorch.org/whl/cu128
#   EXTRA_PIP_ARGS=--no-index bash bootstrap_env.sh --find-links /shared/wheelhouse   # offline
#
# Options (each one wins over its environment variable):
#   --index-url URL     same as INDEX_URL
#   --find-links DIR    same as FIND_LINKS
#   -h, --help          print this text
#
# Environment variables [default]:
#   PYTORCH_ENV       where the venv goes [/shared/apps/pytorch_env]
#   PYTHON            interpreter that creates the venv; it needs the venv and ensurepip modules
#                     (Debian/Ubuntu: apt-get install python3-venv) [python3]
#   TORCH_SPEC        [torch==2.14.1]
#   TORCHVISION_SPEC  [torchvision==0.29.1]
#   TORCHAUDIO_SPEC   [torchaudio==2.11.1]
#   PSUTIL_SPEC       [psutil]
#   NUMPY_SPEC        [numpy]  object collectives in torch.distributed need numpy
#                     Each spec is one pip requirement (name==version, name>=version, a wheel
#                     path).  An empty TORCHVISION_SPEC, TORCHAUDIO_SPEC or PSUTIL_SPEC leaves
#                     that package out.  Keep torch pinned: an unpinned torch may pull a
#                     different multi-GB CUDA build.
#   INDEX_URL         package index used instead of PyPI (pip --index-url): a local mirror, or a
#                     CUDA-specific PyTorch index such as https://download.pytorch.org/whl/cu128
#                     (if that index lacks psutil or numpy, also pass
#                     EXTRA_PIP_ARGS="--extra-index-url https://pypi.org/simple") [pip's own setting]
#   FIND_LINKS        wheelhouse directory (or URL) searched for packages (pip --find-links) [unset]
#   EXTRA_PIP_ARGS    more arguments for pip install, split on whitespace (no quoting, no globbing),
#                     e.g. "--no-index" offline, "--force-reinstall" to reinstall everything [empty]
#   UPGRADE_PIP       1: upgrade pip inside the venv first (a failure, e.g. offline, only warns);
#                     0: keep the pip that venv installed [1]
#
# What it does:
#   1. creates the venv with "$PYTHON -m venv" unless PYTORCH_ENV already is one (an empty
#      directory is used; any other existing directory is refused, never overwritten);
#   2. upgrades pip in it and installs every spec with the venv's pip in one resolution, so the
#      versions fit together or pip says why they don't;
#   3. imports torch, torchvision, torchaudio, psutil and numpy with the venv's python and prints
#      one "name version" line each, then "CUDA available: ..." (False is expected on a node
#      without GPUs, such as a login node; the preflight checks the GPUs on the compute nodes).
#   Files are created with umask 022, readable by every user whose jobs run the preflight.
#   Re-running is safe and fast: when the venv already satisfies every spec (pip --dry-run,
#   offline, against what is installed) and every package imports, pip installs nothing and the
#   script says "nothing changed".
#
# Exit codes: 0 ready; 1 install error (pip failed, or a package does not import); 2 usage or
# setup error (bad option, PYTHON without venv/ensurepip, PYTORCH_ENV not writable or not a venv).
set -euo pipefail

umask 022
# the checks below must see the venv alone
unset PYTHONPATH PYTHONHOME

usage() { awk 'NR == 1 { next } /^#/ { sub(/^# ?/, ""); print; next } { exit }' "${BASH_SOURCE[0]}"; }
fail() {
  local code=$1
  shift
  printf 'ERROR: %s\n' "$*" >&2
  exit "$code"
}
warn() { printf 'WARNING: %s\n' "$*" >&2; }
say() { printf '==> %s\n' "$*"; }
last_line() { printf '%s\n' "$1" | awk 'NF { line = $0 } END { sub(/^[ \t]+/, "", line); print line }'; }
whoami_() { id -un 2>/dev/null || id -u; }

PYTORCH_ENV=${PYTORCH_ENV:-/shared/apps/pytorch_env}
PYTHON=${PYTHON:-python3}
TORCH_SPEC=${TORCH_SPEC:-torch==2.14.1}
TORCHVISION_SPEC=${TORCHVISION_SPEC-torchvision==0.29.1}
TORCHAUDIO_SPEC=${TORCHAUDIO_SPEC-torchaudio==2.11.1}
PSUTIL_SPEC=${PSUTIL_SPEC-psutil}
NUMPY_SPEC=${NUMPY_SPEC:-numpy}
INDEX_URL=${INDEX_URL:-}
FIND_LINKS=${FIND_LINKS:-}
EXTRA_PIP_ARGS=${EXTRA_PIP_ARGS:-}
UPGRADE_PIP=${UPGRADE_PIP:-1}

while [ $# -gt 0 ]; do
  case $1 in
    -h | --help)
      usage
      exit 0
      ;;
    --index-url)
      [ $# -ge 2 ] || fail 2 "--index-url needs a URL (see --help)"
      INDEX_URL=$2
      shift 2
      ;;
    --index-url=*)
      INDEX_URL=${1#*=}
      shift
      ;;
    --find-links)
      [ $# -ge 2 ] || fail 2 "--find-links needs a directory (see --help)"
      FIND_LINKS=$2
      shift 2
      ;;
    --find-links=*)
      FIND_LINKS=${1#*=}
      shift
      ;;
    *) fail 2 "unknown argument: $1 (see --help)" ;;
  esac
done

case $UPGRADE_PIP in
  0 | 1) ;;
  *) fail 2 "UPGRADE_PIP must be 0 or 1, not '$UPGRADE_PIP'" ;;
esac

# absolute path without trailing slashes: it ends up in every hint and in the venv's scripts
while [ "${PYTORCH_ENV%/}" != "$PYTORCH_ENV" ]; do PYTORCH_ENV=${PYTORCH_ENV%/}; done
[ -n "$PYTORCH_ENV" ] || fail 2 "PYTORCH_ENV must name a directory, not /"
case $PYTORCH_ENV in
  /*) ;;
  *) PYTORCH_ENV=$PWD/$PYTORCH_ENV ;;
esac

if [ -n "$FIND_LINKS" ]; then
  case $FIND_LINKS in
    *://*) ;;
    *)
      [ -e "$FIND_LINKS" ] || fail 2 "FIND_LINKS: no such directory: $FIND_LINKS"
      case $FIND_LINKS in /*) ;; *) FIND_LINKS=$PWD/$FIND_LINKS ;; esac
      ;;
  esac
fi

# EXTRA_PIP_ARGS: split on whitespace only (read -a neither evaluates nor globs)
EXTRA_ARGS=()
read -r -d '' -a EXTRA_ARGS <<<"$EXTRA_PIP_ARGS" || true

PIP_COMMON=(--disable-pip-version-check ${EXTRA_ARGS[@]+"${EXTRA_ARGS[@]}"})
PIP_OPTS=("${PIP_COMMON[@]}")
if [ -n "$INDEX_URL" ]; then PIP_OPTS+=(--index-url "$INDEX_URL"); fi
if [ -n "$FIND_LINKS" ]; then PIP_OPTS+=(--find-links "$FIND_LINKS"); fi

# specs, and the module each one must make importable (same order)
SPECS=()
MODULES=()
add_spec() {
  if [ -n "$2" ]; then
    SPECS+=("$2")
    MODULES+=("$1")
  fi
}
add_spec torch "$TORCH_SPEC"
add_spec torchvision "$TORCHVISION_SPEC"
add_spec torchaudio "$TORCHAUDIO_SPEC"
add_spec psutil "$PSUTIL_SPEC"
add_spec numpy "$NUMPY_SPEC"

SCRIPT_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
VPY=$PYTORCH_ENV/bin/python
START=$SECONDS

# Imports each module named in argv; one "name version" line each, then the CUDA line.  A module
# that does not import: one ERROR line on stderr, exit 1.
# shellcheck disable=SC2016  # python code, not shell
IMPORT_CHECK='
import importlib, importlib.metadata, sys
for name in sys.argv[1:]:
    try:
        mod = importlib.import_module(name)
    except KeyboardInterrupt:
        raise
    except BaseException as exc:
        lines = [l.strip() for l in str(exc).splitlines() if l.strip()]
        detail = type(exc).__name__ + (": " + lines[-1] if lines else "")
        print("ERROR: %s failed to import in %s: %s" % (name, sys.prefix, detail), file=sys.stderr, flush=True)
        sys.exit(1)
    version = getattr(mod, "__version__", None)
    if not isinstance(version, str):
        try:
            version = importlib.metadata.version(name)
        except Exception:
            version = "(version unknown)"
    print(name, str(version), flush=True)
torch = sys.modules.get("torch")
if torch is not None:
    build = getattr(getattr(torch, "version", None), "cuda", None)
    hip = getattr(getattr(torch, "version", None), "hip", None)
    build = "CUDA " + build if build else ("ROCm " + hip if hip else None)
    try:
        available = bool(torch.cuda.is_available())
        count = torch.cuda.device_count() if available else 0
    except Exception as exc:
        available, count = None, 0
        build = (build or "unknown build") + ", " + type(exc).__name__ + " from torch.cuda"
    if build is None:
        print("CUDA available: %s (CPU-only torch build: GPU nodes need a CUDA build, "
              "e.g. INDEX_URL=https://download.pytorch.org/whl/cu128)" % available)
    elif available:
        print("CUDA available: True (%d GPU(s) here; torch built for %s)" % (count, build))
    else:
        print("CUDA available: %s (torch built for %s; no usable GPU on this node)" % (available, build))
'

# Prints "<base interpreter> (<path> is mode NNNN)" when a user other than the owner could not run
# or read the interpreter this python's venvs link to (its path as venv records it, and the file it
# resolves to, plus the standard library); prints nothing when everyone can.
# shellcheck disable=SC2016  # python code, not shell
ACCESS_CHECK='
import os, stat, sys, sysconfig
exe = os.path.abspath(getattr(sys, "_base_executable", None) or sys.executable)
for target, need in ((exe, stat.S_IXOTH), (os.path.realpath(exe), stat.S_IXOTH),
                     (sysconfig.get_paths()["stdlib"], stat.S_IROTH | stat.S_IXOTH)):
    chain, p = [], target
    while True:
        chain.append(p)
        parent = os.path.dirname(p)
        if parent == p:
            break
        p = parent
    for p in reversed(chain):
        want = need if p == target else stat.S_IXOTH
        mode = os.stat(p).st_mode
        if mode & want != want:
            print("%s (%s is mode %04o)" % (exe, p, stat.S_IMODE(mode)))
            sys.exit(0)
'

# Prints the versions; returns 0 when every module imports, 1 otherwise (after one ERROR line).
check_imports() {
  local out rc=0 n
  out=$("$VPY" -I -c "$IMPORT_CHECK" "${MODULES[@]}") || rc=$?
  if [ -n "$out" ]; then printf '%s\n' "$out"; fi
  [ "$rc" -eq 0 ] && return 0
  if [ "$rc" -ne 1 ]; then
    # the interpreter died (e.g. a signal from a native extension): the culprit is the first
    # module without a version line
    n=$(printf '%s\n' "$out" | grep -c . || true)
    printf 'ERROR: %s crashed the venv python on import (exit code %s)\n' "${MODULES[$n]:-python}" "$rc" >&2
  fi
  return 1
}

# True when pip, offline and against what is installed, has nothing to install for SPECS.
satisfied() {
  local report
  report=$("$VPY" -m pip install --dry-run --quiet --report - --no-index "${PIP_COMMON[@]}" "${SPECS[@]}" 2>/dev/null) ||
    return 1
  printf '%s' "$report" | "$VPY" -I -c '
import json, sys
sys.exit(1 if json.load(sys.stdin).get("install") else 0)' 2>/dev/null
}

# pip options that make the dry run above meaningless (they install what is already there)
forces_install() {
  local a
  for a in ${EXTRA_ARGS[@]+"${EXTRA_ARGS[@]}"}; do
    case $a in
      -U | --upgrade | --upgrade-strategy* | --force-reinstall | -I | --ignore-installed) return 0 ;;
    esac
  done
  return 1
}

next_steps() {
  local env_prefix=""
  if [ "$PYTORCH_ENV" != /shared/apps/pytorch_env ]; then env_prefix="PYTORCH_ENV=$PYTORCH_ENV "; fi
  echo "Run: $VPY $SCRIPT_DIR/ddp_mesh_ping.py"
  echo "Slurm, every node: cd $SCRIPT_DIR && ${env_prefix}sbatch submit_smoke_test.sbatch"
}

# Fails unless the current user can create (or write into) $1.
need_writable() {
  local path=$1 probe
  if [ -e "$path" ]; then
    if [ ! -w "$path" ] || [ ! -x "$path" ]; then
      fail 2 "$path is not writable by user $(whoami_); run as a user who can write there, or set PYTORCH_ENV to a writable path on the shared filesystem"
    fi
    return 0
  fi
  probe=$(dirname "$path")
  while [ ! -e "$probe" ]; do probe=$(dirname "$probe"); done
  [ -d "$probe" ] || fail 2 "cannot create $path: $probe is not a directory"
  if [ ! -w "$probe" ] || [ ! -x "$probe" ]; then
    fail 2 "cannot create $path: $probe is not writable by user $(whoami_); run as a user who can write there, or set PYTORCH_ENV to a writable path on the shared filesystem"
  fi
}

# ---- what is at PYTORCH_ENV now: nothing, an empty directory, or a venv ----
state=absent
if [ -L "$PYTORCH_ENV" ] && [ ! -e "$PYTORCH_ENV" ]; then
  fail 2 "$PYTORCH_ENV is a dangling symlink; remove it or set PYTORCH_ENV to another path"
elif [ -e "$PYTORCH_ENV" ]; then
  if [ ! -d "$PYTORCH_ENV" ]; then
    fail 2 "$PYTORCH_ENV exists and is not a directory; remove it or set PYTORCH_ENV to another path"
  elif [ -f "$PYTORCH_ENV/pyvenv.cfg" ]; then
    state=venv
  elif [ -z "$(find "$PYTORCH_ENV" -mindepth 1 -maxdepth 1 -print -quit 2>/dev/null)" ]; then
    state=empty
  else
    fail 2 "$PYTORCH_ENV exists and is not a Python venv (no pyvenv.cfg); left untouched: remove it or set PYTORCH_ENV to another path"
  fi
fi

if [ "$state" = venv ]; then
  if [ ! -x "$VPY" ] || ! "$VPY" -I -c '' >/dev/null 2>&1; then
    base_home=$(sed -n 's/^home *= *//p' "$PYTORCH_ENV/pyvenv.cfg" 2>/dev/null | head -n 1)
    fail 2 "the venv at $PYTORCH_ENV does not run for user $(whoami_): $VPY fails (is its base python in ${base_home:-?} missing, or not accessible to this user?); fix that, or remove the venv and re-run"
  fi
  if ! "$VPY" -m pip --version >/dev/null 2>&1; then
    need_writable "$PYTORCH_ENV"
    say "the venv at $PYTORCH_ENV has no pip; adding it with ensurepip"
    out=$("$VPY" -m ensurepip --upgrade --default-pip 2>&1) ||
      fail 2 "the venv at $PYTORCH_ENV has no pip and ensurepip failed: $(last_line "$out"); remove it and re-run"
  fi
  # fast path: every spec already satisfied and every package imports -> pip is not run
  if ! forces_install && satisfied; then
    say "checking the venv at $PYTORCH_ENV ($VPY)"
    check_imports || exit 1
    echo "pytorch env at $PYTORCH_ENV is up to date; nothing changed ($((SECONDS - START)) s)"
    next_steps
    exit 0
  fi
  say "the venv at $PYTORCH_ENV does not satisfy every spec yet; updating it"
  need_writable "$PYTORCH_ENV"
  need_writable "$PYTORCH_ENV/bin"
  purelib=$("$VPY" -I -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  need_writable "$purelib"
else
  need_writable "$PYTORCH_ENV"
  command -v "$PYTHON" >/dev/null 2>&1 || fail 2 "PYTHON=$PYTHON: no such interpreter (set PYTHON to a python3 that has the venv module)"
  pyver=$("$PYTHON" -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null) ||
    fail 2 "PYTHON=$PYTHON does not run"
  "$PYTHON" -c 'import venv' >/dev/null 2>&1 ||
    fail 2 "$PYTHON (Python $pyver) has no venv module; install it (Debian/Ubuntu: apt-get install python$pyver-venv) or set PYTHON to a python3 that has it"
  "$PYTHON" -c 'import ensurepip' >/dev/null 2>&1 ||
    fail 2 "$PYTHON (Python $pyver) lacks ensurepip, so python -m venv cannot put pip into the venv; install it (Debian/Ubuntu: apt-get install python$pyver-venv) or set PYTHON to a python3 that has it"
  # a venv links to its base interpreter: other users' jobs need every directory on the way to it
  blocked=$("$PYTHON" -I -c "$ACCESS_CHECK" 2>/dev/null) || blocked=""
  if [ -n "$blocked" ]; then
    warn "the venv will link to $blocked: other users cannot run it; for a venv shared by everyone's jobs set PYTHON to a system or shared-filesystem python (e.g. PYTHON=/usr/bin/python3)"
  fi
  say "creating the venv at $PYTORCH_ENV with $PYTHON (Python $pyver)"
  if ! out=$("$PYTHON" -m venv "$PYTORCH_ENV" 2>&1); then
    # leave nothing half-made behind: the path was absent or empty before
    if [ "$state" = absent ]; then
      rm -rf -- "$PYTORCH_ENV"
    else
      find "$PYTORCH_ENV" -mindepth 1 -delete 2>/dev/null || true
    fi
    fail 2 "$PYTHON -m venv $PYTORCH_ENV failed: $(last_line "$out")"
  fi
fi

if [ "$UPGRADE_PIP" = 1 ]; then
  say "upgrading pip in the venv"
  if ! out=$("$VPY" -m pip install --quiet --upgrade pip "${PIP_OPTS[@]}" 2>&1); then
    warn "could not upgrade pip (offline?); continuing with $("$VPY" -m pip --version 2>/dev/null | cut -d' ' -f1-2): $(last_line "$out")"
  fi
fi

say "pip install ${SPECS[*]}"
"$VPY" -m pip install "${PIP_OPTS[@]}" "${SPECS[@]}" ||
  fail 1 "pip could not install ${SPECS[*]} into $PYTORCH_ENV (pip's messages above say why)"

say "checking the venv at $PYTORCH_ENV ($VPY)"
check_imports || exit 1
echo "pytorch env at $PYTORCH_ENV is ready ($((SECONDS - START)) s)"
next_steps
