"""Floor 4: what a verdict becomes outside the log: --drain (the scontrol plan and its application) and
--metrics (Prometheus text exposition)."""
import datetime
import math
import re
import shlex

from ..checks.judge import rank_record
from ..checks.manifest import mark_accepted
from ..core.base import (
    CHECKS,
    EXIT_INTERRUPTED,
    EXIT_PASS,
    EXIT_TIMEOUT,
    SCHEMA_VERSION,
    STATUS_RANK,
    VERSION,
    _screen_key,
    _screen_sorted,
    compress_hostlist,
    finding,
    group_by,
    safe_env,
    scontrol_reason,
)
from ..core.blame import blame_gate, blamed_hosts, drains_in
from ..core.deadlines import PHASES
from ..core.names import DRAIN_PREFIX
from ..screen.gpu import gpu_levels
from ..screen.judge import screen_degraded_note, screen_diagnose
from .render import failure_lines

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
