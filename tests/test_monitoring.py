"""The fleet's rules and dashboard (monitoring/): promtool checks the rules and runs their unit tests (a firing
test per alert), and every metric and label the rules, their test series and the dashboard name is one the tool
writes: a real node check on this machine (--node-check --metrics), the once series the same renderer writes for
a GPU judged 'once', and a preflight's metrics from the reference run's JSON."""
import json
import os
import re
import shutil
import subprocess
import sys
import uuid

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from conftest import ROOT, SCRIPT, aiv, clean_env

MON = ROOT / "monitoring"
RULES = MON / "aiv-rules.yml"
RULE_TESTS = MON / "aiv-rules.test.yml"
DASHBOARD = MON / "aiv-dashboard.json"
# what node_exporter adds: its scrape's labels, and the textfile collector's own series
SCRAPE_LABELS = {"instance", "job"}
NODE_EXPORTER = {"node_textfile_mtime_seconds": {"file"}}
PROMQL_WORDS = {"by", "on", "and", "or", "unless", "without", "ignoring", "group_left", "group_right", "bool",
                "offset", "time", "vector", "count", "sum", "max", "min", "avg", "changes", "label_values",
                "rate", "increase", "absent", "humanizeDuration"}


def families(text):
    return {f.name: {k for s in f.samples for k in s.labels} for f in text_string_to_metric_families(text)}


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """{metric: labels} of what the tool writes: a real healthy node check on this machine's CPU, the same
    pass rendered with a GPU judged 'once' (judge_node_speed), and the reference preflight's metrics."""
    tmp = tmp_path_factory.mktemp("mon")
    prom, js = tmp / "aiv_node_check_health.prom", tmp / "health.json"
    env = clean_env({"SLURMD_NODENAME": f"mon-{uuid.uuid4().hex[:8]}", "SLURM_CONF": "/nonexistent/slurm.conf"})
    r = subprocess.run([sys.executable, str(SCRIPT), "--node-check", "health", "--metrics", str(prom),
                        "--json", str(js)], env=env, capture_output=True, text=True, timeout=180)
    assert r.returncode == 0 and prom.exists(), r.stdout + r.stderr
    out = families(prom.read_text())
    state = json.loads(js.read_text())
    by = {i: {"uuid": f"GPU-{i}", "name": "NVIDIA H100 80GB HBM3"} for i in range(4)}
    speeds = {i: {"tflops": 100.0 if i == 1 else 700.0, "hbm_gbps": 3000.0} for i in by}
    once = aiv.judge_node_speed(state["node"], speeds, {}, by)  # GPU 1 slow, not measured again
    assert [f["blame"] for f in once if f["status"] != "PASS"] == ["once"], once
    for k, v in families(aiv.node_metrics(dict(state, findings=state["findings"] + once))).items():
        out[k] = out.get(k, set()) | v
    assert "aiv_node_check_gpu_once_timestamp_seconds" in out
    preflight = json.loads((ROOT / "tests" / "reference_cpu.json").read_text())
    preflight["findings"][0]["status"] = "FAIL"  # a FAIL naming a node, as the preflight writes it
    preflight["findings"][0]["hosts"] = [preflight["ranks"][0]["host"]]
    out.update(families(aiv.render_metrics(preflight)))
    from test_metrics import cluster_state  # a 4-node run with the screen's pairs between nodes
    for k, v in families(aiv.render_metrics(cluster_state())).items():
        out[k] = out.get(k, set()) | v
    return out


def promtool(*args, cwd=MON):
    tool = shutil.which("promtool")
    if tool is None:
        if os.environ.get("CI") == "true":
            pytest.fail("promtool missing on CI (apt-get install prometheus)")
        pytest.skip("promtool not installed (Debian package prometheus)")
    return subprocess.run([tool, *args], cwd=cwd, capture_output=True, text=True, timeout=120)


def rules():
    return [r for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]]


def names_in(expr):
    """Metric and label names a PromQL expression reads (recording rules' names aside)."""
    body = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # label values and strings out
    labels = set(re.findall(r"([a-zA-Z_]\w*)\s*(?:=~|!~|!=|=)\s*\"", body))
    for group in re.findall(r"\b(?:by|on|without|ignoring)\s*\(([^)]*)\)", body):
        labels |= {w.strip() for w in group.split(",") if w.strip()}
    bare = re.sub(r"\b(?:by|on|without|ignoring)\s*\([^)]*\)|\{[^}]*\}|\[[^\]]*\]", " ", body)
    metrics = {m for m in re.findall(r"(?<![\w:$])([a-zA-Z_]\w*)(?![\w:(])(?!\s*\()", bare)
               if m not in PROMQL_WORDS}
    return metrics, labels


def test_promtool_checks_the_rules_and_runs_their_tests():
    r = promtool("check", "rules", RULES.name)
    assert r.returncode == 0, r.stdout + r.stderr
    r = promtool("test", "rules", RULE_TESTS.name)
    assert r.returncode == 0 and "SUCCESS" in r.stdout, r.stdout + r.stderr


def test_every_alert_has_a_test_that_fires_it_and_one_that_does_not():
    alerts = {r["alert"] for r in rules() if "alert" in r}
    cases = [c for t in yaml.safe_load(RULE_TESTS.read_text())["tests"] for c in t.get("alert_rule_test", [])]
    fired = {c["alertname"] for c in cases if c.get("exp_alerts")}
    quiet = {c["alertname"] for c in cases if not c.get("exp_alerts")}
    assert alerts == fired == quiet, (alerts, fired, quiet)
    assert {"AivNodeCheckFailed", "AivNodeCheckNotAssessed", "AivNodeCheckStale", "AivNodeCheckTextfileStale",
            "AivGpuFlaggedOnceRepeatedly", "AivPreflightNodeFailed"} <= alerts


def test_the_rules_read_only_what_the_tool_writes(exported):
    known = dict(exported, **NODE_EXPORTER)
    recorded = {r["record"] for r in rules() if "record" in r}
    all_labels = set().union(*known.values()) | SCRAPE_LABELS
    for r in rules():
        metrics, labels = names_in(r["expr"])
        assert metrics <= set(known), (r.get("alert") or r.get("record"), metrics - set(known))
        assert labels <= all_labels, (r.get("alert") or r.get("record"), labels - all_labels)
    for g in yaml.safe_load(RULES.read_text())["groups"]:  # a record read in its own group, evaluated before
        before = set()
        for r in g["rules"]:
            for m in re.findall(r"\baiv:[\w:]+", r["expr"]):
                assert m in recorded and m in before, (g["name"], m)
            before.add(r.get("record"))


def test_the_rule_tests_feed_the_series_the_tool_writes(exported):
    known = dict(exported, **NODE_EXPORTER)
    for t in yaml.safe_load(RULE_TESTS.read_text())["tests"]:
        for s in t["input_series"]:
            name, labels = re.fullmatch(r"(\w+)\{(.*)\}", s["series"]).groups()
            keys = set(re.findall(r'(\w+)="', labels))
            assert name in known, name
            assert keys - SCRAPE_LABELS <= known[name] and keys >= SCRAPE_LABELS, (name, keys, known[name])


def test_the_dashboard_is_grafana_json_reading_only_what_the_tool_writes(exported):
    d = json.loads(DASHBOARD.read_text())
    known = dict(exported, **NODE_EXPORTER)
    assert d["uid"] and d["title"] and isinstance(d["schemaVersion"], int)
    panels = [p for p in d["panels"] if p["type"] != "row"]
    assert len({p["id"] for p in d["panels"]}) == len(d["panels"])
    exprs = [t["expr"] for p in panels for t in p["targets"]]
    exprs += [re.sub(r"label_values\((\w+), *(\w+)\)", r"count by (\2) (\1)", v["query"]["query"])
              for v in d["templating"]["list"] if v["type"] == "query"]
    assert all(p["targets"] for p in panels) and len(exprs) > len(panels)
    seen = set()
    for e in exprs:
        metrics, labels = names_in(e.replace("$instance", ".*"))
        assert metrics <= set(known), (e, metrics - set(known))
        assert labels <= set().union(*known.values()) | SCRAPE_LABELS, e
        seen |= metrics
    for p in panels:  # on Grafana's 24-column grid
        g = p["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24 and g["h"] > 0, p["title"]
    # every node gate family is on the dashboard
    assert {m for m in exported if m.startswith("aiv_node_check_")} - {"aiv_node_check_exit_code"} <= seen
