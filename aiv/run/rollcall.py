"""Floor 5 (runtime): rank 0's roll call (RollCall, mixed into Coordinator): the store served on a socket rank 0
bound itself, every rank's check-in waited for (the last call), what the roll call shows judged, the gate opened."""
import errno
import json
import os
import socket
import time

from ..checks.judge import apply_strict, judge_no_torch, judge_pre, judge_strays, rank_record
from ..core.base import (
    _T0,
    EXIT_FAIL,
    EXIT_INTERNAL,
    EXIT_TIMEOUT,
    EXIT_USAGE,
    Verdict,
    failed,
    finding,
    format_ranges,
    verdict_code,
)
from ..core.deadlines import ERROR_GRACE, FORGED_POLL_S, LastCall, live_period
from ..launch.contract import slurm_expected_hosts
from .liveness import proc_stat
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
            broken = self.local_failures() if self.proto.error_count() else {}
            if strays or hard_failures(broken) or self.proto.forged or now >= end:
                return complete and self.proto.all_in(self.world), strays, broken
            if complete and self.proto.all_in(self.world):
                return True, strays, broken
            present = self.proto.arrived_count() + len(broken)
            if broken and present >= self.world:  # every rank checked in or could not import torch
                return False, strays, broken
            if lc.seen(now, present, present + self.proto.hello_count()).due(now):
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
        fam, _, _, _, sa = infos[0]
        ip = sa[0]
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
