"""Floor 5 (runtime): rank 0 naming who did not finish a phase (Naming, mixed into Coordinator): the stamps, the
node monitors' liveness, the error reports, what each live rank issued last, NCCL's own view beside ours; and who
was already dead or frozen when a signal came (interruption)."""
import contextlib
import threading
import time

from ..checks.hang import nccl_view
from ..checks.judge import STOPPED_WORDS, judge_unfinished, quiet_monitor_note, unreachable_hosts
from ..core.base import EXIT_INTERRUPTED, EXIT_TIMEOUT, finding, first_line
from ..core.bounds import bounded
from ..core.deadlines import (
    FAN_IN,
    ISSUE_PHASES,
    ISSUED_S,
    NAMING_S,
    NCCL_RAS_S,
    PHASE_CHECK,
    PHASE_WHAT,
    PHASES,
    SCREEN_PHASES,
    SNAPSHOT_S,
    TERM_REPORTS_S,
)
from .liveness import liveness, proc_stat
from .ras import ras_addr, ras_status


class Naming:
    """Rank 0's findings for a phase that did not finish (unfinished) or was interrupted (interruption),
    each judged by judge_unfinished on what rank 0 collected within its bounds. Mixed into Coordinator:
    the state it reads (host_of, records, the screen) is the rank's."""

    def unfinished(self, phase, client, cause, code=EXIT_TIMEOUT, budget=NAMING_S - 1):
        """Rank 0: the finding naming who did not finish `phase`, from stamps, liveness and reports; in a phase
        that issues collectives also from what each live rank issued last (asked at once, collected within
        ISSUED_S while the liveness settles) and, on NCCL, NCCL's own view beside ours (nccl_view_read)."""
        hosts = sorted(set(self.host_of.values()))
        asked = self.ask_issued(client, phase)
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
        f = self._unfinished(phase, client, cause, code, live, silent, stamps, errors, issued)
        if quiet:
            f["reason"] += "; " + quiet_monitor_note(quiet, budget)
        if ras is not None:
            self.nccl_view_add(f, ras, live, silent, issued)
        return f

    def ask_issued(self, client, phase):
        """In a phase that issues collectives: ask every live rank what it issued last (their listeners answer
        on posts/issued). -> when it asked, or None."""
        if phase not in ISSUE_PHASES:
            return None
        try:
            client.ask()
        except Exception:
            return None
        return time.monotonic()

    def issued_posts(self, client, asked, live, silent):
        """{rank: its answer or None} once every live rank answered, at most ISSUED_S after the question; rank 0's
        own record read here."""
        expect = {r for r, h in self.host_of.items() if r and live.get(r, "running") == "running" and h not in silent}
        while True:  # the counter is read every 50 ms (one small operation), the posts once it says enough
            late = time.monotonic() >= asked + ISSUED_S
            if late or client.post_count("issued") >= len(expect):
                posts = client.posts("issued")
                if late or expect <= set(posts):
                    break
            time.sleep(0.05)
        out = {r: posts.get(r) for r in range(self.world)}
        out[0] = self.issued.record(self.torch, self.nccl.diag())
        return out

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
        if (self.screen or {}).get("pairs"):
            return ("the screen's pair results (inter-node rows above: every pair of nodes measured before this "
                    "phase), or a re-run with NCCL_DEBUG=INFO (NCCL's WARN lines name the peer whose connection "
                    "failed)")
        if self.args.skip_screen:
            return ("the network screen (a run without --skip-screen measures every pair of nodes), or a re-run with "
                    "NCCL_DEBUG=INFO (NCCL's WARN lines name the peer whose connection failed)")
        return None

    def own_node_live(self):
        """Rank 0's own node: its ranks' processes read here, from /proc (rank 0 shares the host; its
        node's monitor is not needed to see them, and a slow one is never news about the node)."""
        return {rec["rank"]: liveness(proc_stat(rec["pid"]), ("", rec["pid_start"])) for rec in self.records
                if rec.get("host") == self.host and rec.get("pid") and rec.get("pid_start")}

    def _unfinished(self, phase, client, cause, code, live, silent, stamps, errors, issued=None):
        self.gone = {r for r, st in live.items() if st in ("gone", "stopped")}
        if phase == "soak":  # a rank that posted its soak (or waits at the soak's start gate) finished its part
            with contextlib.suppress(Exception):
                done, idx = self.round_posted(client, "soak"), PHASES.index(phase)
                stamps = {r: max(s, idx) if r in done else s for r, s in stamps.items()}
        if phase in FAN_IN:  # a rank that posted its telemetry or results finished its part: it waits for rank 0
            with contextlib.suppress(Exception):
                done, idx = set(client.posts(FAN_IN[phase])), PHASES.index(phase)
                stamps = {r: max(s, idx) if r in done else s for r, s in stamps.items()}
        if phase in SCREEN_PHASES and self.screen is not None:
            try:
                f, stamps = self.screen_unfinished(phase, client, cause, live, errors, silent, stamps, issued)
            except Exception:
                f = None
            if f is not None:
                return f
        return judge_unfinished(phase, cause, self.world, self.host_of, stamps, live, errors, code, silent, issued,
                                self.fabric_hint())

    def interruption(self, phase, name, client):
        """Rank 0's finding for a signal during `phase`: liveness as it was when the signal came (the ranks
        it stops are not yet gone), then, TERM_REPORTS_S later, the others' reports."""
        why = (f"{PHASE_WHAT[phase]} was interrupted by {name} (scancel, the time limit, preemption, the launcher "
               "or Ctrl-C)")
        if self.poll is None or client is None:  # before the roll call ended: nobody to name
            return finding("interrupted", "FAIL", f"rank 0 ({self.host}): {why}; {STOPPED_WORDS}",
                           code=EXIT_INTERRUPTED)
        hosts = sorted(set(self.host_of.values()))
        snap = bounded(lambda: client.live(hosts), SNAPSHOT_S, {})
        live = {int(r): st for snap_h in snap.values() for r, st in (snap_h.get("ranks") or {}).items()}
        # this node's ranks read directly: a worker that died just before the launcher's SIGTERM (torchrun
        # stops the others at once) is gone here, even when the monitor has not posted it yet
        live.update({rec["rank"]: liveness(proc_stat(rec["pid"]), ("", rec.get("pid_start") or ""))
                     for rec in self.records if rec.get("host") == self.host and rec.get("pid_start")})
        time.sleep(TERM_REPORTS_S)
        seen = bounded(lambda: (client.stamps(self.world), client.errors()), SNAPSHOT_S)
        if seen is None:
            return finding("interrupted", "FAIL", f"rank 0 ({self.host}): {why}; {STOPPED_WORDS}",
                           code=EXIT_INTERRUPTED)
        stamps, errors = seen
        errors[0] = {"line": f"rank 0 ({self.host}): {name}", "term": True, "internal": False}
        # the signalled ranks will not acknowledge: the job's KillWait (often 30 s) must not pass on the acks
        self.gone |= {r for r, e in errors.items() if e.get("term")} | {r for r, st in live.items() if st != "running"}
        return judge_unfinished(phase, why, self.world, self.host_of, stamps, live, errors)
