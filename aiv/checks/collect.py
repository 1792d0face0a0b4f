"""Floor 2: facts of a rank and its node (GPUs, driver, IB ports, PCIe, NUMA, packages, import probe),
one getter per fact; plain data out, no judgement."""
import contextlib
import json
import os
import re
import resource
import signal
import subprocess
import sys

from ..core.base import _screen_key, first_line, read_text, safe_env
from ..core.files import child_finish
from ..core.names import PROBED_PACKAGES, ib_hca_select
from ..launch.launchers import allocated_gpus
from .interfaces import _usable, list_interfaces


def count_visible_gpus(env, root="/"):
    """GPU count without importing torch (for the local launcher)."""
    cvd = env.get("CUDA_VISIBLE_DEVICES")
    if cvd is not None:
        items = [x for x in cvd.split(",") if x.strip() and x.strip() != "-1"]
        if cvd.strip() in ("", "NoDevFiles") or not items:
            return 0
    try:
        n = len(os.listdir(os.path.join(root, "proc/driver/nvidia/gpus")))
    except OSError:
        n = len([d for d in os.listdir("/dev") if re.fullmatch(r"nvidia\d+", d)]) if os.path.isdir("/dev") else 0
    return min(n, len(items)) if cvd is not None else n


def _listdir(path):
    """The names in a directory, [] where it cannot be read."""
    try:
        return os.listdir(path)
    except OSError:
        return []


def driver_gpus(root="/"):
    """The NVIDIA driver's own list of its GPUs (/proc/driver/nvidia/gpus/<bus id>), [] without the driver: the
    node's own GPUs, whatever share of them the job was given (CUDA_VISIBLE_DEVICES, --gpus-per-node)."""
    return sorted(d.lower() for d in _listdir(os.path.join(root, "proc/driver/nvidia/gpus")))


NO_DEVICES = ("", "-1", "NoDevFiles")


def gpus_expected(env, root="/"):
    """Why this rank should have a GPU ('' when it should not): CUDA_VISIBLE_DEVICES names devices,
    Slurm allocated GPUs (SLURM_*GPUS*), or the NVIDIA driver lists GPUs. CUDA_VISIBLE_DEVICES set to
    '', -1 or NoDevFiles means a deliberate CPU run. A pod's NVIDIA_VISIBLE_DEVICES that lists GPUs counts too."""
    cvd = env.get("CUDA_VISIBLE_DEVICES")
    if cvd is not None:
        return "" if cvd.strip() in NO_DEVICES else f"CUDA_VISIBLE_DEVICES={cvd}"
    if allocated_gpus(env):  # a Kubernetes pod's GPUs (the NVIDIA device plugin's list; an image's "all" is none)
        return f"NVIDIA_VISIBLE_DEVICES lists {allocated_gpus(env)} GPU(s)"
    for k in sorted(env):
        v = env[k].strip()
        if re.fullmatch(r"SLURM_\w*GPUS\w*", k) and v and v != "(null)" and (
                re.search(r"[1-9]", v) or k in ("SLURM_JOB_GPUS", "SLURM_STEP_GPUS")):
            return f"{k}={v}"
    return "the NVIDIA driver lists GPUs in /proc/driver/nvidia/gpus" if driver_gpus(root) else ""


def cuda_problem(torch_mod):
    """torch's own reason why CUDA is unusable (a CPU build, driver too old, no device, init error)."""
    if torch_mod.version.cuda is None and getattr(torch_mod.version, "hip", None) is None:
        return f"torch {torch_mod.__version__} is a CPU-only build"
    import warnings
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if torch_mod.cuda.is_available():
            return "none"
    try:
        torch_mod.cuda.init()
    except Exception as e:
        return first_line(e)
    said = [str(w.message).strip().splitlines()[0] for w in caught if str(w.message).strip()]
    return said[0][:300] if said else f"torch {torch_mod.__version__} sees {torch_mod.cuda.device_count()} device(s)"


def read_ib_ports(root="/"):
    """[{'port': 'mlx5_0:1', 'state': 'ACTIVE', 'rate_gbps': 400.0, 'link_layer': 'InfiniBand'}]."""
    base = os.path.join(root, "sys/class/infiniband")
    out = []
    for dev in sorted(_listdir(base)):
        for p in sorted(_listdir(os.path.join(base, dev, "ports")), key=lambda p: int(p) if p.isdigit() else 0):
            state, rate, layer = ((read_text(os.path.join(base, dev, "ports", p, name), "") or "").strip()
                                  for name in ("state", "rate", "link_layer"))
            m = re.match(r"([\d.]+)\s*Gb", rate)
            out.append({"port": f"{dev}:{p}", "state": state.split(":")[-1].strip() or "UNKNOWN",
                        "rate_gbps": float(m.group(1)) if m else None, "link_layer": layer or None})
    return out


PCI_NODE = re.compile(r"pci[0-9a-f]{4}:[0-9a-f]{2}|[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]", re.I)


def _pci_chain(path):
    """The PCI path of a sysfs device link: ['pci0000:00', '0000:00:01.0', '0000:01:00.0', ...]
    (host bridge, then each bridge and switch port down to the device); [] where the link is absent."""
    if not os.path.exists(path):
        return []
    return [c.lower() for c in os.path.realpath(path).split(os.sep) if PCI_NODE.fullmatch(c)]


def nearest_hca(root, pci, spec=None):
    """The InfiniBand/RoCE device (/sys/class/infiniband/<hca>/device) nearest a GPU (its bus id,
    /sys/bus/pci/devices/<pci>) in the PCI tree: the longest common PCI path (behind the GPU's own PCIe
    switch, then its root port, then its host bridge), among the devices NCCL_IB_HCA (spec) selects, those
    with an ACTIVE port first (NCCL uses no other); equals: the lowest name. None: no bus id or no device."""
    gpu = _pci_chain(os.path.join(root, "sys/bus/pci/devices", pci.lower())) if pci else []
    if not gpu:
        return None
    ports, rank = ib_hca_select(spec, read_ib_ports(root)), {}  # rank: {device: (ACTIVE, common path length)}
    for dev in sorted({p["port"].split(":")[0] for p in ports}, key=_screen_key):
        if chain := _pci_chain(os.path.join(root, "sys/class/infiniband", dev, "device")):
            rank[dev] = (any(p["state"] == "ACTIVE" for p in ports if p["port"].split(":")[0] == dev),
                         len(os.path.commonprefix([gpu, chain])))
    return max(rank, key=rank.get, default=None)


def _cpu_model():
    return next((ln.split(":", 1)[1].strip() for ln in read_text("/proc/cpuinfo", "").splitlines()
                 if ln.lower().startswith(("model name", "cpu model", "hardware"))), os.uname().machine)


def _os_name():
    return next((ln.split("=", 1)[1].strip().strip('"') for ln in read_text("/etc/os-release", "").splitlines()
                 if ln.startswith("PRETTY_NAME=")), None)


def _mem_total():
    try:
        import psutil
        return psutil.virtual_memory().total
    except Exception:
        m = re.search(r"MemTotal:\s+(\d+) kB", read_text("/proc/meminfo", "") or "")
        return int(m.group(1)) * 1024 if m else None


def _driver_version(root):
    txt = read_text(os.path.join(root, "proc/driver/nvidia/version"))
    if not txt:
        return None
    m = re.search(r"Kernel Module(?: for \S+)?\s+([\d.]+)", txt) or re.search(r"\s(\d+\.\d+(?:\.\d+)?)\s", txt)
    return m.group(1) if m else txt.splitlines()[0][:60]


IMPORT_PROBE = r"""
import json, os, sys
os.nice(19)  # behind every rank's own work: on a node whose ranks still import, it waits for them
for name in sys.argv[1:]:
    try:
        mod = __import__(name)
        out = {"version": getattr(mod, "__version__", "?"), "ok": True}
    except Exception as e:  # an ABI-broken package is a finding, not a crash
        msg = (str(e).strip().splitlines() or [type(e).__name__])[0][:160]
        out = {"version": None, "ok": False, "error": type(e).__name__ + ": " + msg}
    sys.stdout.write(json.dumps(dict(out, name=name)) + "\n")
    sys.stdout.flush()  # a crash in the next import keeps this line
"""


def start_import_probe():
    """Node leaders, at launch: one child process imports torchvision, then torchaudio (with torch that is
    seconds of work; an ABI-broken extension may even crash the importer), at nice 19 and, where psutil
    is importable, in the idle I/O class: it takes only what the node's ranks leave, so it never slows
    their imports or the roll call, and on a node with cores to spare it is done before the DDP step.
    -> the child, or the OSError that kept it from starting."""
    try:
        proc = subprocess.Popen([sys.executable, "-c", IMPORT_PROBE, *PROBED_PACKAGES], stdout=subprocess.PIPE,
                                stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL)
    except OSError as e:
        return e
    with contextlib.suppress(Exception):
        import psutil
        psutil.Process(proc.pid).ionice(psutil.IOPRIO_CLASS_IDLE)
    return proc


def finish_import_probe(proc, wait_s):
    """{name: {'ok', 'version', 'error'}} for PROBED_PACKAGES; a probe still running after wait_s is killed.
    A package without a line: the import that crashed the child (the first such) or was cut off."""
    if isinstance(proc, OSError):
        return {n: {"ok": False, "version": None, "error": f"probe could not start: {proc}"} for n in PROBED_PACKAGES}
    r = child_finish(proc, wait_s if proc.poll() is None else 60.0, "the import probe")
    why = f"import took over {wait_s:.0f}s" + (f" ({r['unread'].split(': ', 1)[1]})" if r.get("stuck") else "") \
        if "unread" in r else None
    out = {}
    for line in (r.get("out") or "").splitlines():
        with contextlib.suppress(ValueError, TypeError, AttributeError):
            d = json.loads(line)
            out[d.pop("name")] = d
    for name in PROBED_PACKAGES:
        if name not in out:  # a crash (e.g. SIGSEGV from a broken extension) is a finding
            rc = proc.returncode
            how = f"killed by {signal.Signals(-rc).name}" if rc is not None and rc < 0 else f"exited {rc}"
            out[name] = {"ok": False, "version": None, "error": why or f"import probe failed: {how}"}
            why = why or f"not probed: the import of {name} ended the probe"
    return out


def collect_node_facts(root, torch_mod, backend, device_count, env=None):
    """Facts collected once per node (by local rank 0). Missing sources -> None."""
    shm = None
    with contextlib.suppress(OSError):
        st = os.statvfs("/dev/shm")
        shm = st.f_frsize * st.f_blocks
    soft = resource.getrlimit(resource.RLIMIT_MEMLOCK)[0]
    facts = {
        "cpu_model": _cpu_model(), "cpus": os.cpu_count(), "mem_total": _mem_total(),
        "os": _os_name(), "kernel": os.uname().release,
        "driver": _driver_version(root),
        "ib": read_ib_ports(root),
        "peermem": any(os.path.isdir(os.path.join(root, "sys/module", m))
                       for m in ("nvidia_peermem", "nv_peer_mem")),
        "memlock": "unlimited" if soft == resource.RLIM_INFINITY else soft,
        "shm": shm,
        "ifaces": {n: i["addrs"][:1] for n, i in list_interfaces().items() if _usable(i)},
        "gpus_visible": device_count,
        "gpus_driver": len(driver_gpus(root)) or None,  # manifest: the node's own GPU count (its class)
        "peer": None,
        "env": node_env(env) if env is not None else None,  # manifest: this node's NCCL_/GLOO_ settings
    }
    if backend == "nccl" and device_count > 1:
        try:
            n = min(device_count, 16)
            facts["peer"] = ["".join("X" if i == j else ("1" if torch_mod.cuda.can_device_access_peer(i, j) else "0")
                                     for j in range(n)) for i in range(n)]
        except Exception as e:
            facts["peer_error"] = str(e)[:120]
    return facts


def loopback_domain():
    """Which loopback this process reaches: the kernel's boot id and its network namespace (two node names
    of one machine and namespace talk over 127.0.0.1 fine), or None where either is unreadable."""
    boot = (read_text("/proc/sys/kernel/random/boot_id") or "").strip()
    try:
        ns = os.readlink("/proc/self/ns/net")
    except OSError:
        return None
    return f"{boot}/{ns}" if boot else None


def _cpu_affinity():
    try:
        return sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return list(range(os.cpu_count() or 1))


def collect_gpu(torch_mod, index, root):
    """Facts of this rank's GPU (after torch.cuda.set_device)."""
    p = torch_mod.cuda.get_device_properties(index)
    pci = (f"{getattr(p, 'pci_domain_id', 0):04x}:{p.pci_bus_id:02x}:{p.pci_device_id:02x}.0"  # sysfs form
           if hasattr(p, "pci_bus_id") else None)
    uuid = str(getattr(p, "uuid", "") or "") or None
    if uuid and not uuid.startswith(("GPU-", "MIG-")):
        uuid = "GPU-" + uuid
    txt = (read_text(os.path.join(root, "sys/bus/pci/devices", pci.lower(), "numa_node")) or "").strip() if pci else ""
    numa = int(txt) if txt.lstrip("-").isdigit() else None
    numa_cpus = ((read_text(os.path.join(root, f"sys/devices/system/node/node{numa}/cpulist")) or "").strip() or None
                 if numa is not None and numa >= 0 else None)
    used = None
    with contextlib.suppress(Exception):
        free, total = torch_mod.cuda.mem_get_info(index)
        used = total - free
    return {"name": p.name, "vram": int(p.total_memory), "uuid": uuid, "pci": pci,
            "numa": numa, "numa_cpus": numa_cpus, "mem_used": used,
            **pci_link(root, pci)}  # manifest: PCIe link width and speed


# The oldest torch this tool runs on, the one place it is written (docs/install.md's table, measured by
# bench/torch_compat.sh on 2.4.1, 2.8.0 and 2.14.1). Newer APIs are probed where they are used, each with a
# fallback or a named degradation: Store.clone (not in 2.4; else a second TCPStore client, StoreProtocol.clone),
# the store server on a listen fd (not in 2.4; else the server binds the port itself, store_server),
# split_group (2.6; else new_subgroups_by_enumeration, split_problem), the flight recorder's JSON dump (not in
# 2.4; else the rank's own record, recorder_last), NCCL's RAS as JSON (NCCL 2.28.7; else not read, ras_status).
# Used, all older: init_process_group(device_id=) (2.3), new_group(use_local_synchronization=) and the
# store's append, multi_get, multi_set (2.1).
TORCH_FLOOR = (2, 4)


def torch_floor_problem(version):
    """A torch version string ('2.13.0+cu130', '2.8.0a0+git...') older than TORCH_FLOOR -> the FAILURE
    reason, else None (an unparsable version is let through: the versions check shows it)."""
    m = re.match(r"(\d+)\.(\d+)", str(version or ""))
    if m is None or (int(m.group(1)), int(m.group(2))) >= TORCH_FLOOR:
        return None
    return f"torch {version} is older than the oldest supported {'.'.join(map(str, TORCH_FLOOR))}"


def torch_versions(torch_mod):
    nccl = None
    with contextlib.suppress(Exception):
        if torch_mod.cuda.is_available():
            v = torch_mod.cuda.nccl.version()
            nccl = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
    return {"torch": torch_mod.__version__, "cuda": torch_mod.version.cuda, "nccl": nccl,
            "python": ".".join(map(str, sys.version_info[:3]))}


NODE_ENV_PREFIXES = ("NCCL_", "GLOO_", "TORCH_NCCL_")
PCI_LINK_FILES = ("current_link_width", "current_link_speed", "max_link_width", "max_link_speed")


def node_env(env):
    """A node's own NCCL_/GLOO_/TORCH_NCCL_ settings, through the report's allow-list (safe_env)."""
    return {k: v for k, v in safe_env(env).items() if k.startswith(NODE_ENV_PREFIXES)}


def pci_link(root, pci):
    """PCIe link facts of a device from sysfs: widths as lanes, speeds in GT/s; None where absent."""
    out = dict.fromkeys(PCI_LINK_FILES)
    for name in PCI_LINK_FILES if pci else ():
        m = re.match(r"\s*(\d+(?:\.\d+)?)", read_text(os.path.join(root, "sys/bus/pci/devices", pci.lower(), name))
                     or "")
        if m:
            out[name] = int(float(m.group(1))) if name.endswith("width") else float(m.group(1))
    return out
