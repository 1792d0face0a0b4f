"""The false-culprit matrix: benign disturbances of a healthy run name no host in failed_hosts/exclude.

Real processes on loopback; SLURMD_NODENAME per rank makes each rank a node of its own (node1, node2,
...), so that "which host is blamed" is observable. Every disturbance here is one an operator meets on
a healthy cluster: scancel, the time limit or preemption (SIGTERM to every rank, in every phase), a
launcher stopping one rank, Ctrl-C, the tool's own bug (an exception injected with the `raise`
failpoint in each phase and in the report), and ranks entering a phase far apart (the `skew`
failpoint). The real faults next to them (a rank frozen before the signal, a rank hung after a late
start) are still named, alone.
"""
import contextlib
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from conftest import SCRIPT, aiv, clean_env, describe, failures, finish, free_port, tool_ranks, wait_for


def nodes(world):
    return {r: {"SLURMD_NODENAME": f"node{r + 1}", "LOCAL_RANK": 0} for r in range(world)}


def start(world, env, args=()):
    port = free_port()
    envs = [clean_env({"RANK": r, "WORLD_SIZE": world, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port,
                       **env, **nodes(world)[r]}) for r in range(world)]
    return tool_ranks(envs, args, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def verdict(tmp_path, out):
    js = tmp_path / "v.json"
    assert js.exists(), out[0]
    return json.loads(js.read_text())


SIGNAL_PHASES = ["rendezvous", "init", "screen-gpu", "screen-net", "collective", "ddp"]


@pytest.mark.parametrize("phase", SIGNAL_PHASES)
def test_sigterm_to_every_rank_names_nobody(tmp_path, phase):
    """scancel / the time limit / preemption while rank 1 is inside `phase` (paused there): the verdict
    is `interrupted`, exit 5, within NAMING_S of the signal, and no host is blamed, rank 0's included."""
    mark = tmp_path / "mark"
    procs = start(3, {"AIV_FAILPOINT": f"pause=90:{phase}:1", "AIV_FAILPOINT_MARK": mark,
                      "AIV_JSON": tmp_path / "v.json"}, ("--timeout", 60, "--rollcall-timeout", 60))
    assert wait_for(mark.exists), finish([p for p in procs if p.kill() or True])
    time.sleep(0.3)
    t = time.monotonic()
    for p in procs:
        p.send_signal(signal.SIGTERM)
    procs[0].wait(60)
    took = time.monotonic() - t
    out = finish(procs)
    v = verdict(tmp_path, out)
    assert out[0][0] == aiv.EXIT_INTERRUPTED, describe(out)
    assert (v["failed_hosts"], v["exclude"], v["exit_code"]) == ([], "", aiv.EXIT_INTERRUPTED), v
    lines = failures(out[0][1])
    assert lines and all(ln.startswith("FAILURE: interrupted: ") for ln in lines), describe(out)
    assert "no host is blamed" in lines[0]
    assert "Traceback" not in out[0][2], describe(out)
    assert took <= aiv.NAMING_S + 3, f"verdict {took:.1f} s after the signal\n{describe(out)}"


def test_a_signal_that_comes_late_to_one_node_names_nobody(tmp_path):
    """scancel reaches node1 first: rank 0 gives the `interrupted` verdict and its store goes with it
    before rank 2 (node3, held stopped here, as on a loaded node) read the verdict; rank 2's own SIGTERM
    comes about 1 s after it found the store gone. Rank 2 ends on that signal and says no FAILURE line:
    nobody "lost rank 0" (the log is judged whole: one such line blames node1)."""
    mark = tmp_path / "mark"
    procs = start(3, {"AIV_FAILPOINT": "pause=90:rendezvous:1", "AIV_FAILPOINT_MARK": mark,
                      "AIV_JSON": tmp_path / "v.json"}, ("--rollcall-timeout", 60))
    assert wait_for(mark.exists), finish([p for p in procs if p.kill() or True])
    time.sleep(2.0)  # rank 2 checked in: its listener waits for the verdict
    procs[2].send_signal(signal.SIGSTOP)
    procs[0].send_signal(signal.SIGTERM)
    procs[0].wait(30)
    procs[2].send_signal(signal.SIGCONT)
    # halfway into the SIGNAL_SPREAD_S that rank 2 waits once it found the store gone: late enough that a
    # loaded machine has run it by then (0.5 s was not, at times), early enough to be within the spread
    time.sleep(aiv.SIGNAL_SPREAD_S / 2)
    for p in procs[1:]:
        p.send_signal(signal.SIGTERM)
    out = finish(procs)
    v = verdict(tmp_path, out)
    assert (v["exit_code"], v["failed_hosts"], v["exclude"]) == (aiv.EXIT_INTERRUPTED, [], ""), describe(out)
    assert failures(out[2][1]) == [] and "lost rank 0" not in out[2][2], describe(out)
    assert out[2][0] == 128 + signal.SIGTERM, describe(out)


def test_sigint_at_the_roll_call_is_an_interruption(tmp_path):
    """Ctrl-C while rank 0 waits at the roll call for a rank that has not arrived: no traceback, exit 5."""
    mark = tmp_path / "mark"
    procs = start(2, {"AIV_FAILPOINT": "pause=90:rendezvous:1", "AIV_FAILPOINT_MARK": mark,
                      "AIV_JSON": tmp_path / "v.json"})
    assert wait_for(mark.exists)
    time.sleep(0.5)
    procs[0].send_signal(signal.SIGINT)
    procs[0].wait(30)
    procs[1].send_signal(signal.SIGINT)
    out = finish(procs)
    v = verdict(tmp_path, out)
    assert out[0][0] == aiv.EXIT_INTERRUPTED and v["failed_hosts"] == [], describe(out)
    assert "interrupted by SIGINT" in failures(out[0][1])[0]
    assert "Traceback" not in out[0][2] + out[1][2], describe(out)


def test_sigterm_to_one_rank_names_nobody(tmp_path):
    """A launcher stops rank 1 alone inside the collective: the others' errors are its consequence."""
    mark = tmp_path / "mark"
    procs = start(3, {"AIV_FAILPOINT": "pause=90:collective:1", "AIV_FAILPOINT_MARK": mark,
                      "AIV_JSON": tmp_path / "v.json"}, ("--timeout", 60))
    assert wait_for(mark.exists)
    procs[1].send_signal(signal.SIGTERM)
    out = finish(procs)
    v = verdict(tmp_path, out)
    assert out[0][0] == aiv.EXIT_INTERRUPTED, describe(out)
    assert v["failed_hosts"] == [], v["failures"]
    assert failures(out[0][1])[0].startswith("FAILURE: interrupted: "), describe(out)
    assert "rank 1 (node2) terminated by a signal" in failures(out[0][1])[0]


def test_rank_frozen_before_the_signal_is_still_named_alone(tmp_path):
    """Rank 2 froze inside the collective; then the job is cancelled. Rank 2's host alone is blamed."""
    procs = start(3, {"AIV_FAILPOINT": "hang:collective:2", "AIV_JSON": tmp_path / "v.json"}, ("--timeout", 60))
    assert wait_for(lambda: (aiv.proc_stat(procs[2].pid) or ("R",))[0] in "Tt")
    time.sleep(2.5)  # a liveness post (period 1 s) after the freeze
    for p in procs[:2]:
        p.send_signal(signal.SIGTERM)
    procs[0].wait(30)
    procs[2].kill()
    out = finish(procs)
    v = verdict(tmp_path, out)
    assert v["failed_hosts"] == ["node3"], (v["failures"], describe(out))
    assert out[0][0] == aiv.EXIT_TIMEOUT, describe(out)
    assert "rank 2 (node3) frozen" in v["failures"][0]


# (phase, rank). A follower's error in `final` changes nothing: every measurement was judged already.
RAISES = [("telemetry", 1), ("screen-gpu", 1), ("collective", 1), ("ddp", 1),
          ("local", 0), ("rollcall", 0), ("init", 0), ("screen-net", 0), ("ddp", 0), ("final", 0), ("report", 0)]


@pytest.mark.parametrize("phase,rank", RAISES)
def test_the_tools_own_error_names_no_host(tmp_path, phase, rank):
    """An exception that is not the cluster's (the `raise` failpoint: AssertionError) in a phase or in the
    report: `FAILURE: internal: <exception> in <function>`, exit 4, no host, the report and JSON written."""
    procs = start(2, {"AIV_FAILPOINT": f"raise:{phase}:{rank}", "AIV_JSON": tmp_path / "v.json"},
                  ("--timeout", 30, "--rollcall-timeout", 30))
    procs[0].wait(120)
    wait_for(lambda: procs[1].poll() is not None, 5)  # rank 1 reads the verdict, or gives up on a dead master
    out = finish(procs, timeout=1)
    v = verdict(tmp_path, out)
    assert out[0][0] == aiv.EXIT_INTERNAL, describe(out)
    assert (v["failed_hosts"], v["exit_code"], v["verdict"]) == ([], aiv.EXIT_INTERNAL, "FAIL"), v
    lines = failures(out[0][1])
    assert any(ln.startswith("FAILURE: internal: ") and "in failpoint" in ln for ln in lines), describe(out)
    assert all(ln.startswith("FAILURE: internal: ") for ln in lines), lines
    assert "Verdict: FAIL exit=4" in out[0][1] or phase == "report", describe(out)
    assert "Traceback" in out[rank][2], "the traceback goes to stderr for the bug report"


def test_late_rank0_still_speaks_first(tmp_path):
    """Rank 0 enters the collective 16 s after the others (skew), and rank 2 then freezes there. The
    others count their bound from rank 0's gate, so rank 0 names rank 2 alone before anyone gives up
    on rank 0 (without the gate ranks 1-2 would give up at bound + RANK0_GRACE = 23 s after their own
    start, 7 s after rank 0's: before rank 0's verdict at its bound, 8 s)."""
    procs = start(3, {"AIV_FAILPOINT": "skew=16:collective:0,hang:collective:2", "AIV_JSON": tmp_path / "v.json"},
                  ("--timeout", 8))
    procs[0].wait(90)
    procs[2].kill()
    out = finish(procs)
    v = verdict(tmp_path, out)
    assert "written_by" not in v, v
    assert v["failed_hosts"] == ["node3"] and out[0][0] == aiv.EXIT_TIMEOUT, describe(out)
    assert "rank 0 is frozen" not in out[1][1] + out[1][2], describe(out)
    assert out[1][0] == aiv.EXIT_TIMEOUT, describe(out)


def test_verdict_code_prefers_the_clusters_evidence():
    """A dead rank before an interruption or next to the tool's own error is still the news."""
    f = aiv.finding
    dead = f("collective", "FAIL", "rank 1 dead", ["node2"], [1])
    stop = f("interrupted", "FAIL", "stopped", code=aiv.EXIT_INTERRUPTED)
    bug = f("internal", "FAIL", "bug", code=aiv.EXIT_INTERNAL)
    assert aiv.verdict_code([stop, dead]) == aiv.EXIT_FAIL
    assert aiv.verdict_code([bug, stop]) == aiv.EXIT_INTERRUPTED
    assert aiv.verdict_code([bug]) == aiv.EXIT_INTERNAL


def test_judge_unfinished_blames_no_one_for_consequences_of_a_signal():
    """Unit: rank 1 terminated, rank 0 reported the collective's error, rank 2 stuck: nobody blamed;
    the same with rank 3 frozen: rank 3 alone."""
    host_of = {r: f"node{r + 1}" for r in range(4)}
    stamps = {r: aiv.PHASES.index("ddp") for r in range(4)}
    errors = {0: {"line": "rank 0: all_reduce failed", "term": False, "internal": False},
              1: {"line": "rank 1: terminated", "term": True, "internal": False}}
    live = {0: "running", 1: "gone", 2: "running", 3: "running"}
    f = aiv.judge_unfinished("collective", "x", 4, host_of, stamps | {0: 0, 1: 0, 2: 0}, live, errors)
    assert (f["check"], f["hosts"], f.get("code")) == ("interrupted", [], aiv.EXIT_INTERRUPTED), f
    f = aiv.judge_unfinished("collective", "x", 4, host_of, {r: 0 for r in range(4)}, live | {3: "stopped"}, errors)
    assert (f["check"], f["hosts"]) == ("collective", ["node4"]), f
    errors[1] = {"line": "rank 1: bug", "term": False, "internal": True}
    f = aiv.judge_unfinished("collective", "x", 4, host_of, {r: 0 for r in range(4)}, live, errors)
    assert (f["check"], f["hosts"], f.get("code")) == ("internal", [], aiv.EXIT_INTERNAL), f


def test_failpoint_doc_names_every_kind():
    doc = aiv.RankRun.failpoint.__doc__
    for kind in ("die", "hang", "pause=S", "raise", "skew=S", "stall=S", "done-<phase>"):
        assert kind in doc
    for site in ("done-telemetry", "done-screen-gpu", "done-ddp"):  # each done-<phase> the doc names has its site
        assert f'self.failpoint("{site}")' in Path(SCRIPT).read_text()
    assert Path(SCRIPT).read_text().count("self.failpoint(") >= 10


# -- the node monitor: a silent monitor is evidence against its node only when the node's ranks are silent too

def start_on(hosts, env, args=()):
    """One rank per entry of `hosts` (SLURMD_NODENAME), local ranks counted per host."""
    port, envs, seen = free_port(), [], {}
    for r, h in enumerate(hosts):
        seen[h] = seen.get(h, -1) + 1
        envs.append(clean_env({"RANK": r, "WORLD_SIZE": len(hosts), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port,
                               "SLURMD_NODENAME": h, "LOCAL_RANK": seen[h], **env}))
    return tool_ranks(envs, args, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def monitor_of(proc):
    """(pid, cfg) of the node monitor a node leader started (its child with _AIV_NODE_MONITOR), or None."""
    import psutil
    with contextlib.suppress(psutil.Error):
        for c in psutil.Process(proc.pid).children():
            with contextlib.suppress(psutil.Error):
                cfg = c.environ().get("_AIV_NODE_MONITOR")
                if cfg:
                    return c.pid, json.loads(cfg)
    return None


def monitor_posted(cfg):
    """Whether the monitor's liveness post is on the store (read raw: its value is sealed)."""
    import datetime

    import torch.distributed as dist
    with contextlib.suppress(Exception):
        raw = dist.TCPStore(cfg["addr"], cfg["port"], None, False, datetime.timedelta(seconds=2))
        return b'"seq"' in dist.PrefixStore(cfg["prefix"], raw).get(f"live/{cfg['host']}")
    return False


def stop_monitor(proc, posted=False):
    """SIGSTOP the node monitor of `proc`'s node (once it posted, with posted=True); its pid."""
    found = []
    assert wait_for(lambda: found.append(monitor_of(proc)) or found[-1] is not None, 60), "no node monitor"
    pid, cfg = found[-1]
    if posted:
        assert wait_for(lambda: monitor_posted(cfg), 60), "the node monitor never posted"
    os.kill(pid, signal.SIGSTOP)
    return pid


def kill_stopped(pid):
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


def test_rank0s_own_node_monitor_stopped_at_its_start_names_nobody(tmp_path):
    """Both ranks on node1; its monitor (rank 0's child) is stopped as soon as it exists, before its
    first post (as a monitor that imports torch on a loaded node posts late), and rank 1 then hits the
    tool's own error at init. Rank 0 reads its own node's ranks from /proc: the verdict is `internal`,
    exit 4, no host (it was 'rank 0 (node1) unreachable (its node stopped reporting)', exit 3)."""
    procs = start_on(["node1", "node1"], {"AIV_FAILPOINT": "skew=8:init:1,raise:init:1",
                                          "AIV_JSON": tmp_path / "v.json"}, ("--skip-screen",))
    pid = stop_monitor(procs[0])
    try:
        procs[0].wait(120)
    finally:
        kill_stopped(pid)
    out = finish(procs)
    v = verdict(tmp_path, out)
    assert (out[0][0], v["failed_hosts"], v["exclude"]) == (aiv.EXIT_INTERNAL, [], ""), describe(out)
    lines = failures(out[0][1])
    assert lines and lines[0].startswith("FAILURE: internal: "), describe(out)
    assert "unreachable (" not in out[0][1] and "the liveness monitor of node1" in out[0][1], describe(out)


def stop_then_terminate(tmp_path, hosts, leader, also_stop=()):
    """Rank 1 waits inside init (pause); the monitor of `leader`'s node is stopped once it posted (and the
    ranks in also_stop with it); then a launcher stops rank 1 (SIGTERM). -> finish()'s results, the JSON."""
    mark = tmp_path / "mark"
    procs = start_on(hosts, {"AIV_FAILPOINT": "pause=150:init:1", "AIV_FAILPOINT_MARK": mark,
                             "AIV_JSON": tmp_path / "v.json"}, ("--skip-screen",))
    pid = None
    try:
        assert wait_for(mark.exists), finish([p for p in procs if p.kill() or True])
        pid = stop_monitor(procs[leader], posted=True)
        for r in also_stop:
            procs[r].send_signal(signal.SIGSTOP)
        procs[1].send_signal(signal.SIGTERM)
        procs[0].wait(120)
    finally:
        if pid:
            kill_stopped(pid)
        for r in also_stop:
            procs[r].kill()
    out = finish(procs)
    return out, verdict(tmp_path, out)


def test_rank0s_own_node_monitor_stopped_after_posting_names_nobody(tmp_path):
    """The same with the monitor stopped after it posted (a monitor starved of CPU), and rank 1 stopped by
    a launcher: `interrupted`, exit 5, no host."""
    out, v = stop_then_terminate(tmp_path, ["node1", "node1"], 0)
    assert (out[0][0], v["failed_hosts"]) == (aiv.EXIT_INTERRUPTED, []), describe(out)
    assert "unreachable (" not in out[0][1] and "the liveness monitor of node1" in out[0][1], describe(out)


def test_a_remote_nodes_monitor_stopped_while_its_rank_beats_names_nobody(tmp_path):
    """node3's monitor is stopped after its first post; rank 2 there is healthy, blocked in init. Its
    leader's beat still reaches the store: when a launcher stops rank 1, no host is blamed, and the
    verdict notes the silent monitor (it was 'rank 2 (node3) unreachable', exit 3)."""
    out, v = stop_then_terminate(tmp_path, ["node1", "node2", "node3"], 2)
    assert (out[0][0], v["failed_hosts"]) == (aiv.EXIT_INTERRUPTED, []), describe(out)
    assert "the liveness monitor of node3 posted nothing" in out[0][1], describe(out)


def test_a_node_whose_monitor_and_ranks_went_silent_is_unreachable(tmp_path):
    """The real fault next to it: node3's monitor and its rank both stop (as a node cut off the network
    looks from rank 0): node3 alone is named unreachable, exit 3, though rank 1 was stopped by a signal."""
    out, v = stop_then_terminate(tmp_path, ["node1", "node2", "node3"], 2, also_stop=[2])
    assert (out[0][0], v["failed_hosts"]) == (aiv.EXIT_TIMEOUT, ["node3"]), describe(out)
    assert "rank 2 (node3) unreachable (its node's monitor and ranks stopped reporting)" in out[0][1], describe(out)
