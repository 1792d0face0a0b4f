"""Only the job speaks: the side channel (the TCPStore on MASTER_PORT) is signed with the job's secret.

A forger here is what the threat model says it is: a plain TCPStore client, in this test process, on the
run's real port, without the secret. It writes while rank 1 is paused inside a phase (the `pause`
failpoint), so the values land where the run reads them. Real ranks, real gloo, loopback only; each
rank is a node of its own (SLURMD_NODENAME), so that who is blamed is observable.
"""
import datetime
import json
import os
import socket
import subprocess
import sys
import threading
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import (
    SCRIPT,
    aiv,
    clean_env,
    describe,
    failures,
    finish,
    free_port,
    run_tool,
    tool_popen,
    tool_ranks,
    wait_for,
)

SECRET = "5d1c0ffee" * 8  # 72 characters: the tests' job secret


def start(world, env, args=(), port=None):
    port = port or free_port()
    envs = [clean_env({"RANK": r, "LOCAL_RANK": 0, "WORLD_SIZE": world, "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": port, "SLURMD_NODENAME": f"node{r + 1}", **env}) for r in range(world)]
    return tool_ranks(envs, ["--timeout", "30", "--rollcall-timeout", "30", *args], text=True,
                      stdout=subprocess.PIPE, stderr=subprocess.PIPE), port


def forger(port):
    """A plain TCPStore client on the run's port, under the run's key prefix: no secret."""
    import torch.distributed as dist
    raw = dist.TCPStore("127.0.0.1", port, None, False, datetime.timedelta(seconds=10))
    return dist.PrefixStore("aiv", raw)


def forge(store, kind, phase):
    """Write one forged value of `kind`, each claiming rank 1 on node9 (the host that must never be blamed)."""
    if kind == "record":  # the issue's exploit: rank 0's own record, edited to claim rank 1 on node9, checked in
        tag, run, body = store.get("id/0").decode().split("|", 2)
        rec = dict(json.loads(body), rank=1, host="node9", hostname="node9", pid=4242)
        store.set("id/1", f"{tag}|{run}|{json.dumps(rec)}")
        if store.add("arrived", 1) == 3:
            store.set("all_arrived", "1")
    elif kind == "stamp":
        store.set("stamp/1", "1")
    elif kind == "error":
        store.append("errors", json.dumps({"rank": 1, "phase": phase, "code": 1, "term": False, "internal": False,
                                           "line": "FAILURE: collective: rank 1 (node9): NIC down"}) + "\n")
        store.add("nerr", 1)
    elif kind == "live":
        store.set("live/node2", json.dumps({"seq": 10 ** 6, "ranks": {"1": "gone"}}))
    elif kind == "screen":
        store.append("screen/gpu", json.dumps({"rank": 1, "host": "node9", "tflops": 0.001, "mem_gbs": 0.001}) + "\n")
    elif kind == "verdict":
        store.set("verdict", "0")
    else:
        raise AssertionError(kind)


def judged(tmp_path, out):
    js = tmp_path / "v.json"
    assert js.exists(), describe(out)
    return json.loads(js.read_text())


def assert_forgery_named(v, out, what="did not carry the job's secret"):
    """Never a PASS, nobody blamed (node9 least of all), the forgery named on rank 0's FAILURE lines."""
    assert v["verdict"] == "FAIL" and v["exit_code"] != 0, describe(out)
    assert v["failed_hosts"] == [] and v["exclude"] == "", v
    lines = [ln for ln in v["failures"] if what in ln]
    assert lines, describe(out)
    assert all("something outside the job writes to MASTER_PORT (127.0.0.1:" in ln for ln in lines), lines
    assert all(rc != 0 for rc, _, _ in out), describe(out)  # the forged verdict (0) decided no exit code


# ---------------------------------------------------------------- Seal, as plain data
@settings(max_examples=200, deadline=None)
@given(key=st.text(min_size=1, max_size=30).filter(lambda k: "|" not in k),
       body=st.text(max_size=200), flip=st.integers(min_value=0))
def test_a_sealed_value_opens_and_any_change_is_refused(key, body, flip):
    seal = aiv.Seal(SECRET.encode(), "77.0")
    seal.run = "77.0.abc"
    sealed = seal.seal(key, body)
    assert seal.unseal(key, sealed.encode()) == body
    i = flip % len(sealed)
    changed = sealed[:i] + ("x" if sealed[i] != "x" else "y") + sealed[i + 1:]
    with pytest.raises(aiv.Forged):
        seal.unseal(key, changed.encode())
    with pytest.raises(aiv.Forged):
        seal.unseal(key + "/other", sealed.encode())  # the key is signed: a value moved to another key is refused


def test_unsigned_wrong_secret_and_replayed_values_are_refused_with_their_reason():
    seal, other = aiv.Seal(SECRET.encode(), "77.0"), aiv.Seal(b"another-job's-secret-of-32-chars!!", "77.0")
    seal.run = other.run = "77.0.abc"
    with pytest.raises(aiv.Forged, match="did not carry the job's secret$"):
        seal.unseal("id/1", b'{"rank": 1}')
    with pytest.raises(aiv.Forged, match=r"did not carry the job's secret \(it is unsigned\)"):
        seal.unseal("id/1", aiv.Seal(None).seal("id/1", "{}", run="77.0.abc").encode())
    with pytest.raises(aiv.Forged, match="did not carry the job's secret$"):
        seal.unseal("id/1", other.seal("id/1", "{}").encode())
    earlier = seal.seal("id/1", "{}", run="77.0.fed")  # the same job and secret, an earlier roll call
    with pytest.raises(aiv.Forged, match=r"is a replay of another run \(run 77.0.fed, this is 77.0.abc\)"):
        seal.unseal("id/1", earlier.encode())
    with pytest.raises(aiv.Forged, match="another job or step"):
        seal.unseal("world", seal.seal("world", "{}", run="76.0.abc").encode(), world=True)
    open_ = aiv.Seal(None, "77.0")  # no secret: the run id is still checked
    open_.run = "77.0.abc"
    assert open_.unseal("id/1", seal.seal("id/1", "{}").encode()) == "{}"
    with pytest.raises(aiv.Forged, match="replay"):
        open_.unseal("id/1", earlier.encode())


def test_the_run_id_binds_job_step_and_rank0s_nonce():
    assert aiv.run_base({"SLURM_JOB_ID": "123", "SLURM_STEP_ID": "4"}) == "123.4"
    assert aiv.run_base({}) == ""
    assert aiv.Seal().authenticated is False and aiv.Seal(b"x" * 32).authenticated is True


def test_forgeries_are_named_by_what_they_claimed():
    forged = [{"key": "id/1", "why": "did not carry the job's secret", "claim": json.dumps({"host": "node9"})},
              {"key": "verdict", "why": "did not carry the job's secret (it is unsigned)", "claim": "0"}]
    fs = aiv.judge_forged(forged, "127.0.0.1:29500")
    assert [f["hosts"] for f in fs] == [[], []] and all(f["tamper"] for f in fs)
    assert fs[0]["reason"].startswith("a record for rank 1 (claiming host node9) did not carry the job's secret: "
                                      "something outside the job writes to MASTER_PORT (127.0.0.1:29500)")
    assert "the verdict (claiming exit code 0)" in fs[1]["reason"] and "without its AIV_JOB_SECRET" in fs[1]["reason"]
    many = aiv.judge_forged(forged * 5, "a:1")
    assert len(many) == 4 and "(6 more refused value(s) not shown)" in many[-1]["reason"]


def test_outside_connections_warn_when_authenticated_and_fail_naming_nobody_when_not():
    assert aiv.judge_store_peers({"10.0.0.2"}, {"10.0.0.2"}, True, "m:1") == []
    warn = aiv.judge_store_peers({"10.0.0.2", "10.9.9.9"}, {"10.0.0.2"}, True, "m:1")
    assert [f["status"] for f in warn] == ["WARN"] and "10.9.9.9" in warn[0]["reason"]
    fail = aiv.judge_store_peers({"10.9.9.9"}, {"10.0.0.2"}, False, "m:1")
    assert [(f["status"], f["hosts"], f["tamper"]) for f in fail] == [("FAIL", [], True)]


def test_store_peers_sees_who_connected_to_this_process():
    srv = socket.create_server(("127.0.0.1", 0))
    port = srv.getsockname()[1]
    with socket.create_connection(("127.0.0.1", port)):
        conn, _ = srv.accept()
        assert aiv.store_peers(port) == {"127.0.0.1"}
        conn.close()
    srv.close()
    assert aiv.norm_ip("0000:0000:0000:0000:0000:0000:0000:0001") == "::1"
    assert aiv.norm_ip("::ffff:10.1.2.3") == "10.1.2.3" and aiv.norm_ip("eth0") is None


def test_the_channel_is_judged_authenticated_or_warned_on_multi_node():
    assert [f["status"] for f in aiv.judge_channel(True, 2, "m:1")] == ["PASS"]
    assert [f["status"] for f in aiv.judge_channel(False, 2, "m:1")] == ["WARN"]
    assert aiv.judge_channel(False, 1, "m:1") == []


# ---------------------------------------------------------------- the protocol on a real store
def _pair():
    import torch.distributed as dist
    secret = SECRET.encode()
    server = dist.TCPStore("127.0.0.1", 0, None, True, datetime.timedelta(seconds=10), wait_for_workers=False)
    p0 = aiv.StoreProtocol.open(dist, "127.0.0.1", server.port, 10, "aiv", seal=aiv.Seal(secret, "9.0"))
    p1 = aiv.StoreProtocol.open(dist, "127.0.0.1", server.port, 10, "aiv", seal=aiv.Seal(secret, "9.0"))
    return server, p0, p1, forger(server.port)


def test_a_listener_waits_past_a_forged_verdict_for_rank0s_own():
    server, p0, p1, evil = _pair()
    p0.publish_world(2)
    assert p1.check_in(1, {"rank": 1, "host": "n2", "pid": 11}, 2, 5) is None
    evil.set("verdict", "0")
    got = []
    t = threading.Thread(target=lambda: got.append(p1.wait_verdict(5)))
    t.start()
    time.sleep(0.5)
    assert not got  # the forged 0 was not taken
    p0.publish_verdict(1)
    t.join(5)
    assert got == [1]
    assert [e["key"] for e in p0.forgeries()] == ["verdict"]  # rank 1 reported what it refused


def test_a_forged_claim_on_a_rank_is_refused_and_replaced_by_the_ranks_own():
    server, p0, p1, evil = _pair()
    p0.publish_world(2)
    evil.set("who/1", "pid 1 on node9")
    assert p1.check_in(1, {"rank": 1, "host": "n2", "pid": 11}, 2, 5) is None  # not a stray: it keeps its rank
    assert p1.seal.unseal("who/1", evil.get("who/1")) == "pid 11 on n2"
    assert [(e["key"], e["claim"]) for e in p0.forgeries()] == [("who/1", "pid 1 on node9")]


def test_the_audit_finds_a_value_nobody_read_again():
    server, p0, p1, evil = _pair()
    p0.publish_world(2)
    assert p0.check_in(0, {"rank": 0, "host": "n1", "pid": 10}, 2, 5) is None
    assert p1.check_in(1, {"rank": 1, "host": "n2", "pid": 11}, 2, 5) is None
    p0.prepare(p0.identities([0, 1]))
    p0.open_gate("phase/ddp")
    assert p0.audit([0, 1], ["n1", "n2"]) == []
    evil.set("stamp/1", "9")
    evil.set("gate/phase/ddp", "go")
    assert sorted(e["key"] for e in p0.audit([0, 1], ["n1", "n2"])) == ["gate/phase/ddp", "stamp/1"]


def test_nothing_on_the_side_channel_is_unpickled():
    src = SCRIPT.read_text()
    assert "json.loads" in (SCRIPT.parent / "aiv" / "run" / "store.py").read_text()
    for word in ("import pickle", "pickle.load", "torch.load", "marshal", "eval(", "exec("):
        assert word not in src, word


# ---------------------------------------------------------------- forgers against real runs
FORGE_PHASES = ["rendezvous", "init", "screen-gpu", "collective", "ddp"]


@pytest.mark.parametrize("phase", FORGE_PHASES)
def test_a_forger_at_each_phase_is_named_and_nobody_blamed(tmp_path, phase):
    """While rank 1 waits inside `phase`, the forger writes a roll-call record, a stamp, an error line, a
    liveness post, a screen post and the verdict key (exit 0). The run FAILs naming the forgery."""
    mark = tmp_path / "mark"
    procs, port = start(3, {"AIV_JOB_SECRET": SECRET, "AIV_FAILPOINT": f"pause=4:{phase}:1",
                            "AIV_FAILPOINT_MARK": mark, "AIV_JSON": tmp_path / "v.json"})
    assert wait_for(mark.exists), describe(finish([p for p in procs if p.kill() or True]))
    store = forger(port)
    for kind in ("record", "stamp", "error", "live", "screen", "verdict"):
        if kind == "record" and phase != "rendezvous":
            store.set("id/1", store.get("id/0").decode().replace('"node1"', '"node9"'))
        else:
            forge(store, kind, phase)
    out = finish(procs)
    v = judged(tmp_path, out)
    assert_forgery_named(v, out)
    assert "node9" not in v["failed_hosts"] and "SUCCESS" not in out[0][1]


@pytest.mark.parametrize("kind,phase", [("record", "rendezvous"), ("stamp", "collective"), ("error", "collective"),
                                        ("live", "collective"), ("screen", "screen-gpu"), ("verdict", "ddp")])
def test_each_kind_of_forged_value_alone_is_named(tmp_path, kind, phase):
    mark = tmp_path / "mark"
    procs, port = start(3, {"AIV_JOB_SECRET": SECRET, "AIV_FAILPOINT": f"pause=3:{phase}:1",
                            "AIV_FAILPOINT_MARK": mark, "AIV_JSON": tmp_path / "v.json"})
    assert wait_for(mark.exists), describe(finish([p for p in procs if p.kill() or True]))
    forge(forger(port), kind, phase)
    out = finish(procs)
    v = judged(tmp_path, out)
    assert_forgery_named(v, out)
    if kind == "record":  # the measurement: this used to be "rank 1 (node9) unreachable", node9 excluded
        assert any(ln.startswith("FAILURE: rendezvous: a record for rank 1 (claiming host node9) did not carry the "
                                 "job's secret") for ln in v["failures"]), v["failures"]


def test_a_record_replayed_from_an_earlier_run_is_refused(tmp_path):
    """Run A (the same secret, as a reused export under torchrun would give) passes; its rank 1 record,
    captured off the store, is written into run B while B's rank 1 has not checked in yet."""
    mark = tmp_path / "mark"
    procs, port = start(2, {"AIV_JOB_SECRET": SECRET, "AIV_FAILPOINT": "pause=3:init:1", "AIV_FAILPOINT_MARK": mark,
                            "AIV_JSON": tmp_path / "a.json"}, ("--skip-screen",))
    assert wait_for(mark.exists), describe(finish([p for p in procs if p.kill() or True]))
    captured = forger(port).get("id/1")
    out = finish(procs)
    assert out[0][0] == 0, describe(out)
    mark.unlink()
    procs, port = start(2, {"AIV_JOB_SECRET": SECRET, "AIV_FAILPOINT": "pause=3:rendezvous:1",
                            "AIV_FAILPOINT_MARK": mark, "AIV_JSON": tmp_path / "v.json"}, ("--skip-screen",))
    assert wait_for(mark.exists), describe(finish([p for p in procs if p.kill() or True]))
    store = forger(port)
    store.set("id/1", captured)
    if store.add("arrived", 1) == 2:
        store.set("all_arrived", "1")
    out = finish(procs)
    v = judged(tmp_path, out)
    assert_forgery_named(v, out, what="is a replay of another run")


def test_a_secret_less_rank_in_an_authenticated_run_is_named_not_blamed(tmp_path):
    procs, port = start(2, {"AIV_JOB_SECRET": SECRET, "AIV_JSON": tmp_path / "v.json"}, ("--skip-screen",))
    procs[1].kill()  # rank 1 again, without the secret
    procs[1].communicate()
    e = clean_env({"RANK": 1, "LOCAL_RANK": 0, "WORLD_SIZE": 2, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port,
                   "SLURMD_NODENAME": "node2"})
    procs[1] = tool_popen(["--timeout", "30", "--skip-screen"], env=e, fork=procs[0].forked, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    out = finish(procs)
    v = judged(tmp_path, out)
    assert_forgery_named(v, out, what="did not carry the job's secret (it is unsigned)")
    assert any("without its AIV_JOB_SECRET" in ln for ln in v["failures"]), v["failures"]


# ---------------------------------------------------------------- with and without a secret
def test_without_a_secret_a_multi_node_run_passes_with_a_warning(tmp_path):
    procs, _ = start(2, {"AIV_JSON": tmp_path / "v.json"}, ("--skip-screen",))
    out = finish(procs)
    v = judged(tmp_path, out)
    assert (v["verdict"], [rc for rc, _, _ in out]) == ("PASS", [0, 0]), describe(out)
    warn = [f for f in v["findings"] if f["status"] == "WARN" and f["check"] == "rendezvous"]
    assert len(warn) == 1 and warn[0]["reason"].startswith("side channel not authenticated: AIV_JOB_SECRET is not set")


def test_with_the_secret_a_multi_node_run_passes_authenticated(tmp_path):
    procs, _ = start(2, {"AIV_JSON": tmp_path / "v.json", "AIV_JOB_SECRET": SECRET}, ("--skip-screen",))
    out = finish(procs)
    v = judged(tmp_path, out)
    assert (v["verdict"], [rc for rc, _, _ in out]) == ("PASS", [0, 0]), describe(out)
    assert any(f["status"] == "PASS" and f["reason"].startswith("side channel authenticated") for f in v["findings"])
    assert not [f for f in v["findings"] if f["status"] == "WARN" and f["check"] == "rendezvous"], v["findings"]


def _cmdlines_and_environ(pids):
    cmd, env = {}, {}
    for pid in pids:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                c = f.read()
            with open(f"/proc/{pid}/environ", "rb") as f:
                e = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
        except OSError:  # a short-lived child (the import probe) that has ended
            continue
        cmd[pid], env[pid] = c, e
    return cmd, env


def _children(pid):
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        try:
            tasks = os.listdir(f"/proc/{p}/task")
        except OSError:
            continue
        for task in tasks:
            try:
                with open(f"/proc/{p}/task/{task}/children") as f:
                    kids = [int(x) for x in f.read().split()]
            except OSError:
                continue
            out += kids
            todo += kids
    return out


def test_the_secret_appears_nowhere(tmp_path):
    """Local mode makes its own secret: read off a rank's environment while the run waits, it must not be
    on any command line (ps), in stdout, stderr, the JSON or the manifest."""
    mark = tmp_path / "mark"
    env = clean_env({"AIV_FAILPOINT": "pause=3:init:1", "AIV_FAILPOINT_MARK": mark})
    launcher = subprocess.Popen([sys.executable, str(SCRIPT), "--nproc", "2", "--skip-screen", "--json",
                                 str(tmp_path / "v.json"), "--save-manifest", str(tmp_path / "m.json")],
                                env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert wait_for(mark.exists), launcher.kill() or launcher.communicate()
    cmd, environ = _cmdlines_and_environ([launcher.pid, *_children(launcher.pid)])
    secrets = {e.get(b"AIV_JOB_SECRET") for e in environ.values()} - {None}
    assert len(secrets) == 1, environ.keys()  # every rank (and monitor) shares one secret; the launcher has none
    secret = secrets.pop()
    assert len(secret) == 64 and b"AIV_JOB_SECRET" not in environ[launcher.pid]
    ps = subprocess.run(["ps", "-eo", "args", "ww"], capture_output=True).stdout
    assert secret not in ps and not any(secret in c for c in cmd.values())
    o, e = launcher.communicate(timeout=120)
    assert launcher.returncode == 0, o + e
    for text in (o, e, (tmp_path / "v.json").read_text(), (tmp_path / "m.json").read_text()):
        assert secret.decode() not in text
    assert "AIV_JOB_SECRET" not in json.loads((tmp_path / "v.json").read_text())["env"]


def test_a_weak_secret_is_a_usage_error_that_never_shows_it():
    r = run_tool(["--nproc", "2"], env={"AIV_JOB_SECRET": "hunter2"})
    assert r.returncode == 2 and failures(r.stdout + r.stderr)
    assert "hunter2" not in r.stdout + r.stderr and "fewer than 32" in r.stdout + r.stderr
