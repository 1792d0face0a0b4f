#!/usr/bin/env python3
"""Performance screen at scale: the pairing and localisation code on simulated measurements.

  python bench/screen_sim.py [--nodes 512] [--rails 8] [--trials 100] [--seed 1] [--noise 0.05] [--json OUT]

Each trial plants one slow node (0.5x on one rail; a second variant: 0.5x on every rail) and one
slow link (0.5x on every rail of a pair the schedule measures, not involving the slow node), draws
every measurement as 48 GB/s x fault x (1 + Gaussian noise, sigma --noise), runs rounds 1 and 2,
derives the suspects, runs the suspect round, and judges. A trial is right when the judge names
exactly the planted node (with its rail, or every rail) and the planted link, and nothing else
(no other FAIL or WARN). Targets: >= 99/100 right, judging < 1 s per trial.
"""
import argparse
import json
import os
import random
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import ddp_mesh_ping as aiv  # noqa: E402

BASE_GBPS = 48.0


def measure(rnd, groups, rails, rng, noise, bad_node, bad_rails, bad_link):
    """One round's results: every group on every rail at once."""
    out = []
    for g in groups:
        for rail in rails:
            factor = 1.0
            if bad_node in g and rail in bad_rails:
                factor *= 0.5
            if bad_link <= set(g):
                factor *= 0.5
            out.append({"round": rnd, "nodes": tuple(g), "rail": rail, "hca": f"mlx5_{rail}",
                        "busbw": BASE_GBPS * factor * (1.0 + rng.gauss(0.0, noise))})
    return out


def trial(nodes, rails, rng, noise, every_rail):
    rounds = aiv.screen_rounds(nodes)
    bad_node = rng.choice(nodes)
    bad_rails = set(rails) if every_rail else {rng.choice(rails)}
    pairs = [g for r in rounds for g in r if bad_node not in g and len(g) == 2]
    bad_link = set(rng.choice(pairs))
    results = []
    for i, groups in enumerate(rounds, 1):
        results += measure(i, groups, rails, rng, noise, bad_node, bad_rails, bad_link)
    t0 = time.perf_counter()
    plan = aiv.screen_third_round(results)
    t1 = time.perf_counter()
    if plan["groups"]:
        results += measure(3, plan["groups"], rails, rng, noise, bad_node, bad_rails, bad_link)
    t2 = time.perf_counter()
    findings, _ = aiv.judge_pairs(results)
    d = aiv.screen_diagnose(results)
    t3 = time.perf_counter()
    named_nodes = {}
    for n, rail in d["culprits"]:
        named_nodes.setdefault(n, set()).add(rail)
    named_links = {frozenset(results[i]["nodes"]) for i in d["links"]}
    flagged = [f for f in findings if f["status"] != "PASS"]
    right = (named_nodes == {bad_node: bad_rails} and named_links == {frozenset(bad_link)}
             and len(flagged) == 2 and not d["widespread"])
    return {"right": right, "judge_s": (t1 - t0) + (t3 - t2), "suspects": len(plan["suspects"]),
            "round3": len(plan["groups"] or []), "measurements": len(results),
            "false_nodes": len(set(named_nodes) - {bad_node}), "false_links": len(named_links - {frozenset(bad_link)}),
            "missed": int(bad_node not in named_nodes) + int(frozenset(bad_link) not in named_links)}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[1])
    ap.add_argument("--nodes", type=int, default=512)
    ap.add_argument("--rails", type=int, default=8)
    ap.add_argument("--trials", type=int, default=100)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--noise", type=float, default=0.05, help="Gaussian sigma, relative (default 0.05)")
    ap.add_argument("--json", metavar="OUT", help="write the results as JSON")
    a = ap.parse_args()
    if a.nodes < 6:
        ap.error("--nodes must be at least 6 (a planted link that avoids the planted node must exist)")
    nodes = [f"gpu-{i + 1:04d}" for i in range(a.nodes)]
    rails = list(range(a.rails))
    rows = []
    for variant, every in (("node slow on one rail", False), ("node slow on every rail", True)):
        rng = random.Random(f"{a.seed}:{variant}")
        ts = [trial(nodes, rails, rng, a.noise, every) for _ in range(a.trials)]
        rows.append({"variant": variant, "trials": a.trials, "right": sum(t["right"] for t in ts),
                     "false_nodes": sum(t["false_nodes"] for t in ts), "false_links": sum(t["false_links"] for t in ts),
                     "missed": sum(t["missed"] for t in ts),
                     "suspects_mean": statistics.mean(t["suspects"] for t in ts),
                     "measurements_mean": statistics.mean(t["measurements"] for t in ts),
                     "judge_s_mean": statistics.mean(t["judge_s"] for t in ts),
                     "judge_s_max": max(t["judge_s"] for t in ts)})
    print(f"screen_sim: {a.nodes} nodes x {a.rails} rails, noise sigma {a.noise:.0%}, {a.trials} trials, "
          f"seed {a.seed}; planted: one node at 0.5x, one link at 0.5x on every rail")
    hdr = f"{'variant':<26}{'right':>9}{'false node':>12}{'false link':>12}{'missed':>8}{'suspects':>10}" \
          f"{'meas.':>7}{'judge mean':>12}{'judge max':>11}"
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        print(f"{r['variant']:<26}{r['right']:>5}/{r['trials']:<3}{r['false_nodes']:>12}{r['false_links']:>12}"
              f"{r['missed']:>8}{r['suspects_mean']:>10.1f}{r['measurements_mean']:>7.0f}"
              f"{r['judge_s_mean']:>11.3f}s{r['judge_s_max']:>10.3f}s")
    ok = all(r["right"] >= 0.99 * r["trials"] and r["judge_s_max"] < 1.0 for r in rows)
    print(f"target (>= 99% right, judge < 1 s per trial): {'met' if ok else 'NOT met'}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"nodes": a.nodes, "rails": a.rails, "noise": a.noise, "seed": a.seed, "rows": rows,
                       "target_met": ok}, f, indent=2)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
