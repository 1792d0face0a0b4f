"""Floor 2: what the node gate (--node-check) reads on its node without torch: NVML's GPU list and compute
processes (nvidia-smi), the NVIDIA GPUs on the PCI bus and in the driver's list, the kernel log's Xid lines,
Slurm's view of the node (scontrol) and its one write (a drain reason or a resume); each call bounded, plain
data out, an absent source said as {'unread': why}."""
import contextlib
import os
import re
import time

from ..core.base import first_text_line, read_text
from ..core.files import run_bounded


def smi_query(exe, what, fields, seconds):
    """One `nvidia-smi --query-<what>=fields --format=csv,noheader,nounits` -> {'text'} (its stdout, also when it
    exits nonzero beside rows: a GPU it cannot reach is a line of its own) or {'unread': why}."""
    r = run_bounded([exe, f"--query-{what}=" + ",".join(fields), "--format=csv,noheader,nounits"], seconds)
    if "unread" in r:
        return r
    if r["rc"] != 0 and not r["out"].strip():
        return {"unread": f"nvidia-smi exited {r['rc']}: {first_text_line(r['err'] or r['out']) or 'no output'}"}
    return {"text": r["out"] + r["err"]}


WORKER_ARG = "--aiv-node-check-worker"  # on a node check's device worker's command line: our own, never a leftover


def process_owner(pid, root="/"):
    """Who a process is: {'name', 'user', 'job', 'ours'} from /proc (the Slurm job from its cgroup path; ours: a
    node check's own device worker, by WORKER_ARG on its command line), each None where it cannot be read
    (another PID namespace, gone)."""
    base = os.path.join(root, "proc", str(pid))
    ours = WORKER_ARG in (read_text(os.path.join(base, "cmdline"), "") or "").split("\0")
    status = read_text(os.path.join(base, "status"), "") or ""
    uid = re.search(r"^Uid:\s+(\d+)", status, re.M)
    user = None
    if uid:
        with contextlib.suppress(ImportError, KeyError):
            import pwd
            user = pwd.getpwuid(int(uid.group(1))).pw_name
        user = user or f"uid {uid.group(1)}"
    job = re.search(r"/job_(\d+)(?:/|$)", read_text(os.path.join(base, "cgroup"), "") or "", re.M)
    name = (read_text(os.path.join(base, "comm"), "") or "").strip() or None
    return {"name": name, "user": user, "job": job.group(1) if job else None, "ours": ours or None}


def pci_gpus(root="/"):
    """PCI bus ids of NVIDIA display and 3D controllers (vendor 0x10de, class 0x0300xx or 0x0302xx; not the
    NVSwitches) on the bus: what the hardware holds, whatever the driver makes of it."""
    base = os.path.join(root, "sys/bus/pci/devices")
    try:
        names = sorted(os.listdir(base))
    except OSError:
        return []

    def attr(n, name):
        return (read_text(os.path.join(base, n, name), "") or "").strip().lower()
    return [n.lower() for n in names
            if attr(n, "vendor") == "0x10de" and attr(n, "class").startswith(("0x0300", "0x0302"))]


def read_kmsg(root="/", seconds=1.0, limit=8 << 20):
    """The kernel's log buffer, read without blocking from /dev/kmsg (root, or CAP_SYSLOG) -> {'text'} or
    {'unread': why}; at most `limit` bytes and `seconds`."""
    path = os.path.join(root, "dev/kmsg")
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError as e:
        return {"unread": f"{path}: {e.strerror or e}"}
    chunks, size, until = [], 0, time.monotonic() + seconds
    try:
        while size < limit and time.monotonic() < until:
            try:
                b = os.read(fd, 65536)
            except BlockingIOError:
                break  # the end of the buffer
            except BrokenPipeError:
                continue  # a record overwritten while we read: the next one follows
            if not b:
                break
            chunks.append(b)
            size += len(b)
    except OSError as e:
        return {"unread": f"{path}: {e.strerror or e}"}
    finally:
        os.close(fd)
    return {"text": b"".join(chunks).decode(errors="replace")}


def read_slurm_node(name, seconds):
    """`scontrol show node -d -o NAME` -> {'text'} or {'unread': why} (parsed by parse_slurm_node)."""
    r = run_bounded(["scontrol", "show", "node", "-d", "-o", name], seconds)
    if "unread" in r:
        return r
    if r["rc"] != 0:
        return {"unread": f"scontrol show node {name} exited {r['rc']}: {first_text_line(r['err'] or r['out'])}"}
    return {"text": r["out"]}

