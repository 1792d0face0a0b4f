"""Who is named when a phase does not finish, with real processes: one gloo rank per simulated host
(SLURMD_NODENAME=n0, n1, ...), launched by hand as srun would. A rank alive but stuck before its
collective is named alone, by what it never issued, whichever rank it is (rank 0 too); a rank killed after
it did its own part of a phase, while another still works in it, is named dead; one rank stopped by a
signal names nobody, whatever the moment; a non-zero rank whose MASTER_ADDR does not resolve says so at
once. Each case checks rank 0's FAILURE line, its exit code and the JSON's failed_hosts/exclude."""
import json
import signal
import subprocess
import sys
import time

import pytest

from conftest import SCRIPT, aiv, clean_env, describe, failures, finish, free_port, tool_ranks, wait_for

T = 8  # --timeout of the runs that wait out a bound


def start(world, tmp_path, failpoint, args=(), extra=None):
    """One rank per simulated host n0..n<world-1>, srun-style variables, the JSON at tmp_path/v.json."""
    port = free_port()
    envs = [clean_env({"RANK": r, "WORLD_SIZE": world, "LOCAL_RANK": 0, "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": port, "SLURMD_NODENAME": f"n{r}", "AIV_FAILPOINT": failpoint,
                       "AIV_JSON": tmp_path / "v.json", "AIV_FAILPOINT_MARK": tmp_path / "mark", **(extra or {})})
            for r in range(world)]
    return tool_ranks(envs, args, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def ended(procs, tmp_path, timeout=180):
    """(finish()'s results, rank 0's FAILURE lines, the JSON)."""
    out = finish(procs, timeout)
    js = tmp_path / "v.json"
    assert js.exists(), describe(out)
    return out, failures(out[0][1]), json.loads(js.read_text())


def fail_findings(v):
    return [f for f in v["findings"] if f["status"] == "FAIL"]


# -- (a) alive, never issuing: only its host, whichever rank it is
@pytest.mark.parametrize("world,stuck,args", [(3, 1, ()), (2, 0, ("--skip-screen",))])
def test_a_rank_alive_before_its_all_reduce_is_named_alone(tmp_path, world, stuck, args):
    """Rank `stuck` sleeps right before its all_reduce (alive, never issuing it) while its peers issued it and
    wait: only its host is named, exit 3, by what it never issued (torch's flight recorder with the screen's
    groups behind it; the rank's own record where the recorder holds nothing, --skip-screen). It was every
    host: 'ranks 0 (n0), 1 (n1) alive but did not finish'."""
    procs = start(world, tmp_path, f"stall=90:collective:{stuck}", ("--timeout", T, *args))
    try:
        procs[0].wait(120)
    finally:
        procs[stuck].kill()
    out, lines, v = ended(procs, tmp_path)
    assert out[0][0] == aiv.EXIT_TIMEOUT, describe(out)
    (line,) = lines
    others = [r for r in range(world) if r != stuck]
    who = "rank" if len(others) == 1 else "ranks"
    assert line.startswith("FAILURE: collective: all_reduce of rank-encoded integers did not complete within 8s: "
                           f"rank {stuck} (n{stuck}) never issued all_reduce #"), line
    assert f" that {who} {aiv.ranks_text(others)} issued (alive, outside any collective; numbered by " in line, line
    assert (v["failed_hosts"], v["exclude"]) == ([f"n{stuck}"], f"n{stuck}"), v["failures"]
    (f,) = fail_findings(v)
    assert (f["blame"], f["ranks"], f["issued"]["states"][str(stuck)]) == ("never-issued", [stuck], "behind")
    assert f["issued"]["source"] == "recorder", f["issued"]  # its peers' recorders hold the all_reduce
    assert all(f["issued"]["states"][str(r)] == "waiting" for r in others), f["issued"]
    for r in others:  # every live rank exits with the verdict
        assert out[r][0] == aiv.EXIT_TIMEOUT, describe(out)
    if args:  # the answers on the store: torch's recorder holds nothing of the stalled rank's, #1 of its peer's
        last = f["issued"]["last"]
        assert last[str(stuck)] is None and last["1"][:2] == ["all_reduce", 1], last


def test_a_rank_alive_before_the_ddp_step_is_named_alone(tmp_path):
    """The same before DDP's first collective (its constructor's broadcast): rank 1's host alone."""
    procs = start(2, tmp_path, "stall=90:ddp:1", ("--timeout", T, "--skip-screen"))
    try:
        procs[0].wait(120)
    finally:
        procs[1].kill()
    out, lines, v = ended(procs, tmp_path)
    assert out[0][0] == aiv.EXIT_TIMEOUT and len(lines) == 1, describe(out)
    assert lines[0].startswith("FAILURE: ddp: the DDP step and results gather did not complete within 8s: rank 1 (n1) "
                               "never issued "), json.dumps(fail_findings(v)[0].get("issued"))
    assert (v["failed_hosts"], v["exclude"]) == (["n1"], "n1")


def test_a_pair_member_that_never_issues_is_named_not_its_partner(tmp_path):
    """Four nodes; rank 1 (n1) stalls before its first collective of the network screen (its pair group's
    creation) while its partner rank 3 (n3) waits inside it: n1 alone (it was both ends of the link)."""
    procs = start(4, tmp_path, "stall=90:screen-net:1", ("--timeout", 15))
    try:
        procs[0].wait(150)
    finally:
        procs[1].kill()
    out, lines, v = ended(procs, tmp_path)
    assert out[0][0] == aiv.EXIT_TIMEOUT, describe(out)
    (line,) = lines
    assert line.startswith("FAILURE: inter-node: link between n1 and n3 on rail 0 did not complete within 15s (rank 1 "
                           "(n1) never issued new_group that rank 3 issued; rank 3 (n3) alive, inside a collective "
                           "(waiting for its peers) (not blamed)); 2/4 rank(s) finished round 1"), line
    assert (v["failed_hosts"], v["exclude"]) == (["n1"], "n1")
    assert fail_findings(v)[0]["blame"] == "never-issued"


# -- (b) killed after its own part, while rank 0 still works in the phase: its host, dead
@pytest.mark.parametrize("phase", ["screen-gpu", "telemetry"])
def test_a_rank_killed_after_its_part_is_named_dead_never_the_rank_still_working(tmp_path, phase):
    """Rank 1 posts its part of `phase` and is SIGKILLed while rank 0 is still in the phase (held there):
    n1 dead, exit 1 (it was `rank 0 (nodeA) alive but did not finish`, exit 3, failed_hosts ["nodeA"])."""
    procs = start(2, tmp_path, f"pause=40:{phase}:0,die:done-{phase}:1", ("--timeout", 60))
    out, lines, v = ended(procs, tmp_path)
    assert out[0][0] == aiv.EXIT_FAIL and out[1][0] == -signal.SIGKILL, describe(out)
    (line,) = lines
    assert "rank 1 (n1) dead (process gone)" in line and "rank 0 (n0) alive, not finished (not blamed)" in line, line
    assert (v["failed_hosts"], v["exclude"]) == (["n1"], "n1"), v["failures"]
    assert fail_findings(v)[0]["blame"] == "process"


# -- (c) one rank signalled: interrupted, nobody, whatever the moment
@pytest.mark.parametrize("failpoint", ["pause=60:done-telemetry:1", "pause=60:screen-gpu:1",
                                       "pause=60:done-screen-gpu:1", "pause=60:screen-net:1",
                                       "stall=60:collective:1"])
def test_one_rank_signalled_names_nobody_whatever_the_moment(tmp_path, failpoint):
    """SIGTERM to rank 1 alone while it is held at a moment of a phase (before its part, after it while rank 0
    still works or waits, inside the network screen, before its collective): `interrupted`, exit 5, no host,
    never 'every rank finished it' (at 3.5 s, 5.5-6.5 s and 7.5 s into a run this gave exit 5, exit 3 naming
    rank 0's host, and a FAIL that said every rank finished)."""
    procs = start(2, tmp_path, failpoint, ("--timeout", 60))
    assert wait_for((tmp_path / "mark").exists, 120), finish([p for p in procs if p.kill() or True])
    time.sleep(0.5)
    procs[1].send_signal(signal.SIGTERM)
    out, lines, v = ended(procs, tmp_path)
    assert out[0][0] == aiv.EXIT_INTERRUPTED, describe(out)
    assert (v["failed_hosts"], v["exclude"], v["exit_code"]) == ([], "", aiv.EXIT_INTERRUPTED), v["failures"]
    assert lines and all(ln.startswith("FAILURE: interrupted: ") for ln in lines), lines
    assert "rank 1 (n1) terminated by a signal" in lines[0] and "no host is blamed" in lines[0]
    assert "every rank finished it" not in out[0][1]


# -- (e) MASTER_ADDR that does not resolve on a non-zero rank's host
def test_a_rank_whose_master_addr_does_not_resolve_says_so_at_once():
    """Rank 1 alone, MASTER_ADDR a name no resolver knows: the DNS failure in seconds, exit 1, its host (as rank 0
    says it); it printed nothing for up to the roll call's bound and then 'no store answered'."""
    e = clean_env({"RANK": 1, "WORLD_SIZE": 2, "LOCAL_RANK": 0, "MASTER_ADDR": "no-such-master.invalid",
                   "MASTER_PORT": free_port(), "SLURMD_NODENAME": "n1"})
    r = subprocess.run([sys.executable, str(SCRIPT), "--rollcall-timeout", "300"], env=e, capture_output=True,
                       text=True, timeout=200)
    assert r.returncode == aiv.EXIT_FAIL, r.stdout + r.stderr
    (line,) = failures(r.stdout)
    assert line.startswith("FAILURE: rendezvous: MASTER_ADDR=no-such-master.invalid does not resolve on rank 1's host "
                           "n1: "), line
    assert "no store answered" not in r.stdout


# -- the same law as plain data (judge_unfinished with what each rank answered)
H4 = {r: f"n{r}" for r in range(4)}
COLL = aiv.PHASES.index("collective")
W = aiv.group_key(range(4))


def ans(seq=None, inflight=False, idle_s=30.0, fr=None, op="all_reduce"):
    """A rank's answer: its own record of the world group's last collective, inside it or idle for idle_s."""
    own = {W: [op, seq, not inflight]} if seq is not None else {}
    return {"own": own, "fr": fr, "inflight": W if inflight else None, "idle_s": None if inflight else idle_s}


def judge(issued, live=None, errors=None, stamps=None, phase="collective"):
    return aiv.judge_unfinished(phase, "all_reduce did not complete within 8s", 4, H4,
                                stamps or {r: COLL - 1 for r in range(4)}, live or {r: "running" for r in range(4)},
                                errors or {}, None, (), issued)


def test_every_rank_inside_the_collective_is_the_fabric_no_host():
    f = judge({r: ans(3, inflight=True) for r in range(4)})
    assert (f["hosts"], f["blame"], aiv.verdict_code([f])) == ([], "all-issued", aiv.EXIT_TIMEOUT), f
    assert "no host is named: every rank issued all_reduce #3 and it did not finish: the fabric" in f["reason"]
    assert f["unlocalised"]["localise"] == aiv.FABRIC_HINT and "screen's pair results" in f["reason"]


def test_answers_not_collected_name_no_host_and_say_whose():
    f = judge({0: ans(3, inflight=True), 1: None, 2: ans(3, inflight=True), 3: ans(3, inflight=True)})
    assert (f["hosts"], f["blame"]) == ([], "not-collected"), f
    assert "rank 1 (n1) alive, posted no record of what it issued within 4s" in f["reason"]
    assert "what rank(s) 1 issued last was not collected" in f["reason"]


def test_a_rank_between_two_calls_is_no_evidence_but_a_stopped_one_is():
    peers = {r: ans(3, inflight=True) for r in (0, 2, 3)}
    f = judge({**peers, 1: ans(2, idle_s=0.002)})
    assert f["hosts"] == [] and "rank 1 (n1) alive, between two collective calls" in f["reason"], f
    f = judge({**peers, 1: ans(2, idle_s=12.0, fr=None)})
    assert (f["hosts"], f["blame"]) == (["n1"], "never-issued"), f
    assert "rank 1 (n1) never issued all_reduce #3 that ranks 0, 2-3 issued (alive, outside any collective; " \
           "numbered by its own record)" in f["reason"]
    assert "ranks 0 (n0), 2 (n2), 3 (n3) alive, inside a collective (waiting for its peers) (not blamed)" in f["reason"]


def test_torchs_recorder_numbers_the_collectives_where_every_rank_has_it():
    fr = {r: {W: ["all_reduce", 12 if r != 2 else 11, True]} for r in range(4)}
    posts = {r: dict(ans(3, inflight=r != 2), fr=fr[r]) for r in range(4)}
    f = judge(posts)
    assert f["hosts"] == ["n2"] and f["issued"]["source"] == "recorder", f
    assert "rank 2 (n2) never issued all_reduce #12 that ranks 0-1, 3 issued" in f["reason"]
    posts[3]["fr"] = None  # the recorder holds nothing on one rank: every rank's own record stands in
    f = judge(posts)
    assert f["issued"]["source"] == "own" and f["hosts"] == [] and f["blame"] == "all-issued", f


def test_process_evidence_anywhere_wins_and_a_signal_anywhere_names_nobody():
    """Rank 3 finished the phase and died; rank 1 never issued: rank 3 alone (its process state); a rank
    that finished its part and was then terminated: `interrupted`, nobody, never 'every rank finished'."""
    posts = {0: ans(3, inflight=True), 1: ans(2), 2: ans(3, inflight=True), 3: None}
    stamps = {0: COLL - 1, 1: COLL - 1, 2: COLL - 1, 3: COLL}
    f = judge(posts, live={0: "running", 1: "running", 2: "running", 3: "gone"}, stamps=stamps)
    assert (f["hosts"], f["blame"], aiv.verdict_code([f])) == (["n3"], "process", aiv.EXIT_FAIL), f
    done = {r: COLL for r in range(4)}
    f = judge(None, live={0: "running", 1: "gone", 2: "running", 3: "running"}, stamps=done,
              errors={1: {"line": "rank 1 (n1): terminated by SIGTERM", "term": True, "internal": False}})
    assert (f["check"], f["hosts"], aiv.verdict_code([f])) == ("interrupted", [], aiv.EXIT_INTERRUPTED), f
    f = judge(None, stamps=done)
    assert f["hosts"] == [] and "every rank finished it" not in f["reason"] and f["blame"] == "not-collected"


def test_an_error_every_rank_reported_names_no_host():
    errors = {r: {"line": f"rank {r}: Connection reset", "term": False, "internal": False} for r in range(4)}
    f = judge(None, errors=errors)
    assert (f["hosts"], f["blame"]) == ([], "everyone") and "no host is named: every rank reported" in f["reason"]
    f = judge(None, errors={2: errors[2]})
    assert (f["hosts"], f["blame"]) == (["n2"], "own"), f


def test_a_phase_of_each_ranks_own_work_names_the_rank_that_did_not_do_its_part():
    """telemetry: ranks 0, 2, 3 posted, rank 1 did not (no collective involved): rank 1; nobody posted: no host."""
    idx = aiv.PHASES.index("telemetry")
    f = judge(None, stamps={0: idx, 1: idx - 1, 2: idx, 3: idx}, phase="telemetry")
    assert (f["hosts"], f["blame"]) == (["n1"], "never-issued"), f
    assert "rank 1 (n1) never finished its part of telemetry that ranks 0, 2-3 finished" in f["reason"]
    f = judge(None, stamps={r: idx - 1 for r in range(4)}, phase="telemetry")
    assert (f["hosts"], f["blame"]) == ([], "everyone") and "none is behind another" in f["reason"], f


STATES = ["running", "gone", "stopped"]


def test_no_rank_is_named_without_evidence_of_its_own():
    """Generated hangs of 1-12 ranks: a rank is named only for its own process state, an error it reported
    (not all did), a collective it never issued while outside any for at least BETWEEN_S, or its part of the
    phase not done while a peer's is (outside any collective); a rank inside a collective, between two calls,
    not collected, or finished and running is never named; a FAIL that names no host says why."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    rank = st.fixed_dictionaries({"stamp": st.sampled_from([COLL - 1, COLL]), "live": st.sampled_from(STATES),
                                  "err": st.sampled_from([None, "error", "term"]),
                                  "post": st.sampled_from([None, "waiting", "behind", "front", "between"])})

    @settings(max_examples=300, deadline=None)
    @given(st.lists(rank, min_size=1, max_size=12))
    def check(ranks):
        world, hosts = len(ranks), {r: f"n{r}" for r in range(len(ranks))}
        key = aiv.group_key(range(world))
        posts = {}
        for r, x in enumerate(ranks):
            seq = {"waiting": 5, "behind": 4, "front": 5, "between": 4}.get(x["post"])
            posts[r] = None if x["post"] is None else {
                "own": {key: ["all_reduce", seq, x["post"] != "waiting"]}, "fr": None,
                "inflight": key if x["post"] == "waiting" else None,
                "idle_s": None if x["post"] == "waiting" else 0.01 if x["post"] == "between" else 9.0}
        errors = {r: {"line": "x", "term": x["err"] == "term", "internal": False} for r, x in enumerate(ranks)
                  if x["err"]}
        f = aiv.judge_unfinished("collective", "c", world, hosts, {r: x["stamp"] for r, x in enumerate(ranks)},
                                 {r: x["live"] for r, x in enumerate(ranks)}, errors, None, (), posts)
        late = {r for r, x in enumerate(ranks) if x["stamp"] < COLL}
        for r in f["ranks"]:
            x = ranks[r]
            own = x["live"] != "running" and not x["err"] == "term"
            reported = x["err"] == "error" and r in late
            never = r in late and x["live"] == "running" and x["post"] in ("behind", "front")
            assert own or reported or never, (r, x, f["reason"])
            assert not (x["post"] in ("waiting", "between", None) and not own and not reported), (r, x, f["reason"])
        if not f["hosts"] and f["check"] not in ("interrupted", "internal"):
            assert f.get("unlocalised") and "no host is named" in f["reason"], f
        assert "every rank finished it" not in f["reason"]
    check()


# -- docs/checks.md's "When it fails" lines are what the code says
HOSTS16 = {r: f"gpu{r // 8 + 1:03d}" for r in range(16)}


def doc_cases():
    """(what, the FAILURE/WARN line the code makes for it) for the rows of docs/checks.md this file holds."""
    coll, key = aiv.PHASES.index("collective"), aiv.group_key(range(16))
    cause = aiv.Bound(None, "collective", 120).cause()
    fr = {r: {key: ["all_reduce", 12, True]} for r in range(16)}
    fr[9] = {key: ["all_reduce", 11, True]}
    posts = {r: {"own": {}, "fr": fr[r], "inflight": None if r == 9 else key, "idle_s": 40.0 if r == 9 else None}
             for r in range(16)}
    run = {r: "running" for r in range(16)}
    stuck = aiv.judge_unfinished("collective", cause, 16, HOSTS16, {r: coll - 1 for r in range(16)}, run, {}, None, (),
                                 posts)
    posts[9] = dict(posts[0])
    fabric = aiv.judge_unfinished("collective", cause, 16, HOSTS16, {r: coll - 1 for r in range(16)}, run, {}, None,
                                  (), posts, "the screen's pair results (inter-node rows above)")
    gpu = aiv.PHASES.index("screen-gpu")
    died = aiv.judge_unfinished("screen-gpu", f"{aiv.PHASE_WHAT['screen-gpu']} failed", 16, HOSTS16,
                                {r: gpu if r else gpu - 1 for r in range(16)}, {**run, 9: "gone"}, {})
    rec0 = {"rank": 0, "host": "gpu001", "backend": "nccl", "transport": None, "node": None,
            "nccl_log": {"source": "stdout", "path": None, "read": False}}
    (warn,) = aiv.judge_transport([rec0, dict(rec0, rank=8, host="gpu002")])
    # a pair round of the network screen: ranks 1 (gpu002) and 3 (gpu004) hung, the 14 others posted it
    hosts = {r: f"gpu{r + 1:03d}" for r in range(16)}
    rounds = [("p1", [{"ranks": [1, 3], "nodes": ["gpu002", "gpu004"], "rail": 0}])]
    inside = {"own": {"1,3": ["all_reduce (busbw)", 1, False]}, "fr": None, "inflight": "1,3", "idle_s": None}
    never = {"own": {}, "fr": None, "inflight": None, "idle_s": 40.0}
    pair = [aiv.screen_stuck("screen-net", "did not complete within 120s", 16, rounds,
                             {"p1": set(range(16)) - {1, 3}}, hosts, run, {}, (),
                             {**{r: never for r in range(16)}, 1: a, 3: inside}) for a in (never, inside)]
    return [("never issued", stuck), ("fabric", fabric), ("died after its part", died), ("transport", warn),
            ("hung pair, one end", pair[0]), ("hung pair, both ends", pair[1])]


def test_when_it_fails_shows_the_lines_the_code_makes():
    """Each line in full, or up to where the row cuts it with '...'."""
    import re
    text = (aiv_root() / "docs" / "checks.md").read_text()
    shown = re.findall(r"`((?:FAILURE: |\[WARN\] )[^`]*)`", text)
    for what, f in doc_cases():
        line = (aiv.failure_lines([f])[0] if f["status"] == "FAIL" else  # the code's own line, its mark included
                f"[{f['status']}] {f['check']}: {f['reason']}")
        assert any(s == line or (s.endswith("...") and len(s) > 80 and line.startswith(s[:-3])) for s in shown), \
            f"{what}: docs/checks.md lacks\n{line}"


def aiv_root():
    from conftest import ROOT
    return ROOT


# -- (f) inside the collective call, before its backend saw it: torch's flight recorder names it
@pytest.mark.parametrize("world,stuck,args", [(2, 1, ("--skip-screen",)), (2, 0, ("--skip-screen",)), (3, 1, ())])
def test_a_rank_stuck_inside_the_call_before_its_backend_saw_it_is_named_alone(tmp_path, world, stuck, args):
    """Rank `stuck` blocks inside its all_reduce call after its own "about to issue" record and before gloo sees
    the call (a rank stuck in a driver call or a lazy communicator set-up looks so), while its peers issued it:
    torch's flight recorder (live: its peers' hold the collective) lacks it on that rank alone, so only its host
    is named, never-issued, exit 3, for rank 1 and for rank 0 alike. It was `all-issued`: "every rank issued
    all_reduce #1 and it did not finish: the fabric", no host named."""
    procs = start(world, tmp_path, f"wedge=90:collective:{stuck}", ("--timeout", T, *args))
    try:
        procs[0 if stuck else 1].wait(120)
        procs[0].wait(30)
    finally:
        procs[stuck].kill()
    out, lines, v = ended(procs, tmp_path)
    assert out[0][0] == aiv.EXIT_TIMEOUT, describe(out)
    (line,) = lines
    others = [r for r in range(world) if r != stuck]
    who = "rank" if len(others) == 1 else "ranks"
    assert line.startswith("FAILURE: collective: all_reduce of rank-encoded integers did not complete within 8s: "
                           f"rank {stuck} (n{stuck}) never issued all_reduce #"), line
    assert (f" that {who} {aiv.ranks_text(others)} issued (alive, inside the collective call but its backend never "
            "saw it: torch's flight recorder holds it on its peers, not on this rank)") in line, line
    assert (v["failed_hosts"], v["exclude"]) == ([f"n{stuck}"], f"n{stuck}"), v["failures"]
    (f,) = fail_findings(v)
    assert (f["blame"], f["ranks"], f["issued"]["source"]) == ("never-issued", [stuck], "recorder"), f["issued"]
    assert f["issued"]["states"][str(stuck)] == "behind"
    assert all(f["issued"]["states"][str(r)] == "waiting" for r in others), f["issued"]
    for r in others:
        assert out[r][0] == aiv.EXIT_TIMEOUT, describe(out)


def rec_ans(fr_seq=None, own_seq=3, inflight=True, inflight_s=12.0, state="scheduled", fr=True):
    """A rank's answer with torch's flight recorder: fr_seq the last collective it holds on the world group
    (None: none of it; fr=False: the recorder could not be read)."""
    a = ans(own_seq, inflight=inflight)
    a["inflight_s"] = inflight_s if inflight else None
    a["fr"] = None if not fr else ({W: ["all_reduce", fr_seq, False, state]} if fr_seq is not None else {})
    return a


def test_the_recorder_names_a_rank_inside_the_call_that_its_backend_never_saw():
    """Ranks 0, 2, 3 hold all_reduce #3 in their recorders; rank 1's own record says it is inside #3, its recorder
    holds #2: it never handed #3 to its backend, named alone."""
    peers = {r: rec_ans(3) for r in (0, 2, 3)}
    f = judge({**peers, 1: rec_ans(2)})
    assert (f["hosts"], f["blame"], f["issued"]["source"]) == (["n1"], "never-issued", "recorder"), f
    assert "rank 1 (n1) never issued all_reduce #3 that ranks 0, 2-3 issued (alive, inside the collective call but " \
           "its backend never saw it" in f["reason"], f["reason"]
    f = judge({**peers, 1: rec_ans(None, own_seq=1)})  # its first collective: its recorder holds nothing of it
    assert f["hosts"] == ["n1"], f


def test_the_recorder_names_an_entry_that_stayed_scheduled_while_its_peers_started():
    peers = {r: rec_ans(3, state="started") for r in (0, 2, 3)}
    f = judge({**peers, 1: rec_ans(3, state="scheduled")})
    assert (f["hosts"], f["blame"]) == (["n1"], "never-issued"), f
    assert "rank 1 (n1) never started all_reduce #3 that ranks 0, 2-3 started (alive, its entry stayed scheduled" \
           in f["reason"], f["reason"]
    f = judge({r: rec_ans(3, state="scheduled") for r in range(4)})  # gloo: none started: the fabric, no host
    assert (f["hosts"], f["blame"]) == ([], "all-issued"), f


@pytest.mark.parametrize("why,one", [
    ("the recorder of rank 1 cannot be read", dict(fr=False)),
    ("rank 1 finished collectives its recorder does not hold (switched off there)", dict(fr_seq=None, own_seq=3)),
    ("rank 1 entered the call a moment ago", dict(fr_seq=2, inflight_s=0.2)),
])
def test_a_recorder_that_is_no_evidence_names_nobody_inside_a_call(why, one):
    """Where the recorder is not live on every rank, or the rank entered its call under BETWEEN_S ago, a rank
    inside a call is never named: no host."""
    f = judge({**{r: rec_ans(3) for r in (0, 2, 3)}, 1: rec_ans(**one)})
    assert f["hosts"] == [], (why, f)
