"""Floor 5 (runtime): rank 0: serves the store, holds the roll call, judges every phase, owns the verdict."""
import contextlib
import copy
import json
import sys
import threading
import time

from ..checks.judge import apply_strict, judge_final, judge_gate, judge_strays, rank_record, with_results
from ..checks.manifest import judge_bands, judge_manifest
from ..checks.numerics import judge_ddp_grads
from ..core.base import (
    EXIT_FAIL,
    EXIT_INTERNAL,
    EXIT_INTERRUPTED,
    EXIT_TIMEOUT,
    VERSION,
    Verdict,
    _counts,
    elapsed,
    finding,
    first_line,
    internal_finding,
    print_traceback,
    verdict_code,
    where_raised,
)
from ..core.blame import unlocalised
from ..core.bounds import Bound, bounded
from ..core.deadlines import ACKS_S, ACKS_SIGNALLED_S, ERROR_GRACE, NAMING_S, PHASE_CHECK, PHASE_WHAT, STORE_OP_S
from ..core.speak import emit
from ..out.render import NO_HOST_MARK
from ..screen.measure import SCREEN_MATMUL_N
from ..screen.run import ScreenCoordinator
from ..screen.soak import judge_soak, soak_rows
from .conclusion import Conclusion
from .naming import Naming
from .rank import HEADER, PROGRESS, RankRun
from .rollcall import RollCall


class Coordinator(RollCall, Naming, ScreenCoordinator, RankRun):
    """Rank 0: serves the store, holds the roll call (RollCall), judges what each phase gathered and owns
    the verdict. conclude() is the one way out, from whichever thread gets there first (the main thread,
    the watchdog, the signal thread); it names who did not finish a phase (Naming: unfinished) from the
    stamps, the node monitors' liveness and the error reports."""

    beats = False  # rank 0 reads its own node's ranks from /proc

    def __init__(self, args, contract, env):
        self.alarm_at = None  # on_tick: when the first error report was seen
        self.gone = set()  # ranks found dead or frozen: no acknowledgement to wait for
        self.acks_s = ACKS_S  # how long the store stays up for the acknowledgements
        self.verdict_lock = threading.Lock()
        self.concluding = threading.Event()  # the tick handed a verdict to a thread of its own (conclude_apart)
        self.tick_busy = threading.Lock()  # held by the tick's store read, which may outlive its bound
        self.serving = False
        self.last_call = None  # the roll call's last call, when it ended the roll call: {'grace', 'unheard'}
        self.verdict_code = None  # the code as the verdict stands (the verdict's bound exits with it)
        self.soak = self.drain = self.collectives = None  # the soak's rows (--soak); the --drain plan; collectives
        self.screen, self.screen_rounds, self.screen_made = None, {}, set()  # the screen's results, batches, groups
        super().__init__(args, contract, env)

    # ---------------------------------------------------------------- flow
    def end(self, v):
        self.conclude(v.code, v.findings, self.proto)

    def grace(self, phase):
        """Rank 0's watchdog at the roll call: NAMING_S past the bound, to name who did not check in."""
        return NAMING_S if phase == "rollcall" else 0.0

    def enter_phase(self, bound):
        """Rank 0 opens every phase's gate after the roll call."""
        self.proto.open_gate("phase/" + bound.phase)

    def own_error(self, phase, line, code):
        """Rank 0's own torch error: once the roll call is done, ERROR_GRACE for the others' reports, then
        the finding naming who did not finish the phase."""
        if self.poll is None:
            return super().own_error(phase, line, code)
        time.sleep(ERROR_GRACE)
        return Verdict(code, [self.unfinished(phase, self.proto, f"{PHASE_WHAT[phase]} failed", code)])

    # ---------------------------------------------------------------- phases
    def before_check_in(self, R):
        self.proto.publish_world(self.world)

    def after_check_in(self, R):
        self.roll_call()

    def phase_telemetry(self):
        t = time.monotonic()
        self.failpoint("telemetry")
        self.proto.post("telemetry", 0, self.telemetry())
        gathered = self.fan_in("telemetry")
        with self.state_lock:
            self.records = [rank_record(r) for r in gathered]
        gate = apply_strict(judge_gate(gathered, self.env.get("NCCL_IB_HCA")), self.args.strict)
        self.findings += gate
        self.progress("telemetry", ranks=len(gathered), secs=time.monotonic() - t, counts=_counts(gate),
                      size=max(len(json.dumps(r, default=str)) for r in gathered))
        if verdict_code(self.findings):
            raise Verdict(verdict_code(self.findings))
        self.proto.open_gate("judge")

    def phase_soak(self):
        """Rank 0 soaks its own device like every rank, collects every rank's row, judges them (judge_soak)
        and ends the run on a FAIL before the collectives."""
        t = time.monotonic()
        row = super().phase_soak()
        if not self.proto.screen_wait("soak", self.bound.left()):
            raise Verdict(EXIT_TIMEOUT, [self.unfinished(self.phase, self.proto, self.bound.cause())])
        cpu = self._kind() == "cpu"
        rows = soak_rows(self.records, self.proto.screen_posts("soak"), cpu)
        soak = {"seconds": self.args.soak, "cpu": cpu, "dtype": row.get("dtype"),
                     "n": SCREEN_MATMUL_N[self._kind()], "gpus": rows}
        with self.state_lock:
            self.soak = soak
        found = apply_strict(judge_soak(rows, cpu), self.args.strict)
        self.findings += found
        ratios = [r["tflops_last"] / r["tflops_first"] for r in rows if r.get("tflops_first") and
                  r.get("tflops_last") is not None]
        temps = [r["temp_max_c"] for r in rows if r.get("temp_max_c") is not None]
        detail = (f"TFLOPS last/first window min {min(ratios):.2f}" if ratios else "too short to time windows") + (
            f", max temperature {max(temps):g} C" if temps else ", no GPU telemetry" + (" on CPU" if cpu else ""))
        self.progress("soak", n=len(rows), what="CPU rank(s)" if cpu else "GPU(s)", seconds=self.args.soak,
                      detail=detail, counts=_counts(found), secs=time.monotonic() - t)
        if verdict_code(self.findings):
            raise Verdict(verdict_code(self.findings))

    def phase_bandwidth(self):
        super().phase_bandwidth()
        if self.bandwidth:
            with self.state_lock:
                self.collectives["bandwidth"] = self.bandwidth

    def fan_in(self, name):
        """Rank 0: every rank's post of `name` (its own first) from the store, in rank order, within what
        is left of the phase's bound. A refused post ends the run (side_channel names it, nobody is
        blamed); ranks that did not post are named by unfinished (a rank that posted finished its part)."""
        posts = self.proto.wait_posts(name, self.bound.left())
        if self.proto.forged:
            raise Verdict(EXIT_FAIL)
        if len(posts) < self.world:
            raise Verdict(EXIT_TIMEOUT, [self.unfinished(self.phase, self.proto, self.bound.cause())])
        return [posts[r] for r in range(self.world)]

    def results_gathered(self, loss_sum):
        gathered = self.fan_in("results")
        self.results = gathered
        collectives = {"ar_sum": gathered[0]["ar_sum"], "ar_expected": self.world * (self.world + 1) // 2,
                            "ranks": self.world, "loss": loss_sum / self.world,
                            "grads_identical": len({res["grads"] for res in gathered}) == 1}
        with self.state_lock:
            self.collectives = collectives

    def phase_final(self):
        """Judge what the collectives returned: the verdict."""
        with self.state_lock:
            self.records = with_results(self.records, self.results)
        final = (judge_final(self.records, self.results, self.world, self.host_of, self.env.get("NCCL_IB_DISABLE"),
                             (self.collectives or {}).get("bandwidth"), self.args.min_busbw)
                 + judge_ddp_grads(self.records, self.results)  # numerics: each rank's own gradients
                 + judge_manifest(self.args.manifest_data, self.records, self.screen)
                 + judge_bands(self.args.manifest_data, self.records, self.screen)  # manifest: drift from the accepted
                 + judge_strays(self.proto.strays(), self.host_of.values()))  # a stray after the roll call
        self.findings += apply_strict(final, self.args.strict)
        raise Verdict(verdict_code(self.findings))

    # ---------------------------------------------------------------- the verdict
    def conclude(self, code, findings, client):
        """Rank 0 only, from whichever thread gets here first (the main thread, a thread the tick or the
        watchdog started, the signal thread; never the watchdog's own, whose heap still bounds the verdict):
        the verdict (Conclusion, on the run's facts copied under the state lock), then exit. Whatever fails
        inside, the process still exits, with the verdict or with `internal` (exit 4); it never keeps the lock
        and lives on."""
        self.verdict_lock.acquire()  # a second caller waits here until the first one exits the process
        Bound(self.wd, "verdict", self.D["verdict"]).arm()  # the verdict's own bound: expire("verdict")
        self.verdict_code = code
        if client is not None:  # the others now wait up to VERDICT_S for the code (the files come first)
            bounded(client.post_deciding, STORE_OP_S)
        try:
            self.failpoint("verdict", only=("raise",))
            found = self.findings.close() + list(findings) + self.helper_findings()
            c = Conclusion(self.snapshot(), self.args, client, self.progress, self.failpoint, self.set_code)
            code = c.give(found, code)
        except BaseException as e:
            print_traceback(e)
            with contextlib.suppress(BaseException):
                emit(f"FAILURE: internal: {first_line(e)} in {where_raised(e)} (rank 0 on {self.host}, giving the "
                     f"verdict): a bug in the tool, not a fault of the cluster: no host is blamed {NO_HOST_MARK}")
            code = verdict_code(self.findings.snapshot()) or EXIT_INTERNAL
        self.exit(code)

    def set_code(self, code):
        self.verdict_code = code

    def snapshot(self):
        """The run's facts for the verdict, as plain data copied under the state lock: the main thread may still
        be inside a phase (the verdict came from the watchdog or a signal) and writes them under that lock."""
        with self.state_lock:
            run = {"host": self.host, "world": self.world, "started_at": self.started_at, "backend": self.backend,
                   "addr": self.addr, "port": self.port, "expect": self.expect, "strict": self.args.strict,
                   "D": self.D, "times": self.times, "starts": self.starts, "records": self.records,
                   "collectives": self.collectives, "screen": self.screen, "soak": self.soak, "env": self.env,
                   "manifest_data": self.args.manifest_data,
                   "host_of": self.host_of, "gone": set(self.gone), "serving": self.serving,
                   "forged": list(self.proto.forged) if self.proto is not None else [],
                   "authenticated": self.seal.authenticated, "acks_s": min(self.acks_s, self.D["final"])}
            return copy.deepcopy(run)

    def helper_findings(self):
        """Helper threads that died (rank 0's own, and the others' as their results said): a WARN each.
        The run went on without them; the verdict stands on what the phases measured."""
        lines = [f"rank 0 ({self.host}): {e}" for e in self.helper_errors]
        lines += [f"rank {res['rank']} ({self.host_of.get(res['rank'], '?')}): {e}" for res in self.results or ()
                  if isinstance(res, dict) and "rank" in res for e in res.get("helpers") or ()]
        return [finding("internal", "WARN", f"{ln}: a helper thread of the tool died (a bug in the tool: please report "
                        "it); the run went on without it") for ln in lines]

    # ---------------------------------------------------------------- bounds and signals
    def expire(self, phase):
        """The bound passed: name who did not finish (before the roll call ended, only rank 0 itself). The
        verdict's own bound: exit with the verdict's code, saying which output did not finish."""
        if phase == "verdict":
            emit(f"WARNING: rank 0 ({self.host}): the verdict's outputs did not finish within {self.D[phase]:g}s "
                 f"(a file on slow storage, scontrol, the acknowledgements): exiting with the verdict's code "
                 f"{self.verdict_code}", sys.stderr)
            self.exit(self.verdict_code if self.verdict_code is not None else EXIT_INTERNAL)
        cause = self.expiry_cause(phase)
        if self.poll is None:  # rank 0 itself, alive, did not finish its own phase: slow is not evidence
            f = finding(PHASE_CHECK[phase], "FAIL", f"rank 0 ({self.host}): {cause}", [self.host], [0],
                        code=EXIT_TIMEOUT)
            self.conclude(EXIT_TIMEOUT, [unlocalised(f, "stuck")], self.proto)
        self.conclude(EXIT_TIMEOUT, [self.unfinished(phase, self.poll, cause)], self.poll)

    def expire_failed(self, phase, exc):
        self.conclude(EXIT_INTERNAL, [internal_finding(exc, f"rank 0 on {self.host}, at the {phase} bound")], None)

    def on_tick(self, phase):
        """Rank 0, every liveness period during a phase after the roll call (on the watchdog's thread): a rank
        whose process is gone ends the phase at once; an error report ends it ERROR_GRACE later; a value not of
        this run ends the run (side_channel names it, nobody blamed). The tick's store reads take at most
        STORE_OP_S (a tick whose read does not come back is skipped: the phase's own bound still holds), and
        the verdict it decides is given on a thread of its own (conclude_apart): the watchdog goes on bounding
        it."""
        if self.poll is None or phase in ("local", "rollcall") or self.verdict_lock.locked():
            return
        seen = self.tick_read()
        if seen is None:
            return
        forged, dead, errors = seen
        if forged:
            self.conclude_apart(EXIT_FAIL, lambda client: [])
            return
        if self.alarm_at is None and (dead or errors):
            self.alarm_at = time.monotonic()
        if dead or (self.alarm_at is not None and time.monotonic() - self.alarm_at >= ERROR_GRACE):
            self.conclude_apart(EXIT_TIMEOUT, lambda client: [self.unfinished(phase, client,
                                                                              f"{PHASE_WHAT[phase]} failed")])

    def tick_read(self):
        """(a value refused, a rank's process gone, an error report posted) from the store within STORE_OP_S, or
        None: no answer in time, or the last tick's read still pending (one read at a time)."""
        if self.tick_busy.locked():
            return None

        def read():
            with self.tick_busy:
                hosts = sorted(set(self.host_of.values()))
                dead = any(st == "gone" for snap in self.poll.live(hosts).values()
                           for st in (snap.get("ranks") or {}).values())
                return bool(self.poll.forgeries()), dead, bool(self.poll.error_count() and self.poll.errors())
        return bounded(read, STORE_OP_S)

    def conclude_apart(self, code, findings_of):
        """The verdict the tick decided, on a thread of its own with a store connection of its own (the
        findings it names: findings_of(client)); once."""
        if self.concluding.is_set():
            return
        self.concluding.set()

        def give():
            client = bounded(self.proto.clone, STORE_OP_S) or self.poll
            self.conclude(code, findings_of(client), client)
        threading.Thread(target=give, name="aiv-verdict", daemon=True).start()

    def signalled(self, signum, name, phase):
        """The verdict within NAMING_S: `interrupted` (exit 5), naming no host, unless a rank was already
        dead or frozen before the signal (interruption)."""
        if self.verdict_lock.locked():  # the verdict is being given already
            return
        client = bounded(self.proto.clone, STORE_OP_S) if self.proto is not None else None
        self.acks_s = ACKS_SIGNALLED_S
        self.conclude(EXIT_INTERRUPTED, [self.interruption(phase, name, client)], client)

    # ---------------------------------------------------------------- output
    def progress(self, key, **kw):
        emit(f"[{elapsed():9.2f}s] " + PROGRESS[key].format(**kw))

    def header(self):
        emit("\n".join(HEADER).format(
            version=VERSION, started=self.started_at, host=self.host, world=self.world,
            master=f"{self.addr}:{self.port}", port_from=self.c.get("port_from", "port from " + self.c["port_source"]),
            launch=self.c.get("launch", self.c["source"]), rollcall=self.D["rollcall"],
            timeout=self.D["init"], expect=" ".join(f"{k}={v}" for k, v in sorted(self.expect.items())) or "none"))
