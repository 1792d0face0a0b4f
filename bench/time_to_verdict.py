#!/usr/bin/env python3
"""Time to verdict: our full preflight against floors launched the same way, alternated in one run.

  python bench/time_to_verdict.py [--nproc N] [--reps 5] [--local] [--before OLD.py]

Each round launches, in turn: the bare floor (import torch, init over TCP, one all_reduce,
destroy), the DDP floor (the same plus DDP on nn.Linear(10, 10), one forward/backward), the
naive pre-existing design, ddp_mesh_ping.py, ddp_mesh_ping.py without its overlapped imports
(AIV_WARM_IMPORTS=0: the "before" of that optimisation) and with --skip-screen ("skip"). One process
per rank with srun-style variables; wall time from the first spawn to the last exit. Prints medians
and ratios, the screen phases' share of the wall (the screen-* times of rank 0's `Verdict: ...
phases=` line over the run's wall time), and for ddp_mesh_ping.py the median of each phase.

  --local        ddp_mesh_ping.py runs in local mode (--nproc N: its own launcher starts the ranks)
  --before PATH  adds "before": another version of ddp_mesh_ping.py (e.g. the main branch's:
                 git show main:ddp_mesh_ping.py > /tmp/before.py), launched as "ours" is, interleaved

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


def phase_times(text):
    """{phase: seconds} from the tool's `Verdict: ... phases=a=1.0 b=2.0` line ({} without one)."""
    m = re.search(r"^Verdict: .* phases=(.*)$", text, re.MULTILINE)
    return {k: float(v) for k, v in re.findall(r"([\w-]+)=([\d.]+)", m.group(1))} if m else {}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--nproc", type=int, default=0, help="ranks (default: GPUs, or 2 on CPU)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--log", help="append rank 0's output of every run here")
    ap.add_argument("--only", default="bare,ddp,naive,ours,nowarm,before", help="comma list of variants")
    ap.add_argument("--local", action="store_true", help="ddp_mesh_ping.py in local mode (--nproc N)")
    ap.add_argument("--before", help="another version of ddp_mesh_ping.py to time beside ours")
    a = ap.parse_args()
    n = a.nproc or gpu_count() or 2
    py = python()
    variants = {"bare": [py, os.path.join(HERE, "floor_bare.py")],
                "ddp": [py, os.path.join(HERE, "floor_ddp.py")],
                "naive": [py, os.path.join(HERE, "naive_preflight.py")],
                "ours": [py, os.path.join(ROOT, "ddp_mesh_ping.py"), "--timeout", "120"],
                "nowarm": [py, os.path.join(ROOT, "ddp_mesh_ping.py"), "--timeout", "120"],
                "skip": [py, os.path.join(ROOT, "ddp_mesh_ping.py"), "--timeout", "120", "--skip-screen"]}
    if a.before:
        variants["before"] = [py, os.path.abspath(a.before), "--timeout", "120"]
    tools = {"ours", "nowarm", "skip", "before"}
    if a.local:
        for v in tools & set(variants):
            variants[v] += ["--nproc", str(n)]
    envs = {"nowarm": {"AIV_WARM_IMPORTS": "0"}}
    chosen = [v for v in a.only.split(",") if v in variants]
    times, phases, shares = {v: [] for v in chosen}, {v: [] for v in chosen}, {"ours": [], "before": []}
    for rep in range(a.reps):
        for v in chosen:
            secs, codes, text = launch(variants[v], n, env=envs.get(v), log=a.log, local=a.local and v in tools)
            ok = all(c == 0 for c in codes)
            times[v].append(secs)
            phases[v].append(phase_times(text))
            screen = sum(s for p, s in phases[v][-1].items() if p.startswith("screen-"))
            if v in ("ours", "before") and screen:
                shares[v].append(screen / secs)
            print(f"round {rep + 1} {v:6s} {secs:6.2f}s exit={codes}" + ("" if ok else "  <-- FAILED")
                  + (f"  screen phases {screen:.2f}s ({100 * screen / secs:.1f}% of the wall)" if screen else ""),
                  flush=True)
            if not ok:
                print(text[-3000:], file=sys.stderr)
    print(f"\nranks={n} reps={a.reps}" + (" (ddp_mesh_ping.py in local mode)" if a.local else ""))
    med = {v: statistics.median(ts) for v, ts in times.items()}
    for v, ts in times.items():
        print(f"{v:6s} median {med[v]:6.2f}s  min {min(ts):6.2f}s  max {max(ts):6.2f}s")
    if "ours" in med:
        for base in ("bare", "ddp", "naive", "nowarm", "skip", "before"):
            if base in med:
                print(f"ours / {base:5s} = {med['ours'] / med[base]:.3f}")
    for v, sh in shares.items():
        if sh:
            print(f"screen phases' share of the wall ({v}): median {100 * statistics.median(sh):.1f}%  "
                  f"max {100 * max(sh):.1f}%")
    names = [p for v in chosen for run in phases[v] for p in run]
    names = list(dict.fromkeys(names))
    if names:
        print("\nphase medians (s), from each run's Verdict line:")
        print(f"{'phase':15s}" + "".join(f"{v:>9s}" for v in chosen if any(phases[v])))
        for p in names:
            row = [statistics.median([run[p] for run in phases[v] if p in run] or [float("nan")])
                   for v in chosen if any(phases[v])]
            print(f"{p:15s}" + "".join(f"{x:9.2f}" for x in row))


if __name__ == "__main__":
    main()
