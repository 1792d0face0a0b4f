"""The NIC by name (an HCA from NCCL's own log, else the sysfs device nearest the GPU) and NCCL's WARN
lines relayed on every way out of a rank.

The log fixtures follow NCCL's own line formats (2.4 to 2.2x: 'Channel 01 :' and 'Channel 00/0 :',
GDRDMA or no suffix, the IBext plugin, PXN's proxy rank, RoCE, merged devices)."""
import os
import time

import pytest

from conftest import aiv, rec, run_tool

P = "gpu007:24570:24907 [2] NCCL INFO "

USING_IB = P + "NET/IB : Using [0]mlx5_0:1/IB [1]mlx5_1:1/IB [2]mlx5_2:1/IB [3]mlx5_3:1/IB ; OOB ib0:10.0.0.7<0>\n"
USING_ROCE = P + "NET/IB : Using [0]mlx5_10:1/RoCE [1]mlx5_11:1/RoCE [RO]; OOB enp220s0np0:11.1.128.136<0>\n"
USING_MERGED = (P + "NET/IB : Using [0]={[0] mlx5_2:1/RoCE, [1] mlx5_3:1/RoCE} [1]={[2] mlx5_0:1/RoCE, "
                "[3] mlx5_1:1/RoCE} [RO]; OOB bond0.526:169.136.106.9<0>\n")
PREAMBLE = (P + "Bootstrap : Using ib0:10.0.0.7<0>\n" + P + "NET/Plugin : No plugin found (libnccl-net.so), "
            "using internal implementation\n" + P + "NET/Socket : Using [0]ib0:10.0.0.7<0> [1]eth0:10.1.0.7<0>\n")


def chan(idx, net="IB", tail="/GDRDMA", n=4, proxy=""):
    return "".join(f"{P}Channel {c:02d}/0 : 2[2] -> 10[2] [{d}] via NET/{net}/{idx}{proxy}{tail}\n"
                   for c in range(n) for d in ("send", "receive"))


# ------------------------------------------------------------------ NCCL's device list
@pytest.mark.parametrize("text,want", [
    (USING_IB, {0: "mlx5_0", 1: "mlx5_1", 2: "mlx5_2", 3: "mlx5_3"}),
    (USING_ROCE, {0: "mlx5_10", 1: "mlx5_11"}),
    (USING_MERGED, {0: "mlx5_2+mlx5_3", 1: "mlx5_0+mlx5_1"}),
    (P + "NET/IBext_v8 : Using [0]mlx5_0:1/IB [1]mlx5_0:2/IB [RO]; OOB ib0:10.0.0.7<0>\n",
     {0: "mlx5_0", 1: "mlx5_0:2"}),
    (PREAMBLE, {}),  # sockets and the plugin line list no HCA
    (P + "NET/Plugin: Using internal network plugin.\n" + USING_IB + P + "NET/IB : No device found.\n",
     {0: "mlx5_0", 1: "mlx5_1", 2: "mlx5_2", 3: "mlx5_3"}),
])
def test_nccl_device_list(text, want):
    assert aiv.parse_nccl_nics(PREAMBLE + text) == want


# ------------------------------------------------------------------ the HCA a rank's connections used
def test_hca_from_the_channel_lines():
    assert aiv.parse_nccl_hca(PREAMBLE + USING_IB + chan(2)) == "mlx5_2"
    # NCCL 2.4-2.7: 'Channel 01 : 2[c7000] -> 0[87000]'
    old = "".join(f"{P}Channel 0{c} : 2[c7000] -> 0[87000] [receive] via NET/IB/3/GDRDMA\n" for c in range(2))
    assert aiv.parse_nccl_hca(USING_IB + old) == "mlx5_3"
    # the IBext plugin (no GDRDMA suffix), PXN (the proxy rank in parentheses), RoCE, merged devices
    assert aiv.parse_nccl_hca(USING_IB + chan(1, net="IBext_v8", tail="")) == "mlx5_1"
    assert aiv.parse_nccl_hca(USING_IB + chan(0, proxy="(5)")) == "mlx5_0"
    assert aiv.parse_nccl_hca(USING_ROCE + chan(1)) == "mlx5_11"
    assert aiv.parse_nccl_hca(USING_MERGED + chan(1, net="IBext_v8", tail="")) == "mlx5_0+mlx5_1"


def test_hca_the_most_used_then_the_lowest_index():
    assert aiv.parse_nccl_hca(USING_IB + chan(3, n=1) + chan(1, n=3)) == "mlx5_1"
    assert aiv.parse_nccl_hca(USING_IB + chan(3, n=2) + chan(1, n=2)) == "mlx5_1"


def test_hca_of_the_latest_communicator():
    """A pair round reads the log from where the last read ended: its own communicator's NIC, not the
    world communicator's (PXN there can route through another GPU's NIC)."""
    world = USING_IB + chan(0, n=8, proxy="(3)")
    text = world + chan(2, n=2)
    assert aiv.parse_nccl_hca(text) == "mlx5_0"
    assert aiv.parse_nccl_hca(text, since=len(world)) == "mlx5_2"
    # nothing new since: the whole log
    assert aiv.parse_nccl_hca(world, since=len(world)) == "mlx5_0"


def test_no_hca_known():
    assert aiv.parse_nccl_hca("") is None
    assert aiv.parse_nccl_hca(PREAMBLE + USING_IB) is None  # no network connection (one node)
    assert aiv.parse_nccl_hca(chan(2)) is None  # the device list is missing: unknown, sysfs may say
    # sockets only although NCCL listed HCAs: no HCA carries this rank's traffic (and no sysfs guess)
    assert aiv.parse_nccl_hca(PREAMBLE + USING_IB + chan(0, net="Socket", tail="")) == ""


# ------------------------------------------------------------------ the sysfs fallback
def fake_sysfs(root, gpus, hcas):
    """gpus: {bdf: PCI path below /sys/devices}; hcas: {name: (PCI path, port state)}."""
    for bdf, path in gpus.items():
        dev = root / "sys/devices" / path
        dev.mkdir(parents=True, exist_ok=True)
        link = root / "sys/bus/pci/devices" / bdf
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(dev)
    for name, (path, state) in hcas.items():
        dev = root / "sys/devices" / path
        ib = dev / "infiniband" / name
        (ib / "ports/1").mkdir(parents=True)
        (ib / "ports/1/state").write_text(f"{4 if state == 'ACTIVE' else 1}: {state}\n")
        (ib / "ports/1/rate").write_text("400 Gb/sec (4X NDR)\n")
        (ib / "device").symlink_to(dev)
        cls = root / "sys/class/infiniband"
        cls.mkdir(parents=True, exist_ok=True)
        (cls / name).symlink_to(ib)
    return str(root)


# Two sockets; on each a root port with a PCIe switch holding a GPU and an HCA, plus an HCA on another root port.
SW0 = "pci0000:00/0000:00:01.0/0000:01:00.0"
SW1 = "pci0000:80/0000:80:01.0/0000:81:00.0"
GPUS = {"0000:03:00.0": SW0 + "/0000:02:00.0/0000:03:00.0", "0000:83:00.0": SW1 + "/0000:82:00.0/0000:83:00.0"}
HCAS = {"mlx5_0": (SW0 + "/0000:02:01.0/0000:04:00.0", "ACTIVE"),
        "mlx5_1": (SW1 + "/0000:82:01.0/0000:84:00.0", "ACTIVE"),
        "mlx5_2": ("pci0000:00/0000:00:02.0/0000:05:00.0", "ACTIVE")}


def test_nearest_hca_behind_the_gpus_switch(tmp_path):
    root = fake_sysfs(tmp_path, GPUS, HCAS)
    assert aiv.nearest_hca(root, "0000:03:00.0") == "mlx5_0"
    assert aiv.nearest_hca(root, "0000:83:00.0") == "mlx5_1"


def test_nearest_hca_active_first_then_nearer_then_lowest_name(tmp_path):
    hcas = dict(HCAS, mlx5_0=(HCAS["mlx5_0"][0], "DOWN"))
    root = fake_sysfs(tmp_path / "a", GPUS, hcas)
    assert aiv.nearest_hca(root, "0000:03:00.0") == "mlx5_2"  # same host bridge beats the other socket
    # two HCAs as near: the lowest name in natural order (mlx5_2 before mlx5_10)
    root = fake_sysfs(tmp_path / "b", GPUS, {"mlx5_10": (SW0 + "/0000:02:01.0/0000:04:00.0", "ACTIVE"),
                                             "mlx5_2": (SW0 + "/0000:02:02.0/0000:06:00.0", "ACTIVE")})
    assert aiv.nearest_hca(root, "0000:03:00.0") == "mlx5_2"


def test_nearest_hca_honours_nccl_ib_hca(tmp_path):
    root = fake_sysfs(tmp_path, GPUS, HCAS)
    assert aiv.nearest_hca(root, "0000:03:00.0", "^mlx5_0") == "mlx5_2"
    assert aiv.nearest_hca(root, "0000:03:00.0", "=mlx5_1") == "mlx5_1"


def test_no_hca_in_sysfs(tmp_path):
    """A GPU host without InfiniBand (the H200 test box), an unknown bus id, no bus id: None."""
    root = fake_sysfs(tmp_path, GPUS, {})
    assert aiv.nearest_hca(root, "0000:03:00.0") is None
    root = fake_sysfs(tmp_path / "ib", GPUS, HCAS)
    assert aiv.nearest_hca(root, "0000:99:00.0") is None
    assert aiv.nearest_hca(root, None) is None
    assert aiv.nearest_hca(str(tmp_path / "nothing"), "0000:03:00.0") is None


# ------------------------------------------------------------------ the pair rows and the findings
RAILS = [0, 1, 2, 3]
NODES = [f"node{i}" for i in range(1, 7)]


def records(sysfs=None):
    """4 ranks per node, rank = node index * 4 + local rank; gpu 'hca' the sysfs guess."""
    return [rec(i * 4 + lr, host=h, local_rank=lr, gpu={"index": lr, "hca": (sysfs or {}).get((h, lr))})
            for i, h in enumerate(NODES) for lr in RAILS]


def rank(host, rail):
    return NODES.index(host) * 4 + rail


def test_pair_hca_log_first_then_sysfs():
    recs = records({("node1", 2): "mlx5_9", ("node3", 2): "mlx5_8"})
    ranks = [rank("node1", 2), rank("node3", 2)]
    posts = {ranks[0]: {"busbw": 1.0, "hca": "mlx5_2"}, ranks[1]: {"busbw": 1.0}}
    assert aiv.screen_pair_hca(ranks, posts, recs) == {"node1": "mlx5_2", "node3": "mlx5_8"}
    # the log showed sockets: no HCA, and no sysfs guess for that rank
    posts[ranks[0]]["hca"] = ""
    assert aiv.screen_pair_hca(ranks, posts, recs) == {"node3": "mlx5_8"}
    assert aiv.screen_pair_hca(ranks, {}, records()) is None


def pair_rows(bad, hca_of):
    """Every round's pair rows as screen_loop builds them; `bad` slow on rail 2; hca_of(host, rail)."""
    rows = []
    for i, groups in enumerate(aiv.screen_rounds(NODES), 1):
        for g in groups:
            for r in RAILS:
                ranks = [rank(h, r) for h in g]
                posts = {k: {"busbw": 45.0 * (0.4 if bad in g and r == 2 else 1.0), "hca": hca_of(h, r)}
                         for k, h in zip(ranks, g, strict=True)}
                m = aiv.screen_measured([{"nodes": tuple(g), "rail": r, "ranks": ranks}], posts)[0]
                rows.append({"round": i, "nodes": m["nodes"], "rail": r, "busbw": m["busbw"],
                             "hca": aiv.screen_pair_hca(ranks, posts, records()), "ranks": ranks})
    return rows


def test_inter_node_finding_names_host_rail_and_hca():
    """A rail's HCA differs per node: node3's rail 2 is mlx5_6 (the others' mlx5_2); the finding names it,
    and so do the page's heat map caption and the JSON rows."""
    rows = pair_rows("node3", lambda h, r: "mlx5_6" if (h, r) == ("node3", 2) else f"mlx5_{r}")
    plan = aiv.screen_third_round(rows)
    for g in plan["groups"]:
        rows += [dict(m, round=3) for m in pair_rows("node3", lambda h, r: "mlx5_6" if (h, r) == ("node3", 2)
                                                     else f"mlx5_{r}") if tuple(m["nodes"]) == tuple(g)]
    findings, suspects = aiv.judge_pairs(rows)
    (f,) = [x for x in findings if x["status"] != "PASS"]
    assert f["hosts"] == ["node3"] and suspects == ["node3"]
    assert "node node3 is slow on rail 2 (HCA mlx5_6) with" in f["reason"], f["reason"]
    assert f["reason"].count("mlx5_6") == 1 and "mlx5_2" not in f["reason"]
    page = aiv._html_pairs({"pairs": rows}, ["node3"])
    assert "rail 2 (mlx5_2, mlx5_6)" in page and "rail 1 (mlx5_1)" in page


def test_no_hca_known_renders_the_rail_alone():
    """No InfiniBand (a GPU box without HCAs, gloo): 'rail 2', as before."""
    rows = pair_rows("node3", lambda h, r: None)
    assert all(m["hca"] is None for m in rows)
    plan = aiv.screen_third_round(rows)
    for g in plan["groups"]:
        rows += [dict(m, round=3) for m in pair_rows("node3", lambda h, r: None) if tuple(m["nodes"]) == tuple(g)]
    (f,) = [x for x in aiv.judge_pairs(rows)[0] if x["status"] != "PASS"]
    assert "node node3 is slow on rail 2 with" in f["reason"] and "HCA" not in f["reason"]
    page = aiv._html_pairs({"pairs": rows}, ["node3"])
    assert "rail 2: reference" in page


def test_slow_link_names_both_ends_hcas():
    rows = pair_rows("none", lambda h, r: "mlx5_7" if (h, r) == ("node5", 1) else f"mlx5_{r}")
    text = aiv._screen_hca_text(rows, [i for i, m in enumerate(rows) if m["rail"] == 1
                                       and set(m["nodes"]) == {"node1", "node5"}], ["node1", "node5"])
    assert text == " (HCA node1 mlx5_1, node5 mlx5_7)"
    assert aiv._screen_hca_text(rows, [0], list(rows[0]["nodes"])) == " (HCA mlx5_0)"


# ------------------------------------------------------------------ NCCL WARN lines at exit
WARNS = [f"gpu007:24570:24907 [0] transport/net_ib.cc:{800 + i} NCCL WARN NET/IB : Got completion from peer "
         f"10.0.0.{i}<55921> with status=12 opcode=1 len=0 vendor err 129 (Send)" for i in range(25)]


def test_warn_lines_bounded():
    text = "\n".join(PREAMBLE.splitlines() + WARNS[:3] + [P + "comm 0x1 rank 0 nranks 2"] + WARNS[3:])
    lines, more = aiv.nccl_warn_lines(text)
    assert lines == WARNS[:20] and more == 5
    assert aiv.nccl_warn_lines(PREAMBLE) == ([], 0)


def test_operator_debug_file_expanded():
    env = {"NCCL_DEBUG_FILE": "/scratch/nccl.%h.%p.log"}
    assert aiv.nccl_debug_file(env, "gpu007.cluster.local", 4242) == "/scratch/nccl.gpu007.4242.log"
    assert aiv.nccl_debug_file({"NCCL_DEBUG_FILE": "/x/100%%.log"}, "h", 1) == "/x/100%.log"
    assert aiv.nccl_debug_file({}) is None


@pytest.mark.parametrize("failpoint,code", [("raise:init:1", aiv.EXIT_INTERNAL), ("", aiv.EXIT_PASS)])
def test_warn_lines_relayed_at_exit(tmp_path, failpoint, code):
    """A real gloo run that fails before the collectives (the tool's own error in init, rank 1), and one
    that passes: each rank relays the WARN lines of its NCCL log (here the operator's NCCL_DEBUG_FILE, a
    prepared file) to stderr as it exits, the first 20, then how many were left out; once."""
    log = tmp_path / "nccl.log"
    log.write_text("\n".join(PREAMBLE.splitlines() + WARNS) + "\n")
    t = time.monotonic()
    p = run_tool(["--nproc", 2, "--skip-screen", "--timeout", 30],
                 env={"NCCL_DEBUG_FILE": str(log), "AIV_FAILPOINT": failpoint}, timeout=120)
    # the failed run's exact code is not the point here (on a loaded machine liveness may read it as TIMEOUT)
    assert (p.returncode == code) if code == aiv.EXIT_PASS else p.returncode not in (aiv.EXIT_PASS, aiv.EXIT_USAGE), \
        p.stdout + p.stderr
    for r in (0, 1):
        got = [ln for ln in p.stderr.splitlines() if ln.startswith(f"rank {r} (") and " NCCL WARN " in ln]
        assert [ln.split("): ", 1)[1] for ln in got] == WARNS[:20], p.stderr
        assert sum(f"rank {r} (" in ln and "5 more of NCCL's WARN lines not shown" in ln
                   for ln in p.stderr.splitlines()) == 1, p.stderr
    assert time.monotonic() - t < 60
    assert os.path.exists(log)  # the operator's file is only read
