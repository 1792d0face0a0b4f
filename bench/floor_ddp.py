"""DDP floor: the bare floor plus DDP on nn.Linear(10, 10) with one forward/backward."""
import datetime
import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
cuda = torch.cuda.is_available()
dev = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if cuda else torch.device("cpu")
if cuda:
    torch.cuda.set_device(dev)
kw = {"device_id": dev} if cuda else {}
dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://{os.environ['MASTER_ADDR']}:"
                        f"{os.environ['MASTER_PORT']}", rank=rank, world_size=world,
                        timeout=datetime.timedelta(seconds=120), **kw)
x = torch.ones(1, device=dev)
dist.all_reduce(x)
model = DDP(torch.nn.Linear(10, 10).to(dev), device_ids=[dev.index] if cuda else None)
loss = torch.nn.functional.mse_loss(model(torch.randn(16, 10, device=dev)), torch.randn(16, 10, device=dev))
loss.backward()
dist.destroy_process_group()
