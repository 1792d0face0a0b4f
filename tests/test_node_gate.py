"""The node gate (--node-check): its contexts and exit codes, the parsers of nvidia-smi, Slurm and the kernel log,
the judges of one node with the evidence each finding carries, the verdict and what it drains (plain data); then
real runs of the tool on this CPU machine: a healthy node, a silent data corruption on one worker (the SDC
injector on local rank 1 only), a python without torch, a usage error, the lock, a budget too small, and a fake
nvidia-smi and scontrol first on PATH for what a CPU machine lacks (GPUs held by a process, ECC, Slurm's node)."""
import fcntl
import json
import os
import shlex
import shutil
import stat
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from conftest import SCRIPT, aiv, clean_env

SDC = str(Path(__file__).resolve().parent / "sdc")
H100 = "NVIDIA H100 80GB HBM3"


# ---------------------------------------------------------------------------- contexts and exit codes
@pytest.mark.parametrize("given, env, want", [
    ("prolog", {"SLURM_SCRIPT_CONTEXT": "epilog_slurmd"}, ("prolog", None)),  # the word wins
    ("auto", {"SLURM_SCRIPT_CONTEXT": "prolog_slurmd"}, ("prolog", None)),
    ("auto", {"SLURM_SCRIPT_CONTEXT": "epilog_slurmd"}, ("epilog", None)),
    ("auto", {}, ("health", None)),
    ("auto", {"SLURM_JOB_ID": "7", "SLURMD_NODENAME": "n1"}, ("health", None)),
])
def test_the_context_comes_from_the_word_then_slurm_then_health(given, env, want):
    assert aiv.node_context(given, env) == want


def test_a_controller_prolog_is_not_this_nodes_gate():
    ctx, problem = aiv.node_context("auto", {"SLURM_SCRIPT_CONTEXT": "prolog_slurmctld"})
    assert ctx == "prolog" and "not a node's own prolog or epilog" in problem


@pytest.mark.parametrize("ctx", ["prolog", "epilog", "health"])
def test_slurm_contexts_exit_1_only_for_a_fail_that_singles_the_node_out(ctx):
    assert aiv.node_exit_code(ctx, "FAIL", True) == 1
    assert [aiv.node_exit_code(ctx, v, False) for v in ("PASS", "FAIL", "NOT ASSESSED")] == [0, 0, 0]


def test_npd_exits_0_ok_1_problem_2_unknown():
    assert [aiv.node_exit_code("npd", *a) for a in (("PASS", False), ("FAIL", True), ("FAIL", False),
                                                    ("NOT ASSESSED", False))] == [0, 1, 2, 2]


def test_the_node_gates_checks_are_rows_of_the_one_check_table():
    checks = aiv.node_checks()
    assert checks and set(checks) <= set(aiv.CHECKS)
    for c in checks:
        r = aiv.CHECK_RULES[c]
        assert set(r["contexts"]) <= {"job", *aiv.NODE_CONTEXTS} and r["drain"] and r["why"], c
        json.dumps(r)  # plain data
    assert "epilog" not in aiv.CHECK_RULES["numerics"]["contexts"]  # the epilog stays passive
    assert {c for c in checks if "job" not in aiv.CHECK_RULES[c]["contexts"]} == {"gpu-count", "gpu-procs",
                                                                                  "gpu-health"}  # node-only
    own = dict(aiv.finding("gpu-count", "FAIL", "a GPU is missing", ["n1"], blame="own"))
    assert aiv.drains_in(own, "epilog") and not aiv.drains_in(dict(own, check="numerics"), "epilog")


# ---------------------------------------------------------------------------- parsers
SMI_ROWS = ("0, GPU-aaaa, 00000000:1B:00.0, NVIDIA H100 80GB HBM3, 0, 81559, 0, No, No\n"
            "1, GPU-bbbb, 00000000:3B:00.0, NVIDIA H100 80GB HBM3, 70000, 81559, 3, Yes, No\n"
            "Unable to determine the device handle for GPU0000:5D:00.0: GPU is lost.  Reboot the system\n"
            "2, GPU-cccc, 00000000:9A:00.0, NVIDIA H100 80GB HBM3, [N/A], 81559, [N/A], [N/A], [N/A]\n")


def test_nvidia_smi_rows_and_a_lost_gpu():
    rows, lost = aiv.parse_node_gpus(SMI_ROWS)
    assert [r["index"] for r in rows] == [0, 1, 2] and rows[1]["pci"] == "0000:3b:00.0"
    assert rows[1]["ecc_uncorrected"] == 3 and rows[1]["remap_pending"] is True and rows[1]["mem_used_mib"] == 70000
    assert rows[2]["ecc_uncorrected"] is None and rows[2]["remap_pending"] is None
    assert lost == [{"pci": "0000:5d:00.0", "why": "GPU is lost. Reboot the system"}]


def test_compute_apps_job_gpus_and_gres():
    apps = aiv.parse_compute_apps("4242, 70012, GPU-bbbb, python\n17, [N/A], GPU-aaaa, \ngarbage\n")
    assert apps == [{"pid": 4242, "mem_mib": 70012, "uuid": "GPU-bbbb", "name": "python"},
                    {"pid": 17, "mem_mib": None, "uuid": "GPU-aaaa", "name": None}]
    assert aiv.parse_gpu_ids("0,1,3") == [0, 1, 3] and aiv.parse_gpu_ids("0-3") == [0, 1, 2, 3]
    assert aiv.parse_gpu_ids("") is None and aiv.parse_gpu_ids("x") is None
    assert [aiv.parse_gres_gpus(g) for g in ("gpu:8", "gpu:h100:8(S:0-1)", "gpu:a:4,gpu:b:4(S:1)", "(null)",
                                             "nic:2")] == [8, 8, 8, None, None]
    assert aiv.parse_gres_used("gpu:h100:2(IDX:0,3),nic:0") == (2, [0, 3])
    assert aiv.parse_gres_used("gpu:0(IDX:N/A)") == (0, []) and aiv.parse_gres_used("gpu:4(IDX:0-3)")[1] == [0, 1, 2, 3]
    assert aiv.parse_gres_used("gpu:2") == (2, None) and aiv.parse_gres_used("gpu:0") == (0, [])
    assert aiv.gres_busy("gpu:1(IDX:1)", [0, 1]) == {1: "allocated to a running job (Slurm's GresUsed)"}
    assert set(aiv.gres_busy("gpu:1", [0, 1])) == {0, 1} and aiv.gres_busy("gpu:0", [0, 1]) == {}


def test_scontrol_show_node_and_the_kernel_log():
    text = ("NodeName=node3 Arch=x86_64 CoresPerSocket=1 Gres=gpu:2 GresUsed=gpu:2(IDX:0-1) State=MIXED+DRAIN "
            "Reason=aiv: node-check: numerics: GPU 1 wrong [health] [root@2026-12-06T11:27:25] Comment=(null)")
    assert aiv.parse_slurm_node(text) == {"state": "MIXED+DRAIN", "reason": "aiv: node-check: numerics: GPU 1 wrong "
                                          "[health]", "gres": "gpu:2", "gres_used": "gpu:2(IDX:0-1)"}
    kmsg = ("4,812,123456789,-;NVRM: Xid (PCI:0000:3b:00): 79, pid=1234, name=python, GPU has fallen off the bus.\n"
            "6,813,123456790,-;something else\n"
            "[ 4567.123456] NVRM: Xid (PCI:0000:1b:00): 48, pid='<unknown>', name=<unknown>, An uncorrectable ECC\n")
    assert aiv.parse_xids(kmsg) == [
        {"pci": "0000:3b:00.0", "xid": 79, "t": 123.456789,
         "text": "pid=1234, name=python, GPU has fallen off the bus."},
        {"pci": "0000:1b:00.0", "xid": 48, "t": 4567.123456,
         "text": "pid='<unknown>', name=<unknown>, An uncorrectable ECC"}]


# ---------------------------------------------------------------------------- devices and judges
GPUS = [{"index": i, "uuid": f"GPU-{i}", "pci": f"0000:{i:02x}:00.0", "name": H100} for i in range(4)]
HOG = {"pid": 4242, "mem_mib": 70012, "uuid": "GPU-1", "name": "python", "user": "alice", "job": "41"}


def test_prolog_holds_a_foreign_process_against_the_job_and_health_calls_it_busy():
    d = aiv.node_devices("prolog", GPUS, [1, 2], 2, {}, {1: [HOG]}, False)
    assert d == {"ids": [1, 2], "held": {1: [HOG]}, "busy": {}, "compute": [2]}
    d = aiv.node_devices("health", GPUS, None, 2, aiv.gres_busy("gpu:1(IDX:3)", [0, 1, 2, 3]), {1: [HOG]}, False)
    assert d["compute"] == [0, 2] and set(d["busy"]) == {1, 3} and "GresUsed" in d["busy"][3]
    assert aiv.node_devices("epilog", GPUS, [0], 2, {}, {}, False)["compute"] == []  # passive only
    assert aiv.node_devices("prolog", [], [1], 2, {}, {}, True)["ids"] == [1]  # CPU worker 1 stands in for GPU 1


def test_a_held_gpu_fails_the_prolog_naming_the_pid_and_what_it_holds():
    d = aiv.node_devices("prolog", GPUS, [1, 2], 2, {}, {1: [HOG]}, False)
    (f,) = [f for f in aiv.judge_gpu_procs("gpu7", "prolog", d, {1: "GPU-1"}) if f["status"] == "FAIL"]
    assert f["blame"] == "own" and f["hosts"] == ["gpu7"] and f["gpus"] == [1] and f["pids"] == [4242]
    assert "GPU 1 (GPU-1) is held before the job started: pid 4242 (python, user alice, job 41) holds 68.4GiB" \
           in f["reason"]
    busy = aiv.judge_gpu_procs("gpu7", "health", aiv.node_devices("health", GPUS, None, 2, {}, {1: [HOG]}, False),
                               {})
    assert [(f["status"], f["hosts"]) for f in busy] == [("PASS", [])] and "busy, not judged" in busy[0]["reason"]


def test_gpu_count_each_expectation_and_the_jobs_own_gpus():
    fs = aiv.judge_gpu_count("n1", [0, 1, 2], [{"pci": "0000:5d:00.0", "why": "GPU is lost"}],
                             [("the node's gres in Slurm", 4), ("NVIDIA GPUs on the PCI bus", 4)], [2, 3])
    fails = [f for f in fs if f["status"] == "FAIL"]
    assert len(fails) == 4 and all(f["blame"] == "own" and f["hosts"] == ["n1"] for f in fails)
    assert "NVML cannot reach the GPU at PCI 0000:5d:00.0" in fails[0]["reason"]
    assert "GPU(s) 3 (SLURM_JOB_GPUS)" in fails[-1]["reason"]
    (ok,) = aiv.judge_gpu_count("n1", [], [], [("--expect-gpus", 0)], None, cpu=True)
    assert ok["status"] == "PASS" and "CPU workers stand in" in ok["reason"]


def test_gpu_health_a_failed_remap_fails_counters_and_history_warn():
    """NVIDIA's memory error policy, one in both modes: uncorrected ECC errors (contained, the page offlined) and a
    pending row remap (applied at the next reset) WARN; a failed row remap (the RMA policy) FAILs and drains."""
    rows, _ = aiv.parse_node_gpus(SMI_ROWS)
    load = {0: {"pcie_width": 8, "pcie_width_max": 16, "throttle": 0x40}}
    xids = aiv.parse_xids("[ 10.0] NVRM: Xid (PCI:0000:9a:00): 31, pid=9, name=x, MMU Fault\n")
    fs = aiv.judge_gpu_health("n1", rows, load, xids)
    got = {(f["status"], f["blame"], tuple(f["gpus"]), tuple(f["hosts"])) for f in fs}
    assert got == {("WARN", "own", (1,), ("n1",)), ("WARN", "own", (0,), ("n1",)), ("WARN", "own", (2,), ("n1",))}, fs
    (ecc,) = [f for f in fs if f["gpus"] == [1]]
    assert ecc["short"] == "GPU 1 3 uncorrected ECC error(s) since the driver loaded" and not aiv.drains_in(
        ecc, "health")
    assert ecc["reason"].startswith("n1: GPU 1 (GPU-bbbb): 3 uncorrected ECC error(s)") and "row remapping pending" \
        in ecc["reason"]
    (f,) = aiv.judge_gpu_health("n1", [dict(rows[0], remap_failure=True)], {}, [])
    assert (f["status"], f["blame"], f["hosts"], f["short"]) == ("FAIL", "own", ["n1"], "GPU 0 row remapping failed")
    assert aiv.drains_in(f, "health") and aiv.drains_in(f, "epilog")
    (ok,) = aiv.judge_gpu_health("n1", [rows[0]], {}, [], kmsg_unread="/dev/kmsg: Permission denied")
    assert ok["status"] == "PASS" and "kernel log not read" in ok["reason"]


# ---------------------------------------------------------------------------- one core under both modes
@pytest.mark.parametrize("ecc, pending, failure, want", [
    ("0", "No", "No", None),
    ("3", "No", "No", "WARN"),
    ("0", "Yes", "No", "WARN"),
    ("3", "Yes", "No", "WARN"),
    ("0", "No", "Yes", "FAIL"),
    ("3", "Yes", "Yes", "FAIL"),
])
def test_the_same_memory_error_facts_judge_alike_in_the_preflight_and_the_node_gate(ecc, pending, failure, want):
    """One ECC / row-remap policy: the preflight's rows (its node's nvidia-smi, parse_node_smi, attached by UUID) and
    the node gate's (its own query, parse_node_gpus) give the same status and blame, name the same host and drain
    alike, each through its own mode's path (blame_gate and drain_plan; the node gate's verdict and drain)."""
    pre_rows = aiv.screen_gpu_rows(
        [aiv_rec(0, "n1", {"uuid": "GPU-aaaa", "name": H100}, {"smi": {"gpus": aiv.parse_node_smi(
            f"GPU-aaaa, {ecc}, {pending}, {failure}\n")}})], {0: {"rank": 0, "tflops": 700.0, "hbm_gbps": 3000.0}})
    pre = aiv.blame_gate(aiv.judge_gpu_facts(pre_rows))
    rows, _ = aiv.parse_node_gpus(f"0, GPU-aaaa, 00000000:1B:00.0, {H100}, 0, 81559, {ecc}, {pending}, {failure}\n")
    node = [f for f in aiv.judge_gpu_health("n1", rows, {}, []) if f["status"] != "PASS"]
    assert [(f["status"], f["blame"], f["hosts"]) for f in pre] == [(f["status"], f["blame"], f["hosts"])
                                                                     for f in node] == \
        ([(want, "own", ["n1"])] if want else [])
    pre_plan = aiv.drain_plan(pre, "recommend", 4, "42")
    node_plan = aiv.drain_plan(node, "recommend", 1, None, context="health")
    assert pre_plan["hosts"] == node_plan["hosts"] == (["n1"] if want == "FAIL" else [])
    assert aiv.node_verdict(node, "prolog")["exit_code"] == (1 if want == "FAIL" else 0)


def aiv_rec(rank, host, gpu, node):
    from conftest import rec
    return rec(rank, host=host, gpu=gpu, node=node)


def test_one_drain_planner_serves_both_modes():
    """The preflight and the node gate plan their drains with the one drain_plan and apply them with the one
    drain_apply: the node gate's reason is the plan's prolog, epilog or health variant; the rules that keep a
    drain from happening (a check whose evidence does not persist, a check that does not run in the context) hold
    in both."""
    held = aiv.judge_gpu_procs("n1", "prolog", aiv.node_devices("prolog", GPUS, [1], 2, {}, {1: [HOG]}, False), {})
    job = aiv.drain_plan(held, "recommend", 4, "42")
    assert job["hosts"] == [] and "no failed check names a host" in job["skipped"]  # gpu-procs is no job check
    for ctx in ("prolog", "epilog", "health"):
        p = aiv.drain_plan(held, "recommend", 1, None, context=ctx)
        assert p["hosts"] == ["n1"] and p["reason"].endswith(f"[{ctx}]") and p["skipped"] is None
        assert p["argv"] == aiv.drain_command(["n1"], p["reason"])[0]
    assert aiv.drain_plan(held, "off", 1, None, context="prolog")["command"]  # the line a prolog's exit 1 quotes
    bits = dict(aiv.finding("numerics", "FAIL", "GPU 1 wrong", ["n1"], blame="reference"), short="GPU 1 wrong")
    assert aiv.drain_plan([bits], "recommend", 1, None, context="health")["hosts"] == ["n1"]
    assert aiv.drain_plan([bits], "recommend", 1, None, context="epilog")["hosts"] == []  # the epilog is passive
    once = aiv.judge_node_speed("n1", {0: speed_of(100)}, {}, BY)
    assert aiv.drain_plan(once, "recommend", 1, None, context="health")["hosts"] == []
    writers = {str(p.relative_to(ROOT / "aiv")) for p in (ROOT / "aiv").rglob("*.py")
               for ln in p.read_text().splitlines() if '"update"' in ln or "state=drain" in ln or "state=resume" in ln}
    assert writers == {"out/outputs.py"}  # one drain: the only scontrol update lines are the planner's


def test_a_device_error_is_the_gpus_own_only_beside_a_working_peer():
    (f,) = aiv.judge_node_devices("n1", {1: "RuntimeError: CUDA error: uncorrectable ECC"}, [0, 2])
    assert (f["status"], f["blame"], f["hosts"], f["gpus"]) == ("FAIL", "own", ["n1"], [1])
    (f,) = aiv.judge_node_devices("n1", {0: "RuntimeError: driver too old", 1: "RuntimeError: driver too old"}, [])
    assert (f["blame"], f["hosts"]) == ("everyone", []) and "not drained" in f["reason"]


def post(digest="d", off=False, checks=("matmul-bf16", "matmul-fp32")):
    sw = {"torch": "2.11", "sms": 132, "cc": "9.0", "cuda": "13.0", "cublas": 1, "env": {}}
    return {"checks": {c: {"digest": digest, "off": off, "err": 0.5 if off else 0.001, "tol": 0.04, "abs": 0.1,
                           "rel": 0.01, "at": [1, 2], "value": 1.0, "ref": 1.1} for c in checks}, "software": sw}


def numerics(posts):
    by = {i: {"uuid": f"GPU-{i}", "name": H100} for i in posts}
    return aiv.judge_node_numerics("n1", aiv.numerics_rows_of("n1", posts, by, "580.1"))


def test_numerics_evidence_reference_majority_tie_everyone():
    (f,) = [f for f in numerics({0: post(), 1: post("x", off=True), 2: post()}) if f["status"] == "FAIL"]
    assert (f["blame"], f["hosts"], f["gpus"]) == ("reference", ["n1"], [1])
    (f,) = [f for f in numerics({0: post(), 1: post(), 2: post("x")}) if f["status"] == "FAIL"]
    assert (f["blame"], f["hosts"], f["gpus"]) == ("majority", ["n1"], [2])
    ties = numerics({0: post(), 1: post("x")})  # one per check
    assert {(f["status"], f["blame"], tuple(f["hosts"])) for f in ties} == {("FAIL", "tie", ())}
    alike = numerics({0: post("x", off=True), 1: post("x", off=True)})
    assert {(f["status"], f["blame"], tuple(f["hosts"])) for f in alike} == {("FAIL", "everyone", ())}
    alone = numerics({0: post("x", off=True)})  # alone: the device cannot be told from the software
    assert {(f["blame"], tuple(f["hosts"])) for f in alone} == {("tie", ())}  # the preflight's word for it


def speed_of(tflops, hbm=3000.0):
    return {"tflops": tflops, "hbm_gbps": hbm}


BY = {i: {"uuid": f"GPU-{i}", "name": H100} for i in range(4)}


def test_speed_blames_only_what_persists():
    first = {0: speed_of(700), 1: speed_of(300), 2: speed_of(700), 3: speed_of(700)}
    assert aiv.speed_flagged("n1", first, BY) == [1]
    (f,) = aiv.judge_node_speed("n1", first, {1: speed_of(310)}, BY)
    assert (f["status"], f["blame"], f["hosts"], f["gpus"]) == ("FAIL", "persisted", ["n1"], [1])
    assert "measured again on n1, slow again" in f["reason"] and aiv.drains_in(f, "health")
    assert f["reason"].startswith("n1: GPU 1 (GPU-1): ") and f["short"] == "GPU 1 slow, measured twice"
    ok, f = aiv.judge_node_speed("n1", first, {1: speed_of(705)}, BY)  # the preflight's PASS and its transient
    assert ok["status"] == "PASS" and (f["status"], f["blame"], f["hosts"], f["gpus"]) == ("WARN", "once", [], [1])
    assert "transient" in f["reason"]
    (f,) = aiv.judge_node_speed("n1", first, {}, BY, why_once="the re-measure needs about 3.0s, 1.0s left")
    assert (f["status"], f["blame"], f["hosts"]) == ("FAIL", "once", []) and not aiv.drains_in(f, "health")
    assert "measured once (the re-measure needs about 3.0s" in f["reason"]
    (p,) = aiv.judge_node_speed("n1", {0: speed_of(700)}, {}, BY)  # one GPU: its table row judges it
    assert p["status"] == "PASS" and "H100 SXM" in p["reason"]


def test_the_nodes_all_reduce():
    def one(r, floor=None):
        return aiv.judge_node_allreduce("n1", dict({"n": 4, "ok": True, "want": 10.0, "got": 10.0}, **r), floor)[0]
    assert one({"busbw": [100.0, 110.0]})["status"] == "PASS"
    f = one({"ok": False, "got": 9.0, "busbw": [1, 1]})
    assert (f["status"], f["blame"], f["hosts"]) == ("FAIL", "own", ["n1"])
    f = one({"error": "DistBackendError: NCCL error"})
    assert (f["status"], f["blame"], f["hosts"]) == ("FAIL", "not-collected", [])
    assert one({"busbw": [10.0, 12.0]}, 50.0)["blame"] == "persisted"
    (f,) = [f for f in aiv.judge_node_allreduce("n1", {"n": 4, "ok": True, "busbw": [10.0, 60.0]}, 50.0)
            if f["status"] != "PASS"]  # the preflight's transient: slow once, above the floor again
    assert (f["status"], f["blame"], f["hosts"]) == ("WARN", "once", []) and "transient" in f["reason"]
    f = one({"busbw": [10.0, 12.0]}, 50.0)
    assert (f["status"], f["hosts"], f["short"]) == ("FAIL", ["n1"], "busbw 12 < 50 GB/s twice")
    assert aiv.drains_in(f, "health")


def test_the_verdict_drains_only_on_evidence_that_singles_the_node_out():
    own = aiv.judge_gpu_procs("n1", "prolog", aiv.node_devices("prolog", GPUS, [1], 2, {}, {1: [HOG]}, False),
                              {})[0]
    once = aiv.judge_node_speed("n1", {0: speed_of(100)}, {}, BY)[0]
    v = aiv.node_verdict([once], "prolog")
    assert (v["verdict"], v["drainable"], v["exit_code"]) == ("FAIL", False, 0)
    assert aiv.node_verdict([once], "npd")["exit_code"] == 2
    v = aiv.node_verdict([once, own], "prolog")
    assert (v["verdict"], v["drainable"], v["exit_code"], v["culprits"]) == ("FAIL", True, 1, [own])
    na = aiv.unassessed("local", "torch is not importable")
    assert aiv.node_verdict([na], "prolog")["verdict"] == "NOT ASSESSED"
    assert aiv.node_verdict([na, own], "health")["verdict"] == "FAIL"  # evidence beside it still counts
    assert aiv.node_verdict([dict(own, check="numerics")], "epilog")["drainable"] is False  # not an epilog check


def test_the_drain_reason_is_ours_bounded_and_resumed_only_by_its_own_check_passing():
    own = dict(aiv.judge_gpu_procs("n1", "prolog", aiv.node_devices("prolog", GPUS, [1], 2, {}, {1: [HOG] * 9},
                                                                     False), {})[0])
    p = aiv.drain_plan([own, dict(own)], "recommend", 1, None, context="prolog")  # the preflight's planner
    r = p["reason"]
    assert p["hosts"] == ["n1"] and p["argv"] == ["scontrol", "update", "nodename=n1", "state=drain", f"reason={r}"]
    assert r.startswith("aiv: node-check: gpu-procs: GPU 1 held by pid 4242") and r.endswith(" (+1 more) [prolog]")
    long = aiv.drain_reason([dict(own, short="x" * 300)], context="health")
    assert len(long) == aiv.DRAIN_REASON_MAX and long.endswith("... [health]")
    assert aiv.owned_reason(r) and not aiv.owned_reason("aiv: inter-node: slow (job 4)")
    ok = [aiv.finding("gpu-procs", "PASS", "fine")]
    assert aiv.resume_plan("n1", r, ok)["skipped"] is None
    assert aiv.resume_plan("n1", r, ok)["argv"] == ["scontrol", "update", "nodename=n1", "state=resume"]
    assert "not judged" in aiv.resume_plan("n1", r, [aiv.finding("gpu-count", "PASS", "fine")])["skipped"]
    assert "did not pass" in aiv.resume_plan("n1", r, [dict(own, status="WARN")])["skipped"]
    assert "not the node check's" in aiv.resume_plan("n1", "bad fan", ok)["skipped"]


# ---------------------------------------------------------------------------- render
def state(findings, ctx="npd", **kw):
    v = aiv.node_verdict(findings, ctx)
    for f in findings:
        f["drains"] = aiv.drains_in(f, ctx)
    return dict({"context": ctx, "node": "gpu7", "verdict": v["verdict"], "drainable": v["drainable"],
                 "exit_code": v["exit_code"], "findings": findings, "elapsed_s": 9.3, "budget_s": 25.0,
                 "devices": {"ids": [0, 1], "busy": {}, "held": {}, "compute": [0, 1]},
                 "gpus": [{"index": 0, "uuid": "GPU-0"}], "measured": {"0": {"speed": speed_of(700.5)}},
                 "allreduce": {"busbw": [200.0, 210.0]}, "drain": {}, "skipped": []}, **kw)


def test_the_npd_line_fits_and_the_summary_says_what_happened():
    own = aiv.judge_gpu_procs("gpu7", "prolog", aiv.node_devices("prolog", GPUS, [1], 2, {}, {1: [HOG]}, False),
                              {})[0]
    s = state([dict(own, short="GPU 1 held by pid 4242 " + "x" * 200)])
    assert len(aiv.node_npd_line(s)) <= aiv.NODE_NPD_MAX and aiv.node_npd_line(s).startswith("FAIL: GPU 1 held")
    s = state([aiv.finding("gpu-count", "PASS", "ok")], ctx="health", skipped=["the all-reduce (needs 12s)"])
    line = aiv.node_summary(s)
    assert line.startswith("ai-infra-validator node-check: PASS on gpu7 [health]: 2 GPU(s); judged: gpu-count")
    assert "skipped: the all-reduce (needs 12s)" in line and line.endswith("(9.3s of 25s)")
    assert aiv.node_npd_line(state([aiv.finding("gpu-count", "PASS", "ok")])) == "PASS: 2 GPU(s) checked"


def test_the_textfile_is_valid_exposition_without_a_job_or_node_label():
    from test_metrics import promtool
    text = aiv.node_metrics(state([aiv.finding("gpu-count", "PASS", "ok")], ctx="prolog"))
    promtool(text)
    assert 'aiv_node_check_pass{context="prolog"} 1' in text
    assert 'aiv_node_check_gpu_matmul_tflops{context="prolog",gpu="0",uuid="GPU-0"} 700.5' in text
    assert "job" not in text.replace("a job", "") and 'node="' not in text
    assert text.count("# TYPE aiv_node_check_status gauge") == 1


# ---------------------------------------------------------------------------- real runs on this machine
def run(args, env=None, python=sys.executable, timeout=120, node=None):
    """The tool's --node-check as a prolog or a health check would run it (a node name of the test's own, so that
    parallel tests never share a lock)."""
    node = node or f"ngate-{uuid.uuid4().hex[:8]}"
    e = clean_env(dict({"SLURMD_NODENAME": node, "SLURM_CONF": "/nonexistent/slurm.conf"}, **(env or {})))
    t = time.monotonic()
    r = subprocess.run([python, str(SCRIPT), *map(str, args)], env=e, capture_output=True, text=True,
                       timeout=timeout)
    return r, time.monotonic() - t


def verdict(tmp_path, args, env=None, **kw):
    jp = tmp_path / f"v{time.monotonic_ns()}.json"
    r, secs = run([*args, "--json", jp], env, **kw)
    return r, (json.loads(jp.read_text()) if jp.exists() else None), secs


def test_a_healthy_node_passes_within_the_bound(tmp_path, record_property):
    prom = tmp_path / "aiv_node_check_health.prom"
    r, d, secs = verdict(tmp_path, ["--node-check", "--metrics", prom], node="ngate-a")
    assert r.returncode == 0, r.stdout + r.stderr
    (line,) = r.stdout.splitlines()  # one line on stdout: the summary
    assert line.startswith("ai-infra-validator node-check: PASS on ngate-a [health]: 2 CPU worker(s); judged: "
                           "gpu-count, gpu-procs, numerics, gpu-perf, intra-node"), line
    assert d["verdict"] == "PASS" and d["elapsed_s"] < d["budget_s"] == 25.0 and d["allreduce"]["ok"] is True
    assert {f["check"] for f in d["findings"]} >= {"numerics", "gpu-perf", "intra-node"}
    assert d["phases"]["compute"] > 0 and "Traceback" not in r.stderr
    from test_metrics import promtool
    promtool(prom.read_text())
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".aiv-")]  # atomic: no temporary left
    record_property("node_check_cpu_wall_s", round(secs, 2))
    n, _ = run(["--node-check", "npd"], node="ngate-a")
    assert (n.returncode, n.stdout) == (0, "PASS: 2 CPU worker(s) checked\n"), n.stdout + n.stderr


def test_silent_data_corruption_on_local_rank_1_fails_naming_it(tmp_path):
    env = {"PYTHONPATH": SDC, "NUMERICS_FAULT_LOCAL_RANK": "1", "SLURM_JOB_ID": "77", "SLURM_JOB_GPUS": "0,1",
           "SLURM_SCRIPT_CONTEXT": "prolog_slurmd"}
    r, d, _ = verdict(tmp_path, ["--node-check", "--expect-gpus", "0"], env, node="ngate-b")
    assert r.returncode == 1, r.stdout + r.stderr
    assert r.stdout.startswith("ai-infra-validator node-check: FAIL on ngate-b [prolog]: GPU 1 computes wrong numbers "
                               "(off the fp64 reference); not drained by the check (--drain recommend): scontrol "
                               "update nodename=ngate-b state=drain reason="), r.stdout
    (f,) = [f for f in d["findings"] if f["status"] == "FAIL"]
    assert (f["check"], f["blame"], f["gpus"], f["hosts"], f["drains"]) == ("numerics", "reference", [1],
                                                                                ["ngate-b"], True)
    assert f["reason"].startswith("rank 1 on ngate-b (CPU) computes wrong numbers") and "rank 0" not in f["reason"]
    n, _, _ = verdict(tmp_path, ["--node-check", "npd", "--expect-gpus", "0"], env, node="ngate-b")
    assert n.returncode == 1 and n.stdout == "FAIL: GPU 1 computes wrong numbers (off the fp64 reference)\n"


def no_torch(tmp_path):
    d = tmp_path / "notorch" / "torch"
    d.mkdir(parents=True)
    (d / "__init__.py").write_text("raise ImportError('No module named torch (shadowed for the test)')\n")
    return str(d.parent)


@pytest.mark.parametrize("ctx, code", [("prolog", 0), ("health", 0), ("npd", 2)])
def test_a_python_without_torch_is_not_assessed_and_never_fails_the_node(tmp_path, ctx, code):
    r, d, _ = verdict(tmp_path, ["--node-check", ctx, "--drain", "on", "--expect-gpus", "0"],
                      {"PYTHONPATH": no_torch(tmp_path), "SLURM_JOB_ID": "5", "SLURM_JOB_GPUS": "0,1"},
                      node=f"ngate-t{ctx}")
    assert r.returncode == code, r.stdout + r.stderr
    assert d["verdict"] == "NOT ASSESSED" and d["drain"]["action"] == "none"
    words = r.stdout.strip()
    assert ("NOT ASSESSED: torch not importable" in words if ctx == "npd" else
            words.startswith(f"ai-infra-validator node-check: NOT ASSESSED on ngate-t{ctx} [{ctx}]: torch not "
                             "importable")
            and "exit 0 (fail open: nothing drained)" in words), words


@pytest.mark.parametrize("ctx, code", [("prolog", 0), ("npd", 2)])
def test_a_usage_error_is_the_tools_fault_not_the_nodes(ctx, code):
    r, _ = run(["--node-check", ctx, "--node-budget", "abc"])
    assert r.returncode == code and "FAILURE: usage: --node-budget='abc' is not a number" in r.stderr
    assert "NOT ASSESSED" in r.stdout and len(r.stdout.splitlines()) == 1


def test_the_prolog_environment_is_no_batch_shell():
    """A prolog's environment is a job's (SLURM_JOB_ID, SLURMD_NODENAME, no step): the preflight refuses it as the
    batch shell; the node check runs in it. --node-budget 1 leaves no time for a device step: skipped and said."""
    env = {"SLURM_JOB_ID": "9", "SLURM_SCRIPT_CONTEXT": "prolog_slurmd", "SLURM_JOB_GPUS": "0"}
    r, secs = run(["--node-check", "--node-budget", "1", "--expect-gpus", "0"], env, node="ngate-p")
    assert r.returncode == 0 and "batch shell" not in r.stdout + r.stderr, r.stdout + r.stderr
    assert r.stdout.startswith("ai-infra-validator node-check: PASS on ngate-p [prolog]: 1 CPU worker(s)")
    assert "skipped: every device step (the passive checks left 0.0s)" in r.stdout and secs < 30


def lock_path(node):
    path, why = aiv.node_lock_path(node)
    assert path, why
    return Path(path)


def test_a_second_health_pass_is_not_assessed_and_a_prolog_stops_a_health_pass(tmp_path):
    holder = ("import fcntl, os, signal, sys, time\n"
              "fd = os.open(sys.argv[1], os.O_CREAT | os.O_RDWR)\n"
              "fcntl.flock(fd, fcntl.LOCK_EX)\n"
              "os.write(fd, f'{os.getpid()} health\\n'.encode())\n"
              "signal.signal(signal.SIGTERM, lambda *a: sys.exit(7))\n"
              "print('held', flush=True)\n"
              "time.sleep(120)\n")
    node = "ngate-lock"
    p = subprocess.Popen([sys.executable, "-c", holder, str(lock_path(node)), "--node-check"],
                         stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline() == "held\n"
        r, _ = run(["--node-check", "health", "--node-budget", "1"], node=node)
        assert r.returncode == 0 and "NOT ASSESSED" in r.stdout and "another node check is running" in r.stdout
        r, _ = run(["--node-check", "prolog", "--node-budget", "1", "--expect-gpus", "0"], {"SLURM_JOB_ID": "3"},
                   node=node)
        assert r.returncode == 0 and "PASS" in r.stdout, r.stdout + r.stderr
        assert p.wait(timeout=10) == 7  # the health pass holding the lock got SIGTERM
    finally:
        p.kill()
        p.wait()


# ---------------------------------------------------------------------------- what a CPU machine lacks, faked
def fake_bin(tmp_path, name, body):
    script = tmp_path / "bin" / name
    script.parent.mkdir(exist_ok=True)
    script.write_text(f"#!/bin/bash\nprintf '%s\\n' \"$*\" >> {shlex.quote(str(tmp_path / (name + '.calls')))}\n"
                      f"{body}\n")
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return tmp_path / (name + ".calls")


def fake_smi(tmp_path, rows, apps=""):
    return fake_bin(tmp_path, "nvidia-smi", f"case \"$1\" in --query-gpu*) printf {shlex.quote(rows)} ;; "
                    f"--query-compute-apps*) printf {shlex.quote(apps)} ;; esac")


def path_with(tmp_path):
    return {"PATH": f"{tmp_path / 'bin'}:{os.environ['PATH']}"}


def test_a_gpu_held_before_the_job_fails_the_prolog_naming_the_pid(tmp_path):
    hog = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        fake_smi(tmp_path, "0, GPU-aaaa, 00000000:1B:00.0, NVIDIA H100 80GB HBM3, 1, 81559, 0, No, No\n"
                           "1, GPU-bbbb, 00000000:3B:00.0, NVIDIA H100 80GB HBM3, 70012, 81559, 0, No, No\n",
                 f"{hog.pid}, 70012, GPU-bbbb, python\n")
        env = dict(path_with(tmp_path), SLURM_JOB_ID="12", SLURM_JOB_GPUS="1")
        r, d, _ = verdict(tmp_path, ["--node-check", "prolog", "--skip-numerics", "--skip-screen"], env)
        assert r.returncode == 1, r.stdout + r.stderr
        (f,) = [f for f in d["findings"] if f["status"] == "FAIL"]
        assert f["check"] == "gpu-procs" and f["pids"] == [hog.pid] and f["blame"] == "own"
        assert f"GPU 1 (GPU-bbbb) is held before the job started: pid {hog.pid} (python, user " in f["reason"]
        assert "holds 68.4GiB" in f["reason"] and f"GPU 1 held by pid {hog.pid}" in r.stdout
        h, d, _ = verdict(tmp_path, ["--node-check", "health", "--skip-numerics", "--skip-screen"], path_with(tmp_path))
        assert h.returncode == 0 and d["verdict"] == "PASS" and d["devices"]["busy"] == {
            "1": "1 process(es) of others on it"}, h.stdout + h.stderr
        assert "busy, not judged: GPU 1" in h.stdout
    finally:
        hog.kill()
        hog.wait()


SHOW_OURS = ("NodeName={node} Gres=gpu:1 GresUsed=gpu:0(IDX:N/A) State=IDLE+DRAIN "
             "Reason=aiv: node-check: gpu-health: GPU 1 row remap pending [health] [root@2026-12-06T10:00:00]")


def fake_scontrol(tmp_path, show):
    return fake_bin(tmp_path, "scontrol", f'case "$1" in show) printf %s {shlex.quote(show)} ;; update) exit 0 ;; '
                                          "esac")


def test_health_drains_on_a_failed_row_remap_keeps_a_foreign_reason_and_resumes_its_own(tmp_path):
    node, bad = "ngate-d", "0, GPU-aaaa, 00000000:1B:00.0, NVIDIA H100 80GB HBM3, 1, 81559, 0, No, Yes\n"
    fake_smi(tmp_path, bad)
    calls = fake_scontrol(tmp_path, f"NodeName={node} Gres=gpu:1 State=IDLE")
    args = ["--node-check", "health", "--drain", "on", "--skip-numerics", "--skip-screen"]
    r, d, _ = verdict(tmp_path, args, path_with(tmp_path), node=node)
    assert r.returncode == 1 and d["drain"]["done"], r.stdout + r.stderr
    show, update = calls.read_text().splitlines()
    assert show == f"show node -d -o {node}"
    assert update == (f"update nodename={node} state=drain reason=aiv: node-check: gpu-health: GPU 0 row remapping "
                      "failed [health]"), update
    calls.unlink()
    fake_scontrol(tmp_path, f"NodeName={node} Gres=gpu:1 State=IDLE+DRAIN Reason=bad fan [ops@2026-12-01T00:00:00]")
    r, d, _ = verdict(tmp_path, args, path_with(tmp_path), node=node)
    assert not d["drain"]["done"] and "kept ('bad fan')" in r.stdout and len(calls.read_text().splitlines()) == 1
    calls.unlink()
    fake_smi(tmp_path, bad.replace("No, Yes", "No, No"))
    fake_scontrol(tmp_path, SHOW_OURS.format(node=node).replace("GPU 1", "GPU 0"))
    r, d, _ = verdict(tmp_path, args, path_with(tmp_path), node=node)  # no --undrain: left drained
    assert d["verdict"] == "PASS" and calls.read_text().splitlines() == [f"show node -d -o {node}"]
    r, d, _ = verdict(tmp_path, [*args, "--undrain"], path_with(tmp_path), node=node)
    assert d["drain"]["done"] and calls.read_text().splitlines()[-1] == f"update nodename={node} state=resume"
    assert "resumed our own drain" in r.stdout


def test_a_gres_count_nvml_does_not_reach_fails_and_busy_gres_is_not_computed_on(tmp_path):
    node = "ngate-g"
    fake_smi(tmp_path, "0, GPU-aaaa, 00000000:1B:00.0, NVIDIA H100 80GB HBM3, 1, 81559, 0, No, No\n")
    fake_scontrol(tmp_path, f"NodeName={node} Gres=gpu:h100:2 GresUsed=gpu:h100:1(IDX:0) State=MIXED")
    r, d, _ = verdict(tmp_path, ["--node-check", "health"], path_with(tmp_path), node=node)
    (f,) = [f for f in d["findings"] if f["status"] == "FAIL"]
    assert f["check"] == "gpu-count" and "2 GPU(s) expected (the node's gres in Slurm) but NVML lists 1" in f["reason"]
    assert d["devices"]["busy"] == {"0": "allocated to a running job (Slurm's GresUsed)"}
    assert d["devices"]["compute"] == []
    assert d["measured"] == {} and r.returncode == 1


@pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="a machine with NVIDIA GPUs")
def test_nothing_of_this_machine_is_a_gpu(tmp_path):
    assert aiv.pci_gpus() == [] and aiv.driver_gpus() == []


def test_the_kernel_log_is_read_bounded_from_the_root(tmp_path):
    (tmp_path / "dev").mkdir()
    (tmp_path / "dev" / "kmsg").write_text("4,1,5000000,-;NVRM: Xid (PCI:0000:1b:00): 94, pid=3, Contained\n" * 3)
    got = aiv.read_kmsg(str(tmp_path), 1.0, 1 << 20)
    assert [x["xid"] for x in aiv.parse_xids(got["text"])] == [94, 94, 94]
    assert "unread" in aiv.read_kmsg(str(tmp_path / "none"))
    fd = os.open(tmp_path / "dev" / "kmsg", os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_SH)  # a read never needs a lock
    os.close(fd)


# ---------------------------------------------------------------------------- the docs and the shipped configs
ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "node-gate.md"


def table(title_cells):
    """The rows of the docs/node-gate.md table whose header starts with title_cells: [[cell, ...]]."""
    lines, out, on = PAGE.read_text().splitlines(), [], False
    for ln in lines:
        cells = [c.strip() for c in ln.strip().strip("|").split(" | ")]
        if ln.startswith("| ") and cells[:len(title_cells)] == list(title_cells):
            on = True
            continue
        if on and ln.startswith("|---"):
            continue
        if on and ln.startswith("| "):
            out.append(cells)
        elif on:
            break
    return out


NODE_EVIDENCE = ("own", "persisted", "majority", "reference", "manifest", "once", "tie", "everyone", "not-collected")


def node_table_rows():
    """The node gate's rows of the one check table (CHECK_RULES), as the page shows them."""
    def words(kinds):
        return ", ".join(kinds) or "nothing"
    return [[f"`{c}`", ", ".join(x for x in r["contexts"] if x != "job"), words(r["names"]), words(r["drain"]),
             r["why"]] for c in aiv.node_checks() for r in [aiv.CHECK_RULES[c]]]


def test_the_pages_checks_table_is_the_codes():
    assert table(("check", "contexts", "names the node on", "drains on", "why the evidence persists")) == \
        node_table_rows()


def test_the_pages_evidence_table_is_the_blame_laws():
    rows = table(("blame", "singles the node out", "meaning"))
    assert rows == [[f"`{w}`", "yes" if w in aiv.LOCALISING else "no",
                     aiv.LOCALISING[w] if w in aiv.LOCALISING else aiv.UNLOCALISED[w][0]] for w in NODE_EVIDENCE]


def test_the_pages_metrics_table_lists_every_metric_with_its_labels():
    once = aiv.judge_node_speed("gpu7", {0: speed_of(100)}, {}, BY)  # slow, not measured again: 'once'
    s = state([aiv.finding("gpu-count", "PASS", "ok")] + once, ctx="health", ended_at_s=1.0)
    s["measured"]["0"]["numerics"] = {"checks": {"matmul-fp32": {"err": 1.0, "tol": 2.0}}}
    from prometheus_client.parser import text_string_to_metric_families
    fams = {f.name: sorted({k for smp in f.samples for k in smp.labels}) for f in
            text_string_to_metric_families(aiv.node_metrics(s))}
    rows = {r[0].strip("`"): sorted(r[1].split(", ")) for r in table(("metric", "labels", "meaning"))}
    assert rows == fams


def test_the_npd_plugin_config_runs_this_tools_npd_context_within_its_bounds():
    cfg = json.loads((ROOT / "k8s" / "npd" / "node-check-plugin.json").read_text())
    (rule,) = cfg["rules"]
    assert cfg["plugin"] == "custom" and rule["type"] == "permanent"
    assert rule["condition"] in [c["type"] for c in cfg["conditions"]]
    assert cfg["pluginConfig"]["max_output_length"] == aiv.NODE_NPD_MAX
    secs = {k: float(v.rstrip("s")) for k, v in (("global", cfg["pluginConfig"]["timeout"]),
                                                  ("rule", rule["timeout"]))}
    assert secs["rule"] <= secs["global"] and aiv.NODE_BUDGET_DEFAULT + 15 <= secs["rule"]
    assert rule["args"][0].endswith("/ddp_mesh_ping.py")
    p = aiv.plan(rule["args"][1:], {})
    assert p["mode"] == "node-check" and aiv.node_context(p["args"].node_check, {}) == ("npd", None)
    assert rule["args"][rule["args"].index("--node-check") + 1] == "npd"


def test_the_daemonset_sketch_is_valid_and_carries_the_same_plugin_config():
    yaml = pytest.importorskip("yaml")
    kv = pytest.importorskip("kubernetes_validate")
    docs = [d for d in yaml.safe_load_all((ROOT / "k8s" / "node-check-daemonset.yaml").read_text()) if d]
    for version in ("1.31.0", "1.37.0"):
        for d in docs:
            kv.validate(d, version, strict=True)
    (cm,) = [d for d in docs if d["kind"] == "ConfigMap"]
    assert json.loads(cm["data"]["node-check-plugin.json"]) == json.loads(
        (ROOT / "k8s" / "npd" / "node-check-plugin.json").read_text())
    (ds,) = [d for d in docs if d["kind"] == "DaemonSet"]
    (c,) = ds["spec"]["template"]["spec"]["containers"]
    assert "--config.custom-plugin-monitor=/config/node-check-plugin.json" in c["command"]
    env = {e["name"] for e in c["env"]}
    assert {"NODE_NAME", "NVIDIA_VISIBLE_DEVICES"} <= env and not any(
        "nvidia.com/gpu" in (c["resources"].get(k) or {}) for k in ("limits", "requests"))  # takes no GPU
    assert {e["name"] for e in c["env"] if e["name"].startswith("AIV_")} <= {
        a.env for a in aiv.build_parser()._actions if getattr(a, "env", None)}


def test_a_process_gone_a_second_later_is_no_leftover(tmp_path):
    """The compute processes are looked for again before they fail a prolog: one listed by the first call only
    (tearing down at the job's boundary) does not count."""
    hog = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        calls = tmp_path / "apps.calls"
        fake_bin(tmp_path, "nvidia-smi", f'case "$1" in --query-gpu*) printf '
                 f'"0, GPU-aaaa, 00000000:1B:00.0, NVIDIA H100 80GB HBM3, 1, 81559, 0, No, No\\n" ;; '
                 f'--query-compute-apps*) echo x >> {calls}; [ "$(wc -l < {calls})" = 1 ] && '
                 f'printf "{hog.pid}, 512, GPU-aaaa, python\\n" ;; esac; exit 0')
        r, d, _ = verdict(tmp_path, ["--node-check", "prolog", "--skip-numerics", "--skip-screen"],
                          dict(path_with(tmp_path), SLURM_JOB_ID="3", SLURM_JOB_GPUS="0"))
        assert r.returncode == 0 and d["verdict"] == "PASS" and d["devices"]["held"] == {}, r.stdout + r.stderr
        assert len(calls.read_text().splitlines()) == 2
    finally:
        hog.kill()
        hog.wait()


def test_the_manifest_judges_the_node_against_its_accepted_class():
    from conftest import gpu, rec
    recs = [rec(i, host="gpu7", local_rank=i, gpu=gpu(f"GPU-{i}", pci=f"0000:{i:02x}:00.0", index=i), node=i == 0)
            for i in range(2)]
    manifest = json.loads(json.dumps(aiv.manifest_from_records(recs, "2026-12-01T00:00:00+00:00")))
    (ok,) = aiv.judge_node_manifest("gpu7", manifest, recs, [])
    assert ok["status"] == "PASS" and ok["blame"] is None
    drift = [dict(r, versions=dict(r["versions"], torch="2.99.0")) for r in recs]
    (f,) = aiv.judge_node_manifest("gpu7", manifest, drift, [])
    assert (f["status"], f["blame"], f["hosts"]) == ("FAIL", "manifest", ["gpu7"]) and "torch" in f["reason"]
    assert aiv.drains_in(f, "prolog") and aiv.judge_node_manifest("gpu7", None, recs, []) == []


def test_an_unreadable_manifest_is_not_assessed_not_a_failed_node(tmp_path):
    bad = tmp_path / "m.json"
    bad.write_text("{not json")
    r, d, _ = verdict(tmp_path, ["--node-check", "health", "--manifest", bad, "--node-budget", "1"])
    assert r.returncode == 0 and d["verdict"] == "NOT ASSESSED", r.stdout + r.stderr
    (f,) = [f for f in d["findings"] if f["check"] == "manifest"]
    assert f["unassessed"] and "not a manifest" in f["reason"]


def test_a_bug_escaping_the_check_is_not_assessed_never_an_exit_1(capsys):
    from types import SimpleNamespace
    assert aiv.run_node_check(SimpleNamespace(node_check="prolog"), {"SLURMD_NODENAME": "n9"}) == 0
    assert aiv.run_node_check(SimpleNamespace(node_check="npd"), {}) == 2
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("ai-infra-validator node-check: NOT ASSESSED on n9 [prolog]: internal: AttributeError")
    assert out[1].startswith("NOT ASSESSED: internal: AttributeError")


@pytest.mark.parametrize("python, rc, words", [
    ("echo 'ai-infra-validator node-check: FAIL on n1 [prolog]: GPU 0 held by pid 7; drained'; exit 1", 1,
     "FAIL on n1"),
    ("echo 'Traceback (most recent call last):' >&2; exit 1", 0, "NOT ASSESSED on n1 [prolog]: no verdict (exit 1)"),
    ("sleep 30", 0, "no verdict (exit 124)"),
    ("echo 'ai-infra-validator node-check: NOT ASSESSED on n1 [prolog]: x'; exit 0", 0, "NOT ASSESSED on n1"),
])
def test_the_slurm_script_exits_1_only_on_the_tools_fail_line(tmp_path, python, rc, words):
    from test_node_gate_slurm import documented_script
    script, fake = tmp_path / "aiv-node-check.sh", tmp_path / "python"
    script.write_text(documented_script())
    fake.write_text(f"#!/bin/bash\n{python}\n")
    for p in (script, fake):
        p.chmod(0o755)
    env = {"NODE_CHECK_PYTHON": str(fake), "NODE_CHECK_TOOL": str(SCRIPT), "NODE_CHECK_DIR": str(tmp_path),
           "NODE_CHECK_LOG": str(tmp_path / "log"), "NODE_CHECK_BACKSTOP": "2", "SLURMD_NODENAME": "n1",
           "SLURM_SCRIPT_CONTEXT": "prolog_slurmd", "PATH": os.environ["PATH"]}
    r = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == rc and words in r.stdout, r.stdout + r.stderr
