"""Floor 4: what the node gate (--node-check) says: the one summary line (stdout, the node's log), the NPD line
(NPD's condition message), a line per finding (stderr), and the node's Prometheus textfile. Pure functions of
the node check's state (the JSON's dict)."""
from ..core.base import SCHEMA_VERSION, STATUS_RANK, VERSION, format_ranges, group_by
from ..core.blame import NODE_CONTEXTS
from ..core.deadlines import NODE_BUDGET_DEFAULT
from ..out.outputs import metrics_text
from .judge import NODE_LINE_PREFIX, NODE_NPD_MAX, node_verdict, unassessed

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
