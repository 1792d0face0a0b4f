"""Floor 3: the node gate (--node-check): its contexts, the checks it runs in each with whether they may drain
and why their evidence persists (NODE_CHECKS), what nvidia-smi, Slurm and the kernel log say as plain data,
and the judges of one node's facts and measurements. Every finding it makes carries `evidence`: a word from
EVIDENCE_SINGLES when it singles this node out (only those fail a prolog, drain or make an NPD problem), from
EVIDENCE_NAMES_NONE when it does not. Pure: plain data in, findings out."""
import re

from .base import finding, format_ranges, human_bytes, parse_ranges, scontrol_reason
from .blame import LOCALISING, UNLOCALISED, drainable
from .collect import THROTTLE_FAULTS, throttle_names
from .manifest import judge_manifest
from .numerics import judge_numerics, numerics_group
from .screen_gpu import judge_gpu_perf

NODE_CONTEXTS = ("prolog", "epilog", "health", "npd")
SCRIPT_CONTEXTS = {"prolog_slurmd": "prolog", "epilog_slurmd": "epilog"}  # Slurm's SLURM_SCRIPT_CONTEXT
NODE_KMSG_BYTES = 8 << 20    # the most of the kernel log read for Xid lines (within NODE_KMSG_BOUND_S)
NODE_NPD_MAX = 80            # NPD's max_output_length in the shipped plugin config: the npd line fits it
NODE_LINE_PREFIX = "ai-infra-validator node-check:"  # the summary line, the one stdout line (grep it)
NODE_DRAIN_TAG = "node-check"  # our drain reasons: "<DRAIN_PREFIX> node-check: <check>: <what> [<context>]"
NODE_REASON_MAX = 120
# What a step of a device's work costs at most (seconds; GPU / CPU), so that a step that cannot finish
# before the budget ends is skipped and named instead of started. The re-measure costs what the first took.
NODE_STEP_S = {"numerics": {"gpu": 4.0, "cpu": 2.0}, "speed": {"gpu": 5.0, "cpu": 1.5},
               "allreduce": {"gpu": 8.0, "cpu": 5.0}}

# The evidence words the node gate uses (the blame law's, aiv/blame.py): the first five single this node out;
# the others never name it.
EVIDENCE_SINGLES = ("own", "persisted", "majority", "reference", "manifest")
EVIDENCE_NAMES_NONE = ("once", "tie", "everyone", "not-collected")
if not (set(EVIDENCE_SINGLES) <= set(LOCALISING) and set(EVIDENCE_NAMES_NONE) <= set(UNLOCALISED)):
    raise ValueError("the node gate's evidence words must be the blame law's (aiv/blame.py)")
EVIDENCE_WORDS = {
    "own": "this node's own state: a counter, a process holding a GPU, a missing GPU",
    "persisted": "slow, measured again, slow again",
    "majority": "unlike a strict majority of its same-model peers on this node",
    "reference": "off the fp64 reference beyond a tolerance a healthy device never exceeds",
    "manifest": "unlike the accepted manifest class",
    "once": "measured once (slow, not measured again, or at speed when measured again)",
    "tie": "a disagreement with no majority",
    "everyone": "every GPU of the node alike: the software or the model, not a GPU",
    "not-collected": "what would decide was not collected",
}
ALL_CONTEXTS = NODE_CONTEXTS
COMPUTE_CONTEXTS = ("prolog", "health", "npd")  # the epilog stays passive: its time holds the node from the next job

# The checks of the node gate, as soperator's check runner declares its own: where each runs, whether its FAIL
# may drain the node (fail a prolog or an epilog, be an NPD problem) and why the evidence it drains on persists.
NODE_CHECKS = (
    {"check": "gpu-count", "contexts": ALL_CONTEXTS, "drain": True, "blame": ("own",),
     "persists": "a GPU the node should have (--expect-gpus, the job's SLURM_JOB_GPUS, the node's gres, the GPUs "
                 "on its PCI bus) that NVML does not list stays missing until the node is repaired"},
    {"check": "gpu-procs", "contexts": ALL_CONTEXTS, "drain": True, "blame": ("own",),
     "persists": "prolog, epilog: a process holding the job's GPU before the job starts or after it ended, "
                 "still there a second later, outlived its own job (pid and memory from nvidia-smi); health, npd: "
                 "a busy GPU is not judged and never drained"},
    {"check": "gpu-health", "contexts": ALL_CONTEXTS, "drain": True, "blame": ("own",),
     "persists": "uncorrected ECC errors and the row-remap state are kept by the driver until the GPU is reset; "
                 "the PCIe link and clock limits under load and Xid lines are WARNs that drain nothing"},
    {"check": "manifest", "contexts": ALL_CONTEXTS, "drain": True, "blame": ("manifest",),
     "persists": "with --manifest: the node's driver, CUDA, torch, GPUs or PCIe link unlike its accepted class "
                 "stay so until the node is changed back or the change is accepted"},
    {"check": "device", "contexts": COMPUTE_CONTEXTS, "drain": True, "blame": ("own", "everyone"),
     "persists": "CUDA refuses this GPU while the node's other GPUs work with the same software; every GPU "
                 "refused alike is the software's (everyone): not drained"},
    {"check": "numerics", "contexts": COMPUTE_CONTEXTS, "drain": True,
     "blame": ("majority", "reference", "tie", "everyone"),
     "persists": "the results are deterministic: bits unlike a strict majority of the node's GPUs of the model, "
                 "or off the fp64 reference beyond a tolerance a healthy device never exceeds, are a fault of that "
                 "GPU; a tie or every GPU alike drains nothing"},
    {"check": "gpu-perf", "contexts": COMPUTE_CONTEXTS, "drain": True, "blame": ("persisted", "once"),
     "persists": "a GPU below its model's table row or its peers on the node is measured again; only one slow "
                 "again drains (busy GPUs are never measured)"},
    {"check": "intra-node", "contexts": COMPUTE_CONTEXTS, "drain": True,
     "blame": ("own", "persisted", "once", "not-collected"),
     "persists": "the node's own all-reduce across its GPUs: wrong sums are the node's; busbw below "
                 "--min-busbw-intra in both of two measurements drains; an all-reduce that errs drains nothing"},
)
NODE_CHECK = {c["check"]: c for c in NODE_CHECKS}


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
    out = []
    for line in (text or "").splitlines():
        vals = [v.strip() for v in line.split(",")]
        if len(vals) < 3 or not vals[0].isdigit() or not vals[2].startswith(("GPU-", "MIG-")):
            continue
        mem = vals[1]
        out.append({"pid": int(vals[0]), "mem_mib": int(mem) if mem.isdigit() else None, "uuid": vals[2],
                    "name": ",".join(vals[3:]).strip() or None})
    return out


def parse_gpu_ids(text):
    """SLURM_JOB_GPUS ('0,1,3' or '0-3') -> sorted GPU indices, None when empty or malformed."""
    try:
        ids = sorted(set(parse_ranges(text.strip()))) if text and text.strip() else None
    except ValueError:
        return None
    return ids if ids and all(i >= 0 for i in ids) else None


def parse_gres_gpus(gres):
    """scontrol's Gres= ('gpu:8', 'gpu:h100:8(S:0-1)', 'gpu:a:4,gpu:b:4', '(null)') -> GPUs configured, None."""
    total, seen = 0, False
    for part in re.split(r",(?![^()]*\))", gres or ""):
        m = re.fullmatch(r"gpu(?::[^:()]+)?:(\d+)(?:\(.*\))?", part.strip())
        if m:
            total, seen = total + int(m.group(1)), True
    return total if seen else None


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
    held, busy = {}, {}
    for i in ids:
        procs = apps.get(i) or []
        if context in ("prolog", "epilog"):
            if procs:
                held[i] = procs
        elif procs:
            busy[i] = f"{len(procs)} process(es) of others on it"
        elif i in (allocated or {}):
            busy[i] = allocated[i]
    compute = [] if context not in COMPUTE_CONTEXTS else [i for i in ids if i not in held and i not in busy]
    return {"ids": ids, "held": held, "busy": busy, "compute": compute}


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
    named = status != "PASS" and evidence in EVIDENCE_SINGLES
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
    out = []
    for i, procs in sorted(devices["held"].items()):
        when = "before the job started" if context == "prolog" else "after the job ended"
        out.append(_f("gpu-procs", "FAIL", f"{node}: {_gpu_word(i, uuids.get(i))} is held {when}: "
                      + "; ".join(_proc_words(p) for p in procs[:4]) + (f" and {len(procs) - 4} more" if len(procs)
                                                                        > 4 else "")
                      + ": a leftover of an earlier job (the next job would run out of memory); kill it or reset "
                      "the GPU", "own", node, f"GPU {i} held by pid {procs[0]['pid']}", [i],
                      pids=[p["pid"] for p in procs]))
    if devices["busy"]:
        out.append(_f("gpu-procs", "PASS", f"{node}: GPU(s) " + ", ".join(
            f"{i} ({why})" for i, why in sorted(devices["busy"].items())) + ": busy, not judged (no speed, "
            "numerics or all-reduce on them; busy is not broken: never drained for it)", None, node,
            gpus=list(devices["busy"]), busy=sorted(devices["busy"])))
    elif not out:
        out.append(_f("gpu-procs", "PASS", f"{node}: no process of others on the {len(devices['ids'])} {noun} "
                      "checked", None, node))
    return out


def judge_gpu_health(node, gpus, load, xids, kmsg_unread=None):
    """Passive health per GPU from its NVML row (gpus): uncorrected ECC errors since the driver loaded, a row
    remap pending or failed: FAIL own (the driver keeps them until a GPU reset); under load (load: {index:
    the speed step's facts}): PCIe link below its maximum width or speed, clocks slowed by THROTTLE_FAULTS:
    WARN; Xid lines in the kernel log (history since boot, not the state now): WARN."""
    out, by_pci = [], {g["pci"]: g["index"] for g in gpus if g.get("pci")}
    for g in gpus:
        i, u = g["index"], g.get("uuid")
        if g.get("remap_failure"):
            out.append(_f("gpu-health", "FAIL", f"{node}: {_gpu_word(i, u)}: row remapping failed: memory the GPU "
                          "can no longer repair: drain it and replace the GPU", "own", node,
                          f"GPU {i} row remap failed", [i]))
        elif g.get("remap_pending"):
            out.append(_f("gpu-health", "FAIL", f"{node}: {_gpu_word(i, u)}: a row remap is pending: reset the GPU "
                          "(nvidia-smi -r) to apply it before a job runs on it", "own", node,
                          f"GPU {i} row remap pending", [i]))
        if g.get("ecc_uncorrected"):
            out.append(_f("gpu-health", "FAIL", f"{node}: {_gpu_word(i, u)}: {g['ecc_uncorrected']} uncorrected "
                          "ECC error(s) since the driver loaded: drain it, reset the GPU, and run the vendor's "
                          "diagnostics (dcgmi diag -r 3) before it returns", "own", node,
                          f"GPU {i} {g['ecc_uncorrected']} uncorrected ECC", [i]))
    for i, row in sorted((load or {}).items()):
        g = row.get
        words = []
        if g("pcie_width") and g("pcie_width_max") and g("pcie_width") < g("pcie_width_max"):
            words.append(f"PCIe link x{g('pcie_width')} of x{g('pcie_width_max')} under load")
        if g("pcie_speed") and g("pcie_speed_max") and g("pcie_speed") < g("pcie_speed_max"):
            words.append(f"PCIe link {g('pcie_speed'):g} of {g('pcie_speed_max'):g} GT/s under load")
        if int(g("throttle") or 0) & THROTTLE_FAULTS:
            words.append(f"clocks slowed under load: {', '.join(throttle_names(g('throttle')))}")
        if words:
            out.append(_f("gpu-health", "WARN", f"{node}: GPU {i}: " + "; ".join(words) + " (with --manifest a "
                          "narrower link than the accepted one FAILs)", "own", node, f"GPU {i} " + words[0], [i]))
    per = {}
    for x in xids or []:
        per.setdefault((by_pci.get(x["pci"]), x["pci"]), []).append(x)
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
    if not any(f["status"] != "PASS" for f in out):
        words = [f"{len(gpus)} GPU(s): no uncorrected ECC error, no row remap pending or failed"]
        if load:
            words.append("PCIe at full width and speed and clocks unslowed under load")
        words.append(f"kernel log not read ({kmsg_unread})" if kmsg_unread else "no Xid in the kernel log")
        out.append(_f("gpu-health", "PASS", f"{node}: " + "; ".join(words), None, node))
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
    """judge_numerics' rows from the workers' numerics posts ({index: post}); a worker's index is its rank."""
    rows = []
    for i, post in sorted(posts.items()):
        g = gpus_by_id.get(i) or {}
        model = g.get("name") or "CPU"
        rows.append({"rank": i, "host": node, "local_rank": i, "device": i if g.get("uuid") else None,
                     "uuid": g.get("uuid"), "model": model,
                     "group": numerics_group(model, post.get("software"), driver, cpu_model),
                     "checks": post.get("checks") or {}, "error": None, "internal": None, "unread": None})
    return rows


def judge_node_numerics(node, rows):
    """judge_numerics on the node's own GPUs, each finding tagged: a culprit off the fp64 reference
    'reference', one whose bits alone differ from a strict majority 'majority'; a disagreement without a
    majority 'tie'; every GPU of a model off alike 'everyone' (those name no host)."""
    off = {r["rank"]: any(p.get("off") for p in r["checks"].values()) for r in rows}
    out = []
    for f in judge_numerics(rows):
        if f["status"] == "PASS":
            out.append(dict(f, blame=None, short="numerics agree", gpus=[]))
            continue
        if f["hosts"]:
            ev = "reference" if any(off.get(r) for r in f["ranks"]) else "majority"
            what = "off the fp64 reference" if ev == "reference" else "bits unlike its peers"
        else:
            ev = "tie" if "disagree bit for bit" in f["reason"] else "everyone"
            what = "no majority" if ev == "tie" else "every GPU alike"
        gl = f"GPU {format_ranges(f['ranks'])}"
        out.append(dict(f, hosts=[node] if f["hosts"] else [], blame=ev, gpus=list(f["ranks"]),
                        short=f"{gl} computes wrong numbers ({what})" if f["hosts"] else f"numerics: {what}"))
    return out


def _speed_rows(node, rows, gpus_by_id, tries=1):
    return [{"rank": i, "host": node, "local_rank": i, "uuid": (gpus_by_id.get(i) or {}).get("uuid"),
             "model": (gpus_by_id.get(i) or {}).get("name") or "CPU", "tflops": r.get("tflops"),
             "hbm_gbps": r.get("hbm_gbps"), "tries": tries} for i, r in sorted(rows.items())]


def speed_flagged(node, first, gpus_by_id, cpu=False, min_tflops=None, min_hbm=None):
    """The GPUs whose first measurement judge_gpu_perf flags (to be measured again)."""
    rows = _speed_rows(node, first, gpus_by_id)
    return sorted(f["ranks"][0] for f in judge_gpu_perf(rows, min_tflops, min_hbm, cpu) if rows
                  and f["status"] != "PASS" and len(f["ranks"]) == 1)


def _best(first, again):
    """Per GPU the best of its two measurements (a fault only lowers a number)."""
    out = {}
    for i, r in first.items():
        a = again.get(i) or {}
        out[i] = {m: max([v for v in (r.get(m), a.get(m)) if v is not None], default=None)
                  for m in ("tflops", "hbm_gbps")}
    return out


def judge_node_speed(node, first, again, gpus_by_id, cpu=False, min_tflops=None, min_hbm=None, why_once=None):
    """The screen's rule, blame only what persists, on one node: the first measurements (first: {index:
    {'tflops', 'hbm_gbps'}}) judged by judge_gpu_perf against the model's table row, its peers on the node and
    the floors; a GPU flagged there was measured again (again: {index: row}) and is judged on its best value:
    flagged again 'persisted' (names the node), at speed again a transient WARN 'once'; a GPU not measured
    again (why_once says why) keeps its first status as 'once' (FAIL or WARN, no host named)."""
    if not first:
        return []
    def judge(rows, tries=1):
        return judge_gpu_perf(_speed_rows(node, rows, gpus_by_id, tries), min_tflops, min_hbm, cpu)
    one = judge(first, 2)  # the blame is decided here, below: the judge's words only
    flagged = {f["ranks"][0]: f for f in one if f["status"] != "PASS" and len(f["ranks"]) == 1}
    if not flagged:
        return [dict(f, blame=None, short="speed within the reference", gpus=[]) for f in one]
    two = {f["ranks"][0]: f for f in judge(_best(first, again), 2) if f["status"] != "PASS" and len(f["ranks"]) == 1}
    out = []
    for i, f in sorted(flagged.items()):
        if i in two and i in again:
            g = two[i]
            out.append(dict(g, hosts=[node], blame="persisted", gpus=[i], evidence_text=g.get("evidence"),
                            short=f"GPU {i} slow, measured twice",
                            reason=g["reason"] + f"; measured twice, slow both times (first {_speeds(first[i])}, "
                                                 f"again {_speeds(again[i])})"))
        elif i in again:
            out.append(dict(f, status="WARN", hosts=[], blame="once", gpus=[i], evidence_text=f.get("evidence"),
                            short=f"GPU {i} slow once, at speed again",
                            reason=f["reason"] + f"; at speed when measured again ({_speeds(again[i])}): a "
                                                 "transient (another process, a burst): not drained"))
        else:
            out.append(dict(f, hosts=[], blame="once", gpus=[i], evidence_text=f.get("evidence"),
                            short=f"GPU {i} slow, measured once",
                            reason=f["reason"] + f"; measured once ({why_once or 'not measured again'}): "
                                                 "not drained; run the node check again"))
    return out


def _speeds(r):
    return ", ".join(f"{v:.4g} {u}" for v, u in ((r.get("tflops"), "TFLOPS"), (r.get("hbm_gbps"), "GB/s"))
                     if v is not None) or "no value"


def judge_node_allreduce(node, result, floor=None):
    """The node's own all-reduce across its compute GPUs (result: {'n', 'ok', 'want', 'got', 'busbw': [two
    measurements], 'error'}): wrong sums FAIL own; an error FAILs without a host ('not-collected': the node's
    NVLink or fabric manager, or the software, cannot be told apart alone); busbw judged only against
    --min-busbw-intra: below it both times 'persisted', once 'once' (WARN)."""
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
    shown = " and ".join(f"{b:.4g}" for b in bw) or "not measured"
    if floor is not None and bw:
        below = [b for b in bw if b < floor]
        if len(below) == len(bw) and len(bw) >= 2:
            return [_f("intra-node", "FAIL", f"{node}: all-reduce busbw across its {n} GPU(s) {shown} GB/s, below "
                       f"--min-busbw-intra {floor:g} both times: drain it (nvidia-smi topo -m, nvlink -s)",
                       "persisted", node, f"busbw {max(bw):.3g} < {floor:g} GB/s twice")]
        if below:
            return [_f("intra-node", "WARN", f"{node}: all-reduce busbw across its {n} GPU(s) {shown} GB/s: below "
                       f"--min-busbw-intra {floor:g} once: not drained", "once", node)]
    judged = f"above --min-busbw-intra {floor:g}" if floor is not None else "not judged (no --min-busbw-intra)"
    return [_f("intra-node", "PASS", f"{node}: all-reduce across its {n} GPU(s) right; busbw {shown} GB/s "
               f"{judged}", None, node)]


def judge_node_manifest(node, manifest, records, load_rows):
    """--manifest: this node against its accepted class (judge_manifest on the node's records, one per GPU, the
    PCIe link read under load from load_rows), tagged 'manifest'."""
    if not manifest:
        return []
    screen = {"gpu": load_rows} if load_rows else None
    return [dict(f, blame=None if f["status"] == "PASS" else "manifest", gpus=[], short=f["reason"][:90])
            for f in judge_manifest(manifest, records, screen)]


# ---------------------------------------------------------------------------------------------- the verdict
def node_drainable(f, context):
    """Whether a finding may drain the node: the blame law's (drainable: a FAIL naming it, on evidence its check
    declares persistent in CHECK_RULES), of a check the node gate's table runs in this context."""
    spec = NODE_CHECK.get(f["check"])
    return drainable(f) and spec is not None and spec["drain"] and context in spec["contexts"]


def node_verdict(findings, context):
    """-> {'verdict': PASS | FAIL | NOT ASSESSED, 'drainable', 'culprits': the findings that drain, 'exit_code'}.
    A FAIL wins; without one, a check that could not run through our own fault makes NOT ASSESSED."""
    fails = [f for f in findings if f["status"] == "FAIL"]
    culprits = [f for f in fails if node_drainable(f, context)]
    verdict = "FAIL" if fails else "NOT ASSESSED" if any(f.get("unassessed") for f in findings) else "PASS"
    return {"verdict": verdict, "drainable": bool(culprits), "culprits": culprits,
            "exit_code": node_exit_code(context, verdict, bool(culprits))}


def node_reason(prefix, culprits, context):
    """The drain reason: '<prefix> node-check: <check>: <what> [<context>]' (soperator's shape), at most
    NODE_REASON_MAX characters; the first culprit's short words, and how many more."""
    f = culprits[0]
    more = f" (+{len(culprits) - 1} more)" if len(culprits) > 1 else ""
    tail = f"{more} [{context}]"
    head = " ".join(f"{prefix} {NODE_DRAIN_TAG}: {f['check']}: {f.get('short') or f['reason']}".split())
    if len(head) + len(tail) > NODE_REASON_MAX:
        head = head[:NODE_REASON_MAX - len(tail) - 3].rstrip() + "..."
    return head + tail


def owned_reason(prefix, reason):
    """Whether a node's drain reason is one the node check wrote (the only ones it may resume)."""
    return (reason or "").startswith(f"{prefix} {NODE_DRAIN_TAG}:")


def resume_blocker(reason, findings, ran, prefix):
    """Why a PASS may not resume a node drained with `reason` (None: it may): not our reason, or the check that
    drained it did not run (or did not pass) this time. ran: the checks this pass judged."""
    if not owned_reason(prefix, reason):
        return f"its reason is not the node check's ({reason!r}): left alone"
    m = re.match(rf"{re.escape(prefix)} {NODE_DRAIN_TAG}: ([a-z0-9-]+):", reason)
    check = m.group(1) if m else None
    if check not in ran:
        return f"the check that drained it ({check}) was not judged in this pass"
    if any(f["check"] == check and f["status"] != "PASS" for f in findings):
        return f"the check that drained it ({check}) did not pass"
    return None
