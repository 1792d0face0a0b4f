"""Floor 6: the node gate's runtime (--node-check [CONTEXT]): this node alone, no other node, no srun. A lock
against a second pass, the passive facts (node_collect), one worker process per device for the numerics, the
speed and the node's own all-reduce (node_workers), all within --node-budget; then the
judges (node_judge), Slurm told (a drain reason, a resume) and the files (JSON, Prometheus textfile). Fail
open: the tool's own fault is NOT ASSESSED, exit 0 (npd: 2), and never drains."""
import contextlib
import datetime
import os
import shutil
import signal
import socket
import sys
import time

from ..checks.collect import _cpu_model, _driver_version, collect_node_facts, driver_gpus
from ..checks.manifest_io import load_manifest
from ..core.base import SCHEMA_VERSION, VERSION, first_line, print_traceback, read_text, where_raised
from ..core.blame import NODE_CONTEXTS, drains_in
from ..core.bounds import BoundPassed, within
from ..core.deadlines import NODE_HELD_AGAIN_S, NODE_KMSG_BOUND_S, NODE_RESERVE_S, NODE_SLURM_BOUND_S, NODE_SMI_BOUND_S
from ..core.files import write_json_atomic, write_text_atomic
from ..core.speak import emit
from ..launch.options import output_paths_from_argv
from ..out.drain import node_drain
from .collect import pci_gpus, process_owner, read_kmsg, read_slurm_node, smi_query
from .judge import (
    NODE_APP_FIELDS,
    NODE_GPU_FIELDS,
    NODE_KMSG_BYTES,
    NODE_LINE_PREFIX,
    context_from_argv,
    judge_node,
    judge_none_judged,
    node_context,
    node_exit_code,
    node_expectations,
    node_plan,
    node_verdict,
    parse_compute_apps,
    parse_gpu_ids,
    parse_node_gpus,
    parse_slurm_node,
    parse_xids,
    unassessed,
)
from .lock import NodeLock
from .report import node_lines, node_metrics, node_not_written, node_npd_line, node_summary, node_usage_state
from .workers import NodeCompute


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
