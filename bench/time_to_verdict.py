#!/usr/bin/env python3
"""Time to verdict: our full preflight against floors launched the same way, alternated in one run.

  python bench/time_to_verdict.py [--nproc N] [--reps 5]

Each round launches, in turn: the bare floor (import torch, init over TCP, one all_reduce,
destroy), the DDP floor (the same plus DDP on nn.Linear(10, 10), one forward/backward), the
naive pre-existing design, ddp_mesh_ping.py, ddp_mesh_ping.py without its overlapped
imports (AIV_WARM_IMPORTS=0: the "before" of that optimisation), and ddp_mesh_ping.py --skip-screen
("skip"). One process per rank with srun-style variables; wall time from the first spawn to the last
exit. Prints medians and ratios, and for the tool's runs with the screen the screen phases' share of
the wall time (the screen-* phase times of rank 0's "Verdict: ... phases=" line over the run's wall).
On CUDA machines the ranks use NCCL (one per GPU), else gloo on CPU.
"""
import argparse
import os
import re
import statistics
import sys

from _launch import launch, python

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def gpu_count():
    try:
        import torch
        return torch.cuda.device_count()
    except ImportError:
        return 0


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--nproc", type=int, default=0, help="ranks (default: GPUs, or 2 on CPU)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--log", help="append rank 0's output of every run here")
    ap.add_argument("--only", default="bare,ddp,naive,ours,nowarm,skip", help="comma list of variants")
    a = ap.parse_args()
    n = a.nproc or gpu_count() or 2
    py = python()
    variants = {"bare": [py, os.path.join(HERE, "floor_bare.py")],
                "ddp": [py, os.path.join(HERE, "floor_ddp.py")],
                "naive": [py, os.path.join(HERE, "naive_preflight.py")],
                "ours": [py, os.path.join(ROOT, "ddp_mesh_ping.py"), "--timeout", "120"],
                "nowarm": [py, os.path.join(ROOT, "ddp_mesh_ping.py"), "--timeout", "120"],
                "skip": [py, os.path.join(ROOT, "ddp_mesh_ping.py"), "--timeout", "120", "--skip-screen"]}
    envs = {"nowarm": {"AIV_WARM_IMPORTS": "0"}}
    chosen = [v for v in a.only.split(",") if v in variants]
    times, shares = {v: [] for v in chosen}, []
    for rep in range(a.reps):
        for v in chosen:
            secs, codes, text = launch(variants[v], n, env=envs.get(v), log=a.log)
            ok = all(c == 0 for c in codes)
            times[v].append(secs)
            screen = screen_seconds(text) if v == "ours" else None
            if screen is not None:
                shares.append(screen / secs)
            print(f"round {rep + 1} {v:6s} {secs:6.2f}s exit={codes}" + ("" if ok else "  <-- FAILED")
                  + (f"  screen phases {screen:.2f}s ({100 * screen / secs:.1f}% of the wall)"
                     if screen is not None else ""), flush=True)
            if not ok:
                print(text[-3000:], file=sys.stderr)
    print(f"\nranks={n} reps={a.reps}")
    med = {v: statistics.median(ts) for v, ts in times.items()}
    for v, ts in times.items():
        print(f"{v:6s} median {med[v]:6.2f}s  min {min(ts):6.2f}s  max {max(ts):6.2f}s")
    for ours in ("ours", "skip"):
        for base in ("bare", "ddp", "naive", "nowarm"):
            if ours in med and base in med:
                print(f"{ours} / {base:5s} = {med[ours] / med[base]:.3f}")
    if shares:
        print(f"screen phases' share of the wall (ours): median {100 * statistics.median(shares):.1f}%  "
              f"max {100 * max(shares):.1f}%")


def screen_seconds(text):
    """The screen phases' seconds together, from rank 0's 'Verdict: ... phases=a=1.00 b=2.00' line; None when
    there is no such line or no screen phase in it."""
    m = re.search(r"^Verdict: .* phases=(.*)$", text or "", re.M)
    if m is None:
        return None
    secs = [float(v) for k, v in re.findall(r"([\w-]+)=([\d.]+)", m.group(1)) if k.startswith("screen-")]
    return sum(secs) if secs else None


if __name__ == "__main__":
    main()
