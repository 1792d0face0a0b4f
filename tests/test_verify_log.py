"""--verify-log judges the whole log: a clean PASS passes, any edit that contradicts it fails.

Base logs: the committed reference_output.log of a real GPU run, a Slurm job log (the batch
file's header, noise from NCCL and from other ranks interleaved), a 1,416-rank log whose sum
is printed in exponent form, and random passing logs rendered from judged records.
"""
import io
import re
import string
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import ROOT, aiv, gpu, rec, run_tool

REFERENCE = (ROOT / "reference_output.log").read_text()
BAR = aiv.BAR


# ---------------------------------------------------------------------------- building logs
def make_cluster(hosts, per_node, with_gpu):
    out = []
    for n, host in enumerate(hosts):
        for lr in range(per_node):
            g = gpu(f"GPU-{n}-{lr}", pci=f"0000:{lr:02x}:00.0", index=lr) if with_gpu else None
            out.append(rec(n * per_node + lr, host=host, local_rank=lr, gpu=g, node=(lr == 0)))
    return out


def pass_state(recs, loss=0.5, elapsed=1.5, phases=None, env=None):
    """What rank 0 holds after a clean run over recs (judged, with exact collectives)."""
    world = len(recs)
    want = world * (world + 1) // 2
    results = [{"rank": r["rank"], "host": r["host"], "ar_ok": True, "ar_sum": want, "grads": (1.0,)}
               for r in recs]
    findings = aiv.judge_all(recs, world, {}) + aiv.judge_collectives(results, world)
    assert aiv.verdict_code(findings) == 0, findings
    return {"world_size": world, "backend": "nccl" if recs[0]["gpu"] else "gloo", "ranks": recs,
            "findings": findings, "verdict": "PASS", "exit_code": 0, "elapsed_s": elapsed,
            "phases": phases if phases is not None else {"rendezvous": 0.5, "init": 1.25},
            "failures": [], "env": env if env is not None else {"NCCL_DEBUG": "WARN"},
            "collectives": {"ar_sum": want, "ar_expected": want, "ranks": world, "loss": loss,
                            "grads_identical": True}}


def tool_log(state, host="node1", master="10.0.0.1:29500", started="2026-12-01T08:00:00+00:00", t=(0.0, 2.5)):
    """rank 0's output: header, a few progress lines, the report."""
    head = [BAR, f"ai-infra-validator {aiv.VERSION} ddp_mesh_ping  {started}  host={host}",
            f"Total Execution Ranks: {state['world_size']}",
            f"Master: {master} (port from MASTER_PORT)  timeout per phase: 300s  expect: none", BAR,
            f"[{t[0]:9.2f}s] contract: rank 0 of {state['world_size']} from env variables",
            f"[{t[1]:9.2f}s] verdict: PASS (exit 0)"]
    return "\n".join(head) + "\n" + aiv.render_report(state)


NOISE = ["node2:1234:1300 [1] NCCL INFO Channel 00/0 : 1[1] -> 2[0] [send] via NET/Socket/0",
         "[node2:3] NCCL INFO comm 0x5581 rank 3 nranks 4 cudaDev 1 busId 2000 - Init COMPLETE",
         "[node1:1] waiting for rank 0's verdict",
         "node1:99:99 [0] NCCL INFO NET/Plugin: No plugin found (libnccl-net.so)"]


def slurm_log(state, job=4711):
    """A job's .log: the batch file's own header (Total Execution Ranks again), then the tool's
    output with NCCL chatter and other ranks' prefixed lines interleaved, then the trailer."""
    world = state["world_size"]
    batch = [f"ai-infra-validator Slurm preflight: job {job} on node[1-2] (2 node(s), tasks per node 2(x2))",
             "Master Node IP/Hostname: node1", "Dynamically Assigned Port: 53593",
             f"Total Execution Ranks: {world}", "Interfaces: NCCL_SOCKET_IFNAME=eth0 GLOO_SOCKET_IFNAME=eth0",
             f"Expected shape: world size {world}, nodes 2, ranks per node 2"]
    body = []
    for i, ln in enumerate(tool_log(state).splitlines()):
        body.append(ln)
        if i % 3 == 1:
            body.append(NOISE[i % len(NOISE)])
    tail = [f"ai-infra-validator: job exit code 0 (verdict JSON /home/op/ai_infra_smoke_test_{job}.json; "
            "srun exit code 0)"]
    return "\n".join(batch + body + tail) + "\n"


SLURM = slurm_log(pass_state(make_cluster(["node1", "node2"], 2, with_gpu=True)))
# 1,416 ranks: the sum 1003236 is printed as sum=1.00324e+06
LARGE = tool_log(pass_state(make_cluster([f"gpu{i:03d}" for i in range(1, 178)], 8, with_gpu=True)))
SMALL = tool_log(pass_state(make_cluster(["cpu-a"], 1, with_gpu=False)))
BASES = {"reference": REFERENCE, "slurm": SLURM, "large": LARGE, "single-rank": SMALL}

hostnames = st.from_regex(r"[a-z][a-z0-9-]{0,10}[a-z0-9]", fullmatch=True)
times = st.floats(0, 99_999, allow_nan=False, allow_infinity=False)


@st.composite
def passing_logs(draw):
    """A clean run of random shape, host names, timings, loss and interfaces."""
    hosts = draw(st.lists(hostnames, min_size=1, max_size=4, unique=True))
    per_node = draw(st.integers(1, 4))
    recs = make_cluster(hosts, per_node, draw(st.booleans()))
    ips = draw(st.lists(st.ip_addresses(v=4), min_size=len(hosts), max_size=len(hosts)))
    for r in recs:
        if r.get("node"):
            r["node"]["ifaces"] = {"eth0": [str(ips[hosts.index(r["host"])])], "lo": ["127.0.0.1"]}
    phases = dict(zip(["rendezvous", "init", "telemetry", "collectives"],
                      draw(st.lists(times, min_size=4, max_size=4)), strict=True))
    state = pass_state(recs, loss=draw(st.floats(0, 1e6)), elapsed=draw(times), phases=phases)
    t = tuple(sorted(draw(st.lists(times, min_size=2, max_size=2))))
    return tool_log(state, host=hosts[0], master=f"{draw(st.ip_addresses(v=4))}:{draw(st.integers(1, 65535))}",
                    t=t)


any_base = st.one_of(st.sampled_from(sorted(BASES.values())), passing_logs())


def verify(text, strict=False, **expect):
    """The judgement of a log's text; the file reader's relevant lines must be judged the same."""
    got = aiv.verify_log(text, expect, strict=strict)
    streamed = aiv.verify_log(aiv.read_log_lines(io.BytesIO(text.encode("utf-8", "replace"))), expect, strict=strict)
    assert streamed == got or not text.isascii(), (streamed, got)
    return got


# ---------------------------------------------------------------------------- the bases pass
@pytest.mark.parametrize("name", sorted(BASES))
def test_every_base_log_passes(name):
    ok, problems, facts = verify(BASES[name])
    assert ok, problems
    assert facts["verdict"] == "PASS exit=0" and facts["findings"]["FAIL"] == 0


def test_large_log_prints_its_sum_exactly():
    assert "sum=1003236 expected=1003236 on 1416 rank(s)" in LARGE


@given(passing_logs())
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_random_passing_logs_pass(text):
    ok, problems, _ = verify(text)
    assert ok, problems


@given(st.data())
@settings(max_examples=150, deadline=None)
def test_reference_log_with_other_times_hosts_addresses_and_loss_passes(data):
    """Edits that change nothing about the verdict: timings, host name, IPs, port, loss, date."""
    d = data.draw
    t = REFERENCE
    port = re.search(r"^Master: [^ ]+:(\d+) ", REFERENCE, re.M).group(1)
    started = re.search(r"ddp_mesh_ping  (\S{19})", REFERENCE).group(1)
    t = re.sub(rf"(?<=:){port}\b", lambda m: str(d(st.integers(1, 65535))), t)
    t = re.sub(r"\b\d{1,3}(?:\.\d{1,3}){3}\b", lambda m: str(d(st.ip_addresses(v=4))), t)
    t = re.sub(r"\bvm\b", d(hostnames), t)
    t = re.sub(r"^\[\s*\d+\.\d+s\]", lambda m: f"[{d(times):9.2f}s]", t, flags=re.M)
    t = re.sub(r"\d+\.\d+s\)", lambda m: f"{d(times):.2f}s)", t)
    t = re.sub(r"loss=\d+\.\d+", lambda m: f"loss={d(st.floats(0, 1e6)):.6f}", t)
    t = re.sub(r"^Verdict: .*$", lambda m: re.sub(r"=\d+\.\d+", lambda _: f"={d(times):.2f}", m.group(0)),
               t, flags=re.M)
    t = t.replace(started, d(st.datetimes()).strftime("%Y-%m-%dT%H:%M:%S"))
    ok, problems, _ = verify(t)
    assert ok, problems


# ---------------------------------------------------------------------------- self-contradicting edits fail
DIGIT_FIELDS = [re.compile(r"^Ranks Reported: (\d+)/(\d+)", re.M),
                re.compile(r"^ *all_reduce exact: sum=(\S+) expected=(\d+) on (\d+) rank", re.M),
                re.compile(r"Total Execution Ranks: (\d+)"),
                re.compile(r"^Verdict: PASS exit=(\d+)", re.M)]


def digit_sites(text):
    """Positions of every digit in the numbers a passing log must keep consistent."""
    out = set()
    for rx in DIGIT_FIELDS:
        for m in rx.finditer(text):
            for g in range(1, rx.groups + 1):
                out.update(i for i in range(m.start(g), m.end(g)) if text[i].isdigit())
    return sorted(out)


def test_every_digit_field_is_present_in_every_base():
    for name, text in BASES.items():
        assert all(rx.search(text) for rx in DIGIT_FIELDS), name
    assert len(re.findall("Total Execution Ranks", SLURM)) == 2


@given(any_base, st.data())
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_changed_digit_is_rejected(text, data):
    i = data.draw(st.sampled_from(digit_sites(text)))
    new = data.draw(st.sampled_from([c for c in string.digits if c != text[i]]))
    ok, problems, _ = verify(text[:i] + new + text[i + 1:])
    assert not ok and problems


STATUS_SITES = re.compile(r"^ *\[(PASS)\] |^Verdict: (PASS) ", re.M)


@given(any_base, st.sampled_from(["WARN", "FAIL"]), st.data())
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_pass_turned_warn_or_fail_is_rejected(text, new, data):
    """A finding turned WARN fails under --strict only: without it, a WARN is still a PASS."""
    m = data.draw(st.sampled_from(list(STATUS_SITES.finditer(text))))
    g = 1 if m.group(1) else 2
    edited = text[:m.start(g)] + new + text[m.end(g):]
    ok, problems, _ = verify(edited, strict=(g == 1 and new == "WARN"))
    assert not ok and problems


@given(any_base, st.data())
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_inserted_failure_line_is_rejected(text, data):
    lines = text.split("\n")
    at = data.draw(st.integers(0, len(lines)))
    prefix = data.draw(st.sampled_from(["", "  ", "[node2:3] "]))
    reason = data.draw(st.text(st.characters(min_codepoint=32, max_codepoint=126), max_size=60))
    lines.insert(at, f"{prefix}FAILURE: {data.draw(st.sampled_from(aiv.CHECKS))}: {reason}")
    ok, problems, _ = verify("\n".join(lines))
    assert not ok and any("FAILURE:" in p for p in problems)


STABLE = {"total": lambda s: "Total Execution Ranks:" in s, "ranks": lambda s: s.startswith("Ranks Reported:"),
          "verdict": lambda s: s.startswith("Verdict:"), "sum": lambda s: s.startswith("all_reduce exact:"),
          "grads": lambda s: "gradients_identical=" in s, "success": lambda s: s == aiv.SUCCESS_LINE}


@given(any_base, st.sampled_from(sorted(STABLE)))
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_deleted_stable_line_is_rejected(text, kind):
    lines = text.split("\n")
    where = [i for i, ln in enumerate(lines) if STABLE[kind](ln.strip())]
    if kind == "total" and len(where) == 2:      # a Slurm log: deleting one copy leaves a consistent log
        return
    assert len(where) == 1, (kind, where)
    del lines[where[0]]
    ok, problems, _ = verify("\n".join(lines))
    assert not ok and problems


# ---------------------------------------------------------------------------- each reason, by name
def edit(text, old, new, count=1):
    assert old in text, old
    return text.replace(old, new, count)


R = REFERENCE
VERDICT = next(ln for ln in R.splitlines() if ln.startswith("Verdict:"))
N = int(re.search(r"^Total Execution Ranks: (\d+)$", R, re.M).group(1))  # the reference run's world
S = N * (N + 1) // 2  # its all_reduce sum
EDITS = {
    "verdict-fail": (edit(R, "Verdict: PASS exit=0", "Verdict: FAIL exit=1"), "verdict is 'Verdict: FAIL exit=1'"),
    "verdict-timeout": (edit(R, "Verdict: PASS exit=0", "Verdict: FAIL exit=3"), "not 'Verdict: PASS exit=0'"),
    "no-verdict": (edit(R, VERDICT + "\n", ""), "no 'Verdict:' line"),
    "two-verdicts": (edit(R, VERDICT, VERDICT + "\nVerdict: FAIL exit=1 elapsed=1.00s phases="),
                     "'Verdict:' lines disagree"),
    "fail-finding": (edit(R, "  [PASS] fabric:", "  [FAIL] fabric:"), "finding: [FAIL] fabric: no InfiniBand"),
    "grads-differ": (edit(R, "gradients_identical=yes", "gradients_identical=NO"), "gradients_identical=NO"),
    "wrong-sum": (edit(R, f"sum={S} expected={S}", f"sum={S + 1} expected={S}"),
                  f"all_reduce sum={S + 1} but expected={S}"),
    "wrong-expected": (edit(R, f"sum={S} expected={S}", f"sum={S + 1} expected={S + 1}"),
                       f"all_reduce expected={S + 1} but {N} ranks sum to {S}"),
    "wrong-rank-count": (edit(R, f"expected={S} on {N} rank(s)", f"expected={S} on {N + 1} rank(s)"),
                         f"all_reduce ran on {N + 1} rank(s)"),
    "no-sum": (re.sub(r".*all_reduce exact:.*\n", "", R), "no 'all_reduce exact"),
    "no-grads": (re.sub(r".*gradients_identical=.*\n", "", R), "no 'gradients_identical="),
    "missing-rank": (edit(R, f"Ranks Reported: {N}/{N}", f"Ranks Reported: {N - 1}/{N}"),
                     f"Ranks Reported: {N - 1}/{N}: {N - 1} of {N} rank(s)"),
    "other-world": (edit(R, f"Ranks Reported: {N}/{N}", f"Ranks Reported: {N + 1}/{N + 1}"),
                    f"out of {N + 1} rank(s) but Total Execution"),
    "no-ranks-reported": (edit(R, f"Ranks Reported: {N}/{N}\n", ""), "no 'Ranks Reported"),
    "failure-line": (R + "FAILURE: collective: all_reduce returned wrong values\n", "failure reported"),
    "rank-failure-line": (R + "[node2:3] FAILURE: rendezvous: master unreachable\n", "failure reported"),
    "no-findings": (edit(R, "\nFINDINGS\n", "\n"), "no FINDINGS section"),
}


@pytest.mark.parametrize("name", sorted(EDITS))
def test_each_contradiction_is_named(name):
    text, needle = EDITS[name]
    assert aiv.SUCCESS_LINE in text                      # the marker alone does not make it a pass
    ok, problems, _ = verify(text)
    assert not ok and any(needle in p for p in problems), problems


WARNED = edit(R, "  [PASS] fabric:", "  [WARN] fabric:")


def test_warn_finding_fails_only_under_strict():
    assert verify(WARNED)[0]
    ok, problems, _ = verify(WARNED, strict=True)
    assert not ok and "finding (a FAIL under --strict): [WARN] fabric: no InfiniBand ports on any node (sockets " \
        "only)" in problems
    assert all(p.startswith("finding (a FAIL under --strict): [WARN] ") for p in problems)


def broken_state():
    """A failed run with several things wrong at once."""
    recs = make_cluster(["node1"], 1, with_gpu=False)
    findings = [aiv.finding("ddp", "FAIL", "DDP gradients differ from rank 0's on rank 1 (node2)"),
                aiv.finding("imports", "WARN", "torchvision missing on node1")]
    return {"world_size": 2, "backend": "gloo", "ranks": recs, "findings": findings, "verdict": "FAIL",
            "exit_code": 1, "elapsed_s": 3.0, "phases": {}, "failures": aiv.failure_lines(findings), "env": {},
            "collectives": {"ar_sum": 2, "ar_expected": 3, "ranks": 2, "loss": 0.5, "grads_identical": False}}


BROKEN_NEEDLES = ["success marker missing", "failure reported: FAILURE: ddp:", "verdict is 'Verdict: FAIL exit=1'",
                  "Ranks Reported: 1/2: 1 of 2", "all_reduce sum=2 but expected=3", "gradients_identical=NO",
                  "finding: [FAIL] ddp:", "topology accounts for 1 ranks but Total Execution Ranks is 2"]


def test_every_reason_is_named_on_its_own_line(tmp_path):
    text = tool_log(broken_state())
    ok, problems, _ = verify(text)
    assert not ok
    for needle in BROKEN_NEEDLES:
        assert sum(needle in p for p in problems) == 1, (needle, problems)
    p = tmp_path / "broken.log"
    p.write_text(text)
    r = run_tool(["--verify-log", p], timeout=60)
    out = r.stdout.splitlines()
    assert r.returncode == 1, r.stdout + r.stderr
    assert out[:-1] == [f"verify-log: MISSING/BAD: {x}" for x in problems]
    assert out[-1] == f"verify-log: FAIL {p} world_size=2 nodes=1 torch=2.13.0"


# ---------------------------------------------------------------------------- the command line
def test_cli_strict_flag_and_variable(tmp_path):
    p = tmp_path / "warned.log"
    p.write_text(WARNED)
    assert run_tool(["--verify-log", p], timeout=60).returncode == 0
    r = run_tool(["--verify-log", p, "--strict"], timeout=60)
    assert r.returncode == 1 and "verify-log: MISSING/BAD: finding (a FAIL under --strict)" in r.stdout
    assert run_tool(["--verify-log", p], env={"AIV_STRICT": "1"}, timeout=60).returncode == 1


def test_cli_passes_a_slurm_log_with_expectations_from_variables(tmp_path):
    p = tmp_path / "ai_infra_smoke_test_4711.log"
    p.write_text(SLURM)
    r = run_tool(["--verify-log", p], env={"AIV_EXPECT_WORLD_SIZE": "4", "AIV_EXPECT_NODES": "2"}, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.splitlines() == [f"verify-log: PASS {p} world_size=4 nodes=2 torch=2.13.0"]


@pytest.mark.parametrize("env", [{"AIV_VERIFY_LOG": "x.log"}, {"AIV_VERIFY_LOG": ""}], ids=["set", "empty"])
@pytest.mark.parametrize("args", [[], ["--verify-log", "y.log"]], ids=["run", "flag"])
def test_the_variable_is_refused_never_a_silent_log_check(args, env):
    """Left exported, AIV_VERIFY_LOG would turn a Slurm job into a log check of an old PASS: refused."""
    r = run_tool(args, env=env, timeout=60)
    assert r.returncode == 2, r.stdout + r.stderr
    assert r.stdout.splitlines() == [f"FAILURE: usage: AIV_VERIFY_LOG={env['AIV_VERIFY_LOG']!r} is no longer read "
                                     "(left exported it turned every later run, Slurm jobs included, into a log "
                                     "check): unset it and use --verify-log FILE"]


@pytest.mark.parametrize("args", [["--verify-log", ""], ["--verify-log="], ["--verify-log", "  "]],
                         ids=["flag", "flag-equals", "blank"])
def test_empty_path_is_a_usage_error_not_a_run(args):
    r = run_tool(args, timeout=60)
    assert r.returncode == 2, r.stdout + r.stderr
    assert r.stdout.splitlines() == ["FAILURE: usage: --verify-log is empty; give the path of a saved log"]
    assert r.stderr.startswith("usage: ddp_mesh_ping.py") and "Traceback" not in r.stderr


def test_unreadable_path_is_a_usage_error(tmp_path):
    r = run_tool(["--verify-log", tmp_path / "absent.log"], timeout=60)
    out = (r.stdout + r.stderr).strip().splitlines()
    assert r.returncode == 2
    assert out == [f"FAILURE: usage: --verify-log: cannot read {tmp_path / 'absent.log'}: No such file or directory"]
    r = run_tool(["--verify-log", tmp_path], timeout=60)
    assert r.returncode == 2 and r.stdout.startswith("FAILURE: usage: --verify-log: cannot read ")


def test_empty_file_fails(tmp_path):
    p = tmp_path / "empty.log"
    p.write_text("")
    r = run_tool(["--verify-log", p], timeout=60)
    assert r.returncode == 1 and "verify-log: MISSING/BAD: success marker missing" in r.stdout


def test_a_failure_past_300_mb_is_read(tmp_path):
    """The whole file is read, line by line: a FAILURE line after a 300 MB hole (a sparse file) fails."""
    p = tmp_path / "long.log"
    with open(p, "wb") as f:
        f.write(REFERENCE.encode())
        f.seek(300 << 20, io.SEEK_CUR)
        f.write(b"\nFAILURE: collective: rank 3 (node2): all_reduce returned 7, expected 10\n")
    assert p.stat().st_size > 300 << 20 and aiv.verify_log(REFERENCE, {})[0]
    t = time.monotonic()
    r = run_tool(["--verify-log", p], timeout=120)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "verify-log: MISSING/BAD: failure reported: FAILURE: collective: rank 3 (node2)" in r.stdout
    assert time.monotonic() - t < 100  # generous: about a second on a laptop


def test_only_lines_that_matter_are_kept():
    noise = "\n".join(f"step {i} loss=0.{i} lr=3e-4 tokens/s=1.2e6" for i in range(10000))
    kept = aiv.read_log_lines(io.BytesIO((noise + "\n" + REFERENCE + "\n" + noise).encode()))
    assert len(kept) < len(REFERENCE.splitlines()) and aiv.verify_log(kept, {}) == aiv.verify_log(REFERENCE, {})


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(["Total Execution Ranks:", "Verdict:", "Ranks Reported:", "node", "nodes", "=",
                                 "torch", "cuda", "nccl", "x", " ", ":", "\0", "Ranks", "Total"]), max_size=12))
def test_the_quick_word_test_keeps_exactly_the_lines_the_regex_keeps(parts):
    line = "".join(parts)
    assert bool(aiv._log_relevant(line)) == bool(
        line in aiv.LOG_SECTIONS or line == aiv.SUCCESS_LINE or aiv._LOG_FAILURE.match(line)
        or aiv._LOG_FINDING.match(line) or aiv._LOG_SUM.match(line) or aiv._LOG_GRADS.match(line)
        or aiv._LOG_KEEP.search(line))
