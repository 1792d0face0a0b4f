"""Start one process per rank the way srun would (RANK/LOCAL_RANK/WORLD_SIZE/MASTER_* in the
environment) and time the whole run from the first spawn to the last exit."""
import os
import socket
import subprocess
import sys
import time


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


LAUNCH_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def launch(cmd, nproc, env=None, timeout=600, log=None, local=False):
    """-> (seconds, [exit codes], combined output of rank 0). local: one process that starts its own
    ranks (ddp_mesh_ping.py --nproc N), without any launch variable."""
    port = free_port()
    procs = []
    t0 = time.monotonic()
    if local:
        e = {k: v for k, v in dict(os.environ, **(env or {})).items() if k not in LAUNCH_VARS}
        p = subprocess.Popen(cmd, env=e, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        text, _ = p.communicate(timeout=timeout)
        if log:
            with open(log, "a") as f:
                f.write(text)
        return time.monotonic() - t0, [p.returncode], text
    for r in range(nproc):
        e = dict(os.environ, **(env or {}), RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(nproc),
                 LOCAL_WORLD_SIZE=str(nproc), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        out = subprocess.PIPE if r == 0 else subprocess.DEVNULL
        procs.append(subprocess.Popen(cmd, env=e, stdout=out, stderr=subprocess.STDOUT, text=True))
    text, _ = procs[0].communicate(timeout=timeout)
    codes = [procs[0].returncode] + [p.wait(timeout=timeout) for p in procs[1:]]
    secs = time.monotonic() - t0
    if log:
        with open(log, "a") as f:
            f.write(text)
    return secs, codes, text


def python():
    return os.environ.get("BENCH_PYTHON", sys.executable)
