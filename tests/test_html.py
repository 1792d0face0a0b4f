"""The HTML verdict page: escaping, self-containment, verdict and culprits, size at scale, a real browser."""
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
    levels, refs = aiv._html_gpu_levels(screen)
    value, ratio, level = levels[0]["tflops"]
    assert ratio == pytest.approx(0.47) and level == "FAIL"
    assert levels[0]["hbm_gbps"][1] == pytest.approx(1.0) and levels[0]["hbm_gbps"][2] == "OK"
    chart = aiv._html_gpu_chart(screen, levels, refs, "tflops", "TFLOPS")
    assert "table row H200 SXM" in chart and "= 0.470 of the reference" in chart and 'class="b-FAIL"' in chart


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


def check_in_browser(page, culprit, rail, shot):
    """Open the page file in headless Chromium: no SEVERE console entry, the verdict FAIL, the culprit listed
    and outlined, the rail's heat map drawn; the whole page's screenshot kept as `shot` in $AIV_ARTIFACTS
    (default ci-artifacts/). -> the screenshot's path."""
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
        assert culprit in drv.find_element(By.ID, "culprits").text
        outlined = drv.find_elements(By.CSS_SELECTOR, ".culprit")
        assert outlined and any(e.get_attribute("data-host") == culprit for e in outlined)
        assert drv.find_element(By.ID, f"heatmap-rail-{rail}")
        severe = [e for e in drv.get_log("browser") if e.get("level") == "SEVERE"]
        assert not severe, severe
        art = Path(os.environ.get("AIV_ARTIFACTS") or ROOT / "ci-artifacts")
        art.mkdir(parents=True, exist_ok=True)
        drv.set_window_size(1280, min(drv.execute_script("return document.body.scrollHeight") + 100, 8000))
        assert drv.save_screenshot(str(art / shot))
        return art / shot
    finally:
        drv.quit()


def test_browser(tmp_path, fault_page):
    page = tmp_path / "report.html"
    page.write_text(fault_page)
    check_in_browser(page, BAD, 3, "html_report.png")
