"""Floor 3: the GPU screen's judges: each GPU's matmul TFLOPS and memory GB/s against its model's peers, the
per-model table and the floors; a slow GPU measured again before it is named (gpu_suspects, gpu_remeasured,
judge_gpu_transients); its facts under load; the reference and the lines that judged each value (gpu_levels,
judging_lines), which the page draws."""
import re

from ..checks.judge import screen_reference
from ..checks.manifest import BAND_MIN_RUNS, BAND_SLACK, BAND_SLACK_CPU, _band_points, _host_classes
from ..core.base import _screen_sorted, finding, group_by
from ..core.blame import unlocalised
from ..core.names import THROTTLE_FAULTS, throttle_names
from .plan import (
    SCREEN_FLOOR_OPTIONS,
    SCREEN_GPU_LABELS,
    SCREEN_GPU_METRICS,
    SCREEN_LIST_MAX,
    SCREEN_NOISE_SIGMAS,
    _per_status,
    _s3,
    _screen_ref_text,
    _screen_rule,
    _screen_worst,
    _sn,
    screen_against,
    screen_fractions,
    screen_level,
)

# Per-model table: what a healthy GPU of a model reaches in this screen's own measurements (the
# SCREEN_MATMUL_N^3 bf16 matmul, the SCREEN_COPY_BYTES device copy counted read + write). Peers cannot
# see what all of them share (a second job on every GPU, a node or a cluster slow throughout, a job on
# one GPU), so a GPU whose model has a row is ALSO judged against it, whatever the number of its peers:
# below SCREEN_TABLE_FAIL of the row FAIL, below SCREEN_TABLE_WARN WARN. Rows sit below what healthy
# GPUs reach (a false FAIL stops a job for nothing); a row taken from a spec or another benchmark rather
# than measured by this tool sits lower still. Key: the name torch reports (torch.cuda.get_device_name),
# lower-cased, whitespace collapsed, matched by the row's pattern; PCIe and NVL boards (lower power and
# clocks) never match a row (GPU_TABLE_EXCLUDE). Add a row: its name, a pattern that matches only that
# board, TFLOPS and GB/s from a clean run of this tool on a healthy, idle GPU (the screen-gpu progress
# line) lowered by a few percent, and a comment saying where the numbers come from.
SCREEN_TABLE_FAIL = 0.70    # GPU TFLOPS or memory GB/s below 0.70 of its model's row: FAIL
SCREEN_TABLE_WARN = 0.85    # ... below 0.85: WARN
GPU_TABLE_EXCLUDE = r"\b(pcie|nvl)\b"
GPU_TABLE = (  # (row, pattern, TFLOPS, GB/s)
    # measured by this tool on H200 SXM 141 GB: 670-686 TFLOPS, 4,212-4,213 GB/s (20 back-to-back
    # matmuls elsewhere: 760-790); set below the lowest run. "NVIDIA H200" (not GH200, not H200 NVL)
    ("H200 SXM", r"\bh200\b", 660.0, 4100.0),
    # not measured here: the same GH100 compute at 700 W as the H200 (MAMF best shape 794.5 TFLOPS,
    # stas00/ml-engineering), so below the H200 row; HBM3 spec 3,350 GB/s x 0.88 (this tool's H200 copy
    # against its 4,800 spec) = 2,950, set conservatively at 2,800. "NVIDIA H100 80GB HBM3"
    ("H100 SXM", r"\bh100\b.*\b(hbm3|sxm\d?)\b", 620.0, 2800.0),
    # not measured here: MAMF 271.2 TFLOPS x 0.86 (this tool's 8192^3 against the back-to-back H200 number)
    # = 233, set at 220; HBM2e spec 2,039 / 1,555 GB/s x 0.88 = 1,790 / 1,370, set at 1,650 / 1,250
    ("A100 SXM 80GB", r"\ba100\b.*\bsxm\d?\b.*\b80 ?gb\b", 220.0, 1650.0),   # "NVIDIA A100-SXM4-80GB"
    ("A100 SXM 40GB", r"\ba100\b.*\bsxm\d?\b.*\b40 ?gb\b", 220.0, 1250.0),   # "NVIDIA A100-SXM4-40GB"
    # not measured here: MAMF 1,745 TFLOPS x 0.86 = 1,500, set at 1,350 (boards ship at 1,000 W and
    # more); HBM3e spec 8,000 GB/s x 0.88 = 7,040, set at 6,200. "NVIDIA B200" (not GB200)
    ("B200", r"\bb200\b", 1350.0, 6200.0),
)


def gpu_table_row(model):
    """The GPU_TABLE row for a device name (case and spacing ignored) -> {'row', 'tflops', 'hbm_gbps'}, or
    None: no row, a PCIe or NVL board, no name."""
    name = " ".join(str(model or "").lower().split())
    if not name or re.search(GPU_TABLE_EXCLUDE, name):
        return None
    return next(({"row": row, "tflops": tflops, "hbm_gbps": gbps} for row, pattern, tflops, gbps in GPU_TABLE
                 if re.search(pattern, name)), None)


def table_level(value, ref):
    """'FAIL', 'WARN' or 'OK' of a value against a table number (None: 'OK'); a value of None is 0.0."""
    return screen_level(value, {"ref": ref}, SCREEN_TABLE_FAIL, SCREEN_TABLE_WARN)


def _table_rule():
    return f"FAIL below {SCREEN_TABLE_FAIL:.2f}, WARN below {SCREEN_TABLE_WARN:.2f} of the row"


def gpu_refs(per_rank, floors, cpu=False, bands=None):
    """Per model and metric what the GPUs were judged against: {(model, metric): {'peers': screen_reference,
    'table': {'row', 'ref'}|None (never on CPU), 'floor': float|None, 'against': screen_against(...)}}.
    bands: the names of the manifest's judging bands (screen_band_names), or None when not known here."""
    by_model, out = group_by(per_rank, lambda r: r.get("model") or "unknown"), {}
    for model, rs in sorted(by_model.items()):
        row = None if cpu else gpu_table_row(model)
        for metric, unit, floor_name in SCREEN_GPU_METRICS:
            peers = screen_reference(r.get(metric) for r in rs)
            table = {"row": row["row"], "ref": row[metric]} if row else None
            floor = floors.get(floor_name)
            band = None if bands is None else (f"gpu.{metric}/{model}" if f"gpu.{metric}/{model}" in bands else "")
            out[(model, metric)] = {
                "peers": peers, "table": table, "floor": floor,
                "against": screen_against(f"{SCREEN_GPU_LABELS[metric]} of {model}", len(rs), "rank" if cpu else "GPU",
                                          "model", peers, unit.split()[0], table, floor, floor_name, band,
                                          "CPU ranks" if cpu else "")}
    return out


def _gpu_flags(per_rank, floors, cpu):
    """-> (refs {(model, metric): peers' screen_reference}, flags {rank: (entry, [(metric, level, text)])}).
    Each value against its floor, its model's table row and its peers (from 2 GPUs of the model on); the
    text names every reference it fell below, each with its rule."""
    fail, warn = screen_fractions("gpu", cpu)
    allrefs, flags = gpu_refs(per_rank, floors, cpu), {}
    for r in per_rank:
        model = r.get("model") or "unknown"
        for metric, unit, floor_name in SCREEN_GPU_METRICS:
            if r.get(metric) is None:
                continue
            ref = allrefs[(model, metric)]
            v, floor, table, peers = float(r[metric]), ref["floor"], ref["table"], ref["peers"]
            why = []
            if floor is not None and v < floor:
                why.append(("FAIL", f"below the floor {floor:g} {unit} ({SCREEN_FLOOR_OPTIONS[floor_name]}, "
                                    f"the floor decided)"))
            lv = table_level(v, table["ref"]) if table else "OK"
            if lv != "OK":
                why.append((lv, f"{v / table['ref']:.2f} of the table row {table['row']} ({_sn(table['ref'])} "
                                f"{unit.split()[0]}; {_table_rule()})"))
            lv = screen_level(v, peers, fail, warn) if peers["count"] >= 2 else "OK"
            if lv != "OK":
                why.append((lv, f"{v / peers['ref']:.2f} of the {model} peers' reference "
                                f"{_screen_ref_text(peers, unit)} ({_screen_rule('gpu', cpu)})"))
            if why:
                level = _screen_worst([w for w, _ in why])
                flags.setdefault(r["rank"], (r, []))[1].append(
                    (metric, level, f"{_sn(v)} {unit} [{level}]: " + " and ".join(t for _, t in why)))
    return {k: x["peers"] for k, x in allrefs.items()}, dict(sorted(flags.items()))


def _gpu_who(r):
    return (f"rank {r['rank']} on {r.get('host')} (local rank {r.get('local_rank')}, GPU {r.get('uuid') or '-'}, "
            f"{r.get('model') or 'unknown model'})")


def _gpu_perf_pass(n_gpus, against, cpu):
    """judge_gpu_perf's PASS: what each model and metric was judged against (gpu_refs' 'against'), and how
    many measurements were judged against nothing."""
    unjudged = sum(not a["judged"] for a in against)
    head = (f"GPU speed within the reference on {n_gpus} GPU(s)" if not unjudged else
            f"GPU speed on {n_gpus} GPU(s), {unjudged} of {len(against)} measurement(s) judged against nothing")
    rules = ([f"peers: {_screen_rule('gpu', cpu)}"] if any(a["peers"] for a in against) else []) \
        + ([f"table: {_table_rule()}"] if any(a["table"] for a in against) else [])
    return finding("gpu-perf", "PASS", f"{head}: " + "; ".join(a["text"] for a in against)
                   + (f" ({'; '.join(rules)})" if rules else ""))


def judge_gpu_perf(per_rank, min_tflops=None, min_hbm=None, cpu=False, who=None):
    """Per-GPU compute and memory speed against its model's table row (GPU_TABLE, GPU only, whatever the
    number of GPUs: below SCREEN_TABLE_FAIL of it FAIL, below SCREEN_TABLE_WARN WARN), the other GPUs of its
    model (from 2 on, per model and metric: below SCREEN_GPU_FAIL of their screen_reference FAIL, below
    SCREEN_GPU_WARN WARN) and the floors min_tflops, min_hbm (FAIL below; None: none). The worst level
    counts; the text names what decided it. cpu=True: no table; ranks sharing cores give numbers that are
    not comparable, so only values below SCREEN_CPU_FAIL of the peers' reference FAIL and nothing WARNs.
    per_rank: [{'rank': int, 'host': str, 'local_rank': int, 'uuid': str|None, 'model': str|None,
                'tflops': float|None (dense matmul, bf16 on GPU, fp32 on CPU, in 1e12 FLOP/s),
                'hbm_gbps': float|None (device-memory copy, 1e9 B/s)}]; None: not measured (skipped).
    -> findings under 'gpu-perf': one per flagged rank naming rank, host, local rank and GPU UUID (one
    finding per status listing them when more than SCREEN_LIST_MAX ranks are flagged), or one PASS
    saying what each model was judged against (or that nothing was) and the count of GPUs. who(row): a GPU's
    words (the node gate's: its index on the node)."""
    per_rank, who = list(per_rank or []), who or _gpu_who
    if not per_rank:
        return []
    floors = {"min_tflops": min_tflops, "min_hbm": min_hbm}
    _, flags = _gpu_flags(per_rank, floors, cpu)
    allrefs = gpu_refs(per_rank, floors, cpu)
    if not flags:
        return [_gpu_perf_pass(len(per_rank), [x["against"] for x in allrefs.values()], cpu)]
    items = list(flags.items())
    if len(items) > SCREEN_LIST_MAX:
        return _gpu_everyone(_gpu_perf_many(items, who), per_rank)
    return _gpu_everyone([_gpu_blame(dict(finding("gpu-perf", _screen_worst([lv for _, lv, _ in fl]),
                                                  f"{who(r)}: " + "; ".join(t for _, _, t in fl)
                                                  + _gpu_unused(r, allrefs), [r.get("host")], [rk]),
                                          evidence=_gpu_evidence(r, allrefs, cpu), action=_gpu_action(r)), [r])
                          for rk, (r, fl) in items], per_rank)


def _gpu_unused(r, allrefs):
    """'; not judged against' what rank r's GPU lacked (a reference missing, per metric), or ''."""
    lack = {}
    for k, _, _ in SCREEN_GPU_METRICS:
        for m in allrefs[(r.get("model") or "unknown", k)]["against"]["missing"]:
            lack.setdefault(m, []).append(SCREEN_GPU_LABELS[k])
    return "; not judged against " + ", ".join(
        m if len(ks) == len(SCREEN_GPU_METRICS) else f"{m} for {' and '.join(ks)}" for m, ks in lack.items()) \
        if lack else ""


def _gpu_evidence(r, allrefs, cpu):
    """How rank r's slow GPU was measured: again (and its first numbers) or once, and how."""
    how = ("its own CPU clock, best of 5 blocks" if cpu else
           "5 device-timed blocks run back to back, median")
    again = (f"measured again on {r.get('host')}, slow again (first " + ", ".join(
        f"{_sn(v)} {u}" for k, u, _ in SCREEN_GPU_METRICS for v in [(r.get("first") or {}).get(k)] if v is not None)
        + ", the better counting)"
        if _gpu_again(r) else f"measured once on {r.get('host')}")
    return f"{again} ({how}){_gpu_unused(r, allrefs)}"


def _gpu_action(r):
    drain = ("drain the node and run the vendor's diagnostics (dcgmi diag -r 3): clocks, power or thermal limits "
             "(see the GPU facts), a degraded PCIe link")
    return drain if _gpu_again(r) else f"re-run the preflight; if the GPU is slow again, {drain}"


def _gpu_perf_many(items, who):
    """More than SCREEN_LIST_MAX flagged GPUs: one finding per status, the first few named."""
    out = []
    for status, sel, more in _per_status([(rk, r, fl) for rk, (r, fl) in items],
                                         lambda x: _screen_worst([lv for _, lv, _ in x[2]])):
        shown = "; ".join(f"{who(r)}: {fl[0][2]}" for _, r, fl in sel[:SCREEN_LIST_MAX])
        hosts = [r.get("host") for _, r, _ in sel]
        out.append(_gpu_blame(dict(finding("gpu-perf", status, f"{len(sel)} GPU(s) slow on {len(set(hosts))} "
                                           f"node(s): {shown}{more}", hosts, [rk for rk, _, _ in sel]),
                                   evidence=f"{len(sel)} GPU(s), each measured "
                                   + ("again" if all(_gpu_again(r) for _, r, _ in sel) else "once"),
                                   action=_gpu_action(sel[0][1])), [r for _, r, _ in sel]))
    return out


def _gpu_everyone(found, per_rank):
    """found, where every GPU of a run on two or more nodes is slow: a cause the nodes share (the image, the
    driver, a power policy, a floor set above what the model reaches), named on no host."""
    hosts = {r.get("host") for r in per_rank}
    slow = {rk for f in found for rk in f["ranks"]}
    if len(hosts) < 2 or slow != {r["rank"] for r in per_rank}:
        return found
    return [f if not f["hosts"] else unlocalised(f, "everyone", "the GPUs' clocks and power limits on every node "
                                                 "(nvidia-smi -q -d PERFORMANCE), the floors set, the image")
            for f in found]


def _gpu_again(r):
    """Whether a GPU row was measured again and was slow again ('tries' >= 2: screen_loop's re-measure rule)."""
    return int(r.get("tries") or 1) >= 2


def _gpu_blame(f, rows):
    """A gpu-perf finding's blame: 'persisted' when every GPU it names was slow again when measured again,
    else 'once' (no host is named: a value measured once is not evidence that persists)."""
    if all(_gpu_again(r) for r in rows):
        return dict(f, blame="persisted")
    return unlocalised(f, "once", "a re-run: a GPU slow again when measured again is named with its host")


def screen_band_lines(manifest, records, screen):
    """The manifest's speed bands that judge this run (as judge_bands: BAND_MIN_RUNS runs or more), each with
    the value below which it FAILs a measurement, for the page to draw: [{'band', 'class', 'hosts' (this run's
    hosts of that class), 'lo', 'hi', 'ref', 'runs', 'slack', 'fail_below'}], [] without a manifest."""
    classes, host_class = (manifest or {}).get("classes") or {}, _host_classes(records or [])
    slack = BAND_SLACK_CPU if (screen or {}).get("cpu") else BAND_SLACK
    seen = {}
    for cls, band, _, hosts, *_ in _band_points(screen, host_class):
        b = ((classes.get(cls) or {}).get("bands") or {}).get(band)
        if b and b.get("runs", 1) >= BAND_MIN_RUNS:
            e = seen.setdefault((band, cls), {"band": band, "class": cls, "hosts": set(), "lo": b["lo"], "hi": b["hi"],
                                              "ref": b["ref"], "runs": b["runs"], "slack": slack,
                                              "fail_below": slack * b["lo"]})
            e["hosts"].update(h for h in hosts if h is not None)
    return [dict(e, hosts=_screen_sorted(e["hosts"])) for _, e in sorted(seen.items())]


def judging_lines(values_ref, fail, warn, table=None, floor=None, floor_name=None, bands=(), peers_word="peers"):
    """The lines a set of like-for-like values was judged against, in the values' own unit, exactly as the
    judges apply them: the peers' reference (screen_reference, from 2 values on) with its FAIL fraction and its
    WARN line (the WARN fraction, or SCREEN_NOISE_SIGMAS spreads below the reference where that is lower:
    screen_level), a table row {'row', 'ref'} with SCREEN_TABLE_FAIL/WARN of it (table_level), the floor (a
    --min-* value; floor_name its SCREEN_FLOOR_OPTIONS key) and the manifest bands (screen_band_lines entries:
    FAIL below 'fail_below'). -> [{'kind': 'ref'|'fail'|'warn'|'row'|'floor'|'band', 'level': 'FAIL'|'WARN'|
    None (a reference, no threshold), 'value', 'text'}]; a value below a line of level FAIL is judged FAIL."""
    out, p = [], values_ref or {}
    if p.get("count", 0) >= 2 and p.get("ref"):
        r = float(p["ref"])
        out.append({"kind": "ref", "level": None, "value": r,
                    "text": f"{peers_word}' reference {_s3(r)} ({p['how']} of {p['count']})"})
        out.append({"kind": "fail", "level": "FAIL", "value": fail * r,
                    "text": f"FAIL below {fail:.2f} of the reference: {_s3(fail * r)}"})
        w = None if warn is None else min(warn * r, r - SCREEN_NOISE_SIGMAS * float(p.get("spread") or 0.0))
        if w is not None and w > 0:
            out.append({"kind": "warn", "level": "WARN", "value": w,
                        "text": f"WARN below {warn:.2f} of the reference"
                                + (f" and {SCREEN_NOISE_SIGMAS:g} spreads below it" if w < warn * r else "")
                                + f": {_s3(w)}"})
    if table:
        t = float(table["ref"])
        out += [{"kind": "row", "level": None, "value": t, "text": f"table row {table['row']}: {_s3(t)}"},
                {"kind": "fail", "level": "FAIL", "value": SCREEN_TABLE_FAIL * t,
                 "text": f"FAIL below {SCREEN_TABLE_FAIL:.2f} of the row: {_s3(SCREEN_TABLE_FAIL * t)}"},
                {"kind": "warn", "level": "WARN", "value": SCREEN_TABLE_WARN * t,
                 "text": f"WARN below {SCREEN_TABLE_WARN:.2f} of the row: {_s3(SCREEN_TABLE_WARN * t)}"}]
    if floor is not None:
        out.append({"kind": "floor", "level": "FAIL", "value": float(floor),
                    "text": f"floor {SCREEN_FLOOR_OPTIONS.get(floor_name, 'floor')} {floor:g}: FAIL below"})
    for b in bands:
        out.append({"kind": "band", "level": "FAIL", "value": float(b["fail_below"]),
                    "text": f"manifest band {b['band']} of {b['class']}: FAIL below {b['slack']:g} x its lowest "
                            f"{_s3(b['lo'])}: {_s3(b['fail_below'])}"})
    return out


def band_level(value, host, bands):
    """'FAIL' when a manifest band that judges `host` FAILs the value (as _below_band), else 'OK'."""
    v = value if isinstance(value, (int, float)) else None
    return "FAIL" if v is not None and any(host in b["hosts"] and v < b["fail_below"] for b in bands) else "OK"


GPU_FACT_KEYS = ("pcie_width", "pcie_width_max", "pcie_speed", "pcie_speed_max", "sm_mhz", "sm_max_mhz",
                 "throttle", "temp_c", "power_w", "ecc_uncorrected", "remap_pending", "remap_failure")


def gpu_fact_problems(row):
    """[(status, text)] for one GPU's facts (a judge_gpu_perf row with GPU_FACT_KEYS, each optional): under
    load, PCIe link below its maximum width or speed, clocks slowed by THROTTLE_FAULTS; from its node's
    nvidia-smi (the preflight's read_node_smi, the node gate's one query), the memory error policy of both
    modes, after NVIDIA's GPU memory error management: uncorrected ECC errors since the driver loaded and a
    pending row remap WARN (error containment and dynamic page offlining keep new work unaffected; the remap
    takes effect at the next GPU reset), a failed row remap FAILs (the GPU meets NVIDIA's RMA policy)."""
    out, g = [], row.get
    for k, link in (("pcie_width", "x{} of x{}"), ("pcie_speed", "{:g} of {:g} GT/s")):  # below its maximum
        if g(k) and g(f"{k}_max") and g(k) < g(f"{k}_max"):
            out.append(("WARN", f"PCIe link {link.format(g(k), g(f'{k}_max'))} under load"))
    if int(g("throttle") or 0) & THROTTLE_FAULTS:
        clock = f" (SM {g('sm_mhz'):g} of {g('sm_max_mhz'):g} MHz)" if g("sm_mhz") and g("sm_max_mhz") else ""
        out.append(("WARN", f"clocks slowed under load: {', '.join(throttle_names(g('throttle')))}{clock}"))
    if g("ecc_uncorrected"):
        out.append(("WARN", f"{g('ecc_uncorrected'):g} uncorrected ECC error(s) since the driver loaded (contained "
                            "and the page offlined; reset the GPU when it is idle)"))
    if g("remap_failure"):
        out.append(("FAIL", "row remapping failed: memory the GPU can no longer repair (replace it: NVIDIA's RMA "
                            "policy)"))
    elif g("remap_pending"):
        out.append(("WARN", "row remapping pending: reset the GPU (nvidia-smi -r) when it is idle to apply it; new "
                            "work is unaffected until then"))
    return out


def judge_gpu_facts(per_rank, check="gpu-perf", who=None):
    """Findings under `check` ('gpu-perf' in the preflight, 'gpu-health' in the node gate) from each GPU's
    facts (gpu_fact_problems), blame 'own': one per GPU with a problem, or beyond SCREEN_LIST_MAX GPUs one per
    status listing the first ones and a count. who(row): the GPU's words. No PASS finding: judge_gpu_perf (the
    node gate's judge_gpu_health) gives it."""
    flagged = [(r, p) for r in sorted(per_rank or [], key=lambda r: r["rank"]) for p in [gpu_fact_problems(r)] if p]
    items = [(_screen_worst([s for s, _ in p]), r, "; ".join(t for _, t in p)) for r, p in flagged]
    return per_gpu_findings(check, items, who or _gpu_who, "GPU(s) with a problem under load")


def per_gpu_findings(check, items, who, headline, blame="own"):
    """items [(status, rank record, text)] -> one finding per GPU, or beyond SCREEN_LIST_MAX GPUs one per
    status: '<n> <headline>: ' the first ones (who(record): text) and a count of the rest."""
    if len(items) <= SCREEN_LIST_MAX:
        return [finding(check, st, f"{who(r)}: {txt}", [r.get("host")], [r["rank"]], blame=blame)
                for st, r, txt in items]
    return [finding(check, status, f"{len(sel)} {headline}: " + "; ".join(
        f"{who(r)}: {txt}" for _, r, txt in sel[:SCREEN_LIST_MAX]) + more,
        [r.get("host") for _, r, _ in sel], [r["rank"] for _, r, _ in sel], blame=blame)
        for status, sel, more in _per_status(items, lambda x: x[0])]


def gpu_levels(screen):
    """Per GPU row, against the reference that judged it: {rank: {metric: (value, ratio, level)}}, plus the
    refs {(model, metric): {'ref', 'how', 'count'}} drawn at 1.0 (the judge's references and levels,
    judge_gpu_perf): its model's peers where it has two or more of them, else its model's table row (a lone
    GPU is never drawn at 1.0 of itself), else itself (judged by the floor alone)."""
    rows = (screen or {}).get("gpu") or []
    fail, warn = screen_fractions("gpu", bool((screen or {}).get("cpu")))
    floors = {"tflops": (screen or {}).get("min_tflops"), "hbm_gbps": (screen or {}).get("min_hbm")}
    refs, out = {}, {}
    for metric in ("tflops", "hbm_gbps"):
        for model in {r.get("model") or "unknown" for r in rows}:
            same = (r.get(metric) for r in rows if (r.get("model") or "unknown") == model
                    and isinstance(r.get(metric), (int, float)) and r.get(metric) == r.get(metric))
            refs[(model, metric)] = screen_reference(same)
        for r in rows:
            model = r.get("model") or "unknown"
            v, ref = r.get(metric), refs[(model, metric)]
            if not isinstance(v, (int, float)) or v != v or v in (float("inf"), float("-inf")) or not ref["ref"]:
                continue  # not measured (None, NaN, text): nothing to draw
            row = None if (screen or {}).get("cpu") else gpu_table_row(r.get("model"))
            table = (row or {}).get(metric)
            lv = _screen_worst([screen_level(v, ref if ref["count"] >= 2 else {}, fail, warn, floors[metric]),
                                table_level(v, table)])  # as judge_gpu_perf: peers, floor, table
            base = ref["ref"]
            if ref["count"] < 2 and table:  # a lone GPU: drawn against the row that judged it
                base = table
                refs[(model, metric)] = {"ref": table, "how": f"table row {row['row']}", "count": ref["count"]}
            out.setdefault(r.get("rank"), {})[metric] = (float(v), float(v) / base, lv)
    return out, refs


def gpu_suspects(per_rank, floors=None, cpu=False):
    """The ranks whose GPU row is slow (WARN or FAIL against its peers, its table row or a floor: judge_gpu_perf's
    rule): the GPUs measured again before any is named (the screen blames only what persists)."""
    return sorted(_gpu_flags(list(per_rank or []), floors or {}, cpu)[1])  # floors: min_tflops, min_hbm


def gpu_remeasured(per_rank, again):
    """per_rank rows with each re-measurement in `again` ({rank: the new row's measurements}) merged: 'tries' 2,
    'first' the first values of each metric, and each metric the better of the two (faults only lower numbers:
    a GPU slow again is slow in its best value; one at speed again was a transient). A rank missing from
    `again` (not measured again in time, or starved) keeps its single measurement."""
    out = []
    for r in per_rank or []:
        new = (again or {}).get(r["rank"])
        if isinstance(new, dict):
            r = dict(r, tries=int(r.get("tries") or 1) + 1, first={k: r.get(k) for k, _, _ in SCREEN_GPU_METRICS},
                     **{k: max([v for v in (r.get(k), new.get(k)) if isinstance(v, (int, float))], default=None)
                        for k, _, _ in SCREEN_GPU_METRICS})
        out.append(r)
    return out


def judge_gpu_transients(per_rank, floors=None, cpu=False, who=None):
    """GPUs slow at first and at speed when measured again: one WARN under 'gpu-perf' naming no host (a burst of
    another process's work, a moment of contention), with what was seen; [] when none."""
    rows = [r for r in per_rank or [] if _gpu_again(r)]
    slow = set(gpu_suspects(rows, floors, cpu))
    seen = [r for r in rows if r["rank"] not in slow]
    if not seen:
        return []
    who = who or _gpu_who
    items = [f"{who(r)}: " + ", ".join(f"{SCREEN_GPU_LABELS[k]} {_sn((r.get('first') or {}).get(k) or 0)} then "
                                             f"{_sn(r.get(k) or 0)}" for k, _, _ in SCREEN_GPU_METRICS) for r in seen]
    shown = "; ".join(items[:8]) + (f"; and {len(items) - 8} more" if len(items) > 8 else "")
    return [dict(finding("gpu-perf", "WARN", f"{len(seen)} GPU(s) slow at first and at speed when measured again: "
                         f"{shown}: a transient (another process on the GPU, a burst), no host is named",
                         blame="once"),
                 evidence=f"{len(seen)} GPU(s) slow once, at speed when measured again", transient=True,
                 action="none now: nothing is drained; re-run the preflight if the same GPU recurs")]
