"""Floor 1: the bounds that enforce the table of aiv/core/deadlines.py: Bound (one phase's bound, the
only thing that arms the watchdog), the watchdog, and within() / bounded() for a call that can block."""
import heapq
import itertools
import threading
import time

from .deadlines import PHASE_WHAT


class BoundPassed(TimeoutError):
    """A call run under a bound (within) did not return in time."""


def within(fn, seconds, what="the call"):
    """fn() on a thread of its own, at most `seconds`: its result, or its own exception raised again here,
    or BoundPassed. The thread is left behind when the bound passes (daemon: the process exits on its
    verdict). For a call that can block without a timeout of its own: a file on shared storage, a
    store operation off the main thread."""
    box, done = {}, threading.Event()

    def call():
        try:
            box["value"] = fn()
        except BaseException as e:
            box["error"] = e
        finally:
            done.set()
    threading.Thread(target=call, name="aiv-within", daemon=True).start()
    if not done.wait(max(0.0, seconds)):
        raise BoundPassed(f"{what} did not return within {seconds:g}s")
    if "error" in box:
        raise box["error"]
    return box.get("value")


def bounded(fn, seconds, default=None):
    """within(fn, seconds), or `default` when it raises or takes longer: for a best-effort read whose
    absence the caller names itself (a snapshot at a signal, an audit, a count)."""
    try:
        return within(fn, seconds)
    except Exception:
        return default


class Bound:
    """One phase's bound: the only thing that arms the watchdog. Made by RankRun.deadline for each
    phase: `seconds` is the table's value for the phase (what every message quotes), `grace` what the
    role adds before the watchdog speaks (rank 0: NAMING_S at the roll call; the other ranks:
    RANK0_GRACE, so that rank 0 names the culprit first). Every wait inside the phase takes left().
    A rank other than 0 counts its bound from rank 0's gate (restart), however late rank 0 got there.
    Each bound is a timer of its own on the watchdog (its token): arming or disarming one never touches
    another (the verdict's bound, armed while a phase's is still armed, holds whatever the phase does)."""

    def __init__(self, watchdog, phase, seconds, grace=0.0):
        self.wd, self.phase, self.seconds, self.grace = watchdog, phase, float(seconds), float(grace)
        self.start = time.monotonic()
        self.armed, self.token = False, None

    def left(self, extra=0.0):
        """Seconds left of the phase's own bound (+ extra), never negative."""
        return max(0.0, self.start + self.seconds + extra - time.monotonic())

    def cause(self):
        """The words for a phase that did not finish within its bound."""
        return f"{PHASE_WHAT.get(self.phase, self.phase)} did not complete within {self.seconds:g}s"

    def arm(self):
        self.armed = True
        self.token = self.wd.arm(self.phase, self.left(self.grace), self.token)
        return self

    def restart(self):
        """Count the bound from now (a gate rank 0 opened, the store's first answer), still armed."""
        self.start = time.monotonic()
        if self.armed:
            self.arm()

    def disarm(self):
        if self.armed:
            self.armed = False
            self.wd.disarm(self.token)

    def __enter__(self):
        return self.arm()

    def __exit__(self, *exc):
        self.disarm()
        return False


class Watchdog:
    """Every armed bound from a thread of its own: a heap of deadlines, one timer per bound (arm returns its
    token). A bound that passes calls expire(name) once, on a thread of its own (expire usually ends the
    process with os._exit, which works while the main thread is blocked in a collective: a signal handler
    would run only after the collective returned). While a phase's bound is armed (the newest bound that is
    not the verdict's), tick(phase) runs every `period` seconds on this thread; a tick that raises is switched
    off and said (on_error)."""

    def __init__(self, expire, tick=None, period=1.0, on_error=None):
        self.expire, self.tick, self.period, self.on_error = expire, tick, period, on_error
        self._cv = threading.Condition()
        self._heap, self._live, self._tokens = [], {}, itertools.count(1)  # live: token -> (name, deadline)
        threading.Thread(target=self._loop, name="aiv-watchdog", daemon=True).start()

    def arm(self, name, seconds, token=None):
        """Arm (or, with the token of an armed bound, re-arm) a bound of `seconds` from now. -> its token."""
        with self._cv:
            token = token or next(self._tokens)
            due = time.monotonic() + max(0.0, seconds)
            self._live[token] = (name, due)
            heapq.heappush(self._heap, (due, token))
            self._cv.notify()
            return token

    def disarm(self, token=None):
        """Disarm one bound (its token); without a token, every bound."""
        with self._cv:
            if token is None:
                self._live.clear()
            else:
                self._live.pop(token, None)
            self._cv.notify()

    def armed(self):
        """The names of the bounds armed now, oldest first."""
        with self._cv:
            return [name for _, (name, _) in sorted(self._live.items())]

    def _next(self):
        """(the earliest live (deadline, token) or None, the phase to tick or None), under the lock."""
        while self._heap and self._live.get(self._heap[0][1], (None, None))[1] != self._heap[0][0]:
            heapq.heappop(self._heap)  # disarmed, or re-armed with another deadline
        phases = [name for _, (name, _) in sorted(self._live.items()) if name != "verdict"]
        return (self._heap[0] if self._heap else None), (phases[-1] if phases else None)

    def _loop(self):
        next_tick = time.monotonic() + self.period
        while True:
            with self._cv:
                head, phase = self._next()
                while head is None:
                    self._cv.wait()
                    head, phase = self._next()
                    next_tick = time.monotonic() + self.period
                now = time.monotonic()
                ticking = phase is not None and self.tick is not None
                if head[0] > now and (not ticking or next_tick > now):
                    self._cv.wait(max(0.0, (min(head[0], next_tick) if ticking else head[0]) - now))
                    continue  # something may have been armed or disarmed meanwhile: look again
                fire = None
                if head[0] <= now:  # once per arming
                    heapq.heappop(self._heap)
                    fire = self._live.pop(head[1])[0]
            if fire is not None:  # on a thread of its own: a bound armed while expire runs (the verdict's) still holds
                threading.Thread(target=self.expire, args=(fire,), name="aiv-expire", daemon=True).start()
                continue
            next_tick = time.monotonic() + self.period
            if self.tick is not None and phase is not None:
                try:
                    self.tick(phase)
                except Exception as e:  # the bound still holds; the tick is off, and the report says so
                    self.tick = None
                    if self.on_error is not None:
                        self.on_error("the watchdog's liveness tick", e)
