#!/usr/bin/env python3
"""A simulated verdict state (the dict the tool writes as JSON) for N nodes x R rails, with an optional
planted fault, judged by the tool's own screen judges.

  python bench/sim_state.py OUT.json [--nodes 4] [--rails 8] [--gpus-per-node G] [--fault rail] [--seed 1]

Faults: 'rail' (node003 at 0.5x on one rail), 'node' (node003 at 0.5x on every rail), 'gpu' (node003's
local rank 2 at 0.6x TFLOPS), 'hbm' (its memory at 0.85x: a WARN), 'link' (one pair path at 0.5x: a
suspect link), or None (healthy). Measurements: ~680 TFLOPS, ~4200 GB/s, ~48 GB/s inter-node and
~480 GB/s intra-node busbw, each with Gaussian noise.
"""
import argparse
import json
import os
import random
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import ddp_mesh_ping as aiv  # noqa: E402

FAULTS = ("rail", "node", "gpu", "hbm", "link")
BAD = "node003"
PHASE_S = {"local": 3.3, "rollcall": 0.4, "init": 3.5, "telemetry": 0.1, "screen-gpu": 1.9, "screen-net": 5.9,
           "collective": 0.3, "ddp": 0.5, "bandwidth": 0.0, "final": 0.1}


def _names(nodes):
    return [f"node{i + 1:03d}" for i in range(nodes)]


def _ranks(names, gpn):
    """Per-rank records as the roll call gathers them (the fields the report uses)."""
    out = []
    for n, host in enumerate(names):
        for lr in range(gpn):
            uuid = f"GPU-{n:04x}{lr:04x}-3a15-cada-44d8-{n * gpn + lr:012x}"
            out.append({"rank": n * gpn + lr, "host": host, "hostname": host, "local_rank": lr, "device": lr,
                        "backend": "nccl", "gpu": {"name": "NVIDIA H200", "uuid": uuid, "vram": 150109880320},
                        "numerics": _numerics()})
    return out


def _numerics():
    """A healthy rank's numerics post (its checks' digests and errors against the fp64 reference)."""
    errs = {"matmul-bf16": (0.0006, 0.0391), "linear-bf16": (0.0006, 0.0391), "matmul-fp32": (2.1e-07, 0.000122),
            "matmul-tf32": (0.00031, 0.00403), "elementwise-fp32": (5.9e-08, 2.384e-07)}
    return {"checks": {c: {"err": e, "tol": t, "off": False, "digest": f"{i:032x}"}
                       for i, (c, (e, t)) in enumerate(errs.items())},
            "software": {"torch": "2.13.0+cu130", "sms": 132, "cc": "9.0", "cuda": "13.0", "cublas": 130100}}


def _gpu_rows(ranks, rng, fault):
    rows = []
    for r in ranks:
        hit = r["host"] == BAD and r["local_rank"] == 2
        tf = 680.0 * (1 + rng.gauss(0, 0.006)) * (0.6 if hit and fault == "gpu" else 1.0)
        hbm = 4200.0 * (1 + rng.gauss(0, 0.004)) * (0.85 if hit and fault == "hbm" else 1.0)
        rows.append({"rank": r["rank"], "host": r["host"], "local_rank": r["local_rank"], "uuid": r["gpu"]["uuid"],
                     "model": "NVIDIA H200", "tflops": round(tf, 1), "hbm_gbps": round(hbm, 1)})
    return rows


def _measure(groups, rails, rnd, rng, fault, bad_rail, link):
    """One round's measurements, every group on every rail."""
    out = []
    for g in groups:
        for rail in rails:
            f = 0.5 if BAD in g and (fault == "node" or (fault == "rail" and rail == bad_rail)) else 1.0
            f *= 0.5 if fault == "link" and set(g) == link and rail == bad_rail else 1.0
            out.append({"round": rnd, "nodes": list(g), "rail": rail, "hca": f"mlx5_{rail}",
                        "busbw": round(48.0 * f * (1 + rng.gauss(0, 0.01)), 2)})
    return out


def _pairs(names, rails, rng, fault):
    bad_rail = min(3, len(rails) - 1)
    rounds = aiv.screen_rounds(names)
    link = set(rounds[0][0]) if rounds else set()  # the first pair of round 1: its path is slow
    rows = []
    for i, groups in enumerate(rounds, 1):
        rows += _measure(groups, rails, i, rng, fault, bad_rail, link)
    plan = aiv.screen_third_round(rows)
    if plan["groups"]:
        rows += _measure(plan["groups"], rails, 3, rng, fault, bad_rail, link)
    return rows


def _phases(rng):
    phases, starts, t = {}, {}, 0.0
    for p in aiv.PHASES:
        d = round(PHASE_S.get(p, 0.1) * (1 + rng.gauss(0, 0.1)), 3)
        phases[p], starts[p] = max(d, 0.0), round(t, 3)
        t += max(d, 0.0)
    return phases, starts, round(t + 0.2, 3)


def simulated_state(nodes, rails, gpus_per_node=None, fault=None, seed=1):
    """-> a verdict state for `nodes` nodes (node001..) x `rails` rails, `gpus_per_node` (default: rails)
    GPUs each; fault: one of FAULTS or None. Findings come from aiv.judge_screen."""
    if fault is not None and fault not in FAULTS:
        raise ValueError(f"fault must be one of {FAULTS} or None")
    rng = random.Random(seed)
    names, gpn = _names(nodes), gpus_per_node or rails
    ranks = _ranks(names, gpn)
    screen = {"cpu": False, "gpu": _gpu_rows(ranks, rng, fault),
              "intra": [{"host": h, "busbw": round(480.0 * (1 + rng.gauss(0, 0.01)), 1), "model": "NVIDIA H200",
                         "ranks": [r["rank"] for r in ranks if r["host"] == h]} for h in names],
              "pairs": _pairs(names, list(range(rails)), rng, fault),
              "min_tflops": None, "min_hbm": None, "min_busbw_intra": None, "min_busbw_inter": None}
    screen["suspect_links"] = aiv.screen_suspect_links(screen["pairs"])
    findings = [aiv.finding("world-size", "PASS", f"WORLD_SIZE={len(ranks)} as expected"),
                aiv.finding("layout", "PASS", f"{nodes} node(s) x {gpn} rank(s)")] + aiv.judge_screen(screen)
    findings += aiv.judge_numerics(aiv.numerics_rows(ranks))
    failed = sorted({h for f in findings if f["status"] == "FAIL" for h in f["hosts"]})
    code = aiv.EXIT_FAIL if any(f["status"] == "FAIL" for f in findings) else aiv.EXIT_PASS
    drain = aiv.drain_plan(findings, "recommend", nodes, "4242")
    phases, starts, elapsed = _phases(rng)
    return {"schema_version": aiv.SCHEMA_VERSION, "tool": "ai-infra-validator", "version": aiv.VERSION,
            "started_at": "2026-12-02T17:12:11+00:00", "host": names[0],
            "verdict": "PASS" if code == aiv.EXIT_PASS else "FAIL", "exit_code": code, "world_size": len(ranks),
            "ranks_reported": len(ranks), "backend": "nccl", "elapsed_s": elapsed, "phases": phases,
            "phase_starts": starts, "findings": findings, "failures": aiv.failure_lines(findings),
            "failed_hosts": failed, "exclude": aiv.compress_hostlist(failed) if failed else "",
            "suspect_links": screen["suspect_links"], "drain": drain, "drain_command": drain.get("command") or "",
            "screen": screen, "ranks": ranks}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out", help="path of the JSON state to write")
    ap.add_argument("--nodes", type=int, default=4)
    ap.add_argument("--rails", type=int, default=8)
    ap.add_argument("--gpus-per-node", type=int, default=None)
    ap.add_argument("--fault", choices=FAULTS, default=None)
    ap.add_argument("--seed", type=int, default=1)
    a = ap.parse_args()
    state = simulated_state(a.nodes, a.rails, a.gpus_per_node, a.fault, a.seed)
    with open(a.out, "w") as f:
        json.dump(state, f, indent=1)
    print(f"{a.out}: {state['verdict']} exit={state['exit_code']} failed_hosts={state['exclude'] or '-'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
