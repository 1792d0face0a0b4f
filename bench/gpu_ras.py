#!/usr/bin/env python3
"""NCCL's own view on a GPU host, read the way rank 0 reads it when a collective does not finish.

Starts an NCCL group of N ranks (default 1) on cuda:0..N-1 (one process per GPU), issues two all_reduces
on the world group, then, in each rank, reads what torch's flight recorder holds (recorder_last: the last
collective per group, what a rank answers rank 0) and, in rank 0, NCCL's RAS STATUS over its socket
(ras_status, at NCCL_RAS_ADDR or localhost:28028) and NCCL's view beside ours (nccl_view). Prints one
JSON line per rank and, for rank 0, the RAS answer (ok, seconds, NCCL version, the world communicator's
ranks with their status and collective counts) and the view's words. Exit 0 when RAS answered.

  python3 bench/gpu_ras.py            1 rank on cuda:0 (a 1-rank communicator answers STATUS)
  python3 bench/gpu_ras.py --ranks 2  2 ranks on cuda:0 and cuda:1 (does the recorder hold NCCL entries?)
"""
import argparse
import json
import os
import socket
import sys
import time
from pathlib import Path

os.environ.setdefault("TORCH_FR_BUFFER_SIZE", "2000")  # as a rank sets it, before torch is imported
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def rank_main(rank, world, port, seconds, out):
    import torch
    import torch.distributed as dist

    import ddp_mesh_ping as aiv
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=torch.device("cuda", rank))
    x = torch.ones(1 << 20, device="cuda")
    for _ in range(2):
        dist.all_reduce(x)
    torch.cuda.synchronize()
    key = aiv.group_key(range(world))
    names = {dist.group.WORLD.group_name: key}
    raw = json.loads(torch._C._distributed_c10d._dump_fr_trace_json(True, False))
    v = torch.cuda.nccl.version()
    line = {"rank": rank, "torch": torch.__version__, "nccl": ".".join(map(str, v)) if isinstance(v, tuple) else str(v),
            "recorder_entries": len(raw.get("entries") or []), "recorder_last": aiv.recorder_last(torch, names),
            "pg_status": raw.get("pg_status")}
    if rank == 0:
        t = time.monotonic()
        ras = aiv.ras_status(*aiv.ras_addr(os.environ), seconds)
        line["ras_secs"] = round(time.monotonic() - t, 3)
        line["ras_ok"], line["ras_why"] = ras["ok"], ras.get("why")
        if ras["ok"]:
            comm = aiv.ras_world(ras["data"], world)
            line["ras_nccl_version"] = ras["data"].get("nccl_version")
            line["ras_world"] = comm and {"size": comm.get("size"), "missing": comm.get("missing_ranks"),
                                          "ranks": [{k: r.get(k) for k in ("rank", "host", "pid", "status",
                                                                           "collective_counts")}
                                                    for r in comm.get("ranks") or []]}
            line["ras_communicators"] = len(ras["data"].get("communicators") or [])
        view = aiv.nccl_view(ras, world, {r: socket.gethostname() for r in range(world)}, {}, [])
        line["view"] = view["words"]
    print(json.dumps(line), flush=True)
    out.put(line)
    dist.barrier()
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=1, help="ranks, one per GPU (default 1)")
    ap.add_argument("--seconds", type=float, default=5.0, help="the RAS read's bound (default 5)")
    a = ap.parse_args()
    import torch.multiprocessing as mp
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.SimpleQueue()
    procs = [ctx.Process(target=rank_main, args=(r, a.ranks, port, a.seconds, out)) for r in range(a.ranks)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(300)
    lines = [out.get() for _ in range(a.ranks) if not out.empty()]
    ok = any(ln.get("ras_ok") for ln in lines)
    print("RAS answered" if ok else "RAS did not answer", flush=True)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
