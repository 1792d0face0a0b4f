"""The fan-in to rank 0 (telemetry, DDP results) travels through the store, not a collective of the world.

Each rank appends one sealed JSON post to posts/<name>; rank 0 reads the world's posts in one read of one
key, within the phase's bound. What that must keep: a rank that never posts is named, alone, within the
bound; a forged post is refused and named, nobody blamed; rank 0's reads do not grow with the world.
Real ranks, real gloo, a real TCPStore; loopback only.
"""
import datetime
import json
import os
import socket
import subprocess
import sys

import pytest
from test_hangs import SLACK, Ranks, T, progress_at
from test_side_channel import SECRET, assert_forgery_named, forger, judged, start

from conftest import ROOT, aiv, clean_env, describe, failures, finish, free_port, wait_for

HOST = socket.gethostname()


class Counting:
    """A real store, every call counted: what rank 0's reads cost in round trips."""

    def __init__(self, store):
        self.store, self.calls = store, 0

    def __getattr__(self, name):
        fn = getattr(self.store, name)

        def call(*a, **kw):
            self.calls += 1
            return fn(*a, **kw)
        return call


def protocol(port, world, rank, server=False):
    import torch.distributed as dist
    raw = dist.TCPStore("127.0.0.1", port, None, server, datetime.timedelta(seconds=10), wait_for_workers=False)
    seal = aiv.Seal(SECRET.encode(), "9.0")
    seal.run = "9.0.fan"
    p = aiv.StoreProtocol(Counting(dist.PrefixStore("aiv", raw)), raw, "aiv", seal)
    p.rank, p.world = rank, world
    return p


@pytest.mark.parametrize("world", [4, 64])
def test_rank0_reads_the_whole_worlds_posts_in_a_constant_number_of_store_calls(world):
    port = free_port()
    rank0 = protocol(port, world, 0, server=True)
    other = protocol(port, world, 1)
    tele = {"host": "n1", "node": {"cpu_model": "x" * 1500}}  # ~1.5 KB, the size of a node leader's telemetry
    for r in range(world):
        other.post("telemetry", r, dict(tele, rank=r))
    rank0.store.calls = 0
    got = rank0.wait_posts("telemetry", 5)
    assert sorted(got) == list(range(world)) and got[world - 1]["node"] == tele["node"]
    assert rank0.store.calls <= 3, rank0.store.calls  # wait, check, get: never one read per rank


def test_wait_posts_returns_what_came_within_its_bound():
    port = free_port()
    rank0 = protocol(port, 3, 0, server=True)
    rank0.post("results", 0, {"ok": True})
    protocol(port, 3, 2).post("results", 2, {"ok": True})
    got = rank0.wait_posts("results", 0.5)
    assert sorted(got) == [0, 2]


def test_a_rank_that_never_posts_its_telemetry_is_named_alone_within_the_bound(tmp_path):
    """Rank 2 is alive but never posts (a 60 s pause before its post). With a collective of the world the
    ranks that did post would have been stuck beside it and named with it; here rank 2 alone is named."""
    jp, t = tmp_path / "v.json", 2 * T  # init of 4 ranks on a loaded 2-core machine can take T itself
    w = Ranks(4, ["--timeout", t, "--json", jp, "--skip-screen"],
              env={"AIV_FAILPOINT": "pause=90:telemetry:2"})
    try:
        w.wait([0, 1, 3])
    finally:
        w.kill_rest()
    out0 = w.out[0]
    assert w.rc(0) == aiv.EXIT_TIMEOUT, out0
    (line,) = failures(out0)
    assert line.startswith("FAILURE: telemetry: the telemetry gather and judge did not complete within"), line
    assert f"rank 2 ({HOST}) never finished its part of telemetry that ranks 0-1, 3 finished" in line, line
    assert "3/4 rank(s) finished telemetry" in line, line
    d = json.loads(jp.read_text())
    assert [f["ranks"] for f in d["findings"] if f["status"] == "FAIL"] == [[2]], d["findings"]
    took = progress_at(out0, "verdict:") - progress_at(out0, "init:")
    assert took <= t + aiv.NAMING_S + SLACK, f"verdict {took:.1f}s after telemetry began"
    assert w.rc(1) == w.rc(3) == aiv.EXIT_TIMEOUT and not failures(w.out[1]) and not failures(w.out[3])


@pytest.mark.parametrize("name,phase", [("telemetry", "telemetry"), ("results", "ddp")])
def test_a_forged_post_is_refused_and_named_and_nobody_blamed(tmp_path, name, phase):
    """While rank 1 waits before its own post, a client without the secret appends a post claiming rank 1 on
    node9. Rank 0 refuses it (it never stands in for rank 1's), names it, and blames nobody."""
    mark = tmp_path / "mark"
    procs, port = start(3, {"AIV_JOB_SECRET": SECRET, "AIV_FAILPOINT": f"pause=4:{phase}:1",
                            "AIV_FAILPOINT_MARK": mark, "AIV_JSON": tmp_path / "v.json"}, ["--skip-screen"])
    assert wait_for(mark.exists), describe(finish([p for p in procs if p.kill() or True]))
    store = forger(port)
    post = {"rank": 1, "host": "node9", "ar_ok": True, "ar_sum": 6, "grads": "0", "loss": 0.0}
    store.append(f"posts/{name}", json.dumps(post) + "\n")
    if store.add(f"posts/{name}/n", 1) == 3:
        store.set(f"posts/{name}/all", "1")
    out = finish(procs)
    v = judged(tmp_path, out)
    assert_forgery_named(v, out)
    assert any(ln.startswith(f"FAILURE: rendezvous: a {name} post claiming rank 1 did not carry the job's secret")
               for ln in v["failures"]), v["failures"]
    assert "node9" not in v["failed_hosts"] and "SUCCESS" not in out[0][1]


# ---------------------------------------------------------------- the node monitor without torch
@pytest.mark.parametrize("libuv", [True, False])
def test_the_monitors_client_speaks_torchs_store_protocol(libuv):
    import torch.distributed as dist
    port = free_port()
    srv = dist.TCPStore("127.0.0.1", port, None, True, datetime.timedelta(seconds=5), wait_for_workers=False,
                        use_libuv=libuv)
    torch_side = dist.PrefixStore("aiv", srv)
    torch_side.set("world", "w")
    light = aiv.monitor_store({"addr": "127.0.0.1", "port": port, "prefix": "aiv", "host": "n1"}, 5)
    assert isinstance(light, aiv.LightStore)
    assert light.check(["world"]) and light.get("world") == b"w" and not light.check(["world", "absent"])
    light.set("live/n1", "a|b|{}")  # a set or append has no answer: a round trip on its connection orders it
    assert light.check(["live/n1"]) and torch_side.get("live/n1") == b"a|b|{}"
    assert light.compare_set("live/n1", "a|b|{}", "x") == b"x" and light.compare_set("live/n1", "no", "y") == b"x"
    light.append("forged", "1\n")
    light.append("forged", "2\n")
    assert light.check(["forged"]) and torch_side.get("forged") == b"1\n2\n"
    light.close()


def test_the_monitor_takes_torchs_client_where_its_own_does_not_see_rank0s_record():
    import torch.distributed as dist
    port = free_port()
    srv = dist.TCPStore("127.0.0.1", port, None, True, datetime.timedelta(seconds=5), wait_for_workers=False)
    dist.PrefixStore("other", srv).set("world", "w")  # no world record under the monitor's prefix
    got = aiv.monitor_store({"addr": "127.0.0.1", "port": port, "prefix": "aiv", "host": "n1"}, 2)
    assert isinstance(got, dist.PrefixStore)


def test_a_node_monitor_that_finds_no_store_ends_within_its_connect_bound_without_torch():
    """A run that ended as its node monitor started: nothing listens on the port. Before, the monitor then
    imported torch for torch's own client and waited on it again: 15 s after its run on a loaded machine,
    a process left behind (CI's test_local_mode_passes[2]). Now the failed connect ends it."""
    cfg = {"addr": "127.0.0.1", "port": free_port(), "prefix": "aiv", "host": "n1", "ranks": [[0, os.getpid()]],
           "period": 0.2, "lifetime": 60, "run": "r"}
    code = ("import json, sys, time; sys.path.insert(0, sys.argv[2]); import ddp_mesh_ping as aiv\n"
            "t = time.monotonic()\n"
            "try:\n    aiv.node_monitor(json.loads(sys.argv[1]))\n"
            "except OSError as e:\n    print(type(e).__name__)\n"
            "print('torch' in sys.modules, round(time.monotonic() - t, 2))")
    out = subprocess.run([sys.executable, "-c", code, json.dumps(cfg), str(ROOT)], env=clean_env(),
                         capture_output=True, text=True, timeout=60)
    err, torch_imported, secs = out.stdout.split()
    assert err == "ConnectionRefusedError" and torch_imported == "False", out
    assert aiv.MONITOR_CONNECT_S - 0.5 < float(secs) < aiv.MONITOR_CONNECT_S + 2, out  # the bound, not more


def test_the_node_monitor_posts_without_importing_torch(tmp_path):
    """The monitor, as a process of its own, posts its ranks' liveness and never imports torch."""
    import torch.distributed as dist
    port = free_port()
    srv = dist.TCPStore("127.0.0.1", port, None, True, datetime.timedelta(seconds=5), wait_for_workers=False)
    p0 = aiv.StoreProtocol(dist.PrefixStore("aiv", srv), srv, "aiv")
    p0.publish_world(1)
    p0.prepare([{"rank": 0, "host": "n1", "pid": 1}])
    cfg = {"addr": "127.0.0.1", "port": port, "prefix": "aiv", "host": "n1", "ranks": [[0, 1]], "period": 0.2,
           "lifetime": 1, "run": p0.run}
    code = ("import json, sys; sys.path.insert(0, sys.argv[2]); import ddp_mesh_ping as aiv; "
            "aiv.node_monitor(json.loads(sys.argv[1])); print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code, json.dumps(cfg), str(ROOT)], env=clean_env(),
                         capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "False", out
    assert p0.live(["n1"])["n1"].get("ranks") == {"0": "running"}
