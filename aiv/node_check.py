"""Floor 6: the node gate's runtime (--node-check [CONTEXT]): this node alone, no other node, no srun. A lock
against a second pass, the passive facts (node_collect), one worker process per device for the numerics, the
speed and the node's own all-reduce (node_workers), all within --node-budget; then the
judges (node_judge), Slurm told (a drain reason, a resume) and the files (JSON, Prometheus textfile). Fail
open: the tool's own fault is NOT ASSESSED, exit 0 (npd: 2), and never drains."""
import contextlib
import datetime
import fcntl
import os
import shlex
import shutil
import signal
import socket
import sys
import time

from .base import (
    SCHEMA_VERSION,
    VERSION,
    emit,
    first_line,
    print_traceback,
    read_text,
    where_raised,
)
from .collect import _cpu_model, _driver_version, collect_node_facts
from .deadlines import (
    NODE_HELD_AGAIN_S,
    NODE_KMSG_BOUND_S,
    NODE_PREEMPT_S,
    NODE_RESERVE_S,
    NODE_SLURM_BOUND_S,
    NODE_SMI_BOUND_S,
    BoundPassed,
    within,
)
from .files import node_lock_path, write_json_atomic, write_text_atomic
from .manifest_io import load_manifest
from .node_collect import (
    driver_gpus,
    pci_gpus,
    process_owner,
    read_kmsg,
    read_slurm_node,
    slurm_update_node,
    smi_query,
)
from .node_judge import (
    NODE_APP_FIELDS,
    NODE_CONTEXTS,
    NODE_GPU_FIELDS,
    NODE_KMSG_BYTES,
    NODE_LINE_PREFIX,
    NODE_STEP_S,
    context_from_argv,
    gres_busy,
    judge_gpu_count,
    judge_gpu_health,
    judge_gpu_procs,
    judge_node_allreduce,
    judge_node_devices,
    judge_node_manifest,
    judge_node_numerics,
    judge_node_speed,
    judge_none_judged,
    node_context,
    node_devices,
    node_drainable,
    node_exit_code,
    node_reason,
    node_verdict,
    numerics_rows_of,
    owned_reason,
    parse_compute_apps,
    parse_gpu_ids,
    parse_gres_gpus,
    parse_node_gpus,
    parse_slurm_node,
    parse_xids,
    resume_blocker,
    speed_flagged,
    unassessed,
)
from .node_report import node_lines, node_metrics, node_not_written, node_npd_line, node_summary, node_usage_state
from .node_workers import _Workers
from .options import DRAIN_PREFIX, output_paths_from_argv
from .outputs import drain_keeps
from .plan import free_port


# ---------------------------------------------------------------------------------------------- the check
class NodeCheck:
    """One pass of the node gate in its context, within its budget; run() -> the state (the JSON's dict)."""

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
        self.unlocked, self.procs_unjudged = None, None

    def lap(self, name):
        """Seconds since the last lap (or the start) under name: where the budget went."""
        now = time.monotonic()
        self.phases[name] = round(max(0.0, now - self.t0 - sum(self.phases.values())), 2)

    def left(self):
        return self.until - time.monotonic()

    # ------------------------------------------------------------------ lock: one pass touches the GPUs at a time
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
        f = self.facts
        raw = self.env.get("SLURM_JOB_GPUS")
        ids = parse_gpu_ids(raw) if raw else None
        job = {g["uuid"] for g in f["rows"] if ids is None or g["index"] in ids}
        if not any(p["uuid"] in job for p in f["apps"]):
            return
        time.sleep(max(0.0, min(NODE_HELD_AGAIN_S, self.left())))
        a = smi_query(exe, "compute-apps", NODE_APP_FIELDS, self.bound(NODE_SMI_BOUND_S))
        if "text" in a:
            still = {(p["pid"], p["uuid"]) for p in parse_compute_apps(a["text"])}
            f["apps"] = [p for p in f["apps"] if (p["pid"], p["uuid"]) in still]

    def expectations(self):
        a, f = self.args, self.facts
        if a.expect_gpus is not None:
            return [(a.origin.get("expect_gpus", "--expect-gpus"), a.expect_gpus)]
        out = []
        gres = parse_gres_gpus((self.slurm or {}).get("gres"))
        if gres is not None:
            out.append(("the node's gres in Slurm", gres))
        if f["pci"]:
            out.append(("NVIDIA GPUs on the PCI bus", len(f["pci"])))
        if f["driver"]:
            out.append(("the NVIDIA driver's list", len(f["driver"])))
        return out

    def plan(self):
        f, a = self.facts, self.args
        found = f["rows"] or f["driver"]
        self.cpu = not found and not f["pci"] and all(n == 0 for _, n in self.expectations())
        self.gpus = f["rows"] or [{"index": i, "uuid": None, "pci": p} for i, p in enumerate(f["driver"])]
        by_uuid = {g["uuid"]: g["index"] for g in self.gpus if g.get("uuid")}
        apps = {}
        for p in f["apps"]:
            if p["uuid"] in by_uuid:
                apps.setdefault(by_uuid[p["uuid"]], []).append(p)
        if self.ctx in ("prolog", "epilog"):
            apps = self.procs_we_cannot_judge(by_uuid, apps)
        ids = list(range(a.nproc or 2)) if self.cpu else [g["index"] for g in self.gpus]
        used = gres_busy((self.slurm or {}).get("gres_used"), ids) if self.ctx == "health" else {}
        self.devices = node_devices(self.ctx, self.gpus, f["job_gpus"], a.nproc or 2, used, apps, self.cpu)
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

    # ------------------------------------------------------------------ compute
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
        self.take_steps(ids, steps)
        ok = [i for i in ids if self.usable(i)]
        first = {i: self.measured[i]["speed"] for i in ok if isinstance(self.measured[i].get("speed"), dict)}
        slow = speed_flagged(self.node, first, self.gpus_by_id(), self.cpu, a.min_tflops, a.min_hbm)
        if slow and not self.stopped:
            need = max(w.said[i]["speed"].get("secs", 0.0) for i in slow) + 1.0
            if self.left() < need:
                self.why_once = f"the re-measure needs about {need:.1f}s, {max(0.0, self.left()):.1f}s left"
            else:
                for i in slow:
                    w.send(i, do="speed", need=need)
                w.wait(["speed2"], slow, self.until, lambda: self.stopped)
                self.take_steps(slow, ["speed2"])
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
        done = w.wait(["allreduce"], ok, self.until, lambda: self.stopped)
        said = [w.said[i].get("allreduce") for i in ok]
        errors = [m for m in said if m and m.get("error")]
        if errors:
            self.allreduce = {"n": len(ok), "error": errors[0]["error"], "internal": errors[0].get("internal")}
        elif done and all(m and isinstance(m.get("value"), dict) for m in said):
            vals = [m["value"] for m in said]
            bad = next((v for v in vals if not v["ok"]), None)
            self.allreduce = dict(bad or vals[0])
        elif not self.stopped:
            self.skipped.append("the all-reduce (did not finish within the budget)")

    def usable(self, i):
        """Whether worker i's device worked (ready without an error, no device error in a step)."""
        m = self.measured.get(i) or {}
        return bool(m.get("ready")) and not m.get("error")

    def take_steps(self, ids, steps):
        """What the workers said for these steps -> self.measured[i][step], their errors and skips noted."""
        w = self.workers
        for i in ids:
            m = self.measured.setdefault(i, {})
            said = w.said[i]
            if "import" in said:
                m["import"] = said["import"]["error"]
                continue
            for s in steps:
                if m.get("error") or m.get("internal") or m.get("died"):
                    break  # nothing more comes from this worker
                msg = said.get(s)
                if msg is None:
                    if i in w.dead:
                        rc = w.procs[i].poll()
                        m["died"] = (f"ended ({'killed by signal ' + str(-rc) if rc and rc < 0 else f'exit {rc}'}) "
                                     f"before its {s} step: {w.stderr_tail(i) or 'no error on stderr'}")
                    elif s != "ready":
                        self.skipped.append(f"{s} on GPU {i} (the budget ended first)")
                    continue
                if msg.get("skipped"):
                    self.skipped.append(f"{s} on GPU {i} ({msg['skipped']})")
                elif msg.get("error"):
                    m["internal" if msg.get("internal") else "error"] = f"{s}: {msg['error']}"
                elif s == "ready":
                    m["ready"], m["gpu"], m["versions"] = True, msg.get("gpu"), msg.get("versions")
                else:
                    m[s] = msg.get("value")

    def gpus_by_id(self):
        out = {}
        for g in self.gpus:
            out[g["index"]] = {"uuid": g.get("uuid"), "name": g.get("name"), "pci": g.get("pci")}
        for i, m in self.measured.items():
            if m.get("gpu"):
                out[i] = dict(out.get(i) or {}, **{k: v for k, v in m["gpu"].items() if v is not None})
        return out

    # ------------------------------------------------------------------ judge
    def judge(self):
        f, node, a = self.facts, self.node, self.args
        out = self.findings
        if f.get("smi_unread"):
            out.append(unassessed("gpu-health", f"{node}: nvidia-smi: {f['smi_unread']}: the GPUs' count, ECC and "
                                  "row remapping were not read (a slow nvidia-smi is often NVML starting without "
                                  "persistence mode: nvidia-smi -pm 1)", "nvidia-smi not read"))
        else:
            out += judge_gpu_count(node, [g["index"] for g in self.gpus], f["lost"], self.expectations(),
                                   f["job_gpus"], self.cpu)
        out += judge_gpu_procs(node, self.ctx, self.devices, {g["index"]: g.get("uuid") for g in self.gpus},
                               "CPU worker(s)" if self.cpu else "GPU(s)")
        by_id = self.gpus_by_id()
        load = {i: m["speed"] for i, m in self.measured.items() if isinstance(m.get("speed"), dict)}
        if not self.cpu and not f.get("smi_unread"):
            out += judge_gpu_health(node, f["rows"], load, f["xids"], f["kmsg_unread"])
        imports = sorted({m["import"] for m in self.measured.values() if m.get("import")})
        if imports:
            how = "usable" if imports[0].startswith("torch ") else "importable"  # a CPU-only build, or no torch
            out.append(unassessed("local", f"{node}: torch is not {how} in {sys.executable}: {imports[0]}: the "
                                  "numerics, speed and all-reduce were not run (the tool's environment, not the node)",
                                  f"torch not {how}: " + imports[0][:60]))
        for i, m in sorted(self.measured.items()):
            if m.get("internal"):
                out.append(unassessed("internal", f"{node}: GPU {i}: {m['internal']}: a bug in the tool, not a fault "
                                      "of the node", f"tool error on GPU {i}"))
            if m.get("died"):
                out.append(unassessed("launch", f"{node}: the worker for GPU {i} {m['died']}", f"worker {i} died"))
        errors = {i: m["error"] for i, m in self.measured.items() if m.get("error")}
        done = [i for i, m in self.measured.items() if m.get("ready") and not m.get("error")]
        out += judge_node_devices(node, errors, done)
        posts = {i: m["numerics"] for i, m in self.measured.items() if isinstance(m.get("numerics"), dict)
                 and not m.get("error")}
        if posts:
            rows = numerics_rows_of(node, posts, by_id, _driver_version(self.root), _cpu_model())
            out += judge_node_numerics(node, rows)
        first = {i: r for i, r in load.items() if not self.measured[i].get("error")}
        out += judge_node_speed(node, first, self.again, by_id, self.cpu, a.min_tflops, a.min_hbm, self.why_once)
        if self.allreduce and self.allreduce.get("internal"):
            out.append(unassessed("internal", f"{node}: the all-reduce: {self.allreduce['error']}: a bug in the tool",
                                  "tool error in the all-reduce"))
        else:
            out += judge_node_allreduce(node, self.allreduce, a.min_busbw_intra)
        if a.manifest:
            out += self.judge_manifest(load)

    def judge_manifest(self, load):
        try:
            manifest = load_manifest(self.args.manifest, self.args.origin.get("manifest", "--manifest"))
        except Exception as e:
            return [unassessed("manifest", f"{self.node}: {e}", "manifest unreadable")]
        facts = collect_node_facts(self.root, None, "gloo", len(self.devices["ids"]), self.env)
        by_id, recs = self.gpus_by_id(), []
        for k, i in enumerate(self.devices["ids"]):
            m = self.measured.get(i) or {}
            g = by_id.get(i) or {}
            gpu = None if self.cpu else {"name": g.get("name"), "vram": g.get("vram"), "uuid": g.get("uuid"),
                                         "pci": g.get("pci")}
            recs.append({"rank": i, "host": self.node, "local_rank": i, "gpu": gpu, "versions": m.get("versions") or {},
                         **({"node": facts} if k == 0 else {})})
        if not recs:
            recs = [{"rank": 0, "host": self.node, "local_rank": 0, "gpu": None, "versions": {}, "node": facts}]
        rows = [dict(r, rank=i) for i, r in load.items()]
        return judge_node_manifest(self.node, manifest, recs, rows)

    # ------------------------------------------------------------------ act
    def act(self, v):
        """Tell Slurm: health drains this node on a FAIL that singles it out (with --drain on), and resumes our own
        drain after a pass that judged the check that drained it (--undrain); prolog and epilog write the reason
        before their exit 1 (Slurm then drains the node; the prolog's job is requeued). A reason not ours is
        never touched. npd leaves Slurm alone. -> {'action', 'done', 'reason', 'command', 'said'}."""
        out = {"action": "none", "done": False, "reason": "", "command": "", "said": ""}
        if self.ctx == "npd":
            if v["drainable"]:
                out["said"] = "NPD problem (exit 1): the condition turns True"
            return out
        if v["drainable"]:
            reason = node_reason(DRAIN_PREFIX, v["culprits"], self.ctx)
            cmd = f"scontrol update nodename={self.node} state=drain reason={shlex.quote(reason)}"
            out.update(action="drain", reason=reason, command=cmd)
            slurm_does = "; exit 1: Slurm drains the node" + (" and requeues the job" if self.ctx == "prolog" else "")
            if self.args.drain != "on":
                out["said"] = f"not drained by the check (--drain {self.args.drain}): {cmd}" + (
                    slurm_does if self.ctx != "health" else "")
                return out
            why = self.foreign_reason()
            if why:
                out["said"] = why + (slurm_does if self.ctx != "health" else "")
                return out
            err = slurm_update_node(self.node, self.verdict_bound(), state="drain", reason=reason)
            out["done"] = err is None
            out["said"] = (f"drained: {reason}" if err is None else f"not drained: {err}; run: {cmd}") + (
                slurm_does if self.ctx != "health" else "")
            return out
        if self.ctx == "health" and self.args.undrain and v["verdict"] == "PASS":
            out.update(self.resume())
        return out

    def foreign_reason(self):
        """Why the drain is not written ('' when it may be): the node is drained or down for a reason not ours
        (kept), or Slurm could not be asked."""
        s = self.slurm
        if s is None:
            r = read_slurm_node(self.node, self.verdict_bound())
            s = self.slurm = parse_slurm_node(r["text"]) if "text" in r else {"unread": r["unread"]}
        if s.get("unread"):
            return f"not drained: Slurm's view of the node was not read ({s['unread']})"
        kept = drain_keeps({self.node: (s.get("state") or "", s.get("reason") or "")})
        if kept:
            return f"not drained by the check: already drained or down for another reason, kept ({kept[self.node]!r})"
        return ""

    def resume(self):
        s = self.slurm or {}
        if s.get("unread") or "DRAIN" not in (s.get("state") or ""):
            return {}
        if not owned_reason(DRAIN_PREFIX, s.get("reason")):
            return {"said": f"left drained: its reason is not the node check's ({s.get('reason')!r})"}
        ran = {f["check"] for f in self.findings if not f.get("unassessed")}
        why = resume_blocker(s["reason"], self.findings, ran, DRAIN_PREFIX)
        if why:
            return {"action": "resume", "said": f"left drained: {why}"}
        err = slurm_update_node(self.node, self.verdict_bound(), state="resume")
        return {"action": "resume", "done": err is None,
                "said": "resumed our own drain: the check that drained it passed" if err is None else
                f"not resumed: {err}"}

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
            f["drains"] = node_drainable(f, self.ctx)
        try:
            drain = self.act(v)
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
                 "devices": {"ids": dev["ids"], "compute": dev["compute"], "busy": {str(k): x for k, x in
                                                                                     dev["busy"].items()},
                             "held": {str(k): x for k, x in dev["held"].items()}},
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
