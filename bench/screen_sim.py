#!/usr/bin/env python3
"""The whole network screen (intra-node and inter-node) in simulation: the tool's own screen_loop and
judges, driven by a simulated measure().

  python bench/screen_sim.py [--nodes 4,8,16,32,64,128,256,512] [--p 1,3,5] [--trials 40] [--seed 1]
                             [--gpus 8] [--noise 0.02] [--json OUT]
  (environment: AIV_SIM_TRIALS, AIV_SIM_NODES override the defaults of --trials and --nodes)

Every node has --gpus GPUs and as many rails. A measurement is its kind's speed (all_reduce inside a
node 480 GB/s, between two GPUs of a node 360, between nodes 48 per rail) x a planted fault x (1 +
Gaussian noise, sigma --noise), halved with probability p (a transient: another job, a burst), drawn
again for every measurement of every batch. Each cell runs --trials healthy screens and --trials
screens with one planted fault, the kinds taken in turn:
  node      one node slow on every rail (0.5x) between nodes
  rail      one node slow on one rail (0.5x)
  link      one path between two nodes on one rail (0.5x): a suspect link, no host
  gpu       one GPU's NVLink (0.5x: every pair with it, and its node's all_reduce)
  gpu-pair  the NVLink between two GPUs of one node (0.5x: that pair, and its node's all_reduce)
Healthy: FAIL is a trial with a FAIL finding; hosts named counts the hosts of WARN and FAIL findings.
Planted: found when the finding names the fault (its node, or for a link the suspect link); exact when
it names exactly that (the node; the rail; the link and no host; the GPU's rank; the pair's two ranks)
and nothing else. Batches: calls of measure() per screen. Targets (at p <= 3%, 64-512 nodes): 0 hosts
named on a healthy cluster, every planted fault found exactly, at most 16 batches healthy, 24 planted.
"""
import argparse
import json
import os
import random
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import ddp_mesh_ping as aiv  # noqa: E402

SPEED = {"intra": 480.0, "gpu-pair": 360.0, "pair": 48.0}
FAULTS = ("node", "rail", "link", "gpu", "gpu-pair")
SIZES = (4, 8, 16, 32, 64, 128, 256, 512)
HEADER = ("| nodes | p | healthy: FAIL | hosts named mean/max | batches mean/max | planted: found | exact "
          "| batches mean/max |")


def records(n, gpus):
    return [{"rank": i * gpus + lr, "host": f"gpu-{i + 1:04d}", "local_rank": lr, "gpu": {"name": "NVIDIA H200"}}
            for i in range(n) for lr in range(gpus)]


def plant(kind, n, gpus, rng):
    """-> the planted fault: {'kind', 'node', 'rail', 'gpus', 'link'}."""
    hosts = [f"gpu-{i + 1:04d}" for i in range(n)]
    f = {"kind": kind, "node": rng.choice(hosts), "rail": rng.randrange(gpus), "gpus": (), "link": ()}
    if kind == "link":
        pairs = [g for g in aiv.screen_rounds(hosts)[0] if len(g) == 2]
        f["link"], f["node"] = tuple(rng.choice(pairs)), None
    if kind == "gpu":
        f["gpus"] = (rng.randrange(gpus),)
    if kind == "gpu-pair":
        f["gpus"] = tuple(sorted(rng.sample(range(gpus), 2)))
    return f


def factor(g, fault):
    """The planted fault's factor on one group."""
    if not fault:
        return 1.0
    k, nodes = fault["kind"], g["nodes"]
    if g["kind"] == "pair":
        if k == "node" and fault["node"] in nodes:
            return 0.5
        if k == "rail" and fault["node"] in nodes and g["rail"] == fault["rail"]:
            return 0.5
        if k == "link" and set(fault["link"]) == set(nodes) and g["rail"] == fault["rail"]:
            return 0.5
        return 1.0
    if k not in ("gpu", "gpu-pair") or nodes != [fault["node"]]:
        return 1.0
    if g["kind"] == "intra":
        return 0.5
    return 0.5 if (set(fault["gpus"]) <= set(g["gpus"])) else 1.0


def simulated_measure(rng, p, noise, fault=None):
    def measure(groups):
        out = {}
        for g in groups:
            v = SPEED[g["kind"]] * factor(g, fault) * (0.5 if rng.random() < p else 1.0) * (1 + rng.gauss(0, noise))
            for r in g["ranks"]:
                out[r] = {"busbw": v, "time_us": 1000.0}
        return out
    return measure


def judged(recs, measure):
    screen = dict(aiv.screen_loop(recs, measure), cpu=False)
    findings = aiv.judge_screen(screen)
    named = {h for f in findings if f["status"] != "PASS" for h in f["hosts"]}
    return screen, findings, named


def exact(fault, screen, findings, named, gpus):
    """(found, exact) for a planted fault."""
    bad = [f for f in findings if f["status"] != "PASS" and f["hosts"]]
    if fault["kind"] == "link":
        links = [(tuple(s["hosts"]), s["rail"]) for s in screen["suspect_links"]]
        found = (tuple(aiv._screen_sorted(fault["link"])), fault["rail"]) in links
        return found, found and not named and len(links) == 1
    node = fault["node"]
    found = node in named
    if not found or named != {node}:
        return found, False
    if fault["kind"] in ("gpu", "gpu-pair"):
        base = (int(node.split("-")[1]) - 1) * gpus
        want = sorted(base + x for x in fault["gpus"])
        return found, [f["ranks"] for f in bad] == [want] and bad[0]["check"] == "intra-node"
    if fault["kind"] == "rail":
        why = bad[0]["reason"]
        return found, len(bad) == 1 and f"rail {fault['rail']}" in why and "every rail" not in why
    return found, len(bad) == 1 and "every rail" in bad[0]["reason"]


def cell(n, p, trials, seed, gpus=8, noise=0.02):
    """One row of the table: `trials` healthy and `trials` planted screens of n nodes at transient rate p."""
    rng = random.Random(f"{seed}:{n}:{p}")
    recs = records(n, gpus)
    h = {"fail": 0, "named": [], "batches": []}
    for _ in range(trials):
        screen, findings, named = judged(recs, simulated_measure(rng, p, noise))
        h["fail"] += any(f["status"] == "FAIL" for f in findings)
        h["named"].append(len(named))
        h["batches"].append(len(screen["batches"]))
    pl = {"found": 0, "exact": 0, "batches": [], "misses": []}
    for i in range(trials):
        fault = plant(FAULTS[i % len(FAULTS)], n, gpus, rng)
        screen, findings, named = judged(recs, simulated_measure(rng, p, noise, fault))
        found, ok = exact(fault, screen, findings, named, gpus)
        pl["found"] += found
        pl["exact"] += ok
        pl["batches"].append(len(screen["batches"]))
        if not ok:
            pl["misses"].append(fault["kind"])
    return {"nodes": n, "p": p, "trials": trials, "healthy_fail": h["fail"],
            "hosts_named_mean": sum(h["named"]) / trials, "hosts_named_max": max(h["named"]),
            "healthy_batches_mean": sum(h["batches"]) / trials, "healthy_batches_max": max(h["batches"]),
            "found": pl["found"], "exact": pl["exact"], "misses": pl["misses"],
            "planted_batches_mean": sum(pl["batches"]) / trials, "planted_batches_max": max(pl["batches"])}


def row(c):
    t = c["trials"]
    return (f"| {c['nodes']} | {c['p']:.0%} | {c['healthy_fail']}/{t} | {c['hosts_named_mean']:.2f}/"
            f"{c['hosts_named_max']} | {c['healthy_batches_mean']:.1f}/{c['healthy_batches_max']} | "
            f"{c['found']}/{t} | {c['exact']}/{t} | {c['planted_batches_mean']:.1f}/{c['planted_batches_max']} |")


def table(sizes=SIZES, ps=(0.01, 0.03, 0.05), trials=40, seed=1, gpus=8, noise=0.02, out=None):
    """-> (markdown lines, cells); out: a callable given each line as it is made."""
    lines, cells = [HEADER, "|" + "---|" * (HEADER.count("|") - 1)], []
    for line in lines:
        (out or (lambda _: None))(line)
    for n in sizes:
        for p in ps:
            c = cell(n, p, trials, seed, gpus, noise)
            cells.append(c)
            lines.append(row(c))
            (out or (lambda _: None))(lines[-1])
    return lines, cells


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[1])
    ap.add_argument("--nodes", default=os.environ.get("AIV_SIM_NODES", ",".join(map(str, SIZES))))
    ap.add_argument("--p", default="1,3,5", help="transient halving rates in percent (default 1,3,5)")
    ap.add_argument("--trials", type=int, default=int(os.environ.get("AIV_SIM_TRIALS", "40")))
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--gpus", type=int, default=8, help="GPUs (and rails) per node (default 8)")
    ap.add_argument("--noise", type=float, default=0.02, help="Gaussian sigma, relative (default 0.02)")
    ap.add_argument("--json", metavar="OUT", help="write the cells as JSON")
    a = ap.parse_args()
    sizes, ps = [int(x) for x in a.nodes.split(",")], [float(x) / 100 for x in a.p.split(",")]
    print(f"screen_sim: {a.gpus} GPUs and rails per node, noise sigma {a.noise:.0%}, {a.trials} healthy and "
          f"{a.trials} planted trials per cell, seed {a.seed}")
    t0 = time.perf_counter()
    _, cells = table(sizes, ps, a.trials, a.seed, a.gpus, a.noise, out=lambda s: print(s, flush=True))
    ok = all(c["hosts_named_max"] == 0 and c["exact"] == c["trials"] and c["healthy_batches_max"] <= 16
             and c["planted_batches_max"] <= 24 for c in cells if c["p"] <= 0.03 and c["nodes"] >= 64)
    print(f"targets (p <= 3%, 64-512 nodes: 0 hosts named, every fault exact, batches <= 16 / 24): "
          f"{'met' if ok else 'NOT met'} ({time.perf_counter() - t0:.0f}s)")
    for c in cells:
        if c["misses"]:
            print(f"  N={c['nodes']} p={c['p']:.0%}: not exact: {', '.join(c['misses'])}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"gpus": a.gpus, "noise": a.noise, "seed": a.seed, "cells": cells, "targets_met": ok}, f,
                      indent=2)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
