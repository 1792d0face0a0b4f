#!/usr/bin/env python3
# GENERATED FILE: do not edit. Built by tools/build.py from the modules in aiv/ (edit those, then run
# tools/build.py; tools/build.py --check fails when this file differs from what aiv/ builds). Each part
# below starts with a banner naming its source module.
"""ddp_mesh_ping.py -- multi-node, multi-GPU preflight for Slurm clusters.

Run it before an expensive training job. It checks that the launcher started the
right ranks, that every rank owns the right GPU, that the software stack matches
across nodes, that the fabric is up, and that NCCL (or gloo on CPU) completes a DDP
all-reduce ring. It never hangs: every distributed phase is bounded by --timeout.

Phases (each prints one progress line on rank 0):
  contract    read RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT
              (fallback: SLURM_PROCID / SLURM_NTASKS / SLURM_LOCALID / first host of
              SLURM_JOB_NODELIST / a port derived from SLURM_JOB_ID; an MPI launcher's);
              a pod of Kubeflow Trainer v2, PyTorchJob v1, an Indexed Job, JobSet,
              LeaderWorkerSet or Volcano (one process per node) starts its node's ranks:
              the table LAUNCHERS in aiv/launch/launchers.py
  local       backend, GPU device, NCCL_SOCKET_IFNAME / GLOO_SOCKET_IFNAME, numpy
  rendezvous  roll call through a TCPStore on MASTER_ADDR:MASTER_PORT, every value signed with
              the job's secret AIV_JOB_SECRET (HMAC-SHA256, bound to the run); rank 0 judges
              layout and GPU affinity before any NCCL communicator exists
  init        torch.distributed.init_process_group on that store
  telemetry   per-rank and per-node facts posted to the store, read by rank 0 in one read, with each
              rank's numerics check (--skip-numerics skips it): seeded bf16/TF32/fp32 matmuls and an
              elementwise kernel whose bits must match the rank's GPU model and software peers and
              whose values must lie within a tolerance of an fp64 reference (silent data corruption)
  judge       small pure checks over the gathered data -> PASS / WARN / FAIL
  screen      performance screen (--skip-screen skips it): each GPU's matmul TFLOPS and memory GB/s
              (measured on a thread of the rank's own from the local checks on, while it waits at the
              roll call and in init, timed on the device), all_reduce busbw inside each node, then
              between pairs of nodes per rail in two rounds and a third for suspects; names the slow
              GPU, node, rail or link
  soak        with --soak SECONDS: bf16 matmul on every GPU at once for SECONDS, clocks, temperature,
              power and clock-event reasons sampled; names the GPU that slows down, overheats or brakes
  collectives exact all_reduce with a closed-form sum, DDP step on nn.Linear(10, 10), each rank's
              own gradients (same input everywhere) compared before the all-reduce, gradients
              compared across ranks after it, loss all_reduced
  verdict     report, one FAILURE line per failed check, or the success line

Launch:
  python ddp_mesh_ping.py                 local mode: one rank per visible GPU, or
                                          --nproc N gloo ranks on CPU (default 2)
  srun python ddp_mesh_ping.py            one rank per Slurm task
  torchrun --nproc-per-node 8 ddp_mesh_ping.py
  python ddp_mesh_ping.py                 in a pod of a Kubernetes launcher: one rank per GPU,
                                          the node's share of the job (docs/kubernetes.md)
  python ddp_mesh_ping.py --verify-log ai_infra_smoke_test_123.log --expect-world-size 16

Exit codes: 0 PASS, 1 FAIL (a check failed), 2 USAGE (bad flags or launch contract,
nothing attempted), 3 TIMEOUT (a deadline passed: missing ranks, unreachable master,
a collective that never completed), 4 INTERNAL (the tool's own error: no host blamed),
5 INTERRUPTED (SIGTERM/SIGINT: scancel, the time limit, preemption, Ctrl-C: no host blamed).
Every mistake in a flag, variable or launch variable is one FAILURE line and exit 2. Every option
but --verify-log can also be set through an environment variable AIV_<OPTION> (e.g.
AIV_TIMEOUT=120); the command line wins.

Stable strings for automation:
  Total Execution Ranks: N
  SUCCESS: DDP Multi-Node AllReduce Ring Complete!
  FAILURE: <check>: <reason>        (check names: see CHECKS below)
"""
import argparse
import collections
import contextlib
import copy
import ctypes
import datetime
import difflib
import errno
import fcntl
import functools
import gc
import glob
import hashlib
import heapq
import hmac
import html
import inspect
import ipaddress
import itertools
import json
import math
import os
import queue
import re
import resource
import shlex
import shutil
import signal
import socket
import stat
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from typing import NamedTuple


# ============================================================================ aiv/core/base.py
# Floor 1: the tool's constants and stable names (CHECKS, exit codes), findings and verdict codes,
VERSION = "1.0.0"
DESCRIPTION = "ddp_mesh_ping.py -- multi-node, multi-GPU preflight for Slurm clusters."
SCHEMA_VERSION = 1
SUCCESS_LINE = "SUCCESS: DDP Multi-Node AllReduce Ring Complete!"
EXIT_PASS, EXIT_FAIL, EXIT_USAGE, EXIT_TIMEOUT = 0, 1, 2, 3
EXIT_INTERNAL = 4     # a bug in the tool: no host is blamed
EXIT_INTERRUPTED = 5  # the run was stopped from outside (scancel, time limit, preemption, Ctrl-C): no host is blamed
HOST_CODES = (EXIT_FAIL, EXIT_USAGE, EXIT_TIMEOUT)  # codes of findings that carry evidence about the cluster

# The stable names that follow "FAILURE:" (documented in docs/checks.md).
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
    "verdict",       # a rank died or hung after the collectives, before the verdict
    "bandwidth",     # all_reduce bus bandwidth below --min-busbw
    "transport",     # NCCL fell back to sockets although IB is active
    "manifest",      # a node drifted from the accepted --manifest (FAIL or WARN by field)
    "internal",      # an unexpected error inside the tool (a bug: please report it; exit 4, no host blamed)
    "interrupted",   # SIGTERM/SIGINT stopped the run (scancel, time limit, preemption; exit 5, no host blamed)
    "gpu-perf",      # performance screen: a GPU's matmul TFLOPS or memory GB/s below its model's peers or table row
    "intra-node",    # performance screen: a node's all_reduce busbw inside the node below the other nodes'
    "inter-node",    # performance screen: a node, a node's rail (HCA) or a link slow between nodes
    "soak",          # --soak: a GPU's matmul speed decayed under sustained load, or its clocks slowed for heat or power
    "numerics",      # a rank computes wrong numbers: bits unlike its model's peers, or off the fp64 reference
    "drain",         # --drain on: scontrol missing, refused or silent (WARN only: never changes the verdict)
    "output",        # a requested --json / --metrics / --html file could not be written (exit 1, no host blamed)
    "gpu-count",     # --node-check: a GPU the node should have is missing, or lost to NVML
    "gpu-procs",     # --node-check: a process holds the job's GPU before the job starts or after it ended
    "gpu-health",    # --node-check: uncorrected ECC errors, a row remap pending or failed; PCIe, clocks, Xid (WARN)
)

# What each check can say besides PASS, without --strict (which makes every WARN a FAIL). docs/checks.md's
# table has a FAIL and a WARN column per check: a test holds them to this, and finding() refuses any other
# level, as it refuses a check not in CHECKS. --node-check: a check that could not run through the tool's own
# fault (usage, contract, launch, local, interrupted, manifest, internal, output) is a WARN row, the node NOT ASSESSED.
_FAIL_ONLY = ("device", "interface", "world-size", "layout", "gpu-affinity", "init", "telemetry", "collective", "ddp",
              "verdict", "bandwidth")
_WARN_ONLY = ("numa", "imports", "fabric", "day0", "drain")
CHECK_LEVELS = {c: ("FAIL",) if c in _FAIL_ONLY else ("WARN",) if c in _WARN_ONLY else ("FAIL", "WARN") for c in CHECKS}

# Environment variables the report may print. Nothing else is ever echoed.
ENV_ALLOW_PREFIXES = ("NCCL_", "GLOO_", "TORCH_NCCL_", "AIV_")
ENV_ALLOW_NAMES = (
    "CUDA_VISIBLE_DEVICES", "MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE",
    "SLURM_JOB_ID", "SLURM_JOB_NAME", "SLURM_JOB_NODELIST", "SLURM_JOB_NUM_NODES",
    "SLURM_NTASKS", "SLURM_NTASKS_PER_NODE", "SLURM_TASKS_PER_NODE", "SLURM_CPUS_PER_TASK",
    "SLURM_JOB_PARTITION", "SLURM_CLUSTER_NAME", "SLURM_GPUS_ON_NODE", "SLURM_DISTRIBUTION",
)
ENV_DENY_WORDS = ("TOKEN", "SECRET", "PASSWORD", "PASSWD", "CREDENTIAL", "AUTH", "KEY", "COOKIE")

_T0 = time.monotonic()


class UsageError(Exception):
    """A malformed flag, variable or launch contract: nothing was attempted (exit 2). own: the mistake
    is in this rank's own values (RANK, LOCAL_RANK, ...), which rank 0 cannot see."""

    def __init__(self, message, own=False):
        super().__init__(message)
        self.own = own


def finding(check, status, reason, hosts=(), ranks=(), code=EXIT_FAIL, blame=None):
    """One judged fact. status is PASS, WARN or FAIL; code is the exit code a FAIL implies; blame: the kind of
    evidence that singles out its hosts (aiv/core/blame.py), without which blame_gate names none."""
    if check not in CHECKS:
        raise ValueError(f"finding() got check {check!r}, which is not in CHECKS")
    if status != "PASS" and status not in CHECK_LEVELS[check]:
        raise ValueError(f"finding() got {status} for {check}, which CHECK_LEVELS says gives only "
                         f"{'/'.join(CHECK_LEVELS[check])}")
    f = {"check": check, "status": status, "reason": reason,
         "hosts": sorted(set(hosts)), "ranks": sorted(set(ranks))}
    if status == "FAIL" and code != EXIT_FAIL:
        f["code"] = code
    if blame is not None:
        f["blame"] = blame
    return f


def verdict_code(findings):
    """0 when nothing FAILed, else the largest exit code the failures imply. Evidence about the cluster
    (1, 2, 3) wins over the tool's own error (4) and an interruption (5): a rank that died before the
    run was stopped is still the news."""
    codes = [f.get("code", EXIT_FAIL) for f in findings if f["status"] == "FAIL"]
    return max([c for c in codes if c in HOST_CODES] or codes, default=EXIT_PASS)


STATUS_RANK = {"PASS": 0, "WARN": 1, "FAIL": 2}


def finding_rows(findings):
    """The report's FINDINGS rows: [(status, check, reason)], one row per check and node set, never a
    contradiction. WARN/FAIL findings of one check that name the same node(s) are one row (the worst
    status, their reasons joined by ' | '); an identical reason twice is said once. A PASS counts the nodes
    in its hosts (no hosts: every node): a node with a WARN or FAIL under the same check is taken out of it,
    the row dropped when none is left, else saying which nodes it does not cover ('(except node3: see its
    FAIL row)'). The findings themselves (JSON, FAILURE lines) are untouched."""
    worst, rows, at = {}, [], {}  # worst: {check: {host: the worst status a WARN/FAIL gives it}}
    for f in findings:
        if f["status"] != "PASS":
            per = worst.setdefault(f["check"], {})
            for h in f["hosts"]:
                per[h] = max(per.get(h, "WARN"), f["status"], key=STATUS_RANK.get)
    for f in findings:
        text = f["reason"] + (" (accepted in manifest)" if f.get("accepted") else "")
        if f["status"] == "PASS":
            per = worst.get(f["check"], {})
            off = sorted({h for h in f["hosts"] if h in per} if f["hosts"] else per)
            if off and len(off) == len(set(f["hosts"])):
                continue
            if off:
                text += (f" (except {compress_hostlist(off)}: see its "
                         f"{max((per[h] for h in off), key=STATUS_RANK.get)} row)")
            rows.append([f["status"], f["check"], [text]])
            continue
        key = (f["check"], tuple(sorted(set(f["hosts"])))) if f["hosts"] else object()  # no host: a row of its own
        if key not in at:
            rows.append(at.setdefault(key, [f["status"], f["check"], []]))
        row = at[key]
        if STATUS_RANK.get(f["status"], 0) > STATUS_RANK.get(row[0], 0):
            row[0] = f["status"]
        if text not in row[2]:
            row[2].append(text)
    return [(st, check, " | ".join(texts)) for st, check, texts in rows]


def elapsed():
    return time.monotonic() - _T0


def group_by(items, key, value=lambda x: x):
    """{key(x): [value(x), ...]}, the keys in the order first seen."""
    out = {}
    for x in items:
        out.setdefault(key(x), []).append(value(x))
    return out


def format_ranges(nums):
    """[0,1,2,5,7,8] -> '0-2,5,7-8' (a run of consecutive numbers keeps one difference to its index)."""
    runs = [[n for _, n in g] for _, g in itertools.groupby(enumerate(sorted(set(nums))), lambda p: p[1] - p[0])]
    return ",".join(str(r[0]) if len(r) == 1 else f"{r[0]}-{r[-1]}" for r in runs)


def parse_ranges(text):
    """'0-2,5' -> [0,1,2,5]. Raises ValueError on garbage."""
    out = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            raise ValueError("empty range")
        a, sep, b = part.partition("-")
        a, b = int(a), int(b) if sep else int(a)
        if b < a or b - a > 1_000_000:
            raise ValueError(f"bad range {part}")
        out.extend(range(a, b + 1))
    return out


def _split_top(text, sep=","):
    """Split on sep outside brackets (depth: the brackets open after each character)."""
    depth = list(itertools.accumulate((ch == "[") - (ch == "]") for ch in text))
    if min(depth, default=0) < 0:
        raise ValueError("unbalanced ']'")
    if depth and depth[-1]:
        raise ValueError("unbalanced '['")
    cuts = [i for i, ch in enumerate(text) if ch == sep and not depth[i]]
    return [text[a + 1:b] for a, b in zip([-1] + cuts, cuts + [len(text)], strict=True)]


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
    groups = {}  # in the order first seen
    for h in hosts:
        m = re.fullmatch(r"(.*?)(\d+)", h)
        key = (m.group(1), len(m.group(2)) if m.group(2).startswith("0") else 0) if m else (h, None)
        groups.setdefault(key, []).append(m.group(2) if m else None)
    out = []
    for (prefix, width), vals in groups.items():
        if width is None:
            out.append(prefix)
            continue
        nums = sorted(set(int(v) for v in vals))
        if len(nums) == 1:
            out.append(f"{prefix}{str(nums[0]).zfill(width)}")
            continue
        parts = ("-".join(str(n).zfill(width) for n in r.split("-")) for r in format_ranges(nums).split(","))
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


def read_text(path, default=None, limit=65536):
    try:
        with open(path, errors="replace") as f:
            return f.read(limit)
    except OSError:
        return default


def safe_env(env):
    """The allow-listed environment: what the report and JSON may show."""
    return {k: env[k][:200] for k in sorted(env) if not any(w in k.upper() for w in ENV_DENY_WORDS)
            and (k in ENV_ALLOW_NAMES or k.startswith(ENV_ALLOW_PREFIXES))}


def _screen_key(name):
    """Natural order of node names: gpu-2 before gpu-10."""
    return [(0, int(t), t) if t.isdigit() else (1, 0, t) for t in re.split(r"(\d+)", str(name)) if t]


def _screen_sorted(names):
    return sorted(set(names), key=_screen_key)


def _screen_quantile(v, q):
    """q-quantile of the sorted list v, linear interpolation."""
    pos = q * (len(v) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (pos - lo)


def _screen_median(values):
    v = sorted(values)
    return _screen_quantile(v, 0.5) if v else None


def first_text_line(text, limit=160):
    """A command's first non-blank line of output, stripped and cut at `limit` ('' when none)."""
    return next((ln.strip() for ln in (text or "").splitlines() if ln.strip()), "")[:limit]


def scontrol_reason(line):
    """The Reason= of one `scontrol show node -o` line: everything up to the next field (or the line's end),
    without Slurm's trailing [user@time]; '' when absent."""
    reason = re.search(r"\sReason=(.*?)(?=\s+[A-Z][A-Za-z]+=|$)", line or "")
    return re.sub(r"\s*\[[^\]]*@[^\]]*\]$", "", reason.group(1).strip()) if reason else ""


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


# The exceptions that can be news about the cluster: torch reports distributed, CUDA and NCCL failures as
# RuntimeError (DistError, DistBackendError, OutOfMemoryError, AcceleratorError), the network as OSError or
# TimeoutError. `except CLUSTER_ERRORS:` handles those and lets the tool's own error through.
CLUSTER_ERRORS = (RuntimeError, OSError, TimeoutError, MemoryError)


def is_tool_error(exc):
    """An exception that says nothing about the cluster (none of CLUSTER_ERRORS): a bug in the tool (check
    `internal`, exit 4, no host blamed)."""
    return not isinstance(exc, CLUSTER_ERRORS)


def where_raised(exc):
    """The innermost function of this file in the exception's traceback ('?' when none)."""
    import traceback
    here = os.path.abspath(__file__)
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if os.path.abspath(f.filename) == here]
    return frames[-1].name if frames else "?"


def internal_finding(exc, who):
    """The FAIL for the tool's own error: `<exception> in <function>`, no host, exit 4."""
    return finding("internal", "FAIL", f"{first_line(exc)} in {where_raised(exc)} ({who}): a bug in the tool, not "
                   f"a fault of the cluster: no host is blamed (the traceback is on stderr)", code=EXIT_INTERNAL)


def print_traceback(exc):
    import traceback
    with contextlib.suppress(Exception):
        traceback.print_exception(type(exc), exc, exc.__traceback__, file=sys.stderr)


class Verdict(Exception):
    """The run ends here with this exit code; `findings` are added to what rank 0 reports."""

    def __init__(self, code, findings=()):
        super().__init__(code)
        self.code, self.findings = code, list(findings)


def failed(check, reason, code=EXIT_FAIL, hosts=(), ranks=(), blame=None):
    return Verdict(code, [finding(check, "FAIL", reason, hosts, ranks, code=code, blame=blame)])


def _counts(findings):
    return ", ".join(f"{sum(f['status'] == s for f in findings)} {s}" for s in ("PASS", "WARN", "FAIL"))



# ============================================================================ aiv/core/names.py
# Floor 1: the names the collectors and the judges share, effect-free: the packages probed beside torch,
# -- the software probed beside torch (checks/collect.py imports them in a child process)
PROBED_PACKAGES = ("torchvision", "torchaudio")


def nccl_list(spec):
    """NCCL's list of names (NCCL_SOCKET_IFNAME, NCCL_IB_HCA): '^' excludes, '=' matches exactly, else
    prefixes -> (exclude, exact, [pattern])."""
    spec = spec.strip()
    exclude, spec = spec.startswith("^"), spec.removeprefix("^")
    exact, spec = spec.startswith("="), spec.removeprefix("=")
    return exclude, exact, [p.strip() for p in spec.split(",") if p.strip()]


def ib_hca_select(spec, ports):
    """Ports NCCL_IB_HCA selects: 'mlx5_0:1,mlx5_1' prefixes; '=' exact; '^' exclude."""
    if not spec:
        return ports
    exclude, exact, pats = nccl_list(spec)

    def hit(port):
        dev, num = port["port"].split(":")
        return any((dev == pd if exact else dev.startswith(pd)) and (not pn or pn == num)
                   for pd, _, pn in (p.partition(":") for p in pats))
    return [p for p in ports if hit(p) != exclude]


# -- facts read under load: the GPU's clock limits (NVML's clock-event reasons)
THROTTLE_IGNORED = 0x1 | 0x2   # GPU idle, application clocks setting: not a slowdown
THROTTLE_REASONS = {0x4: "sw-power-cap", 0x8: "hw-slowdown", 0x10: "sync-boost", 0x20: "sw-thermal",
                    0x40: "hw-thermal", 0x80: "hw-power-brake", 0x100: "display-clocks"}
THROTTLE_FAULTS = 0x8 | 0x20 | 0x40 | 0x80  # heat, a power brake or the board slowing the clocks: a WARN


def throttle_names(mask):
    """Names of the active clock limits in an NVML bitmask, the idle and application-clock bits left out."""
    mask = int(mask or 0) & ~THROTTLE_IGNORED
    names = [n for bit, n in sorted(THROTTLE_REASONS.items()) if mask & bit]
    rest = mask & ~sum(THROTTLE_REASONS)
    return names + ([hex(rest)] if rest else [])


# -- what nvidia-smi is read for (screen/measure.py reads it)
SMI_WHAT = "SM clock, clock limits, temperature and power under load"  # what SmiProbe reads, as a note names it
NODE_SMI_WHAT = "uncorrected ECC errors and row remapping"  # what the node's call reads, as a note names it

# -- the numerics check's kinds (checks/numerics_measure.py computes them, checks/numerics.py judges them)
NUMERICS_CHECKS = ("matmul-bf16", "linear-bf16", "matmul-fp32", "matmul-tf32", "elementwise-fp32", "ddp-grad")
NUMERICS_WHAT = {
    "matmul-bf16": "bf16 matmul through torch.matmul",
    "linear-bf16": "bf16 linear with bias through F.linear",
    "matmul-fp32": "fp32 matmul through @, TF32 off",
    "matmul-tf32": "fp32 matmul through @ with TF32",
    "elementwise-fp32": "fp32 a*b+c through torch.addcmul",
    "ddp-grad": "the DDP step's local gradients before the all-reduce: nn.Linear(10, 10), the same input on "
                "every rank",
}

# -- the drain (out/outputs.py plans it, out/drain.py and node/check.py apply it)
DRAIN_PREFIX = "aiv:"       # the reason's owned prefix: a site finds (and resumes) our drains by it



# ============================================================================ aiv/core/blame.py
# Floor 1: the blame law, in one place. A host is named (failed_hosts, exclude, a drain) only on evidence
# Evidence that singles a host out: a finding standing on it may name the host.
LOCALISING = {
    "process": "its own process state: dead, frozen or unreachable",
    "own": "its own state, seen on its host by its own rank: a local check, a device error, a counter, a process "
           "of its own",
    "persisted": "a measurement that persisted when measured again",
    "majority": "a fact unlike a strict majority of its class",
    "reference": "a result off the fp64 reference that its peers of the same model and software meet",
    "manifest": "a fact unlike the accepted manifest",
    "never-issued": "a collective it never issued while its peers did",
}

# Evidence that does not: the finding names no host. Each with why, and what would localise it.
UNLOCALISED = {
    "everyone": ("every member of its class, or most of them, alike: none is singled out",
                 "an accepted --manifest (docs/manifest.md) or the per-model table says which value is right"),
    "tie": ("no strict majority: the values split evenly, so this run cannot tell which side is wrong",
            "a run with a third node of the class, or an accepted --manifest (docs/manifest.md)"),
    "not-collected": ("the evidence did not come back from every node in time",
                      "a re-run: the facts that did not come back name their host when they do"),
    "once": ("measured once, not again", "a re-run: a value slow again when measured again names its host"),
    "all-issued": ("every rank issued the collective and none finished: the fabric between them, not a host",
                   "the screen's pair results (the inter-node rows), or a run with the screen on"),
    "stuck": ("alive but did not finish within its bound, and nothing shows what held it: a slow or loaded node is "
              "not a broken one",
              "a re-run: a rank stuck again is named by the collective it never issued; on a loaded node a longer "
              "bound (--timeout, --rollcall-timeout)"),
    "signal": ("a signal stopped the run from outside (scancel, the time limit, preemption, Ctrl-C)",
               "nothing on the cluster: resubmit"),
    "tool": ("the tool's own error, not a fault of the cluster", "a report of the line and the traceback"),
    "launch": ("how the launcher placed the ranks, not a fault of a node",
               "the launch command and the allocation (docs/slurm.md)"),
    "widespread": ("more nodes implicated than passed: a switch, the fabric or its configuration",
                   "the switches and the fabric's configuration; then a re-run"),
    "link": ("the path between the nodes, not either node: each is at speed with other partners",
             "the cables and the switch path between them; a re-run with other partners"),
    "forged": ("a value on the side channel failed authentication: the run's evidence came through a store written "
               "from outside the job, so no host is named on it",
               "a re-run with the job's secret (AIV_JOB_SECRET) on a MASTER_PORT nothing else reaches"),
    "undeclared": ("its check declares no evidence that names a host",
                   "a report of this line: a check must declare its evidence (docs/development.md)"),
}
EVIDENCE = tuple(LOCALISING) + tuple(UNLOCALISED)


NODE_CONTEXTS = ("prolog", "epilog", "health", "npd")  # the node gate's (--node-check CONTEXT)
NODE_COMPUTE = ("prolog", "health", "npd")  # where it computes; the epilog stays passive (the next job waits on it)


def rule(names=(), drain=(), why=None, contexts=("job",)):
    """A check's declaration: the evidence on which it may name a host (names), the part of it on which it may
    drain (drain: a subset of names, each with `why` that evidence persists) and where it runs (contexts:
    'job', the preflight; the node gate's NODE_CONTEXTS, where a FAIL on drain evidence fails a prolog or an
    epilog, drains the node or raises the NPD condition)."""
    names, drain = tuple(names), tuple(drain)
    if not set(names) <= set(LOCALISING) or not set(drain) <= set(names) or (drain and not why):
        raise ValueError(f"rule(names={names}, drain={drain}): names must be localising evidence, drain a part of "
                         "them, and a drain must say why its evidence persists")
    return {"names": names, "drain": drain, "why": why, "contexts": tuple(contexts)}


_PROCESS_WHY = ("a rank whose process died, froze or whose node stopped answering in the middle of a run is a "
                "fault of its node (its GPU, kernel, memory or network) that a re-run there meets again")
_NODE = ("job",) + NODE_COMPUTE  # checks the node gate (--node-check) also makes, where it computes
# Every check of CHECKS, declared. A check not declared here names no host and drains nothing.
CHECK_RULES = {
    "usage": rule(), "contract": rule(), "launch": rule(), "layout": rule(),
    "world-size": rule(("majority",)),  # a process launched with another WORLD_SIZE than most nodes' ranks
    "bandwidth": rule(), "internal": rule(), "interrupted": rule(), "output": rule(), "drain": rule(),
    "local": rule(("own", "majority"), ("own",), "a rank's own software or configuration on its host (a missing "
                  "numpy, an old torch, an interface) stays until the node is fixed"),
    "device": rule(("own", "majority"), ("own", "majority"), "a GPU that CUDA cannot use, or a node whose ranks "
                   "chose another backend than the rest, stays so until the node is repaired", _NODE),
    "interface": rule(("own", "majority"), ("own", "majority"), "a node's interfaces and the address its hostname "
                      "maps to stay until the node is reconfigured"),
    "rendezvous": rule(("process", "own"), ("process",), _PROCESS_WHY + "; so does a rank that never checked in "
                       "while its peers did"),
    "gpu-affinity": rule(("majority",), ("majority",), "a node that binds two ranks to one GPU, unlike the other "
                         "nodes, does so from its own configuration (gres.conf, its slurmd) on every run"),
    "numa": rule(("own",)),
    "versions": rule(("majority", "manifest"), ("majority", "manifest"), "software installed on a node stays "
                     "until it is reinstalled"),
    "imports": rule(("own", "majority")),
    "fabric": rule(("own", "majority")),
    "day0": rule(("own",)),
    "init": rule(("process", "own", "never-issued"), ("process",), _PROCESS_WHY),
    "telemetry": rule(("process", "own", "never-issued"), ("process",), _PROCESS_WHY),
    "collective": rule(("process", "own", "never-issued", "majority"), ("process",), _PROCESS_WHY),
    "ddp": rule(("process", "own", "never-issued", "majority"), ("process",), _PROCESS_WHY),
    "verdict": rule(("process", "own"), ("process",), _PROCESS_WHY),
    "transport": rule(("own",), ("own",), "NCCL falling back to sockets on a node whose InfiniBand ports are "
                      "ACTIVE is its own libraries or device access, which stay until fixed"),
    "manifest": rule(("manifest",), ("manifest",), "a node unlike the accepted manifest stays so until it is "
                     "reinstalled or the manifest is accepted anew", ("job",) + NODE_CONTEXTS),
    "gpu-perf": rule(("persisted", "own", "process", "never-issued"), ("persisted", "own", "process"),
                     "a GPU slow again when measured again, or whose row remapping failed, stays so until it "
                     "is repaired; " + _PROCESS_WHY, _NODE),
    "intra-node": rule(("persisted", "own", "process", "never-issued"), ("persisted", "own", "process"),
                       "a node slow inside in every try, beside known-good nodes, or whose own all-reduce returns "
                       "wrong sums, stays so until its NVLink, NVSwitch or PCIe is repaired; " + _PROCESS_WHY, _NODE),
    "inter-node": rule(("persisted", "process", "never-issued"), ("persisted", "process"),
                       "a node slow with two different partners after re-measurement and fine with none stays so "
                       "until its NIC, cable or switch port is repaired; " + _PROCESS_WHY),
    "soak": rule(("persisted", "own", "process"), ("persisted", "own", "process"),
                 "a GPU that slows down, overheats or brakes over a sustained load does so again under the next "
                 "job's load; " + _PROCESS_WHY),
    "numerics": rule(("reference", "majority", "own"), ("reference", "majority", "own"),
                     "a GPU that computed wrong bits (off the fp64 reference its peers meet, unlike a strict "
                     "majority of them, or unlike its own first result) computes wrong again: silent data "
                     "corruption persists until the GPU is replaced", _NODE),
    "gpu-count": rule(("own",), ("own",), "a GPU the node should have (--expect-gpus, the job's SLURM_JOB_GPUS, the "
                      "node's gres, the GPUs on its PCI bus) that NVML does not list stays missing until the node is "
                      "repaired", NODE_CONTEXTS),
    "gpu-procs": rule(("own",), ("own",), "a process holding the job's GPU before the job starts or after it ended, "
                      "still there a second later, outlived its own job; a busy GPU beside jobs is never judged",
                      NODE_CONTEXTS),
    "gpu-health": rule(("own",), ("own",), "a failed row remap is memory the GPU can no longer repair: it stays "
                       "until the GPU is replaced (NVIDIA's RMA policy); uncorrected ECC counts and a pending remap "
                       "(contained, applied at the next GPU reset), the PCIe link and clocks under load and Xid lines "
                       "WARN and drain nothing", NODE_CONTEXTS),
}


def drains_in(f, context):
    """Whether finding f drains its hosts in `context` ('job', or one of NODE_CONTEXTS): drainable, and its check
    runs there (CHECK_RULES' contexts)."""
    return drainable(f) and context in CHECK_RULES[f["check"]]["contexts"]


if set(CHECK_RULES) != set(CHECKS):  # a new check declares itself here (docs/development.md: adding a check)
    raise ValueError(f"CHECK_RULES and CHECKS differ: {sorted(set(CHECKS) ^ set(CHECK_RULES))}")


def localises(f):
    """Whether finding f may name its hosts: its evidence singles a host out and its check declares that."""
    return f.get("blame") in CHECK_RULES.get(f["check"], {}).get("names", ())  # rule(): names are LOCALISING


def unlocalised(f, kind, localise=None, why=None):
    """f (a new dict) naming no host: evidence `kind` (a key of UNLOCALISED), its hosts kept as `involved`, the
    reason saying that no host is named, why, and what would localise it."""
    default_why, default_how = UNLOCALISED[kind]
    said = f.get("unlocalised") or {}  # a judge's own words win over the kind's defaults
    why, how = why or said.get("why") or default_why, localise or said.get("localise") or default_how
    out = dict(f, blame=kind, hosts=[], involved=sorted(set(f.get("involved") or []) | set(f.get("hosts") or [])),
               unlocalised={"why": why, "localise": how})
    if not any(w in out["reason"] for w in ("no host is named", "no host blamed", "no host is blamed")):
        out["reason"] = f"{out['reason']}; no host is named: {why}; to localise it: {how}"
    return out


def blame_gate(findings, hosts=(), nodes=0):
    """The one gate every finding passes at the verdict (pure); every sink (report, ACTION, JSON, metrics, page,
    drain, the fallback verdicts) reads the hosts of what it returns, never a finding's own. hosts: the run's
    hosts (the roll call's), nodes: the allocation's node count where known. In order:
    - a WARN or FAIL keeps its hosts only when localises(f); one naming hosts without such evidence is turned
      into unlocalised(f, ...) (its evidence kept when it is an UNLOCALISED kind, else 'undeclared');
    - a FAIL carrying `tamper` (a value on the side channel refused) names nobody, and no finding names a host
      (`forged`): the run's evidence came through that store;
    - a finding naming more than half of the run's hosts, or FAILs naming more than half of them together,
      name none (`widespread`, marked so: nothing is drained), on any evidence: "most of the job" is not a
      host's fault. A run of one host (or a call that gives neither hosts nor nodes) has no such guard.
    PASS findings are untouched. -> new findings."""
    out = [f if f["status"] == "PASS" or localises(f) or not (f["hosts"] or f.get("blame") in UNLOCALISED)
           else unlocalised(f, f.get("blame") if f.get("blame") in UNLOCALISED else "undeclared") for f in findings]
    if any(f.get("tamper") and f["status"] == "FAIL" for f in out):
        return [unlocalised(f, "forged") if f["status"] != "PASS" and f["hosts"] else f for f in out]
    return _widespread(out, hosts, nodes)


def _widespread(findings, hosts, nodes):
    """blame_gate's minority guard: the findings that would name more than half of the run's hosts, made
    `widespread` (see blame_gate)."""
    named = {h for f in findings if f["status"] != "PASS" for h in f["hosts"]}
    failed = {h for f in findings if f["status"] == "FAIL" for h in f["hosts"]}
    n = max(len(set(hosts) | named), nodes or 0)
    if n < 2 or not (hosts or nodes):  # the run's hosts not known (a unit of a judge): nothing to weigh against
        return findings
    out = []
    for f in findings:
        wide = f["hosts"] if 2 * len(f["hosts"]) > n else failed if f["status"] == "FAIL" and 2 * len(failed) > n \
            else None
        if f["status"] != "PASS" and wide:
            why = (f"it would name {len(wide)} of the run's {n} nodes, more than half: a cause that wide is a switch, "
                   "the fabric, the software image or their configuration, not those nodes")
            f = dict(unlocalised(f, "widespread", why=why), widespread=True)
        out.append(f)
    return out


def blamed_hosts(findings):
    """The hosts the gated findings blame: every FAIL's hosts (blame_gate has already taken them away where the
    run's evidence came through a store written from outside, or where they are most of the run)."""
    return sorted({h for f in findings if f["status"] == "FAIL" and localises(f) for h in f["hosts"]})


def drainable(f):
    """Whether a gated FAIL may drain its hosts: its check declares its evidence persistent (CHECK_RULES
    drain); a check that says nothing drains nothing, and a WARN made a FAIL by --strict (`strict`) never
    drains."""
    return (f["status"] == "FAIL" and bool(f["hosts"]) and localises(f) and not f.get("strict")
            and f.get("blame") in CHECK_RULES[f["check"]]["drain"])


def strict_majority(groups):
    """{value: [members]} -> the value a strict majority of all members share, or None (a tie, or no value
    held by more than half)."""
    total = sum(len(v) for v in groups.values())
    return next((value for value, members in groups.items() if 2 * len(members) > total), None)


def odd_ones(groups):
    """{value: [members]} of one class -> (the members unlike the strict majority, evidence kind): ([], None)
    when all agree; (members, 'majority') with a strict majority; (every member, 'tie') without one."""
    if len(groups) <= 1:
        return [], None
    top = strict_majority(groups)
    if top is None:
        return sorted({m for v in groups.values() for m in v}, key=str), "tie"
    return sorted({m for v, ms in groups.items() if v != top for m in ms}, key=str), "majority"


def minority_kind(bad, members):
    """The evidence kind of `bad` among `members` (both sets of hosts): 'majority' when the bad ones are a strict
    minority (each is unlike a strict majority), 'tie' at half, 'everyone' beyond."""
    bad, members = set(bad), set(members)
    if 2 * len(bad) < len(members):
        return "majority"
    return "tie" if 2 * len(bad) == len(members) else "everyone"



# ============================================================================ aiv/core/deadlines.py
# Floor 1: every bound in one table (deadlines()) and the small waits beside it, as plain numbers;
TIMEOUT_DEFAULT = 120.0   # --timeout: each phase after the roll call (NCCL init of 2 H200s takes ~5 s)
ROLLCALL_DEFAULT = 300.0  # --rollcall-timeout: start-up skew of thousands of ranks importing torch
# The roll call's last call (torchrun's rendezvous last_call_timeout, 30 s by default, is the anchor): once at
# least half the world checked in (or failed before it), the ranks never heard of get last_call_grace() past the
# latest arrival, not the whole --rollcall-timeout; a rank that said hello (its process reached the store, still
# importing torch) keeps the whole bound
LAST_CALL_FRACTION = 0.1  # of --rollcall-timeout: 30 s at the default 300 s
LAST_CALL_MIN_S = 5.0     # never less (a short --rollcall-timeout in a test)
LAST_CALL_LAUNCH_X = 2.0  # times what the launch showed: rank 0's start until half the world checked in
HELLO_RETRY_S = 0.5       # a rank's hello to the store, tried again this often until it checks in
NAMING_S = 5.0            # rank 0, once a bound passes: settle liveness, name the culprits, publish
RANK0_GRACE = 15.0        # the other ranks wait this long past their own bound before speaking for rank 0
ACKS_S = 5.0              # rank 0 keeps its store up this long for live ranks to read the verdict
ACKS_SIGNALLED_S = 1.0    # ... or this long once rank 0 itself was signalled (the others are, too: KillWait runs)
ERROR_GRACE = 2.0         # after the first error report: time for other reports and liveness to arrive
MANIFEST_LOCK_S = 10.0    # rank 0 at the verdict: the most it waits for another job's lock on a --save-manifest file
LOCK_RETRY_S = 0.2        # how often that lock is tried again (non-blocking) while another job holds it
# The small waits inside a phase, each also inside the phase's bound (the table below):
NCCL_RELAY_S = 1.0        # a rank's exit: the most it waits for another thread relaying its NCCL WARN lines
STORE_OP_S = 1.0          # one store operation off the main thread (a report after a signal, a clone, a counter)
AUDIT_S = 1.0             # rank 0 at the verdict: every value on the store checked once more (StoreProtocol.audit)
FORGED_POLL_S = 0.1       # a reader that refused a value not of this run looks again this often, within its wait
SNAPSHOT_S = 1.5          # rank 0, after a signal: one read of liveness, of the stamps and of the reports
TERM_REPORTS_S = 0.5      # rank 0, after a signal: time for the other ranks' "terminated" reports to arrive
SIGNAL_SPREAD_S = 2.0     # a rank that lost rank 0's store with no verdict read: the most it waits for a signal of
                          # its own (scancel and the time limit reach each node at its own time) before it speaks
ISSUED_S = 4.0            # rank 0, a collective phase's bound passed: the most it waits (beside the liveness settle,
                          # inside NAMING_S) for each live rank's post of the last collective it issued
NCCL_RAS_S = 3.0          # rank 0, the same moment on NCCL: NCCL's own view (its RAS STATUS), read beside it
RESOLVE_S = 5.0           # a rank's lookup of MASTER_ADDR before it connects (a name that does not resolve is said
                          # at once; a lookup slower than this is left to the store's connect)
TORCH_BACKSTOP_S = 30.0   # torch's own process-group timeout lies this far past our bound: ours fires first
IMPORT_PROBE_S = 60.0     # torchvision/torchaudio import probe: at most this, T/2 at the verdict, T/4 before the screen
MONITOR_CONNECT_S = 5.0   # a node monitor's store connect (1 s when its ranks are gone already: the run ended)
PROBE_CONNECT_S = 0.8     # a raw TCP connect that tells "no listener" from "a listener that never answers"
MARK_TTL = 30.0           # seconds a node's "said" marker silences its siblings; an older one is another run's
OUTPUT_S = 20.0           # rank 0 at the verdict: each requested file (--json, --metrics, --html) written within this
VERDICT_S = 90.0          # rank 0, from the verdict's start to its exit (report, drain, files, manifest, acks); past
                          # it rank 0 exits with the verdict's code (published on the store first) and says so
DRAIN_S = 10.0            # rank 0 at a FAIL verdict with --drain on: both scontrol calls (show, update) together
NODE_SMI_S = 15.0         # a node leader's one nvidia-smi call for all its GPUs (ECC, row remapping), started at
                          # launch: NVML's start without persistence mode takes seconds per GPU; past it "not read"
CHILD_REAP_S = 1.5        # a child killed at its bound: at most this more for it to exit and its pipes to close; then
                          # it is left behind and said (a process stuck in the kernel cannot be reaped)
LAUNCHER_SLACK_S = 30.0   # local launcher: its backstop past the worst case; then 5 s for the others after rank 0
# --node-check: one node's pass, all of it within --node-budget (NODE_BUDGET_DEFAULT, under LBNL NHC's 30 s
# watchdog; Slurm kills a HealthCheckProgram at 60 s)
NODE_BUDGET_DEFAULT = 25.0
NODE_RESERVE_S = 3.0      # of the budget, kept for the verdict: scontrol (once or twice) and the files
NODE_SMI_BOUND_S = 5.0    # each nvidia-smi call of the pass (the GPU list, the compute processes)
NODE_SLURM_BOUND_S = 4.0  # each scontrol call of the pass
NODE_KMSG_BOUND_S = 1.0   # reading the kernel log for Xid lines (and at most 8 MiB of it)
NODE_PREEMPT_S = 5.0      # a prolog waits this long for a health pass it stopped to let go of the GPUs
NODE_HELD_AGAIN_S = 1.0   # prolog, epilog: a process on the job's GPU is looked for again this much later (it counts
                          # only if still there: one tearing down at the job's boundary is gone by then)

PHASES = ("local", "rollcall", "init", "telemetry", "screen-gpu", "screen-net", "soak", "collective", "ddp",
          "bandwidth", "final")
FAN_IN = {"telemetry": "telemetry", "ddp": "results"}  # phase -> what each rank posts to rank 0 through the store
SCREEN_PHASES = ("screen-gpu", "screen-net")  # skipped with --skip-screen
ISSUE_PHASES = ("init", "screen-net", "collective", "ddp", "bandwidth")  # phases whose ranks issue collectives
PHASE_CHECK = {"local": "local", "rollcall": "rendezvous", "init": "init", "telemetry": "telemetry",
               "screen-gpu": "gpu-perf", "screen-net": "inter-node", "soak": "soak",
               "collective": "collective", "ddp": "ddp", "bandwidth": "bandwidth", "final": "verdict"}
PHASE_WHAT = {"local": "import torch and the local checks", "rollcall": "the roll call",
              "init": "init_process_group", "telemetry": "the telemetry gather and judge",
              "screen-gpu": "the GPU screen (matmul and memory copy)",
              "screen-net": "the network screen (all_reduce inside each node and between nodes) and its judgement",
              "soak": "the soak (sustained matmul on every GPU at once)",
              "collective": "all_reduce of rank-encoded integers", "ddp": "the DDP step and results gather",
              "bandwidth": "the bandwidth probe", "final": "the verdict"}


def deadlines(timeout, rollcall_timeout, soak=0.0):
    """The one table of bounds: phase -> seconds. `local` and `rollcall` get --rollcall-timeout, `soak`
    its --soak seconds + --timeout (the load itself, then what any phase does), every other
    later phase --timeout; `manifest-lock` (MANIFEST_LOCK_S, not a phase) bounds the wait for a
    --save-manifest file's lock at the verdict. Invariant (checked by a test): rank 0 names the culprits
    within a phase's bound + NAMING_S, which is below the other ranks' backstop (bound + RANK0_GRACE), so rank 0
    reports before anyone gives up on it."""
    table = {p: float(timeout) for p in PHASES}
    table["local"] = table["rollcall"] = float(rollcall_timeout)
    table["soak"] = float(timeout) + float(soak)
    table["manifest-lock"] = MANIFEST_LOCK_S  # not a phase: part of the verdict, with --save-manifest only
    table["verdict"] = VERDICT_S  # not a phase: rank 0's verdict, once a phase ended or its bound passed
    return table


def worst_case(table, bandwidth=False, screen=True, soak=False):
    """The longest a run takes to its verdict with its files written at once: every phase at its bound, then
    naming and acks. The verdict itself is not counted: it writes the files asked for (--json, --metrics,
    --html, each within OUTPUT_S) before it prints the report and publishes the code, then the drain, the
    manifest and the acknowledgements; on slow storage all of it takes up to VERDICT_S
    (rank 0 posts "deciding" as it starts: the others then wait that long for the code, not RANK0_GRACE)."""
    return sum(s for p, s in table.items() if (bandwidth or p != "bandwidth") and (soak or p != "soak")
               and (screen or p not in SCREEN_PHASES) and p != "verdict") + NAMING_S + ACKS_S


def last_call_grace(rollcall_s, launch_s):
    """Seconds the ranks never heard of get past the latest arrival once the last call began: the larger of
    LAST_CALL_FRACTION of the roll call's bound (30 s at the default) and LAST_CALL_LAUNCH_X times `launch_s`
    (how long half the world took to start, import torch and check in: a slow launch, or a slow filesystem at
    scale, gets a longer last call), at least LAST_CALL_MIN_S, never past the roll call's bound."""
    rollcall_s = float(rollcall_s)
    return min(rollcall_s, max(LAST_CALL_MIN_S, LAST_CALL_FRACTION * rollcall_s, LAST_CALL_LAUNCH_X * float(launch_s)))


class LastCall:
    """The roll call's last call as plain state (pure): seen(now, present, heard) at each look (present: ranks
    checked in or failed before it; heard: those and the ranks that said hello); due(now) once at least half the
    world is present and nothing new was heard for the grace (last_call_grace, fixed when half the world was
    present: launch_s, seconds since the launch's start, is what the launch showed)."""

    def __init__(self, world, rollcall_s, launch_t0):
        self.world, self.rollcall_s, self.t0 = int(world), float(rollcall_s), launch_t0
        self.begun = self.grace = None
        self.heard, self.last = -1, None

    def seen(self, now, present, heard):
        if heard != self.heard:
            self.heard, self.last = heard, now
        if self.begun is None and 2 * present >= self.world:
            self.begun = now
            self.grace = last_call_grace(self.rollcall_s, now - self.t0)
        return self

    def due(self, now):
        return self.begun is not None and now >= max(self.begun, self.last) + self.grace


def live_period(nodes):
    """Seconds between a node monitor's posts (and its leader's beats): two operations per node per
    period keep rank 0's store under ~1,000 operations per second up to 1,000 nodes (8,000 ranks at 8 per
    node). Capped at 2 s, so that two periods fit in the NAMING_S - 1 seconds rank 0 waits for fresh
    liveness; past 1,000 nodes that costs nodes operations per second."""
    return min(2.0, max(1.0, nodes / 500.0))



# ============================================================================ aiv/core/speak.py
# Floor 1: speaking, the effects of the floor: one line printed under a lock that outlives a reader gone
_PRINT_LOCK = threading.Lock()


def emit(line, stream=None):
    """Print a line. A reader that went away (`| head`, a closed terminal), a full disk behind it, a stream
    closed from the start (`>&-`) never stops the run: the stream's descriptor is pointed at /dev/null and the
    run goes on to its verdict and its JSON."""
    with _PRINT_LOCK:
        stream = stream or sys.stdout
        if stream is None:
            return
        try:
            stream.write(line + "\n")
            stream.flush()
        except (OSError, ValueError):  # ValueError: the stream was closed; EPIPE, EIO, ENOSPC ...
            drop_stream(stream)


def guard_std_streams():
    """Descriptors 0, 1 and 2 closed at the start (`>&-`, a daemon's children) are opened on /dev/null, so that
    no file or pipe the tool opens takes their numbers, and sys.stdout/stderr exist: the run's lines go
    nowhere, its verdict, files and exit code are what they would be."""
    for fd, name, mode in ((0, "stdin", os.O_RDONLY), (1, "stdout", os.O_WRONLY), (2, "stderr", os.O_WRONLY)):
        try:
            os.fstat(fd)
        except OSError:
            try:
                null = os.open(os.devnull, mode)
                if null != fd:
                    os.dup2(null, fd)
                    os.close(null)
            except OSError:
                continue
        if getattr(sys, name) is None:
            with contextlib.suppress(OSError, ValueError):
                setattr(sys, name, open(fd, "r" if fd == 0 else "w", closefd=False))


def drop_stream(stream):
    """Point a dead stream's descriptor at /dev/null: later writes and the flush at exit are silent."""
    with contextlib.suppress(OSError, ValueError):
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, stream.fileno())
        os.close(null)


def flush_all():
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            drop_stream(stream)


class Findings:
    """The run's findings, one owner. The phases add to it (+=, append) and read it (iteration, code()),
    every call under one lock; the verdict, given by whichever thread concludes first (the main thread,
    the watchdog, the signal thread), takes it whole once (close) and works on its own list from then
    on. A finding added after that is not part of the verdict: it goes to stderr, never lost silently."""

    def __init__(self, items=()):
        self._lock = threading.Lock()
        self._items, self._closed = list(items), False

    def __iadd__(self, items):
        items = list(items)
        with self._lock:
            if not self._closed:
                self._items.extend(items)
                return self
        for f in items:
            emit(f"NOTE: a finding came after the verdict and is not part of it: {f['check']}: {f['reason']}",
                 sys.stderr)
        return self

    def append(self, f):
        self += [f]

    def snapshot(self):
        with self._lock:
            return list(self._items)

    def close(self):
        """The findings as they stand, for the verdict; nothing joins them afterwards."""
        with self._lock:
            self._closed = True
            return list(self._items)

    def code(self):
        return verdict_code(self.snapshot())

    def __iter__(self):
        return iter(self.snapshot())

    def __len__(self):
        with self._lock:
            return len(self._items)



# ============================================================================ aiv/core/bounds.py
# Floor 1: the bounds that enforce the table of aiv/core/deadlines.py: Bound (one phase's bound, the
class BoundPassed(TimeoutError):
    """A call run under a bound (within) did not return in time."""


def within(fn, seconds, what="the call"):
    """fn() on a thread of its own, at most `seconds`: its result, or its own exception raised again here,
    or BoundPassed. The thread is left behind when the bound passes (daemon: the process exits on its
    verdict). For a call that can block without a timeout of its own: a file on shared storage, a
    store operation off the main thread."""
    box, done = {}, threading.Event()

    def call():
        try:
            box["value"] = fn()
        except BaseException as e:
            box["error"] = e
        finally:
            done.set()
    threading.Thread(target=call, name="aiv-within", daemon=True).start()
    if not done.wait(max(0.0, seconds)):
        raise BoundPassed(f"{what} did not return within {seconds:g}s")
    if "error" in box:
        raise box["error"]
    return box.get("value")


def bounded(fn, seconds, default=None):
    """within(fn, seconds), or `default` when it raises or takes longer: for a best-effort read whose
    absence the caller names itself (a snapshot at a signal, an audit, a count)."""
    try:
        return within(fn, seconds)
    except Exception:
        return default


class Bound:
    """One phase's bound: the only thing that arms the watchdog. Made by RankRun.deadline for each
    phase: `seconds` is the table's value for the phase (what every message quotes), `grace` what the
    role adds before the watchdog speaks (rank 0: NAMING_S at the roll call; the other ranks:
    RANK0_GRACE, so that rank 0 names the culprit first). Every wait inside the phase takes left().
    A rank other than 0 counts its bound from rank 0's gate (restart), however late rank 0 got there.
    Each bound is a timer of its own on the watchdog (its token): arming or disarming one never touches
    another (the verdict's bound, armed while a phase's is still armed, holds whatever the phase does)."""

    def __init__(self, watchdog, phase, seconds, grace=0.0):
        self.wd, self.phase, self.seconds, self.grace = watchdog, phase, float(seconds), float(grace)
        self.start = time.monotonic()
        self.armed, self.token = False, None

    def left(self, extra=0.0):
        """Seconds left of the phase's own bound (+ extra), never negative."""
        return max(0.0, self.start + self.seconds + extra - time.monotonic())

    def cause(self):
        """The words for a phase that did not finish within its bound."""
        return f"{PHASE_WHAT.get(self.phase, self.phase)} did not complete within {self.seconds:g}s"

    def arm(self):
        self.armed = True
        self.token = self.wd.arm(self.phase, self.left(self.grace), self.token)
        return self

    def restart(self):
        """Count the bound from now (a gate rank 0 opened, the store's first answer), still armed."""
        self.start = time.monotonic()
        if self.armed:
            self.arm()

    def disarm(self):
        if self.armed:
            self.armed = False
            self.wd.disarm(self.token)

    def __enter__(self):
        return self.arm()

    def __exit__(self, *exc):
        self.disarm()
        return False


class Watchdog:
    """Every armed bound from a thread of its own: a heap of deadlines, one timer per bound (arm returns its
    token). A bound that passes calls expire(name) once, on a thread of its own (expire usually ends the
    process with os._exit, which works while the main thread is blocked in a collective: a signal handler
    would run only after the collective returned). While a phase's bound is armed (the newest bound that is
    not the verdict's), tick(phase) runs every `period` seconds on this thread; a tick that raises is switched
    off and said (on_error)."""

    def __init__(self, expire, tick=None, period=1.0, on_error=None):
        self.expire, self.tick, self.period, self.on_error = expire, tick, period, on_error
        self._cv = threading.Condition()
        self._heap, self._live, self._tokens = [], {}, itertools.count(1)  # live: token -> (name, deadline)
        threading.Thread(target=self._loop, name="aiv-watchdog", daemon=True).start()

    def arm(self, name, seconds, token=None):
        """Arm (or, with the token of an armed bound, re-arm) a bound of `seconds` from now. -> its token."""
        with self._cv:
            token = token or next(self._tokens)
            due = time.monotonic() + max(0.0, seconds)
            self._live[token] = (name, due)
            heapq.heappush(self._heap, (due, token))
            self._cv.notify()
            return token

    def disarm(self, token=None):
        """Disarm one bound (its token); without a token, every bound."""
        with self._cv:
            if token is None:
                self._live.clear()
            else:
                self._live.pop(token, None)
            self._cv.notify()

    def armed(self):
        """The names of the bounds armed now, oldest first."""
        with self._cv:
            return [name for _, (name, _) in sorted(self._live.items())]

    def _next(self):
        """(the earliest live (deadline, token) or None, the phase to tick or None), under the lock."""
        while self._heap and self._live.get(self._heap[0][1], (None, None))[1] != self._heap[0][0]:
            heapq.heappop(self._heap)  # disarmed, or re-armed with another deadline
        phases = [name for _, (name, _) in sorted(self._live.items()) if name != "verdict"]
        return (self._heap[0] if self._heap else None), (phases[-1] if phases else None)

    def _loop(self):
        next_tick = time.monotonic() + self.period
        while True:
            with self._cv:
                head, phase = self._next()
                while head is None:
                    self._cv.wait()
                    head, phase = self._next()
                    next_tick = time.monotonic() + self.period
                now = time.monotonic()
                ticking = phase is not None and self.tick is not None
                if head[0] > now and (not ticking or next_tick > now):
                    self._cv.wait(max(0.0, (min(head[0], next_tick) if ticking else head[0]) - now))
                    continue  # something may have been armed or disarmed meanwhile: look again
                fire = None
                if head[0] <= now:  # once per arming
                    heapq.heappop(self._heap)
                    fire = self._live.pop(head[1])[0]
            if fire is not None:  # on a thread of its own: a bound armed while expire runs (the verdict's) still holds
                threading.Thread(target=self.expire, args=(fire,), name="aiv-expire", daemon=True).start()
                continue
            next_tick = time.monotonic() + self.period
            if self.tick is not None and phase is not None:
                try:
                    self.tick(phase)
                except Exception as e:  # the bound still holds; the tick is off, and the report says so
                    self.tick = None
                    if self.on_error is not None:
                        self.on_error("the watchdog's liveness tick", e)



# ============================================================================ aiv/core/files.py
# Floor 1: files the tool writes (JSON, page, metrics, manifest): atomic replace, cross-job locks, the node
class LockTimeout(Exception):
    """The manifest's lock file stayed held by another job for the whole MANIFEST_LOCK_S."""


@contextlib.contextmanager
def _file_lock(path, budget=None):
    """Serialise read-merge-write of one manifest across jobs with a `.NAME.lock` file beside it. The lock is
    tried without blocking (LOCK_NB) every LOCK_RETRY_S until budget seconds (MANIFEST_LOCK_S) have passed,
    then LockTimeout: a hung holder or a stuck lock on shared storage never hangs the verdict. A directory
    where no lock file can be created (or a file system without flock) is not locked (best effort)."""
    budget = MANIFEST_LOCK_S if budget is None else budget
    try:
        fd = os.open(os.path.join(os.path.dirname(os.path.abspath(path)), f".{os.path.basename(path)}.lock"),
                     os.O_CREAT | os.O_RDWR, _new_file_mode(path))
    except OSError:
        fd = None
    try:
        until = time.monotonic() + budget
        while fd is not None:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= until:
                    raise LockTimeout(f"another job held its lock file for {budget:g}s") from None
                time.sleep(min(LOCK_RETRY_S, max(0.0, until - time.monotonic())))
            except OSError:
                break  # flock unsupported here: unlocked, as before
        yield
    finally:
        if fd is not None:
            os.close(fd)


def _new_file_mode(path):
    """The mode a file at path gets: an existing file's own mode, else 0666 & ~umask (0644 under 022), as
    open(2) would give it, so that a teammate can read a verdict JSON or manifest the umask lets them."""
    try:
        return os.stat(path).st_mode & 0o7777
    except OSError:
        mask = os.umask(0)
        os.umask(mask)
        return 0o666 & ~mask


def write_text_atomic(path, text, suffix=".tmp", first=False):
    """Write text to path atomically: a temporary file beside it whose name never ends like the target (a
    textfile collector reading *.prom never reads half a file), with the mode _new_file_mode gives (mkstemp's
    own 0600 would hide the file from everyone else), then a rename. first: only when no file is there yet
    (the first writer wins, atomically: a hard link that fails when the path exists), for the ranks and the
    batch file that write a verdict when rank 0 left none. -> whether it was written."""
    if not first and _is_stream(path):  # a FIFO or a device (/dev/stdout, a collector's pipe): written into
        with open(path, "w") as f:
            f.write(text)
        return True
    fd, tmp = tempfile.mkstemp(prefix=".aiv-", suffix=suffix, dir=os.path.dirname(os.path.abspath(path)))
    try:
        os.fchmod(fd, _new_file_mode(path))
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        if not first:
            os.replace(tmp, path)
            return True
        try:
            os.link(tmp, path)
            return True
        except FileExistsError:
            return False
        finally:
            os.unlink(tmp)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _is_stream(path):
    try:
        m = os.stat(path).st_mode
    except OSError:
        return False
    return stat.S_ISFIFO(m) or stat.S_ISCHR(m)


def write_json_atomic(path, data, first=False):
    """data as JSON, through write_text_atomic."""
    return write_text_atomic(path, json.dumps(data, indent=1, sort_keys=True, default=str) + "\n", ".json", first)


# ---------------------------------------------------------------------------------------------- the node's lock
def node_lock_dirs(uid=None):
    """Where the node's lock may live (--node-lock-dir unset): root's own directories under /run (never a job's
    TMPDIR, which a job sets and a job-container plugin may mount per job), else this user's own."""
    uid = os.geteuid() if uid is None else uid
    return ("/run/aiv", "/var/lock/aiv") if uid == 0 else (f"/run/user/{uid}/aiv", f"/tmp/aiv-node-check-{uid}")


def node_lock_path(node, chosen=None):
    """-> (the lock file of this node's checks, None), or (None, why not): in `chosen` (--node-lock-dir) or the
    first of node_lock_dirs, a directory (made where missing) owned by this user and writable by no one else,
    so that no other user's file can stand in for the lock (fs.protected_regular refuses to open those)."""
    uid, whys = os.geteuid(), []
    for d in [chosen] if chosen else node_lock_dirs(uid):
        try:
            os.makedirs(d, 0o755 if uid == 0 else 0o700, exist_ok=True)
            st = os.lstat(d)
        except OSError as e:
            whys.append(f"{d}: {e.strerror}")
            continue
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != uid or st.st_mode & 0o022:
            whys.append(f"{d}: not a directory that only uid {uid} may write")
            continue
        return os.path.join(d, "aiv-node-check-" + re.sub(r"[^A-Za-z0-9._-]", "_", node) + ".lock"), None
    return None, "; ".join(whys)


# ---------------------------------------------------------------------------------------------- child processes
def stat_fields(pid, root="/"):
    """The fields of /proc/<pid>/stat after the command's name (the state letter first), [] when there is no such
    process."""
    text = read_text(os.path.join(root, f"proc/{pid}/stat"))
    return text.rsplit(")", 1)[1].split() if text and ")" in text else []


def proc_state(pid):
    """A process's state letter from /proc/PID/stat ('D': uninterruptible, in the kernel), None when gone."""
    return next(iter(stat_fields(pid)), None)


def child_finish(proc, seconds, name=None):
    """The output of a child started with stdout (and stderr) piped, within `seconds` -> {'rc', 'out', 'err'}, or
    {'unread': why, 'rc', 'stuck'} (with 'out' and 'err', what it said before the bound, when it was reaped).
    Past the bound its process group (or the child alone, when it shares ours) gets SIGKILL, and the reap is
    bounded too: at most CHILD_REAP_S more for it to exit and its pipes to close (a grandchild of another
    session may hold them), then it is left behind, said with its state ('D': stuck in the kernel, a driver
    call) and never waited for again."""
    name = name or os.path.basename(str(proc.args[0] if isinstance(proc.args, (list, tuple)) else proc.args))
    with contextlib.suppress(subprocess.TimeoutExpired):
        out, err = proc.communicate(timeout=max(0.01, seconds))
        return {"rc": proc.returncode, "out": _text(out), "err": _text(err)}
    _kill_group(proc)
    with contextlib.suppress(subprocess.TimeoutExpired):
        out, err = proc.communicate(timeout=CHILD_REAP_S)  # what it said before the bound is kept
        return {"unread": f"{name} gave no answer within {seconds:g}s", "rc": proc.returncode, "stuck": None,
                "out": _text(out), "err": _text(err)}
    state = proc_state(proc.pid) if proc.poll() is None else None
    for s in filter(None, (proc.stdin, proc.stdout, proc.stderr)):
        with contextlib.suppress(OSError, ValueError):
            s.close()
    how = (f"stuck, not reaped (state {state}{': in the kernel, a driver call' if state == 'D' else ''})"
           if state else "ended, but a process it started still holds its output open")
    return {"unread": f"{name} gave no answer within {seconds:g}s and was killed: {how}", "rc": proc.returncode,
            "stuck": state or "pipe"}


def _kill_group(proc):
    try:
        own = os.getpgid(proc.pid) == proc.pid
    except OSError:
        return
    with contextlib.suppress(OSError):
        if own:
            os.killpg(proc.pid, signal.SIGKILL)
        else:
            proc.kill()


def _text(b):
    return b.decode(errors="replace") if isinstance(b, bytes) else (b or "")


def child_start(argv, **kw):
    """argv in a session (process group) of its own, stdin from /dev/null, stdout and stderr piped, as text;
    OSError when it cannot start."""
    kw = dict({"stdin": subprocess.DEVNULL, "stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True,
               "errors": "replace", "start_new_session": True}, **kw)
    return subprocess.Popen(argv, **kw)


def run_bounded(argv, seconds, box=None, name=None):
    """argv within `seconds` (child_start, child_finish) -> {'rc', 'out', 'err'}, or {'unread': why} when it could
    not start or did not answer in time. box: where the child is kept (box['proc']) for whoever stops waiting for
    it earlier."""
    name = name or os.path.basename(argv[0])
    try:
        p = child_start(argv)
    except OSError as e:
        return {"unread": f"{name} could not run: {e.strerror or e}"}
    if box is not None:
        box["proc"] = p
    return child_finish(p, seconds, name)



# ============================================================================ aiv/launch/contract.py
# Floor 2: the launch contract: RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT, the Slurm and
OWN_VARS = ("RANK", "LOCAL_RANK", "SLURM_PROCID", "SLURM_LOCALID")  # differ per rank: rank 0 cannot see them


def _int_var(env, name, lo=None, hi=None):
    raw, own = env.get(name), name in OWN_VARS
    if raw is None or raw.strip() == "":
        raise UsageError(f"{name} is empty", own)
    try:
        val = int(raw.strip())
    except ValueError:
        raise UsageError(f"{name}={raw!r} is not an integer", own) from None
    if lo is not None and val < lo:
        raise UsageError(f"{name}={val} is below {lo}", own)
    if hi is not None and val > hi:
        raise UsageError(f"{name}={val} is above {hi}", own)
    return val


def _pick(env, *names):
    return next((n for n in names if n in env), None)


def derive_port(job_id):
    """Port used when Slurm gives no MASTER_PORT: deterministic per job, in 49152-65535."""
    return 49152 + job_id % 16384


def in_batch_shell(env):
    """True in an sbatch/salloc shell: a job exists but no srun step started this process."""
    return ("SLURM_JOB_ID" in env and "RANK" not in env
            and "SLURM_STEP_ID" not in env and "SLURM_STEPID" not in env)


def this_machine(addr):
    """Whether a MASTER_ADDR names this machine: a loopback address, localhost, or this host's own name."""
    a = addr.strip().strip("[]").lower()
    host = socket.gethostname().lower()
    return a in ("localhost", "::1", host, host.split(".")[0]) or a.startswith("127.")


REPLICA_POD = re.compile(r"(.+)-(master|worker)-(\d+)")  # PyTorchJob's, MPIJob's and Volcano's pod names


def pod_of_several(env, host=None):
    """Why this process, with no launch variables, is one pod of a multi-pod job, or None: inside a pod
    (KUBERNETES_SERVICE_HOST) whose name is a replica's, <job>-master-N or <job>-worker-N (a PyTorchJob v1
    init container, a pod whose launcher writes its variables into other containers). Alone it would test
    its own node and PASS with nothing between the nodes tested."""
    if not env.get("KUBERNETES_SERVICE_HOST"):
        return None
    host = (host or socket.gethostname()).split(".")[0]
    m = REPLICA_POD.fullmatch(host)
    return f"this pod, {host}, is a {m.group(2)} replica of a multi-pod job ({m.group(1)})" if m else None


def _no_rank(env):
    """No RANK (nor SLURM_PROCID): local mode, unless the environment is half a launch contract: a size or
    local rank without a rank, an MPI launcher's variables, or a master that is another machine (a multi-node
    hint, never replaced by 127.0.0.1)."""
    if in_batch_shell(env):
        raise UsageError("running in the Slurm batch shell, not as an srun task: launch it with "
                         "srun (one task per GPU), e.g. srun python ddp_mesh_ping.py")
    partial = [f"{v}={env[v]!r}" for v in ("WORLD_SIZE", "LOCAL_RANK", *MPI_SIZE_VARS, *MPI_LOCAL_VARS) if v in env]
    if partial:
        raise UsageError(" and ".join(partial) + (" are" if len(partial) > 1 else " is") + " set but RANK is not: a "
                         "rank needs RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT; unset them all to "
                         "run in local mode", own=True)
    for var in ("MASTER_ADDR", "PET_MASTER_ADDR"):
        if env.get(var) is not None and not this_machine(env[var]):
            raise UsageError(f"{var}={env[var]!r} is set but RANK is not: a master on another machine is half a "
                             "multi-node launch; give each process RANK, WORLD_SIZE, LOCAL_RANK and MASTER_PORT, or, "
                             "one process per node, PET_NNODES and PET_NODE_RANK (this tool then starts the node's "
                             f"ranks); unset {var} to run in local mode on this machine")
    several = pod_of_several(env)
    if several:
        raise UsageError(f"{several}, but no launch variables reach this container (a PyTorchJob v1 init "
                         "container gets none of the operator's): alone it would test this node only. Run it as "
                         "the main container, or give it PET_NNODES, PET_NODE_RANK, MASTER_ADDR and MASTER_PORT; "
                         "to test this node alone on purpose, PET_NNODES=1 PET_NODE_RANK=0 MASTER_ADDR=127.0.0.1")


# An MPI launcher's rank variables (Open MPI, PMIx, MPICH/Hydra and Intel MPI), read after torchrun's and
# Slurm's names: under srun --mpi=pmix Slurm's own come first.
MPI_RANK_VARS = ("OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK")
MPI_SIZE_VARS = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE")
MPI_LOCAL_VARS = ("OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "PMI_LOCAL_RANK")


def _rank_names(env):
    """The variables that give rank, world size and local rank (torchrun's names, then Slurm's, then an
    MPI launcher's). A launch that gives only part of them is one line naming what is missing."""
    names = {"RANK": _pick(env, "RANK", "SLURM_PROCID", *MPI_RANK_VARS),
             "WORLD_SIZE": _pick(env, "WORLD_SIZE", "SLURM_NTASKS", "SLURM_STEP_NUM_TASKS", *MPI_SIZE_VARS),
             "LOCAL_RANK": _pick(env, "LOCAL_RANK", "SLURM_LOCALID", *MPI_LOCAL_VARS)}
    mpi = names["RANK"] in MPI_RANK_VARS
    for wanted, var in names.items():
        if var is None:
            raise UsageError(f"{wanted} is not set (nor its Slurm or MPI fallback)" + (
                f": the MPI launcher set {names['RANK']} but not {wanted}; export {wanted} for each rank "
                "(mpirun -x) or launch with srun or torchrun" if mpi else
                ": set LOCAL_RANK for each process (its index on its node); for one process per node or pod, set "
                "PET_NNODES and PET_NODE_RANK instead of RANK and this tool starts the node's ranks"
                if wanted == "LOCAL_RANK" else ""), own=wanted != "WORLD_SIZE")
    return names


def check_host(var, addr):
    """A master's host name or address as given in `var`, stripped (and its [] of IPv6); UsageError if it is none."""
    addr = addr.strip()
    if not addr or not re.fullmatch(r"[A-Za-z0-9_.:%\-\[\]]{1,253}", addr):
        raise UsageError(f"{var}={addr!r} is not a host name or address")
    return addr.strip("[]")


def _master(env):
    """(address, port, the variable the port came from)."""
    addr_var, addr = "MASTER_ADDR", env.get("MASTER_ADDR")
    if addr is None and env.get("SLURM_JOB_NODELIST"):
        addr_var = "SLURM_JOB_NODELIST"
        try:
            addr = expand_hostlist(env["SLURM_JOB_NODELIST"])[0]
        except ValueError as e:
            raise UsageError(f"SLURM_JOB_NODELIST={env['SLURM_JOB_NODELIST']!r}: {e}") from None
    if addr is None:
        raise UsageError("MASTER_ADDR is not set (nor SLURM_JOB_NODELIST)")
    addr = check_host(addr_var, addr)
    if "MASTER_PORT" in env:
        return addr, _int_var(env, "MASTER_PORT", lo=1, hi=65535), "MASTER_PORT"
    if "SLURM_JOB_ID" in env:
        return addr, derive_port(_int_var(env, "SLURM_JOB_ID", lo=0)), "SLURM_JOB_ID"
    raise UsageError("MASTER_PORT is not set (nor SLURM_JOB_ID to derive one)")


def read_contract(env):
    """The launch contract as a dict, or None for local mode. Raises UsageError (own=True when the
    mistake is in this rank's own values)."""
    if _pick(env, "RANK", "SLURM_PROCID", *MPI_RANK_VARS) is None:
        _no_rank(env)
        return None
    if in_batch_shell(env):
        raise UsageError("SLURM_PROCID is set but no srun step started this process (batch shell): "
                         "launch it with srun (one task per GPU), e.g. srun python ddp_mesh_ping.py")
    names = _rank_names(env)
    world = _int_var(env, names["WORLD_SIZE"], lo=1, hi=1_000_000)
    rank = _int_var(env, names["RANK"], lo=0)
    if rank >= world:
        raise UsageError(f"{names['RANK']}={rank} is not below {names['WORLD_SIZE']}={world}", own=True)
    local_rank = _int_var(env, names["LOCAL_RANK"], lo=0, hi=1023)
    if local_rank > rank:
        raise UsageError(f"{names['LOCAL_RANK']}={local_rank} is larger than {names['RANK']}={rank}", own=True)
    try:
        addr, port, port_src = _master(env)
    except UsageError as e:
        if names["RANK"] in MPI_RANK_VARS:  # mpirun sets no rendezvous of its own
            raise UsageError(f"{e}: under an MPI launcher ({names['RANK']} is set) export MASTER_ADDR (the host of "
                             "rank 0) and MASTER_PORT to every rank, e.g. mpirun -x MASTER_ADDR=node1 -x "
                             "MASTER_PORT=29500") from None
        raise
    source = "slurm" if names["RANK"] == "SLURM_PROCID" else "mpi" if names["RANK"] in MPI_RANK_VARS else "env"
    return {"rank": rank, "world_size": world, "local_rank": local_rank,
            "master_addr": addr, "master_port": port, "port_source": port_src, "source": source,
            "vars": [names["RANK"], names["WORLD_SIZE"], names["LOCAL_RANK"]]}


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
    return dict(enumerate(h for h, c in zip(hosts, counts, strict=True) for _ in range(c)))


def slurm_expectations(env):
    """Default expected shape from what Slurm launched (the srun step first, then the job); absent keys mean no
    expectation, and an uneven layout (e.g. 2,1) sets no ranks-per-node."""
    out = {}
    for key, names in (("world_size", ("SLURM_STEP_NUM_TASKS", "SLURM_NTASKS")),
                       ("nodes", ("SLURM_STEP_NUM_NODES", "SLURM_JOB_NUM_NODES"))):
        for var in names:
            with contextlib.suppress(ValueError):
                if env.get(var):
                    out[key] = int(env[var])
                    break
    layout = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE")
    if layout:
        with contextlib.suppress(ValueError):
            counts = set(parse_tasks_per_node(layout))
            if len(counts) == 1:
                out["ranks_per_node"] = counts.pop()
            return out
    with contextlib.suppress(ValueError):
        if env.get("SLURM_NTASKS_PER_NODE"):
            out["ranks_per_node"] = int(env["SLURM_NTASKS_PER_NODE"])
    return out


def under_torchrun(env):
    return "TORCHELASTIC_RUN_ID" in env


def launcher_store(env):
    """(key prefix, serve) of the side channel. torch's rule (_create_c10d_store): with
    TORCHELASTIC_USE_AGENT_STORE=True every rank, rank 0 included, is a client of the agent's store at
    MASTER_ADDR:MASTER_PORT; otherwise rank 0 serves it. The agent's store outlives worker restarts,
    so the keys carry the run id and the restart count."""
    if not under_torchrun(env):
        return "aiv", True
    prefix = f"aiv/{env['TORCHELASTIC_RUN_ID']}/{env.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    return prefix, env.get("TORCHELASTIC_USE_AGENT_STORE", "").strip().lower() != "true"


def launcher_expectations(env):
    """The expected shape from the launcher: torchrun's WORLD_SIZE / LOCAL_WORLD_SIZE / GROUP_WORLD_SIZE
    (under `srun torchrun`, Slurm's task counts are agents, not ranks), else what Slurm launched."""
    if not under_torchrun(env):
        return slurm_expectations(env)
    out = {}
    for key, var in (("world_size", "WORLD_SIZE"), ("ranks_per_node", "LOCAL_WORLD_SIZE"),
                     ("nodes", "GROUP_WORLD_SIZE")):
        with contextlib.suppress(KeyError, ValueError):
            out[key] = int(env[var])
    return out


SECRET_VAR, SECRET_MIN = "AIV_JOB_SECRET", 32  # the job's secret: the batch file and local mode make 64 hex digits


def job_secret(env):
    """The job's secret (bytes), None when unset; UsageError when it is too weak to authenticate. The
    value is never echoed: not here, not in the report, the JSON or the manifest."""
    raw = env.get(SECRET_VAR)
    if raw is None:
        return None
    if len(raw.strip()) < SECRET_MIN:
        raise UsageError(f"{SECRET_VAR} is set but holds {len(raw.strip())} character(s), fewer than {SECRET_MIN}: too "
                         "weak to authenticate the side channel; unset it, or export a fresh one: export "
                         f"{SECRET_VAR}=$(python3 -c 'import secrets; print(secrets.token_hex(32))')")
    return raw.strip().encode()



# ============================================================================ aiv/launch/launchers.py
# Floor 2: the one table of launch contracts (LAUNCHERS): what each launcher gives a process, and how the
TORCHRUN_PORT = 29500   # torchrun's default --master-port: the port where a launcher names a master but no port
LAUNCH_VAR = "_AIV_LAUNCH"  # set by this tool's own launcher on its ranks: which contract it read, in words


class Launcher(NamedTuple):
    key: str
    name: str
    recognised: str   # the variables that select this row
    gives: str        # what the launcher sets in the process's environment
    nodes: str        # where the node count comes from
    node: str         # where this node's index comes from
    ranks: str        # ranks per node, and who starts them
    rendezvous: str   # MASTER_ADDR:MASTER_PORT, from where
    per_node: bool    # True: one process per node or pod, and this tool starts that node's ranks


_ONE_PER_GPU = "one per GPU, 2 CPU ranks without one; `PET_NPROC_PER_NODE` or `--nproc` to choose"
LAUNCHERS = (
    Launcher("slurm", "Slurm srun", "`SLURM_PROCID` in an srun step",
             "`SLURM_PROCID`, `SLURM_NTASKS`, `SLURM_LOCALID`, `SLURM_JOB_NODELIST`, `SLURM_JOB_ID`, "
             "`SLURM_STEP_NUM_NODES`, `SLURM_STEP_TASKS_PER_NODE`",
             "`SLURM_STEP_NUM_NODES` (the expectation)", "its host in `SLURM_JOB_NODELIST`",
             "srun's tasks, one per GPU (`SLURM_LOCALID`)",
             "first host of `SLURM_JOB_NODELIST`, port from `SLURM_JOB_ID` (or `MASTER_ADDR`, `MASTER_PORT`)", False),
    Launcher("torchrun", "torchrun", "`TORCHELASTIC_RUN_ID`",
             "`RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `LOCAL_WORLD_SIZE`, `GROUP_RANK`, `GROUP_WORLD_SIZE`, "
             "`MASTER_ADDR`, `MASTER_PORT`, `TORCHELASTIC_RUN_ID`",
             "`GROUP_WORLD_SIZE` (the expectation)", "`GROUP_RANK`", "torchrun's workers (`LOCAL_WORLD_SIZE`)",
             "`MASTER_ADDR`:`MASTER_PORT`, the agent's store", False),
    Launcher("mpi", "mpirun", "`OMPI_COMM_WORLD_RANK`, `PMIX_RANK` or `PMI_RANK`",
             "`OMPI_COMM_WORLD_RANK`, `OMPI_COMM_WORLD_SIZE`, `OMPI_COMM_WORLD_LOCAL_RANK` (Open MPI), `PMIX_RANK` "
             "(PMIx), `PMI_RANK`, `PMI_SIZE`, `MPI_LOCALRANKID` (MPICH, Intel MPI); no rendezvous",
             "the ranks' hosts", "the rank's host", "mpirun's processes (`OMPI_COMM_WORLD_LOCAL_RANK`)",
             "`MASTER_ADDR`, `MASTER_PORT` exported to every rank (`mpirun -x`)", False),
    Launcher("trainer-v2", "Kubeflow Trainer v2", "`PET_NODE_RANK` or `PET_NNODES`, no `RANK`",
             "`PET_NNODES`, `PET_NPROC_PER_NODE` (a number, or `auto` where the pod has GPUs), `PET_NODE_RANK` (the "
             "pod's completion index), `PET_MASTER_ADDR` (`<trainjob>-node-0-0.<trainjob>`), `PET_MASTER_PORT` "
             "(29500); an init container gets them through `envInjection`",
             "`PET_NNODES`", "`PET_NODE_RANK`", _ONE_PER_GPU, "`PET_MASTER_ADDR`:`PET_MASTER_PORT`", True),
    Launcher("pytorchjob", "PyTorchJob v1", "`RANK` and `WORLD_SIZE` without `LOCAL_RANK`",
             "`MASTER_ADDR` (`<job>-master-0`), `MASTER_PORT` (23456), `WORLD_SIZE` (pods x `nprocPerNode`; pods "
             "where it is `auto`), `RANK` (the pod's index: master 0, worker i+1); since 1.7 also `PET_NNODES`, "
             "`PET_NODE_RANK`, `PET_NPROC_PER_NODE` (`auto` by default), `PET_MASTER_ADDR`, `PET_MASTER_PORT`",
             "`PET_NNODES`, else `WORLD_SIZE`", "`RANK` (the pod's index)",
             _ONE_PER_GPU + " (a pod of several GPUs without either: exit 2)", "`MASTER_ADDR`:`MASTER_PORT`", True),
    Launcher("indexed-job", "Indexed Job", "`JOB_COMPLETION_INDEX`",
             "`JOB_COMPLETION_INDEX` (the hostname is `<job>-<index>`); the manifest sets `PET_NNODES`, "
             "`MASTER_ADDR` (pod 0 through a headless Service), `MASTER_PORT`",
             "`PET_NNODES`", "`JOB_COMPLETION_INDEX`", _ONE_PER_GPU,
             "`MASTER_ADDR`:`MASTER_PORT` (29500 when unset)", True),
    Launcher("jobset", "JobSet", "`JOB_COMPLETION_INDEX` and `JOBSET_NAME`",
             "no variable of its own: its Jobs are Indexed (`JOB_COMPLETION_INDEX`), its labels "
             "(`jobset.sigs.k8s.io/jobset-name`, `job-index`, `job-global-index`, `replicatedjob-name`) reach the "
             "environment through the downward API; the manifest sets `JOBSET_NAME`, `PET_NNODES`, `MASTER_ADDR` "
             "(`<jobset>-<job>-0-0.<jobset>`), `MASTER_PORT`",
             "`PET_NNODES`", "`JOB_COMPLETION_INDEX` (one Job of N pods)", _ONE_PER_GPU,
             "`MASTER_ADDR`:`MASTER_PORT` (29500 when unset)", True),
    Launcher("lws", "LeaderWorkerSet", "`LWS_GROUP_SIZE`, `LWS_WORKER_INDEX` or `LWS_LEADER_ADDRESS`",
             "`LWS_LEADER_ADDRESS` (`<lws>-<group>.<subdomain>.<namespace>`), `LWS_GROUP_SIZE` (leader and "
             "workers), `LWS_WORKER_INDEX` (0 on the leader)",
             "`LWS_GROUP_SIZE`", "`LWS_WORKER_INDEX`", _ONE_PER_GPU,
             "`LWS_LEADER_ADDRESS`:`MASTER_PORT` (29500 when unset)", True),
    Launcher("volcano", "Volcano", "`VC_TASK_INDEX`, `VC_<TASK>_HOSTS` or `VC_<TASK>_NUM`",
             "env plugin: `VC_TASK_INDEX` (the pod's index in its task); svc plugin: `VC_<TASK>_HOSTS`, "
             "`VC_<TASK>_NUM`; pytorch plugin (main containers only): `MASTER_ADDR`, `MASTER_PORT` (23456), "
             "`WORLD_SIZE` (pods), `RANK` (master 0, worker i+1)",
             "`WORLD_SIZE` (pytorch plugin), else `VC_<TASK>_NUM` (svc plugin, a job of one task)",
             "`RANK` (pytorch plugin), else `VC_TASK_INDEX`", _ONE_PER_GPU,
             "`MASTER_ADDR`:`MASTER_PORT` (pytorch plugin), else the first of `VC_<TASK>_HOSTS`:29500", True),
    Launcher("env", "any launcher", "`RANK` and `LOCAL_RANK`",
             "`RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `MASTER_ADDR`, `MASTER_PORT`",
             "the ranks' hosts", "the rank's host", "the launcher's processes (`LOCAL_RANK`)",
             "`MASTER_ADDR`:`MASTER_PORT`", False),
    Launcher("local", "local mode", "none of the above",
             "nothing", "1", "0", "one per GPU, 2 CPU ranks without one (`--nproc`)",
             "127.0.0.1 (or a `MASTER_ADDR` of this machine), a free port (or `MASTER_PORT`)", True),
)
BY_KEY = {launcher.key: launcher for launcher in LAUNCHERS}
GENERIC_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")  # any launcher's
LWS_VARS = ("LWS_GROUP_SIZE", "LWS_WORKER_INDEX", "LWS_LEADER_ADDRESS")


def node_name(env):
    """The name this process's node goes by in the report, the JSON and `exclude`: Slurm's node name, the
    Kubernetes node a pod runs on (NODE_NAME from the downward API's spec.nodeName, read only inside a
    pod), else the host name."""
    if env.get("SLURMD_NODENAME"):
        return env["SLURMD_NODENAME"]
    if env.get("KUBERNETES_SERVICE_HOST") and env.get("NODE_NAME", "").strip():
        return env["NODE_NAME"].strip()
    return socket.gethostname()


# ---------------------------------------------------------------------------- per-node launches
def _count(env, var):
    """A node count: a number, or torchrun's elastic 'min:max' when min == max."""
    raw = env[var].strip()
    m = re.fullmatch(r"(\d+):(\d+)", raw)
    if m and m.group(1) == m.group(2):
        return int(m.group(1))
    if m:
        raise UsageError(f"{var}={raw!r} is an elastic range: a preflight needs a fixed node count; set {var} to "
                         "one number")
    return _int_var(env, var, lo=1, hi=100_000)


def _first(env, launcher, fact, sources, read, fix):
    """The value of `fact` from the first of the variables `sources` that is set (read(env, variable)); every
    other one set must agree (else one line naming both). -> (value, variable)."""
    got = [(var, read(env, var)) for var in sources if var in env]
    if not got:
        raise UsageError(f"{launcher}: {fact} is not set: set {' or '.join(sources)}{fix}")
    var, value = got[0]
    for other, v in got[1:]:
        if v != value:
            raise UsageError(f"{launcher}: {var}={env.get(var, value)!s} and {other}={env.get(other, v)!s} disagree on "
                             f"{fact}: set one of them, or make them equal")
    return value, var


def _nproc(env):
    """PET_NPROC_PER_NODE: a number of ranks for this node, or None for one per GPU (auto, gpu, or unset)."""
    raw = env.get("PET_NPROC_PER_NODE")
    if raw is None or raw.strip().lower() in ("auto", "gpu"):
        return None
    if not raw.strip().isdigit():
        raise UsageError(f"PET_NPROC_PER_NODE={raw!r} is not a number nor auto: set the ranks per node, or auto for "
                         "one per GPU")
    return ("PET_NPROC_PER_NODE", _int_var(env, "PET_NPROC_PER_NODE", lo=1, hi=1024))


def _volcano_task(env):
    """The svc plugin's one task: (its VC_<TASK>_NUM, its first host), or a line naming what to set."""
    nums = sorted(v for v in env if re.fullmatch(r"VC_\w+_NUM", v))
    tasks = [v[3:-4] for v in nums if f"VC_{v[3:-4]}_HOSTS" in env]
    if len(tasks) != 1:
        what = (f"a job of {len(tasks)} tasks ({', '.join(f'VC_{t}_NUM' for t in tasks)})" if tasks else
                f"{', '.join(nums)} without its VC_<TASK>_HOSTS" if nums else
                "no svc plugin variables (VC_<TASK>_NUM, VC_<TASK>_HOSTS)")
        index = (f"VC_TASK_INDEX={env['VC_TASK_INDEX']} is a pod's index within its task, and "
                 if "VC_TASK_INDEX" in env else "")
        raise UsageError(f"Volcano: {index}this pod has {what}: enable the pytorch plugin (RANK, WORLD_SIZE, "
                         "MASTER_ADDR, MASTER_PORT), or set PET_NNODES, PET_NODE_RANK and MASTER_ADDR")
    t = tasks[0]
    hosts = [h.strip() for h in env[f"VC_{t}_HOSTS"].split(",") if h.strip()]
    if not hosts:
        raise UsageError(f"Volcano: VC_{t}_HOSTS is empty: the svc plugin names no host")
    return f"VC_{t}_NUM", f"VC_{t}_HOSTS", check_host(f"VC_{t}_HOSTS", hosts[0])


def allocated_gpus(env):
    """The GPUs the pod was given, from the NVIDIA device plugin's NVIDIA_VISIBLE_DEVICES when it lists them (UUIDs
    or indices; not all, none, void or a path): the same on every pod of one template, whatever the driver still
    shows, so that a GPU lost on one node fails that node's rank instead of changing the world size. None: unknown."""
    raw = env.get("NVIDIA_VISIBLE_DEVICES", "").strip()
    items = [x.strip() for x in raw.split(",") if x.strip()]
    if not items or any(x.lower() in ("all", "none", "void") or "/" in x for x in items):
        return None
    return len(items)


def which_node_launcher(env):
    """The key of the per-node launcher this environment is, or None (a per-process launch or local mode)."""
    rank_var = _pick(env, "RANK", "SLURM_PROCID", *MPI_RANK_VARS)
    if LAUNCH_VAR in env or under_torchrun(env) or rank_var not in (None, "RANK"):
        return None  # this tool's own ranks, torchrun's workers, an srun task or an MPI rank
    if rank_var == "RANK" and _pick(env, "LOCAL_RANK", "SLURM_LOCALID", *MPI_LOCAL_VARS):
        return None  # one process per rank
    if any(v in env for v in LWS_VARS):
        return "lws"
    if "VC_TASK_INDEX" in env or any(re.fullmatch(r"VC_\w+_(HOSTS|NUM)", v) for v in env):  # env or svc plugin
        return "volcano"
    if rank_var is None and "PET_NODE_RANK" in env:
        return "trainer-v2"
    if rank_var == "RANK" and ("PET_NNODES" in env or "PET_NODE_RANK" in env):
        return "pytorchjob"
    if "JOB_COMPLETION_INDEX" in env:
        return "jobset" if env.get("JOBSET_NAME", "").strip() else "indexed-job"
    if "PET_NNODES" in env:
        return "trainer-v2"
    if rank_var == "RANK" and "WORLD_SIZE" in env:
        return "pytorchjob"
    return None


def _one_launch(env, name, nnodes, nodes_from):
    """One node by this launcher's count and several by another's (a pod with two launchers' variables): a
    UsageError, never a local run alone."""
    more = [f"{v}={env[v].strip()}" for v in ("PET_NNODES", "LWS_GROUP_SIZE", "VC_WORKER_NUM")
            if env.get(v, "").strip().isdigit() and int(env[v]) > 1]
    if nnodes == 1 and more:
        raise UsageError(f"{name}: {nodes_from}={nnodes} (one node), but {', '.join(more)} say this pod is one of "
                         "several: the environment mixes two launchers' variables; give the pod one launcher's",
                         own=True)


def read_node_launch(env):
    """A per-node launch: {'launcher', 'name', 'nnodes', 'node_rank', 'nproc' ((variable, n) or None: one per GPU),
    'master_addr', 'master_port', 'from' (fact -> the variable it came from), 'world_given' (a WORLD_SIZE to
    hold to the launch: world_mismatch), 'ambiguous' (RANK may count processes)}, or None when the environment is a
    per-process launch or local mode. Contradictory or missing variables: UsageError, one line naming them."""
    key = which_node_launcher(env)
    if key is None:
        return None
    name, fix, where = BY_KEY[key].name, "", ""
    nodes, index, addrs = ["PET_NNODES"], ["PET_NODE_RANK"], ["MASTER_ADDR", "PET_MASTER_ADDR"]
    ports, known = ["MASTER_PORT", "PET_MASTER_PORT"], {}  # known: an address read already (Volcano's first host)
    default_port, world_var, ambiguous = TORCHRUN_PORT, "WORLD_SIZE", False  # WORLD_SIZE: held to the launch
    if key == "trainer-v2":
        index.append("JOB_COMPLETION_INDEX")
        addrs.reverse()
        ports.reverse()
    elif key == "pytorchjob":
        if "PET_NNODES" not in env:
            nodes, world_var = ["WORLD_SIZE"], None
        index.append("RANK")
        ambiguous = "PET_NNODES" not in env and "PET_NODE_RANK" not in env
        default_port = None
    elif key in ("indexed-job", "jobset"):
        index.insert(0, "JOB_COMPLETION_INDEX")
        fix, where = " (the Job's completions)", ": pod 0 through the headless Service, e.g. <job>-0.<service>"
    elif key == "lws":
        nodes.insert(0, "LWS_GROUP_SIZE")
        index.insert(0, "LWS_WORKER_INDEX")
        addrs.insert(0, "LWS_LEADER_ADDRESS")
    elif key == "volcano" and "RANK" in env:  # the pytorch plugin: one process per pod, RANK its index
        nodes, world_var = ["WORLD_SIZE", "PET_NNODES"], None
        index = ["RANK", "PET_NODE_RANK"]
        default_port = None
    elif key == "volcano":
        if "PET_NNODES" in env:  # set by hand: PET_NODE_RANK is the node's index (VC_TASK_INDEX is per task)
            index = index if "PET_NODE_RANK" in env else ["VC_TASK_INDEX"]
        else:
            num, hosts_var, first = _volcano_task(env)
            nodes, index = [num], ["VC_TASK_INDEX", "PET_NODE_RANK"]
            addrs.append(hosts_var)
            known[hosts_var] = first
            fix = " (Volcano's env plugin sets VC_TASK_INDEX)"
    nnodes, nodes_from = _first(env, name, "the node count", nodes, _count, fix)
    _one_launch(env, name, nnodes, nodes_from)
    node_rank, node_from = _first(env, name, "this node's index", index,
                                  lambda e, v: _int_var(e, v, lo=0, hi=100_000), fix if key == "volcano" else "")
    if node_rank >= nnodes:
        raise UsageError(f"{name}: {node_from}={node_rank} is not below {nodes_from}={nnodes}", own=True)
    addr, addr_from = _first(env, name, "the master's address", addrs, lambda e, v: known.get(v) or check_host(v, e[v]),
                             f" (the host of node 0{where})")
    if default_port is not None and not any(var in env for var in ports):
        port, port_from = default_port, f"torchrun's default {default_port}: no MASTER_PORT"
    else:
        port, port_var = _first(env, name, "the master's port", ports, lambda e, v: _int_var(e, v, lo=1, hi=65535), "")
        port_from = f"port from {port_var}"
    return {"launcher": key, "name": name, "nnodes": nnodes, "node_rank": node_rank, "nproc": _nproc(env),
            "master_addr": addr, "master_port": port, "port_from": port_from,
            "from": {"nodes": nodes_from, "node": node_from, "master": addr_from},
            "world_given": _int_var(env, world_var, lo=1, hi=100_000_000) if world_var in env else None,
            "ambiguous": ambiguous}


def check_pet_beside_ranks(env, world):
    """A per-process launch (RANK and LOCAL_RANK) beside torchrun's PET_NNODES and a numeric PET_NPROC_PER_NODE
    that make another world size: one line naming them (torchrun's workers and this tool's own ranks excepted)."""
    if LAUNCH_VAR in env or under_torchrun(env) or "PET_NNODES" not in env:
        return
    nproc, nnodes = _nproc(env), _count(env, "PET_NNODES")
    if nproc is not None and nnodes * nproc[1] != world:
        raise UsageError(f"PET_NNODES={nnodes} x PET_NPROC_PER_NODE={nproc[1]} make {nnodes * nproc[1]} ranks, but "
                         f"WORLD_SIZE={world}: set WORLD_SIZE to the ranks of the whole job, or unset the PET_* "
                         "variables that belong to another launch")


def ambiguous_rank(env, gpus):
    """The line for RANK and WORLD_SIZE without LOCAL_RANK on a node of several GPUs, where nothing says whether
    RANK counts pods or processes."""
    return UsageError(f"RANK={env['RANK']} and WORLD_SIZE={env['WORLD_SIZE']} are set but LOCAL_RANK is not, on a "
                      f"node with {gpus} GPUs: RANK may count pods (PyTorchJob v1: one process per pod) or processes; "
                      f"set PET_NPROC_PER_NODE={gpus} (nprocPerNode) or --nproc {gpus} when it counts pods (this tool "
                      "then starts one rank per GPU), or LOCAL_RANK when every process is one rank")


def world_mismatch(node, nproc):
    """A WORLD_SIZE beside a per-node launch that is neither its pods nor its ranks: the line, or None."""
    given, world = node["world_given"], node["nnodes"] * nproc
    if given is None or given in (node["nnodes"], world):
        return None
    return UsageError(f"{node['name']}: {node['from']['nodes']}={node['nnodes']} node(s) x {nproc} rank(s) per node "
                      f"make {world} ranks, but WORLD_SIZE={given}: set WORLD_SIZE to {world} (ranks) or "
                      f"{node['nnodes']} (pods), or unset it")


# ---------------------------------------------------------------------------- the words for the header
def describe_node(node, nproc, why):
    """A per-node launch in words (the contract line's `how`; `why`: how the ranks per node were chosen)."""
    f = node["from"]
    return (f"{node['name']} ({f['nodes']}, {f['node']}, {f['master']}): node {node['node_rank']} of "
            f"{node['nnodes']}, {nproc} rank(s) per node started by this tool ({why}), rank = node x {nproc} + "
            "local rank")


def describe_contract(contract, env):
    """{'launch', 'how', 'port_from'} of a per-process contract: what this tool's own launcher said
    (LAUNCH_VAR), else which launcher's variables were read."""
    with contextlib.suppress(KeyError, ValueError):
        told = json.loads(env[LAUNCH_VAR])
        if isinstance(told, dict) and all(isinstance(told.get(k), str) for k in ("launch", "how", "port_from")):
            return {k: told[k] for k in ("launch", "how", "port_from")}
    names = ", ".join(contract.get("vars", ()))
    launch = {"slurm": "Slurm srun", "mpi": "mpirun"}.get(contract.get("source")) or (
        "torchrun" if under_torchrun(env) else "RANK, WORLD_SIZE, LOCAL_RANK")
    return {"launch": launch, "how": f"{launch}: {names}, one process per rank started by the launcher",
            "port_from": f"port from {contract.get('port_source', 'MASTER_PORT')}"}



# ============================================================================ aiv/launch/options.py
# Floor 2: the one parser of flags and AIV_* variables (one grammar for both; the command line wins).
# One grammar for every flag and AIV_* variable: on = 1/on/yes/true, off = 0/off/no/false (any case);
# sizes are bytes with binary K/M/G suffixes (1M = 2^20); an empty value is a mistake, not a default.
# Converters raise ValueError(the predicate: "is not a number"); parse_args names the flag or the
# variable as the user wrote it.
ON_WORDS, OFF_WORDS = ("1", "on", "yes", "true"), ("0", "off", "no", "false")
SECONDS_MAX = 86400.0      # a phase bound above a day is a typo (and overflows the store's timedelta)
SIZE_MAX = 64 << 30        # one all_reduce buffer: more than any GPU holds is a typo
DEFAULT_BW_SIZES = "1M,16M,256M,1G"


def _number(text):
    try:
        return float(text)
    except ValueError:
        raise ValueError("is not a number") from None


def _positive_float(text):
    v = _number(text)
    if not (v > 0 and math.isfinite(v)):
        raise ValueError("is not a finite number > 0")
    return v


def _seconds(text):
    v = _number(text)
    if not math.isfinite(v):
        raise ValueError("is not a finite number of seconds")
    if not 1 <= v <= SECONDS_MAX:
        raise ValueError(f"is outside 1-{SECONDS_MAX:g} seconds")
    return v


def _soak(text):
    """--soak: 0 or an off word: no soak; else seconds of load, 1 to SECONDS_MAX."""
    if text.strip().lower() in OFF_WORDS:
        return 0.0
    v = _number(text)
    if not (math.isfinite(v) and (v == 0 or 1 <= v <= SECONDS_MAX)):
        raise ValueError(f"is not 0 (off) or 1-{SECONDS_MAX:g} seconds")
    return v


def _int_from(low):
    def conv(text):
        try:
            v = int(text)
        except ValueError:
            raise ValueError("is not an integer") from None
        if v < low:
            raise ValueError(f"is below {low}")
        return v
    return conv


def _one_of(words):
    def conv(text):
        if text not in words:
            raise ValueError("is not " + ", ".join(words[:-1]) + " or " + words[-1])
        return text
    return conv


_positive_int, _count_arg = _int_from(1), _int_from(0)
NODE_CHECK_WORDS = ("prolog", "epilog", "health", "npd", "auto")
# Where the verdict goes besides the log and the JSON: Slurm's node state (drain), Prometheus text, one
# page. Each is planned or rendered by a pure function of the verdict's state; only drain_apply acts.
DRAIN_MODES = ("off", "recommend", "on")
_node_check, _backend, _drain_mode = _one_of(NODE_CHECK_WORDS), _one_of(("auto", "nccl", "gloo")), _one_of(DRAIN_MODES)


def _switch(text):
    word = text.strip().lower()
    if word in ON_WORDS or word in OFF_WORDS:
        return word in ON_WORDS
    raise ValueError("is neither on (1/on/yes/true) nor off (0/off/no/false)")


def _sizes(text):
    """'1M,64MiB,1G' -> bytes; an on word: the default sizes; 0 or an off word: None (no probe)."""
    word = text.strip().lower()
    if word in ON_WORDS or word in OFF_WORDS:
        return _sizes(DEFAULT_BW_SIZES) if word in ON_WORDS else None
    out = []
    for part in text.split(","):
        m = re.fullmatch(r"\s*([0-9]+)\s*(?:([KMG])(?:iB)?)?\s*", part, re.I)
        if not m:
            raise ValueError(f"is not a list of sizes (bytes with binary K/M/G suffixes, e.g. {DEFAULT_BW_SIZES}; "
                             f"0 or off for none)")
        n = int(m.group(1)) << {"": 0, "K": 10, "M": 20, "G": 30}[(m.group(2) or "").upper()]
        if not 1 <= n <= SIZE_MAX:
            raise ValueError(f"has a size outside 1 B-{human_bytes(SIZE_MAX)}")
        out.append(n)
    return out


def _directory(text):
    if not os.path.isdir(text):
        raise ValueError("is not a directory")
    return text


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        raise UsageError(message[len("argument "):] if message.startswith("argument ") else message)


WANT = {_backend: "auto, nccl or gloo", _seconds: "a number of seconds", _positive_int: "a whole number",
        _switch: "on or off", _sizes: "sizes, on or off", _positive_float: "a number", str: "a path",
        _directory: "a directory", _drain_mode: "off, recommend or on",
        _soak: "a number of seconds, or 0 for no soak", _count_arg: "a whole number (0 or more)",
        _node_check: "prolog, epilog, health, npd or auto"}  # what an empty value should have been


def _opt(p, flag, conv, shown, text, env=True, want=None, **kw):
    """One option: its converter, its variable (AIV_<OPTION>, or none), its default as --help and the
    options page (docs/options.md) show it, and what an empty value should have been."""
    var = "AIV_" + flag[2:].upper().replace("-", "_") if env else None
    a = p.add_argument(flag, help=f"{text} (default: {shown}; variable: {var or 'none'})".replace("%", "%%"), **kw)
    a.conv, a.env, a.shown, a.want = conv, var, shown, want or WANT[conv]
    return a


# --nproc: what one machine holds. A gloo rank peaks at ~0.3 GiB resident (CPU torch 2.x: the
# interpreter, torch and a gloo group; measured with 2 and 4 ranks), and the node's import probe and
# liveness monitor add ~0.3 GiB once: 512 MiB per CPU rank covers both. A rank that drives a GPU also
# holds a CUDA context in host memory: 1.5 GiB. A rank is idle but for its start (import torch, 1-2
# CPU seconds) and milliseconds of collectives, so 4 ranks per core start within seconds, far inside
# the roll-call bound, and leave the machine usable. Only an explicit --nproc is held to this rule.
RANKS_PER_CORE = 4
RANK_MEM_CPU = 512 << 20
RANK_MEM_GPU = 1536 << 20

EPILOG = "\n".join((
    "Values: on = 1/on/yes/true, off = 0/off/no/false (any case); sizes are bytes with binary K/M/G",
    f"suffixes (1M = 2^20); seconds are 1-{SECONDS_MAX:g}. Flags are spelled out in full. A malformed or",
    "empty flag, AIV_* variable or launch variable is one FAILURE line and exit 2; nothing runs.",
    f"--nproc: at most {RANKS_PER_CORE} ranks per CPU core this process may use, and one rank per",
    f"{human_bytes(RANK_MEM_CPU)} (CPU) or {human_bytes(RANK_MEM_GPU)} (GPU) of MemAvailable or of what the "
    "memory cgroup has left.",
    "--verify-log has no variable: an exported AIV_VERIFY_LOG would turn every later run, Slurm jobs",
    "included, into a log check; setting it is a usage error. Nor has --node-check (every run a node check).",
    "Exit codes: 0 PASS, 1 FAIL, 2 USAGE, 3 TIMEOUT, 4 INTERNAL, 5 INTERRUPTED."))


def build_parser():
    p = _Parser(prog="ddp_mesh_ping.py", description=DESCRIPTION, add_help=False, allow_abbrev=False,
                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=EPILOG)
    p.add_argument("-h", "--help", action="store_true", help="show this help and exit")
    _opt(p, "--backend", _backend, "auto", "auto: nccl when CUDA is available, else gloo", default="auto",
         metavar="{auto,nccl,gloo}")
    _opt(p, "--timeout", _seconds, f"{TIMEOUT_DEFAULT:g}", "seconds each phase after the roll call may take: init, "
         "telemetry, collective, ddp, bandwidth, verdict", default=TIMEOUT_DEFAULT, metavar="SECONDS")
    _opt(p, "--rollcall-timeout", _seconds, f"{ROLLCALL_DEFAULT:g}", "seconds for every rank to start and check "
         "in; absorbs start-up skew such as thousands of ranks importing torch from shared storage",
         default=ROLLCALL_DEFAULT, metavar="SECONDS")
    for what, text in (("world-size", "N ranks in all"), ("nodes", "N nodes"),
                       ("ranks-per-node", "N ranks on every node")):
        _opt(p, f"--expect-{what}", _positive_int, "from Slurm", f"FAIL unless the run has {text}", metavar="N")
    _opt(p, "--strict", _switch, "off", "turn every WARN into a FAIL (exit 1; such a FAIL never drains a node); "
         "no value: on", nargs="?", const="on", default=False, metavar="on/off")
    _opt(p, "--json", str, "none", "rank 0 writes the verdict as JSON here; tried before the run", metavar="PATH")
    _opt(p, "--nproc", _positive_int, "GPUs, or 2", "local mode (or a pod's per-node launch): ranks here (see the "
         "rule below); --node-check on a node without GPUs: the CPU workers standing in for GPUs", metavar="N")
    _opt(p, "--bandwidth", _sizes, "off", f"measure all_reduce bus bandwidth; no value or on: {DEFAULT_BW_SIZES}; "
         "0 or off: no probe", nargs="?", const="on", metavar="SIZES")
    _opt(p, "--min-busbw", _positive_float, "none", "FAIL when the largest size's busbw is below this (GB/s, "
         "1e9 B/s); implies --bandwidth", metavar="GBPS")
    _opt(p, "--verify-log", str, "none", "check a saved log and exit", env=False, metavar="FILE",
         want="the path of a saved log")
    _opt(p, "--save-manifest", str, "none", "on a PASS, save (merge into) the accepted state of the nodes as a "
         "manifest, its WARNs recorded as accepted", metavar="PATH")
    _opt(p, "--manifest", str, "none", "judge this run against a saved manifest (check 'manifest')", metavar="PATH")
    _opt(p, "--diff-manifest", str, "none", "print the differences between two manifests and exit: 0 equal, "
         "1 different, 2 unreadable", env=False, nargs=2, metavar=("A", "B"))
    p.set_defaults(manifest_data=None)  # the --manifest file, read up front by rank 0 (manifest_preflight)
    _screen_options(p)
    _output_options(p)
    _node_options(p)
    _opt(p, "--sysfs-root", _directory, "/", "root for /sys, /proc/driver and /dev/kmsg reads (tests)", default="/",
         metavar="DIR")
    p.add_argument("--version", action="store_true", help="print the version and exit")
    return p


def _screen_options(p):
    """Performance screen (section `screen`): on by default, floors in the units of the report."""
    _opt(p, "--skip-screen", _switch, "off", "skip the performance screen (GPU matmul and memory, intra-node and "
         "inter-node busbw); no value: on", nargs="?", const="on", default=False, metavar="on/off")
    _opt(p, "--skip-numerics", _switch, "off", "skip the numerics check (every rank's matmuls compared bit for bit "
         "with its model's peers and with an fp64 reference; the DDP step's local gradients); no value: on",
         nargs="?", const="on", default=False, metavar="on/off")
    _opt(p, "--min-tflops", _positive_float, "none", "screen: FAIL a GPU whose dense matmul is below this (bf16 on "
         "GPU, fp32 on CPU)", metavar="TFLOPS")
    _opt(p, "--min-hbm", _positive_float, "none", "screen: FAIL a GPU whose device-memory copy is below this (GB/s, "
         "read + write)", metavar="GBPS")
    _opt(p, "--min-busbw-intra", _positive_float, "none", "screen: FAIL a node whose all_reduce busbw inside the "
         "node is below this (GB/s)", metavar="GBPS")
    _opt(p, "--min-busbw-inter", _positive_float, "none", "screen: FAIL an inter-node measurement (a pair on one "
         "rail) below this busbw (GB/s)", metavar="GBPS")
    _opt(p, "--soak", _soak, "0", "after the screen, bf16 matmul on every GPU at once for SECONDS (fp32 on CPU), "
         "sampling clocks, temperature, power and clock-event reasons; FAIL a GPU whose speed decays or whose "
         "clocks slow for heat or a power brake; 0: no soak", default=0.0, metavar="SECONDS")


def _output_options(p):
    """Where the verdict goes besides the log and the JSON (section `outputs`)."""
    _opt(p, "--drain", _drain_mode, "recommend", "on a FAIL whose culprits are hosts: 'on' drains them in Slurm "
         f"(scontrol, reason '{DRAIN_PREFIX} ...'), 'recommend' prints the command, 'off' neither",
         default="recommend", metavar="{off,recommend,on}")
    _opt(p, "--drain-max", _positive_int, "10% of the nodes, at least 1", "more culprits than this: nothing is "
         "drained (a cause that wide is rarely the nodes)", metavar="N")
    _opt(p, "--metrics", str, "none", "rank 0 writes the run as Prometheus text here (atomically: the "
         "node_exporter textfile collector's convention); tried before the run", metavar="PATH")
    _opt(p, "--html", str, "none", "rank 0 writes one self-contained page of the run here (the batch file: "
         "ai_infra_smoke_test_<jobid>.html); tried before the run", metavar="PATH")


def _node_options(p):
    """The node gate (docs/node-gate.md): this node alone, as Slurm's Prolog/Epilog/HealthCheckProgram or NPD's
    plugin."""
    _opt(p, "--node-check", _node_check, "none", "check this node alone and exit: prolog, epilog, health "
         "(HealthCheckProgram) or npd (Node Problem Detector); no value or auto: Slurm's SLURM_SCRIPT_CONTEXT, else "
         "health. Exit 1 only on a FAIL whose evidence singles the node out; the tool's own trouble exits 0 (npd: 2)",
         env=False, nargs="?", const="auto", metavar="CONTEXT", want="prolog, epilog, health, npd or auto")
    _opt(p, "--node-budget", _seconds, f"{NODE_BUDGET_DEFAULT:g}", "--node-check: seconds for the whole check; "
         "what does not fit is skipped and named", default=NODE_BUDGET_DEFAULT, metavar="SECONDS")
    _opt(p, "--expect-gpus", _count_arg, "the job's GPUs, the node's gres, its PCI bus", "--node-check: FAIL unless "
         "the node lists N GPUs; 0: a node without GPUs (CPU workers stand in)", metavar="N")
    _opt(p, "--undrain", _switch, "off", "--node-check health with --drain on: a pass resumes the node when the "
         "check's own drain names a check that passed now; no value: on", nargs="?", const="on", default=False,
         metavar="on/off")
    _opt(p, "--node-lock-dir", _directory, "/run/aiv (root), else the user's own", "--node-check: the directory of "
         "the node's lock (one pass on the GPUs at a time): owned by the user that runs the check, writable by no "
         "one else; never a job's TMPDIR", metavar="DIR")


_UNSET = object()
REMOVED_VARS = {"AIV_VERIFY_LOG": "is no longer read (left exported it turned every later run, Slurm jobs "
                                  "included, into a log check): unset it and use --verify-log FILE"}


# AIV_* variables that are no option of the tool, by their owner (a test checks this list against the
# names those files use). Any other AIV_* variable is a usage error naming the closest known one.
OWNED_VARS = {
    "the tool": ("AIV_FAILPOINT", "AIV_FAILPOINT_MARK", "AIV_JOB_SECRET", "AIV_WARM_IMPORTS"),
    "submit_smoke_test.sbatch": ("AIV_CPU_BIND", "AIV_SCRIPT", "AIV_STEP_GRACE", "AIV_STEP_KILL_WAIT"),
    "tests and bench": ("AIV_ARTIFACTS", "AIV_SIM_NODES", "AIV_SIM_TRIALS", "AIV_SLURM_DIR", "AIV_SLURM_INSTALL",
                        "AIV_SLURM_SUBNET", "AIV_TEST_ENV", "AIV_TEST_FORK"),
}


def unknown_var(env, parser):
    """The first AIV_* variable nobody reads, as a usage error naming the closest known one (None: none)."""
    known = [a.env for a in parser._actions if getattr(a, "env", None)]
    known += [v for names in OWNED_VARS.values() for v in names] + list(REMOVED_VARS)
    for var in sorted(v for v in env if v.startswith("AIV_") and v not in known):
        near = difflib.get_close_matches(var, known, n=1, cutoff=0.6)
        secret = any(w in name for name in [var] + near for w in ENV_DENY_WORDS)  # a misspelled AIV_JOB_SECRET too
        shown = "(value not shown)" if secret else repr(env[var][:60])
        return UsageError(f"{var}={shown} is not a variable of ddp_mesh_ping.py"
                          + (f" (did you mean {near[0]}?)" if near else " (see --help)"))
    return None


def _given(action, name, value):
    """A flag's or variable's text, converted; UsageError naming it as the user wrote it."""
    if isinstance(value, list):  # nargs=2 (--diff-manifest A B)
        return [_given(action, name, v) for v in value]
    if not value.strip():
        raise UsageError(f"{name} is empty; give {action.want}" + (", or unset it" if name.startswith("AIV_") else ""))
    try:
        return action.conv(value)
    except ValueError as e:
        raise UsageError(f"{name}={value!r} {e}") from None


def output_paths_from_argv(argv, env):
    """--json and --metrics read without the parser (a --node-check usage error still writes them): the flags,
    else AIV_JSON, AIV_METRICS. -> [(flag, path)]."""
    out = []
    for flag, var in (("--json", "AIV_JSON"), ("--metrics", "AIV_METRICS")):
        given = [a.split("=", 1)[1] if a != flag else after for a, after in zip(argv, [*argv[1:], "--"], strict=False)
                 if a.startswith(flag + "=") or a == flag and not after.startswith("--")]  # the last one wins
        path = (given or [""])[-1] or env.get(var)
        if path:
            out.append((flag, path))
    return out


def parse_args(argv, env):
    """Flags win over AIV_<OPTION> variables; every value goes through its option's converter, and the
    result records where each came from (args.origin: dest -> the flag or variable). UsageError else."""
    for var, why in REMOVED_VARS.items():
        if var in env:
            raise UsageError(f"{var}={env[var]!r} {why}")
    parser = build_parser()
    if unknown := unknown_var(env, parser):
        raise unknown
    job_secret(env)  # too short: a usage error (its value is never shown)
    opts = [a for a in parser._actions if hasattr(a, "conv")]
    ns, extra = parser.parse_known_args(list(argv), argparse.Namespace(**{a.dest: _UNSET for a in opts}))
    if extra:  # the first argument argparse did not take, with the likely flag meant
        if extra[0] in ("-", "--") or not extra[0].startswith("-"):
            raise UsageError(f"unexpected argument {extra[0]!r}: ddp_mesh_ping.py takes options only (see --help)")
        flags = [o for a in parser._actions for o in a.option_strings if o.startswith("--")]
        near = difflib.get_close_matches(extra[0].split("=", 1)[0], flags, n=1) if extra[0].startswith("--") else []
        raise UsageError(f"unknown option {extra[0]!r}" + (f" (did you mean {near[0]}?)" if near else " (see --help)"))
    ns.origin = {}
    for a in opts:
        flag, raw = a.option_strings[0], getattr(ns, a.dest)
        if raw is _UNSET and a.env in env:
            flag, raw = a.env, env[a.env]
        if raw is not _UNSET:
            ns.origin[a.dest] = flag
        setattr(ns, a.dest, a.default if raw is _UNSET else _given(a, flag, raw))
    if ns.min_busbw and not ns.bandwidth:
        if "bandwidth" in ns.origin:
            raise UsageError(f"{ns.origin['min_busbw']} needs the bandwidth probe, which "
                             f"{ns.origin['bandwidth']} turns off")
        ns.bandwidth = _sizes(DEFAULT_BW_SIZES)
    return ns



# ============================================================================ aiv/checks/interfaces.py
# Floor 2: NCCL_SOCKET_IFNAME / GLOO_SOCKET_IFNAME against the host's interfaces, and the lines of NCCL's
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
            with contextlib.suppress(OSError):
                addrs.append(socket.inet_ntoa(fcntl.ioctl(s.fileno(), SIOCGIFADDR, req)[20:24]))
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
    exclude, exact, pats = nccl_list(spec)
    return [n for n in names if any(n == p if exact else n.startswith(p) for p in pats) != exclude]


def gloo_ifname_select(spec, names):
    """GLOO_SOCKET_IFNAME: comma list of exact names; gloo needs every one. -> (found, missing)."""
    wanted = [p.strip() for p in spec.split(",") if p.strip()]
    return [w for w in wanted if w in names], [w for w in wanted if w not in names]


def check_interfaces(env, ifaces, host):
    """Local check: each *_SOCKET_IFNAME set selects at least one up interface with an address."""
    listed = ", ".join(f"{n}({'up' if i['up'] else 'down'}{':' + i['addrs'][0] if i['addrs'] else ''})"
                       for n, i in sorted(ifaces.items())) or "none"
    out, here = [], f"on {host}; interfaces here: {listed}"
    usable = {n for n, i in ifaces.items() if _usable(i)}
    if "NCCL_SOCKET_IFNAME" in env:
        val = env["NCCL_SOCKET_IFNAME"]
        sel = nccl_ifname_select(val, sorted(ifaces))
        good = [n for n in sel if n in usable]
        why = f"selects {','.join(sel)} but none is up with an address" if sel else "matches no interface"
        text = f"NCCL_SOCKET_IFNAME={val} selects {','.join(good)} on {host}" if good else \
            f"NCCL_SOCKET_IFNAME={val!r} {why} {here}"
        out.append(finding("interface", "PASS" if good else "FAIL", text, [host]))
    if "GLOO_SOCKET_IFNAME" in env:
        val = env["GLOO_SOCKET_IFNAME"]
        found, missing = gloo_ifname_select(val, set(ifaces))
        bad = missing + [n for n in found if n not in usable]
        text = f"GLOO_SOCKET_IFNAME={val} present on {host}" if found and not bad else \
            f"GLOO_SOCKET_IFNAME={val!r}: {','.join(bad) or val} is absent, down or has no address {here}"
        out.append(finding("interface", "PASS" if found and not bad else "FAIL", text, [host]))
    return out


def gloo_address(env, ifaces, hostname=None):
    """The interface and address gloo binds: GLOO_SOCKET_IFNAME's; else, as gloo does, the hostname's
    address when it resolves (Debian maps the hostname to 127.0.1.1, a loopback address), else the
    loopback address. -> {'iface', 'addr', 'how', 'loopback'}."""
    spec = (env.get("GLOO_SOCKET_IFNAME") or "").split(",")[0].strip()
    if spec:
        addrs = (ifaces.get(spec) or {}).get("addrs") or [None]
        out = {"iface": spec, "addr": addrs[0], "how": "GLOO_SOCKET_IFNAME"}
    else:
        host = hostname or socket.gethostname()
        try:
            addr = socket.getaddrinfo(host, None, socket.AF_INET, socket.SOCK_STREAM)[0][4][0]
            how = f"hostname {host} resolves to it"
        except OSError:
            addr, how = "127.0.0.1", f"hostname {host} does not resolve: gloo falls back to loopback"
        owner = next((n for n, i in ifaces.items() if addr in i["addrs"]), "lo" if addr.startswith("127.") else "?")
        out = {"iface": owner, "addr": addr, "how": how}
    out["loopback"] = bool(out["addr"]) and (out["addr"].startswith("127.") or out["addr"] == "::1")
    return out


def parse_nccl_ifaces(text):
    """Interfaces NCCL chose, from its INFO lines ('NET/Socket : Using [0]eth0:10.0.0.1<0>')."""
    return sorted({nic for line in re.findall(r"(?:NET/Socket|Bootstrap) ?: Using (.*)", text)
                   for nic in re.findall(r"(?:\[\d+\])?([\w.\-]+:[0-9A-Fa-f.:]+)<\d+>", line)})


def parse_nccl_nics(text):
    """The network devices NCCL listed, by its index: {0: 'mlx5_0', 1: 'mlx5_1:2'} from 'NET/IB : Using
    [0]mlx5_0:1/IB [1]mlx5_1:2/RoCE [RO]; OOB ib0:10.0.0.1<0>' (port 1 left out; a merged device
    '[0]={[0] mlx5_2:1/RoCE, [1] mlx5_3:1/RoCE}' is 'mlx5_2+mlx5_3'). Any network but sockets; the last list."""
    nics = {}
    for line in re.findall(r"NET/(?!Socket\b)[\w.\-]+ ?: Using ([^;\n]*)", text):
        cur = {}
        for idx, body in re.findall(r"\[(\d+)\](=\{[^}]*\}|[^\s\[]+)", line):
            if devs := re.findall(r"([\w.\-]+):(\d+)", body):
                cur[int(idx)] = "+".join(d if p == "1" else f"{d}:{p}" for d, p in devs)
        if cur:
            nics = cur
    return nics


def parse_nccl_hca(text, since=0):
    """The HCA this rank's NCCL traffic went through: the device (parse_nccl_nics) most of its network
    connections used ('Channel 00/0 : 0[0] -> 8[0] [send] via NET/IB/2/GDRDMA', 'via NET/IBext_v8/2', PXN
    'via NET/IB/2(5)/GDRDMA'), counted in the log from offset `since` (the latest communicators), else in the
    whole log; ties: the lowest index. None: no network connection of a known device in the log; '': its
    network connections all went over sockets (no HCA carries them)."""
    nics = parse_nccl_nics(text)
    for part in ((text[since:], text) if since else (text,)):
        net = [int(idx) for kind, idx in re.findall(r"\] via NET/([\w.\-]+)/(\d+)", part) if kind != "Socket"]
        counts = collections.Counter(idx for idx in net if idx in nics)
        if counts:
            return nics[max(sorted(counts), key=counts.get)]
        if part and re.search(r"\] via NET/Socket/", part) and not net:
            return ""
    return None


NCCL_WARN_RELAY = 20  # NCCL WARN lines a rank relays to stderr as it exits; the rest are counted


def nccl_warn_lines(text, limit=NCCL_WARN_RELAY):
    """NCCL's own WARN lines of a log: (the first `limit`, how many more)."""
    lines = [ln.rstrip() for ln in text.splitlines() if " NCCL WARN " in ln]
    return lines[:limit], max(0, len(lines) - limit)


def nccl_subsys_hides_channels(spec):
    """Whether NCCL_DEBUG_SUBSYS=spec leaves out the lines that say which transport each channel uses (logged
    under INIT and NET; unset: NCCL's default INIT,BOOTSTRAP,ENV shows them; '^X,Y' leaves out X and Y)."""
    if not spec:
        return False
    names = {s.strip().upper() for s in spec.lstrip("^").split(",")}
    if spec.startswith("^"):
        return {"INIT", "NET"} <= names or "ALL" in names
    return not names & {"INIT", "NET", "ALL"}


def nccl_diag_lines(text, limit=NCCL_WARN_RELAY):
    """NCCL's own diagnostics (NCCL >= 2.31 with NCCL_RUN_DIAGNOSTICS=1: 'host:pid NCCL DIAG <line>'), the first
    `limit`."""
    return [ln.strip() for ln in text.splitlines() if " NCCL DIAG " in ln][:limit]


def nccl_debug_file(env, host=None, pid=None):
    """The operator's NCCL_DEBUG_FILE as NCCL expands it for this process (%h: host name up to the first
    dot, %p: pid, %%: %); None when unset."""
    if not (spec := env.get("NCCL_DEBUG_FILE")):
        return None
    host = (host or socket.gethostname()).split(".")[0]
    return re.sub(r"%([hp%])", lambda m: {"h": host, "p": str(pid or os.getpid()), "%": "%"}[m.group(1)], spec)


NCCL_TRANSPORTS = ("P2P", "SHM", "NET/Socket", "NET/IB", "COLLNET", "NVLS", "NET/other")


def parse_nccl_transport(text):
    """Transports NCCL chose, from its own INFO lines ('Channel 00/0 : 0[0] -> 1[1] via P2P/CUMEM')."""
    return sorted({"COLLNET" if k == "CollNet" else "NET/other" if k.startswith("NET/") and k not in NCCL_TRANSPORTS
                   else k for k in re.findall(r" via (P2P|SHM|NET/\w+|COLLNET|CollNet|NVLS)", text)})



# ============================================================================ aiv/checks/collect.py
# Floor 2: facts of a rank and its node (GPUs, driver, IB ports, PCIe, NUMA, packages, import probe),
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


def _listdir(path):
    """The names in a directory, [] where it cannot be read."""
    try:
        return os.listdir(path)
    except OSError:
        return []


def driver_gpus(root="/"):
    """The NVIDIA driver's own list of its GPUs (/proc/driver/nvidia/gpus/<bus id>), [] without the driver: the
    node's own GPUs, whatever share of them the job was given (CUDA_VISIBLE_DEVICES, --gpus-per-node)."""
    return sorted(d.lower() for d in _listdir(os.path.join(root, "proc/driver/nvidia/gpus")))


NO_DEVICES = ("", "-1", "NoDevFiles")


def gpus_expected(env, root="/"):
    """Why this rank should have a GPU ('' when it should not): CUDA_VISIBLE_DEVICES names devices,
    Slurm allocated GPUs (SLURM_*GPUS*), or the NVIDIA driver lists GPUs. CUDA_VISIBLE_DEVICES set to
    '', -1 or NoDevFiles means a deliberate CPU run. A pod's NVIDIA_VISIBLE_DEVICES that lists GPUs counts too."""
    cvd = env.get("CUDA_VISIBLE_DEVICES")
    if cvd is not None:
        return "" if cvd.strip() in NO_DEVICES else f"CUDA_VISIBLE_DEVICES={cvd}"
    if allocated_gpus(env):  # a Kubernetes pod's GPUs (the NVIDIA device plugin's list; an image's "all" is none)
        return f"NVIDIA_VISIBLE_DEVICES lists {allocated_gpus(env)} GPU(s)"
    for k in sorted(env):
        v = env[k].strip()
        if re.fullmatch(r"SLURM_\w*GPUS\w*", k) and v and v != "(null)" and (
                re.search(r"[1-9]", v) or k in ("SLURM_JOB_GPUS", "SLURM_STEP_GPUS")):
            return f"{k}={v}"
    return "the NVIDIA driver lists GPUs in /proc/driver/nvidia/gpus" if driver_gpus(root) else ""


def cuda_problem(torch_mod):
    """torch's own reason why CUDA is unusable (a CPU build, driver too old, no device, init error)."""
    if torch_mod.version.cuda is None and getattr(torch_mod.version, "hip", None) is None:
        return f"torch {torch_mod.__version__} is a CPU-only build"
    import warnings
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if torch_mod.cuda.is_available():
            return "none"
    try:
        torch_mod.cuda.init()
    except Exception as e:
        return first_line(e)
    said = [str(w.message).strip().splitlines()[0] for w in caught if str(w.message).strip()]
    return said[0][:300] if said else f"torch {torch_mod.__version__} sees {torch_mod.cuda.device_count()} device(s)"


def read_ib_ports(root="/"):
    """[{'port': 'mlx5_0:1', 'state': 'ACTIVE', 'rate_gbps': 400.0, 'link_layer': 'InfiniBand'}]."""
    base = os.path.join(root, "sys/class/infiniband")
    out = []
    for dev in sorted(_listdir(base)):
        for p in sorted(_listdir(os.path.join(base, dev, "ports")), key=lambda p: int(p) if p.isdigit() else 0):
            state, rate, layer = ((read_text(os.path.join(base, dev, "ports", p, name), "") or "").strip()
                                  for name in ("state", "rate", "link_layer"))
            m = re.match(r"([\d.]+)\s*Gb", rate)
            out.append({"port": f"{dev}:{p}", "state": state.split(":")[-1].strip() or "UNKNOWN",
                        "rate_gbps": float(m.group(1)) if m else None, "link_layer": layer or None})
    return out


PCI_NODE = re.compile(r"pci[0-9a-f]{4}:[0-9a-f]{2}|[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]", re.I)


def _pci_chain(path):
    """The PCI path of a sysfs device link: ['pci0000:00', '0000:00:01.0', '0000:01:00.0', ...]
    (host bridge, then each bridge and switch port down to the device); [] where the link is absent."""
    if not os.path.exists(path):
        return []
    return [c.lower() for c in os.path.realpath(path).split(os.sep) if PCI_NODE.fullmatch(c)]


def nearest_hca(root, pci, spec=None):
    """The InfiniBand/RoCE device (/sys/class/infiniband/<hca>/device) nearest a GPU (its bus id,
    /sys/bus/pci/devices/<pci>) in the PCI tree: the longest common PCI path (behind the GPU's own PCIe
    switch, then its root port, then its host bridge), among the devices NCCL_IB_HCA (spec) selects, those
    with an ACTIVE port first (NCCL uses no other); equals: the lowest name. None: no bus id or no device."""
    gpu = _pci_chain(os.path.join(root, "sys/bus/pci/devices", pci.lower())) if pci else []
    if not gpu:
        return None
    ports, rank = ib_hca_select(spec, read_ib_ports(root)), {}  # rank: {device: (ACTIVE, common path length)}
    for dev in sorted({p["port"].split(":")[0] for p in ports}, key=_screen_key):
        if chain := _pci_chain(os.path.join(root, "sys/class/infiniband", dev, "device")):
            rank[dev] = (any(p["state"] == "ACTIVE" for p in ports if p["port"].split(":")[0] == dev),
                         len(os.path.commonprefix([gpu, chain])))
    return max(rank, key=rank.get, default=None)


def _cpu_model():
    return next((ln.split(":", 1)[1].strip() for ln in read_text("/proc/cpuinfo", "").splitlines()
                 if ln.lower().startswith(("model name", "cpu model", "hardware"))), os.uname().machine)


def _os_name():
    return next((ln.split("=", 1)[1].strip().strip('"') for ln in read_text("/etc/os-release", "").splitlines()
                 if ln.startswith("PRETTY_NAME=")), None)


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


IMPORT_PROBE = r"""
import json, os, sys
os.nice(19)  # behind every rank's own work: on a node whose ranks still import, it waits for them
for name in sys.argv[1:]:
    try:
        mod = __import__(name)
        out = {"version": getattr(mod, "__version__", "?"), "ok": True}
    except Exception as e:  # an ABI-broken package is a finding, not a crash
        msg = (str(e).strip().splitlines() or [type(e).__name__])[0][:160]
        out = {"version": None, "ok": False, "error": type(e).__name__ + ": " + msg}
    sys.stdout.write(json.dumps(dict(out, name=name)) + "\n")
    sys.stdout.flush()  # a crash in the next import keeps this line
"""


def start_import_probe():
    """Node leaders, at launch: one child process imports torchvision, then torchaudio (with torch that is
    seconds of work; an ABI-broken extension may even crash the importer), at nice 19 and, where psutil
    is importable, in the idle I/O class: it takes only what the node's ranks leave, so it never slows
    their imports or the roll call, and on a node with cores to spare it is done before the DDP step.
    -> the child, or the OSError that kept it from starting."""
    try:
        proc = subprocess.Popen([sys.executable, "-c", IMPORT_PROBE, *PROBED_PACKAGES], stdout=subprocess.PIPE,
                                stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL)
    except OSError as e:
        return e
    with contextlib.suppress(Exception):
        import psutil
        psutil.Process(proc.pid).ionice(psutil.IOPRIO_CLASS_IDLE)
    return proc


def finish_import_probe(proc, wait_s):
    """{name: {'ok', 'version', 'error'}} for PROBED_PACKAGES; a probe still running after wait_s is killed.
    A package without a line: the import that crashed the child (the first such) or was cut off."""
    if isinstance(proc, OSError):
        return {n: {"ok": False, "version": None, "error": f"probe could not start: {proc}"} for n in PROBED_PACKAGES}
    r = child_finish(proc, wait_s if proc.poll() is None else 60.0, "the import probe")
    why = f"import took over {wait_s:.0f}s" + (f" ({r['unread'].split(': ', 1)[1]})" if r.get("stuck") else "") \
        if "unread" in r else None
    out = {}
    for line in (r.get("out") or "").splitlines():
        with contextlib.suppress(ValueError, TypeError, AttributeError):
            d = json.loads(line)
            out[d.pop("name")] = d
    for name in PROBED_PACKAGES:
        if name not in out:  # a crash (e.g. SIGSEGV from a broken extension) is a finding
            rc = proc.returncode
            how = f"killed by {signal.Signals(-rc).name}" if rc is not None and rc < 0 else f"exited {rc}"
            out[name] = {"ok": False, "version": None, "error": why or f"import probe failed: {how}"}
            why = why or f"not probed: the import of {name} ended the probe"
    return out


def collect_node_facts(root, torch_mod, backend, device_count, env=None):
    """Facts collected once per node (by local rank 0). Missing sources -> None."""
    shm = None
    with contextlib.suppress(OSError):
        st = os.statvfs("/dev/shm")
        shm = st.f_frsize * st.f_blocks
    soft = resource.getrlimit(resource.RLIMIT_MEMLOCK)[0]
    facts = {
        "cpu_model": _cpu_model(), "cpus": os.cpu_count(), "mem_total": _mem_total(),
        "os": _os_name(), "kernel": os.uname().release,
        "driver": _driver_version(root),
        "ib": read_ib_ports(root),
        "peermem": any(os.path.isdir(os.path.join(root, "sys/module", m))
                       for m in ("nvidia_peermem", "nv_peer_mem")),
        "memlock": "unlimited" if soft == resource.RLIM_INFINITY else soft,
        "shm": shm,
        "ifaces": {n: i["addrs"][:1] for n, i in list_interfaces().items() if _usable(i)},
        "gpus_visible": device_count,
        "gpus_driver": len(driver_gpus(root)) or None,  # manifest: the node's own GPU count (its class)
        "peer": None,
        "env": node_env(env) if env is not None else None,  # manifest: this node's NCCL_/GLOO_ settings
    }
    if backend == "nccl" and device_count > 1:
        try:
            n = min(device_count, 16)
            facts["peer"] = ["".join("X" if i == j else ("1" if torch_mod.cuda.can_device_access_peer(i, j) else "0")
                                     for j in range(n)) for i in range(n)]
        except Exception as e:
            facts["peer_error"] = str(e)[:120]
    return facts


def loopback_domain():
    """Which loopback this process reaches: the kernel's boot id and its network namespace (two node names
    of one machine and namespace talk over 127.0.0.1 fine), or None where either is unreadable."""
    boot = (read_text("/proc/sys/kernel/random/boot_id") or "").strip()
    try:
        ns = os.readlink("/proc/self/ns/net")
    except OSError:
        return None
    return f"{boot}/{ns}" if boot else None


def _cpu_affinity():
    try:
        return sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return list(range(os.cpu_count() or 1))


def collect_gpu(torch_mod, index, root):
    """Facts of this rank's GPU (after torch.cuda.set_device)."""
    p = torch_mod.cuda.get_device_properties(index)
    pci = (f"{getattr(p, 'pci_domain_id', 0):04x}:{p.pci_bus_id:02x}:{p.pci_device_id:02x}.0"  # sysfs form
           if hasattr(p, "pci_bus_id") else None)
    uuid = str(getattr(p, "uuid", "") or "") or None
    if uuid and not uuid.startswith(("GPU-", "MIG-")):
        uuid = "GPU-" + uuid
    txt = (read_text(os.path.join(root, "sys/bus/pci/devices", pci.lower(), "numa_node")) or "").strip() if pci else ""
    numa = int(txt) if txt.lstrip("-").isdigit() else None
    numa_cpus = ((read_text(os.path.join(root, f"sys/devices/system/node/node{numa}/cpulist")) or "").strip() or None
                 if numa is not None and numa >= 0 else None)
    used = None
    with contextlib.suppress(Exception):
        free, total = torch_mod.cuda.mem_get_info(index)
        used = total - free
    return {"name": p.name, "vram": int(p.total_memory), "uuid": uuid, "pci": pci,
            "numa": numa, "numa_cpus": numa_cpus, "mem_used": used,
            **pci_link(root, pci)}  # manifest: PCIe link width and speed


# The oldest torch this tool runs on, the one place it is written (docs/install.md's table, measured by
# bench/torch_compat.sh on 2.4.1, 2.8.0 and 2.14.1). Newer APIs are probed where they are used, each with a
# fallback or a named degradation: Store.clone (not in 2.4; else a second TCPStore client, StoreProtocol.clone),
# the store server on a listen fd (not in 2.4; else the server binds the port itself, store_server),
# split_group (2.6; else new_subgroups_by_enumeration, split_problem), the flight recorder's JSON dump (not in
# 2.4; else the rank's own record, recorder_last), NCCL's RAS as JSON (NCCL 2.28.7; else not read, ras_status).
# Used, all older: init_process_group(device_id=) (2.3), new_group(use_local_synchronization=) and the
# store's append, multi_get, multi_set (2.1).
TORCH_FLOOR = (2, 4)


def torch_floor_problem(version):
    """A torch version string ('2.13.0+cu130', '2.8.0a0+git...') older than TORCH_FLOOR -> the FAILURE
    reason, else None (an unparsable version is let through: the versions check shows it)."""
    m = re.match(r"(\d+)\.(\d+)", str(version or ""))
    if m is None or (int(m.group(1)), int(m.group(2))) >= TORCH_FLOOR:
        return None
    return f"torch {version} is older than the oldest supported {'.'.join(map(str, TORCH_FLOOR))}"


def torch_versions(torch_mod):
    nccl = None
    with contextlib.suppress(Exception):
        if torch_mod.cuda.is_available():
            v = torch_mod.cuda.nccl.version()
            nccl = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
    return {"torch": torch_mod.__version__, "cuda": torch_mod.version.cuda, "nccl": nccl,
            "python": ".".join(map(str, sys.version_info[:3]))}


NODE_ENV_PREFIXES = ("NCCL_", "GLOO_", "TORCH_NCCL_")
PCI_LINK_FILES = ("current_link_width", "current_link_speed", "max_link_width", "max_link_speed")


def node_env(env):
    """A node's own NCCL_/GLOO_/TORCH_NCCL_ settings, through the report's allow-list (safe_env)."""
    return {k: v for k, v in safe_env(env).items() if k.startswith(NODE_ENV_PREFIXES)}


def pci_link(root, pci):
    """PCIe link facts of a device from sysfs: widths as lanes, speeds in GT/s; None where absent."""
    out = dict.fromkeys(PCI_LINK_FILES)
    for name in PCI_LINK_FILES if pci else ():
        m = re.match(r"\s*(\d+(?:\.\d+)?)", read_text(os.path.join(root, "sys/bus/pci/devices", pci.lower(), name))
                     or "")
        if m:
            out[name] = int(float(m.group(1))) if name.endswith("width") else float(m.group(1))
    return out



# ============================================================================ aiv/node/collect.py
# Floor 2: what the node gate (--node-check) reads on its node without torch: NVML's GPU list and compute
def smi_query(exe, what, fields, seconds):
    """One `nvidia-smi --query-<what>=fields --format=csv,noheader,nounits` -> {'text'} (its stdout, also when it
    exits nonzero beside rows: a GPU it cannot reach is a line of its own) or {'unread': why}."""
    r = run_bounded([exe, f"--query-{what}=" + ",".join(fields), "--format=csv,noheader,nounits"], seconds)
    if "unread" in r:
        return r
    if r["rc"] != 0 and not r["out"].strip():
        return {"unread": f"nvidia-smi exited {r['rc']}: {first_text_line(r['err'] or r['out']) or 'no output'}"}
    return {"text": r["out"] + r["err"]}


WORKER_ARG = "--aiv-node-check-worker"  # on a node check's device worker's command line: our own, never a leftover


def process_owner(pid, root="/"):
    """Who a process is: {'name', 'user', 'job', 'ours'} from /proc (the Slurm job from its cgroup path; ours: a
    node check's own device worker, by WORKER_ARG on its command line), each None where it cannot be read
    (another PID namespace, gone)."""
    base = os.path.join(root, "proc", str(pid))
    ours = WORKER_ARG in (read_text(os.path.join(base, "cmdline"), "") or "").split("\0")
    status = read_text(os.path.join(base, "status"), "") or ""
    uid = re.search(r"^Uid:\s+(\d+)", status, re.M)
    user = None
    if uid:
        with contextlib.suppress(ImportError, KeyError):
            import pwd
            user = pwd.getpwuid(int(uid.group(1))).pw_name
        user = user or f"uid {uid.group(1)}"
    job = re.search(r"/job_(\d+)(?:/|$)", read_text(os.path.join(base, "cgroup"), "") or "", re.M)
    name = (read_text(os.path.join(base, "comm"), "") or "").strip() or None
    return {"name": name, "user": user, "job": job.group(1) if job else None, "ours": ours or None}


def pci_gpus(root="/"):
    """PCI bus ids of NVIDIA display and 3D controllers (vendor 0x10de, class 0x0300xx or 0x0302xx; not the
    NVSwitches) on the bus: what the hardware holds, whatever the driver makes of it."""
    base = os.path.join(root, "sys/bus/pci/devices")
    try:
        names = sorted(os.listdir(base))
    except OSError:
        return []

    def attr(n, name):
        return (read_text(os.path.join(base, n, name), "") or "").strip().lower()
    return [n.lower() for n in names
            if attr(n, "vendor") == "0x10de" and attr(n, "class").startswith(("0x0300", "0x0302"))]


def read_kmsg(root="/", seconds=1.0, limit=8 << 20):
    """The kernel's log buffer, read without blocking from /dev/kmsg (root, or CAP_SYSLOG) -> {'text'} or
    {'unread': why}; at most `limit` bytes and `seconds`."""
    path = os.path.join(root, "dev/kmsg")
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError as e:
        return {"unread": f"{path}: {e.strerror or e}"}
    chunks, size, until = [], 0, time.monotonic() + seconds
    try:
        while size < limit and time.monotonic() < until:
            try:
                b = os.read(fd, 65536)
            except BlockingIOError:
                break  # the end of the buffer
            except BrokenPipeError:
                continue  # a record overwritten while we read: the next one follows
            if not b:
                break
            chunks.append(b)
            size += len(b)
    except OSError as e:
        return {"unread": f"{path}: {e.strerror or e}"}
    finally:
        os.close(fd)
    return {"text": b"".join(chunks).decode(errors="replace")}


def read_slurm_node(name, seconds):
    """`scontrol show node -d -o NAME` -> {'text'} or {'unread': why} (parsed by parse_slurm_node)."""
    r = run_bounded(["scontrol", "show", "node", "-d", "-o", name], seconds)
    if "unread" in r:
        return r
    if r["rc"] != 0:
        return {"unread": f"scontrol show node {name} exited {r['rc']}: {first_text_line(r['err'] or r['out'])}"}
    return {"text": r["out"]}



# ============================================================================ aiv/checks/numerics_measure.py
# Floor 2: what the numerics check (silent data corruption) computes on every rank's device: seeded matmuls and an
# What every rank computes (docs/numerics.md). The operands come from one seeded CPU generator, so every rank
# builds the same bits, then go to the rank's device. GPU: a 4096 x 1024 by 1024 x 4096 product, whose 16M
# outputs span every SM of the GPU several times over (a fault tied to one SM or one tensor core shows in some
# tile); CPU (gloo ranks): 128 x 256 by 256 x 256 on one thread.
NUMERICS_SHAPE = {"gpu": (4096, 1024, 4096), "cpu": (128, 256, 256)}   # (M, K, N): A is M x K, B is K x N
NUMERICS_ELEMENTS = {"gpu": 1 << 20, "cpu": 1 << 14}                   # the elementwise kernel's length
NUMERICS_SEED = 31
NUMERICS_BLOCK = 64          # GPU: the fp64 reference computed on the device is checked on this block on the CPU
# Variables that change which kernels cuBLAS runs or how: part of "the same software" (a rank with another
# value is judged in another group, never against the others' bits).
NUMERICS_ENV = ("CUBLAS_WORKSPACE_CONFIG", "CUBLASLT_WORKSPACE_SIZE", "NVIDIA_TF32_OVERRIDE",
                "TORCH_BLAS_PREFER_CUBLASLT", "TORCH_BLAS_PREFER_HIPBLASLT", "CUBLAS_EMULATION_STRATEGY")
NUMERICS_SOAK_EVERY_S = 1.0  # --soak: the numerics repeated at most this often, between timed blocks
# Tolerances against the fp64 reference, as a fraction of each element's scale: ||row i of A|| x ||column j
# of B|| (Cauchy-Schwarz: at least sum_k |a_ik b_kj|, the scale of the classic error bound), plus |bias_j| for
# the linear, plus |a*b| + |c| for the elementwise kernel. Bounds that hold for any order of summation
# (gamma_K = K u / (1 - K u)), times 2: a healthy device never exceeds them.
U32, UBF16, UTF32 = 2.0 ** -24, 2.0 ** -8, 2.0 ** -10


def _gamma(k, u):
    return k * u / (1 - k * u)


def numerics_tolerance(check, k, tf32_forced=False):
    """The largest error against the fp64 reference a healthy device may show, as a fraction of the element's
    scale. bf16: fp32 accumulation (gamma_K), the bf16 output rounding and up to 4 partial sums rounded to bf16
    (split-K with reduced-precision reductions, torch's default); TF32: both inputs rounded to 10 mantissa bits;
    fp32: gamma_K; elementwise: two roundings. NVIDIA_TF32_OVERRIDE=1 makes every fp32 matmul a TF32 one."""
    acc = _gamma(k, U32)
    if check in ("matmul-bf16", "linear-bf16"):
        return 2 * (acc + 5 * UBF16)
    if check == "matmul-tf32" or (tf32_forced and check in ("matmul-fp32", "ddp-grad")):
        return 2 * (acc + 2 * UTF32 + U32)
    if check == "elementwise-fp32":
        return 2 * 2 * U32
    return 2 * (acc + U32)


@contextlib.contextmanager
def fp32_matmul_precision(torch_mod, mode):
    """torch's fp32 matmul precision ('highest': no TF32, 'high': TF32) for the block, put back after: the
    process's own setting is never changed for long (the setting is the process's, not the thread's)."""
    old = torch_mod.get_float32_matmul_precision()
    torch_mod.set_float32_matmul_precision(mode)
    try:
        yield
    finally:
        torch_mod.set_float32_matmul_precision(old)


def cublas_version():
    """cuBLASLt's version (e.g. 130100) from the library this process already loaded, or None."""
    for major in (13, 12, 11):
        with contextlib.suppress(OSError, AttributeError):
            lib = ctypes.CDLL(f"libcublasLt.so.{major}", mode=getattr(os, "RTLD_NOLOAD", 4) | ctypes.RTLD_GLOBAL)
            lib.cublasLtGetVersion.restype = ctypes.c_size_t
            return int(lib.cublasLtGetVersion())
    return None


def numerics_software(torch_mod, dev, kind):
    """What decides the bits of a result besides the device: torch, CUDA, cuBLAS, the BLAS torch prefers, the
    reduced-precision bf16 reduction flag and NUMERICS_ENV; the GPU's SM count and compute capability (the
    driver and the model come from the record, rank 0 adds them)."""
    sw = {"torch": torch_mod.__version__, "env": {k: os.environ[k] for k in NUMERICS_ENV if k in os.environ}}
    if kind == "gpu":
        p = torch_mod.cuda.get_device_properties(dev)
        m = torch_mod.backends.cuda.matmul
        sw.update(sms=p.multi_processor_count, cc=f"{p.major}.{p.minor}", cuda=torch_mod.version.cuda,
                  cublas=cublas_version(), bf16_reduced=bool(m.allow_bf16_reduced_precision_reduction))
        with contextlib.suppress(Exception):
            sw["blas"] = str(torch_mod.backends.cuda.preferred_blas_library()).rsplit(".", 1)[-1]
    else:
        with contextlib.suppress(Exception):
            sw["isa"] = torch_mod.backends.cpu.get_cpu_capability()
    return sw


def numerics_digest(torch_mod, t):
    """A result's bits as 32 hex digits: two weighted sums of its elements' bit patterns (int64, wrapping), each
    weight odd, so that any change of one element changes both; integer sums do not depend on the order of
    summation, so the digest is computed where the result is (the GPU) without copying it."""
    flat = t.detach().contiguous().view(-1)
    ints = {2: torch_mod.int16, 4: torch_mod.int32, 8: torch_mod.int64}[flat.element_size()]
    v = flat.view(ints).to(torch_mod.int64)
    i = torch_mod.arange(v.numel(), device=v.device, dtype=torch_mod.int64)
    w1 = ((i * 2654435761 + 97) % 2147483648) | 1
    w2 = ((i * 40503 + 7919) % 1073741824) * 2 + 1
    s = torch_mod.stack([(v * w1).sum(), (v * w2).sum()]).tolist()
    return "".join(f"{x & 0xFFFFFFFFFFFFFFFF:016x}" for x in s)


def _mm64(torch_mod, a, b):
    """The fp64 product that references a check: aten's mm itself, below torch's public operators, so that
    nothing that wraps or patches torch.matmul, torch.mm or @ in this process bends the reference the checks
    are held to (and fp64 runs on other units than the bf16, TF32 and fp32 products it judges)."""
    return torch_mod.ops.aten.mm.default(a.double(), b.double())


def _compare(torch_mod, res, ref, scale, tol):
    """res against the fp64 reference (same shape): the worst element by error over scale -> the check's
    post without its digest: 'err' (worst error / scale), 'tol', 'off' (err > tol), 'abs', 'rel' (abs / |ref|),
    'at' (the element: [i, j] or [i]), 'value' and 'ref' there. A NaN or infinity is off by itself."""
    r = res.double()
    err = (r - ref).abs()
    norm = torch_mod.where(torch_mod.isfinite(r), err / scale, torch_mod.full_like(err, float("inf")))
    k = int(torch_mod.argmax(norm.view(-1)))
    worst, a, v, want = torch_mod.stack([norm.view(-1)[k], err.view(-1)[k], r.view(-1)[k], ref.view(-1)[k]]).tolist()
    at = list(divmod(k, res.shape[-1])) if res.dim() == 2 else [k]
    return {"err": float(f"{worst:.4g}"), "tol": float(f"{tol:.4g}"), "off": not worst <= tol,
            "abs": float(f"{a:.4g}"), "rel": float(f"{a / abs(want):.4g}") if want else None, "at": at,
            "value": float(f"{v:.8g}"), "ref": float(f"{want:.8g}")}


def _post(torch_mod, res, ref, scale, tol):
    return dict(_compare(torch_mod, res, ref, scale, tol), digest=numerics_digest(torch_mod, res))


def numerics_operands(torch_mod, kind):
    """The seeded operands, on the CPU: A (M x K), B (K x N), a bias (N), uniform in [-1, 1) in fp32, the same
    bits on every rank (torch's CPU generator); the elementwise kernel's a, b, c are slices of A and B."""
    m, k, n = NUMERICS_SHAPE[kind]
    g = torch_mod.Generator().manual_seed(NUMERICS_SEED)

    def u(*shape):
        return torch_mod.empty(*shape).uniform_(-1.0, 1.0, generator=g)
    e = NUMERICS_ELEMENTS[kind]
    a, b = u(m, k), u(k, n)
    return a, b, u(n), (a.view(-1)[:e], b.view(-1)[:e], a.view(-1)[e:2 * e])


def numerics_measure(torch_mod, dev, kind):
    """One rank's numerics on its device (kind 'gpu': a CUDA index, on a stream of the caller's thread; 'cpu':
    one thread): every check of NUMERICS_CHECKS but ddp-grad (matmul-tf32 on GPUs with TF32 only), each result
    compared with the fp64 reference of the whole result and reduced to a digest. On GPU the reference is an
    fp64 product on the device, itself checked on a NUMERICS_BLOCK block against the CPU's. -> {'checks':
    {name: post}, 'software': numerics_software(), 'secs'}."""
    t0 = time.monotonic()
    gpu = kind == "gpu"
    a, b, bias, (x, y, z) = numerics_operands(torch_mod, kind)
    k = a.shape[1]
    tf32_forced = os.environ.get("NVIDIA_TF32_OVERRIDE", "").strip() not in ("", "0")
    threads = torch_mod.get_num_threads()
    ctx = contextlib.ExitStack()
    if gpu:
        torch_mod.cuda.set_device(dev)
        ctx.enter_context(torch_mod.cuda.stream(torch_mod.cuda.Stream(dev)))
        device = torch_mod.device("cuda", dev)
    else:
        torch_mod.set_num_threads(1)  # one thread: the same kernels (and bits) on every rank
        device = torch_mod.device("cpu")
    checks = {}

    def check(name, res, ref, scale, k=k):  # each result against its reference, within its own tolerance
        checks[name] = _post(torch_mod, res, ref, scale, numerics_tolerance(name, k, tf32_forced))
    try:
        with ctx, torch_mod.no_grad():
            a32, b32, bias32 = (t.to(device) for t in (a, b, bias))
            a16, b16, bias16 = (t.to(torch_mod.bfloat16) for t in (a32, b32, bias32))
            scale32 = a32.double().norm(dim=1)[:, None] * b32.double().norm(dim=0)[None, :]
            scale16 = a16.double().norm(dim=1)[:, None] * b16.double().norm(dim=0)[None, :]
            ref32, ref16 = _mm64(torch_mod, a32, b32), _mm64(torch_mod, a16, b16)
            refs_ok = _reference_problem(torch_mod, a, b, ref32) if gpu else None
            with fp32_matmul_precision(torch_mod, "highest"):
                check("matmul-bf16", torch_mod.matmul(a16, b16), ref16, scale16)
                wt = b16.t().contiguous()  # F.linear takes the weight as out_features x in_features
                bias64 = bias16.double()[None, :]
                check("linear-bf16", torch_mod.nn.functional.linear(a16, wt, bias16), ref16 + bias64,
                      scale16 + bias64.abs())
                check("matmul-fp32", a32 @ b32, ref32, scale32)
            if gpu and torch_mod.cuda.get_device_capability(dev)[0] >= 8:
                with fp32_matmul_precision(torch_mod, "high"):
                    check("matmul-tf32", a32 @ b32, ref32, scale32)
            ea, eb, ec = (t.to(device) for t in (x, y, z))
            check("elementwise-fp32", torch_mod.addcmul(ec, ea, eb), ec.double() + ea.double() * eb.double(),
                  (ea.double() * eb.double()).abs() + ec.double().abs(), 1)
            if refs_ok:  # the device's own fp64 is off the CPU's: no check of this rank can be believed
                for c in checks.values():
                    c.update(off=True, reference=refs_ok)
        software = numerics_software(torch_mod, dev, kind)
    finally:
        if not gpu:
            torch_mod.set_num_threads(threads)
    return {"checks": checks, "software": software, "secs": round(time.monotonic() - t0, 3)}


def _reference_problem(torch_mod, a, b, ref):
    """GPU: the device's fp64 product on the first NUMERICS_BLOCK rows and columns against the CPU's; None when
    they agree within fp64's own bound, else the words for the finding (the device's fp64 path is wrong too)."""
    blk = NUMERICS_BLOCK
    cpu = _mm64(torch_mod, a[:blk], b[:, :blk])
    dev = ref[:blk, :blk].cpu()
    scale = a[:blk].double().norm(dim=1)[:, None] * b[:, :blk].double().norm(dim=0)[None, :]
    worst = float(((dev - cpu).abs() / scale).max())
    tol = 2 * _gamma(a.shape[1], 2.0 ** -53)
    if worst <= tol:
        return None
    return f"the device's fp64 reference itself is off the CPU's by {worst:.3g} of the scale (bound {tol:.2g})"


def start_numerics(torch_mod, dev, kind, box):
    """numerics_measure into box['numerics'] (or box['numerics_error'], box['numerics_internal']), then
    box['numerics_done'] set: on whatever thread calls it (GPU ranks: the measuring thread, before the
    screen's measurement)."""
    try:
        box["numerics"] = numerics_measure(torch_mod, dev, kind)
    except Exception as e:
        box["numerics_internal" if is_tool_error(e) else "numerics_error"] = first_line(e)
    finally:
        box["numerics_done"].set()


def rank_numerics(torch_mod, dev, kind, box, wait_s):
    """This rank's numerics for its telemetry: from the measuring thread's box (GPU ranks; waited for at most
    wait_s: not in by then is {'unread': seconds}), else measured here (CPU ranks, on the main thread)."""
    if box is None or "numerics_done" not in box:
        box = {"numerics_done": threading.Event()}
        start_numerics(torch_mod, dev, kind, box)
    if not box["numerics_done"].wait(wait_s):
        return {"unread": round(wait_s, 1)}
    if "numerics" in box:
        return box["numerics"]
    if "numerics_internal" in box:
        return {"internal": box["numerics_internal"]}
    return {"error": box["numerics_error"]}
# -- the DDP step's local gradients: nn.Linear(10, 10), the same seeded weights and input on every rank, one
# forward (the module's call: F.linear) and backward on the rank's device, no DDP, before the DDP step; the
# gradients against the fp64 ones from the closed form of the MSE loss's gradient.
DDP_GRAD_SEED = 1234


def ddp_local_grads(torch_mod, dev):
    """-> the check's post: digest of the gradients' bits, worst error against the fp64 gradients."""
    g = torch_mod.Generator().manual_seed(DDP_GRAD_SEED)
    w, b = torch_mod.randn(10, 10, generator=g) * 0.3, torch_mod.randn(10, generator=g) * 0.3
    x, y = torch_mod.randn(16, 10, generator=g), torch_mod.randn(16, 10, generator=g)
    model = torch_mod.nn.Linear(10, 10)
    with torch_mod.no_grad():
        model.weight.copy_(w)
        model.bias.copy_(b)
    model = model.to(dev)
    with fp32_matmul_precision(torch_mod, "highest"):
        loss = torch_mod.nn.functional.mse_loss(model(x.to(dev)), y.to(dev))
        loss.backward()
    got = torch_mod.cat([model.weight.grad.flatten(), model.bias.grad.flatten()]).detach()
    w64, b64, x64, y64 = (t.double() for t in (w, b, x, y))
    n = y.numel()
    d = 2.0 / n * (_mm64(torch_mod, x64, w64.t()) + b64 - y64)  # dL/d(out)
    ref = torch_mod.cat([_mm64(torch_mod, d.t(), x64).flatten(), d.sum(0)])
    mag = 2.0 / n * (_mm64(torch_mod, x64.abs(), w64.abs().t()) + b64.abs() + y64.abs())  # the scale of d's terms
    scale = torch_mod.cat([_mm64(torch_mod, mag.t(), x64.abs()).flatten(), mag.sum(0)])
    tf32_forced = os.environ.get("NVIDIA_TF32_OVERRIDE", "").strip() not in ("", "0")
    return _post(torch_mod, got.cpu(), ref, scale, 4 * numerics_tolerance("ddp-grad", 16, tf32_forced))
# -- the soak's repeats: the same GPU must give the same bits every time, also hot
class NumericsRepeat:
    """--soak: the bf16 and fp32 matmuls of the numerics check made once on the rank's device (first results
    kept), then repeated by tick() at most every NUMERICS_SOAK_EVERY_S between the soak's timed blocks; a
    repeat whose bits differ from the first is counted, the first few with where and by how much."""

    def __init__(self, torch_mod, dev, kind):
        self.torch, self.repeats, self.mismatches, self.first_bad = torch_mod, 0, 0, []
        a, b, _, _ = numerics_operands(torch_mod, kind)
        device = torch_mod.device("cpu") if kind == "cpu" else (
            torch_mod.device("cuda", dev) if isinstance(dev, int) else dev)  # an index or a torch.device
        a32, b32 = a.to(device), b.to(device)
        self.ops = {"matmul-bf16": (a32.to(torch_mod.bfloat16), b32.to(torch_mod.bfloat16)),
                    "matmul-fp32": (a32, b32)}
        self.first = self._run()
        self.digests = {c: numerics_digest(torch_mod, r) for c, r in self.first.items()}
        self.last = time.monotonic()

    def _run(self):
        with self.torch.no_grad(), fp32_matmul_precision(self.torch, "highest"):
            return {c: self.torch.matmul(a, b) for c, (a, b) in self.ops.items()}

    def tick(self, t):
        """Repeat when NUMERICS_SOAK_EVERY_S passed since the last one; t: seconds into the soak."""
        if time.monotonic() - self.last < NUMERICS_SOAK_EVERY_S:
            return
        self.last = time.monotonic()
        self.repeats += 1
        bad = [(c, r) for c, r in self._run().items() if numerics_digest(self.torch, r) != self.digests[c]]
        for c, r in bad[:3 - len(self.first_bad)]:  # the first few, with where and by how much
            diff = (r.double() - self.first[c].double()).abs()
            k = int(self.torch.argmax(diff.view(-1)))
            self.first_bad.append({"t": round(t, 1), "check": c, "abs": float(f"{float(diff.view(-1)[k]):.4g}"),
                                   "at": list(divmod(k, r.shape[-1]))})
        self.mismatches += bool(bad)

    def summary(self):
        return {"numerics_repeats": self.repeats, "numerics_mismatches": self.mismatches,
                "numerics_first_bad": self.first_bad}



# ============================================================================ aiv/screen/measure.py
# Floor 2: what the performance screen and the soak measure: nvidia-smi, the device-timed GPU
# What the performance screen measures (section `screen` judges it). GPU: each measurement runs about
# SCREEN_TARGET_S of timed work after a warm-up, in SCREEN_BLOCKS device-synchronised blocks, and the
# median block counts. CPU (gloo runs, CI): tiny sizes on one thread and the best block, because the
# ranks share cores and only a gross fault can be told from their noise.
SCREEN_TARGET_S = {"gpu": 0.3, "cpu": 0.02}            # seconds of timed work per measurement
SCREEN_BLOCKS = 5
SCREEN_HOLD_S = 0.05      # GPU: the blocks are queued behind a kernel that holds the device this long (gated_blocks),
SCREEN_HOLD_GROWTH = 6    # doubled while the host could not queue them in time, at most this many holds (to 1.6 s)
SCREEN_SWITCH_S = 2e-4    # the interpreter's switch interval while a measurement is captured (quick_switch)
SCREEN_MATMUL_N = {"gpu": 8192, "cpu": 256}            # square matmul: bf16 on GPU, fp32 on CPU
SCREEN_COPY_BYTES = {"gpu": 512 << 20, "cpu": 8 << 20}  # memory: STREAM scale (GPU), copy (CPU); read + write
SCREEN_AR_BYTES = {"gpu": 128 << 20, "cpu": 1 << 20}   # all_reduce message of the busbw rounds
SCREEN_AR_ITERS = {"gpu": (3, 12), "cpu": (1, 8)}      # warm-up and timed iterations (median / best)
SCREEN_SMI_S = 3.0    # nvidia-smi must answer within this while the GPU stays loaded; else no such facts
SMI_FIELDS = ("clocks.sm", "clocks.max.sm", "clocks_throttle_reasons.active", "temperature.gpu", "power.draw")
SMI_KEYS = ("sm_mhz", "sm_max_mhz", "throttle", "temp_c", "power_w")
SMI_RENAMED = {"clocks_throttle_reasons.active": "clocks_event_reasons.active"}  # drivers that dropped the old name


def parse_smi(text, keys=SMI_KEYS):
    """nvidia-smi --format=csv,noheader,nounits for SMI_FIELDS -> {SMI_KEYS: value} (keys: the names of the
    fields asked); [N/A], [Not Supported] and unparsable values are left out, a line of the wrong shape gives {}."""
    line = next((ln for ln in (text or "").splitlines() if ln.strip()), "")
    vals = [v.strip() for v in line.split(",")]
    if len(vals) != len(keys):
        return {}
    out = {}
    for key, v in zip(keys, vals, strict=True):
        with contextlib.suppress(ValueError, KeyError):  # a value of none of these shapes is left out
            out[key] = (int(v, 16) if key == "throttle" else {"yes": True, "no": False}[v.lower()]
                        if key.startswith("remap_") else float(v))
    return out


NODE_SMI_FIELDS = ("uuid", "ecc.errors.uncorrected.volatile.total", "remapped_rows.pending", "remapped_rows.failure")
NODE_SMI_KEYS = ("uuid", "ecc_uncorrected", "remap_pending", "remap_failure")


def parse_node_smi(text):
    """The node's one nvidia-smi answer (NODE_SMI_FIELDS, one line per GPU) -> {uuid: {key: value}}; a line of
    the wrong shape or without a UUID is left out."""
    rows = [[v.strip() for v in line.split(",")] for line in (text or "").splitlines()]
    return {vals[0]: parse_smi(",".join(vals[1:]), NODE_SMI_KEYS[1:]) for vals in rows
            if len(vals) == len(NODE_SMI_KEYS) and vals[0].startswith(("GPU-", "MIG-"))}


def read_node_smi(exe, bound=NODE_SMI_S, box=None):
    """One nvidia-smi call for every GPU of the node (no -i), killed past bound seconds: {'gpus': {uuid: facts}}
    or {'unread': why, 'bound': bound}. The node leader calls it once; rank 0 gives each rank its GPU's row.
    box: where the child is kept (box['proc']) for whoever stops waiting for it earlier."""
    cmd = [exe, "--query-gpu=" + ",".join(NODE_SMI_FIELDS), "--format=csv,noheader,nounits"]
    r = run_bounded(cmd, bound, box, "nvidia-smi")  # its own group: a wrapper's children die too; reaped bounded
    if "unread" in r:
        return {"unread": r["unread"], "bound": bound}
    if r["rc"] != 0:
        why = first_text_line(r["err"] or r["out"])
        return {"unread": f"nvidia-smi exited {r['rc']}" + (f": {why}" if why else ""), "bound": bound}
    return {"gpus": parse_node_smi(r["out"])}


def start_node_smi():
    """Node leaders, at launch: read_node_smi in a thread, off the critical path -> its box, or None where
    nvidia-smi is not on PATH (a node without it pays one PATH lookup)."""
    exe = shutil.which("nvidia-smi")
    if not exe:
        return None
    box = {"t0": time.monotonic(), "done": threading.Event()}

    def run():
        try:
            box["smi"] = read_node_smi(exe, NODE_SMI_S, box)
        except Exception as e:  # the facts are then "not read", never silently absent
            if is_tool_error(e):  # the tool's own error: raised again where the facts are taken
                box["internal"] = e
            else:
                box["smi"] = {"unread": f"nvidia-smi failed: {first_line(e)}", "bound": NODE_SMI_S}
        finally:
            box["done"].set()
    threading.Thread(target=run, name="aiv-node-smi", daemon=True).start()
    return box


def finish_node_smi(box, most_s):
    """The node's nvidia-smi facts for the telemetry: waited for until NODE_SMI_S after its start, and at most
    most_s now; an answer not in by then is {'unread': ..., 'bound': seconds it had}."""
    box["done"].wait(max(0.0, min(most_s, box["t0"] + NODE_SMI_S - time.monotonic())))
    if "internal" in box:
        raise box["internal"]
    if "smi" in box:
        return box["smi"]
    if box.get("proc") is not None:  # not waited for any longer: it does not outlive the run
        with contextlib.suppress(OSError):
            os.killpg(box["proc"].pid, signal.SIGKILL)
    had = time.monotonic() - box["t0"]
    return {"unread": f"nvidia-smi gave no answer within {had:.0f}s", "bound": round(had, 1)}


class SmiProbe:
    """nvidia-smi's view of one GPU, asked in a child process while the caller keeps the GPU loaded:
    clocks, active clock limits, temperature and power. One per rank (not one per node like read_node_smi):
    these facts mean something only while this GPU works, and the ranks of a node load their GPUs at
    slightly different times. No nvidia-smi or a field it does not know (under both names): those facts
    are absent; no answer within SCREEN_SMI_S: {'smi_unread': SCREEN_SMI_S}, which the report shows."""

    def __init__(self, uuid):
        self.exe = shutil.which("nvidia-smi") if uuid else None
        self.uuid, self.proc, self.t0 = uuid, None, time.monotonic()
        self.variants = [SMI_FIELDS, tuple(SMI_RENAMED.get(f, f) for f in SMI_FIELDS)]
        self._start()

    def _start(self):
        self.proc = None
        if self.exe and self.variants:
            cmd = [self.exe, "--query-gpu=" + ",".join(self.variants.pop(0)), "--format=csv,noheader,nounits",
                   "-i", self.uuid]
            with contextlib.suppress(OSError):  # cannot start: those facts are absent
                self.proc = child_start(cmd, stderr=subprocess.DEVNULL)

    def finish(self, load):
        """Call load() (one unit of GPU work, synchronised) until nvidia-smi has answered. -> facts."""
        while self.proc is not None:
            left = SCREEN_SMI_S - (time.monotonic() - self.t0)
            if self.proc.poll() is None and left > 0:
                load()
                continue
            r = child_finish(self.proc, max(0.0, left), "nvidia-smi")
            if "unread" in r:
                return {"smi_unread": SCREEN_SMI_S}
            if r["rc"] == 0:
                return parse_smi(r["out"])
            self._start()
        return {}


def pcie_under_load(root, pci):
    """The GPU's PCIe link read while it works (an idle GPU may train its link down to save power)."""
    link = pci_link(root, pci)
    keys = (("pcie_width", "current_link_width"), ("pcie_width_max", "max_link_width"),
            ("pcie_speed", "current_link_speed"), ("pcie_speed_max", "max_link_speed"))
    return {k: link[f] for k, f in keys if link.get(f) is not None}


def _host_rate(fn, work, during=None):
    """CPU: units of `work` per second of fn() on this thread's own CPU clock (time.thread_time: the ranks
    that share a core do not slow each other's number by taking turns): warm-up, a calibration, then
    SCREEN_BLOCKS blocks of about SCREEN_TARGET_S together, the best one. during() runs once after the middle block."""
    clock = time.thread_time
    fn()
    t = clock()
    fn()
    fn()
    one = max((clock() - t) / 2, 1e-7)
    per_block = max(1, int(SCREEN_TARGET_S["cpu"] / SCREEN_BLOCKS / one))
    times = []
    for i in range(SCREEN_BLOCKS):
        t = clock()
        for _ in range(per_block):
            fn()
        times.append(max(clock() - t, 1e-7))
        if during is not None and i == SCREEN_BLOCKS // 2:
            during()
    return work * per_block / min(times)


class HostStarved(RuntimeError):
    """(torch < 2.9, gated blocks) _device_rate could not queue its blocks within the longest hold of the
    device. On the measuring thread that may be the rank's own other threads holding the interpreter lock
    (screen-gpu then measures again on its quiet main thread); there, it says the node cannot drive its GPU."""


def _capture(torch_mod, stream, body):
    """body()'s CUDA calls as one CUDA graph, captured on `stream` in thread-local mode: the CUDA calls of the
    rank's other threads (NCCL's init among them) go on, neither refused nor captured."""
    graph = torch_mod.cuda.CUDAGraph()
    with torch_mod.cuda.stream(stream):
        graph.capture_begin(capture_error_mode="thread_local")
        try:
            body()
        finally:
            graph.capture_end()
    return graph


def gated_blocks(hold, record, replay, started, blocks=None):
    """Queue `blocks` timed blocks behind a hold, so that the device runs them back to back whatever the host
    does meanwhile: hold() (a kernel that keeps the device busy), then for each block record() (an event),
    replay() (the work, one launch), record(). -> (spans [(start, end)], whether the whole queue was in
    before the device reached the first block: started(first start event) still false). When the host was
    slower than the hold (its other threads held the interpreter lock), the caller holds longer."""
    hold()
    spans = []
    for _ in range(blocks or SCREEN_BLOCKS):
        start = record()
        replay()
        spans.append((start, record()))
    return spans, not started(spans[0][0])


_switch_state = {"depth": 0, "saved": None}
_switch_lock = threading.Lock()


@contextlib.contextmanager
def quick_switch(seconds=SCREEN_SWITCH_S):
    """The interpreter's switch interval lowered to `seconds` while a measurement is captured. A capture is
    a thousand short torch calls, and a call that lets go of the interpreter lock waits for it to come back:
    beside a thread that keeps computing in Python, that is a whole switch interval (5 ms by default) per
    call, seconds per measurement with the GPU idle. Process-wide, restored by the last thread out."""
    with _switch_lock:
        if _switch_state["depth"] == 0:
            _switch_state["saved"] = sys.getswitchinterval()
            sys.setswitchinterval(min(seconds, _switch_state["saved"]))
        _switch_state["depth"] += 1
    try:
        yield
    finally:
        with _switch_lock:
            _switch_state["depth"] -= 1
            if _switch_state["depth"] == 0:
                sys.setswitchinterval(_switch_state["saved"])


def graph_timing(torch_mod):
    """Whether CUDA events can be recorded inside a CUDA graph and timed (torch.cuda.Event(external=True),
    torch >= 2.9): then _device_rate queues a whole measurement with one launch (_graph_rate)."""
    try:
        return "external" in inspect.signature(torch_mod.cuda.Event).parameters
    except (TypeError, ValueError):
        return False


def timed_blocks(fn, k, pairs, record):
    """What _graph_rate captures, in order: a lead block of k calls of fn, untimed (the device's clocks and
    power settle under this very load, whatever the device did before), then for each (start, end) of
    `pairs`: record(start), fn() k times, record(end)."""
    for _ in range(k):
        fn()
    for start, end in pairs:
        record(start)
        for _ in range(k):
            fn()
        record(end)


def _graph_rate(torch_mod, fn, work, stream, during, k, before=None):
    """_device_rate with in-graph timing (timed_blocks, launched once). `before`: a graph replayed just ahead
    of it (the calibration's), so that the device is under this load again when the lead block starts,
    however long the capture kept it idle. -> (rate, the graph)."""
    cuda = torch_mod.cuda
    pairs = [(cuda.Event(enable_timing=True, external=True), cuda.Event(enable_timing=True, external=True))
             for _ in range(SCREEN_BLOCKS)]
    graph = _capture(torch_mod, stream, lambda: timed_blocks(fn, k, pairs, lambda e: e.record(stream)))
    with cuda.stream(stream):
        if before is not None:
            before.replay()
        graph.replay()
    if during is not None:  # while the blocks run
        during()
    pairs[-1][1].synchronize()
    graph.events = pairs  # its event nodes record these on every replay: they live as long as the graph
    return work * k / _screen_median([s.elapsed_time(e) / 1e3 for s, e in pairs]), graph


def _device_rate(torch_mod, fn, work, stream, during=None, k=None):
    """GPU: units of `work` per second of fn(), timed on the device (CUDA events), never on the host's clock,
    so that what the host does meanwhile (this rank's other threads, NCCL's init, the node's imports) cannot
    enter the number: k calls of fn() make a block of about SCREEN_TARGET_S / SCREEN_BLOCKS of work; the
    median of SCREEN_BLOCKS timed blocks counts. Where torch times events inside a graph (graph_timing),
    the whole measurement is one graph and one launch (_graph_rate): the device runs it back to back, so no
    host delay (other threads holding the interpreter lock) can enter or stop it; so is the calibration of k
    (a matmul's rate depends on how long the load lasts: the power cap lowers the clocks within a second, so
    a k shrunk by a stalled host would read a burst rate, ~10% higher on an H100). Before that (torch < 2.9):
    _gated_rate. -> (rate, the graph: one measurement's work, for load under nvidia-smi)."""
    with quick_switch():  # each captured or queued call gets the interpreter back at once
        if not graph_timing(torch_mod):
            return _gated_rate(torch_mod, fn, work, stream, during, k)
        with torch_mod.cuda.stream(stream):
            fn()
            fn()  # warm-up: the cuBLAS handle and workspace, outside any capture
        stream.synchronize()
        before = None
        if k is None:  # calls per second, timed inside a graph too: a host stall cannot shrink k
            per_s, before = _graph_rate(torch_mod, fn, 1.0, stream, None, 2)
            k = max(1, int(SCREEN_TARGET_S["gpu"] / SCREEN_BLOCKS * per_s))
        return _graph_rate(torch_mod, fn, work, stream, during, k, before)


def _gated_rate(torch_mod, fn, work, stream, during, k):
    """_device_rate before torch 2.9: each block one replay of a graph of k calls, all of them queued
    behind a hold (gated_blocks); a host too slow to queue them within the hold gets a hold twice as long,
    up to SCREEN_HOLD_GROWTH times, then HostStarved, never a slow number."""
    cuda = torch_mod.cuda

    def record():
        e = cuda.Event(enable_timing=True)
        e.record(stream)
        return e
    with cuda.stream(stream):
        fn()
        fn()  # warm-up: the cuBLAS handle and workspace, the clocks up
        a = record()
        fn()
        fn()
        b = record()
        cuda._sleep(1 << 20)  # the hold's calibration: cycles per second of this GPU's clock
        c = record()
    c.synchronize()
    if k is None:
        k = max(1, int(SCREEN_TARGET_S["gpu"] / SCREEN_BLOCKS / max(a.elapsed_time(b) / 2e3, 1e-7)))
    cycles = int((1 << 20) * SCREEN_HOLD_S / max(b.elapsed_time(c) / 1e3, 1e-7))
    graph = _capture(torch_mod, stream, lambda: timed_blocks(fn, k, (), None))  # k calls of fn, no timed block
    for _ in range(SCREEN_HOLD_GROWTH):
        with cuda.stream(stream):  # a replay goes to the current stream
            spans, whole = gated_blocks(lambda n=cycles: cuda._sleep(n), record, graph.replay, lambda e: e.query())
        if during is not None:  # while the queued blocks run
            during()
            during = None
        spans[-1][1].synchronize()
        if whole:
            return work * k / _screen_median([s.elapsed_time(e) / 1e3 for s, e in spans]), graph
        cycles *= 2  # the host could not queue the blocks within the hold: hold longer
    raise HostStarved(f"{stream.device}: the host could not queue {SCREEN_BLOCKS} timed blocks within a "
                      f"{SCREEN_HOLD_S * (1 << (SCREEN_HOLD_GROWTH - 1)):g}s hold of the device: its process is "
                      "starved of CPU")


def _mm_operands(torch_mod, dev, kind):
    """The square matmul's a, b, c: bf16 where the GPU has it (Ampere on), else fp16; fp32 on CPU."""
    n, dtype = SCREEN_MATMUL_N[kind], torch_mod.float32
    if kind == "gpu":  # the model's peers run the same
        dtype = torch_mod.bfloat16 if torch_mod.cuda.is_bf16_supported() else torch_mod.float16
    return [torch_mod.randn(n, n, device=dev, dtype=dtype) for _ in range(2)] + [
        torch_mod.empty(n, n, device=dev, dtype=dtype)]


def _screen_operands(torch_mod, dev, kind):
    """The matmul's a, b, c (_mm_operands) and the memory measurement's src, dst (fp32, SCREEN_COPY_BYTES each)."""
    src = torch_mod.ones(SCREEN_COPY_BYTES[kind] // 4, dtype=torch_mod.float32, device=dev)
    return _mm_operands(torch_mod, dev, kind), (src, torch_mod.empty_like(src))


def screen_measure_gpu(torch_mod, dev, kind, uuid=None, pci=None, root="/"):
    """One rank's device speed: {'tflops': dense matmul (_mm_operands), 'hbm_gbps': memory copy (read +
    write)}. GPU: _measure_device, with the facts read under load; CPU: on one thread, timed on its CPU
    clock (_host_rate)."""
    if kind == "gpu":
        return _measure_device(torch_mod, dev, uuid, pci, root)
    (a, b, c), (src, dst) = _screen_operands(torch_mod, dev, kind)
    threads = torch_mod.get_num_threads()
    torch_mod.set_num_threads(1)
    try:
        tflops = _host_rate(lambda: torch_mod.mm(a, b, out=c), 2 * SCREEN_MATMUL_N[kind] ** 3 / 1e12)
        hbm = _host_rate(lambda: dst.copy_(src), 2 * src.numel() * 4 / 1e9)
    finally:
        torch_mod.set_num_threads(threads)
    return {"tflops": float(f"{tflops:.4g}"), "hbm_gbps": float(f"{hbm:.4g}")}


def _measure_device(torch_mod, dev, uuid, pci, root):
    """screen_measure_gpu on a GPU: the matmul and the copy each timed on the device by _device_rate on a
    stream of the caller's own (so it may run on a thread of its own while the rank waits), and the facts
    read under load (GPU_FACT_KEYS: the PCIe link from sysfs; nvidia-smi's clocks, limits, temperature, power
    while the matmul's graph keeps the GPU loaded, where it answers in time, else 'smi_unread')."""
    cuda, facts, graphs = torch_mod.cuda, {}, []
    cuda.set_device(dev)  # a thread's own current device (the measuring thread's too)
    stream = cuda.Stream(dev)
    (a, b, c), (src, dst) = _screen_operands(torch_mod, dev, "gpu")
    stream.wait_stream(cuda.current_stream(dev))  # made on this thread's default stream: ready before use
    probe = SmiProbe(uuid)  # started now: it samples while the matmul runs

    def load():  # one block of matmuls, synchronised: the GPU stays loaded until nvidia-smi answers
        with cuda.stream(stream):
            graphs[0].replay()
        stream.synchronize()
    try:
        tflops, g = _device_rate(torch_mod, lambda: torch_mod.mm(a, b, out=c), 2 * SCREEN_MATMUL_N["gpu"] ** 3 / 1e12,
                                 stream, (lambda: facts.update(pcie_under_load(root, pci))) if pci else None)
        graphs.append(g)
        smi = probe.finish(load)
        # STREAM's scale (dst = 1.0 x src): a kernel, read + write counted; a captured copy_ would be a graph
        # memcpy node, which the copy engines run well below the bandwidth of the GPU's own kernels
        hbm, g = _device_rate(torch_mod, lambda: torch_mod.mul(src, 1.0, out=dst), 2 * src.numel() * 4 / 1e9, stream)
        graphs.append(g)
        stream.synchronize()
    finally:
        a = b = c = src = dst = g = None
        del graphs[:]  # the operands and each graph's memory pool go back to the driver
        cuda.empty_cache()
    return {"tflops": float(f"{tflops:.4g}"), "hbm_gbps": float(f"{hbm:.4g}"), **facts, **smi}


def start_screen_gpu(torch_mod, dev, uuid=None, pci=None, root="/", screen=True, numerics=True):
    """GPU ranks, from the end of their local checks: on a thread of its own, first the numerics check
    (start_numerics: box['numerics'], read by rank_numerics at the telemetry), then screen_measure_gpu, while the
    rank waits at the roll call and in init (the device keeps the time, so the host's work in those waits cannot
    enter it) -> the box that take_screen_gpu reads in screen-gpu. screen, numerics: which of the two to run."""
    box = {"done": threading.Event(), "t0": time.monotonic()}
    if numerics:
        box["numerics_done"] = threading.Event()

    def run():
        try:
            if numerics:
                start_numerics(torch_mod, dev, "gpu", box)
            if screen:
                box["row"] = screen_measure_gpu(torch_mod, dev, "gpu", uuid, pci, root)
        except BaseException as e:  # raised again in screen-gpu, on the rank's own thread
            box["error"] = e
        finally:
            box["secs"] = round(time.monotonic() - box["t0"], 3)
            box["done"].set()
    threading.Thread(target=run, name="aiv-screen-gpu", daemon=True).start()
    return box


def take_screen_gpu(box):
    """The measurement of start_screen_gpu, waited for (screen-gpu's bound covers a device that hangs), or its error."""
    box["done"].wait()
    if "error" in box:
        raise box["error"]
    return box["row"]


def can_split(torch_mod, dist):
    """Whether torch.distributed.split_group (torch >= 2.6) can split the default NCCL group (its
    backend supports splitting); else the screen enumerates every group with new_subgroups_by_enumeration."""
    return split_problem(torch_mod, dist) is None


def split_problem(torch_mod, dist):
    """Why the screen cannot split the default NCCL group (can_split), in words, or None when it can."""
    version = getattr(torch_mod, "__version__", "?")
    if not hasattr(dist, "split_group"):
        return f"torch {version} has no split_group"
    try:
        pg = dist.distributed_c10d._get_default_group()
        if pg._get_backend(torch_mod.device("cuda")).supports_splitting:
            return None
    except Exception as e:
        return f"torch {version} cannot split its NCCL group ({first_line(e)})"
    return f"torch {version}'s NCCL backend cannot split a communicator (NCCL older than 2.18?)"


def screen_busbw(torch_mod, dist, group, nranks, dev, kind):
    """all_reduce bus bandwidth of one group as nccl-tests defines it (busbw = algbw x 2(n-1)/n, GB/s =
    1e9 B/s) at SCREEN_AR_BYTES: warm-up, then each iteration timed device-synchronised; the median
    iteration on GPU, the best on CPU. -> (busbw, seconds per iteration)."""
    sync = (lambda: None) if kind == "cpu" else (lambda: torch_mod.cuda.synchronize(dev))
    warm, iters = SCREEN_AR_ITERS[kind]
    size = SCREEN_AR_BYTES[kind]
    x = torch_mod.zeros(size // 4, dtype=torch_mod.float32, device=dev)
    for _ in range(warm):
        dist.all_reduce(x, group=group)
    sync()
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        dist.all_reduce(x, group=group)
        sync()
        times.append(time.perf_counter() - t)
    sec = _screen_median(times) if kind == "gpu" else min(times)
    return size / sec / 1e9 * 2 * (nranks - 1) / nranks, sec


# -- the soak (--soak SECONDS): every GPU under sustained matmul at once, its TFLOPS timed in blocks and
# its telemetry sampled from a thread of its own, so that a slow NVML or nvidia-smi never stalls the load.
# Section `screen` judges the rows (judge_soak).
SOAK_BLOCK_S = {"gpu": 0.25, "cpu": 0.05}  # one timed block of matmuls, device-synchronised
SOAK_WINDOW_BLOCKS = 8   # a window: the median (GPU) or best (CPU) of this many blocks (fewer in a short soak)
SOAK_SAMPLE_S = 1.0      # telemetry period: NVML (nvidia-ml-py), else nvidia-smi in a child bounded by SCREEN_SMI_S
SOAK_WINDOWS_MAX = 64    # at most this many windows kept per GPU (longer soaks: wider windows)
SOAK_TELEMETRY = ("sm_mhz", "sm_max_mhz", "throttle", "temp_c", "power_w")


def nvml_reader(uuid):
    """A function reading one GPU's SOAK_TELEMETRY through NVML (nvidia-ml-py's pynvml), each value
    skipped where NVML refuses it; None when pynvml is missing or does not know the GPU."""
    try:
        import pynvml
        pynvml.nvmlInit()
        h = pynvml.nvmlDeviceGetHandleByUUID(uuid)
    except Exception:
        return None
    reasons = (getattr(pynvml, "nvmlDeviceGetCurrentClocksEventReasons", None)
               or getattr(pynvml, "nvmlDeviceGetCurrentClocksThrottleReasons", None))
    calls = (("sm_mhz", lambda: pynvml.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_SM)),
             ("sm_max_mhz", lambda: pynvml.nvmlDeviceGetMaxClockInfo(h, pynvml.NVML_CLOCK_SM)),
             ("temp_c", lambda: pynvml.nvmlDeviceGetTemperature(h, pynvml.NVML_TEMPERATURE_GPU)),
             ("power_w", lambda: pynvml.nvmlDeviceGetPowerUsage(h) / 1000.0),
             ("throttle", lambda: reasons(h)))

    def read():
        out = {}
        for key, call in calls:
            with contextlib.suppress(Exception):
                out[key] = call()
        return out
    return read


class SoakSampler:
    """One GPU's telemetry every SOAK_SAMPLE_S while the soak runs, from a daemon thread that also opens
    the source (so that not even NVML's start can stall the load): NVML where pynvml is importable and
    knows the GPU, else nvidia-smi (SmiProbe, each call within SCREEN_SMI_S), else nothing (source None;
    always on CPU, where uuid is None). stop() waits at most SCREEN_SMI_S + 1 s for the thread."""

    def __init__(self, uuid):
        self.uuid, self.source, self.samples, self.t0 = uuid, None, [], time.monotonic()
        self._stop, self.thread = threading.Event(), None
        if uuid:
            self.thread = threading.Thread(target=self._loop, name="aiv-soak-sampler", daemon=True)
            self.thread.start()

    def _reader(self):
        read = nvml_reader(self.uuid)
        if read:
            self.source = "nvml"
            return read
        if shutil.which("nvidia-smi"):
            self.source = "nvidia-smi"
            return lambda: SmiProbe(self.uuid).finish(lambda: time.sleep(0.05))
        return None

    def _loop(self):
        read = self._reader()
        while read and not self._stop.is_set():
            t = time.monotonic()
            s = {k: v for k, v in (read() or {}).items() if k in SOAK_TELEMETRY and v is not None}
            if s:
                self.samples.append(dict(s, t=round(t - self.t0, 2)))
            self._stop.wait(max(0.0, SOAK_SAMPLE_S - (time.monotonic() - t)))

    def stop(self):
        self._stop.set()
        if self.thread is not None:
            self.thread.join(SCREEN_SMI_S + 1.0)
        return list(self.samples)


def soak_windows(blocks, cpu=False):
    """TFLOPS of consecutive blocks -> (window size in blocks, one value per window: the median of its
    blocks on GPU, the best on CPU). Up to SOAK_WINDOW_BLOCKS blocks a window, at least 4 windows where
    there are 4 blocks; the window widens past SOAK_WINDOWS_MAX windows; a partial last window is
    joined to the window before."""
    n = len(blocks)
    if not n:
        return 0, []
    w = max(1, min(SOAK_WINDOW_BLOCKS, n // 4), math.ceil(n / SOAK_WINDOWS_MAX))
    chunks = [blocks[i:i + w] for i in range(0, n - w + 1, w)]
    if n % w and len(chunks) > 1:
        chunks[-1] = chunks[-1] + blocks[len(chunks) * w:]
    pick = max if cpu else _screen_median
    return w, [float(f"{pick(c):.4g}") for c in chunks]


def soak_summary(samples):
    """A soak's telemetry samples -> the row's fields: samples, max temperature, min/max SM clock, the
    rated max SM clock, max power, the clock-event reasons seen (OR of the masks) and per reason name the
    count of samples that showed it."""
    out = {"samples": len(samples)}
    for key, k, f in (("temp_max_c", "temp_c", max), ("sm_min_mhz", "sm_mhz", min), ("sm_max_seen_mhz", "sm_mhz", max),
                      ("sm_rated_mhz", "sm_max_mhz", max), ("power_max_w", "power_w", max)):
        v = [float(s[k]) for s in samples if s.get(k) is not None]
        out[key] = round(f(v), 1) if v else None
    masks = [int(s["throttle"]) for s in samples if s.get("throttle") is not None]
    seen = functools.reduce(int.__or__, masks, 0)
    out["throttle_seen"] = seen if masks else None
    out["throttle_reasons"] = throttle_names(seen)
    out["throttle_counts"] = {n: sum(n in throttle_names(m) for m in masks) for n in throttle_names(seen)}
    return out


def soak_measure(torch_mod, dev, kind, seconds, uuid=None, start=None, numerics=True):
    """One rank's soak: square matmul (bf16 on GPU, fp16 before Ampere, fp32 on one CPU thread) in blocks
    of about SOAK_BLOCK_S for `seconds`, while SoakSampler reads the GPU. start(): called once the
    operands are made and warm, before the timed load (the gate that starts every GPU together).
    numerics: between timed blocks, the numerics check's matmuls repeated against their first result
    (NumericsRepeat). -> the row judge_soak takes (without the rank's record facts)."""
    cpu = kind == "cpu"
    sync = (lambda: None) if cpu else (lambda: torch_mod.cuda.synchronize(dev))
    threads = torch_mod.get_num_threads()
    if cpu:
        torch_mod.set_num_threads(1)
    try:
        a, b, c = _mm_operands(torch_mod, dev, kind)
        n, dtype = SCREEN_MATMUL_N[kind], c.dtype

        def mm(calls):  # `calls` matmuls, synchronised -> their seconds
            t = time.perf_counter()
            for _ in range(calls):
                torch_mod.mm(a, b, out=c)
            sync()
            return time.perf_counter() - t
        mm(2)
        per_block = max(1, int(SOAK_BLOCK_S[kind] / max(mm(2) / 2, 1e-7)))
        repeat = NumericsRepeat(torch_mod, dev, kind) if numerics else None
        if start is not None:
            start()
        sampler = SoakSampler(None if cpu else uuid)
        blocks, t0 = [], time.perf_counter()
        try:
            while time.perf_counter() - t0 < seconds:
                blocks.append(2 * n ** 3 * per_block / 1e12 / max(mm(per_block), 1e-9))
                if repeat is not None:  # between timed blocks: never inside a block's time
                    repeat.tick(time.perf_counter() - t0)
            loaded = time.perf_counter() - t0
        finally:
            samples = sampler.stop()
    finally:
        if cpu:
            torch_mod.set_num_threads(threads)
        else:
            with contextlib.suppress(Exception):
                del a, b, c
                torch_mod.cuda.empty_cache()
    w, windows = soak_windows(blocks, cpu)
    return {"dtype": str(dtype).replace("torch.", ""), "seconds": round(loaded, 2), "blocks": len(blocks),
            "window_s": round(loaded * w / max(len(blocks), 1), 2),
            "tflops_windows": windows, "tflops_first": windows[0] if windows else None,
            "tflops_last": windows[-1] if windows else None, "telemetry": sampler.source,
            **soak_summary(samples), **(repeat.summary() if repeat is not None else {})}



# ============================================================================ aiv/checks/numerics.py
# Floor 3: how the numerics check (silent data corruption) is judged: every rank's results (numerics_measure)
NUMERICS_LIST_MAX = 16       # beyond this many culprits, one finding lists the first ones and a count
NUMERICS_ACTION = ("drain it and run the vendor's diagnostics before it returns to service (DCGM level 3: "
                   "dcgmi diag -r 3)")
NUMERICS_CPU_ACTION = "drain it and run the vendor's CPU and memory diagnostics before it returns to service"


def numerics_group(model, software, driver=None, cpu_model=None):
    """The words that name "the same model and software": results in one group must agree bit for bit."""
    sw = software or {}
    if sw.get("sms") is not None:
        head = f"{model} ({sw['sms']} SMs, compute {sw.get('cc')})"
        soft = (f"torch {sw.get('torch')}, CUDA {sw.get('cuda')}, cuBLAS {sw.get('cublas') or '?'}, driver "
                f"{driver or '?'}" + (f", BLAS {sw['blas']}" if sw.get("blas") else "")
                + ("" if sw.get("bf16_reduced", True) else ", bf16 reductions in fp32"))
    else:
        head = f"CPU {cpu_model or model or '?'} ({sw.get('isa') or '?'})"
        soft = f"torch {sw.get('torch')}"
    return f"{head}; {soft}" + "".join(f", {k}={v}" for k, v in sorted((sw.get("env") or {}).items()))


def numerics_rows(records, posts=None, field="numerics"):
    """judge_numerics' rows from the gathered records: each rank's post (posts: rank -> post, else the record's
    own `field`), with its host, GPU (UUID, CUDA index, model) and group (numerics_group; the driver and the
    CPU model from its node's facts). Ranks without a post are left out."""
    node = {rec.get("host"): rec["node"] for rec in records if isinstance(rec.get("node"), dict)}
    rows = []
    for rec in sorted(records, key=lambda r: r["rank"]):
        post = (posts or {}).get(rec["rank"]) if posts is not None else rec.get(field)
        if not isinstance(post, dict):
            continue
        g, facts = rec.get("gpu") or {}, node.get(rec.get("host")) or {}
        model = g.get("name") or "CPU"
        rows.append({"rank": rec["rank"], "host": rec.get("host"), "local_rank": rec.get("local_rank"),
                     "device": rec.get("device"), "uuid": g.get("uuid"), "model": model,
                     "group": numerics_group(model, post.get("software"), facts.get("driver"), facts.get("cpu_model")),
                     "checks": post.get("checks") or {}, "error": post.get("error"),
                     "internal": post.get("internal"), "unread": post.get("unread")})
    return rows


def _who(r):
    if r.get("uuid") or r.get("device") is not None:
        return (f"rank {r['rank']} on {r.get('host')} (GPU {r.get('uuid') or 'UUID unknown'}, cuda:{r.get('device')}, "
                f"local rank {r.get('local_rank')}, {r.get('model')})")
    return f"rank {r['rank']} on {r.get('host')} (CPU)"


def _ranks_words(rows, limit=8):
    by = group_by(rows, lambda r: r.get("host"), lambda r: r["rank"])
    parts = [f"rank(s) {format_ranges(v)} ({h})" for h, v in list(by.items())[:limit]]
    return ", ".join(parts) + (f" and {len(by) - limit} more node(s)" if len(by) > limit else "")


def _n(x):
    return "?" if x is None else f"{x:.3g}"


def _off_words(c, p, detail_only=False):
    """Check c of a rank off the fp64 reference: by how much and where (detail_only: that alone), and why its
    reference is not believed."""
    at = ", ".join(map(str, p.get("at") or []))
    ratio = _n((p.get("err") or 0) / p["tol"]) if p.get("tol") else "?"
    detail = (f"max abs error {_n(p.get('abs'))} at element ({at}) ({_n(p.get('value'))} where fp64 gives "
              f"{_n(p.get('ref'))}: rel {_n(p.get('rel'))}, {ratio}x the tolerance)")
    return detail if detail_only else (f"{c} ({NUMERICS_WHAT.get(c, c)}) is off the fp64 reference: {detail}"
                                       + (f"; {p['reference']}" if p.get("reference") else ""))


def _check_order(names):
    return sorted(names, key=lambda c: (NUMERICS_CHECKS.index(c) if c in NUMERICS_CHECKS else 99, c))


def _numerics_bits(c, on, culprits):
    """Check c among the ranks `on` the reference: a strict majority of bits names the minority (added to
    culprits). -> the classes {digest: rows} where there is no majority (a tie), else None."""
    by = group_by(on, lambda r: r["checks"][c].get("digest"))
    top = max(by.values(), key=len, default=[])
    if len(by) > 1 and 2 * len(top) <= len(on):
        return by
    for r in [r for rs_ in by.values() if rs_ is not top for r in rs_]:
        culprits.setdefault(r["rank"], (r, []))[1].append(_bits_words(c, r, len(top)))
    return None


def _numerics_tie(group, c, by, culprits):
    """No majority on check c: explained when every class but one holds only culprits (the others' bits
    are then named against it), else one FAIL naming the ranks that disagree, no host blamed (or None)."""
    clean = [d for d, rs_ in by.items() if not all(r["rank"] in culprits for r in rs_)]
    if len(clean) == 1:
        for r in [r for d, rs_ in by.items() if d != clean[0] for r in rs_]:
            culprits[r["rank"]][1].append(_bits_words(c, r, len(by[clean[0]])))
        return None
    ranks = [r for rs_ in by.values() for r in rs_]
    return finding("numerics", "FAIL", f"{len(ranks)} rank(s) of {group} disagree bit for bit on {c} "
                   f"({NUMERICS_WHAT.get(c, c)}): {len(by)} distinct results ("
                   + " | ".join(_ranks_words(rs_) for rs_ in by.values())
                   + ") and none is off the fp64 reference beyond the tolerance: one of them computes wrong "
                   "and this run cannot tell which (no majority): run dcgmi diag -r 3 on "
                   f"{compress_hostlist(sorted({r.get('host') for r in ranks}))}, or rerun with a third "
                   "device of the model; no host blamed", ranks=[r["rank"] for r in ranks], blame="tie")


def judge_numerics(rows, stage="numerics check"):
    """The numerics findings (check 'numerics') of rows [{'rank', 'host', 'local_rank', 'device', 'uuid', 'model',
    'group', 'checks': {check: {'digest', 'off', 'err', 'tol', 'abs', 'rel', 'at', 'value', 'ref'}}, 'error',
    'internal', 'unread'}] (numerics_rows). Within a group (one model and one software) every result must have
    the same bits, and every result must lie within the tolerance of the fp64 reference. Per check and group:
      - every rank of a group of two or more off the reference: ONE finding about the model or the software,
        no host blamed (the same fault everywhere is not a host's);
      - the only rank of its group off the reference: FAIL naming it, no host blamed (the GPU cannot be told
        from the software with nothing to compare);
      - otherwise each rank off the reference is a culprit, and among the others a strict majority of bits
        names the minority; with no majority (two ranks, a tie), the ranks already culprits by another check
        explain the disagreement, else one FAIL names the ranks that disagree, no host blamed.
    A rank whose check raised a torch error FAILs (its host); the tool's own error is `internal`; a check not
    finished in time WARNs. -> findings; a PASS when every result agrees."""
    rows = sorted(rows or [], key=lambda r: r["rank"])
    if not rows:
        return []
    out, culprits, groups = [], {}, {}
    for r in rows:
        if unjudged := _numerics_unjudged(r, stage):
            out.append(unjudged)
        elif r.get("checks"):
            groups.setdefault(r["group"], []).append(r)
    ties = []
    for group, rs in groups.items():
        for c in _check_order({c for r in rs for c in r["checks"]}):
            have = [r for r in rs if c in r["checks"]]
            off = [r for r in have if r["checks"][c].get("off")]
            if off and len(off) == len(have):
                out.append(_numerics_all_off(group, c, have, off))
                continue
            for r in off:
                culprits.setdefault(r["rank"], (r, []))[1].append(_off_words(c, r["checks"][c]))
            if tie := _numerics_bits(c, [r for r in have if not r["checks"][c].get("off")], culprits):
                ties.append((group, c, tie))
    # after every check: a tie is explained by culprits of any check
    out += filter(None, [_numerics_tie(group, c, by, culprits) for group, c, by in ties])
    out += _numerics_culprits(culprits, stage)
    if not out:
        out.append(_numerics_pass(groups, stage))
    return out


def _numerics_unjudged(r, stage):
    """The finding of a row whose numbers could not be judged (the tool's error, a torch error on its device,
    a check not finished in time), or None."""
    if r.get("internal"):
        return finding("internal", "FAIL", f"{_who(r)}: the {stage} failed: {r['internal']}: a bug in the "
                       "tool, not a fault of the cluster: no host is blamed", code=EXIT_INTERNAL)
    if r.get("error"):
        return finding("numerics", "FAIL", f"{_who(r)}: the {stage} could not run on its device: "
                       f"{r['error']}: {NUMERICS_ACTION}", [r.get("host")], [r["rank"]], blame="own")
    if r.get("unread") is not None:
        return unlocalised(finding("numerics", "WARN", f"{_who(r)}: the {stage} did not finish within "
                                   f"{r['unread']:g}s: its numbers were not checked", [r.get("host")], [r["rank"]]),
                           "not-collected", "a re-run: the numbers checked in time name their host if wrong")
    return None


def _numerics_all_off(group, c, have, off):
    """Every rank of a group off the reference on check c: the lone rank of its group, or one finding about
    the model or the software; no host blamed."""
    worst = max(off, key=lambda r: r["checks"][c].get("err") or 0)
    p = worst["checks"][c]
    if len(have) == 1:
        return finding("numerics", "FAIL", f"{_who(worst)}: {_off_words(c, p)}; the only rank of its model and "
                       f"software ({group}) in this run, so its device cannot be told from the software: run dcgmi "
                       f"diag -r 3 on {worst.get('host')}, or run with a second device of the model; no host blamed",
                       ranks=[worst["rank"]], blame="tie")
    same = len({r["checks"][c].get("digest") for r in have}) == 1
    return finding("numerics", "FAIL", f"every one of the {len(have)} rank(s) of {group} computes "
                   f"{c} ({NUMERICS_WHAT.get(c, c)}) off the fp64 reference"
                   + (" with the same bits" if same else ", and their bits differ")
                   + f" (worst: {_ranks_words([worst])}: {_off_words(c, p, True)}): a fault of the software "
                   "(torch, CUDA, cuBLAS, driver) or of the model, not of a host: no host blamed; "
                   "report it with this line, and try another software version",
                   ranks=[r["rank"] for r in have], blame="everyone")


def _numerics_culprits(culprits, stage):
    """One FAIL per culprit rank {rank: (row, [what it got wrong])}, at most NUMERICS_LIST_MAX, then one for
    the rest."""
    out = []
    items = sorted(culprits.values(), key=lambda x: x[0]["rank"])
    for r, texts in items[:NUMERICS_LIST_MAX]:
        action = NUMERICS_ACTION if r.get("uuid") or r.get("device") is not None else NUMERICS_CPU_ACTION
        out.append(finding("numerics", "FAIL", f"{_who(r)} computes wrong numbers in the {stage}: "
                           + "; ".join(texts) + f": {action}", [r.get("host")], [r["rank"]],
                           blame=_culprit_blame(texts)))
    if len(items) > NUMERICS_LIST_MAX:
        rest = [r for r, _ in items[NUMERICS_LIST_MAX:]]
        out.append(finding("numerics", "FAIL", f"and {len(rest)} more rank(s) compute wrong numbers in the {stage}: "
                           f"{_ranks_words(rest)}: see the JSON's ranks[].numerics", [r.get("host") for r in rest],
                           [r["rank"] for r in rest],
                           blame=_culprit_blame([t for _, ts in items[NUMERICS_LIST_MAX:] for t in ts])))
    return out


def _culprit_blame(texts):
    """The evidence a culprit's texts stand on: off the fp64 reference its peers meet ('reference'), else bits
    unlike a strict majority of its peers ('majority')."""
    return "reference" if any("off the fp64 reference" in t for t in texts) else "majority"


def _numerics_pass(groups, stage):
    """The PASS of groups {group: [rows]} that agree and lie within the tolerance."""
    judged = [r for rs in groups.values() for r in rs]
    names = _check_order({c for r in judged for c in r["checks"]})
    worst = max((r["checks"][c].get("err") or 0) / r["checks"][c]["tol"] for r in judged for c in r["checks"]
                if r["checks"][c].get("tol"))
    return finding("numerics", "PASS", f"{stage}: {len(judged)} rank(s) in {len(groups)} group(s) of model "
                   f"and software agree bit for bit on {', '.join(names)}, each within the tolerance of "
                   f"the fp64 reference (worst {worst:.2g} of it)")


def _bits_words(c, r, agree):
    p = r["checks"][c]
    ratio = _n((p.get("err") or 0) / p["tol"]) if p.get("tol") else "?"
    return (f"{c} ({NUMERICS_WHAT.get(c, c)}): its bits differ from those of the {agree} other rank(s) of its model "
            f"and software, which agree; its largest deviation from fp64 is {_n(p.get('abs'))} at element "
            f"({', '.join(map(str, p.get('at') or []))}), within the tolerance ({ratio} of it)")


def judge_numerics_records(records):
    """judge_numerics of the telemetry's numerics (the records gathered at telemetry), [] when no rank has one."""
    return judge_numerics(numerics_rows(records))


def judge_ddp_grads(records, results):
    """judge_numerics of the DDP step's local gradients (each rank's results['grads_local'], posted with its
    results), [] when no rank checked them."""
    software = {rec["rank"]: (rec.get("numerics") or {}).get("software") for rec in records}
    posts = {res["rank"]: {"checks": {"ddp-grad": res["grads_local"]}, "software": software.get(res["rank"])}
             for res in results or [] if isinstance(res.get("grads_local"), dict)}
    return judge_numerics(numerics_rows(records, posts), "DDP step's local backward (before the all-reduce)")


def judge_numerics_soak(rows):
    """--soak: a rank whose repeats of the numerics under load differed from its own first result FAILs under
    'numerics' (an intermittent fault), naming it; every rank that repeated differing: one finding without a
    host (the software is not deterministic). rows: the soak's rows (judge_soak's) with numerics_repeats,
    numerics_mismatches, numerics_first_bad. [] when no row repeated."""
    done = [r for r in rows or [] if r.get("numerics_repeats")]
    if not done:
        return []
    bad = [r for r in done if r.get("numerics_mismatches")]
    if not bad:
        return [finding("numerics", "PASS", f"soak: {sum(r['numerics_repeats'] for r in done)} repeat(s) of the "
                        f"bf16 and fp32 matmuls on {len(done)} rank(s) under sustained load, each identical to its "
                        "own first result")]

    def first(r):
        fb = (r.get("numerics_first_bad") or [{}])[0]
        return (f"first at {fb.get('t')}s: {fb.get('check')}, max abs difference {_n(fb.get('abs'))} at element "
                f"({', '.join(map(str, fb.get('at') or []))})") if fb else "no detail"
    if len(bad) == len(done) > 1:
        return [finding("numerics", "FAIL", f"soak: every one of the {len(done)} rank(s) gave results under sustained "
                        f"load whose bits differ from its own first result ({_ranks_words(bad)}; {first(bad[0])}): "
                        "the software is not deterministic here, not a host's fault: no host blamed",
                        ranks=[r["rank"] for r in bad], blame="everyone")]
    return [finding("numerics", "FAIL", f"{_who(r)}: under sustained load (--soak) {r['numerics_mismatches']} of "
                    f"{r['numerics_repeats']} repeat(s) of its matmuls differed from its own first result "
                    f"({first(r)}): an intermittent fault: {NUMERICS_ACTION}", [r.get("host")], [r["rank"]],
                    blame="own") for r in bad]



# ============================================================================ aiv/checks/hang.py
# Floor 3: who is behind in a phase that did not finish, from plain data: the last collective each rank
# What a late rank was doing when rank 0 asked, per group (issued_states):
#   behind   outside any collective, and it never issued one that a peer of the group issued: the rank
#            itself stopped the group (evidence "never-issued")
#   waiting  inside a collective call (its own record says so: every call passes RankRun.issuing; torch's
#            recorder does not always mark a finished gloo collective completed): it waits for its peers
#   idle     outside any collective, every collective its peers issued issued too
#   between  outside any collective for less than BETWEEN_S: between two calls, not stopped (a snapshot of a
#            rank that is progressing, one call behind its peers for microseconds, is no evidence)
#   unposted no post came back within ISSUED_S (alive, but its record was not collected)
ISSUED_STATES = ("behind", "waiting", "idle", "between", "unposted")
BETWEEN_S = 1.0  # a rank outside any collective call for less than this is between two calls
# a rank behind its peers, by how (hang.issued_states' 'how'): outside any collective; inside the call but its
# backend never saw it (its recorder lacks what its peers' recorders hold); its entry scheduled, never started
BEHIND_WORDS = {None: "alive, outside any collective; numbered by {src}",
                "unseen": "alive, inside the collective call but its backend never saw it: torch's flight recorder "
                          "holds it on its peers, not on this rank",
                "unstarted": "alive, its entry stayed scheduled in torch's flight recorder while its peers' started"}


def ranks_text(ranks):
    """[0, 2, 3, 4] -> '0, 2-4'."""
    return format_ranges(ranks).replace(",", ", ")


def group_key(ranks):
    """The key of a process group in a rank's issued record: its ranks, '0-15' (the world's too)."""
    return format_ranges(ranks)


def own_completed(post, key):
    """How many collectives a rank's own record says it finished on the group `key` (its set-up, number 0, not
    counted): the last one's number when it finished, else one fewer."""
    last = ((post or {}).get("own") or {}).get(key)
    if not last or not isinstance(last[1], int):
        return 0
    return last[1] if last[2] else last[1] - 1


def recorder_live(post, key):
    """Whether torch's flight recorder is live on this rank for the group `key`: it could be read, and it holds
    the group's collectives if the rank's own record says it finished one there (a recorder switched off or
    overwritten holds nothing where the rank did finish collectives: then it is no evidence)."""
    fr = post.get("fr")
    return isinstance(fr, dict) and (fr.get(key) is not None or own_completed(post, key) == 0)


def issued_source(posts, ranks, key=None):
    """'recorder' when torch's flight recorder is live on every rank of `ranks` that posted (recorder_live) and
    holds entries of the group on at least one of them (then its sequence numbers are comparable across them,
    and a rank whose recorder lacks what its peers' hold never issued it to its backend), else 'own' (each
    rank's own record of what it issued). Without a key: whether every posting rank's recorder held entries."""
    got = [posts[r] for r in ranks if posts.get(r) is not None]
    if key is None:
        return "recorder" if got and all(p.get("fr") for p in got) else "own"
    held = any((p.get("fr") or {}).get(key) for p in got)
    return "recorder" if got and held and all(recorder_live(p, key) for p in got) else "own"


def issued_last(post, key, source):
    """[op, seq, done(, state)] of the last collective a rank issued on the group `key` (None: none), from
    `source` (the recorder's entries carry its state: scheduled, started, completed)."""
    last = ((post.get("fr") if source == "recorder" else post.get("own")) or {}).get(key)
    return list(last) if last else None


def _late_state(post, x, front, source, started):
    """One late rank's place (ISSUED_STATES) and, when it is behind on the recorder's evidence although its own
    record says it is inside the call, how: 'unseen' (its backend never saw the collective its peers' recorders
    hold) or 'unstarted' (its entry stayed scheduled while a peer's started)."""
    inside = post.get("inflight")
    lags = front is not None and (x is None or x[1] < front)  # behind the furthest collective a peer issued
    idle_brief, inside_brief = (s is not None and s < BETWEEN_S for s in (post.get("idle_s"), post.get("inflight_s")))
    if source == "recorder" and lags:
        if not inside:
            return ("between", None) if idle_brief else ("behind", None)
        return ("between", None) if inside_brief else ("behind", "unseen")
    if source == "recorder" and inside and x and x[1] == front and started and len(x) > 3 and \
            x[3] == "scheduled" and not inside_brief:
        return "behind", "unstarted"
    if inside:  # its own record: the main thread is inside a collective call right now
        return "waiting", None
    if idle_brief:
        return "between", None
    return ("behind", None) if lags else ("idle", None)


def issued_states(ranks, posts, late, key):
    """The group `key` of `ranks`, from each rank's post ({rank: post or None}; a post: {'own': {key: [op, seq,
    done]}, 'fr': the same from torch's flight recorder with its state, {} when it holds nothing of this
    rank's groups, None when it cannot be read, 'inflight': key of the collective call the rank's main thread
    is inside, or None, 'inflight_s': for how long, 'idle_s': seconds since it left its last call}). A rank's
    place comes from `source` (issued_source); whether it is inside a call, from its own record (_late_state).
    -> {'source', 'key', 'front': [op, seq] of the furthest collective a rank issued (None: none), 'issuers':
    ranks that issued it, 'last': {rank: [op, seq, done(, state)] or None}, 'states': {rank: one of
    ISSUED_STATES} for the late ranks, 'how': {rank: 'unseen'|'unstarted'} of the behind ranks that are inside
    the call}."""
    source = issued_source(posts, ranks, key)
    last = {r: issued_last(posts[r], key, source) for r in ranks if posts.get(r) is not None}
    front = max((x[1] for x in last.values() if x), default=None)
    fop = next((x[0] for x in last.values() if x and x[1] == front), None)
    started = any(x and x[1] == front and len(x) > 3 and x[3] in ("started", "completed") for x in last.values())
    places = {r: _late_state(posts[r], last.get(r), front, source, started) if posts.get(r) is not None
              else ("unposted", None) for r in late}
    states = {r: s for r, (s, _) in places.items()}
    how = {r: h for r, (_, h) in places.items() if h}
    issuers = sorted(r for r, x in last.items() if x and x[1] == front and how.get(r) != "unstarted")
    return {"source": source, "key": key, "front": None if front is None else [fop, front], "issuers": issuers,
            "last": last, "states": states, "how": how}


def op_text(front):
    """['all_reduce', 3] -> 'all_reduce #3'; the process group's own set-up has no number."""
    op, seq = front
    return op if not seq else f"{op} #{seq}"


def on_hosts(ranks, host_of, limit=16):
    """'rank 1 (node2)' or 'ranks 4-7 (node2), 9 (node3)'; at most `limit` hosts, then a count."""
    by_host = group_by(sorted(ranks), lambda r: host_of.get(r, "?"))
    items = [f"{format_ranges(rs)} ({h})" for h, rs in list(by_host.items())[:limit]]
    more = f" and {len(by_host) - limit} more node(s)" if len(by_host) > limit else ""
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(items) + more


def never_issued_text(behind, an, host_of):
    """The greppable words for ranks that never issued a collective their peers issued:
    'rank 1 (n1) never issued all_reduce #3 that ranks 0, 2-15 issued'; a rank whose entry stayed scheduled
    while its peers' started: 'rank 1 (n1) never started all_reduce #3 that ranks 0, 2-15 started'."""
    who = "rank" if len(an["issuers"]) == 1 else "ranks"
    how = an.get("how") or {}
    by_verb = group_by(behind, lambda r: "started" if how.get(r) == "unstarted" else "issued")
    return "; ".join(f"{on_hosts(by_verb[verb], host_of)} never {verb} {op_text(an['front'])} that {who} "
                     f"{ranks_text(an['issuers'])} {verb}" for verb in ("issued", "started") if verb in by_verb)


def never_finished_text(ranks, phase, finished, host_of):
    """'rank 1 (n1) never finished its part of screen-gpu that ranks 0, 2-3 finished' (a phase whose work
    is each rank's own: the others did theirs and wait)."""
    who = "rank" if len(finished) == 1 else "ranks"
    return f"{on_hosts(ranks, host_of)} never finished its part of {phase} that {who} {ranks_text(finished)} finished"


def unlocalised_record(why, localise):
    """The finding's record of a FAIL that names no host: why, and what would localise it."""
    return {"why": why, "localise": localise}


def unlocalised_words(u):
    return f"no host is named: {u['why']}; to localise it: {u['localise']}"


RERUN_HINT = ("a re-run (a rank that again never issues or finishes its part is named), or py-spy dump --pid "
              "<pid> on the hosts above (where each rank's main thread is)")
LINK_HINT = ("a re-run with one end left out (sbatch --exclude=<node>): a hang that follows a node is that node's, "
             "one that stays with the other nodes is the fabric's; NCCL_DEBUG=INFO names the peer whose "
             "connection failed")
FABRIC_HINT = ("the screen's pair results (inter-node rows above), or a re-run with NCCL_DEBUG=INFO (NCCL's WARN "
               "lines name the peer whose connection failed)")


# -- NCCL's own view: its RAS service (NCCL >= 2.24; JSON from 2.28.7), read by rank 0 beside ours
def ras_world(ras, world):
    """The job's world communicator in a RAS STATUS document (size == world, the one listing most ranks), or
    None. Any other shape (not a document, communicators not a list, ranks not a list) is no communicator."""
    comms = (ras or {}).get("communicators") if isinstance(ras, dict) else None
    comms = [c for c in comms if isinstance(c, dict) and c.get("size") == world] if isinstance(comms, list) else []
    return max(comms, key=lambda c: len(_items(c.get("ranks"))), default=None)


def _items(value):
    """A list in NCCL's document, else nothing (a reply of another shape is never trusted)."""
    return value if isinstance(value, list) else []


def _obj(value):
    return value if isinstance(value, dict) else {}


def _rank_of(entry):
    """An entry's int rank (a bool, a string, a missing rank: None)."""
    r = entry.get("rank") if isinstance(entry, dict) else None
    return r if isinstance(r, int) and not isinstance(r, bool) and r >= 0 else None


def ras_rank_states(comm):
    """{rank: {'state': 'present'|'missing', 'count': collectives issued (sum of collective_counts) or None,
    'error': async_error or abort_flag seen, 'dead': RAS considers it dead, 'unresponsive'}} of one
    communicator, and the number of entries of a shape NCCL does not write (no int rank, a status or counts
    that is not an object): those are skipped, never guessed. -> (states, skipped)."""
    out, skipped = {}, 0
    for r in _items(comm.get("ranks")):
        rank, st, counts = _rank_of(r), _obj(_obj(r).get("status")), _obj(r).get("collective_counts")
        if rank is None or (counts is not None and not isinstance(counts, dict)):
            skipped += 1
            continue
        total = sum(v for v in counts.values() if isinstance(v, int) and not isinstance(v, bool)) if counts else None
        out[rank] = {"state": "present", "count": total, "init": st.get("init_state"),
                     "error": bool(st.get("async_error")) or bool(st.get("abort_flag"))}
    for r in _items(comm.get("missing_ranks")):
        rank = _rank_of(r)
        if rank is None:
            skipped += 1
            continue
        st = _obj(r.get("status"))
        out[rank] = {"state": "missing", "dead": bool(st.get("considered_dead")),
                     "unresponsive": bool(st.get("unresponsive"))}
    return out, skipped


def _nccl_word(s, top):
    """NCCL's word for one rank: 'absent' (not in RAS's reply), 'missing', 'error', 'behind' (fewer collectives
    than top), or 'ok'."""
    if s is None:
        return "absent"
    if s["state"] == "missing":
        return "missing"
    if s["error"]:
        return "error"
    if top is not None and s.get("count") is not None and s["count"] < top:
        return "behind"
    return "ok"


def nccl_view(ras, world, host_of, kinds, named):
    """NCCL's view beside ours (never decides the verdict). ras: {'ok': True, 'data': STATUS JSON} or {'ok':
    False, 'why': ...}; kinds: {rank: our word for it: 'dead'|'frozen'|'silent'|'behind'|'waiting'|...};
    named: the ranks our finding names. -> {'read': bool, 'why'?, 'agree': bool|None, 'ranks': {rank: {'ours',
    'nccl', 'agree'}}, 'nccl_version', 'words'}. Per rank NCCL says 'missing' (RAS lost it: dead or
    unresponsive), 'error' (an async error or abort on it), 'behind' (fewer collectives than the most any rank
    of the communicator issued), or 'ok'; ours 'named' for a rank we name by its process, else 'behind'
    (never issued), else 'ok'. They agree where both say the rank stopped the job or both say it did not."""
    if not isinstance(ras, dict) or not ras.get("ok"):
        why = str(_obj(ras).get("why") or "not read")
        return {"read": False, "why": why, "agree": None, "ranks": {},
                "words": f"NCCL's own view (RAS) not read: {why}"}
    data = ras.get("data") if isinstance(ras.get("data"), dict) else {}
    version = data.get("nccl_version") if isinstance(data.get("nccl_version"), str) else None
    head = f"NCCL's own view (RAS{', NCCL ' + version if version else ''})"
    comm = ras_world(data, world)
    states, skipped = ras_rank_states(comm) if comm is not None else ({}, 0)
    if not states:
        why = (f"RAS listed no communicator of the job's {world} rank(s)" if comm is None else
               f"RAS listed the job's communicator with no rank it could read ({skipped} entr(ies) of another shape)")
        return dict({"read": True, "why": why, "agree": None, "ranks": {}, "nccl_version": version},
                    **({} if comm is None else {"skipped": skipped}), words=f"{head}: {why}")
    top = max((s["count"] for s in states.values() if s.get("count") is not None), default=None)
    rows = {}
    for r in range(world):
        s, ours = states.get(r), kinds.get(r, "ok")
        nccl, ours = _nccl_word(s, top), ours if ours in ("dead", "frozen", "silent", "behind") else "ok"
        agree = (r in named or ours != "ok") == (nccl in ("missing", "error", "behind")) or nccl == "absent"
        rows[r] = {"ours": ours, "nccl": nccl, "agree": agree, "count": (s or {}).get("count")}
    differ = sorted(r for r, x in rows.items() if not x["agree"])
    marked = sorted(r for r, x in rows.items() if x["nccl"] != "ok" and x["nccl"] != "absent")
    if differ:
        parts = [f"{on_hosts([r], host_of)}: ours {rows[r]['ours']}, NCCL's {rows[r]['nccl']}" for r in differ[:8]]
        words = f"{head} differs on {len(differ)} rank(s): " + "; ".join(parts) + (" ..." if len(differ) > 8 else "")
    elif marked:
        words = f"{head} agrees: " + "; ".join(f"{on_hosts([r], host_of)} {rows[r]['nccl']}" for r in marked[:8])
    else:
        counts = f"each issued {top} collective(s)" if top is not None else "no counts"
        words = f"{head} agrees: no rank missing, in error or behind ({counts})"
    if skipped:
        words += f"; {skipped} entr{'y' if skipped == 1 else 'ies'} of its reply not of NCCL's shape skipped"
    return {"skipped": skipped, "read": True, "agree": not differ, "ranks": {str(r): x for r, x in rows.items()},
            "nccl_version": version, "missing": [r for r, x in rows.items() if x["nccl"] == "missing"],
            "hosts": compress_hostlist(sorted({host_of.get(r, "?") for r in marked})) if marked else "",
            "words": words}



# ============================================================================ aiv/checks/judge.py
# Floor 3: pure checks of plain data -> findings (PASS / WARN / FAIL with hosts and ranks), and who is
def _by_host(records):
    return group_by(records, lambda r: r["host"])


def _rank_str(r):
    return f"rank {r['rank']} ({r['host']})"


def judge_world_size(world_size, expect):
    want = expect.get("world_size")
    if want not in (None, world_size):
        return [finding("world-size", "FAIL", f"WORLD_SIZE={world_size} but {want} ranks were expected")]
    said = "(no expectation set)" if want is None else "as expected"
    return [finding("world-size", "PASS", f"WORLD_SIZE={world_size} {said}")]


def stray_reason(rank, world, world0, first):
    """Why a process that checked in is not a rank of rank 0's run (None: it is one). first: the
    'pid P on HOST' that claimed this rank before it (None: its claim came first)."""
    if world != world0 or rank >= world0:
        beyond = f"RANK={rank} is not a rank of rank 0's world of {world0}" if rank >= world0 else ""
        other = f"it was launched with WORLD_SIZE={world}, rank 0 with WORLD_SIZE={world0}" if world != world0 else ""
        return "world-size", "; ".join(x for x in (beyond, other) if x)
    if first is not None:
        return "rendezvous", f"RANK={rank} is claimed twice: first by {first}"
    return None


def judge_strays(strays, hosts=()):
    """One FAIL per process refused at the roll call (stray_reason): the launch started a process that
    is not a rank of this run. A second claim of a rank names the stray's host (its own process: 'own'). A
    process launched with another WORLD_SIZE than rank 0's is unlike rank 0, which may be the odd one itself:
    its host is named only when the strays' hosts are a strict minority of every host seen (hosts: the run's,
    from the roll call); else no host is named."""
    out, seen = [], set(hosts) | {x["host"] for x in strays}
    odd = {x["host"] for x in strays if x["check"] == "world-size"}
    kind = minority_kind(odd, seen) if odd else "majority"
    for x in sorted(strays, key=lambda x: (x["rank"], x["host"], x["pid"])):
        f = finding(x["check"], "FAIL", f"a process with RANK={x['rank']} (pid {x['pid']} on {x['host']}) "
                    f"joined the roll call but is not a rank of this run: {x['why']}; two launches share "
                    f"MASTER_ADDR:MASTER_PORT, or the launcher gave out RANK/WORLD_SIZE wrong",
                    [x["host"]], [x["rank"]], blame="own" if x["check"] != "world-size" else "majority")
        out.append(f if x["check"] != "world-size" or kind == "majority" else unlocalised(
            f, kind, "the launch's WORLD_SIZE on every node (rank 0's node may be the odd one)"))
    return out

def forged_what(key, claim):
    """What a refused store value claimed to be, in words (the claim is quoted, never believed)."""
    try:
        c = json.loads(claim)
    except ValueError:
        c = None
    c = c if isinstance(c, dict) else {}
    kind, _, rest = key.partition("/")
    who = f" claiming rank {c['rank']}" if "rank" in c else ""
    if "/" not in rest and kind in ("screen", "posts"):  # one round's or one phase's post
        return f"a screen post{who} in round {rest}" if kind == "screen" else f"a {rest} post{who}"
    host = f" (claiming host {c['host']})" if c.get("host") else ""
    words = {"id": f"a record for rank {rest}{host}", "stamp": f"a progress stamp for rank {rest}",
             "live": f"a liveness post for node {rest}", "errors": f"an error report{who}",
             "gate": f"rank 0's gate {rest}", "ack": f"an acknowledgement for rank {rest}",
             "verdict": f"the verdict (claiming exit code {claim[:8]})", "world": "the world record",
             "who": f"a claim on rank {rest} ({claim[:80]})", "strays": f"a stray's record{who}",
             "node": f"the rank list of node {rest}", "all_arrived": "the roll call's all-arrived mark",
             "forged": "a report of a refused value", "screen": f"the screen plan {rest}"}
    return words.get(kind, f"the value of {key}")


def judge_forged(forged, master, limit=4):
    """One FAIL per store value that was refused (Seal): something outside the job wrote to the store, or
    a rank runs without the job's secret. Tamper findings name no host, and while one stands nobody is
    excluded: the run's own evidence came through that store (Coordinator.state)."""
    unsigned = ", or a rank of this job was started without its AIV_JOB_SECRET"
    out = [dict(finding("rendezvous", "FAIL", f"{forged_what(e['key'], e.get('claim') or '')} {e['why']}: something "
                        f"outside the job writes to MASTER_PORT ({master})"
                        f"{unsigned if 'unsigned' in e['why'] else ''}; no host is excluded on this run's evidence"),
                tamper=True) for e in forged[:limit]]
    if len(forged) > limit:
        out[-1]["reason"] += f" ({len(forged) - limit} more refused value(s) not shown)"
    return out


def judge_channel(authenticated, nodes, master):
    """Whether the side channel was authenticated: PASS with the job's secret, WARN without one on more
    than one node (anything that reaches MASTER_PORT could write the roll call and the verdict)."""
    if authenticated:
        return [finding("rendezvous", "PASS", "side channel authenticated: every value on the store carried the "
                        "job's secret (HMAC-SHA256) and this run's id")]
    if nodes > 1:
        return [finding("rendezvous", "WARN", f"side channel not authenticated: AIV_JOB_SECRET is not set, so "
                        f"anything that reaches MASTER_PORT ({master}) can write the roll call, the culprits and "
                        "the verdict; submit_smoke_test.sbatch sets one, under torchrun export one "
                        "(docs/launchers.md)")]
    return []


def judge_store_peers(peers, allowed, authenticated, master):
    """Connections to rank 0's store from an address that is no node of the run (peers, allowed: IP
    strings): WARN when every value is authenticated anyway, FAIL (no host excluded) when not."""
    outside = sorted(set(peers) - set(allowed))
    if not outside:
        return []
    what = (f"{len(outside)} connection source(s) to the store at {master} outside the run's nodes: "
            f"{', '.join(outside[:8])}{' ...' if len(outside) > 8 else ''}")
    if authenticated:
        return [finding("rendezvous", "WARN", f"{what}; the side channel is authenticated, so nothing they wrote "
                        "was believed")]
    return [dict(finding("rendezvous", "FAIL", f"{what}; the side channel is not authenticated (AIV_JOB_SECRET "
                         "unset), so what they wrote cannot be told from the run's own records; no host is excluded "
                         "on this run's evidence"), tamper=True)]


def judge_layout(records, expect):
    """Nodes count, ranks per node, local ranks 0..k-1 exactly once on every node. How the launcher placed
    the ranks is not a node's fault: the findings name no host (evidence 'launch')."""
    out = []
    hosts = _by_host(records)
    for host, rs in sorted(hosts.items()):
        locs = sorted(r["local_rank"] for r in rs)
        if locs != list(range(len(rs))):
            dups = sorted({x for x in locs if locs.count(x) > 1})
            gaps = sorted(set(range(len(rs))) - set(locs))
            what = "; ".join(f"{w} {format_ranges(xs)}" for w, xs in (("duplicate", dups), ("missing", gaps)) if xs)
            out.append(unlocalised(finding("layout", "FAIL", f"node {host} has local ranks "
                                           f"{','.join(map(str, locs))} ({what}), expected 0..{len(rs) - 1} once "
                                           "each", [host], [r["rank"] for r in rs]), "launch"))
    want_nodes = expect.get("nodes")
    if want_nodes is not None and want_nodes != len(hosts):
        out.append(finding("layout", "FAIL", f"{len(hosts)} node(s) reported ({compress_hostlist(sorted(hosts))}) "
                           f"but {want_nodes} were expected"))
    rpn = expect.get("ranks_per_node")
    out += [unlocalised(finding("layout", "FAIL", f"node {host} runs {len(rs)} ranks but {rpn} per node were "
                                "expected", [host], [r["rank"] for r in rs]), "launch")
            for host, rs in sorted(hosts.items()) if rpn is not None and len(rs) != rpn]
    counts = "/".join(map(str, sorted({len(rs) for rs in hosts.values()})))
    return out or [finding("layout", "PASS", f"{len(hosts)} node(s) x {counts} rank(s), local ranks 0..k-1 once on "
                           "every node")]


def judge_gpu_affinity(records):
    """No two ranks anywhere on one physical GPU (UUIDs are globally unique). A node that binds two ranks
    to one GPU is named when it is unlike a strict majority of the nodes (its own configuration); when most
    nodes do it, the launch does: FAIL, no host named."""
    gpu_recs = [r for r in records if r.get("gpu")]
    if not gpu_recs:
        return []
    out, seen = [], group_by(gpu_recs, lambda r: r["gpu"].get("uuid") or f"{r['host']}/{r['gpu'].get('pci')}")
    shared = [rs for _, rs in sorted(seen.items()) if len(rs) > 1]
    kind = minority_kind({r["host"] for rs in shared for r in rs}, {r["host"] for r in gpu_recs})
    for rs in shared:
        g = rs[0]["gpu"]
        f = finding("gpu-affinity", "FAIL", f"{' and '.join(_rank_str(r) for r in rs)} share one GPU "
                    f"{g.get('uuid') or '?'} (pci {g.get('pci') or '?'}, cuda:{rs[0].get('device')}, "
                    f"CUDA_VISIBLE_DEVICES={rs[0].get('cvd')})", [r["host"] for r in rs], [r["rank"] for r in rs],
                    blame="majority")
        out.append(f if kind == "majority" else unlocalised(
            f, kind, "the launch's GPU binding (--gpus-per-task, CUDA_VISIBLE_DEVICES) on every node"))
    return out or [finding("gpu-affinity", "PASS", f"{len(gpu_recs)} rank(s) on {len(seen)} distinct GPU(s)")]


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
                               [r["host"]], [r["rank"]], blame="own"))
    return out


def _spread(values):
    """{value: [hosts]} -> 'v1 on h[1-2]; v2 on h3'."""
    return "; ".join(f"{v} on {compress_hostlist(sorted(hs))}" for v, hs in sorted(values.items(), key=str))


def _differs(check, sev, text, values, localise=None, records=()):
    """A finding that `text` differs across nodes (values: {value: hosts}): the nodes unlike a strict majority
    named (evidence 'majority'; their ranks among `records`), or with no majority (a tie) one finding naming no host."""
    odd, kind = odd_ones(values)
    f = finding(check, sev, f"{text}: {_spread(values)}", odd, [r["rank"] for r in records if r["host"] in odd],
                blame="majority")
    return f if kind == "majority" else unlocalised(f, kind, localise)


def _node_facts_unread(records):
    """{host: why} of nodes whose facts were not collected (the node leader's facts carry an error)."""
    return {r["host"]: r["node"]["error"] for r in records
            if isinstance(r.get("node"), dict) and r["node"].get("error")}


VERSION_FIELDS = (("torch", "FAIL", lambda r: r["versions"]["torch"]),
                  ("CUDA", "FAIL", lambda r: r["versions"]["cuda"]),
                  ("NCCL", "FAIL", lambda r: r["versions"]["nccl"]),
                  ("GPU model", "FAIL", lambda r: (r.get("gpu") or {}).get("name")),
                  ("driver", "FAIL", lambda r: (r.get("node") or {}).get("driver")),
                  ("python", "WARN", lambda r: r["versions"]["python"]),
                  ("OS", "WARN", lambda r: (r.get("node") or {}).get("os")),
                  ("kernel", "WARN", lambda r: (r.get("node") or {}).get("kernel")))
NODE_VERSION_FIELDS = ("driver", "OS", "kernel")  # from the node leader's facts: absent where not collected


def judge_versions(records):
    """Software stack identical across nodes: FAIL for torch/CUDA/NCCL/driver/GPU model, WARN for the rest.
    The nodes unlike a strict majority are named; a tie names none (with two nodes, which is right cannot be
    told: an accepted --manifest decides). A node whose facts were not collected is left out of the node
    fields (a WARN says so), never compared as 'None'."""
    out, unread = [], _node_facts_unread(records)
    for label, sev, get in VERSION_FIELDS:
        values = {}
        for r in records:
            if label not in NODE_VERSION_FIELDS or (r.get("node") and r["host"] not in unread):
                values.setdefault(str(get(r)), set()).add(r["host"])
        if len(values) > 1:
            out.append(_differs("versions", sev, f"{label} differs across nodes", values,
                                "an accepted --manifest (docs/manifest.md), or a run with a third node of the class"))
    if unread:
        out.append(unlocalised(finding("versions", "WARN", f"driver, OS and kernel not compared on "
                                       f"{compress_hostlist(sorted(unread))}: the node facts were not collected ("
                                       f"{next(iter(unread.values()))})", sorted(unread)), "not-collected"))
    if not any(f["status"] == "FAIL" for f in out):
        v = records[0]["versions"]
        nodes = {r["host"] for r in records}
        where = "on all nodes" if not unread else \
            f"on the {len(nodes - set(unread))} of {len(nodes)} node(s) compared"
        driver = next(((r.get("node") or {}).get("driver") for r in records
                       if r.get("node") and r["host"] not in unread), None)
        out.insert(0, finding("versions", "PASS", f"torch {v['torch']}, CUDA {v['cuda'] or '-'}, NCCL "
                              f"{v['nccl'] or '-'}, driver {driver or '-'} identical {where}"))
    return out


def judge_imports(records):
    """torchvision / torchaudio import on every node (a WARN naming the node where not: its own state), at one
    version across nodes (WARN: the nodes unlike a strict majority)."""
    out, versions = [], {name: {} for name in PROBED_PACKAGES}
    for r in records:
        imp = (r.get("node") or {}).get("imports") or {}
        for name in PROBED_PACKAGES:
            st = imp.get(name)
            if st and not st.get("ok"):
                what = "is not installed" if _import_state(st) == "missing" else "does not import"
                out.append(finding("imports", "WARN", f"{name} {what} on {r['host']}: {st.get('error')}",
                                   [r["host"]], blame="own"))
            elif st:
                versions[name].setdefault(str(st.get("version")), set()).add(r["host"])
    return out + [_differs("versions", "WARN", f"{name} differs across nodes", values)
                  for name, values in versions.items() if len(values) > 1]


def judge_fabric(records, ib_hca=None):
    """IB ports (those NCCL_IB_HCA names, when set) ACTIVE and at their siblings' rate (WARN, the node's own
    state); a node's rate, or its having IB ports at all, unlike a strict majority of the nodes (WARN)."""
    out = []
    nodes = {r["host"]: r["node"] for r in records if r.get("node")}
    with_ib = {h: ps for h, n in nodes.items() if (ps := ib_hca_select(ib_hca, n.get("ib") or []))}
    if not with_ib:
        return [finding("fabric", "PASS", "no InfiniBand ports on any node (sockets only)")] if nodes else []
    node_max = {h: max((p["rate_gbps"] or 0) for p in ps) for h, ps in with_ib.items()}
    for h, ps in sorted(with_ib.items()):
        for p in ps:
            if p["state"] != "ACTIVE":
                out.append(finding("fabric", "WARN", f"{h} {p['port']} is {p['state']}", [h], blame="own"))
            elif (p["rate_gbps"] or 0) < node_max[h]:
                out.append(finding("fabric", "WARN", f"{h} {p['port']} runs at {p['rate_gbps']:g} Gb/s, "
                                   f"below {node_max[h]:g} Gb/s of its sibling ports", [h], blame="own"))
    rates = group_by(node_max, lambda h: f"{node_max[h]:g} Gb/s")
    if len(rates) > 1:
        out.append(_differs("fabric", "WARN", "the fastest InfiniBand port's rate differs across nodes", rates))
    missing = sorted(set(nodes) - set(with_ib))
    if missing:
        out.append(_differs("fabric", "WARN", "InfiniBand ports present on some nodes only",
                            {"present": set(with_ib), "absent": set(missing)}))
    n = sum(len(ps) for ps in with_ib.values())
    return out or [finding("fabric", "PASS", f"{n} InfiniBand port(s) ACTIVE at {max(node_max.values()):g} Gb/s on "
                           f"{len(with_ib)} node(s)")]


SHM_MIN = 1 << 30          # NCCL's SHM transport needs more than a container's 64 MiB default
GPU_BUSY_MIN = 2 << 30     # memory already used on a GPU before we allocate (our context is ~0.5 GiB)


def judge_day0(records):
    """The basics that break NCCL in practice (WARN, each the node's own state)."""
    out = []
    per_host = {h: len(rs) for h, rs in _by_host(records).items()}
    for r in records:
        n, h = r.get("node"), r["host"]
        g = r.get("gpu") or {}
        if g.get("mem_used") is not None and g["mem_used"] > GPU_BUSY_MIN:
            out.append(finding("day0", "WARN", f"{_rank_str(r)}: {human_bytes(g['mem_used'])} of GPU "
                               f"{g.get('pci')} already in use by other processes", [h], [r["rank"]], blame="own"))
        if not n:
            continue
        has_ib = any(p["state"] == "ACTIVE" for p in n.get("ib") or [])
        if has_ib and n.get("memlock") != "unlimited":
            out.append(finding("day0", "WARN", f"{h}: locked-memory limit is {human_bytes(n.get('memlock'))}, "
                               f"not unlimited (ulimit -l); RDMA registration can fail", [h], blame="own"))
        if n.get("shm") is not None and n["shm"] < SHM_MIN and per_host.get(h, 1) > 1:
            out.append(finding("day0", "WARN", f"{h}: /dev/shm is {human_bytes(n['shm'])}, below "
                               f"{human_bytes(SHM_MIN)}; NCCL's shared-memory transport can fail", [h], blame="own"))
        if has_ib and g and not n.get("peermem"):
            out.append(finding("day0", "WARN", f"{h}: InfiniBand present but nvidia_peermem is not loaded "
                               f"(no GPUDirect RDMA)", [h], blame="own"))
    return out + judge_node_smi(records)


def judge_node_smi(records):
    """A WARN per node whose GPU facts from its one nvidia-smi call (node.smi) were not read: no answer within
    its bound (NODE_SMI_S), an error, or no row for a rank's GPU. It names the node, the GPUs (index, UUID,
    rank), what was not read and the bound: facts never read are never a silent PASS, and never blame a host
    (evidence 'not-collected')."""
    out = []
    for h, rs in sorted(_by_host(records).items()):
        if not (smi := next((r["node"].get("smi") for r in rs if r.get("node")), None)):
            continue
        gpus = sorted((r for r in rs if (r.get("gpu") or {}).get("uuid")), key=lambda r: r["local_rank"])
        missing = gpus if smi.get("unread") else [r for r in gpus if r["gpu"]["uuid"].startswith("GPU-")
                                                  and r["gpu"]["uuid"] not in (smi.get("gpus") or {})]
        if not smi.get("unread") and not missing:
            continue
        who = ", ".join(f"GPU {r['local_rank']} ({r['gpu']['uuid']}, rank {r['rank']})" for r in missing[:4]) + (
            f" and {len(missing) - 4} more" if len(missing) > 4 else "")
        if smi.get("unread"):
            bound = f"{smi.get('bound', NODE_SMI_S):g}s"
            text = (f"{h}: {smi['unread']}" + ("" if bound in smi["unread"] else f" (bound {bound})")
                    + f": {NODE_SMI_WHAT} not read for {who or 'its GPUs'}; a slow nvidia-smi is often NVML "
                    f"starting without persistence mode (nvidia-smi -pm 1, or nvidia-persistenced)")
        else:
            text = f"{h}: nvidia-smi listed no row for {who}: {NODE_SMI_WHAT} not read"
        out.append(unlocalised(finding("day0", "WARN", text, [h], [r["rank"] for r in (missing or rs)]),
                               "not-collected", "a re-run once nvidia-smi answers on the node"))
    return out


def judge_local(records):
    """The local checks each rank ran before any communication; one finding per distinct
    reason (ranks of one host that share a misconfiguration are named together). A local check is the
    rank's own state on its host (evidence 'own')."""
    merged = group_by((f for r in records for f in r.get("local") or [] if f["status"] != "PASS"),
                      lambda f: (f["check"], f["status"], f["reason"]))
    return [dict(fs[0], blame=fs[0].get("blame") or "own", ranks=sorted({x for f in fs for x in f["ranks"]}))
            for fs in merged.values()]


def judge_device_use(records):
    """One backend on every rank (the nodes unlike a strict majority named); with gloo asked for explicitly,
    say which GPUs were not exercised."""
    seen = {b: set(hs) for b, hs in group_by(records, lambda r: r.get("backend"), lambda r: r["host"]).items()}
    if len(seen) > 1:
        return [_differs("device", "FAIL", "ranks chose different backends", seen, records=records)]
    unused = {r["host"]: r["gpus_expected"] for r in records if r.get("backend") == "gloo" and r.get("gpus_expected")
              and not any(f["check"] == "device" for f in r.get("local") or [])}
    if unused:
        return [finding("device", "PASS", f"backend gloo as asked: GPUs present on {compress_hostlist(sorted(unused))} "
                        f"({next(iter(unused.values()))}) were not exercised")]
    return []


def judge_gloo_address(records):
    """A multi-node gloo run whose chosen address is loopback cannot connect across nodes (FAIL: the nodes
    unlike a strict majority named, none when most or all nodes do it); else say which interface and address
    gloo uses on each node."""
    gl = [r for r in records if r.get("backend") == "gloo" and r.get("gloo")]
    if not gl:
        return []
    hosts = {r["host"] for r in records}
    machines = {r.get("loopback") or r["host"] for r in records}  # node names sharing one loopback are one
    loop = {r["host"]: r["gloo"] for r in gl if r["gloo"]["loopback"]}
    if len(machines) > 1 and loop:
        g = next(iter(loop.values()))
        f = finding("interface", "FAIL", f"gloo would use the loopback address {g['addr']} on "
                    f"{compress_hostlist(sorted(loop))} ({g['how']}) in a {len(hosts)}-node run: set "
                    f"GLOO_SOCKET_IFNAME to the interface that reaches the other nodes, or map the hostname "
                    f"to that interface's address", sorted(loop), [r["rank"] for r in gl if r["host"] in loop],
                    blame="majority")
        kind = minority_kind(loop, hosts)
        return [f if kind == "majority" else unlocalised(f, kind, "GLOO_SOCKET_IFNAME for every node")]
    used = group_by(gl, lambda r: f"{r['gloo']['iface']}({r['gloo']['addr']})", lambda r: r["host"])
    return [finding("interface", "PASS", "gloo uses " + _spread({k: set(v) for k, v in used.items()}))]


NO_TORCH = ("the python this launch ran cannot import torch (no venv, the wrong python, PYTORCH_ENV unset): the "
            "job's environment, not a fault of a node", "bootstrap_env.sh, or the job pointed at the shared venv "
            "(PYTORCH_ENV); a node is named only when it alone, of several, cannot import what a strict majority "
            "of the job's nodes import")


def judge_no_torch(reports, imported_hosts, nodes=None):
    """The ranks whose python could not import torch ({rank: {'line', 'host'}}, their reports at the roll call)
    among the hosts whose ranks did (imported_hosts); nodes: the job's node count where the launch says it. Their
    hosts are named (`majority`, exit 1) only when a strict majority of the job's nodes imported torch; else exit 2,
    no host (a rank alone: imported_hosts empty)."""
    ranks = sorted(reports)
    bad = {reports[r].get("host") or "?" for r in ranks}
    good, hl = set(imported_hosts) - bad, compress_hostlist(sorted(bad))
    total = max(len(good | bad), int(nodes or 0))
    line = reports[ranks[0]]["line"].split("; no host is named:")[0] if ranks else ""  # judged alone, it said so
    line += f"; rank(s) {format_ranges(ranks)} on {hl} cannot either" if len(ranks) > 1 else ""
    if ranks and len(good | bad) > 1 and 2 * len(good) > total:
        return [finding("local", "FAIL", f"{line}; {len(good)} of {total} node(s) import torch in this launch: {hl} "
                        "alone cannot", sorted(bad), ranks, code=EXIT_FAIL, blame="majority")]
    return [unlocalised(finding("local", "FAIL", line, sorted(bad), ranks, code=EXIT_USAGE), "launch", NO_TORCH[1],
                        NO_TORCH[0])] if ranks else []


def judge_pre(records, world_size, expect):
    """Stage 1, from the roll call alone, before NCCL exists. The layout is judged only over a
    complete roll call: a missing rank is the cause, not a layout fault."""
    complete = len(records) == world_size
    return (judge_local(records) + judge_device_use(records) + judge_world_size(world_size, expect)
            + (judge_layout(records, expect) if complete else []) + judge_gpu_affinity(records)
            + (judge_gloo_address(records) if complete else []))


def judge_gate(records, ib_hca=None):
    """Stage 2, from the gathered telemetry, before the collectives: node facts, and the numerics each rank
    computed (judge_numerics_records; nothing when the ranks carry none: --skip-numerics)."""
    return (judge_numa(records) + judge_versions(records) + judge_fabric(records, ib_hca) + judge_day0(records)
            + judge_numerics_records(records))


def judge_final(records, results, world_size, host_of=None, ib_disable=None, bandwidth=None, min_busbw=None):
    """Stage 3, after the collectives and the DDP step: packages, the collectives' values, NCCL's
    transport, the bandwidth probe (records: with_results applied)."""
    return (judge_imports(records) + judge_collectives(results, world_size, host_of)
            + judge_transport(records, ib_disable) + judge_bandwidth(bandwidth, min_busbw))


def judge_all(records, world_size, expect, ib_hca=None, results=None, ib_disable=None, bandwidth=None,
              min_busbw=None):
    """The stages the runtime runs, in one call, on the same functions (judge_pre at the roll call,
    judge_gate at the telemetry, judge_final after the DDP step; the manifest and screen judges follow in
    their own rooms). results: the DDP step's per-rank results (None: the run stopped before them)."""
    out = judge_pre(records, world_size, expect) + judge_gate(records, ib_hca)
    if results is not None:
        out += judge_final(with_results(records, results), results, world_size,
                           {r["rank"]: r["host"] for r in records}, ib_disable, bandwidth, min_busbw)
    else:
        out += judge_imports(records)
    return out


# What every rank's record holds, wherever the run stopped (the JSON's `ranks`): the roll call's identity,
# the telemetry's numerics digests and node facts (node leaders; null on the others), the DDP step's NCCL facts (null
# before it, and on gloo). A record is never patched: each phase's results make new ones (with_results).
RANK_IDENTITY = ("rank", "host", "hostname", "loopback", "local_rank", "backend", "device", "cvd", "gpu",
                 "gpus_expected", "gloo", "cpus", "versions", "local", "pid", "pid_start", "addrs")
RANK_FIELDS = RANK_IDENTITY + ("numerics", "node", "transport", "nccl_net", "nccl_log")


def rank_record(rec):
    """A rank's record in the declared schema (RANK_FIELDS, null where not measured), a new dict."""
    return {k: rec.get(k) for k in RANK_FIELDS}


def with_results(records, results):
    """New records with the DDP step's results of each rank: NCCL's transport and interfaces (and where its
    lines were read: nccl_log), and the node leader's package probe in its node facts."""
    by_rank = {res["rank"]: res for res in results or () if isinstance(res, dict) and "rank" in res}
    out = []
    for rec in records:
        rec, res = rank_record(rec), by_rank.get(rec["rank"])
        if res is not None:
            rec.update({k: res.get(k) for k in ("transport", "nccl_net", "nccl_log")})
            if rec["node"] is not None and res.get("imports") is not None:
                rec["node"] = dict(rec["node"], imports=res["imports"])
        out.append(rec)
    return out


def judge_collectives(results, world_size, host_of=None):
    """results: per rank {'rank', 'ar_ok', 'ar_sum', 'grads'} (grads: a digest of the gradient bytes);
    host_of: rank -> host (default: each result's own 'host'). A rank whose all_reduce result is wrong while
    a strict majority got the exact value is named (its result unlike theirs); every rank or no majority
    wrong: FAIL, no host. DDP gradients are compared across ranks (not with rank 0's): the ranks unlike a
    strict majority are named; a tie names none."""
    out = []
    host_of = host_of or {r["rank"]: r.get("host", "?") for r in results}
    want = world_size * (world_size + 1) // 2

    def who(rs):
        return ", ".join(f"rank {r['rank']} ({host_of.get(r['rank'], '?')})" for r in rs)
    bad = [r for r in results if not r["ar_ok"] or int(r["ar_sum"]) != want]
    if bad:
        f = finding("collective", "FAIL", "all_reduce returned wrong values on " + ", ".join(
            f"{who([r])} (sum {r['ar_sum']}, expected {want}{', pattern wrong' if not r['ar_ok'] else ''})"
            for r in bad), [host_of.get(r["rank"], "?") for r in bad], [r["rank"] for r in bad], blame="majority")
        if 2 * len(bad) >= len(results):  # no strict majority got the exact value: not a host's result
            f = unlocalised(f, "everyone" if len(bad) == len(results) else "tie",
                            "the screen's pair results and the numerics check (a GPU computing wrong), or a run "
                            "with more nodes")
        out.append(f)
    else:
        out.append(finding("collective", "PASS", f"all_reduce exact on {len(results)} rank(s): "
                           f"sum {want} = w(w+1)/2, element-wise pattern verified"))
    digests = group_by(results, lambda r: r["grads"] if isinstance(r["grads"], str) else repr(r["grads"]),
                       lambda r: r["rank"])
    if len(digests) > 1:
        odd, kind = odd_ones(digests)
        text = "; ".join(f"ranks {format_ranges(rs)}" if len(rs) > 1 else f"rank {rs[0]}" for rs in
                         sorted(digests.values(), key=len, reverse=True))
        named = [r for r in results if r["rank"] in odd]
        f = finding("ddp", "FAIL", f"DDP gradients after the all-reduce differ across ranks ({len(digests)} distinct "
                    f"results: {text}); unlike the {'majority' if kind == 'majority' else 'others'}: {who(named)}",
                    [host_of.get(r["rank"], "?") for r in named], [r["rank"] for r in named], blame="majority")
        out.append(f if kind == "majority" else unlocalised(f, kind, "a run with more ranks, and the numerics "
                                                                     "check's DDP-gradient rows"))
    else:
        out.append(finding("ddp", "PASS", f"DDP gradients identical on {len(results)} rank(s)"))
    return out


def judge_transport(records, ib_disable=None):
    """Per node, the transport NCCL used; sockets between nodes while IB is ACTIVE is a FAIL (every
    correctness check passes, at ~1/100 of the bandwidth). An NCCL rank whose transport was not read (its
    record's nccl_log says where NCCL's lines went: the job's stdout with the operator's NCCL_DEBUG=INFO, an
    operator's NCCL_DEBUG_FILE with no INFO line in it) is a WARN naming its nodes and why: a transport not
    judged is never a silent PASS."""
    per_host, unread = {}, {}
    for r in records:
        if r.get("transport") is not None:
            per_host.setdefault(r["host"], set()).update(r["transport"])
        elif r.get("backend") == "nccl":
            unread.setdefault(nccl_log_why(r.get("nccl_log")), set()).add(r["host"])
    nodes = {r["host"]: r.get("node") or {} for r in records if r.get("node")}
    out = []
    for h, kinds in sorted(per_host.items()):
        active = [p["port"] for p in nodes.get(h, {}).get("ib") or [] if p["state"] == "ACTIVE"]
        if "NET/Socket" in kinds and active and str(ib_disable).strip() != "1":
            out.append(finding("transport", "FAIL", f"{h}: NCCL used NET/Socket although InfiniBand port(s) "
                               f"{','.join(active[:4])} are ACTIVE and NCCL_IB_DISABLE is not 1 (IB not usable by "
                               f"NCCL: check the IB verbs libraries, NCCL_IB_HCA, /dev/infiniband access)", [h]))
    out += [finding("transport", "WARN", f"NCCL's transport was not judged on {compress_hostlist(sorted(hosts))}: "
                    f"{why}; an InfiniBand-to-socket fallback there would pass unseen", sorted(hosts))
            for why, hosts in sorted(unread.items())]
    if per_host and not any(f["status"] == "FAIL" for f in out):
        out.insert(0, finding("transport", "PASS", "NCCL transports: " + "; ".join(
            f"{'+'.join(sorted(k)) or 'none'} on {compress_hostlist(sorted(hs))}"
            for k, hs in group_by(per_host, lambda h: tuple(sorted(per_host[h]))).items()), sorted(per_host)))
    return out


def nccl_log_why(log):
    """Why NCCL's INFO lines of a rank were not read, from its record's nccl_log (NcclLog.facts)."""
    src, path = (log or {}).get("source"), (log or {}).get("path")
    if src == "stdout":
        return ("NCCL_DEBUG=INFO (the job's own setting) sends NCCL's lines to the job's stdout, which the tool cannot "
                "read: look for ' via NET/Socket' in this log, or set NCCL_DEBUG_FILE (the tool reads that file), or "
                "leave NCCL_DEBUG unset (the tool keeps NCCL's lines in a private file)")
    if src == "operator":
        hidden = (log or {}).get("subsys")
        return (f"the job's own NCCL_DEBUG_FILE ({path}) holds " + (
            f"no line of NCCL's channels (NCCL_DEBUG_SUBSYS={hidden} leaves out INIT and NET)" if hidden else
            "no INFO line of NCCL (NCCL writes them there only with NCCL_DEBUG=INFO)"))
    if src == "private":
        return f"NCCL wrote no INFO line to the rank's private log ({path})"
    return "the rank's NCCL log facts did not come with its results"
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
    """--strict: every WARN a FAIL, marked `strict` (named as its evidence allows, never drained: drainable)."""
    return [dict(f, status="FAIL", strict=True) if strict and f["status"] == "WARN" else f for f in findings]


UNFINISHED_WORDS = {"dead": "dead (process gone)", "frozen": "frozen (process stopped)",
                    "silent": "unreachable (its node's monitor and ranks stopped reporting)",
                    "error": "reported an error",
                    "stuck": "alive, not finished",
                    "terminated": "terminated by a signal (scancel, the time limit, preemption or the launcher)",
                    "internal": "hit an error inside the tool"}
# a live rank that did not finish, by what it posted when rank 0 asked (hang.issued_states); "behind" ranks
# are said with never_issued_text
ISSUED_WORDS = {"waiting": "alive, inside a collective (waiting for its peers)",
                "idle": "alive, outside any collective",
                "between": "alive, between two collective calls",
                "unposted": "alive, posted no record of what it issued within {s:g}s"}
PROCESS_KINDS = ("dead", "frozen", "silent")  # evidence of a rank's own process state
STOPPED_WORDS = "the run was stopped from outside, not by a fault of the cluster: no host is blamed"
NOT_BLAMED = " (not blamed)"


def unfinished_parts(ranks_of, states, named, host_of, by_issued):
    """The words for the ranks that did not finish, kind by kind (UNFINISHED_WORDS; ranks_of(kind): its
    ranks), the live ones ('stuck') by what they issued last (ISSUED_WORDS) when by_issued; where some rank
    is named (named), the others say they are not blamed."""
    parts = []
    for k, words in UNFINISHED_WORDS.items():
        rs = ranks_of(k)
        if k == "stuck" and by_issued:
            by_state = group_by(rs, states.get)
            parts += [f"{on_hosts(by_state[s], host_of)} {w.format(s=ISSUED_S)}" + (NOT_BLAMED if named else "")
                      for s, w in ISSUED_WORDS.items() if s in by_state]
            rs = [r for r in rs if states.get(r) not in ISSUED_WORDS]
        if rs:
            parts.append(f"{on_hosts(rs, host_of)} {words}" + (NOT_BLAMED if named and not set(rs) & named else ""))
    return parts


def finished_by(stamps, done, phase):
    """stamps ({rank: index in PHASES of its last finished phase}) with the ranks in `done` counted as having
    finished `phase` (they posted their part of it: they wait for rank 0, not stuck themselves)."""
    idx = PHASES.index(phase)
    return {r: max(s, idx) if r in done else s for r, s in stamps.items()}


def unfinished_kind(r, live, errors, host_of, silent_hosts=()):
    """A rank that did not finish: one key of UNFINISHED_WORDS (see judge_unfinished)."""
    e = errors.get(r, {})
    first = (("terminated", e.get("term")), ("internal", e.get("internal")), ("dead", live.get(r) == "gone"),
             ("frozen", live.get(r) == "stopped"), ("silent", host_of.get(r) in silent_hosts), ("error", r in errors))
    return next((kind for kind, seen in first if seen), "stuck")


def unreachable_hosts(silent, quiet, own_host, host_of, errors):
    """(unreachable, quiet) from settled_live's silent and quiet nodes. A silent node is unreachable only
    when nothing else shows it reaches the store: never rank 0's own node (rank 0 reads its ranks from
    /proc), never a node one of whose ranks posted an error report. The others join quiet: the tool's own
    monitor was slow or stopped there, a note in the verdict, no host blamed for it (not said of a node
    whose ranks all reported: what happened to them is said already)."""
    spoke = {host_of.get(r) for r in errors}
    unreachable = {h for h in silent if h != own_host and h not in spoke}
    told = {h for h in spoke if all(r in errors for r, x in host_of.items() if x == h)}
    return unreachable, (set(quiet) | set(silent)) - unreachable - told


def quiet_monitor_note(quiet, budget):
    """The verdict's note on node monitors that did not post while their nodes were otherwise seen."""
    return (f"note: the liveness monitor of {compress_hostlist(sorted(quiet))} posted nothing within {budget:g}s (the "
            "tool's own process, slow to start or to post under CPU load, or stopped) and nothing else showed "
            "the node unreachable: no host is blamed for it")


def hang_culprits(kinds, late, world, states, finished, recorded, all_issued=None):
    """The one blame law on work that did not finish, a phase of every rank or a screen round of groups:
    -> (culprits, check or None, code or None, evidence, unlocalised or None). kinds: {rank: UNFINISHED_WORDS
    key} of every rank; late: the ranks that did not finish; states: {rank: one of ISSUED_STATES} of the late
    live ranks, what they issued last (hang.issued_states of their group), "idle" for a rank outside any
    collective; finished: whether some rank finished; recorded: whether what the ranks issued was collected
    where the work issues collectives; all_issued: (words, hint) when the live ranks wait inside a collective
    every member of its group issued (the caller knows its groups), else None. In order: a rank's own process
    state anywhere in the world (dead, frozen, unreachable: also a rank that finished its part and then
    died), whatever else happened; a signal (`interrupted`) or the tool's own error (`internal`), whose
    consequences are nobody's fault; errors ranks reported themselves (when not every rank did); then, among
    the live ranks that did not finish, those that never issued a collective their peers issued, and, while
    a peer finished, those outside any collective that never finished their part. Anything else (every rank
    inside the collective, records not collected, every rank alike) FAILs naming no host, saying what would
    localise it."""
    hard = [r for r in range(world) if kinds[r] in PROCESS_KINDS]
    if hard:
        return hard, None, EXIT_FAIL if any(kinds[r] == "dead" for r in hard) else EXIT_TIMEOUT, "process", None
    if any(kinds[r] == "terminated" for r in range(world)):
        return [], "interrupted", EXIT_INTERRUPTED, "signal", None
    if any(kinds[r] == "internal" for r in range(world)):
        return [], "internal", EXIT_INTERNAL, "tool", None
    errs = [r for r in late if kinds[r] == "error"]
    if errs and len(errs) < world:
        return errs, None, None, "own", None
    if errs:
        return [], None, None, "everyone", unlocalised_record(
            "every rank reported an error of its own, so none is unlike its peers", RERUN_HINT)
    stuck = [r for r in late if kinds[r] == "stuck"]
    named = [r for r in stuck if states.get(r) == "behind" or (finished and states.get(r) == "idle")]
    if named:
        return named, None, EXIT_TIMEOUT, "never-issued", None
    if not stuck:
        return [], None, EXIT_TIMEOUT, "not-collected", unlocalised_record(
            "every rank did its part and none is behind; what held it back was not seen", RERUN_HINT)
    unposted = [r for r in stuck if states.get(r) == "unposted"]
    if unposted or not recorded:
        who = f"rank(s) {ranks_text(unposted)}" if unposted else "the ranks"
        return [], None, EXIT_TIMEOUT, "not-collected", unlocalised_record(
            f"what {who} issued last was not collected (a rank whose main thread holds the interpreter, or a "
            "store connection that did not answer), and no other evidence singles one out", RERUN_HINT)
    if all_issued:
        return [], None, EXIT_TIMEOUT, "all-issued", unlocalised_record(*all_issued)
    if all(states.get(r) == "idle" for r in stuck):
        return [], None, EXIT_TIMEOUT, "everyone", unlocalised_record(
            "every rank that did not finish is alive and outside any collective: none is behind another",
            RERUN_HINT)
    return [], None, EXIT_TIMEOUT, "not-collected", unlocalised_record(
        "the ranks that did not finish are alive and none is behind another (some inside a collective, some "
        "between calls), and no other evidence singles one out", RERUN_HINT)


def judge_unfinished(phase, cause, world, host_of, stamps, live, errors, code=None, silent_hosts=(), issued=None,
                     fabric_hint=None):
    """Who did not finish `phase` (one FAIL finding). A rank whose last stamp is before the phase is dead
    (its process is gone), frozen (stopped), unreachable (its node's monitor went silent), was terminated by
    a signal, hit the tool's own error, reported an error, or is alive: then, in a phase that issues
    collectives, what it posted when rank 0 asked (issued: {rank: post or None}; None: not asked) tells
    whether it never issued a collective its peers issued (named), waits inside one (not named), or is
    outside any. The culprits and the evidence: see hang_culprits. A run stopped by a signal with no
    other culprit is check `interrupted` (exit 5), one stopped by the tool's own error `internal` (exit 4),
    naming no host. Exit code otherwise: 1 when a rank is dead, 3 when one is frozen, unreachable or stuck,
    else `code` (the reported error's). A FAIL that names no host says so, why, and what would localise it
    (its 'unlocalised'); every finding carries its 'blame'.

    stamps: {rank: index in PHASES of its last finished phase}; live: {rank: running|stopped|gone};
    errors: {rank: {'line', 'term', 'internal'}}; host_of: {rank: host}."""
    idx = PHASES.index(phase)
    late = [r for r in range(world) if stamps.get(r, -1) < idx]
    finished = [r for r in range(world) if r not in late]
    kinds = {r: unfinished_kind(r, live, errors, host_of, silent_hosts) for r in range(world)}
    stuck = [r for r in late if kinds[r] == "stuck"]
    an = issued_states(range(world), issued, stuck, group_key(range(world))) if issued is not None else None
    states = an["states"] if an else {r: "idle" for r in stuck} if phase not in ISSUE_PHASES else {}
    waiting = [r for r in stuck if states.get(r) == "waiting"]
    all_issued = None
    if an and an["front"] and waiting:
        every = all((an["last"].get(r) or [None, -1])[1] == an["front"][1] for r in stuck)
        what = (f"every rank issued {op_text(an['front'])} and it did not finish" if every else
                f"ranks {ranks_text(waiting)} wait inside a collective and no rank is stopped outside one")
        all_issued = (f"{what}: the fabric or a link between the ranks, which no rank's own state singles out",
                      fabric_hint or FABRIC_HINT)
    culprits, check, ccode, evidence, unloc = hang_culprits(kinds, late, world, states, bool(finished),
                                                            bool(an) or phase not in ISSUE_PHASES, all_issued)
    code = ccode or code or EXIT_FAIL
    detail = _unfinished_detail(kinds, late, an, culprits, evidence, host_of, phase, finished)
    first_err = next((errors[r]["line"] for r in culprits or late if r in errors and not errors[r].get("term")), None)
    reason = (f"{cause}: {detail}; {len(finished)}/{world} rank(s) finished {phase}"
              + (f"; first error: {first_err}" if first_err else "")
              + (f"; {STOPPED_WORDS}" if check == "interrupted" else "")
              + ("; a bug in the tool, not a fault of the cluster: no host is blamed" if check == "internal" else "")
              + (f"; {unlocalised_words(unloc)}" if unloc else ""))
    f = finding(check or PHASE_CHECK[phase], "FAIL", reason, [host_of.get(r, "?") for r in culprits], culprits,
                code=code, blame=evidence)
    if unloc:
        f["unlocalised"] = unloc
    if an:
        f["issued"] = {"source": an["source"], "front": an["front"], "issuers": an["issuers"],
                       "states": {str(r): s for r, s in sorted(an["states"].items())},
                       "last": {str(r): x for r, x in sorted(an["last"].items())}}
    return f


def _unfinished_detail(kinds, late, an, culprits, evidence, host_of, phase, finished):
    """The finding's words: each rank that did not finish (or whose process is gone) by what it was doing;
    when some are named, the others say they are not."""
    named, parts = set(culprits), []
    shown = [r for r in sorted(kinds) if r in late or kinds[r] in PROCESS_KINDS + ("terminated", "internal")]
    states = an["states"] if an else {}
    if evidence == "never-issued":
        behind = [r for r in culprits if states.get(r) == "behind"]
        src = "torch's flight recorder" if (an or {}).get("source") == "recorder" else "its own record"
        hows = (an or {}).get("how") or {}
        by_how = group_by(behind, hows.get)
        parts += [f"{never_issued_text(by_how[h], an, host_of)} ({words.format(src=src)})"
                  for h, words in BEHIND_WORDS.items() if h in by_how]
        rest = [r for r in culprits if r not in behind]
        if rest:
            parts.append(never_finished_text(rest, phase, finished, host_of) + " (alive, outside any collective)")
    parts += unfinished_parts(
        lambda k: [r for r in shown if kinds[r] == k and r not in (named if evidence == "never-issued" else ())],
        states, named, host_of, bool(an))
    return "; ".join(parts) if parts else "no rank is behind"


SCREEN_QUARTILE_MIN = 4     # fewer values: the reference is their maximum
SCREEN_SPREAD_MIN = 8       # fewer values: no noise estimate (the WARN fraction alone decides)


def screen_reference(values):
    """Robust reference of peer measurements (None values are skipped).
    -> {'ref': float|None, 'spread': float, 'count': int, 'how': 'upper quartile'|'maximum'}.
    ref: the upper quartile, or the maximum below SCREEN_QUARTILE_MIN values. spread: the peers'
    standard deviation estimated from the upper half of the values only (their population standard
    deviation / 0.6028, the ratio for the upper half of a normal distribution), so low outliers do not
    widen it; 0.0 below SCREEN_SPREAD_MIN values."""
    v = sorted(float(x) for x in values if x is not None)
    n = len(v)
    if not n:
        return {"ref": None, "spread": 0.0, "count": 0, "how": "maximum"}
    quart = n >= SCREEN_QUARTILE_MIN
    spread = 0.0
    if n >= SCREEN_SPREAD_MIN:
        top = v[n // 2:]
        mean = sum(top) / len(top)
        spread = math.sqrt(sum((x - mean) ** 2 for x in top) / len(top)) / 0.6028
    return {"ref": _screen_quantile(v, 0.75) if quart else v[-1], "spread": spread, "count": n,
            "how": "upper quartile" if quart else "maximum"}


def _import_state(st):
    if not st:
        return "-"
    if st.get("ok"):
        return st.get("version") or "?"
    return "missing" if "ModuleNotFoundError" in (st.get("error") or "") else "BROKEN"



# ============================================================================ aiv/checks/manifest.py
# Floor 3: the cluster manifest: --save-manifest, --manifest (drift is a finding), --diff-manifest.
# Accept once, gate forever. --save-manifest PATH writes the state a PASS saw (its WARNs recorded as
# accepted), grouped by node class and keeping the hosts each value was accepted on; --manifest PATH
# judges later runs against it (check `manifest`); --diff-manifest A B prints what changed between two
# files. A class is what a node is, not what a job was given: the node's own GPU count (the driver's
# list), bands keyed by what they depend on (GPU model; ranks per node; rails per pair).
# In memory a class is "expanded": {'hosts': set, 'values': {field: {host: value}}, ...}; on disk each
# field is a list of variants {'value': v, 'hosts': hostlist} (see docs/manifest.md, Schema).
MANIFEST_SCHEMA_VERSION = 2  # 1: classes and bands keyed by the job's GPUs; refused with how to re-save
MANIFEST_TOOL = "ai-infra-validator"
INTRA_TRANSPORTS = ("P2P", "SHM", "NVLS")  # the rest (NET/*, COLLNET) carry the path between nodes
TRANSPORT_RANK = {"NET/Socket": 0, "NET/other": 1, "SHM": 2, "P2P": 3, "NET/IB": 4, "COLLNET": 5, "NVLS": 5}
BAND_MIN_RUNS = 3  # a speed band judges only once this many accepted runs built it (see merge_bands)
BAND_WINDOW = 5    # a band spans the last this many accepted runs (older ones age out; see merge_bands)


def _lower_fails(old, new):
    """A downgrade (below the accepted) FAILs; an upgrade is a change to review (WARN)."""
    try:
        return "FAIL" if new < old else "WARN"
    except TypeError:  # a hand-edited value of another type: not comparable, so not known to be better
        return "FAIL"


def _transport_severity(old, new):
    """FAIL when the path lost its best transport or gained a worse one (NET/IB -> NET/Socket, P2P -> SHM)."""
    o = [TRANSPORT_RANK.get(k, 1) for k in old if isinstance(k, str)] if isinstance(old, list) else []
    n = [TRANSPORT_RANK.get(k, 1) for k in new]
    return "FAIL" if not o or max(n) < max(o) or min(n) < min(o) else "WARN"


# (field, what a finding calls it, severity of a change: FAIL, WARN or a function of old, new), in listing order.
MANIFEST_FIELDS = (
    ("driver", "driver", "FAIL"), ("cuda", "CUDA", "FAIL"), ("nccl", "NCCL", "FAIL"),
    ("torch", "torch", "FAIL"), ("gpu_model", "GPU model", "FAIL"),
    ("gpus_per_node", "GPUs per node", "FAIL"), ("gpu_memory", "GPU memory", "FAIL"),
    ("ib_ports", "IB port count", "FAIL"), ("ib_rate", "IB rate", "FAIL"),
    ("pcie_width", "PCIe link width", _lower_fails), ("pcie_speed", "PCIe link speed", _lower_fails),
    ("transport_intra", "NCCL transport within the node", _transport_severity),
    ("transport_inter", "NCCL transport between nodes", _transport_severity),
    ("torchvision", "torchvision", "WARN"), ("torchaudio", "torchaudio", "WARN"),
    ("python", "Python", "WARN"), ("kernel", "kernel", "WARN"), ("os", "OS", "WARN"),
    ("ib_state", "IB port state", "WARN"), ("ifaces", "interfaces", "WARN"),
    ("env", "environment", "WARN"),
)
FIELD_NAMES = tuple(f[0] for f in MANIFEST_FIELDS)


def _low(values):
    return min((v for v in values if v is not None), default=None)


def _gpu_fields(rs, node, load):
    """GPU fields of a node: its own GPU count from the driver's list (else the most its ranks could
    see), each model's memory, the PCIe link read under load by the screen (load: {rank: screen row})."""
    gs = [r["gpu"] for r in rs if r.get("gpu")]
    if not gs:
        return dict.fromkeys(("gpu_model", "gpus_per_node", "gpu_memory", "pcie_width", "pcie_speed"))
    distinct = {g.get("uuid") or g.get("pci") or i for i, g in enumerate(gs)}
    sized = [g for g in gs if isinstance(g.get("vram"), int) and g["vram"] > 0]
    memory = {m: max(vs) for m, vs in group_by(sized, lambda g: str(g.get("name")), lambda g: g["vram"]).items()}
    links = [load[r["rank"]] for r in rs if r.get("rank") in load]
    return {"gpu_model": "+".join(sorted({str(g.get("name")) for g in gs})),
            "gpus_per_node": node.get("gpus_driver") or max(len(distinct), node.get("gpus_visible") or 0),
            "gpu_memory": memory or None,
            "pcie_width": _low(x.get("pcie_width") for x in links),
            "pcie_speed": _low(x.get("pcie_speed") for x in links)}


def _node_fields(node):
    ib, imports = node.get("ib"), node.get("imports") or {}
    active = [p["rate_gbps"] for p in ib or [] if p.get("state") == "ACTIVE" and p.get("rate_gbps")]
    down = [f"{p.get('port')} {p.get('state')}" for p in ib or [] if p.get("state") != "ACTIVE"]
    return {"driver": node.get("driver"), "kernel": node.get("kernel"), "os": node.get("os"),
            "ib_ports": len(ib) if ib is not None else None, "ib_rate": min(active) if active else None,
            "ib_state": (", ".join(down) or "all ACTIVE") if ib else None,
            "ifaces": sorted(node["ifaces"]) if node.get("ifaces") is not None else None,
            "env": node.get("env"),
            **{name: (None if _import_state(imports.get(name)) == "-" else _import_state(imports.get(name)))
               for name in PROBED_PACKAGES}}


def _transport_fields(rs):
    kinds = sorted(set().union(*(r["transport"] for r in rs if r.get("transport") is not None)))
    intra = [k for k in kinds if k in INTRA_TRANSPORTS]
    inter = [k for k in kinds if k not in INTRA_TRANSPORTS]
    return {"transport_intra": intra or None, "transport_inter": inter or None}  # a path not used: unmeasured


def screen_load(screen):
    """{rank: the screen's GPU row} (its PCIe link read under load), {} when the screen did not run."""
    return {g["rank"]: g for g in (screen or {}).get("gpu") or [] if isinstance(g, dict) and "rank" in g}


def host_view(rs, load=None):
    """(fields, class key) of one node from its rank records and the screen's rows (screen_load); a field
    this run did not measure is None."""
    rs = sorted(rs, key=lambda r: r.get("local_rank", 0))
    node = next((r["node"] for r in rs if r.get("node")), {}) or {}
    v = rs[0].get("versions") or {}
    fields = dict(_gpu_fields(rs, node, load or {}), **_node_fields(node), **_transport_fields(rs),
                  **{k: v.get(k) for k in ("torch", "cuda", "nccl", "python")})
    key = {"gpu_model": fields["gpu_model"], "gpus_per_node": fields["gpus_per_node"], "ib_ports": fields["ib_ports"],
           "ib_rate_gbps": max((p["rate_gbps"] for p in node.get("ib") or [] if p.get("rate_gbps")), default=None)}
    return {f: fields[f] for f in FIELD_NAMES}, key


def class_name(key):
    """'NVIDIA H200 x8, IB 8x400G': GPU model x GPUs per node x fabric shape (IB port count and rate)."""
    gpu = f"{key.get('gpu_model')} x{key.get('gpus_per_node')}" if key.get("gpu_model") else "no GPU"
    n = key.get("ib_ports")
    ib = "IB unknown" if n is None else f"IB {n}x{key.get('ib_rate_gbps') or 0:g}G" if n else "no IB"
    return f"{gpu}, {ib}"


def _canon(v):
    return json.dumps(v, sort_keys=True, default=str)


def _hosts_in(x):
    return list(x) if isinstance(x, list) else expand_hostlist(x) if x else []


def _hosts_out(hosts):
    """A Slurm hostlist string when it expands back to exactly these names, else the sorted list."""
    hs = sorted(set(hosts))
    text = compress_hostlist(hs)
    try:
        return text if sorted(expand_hostlist(text)) == hs else hs
    except ValueError:
        return hs


def _hl(hosts):
    return compress_hostlist(sorted(set(hosts))) or "-"


def _expand_class(c):
    values = {field: hv for field, variants in (c.get("fields") or {}).items()
              if (hv := {h: var["value"] for var in variants for h in _hosts_in(var.get("hosts"))})}
    return {"key": c.get("key") or {}, "hosts": set(_hosts_in(c.get("hosts"))), "values": values,
            "runs": c.get("runs", 1), "first_accepted_at": c.get("first_accepted_at"),
            "last_accepted_at": c.get("last_accepted_at"), "bands": c.get("bands") or {}}


def _pack_class(x):
    fields = {}
    for field in sorted(x["values"], key=lambda f: (FIELD_NAMES.index(f) if f in FIELD_NAMES else 99, f)):
        groups = {}
        for h, v in x["values"][field].items():
            groups.setdefault(_canon(v), (v, []))[1].append(h)
        fields[field] = [{"value": v, "hosts": _hosts_out(hs)}
                         for v, hs in sorted(groups.values(), key=lambda g: (-len(g[1]), _canon(g[0])))]
    return {"key": x["key"], "hosts": _hosts_out(x["hosts"]), "runs": x["runs"],
            "first_accepted_at": x["first_accepted_at"], "last_accepted_at": x["last_accepted_at"],
            "fields": fields, "bands": x["bands"]}


def _manifest_doc(classes, written_at, accepted=()):
    return {"schema_version": MANIFEST_SCHEMA_VERSION, "tool": MANIFEST_TOOL, "version": VERSION,
            "written_at": written_at, "classes": {k: _pack_class(x) for k, x in sorted(classes.items()) if x["hosts"]},
            "accepted_warns": list(accepted)}


def manifest_from_records(records, written_at, screen=None, findings=()):
    """The manifest of one accepted run: each node under its class, every measured field per host, the
    class's speed bands from the screen, and the run's WARNs as accepted (accepted_warns)."""
    classes, load = {}, screen_load(screen)
    for h, rs in sorted(_by_host(records).items()):
        fields, key = host_view(rs, load)
        x = classes.setdefault(class_name(key), {"key": key, "hosts": set(), "values": {}, "runs": 1, "bands": {},
                                                 "first_accepted_at": written_at, "last_accepted_at": written_at})
        x["hosts"].add(h)
        for f, v in fields.items():
            if v is not None:
                x["values"].setdefault(f, {})[h] = v
    for cls, bands in screen_bands(screen, records).items():
        if cls in classes:
            classes[cls]["bands"] = bands
    return _manifest_doc(classes, written_at, accepted_warns(findings or (), written_at))


def _band_from(window, runs):
    """A band over its window of accepted runs [{'ref', 'lo', 'hi'}]: lo the lowest, hi the highest, ref the mean."""
    return {"ref": sum(w["ref"] for w in window) / len(window), "lo": min(w["lo"] for w in window),
            "hi": max(w["hi"] for w in window), "runs": runs, "window": window}


def merge_bands(old, new):
    """Bands over a window: {name: {'ref', 'lo', 'hi', 'runs', 'window'}} -> the window holds the last
    BAND_WINDOW accepted runs (a slow run long ago ages out instead of lowering the band for ever), lo/hi/ref
    are taken over it, runs count every accepted run. A band judges only from BAND_MIN_RUNS runs on."""
    out = dict(old)
    for name, b in new.items():
        a = old.get(name)
        if not a:
            out[name] = b
            continue
        window = [{k: w[k] for k in ("ref", "lo", "hi")} for w in (a.get("window") or [a]) + (b.get("window") or [b])]
        out[name] = _band_from(window[-BAND_WINDOW:], a.get("runs", 1) + b.get("runs", 1))
    return out


def warn_key(f):
    """A WARN's stable key: its check and reason with its own hosts and the decimal numbers in it (rates,
    sizes, times that vary from run to run) masked, so that a WARN accepted on gpu[001-016] is known again
    on a subset of them. Where the masking misses, the WARN shows as new: never silently accepted."""
    text, hosts = f["reason"], sorted(set(f.get("hosts") or ()), key=len, reverse=True)
    for h in ([compress_hostlist(sorted(hosts))] if hosts else []) + hosts:
        text = text.replace(h, "<host>")
    return f"{f['check']}: " + re.sub(r"\d+\.\d+", "<n>", text)


def accepted_warns(findings, when):
    """This run's WARNs as a save accepts them: [{'check', 'key', 'hosts', 'reason', 'accepted_at'}]. The
    `manifest` check's own WARNs are not kept: the save takes the new values, so they are gone."""
    out = {}
    for f in findings:
        if f["status"] == "WARN" and f["check"] != "manifest":
            e = out.setdefault(warn_key(f), {"check": f["check"], "key": warn_key(f), "hosts": set(),
                                             "reason": f["reason"], "accepted_at": when})
            e["hosts"] |= set(f.get("hosts") or ())
    return [dict(e, hosts=_hosts_out(e["hosts"])) for _, e in sorted(out.items())]


def merge_accepted(old, new, run_hosts):
    """Accepted WARNs after a save of the nodes run_hosts: their earlier acceptances give way to this run's."""
    out = {}
    for e in old:
        hs = set(_hosts_in(e.get("hosts"))) - run_hosts
        if hs or not e.get("hosts"):
            out[e["key"]] = dict(e, hosts=hs)
    for e in new:
        out[e["key"]] = dict(e, hosts=set(_hosts_in(e.get("hosts"))) | out.get(e["key"], {}).get("hosts", set()))
    return [dict(e, hosts=_hosts_out(e["hosts"])) for _, e in sorted(out.items())]


def mark_accepted(manifest, findings):
    """findings with each WARN the manifest accepted (same key, its hosts among the accepted ones) marked
    'accepted': True (rendered '(accepted in manifest)'); a new WARN stays a plain WARN."""
    index = {}
    for e in (manifest or {}).get("accepted_warns") or []:
        index.setdefault(e["key"], set()).update(_hosts_in(e.get("hosts")))
    return [dict(f, accepted=True) if f["status"] == "WARN" and warn_key(f) in index
            and set(f.get("hosts") or ()) <= index[warn_key(f)] else f for f in findings]


def merge_manifests(old, new):
    """A save onto an existing manifest. Classes add up (hosts union); a host accepted again takes this run's
    values (fields this run did not measure keep their earlier ones) and leaves any other class it was in;
    bands widen. The written_at is the new one."""
    if not old:
        return new
    run_hosts = {h for c in new["classes"].values() for h in _hosts_in(c.get("hosts"))}
    accepted = merge_accepted(old.get("accepted_warns") or [], new.get("accepted_warns") or [], run_hosts)
    out = {k: _expand_class(c) for k, c in old["classes"].items()}
    for key, c in new["classes"].items():
        n = _expand_class(c)
        for o in (o for k, o in out.items() if k != key):  # a host accepted again leaves its other classes
            o["hosts"] -= n["hosts"]
            o["values"] = {f: {h: v for h, v in hv.items() if h not in n["hosts"]} for f, hv in o["values"].items()}
        o = out.setdefault(key, dict(n, hosts=set(), values={}, runs=0, bands={}))
        o["hosts"] |= n["hosts"]
        for field, hv in n["values"].items():
            o["values"].setdefault(field, {}).update(hv)
        o.update(runs=o["runs"] + n["runs"], bands=merge_bands(o["bands"], n["bands"]),
                 first_accepted_at=min(filter(None, [o["first_accepted_at"], n["first_accepted_at"]]), default=None),
                 last_accepted_at=max(filter(None, [o["last_accepted_at"], n["last_accepted_at"]]), default=None))
    return _manifest_doc(out, new["written_at"], accepted)


def _fmt(field, v):
    if v is None:
        return "-"
    if field == "gpu_memory" and isinstance(v, dict):
        return ", ".join(f"{m} {_fmt(field, n)}" for m, n in sorted(v.items()))
    if isinstance(v, (int, float)) and not isinstance(v, bool) and field in ("gpu_memory", "ib_rate", "pcie_speed"):
        return f"{int(v) >> 20} MiB" if field == "gpu_memory" else f"{v:g} {'Gb/s' if field == 'ib_rate' else 'GT/s'}"
    if field == "pcie_width":
        return f"x{v}"
    if isinstance(v, list):
        return ",".join(map(str, v)) or "none"
    return str(v)


def _changes(field, old, new):
    """[(label, old text, new text)] of one host's change; the environment per variable."""
    if field != "env":
        return [(field, _fmt(field, old), _fmt(field, new))]
    old, new = (x if isinstance(x, dict) else {} for x in (old, new))
    return [(f"env.{k}", old.get(k, "(unset)"), new.get(k, "(unset)"))
            for k in sorted(set(old) | set(new)) if old.get(k) != new.get(k)]


def _most_common(hv):
    counts = {}
    for v in hv.values():
        counts.setdefault(_canon(v), [v, 0])[1] += 1
    return max(counts.values(), key=lambda c: (c[1], _canon(c[0])))[0] if counts else None


def _project(field, new, accepted):
    """gpu_memory is compared model by model, for the models both sides know: a job given some GPUs of a
    mixed node sees fewer models, and a changed model is gpu_model's finding already."""
    if field != "gpu_memory" or not isinstance(new, dict):
        return new, accepted
    known = {m for a in accepted if isinstance(a, dict) for m in a}
    new = {m: v for m, v in new.items() if m in known} or None
    return new, [{m: a[m] for m in new or () if m in a} if isinstance(a, dict) else a for a in accepted]


def _judge_host(h, fields, cls, listed, drift, unchecked):
    """Compare one node's fields with its class: its own accepted values when listed, else any of the class's."""
    for field, _, severity in MANIFEST_FIELDS:
        hv = cls["values"].get(field) or {}
        new, accepted = _project(field, fields[field], ([hv[h]] if h in hv else []) if listed else list(hv.values()))
        if new is None or not accepted:
            unchecked.add(field)
            continue
        if _canon(new) in {_canon(v) for v in accepted}:
            continue
        old = accepted[0] if listed else _most_common(dict(enumerate(accepted)))
        text = "; ".join(f"{lab[4:]} {o} -> {n}" if field == "env" else f"{o} -> {n}"
                         for lab, o, n in _changes(field, old, new))
        sev = severity if isinstance(severity, str) else severity(old, new)
        drift.setdefault((field, sev), {}).setdefault(text, []).append(h)


def judge_manifest(manifest, records, screen=None):
    """This run against an accepted manifest (None: no --manifest). A listed host is judged field by field
    against its own accepted values in the class it was accepted in; an unlisted host by its class key
    (an unknown class is a WARN). The PCIe link is the screen's reading under load (screen: this run's screen,
    None when skipped). Unmeasured fields are not checked; hosts not in this run are not judged."""
    if not manifest:
        return []
    classes = {k: _expand_class(c) for k, c in manifest["classes"].items()}
    index = {h: k for k, x in sorted(classes.items()) for h in sorted(x["hosts"])}
    drift, unchecked, unknown, counts = {}, set(), {}, [[], []]
    load = screen_load(screen)
    slow = {h for f in judge_bands(manifest, records, screen)  # not a match: judge_bands FAILs it, named or not
            for h in f["hosts"] + f.get("involved", [])}
    for h, rs in sorted(_by_host(records).items()):
        fields, key = host_view(rs, load)
        listed = h in index
        cls = classes.get(index[h] if listed else class_name(key))
        if cls is None:
            unknown.setdefault(class_name(key), []).append(h)
            continue
        if h not in slow:
            counts[0 if listed else 1].append(h)
        _judge_host(h, fields, cls, listed, drift, unchecked)
    return _manifest_findings(drift, unknown, counts, unchecked, sorted(classes))


def _manifest_findings(drift, unknown, counts, unchecked, accepted):
    """counts: [listed hosts, hosts judged by class] that match (the PASS names them)."""
    out = []
    labels = {f: lab for f, lab, _ in MANIFEST_FIELDS}
    for (field, sev), texts in sorted(drift.items(), key=lambda d: (d[0][1] != "FAIL", FIELD_NAMES.index(d[0][0]))):
        hosts = [h for hs in texts.values() for h in hs]
        out.append(finding("manifest", sev, f"{labels[field]} differs from the manifest: " + "; ".join(
            f"{t} on {_hl(hs)}" for t, hs in sorted(texts.items())), hosts, blame="manifest"))
    for key, hosts in sorted(unknown.items()):
        out.append(finding("manifest", "WARN", f"{_hl(hosts)} not in the manifest, and its class '{key}' was never "
                           f"accepted (accepted: {'; '.join(accepted) or 'none'})", hosts, blame="manifest"))
    if not out and counts[0] + counts[1]:
        skipped = [f for f in FIELD_NAMES if f in unchecked]
        out.append(finding("manifest", "PASS", f"{len(counts[0]) + len(counts[1])} node(s) match the manifest "
                           f"({len(counts[0])} listed, {len(counts[1])} judged by class)"
                           + (f"; not checked (not measured): {', '.join(skipped)}" if skipped else ""),
                           counts[0] + counts[1]))
    return out


def _is_num(v):
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _is_count(v):
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


# What a manifest value must be, by kind: (test, words for the problem line).
VALUE_KINDS = {"text": (lambda v: isinstance(v, str), "a string"), "count": (_is_count, "an integer >= 0"),
               "runs": (lambda v: _is_count(v) and v >= 1, "an integer >= 1"),
               "rate": (lambda v: _is_num(v) and v > 0, "a finite number > 0"),
               "memory": (lambda v: isinstance(v, dict) and bool(v) and all(_is_count(n) and n > 0 for n in v.values()),
                          "an object {GPU model: bytes > 0}"),
               "names": (lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v), "a list of strings"),
               "env": (lambda v: isinstance(v, dict) and all(isinstance(x, str) for x in v.values()),
                       "an object {variable: string}"),
               "when": (lambda v: v is None or isinstance(v, str), "a string or null")}
FIELD_KINDS = dict({f: "text" for f in FIELD_NAMES}, gpus_per_node="count", ib_ports="count", pcie_width="count",
                   ib_rate="rate", pcie_speed="rate", gpu_memory="memory", transport_intra="names",
                   transport_inter="names", ifaces="names", env="env")
KEY_KINDS = {"gpu_model": "text", "gpus_per_node": "count", "ib_ports": "count", "ib_rate_gbps": "rate"}
CLASS_KEYS = ("key", "hosts", "runs", "first_accepted_at", "last_accepted_at", "fields", "bands")
CLASS_KINDS = {"runs": "runs", "first_accepted_at": "when", "last_accepted_at": "when"}
ACCEPTED_KINDS = {"check": "text", "key": "text", "reason": "text", "accepted_at": "when"}
SPAN_KEYS = ("ref", "lo", "hi")


def _qn(name):
    return json.dumps(name)


def _first_problem(problems):
    return next(filter(None, problems), None)


def _kind_problem(where, v, kind):
    ok, words = VALUE_KINDS[kind]
    return None if ok(v) else f"{where}: {json.dumps(v, default=str)[:60]} is not {words}"


def _kinds_problem(where, x, kinds):
    """The first value of x ({key: value}) not of its kind (kinds: {key: a kind of VALUE_KINDS}), or None."""
    return _first_problem(_kind_problem(f"{where}.{k}", x[k], kind) for k, kind in kinds.items())


def _hosts_problem(where, x):
    if isinstance(x, list):
        return None if all(isinstance(h, str) and h for h in x) else f"{where}: a list of host names must hold names"
    if not isinstance(x, str):
        return f"{where}: {json.dumps(x, default=str)[:60]} is not a hostlist"
    try:
        expand_hostlist(x) if x else None
    except (ValueError, TypeError) as e:
        return f"{where}: {x[:60]!r} is not a hostlist ({e})"
    return None


def _object_problem(where, x, keys):
    """x an object of exactly these keys."""
    if not isinstance(x, dict):
        return f"{where}: not an object"
    extra = [k for k in x if k not in keys]
    missing = [k for k in keys if k not in x]
    return (f"{where}: unknown key {_qn(extra[0])}" if extra else
            f"{where}: {_qn(missing[0])} is missing" if missing else None)


def _span_problem(where, w, keys=SPAN_KEYS):
    """A band (keys: its own) or one run of its window: an object of keys; ref, lo, hi finite and above 0, lo
    not above hi."""
    return (_object_problem(where, w, keys) or _kinds_problem(where, w, dict.fromkeys(SPAN_KEYS, "rate"))
            or (f"{where}: lo {w['lo']:g} is above hi {w['hi']:g}" if w["lo"] > w["hi"] else None))


def _band_problem(where, b):
    problem = (_span_problem(where, b, (*SPAN_KEYS, "runs", "window"))
               or _kind_problem(f"{where}.runs", b["runs"], "runs"))
    if problem or not isinstance(b["window"], list) or not b["window"]:
        return problem or f"{where}.window: not a non-empty list"
    return _first_problem(_span_problem(f"{where}.window[{i}]", w) for i, w in enumerate(b["window"]))


def _fields_problem(where, fields):
    if not isinstance(fields, dict):
        return f"{where}: not an object"
    for field, variants in fields.items():
        at = f"{where}.{field}"
        if field not in FIELD_KINDS:
            return f"{at}: unknown field (known: {', '.join(FIELD_NAMES)})"
        if not isinstance(variants, list):
            return f"{at}: not a list of {{value, hosts}}"
        if problem := _first_problem(_object_problem(f"{at}[{i}]", var, ("value", "hosts"))
                                     or _kind_problem(f"{at}[{i}].value", var["value"], FIELD_KINDS[field])
                                     or _hosts_problem(f"{at}[{i}].hosts", var["hosts"])
                                     for i, var in enumerate(variants)):
            return problem
    return None


def _class_problem(name, c):
    where = f"classes[{_qn(name)}]"
    return (_object_problem(where, c, CLASS_KEYS) or _object_problem(f"{where}.key", c["key"], KEY_KINDS)
            or _kinds_problem(f"{where}.key", c["key"], {k: v for k, v in KEY_KINDS.items() if c["key"][k] is not None})
            or _hosts_problem(f"{where}.hosts", c["hosts"]) or _kinds_problem(where, c, CLASS_KINDS)
            or _fields_problem(f"{where}.fields", c["fields"])
            or (None if isinstance(c["bands"], dict) else f"{where}.bands: not an object")
            or _first_problem(_band_problem(f"{where}.bands[{_qn(k)}]", b) for k, b in c["bands"].items()))


def _accepted_problem(entries):
    if not isinstance(entries, list):
        return "accepted_warns: not a list"
    return _first_problem(_object_problem(at, e, (*ACCEPTED_KINDS, "hosts")) or _kinds_problem(at, e, ACCEPTED_KINDS)
                          or _hosts_problem(f"{at}.hosts", e["hosts"])
                          or (None if e["check"] in CHECKS else f"{at}.check: {e['check'][:60]!r} is not a check name")
                          for at, e in ((f"accepted_warns[{i}]", e) for i, e in enumerate(entries)))


def _schema_problem(data):
    sv = data.get("schema_version")
    if not isinstance(sv, int) or isinstance(sv, bool) or sv < 1:
        return f"schema_version {sv!r} is not a positive integer"
    if sv > MANIFEST_SCHEMA_VERSION:
        return (f"schema_version {sv} is newer than the {MANIFEST_SCHEMA_VERSION} this tool reads (written by "
                f"ai-infra-validator {data.get('version', '?')}, this is {VERSION}): use that version or newer")
    if sv < MANIFEST_SCHEMA_VERSION:
        return (f"schema_version {sv} is an old manifest (its node classes and speed bands follow the GPUs a job "
                f"was given, not the node's own); this tool reads {MANIFEST_SCHEMA_VERSION}: move the file aside "
                f"and accept the nodes again with --save-manifest")
    return None


def manifest_problem(data):
    """Why data is not a manifest this tool can use (one line naming the field: classes["C"].bands["B"].lo),
    or None. Every field of every class is checked, so that a manifest that loads is judged without error."""
    if not isinstance(data, dict) or data.get("tool") != MANIFEST_TOOL:
        return "not an ai-infra-validator manifest (no \"tool\": \"ai-infra-validator\")"
    top = ("schema_version", "tool", "version", "written_at", "classes", "accepted_warns")
    problem = (_schema_problem(data) or _object_problem("manifest", data, top)
               or _kind_problem("version", data["version"], "text")
               or _kind_problem("written_at", data["written_at"], "when"))
    if problem:
        return problem
    if not isinstance(data["classes"], dict):
        return "classes: not an object"
    seen = {}
    for name, c in data["classes"].items():
        if problem := _class_problem(name, c):
            return problem
        for h in _hosts_in(c["hosts"]):
            if h in seen:
                return f"host {h} is listed in two classes: '{seen[h]}' and '{name}'"
            seen[h] = name
    return _accepted_problem(data["accepted_warns"])


def manifest_refusal(state):
    """Why this run's state may not be accepted ('' when it may: a PASS; its WARNs are saved as accepted)."""
    if state.get("verdict") != "PASS":
        return f"the verdict is {state.get('verdict')} (exit {state.get('exit_code')})"
    return ""


BAND_SLACK = 0.9      # a measurement below this fraction of its band's lowest accepted value is "below the band"
BAND_SLACK_CPU = 0.1  # on CPU ranks share cores: only a collapse counts (as in the screen's own judge)


def _band_gpu_words(g):
    """'node1 GPU 3 (GPU-..., rank 3)': the GPU of one screen row by node, local index, UUID and rank."""
    uuid = f"{g['uuid']}, " if g.get("uuid") else ""
    return f"{g.get('host')} GPU {g.get('local_rank', '-')} ({uuid}rank {g.get('rank', '-')})"


def _band_points(screen, host_class):
    """(class, band, value, hosts, ranks, where, tries) of each measurement of one screen, the band named by what
    the value depends on: 'gpu.tflops/<model>', 'gpu.hbm_gbps/<model>' per GPU, 'intra.busbw/<n> ranks' per node
    (ranks per node), 'inter.busbw/<k> rails' per pair of nodes of one class (rails the pair ran at once).
    ranks: the ranks measured; where: the words naming them (a GPU by node, index, UUID and rank); tries: how
    many times the value was measured (the best counting)."""
    screen = screen or {}
    for g in screen.get("gpu") or []:
        cls, model = host_class.get(g.get("host")), g.get("model") or "unknown"
        ranks, where = [g["rank"]] if g.get("rank") is not None else [], _band_gpu_words(g)
        tries = int(g.get("tries") or 1)
        yield cls, f"gpu.tflops/{model}", g.get("tflops"), [g.get("host")], ranks, where, tries
        yield cls, f"gpu.hbm_gbps/{model}", g.get("hbm_gbps"), [g.get("host")], ranks, where, tries
    for n in screen.get("intra") or []:
        ranks = list(n.get("ranks") or ())
        yield host_class.get(n.get("host")), f"intra.busbw/{len(ranks)} ranks", n.get("busbw"), \
            [n.get("host")], ranks, f"{n.get('host')} (ranks {format_ranges(ranks) or '-'})", \
            max(int(n.get("tries") or 1), len(n.get("values") or ()))
    pairs = screen.get("pairs") or []
    rails = collections.Counter((pr.get("round"), tuple(sorted(pr.get("nodes") or ()))) for pr in pairs)
    for pr in pairs:
        hosts, ranks = sorted(pr.get("nodes") or ()), list(pr.get("ranks") or ())
        classes = {host_class.get(h) for h in hosts}
        if len(classes) == 1:
            rail = f" rail {pr['rail']}" if pr.get("rail") is not None else ""
            yield classes.pop(), f"inter.busbw/{rails[(pr.get('round'), tuple(hosts))]} rails", pr.get("busbw"), \
                hosts, ranks, f"{compress_hostlist(hosts)}{rail} (ranks {format_ranges(ranks) or '-'})", \
                int(pr.get("tries") or 1)


def _host_classes(records):
    return {h: class_name(host_view(rs)[1]) for h, rs in _by_host(records).items()}


def screen_bands(screen, records):
    """The speed bands of one accepted run, per node class: {class: {band: {'ref', 'lo', 'hi', 'runs': 1,
    'window': [one entry]}}}. ref is the screen's own reference (upper quartile of the peers), lo/hi the
    extremes; merge_bands keeps the last BAND_WINDOW accepted runs, and they judge from BAND_MIN_RUNS runs on."""
    samples = {}
    for cls, band, v, *_ in _band_points(screen, _host_classes(records)):
        if cls is not None and _is_num(v) and v > 0:
            samples.setdefault(cls, {}).setdefault(band, []).append(float(v))
    return {cls: {b: _band_from([{"ref": screen_reference(v)["ref"], "lo": min(v), "hi": max(v)}], 1)
                  for b, v in sorted(bands.items())} for cls, bands in samples.items()}


def judge_bands(manifest, records, screen):
    """This run's screen against the accepted bands of each node's class (bands of BAND_MIN_RUNS runs or
    more, of the same GPU model, ranks per node or rails per pair): a measurement below BAND_SLACK (on CPU
    BAND_SLACK_CPU) x the band's lowest value in its window FAILs, naming its host when it was measured again
    (a value of one host measured once, or of a pair of nodes, names none: _below_band)."""
    if not manifest or not screen:
        return []
    slack = BAND_SLACK_CPU if screen.get("cpu") else BAND_SLACK
    return [f for cls, band, v, hosts, ranks, where, tries in _band_points(screen, _host_classes(records))
            for f in _below_band(manifest, cls, band, v, hosts, slack, ranks, where, tries)]


def _below_band(manifest, cls, band, value, hosts, slack, ranks=(), where=None, tries=1):
    b = ((manifest.get("classes") or {}).get(cls) or {}).get("bands", {}).get(band)
    if not b or b.get("runs", 1) < BAND_MIN_RUNS or not _is_num(value) or value >= slack * b["lo"]:
        return []
    f = finding("manifest", "FAIL", f"{band} {value:.4g} on {where or compress_hostlist(sorted(hosts))} is "
                f"below the accepted band of {cls} ({b['lo']:.4g}-{b['hi']:.4g}, reference {b['ref']:.4g}, "
                f"{b['runs']} runs; FAIL below {slack:g} x its lowest)", hosts, ranks, blame="manifest")
    if len(set(hosts)) > 1:  # a pair of nodes: the value is the link's, neither end is singled out
        return [unlocalised(f, "link", "the screen's inter-node rows, which measure each node with other partners")]
    return [f if tries >= 2 else unlocalised(f, "once", "a re-run: a value below the band again names its host")]


def diff_manifests(a, b):
    """Lines 'class/field: old -> new (hosts)' from manifest a to b: hosts joining or leaving a class; per
    field, hosts in both whose value changed and new hosts whose value is none of a's; bands."""
    ca, cb = ({k: _expand_class(c) for k, c in m["classes"].items()} for m in (a, b))
    out = []
    for key in sorted(set(ca) | set(cb)):
        x, y = ca.get(key), cb.get(key)
        hx, hy = (x or {}).get("hosts", set()), (y or {}).get("hosts", set())
        if hx != hy:
            out.append(f"{key}/hosts: {_hl(hx)} -> {_hl(hy)} ({_hl(hx ^ hy)})")
        if x and y:
            out += _diff_fields(key, x["values"], y["values"])
            if _canon(x["bands"]) != _canon(y["bands"]):
                out.append(f"{key}/bands: {_canon(x['bands'])} -> {_canon(y['bands'])} ({_hl(hx | hy)})")
    wa, wb = ({e["key"]: set(_hosts_in(e["hosts"])) for e in m.get("accepted_warns") or []} for m in (a, b))
    out += [f"accepted WARN {k}: {_hl(wa.get(k, ()))} -> {_hl(wb.get(k, ()))}"
            for k in sorted(set(wa) | set(wb)) if wa.get(k) != wb.get(k)]
    return out


def _diff_fields(key, va, vb):
    out = []
    for field in sorted(set(va) | set(vb), key=lambda f: (FIELD_NAMES.index(f) if f in FIELD_NAMES else 99, f)):
        a, b = va.get(field, {}), vb.get(field, {})
        known, groups = {_canon(v) for v in a.values()}, {}
        for h, new in sorted(b.items()):
            if h not in a and _canon(new) in known:
                continue
            old = a[h] if h in a else _most_common(a)
            for label, o, n in (_changes(field, old, new) if _canon(old) != _canon(new) else []):
                groups.setdefault((label, o, n), []).append(h)
        out += [f"{key}/{label}: {o} -> {n} ({_hl(hs)})" for (label, o, n), hs in sorted(groups.items())]
    return out



# ============================================================================ aiv/screen/plan.py
# Floor 3: the performance screen's plan: rounds of node pairs per rail, suspects, re-measurements,
# The performance screen finds the slow or broken part: a GPU, a node's NVLink/PCIe, a node's NIC on
# one rail, a whole node's network, or one path between two nodes. The runtime measures; these pure
# functions plan the rounds and judge plain data. Units: TFLOPS = 1e12 FLOP/s, GB/s = 1e9 B/s.
#
# Every judgement compares a value with a robust reference of its peers, like for like (same GPU model
# for GPU numbers; same ranks per node and GPU model for intra-node groups; same rail for inter-node
# pair measurements). Faults only LOWER numbers, so the
# reference is the upper quartile (the maximum below SCREEN_QUARTILE_MIN values): up to three
# quarters of the values may be low without dragging it down (at 4 nodes, half of all pair
# measurements involve a bad node). A WARN must also lie outside the peers' own noise
# (SCREEN_NOISE_SIGMAS standard deviations, estimated from the upper half of the values), so
# run-to-run noise over thousands of measurements names no one; a FAIL needs no such margin. A GPU is
# also judged against its model's row of the per-model table (GPU_TABLE), whatever the number of its
# peers, and every value against its floor (--min-*); screen_judged_against says, per measurement, which
# of these it had (a single value is no peer reference: its own maximum).
#
# Flow for the runtime (rank 0 plans and judges, every rank measures): per GPU, all ranks at once -> the
# per_rank rows of judge_gpu_perf; screen_loop(records, measure) (aiv/screen/loop.py says how: the rounds of
# screen_rounds, one 2- or 3-rank group per rail, every slow measurement again, the suspect round) -> the
# intra and pair rows; findings = judge_screen(screen); report = render_performance(screen).
SCREEN_GPU_FAIL = 0.80      # GPU TFLOPS or memory GB/s below 0.80 of its model's reference: FAIL
SCREEN_GPU_WARN = 0.90      # ... below 0.90: WARN
SCREEN_NET_FAIL = 0.70      # all_reduce busbw (intra-node group, inter-node pair) below 0.70 of the reference: FAIL
SCREEN_NET_WARN = 0.85      # ... below 0.85: WARN
SCREEN_CPU_FAIL = 0.10      # cpu=True: FAIL only below 0.10 of the reference and never WARN (ranks share cores)
SCREEN_NOISE_SIGMAS = 6.0   # a WARN must also lie this many peer standard deviations below the reference
SCREEN_LIST_MAX = 16        # more flagged GPUs or nodes than this: one finding lists the first ones and a count


def screen_rounds(nodes):
    """The schedule's rounds of inter-node groups. nodes: node names (any order, duplicates ignored).
    -> [round, ...], round = [group, ...], group = tuple of node names in natural sorted order s[0..N-1].

    N >= 4, h = N // 2: round 1 pairs s[i] with s[i + h] (the two halves, so in rack-ordered names
    every pair crosses the fabric), round 2 pairs s[i] with s[h + (i + 1) % h]: the partner shifted by
    one, never the same for h >= 2. Odd N: the last node s[N-1] joins round 1's last pair and round 2's
    first pair (groups of three); for N >= 7 no two nodes share a group in both rounds. Every node is
    in exactly one group per round. The number of rounds never grows with N.
    Exceptions, because groups of 2 and 3 cannot do better:
      N = 2: one round, the single pair (a fault can only be named as the pair).
      N = 3: three rounds, the three pairs, one per round (the third node idles); a group of three
             cannot tell its members apart. No suspect round follows: every pair is measured.
      N = 5: one pair meets twice (s[3] and s[4]: round 2's group of three must take two members of
             one round-1 group); the suspect round separates them.
      N < 2: no rounds."""
    s = _screen_sorted(nodes)
    n = len(s)
    if n < 2:
        return []
    if n == 2:
        return [[(s[0], s[1])]]
    if n == 3:
        return [[(s[0], s[1])], [(s[0], s[2])], [(s[1], s[2])]]
    h = n // 2
    r1 = [[s[i], s[i + h]] for i in range(h)]
    r2 = [[s[i], s[h + (i + 1) % h]] for i in range(h)]
    if n % 2:
        r1[-1].append(s[-1])
        r2[0].append(s[-1])
    return [[tuple(g) for g in r1], [tuple(g) for g in r2]]


def suspect_round(suspects, passing, met=()):
    """The third round: each suspect paired with a distinct passing node.
    suspects: node names; passing: node names in order of preference (nodes that were in no slow
    measurement first); met: groups already measured (tuples of names), whose pairs are avoided while
    another passing node is free. -> [(suspect, passing_node), ...] in natural order of the suspects,
    [] without suspects, or None when there are more suspects than passing nodes: the fault is
    widespread and no third round is run (judge_pairs then FAILs naming every suspect)."""
    sus = _screen_sorted(suspects)
    if not sus:
        return []
    taken = set(sus)
    free = [p for p in dict.fromkeys(passing) if p not in taken]
    if len(sus) > len(free):
        return None
    seen = {frozenset((a, b)) for g in met for a in g for b in g if a != b}
    out = []
    for s in sus:
        pick = next((p for p in free if frozenset((s, p)) not in seen), free[0])
        free.remove(pick)
        out.append((s, pick))
    return out


def screen_fractions(kind, cpu=False):
    """(fail_fraction, warn_fraction or None) for kind 'gpu' or 'net'; cpu=True: (SCREEN_CPU_FAIL, None)."""
    if cpu:
        return SCREEN_CPU_FAIL, None
    return (SCREEN_GPU_FAIL, SCREEN_GPU_WARN) if kind == "gpu" else (SCREEN_NET_FAIL, SCREEN_NET_WARN)


def screen_level(value, ref, fail, warn=None, floor=None):
    """'FAIL', 'WARN' or 'OK' for one value. ref: a screen_reference() dict; fail, warn: fractions of
    ref['ref'] (warn None: never WARN); floor: an absolute minimum (below it: FAIL), or None. A value of
    None (not measured) is 0.0. A WARN also needs the value SCREEN_NOISE_SIGMAS spreads below ref."""
    value = 0.0 if value is None else float(value)
    if floor is not None and value < floor:
        return "FAIL"
    r = ref.get("ref")
    if not r or r <= 0:
        return "OK"
    if value < fail * r:
        return "FAIL"
    if warn is not None and value < warn * r and value < r - SCREEN_NOISE_SIGMAS * ref.get("spread", 0.0):
        return "WARN"
    return "OK"


def screen_rail_refs(results):
    """Like for like: {rail: screen_reference of that rail's measurements}. A rail whose own reference is
    below SCREEN_NET_FAIL of the median of the rails' references (slow nearly everywhere) is judged
    against that median instead, so a rail that is broken on most nodes still fails."""
    refs = {rail: screen_reference(m.get("busbw") for m in results if m["rail"] == rail)
            for rail in sorted({m["rail"] for m in results})}
    mid = _screen_median([r["ref"] for r in refs.values() if r["ref"]])
    for rail, r in refs.items():
        if mid and (r["ref"] or 0.0) < SCREEN_NET_FAIL * mid:
            refs[rail] = dict(r, ref=mid, how="median of the rails")
    return refs


def screen_pair_levels(results, min_busbw=None, cpu=False):
    """-> (refs per rail, ['FAIL'|'WARN'|'OK' per measurement against its rail's reference])."""
    fail, warn = screen_fractions("net", cpu)
    refs = screen_rail_refs(results)
    return refs, [screen_level(m.get("busbw"), refs[m["rail"]], fail, warn, min_busbw) for m in results]


# -- the runtime's plain data: the rounds' groups, each rank's part, the rows the judges take, who hung
def screen_round_label(name):
    """A batch's name in words: 'intra' -> 'the intra-node round', 'p2' -> 'round 2', 'b5' -> 'batch 5'."""
    return "the intra-node round" if name == "intra" else f"round {name[1:]}" if name[:1] == "p" else \
        f"batch {name[1:]}"


def screen_layout(records):
    """{host: {local_rank: rank}} from the gathered records."""
    by_node = {}
    for r in records:
        by_node.setdefault(r["host"], {})[r["local_rank"]] = r["rank"]
    return by_node


def screen_rail_groups(node_groups, by_node):
    """Per group of nodes, one group per rail (a local rank present on each of them):
    [{'ranks': sorted global ranks, 'nodes': [host, ...], 'rail': local rank}]."""
    return [{"ranks": sorted(by_node[n][rail] for n in nodes), "nodes": list(nodes), "rail": rail}
            for nodes in node_groups for rail in sorted(set.intersection(*(set(by_node.get(n, {})) for n in nodes)))]


def screen_plan(records):
    """The screen's rounds of groups, in the order they run: [(name, groups)]: 'intra' (one group of
    all the ranks of each node with two or more, rail None), then 'p1', 'p2' (and 'p3' for three
    nodes) from screen_rounds, one group per rail (screen_rail_groups). records: the gathered
    records ({'rank', 'host', 'local_rank'})."""
    by_node = screen_layout(records)
    intra = [{"ranks": sorted(lr.values()), "nodes": [h], "rail": None}
             for h, lr in sorted(by_node.items(), key=lambda x: _screen_key(x[0])) if len(lr) > 1]
    return [("intra", intra)] + [(f"p{i}", screen_rail_groups(rnd, by_node))
                                 for i, rnd in enumerate(screen_rounds(by_node), 1)]


def screen_rank_plans(rounds, world):
    """Each rank's part of the rounds: {rank: {name: entry}}; entry = {'mode': 'none' (no group in the
    round), 'world' (one group of every rank: the default group serves) or 'split' (the groups are
    split off the default group), 'g': this rank's group (sorted ranks) or None, and with 'split' for a
    rank in no group 'other': a group of the round (NCCL's split needs one to leave)}."""
    plans = {r: {} for r in range(world)}
    for name, groups in rounds:
        mode = "none" if not groups else \
            "world" if len(groups) == 1 and groups[0]["ranks"] == list(range(world)) else "split"
        mine = {r: g["ranks"] for g in groups for r in g["ranks"]}
        for r in range(world):
            e = plans[r][name] = {"mode": mode, "g": mine.get(r)}
            if mode == "split" and r not in mine:
                e["other"] = groups[0]["ranks"]
    return plans


def screen_split_groups(rounds, world):
    """How many groups the rounds make by splitting the default group (screen_rank_plans' 'split' mode)."""
    return sum(len(gs) for _, gs in rounds if gs and not (len(gs) == 1 and gs[0]["ranks"] == list(range(world))))


def screen_measured(groups, posts):
    """The groups whose members all posted a busbw, each with the slowest member's busbw and time:
    [dict(group, busbw=, time_us=)]. posts: {rank: {'busbw', 'time_us', ...}}."""
    out = []
    for g in groups:
        ps = [posts.get(r) for r in g["ranks"]]
        if all(p and p.get("busbw") is not None for p in ps):
            slow = min(ps, key=lambda p: p["busbw"])
            out.append(dict(g, busbw=slow["busbw"], time_us=slow.get("time_us")))
    return out


def screen_pair_hca(ranks, posts, records):
    """{host: HCA} of a pair group's ranks: what each rank's NCCL log showed (its post's 'hca'), else the
    HCA nearest its GPU in sysfs (its record's gpu 'hca'); None where none is known ('' in a post: sockets,
    no HCA, and no sysfs guess either). records: the gathered records, or {rank: record}."""
    recs = records if isinstance(records, dict) else {r["rank"]: r for r in records}
    out = {}
    for r in ranks:
        h = (posts.get(r) or {}).get("hca")
        rec = recs.get(r) or {}
        if h is None:
            h = (rec.get("gpu") or {}).get("hca")
        if h and rec.get("host"):
            out[rec["host"]] = h
    return out or None


def screen_creation(groups, posts):
    """Seconds a round's group creation took: per group its last member's time (the others also waited
    for the last to arrive), the slowest group's; 0.0 when nothing was created."""
    per = [min(posts[r].get("split_s") or 0.0 for r in g["ranks"] if r in posts)
           for g in groups if any(r in posts for r in g["ranks"])]
    return max(per, default=0.0)


def screen_gpu_rows(records, posts, cpu=False):
    """judge_gpu_perf's per_rank rows: each posting rank's record facts and its measurement, with its GPU's
    row of its node's one nvidia-smi call (node.smi.gpus, by UUID: ECC and row remapping) where there is one."""
    smi = {u: row for rec in records
           for u, row in (((rec.get("node") or {}).get("smi") or {}).get("gpus") or {}).items()}
    return [{"rank": rec["rank"], "host": rec["host"], "local_rank": rec["local_rank"], "uuid": g.get("uuid"),
             "model": g.get("name") or ("cpu" if cpu else None), **(smi.get(g.get("uuid")) or {}),
             **{k: v for k, v in posts[rec["rank"]].items() if k != "rank"}}
            for rec in sorted(records, key=lambda r: r["rank"]) if posts.get(rec["rank"]) is not None
            for g in [rec.get("gpu") or {}]]


def _screen_group_words(g):
    if g.get("gpu"):
        return f"the GPU of rank {g['ranks'][0]} on {g['nodes'][0]}, measured again"
    if g.get("gpus"):
        return f"GPUs {g['gpus'][0]} and {g['gpus'][1]} of {g['nodes'][0]} (ranks {format_ranges(g['ranks'])})"
    if g.get("rail") is None:
        return f"the intra-node group of {g['nodes'][0]} (ranks {format_ranges(g['ranks'])})"
    if len(g["nodes"]) == 2:
        return f"link between {g['nodes'][0]} and {g['nodes'][1]} on rail {g['rail']}"
    return f"links among {', '.join(g['nodes'])} on rail {g['rail']}"


def _stuck_states(hung, loose, stuck, issued, host_of):
    """What each unfinished rank of a screen round issued last: ({rank: 'behind'|'waiting'|'idle'|'unposted'|...},
    [words naming the members that never issued their group's collective]); ({}, []) when not asked."""
    states, behind_words = {}, []
    if issued is None:
        return states, behind_words
    for g in hung:
        an = issued_states(g["ranks"], issued, [r for r in g["ranks"] if r in stuck], group_key(g["ranks"]))
        states.update(an["states"])
        behind = [r for r in g["ranks"] if an["states"].get(r) == "behind"]
        if behind:
            behind_words.append(never_issued_text(behind, an, host_of))
    for r in loose:  # in no group of the round: its part was its post alone
        if r in stuck:
            p = issued.get(r)
            states[r] = "unposted" if p is None else "waiting" if p.get("inflight") else "idle"
    return states, behind_words


def screen_stuck(phase, how, world, rounds, posted, host_of, live, errors, silent_hosts=(), issued=None):
    """Who did not finish a screen round (one FAIL finding under PHASE_CHECK[phase]), or None when every
    rank posted every round. rounds: [(name, groups)] of the phase in the order they ran; posted: {name:
    ranks that posted it}; how: 'did not complete within 30s', 'failed', ...; live, errors, silent_hosts
    as judge_unfinished; issued: {rank: its post of what it issued last, or None} (None: not asked). The
    first round some rank did not post names its groups with a member missing (the node pair and rail, or
    the node) and the missing ranks in no group of it. The culprits follow judge_unfinished's law: a rank's
    own process state (dead, frozen, unreachable) anywhere; a signal or the tool's own error names nobody;
    an error a rank reported itself; a member that never issued its group's collective while the other end
    did, or a rank outside any collective that never finished its part of the round while others did.
    Else (both ends inside the collective: the link; records not collected) no host is named, and the
    finding says why and what would localise it."""
    todo = [(n, gs, m) for n, gs in rounds for m in [sorted(set(range(world)) - set(posted.get(n) or ()))] if m]
    if not todo:
        return None
    name, groups, missing = todo[0]
    label = screen_round_label(name)
    hung = [g for g in groups if set(g["ranks"]) & set(missing)]
    loose = sorted(set(missing) - {r for g in hung for r in g["ranks"]})
    kinds = {r: unfinished_kind(r, live, errors, host_of, silent_hosts) for r in range(world)}
    hard = [r for r in range(world) if kinds[r] in PROCESS_KINDS]
    if not hard and any(kinds[r] in ("terminated", "internal") for r in range(world)):
        return judge_unfinished(phase, f"{label} {how}", world, host_of,  # as judge_unfinished: nobody's fault
                                {r: -1 if r in missing else PHASES.index(phase) for r in range(world)}, live, errors)
    stuck = [r for r in missing if kinds[r] == "stuck"]
    states, behind_words = _stuck_states(hung, loose, stuck, issued, host_of)
    done = sorted(set(range(world)) - set(missing))
    all_issued = None
    if stuck and hung and all(states.get(r) == "waiting" for r in stuck):
        all_issued = (f"every member of {_screen_group_words(hung[0])}{' and the others' if len(hung) > 1 else ''} "
                      "issued its all_reduce and it did not finish: the link, which neither end's own state singles "
                      "out", LINK_HINT)
    culprits, _, _, evidence, unloc = hang_culprits(kinds, missing, world, states, bool(done), issued is not None,
                                                    all_issued)
    idle = [r for r in culprits if evidence == "never-issued" and states.get(r) == "idle"]
    what = [_screen_group_words(g) for g in hung[:8]] + ([f"{len(hung) - 8} more group(s)"] if len(hung) > 8 else [])
    what += [f"{on_hosts(loose, host_of)} (in no group of {label})"] if loose else []
    parts = behind_words + ([never_finished_text(idle, label, done, host_of)] if idle and evidence ==
                            "never-issued" else [])
    named = set(culprits)

    def ranks_of(k):  # those of kind k; the ones named for never issuing are said above
        return ([r for r in missing if kinds[r] == k and not (evidence == "never-issued" and r in named)]
                + [r for r in hard if kinds[r] == k and r not in missing])
    parts += unfinished_parts(ranks_of, states, named, host_of, issued is not None)
    first_err = next((errors[r]["line"] for r in culprits if r in errors), None)
    reason = (f"{'; '.join(what)} {how} ({'; '.join(parts)}); {world - len(missing)}/{world} rank(s) finished "
              f"{label}" + (f"; first error: {first_err}" if first_err else "")
              + (f"; {unlocalised_words(unloc)}" if unloc else ""))
    code = EXIT_FAIL if any(kinds[r] == "dead" for r in hard) else \
        EXIT_FAIL if evidence in ("own", "everyone") and all(kinds[r] in ("error", "terminated") for r in missing) \
        else EXIT_TIMEOUT
    check = "gpu-perf" if hung and all(g.get("gpu") for g in hung) else \
        "intra-node" if hung and all(g.get("rail") is None for g in hung) else PHASE_CHECK[phase]
    f = finding(check, "FAIL", reason, _screen_sorted(host_of.get(r, "?") for r in culprits), culprits, code=code)
    f["blame"] = evidence
    if unloc:
        f["unlocalised"] = unloc
    return f


def _per_status(items, status_of):
    """Beyond SCREEN_LIST_MAX flagged items, one finding per status: [(status, its items, '; and <n> more'
    past the first SCREEN_LIST_MAX, or '')] for FAIL, then WARN, where there are any."""
    return [(s, sel, f"; and {len(sel) - SCREEN_LIST_MAX} more" if len(sel) > SCREEN_LIST_MAX else "")
            for s in ("FAIL", "WARN") for sel in [[x for x in items if status_of(x) == s]] if sel]


def _screen_worst(levels):
    return "FAIL" if "FAIL" in levels else "WARN" if "WARN" in levels else "OK"


def _sn(x):
    """A screen number for the report: one decimal from 1 up, two significant digits below (CPU runs
    measure GB/s and TFLOPS in hundredths)."""
    x = float(x)
    return f"{x:.1f}" if abs(x) >= 1 or x == 0 else f"{x:.2g}"


def _s3(x):
    """A value for a picture: 3 significant digits (0.0921, 12.3, 670, 4213), never rounded to nothing."""
    x = float(x)
    return f"{x:.3g}" if abs(x) >= 1e6 else f"{x:.0f}" if abs(x) >= 100 else f"{x:.3g}"


def _screen_ref_text(ref, unit, noun=""):
    return f"{_sn(ref['ref'])} {unit} ({ref['how']} of {ref['count']}{' ' + noun if noun else ''})"


def _screen_rule(kind, cpu):
    fail, warn = screen_fractions(kind, cpu)
    if cpu:
        return (f"CPU ranks share cores, so their numbers are not comparable: only values below {fail:.2f} "
                f"of the reference FAIL and nothing WARNs")
    return f"FAIL below {fail:.2f}, WARN below {warn:.2f} of the reference"


def _screen_names(names, limit=4):
    names = list(names)
    more = f" and {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(map(str, names[:limit])) + more


SCREEN_GPU_METRICS = (("tflops", "TFLOPS", "min_tflops"), ("hbm_gbps", "GB/s memory", "min_hbm"))
SCREEN_GPU_LABELS = {"tflops": "matmul TFLOPS", "hbm_gbps": "memory GB/s"}
SCREEN_FLOOR_OPTIONS = {"min_tflops": "--min-tflops", "min_hbm": "--min-hbm", "min_busbw_intra": "--min-busbw-intra",
                        "min_busbw_inter": "--min-busbw-inter"}


def screen_against(what, count, noun, kind, peers, unit, table=None, floor=None, floor_name=None, band=None,
                   no_table=""):
    """What one measurement was judged against, as plain data and one line of text. what: e.g. 'matmul
    TFLOPS of NVIDIA H200'; count: how many values of it, each a noun ('GPU', 'node') of its kind ('model', 'class');
    peers: their screen_reference, a reference only from 2 values on (one value is its own maximum);
    table: {'row', 'ref'} or None (no_table: why there is none); floor: the --min-* value (floor_name its
    key) or None; band: the manifest band's name, '' for none, None when not known here (left out).
    -> {'measurement', 'count', 'peers': {'ref', 'how', 'count'}|None, 'table', 'floor', 'band', 'judged',
    'missing': [what it was not judged against], 'text'}."""
    p = {k: peers[k] for k in ("ref", "how", "count")} if peers.get("count", 0) >= 2 and peers.get("ref") else None
    s = "s" if count != 1 else ""
    got, miss = [], []  # miss: (as an item of 'not against', as an item of 'no reference')
    if p:
        got.append(f"{p['count']} peers (reference {_sn(p['ref'])} {unit}, {p['how']})")
    else:
        alone = f"{count} {noun}{s} of its {kind}" if count == 1 else f"{count} {noun}{s} of its {kind}, none measured"
        miss.append((f"peers ({alone})", alone))
    if table:
        got.append(f"the table row {table['row']} ({_sn(table['ref'])} {unit})")
    else:
        miss.append((f"a table row{' (' + no_table + ')' if no_table else ''}",
                     f"no table row{' (' + no_table + ')' if no_table else ''}"))
    if floor is not None:
        got.append(f"the floor {floor:g} {unit} ({SCREEN_FLOOR_OPTIONS.get(floor_name, 'floor')})")
    else:
        miss.append(("a floor", "no floor"))
    if band:
        got.append(f"the manifest band {band}")
    elif band is not None:
        miss.append(("a manifest band", "no manifest band"))
    head = f"{what} ({count} {noun}{s})"
    text = (f"{head}: no reference: {', '.join(n for _, n in miss)}" if not got else
            f"{head}: against {', '.join(got)}" + (f"; not against {', '.join(m for m, _ in miss)}" if miss else ""))
    return {"measurement": what, "count": count, "peers": p, "table": table, "floor": floor,
            "band": band or None, "judged": bool(got), "missing": [m for m, _ in miss], "text": text}



# ============================================================================ aiv/screen/gpu.py
# Floor 3: the GPU screen's judges: each GPU's matmul TFLOPS and memory GB/s against its model's peers, the
# Per-model table: what a healthy GPU of a model reaches in this screen's own measurements (the
# SCREEN_MATMUL_N^3 bf16 matmul, the SCREEN_COPY_BYTES device copy counted read + write). Peers cannot
# see what all of them share (a second job on every GPU, a node or a cluster slow throughout, a job on
# one GPU), so a GPU whose model has a row is ALSO judged against it, whatever the number of its peers:
# below SCREEN_TABLE_FAIL of the row FAIL, below SCREEN_TABLE_WARN WARN. Rows sit below what healthy
# GPUs reach (a false FAIL stops a job for nothing); a row taken from a spec or another benchmark rather
# than measured by this tool sits lower still. Key: the name torch reports (torch.cuda.get_device_name),
# lower-cased, whitespace collapsed, matched by the row's pattern; PCIe and NVL boards (lower power and
# clocks) never match a row (GPU_TABLE_EXCLUDE). Add a row: its name, a pattern that matches only that
# board, TFLOPS and GB/s from a clean run of this tool on a healthy, idle GPU (the screen-gpu progress
# line) lowered by a few percent, and a comment saying where the numbers come from.
SCREEN_TABLE_FAIL = 0.70    # GPU TFLOPS or memory GB/s below 0.70 of its model's row: FAIL
SCREEN_TABLE_WARN = 0.85    # ... below 0.85: WARN
GPU_TABLE_EXCLUDE = r"\b(pcie|nvl)\b"
GPU_TABLE = (  # (row, pattern, TFLOPS, GB/s)
    # measured by this tool on H200 SXM 141 GB: 670-686 TFLOPS, 4,212-4,213 GB/s (20 back-to-back
    # matmuls elsewhere: 760-790); set below the lowest run. "NVIDIA H200" (not GH200, not H200 NVL)
    ("H200 SXM", r"\bh200\b", 660.0, 4100.0),
    # not measured here: the same GH100 compute at 700 W as the H200 (MAMF best shape 794.5 TFLOPS,
    # stas00/ml-engineering), so below the H200 row; HBM3 spec 3,350 GB/s x 0.88 (this tool's H200 copy
    # against its 4,800 spec) = 2,950, set conservatively at 2,800. "NVIDIA H100 80GB HBM3"
    ("H100 SXM", r"\bh100\b.*\b(hbm3|sxm\d?)\b", 620.0, 2800.0),
    # not measured here: MAMF 271.2 TFLOPS x 0.86 (this tool's 8192^3 against the back-to-back H200 number)
    # = 233, set at 220; HBM2e spec 2,039 / 1,555 GB/s x 0.88 = 1,790 / 1,370, set at 1,650 / 1,250
    ("A100 SXM 80GB", r"\ba100\b.*\bsxm\d?\b.*\b80 ?gb\b", 220.0, 1650.0),   # "NVIDIA A100-SXM4-80GB"
    ("A100 SXM 40GB", r"\ba100\b.*\bsxm\d?\b.*\b40 ?gb\b", 220.0, 1250.0),   # "NVIDIA A100-SXM4-40GB"
    # not measured here: MAMF 1,745 TFLOPS x 0.86 = 1,500, set at 1,350 (boards ship at 1,000 W and
    # more); HBM3e spec 8,000 GB/s x 0.88 = 7,040, set at 6,200. "NVIDIA B200" (not GB200)
    ("B200", r"\bb200\b", 1350.0, 6200.0),
)


def gpu_table_row(model):
    """The GPU_TABLE row for a device name (case and spacing ignored) -> {'row', 'tflops', 'hbm_gbps'}, or
    None: no row, a PCIe or NVL board, no name."""
    name = " ".join(str(model or "").lower().split())
    if not name or re.search(GPU_TABLE_EXCLUDE, name):
        return None
    return next(({"row": row, "tflops": tflops, "hbm_gbps": gbps} for row, pattern, tflops, gbps in GPU_TABLE
                 if re.search(pattern, name)), None)


def table_level(value, ref):
    """'FAIL', 'WARN' or 'OK' of a value against a table number (None: 'OK'); a value of None is 0.0."""
    return screen_level(value, {"ref": ref}, SCREEN_TABLE_FAIL, SCREEN_TABLE_WARN)


def _table_rule():
    return f"FAIL below {SCREEN_TABLE_FAIL:.2f}, WARN below {SCREEN_TABLE_WARN:.2f} of the row"


def gpu_refs(per_rank, floors, cpu=False, bands=None):
    """Per model and metric what the GPUs were judged against: {(model, metric): {'peers': screen_reference,
    'table': {'row', 'ref'}|None (never on CPU), 'floor': float|None, 'against': screen_against(...)}}.
    bands: the names of the manifest's judging bands (screen_band_names), or None when not known here."""
    by_model, out = group_by(per_rank, lambda r: r.get("model") or "unknown"), {}
    for model, rs in sorted(by_model.items()):
        row = None if cpu else gpu_table_row(model)
        for metric, unit, floor_name in SCREEN_GPU_METRICS:
            peers = screen_reference(r.get(metric) for r in rs)
            table = {"row": row["row"], "ref": row[metric]} if row else None
            floor = floors.get(floor_name)
            band = None if bands is None else (f"gpu.{metric}/{model}" if f"gpu.{metric}/{model}" in bands else "")
            out[(model, metric)] = {
                "peers": peers, "table": table, "floor": floor,
                "against": screen_against(f"{SCREEN_GPU_LABELS[metric]} of {model}", len(rs), "rank" if cpu else "GPU",
                                          "model", peers, unit.split()[0], table, floor, floor_name, band,
                                          "CPU ranks" if cpu else "")}
    return out


def _gpu_flags(per_rank, floors, cpu):
    """-> (refs {(model, metric): peers' screen_reference}, flags {rank: (entry, [(metric, level, text)])}).
    Each value against its floor, its model's table row and its peers (from 2 GPUs of the model on); the
    text names every reference it fell below, each with its rule."""
    fail, warn = screen_fractions("gpu", cpu)
    allrefs, flags = gpu_refs(per_rank, floors, cpu), {}
    for r in per_rank:
        model = r.get("model") or "unknown"
        for metric, unit, floor_name in SCREEN_GPU_METRICS:
            if r.get(metric) is None:
                continue
            ref = allrefs[(model, metric)]
            v, floor, table, peers = float(r[metric]), ref["floor"], ref["table"], ref["peers"]
            why = []
            if floor is not None and v < floor:
                why.append(("FAIL", f"below the floor {floor:g} {unit} ({SCREEN_FLOOR_OPTIONS[floor_name]}, "
                                    f"the floor decided)"))
            lv = table_level(v, table["ref"]) if table else "OK"
            if lv != "OK":
                why.append((lv, f"{v / table['ref']:.2f} of the table row {table['row']} ({_sn(table['ref'])} "
                                f"{unit.split()[0]}; {_table_rule()})"))
            lv = screen_level(v, peers, fail, warn) if peers["count"] >= 2 else "OK"
            if lv != "OK":
                why.append((lv, f"{v / peers['ref']:.2f} of the {model} peers' reference "
                                f"{_screen_ref_text(peers, unit)} ({_screen_rule('gpu', cpu)})"))
            if why:
                level = _screen_worst([w for w, _ in why])
                flags.setdefault(r["rank"], (r, []))[1].append(
                    (metric, level, f"{_sn(v)} {unit} [{level}]: " + " and ".join(t for _, t in why)))
    return {k: x["peers"] for k, x in allrefs.items()}, dict(sorted(flags.items()))


def _gpu_who(r):
    return (f"rank {r['rank']} on {r.get('host')} (local rank {r.get('local_rank')}, GPU {r.get('uuid') or '-'}, "
            f"{r.get('model') or 'unknown model'})")


def _gpu_perf_pass(n_gpus, against, cpu):
    """judge_gpu_perf's PASS: what each model and metric was judged against (gpu_refs' 'against'), and how
    many measurements were judged against nothing."""
    unjudged = sum(not a["judged"] for a in against)
    head = (f"GPU speed within the reference on {n_gpus} GPU(s)" if not unjudged else
            f"GPU speed on {n_gpus} GPU(s), {unjudged} of {len(against)} measurement(s) judged against nothing")
    rules = ([f"peers: {_screen_rule('gpu', cpu)}"] if any(a["peers"] for a in against) else []) \
        + ([f"table: {_table_rule()}"] if any(a["table"] for a in against) else [])
    return finding("gpu-perf", "PASS", f"{head}: " + "; ".join(a["text"] for a in against)
                   + (f" ({'; '.join(rules)})" if rules else ""))


def judge_gpu_perf(per_rank, min_tflops=None, min_hbm=None, cpu=False, who=None):
    """Per-GPU compute and memory speed against its model's table row (GPU_TABLE, GPU only, whatever the
    number of GPUs: below SCREEN_TABLE_FAIL of it FAIL, below SCREEN_TABLE_WARN WARN), the other GPUs of its
    model (from 2 on, per model and metric: below SCREEN_GPU_FAIL of their screen_reference FAIL, below
    SCREEN_GPU_WARN WARN) and the floors min_tflops, min_hbm (FAIL below; None: none). The worst level
    counts; the text names what decided it. cpu=True: no table; ranks sharing cores give numbers that are
    not comparable, so only values below SCREEN_CPU_FAIL of the peers' reference FAIL and nothing WARNs.
    per_rank: [{'rank': int, 'host': str, 'local_rank': int, 'uuid': str|None, 'model': str|None,
                'tflops': float|None (dense matmul, bf16 on GPU, fp32 on CPU, in 1e12 FLOP/s),
                'hbm_gbps': float|None (device-memory copy, 1e9 B/s)}]; None: not measured (skipped).
    -> findings under 'gpu-perf': one per flagged rank naming rank, host, local rank and GPU UUID (one
    finding per status listing them when more than SCREEN_LIST_MAX ranks are flagged), or one PASS
    saying what each model was judged against (or that nothing was) and the count of GPUs. who(row): a GPU's
    words (the node gate's: its index on the node)."""
    per_rank, who = list(per_rank or []), who or _gpu_who
    if not per_rank:
        return []
    floors = {"min_tflops": min_tflops, "min_hbm": min_hbm}
    _, flags = _gpu_flags(per_rank, floors, cpu)
    allrefs = gpu_refs(per_rank, floors, cpu)
    if not flags:
        return [_gpu_perf_pass(len(per_rank), [x["against"] for x in allrefs.values()], cpu)]
    items = list(flags.items())
    if len(items) > SCREEN_LIST_MAX:
        return _gpu_everyone(_gpu_perf_many(items, who), per_rank)
    return _gpu_everyone([_gpu_blame(dict(finding("gpu-perf", _screen_worst([lv for _, lv, _ in fl]),
                                                  f"{who(r)}: " + "; ".join(t for _, _, t in fl)
                                                  + _gpu_unused(r, allrefs), [r.get("host")], [rk]),
                                          evidence=_gpu_evidence(r, allrefs, cpu), action=_gpu_action(r)), [r])
                          for rk, (r, fl) in items], per_rank)


def _gpu_unused(r, allrefs):
    """'; not judged against' what rank r's GPU lacked (a reference missing, per metric), or ''."""
    lack = {}
    for k, _, _ in SCREEN_GPU_METRICS:
        for m in allrefs[(r.get("model") or "unknown", k)]["against"]["missing"]:
            lack.setdefault(m, []).append(SCREEN_GPU_LABELS[k])
    return "; not judged against " + ", ".join(
        m if len(ks) == len(SCREEN_GPU_METRICS) else f"{m} for {' and '.join(ks)}" for m, ks in lack.items()) \
        if lack else ""


def _gpu_evidence(r, allrefs, cpu):
    """How rank r's slow GPU was measured: again (and its first numbers) or once, and how."""
    how = ("its own CPU clock, best of 5 blocks" if cpu else
           "5 device-timed blocks run back to back, median")
    again = (f"measured again on {r.get('host')}, slow again (first " + ", ".join(
        f"{_sn(v)} {u}" for k, u, _ in SCREEN_GPU_METRICS for v in [(r.get("first") or {}).get(k)] if v is not None)
        + ", the better counting)"
        if _gpu_again(r) else f"measured once on {r.get('host')}")
    return f"{again} ({how}){_gpu_unused(r, allrefs)}"


def _gpu_action(r):
    drain = ("drain the node and run the vendor's diagnostics (dcgmi diag -r 3): clocks, power or thermal limits "
             "(see the GPU facts), a degraded PCIe link")
    return drain if _gpu_again(r) else f"re-run the preflight; if the GPU is slow again, {drain}"


def _gpu_perf_many(items, who):
    """More than SCREEN_LIST_MAX flagged GPUs: one finding per status, the first few named."""
    out = []
    for status, sel, more in _per_status([(rk, r, fl) for rk, (r, fl) in items],
                                         lambda x: _screen_worst([lv for _, lv, _ in x[2]])):
        shown = "; ".join(f"{who(r)}: {fl[0][2]}" for _, r, fl in sel[:SCREEN_LIST_MAX])
        hosts = [r.get("host") for _, r, _ in sel]
        out.append(_gpu_blame(dict(finding("gpu-perf", status, f"{len(sel)} GPU(s) slow on {len(set(hosts))} "
                                           f"node(s): {shown}{more}", hosts, [rk for rk, _, _ in sel]),
                                   evidence=f"{len(sel)} GPU(s), each measured "
                                   + ("again" if all(_gpu_again(r) for _, r, _ in sel) else "once"),
                                   action=_gpu_action(sel[0][1])), [r for _, r, _ in sel]))
    return out


def _gpu_everyone(found, per_rank):
    """found, where every GPU of a run on two or more nodes is slow: a cause the nodes share (the image, the
    driver, a power policy, a floor set above what the model reaches), named on no host."""
    hosts = {r.get("host") for r in per_rank}
    slow = {rk for f in found for rk in f["ranks"]}
    if len(hosts) < 2 or slow != {r["rank"] for r in per_rank}:
        return found
    return [f if not f["hosts"] else unlocalised(f, "everyone", "the GPUs' clocks and power limits on every node "
                                                 "(nvidia-smi -q -d PERFORMANCE), the floors set, the image")
            for f in found]


def _gpu_again(r):
    """Whether a GPU row was measured again and was slow again ('tries' >= 2: screen_loop's re-measure rule)."""
    return int(r.get("tries") or 1) >= 2


def _gpu_blame(f, rows):
    """A gpu-perf finding's blame: 'persisted' when every GPU it names was slow again when measured again,
    else 'once' (no host is named: a value measured once is not evidence that persists)."""
    if all(_gpu_again(r) for r in rows):
        return dict(f, blame="persisted")
    return unlocalised(f, "once", "a re-run: a GPU slow again when measured again is named with its host")


def screen_band_lines(manifest, records, screen):
    """The manifest's speed bands that judge this run (as judge_bands: BAND_MIN_RUNS runs or more), each with
    the value below which it FAILs a measurement, for the page to draw: [{'band', 'class', 'hosts' (this run's
    hosts of that class), 'lo', 'hi', 'ref', 'runs', 'slack', 'fail_below'}], [] without a manifest."""
    classes, host_class = (manifest or {}).get("classes") or {}, _host_classes(records or [])
    slack = BAND_SLACK_CPU if (screen or {}).get("cpu") else BAND_SLACK
    seen = {}
    for cls, band, _, hosts, *_ in _band_points(screen, host_class):
        b = ((classes.get(cls) or {}).get("bands") or {}).get(band)
        if b and b.get("runs", 1) >= BAND_MIN_RUNS:
            e = seen.setdefault((band, cls), {"band": band, "class": cls, "hosts": set(), "lo": b["lo"], "hi": b["hi"],
                                              "ref": b["ref"], "runs": b["runs"], "slack": slack,
                                              "fail_below": slack * b["lo"]})
            e["hosts"].update(h for h in hosts if h is not None)
    return [dict(e, hosts=_screen_sorted(e["hosts"])) for _, e in sorted(seen.items())]


def judging_lines(values_ref, fail, warn, table=None, floor=None, floor_name=None, bands=(), peers_word="peers"):
    """The lines a set of like-for-like values was judged against, in the values' own unit, exactly as the
    judges apply them: the peers' reference (screen_reference, from 2 values on) with its FAIL fraction and its
    WARN line (the WARN fraction, or SCREEN_NOISE_SIGMAS spreads below the reference where that is lower:
    screen_level), a table row {'row', 'ref'} with SCREEN_TABLE_FAIL/WARN of it (table_level), the floor (a
    --min-* value; floor_name its SCREEN_FLOOR_OPTIONS key) and the manifest bands (screen_band_lines entries:
    FAIL below 'fail_below'). -> [{'kind': 'ref'|'fail'|'warn'|'row'|'floor'|'band', 'level': 'FAIL'|'WARN'|
    None (a reference, no threshold), 'value', 'text'}]; a value below a line of level FAIL is judged FAIL."""
    out, p = [], values_ref or {}
    if p.get("count", 0) >= 2 and p.get("ref"):
        r = float(p["ref"])
        out.append({"kind": "ref", "level": None, "value": r,
                    "text": f"{peers_word}' reference {_s3(r)} ({p['how']} of {p['count']})"})
        out.append({"kind": "fail", "level": "FAIL", "value": fail * r,
                    "text": f"FAIL below {fail:.2f} of the reference: {_s3(fail * r)}"})
        w = None if warn is None else min(warn * r, r - SCREEN_NOISE_SIGMAS * float(p.get("spread") or 0.0))
        if w is not None and w > 0:
            out.append({"kind": "warn", "level": "WARN", "value": w,
                        "text": f"WARN below {warn:.2f} of the reference"
                                + (f" and {SCREEN_NOISE_SIGMAS:g} spreads below it" if w < warn * r else "")
                                + f": {_s3(w)}"})
    if table:
        t = float(table["ref"])
        out += [{"kind": "row", "level": None, "value": t, "text": f"table row {table['row']}: {_s3(t)}"},
                {"kind": "fail", "level": "FAIL", "value": SCREEN_TABLE_FAIL * t,
                 "text": f"FAIL below {SCREEN_TABLE_FAIL:.2f} of the row: {_s3(SCREEN_TABLE_FAIL * t)}"},
                {"kind": "warn", "level": "WARN", "value": SCREEN_TABLE_WARN * t,
                 "text": f"WARN below {SCREEN_TABLE_WARN:.2f} of the row: {_s3(SCREEN_TABLE_WARN * t)}"}]
    if floor is not None:
        out.append({"kind": "floor", "level": "FAIL", "value": float(floor),
                    "text": f"floor {SCREEN_FLOOR_OPTIONS.get(floor_name, 'floor')} {floor:g}: FAIL below"})
    for b in bands:
        out.append({"kind": "band", "level": "FAIL", "value": float(b["fail_below"]),
                    "text": f"manifest band {b['band']} of {b['class']}: FAIL below {b['slack']:g} x its lowest "
                            f"{_s3(b['lo'])}: {_s3(b['fail_below'])}"})
    return out


def band_level(value, host, bands):
    """'FAIL' when a manifest band that judges `host` FAILs the value (as _below_band), else 'OK'."""
    v = value if isinstance(value, (int, float)) else None
    return "FAIL" if v is not None and any(host in b["hosts"] and v < b["fail_below"] for b in bands) else "OK"


GPU_FACT_KEYS = ("pcie_width", "pcie_width_max", "pcie_speed", "pcie_speed_max", "sm_mhz", "sm_max_mhz",
                 "throttle", "temp_c", "power_w", "ecc_uncorrected", "remap_pending", "remap_failure")


def gpu_fact_problems(row):
    """[(status, text)] for one GPU's facts (a judge_gpu_perf row with GPU_FACT_KEYS, each optional): under
    load, PCIe link below its maximum width or speed, clocks slowed by THROTTLE_FAULTS; from its node's
    nvidia-smi (the preflight's read_node_smi, the node gate's one query), the memory error policy of both
    modes, after NVIDIA's GPU memory error management: uncorrected ECC errors since the driver loaded and a
    pending row remap WARN (error containment and dynamic page offlining keep new work unaffected; the remap
    takes effect at the next GPU reset), a failed row remap FAILs (the GPU meets NVIDIA's RMA policy)."""
    out, g = [], row.get
    for k, link in (("pcie_width", "x{} of x{}"), ("pcie_speed", "{:g} of {:g} GT/s")):  # below its maximum
        if g(k) and g(f"{k}_max") and g(k) < g(f"{k}_max"):
            out.append(("WARN", f"PCIe link {link.format(g(k), g(f'{k}_max'))} under load"))
    if int(g("throttle") or 0) & THROTTLE_FAULTS:
        clock = f" (SM {g('sm_mhz'):g} of {g('sm_max_mhz'):g} MHz)" if g("sm_mhz") and g("sm_max_mhz") else ""
        out.append(("WARN", f"clocks slowed under load: {', '.join(throttle_names(g('throttle')))}{clock}"))
    if g("ecc_uncorrected"):
        out.append(("WARN", f"{g('ecc_uncorrected'):g} uncorrected ECC error(s) since the driver loaded (contained "
                            "and the page offlined; reset the GPU when it is idle)"))
    if g("remap_failure"):
        out.append(("FAIL", "row remapping failed: memory the GPU can no longer repair (replace it: NVIDIA's RMA "
                            "policy)"))
    elif g("remap_pending"):
        out.append(("WARN", "row remapping pending: reset the GPU (nvidia-smi -r) when it is idle to apply it; new "
                            "work is unaffected until then"))
    return out


def judge_gpu_facts(per_rank, check="gpu-perf", who=None):
    """Findings under `check` ('gpu-perf' in the preflight, 'gpu-health' in the node gate) from each GPU's
    facts (gpu_fact_problems), blame 'own': one per GPU with a problem, or beyond SCREEN_LIST_MAX GPUs one per
    status listing the first ones and a count. who(row): the GPU's words. No PASS finding: judge_gpu_perf (the
    node gate's judge_gpu_health) gives it."""
    flagged = [(r, p) for r in sorted(per_rank or [], key=lambda r: r["rank"]) for p in [gpu_fact_problems(r)] if p]
    items = [(_screen_worst([s for s, _ in p]), r, "; ".join(t for _, t in p)) for r, p in flagged]
    return per_gpu_findings(check, items, who or _gpu_who, "GPU(s) with a problem under load")


def per_gpu_findings(check, items, who, headline, blame="own"):
    """items [(status, rank record, text)] -> one finding per GPU, or beyond SCREEN_LIST_MAX GPUs one per
    status: '<n> <headline>: ' the first ones (who(record): text) and a count of the rest."""
    if len(items) <= SCREEN_LIST_MAX:
        return [finding(check, st, f"{who(r)}: {txt}", [r.get("host")], [r["rank"]], blame=blame)
                for st, r, txt in items]
    return [finding(check, status, f"{len(sel)} {headline}: " + "; ".join(
        f"{who(r)}: {txt}" for _, r, txt in sel[:SCREEN_LIST_MAX]) + more,
        [r.get("host") for _, r, _ in sel], [r["rank"] for _, r, _ in sel], blame=blame)
        for status, sel, more in _per_status(items, lambda x: x[0])]


def gpu_levels(screen):
    """Per GPU row, against the reference that judged it: {rank: {metric: (value, ratio, level)}}, plus the
    refs {(model, metric): {'ref', 'how', 'count'}} drawn at 1.0 (the judge's references and levels,
    judge_gpu_perf): its model's peers where it has two or more of them, else its model's table row (a lone
    GPU is never drawn at 1.0 of itself), else itself (judged by the floor alone)."""
    rows = (screen or {}).get("gpu") or []
    fail, warn = screen_fractions("gpu", bool((screen or {}).get("cpu")))
    floors = {"tflops": (screen or {}).get("min_tflops"), "hbm_gbps": (screen or {}).get("min_hbm")}
    refs, out = {}, {}
    for metric in ("tflops", "hbm_gbps"):
        for model in {r.get("model") or "unknown" for r in rows}:
            same = (r.get(metric) for r in rows if (r.get("model") or "unknown") == model
                    and isinstance(r.get(metric), (int, float)) and r.get(metric) == r.get(metric))
            refs[(model, metric)] = screen_reference(same)
        for r in rows:
            model = r.get("model") or "unknown"
            v, ref = r.get(metric), refs[(model, metric)]
            if not isinstance(v, (int, float)) or v != v or v in (float("inf"), float("-inf")) or not ref["ref"]:
                continue  # not measured (None, NaN, text): nothing to draw
            row = None if (screen or {}).get("cpu") else gpu_table_row(r.get("model"))
            table = (row or {}).get(metric)
            lv = _screen_worst([screen_level(v, ref if ref["count"] >= 2 else {}, fail, warn, floors[metric]),
                                table_level(v, table)])  # as judge_gpu_perf: peers, floor, table
            base = ref["ref"]
            if ref["count"] < 2 and table:  # a lone GPU: drawn against the row that judged it
                base = table
                refs[(model, metric)] = {"ref": table, "how": f"table row {row['row']}", "count": ref["count"]}
            out.setdefault(r.get("rank"), {})[metric] = (float(v), float(v) / base, lv)
    return out, refs


def gpu_suspects(per_rank, floors=None, cpu=False):
    """The ranks whose GPU row is slow (WARN or FAIL against its peers, its table row or a floor: judge_gpu_perf's
    rule): the GPUs measured again before any is named (the screen blames only what persists)."""
    return sorted(_gpu_flags(list(per_rank or []), floors or {}, cpu)[1])  # floors: min_tflops, min_hbm


def gpu_remeasured(per_rank, again):
    """per_rank rows with each re-measurement in `again` ({rank: the new row's measurements}) merged: 'tries' 2,
    'first' the first values of each metric, and each metric the better of the two (faults only lower numbers:
    a GPU slow again is slow in its best value; one at speed again was a transient). A rank missing from
    `again` (not measured again in time, or starved) keeps its single measurement."""
    out = []
    for r in per_rank or []:
        new = (again or {}).get(r["rank"])
        if isinstance(new, dict):
            r = dict(r, tries=int(r.get("tries") or 1) + 1, first={k: r.get(k) for k, _, _ in SCREEN_GPU_METRICS},
                     **{k: max([v for v in (r.get(k), new.get(k)) if isinstance(v, (int, float))], default=None)
                        for k, _, _ in SCREEN_GPU_METRICS})
        out.append(r)
    return out


def judge_gpu_transients(per_rank, floors=None, cpu=False, who=None):
    """GPUs slow at first and at speed when measured again: one WARN under 'gpu-perf' naming no host (a burst of
    another process's work, a moment of contention), with what was seen; [] when none."""
    rows = [r for r in per_rank or [] if _gpu_again(r)]
    slow = set(gpu_suspects(rows, floors, cpu))
    seen = [r for r in rows if r["rank"] not in slow]
    if not seen:
        return []
    who = who or _gpu_who
    items = [f"{who(r)}: " + ", ".join(f"{SCREEN_GPU_LABELS[k]} {_sn((r.get('first') or {}).get(k) or 0)} then "
                                             f"{_sn(r.get(k) or 0)}" for k, _, _ in SCREEN_GPU_METRICS) for r in seen]
    shown = "; ".join(items[:8]) + (f"; and {len(items) - 8} more" if len(items) > 8 else "")
    return [dict(finding("gpu-perf", "WARN", f"{len(seen)} GPU(s) slow at first and at speed when measured again: "
                         f"{shown}: a transient (another process on the GPU, a burst), no host is named",
                         blame="once"),
                 evidence=f"{len(seen)} GPU(s) slow once, at speed when measured again", transient=True,
                 action="none now: nothing is drained; re-run the preflight if the same GPU recurs")]



# ============================================================================ aiv/screen/judge.py
# Floor 3: the screen's judges: per-GPU TFLOPS and GB/s against model peers and the table (and the
SCREEN_RENDER_ALL = 16      # up to this many nodes the PERFORMANCE section shows every node and every group
SCREEN_RENDER_SLOW = 32     # beyond that, at most this many slow groups are listed (then a count)


def screen_best(rows, redone):
    """rows with re-measurements merged: per (nodes, rail) the best busbw counts; 'tries' counts the
    measurements and 'first' keeps the first value (a re-measured row). redone: screen_measured rows."""
    best = {(tuple(m["nodes"]), m["rail"]): m for m in redone}
    out = []
    for m in rows:
        r = best.get((tuple(m["nodes"]), m["rail"]))
        if r is not None:
            keep = m if (m.get("busbw") or 0.0) >= (r.get("busbw") or 0.0) else dict(m, busbw=r["busbw"],
                                                                                   time_us=r.get("time_us"))
            m = dict(keep, tries=m.get("tries", 1) + 1, first=m.get("first", m.get("busbw")))
        out.append(m)
    return out


def _intra_class(p):
    """Like for like: (ranks per node, GPU model) of an intra-node row."""
    return (len(p.get("ranks") or ()) or None, p.get("model"))


def _intra_class_text(key):
    rpn, model = key
    return ", ".join(x for x in (f"{rpn} ranks" if rpn else "", model or "") if x) or "all nodes"


def intra_levels(per_node, min_busbw=None, cpu=False):
    """-> ({class: screen_reference}, {host: (level, class)}) for judge_intra's rows; the reference is
    taken per (ranks per node, GPU model) class (_intra_class)."""
    fail, warn = screen_fractions("net", cpu)
    by_cls = group_by(per_node, _intra_class)
    refs = {k: screen_reference(p.get("busbw") for p in ps) for k, ps in by_cls.items()}
    peers = {k: r if r["count"] >= 2 else {} for k, r in refs.items()}  # one node is its own maximum: no peers
    return refs, {p["host"]: (screen_level(p.get("busbw"), peers[_intra_class(p)], fail, warn, min_busbw),
                              _intra_class(p)) for p in per_node}


def intra_against(per_node, min_busbw=None, bands=None):
    """What each class of intra-node rows was judged against (screen_against): its peers from 2 nodes on, the
    floor, the manifest band; never a table (no per-model numbers for NVLink/NVSwitch/PCIe busbw)."""
    by_cls = group_by(per_node, _intra_class)
    out = {}
    for k, ps in sorted(by_cls.items(), key=str):
        band = None if bands is None else next((b for b in [f"intra.busbw/{k[0] or 0} ranks"] if b in bands), "")
        out[k] = screen_against(f"intra-node busbw of {_intra_class_text(k)}", len(ps), "node", "class",
                                screen_reference(p.get("busbw") for p in ps), "GB/s", None, min_busbw,
                                "min_busbw_intra", band, "none exists for intra-node busbw")
    return out


def _intra_evidence(p, ref):
    """(evidence, action, GPU ranks to name) of a node slow inside: how often it was measured, beside which
    known-good nodes, and where its localisation (screen_loop: the node's GPU pairs beside the same pairs of
    the controls) put the fault."""
    r, unit = (ref["ref"], " of the reference") if ref.get("ref") else (None, " GB/s")
    num = (lambda v: f"{float(v or 0.0) / r:.2f}") if r else (lambda v: _sn(float(v or 0.0)))  # noqa: E731
    vals = p.get("values") or [p.get("busbw")]
    ev = f"measured {len(vals)} time(s), slow every time ({', '.join(num(v) for v in vals)}{unit})"
    for b in (p.get("beside") or [])[-1:]:
        ev += f"; try {b['try']} beside the known-good " + ", ".join(f"{c} ({num(v)})"
                                                                     for c, v in b["controls"].items())
    loc, h = p.get("local"), p["host"]
    if not loc:
        return ev, f"drain {h}; run the vendor's diagnostics (dcgmi diag -r 3, nvidia-smi nvlink -s)", []
    lr = {g: rk for pr in loc["pairs"] for g, rk in zip(pr["gpus"], pr["ranks"], strict=True)}
    slow = [pr for pr in loc["pairs"] if pr["level"] != "OK"]
    ctrl = f" beside the same pairs on {', '.join(loc['controls'])}" if loc["controls"] else ""
    ev += f"; its {len(loc['pairs'])} GPU pair(s) measured{ctrl}"
    if loc["wide"]:
        return (ev + ": every pair slow", f"drain {h}; the node's NVSwitch or baseboard: run the vendor's "
                "diagnostics (dcgmi diag -r 3, nvidia-smi nvlink -s)", [])
    if not slow:
        return (ev + ": every pair at speed: slow only in the all_reduce of the whole node (NVSwitch under full "
                "load, PCIe, the host side)", f"drain {h}; run the vendor's diagnostics (dcgmi diag -r 3)", [])
    parts = [f"GPU {g} (rank {lr.get(g)}) slow with every partner, "
             + ", ".join(f"{pr['gpus'][0]}-{pr['gpus'][1]} {pr['busbw'] / (pr['ref'] or 1.0):.2f}"
                         for pr in slow if g in pr["gpus"]) for g in loc["gpus"]]
    parts += [f"GPU pair {a}-{b} slow ({pr['busbw'] / (pr['ref'] or 1.0):.2f}), both at speed with other partners"
              for a, b in loc["links"] for pr in slow if pr["gpus"] == [a, b]]
    what = " and ".join(f"GPU {g}" for g in loc["gpus"]) or " and ".join(f"the NVLink between GPUs {a} and {b}"
                                                                           for a, b in loc["links"])
    return (ev + ": " + "; ".join(parts), f"drain {h}; {what}: run the vendor's diagnostics on it (dcgmi diag -r 3, "
            "nvidia-smi nvlink -s), reseat or replace it",
            sorted({lr[g] for g in loc["gpus"] or [x for e in loc["links"] for x in e] if g in lr}))


def judge_intra(per_node, min_busbw=None, cpu=False):
    """Intra-node all_reduce bus bandwidth (one group of all local ranks per node) against the other nodes
    of its class. per_node: [{'host': str, 'busbw': float|None (1e9 B/s, the best of its tries; None: the
    group failed, judged as 0.0), 'ranks': [rank, ...] (optional), 'model': GPU model (optional), and from
    screen_loop where it was measured again: 'tries', 'first', 'values', 'beside' (the tries measured beside
    known-good nodes), 'local' (its GPU pairs: screen_loop's localisation)}]; min_busbw: absolute floor
    (FAIL below) or None.
    Reference per (ranks per node, GPU model) (screen_reference); below SCREEN_NET_FAIL of it FAIL, below
    SCREEN_NET_WARN WARN; cpu=True: only below SCREEN_CPU_FAIL FAILs, nothing WARNs (CPU-bound numbers).
    A node slow at first and at speed again is no finding here (judge_transients).
    -> findings under 'intra-node': one per flagged node (one per status listing them beyond
    SCREEN_LIST_MAX nodes) with its 'evidence' and 'action' (naming the GPU or GPU pair where localised,
    its ranks the GPU's), or one PASS giving the references and the count of nodes."""
    per_node = list(per_node or [])
    if not per_node:
        return []
    refs, levels = intra_levels(per_node, min_busbw, cpu)
    rule = _screen_rule("net", cpu)
    flagged = []
    for p in sorted(per_node, key=lambda p: _screen_key(p["host"])):
        level, cls = levels[p["host"]]
        if level != "OK":
            v, ref = float(p.get("busbw") or 0.0), refs[cls]
            floor = min_busbw is not None and v < min_busbw
            why = (f"below the floor {min_busbw:g} GB/s (--min-busbw-intra, the floor decided)" if floor
                   else f"{v / ref['ref']:.2f} of the reference {_screen_ref_text(ref, 'GB/s')}"
                   + (f" of {_intra_class_text(cls)}" if len(refs) > 1 else "") + f" ({rule})")
            ev = _intra_evidence(p, ref if ref["count"] >= 2 and not floor else {"ref": None})
            flagged.append((level, p["host"], f"{p['host']}: intra-node all_reduce busbw {_sn(v)} GB/s: {why}", ev))
    if not flagged:
        against = intra_against(per_node, min_busbw).values()
        if not all(a["peers"] for a in against):
            judged = "" if all(a["judged"] for a in against) else ", not judged"
            return [finding("intra-node", "PASS", f"intra-node busbw on {len(per_node)} node(s){judged}: "
                            + "; ".join(a["text"] for a in against))]
        txt = "; ".join((f"{_intra_class_text(k)}: " if len(refs) > 1 else "") + _screen_ref_text(r, "GB/s")
                        for k, r in sorted(refs.items(), key=str))
        return [finding("intra-node", "PASS", f"intra-node busbw on {len(per_node)} node(s): reference "
                        f"{txt} ({rule})")]
    tries = {p["host"]: max(int(p.get("tries") or 1), len(p.get("values") or ())) for p in per_node}
    if len(flagged) <= SCREEN_LIST_MAX:
        return [_measured_blame(dict(finding("intra-node", lv, f"{txt}: NVLink/NVSwitch/PCIe inside the node; {ev}",
                                             [h], ranks), evidence=ev, action=act), [tries[h]])
                for lv, h, txt, (ev, act, ranks) in flagged]
    return [_measured_blame(dict(finding("intra-node", status, f"{len(sel)} node(s) slow inside: "
                                         + "; ".join(t for _, _, t, _ in sel[:SCREEN_LIST_MAX]) + more,
                                         [h for _, h, _, _ in sel]),
                                 evidence="; ".join(f"{h}: {e[0]}" for _, h, _, e in sel[:SCREEN_LIST_MAX]),
                                 action="drain them; run the vendor's diagnostics on each"),
                            [tries[h] for _, h, _, _ in sel])
            for status, sel, more in _per_status(flagged, lambda f: f[0])]


def _measured_blame(f, tries):
    """A screen finding's blame from how often each thing it names was measured: 'persisted' when every one was
    measured two or more times (slow each time), else 'once'."""
    if all(t >= 2 for t in tries):
        return dict(f, blame="persisted")
    return unlocalised(f, "once", "a re-run: a node slow again when measured again is named")


def _pair_evidence(results, levels):
    """{(node, rail): {'slow': {partners (frozenset): [index]}, 'ok': [index]}} over every measurement."""
    ev = {}
    for i, (m, level) in enumerate(zip(results, levels, strict=True)):
        group = frozenset(m["nodes"])
        for n in group:
            e = ev.setdefault((n, m["rail"]), {"slow": {}, "ok": []})
            if level == "OK":
                e["ok"].append(i)
            else:
                e["slow"].setdefault(group - {n}, []).append(i)
    return ev


def screen_diagnose(results, min_busbw=None, cpu=False):
    """Localisation over inter-node measurements (the shapes of judge_pairs). -> {
      'ref': screen_reference of all busbw (for the report), 'refs': {rail: reference} (the judge's),
      'levels': ['FAIL'|'WARN'|'OK' per result], 'rails': sorted rails, 'nodes': sorted nodes,
      'culprits': {(node, rail)}, 'links': [index of a slow measurement no culprit explains],
      'suspect_links': [index of such a measurement whose every member is fine with another partner on
      that rail], 'suspects': [node], 'passing': [node not a suspect, those in no slow measurement first],
      'clean': [node in no slow measurement], 'widespread': bool, 'final': bool (round 3 measured),
      'two_nodes': bool}.
    suspects: culprit nodes and every member of an unexplained slow group (after round 3 only those of
    links that are not suspect links). Widespread: before round 3, more suspects than passing nodes
    (N >= 3), or no node passed at all. Also 'min_busbw' (for _pair_floor_text)."""
    refs, levels = screen_pair_levels(results, min_busbw, cpu)
    nodes = _screen_sorted(n for m in results for n in m["nodes"])
    ev = _pair_evidence(results, levels)
    # the node: slow with two different partners (or partner groups) and fine with none; a node slow only because
    # two of its partners were bad is fine with its suspect-round partner (a node that passed), and so is cleared
    culprits = {k for k, e in ev.items() if len(e["slow"]) >= 2 and not e["ok"]}
    links = [i for i, (m, level) in enumerate(zip(results, levels, strict=True))  # the link or path between them
             if level != "OK" and not any((n, m["rail"]) in culprits for n in m["nodes"])]
    two = len(nodes) == 2
    final = any(m.get("round") == 3 for m in results)
    lone = [] if two else [i for i in links if all(ev[(n, results[i]["rail"])]["ok"] for n in results[i]["nodes"])]
    named = [i for i in links if i not in lone] if final else links
    sus = {n for n, _ in culprits} | {n for i in named for n in results[i]["nodes"]}
    dirty = {n for m, lv in zip(results, levels, strict=True) if lv != "OK" for n in m["nodes"]}
    clean = [n for n in nodes if n not in dirty]
    passing = clean + [n for n in nodes if n in dirty and n not in sus]
    wide = bool(sus) and not two and (not passing or (not final and len(sus) > len(passing)))
    return {"ref": screen_reference(m.get("busbw") for m in results), "refs": refs, "levels": levels,
            "rails": sorted(refs), "nodes": nodes, "culprits": culprits, "links": links, "suspect_links": lone,
            "suspects": _screen_sorted(sus), "passing": passing, "clean": clean, "widespread": wide,
            "final": final, "two_nodes": two, "min_busbw": min_busbw}


def _pair_floor_text(results, idx, d):
    """'; ... below the floor' when measurements idx fell below --min-busbw-inter: the floor FAILs them
    whatever their ratio to the rail's reference."""
    f = d.get("min_busbw")
    below = [i for i in idx if f is not None and float(results[i].get("busbw") or 0.0) < f]
    return (f"; {len(below)} measurement(s) below the floor {f:g} GB/s (--min-busbw-inter: the floor FAILs them)"
            if below else "")


def screen_suspect_links(results, min_busbw=None, cpu=False):
    """The JSON's suspect_links: slow pair measurements whose two ends are both fine with their other
    partners on that rail (after re-measurement): [{'hosts': [a, b], 'rail', 'busbw', 'ratio'}]. These
    name no host in failed_hosts or exclude: the path between them (ECMP, a switch, another tenant) is
    the suspect, not either node."""
    results = list(results or [])
    if not results:
        return []
    d = screen_diagnose(results, min_busbw, cpu)
    return [{"hosts": _screen_sorted(m["nodes"]), "rail": m["rail"], "busbw": float(f"{bw:.4g}"),
             "ratio": round(bw / (d["refs"][m["rail"]]["ref"] or 1.0), 3)}
            for m in (results[i] for i in d["suspect_links"]) for bw in [float(m.get("busbw") or 0.0)]]


def screen_third_round(results, min_busbw=None, cpu=False):
    """After the schedule's rounds (rounds 1 and 2; all three for N = 3): what to measure next.
    results: as judge_pairs. -> {'groups': [(suspect, passing_node)] to measure as round 3 (every rail),
    [] when nothing is needed (no suspect, two nodes, or round 3 already measured), or None when the
    fault is widespread (run nothing more: judge_pairs FAILs naming every suspect);
    'suspects': [node], 'passing': [node]}."""
    d = screen_diagnose(results, min_busbw, cpu)
    out = {"suspects": d["suspects"], "passing": d["passing"], "groups": []}
    if d["final"] or d["two_nodes"] or not d["suspects"]:
        return out
    met = {tuple(m["nodes"]) for m in results}
    out["groups"] = None if d["widespread"] else suspect_round(d["suspects"], d["passing"], met)
    return out


def _screen_hca(m, node):
    h = m.get("hca")
    return h.get(node) if isinstance(h, dict) else h


def _screen_hca_text(results, idx, nodes):
    """' (HCA mlx5_2)' for the nodes' HCA in measurements idx of one rail, ' (HCA node1 mlx5_2, node3
    mlx5_3)' where they differ; '' where none is known."""
    hcas = {n: next((h for i in idx for h in [_screen_hca(results[i], n)] if h), None) for n in nodes}
    known = {n: h for n, h in hcas.items() if h}
    if not known:
        return ""
    if len(set(known.values())) == 1 and len(known) == len(nodes):
        return f" (HCA {next(iter(known.values()))})"
    return " (HCA " + ", ".join(f"{n} {h}" for n, h in known.items()) + ")"


def _screen_rails_text(rails, all_rails):
    rails = sorted(rails)
    if len(rails) > 1 and rails == all_rails:
        return f"every rail ({format_ranges(rails)})"
    return ("rail " if len(rails) == 1 else "rails ") + format_ranges(rails)


def _pair_node_findings(results, d):
    """One finding per culprit node: its rails (every rail: the node as a whole), HCAs, partners, speed."""
    ev = _pair_evidence(results, d["levels"])
    out, by_node = [], group_by(d["culprits"], lambda c: c[0], lambda c: c[1])
    for n in _screen_sorted(by_node):
        rails = sorted(by_node[n])
        own = sorted({m["rail"] for m in results if n in m["nodes"]})
        slow = {rail: sorted(i for ids in ev[(n, rail)]["slow"].values() for i in ids) for rail in rails}
        parts, statuses, ratios = [], [], []
        for rail in rails:
            idx = slow[rail]
            # consistent evidence: the node is at least as bad as its least bad slow measurement
            statuses.append("WARN" if "WARN" in [d["levels"][i] for i in idx] else "FAIL")
            bw, ref = _screen_median([float(results[i].get("busbw") or 0.0) for i in idx]), d["refs"][rail]["ref"]
            parts.append(f"local rank {rail}" + (_screen_hca_text(results, idx, [n]) if len(rails) > 1 else "")
                         + f" {_sn(bw)} GB/s = {bw / ref:.2f} of the rail's reference {_sn(ref)} GB/s")
            ratios.append(bw / ref)
        partners = _screen_sorted(p for rail in rails for ps in ev[(n, rail)]["slow"] for p in ps)
        whole = len(rails) > 1 and rails == own
        # one rail: its HCA on this node beside it (node3 rail 2 (HCA mlx5_2))
        named = _screen_hca_text(results, slow[rails[0]], [n]) if len(rails) == 1 else ""
        if whole:
            speed = f"busbw median {_screen_median(ratios):.2f} of the rails' references"
            where = ("a node-wide network fault (its NICs or their switch ports together, or the host side: "
                     "PCIe, firmware)")
        else:
            speed = "; ".join(parts)
            where = "its NIC, cable or switch port on " + ("that rail" if len(rails) == 1 else "those rails")
        every = sorted(i for rail in rails for i in slow[rail])
        tries = max(results[i].get("tries", 1) for i in every)
        act = (f"drain {n}; its NICs together or the host side: check their PCIe links and firmware, run the "
               "vendor's diagnostics" if whole else
               f"drain {n}; reseat or replace the HCA or cable of {_screen_rails_text(rails, [])}{named}, then "
               "check its switch port")
        out.append(dict(finding("inter-node", _screen_worst(statuses),
                                f"node {n} is slow on {_screen_rails_text(rails, own if whole else [])}{named} with "
                                f"{len(partners)} different partner(s) ({_screen_names(partners)}) and fine with none, "
                                f"after re-measurement: {speed}: {where}{_pair_floor_text(results, every, d)}", [n],
                                blame="persisted"),
                        evidence=f"{len(every)} slow measurement(s) with {len(partners)} different partner(s) "
                                 f"({_screen_names(partners)}), each measured up to {tries} time(s), the best "
                                 f"counting; at speed with no partner", action=act))
    return out


def _pair_link_findings(results, d):
    """One finding per group whose slow measurements no culprit explains: the link or path between them.
    Both ends fine with other partners (after round 3): a suspect link, WARN at most, naming no host."""
    ev = _pair_evidence(results, d["levels"])
    groups = group_by(d["links"], lambda i: tuple(_screen_sorted(results[i]["nodes"])))
    out = []
    for g in sorted(groups, key=lambda g: [_screen_key(x) for x in g]):
        idx = groups[g]
        rails = sorted({results[i]["rail"] for i in idx})
        ratio = _screen_median([float(results[i].get("busbw") or 0.0) / d["refs"][results[i]["rail"]]["ref"]
                                for i in idx])
        fine = [n for n in g if all(ev[(n, results[i]["rail"])]["ok"] for i in idx)]
        lone = d["final"] and all(i in d["suspect_links"] for i in idx)
        if d["two_nodes"]:
            what = (f"nodes {g[0]} and {g[1]} are slow together (two nodes only: the pair is named, it cannot "
                    f"be split)")
        elif len(g) == 3:
            what = f"the paths among {', '.join(g)} are slow (a group of three: the pair cannot be told apart)"
        else:
            what = f"the link or path between {g[0]} and {g[1]} is slow"
        alone = ("both are fine with other partners" if len(fine) == len(g) else
                 f"{_screen_names([n for n in g if n not in fine])} measured with no other partner there")
        alone = "" if d["two_nodes"] else f"; {alone}"
        status = _screen_worst([d["levels"][i] for i in idx])
        if lone:
            alone += " (a suspect link: the path between them, no host is excluded for it)"
            status = "WARN" if status != "OK" else status
        named = _screen_hca_text(results, idx, g) if len(rails) == 1 else ""
        on = f"{_screen_rails_text(rails, d['rails'])}{named}"
        act = ("none drained; re-run, and if it recurs check the cables and the switch path between "
               f"{' and '.join(g)} on {on}" if lone else
               f"measure each of {' and '.join(g)} with a third node (two nodes cannot be told apart); reseat or "
               "replace the HCAs or cables of that rail" if d["two_nodes"] else
               f"drain {' and '.join(g)} or re-run; check the cables, HCAs and switch ports between them on {on}")
        tries = max(results[i].get("tries", 1) for i in idx)
        f = dict(finding("inter-node", status, f"{what} on {on}: busbw "
                         f"{ratio:.2f} of the rail's reference after re-measurement{alone}"
                         f"{_pair_floor_text(results, idx, d)}", list(g)),
                 evidence=f"{len(idx)} slow measurement(s), each measured up to {tries} time(s), the best "
                          f"counting{alone}", action=act)
        # a link or a group names neither end: each is slow only with the other(s), and nothing tells which
        out.append(unlocalised(f, "tie" if d["two_nodes"] or len(g) == 3 else "link",
                               f"measure each of {' and '.join(g)} with a third node" if d["two_nodes"] else None,
                               None if not d["two_nodes"] else "two nodes only: the pair cannot be split"))
    return out


def judge_pairs(results, min_busbw=None, cpu=False):
    """Inter-node bus bandwidth, localised to a node, a node's rail or a link.
    results: [{'round': 1|2|3, 'nodes': (a, b) or (a, b, c), 'rail': int (the local rank: each local
               rank measured with the same local rank on the partner nodes, one group per rail),
               'busbw': float (1e9 B/s, the best of the measurement and its re-measurements; None: the
               group failed, judged as 0.0),
               'hca': str (the HCA this rail uses, same name on every node) | {node: str} | None}],
    every round's measurements together (rounds 1-2 to plan the suspect round, all rounds to judge).
    min_busbw: absolute floor (FAIL below) or None; cpu=True: only below SCREEN_CPU_FAIL FAILs and
    nothing WARNs (gloo over loopback is CPU-bound: never a culprit out of noise).
    Reference: per rail (screen_rail_refs), each measurement FAIL/WARN/OK against it (screen_level with
    SCREEN_NET_FAIL/SCREEN_NET_WARN). Localised per rail (screen_diagnose): a node slow with two different
    partners (or groups) and fine with none is named on that rail (the HCA named when known; on every rail:
    the node as a whole); a slow group none of whose members is such a node is the link or
    path between them, a suspect link when every member is fine with another partner there (WARN at most,
    no host named, the JSON's suspect_links), else both named; two nodes only: the pair is named (nothing
    can localise it); widespread (screen_diagnose): one FAIL naming every suspect.
    -> (findings under 'inter-node', suspects: sorted node names implicated: before round 3 the nodes
        to give suspect_round, after it the nodes the findings name). One PASS finding with the
        reference and the count of measurements when nothing is slow."""
    results = list(results or [])
    if not results:
        return [], []
    d = screen_diagnose(results, min_busbw, cpu)
    ref, sus = d["ref"], d["suspects"]
    if not sus and not d["links"]:
        spread = f", spread {100 * ref['spread'] / ref['ref']:.1f}%" if ref["spread"] and ref["ref"] else ""
        return [finding("inter-node", "PASS", f"inter-node busbw: reference "
                        f"{_screen_ref_text(ref, 'GB/s', 'measurements')} over {len(d['rails'])} rail(s) and "
                        f"{len(d['nodes'])} node(s){spread}; "
                        + (f"none slow ({_screen_rule('net', cpu)})" if ref["count"] >= 2 else
                           "not judged against peers (one measurement is its own reference)"))], []
    if d["widespread"]:
        slow = sum(lv != "OK" for lv in d["levels"])
        f = dict(finding("inter-node", "FAIL", f"widespread: {len(sus)} node(s) implicated, more than the "
                         f"{len(d['passing'])} that passed, so no single node or link is to blame (a switch, "
                         f"the fabric or its configuration): {slow}/{len(results)} measurement(s) slow against "
                         f"the rails' references or the floor after re-measurement; suspects: "
                         f"{compress_hostlist(sus)}"
                         f"{_pair_floor_text(results, [i for i, lv in enumerate(d['levels']) if lv != 'OK'], d)}",
                         sus), widespread=True, evidence=f"{slow} slow measurement(s) after re-measurement",
                 action="nothing is drained: check the switches, the fabric and its configuration")
        return [unlocalised(f, "widespread")], sus
    return _pair_node_findings(results, d) + _pair_link_findings(results, d), sus


def screen_band_names(manifest, records, screen):
    """The manifest's speed bands that judge this run's measurements (as judge_bands: BAND_MIN_RUNS runs or
    more, in the class of one of the run's nodes: screen_band_lines) -> sorted band names, [] without a manifest."""
    return sorted({b["band"] for b in screen_band_lines(manifest, records, screen)})


def screen_judged_against(screen, bands=None):
    """Per measurement, what it was judged against (screen_against): each GPU model's matmul TFLOPS and
    memory GB/s (peers, the table row, the floor), each class of intra-node busbw (peers, the floor; no
    table exists), the inter-node busbw (the measurements of the rails, the floor; no table exists), and
    with bands (screen_band_names' list; None: no manifest given) the manifest band. -> [entry], in the
    JSON as screen['judged_against'] and in the PERFORMANCE section."""
    cpu, band_set = bool(screen.get("cpu")), None if bands is None else set(bands)
    floors = {k: screen.get(k) for k in SCREEN_FLOOR_OPTIONS}
    out = [x["against"] for x in gpu_refs(screen.get("gpu") or [], floors, cpu, band_set).values()]
    out += list(intra_against(screen.get("intra") or [], screen.get("min_busbw_intra"), band_set).values())
    pairs = screen.get("pairs") or []
    if pairs:
        band = None if band_set is None else next((b for b in sorted(band_set) if b.startswith("inter.busbw/")), "")
        rails = len({m["rail"] for m in pairs})
        out.append(screen_against(f"inter-node busbw over {rails} rail(s)", len(pairs), "measurement", "rail",
                                  screen_reference(m.get("busbw") for m in pairs), "GB/s", None,
                                  screen.get("min_busbw_inter"), "min_busbw_inter", band,
                                  "none exists for inter-node busbw"))
    return out


def screen_degraded_note(screen):
    """The report's and the JSON's note when the screen made its groups without split_group (screen['no_split']:
    {'why', 'groups'}), else None: each group then costs one call of every rank (new_group through
    new_subgroups_by_enumeration), thousands per round on a large job, where one split makes a round."""
    ns = (screen or {}).get("no_split")
    if not ns:
        return None
    return (f"screen ran in a degraded mode: {ns['why']}: {ns['groups']} groups made by world-wide new_group "
            f"(one call of every rank per group; split_group makes a round in one)")



# ============================================================================ aiv/screen/soak.py
# Floor 3: the soak's judges (--soak): a GPU whose matmul speed decays under sustained load, or whose
# -- the soak (--soak SECONDS): a GPU that holds its speed for a second may not hold it for a minute. A
# failing fan, dried thermal paste, blocked airflow or a power brake shows after tens of seconds of load:
# the matmul slows (last window against the first) or the driver reports why the clocks dropped.
SOAK_DECAY_FAIL = 0.90   # GPU: the last window's TFLOPS below 0.90 of the first: FAIL
SOAK_DECAY_WARN = 0.95   # ... below 0.95: WARN
SOAK_FAULTS = 0x8 | 0x20 | 0x40 | 0x80  # HW slowdown, SW thermal, HW thermal, HW power brake: FAIL
SOAK_POWER_CAP = 0x4     # SW power cap: normal for a GPU at full load (H100/H200); only noted, its decay judged


def soak_problems(row, cpu=False):
    """[(status, text)] for one GPU's soak (a judge_soak row): its speed decay (tflops_last against
    tflops_first: below SOAK_DECAY_FAIL FAIL, below SOAK_DECAY_WARN WARN; on CPU not judged: ranks share
    cores with each other and with whatever else runs, so their decay is that noise)
    and clock-event reasons of SOAK_FAULTS seen in any sample (FAIL, with the samples that showed them,
    max temperature, SM clocks and max power). A SW power cap alone is no problem; with a decay the text
    says it was active."""
    out, g = [], row.get
    seen = int(g("throttle_seen") or 0)
    cap = " while the SW power cap was active" if seen & SOAK_POWER_CAP else ""
    first, last = g("tflops_first"), g("tflops_last")
    if first and last is not None and first > 0:
        ratio = last / first
        level = None if cpu else "FAIL" if ratio < SOAK_DECAY_FAIL else "WARN" if ratio < SOAK_DECAY_WARN else None
        if level:
            out.append((level, f"matmul slowed from {_sn(first)} to {_sn(last)} TFLOPS ({ratio:.2f} of the first "
                               f"window) over {g('seconds') or 0:g}s of load{cap}"))
    if seen & SOAK_FAULTS:
        counts = g("throttle_counts") or {}
        names = throttle_names(seen & SOAK_FAULTS)
        ev = [f"max {g('temp_max_c'):g} C" if g("temp_max_c") is not None else None,
              f"SM {g('sm_min_mhz'):g}-{g('sm_max_seen_mhz'):g} MHz" + (
                  f" of {g('sm_rated_mhz'):g}" if g("sm_rated_mhz") else "") if g("sm_min_mhz") is not None else None,
              f"max {g('power_max_w'):g} W" if g("power_max_w") is not None else None]
        out.append(("FAIL", "clocks slowed under sustained load: " + ", ".join(
            f"{n} in {counts.get(n, '?')}/{g('samples') or '?'} samples" for n in names)
            + "".join(f"; {e}" for e in ev if e)))
    return out


def soak_verdict(row, cpu=False):
    """One GPU's soak verdict: PASS, WARN or FAIL (soak_problems' worst)."""
    worst = _screen_worst([s for s, _ in soak_problems(row, cpu)])
    return "PASS" if worst == "OK" else worst


def _soak_who(r):
    dev = f"cuda:{r['device']}" if r.get("device") is not None else "cpu"
    return (f"rank {r['rank']} on {r.get('host')} (GPU {dev}, local rank {r.get('local_rank')}, "
            f"{r.get('uuid') or 'UUID unknown'}, {r.get('model') or 'unknown model'})")


def judge_soak(rows, cpu=False):
    """The soak's findings under 'soak'. rows: [{'rank', 'host', 'local_rank', 'device' (CUDA index or
    None), 'uuid', 'model', 'seconds' (of load), 'tflops_first', 'tflops_last' (window values, 1e12
    FLOP/s; None: too short to time), 'telemetry' ('nvml', 'nvidia-smi' or None), 'samples',
    'temp_max_c', 'sm_min_mhz', 'sm_max_seen_mhz', 'sm_rated_mhz', 'power_max_w', 'throttle_seen'
    (OR of the clock-event masks, None: not read), 'throttle_counts' {name: samples}}]; cpu: gloo ranks.
    -> one finding per GPU with a problem (soak_problems; beyond SCREEN_LIST_MAX one per status listing
    the first ones and a count), or one PASS saying how far the slowest GPU held its speed, the hottest
    GPU, the clock limits seen, and where there was no telemetry (CPU, or neither NVML nor nvidia-smi); then
    the numerics repeats' findings (judge_numerics_soak: check 'numerics', where rows carry them)."""
    rows = sorted(rows or [], key=lambda r: r["rank"])
    if not rows:
        return []
    items = [(_screen_worst([s for s, _ in p]), r, "; ".join(t for _, t in p))
             for r in rows for p in [soak_problems(r, cpu)] if p]
    if not items:
        ratios = [r["tflops_last"] / r["tflops_first"] for r in rows if r.get("tflops_first") and
                  r.get("tflops_last") is not None]
        temps = [r["temp_max_c"] for r in rows if r.get("temp_max_c") is not None]
        limits = Counter(n for r in rows for n in throttle_names(r.get("throttle_seen")))
        none = [r for r in rows if not r.get("telemetry") or not r.get("samples")]
        parts = [f"the slowest held {min(ratios):.2f} of its first window" if ratios else "too short to time windows",
                 f"max temperature {max(temps):g} C" if temps else None,
                 ("clock limits seen: " + ", ".join(f"{n} on {k}" for n, k in sorted(limits.items()))) if limits
                 else None,
                 ("no GPU telemetry on CPU" if cpu else f"no telemetry on {len(none)} GPU(s) (neither NVML nor "
                  f"nvidia-smi answered): judged on TFLOPS alone") if none else None]
        secs = max(float(r.get("seconds") or 0) for r in rows)
        lead = (f"{len(rows)} CPU rank(s) ran {secs:g}s of load at once (decay not judged: ranks share cores)" if cpu
                else f"{len(rows)} GPU(s) held their speed over {secs:g}s of load at once")
        return [finding("soak", "PASS", f"{lead}: " + "; ".join(p for p in parts if p))] + judge_numerics_soak(rows)
    return (per_gpu_findings("soak", items, _soak_who, "GPU(s) did not hold up under sustained load", "persisted")
            + judge_numerics_soak(rows))


def _soak_n(v):
    return "-" if v is None else f"{v:g}"


def soak_rows(records, posts, cpu=False):
    """judge_soak's rows: screen_gpu_rows' (each posting rank's record facts and its post) with the CUDA
    index and the GPU's verdict (soak_verdict)."""
    dev = {rec["rank"]: rec.get("device") for rec in records}
    rows = [dict(r, device=dev.get(r["rank"])) for r in screen_gpu_rows(records, posts, cpu)]
    return [dict(r, verdict=soak_verdict(r, cpu)) for r in rows]



# ============================================================================ aiv/screen/loop.py
# Floor 3: the screen's control loop, screen_loop(records, measure): the batches of groups that run at
# Blame only what persists. Every slow measurement is measured again before it counts, and the best
# value counts (faults only lower numbers; a burst of another job's traffic halves one measurement,
# not three). A node slow inside (its all_reduce) is measured again, from its third try on beside
# SCREEN_CONTROLS known-good nodes of its class in the same batch; slow in every try, it is localised:
# each GPU pair of the node (a ring first: every GPU with its two neighbours; then, when no pair of the
# ring is slow, every other pair) beside the same pairs of the controls, so the finding names the GPU
# (slow with two partners, at speed with none) or the GPU pair. A node slow in every try whose pairs are
# all at speed is measured SCREEN_CONFIRM_TRIES more times before it is named as a whole. A measurement
# slow at first and at speed again is a transient: a WARN that names no host (judge_transients).
SCREEN_TRIES = 4          # a slow pair measurement (between nodes, or two GPUs of a node): at most this many times
SCREEN_INTRA_TRIES = 4    # a slow node's all_reduce inside the node: at most this many times before localising
SCREEN_CONFIRM_TRIES = 1  # ... and this many more when every GPU pair of it is at speed
SCREEN_CONTROL_TRY = 3    # from this try on a slow node is measured beside its controls
SCREEN_CONTROLS = 2       # known-good nodes of its class measured beside a slow node
SCREEN_BATCHES_MAX = 40   # the loop's own bound: a healthy screen takes at most 16 batches, one with a fault 24


def _pack(bundles):
    """One batch: the bundles (lists of groups that must run together) in order, each taken whole when
    its ranks are free; a group already in the batch (a control shared by two slow nodes) is taken once."""
    used, keys, out = set(), set(), []
    for b in bundles:
        new = [g for g in b if tuple(g["ranks"]) not in keys]
        rs = {r for g in new for r in g["ranks"]}
        if rs & used or len(rs) != sum(len(g["ranks"]) for g in new):
            continue
        used |= rs
        keys |= {tuple(g["ranks"]) for g in new}
        out += new
    return out


def _ring(lrs):
    """Each GPU with its two neighbours in local-rank order: [(a, b)], a before b, each pair once."""
    return list(dict.fromkeys(tuple(sorted(e)) for e in zip(lrs, lrs[1:] + lrs[:1], strict=True) if e[0] != e[1]))


def _matchings(edges):
    """edges ordered so that consecutive ones share no GPU where possible (the packer then fills each
    batch): greedy rounds of disjoint edges."""
    left, out = list(edges), []
    while left:
        used, rnd = set(), []
        for e in list(left):
            if not set(e) & used:
                rnd.append(e)
                used |= set(e)
                left.remove(e)
        out += rnd
    return out


class _Loop:
    def __init__(self, records, measure, min_intra=None, min_inter=None, cpu=False):
        self.records, self.measure, self.cpu = {r["rank"]: r for r in records}, measure, cpu
        self.min_intra, self.min_inter = min_intra, min_inter
        self.by_node = screen_layout(records)
        model = {r["rank"]: (r.get("gpu") or {}).get("name") for r in records}
        self.intra = {h: {"host": h, "busbw": None, "ranks": sorted(lr.values()), "model": model.get(min(lr.values())),
                          "time_us": None, "tries": 0, "values": []}
                      for h, lr in sorted(self.by_node.items(), key=lambda x: _screen_key(x[0])) if len(lr) > 1}
        self.rounds = [screen_rail_groups(rnd, self.by_node) for rnd in screen_rounds(self.by_node)]
        self.pairs, self.third, self.todo3, self.batches, self.done = [], None, [], [], 0
        self.local = {}      # host -> localisation state
        self.controls = {}   # host -> its control nodes

    # ---------------------------------------------------------------- groups
    def g_intra(self, h):
        return {"ranks": self.intra[h]["ranks"], "nodes": [h], "rail": None, "kind": "intra"}

    def g_gpus(self, h, e):
        lr = self.by_node[h]
        return {"ranks": sorted(lr[x] for x in e), "nodes": [h], "rail": None, "kind": "gpu-pair", "gpus": list(e)}

    def edge_bundle(self, h, e):
        """GPU pair e of node h with the same pair on each of h's controls: measured in one batch."""
        return [self.g_gpus(h, e)] + [dict(self.g_gpus(c, e), control=h) for c in self.local[h]["controls"]]

    # ---------------------------------------------------------------- levels
    def intra_level(self):
        rows = [r for r in self.intra.values() if r["tries"]]
        return {h: lv for h, (lv, _) in intra_levels(rows, self.min_intra, self.cpu)[1].items()} if rows else {}

    def pair_levels(self):
        return screen_pair_levels(self.pairs, self.min_inter, self.cpu)[1] if self.pairs else []

    def edge_levels(self, h):
        """{edge: level} of node h's measured GPU pairs against the same pair on its controls (and on h
        itself: a reference from the best values, the upper quartile from 4 values on)."""
        st, fail, warn = self.local[h], *screen_fractions("net", self.cpu)
        out = {}
        for e, vs in st["edges"].items():
            if not vs:
                continue
            peers = [max(c) for c in st["ctrl"].get(e, {}).values() if c] + [max(vs)]
            ref = screen_reference(peers) if len(peers) > 1 else \
                screen_reference(max(v) for v in st["edges"].values() if v)
            st["refs"][e] = ref["ref"]
            out[e] = screen_level(max(vs), ref, fail, warn)
        return out

    def pick_controls(self, h, levels):
        if h in self.controls:
            return self.controls[h]
        cls = (len(self.intra[h]["ranks"]), self.intra[h]["model"])
        busy = {c for cs in self.controls.values() for c in cs}
        ok = [x for x in self.intra if x != h and levels.get(x) == "OK" and x not in self.local
              and (len(self.intra[x]["ranks"]), self.intra[x]["model"]) == cls
              and sorted(self.by_node[x]) == sorted(self.by_node[h])]
        pick = ([x for x in ok if x not in busy] + [x for x in ok if x in busy])[:SCREEN_CONTROLS]
        self.controls[h] = pick
        return pick

    # ---------------------------------------------------------------- what to measure next
    def wants(self):
        """Bundles of groups wanted now, in order of priority; [] when the screen is done."""
        if self.intra and not any(r["tries"] for r in self.intra.values()):
            return [[self.g_intra(h)] for h in self.intra], "intra"
        ilv, plv = self.intra_level(), self.pair_levels()
        slow = [i for i, lv in enumerate(plv) if lv != "OK" and self.pairs[i].get("tries", 1) < SCREEN_TRIES]
        while not slow and self.done < len(self.rounds):  # each pair round's slow ones again before the next
            self.done += 1
            if self.rounds[self.done - 1]:
                return [[dict(g, kind="pair", round=self.done)] for g in self.rounds[self.done - 1]], f"p{self.done}"
        out = self.local_wants(ilv)
        for h, r in self.intra.items():
            if h in self.local or ilv.get(h, "OK") == "OK" or r["tries"] >= SCREEN_INTRA_TRIES:
                continue
            ctrl = self.pick_controls(h, ilv) if r["tries"] + 1 >= SCREEN_CONTROL_TRY else []
            out.append([self.g_intra(h)] + [dict(self.g_intra(c), control=h) for c in ctrl])
        out += [[{"ranks": m["ranks"], "nodes": list(m["nodes"]), "rail": m["rail"], "kind": "pair",
                  "round": m["round"], "redo": i}] for i in slow for m in [self.pairs[i]]]
        if self.third is None and not slow and self.pairs:
            self.third = screen_third_round(self.pairs, self.min_inter, self.cpu)
            if self.third["groups"]:
                self.todo3 = [dict(g, kind="pair", round=3)
                              for g in screen_rail_groups(self.third["groups"], self.by_node)]
        out += [[g] for g in self.todo3]
        return out, None

    def local_wants(self, ilv):
        """Localisation of the nodes slow in every try: their GPU pairs beside the controls' same pairs,
        the slow ones again, the remaining pairs when the ring shows none slow, then the node itself."""
        for h, r in self.intra.items():  # slow in every try, three GPUs or more: its GPU pairs, a ring first
            if h not in self.local and len(r["ranks"]) >= 3 and r["tries"] >= SCREEN_INTRA_TRIES \
                    and ilv.get(h, "OK") != "OK":
                self.local[h] = {"stage": 1, "edges": {e: [] for e in _matchings(_ring(sorted(self.by_node[h])))},
                                 "ctrl": {}, "refs": {}, "controls": self.pick_controls(h, ilv), "result": None}
        out = []
        for h, st in self.local.items():
            if st["result"] is not None:
                continue
            todo = [e for e, vs in st["edges"].items() if not vs]
            if todo:
                out += [self.edge_bundle(h, e) for e in todo]
                continue
            lv = self.edge_levels(h)
            redo = [e for e, x in lv.items() if x != "OK" and len(st["edges"][e]) < SCREEN_TRIES]
            if redo:
                out += [[self.g_gpus(h, e)] for e in redo]
                continue
            if any(x != "OK" for x in lv.values()):
                st["result"] = "localised"
                continue
            if st["stage"] == 1:
                lrs = sorted(self.by_node[h])
                rest = [e for e in _matchings([(a, b) for i, a in enumerate(lrs) for b in lrs[i + 1:]])
                        if e not in st["edges"]]
                st["stage"] = 2
                if rest:
                    st["edges"].update({e: [] for e in rest})
                    out += [self.edge_bundle(h, e) for e in rest]
                    continue
            if self.intra[h]["tries"] < SCREEN_INTRA_TRIES + SCREEN_CONFIRM_TRIES and ilv.get(h, "OK") != "OK":
                out.append([self.g_intra(h)] + [dict(self.g_intra(c), control=h) for c in st["controls"]])
                continue
            st["result"] = "unlocalised"
        return out

    # ---------------------------------------------------------------- results
    def take(self, batch, posts):
        got = {tuple(m["ranks"]): m for m in screen_measured(batch, posts)}
        res = [(g, *((got[k]["busbw"], got[k].get("time_us")) if k in got else (None, None)))
               for g in batch for k in [tuple(g["ranks"])]]
        beside = {g["nodes"][0]: bw for g, bw, _ in res if g["kind"] == "intra"}
        for g, bw, us in res:
            h = g["nodes"][0]
            if g["kind"] == "intra" and "control" not in g:
                self.take_intra(h, bw, us, beside)
            elif g["kind"] == "gpu-pair":
                e, v = tuple(g["gpus"]), 0.0 if bw is None else bw
                if "control" not in g and h in self.local:
                    self.local[h]["edges"][e].append(v)
                for st in self.local.values():
                    if h in st["controls"]:
                        st["ctrl"].setdefault(e, {}).setdefault(h, []).append(v)
            elif g["kind"] == "pair" and "redo" in g:
                self.pairs[g["redo"]] = screen_best([self.pairs[g["redo"]]], [dict(g, busbw=bw, time_us=us)])[0]
            elif g["kind"] == "pair":
                self.pairs.append({"round": g["round"], "nodes": list(g["nodes"]), "rail": g["rail"], "busbw": bw,
                                   "hca": screen_pair_hca(g["ranks"], posts, self.records), "ranks": g["ranks"],
                                   "time_us": us})
        took = {tuple(g["ranks"]) for g in batch if g["kind"] == "pair" and "redo" not in g}
        self.todo3 = [g for g in self.todo3 if tuple(g["ranks"]) not in took]

    def take_intra(self, h, bw, us, beside):
        r = self.intra[h]
        r["tries"] += 1
        r["values"].append(bw)
        if r["busbw"] is None or (bw or 0.0) > r["busbw"]:
            r["busbw"], r["time_us"] = bw, us
        ctrl = {c: beside[c] for c in self.controls.get(h, []) if c in beside}
        if ctrl and r["tries"] > 1:
            r.setdefault("beside", []).append({"try": r["tries"], "busbw": bw, "controls": ctrl})

    # ---------------------------------------------------------------- the loop
    def run(self):
        while len(self.batches) < SCREEN_BATCHES_MAX:
            bundles, name = self.wants()
            batch = _pack(bundles)
            if not batch:
                break
            name = name or f"b{len(self.batches) + 1}"
            batch = [dict(g, batch=name) for g in batch]
            posts = self.measure(batch) or {}
            self.batches.append({"name": name, "groups": len(batch), "kinds": dict(Counter(g["kind"] for g in batch))})
            self.take(batch, posts)
        return self.result()

    def result(self):
        intra = []
        for h, r in self.intra.items():
            if not r["tries"]:
                continue
            row = {k: r[k] for k in ("host", "busbw", "ranks", "model", "time_us")}
            if r["tries"] > 1:
                row.update(tries=r["tries"], first=r["values"][0], values=r["values"])
                if r.get("beside"):
                    row["beside"] = r["beside"]
            if h in self.local:
                row["local"] = self.local_result(h)
            intra.append(row)
        return {"intra": intra, "pairs": self.pairs,
                "suspect_links": screen_suspect_links(self.pairs, self.min_inter, self.cpu),
                "third": self.third or {"suspects": [], "passing": [], "groups": []},
                "batches": self.batches}

    def local_result(self, h):
        """{'controls', 'pairs': [{'gpus', 'ranks', 'busbw' (best), 'tries', 'ref', 'level'}], 'gpus': GPUs
        slow with two or more partners and at speed with none, 'links': slow pairs no such GPU explains,
        'wide': every pair slow, 'result': 'localised'|'unlocalised'|None}."""
        st = self.local[h]
        lv = self.edge_levels(h)
        lr = self.by_node[h]
        pairs = [{"gpus": list(e), "ranks": sorted(lr[x] for x in e), "busbw": max(vs), "tries": len(vs),
                  "ref": st["refs"].get(e), "level": lv[e]} for e, vs in sorted(st["edges"].items()) if vs]
        slow = {e for e, x in lv.items() if x != "OK"}
        n_slow, n_ok = Counter(g for e in slow for g in e), Counter(g for e in lv if e not in slow for g in e)
        gpus = sorted(g for g, c in n_slow.items() if c >= 2 and not n_ok[g])
        links = [list(e) for e in sorted(slow) if not set(e) & set(gpus)]
        return {"controls": st["controls"], "pairs": pairs, "gpus": gpus, "links": links,
                "wide": bool(slow) and len(slow) == len(lv), "result": st["result"]}


def screen_loop(records, measure, min_busbw_intra=None, min_busbw_inter=None, cpu=False):
    """The screen's network rounds as one loop. records: the gathered records ({'rank', 'host',
    'local_rank', 'gpu': {'name'}}); measure(groups) runs every group of one batch at once (each rank in
    at most one group) and returns {rank: {'busbw': GB/s, 'time_us': us, ...}}, each member posting its
    group's result (a pair rank may add 'hca'). A group: {'ranks', 'nodes', 'rail' (None inside a node),
    'kind': 'intra'|'pair'|'gpu-pair', 'batch': the batch's name ('intra', 'p1', 'p2', 'p3', then 'b<k>')},
    a pair also 'round', a GPU pair 'gpus' (local ranks).
    Batches: the intra-node round (every node of two or more ranks), the pair rounds of screen_rounds
    (every rail), then, packed together while their ranks are free: the re-measurements and localisations
    of the comment above, and the suspect round (screen_third_round) once the pair rounds are settled.
    -> {'intra': judge_intra's rows (re-measured ones with 'tries', 'first', 'values', 'beside';
    localised ones with 'local'), 'pairs': judge_pairs' rows, 'suspect_links', 'third', 'batches':
    [{'name', 'groups', 'kinds'}]}."""
    return _Loop(records, measure, min_busbw_intra, min_busbw_inter, cpu).run()


def judge_transients(screen):
    """Measurements slow at first and at speed when measured again (screen_loop's re-measurements: a
    burst of another job's traffic, a moment of contention): one WARN per check that names no host, so
    that --drain never acts on it, with what was seen. -> findings under 'intra-node' / 'inter-node'."""
    cpu, out = bool(screen.get("cpu")), []
    intra = [p for p in screen.get("intra") or [] if p.get("tries", 1) > 1]
    if intra:
        refs, levels = intra_levels(screen.get("intra") or [], screen.get("min_busbw_intra"), cpu)
        seen = [(p, refs[levels[p["host"]][1]]["ref"] or 1.0) for p in intra if levels[p["host"]][0] == "OK"]
        if seen:
            out.append(_transient_finding("intra-node", [
                f"{p['host']} " + " then ".join(f"{float(v or 0.0) / r:.2f}" for v in p.get("values") or [])
                for p, r in seen], "node(s)"))
    pairs = screen.get("pairs") or []
    if pairs:
        refs, levels = screen_pair_levels(pairs, screen.get("min_busbw_inter"), cpu)
        seen = [m for m, lv in zip(pairs, levels, strict=True) if lv == "OK" and m.get("tries", 1) > 1]
        if seen:
            ratio = lambda m, v: float(v or 0.0) / (refs[m["rail"]]["ref"] or 1.0)  # noqa: E731
            out.append(_transient_finding("inter-node", [
                f"{'<->'.join(m['nodes'])} rail {m['rail']} {ratio(m, m.get('first')):.2f} then "
                f"{ratio(m, m.get('busbw')):.2f} (best of {m['tries']})" for m in seen],
                "measurement(s) between nodes"))
    return out


def _transient_finding(check, items, noun):
    shown = "; ".join(items[:8]) + (f"; and {len(items) - 8} more" if len(items) > 8 else "")
    return dict(finding(check, "WARN", f"{len(items)} {noun} slow at first and at speed when measured again "
                        f"(ratio to the reference, each try): {shown}: a transient (another job's traffic, a burst), "
                        "no host is named"),
                evidence=f"{len(items)} {noun} slow once, at speed in a later try", transient=True,
                action="none now: nothing is drained; re-run the preflight if the same node or link recurs")


def judge_screen(screen):
    """Every screen judgement. screen: the dict render_performance takes (screen_loop's and the GPU
    screen's). -> findings: judge_gpu_perf, judge_gpu_transients, judge_intra, judge_pairs, judge_transients."""
    cpu = bool(screen.get("cpu"))
    return (judge_gpu_perf(screen.get("gpu") or [], screen.get("min_tflops"), screen.get("min_hbm"), cpu)
            + judge_gpu_transients(screen.get("gpu") or [], screen, cpu)  # the floors: min_tflops, min_hbm
            + judge_intra(screen.get("intra") or [], screen.get("min_busbw_intra"), cpu)
            + judge_pairs(screen.get("pairs") or [], screen.get("min_busbw_inter"), cpu)[0]
            + judge_transients(screen))



# ============================================================================ aiv/node/judge.py
# Floor 3: the node gate (--node-check): its contexts, what nvidia-smi, Slurm and the kernel log say as plain
SCRIPT_CONTEXTS = {"prolog_slurmd": "prolog", "epilog_slurmd": "epilog"}  # Slurm's SLURM_SCRIPT_CONTEXT
NODE_KMSG_BYTES = 8 << 20    # the most of the kernel log read for Xid lines (within NODE_KMSG_BOUND_S)
NODE_NPD_MAX = 80            # NPD's max_output_length in the shipped plugin config: the npd line fits it
NODE_LINE_PREFIX = "ai-infra-validator node-check:"  # the summary line, the one stdout line (grep it)
# What a step of a device's work costs at most (seconds; GPU / CPU), so that a step that cannot finish
# before the budget ends is skipped and named instead of started. The re-measure costs what the first took.
NODE_STEP_S = {"numerics": {"gpu": 4.0, "cpu": 2.0}, "speed": {"gpu": 5.0, "cpu": 1.5},
               "allreduce": {"gpu": 8.0, "cpu": 5.0}}


def node_checks():
    """The checks the node gate makes (those CHECK_RULES runs in a node context): its own first, then those it
    shares with the preflight, each in CHECKS order."""
    mine = [c for c in CHECKS if set(CHECK_RULES[c]["contexts"]) & set(NODE_CONTEXTS)]
    return sorted(mine, key=lambda c: "job" in CHECK_RULES[c]["contexts"])


# ---------------------------------------------------------------------------------------------- context
def node_context(given, env):
    """The context to run in -> (context, problem or None). given: the word after --node-check ('auto' for
    none): then Slurm's SLURM_SCRIPT_CONTEXT (prolog_slurmd, epilog_slurmd) decides, else health. A script
    context of another kind (the controller's PrologSlurmctld, a task prolog) is not this node's gate: the
    problem says so (not assessed)."""
    if given in NODE_CONTEXTS:
        return given, None
    sc = (env.get("SLURM_SCRIPT_CONTEXT") or "").strip()
    if not sc:
        return "health", None
    if sc in SCRIPT_CONTEXTS:
        return SCRIPT_CONTEXTS[sc], None
    ctx = "prolog" if sc.startswith("prolog") else "epilog" if sc.startswith("epilog") else "health"
    return ctx, (f"SLURM_SCRIPT_CONTEXT={sc!r} is not a node's own prolog or epilog (prolog_slurmd, "
                 "epilog_slurmd): use the node check as Prolog=, Epilog= or HealthCheckProgram=")


def context_from_argv(argv, env):
    """The context a command line asks for, read without the parser (for a usage error's exit code): its word
    when it is one of NODE_CONTEXTS; no word: node_context's choice. A word that is none of them: Slurm's
    SLURM_SCRIPT_CONTEXT, or a job's SLURM_JOB_ID (a prolog or epilog of a Slurm that does not set it), decides,
    since a prolog must never exit 1 for it; else the word in another case or spacing ('nPd'); else 'unknown'
    (exit 2: never 0, which NPD would read as OK)."""
    for i, a in enumerate(argv):
        if a.startswith("--node-check="):
            word = a.split("=", 1)[1]
        elif a == "--node-check":
            nxt = argv[i + 1] if i + 1 < len(argv) else ""
            word = "auto" if not nxt or nxt.startswith("--") else nxt
        else:
            continue
        if word in NODE_CONTEXTS or word == "auto":
            return node_context(word, env)[0]
        sc = (env.get("SLURM_SCRIPT_CONTEXT") or "").strip()
        if sc or env.get("SLURM_JOB_ID"):
            return node_context("auto", env)[0] if sc else "prolog"
        near = word.strip().lower()
        return near if near in NODE_CONTEXTS else "unknown"
    return None


def node_exit_code(context, verdict, drainable):
    """prolog, epilog, health: 1 only for a FAIL whose evidence singles this node out (Slurm drains on a
    failed prolog or epilog; health drains itself), else 0 (fail open). npd: 0 PASS, 1 such a FAIL, 2 unknown
    (not assessed, or a FAIL that names no node)."""
    if verdict == "FAIL" and drainable:
        return 1
    if context == "npd":
        return 0 if verdict == "PASS" else 2
    return 0


# ---------------------------------------------------------------------------------------------- parsers
NODE_GPU_FIELDS = ("index", "uuid", "pci.bus_id", "name", "memory.used", "memory.total",
                   "ecc.errors.uncorrected.volatile.total", "remapped_rows.pending", "remapped_rows.failure")
NODE_GPU_KEYS = ("index", "uuid", "pci", "name", "mem_used_mib", "mem_total_mib", "ecc_uncorrected",
                 "remap_pending", "remap_failure")
NODE_APP_FIELDS = ("pid", "used_memory", "gpu_uuid", "process_name")


def pci_norm(text):
    """A PCI bus id in sysfs form ('0000:3b:00.0') from nvidia-smi's ('00000000:3B:00.0') or the kernel's
    ('0000:3b:00'); None when it is none."""
    m = re.fullmatch(r"(?:([0-9a-f]{1,8}):)?([0-9a-f]{2}):([0-9a-f]{2})(?:\.([0-7]))?", (text or "").strip().lower())
    if not m:
        return None
    return f"{int(m.group(1) or '0', 16):04x}:{m.group(2)}:{m.group(3)}.{m.group(4) or '0'}"


def _smi_value(key, v):
    v = v.strip()
    if not v or v.startswith("[") or v in ("N/A", "Unknown Error"):
        return None
    if key in ("remap_pending", "remap_failure"):
        return {"yes": True, "no": False}.get(v.lower())
    if key in ("index", "mem_used_mib", "mem_total_mib", "ecc_uncorrected"):
        try:
            return int(float(v))
        except ValueError:
            return None
    return pci_norm(v) if key == "pci" else v


def parse_node_gpus(text):
    """nvidia-smi --query-gpu=NODE_GPU_FIELDS --format=csv,noheader,nounits -> (rows [{NODE_GPU_KEYS}], lost
    [{'pci', 'why'}]): a GPU NVML cannot reach is a line 'Unable to determine the device handle for GPU
    <bus id>: <why>' in place of its row."""
    rows, lost = [], []
    for line in (text or "").splitlines():
        m = re.search(r"device handle for GPU\s*([0-9A-Fa-f:.]+)\s*:\s*(.*)", line)
        if m:
            lost.append({"pci": pci_norm(m.group(1)) or m.group(1), "why": " ".join(m.group(2).split())[:160]})
            continue
        vals = line.split(",")
        if len(vals) != len(NODE_GPU_KEYS) or not vals[1].strip().startswith(("GPU-", "MIG-")):
            continue
        row = {k: _smi_value(k, v) for k, v in zip(NODE_GPU_KEYS, vals, strict=True)}
        if row["index"] is not None:
            rows.append(row)
    return sorted(rows, key=lambda r: r["index"]), lost


def parse_compute_apps(text):
    """nvidia-smi --query-compute-apps=NODE_APP_FIELDS --format=csv,noheader,nounits -> [{'pid', 'mem_mib',
    'uuid', 'name'}] (memory None where NVML does not say)."""
    rows = [[v.strip() for v in line.split(",")] for line in (text or "").splitlines()]
    return [{"pid": int(vals[0]), "mem_mib": int(vals[1]) if vals[1].isdigit() else None, "uuid": vals[2],
             "name": ",".join(vals[3:]).strip() or None}
            for vals in rows if len(vals) >= 3 and vals[0].isdigit() and vals[2].startswith(("GPU-", "MIG-"))]


def parse_gpu_ids(text):
    """SLURM_JOB_GPUS ('0,1,3' or '0-3') -> sorted GPU indices, None when empty or malformed."""
    try:
        ids = sorted(set(parse_ranges(text.strip()))) if text and text.strip() else None
    except ValueError:
        return None
    return ids if ids and all(i >= 0 for i in ids) else None


def parse_gres_gpus(gres):
    """scontrol's Gres= ('gpu:8', 'gpu:h100:8(S:0-1)', 'gpu:a:4,gpu:b:4', '(null)') -> GPUs configured, None."""
    counts = [int(m.group(1)) for part in re.split(r",(?![^()]*\))", gres or "")
              for m in [re.fullmatch(r"gpu(?::[^:()]+)?:(\d+)(?:\(.*\))?", part.strip())] if m]
    return sum(counts) if counts else None


def parse_gres_used(gres_used):
    """scontrol show node -d's GresUsed= ('gpu:h100:2(IDX:0-1)', 'gpu:0(IDX:N/A)', 'gpu:2') -> (GPUs jobs hold,
    their indices, or None where Slurm does not say which: no IDX for a GRES it tracks without device files)."""
    count, idx, said = 0, set(), True
    for m in re.finditer(r"(?:^|,)gpu(?::[^:(),]+)*:(\d+)(?:\(IDX:([^)]*)\))?", gres_used or ""):
        count += int(m.group(1))
        if m.group(2) and re.fullmatch(r"[0-9,\-]+", m.group(2)):
            idx |= set(parse_ranges(m.group(2)))
        elif int(m.group(1)):
            said = False
    return count, sorted(idx) if said else None


def gres_busy(gres_used, ids):
    """{GPU: why} of the GPUs Slurm gave to running jobs (GresUsed): by index where Slurm says which, else every
    GPU while any is allocated (which ones is not known: none is touched)."""
    count, idx = parse_gres_used(gres_used)
    if idx is not None:
        return {i: "allocated to a running job (Slurm's GresUsed)" for i in ids if i in idx}
    return {i: f"{count} GPU(s) of the node allocated to running jobs, which ones Slurm does not say (GresUsed)"
            for i in ids} if count else {}


def parse_slurm_node(text):
    """`scontrol show node -d -o NODE` -> {'state', 'reason', 'gres', 'gres_used'} (None: absent)."""
    def field(name):
        m = re.search(rf"(?:^|\s){name}=(\S+)", text or "")
        return m.group(1) if m else None
    why = scontrol_reason(text)
    return {"state": field("State"), "reason": why if why not in ("", "none", "(null)") else "",
            "gres": field("Gres"), "gres_used": field("GresUsed")}


XID_LINE = re.compile(r"NVRM: Xid \(PCI:([0-9A-Fa-f:.]+)\): (\d+)(?:,\s*(.*))?")


def parse_xids(text):
    """Kernel log records (/dev/kmsg 'pri,seq,usec,flags;msg' or dmesg '[ secs] msg') -> the NVIDIA Xid lines,
    [{'pci', 'xid', 't': seconds after boot or None, 'text'}]."""
    out = []
    for line in (text or "").splitlines():
        m = XID_LINE.search(line)
        if not m:
            continue
        t = re.match(r"\s*\d+,\d+,(\d+),[^;]*;", line)
        d = re.match(r"\s*\[\s*(\d+\.\d+)\]", line)
        secs = int(t.group(1)) / 1e6 if t else float(d.group(1)) if d else None
        out.append({"pci": pci_norm(m.group(1)) or m.group(1).lower(), "xid": int(m.group(2)),
                    "t": secs, "text": " ".join((m.group(3) or "").split())[:120]})
    return out


# ---------------------------------------------------------------------------------------------- devices
def node_devices(context, gpus, job_ids, nproc, allocated, apps, cpu):
    """Which devices the check covers and what it may run on each. gpus: NVML's rows (index, uuid); job_ids:
    the job's GPUs (prolog, epilog; None: every GPU); cpu: no GPU here (device k is a CPU worker standing in for
    GPU k, nproc of them); allocated: {GPU: why} Slurm gave to running jobs (health, gres_busy); apps: compute processes
    by GPU index. -> {'ids': covered, 'held': {id: apps} (prolog, epilog: a process before or after the job),
    'busy': {id: why} (health, npd: not computed on, not judged for speed), 'compute': ids to compute on}."""
    ids = list(range(nproc)) if cpu else [g["index"] for g in gpus]
    if job_ids is not None and (job_ids or not cpu):  # a job without GPUs: none of them (CPU workers still run)
        ids = [i for i in ids if i in job_ids]
    job = context in ("prolog", "epilog")  # a process there: held by a job's leftover; in health, npd: busy
    held = {i: apps[i] for i in ids if job and apps.get(i)}
    busy = {} if job else {i: f"{len(apps[i])} process(es) of others on it" if apps.get(i) else allocated[i]
                           for i in ids if apps.get(i) or i in (allocated or {})}
    compute = [] if context not in NODE_COMPUTE else [i for i in ids if i not in held and i not in busy]
    return {"ids": ids, "held": held, "busy": busy, "compute": compute}


def node_expectations(given, gres, pci, driver):
    """What the node should have, [(source words, count)]: --expect-gpus (given: (words, n)) alone when given;
    else the node's gres in Slurm (scontrol's Gres=), the NVIDIA GPUs on its PCI bus, the driver's list."""
    if given is not None:
        return [given]
    counts = (("the node's gres in Slurm", parse_gres_gpus(gres)),
              ("NVIDIA GPUs on the PCI bus", len(pci) if pci else None),
              ("the NVIDIA driver's list", len(driver) if driver else None))
    return [(words, n) for words, n in counts if n is not None]


def node_plan(context, facts, slurm, nproc, expectations, keep=None):
    """-> (cpu, gpus, devices): whether CPU workers stand in (no GPU seen and none expected), the node's GPUs
    (NVML's rows, else the driver's list) and node_devices' plan with the compute processes by GPU index and, in
    health, the GPUs Slurm gave to running jobs (slurm: parse_slurm_node's view). keep(by_uuid, apps) -> the
    processes left to judge (the prolog's and epilog's: none without the lock, never a node check's own worker)."""
    cpu = not (facts["rows"] or facts["driver"]) and not facts["pci"] and all(n == 0 for _, n in expectations)
    gpus = facts["rows"] or [{"index": i, "uuid": None, "pci": p} for i, p in enumerate(facts["driver"])]
    by_uuid = {g["uuid"]: g["index"] for g in gpus if g.get("uuid")}
    apps = group_by([p for p in facts["apps"] if p["uuid"] in by_uuid], lambda p: by_uuid[p["uuid"]])
    if keep is not None:
        apps = keep(by_uuid, apps)
    ids = list(range(nproc)) if cpu else [g["index"] for g in gpus]
    used = gres_busy((slurm or {}).get("gres_used"), ids) if context == "health" else {}
    return cpu, gpus, node_devices(context, gpus, facts["job_gpus"], nproc, used, apps, cpu)


def judge_none_judged(node, devices, noun="GPU(s)"):
    """A node with devices none of which was judged is never a PASS: every device busy with others (health,
    npd: in use, so nothing of it is computed or judged for speed) -> a NOTE that says which and why, and the
    node is NOT ASSESSED; [] when at least one device was judged (the others are 'busy, not judged')."""
    ids, busy = devices.get("ids") or [], devices.get("busy") or {}
    if not ids or any(i not in busy for i in ids):
        return []
    why = "; ".join(f"{i}: {w}" for i, w in sorted(busy.items()))
    return [unassessed("gpu-procs", f"{node}: every one of its {len(ids)} {noun} is busy, none judged ({why}): "
                       "no numerics, speed or all-reduce ran; run the check again when a GPU is free",
                       f"every {noun[:-3]} busy, none judged")]


# ---------------------------------------------------------------------------------------------- findings
def _f(check, status, reason, evidence, node, short=None, gpus=(), ranks=(), **kw):
    """A node-check finding: hosts=[node] only when its evidence singles the node out and it is no PASS."""
    named = status != "PASS" and evidence in LOCALISING
    f = finding(check, status, reason, [node] if named else [], ranks)
    f.update(blame=evidence if status != "PASS" else None, short=short or reason[:90], gpus=sorted(set(gpus)),
             **kw)
    return f


def unassessed(check, reason, short=None):
    """A check that could not run through the tool's own fault (no torch, a worker that died, a bug): a WARN
    that names no host; with no FAIL beside it the node is NOT ASSESSED."""
    return dict(finding(check, "WARN", reason), blame="not-collected", short=short or reason[:90], gpus=[],
                unassessed=True)


def _gpu_word(i, uuid=None):
    return f"GPU {i}" + (f" ({uuid})" if uuid else "")


def judge_gpu_count(node, found, lost, expectations, job_ids=None, cpu=False):
    """The GPUs the node should have against those NVML lists. found: indices NVML lists; lost: GPUs NVML
    cannot reach ({'pci', 'why'}); expectations: [(source words, count)], each held to what is found (fewer:
    FAIL own, more: WARN); job_ids: the job's GPUs, each of which must be there."""
    out, n = [], len(found)
    for pci in lost:
        out.append(_f("gpu-count", "FAIL", f"{node}: NVML cannot reach the GPU at PCI {pci['pci']}: {pci['why']}: "
                      "drain it; a GPU lost to the driver needs a reset or a reboot (nvidia-smi -r, dmesg for Xid 79)",
                      "own", node, f"GPU at {pci['pci']} lost: {pci['why'][:40]}"))
    for source, want in expectations:
        if n < want:
            out.append(_f("gpu-count", "FAIL", f"{node}: {want} GPU(s) expected ({source}) but NVML lists {n}: "
                          "drain it; check nvidia-smi, dmesg for Xid 79 (fallen off the bus), reseat the GPU",
                          "own", node, f"{n} of {want} GPUs expected"))
        elif n > want:
            out.append(_f("gpu-count", "WARN", f"{node}: {n} GPU(s) listed, more than the {want} expected "
                          f"({source}): the expectation may be stale", "own", node))
    missing = [i for i in job_ids or () if i not in found] if not cpu else []
    if missing:
        out.append(_f("gpu-count", "FAIL", f"{node}: the job's GPU(s) {format_ranges(missing)} (SLURM_JOB_GPUS) "
                      f"are not among the {n} NVML lists ({format_ranges(found) or 'none'})", "own", node,
                      f"job GPU(s) {format_ranges(missing)} missing", missing))
    if not any(f["status"] == "FAIL" for f in out):
        said = "; ".join(f"{w} expected by {s}" for s, w in expectations) or "no expectation given"
        out.append(_f("gpu-count", "PASS", f"{node}: {'no GPU, CPU workers stand in' if cpu else f'{n} GPU(s)'}"
                      f" ({said})", None, node))
    return out


def _proc_words(p):
    who = ", ".join(x for x in (p.get("name"), f"user {p['user']}" if p.get("user") else "",
                                f"job {p['job']}" if p.get("job") else "") if x)
    mem = f"{human_bytes(p['mem_mib'] << 20)}" if p.get("mem_mib") is not None else "memory not reported"
    return f"pid {p['pid']}" + (f" ({who})" if who else "") + f" holds {mem}"


def judge_gpu_procs(node, context, devices, uuids, noun="GPU(s)"):
    """prolog, epilog: a process on the job's GPU before the job started (a previous job's leftover: the classic
    OOM at job start) or still there after it ended: FAIL own, naming the pid and what it holds. health, npd:
    a GPU in use is busy, not broken: not judged for speed, never drained (a PASS that says so)."""
    when = "before the job started" if context == "prolog" else "after the job ended"
    out = [_f("gpu-procs", "FAIL", f"{node}: {_gpu_word(i, uuids.get(i))} is held {when}: "
              + "; ".join(_proc_words(p) for p in procs[:4]) + (f" and {len(procs) - 4} more" if len(procs) > 4 else "")
              + ": a leftover of an earlier job (the next job would run out of memory); kill it or reset the GPU",
              "own", node, f"GPU {i} held by pid {procs[0]['pid']}", [i], pids=[p["pid"] for p in procs])
           for i, procs in sorted(devices["held"].items())]
    if devices["busy"]:
        out.append(_f("gpu-procs", "PASS", f"{node}: GPU(s) " + ", ".join(
            f"{i} ({why})" for i, why in sorted(devices["busy"].items())) + ": busy, not judged (no speed, "
            "numerics or all-reduce on them; busy is not broken: never drained for it)", None, node,
            gpus=list(devices["busy"]), busy=sorted(devices["busy"])))
    elif not out:
        out.append(_f("gpu-procs", "PASS", f"{node}: no process of others on the {len(devices['ids'])} {noun} "
                      "checked", None, node))
    return out


def gpu_rows(node, gpus, load=None):
    """Preflight-shaped rows of the node's GPUs (judge_gpu_facts, judge_gpu_perf): one per GPU, host = the node,
    rank and local rank = its index; gpus: NVML's rows (parse_node_gpus) or {index: {'uuid', 'name'}}; load:
    {index: a measurement or the facts under load} merged in."""
    by = {g["index"]: g for g in gpus} if isinstance(gpus, list) else {i: dict(g, index=i) for i, g in gpus.items()}
    return [dict({k: v for k, v in g.items() if k not in ("index", "name")}, **(load or {}).get(i, {}), rank=i,
                 host=node, local_rank=i, uuid=g.get("uuid"), model=g.get("name") or "CPU")
            for i in sorted(set(by) | set(load or {})) for g in [by.get(i) or {}]]


def gpu_words(node):
    """A GPU's words in the node gate's lines: '<node>: GPU <index> (<uuid>)'."""
    return lambda r: f"{node}: {_gpu_word(r['rank'], r.get('uuid'))}"


def _node_tagged(f, node, short):
    """A shared judge's finding as the node gate says it: its GPUs (the ranks are the GPU indices) and its short
    words (the drain reason, the NPD line)."""
    return dict(f, gpus=list(f.get("ranks") or []), short=short, hosts=[node] if f["hosts"] else [])


def _node_said(found, passed, said):
    """A shared judge's findings as the node gate says them: its PASS with the short words `passed` (no blame, no
    GPU), each other finding said(f) (_node_tagged)."""
    return [dict(f, blame=None, short=passed, gpus=[]) if f["status"] == "PASS" else said(f) for f in found]


def judge_gpu_health(node, gpus, load, xids, kmsg_unread=None):
    """Passive health per GPU: its NVML row (gpus: ECC, row remapping) and its facts under load (load: {index:
    the speed step's facts}: PCIe link, clocks), judged by the preflight's judge_gpu_facts under 'gpu-health'
    (one policy in both modes: a failed row remap FAILs own, uncorrected ECC errors, a pending remap, the link
    and the clocks WARN); Xid lines in the kernel log (history since boot, not the state now): WARN."""
    out, rows = [], {r["rank"]: r for r in gpu_rows(node, gpus, load)}
    for f in judge_gpu_facts(list(rows.values()), "gpu-health", gpu_words(node)):
        worst = sorted(gpu_fact_problems(rows[f["ranks"][0]]), key=lambda p: (p[0] != "FAIL", "PCIe" in p[1]))[0]
        first = worst[1].split(" (")[0].split(":")[0]  # a failed remap, the memory, then the rest
        out.append(_node_tagged(f, node, f"GPU {format_ranges(f['ranks'])} {first}"[:90]))
    by_pci = {g["pci"]: g["index"] for g in gpus if g.get("pci")}
    per = group_by(xids or [], lambda x: (by_pci.get(x["pci"]), x["pci"]))
    for (i, pci), xs in sorted(per.items(), key=lambda kv: (kv[0][0] is None, kv[0][0] or 0, kv[0][1])):
        codes = sorted({x["xid"] for x in xs})
        last = xs[-1]
        when = f" (the last {last['t']:.0f}s after boot: {last['text'] or 'no text'})" if last.get("t") is not None \
            else ""
        out.append(_f("gpu-health", "WARN", f"{node}: {'GPU ' + str(i) if i is not None else 'GPU'} at {pci}: "
                      f"{len(xs)} Xid line(s) in the kernel log since boot, Xid {', '.join(map(str, codes))}{when}: "
                      "history, not the state now (which the counters above judge); see NVIDIA's Xid catalog",
                      "own", node, f"Xid {','.join(map(str, codes))} on GPU {i if i is not None else pci}",
                      [] if i is None else [i], xids=codes))
    if not out:  # no GPU with a problem, no Xid line
        words = [f"{len(gpus)} GPU(s): no uncorrected ECC error, no row remap pending or failed",
                 "PCIe at full width and speed and clocks unslowed under load" if load else "",
                 f"kernel log not read ({kmsg_unread})" if kmsg_unread else "no Xid in the kernel log"]
        out.append(_f("gpu-health", "PASS", f"{node}: " + "; ".join(w for w in words if w), None, node))
    return out


def judge_node_devices(node, errors, done):
    """Workers whose device raised a CUDA or torch error (errors: {index: message}; done: indices whose device
    worked): FAIL own where another GPU of the node worked with the same software, else every GPU refused alike:
    a FAIL that names no host (the software: the driver against the venv's CUDA build, a missing fabric
    manager on every GPU ...)."""
    if not errors:
        return []
    if done:
        return [_f("device", "FAIL", f"{node}: GPU {i} cannot be used: {why}; the node's GPU(s) "
                   f"{format_ranges(done)} work with the same software: drain it, reset the GPU", "own", node,
                   f"GPU {i} unusable: {why[:50]}", [i]) for i, why in sorted(errors.items())]
    first = sorted(errors.items())[0]
    return [_f("device", "FAIL", f"{node}: every GPU checked ({format_ranges(errors)}) refused alike, e.g. GPU "
               f"{first[0]}: {first[1]}: the software or the node's driver as a whole (a CUDA build newer than "
               "the driver, no fabric manager): no GPU singled out, not drained", "everyone", node,
               f"every GPU unusable: {first[1][:50]}", list(errors))]


def numerics_rows_of(node, posts, gpus_by_id, driver=None, cpu_model=None):
    """judge_numerics' rows from the workers' numerics posts ({index: post}): the preflight's numerics_rows on
    records shaped as its own (a worker's index is its rank, and its CUDA index where it has a GPU)."""
    facts = {"driver": driver, "cpu_model": cpu_model}
    return numerics_rows([{"rank": i, "host": node, "local_rank": i, "device": i if g.get("uuid") else None, "gpu": g,
                           "node": facts} for i in sorted(posts) for g in [gpus_by_id.get(i) or {}]], posts)


NUMERICS_SHORT = {"reference": "off the fp64 reference", "majority": "bits unlike its peers",
                  "own": "its device failed", "tie": "no majority", "everyone": "every GPU alike",
                  "not-collected": "not checked in time"}


def judge_node_numerics(node, rows):
    """judge_numerics on the node's own GPUs, its findings and their evidence as they are (a culprit off the fp64
    reference 'reference', bits unlike a strict majority 'majority'; a disagreement without a majority, or a
    GPU alone off the reference, 'tie'; every GPU of a model off alike 'everyone': those name no host), with the
    node gate's GPUs and short words."""
    def said(f):
        what = NUMERICS_SHORT.get(f.get("blame"), f.get("blame") or "wrong")
        return _node_tagged(f, node, f"GPU {format_ranges(f['ranks'])} computes wrong numbers ({what})"
                            if f["hosts"] else f"numerics: {what}")
    return _node_said(judge_numerics(rows), "numerics agree", said)


def speed_flagged(node, first, gpus_by_id, cpu=False, min_tflops=None, min_hbm=None):
    """The GPUs whose first measurement (first: {index: {'tflops', 'hbm_gbps'}}) the preflight's rule flags
    (gpu_suspects): those measured again before any is named."""
    return gpu_suspects(gpu_rows(node, gpus_by_id, first), {"min_tflops": min_tflops, "min_hbm": min_hbm}, cpu)


def judge_node_speed(node, first, again, gpus_by_id, cpu=False, min_tflops=None, min_hbm=None, why_once=None):
    """The preflight's speed judge and its re-measure rule on one node: the first measurements (first: {index:
    {'tflops', 'hbm_gbps'}}) merged with the second of the GPUs measured again (again: {index: row};
    gpu_remeasured: each judged on its best value), then judge_gpu_perf against the model's table row, its peers
    on the node and the floors (slow again: 'persisted', names the node; not measured again: 'once', no host;
    why_once says why) and judge_gpu_transients (slow once, at speed again: a WARN 'once')."""
    if not first:
        return []
    rows = gpu_remeasured(gpu_rows(node, gpus_by_id, first), again)

    def said(f):
        twice = f.get("blame") == "persisted"
        how = f.get("evidence") if twice else f"measured once ({why_once or 'not measured again'}): not drained"
        return _node_tagged(dict(f, reason=f"{f['reason']}; {how}"), node,
                            f"GPU {format_ranges(f['ranks'])} slow, measured {'twice' if twice else 'once'}")
    out = _node_said(judge_gpu_perf(rows, min_tflops, min_hbm, cpu, gpu_words(node)), "speed within the reference",
                     said)
    floors = {"min_tflops": min_tflops, "min_hbm": min_hbm}
    slow = set(gpu_suspects(rows, floors, cpu))
    seen = sorted(r["rank"] for r in rows if int(r.get("tries") or 1) >= 2 and r["rank"] not in slow)
    return out + [_node_tagged(dict(f, ranks=seen), node, f"GPU {format_ranges(seen)} slow once, at speed again")
                  for f in judge_gpu_transients(rows, floors, cpu, gpu_words(node))]


def judge_node_allreduce(node, result, floor=None):
    """The node's own all-reduce across its compute GPUs (result: {'n', 'ok', 'want', 'got', 'busbw': [two
    measurements], 'error'}): wrong sums FAIL own; an error FAILs without a host ('not-collected': the node's
    NVLink or fabric manager, or the software, cannot be told apart alone); its busbw (two measurements) by the
    preflight's judge_intra and judge_transients on one row (alone, the node has only --min-busbw-intra to be
    judged against): below it both times 'persisted', below it and then above a transient (WARN 'once')."""
    if not result:
        return []
    n = result.get("n")
    if result.get("error"):
        return [_f("intra-node", "FAIL", f"{node}: the all-reduce across its {n} GPU(s) did not complete: "
                   f"{result['error']}: the node's NVLink/NVSwitch (fabric manager) or the software; not singled "
                   "out alone: run nvidia-smi topo -m, dcgmi diag -r 2", "not-collected", node,
                   "all-reduce failed: " + result["error"][:50])]
    if not result.get("ok"):
        return [_f("intra-node", "FAIL", f"{node}: the all-reduce across its {n} GPU(s) returned wrong sums "
                   f"({result.get('got')} where {result.get('want')} was due): drain it; NVLink/PCIe between its "
                   "GPUs (nvidia-smi nvlink -s, dcgmi diag -r 2)", "own", node, "all-reduce wrong sums")]
    bw = [b for b in result.get("busbw") or [] if b is not None]
    if not bw:
        return [_f("intra-node", "PASS", f"{node}: all-reduce across its {n} GPU(s) right; busbw not measured",
                   None, node)]
    again = intra_levels([{"host": node, "busbw": bw[0]}], floor)[1][node][0] != "OK"  # flagged: measured again
    row = {"host": node, "busbw": max(bw) if again else bw[0], "values": bw if again else bw[:1],
           "tries": len(bw) if again else 1, "first": bw[0]}
    out = []  # the preflight's judges of a node's inside: judge_intra (alone: the floor) and its transients
    for f in judge_transients({"intra": [row], "min_busbw_intra": floor}) + judge_intra([row], floor):
        short = f"busbw {max(bw):.3g} < {floor:g} GB/s twice" if f["status"] == "FAIL" and floor else None
        f = dict(f, blame="once" if f.get("transient") else f.get("blame"))
        out.append(dict(_node_tagged(f, node, short or f["reason"][:90]), gpus=[],
                        reason=f"{f['reason']} (the node's own all-reduce across its {n} GPU(s): right sums)"))
    return out


def judge_node_manifest(node, manifest, records, load_rows):
    """--manifest: this node against its accepted class (judge_manifest on the node's records, one per GPU, the
    PCIe link read under load from load_rows), tagged 'manifest'."""
    if not manifest:
        return []
    screen = {"gpu": load_rows} if load_rows else None
    return [dict(f, blame=None if f["status"] == "PASS" else "manifest", gpus=[], short=f["reason"][:90])
            for f in judge_manifest(manifest, records, screen)]


# ---------------------------------------------------------------------------------------------- one pass
def gpus_by_id(gpus, measured):
    """Each GPU's identity by index: NVML's row (gpus), completed by what its worker read (measured[i]['gpu'])."""
    out = {g["index"]: {"uuid": g.get("uuid"), "name": g.get("name"), "pci": g.get("pci")} for g in gpus}
    for i, m in measured.items():
        if m.get("gpu"):
            out[i] = dict(out.get(i) or {}, **{k: v for k, v in m["gpu"].items() if v is not None})
    return out


def judge_node(p):
    """Every finding of one pass, from its plain data p (NodeCheck.judge gathers it: 'node', 'ctx', 'cpu',
    'facts', 'gpus', 'devices', 'measured', 'again', 'why_once', 'allreduce', 'expectations', the floors
    'min_tflops', 'min_hbm', 'min_busbw_intra', 'python', 'driver', 'cpu_model', 'manifest' (None, the
    accepted manifest, or {'error'}) and 'node_facts'): the node gate's own checks, then the preflight's
    judges on preflight-shaped rows."""
    return _judge_passive(p) + _judge_measured(p) + _judge_node_manifest(p)


def _judge_passive(p):
    f, node, out = p["facts"], p["node"], []
    if f.get("smi_unread"):
        out.append(unassessed("gpu-health", f"{node}: nvidia-smi: {f['smi_unread']}: the GPUs' count, ECC and "
                              "row remapping were not read (a slow nvidia-smi is often NVML starting without "
                              "persistence mode: nvidia-smi -pm 1)", "nvidia-smi not read"))
    else:
        out += judge_gpu_count(node, [g["index"] for g in p["gpus"]], f["lost"], p["expectations"],
                               f["job_gpus"], p["cpu"])
    out += judge_gpu_procs(node, p["ctx"], p["devices"], {g["index"]: g.get("uuid") for g in p["gpus"]},
                           "CPU worker(s)" if p["cpu"] else "GPU(s)")
    if not p["cpu"] and not f.get("smi_unread"):
        out += judge_gpu_health(node, f["rows"], _load(p), f["xids"], f["kmsg_unread"])
    return out


def _load(p):
    """The first speed measurement of each device, with its facts under load: {index: row}."""
    return {i: m["speed"] for i, m in p["measured"].items() if isinstance(m.get("speed"), dict)}


def _judge_measured(p):
    node, measured, out = p["node"], p["measured"], []
    imports = sorted({m["import"] for m in measured.values() if m.get("import")})
    if imports:
        how = "usable" if imports[0].startswith("torch ") else "importable"  # a CPU-only build, or no torch
        out.append(unassessed("local", f"{node}: torch is not {how} in {p['python']}: {imports[0]}: the numerics, "
                              "speed and all-reduce were not run (the tool's environment, not the node)",
                              f"torch not {how}: " + imports[0][:60]))
    for i, m in sorted(measured.items()):
        if m.get("internal"):
            out.append(unassessed("internal", f"{node}: GPU {i}: {m['internal']}: a bug in the tool, not a fault "
                                  "of the node", f"tool error on GPU {i}"))
        if m.get("died"):
            out.append(unassessed("launch", f"{node}: the worker for GPU {i} {m['died']}", f"worker {i} died"))
    out += judge_node_devices(node, {i: m["error"] for i, m in measured.items() if m.get("error")},
                              [i for i, m in measured.items() if m.get("ready") and not m.get("error")])
    by_id = gpus_by_id(p["gpus"], measured)
    posts = {i: m["numerics"] for i, m in measured.items() if isinstance(m.get("numerics"), dict)
             and not m.get("error")}
    if posts:
        out += judge_node_numerics(node, numerics_rows_of(node, posts, by_id, p["driver"], p["cpu_model"]))
    first = {i: r for i, r in _load(p).items() if not measured[i].get("error")}
    out += judge_node_speed(node, first, p["again"], by_id, p["cpu"], p["min_tflops"], p["min_hbm"], p["why_once"])
    ar = p["allreduce"]
    if ar and ar.get("internal"):
        return out + [unassessed("internal", f"{node}: the all-reduce: {ar['error']}: a bug in the tool",
                                 "tool error in the all-reduce")]
    return out + judge_node_allreduce(node, ar, p["min_busbw_intra"])


def _judge_node_manifest(p):
    """--manifest: the node's records (one per device, its node facts on the first) against the accepted class."""
    if not p["manifest"]:
        return []
    if p["manifest"].get("error"):
        return [unassessed("manifest", f"{p['node']}: {p['manifest']['error']}", "manifest unreadable")]
    by_id, recs = gpus_by_id(p["gpus"], p["measured"]), []
    for k, i in enumerate(p["devices"]["ids"]):
        g = by_id.get(i) or {}
        gpu = None if p["cpu"] else {key: g.get(key) for key in ("name", "vram", "uuid", "pci")}
        recs.append({"rank": i, "host": p["node"], "local_rank": i, "gpu": gpu,
                     "versions": (p["measured"].get(i) or {}).get("versions") or {},
                     **({"node": p["node_facts"]} if k == 0 else {})})
    recs = recs or [{"rank": 0, "host": p["node"], "local_rank": 0, "gpu": None, "versions": {},
                     "node": p["node_facts"]}]
    return judge_node_manifest(p["node"], p["manifest"], recs, [dict(r, rank=i) for i, r in _load(p).items()])


# ---------------------------------------------------------------------------------------------- the verdict
def node_verdict(findings, context):
    """-> {'verdict': PASS | FAIL | NOT ASSESSED, 'drainable', 'culprits': the findings that drain, 'exit_code'}.
    A FAIL wins; without one, a check that could not run through our own fault makes NOT ASSESSED."""
    fails = [f for f in findings if f["status"] == "FAIL"]
    culprits = [f for f in fails if drains_in(f, context)]  # the one table's rule
    verdict = "FAIL" if fails else "NOT ASSESSED" if any(f.get("unassessed") for f in findings) else "PASS"
    return {"verdict": verdict, "drainable": bool(culprits), "culprits": culprits,
            "exit_code": node_exit_code(context, verdict, bool(culprits))}



# ============================================================================ aiv/out/render.py
# Floor 4: the report: topology, environment, fabric, collectives, performance, soak, findings.
def _lone_table_text(model, cpu):
    """What judged a lone GPU of its model: its table row, when it has one."""
    row = None if cpu else gpu_table_row(model)
    return (f"; judged against the table row {row['row']}: {_sn(row['tflops'])} TFLOPS, {row['hbm_gbps']:.0f} GB/s "
            f"({_table_rule()})") if row else ""


def _perf_gpu_lines(screen, cpu):
    per_rank, intra = screen.get("gpu") or [], screen.get("intra") or []
    refs, flags = _gpu_flags(per_rank, screen, cpu)
    irefs, ilevels = intra_levels(intra, screen.get("min_busbw_intra"), cpu)
    ibw = {p["host"]: p.get("busbw") for p in intra}
    L = [f"  gpu reference {m}: " + ", ".join(_screen_ref_text(refs[(m, k)], u, "GPUs")
                                             for k, u, _ in SCREEN_GPU_METRICS if refs[(m, k)]["count"])
         if max(refs[(m, k)]["count"] for k, _, _ in SCREEN_GPU_METRICS) >= 2 else
         f"  gpu reference {m}: none among peers (1 GPU of its model)" + _lone_table_text(m, cpu)
         for m in sorted({m for m, _ in refs})]
    L += [f"  intra-node reference{' ' + _intra_class_text(k) if len(irefs) > 1 else ''}: "
          + (_screen_ref_text(ref, "GB/s", "nodes") if ref["count"] >= 2 else "none among peers (1 node of its class)")
          for k, ref in sorted(irefs.items(), key=str)]
    by_host = group_by(per_rank, lambda r: r.get("host"))
    hosts = _screen_sorted(set(by_host) | set(ibw))
    collapse, healthy = len(hosts) > SCREEN_RENDER_ALL, []
    for h in hosts:
        rs = by_host.get(h, [])
        tf = [float(r["tflops"]) for r in rs if r.get("tflops") is not None]
        hb = [float(r["hbm_gbps"]) for r in rs if r.get("hbm_gbps") is not None]
        marks = [f"{'tflops' if k == 'tflops' else 'memory'} rank {rk} [{lv}]" for rk, (r, fl) in flags.items()
                 if r.get("host") == h for k, lv, _ in fl]
        if (ilv := ilevels.get(h, ("OK",))[0]) != "OK":
            marks.append(f"intra [{ilv}]")
        cells = f"gpus={len(rs)} " + (f"tflops min/med={_sn(min(tf))}/{_sn(_screen_median(tf))} " if tf else "")
        cells += f"mem min/med={min(hb):.0f}/{_screen_median(hb):.0f}GB/s " if hb else ""
        cells += f"intra={_sn(ibw[h])}GB/s" if ibw.get(h) is not None else "intra=-"
        if marks or not collapse:
            L.append(f"  node={h} {cells}" + (f"  <- slow: {', '.join(marks)}" if marks else ""))
        if not marks:
            healthy.append((h, tf, hb))
    if collapse and healthy:
        tf = [x for _, t, _ in healthy for x in t]
        hb = [x for _, _, b in healthy for x in b]
        ib = [float(ibw[h]) for h, _, _ in healthy if ibw.get(h) is not None]
        rng = " ".join(f"{k}={_sn(min(v))}-{_sn(max(v))}" for k, v in (("tflops", tf), ("mem", hb), ("intra", ib)) if v)
        L.append(f"  node={compress_hostlist([h for h, _, _ in healthy])} nodes={len(healthy)} {rng} (healthy)")
    return L


def _perf_pair_lines(screen, cpu):
    results = list(screen.get("pairs") or [])
    if not results:
        return []
    d = screen_diagnose(results, screen.get("min_busbw_inter"), cpu)
    per_rail = {rail: screen_reference(m.get("busbw") for m in results if m["rail"] == rail) for rail in d["rails"]}
    by_group = group_by(range(len(results)), lambda i: (results[i].get("round"), tuple(results[i]["nodes"])))
    rounds = Counter(r for r, _ in by_group)
    L = [f"  inter-node reference: {_screen_ref_text(d['ref'], 'GB/s', 'measurements')}; per rail: "
         + " ".join(f"{rail}:{_sn(per_rail[rail]['ref'])}" for rail in d["rails"]),
         "  groups per round: " + " ".join(f"{r}:{n}" for r, n in sorted(rounds.items(), key=lambda x: str(x[0])))
         + f"; {len(results)} measurement(s), {sum(lv != 'OK' for lv in d['levels'])} slow"]
    show_all = len(d["nodes"]) <= SCREEN_RENDER_ALL
    listed = [k for k, idx in by_group.items() if show_all or any(d["levels"][i] != "OK" for i in idx)]
    rows = []
    for rnd, g in listed:
        idx = sorted(by_group[(rnd, g)], key=lambda i: results[i]["rail"])
        cells = " ".join(f"{_sn(float(results[i].get('busbw') or 0))}" + ("!" if d["levels"][i] != "OK" else "")
                         for i in idx)
        bad = [i for i in idx if d["levels"][i] != "OK"]
        tail = (f"  <- slow rail {format_ranges(results[i]['rail'] for i in bad)} "
                f"[{_screen_worst([d['levels'][i] for i in bad])}]") if bad else ""
        rows.append(f"    round {rnd} {' <-> '.join(g)} GB/s by rail {format_ranges(results[i]['rail'] for i in idx)}: "
                    f"{cells}{tail}")
    if show_all:
        return L + rows
    return L + _at_most(rows, "slow group(s)") + [
        f"    ({len(by_group) - len(listed)} group(s) with every rail within the reference not shown)"]


def render_performance(screen):
    """The PERFORMANCE section as report lines. screen: {
      'gpu': judge_gpu_perf's per_rank, 'intra': judge_intra's per_node, 'pairs': judge_pairs' results
      (each optional), 'cpu': bool, 'min_tflops', 'min_hbm', 'min_busbw_intra', 'min_busbw_inter': floors or None,
      'splits': {round: seconds its group creation took} (optional)}; a per_rank row may carry the facts
      read under load (GPU_FACT_KEYS).
    Per node: TFLOPS min/median over its GPUs, memory GB/s min/median, intra-node busbw; the facts under
    load summed up, each GPU with a problem on a line of its own; per group and round the busbw of each
    rail (a slow rail's value marked '!', the row ending '<- slow ... [FAIL]'); the group creation times.
    Above SCREEN_RENDER_ALL nodes the healthy nodes collapse into one line with their ranges and only
    slow groups are listed (at most SCREEN_RENDER_SLOW, then a count), with the per-rail reference."""
    cpu = bool(screen.get("cpu"))
    L = [BAR, "PERFORMANCE", BAR]
    if cpu:
        L.append(f"  (CPU ranks: numbers are not comparable across ranks; only values below "
                 f"{SCREEN_CPU_FAIL:.2f} of the reference are judged)")
    if screen.get("gpu") or screen.get("intra"):
        L += _perf_gpu_lines(screen, cpu)
    L += _perf_fact_lines(screen) + _perf_pair_lines(screen, cpu)
    if screen.get("splits"):
        L.append("  group creation (each group's last member, the slowest group): "
                 + ", ".join(f"{screen_round_label(n)} {s:.2f}s" for n, s in screen["splits"].items()))
    if screen.get("judged_against"):
        L += ["  judged against (per measurement):"] + [f"    {a['text']}" for a in screen["judged_against"]]
    return L


def _at_most(lines, what):
    """The first SCREEN_RENDER_SLOW lines, then how many more there are (the JSON lists them all)."""
    more = len(lines) - SCREEN_RENDER_SLOW
    return lines[:SCREEN_RENDER_SLOW] + ([f"    ... and {more} more {what} (see --json)"] if more > 0 else [])


def _perf_fact_lines(screen):
    """The facts read under load summed up, each GPU with a problem on a line of its own; the GPUs not read."""
    gpus = screen.get("gpu") or []
    unread = _at_most([f"  not read (nvidia-smi gave no answer within {r['smi_unread']:g}s): {SMI_WHAT} of rank "
                       f"{r['rank']} {r.get('host')} GPU {r.get('local_rank')} {r.get('uuid') or '-'}"
                       for r in gpus if r.get("smi_unread")], "GPU(s) not read")
    rows = [r for r in gpus if any(r.get(k) is not None for k in GPU_FACT_KEYS)]
    if not rows:
        return unread
    links = [r for r in rows if r.get("pcie_width") and r.get("pcie_speed")]
    full = sum(r["pcie_width"] >= (r.get("pcie_width_max") or 0) and r["pcie_speed"] >= (r.get("pcie_speed_max") or 0)
               for r in links)
    sm = [float(r["sm_mhz"]) for r in rows if r.get("sm_mhz") is not None]
    limits = Counter(n for r in rows for n in throttle_names(r.get("throttle")))
    parts = [f"PCIe at its maximum width and speed on {full}/{len(links)}" if links else "PCIe link not readable",
             f"SM clock min/median {min(sm):.0f}/{_screen_median(sm):.0f} MHz" if sm else "clocks not read",
             "clock limits: " + (", ".join(f"{n} on {k}" for n, k in sorted(limits.items())) or "none"),
             f"uncorrected ECC errors on {sum(bool(r.get('ecc_uncorrected')) for r in rows)}"]
    bad = [(r, p) for r in rows for p in [gpu_fact_problems(r)] if p]
    return [f"  under load ({len(rows)} GPU(s)): " + "; ".join(parts)] + _at_most(
        [f"    rank {r['rank']} {r.get('host')} {r.get('uuid') or '-'}: " + "; ".join(t for _, t in p) for r, p in bad],
        "GPU(s)") + unread


def render_soak(soak):
    """The SOAK section as report lines. soak: {'seconds' (asked), 'cpu', 'dtype', 'n' (matmul size),
    'gpus': judge_soak's rows}. One line per GPU (above 64 only the GPUs with a problem, then a count)."""
    rows, cpu = soak.get("gpus") or [], bool(soak.get("cpu"))
    src = sorted({r.get("telemetry") for r in rows if r.get("telemetry")})
    L = [BAR, "SOAK", BAR,
         f"  {soak.get('seconds', 0):g}s of {soak.get('dtype')} matmul ({soak.get('n')}x{soak.get('n')}) on "
         f"{len(rows)} {'CPU rank(s)' if cpu else 'GPU(s)'} at once; telemetry: "
         + (", ".join(src) if src else "none" + (" (no GPU telemetry on CPU)" if cpu else ""))
         + (f"; decay FAIL below {SOAK_DECAY_FAIL:.2f}, WARN below {SOAK_DECAY_WARN:.2f} of the first window"
            if not cpu else "; CPU ranks share cores: decay shown, not judged")]
    show = [r for r in rows if len(rows) <= 64 or soak_problems(r, cpu)]
    for r in show:
        first, last = r.get("tflops_first"), r.get("tflops_last")
        ratio = f" ({last / first:.2f})" if first and last is not None else ""
        dev = f"cuda:{r['device']}" if r.get("device") is not None else "cpu"
        cells = [f"rank={r['rank']} node={r.get('host')} gpu={dev} uuid={_q(r.get('uuid'))}",
                 f"tflops first/last={_sn(first) if first else '-'}/{_sn(last) if last is not None else '-'}{ratio}"]
        if r.get("samples"):
            cells += [f"temp_max={_soak_n(r.get('temp_max_c'))}C",
                      f"sm_mhz min/max={_soak_n(r.get('sm_min_mhz'))}/{_soak_n(r.get('sm_max_seen_mhz'))} "
                      f"(rated {_soak_n(r.get('sm_rated_mhz'))})",
                      f"power_max={_soak_n(r.get('power_max_w'))}W",
                      "limits=" + (",".join(throttle_names(r.get("throttle_seen"))) or "none")]
        elif not cpu:
            cells.append("telemetry=none")
        L.append("  " + " ".join(cells) + f" [{soak_verdict(r, cpu)}]")
    if len(show) < len(rows):
        L.append(f"  ({len(rows) - len(show)} GPU(s) that held up not shown; see --json)")
    return L


BAR = "=" * 78


def _q(s):
    s = "-" if s is None or s == "" else str(s)
    return f'"{s}"' if re.search(r"\s", s) else s


def _node_of(rs):
    return next((r.get("node") for r in rs if r.get("node")), {}) or {}


def node_signature(rs):
    """What makes two nodes 'identical' for the collapsed topology view."""
    n, g = _node_of(rs), rs[0].get("gpu") or {}
    return json.dumps([len(rs), sorted(r["local_rank"] for r in rs) == list(range(len(rs))),
                       g.get("name"), g.get("vram"), rs[0]["versions"], n.get("os"), n.get("kernel"),
                       n.get("driver"), n.get("cpu_model"), n.get("cpus"),
                       [(p["port"], p["state"], p["rate_gbps"]) for p in n.get("ib") or []],
                       n.get("imports"), n.get("memlock"),
                       sorted(set().union(*[r.get("transport") or [] for r in rs]))], sort_keys=True, default=str)


def _phase_times(phases):
    """'import_torch=3.19 local=3.60 rollcall=0.63 ...' in the order of the run (JSON sorts its keys)."""
    order = ("import_torch",) + PHASES + ("imports", "gpu_measure")
    keys = sorted(phases, key=lambda k: (order.index(k) if k in order else len(order), k))
    return " ".join(f"{k}={phases[k]:.2f}" for k in keys)


def render_report(state):
    """The whole report as text. state: the dict also written as JSON. Identical nodes are grouped
    once (every flagged node alone) and each section renders the groups."""
    recs = state.get("ranks") or []
    flagged = {h for f in state.get("findings") or [] if f["status"] != "PASS" for h in f["hosts"]}
    hosts = _by_host(recs)  # groups: [(hosts, ranks of the first)], identical nodes together, a flagged node alone
    groups = [(hs, hosts[hs[0]]) for hs in group_by(
        hosts, lambda h: ("flagged", h) if h in flagged else node_signature(hosts[h])).values()]
    out = [s for section in (_render_topology, _render_environment, _render_fabric, _render_collectives)
           for s in section(state, recs, groups)]
    out += render_performance(state["screen"]) if state.get("screen") else []
    out += render_soak(state["soak"]) if state.get("soak") else []
    return "\n".join(out + _render_findings(state, recs, groups))


def _render_topology(state, recs, groups):
    L = [BAR, "CLUSTER HARDWARE TOPOLOGY REPORT", BAR,
         f"  nodes={len(_by_host(recs))} ranks_reported={len(recs)}/{state['world_size']} backend={state['backend']}"]
    for hs, rs in groups:
        g = rs[0].get("gpu") or {}
        gpus = f"{len(rs)}x{_q(g.get('name'))}" if g else "cpu"
        tail = f"ranks={format_ranges(r['rank'] for r in rs)}" if len(hs) == 1 else "ranks=various"
        locs = sorted(r["local_rank"] for r in rs)
        locs_s = format_ranges(locs) if len(set(locs)) == len(locs) else ",".join(map(str, locs))
        L.append(f"  node={compress_hostlist(hs)} nodes={len(hs)} ranks_per_node={len(rs)} "
                 f"local_ranks={locs_s} {tail} gpus={gpus}")
    show_all = len(recs) <= 64
    flagged_ranks = {r for f in state.get("findings") or [] if f["status"] != "PASS" for r in f["ranks"]}
    for r in sorted(recs, key=lambda r: r["rank"]):
        if show_all or r["rank"] in flagged_ranks:
            g = r.get("gpu") or {}
            dev = f"cuda:{r['device']}" if r.get("device") is not None else "cpu"
            L.append(f"    rank={r['rank']} node={r['host']} local_rank={r['local_rank']} device={dev} "
                     f"gpu={_q(g.get('name'))} vram={human_bytes(g.get('vram')) if g else '-'} "
                     f"uuid={_q(g.get('uuid'))} pci={_q(g.get('pci'))} numa={_q(g.get('numa'))} "
                     f"cpus={_q(r.get('cpus'))}")
    if not show_all:
        L.append(f"    ({len(recs)} ranks: per-rank lines shown only for ranks named in a finding; see --json)")
    for hs, rs in groups:
        n = _node_of(rs)
        if n.get("peer"):
            L.append(f"  peer access {compress_hostlist(hs)} (row i, col j: 1 = cuda:i can access cuda:j):")
            L.extend(f"    cuda:{i}  {' '.join(row)}" for i, row in enumerate(n["peer"]))
    return L


def _render_environment(state, recs, groups):
    L = [BAR, "NODE ENVIRONMENT DEEP DIVE", BAR]
    for hs, rs in groups:
        n, v = _node_of(rs), rs[0]["versions"]
        iv = {name: _import_state((n.get("imports") or {}).get(name)) for name in PROBED_PACKAGES}
        memlock = n.get("memlock") if n.get("memlock") == "unlimited" else human_bytes(n.get("memlock"))
        L.append(f"  node={compress_hostlist(hs)} os={_q(n.get('os'))} kernel={_q(n.get('kernel'))} "
                 f"cpu={_q(n.get('cpu_model'))} cpus={_q(n.get('cpus'))} mem={human_bytes(n.get('mem_total'))} "
                 f"driver={_q(n.get('driver'))}")
        L.append(f"    torch={v['torch']} cuda={_q(v['cuda'])} nccl={_q(v['nccl'])} python={v['python']} "
                 f"torchvision={iv['torchvision']} torchaudio={iv['torchaudio']} memlock={memlock} "
                 f"shm={human_bytes(n.get('shm'))}")
    return L


def _render_fabric(state, recs, groups):
    L = [BAR, "NETWORK INTERCONNECT & FABRIC STATUS", BAR]
    for hs, rs in groups:
        n = _node_of(rs)
        ibs = ",".join(f"{p['port']}:{p['state']}:{p['rate_gbps'] or 0:g}Gb/s" for p in n.get("ib") or []) or "none"
        ifs = ",".join(f"{k}({v[0] if v else '-'})" for k, v in sorted((n.get("ifaces") or {}).items())) or "-"
        tr = "+".join(sorted(set().union(*[r.get("transport") or [] for r in rs]))) or \
            ("TCP(gloo)" if state.get("backend") == "gloo" else "-")
        used = sorted({f"{r['gloo']['iface']}({r['gloo']['addr']})" for r in rs if r.get("gloo")}
                      | set().union(*[r.get("nccl_net") or [] for r in rs]))
        L.append(f"  node={compress_hostlist(hs)} ib={ibs} peermem={'yes' if n.get('peermem') else 'no'} "
                 f"transport={tr} ifaces={ifs if len(hs) == 1 else 'per-node'} "
                 f"used={(','.join(used) or '-') if len(hs) == 1 else 'per-node'}")
    env = state.get("env") or {}
    shown = " ".join(f"{k}={_q(v)}" for k, v in env.items() if k.startswith(("NCCL_", "GLOO_", "TORCH_NCCL_")))
    L.append("  env as set in the job: " + (shown or "(no NCCL_/GLOO_ variables set)"))
    loaded = sorted({r["versions"].get("nccl") for r in recs if r["versions"].get("nccl")})
    if "NCCL_VERSION" in env and loaded:
        L.append(f"    (NCCL_VERSION is a variable of the image; the NCCL torch loaded is {', '.join(loaded)})")
    return L


def _render_collectives(state, recs, groups):
    coll = state.get("collectives")
    if not coll:
        return []
    L = [BAR, "COLLECTIVES", BAR,
         f"  all_reduce exact: sum={coll['ar_sum']} expected={coll['ar_expected']} on {coll['ranks']} rank(s)",
         f"  DDP nn.Linear(10,10): global average loss={coll['loss']:.6f} "
         f"gradients_identical={'yes' if coll['grads_identical'] else 'NO'}"]
    return L + [f"  busbw size={human_bytes(b['bytes'])} time={b['time_us']:.1f}us algbw={b['algbw']:.2f}GB/s "
                f"busbw={b['busbw']:.2f}GB/s" for b in coll.get("bandwidth") or []]


def _render_findings(state, recs, groups):
    L = [BAR, "FINDINGS", BAR] + [f"  [{st}] {check}: {text}" for st, check, text in
                                   finding_rows(state.get("findings") or [])]
    L += [f"  NOTE: {n}" for n in state.get("notes") or []]
    L += [f"  ACTION: {a}" for a in action_lines(state.get("findings") or [])]
    L += [BAR, f"Ranks Reported: {len(recs)}/{state['world_size']}",
          f"Verdict: {state['verdict']} exit={state['exit_code']} elapsed={state['elapsed_s']:.2f}s "
          f"phases={_phase_times(state.get('phases') or {})}"]
    L += state.get("failures") or []
    L += render_drain(state.get("drain"))
    if state["verdict"] == "PASS":
        L.append(SUCCESS_LINE)
    return L


def action_lines(findings):
    """What to do about each WARN or FAIL that says (its action, and the evidence it stands on), once each:
    '<check> <hosts>: <action> (evidence: ...)'."""
    out = []
    for f in findings:
        if f["status"] == "PASS" or not (f.get("action") or f.get("evidence")):
            continue
        who = f" {compress_hostlist(f['hosts'])}" if f.get("hosts") else \
            f" {compress_hostlist(f['involved'])} (not blamed)" if f.get("involved") else ""
        act = f"nothing is drained: to localise it, {f['unlocalised']['localise']}" if f.get("unlocalised") else \
            f.get("action") or "see the finding"
        out.append(f"{f['check']}{who}: {act}" + (f" (evidence: {f['evidence']})" if f.get("evidence") else ""))
    return list(dict.fromkeys(out))


NO_HOST_MARK = "[no host named]"  # ends every FAILURE line that names no host: grep -v it for the localised ones


def failure_lines(findings):
    """One `FAILURE: <check>: <reason>` line per FAIL; a FAIL that names no host (after the gate) ends with
    NO_HOST_MARK, so that a grep tells an unlocalised line from one that names its culprits."""
    return [f"FAILURE: {f['check']}: {f['reason']}" + ("" if f.get("hosts") else f" {NO_HOST_MARK}")
            for f in findings if f["status"] == "FAIL"]


def render_drain(drain):
    """The report's drain lines (none when the mode is off or nothing needed draining)."""
    if not drain or drain["mode"] == "off" or drain.get("skipped") == "the run passed":
        return []
    if drain.get("skipped"):
        return [f"  DRAIN: nothing drained: {drain['skipped']}"]
    L = [f"  DRAIN: {n} keeps its own reason: {r!r}" for n, r in sorted(drain.get("kept", {}).items())]
    if drain["mode"] == "recommend":
        return L + [f"  DRAIN (recommended; --drain on runs it): {drain['command']}"]
    if drain.get("pending"):
        return L + [f"  DRAIN: draining {compress_hostlist(drain['hosts'])} now (scontrol, within {DRAIN_S:g}s; the "
                    f"outcome follows): {drain['command']}"]
    if drain.get("done"):
        return L + [f"  DRAIN: drained {compress_hostlist(drain['hosts'])}: {drain['command']}"]
    return L + (["  DRAIN: not drained (see the drain finding)"] if drain["hosts"] else [])



# ============================================================================ aiv/out/outputs.py
# Floor 4: what a verdict becomes outside the log: --drain (the scontrol plan and its application) and
DRAIN_SHARE = 0.10          # --drain-max default: 10% of the allocation's nodes, at least 1
DRAIN_REASON_MAX = 120      # characters of a drain reason (Slurm keeps it whole; sinfo -R shows it)
NODE_DRAIN_TAG = "node-check"  # the node gate's reasons: "<DRAIN_PREFIX> node-check: <check>: <what> [<context>]"
# Which findings may drain their hosts is declared by each check (CHECK_RULES in aiv/core/blame.py: the evidence on
# which it drains, and why that evidence persists); a check that declares nothing drains nothing (drainable).


def drain_max(given, nodes):
    """--drain-max, or DRAIN_SHARE of the allocation's nodes (at least 1)."""
    return given if given else max(1, int(DRAIN_SHARE * max(1, nodes)))


def drain_blocker(findings):
    """Why no host may be drained on these findings at all (None: the culprits may be): a PASS, an
    interrupted run, the tool's own error, evidence that failed authentication, a widespread cause."""
    fails = [f for f in findings if f["status"] == "FAIL"]
    if not fails:
        return "the run passed"
    return next((why for test, why in (
        (lambda f: f["check"] == "interrupted", "the run was interrupted (scancel, the time limit, preemption): an "
         "interrupted run drains nobody"),
        (lambda f: f["check"] == "internal", "the tool's own error: it drains nobody"),
        (lambda f: f.get("tamper"), "a value on the side channel failed authentication: evidence that came through "
         "it drains nobody"),
        (lambda f: f.get("widespread"), "the cause is widespread (more nodes implicated than passed: a switch, the "
         "fabric or its configuration): it drains nobody")) if any(test(f) for f in fails)), None)


def drain_reason(fs, job=None, context="job"):
    """The drain reason for the first culprit's findings fs, at most DRAIN_REASON_MAX characters: the preflight's
    '<prefix> <check>: <reason> (job <id>)'; the node gate's (its prolog, epilog and health variants, soperator's
    shape) '<prefix> node-check: <check>: <short words> (+<n> more) [<context>]'."""
    f = fs[0]
    if context == "job":
        head, tail = f"{DRAIN_PREFIX} {f['check']}: {f['reason']}", f" (job {job})"
    else:
        head = f"{DRAIN_PREFIX} {NODE_DRAIN_TAG}: {f['check']}: {f.get('short') or f['reason']}"
        tail = (f" (+{len(fs) - 1} more)" if len(fs) > 1 else "") + f" [{context}]"
    head = " ".join(head.split())
    if len(head) + len(tail) > DRAIN_REASON_MAX:
        head = head[:DRAIN_REASON_MAX - len(tail) - 3].rstrip() + "..."
    return head + tail


def drain_command(hosts, reason):
    """The one scontrol command for hosts, as argv and as the line to paste into a shell."""
    argv = ["scontrol", "update", f"nodename={compress_hostlist(hosts)}", "state=drain", f"reason={reason}"]
    return argv, " ".join(argv[:4] + ["reason=" + shlex.quote(reason)])


def drain_plan(findings, mode, nodes, job, max_nodes=None, context="job"):
    """What --drain does with a verdict (pure), in the preflight (context 'job') and in the node gate (context
    prolog, epilog or health: its one node, no job needed, the command planned under --drain off too, for the
    line that says what Slurm does on exit 1). findings: the verdict's; nodes: the allocation's node count;
    job: SLURM_JOB_ID or None. A finding drains its hosts where drains_in(f, context). -> {'mode', 'hosts':
    the culprits to drain, 'command': the scontrol line or '', 'argv', 'reason', 'max', 'skipped': why nothing
    is drained, or None}."""
    out = {"mode": mode, "hosts": [], "command": "", "argv": [], "reason": "", "max": drain_max(max_nodes, nodes),
           "skipped": None, "done": False, "kept": {}}
    culprits = group_by([(h, f) for f in findings if drains_in(f, context) for h in f["hosts"]], lambda x: x[0],
                        lambda x: x[1])
    why = drain_blocker(findings) or ("no failed check names a host whose fault it is" if not culprits else None)
    if why is None and not job and context == "job":
        why = "not a Slurm job (no SLURM_JOB_ID)"
    if why is None and len(culprits) > out["max"]:
        why = (f"{len(culprits)} culprit node(s), more than the {out['max']} --drain-max allows (of {nodes} "
               "node(s)): a cause that wide is rarely the nodes; nothing is drained")
    if (mode == "off" and context == "job") or why is not None:
        return dict(out, skipped=why if mode != "off" else "--drain off")
    hosts = _screen_sorted(culprits)
    reason = drain_reason(culprits[hosts[0]], job, context)
    argv, line = drain_command(hosts, reason)
    return dict(out, hosts=hosts, command=line, argv=argv, reason=reason)


def owned_reason(reason):
    """Whether a node's drain reason is one the node gate wrote (the only ones it may resume)."""
    return (reason or "").startswith(f"{DRAIN_PREFIX} {NODE_DRAIN_TAG}:")


def resume_plan(node, reason, findings):
    """The node gate's health --undrain after a PASS (pure): a node drained with `reason` is resumed only when the
    reason is the node gate's and the check that drained it was judged and passed in this pass. -> {'argv',
    'command', 'skipped': why it is left drained, or None}."""
    check = re.match(rf"{re.escape(DRAIN_PREFIX)} {NODE_DRAIN_TAG}: ([a-z0-9-]+):", reason or "")
    check = check.group(1) if check else None
    ran = {f["check"] for f in findings if not f.get("unassessed")}
    argv = ["scontrol", "update", f"nodename={node}", "state=resume"]
    why = (f"its reason is not the node check's ({reason!r})" if not owned_reason(reason) else
           f"the check that drained it ({check}) was not judged in this pass" if check not in ran else
           f"the check that drained it ({check}) did not pass"
           if any(f["check"] == check and f["status"] != "PASS" for f in findings) else None)
    return {"argv": argv, "command": " ".join(argv), "skipped": why}


def parse_scontrol_nodes(text):
    """`scontrol show node -o` -> {node: (state, reason)}. The reason is everything after 'Reason=' up to
    the next field of the line (or its end)."""
    return {name.group(1): (state.group(1) if state else "", scontrol_reason(line)) for line in text.splitlines()
            for name, state in [(re.search(r"(?:^|\s)NodeName=(\S+)", line), re.search(r"\sState=(\S+)", line))]
            if name}


def drain_keeps(nodes):
    """Nodes already drained or down for a reason not ours: {node: their reason}. They keep it."""
    return {n: r for n, (st, r) in nodes.items() if re.search(r"DRAIN|DOWN|FAIL", st)
            and r and r not in ("none", "(null)") and not r.startswith(DRAIN_PREFIX)}


def _metrics_value(v):
    """A sample's value as text, or None (omitted) for None, NaN, infinities and anything not a number."""
    if isinstance(v, int):  # a bool too: 1 or 0
        return str(int(v))
    try:
        x = float(v)
    except (TypeError, ValueError):
        return None
    return None if not math.isfinite(x) else str(int(x)) if x.is_integer() and abs(x) < 2 ** 53 else repr(x)


# The exposition format's escapes: backslash and newline in HELP text, and the double quote too in a label value.
_HELP_ESCAPES = str.maketrans({"\\": "\\\\", "\n": "\\n"})
_LABEL_ESCAPES = str.maketrans({"\\": "\\\\", "\n": "\\n", '"': '\\"'})


def _metrics_family(name, text, samples):
    """One gauge family's lines: HELP and TYPE once, then each sample ([(labels dict, value)]) whose value is
    a number, the first of any repeated label set only. Nothing when no sample has a value."""
    lines, seen = [], set()
    for labels, value in samples:
        v, key = _metrics_value(value), tuple(sorted((k, str(x)) for k, x in labels.items()))
        if v is None or key in seen:
            continue
        seen.add(key)
        body = ",".join(f'{k}="{str(x).translate(_LABEL_ESCAPES)}"' for k, x in labels.items())
        lines.append(f"{name}{{{body}}} {v}" if body else f"{name} {v}")
    return [f"# HELP {name} {text.translate(_HELP_ESCAPES)}", f"# TYPE {name} gauge"] + lines if lines else []


def metrics_text(families):
    """[(name, help, samples)] as Prometheus text, a family with no value left out."""
    return "\n".join(line for family in families for line in _metrics_family(*family)) + "\n"


def _metrics_max(values):
    """The largest of the values that are numbers (None, NaN and the like skipped), or None."""
    return max((v for v in values if _metrics_value(v) is not None), default=None)


def _metrics_start(text):
    """started_at (ISO 8601, e.g. 2026-12-02T17:12:11+00:00; naive means UTC) -> Unix seconds, or None."""
    try:
        t = datetime.datetime.fromisoformat(str(text).replace("Z", "+00:00"))
    except ValueError:
        return None
    return (t if t.tzinfo else t.replace(tzinfo=datetime.timezone.utc)).timestamp()


def _metrics_run(state):
    """The run's families: verdict, exit code, duration, start, world size, nodes, failed nodes."""
    verdict = state.get("verdict")
    nodes = len({r.get("host") for r in state["ranks"]}) if state.get("ranks") is not None else None
    failed = state.get("failed_hosts")
    return [
        ("aiv_verdict_pass", "1 when the run's verdict is PASS, 0 when it is FAIL.",
         [({}, None if verdict is None else int(verdict == "PASS"))]),
        ("aiv_exit_code", "The tool's exit code (0 pass, 1 fail, 2 usage, 3 timeout, 4 internal, 5 interrupted).",
         [({}, state.get("exit_code"))]),
        ("aiv_run_duration_seconds", "Seconds the run took, start to verdict.", [({}, state.get("elapsed_s"))]),
        ("aiv_run_start_timestamp_seconds", "When the run started, Unix time in seconds.",
         [({}, _metrics_start(state["started_at"]) if state.get("started_at") else None)]),
        ("aiv_world_size", "Ranks in the run (WORLD_SIZE).", [({}, state.get("world_size"))]),
        ("aiv_nodes", "Distinct nodes among the ranks that reported.", [({}, nodes)]),
        ("aiv_failed_nodes", "Nodes a failed check blames (the JSON's failed_hosts).",
         [({}, None if failed is None else len(failed))]),
    ]


def _metrics_checks(state):
    """aiv_check_status{check}: the worst status of each judged check, in CHECKS order (unknown ones last)."""
    ranks = group_by(state.get("findings") or [], lambda f: f.get("check"), lambda f: STATUS_RANK.get(f.get("status")))
    worst = {c: _metrics_max(v) for c, v in ranks.items()}
    order = [c for c in CHECKS if c in worst] + sorted(str(c) for c in worst if c not in CHECKS)
    return [("aiv_check_status", "Worst status of the check's findings: 0 PASS, 1 WARN, 2 FAIL (checks not judged "
             "are absent).", [({"check": c}, worst[c]) for c in order])]


def _metrics_node_status(state):
    """aiv_node_status{node}: the worst finding naming the node; 0 for a node no finding names. The nodes: every
    one the run knows of (the ranks' hosts, the failed hosts and those findings name), in natural order."""
    findings = state.get("findings") or []
    hosts = ({r.get("host") for r in state.get("ranks") or []} | set(state.get("failed_hosts") or [])
             | {h for f in findings for h in f.get("hosts") or []})
    rows = [({"node": h}, _metrics_max([0] + [STATUS_RANK.get(f.get("status")) for f in findings
                                               if h in (f.get("hosts") or [])]))
            for h in _screen_sorted(h for h in hosts if h is not None)]
    return [("aiv_node_status", "Worst status of the findings that name the node: 0 PASS (or named by none), "
             "1 WARN, 2 FAIL.", rows)]


def _metrics_gpus(state, screen):
    """Per node and GPU (gpu: the local rank): the screen's matmul TFLOPS and memory-copy GB/s."""
    uuids = {r.get("rank"): (r.get("gpu") or {}).get("uuid") for r in state.get("ranks") or []}
    gpus, (levels, _) = screen.get("gpu") or [], gpu_levels(screen)
    labels = [{"node": g.get("host"), "gpu": str(g.get("local_rank")),
               "uuid": g.get("uuid") or uuids.get(g.get("rank")) or ""} for g in gpus]
    tflops, hbm = ([(lb, g.get(m)) for lb, g in zip(labels, gpus, strict=True)] for m in ("tflops", "hbm_gbps"))
    ratio = {m: [(lb, levels[g.get("rank")][m][1]) for lb, g in zip(labels, gpus, strict=True)
                 if m in levels.get(g.get("rank"), {})] for m in ("tflops", "hbm_gbps")}
    return [("aiv_gpu_matmul_tflops", "Performance screen: the GPU's square matmul rate in TFLOPS (10^12 floating "
             "point operations per second; bf16 on GPUs, fp32 on CPU).", tflops),
            ("aiv_gpu_memory_bandwidth_gbps", "Performance screen: the GPU's device-memory copy rate in GB/s "
             "(10^9 bytes per second, read plus write).", hbm),
            ("aiv_gpu_matmul_reference_ratio", "Performance screen: the GPU's matmul rate over the reference that "
             "judged it (its model's peers, else its model's table row).", ratio["tflops"]),
            ("aiv_gpu_memory_reference_ratio", "Performance screen: the GPU's memory rate over the reference that "
             "judged it (its model's peers, else its model's table row).", ratio["hbm_gbps"])]


def _metrics_numerics(state):
    """aiv_numerics_error_ratio{node,gpu,uuid}: per rank, its largest error against the numerics check's fp64
    reference as a fraction of the tolerance, over its checks (ranks[].numerics)."""
    rows = [({"node": r.get("host"), "gpu": str(r.get("local_rank")), "uuid": (r.get("gpu") or {}).get("uuid") or ""},
             max((p["err"] / p["tol"] for p in ((r.get("numerics") or {}).get("checks") or {}).values()
                  if p.get("tol") and p.get("err") is not None), default=None)) for r in state.get("ranks") or []]
    return [("aiv_numerics_error_ratio", "Numerics check: the rank's largest error against the fp64 reference as a "
             "fraction of its tolerance, over its checks (1 or more: off the reference; results whose bits differ "
             "from their peers' show in aiv_check_status for the check numerics).", rows)]


def _metrics_busbw(screen):
    """Per node: its intra-node busbw; per node and rail: the best busbw of the pair rounds the node took part in;
    per rail: the reference."""
    pairs = [m for m in screen.get("pairs") or [] if m.get("nodes") and m.get("rail") is not None]
    seen = group_by([((n, str(m["rail"])), m.get("busbw")) for m in pairs for n in m["nodes"]], lambda x: x[0],
                    lambda x: x[1])
    best = {key: _metrics_max(v) for key, v in seen.items()}
    refs = screen_diagnose(pairs, screen.get("min_busbw_inter"), bool(screen.get("cpu")))["refs"] if pairs else {}
    rails = _screen_sorted(r for _, r in best)
    rows = [({"node": n, "rail": r}, best.get((n, r))) for n in _screen_sorted(n for n, _ in best) for r in rails]
    return [("aiv_intra_node_busbw_gbps", "Performance screen: all_reduce bus bandwidth among the node's own GPUs "
             "in GB/s (10^9 bytes per second).", [({"node": p.get("host")}, p.get("busbw"))
                                                 for p in screen.get("intra") or []]),
            ("aiv_inter_node_busbw_gbps", "Performance screen: the best all_reduce bus bandwidth in GB/s (10^9 "
             "bytes per second) of the inter-node measurements the node took part in on the rail (a node slow "
             "with all its partners has a low best; failed measurements count for nothing).", rows),
            ("aiv_inter_node_busbw_reference_gbps", "Performance screen: the rail's reference bus bandwidth in GB/s "
             "(10^9 bytes per second) that inter-node measurements are judged against.",
             [({"rail": str(r)}, refs[r].get("ref")) for r in sorted(refs, key=lambda r: _screen_key(str(r)))])]


def _metrics_phases(state):
    """aiv_phase_duration_seconds{phase}: seconds per phase, in PHASES order (other timed steps last)."""
    phases = state.get("phases") or {}
    order = [p for p in PHASES if p in phases] + sorted(p for p in phases if p not in PHASES)
    return [("aiv_phase_duration_seconds", "Seconds the run spent in the phase.",
             [({"phase": p}, phases[p]) for p in order])]


def _metrics_drain(state):
    """aiv_drain_nodes: how many nodes the --drain plan named (drained, or recommended), when it ran."""
    drain = state.get("drain")  # not a plan: no sample, so no family written
    nodes = len(drain.get("hosts") or []) if isinstance(drain, dict) else None
    return [("aiv_drain_nodes", "Nodes the --drain plan named: drained with --drain on, else recommended "
             "(0: nothing to drain, or the plan was skipped).", [({}, nodes)])]


def render_metrics(state):
    """The run's state (the JSON's dict) as Prometheus text exposition: gauges named aiv_*, HELP and TYPE once
    per family, labels node, gpu, uuid, rail, check and phase only (never a job id: the file is overwritten
    by each run, so a series stays one series), values that are not numbers left out. Pure."""
    screen = state.get("screen") or {}
    families = (_metrics_run(state) + _metrics_checks(state) + _metrics_node_status(state)
                + _metrics_gpus(state, screen) + _metrics_numerics(state) + _metrics_busbw(screen)
                + _metrics_phases(state) + _metrics_drain(state))
    return metrics_text(families)


def _verdict_head(found, code):
    """What every verdict JSON says: the tool, the verdict, its FAILURE lines, and the hosts the gated findings
    blame (failed_hosts, exclude: blamed_hosts)."""
    failed = blamed_hosts(found)
    return {"schema_version": SCHEMA_VERSION, "tool": "ai-infra-validator", "version": VERSION,
            "verdict": "PASS" if code == EXIT_PASS else "FAIL", "exit_code": code, "failures": failure_lines(found),
            "failed_hosts": failed, "exclude": compress_hostlist(failed) if failed else ""}


def verdict_state(run, found, code, drain):
    """The verdict's state (pure): the JSON, and what the report, the metrics and the page render. run: the
    run's facts as plain data, copied when the verdict began (Coordinator.snapshot); found: the findings after
    the blame gate (blame_gate); drain: the --drain plan."""
    screen = run.get("screen")
    note = screen_degraded_note(screen)
    return {**_verdict_head(found, code), "started_at": run["started_at"], "host": run["host"],
            "world_size": run["world"], "ranks_reported": len(run["records"]), "backend": run["backend"],
            "master": f"{run['addr']}:{run['port']}", "expect": run["expect"], "strict": bool(run["strict"]),
            "deadlines": run["D"], "elapsed_s": round(run["elapsed_s"], 3), "phases": run["times"],
            "findings": mark_accepted(run.get("manifest_data"), found),
            "suspect_links": (screen or {}).get("suspect_links") or [],
            "drain": drain, "drain_command": (drain or {}).get("command") or "",
            "phase_starts": run["starts"], "collectives": run.get("collectives"), "screen": screen,
            "soak": run.get("soak"), "ranks": [rank_record(r) for r in run["records"]], "env": safe_env(run["env"]),
            **({"notes": [note]} if note else {})}


# Why a verdict written where rank 0 left none names nobody, and what would localise it, by its evidence.
RANK0_LOST = {
    "link": ("the connection to rank 0's store broke: rank 0's process, its node and the network between them "
             "cannot be told apart from here",
             "rank 0's node's own state (its kernel log, whether its process died) and a re-run: a rank 0 seen dead "
             "on its own node is named"),
    "stuck": ("rank 0 gave no verdict within its bound and nothing here shows why: frozen, hung, unreachable or "
              "only slow",
              "rank 0's node's own state (its kernel log, its process) and a re-run, or a longer bound on a loaded "
              "node (--timeout)"),
}


def rank0_lost(reason, host0, kind, code=EXIT_TIMEOUT, check="rendezvous"):
    """The finding of a rank (or the batch file) that got no verdict from rank 0 on host0, on evidence `kind`:
    `process` (rank 0's process seen gone on its own node) may name host0; `link` and `stuck` never do (the
    gate turns them into a finding naming nobody, with RANK0_LOST's words); `signal` (the job was cancelled)
    nor any other."""
    f = finding(check, "FAIL", reason, [host0] if host0 else [], code=code, blame=kind or None)
    if kind in RANK0_LOST:
        f["unlocalised"] = {"why": RANK0_LOST[kind][0], "localise": RANK0_LOST[kind][1]}
    return f


def fallback_verdict(found, code, world, written_by, hosts=()):
    """The verdict JSON written where rank 0 left none (pure): by the first rank that lost rank 0
    (Follower.speak_for_rank0) or by the batch file (--fallback: write_fallback). Its findings pass the same
    gate as rank 0's (a lost connection is `link`, a silent rank 0 `stuck`: they name nobody; a rank 0 seen
    dead on its node is `process`), and failed_hosts, exclude and `failures` are read from what it let
    through. hosts: the run's hosts where known."""
    found = blame_gate(found, hosts)
    return {**_verdict_head(found, code), "world_size": world, "findings": found, "drain_command": "",
            "interrupted": code == EXIT_INTERRUPTED, "written_by": written_by}



# ============================================================================ aiv/node/report.py
# Floor 4: what the node gate (--node-check) says: the one summary line (stdout, the node's log), the NPD line
STATUS_WORD = {"FAIL": "FAILURE", "WARN": "WARNING", "PASS": "PASS"}


def _shorts(fs, limit=3):
    words = [f.get("short") or f["reason"] for f in fs[:limit]]
    return "; ".join(words) + (f" (+{len(fs) - limit} more)" if len(fs) > limit else "")


def node_summary(state):
    """The one summary line: '<prefix> <verdict> on <node> [<context>]: what, and what it did (secs of budget)'."""
    v, fs = state["verdict"], state.get("findings") or []
    head = f"{NODE_LINE_PREFIX} {v} on {state['node']} [{state['context']}]"
    took = f" ({state.get('elapsed_s', 0):.1f}s of {state.get('budget_s', 0):g}s)"
    if v == "FAIL":
        culprits = [f for f in fs if f.get("drains")]
        if culprits:
            return f"{head}: {_shorts(culprits)}; {state.get('drain', {}).get('said') or 'exit 1'}{took}"
        fails = [f for f in fs if f["status"] == "FAIL"]
        ev = sorted({f.get("blame") or "-" for f in fails})
        return (f"{head}: {_shorts(fails)}; not drained: the evidence ({', '.join(ev)}) does not single this node "
                f"out; exit {state['exit_code']}{took}")
    if v == "NOT ASSESSED":
        why = [f for f in fs if f.get("unassessed")]
        return f"{head}: {_shorts(why, 2)}; exit {state['exit_code']} (fail open: nothing drained){took}"
    dev = state.get("devices") or {}
    n = len(dev.get("ids") or [])
    judged = dict.fromkeys(f["check"] for f in fs if not f.get("unassessed"))  # a PASS or more, in the order judged
    words = [f"{n} {'CPU worker(s)' if state.get('cpu') else 'GPU(s)'}", "judged: " + ", ".join(judged)]
    if dev.get("busy"):
        words.append(f"busy, not judged: GPU {format_ranges(int(i) for i in dev['busy'])}")
    if state.get("skipped"):
        words.append("skipped: " + "; ".join(state["skipped"]))
    warns = [f for f in fs if f["status"] == "WARN"]
    if warns:
        words.append(f"{len(warns)} WARN: {_shorts(warns, 2)}")
    resumed = (state.get("drain") or {}).get("said")
    return f"{head}: " + "; ".join(words) + (f"; {resumed}" if resumed else "") + took


def node_npd_line(state):
    """One line for Node Problem Detector's condition message, at most NODE_NPD_MAX characters."""
    fs = state.get("findings") or []
    v = state["verdict"]
    pick = ([f for f in fs if f.get("drains")] or [f for f in fs if f["status"] == "FAIL"] if v == "FAIL"
            else [f for f in fs if f.get("unassessed")] if v == "NOT ASSESSED" else [])
    n = len((state.get("devices") or {}).get("ids") or [])
    text = f"{v}: {pick[0].get('short') or pick[0]['reason']}" if pick else \
        f"PASS: {n} {'CPU worker(s)' if state.get('cpu') else 'GPU(s)'} checked"
    text = " ".join(text.split())
    return text if len(text) <= NODE_NPD_MAX else text[:NODE_NPD_MAX - 3] + "..."


def node_lines(state):
    """A line per WARN and FAIL (and a NOTE per check that could not run), worst first, with its evidence."""
    fs = sorted(state.get("findings") or [], key=lambda f: -STATUS_RANK.get(f["status"], 0))
    out = []
    for f in fs:
        if f["status"] == "PASS":
            out.append(f"[PASS] {f['check']}: {f['reason']}")
            continue
        word = "NOTE" if f.get("unassessed") else STATUS_WORD[f["status"]]
        ev, tail = f.get("blame"), ""
        if ev:
            how = "drains" if f.get("drains") else "names no node" if f["status"] == "FAIL" and not f["hosts"] else ""
            tail = f" [blame: {ev}" + (f", {how}" if how else "") + "]"
        out.append(f"{word}: {f['check']}: {f['reason']}{tail}")
    return out


def _node_once(state, ctx, uuid):
    """aiv_node_check_gpu_once_timestamp_seconds{check,gpu,uuid}: the pass's end time for each GPU a WARN or FAIL
    of evidence 'once' flagged (absent otherwise), so that a fleet counts the passes that flagged it again:
    each such pass writes a new value (docs/node-gate.md, monitoring/)."""
    rows = [(dict(ctx, check=f["check"], gpu=str(i), uuid=uuid.get(i, "")), state.get("ended_at_s"))
            for f in state.get("findings") or [] if f.get("blame") == "once" and f["status"] in ("WARN", "FAIL")
            for i in f.get("gpus") or []]
    return ("aiv_node_check_gpu_once_timestamp_seconds", "When the pass that flagged the GPU with evidence 'once' "
            "(slow, not slow again or not measured again: names no node) ended, Unix time in seconds; absent "
            "when this pass did not.", rows)


def node_metrics(state):
    """The node check as Prometheus text for node_exporter's textfile collector: gauges named aiv_node_check_*,
    labels context, check, gpu and uuid only (the node is the file's own: node_exporter adds its instance).
    Written by each pass over the last (per context, when the recipe names a file per context)."""
    ctx = {"context": state["context"]}
    fs = state.get("findings") or []
    worst = {c: max(ranks) for c, ranks in group_by([f for f in fs if not f.get("unassessed")], lambda f: f["check"],
                                                    lambda f: STATUS_RANK.get(f["status"], 0)).items()}
    dev = state.get("devices") or {}
    uuid = {g["index"]: g.get("uuid") or "" for g in state.get("gpus") or []}
    per_gpu = {"tflops": [], "hbm_gbps": [], "numerics": []}
    for i, m in sorted((state.get("measured") or {}).items(), key=lambda kv: int(kv[0])):
        labels = dict(ctx, gpu=str(i), uuid=uuid.get(int(i), ""))
        for k in ("tflops", "hbm_gbps"):  # the best of its measurements
            per_gpu[k].append((labels, max([v for v in ((m.get("speed") or {}).get(k), (m.get("speed2") or {}).get(k))
                                             if v is not None], default=None)))
        checks = ((m.get("numerics") or {}).get("checks") or {}).values()
        ratios = [p["err"] / p["tol"] for p in checks if p.get("tol") and p.get("err") is not None]
        per_gpu["numerics"].append((labels, max(ratios) if ratios else None))
    ar = state.get("allreduce") or {}
    busbw = max([b for b in ar.get("busbw") or [] if b is not None], default=None)
    families = [
        ("aiv_node_check_assessed", "1 when the node check judged the node, 0 when it could not (NOT ASSESSED: the "
         "tool's own fault, nothing drained).", [(ctx, int(state["verdict"] != "NOT ASSESSED"))]),
        ("aiv_node_check_pass", "1 when the node check passed, 0 otherwise.", [(ctx, int(state["verdict"] == "PASS"))]),
        ("aiv_node_check_drainable", "1 when a FAIL's evidence singles this node out (the check drains it, fails "
         "the prolog or raises the NPD condition), 0 otherwise.", [(ctx, int(bool(state.get("drainable"))))]),
        ("aiv_node_check_drained", "1 when this pass wrote its drain reason to Slurm, 0 otherwise.",
         [(ctx, int(bool((state.get("drain") or {}).get("done"))))]),
        ("aiv_node_check_exit_code", "The node check's exit code in its context (prolog, epilog, health: 1 only "
         "for a FAIL that singles the node out; npd: 0 OK, 1 problem, 2 unknown).", [(ctx, state.get("exit_code"))]),
        ("aiv_node_check_duration_seconds", "Seconds the node check took.", [(ctx, state.get("elapsed_s"))]),
        ("aiv_node_check_budget_seconds", "The node check's bound (--node-budget).", [(ctx, state.get("budget_s"))]),
        ("aiv_node_check_end_timestamp_seconds", "When the node check ended, Unix time in seconds.",
         [(ctx, state.get("ended_at_s"))]),
        ("aiv_node_check_gpus", "GPUs the node check covered (CPU workers on a node without GPUs).",
         [(ctx, len(dev.get("ids") or []))]),
        ("aiv_node_check_gpus_busy", "GPUs in use by others: not computed on, not judged for speed.",
         [(ctx, len(dev.get("busy") or {}))]),
        ("aiv_node_check_status", "Worst status of the check's findings: 0 PASS, 1 WARN, 2 FAIL (checks not judged "
         "are absent).", [(dict(ctx, check=c), w) for c, w in worst.items()]),
        ("aiv_node_check_gpu_matmul_tflops", "The GPU's square matmul rate in TFLOPS (bf16 on GPUs, fp32 on CPU), "
         "the best of its measurements.", per_gpu["tflops"]),
        ("aiv_node_check_gpu_memory_bandwidth_gbps", "The GPU's device-memory copy rate in GB/s (read plus write), "
         "the best of its measurements.", per_gpu["hbm_gbps"]),
        ("aiv_node_check_numerics_error_ratio", "The GPU's largest error against the fp64 reference as a fraction "
         "of its tolerance (1 or more: off the reference).", per_gpu["numerics"]),
        ("aiv_node_check_intra_node_busbw_gbps", "all_reduce bus bandwidth across the node's GPUs in GB/s, the best "
         "of two measurements.", [(ctx, busbw)]),
        _node_once(state, ctx, uuid),
    ]
    return metrics_text(families)


def node_not_written(state, flag, path, why):
    """The state once a file asked for was not written (the tool's storage, not the node): an `output` NOTE
    beside the findings, the verdict decided again (NOT ASSESSED; a FAIL on evidence stays a FAIL)."""
    fs = [*state["findings"], unassessed("output", f"{state['node']}: {flag} {path} not written: {why} (the "
                                         "tool's storage, not the node)", f"{flag} not written")]
    v = node_verdict(fs, state["context"]) if state["context"] in NODE_CONTEXTS else \
        {"verdict": "NOT ASSESSED", "drainable": False, "exit_code": 2}
    state = dict(state, findings=fs, verdict=v["verdict"], drainable=v["drainable"], exit_code=v["exit_code"])
    return dict(state, summary=node_summary(state), npd=node_npd_line(state))


def node_usage_state(ctx, node, reason, code, line, ended_at, python):
    """The state of a pass that never ran (a usage error, the tool's own error): NOT ASSESSED, for the files."""
    return {"schema_version": SCHEMA_VERSION, "tool": "ai-infra-validator", "version": VERSION,
            "mode": "node-check", "context": ctx, "node": node, "verdict": "NOT ASSESSED", "drainable": False,
            "exit_code": code, "budget_s": NODE_BUDGET_DEFAULT, "elapsed_s": 0.0, "ended_at_s": ended_at,
            "python": python, "gpus": [], "devices": {"ids": [], "compute": [], "busy": {}, "held": {}},
            "measured": {}, "allreduce": None, "skipped": [], "drain": {"action": "none", "done": False},
            "findings": [unassessed("usage" if reason.startswith("usage") else "internal", f"{node}: {reason}",
                                    reason[:80])], "summary": line, "npd": f"NOT ASSESSED: {reason}"[:NODE_NPD_MAX]}



# ============================================================================ aiv/out/page.py
# Floor 4: --html: one self-contained page per run (inline SVG, no external resources).
# One self-contained page of the run (--html): the verdict, findings, topology, per-GPU bars, per-rail
# heat maps and the phase timeline, as inline SVG drawn here; every text from the state is escaped.
HTML_CSS = """
body{font:14px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;margin:0;background:#f4f6f9;color:#1d2430}
main{max-width:1180px;margin:0 auto;padding:18px 22px 40px}
h2{font-size:17px;margin:26px 0 8px;border-bottom:1px solid #d5dbe3;padding-bottom:4px}
h3{font-size:14px;margin:12px 0 4px}
.card{background:#fff;border:1px solid #dde3ea;border-radius:8px;padding:12px 16px;margin:8px 0}
#verdict{display:flex;gap:22px;align-items:center;color:#fff;border-radius:10px;padding:16px 22px}
#verdict.PASS{background:#1f8a4c}#verdict.FAIL{background:#c23030}
#verdict .big{font-size:44px;font-weight:800;letter-spacing:2px}
#verdict dl{display:grid;grid-template-columns:auto auto auto auto;gap:2px 14px;margin:0}
#verdict dt{opacity:.8}#verdict dd{margin:0;font-weight:600}
pre,code{font:12px/1.4 ui-monospace,SFMono-Regular,Menlo,monospace}
pre{white-space:pre-wrap;word-break:break-word;background:#fbf3f3;border-left:4px solid #c23030;
padding:8px 10px;margin:6px 0}
pre.cmd{background:#f3f5f9;border-left-color:#5465ff}
table{border-collapse:collapse;width:100%}
td,th{text-align:left;vertical-align:top;padding:4px 8px;border-bottom:1px solid #eef1f5}
.st{font-weight:700;border-radius:4px;padding:1px 6px;color:#fff;font-size:12px}
.st.FAIL{background:#c23030}.st.WARN{background:#d18b00}.st.PASS{background:#1f8a4c}
.chip{display:inline-block;background:#fde7e7;color:#8a1414;border-radius:4px;padding:0 6px;
margin:2px 3px 0 0;font:12px ui-monospace,monospace}
.muted{color:#6b7685}.small{font-size:12px}
.nodes{display:grid;grid-template-columns:repeat(auto-fill,minmax(150px,1fr));gap:6px}
.node{background:#fff;border:1px solid #dde3ea;border-radius:6px;padding:4px 7px;font-size:12px}
.node b{font:600 12px ui-monospace,monospace}.node.FAIL{border:2px solid #c23030;background:#fff4f4}
.node.WARN{border:2px solid #d18b00;background:#fffaf0}
.gpus{display:flex;flex-wrap:wrap;gap:2px;margin-top:3px}.g{width:14px;height:14px;border-radius:2px;display:inline-block}
.dots{display:flex;flex-wrap:wrap;gap:2px;margin:6px 0}
.dots i{width:8px;height:8px;border-radius:1px;display:inline-block}
.OK{background:#3aa76d}.WARN.g,.dots .WARN{background:#e3a008}.FAIL.g,.dots .FAIL{background:#d43d3d}
.NA{background:#c5ccd6}
svg text{font:11px system-ui,sans-serif;fill:#4a5563}svg .lab{font:10px ui-monospace,monospace;fill:#1d2430}
.b-OK{fill:#3aa76d}.b-WARN{fill:#e3a008}.b-FAIL{fill:#d43d3d}.b-NA{fill:#c5ccd6}.rng-top{fill:#1d2430}
.chart{overflow-x:auto}.tick{stroke:#e3e8ee}.unit{font-weight:600}
svg .val{font:600 10px ui-monospace,monospace;fill:#1d2430;paint-order:stroke;stroke:#fff;stroke-width:3px}
svg .val.v-FAIL{fill:#a11616}
.jl{stroke-width:1.4}.lead{stroke:#aab3bf;stroke-width:.8}.j-ref,.j-row{stroke:#1d2430}.j-warn{stroke:#d18b00;
stroke-dasharray:5 3}.j-fail{stroke:#d43d3d;stroke-dasharray:5 3}.j-floor{stroke:#a11616;stroke-width:2}
.j-band{stroke:#7a3fd1;stroke-dasharray:2 2;stroke-width:1.8}.j-row{stroke-dasharray:8 3 2 3}
svg text.jlab{font:11px system-ui,sans-serif;stroke:none}svg text.j-warn{fill:#9a6700}svg text.j-fail,
svg text.j-floor{fill:#a11616}svg text.j-band{fill:#5b2ca0}svg text.j-ref,svg text.j-row{fill:#1d2430}
.brk{fill:none;stroke:#1d2430;stroke-width:1.4}svg .brk-t{font-style:italic}
svg .cv{font:9px ui-monospace,monospace;fill:#fff}svg .cv.c-k1,svg .cv.c-k2{fill:#1d2430}
.k0{fill:#1f8a4c;background:#1f8a4c}.k1{fill:#7cc79a;background:#7cc79a}.k2{fill:#e3a008;background:#e3a008}
.k3{fill:#d43d3d;background:#d43d3d}.k4{fill:#5a0d0d;background:#5a0d0d}
.hm{background:#fff;border:1px solid #dde3ea;border-radius:6px;padding:6px}.hm svg{display:block}
.hms{display:flex;flex-wrap:wrap;gap:10px}.culprit{fill:rgba(176,0,32,.07);stroke:#b00020;stroke-width:1.6}
.suspect{fill:none;stroke:#5465ff;stroke-width:1.6;stroke-dasharray:3 2}.grid{fill:#f7f9fb;stroke:#e3e8ee}
.ph{fill:#5b8def}.ph.s{fill:#8e6bd8}.legend i{display:inline-block;width:11px;height:11px;margin:0 3px 0 10px;
vertical-align:-1px;border-radius:2px}
details summary{cursor:pointer;color:#3a4656}
"""


def _html_e(x):
    """HTML-escaped text of any value (None: '')."""
    return html.escape("" if x is None else str(x), quote=True)


def _html_n(x, nd=1):
    """A number as short text ('-' when missing)."""
    return "-" if x is None else f"{float(x):.{nd}f}"


def _html_hosts(hosts, limit=64):
    """Hosts as escaped chips, the first `limit` of them, then a count."""
    hosts = list(hosts or [])
    chips = "".join(f'<span class="chip">{_html_e(h)}</span>' for h in hosts[:limit])
    more = f' <span class="muted">and {len(hosts) - limit} more</span>' if len(hosts) > limit else ""
    return f'<span class="hostl">{chips}{more}</span>' if hosts else '<span class="muted">none</span>'


def _html_section(sid, title, inner):
    """A section of the page: its id, its heading, its content on a card."""
    return f'<section id="{sid}"><h2>{title}</h2><div class="card">{inner}</div></section>'


def _html_verdict(state):
    """The verdict banner: PASS/FAIL, exit code, time, host, world size."""
    v = "PASS" if state.get("verdict") == "PASS" else "FAIL"
    facts = [(k, f"{_html_n(state.get(key))} s" if key == "elapsed_s" else state.get(key)) for k, key in (
        ("exit code", "exit_code"), ("started", "started_at"), ("host", "host"), ("world size", "world_size"),
        ("backend", "backend"), ("elapsed", "elapsed_s"), ("tool", "version"), ("ranks reported", "ranks_reported"))]
    dl = "".join(f"<dt>{_html_e(k)}</dt><dd>{_html_e(x)}</dd>" for k, x in facts if x is not None)
    return f'<section id="verdict" class="{v}"><div class="big">{v}</div><dl>{dl}</dl></section>'


def _html_findings(state):
    """The FAILURE lines, every WARN/FAIL finding with its hosts, the PASS ones folded away."""
    fails = "".join(f"<pre>{_html_e(x)}</pre>" for x in state.get("failures") or [])
    rows, passed = [], []
    for f in state.get("findings") or []:
        st = f.get("status") if f.get("status") in ("PASS", "WARN", "FAIL") else "FAIL"
        row = (f'<tr><td><span class="st {st}">{st}</span></td><td><code>{_html_e(f.get("check"))}</code></td>'
               f'<td>{_html_e(f.get("reason"))}</td><td>{_html_hosts(f.get("hosts"), 16)}</td></tr>')
        (passed if st == "PASS" else rows).append(row)
    head = "<tr><th>status</th><th>check</th><th>reason</th><th>hosts</th></tr>"
    body = f"<table>{head}{''.join(rows)}</table>" if rows else '<p class="muted">no WARN or FAIL finding</p>'
    folded = (f"<details><summary>{len(passed)} passing check(s)</summary><table>{''.join(passed)}</table></details>"
              if passed else "")
    return f'<section id="findings"><h2>Findings</h2>{fails}<div class="card">{body}{folded}</div></section>'


def _html_actions(state):
    """Culprits (failed_hosts), the exclude list, suspect links and the drain command."""
    findings, exclude = state.get("findings") or [], state.get("exclude") or ""
    cmd, drain = state.get("drain_command") or "", state.get("drain") or {}
    lk = "".join(f"<li><code>{_html_e(' - '.join(map(str, s.get('hosts') or [])))}</code> rail {_html_e(s.get('rail'))}"
                 f": {_html_n(s.get('busbw'))} GB/s ({_html_n(s.get('ratio'), 2)} of the rail's reference)</li>"
                 for s in state.get("suspect_links") or [])
    dtext = "drained" if drain.get("done") else f"recommended (--drain {_html_e(drain.get('mode'))})"
    skipped = drain.get("skipped") if drain.get("mode") not in (None, "off") else None
    unl = "".join(f"<li>{_html_e(f['check'])}: {_html_e(f['unlocalised']['why'])}; to localise it: "
                  f"{_html_e(f['unlocalised']['localise'])}"
                  + (f" (involves {_html_e(compress_hostlist(f['involved']))}, none of them blamed)"
                     if f.get("involved") else "") + "</li>"
                  for f in findings if f["status"] == "FAIL" and f.get("unlocalised"))
    todo = "".join(f"<li>{_html_e(a)}</li>" for a in action_lines(findings))
    parts = [f'<p><b>Failed hosts:</b> <span id="culprits">{_html_hosts(state.get("failed_hosts"), 256)}</span></p>',
             "<p><b>Exclude:</b> " + (f'<code id="exclude">{_html_e(exclude)}</code>' if exclude
                                      else '<span class="muted">-</span>') + "</p>",
             unl and f'<p><b>Not localised</b> (these FAILs name no host):</p><ul id="unlocalised">{unl}</ul>',
             lk and f'<p><b>Suspect links</b> (the path, not either node):</p><ul id="suspect-links">{lk}</ul>',
             todo and f'<p><b>What to do</b>:</p><ul id="finding-actions">{todo}</ul>',
             cmd and f'<p><b>Drain</b> ({dtext}):</p><pre class="cmd" id="drain">{_html_e(cmd)}</pre>',
             skipped and f'<p class="muted small">Drain: nothing drained: {_html_e(skipped)}</p>']
    return _html_section("actions", "Culprits and actions", "".join(p for p in parts if p))


def _html_numerics(state, limit=64):
    """The numerics check: per rank its worst error against the fp64 reference as a fraction of the tolerance,
    the ranks a numerics FAIL names first (then the worst, up to `limit`); nothing when no rank carries it."""
    named = {r for f in state.get("findings") or [] if f.get("check") == "numerics" and f.get("status") == "FAIL"
             for r in f.get("ranks") or []}
    rows = []
    for r in state.get("ranks") or []:
        checks = (r.get("numerics") or {}).get("checks") or {}
        ratios = {c: p["err"] / p["tol"] for c, p in checks.items() if p.get("tol") and p.get("err") is not None}
        if checks:
            worst = max(ratios, key=ratios.get) if ratios else None
            rows.append((r.get("rank") not in named, -(ratios.get(worst) or 0), r, worst, ratios.get(worst)))
    if not rows:
        return ""
    rows.sort(key=lambda x: (x[0], x[1], x[2].get("rank", 0)))
    body = "".join(
        f'<tr><td>{_html_e(r.get("rank"))}</td><td><code>{_html_e(r.get("host"))}</code></td>'
        f'<td><code>{_html_e((r.get("gpu") or {}).get("uuid") or "CPU")}</code></td><td>{_html_e(worst)}</td>'
        f'<td>{_html_n(ratio, 3)}</td><td>' + ('<span class="st FAIL">named</span>' if not clean else "") + "</td></tr>"
        for clean, _, r, worst, ratio in rows[:limit])
    more = f'<p class="muted small">and {len(rows) - limit} more rank(s)</p>' if len(rows) > limit else ""
    return _html_section("numerics", "Numerics", '<p class="muted small">Each rank\'s largest error against the fp64 '
                         'reference, as a fraction of the tolerance (1 or more: off the reference); "named": a '
                         'numerics FAIL names the rank (bits unlike its peers\', or off the reference).</p><table>'
                         "<tr><th>rank</th><th>host</th><th>GPU</th><th>worst check</th><th>error / tolerance</th>"
                         f"<th></th></tr>{body}</table>{more}")


def _html_nccl_view(state, limit=64):
    """NCCL's own view beside ours, where a finding carries one (a collective that did not finish on NCCL):
    per rank what we saw and what NCCL's RAS said, differences first; nothing otherwise."""
    views = [f["nccl_view"] for f in state.get("findings") or [] if isinstance(f.get("nccl_view"), dict)]
    if not views:
        return ""
    v, hosts = views[0], {r.get("rank"): r.get("host") for r in state.get("ranks") or []}
    rows = sorted(((int(r), x) for r, x in (v.get("ranks") or {}).items()),
                  key=lambda y: (y[1].get("agree", True), y[0]))
    body = "".join(f'<tr><td>{r}</td><td><code>{_html_e(hosts.get(r))}</code></td><td>{_html_e(x.get("ours"))}</td>'
                   f'<td>{_html_e(x.get("nccl"))}</td><td>{_html_e(x.get("count"))}</td><td>'
                   + ("" if x.get("agree") else '<span class="st WARN">differs</span>') + "</td></tr>"
                   for r, x in rows[:limit])
    head = "<tr><th>rank</th><th>host</th><th>ours</th><th>NCCL's</th><th>collectives (NCCL)</th><th></th></tr>"
    table = f"<table>{head}{body}</table>" if body else ""
    return _html_section("nccl-view", "NCCL's own view", f"<p>{_html_e(v.get('words'))}</p>{table}")


def _html_worst(levels):
    """The worst of 'FAIL', 'WARN', 'OK' (None/empty: 'NA')."""
    levels = set(levels)
    return next((x for x in ("FAIL", "WARN", "OK") if x in levels), "NA")


def _html_gpu_cell(r, gl):
    """One GPU square of a node card, coloured by its worst screen level."""
    g = r.get("gpu") or {}
    lv = gl.get(r.get("rank"), {})
    vals = " ".join(f"{_html_n(lv[m][0])} {u} ({_html_n(lv[m][1], 2)})"
                    for m, u in (("tflops", "TFLOPS"), ("hbm_gbps", "GB/s")) if m in lv)
    tip = (f"rank {r.get('rank')}, local rank {r.get('local_rank')}, {g.get('name') or r.get('model') or 'no GPU'} "
           f"{g.get('uuid') or r.get('uuid') or ''} {vals}")
    return f'<i class="g {_html_worst(x[2] for x in lv.values())}" title="{_html_e(tip)}"></i>'


def _html_node_card(host, recs, flag, gl):
    """A node: name, rank range, its GPUs."""
    ranks = sorted(r.get("rank") for r in recs if r.get("rank") is not None)
    span = f"ranks {ranks[0]}-{ranks[-1]}" if len(ranks) > 1 else (f"rank {ranks[0]}" if ranks else "")
    cells = "".join(_html_gpu_cell(r, gl) for r in recs)
    return (f'<div class="node {flag or ""}" data-host="{_html_e(host)}"><b>{_html_e(host)}</b> '
            f'<span class="muted">{span}</span><div class="gpus">{cells}</div></div>')


def _html_topology(state, gl):
    """Nodes with their ranks and GPUs; beyond 64 nodes a dot per node, and cards for the flagged ones."""
    recs = state.get("ranks") or ((state.get("screen") or {}).get("gpu")) or []  # else the screen's GPU rows
    nodes = group_by(sorted(recs, key=lambda r: (_screen_key(r.get("host")), r.get("local_rank") or 0)),
                     lambda r: r.get("host"))  # {host: [rank record, ...]} in natural order
    if not nodes:
        return ""
    # flagged nodes, {host: 'FAIL'|'WARN'}: the hosts the gated WARN/FAIL findings name (blame_gate), the same as
    # failed_hosts for the FAILs. A suspect link colours no node: it is the path's (the pair view).
    named = [(h, f["status"]) for f in state.get("findings") or [] if f.get("status") in ("WARN", "FAIL")
             for h in f.get("hosts") or []]
    flags = {h: _html_worst(st) for h, st in group_by(named, lambda x: x[0], lambda x: x[1]).items()}
    rpn = sorted({len(v) for v in nodes.values()})
    models = sorted({(r.get("gpu") or {}).get("name") or r.get("model") or "no GPU" for v in nodes.values() for r in v})
    head = (f'<p>{len(nodes)} node(s), {sum(map(len, nodes.values()))} rank(s), {"/".join(map(str, rpn))} per node; '
            f'{_html_e(", ".join(models))}; {len(flags)} flagged</p>')
    if len(nodes) <= 64:
        cards = "".join(_html_node_card(h, v, flags.get(h), gl) for h, v in nodes.items())
        return f'<section id="topology"><h2>Topology</h2>{head}<div class="nodes">{cards}</div></section>'
    dots = "".join(f'<i class="{flags.get(h, "OK")}" title="{_html_e(h)}"></i>' for h in nodes)
    flagged = [h for h in nodes if h in flags][:64]
    cards = "".join(_html_node_card(h, nodes[h], flags[h], gl) for h in flagged)
    more = f'<p class="muted">and {len(flags) - 64} more flagged</p>' if len(flags) > 64 else ""
    return (f'<section id="topology"><h2>Topology</h2>{head}<div class="dots">{dots}</div>'
            f'<h3>Flagged nodes</h3><div class="nodes">{cards or "<span class=muted>none</span>"}</div>{more}'
            '</section>')


GPU_BARS_MAX = 512      # up to this many GPUs of one model a chart has one labelled bar each; beyond, a column
                        # per node (the range of its GPUs) and a labelled bar per GPU below a line
FLAGGED_BARS_MAX = 64   # ... at most this many of those (the lowest first), then a count
BREAK_RATIO = 2.0       # a line this far above every value and every reference is drawn above a broken axis


def _html_step(top, ticks=5):
    """A round tick step (1, 2 or 5 x 10^k, any k) giving about `ticks` ticks from 0 to top."""
    raw = max(top, 1e-12) / ticks
    mag = 10 ** math.floor(math.log10(raw))
    return next(m * mag for m in (1, 2, 5, 10) if m * mag >= raw)


def _html_label_ys(ys, lo, hi, gap=12.0):
    """Label positions for lines at ys: each as near its line as it can be, at least `gap` apart, within [lo, hi]."""
    order = sorted(range(len(ys)), key=lambda i: ys[i])
    out = [0.0] * len(ys)
    prev = lo - gap
    for i in order:
        out[i] = prev = max(ys[i], prev + gap)
    over = prev - hi  # pushed past the bottom: move the whole stack up as far as it needs
    return [y - over for y in out] if over > 0 else out


def _html_scale(vals, lines):
    """The judging lines drawn to scale, those far above every value and every reference (BREAK_RATIO: off the
    axis), and the axis's top."""
    core = max(vals + [ln["value"] for ln in lines if ln["kind"] not in ("floor", "band")] + [1e-12])
    broken = [ln for ln in lines if ln["value"] > BREAK_RATIO * core]
    shown = [ln for ln in lines if ln not in broken]
    return shown, broken, max([core] + [ln["value"] for ln in shown]) * 1.08


def _html_chart_geometry(bars, lines):
    """Where a chart's parts go: the axis's top and step, each bar's slot, the room for labels, the judging
    lines drawn to scale ('shown') and those above a broken axis ('broken')."""
    vals = [float(v) for _, v, _, _ in bars if v is not None]
    shown, broken, top = _html_scale(vals, lines)
    step = _html_step(top)
    top = math.ceil(top / step - 1e-9) * step
    n = max(len(bars), 1)
    slot = max(16.0, 680.0 / n)
    flat = slot >= 64  # room for labels written across
    name_h = 32 if flat else 10 + 6.2 * max([len(b[0]) for b in bars] + [4])
    val_h = 16 if slot >= 44 else 10 + 6.2 * max([len(_s3(v)) for v in vals] + [1])
    left, right, plot_h = 60, 330, 200
    y0 = 8 + (16 * len(broken) + 22 if broken else 0) + val_h  # the broken axis's lines above the values
    w = slot * n
    return {"top": top, "step": step, "slot": slot, "flat": flat, "name_h": name_h, "val_h": val_h, "left": left,
            "plot_h": plot_h, "y0": y0, "w": w, "broken": broken, "shown": shown,
            "width": left + w + right, "height": y0 + plot_h + name_h + 6}


def _html_chart_y(g, v):
    return g["y0"] + g["plot_h"] * (1 - min(max(float(v), 0.0), g["top"]) / g["top"])


def _html_chart_axis(g, unit):
    left, w, top = g["left"], g["w"], g["top"]
    out = [f'<rect class="grid" x="{left}" y="{g["y0"]:.1f}" width="{w:.1f}" height="{g["plot_h"]}"/>']
    t = 0.0
    while t <= top * (1 + 1e-9):
        yt = _html_chart_y(g, t)
        out.append(f'<line class="tick" x1="{left}" x2="{left + w:.1f}" y1="{yt:.1f}" y2="{yt:.1f}"/>'
                   f'<text x="{left - 5}" y="{yt + 4:.1f}" text-anchor="end">{_s3(t) if t else "0"}</text>')
        t += g["step"]
    out.append(f'<text class="unit" x="{left - 5}" y="{g["y0"] - g["val_h"] + 2:.1f}" text-anchor="end">'
               f'{_html_e(unit)}</text>')
    return out


def _html_chart_bar(g, i, name, v, lv, tip):
    """One bar, its value above it and its name below (across when there is room, else upright)."""
    slot, y0, plot_h = g["slot"], g["y0"], g["plot_h"]
    x, bw = g["left"] + i * slot, max(slot - (2 if slot > 6 else 0), 1.0)
    cx, out = x + slot / 2, []
    if v is None:
        out.append(f'<text class="val na" x="{cx:.1f}" y="{y0 + plot_h - 4:.1f}" text-anchor="middle">n/a</text>')
    else:
        yt = _html_chart_y(g, v)
        yb = min(yt, y0 + plot_h - 1)
        out.append(f'<rect class="bar b-{lv}" x="{x + 1:.1f}" y="{yb:.1f}" width="{bw:.1f}" '
                   f'height="{max(y0 + plot_h - yt, 1):.1f}" data-gpu="{_html_e(name)}" '
                   f'data-value="{float(v):.6g}" data-level="{lv}"><title>{_html_e(tip)}</title></rect>')
        vt, vy = _s3(v), yb - 3
        out.append(f'<text class="val v-{lv}" x="{cx:.1f}" y="{vy:.1f}" text-anchor="middle">{vt}</text>'
                   if slot >= 44 else
                   f'<text class="val v-{lv}" transform="translate({cx + 3.5:.1f},{vy:.1f}) rotate(-90)">'
                   f'{vt}</text>')
    ny = y0 + plot_h + 13
    if g["flat"]:
        host, _, rest = name.partition(" ")
        out.append(f'<text class="lab" x="{cx:.1f}" y="{ny:.1f}" text-anchor="middle">{_html_e(host)}</text>'
                   f'<text class="lab" x="{cx:.1f}" y="{ny + 12:.1f}" text-anchor="middle">{_html_e(rest)}</text>')
    else:
        out.append(f'<text class="lab" transform="translate({cx + 3.5:.1f},{y0 + plot_h + 6:.1f}) rotate(-90)" '
                   f'text-anchor="end">{_html_e(name)}</text>')
    return out


def _html_jline(ln, x1, x2, y, tail, label_x, label_y):
    """A judging line from x1 to x2 at height y (tail: the rest of its tag) and its label (coordinates as text)."""
    return (f'<line class="jl j-{ln["kind"]}" x1="{x1}" x2="{x2}" y1="{y}" y2="{y}" data-kind="{ln["kind"]}" '
            f'data-level="{ln["level"] or "ref"}" data-value="{ln["value"]:.6g}"{tail}',
            f'<text class="jlab j-{ln["kind"]}" x="{label_x}" y="{label_y}">{_html_e(ln["text"])}</text>')


def _html_chart_lines(g):
    """The judging lines: those to scale with their labels kept apart, those above the broken axis, the break."""
    left, w, shown, broken, out = g["left"], g["w"], g["shown"], g["broken"], []
    x2, xl = f"{left + w + 6:.1f}", f"{left + w + 14:.1f}"
    lys = _html_label_ys([_html_chart_y(g, ln["value"]) + 4 for ln in shown], g["y0"] + 4,
                         g["y0"] + g["plot_h"] + g["name_h"])
    for ln, ly in zip(shown, lys, strict=True):
        yl = f'{_html_chart_y(g, ln["value"]):.1f}'
        line, label = _html_jline(ln, left, x2, yl, f'><title>{_html_e(ln["text"])}</title></line>', xl, f"{ly:.1f}")
        out.append(f'{line}<line class="lead" x1="{x2}" x2="{left + w + 12:.1f}" y1="{yl}" y2="{ly - 4:.1f}"/>{label}')
    for k, ln in enumerate(broken):
        tail = f' data-broken="1"><title>{_html_e(ln["text"])}</title></line>'
        out.append("".join(_html_jline(ln, left, x2, 12 + 16 * k, tail, xl, 16 + 16 * k)))
    if broken:  # the break: a zigzag across the axis, and words that say so
        zy = 8 + 16 * len(broken) + 2
        out.append(f'<path class="brk" d="M{left - 8},{zy + 4} l4,-4 l4,8 l4,-8 l4,8 l4,-4"/>'
                   f'<text class="brk-t" x="{left + 14}" y="{zy + 8}">axis broken: the line(s) above lie far above '
                   f'every value (not to scale)</text>')
    return out


def _html_chart(cid, bars, lines, unit, caption):
    """One bar chart on an axis from 0 in the values' unit, every bar labelled with what it measures and its value,
    every line it was judged against drawn and named (judging_lines). bars: [(name, value or None, level, tip)];
    a line far above everything else (BREAK_RATIO) is drawn above a broken axis, clearly marked."""
    g = _html_chart_geometry(bars, lines)
    out = _html_chart_axis(g, unit)
    for i, (name, v, lv, tip) in enumerate(bars):
        out += _html_chart_bar(g, i, name, v, lv, tip)
    out += _html_chart_lines(g)
    width, height = g["width"], g["height"]
    return (f'<h3>{caption}</h3><div class="chart"><svg id="{_html_e(cid)}" class="bars" width="{width:.0f}" '
            f'height="{height:.0f}" viewBox="0 0 {width:.0f} {height:.0f}" role="img">{"".join(out)}</svg></div>')


def _html_ranges(cid, groups, lines, unit, caption):
    """At scale, one column per node: the range of its GPUs' values, on the same axis and lines as _html_chart.
    groups: [(host, [value, ...], worst level)]."""
    shown, over, top = _html_scale([v for _, vs, _ in groups for v in vs], lines)
    left, right, h, w = 60, 330, 160, 700.0
    bw, y = w / max(len(groups), 1), functools.partial(_html_chart_y, {"y0": 8, "plot_h": h, "top": top})
    out = [f'<rect class="grid" x="{left}" y="8" width="{w:.0f}" height="{h}"/>']
    step = _html_step(top)
    out += [f'<text x="{left - 5}" y="{y(i * step) + 4:.1f}" text-anchor="end">{_s3(i * step) if i else 0}</text>'
            for i in range(int(top / step) + 1)]
    for i, (host, vs, lv) in enumerate(groups):  # a bar up to the node's lowest GPU, its range above it
        tip = f"{_html_e(host)}: {_s3(min(vs))}-{_s3(max(vs))} {_html_e(unit)} [{lv}]"
        out.append(f'<rect x="{left + i * bw:.2f}" y="{y(min(vs)):.1f}" width="{max(bw, 0.8):.2f}" '
                   f'height="{max(8 + h - y(min(vs)), 1):.1f}" class="rng b-{lv}" data-gpu="{_html_e(host)}" '
                   f'data-value="{min(vs):.6g}" data-level="{lv}"><title>{tip}</title></rect>'
                   f'<rect x="{left + i * bw:.2f}" y="{y(max(vs)):.1f}" width="{max(bw, 0.8):.2f}" '
                   f'height="{max(y(min(vs)) - y(max(vs)), 1):.1f}" class="rng-top"><title>{tip}</title></rect>')
    every = max(1, len(groups) // 16)
    out += [f'<text class="lab" x="{left + (i + 0.5) * bw:.1f}" y="{h + 22}" text-anchor="middle">'
            f'{_html_e(groups[i][0])}</text>' for i in range(0, len(groups), every)]
    lys = _html_label_ys([y(ln["value"]) + 4 for ln in shown], 12, h + 8)
    out += ["".join(_html_jline(ln, left, f"{left + w + 6:.0f}", f'{y(ln["value"]):.1f}', "/>", f"{left + w + 14:.0f}",
                                f"{ly:.1f}")) for ln, ly in zip(shown, lys, strict=True)]
    note = ("; off the axis: " + "; ".join(_html_e(ln["text"]) for ln in over)) if over else ""
    return (f'<h3>{caption}</h3><p class="muted small">one column per node: the range of its GPUs, in node order '
            f'(node names every {every}){note}</p><div class="chart"><svg id="{_html_e(cid)}" class="ranges" '
            f'width="{left + w + right:.0f}" height="{h + 32}" viewBox="0 0 {left + w + right:.0f} {h + 32}" '
            f'role="img">{"".join(out)}</svg></div>')


def _html_gpu_chart(screen, gl, refs, metric, unit, model=None):
    """One model's chart of one metric: a bar per GPU (its node and local rank, its value) against every line
    that judged it (gpu_refs, judging_lines): its model's peers, the table row, the floor, a manifest band."""
    cpu, bands = bool(screen.get("cpu")), screen.get("bands") or []
    rows = sorted((r for r in screen.get("gpu") or [] if model is None or (r.get("model") or "unknown") == model),
                  key=lambda r: (_screen_key(r.get("host")), r.get("local_rank") or 0))
    if not rows:
        return ""
    model = model or rows[0].get("model") or "unknown"
    ref = gpu_refs(rows, {k: screen.get(k) for k in ("min_tflops", "min_hbm")}, cpu)[(model, metric)]
    fail, warn = screen_fractions("gpu", cpu)
    mine = [b for b in bands if b["band"] == f"gpu.{metric}/{model}"]
    lines = judging_lines(ref["peers"], fail, warn, ref["table"], ref["floor"],
                          "min_tflops" if metric == "tflops" else "min_hbm", mine)
    bars = []
    for r in rows:
        v = gl.get(r.get("rank"), {}).get(metric)
        value = v[0] if v else None
        lv = _html_worst([v[2] if v else "NA", band_level(value, r.get("host"), mine)])
        tip = (f"{r.get('host')} rank {r.get('rank')} local rank {r.get('local_rank')} {r.get('uuid') or ''}: "
               + (f"{_s3(value)} {unit} = {v[1]:.3f} of the reference [{lv}]" if v else "not measured"))
        bars.append((f"{r.get('host')} {'rank' if cpu else 'GPU'} {r.get('local_rank')}", value, lv, tip))  # its label
    slow = [b for b in bars if b[2] in ("FAIL", "WARN")]
    caption = (f"{_html_e(unit)} per {'CPU rank' if cpu else 'GPU'} of {_html_e(model)} <span class=\"muted small\">"
               f"({len(bars)} {'rank' if cpu else 'GPU'}(s), "
               f"{len(slow)} below a line{'; CPU ranks: nothing WARNs' if cpu else ''})</span>")
    slug = "".join(c if c.isalnum() else "-" for c in str(model)).strip("-").lower()
    cid = f"gpu-{metric}" + ("" if len(screen.get("gpu_models") or [model]) == 1 else f"-{slug}")
    if len(bars) <= GPU_BARS_MAX:
        return _html_chart(cid, bars, lines, unit, caption)
    groups = group_by([(r.get("host"), b) for b, r in zip(bars, rows, strict=True) if b[1] is not None],
                      lambda x: x[0], lambda x: x[1])
    flagged = sorted(slow, key=lambda b: b[1] if b[1] is not None else -1.0)
    more = (f'<p class="muted small">and {len(flagged) - FLAGGED_BARS_MAX} more GPU(s) below a line (the JSON and '
            'the report list them)</p>' if len(flagged) > FLAGGED_BARS_MAX else "")
    part = (_html_chart(cid + "-flagged", flagged[:FLAGGED_BARS_MAX], lines, unit,
                        f"{_html_e(unit)} of the GPUs below a line, lowest first") + more if flagged
            else '<p class="muted small">no GPU below a line</p>')
    ranges = [(h, [b[1] for b in bs], _html_worst(["OK"] + [b[2] for b in bs])) for h, bs in groups.items()]
    return _html_ranges(cid, ranges, lines, unit, caption) + part


def _html_gpus(screen, gl, refs):
    """The per-GPU TFLOPS and memory GB/s section: per model and metric one chart."""
    if not screen or not screen.get("gpu"):
        return ""
    models = sorted({r.get("model") or "unknown" for r in screen["gpu"]})
    scr = dict(screen, gpu_models=models)
    charts = "".join(_html_gpu_chart(scr, gl, refs, m, u, model) for model in models
                     for m, u in (("tflops", "TFLOPS"), ("hbm_gbps", "GB/s")))
    return _html_section("gpu-perf", "GPU speed", _html_legend(screen) + charts)


def _html_legend(screen):
    """The bars' colours, and what the lines are."""
    return ('<p class="legend small"><i class="OK"></i>OK<i class="WARN g"></i>WARN<i class="FAIL g"></i>FAIL'
            ' &nbsp; each bar is one measurement, labelled with what it measures and its value; each line is one it '
            'was judged against, named on the right: a bar below a red line FAILs, below an amber one WARNs'
            + (" (CPU ranks share cores: only a collapse FAILs, nothing WARNs)" if screen.get("cpu") else "")
            + "</p>")


def _html_intra(screen):
    """The intra-node busbw section: per class of node (ranks per node, GPU model) a bar per node against the
    lines that judged it (its class's peers, --min-busbw-intra, a manifest band)."""
    rows = [p for p in (screen or {}).get("intra") or [] if p.get("host") is not None]
    if not rows:
        return ""
    cpu, bands = bool(screen.get("cpu")), screen.get("bands") or []
    refs, levels = intra_levels(rows, screen.get("min_busbw_intra"), cpu)
    fail, warn = screen_fractions("net", cpu)
    charts = []
    for k, cls in enumerate(sorted(refs, key=str)):
        mine = [p for p in rows if _intra_class(p) == cls]
        band = [b for b in bands if b["band"] == f"intra.busbw/{cls[0] or 0} ranks"]
        lines = judging_lines(refs[cls], fail, warn, None, screen.get("min_busbw_intra"), "min_busbw_intra", band,
                              "nodes")
        bars = [(str(p["host"]), v, lv, f"{p['host']}: intra-node all_reduce busbw "
                 + (f"{_s3(v)} GB/s [{lv}]" if v is not None else "failed"))
                for p in sorted(mine, key=lambda p: _screen_key(p["host"])) for v in [p.get("busbw")]
                for lv in [_html_worst([levels[p["host"]][0], band_level(v, p["host"], band)])]]
        alone = "" if refs[cls].get("count", 0) >= 2 else "; one node: no peers to judge it against"
        charts.append(_html_chart(f"intra-{k}", bars, lines, "GB/s",
                                  f"intra-node busbw of {_html_e(_intra_class_text(cls))} <span class=\"muted small\">"
                                  f"({len(bars)} node(s){alone})</span>"))
    return _html_section("intra", "Intra-node busbw", _html_legend(screen) + "".join(charts))


CELL_NUMBERS_MIN = 26.0  # a heat-map cell at least this many pixels wide shows its busbw in figures
SLOW_ROWS_MAX = 64       # the table of slow inter-node measurements lists at most this many, lowest first


def _html_rail_marks(pairs, idx, rail, d, c, bad):
    """Measured cells of one rail (upper triangle: row = the first node in natural order), culprit
    crosses and suspect-link boxes."""
    mw, cells, slow, boxes = (c - 1 if c > 6 else 3.0), [], [], []
    ref = d["refs"][rail]["ref"] or 1.0
    lone = set(d["suspect_links"])
    for k, m in enumerate(pairs):
        if m["rail"] != rail:
            continue
        bw = m.get("busbw")
        ratio = None if bw is None else float(bw) / ref
        # the colour: k0/k1 OK (near/below the reference), k2 WARN, k3 FAIL, k4 not measured
        cls = "k4" if ratio is None else {"FAIL": "k3", "WARN": "k2"}.get(d["levels"][k])
        cls = cls or ("k0" if ratio >= 0.97 else "k1")
        tip = f"{' - '.join(m['nodes'])} rail {rail} round {m.get('round')}: {_html_n(bw)} GB/s"
        tip += " (failed)" if ratio is None else f" ({ratio:.2f})"
        ns, w = sorted(idx[n] for n in m["nodes"]), mw if cls in ("k0", "k1") else max(mw, 6.0)
        for a, b in itertools.combinations(ns, 2):
            x, y = 90 + (b + 0.5) * c - w / 2, 90 + (a + 0.5) * c - w / 2
            (cells if w == mw else slow).append(f'<rect x="{x:.1f}" y="{y:.1f}" width="{w:.1f}" height="{w:.1f}" '
                                                f'class="{cls}"><title>{_html_e(tip)}</title></rect>')
            if c >= CELL_NUMBERS_MIN:  # the value itself, where the cell holds it
                cells.append(f'<text class="cv c-{cls}" x="{x + w / 2:.1f}" y="{y + w / 2 + 3:.1f}" '
                             f'text-anchor="middle">{"failed" if bw is None else _s3(bw)}</text>')
            if k in lone:
                boxes.append(f'<rect x="{x - 2:.1f}" y="{y - 2:.1f}" width="{w + 4:.1f}" height="{w + 4:.1f}" '
                             f'class="suspect"><title>suspect link: {_html_e(tip)}</title></rect>')
    t, size = max(c, 3.0), len(idx) * c  # a culprit node's row and column outlined
    crosses = "".join(f'<g class="culprit" data-host="{_html_e(n)}"><title>culprit: {_html_e(n)}</title>'
                      f'<rect class="culprit" x="90" y="{p - t / 2:.1f}" width="{size:.1f}" height="{t:.1f}"/>'
                      f'<rect class="culprit" x="{p - t / 2:.1f}" y="90" width="{t:.1f}" height="{size:.1f}"/></g>'
                      for n in bad for p in [90 + (idx[n] + 0.5) * c])
    return crosses + "".join(cells) + "".join(slow) + "".join(boxes)


def _html_heatmap(pairs, rail, d, failed, size):
    """One rail's node-by-node busbw heat map (an SVG, id heatmap-rail-<rail>)."""
    nodes, ref = d["nodes"], d["refs"][rail]
    idx, c = {n: i for i, n in enumerate(nodes)}, size / max(len(nodes), 1)
    slow = [m for k, m in enumerate(pairs) if m["rail"] == rail and d["levels"][k] != "OK"]
    in_slow = {n for m in slow for n in m["nodes"]}  # outlined: the judge's culprits, failed hosts in a slow pair
    bad = _screen_sorted({n for n, r in d["culprits"] if r == rail} | (in_slow & set(failed)))
    hcas = {n: h for m in pairs if m["rail"] == rail for n in m["nodes"] for h in [_screen_hca(m, n)] if h}
    hca = ", ".join(sorted(set(hcas.values()), key=_screen_key)) or None
    cap = (f"rail {_html_e(rail)}{' (' + _html_e(hca) + ')' if hca else ''}: reference {_html_n(ref['ref'])} GB/s "
           f"({_html_e(ref['how'])} of {ref['count']}), {len(slow)} slow"
           + (f", culprit {_html_e(compress_hostlist(bad))}" if bad else ""))
    step = max(1, len(nodes) // 8) if len(nodes) > 24 else 1  # node names along the top and left: every k-th
    axis = "".join(f'<text class="lab" x="86" y="{p + 3:.1f}" text-anchor="end">{_html_e(nodes[i])}</text>'
                   f'<text class="lab" transform="translate({p + 3:.1f},86) rotate(-60)">{_html_e(nodes[i])}</text>'
                   for i in range(0, len(nodes), step) for p in [90 + (i + 0.5) * c])
    svg = (f'<svg id="heatmap-rail-{_html_e(rail)}" width="{size + 100:.0f}" height="{size + 100:.0f}" '
           f'viewBox="0 0 {size + 100:.0f} {size + 100:.0f}" role="img"><title>{cap}</title>'
           f'<rect class="grid" x="90" y="90" width="{size:.1f}" height="{size:.1f}"/>{axis}'
           f'{_html_rail_marks(pairs, idx, rail, d, c, bad)}</svg>')
    return f'<div class="hm"><div class="small">{cap}</div>{svg}</div>'


def _html_pairs(screen, failed):
    """The inter-node section: one heat map per rail, coloured by the ratio to that rail's reference."""
    pairs = [m for m in (screen or {}).get("pairs") or [] if m.get("nodes") and m.get("rail") is not None]
    if not pairs:
        return ""
    d = screen_diagnose(pairs, screen.get("min_busbw_inter"), bool(screen.get("cpu")))
    n = len(d["nodes"])
    size = max(120.0, min(420.0, 28.0 * n)) if len(d["rails"]) > 1 else max(160.0, min(720.0, 28.0 * n))
    maps = "".join(_html_heatmap(pairs, rail, d, failed, size) for rail in d["rails"])
    cpu, floor = bool(screen.get("cpu")), screen.get("min_busbw_inter")
    fail, warn = screen_fractions("net", cpu)
    rule = (f"FAIL below {fail:.2f} of the rail's reference; CPU ranks: nothing WARNs" if cpu else
            f"WARN below {warn:.2f} of the rail's reference (and 6 spreads below it), FAIL below {fail:.2f}")
    rule += f"; FAIL below --min-busbw-inter {floor:g} GB/s" if floor is not None else ""
    legend = ('<p class="legend small"><i class="k0"></i>OK, at 0.97 of the reference or more<i class="k1"></i>OK'
              '<i class="k2"></i>WARN<i class="k3"></i>FAIL<i class="k4"></i>failed'
              '<i style="border:2px solid #b00020"></i>culprit row/column<i style="border:2px dashed #5465ff"></i>'
              f'suspect link</p><p class="small">Cells: the measured pairs only, each with its busbw in GB/s where the '
              f'cell holds it; {rule}.</p>')
    return _html_section("pairs", "Inter-node busbw per rail",
                         f'{legend}<div class="hms">{maps}</div>{_html_slow_pairs(pairs, d, floor)}')


def _html_slow_pairs(pairs, d, floor):
    """The inter-node measurements below a line, lowest ratio first: nodes, rail, busbw, the rail's reference,
    the ratio, the level (what a heat map too dense for figures cannot show)."""
    slow = sorted((k for k, lv in enumerate(d["levels"]) if lv != "OK"),
                  key=lambda k: (float(pairs[k].get("busbw") or 0.0) / (d["refs"][pairs[k]["rail"]]["ref"] or 1.0)))
    if not slow:
        return '<p class="muted small">no inter-node measurement below a line</p>'
    rows = []
    for k in slow[:SLOW_ROWS_MAX]:
        m, ref, bw = pairs[k], d["refs"][pairs[k]["rail"]], pairs[k].get("busbw")
        below = floor is not None and float(bw or 0.0) < floor
        rows.append(f'<tr><td><span class="st {d["levels"][k]}">{d["levels"][k]}</span></td>'
                    f'<td><code>{_html_e(" - ".join(map(str, m["nodes"])))}</code></td><td>{_html_e(m["rail"])}</td>'
                    f'<td>{"failed" if bw is None else _s3(bw)}</td><td>{_s3(ref["ref"] or 0)} '
                    f'({_html_e(ref["how"])})</td><td>{float(bw or 0.0) / (ref["ref"] or 1.0):.2f}'
                    + (f" (below --min-busbw-inter {floor:g})" if below else "") + "</td></tr>")
    more = (f'<p class="muted small">and {len(slow) - SLOW_ROWS_MAX} more</p>' if len(slow) > SLOW_ROWS_MAX else "")
    return ('<h3>Inter-node measurements below a line</h3><table id="slow-pairs"><tr><th>level</th><th>nodes</th>'
            '<th>rail</th><th>busbw GB/s</th><th>the rail\'s reference GB/s</th><th>ratio</th></tr>'
            f'{"".join(rows)}</table>{more}')


def _html_timeline(state):
    """Horizontal bars, one per phase, on a seconds axis: at phase_starts when given (then only the phases of
    PHASES: the other timings, import_torch or a screen round's group creation, lie inside one of them), else
    the phases end to end in PHASES order."""
    phases, starts = state.get("phases") or {}, state.get("phase_starts") or {}
    spans, t = [], 0.0  # (phase, start, seconds)
    for p in [p for p in PHASES if p in phases] + ([] if starts else [p for p in phases if p not in PHASES]):
        d = float(phases.get(p) or 0.0)
        s = float(starts[p]) if p in starts and starts[p] is not None else t
        spans.append((p, s, d))
        t = max(t, s + d)
    if not spans:
        return ""
    end = max([s + d for _, s, d in spans] + [float(state.get("elapsed_s") or 0.0), 0.001])
    w, rh = 900.0, 18
    rows = [f'<text x="126" y="{y + 12}" text-anchor="end">{_html_e(p)}</text>'
            f'<rect x="{130 + w * s / end:.1f}" y="{y + 2}" width="{max(w * d / end, 1):.1f}" height="13" '
            f'class="ph{" s" if p.startswith("screen") else ""}"><title>{_html_e(p)}: {s:.3f} s + {d:.3f} s</title>'
            f'</rect><text x="{134 + w * (s + d) / end:.1f}" y="{y + 12}">{d:.2f} s</text>'
            for i, (p, s, d) in enumerate(spans) for y in [8 + i * rh]]
    h = 8 + len(spans) * rh
    step = _html_step(end, 6)
    ticks = "".join(f'<line x1="{130 + w * t / end:.1f}" x2="{130 + w * t / end:.1f}" y1="4" y2="{h}" '
                    f'stroke="#e3e8ee"/><text x="{130 + w * t / end:.1f}" y="{h + 14}" text-anchor="middle">{t:g} s'
                    '</text>' for t in (round(i * step, 6) for i in range(int(end / step) + 1)))
    return _html_section("timeline", "Phase timeline", f'<svg width="100%" viewBox="0 0 {w + 200:.0f} {h + 20}" '
                         f'role="img">{ticks}{"".join(rows)}</svg>')


def render_html(state):
    """One run's verdict as a self-contained HTML page (inline CSS and SVG, no script, nothing fetched),
    a pure function of the run's JSON state: verdict, findings, culprits and actions, topology,
    per-GPU speed against the model references, per-rail inter-node busbw heat maps, phase timeline."""
    screen = state.get("screen") or {}
    gl, refs = gpu_levels(screen)
    title = f"{state.get('verdict') or 'FAIL'} - ai-infra-validator - {state.get('host') or ''}"
    body = (_html_verdict(state) + _html_findings(state) + _html_actions(state) + _html_topology(state, gl)
            + _html_gpus(screen, gl, refs) + _html_intra(screen) + _html_numerics(state) + _html_nccl_view(state)
            + _html_pairs(screen, state.get("failed_hosts") or []) + _html_timeline(state))
    return (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>{_html_e(title)}</title>'
            f'<meta name="viewport" content="width=device-width,initial-scale=1"><style>{HTML_CSS}</style></head>'
            f'<body><main>{body}<p class="muted small">ai-infra-validator {_html_e(state.get("version"))}, schema '
            f'{_html_e(state.get("schema_version"))}</p></main></body></html>\n')



# ============================================================================ aiv/out/verify_log.py
# Floor 4: --verify-log: a whole log judged again, with no torch and no cluster.
# A saved log passes only when it shows one clean PASS from start to end: the success line, no
# FAILURE line, a "Verdict: PASS exit=0" line, all ranks reported, an exact all_reduce, identical
# DDP gradients, no [FAIL] finding (no [WARN] either under --strict), and counts that agree with
# each other. Progress lines ("[  1.23s] phase: ...") are never read: they are not a stable format.
LOG_SECTIONS = ("CLUSTER HARDWARE TOPOLOGY REPORT", "NODE ENVIRONMENT DEEP DIVE",
                "NETWORK INTERCONNECT & FABRIC STATUS", "COLLECTIVES", "PERFORMANCE", "FINDINGS")
_LOG_FAILURE = re.compile(r"(?:\[[^\]]*\]\s*)?FAILURE:")   # also "[host:rank] FAILURE: ..."
_LOG_FINDING = re.compile(r"\[(PASS|WARN|FAIL)\]\s+\S+?:")
_LOG_SUM = re.compile(r"all_reduce exact:\s*sum=(\S+)\s+expected=(\S+)\s+on\s+(\S+)\s+rank")
_LOG_GRADS = re.compile(r"DDP\b.*\bgradients_identical=(\S*)")


def _log_int(text):
    """A plain non-negative decimal number, else None."""
    return int(text) if re.fullmatch(r"[0-9]+", text) else None


def _log_after(lines, prefix):
    """The rest of every line that starts with prefix, stripped."""
    return [s[len(prefix):].strip() for s in lines if s.startswith(prefix)]


def _verify_totals(lines, problems, facts):
    read = [(s, _log_int(m.group(1))) for s in lines for m in [re.search(r"Total Execution Ranks:\s*(\S+)", s)] if m]
    problems += [f"garbled 'Total Execution Ranks' line: {s[:80]}" for s, n in read if n is None]
    totals = [n for _, n in read if n is not None]
    if not totals:
        problems.append("no 'Total Execution Ranks: N' line")
    elif len(set(totals)) > 1:
        problems.append(f"'Total Execution Ranks' lines disagree: {sorted(set(totals))}")
    else:
        facts["world_size"] = totals[0]


def _verify_verdict(lines, problems, facts):
    """The success marker, no FAILURE line, and exactly one verdict: PASS with exit code 0 (several identical
    lines are fine)."""
    if SUCCESS_LINE not in lines:
        problems.append("success marker missing")
    problems += [f"failure reported: {s[:200]}" for s in lines if _LOG_FAILURE.match(s)]
    heads = list(dict.fromkeys(" ".join(v.split()[:2]) for v in _log_after(lines, "Verdict:")))  # each once
    if not heads:
        problems.append("no 'Verdict:' line")
        return
    if len(heads) > 1:
        problems.append(f"'Verdict:' lines disagree: {' | '.join(heads)}")
    problems += [f"verdict is 'Verdict: {h}', not 'Verdict: PASS exit=0'" for h in heads if h != "PASS exit=0"]
    facts["verdict"] = heads[0]


def _verify_ranks_reported(lines, world, problems):
    values = list(dict.fromkeys(_log_after(lines, "Ranks Reported:")))
    if not values:
        problems.append("no 'Ranks Reported: k/N' line")
    elif len(values) > 1:
        problems.append(f"'Ranks Reported' lines disagree: {' | '.join(values)}")
    for v in values:
        k, n = map(_log_int, v.partition("/")[::2])
        if k is None or n is None:
            problems.append(f"garbled 'Ranks Reported' line: {v[:80]}")
            continue
        if k != n:
            problems.append(f"Ranks Reported: {v}: {k} of {n} rank(s) reported")
        if world is not None and n != world:
            problems.append(f"Ranks Reported: {v} is out of {n} rank(s) but Total Execution Ranks is {world}")


def _sum_matches(text, want):
    """sum= is printed with :g (1.00324e+06 for large worlds); expected= is an exact integer."""
    with contextlib.suppress(OverflowError):
        if text == format(want, "g"):
            return True
    try:
        return float(text) == want
    except ValueError:
        return False


def _verify_collectives(lines, world, problems):
    sums = [m for m in map(_LOG_SUM.match, lines) if m]
    if not sums:
        problems.append("no 'all_reduce exact: sum=S expected=E' line (COLLECTIVES)")
    for m in sums:
        s_txt, e_txt, r_txt = m.groups()
        e, r = _log_int(e_txt), _log_int(r_txt)
        if e is None or r is None:
            problems.append(f"garbled all_reduce line: {m.group(0)[:100]}")
            continue
        if not _sum_matches(s_txt, e):
            problems.append(f"all_reduce sum={s_txt} but expected={e}")
        if world is not None and e != world * (world + 1) // 2:
            problems.append(f"all_reduce expected={e} but {world} ranks sum to {world * (world + 1) // 2}")
        if world is not None and r != world:
            problems.append(f"all_reduce ran on {r} rank(s) but Total Execution Ranks is {world}")
    grads = list(dict.fromkeys(m.group(1) for m in map(_LOG_GRADS.match, lines) if m))
    if not grads:
        problems.append("no 'gradients_identical=' line (COLLECTIVES)")
    problems += [f"DDP gradients_identical={g or '(empty)'}, not yes" for g in grads if g != "yes"]


def _verify_findings(lines, strict, problems, facts):
    if lines is None:
        problems.append("no FINDINGS section")
        return
    found = [(m.group(1), s) for s in lines for m in [_LOG_FINDING.match(s)] if m]
    problems += [f"finding: {s[:200]}" if st == "FAIL" else f"finding (a FAIL under --strict): {s[:200]}"
                 for st, s in found if st == "FAIL" or st == "WARN" and strict]
    facts["findings"] = {st: sum(x == st for x, _ in found) for st in ("PASS", "WARN", "FAIL")}


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
    for s in lines:
        if s.startswith("nodes=") and (m := re.search(r"\bbackend=(\w+)", s)):
            facts["backend"] = m.group(1)
    shapes = [nk for s in lines if s.startswith("node=") for nk in [_topology_line(s, problems)] if nk]
    nodes, ranks, rpn_seen = sum(n for n, _ in shapes), sum(n * k for n, k in shapes), {k for _, k in shapes}
    if nodes == 0:
        problems.append("no node lines in the CLUSTER HARDWARE TOPOLOGY REPORT section")
        return rpn_seen
    facts.update(nodes=nodes, ranks_in_topology=ranks)
    if "world_size" in facts and ranks != facts["world_size"]:
        problems.append(f"topology accounts for {ranks} ranks but Total Execution Ranks is {facts['world_size']}")
    return rpn_seen


def _verify_versions(lines, problems, facts):
    found = {key: val for s in lines for key, val in re.findall(r"\b(torch|cuda|nccl)=(\S+)", s) if val != "-"}
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


_LOG_KEEP = re.compile(r"Total Execution Ranks:|Verdict:|Ranks Reported:|node=|nodes=|\b(?:torch|cuda|nccl)=")
# every _LOG_KEEP match holds one of these: a substring test first (memchr-fast) spares the regex's scan of
# a long line that holds none of them (a megabyte of binary noise: 77 ms by the regex, 0.1 ms by these)
_LOG_KEEP_WORDS = ("Total Execution Ranks:", "Verdict:", "Ranks Reported:", "node=", "nodes=", "torch=", "cuda=",
                   "nccl=")


def _log_relevant(s):
    """Whether a stripped log line can matter to any check below (the others are dropped while reading)."""
    return (s in LOG_SECTIONS or s == SUCCESS_LINE or bool(_LOG_FAILURE.match(s) or _LOG_FINDING.match(s)
            or _LOG_SUM.match(s) or _LOG_GRADS.match(s)
            or any(w in s for w in _LOG_KEEP_WORDS) and _LOG_KEEP.search(s)))


LOG_CHUNK = 1 << 20  # a line longer than this is read in pieces, each judged as a line of its own


def read_log_lines(f):
    """The relevant stripped lines of a binary log file, read to its end one line (or LOG_CHUNK) at a
    time: memory holds the lines that matter, never the file."""
    return [s for raw in iter(lambda: f.readline(LOG_CHUNK), b"")
            for s in (x.strip() for x in raw.decode("utf-8", errors="replace").splitlines()) if _log_relevant(s)]


def verify_log(text, expect, strict=False):
    """Automation's check of a saved log (its text, or read_log_lines' list). Returns (ok, problems, facts); ok
    only for a clean PASS. strict: a [WARN] finding is a problem too (as --strict makes it a FAIL in a run)."""
    problems, facts = [], {"backend": None}
    lines = [ln.strip() for ln in text.splitlines()] if isinstance(text, str) else list(text)
    sections, section = {"": []}, ""  # {section title: its lines}; lines before the first section are under ''
    for s in lines:
        if s in LOG_SECTIONS:
            section = s
            sections.setdefault(s, [])
        else:
            sections[section].append(s)
    _verify_totals(lines, problems, facts)
    _verify_verdict(lines, problems, facts)
    _verify_ranks_reported(lines, facts.get("world_size"), problems)
    _verify_collectives(lines, facts.get("world_size"), problems)
    _verify_findings(sections.get("FINDINGS"), strict, problems, facts)
    rpn_seen = _verify_topology(sections.get("CLUSTER HARDWARE TOPOLOGY REPORT", []), problems, facts)
    _verify_versions(sections.get("NODE ENVIRONMENT DEEP DIVE", []), problems, facts)
    _verify_expect(expect, facts, rpn_seen, problems)
    return not problems, problems, facts



# ============================================================================ aiv/checks/manifest_io.py
# Floor 4 (effects): the known-good manifest on disk: --manifest read and checked before torch, --save-manifest
def load_manifest(path, origin):
    """The manifest at path, or UsageError naming origin (the option) and the problem in one line."""
    try:
        with open(path, "rb") as f:
            text = f.read(64 << 20).decode("utf-8", errors="replace")
    except OSError as e:
        raise UsageError(f"{origin} {path}: cannot read it: {e.strerror or e}") from None
    try:
        data = json.loads(text)
    except ValueError as e:
        raise UsageError(f"{origin} {path}: not a manifest (not JSON: {e})") from None
    if problem := manifest_problem(data):
        raise UsageError(f"{origin} {path}: {problem}")
    return data


def manifest_preflight(args):
    """Rank 0 and the local launcher, before torch is imported: --manifest must be a readable manifest of a
    schema this tool reads (kept in args.manifest_data for the judge); --save-manifest's directory must
    exist and be writable, and a file already there must be a manifest to merge into. UsageError: exit 2."""
    if args.manifest:
        args.manifest_data = load_manifest(args.manifest, "--manifest")
    path = args.save_manifest
    if not path:
        return
    d = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise UsageError(f"--save-manifest {path} is a directory; name the file to write")
    if not os.path.isdir(d):
        raise UsageError(f"--save-manifest {path}: directory {d} does not exist")
    if not os.access(d, os.W_OK | os.X_OK):
        raise UsageError(f"--save-manifest {path}: directory {d} is not writable by uid {os.getuid()}")
    if os.path.exists(path):
        load_manifest(path, "--save-manifest")


def save_manifest(path, state, written_at):
    """Merge this run's accepted state into the manifest at path (atomically, under _file_lock's bounded lock:
    state's deadlines['manifest-lock'], else MANIFEST_LOCK_S). -> the report's note. A PASS saves, its WARNs
    recorded as accepted; a FAIL never saves. A save that cannot take the lock in time or cannot write also
    adds a WARN finding to state['findings'] naming the file (no host: the nodes are not at fault)."""
    if why := manifest_refusal(state):
        return f"manifest not saved to {path}: {why}; a manifest is saved only from a PASS"
    try:
        with _file_lock(path, (state.get("deadlines") or {}).get("manifest-lock")):
            old = load_manifest(path, "--save-manifest") if os.path.exists(path) else None
            new = manifest_from_records(state.get("ranks") or [], written_at, state.get("screen"),
                                        state.get("findings") or [])
            write_json_atomic(path, merge_manifests(old, new))
    except (OSError, UsageError, LockTimeout) as e:
        note = f"manifest not saved to {path}: {e}"
        state.setdefault("findings", []).append(finding("manifest", "WARN", note))
        return note
    hosts = sum(len(_hosts_in(c["hosts"])) for c in new["classes"].values())
    warns = new["accepted_warns"]
    return (f"manifest saved to {path}: {hosts} node(s) accepted in {len(new['classes'])} class(es) "
            f"({'; '.join(new['classes'])})" + (", merged into the existing file" if old else "")
            + (f"; {len(warns)} WARN(s) accepted ({', '.join(sorted({w['check'] for w in warns}))})" if warns else ""))


def note_manifest_save(args, state):
    """Rank 0 at the verdict, with --save-manifest: save on a PASS (WARNs accepted); either way a note in the
    report, and a WARN finding when the file could not be locked or written (save_manifest)."""
    if getattr(args, "save_manifest", None):
        now = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
        state.setdefault("notes", []).append(save_manifest(args.save_manifest, state, now))


def run_diff_manifest(paths):
    """--diff-manifest A B (no torch): one line per difference; 0 equal, 1 different, 2 a file unusable."""
    try:
        a, b = (load_manifest(p, "--diff-manifest") for p in paths)
    except UsageError as e:
        emit(f"FAILURE: usage: {e}")
        return EXIT_USAGE
    lines = diff_manifests(a, b)
    for ln in lines:
        emit(ln)
    emit(f"diff-manifest: {len(lines)} difference(s) from {paths[0]} to {paths[1]}" if lines else
         f"diff-manifest: {paths[0]} and {paths[1]} are equal", sys.stderr)
    return EXIT_FAIL if lines else EXIT_PASS



# ============================================================================ aiv/run/store.py
# Floor 5 (runtime): the side channel: one TCPStore, every value sealed with the job's secret and
def fd_limit_problem(world, nodes):
    """Rank 0's store holds two connections per rank (main and listener) and two per node (its monitor and
    its leader's beat). Raise the soft RLIMIT_NOFILE to the hard limit; a hard limit too low is a message, else None."""
    need = 2 * world + 2 * nodes + 64
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < need:
        return (f"the open-files hard limit (ulimit -Hn) is {hard}, below the {need} the store needs for "
                f"{world} ranks on {nodes} node(s) (2 per rank + 2 per node + 64): raise it for the job")
    if soft != resource.RLIM_INFINITY and soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return None


def norm_ip(text):
    """'0000:...:0001' -> '::1', '::ffff:10.0.0.1' -> '10.0.0.1' (None: not an address)."""
    try:
        ip = ipaddress.ip_address(text.split("%", 1)[0])
    except ValueError:
        return None
    return str(getattr(ip, "ipv4_mapped", None) or ip)


def store_peers(port):
    """The remote addresses of the TCP connections this process accepted on `port` (rank 0's store):
    a set of IPs, None when psutil cannot tell."""
    try:
        import psutil
        me = psutil.Process()
        conns = me.net_connections("tcp") if hasattr(me, "net_connections") else me.connections("tcp")
    except Exception:
        return None
    return {norm_ip(c.raddr.ip) for c in conns if c.laddr and c.laddr.port == port and c.raddr} - {None}


def run_base(env):
    """'<job>.<step>' from Slurm ('' outside Slurm): the part of the run id that binds a record to its job."""
    return ".".join(env.get(v, "") for v in ("SLURM_JOB_ID", "SLURM_STEP_ID")).strip(".")


def store_timed_out(exc):
    """Whether `exc` is the store's own timeout (torch's DistStoreError 'wait timeout', or TimeoutError). A store
    that is gone, and the tool's own error, are not: raised to the phase (is_tool_error), never 'not arrived'."""
    return isinstance(exc, TimeoutError) or (type(exc).__name__ == "DistStoreError" and "timeout" in str(exc).lower())


class Forged(Exception):
    """A store value that is not this run's: it did not carry the job's secret, or it was replayed
    from another run. key: the store key; raw: what the value said (quoted, never believed)."""

    def __init__(self, key, raw, why):
        super().__init__(f"{key}: {why}")
        self.key, self.raw, self.why = key, raw, why


class Seal:
    """Every value on the side channel is '<tag>|<run id>|<payload>', tag = HMAC-SHA256 of (run id, key,
    payload) with the job's secret ('-' without one). The run id is '<job>.<step>.<nonce>'; rank 0 picks
    the nonce and publishes the run id in the world record, so a record of another run (another job,
    step or roll call) is refused even when it carries the secret. Without a secret, values are only
    checked for their run id: the report says the channel is not authenticated."""

    def __init__(self, secret=None, base=""):
        self.secret, self.base, self.run = secret, base, None

    @property
    def authenticated(self):
        return self.secret is not None

    def tag(self, run, key, payload):
        if self.secret is None:
            return "-"
        return hmac.new(self.secret, f"{run}\0{key}\0{payload}".encode(), hashlib.sha256).hexdigest()

    def seal(self, key, payload, run=None):
        run = run or self.run
        return f"{self.tag(run, key, payload)}|{run}|{payload}"

    def unseal(self, key, value, world=False):
        """The payload of a value under `key`, or Forged. world: the world record, which sets the run id
        (its job and step must be ours, when we know them)."""
        text = value.decode(errors="replace") if isinstance(value, bytes) else value
        parts = text.split("|", 2)
        if len(parts) != 3 or not parts[1]:
            raise Forged(key, text, "did not carry the job's secret" if self.secret is not None
                         else "was not written by this tool (no run id)")
        tag, run, payload = parts
        if self.secret is not None and not hmac.compare_digest(tag, self.tag(run, key, payload)):
            raise Forged(key, payload, "did not carry the job's secret" + (" (it is unsigned)" if tag == "-" else ""))
        if world:
            if self.base and run.rsplit(".", 1)[0] != self.base:
                raise Forged(key, payload, f"is a record of another job or step (run {run}, this is {self.base})")
        elif run != self.run:
            raise Forged(key, payload, f"is a replay of another run (run {run}, this is {self.run})")
        return payload


def store_server(dist, addr, port, t, listen_fd):
    """The store's server on a socket rank 0 bound itself. torch 2.4's server (libuv) takes no listen fd
    (NotImplementedError), and its legacy one (use_libuv=False) wakes no wait on a compare_set (every gate
    would hang): there the socket is closed and the server binds the same port itself, on every interface."""
    try:
        return dist.TCPStore(addr, port, None, True, t, wait_for_workers=False, master_listen_fd=listen_fd)
    except NotImplementedError:
        with contextlib.suppress(OSError):
            os.close(listen_fd)
        return dist.TCPStore(addr, port, None, True, t, wait_for_workers=False)


class SealedStore:
    """The side channel's wire, under every key of StoreProtocol: the store (under the run's prefix; raw,
    the bare client), each value written sealed (Seal) and read only when it unseals; a value that does
    not is refused, kept in `forged` (shared by the clones) and, by a rank other than 0, told to rank 0."""

    def __init__(self, store, raw=None, prefix=None, seal=None, shared=None):
        self.store, self.raw, self.prefix = store, raw, prefix
        self.seal = seal if seal is not None else Seal()
        # shared by the clones: forged [{key, why, claim, seen_by}], mine {key: the sealed value this process
        # wrote last}, lists {appended keys read} (what audit() checks again at the verdict)
        self.shared = shared if shared is not None else {"forged": [], "mine": {}, "lists": set()}
        self.forged = self.shared["forged"]
        self.rank = self.world = None
        self.tells = False  # refusals are reported to rank 0 (every process but rank 0's)

    @property
    def run(self):
        """The run id (rank 0 publishes it; the others read it at the check-in)."""
        return self.seal.run

    def _wait(self, keys, seconds):
        self.store.wait(keys, datetime.timedelta(seconds=max(0.001, seconds)))

    # -- sealing
    def _set(self, key, payload):
        """Write a key only this process writes (or writes first), as compare_set from the value it wrote
        last: a value someone else put there in between comes back, and is refused unless it unseals (a
        forger that writes before the owner is found by the owner; one that writes after, by audit())."""
        val = self.seal.seal(key, payload)
        got = self.store.compare_set(key, self.shared["mine"].get(key, ""), val)
        if got != val.encode():
            self._open(key, got)
            self.store.set(key, val)
        self.shared["mine"][key] = val

    def _multi_set(self, keys, payloads):
        vals = [self.seal.seal(k, p) for k, p in zip(keys, payloads, strict=True)]
        self.store.multi_set(keys, vals)
        self.shared["mine"].update(zip(keys, vals, strict=True))

    def _append(self, key, payload):
        self.store.append(key, self.seal.seal(key, payload) + "\n")

    def _open(self, key, value, default=None, read=None):
        """The payload of a sealed value (read: value -> payload, or Forged; default unseal); `default` (and the
        forgery kept) when it does not unseal."""
        try:
            return read(value) if read else self.seal.unseal(key, value)
        except Forged as e:
            self.refuse(e)
            return default

    def _lines(self, key):
        """The payloads of an appended key's sealed lines (forged lines dropped)."""
        self.shared["lists"].add(key)
        if not self.store.check([key]):
            return []
        lines = self.store.get(key).decode(errors="replace").splitlines()
        return [p for p in (self._open(key, ln) for ln in lines if ln) if p is not None]

    def _wait_valid(self, key, seconds, read=None):
        """Wait for `key` to hold a value that unseals (read: as _open's), within `seconds`. A forged value is
        refused and waited past: the real writer may still overwrite it. TimeoutError when none came."""
        end = time.monotonic() + seconds
        while True:
            self._wait([key], end - time.monotonic())
            got = self._open(key, self.store.get(key), read=read)
            if got is not None:
                return got
            if time.monotonic() >= end:
                raise TimeoutError(f"{key} held no value of this run within {seconds:g}s")
            time.sleep(FORGED_POLL_S)

    def refuse(self, exc):
        """Keep a forgery (once per key and reason); a rank other than 0 also tells rank 0 (best effort)."""
        claim = exc.raw if isinstance(exc.raw, str) else str(exc.raw)
        try:
            said = json.loads(claim)
        except ValueError:
            said = None
        if isinstance(said, dict):  # what it claimed to be, for the line: its rank and host
            claim = json.dumps({k: said[k] for k in ("rank", "host") if k in said})
        entry = {"key": exc.key, "why": exc.why, "claim": claim[:300], "seen_by": self.rank}
        if self._known(entry):
            return
        self.forged.append(entry)
        if self.tells and self.seal.run:
            with contextlib.suppress(Exception):
                self._append("forged", json.dumps(entry))

    def forgeries(self):
        """Rank 0: every forgery seen, its own and those the others reported."""
        self.forged.extend(e for e in map(json.loads, self._lines("forged")) if not self._known(e))
        return list(self.forged)

    def _known(self, entry):
        """Whether a forgery of this key, for this reason, is kept already."""
        return any(f["key"] == entry.get("key") and f["why"] == entry.get("why") for f in self.forged)

    def _existing(self, keys):
        """The keys of `keys` that exist (one round trip when all do): a read never waits for a key."""
        if not keys or self.store.check(keys):
            return keys
        return [k for k in keys if self.store.check([k])]

    def _values(self, keys):
        return self.store.multi_get(keys) if keys else []

    def count(self, key):
        """A counter (arrived, hellos, nerr, acks, posts/<name>/n): a count to watch, a wake-up; counters cannot be
        sealed, so the sealed records they count (the identities, errors(), posts(), acked()) are what counts."""
        return self.store.add(key, 0)


class StoreRollCall:
    """The roll call's keys (StoreProtocol lists them), mixed into StoreProtocol: the world record and its run
    id, each rank's check-in, who arrived, their identities, each node's ranks for its monitor."""

    def publish_world(self, world):
        """Rank 0, before its check-in: the world size every rank is held to, and the run id."""
        nonce = os.urandom(8).hex()
        self.seal.run, self.world = f"{self.seal.base}.{nonce}" if self.seal.base else nonce, world
        self._set("world", json.dumps({"world": world, "run": self.seal.run}))

    def read_world(self, value):
        """The world record -> {'world', 'run'} (Forged when it is not this job's, or its run id is not the
        one it is sealed with)."""
        payload = self.seal.unseal("world", value, world=True)
        w = json.loads(payload)
        if value.decode(errors="replace").split("|", 2)[1] != w.get("run"):
            raise Forged("world", payload, "carries a run id other than the one it is sealed with")
        return w

    def _world(self):
        """The world record if there is one that unseals (a forged one is refused), else None; never waits."""
        has = self.store.check(["world"])
        return self._open("world", self.store.get("world"), read=self.read_world) if has else None

    def adopt_run(self):
        """Before its check-in (an error, a signal): take the run id from the world record, if there is one
        that unseals, so that the report is bound to this run. -> whether a run id is known."""
        w = self._world()
        if w is not None:
            self.seal.run = w["run"]
        return self.seal.run is not None

    def check_in(self, rank, identity, world, seconds):
        """Claim the rank (the first claimant's 'pid P on HOST' stays in who/<rank>) and check in; a
        process that is no rank of rank 0's world (stray_reason) is posted under `strays` instead, and
        wakes rank 0's roll call. A claim that does not unseal is refused (and reported) and replaced
        by ours. -> None, or the stray's (check, reason)."""
        w = self._wait_valid("world", seconds, self.read_world)
        world0, self.seal.run, self.world, self.rank = int(w["world"]), w["run"], int(w["world"]), rank
        self.tells = rank != 0
        if self.forged and self.tells:  # refused before the run id was known: rank 0 hears of them now
            for e in list(self.forged):
                with contextlib.suppress(Exception):
                    self._append("forged", json.dumps(dict(e, seen_by=rank)))
        who = self.seal.seal(f"who/{rank}", f"pid {identity['pid']} on {identity['host']}")
        stray = stray_reason(rank, world, world0, None)  # a stray of another world claims no rank
        if stray is None:
            got = self.store.compare_set(f"who/{rank}", "", who)
            if got != who.encode() and self._open(f"who/{rank}", got) is None:  # a forged claim: ours instead
                got = self.store.compare_set(f"who/{rank}", got, who)
            first = None if got == who.encode() else self._open(f"who/{rank}", got, "an unreadable claim")
            stray = stray_reason(rank, world, world0, first)
        if stray is not None:
            entry = {"rank": rank, "host": identity["host"], "pid": identity["pid"], "check": stray[0],
                     "why": stray[1]}
            self._append("strays", json.dumps(entry))
            self.wake_roll_call("stray")
            return stray
        self._set(f"id/{rank}", json.dumps(identity, default=str))
        self._set(f"stamp/{rank}", "0")
        if self.store.add("arrived", 1) == world:
            self._set("all_arrived", "1")
        return None

    def is_run(self, run):
        """Whether this store is the run whose run id is `run`."""
        return (self._world() or {}).get("run") == run

    def strays(self):
        return [json.loads(p) for p in self._lines("strays")]

    def wait_all(self, seconds):
        """Whether all_arrived was set within `seconds` (a wake-up only: the records are what counts)."""
        try:
            self._wait(["all_arrived"], seconds)
        except Exception as e:
            if not store_timed_out(e):
                raise
            return False
        return self._open("all_arrived", self.store.get("all_arrived")) is not None

    def all_in(self, world):
        """Whether every rank's record is there (one round trip)."""
        return self.store.check([f"id/{r}" for r in range(world)])

    def said_hello(self, ranks):
        """The ranks of `ranks` whose process said hello (reached the store, not checked in yet)."""
        return [r for r in ranks if self.store.check([f"hello/{r}"])]

    def missing(self, world):
        have = set(self._existing([f"id/{r}" for r in range(world)]))
        return [r for r in range(world) if f"id/{r}" not in have]

    def identities(self, ranks):
        """The identities of `ranks` that unseal (a forged one is kept in `forged`, not returned)."""
        vals = self._values([f"id/{r}" for r in ranks])
        out = [self._open(f"id/{r}", v) for r, v in zip(ranks, vals, strict=True)]
        return [json.loads(p) for p in out if p is not None]

    def prepare(self, records):
        """Rank 0, before the go: each node's ranks and PIDs, empty liveness and error keys (so that
        no later read waits on a key that was never written)."""
        nodes = group_by(records, lambda rec: rec["host"], lambda rec: [rec["rank"], rec["pid"], rec.get("pid_start")])
        self._multi_set([f"node/{h}" for h in nodes] + [f"live/{h}" for h in nodes],
                        [json.dumps(v) for v in nodes.values()] + ["{}"] * len(nodes))
        self.store.multi_set([f"beat/{h}" for h in nodes], ["0"] * len(nodes))
        self.store.set("errors", "")

    def node_ranks(self, host):
        """A node's [[rank, pid, start], ...] (None when the record does not unseal)."""
        payload = self._open(f"node/{host}", self.store.get(f"node/{host}"))
        return None if payload is None else json.loads(payload)


class StoreProtocol(StoreRollCall, SealedStore):
    """The run's side channel: one TCPStore that every rank reaches, served by rank 0 (or, under
    torchrun, by the agent). A TCPStore client serialises its operations, so each thread that
    blocks on the store has its own connection (clone()). Every value is sealed (Seal: the job's
    secret and the run id); a value that does not unseal is never believed: it is dropped and kept in
    `forged` (shared by the clones), and a rank other than 0 reports it to rank 0 under `forged`.
    Counters (arrived, nerr, acks, screen/<round>/n) cannot be signed: they only wake a reader, who
    then counts the sealed records. Every key, under one prefix:

      world          {"world": N, "run": run id}: the world size every rank is held to, and the
                     run id every value is bound to (said markers, node monitors)   rank 0, first
      who/<rank>     'pid P on HOST' of the rank's first claimant (compare_set)   each rank
      strays         processes refused at the check-in (JSON lines, stray_reason)   a stray
      id/<rank>      identity at the roll call (JSON)             each rank
      arrived        ranks checked in (counter); all_arrived      each rank; the last one
      hello/<rank>, hellos  its process reached the store (its host, unsigned: a wake-up; a forged one only keeps
                     the roll call at its own bound); how many (counter)   each rank but 0, before torch
      node/<host>    [[rank, pid], ...] of a node, for its monitor rank 0
      stamp/<rank>   index in PHASES of the last phase finished   each rank
      live/<host>    {"seq": n, "ranks": {rank: state}}           each node's monitor
      monitor/<host> the monitor's check of its own client (unsigned: read by nobody else)   each node's monitor
      gate/<name>    rank 0's go after the roll call and the judge rank 0
      errors, nerr   error lines (JSON, appended) and their count  any rank
      forged         values a rank refused (JSON lines: key, why, claim)   any rank but 0
      verdict        rank 0's exit code: listeners exit with it   rank 0
      ask            rank 0's question when a phase did not finish ('1'): each rank's listener, which waits
                     on this key, answers under posts/issued; set to 'verdict' after the verdict (the
                     listener then takes the verdict)   rank 0
      ack/<rank>, acks  a rank read the verdict; how many did (counter)   each rank
      screen/q<k>/<rank>                                          rank 0
                     the rank's part of the screen loop's k-th batch (JSON: its group, the batch's group
                     creation from screen_rank_plans), or {"done": true} after the last batch
      screen/<round> a batch's measurements, one JSON line per rank (appended): gpu, intra, p1-p3, b<k>
                     (every rank posts every batch it reaches, also outside any group)   each rank
      screen/<round>/n, screen/<round>/all  posts counted; set by the last of the world  each rank
      gate/screen    rank 0's go after the screen's judgement     rank 0
      posts/<name>   a fan-in to rank 0, one JSON line per rank (appended): telemetry (identity and
                     node facts), results (the collectives' and DDP step's), issued (the last collective
                     each rank issued on each of its groups, when rank 0 asked)   each rank
      posts/<name>/n, posts/<name>/all  posts counted; set by the last of the world   each rank
    Measurements travel here, not through a collective of the world, so that a hung group of two
    nodes cannot hang the others: rank 0 waits for the keys within the phase's bound and names the
    groups whose members did not post. The telemetry and the results come here too (not gather_object,
    which on NCCL is world - 1 point-to-point connections into rank 0): rank 0 reads the whole world's
    posts in one read of one key. Nothing here is unpickled: every payload is JSON or a number.
    """

    @classmethod
    def open(cls, dist, addr, port, timeout, prefix, listen_fd=None, seal=None):
        """Serve the store on a socket rank 0 bound itself (listen_fd), or connect to it."""
        t = datetime.timedelta(seconds=timeout)
        raw = store_server(dist, addr, port, t, listen_fd) if listen_fd is not None else \
            dist.TCPStore(addr, port, None, False, t)
        p = cls(dist.PrefixStore(prefix, raw), raw, prefix, seal)
        p.dial = lambda: dist.PrefixStore(prefix, dist.TCPStore(addr, port, None, False, t))
        return p

    dial = None  # open(): a new client connection to the same store (clone() where torch has no Store.clone)

    def clone(self):
        """Another connection to the same store, for another thread: Store.clone (torch >= 2.8), else a new
        TCPStore client to the same host:port with the same timeout (dial)."""
        try:
            store = self.store.clone() if hasattr(self.store, "clone") or self.dial is None else self.dial()
        except NotImplementedError:
            if self.dial is None:
                raise
            store = self.dial()
        c = StoreProtocol(store, None, self.prefix, self.seal, self.shared)
        c.rank, c.world, c.tells, c.dial = self.rank, self.world, self.tells, self.dial
        return c

    # -- progress and liveness
    def stamp(self, rank, phase):
        self._set(f"stamp/{rank}", str(PHASES.index(phase)))

    def stamps(self, world):
        """{rank: index in PHASES}; a forged stamp counts as the check-in's (0)."""
        vals = self.store.multi_get([f"stamp/{r}" for r in range(world)])
        return {r: int(self._open(f"stamp/{r}", v, "0")) for r, v in enumerate(vals)}

    def post_live(self, host, seq, states):
        self._set(f"live/{host}", json.dumps({"seq": seq, "ranks": states}))

    def live(self, hosts):
        vals = self.store.multi_get([f"live/{h}" for h in hosts])
        return {h: json.loads(self._open(f"live/{h}", v, "{}")) for h, v in zip(hosts, vals, strict=True)}

    def beat(self, host):
        """A node leader's beat thread, every liveness period: the node's ranks reach the store. A bare
        counter (a forged one can only keep a node from being called unreachable, never blame one)."""
        self.store.add(f"beat/{host}", 1)

    def beats(self, hosts):
        """{host: its beat count} (0 where there is none: a read never waits for a key)."""
        keys = self._existing([f"beat/{h}" for h in hosts])
        got = dict(zip(keys, self._values(keys), strict=True))
        return {h: int(v) if (v := got.get(f"beat/{h}", b"0")).isdigit() else 0 for h in hosts}

    def settled_live(self, hosts, budget):
        """Liveness once every node has posted after this call (or its ranks are all gone), within `budget`
        seconds. -> ({rank: state}, silent, quiet). silent: nodes whose monitor posted nothing in the window (it
        stopped, or never posted since the go) and whose leader's beat did not move either (or never beat):
        unreachable, so that the ranks on other nodes, hung behind it, are not named in its place. quiet: the
        monitor silent while the leader still beats: the tool's own monitor slow or stopped, never evidence
        against the node."""
        first, beats, end = self.live(hosts), self.beats(hosts), time.monotonic() + budget
        while True:
            cur = self.live(hosts)
            stale = {h for h in hosts if cur[h].get("seq", -1) <= first[h].get("seq", -1)
                     and not (cur[h].get("ranks") and all(s == "gone" for s in cur[h]["ranks"].values()))}
            if not stale or time.monotonic() >= end:
                break
            time.sleep(0.2)
        moved = {h for h, n in self.beats(sorted(stale)).items() if n > beats[h]}
        silent = {h for h in stale if h not in moved}
        live = {int(r): s for snap in cur.values() for r, s in (snap.get("ranks") or {}).items()}
        return live, silent, stale - silent

    # -- performance screen
    def screen_publish(self, name, plans):
        """Rank 0: each rank's part of a plan ({rank: dict}) under screen/<name>/<rank>, in one write."""
        ranks = sorted(plans)
        self._multi_set([f"screen/{name}/{r}" for r in ranks], [json.dumps(plans[r]) for r in ranks])

    def screen_plan(self, name, rank, seconds):
        return json.loads(self._wait_valid(f"screen/{name}/{rank}", seconds))

    def screen_post(self, rnd, rank, data, world):
        self._fan_post(f"screen/{rnd}", rank, data, world)

    def screen_wait(self, rnd, seconds):
        return self._fan_wait(f"screen/{rnd}", seconds)[0]

    def screen_posts(self, rnd):
        return self._fan_in(f"screen/{rnd}")

    # -- fan-in to rank 0: the telemetry and the results (posts/<name>), the screen's rounds (screen/<round>)
    def post(self, name, rank, data):
        self._fan_post(f"posts/{name}", rank, data, self.world)

    def posts(self, name):
        return self._fan_in(f"posts/{name}")

    def wait_posts(self, name, seconds):
        """{rank: its post} once the whole world posted `name`, or what came within `seconds`."""
        got = self._fan_wait(f"posts/{name}", seconds)[1]
        return self.posts(name) if got is None else got

    def _fan_post(self, key, rank, data, world):
        """This rank's part of the fan-in `key`: one sealed JSON line appended to it; the last rank of the world
        to post sets <key>/all (the counter <key>/n only wakes rank 0)."""
        self._append(key, json.dumps(dict(data, rank=rank), default=str))
        if self.store.add(f"{key}/n", 1) == world:
            self._set(f"{key}/all", "1")

    def _fan_in(self, key):
        """{rank: its post} of the fan-in `key`, so far: one read of the list (sealed posts only)."""
        return {int(e["rank"]): e for e in map(json.loads, self._lines(key))}

    def _fan_wait(self, key, seconds):
        """Whether every rank posted to the fan-in `key` within `seconds`, and its posts as last read (None: not
        read): <key>/all wakes the wait, the sealed posts of the whole world end it (a forged line or a counter
        bumped from outside only makes rank 0 read again, every FORGED_POLL_S)."""
        end = time.monotonic() + seconds
        while True:
            try:
                self._wait([f"{key}/all"], end - time.monotonic())
            except Exception as e:  # the bound passed: what came is what there is
                if not store_timed_out(e):
                    raise
                return False, None
            got = None if self.world is None else self._fan_in(key)
            if got is None or len(got) >= self.world:
                return True, got
            if time.monotonic() >= end:
                return False, got
            time.sleep(FORGED_POLL_S)

    # -- gates, errors, verdict
    def open_gate(self, name, value="go"):
        self._set(f"gate/{name}", value)

    def wait_gate(self, name, seconds):
        return self._wait_valid(f"gate/{name}", seconds)

    def report_error(self, rank, phase, line, code, term=False, internal=False, host=None):
        if self.seal.run is None and not self.adopt_run():  # no run to report into yet
            return
        entry = {"rank": rank, "phase": phase, "line": line, "code": code, "term": term, "internal": internal,
                 "host": host}
        self._append("errors", json.dumps(entry))
        self.store.add("nerr", 1)

    def wake_roll_call(self, why):
        """Wake rank 0's roll call before every rank checked in (a stray, a rank that failed its local phase)."""
        self._set("all_arrived", why)

    def errors(self):
        """{rank: {'line', 'term', 'internal', 'phase', 'host', 'code'}}: the first report of each rank (term: it was
        terminated by a signal; internal: it hit the tool's own error)."""
        out = {}
        for e in map(json.loads, self._lines("errors")):
            entry = out.setdefault(int(e["rank"]), {"line": e["line"], "term": False, "internal": False,
                                                    **{k: e.get(k) for k in ("phase", "host", "code")}})
            for k in ("term", "internal"):
                entry[k] = entry[k] or bool(e.get(k))
        return out

    def post_deciding(self):
        """Rank 0, as its verdict starts (before the files asked for, which come before the code): the other
        ranks that see it wait up to VERDICT_S for the code instead of RANK0_GRACE."""
        self._set("deciding", "1")

    def deciding(self):
        """Whether rank 0 posted that its verdict started (a value not of this run is refused: False)."""
        return bool(self.store.check(["deciding"])) and self._open("deciding", self.store.get("deciding")) == "1"

    def publish_verdict(self, code):
        """The verdict, then `ask` (the listeners wait on it: it wakes them, and they find the verdict)."""
        self._set("verdict", str(code))
        self._set("ask", "verdict")

    def ask(self):
        """Rank 0, a phase did not finish: every live rank's listener posts what it issued last (posts/issued)."""
        self._set("ask", "1")

    def wait_ask(self, seconds):
        """A listener: rank 0's question or its verdict, within `seconds`. -> 'ask' or 'verdict'."""
        return "verdict" if self._wait_valid("ask", seconds) == "verdict" else "ask"

    def verdict_holds(self, code):
        """Rank 0, while it waits for the acks: whether the verdict key still holds its sealed code
        (a value written over it from outside is refused by every listener)."""
        return self._open("verdict", self.store.get("verdict")) == str(code)

    def wait_verdict(self, seconds):
        return int(self._wait_valid("verdict", seconds))

    def ack(self, rank):
        self._set(f"ack/{rank}", "1")
        self.store.add("acks", 1)

    def acked(self, ranks):
        """Whether every one of `ranks` left its sealed acknowledgement."""
        keys = [f"ack/{r}" for r in ranks]
        if not keys or not self.store.check(keys):
            return not keys
        return all(self._open(k, v) == "1" for k, v in zip(keys, self.store.multi_get(keys), strict=True))

    def audit(self, ranks, hosts):
        """Rank 0, before it publishes the verdict: every value the run wrote, checked once more, so that a value
        written from outside is found even where nobody read it after (a stamp on a passing run, a screen post
        after its round was judged). Rank 0's own values must still be its own; each rank's identity, claim and
        stamp, each node's liveness and every appended list read so far must unseal; a verdict key before the
        verdict is foreign. -> the forgeries (forgeries())."""
        mine = dict(self.shared["mine"])
        keys = self._existing(sorted(mine))
        for k, v in zip(keys, self._values(keys), strict=True):
            if v.decode(errors="replace") != mine[k]:
                self._open(k, v)  # written over: refused unless it is one of this run's values
        others = [f"{kind}/{r}" for r in ranks for kind in ("id", "who", "stamp")] + [f"live/{h}" for h in hosts]
        others = self._existing([k for k in others if k not in mine])
        if "verdict" not in mine and self.store.check(["verdict"]):  # there before rank 0's: foreign
            others.append("verdict")
        for k, v in zip(others, self._values(others), strict=True):
            self._open(k, v)
        for key in sorted(self.shared["lists"] | {"errors", "strays"}):
            self._lines(key)
        return self.forgeries()



# ============================================================================ aiv/run/liveness.py
# Floor 5 (runtime): the node monitor, a torch-free child of each node leader that posts the state
def proc_stat(pid, root="/"):
    """(state letter, start time) from /proc/<pid>/stat, or None when there is no such process."""
    fields = stat_fields(pid, root)
    return (fields[0], fields[19]) if len(fields) > 19 else None


def liveness(stat, first):
    """running / stopped / gone for a process first seen as `first` (None: never visible here)."""
    if first is None:
        return "unknown"
    if stat is None or stat[0] in "ZXx" or stat[1] != first[1]:
        return "gone"
    return "stopped" if stat[0] in "Tt" else "running"


def parent_pid(pid, root="/"):
    """The parent of `pid` from /proc/<pid>/stat, or None."""
    fields = stat_fields(pid, root)
    return int(fields[1]) if len(fields) > 1 else None


def launch_key(pid):
    """The launch a process belongs to, as its launcher's pid and start time (srun's step daemon, torchrun's
    agent, the local launcher): every rank of a node under one launch shares it."""
    return f"{pid}-{(proc_stat(pid) or ('', ''))[1]}"


def said_marker(env, topic, launch):
    """The node-local marker file of speak_once_per_node: job, step, topic and launch (launch_key)."""
    key = "-".join(re.sub(r"\W", "_", str(x)) for x in (env.get("SLURM_JOB_ID", "x"), env.get("SLURM_STEP_ID", "x"),
                                                          topic, *launch.split("-", 1)))
    return os.path.join(tempfile.gettempdir(), f"aiv-{key[:200]}.said")


def sweep_said(launch=None):
    """Remove speak_once_per_node's markers: those of one launch (its ranks are gone: the node monitor and
    the local launcher at their end), and any older than MARK_TTL (they silence nobody any more)."""
    now = time.time()
    for path in glob.glob(os.path.join(tempfile.gettempdir(), "aiv-*.said")):
        with contextlib.suppress(OSError):
            mine = launch is not None and path.endswith(f"-{launch}.said")
            if mine or now - os.stat(path).st_mtime > MARK_TTL:
                os.unlink(path)


def node_monitor(cfg):
    """A node leader's child: posts the state of its node's ranks to the store every cfg['period']
    seconds. It runs outside the ranks, so it never needs a rank's GIL (NCCL init can hold it for
    seconds). Ends when its ranks are all gone, the store is gone, or cfg['lifetime'] passes. A store
    on the port that is not its run's (cfg['run'], the roll call's nonce: its run ended while it
    started, and the next run serves the port) gets no post: it would name the next run's ranks gone."""
    pids = {int(x[0]): int(x[1]) for x in cfg["ranks"]}
    launch = launch_key(parent_pid(os.getppid()) or 0)  # its leader rank's launcher
    # each rank's own start time (from the roll call) tells a rank that died before we looked from
    # a PID we cannot see; without it, the first look is the reference
    first = {int(x[0]): ("", x[2]) if len(x) > 2 and x[2] else proc_stat(int(x[1])) for x in cfg["ranks"]}
    # ranks gone before we connect: the run ended (its store is gone: the connect fails within 1 s)
    # or they died, which is news for rank 0: one post, then the loop ends
    ended = all(liveness(proc_stat(p), first[r]) == "gone" for r, p in pids.items())
    store = monitor_store(cfg, 1 if ended else MONITOR_CONNECT_S)
    seal = Seal(job_secret(os.environ), run_base(os.environ))  # the secret travels in the environment only
    seal.run = cfg.get("run")
    proto = StoreProtocol(store, seal=seal)
    proto.tells = True  # what it refuses (a liveness post written over its own) goes to rank 0
    if cfg.get("run") and not proto.is_run(cfg["run"]):  # its run ended; a later run serves this port now
        return 0
    end, seq = time.monotonic() + cfg["lifetime"], 0
    while time.monotonic() < end:
        states = {r: liveness(proc_stat(p), first[r]) for r, p in pids.items()}
        proto.post_live(cfg["host"], seq, states)
        if all(s == "gone" for s in states.values()):
            sweep_said(launch)  # the ranks' markers silence nobody any more
            break
        seq += 1
        time.sleep(cfg["period"])
    return 0


def say_hello(addr, port, prefix, rank, host, stop, seconds, retry_s):
    """A rank other than 0, from its start (before it imports torch), on a thread of its own: tell rank 0's store
    that its process is up and reaches the store (hello/<rank>, then the hellos counter), so that rank 0's last
    call waits for it; tried every retry_s until it is said, `stop` is set (the rank checked in) or `seconds`
    passed. -> whether it was said."""
    end = time.monotonic() + seconds
    while not stop.is_set() and time.monotonic() < end:
        try:
            with contextlib.closing(LightStore(addr, port, prefix, min(1.0, max(0.1, end - time.monotonic())))) as s:
                s.set(f"hello/{rank}", host)
                s.add("hellos", 1)
            return True
        except (OSError, struct.error, ValueError):
            stop.wait(retry_s)
    return False


def tell_rank0_without_torch(addr, port, prefix, rank, host, line, seconds, code=1, internal=False):
    """A rank that failed before the roll call (torch missing or too old, a local check, the tool's own error)
    reports it to rank 0 through the store's own wire (LightStore: no torch needed), so that rank 0 ends the
    roll call at once (naming this host, or nobody for the tool's own error) rather than waiting out the roll
    call. -> whether the report was posted (the store and rank 0's world record answered within `seconds`)."""
    end = time.monotonic() + seconds
    try:
        with contextlib.closing(LightStore(addr, port, prefix, max(0.5, seconds))) as store:
            proto = StoreProtocol(store, seal=Seal(job_secret(os.environ), run_base(os.environ)))
            while not proto.adopt_run():  # rank 0 publishes the world record (the run id) as its store opens
                if time.monotonic() >= end:
                    return False
                time.sleep(0.2)
            proto.report_error(rank, "local", line, code, internal=internal, host=host)
            proto.wake_roll_call("local")
            return True
    except (OSError, struct.error, ValueError):
        return False


def monitor_store(cfg, wait_s):
    """The node monitor's store client: LightStore (no import of torch: the monitor posts within a second
    of the go, not after seconds of importing torch beside the ranks' init), once it sees the world
    record rank 0 wrote through torch's client (same keys on the wire) and a set, check, get and
    compare_set on a key of its own came back as written; else torch's own TCPStore client (a later
    torch that speaks another protocol costs the import, never a silent node). No listener at all within
    wait_s raises the OSError (no fallback: there is no store to speak to). _AIV_MONITOR_TORCH=1 takes
    torch's client at once."""
    if os.environ.get("_AIV_MONITOR_TORCH") != "1":
        # no listener within wait_s: the run has ended (its store went with rank 0) or rank 0 cannot be
        # reached; torch's client would find none either, after seconds of importing torch and wait_s more
        # (a monitor that outlived its run by 15 s on a loaded machine): the OSError ends the monitor
        light = LightStore(cfg["addr"], cfg["port"], cfg["prefix"], wait_s)
        with contextlib.suppress(OSError, struct.error):
            key, mark = f"monitor/{cfg['host']}", f"{os.getpid()}.{time.time():.6f}"
            light.set(key, mark)
            if light.check(["world", key]) and light.get(key) == mark.encode() \
                    and light.compare_set(key, mark, mark + ".1") == (mark + ".1").encode():
                return light
        light.close()
    import torch.distributed as dist
    raw = dist.TCPStore(cfg["addr"], cfg["port"], None, False, datetime.timedelta(seconds=wait_s))
    return dist.PrefixStore(cfg["prefix"], raw)


class LightStore:
    """The store operations a node monitor (and a rank without torch) needs (set, check, get, compare_set,
    append, add) over a plain
    socket, in the wire format of torch's TCPStore (c10d: a query byte, then each key or value as a
    64-bit little-endian length and its bytes; a check answers one byte, 0 = ready; a get or
    compare_set answers a value). Keys are '/<prefix>/<key>', as torch's TCPStore and PrefixStore
    put them on the wire. Never trusted before monitor_store's round trips."""

    VALIDATE, SET, COMPARE_SET, GET, ADD, CHECK, APPEND = 0, 1, 2, 3, 4, 5, 9
    MAGIC = 0x3C85F7CE  # the client's first word: the server drops a connection without it

    def __init__(self, addr, port, prefix, timeout):
        self.prefix, end = prefix, time.monotonic() + timeout
        while True:  # as torch's client does: a refused connect is tried again (a full backlog at the go)
            try:
                self.sock = socket.create_connection((addr, port), timeout=max(0.1, end - time.monotonic()))
                break
            except OSError:
                if time.monotonic() >= end:
                    raise
                time.sleep(0.1)
        self.sock.settimeout(timeout)  # each later operation, as torch's client bounds them
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock.sendall(struct.pack("<BI", self.VALIDATE, self.MAGIC))

    def close(self):
        with contextlib.suppress(OSError):
            self.sock.close()

    @staticmethod
    def _blob(value):
        value = value if isinstance(value, bytes) else str(value).encode()
        return struct.pack("<Q", len(value)) + value

    def _key(self, key):
        return self._blob(f"/{self.prefix}/{key}")  # torch's client puts '/' before every key

    def _read(self, n):
        buf = b""
        while len(buf) < n:
            chunk = self.sock.recv(n - len(buf))
            if not chunk:
                raise ConnectionError("the store closed the connection")
            buf += chunk
        return buf

    def _value(self):
        return self._read(struct.unpack("<Q", self._read(8))[0])

    def set(self, key, value):
        self.sock.sendall(bytes([self.SET]) + self._key(key) + self._blob(value))

    def append(self, key, value):
        self.sock.sendall(bytes([self.APPEND]) + self._key(key) + self._blob(value))

    def check(self, keys):
        self.sock.sendall(struct.pack("<BQ", self.CHECK, len(keys)) + b"".join(map(self._key, keys)))
        return self._read(1) == b"\0"

    def get(self, key):
        self.sock.sendall(bytes([self.GET]) + self._key(key))
        return self._value()

    def add(self, key, n):
        self.sock.sendall(bytes([self.ADD]) + self._key(key) + struct.pack("<q", n))
        return struct.unpack("<q", self._read(8))[0]

    def compare_set(self, key, expected, desired):
        self.sock.sendall(bytes([self.COMPARE_SET]) + self._key(key) + self._blob(expected) + self._blob(desired))
        return self._value()



# ============================================================================ aiv/run/ras.py
# Floor 5 (runtime): NCCL's own view of a job, from its RAS service (NCCL >= 2.24, on unless NCCL_RAS_ENABLE=0):
RAS_PORT = 28028        # NCCL's default RAS client port
RAS_PROTOCOL = 2        # the client protocol this reader speaks
RAS_MAX_BYTES = 16 << 20


def ras_addr(env):
    """(host, port) of NCCL's RAS client socket: NCCL_RAS_ADDR ('host:port', '[v6]:port', 'host' or ':port'),
    else localhost:28028."""
    spec = (env.get("NCCL_RAS_ADDR") or "").strip()
    if spec.startswith("["):
        host, _, rest = spec[1:].partition("]")
        port = rest.lstrip(":")
    elif spec.count(":") == 1:
        host, _, port = spec.partition(":")
    else:
        host, port = spec, ""
    return host or "localhost", int(port) if port.isdigit() else RAS_PORT


class _Conn:
    """One RAS connection: lines and the rest of the stream, every read and write within the deadline."""

    def __init__(self, sock, end):
        self.sock, self.end, self.buf = sock, end, bytearray()

    def left(self):
        left = self.end - time.monotonic()
        if left <= 0:
            raise TimeoutError
        return left

    def send(self, line):
        self.sock.settimeout(self.left())
        self.sock.sendall(line.encode() + b"\n")

    def line(self):
        while b"\n" not in self.buf:
            self._recv()
        head, _, self.buf = self.buf.partition(b"\n")
        return head.decode(errors="replace").strip()

    def rest(self):
        """Everything until NCCL closes the connection (the STATUS document)."""
        try:
            while True:
                self._recv()
        except EOFError:
            return self.buf.decode(errors="replace")

    def _recv(self):
        self.sock.settimeout(self.left())
        got = self.sock.recv(65536)
        if not got:
            raise EOFError
        self.buf += got
        if len(self.buf) > RAS_MAX_BYTES:
            raise ValueError(f"more than {RAS_MAX_BYTES >> 20} MiB")


def ras_status(host, port, seconds):
    """NCCL's RAS STATUS as JSON, within `seconds` in all (NCCL is told to wait for its peers one second
    less). -> {'ok': True, 'data': the document, 'secs'} or {'ok': False, 'why': in words}."""
    t0, where = time.monotonic(), f"{host}:{port}"
    end = t0 + seconds
    try:
        sock = socket.create_connection((host, port), timeout=max(0.05, seconds))
    except ConnectionRefusedError:
        return {"ok": False, "why": f"nothing listens on {where} (RAS off: NCCL_RAS_ENABLE=0, NCCL older than 2.24, or "
                                    "no NCCL process on this node any more)"}
    except (TimeoutError, socket.timeout):
        return {"ok": False, "why": f"no connection to {where} within {seconds:g}s"}
    except OSError as e:
        return {"ok": False, "why": f"cannot connect to {where}: {e.strerror or e}"}
    conn, step = _Conn(sock, end), "the handshake"
    # each step: (its name, the line sent, the answer that says yes (a pattern), the words for any other answer)
    steps = (("the handshake", f"CLIENT PROTOCOL {RAS_PROTOCOL}", "SERVER PROTOCOL .*",
              "answered {!r}, not as NCCL's RAS (SERVER PROTOCOL)"),
             ("TIMEOUT", f"TIMEOUT {max(1, int(seconds) - 1)}", "OK", "refused TIMEOUT"),
             ("SET FORMAT json", "SET FORMAT json", "OK", "does not answer in JSON (NCCL older than 2.28.7?): {!r}"))
    try:
        with sock:
            for step, line, yes, no in steps:  # noqa: B007 - the errors below name the step
                conn.send(line)
                answer = conn.line()
                if not re.fullmatch(yes, answer.upper(), re.S):
                    return {"ok": False, "why": f"{where} " + no.format(answer[:60])}
            step = "STATUS"
            conn.send("STATUS")
            text = conn.rest()
    except (TimeoutError, socket.timeout):
        return {"ok": False, "why": f"{where} did not answer {step} within {seconds:g}s"}
    except EOFError:
        return {"ok": False, "why": f"{where} closed the connection during {step}"}
    except (OSError, ValueError) as e:
        return {"ok": False, "why": f"{where} during {step}: {e}"}
    try:
        data = json.loads(text)
    except ValueError:
        return {"ok": False, "why": f"{where} answered STATUS with something that is not JSON ({text[:60]!r})"}
    if not isinstance(data, dict):
        return {"ok": False, "why": f"{where} answered STATUS with JSON that is not a document"}
    return {"ok": True, "data": data, "secs": round(time.monotonic() - t0, 3), "addr": where}



# ============================================================================ aiv/run/background.py
# Floor 5 (runtime): a rank's work off its main thread, each taken within a bound (Background), its NCCL log
class Issued:
    """What this rank issued last on each of its process groups, kept in memory as it goes (cheap: a list per
    group): the collective's name, its number on that group (1, 2, ...; the group's own set-up is 0) and
    whether it finished on this rank; and the group the main thread is inside right now. Set by the one
    helper every collective call passes through (RankRun.issuing). torch's flight recorder holds the same
    from torch's side (record()): where it recorded nothing, this record stands in."""

    def __init__(self):
        self.own, self.inflight, self.since = {}, None, time.monotonic()
        self.names = {}  # a process group's name (torch's) -> its key (hang.group_key)

    def start(self, op, key, seq=None):
        last = self.own.get(key)
        self.own[key] = [op, (last[1] + 1 if last else 1) if seq is None else seq, False]
        self.inflight, self.since = key, time.monotonic()

    def done(self, key):
        self.own[key] = self.own[key][:2] + [True]
        self.inflight, self.since = None, time.monotonic()

    def record(self, torch, diag=()):
        """This rank's answer to rank 0: {'own': {key: [op, seq, done]}, 'fr': the same from torch's flight
        recorder (None: it recorded nothing, or cannot be read), 'inflight': the group the main thread is
        inside, or None, 'idle_s': seconds since it left its last call, 'diag': NCCL DIAG lines seen}. Never
        raises: the recorder is evidence, not a dependency."""
        inflight, since = self.inflight, self.since
        took = round(time.monotonic() - since, 3)
        return {"own": {k: list(v) for k, v in list(self.own.items())}, "fr": recorder_last(torch, dict(self.names)),
                "inflight": inflight, "idle_s": None if inflight else took, "inflight_s": took if inflight else None,
                "diag": list(diag)[:8]}


# torch's flight recorders, in the order read: ProcessGroupNCCL's own (NCCL's collectives; CUDA builds only),
# then the recorder of the other backends (gloo), whose dump holds none of NCCL's collectives. JSON only: nothing
# a rank reads is unpickled (torch's pickle dump, _dump_nccl_trace, is left alone)
RECORDERS = ("_dump_nccl_trace_json", "_dump_fr_trace_json")


def recorder_dump(torch):
    """The first of torch's flight recorders (RECORDERS) that holds entries, as plain data ({'entries', 'pg_status',
    ...}); {} when those that could be read hold none; None when none could be read."""
    c10d, read = getattr(torch._C, "_distributed_c10d", None), False
    for name in RECORDERS:
        try:  # a recorder this torch lacks, or cannot dump, is skipped
            j = json.loads(getattr(c10d, name)(True, False))
        except Exception:
            continue
        read = read or isinstance(j, dict)
        if isinstance(j, dict) and j.get("entries"):
            return j
    return {} if read else None


def recorder_last(torch, names):
    """The last collective torch's flight recorder holds for each process group this rank knows (names: torch's
    group name -> key): {key: [op, collective_seq_id, done, state]}, done from the recorder's per-group status (the
    last completed collective), else the entry's state (scheduled, started, completed). {} when the recorder
    holds nothing of these groups; None when it cannot be read: the recorder is evidence, not a dependency."""
    try:
        j = recorder_dump(torch)
        if j is None:
            return None
        status, out = j.get("pg_status") or {}, {}
        for e in j.get("entries") or []:
            pg = e.get("process_group") or []
            key, seq = names.get(str(pg[0])) if pg else None, e.get("collective_seq_id")
            if key is None or e.get("is_p2p") or not isinstance(seq, int) or (key in out and out[key][1] >= seq):
                continue
            st = status.get(str(e.get("pg_id")))
            done = int(st["last_completed_collective"]) >= seq if st and "last_completed_collective" in st else \
                e.get("state") == "completed"
            state = "completed" if done else str(e.get("state") or "?")
            out[key] = [str(e.get("profiling_name") or "?").split(":", 1)[-1], seq, done, state]
        return out
    except Exception:
        return None


class NcclLog:
    """NCCL's INFO lines of one rank: the transport it chose and the HCA of each connection, its WARN lines.
    By default NCCL writes them to a private file (not the operator's log). An operator who set NCCL_DEBUG_FILE
    keeps it: the rank reads that file (its %h and %p expanded as NCCL does), and NCCL writes INFO lines there
    only with NCCL_DEBUG=INFO. With NCCL_DEBUG=INFO and no file NCCL writes to the job's stdout, which the rank
    cannot read: `source` says why nothing was read (the transport row says so). Nothing on gloo."""

    def __init__(self, path=None, env=None, source=None):
        self.path, self.env, self.seen = path, env or {}, 0
        self.source = source  # NCCL's lines go to: 'private' (ours), 'operator' (NCCL_DEBUG_FILE), 'stdout'; None: gloo
        self.relay_lock, self.relayed = threading.Lock(), threading.Event()

    @classmethod
    def capture(cls, backend, rank, env):
        """As a rank starts (backend: --backend's word, auto included): the private file, NCCL's variables set
        to write there, unless the backend is gloo or the operator chose where NCCL writes."""
        if backend == "gloo":
            return cls(None, env)
        if "NCCL_DEBUG_FILE" in env or env.get("NCCL_DEBUG", "").upper() in ("INFO", "TRACE"):
            return cls(None, env, "operator" if "NCCL_DEBUG_FILE" in env else "stdout")
        fd, path = tempfile.mkstemp(prefix=f"aiv-nccl-r{rank}-", suffix=".log")
        os.close(fd)
        os.environ["NCCL_DEBUG_FILE"] = path
        os.environ["NCCL_DEBUG"] = "INFO"
        os.environ.setdefault("NCCL_DEBUG_SUBSYS", "INIT,NET")
        return cls(path, env, "private")

    def for_backend(self, backend):
        """This log once the backend is known: a gloo rank's has nothing to read, and its private file is
        dropped (NCCL's variables stay set: nothing in a gloo rank starts NCCL)."""
        if backend != "gloo":
            return self
        self.drop()
        return type(self)(None, self.env)

    def readable(self):
        """The file this rank reads NCCL's lines from (the private one, or the operator's), or None."""
        return self.path or (nccl_debug_file(self.env) if self.source == "operator" else None)

    def __bool__(self):
        return self.readable() is not None

    def _text(self):
        path = self.readable()
        return (read_text(path, "", limit=8 << 20) or "") if path else ""

    def facts(self):
        """{'transport': kinds, 'nccl_net': interfaces, 'nccl_log': where NCCL's lines were read, or why not}:
        transport and nccl_net are None where no INFO line of NCCL was read (gloo; NCCL_DEBUG=INFO on stdout;
        an operator's NCCL_DEBUG_FILE without INFO lines in it)."""
        if self.source is None and not self.path:
            return {"transport": None, "nccl_net": None, "nccl_log": None}
        text, where = self._text(), {"source": self.source, "path": self.readable()}
        hidden = self.source == "operator" and nccl_subsys_hides_channels(self.env.get("NCCL_DEBUG_SUBSYS"))
        if " NCCL INFO " not in text or hidden:
            return {"transport": None, "nccl_net": None, "nccl_log": dict(where, read=False, subsys=self.env.get(
                "NCCL_DEBUG_SUBSYS") if hidden else None)}
        return {"transport": parse_nccl_transport(text), "nccl_net": parse_nccl_ifaces(text),
                "nccl_log": dict(where, read=True)}

    def diag(self):
        """NCCL's DIAG lines (NCCL >= 2.31, NCCL_RUN_DIAGNOSTICS=1) where they reached the file this rank reads
        (NCCL prints them to the process's stdout: they are in the job's log beside ours)."""
        return nccl_diag_lines(self._text()) if self.readable() else []

    def hca_since_last(self):
        """The HCA of this rank's connections since the last call (a pair round's communicator)."""
        text = self._text()
        since, self.seen = self.seen, len(text)
        return parse_nccl_hca(text, since)

    def relay(self, who):
        """This rank's NCCL WARN lines to stderr, once, whichever thread exits first (the other waits at most
        NCCL_RELAY_S): from the private log, else from the operator's NCCL_DEBUG_FILE. The file may sit in
        a job-private TMPDIR that Slurm deletes; the job's stderr stays. A relay never changes the exit."""
        if not self.relay_lock.acquire(blocking=False):
            self.relayed.wait(NCCL_RELAY_S)
            return
        try:
            path = self.path or nccl_debug_file(self.env)
            if path:
                with contextlib.suppress(Exception):
                    lines, more = nccl_warn_lines(read_text(path, "", limit=8 << 20) or "")
                    for ln in lines:
                        emit(who + ln, sys.stderr)
                    if more:
                        emit(f"{who}{more} more of NCCL's WARN lines not shown", sys.stderr)
        finally:
            self.relayed.set()

    def close(self, keep, who):
        """At exit: keep a non-empty log of a failed run (and say where), drop it otherwise."""
        if self.path and keep and os.path.getsize(self.path) > 0:
            emit(f"{who}NCCL debug log kept at {self.path}", sys.stderr)
        else:
            self.drop()

    def drop(self):
        if self.path:
            with contextlib.suppress(OSError):
                os.unlink(self.path)
        self.path = None


class Background:
    """A rank's work off its main thread: started at the local phase, taken by the phase that needs it,
    each within a bound, none outliving the rank: children (the import probe, the node monitor) are killed at exit."""

    def __init__(self):
        self.probe = None     # node leaders: the torchvision/torchaudio import probe (a child, nice 19)
        self.monitor = None   # node leaders: the liveness monitor of the node's ranks (a child)
        self.warm = None      # DDP's lazy imports, on a thread
        self.node = None      # node leaders: the node's facts {'facts'|'error'|'internal'}, on a thread
        self.smi = None       # node leaders: the node's one nvidia-smi call (start_node_smi)
        self.gpu = None       # GPU ranks: the screen's device measurement on its own thread (start_screen_gpu)
        self.imports = None   # the import probe's result, once taken (RankSetup.import_results)

    def node_facts(self, smi_most_s):
        """The node's facts for the telemetry (node leaders; None elsewhere). The tool's own error in their
        collection is raised here (`internal`, no host blamed)."""
        if self.node is None:
            return None
        if "internal" in self.node:
            raise self.node["internal"]
        facts = self.node.get("facts") or {"error": self.node.get("error", "not collected in time")}
        if self.smi is not None:  # waited for within NODE_SMI_S of its start, at most smi_most_s now
            facts = dict(facts, smi=finish_node_smi(self.smi, smi_most_s))
        return facts

    def stop(self):
        for proc in (self.probe, self.monitor):
            if proc is not None and not isinstance(proc, OSError) and proc.poll() is None:
                proc.kill()



# ============================================================================ aiv/out/drain.py
# Floor 5 (runtime): the one drain, in the preflight (--drain on) and in the node gate (its prolog, epilog and
def _scontrol(argv, until):
    """One scontrol call within the time left -> (rc, stdout, message). rc None: missing or silent."""
    r = run_bounded(argv, max(0.1, until - time.monotonic()))
    if "unread" in r:
        why = r["unread"]
        if "could not run" in why and "No such file" in why:
            return None, "", "scontrol is not on PATH"
        if "gave no answer" in why:
            return None, "", f"scontrol did not answer within {DRAIN_S:g}s (slurmctld unreachable?)" + (
                f"; {why.split(': ', 1)[1]}" if r.get("stuck") else "")
        return None, "", why
    msg = " ".join((r["err"] or r["out"] or "").split())[:300]
    return r["rc"], r["out"], msg or f"exit status {r['rc']}"


def drain_apply(plan, known=None, seconds=DRAIN_S):
    """--drain on: one `scontrol show node` (nodes drained for another reason keep it; known: {node: (state,
    reason)} already read, no show), then one `scontrol update` for the rest, both within `seconds`. -> (plan
    with 'done'/'kept'/'hosts', findings: a WARN quoting scontrol when it is missing, refused or silent; never
    a FAIL)."""
    until = time.monotonic() + seconds
    if known is None:
        rc, out, msg = _scontrol(["scontrol", "show", "node", "-o", compress_hostlist(plan["hosts"])], until)
        if rc != 0:
            return plan, [finding("drain", "WARN", f"nothing drained: `scontrol show node` failed: {msg}; run by "
                                  f"hand: {plan['command']}", plan["hosts"])]
        known = parse_scontrol_nodes(out)
    kept = drain_keeps(known)
    hosts = [h for h in plan["hosts"] if h not in kept]
    plan = dict(plan, kept=kept, hosts=hosts)
    if hosts:
        argv, line = drain_command(hosts, plan["reason"])
        plan.update(argv=argv, command=line)
        rc, _, msg = _scontrol(argv, until)
        if rc != 0:
            return plan, [finding("drain", "WARN", f"nothing drained: scontrol refused: {msg}; an operator can "
                                  f"run: {plan['command']}", hosts)]
    return dict(plan, done=bool(hosts)), []


def node_drain(ctx, verdict, findings, args, node, slurm, seconds):
    """The node gate's drain (NodeCheck's verdict told to Slurm): health drains this node on a FAIL that singles
    it out (--drain on) and resumes its own drain after a pass that judged the check that drained it
    (--undrain); prolog and epilog write the reason before their exit 1 (Slurm then drains the node; the
    prolog's job is requeued). A reason not ours is never touched; npd leaves Slurm alone. slurm: the node as
    `scontrol show node` gave it ({'state', 'reason'} or {'unread'}), or None. -> {'action', 'done', 'reason',
    'command', 'said'}."""
    out = {"action": "none", "done": False, "reason": "", "command": "", "said": ""}
    if ctx == "npd":
        return dict(out, said="NPD problem (exit 1): the condition turns True" if verdict["drainable"] else "")
    if not verdict["drainable"]:
        if ctx == "health" and args.undrain and verdict["verdict"] == "PASS":
            out.update(_node_resume(findings, node, slurm, seconds))
        return out
    plan = drain_plan(findings, args.drain, 1, None, context=ctx)
    out.update(action="drain", reason=plan["reason"], command=plan["command"])
    slurm_does = "; exit 1: Slurm drains the node" + (" and requeues the job" if ctx == "prolog" else "") \
        if ctx != "health" else ""
    if plan["skipped"] or args.drain != "on":
        return dict(out, said=(f"not drained: {plan['skipped']}" if plan["skipped"] else
                               f"not drained by the check (--drain {args.drain}): {plan['command']}") + slurm_does)
    if slurm and slurm.get("unread"):
        return dict(out, said=f"not drained: Slurm's view of the node was not read ({slurm['unread']})" + slurm_does)
    known = {node: (slurm.get("state") or "", slurm.get("reason") or "")} if slurm else None
    plan, warns = drain_apply(plan, known, seconds)
    if plan["kept"]:
        return dict(out, said=f"not drained by the check: already drained or down for another reason, kept "
                              f"({plan['kept'][node]!r})" + slurm_does)
    said = f"drained: {plan['reason']}" if plan["done"] else f"not drained: {warns[0]['reason']}"
    return dict(out, done=plan["done"], said=said + slurm_does)


def _node_resume(findings, node, slurm, seconds):
    """--undrain after a PASS: resume_plan, then its one scontrol update."""
    s = slurm or {}
    if s.get("unread") or "DRAIN" not in (s.get("state") or ""):
        return {}
    if not owned_reason(s.get("reason")):
        return {"said": f"left drained: its reason is not the node check's ({s.get('reason')!r})"}
    plan = resume_plan(node, s["reason"], findings)
    if plan["skipped"]:
        return {"action": "resume", "command": plan["command"], "said": f"left drained: {plan['skipped']}"}
    rc, _, msg = _scontrol(plan["argv"], time.monotonic() + seconds)
    return {"action": "resume", "done": rc == 0, "command": plan["command"],
            "said": "resumed our own drain: the check that drained it passed" if rc == 0 else f"not resumed: {msg}"}



# ============================================================================ aiv/run/conclusion.py
# Floor 5 (runtime): rank 0's verdict, given once. Conclusion takes the run's facts as plain data (copied
def write_json_within(path, state, first=False):
    """--json (path; None: not asked), within OUTPUT_S (shared storage can hang). -> None, or why it could not be
    written (also said on stderr). Rank 0's verdict and a rank speaking for rank 0 both write through it."""
    if path:
        try:
            within(lambda: write_json_atomic(path, state, first), OUTPUT_S, f"writing --json {path}")
        except OSError as e:  # BoundPassed too
            why = e.strerror or str(e)
            emit(f"WARNING: could not write --json {path}: {why}", sys.stderr)
            return why
    return None


class Conclusion:
    """One verdict. run: the run's facts (Coordinator.snapshot): host, world, addr, port, records, host_of,
    gone (ranks found dead or frozen), serving, forged, authenticated, expect, env, the report's facts
    (verdict_state) and acks_s; args: the options (json, metrics, html, drain, drain_max, strict,
    save_manifest, manifest_data); client: a store client or None; progress(key, **kw) prints a progress line;
    failpoint(name, only) is the tests' fault injection; on_code(code) tells the caller the code as it stands
    (the verdict's own bound exits with it)."""

    def __init__(self, run, args, client, progress, failpoint, on_code):
        self.run, self.args, self.client = run, args, client
        self.progress, self.failpoint, self.on_code = progress, failpoint, on_code
        self.drain = None

    def give(self, found, code):
        """-> the exit code, decided once (decide: the outputs asked for are written first, and one that could
        not be is a FAIL of the verdict), then the report block with the run's one `Verdict:` line, then the
        code published on the store: every rank exits with it. After it only the drain's outcome and the
        manifest's lines follow (neither changes the code)."""
        run = self.run  # the run's hosts and its allocation's node count, for the gate's minority guard
        hosts = set(run["host_of"].values()) | {rec["host"] for rec in run["records"]}
        found = blame_gate(list(found) + self.side_channel(), hosts, run["expect"].get("nodes") or 0)  # the law
        st, text = self.decide(found, code)
        code = st["exit_code"]
        self.on_code(code)
        self.progress("verdict", verdict="PASS" if code == EXIT_PASS else "FAIL", code=code, counts=_counts(found))
        emit(text)  # the verdict's lines before anything slower (scontrol, the manifest, the acknowledgements)
        if self.client is not None:
            with contextlib.suppress(Exception):
                self.client.publish_verdict(code)
        if self.drain["mode"] == "on" and self.drain["hosts"]:
            self.drain, warns = drain_apply(self.drain)
            self.drain = dict(self.drain, pending=False)
            found += warns
            st = self.state(found, code)
            emit("\n".join(render_drain(self.drain) + [f"  [{f['status']}] {f['check']}: {f['reason']}"
                                                       for f in warns]))
            self.write_files(st)  # the drain's outcome into the files; one that fails now is said on stderr
        if getattr(self.args, "save_manifest", None):  # after the report and the JSON: shared storage may be slow
            before = len(st["findings"])
            note_manifest_save(self.args, st)  # manifest: --save-manifest, on a PASS only (its WARNs accepted)
            emit("\n".join([f"  [{f['status']}] {f['check']}: {f['reason']}" for f in st["findings"][before:]]
                           + [f"  NOTE: {n}" for n in st.get("notes") or []]))
            write_json_within(self.args.json, st)
        if self.client is not None:
            self.wait_acks(code)
        return code

    def decide(self, found, code):
        """The verdict, whole: the drain planned, the report rendered, the files asked for written (each within
        OUTPUT_S). A file that could not be written is an `output` FAIL (never a silent exit 0): the report is
        rendered again with it, and the files that were written are written again, so that they say what the
        log says. -> (state, the report's text). `found` grows with what it adds."""
        st, text = self.report(found, code)
        if self.drain["hosts"] and drain_blocker(found):  # the report itself failed: the tool's error
            st, text = self.report(found, st["exit_code"])
        failed = set()
        self.failpoint("files", only=("pause",))  # the tests' slow shared storage
        for _ in range(2):  # the files, then once more those written, when one could not be
            unwritten = self.write_files(st, skip=failed)
            if failed and not unwritten:
                break
            found += [finding("output", "FAIL", f"--{flag} {path} could not be written: {why}; the verdict is in "
                              "this log (fix the path or its storage)") for flag, path, why in unwritten]
            failed |= {flag for flag, _, _ in unwritten}
            if not failed:
                break
            st, text = self.report(found, code)
            self.on_code(st["exit_code"])  # the verdict's own bound, should the second writes not finish
        return st, text

    # ---------------------------------------------------------------- the state and the report
    def state(self, found, code):
        return verdict_state(dict(self.run, elapsed_s=elapsed()), found, verdict_code(found) or code, self.drain)

    def report(self, found, code):
        """The drain planned, then -> (state, the report's text). A report that cannot be rendered is an
        `internal` FAIL (added to `found`): its text is the `Verdict:` line and the FAILURE lines alone."""
        try:
            self.drain = self.plan_drain(found, verdict_code(found) or code)
            self.failpoint("report", only=("raise",))
            st = self.state(found, code)
            return st, render_report(st)
        except Exception as e:
            print_traceback(e)
            found.append(internal_finding(e, f"rank 0 on {self.run['host']}, rendering the report"))
            self.drain = self.plan_drain(found, verdict_code(found) or code)
            st = self.state(found, code)
            return st, "\n".join([f"Verdict: {st['verdict']} exit={st['exit_code']} (the report could not be "
                                  "rendered: the lines below)"] + failure_lines(found))

    def plan_drain(self, found, code):
        """--drain at the verdict (drain_plan, pure): what to drain, or why nothing; run once the verdict's lines
        are out (drain_apply, bounded by DRAIN_S), its WARN joining the findings, the verdict unchanged."""
        run = self.run
        nodes = run["expect"].get("nodes") or len({rec["host"] for rec in run["records"]}) or 1
        plan = drain_plan(found if code != EXIT_PASS else [], self.args.drain, nodes, run["env"].get("SLURM_JOB_ID"),
                          self.args.drain_max)
        return dict(plan, pending=plan["mode"] == "on" and bool(plan["hosts"]))

    # ---------------------------------------------------------------- the side channel's audit
    def side_channel(self):
        """The side channel's findings: every value refused (judge_forged), connections from outside the run's
        nodes (judge_store_peers), and whether the channel was authenticated."""
        run, strict = self.run, self.args.strict
        master, forged = f"{run['addr']}:{run['port']}", list(run["forged"])
        if self.client is not None:
            ranks, hosts = sorted(run["host_of"]), sorted(set(run["host_of"].values()))
            forged = bounded(lambda: self.client.clone().audit(ranks, hosts), AUDIT_S) or forged  # its own connection
        out = judge_forged(forged, master)
        if run["serving"] and run["records"]:
            allowed = {a for rec in run["records"] for a in rec.get("addrs") or ()}
            peers = {ip for ip in store_peers(run["port"]) or () if not ipaddress.ip_address(ip).is_loopback}
            out += apply_strict(judge_store_peers(peers, allowed, run["authenticated"], master), strict)
        if run["records"] and not forged:
            nodes = len({rec["host"] for rec in run["records"]})
            out += apply_strict(judge_channel(run["authenticated"], nodes, master), strict)
        return out

    # ---------------------------------------------------------------- the files
    def write_files(self, st, skip=()):
        """--json, then --metrics and --html (but those in `skip`), each within OUTPUT_S. -> [(flag, path, why)]
        of those that could not be written (each also said on stderr); a page that cannot be rendered is the
        tool's error, and counts as not written."""
        out = []
        why = write_json_within(self.args.json, st) if "json" not in skip else None
        if why:
            out.append(("json", self.args.json, why))
        for dest, render in (("metrics", render_metrics), ("html", render_html)):
            path = getattr(self.args, dest, None)
            if not path or dest in skip:
                continue
            try:
                text = render(st)
            except Exception as e:  # the tool's own error: said, and the output counts as not written
                print_traceback(e)
                out.append((dest, path, f"the tool could not render it ({first_line(e)} in {where_raised(e)})"))
                continue
            try:
                within(lambda p=path, t=text: write_text_atomic(p, t), OUTPUT_S, f"writing --{dest} {path}")
            except OSError as e:  # BoundPassed too
                emit(f"WARNING: could not write --{dest} {path}: {first_line(e)}", sys.stderr)
                out.append((dest, path, e.strerror or first_line(e)))
        return out

    # ---------------------------------------------------------------- the acknowledgements
    def listeners(self):
        """Who will acknowledge the verdict: (ranks, how many). After the roll call the live ranks; before it
        (None, the number that checked in so far): each has a listener on the verdict key."""
        run = self.run
        if run["host_of"]:
            ranks = [r for r in run["host_of"] if r and r not in run["gone"]]
            return ranks, len(ranks)
        return None, max(0, bounded(lambda: self.client.count("arrived"), STORE_OP_S, 1) - 1)

    def wait_acks(self, code):
        """Keep the store up until every listener acknowledged (their sealed ack/<rank>; the counter only wakes
        the check), within the acks' bound. A verdict written over from outside is put back at once."""
        (ranks, n), end, polls = self.listeners(), time.monotonic() + self.run["acks_s"], 0
        client = self.client
        while n > 0 and time.monotonic() < end:
            try:
                if client.count("acks") >= n and (ranks is None or client.acked(ranks)):
                    return
                polls += 1
                if polls % 5 == 0 and not client.verdict_holds(code):
                    client.publish_verdict(code)
                    emit(f"WARNING: rendezvous: the verdict key at {self.run['addr']}:{self.run['port']} was written "
                         "over from outside the job after the verdict; rank 0 put its own back (no rank takes a "
                         "forged code)", sys.stderr)
            except Exception:
                return
            time.sleep(0.02)



# ============================================================================ aiv/screen/run.py
# Floor 5 (runtime): the performance screen on the ranks: the collectives the screen loop asks for.
class ScreenRunner:
    """Every rank's part of the performance screen (SCREEN_PHASES): its own device measurement, and in
    screen-net each batch's part: its group made (when new), the batch's start gate, its group's all_reduce
    busbw, its post. Mixed into RankRun: the plumbing it uses (store, watchdog, deadlines, devices) is the
    rank's; the roles add screen_together (the gate) and phase_screen_net."""

    def phase_screen_gpu(self):
        """Every rank at once: its device's matmul and memory-copy speed, and on GPU the facts read under
        load, posted on the store."""
        self.failpoint("screen-gpu")
        row = None
        if self.bg.gpu is not None:  # measured on its own thread since the local checks (start_screen_gpu)
            with contextlib.suppress(HostStarved):  # the rank's own threads held the interpreter: again, below
                row = take_screen_gpu(self.bg.gpu)
            with self.state_lock:
                self.times["gpu_measure"] = self.bg.gpu["secs"]
        if row is None:  # CPU ranks (their own CPU clock), or a starved measuring thread: on a quiet process
            row = self.measure_quiet()
        self.proto.screen_post("gpu", self.rank, row, self.world)
        self.failpoint("done-screen-gpu")

    def screen_batch(self, e):
        """This rank's part of one batch: e = {'name', 'key', 'g': its group's ranks or None, 'rail', 'make':
        the batch's group creation (screen_rank_plans' entry) or None when every group exists}. Every rank
        posts, also outside any group, so that rank 0 sees who finished the batch."""
        name, made = e["name"], 0.0
        if e.get("make"):
            group, made = self.screen_group(name, e["make"], e["key"])
            if e["make"].get("g"):
                self.my_groups[tuple(e["make"]["g"])] = group
        self.round_gate(name)
        post = {"split_s": round(made, 3)}
        if e.get("gpu"):  # measured again: a slow GPU is named only when slow again
            post["gpu"] = None  # the interpreter starved: the first measurement stands alone (named once)
            with contextlib.suppress(HostStarved):
                post["gpu"] = self.measure_quiet()
        if e.get("g"):
            with self.issuing("all_reduce (busbw)", e["g"]):
                bw, sec = screen_busbw(self.torch, self.dist, self.my_groups[tuple(e["g"])], len(e["g"]),
                                       self._device(), self._kind())
            post.update(busbw=float(f"{bw:.4g}"), time_us=round(sec * 1e6, 1))
            if e.get("rail") is not None and self.nccl:
                post["hca"] = self.nccl.hca_since_last()  # this pair's connections, from NCCL's log
        self.proto.screen_post(name, self.rank, post, self.world)

    def measure_quiet(self):
        """This rank's device measured (again) on a quiet process, its background work done first (HostStarved
        when the interpreter was starved all the same)."""
        self.quiesce()
        g = self.identity.get("gpu") or {}
        return screen_measure_gpu(self.torch, self._device(), self._kind(), g.get("uuid"), g.get("pci"),
                                  self.args.sysfs_root)

    def round_gate(self, name):
        """Every rank starts `name` together (the soak's load, a screen batch): this rank posts that it is
        ready, then the role's screen_together (rank 0 opens the gate once every rank is ready)."""
        self.proto.screen_post(f"{name}-ready", self.rank, {}, self.world)
        self.screen_together(name)

    def screen_group(self, name, entry, key):
        """(this rank's new group of the batch or None, seconds its creation took). One creation per batch
        with new groups: on NCCL one collective call of every rank splits the world (split_group;
        new_subgroups_by_enumeration before torch 2.6); on gloo only the members meet (new_group with local
        synchronisation), and a rank in no new group makes a group of itself, so that every rank's count of
        groups (part of torch's hashed group names) stays equal. Groups are kept, never destroyed: a
        destroy can hang on a broken peer, and the process ends soon after."""
        mine, dist, t = entry.get("g"), self.dist, time.monotonic()
        if entry["mode"] != "split":
            return (dist.group.WORLD if entry["mode"] == "world" else None), 0.0
        kw = {"timeout": datetime.timedelta(seconds=self.bound.seconds + TORCH_BACKSTOP_S)}  # our bound fires first
        if self.backend != "nccl":
            with self.issuing("new_group", mine or [self.rank], seq=0):
                group = dist.new_group(mine or [self.rank], use_local_synchronization=True, **kw)
        elif can_split(self.torch, dist):
            import inspect
            params = inspect.signature(dist.split_group).parameters
            with self.issuing("split_group"):
                group = dist.split_group(split_ranks=[mine or entry["other"]],
                                         **{k: v for k, v in kw.items() if k in params})
        else:
            every = self.proto.screen_plan(key, "all", self.screen_left())[name]
            with self.issuing("new_subgroups_by_enumeration"):
                group = dist.new_subgroups_by_enumeration(every, **kw)[0]
        if group is not None and (mine or self.backend != "nccl"):  # torch's name of it: its flight recorder's
            self.issued.names[group.group_name] = group_key(mine or [self.rank])
        self.screen_groups.append(group)
        made = time.monotonic() - t
        with self.state_lock:
            self.times[f"groups-{name}"] = round(made, 3)
        return (group if mine else None), made

    def screen_left(self):
        """Seconds this rank still waits within the phase's bound + its role's grace (the others: counted from
        rank 0's gate, + RANK0_GRACE)."""
        return self.bound.left(self.bound.grace)

    def _kind(self):
        return "gpu" if self.backend == "nccl" else "cpu"


class ScreenFollower:
    """Every rank but 0: the batches rank 0 publishes (screen/q<k>/<rank>), each run and posted, until
    rank 0 says the screen is done; then rank 0's gate (or its verdict, read by the listener)."""

    def phase_screen_net(self):
        self.failpoint("screen-net")
        for k in range(1, 1 << 20):
            e = self.proto.screen_plan(f"q{k}", self.rank, self.screen_left())
            if e.get("done"):
                break
            self.screen_batch(e)
        self.proto.wait_gate("screen", self.screen_left())

    def screen_together(self, name):
        """Every group of a batch starts together: wait for rank 0's gate (it opens it once every rank posted
        that its group is made)."""
        self.proto.wait_gate(f"round-{name}", self.screen_left() + NAMING_S)


class ScreenCoordinator:
    """Rank 0's part of the screen: the batches (screen_loop, each through measure()), the collection of
    every rank's posts within the phase's bound, the screen's judgement, and who did not finish."""

    def phase_screen_gpu(self):
        """Rank 0 also collects every rank's GPU row."""
        t = time.monotonic()
        self.screen_start()
        super().phase_screen_gpu()
        rows = screen_gpu_rows(self.records, self.screen_collect(["gpu"])["gpu"], self.screen["cpu"])
        with self.state_lock:
            self.screen["gpu"] = rows
        tf, hb = [r["tflops"] for r in rows], [r["hbm_gbps"] for r in rows]
        self.progress("screen_gpu", n=len(rows), what="CPU rank(s)" if self.screen["cpu"] else "GPU(s)",
                      tflops=f"{min(tf):.2f}/{_screen_median(tf):.2f}", hbm=f"{min(hb):.1f}/{_screen_median(hb):.1f}",
                      secs=time.monotonic() - t)

    def screen_start(self):
        a = self.args
        self.screen_rounds = {"screen-net": []}
        self.screen_made = set()
        screen = {"cpu": self.backend != "nccl", "min_tflops": a.min_tflops, "min_hbm": a.min_hbm,
                  "min_busbw_intra": a.min_busbw_intra, "min_busbw_inter": a.min_busbw_inter,
                  "gpu": [], "intra": [], "pairs": [], "splits": {}}
        why = split_problem(self.torch, self.dist) if self.backend == "nccl" else None
        if why:  # named in the report and the JSON (screen_degraded_note), never chosen silently
            screen["no_split"] = {"why": why, "groups": 0}
        with self.state_lock:
            self.screen = screen

    def phase_screen_net(self):
        """The network screen: screen_loop decides every batch (intra-node, the pair rounds, re-measurements
        beside known-good nodes, the suspect round, the localisation inside a slow node); each runs through
        screen_measure. Then the screen's judgement: a FAIL ends the run before the full-job collectives."""
        t, a = time.monotonic(), self.args
        self.failpoint("screen-net")
        self.gpu_remeasure()
        net = screen_loop(self.records, self.screen_measure, a.min_busbw_intra, a.min_busbw_inter, self.screen["cpu"])
        full = dict(self.screen, **net)
        judged = screen_judged_against(full, screen_band_names(a.manifest_data, self.records, full))  # no --manifest:
        # no band, said as such
        bands = screen_band_lines(a.manifest_data, self.records, full) if a.manifest_data else None
        with self.state_lock:  # the page draws each band's FAIL line beside the screen's own
            self.screen.update(net, judged_against=judged, **({"bands": bands} if bands is not None else {}))
        rounds = self.screen_rounds["screen-net"]
        self.proto.screen_publish(f"q{len(rounds) + 1}", {r: {"done": True} for r in range(self.world)})
        found = apply_strict(judge_screen(self.screen) + judge_gpu_facts(self.screen.get("gpu")), a.strict)
        self.findings += found
        self.progress("screen_net", detail=self.net_detail(), counts=_counts(found), secs=time.monotonic() - t)
        if verdict_code(self.findings):
            raise Verdict(verdict_code(self.findings))
        self.proto.open_gate("screen")

    def gpu_remeasure(self):
        """The GPUs the screen found slow (gpu_suspects) measured again, all at once in one batch, before any is
        named: their rows merged (gpu_remeasured: the better value counts, 'tries' 2)."""
        sc = self.screen
        suspects = gpu_suspects(sc.get("gpu"), sc, sc["cpu"])
        if not suspects:
            return
        posts = self.screen_measure([{"batch": "gpu-again", "ranks": [r], "nodes": [self.host_of.get(r, "?")],
                                      "rail": None, "gpu": True} for r in suspects])
        rows = gpu_remeasured(sc["gpu"], {r: (posts.get(r) or {}).get("gpu") for r in suspects})
        with self.state_lock:
            sc["gpu"] = rows

    def screen_measure(self, groups):
        """screen_loop's measure(): the batch's groups published on the store (each rank its part under
        screen/q<k>/<rank>), rank 0's own part run, every rank's post collected. -> {rank: post}."""
        rounds, name = self.screen_rounds["screen-net"], groups[0]["batch"]
        rounds.append((name, groups))  # for screen_stuck: the batches in the order they run
        key = f"q{len(rounds)}"
        new = [g for g in groups if tuple(g["ranks"]) not in self.screen_made and not g.get("gpu")]
        self.screen_made |= {tuple(g["ranks"]) for g in new}
        make = screen_rank_plans([(name, new)], self.world) if new else {}
        if new and self.screen.get("no_split"):
            with self.state_lock:
                self.screen["no_split"]["groups"] += screen_split_groups([(name, new)], self.world)
        if new and self.backend == "nccl" and not can_split(self.torch, self.dist):  # every rank enumerates them
            self.proto.screen_publish(key, {"all": {name: [g["ranks"] for g in new]}})
        mine = {r: g for g in groups for r in g["ranks"]}
        plans = {r: {"name": name, "key": key, "g": mine[r]["ranks"] if r in mine else None,
                     "rail": mine[r]["rail"] if r in mine else None, "make": make[r][name] if make else None}
                 for r in range(self.world)}
        for r, g in mine.items():
            if g.get("gpu"):  # a device measured again, no group: screen_batch's gpu_again
                plans[r].update(g=None, gpu=True)
        self.proto.screen_publish(key, plans)
        self.screen_batch(plans[0])
        return self.screen_collect([name])[name]

    def screen_together(self, name):
        """Every group of a batch starts together: once every rank has posted that its group is made (within
        the phase's bound, else it names the batch's groups), rank 0 opens the gate."""
        self.screen_wait(f"{name}-ready")
        self.failpoint(f"round-{name}")  # a test holds the run here (pause=S) between two batches
        self.proto.open_gate(f"round-{name}")

    def screen_collect(self, names):
        """Every rank's posts of the batches, waited for within the phase's bound. A batch left incomplete
        ends the run here, naming its groups (as the watchdog does when rank 0 is itself blocked in one)."""
        out = {}
        for name in names:
            self.screen_wait(name)
            out[name] = self.proto.screen_posts(name)
            made = screen_creation(self.round_groups().get(name) or [], out[name])
            if made:
                with self.state_lock:
                    self.screen["splits"][name] = made
        return out

    def screen_wait(self, name):
        """Every rank's post of `name` (a batch, the soak) within the phase's bound, else the run ends here naming
        who did not post."""
        if not self.proto.screen_wait(name, self.screen_left()):
            raise Verdict(EXIT_TIMEOUT, [self.unfinished(self.phase, self.proto, self.bound.cause())])

    def round_groups(self):
        return dict(r for rs in self.screen_rounds.values() for r in rs)

    def screen_unfinished(self, phase, client, cause, live, errors, silent, stamps, issued=None):
        """A screen phase that did not finish: (the finding naming the groups whose members did not post a
        batch, or None; the stamps for judge_unfinished, where a post of the GPU round counts as finishing
        it: rank 0 posts before it waits for the others)."""
        if phase == "screen-gpu":
            return None, finished_by(stamps, client.screen_posts("gpu"), phase)
        rounds = self.screen_rounds.get(phase) or []
        posted = {n: self.round_posted(client, n) for n, _ in rounds}
        how = cause[len(PHASE_WHAT[phase]):].strip() if cause.startswith(PHASE_WHAT[phase]) else cause
        return screen_stuck(phase, how, self.world, rounds, posted, self.host_of, live, errors, silent, issued), stamps

    def round_posted(self, client, name):
        """Ranks that did their part of a batch: posted it, or, while the batch's start gate is not complete,
        posted that their group was made (they wait at the gate for the others, not stuck themselves)."""
        ready = set(client.screen_posts(f"{name}-ready"))
        return set(client.screen_posts(name)) | (ready if len(ready) < self.world else set())

    def net_detail(self):
        """The screen-net progress line: batches, the intra-node and the inter-node measurements."""
        sc, batches = self.screen, self.screen.get("batches") or []
        intra, pairs = sc.get("intra") or [], sc.get("pairs") or []
        made = sum(sc["splits"].values())
        parts = [f"{len(batches)} batch(es)"]
        if intra:
            bws = [r["busbw"] for r in intra if r.get("busbw") is not None] or [0.0]
            parts.append(f"intra-node {len(intra)} node(s), busbw min/median {min(bws):.2f}/{_screen_median(bws):.2f}"
                         " GB/s")
        else:
            parts.append("no node runs two or more ranks")
        if pairs:
            bws = [r["busbw"] or 0.0 for r in pairs]
            rnds = len({r["round"] for r in pairs})
            parts.append(f"inter-node {len(pairs)} group measurement(s) in {rnds} round(s), busbw min/median "
                         f"{min(bws):.2f}/{_screen_median(bws):.2f} GB/s")
        else:
            parts.append("one node: no pairs between nodes")
        third = sc.get("third") or {}
        if third.get("groups"):
            parts.append(f"round 3 for suspect(s) {', '.join(third['suspects'][:4])}")
        return "; ".join(parts) + f"; groups made in {made:.2f}s"



# ============================================================================ aiv/run/setup.py
# Floor 5 (runtime): a rank's set-up before the roll call and a node leader's work beside the phases
def _torch_older_than(version):
    """Whether the torch this python would import is older than version ((major, minor)), read from its
    metadata without importing it; unknown: True (the older torch's variable is set too, at worst a warning)."""
    try:
        from importlib.metadata import version as installed
        m = re.match(r"(\d+)\.(\d+)", installed("torch"))
    except Exception:  # noqa: BLE001 - no metadata, a torch on PYTHONPATH: unknown
        return True
    return m is None or (int(m.group(1)), int(m.group(2))) < version


def own_variables(env, older_than_2_6):
    """What a rank sets in its own environment where `env` (its environment at its start) leaves it unset:
    one FAILURE line rather than a C++ trace per retry; torch's error handling that aborts the communicator and
    raises rather than killing the process (torchrun's default, 1, kills rank 0 before its verdict; an
    operator's own setting outside torchrun is kept); torch's flight recorder (what each rank issued), under
    its second name too for a torch before 2.6, whose ProcessGroupNCCL reads only that one (a later torch
    warns on every rank that it is deprecated)."""
    out = {} if "TORCH_CPP_LOG_LEVEL" in env else {"TORCH_CPP_LOG_LEVEL": "FATAL"}
    if "TORCH_NCCL_ASYNC_ERROR_HANDLING" not in env or (
            under_torchrun(env) and env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1"):
        out["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = "2"
    if not any(v in env for v in ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE")):
        out["TORCH_FR_BUFFER_SIZE"] = "2000"
        if older_than_2_6:
            out["TORCH_NCCL_TRACE_BUFFER_SIZE"] = "2000"
    return out


@contextlib.contextmanager
def gc_paused():
    """Python's cycle collector off while a block imports torch: an import makes many objects and almost no
    garbage, so the collections it sets off find nothing (measured, a 2-core machine: `import torch` 7%
    less CPU, `torch._dynamo` 23% less: bench/import_gc.py). What garbage there is waits for the next
    collection after the block."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def ddp_imports():
    """What the DDP constructor pulls in lazily (torch._dynamo), imported with the collector paused."""
    with gc_paused():
        import torch._dynamo  # noqa: F401
        import torch.nn.parallel  # noqa: F401


def _warm_imports():
    """ddp_imports, while this rank waits on the network (an error there is the DDP step's to report)."""
    with contextlib.suppress(Exception):
        ddp_imports()


class RankSetup:
    """What a rank sets up before the roll call and keeps for the phases: its environment before torch, the
    local phase (phase_local: torch, the local checks, its device, its identity), its device as torch names
    it, and on a node leader the node's facts, the import probe and the liveness monitor. Mixed into
    RankRun: the state it fills (identity, backend, device, bg) is the rank's."""

    def own_environment(self):
        """Every variable this rank sets in its own environment, set at once as it starts, while it is the
        process's only thread (RankRun.__init__, before the watchdog): glibc's setenv may free the array that
        another thread's getenv is reading (a name lookup reads it; a library reads it as it loads), and that
        thread dies of SIGSEGV: a rank lost to the tool's own fault, then named as a node that did not check in.
        Where the backend may be NCCL (auto, nccl), NCCL's private log is made here too (NcclLog.capture);
        phase_local drops it once the backend is gloo. No temporary directory for that file is no crash here,
        before any verdict: phase_local raises it where the backend is NCCL (the tool's own error, naming nobody)."""
        os.environ.update(own_variables(self.env, _torch_older_than((2, 6))))
        self.nccl_unmade = None
        try:
            self.nccl = NcclLog.capture(self.args.backend, self.rank, self.env)
        except OSError as e:
            self.nccl, self.nccl_unmade = NcclLog(None, self.env), e

    def before_torch(self):
        """What a rank starts before it imports torch: its hello to rank 0's last call (so that rank 0 knows
        this process is up and reaches the store, however long its import takes)."""
        if self.rank != 0:
            threading.Thread(target=say_hello, args=(self.addr, self.port, launcher_store(self.env)[0], self.rank,
                                                     self.host, self.hello_stop, self.D["rollcall"], HELLO_RETRY_S),
                             name="aiv-hello", daemon=True).start()

    def phase_local(self):
        self.before_torch()
        self.progress("contract", rank=self.rank, world=self.world, how=self.c.get("how", self.c["source"]),
                      local_rank=self.local_rank, master=f"{self.addr}:{self.port}")
        if self.local_rank == 0:  # nice 19, idle I/O: it takes what the node's ranks leave (start_import_probe)
            self.bg.probe = start_import_probe()
        t = time.monotonic()
        try:
            with gc_paused():
                import torch
                import torch.distributed as dist
        except ImportError as e:  # this host's software, not the tool: rank 0 hears of it at once
            raise self.no_torch(e) from None
        self.torch, self.dist = torch, dist
        with self.state_lock:
            self.times["import_torch"] = round(time.monotonic() - t, 3)
        old = torch_floor_problem(torch.__version__)
        if old:  # before any store operation: the side channel needs what this torch lacks
            raise failed("local", f"{old} on {self.host} (rank {self.rank}, {sys.executable})", EXIT_FAIL,
                         [self.host], [self.rank], blame="own")
        if self.env.get("AIV_WARM_IMPORTS", "1") != "0":  # DDP's constructor imports torch._dynamo (1-7 s)
            self.bg.warm = threading.Thread(target=_warm_imports, name="aiv-warm-imports", daemon=True)
            self.bg.warm.start()
        ifaces, expected = list_interfaces(), gpus_expected(self.env, self.args.sysfs_root)
        local, gpu = self.local_checks(ifaces, expected)
        if self.nccl_unmade is not None and self.backend != "gloo":
            raise self.nccl_unmade
        self.nccl = self.nccl.for_backend(self.backend)  # a gloo rank keeps no file of NCCL's (own_environment)
        screen, numerics = not self.args.skip_screen, not self.args.skip_numerics
        if gpu is not None and (screen or numerics) and not any(f["status"] == "FAIL" for f in local):
            self.bg.gpu = start_screen_gpu(self.torch, self.device, gpu.get("uuid"), gpu.get("pci"),
                                           self.args.sysfs_root, screen=screen, numerics=numerics)
        if gpu is not None:  # the HCA a pair round names where NCCL's log does not say
            gpu["hca"] = nearest_hca(self.args.sysfs_root, gpu.get("pci"), self.env.get("NCCL_IB_HCA"))
        self.identity = {"rank": self.rank, "host": self.host, "hostname": socket.gethostname(),
                         "loopback": loopback_domain(),
                         "local_rank": self.local_rank, "backend": self.backend, "device": self.device,
                         "cvd": self.env.get("CUDA_VISIBLE_DEVICES"), "gpu": gpu,
                         "gpus_expected": expected or None,
                         "gloo": gloo_address(self.env, ifaces) if self.backend == "gloo" else None,
                         "cpus": format_ranges(_cpu_affinity()), "versions": torch_versions(torch),
                         "local": local, "pid": os.getpid(), "pid_start": (proc_stat(os.getpid()) or ("", ""))[1],
                         "addrs": sorted({norm_ip(a) for i in ifaces.values() for a in i["addrs"]} - {None})}
        if self.local_rank == 0:
            self.bg.node = {}
            self.helper("aiv-node-facts", self._collect_node, self.bg.node)
            self.bg.smi = start_node_smi()
        ifn = ",".join(v for v in ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME") if v in self.env) or "none set"
        dev = f"cuda:{self.device}" if self.device is not None else "cpu"
        self.progress("local", backend=self.backend, device=dev, ifaces=ifn,
                      failed=sum(f["status"] == "FAIL" for f in local), import_s=self.times["import_torch"])

    def no_torch(self, exc):
        """torch (or what it needs) cannot be imported here: the launch's environment (no venv, the wrong python),
        exit 2, no host named (judge_no_torch); the other ranks tell rank 0 through the store's wire, no torch
        needed (Follower.end), and rank 0 names a host only when it alone of several cannot (judge_no_torch)."""
        line = (f"rank {self.rank} ({self.host}): torch is not importable by {sys.executable}: {first_line(exc)}; "
                "run bootstrap_env.sh on this node or point the job at the shared venv (PYTORCH_ENV)")
        return Verdict(EXIT_USAGE, judge_no_torch({self.rank: {"line": line, "host": self.host}}, ()))

    def _device(self):
        return self.torch.device("cuda", self.device) if self.backend == "nccl" else self.torch.device("cpu")

    def local_checks(self, ifaces, expected):
        """Checks before any communication. Returns (findings, gpu facts or None). With --backend auto
        a rank that is expected to have GPUs (expected: gpus_expected's reason) but cannot use CUDA FAILs:
        never a CPU run."""
        import importlib.util
        torch, dist = self.torch, self.dist
        out, gpu, who = [], None, f"rank {self.rank} ({self.host})"
        if importlib.util.find_spec("numpy") is None:
            out.append(finding("local", "FAIL", f"numpy is not importable by {sys.executable} on {self.host} "
                               f"(object collectives need it: pip install numpy)", [self.host]))
        backend = self.args.backend
        if backend == "auto":
            backend = "nccl" if torch.cuda.is_available() else "gloo"
            if backend == "gloo" and expected:
                out.append(finding("device", "FAIL", f"{who}: GPUs expected ({expected}) but CUDA is unusable: "
                                   f"{cuda_problem(torch)}", [self.host]))
        self.backend = backend
        if backend == "nccl" and not torch.cuda.is_available():
            out.append(finding("device", "FAIL", f"{who}: --backend nccl but CUDA is unusable: "
                               f"{cuda_problem(torch)}", [self.host]))
        elif backend == "nccl" and not dist.is_nccl_available():
            out.append(finding("local", "FAIL", f"torch {torch.__version__} on {self.host} has no NCCL", [self.host]))
        elif backend == "nccl":
            gpu = self._take_gpu(out, who)
        elif not dist.is_gloo_available():
            out.append(finding("local", "FAIL", f"torch {torch.__version__} on {self.host} has no gloo", [self.host]))
        out += check_interfaces(self.env, ifaces, self.host)
        for f in out:
            f["ranks"] = [self.rank]
        return out, gpu

    def _take_gpu(self, out, who):
        torch = self.torch
        count = torch.cuda.device_count()
        dev = 0 if count == 1 else self.local_rank
        if dev >= count:
            out.append(finding("device", "FAIL", f"{who}: LOCAL_RANK={self.local_rank} but only {count} GPU(s) "
                               f"visible (CUDA_VISIBLE_DEVICES={self.env.get('CUDA_VISIBLE_DEVICES', 'unset')})",
                               [self.host]))
            return None
        try:
            torch.cuda.set_device(dev)
            self.device = dev
            return collect_gpu(torch, dev, self.args.sysfs_root)
        except CLUSTER_ERRORS as e:  # the tool's own error is raised: `internal`, never this GPU's fault
            out.append(finding("device", "FAIL", f"{who}: cuda:{dev} unusable: {first_line(e)}", [self.host]))
            return None

    def _collect_node(self, box):
        try:
            count = self.torch.cuda.device_count() if self.backend == "nccl" else 0
            box["facts"] = collect_node_facts(self.args.sysfs_root, self.torch, self.backend, count, self.env)
        except CLUSTER_ERRORS as e:
            box["error"] = first_line(e)
        except Exception as e:  # the tool's own error: raised where the facts are taken (node_facts)
            box["internal"] = e

    def import_results(self, wait_s=None):
        """Node leaders: the torchvision/torchaudio probe started at launch (usually done by now); taken once
        (the screen takes it early, so that it measures a quiet node), within half the phase's time left."""
        if self.bg.probe is None or self.bg.imports is not None:
            return self.bg.imports
        wait_s = min(IMPORT_PROBE_S, self.bound.left() / 2) if wait_s is None else wait_s
        t = time.monotonic()
        self.bg.imports = finish_import_probe(self.bg.probe, wait_s)
        with self.state_lock:
            self.times["imports"] = round(time.monotonic() - t, 3)
        return self.bg.imports

    def quiesce(self):
        """Before the screen measures: this rank's background work done (the DDP imports' thread; on a
        node leader the import probe and the node monitor's first post), each wait
        bounded by a quarter of the phase's bound. Small CPU machines feel them; GPU nodes hardly."""
        wait = self.bound.left() / 4
        if self.bg.warm is not None:
            self.bg.warm.join(timeout=wait)
        self.import_results(min(IMPORT_PROBE_S, wait))
        end = time.monotonic() + wait
        while self.bg.monitor is not None and time.monotonic() < end and self.bg.monitor.poll() is None:
            if "seq" in self.proto.live([self.host])[self.host]:
                break
            time.sleep(0.05)

    def start_monitor(self):
        """Node leaders: the liveness monitor of this node's ranks, a child process (node_monitor)."""
        ranks = self.proto.node_ranks(self.host)
        if ranks is None:  # refused (kept in forged, reported): no monitor posts on a list rank 0 did not write
            return
        cfg = {"addr": self.addr, "port": self.port, "prefix": self.proto.prefix, "host": self.host,
               "ranks": ranks, "period": live_period(self.master["nodes"]),
               "lifetime": worst_case(self.D, True, soak=bool(self.args.soak))}
        cfg["run"] = self.proto.run  # it posts into this run's store only, never into a later run's
        self.bg.monitor = subprocess.Popen([sys.executable, os.path.abspath(__file__)],
                                        env=dict(os.environ, _AIV_NODE_MONITOR=json.dumps(cfg)),
                                        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                        stderr=subprocess.DEVNULL)  # never holds the task's output open (srun)
        if self.beats:  # rank 0 sees its own node's ranks in /proc
            self.helper("aiv-beat", self.beat, cfg["period"])

    def beat(self, period):
        """A node leader's thread: the node's beat every liveness period, on a connection of its own. With
        the monitor's posts, the second sign that the node reaches the store: a node is unreachable only
        when both stop (settled_live). A store that went away ends it quietly (the run is ending, or rank 0
        is gone, which the phases name); the tool's own error is raised (helper: said in the report)."""
        with contextlib.suppress(*CLUSTER_ERRORS):
            client = self.proto.clone()
            while True:
                client.beat(self.host)
                time.sleep(period)



# ============================================================================ aiv/run/guard.py
# Floor 5 (runtime): what guards every rank's phases (RankGuard, mixed into RankRun): each phase under its
def speak_once_per_node(text, env, local_rank=0, topic="run"):
    """Lines a rank prints for itself or for rank 0 when rank 0 cannot: once per node. The first local
    rank (lowest first) to mark a node-local file keyed by job, step, launcher (the parent process all
    ranks of a node share under srun, torchrun and local mode: its pid and start time) and topic (the
    port, and the run's nonce once the roll call gave one), under an fcntl lock, prints; the others
    stay silent. A marker older than MARK_TTL never silences a later run. Returns whether this
    process printed."""
    time.sleep(min(max(local_rank, 0), 20) * 0.05)
    path = said_marker(env, topic, launch_key(os.getppid()))
    sweep_said()
    with contextlib.suppress(OSError, ValueError):  # no node-local coordination here: better a line twice than never
        fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)  # held for microseconds by whoever marks the file
            said = os.read(fd, 32).decode(errors="replace")
            if said and time.time() - float(said or 0) < MARK_TTL:
                return False
            os.lseek(fd, 0, os.SEEK_SET)
            os.write(fd, f"{time.time():.3f}".ljust(32).encode())  # older than MARK_TTL: another run's
        finally:
            os.close(fd)
    emit(text)
    return True


class RankGuard:
    """The plumbing around every phase of RankRun: deadline(phase) arms its Bound and turns an error inside
    into a Verdict; on_expire and on_signal hand a bound passed or a signal to the role (expire,
    signalled); exit() is every rank's way out. Mixed into RankRun: the state it uses (the bound, the
    watchdog, the store, the deadlines) is the rank's. The hooks with a default here: own_error,
    expire_failed; grace (what the role adds to a phase's bound before its watchdog speaks) and enter_phase (the
    start of each phase after the roll call: Coordinator opens its gate, Follower waits for it) are each role's."""

    # ---------------------------------------------------------------- each phase under its bound
    @contextlib.contextmanager
    def deadline(self, phase):
        """The phase under its one Bound (armed on entry, disarmed on the way out, the stamp inside): a
        torch error inside becomes this rank's Verdict, any other exception the tool's own (`internal`).
        Rank 0 speaks first in every phase: after the roll call every phase starts at a gate rank 0 opens
        (enter_phase), and the other ranks count their bound + RANK0_GRACE from that gate, however late
        rank 0 got there."""
        self.phase = phase
        self.failpoint(phase, only=("skew",))
        b = self.bound = Bound(self.wd, phase, self.D[phase], self.grace(phase))
        try:
            with b:
                if PHASES.index(phase) > PHASES.index("rollcall") and self.proto is not None:
                    self.enter_phase(b)
                self.failpoint(phase, only=("raise",))
                yield b
                with self.state_lock:
                    self.times[phase] = round(time.monotonic() - b.start, 3)
                    self.starts[phase] = round(b.start - _T0, 3)
                if self.proto is not None:  # under the bound: rank 0's store may have frozen meanwhile
                    self.proto.stamp(self.rank, phase)
        except Verdict:
            raise
        except Exception as e:
            raise self.phase_error(phase, e) from None
        finally:
            with self.state_lock:
                self.times.setdefault(phase, round(time.monotonic() - b.start, 3))
                self.starts.setdefault(phase, round(b.start - _T0, 3))

    def phase_error(self, phase, exc):
        """An error inside a phase. The tool's own (is_tool_error): the `internal` verdict, no host. A torch
        error: posted on the store, then the role's own_error."""
        if is_tool_error(exc):
            return self.internal_error(phase, exc)
        line = f"rank {self.rank} ({self.host}): {PHASE_WHAT[phase]} failed: {first_line(exc)}"
        code = EXIT_TIMEOUT if re.search(r"[Tt]imed? ?out|timeout", str(exc)) else EXIT_FAIL
        if self.proto is not None:
            with contextlib.suppress(Exception):
                self.proto.report_error(self.rank, phase, line, code)
        return self.own_error(phase, line, code)

    def own_error(self, phase, line, code):
        """A rank's own torch error in a phase: its host, its rank (rank 0 overrides this once it can name
        who did not finish the phase)."""
        return failed(PHASE_CHECK[phase], line, code, [self.host], [self.rank], blame="own")

    def internal_error(self, phase, exc):
        """The tool's own error in a phase: posted (so that rank 0 blames nobody for it), then a Verdict."""
        print_traceback(exc)
        f = internal_finding(exc, f"rank {self.rank} on {self.host}, during {phase}")
        if self.proto is not None:
            with contextlib.suppress(Exception):
                self.proto.report_error(self.rank, phase, f"rank {self.rank} ({self.host}): {f['reason']}",
                                        EXIT_INTERNAL, internal=True)
        return Verdict(EXIT_INTERNAL, [f])

    # ---------------------------------------------------------------- bounds, signals, the way out
    def on_expire(self, phase):
        """The watchdog's bound passed (the role's expire). Never lets the bound itself fail: the tool's own
        error here still ends the process with `internal`."""
        try:
            self.expire(phase)
        except BaseException as e:
            print_traceback(e)
            self.expire_failed(phase, e)
            self.exit(EXIT_INTERNAL)

    def expire_failed(self, phase, exc):
        """The tool's own error at a bound: rank 0 gives the `internal` verdict; the others just exit 4."""

    def expiry_cause(self, phase):
        if phase == "rollcall" and self.proto is None:  # still connecting to the store
            return self.unanswered(self.D[phase])
        return Bound(None, phase, self.D[phase]).cause()

    def unanswered(self, seconds):
        """Why the store's connect did not finish: a listener that accepts but never answers, or none."""
        try:
            socket.create_connection((self.addr, self.port), timeout=PROBE_CONNECT_S).close()
        except OSError:
            return f"cannot reach the master {self.addr}:{self.port}: no store answered within {seconds:g}s"
        return (f"something on MASTER_PORT ({self.addr}:{self.port}) accepts connections but does not answer as "
                f"the job's store (no answer within {seconds:g}s): another service or a stale process holds "
                f"the port; pick a free MASTER_PORT")

    def on_signal(self):
        """SIGTERM or SIGINT: scancel, the time limit, preemption, a launcher (torchrun, when another worker
        died), Ctrl-C. main() blocked both in every thread before this object existed; this thread takes
        them and hands them to the role (signalled)."""
        signum = signal.sigwait({signal.SIGTERM, signal.SIGINT})
        self.signal_seen = signum
        self.signalled(signum, signal.Signals(signum).name, self.phase)

    def speak_for_node(self, text):
        run = getattr(self.proto, "run", None) or ""  # the roll call's nonce: this run, not an earlier one
        return speak_once_per_node(text, self.env, self.local_rank, f"{self.port}-{run}")

    def exit(self, code):
        """Flush and leave without interpreter teardown (gloo threads can SIGABRT there). Every way out of a
        rank passes here: its NCCL WARN lines are relayed first (NcclLog.relay)."""
        self.bg.stop()
        who = f"rank {self.rank} ({self.host}): "
        self.nccl.relay(who)
        self.nccl.close(code != EXIT_PASS, who)
        flush_all()
        os._exit(code)

    # ---------------------------------------------------------------- helpers of the phases
    def failpoint(self, phase, only=("die", "hang", "pause")):
        """Test-only fault injection: AIV_FAILPOINT=<kind>:<phase>:<rank>[,...], kinds:
          die, hang, pause=S  SIGKILL, SIGSTOP or an S-second pause of this rank where it reaches <phase>
                              (rendezvous, init, telemetry, screen-gpu, screen-net, soak, collective, ddp;
                              round-<name>: rank 0 before it opens a screen batch's gate, e.g. round-p2;
                              done-<phase>: after the rank posted its own part of telemetry, screen-gpu or
                              ddp, while the others may still work in it; files: rank 0's verdict, before
                              it writes the files asked for: slow storage); a pause first creates the file
                              AIV_FAILPOINT_MARK, if set, so that a test breaks something (a link) while the
                              run waits
          stall=S             an S-second pause right before the rank issues its first collective of <phase>
                              (init, screen-net, collective, ddp, bandwidth: alive, never issuing it), marked
                              like a pause
          wedge=S             the same pause inside that call, after the rank's own "about to issue" record
                              and before its backend sees the call (a rank stuck in a driver call or a lazy
                              communicator set-up), marked like a pause
          raise               the tool's own error (AssertionError) at the start of a phase of PHASES, in
                              the verdict's report (<phase> = report), at the verdict's start (verdict:
                              rank 0 only, outside the report's own guard), or in a helper thread
                              (helper-<name>, e.g. helper-aiv-listener)
          skew=S              an S-second sleep before the rank enters a phase of PHASES (late start)"""
        for item in filter(None, self.env.get("AIV_FAILPOINT", "").split(",")):
            m = re.fullmatch(r"(die|hang|raise|(pause|skew|stall|wedge)=(\d+)):([\w-]+):(\d+)", item)
            if not (m and m.group(4) == phase and int(m.group(5)) == self.rank and (m.group(2) or m.group(1)) in only):
                continue
            flush_all()
            if m.group(1) == "raise":
                raise AssertionError(f"failpoint {item}")
            if m.group(3) is None:
                os.kill(os.getpid(), signal.SIGKILL if m.group(1) == "die" else signal.SIGSTOP)
            if m.group(2) in ("pause", "stall", "wedge") and self.env.get("AIV_FAILPOINT_MARK"):
                with open(self.env["AIV_FAILPOINT_MARK"], "w") as f:
                    f.write(f"{phase} {self.rank}\n")
            time.sleep(int(m.group(3)))

    def helper(self, name, fn, *args):
        """Start a helper thread. One that dies of an exception says so: on stderr at once, and in the
        report as a WARN `internal` (rank 0's own at the verdict, the others' with their results)."""
        def run():
            try:
                self.failpoint("helper-" + name, only=("raise",))
                fn(*args)
            except BaseException as e:
                self.helper_died(name, e)
        threading.Thread(target=run, name=name, daemon=True).start()

    def helper_died(self, name, exc):
        self.helper_errors.append(f"{name} stopped: {first_line(exc)} in {where_raised(exc)}")
        emit(f"rank {self.rank} ({self.host}): WARNING: helper thread {name} stopped: {first_line(exc)}", sys.stderr)
        print_traceback(exc)



# ============================================================================ aiv/run/rank.py
# Floor 5 (runtime): RankRun, what every rank runs: the phases in order, each under its bound.
PROGRESS = {
    "contract": "contract: rank {rank} of {world}, local_rank {local_rank}, master {master}; {how}",
    "local": "local: backend {backend}, device {device}, interfaces checked: {ifaces}, {failed} local check(s) "
             "failed (import torch {import_s:.2f}s)",
    "rollcall_open": "rendezvous: store at {master}, roll call of {world} rank(s) within {seconds:g}s",
    "rollcall": "rendezvous: {present}/{world} rank(s) checked in ({secs:.2f}s); pre-init checks (layout, "
                "GPU affinity, device, local) {result}",
    "init": "init: {backend} process group of {world} ready ({secs:.2f}s)",
    "telemetry": "telemetry: gathered from {ranks} rank(s), max {size} B per rank ({secs:.2f}s); node checks: "
                 "{counts}",
    "collective": "collective: all_reduce of rank-encoded integers on {world} rank(s) ({secs:.2f}s)",
    "ddp": "ddp: DDP step on nn.Linear(10, 10), results gathered ({secs:.2f}s)",
    "bandwidth": "bandwidth: {size} all_reduce {us:.1f} us, algbw {algbw:.2f} GB/s, busbw {busbw:.2f} GB/s",
    "screen_gpu": "screen-gpu: {n} {what}: matmul {tflops} TFLOPS, memory copy {hbm} GB/s (min/median) ({secs:.2f}s)",
    "screen_net": "screen-net: {detail}; screen findings: {counts} ({secs:.2f}s)",
    "soak": "soak: {n} {what} loaded at once for {seconds:g}s: {detail}; soak findings: {counts} ({secs:.2f}s)",
    "verdict": "verdict: {verdict} (exit {code}); findings: {counts}",
}


HEADER = (BAR, "ai-infra-validator {version} ddp_mesh_ping  {started}  host={host}", "Total Execution Ranks: {world}",
          "Master: {master} ({port_from})  launch: {launch}  deadlines: roll call {rollcall:g}s, each later phase "
          "{timeout:g}s  expect: {expect}", BAR)


class RankRun(RankSetup, RankGuard, ScreenRunner):
    """What every rank runs: the phases of PHASES in order, each under deadline(phase), and the plumbing
    they share. The two roles are subclasses (rank_run picks one):

      Coordinator  rank 0: serves the store, holds the roll call, judges every phase, owns the verdict
                   (the report, the JSON, the exit code published on the store)
      Follower     every other rank: reports its own error (if any) and exits with rank 0's code, which
                   a listener thread reads even while the main thread is blocked in a collective; speaks
                   for rank 0 when rank 0 gives no verdict in time

    Every way a run ends goes through Verdict and end(). The hooks a role defines: end, grace,
    enter_phase, own_error, open_store, before_check_in, after_check_in, phase_telemetry,
    results_gathered, phase_final, expire, signalled, progress, header."""

    on_tick = None  # the Coordinator's liveness tick; the others have none
    beats = True  # a node leader beats for its node (rank 0 reads its own node's ranks from /proc)

    def __init__(self, args, contract, env):
        self.args, self.c, self.env = args, contract, env
        self.rank, self.world, self.local_rank = contract["rank"], contract["world_size"], contract["local_rank"]
        self.host = node_name(env)
        self.addr, self.port = contract["master_addr"], contract["master_port"]
        self.D = deadlines(args.timeout, args.rollcall_timeout, args.soak)
        self.expect = dict(launcher_expectations(env), **{k: getattr(args, "expect_" + k) for k in
                                                       ("world_size", "nodes", "ranks_per_node")
                                                       if getattr(args, "expect_" + k) is not None})
        self.started_at = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
        self.phase, self.times, self.findings, self.records, self.host_of = "local", {}, Findings(), [], {}
        self.state_lock = threading.RLock()  # what the verdict copies (Coordinator.snapshot) is written under it
        self.starts = {}  # phase -> seconds from start
        self.proto = self.poll = self.master = None
        self.backend = self.device = self.results = self.bandwidth = self.identity = None
        self.bg = Background()  # work off the main thread
        self.issued, self.stalled, self.wedged = Issued(), set(), set()  # what this rank issued last (issuing)
        self.screen_groups = []  # the screen's groups this rank made (kept, never destroyed)
        self.my_groups = {}  # a group's ranks -> this rank's group (re-measured with the same group)
        self.seal = Seal(job_secret(env), run_base(env))  # every value on the store, signed with the job's secret
        self.helper_errors = []  # helper threads that died: "<name> stopped: <why>" (helper)
        self.signal_seen = None  # SIGTERM or SIGINT, once on_signal took it
        self.hello_stop = threading.Event()  # set once this rank checked in: its hello (say_hello) is not needed
        self.own_environment()  # its variables and NCCL's log (self.nccl), before this process's first thread
        self.wd = Watchdog(self.on_expire, self.on_tick, on_error=self.helper_died)

    # ---------------------------------------------------------------- flow
    def run(self):
        """main() blocked SIGTERM and SIGINT in every thread before this object existed; one thread takes them."""
        self.helper("aiv-signals", self.on_signal)
        try:
            self.header()
            for phase in PHASES:
                if (phase in SCREEN_PHASES and self.args.skip_screen) or (phase == "soak" and not self.args.soak):
                    continue
                with self.deadline(phase):
                    getattr(self, "phase_" + phase.replace("-", "_"))()
            raise Verdict(EXIT_INTERNAL, [finding("internal", "FAIL", "the phases ended without a verdict",
                                                  code=EXIT_INTERNAL)])
        except Verdict as v:
            self.end(v)
        except BaseException as e:  # a bug still ends in one line and an exit code, blaming no host
            print_traceback(e)
            self.end(Verdict(EXIT_INTERNAL, [internal_finding(e, f"rank {self.rank} on {self.host}")]))

    # ---------------------------------------------------------------- phases
    def phase_rollcall(self):
        R, (prefix, serve) = self.D["rollcall"], launcher_store(self.env)
        self.proto = self.open_store(R, prefix, serve)
        self.progress("rollcall_open", master=f"{self.addr}:{self.port}", world=self.world, seconds=R)
        self.failpoint("rendezvous")
        self.before_check_in(R)
        stray = self.proto.check_in(self.rank, self.identity, self.world, R + RANK0_GRACE)
        self.hello_stop.set()
        if stray is not None:  # not a rank of this run: rank 0 names it; it takes no verdict of that run
            self.speak_for_node(f"FAILURE: {stray[0]}: rank {self.rank} ({self.host}, pid {os.getpid()}) is not a "
                                f"rank of the run at {self.addr}:{self.port}: {stray[1]}")
            self.exit(EXIT_FAIL)
        self.after_check_in(R)
        if self.local_rank == 0:  # after the go: the monitor never slows the roll call
            self.start_monitor()

    def open_store(self, R, prefix, serve):
        """Connect to the store (rank 0's, or torchrun's agent's): the connect and the store's first answer
        within the roll call's own bound R. A MASTER_ADDR that does not resolve here is said at once
        (resolvable), as rank 0 says it; a listener that accepts but never answers as a store (another
        service on MASTER_PORT) is named as such (unanswered)."""
        self.resolvable()
        try:
            return within(lambda: StoreProtocol.open(self.dist, self.addr, self.port, R, prefix, seal=self.seal),
                          self.bound.left(), "the store's connect")
        except BoundPassed:
            raise failed("rendezvous", f"rank {self.rank} ({self.host}): {self.unanswered(R)}", EXIT_TIMEOUT,
                         [self.host]) from None
        except CLUSTER_ERRORS as e:
            raise failed("rendezvous", f"rank {self.rank} ({self.host}) cannot reach the "
                         f"{'master' if serve else 'torchrun agent store at'} {self.addr}:{self.port}: "
                         f"{first_line(e)}", EXIT_TIMEOUT, [self.host]) from None

    def resolvable(self):
        """MASTER_ADDR looked up here within RESOLVE_S: a name that does not resolve is this host's `rendezvous`
        FAIL at once (exit 1, as rank 0 says it), not a store that never answered after the roll call's bound.
        A lookup that is only slow is left to the store's connect, which looks again."""
        try:
            within(lambda: socket.getaddrinfo(self.addr, self.port, type=socket.SOCK_STREAM), RESOLVE_S,
                   f"the lookup of MASTER_ADDR={self.addr}")
        except socket.gaierror as e:
            raise failed("rendezvous", f"MASTER_ADDR={self.addr} does not resolve on rank {self.rank}'s host "
                         f"{self.host}: {e.strerror}", hosts=[self.host], ranks=[self.rank]) from None
        except (BoundPassed, OSError):
            pass

    @contextlib.contextmanager
    def issuing(self, op, ranks=None, seq=None):
        """Around every collective call of the phases (the one helper their call sites use): this rank's
        record of the collective it is about to issue on the group of `ranks` (default the world), kept in
        memory (Issued), read when rank 0 asks (a phase's bound passed). On NCCL the block ends once the
        collective finished on this device (a synchronise: done means finished, not only queued). The
        `stall` failpoint pauses here, before the phase's first collective is issued."""
        if self.phase not in self.stalled:
            self.stalled.add(self.phase)
            self.failpoint(self.phase, only=("stall",))
        key = group_key(range(self.world) if ranks is None else ranks)
        self.issued.start(op, key, seq)
        if self.phase not in self.wedged:  # inside the call, its "about to issue" record made: the backend not yet
            self.wedged.add(self.phase)
            self.failpoint(self.phase, only=("wedge",))
        yield
        if self.backend == "nccl":
            self.torch.cuda.synchronize()
        self.issued.done(key)

    def phase_init(self):
        kw = {"backend": self.backend, "rank": self.rank, "world_size": self.world,
              "store": self.dist.PrefixStore(self.proto.prefix + "/pg", self.proto.raw),
              "timeout": datetime.timedelta(seconds=self.D["init"] + TORCH_BACKSTOP_S)}  # ours fires first
        if self.backend == "nccl":
            kw["device_id"] = self.torch.device("cuda", self.device)
        self.failpoint("init")
        t = time.monotonic()
        with self.issuing("init_process_group", seq=0):
            self.dist.init_process_group(**kw)
        self.issued.names[self.dist.group.WORLD.group_name] = group_key(range(self.world))  # the recorder's name
        self.progress("init", backend=self.backend, world=self.world, secs=time.monotonic() - t)

    def telemetry(self):
        """This rank's identity and, on a node leader, the node's facts: what the telemetry gather sends."""
        tele = dict(self.identity)
        if not self.args.skip_numerics:  # GPU: measured on the measuring thread; CPU: here (rank_numerics)
            tele["numerics"] = rank_numerics(self.torch, self.device if self.backend == "nccl" else None,
                                             self._kind(), self.bg.gpu, self.bound.left() / 4)
        node = self.bg.node_facts(self.bound.left() / 4)  # nvidia-smi: a quarter of this phase at most
        if node is not None:
            tele["node"] = node
        return tele

    def phase_telemetry(self):
        self.failpoint("telemetry")
        self.proto.post("telemetry", self.rank, self.telemetry())
        self.failpoint("done-telemetry")
        self.proto.wait_gate("judge", self.bound.left(RANK0_GRACE))

    def phase_soak(self):
        """--soak: every rank loads its own device for --soak seconds, all starting at one gate once their
        operands are warm (every GPU heats together), and posts its row (rank 0 judges them all).
        -> this rank's row."""
        self.failpoint("soak")
        g = self.identity.get("gpu") or {}
        row = soak_measure(self.torch, self._device(), self._kind(), self.args.soak, g.get("uuid"),
                           lambda: self.round_gate("soak"), numerics=not self.args.skip_numerics)
        self.proto.screen_post("soak", self.rank, row, self.world)
        return row

    def phase_collective(self):
        torch, w, r, t = self.torch, self.world, self.rank, time.monotonic()
        base = torch.arange(1 << 16, dtype=torch.int64, device=self._device())
        x, s = base * (r + 1) + r, torch.tensor([r + 1], dtype=torch.int64, device=self._device())
        self.failpoint("collective")
        with self.issuing("all_reduce"):
            self.dist.all_reduce(x)
        with self.issuing("all_reduce"):
            self.dist.all_reduce(s)
        want = base * (w * (w + 1) // 2) + w * (w - 1) // 2
        self.results = {"rank": r, "ar_ok": bool(torch.equal(x, want)), "ar_sum": int(s.item())}
        self.progress("collective", world=w, secs=time.monotonic() - t)

    def phase_ddp(self):
        torch, dist, dev, t = self.torch, self.dist, self._device(), time.monotonic()
        ddp_imports()  # where _warm_imports did not (or not yet): with the collector paused
        from torch.nn.parallel import DistributedDataParallel as DDP
        if not self.args.skip_numerics:  # this rank's own gradients, same input as every rank's, before any all-reduce
            self.results["grads_local"] = ddp_local_grads(torch, dev)
        g = torch.Generator().manual_seed(1234 + self.rank)
        xin, yin = torch.randn(16, 10, generator=g).to(dev), torch.randn(16, 10, generator=g).to(dev)
        model = torch.nn.Linear(10, 10).to(dev)
        with self.issuing("DDP's broadcast of the parameters"):
            ddp = DDP(model, device_ids=[self.device] if self.backend == "nccl" else None)
        self.failpoint("ddp")
        loss = torch.nn.functional.mse_loss(ddp(xin), yin)
        with self.issuing("DDP's all_reduce of the gradients"):
            loss.backward()
        grads = torch.cat([p.grad.detach().flatten() for p in model.parameters()]).double().cpu()
        lsum = loss.detach().clone()
        with self.issuing("all_reduce"):
            dist.all_reduce(lsum)
        self.results.update(loss=loss.item(), grads=hashlib.sha256(grads.numpy().tobytes()).hexdigest(),
                            imports=self.import_results(), helpers=list(self.helper_errors), **self.nccl.facts())
        self.proto.post("results", self.rank, self.results)
        self.failpoint("done-ddp")
        self.results_gathered(lsum.item())
        self.progress("ddp", secs=time.monotonic() - t)

    def results_gathered(self, loss_sum):
        """Rank 0 gathers every rank's results from the store and keeps them; the others have nothing to keep."""

    def phase_bandwidth(self):
        if self.args.bandwidth:
            self.bandwidth = [self.bandwidth_at(size) for size in self.args.bandwidth]

    # ---------------------------------------------------------------- helpers of the phases
    def progress(self, key, **kw):
        """Rank 0 prints the progress lines (Coordinator); the others are silent."""

    def header(self):
        """Rank 0 prints the header (Coordinator)."""

    def bandwidth_at(self, size):
        """all_reduce bus bandwidth as nccl-tests defines it: busbw = algbw * 2(n-1)/n, warm-up then
        timed iterations, device-synchronised, the slowest rank's time; GB/s = 1e9 bytes/s."""
        torch, dist, dev = self.torch, self.dist, self._device()
        sync = torch.cuda.synchronize if self.backend == "nccl" else (lambda: None)
        warm, iters = (5, 20) if self.backend == "nccl" else (1, 3)
        x = torch.zeros(max(1, size // 4), dtype=torch.float32, device=dev)
        with self.issuing(f"all_reduce x{warm} ({human_bytes(size)}, warm-up)"):
            for _ in range(warm):
                dist.all_reduce(x)
            sync()
        with self.issuing(f"all_reduce x{iters} ({human_bytes(size)})"):
            t0 = time.perf_counter()
            for _ in range(iters):
                dist.all_reduce(x)
            sync()
            dt = torch.tensor([(time.perf_counter() - t0) / iters], dtype=torch.float64, device=dev)
        with self.issuing("all_reduce (the slowest rank's time)"):
            dist.all_reduce(dt, op=dist.ReduceOp.MAX)
        sec = dt.item()
        algbw = size / sec / 1e9
        busbw = algbw * 2 * (self.world - 1) / self.world
        self.progress("bandwidth", size=human_bytes(size), us=sec * 1e6, algbw=algbw, busbw=busbw)
        return {"bytes": size, "time_us": sec * 1e6, "algbw": algbw, "busbw": busbw}



# ============================================================================ aiv/run/coordinator.py
# Floor 5 (runtime): rank 0 (Coordinator): serves the store and holds the roll call (RollCall), judges every
def hard_failures(broken):
    """The local failures that end the roll call at once: all but a python without torch (judge_no_torch weighs
    those once every rank checked in or failed)."""
    return {r: e for r, e in broken.items() if not (e.get("code") == EXIT_USAGE and not e.get("internal"))}


class RollCall:
    """Rank 0's roll call: the store (open_store, _listen_socket), the wait for every rank (wait_roll, the
    last call), the judges of what it shows (roll_call, not_checked_in), then the go. Mixed into
    Coordinator: the state it fills (records, host_of, master, poll) is the rank's."""

    def open_store(self, R, prefix, serve):
        """Rank 0 serves the store on a socket it bound itself, unless torchrun's agent serves it."""
        self.serving = serve  # a store of its own: rank 0 sees who connects to it
        if not serve:
            return super().open_store(R, prefix, serve)
        problem = fd_limit_problem(self.world, self.expect.get("nodes") or self.world)
        if problem:
            raise failed("rendezvous", f"rank 0 ({self.host}): {problem}", hosts=[self.host], blame="own")
        fd = self._listen_socket().detach()
        return StoreProtocol.open(self.dist, self.addr, self.port, R, prefix, listen_fd=fd, seal=self.seal)

    def roll_call(self):
        """Rank 0: wait for every rank (or the last call), judge what the roll call shows, then open the gate."""
        t, R = time.monotonic(), self.D["rollcall"]
        complete, strays, broken = self.wait_roll(t + self.bound.left())
        if strays or hard_failures(broken):  # woken early: the others of its launch get a moment to post too
            time.sleep(ERROR_GRACE)
            strays, broken = self.proto.strays(), self.local_failures()
        hard = hard_failures(broken)
        self.findings += [finding("internal", "FAIL", e["line"], ranks=[r], code=EXIT_INTERNAL)
                          if e.get("internal") else finding("local", "FAIL", e["line"], [e["host"]] if e.get("host")
                                                            else [], [r], blame="own")
                          for r, e in sorted(hard.items())]
        early = bool(strays or hard)  # ranks still starting when the roll call ended early are not late
        unseen = [] if complete and not early else self.proto.missing(self.world)  # no record on the store
        missing = [r for r in unseen if r not in broken]
        absent = set(unseen) | set(broken)
        present = [r for r in range(self.world) if r not in absent]
        with self.state_lock:
            self.records = [rank_record(r) for r in self.proto.identities(present)]
        if self.proto.forged:  # a record not of this run: nothing it says is believed, nobody is blamed for it
            self.progress("rollcall", present=len(self.records), world=self.world, secs=time.monotonic() - t,
                          result="FAIL")
            raise Verdict(EXIT_FAIL)
        self.host_of = {rec["rank"]: rec["host"] for rec in self.records}
        self.findings += judge_strays(strays, self.host_of.values()) if early else []
        self.findings += judge_no_torch({r: e for r, e in broken.items() if r not in hard},
                                        self.host_of.values(), self.expect.get("nodes"))
        if missing and not early:
            self.findings.append(self.not_checked_in(missing, present, R))
        self.findings += apply_strict(judge_pre(self.records, self.world, self.expect), self.args.strict)
        code = verdict_code(self.findings)
        self.progress("rollcall", present=len(present), world=self.world, secs=time.monotonic() - t,
                      result="FAIL" if code else "pass")
        if code:
            raise Verdict(code)
        self.proto.prepare(self.records)
        self.poll = self.proto.clone()
        self.wd.period = live_period(len(set(self.host_of.values())))
        self.master = {"host": self.host, "pid": os.getpid(), "pid_start": (proc_stat(os.getpid()) or ("", ""))[1],
                       "nodes": len(set(self.host_of.values()))}
        self.proto.open_gate("roll", json.dumps(self.master))

    def not_checked_in(self, missing, present, R):
        """The `rendezvous` FAIL of the ranks that did not check in, each with its host from the launch plan
        (Slurm's node list and tasks per node). At the last call: the ranks never heard of (no hello: not started,
        or they cannot reach the store) are named; those whose process said hello are still starting (not
        blamed). At the roll call's bound: every missing rank."""
        where = slurm_expected_hosts(self.env, self.world)
        at = f"{len(present)}/{self.world} reported at {self.addr}:{self.port}"
        lc = self.last_call
        named = [r for r in missing if lc is None or r in lc["unheard"]]
        names = ", ".join(f"{r} (expected on {where[r]})" if r in where else str(r) for r in named[:64])
        more = f" and {len(named) - 64} more" if len(named) > 64 else ""
        if lc is None:
            why = f"did not check in within {R:g}s ({at})"
        else:
            starting = [r for r in missing if r not in named]
            why = (f"did not check in: no word from its process within the last call ({lc['grace']:.0f}s after the "
                   f"latest rank arrived; {at}): not started, or it cannot reach the store at {self.addr}:{self.port}"
                   + (f"; rank(s) {format_ranges(starting)} reached the store and are still starting (not blamed)"
                      if starting else ""))
        return finding("rendezvous", "FAIL", f"rank(s) {names}{more} {why}", [where[r] for r in named if r in where],
                       named, code=EXIT_TIMEOUT, blame="process")

    def local_failures(self):
        """{rank: report} of the ranks that failed their local phase before checking in (a rank without
        torch tells rank 0 through the store's wire: tell_rank0_without_torch)."""
        return {r: e for r, e in self.proto.errors().items() if e.get("phase") == "local"}

    def wait_roll(self, end):
        """The roll call's wait, until `end`: all_arrived wakes it, every rank's record ends it (a counter
        bumped from outside wakes it early, not ends it); a stray or a rank that failed its local phase
        ends it early (a rank without torch: once every rank checked in or failed, judge_no_torch weighs
        them). The last call (LastCall): once at least half the world is present, the ranks never heard of
        (no hello) get last_call_grace past the latest news, not the whole bound (self.last_call says so).
        Each second it checks that the world record is still its own. -> (complete, strays, local failures)."""
        mine, self.last_call = self.proto.store.get("world"), None
        lc = LastCall(self.world, self.D["rollcall"], _T0)
        while True:
            complete = self.proto.wait_all(min(1.0, max(0.0, end - time.monotonic())))
            strays, now = self.proto.strays(), time.monotonic()
            held = self.proto.store.get("world")
            if held != mine:  # written over: put ours back (so the ranks can read the verdict), refuse theirs
                self.proto.store.set("world", mine)
                self.proto.refuse(Forged("world", held.decode(errors="replace").split("|")[-1],
                                         "was written over by something other than rank 0"))
            broken = self.local_failures() if self.proto.count("nerr") else {}
            if strays or hard_failures(broken) or self.proto.forged or now >= end:
                return complete and self.proto.all_in(self.world), strays, broken
            if complete and self.proto.all_in(self.world):
                return True, strays, broken
            present = self.proto.count("arrived") + len(broken)
            if broken and present >= self.world:  # every rank checked in or could not import torch
                return False, strays, broken
            if lc.seen(now, present, present + self.proto.count("hellos")).due(now):
                unseen = [r for r in self.proto.missing(self.world) if r not in broken]
                said = set(self.proto.said_hello(unseen))
                if any(r not in said for r in unseen):
                    self.last_call = {"grace": lc.grace, "unheard": [r for r in unseen if r not in said]}
                    return False, strays, broken
                lc.last = now  # every missing rank is up and reaches the store: it keeps the bound
            if complete:  # woken before every record was there
                time.sleep(FORGED_POLL_S)

    def _listen_socket(self):
        """Rank 0 binds the store's socket itself: only where MASTER_ADDR points, named errors."""
        try:
            infos = socket.getaddrinfo(self.addr, self.port, type=socket.SOCK_STREAM)
        except socket.gaierror as e:
            raise failed("rendezvous", f"MASTER_ADDR={self.addr} does not resolve on rank 0's host "
                         f"{self.host}: {e.strerror}: check MASTER_ADDR and the node's resolver") from None
        infos.sort(key=lambda i: i[0] != socket.AF_INET)
        fam, _, _, _, (ip, *_) = infos[0]
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
                why = (f"address already in use on {self.host}:{self.port} (MASTER_ADDR={self.addr}, "
                       f"MASTER_PORT={self.port}): another process listens there; pick a free MASTER_PORT")
            elif e.errno == errno.EADDRNOTAVAIL:
                why = (f"MASTER_ADDR={self.addr} resolves to {ip}, which is not an address of rank 0's host "
                       f"{self.host}: MASTER_ADDR must name the node running rank 0")
            else:
                why = f"cannot listen on {bind_ip}:{self.port} on {self.host}: {e.strerror}"
            raise failed("rendezvous", why) from None  # the launch's MASTER_ADDR/MASTER_PORT: no node's fault
        return s


class Naming:
    """Rank 0's findings for a phase that did not finish (unfinished) or was interrupted (interruption),
    each judged by judge_unfinished on what rank 0 collected within its bounds. Mixed into Coordinator:
    the state it reads (host_of, records, the screen) is the rank's."""

    def unfinished(self, phase, client, cause, code=EXIT_TIMEOUT, budget=NAMING_S - 1):
        """The finding naming who did not finish `phase`, from stamps, liveness and reports; in a phase
        that issues collectives also from what each live rank issued last (asked at once, collected within
        ISSUED_S while the liveness settles) and, on NCCL, NCCL's own view beside ours (nccl_view_read)."""
        hosts, asked = sorted(set(self.host_of.values())), None
        if phase in ISSUE_PHASES:  # every live rank's listener answers on posts/issued (issued_posts)
            with contextlib.suppress(Exception):
                client.ask()
                asked = time.monotonic()
        ras = self.nccl_view_read(phase)
        try:
            live, silent, quiet = client.settled_live(hosts, budget)
            stamps, errors = client.stamps(self.world), client.errors()
        except Exception as e:
            f = finding(PHASE_CHECK[phase], "FAIL", f"{cause}; the store could not be read to name the ranks: "
                        f"{first_line(e)}; no host is named", code=EXIT_TIMEOUT)
            f["blame"], f["unlocalised"] = "not-collected", {"why": "rank 0's store could not be read",
                                                                "localise": "a re-run"}
            return f
        live.update(self.own_node_live())
        silent, quiet = unreachable_hosts(silent, quiet, self.host, self.host_of, errors)
        issued = None
        if asked is not None:
            with contextlib.suppress(Exception):  # not collected: the finding says so
                issued = self.issued_posts(client, asked, live, silent)
        self.gone = {r for r, st in live.items() if st in ("gone", "stopped")}
        if phase == "soak":  # a rank that posted its soak (or waits at the soak's start gate) finished its part
            with contextlib.suppress(Exception):
                stamps = finished_by(stamps, self.round_posted(client, "soak"), phase)
        if phase in FAN_IN:  # a rank that posted its telemetry or results finished its part: it waits for rank 0
            with contextlib.suppress(Exception):
                stamps = finished_by(stamps, client.posts(FAN_IN[phase]), phase)
        f = None
        if phase in SCREEN_PHASES and self.screen is not None:
            with contextlib.suppress(Exception):
                f, stamps = self.screen_unfinished(phase, client, cause, live, errors, silent, stamps, issued)
        if f is None:
            f = judge_unfinished(phase, cause, self.world, self.host_of, stamps, live, errors, code, silent, issued,
                                 self.fabric_hint())
        if quiet:
            f["reason"] += "; " + quiet_monitor_note(quiet, budget)
        if ras is not None:
            self.nccl_view_add(f, ras, live, silent, issued)
        return f

    def issued_posts(self, client, asked, live, silent):
        """{rank: its answer or None} once every live rank answered, at most ISSUED_S after the question; rank 0's
        own record read here."""
        expect = {r for r, h in self.host_of.items() if r and live.get(r, "running") == "running" and h not in silent}
        while True:  # the counter is read every 50 ms (one small operation), the posts once it says enough
            late = time.monotonic() >= asked + ISSUED_S
            if late or client.count("posts/issued/n") >= len(expect):
                posts = client.posts("issued")
                if late or expect <= set(posts):
                    break
            time.sleep(0.05)
        return {r: posts.get(r) for r in range(self.world)} | {0: self.issued.record(self.torch, self.nccl.diag())}

    def nccl_view_read(self, phase):
        """On NCCL, in a phase that issues collectives: NCCL's RAS STATUS read on a thread of its own (its node's
        RAS answers for the whole job), within NCCL_RAS_S. -> (thread, box) or None."""
        if self.backend != "nccl" or phase not in ISSUE_PHASES:
            return None
        box = {}
        th = threading.Thread(target=lambda: box.update(ras=ras_status(*ras_addr(self.env), NCCL_RAS_S)),
                              name="aiv-ras", daemon=True)
        th.start()
        return th, box

    def nccl_view_add(self, f, ras, live, silent, issued=None):
        """NCCL's view beside ours in the finding: its words in the reason, its data under 'nccl_view' (with the
        NCCL DIAG lines the ranks' answers carried)."""
        th, box = ras
        th.join(NCCL_RAS_S + 0.5)
        got = box.get("ras") or {"ok": False, "why": f"no answer within {NCCL_RAS_S:g}s"}
        states = (f.get("issued") or {}).get("states") or {}
        kinds = {r: "dead" if live.get(r) == "gone" else "frozen" if live.get(r) == "stopped" else
                 "silent" if h in silent else "behind" if states.get(str(r)) == "behind" else "ok"
                 for r, h in self.host_of.items()}
        try:  # NCCL's view is said beside ours; it never changes the culprits or the exit code
            view = nccl_view(got, self.world, self.host_of, kinds, f.get("ranks") or [])
        except Exception as e:
            why = f"its reply could not be read ({type(e).__name__}: {first_line(e)})"
            view = {"read": False, "why": why, "agree": None, "ranks": {},
                    "words": f"NCCL's own view (RAS) not read: {why}"}
        diag = [ln for p in (issued or {}).values() if p for ln in p.get("diag") or []]
        if diag:
            view["diag"] = diag[:20]
            view["words"] += f"; NCCL DIAG ({len(diag)} line(s)): {diag[0]}"
        f["reason"] += "; " + view["words"]
        f["nccl_view"] = view

    def fabric_hint(self):
        """What would localise a collective that every rank issued and none finished, in this run's words."""
        rerun = "a re-run with NCCL_DEBUG=INFO (NCCL's WARN lines name the peer whose connection failed)"
        if (self.screen or {}).get("pairs"):
            return ("the screen's pair results (inter-node rows above: every pair of nodes measured before this "
                    f"phase), or {rerun}")
        if self.args.skip_screen:
            return f"the network screen (a run without --skip-screen measures every pair of nodes), or {rerun}"
        return None

    def own_node_live(self):
        """Rank 0's own node: its ranks' processes read here, from /proc (rank 0 shares the host; its
        node's monitor is not needed to see them, and a slow one is never news about the node)."""
        return {rec["rank"]: liveness(proc_stat(rec["pid"]), ("", rec["pid_start"])) for rec in self.records
                if rec.get("host") == self.host and rec.get("pid") and rec.get("pid_start")}

    def interruption(self, phase, name, client):
        """Rank 0's finding for a signal during `phase`: liveness as it was when the signal came (the ranks
        it stops are not yet gone), then, TERM_REPORTS_S later, the others' reports."""
        why = (f"{PHASE_WHAT[phase]} was interrupted by {name} (scancel, the time limit, preemption, the launcher "
               "or Ctrl-C)")
        nobody = finding("interrupted", "FAIL", f"rank 0 ({self.host}): {why}; {STOPPED_WORDS}", code=EXIT_INTERRUPTED)
        if self.poll is None or client is None:  # before the roll call ended: nobody to name
            return nobody
        hosts = sorted(set(self.host_of.values()))
        snap = bounded(lambda: client.live(hosts), SNAPSHOT_S, {})
        live = {int(r): st for snap_h in snap.values() for r, st in (snap_h.get("ranks") or {}).items()}
        # this node's ranks read directly: a worker that died just before the launcher's SIGTERM (torchrun
        # stops the others at once) is gone here, even when the monitor has not posted it yet
        live.update(self.own_node_live())
        time.sleep(TERM_REPORTS_S)
        seen = bounded(lambda: (client.stamps(self.world), client.errors()), SNAPSHOT_S)
        if seen is None:
            return nobody
        stamps, errors = seen
        errors[0] = {"line": f"rank 0 ({self.host}): {name}", "term": True, "internal": False}
        # the signalled ranks will not acknowledge: the job's KillWait (often 30 s) must not pass on the acks
        self.gone |= {r for r, e in errors.items() if e.get("term")} | {r for r, st in live.items() if st != "running"}
        return judge_unfinished(phase, why, self.world, self.host_of, stamps, live, errors)


class Coordinator(RollCall, Naming, ScreenCoordinator, RankRun):
    """Rank 0: the roll call (RollCall), the judges of each phase, the naming (Naming), the verdict. conclude() is
    the one way out, from whichever thread gets there first (the main thread, the watchdog, the signal thread)."""

    beats = False  # rank 0 reads its own node's ranks from /proc

    def __init__(self, args, contract, env):
        self.alarm_at = None  # on_tick: when the first error report was seen
        self.gone = set()  # ranks found dead or frozen: no acknowledgement to wait for
        self.acks_s = ACKS_S  # how long the store stays up for the acknowledgements
        self.verdict_lock = threading.Lock()
        self.concluding = threading.Event()  # the tick handed a verdict to a thread of its own (conclude_apart)
        self.tick_busy = threading.Lock()  # held by the tick's store read, which may outlive its bound
        self.serving = False
        self.last_call = None  # the roll call's last call, when it ended the roll call: {'grace', 'unheard'}
        self.verdict_code = None  # the code as the verdict stands (the verdict's bound exits with it)
        self.soak = self.drain = self.collectives = None  # the soak's rows (--soak); the --drain plan; collectives
        self.screen, self.screen_rounds, self.screen_made = None, {}, set()  # the screen's results, batches, groups
        super().__init__(args, contract, env)

    # ---------------------------------------------------------------- flow
    def end(self, v):
        self.conclude(v.code, v.findings, self.proto)

    def grace(self, phase):
        """Rank 0's watchdog at the roll call: NAMING_S past the bound, to name who did not check in."""
        return NAMING_S if phase == "rollcall" else 0.0

    def enter_phase(self, bound):
        """Rank 0 opens every phase's gate after the roll call."""
        self.proto.open_gate("phase/" + bound.phase)

    def own_error(self, phase, line, code):
        """Rank 0's own torch error: once the roll call is done, ERROR_GRACE for the others' reports, then
        the finding naming who did not finish the phase."""
        if self.poll is None:
            return super().own_error(phase, line, code)
        time.sleep(ERROR_GRACE)
        return Verdict(code, [self.unfinished(phase, self.proto, f"{PHASE_WHAT[phase]} failed", code)])

    # ---------------------------------------------------------------- phases
    def before_check_in(self, R):
        self.proto.publish_world(self.world)

    def after_check_in(self, R):
        self.roll_call()

    def phase_telemetry(self):
        t = time.monotonic()
        self.failpoint("telemetry")
        self.proto.post("telemetry", 0, self.telemetry())
        gathered = self.fan_in("telemetry")
        with self.state_lock:
            self.records = [rank_record(r) for r in gathered]
        gate = apply_strict(judge_gate(gathered, self.env.get("NCCL_IB_HCA")), self.args.strict)
        self.findings += gate
        self.progress("telemetry", ranks=len(gathered), secs=time.monotonic() - t, counts=_counts(gate),
                      size=max(len(json.dumps(r, default=str)) for r in gathered))
        if verdict_code(self.findings):
            raise Verdict(verdict_code(self.findings))
        self.proto.open_gate("judge")

    def phase_soak(self):
        """Rank 0 soaks its own device like every rank, collects every rank's row, judges them (judge_soak)
        and ends the run on a FAIL before the collectives."""
        t = time.monotonic()
        row = super().phase_soak()
        self.screen_wait("soak")
        cpu = self._kind() == "cpu"
        rows = soak_rows(self.records, self.proto.screen_posts("soak"), cpu)
        with self.state_lock:
            self.soak = {"seconds": self.args.soak, "cpu": cpu, "dtype": row.get("dtype"),
                         "n": SCREEN_MATMUL_N[self._kind()], "gpus": rows}
        found = apply_strict(judge_soak(rows, cpu), self.args.strict)
        self.findings += found
        ratios = [r["tflops_last"] / r["tflops_first"] for r in rows if r.get("tflops_first") and
                  r.get("tflops_last") is not None]
        temps = [r["temp_max_c"] for r in rows if r.get("temp_max_c") is not None]
        detail = (f"TFLOPS last/first window min {min(ratios):.2f}" if ratios else "too short to time windows") + (
            f", max temperature {max(temps):g} C" if temps else ", no GPU telemetry" + (" on CPU" if cpu else ""))
        self.progress("soak", n=len(rows), what="CPU rank(s)" if cpu else "GPU(s)", seconds=self.args.soak,
                      detail=detail, counts=_counts(found), secs=time.monotonic() - t)
        if verdict_code(self.findings):
            raise Verdict(verdict_code(self.findings))

    def phase_bandwidth(self):
        super().phase_bandwidth()
        if self.bandwidth:
            with self.state_lock:
                self.collectives["bandwidth"] = self.bandwidth

    def fan_in(self, name):
        """Rank 0: every rank's post of `name` (its own first) from the store, in rank order, within what
        is left of the phase's bound. A refused post ends the run (side_channel names it, nobody is
        blamed); ranks that did not post are named by unfinished (a rank that posted finished its part)."""
        posts = self.proto.wait_posts(name, self.bound.left())
        if self.proto.forged:
            raise Verdict(EXIT_FAIL)
        if len(posts) < self.world:
            raise Verdict(EXIT_TIMEOUT, [self.unfinished(self.phase, self.proto, self.bound.cause())])
        return [posts[r] for r in range(self.world)]

    def results_gathered(self, loss_sum):
        gathered = self.results = self.fan_in("results")
        with self.state_lock:
            self.collectives = {"ar_sum": gathered[0]["ar_sum"], "ar_expected": self.world * (self.world + 1) // 2,
                                "ranks": self.world, "loss": loss_sum / self.world,
                                "grads_identical": len({res["grads"] for res in gathered}) == 1}

    def phase_final(self):
        """Judge what the collectives returned: the verdict."""
        with self.state_lock:
            self.records = with_results(self.records, self.results)
        final = (judge_final(self.records, self.results, self.world, self.host_of, self.env.get("NCCL_IB_DISABLE"),
                             (self.collectives or {}).get("bandwidth"), self.args.min_busbw)
                 + judge_ddp_grads(self.records, self.results)  # numerics: each rank's own gradients
                 + judge_manifest(self.args.manifest_data, self.records, self.screen)
                 + judge_bands(self.args.manifest_data, self.records, self.screen)  # manifest: drift from the accepted
                 + judge_strays(self.proto.strays(), self.host_of.values()))  # a stray after the roll call
        self.findings += apply_strict(final, self.args.strict)
        raise Verdict(verdict_code(self.findings))

    # ---------------------------------------------------------------- the verdict
    def conclude(self, code, findings, client):
        """Rank 0 only, from whichever thread gets here first (the main thread, a thread the tick or the
        watchdog started, the signal thread; never the watchdog's own, whose heap still bounds the verdict):
        the verdict (Conclusion, on the run's facts copied under the state lock), then exit. Whatever fails
        inside, the process still exits, with the verdict or with `internal` (exit 4); it never keeps the lock
        and lives on."""
        self.verdict_lock.acquire()  # a second caller waits here until the first one exits the process
        Bound(self.wd, "verdict", self.D["verdict"]).arm()  # the verdict's own bound: expire("verdict")
        self.verdict_code = code
        if client is not None:  # the others now wait up to VERDICT_S for the code (the files come first)
            bounded(client.post_deciding, STORE_OP_S)
        try:
            self.failpoint("verdict", only=("raise",))
            found = self.findings.close() + list(findings) + self.helper_findings()
            c = Conclusion(self.snapshot(), self.args, client, self.progress, self.failpoint, self.set_code)
            code = c.give(found, code)
        except BaseException as e:
            print_traceback(e)
            with contextlib.suppress(BaseException):
                emit(f"FAILURE: internal: {first_line(e)} in {where_raised(e)} (rank 0 on {self.host}, giving the "
                     f"verdict): a bug in the tool, not a fault of the cluster: no host is blamed {NO_HOST_MARK}")
            code = verdict_code(self.findings.snapshot()) or EXIT_INTERNAL
        self.exit(code)

    def set_code(self, code):
        self.verdict_code = code

    def snapshot(self):
        """The run's facts for the verdict, as plain data copied under the state lock: the main thread may still
        be inside a phase (the verdict came from the watchdog or a signal) and writes them under that lock."""
        with self.state_lock:
            run = {"host": self.host, "world": self.world, "started_at": self.started_at, "backend": self.backend,
                   "addr": self.addr, "port": self.port, "expect": self.expect, "strict": self.args.strict,
                   "D": self.D, "times": self.times, "starts": self.starts, "records": self.records,
                   "collectives": self.collectives, "screen": self.screen, "soak": self.soak, "env": self.env,
                   "manifest_data": self.args.manifest_data,
                   "host_of": self.host_of, "gone": set(self.gone), "serving": self.serving,
                   "forged": list(self.proto.forged) if self.proto is not None else [],
                   "authenticated": self.seal.authenticated, "acks_s": min(self.acks_s, self.D["final"])}
            return copy.deepcopy(run)

    def helper_findings(self):
        """Helper threads that died (rank 0's own, and the others' as their results said): a WARN each.
        The run went on without them; the verdict stands on what the phases measured."""
        lines = [f"rank 0 ({self.host}): {e}" for e in self.helper_errors]
        lines += [f"rank {res['rank']} ({self.host_of.get(res['rank'], '?')}): {e}" for res in self.results or ()
                  if isinstance(res, dict) and "rank" in res for e in res.get("helpers") or ()]
        return [finding("internal", "WARN", f"{ln}: a helper thread of the tool died (a bug in the tool: please report "
                        "it); the run went on without it") for ln in lines]

    # ---------------------------------------------------------------- bounds and signals
    def expire(self, phase):
        """The bound passed: name who did not finish (before the roll call ended, only rank 0 itself). The
        verdict's own bound: exit with the verdict's code, saying which output did not finish."""
        if phase == "verdict":
            emit(f"WARNING: rank 0 ({self.host}): the verdict's outputs did not finish within {self.D[phase]:g}s "
                 f"(a file on slow storage, scontrol, the acknowledgements): exiting with the verdict's code "
                 f"{self.verdict_code}", sys.stderr)
            self.exit(self.verdict_code if self.verdict_code is not None else EXIT_INTERNAL)
        cause = self.expiry_cause(phase)
        if self.poll is None:  # rank 0 itself, alive, did not finish its own phase: slow is not evidence
            f = finding(PHASE_CHECK[phase], "FAIL", f"rank 0 ({self.host}): {cause}", [self.host], [0],
                        code=EXIT_TIMEOUT)
            self.conclude(EXIT_TIMEOUT, [unlocalised(f, "stuck")], self.proto)
        self.conclude(EXIT_TIMEOUT, [self.unfinished(phase, self.poll, cause)], self.poll)

    def expire_failed(self, phase, exc):
        self.conclude(EXIT_INTERNAL, [internal_finding(exc, f"rank 0 on {self.host}, at the {phase} bound")], None)

    def on_tick(self, phase):
        """Rank 0, every liveness period during a phase after the roll call (on the watchdog's thread): a rank
        whose process is gone ends the phase at once; an error report ends it ERROR_GRACE later; a value not of
        this run ends the run (side_channel names it, nobody blamed). The tick's store reads take at most
        STORE_OP_S (a tick whose read does not come back is skipped: the phase's own bound still holds), and
        the verdict it decides is given on a thread of its own (conclude_apart): the watchdog goes on bounding
        it."""
        if self.poll is None or phase in ("local", "rollcall") or self.verdict_lock.locked():
            return
        seen = self.tick_read()
        if seen is None:
            return
        forged, dead, errors = seen
        if forged:
            self.conclude_apart(EXIT_FAIL, lambda client: [])
            return
        if self.alarm_at is None and (dead or errors):
            self.alarm_at = time.monotonic()
        if dead or (self.alarm_at is not None and time.monotonic() - self.alarm_at >= ERROR_GRACE):
            self.conclude_apart(EXIT_TIMEOUT, lambda client: [self.unfinished(phase, client,
                                                                              f"{PHASE_WHAT[phase]} failed")])

    def tick_read(self):
        """(a value refused, a rank's process gone, an error report posted) from the store within STORE_OP_S, or
        None: no answer in time, or the last tick's read still pending (one read at a time)."""
        if self.tick_busy.locked():
            return None

        def read():
            with self.tick_busy:
                hosts = sorted(set(self.host_of.values()))
                dead = any(st == "gone" for snap in self.poll.live(hosts).values()
                           for st in (snap.get("ranks") or {}).values())
                return bool(self.poll.forgeries()), dead, bool(self.poll.count("nerr") and self.poll.errors())
        return bounded(read, STORE_OP_S)

    def conclude_apart(self, code, findings_of):
        """The verdict the tick decided, on a thread of its own with a store connection of its own (the
        findings it names: findings_of(client)); once."""
        if self.concluding.is_set():
            return
        self.concluding.set()

        def give():
            client = bounded(self.proto.clone, STORE_OP_S) or self.poll
            self.conclude(code, findings_of(client), client)
        threading.Thread(target=give, name="aiv-verdict", daemon=True).start()

    def signalled(self, signum, name, phase):
        """The verdict within NAMING_S: `interrupted` (exit 5), naming no host, unless a rank was already
        dead or frozen before the signal (interruption)."""
        if self.verdict_lock.locked():  # the verdict is being given already
            return
        client = bounded(self.proto.clone, STORE_OP_S) if self.proto is not None else None
        self.acks_s = ACKS_SIGNALLED_S
        self.conclude(EXIT_INTERRUPTED, [self.interruption(phase, name, client)], client)

    # ---------------------------------------------------------------- output
    def progress(self, key, **kw):
        emit(f"[{elapsed():9.2f}s] " + PROGRESS[key].format(**kw))

    def header(self):
        emit("\n".join(HEADER).format(
            version=VERSION, started=self.started_at, host=self.host, world=self.world,
            master=f"{self.addr}:{self.port}", port_from=self.c.get("port_from", "port from " + self.c["port_source"]),
            launch=self.c.get("launch", self.c["source"]), rollcall=self.D["rollcall"],
            timeout=self.D["init"], expect=" ".join(f"{k}={v}" for k, v in sorted(self.expect.items())) or "none"))



# ============================================================================ aiv/run/follower.py
# Floor 5 (runtime): every other rank: reports its own error, takes rank 0's verdict, speaks for a
class Follower(ScreenFollower, RankRun):
    """Every rank but 0: enters each phase at rank 0's gate, reports its own error, and exits with rank
    0's verdict, read from the store by a listener thread even while the main thread is blocked in a
    collective. When rank 0 gives none in time, it speaks for rank 0, once per node."""

    def __init__(self, args, contract, env):
        self.verdict_seen = None  # rank 0's exit code, once read
        self.ack_lock, self.acked = threading.Lock(), False
        self.speak_lock = threading.Lock()  # speak_for_rank0: one thread speaks and writes the JSON
        super().__init__(args, contract, env)

    # ---------------------------------------------------------------- flow
    def end(self, v):
        """Report (done by phase_error), then take rank 0's verdict; before the roll call, tell rank 0 why (through
        the store's wire: tell_rank0) and speak for the node."""
        if self.proto is None:
            self.tell_rank0(v)
        if self.proto is not None:  # rank 0 names the culprit within the phase's bound: wait that long again
            try:
                with Bound(self.wd, self.phase, self.D[self.phase], RANK0_GRACE) as b:
                    self.exit(self.verdict_within(self.proto, b.left(RANK0_GRACE)))
            except Exception as e:  # the tool's own error while taking the verdict: `internal`, no host blamed
                print_traceback(e)
                f = internal_finding(e, f"rank {self.rank} on {self.host}, taking the verdict")
                v = Verdict(EXIT_INTERNAL, [f])
        self.speak_for_node("\n".join(failure_lines(v.findings))
                            or f"FAILURE: internal: rank {self.rank} {NO_HOST_MARK}")
        self.exit(v.code)

    def tell_rank0(self, v):
        """This rank failed before it checked in (torch missing or too old, a local check, the tool's own error):
        rank 0 hears why at once, through the store's own wire (no torch needed), within what is left of the
        phase's bound, and ends the roll call in seconds instead of at its bound. An interruption says nothing:
        rank 0 takes its own signal."""
        if v.code == EXIT_INTERRUPTED or not v.findings or self.phase != "local":  # the store unreachable: no tell
            return
        f = v.findings[0]
        line = f["reason"] if f["reason"].startswith(f"rank {self.rank} ") else f"rank {self.rank} ({self.host}): " \
            f"{f['check']}: {f['reason']}"
        tell_rank0_without_torch(self.addr, self.port, launcher_store(self.env)[0], self.rank, self.host, line,
                                 self.bound.left() if getattr(self, "bound", None) else 0.0, v.code,
                                 internal=v.code == EXIT_INTERNAL)

    def grace(self, phase):
        """The other ranks give rank 0 RANK0_GRACE past each bound to name the culprit first."""
        return RANK0_GRACE if phase != "local" else 0.0

    def enter_phase(self, bound):
        """Wait for rank 0's gate, bounded as the phase itself (rank 0 opens it, or gives a verdict, within
        the previous phase's bound + NAMING_S of the previous gate); the bound then counts from the gate."""
        self.proto.wait_gate("phase/" + bound.phase, bound.left(bound.grace + NAMING_S))  # the watchdog speaks first
        bound.restart()

    # ---------------------------------------------------------------- phases
    def before_check_in(self, R):
        self.bound.restart()  # counted from rank 0's store's first answer: rank 0 may start late

    def after_check_in(self, R):
        self.helper("aiv-listener", self.listen)
        self.master = json.loads(self.proto.wait_gate("roll", self.bound.left(RANK0_GRACE)))

    def phase_final(self):
        """Rank 0 judges; this rank waits for its verdict."""
        self.exit(self.verdict_within(self.proto, self.bound.left(RANK0_GRACE)))

    # ---------------------------------------------------------------- rank 0's verdict
    def listen(self):
        """Non-zero ranks: on a connection of our own, wait for rank 0's question or its verdict (`ask`). Asked
        (a phase did not finish), post what this rank issued last (answer); then exit with the verdict."""
        client = self.proto.clone()
        end = time.monotonic() + worst_case(self.D, True, soak=bool(self.args.soak)) + RANK0_GRACE
        with contextlib.suppress(*CLUSTER_ERRORS):  # a store that went away or timed out: the verdict's wait says so
            if client.wait_ask(end - time.monotonic()) == "ask":
                self.answer(client)
        self.exit(self.verdict_within(client, max(0.001, end - time.monotonic())))

    def answer(self, client):
        """This rank's answer to rank 0's question: the last collective it issued on each of its groups (torch's
        flight recorder and its own record), whether its main thread is inside one, NCCL's DIAG lines. The
        tool's own error here is said (a WARN) and the listener goes on to the verdict: no answer is no
        evidence, never a rank that cannot exit."""
        try:
            client.post("issued", self.rank, self.issued.record(getattr(self, "torch", None), self.nccl.diag()))
        except Exception as e:
            if not is_tool_error(e):
                raise
            self.helper_died("the answer to rank 0's question", e)

    def verdict_within(self, client, seconds):
        """Rank 0's code from the store within `seconds`. A store that is gone or silent is rank 0's news
        (lost_rank0); the tool's own error is raised as it is (`internal`, no host blamed)."""
        try:
            return self.take_verdict(client, seconds)
        except CLUSTER_ERRORS as e:
            code = self.verdict_of_deciding(client) if store_timed_out(e) else None
            if code is not None:
                return code
            self.lost_rank0(e)

    def verdict_of_deciding(self, client=None):
        """Rank 0 posted `deciding` (its verdict started; the files asked for come before its code, and shared
        storage can be slow): -> its code, waited for up to VERDICT_S (the verdict's own bound, within which
        rank 0 publishes it) instead of RANK0_GRACE; None when there is no mark, or no code came."""
        if self.proto is None or self.master is None:
            return None
        try:
            client = client or within(self.proto.clone, STORE_OP_S, "a store connection")
            if not within(client.deciding, STORE_OP_S, "reading rank 0's deciding mark"):
                return None
            return self.take_verdict(client, VERDICT_S)
        except CLUSTER_ERRORS:
            return None

    def take_verdict(self, client, seconds):
        code = client.wait_verdict(seconds)
        self.verdict_seen = code
        with self.ack_lock:
            if not self.acked:
                self.acked = True
                with contextlib.suppress(Exception):  # rank 0 stopped waiting for acks: the code is what matters
                    client.ack(self.rank)
        return code

    def lost_rank0(self, exc):
        """Rank 0's store went away. After its verdict: nothing is lost. Before it: speak for rank 0,
        unless this rank is signalled within SIGNAL_SPREAD_S: then the job was stopped from outside
        (scancel, the time limit: rank 0 took the signal first and gave the `interrupted` verdict, its
        store going with it) and the signal's own path ends this rank, blaming nobody."""
        if self.verdict_seen is not None:  # rank 0 gave its verdict, then its store went away: nothing lost
            self.exit(self.verdict_seen)
        if self.came_within(lambda: self.signal_seen is not None, SIGNAL_SPREAD_S):
            time.sleep(STORE_OP_S + ACKS_SIGNALLED_S + 1)  # signalled() ends the process within this
            self.exit(128 + self.signal_seen)
        host0, (state, kind) = (self.master or {}).get("host", self.addr), self.rank0_seen("link")
        self.exit(self.speak_for_rank0(f"FAILURE: rendezvous: rank {self.rank} ({self.host}) lost rank 0 ({host0}) "
                                       f"during {self.phase}: its store at {self.addr}:{self.port} is gone "
                                       f"({first_line(exc)}){state}", kind))

    def expire(self, phase):
        """Speak for this rank (before the roll call) or for rank 0, which gave no verdict in time."""
        cause = self.expiry_cause(phase)
        if self.master is None and not (self.proto is not None and self.proto.forged):
            self.speak_for_node(f"FAILURE: {PHASE_CHECK[phase]}: rank {self.rank} ({self.host}): {cause}")
            self.exit(EXIT_TIMEOUT)
        code = self.verdict_of_deciding()  # rank 0 alive and deciding: its code, within the verdict's bound
        if code is not None:
            self.exit(code)
        host0, (state, kind) = (self.master or {}).get("host", self.addr), self.rank0_seen("stuck")
        self.exit(self.speak_for_rank0(f"FAILURE: rendezvous: rank {self.rank} ({self.host}) got no verdict from "
                                       f"rank 0 ({host0}) within {self.D[phase] + RANK0_GRACE:g}s of {phase}: rank 0 "
                                       f"is frozen, hung or unreachable{state}", kind))

    def signalled(self, signum, name, phase):
        """Post that this rank was terminated (so that rank 0 does not take it for dead), exit 128 + signal.
        When rank 0's process on this node is gone and no verdict came (torchrun stops the other workers
        once one died: rank 0 killed leaves nobody to speak), speak for rank 0 and leave the JSON."""
        if self.rank0_died():
            host0 = (self.master or {}).get("host", self.addr)
            self.exit(self.speak_for_rank0(f"FAILURE: rendezvous: rank 0 ({host0}) died during {phase} before its "
                                           f"verdict (its process is gone); {name} then stopped rank {self.rank} "
                                           f"({self.host})", "process"))
        if self.proto is not None:
            line = f"rank {self.rank} ({self.host}): terminated by {name} during {phase}"
            bounded(lambda: self.proto.clone().report_error(self.rank, phase, line, EXIT_INTERRUPTED, term=True),
                    STORE_OP_S)
        self.exit(128 + signum)

    def speak_for_rank0(self, line, kind):
        """Rank 0 gave no verdict: say so once per node, and leave a FAIL JSON where rank 0 left none (the batch
        file ends the step once a verdict JSON exists). line: `FAILURE: rendezvous: ...`; kind: the evidence it
        stands on (`link`: the store connection broke; `stuck`: no verdict in time; `process`: rank 0's process
        seen gone on this node): the one fallback writer (fallback_verdict) gates it, so only `process` names
        rank 0's host. A rank that refused a forged value names that instead, and nobody (judge_forged). The
        listener and the main thread can both get here: the second waits (for ever: the first exits) until
        the first has written the JSON. -> the exit code."""
        self.speak_lock.acquire()
        host0, code = (self.master or {}).get("host", self.addr), EXIT_TIMEOUT
        found = [rank0_lost(line.split(": ", 2)[-1], host0, kind, code)]
        if self.proto is not None and self.proto.forged:
            found, code = judge_forged(self.proto.forged, f"{self.addr}:{self.port}"), EXIT_FAIL
        state = fallback_verdict(found, code, self.world, f"rank {self.rank} ({self.host})",
                                 set(self.host_of.values()) if getattr(self, "host_of", None) else ())
        if not self.speak_for_node("\n".join(state["failures"])) or not self.args.json \
                or os.path.exists(self.args.json):
            return code
        write_json_within(self.args.json, state, first=True)
        return code

    @staticmethod
    def came_within(seen, seconds):
        """Whether seen() is true within `seconds` (looked at every 50 ms)."""
        end = time.monotonic() + seconds
        while not seen() and time.monotonic() < end:
            time.sleep(0.05)
        return seen()

    def rank0_died(self):
        """Whether rank 0 runs on this node and its process is gone with no verdict read within
        ACKS_SIGNALLED_S (a rank 0 that gave its verdict publishes it before it exits)."""
        m = self.master or {}
        if m.get("host") != self.host or not m.get("pid") or self.verdict_seen is not None:
            return False
        stat = proc_stat(m["pid"])
        first = ("", m["pid_start"]) if m.get("pid_start") else stat
        if stat is not None and liveness(stat, first) != "gone":
            return False
        return not self.came_within(lambda: self.verdict_seen is not None, ACKS_SIGNALLED_S)

    def rank0_liveness(self):
        """Rank 0's process state where it runs on this node (running, stopped, gone), else None."""
        m = self.master or {}
        if m.get("host") != self.host or not m.get("pid"):
            return None
        return liveness(proc_stat(m["pid"]), proc_stat(m["pid"]) or ("", ""))

    def rank0_seen(self, otherwise):
        """Rank 0's process as this node sees it: (its state, for the end of a line; what a rank that got no verdict
        stands on: `process` where it is stopped or gone, which names rank 0's host, else `otherwise`, `link` or
        `stuck`: nobody)."""
        st = self.rank0_liveness()
        return (f" (rank 0's process on this node is {st})" if st else "",
                "process" if st in ("stopped", "gone") else otherwise)



# ============================================================================ aiv/launch/plan.py
# Floor 6: what a command line becomes (help, version, verify-log, diff-manifest, local, rank).
# Set by a launcher that starts several ranks per node (srun, torchrun, mpirun, local mode): then a
# rank's own usage error is said once per node. A process started by hand has no siblings: it speaks.
LAUNCHER_VARS = ("SLURM_STEP_ID", "SLURM_STEPID", "TORCHELASTIC_RUN_ID", "LOCAL_WORLD_SIZE",
                 "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK")


def usable_cores():
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def mem_available(root="/"):
    """Bytes this process may still use: MemAvailable, lowered to what a cgroup v2 memory limit has
    left; None when unknown."""
    m = re.search(r"^MemAvailable:\s+(\d+) kB", read_text(os.path.join(root, "proc/meminfo"), ""), re.M)
    avail = int(m.group(1)) << 10 if m else None
    m = re.search(r"^0::/(\S*)", read_text(os.path.join(root, "proc/self/cgroup"), ""), re.M)
    if m:
        d = os.path.join(root, "sys/fs/cgroup", m.group(1))
        limit = read_text(os.path.join(d, "memory.max"), "").strip()
        used = read_text(os.path.join(d, "memory.current"), "").strip()
        if limit.isdigit() and used.isdigit():
            left = max(0, int(limit) - int(used))
            avail = left if avail is None else min(avail, left)
    return avail


def check_nproc(args, gpu, root="/"):
    """An explicit --nproc beyond what this machine holds (the rule above) is a usage error."""
    n, name = args.nproc, getattr(args, "origin", {}).get("nproc", "--nproc")
    cores, avail, per = usable_cores(), mem_available(root), RANK_MEM_GPU if gpu else RANK_MEM_CPU
    if n > RANKS_PER_CORE * cores:
        raise UsageError(f"{name}={n} is more ranks than this machine holds: at most {RANKS_PER_CORE} per CPU "
                         f"core, {RANKS_PER_CORE * cores} on the {cores} core(s) this process may use")
    if avail is not None and n * per > avail:
        raise UsageError(f"{name}={n} is more ranks than this machine holds: {n} x {human_bytes(per)} per "
                         f"{'GPU' if gpu else 'CPU'} rank, but {human_bytes(avail)} of memory is available")


def json_problem(path):
    """Why rank 0 could not write its verdict to path (None: it can): the directory must exist and take
    a new file, which is tried by creating and removing one."""
    d = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        return "is a directory"
    if not os.path.exists(d):
        return f"names directory {d}, which does not exist"
    if not os.path.isdir(d):
        return f"names {d}, which is not a directory"
    try:
        fd, probe = tempfile.mkstemp(prefix=".aiv-probe-", dir=d)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        return f"cannot be written: no file can be created in {d} ({e.strerror or e})"
    return None


def check_json_target(args):
    """--json, --metrics and --html PATH, tried by rank 0 and the local launcher before torch is imported: an
    output that cannot be written is a usage error now, not a warning after the run."""
    for dest in ("json", "metrics", "html"):
        path = getattr(args, dest, None)
        if path is not None and (problem := json_problem(path)):
            name = getattr(args, "origin", {}).get(dest, "--" + dest)
            raise UsageError(" ".join(f"FAILURE: usage: {name}={path!r} {problem}".split()))


def _line(check, e):
    """A UsageError from a check, as the exact line to print (one line, whatever the input held)."""
    return UsageError(" ".join(f"FAILURE: {check}: {e}".split()), own=e.own)


def _local(args, env, root):
    """Local mode's launch plan: launch_plan's, plus the port (None: a free one at launch), the master (a
    MASTER_ADDR of this machine is kept) and the words for the header."""
    try:
        port = _int_var(env, "MASTER_PORT", lo=1, hi=65535) if "MASTER_PORT" in env else None
    except UsageError as e:
        raise _line("contract", e) from None
    try:
        out = dict(launch_plan(args, env, root), port=port)
    except UsageError as e:
        raise _line("usage", e) from None
    addr = env.get("MASTER_ADDR", "").strip() or "127.0.0.1"
    how = f"local mode, no launcher variables: {out['nproc']} rank(s) on this machine ({_ranks_why(args, out)})"
    return dict(out, master_addr=addr, launch="local mode",
                port_from="port from MASTER_PORT" if port else "a free port", how=how)


def _ranks_why(args, lp):
    """How launch_plan chose the ranks per node, in words."""
    if args.nproc:
        return f"{getattr(args, 'origin', {}).get('nproc', '--nproc')}={args.nproc}"
    if lp["backend"] == "gloo" or args.backend == "gloo":
        return "CPU ranks: " + ("--backend gloo" if args.backend == "gloo" else "no GPU visible")
    return "one per GPU"


def _node_launch(args, env, root, node):
    """A per-node launch (read_node_launch): this node's ranks as local mode chooses them (one per GPU, 2 CPU
    ranks), or as PET_NPROC_PER_NODE or --nproc says; numbered as torchrun numbers them. A RANK that may count
    processes on a node of several GPUs, PET_NPROC_PER_NODE against --nproc, or a WORLD_SIZE that is neither
    the pods nor the ranks: one line."""
    stated = node["nproc"]
    if stated and args.nproc and args.nproc != stated[1]:
        name = getattr(args, "origin", {}).get("nproc", "--nproc")
        raise _line("contract", UsageError(f"{stated[0]}={stated[1]} and {name}={args.nproc} disagree on the ranks per "
                                           "node: give one of them"))
    if stated and not args.nproc:
        args = argparse.Namespace(**vars(args))
        args.nproc, args.origin = stated[1], dict(getattr(args, "origin", {}), nproc=stated[0])
    try:
        lp = launch_plan(args, env, root)
    except UsageError as e:
        raise _line("usage", e) from None
    why, alloc, gpu_ranks = _ranks_why(args, lp), allocated_gpus(env), lp["backend"] is None and args.backend != "gloo"
    if alloc and not args.nproc and gpu_ranks and alloc != lp["nproc"]:  # the pod's allocation
        lp, why = dict(lp, nproc=alloc), f"one per GPU allocated: NVIDIA_VISIBLE_DEVICES lists {alloc}"
    if node["ambiguous"] and not args.nproc and gpu_ranks and lp["nproc"] > 1:
        raise _line("contract", ambiguous_rank(env, lp["nproc"]))
    bad = world_mismatch(node, lp["nproc"])
    if bad:
        raise _line("contract", bad)
    how = describe_node(node, lp["nproc"], why)
    return dict(lp, port=node["master_port"], master_addr=node["master_addr"], port_from=node["port_from"],
                launch=f"{node['name']}, this tool starting {lp['nproc']} rank(s) per node", how=how,
                node={k: node[k] for k in ("launcher", "nnodes", "node_rank")})


def plan(argv, env, root="/"):
    """(argv, env) -> what this process does, without importing torch or writing anything:
    {"mode": "help"|"version", "text"}, {"mode": "verify-log"|"node-check", "args"}, {"mode": "rank", "args",
    "contract"} or {"mode": "local", "args", "launch"}; with "check_json" where this process is the one
    to try --json (rank 0's node). A per-node launch (Kubeflow Trainer v2, PyTorchJob v1, an Indexed Job,
    JobSet, LeaderWorkerSet, Volcano) is mode "local" with launch["node"]: this process starts its node's
    ranks. Raises UsageError whose message is the exact line to print."""
    argv = list(argv)
    words = argv[:argv.index("--")] if "--" in argv else argv
    if "-h" in words or "--help" in words:
        return {"mode": "help", "text": build_parser().format_help()}
    if "--version" in words:
        return {"mode": "version", "text": f"ai-infra-validator {VERSION}"}
    try:
        args = parse_args(argv, env)
    except UsageError as e:
        raise _line("usage", e) from None
    for mode in ("verify-log", "diff-manifest", "node-check"):  # node-check: this node alone, no launch contract
        if getattr(args, mode.replace("-", "_")) is not None:    # (a prolog's environment is a job's)
            return {"mode": mode, "args": args}
    try:
        node = read_node_launch(env)  # one process per node or pod: this tool starts the node's ranks
        contract = None if node else read_contract(env)
        if contract is not None:
            check_pet_beside_ranks(env, contract["world_size"])
            contract.update(describe_contract(contract, env))
    except UsageError as e:
        raise _line("contract", e) from None
    if node is not None:
        return {"mode": "local", "args": args, "launch": _node_launch(args, env, root, node),
                "check_json": node["node_rank"] == 0}
    if contract is not None:
        return {"mode": "rank", "args": args, "contract": contract, "check_json": contract["rank"] == 0}
    return {"mode": "local", "args": args, "launch": _local(args, env, root), "check_json": True}


def free_port(host="127.0.0.1"):
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def launch_plan(args, env, root="/"):
    """Local mode: {'nproc', 'backend'} (backend: the flag to add, None to let each rank choose), or
    a UsageError. One rank per visible GPU; where GPUs are expected but none is visible, still one rank
    per listed device, so that each rank FAILs naming torch's reason instead of a CPU run passing.
    An explicit --nproc is held to what the machine holds (check_nproc)."""
    if args.backend == "gloo":
        out = {"nproc": args.nproc or 2, "backend": None}
    else:
        gpus = count_visible_gpus(env, root)
        if not gpus and gpus_expected(env, root):
            cvd = env.get("CUDA_VISIBLE_DEVICES")
            gpus = len([x for x in cvd.split(",") if x.strip()]) if cvd else allocated_gpus(env) or 1
        if args.backend == "nccl" and not gpus:
            name = getattr(args, "origin", {}).get("backend", "--backend")
            raise UsageError(f"{name}=nccl but no GPU is visible on {socket.gethostname()} and none is expected")
        out = {"nproc": args.nproc or gpus, "backend": None} if gpus else {"nproc": args.nproc or 2, "backend": "gloo"}
    if args.nproc:
        check_nproc(args, gpu=args.backend != "gloo" and out["backend"] is None, root=root)
    return out



# ============================================================================ aiv/launch/local.py
# Floor 6: the local launcher: one rank per visible GPU, or --nproc gloo ranks on CPU; the whole job in
def die_with_parent(sig):
    """A Popen preexec_fn: the child gets `sig` when the process that started it dies (prctl
    PR_SET_PDEATHSIG), and ends at once where that process is already gone."""
    import ctypes
    libc, parent = ctypes.CDLL(None, use_errno=True), os.getpid()

    def arm():
        libc.prctl(1, int(sig), 0, 0, 0)  # 1: PR_SET_PDEATHSIG
        if os.getppid() != parent:
            os._exit(EXIT_TIMEOUT)
    return arm


class Forward:
    """The local launcher's SIGTERM and SIGINT: passed to its ranks as SIGTERM (they give their verdict);
    the launcher then waits for them, bounded, and exits with it."""

    def __init__(self, procs):
        self.procs, self.sig = procs, None
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self.take)

    def take(self, signum, frame):
        self.sig = self.sig or signum
        for p in self.procs:
            if p.poll() is None:
                with contextlib.suppress(OSError):
                    p.send_signal(signal.SIGTERM)


def _start_ranks(cmd, env, launch, node, nproc, base, world, port):
    """This node's ranks base..base+nproc-1 of `world`, each its own session, dying with this process."""
    keep = SECRET_VAR in env or node["nnodes"] > 1  # exported, or other nodes could not know one made here
    secret = {} if keep else {SECRET_VAR: os.urandom(32).hex()}  # in the environment only
    told = json.dumps({"launch": launch.get("launch", "local mode"), "how": launch.get("how", "local mode"),
                       "port_from": launch.get("port_from") or "a free port"})
    expect = {"AIV_EXPECT_NODES": str(node["nnodes"]), "AIV_EXPECT_RANKS_PER_NODE": str(nproc),
              "AIV_EXPECT_WORLD_SIZE": str(world), **env}  # the launch's shape, unless exported
    envs = [dict(expect, **secret, RANK=str(base + r), LOCAL_RANK=str(r), WORLD_SIZE=str(world),
                 LOCAL_WORLD_SIZE=str(nproc), MASTER_ADDR=launch.get("master_addr") or "127.0.0.1",
                 MASTER_PORT=str(port), PYTHONUNBUFFERED="1", **{LAUNCH_VAR: told}) for r in range(nproc)]
    return [subprocess.Popen(cmd, env=e, stdin=subprocess.DEVNULL, start_new_session=True,
                             preexec_fn=die_with_parent(signal.SIGTERM)) for e in envs]


def _launcher_verdict(procs, alive, sig, base, nproc, node):
    """The launcher's exit code from its ranks' (alive: those it had to kill; sig: the signal it was given),
    with one line where that code is not rank 0's own."""
    # the verdict: rank 0's code; on another node of a per-node launch, the one its ranks got from rank 0
    first = "rank 0" if base == 0 else f"rank {base} (this node's first)"
    if alive and (procs[0] in alive or procs[0].returncode == EXIT_PASS):
        emit(f"FAILURE: launch: local ranks {format_ranges(base + procs.index(p) for p in alive)} still running at "
             f"the launcher's deadline; killed")
        return EXIT_TIMEOUT
    codes = [p.returncode for p in procs]
    if codes[0] < 0 and sig:
        emit(f"FAILURE: interrupted: the launcher was interrupted by {signal.Signals(sig).name} before {first} "
             f"(pid {procs[0].pid}) gave a verdict; {STOPPED_WORDS}")
        return EXIT_INTERRUPTED
    if codes[0] < 0:
        emit(f"FAILURE: launch: {first} (pid {procs[0].pid}) died with signal {-codes[0]} before its verdict")
        return EXIT_FAIL
    if codes[0] == EXIT_PASS and any(c for p, c in zip(procs, codes, strict=True) if p not in alive):
        bad = [(base + r, c) for r, c in enumerate(codes) if c]
        emit(f"FAILURE: launch: {first} passed but " + ", ".join(f"rank {r} exited {c}" for r, c in bad))
        return EXIT_FAIL
    if base and sig and codes[0] >= 128:  # this node's ranks stopped on its own signal
        emit(f"FAILURE: interrupted: the launcher of node {node['node_rank']} ({socket.gethostname()}) was "
             f"interrupted by {signal.Signals(sig).name}: its ranks {format_ranges(range(base, base + nproc))} "
             f"stopped before rank 0's verdict; {STOPPED_WORDS}")
        return EXIT_INTERRUPTED
    if base:  # another node's log says what its ranks got (rank 0's node prints the report)
        emit(f"node {node['node_rank']} of {node['nnodes']} ({socket.gethostname()}): ranks "
             f"{format_ranges(range(base, base + nproc))} ended; the verdict they got: exit {codes[0]}")
    return codes[0]


def launch_local(args, argv, env, launch):
    """Become the launcher of this machine's ranks, one per GPU or --nproc CPU ranks, as plan() planned it
    (launch: its 'nproc', 'backend', 'port', 'master_addr', and the words of its contract). Local mode: the
    whole job. A per-node launch (launch['node']: 'nnodes', 'node_rank'): this node's ranks of a job over
    several nodes, numbered as torchrun numbers them (node_rank x nproc + local rank), meeting at the
    launcher's master. The ranks share a fresh AIV_JOB_SECRET on one node (unless one is exported), die
    with the launcher (die_with_parent) and get its SIGTERM/SIGINT (Forward)."""
    nproc, node = launch["nproc"], launch.get("node") or {"nnodes": 1, "node_rank": 0}
    base, world = node["node_rank"] * nproc, node["nnodes"] * nproc
    port = launch["port"] or free_port()
    cmd = [sys.executable, os.path.abspath(__file__)] + list(argv)
    if launch["backend"] and not any(a == "--backend" or a.startswith("--backend=") for a in argv):
        cmd.append(f"--backend={launch['backend']}")
    procs = _start_ranks(cmd, env, launch, node, nproc, base, world, port)
    fwd = Forward(procs)
    # The ranks bound themselves; this is the launcher's own backstop. Once rank 0 has given
    # its verdict the others get a grace period to read it, then are killed (e.g. a frozen rank).
    deadline = time.monotonic() + worst_case(deadlines(args.timeout, args.rollcall_timeout, args.soak), True,
                                             soak=bool(args.soak)) + LAUNCHER_SLACK_S
    while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
        if procs[0].poll() is not None:
            deadline = min(deadline, time.monotonic() + 5.0)
        elif fwd.sig or (procs[1:] and all(p.poll() is not None for p in procs[1:])):  # rank 0 reporting, or frozen
            deadline = min(deadline, time.monotonic() + NAMING_S + ACKS_S + 5.0)
        time.sleep(0.05)
    alive = [p for p in procs if p.poll() is None]
    for p in alive:
        p.kill()
    for p in procs:
        p.wait()
    sweep_said(launch_key(os.getpid()))  # the ranks' speak-once markers: their launch is over
    return _launcher_verdict(procs, alive, fwd.sig, base, nproc, node)



# ============================================================================ aiv/node/workers.py
# Floor 6: the node gate's device workers: one process per device (this file again, with WORKER_VAR set) that
WORKER_VAR = "_AIV_NODE_WORKER"  # set for a node check's device worker (main() hands it to node_worker)


# ---------------------------------------------------------------------------------------------- a worker
def _failure(e):
    return {"error": first_line(e), "internal": is_tool_error(e)}


def _worker_say(step, **kw):
    """One step of a node-check worker: a JSON line on stdout."""
    emit(json.dumps(dict(kw, step=step), default=str))


def _worker_step(name, fn, need, until):
    """One measurement of a worker, when `need` seconds are left before `until`: its value or its error, said."""
    left = until - time.monotonic()
    if left < need:
        _worker_say(name, skipped=f"needs about {need:g}s, {max(0.0, left):.1f}s left")
        return
    t = time.monotonic()
    try:
        value = fn()
    except Exception as e:
        _worker_say(name, secs=round(time.monotonic() - t, 2), **_failure(e))
        return
    _worker_say(name, value=value, secs=round(time.monotonic() - t, 2))


def node_worker(spec):
    """One device of the node check, in a process of its own: import torch, the device's identity, then the
    numerics (numerics_measure) and the speed (screen_measure_gpu), each only when it fits in what is left of
    spec['seconds']; then the parent's commands on stdin (one JSON line each): 'speed' (measure again),
    'allreduce' (the node's own all-reduce with the other workers), 'exit'. Every step is one JSON line on
    stdout; the process ends itself at its bound."""
    t0 = time.monotonic()
    until = t0 + spec["seconds"]
    timer = threading.Timer(spec["seconds"] + 2.0, os._exit, [EXIT_TIMEOUT])  # the parent kills it before
    timer.daemon = True
    timer.start()
    say = _worker_say
    try:
        import torch
    except Exception as e:  # the tool's environment, not the node: the parent says NOT ASSESSED
        say("import", error=first_line(e))
        return 0
    kind, j = spec["kind"], spec["cuda"]
    if kind == "gpu" and torch.version.cuda is None and getattr(torch.version, "hip", None) is None:
        say("import", error=f"torch {torch.__version__} is a CPU-only build: GPUs are listed but this python "
                            "cannot use them")  # the tool's environment (a wrong venv), not the node
        return 0
    try:
        gpu, dev = None, "cpu"
        if kind == "gpu":
            problem = cuda_problem(torch)
            if problem != "none":
                raise RuntimeError(problem)  # the driver, the device or the build: judged as a device error
            torch.cuda.set_device(j)
            gpu, dev = collect_gpu(torch, j, spec["root"]), j
        say("ready", gpu=gpu, versions=torch_versions(torch), secs=round(time.monotonic() - t0, 2))
    except Exception as e:
        say("ready", **_failure(e))
        return 0
    step = functools.partial(_worker_step, until=until)
    uuid, pci = (gpu or {}).get("uuid"), (gpu or {}).get("pci")
    speed = functools.partial(screen_measure_gpu, torch, dev, kind, uuid, pci, spec["root"])
    if spec["numerics"]:
        step("numerics", lambda: numerics_measure(torch, dev, kind), NODE_STEP_S["numerics"][kind])
    if spec["speed"]:
        step("speed", speed, NODE_STEP_S["speed"][kind])
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["do"] == "speed":
            step("speed2", speed, cmd["need"])
        elif cmd["do"] == "allreduce":
            step("allreduce", lambda c=cmd: _allreduce(torch, kind, dev, c, until), 0.0)
        else:
            break
    flush_all()
    os._exit(0)  # every line is out: the interpreter's and torch's teardown would only hold the check up


def _allreduce(torch, kind, dev, cmd, until):
    """This worker's part of the node's all-reduce: a group of the node's workers on 127.0.0.1 (NCCL on GPUs,
    gloo on CPU), each adding rank + 1: every element must be n(n+1)/2; then busbw measured twice."""
    import torch.distributed as dist
    n, rank = cmd["n"], cmd["rank"]
    device = torch.device("cuda", dev) if kind == "gpu" else torch.device("cpu")
    kw = {"backend": "nccl" if kind == "gpu" else "gloo", "init_method": f"tcp://127.0.0.1:{cmd['port']}",
          "rank": rank, "world_size": n, "timeout": datetime.timedelta(seconds=max(2.0, until - time.monotonic()))}
    if kind == "gpu":
        kw["device_id"] = device
    dist.init_process_group(**kw)
    try:
        x = torch.full((1 << 16,), float(rank + 1), device=device)
        dist.all_reduce(x)
        want = n * (n + 1) / 2
        bad = (x != want).nonzero()
        got = float(x[bad[0, 0]]) if len(bad) else want
        bw = [round(screen_busbw(torch, dist, None, n, device, kind)[0], 4) for _ in range(2)]
    finally:
        with contextlib.suppress(Exception):
            dist.destroy_process_group()
    return {"n": n, "ok": not len(bad), "want": want, "got": got, "busbw": bw}


class _Workers:
    """The node check's worker processes: each in a session of its own (killed as a group), dead with the
    check (die_with_parent), its stdout read line by line by a thread into one queue."""

    def __init__(self, specs, env):
        self.q, self.procs, self.said, self.dead, self.errs = queue.Queue(), {}, {}, set(), {}
        for i, (spec, wenv) in specs.items():
            err = tempfile.TemporaryFile()
            p = subprocess.Popen([sys.executable, os.path.abspath(__file__), WORKER_ARG], env=dict(env, **wenv,
                                 **{WORKER_VAR: json.dumps(spec)}), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                 stderr=err, text=True, start_new_session=True,
                                 preexec_fn=die_with_parent(signal.SIGKILL))
            self.procs[i], self.said[i], self.errs[i] = p, {}, err
            threading.Thread(target=self._read, args=(i, p.stdout), daemon=True).start()

    def _read(self, i, stream):
        with contextlib.suppress(Exception):
            for line in stream:
                self.q.put((i, line))
        self.q.put((i, None))

    def wait(self, steps, ids, until, stopped):
        """Lines until each of ids said each of steps (or ended), `until`, or stopped(). -> whether all did."""
        while True:
            pending = [i for i in ids if i not in self.dead and not all(s in self.said[i] for s in steps)]
            left = until - time.monotonic()
            if not pending:
                return True
            if left <= 0 or stopped():
                return False
            try:
                i, line = self.q.get(timeout=min(0.2, left))
            except queue.Empty:
                continue
            if line is None:
                self.dead.add(i)
                continue
            with contextlib.suppress(ValueError):
                msg = json.loads(line)
                if isinstance(msg, dict) and "step" in msg:
                    self.said[i][msg["step"]] = msg

    def send(self, i, **cmd):
        with contextlib.suppress(OSError, ValueError):
            self.procs[i].stdin.write(json.dumps(cmd) + "\n")
            self.procs[i].stdin.flush()

    def take(self, ids, steps, measured, skipped):
        """What the workers said for these steps -> measured[i][step], their errors noted; skips (a step the
        budget ended first, a step a worker skipped) appended to skipped."""
        for i in ids:
            m = measured.setdefault(i, {})
            said = self.said[i]
            if "import" in said:
                m["import"] = said["import"]["error"]
                continue
            for s in steps:
                if m.get("error") or m.get("internal") or m.get("died"):
                    break  # nothing more comes from this worker
                msg = said.get(s)
                if msg is None:
                    if i in self.dead:
                        rc = self.procs[i].poll()
                        m["died"] = (f"ended ({'killed by signal ' + str(-rc) if rc and rc < 0 else f'exit {rc}'}) "
                                     f"before its {s} step: {self.stderr_tail(i) or 'no error on stderr'}")
                    elif s != "ready":
                        skipped.append(f"{s} on GPU {i} (the budget ended first)")
                    continue
                if msg.get("skipped"):
                    skipped.append(f"{s} on GPU {i} ({msg['skipped']})")
                elif msg.get("error"):
                    m["internal" if msg.get("internal") else "error"] = f"{s}: {msg['error']}"
                elif s == "ready":
                    m["ready"], m["gpu"], m["versions"] = True, msg.get("gpu"), msg.get("versions")
                else:
                    m[s] = msg.get("value")

    def allreduce_result(self, ok, done):
        """The node's all-reduce as its workers said it: {'n', 'error', 'internal'} on an error, the first
        worker's wrong sums or any worker's value when all answered in time, else None."""
        said = [self.said[i].get("allreduce") for i in ok]
        errors = [m for m in said if m and m.get("error")]
        if errors:
            return {"n": len(ok), "error": errors[0]["error"], "internal": errors[0].get("internal")}
        if done and all(m and isinstance(m.get("value"), dict) for m in said):
            vals = [m["value"] for m in said]
            return dict(next((v for v in vals if not v["ok"]), None) or vals[0])
        return None

    def stderr_tail(self, i):
        with contextlib.suppress(OSError, ValueError):
            self.errs[i].seek(0)
            lines = [ln.strip() for ln in self.errs[i].read().decode(errors="replace").splitlines() if ln.strip()]
            return lines[-1][:200] if lines else ""
        return ""

    def close(self, grace=1.0):
        for i in self.procs:
            self.send(i, do="exit")
        until = time.monotonic() + grace
        for p in self.procs.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=max(0.0, until - time.monotonic()))
        until = time.monotonic() + CHILD_REAP_S  # a worker stuck in the driver (state D) is left behind, said
        for p in self.procs.values():
            with contextlib.suppress(OSError):
                os.killpg(p.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=max(0.0, until - time.monotonic()))
            for s in (p.stdin, p.stdout):
                with contextlib.suppress(OSError, ValueError):
                    s.close()
        for e in self.errs.values():
            e.close()
        return [f"the worker of device {i} (pid {p.pid}) did not end when killed: stuck, not reaped (state "
                f"{proc_state(p.pid) or '?'}{': in the kernel, a driver call' if proc_state(p.pid) == 'D' else ''})"
                for i, p in self.procs.items() if p.poll() is None]


# ---------------------------------------------------------------------------------------------- the pass's compute
class NodeCompute:
    """The pass's device step (compute): workers on the devices the plan allows, the slow ones measured
    again, the node's all-reduce. Mixed into NodeCheck: the state it fills (workers, measured, again,
    why_once, allreduce, skipped) is the pass's."""

    def compute(self):
        """Workers on the devices the plan allows; the re-measure of the slow ones; the node's all-reduce."""
        a, ids = self.args, self.devices["compute"]
        numerics, speed = not a.skip_numerics, not a.skip_screen
        if speed and self.unlocked and ids:  # a health pass may compute beside us: the speed is not the GPUs'
            speed = False
            self.skipped.append("the speed and the all-reduce (without the lock: a health pass may compute beside "
                                "this one)")
        if not ids or not (numerics or speed):
            if ids:
                self.skipped.append("numerics and speed (--skip-numerics, --skip-screen)")
            return
        kind = "cpu" if self.cpu else "gpu"
        if self.left() < 2.0:
            self.skipped.append(f"every device step (the passive checks left {max(0.0, self.left()):.1f}s)")
            return
        wenv = {"GLOO_SOCKET_IFNAME": "lo", "PYTHONUNBUFFERED": "1"}
        if self.cpu:
            wenv["CUDA_VISIBLE_DEVICES"] = ""
        else:
            uuids = {g["index"]: g.get("uuid") for g in self.gpus}
            wenv.update(CUDA_VISIBLE_DEVICES=",".join(uuids.get(i) or str(i) for i in ids),
                        CUDA_DEVICE_ORDER="PCI_BUS_ID")  # the driver's order, as nvidia-smi's indices
        specs = {i: ({"kind": kind, "id": i, "cuda": k, "seconds": round(self.left(), 2), "root": self.root,
                      "numerics": numerics, "speed": speed}, dict(wenv, LOCAL_RANK=str(i)))
                 for k, i in enumerate(ids)}
        self.workers = w = _Workers(specs, self.env)
        steps = ["ready"] + (["numerics"] if numerics else []) + (["speed"] if speed else [])
        w.wait(steps, ids, self.until, lambda: self.stopped)
        w.take(ids, steps, self.measured, self.skipped)
        ok = [i for i in ids if self.measured[i].get("ready") and not self.measured[i].get("error")]  # it worked
        first = {i: self.measured[i]["speed"] for i in ok if isinstance(self.measured[i].get("speed"), dict)}
        slow = speed_flagged(self.node, first, gpus_by_id(self.gpus, self.measured), self.cpu, a.min_tflops,
                             a.min_hbm)
        if slow and not self.stopped:
            need = max(w.said[i]["speed"].get("secs", 0.0) for i in slow) + 1.0
            if self.left() < need:
                self.why_once = f"the re-measure needs about {need:.1f}s, {max(0.0, self.left()):.1f}s left"
            else:
                for i in slow:
                    w.send(i, do="speed", need=need)
                w.wait(["speed2"], slow, self.until, lambda: self.stopped)
                w.take(slow, ["speed2"], self.measured, self.skipped)
                self.again = {i: self.measured[i]["speed2"] for i in slow
                              if isinstance(self.measured[i].get("speed2"), dict)}
                if len(self.again) < len(slow):
                    self.why_once = "the re-measure did not finish within the budget"
        if speed and len(ok) >= 2 and not self.stopped:
            self.node_allreduce(ok, kind)

    def node_allreduce(self, ok, kind):
        w, need = self.workers, NODE_STEP_S["allreduce"][kind]
        if self.left() < need:
            self.skipped.append(f"the all-reduce (needs about {need:g}s, {max(0.0, self.left()):.1f}s left)")
            return
        port = free_port()
        for r, i in enumerate(ok):
            w.send(i, do="allreduce", port=port, n=len(ok), rank=r)
        self.allreduce = w.allreduce_result(ok, w.wait(["allreduce"], ok, self.until, lambda: self.stopped))
        if self.allreduce is None and not self.stopped:
            self.skipped.append("the all-reduce (did not finish within the budget)")



# ============================================================================ aiv/node/lock.py
# Floor 6: the node gate's lock (NodeLock, mixed into NodeCheck): one pass touches the GPUs at a time; a job's
class NodeLock:
    """take_lock and what it needs: the lock file in a root-owned directory (node_lock_path), taken shared
    or alone by context, the holder's pid written, a health pass preempted. Mixed into NodeCheck: the
    state it fills (lock_fd, unlocked, skipped, findings, locked_out) is the pass's."""

    def take_lock(self):
        """health, npd: the lock alone (another pass running: not assessed); prolog, epilog: shared with each other
        (jobs on other GPUs of the node start and end side by side), and a health or npd pass holding it is
        stopped (SIGTERM): a job start wins over a health pass. The lock is in a root-owned directory
        (node_lock_path), never under a job's TMPDIR. A prolog or epilog that could not take it goes on without
        it (self.unlocked says why): its GPUs' processes are not judged then, nor its speed (a health pass's
        workers may be on them). -> False when this pass must not go on."""
        path, why = node_lock_path(self.node, getattr(self.args, "node_lock_dir", None))
        job = self.ctx in ("prolog", "epilog")
        try:
            fd = os.open(path, os.O_CREAT | os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644) if path else None
        except OSError as e:
            fd, why = None, f"{path}: {e.strerror}"
        if fd is None:
            self.unlocked = f"the node check's lock could not be opened ({why})"
            self.skipped.append(f"no lock ({why})")
            return True
        self.lock_fd = fd
        mode = fcntl.LOCK_SH if job else fcntl.LOCK_EX
        try:
            fcntl.flock(fd, mode | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = (read_text(path, "") or "").split()
            if not job:
                who = f" (pid {holder[0]}, {holder[1]})" if len(holder) >= 2 else " (a job's prolog or epilog)"
                self.findings.append(unassessed("interrupted", f"{self.node}: another node check holds {path}{who}: "
                                                "this pass did not run (its files are left to that pass)",
                                                "another node check is running"))
                self.locked_out = True
                return False
            self._preempt(holder)
            if not self._wait_lock(fd, mode):
                who = f" (pid {holder[0]})" if holder else ""
                self.unlocked = f"the health pass holding {path}{who} did not let go within {NODE_PREEMPT_S:g}s"
                self.skipped.append(self.unlocked)
                return True
        except OSError as e:
            self.unlocked = f"the node check's lock {path} could not be taken ({e.strerror})"
            self.skipped.append(self.unlocked)
            return True
        if not job:
            with contextlib.suppress(OSError):
                os.ftruncate(fd, 0)
                os.write(fd, f"{os.getpid()} {self.ctx}\n".encode())
        return True

    def _wait_lock(self, fd, mode):
        until = time.monotonic() + NODE_PREEMPT_S
        while True:
            try:
                fcntl.flock(fd, mode | fcntl.LOCK_NB)
                return True
            except BlockingIOError:
                if time.monotonic() > until or self.stopped:
                    return False
                time.sleep(0.1)

    def _preempt(self, holder):
        """SIGTERM to the health or npd pass holding the lock, when that pid is a node check."""
        if not holder or not holder[0].isdigit():
            return
        cmd = read_text(f"/proc/{holder[0]}/cmdline", "") or ""
        if "--node-check" in cmd:
            with contextlib.suppress(OSError):
                os.kill(int(holder[0]), signal.SIGTERM)



# ============================================================================ aiv/node/check.py
# Floor 6: the node gate's runtime (--node-check [CONTEXT]): this node alone, no other node, no srun. A lock
# ---------------------------------------------------------------------------------------------- the check
class NodeCheck(NodeLock, NodeCompute):
    """One pass of the node gate in its context, within its budget; run() -> the state (the JSON's dict). Its
    lock (NodeLock) and its device step (NodeCompute) are mixed in."""

    def __init__(self, args, env, context, problem=None):
        self.args, self.env, self.ctx, self.problem = args, env, context, problem
        self.t0, self.wall0 = time.monotonic(), time.time()
        self.node = env.get("SLURMD_NODENAME") or socket.gethostname()
        self.root = args.sysfs_root
        self.budget = float(args.node_budget)
        self.until = self.t0 + self.budget - NODE_RESERVE_S
        self.findings, self.skipped, self.stopped, self.workers = [], [], None, None
        self.measured, self.allreduce, self.slurm, self.lock_fd = {}, None, None, None
        self.facts, self.devices, self.gpus = {}, {"ids": [], "held": {}, "busy": {}, "compute": []}, []
        self.cpu, self.again, self.why_once, self.phases, self.locked_out = False, {}, None, {}, False
        self.expect = []  # what the node should have (node_expectations), [(source words, count)]
        self.unlocked, self.procs_unjudged = None, None

    def lap(self, name):
        """Seconds since the last lap (or the start) under name: where the budget went."""
        now = time.monotonic()
        self.phases[name] = round(max(0.0, now - self.t0 - sum(self.phases.values())), 2)

    def left(self):
        return self.until - time.monotonic()

    def on_signal(self, signum, frame):
        self.stopped = signal.Signals(signum).name
        if self.workers is not None:
            for p in self.workers.procs.values():
                with contextlib.suppress(OSError):
                    os.killpg(p.pid, signal.SIGKILL)

    # ------------------------------------------------------------------ passive facts
    def bound(self, most):
        """A call's bound before the verdict: at most `most`, within what is left for the facts and the workers."""
        return max(0.5, min(most, self.left()))

    def verdict_bound(self, most=NODE_SLURM_BOUND_S):
        """A call's bound at the verdict: at most `most`, within the whole budget (the reserve is for these)."""
        return max(1.0, min(most, self.t0 + self.budget - time.monotonic()))

    def passive(self):
        """NVML's GPUs and their processes (nvidia-smi), the PCI bus, the driver's list, the kernel log's Xid
        lines, the job's GPUs and, in health, Slurm's view of the node (one scontrol call)."""
        f, root = self.facts, self.root
        f["pci"], f["driver"] = pci_gpus(root), driver_gpus(root)
        exe = shutil.which("nvidia-smi")
        f["rows"], f["lost"], f["apps"] = [], [], []
        if exe:
            r = smi_query(exe, "gpu", NODE_GPU_FIELDS, self.bound(NODE_SMI_BOUND_S))
            if "text" in r:
                f["rows"], f["lost"] = parse_node_gpus(r["text"])
            else:
                f["smi_unread"] = r["unread"]
            a = {"unread": "not asked: the GPU query was not read"} if f.get("smi_unread") and "gave no answer" in \
                f["smi_unread"] else smi_query(exe, "compute-apps", NODE_APP_FIELDS, self.bound(NODE_SMI_BOUND_S))
            if "text" in a:
                f["apps"] = [dict(p, **{k: v for k, v in process_owner(p["pid"], root).items() if v})
                             for p in parse_compute_apps(a["text"])]
            else:
                f["apps_unread"] = a["unread"]
        elif f["driver"] or f["pci"]:
            f["smi_unread"] = "nvidia-smi is not on PATH"
        if f["apps"] and self.ctx in ("prolog", "epilog"):
            self.held_again(exe)
        for g in f["rows"]:
            numa = (read_text(os.path.join(root, "sys/bus/pci/devices", g["pci"] or "-", "numa_node")) or "").strip()
            g["numa"] = int(numa) if numa.lstrip("-").isdigit() else None
        k = read_kmsg(root, NODE_KMSG_BOUND_S, NODE_KMSG_BYTES)
        f["xids"], f["kmsg_unread"] = parse_xids(k.get("text")), k.get("unread")
        f["job_gpus"] = None
        if self.ctx in ("prolog", "epilog") and self.env.get("SLURM_JOB_ID"):
            raw = self.env.get("SLURM_JOB_GPUS")
            f["job_gpus"] = parse_gpu_ids(raw) if raw else []  # a job without GPUs: none of them is checked
            if raw and f["job_gpus"] is None:
                self.findings.append(unassessed("contract", f"{self.node}: SLURM_JOB_GPUS={raw!r} is not a list of "
                                                "GPU indices: the job's GPUs are unknown", "SLURM_JOB_GPUS unreadable"))
        if self.ctx == "health":
            s = read_slurm_node(self.node, self.bound(NODE_SLURM_BOUND_S))
            self.slurm = parse_slurm_node(s["text"]) if "text" in s else {"unread": s["unread"]}

    def held_again(self, exe):
        """prolog, epilog: the processes on the job's GPUs looked for again NODE_HELD_AGAIN_S later; only those still
        there count (a process tearing down at the job's boundary is not a leftover)."""
        f, ids = self.facts, parse_gpu_ids(self.env.get("SLURM_JOB_GPUS"))  # None: every GPU
        job = {g["uuid"] for g in f["rows"] if ids is None or g["index"] in ids}
        if not any(p["uuid"] in job for p in f["apps"]):
            return
        time.sleep(max(0.0, min(NODE_HELD_AGAIN_S, self.left())))
        a = smi_query(exe, "compute-apps", NODE_APP_FIELDS, self.bound(NODE_SMI_BOUND_S))
        if "text" in a:
            still = {(p["pid"], p["uuid"]) for p in parse_compute_apps(a["text"])}
            f["apps"] = [p for p in f["apps"] if (p["pid"], p["uuid"]) in still]

    def plan(self):
        f, a = self.facts, self.args
        given = None if a.expect_gpus is None else (a.origin.get("expect_gpus", "--expect-gpus"), a.expect_gpus)
        self.expect = node_expectations(given, (self.slurm or {}).get("gres"), f["pci"], f["driver"])
        keep = self.procs_we_cannot_judge if self.ctx in ("prolog", "epilog") else None
        self.cpu, self.gpus, self.devices = node_plan(self.ctx, f, self.slurm, a.nproc or 2, self.expect, keep)
        if f.get("apps_unread") and self.ctx in ("prolog", "epilog"):
            self.findings.append(unassessed("gpu-procs", f"{self.node}: the GPUs' processes were not read "
                                            f"({f['apps_unread']})", "GPU processes not read"))

    def procs_we_cannot_judge(self, by_uuid, apps):
        """prolog, epilog: the processes on the GPUs that are not a leftover's: without the lock none is judged
        (a health pass's workers may be on them); a node check's own worker (of a health pass stopped a moment
        ago, or stuck in the driver) is ours, never a leftover. Either: gpu-procs not judged, said. -> the apps
        that remain to judge ({index: [process]})."""
        ours = sorted({(by_uuid[p["uuid"]], p["pid"]) for p in self.facts["apps"]
                       if p.get("ours") and p["uuid"] in by_uuid})
        why = None
        if self.unlocked:
            why = f"{self.unlocked}: the GPUs' processes were not judged (a node check's own workers may be on them)"
        elif ours:
            why = ("a node check's own worker is still on " + ", ".join(f"GPU {i} (pid {pid})" for i, pid in ours)
                   + ": not a leftover of a job; the GPUs' processes were not judged")
        if not why:
            return apps
        self.procs_unjudged = why
        self.findings.append(unassessed("gpu-procs", f"{self.node}: {why}", "GPU processes not judged: " + (
            "no lock" if self.unlocked else "our own worker on a GPU")))
        if self.unlocked:
            return {}
        theirs = {i: [p for p in ps if not p.get("ours")] for i, ps in apps.items()}
        return {i: ps for i, ps in theirs.items() if ps}  # another's process beside ours is still judged

    # ------------------------------------------------------------------ judge
    def judge(self):
        """The pass's plain data, with what the judges need read from the node (the driver, the CPU model, the
        manifest and the node's facts), judged by node_judge.judge_node."""
        a, manifest, facts = self.args, None, None
        if a.manifest:
            try:
                manifest = load_manifest(a.manifest, a.origin.get("manifest", "--manifest"))
            except Exception as e:
                manifest = {"error": str(e)}
            else:
                facts = collect_node_facts(self.root, None, "gloo", len(self.devices["ids"]), self.env)
        self.findings += judge_node({
            "node": self.node, "ctx": self.ctx, "cpu": self.cpu, "facts": self.facts, "gpus": self.gpus,
            "devices": self.devices, "measured": self.measured, "again": self.again, "why_once": self.why_once,
            "allreduce": self.allreduce, "expectations": self.expect, "min_tflops": a.min_tflops,
            "min_hbm": a.min_hbm, "min_busbw_intra": a.min_busbw_intra, "python": sys.executable,
            "driver": _driver_version(self.root), "cpu_model": _cpu_model(), "manifest": manifest, "node_facts": facts})

    # ------------------------------------------------------------------ the pass
    def run(self):
        try:
            if self.problem:
                self.findings.append(unassessed("contract", f"{self.node}: {self.problem}", self.problem[:80]))
            elif self.take_lock():
                self.lap("lock")
                self.passive()
                self.plan()
                self.lap("passive")
                self.compute()
                self.lap("compute")
                if self.stopped:
                    self.findings.append(unassessed("interrupted", f"{self.node}: stopped by {self.stopped} (a job's "
                                                    "prolog taking the GPUs, or Slurm): this pass is void",
                                                    f"stopped by {self.stopped}"))
                self.judge()
                if self.procs_unjudged:  # its PASS would say "no process of others": not judged, said above
                    self.findings[:] = [f for f in self.findings if f["check"] != "gpu-procs" or f["status"] != "PASS"]
                self.findings += judge_none_judged(self.node, self.devices, "CPU worker(s)" if self.cpu else "GPU(s)")
                self.lap("judge")
        except Exception as e:
            print_traceback(e)
            self.findings.append(unassessed("internal", f"{self.node}: {first_line(e)} in {where_raised(e)}: a bug in "
                                            "the tool, not a fault of the node (the traceback is on stderr)",
                                            "tool error: " + first_line(e)[:60]))
        finally:
            if self.workers is not None:
                self.skipped += self.workers.close(min(1.0, max(0.2, self.t0 + self.budget - time.monotonic() - 2.0)))
                self.lap("workers-exit")
        return self.finish()

    def finish(self):
        v = node_verdict(self.findings, self.ctx)
        for f in self.findings:
            f["drains"] = drains_in(f, self.ctx)
        try:
            drain = node_drain(self.ctx, v, self.findings, self.args, self.node, self.slurm, self.verdict_bound())
        except Exception as e:
            print_traceback(e)
            drain = {"action": "none", "done": False, "said": f"nothing drained: {first_line(e)}"}
        self.lap("slurm")
        dev = self.devices
        state = {"schema_version": SCHEMA_VERSION, "tool": "ai-infra-validator", "version": VERSION,
                 "mode": "node-check", "context": self.ctx, "node": self.node, "verdict": v["verdict"],
                 "drainable": v["drainable"], "exit_code": v["exit_code"], "cpu": bool(getattr(self, "cpu", False)),
                 "started_at": datetime.datetime.fromtimestamp(self.wall0, datetime.timezone.utc).isoformat(
                     timespec="seconds"),
                 "budget_s": self.budget, "elapsed_s": round(time.monotonic() - self.t0, 2),
                 "ended_at_s": round(time.time(), 1), "python": sys.executable, "phases": self.phases,
                 "gpus": [{k: g.get(k) for k in ("index", "uuid", "pci", "name", "numa", "mem_used_mib",
                                                 "mem_total_mib")} for g in self.gpus],
                 "devices": {"ids": dev["ids"], "compute": dev["compute"],
                             **{k: {str(i): x for i, x in dev[k].items()} for k in ("busy", "held")}},
                 "measured": {str(i): {k: m.get(k) for k in ("numerics", "speed", "speed2", "error", "versions")}
                              for i, m in self.measured.items()},
                 "allreduce": self.allreduce, "skipped": self.skipped, "findings": self.findings, "drain": drain,
                 "facts": dict({k: self.facts.get(k) for k in ("pci", "driver", "lost", "kmsg_unread", "smi_unread",
                                                               "apps_unread", "job_gpus")},
                               xids=(self.facts.get("xids") or [])[-50:]),  # the last 50 (the findings count all)
                 "slurm": self.slurm, "locked_out": self.locked_out}
        state["summary"] = node_summary(state)
        state["npd"] = node_npd_line(state)
        return state


def _output_paths(args):
    return [(flag, path) for flag, path in (("--json", getattr(args, "json", None)),
                                            ("--metrics", getattr(args, "metrics", None))) if path]


def _write_one(flag, path, state, seconds):
    """One file within `seconds` (on a thread: storage that hangs holds that thread, never the pass) -> None or
    why it was not written."""
    def write():
        if flag == "--json":
            write_json_atomic(path, state)
        else:
            write_text_atomic(path, node_metrics(state))
    try:
        within(write, seconds, f"{flag} {path}")
    except BoundPassed:
        return f"not written within {seconds:.1f}s (storage that hangs?)"
    except Exception as e:
        return first_line(e)
    return None


def write_outputs(paths, state, until):
    """The JSON and the Prometheus textfile, each atomically, all by `until` (what is left of the budget, at
    least 1 s). A file not written is the tool's own trouble: the pass becomes NOT ASSESSED (a FAIL on evidence
    stays a FAIL), the files written before it are written again to say so, and the exit code is the new
    verdict's. -> the state as it stands, and a WARNING line per file not written."""
    said, done = [], []
    for k, (flag, path) in enumerate(paths):
        why = _write_one(flag, path, state, max(1.0, (until - time.monotonic()) / (len(paths) - k)))
        if why is None:
            done.append((flag, path))
            continue
        said.append(f"WARNING: output: {path} not written: {why}")
        state = node_not_written(state, flag, path, why)
        for flag2, path2 in done:  # they said what the pass was before it: said again, within what is left
            if _write_one(flag2, path2, state, max(0.5, until - time.monotonic())):
                said.append(f"WARNING: output: {path2} keeps the verdict before {path} failed")
    return state, said


def run_node_check(args, env):
    """--node-check: one pass in its context; the summary line on stdout (NPD: its one line), a line per finding
    on stderr, the files; -> the context's exit code. Whatever escapes (a bug in the verdict's own code) is NOT
    ASSESSED with the context's code: never an exit 1 that would read as evidence."""
    ctx, problem = node_context(args.node_check, env)
    try:
        check = NodeCheck(args, env, ctx, problem)
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, check.on_signal)
        state = check.run()
        for line in node_lines(state):
            emit(line, sys.stderr)
        if not state["locked_out"]:  # the pass that holds the lock writes the files
            state, said = write_outputs(_output_paths(args), state, check.t0 + check.budget)
            for line in said:
                emit(line, sys.stderr)
        emit(state["npd"] if ctx == "npd" else state["summary"])
        return state["exit_code"]
    except Exception as e:
        print_traceback(e)
        return node_check_usage(f"internal: {first_line(e)} in {where_raised(e)}: a bug in the tool", [], env, ctx,
                                args)


def node_check_usage(e, argv, env, ctx=None, args=None):
    """A usage error on a --node-check command line (or the tool's own error): not the node's fault (fail open):
    the line on stderr, NOT ASSESSED on stdout and in the --json and --metrics files asked for (aiv_node_check_
    assessed 0, within NODE_RESERVE_S), and the context's exit code: 0; npd 2; a context word that is none of
    the four, in no Slurm script: 2 (NPD's unknown; Slurm's HealthCheckProgram only logs it)."""
    t0 = time.monotonic()
    ctx = ctx or context_from_argv(argv, env) or "health"
    node = env.get("SLURMD_NODENAME") or socket.gethostname()
    emit(str(e), sys.stderr)
    code = node_exit_code(ctx, "NOT ASSESSED", False) if ctx in NODE_CONTEXTS else 2
    reason = str(e).replace("FAILURE: ", "")
    line = f"{NODE_LINE_PREFIX} NOT ASSESSED on {node} [{ctx}]: {e}; exit {code} (fail open: nothing drained)"
    state = node_usage_state(ctx, node, reason, code, line, round(time.time(), 1), sys.executable)
    with contextlib.suppress(Exception):
        paths = _output_paths(args) if args is not None else output_paths_from_argv(argv, env)
        _, said = write_outputs(paths, state, t0 + NODE_RESERVE_S)
        for w in said:
            emit(w, sys.stderr)
    emit(state["npd"] if ctx == "npd" else line)
    return code



# ============================================================================ aiv/main.py
# Floor 6: the entry point.
def _rank_hint(env):
    """This process's rank when it can be read at all (to print usage errors once, not per rank)."""
    for var in ("RANK", "SLURM_PROCID"):
        with contextlib.suppress(KeyError, ValueError):
            return int(env[var])
    return None


def report_usage(e, env):
    """Print a usage error's one line where it belongs; returns EXIT_USAGE. A process started by hand
    speaks. Under a launcher, rank 0 speaks for what every rank shares (flags, AIV_* variables, WORLD_SIZE,
    MASTER_*), and a rank whose own values are wrong (or unreadable) speaks once per node, since rank 0
    cannot see them. argparse's usage text goes to stderr with a flag's line."""
    line, rank = str(e), _rank_hint(env)
    if any(v in env for v in LAUNCHER_VARS) and (e.own or rank is None):
        # once per node among the ranks one launcher started: the marker is keyed by the launcher's identity and
        # start time, and by MASTER_PORT, so every launch speaks
        try:
            local_rank = int(env.get("LOCAL_RANK") or env.get("SLURM_LOCALID") or 0)
        except ValueError:
            local_rank = 0
        parent_start = (proc_stat(os.getppid()) or ("", ""))[1]
        topic = f"usage-{parent_start}-{env.get('MASTER_PORT', '')}-{env.get('TORCHELASTIC_RESTART_COUNT', '')}"
        speak_once_per_node(line, env, local_rank, topic[:120])
    elif not any(v in env for v in LAUNCHER_VARS) or rank == 0:
        emit(line)
        if line.startswith("FAILURE: usage:"):
            emit(build_parser().format_usage().rstrip() + "  (--help for more)", sys.stderr)
    return EXIT_USAGE


def probe(fn, what, prefix="FAILURE: usage: "):
    """A probe of the run's files before torch (their directories on shared storage, the manifest), within
    OUTPUT_S: storage that does not answer is one usage line, never a hang before the run even starts."""
    try:
        return within(fn, OUTPUT_S, what)
    except BoundPassed:
        raise UsageError(f"{prefix}{what} did not answer within {OUTPUT_S:g}s (shared storage that hangs?): "
                         "point them at storage that answers, or leave them out") from None


FALLBACK_VAR = "_AIV_FALLBACK_VERDICT"  # set by submit_smoke_test.sbatch: write the verdict rank 0 left none of


def write_fallback(argv):
    """The batch file's verdict where rank 0 left none, through the one fallback writer (fallback_verdict, the
    gate): argv PATH CODE CHECK BLAME REASON [HOST]. Prints its FAILURE line and writes PATH unless a verdict
    JSON is there already (the first writer wins). -> 0 written (or already there), 1 not written."""
    path, code, check, blame, reason, *hosts = argv
    state = fallback_verdict([rank0_lost(reason, (hosts or [None])[0], blame, int(code), check)], int(code), None,
                             "submit_smoke_test.sbatch")
    emit("\n".join(state["failures"]))
    try:
        within(lambda: write_json_atomic(path, state, first=True), OUTPUT_S, f"writing the verdict JSON {path}")
    except OSError as e:  # BoundPassed too
        emit(f"WARNING: could not write the verdict JSON {path}: {first_line(e)}", sys.stderr)
        return EXIT_FAIL
    return EXIT_PASS


def rank_run(args, contract, env):
    """The role of this rank: Coordinator on rank 0, Follower on every other."""
    return (Coordinator if contract["rank"] == 0 else Follower)(args, contract, env)


def run_verify_log(args):
    """--verify-log FILE (never empty: plan() refuses that): 0 the log shows a clean PASS, 1 it does not,
    2 the file cannot be read."""
    try:
        with open(args.verify_log, "rb") as f:
            text = read_log_lines(f)
    except OSError as e:
        emit(f"FAILURE: usage: --verify-log: cannot read {args.verify_log}: {e.strerror or e}")
        return EXIT_USAGE
    ok, problems, facts = verify_log(text, {"world_size": args.expect_world_size, "nodes": args.expect_nodes,
                                            "ranks_per_node": args.expect_ranks_per_node}, strict=args.strict)
    for p in problems:
        emit(f"verify-log: MISSING/BAD: {p}")
    emit(f"verify-log: {'PASS' if ok else 'FAIL'} {args.verify_log} world_size={facts.get('world_size')} "
         f"nodes={facts.get('nodes')} torch={facts.get('torch')}")
    return EXIT_PASS if ok else EXIT_FAIL


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    guard_std_streams()  # a closed stdout or stderr: the lines go nowhere, the verdict and the files stay
    env = dict(os.environ)
    if "_AIV_NODE_MONITOR" in env:  # a node leader's liveness monitor (see node_monitor)
        try:
            return node_monitor(json.loads(env["_AIV_NODE_MONITOR"]))
        except Exception as e:  # a store that went away ends it quietly (the run ended); a bug says so
            if not is_tool_error(e):
                return 0
            emit(f"WARNING: the node monitor on {socket.gethostname()} stopped: {first_line(e)} in "
                 f"{where_raised(e)} (a bug in the tool): rank 0 reads this node's ranks from their beats alone",
                 sys.stderr)  # where a node monitor is started by hand; a rank's monitor has no stderr (srun)
            return EXIT_INTERNAL
    if FALLBACK_VAR in env:  # the batch file's verdict where rank 0 left none
        return write_fallback(argv)
    if WORKER_VAR in env:  # a device worker of --node-check
        return node_worker(json.loads(env[WORKER_VAR]))
    try:
        p = plan(argv, env)
        if p.get("check_json"):
            probe(lambda: check_json_target(p["args"]), "--json, --metrics and --html: their directories")
    except UsageError as e:
        if any(a == "--node-check" or a.startswith("--node-check=") for a in argv):
            return node_check_usage(e, argv, env)  # fail open: a wrong recipe never fails a prolog
        return report_usage(e, env)
    if p["mode"] in ("help", "version"):
        emit(p["text"].rstrip())
        return EXIT_PASS
    alone = {"verify-log": run_verify_log, "diff-manifest": lambda a: run_diff_manifest(a.diff_manifest),
             "node-check": lambda a: run_node_check(a, env)}  # no torch: a log, two files, this node alone
    if p["mode"] in alone:
        return alone[p["mode"]](p["args"])
    if p.get("check_json"):  # rank 0's process or its node's launcher: the manifests, before torch and NCCL
        try:
            probe(lambda: manifest_preflight(p["args"]), "--manifest and --save-manifest", prefix="")
        except UsageError as e:
            emit(f"FAILURE: usage: {e}")
            return EXIT_USAGE
    if p["mode"] == "local":
        return launch_local(p["args"], argv, env, p["launch"])
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT})  # taken by RankRun.on_signal only
    rank_run(p["args"], p["contract"], env).run()
    return EXIT_FAIL  # not reached: run() always exits the process


if __name__ == "__main__":
    sys.exit(main())
