"""The runtime's parts, each on its own: the deadline table, naming who did not finish, process
liveness from /proc, the store protocol on a real TCPStore, the watchdog, GPU expectation."""
import datetime
import os
import signal
import subprocess
import threading
import time
from types import SimpleNamespace

import pytest
import torch.distributed as dist

from conftest import aiv


@pytest.mark.parametrize("timeout,rollcall", [(1, 1), (5, 300), (120, 300), (3600, 60)])
def test_deadline_table_keeps_rank_0_ahead_of_everyone(timeout, rollcall):
    table = aiv.deadlines(timeout, rollcall)
    assert set(table) - {"manifest-lock", "verdict"} == set(aiv.PHASES) == set(aiv.PHASE_CHECK) == set(aiv.PHASE_WHAT)
    assert table["verdict"] == aiv.VERDICT_S  # rank 0's verdict: its own bound, not counted in the worst case
    assert table["rollcall"] == table["local"] == rollcall and table["manifest-lock"] == aiv.MANIFEST_LOCK_S
    assert all(table[p] == timeout for p in aiv.PHASES if p not in ("local", "rollcall"))  # "soak": + --soak (0)
    for p in aiv.PHASES:  # rank 0 names culprits before any other rank gives up on it
        assert table[p] + aiv.NAMING_S < table[p] + aiv.RANK0_GRACE
    assert aiv.worst_case(table) == (2 * rollcall + 7 * timeout + aiv.MANIFEST_LOCK_S + aiv.NAMING_S
                                     + aiv.ACKS_S)
    assert aiv.worst_case(table, bandwidth=True) == aiv.worst_case(table) + timeout
    assert aiv.worst_case(table, screen=False) == aiv.worst_case(table) - len(aiv.SCREEN_PHASES) * timeout
    assert all(aiv.PHASE_CHECK[p] in aiv.CHECKS for p in aiv.PHASES)
    soaked = aiv.deadlines(timeout, rollcall, soak=600)  # the soak's bound: its seconds + --timeout
    assert soaked["soak"] == timeout + 600 and {p: s for p, s in soaked.items() if p != "soak"} == \
        {p: s for p, s in table.items() if p != "soak"}
    assert aiv.worst_case(soaked, soak=True) == aiv.worst_case(table) + timeout + 600
    assert aiv.worst_case(soaked) == aiv.worst_case(table)  # without --soak the phase never runs


def test_liveness_period_keeps_rank_0_under_1k_ops_per_second():
    for nodes in (1, 2, 64, 512, 4096, 65536):
        assert aiv.live_period(nodes) >= 1.0 and 2 * aiv.live_period(nodes) <= aiv.NAMING_S - 1
        assert nodes / aiv.live_period(nodes) <= (500 if nodes <= 1000 else nodes / 2)


HOSTS = {0: "n1", 1: "n1", 2: "n2", 3: "n2"}
COLL = aiv.PHASES.index("collective")


def unfinished(stamps, live, errors=None, silent=(), code=None):
    return aiv.judge_unfinished("collective", "all_reduce did not complete within 8s", 4, HOSTS, stamps, live,
                                errors or {}, code, silent)


def test_a_dead_rank_is_the_culprit_not_those_waiting_on_it():
    f = unfinished({0: COLL - 1, 1: COLL - 1, 2: COLL - 1, 3: COLL - 1},
                   {0: "running", 1: "running", 2: "gone", 3: "running"})
    assert f["status"] == "FAIL" and f["check"] == "collective" and aiv.verdict_code([f]) == aiv.EXIT_FAIL
    assert f["ranks"] == [2] and f["hosts"] == ["n2"]
    assert "rank 2 (n2) dead (process gone)" in f["reason"] and "ranks 0-1 (n1), 3 (n2) alive" in f["reason"]


def test_frozen_and_silent_ranks_time_out_with_exit_3():
    f = unfinished({r: COLL - 1 for r in range(4)}, {0: "running", 1: "stopped", 2: "running", 3: "running"},
                   silent={"n2"})
    assert aiv.verdict_code([f]) == aiv.EXIT_TIMEOUT and f["ranks"] == [1, 2, 3] and f["hosts"] == ["n1", "n2"]
    assert "frozen (process stopped)" in f["reason"]
    assert "unreachable (its node's monitor and ranks stopped reporting)" in f["reason"]


def test_finished_ranks_are_never_named():
    """Ranks 1-2 finished the collective, 0 and 3 are alive and did not: without their answers (not asked) no
    host is named; with them (outside any collective for seconds, while their peers finished) 0 and 3 are."""
    stamps = {0: COLL - 1, 1: COLL, 2: COLL, 3: COLL - 1}
    f = unfinished(stamps, {r: "running" for r in range(4)})
    assert (f["ranks"], f["hosts"], f["blame"]) == ([], [], "not-collected") and "no host is named" in f["reason"]
    assert "2/4 rank(s) finished collective" in f["reason"] and "ranks 0 (n1), 3 (n2) alive" in f["reason"]
    idle = {"own": {"0-3": ["all_reduce", 2, True]}, "fr": None, "inflight": None, "idle_s": 30.0}
    f = aiv.judge_unfinished("collective", "x", 4, HOSTS, stamps, {r: "running" for r in range(4)}, {}, None, (),
                             {r: idle for r in range(4)})
    assert (f["ranks"], f["blame"]) == ([0, 3], "never-issued"), f
    assert "ranks 0 (n1), 3 (n2) never finished its part of collective that ranks 1-2 finished" in f["reason"]


def test_reported_errors_name_their_ranks_with_their_own_code():
    f = unfinished({r: COLL - 1 for r in range(4)}, {r: "running" for r in range(4)},
                   errors={3: {"line": "rank 3 (n2): all_reduce failed: RuntimeError: boom"}}, code=aiv.EXIT_FAIL)
    assert f["ranks"] == [3] and aiv.verdict_code([f]) == aiv.EXIT_FAIL and "first error: rank 3 (n2)" in f["reason"]


def test_many_culprits_are_listed_per_node_and_bounded():
    hosts = {r: f"n{r // 8:03d}" for r in range(8 * 40)}
    f = aiv.judge_unfinished("init", "init", 320, hosts, {r: 1 for r in range(320)},
                             {r: "gone" for r in range(320)}, {}, None, ())
    assert len(f["ranks"]) == 320 and "and 24 more node(s)" in f["reason"] and len(f["reason"]) < 1200


def test_liveness_of_a_real_process():
    p = subprocess.Popen(["sleep", "60"])
    try:
        first = aiv.proc_stat(p.pid)
        assert first is not None and aiv.liveness(aiv.proc_stat(p.pid), first) == "running"
        os.kill(p.pid, signal.SIGSTOP)
        time.sleep(0.2)
        assert aiv.liveness(aiv.proc_stat(p.pid), first) == "stopped"
        os.kill(p.pid, signal.SIGCONT)
        p.kill()
        p.wait()
        assert aiv.liveness(aiv.proc_stat(p.pid), first) == "gone"
        assert aiv.liveness(("S", "other-start"), first) == "gone"        # the PID was reused
        assert aiv.liveness(None, None) == "unknown"                       # never visible here
    finally:
        if p.poll() is None:
            p.kill()


@pytest.fixture
def store():
    server = dist.TCPStore("127.0.0.1", 0, None, True, datetime.timedelta(seconds=10), wait_for_workers=False)
    yield server
    del server


def proto_for(server):
    return aiv.StoreProtocol.open(dist, "127.0.0.1", server.port, 10, "aiv")


def test_store_protocol_roll_call_stamps_errors_and_verdict(store):
    p0, p1 = proto_for(store), proto_for(store)
    p0.publish_world(3)
    assert p1.check_in(1, {"rank": 1, "host": "n2", "pid": 11}, 3, 5) is None
    assert p0.check_in(0, {"rank": 0, "host": "n1", "pid": 10}, 3, 5) is None
    assert not p0.wait_all(0.3) and p0.missing(3) == [2] and p0.strays() == []
    recs = p0.identities([0, 1])
    assert [r["host"] for r in recs] == ["n1", "n2"]
    p0.prepare(recs)
    assert p1.node_ranks("n2") == [[1, 11, None]] and p0.live(["n1", "n2"]) == {"n1": {}, "n2": {}}
    p1.stamp(1, "init")
    assert p0.stamps(2) == {0: 0, 1: aiv.PHASES.index("init")}
    p1.report_error(1, "init", "rank 1 (n2): init failed: X", 1)
    assert p0.count("nerr") == 1 and p0.errors() == {1: {"line": "rank 1 (n2): init failed: X", "term": False,
                                                                  "internal": False, "phase": "init", "host": None,
                                                                  "code": 1}}
    got = {}
    listener = p1.clone()
    t = threading.Thread(target=lambda: got.update(code=listener.wait_verdict(10)))
    t.start()
    p0.publish_verdict(3)
    t.join(10)
    assert got == {"code": 3}


class _NoClone:
    """A torch < 2.8 store as the protocol sees it: every operation of the real PrefixStore, but no clone."""

    def __init__(self, store):
        self._store = store

    def __getattr__(self, name):
        if name == "clone":
            raise AttributeError(name)
        return getattr(self._store, name)


def test_clone_without_store_clone_dials_a_second_connection(store):
    """Where torch has no Store.clone, clone() is a second TCPStore client to the same host:port: a thread
    blocked in a wait on it does not hold up the first connection, and both see the same keys."""
    p0, p1 = proto_for(store), proto_for(store)
    p1.store = _NoClone(p1.store)
    p0.publish_world(2)
    assert p1.check_in(1, {"rank": 1, "host": "n2", "pid": 11}, 2, 5) is None
    listener = p1.clone()
    assert not hasattr(p1.store, "clone") and listener.store is not p1.store and listener.run == p1.run
    got = {}
    t = threading.Thread(target=lambda: got.update(code=listener.wait_verdict(10)))
    t.start()
    time.sleep(0.2)
    t0 = time.monotonic()
    p1.stamp(1, "init")  # the first connection is free while the listener blocks on its own
    assert time.monotonic() - t0 < 5
    p0.stamp(0, "init")
    assert p0.stamps(2) == {0: aiv.PHASES.index("init"), 1: aiv.PHASES.index("init")}
    p0.publish_verdict(3)
    t.join(10)
    assert got == {"code": 3}
    assert listener.clone().dial is p1.dial  # a clone of a clone dials the same store


class _Torch24:
    """torch.distributed as torch 2.4 has it for the store's server: the real TCPStore, but a listen fd is
    refused as its libuv server refuses it."""
    PrefixStore = dist.PrefixStore

    @staticmethod
    def TCPStore(*a, **kw):
        if kw.get("master_listen_fd") is not None and kw.get("use_libuv", True):
            raise NotImplementedError("The libuv TCPStore backend does not support initialization with an listen fd")
        return dist.TCPStore(*a, **kw)


def test_a_server_that_takes_no_listen_fd_binds_the_port_itself():
    """torch 2.4: the socket rank 0 bound is closed and the server binds its port; a gate written with
    compare_set wakes a rank waiting for it (torch 2.4's legacy server, the other way to serve a listen fd,
    does not wake it: every gate hung until its bound)."""
    import socket
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    port = s.getsockname()[1]
    fd = s.detach()
    p0 = aiv.StoreProtocol.open(_Torch24, "127.0.0.1", port, 10, "aiv", listen_fd=fd)
    p1 = aiv.StoreProtocol.open(dist, "127.0.0.1", port, 10, "aiv")
    p0.publish_world(2)
    assert p1.check_in(1, {"rank": 1, "host": "n2", "pid": 11}, 2, 5) is None
    got = {}
    t = threading.Thread(target=lambda: got.update(go=p1.wait_gate("phase/init", 10)))
    t.start()
    time.sleep(0.2)
    t0 = time.monotonic()
    p0.open_gate("phase/init")
    t.join(10)
    assert got == {"go": "go"} and time.monotonic() - t0 < 5


def test_store_protocol_refuses_a_second_claim_and_another_world(store):
    p0, p1, dup, other = (proto_for(store) for _ in range(4))
    p0.publish_world(2)
    assert p0.check_in(0, {"rank": 0, "host": "n1", "pid": 10}, 2, 5) is None
    assert other.check_in(1, {"rank": 1, "host": "n9", "pid": 90}, 3, 5)[0] == "world-size"
    assert p0.wait_all(0.3) and p0.missing(2) == [1]  # the stray woke the roll call; it claimed nothing
    assert p1.check_in(1, {"rank": 1, "host": "n2", "pid": 11}, 2, 5) is None
    assert dup.check_in(1, {"rank": 1, "host": "n3", "pid": 12}, 2, 5) == (
        "rendezvous", "RANK=1 is claimed twice: first by pid 11 on n2")
    assert p0.missing(2) == [] and [(x["host"], x["check"]) for x in p0.strays()] == [
        ("n9", "world-size"), ("n3", "rendezvous")]
    run = ["n0", "n1", "n2"]  # the run's own hosts: a world-size stray is named against their majority
    assert [f["hosts"] for f in aiv.judge_strays(p0.strays(), run)] == [["n3"], ["n9"]]
    assert [f["hosts"] for f in aiv.judge_strays(p0.strays())] == [["n3"], []]  # n9 against n3 alone: a tie


def test_settled_liveness_waits_for_fresh_posts_and_names_silent_nodes(store):
    """n1 posts again: settled. n2's monitor posted once, then nothing, and its leader's beat stopped too:
    silent (unreachable); so is n3, whose monitor never posted and whose leader never beat (cut off since the
    go). n4's monitor stopped while its leader still beats: quiet, the tool's own monitor, never evidence
    against the node."""
    p0, mon = proto_for(store), proto_for(store)
    p0.publish_world(4)
    mon.seal.run = p0.run  # a node monitor is given the run id (cfg["run"])
    p0.prepare([{"rank": r, "host": f"n{r + 1}", "pid": r + 1} for r in range(4)])
    for h in ("n1", "n2", "n4"):
        mon.post_live(h, 0, {str(int(h[1]) - 1): "running"})

    def later():
        time.sleep(0.5)
        mon.post_live("n1", 1, {"0": "running"})
        mon.beat("n4")
    threading.Thread(target=later).start()
    t0 = time.monotonic()
    live, silent, quiet = p0.settled_live(["n1", "n2", "n3", "n4"], 2.0)
    assert live == {0: "running", 1: "running", 3: "running"} and 1.9 < time.monotonic() - t0 < 4
    assert silent == {"n2", "n3"} and quiet == {"n4"}


def test_a_silent_monitor_blames_no_host_that_is_otherwise_seen():
    """Rank 0's own node is never unreachable (rank 0 reads its ranks from /proc), nor a node one of whose
    ranks posted an error report; what is left of silent is a note, no host."""
    host_of = {0: "n1", 1: "n1", 2: "n2", 3: "n3", 4: "n5", 5: "n5"}
    un, quiet = aiv.unreachable_hosts({"n1", "n2", "n3", "n5"}, {"n4"}, "n1", host_of, {4: {"line": "x"}})
    assert un == {"n2", "n3"} and quiet == {"n1", "n4", "n5"}
    un, quiet = aiv.unreachable_hosts({"n1", "n2", "n3"}, {"n4"}, "n1", host_of, {2: {"line": "x"}})
    assert un == {"n3"} and quiet == {"n1", "n4"}  # n2's only rank said what happened to it: no note
    assert "no host is blamed" in aiv.quiet_monitor_note(quiet, 4)


def test_node_monitor_posts_the_state_of_its_ranks(store):
    sleeper = subprocess.Popen(["sleep", "60"])
    cfg = {"addr": "127.0.0.1", "port": store.port, "prefix": "aiv", "host": "n1",
           "ranks": [[0, os.getpid()], [1, sleeper.pid]], "period": 0.2, "lifetime": 6}
    p0 = proto_for(store)
    p0.publish_world(2)
    cfg["run"] = p0.run
    p0.prepare([{"rank": 0, "host": "n1", "pid": os.getpid()}])
    t = threading.Thread(target=aiv.node_monitor, args=(cfg,), daemon=True)
    t.start()
    try:
        deadline = time.monotonic() + 20
        while p0.live(["n1"])["n1"].get("ranks", {}).get("1") != "running" and time.monotonic() < deadline:
            time.sleep(0.1)
        os.kill(sleeper.pid, signal.SIGSTOP)
        live, *_ = p0.settled_live(["n1"], 3)
        assert live == {0: "running", 1: "stopped"}
        os.kill(sleeper.pid, signal.SIGKILL)
        sleeper.wait()
        live, *_ = p0.settled_live(["n1"], 3)
        assert live == {0: "running", 1: "gone"}
    finally:
        if sleeper.poll() is None:
            sleeper.kill()
        t.join(10)                                            # its lifetime bounds it


def test_watchdog_ticks_then_expires_once_per_arming():
    events = []
    wd = aiv.Watchdog(expire=lambda ph: events.append(("expire", ph)),
                      tick=lambda ph: events.append(("tick", ph)), period=0.1)
    wd.arm("init", 0.45)
    time.sleep(0.8)
    wd.disarm()
    assert events[-1] == ("expire", "init") and events.count(("tick", "init")) >= 3
    n = len(events)
    wd.arm("ddp", 5)
    wd.disarm()
    time.sleep(0.3)
    assert len(events) == n                                    # disarmed: nothing fires


@pytest.mark.parametrize("env,expected", [
    ({}, ""),
    ({"CUDA_VISIBLE_DEVICES": ""}, ""), ({"CUDA_VISIBLE_DEVICES": "-1"}, ""),
    ({"CUDA_VISIBLE_DEVICES": "NoDevFiles", "SLURM_GPUS_ON_NODE": "8"}, ""),
    ({"CUDA_VISIBLE_DEVICES": "0,1"}, "CUDA_VISIBLE_DEVICES=0,1"),
    ({"SLURM_GPUS_ON_NODE": "8"}, "SLURM_GPUS_ON_NODE=8"), ({"SLURM_GPUS_ON_NODE": "0"}, ""),
    ({"SLURM_JOB_GPUS": "0"}, "SLURM_JOB_GPUS=0"), ({"SLURM_GPUS_PER_NODE": "h200:8"}, "SLURM_GPUS_PER_NODE=h200:8"),
])
def test_gpus_expected(env, expected, tmp_path):
    assert aiv.gpus_expected(env, str(tmp_path)) == expected


def test_gpus_expected_from_the_driver(tmp_path):
    (tmp_path / "proc/driver/nvidia/gpus/0000:1b:00.0").mkdir(parents=True)
    assert "NVIDIA driver" in aiv.gpus_expected({}, str(tmp_path))
    assert aiv.gpus_expected({"CUDA_VISIBLE_DEVICES": ""}, str(tmp_path)) == ""


def args(**kw):
    base = {"backend": "auto", "nproc": None}
    base.update(kw)
    return SimpleNamespace(**base)


def test_launch_plan_never_turns_expected_gpus_into_a_cpu_run(tmp_path):
    root = str(tmp_path)
    assert aiv.launch_plan(args(), {}, root) == {"nproc": 2, "backend": "gloo"}
    assert aiv.launch_plan(args(), {"CUDA_VISIBLE_DEVICES": "0,1,2"}, root) == {"nproc": 3, "backend": None}
    assert aiv.launch_plan(args(backend="gloo"), {"CUDA_VISIBLE_DEVICES": "0,1"}, root)["backend"] is None
    assert aiv.launch_plan(args(nproc=4), {}, root)["nproc"] == 4
    with pytest.raises(aiv.UsageError):
        aiv.launch_plan(args(backend="nccl"), {}, root)


def test_fd_limit_problem_names_the_shortfall():
    soft, hard = aiv.resource.getrlimit(aiv.resource.RLIMIT_NOFILE)
    if hard == aiv.resource.RLIM_INFINITY:
        pytest.skip("no hard limit here")
    assert aiv.fd_limit_problem(1, 1) is None
    msg = aiv.fd_limit_problem(hard, 1)
    assert msg and f"is {hard}, below the {2 * hard + 66}" in msg


def test_roles_keep_to_their_own_part():
    """Rank 0 alone gives the verdict; the others alone take it or speak for rank 0; every rank runs the
    screen. A role that gains the other's part (the interleaving the split removed) fails here."""
    verdict = {"conclude", "snapshot", "unfinished", "interruption", "roll_call"}
    follow = {"listen", "take_verdict", "lost_rank0", "speak_for_rank0", "rank0_seen"}
    parts = (aiv.ScreenRunner, aiv.ScreenCoordinator, aiv.ScreenFollower)
    screen = {n for cls in parts for n in vars(cls) if n.startswith("phase_screen_")}
    assert screen == {"phase_" + p.replace("-", "_") for p in aiv.SCREEN_PHASES}
    assert "phase_screen_net" in vars(aiv.ScreenCoordinator) and "phase_screen_net" in vars(aiv.ScreenFollower)
    assert issubclass(aiv.Coordinator, aiv.ScreenCoordinator) and not issubclass(aiv.Follower, aiv.ScreenCoordinator)
    assert issubclass(aiv.Follower, aiv.ScreenFollower) and not issubclass(aiv.Coordinator, aiv.ScreenFollower)
    import ast  # each role owns its part: no branch on "am I rank 0" anywhere in the runtime's classes
    lines = open(aiv.__file__).read().splitlines()  # (parsed once: inspect.getsource parses it again per class)
    source = {n.name: "\n".join(lines[n.lineno - 1:n.end_lineno]) for n in ast.parse("\n".join(lines)).body
              if isinstance(n, ast.ClassDef)}
    rank0 = (aiv.RollCall, aiv.Naming)  # rank 0's parts, mixed into Coordinator alone
    for cls in (*parts, *rank0, aiv.RankSetup, aiv.RankGuard, aiv.RankRun, aiv.Coordinator, aiv.Follower):
        assert "is0" not in source[cls.__name__], cls.__name__
    assert all(issubclass(aiv.Coordinator, c) and not issubclass(aiv.Follower, c) for c in rank0)
    assert verdict <= {n for c in (aiv.Coordinator, *rank0) for n in vars(c)} and not verdict & set(dir(aiv.Follower))
    assert follow <= set(vars(aiv.Follower)) and not follow & set(dir(aiv.Coordinator))
    assert issubclass(aiv.Coordinator, aiv.ScreenRunner) and issubclass(aiv.Follower, aiv.ScreenRunner)
    # the verdict itself is a room of its own with explicit inputs (the run's facts as plain data), no rank
    given = {"give", "state", "report", "plan_drain", "side_channel", "write_files", "listeners", "wait_acks"}
    assert given <= set(vars(aiv.Conclusion)) and not issubclass(aiv.Conclusion, aiv.RankRun)
    assert not given & set(vars(aiv.Coordinator))
    for role in (aiv.Coordinator, aiv.Follower):  # each role defines every hook the shared flow calls
        for hook in ("end", "grace", "enter_phase", "before_check_in", "after_check_in", "expire", "signalled"):
            assert hook in vars(role), (role.__name__, hook)


def test_gc_paused_restores_the_collector_on_every_way_out():
    """A rank's imports of torch run with the cycle collector off; it must come back on after them, an
    ImportError included, and stay off where the caller had it off."""
    import gc
    assert gc.isenabled()
    with aiv.gc_paused():
        assert not gc.isenabled()
    assert gc.isenabled()
    with pytest.raises(ImportError), aiv.gc_paused():
        raise ImportError("no torch here")
    assert gc.isenabled()
    gc.disable()
    try:
        with aiv.gc_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()
    finally:
        gc.enable()
