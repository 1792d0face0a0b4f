"""Floor 5 (runtime): the node monitor, a torch-free child of each node leader that posts the state
of its node's ranks, so that a hung rank is told from a dead node."""
import contextlib
import datetime
import glob
import os
import re
import socket
import struct
import tempfile
import time

from ..core.deadlines import MARK_TTL, MONITOR_CONNECT_S
from ..core.files import stat_fields
from ..launch.contract import job_secret
from .store import Seal, StoreProtocol, run_base


def proc_stat(pid, root="/"):
    """(state letter, start time) from /proc/<pid>/stat, or None when there is no such process."""
    fields = stat_fields(pid, root)
    return (fields[0], fields[19]) if len(fields) > 19 else None


def liveness(stat, first):
    """running / stopped / gone for a process first seen as `first` (None: never visible here)."""
    if first is None:
        return "unknown"
    if stat is None or stat[0] in "ZXx" or stat[1] != first[1]:
        return "gone"
    return "stopped" if stat[0] in "Tt" else "running"


def parent_pid(pid, root="/"):
    """The parent of `pid` from /proc/<pid>/stat, or None."""
    fields = stat_fields(pid, root)
    return int(fields[1]) if len(fields) > 1 else None


def launch_key(pid):
    """The launch a process belongs to, as its launcher's pid and start time (srun's step daemon, torchrun's
    agent, the local launcher): every rank of a node under one launch shares it."""
    return f"{pid}-{(proc_stat(pid) or ('', ''))[1]}"


def said_marker(env, topic, launch):
    """The node-local marker file of speak_once_per_node: job, step, topic and launch (launch_key)."""
    key = "-".join(re.sub(r"\W", "_", str(x)) for x in (env.get("SLURM_JOB_ID", "x"), env.get("SLURM_STEP_ID", "x"),
                                                          topic, *launch.split("-", 1)))
    return os.path.join(tempfile.gettempdir(), f"aiv-{key[:200]}.said")


def sweep_said(launch=None):
    """Remove speak_once_per_node's markers: those of one launch (its ranks are gone: the node monitor and
    the local launcher at their end), and any older than MARK_TTL (they silence nobody any more)."""
    now = time.time()
    for path in glob.glob(os.path.join(tempfile.gettempdir(), "aiv-*.said")):
        with contextlib.suppress(OSError):
            mine = launch is not None and path.endswith(f"-{launch}.said")
            if mine or now - os.stat(path).st_mtime > MARK_TTL:
                os.unlink(path)


def node_monitor(cfg):
    """A node leader's child: posts the state of its node's ranks to the store every cfg['period']
    seconds. It runs outside the ranks, so it never needs a rank's GIL (NCCL init can hold it for
    seconds). Ends when its ranks are all gone, the store is gone, or cfg['lifetime'] passes. A store
    on the port that is not its run's (cfg['run'], the roll call's nonce: its run ended while it
    started, and the next run serves the port) gets no post: it would name the next run's ranks gone."""
    pids = {int(x[0]): int(x[1]) for x in cfg["ranks"]}
    launch = launch_key(parent_pid(os.getppid()) or 0)  # its leader rank's launcher
    # each rank's own start time (from the roll call) tells a rank that died before we looked from
    # a PID we cannot see; without it, the first look is the reference
    first = {int(x[0]): ("", x[2]) if len(x) > 2 and x[2] else proc_stat(int(x[1])) for x in cfg["ranks"]}
    # ranks gone before we connect: the run ended (its store is gone: the connect fails within 1 s)
    # or they died, which is news for rank 0: one post, then the loop ends
    ended = all(liveness(proc_stat(p), first[r]) == "gone" for r, p in pids.items())
    store = monitor_store(cfg, 1 if ended else MONITOR_CONNECT_S)
    seal = Seal(job_secret(os.environ), run_base(os.environ))  # the secret travels in the environment only
    seal.run = cfg.get("run")
    proto = StoreProtocol(store, seal=seal)
    proto.tells = True  # what it refuses (a liveness post written over its own) goes to rank 0
    if cfg.get("run") and not proto.is_run(cfg["run"]):  # its run ended; a later run serves this port now
        return 0
    end, seq = time.monotonic() + cfg["lifetime"], 0
    while time.monotonic() < end:
        states = {r: liveness(proc_stat(p), first[r]) for r, p in pids.items()}
        proto.post_live(cfg["host"], seq, states)
        if all(s == "gone" for s in states.values()):
            sweep_said(launch)  # the ranks' markers silence nobody any more
            break
        seq += 1
        time.sleep(cfg["period"])
    return 0


def say_hello(addr, port, prefix, rank, host, stop, seconds, retry_s):
    """A rank other than 0, from its start (before it imports torch), on a thread of its own: tell rank 0's store
    that its process is up and reaches the store (hello/<rank>, then the hellos counter), so that rank 0's last
    call waits for it; tried every retry_s until it is said, `stop` is set (the rank checked in) or `seconds`
    passed. -> whether it was said."""
    end = time.monotonic() + seconds
    while not stop.is_set() and time.monotonic() < end:
        try:
            with contextlib.closing(LightStore(addr, port, prefix, min(1.0, max(0.1, end - time.monotonic())))) as s:
                s.set(f"hello/{rank}", host)
                s.add("hellos", 1)
            return True
        except (OSError, struct.error, ValueError):
            stop.wait(retry_s)
    return False


def tell_rank0_without_torch(addr, port, prefix, rank, host, line, seconds, code=1, internal=False):
    """A rank that failed before the roll call (torch missing or too old, a local check, the tool's own error)
    reports it to rank 0 through the store's own wire (LightStore: no torch needed), so that rank 0 ends the
    roll call at once (naming this host, or nobody for the tool's own error) rather than waiting out the roll
    call. -> whether the report was posted (the store and rank 0's world record answered within `seconds`)."""
    end = time.monotonic() + seconds
    try:
        with contextlib.closing(LightStore(addr, port, prefix, max(0.5, seconds))) as store:
            proto = StoreProtocol(store, seal=Seal(job_secret(os.environ), run_base(os.environ)))
            while not proto.adopt_run():  # rank 0 publishes the world record (the run id) as its store opens
                if time.monotonic() >= end:
                    return False
                time.sleep(0.2)
            proto.report_error(rank, "local", line, code, internal=internal, host=host)
            proto.wake_roll_call("local")
            return True
    except (OSError, struct.error, ValueError):
        return False


def monitor_store(cfg, wait_s):
    """The node monitor's store client: LightStore (no import of torch: the monitor posts within a second
    of the go, not after seconds of importing torch beside the ranks' init), once it sees the world
    record rank 0 wrote through torch's client (same keys on the wire) and a set, check, get and
    compare_set on a key of its own came back as written; else torch's own TCPStore client (a later
    torch that speaks another protocol costs the import, never a silent node). No listener at all within
    wait_s raises the OSError (no fallback: there is no store to speak to). _AIV_MONITOR_TORCH=1 takes
    torch's client at once."""
    if os.environ.get("_AIV_MONITOR_TORCH") != "1":
        # no listener within wait_s: the run has ended (its store went with rank 0) or rank 0 cannot be
        # reached; torch's client would find none either, after seconds of importing torch and wait_s more
        # (a monitor that outlived its run by 15 s on a loaded machine): the OSError ends the monitor
        light = LightStore(cfg["addr"], cfg["port"], cfg["prefix"], wait_s)
        with contextlib.suppress(OSError, struct.error):
            key, mark = f"monitor/{cfg['host']}", f"{os.getpid()}.{time.time():.6f}"
            light.set(key, mark)
            if light.check(["world", key]) and light.get(key) == mark.encode() \
                    and light.compare_set(key, mark, mark + ".1") == (mark + ".1").encode():
                return light
        light.close()
    import torch.distributed as dist
    raw = dist.TCPStore(cfg["addr"], cfg["port"], None, False, datetime.timedelta(seconds=wait_s))
    return dist.PrefixStore(cfg["prefix"], raw)


class LightStore:
    """The store operations a node monitor (and a rank without torch) needs (set, check, get, compare_set,
    append, add) over a plain
    socket, in the wire format of torch's TCPStore (c10d: a query byte, then each key or value as a
    64-bit little-endian length and its bytes; a check answers one byte, 0 = ready; a get or
    compare_set answers a value). Keys are '/<prefix>/<key>', as torch's TCPStore and PrefixStore
    put them on the wire. Never trusted before monitor_store's round trips."""

    VALIDATE, SET, COMPARE_SET, GET, ADD, CHECK, APPEND = 0, 1, 2, 3, 4, 5, 9
    MAGIC = 0x3C85F7CE  # the client's first word: the server drops a connection without it

    def __init__(self, addr, port, prefix, timeout):
        self.prefix, end = prefix, time.monotonic() + timeout
        while True:  # as torch's client does: a refused connect is tried again (a full backlog at the go)
            try:
                self.sock = socket.create_connection((addr, port), timeout=max(0.1, end - time.monotonic()))
                break
            except OSError:
                if time.monotonic() >= end:
                    raise
                time.sleep(0.1)
        self.sock.settimeout(timeout)  # each later operation, as torch's client bounds them
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock.sendall(struct.pack("<BI", self.VALIDATE, self.MAGIC))

    def close(self):
        with contextlib.suppress(OSError):
            self.sock.close()

    @staticmethod
    def _blob(value):
        value = value if isinstance(value, bytes) else str(value).encode()
        return struct.pack("<Q", len(value)) + value

    def _key(self, key):
        return self._blob(f"/{self.prefix}/{key}")  # torch's client puts '/' before every key

    def _read(self, n):
        buf = b""
        while len(buf) < n:
            chunk = self.sock.recv(n - len(buf))
            if not chunk:
                raise ConnectionError("the store closed the connection")
            buf += chunk
        return buf

    def _value(self):
        return self._read(struct.unpack("<Q", self._read(8))[0])

    def set(self, key, value):
        self.sock.sendall(bytes([self.SET]) + self._key(key) + self._blob(value))

    def append(self, key, value):
        self.sock.sendall(bytes([self.APPEND]) + self._key(key) + self._blob(value))

    def check(self, keys):
        self.sock.sendall(struct.pack("<BQ", self.CHECK, len(keys)) + b"".join(map(self._key, keys)))
        return self._read(1) == b"\0"

    def get(self, key):
        self.sock.sendall(bytes([self.GET]) + self._key(key))
        return self._value()

    def add(self, key, n):
        self.sock.sendall(bytes([self.ADD]) + self._key(key) + struct.pack("<q", n))
        return struct.unpack("<q", self._read(8))[0]

    def compare_set(self, key, expected, desired):
        self.sock.sendall(bytes([self.COMPARE_SET]) + self._key(key) + self._blob(expected) + self._blob(desired))
        return self._value()
