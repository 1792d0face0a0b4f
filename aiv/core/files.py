"""Floor 1: files the tool writes (JSON, page, metrics, manifest): atomic replace, cross-job locks, the node
gate's lock directory; and the one bounded child process (run_bounded, child_finish): every command the tool
runs, its reap bounded too."""
import contextlib
import fcntl
import json
import os
import re
import signal
import stat
import subprocess
import tempfile
import time

from .base import read_text
from .deadlines import CHILD_REAP_S, LOCK_RETRY_S, MANIFEST_LOCK_S


class LockTimeout(Exception):
    """The manifest's lock file stayed held by another job for the whole MANIFEST_LOCK_S."""


@contextlib.contextmanager
def _file_lock(path, budget=None):
    """Serialise read-merge-write of one manifest across jobs with a `.NAME.lock` file beside it. The lock is
    tried without blocking (LOCK_NB) every LOCK_RETRY_S until budget seconds (MANIFEST_LOCK_S) have passed,
    then LockTimeout: a hung holder or a stuck lock on shared storage never hangs the verdict. A directory
    where no lock file can be created (or a file system without flock) is not locked (best effort)."""
    budget = MANIFEST_LOCK_S if budget is None else budget
    try:
        fd = os.open(os.path.join(os.path.dirname(os.path.abspath(path)), f".{os.path.basename(path)}.lock"),
                     os.O_CREAT | os.O_RDWR, _new_file_mode(path))
    except OSError:
        fd = None
    try:
        until = time.monotonic() + budget
        while fd is not None:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= until:
                    raise LockTimeout(f"another job held its lock file for {budget:g}s") from None
                time.sleep(min(LOCK_RETRY_S, max(0.0, until - time.monotonic())))
            except OSError:
                break  # flock unsupported here: unlocked, as before
        yield
    finally:
        if fd is not None:
            os.close(fd)


def _new_file_mode(path):
    """The mode a file at path gets: an existing file's own mode, else 0666 & ~umask (0644 under 022), as
    open(2) would give it, so that a teammate can read a verdict JSON or manifest the umask lets them."""
    try:
        return os.stat(path).st_mode & 0o7777
    except OSError:
        mask = os.umask(0)
        os.umask(mask)
        return 0o666 & ~mask


def write_text_atomic(path, text, suffix=".tmp", first=False):
    """Write text to path atomically: a temporary file beside it whose name never ends like the target (a
    textfile collector reading *.prom never reads half a file), with the mode _new_file_mode gives (mkstemp's
    own 0600 would hide the file from everyone else), then a rename. first: only when no file is there yet
    (the first writer wins, atomically: a hard link that fails when the path exists), for the ranks and the
    batch file that write a verdict when rank 0 left none. -> whether it was written."""
    if not first and _is_stream(path):  # a FIFO or a device (/dev/stdout, a collector's pipe): written into
        with open(path, "w") as f:
            f.write(text)
        return True
    fd, tmp = tempfile.mkstemp(prefix=".aiv-", suffix=suffix, dir=os.path.dirname(os.path.abspath(path)))
    try:
        os.fchmod(fd, _new_file_mode(path))
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        if not first:
            os.replace(tmp, path)
            return True
        try:
            os.link(tmp, path)
            return True
        except FileExistsError:
            return False
        finally:
            os.unlink(tmp)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _is_stream(path):
    try:
        m = os.stat(path).st_mode
    except OSError:
        return False
    return stat.S_ISFIFO(m) or stat.S_ISCHR(m)


def write_json_atomic(path, data, first=False):
    """data as JSON, through write_text_atomic."""
    return write_text_atomic(path, json.dumps(data, indent=1, sort_keys=True, default=str) + "\n", ".json", first)


# ---------------------------------------------------------------------------------------------- the node's lock
def node_lock_dirs(uid=None):
    """Where the node's lock may live (--node-lock-dir unset): root's own directories under /run (never a job's
    TMPDIR, which a job sets and a job-container plugin may mount per job), else this user's own."""
    uid = os.geteuid() if uid is None else uid
    return ("/run/aiv", "/var/lock/aiv") if uid == 0 else (f"/run/user/{uid}/aiv", f"/tmp/aiv-node-check-{uid}")


def node_lock_path(node, chosen=None):
    """-> (the lock file of this node's checks, None), or (None, why not): in `chosen` (--node-lock-dir) or the
    first of node_lock_dirs, a directory (made where missing) owned by this user and writable by no one else,
    so that no other user's file can stand in for the lock (fs.protected_regular refuses to open those)."""
    uid, whys = os.geteuid(), []
    for d in [chosen] if chosen else node_lock_dirs(uid):
        try:
            os.makedirs(d, 0o755 if uid == 0 else 0o700, exist_ok=True)
            st = os.lstat(d)
        except OSError as e:
            whys.append(f"{d}: {e.strerror}")
            continue
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != uid or st.st_mode & 0o022:
            whys.append(f"{d}: not a directory that only uid {uid} may write")
            continue
        return os.path.join(d, "aiv-node-check-" + re.sub(r"[^A-Za-z0-9._-]", "_", node) + ".lock"), None
    return None, "; ".join(whys)


# ---------------------------------------------------------------------------------------------- child processes
def stat_fields(pid, root="/"):
    """The fields of /proc/<pid>/stat after the command's name (the state letter first), [] when there is no such
    process."""
    text = read_text(os.path.join(root, f"proc/{pid}/stat"))
    return text.rsplit(")", 1)[1].split() if text and ")" in text else []


def proc_state(pid):
    """A process's state letter from /proc/PID/stat ('D': uninterruptible, in the kernel), None when gone."""
    return next(iter(stat_fields(pid)), None)


def child_finish(proc, seconds, name=None):
    """The output of a child started with stdout (and stderr) piped, within `seconds` -> {'rc', 'out', 'err'}, or
    {'unread': why, 'rc', 'stuck'} (with 'out' and 'err', what it said before the bound, when it was reaped).
    Past the bound its process group (or the child alone, when it shares ours) gets SIGKILL, and the reap is
    bounded too: at most CHILD_REAP_S more for it to exit and its pipes to close (a grandchild of another
    session may hold them), then it is left behind, said with its state ('D': stuck in the kernel, a driver
    call) and never waited for again."""
    name = name or os.path.basename(str(proc.args[0] if isinstance(proc.args, (list, tuple)) else proc.args))
    with contextlib.suppress(subprocess.TimeoutExpired):
        out, err = proc.communicate(timeout=max(0.01, seconds))
        return {"rc": proc.returncode, "out": _text(out), "err": _text(err)}
    _kill_group(proc)
    with contextlib.suppress(subprocess.TimeoutExpired):
        out, err = proc.communicate(timeout=CHILD_REAP_S)  # what it said before the bound is kept
        return {"unread": f"{name} gave no answer within {seconds:g}s", "rc": proc.returncode, "stuck": None,
                "out": _text(out), "err": _text(err)}
    state = proc_state(proc.pid) if proc.poll() is None else None
    for s in filter(None, (proc.stdin, proc.stdout, proc.stderr)):
        with contextlib.suppress(OSError, ValueError):
            s.close()
    how = (f"stuck, not reaped (state {state}{': in the kernel, a driver call' if state == 'D' else ''})"
           if state else "ended, but a process it started still holds its output open")
    return {"unread": f"{name} gave no answer within {seconds:g}s and was killed: {how}", "rc": proc.returncode,
            "stuck": state or "pipe"}


def _kill_group(proc):
    try:
        own = os.getpgid(proc.pid) == proc.pid
    except OSError:
        return
    with contextlib.suppress(OSError):
        if own:
            os.killpg(proc.pid, signal.SIGKILL)
        else:
            proc.kill()


def _text(b):
    return b.decode(errors="replace") if isinstance(b, bytes) else (b or "")


def child_start(argv, **kw):
    """argv in a session (process group) of its own, stdin from /dev/null, stdout and stderr piped, as text;
    OSError when it cannot start."""
    kw = dict({"stdin": subprocess.DEVNULL, "stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True,
               "errors": "replace", "start_new_session": True}, **kw)
    return subprocess.Popen(argv, **kw)


def run_bounded(argv, seconds, box=None, name=None):
    """argv within `seconds` (child_start, child_finish) -> {'rc', 'out', 'err'}, or {'unread': why} when it could
    not start or did not answer in time. box: where the child is kept (box['proc']) for whoever stops waiting for
    it earlier."""
    name = name or os.path.basename(argv[0])
    try:
        p = child_start(argv)
    except OSError as e:
        return {"unread": f"{name} could not run: {e.strerror or e}"}
    if box is not None:
        box["proc"] = p
    return child_finish(p, seconds, name)
