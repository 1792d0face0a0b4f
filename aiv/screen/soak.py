"""Floor 3: the soak's judges (--soak): a GPU whose matmul speed decays under sustained load, or whose
clocks slow for heat or power, named with its host."""
from collections import Counter

from ..checks.numerics import judge_numerics_soak
from ..core.base import finding
from ..core.names import throttle_names
from .gpu import per_gpu_findings
from .plan import _screen_worst, _sn, screen_gpu_rows

# -- the soak (--soak SECONDS): a GPU that holds its speed for a second may not hold it for a minute. A
# failing fan, dried thermal paste, blocked airflow or a power brake shows after tens of seconds of load:
# the matmul slows (last window against the first) or the driver reports why the clocks dropped.
SOAK_DECAY_FAIL = 0.90   # GPU: the last window's TFLOPS below 0.90 of the first: FAIL
SOAK_DECAY_WARN = 0.95   # ... below 0.95: WARN
SOAK_FAULTS = 0x8 | 0x20 | 0x40 | 0x80  # HW slowdown, SW thermal, HW thermal, HW power brake: FAIL
SOAK_POWER_CAP = 0x4     # SW power cap: normal for a GPU at full load (H100/H200); only noted, its decay judged


def soak_problems(row, cpu=False):
    """[(status, text)] for one GPU's soak (a judge_soak row): its speed decay (tflops_last against
    tflops_first: below SOAK_DECAY_FAIL FAIL, below SOAK_DECAY_WARN WARN; on CPU not judged: ranks share
    cores with each other and with whatever else runs, so their decay is that noise)
    and clock-event reasons of SOAK_FAULTS seen in any sample (FAIL, with the samples that showed them,
    max temperature, SM clocks and max power). A SW power cap alone is no problem; with a decay the text
    says it was active."""
    out, g = [], row.get
    seen = int(g("throttle_seen") or 0)
    cap = " while the SW power cap was active" if seen & SOAK_POWER_CAP else ""
    first, last = g("tflops_first"), g("tflops_last")
    if first and last is not None and first > 0:
        ratio = last / first
        level = None if cpu else "FAIL" if ratio < SOAK_DECAY_FAIL else "WARN" if ratio < SOAK_DECAY_WARN else None
        if level:
            out.append((level, f"matmul slowed from {_sn(first)} to {_sn(last)} TFLOPS ({ratio:.2f} of the first "
                               f"window) over {g('seconds') or 0:g}s of load{cap}"))
    if seen & SOAK_FAULTS:
        counts = g("throttle_counts") or {}
        names = throttle_names(seen & SOAK_FAULTS)
        ev = [f"max {g('temp_max_c'):g} C" if g("temp_max_c") is not None else None,
              f"SM {g('sm_min_mhz'):g}-{g('sm_max_seen_mhz'):g} MHz" + (
                  f" of {g('sm_rated_mhz'):g}" if g("sm_rated_mhz") else "") if g("sm_min_mhz") is not None else None,
              f"max {g('power_max_w'):g} W" if g("power_max_w") is not None else None]
        out.append(("FAIL", "clocks slowed under sustained load: " + ", ".join(
            f"{n} in {counts.get(n, '?')}/{g('samples') or '?'} samples" for n in names)
            + "".join(f"; {e}" for e in ev if e)))
    return out


def soak_verdict(row, cpu=False):
    """One GPU's soak verdict: PASS, WARN or FAIL (soak_problems' worst)."""
    worst = _screen_worst([s for s, _ in soak_problems(row, cpu)])
    return "PASS" if worst == "OK" else worst


def _soak_who(r):
    dev = f"cuda:{r['device']}" if r.get("device") is not None else "cpu"
    return (f"rank {r['rank']} on {r.get('host')} (GPU {dev}, local rank {r.get('local_rank')}, "
            f"{r.get('uuid') or 'UUID unknown'}, {r.get('model') or 'unknown model'})")


def judge_soak(rows, cpu=False):
    """The soak's findings under 'soak'. rows: [{'rank', 'host', 'local_rank', 'device' (CUDA index or
    None), 'uuid', 'model', 'seconds' (of load), 'tflops_first', 'tflops_last' (window values, 1e12
    FLOP/s; None: too short to time), 'telemetry' ('nvml', 'nvidia-smi' or None), 'samples',
    'temp_max_c', 'sm_min_mhz', 'sm_max_seen_mhz', 'sm_rated_mhz', 'power_max_w', 'throttle_seen'
    (OR of the clock-event masks, None: not read), 'throttle_counts' {name: samples}}]; cpu: gloo ranks.
    -> one finding per GPU with a problem (soak_problems; beyond SCREEN_LIST_MAX one per status listing
    the first ones and a count), or one PASS saying how far the slowest GPU held its speed, the hottest
    GPU, the clock limits seen, and where there was no telemetry (CPU, or neither NVML nor nvidia-smi); then
    the numerics repeats' findings (judge_numerics_soak: check 'numerics', where rows carry them)."""
    rows = sorted(rows or [], key=lambda r: r["rank"])
    if not rows:
        return []
    items = [(_screen_worst([s for s, _ in p]), r, "; ".join(t for _, t in p))
             for r in rows for p in [soak_problems(r, cpu)] if p]
    if not items:
        ratios = [r["tflops_last"] / r["tflops_first"] for r in rows if r.get("tflops_first") and
                  r.get("tflops_last") is not None]
        temps = [r["temp_max_c"] for r in rows if r.get("temp_max_c") is not None]
        limits = Counter(n for r in rows for n in throttle_names(r.get("throttle_seen")))
        none = [r for r in rows if not r.get("telemetry") or not r.get("samples")]
        parts = [f"the slowest held {min(ratios):.2f} of its first window" if ratios else "too short to time windows",
                 f"max temperature {max(temps):g} C" if temps else None,
                 ("clock limits seen: " + ", ".join(f"{n} on {k}" for n, k in sorted(limits.items()))) if limits
                 else None,
                 ("no GPU telemetry on CPU" if cpu else f"no telemetry on {len(none)} GPU(s) (neither NVML nor "
                  f"nvidia-smi answered): judged on TFLOPS alone") if none else None]
        secs = max(float(r.get("seconds") or 0) for r in rows)
        lead = (f"{len(rows)} CPU rank(s) ran {secs:g}s of load at once (decay not judged: ranks share cores)" if cpu
                else f"{len(rows)} GPU(s) held their speed over {secs:g}s of load at once")
        return [finding("soak", "PASS", f"{lead}: " + "; ".join(p for p in parts if p))] + judge_numerics_soak(rows)
    return (per_gpu_findings("soak", items, _soak_who, "GPU(s) did not hold up under sustained load", "persisted")
            + judge_numerics_soak(rows))


def _soak_n(v):
    return "-" if v is None else f"{v:g}"


def soak_rows(records, posts, cpu=False):
    """judge_soak's rows: screen_gpu_rows' (each posting rank's record facts and its post) with the CUDA
    index and the GPU's verdict (soak_verdict)."""
    dev = {rec["rank"]: rec.get("device") for rec in records}
    rows = [dict(r, device=dev.get(r["rank"])) for r in screen_gpu_rows(records, posts, cpu)]
    return [dict(r, verdict=soak_verdict(r, cpu)) for r in rows]
