"""Floor 1: the tool's constants and stable names (CHECKS, exit codes), findings and verdict codes,
hostlists and ranges, and the one idiom for the tool's own errors (no host blamed)."""
import contextlib
import itertools
import os
import re
import sys
import time

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
