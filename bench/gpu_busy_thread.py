#!/usr/bin/env python3
"""The GPU screen beside busy threads, and its dependence on the block size, on one GPU.

  python bench/gpu_busy_thread.py [--n 40] [--json out.json]

1. quiet: N/4 measurements with screen_measure_gpu on the main thread (the reference);
2. N measurements on the measuring thread (start_screen_gpu / take_screen_gpu, as a rank does) while
   1 pure-Python thread spins beside it, and N/4 with 4 such threads: how many gave no number
   (HostStarved), each number against the quiet median, and the seconds each took; then N/4 beside 1
   thread with the interpreter's switch interval left as it is (no quick_switch), side by side;
3. the block size: the matmul and the memory rate timed with blocks of k, 2k, 4k and 8k operations
   (k as the screen picks it), --rounds rounds each, interleaved: the spread of the medians; then the
   same sizes each after untimed calls that make every measurement's load equally long (8k blocks' worth):
   the block size alone, apart from how long the load lasted (the power cap);
4. the duty cycle: the same measurement after the device was idle 0, 0.5 and 2 s (its clocks and power
   budget recover while idle), --rounds rounds each, interleaved: the spread of the medians.
Prints one table; --json writes the raw numbers."""
import argparse
import contextlib
import json
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import torch  # noqa: E402

import ddp_mesh_ping as aiv  # noqa: E402


def hogs(n, stop):
    def spin():
        x = 0
        while not stop.is_set():
            x += 1
    ts = [threading.Thread(target=spin, daemon=True) for _ in range(n)]
    for t in ts:
        t.start()
    return ts


def beside(n_threads, n, dev):
    out = []
    stop = threading.Event()
    ts = hogs(n_threads, stop)
    try:
        for _ in range(n):
            t0 = time.monotonic()
            box = aiv.start_screen_gpu(torch, dev, numerics=False)
            try:
                row = aiv.take_screen_gpu(box)
                out.append({"tflops": row["tflops"], "hbm_gbps": row["hbm_gbps"], "secs": time.monotonic() - t0})
            except aiv.HostStarved as e:
                out.append({"starved": str(e), "secs": time.monotonic() - t0})
    finally:
        stop.set()
        for t in ts:
            t.join()
    return out


def block_sizes(dev, rounds):
    """Rates at k, 2k, 4k, 8k operations a block, interleaved rounds."""
    cuda = torch.cuda
    cuda.set_device(dev)
    stream = cuda.Stream(dev)
    (a, b, c), (src, dst) = aiv._screen_operands(torch, dev, "gpu")
    stream.wait_stream(cuda.current_stream(dev))
    mm = (lambda: torch.mm(a, b, out=c), 2 * aiv.SCREEN_MATMUL_N["gpu"] ** 3 / 1e12)
    scale = (lambda: torch.mul(src, 1.0, out=dst), 2 * src.numel() * 4 / 1e9)
    base = {}
    for name, (fn, _work) in (("tflops", mm), ("hbm_gbps", scale)):
        # the k the screen picks, from its own calibration
        with cuda.stream(stream):
            fn()
            e0 = cuda.Event(enable_timing=True)
            e1 = cuda.Event(enable_timing=True)
            e0.record(stream)
            fn()
            fn()
            e1.record(stream)
        e1.synchronize()
        base[name] = max(1, int(aiv.SCREEN_TARGET_S["gpu"] / aiv.SCREEN_BLOCKS / max(e0.elapsed_time(e1) / 2e3, 1e-7)))
    rates = {name: {m: [] for m in (1, 2, 4, 8)} for name in base}
    for _ in range(rounds):
        for m in (1, 2, 4, 8):
            for name, (fn, work) in (("tflops", mm), ("hbm_gbps", scale)):
                r, _g = aiv._device_rate(torch, fn, work, stream, k=base[name] * m)
                rates[name][m].append(r)
    # the same sizes after the same load: blocks of m*k preceded by (8 - m) * k * (SCREEN_BLOCKS + 1) untimed
    # calls, so that every measurement ends after 8k * (SCREEN_BLOCKS + 1) calls of load (the device idle
    # only while the measurement's graph is captured): the block size alone, not how long the load lasted
    equal = {name: {m: [] for m in (1, 2, 4, 8)} for name in base}
    for _ in range(rounds):
        for m in (1, 2, 4, 8):
            for name, (fn, work) in (("tflops", mm), ("hbm_gbps", scale)):
                with cuda.stream(stream):
                    for _i in range((8 - m) * base[name] * (aiv.SCREEN_BLOCKS + 1)):
                        fn()
                r, _g = aiv._device_rate(torch, fn, work, stream, k=base[name] * m)
                equal[name][m].append(r)
    duty = {name: {gap: [] for gap in (0.0, 0.5, 2.0)} for name in base}
    for _ in range(rounds):
        for gap in (0.0, 0.5, 2.0):
            for name, (fn, work) in (("tflops", mm), ("hbm_gbps", scale)):
                cuda.synchronize(dev)
                time.sleep(gap)
                r, _g = aiv._device_rate(torch, fn, work, stream, k=base[name])
                duty[name][gap].append(r)
    return base, rates, equal, duty


def spread(by):
    meds = {m: statistics.median(v) for m, v in by.items()}
    return meds, max(meds.values()) / min(meds.values()) - 1


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    dev = 0
    timing = "one graph, events inside it" if aiv.graph_timing(torch) else "gated blocks"
    print(f"{torch.cuda.get_device_name(dev)}, torch {torch.__version__}; timing: {timing}")
    quiet = [aiv.screen_measure_gpu(torch, dev, "gpu") for _ in range(max(3, a.n // 4))]
    q = {k: statistics.median(r[k] for r in quiet) for k in ("tflops", "hbm_gbps")}
    print(f"quiet ({len(quiet)}): matmul {q['tflops']:.1f} TFLOPS, memory {q['hbm_gbps']:.0f} GB/s (medians)")
    res = {"quiet": quiet}
    quick = aiv.quick_switch
    for n_threads, n, switch in ((1, a.n, True), (4, max(3, a.n // 4), True), (1, max(3, a.n // 4), False)):
        aiv.quick_switch = quick if switch else contextlib.nullcontext
        try:
            rows = beside(n_threads, n, dev)
        finally:
            aiv.quick_switch = quick
        name = f"busy{n_threads}" + ("" if switch else "_no_quick_switch")
        res[name] = rows
        got = [r for r in rows if "tflops" in r]
        starved = len(rows) - len(got)
        how = "" if switch else " (switch interval left as it is)"
        line = f"beside {n_threads} busy thread(s){how}: {len(rows)} measurements, {starved} HostStarved"
        if got:
            for k in ("tflops", "hbm_gbps"):
                ratios = [r[k] / q[k] for r in got]
                line += f"; {k} / quiet min {min(ratios):.3f} median {statistics.median(ratios):.3f}"
            line += f"; seconds each median {statistics.median(r['secs'] for r in rows):.2f}"
        print(line)
    base, rates, equal, duty = block_sizes(dev, a.rounds)
    res["block_sizes"] = {"k": base, "rates": rates, "equal_load": equal, "duty": duty}
    for name, by in rates.items():
        meds, sp = spread(by)
        print(f"block size ({name}, k={base[name]}): " + ", ".join(f"{m}k {v:.1f}" for m, v in meds.items())
              + f"; spread of the medians {100 * sp:.2f}%")
    for name, by in equal.items():
        meds, sp = spread(by)
        print(f"block size after the same load ({name}): " + ", ".join(f"{m}k {v:.1f}" for m, v in meds.items())
              + f"; spread of the medians {100 * sp:.2f}%")
    for name, by in duty.items():
        meds, sp = spread(by)
        print(f"idle before ({name}): " + ", ".join(f"{g:g}s {v:.1f}" for g, v in meds.items())
              + f"; spread of the medians {100 * sp:.2f}%")
    if a.json:
        a.json.write_text(json.dumps(res, indent=1, default=str))


if __name__ == "__main__":
    main()
