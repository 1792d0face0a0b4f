#!/usr/bin/env python3
"""The HTML verdict page at scale: size and browser render time of a simulated 512-node x 8-rail run.

  python bench/html_scale.py [--nodes 512] [--rails 8] [--fault rail] [--loads 3] [--out PAGE.html]

Renders the page (render_html), prints its size, loads it in headless Chromium (Selenium, /usr/bin/chromium
and /usr/bin/chromedriver) and takes navigationStart -> loadEventEnd from window.performance.timing, the
median of --loads loads. Targets: <= 2 MB, <= 2 s.
"""
import argparse
import os
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))
from sim_state import simulated_state  # noqa: E402

import ddp_mesh_ping as aiv  # noqa: E402

MAX_BYTES, MAX_S = 2 * 1024 * 1024, 2.0


def load_times(path, loads):
    """Seconds from navigationStart to loadEventEnd, one per load, in a fresh headless Chromium."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    opts = webdriver.ChromeOptions()
    opts.binary_location = "/usr/bin/chromium"
    for a in ("--headless=new", "--no-sandbox", "--disable-gpu", "--window-size=1280,900"):
        opts.add_argument(a)
    drv = webdriver.Chrome(service=Service("/usr/bin/chromedriver"), options=opts)
    try:
        out = []
        for _ in range(loads):
            drv.get("file://" + os.path.abspath(path))
            t = drv.execute_script("var t = window.performance.timing; return t.loadEventEnd - t.navigationStart;")
            out.append(t / 1000.0)
        return out
    finally:
        drv.quit()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[1])
    ap.add_argument("--nodes", type=int, default=512)
    ap.add_argument("--rails", type=int, default=8)
    ap.add_argument("--fault", default="rail")
    ap.add_argument("--loads", type=int, default=3)
    ap.add_argument("--out", help="keep the page here (default: a temporary file)")
    a = ap.parse_args()
    state = simulated_state(a.nodes, a.rails, fault=a.fault or None)
    t0 = time.perf_counter()
    page = aiv.render_html(state)
    build_s = time.perf_counter() - t0
    size = len(page.encode())
    path = a.out or os.path.join(tempfile.mkdtemp(prefix="aiv-html-"), "report.html")
    with open(path, "w") as f:
        f.write(page)
    times = load_times(path, a.loads)
    med = statistics.median(times)
    ok = size <= MAX_BYTES and med <= MAX_S
    print(f"{'nodes':>6} {'rails':>6} {'GPUs':>6} {'bytes':>10} {'MB':>6} {'render_html s':>14} "
          f"{'browser load s (median of ' + str(a.loads) + ')':>32} {'target':>8}")
    print(f"{a.nodes:>6} {a.rails:>6} {len(state['ranks']):>6} {size:>10} {size / 2**20:>6.2f} {build_s:>14.3f} "
          f"{med:>32.3f} {'met' if ok else 'NOT met':>8}")
    print(f"page: {path}; loads: {', '.join(f'{t:.3f}' for t in times)} s")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
