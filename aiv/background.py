"""Floor 5 (runtime): a rank's work off its main thread and its NCCL log. Background holds what a rank
starts early and takes when a phase needs it (the node's import probe and monitor, the node's facts and
nvidia-smi, the GPU screen's measurement, DDP's lazy imports), each taken within a bound, none outliving
the rank. NcclLog holds NCCL's INFO lines in a private per-rank file: the transport it chose, the HCAs
of a pair round, its WARN lines relayed once at exit."""
import contextlib
import os
import sys
import tempfile
import threading
import time

from .base import emit, read_text
from .collect import finish_import_probe
from .deadlines import NCCL_RELAY_S
from .interfaces import nccl_debug_file, nccl_warn_lines, parse_nccl_hca, parse_nccl_ifaces, parse_nccl_transport
from .measure import finish_node_smi


class NcclLog:
    """NCCL's INFO lines of one rank, sent to a private file (not the operator's log) to learn the
    transport it chose and the HCA of each connection. Left alone (path None) when the operator set
    NCCL_DEBUG_FILE or asked for INFO, and on gloo."""

    def __init__(self, path=None, env=None):
        self.path, self.env, self.seen = path, env or {}, 0
        self.relay_lock, self.relayed = threading.Lock(), threading.Event()

    @classmethod
    def capture(cls, backend, rank, env):
        if backend == "gloo" or "NCCL_DEBUG_FILE" in env or env.get("NCCL_DEBUG", "").upper() in ("INFO", "TRACE"):
            return cls(None, env)
        fd, path = tempfile.mkstemp(prefix=f"aiv-nccl-r{rank}-", suffix=".log")
        os.close(fd)
        os.environ["NCCL_DEBUG_FILE"] = path
        os.environ["NCCL_DEBUG"] = "INFO"
        os.environ.setdefault("NCCL_DEBUG_SUBSYS", "INIT,NET")
        return cls(path, env)

    def __bool__(self):
        return self.path is not None

    def _text(self):
        return read_text(self.path, "", limit=8 << 20) or ""

    def facts(self):
        """{'transport': kinds, 'nccl_net': interfaces}, both None without a private log."""
        if not self.path:  # gloo, or the operator's own NCCL_DEBUG=INFO / NCCL_DEBUG_FILE
            return {"transport": None, "nccl_net": None}
        text = self._text()
        return {"transport": parse_nccl_transport(text), "nccl_net": parse_nccl_ifaces(text)}

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
    each within a bound. Children (the import probe, the node monitor) are killed at exit."""

    def __init__(self):
        self.probe = None     # node leaders: the torchvision/torchaudio import probe (a child, nice 19)
        self.monitor = None   # node leaders: the liveness monitor of the node's ranks (a child)
        self.warm = None      # DDP's lazy imports, on a thread
        self.node = None      # node leaders: the node's facts {'facts'|'error'|'internal'}, on a thread
        self.smi = None       # node leaders: the node's one nvidia-smi call (start_node_smi)
        self.gpu = None       # GPU ranks: the screen's device measurement on its own thread (start_screen_gpu)
        self.imports = None   # the import probe's result, once taken
        self.imports_s = None  # how long taking it waited

    def take_imports(self, wait_s):
        """The import probe's result (node leaders; None elsewhere), taken once, within wait_s."""
        if self.probe is None or self.imports is not None:
            return self.imports
        t = time.monotonic()
        self.imports = finish_import_probe(self.probe, wait_s)
        self.imports_s = round(time.monotonic() - t, 3)
        return self.imports

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
