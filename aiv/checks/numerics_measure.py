"""Floor 2: what the numerics check (silent data corruption) computes on every rank's device: seeded matmuls and an
elementwise kernel, each result reduced to a digest and compared with an fp64 reference; the DDP step's local
gradients; the soak's repeats. How the results are judged is aiv/checks/numerics.py."""
import contextlib
import ctypes
import os
import threading
import time

from ..core.base import first_line, is_tool_error

# What every rank computes (docs/numerics.md). The operands come from one seeded CPU generator, so every rank
# builds the same bits, then go to the rank's device. GPU: a 4096 x 1024 by 1024 x 4096 product, whose 16M
# outputs span every SM of the GPU several times over (a fault tied to one SM or one tensor core shows in some
# tile); CPU (gloo ranks): 128 x 256 by 256 x 256 on one thread.
NUMERICS_SHAPE = {"gpu": (4096, 1024, 4096), "cpu": (128, 256, 256)}   # (M, K, N): A is M x K, B is K x N
NUMERICS_ELEMENTS = {"gpu": 1 << 20, "cpu": 1 << 14}                   # the elementwise kernel's length
NUMERICS_SEED = 31
NUMERICS_BLOCK = 64          # GPU: the fp64 reference computed on the device is checked on this block on the CPU
# Variables that change which kernels cuBLAS runs or how: part of "the same software" (a rank with another
# value is judged in another group, never against the others' bits).
NUMERICS_ENV = ("CUBLAS_WORKSPACE_CONFIG", "CUBLASLT_WORKSPACE_SIZE", "NVIDIA_TF32_OVERRIDE",
                "TORCH_BLAS_PREFER_CUBLASLT", "TORCH_BLAS_PREFER_HIPBLASLT", "CUBLAS_EMULATION_STRATEGY")
NUMERICS_SOAK_EVERY_S = 1.0  # --soak: the numerics repeated at most this often, between timed blocks
# Tolerances against the fp64 reference, as a fraction of each element's scale: ||row i of A|| x ||column j
# of B|| (Cauchy-Schwarz: at least sum_k |a_ik b_kj|, the scale of the classic error bound), plus |bias_j| for
# the linear, plus |a*b| + |c| for the elementwise kernel. Bounds that hold for any order of summation
# (gamma_K = K u / (1 - K u)), times 2: a healthy device never exceeds them.
U32, UBF16, UTF32 = 2.0 ** -24, 2.0 ** -8, 2.0 ** -10


def _gamma(k, u):
    return k * u / (1 - k * u)


def numerics_tolerance(check, k, tf32_forced=False):
    """The largest error against the fp64 reference a healthy device may show, as a fraction of the element's
    scale. bf16: fp32 accumulation (gamma_K), the bf16 output rounding and up to 4 partial sums rounded to bf16
    (split-K with reduced-precision reductions, torch's default); TF32: both inputs rounded to 10 mantissa bits;
    fp32: gamma_K; elementwise: two roundings. NVIDIA_TF32_OVERRIDE=1 makes every fp32 matmul a TF32 one."""
    acc = _gamma(k, U32)
    if check in ("matmul-bf16", "linear-bf16"):
        return 2 * (acc + 5 * UBF16)
    if check == "matmul-tf32" or (tf32_forced and check in ("matmul-fp32", "ddp-grad")):
        return 2 * (acc + 2 * UTF32 + U32)
    if check == "elementwise-fp32":
        return 2 * 2 * U32
    return 2 * (acc + U32)


@contextlib.contextmanager
def fp32_matmul_precision(torch_mod, mode):
    """torch's fp32 matmul precision ('highest': no TF32, 'high': TF32) for the block, put back after: the
    process's own setting is never changed for long (the setting is the process's, not the thread's)."""
    old = torch_mod.get_float32_matmul_precision()
    torch_mod.set_float32_matmul_precision(mode)
    try:
        yield
    finally:
        torch_mod.set_float32_matmul_precision(old)


def cublas_version():
    """cuBLASLt's version (e.g. 130100) from the library this process already loaded, or None."""
    for major in (13, 12, 11):
        with contextlib.suppress(OSError, AttributeError):
            lib = ctypes.CDLL(f"libcublasLt.so.{major}", mode=getattr(os, "RTLD_NOLOAD", 4) | ctypes.RTLD_GLOBAL)
            lib.cublasLtGetVersion.restype = ctypes.c_size_t
            return int(lib.cublasLtGetVersion())
    return None


def numerics_software(torch_mod, dev, kind):
    """What decides the bits of a result besides the device: torch, CUDA, cuBLAS, the BLAS torch prefers, the
    reduced-precision bf16 reduction flag and NUMERICS_ENV; the GPU's SM count and compute capability (the
    driver and the model come from the record, rank 0 adds them)."""
    sw = {"torch": torch_mod.__version__, "env": {k: os.environ[k] for k in NUMERICS_ENV if k in os.environ}}
    if kind == "gpu":
        p = torch_mod.cuda.get_device_properties(dev)
        m = torch_mod.backends.cuda.matmul
        sw.update(sms=p.multi_processor_count, cc=f"{p.major}.{p.minor}", cuda=torch_mod.version.cuda,
                  cublas=cublas_version(), bf16_reduced=bool(m.allow_bf16_reduced_precision_reduction))
        with contextlib.suppress(Exception):
            sw["blas"] = str(torch_mod.backends.cuda.preferred_blas_library()).rsplit(".", 1)[-1]
    else:
        with contextlib.suppress(Exception):
            sw["isa"] = torch_mod.backends.cpu.get_cpu_capability()
    return sw


def numerics_digest(torch_mod, t):
    """A result's bits as 32 hex digits: two weighted sums of its elements' bit patterns (int64, wrapping), each
    weight odd, so that any change of one element changes both; integer sums do not depend on the order of
    summation, so the digest is computed where the result is (the GPU) without copying it."""
    flat = t.detach().contiguous().view(-1)
    ints = {2: torch_mod.int16, 4: torch_mod.int32, 8: torch_mod.int64}[flat.element_size()]
    v = flat.view(ints).to(torch_mod.int64)
    i = torch_mod.arange(v.numel(), device=v.device, dtype=torch_mod.int64)
    w1 = ((i * 2654435761 + 97) % 2147483648) | 1
    w2 = ((i * 40503 + 7919) % 1073741824) * 2 + 1
    s = torch_mod.stack([(v * w1).sum(), (v * w2).sum()]).tolist()
    return "".join(f"{x & 0xFFFFFFFFFFFFFFFF:016x}" for x in s)


def _mm64(torch_mod, a, b):
    """The fp64 product that references a check: aten's mm itself, below torch's public operators, so that
    nothing that wraps or patches torch.matmul, torch.mm or @ in this process bends the reference the checks
    are held to (and fp64 runs on other units than the bf16, TF32 and fp32 products it judges)."""
    return torch_mod.ops.aten.mm.default(a.double(), b.double())


def _compare(torch_mod, res, ref, scale, tol):
    """res against the fp64 reference (same shape): the worst element by error over scale -> the check's
    post without its digest: 'err' (worst error / scale), 'tol', 'off' (err > tol), 'abs', 'rel' (abs / |ref|),
    'at' (the element: [i, j] or [i]), 'value' and 'ref' there. A NaN or infinity is off by itself."""
    r = res.double()
    err = (r - ref).abs()
    norm = torch_mod.where(torch_mod.isfinite(r), err / scale, torch_mod.full_like(err, float("inf")))
    k = int(torch_mod.argmax(norm.view(-1)))
    worst, a, v, want = torch_mod.stack([norm.view(-1)[k], err.view(-1)[k], r.view(-1)[k], ref.view(-1)[k]]).tolist()
    at = list(divmod(k, res.shape[-1])) if res.dim() == 2 else [k]
    return {"err": float(f"{worst:.4g}"), "tol": float(f"{tol:.4g}"), "off": not worst <= tol,
            "abs": float(f"{a:.4g}"), "rel": float(f"{a / abs(want):.4g}") if want else None, "at": at,
            "value": float(f"{v:.8g}"), "ref": float(f"{want:.8g}")}


def _post(torch_mod, res, ref, scale, tol):
    return dict(_compare(torch_mod, res, ref, scale, tol), digest=numerics_digest(torch_mod, res))


def numerics_operands(torch_mod, kind):
    """The seeded operands, on the CPU: A (M x K), B (K x N), a bias (N), uniform in [-1, 1) in fp32, the same
    bits on every rank (torch's CPU generator); the elementwise kernel's a, b, c are slices of A and B."""
    m, k, n = NUMERICS_SHAPE[kind]
    g = torch_mod.Generator().manual_seed(NUMERICS_SEED)

    def u(*shape):
        return torch_mod.empty(*shape).uniform_(-1.0, 1.0, generator=g)
    e = NUMERICS_ELEMENTS[kind]
    a, b = u(m, k), u(k, n)
    return a, b, u(n), (a.view(-1)[:e], b.view(-1)[:e], a.view(-1)[e:2 * e])


def numerics_measure(torch_mod, dev, kind):
    """One rank's numerics on its device (kind 'gpu': a CUDA index, on a stream of the caller's thread; 'cpu':
    one thread): every check of NUMERICS_CHECKS but ddp-grad (matmul-tf32 on GPUs with TF32 only), each result
    compared with the fp64 reference of the whole result and reduced to a digest. On GPU the reference is an
    fp64 product on the device, itself checked on a NUMERICS_BLOCK block against the CPU's. -> {'checks':
    {name: post}, 'software': numerics_software(), 'secs'}."""
    t0 = time.monotonic()
    gpu = kind == "gpu"
    a, b, bias, (x, y, z) = numerics_operands(torch_mod, kind)
    k = a.shape[1]
    tf32_forced = os.environ.get("NVIDIA_TF32_OVERRIDE", "").strip() not in ("", "0")
    threads = torch_mod.get_num_threads()
    ctx = contextlib.ExitStack()
    if gpu:
        torch_mod.cuda.set_device(dev)
        ctx.enter_context(torch_mod.cuda.stream(torch_mod.cuda.Stream(dev)))
        device = torch_mod.device("cuda", dev)
    else:
        torch_mod.set_num_threads(1)  # one thread: the same kernels (and bits) on every rank
        device = torch_mod.device("cpu")
    checks = {}

    def check(name, res, ref, scale, k=k):  # each result against its reference, within its own tolerance
        checks[name] = _post(torch_mod, res, ref, scale, numerics_tolerance(name, k, tf32_forced))
    try:
        with ctx, torch_mod.no_grad():
            a32, b32, bias32 = (t.to(device) for t in (a, b, bias))
            a16, b16, bias16 = (t.to(torch_mod.bfloat16) for t in (a32, b32, bias32))
            scale32 = a32.double().norm(dim=1)[:, None] * b32.double().norm(dim=0)[None, :]
            scale16 = a16.double().norm(dim=1)[:, None] * b16.double().norm(dim=0)[None, :]
            ref32, ref16 = _mm64(torch_mod, a32, b32), _mm64(torch_mod, a16, b16)
            refs_ok = _reference_problem(torch_mod, a, b, ref32) if gpu else None
            with fp32_matmul_precision(torch_mod, "highest"):
                check("matmul-bf16", torch_mod.matmul(a16, b16), ref16, scale16)
                wt = b16.t().contiguous()  # F.linear takes the weight as out_features x in_features
                bias64 = bias16.double()[None, :]
                check("linear-bf16", torch_mod.nn.functional.linear(a16, wt, bias16), ref16 + bias64,
                      scale16 + bias64.abs())
                check("matmul-fp32", a32 @ b32, ref32, scale32)
            if gpu and torch_mod.cuda.get_device_capability(dev)[0] >= 8:
                with fp32_matmul_precision(torch_mod, "high"):
                    check("matmul-tf32", a32 @ b32, ref32, scale32)
            ea, eb, ec = (t.to(device) for t in (x, y, z))
            check("elementwise-fp32", torch_mod.addcmul(ec, ea, eb), ec.double() + ea.double() * eb.double(),
                  (ea.double() * eb.double()).abs() + ec.double().abs(), 1)
            if refs_ok:  # the device's own fp64 is off the CPU's: no check of this rank can be believed
                for c in checks.values():
                    c.update(off=True, reference=refs_ok)
        software = numerics_software(torch_mod, dev, kind)
    finally:
        if not gpu:
            torch_mod.set_num_threads(threads)
    return {"checks": checks, "software": software, "secs": round(time.monotonic() - t0, 3)}


def _reference_problem(torch_mod, a, b, ref):
    """GPU: the device's fp64 product on the first NUMERICS_BLOCK rows and columns against the CPU's; None when
    they agree within fp64's own bound, else the words for the finding (the device's fp64 path is wrong too)."""
    blk = NUMERICS_BLOCK
    cpu = _mm64(torch_mod, a[:blk], b[:, :blk])
    dev = ref[:blk, :blk].cpu()
    scale = a[:blk].double().norm(dim=1)[:, None] * b[:, :blk].double().norm(dim=0)[None, :]
    worst = float(((dev - cpu).abs() / scale).max())
    tol = 2 * _gamma(a.shape[1], 2.0 ** -53)
    if worst <= tol:
        return None
    return f"the device's fp64 reference itself is off the CPU's by {worst:.3g} of the scale (bound {tol:.2g})"


def start_numerics(torch_mod, dev, kind, box):
    """numerics_measure into box['numerics'] (or box['numerics_error'], box['numerics_internal']), then
    box['numerics_done'] set: on whatever thread calls it (GPU ranks: the measuring thread, before the
    screen's measurement)."""
    try:
        box["numerics"] = numerics_measure(torch_mod, dev, kind)
    except Exception as e:
        box["numerics_internal" if is_tool_error(e) else "numerics_error"] = first_line(e)
    finally:
        box["numerics_done"].set()


def rank_numerics(torch_mod, dev, kind, box, wait_s):
    """This rank's numerics for its telemetry: from the measuring thread's box (GPU ranks; waited for at most
    wait_s: not in by then is {'unread': seconds}), else measured here (CPU ranks, on the main thread)."""
    if box is None or "numerics_done" not in box:
        box = {"numerics_done": threading.Event()}
        start_numerics(torch_mod, dev, kind, box)
    if not box["numerics_done"].wait(wait_s):
        return {"unread": round(wait_s, 1)}
    if "numerics" in box:
        return box["numerics"]
    if "numerics_internal" in box:
        return {"internal": box["numerics_internal"]}
    return {"error": box["numerics_error"]}
# -- the DDP step's local gradients: nn.Linear(10, 10), the same seeded weights and input on every rank, one
# forward (the module's call: F.linear) and backward on the rank's device, no DDP, before the DDP step; the
# gradients against the fp64 ones from the closed form of the MSE loss's gradient.
DDP_GRAD_SEED = 1234


def ddp_local_grads(torch_mod, dev):
    """-> the check's post: digest of the gradients' bits, worst error against the fp64 gradients."""
    g = torch_mod.Generator().manual_seed(DDP_GRAD_SEED)
    w, b = torch_mod.randn(10, 10, generator=g) * 0.3, torch_mod.randn(10, generator=g) * 0.3
    x, y = torch_mod.randn(16, 10, generator=g), torch_mod.randn(16, 10, generator=g)
    model = torch_mod.nn.Linear(10, 10)
    with torch_mod.no_grad():
        model.weight.copy_(w)
        model.bias.copy_(b)
    model = model.to(dev)
    with fp32_matmul_precision(torch_mod, "highest"):
        loss = torch_mod.nn.functional.mse_loss(model(x.to(dev)), y.to(dev))
        loss.backward()
    got = torch_mod.cat([model.weight.grad.flatten(), model.bias.grad.flatten()]).detach()
    w64, b64, x64, y64 = (t.double() for t in (w, b, x, y))
    n = y.numel()
    d = 2.0 / n * (_mm64(torch_mod, x64, w64.t()) + b64 - y64)  # dL/d(out)
    ref = torch_mod.cat([_mm64(torch_mod, d.t(), x64).flatten(), d.sum(0)])
    mag = 2.0 / n * (_mm64(torch_mod, x64.abs(), w64.abs().t()) + b64.abs() + y64.abs())  # the scale of d's terms
    scale = torch_mod.cat([_mm64(torch_mod, mag.t(), x64.abs()).flatten(), mag.sum(0)])
    tf32_forced = os.environ.get("NVIDIA_TF32_OVERRIDE", "").strip() not in ("", "0")
    return _post(torch_mod, got.cpu(), ref, scale, 4 * numerics_tolerance("ddp-grad", 16, tf32_forced))
# -- the soak's repeats: the same GPU must give the same bits every time, also hot
class NumericsRepeat:
    """--soak: the bf16 and fp32 matmuls of the numerics check made once on the rank's device (first results
    kept), then repeated by tick() at most every NUMERICS_SOAK_EVERY_S between the soak's timed blocks; a
    repeat whose bits differ from the first is counted, the first few with where and by how much."""

    def __init__(self, torch_mod, dev, kind):
        self.torch, self.repeats, self.mismatches, self.first_bad = torch_mod, 0, 0, []
        a, b, _, _ = numerics_operands(torch_mod, kind)
        device = torch_mod.device("cpu") if kind == "cpu" else (
            torch_mod.device("cuda", dev) if isinstance(dev, int) else dev)  # an index or a torch.device
        a32, b32 = a.to(device), b.to(device)
        self.ops = {"matmul-bf16": (a32.to(torch_mod.bfloat16), b32.to(torch_mod.bfloat16)),
                    "matmul-fp32": (a32, b32)}
        self.first = self._run()
        self.digests = {c: numerics_digest(torch_mod, r) for c, r in self.first.items()}
        self.last = time.monotonic()

    def _run(self):
        with self.torch.no_grad(), fp32_matmul_precision(self.torch, "highest"):
            return {c: self.torch.matmul(a, b) for c, (a, b) in self.ops.items()}

    def tick(self, t):
        """Repeat when NUMERICS_SOAK_EVERY_S passed since the last one; t: seconds into the soak."""
        if time.monotonic() - self.last < NUMERICS_SOAK_EVERY_S:
            return
        self.last = time.monotonic()
        self.repeats += 1
        bad = [(c, r) for c, r in self._run().items() if numerics_digest(self.torch, r) != self.digests[c]]
        for c, r in bad[:3 - len(self.first_bad)]:  # the first few, with where and by how much
            diff = (r.double() - self.first[c].double()).abs()
            k = int(self.torch.argmax(diff.view(-1)))
            self.first_bad.append({"t": round(t, 1), "check": c, "abs": float(f"{float(diff.view(-1)[k]):.4g}"),
                                   "at": list(divmod(k, r.shape[-1]))})
        self.mismatches += bool(bad)

    def summary(self):
        return {"numerics_repeats": self.repeats, "numerics_mismatches": self.mismatches,
                "numerics_first_bad": self.first_bad}
