"""Floor 5 (runtime): RankRun, what every rank runs: the phases in order, each under its bound."""
import contextlib
import datetime
import fcntl
import gc
import hashlib
import json
import os
import re
import signal
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
    gpus_expected,
    loopback_domain,
    nearest_hca,
    start_import_probe,
    torch_floor_problem,
    torch_versions,
)
from ..checks.hang import group_key
from ..checks.interfaces import check_interfaces, gloo_address, list_interfaces
from ..checks.judge import judge_no_torch
from ..checks.numerics_measure import ddp_local_grads, rank_numerics
from ..core.base import (
    _T0,
    EXIT_FAIL,
    EXIT_INTERNAL,
    EXIT_PASS,
    EXIT_TIMEOUT,
    EXIT_USAGE,
    Verdict,
    failed,
    finding,
    first_line,
    format_ranges,
    human_bytes,
    internal_finding,
    is_tool_error,
    print_traceback,
    where_raised,
)
from ..core.bounds import Bound, BoundPassed, Watchdog, within
from ..core.deadlines import (
    HELLO_RETRY_S,
    IMPORT_PROBE_S,
    MARK_TTL,
    PHASE_CHECK,
    PHASE_WHAT,
    PHASES,
    PROBE_CONNECT_S,
    RANK0_GRACE,
    RESOLVE_S,
    SCREEN_PHASES,
    TORCH_BACKSTOP_S,
    deadlines,
    live_period,
    worst_case,
)
from ..core.speak import Findings, emit, flush_all
from ..launch.contract import job_secret, launcher_expectations, launcher_store, under_torchrun
from ..launch.launchers import node_name
from ..out.render import BAR
from ..screen.measure import soak_measure, start_node_smi, start_screen_gpu
from ..screen.run import ScreenRunner
from .background import Background, Issued, NcclLog
from .conclusion import write_json_within
from .liveness import launch_key, proc_stat, said_marker, say_hello, sweep_said
from .store import Seal, StoreProtocol, norm_ip, run_base


def speak_once_per_node(text, env, local_rank=0, topic="run"):
    """Lines a rank prints for itself or for rank 0 when rank 0 cannot: once per node. The first local
    rank (lowest first) to mark a node-local file keyed by job, step, launcher (the parent process all
    ranks of a node share under srun, torchrun and local mode: its pid and start time) and topic (the
    port, and the run's nonce once the roll call gave one), under an fcntl lock, prints; the others
    stay silent. A marker older than MARK_TTL never silences a later run. Returns whether this
    process printed."""
    time.sleep(min(max(local_rank, 0), 20) * 0.05)
    path = said_marker(env, topic, launch_key(os.getppid()))
    sweep_said()
    try:
        fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)  # held for microseconds by whoever marks the file
            said = os.read(fd, 32).decode(errors="replace")
            if said and time.time() - float(said or 0) < MARK_TTL:
                return False
            os.lseek(fd, 0, os.SEEK_SET)
            os.write(fd, f"{time.time():.3f}".ljust(32).encode())  # older than MARK_TTL: another run's
        finally:
            os.close(fd)
    except (OSError, ValueError):
        pass  # no node-local coordination here: better a line twice than never
    emit(text)
    return True


PROGRESS = {
    "contract": "contract: rank {rank} of {world}, local_rank {local_rank}, master {master}; {how}",
    "local": "local: backend {backend}, device {device}, interfaces checked: {ifaces}, {failed} local check(s) "
             "failed (import torch {import_s:.2f}s)",
    "rollcall_open": "rendezvous: store at {master}, roll call of {world} rank(s) within {seconds:g}s",
    "rollcall": "rendezvous: {present}/{world} rank(s) checked in ({secs:.2f}s); pre-init checks (layout, "
                "GPU affinity, device, local) {result}",
    "init": "init: {backend} process group of {world} ready ({secs:.2f}s)",
    "telemetry": "telemetry: gathered from {ranks} rank(s), max {size} B per rank ({secs:.2f}s); node checks: "
                 "{counts}",
    "collective": "collective: all_reduce of rank-encoded integers on {world} rank(s) ({secs:.2f}s)",
    "ddp": "ddp: DDP step on nn.Linear(10, 10), results gathered ({secs:.2f}s)",
    "bandwidth": "bandwidth: {size} all_reduce {us:.1f} us, algbw {algbw:.2f} GB/s, busbw {busbw:.2f} GB/s",
    "screen_gpu": "screen-gpu: {n} {what}: matmul {tflops} TFLOPS, memory copy {hbm} GB/s (min/median) ({secs:.2f}s)",
    "screen_net": "screen-net: {detail}; screen findings: {counts} ({secs:.2f}s)",
    "soak": "soak: {n} {what} loaded at once for {seconds:g}s: {detail}; soak findings: {counts} ({secs:.2f}s)",
    "verdict": "verdict: {verdict} (exit {code}); findings: {counts}",
}


HEADER = (BAR, "ai-infra-validator {version} ddp_mesh_ping  {started}  host={host}", "Total Execution Ranks: {world}",
          "Master: {master} ({port_from})  launch: {launch}  deadlines: roll call {rollcall:g}s, each later phase "
          "{timeout:g}s  expect: {expect}", BAR)


def _torch_older_than(version):
    """Whether the torch this python would import is older than version ((major, minor)), read from its
    metadata without importing it; unknown: True (the older torch's variable is set too, at worst a warning)."""
    try:
        from importlib.metadata import version as installed
        m = re.match(r"(\d+)\.(\d+)", installed("torch"))
    except Exception:  # noqa: BLE001 - no metadata, a torch on PYTHONPATH: unknown
        return True
    return m is None or (int(m.group(1)), int(m.group(2))) < version


class RankRun(ScreenRunner):
    """What every rank runs: the phases of PHASES in order, each under deadline(phase), and the plumbing
    they share. The two roles are subclasses (rank_run picks one):

      Coordinator  rank 0: serves the store, holds the roll call, judges every phase, owns the verdict
                   (the report, the JSON, the exit code published on the store)
      Follower     every other rank: reports its own error (if any) and exits with rank 0's code, which
                   a listener thread reads even while the main thread is blocked in a collective; speaks
                   for rank 0 when rank 0 gives no verdict in time

    Every way a run ends goes through Verdict and end(). The hooks a role defines: end, grace,
    enter_phase, own_error, open_store, before_check_in, after_check_in, phase_telemetry,
    results_gathered, phase_final, expire, signalled, progress, header."""

    on_tick = None  # the Coordinator's liveness tick; the others have none
    beats = True  # a node leader beats for its node (rank 0 reads its own node's ranks from /proc)

    def __init__(self, args, contract, env):
        self.args, self.c, self.env = args, contract, env
        self.rank, self.world, self.local_rank = contract["rank"], contract["world_size"], contract["local_rank"]
        self.host = node_name(env)
        self.addr, self.port = contract["master_addr"], contract["master_port"]
        self.D = deadlines(args.timeout, args.rollcall_timeout, args.soak)
        self.expect = dict(launcher_expectations(env), **{k: getattr(args, "expect_" + k) for k in
                                                       ("world_size", "nodes", "ranks_per_node")
                                                       if getattr(args, "expect_" + k) is not None})
        self.started_at = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
        self.phase, self.times, self.findings, self.records, self.host_of = "local", {}, Findings(), [], {}
        self.state_lock = threading.RLock()  # what the verdict copies (Coordinator.snapshot) is written under it
        self.starts = {}  # phase -> seconds from start
        self.proto = self.poll = self.master = None
        self.backend = self.device = self.results = self.bandwidth = None
        self.identity = None
        self.bg, self.nccl = Background(), NcclLog()  # work off the main thread; NCCL's log
        self.issued, self.stalled, self.wedged = Issued(), set(), set()  # what this rank issued last (issuing)
        self.screen_groups = []  # the screen's groups this rank made (kept, never destroyed)
        self.my_groups = {}  # a group's ranks -> this rank's group (re-measured with the same group)
        self.seal = Seal(job_secret(env), run_base(env))  # every value on the store, signed with the job's secret
        self.helper_errors = []  # helper threads that died: "<name> stopped: <why>" (helper)
        self.signal_seen = None  # SIGTERM or SIGINT, once on_signal took it
        self.hello_stop = threading.Event()  # set once this rank checked in: its hello (say_hello) is not needed
        self.wd = Watchdog(self.on_expire, self.on_tick, on_error=self.helper_died)

    # ---------------------------------------------------------------- flow
    def run(self):
        """main() blocked SIGTERM and SIGINT in every thread before this object existed; one thread takes them."""
        self.helper("aiv-signals", self.on_signal)
        try:
            self.header()
            for phase in PHASES:
                if (phase in SCREEN_PHASES and self.args.skip_screen) or (phase == "soak" and not self.args.soak):
                    continue
                with self.deadline(phase):
                    getattr(self, "phase_" + phase.replace("-", "_"))()
            raise Verdict(EXIT_INTERNAL, [finding("internal", "FAIL", "the phases ended without a verdict",
                                                  code=EXIT_INTERNAL)])
        except Verdict as v:
            self.end(v)
        except BaseException as e:  # a bug still ends in one line and an exit code, blaming no host
            print_traceback(e)
            self.end(Verdict(EXIT_INTERNAL, [internal_finding(e, f"rank {self.rank} on {self.host}")]))

    @contextlib.contextmanager
    def deadline(self, phase):
        """The phase under its one Bound (armed on entry, disarmed on the way out, the stamp inside): a
        torch error inside becomes this rank's Verdict, any other exception the tool's own (`internal`).
        Rank 0 speaks first in every phase: after the roll call every phase starts at a gate rank 0 opens
        (enter_phase), and the other ranks count their bound + RANK0_GRACE from that gate, however late
        rank 0 got there."""
        self.phase = phase
        self.failpoint(phase, only=("skew",))
        b = self.bound = Bound(self.wd, phase, self.D[phase], self.grace(phase))
        try:
            with b:
                if PHASES.index(phase) > PHASES.index("rollcall") and self.proto is not None:
                    self.enter_phase(b)
                self.failpoint(phase, only=("raise",))
                yield b
                with self.state_lock:
                    self.times[phase] = round(time.monotonic() - b.start, 3)
                    self.starts[phase] = round(b.start - _T0, 3)
                if self.proto is not None:  # under the bound: rank 0's store may have frozen meanwhile
                    self.proto.stamp(self.rank, phase)
        except Verdict:
            raise
        except Exception as e:
            raise self.phase_error(phase, e) from None
        finally:
            with self.state_lock:
                self.times.setdefault(phase, round(time.monotonic() - b.start, 3))
                self.starts.setdefault(phase, round(b.start - _T0, 3))

    @property
    def phase_t0(self):
        """When the phase in progress started counting its bound (its Bound's start)."""
        return self.bound.start

    def grace(self, phase):
        """What this role adds to a phase's bound before its watchdog speaks (Coordinator, Follower)."""
        return 0.0

    def enter_phase(self, bound):
        """The start of each phase after the roll call (Coordinator opens its gate, Follower waits for it)."""

    def phase_error(self, phase, exc):
        """An error inside a phase. The tool's own (is_tool_error): the `internal` verdict, no host. A torch
        error: posted on the store, then the role's own_error."""
        if is_tool_error(exc):
            return self.internal_error(phase, exc)
        line = f"rank {self.rank} ({self.host}): {PHASE_WHAT[phase]} failed: {first_line(exc)}"
        code = EXIT_TIMEOUT if re.search(r"[Tt]imed? ?out|timeout", str(exc)) else EXIT_FAIL
        if self.proto is not None:
            try:
                self.proto.report_error(self.rank, phase, line, code)
            except Exception:
                pass
        return self.own_error(phase, line, code)

    def own_error(self, phase, line, code):
        """A rank's own torch error in a phase: its host, its rank (rank 0 overrides this once it can name
        who did not finish the phase)."""
        return failed(PHASE_CHECK[phase], line, code, [self.host], [self.rank], blame="own")

    def internal_error(self, phase, exc):
        """The tool's own error in a phase: posted (so that rank 0 blames nobody for it), then a Verdict."""
        print_traceback(exc)
        f = internal_finding(exc, f"rank {self.rank} on {self.host}, during {phase}")
        if self.proto is not None:
            with contextlib.suppress(Exception):
                self.proto.report_error(self.rank, phase, f"rank {self.rank} ({self.host}): {f['reason']}",
                                        EXIT_INTERNAL, internal=True)
        return Verdict(EXIT_INTERNAL, [f])

    # ---------------------------------------------------------------- phases
    def before_torch(self):
        """What a rank sets up before it imports torch: its hello to rank 0's last call, torch's and NCCL's
        variables (error handling, the flight recorder)."""
        os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "FATAL")  # one FAILURE line, not a C++ trace per retry
        if self.rank != 0:  # before torch: rank 0's last call knows this process is up and reaches the store
            threading.Thread(target=say_hello, args=(self.addr, self.port, launcher_store(self.env)[0], self.rank,
                                                     self.host, self.hello_stop, self.D["rollcall"], HELLO_RETRY_S),
                             name="aiv-hello", daemon=True).start()
        # abort the communicator and raise, never kill the process (1, torchrun's default, kills rank 0
        # before its verdict); an operator's own setting outside torchrun is kept
        if "TORCH_NCCL_ASYNC_ERROR_HANDLING" not in os.environ or (
                under_torchrun(self.env) and os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1"):
            os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = "2"
        if not any(v in os.environ for v in ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE")):
            # torch's flight recorder: what each rank issued (issuing); the second name for torch before 2.6,
            # whose ProcessGroupNCCL reads only it (a later torch warns on every rank that it is deprecated)
            os.environ["TORCH_FR_BUFFER_SIZE"] = "2000"
            if _torch_older_than((2, 6)):
                os.environ["TORCH_NCCL_TRACE_BUFFER_SIZE"] = "2000"

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
        # NCCL's INFO lines to a private file, once the backend is known (NCCL reads the variables at its
        # first communicator, in init): a gloo rank makes no file, so none is left behind
        self.nccl = NcclLog.capture(self.backend, self.rank, self.env)
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
        self.progress("local", backend=self.backend, device=self._dev_str(), ifaces=ifn,
                      failed=sum(f["status"] == "FAIL" for f in local), import_s=self.times["import_torch"])

    def no_torch(self, exc):
        """torch (or what it needs) cannot be imported here: the launch's environment (no venv, the wrong python),
        exit 2, no host named (judge_no_torch); the other ranks tell rank 0 through the store's wire, no torch
        needed (Follower.end), and rank 0 names a host only when it alone of several cannot (judge_no_torch)."""
        line = (f"rank {self.rank} ({self.host}): torch is not importable by {sys.executable}: {first_line(exc)}; "
                "run bootstrap_env.sh on this node or point the job at the shared venv (PYTORCH_ENV)")
        return Verdict(EXIT_USAGE, judge_no_torch({self.rank: {"line": line, "host": self.host}}, ()))

    def phase_rollcall(self):
        R, (prefix, serve) = self.D["rollcall"], launcher_store(self.env)
        self.proto = self.open_store(R, prefix, serve)
        self.progress("rollcall_open", master=f"{self.addr}:{self.port}", world=self.world, seconds=R)
        self.failpoint("rendezvous")
        self.before_check_in(R)
        stray = self.proto.check_in(self.rank, self.identity, self.world, R + RANK0_GRACE)
        self.hello_stop.set()
        if stray is not None:  # not a rank of this run: rank 0 names it; it takes no verdict of that run
            self.speak_for_node(f"FAILURE: {stray[0]}: rank {self.rank} ({self.host}, pid {os.getpid()}) is not a "
                                f"rank of the run at {self.addr}:{self.port}: {stray[1]}")
            self.exit(EXIT_FAIL)
        self.after_check_in(R)
        if self.local_rank == 0:  # after the go: the monitor never slows the roll call
            self.start_monitor()

    def open_store(self, R, prefix, serve):
        """Connect to the store (rank 0's, or torchrun's agent's): the connect and the store's first answer
        within the roll call's own bound R. A MASTER_ADDR that does not resolve here is said at once
        (resolvable), as rank 0 says it; a listener that accepts but never answers as a store (another
        service on MASTER_PORT) is named as such (unanswered)."""
        self.resolvable()
        try:
            return within(lambda: StoreProtocol.open(self.dist, self.addr, self.port, R, prefix, seal=self.seal),
                          self.bound.left(), "the store's connect")
        except BoundPassed:
            raise failed("rendezvous", f"rank {self.rank} ({self.host}): {self.unanswered(R)}", EXIT_TIMEOUT,
                         [self.host]) from None
        except Exception as e:
            if is_tool_error(e):
                raise
            raise failed("rendezvous", f"rank {self.rank} ({self.host}) cannot reach the "
                         f"{'master' if serve else 'torchrun agent store at'} {self.addr}:{self.port}: "
                         f"{first_line(e)}", EXIT_TIMEOUT, [self.host]) from None

    def resolvable(self):
        """MASTER_ADDR looked up here within RESOLVE_S: a name that does not resolve is this host's `rendezvous`
        FAIL at once (exit 1, as rank 0 says it), not a store that never answered after the roll call's bound.
        A lookup that is only slow is left to the store's connect, which looks again."""
        try:
            within(lambda: socket.getaddrinfo(self.addr, self.port, type=socket.SOCK_STREAM), RESOLVE_S,
                   f"the lookup of MASTER_ADDR={self.addr}")
        except socket.gaierror as e:
            raise failed("rendezvous", f"MASTER_ADDR={self.addr} does not resolve on rank {self.rank}'s host "
                         f"{self.host}: {e.strerror}", hosts=[self.host], ranks=[self.rank]) from None
        except (BoundPassed, OSError):
            pass

    @contextlib.contextmanager
    def issuing(self, op, ranks=None, seq=None):
        """Around every collective call of the phases (the one helper their call sites use): this rank's
        record of the collective it is about to issue on the group of `ranks` (default the world), kept in
        memory (Issued), read when rank 0 asks (a phase's bound passed). On NCCL the block ends once the
        collective finished on this device (a synchronise: done means finished, not only queued). The
        `stall` failpoint pauses here, before the phase's first collective is issued."""
        if self.phase not in self.stalled:
            self.stalled.add(self.phase)
            self.failpoint(self.phase, only=("stall",))
        key = group_key(range(self.world) if ranks is None else ranks)
        self.issued.start(op, key, seq)
        if self.phase not in self.wedged:  # inside the call, its "about to issue" record made: the backend not yet
            self.wedged.add(self.phase)
            self.failpoint(self.phase, only=("wedge",))
        yield
        if self.backend == "nccl":
            self.torch.cuda.synchronize()
        self.issued.done(key)

    def phase_init(self):
        kw = {"backend": self.backend, "rank": self.rank, "world_size": self.world,
              "store": self.dist.PrefixStore(self.proto.prefix + "/pg", self.proto.raw),
              "timeout": datetime.timedelta(seconds=self.D["init"] + TORCH_BACKSTOP_S)}  # ours fires first
        if self.backend == "nccl":
            kw["device_id"] = self.torch.device("cuda", self.device)
        self.failpoint("init")
        t = time.monotonic()
        with self.issuing("init_process_group", seq=0):
            self.dist.init_process_group(**kw)
        self.issued.names[self.dist.group.WORLD.group_name] = group_key(range(self.world))  # the recorder's name
        self.progress("init", backend=self.backend, world=self.world, secs=time.monotonic() - t)

    def telemetry(self):
        """This rank's identity and, on a node leader, the node's facts: what the telemetry gather sends."""
        tele = dict(self.identity)
        if not self.args.skip_numerics:  # GPU: measured on the measuring thread; CPU: here (rank_numerics)
            tele["numerics"] = rank_numerics(self.torch, self.device if self.backend == "nccl" else None,
                                             self._kind(), self.bg.gpu, self.bound.left() / 4)
        node = self.bg.node_facts(self.bound.left() / 4)  # nvidia-smi: a quarter of this phase at most
        if node is not None:
            tele["node"] = node
        return tele

    def phase_telemetry(self):
        self.failpoint("telemetry")
        self.proto.post("telemetry", self.rank, self.telemetry())
        self.failpoint("done-telemetry")
        self.proto.wait_gate("judge", self.bound.left(RANK0_GRACE))

    def phase_soak(self):
        """--soak: every rank loads its own device for --soak seconds, all starting at one gate once their
        operands are warm (every GPU heats together), and posts its row (rank 0 judges them all).
        -> this rank's row."""
        self.failpoint("soak")
        g = self.identity.get("gpu") or {}
        row = soak_measure(self.torch, self._device(), self._kind(), self.args.soak, g.get("uuid"),
                           lambda: self.round_gate("soak"), numerics=not self.args.skip_numerics)
        self.proto.screen_post("soak", self.rank, row, self.world)
        return row

    def phase_collective(self):
        torch, w, r, t = self.torch, self.world, self.rank, time.monotonic()
        base = torch.arange(1 << 16, dtype=torch.int64, device=self._device())
        x, s = base * (r + 1) + r, torch.tensor([r + 1], dtype=torch.int64, device=self._device())
        self.failpoint("collective")
        with self.issuing("all_reduce"):
            self.dist.all_reduce(x)
        with self.issuing("all_reduce"):
            self.dist.all_reduce(s)
        want = base * (w * (w + 1) // 2) + w * (w - 1) // 2
        self.results = {"rank": r, "ar_ok": bool(torch.equal(x, want)), "ar_sum": int(s.item())}
        self.progress("collective", world=w, secs=time.monotonic() - t)

    def phase_ddp(self):
        torch, dist, dev, t = self.torch, self.dist, self._device(), time.monotonic()
        ddp_imports()  # where _warm_imports did not (or not yet): with the collector paused
        from torch.nn.parallel import DistributedDataParallel as DDP
        if not self.args.skip_numerics:  # this rank's own gradients, same input as every rank's, before any all-reduce
            self.results["grads_local"] = ddp_local_grads(torch, dev)
        g = torch.Generator().manual_seed(1234 + self.rank)
        xin, yin = torch.randn(16, 10, generator=g).to(dev), torch.randn(16, 10, generator=g).to(dev)
        model = torch.nn.Linear(10, 10).to(dev)
        with self.issuing("DDP's broadcast of the parameters"):
            ddp = DDP(model, device_ids=[self.device] if self.backend == "nccl" else None)
        self.failpoint("ddp")
        loss = torch.nn.functional.mse_loss(ddp(xin), yin)
        with self.issuing("DDP's all_reduce of the gradients"):
            loss.backward()
        grads = torch.cat([p.grad.detach().flatten() for p in model.parameters()]).double().cpu()
        lsum = loss.detach().clone()
        with self.issuing("all_reduce"):
            dist.all_reduce(lsum)
        self.results.update(loss=loss.item(), grads=hashlib.sha256(grads.numpy().tobytes()).hexdigest(),
                            imports=self.import_results(), helpers=list(self.helper_errors), **self.nccl.facts())
        self.proto.post("results", self.rank, self.results)
        self.failpoint("done-ddp")
        self.results_gathered(lsum.item())
        self.progress("ddp", secs=time.monotonic() - t)

    def results_gathered(self, loss_sum):
        """Rank 0 gathers every rank's results from the store and keeps them; the others have nothing to keep."""

    def phase_bandwidth(self):
        if self.args.bandwidth:
            self.bandwidth = [self.bandwidth_at(size) for size in self.args.bandwidth]

    # ---------------------------------------------------------------- bounds, signals, the way out
    def on_expire(self, phase):
        """The watchdog's bound passed (the role's expire). Never lets the bound itself fail: the tool's own
        error here still ends the process with `internal`."""
        try:
            self.expire(phase)
        except BaseException as e:
            print_traceback(e)
            self.expire_failed(phase, e)
            self.exit(EXIT_INTERNAL)

    def expire_failed(self, phase, exc):
        """The tool's own error at a bound: rank 0 gives the `internal` verdict; the others just exit 4."""

    def expiry_cause(self, phase):
        if phase == "rollcall" and self.proto is None:  # still connecting to the store
            return self.unanswered(self.D[phase])
        return self.bound.cause() if self.bound is not None and self.bound.phase == phase else \
            Bound(None, phase, self.D[phase]).cause()

    def unanswered(self, seconds):
        """Why the store's connect did not finish: a listener that accepts but never answers, or none."""
        try:
            socket.create_connection((self.addr, self.port), timeout=PROBE_CONNECT_S).close()
        except OSError:
            return f"cannot reach the master {self.addr}:{self.port}: no store answered within {seconds:g}s"
        return (f"something on MASTER_PORT ({self.addr}:{self.port}) accepts connections but does not answer as "
                f"the job's store (no answer within {seconds:g}s): another service or a stale process holds "
                f"the port; pick a free MASTER_PORT")

    def on_signal(self):
        """SIGTERM or SIGINT: scancel, the time limit, preemption, a launcher (torchrun, when another worker
        died), Ctrl-C. main() blocked both in every thread before this object existed; this thread takes
        them and hands them to the role (signalled)."""
        signum = signal.sigwait({signal.SIGTERM, signal.SIGINT})
        self.signal_seen = signum
        self.signalled(signum, signal.Signals(signum).name, self.phase)

    def speak_for_node(self, text):
        run = getattr(self.proto, "run", None) or ""  # the roll call's nonce: this run, not an earlier one
        return speak_once_per_node(text, self.env, self.local_rank, f"{self.port}-{run}")

    def exit(self, code):
        """Flush and leave without interpreter teardown (gloo threads can SIGABRT there). Every way out of a
        rank passes here: its NCCL WARN lines are relayed first (NcclLog.relay)."""
        self.bg.stop()
        who = f"rank {self.rank} ({self.host}): "
        self.nccl.relay(who)
        self.nccl.close(code != EXIT_PASS, who)
        flush_all()
        os._exit(code)

    # ---------------------------------------------------------------- helpers of the phases
    def progress(self, key, **kw):
        """Rank 0 prints the progress lines (Coordinator); the others are silent."""

    def header(self):
        """Rank 0 prints the header (Coordinator)."""

    def failpoint(self, phase, only=("die", "hang", "pause")):
        """Test-only fault injection: AIV_FAILPOINT=<kind>:<phase>:<rank>[,...], kinds:
          die, hang, pause=S  SIGKILL, SIGSTOP or an S-second pause of this rank where it reaches <phase>
                              (rendezvous, init, telemetry, screen-gpu, screen-net, soak, collective, ddp;
                              round-<name>: rank 0 before it opens a screen batch's gate, e.g. round-p2;
                              done-<phase>: after the rank posted its own part of telemetry, screen-gpu or
                              ddp, while the others may still work in it; files: rank 0's verdict, before
                              it writes the files asked for: slow storage); a pause first creates the file
                              AIV_FAILPOINT_MARK, if set, so that a test breaks something (a link) while the
                              run waits
          stall=S             an S-second pause right before the rank issues its first collective of <phase>
                              (init, screen-net, collective, ddp, bandwidth: alive, never issuing it), marked
                              like a pause
          wedge=S             the same pause inside that call, after the rank's own "about to issue" record
                              and before its backend sees the call (a rank stuck in a driver call or a lazy
                              communicator set-up), marked like a pause
          raise               the tool's own error (AssertionError) at the start of a phase of PHASES, in
                              the verdict's report (<phase> = report), at the verdict's start (verdict:
                              rank 0 only, outside the report's own guard), or in a helper thread
                              (helper-<name>, e.g. helper-aiv-listener)
          skew=S              an S-second sleep before the rank enters a phase of PHASES (late start)"""
        for item in filter(None, self.env.get("AIV_FAILPOINT", "").split(",")):
            m = re.fullmatch(r"(die|hang|raise|(pause|skew|stall|wedge)=(\d+)):([\w-]+):(\d+)", item)
            if not (m and m.group(4) == phase and int(m.group(5)) == self.rank and (m.group(2) or m.group(1)) in only):
                continue
            flush_all()
            if m.group(1) == "raise":
                raise AssertionError(f"failpoint {item}")
            if m.group(3) is None:
                os.kill(os.getpid(), signal.SIGKILL if m.group(1) == "die" else signal.SIGSTOP)
            if m.group(2) in ("pause", "stall", "wedge") and self.env.get("AIV_FAILPOINT_MARK"):
                with open(self.env["AIV_FAILPOINT_MARK"], "w") as f:
                    f.write(f"{phase} {self.rank}\n")
            time.sleep(int(m.group(3)))

    def _device(self):
        return self.torch.device("cuda", self.device) if self.backend == "nccl" else self.torch.device("cpu")

    def _dev_str(self):
        return f"cuda:{self.device}" if self.device is not None else "cpu"

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
        except Exception as e:
            if is_tool_error(e):  # the tool's own error: `internal`, never this GPU's fault
                raise
            out.append(finding("device", "FAIL", f"{who}: cuda:{dev} unusable: {first_line(e)}", [self.host]))
            return None

    def _collect_node(self, box):
        try:
            count = self.torch.cuda.device_count() if self.backend == "nccl" else 0
            box["facts"] = collect_node_facts(self.args.sysfs_root, self.torch, self.backend, count, self.env)
        except Exception as e:
            box["internal" if is_tool_error(e) else "error"] = e if is_tool_error(e) else first_line(e)

    def import_results(self, wait_s=None):
        """Node leaders: the torchvision/torchaudio probe started at launch (usually done by now); taken once
        (the screen takes it early, so that it measures a quiet node), within half the phase's time left."""
        if self.bg.probe is None or self.bg.imports is not None:
            return self.bg.imports
        imports = self.bg.take_imports(min(IMPORT_PROBE_S, self.bound.left() / 2) if wait_s is None else wait_s)
        with self.state_lock:
            self.times["imports"] = self.bg.imports_s
        return imports

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
        try:
            client = self.proto.clone()
            while True:
                client.beat(self.host)
                time.sleep(period)
        except Exception as e:
            if is_tool_error(e):
                raise

    def helper(self, name, fn, *args):
        """Start a helper thread. One that dies of an exception says so: on stderr at once, and in the
        report as a WARN `internal` (rank 0's own at the verdict, the others' with their results)."""
        def run():
            try:
                self.failpoint("helper-" + name, only=("raise",))
                fn(*args)
            except BaseException as e:
                self.helper_died(name, e)
        threading.Thread(target=run, name=name, daemon=True).start()

    def helper_died(self, name, exc):
        self.helper_errors.append(f"{name} stopped: {first_line(exc)} in {where_raised(exc)}")
        emit(f"rank {self.rank} ({self.host}): WARNING: helper thread {name} stopped: {first_line(exc)}", sys.stderr)
        print_traceback(exc)

    def bandwidth_at(self, size):
        """all_reduce bus bandwidth as nccl-tests defines it: busbw = algbw * 2(n-1)/n, warm-up then
        timed iterations, device-synchronised, the slowest rank's time; GB/s = 1e9 bytes/s."""
        torch, dist, dev = self.torch, self.dist, self._device()
        sync = torch.cuda.synchronize if self.backend == "nccl" else (lambda: None)
        warm, iters = (5, 20) if self.backend == "nccl" else (1, 3)
        x = torch.zeros(max(1, size // 4), dtype=torch.float32, device=dev)
        with self.issuing(f"all_reduce x{warm} ({human_bytes(size)}, warm-up)"):
            for _ in range(warm):
                dist.all_reduce(x)
            sync()
        with self.issuing(f"all_reduce x{iters} ({human_bytes(size)})"):
            t0 = time.perf_counter()
            for _ in range(iters):
                dist.all_reduce(x)
            sync()
            dt = torch.tensor([(time.perf_counter() - t0) / iters], dtype=torch.float64, device=dev)
        with self.issuing("all_reduce (the slowest rank's time)"):
            dist.all_reduce(dt, op=dist.ReduceOp.MAX)
        sec = dt.item()
        algbw = size / sec / 1e9
        busbw = algbw * 2 * (self.world - 1) / self.world
        self.progress("bandwidth", size=human_bytes(size), us=sec * 1e6, algbw=algbw, busbw=busbw)
        return {"bytes": size, "time_us": sec * 1e6, "algbw": algbw, "busbw": busbw}

    def write_json(self, state, first=False):
        return write_json_within(self.args.json, state, first)



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
    try:
        ddp_imports()
    except Exception:
        pass
