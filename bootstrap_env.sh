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
#   bash bootstrap_env.sh --cpu        # a CPU build (the PyTorch CPU index, PyPI for the rest)
#   EXTRA_INDEX_URL=https://pypi.org/simple bash bootstrap_env.sh --index-url https://download.pytorch.org/whl/cpu
#   EXTRA_PIP_ARGS=--no-index bash bootstrap_env.sh --find-links /shared/wheelhouse   # offline
#
# Download size: the default torch (PyPI's) is a CUDA build, about 3 GB of wheels (torch and the
# nvidia-* CUDA libraries), even on a machine without GPUs.  The .../whl/cpu line above installs
# a CPU build instead (about 250 MB in all): enough for local mode and CPU-only machines, not for
# GPU nodes.  The last line installs from a local wheelhouse, without any download.
#
# Options (each one wins over its environment variable):
#   --cpu                  same as TORCH_BUILD=cpu
#   --index-url URL        same as INDEX_URL
#   --extra-index-url URL  same as EXTRA_INDEX_URL (repeat it for more than one)
#   --find-links DIR       same as FIND_LINKS
#   -h, --help             print this text
#
# Environment variables [default]:
#   PYTORCH_ENV       where the venv goes [/shared/apps/pytorch_env]
#   PYTHON            interpreter that creates the venv; it needs the venv and ensurepip modules
#                     (Debian/Ubuntu: apt-get install python3-venv) [python3]
#   TORCH_SPEC        [torch==2.14.1]
#   TORCHVISION_SPEC  [torchvision==0.29.1]
#   TORCHAUDIO_SPEC   [torchaudio==2.11.0]
#   PSUTIL_SPEC       [psutil]
#   NUMPY_SPEC        [numpy]  object collectives in torch.distributed need numpy
#                     Each spec is one pip requirement (name==version, name>=version, a wheel
#                     path).  An empty TORCHVISION_SPEC, TORCHAUDIO_SPEC or PSUTIL_SPEC leaves
#                     that package out.  Keep torch pinned: an unpinned torch may pull a
#                     different multi-GB CUDA build.
#   INDEX_URL         package index used instead of PyPI (pip --index-url): a local mirror, or a
#                     PyTorch index such as https://download.pytorch.org/whl/cu128 (CUDA 12.8)
#                     or https://download.pytorch.org/whl/cpu (CPU only) [pip's own setting]
#   EXTRA_INDEX_URL   more indexes, separated by whitespace (pip --extra-index-url); when
#                     INDEX_URL lacks psutil or numpy: https://pypi.org/simple [pip's own setting]
#   FIND_LINKS        wheelhouse directory (or URL) searched for packages (pip --find-links) [unset]
#   EXTRA_PIP_ARGS    more arguments for pip install, split on whitespace (no quoting, no globbing),
#                     e.g. "--no-index" offline, "--force-reinstall" to reinstall everything [empty]
#   UPGRADE_PIP       1: upgrade pip inside the venv first (a failure, e.g. offline, only warns);
#                     0: keep the pip that venv installed [1]
#   TORCH_BUILD       the torch build asked for: cpu, cuXYZ (CUDA X.Y: cu128 is 12.8) or rocmX.Y;
#                     empty: the one a build-specific index names (.../whl/cpu, .../whl/cu128), else
#                     none (pip's choice is taken as it comes).  cpu with no index given uses
#                     https://download.pytorch.org/whl/cpu, and PyPI for the rest [empty]
#   INDEX_RETRIES     pip --retries: tries again per page of an index that does not answer [1]
#   INDEX_TIMEOUT     pip --timeout, in seconds, and the bound of the reachability probe [15]
#   INDEX_FALLBACK    1: when the index of the build asked for does not answer, install the build the
#                     other sources have (one WARNING says which) instead of stopping; 0: stop [0]
#
# What it does:
#   1. creates the venv with "$PYTHON -m venv" unless PYTORCH_ENV already is one (an empty
#      directory is used; any other existing directory is refused, never overwritten);
#   2. upgrades pip in it and installs every spec with the venv's pip in one resolution, so the
#      versions fit together or pip says why they don't;
#   3. records the request in PYTORCH_ENV/bootstrap_env.record: the python (its real path and
#      version), every spec, and the package sources: index URL, extra index URLs, find-links
#      (from the options and variables above, the same pip options in EXTRA_PIP_ARGS, or else
#      PIP_INDEX_URL, PIP_EXTRA_INDEX_URL, PIP_FIND_LINKS; pip.conf files are not read; the
#      user:password part of a URL is masked);
#   4. imports torch, torchvision, torchaudio, psutil and numpy with the venv's python and prints
#      one "name version" line each, then "CUDA available: ..." (False is expected on a node
#      without GPUs, such as a login node; the preflight checks the GPUs on the compute nodes);
#   5. checks that torch is the build asked for (TORCH_BUILD, or the build-specific index): its
#      version's +cpu/+cuXYZ label and torch.version.cuda (or .hip).  Another build (say the CPU
#      index was unreachable and an extra index served a CUDA one) is ONE error line naming both,
#      the index that did not answer and the seconds pip spent retrying it; exit 1, never "ready".
#   6. checks that torchvision and torchaudio are built for the torch beside them, as each reports
#      itself when imported: the same build label (+cpu, +cu130) where both have one, the same CUDA
#      in their compiled extensions as torch.version.cuda, and the torch their metadata requires;
#      another is ONE error line naming both, exit 1.  (The default torchaudio is 2.11.0: PyPI's
#      2.11.1 is built for CUDA 13.2, its 2.11.0 for 13.0, the CUDA of PyPI's torch 2.14.1.)
#   Before the venv is made or pip runs, each http(s) index is probed once (INDEX_TIMEOUT).  When a
#   build was asked (--cpu, TORCH_BUILD, a build-specific index) and its index (the main index, or
#   the one that names the build) does not answer, that is ONE error line and exit 1 at once,
#   nothing installed (INDEX_FALLBACK=1: a WARNING, and the other sources' build is taken).  Any
#   other index that does not answer is a WARNING line, and pip tries it INDEX_RETRIES more time(s)
#   per page, not its own 5.
#   Files are created with umask 022, readable by every user whose jobs run the preflight.
#   Re-running is safe and fast.  Its request (python, specs, package sources; an unset one
#   counts as unset, so re-run with the same settings) is compared with the record:
#   - the same, and the installed versions still fit every spec: pip is not run, the packages
#     are imported and the script says "nothing changed";
#   - another python: the venv is rebuilt from scratch with it;
#   - another package source: every package is reinstalled from it (pip --force-reinstall), as
#     the same version may be another build (CUDA or CPU);
#   - another spec: pip installs it; a package whose spec is empty now is uninstalled;
#   - the same, but torch is not the build asked for: every package is reinstalled from the sources.
#   It then prints what it changed and records the new request, e.g.
#     changed: index-url https://download.pytorch.org/whl/cu126 -> https://download.pytorch.org/whl/cu128
#   Other EXTRA_PIP_ARGS are not compared; packages no longer needed (e.g. the nvidia-* ones
#   after a switch to a CPU build) stay: remove the venv to start clean.  A venv without a record (made by an older
#   bootstrap_env.sh) is checked as before, offline with pip --dry-run against what is
#   installed, and the request is recorded; if that venv came from another index or wheelhouse,
#   re-run once with EXTRA_PIP_ARGS=--force-reinstall.
#
# Exit codes: 0 ready; 1 install error (pip failed, a package does not import, or torch is another
# build than the one asked for); 2 usage or
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
TORCHAUDIO_SPEC=${TORCHAUDIO_SPEC-torchaudio==2.11.0}
PSUTIL_SPEC=${PSUTIL_SPEC-psutil}
NUMPY_SPEC=${NUMPY_SPEC:-numpy}
INDEX_URL=${INDEX_URL:-}
EXTRA_INDEX_URL=${EXTRA_INDEX_URL:-}
FIND_LINKS=${FIND_LINKS:-}
EXTRA_PIP_ARGS=${EXTRA_PIP_ARGS:-}
UPGRADE_PIP=${UPGRADE_PIP:-1}
TORCH_BUILD=${TORCH_BUILD:-}
INDEX_RETRIES=${INDEX_RETRIES:-1}
INDEX_TIMEOUT=${INDEX_TIMEOUT:-15}
INDEX_FALLBACK=${INDEX_FALLBACK:-0}

extra_index_opts=()
cpu_flag=0
while [ $# -gt 0 ]; do
  case $1 in
    -h | --help)
      usage
      exit 0
      ;;
    --cpu)
      TORCH_BUILD=cpu
      cpu_flag=1
      shift
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
    --extra-index-url)
      [ $# -ge 2 ] || fail 2 "--extra-index-url needs a URL (see --help)"
      extra_index_opts+=("$2")
      shift 2
      ;;
    --extra-index-url=*)
      extra_index_opts+=("${1#*=}")
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
if [ ${#extra_index_opts[@]} -gt 0 ]; then EXTRA_INDEX_URL=${extra_index_opts[*]}; fi

case $UPGRADE_PIP in
  0 | 1) ;;
  *) fail 2 "UPGRADE_PIP must be 0 or 1, not '$UPGRADE_PIP'" ;;
esac
case $TORCH_BUILD in
  "" | cpu | cu[0-9][0-9] | cu[0-9][0-9][0-9] | rocm[0-9]*) ;;
  *) fail 2 "TORCH_BUILD must be cpu, cuXYZ (e.g. cu128) or rocmX.Y, not '$TORCH_BUILD'" ;;
esac
case $INDEX_FALLBACK in
  0 | 1) ;;
  *) fail 2 "INDEX_FALLBACK must be 0 or 1, not '$INDEX_FALLBACK'" ;;
esac
[[ $INDEX_RETRIES =~ ^[0-9]+$ ]] || fail 2 "INDEX_RETRIES must be a whole number, not '$INDEX_RETRIES'"
[[ $INDEX_TIMEOUT =~ ^[0-9]+$ && $INDEX_TIMEOUT -gt 0 ]] || fail 2 "INDEX_TIMEOUT must be a whole number of seconds, not '$INDEX_TIMEOUT'"
# --cpu alone: the PyTorch CPU index for torch, PyPI for what it lacks
if [ "$TORCH_BUILD" = cpu ] && [ -z "$INDEX_URL" ] && [ -z "${PIP_INDEX_URL:-}" ] && [ -z "$FIND_LINKS" ] &&
  [[ " $EXTRA_PIP_ARGS " != *" -i"* && " $EXTRA_PIP_ARGS " != *" --index-url"* ]]; then
  INDEX_URL=https://download.pytorch.org/whl/cpu
  if [ ${#extra_index_opts[@]} -eq 0 ] && [ -z "$EXTRA_INDEX_URL" ]; then EXTRA_INDEX_URL=https://pypi.org/simple; fi
fi

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
      while [ "${FIND_LINKS%/}" != "$FIND_LINKS" ] && [ "$FIND_LINKS" != / ]; do FIND_LINKS=${FIND_LINKS%/}; done
      ;;
  esac
fi

# EXTRA_PIP_ARGS and EXTRA_INDEX_URL: split on whitespace only (read -a neither evaluates nor globs)
EXTRA_ARGS=()
read -r -d '' -a EXTRA_ARGS <<<"$EXTRA_PIP_ARGS" || true
EXTRA_INDEXES=()
read -r -d '' -a EXTRA_INDEXES <<<"$EXTRA_INDEX_URL" || true

PIP_COMMON=(--disable-pip-version-check ${EXTRA_ARGS[@]+"${EXTRA_ARGS[@]}"})
PIP_OPTS=("${PIP_COMMON[@]}" --retries "$INDEX_RETRIES" --timeout "$INDEX_TIMEOUT")
if [ -n "$INDEX_URL" ]; then PIP_OPTS+=(--index-url "$INDEX_URL"); fi
for url in ${EXTRA_INDEXES[@]+"${EXTRA_INDEXES[@]}"}; do PIP_OPTS+=(--extra-index-url "$url"); done
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

# the values EXTRA_PIP_ARGS gives pip option $1 (long form) or $2 (short form, or empty), one a line
pip_arg_values() {
  local long=$1 short=$2 a take=0
  for a in ${EXTRA_ARGS[@]+"${EXTRA_ARGS[@]}"}; do
    if [ "$take" = 1 ]; then
      printf '%s\n' "$a"
      take=0
    elif [ "$a" = "$long" ] || { [ -n "$short" ] && [ "$a" = "$short" ]; }; then
      take=1
    elif [ "${a#"$long"=}" != "$a" ]; then
      printf '%s\n' "${a#"$long"=}"
    elif [ -n "$short" ] && [ "${a#"$short"}" != "$a" ]; then
      printf '%s\n' "${a#"$short"}"
    fi
  done
}
# its arguments (each split on whitespace) joined by single spaces
words() {
  local w=()
  read -r -d '' -a w <<<"$*" || true
  local IFS=' '
  printf '%s' "${w[*]-}"
}
# masks the user and password part of every URL: the record and the output are world-readable
redact() { printf '%s' "$1" | sed -E 's#://[^/@[:space:]]*@#://****@#g'; }

# ---- the request: what the venv should be built with, compared with the record of the last build ----
RECORD=$PYTORCH_ENV/bootstrap_env.record
KEYS=(python index-url extra-index-url find-links torch torchvision torchaudio psutil numpy)
src_index=$INDEX_URL
if [ -z "$src_index" ]; then src_index=$(pip_arg_values --index-url -i | tail -n 1); fi
if [ -z "$src_index" ]; then src_index=${PIP_INDEX_URL:-}; fi
src_extra=$(words ${EXTRA_INDEXES[@]+"${EXTRA_INDEXES[@]}"} "$(pip_arg_values --extra-index-url '')")
if [ -z "$src_extra" ]; then src_extra=$(words "${PIP_EXTRA_INDEX_URL:-}"); fi
src_find=$(words "$FIND_LINKS" "$(pip_arg_values --find-links -f)")
if [ -z "$src_find" ]; then src_find=$(words "${PIP_FIND_LINKS:-}"); fi
# REQ[0], the python, is filled in once PYTHON is known to run
REQ=("" "$src_index" "$src_extra" "$src_find"
  "$TORCH_SPEC" "$TORCHVISION_SPEC" "$TORCHAUDIO_SPEC" "$PSUTIL_SPEC" "$NUMPY_SPEC")
for i in "${!REQ[@]}"; do
  case ${REQ[i]} in
    *$'\n'*) fail 2 "the ${KEYS[i]} setting contains a newline: give one value on one line" ;;
  esac
  REQ[i]=$(redact "${REQ[i]}")
done

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

# Prints "<real path of the interpreter a venv made by this python links to> (Python X.Y)".
# shellcheck disable=SC2016  # python code, not shell
ID_CHECK='
import os, sys
exe = getattr(sys, "_base_executable", None) or sys.executable
print("%s (Python %d.%d)" % (os.path.realpath(exe), sys.version_info[0], sys.version_info[1]))
'

# Prints, for each spec in argv that names a version range, "name X installed, SPEC wanted" when the
# installed version is outside it (joined by "; "); nothing when all fit.  Reads package metadata
# only (pip is not run); specs it cannot parse (wheel paths, URLs) are left to the record.
# shellcheck disable=SC2016  # python code, not shell
SPEC_CHECK='
import importlib.metadata as md, sys
try:
    from packaging.requirements import Requirement
except ImportError:
    try:
        from pip._vendor.packaging.requirements import Requirement
    except ImportError:
        sys.exit(0)
bad = []
for spec in sys.argv[1:]:
    try:
        req = Requirement(spec)
    except Exception:
        continue
    if req.url or (req.marker is not None and not req.marker.evaluate()):
        continue
    try:
        have = md.version(req.name)
    except md.PackageNotFoundError:
        bad.append("%s not installed, %s wanted" % (req.name, spec))
        continue
    if not req.specifier.contains(have, prereleases=True):
        bad.append("%s %s installed, %s wanted" % (req.name, have, spec))
print("; ".join(bad))
'

# ---- the torch build: what was asked, what pip got, and how long an index that did not answer cost ----
# The build a URL names: .../whl/cpu -> cpu, .../whl/cu128 -> cu128, .../whl/rocm6.2 -> rocm6.2 (also nightly/).
url_build() {
  local u=${1%/}
  case $u in
    */whl/cpu | */whl/*/cpu | */whl/cu[0-9]* | */whl/*/cu[0-9]* | */whl/rocm[0-9]* | */whl/*/rocm[0-9]*)
      printf '%s' "${u##*/}"
      ;;
  esac
}
# ASKED (cpu, cuXYZ, rocmX.Y or empty) and ASKED_BY (the words saying who asked).
ASKED=$TORCH_BUILD
ASKED_BY=""
if [ "$cpu_flag" = 1 ]; then ASKED_BY="--cpu"; elif [ -n "$TORCH_BUILD" ]; then ASKED_BY="TORCH_BUILD=$TORCH_BUILD"; fi
asked_from_sources() {
  local u b found="" by="" urls=()
  read -r -d '' -a urls <<<"$src_index $src_extra" || true
  for u in ${urls[@]+"${urls[@]}"}; do
    b=$(url_build "$u")
    if [ -n "$b" ] && [ "$b" != "$found" ]; then
      [ -z "$found" ] || return 0 # two builds named: nothing can be told
      found=$b
      by="index $u"
    fi
  done
  ASKED=$found
  ASKED_BY=$by
}
if [ -z "$ASKED" ]; then asked_from_sources; fi
build_words() { # cpu | cu128 | rocm6.2 -> "a CPU build" | "a CUDA 12.8 build" | "a ROCm 6.2 build"
  case $1 in
    cpu) printf 'a CPU build' ;;
    cu*) printf 'a CUDA %s.%s build' "${1:2:${#1}-3}" "${1: -1}" ;;
    rocm*) printf 'a ROCm %s build' "${1#rocm}" ;;
  esac
}
# Prints "<version>|<torch.version.cuda or empty>|<torch.version.hip or empty>" of the venv's torch.
# shellcheck disable=SC2016  # python code, not shell
BUILD_CHECK='
import torch
v = getattr(torch, "version", None)
print("%s|%s|%s" % (torch.__version__, getattr(v, "cuda", None) or "", getattr(v, "hip", None) or ""))
'
# Empty when the venv's torch is the build asked for (or none was asked); else the words of the mismatch.
build_mismatch() {
  local got ver cuda hip have want
  [ -n "$ASKED" ] || return 0
  got=$("$VPY" -I -c "$BUILD_CHECK" 2>/dev/null) || return 0 # no torch: check_imports says so
  IFS='|' read -r ver cuda hip <<<"$got"
  if [ -n "$cuda" ]; then have="a CUDA $cuda build"; elif [ -n "$hip" ]; then have="a ROCm $hip build"; else have="a CPU build"; fi
  case $ASKED in
    cpu) [ -z "$cuda" ] && [ -z "$hip" ] && return 0 ;;
    cu*) want=${ASKED:2:${#ASKED}-3}.${ASKED: -1}
      [[ $cuda == "$want" || $cuda == "$want".* ]] && return 0 ;;
    rocm*) [[ -n $hip && $hip == "${ASKED#rocm}"* ]] && return 0 ;;
  esac
  printf 'torch %s in %s is %s, but %s was asked (%s)' "$ver" "$PYTORCH_ENV" "$have" "$(build_words "$ASKED")" "$ASKED_BY"
}
# Prints one "<url>\t<reason>\t<seconds>" line per http(s) index in argv that does not answer within
# INDEX_TIMEOUT (any HTTP answer, even an error status, is an answer; a TLS error is not judged here).
# shellcheck disable=SC2016  # python code, not shell
PROBE='
import socket, sys, time, urllib.error, urllib.request
timeout = float(sys.argv[1])
for url in sys.argv[2:]:
    if not url.startswith(("http://", "https://")):
        continue
    t0 = time.monotonic()
    try:
        urllib.request.urlopen(url.rstrip("/") + "/", timeout=timeout).close()
        continue
    except urllib.error.HTTPError:
        continue
    except urllib.error.URLError as e:
        r = e.reason
        if "SSL" in type(r).__name__ or "CERTIFICATE" in str(r).upper():
            continue
        why = getattr(r, "strerror", None) or str(r)
    except (socket.timeout, TimeoutError):
        why = "no answer"
    except OSError as e:
        why = e.strerror or str(e)
    print("%s\t%s\t%.1f" % (url, why, time.monotonic() - t0))
'
# Copies pip's output through, and writes to $1 "<retries> <seconds> <pages>": the connections pip
# retried, the seconds from the start of each page it retried to its next line, and how many pages.
# shellcheck disable=SC2016  # python code, not shell
PIP_WATCH='
import re, sys, time
n = pages = 0
spent, start, prev, run = 0.0, None, time.monotonic(), None
for line in sys.stdin:
    sys.stdout.write(line)
    sys.stdout.flush()
    now = time.monotonic()
    m = re.search(r"Retrying \(Retry\(total=\d+.*\)\) after connection broken by .*\x27: (\S+)$", line.rstrip())
    if m:
        n += 1
        if run != m.group(1):
            if start is not None:
                spent += now - start
            run, start, pages = m.group(1), prev, pages + 1
    elif start is not None:
        spent += now - start
        start = run = None
    prev = now
if start is not None:
    spent += time.monotonic() - start
open(sys.argv[1], "w").write("%d %.1f %d\n" % (n, spent, pages))
'
UNREACHABLE=()
SOURCES=()
read -r -d '' -a SOURCES <<<"$src_index $src_extra" || true
probe_indexes() {
  local out line u why secs py=$PYTHON
  if [ -x "$VPY" ]; then py=$VPY; fi
  out=$("$py" -I -c "$PROBE" "$INDEX_TIMEOUT" ${SOURCES[@]+"${SOURCES[@]}"} 2>/dev/null) || return 0
  while IFS= read -r line; do
    [ -n "$line" ] || continue
    UNREACHABLE+=("$line")
    IFS=$'\t' read -r u why secs <<<"$line"
    # the index of the build asked for: stop before anything is installed, unless a fallback was asked
    if [ -n "$ASKED" ] && [ "$INDEX_FALLBACK" = 0 ] && { [ "$u" = "$src_index" ] || [ "$(url_build "$u")" = "$ASKED" ]; }; then
      fail 1 "package index $u does not answer ($why, after $secs s), and $(build_words "$ASKED") was asked ($ASKED_BY): nothing installed; give a source that answers (--index-url, --find-links), or INDEX_FALLBACK=1 to take the build the other sources have"
    fi
    warn "package index $u does not answer ($why, after $secs s); pip tries it $INDEX_RETRIES more time(s) per page, $INDEX_TIMEOUT s each (INDEX_RETRIES, INDEX_TIMEOUT), then takes what the other sources have"
  done <<<"$out"
}
RETRIES=0
RETRY_S=0
RETRY_PAGES=0
# pip install through PIP_WATCH; the pip's status is the pipeline's (pipefail).
watched_pip() {
  local stats=$PYTORCH_ENV/.bootstrap_env.pip.$$ rc=0
  "$VPY" -m pip "$@" 2>&1 | "$VPY" -I -u -c "$PIP_WATCH" "$stats" || rc=$?
  if [ -f "$stats" ]; then
    read -r RETRIES RETRY_S RETRY_PAGES <"$stats" || true
    rm -f "$stats"
  fi
  return "$rc"
}
# The words for where the time went: the indexes that did not answer and pip's retries.
retry_words() {
  local line u why parts=()
  for line in ${UNREACHABLE[@]+"${UNREACHABLE[@]}"}; do
    IFS=$'\t' read -r u why _ <<<"$line"
    parts+=("$u did not answer ($why)")
  done
  [ ${#parts[@]} -gt 0 ] || [ "$RETRIES" -gt 0 ] || return 0
  local IFS=';'
  printf '%s' "${parts[*]:-an index did not answer}"
  printf '; pip spent %s s retrying %s page(s) of it (%s retries)' "$RETRY_S" "$RETRY_PAGES" "$RETRIES"
}
# Fails (exit 1, one line) when torch is not the build asked for.
verify_build() {
  local why more
  why=$(build_mismatch)
  [ -n "$why" ] || return 0
  more=$(retry_words)
  if [ "$INDEX_FALLBACK" = 1 ]; then
    warn "$why${more:+: $more}; INDEX_FALLBACK=1 took the build the other sources have"
    return 0
  fi
  fail 1 "$why${more:+: $more, and another source served torch}; give a source that has the build asked for (or EXTRA_PIP_ARGS=--force-reinstall once it answers), then re-run"
}

# Prints, for torchvision and torchaudio beside torch, what makes one of them another build than the
# torch it sits beside (joined by "; "), nothing when they match.  It imports the three with the venv's
# python and reads what each reports at run time, not its metadata alone (PyPI's wheels carry their
# build label only there: torch 2.14.1 reports 2.14.1+cu130, torchaudio 2.11.1 2.11.1+cu132):
#   "<name> <version> is built for <label>, torch <version> for <label>": both report a build label
#     (+cpu, +cu130) and the labels differ;
#   "<name> <version> is built for CUDA <x.y>, torch <version> for CUDA <x.y>": the CUDA its compiled
#     extension reports (torch.ops.torchvision._cuda_version, torch.ops._torchaudio.cuda_version) is not
#     torch.version.cuda;
#   "<name> <version> requires <requirement>, torch <version> is installed": its metadata's torch
#     requirement excludes the installed torch.
# shellcheck disable=SC2016  # python code, not shell
COMPANION_CHECK='
import importlib, importlib.metadata as md, sys
try:
    from packaging.requirements import Requirement
except ImportError:
    from pip._vendor.packaging.requirements import Requirement
try:
    import torch
    torch_md = md.version("torch")
except Exception:
    sys.exit(0)
label = lambda v: v.partition("+")[2]
torch_v = str(getattr(torch, "__version__", "") or torch_md)
torch_cuda = getattr(getattr(torch, "version", None), "cuda", None)
def ext_cuda(name):
    try:
        if name == "torchvision":
            v = torch.ops.torchvision._cuda_version()
        else:
            v = torch.ops._torchaudio.cuda_version()
        v = int(v)
    except Exception:
        return None
    return "%d.%d" % (v // 1000, v % 1000 // 10) if v > 0 else None
bad = []
for name in ("torchvision", "torchaudio"):
    try:
        have_md = md.version(name)
        mod = importlib.import_module(name)
    except Exception:
        continue
    have = str(getattr(mod, "__version__", "") or have_md)
    cuda = ext_cuda(name)
    if label(have) and label(torch_v) and label(have) != label(torch_v):
        bad.append("%s %s is built for %s, torch %s for %s" % (name, have, label(have), torch_v, label(torch_v)))
    elif cuda and torch_cuda and cuda != ".".join(str(torch_cuda).split(".")[:2]):
        bad.append("%s %s is built for CUDA %s, torch %s for CUDA %s" % (name, have, cuda, torch_v, torch_cuda))
    for r in md.requires(name) or []:
        req = Requirement(r)
        if req.name == "torch" and (req.marker is None or req.marker.evaluate()) and req.specifier and \
                not req.specifier.contains(torch_md, prereleases=True):
            bad.append("%s %s requires %s, torch %s is installed" % (name, have, r, torch_v))
print("; ".join(bad))
'
# Fails (exit 1, one line) when torchvision or torchaudio is not built for the torch beside it.
verify_companions() {
  local why
  why=$("$VPY" -I -c "$COMPANION_CHECK" 2>/dev/null) || why=""
  [ -n "$why" ] || return 0
  fail 1 "$why (in $PYTORCH_ENV): install all three from one source (the same --index-url), pin matching versions (TORCHVISION_SPEC, TORCHAUDIO_SPEC), or leave one out (an empty spec)"
}

# Fills REQ[0] and pyver from PYTHON; fails when it is missing or does not run.
request_python() {
  command -v "$PYTHON" >/dev/null 2>&1 || fail 2 "PYTHON=$PYTHON: no such interpreter (set PYTHON to a python3 that has the venv module)"
  REQ[0]=$("$PYTHON" -I -c "$ID_CHECK" 2>/dev/null) || fail 2 "PYTHON=$PYTHON does not run"
  pyver=${REQ[0]##*(Python }
  pyver=${pyver%)}
}

# Fails unless PYTHON can create a venv with pip in it; warns when other users could not run it.
python_can_create() {
  local blocked
  "$PYTHON" -c 'import venv' >/dev/null 2>&1 ||
    fail 2 "$PYTHON (Python $pyver) has no venv module; install it (Debian/Ubuntu: apt-get install python$pyver-venv) or set PYTHON to a python3 that has it"
  "$PYTHON" -c 'import ensurepip' >/dev/null 2>&1 ||
    fail 2 "$PYTHON (Python $pyver) lacks ensurepip, so python -m venv cannot put pip into the venv; install it (Debian/Ubuntu: apt-get install python$pyver-venv) or set PYTHON to a python3 that has it"
  # a venv links to its base interpreter: other users' jobs need every directory on the way to it
  blocked=$("$PYTHON" -I -c "$ACCESS_CHECK" 2>/dev/null) || blocked=""
  if [ -n "$blocked" ]; then
    warn "the venv will link to $blocked: other users cannot run it; for a venv shared by everyone's jobs set PYTHON to a system or shared-filesystem python (e.g. PYTHON=/usr/bin/python3)"
  fi
}

# Reads the record into REC (same order as KEYS); false when there is none, or it names no python.
REC=()
read_record() {
  local line key i
  [ -f "$RECORD" ] && [ -r "$RECORD" ] || return 1
  while IFS= read -r line || [ -n "$line" ]; do
    key=${line%%=*}
    for i in "${!KEYS[@]}"; do
      if [ "${KEYS[i]}" = "$key" ]; then REC[i]=${line#*=}; fi
    done
  done <"$RECORD" || return 1
  [ -n "${REC[0]:-}" ]
}

# Writes the request as the record (replacing the file in one step); false when it cannot.
write_record() {
  local tmp=$RECORD.$$ i
  {
    echo "# bootstrap_env.sh: what this venv was built with; a re-run compares its request with this"
    for i in "${!KEYS[@]}"; do printf '%s=%s\n' "${KEYS[i]}" "${REQ[i]}"; done
  } >"$tmp" 2>/dev/null && mv -f "$tmp" "$RECORD" 2>/dev/null && return 0
  rm -f "$tmp" 2>/dev/null
  return 1
}
record_or_warn() {
  write_record && return 0
  warn "could not write $RECORD (not writable by user $(whoami_)?); the next run checks the venv with pip instead"
  return 1
}

# A value as the change line shows it.
shown() {
  if [ -n "$2" ]; then
    printf '%s' "$2"
    return
  fi
  case $1 in
    index-url) printf '(pip default)' ;;
    extra-index-url | find-links) printf '(none)' ;;
    *) printf '(left out)' ;;
  esac
}

# Compares REQ with REC: CHANGES (one item per difference), PY_CHANGED, SRC_CHANGED, REMOVED (the
# packages whose spec is empty now).
CHANGES=()
REMOVED=()
PY_CHANGED=0
SRC_CHANGED=0
compare_record() {
  local i key old new
  for i in "${!KEYS[@]}"; do
    key=${KEYS[i]}
    old=${REC[i]:-}
    new=${REQ[i]}
    [ "$old" != "$new" ] || continue
    case $key in
      python)
        PY_CHANGED=1
        CHANGES+=("python $old -> $new")
        ;;
      index-url | extra-index-url | find-links)
        SRC_CHANGED=1
        CHANGES+=("$key $(shown "$key" "$old") -> $(shown "$key" "$new")")
        ;;
      *)
        CHANGES+=("$(shown "$key" "$old") -> $(shown "$key" "$new")")
        if [ -z "$new" ]; then REMOVED+=("$key"); fi
        ;;
    esac
  done
}
changes_text() {
  local out="" c
  for c in "${CHANGES[@]}"; do out=${out:+$out; }$c; done
  printf '%s' "$out"
}

# The request is what the venv was built with: the packages are imported and the script ends, unless
# torch is not the build asked for (then it returns 1, and every package is reinstalled).
WRONG_BUILD=""
up_to_date() {
  say "checking the venv at $PYTORCH_ENV ($VPY)"
  check_imports || exit 1
  WRONG_BUILD=$(build_mismatch)
  if [ -n "$WRONG_BUILD" ] && [ "$INDEX_FALLBACK" = 1 ]; then
    warn "$WRONG_BUILD; kept (INDEX_FALLBACK=1)"
    WRONG_BUILD=""
  fi
  [ -z "$WRONG_BUILD" ] || return 1
  verify_companions
  echo "pytorch env at $PYTORCH_ENV is up to date; nothing changed ($((SECONDS - START)) s)"
  next_steps
  exit 0
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

# create: a new venv; rebuild: a new venv in place of the old one; update: pip install into it
action=create
have_record=0
if [ "$state" = venv ]; then
  request_python
  venv_runs=0
  if [ -x "$VPY" ] && "$VPY" -I -c '' >/dev/null 2>&1; then venv_runs=1; fi
  if read_record; then
    have_record=1
    compare_record
  elif [ "$venv_runs" = 1 ]; then
    # no record: the python is the one thing known about how the venv was built
    REC=("$("$VPY" -I -c "$ID_CHECK" 2>/dev/null || true)")
    if [ -n "${REC[0]}" ] && [ "${REC[0]}" != "${REQ[0]}" ]; then
      PY_CHANGED=1
      CHANGES=("python ${REC[0]} -> ${REQ[0]}")
    fi
  fi
  if [ "$PY_CHANGED" = 1 ]; then
    action=rebuild
  else
    action=update
    if [ "$venv_runs" = 0 ]; then
      base_home=$(sed -n 's/^home *= *//p' "$PYTORCH_ENV/pyvenv.cfg" 2>/dev/null | head -n 1)
      fail 2 "the venv at $PYTORCH_ENV does not run for user $(whoami_): $VPY fails (is its base python in ${base_home:-?} missing, or not accessible to this user?); fix that, or remove the venv and re-run"
    fi
    # fast path: built with this very request and the packages still fit it -> pip is not run
    drift=""
    if [ "$have_record" = 1 ] && [ ${#CHANGES[@]} -eq 0 ] && ! forces_install; then
      drift=$("$VPY" -I -c "$SPEC_CHECK" "${SPECS[@]}" 2>/dev/null) || drift=""
      if [ -z "$drift" ]; then up_to_date || true; fi
    fi
    if ! "$VPY" -m pip --version >/dev/null 2>&1; then
      need_writable "$PYTORCH_ENV"
      say "the venv at $PYTORCH_ENV has no pip; adding it with ensurepip"
      out=$("$VPY" -m ensurepip --upgrade --default-pip 2>&1) ||
        fail 2 "the venv at $PYTORCH_ENV has no pip and ensurepip failed: $(last_line "$out"); remove it and re-run"
    fi
    if [ "$have_record" = 0 ] && ! forces_install; then
      say "the venv at $PYTORCH_ENV has no record of what it was built with (an older bootstrap_env.sh made it); checking its packages with pip"
      if satisfied; then
        if record_or_warn; then
          say "recorded this request in $RECORD (if the venv came from another index or wheelhouse, re-run once with EXTRA_PIP_ARGS=--force-reinstall)"
        fi
        up_to_date || true
      fi
      if [ -z "$WRONG_BUILD" ]; then say "the venv at $PYTORCH_ENV does not satisfy every spec yet; updating it"; fi
    fi
    if [ -n "$WRONG_BUILD" ]; then
      say "$WRONG_BUILD: reinstalling every package from the package sources"
    elif [ "$have_record" = 0 ] && ! forces_install; then
      : # said above
    elif [ ${#CHANGES[@]} -gt 0 ]; then
      say "the venv at $PYTORCH_ENV was built with another request; updating it: $(changes_text)"
    elif [ -n "$drift" ]; then
      say "the packages in the venv at $PYTORCH_ENV no longer match their specs ($drift); updating it"
    else
      say "EXTRA_PIP_ARGS asks pip to reinstall or upgrade; updating the venv at $PYTORCH_ENV"
    fi
    need_writable "$PYTORCH_ENV"
    need_writable "$PYTORCH_ENV/bin"
    purelib=$("$VPY" -I -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    need_writable "$purelib"
  fi
fi

probe_indexes
if [ "$action" != update ]; then
  venv_args=()
  if [ "$action" = rebuild ]; then
    say "the venv at $PYTORCH_ENV was built with another python; rebuilding it from scratch: $(changes_text)"
    venv_args=(--clear)
  fi
  need_writable "$PYTORCH_ENV"
  if [ "$action" = create ]; then request_python; fi
  python_can_create
  say "creating the venv at $PYTORCH_ENV with $PYTHON (Python $pyver)"
  if ! out=$("$PYTHON" -m venv ${venv_args[@]+"${venv_args[@]}"} "$PYTORCH_ENV" 2>&1); then
    # leave nothing half-made behind: an empty directory is built afresh by the next run
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

install_opts=("${PIP_OPTS[@]}")
if [ "$action" = update ]; then
  if [ ${#REMOVED[@]} -gt 0 ]; then
    say "pip uninstall ${REMOVED[*]} (spec now empty)"
    "$VPY" -m pip uninstall --yes --disable-pip-version-check "${REMOVED[@]}" ||
      fail 1 "pip could not uninstall ${REMOVED[*]} from $PYTORCH_ENV (pip's messages above say why)"
  fi
  if [ "$SRC_CHANGED" = 1 ]; then
    say "the package source changed: reinstalling every package from it"
    install_opts+=(--force-reinstall)
  elif [ -n "$WRONG_BUILD" ]; then
    install_opts+=(--force-reinstall)
  fi
fi
say "pip install ${SPECS[*]}"
t_pip=$SECONDS
watched_pip install "${install_opts[@]}" "${SPECS[@]}" ||
  fail 1 "pip could not install ${SPECS[*]} into $PYTORCH_ENV after $((SECONDS - t_pip)) s${UNREACHABLE[0]:+ ($(retry_words))} (pip's messages above say why)"
if [ "$RETRIES" -gt 0 ]; then say "pip took $((SECONDS - t_pip)) s, $RETRY_S s of it retrying $RETRY_PAGES page(s) of an index that did not answer ($RETRIES retries)"; fi
record_or_warn || true
if [ ${#CHANGES[@]} -gt 0 ]; then echo "changed: $(changes_text)"; fi

say "checking the venv at $PYTORCH_ENV ($VPY)"
check_imports || exit 1
verify_build
verify_companions
echo "pytorch env at $PYTORCH_ENV is ready ($((SECONDS - START)) s)"
next_steps
