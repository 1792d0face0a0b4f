"""Every judge function on plain data: a passing and a failing case each."""
import os

import pytest

from conftest import aiv, cluster, gpu, rec


def statuses(findings):
    return sorted({f["status"] for f in findings})


def test_world_size():
    assert statuses(aiv.judge_world_size(4, {"world_size": 4})) == ["PASS"]
    (f,) = aiv.judge_world_size(4, {"world_size": 8})
    assert f["status"] == "FAIL" and "WORLD_SIZE=4" in f["reason"] and "8" in f["reason"]
    assert statuses(aiv.judge_world_size(4, {})) == ["PASS"]


def test_layout_pass():
    assert statuses(aiv.judge_layout(cluster(2, 4), {"nodes": 2, "ranks_per_node": 4})) == ["PASS"]


def test_layout_wrong_ranks_per_node_names_node():
    out = aiv.judge_layout(cluster(2, 2), {"nodes": 2, "ranks_per_node": 3})
    fails = [f for f in out if f["status"] == "FAIL"]
    assert len(fails) == 2 and "node node1 runs 2 ranks but 3 per node" in fails[0]["reason"]
    # how the launcher placed the ranks is not a node's fault: named in the words, not blamed
    assert (fails[0]["hosts"], fails[0]["involved"], fails[0]["blame"]) == ([], ["node1"], "launch")
    assert "no host is named" in fails[0]["reason"]


def test_layout_wrong_node_count():
    out = aiv.judge_layout(cluster(3, 2), {"nodes": 2})
    assert any(f["status"] == "FAIL" and "3 node(s) reported (node[1-3]) but 2" in f["reason"] for f in out)


def test_layout_duplicate_and_missing_local_rank():
    recs = [rec(0, "n1", 0), rec(1, "n1", 0), rec(2, "n2", 0), rec(3, "n2", 2)]
    out = [f for f in aiv.judge_layout(recs, {}) if f["status"] == "FAIL"]
    assert {f["involved"][0] for f in out} == {"n1", "n2"} and all(not f["hosts"] for f in out)
    assert "duplicate 0" in out[0]["reason"] and "missing 1" in out[0]["reason"] + out[1]["reason"]


def test_gpu_affinity_shared_uuid_names_both_ranks_and_gpu():
    recs = [rec(0, "n1", 0, gpu=gpu("GPU-aaa", index=0)), rec(1, "n1", 1, gpu=gpu("GPU-aaa", index=0)),
            rec(2, "n2", 0, gpu=gpu("GPU-bbb"))]
    (f,) = [f for f in aiv.judge_gpu_affinity(recs) if f["status"] == "FAIL"]
    assert "rank 0 (n1) and rank 1 (n1)" in f["reason"] and "GPU-aaa" in f["reason"]
    assert f["ranks"] == [0, 1]


def test_gpu_affinity_uuid_is_global_across_hosts():
    recs = [rec(0, "n1", 0, gpu=gpu("GPU-same")), rec(1, "n2", 0, gpu=gpu("GPU-same"))]
    assert statuses(aiv.judge_gpu_affinity(recs)) == ["FAIL"]


def test_gpu_affinity_pass_and_cpu_only():
    assert statuses(aiv.judge_gpu_affinity(cluster(2, 2, with_gpu=True))) == ["PASS"]
    assert aiv.judge_gpu_affinity(cluster(2, 2)) == []


def test_numa_warns_when_affinity_excludes_gpu_node():
    ok = rec(0, gpu=gpu("G0", numa=0, numa_cpus="0-47"), cpus="0-11")
    bad = rec(1, local_rank=1, gpu=gpu("G1", numa=1, numa_cpus="48-95"), cpus="0-11")
    assert aiv.judge_numa([ok]) == []
    (f,) = aiv.judge_numa([ok, bad])
    assert f["status"] == "WARN" and "rank 1" in f["reason"] and "NUMA node 1" in f["reason"]


def test_versions_identical_pass():
    assert statuses(aiv.judge_versions(cluster(2, 2))) == ["PASS"]


def test_versions_drift_fails_naming_nodes():
    recs = cluster(2, 2)
    for r in recs[2:]:
        r["versions"] = dict(r["versions"], torch="2.14.1")
    out = aiv.judge_versions(recs)
    (f,) = [f for f in out if f["status"] == "FAIL"]
    assert "torch differs across nodes: 2.13.0 on node1; 2.14.1 on node2" in f["reason"]


def test_driver_drift_fails_kernel_drift_warns():
    recs = cluster(2, 1)
    recs[1]["node"] = dict(recs[1]["node"], driver="570.0", kernel="6.8.0")
    out = aiv.judge_versions(recs)
    assert any(f["status"] == "FAIL" and "driver differs" in f["reason"] for f in out)
    assert any(f["status"] == "WARN" and "kernel differs" in f["reason"] for f in out)


def test_imports_broken_is_a_warning():
    recs = cluster(1, 1)
    recs[0]["node"]["imports"]["torchaudio"] = {"ok": False, "version": None,
                                                "error": "OSError: undefined symbol: _ZN3c10"}
    (f,) = aiv.judge_imports(recs)
    assert f["status"] == "WARN" and "torchaudio does not import on node1" in f["reason"]
    assert aiv.judge_imports(cluster(1, 1)) == []


def ib(port, state="ACTIVE", rate=400.0):
    return {"port": port, "state": state, "rate_gbps": rate, "link_layer": "InfiniBand"}


def ib_cluster(ports_by_node):
    recs = cluster(len(ports_by_node), 1)
    for r, ports in zip(recs, ports_by_node, strict=True):
        r["node"]["ib"] = ports
    return recs


def test_fabric_pass():
    recs = ib_cluster([[ib("mlx5_0:1"), ib("mlx5_1:1")], [ib("mlx5_0:1"), ib("mlx5_1:1")]])
    assert statuses(aiv.judge_fabric(recs)) == ["PASS"]
    assert statuses(aiv.judge_fabric(cluster(2, 1))) == ["PASS"]       # sockets only


def test_fabric_down_and_slow_ports_warn():
    recs = ib_cluster([[ib("mlx5_0:1"), ib("mlx5_1:1", state="DOWN")], [ib("mlx5_0:1"), ib("mlx5_1:1", rate=200)]])
    reasons = [f["reason"] for f in aiv.judge_fabric(recs) if f["status"] == "WARN"]
    assert "node1 mlx5_1:1 is DOWN" in reasons
    assert any("node2 mlx5_1:1 runs at 200 Gb/s, below 400 Gb/s of its sibling" in r for r in reasons)


def test_fabric_slower_than_the_job():
    """A node whose ports run slower than a strict majority of the nodes' is named; with two nodes (a tie)
    the rates are said, and no host is named."""
    recs = ib_cluster([[ib("mlx5_0:1")], [ib("mlx5_0:1", rate=100)], [ib("mlx5_0:1")]])
    (f,) = aiv.judge_fabric(recs)
    assert f["status"] == "WARN" and "rate differs across nodes: 100 Gb/s on node2; 400 Gb/s on node[1,3]" \
        in f["reason"], f
    assert (f["hosts"], f["blame"]) == (["node2"], "majority")
    (f,) = aiv.judge_fabric(recs[:2])
    assert f["status"] == "WARN" and (f["hosts"], f["blame"], f["involved"]) == ([], "tie", ["node1", "node2"])


def test_fabric_honours_nccl_ib_hca():
    recs = ib_cluster([[ib("mlx5_0:1"), ib("mlx5_9:1", state="DOWN")]])
    assert statuses(aiv.judge_fabric(recs, "mlx5_0")) == ["PASS"]
    assert statuses(aiv.judge_fabric(recs, "^mlx5_9")) == ["PASS"]
    assert statuses(aiv.judge_fabric(recs, "=mlx5_9:1")) == ["WARN"]


def test_day0_basics():
    recs = cluster(1, 2, with_gpu=True)
    assert aiv.judge_day0(recs) == []
    n = recs[0]["node"]
    n.update(ib=[ib("mlx5_0:1")], memlock=64 << 10, shm=64 << 20, peermem=False)
    recs[1]["gpu"]["mem_used"] = 30 << 30
    reasons = " | ".join(f["reason"] for f in aiv.judge_day0(recs))
    for needle in ("locked-memory limit", "/dev/shm is 64.0MiB", "nvidia_peermem is not loaded",
                   "30.0GiB of GPU"):
        assert needle in reasons


def test_local_findings_pass_through_and_backend_mix():
    recs = cluster(2, 1)
    recs[1]["local"] = [aiv.finding("interface", "FAIL", "GLOO_SOCKET_IFNAME='eth9' ... on node2", ["node2"])]
    (f,) = aiv.judge_local(recs)
    assert f["hosts"] == ["node2"]
    recs[1]["backend"] = "nccl"
    (b,) = aiv.judge_device_use(recs)
    assert b["status"] == "FAIL" and "different backends" in b["reason"]


def test_gloo_asked_on_gpu_nodes_says_gpus_were_not_exercised():
    recs = cluster(2, 1)
    for r in recs:
        r["gpus_expected"] = "CUDA_VISIBLE_DEVICES=0"
    (b,) = aiv.judge_device_use(recs)
    assert b["status"] == "PASS" and "not exercised" in b["reason"] and "node[1-2]" in b["reason"]


def test_finding_refuses_a_check_name_outside_checks():
    with pytest.raises(ValueError, match="not in CHECKS"):
        aiv.finding("judge", "FAIL", "x")


def test_collectives_exact_and_gradients():
    good = [{"rank": r, "host": "n1", "ar_ok": True, "ar_sum": 10, "loss": 1.0, "grads": [0.5, 0.25]}
            for r in range(4)]
    assert statuses(aiv.judge_collectives(good, 4)) == ["PASS"]
    bad = [dict(g) for g in good]
    bad[2]["ar_sum"] = 9
    bad[3]["grads"] = [0.5, 0.2500001]
    out = {f["check"]: f for f in aiv.judge_collectives(bad, 4)}
    assert out["collective"]["status"] == "FAIL" and out["collective"]["ranks"] == [2]
    assert out["ddp"]["status"] == "FAIL" and out["ddp"]["ranks"] == [3]


def test_strict_turns_warn_into_fail_and_codes():
    fs = [aiv.finding("day0", "WARN", "x"), aiv.finding("layout", "PASS", "y")]
    assert aiv.verdict_code(fs) == 0
    assert aiv.verdict_code(aiv.apply_strict(fs, True)) == 1
    assert aiv.verdict_code([aiv.finding("rendezvous", "FAIL", "z", code=3), aiv.finding("layout", "FAIL", "b")]) == 3


def test_judge_all_on_a_healthy_cluster_has_no_fail():
    recs = cluster(2, 4, with_gpu=True)
    out = aiv.judge_all(recs, 8, {"world_size": 8, "nodes": 2, "ranks_per_node": 4})
    assert aiv.verdict_code(out) == 0


def test_ib_ports_from_a_fake_sysfs_tree(tmp_path):
    for dev, port, state, rate in [("mlx5_0", "1", "4: ACTIVE", "400 Gb/sec (4X NDR)"),
                                   ("mlx5_1", "1", "1: DOWN", "10 Gb/sec (4X SDR)")]:
        d = tmp_path / "sys/class/infiniband" / dev / "ports" / port
        os.makedirs(d)
        (d / "state").write_text(state + "\n")
        (d / "rate").write_text(rate + "\n")
        (d / "link_layer").write_text("InfiniBand\n")
    ports = aiv.read_ib_ports(str(tmp_path))
    assert ports == [ib("mlx5_0:1"), ib("mlx5_1:1", state="DOWN", rate=10.0)]
    assert aiv.read_ib_ports(str(tmp_path / "nothing")) == []


NCCL_LOG = """\
node1:1234:1300 [0] NCCL INFO Using network Socket
node1:1234:1300 [0] NCCL INFO Channel 00/0 : 0[0] -> 1[1] via P2P/CUMEM/read
node1:1234:1300 [0] NCCL INFO Channel 01/0 : 1[1] -> 2[0] [send] via NET/Socket/0
node1:1234:1300 [0] NCCL INFO Channel 01/0 : 3[1] -> 0[0] [receive] via NET/IB/0/GDRDMA
"""


def test_parse_nccl_transport_and_interfaces():
    kinds = aiv.parse_nccl_transport(NCCL_LOG)
    assert kinds == ["NET/IB", "NET/Socket", "P2P"]
    assert aiv.parse_nccl_transport("NCCL INFO Bootstrap : Using eth0") == []
    text = ("node1:1:1 [0] NCCL INFO Bootstrap : Using eth0:10.77.0.11<0>\n"
            "node1:1:1 [0] NCCL INFO NET/Socket : Using [0]eth0:10.77.0.11<0> [1]ib0:10.8.0.1<0>\n")
    assert aiv.parse_nccl_ifaces(text) == ["eth0:10.77.0.11", "ib0:10.8.0.1"]


def test_transport_socket_fallback_with_active_ib_fails():
    recs = ib_cluster([[ib("mlx5_0:1")], [ib("mlx5_0:1")]])
    for r in recs:
        r["transport"] = ["NET/Socket", "P2P"]
    (f, g) = aiv.judge_transport(recs)
    assert f["status"] == "FAIL" and "node1: NCCL used NET/Socket" in f["reason"] and "mlx5_0:1" in f["reason"]
    assert aiv.verdict_code(aiv.judge_transport(recs, ib_disable="1")) == 0       # sockets on purpose
    for r in recs:
        r["transport"] = ["NET/IB", "P2P"]
    (p,) = aiv.judge_transport(recs)
    assert p["status"] == "PASS" and "NET/IB+P2P on node[1-2]" in p["reason"]


def test_transport_sockets_without_ib_pass_and_unknown_is_silent():
    recs = cluster(2, 1)
    assert aiv.judge_transport(recs) == []
    for r in recs:
        r["transport"] = ["NET/Socket"]
    assert statuses(aiv.judge_transport(recs)) == ["PASS"]


def test_bandwidth_threshold():
    res = [{"bytes": 1 << 20, "busbw": 20.0}, {"bytes": 1 << 30, "busbw": 320.0}]
    assert statuses(aiv.judge_bandwidth(res, 300)) == ["PASS"]
    (f,) = aiv.judge_bandwidth(res, 400)
    assert f["status"] == "FAIL" and "320.0 GB/s at 1.0GiB is below --min-busbw 400" in f["reason"]
    assert aiv.judge_bandwidth([], 1) == []
