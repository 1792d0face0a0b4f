"""Floor 5 (runtime): a rank's set-up before the roll call and a node leader's work beside the phases
(RankSetup, mixed into RankRun)."""
import contextlib
import gc
import json
import os
import re
import socket
import subprocess
import sys
import threading
import time

from ..checks.collect import (
    _cpu_affinity,
    collect_gpu,
    collect_node_facts,
    cuda_problem,
    finish_import_probe,
    gpus_expected,
    loopback_domain,
    nearest_hca,
    start_import_probe,
    torch_floor_problem,
    torch_versions,
)
from ..checks.interfaces import check_interfaces, gloo_address, list_interfaces
from ..checks.judge import judge_no_torch
from ..core.base import CLUSTER_ERRORS, EXIT_FAIL, EXIT_USAGE, Verdict, failed, finding, first_line, format_ranges
from ..core.deadlines import HELLO_RETRY_S, IMPORT_PROBE_S, live_period, worst_case
from ..launch.contract import launcher_store, under_torchrun
from ..screen.measure import start_node_smi, start_screen_gpu
from .background import NcclLog
from .liveness import proc_stat, say_hello
from .store import norm_ip


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
