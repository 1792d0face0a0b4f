"""Shared helpers: the tool imported as a module, and a runner for real processes; the session's own
TMPDIR (removed at its end); the order and groups in which pytest-xdist hands tests to its workers."""
import atexit
import fnmatch
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import zlib
from pathlib import Path

import psutil
import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "ddp_mesh_ping.py"
sys.path.insert(0, str(ROOT))

import fork_server as forks  # noqa: E402  (tests/fork_server.py)

import ddp_mesh_ping as aiv  # noqa: E402,F401  (the tool as a module, for the tests)

# Site safety settings that must survive (e.g. NVLink multicast off on shared GPU hosts).
_KEEP_VARS = ("NCCL_NVLS_ENABLE",)
_LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def clean_env(extra=None):
    """The caller's environment without any launch, Slurm, NCCL/gloo or AIV_ variables, and with
    AIV_WARM_IMPORTS=0: a rank does not import what DDP's constructor needs (torch._dynamo, 1.5 s of CPU)
    while it waits, which most of the tests' runs, ending before the DDP step, would spend in vain on a
    2-core machine (a quarter of a hang test's CPU). Tests of the shipped default pass
    AIV_WARM_IMPORTS=1 (test_multiproc.py::test_local_mode_passes, the Slurm pass, the README's command)."""
    env = {k: v for k, v in os.environ.items()
           if k not in _LAUNCH_VARS and not k.startswith(("SLURM_", "AIV_", "NCCL_", "GLOO_"))
           or k in _KEEP_VARS}
    env["PYTHONUNBUFFERED"] = "1"
    env["AIV_WARM_IMPORTS"] = "0"
    env.update({k: str(v) for k, v in (extra or {}).items()})
    return env


_PORT_BLOCK = 1000
_next_port = [0 if os.environ.get("PYTEST_XDIST_WORKER") else os.getpid() % _PORT_BLOCK]


def free_port():
    """A port free now, from a block of this pytest process's own below the kernel's ephemeral range (32768
    and up): a port the kernel gives another worker's run (local mode binds port 0) or that another worker
    picked is never this one, so parallel tests cannot meet on a port. A run without xdist (one file, often
    several at once beside each other) shares block 11 with every other such run: each starts at an offset
    of its own (its pid), so that two of them do not pick the same ports in the same order."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    block = int(worker[2:]) if worker[2:].isdigit() else 11
    base = 20000 + (block % 12) * _PORT_BLOCK
    for _ in range(_PORT_BLOCK):
        port = base + _next_port[0] % _PORT_BLOCK
        _next_port[0] += 1
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:  # the whole block is taken: the kernel's choice
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------------------- starting the tool
# Every run of the tool a test starts as `python ddp_mesh_ping.py ARGS` goes through tool_popen or
# tool_ranks: a child of this pytest process's fork server (tests/fork_server.py: torch imported once,
# each rank forked from it), or a plain Popen where a fork cannot reproduce the start (another python, an
# environment that changes what torch reads at import, preexec_fn, ...; AIV_TEST_FORK=0: always).
_SERVER = []


def fork_server():
    """This process's fork server, started on first use (None with AIV_TEST_FORK=0)."""
    if not forks.enabled():
        return None
    if not _SERVER or _SERVER[0].pid_owner != os.getpid():
        s = forks.Server(SCRIPT, clean_env())
        s.pid_owner = os.getpid()
        _SERVER[:] = [s]
        atexit.register(stop_fork_server)
    return _SERVER[0]


def stand_in_venv():
    """A PYTORCH_ENV for a launch that starts `$PYTORCH_ENV/bin/python ddp_mesh_ping.py` itself (a pod's shell): a
    directory whose bin/python is a stand-in (tests/fork_task.py) that has this process's fork server fork the run;
    the test venv itself with AIV_TEST_FORK=0."""
    server = fork_server()
    if server is None:
        return sys.prefix
    if getattr(server, "stand_in", None) is None:
        import fork_task
        server.stand_in = fork_task.task_python(os.path.join(server.dir, "venv"), server)
    return server.stand_in


def stop_fork_server():
    while _SERVER:
        s = _SERVER.pop()
        if s.pid_owner == os.getpid():
            s.stop()


def tool_popen(args=(), env=None, python=None, fork=True, **kwargs):
    """`python ddp_mesh_ping.py ARGS` as subprocess.Popen(cmd, env=env, **kwargs) would start it (python: an
    argv prefix instead of this venv's python); forked from the fork server unless fork is False or the
    fork cannot reproduce the start. A Popen object either way (.forked, .fallback: why not)."""
    cmd = [*(python or [sys.executable]), str(SCRIPT), *map(str, args)]
    return forks.ToolPopen(cmd, server=fork_server() if fork else None, env=env, **kwargs)


def tool_ranks(envs, args=(), python=None, **kwargs):
    """One run of the tool per environment in `envs` (python: {index: argv prefix}), all forked or none
    (so that every rank of a launch has the same parent, as under srun or torchrun)."""
    python = python or {}
    server = fork_server()
    fork = server is not None and all(
        forks.refusal([*python.get(i, [sys.executable]), str(SCRIPT), *map(str, args)], e, server.env,
                            server.python, server.script) is None for i, e in enumerate(envs))
    return [tool_popen(args, env=e, python=python.get(i), fork=fork, **kwargs) for i, e in enumerate(envs)]


def spawn(world, ranks=None, args=(), env=None, per_rank=None, timeout=240, port=None):
    """Start the given ranks of a world by hand (as srun or torchrun would). -> [(rc, out)], seconds."""
    port = port or free_port()
    t0 = time.monotonic()
    envs = [clean_env({"RANK": r, "LOCAL_RANK": r, "WORLD_SIZE": world, "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": port, **(env or {}), **(per_rank or {}).get(r, {})})
            for r in (range(world) if ranks is None else ranks)]
    procs = tool_ranks(envs, args, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    return [(rc, o) for rc, o, _ in finish(procs, timeout)], time.monotonic() - t0


def finish(procs, timeout=120):
    """Each process's (returncode, stdout, stderr), killed after `timeout` (marked '<killed by test: hang>'
    on stderr, or on stdout when stderr goes there)."""
    out = []
    for p in procs:
        try:
            o, e = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            o, e = p.communicate()
            if e is None:
                o += "\n<killed by test: hang>"
            else:
                e += "\n<killed by test: hang>"
        out.append((p.returncode, o, e))
    return out


def state(proc):
    """A psutil process's state, or "gone": a process may exit between being listed and being looked at."""
    try:
        return proc.status()
    except psutil.NoSuchProcess:
        return "gone"


def wait_for(pred, seconds=90):
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(0.05)
    return False


def describe(out):
    """finish()'s results, rank by rank, for an assertion message."""
    return "\n".join(f"--- rank {r} rc={rc}\n{o}\n{(e or '')[-3000:]}" for r, (rc, o, e) in enumerate(out))



def run_tool(args=(), env=None, timeout=300, cwd=None, user=None):
    """subprocess.run of the tool (capture_output, text, timeout), through tool_popen."""
    python = ["runuser", "-u", user, "--", sys.executable] if user else None
    with tool_popen(args, env=clean_env(env), python=python, cwd=cwd, text=True, stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE) as p:
        try:
            out, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
            raise
    return subprocess.CompletedProcess(p.args, p.returncode, out, err)


def failures(text):
    return [ln for ln in text.splitlines() if ln.startswith("FAILURE:")]


def rec(rank, host="node1", local_rank=None, gpu=None, node=True, versions=None, **kw):
    """A gathered per-rank record as rank 0 sees it."""
    r = {"rank": rank, "host": host, "hostname": host, "local_rank": rank if local_rank is None else local_rank,
         "backend": "nccl" if gpu else "gloo", "device": (gpu or {}).get("index"), "cvd": None,
         "gpu": gpu, "cpus": "0-15", "local": [],
         "versions": versions or {"torch": "2.13.0", "cuda": "12.8", "nccl": "2.28.3", "python": "3.11.7"}}
    if node is True:
        node = {"os": "Ubuntu 22.04", "kernel": "5.15.0", "driver": "580.1", "cpu_model": "Xeon", "cpus": 96,
                "mem_total": 1 << 40, "ib": [], "peermem": True, "memlock": "unlimited", "shm": 64 << 30,
                "imports": {"torchvision": {"ok": True, "version": "0.29.1"},
                            "torchaudio": {"ok": True, "version": "2.11.1"}}, "ifaces": {}}
    if node:
        r["node"] = node
    r.update(kw)
    return r


def gpu(uuid, pci="0000:1b:00.0", name="NVIDIA H200", numa=0, numa_cpus="0-47", index=0, mem_used=500 << 20):
    return {"name": name, "vram": 141 << 30, "uuid": uuid, "pci": pci, "numa": numa,
            "numa_cpus": numa_cpus, "mem_used": mem_used, "index": index}


def cluster(nodes=2, per_node=2, with_gpu=False):
    out = []
    for n in range(nodes):
        for lr in range(per_node):
            r = n * per_node + lr
            g = gpu(f"GPU-{n}-{lr}", pci=f"0000:{lr:02x}:00.0", index=lr) if with_gpu else None
            out.append(rec(r, host=f"node{n + 1}", local_rank=lr, gpu=g, node=(lr == 0)))
    return out


# ---------------------------------------------------------------------------- the session's TMPDIR
# Everything a test, the tool, torch, torchrun, Chromium or Slurm puts in the temporary directory
# (the tool's once-per-node '.said' markers, private NCCL logs, torchelastic_* dirs, pytest's own
# tmp_path tree, the Slurm test cluster's state) lands in one directory made for this session, and
# the session removes it at its end: a run leaves nothing in $TMPDIR (or /tmp). The controller makes
# it before pytest-xdist starts its workers, which inherit it; the directory is world-writable and
# sticky like /tmp, so that the tests' runs as user nobody write there too.
@pytest.hookimpl(tryfirst=True)
def pytest_configure(config):
    if hasattr(config, "workerinput"):  # an xdist worker: the controller made it, TMPDIR says where
        return
    parent = os.environ.get("TMPDIR") or tempfile.gettempdir()
    made = tempfile.mkdtemp(prefix="aiv-tests-", dir=parent)
    os.chmod(made, 0o1777)
    config._aiv_session_tmp = (made, os.environ.get("TMPDIR"))
    os.environ["TMPDIR"] = made
    tempfile.tempdir = made  # this process's own tempfile calls (and pytest's tmp_path root) too
    if signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:  # a stopped session still removes it
        signal.signal(signal.SIGTERM, _interrupted)
    if forks.enabled() and config.getoption("numprocesses", None):  # xdist: its workers' fork servers come
        config._aiv_zygote = forks.Zygote(clean_env())               # from one import of torch, not one each
        os.environ[forks.ZYGOTE_VAR] = config._aiv_zygote.path


def _interrupted(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")  # pytest's own way out: unconfigure runs


def pytest_sessionfinish(session, exitstatus):
    stop_fork_server()


def pytest_unconfigure(config):
    if getattr(config, "_aiv_zygote", None) is not None:
        config._aiv_zygote.stop()
        os.environ.pop(forks.ZYGOTE_VAR, None)
    made, before = getattr(config, "_aiv_session_tmp", (None, None))
    if not made:
        return
    if before is None:
        os.environ.pop("TMPDIR", None)
    else:
        os.environ["TMPDIR"] = before
    tempfile.tempdir = None
    shutil.rmtree(made, ignore_errors=True)


_LEFT_KINDS = ("aiv-*.said", "aiv-nccl-*.log", "torchelastic_*", "org.chromium.*", "tmp*", ".aiv-*")


def pytest_terminal_summary(terminalreporter, config):
    """One line: what the session's runs left in its TMPDIR (about to be removed), by kind."""
    made = getattr(config, "_aiv_session_tmp", (None,))[0]
    if not made or not os.path.isdir(made):
        return
    kinds = {}
    for name in os.listdir(made):
        if name.startswith("pytest-of-"):
            continue  # pytest's own tmp_path tree
        kind = next((k for k in _LEFT_KINDS if fnmatch.fnmatch(name, k)), name)
        kinds[kind] = kinds.get(kind, 0) + 1
    left = ", ".join(f"{n} {k}" for k, n in sorted(kinds.items(), key=lambda kv: -kv[1]))
    terminalreporter.write_line(f"session TMPDIR {made}: left by the runs: {left or 'nothing'} (removed now)")


# TEST_TIMELINE=FILE: each test's start and end (wall clock) and its worker, a JSON line per test
# appended to FILE: where a worker's time went (bench/suite_timeline.py reads it). Where the cgroup v1 cpuacct
# controller is writable (root), each pytest process and everything it starts (the fork server and its ranks, a
# Slurm test cluster's daemons and their job steps) runs in a cpuacct group of its own, and each line also holds
# the CPU seconds that group used during the test ("cpu"): what the test cost, beside what it waited.
_STARTED = {}
_CPUACCT = "/sys/fs/cgroup/cpuacct"


def _cpu_group():
    """This process's own cpuacct group's usage file (made and joined on first use), or None."""
    if not hasattr(_cpu_group, "path"):
        _cpu_group.path = None
        group = os.path.join(_CPUACCT, f"aiv-tests-{os.getpid()}")
        try:
            os.makedirs(group, exist_ok=True)
            with open(os.path.join(group, "cgroup.procs"), "w") as f:
                f.write(str(os.getpid()))
            _cpu_group.path = os.path.join(group, "cpuacct.usage")
            atexit.register(_leave_cpu_group, group)
        except OSError:
            pass
    return _cpu_group.path


def _leave_cpu_group(group):
    try:
        with open(os.path.join(_CPUACCT, "cgroup.procs"), "w") as f:
            f.write(str(os.getpid()))
        os.rmdir(group)
    except OSError:  # a process of the group is still running: the group stays until it ends
        pass


def _cpu_seconds():
    path = _cpu_group() if os.environ.get("TEST_TIMELINE") else None
    try:
        with open(path) as f:
            return int(f.read()) / 1e9
    except (OSError, TypeError, ValueError):
        return None


def pytest_runtest_logstart(nodeid, location):
    _STARTED[nodeid] = time.time(), _cpu_seconds()


def pytest_runtest_logreport(report):
    path = os.environ.get("TEST_TIMELINE")
    if not path or report.when != "teardown" or report.nodeid not in _STARTED or hasattr(report, "node"):
        return  # (a report with .node is an xdist worker's, seen again by the controller)
    import json
    start, cpu0 = _STARTED.pop(report.nodeid)
    cpu1 = _cpu_seconds()
    line = {"id": report.nodeid, "worker": os.environ.get("PYTEST_XDIST_WORKER", "main"),
            "start": start, "end": time.time()}
    if cpu0 is not None and cpu1 is not None:
        line["cpu"] = round(cpu1 - cpu0, 3)
    with open(path, "a") as f:
        f.write(json.dumps(line) + "\n")


def pytest_report_header(config):
    made = getattr(config, "_aiv_session_tmp", (None,))[0]
    return f"session TMPDIR: {made} (removed at the end)" if made else None


def own_tool_processes(script=None):
    """Live (not zombie) processes running the tool (`script`, default SCRIPT) that this test process
    started, directly or not: found by their environment (this session's TMPDIR and this xdist worker),
    so that another worker's runs, or another session's, are never counted (nor killed). -> [(pid, cmd)]"""
    script = str(script or SCRIPT)
    tag = {b"TMPDIR": os.environ.get("TMPDIR", "").encode(),
           b"PYTEST_XDIST_WORKER": os.environ.get("PYTEST_XDIST_WORKER", "").encode()}
    mine = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
            if script not in cmd:
                continue
            with open(f"/proc/{pid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
        except (OSError, IndexError):
            continue
        if state != "Z" and all(env.get(k, b"") == v for k, v in tag.items()):
            mine.append((int(pid), cmd[:120]))
    return mine


# ---------------------------------------------------------------------------- order and groups
# tests/run.sh runs the suite on pytest-xdist workers with --dist worksteal: the list below is cut into
# one contiguous share per worker, and a worker that runs out takes the second half of the longest queue
# left. The suite is bound by the CPU (each run of the tool imports torch once per rank), and many tests
# wait out a bound with their CPU idle; the CPU stays busy when the waits of the workers are spread out,
# not when every worker waits at once. So the tests are dealt, costliest first, to the share that costs
# least so far; each share runs its tests of real processes (1 s or more) file by file in a fixed mixed order (by a
# hash of the file's name: long waits do not all come first, nor on every worker at once; a file's tests one after
# another, so that a fixture of the module, a fork server or a wheelhouse, is made once a share, not once a test),
# then its quick
# unit tests, which are what a worker that runs out takes over, so that no worker ends long after the others.
# The Slurm tests are cut into SLURM_SHARES runs of the file's order, each at the head of a share of its own: each
# worker that runs one brings up a Slurm test cluster of its own (tests/slurm_cluster.sh keeps clusters apart, in
# namespaces of their own; about 2 s and 1 CPU-s up, 4 s down), and one worker alone would wait out every Slurm
# test in turn. The node gate's Slurm tests run one after another on a share of their own (_TOGETHER).
# _COST: a file's mean seconds per test, measured on a 2-core machine with 5 workers (a scheduling hint
# only: a file not listed costs 0.1 s a test).
_COST = {"test_node_gate_slurm.py": 18.9, "test_slurm.py": 16.5, "test_screen_run.py": 13.7, "test_torchrun.py": 12.3,
         "test_verdict_path.py": 11.6, "test_hangs.py": 8.6, "test_last_call.py": 8.6, "test_bootstrap.py": 8.2,
         "test_k8s_operator_manifests.py": 7.2, "test_launch_hygiene.py": 6.6, "test_monitoring.py": 5.6,
         "test_false_culprit.py": 5.3, "test_stuck_rank.py": 4.9, "test_k8s_launchers.py": 3.4, "test_fan_in.py": 3.2,
         "test_multiproc.py": 2.6, "test_node_gate_env.py": 2.1, "test_side_channel.py": 1.9, "test_soak.py": 1.7,
         "test_rooms.py": 1.0, "test_numerics.py": 1.2, "test_blame.py": 1.2, "test_fork_server.py": 1.2,
         "test_node_smi.py": 1.0, "test_node_gate.py": 0.7, "test_drain.py": 0.7, "test_manifest.py": 0.6,
         "test_html.py": 0.6, "test_runtime.py": 0.3, "test_build.py": 0.2, "test_usage_errors.py": 0.4,
         "test_verify_log.py": 0.4}
# Files whose tests share a cluster of their own per worker (a module-scoped fixture: brought up before the
# file's first test on a worker and down, 4 s or more, before another file's test): each cut into that many runs of
# the file's order, each run at the head of a share of its own, one cluster each.
_TOGETHER = {"test_slurm.py": 2, "test_node_gate_slurm.py": 1}
SLURM_SHARES = _TOGETHER["test_slurm.py"]


def dealt(items, workers):
    """`items` in the order that gives `workers` xdist worksteal workers shares of equal cost (see above)."""
    cost = [_COST.get(item.path.name, 0.1) for item in items]
    total = len(items)
    sizes = []
    for w in range(workers):  # worksteal's own cut: worker w gets len(left) // (workers - w) of the list
        sizes.append((total - sum(sizes)) // (workers - w))
    shares = [[] for _ in range(workers)]
    spent = [0.0] * workers
    first = 0  # the share of the next run: each run of each file on a share of its own, while there are shares
    for name, cut in _TOGETHER.items():
        mine = [i for i in range(total) if items[i].path.name == name]
        runs = min(cut, workers)
        for k, i in enumerate(mine):  # in runs of the file's order: a cluster's tests one after another
            w = (first + k * runs // len(mine)) % workers
            shares[w].append(i)
            spent[w] += cost[i]
        first += runs if mine else 0
    for i in sorted((i for i in range(total) if items[i].path.name not in _TOGETHER), key=lambda i: -cost[i]):
        w = min((w for w in range(workers) if len(shares[w]) < sizes[w]), key=lambda w: spent[w])
        shares[w].append(i)
        spent[w] += cost[i]

    def within(i):  # each cluster's tests in their file's order, then the other files mixed, then the quick tests
        name = items[i].path.name
        return (name not in _TOGETHER, cost[i] < 1.0,
                -cost[i] if cost[i] < 1.0 or name in _TOGETHER else zlib.crc32(name.encode()), i)
    return [items[i] for share in shares for i in sorted(share, key=within)]


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    workers = getattr(config, "workerinput", {}).get("workercount", 1)
    items[:] = dealt(items, workers)
