"""The node gate on a real Slurm 22.05 cluster (tests/slurm_cluster.sh, three nodes in network namespaces, two
fake GPUs each): the script of docs/slurm.md, verbatim, as Prolog=, Epilog= and HealthCheckProgram=, with the
slurm.conf lines that page asks for. A test-side wrapper only points the script at this repository and its venv
(`NODE_CHECK_*`), says the nodes have no real GPU (AIV_EXPECT_GPUS=0: CPU workers stand in for the fake ones),
gives each cluster its own TMPDIR, lock directory (--node-lock-dir) and SLURM_CONF (a HealthCheckProgram gets
none; a real node's scontrol reads /etc/slurm/slurm.conf), and, per node, by a flag file, injects a fault from outside:
tests/sdc on the PYTHONPATH with NUMERICS_FAULT_LOCAL_RANK=1 (a GPU computing wrong numbers), a torch that fails
to import or no python at all (the tool broken). Health checks run only on nodes whose flag arms them.

Asserted: jobs start on healthy nodes; a node with the corruption is drained with the gate's reason and the job
runs elsewhere (prolog) or never lands there (health); a broken tool drains nothing; a node busy with another
job's load is not drained for speed. Nothing here depends on how loaded the machine is: bounds are generous."""
import datetime
import json
import os
import re
import shutil
import subprocess
import time
from pathlib import Path

import fork_task
import pytest
from test_slurm import CLUSTER_SH, REQUIRED_TOOLS, VENV_PY, Cluster, _skip_or_fail

from conftest import SCRIPT, aiv, clean_env, forks

REPO = Path(__file__).resolve().parent.parent
TOOL = REPO / "ddp_mesh_ping.py"
SDC = REPO / "tests" / "sdc"
NODES = ("node1", "node2", "node3")
WAIT_S = 150


def fenced(text):
    """The fenced code blocks of a Markdown text: [(language, body)]."""
    out, lang, body = [], None, []
    for ln in text.splitlines(keepends=True):
        if ln.startswith("```"):
            if lang is None:
                lang, body = ln[3:].strip(), []
            else:
                out.append((lang, "".join(body)))
                lang = None
        elif lang is not None:
            body.append(ln)
    return out


def documented_script():
    """The bash block of docs/slurm.md that is /etc/slurm/aiv-node-check.sh."""
    (script,) = [b for lang, b in fenced((REPO / "docs" / "slurm.md").read_text())
                 if lang == "bash" and b.startswith("#!/bin/bash\n# /etc/slurm/aiv-node-check.sh")]
    return script


def documented_conf():
    """The slurm.conf block of docs/slurm.md's node gate section, with the script's path still /etc/slurm."""
    (conf,) = [b for lang, b in fenced((REPO / "docs" / "slurm.md").read_text())
               if lang == "" and "HealthCheckProgram=" in b]
    return conf


WRAPPER = """#!/bin/bash
# test-side: point the documented script at this repository and inject faults per node by flag files
n=$(hostname)
F={flags}
ctx=${{SLURM_SCRIPT_CONTEXT:-health}}
ctx=${{ctx%_slurmd}}
if [ "$ctx" = health ] && [ ! -e "$F/health-$n" ]; then exit 0; fi
mkdir -p "{out}/$n"
export NODE_CHECK_PYTHON={python} NODE_CHECK_TOOL={tool} NODE_CHECK_DIR="{out}/$n" NODE_CHECK_LOG="{out}/$n/$ctx.log"
# SLURM_CONF: the cluster's (a node's own is /etc/slurm/slurm.conf)
export TMPDIR={tmp} AIV_NODE_LOCK_DIR={locks} AIV_EXPECT_GPUS=0 AIV_NPROC=2 SLURM_CONF={conf}
if [ -e "$F/corrupt-$n" ]; then export PYTHONPATH={sdc} NUMERICS_FAULT_LOCAL_RANK=1; fi
if [ -e "$F/notorch-$n" ]; then export PYTHONPATH={notorch}; fi
if [ -e "$F/nopython-$n" ]; then export NODE_CHECK_PYTHON=/nonexistent/bin/python; fi
if [ -e "$F/undrain-$n" ]; then export AIV_UNDRAIN=1; fi
if [ -e "$F/slow-$n" ]; then export AIV_NODE_BUDGET=50; fi
if [ -e "$F/gpus3-$ctx-$n" ]; then export AIV_EXPECT_GPUS=3; fi  # a node that should have 3 GPUs, lists none
echo "$(date +%s.%N) $ctx" >> "{out}/$n/runs"
if [ -e "$F/delay-$ctx-$n" ]; then sleep 6; fi  # this node's gate ends later than the others'
"{script}" >> "{out}/$n/$ctx.summary"
"""


class Gate(Cluster):
    def __init__(self, state, work):
        super().__init__(state, work)
        self.flags, self.out, self.tmp = work / "flags", work / "out", work / "tmp"

    def flag(self, name, on=True):
        p = self.flags / name
        if on:
            p.touch()
        else:
            p.unlink(missing_ok=True)

    def clear_flags(self):
        for p in self.flags.iterdir():
            p.unlink()

    def verdict(self, node, ctx):
        p = self.out / node / f"aiv_node_check_{ctx}.json"
        return json.loads(p.read_text()) if p.exists() else None

    def pass_after(self, node, t, limit=WAIT_S):
        """The first health pass on node that started after t and wrote its files (a pass that found another
        one running writes none, only its summary line)."""
        def fresh():
            v = self.verdict(node, "health")
            started = datetime.datetime.fromisoformat(v["started_at"]).timestamp() if v else 0
            return v if started >= int(t) else None
        return self.wait_for(fresh, limit, f"a health pass on {node} after the load started")

    def summaries(self, node, ctx):
        p = self.out / node / f"{ctx}.summary"
        return p.read_text().splitlines() if p.exists() else []

    def states(self):
        return aiv.parse_scontrol_nodes(self.run("scontrol", "show", "node", "-o").stdout)

    def quiet(self, limit=90):
        """Until no node check of this cluster runs (found by the TMPDIR the wrapper gives them)."""
        tag = f"TMPDIR={self.tmp}".encode()

        def running():
            for pid in filter(str.isdigit, os.listdir("/proc")):
                try:
                    cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
                    if b"--node-check" in cmd and tag in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
                        return True
                except OSError:
                    continue
            return False
        self.wait_for(lambda: not running(), limit, "no node check running")

    def sinfo_r(self):
        return self.run("sinfo", "-R", "-h", "-o", "%N|%E").stdout.strip()

    def resume_all(self):
        for n, (st, _) in self.states().items():
            if "DRAIN" in st or "DOWN" in st:
                self.run("scontrol", "update", f"nodename={n}", "state=resume")

    def submit_job(self, *args, script="hostname\n", gpus=True):
        body = self.work_script(script)
        r = self.run("sbatch", "--parsable", *(["--gpus-per-node=2"] if gpus else []), "-o",
                     str(self.workdir / "job_%j.out"), *args, body, env=self.job_env())
        assert r.returncode == 0, r.stdout + r.stderr
        return int(r.stdout.strip().split(";")[0])

    def work_script(self, body):
        p = self.workdir / f"job_{time.monotonic_ns()}.sh"
        p.write_text("#!/bin/bash\n" + body)
        return p

    def ran_on(self, job):
        m = re.search(r"\bNodeList=(\S+)", self.job_info(job)[2])
        return m.group(1) if m else None

    def wait_for(self, pred, limit=WAIT_S, what="the condition"):
        t0 = time.monotonic()
        while time.monotonic() - t0 < limit:
            got = pred()
            if got:
                return got
            time.sleep(0.5)
        pytest.fail(f"{what} not reached within {limit}s; sinfo -R: {self.sinfo_r()}")


@pytest.fixture(scope="module")
def gate(tmp_path_factory):
    missing = [t for t in REQUIRED_TOOLS if shutil.which(t) is None]
    if missing:
        _skip_or_fail("Slurm or namespace tools not installed: " + ", ".join(missing))
    if os.geteuid() != 0:
        _skip_or_fail("needs root (network namespaces, mknod, Slurm daemons)")
    if not VENV_PY.exists():
        _skip_or_fail(f"the tests must run in a venv: {VENV_PY} missing")
    state, work = tmp_path_factory.mktemp("gate-slurm"), tmp_path_factory.mktemp("gate-work")
    for d in ("flags", "out", "tmp", "locks", "notorch/torch"):
        (work / d).mkdir(parents=True)
    os.chmod(work / "locks", 0o755)  # the nodes' locks: a directory only root writes (--node-lock-dir)
    os.chmod(work / "tmp", 0o1777)
    (work / "notorch" / "torch" / "__init__.py").write_text("raise ImportError('torch broken on this node (test)')\n")
    script = work / "aiv-node-check.sh"
    script.write_text(documented_script())
    # the gate's runs forked from a fork server of this pytest process (tests/fork_task.py) rather than each
    # importing torch, where AIV_TEST_FORK allows: slurmd gives a prolog no environment of the caller's, so the
    # server imports torch without the caller's variables that python or torch read
    server = forks.Server(SCRIPT, {k: v for k, v in clean_env().items() if not forks.sensitive(k)}) \
        if forks.enabled() else None
    python = VENV_PY if server is None else Path(fork_task.task_python(str(work / "forkenv"), server)) / "bin/python"
    wrapper = work / "gate.sh"
    wrapper.write_text(WRAPPER.format(flags=work / "flags", out=work / "out", python=python, tool=TOOL,
                                      tmp=work / "tmp", locks=work / "locks", sdc=SDC, notorch=work / "notorch",
                                      script=script,
                                      conf=state / "etc" / "slurm.conf"))
    for p in (script, wrapper):
        p.chmod(0o755)
    conf = documented_conf().replace("/etc/slurm/aiv-node-check.sh", str(wrapper))
    conf = conf.replace("HealthCheckInterval=600", "HealthCheckInterval=5").replace(",CYCLE", "")
    conf = conf.replace("SchedulerParameters=nohold_on_prolog_fail",
                        "SchedulerParameters=batch_sched_delay=0,sched_min_interval=0,nohold_on_prolog_fail,"
                        "bf_interval=1,sched_interval=1\nAuthInfo=cred_expire=5")
    # a requeued job starts again 5 s later, not 120 (the credential's life), and is placed within a second of that,
    # not at the main scheduler's next pass (sched_interval: 60 s)
    env = dict(os.environ, AIV_SLURM_DIR=str(state), SLURM_NODES="3", NODE_CPUS="4", NODE_GPUS="2",
               AIV_SLURM_SUBNET="10.76.0", SLURM_CONF_EXTRA=conf)
    r = subprocess.run(["bash", str(CLUSTER_SH), "up"], env=env, capture_output=True, text=True, timeout=180)
    if r.returncode == 3:
        _skip_or_fail("slurm_cluster.sh refused to start: " + r.stderr.strip())
    if r.returncode != 0:
        subprocess.run(["bash", str(CLUSTER_SH), "down"], env=env, capture_output=True, timeout=120)
        pytest.fail(f"slurm_cluster.sh up failed ({r.returncode}):\n{r.stdout}\n{r.stderr}")
    g = Gate(state, work)
    g.fork_server = server
    try:
        yield g
    finally:
        g.stop_fork_server()
        d = subprocess.run(["bash", str(CLUSTER_SH), "down"], env=env, capture_output=True, text=True, timeout=180)
        assert d.returncode == 0, d.stdout + d.stderr


@pytest.fixture
def clean(gate):
    gate.clear_flags()
    gate.quiet()
    gate.resume_all()
    yield gate
    gate.clear_flags()
    gate.quiet()
    gate.resume_all()


def test_the_documented_script_is_shellcheck_clean(tmp_path):
    if not shutil.which("shellcheck"):
        pytest.skip("shellcheck not installed")
    p = tmp_path / "aiv-node-check.sh"
    p.write_text(documented_script())
    r = subprocess.run(["shellcheck", "-S", "style", str(p)], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout


def test_jobs_start_on_healthy_nodes_through_prolog_and_epilog(clean, capsys):
    g = clean
    job = g.submit_job("--nodes=3", script="srun hostname\n")
    state, code, _ = g.wait(job)
    assert (state, code) == ("COMPLETED", "0:0"), g.job_info(job)[2]
    for n in NODES:  # PrologFlags=Alloc: every node's prolog ran before the job started
        v = g.wait_for(lambda n=n: g.verdict(n, "epilog"), 60, f"{n}'s epilog verdict")
        p = g.verdict(n, "prolog")
        assert p["verdict"] == "PASS" and p["devices"]["ids"] == [0, 1] and p["exit_code"] == 0, p["summary"]
        assert {"numerics", "gpu-perf", "intra-node"} <= {f["check"] for f in p["findings"]}
        assert v["verdict"] == "PASS" and v["measured"] == {}, v["summary"]  # the epilog stays passive
    assert g.sinfo_r() == ""
    with capsys.disabled():
        print(f"\n[node gate] job {job} on node[1-3]: " + g.verdict("node1", "prolog")["summary"]
              + f"\n    epilog: {g.verdict('node1', 'epilog')['summary']}")


def test_a_corrupt_node_fails_its_prolog_is_drained_with_our_reason_and_the_job_runs_elsewhere(clean, capsys):
    g = clean
    g.flag("corrupt-node1")  # the scheduler's first choice among idle nodes
    job = g.submit_job("--nodes=1")
    state, code, _ = g.wait(job, limit=WAIT_S)
    assert (state, code) == ("COMPLETED", "0:0"), g.job_info(job)[2]
    ran = g.ran_on(job)
    states = g.states()
    st, why = states["node1"]
    assert "DRAIN" in st and why.startswith("aiv: node-check: numerics: GPU 1 computes wrong numbers"), states
    assert why.endswith("[prolog]") and ran in ("node2", "node3"), (ran, states)
    p = g.verdict("node1", "prolog")
    assert p["verdict"] == "FAIL" and p["exit_code"] == 1 and p["drain"]["done"], p["summary"]
    (f,) = [f for f in p["findings"] if f["status"] == "FAIL"]
    assert (f["check"], f["blame"], f["gpus"]) == ("numerics", "reference", [1])
    restarts = re.search(r"Restarts=(\d+)", g.job_info(job)[2]).group(1)
    sinfo = g.sinfo_r()
    assert sinfo.splitlines() == [f"node1|{why}"], sinfo
    with capsys.disabled():
        print(f"\n[node gate] prolog on corrupt node1: job {job} requeued ({restarts} restart) and ran on {ran}"
              f"\n    sinfo -R: {sinfo}\n    {p['summary']}")


def test_health_drains_a_corrupt_node_and_jobs_go_elsewhere_then_resumes_its_own_drain(clean, capsys):
    g = clean
    g.flag("corrupt-node1")
    g.flag("health-node1")
    h = g.wait_for(lambda: (lambda v: v if v and v["drain"].get("done") else None)(g.verdict("node1", "health")),
                   WAIT_S, "node1 drained by its health check")
    g.flag("health-node1", on=False)  # (no more passes until the repair: each imports torch twice)
    st, why = g.states()["node1"]
    assert "DRAIN" in st and h["drainable"] and h["exit_code"] == 1, h["summary"]
    assert why.startswith("aiv: node-check: numerics: GPU 1 computes wrong numbers") and why.endswith("[health]")
    sinfo = g.sinfo_r()
    job = g.submit_job("--nodes=1")
    assert g.wait(job)[:2] == ("COMPLETED", "0:0") and g.ran_on(job) in ("node2", "node3")
    # repaired: the next pass passes, and with --undrain (AIV_UNDRAIN=1) resumes the drain it wrote itself
    g.flag("corrupt-node1", on=False)
    g.flag("undrain-node1")
    g.flag("health-node1")
    resumed = g.wait_for(lambda: (lambda v: v if "resumed our own drain" in ((v or {}).get("drain") or {}).get(
        "said", "") else None)(g.verdict("node1", "health")), WAIT_S, "node1 resumed by its health check")
    assert resumed["verdict"] == "PASS" and "DRAIN" not in g.states()["node1"][0], resumed["summary"]
    with capsys.disabled():
        print(f"\n[node gate] HealthCheckProgram on corrupt node1: sinfo -R: {sinfo}\n    {h['summary']}"
              f"\n    after the repair, with --undrain: {resumed['summary']}")


def test_a_gpu_missing_after_the_job_fails_its_epilog_and_the_node_keeps_our_reason(clean, capsys):
    g = clean
    g.flag("gpus3-epilog-node1")
    job = g.submit_job("--nodes=1", "-w", "node1")
    assert g.wait(job)[:2] == ("COMPLETED", "0:0"), g.job_info(job)[2]
    e = g.wait_for(lambda: g.verdict("node1", "epilog"), 60, "node1's epilog verdict")
    st, why = g.wait_for(lambda: (lambda s: s if "DRAIN" in s[0] else None)(g.states()["node1"]), 60,
                         "node1 drained after its epilog")
    assert why.startswith("aiv: node-check: gpu-count: 0 of 3 GPUs expected") and why.endswith("[epilog]"), why
    assert e["verdict"] == "FAIL" and e["exit_code"] == 1 and e["measured"] == {}, e["summary"]
    sinfo = g.sinfo_r()
    with capsys.disabled():
        print(f"\n[node gate] epilog on node1 expecting 3 GPUs: sinfo -R: {sinfo}\n    {e['summary']}")


@pytest.mark.parametrize("broken", ["notorch", "nopython"])
def test_a_broken_tool_drains_nothing(clean, broken, capsys):
    g = clean
    for n in NODES:
        g.flag(f"{broken}-{n}")
    g.flag("health-node1")
    before = len(g.summaries("node1", "health"))
    g.wait_for(lambda: len(g.summaries("node1", "health")) > before, WAIT_S, "a health pass on node1")
    # that pass, on the idle node: a later one may fall while the job holds node1's GPUs (busy, not judged)
    health = g.summaries("node1", "health")[before]
    job = g.submit_job("--nodes=1")
    assert g.wait(job)[:2] == ("COMPLETED", "0:0"), g.job_info(job)[2]
    assert g.sinfo_r() == ""
    line = g.summaries(g.ran_on(job), "prolog")[-1]
    assert "NOT ASSESSED" in line and "exit 0 (fail open" in line, line
    assert "NOT ASSESSED" in health, health
    with capsys.disabled():
        print(f"\n[node gate] {broken}: prolog: {line}\n    health: {health}\n    sinfo -R: (empty)")


def test_a_node_busy_with_another_jobs_load_is_not_drained_for_speed(clean, capsys):
    """node3 runs a job that holds both its GPUs; then a job without GPUs burns its CPUs: a health pass beside
    the first judges no GPU (every one busy: NOT ASSESSED, never a PASS), beside the second it measures the CPU
    workers under load, and neither drains the node."""
    g = clean
    burn = ("srun --cpu-bind=none python3 -c 'import multiprocessing as m, time\n"
            "def spin(_):\n    t = time.time()\n    while time.time() - t < 40: pass\n"
            "m.Pool(4).map(spin, range(4))'\n")
    job = g.submit_job("--nodes=1", "-w", "node3", "--cpus-per-task=4", script="srun sleep 40\n")
    g.wait_for(lambda: g.job_info(job)[0] == "RUNNING", 60, "the busy job running")
    t = time.time()
    g.flag("health-node3")
    h = g.pass_after("node3", t)
    assert h["verdict"] == "NOT ASSESSED" and set(h["devices"]["busy"]) == {"0", "1"} and h["measured"] == {}, \
        h["summary"]
    assert "every CPU worker busy, none judged" in h["summary"] and h["exit_code"] == 0
    assert "DRAIN" not in g.states()["node3"][0]
    assert "allocated to running jobs" in h["devices"]["busy"]["0"]  # Slurm 22.05 says no IDX for fake GPUs
    g.run("scancel", job)
    g.flag("slow-node3")  # a budget that fits two imports of torch on a loaded machine
    cpu = g.submit_job("--nodes=1", "-w", "node3", "--cpus-per-task=4", script=burn, gpus=False)
    g.wait_for(lambda: g.job_info(cpu)[0] == "RUNNING", 60, "the CPU-only busy job running")
    loaded = g.pass_after("node3", time.time() + 1)
    g.run("scancel", cpu)
    assert "gpu-perf" in {f["check"] for f in loaded["findings"]} and loaded["verdict"] == "PASS", loaded["summary"]
    assert "DRAIN" not in g.states()["node3"][0] and g.sinfo_r() == ""
    with capsys.disabled():
        print(f"\n[node gate] node3 busy (job {job} holds its GPUs): {h['summary']}\n    beside a CPU-only "
              f"load: {loaded['summary']}")


def test_the_batch_script_starts_only_after_every_nodes_prolog_passed(clean, capsys):
    """PrologFlags=Alloc,DeferBatch: with Alloc alone the batch script starts when the first node's prolog
    ends; here node2's and node3's prologs end 6 s after node1's, and the script must not start before them."""
    g = clean
    for n in ("node2", "node3"):
        g.flag(f"delay-prolog-{n}")
    t0 = time.time()
    job = g.submit_job("--nodes=3", script='echo "batch-start $(date +%s.%N)"\nsrun hostname\n')
    assert g.wait(job)[:2] == ("COMPLETED", "0:0"), g.job_info(job)[2]
    start = float(re.search(r"batch-start (\S+)", (g.workdir / f"job_{job}.out").read_text()).group(1))
    ends = {n: g.verdict(n, "prolog")["ended_at_s"] for n in NODES}
    assert all(t0 - 1 <= e for e in ends.values()), (t0, ends)  # this job's prologs
    assert all(start >= e - 0.1 for e in ends.values()), (start, ends)  # ended_at_s is rounded to 0.1 s
    assert max(ends.values()) - min(ends.values()) >= 3, ends  # the delay held: Alloc alone would start early
    with capsys.disabled():
        print(f"\n[node gate] DeferBatch: the batch script started {start - max(ends.values()):.1f}s after the "
              f"last prolog ended (prologs ended over {max(ends.values()) - min(ends.values()):.1f}s)")


def test_an_interactive_srun_whose_prolog_fails_ends_nonzero_and_the_node_is_drained(clean, capsys):
    """An srun outside a batch job cannot be requeued: it ends with an error, and the node is drained all the
    same (docs/slurm.md, batch and interactive jobs)."""
    g = clean
    g.flag("corrupt-node1")
    r = g.run("srun", "-w", "node1", "-N1", "--gpus-per-node=2", "hostname", env=g.job_env(), timeout=WAIT_S)
    st, why = g.wait_for(lambda: (lambda s: s if "DRAIN" in s[0] else None)(g.states()["node1"]), 60,
                         "node1 drained by its prolog")
    assert r.returncode != 0 and "node1" not in r.stdout, r.stdout + r.stderr
    assert why.startswith("aiv: node-check: numerics: GPU 1 computes wrong numbers") and why.endswith("[prolog]")
    with capsys.disabled():
        print(f"\n[node gate] interactive srun on corrupt node1: exit {r.returncode}: {r.stderr.strip()}"
              f"\n    sinfo -R: {g.sinfo_r()}")


def test_the_logrotate_block_rotates_the_scripts_default_log():
    text = (REPO / "docs" / "slurm.md").read_text()
    (block,) = [b for lang, b in fenced(text) if lang == "" and "rotate" in b]
    default = re.search(r"LOG=\$\{NODE_CHECK_LOG:-(\S+)\}", documented_script()).group(1)
    assert block.startswith(default + " {") and "copytruncate" not in block

