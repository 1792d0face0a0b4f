"""The runtime's rooms: one bound per phase (the only thing that arms the watchdog), store waits that
read only the store's own timeout as "not arrived", tool errors that blame no host, one owner of the
findings, helper threads that say when they die, and one schema for every rank's record."""
import ast
import datetime
import json
import sys
import threading
import time

import pytest
import torch.distributed as dist

from conftest import ROOT, aiv, clean_env, free_port, run_tool, spawn


# ---------------------------------------------------------------- the one bound
def test_only_the_bound_arms_the_watchdog():
    """Every arming of the watchdog goes through Bound.arm: a phase, the verdict, a follower's wait."""
    tree = ast.parse((ROOT / "ddp_mesh_ping.py").read_text())
    sites = []
    for cls in (n for n in tree.body if isinstance(n, ast.ClassDef)):
        for fn in (n for n in cls.body if isinstance(n, ast.FunctionDef)):
            for call in (n for n in ast.walk(fn) if isinstance(n, ast.Call)):
                f = call.func
                if isinstance(f, ast.Attribute) and f.attr == "arm" and isinstance(f.value, ast.Attribute) \
                        and f.value.attr == "wd":
                    sites.append(f"{cls.name}.{fn.name}")
    assert sites == ["Bound.arm"]


def test_bound_counts_left_restarts_and_arms_once():
    events = []
    wd = aiv.Watchdog(expire=lambda ph: events.append(ph), period=0.05)
    b = aiv.Bound(wd, "init", 0.4, grace=0.2)
    assert b.cause() == f"{aiv.PHASE_WHAT['init']} did not complete within 0.4s"
    with b:
        assert 0.3 < b.left() <= 0.4 and b.left(0.2) > b.left()
        time.sleep(0.3)
        b.restart()  # a gate rank 0 opened: the bound counts from here, still armed
        assert b.left() > 0.35
        time.sleep(0.3)
        assert events == []  # 0.6 s after arming, but only 0.3 s after the restart: not yet
        time.sleep(0.5)
    assert events == ["init"]
    assert b.left() == 0.0


def test_within_returns_raises_or_says_the_bound_passed():
    assert aiv.within(lambda: 7, 1) == 7
    with pytest.raises(KeyError):
        aiv.within(lambda: {}["x"], 1)
    stop = threading.Event()
    with pytest.raises(aiv.BoundPassed, match="writing --json x did not return within 0.2s"):
        aiv.within(lambda: stop.wait(5), 0.2, "writing --json x")
    stop.set()


def test_watchdog_expires_on_a_thread_of_its_own_so_a_later_bound_still_holds():
    """expire() can arm another bound (the verdict's) and block: that bound still fires."""
    fired, release = [], threading.Event()
    wd = None

    def expire(phase):
        fired.append(phase)
        if phase == "init":
            aiv.Bound(wd, "verdict", 0.2).arm()
            release.wait(3)
    wd = aiv.Watchdog(expire=expire, period=0.05)
    aiv.Bound(wd, "init", 0.1).arm()
    deadline = time.monotonic() + 3
    while "verdict" not in fired and time.monotonic() < deadline:
        time.sleep(0.02)
    release.set()
    assert fired == ["init", "verdict"]


# ---------------------------------------------------------------- store waits: the timeout only
@pytest.fixture
def proto():
    server = dist.TCPStore("127.0.0.1", 0, None, True, datetime.timedelta(seconds=10), wait_for_workers=False)
    p = aiv.StoreProtocol.open(dist, "127.0.0.1", server.port, 10, "aiv")
    p.world = 2
    yield p
    del server


def test_a_real_store_timeout_is_the_only_not_arrived(proto):
    try:
        proto.store.wait(["never"], datetime.timedelta(seconds=0.1))
    except Exception as e:
        assert aiv.store_timed_out(e), type(e)
    assert not aiv.store_timed_out(TypeError("wait timeout"))
    assert not aiv.store_timed_out(ConnectionResetError())
    assert proto.wait_all(0.1) is False
    assert proto.screen_wait("r1", 0.1) is False
    assert proto.wait_posts("telemetry", 0.1) == {}


@pytest.mark.parametrize("call", ["wait_all", "screen_wait", "wait_posts"])
def test_a_tool_error_inside_a_store_wait_is_raised_not_read_as_missing_ranks(proto, monkeypatch, call):
    """Before: any exception inside these waits was "not arrived", and the callers named ranks and hosts."""
    def broken(*a, **k):
        raise TypeError("the tool's own bug")
    monkeypatch.setattr(proto, "_wait", broken)
    with pytest.raises(TypeError):
        getattr(proto, call)(*(("r1", 0.1) if call != "wait_all" else (0.1,)))


# ---------------------------------------------------------------- findings: one owner
def test_findings_after_the_verdicts_snapshot_are_not_in_it_and_not_lost(capsys):
    f = aiv.Findings()
    f += [aiv.finding("layout", "PASS", "ok")]
    f.append(aiv.finding("numa", "WARN", "far", ["n1"]))
    snap = f.close()
    f += [aiv.finding("collective", "FAIL", "late", ["n2"])]
    assert [x["check"] for x in snap] == ["layout", "numa"] and len(f) == 2 and f.code() == 0
    assert "came after the verdict and is not part of it: collective: late" in capsys.readouterr().err


def test_findings_take_many_writers_without_loss():
    f = aiv.Findings()

    def add(i):
        for j in range(200):
            f.append(aiv.finding("local", "PASS", f"{i}.{j}"))
    ts = [threading.Thread(target=add, args=(i,)) for i in range(4)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert len({x["reason"] for x in f}) == 800


# ---------------------------------------------------------------- records: one schema
def test_rank_record_has_every_field_and_with_results_makes_new_records():
    rec = {"rank": 1, "host": "n1", "node": {"cpu": "x"}, "stray": 1}
    out = aiv.rank_record(rec)
    assert list(out) == list(aiv.RANK_FIELDS) and out["transport"] is None and "stray" not in out
    new = aiv.with_results([out], [{"rank": 1, "transport": ["IB"], "nccl_net": ["ib0"], "imports": {"tv": 1}}])
    assert new[0]["transport"] == ["IB"] and new[0]["node"] == {"cpu": "x", "imports": {"tv": 1}}
    assert out["transport"] is None and "imports" not in out["node"]  # the old record is untouched


def _ranks_keys(path):
    d = json.loads(path.read_text())
    return d, [sorted(r) for r in d["ranks"]]


def test_json_ranks_have_the_same_keys_wherever_the_run_stopped(tmp_path):
    want = sorted(aiv.RANK_FIELDS)
    ok, failed = tmp_path / "ok.json", tmp_path / "failed.json"
    out, _ = spawn(2, args=["--json", ok, "--skip-screen"])
    assert [rc for rc, _ in out] == [0, 0], out
    out, _ = spawn(2, args=["--json", failed, "--skip-screen", "--timeout", "10"],
                   env={"AIV_FAILPOINT": "die:collective:1"})
    assert out[0][0] in (aiv.EXIT_FAIL, aiv.EXIT_TIMEOUT), out[0][1]
    for path in (ok, failed):
        d, keys = _ranks_keys(path)
        assert keys and all(k == want for k in keys), (path.name, keys)
    assert _ranks_keys(failed)[0]["ranks"][0]["transport"] is None  # stopped before the DDP step: null


# ---------------------------------------------------------------- helper threads say when they die
def test_a_helper_thread_that_dies_is_in_the_report_and_the_run_goes_on(tmp_path):
    out, _ = spawn(2, args=["--skip-screen", "--json", tmp_path / "r.json"],
                   env={"AIV_FAILPOINT": "raise:helper-aiv-listener:1"})
    assert [rc for rc, _ in out] == [0, 0], out
    log = out[0][1]
    assert "SUCCESS: DDP Multi-Node AllReduce Ring Complete!" in log
    assert "[WARN] internal: rank 1" in log and "aiv-listener stopped: AssertionError" in log, log
    assert "helper thread aiv-listener stopped" in out[1][1]
    d = json.loads((tmp_path / "r.json").read_text())
    assert d["failed_hosts"] == [] and any(f["check"] == "internal" and f["status"] == "WARN" for f in d["findings"])


def test_a_tool_error_while_connecting_to_the_store_blames_no_host(tmp_path):
    """A TypeError inside the tool during the roll call is `internal` (exit 4), not 'cannot reach the master'."""
    port = free_port()
    env = clean_env({"RANK": 0, "LOCAL_RANK": 0, "WORLD_SIZE": 1, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port,
                     "AIV_FAILPOINT": "raise:rollcall:0"})
    import subprocess
    import sys
    r = subprocess.run([sys.executable, str(ROOT / "ddp_mesh_ping.py"), "--json", str(tmp_path / "r.json")],
                       env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == aiv.EXIT_INTERNAL, r.stdout + r.stderr
    d = json.loads((tmp_path / "r.json").read_text())
    assert d["failed_hosts"] == [] and "FAILURE: internal:" in r.stdout


def test_a_run_that_speaks_for_rank_0_leaves_no_marker_behind(tmp_path):
    """speak_once_per_node marks a node-local file so that one rank of a node speaks; the launch removes its
    markers when its ranks are gone (here: the local launcher), so runs leave nothing in TMPDIR."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    r = run_tool(["--nproc", "3", "--timeout", "5", "--skip-screen"], timeout=200,
                 env={"TMPDIR": tmp, "AIV_FAILPOINT": "die:collective:0"})  # (rank 0 gone: said in seconds)
    said = [ln for ln in r.stdout.splitlines() if ln.startswith("FAILURE: rendezvous: rank ") and "rank 0 (" in ln]
    assert r.returncode == aiv.EXIT_FAIL and len(said) == 1, r.stdout  # once for the node, not per rank
    assert not list(tmp.glob("aiv-*")), sorted(p.name for p in tmp.iterdir())


def test_a_rank_without_torch_ends_the_roll_call_in_seconds_naming_no_host(tmp_path):
    """Before: `internal` (a bug in the tool), exit 4, and rank 0 waited out the whole roll call (300 s)
    to end with failed_hosts []. Now: rank 1 tells rank 0 through the store's wire (no torch needed); the
    run ends at once with a `local` FAIL and the fix: exit 2, the launch's python, no host named (its node is
    not alone of several: test_last_call.py names a node that is)."""
    fake = tmp_path / "site"
    fake.mkdir()
    (fake / "torch.py").write_text("raise ModuleNotFoundError(\"No module named 'torch'\", name='torch')\n")
    out, secs = spawn(2, args=["--skip-screen", "--json", tmp_path / "r.json"], per_rank={1: {"PYTHONPATH": fake}},
                      timeout=150)
    assert [rc for rc, _ in out] == [aiv.EXIT_USAGE, aiv.EXIT_USAGE], out
    line = next(ln for ln in out[0][1].splitlines() if ln.startswith("FAILURE:"))
    assert line.startswith("FAILURE: local: rank 1 (") and "torch is not importable" in line
    assert "bootstrap_env.sh" in line and "no host is named" in line
    d = json.loads((tmp_path / "r.json").read_text())
    assert d["failed_hosts"] == [] and d["phases"].get("rollcall", 0) < 60
    assert sum(ln.startswith("FAILURE:") for ln in out[1][1].splitlines()) == 1  # said once, not twice


def test_a_requested_output_that_cannot_be_written_fails_the_run_on_stdout(tmp_path):
    """Before: an immutable --json at the end was a warning on stderr and exit 0."""
    import shutil
    import subprocess
    jp, page = tmp_path / "r.json", tmp_path / "r.html"
    jp.write_text("{}")
    if not shutil.which("chattr") or subprocess.run(["chattr", "+i", str(jp)], capture_output=True).returncode:
        pytest.skip("chattr +i is not available here (needs root and a filesystem that supports it)")
    try:
        out, _ = spawn(2, args=["--skip-screen", "--json", jp, "--html", page])
    finally:
        subprocess.run(["chattr", "-i", str(jp)], capture_output=True)
    rc0, log = out[0]
    assert rc0 == aiv.EXIT_FAIL, log
    # the verdict is decided once, after the files were tried: one `Verdict: FAIL exit=1` line, the output's
    # FAILURE line after it, no SUCCESS line; --verify-log refuses it
    lines = log.splitlines()
    fail = lines.index(next(ln for ln in lines if ln.startswith(f"FAILURE: output: --json {jp} could not be written")))
    (verdict,) = [i for i, ln in enumerate(lines) if ln.startswith("Verdict:")]
    assert lines[verdict].startswith("Verdict: FAIL exit=1") and verdict < fail and aiv.SUCCESS_LINE not in lines, log
    log_file = tmp_path / "run.log"
    log_file.write_text(log)
    r = subprocess.run([sys.executable, str(ROOT / "ddp_mesh_ping.py"), "--verify-log", str(log_file)],
                       capture_output=True, text=True, env=clean_env())
    assert r.returncode != 0 and "failure reported: FAILURE: output" in r.stdout + r.stderr, r.stdout + r.stderr
    assert jp.read_text() == "{}" and "output" in page.read_text()  # the page says what the log says


def test_each_bound_is_a_timer_of_its_own():
    """A heap of deadlines, not one slot: another thread's bound armed, disarmed or re-armed never touches
    this one (before: one slot, which a second Bound's disarm emptied, so the verdict's bound never fired)."""
    fired = []
    wd = aiv.Watchdog(expire=fired.append, period=0.05)
    verdict = aiv.Bound(wd, "verdict", 0.4).arm()
    phase = aiv.Bound(wd, "ddp", 5.0).arm()
    other = aiv.Bound(wd, "final", 0.1).arm()
    other.disarm()                                    # a second Bound's disarm: the others stay armed
    phase.restart()
    assert wd.armed() == ["verdict", "ddp"]
    deadline = time.monotonic() + 5
    while "verdict" not in fired and time.monotonic() < deadline:
        time.sleep(0.02)
    assert fired == ["verdict"] and wd.armed() == ["ddp"]
    phase.disarm()
    verdict.disarm()                                  # already fired: nothing happens
    assert wd.armed() == []


def test_the_tick_follows_the_newest_phase_bound_and_not_the_verdicts():
    ticks = []
    wd = aiv.Watchdog(expire=lambda name: None, tick=ticks.append, period=0.05)
    with aiv.Bound(wd, "init", 5.0):
        aiv.Bound(wd, "verdict", 5.0).arm()
        time.sleep(0.3)
    assert ticks and set(ticks) == {"init"}
    ticks.clear()
    time.sleep(0.2)
    assert ticks == []                                # the verdict's bound alone: no phase to tick


def test_the_watchdog_sleeps_between_its_deadlines():
    """A watchdog without a tick (every rank but 0) and one whose only bound is the verdict's wait on the
    nearest deadline: before, a tick time left in the past made them spin a core until the bound passed."""
    import resource
    for tick in (None, lambda phase: None):
        wd = aiv.Watchdog(expire=lambda name: None, tick=tick, period=0.05)
        b = aiv.Bound(wd, "init" if tick is None else "verdict", 30.0).arm()
        before = resource.getrusage(resource.RUSAGE_SELF)
        time.sleep(1.0)
        after = resource.getrusage(resource.RUSAGE_SELF)
        b.disarm()
        assert (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime) < 0.3
