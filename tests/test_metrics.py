"""The run's verdict as Prometheus text (render_metrics) and its atomic write (write_text_atomic)."""
import json
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from conftest import aiv

render_metrics, write_metrics_atomic = aiv.render_metrics, aiv.write_text_atomic

ROOT = Path(__file__).resolve().parent.parent
LABELS = {"node", "gpu", "uuid", "rail", "check", "phase"}
RAILS = (0, 1)
NODES = ["node1", "node2", "node3", "node4"]
SLOW = "node3"
JOB = "4242424"
HOSTILE = 'rack"7\\gpu\n01'  # a host name with a double quote, a backslash and a newline


def _pairs(nodes, slow):
    """The inter-node rows as the runtime measures them: the schedule's rounds, then round 3 if asked for."""
    def measure(rnd, groups):
        return [{"round": rnd, "nodes": list(g), "rail": r, "busbw": 10.0 if slow in g else 40.0 + r,
                 "hca": f"mlx5_{r}"} for g in groups for r in RAILS]
    rows = [m for i, groups in enumerate(aiv.screen_rounds(nodes), 1) for m in measure(i, groups)]
    return rows + measure(3, aiv.screen_third_round(rows)["groups"] or [])


def cluster_state(nodes=NODES, slow=SLOW, per_node=2):
    """A 4 x 2 run's JSON state with the screen: node `slow` slow with every partner between nodes."""
    ranks = [{"host": h, "rank": i * per_node + k, "local_rank": k, "gpu": {"uuid": f"GPU-{i}-{k}"}}
             for i, h in enumerate(nodes) for k in range(per_node)]
    screen = {"cpu": False, "gpu": [{"rank": r["rank"], "host": r["host"], "local_rank": r["local_rank"],
                                     "uuid": r["gpu"]["uuid"], "model": "NVIDIA H200",
                                     "tflops": 680.0 + r["rank"], "hbm_gbps": 4200.0, "temp_c": 40.0}
                                    for r in ranks],
              "intra": [{"host": h, "busbw": 300.0, "ranks": [r["rank"] for r in ranks if r["host"] == h],
                         "model": "NVIDIA H200"} for h in nodes],
              "pairs": _pairs(nodes, slow)}
    findings = [aiv.finding("world-size", "PASS", "as expected")] + aiv.judge_screen(screen)
    failed = sorted({h for f in findings if f["status"] == "FAIL" for h in f["hosts"]})
    code = aiv.verdict_code(findings)
    state = {"verdict": "FAIL" if code else "PASS", "exit_code": code, "started_at": "2026-12-02T17:12:11+00:00",
             "elapsed_s": 42.5, "phases": {p: 0.5 for p in aiv.PHASES} | {"import_torch": 2.0},
             "world_size": len(ranks), "ranks": ranks, "findings": findings, "failed_hosts": failed,
             "screen": screen, "collectives": {"ranks": len(ranks)},
             "drain": aiv.drain_plan(findings, "recommend", len(nodes), JOB)}
    return json.loads(json.dumps(state))  # as the JSON holds it: tuples become lists


def families(text):
    """{name: {frozenset(labels.items()): value}}, checking that each family's samples carry its name."""
    out = {}
    for fam in text_string_to_metric_families(text):
        assert fam.type == "gauge" and fam.documentation
        for s in fam.samples:
            assert s.name == fam.name
            key = frozenset(s.labels.items())
            assert key not in out.setdefault(fam.name, {}), f"repeated series {s}"
            out[fam.name][key] = s.value
    return out


def one(fams, name, **labels):
    return fams[name][frozenset((k, str(v)) for k, v in labels.items())]


def check_shape(text):
    """HELP and TYPE once per family, before its samples; only the allowed labels; a final newline; no NaN."""
    assert text.endswith("\n") and not text.endswith("\n\n")
    names = [ln.split()[2] for ln in text.splitlines() if ln.startswith("# HELP ")]
    types = [ln.split()[2] for ln in text.splitlines() if ln.startswith("# TYPE ")]
    assert names == types and len(set(names)) == len(names) and all(n.startswith("aiv_") for n in names)
    assert "nan" not in text.lower().replace("screen", "")
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            assert set(s.labels) <= LABELS, s
    return families(text)


def promtool(text):
    tool = shutil.which("promtool")
    if tool is None:
        if os.environ.get("CI") == "true":
            pytest.fail("promtool missing on CI (apt-get install prometheus)")
        pytest.skip("promtool not installed (Debian package prometheus)")
    p = subprocess.run([tool, "check", "metrics"], input=text, text=True, capture_output=True, timeout=60)
    assert p.returncode == 0, p.stdout + p.stderr
    assert not (p.stdout + p.stderr).strip(), p.stdout + p.stderr  # no lint complaint either


# ------------------------------------------------------------------ render
def test_four_nodes_values():
    state = cluster_state()
    fams = check_shape(render_metrics(state))
    assert state["failed_hosts"] == [SLOW] and state["exit_code"] == 1
    assert one(fams, "aiv_verdict_pass") == 0 and one(fams, "aiv_exit_code") == 1
    assert one(fams, "aiv_run_duration_seconds") == 42.5
    assert one(fams, "aiv_run_start_timestamp_seconds") == 1796231531.0
    assert one(fams, "aiv_world_size") == 8 and one(fams, "aiv_nodes") == 4 and one(fams, "aiv_failed_nodes") == 1
    assert one(fams, "aiv_check_status", check="inter-node") == 2
    assert one(fams, "aiv_check_status", check="world-size") == 0
    assert {dict(k)["check"] for k in fams["aiv_check_status"]} == {f["check"] for f in state["findings"]}
    assert {dict(k)["node"]: v for k, v in fams["aiv_node_status"].items()} == {
        "node1": 0, "node2": 0, "node3": 2, "node4": 0}
    for r in state["ranks"]:
        labels = {"node": r["host"], "gpu": r["local_rank"], "uuid": r["gpu"]["uuid"]}
        assert one(fams, "aiv_gpu_matmul_tflops", **labels) == 680.0 + r["rank"]
        assert one(fams, "aiv_gpu_memory_bandwidth_gbps", **labels) == 4200.0
    assert len(fams["aiv_gpu_matmul_tflops"]) == 8
    assert all(one(fams, "aiv_intra_node_busbw_gbps", node=h) == 300.0 for h in NODES)
    for h in NODES:
        for r in RAILS:
            assert one(fams, "aiv_inter_node_busbw_gbps", node=h, rail=r) == (10.0 if h == SLOW else 40.0 + r)
    assert {dict(k)["rail"]: v for k, v in fams["aiv_inter_node_busbw_reference_gbps"].items()} == {
        "0": 40.0, "1": 41.0}
    assert {dict(k)["phase"] for k in fams["aiv_phase_duration_seconds"]} == set(aiv.PHASES) | {"import_torch"}
    assert one(fams, "aiv_drain_nodes") == 1


def test_no_job_id_anywhere():
    state = cluster_state()
    assert JOB in json.dumps(state["drain"]), "the drain command names the job: the metrics must not"
    text = render_metrics(state)
    assert JOB not in text and "job" not in text.lower()


def test_reference_output():
    state = json.loads((ROOT / "reference_output.json").read_text())
    text = render_metrics(state)
    fams = check_shape(text)
    assert one(fams, "aiv_verdict_pass") == 1 and one(fams, "aiv_exit_code") == 0
    warned = any(f["status"] == "WARN" and state["host"] in f["hosts"] for f in state["findings"])
    assert one(fams, "aiv_nodes") == 1 and one(fams, "aiv_node_status", node=state["host"]) == int(warned)
    g = state["screen"]["gpu"][0]
    assert one(fams, "aiv_gpu_matmul_tflops", node=g["host"], gpu=0, uuid=g.get("uuid") or "") == g["tflops"]
    assert "aiv_inter_node_busbw_gbps" not in fams  # one node: no pairs
    assert one(fams, "aiv_drain_nodes") == 0  # a PASS drains nothing


def minimal_state():
    """The JSON a rank or the batch file writes when rank 0 left none: no ranks, screen, phases or drain."""
    return {"verdict": "FAIL", "exit_code": 3, "world_size": 16, "failures": ["FAILURE: ..."],
            "failed_hosts": ["gpu-07"], "exclude": "gpu-07", "drain_command": ""}


def hostile_state():
    return cluster_state(nodes=["node1", HOSTILE, "node3", "node4"], slow=HOSTILE)


def test_minimal_state_from_the_batch_file():
    fams = check_shape(render_metrics(minimal_state()))
    assert set(fams) == {"aiv_verdict_pass", "aiv_exit_code", "aiv_world_size", "aiv_failed_nodes",
                         "aiv_node_status"}
    assert one(fams, "aiv_node_status", node="gpu-07") == 0  # named by no finding of this JSON


def test_missing_values_are_omitted_not_nan():
    state = cluster_state()
    gpu = state["screen"]["gpu"]
    gpu[0]["tflops"], gpu[1]["tflops"], gpu[2]["hbm_gbps"] = None, float("nan"), "n/a"
    state["screen"]["intra"][0]["busbw"] = None
    state["elapsed_s"], state["started_at"] = float("inf"), "not a time"
    for m in state["screen"]["pairs"]:
        if "node1" in m["nodes"] and m["rail"] == 0:
            m["busbw"] = None  # every node1 measurement on rail 0 failed
    fams = check_shape(render_metrics(state))
    assert len(fams["aiv_gpu_matmul_tflops"]) == 6 and len(fams["aiv_gpu_memory_bandwidth_gbps"]) == 7
    assert len(fams["aiv_intra_node_busbw_gbps"]) == 3
    assert "aiv_run_duration_seconds" not in fams and "aiv_run_start_timestamp_seconds" not in fams
    assert frozenset({("node", "node1"), ("rail", "0")}) not in fams["aiv_inter_node_busbw_gbps"]
    assert one(fams, "aiv_inter_node_busbw_gbps", node="node1", rail=1) == 41.0


def test_hostile_label_values_round_trip():
    bad, nodes = HOSTILE, ["node1", HOSTILE, "node3", "node4"]
    text = render_metrics(hostile_state())
    assert '\\"' in text and "\\\\" in text and "\\n" in text
    assert all(ln.startswith(("# ", "aiv_")) for ln in text.splitlines()), "a raw newline split a sample"
    fams = check_shape(text)
    assert one(fams, "aiv_node_status", node=bad) == 2
    assert one(fams, "aiv_intra_node_busbw_gbps", node=bad) == 300.0
    assert one(fams, "aiv_inter_node_busbw_gbps", node=bad, rail=1) == 10.0
    assert {dict(k)["node"] for k in fams["aiv_gpu_matmul_tflops"]} == set(nodes)


@pytest.mark.parametrize("make", [cluster_state, minimal_state, hostile_state,
                                  lambda: json.loads((ROOT / "reference_output.json").read_text())],
                         ids=["four-nodes", "minimal", "hostile", "reference"])
def test_promtool_accepts(make):
    promtool(render_metrics(make()))


def test_pure():
    state = cluster_state()
    before = json.dumps(state, sort_keys=True)
    assert render_metrics(state) == render_metrics(state)
    assert json.dumps(state, sort_keys=True) == before


# ------------------------------------------------------------------ atomic write
def test_write_is_complete_and_leaves_no_temp(tmp_path):
    path = tmp_path / "aiv.prom"
    text = render_metrics(cluster_state())
    write_metrics_atomic(str(path), text)
    write_metrics_atomic(str(path), text + "# again\n")
    assert path.read_text() == text + "# again\n"
    assert os.listdir(tmp_path) == ["aiv.prom"]


@pytest.mark.parametrize("mask, mode", [(0o022, 0o644), (0o027, 0o640), (0o077, 0o600)])
def test_mode_honours_the_umask(tmp_path, mask, mode):
    old = os.umask(mask)
    try:
        write_metrics_atomic(str(tmp_path / "aiv.prom"), "x 1\n")
    finally:
        os.umask(old)
    assert (tmp_path / "aiv.prom").stat().st_mode & 0o7777 == mode


def test_existing_mode_kept(tmp_path):
    path = tmp_path / "aiv.prom"
    path.write_text("old 1\n")
    path.chmod(0o604)
    write_metrics_atomic(str(path), "new 1\n")
    assert path.stat().st_mode & 0o7777 == 0o604 and path.read_text() == "new 1\n"


def test_failed_write_keeps_the_old_file_and_no_temp(tmp_path, monkeypatch):
    path = tmp_path / "aiv.prom"
    path.write_text("old 1\n")

    def boom(src, dst):
        raise OSError("disk gone")
    monkeypatch.setattr(os, "replace", boom)
    with pytest.raises(OSError, match="disk gone"):
        write_metrics_atomic(str(path), "new 1\n")
    assert path.read_text() == "old 1\n" and os.listdir(tmp_path) == ["aiv.prom"]


def test_concurrent_reader_never_sees_a_partial_file(tmp_path):
    """A collector reading *.prom while runs rewrite it sees one whole version or the other, never a mix."""
    nodes = [f"gpu-{i:03d}" for i in range(128)]
    texts = [render_metrics(cluster_state(nodes=nodes, slow=nodes[k], per_node=8)) for k in (5, 90)]
    assert min(map(len, texts)) > 100_000 and texts[0] != texts[1]
    path = tmp_path / "aiv.prom"
    write_metrics_atomic(str(path), texts[0])
    done, seen, bad, strays = threading.Event(), set(), [], set()

    def reader():
        while not done.is_set():
            strays.update(p.name for p in tmp_path.glob("*.prom") if p.name != "aiv.prom")
            got = path.read_text()
            if got in texts:
                seen.add(texts.index(got))
            else:
                bad.append(len(got))
    t = threading.Thread(target=reader)
    t.start()
    try:
        for i in range(200):
            write_metrics_atomic(str(path), texts[i % 2])
    finally:
        done.set()
        t.join(30)
    assert not bad, f"partial reads of sizes {bad[:5]}"
    assert seen == {0, 1} and not strays
    assert families(path.read_text()) and os.listdir(tmp_path) == ["aiv.prom"]


def test_the_readme_table_lists_every_metric_with_its_labels_and_help():
    """The metrics table (docs/outputs.md) is the metrics a full run writes: names, labels and HELP text."""
    sys.path.insert(0, str(ROOT / "bench"))
    from sim_state import simulated_state
    want = []
    for f in text_string_to_metric_families(render_metrics(simulated_state(4, 2, fault="rail"))):
        labels = sorted({k for s in f.samples for k in s.labels})
        want.append(f"| `{f.name}` | {', '.join(labels) or '-'} | {f.documentation} |")
    readme = (ROOT / "docs" / "outputs.md").read_text().splitlines()
    start = readme.index("| metric | labels | what |") + 2
    got = readme[start:start + len(want) + 1]
    assert got[:len(want)] == want and not got[-1].startswith("| `aiv_")
