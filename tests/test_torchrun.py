"""torchrun, for real: the agent serves the store (every rank is its client), the keys carry the run
id, torchrun's own shape is the expectation, a dead worker makes the agent SIGTERM the others and
rank 0 still names it, and two agents in two network namespaces with their own hostnames make a
2-node run."""
import contextlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from conftest import SCRIPT, aiv, clean_env, failures, free_port, state

TORCHRUN = Path(sys.executable).with_name("torchrun")
if not TORCHRUN.exists():
    pytest.skip(f"no torchrun beside {sys.executable}", allow_module_level=True)


def torchrun(*args, env=None, timeout=180, prefix=()):
    cmd = [*prefix, str(TORCHRUN), *map(str, args)]
    return subprocess.run(cmd, env=clean_env(env), capture_output=True, text=True, timeout=timeout)


def test_standalone_passes_with_torchruns_shape():
    r = torchrun("--standalone", "--nproc-per-node", 2, SCRIPT, "--timeout", 60)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "Total Execution Ranks: 2" in r.stdout and aiv.SUCCESS_LINE in r.stdout
    assert "expect: nodes=1 ranks_per_node=2 world_size=2" in r.stdout       # torchrun's shape
    assert "address already in use" not in r.stdout


def test_static_rendezvous_passes():
    r = torchrun("--nnodes", 1, "--nproc-per-node", 2, "--master-addr", "127.0.0.1", "--master-port", free_port(),
                 SCRIPT, "--timeout", 60)
    assert r.returncode == 0, r.stdout + r.stderr
    assert aiv.SUCCESS_LINE in r.stdout


@pytest.mark.parametrize("fault,word,code", [("die", "dead (process gone)", 1),
                                             ("hang", "frozen (process stopped)", 3)])
def test_failpoints_under_torchrun_give_the_named_verdict(fault, word, code, tmp_path):
    """die: the agent SIGTERMs the others at once and rank 0 gives its verdict on the signal; hang:
    rank 0's own deadline names the frozen rank (the agent then kills the stopped worker)."""
    jp = tmp_path / "v.json"
    t0 = time.monotonic()
    agent = subprocess.Popen([str(TORCHRUN), "--standalone", "--nproc-per-node", "3", str(SCRIPT), "--timeout", "8",
                              "--json", str(jp)], env=clean_env({"AIV_FAILPOINT": f"{fault}:collective:1"}),
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if fault == "hang":
        # the verdict is in once rank 0 wrote the JSON; the agent's SIGTERM cannot end a stopped worker and it
        # waits its fixed 30 s before SIGKILL: the test kills the stopped worker itself, as a node would
        deadline = time.monotonic() + 120
        while not jp.exists() and agent.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        while agent.poll() is None and time.monotonic() < deadline:
            stopped = [c for c in psutil.Process(agent.pid).children(recursive=True)
                       if state(c) == psutil.STATUS_STOPPED]
            if stopped:
                for c in stopped:
                    with contextlib.suppress(psutil.NoSuchProcess):
                        c.kill()
                break
            time.sleep(0.2)
    try:
        out, err = agent.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        agent.kill()
        out, err = agent.communicate()
    r = subprocess.CompletedProcess(agent.args, agent.returncode, out, err)
    assert r.returncode != 0                               # torchrun's code: some worker exited non-zero
    lines = failures(r.stdout)
    assert len(lines) == 1 and lines[0].startswith("FAILURE: collective:") and "rank 1 (" in lines[0], r.stdout
    assert word in lines[0] and "Traceback" not in r.stdout
    d = json.loads(jp.read_text())
    assert d["exit_code"] == code and d["failed_hosts"] and [f["ranks"] for f in d["findings"]
                                                            if f["status"] == "FAIL"] == [[1]]
    assert time.monotonic() - t0 < 120


def test_rank_0_killed_under_torchrun_still_leaves_a_verdict_line_and_the_json(tmp_path):
    """torchrun SIGTERMs the other workers once rank 0 died: before, nobody spoke and no JSON was left.
    A worker on rank 0's node sees rank 0's process gone with no verdict and speaks for it, once."""
    jp = tmp_path / "v.json"
    r = torchrun("--standalone", "--nproc-per-node", 3, SCRIPT, "--timeout", 20, "--json", jp,
                 env={"AIV_FAILPOINT": "die:collective:0"}, timeout=240)
    assert r.returncode != 0
    lines = failures(r.stdout)
    assert len(lines) == 1 and lines[0].startswith("FAILURE: rendezvous: rank 0 (") and "died during" in lines[0], \
        r.stdout + r.stderr
    d = json.loads(jp.read_text())
    assert d["verdict"] == "FAIL" and d["exit_code"] == aiv.EXIT_TIMEOUT and d["failed_hosts"] and "written_by" in d


# ---------------------------------------------------------------- two agents, two namespaces
def _skip_or_fail(msg):
    if os.environ.get("CI") == "true":
        pytest.fail(msg)
    pytest.skip(msg)


def sh(*cmd):
    subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=30)


@pytest.fixture
def two_namespaces():
    """aivtr1 (10.79.0.1) and aivtr2 (10.79.0.2), joined by a veth pair named eth0 on both sides."""
    if os.geteuid() != 0 or not shutil.which("ip") or not shutil.which("unshare"):
        _skip_or_fail("needs root, ip (iproute2) and unshare (util-linux) for network namespaces")
    tag = str(os.getpid() % 10000)
    ns = [f"aivtr{tag}a", f"aivtr{tag}b"]
    try:
        for n in ns:
            sh("ip", "netns", "add", n)
        sh("ip", "link", "add", f"aivt{tag}a", "type", "veth", "peer", "name", f"aivt{tag}b")
        for i, n in enumerate(ns):
            dev = f"aivt{tag}{'ab'[i]}"
            sh("ip", "link", "set", dev, "netns", n)
            sh("ip", "-n", n, "link", "set", dev, "name", "eth0")
            sh("ip", "-n", n, "addr", "add", f"10.79.0.{i + 1}/24", "dev", "eth0")
            sh("ip", "-n", n, "link", "set", "eth0", "up")
            sh("ip", "-n", n, "link", "set", "lo", "up")
        yield ns
    finally:
        for n in ns:
            subprocess.run(["ip", "netns", "del", n], capture_output=True, timeout=30)


def two_node_run(ns, extra_env=None):
    port = 29611
    procs = []
    for i, n in enumerate(ns):
        cmd = ["ip", "netns", "exec", n, "unshare", "--uts", "sh", "-c",
               f'hostname tnode{i + 1} && exec "$@"', "sh", str(TORCHRUN), "--nnodes", "2", "--node-rank", str(i),
               "--nproc-per-node", "1", "--master-addr", "10.79.0.1", "--master-port", str(port),
               str(SCRIPT), "--timeout", "30", "--rollcall-timeout", "60"]
        procs.append(subprocess.Popen(cmd, env=clean_env(extra_env), stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    outs = []
    for p in procs:
        try:
            out, _ = p.communicate(timeout=180)
        except subprocess.TimeoutExpired:
            p.kill()
            out, _ = p.communicate()
        outs.append((p.returncode, out))
    return outs


@pytest.mark.parametrize("secret", [None, "e1" * 32])
def test_two_agents_in_two_namespaces_make_a_two_node_run(two_namespaces, secret):
    """With AIV_JOB_SECRET exported before both torchruns (docs/launchers.md) the side channel is authenticated;
    without it the run passes with the WARN that says so."""
    env = {"GLOO_SOCKET_IFNAME": "eth0", **({"AIV_JOB_SECRET": secret} if secret else {})}
    (rc1, out1), (rc2, out2) = two_node_run(two_namespaces, env)
    assert rc1 == 0 and rc2 == 0, out1 + out2
    assert "Total Execution Ranks: 2" in out1 and aiv.SUCCESS_LINE in out1
    assert "nodes=2 ranks_reported=2/2" in out1 and "node=tnode1 " in out1 and "node=tnode2 " in out1
    assert "[PASS] interface: gloo uses eth0(10.79.0.1) on tnode1; eth0(10.79.0.2) on tnode2" in out1
    if secret:
        assert "[PASS] rendezvous: side channel authenticated" in out1 and secret not in out1 + out2
    else:
        assert "[WARN] rendezvous: side channel not authenticated: AIV_JOB_SECRET is not set" in out1


def test_two_nodes_on_gloos_loopback_fallback_fail_the_interface_check(two_namespaces):
    """No GLOO_SOCKET_IFNAME and hostnames that do not resolve: gloo would bind loopback on each node."""
    (rc1, out1), (rc2, out2) = two_node_run(two_namespaces)
    assert rc1 != 0 and rc2 != 0
    (line,) = failures(out1)
    assert line.startswith("FAILURE: interface: gloo would use the loopback address") and "tnode[1-2]" in line
    assert "init:" not in out1                                     # judged at the roll call
