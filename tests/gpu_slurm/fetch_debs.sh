#!/usr/bin/env bash
# Download the Debian 12 (bookworm, amd64) packages that tests/gpu_slurm/run_gpu_slurm.sh unpacks
# on a GPU node to run a private Slurm 22.05 cluster there.  Nothing is installed: the packages are
# only downloaded (apt-get download) into ${DEB_DIR:-.debs} at the repository root.
#
#   bash tests/gpu_slurm/fetch_debs.sh            # on a Debian 12 amd64 machine with apt access
#   DEB_DIR=/some/dir bash tests/gpu_slurm/fetch_debs.sh
#
# The default .debs/ is added to .git/info/exclude (not .gitignore): it stays out of commits.  When
# the repository is copied to the GPU node, copy .debs/ along with it.
# The first 11 packages are the ones a minimal Ubuntu 24.04 image lacks (Slurm itself, the plugins,
# iproute2 and the few libraries those need); the other 12 are common base libraries, carried so that
# the run does not depend on the image having them (the runner uses a carried library only when the
# system has no library of that name).  Total: about 6 MB.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
DEB_DIR=${DEB_DIR:-.debs}
MAX_MIB=${MAX_MIB:-50}

PKGS=(
  slurmd slurmctld slurm-client slurm-wlm-basic-plugins
  iproute2 libbpf1 libmnl0
  libdbus-1-3 libjson-c5 liblua5.1-0 libyaml-0-2
  libhwloc15 liblz4-1 libnuma1 libreadline8 libmunge2 libpam0g libudev1 libtinfo6
  libcap2 libelf1 libbsd0 libmd0
)

command -v apt-get >/dev/null || { echo "fetch_debs: apt-get not found (needs a Debian 12 machine)" >&2; exit 1; }
if [ "$(dpkg --print-architecture 2>/dev/null || echo unknown)" != amd64 ]; then
  echo "fetch_debs: note: this machine is not amd64; downloading the :amd64 packages anyway" >&2
fi

mkdir -p "$DEB_DIR"
DEB_DIR=$(cd "$DEB_DIR" && pwd)

# keep .debs/ out of git without touching the shared .gitignore
if [ "$DEB_DIR" = "$PWD/.debs" ] && git rev-parse --git-dir >/dev/null 2>&1; then
  ex=$(git rev-parse --git-path info/exclude)
  mkdir -p "$(dirname "$ex")"
  grep -qxF '/.debs/' "$ex" 2>/dev/null || echo '/.debs/' >>"$ex"
fi

# remove older downloads of these packages only (nothing else in DEB_DIR is touched)
for p in "${PKGS[@]}"; do rm -f "$DEB_DIR/${p}_"*.deb; done

args=()
for p in "${PKGS[@]}"; do args+=("$p:amd64"); done
dl() { (cd "$DEB_DIR" && apt-get download -q "${args[@]}"); }
if ! dl; then
  echo "fetch_debs: apt-get download failed; refreshing the package lists and retrying" >&2
  apt-get update -q >/dev/null
  dl
fi

missing=()
for p in "${PKGS[@]}"; do
  compgen -G "$DEB_DIR/${p}_*_amd64.deb" >/dev/null || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "fetch_debs: missing after download: ${missing[*]}" >&2
  exit 1
fi
ver=$(dpkg-deb -f "$(compgen -G "$DEB_DIR/slurmd_*_amd64.deb" | head -n1)" Version)
case $ver in
  22.05.*) ;;
  *) echo "fetch_debs: WARNING: slurmd version $ver is not 22.05.x (the harness was verified with 22.05.8)" >&2 ;;
esac

total=0
for p in "${PKGS[@]}"; do
  f=$(compgen -G "$DEB_DIR/${p}_*_amd64.deb" | head -n1)
  sz=$(stat -c %s "$f")
  total=$((total + sz))
  printf '  %10d  %s\n' "$sz" "$(basename "$f")"
done
mib=$(awk -v b="$total" 'BEGIN{printf "%.2f", b/1048576}')
echo "fetch_debs: ${#PKGS[@]} packages in $DEB_DIR, total $total bytes ($mib MiB), slurm $ver"
if [ "$total" -gt $((MAX_MIB * 1048576)) ]; then
  echo "fetch_debs: total exceeds ${MAX_MIB} MiB" >&2
  exit 1
fi
