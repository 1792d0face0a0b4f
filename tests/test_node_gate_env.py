"""The node gate against faults of its own environment, not of the node, with real processes: a closed or broken
stdout or stderr, usage mistakes (the JSON and the metrics still written: assessed 0), a context word that is
none of the four, the lock (a foreign lock file, a health pass that will not let go, our own worker left on a
GPU), a --json path that blocks, every device busy; and the one bounded child helper, whose reap is bounded too.
Each: never exit 1 (npd: 2, never 0 for a node it did not judge), nothing drained, the metrics say not assessed."""
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest
from test_node_gate import fake_bin, fake_smi, path_with

from conftest import SCRIPT, aiv, clean_env

FAST = ["--expect-gpus", "0", "--skip-numerics", "--skip-screen"]
ROW = "0, GPU-aaaa, 00000000:1B:00.0, NVIDIA H100 80GB HBM3, 1, 81559, 0, No, No\n"

# a misspelled AIV_NODE_BUDGET, spelled in two parts so that the scan of the AIV_* names the repository uses
# (test_launch_hygiene) does not count it as one
MISSPELT = "AIV_NODE_" + "BUGDET"


def node():
    return f"ngenv-{uuid.uuid4().hex[:8]}"


def env_of(name, extra=None):
    return clean_env(dict({"SLURMD_NODENAME": name, "SLURM_CONF": "/nonexistent/slurm.conf"}, **(extra or {})))


def run(args, extra=None, name=None, shell_tail="", timeout=90, **kw):
    """The tool as Slurm or NPD would start it; shell_tail: redirections after the command (bash)."""
    cmd = " ".join(map(lambda a: "'" + str(a) + "'", [sys.executable, SCRIPT, *args])) + " " + shell_tail
    t = time.monotonic()
    r = subprocess.run(["bash", "-c", cmd], env=env_of(name or node(), extra), capture_output=True, text=True,
                       timeout=timeout, **kw)
    return r, time.monotonic() - t


def assessed(prom):
    (line,) = [ln for ln in Path(prom).read_text().splitlines() if ln.startswith("aiv_node_check_assessed{")]
    return int(line.rsplit(" ", 1)[1])


# ---------------------------------------------------------------------------- stdout and stderr
@pytest.mark.parametrize("tail", [">&-", "2>&-", ">&- 2>&-", ">/dev/full", "2>/dev/full"])
def test_a_healthy_prolog_with_its_streams_closed_or_full_exits_0(tmp_path, tail):
    jp = tmp_path / "v.json"
    r, _ = run(["--node-check", "prolog", *FAST, "--json", jp], {"SLURM_JOB_ID": "3"}, shell_tail=tail)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "Traceback" not in r.stderr and json.loads(jp.read_text())["verdict"] == "PASS"


def test_a_reader_gone_before_the_summary_exits_0(tmp_path):
    jp = tmp_path / "v.json"
    rd, wr = os.pipe()
    os.close(rd)  # nobody reads: every write is EPIPE
    try:
        p = subprocess.run([sys.executable, str(SCRIPT), "--node-check", "prolog", *FAST, "--json", str(jp)],
                           env=env_of(node(), {"SLURM_JOB_ID": "3"}), stdout=wr, stderr=wr, timeout=90)
    finally:
        os.close(wr)
    assert p.returncode == 0 and json.loads(jp.read_text())["exit_code"] == 0


# ---------------------------------------------------------------------------- usage mistakes
@pytest.mark.parametrize("args, extra, ctx, code", [
    (["--node-check", "helth"], {}, "unknown", 2),  # no Slurm script: NPD's unknown, never its OK
    (["--node-check", "helth"], {"SLURM_SCRIPT_CONTEXT": "prolog_slurmd", "SLURM_JOB_ID": "4"}, "prolog", 0),
    (["--node-check", "nPd"], {}, "npd", 2),
    (["--node-check", "nPd"], {"SLURM_JOB_ID": "4"}, "prolog", 0),  # a bare Prolog= of an older Slurm
    (["--node-check"], {MISSPELT: "10"}, "health", 0),
    (["--node-check", "npd", "--node-budget", "0"], {}, "npd", 2),
    (["--node-check", "prolog", "--node-budget", "0"], {}, "prolog", 0),
])
def test_a_usage_mistake_still_writes_not_assessed_json_and_metrics(tmp_path, args, extra, ctx, code):
    jp, prom = tmp_path / "v.json", tmp_path / "node.prom"
    r, _ = run([*args, "--json", jp, "--metrics", prom], extra)
    assert r.returncode == code and "FAILURE: usage:" in r.stderr, r.stdout + r.stderr
    assert "NOT ASSESSED" in r.stdout and len(r.stdout.splitlines()) == 1
    d = json.loads(jp.read_text())
    assert (d["verdict"], d["context"], d["exit_code"], d["drain"]["done"]) == ("NOT ASSESSED", ctx, code, False)
    assert assessed(prom) == 0 and f'aiv_node_check_exit_code{{context="{ctx}"}} {code}' in prom.read_text()
    from test_metrics import promtool
    promtool(prom.read_text())


def test_a_usage_mistake_finds_its_files_in_the_variables_too(tmp_path):
    prom = tmp_path / "node.prom"
    r, _ = run(["--node-check", "npd"], {"AIV_METRICS": prom, MISSPELT: "10"})
    assert r.returncode == 2 and assessed(prom) == 0


def test_the_context_of_a_usage_error_is_read_without_the_parser():
    f = aiv.context_from_argv
    assert f(["--node-check", "helth"], {}) == "unknown" and f(["--node-check=NPD "], {}) == "npd"
    assert f(["--node-check", "x"], {"SLURM_SCRIPT_CONTEXT": "epilog_slurmd"}) == "epilog"
    assert f(["--node-check", "--json", "x"], {}) == "health" and f(["--json", "x"], {}) is None


# ---------------------------------------------------------------------------- the lock
def holder(lock, seconds_ignoring_term):
    """A stand-in for a health pass holding the lock (its command line says --node-check) that ignores SIGTERM
    for a while, and one of its device workers (our marker on its command line)."""
    code = ("import fcntl, os, signal, sys, time\n"
            "fd = os.open(sys.argv[1], os.O_CREAT | os.O_RDWR)\n"
            "fcntl.flock(fd, fcntl.LOCK_EX)\n"
            "os.write(fd, f'{os.getpid()} health\\n'.encode())\n"
            "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
            "print('held', flush=True)\n"
            f"time.sleep({seconds_ignoring_term})\n"
            "signal.signal(signal.SIGTERM, signal.SIG_DFL)\n"
            "time.sleep(60)\n")
    p = subprocess.Popen([sys.executable, "-c", code, str(lock), "--node-check", "health"], stdout=subprocess.PIPE,
                         text=True)
    assert p.stdout.readline() == "held\n"
    return p


def worker_like():
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)", aiv.WORKER_ARG])


def gate_env(tmp_path, pid, extra=None):
    fake_smi(tmp_path, ROW, f"{pid}, 1024, GPU-aaaa, python\n")
    calls = fake_bin(tmp_path, "scontrol", 'case "$1" in show) echo "NodeName=x State=IDLE" ;; esac; exit 0')
    return dict(path_with(tmp_path), SLURM_JOB_ID="7", SLURM_JOB_GPUS="0", **(extra or {})), calls


def not_assessed_nothing_drained(tmp_path, r, calls, code=0):
    d = json.loads((tmp_path / "v.json").read_text())
    assert r.returncode == code and d["verdict"] == "NOT ASSESSED", r.stdout + r.stderr
    updates = [c for c in calls.read_text().splitlines() if c.startswith("update")] if calls.exists() else []
    assert not d["drain"]["done"] and not updates and assessed(tmp_path / "v.prom") == 0
    return d


def test_a_health_pass_that_ignores_sigterm_beside_a_prolog_is_no_leftover(tmp_path):
    name = node()
    lock, why = aiv.node_lock_path(name)
    assert lock, why
    h, w = holder(lock, 10), worker_like()
    try:
        env, calls = gate_env(tmp_path, w.pid)
        r, secs = run(["--node-check", "prolog", "--drain", "on", "--skip-numerics", "--json", tmp_path / "v.json",
                       "--metrics", tmp_path / "v.prom"], env, name)
        d = not_assessed_nothing_drained(tmp_path, r, calls)
        (f,) = [f for f in d["findings"] if f["check"] == "gpu-procs"]
        assert f["unassessed"] and "did not let go within 5s" in f["reason"] and secs < d["budget_s"] + 5
        assert any("without the lock" in s for s in d["skipped"])
        assert h.poll() is None  # it ignored the SIGTERM it got (and its worker was not judged)
    finally:
        for p in (h, w):
            p.kill()
            p.wait()


def test_our_own_worker_left_on_a_gpu_is_not_a_leftover(tmp_path):
    w = worker_like()
    try:
        env, calls = gate_env(tmp_path, w.pid)
        r, _ = run(["--node-check", "prolog", "--drain", "on", "--skip-numerics", "--skip-screen", "--json",
                    tmp_path / "v.json", "--metrics", tmp_path / "v.prom"], env)
        d = not_assessed_nothing_drained(tmp_path, r, calls)
        assert f"a node check's own worker is still on GPU 0 (pid {w.pid})" in json.dumps(d["findings"])
    finally:
        w.kill()
        w.wait()


@pytest.fixture
def protected_regular():
    """fs.protected_regular=2 for the test (O_CREAT of another user's file in a sticky directory is refused,
    even to root), restored after."""
    path = Path("/proc/sys/fs/protected_regular")
    try:
        old = path.read_text().strip()
        path.write_text("2")
    except OSError as e:
        pytest.skip(f"fs.protected_regular cannot be set here ({e.strerror}): needs root outside a read-only /proc/sys")
    yield
    path.write_text(old)


def test_a_foreign_lock_file_under_a_jobs_tmpdir_is_not_the_lock(tmp_path, protected_regular):
    """Another user's file where the lock used to be (a job's TMPDIR, sticky and world-writable): the lock lives
    in a root-owned directory, so the prolog takes it and judges; pointed at that sticky directory itself
    (--node-lock-dir), no lock is taken: the GPU's processes are not judged, NOT ASSESSED, nothing drained."""
    if os.geteuid() != 0:
        pytest.skip("needs root (a file of another user)")
    name, sticky = node(), tmp_path / "jobtmp"
    sticky.mkdir()
    sticky.chmod(0o1777)
    foreign = sticky / f"aiv-node-check-{name}.lock"
    foreign.write_text("")
    os.chown(foreign, 65534, 65534)
    with pytest.raises(PermissionError):  # what the old lock met: fs.protected_regular=2 refuses it
        os.close(os.open(foreign, os.O_CREAT | os.O_RDWR))
    hog = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        env, calls = gate_env(tmp_path, hog.pid, {"TMPDIR": sticky})
        args = ["--node-check", "prolog", "--skip-numerics", "--skip-screen", "--json", tmp_path / "v.json",
                "--metrics", tmp_path / "v.prom"]
        r, _ = run(args, env, name)
        d = json.loads((tmp_path / "v.json").read_text())
        assert r.returncode == 1 and d["verdict"] == "FAIL", r.stdout + r.stderr  # judged: the lock was taken
        assert not [s for s in d["skipped"] if "lock" in s]
        (f,) = [f for f in d["findings"] if f["status"] == "FAIL"]
        assert f["check"] == "gpu-procs" and f["pids"] == [hog.pid]
        r, _ = run([*args, "--drain", "on", "--node-lock-dir", sticky], env, name)
        d = not_assessed_nothing_drained(tmp_path, r, calls)
        assert "not a directory that only uid 0 may write" in d["skipped"][0]
    finally:
        hog.kill()
        hog.wait()


# ---------------------------------------------------------------------------- outputs that hang
@pytest.mark.parametrize("ctx, code", [("npd", 2), ("health", 0)])
def test_a_json_path_that_blocks_ends_the_pass_on_time_not_assessed(tmp_path, ctx, code):
    """The pass ends within its budget by its own clock, and the process ends within 3 s of its verdict line (the
    writer blocked on the FIFO holds neither): measured from the tool's own start, not python's, whose start and
    import of torch take as long as the machine's load makes them."""
    fifo, prom = tmp_path / "v.json", tmp_path / "v.prom"
    os.mkfifo(fifo)  # no reader: opening it for writing blocks
    cmd = [sys.executable, SCRIPT, "--node-check", ctx, *FAST, "--node-budget", "6", "--json", fifo, "--metrics", prom]
    p = subprocess.Popen(cmd, env=env_of(node()), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    said, hang = None, threading.Timer(60, p.kill)  # (a pass held by its writer: killed, and failed below)
    hang.start()
    for line in p.stdout:  # (the verdict line, its last, is flushed as it is said; NPD's is its only one)
        said, verdict_at = line, time.monotonic()
    ended = time.monotonic()
    hang.cancel()
    err = p.stderr.read()
    assert p.wait(timeout=30) == code and said, (said, err)
    own = re.search(r"\(([\d.]+)s of 6s\)", said)  # (NPD's line has no clock)
    assert (own is not None) is (ctx == "health") and float(own.group(1) if own else 0) <= 6, (said, err)
    assert ended - verdict_at < 3, (ended - verdict_at, said, err)
    assert f"WARNING: output: {fifo} not written: not written within" in err
    assert "NOT ASSESSED" in said and assessed(prom) == 0


def test_a_json_fifo_with_a_reader_gets_the_verdict(tmp_path):
    fifo = tmp_path / "v.json"
    os.mkfifo(fifo)
    cat = subprocess.Popen(["cat", str(fifo)], stdout=subprocess.PIPE, text=True)
    r, _ = run(["--node-check", "health", *FAST, "--json", fifo])
    assert r.returncode == 0 and json.loads(cat.communicate(timeout=30)[0])["verdict"] == "PASS"


# ---------------------------------------------------------------------------- every device busy (issue 48)
def test_devices_present_none_judged_is_never_pass():
    busy = {"ids": [0], "busy": {0: "1 process(es) of others on it"}, "held": {}, "compute": []}
    (f,) = aiv.judge_none_judged("n1", busy)
    assert f["unassessed"] and f["check"] == "gpu-procs" and f["hosts"] == []
    assert aiv.node_verdict([aiv.finding("gpu-count", "PASS", "ok"), f], "health")["verdict"] == "NOT ASSESSED"
    assert aiv.node_verdict([f], "npd")["exit_code"] == 2
    assert aiv.judge_none_judged("n1", dict(busy, ids=[0, 1], compute=[1])) == []  # one judged: busy, not judged
    assert aiv.judge_none_judged("n1", {"ids": [], "busy": {}, "held": {}, "compute": []}) == []


@pytest.mark.parametrize("ctx, code", [("health", 0), ("npd", 2)])
def test_the_only_gpu_busy_with_a_process_is_not_assessed(tmp_path, ctx, code):
    """The GPU test's state on one GPU: a process of others on GPU 0 (a CUDA context left by an earlier test):
    nothing was computed on the node, so it is not a PASS."""
    hog = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        fake_smi(tmp_path, ROW, f"{hog.pid}, 1024, GPU-aaaa, python\n")
        jp, prom = tmp_path / "v.json", tmp_path / "v.prom"
        r, _ = run(["--node-check", ctx, "--json", jp, "--metrics", prom], path_with(tmp_path))
        d = json.loads(jp.read_text())
        assert r.returncode == code and d["verdict"] == "NOT ASSESSED", r.stdout + r.stderr
        assert d["devices"]["compute"] == [] and assessed(prom) == 0
        assert "every GPU busy, none judged" in r.stdout
    finally:
        hog.kill()
        hog.wait()


def test_every_cpu_worker_busy_by_slurms_gres_used_is_not_assessed(tmp_path):
    fake_bin(tmp_path, "scontrol", 'case "$1" in show) echo "NodeName=x Gres=(null) GresUsed=gpu:2(IDX:0-1) '
                                   'State=MIXED" ;; esac')
    r, _ = run(["--node-check", "health", "--expect-gpus", "0", "--json", tmp_path / "v.json"], path_with(tmp_path))
    d = json.loads((tmp_path / "v.json").read_text())
    assert r.returncode == 0 and d["verdict"] == "NOT ASSESSED" and set(d["devices"]["busy"]) == {"0", "1"}
    assert "every CPU worker busy, none judged" in r.stdout


# ---------------------------------------------------------------------------- the bounded child
def pipe_holder(tmp_path, then="sleep 60"):
    """A command that leaves a grandchild in a session of its own holding its stdout and stderr (out of reach of
    a kill of its process group), then `then`. -> (argv, file with the grandchild's pid)."""
    pidfile = tmp_path / f"grandchild-{uuid.uuid4().hex[:6]}"
    return ["bash", "-c", f"setsid sleep 60 & echo $! >> {pidfile}; echo started; {then}"], pidfile


def kill_pidfile(pidfile):
    for pid in pidfile.read_text().split() if pidfile.exists() else []:
        try:
            os.kill(int(pid), signal.SIGKILL)
        except (OSError, ValueError):
            pass


@pytest.mark.parametrize("then", ["sleep 60", "exit 0"])
def test_a_child_whose_pipe_outlives_its_kill_cannot_hold_a_bounded_call(tmp_path, then):
    argv, pidfile = pipe_holder(tmp_path, then)
    try:
        t = time.monotonic()
        r = aiv.run_bounded(argv, 1.0)
        secs = time.monotonic() - t
        assert secs < 1.0 + 2.0, secs
        assert "gave no answer within 1s" in r["unread"] and "still holds its output open" in r["unread"], r
    finally:
        kill_pidfile(pidfile)


def test_each_caller_goes_through_the_one_helper_within_its_bound(tmp_path, monkeypatch):
    argv, pidfile = pipe_holder(tmp_path)
    exe = tmp_path / "nvidia-smi"
    exe.write_text("#!/bin/bash\nexec " + " ".join(f"'{a}'" for a in argv) + "\n")
    exe.chmod(0o755)
    try:
        t = time.monotonic()
        assert "gave no answer within 1s" in aiv.read_node_smi(str(exe), 1.0)["unread"]
        assert time.monotonic() - t < 3.0
        t = time.monotonic()
        rc, _, msg = aiv._scontrol([str(exe)], time.monotonic() + 1.0)
        assert rc is None and "did not answer" in msg and time.monotonic() - t < 3.0
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL)
        t = time.monotonic()
        got = aiv.finish_import_probe(proc, 1.0)
        assert time.monotonic() - t < 3.0 and all(not v["ok"] for v in got.values())
    finally:
        kill_pidfile(pidfile)


def test_a_stopped_or_stuck_process_is_said_by_its_state():
    p = subprocess.Popen(["sleep", "60"])
    try:
        os.kill(p.pid, signal.SIGSTOP)
        for _ in range(100):
            if aiv.proc_state(p.pid) == "T":
                break
            time.sleep(0.02)
        assert aiv.proc_state(p.pid) == "T"
    finally:
        p.kill()
        p.wait()
    assert aiv.proc_state(p.pid) is None


def test_a_node_check_whose_nvidia_smi_leaves_its_pipe_held_ends_within_its_budget(tmp_path):
    argv, pidfile = pipe_holder(tmp_path)
    fake_bin(tmp_path, "nvidia-smi", "exec " + " ".join(f"'{a}'" for a in argv))
    try:
        r, secs = run(["--node-check", "npd", "--node-budget", "8", "--json", tmp_path / "v.json"],
                      path_with(tmp_path))
        d = json.loads((tmp_path / "v.json").read_text())
        assert r.returncode == 2 and secs < 8 + 3, (secs, r.stdout + r.stderr)
        assert "still holds its output open" in d["facts"]["smi_unread"]
    finally:
        kill_pidfile(pidfile)


def test_the_screens_nvidia_smi_under_load_goes_through_the_helper_too(tmp_path, monkeypatch):
    argv, pidfile = pipe_holder(tmp_path)
    exe = tmp_path / "nvidia-smi"
    monkeypatch.setattr(aiv.shutil, "which", lambda name: str(exe))
    monkeypatch.setattr(aiv, "SCREEN_SMI_S", 1.0)
    try:
        exe.write_text("#!/bin/bash\necho '1980, 1980, 0x0000000000000004, 45, 650.12'\n")
        exe.chmod(0o755)
        assert aiv.SmiProbe("GPU-x").finish(lambda: time.sleep(0.01))["sm_mhz"] == 1980.0
        exe.write_text("#!/bin/bash\nexec " + " ".join(f"'{a}'" for a in argv) + "\n")
        t = time.monotonic()
        assert aiv.SmiProbe("GPU-x").finish(lambda: time.sleep(0.01)) == {"smi_unread": 1.0}
        assert time.monotonic() - t < 1.0 + 2.0
    finally:
        kill_pidfile(pidfile)
