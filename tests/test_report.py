"""The rendered report, the JSON beside it, and --verify-log on good and damaged logs."""
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import aiv, cluster, run_tool


def state_for(recs, world=None, findings=None, code=0, backend="nccl"):
    world = world or len(recs)
    findings = aiv.judge_all(recs, world, {}) if findings is None else findings
    return {"world_size": world, "backend": backend, "ranks": recs, "findings": findings,
            "verdict": "PASS" if code == 0 else "FAIL", "exit_code": code, "elapsed_s": 1.5,
            "phases": {"init": 0.5}, "failures": aiv.failure_lines(findings),
            "collectives": {"ar_sum": world * (world + 1) // 2, "ar_expected": world * (world + 1) // 2,
                            "ranks": world, "loss": 0.5,
                            "grads_identical": True}, "env": {"NCCL_DEBUG": "WARN"}}


def log_text(recs, **kw):
    st = state_for(recs, **kw)
    return f"Total Execution Ranks: {st['world_size']}\n" + aiv.render_report(st)


def test_report_sections_and_success_line():
    text = log_text(cluster(2, 2, with_gpu=True))
    for s in ("CLUSTER HARDWARE TOPOLOGY REPORT", "NODE ENVIRONMENT DEEP DIVE",
              "NETWORK INTERCONNECT & FABRIC STATUS", "FINDINGS", "Ranks Reported: 4/4"):
        assert s in text
    assert text.splitlines()[-1] == "SUCCESS: DDP Multi-Node AllReduce Ring Complete!"
    assert "uuid=GPU-1-1" in text and "node=node2" in text


def test_failed_report_has_failure_lines_and_no_success():
    recs = cluster(2, 2)
    findings = aiv.judge_all(recs, 4, {"ranks_per_node": 3})
    text = log_text(recs, findings=findings, code=1)
    assert aiv.SUCCESS_LINE not in text
    assert "FAILURE: layout: node node1 runs 2 ranks but 3 per node were expected" in text


def test_verify_log_accepts_a_good_log():
    ok, problems, facts = aiv.verify_log(log_text(cluster(2, 2, with_gpu=True)),
                                         {"world_size": 4, "nodes": 2, "ranks_per_node": 2})
    assert ok, problems
    assert facts["nodes"] == 2 and facts["torch"] == "2.13.0" and facts["nccl"] == "2.28.3"


@pytest.mark.parametrize("expect,needle", [
    ({"world_size": 8}, "expected 8"),
    ({"nodes": 3}, "expected 3"),
    ({"ranks_per_node": 4}, "expected 4"),
])
def test_verify_log_checks_expectations(expect, needle):
    ok, problems, _ = aiv.verify_log(log_text(cluster(2, 2)), expect)
    assert not ok and any(needle in p for p in problems)


def damage(text, how):
    lines = text.splitlines()
    if how == "truncated":
        return "\n".join(lines[: len(lines) // 2])
    if how == "no-success":
        return "\n".join(ln for ln in lines if not ln.startswith("SUCCESS"))
    if how == "failure":
        return text + "\nFAILURE: collective: all_reduce returned wrong values"
    if how == "garbled-topology":
        return text.replace("local_ranks=0-1", "local_ranks=0-x", 1)
    if how == "bad-local-ranks":
        return text.replace("local_ranks=0-1", "local_ranks=1-2", 1)
    if how == "no-torch":
        return "\n".join(ln.replace("torch=2.13.0", "torch=-") for ln in lines)
    if how == "world-mismatch":
        return text.replace("Total Execution Ranks: 4", "Total Execution Ranks: 6")
    if how == "two-totals":
        return "Total Execution Ranks: 8\n" + text
    if how == "binary":
        return "\x00\xff" * 50
    raise AssertionError(how)


@pytest.mark.parametrize("how", ["truncated", "no-success", "failure", "garbled-topology", "bad-local-ranks",
                                 "no-torch", "world-mismatch", "two-totals", "binary"])
def test_verify_log_rejects_damaged_logs(how):
    ok, problems, _ = aiv.verify_log(damage(log_text(cluster(2, 2)), how), {})
    assert not ok and problems


def test_verify_log_tolerates_interleaved_noise():
    noise = "node2:1234:1300 [1] NCCL INFO Channel 00/0 : 1[1] -> 2[0] [send] via NET/Socket/0"
    lines = log_text(cluster(2, 2)).splitlines()
    mixed = "\n".join(x for ln in lines for x in (ln, noise))
    ok, problems, _ = aiv.verify_log(mixed, {"world_size": 4})
    assert ok, problems


def test_collapsed_report_at_scale_still_verifies():
    recs = cluster(64, 8, with_gpu=True)
    recs[8 * 5 + 3]["gpu"]["mem_used"] = 40 << 30          # one deviating node: node6
    text = log_text(recs)
    topo = [ln for ln in text.splitlines() if ln.startswith("  node=")]
    assert len(topo) < 10, topo                              # 64 nodes collapse to a few lines
    assert any(ln.startswith("  node=node6 nodes=1") for ln in topo)
    assert sum(1 for ln in text.splitlines() if ln.startswith("    rank=")) == 1   # only the flagged rank
    ok, problems, facts = aiv.verify_log(text, {"world_size": 512, "nodes": 64, "ranks_per_node": 8})
    assert ok, problems


def test_verify_log_cli_exit_codes(tmp_path):
    good = tmp_path / "good.log"
    good.write_text(log_text(cluster(2, 2)))
    bad = tmp_path / "bad.log"
    bad.write_text(damage(good.read_text(), "no-success"))
    assert run_tool(["--verify-log", good, "--expect-world-size", 4]).returncode == 0
    r = run_tool(["--verify-log", bad])
    assert r.returncode == 1 and "success marker missing" in r.stdout
    assert run_tool(["--verify-log", tmp_path / "absent.log"]).returncode == 2
    assert run_tool(["--verify-log", good, "--expect-nodes", "two"]).returncode == 2


def test_json_atomic_write(tmp_path):
    p = tmp_path / "v.json"
    aiv.write_json_atomic(str(p), {"a": 1})
    assert json.loads(p.read_text()) == {"a": 1}
    assert [x.name for x in tmp_path.iterdir()] == ["v.json"]


GOOD = log_text(cluster(2, 2))


@given(st.lists(st.sampled_from(GOOD.splitlines() + ["FAILURE: x: y", "garbage ]]] [[[", "node=n[1-", ""]),
                max_size=80), st.integers(0, 4))
@settings(max_examples=300, deadline=None)
def test_verify_log_never_raises_on_shuffled_lines(lines, n):
    ok, problems, _ = aiv.verify_log("\n".join(lines), {"world_size": n or None})
    assert ok or problems


@given(st.text(max_size=2000))
@settings(max_examples=300, deadline=None)
def test_verify_log_never_raises_on_random_text(text):
    ok, problems, _ = aiv.verify_log(text, {})
    assert not ok and problems


def test_reference_log_verifies():
    """The committed reference log of a real run must keep passing --verify-log, its facts those of its JSON."""
    import json

    from conftest import ROOT
    text = (ROOT / "reference_output.log").read_text()
    state = json.loads((ROOT / "reference_output.json").read_text())
    ok, problems, facts = aiv.verify_log(text, {})
    assert ok, problems
    assert facts["backend"] == state["backend"]
    if state["backend"] == "nccl":
        assert facts["cuda"] and facts["nccl"]


# ---------------------------------------------------------------- FINDINGS rows: one per check and node
def test_finding_rows_never_pass_a_node_that_has_a_warn_or_fail_under_the_same_check():
    F = aiv.finding
    findings = [F("manifest", "PASS", "1 node(s) match the manifest", ["node1"]),
                F("manifest", "FAIL", "gpu.tflops/H200 500 on node1 GPU 3 is below the band", ["node1"], [3]),
                F("manifest", "FAIL", "gpu.hbm_gbps/H200 3000 on node1 GPU 3 is below the band", ["node1"], [3]),
                F("fabric", "PASS", "8 port(s) ACTIVE on 2 node(s)", ["node1", "node2"]),
                F("fabric", "WARN", "node2 mlx5_0:1 is DOWN", ["node2"]),
                F("gpu-perf", "PASS", "GPU speed within the reference on 16 GPU(s)"),
                F("gpu-perf", "WARN", "rank 9 on node2: ECC errors", ["node2"], [9]),
                F("layout", "PASS", "2 node(s) x 8 rank(s)")]
    rows = aiv.finding_rows(findings)
    assert rows == [
        ("FAIL", "manifest", "gpu.tflops/H200 500 on node1 GPU 3 is below the band | "
                             "gpu.hbm_gbps/H200 3000 on node1 GPU 3 is below the band"),
        ("PASS", "fabric", "8 port(s) ACTIVE on 2 node(s) (except node2: see its WARN row)"),
        ("WARN", "fabric", "node2 mlx5_0:1 is DOWN"),
        ("PASS", "gpu-perf", "GPU speed within the reference on 16 GPU(s) (except node2: see its WARN row)"),
        ("WARN", "gpu-perf", "rank 9 on node2: ECC errors"),
        ("PASS", "layout", "2 node(s) x 8 rank(s)")]
    # every (check, node) pair is in one row only, and a PASS row never stands unqualified beside a problem
    for check in {f["check"] for f in findings}:
        bad = [r for r in rows if r[1] == check and r[0] != "PASS"]
        assert len(bad) == len({tuple(f["hosts"]) for f in findings if f["check"] == check and f["status"] != "PASS"})
        for st_, _, text in rows:
            if st_ == "PASS" and _ == check and bad:
                assert "(except " in text
    # the findings themselves and their FAILURE lines are untouched: one line per failed finding
    assert len(aiv.failure_lines(findings)) == 2 and findings[0]["status"] == "PASS"


def test_finding_rows_worst_status_wins_and_a_repeated_reason_is_said_once():
    F = aiv.finding
    a = F("day0", "WARN", "node1: /dev/shm is 64 MiB", ["node1"])
    worse = dict(F("day0", "WARN", "node1: something worse", ["node1"]), status="FAIL")  # as --strict makes it
    rows = aiv.finding_rows([a, dict(a), worse,
                             F("day0", "WARN", "no host named", []), F("day0", "WARN", "no host named either", [])])
    assert rows == [("FAIL", "day0", "node1: /dev/shm is 64 MiB | node1: something worse"),
                    ("WARN", "day0", "no host named"), ("WARN", "day0", "no host named either")]
    acc = dict(F("imports", "WARN", "node1: torchvision missing", ["node1"]), accepted=True)
    assert aiv.finding_rows([acc]) == [("WARN", "imports", "node1: torchvision missing (accepted in manifest)")]


def test_report_of_a_band_fail_shows_no_pass_for_its_node():
    recs = cluster(1, 2)
    F = aiv.finding
    findings = [F("manifest", "PASS", "1 node(s) match the manifest (1 listed, 0 judged by class)", ["node1"]),
                F("manifest", "FAIL", "gpu.tflops/cpu 1 on node1 GPU 0 (rank 0) is below the band", ["node1"], [0]),
                F("manifest", "FAIL", "gpu.hbm_gbps/cpu 1 on node1 GPU 0 (rank 0) is below the band", ["node1"], [0])]
    text = aiv.render_report(state_for(recs, findings=findings, code=1))
    rows = [ln for ln in text.splitlines() if ln.startswith("  [")]
    assert rows == ["  [FAIL] manifest: gpu.tflops/cpu 1 on node1 GPU 0 (rank 0) is below the band | "
                    "gpu.hbm_gbps/cpu 1 on node1 GPU 0 (rank 0) is below the band"]
    assert sum(ln.startswith("FAILURE: manifest: ") for ln in text.splitlines()) == 2


def test_each_warn_or_fail_that_says_what_to_do_gets_one_action_line():
    rows = [{"rank": 3, "host": "n2", "local_rank": 1, "uuid": "GPU-3", "model": "NVIDIA H200", "tflops": 300.0,
             "hbm_gbps": 4200.0, "tries": 2}]
    found = aiv.judge_gpu_perf(rows)
    assert found[0]["status"] == "FAIL" and "measured again on n2" in found[0]["evidence"]
    assert "dcgmi diag -r 3" in found[0]["action"]
    lines = aiv.action_lines(found + found + [aiv.finding("layout", "PASS", "ok")])
    assert lines == [f"gpu-perf n2: {found[0]['action']} (evidence: {found[0]['evidence']})"]  # once, PASS never
