"""Floor 6: the node gate's runtime (--node-check [CONTEXT]): this node alone, no other node, no srun. A lock
against a second pass, the passive facts (node_collect), one worker process per device for the numerics, the
speed and the node's own all-reduce (this file again, with WORKER_VAR set), all within --node-budget; then the
judges (node_judge), Slurm told (a drain reason, a resume) and the files (JSON, Prometheus textfile). Fail
open: the tool's own fault is NOT ASSESSED, exit 0 (npd: 2), and never drains."""
import contextlib
import datetime
import fcntl
import json
import os
import queue
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

from ..checks.collect import (
    _cpu_model,
    _driver_version,
    collect_gpu,
    collect_node_facts,
    cuda_problem,
    torch_versions,
)
from ..checks.manifest_io import load_manifest
from ..checks.numerics_measure import numerics_measure
from ..core.base import (
    EXIT_TIMEOUT,
    SCHEMA_VERSION,
    VERSION,
    first_line,
    is_tool_error,
    print_traceback,
    read_text,
    where_raised,
)
from ..core.deadlines import (
    NODE_HELD_AGAIN_S,
    NODE_KMSG_BOUND_S,
    NODE_PREEMPT_S,
    NODE_RESERVE_S,
    NODE_SLURM_BOUND_S,
    NODE_SMI_BOUND_S,
)
from ..core.files import write_json_atomic, write_text_atomic
from ..core.speak import emit, flush_all
from ..launch.local import die_with_parent
from ..launch.plan import free_port
from ..out.drain import node_drain
from ..screen.measure import screen_busbw, screen_measure_gpu
from .collect import driver_gpus, pci_gpus, process_owner, read_kmsg, read_slurm_node, smi_query
from .judge import (
    NODE_APP_FIELDS,
    NODE_GPU_FIELDS,
    NODE_KMSG_BYTES,
    NODE_LINE_PREFIX,
    NODE_STEP_S,
    context_from_argv,
    gpus_by_id,
    judge_node,
    node_context,
    node_drainable,
    node_exit_code,
    node_expectations,
    node_plan,
    node_verdict,
    parse_compute_apps,
    parse_gpu_ids,
    parse_node_gpus,
    parse_slurm_node,
    parse_xids,
    speed_flagged,
    unassessed,
)
from .report import node_lines, node_metrics, node_npd_line, node_summary

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

    def step(name, fn, need):
        _worker_step(name, fn, need, until)
    uuid, pci = (gpu or {}).get("uuid"), (gpu or {}).get("pci")

    def speed():
        return screen_measure_gpu(torch, dev, kind, uuid, pci, spec["root"])
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
            p = subprocess.Popen([sys.executable, os.path.abspath(__file__)], env=dict(env, **wenv,
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
        for p in self.procs.values():
            with contextlib.suppress(OSError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()
            for s in (p.stdin, p.stdout):
                with contextlib.suppress(OSError, ValueError):
                    s.close()
        for e in self.errs.values():
            e.close()


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
        self.expect = []  # what the node should have (node_expectations), [(source words, count)]

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
        stopped (SIGTERM): a job start wins over a health pass. -> False when this pass must not go on."""
        safe = re.sub(r"[^A-Za-z0-9._-]", "_", self.node)
        path = os.path.join(tempfile.gettempdir(), f"aiv-node-check-{safe}.lock")
        try:
            fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o644)
        except OSError as e:
            self.skipped.append(f"no lock ({path}: {e.strerror})")
            return True
        self.lock_fd = fd
        job = self.ctx in ("prolog", "epilog")
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
            until = time.monotonic() + NODE_PREEMPT_S
            while True:
                try:
                    fcntl.flock(fd, mode | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() > until:
                        self.skipped.append(f"the health pass holding {path} did not let go within {NODE_PREEMPT_S:g}s")
                        return True
                    time.sleep(0.1)
        except OSError:
            return True
        if not job:
            with contextlib.suppress(OSError):
                os.ftruncate(fd, 0)
                os.write(fd, f"{os.getpid()} {self.ctx}\n".encode())
        return True

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
            a = smi_query(exe, "compute-apps", NODE_APP_FIELDS, self.bound(NODE_SMI_BOUND_S))
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

    def plan(self):
        f, a = self.facts, self.args
        given = None if a.expect_gpus is None else (a.origin.get("expect_gpus", "--expect-gpus"), a.expect_gpus)
        self.expect = node_expectations(given, (self.slurm or {}).get("gres"), f["pci"], f["driver"])
        self.cpu, self.gpus, self.devices = node_plan(self.ctx, f, self.slurm, a.nproc or 2, self.expect)
        if f.get("apps_unread") and self.ctx in ("prolog", "epilog"):
            self.findings.append(unassessed("gpu-procs", f"{self.node}: the GPUs' processes were not read "
                                            f"({f['apps_unread']})", "GPU processes not read"))

    # ------------------------------------------------------------------ compute
    def compute(self):
        """Workers on the devices the plan allows; the re-measure of the slow ones; the node's all-reduce."""
        a, ids = self.args, self.devices["compute"]
        numerics, speed = not a.skip_numerics, not a.skip_screen
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
                self.lap("judge")
        except Exception as e:
            print_traceback(e)
            self.findings.append(unassessed("internal", f"{self.node}: {first_line(e)} in {where_raised(e)}: a bug in "
                                            "the tool, not a fault of the node (the traceback is on stderr)",
                                            "tool error: " + first_line(e)[:60]))
        finally:
            if self.workers is not None:
                self.workers.close(min(1.0, max(0.2, self.t0 + self.budget - time.monotonic() - 2.0)))
                self.lap("workers-exit")
        return self.finish()

    def finish(self):
        v = node_verdict(self.findings, self.ctx)
        for f in self.findings:
            f["drains"] = node_drainable(f, self.ctx)
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


def _write_outputs(args, state):
    """The JSON and the Prometheus textfile, each atomically (a temporary file beside it, then a rename). A file
    that cannot be written is a line on stderr, never a changed verdict (the node is not at fault)."""
    said = []
    for path, text in ((args.json, None), (args.metrics, node_metrics(state))):
        if not path:
            continue
        try:
            if text is None:
                write_json_atomic(path, state)
            else:
                write_text_atomic(path, text)
        except Exception as e:
            said.append(f"WARNING: output: {path} not written: {first_line(e)}")
    return said


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
            for line in _write_outputs(args, state):
                emit(line, sys.stderr)
        emit(state["npd"] if ctx == "npd" else state["summary"])
        return state["exit_code"]
    except Exception as e:
        print_traceback(e)
        return node_check_usage(f"internal: {first_line(e)} in {where_raised(e)}: a bug in the tool", [], env, ctx)


def node_check_usage(e, argv, env, ctx=None):
    """A usage error on a --node-check command line (or the tool's own error): not the node's fault (fail open):
    the line on stderr, NOT ASSESSED on stdout, and the context's exit code (0; npd: 2)."""
    ctx = ctx or context_from_argv(argv, env) or "health"
    node = env.get("SLURMD_NODENAME") or socket.gethostname()
    emit(str(e), sys.stderr)
    code = node_exit_code(ctx, "NOT ASSESSED", False)
    if ctx == "npd":
        emit(f"NOT ASSESSED: {str(e).replace('FAILURE: ', '')}"[:80])
    else:
        emit(f"{NODE_LINE_PREFIX} NOT ASSESSED on {node} [{ctx}]: {e}; exit {code} (fail open: nothing drained)")
    return code

