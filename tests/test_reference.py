"""reference_output.log is a real run of the current code (a local 2-rank gloo run in the venv that
bootstrap_env.sh builds; regenerated whenever the output changes) and reference_output.json is that
run's JSON: the report re-rendered from the JSON must equal the log byte for byte, and every header
and progress line must come from the templates the code prints from. A format change not carried
into the reference files fails here."""
import json
import re

from conftest import ROOT, aiv, run_tool

LOG = (ROOT / "reference_output.log").read_text()
STATE = json.loads((ROOT / "reference_output.json").read_text())


def template_regex(template):
    """'init: {backend} ... ({secs:.2f}s)' -> a regex where each field matches any text."""
    parts = re.split(r"\{[^{}]*\}", template)
    return re.compile("^" + "(.+?)".join(re.escape(p) for p in parts) + "$")


def test_report_rerendered_from_the_json_is_the_log():
    lines = LOG.splitlines()
    start = lines.index("CLUSTER HARDWARE TOPOLOGY REPORT") - 1
    assert "\n".join(lines[start:]) + "\n" == aiv.render_report(STATE) + "\n"
    assert LOG.endswith(aiv.SUCCESS_LINE + "\n")


def test_header_and_progress_lines_come_from_the_templates():
    lines = LOG.splitlines()
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


def test_reference_is_a_clean_pass_of_the_current_schema():
    assert STATE["schema_version"] == aiv.SCHEMA_VERSION and STATE["verdict"] == "PASS"
    assert STATE["deadlines"] == aiv.deadlines(aiv.TIMEOUT_DEFAULT, aiv.ROLLCALL_DEFAULT)
    counts = re.search(r"verdict: PASS \(exit 0\); findings: (.*)$", LOG, re.M).group(1)
    assert counts == aiv._counts(STATE["findings"])          # the progress line counts the final list
    assert run_tool(["--verify-log", ROOT / "reference_output.log"]).returncode == 0
