"""The HTML verdict page: escaping, self-containment, verdict and culprits, size at scale, a real browser."""
import html
import math
import os
import re
import shutil
import sys
from pathlib import Path

import pytest

from conftest import ROOT, aiv

sys.path.insert(0, str(ROOT / "bench"))
from sim_state import simulated_state  # noqa: E402

render_html = aiv.render_html

CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
BAD = "node003"


@pytest.fixture(scope="module")
def fault_page():
    state = simulated_state(4, 8, fault="rail")
    assert state["failed_hosts"] == [BAD]
    return render_html(state)


@pytest.mark.parametrize("elapsed", [0.004, 12.0, 7200.0, 100000.0])
def test_the_timeline_has_round_ticks_whatever_the_run_took(elapsed):
    """Before: a run longer than about 30,000 s (a long soak) raised StopIteration in the timeline's tick step,
    and the page was not written."""
    state = simulated_state(2, 2)
    state["phases"], state["phase_starts"], state["elapsed_s"] = {"soak": elapsed * 0.9}, {"soak": 0.0}, elapsed
    ticks = [float(t) for t in re.findall(r'text-anchor="middle">([0-9.e+]+) s</text>', render_html(state))]
    step = ticks[1] - ticks[0]
    assert 3 <= len(ticks) <= 13 and ticks[0] == 0 and ticks[-1] <= elapsed < ticks[-1] + step, ticks
    assert f"{step / 10 ** math.floor(math.log10(step)):.6g}" in ("1", "2", "5"), ticks


def test_hostile_host_name_is_escaped():
    state = simulated_state(4, 2, fault="rail")
    evil = '<script>alert(1)</script>"'
    state["host"] = evil
    state["failed_hosts"] = [evil]
    state["findings"].append(aiv.finding("inter-node", "FAIL", f"slow {evil}", [evil]))
    state["failures"].append(f"FAILURE: inter-node: slow {evil}")
    state["ranks"][0]["host"] = evil
    state["screen"]["gpu"][0]["host"] = evil
    state["screen"]["pairs"][0]["nodes"][0] = evil
    page = render_html(state)
    assert "<script" not in page.lower()
    assert "&lt;script&gt;alert(1)&lt;/script&gt;&quot;" in page


def test_a_lone_gpu_is_drawn_against_the_table_row_that_judged_it():
    """Before: a lone H200 measured at 0.47 of its model's row was drawn as a full red bar at 1.00 of itself."""
    row = aiv.gpu_table_row("NVIDIA H200")
    screen = {"cpu": False, "gpu": [{"rank": 0, "host": "n1", "local_rank": 0, "model": "NVIDIA H200",
                                     "tflops": 0.47 * row["tflops"], "hbm_gbps": row["hbm_gbps"]}]}
    levels, refs = aiv.gpu_levels(screen)
    value, ratio, level = levels[0]["tflops"]
    assert ratio == pytest.approx(0.47) and level == "FAIL"
    assert levels[0]["hbm_gbps"][1] == pytest.approx(1.0) and levels[0]["hbm_gbps"][2] == "OK"
    chart = aiv._html_gpu_chart(screen, levels, refs, "tflops", "TFLOPS")
    bars, lines = svg_bars(chart), svg_lines(chart)
    assert [(b["gpu"], b["level"]) for b in bars] == [("n1 GPU 0", "FAIL")]
    assert f"table row H200 SXM: {row['tflops']:.0f}" in chart and "FAIL below 0.70 of the row: 462" in chart
    assert any(ln["level"] == "FAIL" and ln["y"] < bars[0]["y"] for ln in lines)


# ---------------------------------------------------------------------------- the charts, as markup
def svg_bars(page, cls="bar"):
    """[{'gpu', 'value', 'level', 'y'}] of every bar of the page's charts (y: the bar's top)."""
    out = []
    for m in re.finditer(rf'<rect class="{cls} b-(\w+)" x="[\d.]+" y="([\d.]+)"[^>]*data-gpu="([^"]*)" '
                         r'data-value="([^"]*)" data-level="(\w+)"', page):
        assert m.group(1) == m.group(5)
        out.append({"gpu": html.unescape(m.group(3)), "value": float(m.group(4)), "level": m.group(5),
                    "y": float(m.group(2))})
    return out


def svg_lines(page):
    """[{'kind', 'level', 'value', 'y', 'broken'}] of every judging line of the page's charts."""
    rx = (r'<line class="jl j-\w+" x1="[\d.]+" x2="[\d.]+" y1="([\d.]+)" y2="[\d.]+" data-kind="(\w+)" '
          r'data-level="(\w+)" data-value="([^"]+)"( data-broken="1")?')
    return [{"y": float(m.group(1)), "kind": m.group(2), "level": m.group(3), "value": float(m.group(4)),
             "broken": bool(m.group(5))} for m in re.finditer(rx, page)]


MODEL = "NVIDIA H100 80GB HBM3"


def fail_state(min_tflops=1e9, min_hbm=None, low=0.02, nodes=2, gpus=4, bands=None):
    """A FAIL run judged by the tool's own judges: GPU 1 of the second node at `low` of its peers' matmul
    reference, every GPU below --min-tflops (1e9: far above every value), --min-hbm as given."""
    rows = []
    for i in range(nodes * gpus):
        tf = 700.0 + 5 * (i % 3)
        rows.append({"rank": i, "host": f"gpu{i // gpus + 1:03d}", "local_rank": i % gpus, "uuid": f"GPU-{i:04d}",
                     "model": MODEL, "tflops": tf, "hbm_gbps": 3000.0 + 10 * (i % 4)})
    ref = aiv.screen_reference(r["tflops"] for r in rows)["ref"]
    rows[gpus + 1]["tflops"] = low * ref
    screen = {"cpu": False, "gpu": rows, "min_tflops": min_tflops, "min_hbm": min_hbm, "min_busbw_intra": None,
              "min_busbw_inter": None,
              "intra": [{"host": f"gpu{k + 1:03d}", "busbw": 400.0 + k, "model": MODEL,
                         "ranks": list(range(k * gpus, (k + 1) * gpus))} for k in range(nodes)],
              "pairs": [{"round": 1, "nodes": ["gpu001", "gpu002"], "rail": r, "busbw": 47.0 + r, "hca": f"mlx5_{r}"}
                        for r in range(gpus)]}
    if bands is not None:
        screen["bands"] = bands
    found = aiv.blame_gate(aiv.judge_screen(screen))
    failed, code = aiv.blamed_hosts(found), aiv.verdict_code(found)
    return {"verdict": "FAIL" if code else "PASS", "exit_code": code, "host": "gpu001",
            "world_size": len(rows), "backend": "nccl", "findings": found, "failures": aiv.failure_lines(found),
            "failed_hosts": failed, "exclude": aiv.compress_hostlist(failed) if failed else "", "screen": screen}


def test_every_bar_is_labelled_with_its_gpu_and_value_and_sits_below_the_line_that_failed_it():
    state = fail_state(min_hbm=5000.0)
    page = render_html(state)
    bars, lines = svg_bars(page), svg_lines(page)
    gpus = {f"{r['host']} GPU {r['local_rank']}" for r in state["screen"]["gpu"]}
    tflops = re.search(r'<svg id="gpu-tflops".*?</svg>', page, re.S).group(0)
    hbm = re.search(r'<svg id="gpu-hbm_gbps".*?</svg>', page, re.S).group(0)
    for chart, metric in ((tflops, "tflops"), (hbm, "hbm_gbps")):
        cb, cl = svg_bars(chart), svg_lines(chart)
        assert {b["gpu"] for b in cb} == gpus
        for r in state["screen"]["gpu"]:
            assert f">{aiv._s3(r[metric])}</text>" in chart, (metric, r[metric])  # the value, written out
            assert f">{r['host']}</text>" in chart and f">GPU {r['local_rank']}</text>" in chart
        assert all(b["level"] == "FAIL" for b in cb), cb  # the floor above every GPU
        for b in cb:  # each red bar below a drawn FAIL line that its value is below
            assert any(ln["level"] == "FAIL" and ln["value"] > b["value"] and ln["y"] < b["y"] for ln in cl), b
    assert len(bars) == 2 * 8 + 2 and len(lines) >= 12  # 8 GPUs in two charts, 2 nodes in the intra-node one
    # the floor far above every value: above a broken axis, said in words; the in-scale floor is not broken
    floor = [ln for ln in svg_lines(tflops) if ln["kind"] == "floor"]
    assert floor and floor[0]["broken"] and "axis broken" in tflops and "--min-tflops 1e+09: FAIL below" in tflops
    assert [ln["broken"] for ln in svg_lines(hbm) if ln["kind"] == "floor"] == [False] and "axis broken" not in hbm
    # the GPU at 0.02 of its peers' reference: its own value, the peers' reference and the FAIL line named
    low = next(b for b in svg_bars(tflops) if b["gpu"] == "gpu002 GPU 1")
    ref = aiv.screen_reference(r["tflops"] for r in state["screen"]["gpu"])["ref"]  # the judge's reference
    assert low["value"] / ref == pytest.approx(0.02, abs=0.001) and ref == pytest.approx(705.0)
    assert "peers&#x27; reference 705 (upper quartile of 8)" in tflops
    assert "FAIL below 0.80 of the reference: 564" in tflops
    assert "table row H100 SXM: 620" in tflops and "WARN below 0.85 of the row: 527" in tflops


def test_the_axis_starts_at_zero_and_spans_every_value():
    """Before: the axis ran from about 0.6 of the reference, so 0.49 and 0.02 were the same sliver."""
    for low in (0.49, 0.02):
        tflops = re.search(r'<svg id="gpu-tflops".*?</svg>', render_html(fail_state(None, low=low)), re.S).group(0)
        bars = svg_bars(tflops)
        bottom = max(float(m) + float(h) for m, h in re.findall(r'class="bar b-\w+" x="[\d.]+" y="([\d.]+)" '
                                                                 r'width="[\d.]+" height="([\d.]+)"', tflops))
        top = min(b["y"] for b in bars)
        full = max(b["value"] for b in bars)
        lowb = next(b for b in bars if b["gpu"] == "gpu002 GPU 1")
        # bar heights are proportional to the values, from one zero line
        assert (bottom - lowb["y"]) / (bottom - top) == pytest.approx(lowb["value"] / full, abs=0.01)


def test_intra_node_busbw_and_bands_are_drawn_against_their_lines():
    band = {"band": f"gpu.hbm_gbps/{MODEL}", "class": "H100 x4", "hosts": ["gpu002"], "lo": 3400.0, "hi": 3500.0,
            "ref": 3450.0, "runs": 3, "slack": 0.9, "fail_below": 3060.0}
    page = render_html(fail_state(None, bands=[band]))
    hbm = re.search(r'<svg id="gpu-hbm_gbps".*?</svg>', page, re.S).group(0)
    (bl,) = [ln for ln in svg_lines(hbm) if ln["kind"] == "band"]
    assert bl["value"] == 3060.0 and f"manifest band gpu.hbm_gbps/{MODEL} of H100 x4: FAIL below 0.9" in hbm
    for b in svg_bars(hbm):  # the band judges gpu002's GPUs only, all of them below its line
        assert b["level"] == ("FAIL" if b["gpu"].startswith("gpu002") else "OK"), b
        if b["level"] == "FAIL":
            assert b["y"] > bl["y"]
    intra = re.search(r'<section id="intra">.*?</section>', page, re.S).group(0)
    assert [b["gpu"] for b in svg_bars(intra)] == ["gpu001", "gpu002"] and ">400</text>" in intra
    assert "nodes&#x27; reference 401 (maximum of 2)" in intra


def test_heat_map_cells_show_their_busbw_and_the_slow_ones_are_listed():
    page = render_html(simulated_state(4, 2, fault="rail"))
    hm = re.search(r'<svg id="heatmap-rail-1".*?</svg>', page, re.S).group(0)
    cells = re.findall(r'<text class="cv c-k(\d)"[^>]*>([\d.]+|failed)</text>', hm)
    assert cells and all(float(v) > 10 for _, v in cells), cells  # GB/s in figures
    slow = re.search(r'<table id="slow-pairs">.*?</table>', page, re.S).group(0)
    assert BAD in slow and "FAIL" in slow


def test_pass_page_has_no_red_pill_and_the_cpu_legend_no_empty_warn():
    """Before: 'Failed hosts: none' was styled as a red host chip; the CPU heat-map legend read 'WARN (< 0.00)'."""
    import json
    page = render_html(json.loads((ROOT / "reference_output.json").read_text()))
    culprits = re.search(r'id="culprits">(.*?)</span></p>', page, re.S).group(1)
    assert "chip" not in culprits and ">none<" in culprits
    cpu = dict(simulated_state(3, 1), verdict="PASS")
    cpu["screen"] = dict(cpu["screen"], cpu=True)
    legend = render_html(cpu)
    assert "0.00" not in re.search(r'<section id="pairs">.*?</section>', legend, re.S).group(0).split("<svg")[0]
    assert "CPU ranks: nothing WARNs" in legend


def test_self_contained(fault_page):
    low = fault_page.lower()
    assert "<link" not in low and "<script" not in low and "@import" not in low
    assert not re.search(r"""(src|href)\s*=\s*["']?\s*(https?:|//|file:)""", low)
    assert not re.search(r"url\(", low)


def test_verdict_and_culprit(fault_page):
    verdict = re.search(r'<section id="verdict"[^>]*>(.*?)</section>', fault_page, re.S)
    assert verdict and "FAIL" in verdict.group(1)
    culprits = re.search(r'id="culprits">(.*?)</span></p>', fault_page, re.S)
    assert culprits and BAD in culprits.group(1)
    assert re.search(r'id="heatmap-rail-3"', fault_page)
    assert re.search(rf'class="culprit" data-host="{BAD}"', fault_page)
    for rail in range(8):
        assert f'id="heatmap-rail-{rail}"' in fault_page


def test_reference_output_renders():
    import json
    state = json.loads((ROOT / "reference_output.json").read_text())
    page = render_html(state)
    assert 'id="verdict" class="PASS"' in page and 'id="culprits"' in page


def test_size_512x8():
    page = render_html(simulated_state(512, 8, fault="rail"))
    assert len(page.encode()) <= 2 * 1024 * 1024, len(page.encode())
    assert f'data-host="{BAD}"' in page


def _browser_or_skip():
    """-> a selenium webdriver module pair, or skip (fail under CI=true) naming what is missing."""
    missing = [p for p in (CHROMIUM, CHROMEDRIVER) if not shutil.which(p)]
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        missing.append("python package selenium")
        webdriver = Service = None
    if missing:
        why = "browser test needs " + ", ".join(missing)
        if os.environ.get("CI") == "true":
            pytest.fail(why + " (CI=true: CI installs them)")
        pytest.skip(why)
    return webdriver, Service


def check_in_browser(page, culprit, rail, shot, extra=None):
    """Open the page file in headless Chromium: no SEVERE console entry, the verdict FAIL, the culprit listed
    and (rail not None) outlined on that rail's heat map, then extra(driver) when given; the whole page's
    screenshot kept as `shot` in $AIV_ARTIFACTS (default ci-artifacts/). -> the screenshot's path."""
    webdriver, Service = _browser_or_skip()
    from selenium.webdriver.common.by import By
    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for a in ("--headless=new", "--no-sandbox", "--disable-gpu", "--window-size=1280,900"):
        opts.add_argument(a)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    drv = webdriver.Chrome(service=Service(CHROMEDRIVER), options=opts)
    try:
        drv.get(Path(page).as_uri())
        assert "FAIL" in drv.find_element(By.ID, "verdict").text
        if culprit is None:  # a FAIL that names no host says so, and why
            assert "to localise it" in drv.find_element(By.ID, "unlocalised").text
        else:
            assert culprit in drv.find_element(By.ID, "culprits").text
        if rail is not None:  # an inter-node culprit: outlined on its rail's heat map
            outlined = drv.find_elements(By.CSS_SELECTOR, ".culprit")
            assert outlined and any(e.get_attribute("data-host") == culprit for e in outlined)
            assert drv.find_element(By.ID, f"heatmap-rail-{rail}")
        if extra is not None:
            extra(drv)
        severe = [e for e in drv.get_log("browser") if e.get("level") == "SEVERE"]
        assert not severe, severe
        art = Path(os.environ.get("AIV_ARTIFACTS") or ROOT / "ci-artifacts")
        art.mkdir(parents=True, exist_ok=True)
        drv.set_window_size(1280, min(drv.execute_script("return document.body.scrollHeight") + 100, 8000))
        assert drv.save_screenshot(str(art / shot))
        return art / shot
    finally:
        drv.quit()


CHART_DOM = """
return Array.from(document.querySelectorAll('svg.bars')).map(svg => ({
  id: svg.id,
  bars: Array.from(svg.querySelectorAll('rect.bar')).map(r => ({gpu: r.dataset.gpu, value: +r.dataset.value,
        level: r.dataset.level, top: r.getBoundingClientRect().top, height: r.getBoundingClientRect().height})),
  lines: Array.from(svg.querySelectorAll('line.jl')).map(l => ({kind: l.dataset.kind, level: l.dataset.level,
        value: +l.dataset.value, y: l.getBoundingClientRect().top, name: l.querySelector('title').textContent})),
  values: Array.from(svg.querySelectorAll('text.val')).filter(t => t.getBBox().width > 0).map(t => t.textContent),
  labels: Array.from(svg.querySelectorAll('text.lab, text.jlab')).filter(t => t.getBBox().width > 0)
          .map(t => t.textContent),
}));
"""


def test_browser_fail_page_shows_every_value_and_line(tmp_path):
    """The page a new operator opens after a FAIL: a GPU at 0.02 of its peers' reference and --min-tflops above
    every GPU (drawn above a broken axis), --min-hbm above every GPU on scale. In a real browser: every bar's
    GPU and value written out, every judging line drawn and named, every red bar below a FAIL line it is below."""
    state = fail_state(min_tflops=1e9, min_hbm=3500.0)
    page = tmp_path / "fail.html"
    page.write_text(render_html(state))
    charts = {}

    def dom(drv):
        charts.update({c["id"]: c for c in drv.execute_script(CHART_DOM)})
    # every GPU of two nodes below the floors: a cause the nodes share, a FAIL naming no host
    shot = check_in_browser(page, None, None, "html_gpu_lines.png", extra=dom)
    assert shot.stat().st_size > 10_000
    assert {"gpu-tflops", "gpu-hbm_gbps", "intra-0"} <= set(charts)
    for cid in ("gpu-tflops", "gpu-hbm_gbps"):
        c = charts[cid]
        metric = cid[4:]
        assert len(c["bars"]) == len(state["screen"]["gpu"])
        for r in state["screen"]["gpu"]:
            assert aiv._s3(r[metric]) in c["values"], (cid, r[metric], c["values"])
            assert r["host"] in c["labels"] and f"GPU {r['local_rank']}" in c["labels"]
        for ln in c["lines"]:
            assert ln["name"] in c["labels"], ln  # each judging line named where it is drawn
        kinds = {ln["kind"] for ln in c["lines"]}
        assert {"ref", "fail", "warn", "row", "floor"} <= kinds, kinds
        for b in c["bars"]:
            assert b["height"] >= 1 and b["level"] == "FAIL", b
            assert [ln for ln in c["lines"]
                    if ln["level"] == "FAIL" and ln["value"] > b["value"] and ln["y"] < b["top"]], b
    low = next(b for b in charts["gpu-tflops"]["bars"] if b["gpu"] == "gpu002 GPU 1")
    assert aiv._s3(low["value"]) in charts["gpu-tflops"]["values"] and low["value"] < 0.03 * 705


def test_browser(tmp_path, fault_page):
    page = tmp_path / "report.html"
    page.write_text(fault_page)
    check_in_browser(page, BAD, 3, "html_report.png")
