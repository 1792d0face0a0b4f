"""The pre-existing design this project replaces, rewritten from its published description for a
same-run comparison: tcp:// init, set_device after init, per-rank telemetry (psutil, /proc,
/sys/class/infiniband, peer access), gather_object to rank 0, a DDP step on nn.Linear(10, 10),
all_reduce of the loss, a printed report. No deadlines, no checks, interpreter teardown at exit."""
import os
import platform
import socket

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

rank, world, local = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_RANK"])
cuda = torch.cuda.is_available()
dist.init_process_group("nccl" if cuda else "gloo",
                        init_method=f"tcp://{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}",
                        world_size=world, rank=rank)
if cuda:
    torch.cuda.set_device(local)
dev = torch.device("cuda", local) if cuda else torch.device("cpu")


def read(path):
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return ""


try:
    import psutil
    mem = psutil.virtual_memory().total
except ImportError:
    mem = 0
info = {"rank": rank, "node": os.environ.get("SLURMD_NODENAME", socket.gethostname()), "local": local,
        "gpu": torch.cuda.get_device_name(local) if cuda else "cpu", "mem": mem,
        "cpu": next((ln.split(":")[1].strip() for ln in read("/proc/cpuinfo").splitlines()
                     if ln.startswith("model name")), ""),
        "os": read("/etc/os-release"), "kernel": platform.release(),
        "driver": read("/proc/driver/nvidia/version").split("\n")[0], "torch": torch.__version__,
        "cuda": torch.version.cuda, "nccl": str(torch.cuda.nccl.version()) if cuda else "-",
        "peer": [torch.cuda.can_device_access_peer(local, j) for j in range(torch.cuda.device_count())
                 if j != local] if cuda else []}
ib = "/sys/class/infiniband"
if os.path.isdir(ib):
    info["ib"] = {d: read(f"{ib}/{d}/ports/1/state") + read(f"{ib}/{d}/ports/1/rate") for d in os.listdir(ib)}
out = [None] * world if rank == 0 else None
dist.gather_object(info, out, dst=0)
model = DDP(torch.nn.Linear(10, 10).to(dev), device_ids=[local] if cuda else None)
loss = torch.nn.functional.mse_loss(model(torch.randn(20, 10, device=dev)), torch.randn(20, 10, device=dev))
loss.backward()
t = loss.detach().clone()
dist.all_reduce(t)
if rank == 0:
    for o in out:
        print(f"| {o['rank']} | {o['node']} | {o['local']} | {o['gpu']} | {o['mem'] / 2**30:.1f} GB |")
    print(" SUCCESS: DDP Multi-Node AllReduce Ring Complete!")
    print(f"--> Computed System Verification Convergence Loss : {t.item() / world:.6f}")
dist.destroy_process_group()
