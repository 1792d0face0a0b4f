"""Floor 6: the node gate's device workers: one process per device (this file again, with WORKER_VAR set) that
imports torch, identifies its device and measures the numerics, the speed and the node's own all-reduce, each
step a JSON line on its stdout; the check's handle on them (_Workers), which reads those lines and kills
them, whole process groups, at the bound; and the pass's step that runs them (NodeCompute)."""
import contextlib
import datetime
import functools
import json
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time

from ..checks.collect import collect_gpu, cuda_problem, torch_versions
from ..checks.numerics_measure import numerics_measure
from ..core.base import EXIT_TIMEOUT, first_line, is_tool_error
from ..core.deadlines import CHILD_REAP_S
from ..core.files import proc_state
from ..core.speak import emit, flush_all
from ..launch.local import die_with_parent
from ..launch.plan import free_port
from ..screen.measure import screen_busbw, screen_measure_gpu
from .collect import WORKER_ARG
from .judge import NODE_STEP_S, gpus_by_id, speed_flagged

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
