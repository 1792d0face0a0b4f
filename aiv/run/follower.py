"""Floor 5 (runtime): every other rank: reports its own error, takes rank 0's verdict, speaks for a
rank 0 that gives none in time."""
import contextlib
import json
import os
import threading
import time

from ..checks.judge import judge_forged
from ..core.base import (
    CLUSTER_ERRORS,
    EXIT_FAIL,
    EXIT_INTERNAL,
    EXIT_INTERRUPTED,
    EXIT_TIMEOUT,
    Verdict,
    first_line,
    internal_finding,
    is_tool_error,
    print_traceback,
)
from ..core.bounds import Bound, bounded, within
from ..core.deadlines import (
    ACKS_SIGNALLED_S,
    NAMING_S,
    PHASE_CHECK,
    RANK0_GRACE,
    SIGNAL_SPREAD_S,
    STORE_OP_S,
    VERDICT_S,
    worst_case,
)
from ..launch.contract import launcher_store
from ..out.outputs import fallback_verdict, rank0_lost
from ..out.render import NO_HOST_MARK, failure_lines
from ..screen.run import ScreenFollower
from .conclusion import write_json_within
from .liveness import liveness, proc_stat, tell_rank0_without_torch
from .rank import RankRun
from .store import store_timed_out


class Follower(ScreenFollower, RankRun):
    """Every rank but 0: enters each phase at rank 0's gate, reports its own error, and exits with rank
    0's verdict, read from the store by a listener thread even while the main thread is blocked in a
    collective. When rank 0 gives none in time, it speaks for rank 0, once per node."""

    def __init__(self, args, contract, env):
        self.verdict_seen = None  # rank 0's exit code, once read
        self.ack_lock, self.acked = threading.Lock(), False
        self.speak_lock = threading.Lock()  # speak_for_rank0: one thread speaks and writes the JSON
        super().__init__(args, contract, env)

    # ---------------------------------------------------------------- flow
    def end(self, v):
        """Report (done by phase_error), then take rank 0's verdict; before the roll call, tell rank 0 why (through
        the store's wire: tell_rank0) and speak for the node."""
        if self.proto is None:
            self.tell_rank0(v)
        if self.proto is not None:  # rank 0 names the culprit within the phase's bound: wait that long again
            try:
                with Bound(self.wd, self.phase, self.D[self.phase], RANK0_GRACE) as b:
                    self.exit(self.verdict_within(self.proto, b.left(RANK0_GRACE)))
            except Exception as e:  # the tool's own error while taking the verdict: `internal`, no host blamed
                print_traceback(e)
                f = internal_finding(e, f"rank {self.rank} on {self.host}, taking the verdict")
                v = Verdict(EXIT_INTERNAL, [f])
        self.speak_for_node("\n".join(failure_lines(v.findings))
                            or f"FAILURE: internal: rank {self.rank} {NO_HOST_MARK}")
        self.exit(v.code)

    def tell_rank0(self, v):
        """This rank failed before it checked in (torch missing or too old, a local check, the tool's own error):
        rank 0 hears why at once, through the store's own wire (no torch needed), within what is left of the
        phase's bound, and ends the roll call in seconds instead of at its bound. An interruption says nothing:
        rank 0 takes its own signal."""
        if v.code == EXIT_INTERRUPTED or not v.findings or self.phase != "local":  # the store unreachable: no tell
            return
        f = v.findings[0]
        line = f["reason"] if f["reason"].startswith(f"rank {self.rank} ") else f"rank {self.rank} ({self.host}): " \
            f"{f['check']}: {f['reason']}"
        tell_rank0_without_torch(self.addr, self.port, launcher_store(self.env)[0], self.rank, self.host, line,
                                 self.bound.left() if getattr(self, "bound", None) else 0.0, v.code,
                                 internal=v.code == EXIT_INTERNAL)

    def grace(self, phase):
        """The other ranks give rank 0 RANK0_GRACE past each bound to name the culprit first."""
        return RANK0_GRACE if phase != "local" else 0.0

    def enter_phase(self, bound):
        """Wait for rank 0's gate, bounded as the phase itself (rank 0 opens it, or gives a verdict, within
        the previous phase's bound + NAMING_S of the previous gate); the bound then counts from the gate."""
        self.proto.wait_gate("phase/" + bound.phase, bound.left(bound.grace + NAMING_S))  # the watchdog speaks first
        bound.restart()

    # ---------------------------------------------------------------- phases
    def before_check_in(self, R):
        self.bound.restart()  # counted from rank 0's store's first answer: rank 0 may start late

    def after_check_in(self, R):
        self.helper("aiv-listener", self.listen)
        self.master = json.loads(self.proto.wait_gate("roll", self.bound.left(RANK0_GRACE)))

    def phase_final(self):
        """Rank 0 judges; this rank waits for its verdict."""
        self.exit(self.verdict_within(self.proto, self.bound.left(RANK0_GRACE)))

    # ---------------------------------------------------------------- rank 0's verdict
    def listen(self):
        """Non-zero ranks: on a connection of our own, wait for rank 0's question or its verdict (`ask`). Asked
        (a phase did not finish), post what this rank issued last (answer); then exit with the verdict."""
        client = self.proto.clone()
        end = time.monotonic() + worst_case(self.D, True, soak=bool(self.args.soak)) + RANK0_GRACE
        with contextlib.suppress(*CLUSTER_ERRORS):  # a store that went away or timed out: the verdict's wait says so
            if client.wait_ask(end - time.monotonic()) == "ask":
                self.answer(client)
        self.exit(self.verdict_within(client, max(0.001, end - time.monotonic())))

    def answer(self, client):
        """This rank's answer to rank 0's question: the last collective it issued on each of its groups (torch's
        flight recorder and its own record), whether its main thread is inside one, NCCL's DIAG lines. The
        tool's own error here is said (a WARN) and the listener goes on to the verdict: no answer is no
        evidence, never a rank that cannot exit."""
        try:
            client.post("issued", self.rank, self.issued.record(getattr(self, "torch", None), self.nccl.diag()))
        except Exception as e:
            if not is_tool_error(e):
                raise
            self.helper_died("the answer to rank 0's question", e)

    def verdict_within(self, client, seconds):
        """Rank 0's code from the store within `seconds`. A store that is gone or silent is rank 0's news
        (lost_rank0); the tool's own error is raised as it is (`internal`, no host blamed)."""
        try:
            return self.take_verdict(client, seconds)
        except CLUSTER_ERRORS as e:
            code = self.verdict_of_deciding(client) if store_timed_out(e) else None
            if code is not None:
                return code
            self.lost_rank0(e)

    def verdict_of_deciding(self, client=None):
        """Rank 0 posted `deciding` (its verdict started; the files asked for come before its code, and shared
        storage can be slow): -> its code, waited for up to VERDICT_S (the verdict's own bound, within which
        rank 0 publishes it) instead of RANK0_GRACE; None when there is no mark, or no code came."""
        if self.proto is None or self.master is None:
            return None
        try:
            client = client or within(self.proto.clone, STORE_OP_S, "a store connection")
            if not within(client.deciding, STORE_OP_S, "reading rank 0's deciding mark"):
                return None
            return self.take_verdict(client, VERDICT_S)
        except CLUSTER_ERRORS:
            return None

    def take_verdict(self, client, seconds):
        code = client.wait_verdict(seconds)
        self.verdict_seen = code
        with self.ack_lock:
            if not self.acked:
                self.acked = True
                with contextlib.suppress(Exception):  # rank 0 stopped waiting for acks: the code is what matters
                    client.ack(self.rank)
        return code

    def lost_rank0(self, exc):
        """Rank 0's store went away. After its verdict: nothing is lost. Before it: speak for rank 0,
        unless this rank is signalled within SIGNAL_SPREAD_S: then the job was stopped from outside
        (scancel, the time limit: rank 0 took the signal first and gave the `interrupted` verdict, its
        store going with it) and the signal's own path ends this rank, blaming nobody."""
        if self.verdict_seen is not None:  # rank 0 gave its verdict, then its store went away: nothing lost
            self.exit(self.verdict_seen)
        if self.came_within(lambda: self.signal_seen is not None, SIGNAL_SPREAD_S):
            time.sleep(STORE_OP_S + ACKS_SIGNALLED_S + 1)  # signalled() ends the process within this
            self.exit(128 + self.signal_seen)
        host0, (state, kind) = (self.master or {}).get("host", self.addr), self.rank0_seen("link")
        self.exit(self.speak_for_rank0(f"FAILURE: rendezvous: rank {self.rank} ({self.host}) lost rank 0 ({host0}) "
                                       f"during {self.phase}: its store at {self.addr}:{self.port} is gone "
                                       f"({first_line(exc)}){state}", kind))

    def expire(self, phase):
        """Speak for this rank (before the roll call) or for rank 0, which gave no verdict in time."""
        cause = self.expiry_cause(phase)
        if self.master is None and not (self.proto is not None and self.proto.forged):
            self.speak_for_node(f"FAILURE: {PHASE_CHECK[phase]}: rank {self.rank} ({self.host}): {cause}")
            self.exit(EXIT_TIMEOUT)
        code = self.verdict_of_deciding()  # rank 0 alive and deciding: its code, within the verdict's bound
        if code is not None:
            self.exit(code)
        host0, (state, kind) = (self.master or {}).get("host", self.addr), self.rank0_seen("stuck")
        self.exit(self.speak_for_rank0(f"FAILURE: rendezvous: rank {self.rank} ({self.host}) got no verdict from "
                                       f"rank 0 ({host0}) within {self.D[phase] + RANK0_GRACE:g}s of {phase}: rank 0 "
                                       f"is frozen, hung or unreachable{state}", kind))

    def signalled(self, signum, name, phase):
        """Post that this rank was terminated (so that rank 0 does not take it for dead), exit 128 + signal.
        When rank 0's process on this node is gone and no verdict came (torchrun stops the other workers
        once one died: rank 0 killed leaves nobody to speak), speak for rank 0 and leave the JSON."""
        if self.rank0_died():
            host0 = (self.master or {}).get("host", self.addr)
            self.exit(self.speak_for_rank0(f"FAILURE: rendezvous: rank 0 ({host0}) died during {phase} before its "
                                           f"verdict (its process is gone); {name} then stopped rank {self.rank} "
                                           f"({self.host})", "process"))
        if self.proto is not None:
            line = f"rank {self.rank} ({self.host}): terminated by {name} during {phase}"
            bounded(lambda: self.proto.clone().report_error(self.rank, phase, line, EXIT_INTERRUPTED, term=True),
                    STORE_OP_S)
        self.exit(128 + signum)

    def speak_for_rank0(self, line, kind):
        """Rank 0 gave no verdict: say so once per node, and leave a FAIL JSON where rank 0 left none (the batch
        file ends the step once a verdict JSON exists). line: `FAILURE: rendezvous: ...`; kind: the evidence it
        stands on (`link`: the store connection broke; `stuck`: no verdict in time; `process`: rank 0's process
        seen gone on this node): the one fallback writer (fallback_verdict) gates it, so only `process` names
        rank 0's host. A rank that refused a forged value names that instead, and nobody (judge_forged). The
        listener and the main thread can both get here: the second waits (for ever: the first exits) until
        the first has written the JSON. -> the exit code."""
        self.speak_lock.acquire()
        host0, code = (self.master or {}).get("host", self.addr), EXIT_TIMEOUT
        found = [rank0_lost(line.split(": ", 2)[-1], host0, kind, code)]
        if self.proto is not None and self.proto.forged:
            found, code = judge_forged(self.proto.forged, f"{self.addr}:{self.port}"), EXIT_FAIL
        state = fallback_verdict(found, code, self.world, f"rank {self.rank} ({self.host})",
                                 set(self.host_of.values()) if getattr(self, "host_of", None) else ())
        if not self.speak_for_node("\n".join(state["failures"])) or not self.args.json \
                or os.path.exists(self.args.json):
            return code
        write_json_within(self.args.json, state, first=True)
        return code

    @staticmethod
    def came_within(seen, seconds):
        """Whether seen() is true within `seconds` (looked at every 50 ms)."""
        end = time.monotonic() + seconds
        while not seen() and time.monotonic() < end:
            time.sleep(0.05)
        return seen()

    def rank0_died(self):
        """Whether rank 0 runs on this node and its process is gone with no verdict read within
        ACKS_SIGNALLED_S (a rank 0 that gave its verdict publishes it before it exits)."""
        m = self.master or {}
        if m.get("host") != self.host or not m.get("pid") or self.verdict_seen is not None:
            return False
        stat = proc_stat(m["pid"])
        first = ("", m["pid_start"]) if m.get("pid_start") else stat
        if stat is not None and liveness(stat, first) != "gone":
            return False
        return not self.came_within(lambda: self.verdict_seen is not None, ACKS_SIGNALLED_S)

    def rank0_liveness(self):
        """Rank 0's process state where it runs on this node (running, stopped, gone), else None."""
        m = self.master or {}
        if m.get("host") != self.host or not m.get("pid"):
            return None
        return liveness(proc_stat(m["pid"]), proc_stat(m["pid"]) or ("", ""))

    def rank0_seen(self, otherwise):
        """Rank 0's process as this node sees it: (its state, for the end of a line; what a rank that got no verdict
        stands on: `process` where it is stopped or gone, which names rank 0's host, else `otherwise`, `link` or
        `stuck`: nobody)."""
        st = self.rank0_liveness()
        return (f" (rank 0's process on this node is {st})" if st else "",
                "process" if st in ("stopped", "gone") else otherwise)
