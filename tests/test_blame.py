"""The blame law (aiv/core/blame.py): a host is named only on evidence that singles it out, whatever judge found
it. The declarations and the gate on plain data; a property test over the judges with faults planted in
generated healthy clusters of 1-64 nodes (one host, several, rank 0's own, a tie, facts not collected): no
healthy host is ever named, and every planted host is named or its finding says it could not be localised;
and real runs, one rank per simulated node, with other software on one node of two and of three."""
import json
import subprocess
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import aiv, clean_env, describe, failures, finish, free_port, gpu, rec, tool_ranks

SOFTWARE = str(Path(__file__).resolve().parent / "software")


# ---------------------------------------------------------------------------- declarations and the gate
def test_every_check_declares_its_blame_and_a_drain_says_why_it_persists():
    assert set(aiv.CHECK_RULES) == set(aiv.CHECKS)
    for check, r in aiv.CHECK_RULES.items():
        assert set(r["names"]) <= set(aiv.LOCALISING), check
        assert set(r["drain"]) <= set(r["names"]), check
        assert not r["drain"] or len(r["why"]) > 40, f"{check}: a drain must say why its evidence persists"
    with pytest.raises(ValueError):
        aiv.rule(("persisted",), ("persisted",))            # a drain without why
    with pytest.raises(ValueError):
        aiv.rule(("once",))                                  # not evidence that names a host
    assert not set(aiv.LOCALISING) & set(aiv.UNLOCALISED)


def test_the_gate_keeps_hosts_only_on_declared_evidence():
    named = aiv.finding("versions", "FAIL", "torch differs", ["n2"], blame="majority")
    bare = aiv.finding("versions", "FAIL", "torch differs", ["n2"])                  # no evidence said
    wrong = aiv.finding("layout", "FAIL", "odd layout", ["n2"], blame="own")         # layout names no host
    tie = aiv.finding("versions", "FAIL", "torch differs", ["n1", "n2"], blame="tie")
    ok = aiv.finding("versions", "PASS", "same", ["n1", "n2"])
    out = aiv.blame_gate([named, bare, wrong, tie, ok])
    assert [f["hosts"] for f in out] == [["n2"], [], [], [], ["n1", "n2"]]
    assert [f.get("blame") for f in out] == ["majority", "undeclared", "undeclared", "tie", None]
    for f in out[1:4]:
        assert f["involved"] and "no host is named" in f["reason"] and f["unlocalised"]["localise"]
    assert aiv.blamed_hosts(out) == ["n2"]
    assert [aiv.drainable(f) for f in out] == [True, False, False, False, False]
    tamper = dict(aiv.finding("rendezvous", "FAIL", "forged"), tamper=True)
    assert aiv.blamed_hosts(aiv.blame_gate(out + [tamper])) == []  # evidence through a forged store blames nobody


def test_majorities():
    assert aiv.odd_ones({"a": [1, 2, 3], "b": [4]}) == ([4], "majority")
    assert aiv.odd_ones({"a": [1, 2], "b": [3, 4]}) == ([1, 2, 3, 4], "tie")
    assert aiv.odd_ones({"a": [1, 2], "b": [3], "c": [4]}) == ([1, 2, 3, 4], "tie")  # 2 of 4 is no strict majority
    assert aiv.odd_ones({"a": [1]}) == ([], None)
    assert [aiv.minority_kind(set(range(b)), set(range(4))) for b in (1, 2, 3, 4)] == [
        "majority", "tie", "everyone", "everyone"]


# ---------------------------------------------------------------------------- the property test
def healthy(nodes, per_node):
    """A healthy GPU cluster: records (node facts on local rank 0), DDP results, and the GPU screen's rows."""
    records, results, rows = [], [], []
    for n in range(nodes):
        for lr in range(per_node):
            r = n * per_node + lr
            g = gpu(f"GPU-{n}-{lr}", pci=f"0000:{lr:02x}:00.0", index=lr)
            x = rec(r, host=f"node{n + 1}", local_rank=lr, gpu=g, node=(lr == 0))
            x["numerics"] = {"software": {"torch": "2.13.0", "sms": 132, "cc": "9.0", "cuda": "12.8",
                                          "cublas": 1, "env": {}},
                             "checks": {c: {"digest": "d0", "off": False, "err": 1e-3, "tol": 4e-2, "abs": 0.1,
                                            "rel": 1e-3, "at": [1, 2], "value": 1.0, "ref": 1.0}
                                        for c in ("matmul-bf16", "matmul-fp32")}}
            records.append(x)
            results.append({"rank": r, "host": x["host"], "ar_ok": True,
                            "ar_sum": nodes * per_node * (nodes * per_node + 1) // 2, "grads": "g0"})
            rows.append({"rank": r, "host": x["host"], "local_rank": lr, "uuid": g["uuid"], "model": g["name"],
                         "tflops": 680.0, "hbm_gbps": 4200.0, "tries": 1})
    return records, results, rows


def plant(kind, hosts, records, results, rows, tries):
    """Plant `kind` on every rank of `hosts` (local rank 0 only for what is per GPU). -> the class it is judged in
    (its members): ranks for what is judged per rank, hosts for what is judged per node."""
    first = {x["rank"] for x in records if x["host"] in hosts and x["local_rank"] == 0}
    if kind == "versions":
        for x in records:
            if x["host"] in hosts:
                x["versions"] = dict(x["versions"], torch="2.12.0")
    elif kind == "numerics":  # each corrupt GPU computes its own wrong bits, within the tolerance
        for x in records:
            if x["rank"] in first:
                x["numerics"]["checks"]["matmul-bf16"] = dict(x["numerics"]["checks"]["matmul-bf16"],
                                                              digest=f"bad{x['rank']}")
    elif kind == "numerics-off":
        for x in records:
            if x["rank"] in first:
                x["numerics"]["checks"]["matmul-fp32"] = dict(x["numerics"]["checks"]["matmul-fp32"], off=True,
                                                              err=1.0, digest=f"off{x['rank']}")
    elif kind == "collective":
        for res in results:
            if res["rank"] in first:
                res["ar_sum"] -= 1
    elif kind == "ddp":
        for res in results:
            if res["rank"] in first:
                res["grads"] = f"bad{res['rank']}"
    elif kind == "gpu-slow":
        for row in rows:
            if row["rank"] in first:
                row.update(tflops=300.0, tries=tries, first={"tflops": 290.0, "hbm_gbps": 4200.0})
    elif kind == "facts-missing":
        for x in records:
            if x["host"] in hosts and x.get("node"):
                x["node"] = {"error": "not collected in time"}
    elif kind == "affinity":
        for x in records:
            if x["host"] in hosts and x["local_rank"] == 1:  # bound to its node's GPU 0 as well
                x["gpu"] = dict(x["gpu"], uuid=x["gpu"]["uuid"].rsplit("-", 1)[0] + "-0")
    per_node = kind in ("versions", "facts-missing", "affinity")
    return {x["host"] for x in records} if per_node else {x["rank"] for x in records}, first


KINDS = ("versions", "numerics", "numerics-off", "collective", "ddp", "gpu-slow", "facts-missing", "affinity")


@st.composite
def planted_clusters(draw):
    nodes = draw(st.integers(1, 64))
    per_node = draw(st.integers(2 if nodes == 1 else 1, 4))
    kind = draw(st.sampled_from(KINDS))
    if kind == "affinity" and per_node < 2:
        per_node = 2
    shape = draw(st.sampled_from(("one", "rank0", "several", "tie")))
    names = [f"node{n + 1}" for n in range(nodes)]
    if shape == "one":
        hosts = {draw(st.sampled_from(names))}
    elif shape == "rank0":
        hosts = {"node1"}
    elif shape == "several":
        hosts = set(draw(st.lists(st.sampled_from(names), min_size=1, max_size=max(1, (nodes - 1) // 2),
                                  unique=True)))
    else:
        hosts = set(names[:max(1, nodes // 2)])
    return nodes, per_node, kind, hosts, draw(st.sampled_from((1, 2)))


def judge_everything(records, results, rows, world):
    host_of = {x["rank"]: x["host"] for x in records}
    expect = {"world_size": world, "nodes": len(set(host_of.values())), "ranks_per_node": world // len(set(
        host_of.values()))}
    screen = {"cpu": False, "gpu": rows, "intra": [], "pairs": []}
    found = (aiv.judge_all(records, world, expect, results=results) + aiv.judge_ddp_grads(records, results)
             + aiv.judge_screen(screen))
    return aiv.blame_gate(found, set(host_of.values()))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(planted_clusters())
def test_no_healthy_host_is_ever_named_and_every_planted_host_is_named_or_said_unlocalised(case):
    nodes, per_node, kind, hosts, tries = case
    records, results, rows = healthy(nodes, per_node)
    members, planted_ranks = plant(kind, hosts, records, results, rows, tries)
    found = judge_everything(records, results, rows, nodes * per_node)
    named = set(aiv.blamed_hosts(found))
    assert named <= hosts, (kind, sorted(named - hosts), [f["reason"] for f in found if f["status"] != "PASS"])
    unseen = kind == "versions" and len(hosts) == nodes  # the same software everywhere: nothing differs
    assert aiv.verdict_code(found) != aiv.EXIT_PASS or kind == "facts-missing" or unseen, found
    for h in hosts - named:  # not named: a WARN or FAIL says it could not be localised (naming h, or nobody)
        says = [f for f in found if f["status"] != "PASS" and f.get("unlocalised")
                and (h in f.get("involved", []) or not f.get("involved"))]
        assert says or unseen, (kind, h, found)
    # what must be named: a strict minority of its class, on evidence that persists
    planted = hosts if kind in ("versions", "affinity") else planted_ranks
    minority = 2 * len(planted) < len(members)
    if kind == "gpu-slow":  # against its model's table row, measured again; every GPU of 2+ nodes: shared
        minority = tries >= 2 and (nodes == 1 or len(planted_ranks) < nodes * per_node)
    if kind == "numerics-off":  # off the reference its healthy peers meet
        minority = len(planted_ranks) < nodes * per_node
    if kind == "facts-missing":
        assert named == set()
    elif minority and not unseen:
        assert named == hosts, (kind, sorted(hosts), sorted(named), [f["reason"] for f in found])


def test_a_two_node_tie_names_neither_and_says_what_would_localise_it():
    records, results, rows = healthy(2, 1)
    plant("versions", {"node2"}, records, results, rows, 1)
    (f,) = [f for f in judge_everything(records, results, rows, 2) if f["status"] == "FAIL"]
    assert f["check"] == "versions" and f["hosts"] == [] and f["involved"] == ["node1", "node2"]
    assert f["blame"] == "tie" and "manifest" in f["unlocalised"]["localise"]
    assert "torch differs across nodes: 2.12.0 on node2; 2.13.0 on node1; no host is named" in f["reason"]


def test_ddp_gradients_are_judged_against_the_majority_not_rank_0():
    """Rank 0 odd: rank 0's host alone is named, never every other rank's."""
    records, results, rows = healthy(4, 1)
    results[0]["grads"] = "odd"
    (f,) = [f for f in aiv.judge_collectives(results, 4) if f["check"] == "ddp"]
    assert (f["status"], f["hosts"], f["ranks"]) == ("FAIL", ["node1"], [0])


def test_facts_not_collected_are_said_and_never_compared_as_none():
    records, results, rows = healthy(3, 1)
    records[2]["node"] = {"error": "not collected in time"}
    found = aiv.blame_gate(aiv.judge_versions(records))
    assert not any("None" in f["reason"] for f in found), found
    (w,) = [f for f in found if f["status"] == "WARN"]
    assert w["hosts"] == [] and w["involved"] == ["node3"] and "not collected" in w["reason"]
    assert [f["status"] for f in found] == ["PASS", "WARN"] and "2 of 3 node(s) compared" in found[0]["reason"]


# ---------------------------------------------------------------------------- real runs
def run_nodes(tmp_path, world, per_rank=None, args=()):
    """One rank per simulated node (SLURMD_NODENAME n0, n1, ...), srun-style environment, gloo on loopback."""
    port = free_port()
    envs = [clean_env({"RANK": r, "LOCAL_RANK": 0, "WORLD_SIZE": world, "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": port, "SLURMD_NODENAME": f"n{r}", "AIV_JSON": tmp_path / "v.json",
                       **(per_rank or {}).get(r, {})}) for r in range(world)]
    procs = tool_ranks(envs, ["--skip-screen", *args], text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    out = finish(procs, 240)
    return out, json.loads((tmp_path / "v.json").read_text())


@pytest.mark.parametrize("world, expect", [(2, []), (3, ["n1"])])
def test_other_software_on_one_node_names_it_only_against_a_majority(tmp_path, world, expect):
    """Another torch on n1 (tests/software on its PYTHONPATH): of two nodes a tie, FAIL naming no host; of three,
    n1 alone. The FAILURE line, the exit code and the JSON agree."""
    out, v = run_nodes(tmp_path, world, {1: {"PYTHONPATH": SOFTWARE}})
    assert out[0][0] == aiv.EXIT_FAIL, describe(out)
    (line,) = [ln for ln in failures(out[0][1]) if ln.startswith("FAILURE: versions:")]
    assert "torch differs across nodes: 2.12.0 on n1;" in line, line
    assert (v["exit_code"], v["failed_hosts"], v["exclude"]) == (aiv.EXIT_FAIL, expect, ",".join(expect)), v
    (f,) = [f for f in v["findings"] if f["check"] == "versions" and f["status"] == "FAIL"]
    if expect:
        assert f["blame"] == "majority" and "no host is named" not in line
    else:
        assert f["blame"] == "tie" and f["involved"] == ["n0", "n1"] and "no host is named" in line


def test_a_healthy_run_names_nobody(tmp_path):
    out, v = run_nodes(tmp_path, 3)
    assert out[0][0] == aiv.EXIT_PASS and aiv.SUCCESS_LINE in out[0][1], describe(out)
    assert (v["failed_hosts"], v["exclude"]) == ([], "") and not failures(out[0][1])


def test_the_docs_say_what_the_code_declares():
    """checks.md's table of whom each check names and drains is CHECK_RULES; design.md's evidence table is
    LOCALISING; every UNLOCALISED kind is named in design.md."""
    root = Path(__file__).resolve().parent.parent
    checks = (root / "docs" / "checks.md").read_text()
    section = checks[checks.index("## Whom a FAIL names"):checks.index("## When it fails")]
    rows = {}
    for ln in section.splitlines():
        cells = [c.strip() for c in ln.strip("|").split("|")]
        if ln.startswith("| `") and len(cells) == 3:
            rows[cells[0].strip("`")] = cells[1:]

    def kinds(cell):
        return tuple(k.strip().strip("`") for k in cell.split(",")) if cell.startswith("`") else ()
    assert list(rows) == list(aiv.CHECKS)
    for check, (names, drain) in rows.items():
        assert (kinds(names), kinds(drain)) == (aiv.CHECK_RULES[check]["names"], aiv.CHECK_RULES[check]["drain"]), check
    design = (root / "docs" / "design.md").read_text()
    table = [ln.split("|")[1].strip().strip("`") for ln in design.splitlines() if ln.startswith("| `")]
    assert [k for k in table if k in aiv.EVIDENCE] == list(aiv.LOCALISING)
    assert all(f"(`{k}`" in design or f"`{k}`" in design for k in aiv.UNLOCALISED if k != "undeclared")
