#!/usr/bin/env python3
"""Where the test suite's time went, from a timeline written by the tests themselves
(TEST_TIMELINE=FILE tests/run.sh ...: a JSON line per test, its worker, start and end, and where the tests could
measure it, the CPU seconds the test and everything it started used).

    python3 bench/suite_timeline.py FILE [--top N]

Prints each worker's span and busy time, the files by summed wall time (and CPU), the longest tests and, with
CPU measured, the costliest."""
import argparse
import collections
import json


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("timeline")
    ap.add_argument("--top", type=int, default=15)
    a = ap.parse_args()
    rows = [json.loads(line) for line in open(a.timeline) if line.strip()]
    t0 = min(r["start"] for r in rows)
    print(f"{len(rows)} tests, first start to last end: {max(r['end'] for r in rows) - t0:.0f} s")
    workers = collections.defaultdict(list)
    for r in rows:
        workers[r["worker"]].append(r)
    print("\nworker  tests  ends at  busy (s)")
    for w, rs in sorted(workers.items()):
        print(f"{w:6} {len(rs):6} {max(r['end'] for r in rs) - t0:8.0f} {sum(r['end'] - r['start'] for r in rs):9.0f}")
    files = collections.Counter()
    counts = collections.Counter()
    cpu = collections.Counter()
    for r in rows:
        f = r["id"].split("::")[0]
        files[f] += r["end"] - r["start"]
        counts[f] += 1
        cpu[f] += r.get("cpu", 0.0)
    measured = any("cpu" in r for r in rows)
    if measured:
        print(f"CPU used by the tests and what they started: {sum(cpu.values()):.0f} s")
    print("\nfile (summed wall)                              tests   wall (s)" + ("   CPU (s)" if measured else ""))
    for f, s in files.most_common(a.top):
        print(f"{f:48} {counts[f]:5} {s:9.0f}" + (f" {cpu[f]:9.0f}" if measured else ""))
    print(f"\nthe {a.top} longest tests (s)")
    for r in sorted(rows, key=lambda r: r["start"] - r["end"])[:a.top]:
        print(f"{r['end'] - r['start']:7.1f}  {r['worker']:5} {r['id']}")
    if measured:
        print(f"\nthe {a.top} costliest tests (CPU s, wall s)")
        for r in sorted(rows, key=lambda r: -r.get("cpu", 0.0))[:a.top]:
            print(f"{r.get('cpu', 0.0):7.1f} {r['end'] - r['start']:7.1f}  {r['worker']:5} {r['id']}")


if __name__ == "__main__":
    main()
