"""What the torch these tests run on gives beyond the tool's floor: one probe per row of docs/install.md's
table (Supported torch), each True, False, or None where the row does not apply to this build."""
import contextlib
import datetime
import importlib.metadata
import inspect
import os
import re
import socket

import torch
import torch.distributed as dist


def torch_version():
    return torch.__version__


def serves_listen_fd():
    """Whether torch's store server (libuv, the default) serves a socket bound beforehand (master_listen_fd)."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    port, fd = s.getsockname()[1], s.detach()
    try:
        store = dist.TCPStore("127.0.0.1", port, None, True, datetime.timedelta(seconds=5), wait_for_workers=False,
                              master_listen_fd=fd)
    except NotImplementedError:
        with contextlib.suppress(OSError):
            os.close(fd)
        return False
    del store
    return True


def nccl_version():
    """The NCCL a pip-installed CUDA build brings (nvidia-nccl-cu*), as a tuple; None without one (a CPU build)."""
    for d in importlib.metadata.distributions():
        if (d.metadata["Name"] or "").lower().startswith("nvidia-nccl"):
            return tuple(int(x) for x in re.findall(r"\d+", d.version)[:3])
    return None


def ras_json():
    v = nccl_version()
    return None if v is None else v >= (2, 28, 7)


def params(fn):
    return inspect.signature(fn).parameters


# the first cell of each row of docs/install.md's table -> its probe
PROBES = {
    "`Store.clone`": lambda: hasattr(dist.Store, "clone"),
    "store server on rank 0's own socket (`master_listen_fd`, libuv)": serves_listen_fd,
    "`split_group`": lambda: hasattr(dist, "split_group"),
    "flight recorder as JSON (`_dump_fr_trace_json`)":
        lambda: hasattr(torch._C._distributed_c10d, "_dump_fr_trace_json"),
    "NCCL's RAS as JSON (NCCL 2.28.7 or newer; PyPI's build brings its NCCL)": ras_json,
    "`init_process_group(device_id=)`": lambda: "device_id" in params(dist.init_process_group),
    "`new_group(use_local_synchronization=)`, the store's `append`, `multi_get`, `multi_set`":
        lambda: "use_local_synchronization" in params(dist.new_group)
        and all(hasattr(dist.Store, m) for m in ("append", "multi_get", "multi_set")),
}
