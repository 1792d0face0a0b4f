#!/usr/bin/env python3
"""Rank 0's store protocol at scale: thousands of simulated ranks against the real StoreProtocol.

  python bench/protocol_scale.py [--ranks 2048] [--ranks-per-node 8] [--workers 4] [--json OUT]
  python bench/protocol_scale.py --ranks 4096

This process is rank 0: it serves the TCPStore on a socket it bound itself and runs rank 0's
side of the protocol with the module's own code (StoreProtocol, judge_pre, judge_unfinished, ...),
in the order RankRun uses it. --workers processes hold the other ranks: for each one a main
connection (StoreProtocol.open) and a listener connection (clone(), blocked in wait_verdict from
the start, as the listener thread is), plus one connection per node for its simulated monitor.
No process group, no torch collective. Runs, in order:

  2. missing rank: one rank never checks in; wait_all(--rollcall-deadline) runs out, then
     missing() (one check per rank), identities, judge_pre and the rendezvous finding.
  1. roll call: every rank checks in and waits for the gate; rank 0 wait_all -> identities ->
     judge_pre -> prepare -> open_gate. Time from the last check-in to the last client that saw
     the gate.
  3. a phase: ranks stamp "rollcall" and "init" except one frozen rank (its monitor reports it
     stopped) and one dead rank (reported gone); node monitors post live/<host> every
     live_period(nodes); rank 0 ticks (live + the nerr count) each period. At --phase-deadline rank 0
     names who did not finish (settled_live, stamps, errors, judge_unfinished) and the finding must
     name exactly those two ranks (else exit 1). --stuck K adds K ranks that are alive (reported
     running) but never stamp: the finding mentions them, but they are no culprits next to a dead rank.
  4. the steady state of 3: the store operations issued per second, and the wall time of one
     live(hosts) and one stamps(world) multi_get.
  5. the verdict: the audit of every value on the store (give_verdict runs it before it publishes),
     publish_verdict; every listener returns from wait_verdict and acks; time until every sealed
     ack/<rank> is there.

Every value is signed with a fresh AIV_JOB_SECRET, put in the environment the workers inherit (never
on a command line), as the batch file does; --no-secret runs unsigned: the difference is the cost of
signing.

Every process raises its RLIMIT_NOFILE soft limit to the hard limit (the store holds 2 connections
per rank + 1 per node). The run happens inside a private network namespace with only a loopback
interface (needs root or CAP_SYS_ADMIN): torch's c10d looks up the name of the address of every
client socket it opens (getnameinfo on ::ffff:127.0.0.1, which /etc/hosts does not list), so each of
the thousands of connections would otherwise send a reverse lookup to the system resolver.
--host-net skips that isolation. The run ends by itself (--max-seconds).
"""
import argparse
import ctypes
import datetime
import fcntl
import json
import os
import queue
import resource
import socket
import statistics
import struct
import subprocess
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")  # no per-connection c10d warnings
import ddp_mesh_ping as aiv  # noqa: E402

ADDR = "127.0.0.1"
PREFIX, MISS_PREFIX = "aiv", "aiv-missing"
STORE_TIMEOUT_S = 120.0  # client connections: connect and default op timeout
WAIT_S = 90.0            # clients' wait_gate / wait_verdict bound
CLONE_NEWNET = 0x40000000
SIOCGIFFLAGS, SIOCSIFFLAGS, IFF_UP = 0x8913, 0x8914, 0x1
mono = time.monotonic


# ---------------------------------------------------------------------------- shared
def host_name(node):
    return f"gpu-{node + 1:04d}"


def identity(rank, rpn):
    """A roll-call identity as phase_local builds it (nccl, one H200 per rank, 8 per node)."""
    n, lr = divmod(rank, rpn)
    host = host_name(n)
    return {"rank": rank, "host": host, "hostname": host, "local_rank": lr, "backend": "nccl", "device": lr,
            "cvd": ",".join(map(str, range(rpn))),
            "gpu": {"name": "NVIDIA H200", "vram": 150_754_820_096, "uuid": f"GPU-{n:08x}-{lr:04x}-4b1c-9d2e",
                    "pci": f"0000:{0x18 + lr * 0x10:02x}:00.0", "numa": lr * 2 // rpn,
                    "numa_cpus": "0-47" if lr * 2 < rpn else "48-95", "mem_used": 560 << 20},
            "gpus_expected": rpn, "cpus": f"{lr * 12}-{lr * 12 + 11}",
            "versions": {"torch": "2.11.0+cu130", "cuda": "13.0", "nccl": "2.28.3", "python": "3.12.3"},
            "local": [aiv.finding("interface", "PASS", f"NCCL_SOCKET_IFNAME=eth0 selects eth0 on {host}",
                                  [host], [rank])],
            "pid": 100000 + rank}  # simulated: no monitor reads /proc here


def raise_nofile(need):
    """Soft RLIMIT_NOFILE to the hard limit. -> (soft, hard), or SystemExit when the hard one is too low."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < need:
        raise SystemExit(f"open-files hard limit {hard} < {need} needed: raise ulimit -Hn")
    if soft != resource.RLIM_INFINITY and soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)


def isolate_network():
    """Move this process (and the workers it will start) into a new network namespace and bring its
    loopback up: traffic can reach 127.0.0.1 only. -> None, or why it could not."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(CLONE_NEWNET) != 0:
        return os.strerror(ctypes.get_errno())
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        flags = struct.unpack("16sH22x", fcntl.ioctl(s, SIOCGIFFLAGS, struct.pack("16sH22x", b"lo", 0)))[1]
        fcntl.ioctl(s, SIOCSIFFLAGS, struct.pack("16sH22x", b"lo", flags | IFF_UP))
    return None


def host_cpu():
    """Seconds of CPU the whole host has been busy (all processes, /proc/stat), or None."""
    try:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
        return (sum(v[:8]) - v[3] - v[4]) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def pct(values, q):
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else None


# ---------------------------------------------------------------------------- worker
class Worker:
    """Holds ranks [lo, hi): main + listener connection each, and the monitors of some nodes.
    Commands arrive as JSON lines on stdin; each gets one JSON line on stdout."""

    def __init__(self, cfg):
        import torch.distributed as dist
        self.dist, self.cfg = dist, cfg
        self.world, self.rpn = cfg["world"], cfg["rpn"]
        self.ranks = list(range(cfg["lo"], cfg["hi"]))
        self.limits = raise_nofile(2 * len(self.ranks) + len(cfg["nodes"]) + 64)
        threading.stack_size(512 << 10)
        t = mono()
        self.main, self.listener = {}, {}
        self.secret = secret = aiv.job_secret(os.environ)  # the job's secret comes in the environment, as in a rank
        for r in self.ranks:
            self.main[r] = aiv.StoreProtocol.open(dist, ADDR, cfg["port"], STORE_TIMEOUT_S, PREFIX,
                                                  seal=aiv.Seal(secret))
            self.listener[r] = self.main[r].clone()
        self.monitors = []
        for n in cfg["nodes"]:  # as node_monitor connects: a raw client and the prefix
            raw = dist.TCPStore(ADDR, cfg["port"], None, False, datetime.timedelta(seconds=STORE_TIMEOUT_S))
            ranks = list(range(n * self.rpn, min((n + 1) * self.rpn, self.world)))
            self.monitors.append((host_name(n), aiv.StoreProtocol(dist.PrefixStore(PREFIX, raw),
                                                                  seal=aiv.Seal(secret)), ranks))
        self.connect_s = mono() - t
        self.heard = {}
        self.listeners = [threading.Thread(target=self._listen, args=(r,), daemon=True) for r in self.ranks]
        for th in self.listeners:
            th.start()
        self.mon_stop, self.mon_thread, self.posts = threading.Event(), None, []

    # -- threads
    def _listen(self, r):
        """The listener thread of a rank: take_verdict on its own connection."""
        client = self.listener[r]
        try:
            code = client.wait_verdict(WAIT_S)
            t = mono()
            client.ack(r)
            self.heard[r] = (code, t, mono())
        except Exception as e:
            self.heard[r] = f"{type(e).__name__}: {e}"

    def _rollcall(self, proto, r, gate, out):
        try:
            t0 = mono()
            proto.check_in(r, identity(r, self.rpn), self.world, WAIT_S)
            t1 = mono()
            if gate:
                proto.wait_gate("roll", WAIT_S)
            out[r] = (t0, t1, mono() if gate else None)
        except Exception as e:
            out[r] = f"{type(e).__name__}: {e}"

    def _monitor_loop(self, period, overrides, t0):
        """Each node's monitor posts once per period, with its leader's beat, the nodes spread evenly over
        the period."""
        m, seq = len(self.monitors), 0
        while not self.mon_stop.is_set():
            for j, (host, proto, ranks) in enumerate(self.monitors):
                if self.mon_stop.wait(max(0.0, t0 + seq * period + j * period / m - mono())):
                    return
                proto.post_live(host, seq, {r: overrides.get(r, "running") for r in ranks})
                proto.beat(host)  # the node leader's beat (the tool posts it from the rank, not the monitor)
                self.posts += [mono()] * 2  # two store operations per node per period
            seq += 1

    # -- commands
    def cmd_rollcall(self, prefix, skip, gate):
        """Every rank but `skip` checks in (one thread each, as ranks arrive on their own) and, with
        `gate`, waits for the roll gate."""
        if prefix == PREFIX:
            protos = self.main
        else:
            protos = {r: aiv.StoreProtocol(self.dist.PrefixStore(prefix, p.raw), p.raw, prefix,
                                           aiv.Seal(self.secret))
                      for r, p in self.main.items()}
        out = {}
        threads = [threading.Thread(target=self._rollcall, args=(protos[r], r, gate, out), daemon=True)
                   for r in self.ranks if r not in skip]
        for th in threads:
            th.start()
        for th in threads:
            th.join(WAIT_S + 10)
        bad = [v for v in out.values() if isinstance(v, str)]
        ok = [v for v in out.values() if not isinstance(v, str)]
        return {"n": len(ok), "errors": bad[:3], "n_errors": len(bad) + len(threads) - len(out),
                "checkin_end": [v[1] for v in ok], "gate_seen": [v[2] for v in ok if v[2] is not None]}

    def cmd_stamp(self, phases, skip):
        t = mono()
        for phase in phases:
            for r in self.ranks:
                if r not in skip or phase != phases[-1]:
                    self.main[r].stamp(r, phase)
        return {"t0": t, "t1": mono(), "sets": sum(1 for p in phases for r in self.ranks
                                                   if r not in skip or p != phases[-1])}

    def cmd_monitors_start(self, period, overrides, t0):
        over = {int(r): s for r, s in overrides}
        for _, proto, _ in self.monitors:  # a node monitor gets the run id from its node leader (cfg["run"])
            proto.seal.run = self.main[self.ranks[0]].run
        self.mon_thread = threading.Thread(target=self._monitor_loop, args=(period, over, t0), daemon=True)
        self.mon_thread.start()
        return {"monitors": len(self.monitors)}

    def cmd_monitors_stop(self, window):
        self.mon_stop.set()
        if self.mon_thread is not None:
            self.mon_thread.join(10)
        a, b = window
        return {"posts": len(self.posts), "in_window": sum(a <= t < b for t in self.posts)}

    def cmd_verdict(self, timeout):
        end = mono() + timeout
        for th in self.listeners:
            th.join(max(0.0, end - mono()))
        ok = [v for v in self.heard.values() if not isinstance(v, str)]
        bad = [v for v in self.heard.values() if isinstance(v, str)]
        return {"heard": len(ok), "codes": sorted({v[0] for v in ok}), "errors": bad[:3],
                "returned": [v[1] for v in ok], "acked": [v[2] for v in ok]}

    def serve(self):
        reply({"ready": True, "connections": 2 * len(self.ranks) + len(self.monitors),
               "connect_s": self.connect_s, "nofile": self.limits})
        for line in sys.stdin:
            msg = json.loads(line)
            cmd = msg.pop("cmd")
            if cmd == "quit":
                ru = resource.getrusage(resource.RUSAGE_SELF)
                reply({"bye": True, "cpu_s": ru.ru_utime + ru.ru_stime, "maxrss_mb": ru.ru_maxrss / 1024})
                break
            try:
                reply(getattr(self, "cmd_" + cmd)(**msg))
            except Exception as e:
                reply({"error": f"{cmd}: {type(e).__name__}: {e}"})
        sys.stdout.flush()
        os._exit(0)  # no interpreter teardown with thousands of blocked store threads


def reply(obj):
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def worker_main(cfg):
    threading.Timer(cfg["lifetime"], lambda: os._exit(3)).start()  # never outlive the benchmark
    Worker(cfg).serve()


# ---------------------------------------------------------------------------- rank 0 side
class Pool:
    """The worker processes and their JSON line channels."""

    def __init__(self, cfgs):
        self.procs, self.queues = [], []
        for cfg in cfgs:
            p = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--worker", json.dumps(cfg)],
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1)
            q = queue.Queue()
            threading.Thread(target=self._read, args=(p, q), daemon=True).start()
            self.procs.append(p)
            self.queues.append(q)

    @staticmethod
    def _read(p, q):
        for line in p.stdout:
            q.put(json.loads(line))
        q.put({"error": f"worker {p.pid} exited ({p.wait()})"})

    def send(self, cmd, **kw):
        for p in self.procs:
            p.stdin.write(json.dumps(dict(kw, cmd=cmd)) + "\n")
            p.stdin.flush()

    def collect(self, timeout):
        out, end = [], mono() + timeout
        for q in self.queues:
            try:
                msg = q.get(timeout=max(0.1, end - mono()))
            except queue.Empty:
                raise RuntimeError(f"a worker did not answer within {timeout:g}s") from None
            if "error" in msg:
                raise RuntimeError(msg["error"])
            out.append(msg)
        return out

    def close(self):
        try:
            self.send("quit")
            byes = self.collect(15)
        except Exception:
            byes = []
        for p in self.procs:  # each worker by its own PID, never by name
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        return byes


def expected_shape(world, rpn):
    return {"world_size": world, "nodes": -(-world // rpn), "ranks_per_node": rpn}


def scenario_missing(dist, proto0, pool, world, rpn, deadline_s, miss):
    """One rank never checks in: the roll call's deadline path, as in roll_call."""
    p0 = aiv.StoreProtocol(dist.PrefixStore(MISS_PREFIX, proto0.raw), proto0.raw, MISS_PREFIX,
                           aiv.Seal(proto0.seal.secret))
    p0.publish_world(world)
    pool.send("rollcall", prefix=MISS_PREFIX, skip=[miss], gate=False)
    p0.check_in(0, identity(0, rpn), world, WAIT_S)
    t0 = mono()
    arrived = p0.wait_all(deadline_s)
    t_dl = mono()
    missing = [] if arrived else p0.missing(world)
    t_m = mono()
    present = [r for r in range(world) if r not in set(missing)]  # as roll_call writes it
    t_p = mono()
    records = p0.identities(present)
    t_i = mono()
    names = ", ".join(str(r) for r in missing[:64])
    findings = [aiv.finding("rendezvous", "FAIL", f"rank(s) {names} did not check in within {deadline_s:g}s "
                            f"({len(present)}/{world} reported)", [], missing, code=aiv.EXIT_TIMEOUT)]
    findings += aiv.judge_pre(records, world, expected_shape(world, rpn))
    t_j = mono()
    replies = pool.collect(WAIT_S)
    assert not arrived and missing == [miss], f"expected rank {miss} missing, got {missing[:8]}"
    assert sum(r["n"] for r in replies) == world - 2 and not any(r["n_errors"] for r in replies), replies
    return {"missing_rank": miss, "deadline_s": deadline_s, "wait_all_overrun_s": t_dl - t0 - deadline_s,
            "missing_s": t_m - t_dl, "present_s": t_p - t_m, "identities_s": t_i - t_p, "judge_s": t_j - t_i,
            "deadline_to_finding_s": t_j - t_dl, "verdict_code": aiv.verdict_code(findings)}


def scenario_rollcall(proto0, pool, world, rpn, deadline_s):
    """Every rank checks in and waits for the gate; rank 0 as in roll_call."""
    proto0.publish_world(world)
    pool.send("rollcall", prefix=PREFIX, skip=[], gate=True)
    proto0.check_in(0, identity(0, rpn), world, WAIT_S)
    t_in0 = mono()
    arrived = proto0.wait_all(deadline_s)
    t_all = mono()
    missing = [] if arrived else proto0.missing(world)
    present = [r for r in range(world) if r not in set(missing)]
    records = proto0.identities(present)
    t_id = mono()
    host_of = {rec["rank"]: rec["host"] for rec in records}
    findings = aiv.apply_strict(aiv.judge_pre(records, world, expected_shape(world, rpn)), False)
    t_judge = mono()
    assert arrived and aiv.verdict_code(findings) == aiv.EXIT_PASS, [f["reason"] for f in findings
                                                                      if f["status"] != "PASS"][:3]
    proto0.prepare(records)
    t_prep = mono()
    poll = proto0.clone()
    nodes = len(set(host_of.values()))
    proto0.open_gate("roll", json.dumps({"host": host_name(0), "pid": os.getpid(), "nodes": nodes}))
    t_gate = mono()
    replies = pool.collect(WAIT_S)
    assert sum(r["n"] for r in replies) == world - 1 and not any(r["n_errors"] for r in replies), \
        [r["errors"] for r in replies]
    ends = [t for r in replies for t in r["checkin_end"]] + [t_in0]
    seen = [t for r in replies for t in r["gate_seen"]]
    last = min(max(ends), t_all)  # the last check-in landed before rank 0 woke, maybe before its caller ran
    return poll, host_of, {
        "checkin_spread_s": last - min(ends), "wake_s": t_all - last, "identities_s": t_id - t_all,
        "judge_pre_s": t_judge - t_id, "prepare_s": t_prep - t_judge, "open_gate_s": t_gate - t_prep,
        "rank0_s": t_gate - t_all, "gate_first_s": min(seen) - last, "gate_median_s": statistics.median(seen) - last,
        "gate_p99_s": pct(seen, 0.99) - last, "last_arrival_to_gate_all_s": max(seen) - last,
        "identity_bytes": len(json.dumps(records[-1])), "findings": len(findings)}


def scenario_phase(proto0, poll, pool, world, host_of, deadline_s, frozen, dead, stuck, reps):
    """After the gate: stamps, monitors, rank 0's ticks; at the deadline, who did not finish. `stuck`
    ranks stay alive (reported running) and never stamp: named, but not culprits next to a dead rank."""
    hosts = sorted(set(host_of.values()))
    period = aiv.live_period(len(hosts))
    t_ph = mono()  # rank 0 enters init: its watchdog arms the phase bound now
    deadline = t_ph + deadline_s
    pool.send("monitors_start", period=period, overrides=[[frozen, "stopped"], [dead, "gone"]], t0=t_ph + 0.05)
    pool.collect(30)
    pool.send("stamp", phases=["rollcall", "init"], skip=[frozen, dead, *stuck])
    proto0.stamp(0, "rollcall")
    proto0.stamp(0, "init")
    ticks, dead_seen, nxt = [], None, t_ph + period
    while True:  # on_tick's store reads, once per period (this run goes on to the deadline)
        if mono() + 0.001 >= deadline:
            break
        time.sleep(max(0.0, min(nxt, deadline) - mono()))
        if mono() >= deadline:
            break
        t = mono()
        snap = poll.live(hosts)
        poll.count("nerr")
        ticks.append((t, mono() - t))
        if dead_seen is None and any(s == "gone" for v in snap.values() for s in (v.get("ranks") or {}).values()):
            dead_seen = mono()
        nxt += period
    stamp_replies = pool.collect(30)
    t_dl = mono()  # the deadline: unfinished(), as on_expire calls it
    live, silent, _ = poll.settled_live(hosts, aiv.NAMING_S - 1)
    t_l = mono()
    stamps = poll.stamps(world)
    t_s = mono()
    errors = poll.errors()
    t_e = mono()
    cause = f"{aiv.PHASE_WHAT['init']} did not complete within {deadline_s:g}s"
    f = aiv.judge_unfinished("init", cause, world, host_of, stamps, live, errors, aiv.EXIT_TIMEOUT, silent)
    t_f = mono()
    named_right = (f["ranks"] == sorted([frozen, dead]) and f.get("code", aiv.EXIT_FAIL) == aiv.EXIT_FAIL
                   and "dead (process gone)" in f["reason"] and "frozen (process stopped)" in f["reason"])
    misnamed = sorted(r for r in stuck if host_of[r] in silent)
    walls = {"live": [], "stamps": []}
    for _ in range(reps):  # one multi_get each, monitors still posting
        t = mono()
        poll.live(hosts)
        walls["live"].append(mono() - t)
        t = mono()
        poll.stamps(world)
        walls["stamps"].append(mono() - t)
    win = (t_ph + period, t_dl)
    pool.send("monitors_stop", window=win)
    mons = pool.collect(30)
    posts = sum(m["in_window"] for m in mons)
    tick_ops = 2 * sum(win[0] <= t < win[1] for t, _ in ticks)
    secs = win[1] - win[0]
    return {
        "frozen": frozen, "dead": dead, "stuck": stuck, "named_exactly": named_right, "finding_ranks": f["ranks"],
        "silent_nodes": len(silent), "stuck_named_unreachable": misnamed,
        "period_s": period, "nodes": len(hosts), "deadline_s": deadline_s,
        "stamp_sets": sum(r["sets"] for r in stamp_replies) + 2,
        "stamp_burst_s": max(r["t1"] for r in stamp_replies) - min(r["t0"] for r in stamp_replies),
        "dead_seen_by_tick_after_s": None if dead_seen is None else dead_seen - t_ph,
        "tick_s_median": statistics.median(d for _, d in ticks) if ticks else None,
        "settled_live_s": t_l - t_dl, "stamps_s": t_s - t_l, "errors_s": t_e - t_s, "judge_s": t_f - t_e,
        "deadline_to_finding_s": t_f - t_dl, "finding": f["reason"], "finding_code": f.get("code", aiv.EXIT_FAIL),
        "window_s": secs, "monitor_posts": posts, "tick_ops": tick_ops, "ops_per_s": (posts + tick_ops) / secs,
        "posts_total": sum(m["posts"] for m in mons),
        "live_multiget_s_median": statistics.median(walls["live"]), "live_multiget_s_max": max(walls["live"]),
        "stamps_multiget_s_median": statistics.median(walls["stamps"]),
        "stamps_multiget_s_max": max(walls["stamps"])}


def scenario_verdict(poll, pool, world, host_of, code):
    """conclude: the audit of every value on the store (give_verdict, before it publishes), publish on the
    poll client, wait_acks' loop (20 ms) until every listener's sealed ack is there."""
    pool.send("verdict", timeout=WAIT_S)  # the workers report once their listeners returned
    t_a = mono()
    forged = poll.audit(sorted(host_of), sorted(set(host_of.values())))
    t0 = mono()
    poll.publish_verdict(code)
    t_pub = mono()
    n, acks, end, ranks = world - 1, 0, t0 + WAIT_S, list(range(1, world))
    while mono() < end:
        acks = poll.count("acks")
        if acks >= n and poll.acked(ranks):
            break
        time.sleep(0.02)
    t_ack = mono()
    assert forged == [], forged[:3]
    replies = pool.collect(WAIT_S)
    heard = sum(r["heard"] for r in replies)
    codes = sorted({c for r in replies for c in r["codes"]})
    assert acks >= n and heard == n and codes == [code], (acks, heard, codes, [r["errors"] for r in replies])
    returned = [t for r in replies for t in r["returned"]]
    return {"audit_s": t0 - t_a, "publish_s": t_pub - t0, "all_returned_s": max(returned) - t0,
            "returned_median_s": statistics.median(returned) - t0,
            "all_acked_s": max(t for r in replies for t in r["acked"]) - t0, "acks_seen_s": t_ack - t0,
            "acks": acks, "within_acks_bound": t_ack - t0 <= aiv.ACKS_S}


# ---------------------------------------------------------------------------- report
def ms(x):
    if x is None:
        return "-"
    return f"{x * 1000:.1f} ms" if x < 0.01 else f"{x * 1000:.0f} ms" if x < 1 else f"{x:.2f} s"


def table(res):
    a, b, c, d = res["rollcall"], res["missing"], res["phase"], res["verdict"]
    w = res["ranks"]
    rows = [
        ("1", f"last check-in -> go gate seen by all {w - 1} clients", ms(a["last_arrival_to_gate_all_s"]),
         "<= 2 s"),
        ("", "  rank 0: wait_all wake / identities / judge_pre / prepare / open_gate",
         " / ".join(ms(a[k]) for k in ("wake_s", "identities_s", "judge_pre_s", "prepare_s", "open_gate_s")), ""),
        ("", "  clients saw the gate: first / median / p99 (after the last check-in)",
         " / ".join(ms(a[k]) for k in ("gate_first_s", "gate_median_s", "gate_p99_s")), ""),
        ("2", f"roll-call deadline -> rank {b['missing_rank']} named missing ({b['deadline_s']:g} s deadline)",
         ms(b["deadline_to_finding_s"]), f"< NAMING_S {aiv.NAMING_S:g} s"),
        ("", f"  missing() = {w} checks / identities / judge_pre + finding",
         " / ".join(ms(b[k]) for k in ("missing_s", "identities_s", "judge_s")), ""),
        ("3", f"phase deadline -> finding naming frozen {c['frozen']} + dead {c['dead']}",
         ms(c["deadline_to_finding_s"]), "<= 2 s"),
        ("", "  settled_live / stamps / errors / judge_unfinished",
         " / ".join(ms(c[k]) for k in ("settled_live_s", "stamps_s", "errors_s", "judge_s")), ""),
        ("", f"  finding names exactly ranks {c['frozen']} and {c['dead']}" + (
            f" ({len(c['stuck'])} stuck rank(s) also late)" if c["stuck"] else ""),
         "yes" if c["named_exactly"] else f"NO: {c['finding_ranks'][:8]}", "yes"),
        ("", "  nodes settled_live left silent (a stuck rank there reads 'unreachable')",
         f"{c['silent_nodes']}" + (f", stuck misnamed: {c['stuck_named_unreachable'][:8]}"
                                   if c["stuck_named_unreachable"] else ""), "0"),
        ("", "  (on_tick would have ended the phase at: dead rank seen, s after phase start)",
         ms(c["dead_seen_by_tick_after_s"]), ""),
        ("4", f"steady state at rank 0: {c['nodes']} monitors + beats every {c['period_s']:g} s + tick",
         f"{c['ops_per_s']:.0f} ops/s", "< ~1000 ops/s"),
        ("", f"  one live({c['nodes']} hosts) multi_get: median / max",
         f"{ms(c['live_multiget_s_median'])} / {ms(c['live_multiget_s_max'])}", ""),
        ("", f"  one stamps({w}) multi_get: median / max",
         f"{ms(c['stamps_multiget_s_median'])} / {ms(c['stamps_multiget_s_max'])}", ""),
        ("5", f"audit: every value on the store verified once more ({w} ranks)", ms(d["audit_s"]), f"<= AUDIT_S "
         f"{aiv.AUDIT_S:g} s"),
        ("", f"publish_verdict -> every sealed ack/<rank> of {w - 1} there", ms(d["acks_seen_s"]),
         f"<= ACKS_S {aiv.ACKS_S:g} s"),
        ("", "  listeners back from wait_verdict: median / last (client side)",
         f"{ms(d['returned_median_s'])} / {ms(d['all_returned_s'])}", ""),
    ]
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    out = []
    for r in rows:
        out.append("  ".join(x.ljust(widths[i]) for i, x in enumerate(r)).rstrip())
    return "\n".join(out)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", type=int, default=2048, help="simulated world size (2048; 4096 also documented)")
    ap.add_argument("--ranks-per-node", type=int, default=8)
    ap.add_argument("--workers", type=int, default=4, help="processes holding the simulated ranks")
    ap.add_argument("--rollcall-deadline", type=float, default=3.0, help="roll-call bound of the missing-rank run")
    ap.add_argument("--phase-deadline", type=float, default=5.0, help="bound of the phase with the frozen/dead rank")
    ap.add_argument("--stuck", type=int, default=0, metavar="K", help="also K ranks alive but unfinished "
                    "(reported running, never stamp): named, but no culprits next to a dead rank")
    ap.add_argument("--reps", type=int, default=20, help="repetitions of the multi_get timings")
    ap.add_argument("--max-seconds", type=float, default=300.0, help="the whole run, then everything is killed")
    ap.add_argument("--host-net", action="store_true", help="skip the private network namespace (resolver "
                    "lookups of 127.0.0.1 leave the host, one per connection)")
    ap.add_argument("--json", metavar="OUT", help="write the numbers here")
    ap.add_argument("--no-secret", action="store_true", help="no AIV_JOB_SECRET: values carry the run id only, "
                    "no HMAC (the cost of signing is the difference to a run without this flag)")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker_main(json.loads(args.worker))
    world, rpn, nw = args.ranks, args.ranks_per_node, args.workers
    if world < 64 or rpn < 1 or not 1 <= nw < world:
        ap.error("need --ranks >= 64, --ranks-per-node >= 1 and 1 <= --workers < --ranks")
    nodes = -(-world // rpn)
    net = "private network namespace, loopback only"
    if not args.host_net:
        why = isolate_network()
        if why:
            raise SystemExit(f"cannot create a private network namespace ({why}): run as root, or pass "
                             "--host-net to accept one resolver lookup per store connection")
    else:
        net = "host network"
    problem = aiv.fd_limit_problem(world, nodes)  # rank 0's own check: soft limit raised to the hard one
    if problem:
        raise SystemExit(problem)
    nofile0 = resource.getrlimit(resource.RLIMIT_NOFILE)
    load0, cpu0, started = os.getloadavg(), host_cpu(), mono()
    import torch
    import torch.distributed as dist

    # rank 0 binds the store's socket itself, as _listen_socket does, and serves the store on it
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((ADDR, 0))
    s.listen(min(4096, max(128, world)))
    port = s.getsockname()[1]
    if args.no_secret:
        os.environ.pop("AIV_JOB_SECRET", None)
    else:  # as the batch file does: in the environment, which the workers inherit, never on a command line
        os.environ["AIV_JOB_SECRET"] = os.environ.get("AIV_JOB_SECRET") or os.urandom(32).hex()
    seal = aiv.Seal(aiv.job_secret(os.environ))
    proto0 = aiv.StoreProtocol.open(dist, ADDR, port, aiv.ROLLCALL_DEFAULT, PREFIX, listen_fd=s.detach(), seal=seal)

    bounds = [1 + (world - 1) * i // nw for i in range(nw + 1)]
    cfgs = [{"port": port, "world": world, "rpn": rpn, "lo": bounds[i], "hi": bounds[i + 1],
             "nodes": list(range(i, nodes, nw)), "lifetime": args.max_seconds + 30} for i in range(nw)]
    pool = Pool(cfgs)

    def overrun():
        print(f"protocol_scale: over --max-seconds {args.max_seconds:g}, stopping", flush=True)
        for p in pool.procs:
            p.kill()
        os._exit(3)
    timer = threading.Timer(args.max_seconds, overrun)
    timer.daemon = True
    timer.start()
    try:
        t = mono()
        ready = pool.collect(180)
        setup = {"workers_ready_s": mono() - t, "connect_s_max": max(r["connect_s"] for r in ready),
                 "connections": sum(r["connections"] for r in ready), "worker_nofile": ready[0]["nofile"]}
        res = {"ranks": world, "ranks_per_node": rpn, "nodes": nodes, "workers": nw, "network": net,
               "authenticated": seal.authenticated,
               "torch": torch.__version__, "rank0_nofile": nofile0, "setup": setup}
        res["missing"] = scenario_missing(dist, proto0, pool, world, rpn, args.rollcall_deadline, world // 2 + 3)
        poll, host_of, res["rollcall"] = scenario_rollcall(proto0, pool, world, rpn, aiv.ROLLCALL_DEFAULT)
        frozen, dead = world // 4 + 5, 3 * world // 4 + 2
        stuck = sorted({world * (2 * i + 1) // (2 * args.stuck) + 1 for i in range(args.stuck)} - {0, frozen, dead})
        res["phase"] = scenario_phase(proto0, poll, pool, world, host_of, args.phase_deadline,
                                      frozen, dead, stuck, args.reps)
        res["verdict"] = scenario_verdict(poll, pool, world, host_of, res["phase"]["finding_code"])
    finally:
        byes = pool.close()
        timer.cancel()
    ru = resource.getrusage(resource.RUSAGE_SELF)
    res["load_avg_start"], res["load_avg_end"] = load0, os.getloadavg()
    res["rank0_cpu_s"] = ru.ru_utime + ru.ru_stime
    res["workers_cpu_s"] = sum(b.get("cpu_s", 0) for b in byes)
    res["workers_maxrss_mb"] = max((b.get("maxrss_mb", 0) for b in byes), default=0)
    res["wall_s"] = mono() - started
    cpu1 = host_cpu()
    res["host_cpu_busy_s"] = None if cpu0 is None or cpu1 is None else cpu1 - cpu0
    print(f"protocol_scale: {world} ranks ({nodes} nodes x {rpn}), {nw} worker processes, "
          f"{setup['connections']} client connections ({net}); torch {res['torch']}; values "
          f"{'signed (HMAC-SHA256, AIV_JOB_SECRET)' if seal.authenticated else 'unsigned (--no-secret)'}")
    print(f"RLIMIT_NOFILE raised soft -> hard in every process: rank 0 (store server) {nofile0[0]}, "
          f"workers {setup['worker_nofile'][0]}; setup {setup['workers_ready_s']:.1f} s "
          f"(connections {setup['connect_s_max']:.1f} s)")
    print(table(res))
    print(f"finding: {res['phase']['finding']}")
    la0, la1 = res["load_avg_start"], res["load_avg_end"]
    ours = res["rank0_cpu_s"] + res["workers_cpu_s"]
    busy = res["host_cpu_busy_s"]
    others = "" if busy is None else f", everything else on the host {max(0.0, busy - ours):.1f} s"
    print(f"load average {la0[0]:.2f} at start, {la1[0]:.2f} at end on {os.cpu_count()} CPU(s); wall "
          f"{res['wall_s']:.1f} s; CPU rank 0 {res['rank0_cpu_s']:.1f} s, workers {res['workers_cpu_s']:.1f} s{others}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    if not res["phase"]["named_exactly"]:
        print(f"protocol_scale: FAIL: the finding names {res['phase']['finding_ranks'][:16]}, expected "
              f"{sorted([frozen, dead])}")
    sys.stdout.flush()
    os._exit(0 if res["phase"]["named_exactly"] else 1)  # the store server's threads need no teardown


if __name__ == "__main__":
    main()
