"""Every sink reads one gated result, and the verdict is decided once.

The sinks are the report's FAILURE and ACTION lines, the JSON's failed_hosts and exclude, the metrics'
aiv_node_status, the page's node colours, the drain plan and the two fallback verdicts (a rank's when rank 0
gave none, the batch file's when rank 0 left no JSON). First as pure functions of plain data: findings of
every kind of evidence, with and without a refused value on the side channel (`tamper`) and --strict, passed
through blame_gate and rendered by every sink, each compared with what the law says. Then with real
processes (one gloo rank per simulated host, SLURMD_NODENAME=n0, n1, ...): a lost rank 0, --strict on a
kernel that differs on one of three nodes, a forged culprit, 6 of 8 ranks behind, a --json that cannot be
written after a PASS."""
import json
import re
import shutil
import subprocess

import pytest

from conftest import aiv, clean_env, describe, failures, finish, free_port, rec, run_tool, tool_ranks, wait_for

HOSTS = ["n1", "n2", "n3", "n4"]
ONE, WIDE = ["n2"], ["n2", "n3", "n4"]  # one host of four; three of four (more than half)


def check_for(kind):
    """A check that may FAIL and WARN and names a host on `kind` (drains on it, where one does); for a kind
    that names nobody, `versions`."""
    if kind not in aiv.LOCALISING:
        return "versions"
    fits = [c for c, r in aiv.CHECK_RULES.items() if kind in r["names"] and "job" in r["contexts"]
            and {"FAIL", "WARN"} <= set(aiv.CHECK_LEVELS[c])]
    return next((c for c in fits if kind in aiv.CHECK_RULES[c]["drain"]), fits[0])


def run_facts(strict):
    """The run's facts as the coordinator copies them at the verdict (plain data)."""
    return {"host": "n1", "world": len(HOSTS), "started_at": "2026-12-06T23:00:00+00:00", "backend": "gloo",
            "addr": "127.0.0.1", "port": 29500, "expect": {"nodes": len(HOSTS)}, "strict": strict, "D": {},
            "times": {"init": 0.5}, "starts": {},
            "records": [rec(i, host=h, local_rank=0) for i, h in enumerate(HOSTS)],
            "collectives": None, "screen": None, "soak": None, "env": {"SLURM_JOB_ID": "77"}, "elapsed_s": 1.0,
            "host_of": dict(enumerate(HOSTS))}


def verdict(findings, strict):
    """What Conclusion does, as pure functions: the gate, the drain plan, the state every sink renders."""
    run = run_facts(strict)
    gated = aiv.blame_gate(findings, set(run["host_of"].values()), len(HOSTS))
    code = aiv.verdict_code(gated)
    drain = aiv.drain_plan(gated if code else [], "recommend", len(HOSTS), "77")
    return aiv.verdict_state(run, gated, code, drain)


def hosts_in(text):
    return {h for h in HOSTS if re.search(rf"\b{h}\b", text)}


def named_by_every_sink(state, check):
    """{sink: {host: 'FAIL' | 'WARN'}}: whom each sink names, read back from what it renders."""
    report = aiv.render_report(state)
    lines = report.splitlines()
    assert [ln for ln in lines if ln.startswith("FAILURE:")] == state["failures"]
    metrics = aiv.render_metrics(state)
    page = aiv.render_html(state)
    status = {"2": "FAIL", "1": "WARN"}
    out = {
        "json failed_hosts": {h: "FAIL" for h in state["failed_hosts"]},
        "json exclude": {h: "FAIL" for h in (aiv.expand_hostlist(state["exclude"]) if state["exclude"] else [])},
        # a FAILURE line that does not say it names nobody names the hosts it quotes
        "FAILURE lines": {h: "FAIL" for ln in state["failures"] if not ln.endswith(aiv.NO_HOST_MARK)
                          for h in hosts_in(ln)},
        "ACTION lines": {h: "ANY" for m in re.finditer(rf"^  ACTION: {re.escape(check)} (\S+): ", report, re.M)
                         for h in aiv.expand_hostlist(m.group(1))},
        "metrics": {m.group(1): status[m.group(2)]
                    for m in re.finditer(r'^aiv_node_status\{node="([^"]+)"\} ([12])$', metrics, re.M)},
        "page": {m.group(2): m.group(1) for m in re.finditer(r'class="node (FAIL|WARN)" data-host="([^"]+)"', page)},
        "drain": {h: "FAIL" for h in state["drain"]["hosts"]},
    }
    assert ("scontrol update" in report) == bool(state["drain"]["hosts"]), report
    return out


@pytest.mark.parametrize("strict", [False, True], ids=["plain", "strict"])
@pytest.mark.parametrize("tamper", [False, True], ids=["clean", "tamper"])
@pytest.mark.parametrize("shape", ["one", "wide"])
@pytest.mark.parametrize("kind", aiv.EVIDENCE)
def test_every_sink_names_exactly_the_gates_hosts(kind, shape, tamper, strict):
    """One FAIL (with --strict: a WARN made a FAIL) naming one host of four, or three of four, on `kind`; a PASS
    naming every host; with `tamper`, a refused value on the side channel beside it. Every sink names exactly
    the hosts the law allows: the planted host where its evidence singles it out and its check declares that,
    nobody when a value was refused or when it is most of the run; the drain only where the check declares that
    evidence persistent and the FAIL was not a WARN made a FAIL by --strict."""
    check, hosts = check_for(kind), ONE if shape == "one" else WIDE
    planted = dict(aiv.finding(check, "WARN" if strict else "FAIL", f"PLANTED on {','.join(hosts)}", hosts,
                               blame=kind), action="that node: look at it", evidence="planted")
    found = aiv.apply_strict([planted], strict) + [aiv.finding(check, "PASS", "fine", HOSTS)]
    if tamper:
        found.append(dict(aiv.finding("rendezvous", "FAIL", "a value did not carry the job's secret"), tamper=True))
    state = verdict(found, strict)
    gated = [f for f in state["findings"] if f["reason"].startswith("PLANTED")]
    assert len(gated) == 1 and gated[0]["status"] == "FAIL"
    law = set(hosts) if (kind in aiv.CHECK_RULES[check]["names"] and shape == "one" and not tamper) else set()
    assert set(gated[0]["hosts"]) == law and set(aiv.blamed_hosts(state["findings"])) == law  # the gate itself
    drains = law if (not strict and kind in aiv.CHECK_RULES[check]["drain"]) else set()
    for sink, named in named_by_every_sink(state, check).items():
        want = drains if sink == "drain" else law
        assert set(named) == want, (sink, named, want, gated[0]["reason"])
    assert state["verdict"] == "FAIL" and state["exit_code"] == aiv.EXIT_FAIL
    if not law:  # named nobody: it says why, and what would localise it, and the line says so
        assert gated[0]["unlocalised"]["localise"] and gated[0]["involved"] == sorted(hosts)
        assert all(ln.endswith(aiv.NO_HOST_MARK) for ln in state["failures"]), state["failures"]
    if shape == "wide" and not tamper and kind in aiv.CHECK_RULES[check]["names"]:
        assert gated[0]["blame"] == "widespread" and gated[0].get("widespread"), gated[0]
        assert "widespread" in state["drain"]["skipped"], state["drain"]


def test_fails_that_together_name_most_of_the_run_name_nobody():
    """Three FAILs, each naming one host of four on its own evidence: together most of the run (widespread)."""
    found = [aiv.finding("local", "FAIL", f"numpy missing on {h}", [h], blame="own") for h in WIDE]
    state = verdict(found, False)
    assert state["failed_hosts"] == [] and state["drain"]["hosts"] == [], state["failures"]
    assert all(f["blame"] == "widespread" for f in state["findings"])
    one = verdict(found[:1], False)
    assert one["failed_hosts"] == ["n2"] and one["drain"]["hosts"] == ["n2"]


def test_a_run_of_one_host_keeps_its_culprit():
    """One node: its own dead rank is its own, not "most of the job" (no minority to weigh against)."""
    f = aiv.finding("collective", "FAIL", "rank 1 (solo) dead", ["solo"], blame="process")
    assert aiv.blamed_hosts(aiv.blame_gate([f], {"solo"}, 1)) == ["solo"]


@pytest.mark.parametrize("tamper", [False, True], ids=["clean", "tamper"])
@pytest.mark.parametrize("kind", ["link", "stuck", "process", "signal", None])
def test_the_fallback_verdict_names_only_what_the_gate_lets_through(kind, tamper):
    """The one fallback writer (a rank's speak_for_rank0, the batch file's --fallback): a lost connection
    (`link`) and a missing verdict (`stuck`) name nobody, nor does a cancelled run or a missing JSON; only a
    rank 0 whose process was seen gone on its own node is named, and nobody while a value was refused."""
    found = [aiv.rank0_lost("rank 1 (n2) lost rank 0 (n1)", "n1", kind)]
    if tamper:
        found.append(dict(aiv.finding("rendezvous", "FAIL", "a value did not carry the job's secret"), tamper=True))
    state = aiv.fallback_verdict(found, aiv.EXIT_TIMEOUT, 4, "rank 1 (n2)", HOSTS)
    law = ["n1"] if kind == "process" and not tamper else []
    assert (state["failed_hosts"], state["exclude"]) == (law, ",".join(law)), state
    assert state["failures"][0].endswith(aiv.NO_HOST_MARK) == (not law), state["failures"]
    if kind in ("link", "stuck") and not tamper:
        assert "no host is named" in state["failures"][0] and state["findings"][0]["involved"] == ["n1"]


def test_the_batch_files_fallback_is_written_by_the_tool_and_names_nobody(tmp_path):
    """What submit_smoke_test.sbatch runs when rank 0 left no JSON: the tool writes it (the gate), names no host
    for MASTER_ADDR (an address), prints the line it wrote, and never replaces a verdict already there."""
    jp = tmp_path / "v.json"
    env = {"_AIV_FALLBACK_VERDICT": "1"}
    r = run_tool([jp, 3, "rendezvous", "stuck", "rank 0 on 10.1.2.3 left no verdict (srun exit code 137)",
                  "10.1.2.3"], env=env, timeout=60)
    v = json.loads(jp.read_text())
    assert r.returncode == 0 and failures(r.stdout) == v["failures"], r.stdout + r.stderr
    assert (v["exit_code"], v["failed_hosts"], v["exclude"], v["written_by"]) == (3, [], "", "submit_smoke_test.sbatch")
    assert v["failures"][0].startswith("FAILURE: rendezvous: rank 0 on 10.1.2.3 left no verdict (srun exit code 137)")
    assert v["failures"][0].endswith(aiv.NO_HOST_MARK) and v["findings"][0]["involved"] == ["10.1.2.3"]
    r = run_tool([jp, 5, "interrupted", "signal", "the job was cancelled"], env=env, timeout=60)
    assert r.returncode == 0 and json.loads(jp.read_text()) == v  # the first writer wins


# ---------------------------------------------------------------- real processes
def start(world, tmp_path, args=(), env=None, per_rank=None, port=None):
    """One rank per simulated host n0..n<world-1>, srun-style variables, on `port`."""
    port = port or free_port()
    envs = [clean_env({"RANK": r, "WORLD_SIZE": world, "LOCAL_RANK": 0, "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": port, "SLURMD_NODENAME": f"n{r}", "AIV_FAILPOINT_MARK": tmp_path / "mark",
                       **(env or {}), **(per_rank or {}).get(r, {})}) for r in range(world)]
    return tool_ranks(envs, args, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def outputs(tmp_path):
    """(the JSON, the metrics, the page) of a run that wrote them under tmp_path."""
    return (json.loads((tmp_path / "v.json").read_text()), (tmp_path / "v.prom").read_text(),
            (tmp_path / "v.html").read_text())


FILES = ("--json", "{t}/v.json", "--metrics", "{t}/v.prom", "--html", "{t}/v.html")


def files(tmp_path):
    return [a.format(t=tmp_path) for a in FILES]


def names_nobody_anywhere(v, prom, page, log):
    """No sink names a host: the JSON, the metrics, the page, the ACTION and FAILURE lines, the drain."""
    assert (v["failed_hosts"], v["exclude"], v["drain"]["hosts"], v["drain_command"]) == ([], "", [], ""), v
    assert not re.search(r'^aiv_node_status\{node="[^"]+"\} [12]$', prom, re.M), prom
    assert not re.search(r'class="node (FAIL|WARN)"', page)
    assert all(ln.endswith(aiv.NO_HOST_MARK) for ln in v["failures"]) and v["failures"], v["failures"]
    named = [ln for ln in log.splitlines() if ln.startswith("  ACTION:") and "(not blamed)" not in ln
             and re.match(r"  ACTION: \S+ \S+: ", ln)]
    assert not named, named


def test_a_rank_that_lost_rank_0_on_another_node_names_nobody(tmp_path):
    """Rank 0 (n0) is killed in the collective: rank 1 (n1) loses its store connection, says so and writes
    the verdict JSON through the one fallback writer: `link`, no host (before: failed_hosts ['n0'])."""
    procs = start(2, tmp_path, ["--skip-screen", "--json", tmp_path / "v.json"],
                  env={"AIV_FAILPOINT": "die:collective:0"})
    out = finish(procs, 120)
    assert out[0][0] == -9 and out[1][0] == aiv.EXIT_TIMEOUT, describe(out)
    v = json.loads((tmp_path / "v.json").read_text())
    assert v["written_by"] == "rank 1 (n1)" and (v["failed_hosts"], v["exclude"]) == ([], ""), v
    (line,) = failures(out[1][1])
    # rank 1 says its own phase: the collective, or the telemetry while it still waits for rank 0's word on it
    assert re.match(r"FAILURE: rendezvous: rank 1 \(n1\) lost rank 0 \(n0\) during (collective|telemetry)", line) \
        and line.endswith(aiv.NO_HOST_MARK) and "no host is named" in line, line
    assert v["failures"] == [line] and v["findings"][0]["blame"] == "link", v


SECRET = {"AIV_JOB_SECRET": "5d1c0ffee" * 8}  # the job's secret: an authenticated side channel
UNAME = """import os
_uname = os.uname
os.uname = lambda: os.uname_result(tuple(_uname())[:2] + ("9.9.9-other",) + tuple(_uname())[3:])
"""


def test_strict_makes_a_kernel_unlike_the_others_a_fail_that_drains_nothing(tmp_path):
    """n2's kernel differs from n0's and n1's (a WARN, named against the majority). --strict makes it a FAIL:
    exit 1 and n2 in failed_hosts, but no drain (before: `scontrol update nodename=n2 state=drain`)."""
    (tmp_path / "uname").mkdir()
    (tmp_path / "uname" / "sitecustomize.py").write_text(UNAME)
    procs = start(3, tmp_path, ["--strict", "--skip-screen", *files(tmp_path)], env={"SLURM_JOB_ID": "77", **SECRET},
                  per_rank={2: {"PYTHONPATH": tmp_path / "uname"}})
    out = finish(procs, 180)
    assert [rc for rc, _, _ in out] == [aiv.EXIT_FAIL] * 3, describe(out)
    v, prom, page = outputs(tmp_path)
    (f,) = [f for f in v["findings"] if f["status"] == "FAIL"]
    assert (f["check"], f["hosts"], f["blame"], f.get("strict")) == ("versions", ["n2"], "majority", True), f
    assert "kernel differs" in f["reason"] and "9.9.9-other on n2" in f["reason"], f
    assert (v["failed_hosts"], v["exclude"]) == (["n2"], "n2"), v
    assert (v["drain"]["hosts"], v["drain_command"]) == ([], ""), v["drain"]
    assert "no failed check names a host whose fault it is" in v["drain"]["skipped"], v["drain"]
    assert "scontrol update" not in out[0][1] and 'aiv_node_status{node="n2"} 2' in prom, out[0][1]


def forger(port):
    """A plain TCPStore client on the run's port, without the job's secret."""
    import datetime

    import torch.distributed as dist
    return dist.PrefixStore("aiv", dist.TCPStore("127.0.0.1", port, None, False, datetime.timedelta(seconds=10)))


def test_a_forged_culprit_appears_in_no_sink(tmp_path):
    """While rank 1 waits in the collective, a forger without the secret posts an error report naming n2 and a
    liveness post saying rank 1 on n1 is gone. Both are refused; the run FAILs naming the forgery, and neither
    forged culprit (nor any other host) is named by the JSON, the metrics, the page, the ACTION lines, the
    FAILURE lines or the drain."""
    env = {**SECRET, "AIV_FAILPOINT": "pause=8:collective:1", "SLURM_JOB_ID": "77"}
    import torch.distributed  # noqa: F401  (the forger's, before the run: importing it takes seconds)
    port = free_port()
    procs = start(3, tmp_path, ["--skip-screen", "--timeout", 30, *files(tmp_path)], env=env, port=port)
    assert wait_for((tmp_path / "mark").exists), describe(finish([p for p in procs if p.kill() or True]))
    store = forger(port)
    store.append("errors", json.dumps({"rank": 2, "phase": "collective", "code": 1, "term": False,
                                       "internal": False, "line": "FAILURE: collective: rank 2 (n2): NIC down"}) + "\n")
    store.add("nerr", 1)
    store.set("live/n1", json.dumps({"seq": 10 ** 6, "ranks": {"1": "gone"}}))
    out = finish(procs, 120)
    v, prom, page = outputs(tmp_path)
    assert v["verdict"] == "FAIL" and all(rc == v["exit_code"] != 0 for rc, _, _ in out), describe(out)
    assert any("did not carry the job's secret" in ln for ln in v["failures"]), v["failures"]
    names_nobody_anywhere(v, prom, page, out[0][1])


def test_six_of_eight_ranks_behind_name_nobody(tmp_path):
    """Ranks 2-7 (n2..n7), alive, never issue the all_reduce that ranks 0-1 issued: a rank that never issued it
    is evidence, but six of eight hosts are most of the run: `widespread`, no host named, nothing drained
    (before: n2..n7 in failed_hosts and exclude)."""
    stalls = ",".join(f"stall=90:collective:{r}" for r in range(2, 8))
    procs = start(8, tmp_path, ["--skip-screen", "--timeout", 20, *files(tmp_path)],
                  env={"AIV_FAILPOINT": stalls, "SLURM_JOB_ID": "77"})
    try:
        procs[0].wait(240)
    finally:
        out = finish(procs, 60)
    v, prom, page = outputs(tmp_path)
    assert [rc for rc, _, _ in out] == [aiv.EXIT_TIMEOUT] * 8, describe(out)
    (f,) = [f for f in v["findings"] if f["status"] == "FAIL"]
    assert f["check"] == "collective" and f["blame"] == "widespread" and f.get("widespread"), f
    assert f["involved"] == [f"n{r}" for r in range(2, 8)], f
    assert "never issued" in f["reason"] and "6 of the run's 8 nodes" in f["reason"], f["reason"]
    names_nobody_anywhere(v, prom, page, out[0][1])


def test_a_json_that_cannot_be_written_after_a_pass_is_one_verdict_with_one_code(tmp_path):
    """The --json directory disappears while the run works (after the probe before torch): the verdict is
    decided after the files were tried, so the log holds one `Verdict: FAIL exit=1` line, right after
    `Ranks Reported:`, with the output's FAILURE line after it and no SUCCESS line; every rank exits 1; no
    "written over from outside the job" alarm from rank 0's own code (before: `Verdict: PASS exit=0`, SUCCESS,
    then `Verdict: FAIL exit=1`, codes [0, 1] on the store, early ranks exiting 0)."""
    gone = tmp_path / "gone"
    gone.mkdir()
    procs = start(2, tmp_path, ["--skip-screen", "--json", gone / "v.json", "--metrics", tmp_path / "v.prom"],
                  env={"AIV_FAILPOINT": "pause=3:ddp:0"})
    assert wait_for((tmp_path / "mark").exists), describe(finish([p for p in procs if p.kill() or True]))
    shutil.rmtree(gone)
    out = finish(procs, 120)
    assert [rc for rc, _, _ in out] == [aiv.EXIT_FAIL, aiv.EXIT_FAIL], describe(out)
    lines = out[0][1].splitlines()
    verdicts = [i for i, ln in enumerate(lines) if ln.startswith("Verdict:")]
    assert len(verdicts) == 1 and lines[verdicts[0]].startswith("Verdict: FAIL exit=1 "), describe(out)
    assert lines[verdicts[0] - 1].startswith("Ranks Reported: 2/2"), describe(out)
    (line,) = failures(out[0][1])
    assert line.startswith(f"FAILURE: output: --json {gone / 'v.json'} could not be written"), line
    assert lines.index(line) > verdicts[0] and aiv.SUCCESS_LINE not in lines, describe(out)
    assert "written over from outside the job" not in out[0][2], out[0][2]
    prom = (tmp_path / "v.prom").read_text()  # the file that was written says what the log says
    assert "aiv_verdict_pass 0" in prom and "aiv_exit_code 1" in prom, prom


def test_the_readme_says_where_the_verdict_line_stands():
    """The README's sentence that the tests above hold."""
    from conftest import ROOT
    text = " ".join((ROOT / "README.md").read_text().split())
    assert "A run prints exactly one `Verdict:` line: right after `Ranks Reported:`, followed by the SUCCESS line " \
           "or the `FAILURE:` lines, then the `DRAIN:` lines." in text
