"""Floor 5 (runtime): rank 0 (Coordinator): serves the store and holds the roll call (RollCall), judges every
phase, names who did not finish one or was already dead when a signal came (Naming), owns the verdict."""
import contextlib
import copy
import errno
import json
import os
import socket
import sys
import threading
import time

from ..checks.hang import nccl_view
from ..checks.judge import (
    STOPPED_WORDS,
    apply_strict,
    finished_by,
    judge_final,
    judge_gate,
    judge_no_torch,
    judge_pre,
    judge_strays,
    judge_unfinished,
    quiet_monitor_note,
    rank_record,
    unreachable_hosts,
    with_results,
)
from ..checks.manifest import judge_bands, judge_manifest
from ..checks.numerics import judge_ddp_grads
from ..core.base import (
    _T0,
    EXIT_FAIL,
    EXIT_INTERNAL,
    EXIT_INTERRUPTED,
    EXIT_TIMEOUT,
    EXIT_USAGE,
    VERSION,
    Verdict,
    _counts,
    elapsed,
    failed,
    finding,
    first_line,
    format_ranges,
    internal_finding,
    print_traceback,
    verdict_code,
    where_raised,
)
from ..core.blame import unlocalised
from ..core.bounds import Bound, bounded
from ..core.deadlines import (
    ACKS_S,
    ACKS_SIGNALLED_S,
    ERROR_GRACE,
    FAN_IN,
    FORGED_POLL_S,
    ISSUE_PHASES,
    ISSUED_S,
    NAMING_S,
    NCCL_RAS_S,
    PHASE_CHECK,
    PHASE_WHAT,
    SCREEN_PHASES,
    SNAPSHOT_S,
    STORE_OP_S,
    TERM_REPORTS_S,
    LastCall,
    live_period,
)
from ..core.speak import emit
from ..launch.contract import slurm_expected_hosts
from ..out.render import NO_HOST_MARK
from ..screen.measure import SCREEN_MATMUL_N
from ..screen.run import ScreenCoordinator
from ..screen.soak import judge_soak, soak_rows
from .conclusion import Conclusion
from .liveness import liveness, proc_stat
from .rank import HEADER, PROGRESS, RankRun
from .ras import ras_addr, ras_status
from .store import Forged, StoreProtocol, fd_limit_problem


def hard_failures(broken):
    """The local failures that end the roll call at once: all but a python without torch (judge_no_torch weighs
    those once every rank checked in or failed)."""
    return {r: e for r, e in broken.items() if not (e.get("code") == EXIT_USAGE and not e.get("internal"))}


class RollCall:
    """Rank 0's roll call: the store (open_store, _listen_socket), the wait for every rank (wait_roll, the
    last call), the judges of what it shows (roll_call, not_checked_in), then the go. Mixed into
    Coordinator: the state it fills (records, host_of, master, poll) is the rank's."""

    def open_store(self, R, prefix, serve):
        """Rank 0 serves the store on a socket it bound itself, unless torchrun's agent serves it."""
        self.serving = serve  # a store of its own: rank 0 sees who connects to it
        if not serve:
            return super().open_store(R, prefix, serve)
        problem = fd_limit_problem(self.world, self.expect.get("nodes") or self.world)
        if problem:
            raise failed("rendezvous", f"rank 0 ({self.host}): {problem}", hosts=[self.host], blame="own")
        fd = self._listen_socket().detach()
        return StoreProtocol.open(self.dist, self.addr, self.port, R, prefix, listen_fd=fd, seal=self.seal)

    def roll_call(self):
        """Rank 0: wait for every rank (or the last call), judge what the roll call shows, then open the gate."""
        t, R = time.monotonic(), self.D["rollcall"]
        complete, strays, broken = self.wait_roll(t + self.bound.left())
        if strays or hard_failures(broken):  # woken early: the others of its launch get a moment to post too
            time.sleep(ERROR_GRACE)
            strays, broken = self.proto.strays(), self.local_failures()
        hard = hard_failures(broken)
        self.findings += [finding("internal", "FAIL", e["line"], ranks=[r], code=EXIT_INTERNAL)
                          if e.get("internal") else finding("local", "FAIL", e["line"], [e["host"]] if e.get("host")
                                                            else [], [r], blame="own")
                          for r, e in sorted(hard.items())]
        early = bool(strays or hard)  # ranks still starting when the roll call ended early are not late
        unseen = [] if complete and not early else self.proto.missing(self.world)  # no record on the store
        missing = [r for r in unseen if r not in broken]
        absent = set(unseen) | set(broken)
        present = [r for r in range(self.world) if r not in absent]
        with self.state_lock:
            self.records = [rank_record(r) for r in self.proto.identities(present)]
        if self.proto.forged:  # a record not of this run: nothing it says is believed, nobody is blamed for it
            self.progress("rollcall", present=len(self.records), world=self.world, secs=time.monotonic() - t,
                          result="FAIL")
            raise Verdict(EXIT_FAIL)
        self.host_of = {rec["rank"]: rec["host"] for rec in self.records}
        self.findings += judge_strays(strays, self.host_of.values()) if early else []
        self.findings += judge_no_torch({r: e for r, e in broken.items() if r not in hard},
                                        self.host_of.values(), self.expect.get("nodes"))
        if missing and not early:
            self.findings.append(self.not_checked_in(missing, present, R))
        self.findings += apply_strict(judge_pre(self.records, self.world, self.expect), self.args.strict)
        code = verdict_code(self.findings)
        self.progress("rollcall", present=len(present), world=self.world, secs=time.monotonic() - t,
                      result="FAIL" if code else "pass")
        if code:
            raise Verdict(code)
        self.proto.prepare(self.records)
        self.poll = self.proto.clone()
        self.wd.period = live_period(len(set(self.host_of.values())))
        self.master = {"host": self.host, "pid": os.getpid(), "pid_start": (proc_stat(os.getpid()) or ("", ""))[1],
                       "nodes": len(set(self.host_of.values()))}
        self.proto.open_gate("roll", json.dumps(self.master))

    def not_checked_in(self, missing, present, R):
        """The `rendezvous` FAIL of the ranks that did not check in, each with its host from the launch plan
        (Slurm's node list and tasks per node). At the last call: the ranks never heard of (no hello: not started,
        or they cannot reach the store) are named; those whose process said hello are still starting (not
        blamed). At the roll call's bound: every missing rank."""
        where = slurm_expected_hosts(self.env, self.world)
        at = f"{len(present)}/{self.world} reported at {self.addr}:{self.port}"
        lc = self.last_call
        named = [r for r in missing if lc is None or r in lc["unheard"]]
        names = ", ".join(f"{r} (expected on {where[r]})" if r in where else str(r) for r in named[:64])
        more = f" and {len(named) - 64} more" if len(named) > 64 else ""
        if lc is None:
            why = f"did not check in within {R:g}s ({at})"
        else:
            starting = [r for r in missing if r not in named]
            why = (f"did not check in: no word from its process within the last call ({lc['grace']:.0f}s after the "
                   f"latest rank arrived; {at}): not started, or it cannot reach the store at {self.addr}:{self.port}"
                   + (f"; rank(s) {format_ranges(starting)} reached the store and are still starting (not blamed)"
                      if starting else ""))
        return finding("rendezvous", "FAIL", f"rank(s) {names}{more} {why}", [where[r] for r in named if r in where],
                       named, code=EXIT_TIMEOUT, blame="process")

    def local_failures(self):
        """{rank: report} of the ranks that failed their local phase before checking in (a rank without
        torch tells rank 0 through the store's wire: tell_rank0_without_torch)."""
        return {r: e for r, e in self.proto.errors().items() if e.get("phase") == "local"}

    def wait_roll(self, end):
        """The roll call's wait, until `end`: all_arrived wakes it, every rank's record ends it (a counter
        bumped from outside wakes it early, not ends it); a stray or a rank that failed its local phase
        ends it early (a rank without torch: once every rank checked in or failed, judge_no_torch weighs
        them). The last call (LastCall): once at least half the world is present, the ranks never heard of
        (no hello) get last_call_grace past the latest news, not the whole bound (self.last_call says so).
        Each second it checks that the world record is still its own. -> (complete, strays, local failures)."""
        mine, self.last_call = self.proto.store.get("world"), None
        lc = LastCall(self.world, self.D["rollcall"], _T0)
        while True:
            complete = self.proto.wait_all(min(1.0, max(0.0, end - time.monotonic())))
            strays, now = self.proto.strays(), time.monotonic()
            held = self.proto.store.get("world")
            if held != mine:  # written over: put ours back (so the ranks can read the verdict), refuse theirs
                self.proto.store.set("world", mine)
                self.proto.refuse(Forged("world", held.decode(errors="replace").split("|")[-1],
                                         "was written over by something other than rank 0"))
            broken = self.local_failures() if self.proto.count("nerr") else {}
            if strays or hard_failures(broken) or self.proto.forged or now >= end:
                return complete and self.proto.all_in(self.world), strays, broken
            if complete and self.proto.all_in(self.world):
                return True, strays, broken
            present = self.proto.count("arrived") + len(broken)
            if broken and present >= self.world:  # every rank checked in or could not import torch
                return False, strays, broken
            if lc.seen(now, present, present + self.proto.count("hellos")).due(now):
                unseen = [r for r in self.proto.missing(self.world) if r not in broken]
                said = set(self.proto.said_hello(unseen))
                if any(r not in said for r in unseen):
                    self.last_call = {"grace": lc.grace, "unheard": [r for r in unseen if r not in said]}
                    return False, strays, broken
                lc.last = now  # every missing rank is up and reaches the store: it keeps the bound
            if complete:  # woken before every record was there
                time.sleep(FORGED_POLL_S)

    def _listen_socket(self):
        """Rank 0 binds the store's socket itself: only where MASTER_ADDR points, named errors."""
        try:
            infos = socket.getaddrinfo(self.addr, self.port, type=socket.SOCK_STREAM)
        except socket.gaierror as e:
            raise failed("rendezvous", f"MASTER_ADDR={self.addr} does not resolve on rank 0's host "
                         f"{self.host}: {e.strerror}: check MASTER_ADDR and the node's resolver") from None
        infos.sort(key=lambda i: i[0] != socket.AF_INET)
        fam, _, _, _, (ip, *_) = infos[0]
        multi_node = self.expect.get("nodes", 1) > 1  # Slurm's node count is already in the expectation
        bind_ip = ("::" if fam == socket.AF_INET6 else "0.0.0.0") if (ip.startswith("127.") or ip == "::1") \
            and multi_node else ip
        s = socket.socket(fam, socket.SOCK_STREAM)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((bind_ip, self.port))
            s.listen(min(4096, max(128, self.world)))
        except OSError as e:
            s.close()
            if e.errno == errno.EADDRINUSE:
                why = (f"address already in use on {self.host}:{self.port} (MASTER_ADDR={self.addr}, "
                       f"MASTER_PORT={self.port}): another process listens there; pick a free MASTER_PORT")
            elif e.errno == errno.EADDRNOTAVAIL:
                why = (f"MASTER_ADDR={self.addr} resolves to {ip}, which is not an address of rank 0's host "
                       f"{self.host}: MASTER_ADDR must name the node running rank 0")
            else:
                why = f"cannot listen on {bind_ip}:{self.port} on {self.host}: {e.strerror}"
            raise failed("rendezvous", why) from None  # the launch's MASTER_ADDR/MASTER_PORT: no node's fault
        return s


class Naming:
    """Rank 0's findings for a phase that did not finish (unfinished) or was interrupted (interruption),
    each judged by judge_unfinished on what rank 0 collected within its bounds. Mixed into Coordinator:
    the state it reads (host_of, records, the screen) is the rank's."""

    def unfinished(self, phase, client, cause, code=EXIT_TIMEOUT, budget=NAMING_S - 1):
        """The finding naming who did not finish `phase`, from stamps, liveness and reports; in a phase
        that issues collectives also from what each live rank issued last (asked at once, collected within
        ISSUED_S while the liveness settles) and, on NCCL, NCCL's own view beside ours (nccl_view_read)."""
        hosts, asked = sorted(set(self.host_of.values())), None
        if phase in ISSUE_PHASES:  # every live rank's listener answers on posts/issued (issued_posts)
            with contextlib.suppress(Exception):
                client.ask()
                asked = time.monotonic()
        ras = self.nccl_view_read(phase)
        try:
            live, silent, quiet = client.settled_live(hosts, budget)
            stamps, errors = client.stamps(self.world), client.errors()
        except Exception as e:
            f = finding(PHASE_CHECK[phase], "FAIL", f"{cause}; the store could not be read to name the ranks: "
                        f"{first_line(e)}; no host is named", code=EXIT_TIMEOUT)
            f["blame"], f["unlocalised"] = "not-collected", {"why": "rank 0's store could not be read",
                                                                "localise": "a re-run"}
            return f
        live.update(self.own_node_live())
        silent, quiet = unreachable_hosts(silent, quiet, self.host, self.host_of, errors)
        issued = None
        if asked is not None:
            with contextlib.suppress(Exception):  # not collected: the finding says so
                issued = self.issued_posts(client, asked, live, silent)
        self.gone = {r for r, st in live.items() if st in ("gone", "stopped")}
        if phase == "soak":  # a rank that posted its soak (or waits at the soak's start gate) finished its part
            with contextlib.suppress(Exception):
                stamps = finished_by(stamps, self.round_posted(client, "soak"), phase)
        if phase in FAN_IN:  # a rank that posted its telemetry or results finished its part: it waits for rank 0
            with contextlib.suppress(Exception):
                stamps = finished_by(stamps, client.posts(FAN_IN[phase]), phase)
        f = None
        if phase in SCREEN_PHASES and self.screen is not None:
            with contextlib.suppress(Exception):
                f, stamps = self.screen_unfinished(phase, client, cause, live, errors, silent, stamps, issued)
        if f is None:
            f = judge_unfinished(phase, cause, self.world, self.host_of, stamps, live, errors, code, silent, issued,
                                 self.fabric_hint())
        if quiet:
            f["reason"] += "; " + quiet_monitor_note(quiet, budget)
        if ras is not None:
            self.nccl_view_add(f, ras, live, silent, issued)
        return f

    def issued_posts(self, client, asked, live, silent):
        """{rank: its answer or None} once every live rank answered, at most ISSUED_S after the question; rank 0's
        own record read here."""
        expect = {r for r, h in self.host_of.items() if r and live.get(r, "running") == "running" and h not in silent}
        while True:  # the counter is read every 50 ms (one small operation), the posts once it says enough
            late = time.monotonic() >= asked + ISSUED_S
            if late or client.count("posts/issued/n") >= len(expect):
                posts = client.posts("issued")
                if late or expect <= set(posts):
                    break
            time.sleep(0.05)
        return {r: posts.get(r) for r in range(self.world)} | {0: self.issued.record(self.torch, self.nccl.diag())}

    def nccl_view_read(self, phase):
        """On NCCL, in a phase that issues collectives: NCCL's RAS STATUS read on a thread of its own (its node's
        RAS answers for the whole job), within NCCL_RAS_S. -> (thread, box) or None."""
        if self.backend != "nccl" or phase not in ISSUE_PHASES:
            return None
        box = {}
        th = threading.Thread(target=lambda: box.update(ras=ras_status(*ras_addr(self.env), NCCL_RAS_S)),
                              name="aiv-ras", daemon=True)
        th.start()
        return th, box

    def nccl_view_add(self, f, ras, live, silent, issued=None):
        """NCCL's view beside ours in the finding: its words in the reason, its data under 'nccl_view' (with the
        NCCL DIAG lines the ranks' answers carried)."""
        th, box = ras
        th.join(NCCL_RAS_S + 0.5)
        got = box.get("ras") or {"ok": False, "why": f"no answer within {NCCL_RAS_S:g}s"}
        states = (f.get("issued") or {}).get("states") or {}
        kinds = {r: "dead" if live.get(r) == "gone" else "frozen" if live.get(r) == "stopped" else
                 "silent" if h in silent else "behind" if states.get(str(r)) == "behind" else "ok"
                 for r, h in self.host_of.items()}
        try:  # NCCL's view is said beside ours; it never changes the culprits or the exit code
            view = nccl_view(got, self.world, self.host_of, kinds, f.get("ranks") or [])
        except Exception as e:
            why = f"its reply could not be read ({type(e).__name__}: {first_line(e)})"
            view = {"read": False, "why": why, "agree": None, "ranks": {},
                    "words": f"NCCL's own view (RAS) not read: {why}"}
        diag = [ln for p in (issued or {}).values() if p for ln in p.get("diag") or []]
        if diag:
            view["diag"] = diag[:20]
            view["words"] += f"; NCCL DIAG ({len(diag)} line(s)): {diag[0]}"
        f["reason"] += "; " + view["words"]
        f["nccl_view"] = view

    def fabric_hint(self):
        """What would localise a collective that every rank issued and none finished, in this run's words."""
        rerun = "a re-run with NCCL_DEBUG=INFO (NCCL's WARN lines name the peer whose connection failed)"
        if (self.screen or {}).get("pairs"):
            return ("the screen's pair results (inter-node rows above: every pair of nodes measured before this "
                    f"phase), or {rerun}")
        if self.args.skip_screen:
            return f"the network screen (a run without --skip-screen measures every pair of nodes), or {rerun}"
        return None

    def own_node_live(self):
        """Rank 0's own node: its ranks' processes read here, from /proc (rank 0 shares the host; its
        node's monitor is not needed to see them, and a slow one is never news about the node)."""
        return {rec["rank"]: liveness(proc_stat(rec["pid"]), ("", rec["pid_start"])) for rec in self.records
                if rec.get("host") == self.host and rec.get("pid") and rec.get("pid_start")}

    def interruption(self, phase, name, client):
        """Rank 0's finding for a signal during `phase`: liveness as it was when the signal came (the ranks
        it stops are not yet gone), then, TERM_REPORTS_S later, the others' reports."""
        why = (f"{PHASE_WHAT[phase]} was interrupted by {name} (scancel, the time limit, preemption, the launcher "
               "or Ctrl-C)")
        nobody = finding("interrupted", "FAIL", f"rank 0 ({self.host}): {why}; {STOPPED_WORDS}", code=EXIT_INTERRUPTED)
        if self.poll is None or client is None:  # before the roll call ended: nobody to name
            return nobody
        hosts = sorted(set(self.host_of.values()))
        snap = bounded(lambda: client.live(hosts), SNAPSHOT_S, {})
        live = {int(r): st for snap_h in snap.values() for r, st in (snap_h.get("ranks") or {}).items()}
        # this node's ranks read directly: a worker that died just before the launcher's SIGTERM (torchrun
        # stops the others at once) is gone here, even when the monitor has not posted it yet
        live.update(self.own_node_live())
        time.sleep(TERM_REPORTS_S)
        seen = bounded(lambda: (client.stamps(self.world), client.errors()), SNAPSHOT_S)
        if seen is None:
            return nobody
        stamps, errors = seen
        errors[0] = {"line": f"rank 0 ({self.host}): {name}", "term": True, "internal": False}
        # the signalled ranks will not acknowledge: the job's KillWait (often 30 s) must not pass on the acks
        self.gone |= {r for r, e in errors.items() if e.get("term")} | {r for r, st in live.items() if st != "running"}
        return judge_unfinished(phase, why, self.world, self.host_of, stamps, live, errors)


class Coordinator(RollCall, Naming, ScreenCoordinator, RankRun):
    """Rank 0: the roll call (RollCall), the judges of each phase, the naming (Naming), the verdict. conclude() is
    the one way out, from whichever thread gets there first (the main thread, the watchdog, the signal thread)."""

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
        self.screen_wait("soak")
        cpu = self._kind() == "cpu"
        rows = soak_rows(self.records, self.proto.screen_posts("soak"), cpu)
        with self.state_lock:
            self.soak = {"seconds": self.args.soak, "cpu": cpu, "dtype": row.get("dtype"),
                         "n": SCREEN_MATMUL_N[self._kind()], "gpus": rows}
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
        gathered = self.results = self.fan_in("results")
        with self.state_lock:
            self.collectives = {"ar_sum": gathered[0]["ar_sum"], "ar_expected": self.world * (self.world + 1) // 2,
                                "ranks": self.world, "loss": loss_sum / self.world,
                                "grads_identical": len({res["grads"] for res in gathered}) == 1}

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
                return bool(self.poll.forgeries()), dead, bool(self.poll.count("nerr") and self.poll.errors())
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
