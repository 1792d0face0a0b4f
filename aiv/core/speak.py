"""Floor 1: speaking, the effects of the floor: one line printed under a lock that outlives a reader gone
away (emit), the flush at the end, and the run's findings with one owner (Findings). The judges never
print: they return findings and lines (aiv/core/base.py holds what they share)."""
import contextlib
import os
import sys
import threading

from .base import verdict_code

_PRINT_LOCK = threading.Lock()


def emit(line, stream=None):
    """Print a line. A reader that went away (`| head`, a closed terminal), a full disk behind it, a stream
    closed from the start (`>&-`) never stops the run: the stream's descriptor is pointed at /dev/null and the
    run goes on to its verdict and its JSON."""
    with _PRINT_LOCK:
        stream = stream or sys.stdout
        if stream is None:
            return
        try:
            stream.write(line + "\n")
            stream.flush()
        except (OSError, ValueError):  # ValueError: the stream was closed; EPIPE, EIO, ENOSPC ...
            drop_stream(stream)


def guard_std_streams():
    """Descriptors 0, 1 and 2 closed at the start (`>&-`, a daemon's children) are opened on /dev/null, so that
    no file or pipe the tool opens takes their numbers, and sys.stdout/stderr exist: the run's lines go
    nowhere, its verdict, files and exit code are what they would be."""
    for fd, name, mode in ((0, "stdin", os.O_RDONLY), (1, "stdout", os.O_WRONLY), (2, "stderr", os.O_WRONLY)):
        try:
            os.fstat(fd)
        except OSError:
            try:
                null = os.open(os.devnull, mode)
                if null != fd:
                    os.dup2(null, fd)
                    os.close(null)
            except OSError:
                continue
        if getattr(sys, name) is None:
            with contextlib.suppress(OSError, ValueError):
                setattr(sys, name, open(fd, "r" if fd == 0 else "w", closefd=False))


def drop_stream(stream):
    """Point a dead stream's descriptor at /dev/null: later writes and the flush at exit are silent."""
    with contextlib.suppress(OSError, ValueError):
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, stream.fileno())
        os.close(null)


def flush_all():
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            drop_stream(stream)


class Findings:
    """The run's findings, one owner. The phases add to it (+=, append) and read it (iteration, code()),
    every call under one lock; the verdict, given by whichever thread concludes first (the main thread,
    the watchdog, the signal thread), takes it whole once (close) and works on its own list from then
    on. A finding added after that is not part of the verdict: it goes to stderr, never lost silently."""

    def __init__(self, items=()):
        self._lock = threading.Lock()
        self._items, self._closed = list(items), False

    def __iadd__(self, items):
        items = list(items)
        with self._lock:
            if not self._closed:
                self._items.extend(items)
                return self
        for f in items:
            emit(f"NOTE: a finding came after the verdict and is not part of it: {f['check']}: {f['reason']}",
                 sys.stderr)
        return self

    def append(self, f):
        self += [f]

    def snapshot(self):
        with self._lock:
            return list(self._items)

    def close(self):
        """The findings as they stand, for the verdict; nothing joins them afterwards."""
        with self._lock:
            self._closed = True
            return list(self._items)

    def code(self):
        return verdict_code(self.snapshot())

    def __iter__(self):
        return iter(self.snapshot())

    def __len__(self):
        with self._lock:
            return len(self._items)
