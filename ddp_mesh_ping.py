#!/usr/bin/env python3
"""ddp_mesh_ping.py -- multi-node, multi-GPU preflight for Slurm clusters.

Run it before an expensive training job. It checks that the launcher started the
right ranks, that every rank owns the right GPU, that the software stack matches
across nodes, that the fabric is up, and that NCCL (or gloo on CPU) completes a DDP
all-reduce ring. It never hangs: every distributed phase is bounded by --timeout.

Phases (each prints one progress line on rank 0):
  contract    read RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT
              (fallback: SLURM_PROCID / SLURM_NTASKS / SLURM_LOCALID / first host of
              SLURM_JOB_NODELIST / a port derived from SLURM_JOB_ID)
  local       backend, GPU device, NCCL_SOCKET_IFNAME / GLOO_SOCKET_IFNAME, numpy
  rendezvous  roll call through a TCPStore on MASTER_ADDR:MASTER_PORT; rank 0 judges
              layout and GPU affinity before any NCCL communicator exists
  init        torch.distributed.init_process_group on that store
  telemetry   per-rank and per-node facts gathered to rank 0 (gather_object)
  judge       small pure checks over the gathered data -> PASS / WARN / FAIL
  collectives exact all_reduce with a closed-form sum, DDP step on nn.Linear(10, 10),
              gradients compared across ranks, loss all_reduced
  verdict     report, one FAILURE line per failed check, or the success line

Launch:
  python ddp_mesh_ping.py                 local mode: one rank per visible GPU, or
                                          --nproc N gloo ranks on CPU (default 2)
  srun python ddp_mesh_ping.py            one rank per Slurm task
  torchrun --nproc-per-node 8 ddp_mesh_ping.py
  python ddp_mesh_ping.py --verify-log ai_infra_smoke_test_123.log --expect-world-size 16

Exit codes: 0 PASS, 1 FAIL (a check failed), 2 USAGE (bad flags or launch contract,
nothing attempted), 3 TIMEOUT (a deadline passed: missing ranks, unreachable master,
a collective that never completed). Every option can also be set through an
environment variable AIV_<OPTION> (e.g. AIV_TIMEOUT=120); the command line wins.

Stable strings for automation:
  Total Execution Ranks: N
  SUCCESS: DDP Multi-Node AllReduce Ring Complete!
  FAILURE: <check>: <reason>        (check names: see CHECKS below)
"""

import argparse
import datetime
import fcntl
import json
import os
import re
import resource
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time

VERSION = "1.0.0"
SCHEMA_VERSION = 1
SUCCESS_LINE = "SUCCESS: DDP Multi-Node AllReduce Ring Complete!"
EXIT_PASS, EXIT_FAIL, EXIT_USAGE, EXIT_TIMEOUT = 0, 1, 2, 3

# The stable names that follow "FAILURE:" (documented in the README).
CHECKS = (
    "usage",         # malformed command-line flag or AIV_* variable (exit 2)
    "contract",      # launch environment malformed (exit 2)
    "launch",        # local launcher: a rank died without a verdict
    "local",         # a rank's own pre-flight (backend, numpy) failed
    "device",        # LOCAL_RANK has no GPU, CUDA unusable
    "interface",     # NCCL_SOCKET_IFNAME / GLOO_SOCKET_IFNAME select nothing usable
    "rendezvous",    # roll call: missing ranks, master unreachable, port in use
    "world-size",    # WORLD_SIZE differs from the expectation
    "layout",        # nodes / ranks per node / local ranks wrong
    "gpu-affinity",  # two ranks on one physical GPU
    "numa",          # GPU's NUMA node outside the rank's CPU affinity (WARN)
    "versions",      # torch / CUDA / NCCL / driver / GPU model differ across nodes
    "imports",       # torchvision / torchaudio missing or broken (WARN)
    "fabric",        # InfiniBand ports down or slow (WARN)
    "day0",          # memlock, /dev/shm, busy GPU memory, nvidia_peermem (WARN)
    "init",          # init_process_group failed or timed out
    "telemetry",     # gather to rank 0 failed or timed out
    "collective",    # wrong all_reduce values, a peer died, a collective timed out
    "ddp",           # DDP step failed or gradients differ across ranks
    "bandwidth",     # all_reduce bus bandwidth below --min-busbw
    "transport",     # NCCL fell back to sockets although IB is active
    "internal",      # an unexpected error inside the tool (a bug: please report it)
)

# Environment variables the report may print. Nothing else is ever echoed.
ENV_ALLOW_PREFIXES = ("NCCL_", "GLOO_", "TORCH_NCCL_", "AIV_")
ENV_ALLOW_NAMES = (
    "CUDA_VISIBLE_DEVICES", "MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE",
    "SLURM_JOB_ID", "SLURM_JOB_NAME", "SLURM_JOB_NODELIST", "SLURM_JOB_NUM_NODES",
    "SLURM_NTASKS", "SLURM_NTASKS_PER_NODE", "SLURM_TASKS_PER_NODE", "SLURM_CPUS_PER_TASK",
    "SLURM_JOB_PARTITION", "SLURM_CLUSTER_NAME", "SLURM_GPUS_ON_NODE", "SLURM_DISTRIBUTION",
)
ENV_DENY_WORDS = ("TOKEN", "SECRET", "PASSWORD", "PASSWD", "CREDENTIAL", "AUTH", "KEY", "COOKIE")

PEER_GRACE = 3.0  # seconds rank 0 waits for live peers to report their errors after a failed phase

_T0 = time.monotonic()


# ============================================================================ helpers
class UsageError(Exception):
    """A malformed flag or launch contract: nothing was attempted (exit 2)."""


def finding(check, status, reason, hosts=(), ranks=(), code=EXIT_FAIL):
    """One judged fact. status is PASS, WARN or FAIL; code is the exit code a FAIL implies."""
    f = {"check": check, "status": status, "reason": reason,
         "hosts": sorted(set(hosts)), "ranks": sorted(set(ranks))}
    if status == "FAIL" and code != EXIT_FAIL:
        f["code"] = code
    return f


def verdict_code(findings):
    """0 when nothing FAILed, else the largest exit code the failures imply (1 or 3)."""
    fails = [f for f in findings if f["status"] == "FAIL"]
    return max((f.get("code", EXIT_FAIL) for f in fails), default=EXIT_PASS)


def elapsed():
    return time.monotonic() - _T0


def format_ranges(nums):
    """[0,1,2,5,7,8] -> '0-2,5,7-8'."""
    nums = sorted(set(nums))
    out, i = [], 0
    while i < len(nums):
        j = i
        while j + 1 < len(nums) and nums[j + 1] == nums[j] + 1:
            j += 1
        out.append(str(nums[i]) if i == j else f"{nums[i]}-{nums[j]}")
        i = j + 1
    return ",".join(out)


def parse_ranges(text):
    """'0-2,5' -> [0,1,2,5]. Raises ValueError on garbage."""
    out = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            raise ValueError("empty range")
        if "-" in part:
            a, b = part.split("-", 1)
            a, b = int(a), int(b)
            if b < a or b - a > 1_000_000:
                raise ValueError(f"bad range {part}")
            out.extend(range(a, b + 1))
        else:
            out.append(int(part))
    return out


def _split_top(text, sep=","):
    """Split on sep outside brackets."""
    parts, depth, cur = [], 0, []
    for ch in text:
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise ValueError("unbalanced ']'")
        if ch == sep and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    if depth != 0:
        raise ValueError("unbalanced '['")
    parts.append("".join(cur))
    return parts


def expand_hostlist(text, limit=100_000):
    """Slurm hostlist expansion: 'gpu[01-03,7],login-2' -> ['gpu01','gpu02','gpu03','gpu7','login-2'].

    Several bracket groups in one name expand as a product ('r[1-2]n[1-2]').
    Zero padding follows the lower bound's width. Raises ValueError on bad input.
    """
    hosts = []
    for item in _split_top(text.strip()):
        item = item.strip()
        if not item:
            continue
        names = [""]
        for lit, rng in re.findall(r"([^\[\]]*)(?:\[([^\[\]]*)\])?", item):
            names = [n + lit for n in names]
            if rng:
                choices = []
                for part in rng.split(","):
                    part = part.strip()
                    m = re.fullmatch(r"(\d+)(?:-(\d+))?", part)
                    if not m:
                        raise ValueError(f"bad range '{part}' in '{item}'")
                    lo, hi = m.group(1), m.group(2) or m.group(1)
                    if int(hi) < int(lo):
                        raise ValueError(f"descending range '{part}' in '{item}'")
                    width = len(lo) if lo.startswith("0") or len(lo) == len(hi) else 0
                    if int(hi) - int(lo) > limit:
                        raise ValueError(f"range too large in '{item}'")
                    choices.extend(str(k).zfill(width) for k in range(int(lo), int(hi) + 1))
                names = [n + c for n in names for c in choices]
                if len(names) > limit:
                    raise ValueError("hostlist too large")
        hosts.extend(names)
    if not hosts:
        raise ValueError("empty hostlist")
    return hosts


def compress_hostlist(hosts):
    """Inverse of expand_hostlist for names that end in digits: node1,node2,node3 -> node[1-3]."""
    groups, order = {}, []
    for h in hosts:
        m = re.fullmatch(r"(.*?)(\d+)", h)
        key = (m.group(1), len(m.group(2)) if m.group(2).startswith("0") else 0) if m else (h, None)
        if key not in groups:
            groups[key] = []
            order.append(key)
        groups[key].append(m.group(2) if m else None)
    out = []
    for prefix, width in order:
        vals = groups[(prefix, width)]
        if width is None:
            out.append(prefix)
            continue
        nums = sorted(set(int(v) for v in vals))
        if len(nums) == 1:
            out.append(f"{prefix}{str(nums[0]).zfill(width)}")
            continue
        parts = []
        for r in format_ranges(nums).split(","):
            a, _, b = r.partition("-")
            parts.append(str(int(a)).zfill(width) + (("-" + str(int(b)).zfill(width)) if b else ""))
        out.append(f"{prefix}[{','.join(parts)}]")
    return ",".join(out)


def parse_tasks_per_node(text):
    """SLURM_TASKS_PER_NODE '2(x3),1' -> [2,2,2,1]."""
    out = []
    for part in text.split(","):
        m = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if not m:
            raise ValueError(f"bad tasks-per-node '{part}'")
        out.extend([int(m.group(1))] * int(m.group(2) or 1))
    return out


def human_bytes(n):
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f}{unit}" if unit == "B" else f"{n:.1f}{unit}"
        n /= 1024.0
    return str(n)


def read_text(path, default=None, limit=65536):
    try:
        with open(path, errors="replace") as f:
            return f.read(limit)
    except OSError:
        return default


def safe_env(env):
    """The allow-listed environment: what the report and JSON may show."""
    out = {}
    for k in sorted(env):
        if any(w in k.upper() for w in ENV_DENY_WORDS):
            continue
        if k in ENV_ALLOW_NAMES or k.startswith(ENV_ALLOW_PREFIXES):
            out[k] = env[k][:200]
    return out


# ============================================================================ contract
def _int_var(env, name, lo=None, hi=None):
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        raise UsageError(f"{name} is empty")
    try:
        val = int(raw.strip())
    except ValueError:
        raise UsageError(f"{name}={raw!r} is not an integer") from None
    if lo is not None and val < lo:
        raise UsageError(f"{name}={val} is below {lo}")
    if hi is not None and val > hi:
        raise UsageError(f"{name}={val} is above {hi}")
    return val


def _pick(env, *names):
    for n in names:
        if n in env:
            return n
    return None


def derive_port(job_id):
    """Port used when Slurm gives no MASTER_PORT: deterministic per job, in 49152-65535."""
    return 49152 + job_id % 16384


def in_batch_shell(env):
    """True in an sbatch/salloc shell: a job exists but no srun step started this process."""
    return ("SLURM_JOB_ID" in env and "RANK" not in env
            and "SLURM_STEP_ID" not in env and "SLURM_STEPID" not in env)


def read_contract(env):
    """The launch contract as a dict, or None for local mode. Raises UsageError."""
    if "RANK" not in env and "SLURM_PROCID" not in env:
        if "SLURM_JOB_ID" in env and in_batch_shell(env):
            raise UsageError("running in the Slurm batch shell, not as an srun task: launch it with "
                             "srun (one task per GPU), e.g. srun python ddp_mesh_ping.py")
        return None
    if in_batch_shell(env):
        raise UsageError("SLURM_PROCID is set but no srun step started this process (batch shell): "
                         "launch it with srun (one task per GPU), e.g. srun python ddp_mesh_ping.py")
    names = {
        "rank": _pick(env, "RANK", "SLURM_PROCID"),
        "world_size": _pick(env, "WORLD_SIZE", "SLURM_NTASKS", "SLURM_STEP_NUM_TASKS"),
        "local_rank": _pick(env, "LOCAL_RANK", "SLURM_LOCALID"),
    }
    for key, var in names.items():
        if var is None:
            wanted = {"rank": "RANK", "world_size": "WORLD_SIZE", "local_rank": "LOCAL_RANK"}[key]
            raise UsageError(f"{wanted} is not set (nor its Slurm fallback)")
    world = _int_var(env, names["world_size"], lo=1, hi=1_000_000)
    rank = _int_var(env, names["rank"], lo=0)
    if rank >= world:
        raise UsageError(f"{names['rank']}={rank} is not below {names['world_size']}={world}")
    local_rank = _int_var(env, names["local_rank"], lo=0, hi=1023)
    if local_rank > rank:
        raise UsageError(f"{names['local_rank']}={local_rank} is larger than {names['rank']}={rank}")

    addr_var = "MASTER_ADDR"
    addr = env.get("MASTER_ADDR")
    if addr is None and env.get("SLURM_JOB_NODELIST"):
        addr_var = "SLURM_JOB_NODELIST"
        try:
            addr = expand_hostlist(env["SLURM_JOB_NODELIST"])[0]
        except ValueError as e:
            raise UsageError(f"SLURM_JOB_NODELIST={env['SLURM_JOB_NODELIST']!r}: {e}") from None
    if addr is None:
        raise UsageError("MASTER_ADDR is not set (nor SLURM_JOB_NODELIST)")
    addr = addr.strip()
    if not addr or not re.fullmatch(r"[A-Za-z0-9_.:%\-\[\]]{1,253}", addr):
        raise UsageError(f"{addr_var}={addr!r} is not a host name or address")
    addr = addr.strip("[]")

    if "MASTER_PORT" in env:
        port = _int_var(env, "MASTER_PORT", lo=1, hi=65535)
        port_src = "MASTER_PORT"
    elif "SLURM_JOB_ID" in env:
        port = derive_port(_int_var(env, "SLURM_JOB_ID", lo=0))
        port_src = "SLURM_JOB_ID"
    else:
        raise UsageError("MASTER_PORT is not set (nor SLURM_JOB_ID to derive one)")
    return {"rank": rank, "world_size": world, "local_rank": local_rank,
            "master_addr": addr, "master_port": port, "port_source": port_src,
            "source": "slurm" if names["rank"] == "SLURM_PROCID" else "env"}


def slurm_expected_hosts(env, world):
    """rank -> expected host from Slurm's layout (block distribution), or {}."""
    nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST")
    tpn = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE")
    if not nodelist or not tpn or "cyclic" in env.get("SLURM_DISTRIBUTION", ""):
        return {}
    try:
        hosts = expand_hostlist(nodelist)
        counts = parse_tasks_per_node(tpn)
    except ValueError:
        return {}
    if len(hosts) != len(counts) or sum(counts) != world:
        return {}
    out, r = {}, 0
    for h, c in zip(hosts, counts, strict=True):
        for _ in range(c):
            out[r] = h
            r += 1
    return out


def slurm_expectations(env):
    """Default expected shape from what Slurm launched (the srun step first, then the job).

    Absent keys mean no expectation; an uneven layout (e.g. 2,1) sets no ranks-per-node.
    """
    out = {}
    for key, names in (("world_size", ("SLURM_STEP_NUM_TASKS", "SLURM_NTASKS")),
                       ("nodes", ("SLURM_STEP_NUM_NODES", "SLURM_JOB_NUM_NODES"))):
        for var in names:
            try:
                if env.get(var):
                    out[key] = int(env[var])
                    break
            except ValueError:
                pass
    layout = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE")
    if layout:
        try:
            counts = set(parse_tasks_per_node(layout))
            if len(counts) == 1:
                out["ranks_per_node"] = counts.pop()
            return out
        except ValueError:
            pass
    try:
        if env.get("SLURM_NTASKS_PER_NODE"):
            out["ranks_per_node"] = int(env["SLURM_NTASKS_PER_NODE"])
    except ValueError:
        pass
    return out


# ============================================================================ options
def _positive_float(text):
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not v > 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be > 0")
    return v


def _positive_int(text):
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be >= 1")
    return v


def _sizes(text):
    out = []
    for part in text.split(","):
        m = re.fullmatch(r"\s*(\d+)\s*([KMG]?)(?:i?B)?\s*", part, re.I)
        if not m:
            raise argparse.ArgumentTypeError(f"bad size {part!r} (e.g. 1M,64M,1G)")
        mult = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}[m.group(2).upper()]
        out.append(int(m.group(1)) * mult)
    return out


DEFAULT_BW_SIZES = "1M,16M,256M,1G"


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        raise UsageError(message)


def build_parser():
    p = _Parser(prog="ddp_mesh_ping.py", description=__doc__.split("\n")[0],
                formatter_class=argparse.RawDescriptionHelpFormatter,
                epilog="Every option can also be set as AIV_<OPTION> (e.g. AIV_TIMEOUT=120).")
    p.add_argument("--backend", choices=("auto", "nccl", "gloo"), default="auto",
                   help="auto: nccl when CUDA is available, else gloo")
    p.add_argument("--timeout", type=_positive_float, default=300.0,
                   help="seconds each distributed phase may take (default 300: enough for "
                        "thousands of ranks importing torch from shared storage)")
    p.add_argument("--expect-world-size", type=_positive_int)
    p.add_argument("--expect-nodes", type=_positive_int)
    p.add_argument("--expect-ranks-per-node", type=_positive_int)
    p.add_argument("--strict", action="store_true", help="treat every WARN as a FAIL")
    p.add_argument("--json", metavar="PATH", help="write the verdict as JSON (rank 0)")
    p.add_argument("--nproc", type=_positive_int, help="local mode: number of CPU ranks (default 2)")
    p.add_argument("--verify-log", metavar="FILE", help="check a saved log and exit")
    p.add_argument("--bandwidth", nargs="?", const=DEFAULT_BW_SIZES, type=_sizes, metavar="SIZES",
                   help=f"measure all_reduce bus bandwidth (default sizes {DEFAULT_BW_SIZES})")
    p.add_argument("--min-busbw", type=_positive_float, metavar="GBPS",
                   help="FAIL when the largest size's busbw is below this (GB/s, 1e9 B/s)")
    p.add_argument("--sysfs-root", default="/", help="root for /sys and /proc/driver reads (tests)")
    p.add_argument("--version", action="version", version=f"ai-infra-validator {VERSION}")
    return p


def parse_args(argv, env):
    """Flags win over AIV_<OPTION> environment variables."""
    parser = build_parser()
    injected = []
    given = {a.split("=", 1)[0] for a in argv if a.startswith("--")}
    for action in parser._actions:
        opt = next((o for o in action.option_strings if o.startswith("--")), None)
        if not opt or opt in ("--help", "--version"):
            continue
        var = "AIV_" + opt[2:].upper().replace("-", "_")
        if var not in env or opt in given:
            continue
        val = env[var]
        if action.nargs == 0:  # store_true
            if val.strip().lower() in ("1", "true", "yes", "on"):
                injected.append(opt)
            elif val.strip().lower() not in ("0", "false", "no", "off", ""):
                raise UsageError(f"{var}={val!r} is not a boolean")
        elif action.nargs == "?" and val.strip().lower() in ("1", "true", "yes", "on"):
            injected.append(opt)  # AIV_BANDWIDTH=1: the flag with its default value
        else:
            injected.append(f"{opt}={val}")
    return parser.parse_args(injected + list(argv))


# ============================================================================ interfaces
SIOCGIFFLAGS, SIOCGIFADDR, IFF_UP = 0x8913, 0x8915, 0x1


def list_interfaces():
    """{name: {'up': bool, 'addrs': [...]}} with the stdlib only."""
    out = {}
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        for _, name in socket.if_nameindex():
            req = struct.pack("256s", name.encode()[:15])
            try:
                flags = struct.unpack("H", fcntl.ioctl(s.fileno(), SIOCGIFFLAGS, req)[16:18])[0]
            except OSError:
                flags = 0
            addrs = []
            try:
                addrs.append(socket.inet_ntoa(fcntl.ioctl(s.fileno(), SIOCGIFADDR, req)[20:24]))
            except OSError:
                pass
            out[name] = {"up": bool(flags & IFF_UP), "addrs": addrs}
    finally:
        s.close()
    for line in (read_text("/proc/net/if_inet6", "") or "").splitlines():
        f = line.split()
        if len(f) >= 6 and f[5] in out and not f[0].startswith("fe80"):
            out[f[5]]["addrs"].append(":".join(f[0][i:i + 4] for i in range(0, 32, 4)))
    return out


def _usable(info):
    return info["up"] and bool(info["addrs"])


def nccl_ifname_select(spec, names):
    """Interfaces NCCL_SOCKET_IFNAME selects: comma list of prefixes; '=' exact; '^' exclude."""
    spec = spec.strip()
    exclude = spec.startswith("^")
    if exclude:
        spec = spec[1:]
    exact = spec.startswith("=")
    if exact:
        spec = spec[1:]
    pats = [p.strip() for p in spec.split(",") if p.strip()]

    def hit(name):
        return any(name == p if exact else name.startswith(p) for p in pats)
    return [n for n in names if (not hit(n)) == exclude]


def gloo_ifname_select(spec, names):
    """GLOO_SOCKET_IFNAME: comma list of exact names; gloo needs every one. -> (found, missing)."""
    wanted = [p.strip() for p in spec.split(",") if p.strip()]
    return [w for w in wanted if w in names], [w for w in wanted if w not in names]


def _iface_summary(ifaces):
    return ", ".join(f"{n}({'up' if i['up'] else 'down'}{':' + i['addrs'][0] if i['addrs'] else ''})"
                     for n, i in sorted(ifaces.items())) or "none"


def check_interfaces(env, ifaces, host):
    """Local check: each *_SOCKET_IFNAME set selects at least one up interface with an address."""
    out = []
    usable = {n for n, i in ifaces.items() if _usable(i)}
    if "NCCL_SOCKET_IFNAME" in env:
        val = env["NCCL_SOCKET_IFNAME"]
        sel = nccl_ifname_select(val, sorted(ifaces))
        good = [n for n in sel if n in usable]
        if good:
            out.append(finding("interface", "PASS", f"NCCL_SOCKET_IFNAME={val} selects {','.join(good)} on {host}",
                               [host]))
        else:
            why = f"selects {','.join(sel)} but none is up with an address" if sel else "matches no interface"
            out.append(finding("interface", "FAIL", f"NCCL_SOCKET_IFNAME={val!r} {why} on {host}; "
                               f"interfaces here: {_iface_summary(ifaces)}", [host]))
    if "GLOO_SOCKET_IFNAME" in env:
        val = env["GLOO_SOCKET_IFNAME"]
        found, missing = gloo_ifname_select(val, set(ifaces))
        bad = missing + [n for n in found if n not in usable]
        if found and not bad:
            out.append(finding("interface", "PASS", f"GLOO_SOCKET_IFNAME={val} present on {host}", [host]))
        else:
            what = ",".join(bad) or val
            out.append(finding("interface", "FAIL", f"GLOO_SOCKET_IFNAME={val!r}: {what} is absent, down or has "
                               f"no address on {host}; interfaces here: {_iface_summary(ifaces)}", [host]))
    return out


# ============================================================================ collect
def count_visible_gpus(env, root="/"):
    """GPU count without importing torch (for the local launcher)."""
    cvd = env.get("CUDA_VISIBLE_DEVICES")
    if cvd is not None:
        items = [x for x in cvd.split(",") if x.strip() and x.strip() != "-1"]
        if cvd.strip() in ("", "NoDevFiles") or not items:
            return 0
    try:
        n = len(os.listdir(os.path.join(root, "proc/driver/nvidia/gpus")))
    except OSError:
        n = len([d for d in os.listdir("/dev") if re.fullmatch(r"nvidia\d+", d)]) if os.path.isdir("/dev") else 0
    return min(n, len(items)) if cvd is not None else n


def read_ib_ports(root="/"):
    """[{'port': 'mlx5_0:1', 'state': 'ACTIVE', 'rate_gbps': 400.0, 'link_layer': 'InfiniBand'}]."""
    base = os.path.join(root, "sys/class/infiniband")
    out = []
    try:
        devs = sorted(os.listdir(base))
    except OSError:
        return out
    for dev in devs:
        try:
            ports = sorted(os.listdir(os.path.join(base, dev, "ports")), key=lambda p: int(p) if p.isdigit() else 0)
        except OSError:
            continue
        for p in ports:
            d = os.path.join(base, dev, "ports", p)
            state = (read_text(os.path.join(d, "state"), "") or "").strip()
            rate = (read_text(os.path.join(d, "rate"), "") or "").strip()
            m = re.match(r"([\d.]+)\s*Gb", rate)
            out.append({"port": f"{dev}:{p}", "state": state.split(":")[-1].strip() or "UNKNOWN",
                        "rate_gbps": float(m.group(1)) if m else None,
                        "link_layer": (read_text(os.path.join(d, "link_layer"), "") or "").strip() or None})
    return out


def _cpu_model():
    for line in (read_text("/proc/cpuinfo", "") or "").splitlines():
        if line.lower().startswith(("model name", "cpu model", "hardware")):
            return line.split(":", 1)[1].strip()
    return os.uname().machine


def _os_name():
    for line in (read_text("/etc/os-release", "") or "").splitlines():
        if line.startswith("PRETTY_NAME="):
            return line.split("=", 1)[1].strip().strip('"')
    return None


def _mem_total():
    try:
        import psutil
        return psutil.virtual_memory().total
    except Exception:
        m = re.search(r"MemTotal:\s+(\d+) kB", read_text("/proc/meminfo", "") or "")
        return int(m.group(1)) * 1024 if m else None


def _driver_version(root):
    txt = read_text(os.path.join(root, "proc/driver/nvidia/version"))
    if not txt:
        return None
    m = re.search(r"Kernel Module(?: for \S+)?\s+([\d.]+)", txt) or re.search(r"\s(\d+\.\d+(?:\.\d+)?)\s", txt)
    return m.group(1) if m else txt.splitlines()[0][:60]


PROBED_PACKAGES = ("torchvision", "torchaudio")
IMPORT_PROBE = r"""
import json, sys
name = sys.argv[1]
try:
    mod = __import__(name)
    out = {"version": getattr(mod, "__version__", "?"), "ok": True}
except Exception as e:  # an ABI-broken package is a finding, not a crash
    msg = (str(e).strip().splitlines() or [type(e).__name__])[0][:160]
    out = {"version": None, "ok": False, "error": type(e).__name__ + ": " + msg}
sys.stdout.write(json.dumps(out))
"""


def start_import_probe():
    """Import torchvision and torchaudio, each in its own child process, off the critical path
    (with torch that is seconds of work; an ABI-broken extension may even crash the importer)."""
    procs = {}
    for name in PROBED_PACKAGES:
        try:
            procs[name] = subprocess.Popen([sys.executable, "-c", IMPORT_PROBE, name], stdout=subprocess.PIPE,
                                           stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL)
        except OSError as e:
            procs[name] = e
    return procs


def import_probe_done(procs):
    return all(isinstance(p, OSError) or p.poll() is not None for p in procs.values())


def finish_import_probe(procs, wait_s):
    """{name: {'ok', 'version', 'error'}}; a probe still running after wait_s is killed."""
    out, deadline = {}, time.monotonic() + wait_s
    for name, proc in procs.items():
        if isinstance(proc, OSError):
            out[name] = {"ok": False, "version": None, "error": f"probe could not start: {proc}"}
            continue
        try:
            left = None if proc.poll() is not None else max(0.01, deadline - time.monotonic())
            text, _ = proc.communicate(timeout=left)
            data = json.loads(text or b"{}")
            if proc.returncode != 0 or not data:
                raise ValueError(f"probe exited {proc.returncode}")
            out[name] = data
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            out[name] = {"ok": False, "version": None, "error": f"import took over {wait_s:.0f}s"}
        except Exception as e:  # a crash (e.g. SIGSEGV from a broken extension) is a finding
            out[name] = {"ok": False, "version": None, "error": f"import probe failed: {e}"}
    return out


def collect_node_facts(root, torch_mod, backend, device_count):
    """Facts collected once per node (by local rank 0). Missing sources -> None."""
    shm = None
    try:
        st = os.statvfs("/dev/shm")
        shm = st.f_frsize * st.f_blocks
    except OSError:
        pass
    soft = resource.getrlimit(resource.RLIMIT_MEMLOCK)[0]
    ib = read_ib_ports(root)
    facts = {
        "cpu_model": _cpu_model(), "cpus": os.cpu_count(), "mem_total": _mem_total(),
        "os": _os_name(), "kernel": os.uname().release,
        "driver": _driver_version(root),
        "ib": ib,
        "peermem": any(os.path.isdir(os.path.join(root, "sys/module", m))
                       for m in ("nvidia_peermem", "nv_peer_mem")),
        "memlock": "unlimited" if soft == resource.RLIM_INFINITY else soft,
        "shm": shm,
        "ifaces": {n: i["addrs"][:1] for n, i in list_interfaces().items() if _usable(i)},
        "gpus_visible": device_count,
        "peer": None,
    }
    if backend == "nccl" and device_count > 1:
        try:
            n = min(device_count, 16)
            facts["peer"] = ["".join("X" if i == j else ("1" if torch_mod.cuda.can_device_access_peer(i, j) else "0")
                                     for j in range(n)) for i in range(n)]
        except Exception as e:
            facts["peer_error"] = str(e)[:120]
    return facts


def _cpu_affinity():
    try:
        return sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return list(range(os.cpu_count() or 1))


def collect_gpu(torch_mod, index, root):
    """Facts of this rank's GPU (after torch.cuda.set_device)."""
    p = torch_mod.cuda.get_device_properties(index)
    pci = None
    if hasattr(p, "pci_bus_id"):
        pci = f"{getattr(p, 'pci_domain_id', 0):04x}:{p.pci_bus_id:02x}:{p.pci_device_id:02x}.0"  # sysfs form
    uuid = str(getattr(p, "uuid", "") or "") or None
    if uuid and not uuid.startswith(("GPU-", "MIG-")):
        uuid = "GPU-" + uuid
    numa = None
    if pci:
        txt = read_text(os.path.join(root, "sys/bus/pci/devices", pci.lower(), "numa_node"))
        if txt and txt.strip().lstrip("-").isdigit():
            numa = int(txt.strip())
    numa_cpus = None
    if numa is not None and numa >= 0:
        txt = read_text(os.path.join(root, f"sys/devices/system/node/node{numa}/cpulist"))
        if txt and txt.strip():
            numa_cpus = txt.strip()
    used = None
    try:
        free, total = torch_mod.cuda.mem_get_info(index)
        used = total - free
    except Exception:
        pass
    return {"name": p.name, "vram": int(p.total_memory), "uuid": uuid, "pci": pci,
            "numa": numa, "numa_cpus": numa_cpus, "mem_used": used}


def torch_versions(torch_mod):
    nccl = None
    try:
        if torch_mod.cuda.is_available():
            v = torch_mod.cuda.nccl.version()
            nccl = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
    except Exception:
        nccl = None
    return {"torch": torch_mod.__version__, "cuda": torch_mod.version.cuda, "nccl": nccl,
            "python": ".".join(map(str, sys.version_info[:3]))}


# ============================================================================ judge
def _by_host(records):
    hosts = {}
    for r in records:
        hosts.setdefault(r["host"], []).append(r)
    return hosts


def _rank_str(r):
    return f"rank {r['rank']} ({r['host']})"


def judge_world_size(world_size, expect):
    want = expect.get("world_size")
    if want is None:
        return [finding("world-size", "PASS", f"WORLD_SIZE={world_size} (no expectation set)")]
    if want != world_size:
        return [finding("world-size", "FAIL", f"WORLD_SIZE={world_size} but {want} ranks were expected")]
    return [finding("world-size", "PASS", f"WORLD_SIZE={world_size} as expected")]


def judge_layout(records, expect):
    """Nodes count, ranks per node, local ranks 0..k-1 exactly once on every node."""
    out = []
    hosts = _by_host(records)
    for host, rs in sorted(hosts.items()):
        locs = sorted(r["local_rank"] for r in rs)
        if locs != list(range(len(rs))):
            dups = sorted({x for x in locs if locs.count(x) > 1})
            gaps = sorted(set(range(len(rs))) - set(locs))
            what = "; ".join(filter(None, [f"duplicate {format_ranges(dups)}" if dups else "",
                                           f"missing {format_ranges(gaps)}" if gaps else ""]))
            out.append(finding("layout", "FAIL", f"node {host} has local ranks {','.join(map(str, locs))} "
                               f"({what}), expected 0..{len(rs) - 1} once each",
                               [host], [r["rank"] for r in rs]))
    want_nodes = expect.get("nodes")
    if want_nodes is not None and want_nodes != len(hosts):
        out.append(finding("layout", "FAIL", f"{len(hosts)} node(s) reported ({compress_hostlist(sorted(hosts))}) "
                           f"but {want_nodes} were expected"))
    rpn = expect.get("ranks_per_node")
    if rpn is not None:
        for host, rs in sorted(hosts.items()):
            if len(rs) != rpn:
                out.append(finding("layout", "FAIL", f"node {host} runs {len(rs)} ranks but {rpn} per node "
                                   f"were expected", [host], [r["rank"] for r in rs]))
    if not out:
        counts = sorted({len(rs) for rs in hosts.values()})
        out.append(finding("layout", "PASS", f"{len(hosts)} node(s) x {'/'.join(map(str, counts))} rank(s), "
                           f"local ranks 0..k-1 once on every node"))
    return out


def judge_gpu_affinity(records):
    """No two ranks anywhere on one physical GPU (UUIDs are globally unique)."""
    gpu_recs = [r for r in records if r.get("gpu")]
    if not gpu_recs:
        return []
    out, seen = [], {}
    for r in gpu_recs:
        g = r["gpu"]
        key = g.get("uuid") or f"{r['host']}/{g.get('pci')}"
        seen.setdefault(key, []).append(r)
    for _, rs in sorted(seen.items()):
        if len(rs) > 1:
            g = rs[0]["gpu"]
            out.append(finding("gpu-affinity", "FAIL",
                               f"{' and '.join(_rank_str(r) for r in rs)} share one GPU {g.get('uuid') or '?'} "
                               f"(pci {g.get('pci') or '?'}, cuda:{rs[0].get('device')}, "
                               f"CUDA_VISIBLE_DEVICES={rs[0].get('cvd')})",
                               [r["host"] for r in rs], [r["rank"] for r in rs]))
    if not out:
        out.append(finding("gpu-affinity", "PASS", f"{len(gpu_recs)} rank(s) on {len(seen)} distinct GPU(s)"))
    return out


def judge_numa(records):
    out = []
    for r in records:
        g = r.get("gpu") or {}
        if g.get("numa") is None or g["numa"] < 0 or not g.get("numa_cpus"):
            continue
        try:
            numa_cpus = set(parse_ranges(g["numa_cpus"]))
            aff = set(parse_ranges(r["cpus"]))
        except (ValueError, KeyError):
            continue
        if not numa_cpus & aff:
            out.append(finding("numa", "WARN", f"{_rank_str(r)} runs on CPUs {r['cpus']} but its GPU "
                               f"{g.get('pci')} is on NUMA node {g['numa']} (CPUs {g['numa_cpus']})",
                               [r["host"]], [r["rank"]]))
    return out


def _spread(values):
    """{value: [hosts]} -> 'v1 on h[1-2]; v2 on h3'."""
    return "; ".join(f"{v} on {compress_hostlist(sorted(hs))}" for v, hs in sorted(values.items(), key=str))


def judge_versions(records):
    """Software stack identical across nodes: FAIL for torch/CUDA/NCCL/driver/GPU model, WARN for the rest."""
    out = []
    fields = [("torch", "FAIL", lambda r: r["versions"]["torch"]),
              ("CUDA", "FAIL", lambda r: r["versions"]["cuda"]),
              ("NCCL", "FAIL", lambda r: r["versions"]["nccl"]),
              ("GPU model", "FAIL", lambda r: (r.get("gpu") or {}).get("name")),
              ("driver", "FAIL", lambda r: (r.get("node") or {}).get("driver")),
              ("python", "WARN", lambda r: r["versions"]["python"]),
              ("OS", "WARN", lambda r: (r.get("node") or {}).get("os")),
              ("kernel", "WARN", lambda r: (r.get("node") or {}).get("kernel")),
              ("torchvision", "WARN", lambda r: ((r.get("node") or {}).get("imports") or {})
               .get("torchvision", {}).get("version")),
              ("torchaudio", "WARN", lambda r: ((r.get("node") or {}).get("imports") or {})
               .get("torchaudio", {}).get("version"))]
    for label, sev, get in fields:
        values = {}
        for r in records:
            if label in ("driver", "OS", "kernel", "torchvision", "torchaudio") and not r.get("node"):
                continue
            values.setdefault(str(get(r)), set()).add(r["host"])
        if len(values) > 1:
            groups = sorted(values.values(), key=len)
            # name the deviating nodes (all but the largest group), unless there is no majority
            odd = groups[:-1] if len(groups[-1]) > len(groups[-2]) else groups
            out.append(finding("versions", sev, f"{label} differs across nodes: {_spread(values)}",
                               [h for hs in odd for h in hs]))
    if not any(f["status"] == "FAIL" for f in out):
        r0 = records[0]
        v = r0["versions"]
        out.insert(0, finding("versions", "PASS", f"torch {v['torch']}, CUDA {v['cuda'] or '-'}, NCCL "
                              f"{v['nccl'] or '-'}, driver {(r0.get('node') or {}).get('driver') or '-'} "
                              f"identical on all nodes"))
    return out


def judge_imports(records):
    out = []
    for r in records:
        imp = (r.get("node") or {}).get("imports") or {}
        for name in ("torchvision", "torchaudio"):
            st = imp.get(name)
            if st and not st.get("ok"):
                what = "is not installed" if _import_state(st) == "missing" else "does not import"
                out.append(finding("imports", "WARN", f"{name} {what} on {r['host']}: {st.get('error')}",
                                   [r["host"]]))
    return out


def ib_hca_select(spec, ports):
    """Ports NCCL_IB_HCA selects: 'mlx5_0:1,mlx5_1' prefixes; '=' exact; '^' exclude."""
    if not spec:
        return ports
    spec = spec.strip()
    exclude = spec.startswith("^")
    spec = spec[1:] if exclude else spec
    exact = spec.startswith("=")
    spec = spec[1:] if exact else spec
    pats = [p.strip() for p in spec.split(",") if p.strip()]

    def hit(port):
        dev, num = port["port"].split(":")
        for p in pats:
            pd, _, pn = p.partition(":")
            if (dev == pd if exact else dev.startswith(pd)) and (not pn or pn == num):
                return True
        return False
    return [p for p in ports if hit(p) != exclude]


def judge_fabric(records, ib_hca=None):
    """IB ports (those NCCL_IB_HCA names, when set) ACTIVE and at their siblings' rate."""
    out = []
    nodes = {r["host"]: r["node"] for r in records if r.get("node")}
    with_ib = {h: ib_hca_select(ib_hca, n.get("ib") or []) for h, n in nodes.items()}
    with_ib = {h: ps for h, ps in with_ib.items() if ps}
    if not with_ib:
        return [finding("fabric", "PASS", "no InfiniBand ports on any node (sockets only)")] if nodes else []
    job_max = max((p["rate_gbps"] or 0) for ps in with_ib.values() for p in ps)
    for h, ps in sorted(with_ib.items()):
        node_max = max((p["rate_gbps"] or 0) for p in ps)
        for p in ps:
            if p["state"] != "ACTIVE":
                out.append(finding("fabric", "WARN", f"{h} {p['port']} is {p['state']}", [h]))
            elif (p["rate_gbps"] or 0) < node_max:
                out.append(finding("fabric", "WARN", f"{h} {p['port']} runs at {p['rate_gbps']:g} Gb/s, "
                                   f"below {node_max:g} Gb/s of its sibling ports", [h]))
            elif (p["rate_gbps"] or 0) < job_max:
                out.append(finding("fabric", "WARN", f"{h} {p['port']} runs at {p['rate_gbps']:g} Gb/s, "
                                   f"below {job_max:g} Gb/s elsewhere in the job", [h]))
    missing = sorted(set(nodes) - set(with_ib))
    if missing:
        out.append(finding("fabric", "WARN", f"no InfiniBand ports on {compress_hostlist(missing)} while "
                           f"{compress_hostlist(sorted(with_ib))} have them", missing))
    if not out:
        n = sum(len(ps) for ps in with_ib.values())
        out.append(finding("fabric", "PASS", f"{n} InfiniBand port(s) ACTIVE at {job_max:g} Gb/s on "
                           f"{len(with_ib)} node(s)"))
    return out


SHM_MIN = 1 << 30          # NCCL's SHM transport needs more than a container's 64 MiB default
GPU_BUSY_MIN = 2 << 30     # memory already used on a GPU before we allocate (our context is ~0.5 GiB)


def judge_day0(records):
    """The basics that break NCCL in practice (WARN)."""
    out = []
    per_host = {h: len(rs) for h, rs in _by_host(records).items()}
    for r in records:
        n, h = r.get("node"), r["host"]
        g = r.get("gpu") or {}
        if g.get("mem_used") is not None and g["mem_used"] > GPU_BUSY_MIN:
            out.append(finding("day0", "WARN", f"{_rank_str(r)}: {human_bytes(g['mem_used'])} of GPU "
                               f"{g.get('pci')} already in use by other processes", [h], [r["rank"]]))
        if not n:
            continue
        has_ib = any(p["state"] == "ACTIVE" for p in n.get("ib") or [])
        if has_ib and n.get("memlock") != "unlimited":
            out.append(finding("day0", "WARN", f"{h}: locked-memory limit is {human_bytes(n.get('memlock'))}, "
                               f"not unlimited (ulimit -l); RDMA registration can fail", [h]))
        if n.get("shm") is not None and n["shm"] < SHM_MIN and per_host.get(h, 1) > 1:
            out.append(finding("day0", "WARN", f"{h}: /dev/shm is {human_bytes(n['shm'])}, below "
                               f"{human_bytes(SHM_MIN)}; NCCL's shared-memory transport can fail", [h]))
        if has_ib and g and not n.get("peermem"):
            out.append(finding("day0", "WARN", f"{h}: InfiniBand present but nvidia_peermem is not loaded "
                               f"(no GPUDirect RDMA)", [h]))
    return out


def judge_local(records):
    """The local checks each rank ran before any communication; one finding per distinct
    reason (ranks of one host that share a misconfiguration are named together)."""
    merged = {}
    for r in records:
        for f in r.get("local") or []:
            if f["status"] == "PASS":
                continue
            key = (f["check"], f["status"], f["reason"])
            if key in merged:
                merged[key]["ranks"] = sorted(set(merged[key]["ranks"]) | set(f["ranks"]))
            else:
                merged[key] = dict(f)
    return list(merged.values())


def judge_all(records, world_size, expect, ib_hca=None):
    """Every check of the gathered data. records: one dict per rank that reported."""
    out = []
    out += judge_local(records)
    out += judge_world_size(world_size, expect)
    out += judge_layout(records, expect)
    out += judge_gpu_affinity(records)
    out += judge_numa(records)
    out += judge_versions(records)
    out += judge_imports(records)
    out += judge_fabric(records, ib_hca)
    out += judge_day0(records)
    return out


def judge_pre(records, world_size, expect):
    """What rank 0 can judge from the roll call alone, before NCCL exists. The layout is judged
    only over a complete roll call: a missing rank is the cause, not a layout fault."""
    complete = len(records) == world_size
    return (judge_local(records) + judge_world_size(world_size, expect)
            + (judge_layout(records, expect) if complete else []) + judge_gpu_affinity(records))


def judge_collectives(results, world_size):
    """results: per rank {'rank','host','ar_ok','ar_sum','loss','grad_digest'}."""
    out = []
    want = world_size * (world_size + 1) // 2
    bad = [r for r in results if not r["ar_ok"] or int(r["ar_sum"]) != want]
    if bad:
        out.append(finding("collective", "FAIL", "all_reduce returned wrong values on "
                           + ", ".join(f"{_rank_str(r)} (sum {r['ar_sum']:g}, expected {want})" for r in bad),
                           [r["host"] for r in bad], [r["rank"] for r in bad]))
    else:
        out.append(finding("collective", "PASS", f"all_reduce exact on {len(results)} rank(s): "
                           f"sum {want} = w(w+1)/2, element-wise pattern verified"))
    ref = results[0]["grads"]
    diff = [r for r in results if r["grads"] != ref]
    if diff:
        out.append(finding("ddp", "FAIL", "DDP gradients differ from rank 0's on "
                           + ", ".join(_rank_str(r) for r in diff), [r["host"] for r in diff],
                           [r["rank"] for r in diff]))
    else:
        out.append(finding("ddp", "PASS", f"DDP gradients identical on {len(results)} rank(s)"))
    return out


TRANSPORT_BITS = {"P2P": 1, "SHM": 2, "NET/Socket": 4, "NET/IB": 8, "COLLNET": 16, "NVLS": 32, "NET/other": 64}


def parse_nccl_transport(text):
    """Transports NCCL chose, from its own INFO lines ('Channel 00/0 : 0[0] -> 1[1] via P2P/CUMEM')."""
    found = set()
    for m in re.finditer(r" via (P2P|SHM|NET/\w+|COLLNET|CollNet|NVLS)", text):
        k = m.group(1)
        if k.startswith("NET/") and k not in TRANSPORT_BITS:
            k = "NET/other"
        found.add(k.upper() if k in ("CollNet",) else k)
    return sorted(found)


def transport_mask(kinds):
    return sum(TRANSPORT_BITS.get(k, 0) for k in set(kinds))


def transport_kinds(mask):
    return [k for k, b in TRANSPORT_BITS.items() if int(mask) & b]


def judge_transport(records, ib_disable=None):
    """Per node, the transport NCCL used; sockets between nodes while IB is ACTIVE is a FAIL
    (every correctness check passes, at ~1/100 of the bandwidth)."""
    per_host = {}
    for r in records:
        if r.get("transport") is not None:
            per_host.setdefault(r["host"], set()).update(r["transport"])
    if not per_host:
        return []
    nodes = {r["host"]: r.get("node") or {} for r in records if r.get("node")}
    out = []
    for h, kinds in sorted(per_host.items()):
        active = [p["port"] for p in nodes.get(h, {}).get("ib") or [] if p["state"] == "ACTIVE"]
        if "NET/Socket" in kinds and active and str(ib_disable).strip() != "1":
            out.append(finding("transport", "FAIL", f"{h}: NCCL used NET/Socket although InfiniBand port(s) "
                               f"{','.join(active[:4])} are ACTIVE and NCCL_IB_DISABLE is not 1 (IB not usable by "
                               f"NCCL: check the IB verbs libraries, NCCL_IB_HCA, /dev/infiniband access)", [h]))
    if not out:
        out.append(finding("transport", "PASS", "NCCL transports: " + "; ".join(
            f"{'+'.join(sorted(k)) or 'none'} on {compress_hostlist(sorted(hs))}"
            for k, hs in _invert(per_host).items())))
    return out


def _invert(per_host):
    out = {}
    for h, kinds in per_host.items():
        out.setdefault(tuple(sorted(kinds)), []).append(h)
    return out


def judge_bandwidth(results, min_busbw=None):
    """results: [{'bytes', 'busbw', ...}] measured on the whole job; FAIL below --min-busbw."""
    if not results:
        return []
    top = max(results, key=lambda b: b["bytes"])
    txt = ", ".join(f"{human_bytes(b['bytes'])} {b['busbw']:.1f} GB/s" for b in results)
    if min_busbw is not None and top["busbw"] < min_busbw:
        return [finding("bandwidth", "FAIL", f"all_reduce busbw {top['busbw']:.1f} GB/s at "
                        f"{human_bytes(top['bytes'])} is below --min-busbw {min_busbw:g} GB/s ({txt})")]
    return [finding("bandwidth", "PASS", f"all_reduce busbw: {txt}")]


def apply_strict(findings, strict):
    if not strict:
        return findings
    return [dict(f, status="FAIL") if f["status"] == "WARN" else f for f in findings]


# ============================================================================ render
BAR = "=" * 78


def _q(s):
    s = "-" if s is None or s == "" else str(s)
    return f'"{s}"' if re.search(r"\s", s) else s


def node_signature(rs):
    """What makes two nodes 'identical' for the collapsed topology view."""
    n = next((r.get("node") for r in rs if r.get("node")), {}) or {}
    g = rs[0].get("gpu") or {}
    return json.dumps([len(rs), sorted(r["local_rank"] for r in rs) == list(range(len(rs))),
                       g.get("name"), g.get("vram"), rs[0]["versions"], n.get("os"), n.get("kernel"),
                       n.get("driver"), n.get("cpu_model"), n.get("cpus"),
                       [(p["port"], p["state"], p["rate_gbps"]) for p in n.get("ib") or []],
                       n.get("imports"), n.get("memlock"),
                       sorted(set().union(*[r.get("transport") or [] for r in rs]))], sort_keys=True, default=str)


def group_nodes(records, flagged_hosts, collapse_at=2):
    """[(hosts, ranks_of_first)]: identical nodes collapsed, every flagged node alone."""
    hosts = _by_host(records)
    groups, order = {}, []
    for h, rs in hosts.items():
        key = ("flagged", h) if h in flagged_hosts else node_signature(rs)
        if key not in groups:
            groups[key] = []
            order.append(key)
        groups[key].append(h)
    out = []
    for key in order:
        hs = groups[key]
        if len(hs) < collapse_at:
            out.extend(([h], hosts[h]) for h in hs)
        else:
            out.append((hs, hosts[hs[0]]))
    return out


def _import_state(st):
    if not st:
        return "-"
    if st.get("ok"):
        return st.get("version") or "?"
    return "missing" if "ModuleNotFoundError" in (st.get("error") or "") else "BROKEN"


def render_report(state):
    """The whole report as text. state: the dict also written as JSON."""
    L = []
    recs = state.get("ranks") or []
    findings = state.get("findings") or []
    flagged = {h for f in findings if f["status"] != "PASS" for h in f["hosts"]}
    show_ranks = len(recs) <= 64
    groups = group_nodes(recs, flagged)  # identical nodes collapsed once, used by every section
    L += [BAR, "CLUSTER HARDWARE TOPOLOGY REPORT", BAR]
    hosts = _by_host(recs)
    L.append(f"  nodes={len(hosts)} ranks_reported={len(recs)}/{state['world_size']} backend={state['backend']}")
    for hs, rs in groups:
        g = rs[0].get("gpu") or {}
        gpus = f"{len(rs)}x{_q(g.get('name'))}" if g else "cpu"
        tail = f"ranks={format_ranges(r['rank'] for r in rs)}" if len(hs) == 1 else "ranks=various"
        locs = sorted(r["local_rank"] for r in rs)
        locs_s = format_ranges(locs) if len(set(locs)) == len(locs) else ",".join(map(str, locs))
        L.append(f"  node={compress_hostlist(hs)} nodes={len(hs)} ranks_per_node={len(rs)} "
                 f"local_ranks={locs_s} {tail} gpus={gpus}")
    flagged_ranks = {r for f in findings if f["status"] != "PASS" for r in f["ranks"]}
    for r in sorted(recs, key=lambda r: r["rank"]):
        if not show_ranks and r["rank"] not in flagged_ranks:
            continue
        g = r.get("gpu") or {}
        dev = f"cuda:{r['device']}" if r.get("device") is not None else "cpu"
        L.append(f"    rank={r['rank']} node={r['host']} local_rank={r['local_rank']} device={dev} "
                 f"gpu={_q(g.get('name'))} vram={human_bytes(g.get('vram')) if g else '-'} uuid={_q(g.get('uuid'))} "
                 f"pci={_q(g.get('pci'))} numa={_q(g.get('numa'))} cpus={r.get('cpus')}")
    if not show_ranks:
        L.append(f"    ({len(recs)} ranks: per-rank lines shown only for ranks named in a finding; see --json)")
    for hs, rs in groups:
        n = next((r.get("node") for r in rs if r.get("node")), None)
        if n and n.get("peer"):
            L.append(f"  peer access {compress_hostlist(hs)} (row i, col j: 1 = cuda:i can access cuda:j):")
            L.extend(f"    cuda:{i}  {' '.join(row)}" for i, row in enumerate(n["peer"]))

    L += [BAR, "NODE ENVIRONMENT DEEP DIVE", BAR]
    for hs, rs in groups:
        n = next((r.get("node") for r in rs if r.get("node")), {}) or {}
        v = rs[0]["versions"]
        imp = n.get("imports") or {}
        iv = {name: _import_state(imp.get(name)) for name in ("torchvision", "torchaudio")}
        L.append(f"  node={compress_hostlist(hs)} os={_q(n.get('os'))} kernel={_q(n.get('kernel'))} "
                 f"cpu={_q(n.get('cpu_model'))} cpus={n.get('cpus')} mem={human_bytes(n.get('mem_total'))} "
                 f"driver={_q(n.get('driver'))}")
        L.append(f"    torch={v['torch']} cuda={_q(v['cuda'])} nccl={_q(v['nccl'])} python={v['python']} "
                 f"torchvision={iv['torchvision']} torchaudio={iv['torchaudio']} "
                 f"memlock={n.get('memlock') if n.get('memlock') == 'unlimited' else human_bytes(n.get('memlock'))} "
                 f"shm={human_bytes(n.get('shm'))}")

    L += [BAR, "NETWORK INTERCONNECT & FABRIC STATUS", BAR]
    for hs, rs in groups:
        n = next((r.get("node") for r in rs if r.get("node")), {}) or {}
        ib = n.get("ib") or []
        ibs = ",".join(f"{p['port']}:{p['state']}:{p['rate_gbps'] or 0:g}Gb/s" for p in ib) or "none"
        ifs = ",".join(f"{k}({v[0] if v else '-'})" for k, v in sorted((n.get("ifaces") or {}).items())) or "-"
        tr = "+".join(sorted(set().union(*[r.get("transport") or [] for r in rs]))) or \
            ("TCP(gloo)" if state.get("backend") == "gloo" else "-")
        L.append(f"  node={compress_hostlist(hs)} ib={ibs} peermem={'yes' if n.get('peermem') else 'no'} "
                 f"transport={tr} ifaces={ifs if len(hs) == 1 else 'per-node'}")
    env = state.get("env") or {}
    shown = " ".join(f"{k}={_q(v)}" for k, v in env.items() if k.startswith(("NCCL_", "GLOO_", "TORCH_NCCL_")))
    L.append("  env: " + (shown or "(no NCCL_/GLOO_ variables set)"))

    coll = state.get("collectives")
    if coll:
        L += [BAR, "COLLECTIVES", BAR]
        L.append(f"  all_reduce exact: sum={coll['ar_sum']:g} expected={coll['ar_expected']} "
                 f"on {coll['ranks']} rank(s)")
        L.append(f"  DDP nn.Linear(10,10): global average loss={coll['loss']:.6f} "
                 f"gradients_identical={'yes' if coll['grads_identical'] else 'NO'}")
        for b in coll.get("bandwidth") or []:
            L.append(f"  busbw size={human_bytes(b['bytes'])} time={b['time_us']:.1f}us "
                     f"algbw={b['algbw']:.2f}GB/s busbw={b['busbw']:.2f}GB/s")

    L += [BAR, "FINDINGS", BAR]
    for f in findings:
        L.append(f"  [{f['status']}] {f['check']}: {f['reason']}")
    L.append(BAR)
    L.append(f"Ranks Reported: {len(recs)}/{state['world_size']}")
    L.append(f"Verdict: {state['verdict']} exit={state['exit_code']} elapsed={state['elapsed_s']:.2f}s "
             f"phases={' '.join(f'{k}={v:.2f}' for k, v in (state.get('phases') or {}).items())}")
    for line in state.get("failures") or []:
        L.append(line)
    if state["verdict"] == "PASS":
        L.append(SUCCESS_LINE)
    return "\n".join(L)


def failure_lines(findings):
    return [f"FAILURE: {f['check']}: {f['reason']}" for f in findings if f["status"] == "FAIL"]


def write_json_atomic(path, data):
    d = os.path.dirname(os.path.abspath(path)) or "."
    fd, tmp = tempfile.mkstemp(prefix=".aiv-", suffix=".json", dir=d)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=1, sort_keys=True, default=str)
            f.write("\n")
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


# ============================================================================ verify-log
# A saved log passes only when it shows one clean PASS from start to end: the success line, no
# FAILURE line, a "Verdict: PASS exit=0" line, all ranks reported, an exact all_reduce, identical
# DDP gradients, no [FAIL] finding (no [WARN] either under --strict), and counts that agree with
# each other. Progress lines ("[  1.23s] phase: ...") are never read: they are not a stable format.
LOG_SECTIONS = ("CLUSTER HARDWARE TOPOLOGY REPORT", "NODE ENVIRONMENT DEEP DIVE",
                "NETWORK INTERCONNECT & FABRIC STATUS", "COLLECTIVES", "FINDINGS")
_LOG_FAILURE = re.compile(r"(?:\[[^\]]*\]\s*)?FAILURE:")   # also "[host:rank] FAILURE: ..."
_LOG_FINDING = re.compile(r"\[(PASS|WARN|FAIL)\]\s+\S+?:")
_LOG_SUM = re.compile(r"all_reduce exact:\s*sum=(\S+)\s+expected=(\S+)\s+on\s+(\S+)\s+rank")
_LOG_GRADS = re.compile(r"DDP\b.*\bgradients_identical=(\S*)")


def _log_int(text):
    """A plain non-negative decimal number, else None."""
    return int(text) if re.fullmatch(r"[0-9]+", text) else None


def _distinct(values):
    return list(dict.fromkeys(values))


def _log_sections(lines):
    """{section title: its lines}; lines before the first section are under ''."""
    out, section = {"": []}, ""
    for s in lines:
        if s in LOG_SECTIONS:
            section = s
            out.setdefault(s, [])
        else:
            out[section].append(s)
    return out


def _log_after(lines, prefix):
    """The rest of every line that starts with prefix, stripped."""
    return [s[len(prefix):].strip() for s in lines if s.startswith(prefix)]


def _verify_totals(lines, problems, facts):
    totals = []
    for s in lines:
        m = re.search(r"Total Execution Ranks:\s*(\S+)", s)
        if m:
            n = _log_int(m.group(1))
            if n is None:
                problems.append(f"garbled 'Total Execution Ranks' line: {s[:80]}")
            else:
                totals.append(n)
    if not totals:
        problems.append("no 'Total Execution Ranks: N' line")
    elif len(set(totals)) > 1:
        problems.append(f"'Total Execution Ranks' lines disagree: {sorted(set(totals))}")
    else:
        facts["world_size"] = totals[0]


def _verify_markers(lines, problems):
    if SUCCESS_LINE not in lines:
        problems.append("success marker missing")
    problems += [f"failure reported: {s[:200]}" for s in lines if _LOG_FAILURE.match(s)]


def _verify_verdict(lines, problems, facts):
    """Exactly one verdict, and it is PASS with exit code 0 (several identical lines are fine)."""
    heads = _distinct(" ".join(v.split()[:2]) for v in _log_after(lines, "Verdict:"))
    if not heads:
        problems.append("no 'Verdict:' line")
        return
    if len(heads) > 1:
        problems.append(f"'Verdict:' lines disagree: {' | '.join(heads)}")
    problems += [f"verdict is 'Verdict: {h}', not 'Verdict: PASS exit=0'" for h in heads if h != "PASS exit=0"]
    facts["verdict"] = heads[0]


def _verify_ranks_reported(lines, world, problems):
    values = _distinct(_log_after(lines, "Ranks Reported:"))
    if not values:
        problems.append("no 'Ranks Reported: k/N' line")
    elif len(values) > 1:
        problems.append(f"'Ranks Reported' lines disagree: {' | '.join(values)}")
    for v in values:
        k, _, n = v.partition("/")
        k, n = _log_int(k), _log_int(n)
        if k is None or n is None:
            problems.append(f"garbled 'Ranks Reported' line: {v[:80]}")
            continue
        if k != n:
            problems.append(f"Ranks Reported: {v}: {k} of {n} rank(s) reported")
        if world is not None and n != world:
            problems.append(f"Ranks Reported: {v} is out of {n} rank(s) but Total Execution Ranks is {world}")


def _sum_matches(text, want):
    """sum= is printed with :g (1.00324e+06 for large worlds); expected= is an exact integer."""
    try:
        if text == format(want, "g"):
            return True
    except OverflowError:
        pass
    try:
        return float(text) == want
    except ValueError:
        return False


def _verify_sum_line(m, world, problems):
    s_txt, e_txt, r_txt = m.groups()
    e, r = _log_int(e_txt), _log_int(r_txt)
    if e is None or r is None:
        problems.append(f"garbled all_reduce line: {m.group(0)[:100]}")
        return
    if not _sum_matches(s_txt, e):
        problems.append(f"all_reduce sum={s_txt} but expected={e}")
    if world is not None and e != world * (world + 1) // 2:
        problems.append(f"all_reduce expected={e} but {world} ranks sum to {world * (world + 1) // 2}")
    if world is not None and r != world:
        problems.append(f"all_reduce ran on {r} rank(s) but Total Execution Ranks is {world}")


def _verify_collectives(lines, world, problems):
    sums = [m for m in map(_LOG_SUM.match, lines) if m]
    if not sums:
        problems.append("no 'all_reduce exact: sum=S expected=E' line (COLLECTIVES)")
    for m in sums:
        _verify_sum_line(m, world, problems)
    grads = _distinct(m.group(1) for m in map(_LOG_GRADS.match, lines) if m)
    if not grads:
        problems.append("no 'gradients_identical=' line (COLLECTIVES)")
    problems += [f"DDP gradients_identical={g or '(empty)'}, not yes" for g in grads if g != "yes"]


def _verify_findings(lines, strict, problems, facts):
    if lines is None:
        problems.append("no FINDINGS section")
        return
    counts = {"PASS": 0, "WARN": 0, "FAIL": 0}
    for s in lines:
        m = _LOG_FINDING.match(s)
        if not m:
            continue
        counts[m.group(1)] += 1
        if m.group(1) == "FAIL":
            problems.append(f"finding: {s[:200]}")
        elif m.group(1) == "WARN" and strict:
            problems.append(f"finding (a FAIL under --strict): {s[:200]}")
    facts["findings"] = counts


def _topology_line(s, problems):
    """(nodes, ranks_per_node) of one node= line of the topology section, or None."""
    kv = dict(re.findall(r"(\w+)=(\S+)", s))
    try:
        hs = expand_hostlist(kv["node"])
        n = int(kv["nodes"])
        k = int(kv["ranks_per_node"])
        locs = parse_ranges(kv["local_ranks"])
    except (KeyError, ValueError) as e:
        problems.append(f"garbled topology line ({e}): {s[:100]}")
        return None
    if len(hs) != n:
        problems.append(f"topology line lists {len(hs)} hosts but says nodes={n}: {s[:100]}")
    if sorted(locs) != list(range(k)):
        problems.append(f"node {kv['node']}: local ranks {kv['local_ranks']} are not 0..{k - 1}")
    return n, k


def _verify_topology(lines, problems, facts):
    """Nodes and ranks the topology section accounts for; returns the ranks-per-node values seen."""
    nodes, ranks, rpn_seen = 0, 0, set()
    for s in lines:
        m = re.search(r"\bbackend=(\w+)", s)
        if m and s.startswith("nodes="):
            facts["backend"] = m.group(1)
        if s.startswith("node="):
            nk = _topology_line(s, problems)
            if nk:
                nodes, ranks = nodes + nk[0], ranks + nk[0] * nk[1]
                rpn_seen.add(nk[1])
    if nodes == 0:
        problems.append("no node lines in the CLUSTER HARDWARE TOPOLOGY REPORT section")
        return rpn_seen
    facts.update(nodes=nodes, ranks_in_topology=ranks)
    if "world_size" in facts and ranks != facts["world_size"]:
        problems.append(f"topology accounts for {ranks} ranks but Total Execution Ranks is {facts['world_size']}")
    return rpn_seen


def _verify_versions(lines, problems, facts):
    found = {}
    for s in lines:
        for key, val in re.findall(r"\b(torch|cuda|nccl)=(\S+)", s):
            if val != "-":
                found[key] = val
    if not found.get("torch"):
        problems.append("torch version missing")
    if facts.get("backend") == "nccl" and not (found.get("cuda") and found.get("nccl")):
        problems.append("CUDA/NCCL versions missing for an nccl run")
    facts.update(torch=found.get("torch"), cuda=found.get("cuda"), nccl=found.get("nccl"))


def _verify_expect(expect, facts, rpn_seen, problems):
    if expect.get("world_size") is not None and facts.get("world_size") != expect["world_size"]:
        problems.append(f"Total Execution Ranks is {facts.get('world_size')}, expected {expect['world_size']}")
    if expect.get("nodes") is not None and facts.get("nodes", 0) != expect["nodes"]:
        problems.append(f"{facts.get('nodes', 0)} nodes in the topology, expected {expect['nodes']}")
    if expect.get("ranks_per_node") is not None and rpn_seen and rpn_seen != {expect["ranks_per_node"]}:
        problems.append(f"ranks per node {sorted(rpn_seen)}, expected {expect['ranks_per_node']}")


def verify_log(text, expect, strict=False):
    """Automation's check of a saved log. Returns (ok, problems, facts); ok only for a clean PASS.

    strict: a [WARN] finding is a problem too (as --strict makes it a FAIL in a run)."""
    problems, facts = [], {"backend": None}
    lines = [ln.strip() for ln in text.splitlines()]
    sections = _log_sections(lines)
    _verify_totals(lines, problems, facts)
    _verify_markers(lines, problems)
    _verify_verdict(lines, problems, facts)
    _verify_ranks_reported(lines, facts.get("world_size"), problems)
    _verify_collectives(lines, facts.get("world_size"), problems)
    _verify_findings(sections.get("FINDINGS"), strict, problems, facts)
    rpn_seen = _verify_topology(sections.get("CLUSTER HARDWARE TOPOLOGY REPORT", []), problems, facts)
    _verify_versions(sections.get("NODE ENVIRONMENT DEEP DIVE", []), problems, facts)
    _verify_expect(expect, facts, rpn_seen, problems)
    return not problems, problems, facts


def _verify_log_origin(argv):
    """Where the --verify-log value came from: the flag (or an abbreviation of it), else AIV_VERIFY_LOG."""
    for a in argv:
        opt = a.split("=", 1)[0]
        if len(opt) > 2 and "--verify-log".startswith(opt):
            return "--verify-log"
    return "AIV_VERIFY_LOG"


def run_verify_log(args, argv=()):
    """--verify-log FILE: 0 the log shows a clean PASS, 1 it does not, 2 no readable file was named."""
    origin = _verify_log_origin(argv)
    if not args.verify_log.strip():
        print(f"FAILURE: usage: {origin} is empty; give the path of a saved log")
        return EXIT_USAGE
    try:
        with open(args.verify_log, "rb") as f:
            text = f.read(256 << 20).decode("utf-8", errors="replace")
    except OSError as e:
        print(f"FAILURE: usage: {origin}: cannot read {args.verify_log}: {e.strerror or e}")
        return EXIT_USAGE
    expect = {"world_size": args.expect_world_size, "nodes": args.expect_nodes,
              "ranks_per_node": args.expect_ranks_per_node}
    ok, problems, facts = verify_log(text, expect, strict=args.strict)
    for p in problems:
        print(f"verify-log: MISSING/BAD: {p}")
    print(f"verify-log: {'PASS' if ok else 'FAIL'} {args.verify_log} world_size={facts.get('world_size')} "
          f"nodes={facts.get('nodes')} torch={facts.get('torch')}")
    return EXIT_PASS if ok else EXIT_FAIL


def judge_backend(records):
    """All ranks must use one backend (auto picks gloo where CUDA is broken)."""
    seen = {}
    for r in records:
        seen.setdefault(r.get("backend"), []).append(r)
    if len(seen) <= 1:
        return []
    minority = sorted(seen.values(), key=len)[0]
    return [finding("device", "FAIL", "ranks chose different backends: " + "; ".join(
        f"{b} on {compress_hostlist(sorted({r['host'] for r in rs}))}" for b, rs in sorted(seen.items(), key=str))
        + " (CUDA unusable where gloo was chosen?)", [r["host"] for r in minority], [r["rank"] for r in minority])]


# ============================================================================ runtime
_PRINT_LOCK = threading.Lock()


def emit(line, stream=None):
    with _PRINT_LOCK:
        stream = stream or sys.stdout
        stream.write(line + "\n")
        stream.flush()


def first_line(exc):
    """The one informative line of an exception (no C++ frames, source paths or chatter)."""
    text = str(exc).strip()
    for ln in text.splitlines():
        ln = ln.strip()
        if ln and not ln.startswith(("Exception raised from", "frame #")):
            ln = re.sub(r"^\[[^\]]*\.(?:cc|cpp|h):\d+\]\s*", "", ln)
            ln = re.split(r"\.? This is typically caused", ln)[0]
            return f"{type(exc).__name__}: {ln[:300]}"
    return type(exc).__name__


class PhaseFailure(Exception):
    """A judged failure that ends the run on this rank: (check, reason, code)."""

    def __init__(self, check, reason, code=EXIT_FAIL):
        super().__init__(reason)
        self.check, self.reason, self.code = check, reason, code


class Watchdog:
    """Bounds every phase. On expiry: the FAILURE line, flush, os._exit(code).

    torch's own timeouts do not bound every hang (a store peer that accepts and never
    answers, a hung NCCL kernel), and a signal handler cannot interrupt a blocked
    collective; a thread calling os._exit can.
    """

    def __init__(self, rank, host):
        self.rank, self.host = rank, host
        self.on_fire = None
        self._cv = threading.Condition()
        self._armed = None
        threading.Thread(target=self._loop, name="aiv-watchdog", daemon=True).start()

    def arm(self, check, what, seconds, code=EXIT_TIMEOUT):
        with self._cv:
            self._armed = (check, what, time.monotonic() + seconds, seconds, code)
            self._cv.notify()

    def disarm(self):
        with self._cv:
            self._armed = None
            self._cv.notify()

    def _loop(self):
        while True:
            with self._cv:
                while self._armed is None:
                    self._cv.wait()
                check, what, deadline, seconds, code = self._armed
                left = deadline - time.monotonic()
                if left > 0:
                    self._cv.wait(left)
                    continue
            self._fire(check, what, seconds, code)

    def _fire(self, check, what, seconds, code):
        line = f"FAILURE: {check}: rank {self.rank} ({self.host}): {what} did not complete within {seconds:.0f}s"
        if self.on_fire is not None:
            t = threading.Thread(target=self.on_fire, args=(check, line, code), daemon=True)
            t.start()
            t.join(10)
        emit(line)
        sys.stderr.flush()
        os._exit(code)


class RankRun:
    """One rank of the preflight: the phases in order, each bounded."""

    def __init__(self, args, contract, env):
        self.args, self.c, self.env = args, contract, env
        self.rank, self.world = contract["rank"], contract["world_size"]
        self.local_rank = contract["local_rank"]
        self.is0 = self.rank == 0
        self.host = env.get("SLURMD_NODENAME") or socket.gethostname()
        self.T = float(args.timeout)
        self.addr, self.port = contract["master_addr"], contract["master_port"]
        self.wd = Watchdog(self.rank, self.host)
        self.wd.on_fire = self._on_watchdog
        self.store = None
        self.phases = {}
        self.findings = []
        self.records = []
        self.collectives = None
        self.collective_findings = []
        self.published = set()
        self.acked = False
        self.expected_acks = self.world - 1
        self.verdict_at = 0.0
        self.probe = None
        self.nccl_log = None
        self.node_facts = None
        self.backend = None
        self.device = None
        expect = slurm_expectations(env)
        for key in ("world_size", "nodes", "ranks_per_node"):
            val = getattr(args, "expect_" + key)
            if val is not None:
                expect[key] = val
        self.expect = expect
        self.started_at = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")

    # ---------------------------------------------------------------- output
    def progress(self, msg):
        if self.is0:
            emit(f"[{elapsed():9.2f}s] {msg}")

    def capture_nccl_debug(self):
        """Send NCCL's INFO lines to a private per-rank file (not the operator's log) to learn the
        transport it chose. Left alone when the operator set NCCL_DEBUG_FILE or asked for INFO."""
        if self.args.backend == "gloo" or "NCCL_DEBUG_FILE" in self.env \
                or self.env.get("NCCL_DEBUG", "").upper() in ("INFO", "TRACE"):
            return None
        fd, path = tempfile.mkstemp(prefix=f"aiv-nccl-r{self.rank}-", suffix=".log")
        os.close(fd)
        os.environ["NCCL_DEBUG_FILE"] = path
        os.environ["NCCL_DEBUG"] = "INFO"
        os.environ.setdefault("NCCL_DEBUG_SUBSYS", "INIT,NET")
        return path

    def nccl_transport(self):
        """Read back the NCCL log: relay its WARN lines as the operator's NCCL_DEBUG asked, return kinds."""
        if not self.nccl_log:
            return None
        text = read_text(self.nccl_log, "", limit=8 << 20) or ""
        if self.env.get("NCCL_DEBUG", "").upper() in ("WARN", "VERSION"):
            for ln in text.splitlines():
                if " NCCL WARN " in ln:
                    emit(ln, sys.stderr)
        return parse_nccl_transport(text)

    def _drop_nccl_log(self):
        try:
            os.unlink(self.nccl_log)
        except OSError:
            pass
        self.nccl_log = None

    def failpoint(self, phase):
        """Test-only fault injection: AIV_FAILPOINT=<die|hang>:<phase>:<rank> kills (SIGKILL) or
        freezes (SIGSTOP) this rank when it reaches <phase> (rendezvous, init, collective, ddp)."""
        fp = self.env.get("AIV_FAILPOINT", "")
        m = re.fullmatch(r"(die|hang):(\w+):(\d+)", fp)
        if m and m.group(2) == phase and int(m.group(3)) == self.rank:
            sys.stdout.flush()
            os.kill(os.getpid(), signal.SIGKILL if m.group(1) == "die" else signal.SIGSTOP)

    def mark(self, name, t0):
        self.phases[name] = round(time.monotonic() - t0, 3)

    def header(self):
        if not self.is0:
            return
        emit(BAR)
        emit(f"ai-infra-validator {VERSION} ddp_mesh_ping  {self.started_at}  host={self.host}")
        emit(f"Total Execution Ranks: {self.world}")
        emit(f"Master: {self.addr}:{self.port} (port from {self.c['port_source']})  "
             f"timeout per phase: {self.T:g}s  expect: "
             + (" ".join(f"{k}={v}" for k, v in sorted(self.expect.items())) or "none"))
        emit(BAR)

    # ---------------------------------------------------------------- flow
    def run(self):
        code = EXIT_FAIL
        try:
            code = self._run()
        except _Finished as e:
            code = e.code
        except PhaseFailure as e:
            code = self._fail(e.check, e.reason, e.code)
        except BaseException as e:  # a bug must still end in one line and an exit code
            import traceback
            traceback.print_exc(file=sys.stderr)
            code = self._fail("internal", f"rank {self.rank} ({self.host}): {first_line(e)}", EXIT_FAIL)
        self._exit(code)

    def _run(self):
        self.header()
        self.progress(f"contract: rank {self.rank} of {self.world} from {self.c['source']} variables, "
                      f"local_rank {self.local_rank}, master {self.addr}:{self.port}")
        probe = self.probe = start_import_probe() if self.local_rank == 0 else None
        self.nccl_log = self.capture_nccl_debug()
        t = time.monotonic()
        # c10d prints a C++ stack trace per failed connect attempt; our FAILURE line says it once.
        os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "FATAL")
        import torch
        import torch.distributed as dist
        self.torch, self.dist = torch, dist
        self.mark("import_torch", t)
        # The DDP constructor imports torch._dynamo lazily (1-7 s); do it while we wait on the network.
        # (AIV_WARM_IMPORTS=0 turns this off, for benchmarks.)
        if self.env.get("AIV_WARM_IMPORTS", "1") != "0":
            threading.Thread(target=_warm_imports, name="aiv-warm-imports", daemon=True).start()

        t = time.monotonic()
        local, gpu = self.local_checks()
        if self.backend != "nccl" and self.nccl_log:  # auto chose gloo: no NCCL log to read
            self._drop_nccl_log()
        identity = {"rank": self.rank, "host": self.host, "hostname": socket.gethostname(),
                    "local_rank": self.local_rank, "backend": self.backend, "device": self.device,
                    "cvd": self.env.get("CUDA_VISIBLE_DEVICES"), "gpu": gpu,
                    "cpus": format_ranges(_cpu_affinity()), "versions": torch_versions(torch),
                    "local": local, "pid": os.getpid()}
        node_box = {}
        node_thread = None
        if self.local_rank == 0:
            node_thread = threading.Thread(target=self._collect_node, args=(node_box,), daemon=True)
            node_thread.start()
        self.mark("local", t)
        bad = [f for f in local if f["status"] == "FAIL"]
        ifn = ",".join(v for v in ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME") if v in self.env) or "none set"
        self.progress(f"local: backend {self.backend}, device {self._dev_str()}, interfaces checked: {ifn}, "
                      f"{len(bad)} local check(s) failed (import torch {self.phases['import_torch']:.2f}s)")

        self.rendezvous(identity)

        t = time.monotonic()
        self.init_process_group()
        self.mark("init", t)
        self.progress(f"init: {self.backend} process group of {self.world} ready ({self.phases['init']:.2f}s)")

        t = time.monotonic()
        tele = dict(identity)
        if node_thread is not None:
            node_thread.join(max(1.0, self.T / 4))
            node = node_box.get("facts") or {"error": node_box.get("error", "node facts not collected in time")}
            # the import probe usually outlasts this point; its result travels at the end
            node["imports"] = finish_import_probe(probe, 0) if import_probe_done(probe) else None
            tele["node"] = node
            self.node_facts = node
        self.wd.arm("telemetry", "gathering telemetry to rank 0", self.T + 15)
        gathered = [None] * self.world if self.is0 else None
        try:
            dist.gather_object(tele, gathered, dst=0)
        except Exception as e:
            self.phase_error("telemetry", "telemetry", e)
        self.wd.disarm()
        self.mark("telemetry", t)

        if self.is0:
            t = time.monotonic()
            self.records = gathered
            sizes = [len(json.dumps(r, default=str)) for r in gathered]
            self.findings = apply_strict(judge_all(gathered, self.world, self.expect,
                                                   self.env.get("NCCL_IB_HCA")), self.args.strict)
            self.mark("judge", t)
            counts = {s: sum(f["status"] == s for f in self.findings) for s in ("PASS", "WARN", "FAIL")}
            self.progress(f"telemetry: gathered from {len(gathered)} rank(s), max {max(sizes)} B per rank "
                          f"({self.phases['telemetry']:.2f}s); judge: {counts['PASS']} PASS, "
                          f"{counts['WARN']} WARN, {counts['FAIL']} FAIL")
            code = verdict_code(self.findings)
            self.gate("judge", code if code else "go")
            if code:
                return self.finish(code)
        else:
            val = self.wait_gate("judge")
            if val != "go":
                return self.learned(val)

        t = time.monotonic()
        self.run_collectives()
        self.mark("collectives", t)
        if self.args.bandwidth:
            t = time.monotonic()
            bw = self.run_bandwidth()
            self.mark("bandwidth", t)
            if self.is0:
                self.collectives["bandwidth"] = bw
                self.collective_findings += judge_bandwidth(bw, self.args.min_busbw)
        self.post_imports()
        if not self.is0:
            return self.learned(self.wait_gate("final"))
        self.collect_imports()
        self.findings = apply_strict(judge_all(self.records, self.world, self.expect, self.env.get("NCCL_IB_HCA"))
                                     + self.collective_findings, self.args.strict)
        code = verdict_code(self.findings)
        self.progress(f"collectives: all_reduce + DDP step on {self.world} rank(s) "
                      f"({self.phases['collectives']:.2f}s)")
        return self.finish(code)

    # ---------------------------------------------------------------- local
    def _dev_str(self):
        return f"cuda:{self.device}" if self.device is not None else "cpu"

    def local_checks(self):
        """Checks before any communication. Returns (findings, gpu facts or None)."""
        import importlib.util
        torch, dist = self.torch, self.dist
        out, gpu = [], None
        if importlib.util.find_spec("numpy") is None:
            out.append(finding("local", "FAIL", f"numpy is not importable by {sys.executable} on {self.host} "
                               f"(object collectives need it: pip install numpy)", [self.host], [self.rank]))
        backend = self.args.backend
        if backend == "auto":
            backend = "nccl" if torch.cuda.is_available() else "gloo"
        self.backend = backend
        if backend == "nccl":
            if not torch.cuda.is_available():
                out.append(finding("device", "FAIL", f"--backend nccl but CUDA is not available on {self.host} "
                                   f"(torch {torch.__version__}, CUDA_VISIBLE_DEVICES="
                                   f"{self.env.get('CUDA_VISIBLE_DEVICES', 'unset')})", [self.host], [self.rank]))
            elif not dist.is_nccl_available():
                out.append(finding("local", "FAIL", f"torch {torch.__version__} on {self.host} has no NCCL",
                                   [self.host], [self.rank]))
            else:
                count = torch.cuda.device_count()
                dev = 0 if count == 1 else self.local_rank
                if dev >= count:
                    out.append(finding("device", "FAIL", f"rank {self.rank} ({self.host}): LOCAL_RANK={self.local_rank}"
                                       f" but only {count} GPU(s) visible (CUDA_VISIBLE_DEVICES="
                                       f"{self.env.get('CUDA_VISIBLE_DEVICES', 'unset')})", [self.host], [self.rank]))
                else:
                    try:
                        torch.cuda.set_device(dev)
                        self.device = dev
                        gpu = collect_gpu(torch, dev, self.args.sysfs_root)
                    except Exception as e:
                        out.append(finding("device", "FAIL", f"rank {self.rank} ({self.host}): cuda:{dev} "
                                           f"unusable: {first_line(e)}", [self.host], [self.rank]))
        elif not dist.is_gloo_available():
            out.append(finding("local", "FAIL", f"torch {torch.__version__} on {self.host} has no gloo",
                               [self.host], [self.rank]))
        out += check_interfaces(self.env, list_interfaces(), self.host)
        for f in out:
            f["ranks"] = [self.rank]
        return out, gpu

    def _collect_node(self, box):
        try:
            count = self.torch.cuda.device_count() if self.backend == "nccl" else 0
            box["facts"] = collect_node_facts(self.args.sysfs_root, self.torch, self.backend, count)
        except Exception as e:
            box["error"] = first_line(e)

    # ---------------------------------------------------------------- rendezvous
    def _listen_socket(self):
        """Rank 0 binds the store's socket itself: only where MASTER_ADDR points, named errors."""
        import errno
        try:
            infos = socket.getaddrinfo(self.addr, self.port, type=socket.SOCK_STREAM)
        except socket.gaierror as e:
            raise PhaseFailure("rendezvous", f"MASTER_ADDR={self.addr} does not resolve on rank 0's host "
                               f"{self.host}: {e.strerror}") from None
        infos.sort(key=lambda i: i[0] != socket.AF_INET)
        fam, _, _, _, sa = infos[0]
        ip = sa[0]
        multi_node = self.expect.get("nodes", 1) > 1  # Slurm's node count is already in the expectation
        bind_ip = ("::" if fam == socket.AF_INET6 else "0.0.0.0") if (ip.startswith("127.") or ip == "::1") \
            and multi_node else ip
        s = socket.socket(fam, socket.SOCK_STREAM)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((bind_ip, self.port))
            s.listen(min(4096, max(128, self.world)))
        except OSError as e:
            s.close()
            if e.errno == errno.EADDRINUSE:
                raise PhaseFailure("rendezvous", f"address already in use on {self.host}:{self.port} "
                                   f"(MASTER_ADDR={self.addr}, MASTER_PORT={self.port}): another process "
                                   f"listens there; pick a free MASTER_PORT") from None
            if e.errno == errno.EADDRNOTAVAIL:
                raise PhaseFailure("rendezvous", f"MASTER_ADDR={self.addr} resolves to {ip}, which is not an "
                                   f"address of rank 0's host {self.host}: MASTER_ADDR must name the node "
                                   f"running rank 0") from None
            raise PhaseFailure("rendezvous", f"cannot listen on {bind_ip}:{self.port} on {self.host}: "
                               f"{e.strerror}") from None
        return s

    def rendezvous(self, identity):
        dist = self.dist
        t = time.monotonic()
        T = datetime.timedelta(seconds=self.T)
        if self.is0:
            self.wd.arm("rendezvous", f"starting the store on {self.addr}:{self.port}", 60)
            sock = self._listen_socket()
            store = dist.TCPStore(self.addr, self.port, None, True, T, wait_for_workers=False,
                                  master_listen_fd=sock.detach())
        else:
            self.wd.arm("rendezvous", f"reaching the master {self.addr}:{self.port}", self.T)
            try:
                store = dist.TCPStore(self.addr, self.port, None, False, T)
            except Exception as e:
                raise PhaseFailure("rendezvous", f"rank {self.rank} ({self.host}) cannot reach the master "
                                   f"{self.addr}:{self.port}: {first_line(e)}", EXIT_TIMEOUT) from None
        self.store = dist.PrefixStore("aiv/", store)
        self.raw_store = store
        self.failpoint("rendezvous")
        self.store.set(f"id/{self.rank}", json.dumps(identity, default=str))
        if self.store.add("arrived", 1) == self.world:
            self.store.set("all_arrived", "1")
        if not self.is0:
            self.wait_gate("roll", what=f"waiting for rank 0's roll call at {self.addr}:{self.port}")
            self.mark("rendezvous", t)
            return
        self.progress(f"rendezvous: store listening on {self.addr}:{self.port}, roll call of {self.world} rank(s)")
        self.wd.arm("rendezvous", "the roll call", self.T + 30)
        try:
            self.store.wait(["all_arrived"], T)
            missing = []
        except Exception:
            missing = [r for r in range(self.world) if not self.store.check([f"id/{r}"])]
        present = [r for r in range(self.world) if r not in set(missing)]
        self.records = [json.loads(v) for v in self.store.multi_get([f"id/{r}" for r in present])]
        self.mark("rendezvous", t)
        findings = []
        if missing:
            where = slurm_expected_hosts(self.env, self.world)
            names = ", ".join(f"{r} (expected on {where[r]})" if r in where else str(r) for r in missing[:64])
            more = f" and {len(missing) - 64} more" if len(missing) > 64 else ""
            findings.append(finding("rendezvous", "FAIL", f"rank(s) {names}{more} did not check in within "
                                    f"{self.T:g}s ({len(present)}/{self.world} reported at {self.addr}:{self.port})",
                                    [where[r] for r in missing if r in where], missing, code=EXIT_TIMEOUT))
        findings += apply_strict(judge_backend(self.records) + judge_pre(self.records, self.world, self.expect),
                                 self.args.strict)
        self.findings = findings
        code = verdict_code(findings)
        self.progress(f"rendezvous: {len(present)}/{self.world} rank(s) checked in "
                      f"({self.phases['rendezvous']:.2f}s); pre-init checks (layout, GPU affinity, local) "
                      f"{'FAIL' if code else 'pass'}")
        self.wd.disarm()
        self.expected_acks = len(present) - 1
        if code:
            raise _Finished(self.finish(code))
        self.gate("roll", "go")

    GATES = ("roll", "judge", "final")

    def gate(self, name, value):
        """Rank 0 publishes a decision every other rank waits for."""
        self.store.set(f"gate/{name}", str(value))
        self.published.add(name)

    def publish_verdict(self, code):
        """Rank 0: every gate not yet opened carries the exit code, wherever the others wait."""
        for name in self.GATES:
            if name not in self.published:
                self.gate(name, code if code else "go")

    def wait_gate(self, name, what=None):
        """Non-zero ranks: wait (bounded) for rank 0's decision; 'go' or an exit code."""
        what = what or f"waiting for rank 0's decision after {name}"
        self.wd.arm("rendezvous" if name == "roll" else name, what, self.T + 45)
        try:
            self.store.wait([f"gate/{name}"], datetime.timedelta(seconds=self.T + 30))
            val = self.store.get(f"gate/{name}").decode()
        except Exception as e:
            raise PhaseFailure("rendezvous" if name == "roll" else name,
                               f"rank {self.rank} ({self.host}) lost rank 0 at {self.addr}:{self.port} while "
                               f"{what}: {first_line(e)}", EXIT_TIMEOUT) from None
        self.wd.disarm()
        if name != "final" and val != "go":
            raise _Finished(self.learned(val))
        return val

    def learned(self, val):
        """A non-zero rank learned the verdict: acknowledge it (rank 0 keeps the store up until then)."""
        if not self.acked:
            self.acked = True
            try:
                self.store.add("acks", 1)
            except Exception:
                pass
        return EXIT_PASS if val == "go" else int(val)

    # ---------------------------------------------------------------- init / collectives
    def init_process_group(self):
        torch, dist = self.torch, self.dist
        # gloo honours this timeout and raises; NCCL's watchdog would abort the process, so
        # NCCL gets more time than our own watchdog, which then reports first.
        pg_timeout = self.T if self.backend == "gloo" else self.T + 120
        kw = {"backend": self.backend, "store": dist.PrefixStore("pg/", self.raw_store), "rank": self.rank,
              "world_size": self.world, "timeout": datetime.timedelta(seconds=pg_timeout)}
        if self.backend == "nccl":
            kw["device_id"] = torch.device("cuda", self.device)
        self.wd.arm("init", f"init_process_group({self.backend})", self.T + 15)
        self.failpoint("init")
        try:
            dist.init_process_group(**kw)
        except Exception as e:
            self.phase_error("init", "init", e)
        self.wd.disarm()

    def run_collectives(self):
        torch, dist = self.torch, self.dist
        dev = torch.device("cuda", self.device) if self.backend == "nccl" else torch.device("cpu")
        w, r = self.world, self.rank
        self.wd.arm("collective", "all_reduce of rank-encoded integers", self.T + 15)
        try:
            n = 1 << 16
            base = torch.arange(n, dtype=torch.int64, device=dev)
            x = base * (r + 1) + r
            s = torch.tensor([r + 1], dtype=torch.int64, device=dev)
            self.failpoint("collective")
            dist.all_reduce(x)
            dist.all_reduce(s)
            want = base * (w * (w + 1) // 2) + w * (w - 1) // 2
            ar_ok = bool(torch.equal(x, want))
            ar_sum = int(s.item())
        except Exception as e:
            self.phase_error("collective", "all_reduce", e)
        self.wd.arm("ddp", "DDP step on nn.Linear(10, 10)", self.T + 15)
        try:
            from torch.nn.parallel import DistributedDataParallel as DDP
            g = torch.Generator().manual_seed(1234 + r)
            xin = torch.randn(16, 10, generator=g).to(dev)
            yin = torch.randn(16, 10, generator=g).to(dev)
            model = torch.nn.Linear(10, 10).to(dev)
            ddp = DDP(model, device_ids=[self.device] if self.backend == "nccl" else None)
            self.failpoint("ddp")
            loss = torch.nn.functional.mse_loss(ddp(xin), yin)
            loss.backward()
            grads = torch.cat([p.grad.detach().flatten() for p in model.parameters()]).double()
            lsum = loss.detach().clone()
            dist.all_reduce(lsum)
            kinds = self.nccl_transport() if self.backend == "nccl" else None
            tmask = -1.0 if kinds is None else float(transport_mask(kinds))
            vec = torch.cat([torch.tensor([r, float(ar_ok), ar_sum, loss.item(), tmask], dtype=torch.float64,
                                          device=dev), grads.to(dev)])
            gl = [torch.empty_like(vec) for _ in range(w)] if self.is0 else None
            dist.gather(vec, gl, dst=0)
            avg_loss = lsum.item() / w
        except Exception as e:
            self.phase_error("ddp", "DDP step", e)
        self.wd.disarm()
        if self.is0:
            rows = [v.cpu().tolist() for v in gl]
            hosts = {rec["rank"]: rec["host"] for rec in self.records}
            results = [{"rank": int(row[0]), "host": hosts.get(int(row[0]), "?"), "ar_ok": bool(row[1]),
                        "ar_sum": row[2], "loss": row[3], "grads": row[5:]} for row in rows]
            by_rank = {rec["rank"]: rec for rec in self.records}
            for row in rows:
                if row[4] >= 0 and int(row[0]) in by_rank:
                    by_rank[int(row[0])]["transport"] = transport_kinds(row[4])
            self.collective_findings = judge_collectives(results, w) + judge_transport(
                self.records, self.env.get("NCCL_IB_DISABLE"))
            self.collectives = {"ar_sum": ar_sum, "ar_expected": w * (w + 1) // 2, "ranks": w,
                                "loss": avg_loss,
                                "grads_identical": all(res["grads"] == results[0]["grads"] for res in results)}

    def post_imports(self):
        """Node leaders: the torchvision/torchaudio probe's result, if it was still running at telemetry."""
        node = self.node_facts
        if node is None or node.get("imports") is not None:
            return
        t = time.monotonic()
        node["imports"] = finish_import_probe(self.probe, min(60.0, self.T / 2))
        self.mark("imports", t)
        if not self.is0:
            try:
                self.store.set(f"imports/{self.rank}", json.dumps(node["imports"]))
            except Exception:
                pass

    def collect_imports(self):
        """Rank 0: the import results that other node leaders posted after telemetry (bounded)."""
        pending = [r for r in self.records if r.get("node") and r["node"].get("imports") is None]
        if self.node_facts is not None and self.records:
            self.records[0].get("node", {})["imports"] = self.node_facts.get("imports")
        pending = [r for r in pending if r["rank"] != 0]
        if not pending:
            return
        keys = [f"imports/{r['rank']}" for r in pending]
        self.wd.arm("imports", "waiting for the import probes of the node leaders", min(60.0, self.T) + 20,
                    code=EXIT_TIMEOUT)
        try:
            self.store.wait(keys, datetime.timedelta(seconds=min(60.0, self.T) + 10))
        except Exception:
            pass
        for r, k in zip(pending, keys, strict=True):
            try:
                if self.store.check([k]):
                    r["node"]["imports"] = json.loads(self.store.get(k))
            except Exception:
                pass
        self.wd.disarm()

    def run_bandwidth(self):
        """all_reduce bus bandwidth as nccl-tests defines it: busbw = algbw * 2(n-1)/n, warm-up then
        timed iterations, device-synchronised, the slowest rank's time; GB/s = 1e9 bytes/s."""
        torch, dist = self.torch, self.dist
        cuda = self.backend == "nccl"
        dev = torch.device("cuda", self.device) if cuda else torch.device("cpu")
        w, out = self.world, []
        warm, iters = (5, 20) if cuda else (1, 3)
        for size in self.args.bandwidth:
            self.wd.arm("bandwidth", f"all_reduce bandwidth at {human_bytes(size)}", self.T + 15)
            try:
                x = torch.zeros(max(1, size // 4), dtype=torch.float32, device=dev)
                for _ in range(warm):
                    dist.all_reduce(x)
                if cuda:
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                for _ in range(iters):
                    dist.all_reduce(x)
                if cuda:
                    torch.cuda.synchronize()
                dt = torch.tensor([(time.perf_counter() - t0) / iters], dtype=torch.float64, device=dev)
                dist.all_reduce(dt, op=dist.ReduceOp.MAX)
                sec = dt.item()
                del x
            except Exception as e:
                self.phase_error("bandwidth", f"bandwidth probe at {human_bytes(size)}", e)
            algbw = size / sec / 1e9
            busbw = algbw * 2 * (w - 1) / w
            out.append({"bytes": size, "time_us": sec * 1e6, "algbw": algbw, "busbw": busbw})
            self.progress(f"bandwidth: {human_bytes(size)} all_reduce {sec * 1e6:.1f} us, algbw {algbw:.2f} GB/s, "
                          f"busbw {busbw:.2f} GB/s")
        self.wd.disarm()
        return out

    def phase_error(self, check, what, exc):
        """A torch error inside a distributed phase: report it and name who went silent."""
        msg = f"{what} failed on rank {self.rank} ({self.host}): {first_line(exc)}"
        code = EXIT_TIMEOUT if re.search(r"[Tt]imed? ?out|timeout", str(exc)) else EXIT_FAIL
        try:
            self.store.set(f"err/{check}/{self.rank}", msg)
            self.store.add(f"nerr/{check}", 1)
        except Exception:
            pass
        if not self.is0:
            raise PhaseFailure(check, msg, code)
        # rank 0: give live peers a moment to report their own errors, then name the silent ones
        self.wd.arm(check, f"collecting peer errors after: {msg}", 30)
        deadline = time.monotonic() + min(PEER_GRACE, self.T / 2)
        while time.monotonic() < deadline:
            try:
                if self.store.add(f"nerr/{check}", 0) >= self.world:
                    break
            except Exception:
                break
            time.sleep(0.1)
        reported, silent = [], []
        for rr in range(1, self.world):
            try:
                if self.store.check([f"err/{check}/{rr}"]):
                    reported.append(rr)
                else:
                    silent.append(rr)
            except Exception:
                break
        self.expected_acks = self.world - 1 - len(silent)
        hosts = {rec["rank"]: rec["host"] for rec in self.records}
        detail = msg
        if silent:
            detail += ("; no report from rank(s) " + ", ".join(f"{x} ({hosts.get(x, '?')})" for x in silent[:32])
                       + (" ..." if len(silent) > 32 else "") + " (dead or hung)")
        elif reported:
            detail += f"; {len(reported)} other rank(s) reported errors too"
        raise PhaseFailure(check, detail, code)

    # ---------------------------------------------------------------- verdict
    def state(self, code):
        fails = failure_lines(self.findings)
        failed_hosts = sorted({h for f in self.findings if f["status"] == "FAIL" for h in f["hosts"]})
        return {"schema_version": SCHEMA_VERSION, "tool": "ai-infra-validator", "version": VERSION,
                "started_at": self.started_at, "host": self.host,
                "verdict": "PASS" if code == EXIT_PASS else "FAIL", "exit_code": code,
                "world_size": self.world, "ranks_reported": len(self.records), "backend": self.backend,
                "master": f"{self.addr}:{self.port}", "expect": self.expect, "strict": bool(self.args.strict),
                "elapsed_s": round(elapsed(), 3), "phases": self.phases, "findings": self.findings,
                "failures": fails, "failed_hosts": failed_hosts,
                "exclude": compress_hostlist(failed_hosts) if failed_hosts else "",
                "collectives": self.collectives, "ranks": self.records, "env": safe_env(self.env)}

    def write_json(self, state):
        if self.args.json:
            try:
                write_json_atomic(self.args.json, state)
            except OSError as e:
                emit(f"WARNING: could not write --json {self.args.json}: {e.strerror}", sys.stderr)

    def finish(self, code):
        """Rank 0: publish the verdict, print the report, write JSON, let the others exit."""
        if self.store is not None:
            try:
                self.publish_verdict(code)
            except Exception:
                pass
        self.verdict_at = elapsed()
        self.progress(f"verdict: {'PASS' if code == EXIT_PASS else 'FAIL'} (exit {code})")
        st = self.state(code)
        emit(render_report(st))
        self.write_json(st)
        if self.store is not None:
            self.wait_acks(self.expected_acks)
        return code

    def wait_acks(self, n):
        """Keep the store up until every live rank has read the verdict (bounded)."""
        limit = min(30.0, self.T)
        deadline = time.monotonic() + limit
        self.wd.arm("verdict", "waiting for ranks to read the verdict", limit + 10, code=verdict_code(self.findings))
        while n > 0 and time.monotonic() < deadline:
            try:
                if self.store.add("acks", 0) >= n:
                    break
            except Exception:
                break
            time.sleep(0.02)
        self.wd.disarm()

    def _fail(self, check, reason, code):
        """This rank cannot go on. Rank 0 turns it into the verdict; another rank takes rank 0's
        verdict when it can get it, and says its own failure only when it cannot."""
        if self.is0:
            self.findings.append(finding(check, "FAIL", reason, code=code))
            return self.finish(code)
        if self.store is not None:
            try:
                self.store.set(f"err/{check}/{self.rank}", reason)
                self.wd.arm(check, "waiting for rank 0's verdict", self.T + 40, code=code)
                self.store.wait(["gate/final"], datetime.timedelta(seconds=self.T + 30))
                val = self.store.get("gate/final").decode()
                self.wd.disarm()
                if val != "go":
                    return self.learned(val)
            except Exception:
                pass
        emit(f"FAILURE: {check}: {reason}")
        return code

    def _on_watchdog(self, check, line, code):
        if self.is0:
            self.findings.append(finding(check, "FAIL", line.split(": ", 2)[-1], code=code))
            self.write_json(self.state(code))

    def _exit(self, code):
        """Flush and leave without interpreter teardown (gloo threads can SIGABRT there)."""
        self.wd.arm("verdict", "process group teardown", 20, code=code)
        for proc in (self.probe or {}).values():  # an early verdict: leave no child behind
            if not isinstance(proc, OSError) and proc.poll() is None:
                proc.kill()
        t = time.monotonic()
        try:
            if self.dist_ready():
                self.dist.destroy_process_group()
        except Exception:
            pass
        if self.env.get("AIV_TRACE") == "1":
            emit(f"trace rank {self.rank}: verdict at {self.verdict_at:.2f}s, teardown "
                 f"{time.monotonic() - t:.2f}s, exit at {elapsed():.2f}s", sys.stderr)
        if getattr(self, "nccl_log", None):
            if code != EXIT_PASS and os.path.getsize(self.nccl_log) > 0:
                emit(f"rank {self.rank} ({self.host}): NCCL debug log kept at {self.nccl_log}", sys.stderr)
            else:
                self._drop_nccl_log()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)

    def dist_ready(self):
        d = getattr(self, "dist", None)
        return d is not None and d.is_available() and d.is_initialized()


class _Finished(Exception):
    """A decision reached early (e.g. at the roll call): unwind to the exit with this code."""

    def __init__(self, code):
        super().__init__(code)
        self.code = code


def _warm_imports():
    """Import what the DDP constructor pulls in lazily, while this rank waits on the network."""
    try:
        import torch._dynamo  # noqa: F401
        import torch.nn.parallel  # noqa: F401
    except Exception:
        pass


# ============================================================================ local mode
def free_port(host="127.0.0.1"):
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def launch_local(args, argv, env):
    """No distributed environment: become the launcher, one rank per GPU or --nproc CPU ranks."""
    gpus = count_visible_gpus(env) if args.backend != "gloo" else 0
    if args.backend == "nccl" and gpus == 0:
        emit(f"FAILURE: device: --backend nccl but no GPU is visible on {socket.gethostname()}")
        return EXIT_FAIL
    backend = "nccl" if gpus > 0 else "gloo"
    nproc = args.nproc or (gpus if backend == "nccl" else 2)
    port = int(env.get("MASTER_PORT") or free_port())
    cmd = [sys.executable, os.path.abspath(__file__)] + list(argv)
    if not any(a == "--backend" or a.startswith("--backend=") for a in argv):
        cmd.append(f"--backend={backend}")
    procs = []
    for r in range(nproc):
        cenv = dict(env, RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(nproc), LOCAL_WORLD_SIZE=str(nproc),
                    MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), PYTHONUNBUFFERED="1")
        cenv.setdefault("AIV_EXPECT_NODES", "1")
        cenv.setdefault("AIV_EXPECT_RANKS_PER_NODE", str(nproc))
        cenv.setdefault("AIV_EXPECT_WORLD_SIZE", str(nproc))
        procs.append(subprocess.Popen(cmd, env=cenv, stdin=subprocess.DEVNULL))
    # The ranks bound themselves; this is the launcher's own backstop. Once rank 0 has given
    # its verdict the others get a grace period to read it, then are killed (e.g. a frozen rank).
    deadline = time.monotonic() + 7 * (args.timeout + 60)
    try:
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            if procs[0].poll() is not None:
                deadline = min(deadline, time.monotonic() + 5.0)
            time.sleep(0.05)
    except KeyboardInterrupt:
        deadline = 0
    alive = [p for p in procs if p.poll() is None]
    for p in alive:
        p.kill()
    for p in procs:
        p.wait()
    if alive and (procs[0] in alive or procs[0].returncode == EXIT_PASS):
        emit(f"FAILURE: launch: local ranks {format_ranges(procs.index(p) for p in alive)} still running at the "
             f"launcher's deadline; killed")
        return EXIT_TIMEOUT
    codes = [p.returncode for p in procs]
    if codes[0] < 0:
        emit(f"FAILURE: launch: rank 0 (pid {procs[0].pid}) died with signal {-codes[0]} before its verdict")
        return EXIT_FAIL
    if codes[0] == EXIT_PASS and any(c for p, c in zip(procs, codes, strict=True) if p not in alive):
        bad = [(r, c) for r, c in enumerate(codes) if c]
        emit("FAILURE: launch: rank 0 passed but " + ", ".join(f"rank {r} exited {c}" for r, c in bad))
        return EXIT_FAIL
    return codes[0]


# ============================================================================ main
def _rank_hint(env):
    """This process's rank when it can be read at all (to print usage errors once, not per rank)."""
    for var in ("RANK", "SLURM_PROCID"):
        try:
            return int(env[var])
        except (KeyError, ValueError):
            continue
    return None


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    env = dict(os.environ)
    try:
        args = parse_args(argv, env)
    except UsageError as e:
        if _rank_hint(env) in (None, 0):  # under srun, one line from rank 0 instead of one per rank
            emit(f"FAILURE: usage: {e}")
        return EXIT_USAGE
    if args.verify_log is not None:
        return run_verify_log(args, argv)
    if args.min_busbw and not args.bandwidth:
        args.bandwidth = _sizes(DEFAULT_BW_SIZES)
    try:
        contract = read_contract(env)
    except UsageError as e:
        if _rank_hint(env) in (None, 0):
            emit(f"FAILURE: contract: {e}")
        return EXIT_USAGE
    if contract is None:
        return launch_local(args, argv, env)
    RankRun(args, contract, env).run()
    return EXIT_FAIL  # not reached: run() always exits the process


if __name__ == "__main__":
    sys.exit(main())
