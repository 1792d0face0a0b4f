"""Known-good manifests: saved on a clean PASS, judged against (check `manifest`), merged, diffed.
Pure tests of the judge on plain records, and real local-mode runs for what is a process matter."""
import copy
import json
import os
import stat
import subprocess
import sys
import tempfile
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import SCRIPT, aiv, clean_env, cluster, failures, gpu, rec, run_tool, spawn

T0 = "2030-01-01T00:00:00+00:00"


def ib(n=8, rate=400.0, state="ACTIVE"):
    return [{"port": f"mlx5_{i}:1", "state": state, "rate_gbps": rate, "link_layer": "InfiniBand"} for i in range(n)]


def gpu_node(host, first_rank=0, per_node=2, model="NVIDIA H200", ports=8, width=16, speed=32.0,
             transport=("P2P", "NET/IB"), env=None, driver_gpus=None):
    """Rank records of one GPU node with IB, PCIe link facts (idle), transports and its own environment;
    the driver lists driver_gpus GPUs (default: per_node, a job of the whole node)."""
    out = []
    for lr in range(per_node):
        g = dict(gpu(f"GPU-{host}-{lr}", pci=f"0000:{lr:02x}:00.0", name=model, index=lr),
                 current_link_width=width, current_link_speed=speed, max_link_width=16, max_link_speed=32.0)
        r = rec(first_rank + lr, host=host, local_rank=lr, gpu=g, node=(lr == 0),
                transport=list(transport) if transport is not None else None)
        if lr == 0:
            r["node"].update(ib=ib(ports), gpus_visible=per_node, gpus_driver=driver_gpus or per_node,
                             env=dict(env or {"NCCL_IB_HCA": "mlx5"}),
                             ifaces={"eth0": ["10.0.0.1"], "ib0": ["10.1.0.1"], "lo": ["127.0.0.1"]})
        out.append(r)
    return out


def gpu_cluster(hosts=("node1", "node2"), **kw):
    out = []
    for h in hosts:
        out += gpu_node(h, first_rank=len(out), **kw)
    return out


def loaded(records, width=16, speed=32.0, tflops=700.0):
    """The performance screen of these GPU records: one row per rank with its PCIe link read under load."""
    rows = [{"rank": r["rank"], "host": r["host"], "local_rank": r["local_rank"], "uuid": r["gpu"]["uuid"],
             "model": r["gpu"]["name"], "tflops": tflops, "hbm_gbps": 4000.0, "pcie_width": width,
             "pcie_speed": speed} for r in records if r.get("gpu")]
    return {"cpu": False, "gpu": rows, "intra": [], "pairs": []}


def saved(records, when=T0, screen=None, findings=()):
    return aiv.manifest_from_records(records, when, screen, findings)


def by_status(findings, status):
    return [f for f in findings if f["status"] == status]


def only_finding(findings, status):
    got = by_status(findings, status)
    assert len(got) == 1, findings
    return got[0]


# ---------------------------------------------------------------- collect
def test_node_env_keeps_only_nccl_gloo_settings_through_the_allow_list():
    env = {"NCCL_IB_HCA": "mlx5", "GLOO_SOCKET_IFNAME": "eth0", "TORCH_NCCL_BLOCKING_WAIT": "1",
           "AIV_TIMEOUT": "60", "SLURM_JOB_ID": "7", "NCCL_IB_KEY": "x", "PATH": "/bin"}
    assert aiv.node_env(env) == {"GLOO_SOCKET_IFNAME": "eth0", "NCCL_IB_HCA": "mlx5", "TORCH_NCCL_BLOCKING_WAIT": "1"}


def test_node_facts_carry_the_nodes_own_environment():
    facts = aiv.collect_node_facts("/", None, "gloo", 0, env={"NCCL_SOCKET_NTHREADS": "4", "HOME": "/root"})
    assert facts["env"] == {"NCCL_SOCKET_NTHREADS": "4"}
    assert aiv.collect_node_facts("/", None, "gloo", 0)["env"] is None


def test_pci_link_read_from_sysfs_root_and_absent_is_none(tmp_path):
    d = tmp_path / "sys/bus/pci/devices/0000:1b:00.0"
    d.mkdir(parents=True)
    for name, text in (("current_link_width", "8\n"), ("current_link_speed", "16.0 GT/s PCIe\n"),
                       ("max_link_width", "16\n"), ("max_link_speed", "Unknown\n")):
        (d / name).write_text(text)
    assert aiv.pci_link(str(tmp_path), "0000:1B:00.0") == {
        "current_link_width": 8, "current_link_speed": 16.0, "max_link_width": 16, "max_link_speed": None}
    assert set(aiv.pci_link(str(tmp_path), "0000:99:00.0").values()) == {None}
    assert set(aiv.pci_link(str(tmp_path), None).values()) == {None}


# ---------------------------------------------------------------- classes and save
def test_class_key_is_gpu_model_count_and_fabric_shape():
    recs = gpu_node("node1")
    fields, key = aiv.host_view(recs, aiv.screen_load(loaded(recs, width=8)))
    assert aiv.class_name(key) == "NVIDIA H200 x2, IB 8x400G"
    assert fields["transport_intra"] == ["P2P"] and fields["transport_inter"] == ["NET/IB"]
    assert fields["pcie_width"] == 8 and fields["ib_ports"] == 8 and fields["env"] == {"NCCL_IB_HCA": "mlx5"}
    assert fields["gpu_memory"] == {"NVIDIA H200": 141 << 30}   # per model, not the smallest of the GPUs used
    assert aiv.host_view(recs)[0]["pcie_width"] is None          # the idle reading is not the node's link


def test_class_is_the_nodes_own_gpu_count_not_the_jobs():
    """An 8-GPU node in a job given 4 of its GPUs is still an 8-GPU node (the driver's list)."""
    whole, part = gpu_node("node1", per_node=8), gpu_node("node1", per_node=4, driver_gpus=8)
    assert aiv.host_view(whole)[1] == aiv.host_view(part)[1]
    assert aiv.class_name(aiv.host_view(part)[1]) == "NVIDIA H200 x8, IB 8x400G"
    no_driver = gpu_node("node1", per_node=4)
    no_driver[0]["node"]["gpus_driver"] = None                   # no /proc/driver/nvidia/gpus: what the ranks saw
    assert aiv.host_view(no_driver)[0]["gpus_per_node"] == 4


def test_driver_gpus_reads_the_drivers_list(tmp_path):
    d = tmp_path / "proc/driver/nvidia/gpus"
    d.mkdir(parents=True)
    for bus in ("0000:18:00.0", "0000:2a:00.0", "0000:3a:00.0"):
        (d / bus).mkdir()
    assert aiv.driver_gpus(str(tmp_path)) == ["0000:18:00.0", "0000:2a:00.0", "0000:3a:00.0"]
    assert aiv.driver_gpus(str(tmp_path / "none")) == []
    facts = aiv.collect_node_facts(str(tmp_path), None, "gloo", 0, env={"CUDA_VISIBLE_DEVICES": "0"})
    assert facts["gpus_driver"] == 3 and facts["gpus_visible"] == 0


def test_accepted_whole_nodes_judged_on_a_half_node_job_do_not_fail():
    """Accepted from 8 ranks per node (8 GPUs each), judged on a 4-GPU-per-node job of the same nodes, with
    bands of enough runs: no FAIL (the intra-node band of 4 ranks per node is not the 8-rank one)."""
    hosts = ("node1", "node2")
    whole = gpu_cluster(hosts, per_node=8)
    screen = dict(loaded(whole), intra=[{"host": h, "busbw": 400.0, "ranks": list(range(i * 8, i * 8 + 8))}
                                        for i, h in enumerate(hosts)])
    m = saved(whole, screen=screen)
    for _ in range(aiv.BAND_MIN_RUNS - 1):
        m = aiv.merge_manifests(m, saved(whole, screen=screen))
    assert aiv.manifest_problem(m) is None
    half = gpu_cluster(hosts, per_node=4, driver_gpus=8)
    half_screen = dict(loaded(half), intra=[{"host": h, "busbw": 150.0, "ranks": list(range(i * 4, i * 4 + 4))}
                                            for i, h in enumerate(hosts)])
    out = aiv.judge_manifest(m, half, half_screen) + aiv.judge_bands(m, half, half_screen)
    assert not by_status(out, "FAIL"), out
    assert only_finding(out, "PASS")["reason"].startswith("2 node(s) match the manifest (2 listed")
    _, cpu_key = aiv.host_view(cluster(1, 2))
    assert aiv.class_name(cpu_key) == "no GPU, no IB"


def test_saved_manifest_is_versioned_and_grouped_by_class():
    m = saved(gpu_cluster(("node1", "node2")) + gpu_cluster(("h100a",), model="NVIDIA H100"))
    assert m["schema_version"] == aiv.MANIFEST_SCHEMA_VERSION and m["tool"] == "ai-infra-validator"
    assert m["written_at"] == T0 and aiv.manifest_problem(m) is None
    h200 = m["classes"]["NVIDIA H200 x2, IB 8x400G"]
    assert h200["hosts"] == "node[1-2]" and h200["bands"] == {} and h200["runs"] == 1
    assert h200["fields"]["driver"] == [{"value": "580.1", "hosts": "node[1-2]"}]
    assert h200["fields"]["transport_inter"] == [{"value": ["NET/IB"], "hosts": "node[1-2]"}]
    assert m["classes"]["NVIDIA H100 x2, IB 8x400G"]["hosts"] == "h100a"
    assert json.loads(json.dumps(m)) == m


def test_unmeasured_fields_are_not_saved():
    m = saved(cluster(1, 2))                                   # gloo: no GPU, no transport
    fields = m["classes"]["no GPU, no IB"]["fields"]
    assert "transport_inter" not in fields and "gpu_model" not in fields and "torch" in fields


def test_refusal_only_for_a_fail():
    ok = {"verdict": "PASS", "exit_code": 0, "findings": [aiv.finding("layout", "PASS", "fine")]}
    assert aiv.manifest_refusal(ok) == ""
    warned = dict(ok, findings=[aiv.finding("fabric", "WARN", "mlx5_1:1 is DOWN")])
    assert aiv.manifest_refusal(warned) == ""
    assert aiv.manifest_refusal(dict(ok, verdict="FAIL", exit_code=1)) == "the verdict is FAIL (exit 1)"


def test_hostlist_fallback_for_names_that_do_not_round_trip():
    assert aiv._hosts_out(["node2", "node1"]) == "node[1-2]"
    assert aiv._hosts_out(["a[1]", "b,c"]) == ["a[1]", "b,c"]
    assert aiv._hosts_in(["a[1]"]) == ["a[1]"] and aiv._hosts_in("n[1-2]") == ["n1", "n2"]


# ---------------------------------------------------------------- merge
def test_two_saves_with_different_hosts_add_up():
    a = saved(gpu_cluster(("node1", "node2")))
    b = saved(gpu_cluster(("node3",)) + gpu_cluster(("h100a",), model="NVIDIA H100"), "2030-02-01T00:00:00+00:00")
    m = aiv.merge_manifests(a, b)
    h200 = m["classes"]["NVIDIA H200 x2, IB 8x400G"]
    assert h200["hosts"] == "node[1-3]" and h200["runs"] == 2
    assert h200["first_accepted_at"] == T0 and h200["last_accepted_at"].startswith("2030-02")
    assert h200["fields"]["torch"] == [{"value": "2.13.0", "hosts": "node[1-3]"}]
    assert m["classes"]["NVIDIA H100 x2, IB 8x400G"]["hosts"] == "h100a"
    assert m["written_at"].startswith("2030-02") and aiv.manifest_problem(m) is None


def test_reaccepted_host_takes_new_values_keeps_unmeasured_ones_and_leaves_its_old_class():
    a = saved(gpu_cluster(("node1", "node2")))
    again = gpu_cluster(("node1",), transport=None)            # no transports measured this time
    again[0]["node"]["driver"] = "590.2"
    m = aiv.merge_manifests(a, saved(again))
    f = m["classes"]["NVIDIA H200 x2, IB 8x400G"]["fields"]
    assert {v["value"]: v["hosts"] for v in f["driver"]} == {"580.1": "node2", "590.2": "node1"}
    assert f["transport_inter"] == [{"value": ["NET/IB"], "hosts": "node[1-2]"}]  # kept from the first save
    moved = aiv.merge_manifests(m, saved(gpu_cluster(("node2",), ports=4)))
    assert moved["classes"]["NVIDIA H200 x2, IB 8x400G"]["hosts"] == "node1"
    assert moved["classes"]["NVIDIA H200 x2, IB 4x400G"]["hosts"] == "node2"
    assert aiv.manifest_problem(moved) is None


def one_run(ref, lo, hi):
    return aiv._band_from([{"ref": ref, "lo": lo, "hi": hi}], 1)


def test_bands_span_a_window_of_recent_runs_and_count_all():
    old = {"busbw_1G": one_run(100.0, 95.0, 105.0)}
    new = {"busbw_1G": one_run(110.0, 108.0, 112.0), "busbw_16M": one_run(5, 4, 6)}
    b = aiv.merge_bands(old, new)
    assert {k: b["busbw_1G"][k] for k in ("ref", "lo", "hi", "runs")} == {"ref": 105.0, "lo": 95.0, "hi": 112.0,
                                                                          "runs": 2}
    assert b["busbw_16M"]["runs"] == 1 and len(b["busbw_1G"]["window"]) == 2
    a, n = saved(cluster(1, 2)), saved(cluster(1, 2))
    a["classes"]["no GPU, no IB"]["bands"], n["classes"]["no GPU, no IB"]["bands"] = old, new
    m = aiv.merge_manifests(a, n)
    assert m["classes"]["no GPU, no IB"]["bands"]["busbw_1G"]["hi"] == 112.0 and aiv.manifest_problem(m) is None


def test_a_slow_run_ages_out_of_the_band_after_the_window():
    """Not an all-time minimum: one slow accepted run lowers the band only while it is among the last
    BAND_WINDOW runs."""
    b = {"x": one_run(100.0, 50.0, 101.0)}                      # the slow one
    for i in range(aiv.BAND_WINDOW - 1):
        b = aiv.merge_bands(b, {"x": one_run(100.0, 98.0, 102.0)})
        assert b["x"]["lo"] == 50.0 and b["x"]["runs"] == i + 2
    b = aiv.merge_bands(b, {"x": one_run(100.0, 98.0, 102.0)})
    assert b["x"]["lo"] == 98.0 and b["x"]["runs"] == aiv.BAND_WINDOW + 1 and len(b["x"]["window"]) == aiv.BAND_WINDOW


# ---------------------------------------------------------------- judge
def test_same_state_passes_and_names_what_was_not_checked():
    recs = gpu_cluster(("node1", "node2"))
    f = only_finding(aiv.judge_manifest(saved(recs), recs), "PASS")
    assert f["check"] == "manifest" and "2 node(s) match the manifest (2 listed, 0 judged by class)" in f["reason"]
    assert aiv.judge_manifest(None, recs) == []


def test_listed_host_that_lost_an_hca_fails_against_its_own_class():
    m = saved(gpu_cluster(("node1", "node2")))
    recs = gpu_node("node1") + gpu_node("node2", first_rank=2, ports=7)
    out = aiv.judge_manifest(m, recs)
    f = only_finding(out, "FAIL")
    assert f["reason"] == "IB port count differs from the manifest: 8 -> 7 on node2" and f["hosts"] == ["node2"]
    assert not any("never accepted" in x["reason"] for x in out)      # not an unknown class


def test_listed_host_with_another_gpu_model_fails():
    m = saved(gpu_cluster(("node1", "node2")))
    recs = gpu_node("node1") + gpu_node("node2", first_rank=2, model="NVIDIA H100 80GB HBM3")
    f = only_finding(aiv.judge_manifest(m, recs), "FAIL")      # GPU memory is compared per model: not twice
    assert f["reason"] == "GPU model differs from the manifest: NVIDIA H200 -> NVIDIA H100 80GB HBM3 on node2"


def test_unlisted_host_of_a_known_class_is_judged_by_class():
    m = saved(gpu_cluster(("node1", "node2")))
    f = only_finding(aiv.judge_manifest(m, gpu_node("node9")), "PASS")
    assert "(0 listed, 1 judged by class)" in f["reason"]
    odd = gpu_node("node9")
    odd[0]["versions"] = dict(odd[0]["versions"], torch="2.12.0")
    f = only_finding(aiv.judge_manifest(m, odd), "FAIL")
    assert f["reason"] == "torch differs from the manifest: 2.13.0 -> 2.12.0 on node9"


def test_unlisted_host_of_an_unknown_class_warns_naming_it():
    m = saved(gpu_cluster(("node1",)))
    recs = gpu_node("node1") + gpu_node("b200x", first_rank=2, model="NVIDIA B200")
    f = only_finding(aiv.judge_manifest(m, recs), "WARN")
    assert f["hosts"] == ["b200x"] and "'NVIDIA B200 x2, IB 8x400G' was never accepted" in f["reason"]
    assert "accepted: NVIDIA H200 x2, IB 8x400G" in f["reason"]


def test_subset_run_reports_no_absent_hosts():
    m = saved(gpu_cluster(("node1", "node2", "node3", "node4")))
    (f,) = aiv.judge_manifest(m, gpu_node("node3"))
    assert f["status"] == "PASS" and f["hosts"] == ["node3"] and "1 node(s) match" in f["reason"]


def test_gloo_run_does_not_check_transport_or_gpus():
    m = saved(gpu_cluster(("node1", "node2")))
    recs = cluster(2, 2)                                                  # same hosts, gloo on CPU
    for r in recs:
        if r.get("node"):
            r["node"].update(ib=ib(), ifaces={"eth0": [], "ib0": [], "lo": []}, env={"NCCL_IB_HCA": "mlx5"})
    f = only_finding(aiv.judge_manifest(m, recs), "PASS")
    assert "transport_intra, transport_inter" in f["reason"] and "gpu_model" in f["reason"]


def test_transport_downgrade_fails_and_a_new_fast_path_warns():
    m = saved(gpu_cluster(("node1", "node2")))
    recs = gpu_node("node1") + gpu_node("node2", first_rank=2, transport=("P2P", "NET/Socket"))
    f = only_finding(aiv.judge_manifest(m, recs), "FAIL")
    assert f["reason"] == "NCCL transport between nodes differs from the manifest: NET/IB -> NET/Socket on node2"
    m2 = saved(gpu_cluster(("node1",), transport=("SHM", "NET/IB")))
    f = only_finding(aiv.judge_manifest(m2, gpu_node("node1")), "WARN")
    assert "SHM -> P2P on node1" in f["reason"]


def test_pcie_under_load_downgrade_fails_upgrade_warns_absent_not_checked():
    """The PCIe link is the screen's reading under load; the idle one (an idle GPU may train its link down)
    is not judged, and a run without the screen does not check the link."""
    accepted = gpu_cluster(("node1", "node2"))
    m = saved(accepted, screen=loaded(accepted, width=8))
    n1, n2 = gpu_node("node1", width=1), gpu_node("node2", first_rank=2, width=1)   # idle readings: ignored
    out = aiv.judge_manifest(m, n1 + n2, dict(loaded(n1, width=4), gpu=loaded(n1, width=4)["gpu"]
                                              + loaded(n2, width=16)["gpu"]))
    assert only_finding(out, "FAIL")["reason"] == "PCIe link width differs from the manifest: x8 -> x4 on node1"
    assert only_finding(out, "WARN")["reason"] == "PCIe link width differs from the manifest: x8 -> x16 on node2"
    for screen in (None, loaded(n1, width=None, speed=None)):
        f = only_finding(aiv.judge_manifest(m, n1, screen), "PASS")
        assert "pcie_width, pcie_speed" in f["reason"]


def test_warn_fields_and_strict():
    m = saved(gpu_cluster(("node1", "node2")))
    recs = gpu_cluster(("node1", "node2"), env={"NCCL_IB_HCA": "mlx5", "NCCL_ALGO": "Tree"})
    for r in recs:
        if r.get("node"):
            r["node"]["kernel"] = "6.8.0"
    out = aiv.judge_manifest(m, recs)
    assert [f["status"] for f in out] == ["WARN", "WARN"] and not by_status(out, "FAIL")
    assert out[0]["reason"] == "kernel differs from the manifest: 5.15.0 -> 6.8.0 on node[1-2]"
    assert out[1]["reason"] == "environment differs from the manifest: NCCL_ALGO (unset) -> Tree on node[1-2]"
    assert {f["status"] for f in aiv.apply_strict(out, True)} == {"FAIL"}


def test_every_fail_field_fails_and_one_finding_per_field():
    m = saved(gpu_cluster(("node1", "node2", "node3")))
    recs = gpu_cluster(("node1", "node2", "node3"))
    for r in recs:
        r["versions"] = dict(r["versions"], cuda="13.0", nccl="2.29.1")
        if r.get("node"):
            r["node"]["driver"] = "590.1"
    out = aiv.judge_manifest(m, recs)
    assert [f["reason"].split(" differs")[0] for f in out] == ["driver", "CUDA", "NCCL"]
    assert all(f["status"] == "FAIL" and f["hosts"] == ["node1", "node2", "node3"] for f in out)
    assert out[0]["reason"] == "driver differs from the manifest: 580.1 -> 590.1 on node[1-3]"


def test_hand_edited_values_of_another_type_fail_without_a_crash():
    recs = gpu_node("node1")
    m = saved(recs, screen=loaded(recs))
    f = m["classes"]["NVIDIA H200 x2, IB 8x400G"]["fields"]
    f["pcie_width"][0]["value"], f["transport_inter"][0]["value"], f["env"][0]["value"] = "16", "NET/IB", ["x"]
    f["gpu_memory"][0]["value"] = "lots"
    for bad in ("pcie_width", "transport_inter", "env", "gpu_memory"):
        assert aiv.manifest_problem(m).startswith('classes["NVIDIA H200 x2, IB 8x400G"].fields.')
        f[bad][0]["value"] = copy.deepcopy(saved(recs, screen=loaded(recs)))["classes"][
            "NVIDIA H200 x2, IB 8x400G"]["fields"][bad][0]["value"]
    assert aiv.manifest_problem(m) is None
    f["pcie_width"][0]["value"], f["transport_inter"][0]["value"], f["env"][0]["value"] = "16", "NET/IB", ["x"]
    f["gpu_memory"][0]["value"] = "lots"
    out = aiv.judge_manifest(m, recs, loaded(recs))                  # the judge itself never crashes on them
    assert [x["reason"].split(" differs")[0] for x in by_status(out, "FAIL")] == [
        "PCIe link width", "NCCL transport between nodes"]
    assert [x["reason"].split(" differs")[0] for x in by_status(out, "WARN")] == ["environment"]


def test_judge_is_fast_at_scale():
    recs = gpu_cluster(tuple(f"gpu{i:03d}" for i in range(1, 513)), per_node=8)
    m = saved(recs)
    t = time.monotonic()
    assert only_finding(aiv.judge_manifest(m, recs), "PASS")
    assert time.monotonic() - t < 5
    hosts = m["classes"]["NVIDIA H200 x8, IB 8x400G"]["hosts"]
    assert isinstance(hosts, str) and aiv.expand_hostlist(hosts) == [f"gpu{i:03d}" for i in range(1, 513)]


# ---------------------------------------------------------------- schema checks and diff
H200 = "NVIDIA H200 x2, IB 8x400G"
C = f'classes["{H200}"]'


def valid_manifest():
    """A manifest with every part filled: fields, a band of enough runs, an accepted WARN."""
    recs = gpu_cluster(("node1", "node2"))
    screen = dict(loaded(recs), intra=[{"host": "node1", "busbw": 300.0, "ranks": [0, 1]},
                                       {"host": "node2", "busbw": 310.0, "ranks": [2, 3]}],
                  pairs=[{"round": 1, "nodes": ["node1", "node2"], "rail": 0, "busbw": 40.0}])
    warn = aiv.finding("fabric", "WARN", "mlx5_9:1 is DOWN on node[1-2]", ["node1", "node2"])
    m = saved(recs, screen=screen, findings=[warn])
    for _ in range(aiv.BAND_MIN_RUNS - 1):
        m = aiv.merge_manifests(m, saved(recs, screen=screen, findings=[warn]))
    assert aiv.manifest_problem(m) is None
    return m, recs, screen


def at(m, path):
    for k in path[:-1]:
        m = m[k]
    return m, path[-1]


@pytest.mark.parametrize("path, value, words", [
    (("tool",), "other", "not an ai-infra-validator manifest"),
    (("schema_version",), "2", "is not a positive integer"),
    (("classes",), None, "classes: not an object"),
    (("classes", H200, "hosts"), "n[2-1]", f"{C}.hosts: 'n[2-1]' is not a hostlist"),
    (("classes", H200, "fields", "driver"), 3, f"{C}.fields.driver: not a list of {{value, hosts}}"),
    (("classes", H200, "fields", "driver", 0, "value"), 580, f"{C}.fields.driver[0].value: 580 is not a string"),
    (("classes", H200, "fields", "gpus_per_node", 0, "value"), -1, "is not an integer >= 0"),
    (("classes", H200, "fields", "gpu_memory", 0, "value"), {"NVIDIA H200": 0}, "is not an object {GPU model"),
    (("classes", H200, "fields", "ib_rate", 0, "value"), float("nan"), f"{C}.fields.ib_rate[0].value: NaN is not"),
    (("classes", H200, "fields", "wattage"), [], f"{C}.fields.wattage: unknown field"),
    (("classes", H200, "key", "gpus_per_node"), "8", f"{C}.key.gpus_per_node: \"8\" is not an integer"),
    (("classes", H200, "runs"), 0, f"{C}.runs: 0 is not an integer >= 1"),
    (("classes", H200, "bands", "gpu.tflops/NVIDIA H200", "lo"), None,
     f'{C}.bands["gpu.tflops/NVIDIA H200"]: "lo" is missing'),
    (("classes", H200, "bands", "gpu.tflops/NVIDIA H200", "lo"), float("inf"),
     f'{C}.bands["gpu.tflops/NVIDIA H200"].lo: Infinity is not a finite number > 0'),
    (("classes", H200, "bands", "gpu.tflops/NVIDIA H200", "hi"), 1.0, "lo 700 is above hi 1"),
    (("classes", H200, "bands", "intra.busbw/2 ranks", "window", 0, "ref"), -3,
     f'{C}.bands["intra.busbw/2 ranks"].window[0].ref: -3 is not a finite number > 0'),
    (("accepted_warns", 0, "check"), "wifi", "accepted_warns[0].check: 'wifi' is not a check name"),
    (("accepted_warns", 0, "hosts"), 7, "accepted_warns[0].hosts: 7 is not a hostlist"),
])
def test_every_field_is_validated_and_named(path, value, words):
    m, _, _ = valid_manifest()
    parent, key = at(m, path)
    if value is None and key == "lo":
        del parent[key]
    else:
        parent[key] = value
    assert words in (aiv.manifest_problem(m) or ""), aiv.manifest_problem(m)


def test_a_host_in_two_classes_is_named():
    m, _, _ = valid_manifest()
    m["classes"]["other"] = copy.deepcopy(m["classes"][H200])
    assert aiv.manifest_problem(m) == f"host node1 is listed in two classes: '{H200}' and 'other'"


def test_schema_1_is_refused_with_what_to_do(tmp_path):
    old = {"tool": "ai-infra-validator", "schema_version": 1, "version": "1.0.0", "classes": {}}
    p = aiv.manifest_problem(old)
    assert p.startswith("schema_version 1 is an old manifest") and "accept the nodes again with --save-manifest" in p
    path = write(tmp_path, "v1.json", json.dumps(old))
    with pytest.raises(aiv.UsageError, match=rf"^--manifest {path}: schema_version 1 is an old manifest"):
        aiv.load_manifest(str(path), "--manifest")
    r = run_tool(["--nproc", 2, "--save-manifest", path], timeout=60)     # not merged into, not overwritten
    assert r.returncode == 2 and r.stdout.startswith(f"FAILURE: usage: --save-manifest {path}: schema_version 1 is")
    assert json.loads(path.read_text()) == old


def test_newer_schema_names_both_versions():
    m = dict(saved(cluster(1, 2)), schema_version=aiv.MANIFEST_SCHEMA_VERSION + 1, version="9.9.9")
    p = aiv.manifest_problem(m)
    assert f"schema_version {aiv.MANIFEST_SCHEMA_VERSION + 1} is newer than the {aiv.MANIFEST_SCHEMA_VERSION}" in p
    assert "9.9.9" in p


def test_diff_lines_per_difference():
    a = saved(gpu_cluster(("node1", "node2")))
    assert aiv.diff_manifests(a, copy.deepcopy(a)) == []
    recs = gpu_cluster(("node1", "node2", "node3"), env={"NCCL_IB_HCA": "mlx5", "NCCL_ALGO": "Ring"})
    recs[0]["node"]["driver"] = "590.1"
    b = saved(recs)
    b["classes"]["NVIDIA H200 x2, IB 8x400G"]["bands"] = {"busbw_1G": {"ref": 1, "lo": 1, "hi": 1, "runs": 1}}
    lines = aiv.diff_manifests(a, b)
    k = "NVIDIA H200 x2, IB 8x400G"
    assert f"{k}/hosts: node[1-2] -> node[1-3] (node3)" in lines
    assert f"{k}/driver: 580.1 -> 590.1 (node1)" in lines
    assert f"{k}/env.NCCL_ALGO: (unset) -> Ring (node[1-3])" in lines
    assert any(ln.startswith(f"{k}/bands: {{}} -> ") for ln in lines)
    assert len(lines) == 4
    c = aiv.merge_manifests(a, saved(gpu_cluster(("h100a",), model="NVIDIA H100")))
    assert aiv.diff_manifests(a, c) == ["NVIDIA H100 x2, IB 8x400G/hosts: - -> h100a (h100a)"]


# ---------------------------------------------------------------- real processes
@pytest.fixture(scope="module")
def stubs(tmp_path_factory):
    """torchvision and torchaudio stand-ins, so that a CPU run here has no imports WARN to refuse a save."""
    d = tmp_path_factory.mktemp("stubs")
    for name, version in (("torchvision", "0.0.1+stub"), ("torchaudio", "0.0.2+stub")):
        (d / name).mkdir()
        (d / name / "__init__.py").write_text(f'__version__ = "{version}"\n')
    return {"PYTHONPATH": str(d)}


@pytest.fixture(scope="module")
def accepted(tmp_path_factory, stubs):
    """A manifest saved from a passing 2-rank CPU run of this machine: (path, that run, its JSON)."""
    d = tmp_path_factory.mktemp("accepted")
    path, jp = d / "m.json", d / "run.json"
    r = run_tool(["--nproc", 2, "--timeout", 60, "--save-manifest", path, "--json", jp], env=stubs)
    return path, r, json.loads(jp.read_text())


def test_save_on_a_passing_cpu_run_then_judge_the_same_machine(accepted, stubs, tmp_path):
    path, r, d = accepted
    host = d["ranks"][0]["host"]
    assert r.returncode == 0 and not failures(r.stdout), r.stdout + r.stderr
    assert f"  NOTE: manifest saved to {path}: 1 node(s) accepted in 1 class(es) (no GPU, no IB)" in r.stdout
    assert d["notes"] == [r.stdout.split("NOTE: ")[1].splitlines()[0]]
    m = json.loads(path.read_text())
    assert aiv.manifest_problem(m) is None and list(m["classes"]) == ["no GPU, no IB"]
    f = m["classes"]["no GPU, no IB"]["fields"]
    assert f["torchvision"] == [{"value": "0.0.1+stub", "hosts": host}] and f["env"] == [{"value": {}, "hosts": host}]
    j = run_tool(["--nproc", 2, "--timeout", 60, "--manifest", path], env=stubs)
    assert j.returncode == 0 and j.stdout.splitlines()[-1] == aiv.SUCCESS_LINE, j.stdout
    assert "  [PASS] manifest: 1 node(s) match the manifest (1 listed, 0 judged by class)" in j.stdout


def test_edited_field_fails_naming_old_and_new(accepted, stubs, tmp_path):
    path, _, d = accepted
    m = json.loads(path.read_text())
    torch_now = d["ranks"][0]["versions"]["torch"]
    m["classes"]["no GPU, no IB"]["fields"]["torch"][0]["value"] = "1.0.0"
    edited = tmp_path / "edited.json"
    edited.write_text(json.dumps(m))
    r = run_tool(["--nproc", 2, "--timeout", 60, "--manifest", edited], env=stubs)
    assert r.returncode == 1, r.stdout
    host = d["ranks"][0]["host"]
    assert failures(r.stdout) == [f"FAILURE: manifest: torch differs from the manifest: 1.0.0 -> {torch_now} on {host}"]


def test_changed_nccl_variable_warns_naming_the_node_and_the_save_takes_the_new_value(accepted, stubs, tmp_path):
    path, _, d = accepted
    out = tmp_path / "again.json"
    r = run_tool(["--nproc", 2, "--timeout", 60, "--manifest", path, "--save-manifest", out],
                 env=dict(stubs, NCCL_SOCKET_NTHREADS="4"))
    host = d["ranks"][0]["host"]
    assert r.returncode == 0 and not failures(r.stdout), r.stdout
    assert (f"  [WARN] manifest: environment differs from the manifest: NCCL_SOCKET_NTHREADS (unset) -> 4 on {host}"
            in r.stdout)
    assert f"  NOTE: manifest saved to {out}: 1 node(s) accepted" in r.stdout and "WARN(s) accepted" not in r.stdout
    m = json.loads(out.read_text())
    assert m["classes"]["no GPU, no IB"]["fields"]["env"] == [{"value": {"NCCL_SOCKET_NTHREADS": "4"}, "hosts": host}]
    assert m["accepted_warns"] == []                  # the manifest's own drift is taken, not accepted as a WARN


def test_save_onto_an_existing_manifest_merges_hosts(accepted, stubs, tmp_path):
    path, _, d = accepted
    m = json.loads(path.read_text())
    c = m["classes"]["no GPU, no IB"]
    host = d["ranks"][0]["host"]
    c["hosts"] = "otherbox"
    for variants in c["fields"].values():
        for v in variants:
            v["hosts"] = "otherbox"
    both = tmp_path / "both.json"
    both.write_text(json.dumps(m))
    r = run_tool(["--nproc", 2, "--timeout", 60, "--save-manifest", both], env=stubs)
    assert r.returncode == 0 and "merged into the existing file" in r.stdout, r.stdout
    merged = json.loads(both.read_text())["classes"]["no GPU, no IB"]
    assert sorted(aiv._hosts_in(merged["hosts"])) == sorted(["otherbox", host]) and merged["runs"] == 2


def test_saved_over_warnings_which_are_then_judged_accepted_and_a_new_warn_still_shows(tmp_path):
    path = tmp_path / "m.json"
    r = run_tool(["--nproc", 2, "--timeout", 60, "--save-manifest", path])   # no torchvision here: WARN
    assert r.returncode == 0 and not failures(r.stdout), r.stdout
    assert f"  NOTE: manifest saved to {path}: 1 node(s) accepted in 1 class(es) (no GPU, no IB); 2 WARN(s) " \
           f"accepted (imports)" in r.stdout
    m = json.loads(path.read_text())
    assert [w["check"] for w in m["accepted_warns"]] == ["imports", "imports"] and aiv.manifest_problem(m) is None
    j = run_tool(["--nproc", 2, "--timeout", 60, "--manifest", path], env={"NCCL_SOCKET_NTHREADS": "4"})
    assert j.returncode == 0 and not failures(j.stdout), j.stdout
    warns = [ln for ln in j.stdout.splitlines() if ln.startswith("  [WARN]")]
    assert len(warns) == 2 and sum(ln.endswith(" (accepted in manifest)") for ln in warns) == 1, warns  # one row
    assert sum(ln.count(" (accepted in manifest)") for ln in warns) == 2, warns  # per check and node: both WARNs
    assert [ln for ln in warns if "accepted" not in ln][0].startswith("  [WARN] manifest: environment differs")
    f = tmp_path / "run.log"
    f.write_text(j.stdout)
    assert run_tool(["--verify-log", f]).returncode == 0


def test_failed_run_is_not_saved(tmp_path):
    path = tmp_path / "m.json"
    r = run_tool(["--nproc", 2, "--timeout", 60, "--save-manifest", path, "--expect-world-size", 3])
    assert r.returncode == 1, r.stdout
    assert f"  NOTE: manifest not saved to {path}: the verdict is FAIL (exit 1); a manifest is saved only from a " \
           f"PASS" in r.stdout
    assert not path.exists()


def write(tmp_path, name, text):
    p = tmp_path / name
    p.write_text(text)
    return p


def without_lo():
    """A manifest of schema 2 whose speed band lacks 'lo' (once a verdict: KeyError: 'lo'): refused up front."""
    m, _, _ = valid_manifest()
    del m["classes"][H200]["bands"]["gpu.tflops/NVIDIA H200"]["lo"]
    return json.dumps(m)


@pytest.mark.parametrize("content, words", [
    ("{not json", "not a manifest (not JSON"),
    (without_lo(), f'{C}.bands["gpu.tflops/NVIDIA H200"]: "lo" is missing'),
    ('{"tool": "ai-infra-validator", "schema_version": 99, "classes": {}, "version": "7.0.0"}',
     f"schema_version 99 is newer than the {aiv.MANIFEST_SCHEMA_VERSION} this tool reads"),
    (None, "cannot read it"),
])
def test_unusable_manifest_is_a_usage_error_with_one_line(tmp_path, content, words):
    p = write(tmp_path, "m.json", content) if content is not None else tmp_path / "missing.json"
    for args, env in ((["--nproc", 2, "--manifest", p], None), (["--nproc", 2], {"AIV_MANIFEST": p})):
        r = run_tool(args, env=env, timeout=60)
        assert r.returncode == 2, r.stdout + r.stderr
        assert r.stdout.splitlines() == [r.stdout.strip()] and r.stdout.startswith(f"FAILURE: usage: --manifest {p}: ")
        assert words in r.stdout and r.stderr == ""


def test_rank0_under_a_launcher_says_it_before_the_roll_call(tmp_path):
    p = write(tmp_path, "m.json", "garbage")
    t = time.monotonic()
    ((rc, out),), _ = spawn(2, ranks=[0], args=["--manifest", p, "--rollcall-timeout", 60])
    assert rc == 2 and out.strip().splitlines() == [f"FAILURE: usage: --manifest {p}: not a manifest (not JSON: "
                                                    f"Expecting value: line 1 column 1 (char 0))"]
    assert time.monotonic() - t < 30


def test_save_manifest_directory_checked_up_front(tmp_path):
    r = run_tool(["--nproc", 2, "--save-manifest", tmp_path / "nodir" / "m.json"], timeout=60)
    assert r.returncode == 2 and r.stdout.strip() == (f"FAILURE: usage: --save-manifest {tmp_path}/nodir/m.json: "
                                                      f"directory {tmp_path}/nodir does not exist")
    bad = write(tmp_path, "bad.json", "[]")
    r = run_tool(["--nproc", 2, "--save-manifest", bad], timeout=60)
    assert r.returncode == 2 and "not an ai-infra-validator manifest" in r.stdout
    r = run_tool(["--nproc", 2, "--save-manifest", tmp_path], timeout=60)
    assert r.returncode == 2 and "is a directory" in r.stdout


def diff_env(tmp_path):
    """A torch that cannot be imported: --diff-manifest must not need it."""
    (tmp_path / "notorch" / "torch").mkdir(parents=True)
    (tmp_path / "notorch" / "torch" / "__init__.py").write_text("raise ImportError('torch imported')\n")
    return {"PYTHONPATH": str(tmp_path / "notorch")}


def test_diff_manifest_exit_codes_without_torch(tmp_path):
    a = saved(gpu_cluster(("node1", "node2")))
    b = copy.deepcopy(a)
    b["classes"]["NVIDIA H200 x2, IB 8x400G"]["fields"]["driver"][0]["value"] = "590.1"
    pa, pa2, pb = (write(tmp_path, n, json.dumps(x)) for n, x in (("a.json", a), ("a2.json", a), ("b.json", b)))
    env = diff_env(tmp_path)
    r = run_tool(["--diff-manifest", pa, pa2], env=env, timeout=60)
    assert r.returncode == 0 and r.stdout == "" and "are equal" in r.stderr, r.stdout + r.stderr
    r = run_tool(["--diff-manifest", pa, pb], env=env, timeout=60)
    assert r.returncode == 1 and r.stdout.splitlines() == ["NVIDIA H200 x2, IB 8x400G/driver: 580.1 -> 590.1 "
                                                           "(node[1-2])"], r.stdout + r.stderr
    r = run_tool(["--diff-manifest", pa, tmp_path / "none.json"], env=env, timeout=60)
    assert r.returncode == 2 and r.stdout.startswith("FAILURE: usage: --diff-manifest ") and "cannot read" in r.stdout
    r = run_tool(["--diff-manifest", pa, write(tmp_path, "g.json", "{")], env=env, timeout=60)
    assert r.returncode == 2 and len(r.stdout.splitlines()) == 1


def test_report_note_is_rendered_and_verify_log_still_passes(tmp_path):
    recs = cluster(1, 2)
    findings = aiv.judge_all(recs, 2, {})
    state = {"world_size": 2, "backend": "gloo", "ranks": recs, "findings": findings, "verdict": "PASS",
             "exit_code": 0, "elapsed_s": 1.0, "phases": {}, "failures": [], "env": {},
             "collectives": {"ar_sum": 3, "ar_expected": 3, "ranks": 2, "loss": 0.5, "grads_identical": True},
             "notes": ["manifest not saved to m.json: 1 WARN finding(s) (fabric); a manifest is saved only ..."]}
    text = "Total Execution Ranks: 2\n" + aiv.render_report(state)
    assert "  NOTE: manifest not saved to m.json" in text
    ok, problems, _ = aiv.verify_log(text, {})
    assert ok, problems


def test_manifest_is_a_stable_check_name():
    assert "manifest" in aiv.CHECKS


def test_gpu_run_saves_gpu_pcie_and_transport_then_matches(tmp_path, stubs):
    """On a CUDA machine (skipped elsewhere): the NCCL path fills the GPU, PCIe and transport fields."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device on this machine")
    path, jp = tmp_path / "gpu.json", tmp_path / "run.json"
    r = run_tool(["--timeout", 120, "--save-manifest", path, "--json", jp], env=stubs)
    assert r.returncode == 0, r.stdout + r.stderr
    d = json.loads(jp.read_text())
    g = d["ranks"][0]["gpu"]
    assert set(aiv.PCI_LINK_FILES) <= set(g) and "env" in d["ranks"][0]["node"]
    if not path.exists():
        pytest.skip(f"this machine's run has WARNs: {d['notes']}")
    (c,) = json.loads(path.read_text())["classes"].values()
    assert c["key"]["gpu_model"] == g["name"] and c["key"]["gpus_per_node"] >= len(d["ranks"])
    assert c["key"]["gpus_per_node"] == (len(aiv.driver_gpus()) or c["key"]["gpus_per_node"])
    assert {"driver", "cuda", "nccl", "gpu_memory"} <= set(c["fields"])
    load = (d.get("screen") or {}).get("gpu") or []                      # the PCIe link read under load
    assert ("pcie_width" in c["fields"]) == any(x.get("pcie_width") is not None for x in load)
    assert ("transport_intra" in c["fields"]) == (len(d["ranks"]) > 1)
    j = run_tool(["--timeout", 120, "--manifest", path], env=stubs)
    assert j.returncode == 0 and "  [PASS] manifest: 1 node(s) match the manifest (1 listed" in j.stdout, j.stdout


# ---------------------------------------------------------------- speed bands from the performance screen
def band_screen(tflops=(100.0, 100.0, 98.0, 101.0), inter=(20.0, 21.0), cpu=False, tries=2):
    """A screen of 4 nodes; tries: how often each GPU and node was measured (the screen measures a slow value
    again: a value below a band names its host only when it was measured again)."""
    hosts = ["node1", "node2", "node3", "node4"]
    return {"cpu": cpu,
            "gpu": [{"rank": i, "host": h, "local_rank": 0, "uuid": f"GPU-{i}", "model": "cpu",
                     "tflops": t, "hbm_gbps": 50.0, "tries": tries}
                    for i, (h, t) in enumerate(zip(hosts, tflops, strict=True))],
            "intra": [{"host": h, "busbw": 5.0, "ranks": [i, i + 4], "tries": tries} for i, h in enumerate(hosts)],
            "pairs": [{"round": 1, "nodes": ["node1", "node3"], "rail": 0, "busbw": inter[0]},
                      {"round": 1, "nodes": ["node2", "node4"], "rail": 0, "busbw": inter[1]}]}


def test_bands_are_saved_per_class_and_widen_over_accepted_runs():
    recs = cluster(4, 1)
    cls = aiv.class_name(aiv.host_view([recs[0]])[1])
    b1 = aiv.screen_bands(band_screen(), recs)[cls]
    assert set(b1) == {"gpu.tflops/cpu", "gpu.hbm_gbps/cpu", "intra.busbw/2 ranks", "inter.busbw/1 rails"}
    t = b1["gpu.tflops/cpu"]
    assert t["lo"] == 98.0 and t["hi"] == 101.0 and t["runs"] == 1
    b2 = aiv.screen_bands(band_screen(tflops=(90.0, 95.0, 96.0, 97.0)), recs)[cls]
    merged = aiv.merge_bands(b1, b2)
    assert merged["gpu.tflops/cpu"]["lo"] == 90.0 and merged["gpu.tflops/cpu"]["hi"] == 101.0
    assert merged["gpu.tflops/cpu"]["runs"] == 2


def test_band_names_follow_what_the_speed_depends_on():
    """Two rails of one pair at once is another band than one rail; 4 ranks per node another than 8."""
    recs = cluster(4, 1)
    screen = band_screen()
    screen["pairs"].append({"round": 1, "nodes": ["node3", "node1"], "rail": 1, "busbw": 19.0})
    screen["intra"][0]["ranks"] = [0, 4, 8, 12]
    names = set(next(iter(aiv.screen_bands(screen, recs).values())))
    assert {"inter.busbw/2 rails", "inter.busbw/1 rails", "intra.busbw/4 ranks", "intra.busbw/2 ranks"} <= names


def test_speed_below_the_band_fails_naming_the_node_once_the_band_has_enough_runs():
    recs = cluster(4, 1)
    manifest = aiv.manifest_from_records(recs, "2026-01-01T00:00:00+00:00")
    cls = next(iter(manifest["classes"]))
    bands = {}
    for _ in range(aiv.BAND_MIN_RUNS - 1):
        bands = aiv.merge_bands(bands, aiv.screen_bands(band_screen(), recs)[cls])
    manifest["classes"][cls]["bands"] = bands
    slow = band_screen(tflops=(100.0, 60.0, 99.0, 100.0), inter=(5.0, 21.0))
    assert aiv.judge_bands(manifest, recs, slow) == []                   # too few accepted runs: not judged
    manifest["classes"][cls]["bands"] = aiv.merge_bands(bands, aiv.screen_bands(band_screen(), recs)[cls])
    out = aiv.judge_bands(manifest, recs, slow)
    # a GPU measured again and below the band is named; a pair of nodes below it names neither end (the link)
    assert [(f["status"], f["check"], f["hosts"], f.get("involved")) for f in out] == [
        ("FAIL", "manifest", ["node2"], None), ("FAIL", "manifest", [], ["node1", "node3"])]
    once = aiv.judge_bands(manifest, recs, band_screen(tflops=(100.0, 60.0, 99.0, 100.0), tries=1))
    assert [(f["hosts"], f["involved"], f["blame"]) for f in once] == [([], ["node2"], "once")]
    assert "gpu.tflops/cpu 60 on node2 GPU 0 (GPU-1, rank 1) is below the accepted band" in out[0]["reason"]
    assert out[0]["ranks"] == [1]                                        # the GPU's rank, not []
    assert "node[1,3] rail 0" in out[1]["reason"]
    assert aiv.judge_bands(manifest, recs, band_screen()) == []          # as accepted: nothing
    assert aiv.judge_bands(manifest, recs, dict(slow, cpu=True)) == []   # CPU: only a collapse counts


def test_a_node_below_its_band_is_not_counted_as_matching_the_manifest():
    """The manifest's PASS counts only nodes judge_bands does not FAIL, and names them in its hosts."""
    recs = cluster(4, 1)
    manifest = aiv.manifest_from_records(recs, "2026-01-01T00:00:00+00:00")
    cls = next(iter(manifest["classes"]))
    bands = {}
    for _ in range(aiv.BAND_MIN_RUNS):
        bands = aiv.merge_bands(bands, aiv.screen_bands(band_screen(), recs)[cls])
    manifest["classes"][cls]["bands"] = bands
    (ok,) = aiv.judge_manifest(manifest, recs, band_screen())
    assert ok["status"] == "PASS" and ok["hosts"] == ["node1", "node2", "node3", "node4"]
    slow = band_screen(tflops=(100.0, 60.0, 99.0, 100.0))
    (ok,) = aiv.judge_manifest(manifest, recs, slow)
    assert ok["hosts"] == ["node1", "node3", "node4"] and ok["reason"].startswith("3 node(s) match the manifest")
    one = [r for r in recs if r["host"] == "node2"]
    assert aiv.judge_manifest(manifest, one, slow) == []                  # its only node is below: no PASS
    assert [f["status"] for f in aiv.judge_bands(manifest, one, slow)] == ["FAIL"]


def test_band_fail_names_the_gpu_and_its_rank_and_the_group_ranks():
    """A slow GPU is named by node, index, UUID and rank, and its rank is in the finding's ranks; a slow
    node's intra-node group or a slow pair carries the ranks measured."""
    recs = cluster(4, 1)
    manifest = aiv.manifest_from_records(recs, "2026-01-01T00:00:00+00:00")
    cls = next(iter(manifest["classes"]))
    bands = {}
    for _ in range(aiv.BAND_MIN_RUNS):
        bands = aiv.merge_bands(bands, aiv.screen_bands(band_screen(), recs)[cls])
    manifest["classes"][cls]["bands"] = bands
    slow = band_screen(tflops=(100.0, 100.0, 99.0, 100.0))
    slow["gpu"][2].update(local_rank=5, hbm_gbps=10.0, uuid=None)
    slow["intra"][3]["busbw"] = 1.0
    slow["pairs"][1].update(busbw=1.0, ranks=[1, 3])
    out = aiv.judge_bands(manifest, recs, slow)
    by_band = {f["reason"].split(" ")[0]: f for f in out}
    gpu = by_band["gpu.hbm_gbps/cpu"]
    assert gpu["hosts"] == ["node3"] and gpu["ranks"] == [2]
    assert "10 on node3 GPU 5 (rank 2) is below" in gpu["reason"]   # no UUID known: index and rank
    intra = by_band["intra.busbw/2"]
    assert intra["hosts"] == ["node4"] and intra["ranks"] == [3, 7] and "node4 (ranks 3,7)" in intra["reason"]
    pair = by_band["inter.busbw/1"]
    assert pair["involved"] == ["node2", "node4"] and pair["ranks"] == [1, 3] and pair["hosts"] == []
    assert "node[2,4] rail 0 (ranks 1,3)" in pair["reason"]


# ---------------------------------------------------------------- accepted WARNs
def test_accepted_warn_is_known_on_a_subset_and_a_new_one_is_not():
    m, _, _ = valid_manifest()
    (e,) = m["accepted_warns"]
    assert e["check"] == "fabric" and e["hosts"] == "node[1-2]" and e["key"] == "fabric: mlx5_9:1 is DOWN on <host>"
    same_subset = aiv.finding("fabric", "WARN", "mlx5_9:1 is DOWN on node2", ["node2"])
    other_port = aiv.finding("fabric", "WARN", "mlx5_0:1 is DOWN on node2", ["node2"])
    other_host = aiv.finding("fabric", "WARN", "mlx5_9:1 is DOWN on node3", ["node3"])
    ok = aiv.finding("fabric", "PASS", "mlx5_9:1 is DOWN on node2", ["node2"])
    out = aiv.mark_accepted(m, [same_subset, other_port, other_host, ok])
    assert [f.get("accepted", False) for f in out] == [True, False, False, False]
    assert aiv.mark_accepted(None, [same_subset]) == [same_subset]


def test_decimal_numbers_do_not_change_a_warns_key():
    a = aiv.finding("day0", "WARN", "/dev/shm is 31.5 GiB on gpu001", ["gpu001"])
    b = aiv.finding("day0", "WARN", "/dev/shm is 30.9 GiB on gpu002", ["gpu002"])
    assert aiv.warn_key(a) == aiv.warn_key(b) == "day0: /dev/shm is <n> GiB on <host>"


def test_a_resave_replaces_the_acceptances_of_its_nodes_only():
    m, recs, screen = valid_manifest()
    again = aiv.merge_manifests(m, saved(gpu_node("node1"), screen=screen))       # node1 again, now clean
    assert again["accepted_warns"][0]["hosts"] == "node2"
    gone = aiv.merge_manifests(again, saved(recs, screen=screen))
    assert gone["accepted_warns"] == [] and aiv.manifest_problem(gone) is None
    assert any(ln.startswith("accepted WARN fabric: mlx5_9:1") for ln in aiv.diff_manifests(m, gone))


def test_report_marks_an_accepted_warn():
    recs = cluster(1, 2)
    f = dict(aiv.finding("day0", "WARN", "memlock 64 KiB"), accepted=True)
    state = {"world_size": 2, "backend": "gloo", "ranks": recs, "findings": [f], "verdict": "PASS",
             "exit_code": 0, "elapsed_s": 1.0, "phases": {}, "failures": [], "env": {},
             "collectives": {"ar_sum": 3, "ar_expected": 3, "ranks": 2, "loss": 0.5, "grads_identical": True}}
    assert "  [WARN] day0: memlock 64 KiB (accepted in manifest)" in aiv.render_report(state).splitlines()


# ---------------------------------------------------------------- file modes
def umasked(mask, fn):
    old = os.umask(mask)
    try:
        return fn()
    finally:
        os.umask(old)


@pytest.mark.parametrize("mask, mode", [(0o022, 0o644), (0o077, 0o600), (0o002, 0o664)])
def test_written_json_takes_the_umask_and_an_existing_file_keeps_its_mode(tmp_path, mask, mode):
    p = tmp_path / "v.json"
    umasked(mask, lambda: aiv.write_json_atomic(str(p), {"a": 1}))
    assert stat.S_IMODE(p.stat().st_mode) == mode and json.loads(p.read_text()) == {"a": 1}
    p.chmod(0o640)
    umasked(mask, lambda: aiv.write_json_atomic(str(p), {"a": 2}))
    assert stat.S_IMODE(p.stat().st_mode) == 0o640 and json.loads(p.read_text()) == {"a": 2}
    assert [x.name for x in tmp_path.iterdir()] == ["v.json"]              # no temporary file left behind


def test_a_real_run_writes_json_and_manifest_readable_under_umask_022(tmp_path):
    m, jp = tmp_path / "m.json", tmp_path / "run.json"
    cmd = [sys.executable, str(SCRIPT), "--nproc", "2", "--timeout", "60", "--save-manifest", str(m), "--json", str(jp)]
    r = subprocess.run(cmd, env=clean_env(None), capture_output=True, text=True, timeout=300, umask=0o022)
    assert r.returncode == 0 and m.exists(), r.stdout
    assert stat.S_IMODE(m.stat().st_mode) == stat.S_IMODE(jp.stat().st_mode) == 0o644


# ---------------------------------------------------------------- the save's lock
def hold_lock(path, seconds):
    """A second process holding the manifest's lock file (as another job's save would) for seconds."""
    lock = path.parent / f".{path.name}.lock"
    code = ("import fcntl, os, sys, time\n"
            "fd = os.open(sys.argv[1], os.O_CREAT | os.O_RDWR)\n"
            "fcntl.flock(fd, fcntl.LOCK_EX)\n"
            "print('held', flush=True)\n"
            "time.sleep(float(sys.argv[2]))\n")
    p = subprocess.Popen([sys.executable, "-c", code, str(lock), str(seconds)], stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "held"
    return p


def test_lock_held_by_another_process_times_out_instead_of_hanging(tmp_path):
    path = tmp_path / "m.json"
    holder = hold_lock(path, 120)
    try:
        with pytest.raises(aiv.LockTimeout, match="another job held its lock file for 0.5s"):
            with aiv._file_lock(str(path), 0.5):
                pass
    finally:
        holder.kill()
        holder.wait()
    with aiv._file_lock(str(path), 0.5):        # released with its holder: taken at once
        pass


def test_lock_is_retried_until_the_holder_lets_go(tmp_path):
    path = tmp_path / "m.json"
    holder = hold_lock(path, 1.0)
    try:
        with aiv._file_lock(str(path), 60):
            assert holder.poll() is not None or holder.wait(5) == 0     # we got it once the holder was done
    finally:
        holder.kill()
        holder.wait()


def test_save_that_cannot_lock_is_a_warn_naming_the_file_and_no_host(tmp_path):
    path = tmp_path / "m.json"
    state = {"verdict": "PASS", "exit_code": 0, "ranks": cluster(1, 2), "findings": [],
             "deadlines": {"manifest-lock": 0.3}}
    holder = hold_lock(path, 120)
    try:
        note = aiv.save_manifest(str(path), state, T0)
    finally:
        holder.kill()
        holder.wait()
    assert note == f"manifest not saved to {path}: another job held its lock file for 0.3s"
    assert state["findings"] == [aiv.finding("manifest", "WARN", note)] and not path.exists()
    assert aiv.save_manifest(str(path), dict(state, findings=[]), T0).startswith(f"manifest saved to {path}")


def test_real_run_whose_manifest_is_locked_ends_pass_with_a_warn(tmp_path, stubs):
    path = tmp_path / "m.json"
    holder = hold_lock(path, 120)
    try:
        r = run_tool(["--nproc", 2, "--timeout", 60, "--save-manifest", path], env=stubs)
    finally:
        holder.kill()
        holder.wait()
    assert r.returncode == 0 and not failures(r.stdout) and aiv.SUCCESS_LINE in r.stdout, r.stdout
    warn = (f"  [WARN] manifest: manifest not saved to {path}: another job held its lock file for "
            f"{aiv.MANIFEST_LOCK_S:g}s")
    # the report and the JSON come first; the save (bounded by its lock) after them
    assert r.stdout.index(aiv.SUCCESS_LINE) < r.stdout.index(warn), r.stdout
    assert not path.exists()


# ---------------------------------------------------------------- any edit: valid and judged, or exit 2
def _paths(x, path=()):
    yield path
    items = x.items() if isinstance(x, dict) else enumerate(x) if isinstance(x, list) else ()
    for k, v in items:
        yield from _paths(v, (*path, k))


JUNK = st.one_of(st.none(), st.booleans(), st.integers(-3, 1 << 40), st.floats(allow_nan=True, allow_infinity=True),
                 st.text(max_size=6), st.lists(st.text(max_size=3), max_size=2),
                 st.dictionaries(st.text(max_size=3), st.one_of(st.integers(-1, 9), st.text(max_size=2)), max_size=2))
SAME_TYPE = {int: st.integers(0, 1 << 40), float: st.floats(1e-3, 1e6), str: st.text(max_size=8),
             list: st.lists(st.text(max_size=3), max_size=2)}
BASE = valid_manifest()


@settings(max_examples=1000, deadline=None, database=None)
@given(data=st.data())
def test_any_edit_of_a_manifest_is_either_judged_without_error_or_refused(data):
    m, recs, screen = copy.deepcopy(BASE)
    for _ in range(data.draw(st.integers(1, 3))):
        path = data.draw(st.sampled_from([p for p in _paths(m) if p]))
        parent, key = at(m, path)
        op = data.draw(st.sampled_from(["set", "delete", "add", "tweak"]))
        if op == "delete":
            del parent[key]
        elif op == "add" and isinstance(parent, dict):
            parent[data.draw(st.text(max_size=5))] = data.draw(JUNK)
        elif op == "tweak":                                     # a value of the same type: often still valid
            parent[key] = data.draw(SAME_TYPE.get(type(parent[key]), JUNK))
        else:
            parent[key] = data.draw(JUNK)
    problem = aiv.manifest_problem(m)
    if problem is not None:
        assert isinstance(problem, str) and problem
        with tempfile.NamedTemporaryFile("w", suffix=".json") as f:
            json.dump(m, f)
            f.flush()
            with pytest.raises(aiv.UsageError, match=f"^--manifest {f.name}: "):
                aiv.load_manifest(f.name, "--manifest")
        return
    half = gpu_cluster(("node1", "node2"), per_node=1, driver_gpus=2)
    for rs, sc in ((recs, screen), (half, loaded(half)), (cluster(2, 2), None)):
        out = aiv.judge_manifest(m, rs, sc) + aiv.judge_bands(m, rs, sc)
        assert all(f["status"] in ("PASS", "WARN", "FAIL") and f["check"] == "manifest" for f in out)
    warn = aiv.finding("fabric", "WARN", "mlx5_9:1 is DOWN on node1", ["node1"])
    aiv.mark_accepted(m, [warn])
    assert aiv.manifest_problem(aiv.merge_manifests(m, saved(recs, screen=screen, findings=[warn]))) is None
    aiv.diff_manifests(m, BASE[0])
