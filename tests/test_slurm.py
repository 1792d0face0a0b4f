"""End-to-end tests of submit_smoke_test.sbatch on a real (throwaway) Slurm 22.05 cluster.

tests/slurm_cluster.sh stands up slurmctld + 4 slurmd ("node1" .. "node4"), each node in its own
network + UTS namespace with an eth0 on a private bridge, fake GPUs as gres.  Most jobs use two of
the nodes; the performance screen's use all four (4 x 1 rank), one with a node's link slowed by a
tbf qdisc on both ends of its veth.  The tests submit the
unmodified repo batch file with small shapes on the sbatch command line and AIV_BACKEND=gloo (CPU),
no interface variables unless a test is about them, and check job state, exit code, log, .err and
the JSON verdict.

Needs root and the Slurm binaries (Debian: apt-get install slurmd slurmctld slurm-client).
Skipped otherwise, except with CI=true, where a missing Slurm is an error.

    sudo python -m pytest -v tests/test_slurm.py
"""

import contextlib
import datetime
import json
import os
import re
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import fork_task
import pytest

from conftest import SCRIPT, aiv, clean_env, forks

REPO = Path(__file__).resolve().parent.parent
CLUSTER_SH = REPO / "tests" / "slurm_cluster.sh"
SBATCH_FILE = REPO / "submit_smoke_test.sbatch"
TOOL = REPO / "ddp_mesh_ping.py"
VENV = Path(sys.prefix)  # the venv these tests run in is the one the jobs use
VENV_PY = VENV / "bin" / "python"

# small shape for a 2-core machine: 2 nodes x 2 ranks
SHAPE = ["--nodes=2", "--ntasks-per-node=2", "--gpus-per-node=2", "--cpus-per-task=1", "--time=5"]
AIV_TIMEOUT = "30"
JOB_WAIT_S = 240

# environment variables of the caller that would change what the batch file does
_SCRUB = ("SLURM_", "SBATCH_", "SRUN_", "SALLOC_", "AIV_", "NCCL_", "GLOO_", "TORCH_CPP_")
_SCRUB_EXACT = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "PYTORCH_ENV")

# one test cluster per module instance: under pytest-xdist each worker that runs tests of this module
# brings up a cluster of its own (tests/slurm_cluster.sh keeps each in namespaces of its own)

REQUIRED_TOOLS = ("slurmctld", "slurmd", "sbatch", "srun", "scontrol", "sinfo", "unshare", "nsenter", "ip")


def _ci():
    return os.environ.get("CI", "").strip().lower() in ("true", "1", "yes")


def _skip_or_fail(reason):
    if _ci():
        pytest.fail(f"CI=true but the Slurm tests cannot run: {reason}")
    pytest.skip(reason)


def first_port_candidates(job_id, port_range_text, n=3):
    """The ports submit_smoke_test.sbatch tries first for job_id (same formula as the batch file)."""
    upper = int(port_range_text.split()[1])
    lo = 49152 if upper >= 65535 else max(49152, upper + 1)
    span = 65536 - lo
    return [lo + (job_id + i) % span for i in range(n)]


class Cluster:
    def __init__(self, state_dir, workdir):
        self.state_dir = Path(state_dir)
        self.workdir = Path(workdir)
        self.env = dict(os.environ, AIV_SLURM_DIR=str(self.state_dir))
        self.pytorch_env = VENV  # the jobs' PYTORCH_ENV (with_fork_server: a stand-in python's)
        self.fork_server = None

    # -- commands inside the cluster's namespaces --
    def run(self, *args, env=None, timeout=60, check=False):
        return subprocess.run(["bash", str(CLUSTER_SH), "exec", *map(str, args)], cwd=self.workdir,
                              env=env or self.env, capture_output=True, text=True, timeout=timeout,
                              check=check)

    def node_popen(self, node, *args):
        return subprocess.Popen(["bash", str(CLUSTER_SH), "exec-node", node, *map(str, args)],
                                cwd=self.workdir, env=self.env, stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def node_run(self, node, *args, timeout=30):
        return subprocess.run(["bash", str(CLUSTER_SH), "exec-node", node, *map(str, args)],
                              cwd=self.workdir, env=self.env, capture_output=True, text=True,
                              timeout=timeout, check=True)

    # -- jobs --
    def job_env(self, **overrides):
        """What a job sees: the caller's environment without Slurm/NCCL/gloo/AIV settings (so no
        interface variables), plus the venv and AIV_BACKEND=gloo.  gloo is explicit: the fake GPUs
        set CUDA_VISIBLE_DEVICES, and with GPUs expected but no usable CUDA, 'auto' fails."""
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(_SCRUB) and k not in _SCRUB_EXACT}
        env.update(AIV_SLURM_DIR=str(self.state_dir), PYTORCH_ENV=str(self.pytorch_env), AIV_BACKEND="gloo",
                   AIV_TIMEOUT=AIV_TIMEOUT, AIV_WARM_IMPORTS="0")  # as conftest.clean_env says why
        env.update({k: str(v) for k, v in overrides.items()})
        return env

    def with_fork_server(self, where):
        """The jobs' ranks forked from a fork server of this pytest process (tests/fork_task.py) rather than each
        importing torch, where AIV_TEST_FORK allows: PYTORCH_ENV becomes `where`, whose bin/python is the
        stand-in. The server imports torch as the batch file's ranks do (TORCH_CPP_LOG_LEVEL=ERROR)."""
        if forks.enabled():
            self.fork_server = forks.Server(SCRIPT, clean_env({"TORCH_CPP_LOG_LEVEL": "ERROR"}))
            self.pytorch_env = Path(fork_task.task_python(str(where), self.fork_server))
        return self

    def stop_fork_server(self):
        if self.fork_server is not None:
            self.fork_server.stop()

    def submit(self, *sbatch_args, script_args=(), **env_overrides):
        """sbatch [sbatch_args] submit_smoke_test.sbatch [script_args] (the latter go to ddp_mesh_ping.py)."""
        r = self.run("sbatch", "--parsable", *sbatch_args, SBATCH_FILE, *script_args,
                     env=self.job_env(**env_overrides))
        assert r.returncode == 0, f"sbatch failed: {r.stdout}{r.stderr}"
        return int(r.stdout.strip().split(";")[0])

    def jobcomp_times(self, job_id, wait_s=10):
        """(StartTime, EndTime) in epoch seconds from the jobcomp/filetxt record (whole seconds)."""
        path = self.state_dir / "log" / "jobcomp.txt"
        deadline = time.monotonic() + wait_s
        while True:
            text = path.read_text(errors="replace") if path.exists() else ""
            m = re.search(rf"^JobId={job_id} .*?\bStartTime=(\S+) EndTime=(\S+)", text, re.MULTILINE)
            if m:
                return tuple(time.mktime(time.strptime(v, "%Y-%m-%dT%H:%M:%S")) for v in m.groups())
            if time.monotonic() > deadline:
                pytest.fail(f"no jobcomp record for job {job_id} in {path}:\n{text[-2000:]}")
            time.sleep(0.2)

    def job_info(self, job_id):
        r = self.run("scontrol", "show", "job", job_id)
        assert r.returncode == 0, r.stderr
        state = re.search(r"\bJobState=(\S+)", r.stdout)
        code = re.search(r"\bExitCode=(\S+)", r.stdout)
        return (state.group(1) if state else "?"), (code.group(1) if code else "?"), r.stdout

    def wait(self, job_id, limit=JOB_WAIT_S):
        t0 = time.monotonic()
        while True:
            state, code, text = self.job_info(job_id)
            if state not in ("PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "SUSPENDED"):
                return state, code, time.monotonic() - t0
            if time.monotonic() - t0 > limit:
                self.run("scancel", job_id)
                pytest.fail(f"job {job_id} still {state} after {limit} s:\n{text}")
            time.sleep(0.25)

    def files(self, job_id):
        stem = self.workdir / f"ai_infra_smoke_test_{job_id}"
        return stem.with_suffix(".log"), stem.with_suffix(".err"), stem.with_suffix(".json")

    def outputs(self, job_id):
        log, err, js = self.files(job_id)
        return (log.read_text(errors="replace") if log.exists() else "",
                err.read_text(errors="replace") if err.exists() else "", js)

    def port_range(self, node="node1"):
        return self.node_run(node, "cat", "/proc/sys/net/ipv4/ip_local_port_range").stdout

    def hold_port(self, node, port):
        """Listen on 0.0.0.0:port (port 0: any) inside node's network namespace; returns (proc, port)."""
        code = ("import socket, sys\n"
                "s = socket.socket()\n"
                "s.bind(('0.0.0.0', int(sys.argv[1])))\n"
                "s.listen(8)\n"
                "print(s.getsockname()[1], flush=True)\n"
                "sys.stdin.read()\n")
        p = self.node_popen(node, sys.executable, "-c", code, port)
        line = p.stdout.readline().strip()
        if not line.isdigit():
            p.kill()
            pytest.fail(f"could not hold port {port} on {node}: {line} {p.stderr.read()}")
        return p, int(line)


def release_port(proc):
    try:
        proc.stdin.close()
        proc.wait(timeout=5)
    except (OSError, subprocess.TimeoutExpired):
        proc.kill()
        proc.wait(timeout=5)


def describe(cluster, job_id):
    log, err, js = cluster.outputs(job_id)
    j = js.read_text() if js.exists() else "(no json)"
    return f"--- log\n{log}\n--- err\n{err[-4000:]}\n--- json\n{j[:2000]}"


def load_json(path):
    import json
    assert path.exists(), f"no verdict JSON at {path}"
    return json.loads(path.read_text())


def tool_output(log):
    """The part of the log that ddp_mesh_ping.py wrote (after the batch file's own header)."""
    m = re.search(r"^Python: .*$", log, re.MULTILINE)
    return log[m.end():] if m else log


def failure_lines(log, check):
    return [ln.strip() for ln in log.splitlines() if ln.strip().startswith(f"FAILURE: {check}:")]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    missing = [t for t in REQUIRED_TOOLS if shutil.which(t) is None]
    if missing:
        _skip_or_fail("Slurm or namespace tools not installed: " + ", ".join(missing)
                      + " (Debian: apt-get install slurmd slurmctld slurm-client)")
    if os.geteuid() != 0:
        _skip_or_fail("needs root (network namespaces, mknod, Slurm daemons)")
    if not VENV_PY.exists():
        _skip_or_fail(f"the tests must run in a venv: {VENV_PY} missing (the jobs use PYTORCH_ENV={VENV})")
    if not TOOL.exists():
        _skip_or_fail(f"{TOOL} missing")
    state = tmp_path_factory.mktemp("slurm")
    work = tmp_path_factory.mktemp("submit")
    # the batch file's default AIV_SCRIPT is $SLURM_SUBMIT_DIR/ddp_mesh_ping.py
    (work / "ddp_mesh_ping.py").symlink_to(TOOL)
    hosts_before = Path("/etc/hosts").read_bytes()
    # 8 GPUs on a node of only 16 CPUs: the batch file's default shape (2 x 8 ranks, 1 CPU each)
    # must fit nodes smaller than the usual 8-GPU server
    env = dict(os.environ, AIV_SLURM_DIR=str(state), SLURM_NODES="4", NODE_CPUS="16", NODE_GPUS="8")
    r = subprocess.run(["bash", str(CLUSTER_SH), "up"], check=False, env=env, capture_output=True, text=True,
                       timeout=180)
    if r.returncode == 3:
        _skip_or_fail("slurm_cluster.sh refused to start: " + r.stderr.strip())
    if r.returncode != 0:
        subprocess.run(["bash", str(CLUSTER_SH), "down"], check=False, env=env, capture_output=True,
                       timeout=120)
        pytest.fail(f"slurm_cluster.sh up failed ({r.returncode}):\n{r.stdout}\n{r.stderr}")
    c = Cluster(state, work).with_fork_server(tmp_path_factory.mktemp("forkenv"))
    c.hosts_before = hosts_before
    try:
        yield c
    finally:
        c.stop_fork_server()
        d = subprocess.run(["bash", str(CLUSTER_SH), "down"], check=False, env=env, capture_output=True, text=True,
                           timeout=180)
        assert d.returncode == 0, f"slurm_cluster.sh down failed:\n{d.stdout}\n{d.stderr}"


def test_cluster_is_private(cluster):
    """The host's /etc/hosts and network namespace are untouched; nodes resolve inside."""
    assert Path("/etc/hosts").read_bytes() == cluster.hosts_before
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, check=True).stdout
    assert "aivbr0" not in links and "veth-aiv" not in links
    r = cluster.run("getent", "hosts", "node1")
    assert r.returncode == 0 and r.stdout.split()[0].startswith("10.77.0."), r.stdout
    assert cluster.node_run("node2", "hostname").stdout.strip() == "node2"


def test_a_second_cluster_runs_beside_this_one(cluster, tmp_path):
    """Test workers each bring up a cluster: another cluster made by tests/slurm_cluster.sh is not a
    foreign Slurm (which "up" refuses), and each answers only for its own nodes."""
    env = dict(os.environ, AIV_SLURM_DIR=str(tmp_path / "second"), SLURM_NODES="1", NODE_CPUS="2",
               NODE_GPUS="1", AIV_SLURM_SUBNET="10.78.0")
    up = subprocess.run(["bash", str(CLUSTER_SH), "up"], check=False, env=env, capture_output=True, text=True,
                        timeout=180)
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        second = subprocess.run(["bash", str(CLUSTER_SH), "exec", "sinfo", "-h", "-N", "-o", "%N %c"],
                                check=False, env=env, capture_output=True, text=True, timeout=60)
        assert second.stdout.split() == ["node1", "2"], second.stdout + second.stderr
    finally:
        # pods and other clusters making namespaces while it goes down: the kernel gives them the ids of the
        # namespaces "down" frees; before, "down" stopped their processes as its own ("processes left")
        downer = subprocess.Popen(["bash", str(CLUSTER_SH), "down"], env=env, stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True)
        others = []
        while downer.poll() is None and len(others) < 400:
            others.append(subprocess.Popen(["unshare", "--mount", "--net", "--uts", "sleep", "120"]))
            time.sleep(0.05)
        down_out = downer.communicate(timeout=180)[0]
        ended = [p.returncode for p in others if p.poll() is not None]
        for p in others:
            p.kill()
            p.wait()
    assert downer.returncode == 0, down_out
    assert not ended, f"{len(ended)} of {len(others)} processes in namespaces of their own ended: {ended}\n{down_out}"
    first = cluster.run("sinfo", "-h", "-N", "-o", "%N %c")  # the first cluster is intact
    assert first.stdout.split() == ["node1", "16", "node2", "16", "node3", "16", "node4", "16"], first.stdout


def test_a_slurmd_on_its_way_out_is_not_taken_for_a_foreign_one(cluster, tmp_path):
    """"up" refuses beside Slurm daemons it did not start, found by name and told from another test cluster's by
    the SLURM_CONF in their environment. A process on its way out has no environment left to read (another
    cluster's slurmd, or its forked child, ending), and was taken for a foreign daemon: it is looked at again
    until it is gone. One that lasts without our SLURM_CONF is still foreign."""
    fake = tmp_path / "slurmd"  # its name is slurmd; started by `env -i`: no environment to read
    shutil.copy("/bin/sleep", fake)
    lasting = subprocess.Popen(["env", "-i", str(fake), "60"])
    ending = subprocess.Popen(["env", "-i", str(fake), "1.5"])
    env = dict(os.environ, AIV_SLURM_DIR=str(tmp_path / "third"), SLURM_NODES="1", NODE_CPUS="2", NODE_GPUS="1",
               AIV_SLURM_SUBNET="10.79.0")
    try:
        r = subprocess.run(["bash", str(CLUSTER_SH), "up"], env=env, capture_output=True, text=True, timeout=120)
    finally:
        for p in (lasting, ending):
            p.kill()
            p.wait()
    assert r.returncode == 3 and f" {lasting.pid}(slurmd) " in f" {r.stderr.split(': ')[-1]}", r.stderr
    assert f"{ending.pid}(slurmd)" not in r.stderr, r.stderr


def test_default_shape_is_accepted(cluster):
    """The #SBATCH defaults (2 nodes x 8 tasks x 8 GPUs, Slurm's default 1 CPU per task) are a
    valid request on 16-CPU nodes."""
    r = cluster.run("sbatch", "--test-only", SBATCH_FILE, env=cluster.job_env())
    assert r.returncode == 0, r.stdout + r.stderr
    assert "16 processors on nodes node[1-2]" in r.stderr, r.stderr


def test_two_nodes_two_ranks_pass(cluster, capsys, record_property):
    t0 = time.monotonic()
    job = cluster.submit(*SHAPE, AIV_WARM_IMPORTS=1)  # the shipped default
    state, code, _ = cluster.wait(job)
    took = time.monotonic() - t0
    record_property("sbatch_to_completed_s", round(took, 2))
    with capsys.disabled():
        print(f"\n[slurm] 2 nodes x 2 ranks: sbatch -> {state} in {took:.1f} s (job {job})")
    assert (state, code) == ("COMPLETED", "0:0"), describe(cluster, job)
    log, err, js = cluster.outputs(job)
    assert "Master Node IP/Hostname: node1" in log
    assert "Total Execution Ranks: 4" in log
    unset = "(unset: NCCL/gloo choose)"
    assert f"Interfaces: NCCL_SOCKET_IFNAME={unset} GLOO_SOCKET_IFNAME={unset}" in log, log
    port = int(re.search(r"^Dynamically Assigned Port: (\d+)$", log, re.MULTILINE).group(1))
    assert port == first_port_candidates(job, cluster.port_range())[0]
    assert "SUCCESS: DDP Multi-Node AllReduce Ring Complete!" in log
    tool_out = tool_output(log)
    assert re.search(r"\bnode1\b", tool_out) and re.search(r"\bnode2\b", tool_out), log
    assert "Traceback" not in log + err, err
    verdict = load_json(js)
    assert verdict["verdict"] == "PASS" and verdict["exit_code"] == 0
    assert not {"NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME"} & set(verdict["env"]), verdict["env"]
    assert "ending the step" not in log  # every rank ended by itself
    log_path = cluster.files(job)[0]
    v = subprocess.run([str(VENV_PY), str(TOOL), "--verify-log", str(log_path), "--expect-world-size", "4",
                        "--expect-nodes", "2", "--expect-ranks-per-node", "2"],
                       check=False, capture_output=True, text=True, timeout=120)
    assert v.returncode == 0, v.stdout + v.stderr


@pytest.mark.parametrize("shape, expect", [
    # one node, 3 ranks: uniform layout "3"
    (["--nodes=1", "--ntasks-per-node=3", "--gpus-per-node=3", "--cpus-per-task=1", "--time=5"],
     "world size 3, nodes 1, ranks per node 3"),
    # --ntasks on the command line with the file's --ntasks-per-node=8 still in force: 8 is only a
    # maximum, Slurm lays out 2+1, so no per-node expectation may be passed on
    (["--ntasks=3", "--gpus-per-node=1", "--cpus-per-task=1", "--time=5"],
     "world size 3, nodes 2, ranks per node (not uniform, unchecked)"),
], ids=["1x3", "2-nodes-3-tasks"])
def test_shape_overrides_pass(cluster, shape, expect):
    job = cluster.submit(*shape)
    state, code, _ = cluster.wait(job)
    assert (state, code) == ("COMPLETED", "0:0"), describe(cluster, job)
    log, _, js = cluster.outputs(job)
    assert f"Expected shape: {expect}" in log
    assert "Total Execution Ranks: 3" in log
    assert load_json(js)["verdict"] == "PASS"


def test_layout_mismatch_fails(cluster):
    job = cluster.submit(*SHAPE, AIV_EXPECT_RANKS_PER_NODE=3)
    state, code, _ = cluster.wait(job)
    assert (state, code) == ("FAILED", "1:0"), describe(cluster, job)
    log, _, js = cluster.outputs(job)
    lines = failure_lines(log, "layout")
    assert lines, describe(cluster, job)
    assert any(re.search(r"\bnode[12]\b", ln) and "3" in ln and "2" in ln for ln in lines), lines
    assert load_json(js)["exit_code"] == 1


def test_bad_interface_fails_fast(cluster):
    job = cluster.submit(*SHAPE, NCCL_SOCKET_IFNAME="eth9", GLOO_SOCKET_IFNAME="eth9")
    state, code, took = cluster.wait(job)
    assert (state, code) == ("FAILED", "1:0"), describe(cluster, job)
    log, _, _ = cluster.outputs(job)
    lines = failure_lines(log, "interface")
    assert lines, describe(cluster, job)
    assert any("eth9" in ln and re.search(r"\bnode[12]\b", ln) for ln in lines), lines
    assert took < float(AIV_TIMEOUT) + 30, f"took {took:.1f} s"  # job limit is 5 min


def test_interface_absent_on_one_node_names_that_node(cluster):
    """eth1 exists (up, with an address) on node1 only: the verdict names node2, not node1."""
    # a veth pair with both ends inside node1's namespace (no dummy driver needed)
    cluster.node_run("node1", "ip", "link", "add", "eth1", "type", "veth", "peer", "name", "eth1p")
    try:
        cluster.node_run("node1", "ip", "addr", "add", "10.78.0.1/24", "dev", "eth1")
        cluster.node_run("node1", "ip", "link", "set", "eth1p", "up")
        cluster.node_run("node1", "ip", "link", "set", "eth1", "up")
        job = cluster.submit(*SHAPE, NCCL_SOCKET_IFNAME="eth1", GLOO_SOCKET_IFNAME="eth1")
        state, code, took = cluster.wait(job)
    finally:
        cluster.node_run("node1", "ip", "link", "del", "eth1")
    assert (state, code) == ("FAILED", "1:0"), describe(cluster, job)
    log, _, js = cluster.outputs(job)
    lines = failure_lines(log, "interface")
    assert lines and all("node2" in ln and "eth1" in ln for ln in lines), lines
    assert not any("on node1" in ln for ln in lines), lines
    assert json.loads(js.read_text())["failed_hosts"] == ["node2"]
    assert took < float(AIV_TIMEOUT) + 30, f"took {took:.1f} s"


def test_pythonpath_does_not_shadow_the_venv(cluster, tmp_path):
    """A PYTHONPATH with a broken torch and a bogus PYTHONHOME in the submitter's environment: the
    job clears both and runs the venv alone."""
    shadow = tmp_path / "shadow"
    (shadow / "torch").mkdir(parents=True)
    (shadow / "torch" / "__init__.py").write_text("raise ImportError('torch shadowed through PYTHONPATH')\n")
    job = cluster.submit("--nodes=1", "--ntasks-per-node=2", "--gpus-per-node=2", "--cpus-per-task=1", "--time=5",
                         PYTHONPATH=shadow, PYTHONHOME="/nonexistent/aiv-pythonhome")
    state, code, _ = cluster.wait(job)
    assert (state, code) == ("COMPLETED", "0:0"), describe(cluster, job)
    log, err, _ = cluster.outputs(job)
    assert "shadowed" not in log + err


def test_missing_venv_one_line_error(cluster):
    missing = f"/nonexistent/aiv-venv-{uuid.uuid4().hex[:8]}"
    job = cluster.submit(*SHAPE, PYTORCH_ENV=missing)
    state, code, _ = cluster.wait(job)
    assert (state, code) == ("FAILED", "2:0"), describe(cluster, job)
    log, err, js = cluster.outputs(job)
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("ERROR:") and f"venv not found at {missing}" in lines[0], lines
    assert "bootstrap_env.sh" in lines[0]
    assert "Traceback" not in log + err
    assert "Total Execution Ranks" not in log  # no python ran
    assert not js.exists()


def test_dynamic_port_skips_busy_port(cluster):
    job = cluster.submit("--hold", *SHAPE)
    holder = None
    try:
        cands = first_port_candidates(job, cluster.port_range())
        holder, busy = cluster.hold_port("node1", cands[0])
        r = cluster.run("scontrol", "release", job)
        assert r.returncode == 0, r.stderr
        state, code, _ = cluster.wait(job)
    finally:
        if holder is not None:
            release_port(holder)
        else:
            cluster.run("scancel", job)
    assert (state, code) == ("COMPLETED", "0:0"), describe(cluster, job)
    log, _, _ = cluster.outputs(job)
    port = int(re.search(r"^Dynamically Assigned Port: (\d+)$", log, re.MULTILINE).group(1))
    assert port != busy
    assert port == cands[1]


def test_busy_forced_master_port_fails(cluster, capsys, record_property):
    """Rank 0 fails at once; the other ranks would wait out their 120 s deadline, but the job ends
    with the verdict: AIV_STEP_GRACE (10 s) after the JSON appears the batch file ends the step."""
    holder, port = cluster.hold_port("node1", 0)
    try:
        job = cluster.submit(*SHAPE, MASTER_PORT=port, AIV_TIMEOUT=120)
        state, code, _ = cluster.wait(job)
    finally:
        release_port(holder)
    assert (state, code) == ("FAILED", "1:0"), describe(cluster, job)
    log, _, js = cluster.outputs(job)
    assert f"Dynamically Assigned Port: {port}" in log
    lines = failure_lines(log, "rendezvous")
    assert any(f"node1:{port}" in ln for ln in lines), describe(cluster, job)
    assert "ending the step" in log, describe(cluster, job)
    # rank 0 writes the JSON right after its FAILURE line: its mtime is the verdict's time
    _, end = cluster.jobcomp_times(job)
    after = end - js.stat().st_mtime  # EndTime has whole seconds (rounded down)
    record_property("job_end_after_verdict_s", round(after, 2))
    with capsys.disabled():
        print(f"\n[slurm] busy MASTER_PORT: job ended {after:.1f} s after rank 0's FAILURE line (job {job})")
    assert after <= 15, f"job ended {after:.1f} s after the verdict\n{describe(cluster, job)}"


def test_rank0_dies_batch_file_writes_fail_json(cluster, capsys, record_property):
    """Rank 0 is SIGKILLed at the roll call: no verdict from the preflight.  Whoever notices first writes
    the FAIL verdict, exit 3, long before the others' --timeout 20: the batch file (rank 0's python ended
    without a JSON) or any other rank, rank 1 on node1 included (its store connection to rank 0 is gone).
    Both go through the one fallback writer and the gate: a lost connection (`link`) and a missing verdict
    (`stuck`) name nobody (before: node1, and MASTER_ADDR, an address, from the batch file).  The first
    writer wins, atomically; the others never replace it."""
    job = cluster.submit(*SHAPE, script_args=("--timeout", "20"), AIV_FAILPOINT="die:rendezvous:0")
    state, code, _ = cluster.wait(job)
    assert (state, code) == ("FAILED", "3:0"), describe(cluster, job)
    log, _, js = cluster.outputs(job)
    verdict = load_json(js)
    assert verdict["schema_version"] == 1 and verdict["tool"] == "ai-infra-validator"
    assert (verdict["verdict"], verdict["exit_code"]) == ("FAIL", 3), verdict
    assert verdict["failed_hosts"] == [] and verdict["exclude"] == "", verdict
    assert len(verdict["failures"]) == 1, verdict
    line = verdict["failures"][0]
    assert line.endswith(" [no host named]") and "no host is named" in line, line
    if verdict["written_by"] == "submit_smoke_test.sbatch":
        assert re.match(r"FAILURE: rendezvous: rank 0 on node1 left no verdict \(srun exit code \d+\); ", line), line
    else:
        writer = re.fullmatch(r"rank ([123]) \((node[12])\)", verdict["written_by"])
        assert writer and writer[2] == ("node1" if writer[1] == "1" else "node2"), verdict
        assert line.startswith(f"FAILURE: rendezvous: {verdict['written_by']} lost rank 0 (node1)"), line
    assert line in failure_lines(log, "rendezvous"), describe(cluster, job)
    # Two bounds, each on what this tool controls: the verdict comes long before --timeout 20 (whoever
    # notices first writes it), and the job ends within AIV_STEP_GRACE (10 s) of it. The ranks that had not
    # reached the store when rank 0 died (a slow import on a loaded machine) wait for it until the batch file
    # ends the step, so the job's whole length is the verdict's time plus up to that grace.
    start, end = cluster.jobcomp_times(job)
    verdict_at = js.stat().st_mtime - start  # StartTime/EndTime have whole seconds (rounded down)
    record_property("rank0_dead_verdict_s", round(verdict_at, 2))
    record_property("rank0_dead_job_s", end - start)
    with capsys.disabled():
        print(f"\n[slurm] rank 0 killed at the roll call: verdict after {verdict_at:.1f} s, written by "
              f"{verdict['written_by']}; job ran {end - start:.0f} s (job {job})")
    # counted from rank 0's own start (its header's time, in whole seconds: up to 1 s early), not the job's: the
    # batch file's own steps, srun's start of the tasks and their imports take as long as the machine's load makes
    # them, before rank 0 even starts
    head = re.search(r"^ai-infra-validator \S+ ddp_mesh_ping\s+(\S+)\s+host=node1$", log, re.MULTILINE)
    assert head, describe(cluster, job)
    after_start = js.stat().st_mtime - datetime.datetime.fromisoformat(head[1]).timestamp()
    assert after_start <= 15, (f"verdict {verdict_at:.1f} s after the job's start, {after_start:.1f} s after "
                               f"rank 0's start\n{describe(cluster, job)}")
    assert end - js.stat().st_mtime <= 15, f"job ran {end - start:.0f} s\n{describe(cluster, job)}"


def test_rank0_that_gave_its_verdict_without_a_json_is_trusted_and_names_nobody(cluster, tmp_path):
    """Rank 0's python ends with its verdict's code but leaves no verdict JSON (its storage refused it; the log
    says so): the batch file takes rank 0's code and names no host. Before: a FAIL naming MASTER_ADDR, exit 3,
    whenever the JSON was missing. The stand-in for AIV_SCRIPT is rank 0 whose JSON write failed after its
    verdict (and ranks that end with it); the batch file, srun and Slurm are real, and so is the tool that
    writes the batch file's verdict (the stand-in hands that call to it)."""
    stand_in = tmp_path / "rank0_without_json.py"
    stand_in.write_text(
        "import os, sys\n"
        "if os.environ.get('_AIV_FALLBACK_VERDICT'):\n"
        f"    os.execv(sys.executable, [sys.executable, {str(SCRIPT)!r}] + sys.argv[1:])\n"
        "if os.environ.get('SLURM_PROCID') == '0':\n"
        "    print('Verdict: FAIL exit=1 (an output the run was asked for could not be written: the lines above)')\n"
        "    print('FAILURE: output: --json x could not be written: Read-only file system')\n"
        "sys.exit(1)\n")
    job = cluster.submit(*SHAPE, AIV_SCRIPT=stand_in)
    state, code, _ = cluster.wait(job)
    assert (state, code) == ("FAILED", "1:0"), describe(cluster, job)
    log, _, js = cluster.outputs(job)
    v = load_json(js)
    assert (v["exit_code"], v["failed_hosts"], v["exclude"], v["written_by"]) == (1, [], "", "submit_smoke_test.sbatch")
    assert "gave its verdict (exit code 1, in the log) but no verdict JSON" in v["failures"][0], v
    assert v["failures"][0] in log and v["failures"][0].endswith(" [no host named]"), log
    assert "left no verdict" not in log, log


@pytest.mark.parametrize("phase", ["rendezvous", "collective"])
def test_scancel_names_nobody(cluster, capsys, phase):
    """scancel while rank 1 waits inside `phase` (at the roll call: rank 0 waits for it): rank 0 takes the
    SIGTERM and gives the `interrupted` verdict (exit 5) inside KillWait, naming no host; the batch file
    says the job was cancelled; no rank outlives the job."""
    mark = cluster.workdir / f"paused-{uuid.uuid4().hex}"
    job = cluster.submit(*SHAPE, AIV_FAILPOINT=f"pause=120:{phase}:1", AIV_FAILPOINT_MARK=str(mark), AIV_DRAIN="on")
    deadline = time.monotonic() + 120
    while not mark.exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert mark.exists(), describe(cluster, job)
    time.sleep(0.5)
    cluster.run("scancel", job)
    state, _, _ = cluster.wait(job)
    assert state == "CANCELLED", describe(cluster, job)
    deadline = time.monotonic() + 15  # Slurm says CANCELLED at once; the batch shell ends within KillWait
    while "ai-infra-validator: job exit code" not in cluster.outputs(job)[0] and time.monotonic() < deadline:
        time.sleep(0.2)
    log, _, js = cluster.outputs(job)
    v = load_json(js)
    assert (v["exit_code"], v["failed_hosts"], v["exclude"]) == (aiv.EXIT_INTERRUPTED, [], ""), describe(cluster, job)
    assert v["failures"] and all(ln.startswith("FAILURE: interrupted: ") for ln in v["failures"]), v
    assert "written_by" not in v, "rank 0 gave the verdict itself, inside KillWait"
    assert v["drain_command"] == "" and "interrupted" in v["drain"]["skipped"] and drained(cluster) == {}, v["drain"]
    assert "ai-infra-validator: the job was cancelled (SIGTERM" in log, describe(cluster, job)
    assert "ai-infra-validator: job exit code 5" in log, describe(cluster, job)
    said = [ln for ln in log.splitlines() if ln.startswith("FAILURE:")]
    assert said and all(ln.startswith("FAILURE: interrupted: ") for ln in said), said  # nobody "lost rank 0"
    def left():  # this cluster's ranks only: their command line holds the submit directory's path
        return subprocess.run(["pgrep", "-f", str(cluster.workdir / "ddp_mesh_ping.py")], capture_output=True,
                              text=True).stdout.split()
    deadline = time.monotonic() + 15  # the ranks end on the SIGTERM themselves (KillWait, 30 s, would kill them later)
    while left() and time.monotonic() < deadline:
        time.sleep(0.5)
    with capsys.disabled():
        print(f"\n[slurm] scancel during {phase}: {v['failures'][0]}")
    assert not left(), f"preflight processes outlived the cancelled job: {left()}"


FORGER = """import datetime, json, sys, time
import torch.distributed as dist
print("ready", flush=True)
host, port = sys.stdin.readline().split()
store = dist.PrefixStore("aiv", dist.TCPStore(host, int(port), None, False, datetime.timedelta(seconds=10)))
store.set("stamp/1", "1")
store.append("errors", json.dumps({"rank": 1, "phase": "collective", "code": 1, "line": "NIC down on node9"}) + "\\n")
print("forged", flush=True)
time.sleep(float(sys.argv[1]))
"""


def test_a_forger_outside_the_allocation_is_named_and_nobody_blamed(cluster, capsys):
    """While rank 1 waits in the collective, a TCPStore client on node3 (not in the job's allocation, and
    without the job's secret, which the batch file made) writes a stamp and an error line into the job's
    store and stays connected: the verdict is a FAIL naming the forgery and the outside address, nobody
    excluded, every rank's exit code rank 0's."""
    mark = cluster.workdir / f"paused-{uuid.uuid4().hex}"
    # the forger imports torch first (seconds on a loaded machine), so that it writes inside rank 1's pause
    forger = cluster.node_popen("node3", str(VENV_PY), "-c", FORGER, "40")
    try:
        assert forger.stdout.readline().strip() == "ready", forger.stderr.read()
        job = cluster.submit(*SHAPE, AIV_FAILPOINT="pause=6:collective:1", AIV_FAILPOINT_MARK=str(mark))
        deadline = time.monotonic() + 120
        while not mark.exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert mark.exists(), describe(cluster, job)
        port = re.search(r"^Dynamically Assigned Port: (\d+)$", cluster.outputs(job)[0], re.MULTILINE)
        assert port, describe(cluster, job)
        forger.stdin.write(f"node1 {port.group(1)}\n")
        forger.stdin.flush()
        assert forger.stdout.readline().strip() == "forged", forger.stderr.read()
        state, code, _ = cluster.wait(job)
    finally:
        forger.kill()  # by its PID
        forger.communicate()
    log, _, js = cluster.outputs(job)
    v = load_json(js)
    assert (state, code, v["verdict"], v["exit_code"]) == ("FAILED", "1:0", "FAIL", 1), describe(cluster, job)
    assert (v["failed_hosts"], v["exclude"]) == ([], ""), v
    forged = [ln for ln in v["failures"] if "did not carry the job's secret: something outside the job writes "
              f"to MASTER_PORT (node1:{port.group(1)})" in ln]
    assert forged, describe(cluster, job)
    outside = [f for f in v["findings"] if f["check"] == "rendezvous" and "outside the run's nodes" in f["reason"]]
    node3 = os.environ.get("AIV_SLURM_SUBNET", "10.77.0") + ".13"
    assert [f["status"] for f in outside] == ["WARN"] and node3 in outside[0]["reason"], v["findings"]
    assert "AIV_JOB_SECRET" not in v["env"] and "side channel not authenticated" not in log
    with capsys.disabled():
        print(f"\n[slurm] forger on node3: {forged[0]}; {outside[0]['reason']}")


def test_hostile_env_values_not_evaluated(cluster):
    tag = uuid.uuid4().hex[:10]
    marks = [Path(f"/tmp/aiv-hostile-{tag}-{i}") for i in range(8)]
    job1 = cluster.submit(*SHAPE,
                          NCCL_SOCKET_IFNAME=f"$(touch {marks[0]})",
                          GLOO_SOCKET_IFNAME=f"`touch {marks[1]}`;touch {marks[2]}",
                          NCCL_DEBUG=f"$(touch {marks[3]})",
                          NCCL_IB_DISABLE=f"a[$(touch {marks[4]})]")
    job2 = cluster.submit(*SHAPE,
                          MASTER_PORT=f"$(touch {marks[5]})",
                          AIV_EXPECT_NODES=f"x[$(touch {marks[6]})]",
                          AIV_JSON=f"/tmp/aiv-hostile-{tag}-$(touch {marks[7]}).json")
    s1, c1, _ = cluster.wait(job1)
    s2, c2, _ = cluster.wait(job2)
    created = [str(m) for m in marks if m.exists()]
    for m in marks:
        m.unlink(missing_ok=True)
    assert not created, f"environment values were executed: {created}"
    # the values arrive as data: the interface names fail the interface check (exit 1),
    # the non-numeric MASTER_PORT / AIV_EXPECT_NODES are usage errors (exit 2)
    assert (s1, c1) == ("FAILED", "1:0"), describe(cluster, job1)
    assert (s2, c2) == ("FAILED", "2:0"), describe(cluster, job2)
    log1, _, _ = cluster.outputs(job1)
    assert any(str(marks[0]) in ln for ln in failure_lines(log1, "interface")), describe(cluster, job1)


def test_manifest_drift_on_one_node_is_named_on_that_node_only(cluster):
    """Accept the cluster (the manifest built from a passing job's own records), then give node2 one
    more interface: the next job run against the manifest names that drift on node2 and nowhere else."""
    job = cluster.submit(*SHAPE)
    state, code, _ = cluster.wait(job)
    assert (state, code) == ("COMPLETED", "0:0"), describe(cluster, job)
    records = json.loads(cluster.outputs(job)[2].read_text())["ranks"]
    path = cluster.workdir / "accepted-manifest.json"
    path.write_text(json.dumps(aiv.manifest_from_records(records, "2026-01-01T00:00:00+00:00")))
    cluster.node_run("node2", "ip", "link", "add", "eth1", "type", "veth", "peer", "name", "eth1p")
    try:
        cluster.node_run("node2", "ip", "addr", "add", "10.78.0.2/24", "dev", "eth1")
        cluster.node_run("node2", "ip", "link", "set", "eth1p", "up")
        cluster.node_run("node2", "ip", "link", "set", "eth1", "up")
        job = cluster.submit(*SHAPE, AIV_MANIFEST=str(path))
        state, code, _ = cluster.wait(job)
    finally:
        cluster.node_run("node2", "ip", "link", "del", "eth1")
    log, _, js = cluster.outputs(job)
    drift = [ln.strip() for ln in log.splitlines() if ln.strip().startswith(("[WARN] manifest:", "[FAIL] manifest:"))]
    assert drift and all("node2" in ln and "node1" not in ln for ln in drift), log
    assert any("eth1" in ln for ln in drift), drift
    assert (state, code) == ("COMPLETED", "0:0"), describe(cluster, job)     # a WARN field: no FAIL without --strict


# ---------------------------------------------------------------- the performance screen on 4 nodes
SHAPE_4X1 = ["--nodes=4", "--ntasks-per-node=1", "--gpus-per-node=1", "--cpus-per-task=1", "--time=5"]
TBF = ["root", "tbf", "rate", "50mbit", "burst", "64kb", "latency", "200ms"]
SCREEN_CHECKS = ("gpu-perf", "intra-node", "inter-node")
SCREEN_PHASES_ORDER = ("screen-gpu", "screen-net")


def pair_summary(screen):
    return " ".join(f"r{p['round']}:{'-'.join(n[4:] for n in p['nodes'])}={p['busbw']:.3f}" for p in screen["pairs"])


@pytest.mark.parametrize("run", range(1, 1 + int(os.environ.get("TEST_SCREEN_RUNS", "1"))))
def test_screen_on_four_healthy_nodes_names_nobody(cluster, run, capsys):
    """4 nodes x 1 rank over the bridge: rounds 1 and 2 pair every node with two others; nobody slow.
    TEST_SCREEN_RUNS=N runs it N times (1 by default: every other screen test here also measures healthy
    pairs beside the one it slows, and none of them may name a healthy node either)."""
    job = cluster.submit(*SHAPE_4X1)
    state, code, took = cluster.wait(job)
    assert (state, code) == ("COMPLETED", "0:0"), describe(cluster, job)
    log, _, js = cluster.outputs(job)
    v = load_json(js)
    assert v["failed_hosts"] == [] and "PERFORMANCE" in log
    # nothing slow; on a loaded machine a measurement slow at first and at speed again is a transient WARN
    # that names no host (it is what the re-measurement is for), never more
    assert [f for f in v["findings"] if f["check"] in SCREEN_CHECKS and f["status"] != "PASS"
            and not (f.get("transient") and f["status"] == "WARN" and not f["hosts"])] == []
    sc = v["screen"]
    assert sorted(tuple(p["nodes"]) for p in sc["pairs"]) == [("node1", "node3"), ("node1", "node4"),
                                                             ("node2", "node3"), ("node2", "node4")]
    with capsys.disabled():
        print(f"\n[slurm] screen 4x1 run {run}: {took:.1f} s, busbw GB/s {pair_summary(sc)}, groups made "
              f"{sc['splits']}, phases " + " ".join(f"{p}={v['phases'][p]:.2f}" for p in SCREEN_PHASES_ORDER))


@contextlib.contextmanager
def slowed_link(cluster, node):
    """The node's link rate-limited both ways (TBF on the bridge side of its veth and on its eth0) while
    the block runs; removed afterwards, whatever happens."""
    hub_dev, added = f"veth-aiv{node.removeprefix('node')}", []
    try:
        r = cluster.run("tc", "qdisc", "add", "dev", hub_dev, *TBF)
        assert r.returncode == 0, r.stderr
        added.append(("hub", hub_dev))
        cluster.node_run(node, "tc", "qdisc", "add", "dev", "eth0", *TBF)
        added.append((node, "eth0"))
        yield
    finally:
        for where, dev in added:
            if where == "hub":
                cluster.run("tc", "qdisc", "del", "dev", dev, "root")
            else:
                cluster.node_run(where, "tc", "qdisc", "del", "dev", dev, "root")


def test_screen_names_the_node_behind_a_slow_link(cluster, capsys):
    """node3's link rate-limited both ways (tbf, 50 Mbit/s, on the bridge side of its veth and on its
    eth0): node3, and only node3, is named under inter-node, after round 3 paired it with a good node."""
    with slowed_link(cluster, "node3"):
        job = cluster.submit(*SHAPE_4X1)
        state, code, took = cluster.wait(job)
    assert (state, code) == ("FAILED", "1:0"), describe(cluster, job)
    log, _, js = cluster.outputs(job)
    v = load_json(js)
    fails = [(f["check"], f["hosts"]) for f in v["findings"] if f["status"] == "FAIL"]
    assert fails == [("inter-node", ["node3"])], describe(cluster, job)
    assert v["failed_hosts"] == ["node3"] and v["exclude"] == "node3"
    assert [f for f in v["findings"] if f["status"] == "WARN" and f["check"] in SCREEN_CHECKS] == []
    (line,) = failure_lines(log, "inter-node")
    assert "node node3 is slow on rail 0 with 3 different partner(s) (node1, node2, node4)" in line, line
    sc = v["screen"]
    assert sc["third"]["groups"] == [["node3", "node4"]]
    slow = {tuple(p["nodes"]) for p in sc["pairs"] if p["busbw"] < 0.1 * max(q["busbw"] for q in sc["pairs"])}
    assert slow == {("node1", "node3"), ("node2", "node3"), ("node3", "node4")}, pair_summary(sc)
    assert "COLLECTIVES" not in log                   # the screen's FAIL comes before the full-job collectives
    with capsys.disabled():
        print(f"\n[slurm] screen, node3 at 50 Mbit/s: {took:.1f} s, busbw GB/s {pair_summary(sc)}; {line}")


def test_screen_names_a_node_whose_link_goes_down_after_the_roll_call(cluster, capsys):
    """Rank 0 pauses after the roll call (test failpoint); meanwhile node3's eth0 goes down: node3,
    and only node3, is named within the deadline (its monitor falls silent, its ranks never finish)."""
    mark = cluster.workdir / f"paused-{uuid.uuid4().hex}"
    job = cluster.submit(*SHAPE_4X1, AIV_FAILPOINT="pause=8:init:0", AIV_FAILPOINT_MARK=str(mark))
    js = cluster.files(job)[2]
    deadline = time.monotonic() + 120
    while not mark.exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert mark.exists(), describe(cluster, job)
    t_down = time.monotonic()
    cluster.node_run("node3", "ip", "link", "set", "eth0", "down")
    try:
        while not js.exists() and time.monotonic() - t_down < float(AIV_TIMEOUT) + 60:
            time.sleep(0.2)
        verdict_after = time.monotonic() - t_down
    finally:
        cluster.node_run("node3", "ip", "link", "set", "eth0", "up")
    state, code, _ = cluster.wait(job)
    v = load_json(js)
    assert v["failed_hosts"] == ["node3"] and v["exit_code"] in (1, 3), describe(cluster, job)
    assert (state, code) == ("FAILED", f"{v['exit_code']}:0"), describe(cluster, job)
    fails = [ln for ln in cluster.outputs(job)[0].splitlines() if ln.startswith("FAILURE:")]
    assert fails and all("node3" in ln for ln in fails), fails
    # the pause (8 s) + the phase's bound + naming, from the moment the link went down
    assert verdict_after < 8 + float(AIV_TIMEOUT) + aiv.NAMING_S + 5, f"verdict {verdict_after:.1f} s after"
    with capsys.disabled():
        print(f"\n[slurm] node3's link down after the roll call: verdict {verdict_after:.1f} s later; {fails[0]}")


def test_screen_a_link_slow_only_in_the_first_pair_round_names_nobody(cluster, capsys):
    """node3's link rate-limited (tbf, both ways) until rank 0 holds the run between pair rounds 1 and 2
    (test failpoint pause at round-p2's gate): round 1's node1 <-> node3 stays slow through its
    re-measurement, node3 and node1 are fine with their other partners afterwards, so the pair is a
    suspect link (a WARN, in suspect_links) and no host is named or excluded."""
    mark = cluster.workdir / f"paused-{uuid.uuid4().hex}"
    with slowed_link(cluster, "node3"):
        job = cluster.submit(*SHAPE_4X1, AIV_FAILPOINT="pause=6:round-p2:0", AIV_FAILPOINT_MARK=str(mark))
        deadline = time.monotonic() + 180
        while not mark.exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert mark.exists(), describe(cluster, job)
    state, code, took = cluster.wait(job)
    assert (state, code) == ("COMPLETED", "0:0"), describe(cluster, job)
    log, _, js = cluster.outputs(job)
    v = load_json(js)
    assert v["failed_hosts"] == [] and v["exclude"] == "", describe(cluster, job)
    assert [(x["hosts"], x["rail"]) for x in v["suspect_links"]] == [(["node1", "node3"], 0)], v["suspect_links"]
    (warn,) = [f for f in v["findings"] if f["check"] in SCREEN_CHECKS and f["status"] != "PASS"
               and not f.get("transient")]  # a transient WARN of a loaded machine beside it names no host either
    assert warn["status"] == "WARN" and warn["hosts"] == [] and "suspect link" in warn["reason"], warn
    sc = v["screen"]
    (r1,) = [p for p in sc["pairs"] if p["round"] == 1 and p["nodes"] == ["node1", "node3"]]
    assert r1["tries"] >= 2, r1                       # re-measured while still limited, still slow
    assert sorted(s for s, _ in sc["third"]["groups"]) == ["node1", "node3"]
    with capsys.disabled():
        print(f"\n[slurm] screen, node3 at 50 Mbit/s in round 1 only: {took:.1f} s, busbw GB/s {pair_summary(sc)}; "
              f"{warn['reason']}")


# ---------------------------------------------------------------- where the verdict goes: drain, metrics, page, gate
TRAIN = """#!/bin/bash
#SBATCH --job-name=train
#SBATCH --ntasks-per-node=1
#SBATCH --time=2
#SBATCH --output=train_%j.out
srun hostname
"""


def node_states(cluster, nodes="node[1-4]"):
    r = cluster.run("scontrol", "show", "node", "-o", nodes)
    assert r.returncode == 0, r.stderr
    return aiv.parse_scontrol_nodes(r.stdout)


def drained(cluster):
    return {n: why for n, (st, why) in node_states(cluster).items() if "DRAIN" in st}


@contextlib.contextmanager
def resume_after(cluster, nodes="node[1-4]"):
    """Whatever happens, every node is back in service afterwards (the documented resume)."""
    try:
        yield
    finally:
        for n in drained(cluster):
            cluster.run("scontrol", "update", f"nodename={n}", "state=resume")


def job_field(cluster, job, field):
    m = re.search(rf"\b{field}=(\S+)", cluster.job_info(job)[2])
    return m.group(1) if m else ""


def wait_pending_reason(cluster, job, reason, limit=30):
    deadline = time.monotonic() + limit
    while job_field(cluster, job, "Reason") != reason and time.monotonic() < deadline:
        time.sleep(0.5)
    return job_field(cluster, job, "JobState"), job_field(cluster, job, "Reason")


def test_drain_on_drains_the_slow_node_alone_and_the_gate_holds_training(cluster, capsys):
    """node3's link rate-limited, AIV_DRAIN=on, --metrics: node3 alone is DRAIN with the tool's reason; the
    metrics parse and say so; the page beside the log outlines node3; a training job submitted with
    --dependency=afterok on the preflight never starts; the preflight resubmitted with --exclude from the
    JSON passes, and the training job behind it runs on the nodes that passed."""
    from prometheus_client.parser import text_string_to_metric_families
    train = cluster.workdir / "train.sbatch"
    train.write_text(TRAIN)
    metrics = cluster.workdir / f"aiv-{uuid.uuid4().hex}.prom"
    with resume_after(cluster):
        with slowed_link(cluster, "node3"):
            job = cluster.submit(*SHAPE_4X1, AIV_DRAIN="on", AIV_METRICS=str(metrics))
            r = cluster.run("sbatch", "--parsable", f"--dependency=afterok:{job}", "--nodes=1", train,
                            env=cluster.job_env())
            assert r.returncode == 0, r.stderr
            held = int(r.stdout.strip().split(";")[0])
            state, code, _ = cluster.wait(job)
        assert (state, code) == ("FAILED", "1:0"), describe(cluster, job)
        log, _, js = cluster.outputs(job)
        v = load_json(js)
        assert v["failed_hosts"] == ["node3"] and v["drain"]["done"] and v["drain"]["hosts"] == ["node3"], v["drain"]
        now = drained(cluster)
        assert list(now) == ["node3"], now
        assert now["node3"].startswith("aiv: inter-node: node node3 is slow") and now["node3"].endswith(f"(job {job})")
        assert f"DRAIN: drained node3: {v['drain_command']}" in log, describe(cluster, job)
        shown = cluster.run("scontrol", "show", "node", "node3").stdout
        # the metrics: atomically written, parseable, node3 failed and only node3
        fams = {f.name: f for f in text_string_to_metric_families(metrics.read_text())}
        status = {s.labels["node"]: s.value for s in fams["aiv_node_status"].samples}
        assert status == {"node1": 0, "node2": 0, "node3": 2, "node4": 0}, status
        assert fams["aiv_verdict_pass"].samples[0].value == 0 and fams["aiv_exit_code"].samples[0].value == 1
        assert not [p for p in cluster.workdir.iterdir() if p.name.startswith(".aiv-")]  # no temporary left
        # the page beside the log
        page = cluster.workdir / f"ai_infra_smoke_test_{job}.html"
        html = page.read_text()
        assert 'id="verdict"' in html and "FAIL" in html and 'class="culprit' in html and "node3" in html
        from test_html import check_in_browser
        shot = check_in_browser(page, "node3", 0, "slurm_node3_drained.png")
        # the gate: training never starts behind a FAIL
        assert wait_pending_reason(cluster, held, "DependencyNeverSatisfied") == ("PENDING", "DependencyNeverSatisfied")
        cluster.run("scancel", held)
        # resubmitted without the culprit: PASS, and the training job behind it runs
        job2 = cluster.submit("--nodes=3", *SHAPE_4X1[1:], f"--exclude={v['exclude']}")
        r = cluster.run("sbatch", "--parsable", f"--dependency=afterok:{job2}", "--nodes=3", train,
                        env=cluster.job_env())
        train2 = int(r.stdout.strip().split(";")[0])
        assert cluster.wait(job2)[:2] == ("COMPLETED", "0:0"), describe(cluster, job2)
        assert cluster.wait(train2)[:2] == ("COMPLETED", "0:0")
        ran = (cluster.workdir / f"train_{train2}.out").read_text().split()
        assert sorted(ran) == ["node1", "node2", "node4"], ran
    assert drained(cluster) == {}  # `scontrol update nodename=node3 state=resume` puts it back
    with capsys.disabled():
        print(f"\n[slurm] --drain on, node3 at 50 Mbit/s (job {job}): {v['drain_command']}\n"
              + "\n".join("    " + ln.strip() for ln in shown.splitlines() if re.search(r"State=|Reason=", ln))
              + "\n    metrics: " + " ".join(f"{k}={int(x)}" for k, x in sorted(status.items()))
              + f"\n    resubmitted --exclude={v['exclude']}: job {job2} PASS, training job {train2} ran on {ran}"
              + f"\n    page: {page.stat().st_size} bytes, screenshot {shot}")


def test_drain_on_a_widespread_cause_drains_nobody_and_says_why(cluster, capsys):
    """Every node's link rate-limited under an inter-node floor: every measurement slow, every node a
    suspect, none passing: widespread. With AIV_DRAIN=on nobody is drained, and the report says why."""
    with resume_after(cluster), contextlib.ExitStack() as stack:
        for n in ("node1", "node2", "node3", "node4"):
            stack.enter_context(slowed_link(cluster, n))
        job = cluster.submit(*SHAPE_4X1, AIV_DRAIN="on", AIV_MIN_BUSBW_INTER="0.05")
        state, code, _ = cluster.wait(job)
        assert drained(cluster) == {}
    log, _, js = cluster.outputs(job)
    v = load_json(js)
    assert (state, code) == ("FAILED", "1:0") and v["drain"]["hosts"] == [], describe(cluster, job)
    (line,) = [ln.strip() for ln in log.splitlines() if "DRAIN: nothing drained" in ln]
    assert "the cause is widespread" in line and v["drain_command"] == "", line
    with capsys.disabled():
        print(f"\n[slurm] every link at 50 Mbit/s, AIV_DRAIN=on: {line}")


def test_drain_apply_against_slurmctld_keeps_a_foreign_reason_and_quotes_a_refusal(cluster):
    """The real scontrol: node4 drained by an operator for a bad fan keeps that reason; an unprivileged
    user's scontrol drains nothing and is a WARN."""
    code = ("import json, sys; sys.path.insert(0, sys.argv[1]); import ddp_mesh_ping as aiv\n"
            "p = aiv.drain_plan([aiv.finding('gpu-perf', 'FAIL', 'slow GPU', [sys.argv[2]], blame='persisted')], "
            "'on', 4, '9')\n"
            "print(json.dumps(aiv.drain_apply(p)))\n")
    with resume_after(cluster):
        assert cluster.run("scontrol", "update", "nodename=node4", "state=drain", "reason=bad fan").returncode == 0
        r = cluster.run(VENV_PY, "-c", code, REPO, "node4")
        plan, warns = json.loads(r.stdout)
        assert warns == [] and not plan["done"] and plan["kept"] == {"node4": "bad fan"}, r.stdout + r.stderr
        assert drained(cluster) == {"node4": "bad fan"}
        wrapper = cluster.workdir / "bin" / "scontrol"
        wrapper.parent.mkdir(exist_ok=True)
        wrapper.write_text(f'#!/bin/bash\nexec runuser -u nobody -- {shutil.which("scontrol")} "$@"\n')
        wrapper.chmod(0o755)
        env = dict(cluster.env, PATH=f"{wrapper.parent}:{os.environ['PATH']}")
        r = cluster.run(VENV_PY, "-c", code, REPO, "node2", env=env)
        plan, (warn,) = json.loads(r.stdout)
        # slurmctld refuses an unprivileged update (or, where nobody cannot read the test cluster's private
        # configuration, scontrol never answers): either way a WARN, within DRAIN_S, and nothing drained
        assert warn["status"] == "WARN" and warn["reason"].startswith("nothing drained: "), warn
        assert drained(cluster) == {"node4": "bad fan"}
