#!/usr/bin/env bash
# The signed side channel on real GPUs (local mode, one rank per GPU over NCCL). Lines of $OUT/summary.txt:
#   pass        no forger: PASS, exit 0, the report says the side channel is authenticated
#   forge-<k>   while rank 0 waits inside the collective (pause failpoint), a plain TCPStore client
#               without the secret writes a forged <k> (stamp, error line, verdict) into the run's
#               store: FAIL, exit 1, failed_hosts [], the forgery named
#   secret      the secret local mode made, read off a rank's environment during the run: found
#               nowhere in stdout, stderr, the JSON or any command line
# then the time to verdict, interleaved: this tree against OLD (a copy of ddp_mesh_ping.py from before
# the signing, if given), REPS rounds each.
# Usage: OUT=dir [OLD=old_ddp_mesh_ping.py] [REPS=5] bash bench/gpu_side_channel.sh   (PY: python with torch)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT=${OUT:-gpu-side-channel}
PY=${PY:-python3}
REPS=${REPS:-5}
OLD=${OLD:-}
export PYTHONUNBUFFERED=1
mkdir -p "$OUT/logs"
: >"$OUT/summary.txt"

free_port() { "$PY" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }

summary() { # $1 label, $2 exit code, $3 JSON, $4 log
  "$PY" - "$@" >>"$OUT/summary.txt" <<'PY'
import json, sys
label, rc, js, log = sys.argv[1:5]
try:
    v = json.load(open(js))
    hosts = v.get("failed_hosts")
    chan = [f["status"] + " " + f["reason"][:60] for f in v["findings"] if f["check"] == "rendezvous"]
except (OSError, ValueError):
    hosts, chan = "no JSON", []
first = next((ln for ln in open(log) if ln.startswith("FAILURE:")), "-").strip()
print(f"{label}\texit={rc}\tfailed_hosts={hosts}\t{first[:220]}\t{chan}")
PY
}

forge() { # $1 kind, $2 port
  "$PY" - "$1" "$2" <<'PY'
import datetime, json, sys
import torch.distributed as dist
kind, port = sys.argv[1], int(sys.argv[2])
s = dist.PrefixStore("aiv", dist.TCPStore("127.0.0.1", port, None, False, datetime.timedelta(seconds=10)))
if kind == "stamp":
    s.set("stamp/0", "1")
elif kind == "error":
    s.append("errors", json.dumps({"rank": 0, "phase": "collective", "code": 1, "line": "NIC down on node9"}) + "\n")
    s.add("nerr", 1)
elif kind == "verdict":
    s.set("verdict", "0")
PY
}

run() { # $1 label, $2 forged kind ('' for none)
  local label=$1 kind=$2 port mark rc=0
  port=$(free_port)
  mark="$OUT/logs/$label.mark"
  rm -f "$mark" "$OUT/logs/$label.json"
  MASTER_PORT=$port AIV_FAILPOINT=${kind:+pause=4:collective:0} AIV_FAILPOINT_MARK=$mark \
    "$PY" ddp_mesh_ping.py --timeout 30 --json "$OUT/logs/$label.json" \
    >"$OUT/logs/$label.log" 2>"$OUT/logs/$label.err" &
  local pid=$!
  if [ -n "$kind" ]; then
    for _ in $(seq 1 600); do [ -e "$mark" ] && break; sleep 0.1; done
    forge "$kind" "$port"
  fi
  wait "$pid" || rc=$?
  summary "$label" "$rc" "$OUT/logs/$label.json" "$OUT/logs/$label.log"
}

run pass ""
for k in stamp error verdict; do run "forge-$k" "$k"; done

# the secret local mode made: nowhere but in the ranks' environment
mark="$OUT/logs/secret.mark"
rm -f "$mark"
AIV_FAILPOINT=pause=3:collective:0 AIV_FAILPOINT_MARK=$mark "$PY" ddp_mesh_ping.py --timeout 30 \
  --json "$OUT/logs/secret.json" >"$OUT/logs/secret.log" 2>"$OUT/logs/secret.err" &
launcher=$!
for _ in $(seq 1 600); do [ -e "$mark" ] && break; sleep 0.1; done
secret=""
read -r -a kids < <(cat /proc/"$launcher"/task/*/children 2>/dev/null; echo)
for kid in "${kids[@]}"; do
  secret=$(tr '\0' '\n' <"/proc/$kid/environ" | sed -n 's/^AIV_JOB_SECRET=//p') && [ -n "$secret" ] && break
done
cmdlines=$(for p in /proc/[0-9]*; do tr '\0' ' ' <"$p/cmdline" 2>/dev/null; echo; done)
wait "$launcher" || true
where="none"
if [ -z "$secret" ]; then
  where="NO SECRET FOUND in the ranks' environment"
elif grep -qF -- "$secret" "$OUT/logs/secret.log" "$OUT/logs/secret.err" "$OUT/logs/secret.json"; then
  where="IN THE OUTPUT"
elif grep -qF -- "$secret" <<<"$cmdlines"; then
  where="ON A COMMAND LINE"
fi
printf 'secret\t%s characters, found in the outputs or command lines: %s\n' "${#secret}" "$where" >>"$OUT/summary.txt"

# time to verdict, interleaved: this tree and OLD
if [ -n "$OLD" ]; then
  for ((i = 1; i <= REPS; i++)); do
    for v in new old; do
      f=ddp_mesh_ping.py
      [ "$v" = old ] && f=$OLD
      t0=$(date +%s.%N)
      rc=0
      "$PY" "$f" >"$OUT/logs/ttv-$v-$i.log" 2>&1 || rc=$?
      t1=$(date +%s.%N)
      printf 'ttv\t%s\tround %d\texit=%s\t%s s\n' "$v" "$i" "$rc" "$(awk -v a="$t0" -v b="$t1" 'BEGIN { printf "%.2f", b - a }')" \
        >>"$OUT/summary.txt"
    done
  done
fi
cat "$OUT/summary.txt"
