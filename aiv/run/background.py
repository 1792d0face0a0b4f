"""Floor 5 (runtime): a rank's work off its main thread, each taken within a bound (Background), its NCCL log
(NcclLog), and what it issued last on each of its process groups, for rank 0's question (Issued)."""
import contextlib
import json
import os
import sys
import tempfile
import threading
import time

from ..checks.interfaces import (
    nccl_debug_file,
    nccl_diag_lines,
    nccl_subsys_hides_channels,
    nccl_warn_lines,
    parse_nccl_hca,
    parse_nccl_ifaces,
    parse_nccl_transport,
)
from ..core.base import read_text
from ..core.deadlines import NCCL_RELAY_S
from ..core.speak import emit
from ..screen.measure import finish_node_smi


class Issued:
    """What this rank issued last on each of its process groups, kept in memory as it goes (cheap: a list per
    group): the collective's name, its number on that group (1, 2, ...; the group's own set-up is 0) and
    whether it finished on this rank; and the group the main thread is inside right now. Set by the one
    helper every collective call passes through (RankRun.issuing). torch's flight recorder holds the same
    from torch's side (record()): where it recorded nothing, this record stands in."""

    def __init__(self):
        self.own, self.inflight, self.since = {}, None, time.monotonic()
        self.names = {}  # a process group's name (torch's) -> its key (hang.group_key)

    def start(self, op, key, seq=None):
        last = self.own.get(key)
        self.own[key] = [op, (last[1] + 1 if last else 1) if seq is None else seq, False]
        self.inflight, self.since = key, time.monotonic()

    def done(self, key):
        self.own[key] = self.own[key][:2] + [True]
        self.inflight, self.since = None, time.monotonic()

    def record(self, torch, diag=()):
        """This rank's answer to rank 0: {'own': {key: [op, seq, done]}, 'fr': the same from torch's flight
        recorder (None: it recorded nothing, or cannot be read), 'inflight': the group the main thread is
        inside, or None, 'idle_s': seconds since it left its last call, 'diag': NCCL DIAG lines seen}. Never
        raises: the recorder is evidence, not a dependency."""
        inflight, since = self.inflight, self.since
        took = round(time.monotonic() - since, 3)
        return {"own": {k: list(v) for k, v in list(self.own.items())}, "fr": recorder_last(torch, dict(self.names)),
                "inflight": inflight, "idle_s": None if inflight else took, "inflight_s": took if inflight else None,
                "diag": list(diag)[:8]}


# torch's flight recorders, in the order read: ProcessGroupNCCL's own (NCCL's collectives; CUDA builds only),
# then the recorder of the other backends (gloo), whose dump holds none of NCCL's collectives. JSON only: nothing
# a rank reads is unpickled (torch's pickle dump, _dump_nccl_trace, is left alone)
RECORDERS = ("_dump_nccl_trace_json", "_dump_fr_trace_json")


def recorder_dump(torch):
    """The first of torch's flight recorders (RECORDERS) that holds entries, as plain data ({'entries', 'pg_status',
    ...}); {} when those that could be read hold none; None when none could be read."""
    c10d, read = getattr(torch._C, "_distributed_c10d", None), False
    for name in RECORDERS:
        try:  # a recorder this torch lacks, or cannot dump, is skipped
            j = json.loads(getattr(c10d, name)(True, False))
        except Exception:
            continue
        read = read or isinstance(j, dict)
        if isinstance(j, dict) and j.get("entries"):
            return j
    return {} if read else None


def recorder_last(torch, names):
    """The last collective torch's flight recorder holds for each process group this rank knows (names: torch's
    group name -> key): {key: [op, collective_seq_id, done, state]}, done from the recorder's per-group status (the
    last completed collective), else the entry's state (scheduled, started, completed). {} when the recorder
    holds nothing of these groups; None when it cannot be read: the recorder is evidence, not a dependency."""
    try:
        j = recorder_dump(torch)
        if j is None:
            return None
        status, out = j.get("pg_status") or {}, {}
        for e in j.get("entries") or []:
            pg = e.get("process_group") or []
            key, seq = names.get(str(pg[0])) if pg else None, e.get("collective_seq_id")
            if key is None or e.get("is_p2p") or not isinstance(seq, int) or (key in out and out[key][1] >= seq):
                continue
            st = status.get(str(e.get("pg_id")))
            done = int(st["last_completed_collective"]) >= seq if st and "last_completed_collective" in st else \
                e.get("state") == "completed"
            state = "completed" if done else str(e.get("state") or "?")
            out[key] = [str(e.get("profiling_name") or "?").split(":", 1)[-1], seq, done, state]
        return out
    except Exception:
        return None


class NcclLog:
    """NCCL's INFO lines of one rank: the transport it chose and the HCA of each connection, its WARN lines.
    By default NCCL writes them to a private file (not the operator's log). An operator who set NCCL_DEBUG_FILE
    keeps it: the rank reads that file (its %h and %p expanded as NCCL does), and NCCL writes INFO lines there
    only with NCCL_DEBUG=INFO. With NCCL_DEBUG=INFO and no file NCCL writes to the job's stdout, which the rank
    cannot read: `source` says why nothing was read (the transport row says so). Nothing on gloo."""

    def __init__(self, path=None, env=None, source=None):
        self.path, self.env, self.seen = path, env or {}, 0
        self.source = source  # NCCL's lines go to: 'private' (ours), 'operator' (NCCL_DEBUG_FILE), 'stdout'; None: gloo
        self.relay_lock, self.relayed = threading.Lock(), threading.Event()

    @classmethod
    def capture(cls, backend, rank, env):
        """As a rank starts (backend: --backend's word, auto included): the private file, NCCL's variables set
        to write there, unless the backend is gloo or the operator chose where NCCL writes."""
        if backend == "gloo":
            return cls(None, env)
        if "NCCL_DEBUG_FILE" in env or env.get("NCCL_DEBUG", "").upper() in ("INFO", "TRACE"):
            return cls(None, env, "operator" if "NCCL_DEBUG_FILE" in env else "stdout")
        fd, path = tempfile.mkstemp(prefix=f"aiv-nccl-r{rank}-", suffix=".log")
        os.close(fd)
        os.environ["NCCL_DEBUG_FILE"] = path
        os.environ["NCCL_DEBUG"] = "INFO"
        os.environ.setdefault("NCCL_DEBUG_SUBSYS", "INIT,NET")
        return cls(path, env, "private")

    def for_backend(self, backend):
        """This log once the backend is known: a gloo rank's has nothing to read, and its private file is
        dropped (NCCL's variables stay set: nothing in a gloo rank starts NCCL)."""
        if backend != "gloo":
            return self
        self.drop()
        return type(self)(None, self.env)

    def readable(self):
        """The file this rank reads NCCL's lines from (the private one, or the operator's), or None."""
        return self.path or (nccl_debug_file(self.env) if self.source == "operator" else None)

    def __bool__(self):
        return self.readable() is not None

    def _text(self):
        path = self.readable()
        return (read_text(path, "", limit=8 << 20) or "") if path else ""

    def facts(self):
        """{'transport': kinds, 'nccl_net': interfaces, 'nccl_log': where NCCL's lines were read, or why not}:
        transport and nccl_net are None where no INFO line of NCCL was read (gloo; NCCL_DEBUG=INFO on stdout;
        an operator's NCCL_DEBUG_FILE without INFO lines in it)."""
        if self.source is None and not self.path:
            return {"transport": None, "nccl_net": None, "nccl_log": None}
        text, where = self._text(), {"source": self.source, "path": self.readable()}
        hidden = self.source == "operator" and nccl_subsys_hides_channels(self.env.get("NCCL_DEBUG_SUBSYS"))
        if " NCCL INFO " not in text or hidden:
            return {"transport": None, "nccl_net": None, "nccl_log": dict(where, read=False, subsys=self.env.get(
                "NCCL_DEBUG_SUBSYS") if hidden else None)}
        return {"transport": parse_nccl_transport(text), "nccl_net": parse_nccl_ifaces(text),
                "nccl_log": dict(where, read=True)}

    def diag(self):
        """NCCL's DIAG lines (NCCL >= 2.31, NCCL_RUN_DIAGNOSTICS=1) where they reached the file this rank reads
        (NCCL prints them to the process's stdout: they are in the job's log beside ours)."""
        return nccl_diag_lines(self._text()) if self.readable() else []

    def hca_since_last(self):
        """The HCA of this rank's connections since the last call (a pair round's communicator)."""
        text = self._text()
        since, self.seen = self.seen, len(text)
        return parse_nccl_hca(text, since)

    def relay(self, who):
        """This rank's NCCL WARN lines to stderr, once, whichever thread exits first (the other waits at most
        NCCL_RELAY_S): from the private log, else from the operator's NCCL_DEBUG_FILE. The file may sit in
        a job-private TMPDIR that Slurm deletes; the job's stderr stays. A relay never changes the exit."""
        if not self.relay_lock.acquire(blocking=False):
            self.relayed.wait(NCCL_RELAY_S)
            return
        try:
            path = self.path or nccl_debug_file(self.env)
            if path:
                with contextlib.suppress(Exception):
                    lines, more = nccl_warn_lines(read_text(path, "", limit=8 << 20) or "")
                    for ln in lines:
                        emit(who + ln, sys.stderr)
                    if more:
                        emit(f"{who}{more} more of NCCL's WARN lines not shown", sys.stderr)
        finally:
            self.relayed.set()

    def close(self, keep, who):
        """At exit: keep a non-empty log of a failed run (and say where), drop it otherwise."""
        if self.path and keep and os.path.getsize(self.path) > 0:
            emit(f"{who}NCCL debug log kept at {self.path}", sys.stderr)
        else:
            self.drop()

    def drop(self):
        if self.path:
            with contextlib.suppress(OSError):
                os.unlink(self.path)
        self.path = None


class Background:
    """A rank's work off its main thread: started at the local phase, taken by the phase that needs it,
    each within a bound, none outliving the rank: children (the import probe, the node monitor) are killed at exit."""

    def __init__(self):
        self.probe = None     # node leaders: the torchvision/torchaudio import probe (a child, nice 19)
        self.monitor = None   # node leaders: the liveness monitor of the node's ranks (a child)
        self.warm = None      # DDP's lazy imports, on a thread
        self.node = None      # node leaders: the node's facts {'facts'|'error'|'internal'}, on a thread
        self.smi = None       # node leaders: the node's one nvidia-smi call (start_node_smi)
        self.gpu = None       # GPU ranks: the screen's device measurement on its own thread (start_screen_gpu)
        self.imports = None   # the import probe's result, once taken (RankSetup.import_results)

    def node_facts(self, smi_most_s):
        """The node's facts for the telemetry (node leaders; None elsewhere). The tool's own error in their
        collection is raised here (`internal`, no host blamed)."""
        if self.node is None:
            return None
        if "internal" in self.node:
            raise self.node["internal"]
        facts = self.node.get("facts") or {"error": self.node.get("error", "not collected in time")}
        if self.smi is not None:  # waited for within NODE_SMI_S of its start, at most smi_most_s now
            facts = dict(facts, smi=finish_node_smi(self.smi, smi_most_s))
        return facts

    def stop(self):
        for proc in (self.probe, self.monitor):
            if proc is not None and not isinstance(proc, OSError) and proc.poll() is None:
                proc.kill()
