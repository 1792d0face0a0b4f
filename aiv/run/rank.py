"""Floor 5 (runtime): RankRun, what every rank runs: the phases in order, each under its bound."""
import contextlib
import datetime
import hashlib
import os
import socket
import threading
import time

from ..checks.hang import group_key
from ..checks.numerics_measure import ddp_local_grads, rank_numerics
from ..core.base import (
    CLUSTER_ERRORS,
    EXIT_FAIL,
    EXIT_INTERNAL,
    EXIT_TIMEOUT,
    Verdict,
    failed,
    finding,
    first_line,
    human_bytes,
    internal_finding,
    print_traceback,
)
from ..core.bounds import BoundPassed, Watchdog, within
from ..core.deadlines import PHASES, RANK0_GRACE, RESOLVE_S, SCREEN_PHASES, TORCH_BACKSTOP_S, deadlines
from ..core.speak import Findings
from ..launch.contract import job_secret, launcher_expectations, launcher_store
from ..launch.launchers import node_name
from ..out.render import BAR
from ..screen.measure import soak_measure
from ..screen.run import ScreenRunner
from .background import Background, Issued
from .guard import RankGuard
from .setup import RankSetup, ddp_imports
from .store import Seal, StoreProtocol, run_base

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


class RankRun(RankSetup, RankGuard, ScreenRunner):
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
        self.backend = self.device = self.results = self.bandwidth = self.identity = None
        self.bg = Background()  # work off the main thread
        self.issued, self.stalled, self.wedged = Issued(), set(), set()  # what this rank issued last (issuing)
        self.screen_groups = []  # the screen's groups this rank made (kept, never destroyed)
        self.my_groups = {}  # a group's ranks -> this rank's group (re-measured with the same group)
        self.seal = Seal(job_secret(env), run_base(env))  # every value on the store, signed with the job's secret
        self.helper_errors = []  # helper threads that died: "<name> stopped: <why>" (helper)
        self.signal_seen = None  # SIGTERM or SIGINT, once on_signal took it
        self.hello_stop = threading.Event()  # set once this rank checked in: its hello (say_hello) is not needed
        self.own_environment()  # its variables and NCCL's log (self.nccl), before this process's first thread
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

    # ---------------------------------------------------------------- phases
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
        except CLUSTER_ERRORS as e:
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

    # ---------------------------------------------------------------- helpers of the phases
    def progress(self, key, **kw):
        """Rank 0 prints the progress lines (Coordinator); the others are silent."""

    def header(self):
        """Rank 0 prints the header (Coordinator)."""

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
