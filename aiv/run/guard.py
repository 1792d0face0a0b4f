"""Floor 5 (runtime): what guards every rank's phases (RankGuard, mixed into RankRun): each phase under its
bound, what an error in it becomes, the watchdog's expiry, the signals, helper threads, failpoints and the one
way out (exit); a line said once per node (speak_once_per_node)."""
import contextlib
import fcntl
import os
import re
import signal
import socket
import sys
import threading
import time

from ..core.base import (
    _T0,
    EXIT_FAIL,
    EXIT_INTERNAL,
    EXIT_PASS,
    EXIT_TIMEOUT,
    Verdict,
    failed,
    first_line,
    internal_finding,
    is_tool_error,
    print_traceback,
    where_raised,
)
from ..core.bounds import Bound
from ..core.deadlines import MARK_TTL, PHASE_CHECK, PHASE_WHAT, PHASES, PROBE_CONNECT_S
from ..core.speak import emit, flush_all
from .liveness import launch_key, said_marker, sweep_said


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
    with contextlib.suppress(OSError, ValueError):  # no node-local coordination here: better a line twice than never
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
    emit(text)
    return True


class RankGuard:
    """The plumbing around every phase of RankRun: deadline(phase) arms its Bound and turns an error inside
    into a Verdict; on_expire and on_signal hand a bound passed or a signal to the role (expire,
    signalled); exit() is every rank's way out. Mixed into RankRun: the state it uses (the bound, the
    watchdog, the store, the deadlines) is the rank's. The hooks with a default here: own_error,
    expire_failed; grace (what the role adds to a phase's bound before its watchdog speaks) and enter_phase (the
    start of each phase after the roll call: Coordinator opens its gate, Follower waits for it) are each role's."""

    # ---------------------------------------------------------------- each phase under its bound
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

    def phase_error(self, phase, exc):
        """An error inside a phase. The tool's own (is_tool_error): the `internal` verdict, no host. A torch
        error: posted on the store, then the role's own_error."""
        if is_tool_error(exc):
            return self.internal_error(phase, exc)
        line = f"rank {self.rank} ({self.host}): {PHASE_WHAT[phase]} failed: {first_line(exc)}"
        code = EXIT_TIMEOUT if re.search(r"[Tt]imed? ?out|timeout", str(exc)) else EXIT_FAIL
        if self.proto is not None:
            with contextlib.suppress(Exception):
                self.proto.report_error(self.rank, phase, line, code)
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
        return Bound(None, phase, self.D[phase]).cause()

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
