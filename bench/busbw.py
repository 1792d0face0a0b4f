#!/usr/bin/env python3
"""Bus bandwidth of a plain torch all_reduce loop, next to ddp_mesh_ping.py --bandwidth, in one run.

  python bench/busbw.py [--sizes 1M,16M,256M,1G] [--reps 3]

The loop is the reference: NCCL all_reduce of float32, 5 warm-ups, 20 timed iterations,
cuda.synchronize, the slowest rank's time, busbw = size/time * 2(n-1)/n in 1e9 B/s (nccl-tests'
definition). Both are launched one process per GPU, alternated --reps times; medians compared.
"""
import argparse
import os
import re
import statistics
import sys

from _launch import launch, python

HERE = os.path.dirname(os.path.abspath(__file__))
LOOP = r"""
import datetime, os, sys, time, torch, torch.distributed as dist
r, w = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
torch.cuda.set_device(r)
dev = torch.device("cuda", r)
dist.init_process_group("nccl", init_method=f"tcp://{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}",
                        rank=r, world_size=w, device_id=dev, timeout=datetime.timedelta(seconds=120))
for size in [int(s) for s in sys.argv[1].split(",")]:
    x = torch.zeros(size // 4, device=dev)
    for _ in range(5):
        dist.all_reduce(x)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(20):
        dist.all_reduce(x)
    torch.cuda.synchronize()
    dt = torch.tensor([(time.perf_counter() - t0) / 20], dtype=torch.float64, device=dev)
    dist.all_reduce(dt, op=dist.ReduceOp.MAX)
    if r == 0:
        print(f"LOOP {size} {size / dt.item() / 1e9 * 2 * (w - 1) / w:.2f}", flush=True)
    del x
dist.destroy_process_group()
"""


def parse_size(s):
    m = re.fullmatch(r"(\d+)([KMG]?)", s.strip().upper())
    return int(m.group(1)) * {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}[m.group(2)]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="1M,16M,256M,1G")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--nproc", type=int, default=0)
    a = ap.parse_args()
    import torch
    n = a.nproc or torch.cuda.device_count()
    sizes = [parse_size(s) for s in a.sizes.split(",")]
    loop, ours = {s: [] for s in sizes}, {s: [] for s in sizes}
    for rep in range(a.reps):
        _, codes, text = launch([python(), "-c", LOOP, ",".join(map(str, sizes))], n)
        for m in re.finditer(r"^LOOP (\d+) ([\d.]+)", text, re.M):
            loop[int(m.group(1))].append(float(m.group(2)))
        _, codes2, text2 = launch([python(), os.path.join(os.path.dirname(HERE), "ddp_mesh_ping.py"),
                                   "--bandwidth=" + a.sizes], n)
        for m in re.finditer(r"busbw size=(\S+) time=\S+ algbw=\S+ busbw=([\d.]+)GB/s", text2):
            label = m.group(1)
            size = next(s for s in sizes if label in (f"{s / (1 << 20):.1f}MiB", f"{s / (1 << 30):.1f}GiB",
                                                     f"{s / (1 << 10):.1f}KiB"))
            ours[size].append(float(m.group(2)))
        print(f"round {rep + 1}: loop exit {codes}, ddp_mesh_ping exit {codes2}", flush=True)
        if any(codes) or any(codes2):
            print(text[-2000:], text2[-4000:], file=sys.stderr)
    print(f"\nranks={n} reps={a.reps}  (busbw GB/s, medians)")
    for s in sizes:
        lm, om = statistics.median(loop[s] or [0]), statistics.median(ours[s] or [0])
        print(f"{s:>12d} B  torch loop {lm:8.2f}  ddp_mesh_ping {om:8.2f}  ratio {om / lm if lm else 0:.3f}")


if __name__ == "__main__":
    main()
