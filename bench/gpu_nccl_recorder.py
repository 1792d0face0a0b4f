#!/usr/bin/env python3
"""What torch's recorders hold after two all_reduces on one NCCL rank (one GPU): ProcessGroupNCCL's own
trace (_dump_nccl_trace / _dump_nccl_trace_json, TORCH_NCCL_TRACE_BUFFER_SIZE) and the generic flight
recorder (_dump_fr_trace_json, TORCH_FR_BUFFER_SIZE). Prints one JSON line per dump: entries, and for each
its profiling name, sequence id and state.
    python3 bench/gpu_nccl_recorder.py"""
import json
import os
import pickle
import socket

os.environ.setdefault("TORCH_NCCL_TRACE_BUFFER_SIZE", "2000")
os.environ.setdefault("TORCH_FR_BUFFER_SIZE", "2000")
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

s = socket.socket()
s.bind(("127.0.0.1", 0))
port = s.getsockname()[1]
s.close()
torch.cuda.set_device(0)
dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
x = torch.ones(1024, device="cuda")
for _ in range(2):
    dist.all_reduce(x)
torch.cuda.synchronize()
c10d = torch._C._distributed_c10d


def summary(entries):
    return [{k: e.get(k) for k in ("profiling_name", "collective_seq_id", "p2p_seq_id", "op_id", "state",
                                    "is_p2p", "process_group")} for e in entries]


out = {"torch": torch.__version__, "nccl": ".".join(map(str, torch.cuda.nccl.version()))}
for name in ("_dump_nccl_trace", "_dump_nccl_trace_json", "_dump_fr_trace", "_dump_fr_trace_json"):
    fn = getattr(c10d, name, None)
    if fn is None:
        out[name] = "absent"
        continue
    try:
        raw = fn()
        d = json.loads(raw) if name.endswith("_json") else pickle.loads(raw)
        entries = d.get("entries") or []
        out[name] = {"entries": len(entries), "summary": summary(entries), "keys": sorted(d)}
    except Exception as e:  # noqa: BLE001 - a measurement: say what failed
        out[name] = f"{type(e).__name__}: {e}"
print(json.dumps(out, default=str))
dist.destroy_process_group()
