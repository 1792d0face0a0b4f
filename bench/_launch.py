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


def launch(cmd, nproc, env=None, timeout=600, log=None):
    """-> (seconds, [exit codes], combined output of rank 0)."""
    port = free_port()
    procs = []
    t0 = time.monotonic()
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
