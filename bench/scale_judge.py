#!/usr/bin/env python3
"""Judge and report at scale: 512 nodes x 8 ranks of realistic gathered data, on one CPU core.

  python bench/scale_judge.py [--nodes 512] [--per-node 8] [--reps 5]

Builds per-rank records shaped like the ones ranks gather to rank 0 (a full node record on each
node's local rank 0), plants a few faults (a slow IB port, a busy GPU, a torch drift), then times
judge_all + render_report + verify_log and prints the payload size per rank. Target: < 1 s.
"""
import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import ddp_mesh_ping as aiv  # noqa: E402


def records(nodes, per_node):
    out = []
    for n in range(nodes):
        host = f"gpu-{n + 1:04d}"
        for lr in range(per_node):
            r = n * per_node + lr
            rec = {"rank": r, "host": host, "hostname": host, "local_rank": lr, "backend": "nccl", "device": lr,
                   "cvd": "0,1,2,3,4,5,6,7", "cpus": f"{lr * 12}-{lr * 12 + 11}", "pid": 100000 + r,
                   "versions": {"torch": "2.11.0+cu130", "cuda": "13.0", "nccl": "2.28.3", "python": "3.12.3"},
                   "gpu": {"name": "NVIDIA H200", "vram": 150_754_820_096, "uuid": f"GPU-{n:08x}-{lr:04x}-4b1c-9d2e",
                           "pci": f"0000:{0x18 + lr * 0x10:02x}:00.0", "numa": lr // 4,
                           "numa_cpus": "0-47" if lr < 4 else "48-95", "mem_used": 560 << 20},
                   "local": [aiv.finding("interface", "PASS", f"NCCL_SOCKET_IFNAME=eth0 selects eth0 on {host}",
                                         [host], [r])]}
            if lr == 0:
                rec["node"] = {
                    "cpu_model": "Intel(R) Xeon(R) Platinum 8480+", "cpus": 224, "mem_total": 2_164_000_000_000,
                    "os": "Ubuntu 22.04.5 LTS", "kernel": "5.15.0-1110-azure", "driver": "580.159.04",
                    "ib": [{"port": f"mlx5_{i}:1", "state": "ACTIVE", "rate_gbps": 400.0,
                            "link_layer": "InfiniBand"} for i in range(8)],
                    "peermem": True, "memlock": "unlimited", "shm": 1 << 40,
                    "ifaces": {"eth0": [f"10.1.{n // 256}.{n % 256}"], "lo": ["127.0.0.1"]},
                    "gpus_visible": 8, "peer": ["".join("X" if i == j else "1" for j in range(8)) for i in range(8)],
                    "imports": {"torchvision": {"ok": True, "version": "0.26.0"},
                                "torchaudio": {"ok": True, "version": "2.11.0"}}}
            out.append(rec)
    # planted faults: one slow HCA, one busy GPU, one node with another torch
    out[8 * 17]["node"]["ib"][3]["rate_gbps"] = 200.0
    out[8 * 101 + 5]["gpu"]["mem_used"] = 60 << 30
    for r in out[8 * 300: 8 * 301]:
        r["versions"] = dict(r["versions"], torch="2.10.0+cu130")
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--nodes", type=int, default=512)
    ap.add_argument("--per-node", type=int, default=8)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--show", action="store_true", help="print the rendered report once")
    a = ap.parse_args()
    recs = records(a.nodes, a.per_node)
    world = len(recs)
    expect = {"world_size": world, "nodes": a.nodes, "ranks_per_node": a.per_node}
    sizes = [len(json.dumps(r)) for r in recs]
    judge_t, render_t, verify_t = [], [], []
    for _ in range(a.reps):
        t0 = time.perf_counter()
        findings = aiv.judge_all(recs, world, expect)
        t1 = time.perf_counter()
        code = aiv.verdict_code(findings)
        state = {"world_size": world, "backend": "nccl", "ranks": recs, "findings": findings,
                 "verdict": "PASS" if code == 0 else "FAIL", "exit_code": code, "elapsed_s": 0.0, "phases": {},
                 "failures": aiv.failure_lines(findings), "collectives": None, "env": {}}
        text = f"Total Execution Ranks: {world}\n" + aiv.render_report(state)
        t2 = time.perf_counter()
        ok, problems, facts = aiv.verify_log(text, expect)
        t3 = time.perf_counter()
        judge_t.append(t1 - t0)
        render_t.append(t2 - t1)
        verify_t.append(t3 - t2)
    if a.show:
        print(text)
    lines = text.count("\n") + 1
    fails = [f for f in findings if f["status"] == "FAIL"]
    warns = [f for f in findings if f["status"] == "WARN"]
    print(f"ranks={world} nodes={a.nodes} per_node={a.per_node}")
    print(f"payload per rank: max {max(sizes)} B (node leader), median {statistics.median(sizes):.0f} B")
    print(f"judge  median {statistics.median(judge_t) * 1e3:7.1f} ms")
    print(f"render median {statistics.median(render_t) * 1e3:7.1f} ms  ({lines} lines)")
    print(f"verify median {statistics.median(verify_t) * 1e3:7.1f} ms  (log fails as it should: {not ok}, "
          f"nodes counted {facts.get('nodes')})")
    total = statistics.median(judge_t) + statistics.median(render_t)
    print(f"judge+render {total:.3f} s  target < 1 s: {'MET' if total < 1 else 'MISSED'}")
    print(f"planted faults found: {len(fails)} FAIL, {len(warns)} WARN")
    for f in fails + warns:
        print(f"  [{f['status']}] {f['check']}: {f['reason'][:150]}")


if __name__ == "__main__":
    main()
