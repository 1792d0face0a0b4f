"""The tests' fork server (tests/fork_server.py): a forked child ends, talks and is waited on as the plain
Popen of `python SCRIPT ARGS` would, and a start it cannot reproduce is a plain Popen."""
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import time

import fork_server as forks
import fork_task
import pytest

from conftest import SCRIPT, clean_env, tool_popen

PROBE = r'''
import json, os, sys, tempfile, time
what = sys.argv[1]
if what == "report":
    with open(f"/proc/{os.getpid()}/cmdline", "rb") as f:
        cmd = [a.decode() for a in f.read().rstrip(b"\0").split(b"\0")]
    print(json.dumps({"argv": sys.argv, "cwd": os.getcwd(), "x": os.environ.get("FORK_X"),
                      "getenv_x": os.getenv("FORK_X"), "home_gone": "FORK_GONE" not in os.environ,
                      "tmp": tempfile.gettempdir(), "name": __name__, "file": __file__, "path0": sys.path[0],
                      "cmdline": cmd, "sid": os.getsid(0), "pid": os.getpid(), "umask": os.umask(0),
                      "line": sys.stdin.readline(), "ppid": os.getppid(), "torch": "torch" in sys.modules,
                      "orig": sys.orig_argv, "hostname": os.uname().nodename,
                      "hosts": open("/etc/hosts").read(), "path1": sys.path[1],
                      "site": getattr(sys.modules.get("sitecustomize"), "MARK", None),
                      "extra": os.environ.get("FORK_EXTRA") and __import__("forkextra").VALUE,
                      "netns": os.readlink("/proc/self/ns/net"), "cpus": sorted(os.sched_getaffinity(0))}))
    print("to stderr", file=sys.stderr)
    sys.exit(3)
if what == "sleep":
    print("sleeping", flush=True)
    time.sleep(60)
if what == "nap":  # its pid, then a nap that a SIGTERM ends as python's default does
    print(os.getpid(), flush=True)
    time.sleep(60)
if what == "kill":
    os.kill(os.getpid(), 9)
if what == "raise":
    raise ValueError("from the probe")
if what == "message":
    sys.exit("a message")
if what in ("spawn", "spawn-threaded"):  # start `python PROBE report` as the tool's local launcher starts its ranks
    import subprocess, threading
    mark = sys.argv[3]
    if what == "spawn-threaded":  # as a node leader starts its monitor: its own threads running
        threading.Thread(target=time.sleep, args=(30,), daemon=True, name="busy").start()
    p = subprocess.Popen([sys.executable, __file__, "report"], env=dict(os.environ, **json.loads(sys.argv[2])),
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         start_new_session=True, preexec_fn=lambda: open(mark, "w").close())
    out, err = p.communicate("in\n", timeout=120)
    print(json.dumps({"rc": p.returncode, "child": json.loads(out), "err": err, "me": os.getpid(),
                      "marked": os.path.exists(mark)}))
'''


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    script = tmp_path_factory.mktemp("fork") / "probe.py"
    script.write_text(PROBE)
    s = forks.Server(script, clean_env())
    yield s
    s.stop()


def popen(server, what, env=None, **kw):
    kw = {"text": True, "stdout": subprocess.PIPE, "stderr": subprocess.PIPE, **kw}
    return forks.ToolPopen([sys.executable, server.script, what], server=server, env=env or clean_env(), **kw)


def test_a_forked_child_runs_as_python_script_would(server, tmp_path):
    env = clean_env({"FORK_X": "y", "TMPDIR": str(tmp_path)})
    os.environ["FORK_GONE"] = "1"  # in this process only: the child's environment is the request's, wholesale
    try:
        with popen(server, "report", env=env, cwd=tmp_path, stdin=subprocess.PIPE, start_new_session=True) as p:
            out, err = p.communicate("a line\n", timeout=120)
    finally:
        del os.environ["FORK_GONE"]
    assert p.forked, p.fallback
    assert (p.returncode, err) == (3, "to stderr\n")
    got = json.loads(out)
    assert got["argv"] == [server.script, "report"] and got["name"] == "__main__" and got["file"] == server.script
    assert got["cmdline"] == [sys.executable, server.script, "report"]  # /proc/<pid>/cmdline as Popen's
    assert (got["x"], got["getenv_x"], got["home_gone"]) == ("y", "y", True)
    assert (got["cwd"], got["tmp"], got["path0"]) == (str(tmp_path), str(tmp_path), os.path.dirname(server.script))
    assert got["sid"] == got["pid"] == p.pid and got["line"] == "a line\n"
    umask = os.umask(0)
    os.umask(umask)
    assert got["umask"] == umask


def test_a_signal_death_is_minus_the_signal(server):
    p = popen(server, "kill")
    assert p.forked and p.wait(timeout=120) == -signal.SIGKILL
    q = popen(server, "sleep")
    assert q.stdout.readline() == "sleeping\n"
    q.terminate()
    assert q.wait(timeout=60) == -signal.SIGTERM and q.poll() == -signal.SIGTERM


def test_wait_and_communicate_raise_timeout_expired(server):
    p = popen(server, "sleep")
    assert p.stdout.readline() == "sleeping\n"
    t = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired):
        p.wait(timeout=0.3)
    with pytest.raises(subprocess.TimeoutExpired):
        p.communicate(timeout=0.3)
    assert time.monotonic() - t < 30 and p.poll() is None
    p.kill()
    out, _ = p.communicate(timeout=60)
    assert p.returncode == -signal.SIGKILL


def test_an_uncaught_exception_and_an_exit_message_end_as_in_python(server):
    p = popen(server, "raise")
    _, err = p.communicate(timeout=120)
    assert p.returncode == 1 and err.startswith("Traceback") and "ValueError: from the probe" in err
    assert "fork_server" not in err and "runpy" not in err, err  # the script's frames only, as python shows
    q = popen(server, "message")
    _, err = q.communicate(timeout=120)
    assert (q.returncode, err) == (1, "a message\n")


@pytest.mark.parametrize("extra", [{"LD_PRELOAD": ""}, {"TORCH_CPP_LOG_LEVEL": "INFO"},
                                   {"OMP_NUM_THREADS": "7"}, {"TORCH_SHOW_CPP_STACKTRACES": "1"}])
def test_an_environment_torch_reads_at_import_is_a_plain_popen(server, extra):
    p = popen(server, "report", env=clean_env({"FORK_X": "z", **extra}), stdin=subprocess.DEVNULL)
    out, _ = p.communicate(timeout=120)
    assert not p.forked and "differs from the fork server's" in p.fallback
    assert p.returncode == 3 and json.loads(out)["x"] == "z"


def test_what_a_fork_cannot_reproduce_is_a_plain_popen(server, tmp_path):
    other = forks.ToolPopen(["/bin/sh", "-c", "exit 4"], server=server)
    assert (other.wait(timeout=60), other.forked, other.fallback) == (4, False, "another python")
    pre = popen(server, "message", preexec_fn=lambda: None)
    pre.communicate(timeout=120)
    assert (pre.returncode, pre.forked) == (1, False) and "preexec_fn" in pre.fallback
    with pytest.raises(FileNotFoundError):  # as Popen says it
        popen(server, "message", cwd=str(tmp_path / "no such dir"))


def test_a_dead_server_is_a_plain_popen(tmp_path):
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    s = forks.Server(script, clean_env())
    s.stop()
    p = popen(s, "message")
    p.communicate(timeout=120)
    assert (p.returncode, p.forked) == (1, False) and "not running" in p.fallback


def test_the_tool_forked_and_plain_say_the_same(monkeypatch):
    was = forks.enabled()
    forked = tool_popen(["--help"], env=clean_env(), text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    fo, fe = forked.communicate(timeout=120)
    monkeypatch.setenv("AIV_TEST_FORK", "0")
    plain = tool_popen(["--help"], env=clean_env(), text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    po, pe = plain.communicate(timeout=120)
    assert forks.enabled() is False and not plain.forked
    if was:
        assert forked.forked, forked.fallback
    assert (forked.returncode, fo, fe) == (plain.returncode, po, pe) == (0, po, "")
    assert str(SCRIPT) in forked.args


def spawned(server, tmp_path, how, extra, env=None):
    """A forked PROBE (`env` added to its environment) that starts `python PROBE report` (`how`: "spawn" or
    "spawn-threaded") with `extra` in its environment: the started child's report, once its own start is checked
    to be what Popen's would be (its pipes, preexec_fn, its session, its parent, its environment)."""
    p = forks.ToolPopen([sys.executable, server.script, how, json.dumps(extra), str(tmp_path / "mark")],
                        server=server, env=clean_env({"FORK_X": "x", **(env or {})}), text=True,
                        stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    out, err = p.communicate(timeout=180)
    assert p.forked and p.returncode == 0, (p.fallback, out, err)
    r = json.loads(out)
    child = r["child"]
    assert (r["rc"], r["err"], r["marked"], child["line"], child["x"]) == (3, "to stderr\n", True, "in\n", "x"), r
    assert child["ppid"] == r["me"] and child["sid"] == child["pid"], child
    return child


@pytest.mark.parametrize("extra,in_place", [({}, True), ({"PYTHONUNBUFFERED": "1"}, True), ({"LD_PRELOAD": ""}, False),
                                            (forks.TOOL_SETS, True),  # what a rank sets: the server's import
                                            ({"TORCH_CPP_LOG_LEVEL": "INFO"}, False),
                                            ({"TORCH_FR_BUFFER_SIZE": "10"}, False)])
def test_a_forked_childs_own_start_of_the_script_is_forked_in_place(server, tmp_path, extra, in_place):
    """What the tool's local launcher starts (`python SCRIPT ...` with preexec_fn and a session of its own) is
    forked from the launcher itself, torch already imported, as its child; a start a fork cannot reproduce
    (a variable torch reads at import) is a fresh python, as before."""
    child = spawned(server, tmp_path, "spawn", extra)
    assert child["name"] == "__main__" and child["torch"] is in_place, child


def _site_dirs(tmp_path):
    """PYTHONPATH directories: `add` (a sitecustomize and a module of its own), `mod` (a module only), `bad`
    (a sitecustomize that raises), `shadow` (a module of the standard library's name) and `torch` (a torch)."""
    made = {}
    for name, files in (("add", {"sitecustomize.py": "import os\nMARK = 'ran with ' + os.environ['FORK_X']\n",
                                 "forkextra.py": "VALUE = 7\n"}),
                        ("mod", {"forkextra.py": "VALUE = 8\n"}),
                        ("bad", {"sitecustomize.py": "raise ValueError('a broken site')\n"}),
                        ("shadow", {"json.py": "raise SystemExit('the shadow')\n"}),
                        ("torch", {"torch/__init__.py": "raise SystemExit('another torch')\n"})):
        for f, text in files.items():
            (tmp_path / name / f).parent.mkdir(parents=True, exist_ok=True)
            (tmp_path / name / f).write_text(text)
        made[name] = str(tmp_path / name)
    return made


def test_a_pythonpath_that_only_adds_modules_is_forked_and_runs_as_in_a_fresh_python(server, tmp_path):
    """A PYTHONPATH whose directories add modules (a fault injected through a sitecustomize, stand-in packages)
    is honoured by the fork: its directories on sys.path where python puts them, its sitecustomize run (an error
    in it said as python's site says it), its modules importable; forked and plain say the same."""
    dirs = _site_dirs(tmp_path)
    for pythonpath in (dirs["add"], dirs["bad"] + os.pathsep + dirs["mod"]):
        seen = []
        for srv in (server, None):
            p = forks.ToolPopen([sys.executable, server.script, "report"], server=srv, text=True,
                                env=clean_env({"FORK_X": "x", "FORK_EXTRA": "1", "PYTHONPATH": pythonpath}),
                                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
            out, err = p.communicate(timeout=120)
            assert p.returncode == 3 and p.forked is (srv is not None), (p.fallback, out, err)
            got = json.loads(out)
            seen.append((got["path1"], got["site"], got["extra"], err))
        assert seen[0] == seen[1], seen
    assert seen[0][:2] == (dirs["bad"], None) and seen[0][2] == 8
    assert seen[0][3].startswith("Error in sitecustomize; set PYTHONVERBOSE for traceback:\nValueError: a broken site")


@pytest.mark.parametrize("which,words", [("shadow", "shadows json"), ("torch", "shadows torch"),
                                         ("relative", "relative entry")])
def test_a_pythonpath_that_shadows_what_the_server_imported_is_a_plain_popen(server, tmp_path, which, words):
    dirs = dict(_site_dirs(tmp_path), relative="add")
    p = popen(server, "report", env=clean_env({"PYTHONPATH": dirs[which]}), stdin=subprocess.DEVNULL, cwd=tmp_path)
    out, err = p.communicate(timeout=120)
    assert not p.forked and words in p.fallback, p.fallback
    if which == "shadow":  # what the fork could not have done: the plain python imports the shadow
        assert p.returncode == 1 and "the shadow" in err, err


def test_a_pythonpath_is_kept_in_place_and_its_sitecustomize_is_never_run_twice(server, tmp_path):
    """A forked child's own start with the PYTHONPATH it has is forked in place when it ran no sitecustomize of it
    (its modules already on sys.path); one whose sitecustomize ran in the caller is a fresh python, which runs it
    on a state without its effects, as a fresh python of a plain caller would."""
    dirs = _site_dirs(tmp_path)
    kept = spawned(server, tmp_path, "spawn", {"FORK_EXTRA": "1"}, env={"PYTHONPATH": dirs["mod"]})
    assert kept["torch"] is True and kept["extra"] == 8 and kept["path1"] == dirs["mod"], kept
    added = spawned(server, tmp_path, "spawn", {"FORK_EXTRA": "1", "PYTHONPATH": dirs["add"]})
    assert added["torch"] is True and (added["site"], added["extra"]) == ("ran with x", 7), added
    fresh = spawned(server, tmp_path, "spawn", {"FORK_EXTRA": "1"}, env={"PYTHONPATH": dirs["add"]})
    assert fresh["torch"] is False and (fresh["site"], fresh["extra"]) == ("ran with x", 7), fresh


def test_a_start_from_a_process_with_threads_is_a_fresh_python_running_the_compiled_script(server, tmp_path):
    """A start from a forked child with a second thread running is never a fork (it could inherit a lock that
    thread holds): a fresh python, the caller its parent, torch not imported, which runs the code the server
    compiled (not compiling the script again) as `python SCRIPT ARGS` would."""
    child = spawned(server, tmp_path, "spawn-threaded", {})
    assert child["torch"] is False, child
    assert child["orig"][1:3] == [forks.__file__, "--compiled"], child  # the server's code, not a compile
    assert child["cmdline"] == [sys.executable, server.script, "report"] and child["argv"] == [server.script, "report"]
    assert (child["name"], child["file"], child["path0"]) == ("__main__", server.script,
                                                              os.path.dirname(server.script)), child


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("unshare"), reason="a pod's namespaces need root and unshare")
def test_a_pod_forked_or_under_unshare_has_its_own_hostname_and_hosts_file(server, tmp_path):
    """pod=(hostname, hosts file): forked, the child enters a UTS and a mount namespace of its own itself; plain,
    it runs under unshare; either way the same hostname and /etc/hosts, and this machine's are untouched."""
    hosts = tmp_path / "hosts"
    hosts.write_text("127.0.0.1 localhost\n127.0.0.1 pod-0.svc\n")
    mine = (os.uname().nodename, open("/etc/hosts").read())
    seen = []
    for srv in (server, None):
        p = forks.ToolPopen([sys.executable, server.script, "report"], server=srv, pod=("pod-0", hosts),
                            env=clean_env(), text=True, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
        out, err = p.communicate(timeout=120)
        assert p.forked is (srv is not None) and p.returncode == 3, (p.fallback, out, err)
        r = json.loads(out)
        seen.append((r["hostname"], r["hosts"], r["cmdline"][1:]))
    assert seen[0] == seen[1] == ("pod-0", hosts.read_text(), [server.script, "report"]), seen
    assert (os.uname().nodename, open("/etc/hosts").read()) == mine


ROOT_AND_UNSHARE = pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("unshare") or not shutil.which("taskset"),
                                      reason="a task's namespaces need root, unshare and taskset")


def as_task(python, *args, **kw):
    """`python` started as slurmd starts a task on a node of the Slurm test cluster: in a network and UTS namespace
    of its own (hostname node7), bound to CPU 0; the process Popen sees is `python` itself (exec all the way)."""
    return subprocess.Popen(["unshare", "--net", "--uts", "sh", "-c", 'hostname node7 && exec taskset -c 0 "$@"',
                             "task", python, *map(str, args)], text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, **kw)


@ROOT_AND_UNSHARE
def test_a_slurm_tasks_stand_in_forks_the_run_into_the_tasks_namespaces(server, tmp_path):
    """fork_task.py, a Slurm task's python: the run forked from the server (torch already imported) sees what an
    exec'd python sees: the task's hostname, network namespace, CPU affinity, parent, descriptors, environment,
    directory; its exit status is the task's."""
    stand_in = os.path.join(fork_task.task_python(str(tmp_path / "env"), server), "bin", "python")
    seen = []
    for python in (stand_in, sys.executable):
        p = as_task(python, server.script, "report", env=clean_env({"FORK_X": "task"}), cwd=tmp_path,
                    stdin=subprocess.PIPE)
        out, err = p.communicate("in\n", timeout=120)
        assert (p.returncode, err) == (3, "to stderr\n"), (out, err)
        r = json.loads(out)
        seen.append(r)
        assert (r["hostname"], r["cpus"], r["ppid"], r["x"], r["cwd"], r["line"]) == (
            "node7", [0], os.getpid(), "task", str(tmp_path), "in\n"), r
        assert r["netns"] != os.readlink("/proc/self/ns/net") and r["argv"] == [server.script, "report"], r
    assert (seen[0]["torch"], seen[1]["torch"]) == (True, False)  # forked from the server; python itself


@ROOT_AND_UNSHARE
def test_a_slurm_tasks_stand_in_passes_on_signals_and_its_run_dies_with_it(server, tmp_path):
    """The signals slurmstepd sends a task reach the run, whose death is the task's; a SIGKILLed stand-in's run
    is killed by the server, as an exec'd python would have died with it."""
    stand_in = os.path.join(fork_task.task_python(str(tmp_path / "env"), server), "bin", "python")
    p = as_task(stand_in, server.script, "nap", env=clean_env())
    run = int(p.stdout.readline())
    assert run != p.pid
    p.send_signal(signal.SIGTERM)
    assert p.wait(timeout=60) == -signal.SIGTERM and not os.path.exists(f"/proc/{run}")
    p = as_task(stand_in, server.script, "nap", env=clean_env())
    run = os.pidfd_open(int(p.stdout.readline()))
    p.kill()
    assert p.wait(timeout=60) == -signal.SIGKILL
    assert select.select([run], [], [], 30)[0], "the run outlived its SIGKILLed stand-in"


@ROOT_AND_UNSHARE
def test_a_slurm_task_the_server_refuses_is_python_itself_and_keeps_no_copy_of_its_pipes(server, tmp_path):
    """An environment torch reads at import (another TORCH_CPP_LOG_LEVEL) is refused: the stand-in execs python,
    says why in TEST_FORK_LOG, and the task's output ends when that python ends (the server closed the copies of
    its descriptors that came with the request: kept, they held the pipes open until the server's end)."""
    log = tmp_path / "fork.log"
    stand_in = os.path.join(fork_task.task_python(str(tmp_path / "env"), server), "bin", "python")
    p = as_task(stand_in, server.script, "report", env=clean_env({"TORCH_CPP_LOG_LEVEL": "INFO",
                                                                   "TEST_FORK_LOG": str(log)}), stdin=subprocess.PIPE)
    out, err = p.communicate("in\n", timeout=60)
    assert p.returncode == 3 and json.loads(out)["torch"] is False, (out, err)
    (said,) = [json.loads(line) for line in log.read_text().splitlines()]
    assert said["where"] == "a stand-in python on node7" and "TORCH_CPP_LOG_LEVEL differs" in said["why"], said


def test_a_script_changed_after_the_server_compiled_it_runs_as_it_is_now(tmp_path):
    """The server compiles the script once; a script whose text changed since runs its new text."""
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    s = forks.Server(script, clean_env())
    try:
        first = popen(s, "report", stdin=subprocess.DEVNULL)
        out, _ = first.communicate(timeout=120)
        assert first.forked and json.loads(out)["name"] == "__main__", first.fallback
        script.write_text(PROBE.replace("what = sys.argv[1]", "what = sys.argv[1]\nprint('edited')"))
        again = popen(s, "message")
        out, err = again.communicate(timeout=120)
        assert (again.forked, again.returncode, out, err) == (True, 1, "edited\n", "a message\n"), again.fallback
    finally:
        s.stop()


def test_a_server_forked_by_the_sessions_zygote_serves_as_its_own_and_ends_with_its_owner(tmp_path, monkeypatch):
    """Under xdist the controller starts one zygote that imports torch; each worker's server is forked from it
    (not its child) and ends when its worker does; a worker whose server would import torch under other
    variables gets a server of its own."""
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    z = forks.Zygote(clean_env())
    try:
        monkeypatch.setenv(forks.ZYGOTE_VAR, z.path)
        mine = subprocess.run([sys.executable, str(SCRIPT), "--verify-log", tmp_path / "none.log"], text=True,
                              capture_output=True, timeout=120)  # a test's own environment, the variable in it
        assert mine.stdout.startswith("FAILURE: usage: --verify-log: cannot read"), mine.stdout  # not a bad variable
        s = forks.Server(script, clean_env())
        assert isinstance(s.proc, forks._Forked) and s.alive()
        p = popen(s, "report", env=clean_env({"FORK_X": "z"}), stdin=subprocess.DEVNULL)
        out, _ = p.communicate(timeout=120)
        got = json.loads(out)
        assert p.forked and p.returncode == 3 and (got["x"], got["torch"], got["ppid"]) == ("z", True, s.proc.pid)
        own = forks.Server(script, clean_env({"OMP_NUM_THREADS": "3"}))
        assert isinstance(own.proc, subprocess.Popen)
        own.stop()
        s.stop()
        assert not s.alive()
        code = (f"import sys; sys.path.insert(0, {os.path.dirname(forks.__file__)!r}); import fork_server as f; "
                f"print(f.Server({str(script)!r}, {clean_env()!r}).proc.pid)")
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
        try:  # the worker exited without stopping its server
            gone = os.pidfd_open(int(r.stdout))
        except ProcessLookupError:  # gone already
            return
        assert select.select([gone], [], [], 30)[0], "the server outlived its worker"
    finally:
        z.stop()
