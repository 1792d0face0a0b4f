"""Floor 2: what the performance screen and the soak measure: nvidia-smi, the device-timed GPU
screen, the all_reduce bus bandwidth, the soak's sampler."""
import contextlib
import functools
import inspect
import math
import os
import shutil
import signal
import subprocess
import sys
import threading
import time

from ..checks.collect import pci_link
from ..checks.numerics_measure import NumericsRepeat, start_numerics
from ..core.base import _screen_median, first_line, first_text_line, is_tool_error
from ..core.deadlines import NODE_SMI_S
from ..core.files import child_finish, child_start, run_bounded
from ..core.names import throttle_names

# What the performance screen measures (section `screen` judges it). GPU: each measurement runs about
# SCREEN_TARGET_S of timed work after a warm-up, in SCREEN_BLOCKS device-synchronised blocks, and the
# median block counts. CPU (gloo runs, CI): tiny sizes on one thread and the best block, because the
# ranks share cores and only a gross fault can be told from their noise.
SCREEN_TARGET_S = {"gpu": 0.3, "cpu": 0.02}            # seconds of timed work per measurement
SCREEN_BLOCKS = 5
SCREEN_HOLD_S = 0.05      # GPU: the blocks are queued behind a kernel that holds the device this long (gated_blocks),
SCREEN_HOLD_GROWTH = 6    # doubled while the host could not queue them in time, at most this many holds (to 1.6 s)
SCREEN_SWITCH_S = 2e-4    # the interpreter's switch interval while a measurement is captured (quick_switch)
SCREEN_MATMUL_N = {"gpu": 8192, "cpu": 256}            # square matmul: bf16 on GPU, fp32 on CPU
SCREEN_COPY_BYTES = {"gpu": 512 << 20, "cpu": 8 << 20}  # memory: STREAM scale (GPU), copy (CPU); read + write
SCREEN_AR_BYTES = {"gpu": 128 << 20, "cpu": 1 << 20}   # all_reduce message of the busbw rounds
SCREEN_AR_ITERS = {"gpu": (3, 12), "cpu": (1, 8)}      # warm-up and timed iterations (median / best)
SCREEN_SMI_S = 3.0    # nvidia-smi must answer within this while the GPU stays loaded; else no such facts
SMI_FIELDS = ("clocks.sm", "clocks.max.sm", "clocks_throttle_reasons.active", "temperature.gpu", "power.draw")
SMI_KEYS = ("sm_mhz", "sm_max_mhz", "throttle", "temp_c", "power_w")
SMI_RENAMED = {"clocks_throttle_reasons.active": "clocks_event_reasons.active"}  # drivers that dropped the old name


def parse_smi(text, keys=SMI_KEYS):
    """nvidia-smi --format=csv,noheader,nounits for SMI_FIELDS -> {SMI_KEYS: value} (keys: the names of the
    fields asked); [N/A], [Not Supported] and unparsable values are left out, a line of the wrong shape gives {}."""
    line = next((ln for ln in (text or "").splitlines() if ln.strip()), "")
    vals = [v.strip() for v in line.split(",")]
    if len(vals) != len(keys):
        return {}
    out = {}
    for key, v in zip(keys, vals, strict=True):
        with contextlib.suppress(ValueError, KeyError):  # a value of none of these shapes is left out
            out[key] = (int(v, 16) if key == "throttle" else {"yes": True, "no": False}[v.lower()]
                        if key.startswith("remap_") else float(v))
    return out


NODE_SMI_FIELDS = ("uuid", "ecc.errors.uncorrected.volatile.total", "remapped_rows.pending", "remapped_rows.failure")
NODE_SMI_KEYS = ("uuid", "ecc_uncorrected", "remap_pending", "remap_failure")


def parse_node_smi(text):
    """The node's one nvidia-smi answer (NODE_SMI_FIELDS, one line per GPU) -> {uuid: {key: value}}; a line of
    the wrong shape or without a UUID is left out."""
    rows = [[v.strip() for v in line.split(",")] for line in (text or "").splitlines()]
    return {vals[0]: parse_smi(",".join(vals[1:]), NODE_SMI_KEYS[1:]) for vals in rows
            if len(vals) == len(NODE_SMI_KEYS) and vals[0].startswith(("GPU-", "MIG-"))}


def read_node_smi(exe, bound=NODE_SMI_S, box=None):
    """One nvidia-smi call for every GPU of the node (no -i), killed past bound seconds: {'gpus': {uuid: facts}}
    or {'unread': why, 'bound': bound}. The node leader calls it once; rank 0 gives each rank its GPU's row.
    box: where the child is kept (box['proc']) for whoever stops waiting for it earlier."""
    cmd = [exe, "--query-gpu=" + ",".join(NODE_SMI_FIELDS), "--format=csv,noheader,nounits"]
    r = run_bounded(cmd, bound, box, "nvidia-smi")  # its own group: a wrapper's children die too; reaped bounded
    if "unread" in r:
        return {"unread": r["unread"], "bound": bound}
    if r["rc"] != 0:
        why = first_text_line(r["err"] or r["out"])
        return {"unread": f"nvidia-smi exited {r['rc']}" + (f": {why}" if why else ""), "bound": bound}
    return {"gpus": parse_node_smi(r["out"])}


def start_node_smi():
    """Node leaders, at launch: read_node_smi in a thread, off the critical path -> its box, or None where
    nvidia-smi is not on PATH (a node without it pays one PATH lookup)."""
    exe = shutil.which("nvidia-smi")
    if not exe:
        return None
    box = {"t0": time.monotonic(), "done": threading.Event()}

    def run():
        try:
            box["smi"] = read_node_smi(exe, NODE_SMI_S, box)
        except Exception as e:  # the facts are then "not read", never silently absent
            if is_tool_error(e):  # the tool's own error: raised again where the facts are taken
                box["internal"] = e
            else:
                box["smi"] = {"unread": f"nvidia-smi failed: {first_line(e)}", "bound": NODE_SMI_S}
        finally:
            box["done"].set()
    threading.Thread(target=run, name="aiv-node-smi", daemon=True).start()
    return box


def finish_node_smi(box, most_s):
    """The node's nvidia-smi facts for the telemetry: waited for until NODE_SMI_S after its start, and at most
    most_s now; an answer not in by then is {'unread': ..., 'bound': seconds it had}."""
    box["done"].wait(max(0.0, min(most_s, box["t0"] + NODE_SMI_S - time.monotonic())))
    if "internal" in box:
        raise box["internal"]
    if "smi" in box:
        return box["smi"]
    if box.get("proc") is not None:  # not waited for any longer: it does not outlive the run
        with contextlib.suppress(OSError):
            os.killpg(box["proc"].pid, signal.SIGKILL)
    had = time.monotonic() - box["t0"]
    return {"unread": f"nvidia-smi gave no answer within {had:.0f}s", "bound": round(had, 1)}


class SmiProbe:
    """nvidia-smi's view of one GPU, asked in a child process while the caller keeps the GPU loaded:
    clocks, active clock limits, temperature and power. One per rank (not one per node like read_node_smi):
    these facts mean something only while this GPU works, and the ranks of a node load their GPUs at
    slightly different times. No nvidia-smi or a field it does not know (under both names): those facts
    are absent; no answer within SCREEN_SMI_S: {'smi_unread': SCREEN_SMI_S}, which the report shows."""

    def __init__(self, uuid):
        self.exe = shutil.which("nvidia-smi") if uuid else None
        self.uuid, self.proc, self.t0 = uuid, None, time.monotonic()
        self.variants = [SMI_FIELDS, tuple(SMI_RENAMED.get(f, f) for f in SMI_FIELDS)]
        self._start()

    def _start(self):
        self.proc = None
        if self.exe and self.variants:
            cmd = [self.exe, "--query-gpu=" + ",".join(self.variants.pop(0)), "--format=csv,noheader,nounits",
                   "-i", self.uuid]
            with contextlib.suppress(OSError):  # cannot start: those facts are absent
                self.proc = child_start(cmd, stderr=subprocess.DEVNULL)

    def finish(self, load):
        """Call load() (one unit of GPU work, synchronised) until nvidia-smi has answered. -> facts."""
        while self.proc is not None:
            left = SCREEN_SMI_S - (time.monotonic() - self.t0)
            if self.proc.poll() is None and left > 0:
                load()
                continue
            r = child_finish(self.proc, max(0.0, left), "nvidia-smi")
            if "unread" in r:
                return {"smi_unread": SCREEN_SMI_S}
            if r["rc"] == 0:
                return parse_smi(r["out"])
            self._start()
        return {}


def pcie_under_load(root, pci):
    """The GPU's PCIe link read while it works (an idle GPU may train its link down to save power)."""
    link = pci_link(root, pci)
    keys = (("pcie_width", "current_link_width"), ("pcie_width_max", "max_link_width"),
            ("pcie_speed", "current_link_speed"), ("pcie_speed_max", "max_link_speed"))
    return {k: link[f] for k, f in keys if link.get(f) is not None}


def _host_rate(fn, work, during=None):
    """CPU: units of `work` per second of fn() on this thread's own CPU clock (time.thread_time: the ranks
    that share a core do not slow each other's number by taking turns): warm-up, a calibration, then
    SCREEN_BLOCKS blocks of about SCREEN_TARGET_S together, the best one. during() runs once after the middle block."""
    clock = time.thread_time
    fn()
    t = clock()
    fn()
    fn()
    one = max((clock() - t) / 2, 1e-7)
    per_block = max(1, int(SCREEN_TARGET_S["cpu"] / SCREEN_BLOCKS / one))
    times = []
    for i in range(SCREEN_BLOCKS):
        t = clock()
        for _ in range(per_block):
            fn()
        times.append(max(clock() - t, 1e-7))
        if during is not None and i == SCREEN_BLOCKS // 2:
            during()
    return work * per_block / min(times)


class HostStarved(RuntimeError):
    """(torch < 2.9, gated blocks) _device_rate could not queue its blocks within the longest hold of the
    device. On the measuring thread that may be the rank's own other threads holding the interpreter lock
    (screen-gpu then measures again on its quiet main thread); there, it says the node cannot drive its GPU."""


def _capture(torch_mod, stream, body):
    """body()'s CUDA calls as one CUDA graph, captured on `stream` in thread-local mode: the CUDA calls of the
    rank's other threads (NCCL's init among them) go on, neither refused nor captured."""
    graph = torch_mod.cuda.CUDAGraph()
    with torch_mod.cuda.stream(stream):
        graph.capture_begin(capture_error_mode="thread_local")
        try:
            body()
        finally:
            graph.capture_end()
    return graph


def gated_blocks(hold, record, replay, started, blocks=None):
    """Queue `blocks` timed blocks behind a hold, so that the device runs them back to back whatever the host
    does meanwhile: hold() (a kernel that keeps the device busy), then for each block record() (an event),
    replay() (the work, one launch), record(). -> (spans [(start, end)], whether the whole queue was in
    before the device reached the first block: started(first start event) still false). When the host was
    slower than the hold (its other threads held the interpreter lock), the caller holds longer."""
    hold()
    spans = []
    for _ in range(blocks or SCREEN_BLOCKS):
        start = record()
        replay()
        spans.append((start, record()))
    return spans, not started(spans[0][0])


_switch_state = {"depth": 0, "saved": None}
_switch_lock = threading.Lock()


@contextlib.contextmanager
def quick_switch(seconds=SCREEN_SWITCH_S):
    """The interpreter's switch interval lowered to `seconds` while a measurement is captured. A capture is
    a thousand short torch calls, and a call that lets go of the interpreter lock waits for it to come back:
    beside a thread that keeps computing in Python, that is a whole switch interval (5 ms by default) per
    call, seconds per measurement with the GPU idle. Process-wide, restored by the last thread out."""
    with _switch_lock:
        if _switch_state["depth"] == 0:
            _switch_state["saved"] = sys.getswitchinterval()
            sys.setswitchinterval(min(seconds, _switch_state["saved"]))
        _switch_state["depth"] += 1
    try:
        yield
    finally:
        with _switch_lock:
            _switch_state["depth"] -= 1
            if _switch_state["depth"] == 0:
                sys.setswitchinterval(_switch_state["saved"])


def graph_timing(torch_mod):
    """Whether CUDA events can be recorded inside a CUDA graph and timed (torch.cuda.Event(external=True),
    torch >= 2.9): then _device_rate queues a whole measurement with one launch (_graph_rate)."""
    try:
        return "external" in inspect.signature(torch_mod.cuda.Event).parameters
    except (TypeError, ValueError):
        return False


def timed_blocks(fn, k, pairs, record):
    """What _graph_rate captures, in order: a lead block of k calls of fn, untimed (the device's clocks and
    power settle under this very load, whatever the device did before), then for each (start, end) of
    `pairs`: record(start), fn() k times, record(end)."""
    for _ in range(k):
        fn()
    for start, end in pairs:
        record(start)
        for _ in range(k):
            fn()
        record(end)


def _graph_rate(torch_mod, fn, work, stream, during, k, before=None):
    """_device_rate with in-graph timing (timed_blocks, launched once). `before`: a graph replayed just ahead
    of it (the calibration's), so that the device is under this load again when the lead block starts,
    however long the capture kept it idle. -> (rate, the graph)."""
    cuda = torch_mod.cuda
    pairs = [(cuda.Event(enable_timing=True, external=True), cuda.Event(enable_timing=True, external=True))
             for _ in range(SCREEN_BLOCKS)]
    graph = _capture(torch_mod, stream, lambda: timed_blocks(fn, k, pairs, lambda e: e.record(stream)))
    with cuda.stream(stream):
        if before is not None:
            before.replay()
        graph.replay()
    if during is not None:  # while the blocks run
        during()
    pairs[-1][1].synchronize()
    graph.events = pairs  # its event nodes record these on every replay: they live as long as the graph
    return work * k / _screen_median([s.elapsed_time(e) / 1e3 for s, e in pairs]), graph


def _device_rate(torch_mod, fn, work, stream, during=None, k=None):
    """GPU: units of `work` per second of fn(), timed on the device (CUDA events), never on the host's clock,
    so that what the host does meanwhile (this rank's other threads, NCCL's init, the node's imports) cannot
    enter the number: k calls of fn() make a block of about SCREEN_TARGET_S / SCREEN_BLOCKS of work; the
    median of SCREEN_BLOCKS timed blocks counts. Where torch times events inside a graph (graph_timing),
    the whole measurement is one graph and one launch (_graph_rate): the device runs it back to back, so no
    host delay (other threads holding the interpreter lock) can enter or stop it; so is the calibration of k
    (a matmul's rate depends on how long the load lasts: the power cap lowers the clocks within a second, so
    a k shrunk by a stalled host would read a burst rate, ~10% higher on an H100). Before that (torch < 2.9):
    _gated_rate. -> (rate, the graph: one measurement's work, for load under nvidia-smi)."""
    with quick_switch():  # each captured or queued call gets the interpreter back at once
        if not graph_timing(torch_mod):
            return _gated_rate(torch_mod, fn, work, stream, during, k)
        with torch_mod.cuda.stream(stream):
            fn()
            fn()  # warm-up: the cuBLAS handle and workspace, outside any capture
        stream.synchronize()
        before = None
        if k is None:  # calls per second, timed inside a graph too: a host stall cannot shrink k
            per_s, before = _graph_rate(torch_mod, fn, 1.0, stream, None, 2)
            k = max(1, int(SCREEN_TARGET_S["gpu"] / SCREEN_BLOCKS * per_s))
        return _graph_rate(torch_mod, fn, work, stream, during, k, before)


def _gated_rate(torch_mod, fn, work, stream, during, k):
    """_device_rate before torch 2.9: each block one replay of a graph of k calls, all of them queued
    behind a hold (gated_blocks); a host too slow to queue them within the hold gets a hold twice as long,
    up to SCREEN_HOLD_GROWTH times, then HostStarved, never a slow number."""
    cuda = torch_mod.cuda

    def record():
        e = cuda.Event(enable_timing=True)
        e.record(stream)
        return e
    with cuda.stream(stream):
        fn()
        fn()  # warm-up: the cuBLAS handle and workspace, the clocks up
        a = record()
        fn()
        fn()
        b = record()
        cuda._sleep(1 << 20)  # the hold's calibration: cycles per second of this GPU's clock
        c = record()
    c.synchronize()
    if k is None:
        k = max(1, int(SCREEN_TARGET_S["gpu"] / SCREEN_BLOCKS / max(a.elapsed_time(b) / 2e3, 1e-7)))
    cycles = int((1 << 20) * SCREEN_HOLD_S / max(b.elapsed_time(c) / 1e3, 1e-7))
    graph = _capture(torch_mod, stream, lambda: timed_blocks(fn, k, (), None))  # k calls of fn, no timed block
    for _ in range(SCREEN_HOLD_GROWTH):
        with cuda.stream(stream):  # a replay goes to the current stream
            spans, whole = gated_blocks(lambda n=cycles: cuda._sleep(n), record, graph.replay, lambda e: e.query())
        if during is not None:  # while the queued blocks run
            during()
            during = None
        spans[-1][1].synchronize()
        if whole:
            return work * k / _screen_median([s.elapsed_time(e) / 1e3 for s, e in spans]), graph
        cycles *= 2  # the host could not queue the blocks within the hold: hold longer
    raise HostStarved(f"{stream.device}: the host could not queue {SCREEN_BLOCKS} timed blocks within a "
                      f"{SCREEN_HOLD_S * (1 << (SCREEN_HOLD_GROWTH - 1)):g}s hold of the device: its process is "
                      "starved of CPU")


def _mm_operands(torch_mod, dev, kind):
    """The square matmul's a, b, c: bf16 where the GPU has it (Ampere on), else fp16; fp32 on CPU."""
    n, dtype = SCREEN_MATMUL_N[kind], torch_mod.float32
    if kind == "gpu":  # the model's peers run the same
        dtype = torch_mod.bfloat16 if torch_mod.cuda.is_bf16_supported() else torch_mod.float16
    return [torch_mod.randn(n, n, device=dev, dtype=dtype) for _ in range(2)] + [
        torch_mod.empty(n, n, device=dev, dtype=dtype)]


def _screen_operands(torch_mod, dev, kind):
    """The matmul's a, b, c (_mm_operands) and the memory measurement's src, dst (fp32, SCREEN_COPY_BYTES each)."""
    src = torch_mod.ones(SCREEN_COPY_BYTES[kind] // 4, dtype=torch_mod.float32, device=dev)
    return _mm_operands(torch_mod, dev, kind), (src, torch_mod.empty_like(src))


def screen_measure_gpu(torch_mod, dev, kind, uuid=None, pci=None, root="/"):
    """One rank's device speed: {'tflops': dense matmul (_mm_operands), 'hbm_gbps': memory copy (read +
    write)}. GPU: _measure_device, with the facts read under load; CPU: on one thread, timed on its CPU
    clock (_host_rate)."""
    if kind == "gpu":
        return _measure_device(torch_mod, dev, uuid, pci, root)
    (a, b, c), (src, dst) = _screen_operands(torch_mod, dev, kind)
    threads = torch_mod.get_num_threads()
    torch_mod.set_num_threads(1)
    try:
        tflops = _host_rate(lambda: torch_mod.mm(a, b, out=c), 2 * SCREEN_MATMUL_N[kind] ** 3 / 1e12)
        hbm = _host_rate(lambda: dst.copy_(src), 2 * src.numel() * 4 / 1e9)
    finally:
        torch_mod.set_num_threads(threads)
    return {"tflops": float(f"{tflops:.4g}"), "hbm_gbps": float(f"{hbm:.4g}")}


def _measure_device(torch_mod, dev, uuid, pci, root):
    """screen_measure_gpu on a GPU: the matmul and the copy each timed on the device by _device_rate on a
    stream of the caller's own (so it may run on a thread of its own while the rank waits), and the facts
    read under load (GPU_FACT_KEYS: the PCIe link from sysfs; nvidia-smi's clocks, limits, temperature, power
    while the matmul's graph keeps the GPU loaded, where it answers in time, else 'smi_unread')."""
    cuda, facts, graphs = torch_mod.cuda, {}, []
    cuda.set_device(dev)  # a thread's own current device (the measuring thread's too)
    stream = cuda.Stream(dev)
    (a, b, c), (src, dst) = _screen_operands(torch_mod, dev, "gpu")
    stream.wait_stream(cuda.current_stream(dev))  # made on this thread's default stream: ready before use
    probe = SmiProbe(uuid)  # started now: it samples while the matmul runs

    def load():  # one block of matmuls, synchronised: the GPU stays loaded until nvidia-smi answers
        with cuda.stream(stream):
            graphs[0].replay()
        stream.synchronize()
    try:
        tflops, g = _device_rate(torch_mod, lambda: torch_mod.mm(a, b, out=c), 2 * SCREEN_MATMUL_N["gpu"] ** 3 / 1e12,
                                 stream, (lambda: facts.update(pcie_under_load(root, pci))) if pci else None)
        graphs.append(g)
        smi = probe.finish(load)
        # STREAM's scale (dst = 1.0 x src): a kernel, read + write counted; a captured copy_ would be a graph
        # memcpy node, which the copy engines run well below the bandwidth of the GPU's own kernels
        hbm, g = _device_rate(torch_mod, lambda: torch_mod.mul(src, 1.0, out=dst), 2 * src.numel() * 4 / 1e9, stream)
        graphs.append(g)
        stream.synchronize()
    finally:
        a = b = c = src = dst = g = None
        del graphs[:]  # the operands and each graph's memory pool go back to the driver
        cuda.empty_cache()
    return {"tflops": float(f"{tflops:.4g}"), "hbm_gbps": float(f"{hbm:.4g}"), **facts, **smi}


def start_screen_gpu(torch_mod, dev, uuid=None, pci=None, root="/", screen=True, numerics=True):
    """GPU ranks, from the end of their local checks: on a thread of its own, first the numerics check
    (start_numerics: box['numerics'], read by rank_numerics at the telemetry), then screen_measure_gpu, while the
    rank waits at the roll call and in init (the device keeps the time, so the host's work in those waits cannot
    enter it) -> the box that take_screen_gpu reads in screen-gpu. screen, numerics: which of the two to run."""
    box = {"done": threading.Event(), "t0": time.monotonic()}
    if numerics:
        box["numerics_done"] = threading.Event()

    def run():
        try:
            if numerics:
                start_numerics(torch_mod, dev, "gpu", box)
            if screen:
                box["row"] = screen_measure_gpu(torch_mod, dev, "gpu", uuid, pci, root)
        except BaseException as e:  # raised again in screen-gpu, on the rank's own thread
            box["error"] = e
        finally:
            box["secs"] = round(time.monotonic() - box["t0"], 3)
            box["done"].set()
    threading.Thread(target=run, name="aiv-screen-gpu", daemon=True).start()
    return box


def take_screen_gpu(box):
    """The measurement of start_screen_gpu, waited for (screen-gpu's bound covers a device that hangs), or its error."""
    box["done"].wait()
    if "error" in box:
        raise box["error"]
    return box["row"]


def can_split(torch_mod, dist):
    """Whether torch.distributed.split_group (torch >= 2.6) can split the default NCCL group (its
    backend supports splitting); else the screen enumerates every group with new_subgroups_by_enumeration."""
    return split_problem(torch_mod, dist) is None


def split_problem(torch_mod, dist):
    """Why the screen cannot split the default NCCL group (can_split), in words, or None when it can."""
    version = getattr(torch_mod, "__version__", "?")
    if not hasattr(dist, "split_group"):
        return f"torch {version} has no split_group"
    try:
        pg = dist.distributed_c10d._get_default_group()
        if pg._get_backend(torch_mod.device("cuda")).supports_splitting:
            return None
    except Exception as e:
        return f"torch {version} cannot split its NCCL group ({first_line(e)})"
    return f"torch {version}'s NCCL backend cannot split a communicator (NCCL older than 2.18?)"


def screen_busbw(torch_mod, dist, group, nranks, dev, kind):
    """all_reduce bus bandwidth of one group as nccl-tests defines it (busbw = algbw x 2(n-1)/n, GB/s =
    1e9 B/s) at SCREEN_AR_BYTES: warm-up, then each iteration timed device-synchronised; the median
    iteration on GPU, the best on CPU. -> (busbw, seconds per iteration)."""
    sync = (lambda: None) if kind == "cpu" else (lambda: torch_mod.cuda.synchronize(dev))
    warm, iters = SCREEN_AR_ITERS[kind]
    size = SCREEN_AR_BYTES[kind]
    x = torch_mod.zeros(size // 4, dtype=torch_mod.float32, device=dev)
    for _ in range(warm):
        dist.all_reduce(x, group=group)
    sync()
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        dist.all_reduce(x, group=group)
        sync()
        times.append(time.perf_counter() - t)
    sec = _screen_median(times) if kind == "gpu" else min(times)
    return size / sec / 1e9 * 2 * (nranks - 1) / nranks, sec


# -- the soak (--soak SECONDS): every GPU under sustained matmul at once, its TFLOPS timed in blocks and
# its telemetry sampled from a thread of its own, so that a slow NVML or nvidia-smi never stalls the load.
# Section `screen` judges the rows (judge_soak).
SOAK_BLOCK_S = {"gpu": 0.25, "cpu": 0.05}  # one timed block of matmuls, device-synchronised
SOAK_WINDOW_BLOCKS = 8   # a window: the median (GPU) or best (CPU) of this many blocks (fewer in a short soak)
SOAK_SAMPLE_S = 1.0      # telemetry period: NVML (nvidia-ml-py), else nvidia-smi in a child bounded by SCREEN_SMI_S
SOAK_WINDOWS_MAX = 64    # at most this many windows kept per GPU (longer soaks: wider windows)
SOAK_TELEMETRY = ("sm_mhz", "sm_max_mhz", "throttle", "temp_c", "power_w")


def nvml_reader(uuid):
    """A function reading one GPU's SOAK_TELEMETRY through NVML (nvidia-ml-py's pynvml), each value
    skipped where NVML refuses it; None when pynvml is missing or does not know the GPU."""
    try:
        import pynvml
        pynvml.nvmlInit()
        h = pynvml.nvmlDeviceGetHandleByUUID(uuid)
    except Exception:
        return None
    reasons = (getattr(pynvml, "nvmlDeviceGetCurrentClocksEventReasons", None)
               or getattr(pynvml, "nvmlDeviceGetCurrentClocksThrottleReasons", None))
    calls = (("sm_mhz", lambda: pynvml.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_SM)),
             ("sm_max_mhz", lambda: pynvml.nvmlDeviceGetMaxClockInfo(h, pynvml.NVML_CLOCK_SM)),
             ("temp_c", lambda: pynvml.nvmlDeviceGetTemperature(h, pynvml.NVML_TEMPERATURE_GPU)),
             ("power_w", lambda: pynvml.nvmlDeviceGetPowerUsage(h) / 1000.0),
             ("throttle", lambda: reasons(h)))

    def read():
        out = {}
        for key, call in calls:
            with contextlib.suppress(Exception):
                out[key] = call()
        return out
    return read


class SoakSampler:
    """One GPU's telemetry every SOAK_SAMPLE_S while the soak runs, from a daemon thread that also opens
    the source (so that not even NVML's start can stall the load): NVML where pynvml is importable and
    knows the GPU, else nvidia-smi (SmiProbe, each call within SCREEN_SMI_S), else nothing (source None;
    always on CPU, where uuid is None). stop() waits at most SCREEN_SMI_S + 1 s for the thread."""

    def __init__(self, uuid):
        self.uuid, self.source, self.samples, self.t0 = uuid, None, [], time.monotonic()
        self._stop, self.thread = threading.Event(), None
        if uuid:
            self.thread = threading.Thread(target=self._loop, name="aiv-soak-sampler", daemon=True)
            self.thread.start()

    def _reader(self):
        read = nvml_reader(self.uuid)
        if read:
            self.source = "nvml"
            return read
        if shutil.which("nvidia-smi"):
            self.source = "nvidia-smi"
            return lambda: SmiProbe(self.uuid).finish(lambda: time.sleep(0.05))
        return None

    def _loop(self):
        read = self._reader()
        while read and not self._stop.is_set():
            t = time.monotonic()
            s = {k: v for k, v in (read() or {}).items() if k in SOAK_TELEMETRY and v is not None}
            if s:
                self.samples.append(dict(s, t=round(t - self.t0, 2)))
            self._stop.wait(max(0.0, SOAK_SAMPLE_S - (time.monotonic() - t)))

    def stop(self):
        self._stop.set()
        if self.thread is not None:
            self.thread.join(SCREEN_SMI_S + 1.0)
        return list(self.samples)


def soak_windows(blocks, cpu=False):
    """TFLOPS of consecutive blocks -> (window size in blocks, one value per window: the median of its
    blocks on GPU, the best on CPU). Up to SOAK_WINDOW_BLOCKS blocks a window, at least 4 windows where
    there are 4 blocks; the window widens past SOAK_WINDOWS_MAX windows; a partial last window is
    joined to the window before."""
    n = len(blocks)
    if not n:
        return 0, []
    w = max(1, min(SOAK_WINDOW_BLOCKS, n // 4), math.ceil(n / SOAK_WINDOWS_MAX))
    chunks = [blocks[i:i + w] for i in range(0, n - w + 1, w)]
    if n % w and len(chunks) > 1:
        chunks[-1] = chunks[-1] + blocks[len(chunks) * w:]
    pick = max if cpu else _screen_median
    return w, [float(f"{pick(c):.4g}") for c in chunks]


def soak_summary(samples):
    """A soak's telemetry samples -> the row's fields: samples, max temperature, min/max SM clock, the
    rated max SM clock, max power, the clock-event reasons seen (OR of the masks) and per reason name the
    count of samples that showed it."""
    out = {"samples": len(samples)}
    for key, k, f in (("temp_max_c", "temp_c", max), ("sm_min_mhz", "sm_mhz", min), ("sm_max_seen_mhz", "sm_mhz", max),
                      ("sm_rated_mhz", "sm_max_mhz", max), ("power_max_w", "power_w", max)):
        v = [float(s[k]) for s in samples if s.get(k) is not None]
        out[key] = round(f(v), 1) if v else None
    masks = [int(s["throttle"]) for s in samples if s.get("throttle") is not None]
    seen = functools.reduce(int.__or__, masks, 0)
    out["throttle_seen"] = seen if masks else None
    out["throttle_reasons"] = throttle_names(seen)
    out["throttle_counts"] = {n: sum(n in throttle_names(m) for m in masks) for n in throttle_names(seen)}
    return out


def soak_measure(torch_mod, dev, kind, seconds, uuid=None, start=None, numerics=True):
    """One rank's soak: square matmul (bf16 on GPU, fp16 before Ampere, fp32 on one CPU thread) in blocks
    of about SOAK_BLOCK_S for `seconds`, while SoakSampler reads the GPU. start(): called once the
    operands are made and warm, before the timed load (the gate that starts every GPU together).
    numerics: between timed blocks, the numerics check's matmuls repeated against their first result
    (NumericsRepeat). -> the row judge_soak takes (without the rank's record facts)."""
    cpu = kind == "cpu"
    sync = (lambda: None) if cpu else (lambda: torch_mod.cuda.synchronize(dev))
    threads = torch_mod.get_num_threads()
    if cpu:
        torch_mod.set_num_threads(1)
    try:
        a, b, c = _mm_operands(torch_mod, dev, kind)
        n, dtype = SCREEN_MATMUL_N[kind], c.dtype

        def mm(calls):  # `calls` matmuls, synchronised -> their seconds
            t = time.perf_counter()
            for _ in range(calls):
                torch_mod.mm(a, b, out=c)
            sync()
            return time.perf_counter() - t
        mm(2)
        per_block = max(1, int(SOAK_BLOCK_S[kind] / max(mm(2) / 2, 1e-7)))
        repeat = NumericsRepeat(torch_mod, dev, kind) if numerics else None
        if start is not None:
            start()
        sampler = SoakSampler(None if cpu else uuid)
        blocks, t0 = [], time.perf_counter()
        try:
            while time.perf_counter() - t0 < seconds:
                blocks.append(2 * n ** 3 * per_block / 1e12 / max(mm(per_block), 1e-9))
                if repeat is not None:  # between timed blocks: never inside a block's time
                    repeat.tick(time.perf_counter() - t0)
            loaded = time.perf_counter() - t0
        finally:
            samples = sampler.stop()
    finally:
        if cpu:
            torch_mod.set_num_threads(threads)
        else:
            with contextlib.suppress(Exception):
                del a, b, c
                torch_mod.cuda.empty_cache()
    w, windows = soak_windows(blocks, cpu)
    return {"dtype": str(dtype).replace("torch.", ""), "seconds": round(loaded, 2), "blocks": len(blocks),
            "window_s": round(loaded * w / max(len(blocks), 1), 2),
            "tflops_windows": windows, "tflops_first": windows[0] if windows else None,
            "tflops_last": windows[-1] if windows else None, "telemetry": sampler.source,
            **soak_summary(samples), **(repeat.summary() if repeat is not None else {})}
