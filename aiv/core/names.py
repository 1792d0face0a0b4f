"""Floor 1: the names the collectors and the judges share, effect-free: the packages probed beside torch,
NVML's clock-event reasons, what nvidia-smi is read for, the numerics check's kinds, the drain reason's
prefix. A judge imports these from here, never from the module that reads the fact (that one acts)."""

# -- the software probed beside torch (checks/collect.py imports them in a child process)
PROBED_PACKAGES = ("torchvision", "torchaudio")


def nccl_list(spec):
    """NCCL's list of names (NCCL_SOCKET_IFNAME, NCCL_IB_HCA): '^' excludes, '=' matches exactly, else
    prefixes -> (exclude, exact, [pattern])."""
    spec = spec.strip()
    exclude, spec = spec.startswith("^"), spec.removeprefix("^")
    exact, spec = spec.startswith("="), spec.removeprefix("=")
    return exclude, exact, [p.strip() for p in spec.split(",") if p.strip()]


def ib_hca_select(spec, ports):
    """Ports NCCL_IB_HCA selects: 'mlx5_0:1,mlx5_1' prefixes; '=' exact; '^' exclude."""
    if not spec:
        return ports
    exclude, exact, pats = nccl_list(spec)

    def hit(port):
        dev, num = port["port"].split(":")
        return any((dev == pd if exact else dev.startswith(pd)) and (not pn or pn == num)
                   for pd, _, pn in (p.partition(":") for p in pats))
    return [p for p in ports if hit(p) != exclude]


# -- facts read under load: the GPU's clock limits (NVML's clock-event reasons)
THROTTLE_IGNORED = 0x1 | 0x2   # GPU idle, application clocks setting: not a slowdown
THROTTLE_REASONS = {0x4: "sw-power-cap", 0x8: "hw-slowdown", 0x10: "sync-boost", 0x20: "sw-thermal",
                    0x40: "hw-thermal", 0x80: "hw-power-brake", 0x100: "display-clocks"}
THROTTLE_FAULTS = 0x8 | 0x20 | 0x40 | 0x80  # heat, a power brake or the board slowing the clocks: a WARN


def throttle_names(mask):
    """Names of the active clock limits in an NVML bitmask, the idle and application-clock bits left out."""
    mask = int(mask or 0) & ~THROTTLE_IGNORED
    names = [n for bit, n in sorted(THROTTLE_REASONS.items()) if mask & bit]
    rest = mask & ~sum(THROTTLE_REASONS)
    return names + ([hex(rest)] if rest else [])


# -- what nvidia-smi is read for (screen/measure.py reads it)
SMI_WHAT = "SM clock, clock limits, temperature and power under load"  # what SmiProbe reads, as a note names it
NODE_SMI_WHAT = "uncorrected ECC errors and row remapping"  # what the node's call reads, as a note names it

# -- the numerics check's kinds (checks/numerics_measure.py computes them, checks/numerics.py judges them)
NUMERICS_CHECKS = ("matmul-bf16", "linear-bf16", "matmul-fp32", "matmul-tf32", "elementwise-fp32", "ddp-grad")
NUMERICS_WHAT = {
    "matmul-bf16": "bf16 matmul through torch.matmul",
    "linear-bf16": "bf16 linear with bias through F.linear",
    "matmul-fp32": "fp32 matmul through @, TF32 off",
    "matmul-tf32": "fp32 matmul through @ with TF32",
    "elementwise-fp32": "fp32 a*b+c through torch.addcmul",
    "ddp-grad": "the DDP step's local gradients before the all-reduce: nn.Linear(10, 10), the same input on "
                "every rank",
}

# -- the drain (out/outputs.py plans it, out/drain.py and node/check.py apply it)
DRAIN_PREFIX = "aiv:"       # the reason's owned prefix: a site finds (and resumes) our drains by it
