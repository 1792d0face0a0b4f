"""Floor 6: the node gate's lock (NodeLock, mixed into NodeCheck): one pass touches the GPUs at a time; a job's
prolog or epilog stops a health or npd pass that holds it, and goes on without it when it cannot take it."""
import contextlib
import fcntl
import os
import signal
import time

from ..core.base import read_text
from ..core.deadlines import NODE_PREEMPT_S
from ..core.files import node_lock_path
from .judge import unassessed


class NodeLock:
    """take_lock and what it needs: the lock file in a root-owned directory (node_lock_path), taken shared
    or alone by context, the holder's pid written, a health pass preempted. Mixed into NodeCheck: the
    state it fills (lock_fd, unlocked, skipped, findings, locked_out) is the pass's."""

    def take_lock(self):
        """health, npd: the lock alone (another pass running: not assessed); prolog, epilog: shared with each other
        (jobs on other GPUs of the node start and end side by side), and a health or npd pass holding it is
        stopped (SIGTERM): a job start wins over a health pass. The lock is in a root-owned directory
        (node_lock_path), never under a job's TMPDIR. A prolog or epilog that could not take it goes on without
        it (self.unlocked says why): its GPUs' processes are not judged then, nor its speed (a health pass's
        workers may be on them). -> False when this pass must not go on."""
        path, why = node_lock_path(self.node, getattr(self.args, "node_lock_dir", None))
        job = self.ctx in ("prolog", "epilog")
        try:
            fd = os.open(path, os.O_CREAT | os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644) if path else None
        except OSError as e:
            fd, why = None, f"{path}: {e.strerror}"
        if fd is None:
            self.unlocked = f"the node check's lock could not be opened ({why})"
            self.skipped.append(f"no lock ({why})")
            return True
        self.lock_fd = fd
        mode = fcntl.LOCK_SH if job else fcntl.LOCK_EX
        try:
            fcntl.flock(fd, mode | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = (read_text(path, "") or "").split()
            if not job:
                who = f" (pid {holder[0]}, {holder[1]})" if len(holder) >= 2 else " (a job's prolog or epilog)"
                self.findings.append(unassessed("interrupted", f"{self.node}: another node check holds {path}{who}: "
                                                "this pass did not run (its files are left to that pass)",
                                                "another node check is running"))
                self.locked_out = True
                return False
            self._preempt(holder)
            if not self._wait_lock(fd, mode):
                who = f" (pid {holder[0]})" if holder else ""
                self.unlocked = f"the health pass holding {path}{who} did not let go within {NODE_PREEMPT_S:g}s"
                self.skipped.append(self.unlocked)
                return True
        except OSError as e:
            self.unlocked = f"the node check's lock {path} could not be taken ({e.strerror})"
            self.skipped.append(self.unlocked)
            return True
        if not job:
            with contextlib.suppress(OSError):
                os.ftruncate(fd, 0)
                os.write(fd, f"{os.getpid()} {self.ctx}\n".encode())
        return True

    def _wait_lock(self, fd, mode):
        until = time.monotonic() + NODE_PREEMPT_S
        while True:
            try:
                fcntl.flock(fd, mode | fcntl.LOCK_NB)
                return True
            except BlockingIOError:
                if time.monotonic() > until or self.stopped:
                    return False
                time.sleep(0.1)

    def _preempt(self, holder):
        """SIGTERM to the health or npd pass holding the lock, when that pid is a node check."""
        if not holder or not holder[0].isdigit():
            return
        cmd = read_text(f"/proc/{holder[0]}/cmdline", "") or ""
        if "--node-check" in cmd:
            with contextlib.suppress(OSError):
                os.kill(int(holder[0]), signal.SIGTERM)
