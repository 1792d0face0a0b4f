"""The numerics check (silent data corruption): its judge on plain data, its measurement on the CPU, and real
runs with a fault injected from outside the tool (tests/sdc/sitecustomize.py on one rank's PYTHONPATH)."""
import json
from pathlib import Path

import pytest

from conftest import aiv, failures, spawn
from conftest import rec as record

torch = pytest.importorskip("torch")

SDC = str(Path(__file__).resolve().parent / "sdc")
H200 = "NVIDIA H200"
SW = {"torch": "2.13.0+cu130", "sms": 132, "cc": "9.0", "cuda": "13.0", "cublas": 130100, "env": {}}


def post(digest="d0", off=False, err=0.001, tol=0.04, at=(7, 9), checks=("matmul-bf16", "matmul-fp32"), **kw):
    """A rank's numerics post: every check with the same digest and error unless kw names the check."""
    out = {}
    for c in checks:
        p = {"digest": digest, "off": off, "err": err, "tol": tol, "abs": err * 100, "rel": err, "at": list(at),
             "value": 1.5, "ref": 1.4}
        p.update(kw.get(c.replace("-", "_"), {}))
        out[c] = p
    return {"checks": out, "software": dict(SW)}


def rec(rank, host, numerics, model=H200, driver="580.1"):
    return {"rank": rank, "host": host, "local_rank": rank % 8, "device": rank % 8,
            "gpu": {"name": model, "uuid": f"GPU-{rank:04d}"}, "numerics": numerics,
            "node": {"driver": driver, "cpu_model": "Xeon"}}


def judge(records):
    return aiv.judge_numerics(aiv.numerics_rows(records))


def fails(found):
    return [f for f in found if f["status"] == "FAIL"]


# ---------------------------------------------------------------------------- the judge
def test_agreeing_ranks_pass():
    (f,) = judge([rec(r, f"node{r // 2}", post()) for r in range(4)])
    assert f["status"] == "PASS" and f["check"] == "numerics" and "4 rank(s) in 1 group(s)" in f["reason"]


def test_a_minority_of_bits_is_the_culprit_with_host_and_uuid():
    recs = [rec(r, f"node{r // 4}", post()) for r in range(8)]
    recs[5]["numerics"] = post(matmul_bf16={"digest": "bad", "at": [3, 4], "abs": 0.25})
    (f,) = judge(recs)
    assert f["status"] == "FAIL" and f["hosts"] == ["node1"] and f["ranks"] == [5]
    r = f["reason"]
    assert r.startswith("rank 5 on node1 (GPU GPU-0005, cuda:5") and "matmul-bf16" in r and "matmul-fp32" not in r
    assert "bits differ from those of the 7 other rank(s)" in r and "element (3, 4)" in r and "dcgmi diag -r 3" in r


def test_off_the_reference_is_a_culprit_even_when_its_bits_are_a_majority_of_none():
    recs = [rec(r, f"node{r}", post()) for r in range(3)]
    recs[1]["numerics"] = post(matmul_fp32={"digest": "x", "off": True, "err": 0.5, "tol": 1e-4, "abs": 0.108,
                                            "rel": 0.0245, "at": [85, 90]})
    (f,) = fails(judge(recs))
    assert f["hosts"] == ["node1"] and f["ranks"] == [1]
    assert "matmul-fp32 (fp32 matmul through @, TF32 off) is off the fp64 reference: max abs error 0.108 at " \
           "element (85, 90)" in f["reason"] and "5e+03x the tolerance" in f["reason"]


def test_every_rank_of_a_model_off_the_same_way_is_one_finding_about_the_software_no_host():
    recs = [rec(r, f"node{r // 8}", post(matmul_fp32={"off": True, "err": 0.01, "tol": 1e-4}))
            for r in range(16)]
    (f,) = fails(judge(recs))
    assert f["hosts"] == [] and f["ranks"] == list(range(16))
    assert "every one of the 16 rank(s) of NVIDIA H200" in f["reason"] and "with the same bits" in f["reason"]
    assert "not of a host: no host blamed" in f["reason"] and "cuBLAS 130100, driver 580.1" in f["reason"]


def test_two_ranks_disagreeing_the_reference_decides():
    """A tie of two: the one off the reference is the culprit, and the bf16 disagreement is put on it too."""
    recs = [rec(0, "node1", post()),
            rec(1, "node2", post(digest="other", matmul_fp32={"off": True, "err": 0.3, "tol": 1e-4}))]
    (f,) = fails(judge(recs))
    assert f["ranks"] == [1] and f["hosts"] == ["node2"]
    assert "matmul-fp32" in f["reason"] and "matmul-bf16" in f["reason"] and "is off the fp64" in f["reason"]


def test_two_ranks_disagreeing_neither_off_the_reference_names_no_culprit():
    recs = [rec(0, "node1", post()), rec(1, "node2", post(matmul_bf16={"digest": "other"}))]
    (f,) = fails(judge(recs))
    assert f["hosts"] == [] and f["ranks"] == [0, 1]
    assert "disagree bit for bit on matmul-bf16" in f["reason"] and "cannot tell which" in f["reason"]
    assert "rank(s) 0 (node1) | rank(s) 1 (node2)" in f["reason"] and "dcgmi diag -r 3 on node[1-2]" in f["reason"]


def test_a_two_two_tie_names_no_culprit_and_no_host():
    recs = [rec(r, f"node{r}", post(digest="a" if r < 2 else "b")) for r in range(4)]
    found = fails(judge(recs))
    assert found and all(f["hosts"] == [] for f in found)


def test_other_software_or_model_is_never_held_to_the_others_bits():
    recs = [rec(r, f"node{r}", post()) for r in range(4)]
    recs.append(rec(4, "node4", post(digest="other-driver"), driver="570.9"))
    recs.append(rec(5, "node5", post(digest="other-model"), model="NVIDIA H100 80GB HBM3"))
    newer = post(digest="other-cublas")
    newer["software"]["cublas"] = 130200
    recs.append(rec(6, "node6", newer))
    (f,) = judge(recs)
    assert f["status"] == "PASS" and "in 4 group(s)" in f["reason"]


def test_a_lone_rank_off_the_reference_fails_without_blaming_its_host():
    (f,) = fails(judge([rec(0, "node1", post(matmul_fp32={"off": True, "err": 0.3, "tol": 1e-4}))]))
    assert f["hosts"] == [] and f["ranks"] == [0] and "the only rank of its model and software" in f["reason"]


def test_errors_unread_and_the_tools_own_error():
    recs = [rec(0, "node1", post()), rec(1, "node2", {"error": "RuntimeError: CUDA error: an illegal memory access"}),
            rec(2, "node3", {"unread": 30.0}), rec(3, "node4", {"internal": "KeyError: 'x'"}),
            rec(4, "node5", post())]
    found = {f["check"] + f["status"]: f for f in judge(recs)}
    assert found["numericsFAIL"]["hosts"] == ["node2"] and "illegal memory access" in found["numericsFAIL"]["reason"]
    # not checked in time is no evidence: said, its host involved, not blamed
    assert (found["numericsWARN"]["hosts"], found["numericsWARN"]["involved"], found["numericsWARN"]["blame"]) == (
        [], ["node3"], "not-collected") and "within 30s" in found["numericsWARN"]["reason"]
    assert found["internalFAIL"]["hosts"] == [] and found["internalFAIL"]["code"] == aiv.EXIT_INTERNAL


def test_many_culprits_are_listed_then_counted():
    recs = [rec(r, f"node{r}", post()) for r in range(60)]
    for r in range(20):
        recs[r]["numerics"] = post(digest=f"bad{r}")
    found = fails(judge(recs))
    assert len(found) == aiv.NUMERICS_LIST_MAX + 1 and "and 4 more rank(s)" in found[-1]["reason"]
    assert sorted(h for f in found for h in f["hosts"]) == sorted(f"node{r}" for r in range(20))


def test_the_gate_judges_numerics_only_when_the_ranks_carry_them():
    recs = [record(r, host=f"node{r}", numerics=post()) for r in range(2)]
    assert [f["status"] for f in aiv.judge_gate(recs) if f["check"] == "numerics"] == ["PASS"]
    for r in recs:
        del r["numerics"]
    assert not [f for f in aiv.judge_gate(recs) if f["check"] == "numerics"]


def test_ddp_local_gradients_are_judged_from_the_results():
    recs = [rec(r, f"node{r}", post()) for r in range(3)]
    g = {"digest": "g", "off": False, "err": 1e-8, "tol": 8e-6, "at": [3]}
    results = [{"rank": r, "grads_local": dict(g)} for r in range(3)]
    results[2]["grads_local"].update(digest="h", off=True, err=1e-2, abs=0.03)
    (f,) = fails(aiv.judge_ddp_grads(recs, results))
    assert f["ranks"] == [2] and f["hosts"] == ["node2"] and "DDP step's local backward" in f["reason"]
    assert "ddp-grad" in f["reason"] and "element (3)" in f["reason"]
    assert aiv.judge_ddp_grads(recs, [{"rank": r} for r in range(3)]) == []


def soak_row(rank, repeats=5, mismatches=0):
    return {"rank": rank, "host": f"node{rank}", "local_rank": 0, "device": 0, "uuid": f"GPU-{rank}", "model": H200,
            "numerics_repeats": repeats, "numerics_mismatches": mismatches,
            "numerics_first_bad": [{"t": 12.5, "check": "matmul-bf16", "abs": 0.03, "at": [1, 2]}][:mismatches]}


def test_soak_repeats():
    (f,) = aiv.judge_numerics_soak([soak_row(0), soak_row(1)])
    assert f["status"] == "PASS" and "10 repeat(s)" in f["reason"]
    (f,) = aiv.judge_numerics_soak([soak_row(0), soak_row(1, mismatches=2)])
    assert f["status"] == "FAIL" and f["hosts"] == ["node1"] and "2 of 5 repeat(s)" in f["reason"]
    assert "first at 12.5s: matmul-bf16" in f["reason"] and "intermittent" in f["reason"]
    (f,) = aiv.judge_numerics_soak([soak_row(0, mismatches=1), soak_row(1, mismatches=1)])
    assert f["status"] == "FAIL" and f["hosts"] == [] and "not deterministic" in f["reason"]
    assert aiv.judge_numerics_soak([{"rank": 0}]) == []
    found = aiv.judge_soak([dict(soak_row(0, mismatches=1), tflops_first=1.0, tflops_last=1.0)], cpu=True)
    assert [(f["check"], f["status"]) for f in found] == [("soak", "PASS"), ("numerics", "FAIL")]


# ---------------------------------------------------------------------------- the measurement, on this CPU
def test_a_healthy_cpu_is_within_every_tolerance_and_deterministic():
    a = aiv.numerics_measure(torch, None, "cpu")
    b = aiv.numerics_measure(torch, None, "cpu")
    assert set(a["checks"]) == {"matmul-bf16", "linear-bf16", "matmul-fp32", "elementwise-fp32"}
    for c, p in a["checks"].items():
        assert not p["off"] and p["err"] <= p["tol"], (c, p)
        assert p["digest"] == b["checks"][c]["digest"] and len(p["digest"]) == 32
    g = aiv.ddp_local_grads(torch, torch.device("cpu"))
    assert not g["off"] and g["digest"] == aiv.ddp_local_grads(torch, torch.device("cpu"))["digest"]


def test_the_digest_sees_any_one_element_change():
    t = torch.randn(64, 33)
    base = aiv.numerics_digest(torch, t)
    for k in (0, 1, 700, t.numel() - 1):
        u = t.clone()
        u.view(-1)[k] = torch.nextafter(u.view(-1)[k], torch.tensor(float("inf")))  # one ulp
        assert aiv.numerics_digest(torch, u) != base, k
    assert aiv.numerics_digest(torch, t.clone()) == base
    assert aiv.numerics_digest(torch, t.bfloat16()) != aiv.numerics_digest(torch, t.bfloat16() * 2)


def test_the_precision_setting_is_put_back():
    before = torch.get_float32_matmul_precision()
    with aiv.fp32_matmul_precision(torch, "high"):
        assert torch.get_float32_matmul_precision() == "high"
    assert torch.get_float32_matmul_precision() == before


def test_the_tolerances_grow_with_k_and_tf32_is_looser():
    assert aiv.numerics_tolerance("matmul-fp32", 1024) > aiv.numerics_tolerance("matmul-fp32", 256)
    assert aiv.numerics_tolerance("matmul-tf32", 1024) > 10 * aiv.numerics_tolerance("matmul-fp32", 1024)
    assert aiv.numerics_tolerance("matmul-fp32", 1024, tf32_forced=True) == aiv.numerics_tolerance("matmul-tf32", 1024)


# ---------------------------------------------------------------------------- real runs, the fault from outside
def nodes(world, bad, mode="forward"):
    env = {r: {"SLURMD_NODENAME": f"node{r + 1}", "LOCAL_RANK": 0} for r in range(world)}
    if bad is not None:
        env[bad].update(PYTHONPATH=SDC, NUMERICS_FAULT=mode)
    return env


def run(world, bad, tmp_path, args=(), mode="forward"):
    jp = tmp_path / "v.json"
    res, _ = spawn(world, per_rank=nodes(world, bad, mode), args=["--timeout", 60, "--json", jp, *args])
    return res, json.loads(jp.read_text())


def test_clean_run_passes_with_the_numerics_and_the_ddp_gradients(tmp_path):
    res, d = run(2, None, tmp_path)
    assert [rc for rc, _ in res] == [0, 0], res[0][1]
    assert res[0][1].splitlines()[-1] == aiv.SUCCESS_LINE
    found = [f for f in d["findings"] if f["check"] == "numerics"]
    assert [f["status"] for f in found] == ["PASS", "PASS"] and "DDP step" in found[1]["reason"]
    assert all(set(r["numerics"]["checks"]) >= {"matmul-bf16", "matmul-fp32"} for r in d["ranks"])


@pytest.mark.parametrize("world,bad", [(2, 1), (3, 2)])
def test_a_rank_computing_wrong_fails_the_run_named_with_its_host(tmp_path, world, bad):
    res, d = run(world, bad, tmp_path, ["--skip-screen"])  # numerics is correctness: it runs without the screen
    assert [rc for rc, _ in res] == [1] * world, res[0][1]
    out = res[0][1]
    (line,) = failures(out)
    assert line.startswith(f"FAILURE: numerics: rank {bad} on node{bad + 1} (CPU) computes wrong numbers in the "
                           "numerics check:"), line
    assert "matmul-fp32 (fp32 matmul through @, TF32 off) is off the fp64 reference" in line
    assert aiv.SUCCESS_LINE not in out and "ddp:" not in out  # judged at the telemetry, before the collectives
    assert d["failed_hosts"] == [f"node{bad + 1}"] and d["verdict"] == "FAIL"
    assert d["ranks"][bad]["numerics"]["checks"]["matmul-fp32"]["off"] is True


def test_a_fault_only_in_backward_is_caught_by_the_ddp_local_gradients(tmp_path):
    res, d = run(2, 1, tmp_path, ["--skip-screen"], mode="backward")
    assert [rc for rc, _ in res] == [1, 1], res[0][1]
    (line,) = failures(res[0][1])
    assert line.startswith("FAILURE: numerics: rank 1 on node2 (CPU) computes wrong numbers in the DDP step's local "
                           "backward (before the all-reduce): ddp-grad"), line
    found = {(f["check"], f["status"]) for f in d["findings"]}
    assert ("ddp", "PASS") in found  # after the all-reduce every rank holds the same gradients: that check is blind
    first = next(f for f in d["findings"] if f["check"] == "numerics")
    assert first["status"] == "PASS" and first["reason"].startswith("numerics check:")  # forward results are right


def test_an_intermittent_fault_is_caught_by_the_soak(tmp_path):
    res, d = run(2, 1, tmp_path, ["--skip-screen", "--soak", 4], mode="flaky")
    assert [rc for rc, _ in res] == [1, 1], res[0][1]
    (line,) = failures(res[0][1])
    assert line.startswith("FAILURE: numerics: rank 1 on node2 (CPU): under sustained load (--soak)"), line
    assert d["soak"]["gpus"][0]["numerics_repeats"] >= 1 and d["soak"]["gpus"][1]["numerics_mismatches"] >= 1


def test_skip_numerics_turns_the_check_off(tmp_path):
    res, d = run(2, 1, tmp_path, ["--skip-screen", "--skip-numerics"])
    assert [rc for rc, _ in res] == [0, 0], res[0][1]
    assert not [f for f in d["findings"] if f["check"] == "numerics"] and d["ranks"][1]["numerics"] is None
