"""The roll call's last call and a python without torch, with real processes: one rank per simulated host
(SLURMD_NODENAME=n0, n1, ...), srun-style variables, launched by hand as srun would.

A rank that can never arrive (its MASTER_ADDR does not resolve, it never started) costs the last call, not the
whole roll call: rank 0 names it with its host from Slurm's plan within 60 s at the defaults (it waited 301.7 s
and said "did not check in within 300s"). A rank whose process said hello keeps the whole bound: a slow start
is never named by the last call. A python without torch is the launch's environment: exit 2, no host named,
unless the node alone of several cannot import what a strict majority of the job's nodes import."""
import json
import os
import shutil
import subprocess
import time

import pytest

from conftest import SCRIPT, aiv, clean_env, describe, failures, finish, free_port, tool_ranks

SLURM2 = {"SLURM_JOB_ID": "77", "SLURM_JOB_NODELIST": "n[0-1]", "SLURM_TASKS_PER_NODE": "1(x2)", "SLURM_NNODES": "2"}


def no_torch_python():
    """An interpreter that cannot import torch: the system python in isolated mode, if it has none."""
    for py in ("/usr/bin/python3", shutil.which("python3")):
        if py and subprocess.run([py, "-I", "-c", "import torch"], capture_output=True).returncode != 0:
            return [py, "-I"]
    pytest.skip("no python without torch on this machine")


def start(world, tmp_path, per_rank=None, args=(), extra=None, python=None):
    """One rank per simulated host n0..n<world-1>; per_rank: {rank: variables}; python: {rank: argv prefix}."""
    port = free_port()
    envs = [clean_env({"RANK": r, "WORLD_SIZE": world, "LOCAL_RANK": 0, "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": port, "SLURMD_NODENAME": f"n{r}", "AIV_JSON": tmp_path / "v.json",
                       **(extra or {}), **(per_rank or {}).get(r, {})}) for r in range(world)]
    return tool_ranks(envs, args, python=python, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)


# -- the last call as plain data
def test_the_last_call_grace_scales_with_the_bound_and_the_launch():
    assert aiv.last_call_grace(aiv.ROLLCALL_DEFAULT, 2.0) == 30.0  # torchrun's last_call_timeout at the defaults
    assert aiv.last_call_grace(aiv.ROLLCALL_DEFAULT, 40.0) == 80.0  # a slow launch: twice what it showed
    assert aiv.last_call_grace(aiv.ROLLCALL_DEFAULT, 400.0) == aiv.ROLLCALL_DEFAULT  # never past the bound
    assert aiv.last_call_grace(25, 0.5) == aiv.LAST_CALL_MIN_S and aiv.last_call_grace(3, 0.5) == 3


def walk(world, events, step=0.5, horizon=400.0, rollcall=aiv.ROLLCALL_DEFAULT):
    """LastCall fed like rank 0's wait: events [(t, 'hello'|'in')] of the ranks; -> the time it fell due, or None."""
    lc, t = aiv.LastCall(world, rollcall, 0.0), 0.0
    while t <= horizon:
        present = sum(1 for at, k in events if k == "in" and at <= t)
        if present >= world:  # every rank checked in: the roll call is complete
            return None
        heard = present + sum(1 for at, k in events if k == "hello" and at <= t)
        if lc.seen(t, present, heard).due(t):
            return t
        t += step
    return None


@pytest.mark.parametrize("spread,imp", [(60.0, 20), (240.0, 40)])
def test_a_slow_launcher_at_scale_never_meets_the_last_call(spread, imp):
    """4,096 ranks started over `spread` seconds (a launcher at scale), each saying hello 0.3 s after its start and
    checking in after an import of torch of `imp` to 2 x `imp` seconds: the last call never falls due while ranks
    keep arriving, nor before the latest arrival; one rank that never starts is named by the last call (twice
    what half the world took, past the latest news) or, when the launch itself took most of it, by the bound."""
    world, events = 4096, []
    for i in range(world - 2):  # rank 0 below, one rank never starts
        start = spread * i / world
        events += [(start + 0.3, "hello"), (start + imp + (i * 7919 % (imp + 1)), "in")]
    last = max(t for t, _ in events)
    due = walk(world, events + [(0.0, "in")], horizon=aiv.ROLLCALL_DEFAULT)  # rank 0 itself at 0
    assert due is None or last < due < aiv.ROLLCALL_DEFAULT, (last, due)
    if spread == 60.0:
        assert due is not None and due - last >= 2 * 60.0, (last, due)  # half the world was in at ~60 s
    assert walk(world, events + [(0.0, "in"), (last + 0.1, "in")], horizon=aiv.ROLLCALL_DEFAULT) is None


def test_the_last_call_begins_only_at_half_the_world():
    assert walk(4, [(0.0, "in")], horizon=200) is None  # 1 of 4: only the bound ends it
    assert walk(4, [(0.0, "in"), (1.0, "in")]) == pytest.approx(31.0, abs=0.6)


# -- real ranks
def test_a_rank_that_cannot_reach_the_store_is_named_within_60s_at_the_defaults(tmp_path):
    """Rank 1's MASTER_ADDR does not resolve: it says so at once and exits 1; rank 0, at the default 300 s roll
    call, names rank 1 with its host from Slurm's plan at the last call (it waited 301.7 s), exit 3."""
    t0 = time.monotonic()
    procs = start(2, tmp_path, {1: {"MASTER_ADDR": "no-such-master.invalid"}}, extra=SLURM2)
    out = finish(procs, 150)
    took = time.monotonic() - t0
    assert out[0][0] == aiv.EXIT_TIMEOUT and out[1][0] == aiv.EXIT_FAIL, describe(out)
    (line,) = failures(out[0][1])
    assert line.startswith("FAILURE: rendezvous: rank(s) 1 (expected on n1) did not check in: no word from its "
                           "process within the last call (30s after the latest rank arrived; 1/2 reported at "), line
    v = json.loads((tmp_path / "v.json").read_text())
    assert (v["failed_hosts"], v["exclude"], v["exit_code"]) == (["n1"], "n1", aiv.EXIT_TIMEOUT), v["failures"]
    assert took < 60 + 15, took  # 30 s past rank 0's own start (import torch), under load a few seconds more
    assert "does not resolve on rank 1's host n1" in failures(out[1][1])[0]


def test_a_rank_that_said_hello_keeps_the_whole_bound(tmp_path):
    """Rank 2 starts with the others but is held 25 s after its import (a slow node): its hello reached the store,
    so the last call (at most 16 s here) never names it; the run passes."""
    procs = start(3, tmp_path, {2: {"AIV_FAILPOINT": "skew=25:rollcall:2"}},
                  args=("--rollcall-timeout", 80, "--skip-screen", "--skip-numerics"))
    out = finish(procs, 200)
    assert [o[0] for o in out] == [0, 0, 0], describe(out)
    assert aiv.last_call_grace(80, 8) <= 16 and "SUCCESS: DDP Multi-Node AllReduce Ring Complete!" in out[0][1]


# -- no torch
def test_a_python_without_torch_exits_2_naming_no_host(tmp_path):
    """`python3 ddp_mesh_ping.py` with a python that has no torch: exit 2 (README: a missing venv), no host named
    (it was exit 1, failed_hosts ["vm"], exclude "vm")."""
    jp = tmp_path / "v.json"
    r = subprocess.run([*no_torch_python(), str(SCRIPT), "--json", str(jp)], env=clean_env(), capture_output=True,
                       text=True, timeout=120, cwd=tmp_path)
    assert r.returncode == aiv.EXIT_USAGE, r.stdout + r.stderr
    (line,) = failures(r.stdout)
    assert line.startswith("FAILURE: local: rank 0 (") and "torch is not importable by " in line, line
    assert "no host is named: the python this launch ran cannot import torch" in line, line
    v = json.loads(jp.read_text())
    assert (v["failed_hosts"], v["exclude"], v["exit_code"]) == ([], "", aiv.EXIT_USAGE), v["failures"]


@pytest.mark.parametrize("world,without,named", [(3, [2], ["n2"]), (2, [1], [])])
def test_a_node_alone_without_torch_is_named_only_against_a_strict_majority(tmp_path, world, without, named):
    """Rank(s) `without` run a python without torch and tell rank 0 at once: with 2 of 3 nodes importing torch
    the odd node is named (exit 1, `majority`); with 1 of 2 nobody is (exit 2)."""
    bare = no_torch_python()
    procs = start(world, tmp_path, python={r: bare for r in without}, args=("--rollcall-timeout", 60))
    out = finish(procs, 150)
    code = aiv.EXIT_FAIL if named else aiv.EXIT_USAGE
    assert out[0][0] == code, describe(out)
    assert all(out[r][0] == aiv.EXIT_USAGE for r in without), describe(out)
    lines = failures(out[0][1])
    assert any(ln.startswith(f"FAILURE: local: rank {without[0]} (n{without[0]}): torch is not importable by ")
               for ln in lines), lines
    v = json.loads((tmp_path / "v.json").read_text())
    assert (v["failed_hosts"], v["exit_code"]) == (named, code), v["failures"]
    (f,) = [f for f in v["findings"] if f["status"] == "FAIL"]
    assert f["blame"] == ("majority" if named else "launch"), f
    assert ("no host is named" in f["reason"]) == (not named), f["reason"]  # one verdict, said once
    assert os.path.basename(SCRIPT) == "ddp_mesh_ping.py"
