"""The reference logs against the code. Two runs of the current code in local mode, each with its JSON:
reference_output.log/.json at the top level (a GPU machine's run: backend nccl, one rank per GPU; until one
replaces it, a CPU run) and tests/reference_cpu.log/.json (2 gloo ranks on a CPU machine). Both are made by
one command, tools/reference.sh (on a GPU machine it writes the top-level pair, on a CPU machine the one under
tests/). For each: the report re-rendered from the JSON must equal the log byte for byte (the values that
vary from run to run, times, hosts, ports, speeds, live in the JSON), every header and progress line must
come from the templates the code prints from, the JSON must be a clean PASS of the current schema, and
--verify-log must accept the log. The GPU log's structure is held to the code too (its sections, the header
and success lines, check names, backend nccl, an NVIDIA GPU per rank). A format change not carried into the
reference files fails here."""
import json
import re

import pytest

from conftest import ROOT, aiv, run_tool

REFS = {"top-level": ROOT / "reference_output", "cpu": ROOT / "tests" / "reference_cpu"}


def load(name):
    base = REFS[name]
    return base.with_suffix(".log").read_text(), json.loads(base.with_suffix(".json").read_text())


def template_regex(template):
    """'init: {backend} ... ({secs:.2f}s)' -> a regex where each field matches any text."""
    parts = re.split(r"\{[^{}]*\}", template)
    return re.compile("^" + "(.+?)".join(re.escape(p) for p in parts) + "$")


def is_gpu_log(log):
    return re.search(r"^\[\s*[\d.]+s\] local: backend nccl, device cuda", log, re.M) is not None


@pytest.mark.parametrize("name", REFS)
def test_report_rerendered_from_the_json_is_the_log(name):
    log, state = load(name)
    lines = log.splitlines()
    start = lines.index("CLUSTER HARDWARE TOPOLOGY REPORT") - 1
    assert "\n".join(lines[start:]) + "\n" == aiv.render_report(state) + "\n"
    assert log.endswith(aiv.SUCCESS_LINE + "\n")


@pytest.mark.parametrize("name", REFS)
def test_header_and_progress_lines_come_from_the_templates(name):
    log, _ = load(name)
    lines = log.splitlines()
    header = lines[:len(aiv.HEADER)]
    for line, template in zip(header, aiv.HEADER, strict=True):
        assert template_regex(template).match(line), (line, template)
    progress = [ln for ln in lines if re.match(r"^\[\s*[\d.]+s\] ", ln)]
    body = lines[len(aiv.HEADER):lines.index("CLUSTER HARDWARE TOPOLOGY REPORT") - 1]
    assert body == progress, "only progress lines between the header and the report"
    regexes = [template_regex(t) for t in aiv.PROGRESS.values()]
    for ln in progress:
        text = re.sub(r"^\[\s*[\d.]+s\] ", "", ln)
        assert any(rx.match(text) for rx in regexes), f"no template prints: {text}"
    said = {k for k, t in aiv.PROGRESS.items() for ln in progress if template_regex(t).match(ln.split("] ", 1)[1])}
    assert said >= {"contract", "local", "rollcall_open", "rollcall", "init", "telemetry", "collective", "ddp",
                    "verdict"}


@pytest.mark.parametrize("name", REFS)
def test_reference_is_a_clean_pass_of_the_current_schema(name):
    log, state = load(name)
    assert state["schema_version"] == aiv.SCHEMA_VERSION and state["verdict"] == "PASS"
    assert state["deadlines"] == aiv.deadlines(aiv.TIMEOUT_DEFAULT, aiv.ROLLCALL_DEFAULT)
    counts = re.search(r"verdict: PASS \(exit 0\); findings: (.*)$", log, re.M).group(1)
    assert counts == aiv._counts(state["findings"])          # the progress line counts the final list
    assert {f["check"] for f in state["findings"]} <= set(aiv.CHECKS)
    r = run_tool(["--verify-log", REFS[name].with_suffix(".log"), "--expect-world-size", state["world_size"]])
    assert r.returncode == 0, r.stdout + r.stderr


def test_the_cpu_reference_is_a_cpu_run():
    log, state = load("cpu")
    assert not is_gpu_log(log) and state["backend"] == "gloo" and state["world_size"] == 2
    assert "] local: backend gloo, device cpu," in log


def test_the_gpu_reference_is_every_gpu_of_one_machine_under_nccl():
    """Skipped while the top-level reference is a CPU run; it holds a GPU log dropped in its place (written by
    tools/reference.sh on a GPU machine) to the code: the report's sections in order, one 'Total Execution
    Ranks: N' line with N the JSON's world size, the success line last, every finding's check one of CHECKS
    and none FAIL, backend nccl, one rank per GPU on one node, each naming its NVIDIA GPU, its own device and
    UUID; --verify-log with the shape accepts it."""
    log, state = load("top-level")
    if not is_gpu_log(log):
        pytest.skip("reference_output.log is a CPU run (backend gloo): the GPU structure test runs once "
                    "tools/reference.sh on a GPU machine writes a GPU log there")
    lines = log.splitlines()
    n = state["world_size"]
    assert [ln for ln in lines if ln.startswith("Total Execution Ranks:")] == [f"Total Execution Ranks: {n}"]
    assert lines[-1] == aiv.SUCCESS_LINE and f"Ranks Reported: {n}/{n}" in lines
    assert [ln for ln in lines if ln in aiv.LOG_SECTIONS] == list(aiv.LOG_SECTIONS)
    assert state["backend"] == "nccl" and "backend=nccl" in log
    rows = re.findall(r"^\[(PASS|WARN|FAIL)\] ([a-z0-9-]+): ", "\n".join(ln.strip() for ln in lines), re.M)
    assert rows and {c for _, c in rows} <= set(aiv.CHECKS) and "FAIL" not in {s for s, _ in rows}
    ranks = state["ranks"]
    assert sorted(r["rank"] for r in ranks) == list(range(n)) and len({r["host"] for r in ranks}) == 1
    assert sorted(r["local_rank"] for r in ranks) == list(range(n))
    assert all(r["device"] == r["local_rank"] for r in ranks)
    names = [(r.get("gpu") or {}).get("name") or "" for r in ranks]
    assert all(x.startswith("NVIDIA ") for x in names), names
    assert len({(r.get("gpu") or {}).get("uuid") for r in ranks}) == n        # every GPU once
    for r in ranks:
        assert re.search(rf'^    rank={r["rank"]} .* device=cuda:{r["device"]} gpu="?NVIDIA ', log, re.M), r["rank"]
    r = run_tool(["--verify-log", REFS["top-level"].with_suffix(".log"), "--expect-world-size", n,
                  "--expect-nodes", 1, "--expect-ranks-per-node", n])
    assert r.returncode == 0, r.stdout + r.stderr


def test_one_command_regenerates_both_references():
    """tools/reference.sh is the one command the pages name, and it writes the files these tests read."""
    script = (ROOT / "tools" / "reference.sh").read_text()
    assert "base=reference_output" in script and "base=tests/reference_cpu" in script
    assert "tools/reference.sh" in (ROOT / "docs" / "outputs.md").read_text()
