"""Launch hygiene with real processes: a reader that goes away, the local launcher killed, what a run
leaves in /tmp, the roll call's identity checks, a foreign listener on MASTER_PORT, unknown variables."""
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import psutil

from conftest import ROOT, SCRIPT, aiv, clean_env, failures, free_port, run_tool, spawn, state, wait_for

SUCCESS_LINE = aiv.SUCCESS_LINE


def test_dead_stdout_never_stops_the_run(tmp_path):
    """Local mode piped into `head -3`: no traceback, the JSON is written, the exit code is the verdict."""
    jp = tmp_path / "v.json"
    tool = subprocess.Popen([sys.executable, str(SCRIPT), "--nproc", "2", "--skip-screen", "--json", str(jp)],
                            env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    head = subprocess.run(["head", "-3"], stdin=tool.stdout, capture_output=True, timeout=300)
    tool.stdout.close()
    _, err = tool.communicate(timeout=300)
    err = err.decode(errors="replace")
    assert len(head.stdout.decode().splitlines()) == 3
    assert tool.returncode == 0, err
    assert "Traceback" not in err and "BrokenPipe" not in err, err
    assert json.loads(jp.read_text())["verdict"] == "PASS"


# ---------------------------------------------------------------------------- the roll call's identity checks
def _fails(res):
    return [ln for _, out in res for ln in out.splitlines() if ln.startswith("FAILURE:")]


def test_two_processes_with_one_rank_fail_naming_both():
    """Rank 0 and two processes with RANK=1: never '2/2 checked in', PASS. Rank 0 starts its collective 10 s
    late, so that the second RANK=1 (started with the others, but last) checks in before a run with forked
    ranks (well under a second) is over."""
    res, _ = spawn(2, ranks=[0, 1, 1], args=["--skip-screen", "--rollcall-timeout", 60],
                   env={"AIV_FAILPOINT": "skew=10:collective:0"})
    assert res[0][0] == 1 and all(rc != 0 for rc, _ in res), res
    (line,) = [ln for ln in failures(res[0][1]) if "claimed twice" in ln]
    assert line.startswith("FAILURE: rendezvous: a process with RANK=1 (pid ") and "first by pid " in line
    assert SUCCESS_LINE not in res[0][1]


def test_a_rank_beyond_the_world_is_named():
    """A stray RANK=2 launched with WORLD_SIZE=3 joins a 2-rank run: all three FAIL, rank 0 names it: at
    the roll call, or at the verdict when the stray checked in after the roll call closed (rank 0 starts its
    collective 10 s late, so that the stray, started last, checks in before a run of forked ranks is over)."""
    res, secs = spawn(2, ranks=[0, 1, 2], per_rank={2: {"WORLD_SIZE": 3}}, args=["--rollcall-timeout", 60],
                      env={"AIV_FAILPOINT": "skew=10:collective:0"})
    assert [rc for rc, _ in res] == [1, 1, 1], res
    (line,) = failures(res[0][1])
    assert line.startswith("FAILURE: world-size: a process with RANK=2 (pid ")
    assert "RANK=2 is not a rank of rank 0's world of 2; it was launched with WORLD_SIZE=3" in line
    assert secs < 45  # named long before the roll call's 60 s bound


def test_ranks_that_disagree_on_world_size_are_named_not_waited_out():
    res, secs = spawn(2, per_rank={1: {"WORLD_SIZE": 3}}, args=["--rollcall-timeout", 60])
    assert [rc for rc, _ in res] == [1, 1], res
    (line,) = failures(res[0][1])
    assert line.startswith("FAILURE: world-size: a process with RANK=1 (pid ")
    assert "it was launched with WORLD_SIZE=3, rank 0 with WORLD_SIZE=2" in line
    assert secs < 45


def test_stray_reason():
    assert aiv.stray_reason(1, 2, 2, None) is None
    assert aiv.stray_reason(1, 2, 2, "pid 7 on a")[0] == "rendezvous"
    assert aiv.stray_reason(2, 3, 2, None)[0] == "world-size"
    assert aiv.stray_reason(1, 3, 2, "pid 7 on a") == ("world-size", "it was launched with WORLD_SIZE=3, rank 0 "
                                                                     "with WORLD_SIZE=2")


# ---------------------------------------------------------------------------- unknown AIV_* variables
def test_a_misspelled_variable_is_a_usage_error_naming_the_closest():
    r = run_tool(["--nproc", 2], env={"AIV_TIMOUT": "5"}, timeout=60)
    assert r.returncode == 2, r.stdout + r.stderr
    assert failures(r.stdout) == ["FAILURE: usage: AIV_TIMOUT='5' is not a variable of ddp_mesh_ping.py "
                                  "(did you mean AIV_TIMEOUT?)"]
    assert "Traceback" not in r.stderr


def test_a_misspelled_secret_is_named_but_its_value_never_shown():
    secret = "5d1c0ffee" * 8
    r = run_tool(["--nproc", 2], env={"AIV_JOB_SECRT": secret}, timeout=60)
    assert r.returncode == 2 and failures(r.stdout) == ["FAILURE: usage: AIV_JOB_SECRT=(value not shown) is not a "
                                                        "variable of ddp_mesh_ping.py (did you mean AIV_JOB_SECRET?)"]
    assert secret not in r.stdout + r.stderr


def test_variables_of_the_batch_file_bootstrap_tests_and_bench_are_known():
    """OWNED_VARS is exactly the AIV_* names the repository uses beyond the options: it cannot drift."""
    files = [ROOT / "ddp_mesh_ping.py", ROOT / "submit_smoke_test.sbatch", ROOT / "bootstrap_env.sh",
             ROOT / ".ci" / "run", *(ROOT / "tests").glob("*.sh"), *(ROOT / "tests").glob("test_*.py"),
             *(ROOT / "bench").iterdir()]
    files = [f for f in files if f.name != "test_launch_hygiene.py"]
    used = {m for f in files for m in re.findall(r"\bAIV_[A-Z0-9_]*[A-Z0-9]\b", f.read_text(errors="replace"))}
    options = {a.env for a in aiv.build_parser()._actions if getattr(a, "env", None)}
    owned = {v for names in aiv.OWNED_VARS.values() for v in names}
    assert used - options - set(aiv.REMOVED_VARS) == owned
    values = {v: "1" * (aiv.SECRET_MIN if v == aiv.SECRET_VAR else 1) for v in owned}
    assert aiv.plan([], values) is not None  # none of them is refused


def test_the_batch_files_time_limit_covers_the_worst_case():
    """--time above the worst case with the default bounds and --bandwidth, the other ranks' wait for
    rank 0 and the step's grace and kill wait: a hung run is named before Slurm kills the job."""
    text = (ROOT / "submit_smoke_test.sbatch").read_text()
    h, m, s = map(int, re.search(r"^#SBATCH --time=(\d+):(\d\d):(\d\d)$", text, re.M).groups())
    grace = int(re.search(r"^AIV_STEP_GRACE=\$\{AIV_STEP_GRACE:-(\d+)\}$", text, re.M).group(1))
    kill = int(re.search(r"^AIV_STEP_KILL_WAIT=\$\{AIV_STEP_KILL_WAIT:-(\d+)\}$", text, re.M).group(1))
    worst = aiv.worst_case(aiv.deadlines(aiv.TIMEOUT_DEFAULT, aiv.ROLLCALL_DEFAULT), bandwidth=True)
    assert h * 3600 + m * 60 + s >= worst + aiv.RANK0_GRACE + grace + kill + 60  # a minute to start python
    readme = (ROOT / "docs" / "slurm.md").read_text()  # the operator's guide states both
    assert f"--time={h:02d}:{m:02d}:{s:02d}" in readme and "--time=00:15:00" not in readme
    assert f"`AIV_TIMEOUT` (seconds per distributed phase, default {aiv.TIMEOUT_DEFAULT:g})" in readme


# ---------------------------------------------------------------------------- a foreign listener on MASTER_PORT
def test_a_listener_that_never_answers_is_named_within_the_bound():
    """Something accepts on MASTER_PORT and never answers: the client rank names it (rc 3) within the roll
    call's bound + NAMING_S of its store connection, long before the bound + RANK0_GRACE backstop. Its store
    connection is the one it holds open to the end; the others are its hellos from before its import of
    torch, each given up after a second (so the bound is counted from the store connection, whatever the
    import of torch took on a loaded machine)."""
    conns = []  # [accepted, closed by the rank or None]
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(16)

    def hold(c, life):  # never answered; reads until the rank closes it
        with c:
            while c.recv(4096):
                pass
        life[1] = time.monotonic()

    def accept():
        while True:
            try:
                c, _ = srv.accept()
            except OSError:
                return
            conns.append([time.monotonic(), None])
            threading.Thread(target=hold, args=(c, conns[-1]), daemon=True).start()
    threading.Thread(target=accept, daemon=True).start()
    R, port = 20, srv.getsockname()[1]
    res, _ = spawn(2, ranks=[1], port=port, args=["--rollcall-timeout", R], timeout=120)
    done = time.monotonic()
    srv.close()
    rc, out = res[0]
    assert rc == 3, out
    (line,) = failures(out)
    assert line.startswith("FAILURE: rendezvous: rank 1 (") and f"something on MASTER_PORT (127.0.0.1:{port})" in line
    assert "accepts connections but does not answer as the job's store" in line, line
    wait_for(lambda: all(c[1] is not None for c in conns), 10)  # the rank has exited: every connection closes
    first = max(conns, key=lambda c: c[1] - c[0])  # the store connection: held longest
    print(f"named {done - first[0]:.1f}s after the store connection ({len(conns)} connections)")
    assert done - first[0] < R + aiv.NAMING_S + 5  # generous: + 5 s for the exit on a loaded machine


# ---------------------------------------------------------------------------- the local launcher killed
def _start_paused(tmp_path):
    """Local mode, 2 ranks, rank 0 paused in init (after the roll call): -> (launcher, its ranks, json)."""
    mark, jp = tmp_path / "mark", tmp_path / "v.json"
    env = clean_env({"AIV_FAILPOINT": "pause=120:init:0", "AIV_FAILPOINT_MARK": mark})
    p = subprocess.Popen([sys.executable, str(SCRIPT), "--nproc", "2", "--skip-screen", "--json", str(jp)],
                         env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    end = time.monotonic() + 120
    while not mark.exists() and time.monotonic() < end and p.poll() is None:
        time.sleep(0.1)
    assert mark.exists(), p.communicate()[0]
    ranks = [c for c in psutil.Process(p.pid).children() if c.cmdline()[1:2] == [str(SCRIPT)]]
    assert len(ranks) == 2
    return p, ranks, jp


def test_sigterm_to_the_launcher_reaches_its_ranks_and_it_exits_with_their_verdict(tmp_path):
    p, ranks, jp = _start_paused(tmp_path)
    p.send_signal(signal.SIGTERM)
    out, _ = p.communicate(timeout=60)
    assert not any(state(r) not in (psutil.STATUS_ZOMBIE, "gone") for r in ranks), out
    d = json.loads(jp.read_text())  # rank 0's verdict on the interrupted run
    assert d["verdict"] == "FAIL" and p.returncode == d["exit_code"] != 0, out
    assert "interrupted by SIGTERM" in out and "Traceback" not in out


def test_a_one_rank_local_run_gets_its_whole_bound_from_the_launcher():
    """One rank and no others: the launcher's short end-game (rank 0 reporting, the others gone) must not
    start at launch. It did: a one-GPU run slower than 15 s (NAMING_S + ACKS_S + 5) was killed, exit 3."""
    t = time.monotonic()
    r = run_tool(["--nproc", 1, "--skip-screen", "--timeout", 60], env={"AIV_FAILPOINT": "pause=16:collective:0"},
                 timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert aiv.SUCCESS_LINE in r.stdout and time.monotonic() - t > 16


def test_ranks_die_with_a_killed_launcher(tmp_path):
    p, ranks, _ = _start_paused(tmp_path)
    p.kill()
    p.communicate(timeout=30)
    gone, alive = psutil.wait_procs(ranks, timeout=60)
    assert not alive, alive


# ---------------------------------------------------------------------------- what a run leaves in /tmp
def test_two_immediate_re_runs_on_one_port_both_speak_and_write_json(tmp_path):
    """Rank 0 dies in the collective: rank 1 speaks for it and leaves the JSON, on every run, even from the
    same parent process on the same port (the node's 'said' marker is this run's only)."""
    port = free_port()
    for i in range(2):
        jp = tmp_path / f"v{i}.json"
        res, _ = spawn(2, port=port, env={"AIV_FAILPOINT": "die:collective:0"}, args=["--skip-screen", "--json", jp])
        (rc0, _), (rc1, out1) = res
        assert rc1 == 3 and any("rank 0" in ln for ln in failures(out1)), (i, out1)
        assert json.loads(jp.read_text())["written_by"].startswith("rank 1 "), i


def test_a_monitor_of_an_ended_run_never_posts_into_the_next_one():
    import datetime

    import torch.distributed as dist
    server = dist.TCPStore("127.0.0.1", 0, None, True, datetime.timedelta(seconds=10), wait_for_workers=False)
    p0 = aiv.StoreProtocol.open(dist, "127.0.0.1", server.port, 10, "aiv")
    p0.publish_world(1)
    p0.store.set("live/n1", "{}")
    me = [0, os.getpid(), (aiv.proc_stat(os.getpid()) or ("", ""))[1]]
    cfg = {"addr": "127.0.0.1", "port": server.port, "prefix": "aiv", "host": "n1", "ranks": [me],
           "period": 0.1, "lifetime": 0.3}
    assert aiv.node_monitor(dict(cfg, run="an-earlier-run")) == 0 and p0.live(["n1"]) == {"n1": {}}
    assert aiv.node_monitor(dict(cfg, run=p0.run)) == 0 and p0.live(["n1"])["n1"]["ranks"] == {"0": "running"}
