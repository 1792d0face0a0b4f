#!/usr/bin/env python3
"""Is the numerics check bitwise deterministic on this GPU, and what does it cost?

  python bench/numerics_determinism.py [--rounds 20] [--device 0] [--tool-rounds 5] [--nproc 1]

On one GPU (CUDA index --device), for the check's shapes and dtypes (aiv.NUMERICS_SHAPE['gpu']):
  in-process   the check --rounds times in this process: every digest must equal the first round's
  2 processes  the same check in a second process (a fresh CUDA context and cuBLAS handle): same digests
  2 streams    the check on two threads at once, each on a stream of its own: same digests
  under load   the check while another thread keeps the GPU busy with bf16 matmuls: same digests
and each check's worst error against the fp64 reference as a fraction of its tolerance (a healthy GPU is
well below 1). Cost: the median milliseconds of one whole check (after the first, which pays cuBLAS's
start), and the critical-path delta: --tool-rounds interleaved runs of the tool in local mode
(--nproc ranks, default 1) with and without --skip-numerics, medians of the elapsed time and of the
telemetry phase (where a GPU rank waits for its measuring thread's numerics if it is not done).
Prints a small table; exit 1 when any digest differs.
"""
import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import ddp_mesh_ping as aiv  # noqa: E402


def digests(res):
    return {c: p["digest"] for c, p in res["checks"].items()}


def child(dev):
    import torch
    print(json.dumps(digests(aiv.numerics_measure(torch, dev, "gpu"))))


def in_process(torch, dev, rounds):
    first, times, same, worst = None, [], True, {}
    for i in range(rounds):
        t = time.perf_counter()
        res = aiv.numerics_measure(torch, dev, "gpu")  # synchronises: its digests are read back
        if i:
            times.append((time.perf_counter() - t) * 1e3)
        d = digests(res)
        first = first or d
        same &= d == first
        for c, p in res["checks"].items():
            worst[c] = max(worst.get(c, 0.0), p["err"] / p["tol"])
    return first, same, times, worst


def two_streams(torch, dev):
    out = [None, None]

    def run(i):
        out[i] = digests(aiv.numerics_measure(torch, dev, "gpu"))
    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def under_load(torch, dev):
    stop = threading.Event()

    def load():
        torch.cuda.set_device(dev)
        s = torch.cuda.Stream(dev)
        with torch.cuda.stream(s):
            a = torch.randn(8192, 8192, device=f"cuda:{dev}", dtype=torch.bfloat16)
            while not stop.is_set():
                for _ in range(8):
                    a @ a
                s.synchronize()
    t = threading.Thread(target=load, daemon=True)
    t.start()
    time.sleep(0.5)
    try:
        return digests(aiv.numerics_measure(torch, dev, "gpu"))
    finally:
        stop.set()
        t.join()


def tool_runs(rounds, nproc):
    """Interleaved runs of the tool with and without --skip-numerics -> {mode: [(elapsed, telemetry, ddp)]}."""
    out = {"on": [], "off": []}
    for _ in range(rounds):
        for mode in ("on", "off"):
            cmd = [sys.executable, os.path.join(ROOT, "ddp_mesh_ping.py"), "--nproc", str(nproc)]
            r = subprocess.run(cmd + (["--skip-numerics"] if mode == "off" else []), capture_output=True, text=True)
            m = re.search(r"Verdict: (\w+) exit=\d+ elapsed=([\d.]+)s phases=(.*)", r.stdout)
            if not m or m.group(1) != "PASS":
                print(f"tool run ({mode}) did not pass:\n{r.stdout[-2000:]}", file=sys.stderr)
                continue
            ph = dict(kv.split("=") for kv in m.group(3).split())
            out[mode].append((float(m.group(2)), float(ph.get("telemetry", 0)), float(ph.get("ddp", 0))))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--device", type=int, default=0)
    ap.add_argument("--tool-rounds", type=int, default=5, help="0: no tool runs")
    ap.add_argument("--nproc", type=int, default=1)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        return child(a.device)
    import torch
    if not torch.cuda.is_available():
        print("no CUDA device: this measures a GPU", file=sys.stderr)
        return 2
    dev = a.device
    name = torch.cuda.get_device_name(dev)
    t = time.perf_counter()
    base = digests(aiv.numerics_measure(torch, dev, "gpu"))
    first_ms = (time.perf_counter() - t) * 1e3
    d, same, times, worst = in_process(torch, dev, a.rounds)
    same &= d == base
    other = json.loads(subprocess.run([sys.executable, __file__, "--child", "--device", str(dev)], capture_output=True,
                                      text=True, check=True).stdout.strip().splitlines()[-1])
    streams = two_streams(torch, dev)
    loaded = under_load(torch, dev)
    sw = aiv.numerics_software(torch, dev, "gpu")
    m, k, n = aiv.NUMERICS_SHAPE["gpu"]
    print(f"GPU {dev}: {name}; {aiv.numerics_group(name, sw)}")
    print(f"shapes: {m} x {k} by {k} x {n}; elementwise {aiv.NUMERICS_ELEMENTS['gpu']} elements")
    print(f"{'check':<18} {'in-process':>11} {'2 processes':>12} {'2 streams':>10} {'under load':>11} {'err/tol':>9}")
    bad = False
    for c in base:
        cells = [same, other.get(c) == base[c], all(s.get(c) == base[c] for s in streams), loaded.get(c) == base[c]]
        bad |= not all(cells)
        marks = [f"{'same' if x else 'DIFFERS':>{w}}" for x, w in zip(cells, (11, 12, 10, 11), strict=True)]
        print(f"{c:<18} " + " ".join(marks) + f" {worst.get(c, 0):>9.3g}")
    print(f"cost: median {statistics.median(times):.1f} ms per check over {len(times)} rounds "
          f"(first {first_ms:.0f} ms, with cuBLAS's start)")
    if a.tool_rounds:
        runs = tool_runs(a.tool_rounds, a.nproc)
        if runs["on"] and runs["off"]:
            med = {k: [statistics.median(x[i] for x in v) for i in range(3)] for k, v in runs.items()}
            print(f"tool, {a.nproc} rank(s), {len(runs['on'])}/{len(runs['off'])} interleaved runs (median):")
            print(f"  {'':<16} {'elapsed s':>10} {'telemetry s':>12} {'ddp s':>8}")
            for mode, label in (("on", "numerics on"), ("off", "--skip-numerics")):
                print(f"  {label:<16} {med[mode][0]:>10.2f} {med[mode][1]:>12.3f} {med[mode][2]:>8.3f}")
            print(f"  critical-path delta: {med['on'][0] - med['off'][0]:+.2f} s elapsed, "
                  f"{med['on'][1] - med['off'][1]:+.3f} s telemetry, {med['on'][2] - med['off'][2]:+.3f} s ddp")
    print("bitwise deterministic: " + ("NO (see DIFFERS above)" if bad else "yes"))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
