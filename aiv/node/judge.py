"""Floor 3: the node gate (--node-check): its contexts, what nvidia-smi, Slurm and the kernel log say as plain
data, and what is the node gate's alone (the GPU count, processes holding a GPU, the kernel's Xid lines). The
rest it judges with the preflight's own judges on preflight-shaped rows (one per GPU, host = the node): the GPU
facts (judge_gpu_facts: one ECC and row-remap policy), the numerics (judge_numerics), the speed with its
re-measure rule (judge_gpu_perf, gpu_remeasured, judge_gpu_transients). Where each check runs and on what
evidence it drains is the one check table, CHECK_RULES (aiv/blame.py). Every finding carries `evidence`
(`blame`): a LOCALISING word names this node (only those fail a prolog, drain or make an NPD problem), an
UNLOCALISED one does not. Pure: plain data in, findings out."""
import re

from ..checks.manifest import judge_manifest
from ..checks.numerics import judge_numerics, numerics_rows
from ..core.base import CHECKS, finding, format_ranges, group_by, human_bytes, parse_ranges, scontrol_reason
from ..core.blame import CHECK_RULES, LOCALISING, NODE_COMPUTE, NODE_CONTEXTS, drains_in
from ..screen.gpu import (
    gpu_fact_problems,
    gpu_remeasured,
    gpu_suspects,
    judge_gpu_facts,
    judge_gpu_perf,
    judge_gpu_transients,
)
from ..screen.judge import intra_levels, judge_intra
from ..screen.loop import judge_transients

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
