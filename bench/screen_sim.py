#!/usr/bin/env python3
"""Performance screen under fabric contention: the tool's own schedule, re-measurement and judges on
simulated measurements.

  python bench/screen_sim.py [--nodes 16,64,256,512] [--rails 8] [--trials 100] [--seed 1] [--noise 0.02]
                             [--json OUT]
  (environment: AIV_SIM_TRIALS, AIV_SIM_NODES override the defaults of --trials and --nodes)

Every measurement is 48 GB/s x planted fault x contention x (1 + Gaussian noise, sigma --noise). It runs
as the runtime does: each pair round with every group at once, then its slow measurements re-measured
(screen_remeasure_plan: round r1 all of them together, r2 and r3 half each; screen_best keeps the best),
then the suspect round (screen_third_round) with its own re-measurement, then judge_pairs. Contention
is drawn again for every batch of groups that runs together, so a re-measure sees a fresh draw:
  transient p   each measurement halved with probability p (1, 3, 5%): another tenant, a burst
  ecmp          3% of the measurements of a batch collide in pairs on one uplink: both halved
  leaf          the first N/8 nodes sit behind one oversubscribed leaf: their flows run at 0.7x when
                more than 70% of them run at once (a full round), at full speed otherwise; plus 1% transient
Healthy: a trial is right when no finding names a host (failed_hosts, exclude or a WARN's hosts).
Planted (with 3% transient): a node slow on one rail (0.5x), on every rail (0.5x), or one NIC (a
dual-port NIC, two rails of one node, at 0.6x); right when the judge names exactly that node.
Target: >= 99/100 right in every setting.
"""
import argparse
import json
import os
import random
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import ddp_mesh_ping as aiv  # noqa: E402

BASE_GBPS = 48.0
HEALTHY = (("transient 1%", {"p": 0.01}), ("transient 3%", {"p": 0.03}), ("transient 5%", {"p": 0.05}),
           ("ecmp collisions 3%", {"ecmp": 0.03}), ("oversubscribed leaf", {"p": 0.01, "leaf": True}))
PLANTED = (("node slow on one rail", "rail"), ("node slow on every rail", "node"), ("one NIC (2 rails)", "nic"))


class Fabric:
    def __init__(self, nodes, rails, rng, noise, p=0.0, ecmp=0.0, leaf=False, fault=None):
        self.rng, self.noise, self.p, self.ecmp = rng, noise, p, ecmp
        self.leaf = set(nodes[:max(2, len(nodes) // 8)]) if leaf else set()
        self.leaf_full = None
        self.bad, self.bad_rails, self.factor = None, set(), 1.0
        if fault:
            self.bad = rng.choice(nodes)
            r = rng.choice(rails)
            self.bad_rails = {"rail": {r}, "node": set(rails), "nic": {r - r % 2, r - r % 2 + 1}}[fault]
            self.factor = 0.6 if fault == "nic" else 0.5

    def batch(self, rnd, items):
        """One batch of (nodes, rail, ranks) that runs at once -> screen_measured rows."""
        leafy = [i for i, (g, _, _) in enumerate(items) if self.leaf & set(g)]
        if rnd != "redo":
            self.leaf_full = max(self.leaf_full or 0, len(leafy))
        crowded = bool(leafy) and len(leafy) > 0.7 * (self.leaf_full or len(leafy))
        hit = set(self.rng.sample(range(len(items)), 2 * int(self.ecmp * len(items) / 2))) if self.ecmp else set()
        out = []
        for i, (g, rail, ranks) in enumerate(items):
            f = self.factor if self.bad in g and rail in self.bad_rails else 1.0
            f *= 0.5 if (self.p and self.rng.random() < self.p) or i in hit else 1.0
            f *= 0.7 if crowded and i in leafy else 1.0
            out.append({"nodes": list(g), "rail": rail, "ranks": ranks, "hca": f"mlx5_{rail}",
                        "busbw": BASE_GBPS * f * (1.0 + self.rng.gauss(0.0, self.noise))})
        return out


def run_round(fab, rnd, groups, rails, before):
    """A pair round and its re-measurement, as RankRun.screen_remeasure runs them."""
    items = [(tuple(g), rail, [hash((g, rail)), rail]) for g in groups for rail in rails]
    rows = [dict(m, round=rnd) for m in fab.batch(rnd, items)]
    for k in range(1, aiv.SCREEN_REMEASURE_ROUNDS + 1):
        todo = aiv.screen_remeasure_plan(rows, before, k)
        if not todo:
            break
        rows = aiv.screen_best(rows, fab.batch("redo", [(tuple(t["nodes"]), t["rail"], t["ranks"]) for t in todo]))
    return rows


def trial(nodes, rails, fab):
    results = []
    for i, groups in enumerate(aiv.screen_rounds(nodes), 1):
        results += run_round(fab, i, groups, rails, results)
    plan = aiv.screen_third_round(results)
    if plan["groups"]:
        results += run_round(fab, 3, plan["groups"], rails, results)
    findings, _ = aiv.judge_pairs(results)
    named = {h for f in findings if f["status"] != "PASS" for h in f["hosts"]}
    links = len(aiv.screen_suspect_links(results))
    return {"named": named, "links": links, "measurements": len(results)}


def setting_row(name, nodes, rails, trials, seed, noise, kw, fault=None):
    rng = random.Random(f"{seed}:{name}:{len(nodes)}")
    right = false_hosts = links = meas = 0
    t0 = time.perf_counter()
    for _ in range(trials):
        fab = Fabric(nodes, rails, rng, noise, fault=fault, **kw)
        t = trial(nodes, rails, fab)
        want = {fab.bad} if fault else set()
        right += t["named"] == want
        false_hosts += len(t["named"] - want)
        links += t["links"]
        meas += t["measurements"]
    return {"setting": name, "nodes": len(nodes), "trials": trials, "right": right, "false_hosts": false_hosts,
            "suspect_links_mean": links / trials, "measurements_mean": meas / trials,
            "trial_s": (time.perf_counter() - t0) / trials}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[1])
    ap.add_argument("--nodes", default=os.environ.get("AIV_SIM_NODES", "16,64,256,512"))
    ap.add_argument("--rails", type=int, default=8)
    ap.add_argument("--trials", type=int, default=int(os.environ.get("AIV_SIM_TRIALS", "100")))
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--noise", type=float, default=0.02, help="Gaussian sigma, relative (default 0.02)")
    ap.add_argument("--json", metavar="OUT", help="write the results as JSON")
    a = ap.parse_args()
    sizes = [int(x) for x in a.nodes.split(",")]
    rails = list(range(a.rails))
    settings = [(n, kw, None) for n, kw in HEALTHY] + [(f"planted: {n}", {"p": 0.03}, f) for n, f in PLANTED]
    print(f"screen_sim: {a.rails} rails, noise sigma {a.noise:.0%}, {a.trials} trials, seed {a.seed}; "
          f"right/{a.trials} (healthy: no host named; planted: exactly the planted node named)")
    hdr = f"{'setting':<34}" + "".join(f"{'N=' + str(n):>10}" for n in sizes) + f"{'false hosts':>13}{'s/trial':>9}"
    print(hdr)
    print("-" * len(hdr))
    rows = []
    for name, kw, fault in settings:
        got = [setting_row(name, [f"gpu-{i + 1:04d}" for i in range(n)], rails, a.trials, a.seed, a.noise, kw, fault)
               for n in sizes]
        rows += got
        print(f"{name:<34}" + "".join(f"{g['right']:>6}/{g['trials']:<3}" for g in got)
              + f"{sum(g['false_hosts'] for g in got):>13}{max(g['trial_s'] for g in got):>9.2f}", flush=True)
    ok = all(r["right"] >= 0.99 * r["trials"] for r in rows)
    print(f"target (>= 99% right in every setting): {'met' if ok else 'NOT met'}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"rails": a.rails, "noise": a.noise, "seed": a.seed, "rows": rows, "target_met": ok}, f,
                      indent=2)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
