"""Floor 1: files the tool writes (JSON, page, metrics, manifest): atomic replace and cross-job locks."""
import contextlib
import fcntl
import json
import os
import tempfile
import time

from .deadlines import LOCK_RETRY_S, MANIFEST_LOCK_S


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
        _take_lock(fd, time.monotonic() + budget, budget)
        yield
    finally:
        if fd is not None:
            os.close(fd)


def _take_lock(fd, until, budget):
    while fd is not None:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() >= until:
                raise LockTimeout(f"another job held its lock file for {budget:g}s") from None
            time.sleep(min(LOCK_RETRY_S, max(0.0, until - time.monotonic())))
        except OSError:
            return  # flock unsupported here: unlocked, as before


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
    d = os.path.dirname(os.path.abspath(path)) or "."
    mode = _new_file_mode(path)
    fd, tmp = tempfile.mkstemp(prefix=".aiv-", suffix=suffix, dir=d)
    try:
        os.fchmod(fd, mode)
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


def write_json_atomic(path, data, first=False):
    """data as JSON, through write_text_atomic."""
    return write_text_atomic(path, json.dumps(data, indent=1, sort_keys=True, default=str) + "\n", ".json", first)
