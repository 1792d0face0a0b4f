"""A rank's start: the CPU time of `import torch` (+ torch.distributed) and of DDP's lazy `torch._dynamo`
import, with Python's cycle collector on (Python's default) and paused as the tool does (gc_paused),
each in a fresh process, the two variants alternated round by round.

    python3 bench/import_gc.py [--rounds 10] [--json FILE]

Prints the median CPU seconds of each import per variant and the ratio paused / on."""
import argparse
import json
import statistics
import subprocess
import sys

CHILD = r"""
import gc, json, time
paused = {paused}
t = time.process_time()
if paused:
    gc.disable()
import torch, torch.distributed
a = time.process_time() - t
gc.enable()
t = time.process_time()
if paused:
    gc.disable()
import torch._dynamo, torch.nn.parallel
b = time.process_time() - t
print(json.dumps([a, b]))
"""


def one(paused):
    out = subprocess.run([sys.executable, "-c", CHILD.format(paused=paused)], capture_output=True, text=True,
                         check=True, timeout=300)
    return json.loads(out.stdout)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--json")
    a = ap.parse_args()
    runs = {"on": [], "paused": []}
    one(False)  # the first import after install compiles and caches: not counted
    for _ in range(a.rounds):
        for name in runs:
            runs[name].append(one(name == "paused"))
    res = {}
    for i, what in enumerate(("import torch", "import torch._dynamo")):
        on = statistics.median(r[i] for r in runs["on"])
        paused = statistics.median(r[i] for r in runs["paused"])
        res[what] = {"on_cpu_s": round(on, 3), "paused_cpu_s": round(paused, 3), "ratio": round(paused / on, 3)}
        print(f"{what:22s} collector on {on:.3f} CPU-s, paused {paused:.3f} CPU-s, paused/on {paused / on:.3f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"rounds": a.rounds, "python": sys.version.split()[0], "results": res}, f, indent=1)


if __name__ == "__main__":
    main()
