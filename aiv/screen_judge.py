"""Floor 3: the screen's judges: per-GPU TFLOPS and GB/s against model peers and the table (and the
reference that judged each number, gpu_levels), intra-node and inter-node busbw, node / rail / link
culprits, GPU facts under load."""
import re

from .base import _screen_key, _screen_median, _screen_sorted, compress_hostlist, finding, format_ranges
from .collect import THROTTLE_FAULTS, throttle_names
from .judge import screen_reference
from .manifest import BAND_MIN_RUNS, BAND_SLACK, BAND_SLACK_CPU, _band_points, _host_classes
from .screen_plan import (
    SCREEN_LIST_MAX,
    SCREEN_NOISE_SIGMAS,
    screen_fractions,
    screen_level,
    screen_pair_levels,
    suspect_round,
)

SCREEN_RENDER_ALL = 16      # up to this many nodes the PERFORMANCE section shows every node and every group
SCREEN_RENDER_SLOW = 32     # beyond that, at most this many slow groups are listed (then a count)


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
    for row, pattern, tflops, gbps in GPU_TABLE:
        if re.search(pattern, name):
            return {"row": row, "tflops": tflops, "hbm_gbps": gbps}
    return None


def table_level(value, ref):
    """'FAIL', 'WARN' or 'OK' of a value against a table number (None: 'OK'); a value of None is 0.0."""
    if not ref:
        return "OK"
    v = 0.0 if value is None else float(value)
    return "FAIL" if v < SCREEN_TABLE_FAIL * ref else "WARN" if v < SCREEN_TABLE_WARN * ref else "OK"


def screen_best(rows, redone):
    """rows with re-measurements merged: per (nodes, rail) the best busbw counts; 'tries' counts the
    measurements and 'first' keeps the first value (a re-measured row). redone: screen_measured rows."""
    best = {(tuple(m["nodes"]), m["rail"]): m for m in redone}
    out = []
    for m in rows:
        r = best.get((tuple(m["nodes"]), m["rail"]))
        if r is None:
            out.append(m)
            continue
        tries = m.get("tries", 1) + 1
        keep = m if (m.get("busbw") or 0.0) >= (r.get("busbw") or 0.0) else dict(m, busbw=r["busbw"],
                                                                               time_us=r.get("time_us"))
        out.append(dict(keep, tries=tries, first=m.get("first", m.get("busbw"))))
    return out


def _screen_worst(levels):
    return "FAIL" if "FAIL" in levels else "WARN" if "WARN" in levels else "OK"


def _sn(x):
    """A screen number for the report: one decimal from 1 up, two significant digits below (CPU runs
    measure GB/s and TFLOPS in hundredths)."""
    x = float(x)
    return f"{x:.1f}" if abs(x) >= 1 or x == 0 else f"{x:.2g}"


def _s3(x):
    """A value for a picture: 3 significant digits (0.0921, 12.3, 670, 4213), never rounded to nothing."""
    x = float(x)
    return f"{x:.3g}" if abs(x) >= 1e6 else f"{x:.0f}" if abs(x) >= 100 else f"{x:.3g}"


def _screen_ref_text(ref, unit, noun=""):
    return f"{_sn(ref['ref'])} {unit} ({ref['how']} of {ref['count']}{' ' + noun if noun else ''})"


def _screen_rule(kind, cpu):
    fail, warn = screen_fractions(kind, cpu)
    if cpu:
        return (f"CPU ranks share cores, so their numbers are not comparable: only values below {fail:.2f} "
                f"of the reference FAIL and nothing WARNs")
    return f"FAIL below {fail:.2f}, WARN below {warn:.2f} of the reference"


def _screen_names(names, limit=4):
    names = list(names)
    more = f" and {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(map(str, names[:limit])) + more


SCREEN_GPU_METRICS = (("tflops", "TFLOPS", "min_tflops"), ("hbm_gbps", "GB/s memory", "min_hbm"))
SCREEN_GPU_LABELS = {"tflops": "matmul TFLOPS", "hbm_gbps": "memory GB/s"}
SCREEN_FLOOR_OPTIONS = {"min_tflops": "--min-tflops", "min_hbm": "--min-hbm", "min_busbw_intra": "--min-busbw-intra",
                        "min_busbw_inter": "--min-busbw-inter"}


def _table_rule():
    return f"FAIL below {SCREEN_TABLE_FAIL:.2f}, WARN below {SCREEN_TABLE_WARN:.2f} of the row"


def screen_against(what, count, noun, kind, peers, unit, table=None, floor=None, floor_name=None, band=None,
                   no_table=""):
    """What one measurement was judged against, as plain data and one line of text. what: e.g. 'matmul
    TFLOPS of NVIDIA H200'; count: how many values of it, each a noun ('GPU', 'node') of its kind ('model', 'class');
    peers: their screen_reference, a reference only from 2 values on (one value is its own maximum);
    table: {'row', 'ref'} or None (no_table: why there is none); floor: the --min-* value (floor_name its
    key) or None; band: the manifest band's name, '' for none, None when not known here (left out).
    -> {'measurement', 'count', 'peers': {'ref', 'how', 'count'}|None, 'table', 'floor', 'band', 'judged',
    'missing': [what it was not judged against], 'text'}."""
    p = {k: peers[k] for k in ("ref", "how", "count")} if peers.get("count", 0) >= 2 and peers.get("ref") else None
    s = "s" if count != 1 else ""
    got, miss = [], []  # miss: (as an item of 'not against', as an item of 'no reference')
    if p:
        got.append(f"{p['count']} peers (reference {_sn(p['ref'])} {unit}, {p['how']})")
    else:
        alone = f"{count} {noun}{s} of its {kind}" if count == 1 else f"{count} {noun}{s} of its {kind}, none measured"
        miss.append((f"peers ({alone})", alone))
    if table:
        got.append(f"the table row {table['row']} ({_sn(table['ref'])} {unit})")
    else:
        miss.append((f"a table row{' (' + no_table + ')' if no_table else ''}",
                     f"no table row{' (' + no_table + ')' if no_table else ''}"))
    if floor is not None:
        got.append(f"the floor {floor:g} {unit} ({SCREEN_FLOOR_OPTIONS.get(floor_name, 'floor')})")
    else:
        miss.append(("a floor", "no floor"))
    if band is not None:
        if band:
            got.append(f"the manifest band {band}")
        else:
            miss.append(("a manifest band", "no manifest band"))
    head = f"{what} ({count} {noun}{s})"
    text = (f"{head}: no reference: {', '.join(n for _, n in miss)}" if not got else
            f"{head}: against {', '.join(got)}" + (f"; not against {', '.join(m for m, _ in miss)}" if miss else ""))
    return {"measurement": what, "count": count, "peers": p, "table": table, "floor": floor,
            "band": band or None, "judged": bool(got), "missing": [m for m, _ in miss], "text": text}


def gpu_refs(per_rank, floors, cpu=False, bands=None):
    """Per model and metric what the GPUs were judged against: {(model, metric): {'peers': screen_reference,
    'table': {'row', 'ref'}|None (never on CPU), 'floor': float|None, 'against': screen_against(...)}}.
    bands: the names of the manifest's judging bands (screen_band_names), or None when not known here."""
    by_model, out = {}, {}
    for r in per_rank:
        by_model.setdefault(r.get("model") or "unknown", []).append(r)
    for model, rs in sorted(by_model.items()):
        row = None if cpu else gpu_table_row(model)
        for metric, unit, floor_name in SCREEN_GPU_METRICS:
            peers = screen_reference(r.get(metric) for r in rs)
            table = {"row": row["row"], "ref": row[metric]} if row else None
            floor = floors.get(floor_name)
            band = None if bands is None else (f"gpu.{metric}/{model}" if f"gpu.{metric}/{model}" in bands else "")
            noun = "rank" if cpu else "GPU"
            out[(model, metric)] = {
                "peers": peers, "table": table, "floor": floor,
                "against": screen_against(f"{SCREEN_GPU_LABELS[metric]} of {model}", len(rs), noun, "model", peers,
                                          unit.split()[0], table, floor, floor_name, band,
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


def judge_gpu_perf(per_rank, min_tflops=None, min_hbm=None, cpu=False):
    """Per-GPU compute and memory speed against its model's table row (GPU_TABLE), the other GPUs of the
    same model and the floors.
    per_rank: [{'rank': int, 'host': str, 'local_rank': int, 'uuid': str|None, 'model': str|None,
                'tflops': float|None (dense matmul, bf16 on GPU, fp32 on CPU, in 1e12 FLOP/s),
                'hbm_gbps': float|None (device-memory copy, 1e9 B/s)}]; None: not measured (skipped).
    min_tflops, min_hbm: absolute floors (FAIL below), or None.
    Table (GPU only, whatever the number of GPUs): below SCREEN_TABLE_FAIL of the row FAIL, below
    SCREEN_TABLE_WARN WARN. Peers (from 2 GPUs of a model on; references per model and metric,
    screen_reference): below SCREEN_GPU_FAIL FAIL, below SCREEN_GPU_WARN WARN. cpu=True: no table; ranks
    sharing cores give numbers that are not comparable, so only values below SCREEN_CPU_FAIL of the
    peers' reference FAIL and nothing WARNs. The worst level counts; the text names what decided it.
    -> findings under 'gpu-perf': one per flagged rank naming rank, host, local rank and GPU UUID (one
    finding per status listing them when more than SCREEN_LIST_MAX ranks are flagged), or one PASS
    saying what each model was judged against (or that nothing was) and the count of GPUs."""
    per_rank = list(per_rank or [])
    if not per_rank:
        return []
    floors = {"min_tflops": min_tflops, "min_hbm": min_hbm}
    _, flags = _gpu_flags(per_rank, floors, cpu)
    allrefs = gpu_refs(per_rank, floors, cpu)
    if not flags:
        return [_gpu_perf_pass(len(per_rank), [x["against"] for x in allrefs.values()], cpu)]
    items = list(flags.items())

    def unused(r):
        lack = {}
        for k, _, _ in SCREEN_GPU_METRICS:
            for m in allrefs[(r.get("model") or "unknown", k)]["against"]["missing"]:
                lack.setdefault(m, []).append(SCREEN_GPU_LABELS[k])
        return "not judged against " + ", ".join(
            m if len(ks) == len(SCREEN_GPU_METRICS) else f"{m} for {' and '.join(ks)}" for m, ks in lack.items()) \
            if lack else ""
    def evidence(r):
        how = ("its own CPU clock, best of 5 blocks" if cpu else
               "5 device-timed blocks run back to back, median")
        return f"measured once on {r.get('host')} ({how})" + (f"; {unused(r)}" if unused(r) else "")
    action = ("re-run the preflight; if the GPU is slow again, drain the node and run the vendor's diagnostics "
              "(dcgmi diag -r 3): clocks, power or thermal limits (see the GPU facts), a degraded PCIe link")
    if len(items) <= SCREEN_LIST_MAX:
        return [dict(finding("gpu-perf", _screen_worst([lv for _, lv, _ in fl]),
                             f"{_gpu_who(r)}: " + "; ".join(t for _, _, t in fl)
                             + (f"; {unused(r)}" if unused(r) else ""), [r.get("host")], [rk]),
                     evidence=evidence(r), action=action)
                for rk, (r, fl) in items]
    out = []
    for status in ("FAIL", "WARN"):
        sel = [(rk, r, fl) for rk, (r, fl) in items if _screen_worst([lv for _, lv, _ in fl]) == status]
        if sel:
            shown = "; ".join(f"{_gpu_who(r)}: {fl[0][2]}" for _, r, fl in sel[:SCREEN_LIST_MAX])
            more = f"; and {len(sel) - SCREEN_LIST_MAX} more" if len(sel) > SCREEN_LIST_MAX else ""
            hosts = [r.get("host") for _, r, _ in sel]
            out.append(dict(finding("gpu-perf", status, f"{len(sel)} GPU(s) slow on {len(set(hosts))} node(s): "
                                    f"{shown}{more}", hosts, [rk for rk, _, _ in sel]),
                            evidence=f"each measured once ({len(sel)} GPU(s))", action=action))
    return out


def _intra_class(p):
    """Like for like: (ranks per node, GPU model) of an intra-node row."""
    return (len(p.get("ranks") or ()) or None, p.get("model"))


def _intra_class_text(key):
    rpn, model = key
    return ", ".join(x for x in (f"{rpn} ranks" if rpn else "", model or "") if x) or "all nodes"


def intra_levels(per_node, min_busbw=None, cpu=False):
    """-> ({class: screen_reference}, {host: (level, class)}) for judge_intra's rows; the reference is
    taken per (ranks per node, GPU model) class (_intra_class)."""
    fail, warn = screen_fractions("net", cpu)
    by_cls = {}
    for p in per_node:
        by_cls.setdefault(_intra_class(p), []).append(p)
    refs = {k: screen_reference(p.get("busbw") for p in ps) for k, ps in by_cls.items()}
    peers = {k: r if r["count"] >= 2 else {} for k, r in refs.items()}  # one node is its own maximum: no peers
    return refs, {p["host"]: (screen_level(p.get("busbw"), peers[_intra_class(p)], fail, warn, min_busbw),
                              _intra_class(p)) for p in per_node}


def intra_against(per_node, min_busbw=None, bands=None):
    """What each class of intra-node rows was judged against (screen_against): its peers from 2 nodes on, the
    floor, the manifest band; never a table (no per-model numbers for NVLink/NVSwitch/PCIe busbw)."""
    by_cls = {}
    for p in per_node:
        by_cls.setdefault(_intra_class(p), []).append(p)
    out = {}
    for k, ps in sorted(by_cls.items(), key=str):
        band = None if bands is None else next((b for b in [f"intra.busbw/{k[0] or 0} ranks"] if b in bands), "")
        out[k] = screen_against(f"intra-node busbw of {_intra_class_text(k)}", len(ps), "node", "class",
                                screen_reference(p.get("busbw") for p in ps), "GB/s", None, min_busbw,
                                "min_busbw_intra", band, "none exists for intra-node busbw")
    return out


def _intra_evidence(p, ref):
    """(evidence, action, GPU ranks to name) of a node slow inside: how often it was measured, beside which
    known-good nodes, and where its localisation (screen_loop: the node's GPU pairs beside the same pairs of
    the controls) put the fault."""
    r, unit = (ref["ref"], " of the reference") if ref.get("ref") else (None, " GB/s")
    num = (lambda v: f"{float(v or 0.0) / r:.2f}") if r else (lambda v: _sn(float(v or 0.0)))  # noqa: E731
    vals = p.get("values") or [p.get("busbw")]
    ev = f"measured {len(vals)} time(s), slow every time ({', '.join(num(v) for v in vals)}{unit})"
    for b in (p.get("beside") or [])[-1:]:
        ev += f"; try {b['try']} beside the known-good " + ", ".join(f"{c} ({num(v)})"
                                                                     for c, v in b["controls"].items())
    loc, h = p.get("local"), p["host"]
    if not loc:
        return ev, f"drain {h}; run the vendor's diagnostics (dcgmi diag -r 3, nvidia-smi nvlink -s)", []
    lr = {g: rk for pr in loc["pairs"] for g, rk in zip(pr["gpus"], pr["ranks"], strict=True)}
    slow = [pr for pr in loc["pairs"] if pr["level"] != "OK"]
    ctrl = f" beside the same pairs on {', '.join(loc['controls'])}" if loc["controls"] else ""
    ev += f"; its {len(loc['pairs'])} GPU pair(s) measured{ctrl}"
    if loc["wide"]:
        return (ev + ": every pair slow", f"drain {h}; the node's NVSwitch or baseboard: run the vendor's "
                "diagnostics (dcgmi diag -r 3, nvidia-smi nvlink -s)", [])
    if not slow:
        return (ev + ": every pair at speed: slow only in the all_reduce of the whole node (NVSwitch under full "
                "load, PCIe, the host side)", f"drain {h}; run the vendor's diagnostics (dcgmi diag -r 3)", [])
    parts = [f"GPU {g} (rank {lr.get(g)}) slow with every partner, "
             + ", ".join(f"{pr['gpus'][0]}-{pr['gpus'][1]} {pr['busbw'] / (pr['ref'] or 1.0):.2f}"
                         for pr in slow if g in pr["gpus"]) for g in loc["gpus"]]
    parts += [f"GPU pair {a}-{b} slow ({pr['busbw'] / (pr['ref'] or 1.0):.2f}), both at speed with other partners"
              for a, b in loc["links"] for pr in slow if pr["gpus"] == [a, b]]
    what = " and ".join(f"GPU {g}" for g in loc["gpus"]) or " and ".join(f"the NVLink between GPUs {a} and {b}"
                                                                           for a, b in loc["links"])
    return (ev + ": " + "; ".join(parts), f"drain {h}; {what}: run the vendor's diagnostics on it (dcgmi diag -r 3, "
            "nvidia-smi nvlink -s), reseat or replace it",
            sorted({lr[g] for g in loc["gpus"] or [x for e in loc["links"] for x in e] if g in lr}))


def judge_intra(per_node, min_busbw=None, cpu=False):
    """Intra-node all_reduce bus bandwidth (one group of all local ranks per node) against the other nodes
    of its class. per_node: [{'host': str, 'busbw': float|None (1e9 B/s, the best of its tries; None: the
    group failed, judged as 0.0), 'ranks': [rank, ...] (optional), 'model': GPU model (optional), and from
    screen_loop where it was measured again: 'tries', 'first', 'values', 'beside' (the tries measured beside
    known-good nodes), 'local' (its GPU pairs: screen_loop's localisation)}]; min_busbw: absolute floor
    (FAIL below) or None.
    Reference per (ranks per node, GPU model) (screen_reference); below SCREEN_NET_FAIL of it FAIL, below
    SCREEN_NET_WARN WARN; cpu=True: only below SCREEN_CPU_FAIL FAILs, nothing WARNs (CPU-bound numbers).
    A node slow at first and at speed again is no finding here (judge_transients).
    -> findings under 'intra-node': one per flagged node (one per status listing them beyond
    SCREEN_LIST_MAX nodes) with its 'evidence' and 'action' (naming the GPU or GPU pair where localised,
    its ranks the GPU's), or one PASS giving the references and the count of nodes."""
    per_node = list(per_node or [])
    if not per_node:
        return []
    refs, levels = intra_levels(per_node, min_busbw, cpu)
    rule = _screen_rule("net", cpu)
    flagged = []
    for p in sorted(per_node, key=lambda p: _screen_key(p["host"])):
        level, cls = levels[p["host"]]
        if level != "OK":
            v, ref = float(p.get("busbw") or 0.0), refs[cls]
            why = (f"below the floor {min_busbw:g} GB/s (--min-busbw-intra, the floor decided)"
                   if min_busbw is not None and v < min_busbw
                   else f"{v / ref['ref']:.2f} of the reference {_screen_ref_text(ref, 'GB/s')}"
                   + (f" of {_intra_class_text(cls)}" if len(refs) > 1 else "") + f" ({rule})")
            floor = min_busbw is not None and v < min_busbw
            ev = _intra_evidence(p, ref if ref["count"] >= 2 and not floor else {"ref": None})
            flagged.append((level, p["host"], f"{p['host']}: intra-node all_reduce busbw {_sn(v)} GB/s: {why}", ev))
    if not flagged:
        against = intra_against(per_node, min_busbw).values()
        if not all(a["peers"] for a in against):
            judged = "" if all(a["judged"] for a in against) else ", not judged"
            return [finding("intra-node", "PASS", f"intra-node busbw on {len(per_node)} node(s){judged}: "
                            + "; ".join(a["text"] for a in against))]
        txt = "; ".join((f"{_intra_class_text(k)}: " if len(refs) > 1 else "") + _screen_ref_text(r, "GB/s")
                        for k, r in sorted(refs.items(), key=str))
        return [finding("intra-node", "PASS", f"intra-node busbw on {len(per_node)} node(s): reference "
                        f"{txt} ({rule})")]
    if len(flagged) <= SCREEN_LIST_MAX:
        return [dict(finding("intra-node", lv, f"{txt}: NVLink/NVSwitch/PCIe inside the node; {ev}", [h], ranks),
                     evidence=ev, action=act) for lv, h, txt, (ev, act, ranks) in flagged]
    out = []
    for status in ("FAIL", "WARN"):
        sel = [f for f in flagged if f[0] == status]
        if sel:
            more = f"; and {len(sel) - SCREEN_LIST_MAX} more" if len(sel) > SCREEN_LIST_MAX else ""
            out.append(dict(finding("intra-node", status, f"{len(sel)} node(s) slow inside: "
                                    + "; ".join(t for _, _, t, _ in sel[:SCREEN_LIST_MAX]) + more,
                                    [h for _, h, _, _ in sel]),
                            evidence="; ".join(f"{h}: {e[0]}" for _, h, _, e in sel[:SCREEN_LIST_MAX]),
                            action="drain them; run the vendor's diagnostics on each"))
    return out


def _pair_evidence(results, levels):
    """{(node, rail): {'slow': {partners (frozenset): [index]}, 'ok': [index]}} over every measurement."""
    ev = {}
    for i, (m, level) in enumerate(zip(results, levels, strict=True)):
        group = frozenset(m["nodes"])
        for n in group:
            e = ev.setdefault((n, m["rail"]), {"slow": {}, "ok": []})
            if level == "OK":
                e["ok"].append(i)
            else:
                e["slow"].setdefault(group - {n}, []).append(i)
    return ev


def _pair_culprits(ev):
    """Node-rails slow with two different partners (or partner groups) and fine with none: the node.
    A node slow only because two of its partners were bad is fine with its suspect-round partner (a
    node that passed), and so is cleared here."""
    return {k for k, e in ev.items() if len(e["slow"]) >= 2 and not e["ok"]}


def _pair_links(results, levels, culprits):
    """Indices of slow measurements that no culprit node explains: the link or path between the members."""
    return [i for i, (m, level) in enumerate(zip(results, levels, strict=True))
            if level != "OK" and not any((n, m["rail"]) in culprits for n in m["nodes"])]


def screen_diagnose(results, min_busbw=None, cpu=False):
    """Localisation over inter-node measurements (the shapes of judge_pairs). -> {
      'ref': screen_reference of all busbw (for the report), 'refs': {rail: reference} (the judge's),
      'levels': ['FAIL'|'WARN'|'OK' per result], 'rails': sorted rails, 'nodes': sorted nodes,
      'culprits': {(node, rail)}, 'links': [index of a slow measurement no culprit explains],
      'suspect_links': [index of such a measurement whose every member is fine with another partner on
      that rail], 'suspects': [node], 'passing': [node not a suspect, those in no slow measurement first],
      'clean': [node in no slow measurement], 'widespread': bool, 'final': bool (round 3 measured),
      'two_nodes': bool}.
    suspects: culprit nodes and every member of an unexplained slow group (after round 3 only those of
    links that are not suspect links). Widespread: before round 3, more suspects than passing nodes
    (N >= 3), or no node passed at all."""
    refs, levels = screen_pair_levels(results, min_busbw, cpu)
    nodes = _screen_sorted(n for m in results for n in m["nodes"])
    ev = _pair_evidence(results, levels)
    culprits = _pair_culprits(ev)
    links = _pair_links(results, levels, culprits)
    two = len(nodes) == 2
    final = any(m.get("round") == 3 for m in results)
    lone = [] if two else [i for i in links if all(ev[(n, results[i]["rail"])]["ok"] for n in results[i]["nodes"])]
    named = [i for i in links if i not in lone] if final else links
    sus = {n for n, _ in culprits} | {n for i in named for n in results[i]["nodes"]}
    dirty = {n for m, lv in zip(results, levels, strict=True) if lv != "OK" for n in m["nodes"]}
    clean = [n for n in nodes if n not in dirty]
    passing = clean + [n for n in nodes if n in dirty and n not in sus]
    wide = bool(sus) and not two and (not passing or (not final and len(sus) > len(passing)))
    return {"ref": screen_reference(m.get("busbw") for m in results), "refs": refs, "levels": levels,
            "rails": sorted(refs), "nodes": nodes, "culprits": culprits, "links": links, "suspect_links": lone,
            "suspects": _screen_sorted(sus), "passing": passing, "clean": clean, "widespread": wide,
            "final": final, "two_nodes": two, "min_busbw": min_busbw}


def _pair_floor_text(results, idx, d):
    """'; ... below the floor' when measurements idx fell below --min-busbw-inter: the floor FAILs them
    whatever their ratio to the rail's reference."""
    f = d.get("min_busbw")
    below = [i for i in idx if f is not None and float(results[i].get("busbw") or 0.0) < f]
    return (f"; {len(below)} measurement(s) below the floor {f:g} GB/s (--min-busbw-inter: the floor FAILs them)"
            if below else "")


def screen_suspect_links(results, min_busbw=None, cpu=False):
    """The JSON's suspect_links: slow pair measurements whose two ends are both fine with their other
    partners on that rail (after re-measurement): [{'hosts': [a, b], 'rail', 'busbw', 'ratio'}]. These
    name no host in failed_hosts or exclude: the path between them (ECMP, a switch, another tenant) is
    the suspect, not either node."""
    results = list(results or [])
    if not results:
        return []
    d = screen_diagnose(results, min_busbw, cpu)
    out = []
    for i in d["suspect_links"]:
        m = results[i]
        bw, ref = float(m.get("busbw") or 0.0), d["refs"][m["rail"]]["ref"] or 1.0
        out.append({"hosts": _screen_sorted(m["nodes"]), "rail": m["rail"], "busbw": float(f"{bw:.4g}"),
                    "ratio": round(bw / ref, 3)})
    return out


def screen_third_round(results, min_busbw=None, cpu=False):
    """After the schedule's rounds (rounds 1 and 2; all three for N = 3): what to measure next.
    results: as judge_pairs. -> {'groups': [(suspect, passing_node)] to measure as round 3 (every rail),
    [] when nothing is needed (no suspect, two nodes, or round 3 already measured), or None when the
    fault is widespread (run nothing more: judge_pairs FAILs naming every suspect);
    'suspects': [node], 'passing': [node]}."""
    d = screen_diagnose(results, min_busbw, cpu)
    out = {"suspects": d["suspects"], "passing": d["passing"], "groups": []}
    if d["final"] or d["two_nodes"] or not d["suspects"]:
        return out
    met = {tuple(m["nodes"]) for m in results}
    out["groups"] = None if d["widespread"] else suspect_round(d["suspects"], d["passing"], met)
    return out


def _screen_hca(m, node):
    h = m.get("hca")
    return h.get(node) if isinstance(h, dict) else h


def _screen_hca_text(results, idx, nodes):
    """' (HCA mlx5_2)' for the nodes' HCA in measurements idx of one rail, ' (HCA node1 mlx5_2, node3
    mlx5_3)' where they differ; '' where none is known."""
    hcas = {n: next((h for i in idx for h in [_screen_hca(results[i], n)] if h), None) for n in nodes}
    known = {n: h for n, h in hcas.items() if h}
    if not known:
        return ""
    if len(set(known.values())) == 1 and len(known) == len(nodes):
        return f" (HCA {next(iter(known.values()))})"
    return " (HCA " + ", ".join(f"{n} {h}" for n, h in known.items()) + ")"


def _screen_rails_text(rails, all_rails):
    rails = sorted(rails)
    if len(rails) > 1 and rails == all_rails:
        return f"every rail ({format_ranges(rails)})"
    return ("rail " if len(rails) == 1 else "rails ") + format_ranges(rails)


def _pair_node_findings(results, d):
    """One finding per culprit node: its rails (every rail: the node as a whole), HCAs, partners, speed."""
    ev = _pair_evidence(results, d["levels"])
    out, by_node = [], {}
    for n, rail in d["culprits"]:
        by_node.setdefault(n, []).append(rail)
    for n in _screen_sorted(by_node):
        rails = sorted(by_node[n])
        own = sorted({m["rail"] for m in results if n in m["nodes"]})
        parts, statuses, ratios = [], [], []
        for rail in rails:
            idx = sorted(i for ids in ev[(n, rail)]["slow"].values() for i in ids)
            # consistent evidence: the node is at least as bad as its least bad slow measurement
            statuses.append("WARN" if "WARN" in [d["levels"][i] for i in idx] else "FAIL")
            hca = next((h for i in idx for h in [_screen_hca(results[i], n)] if h), None)
            bw, ref = _screen_median([float(results[i].get("busbw") or 0.0) for i in idx]), d["refs"][rail]["ref"]
            parts.append(f"local rank {rail}" + (f" (HCA {hca})" if hca and len(rails) > 1 else "")
                         + f" {_sn(bw)} GB/s = {bw / ref:.2f} of the rail's reference {_sn(ref)} GB/s")
            ratios.append(bw / ref)
        partners = _screen_sorted(p for rail in rails for ps in ev[(n, rail)]["slow"] for p in ps)
        whole = len(rails) > 1 and rails == own
        named = ""  # one rail: its HCA on this node beside it (node3 rail 2 (HCA mlx5_2))
        if len(rails) == 1:
            named = _screen_hca_text(results, sorted(i for ids in ev[(n, rails[0])]["slow"].values() for i in ids),
                                     [n])
        if whole:
            speed = f"busbw median {_screen_median(ratios):.2f} of the rails' references"
            where = ("a node-wide network fault (its NICs or their switch ports together, or the host side: "
                     "PCIe, firmware)")
        else:
            speed = "; ".join(parts)
            where = "its NIC, cable or switch port on " + ("that rail" if len(rails) == 1 else "those rails")
        every = sorted(i for rail in rails for ids in ev[(n, rail)]["slow"].values() for i in ids)
        tries = max(results[i].get("tries", 1) for i in every)
        act = (f"drain {n}; its NICs together or the host side: check their PCIe links and firmware, run the "
               "vendor's diagnostics" if whole else
               f"drain {n}; reseat or replace the HCA or cable of {_screen_rails_text(rails, [])}{named}, then "
               "check its switch port")
        out.append(dict(finding("inter-node", _screen_worst(statuses),
                                f"node {n} is slow on {_screen_rails_text(rails, own if whole else [])}{named} with "
                                f"{len(partners)} different partner(s) ({_screen_names(partners)}) and fine with none, "
                                f"after re-measurement: {speed}: {where}{_pair_floor_text(results, every, d)}", [n]),
                        evidence=f"{len(every)} slow measurement(s) with {len(partners)} different partner(s) "
                                 f"({_screen_names(partners)}), each measured up to {tries} time(s), the best "
                                 f"counting; at speed with no partner", action=act))
    return out


def _pair_link_findings(results, d):
    """One finding per group whose slow measurements no culprit explains: the link or path between them.
    Both ends fine with other partners (after round 3): a suspect link, WARN at most, naming no host."""
    ev, groups = _pair_evidence(results, d["levels"]), {}
    for i in d["links"]:
        groups.setdefault(tuple(_screen_sorted(results[i]["nodes"])), []).append(i)
    out = []
    for g in sorted(groups, key=lambda g: [_screen_key(x) for x in g]):
        idx = groups[g]
        rails = sorted({results[i]["rail"] for i in idx})
        ratio = _screen_median([float(results[i].get("busbw") or 0.0) / d["refs"][results[i]["rail"]]["ref"]
                                for i in idx])
        fine = [n for n in g if all(ev[(n, results[i]["rail"])]["ok"] for i in idx)]
        lone = d["final"] and all(i in d["suspect_links"] for i in idx)
        if d["two_nodes"]:
            what = (f"nodes {g[0]} and {g[1]} are slow together (two nodes only: the pair is named, it cannot "
                    f"be split)")
        elif len(g) == 3:
            what = f"the paths among {', '.join(g)} are slow (a group of three: the pair cannot be told apart)"
        else:
            what = f"the link or path between {g[0]} and {g[1]} is slow"
        alone = ("both are fine with other partners" if len(fine) == len(g) else
                 f"{_screen_names([n for n in g if n not in fine])} measured with no other partner there")
        alone = "" if d["two_nodes"] else f"; {alone}"
        status = _screen_worst([d["levels"][i] for i in idx])
        if lone:
            alone += " (a suspect link: the path between them, no host is excluded for it)"
            status = "WARN" if status != "OK" else status
        named = _screen_hca_text(results, idx, g) if len(rails) == 1 else ""
        on = f"{_screen_rails_text(rails, d['rails'])}{named}"
        act = ("none drained; re-run, and if it recurs check the cables and the switch path between "
               f"{' and '.join(g)} on {on}" if lone else
               f"measure each of {' and '.join(g)} with a third node (two nodes cannot be told apart); reseat or "
               "replace the HCAs or cables of that rail" if d["two_nodes"] else
               f"drain {' and '.join(g)} or re-run; check the cables, HCAs and switch ports between them on {on}")
        tries = max(results[i].get("tries", 1) for i in idx)
        out.append(dict(finding("inter-node", status, f"{what} on {on}: busbw "
                                f"{ratio:.2f} of the rail's reference after re-measurement{alone}"
                                f"{_pair_floor_text(results, idx, d)}",
                                [] if lone else list(g)),
                        evidence=f"{len(idx)} slow measurement(s), each measured up to {tries} time(s), the best "
                                 f"counting{alone}", action=act))
    return out


def judge_pairs(results, min_busbw=None, cpu=False):
    """Inter-node bus bandwidth, localised to a node, a node's rail or a link.
    results: [{'round': 1|2|3, 'nodes': (a, b) or (a, b, c), 'rail': int (the local rank: each local
               rank measured with the same local rank on the partner nodes, one group per rail),
               'busbw': float (1e9 B/s, the best of the measurement and its re-measurements; None: the
               group failed, judged as 0.0),
               'hca': str (the HCA this rail uses, same name on every node) | {node: str} | None}],
    every round's measurements together (rounds 1-2 to plan the suspect round, all rounds to judge).
    min_busbw: absolute floor (FAIL below) or None; cpu=True: only below SCREEN_CPU_FAIL FAILs and
    nothing WARNs (gloo over loopback is CPU-bound: never a culprit out of noise).
    Reference: per rail (screen_rail_refs). Each is FAIL/WARN/OK (screen_level with
    SCREEN_NET_FAIL/SCREEN_NET_WARN). Localisation, per rail:
      a node slow with two different partners (or groups) and fine with none: that node on that rail
        (the HCA named when known); on every rail: the node as a whole;
      a slow group none of whose members is such a node: the link or path between them; when every
        member is fine with another partner there, a suspect link (WARN at most, no host named, the
        JSON's suspect_links); else both named;
        a node slow only beside bad partners is fine with its suspect-round partner and is cleared;
      two nodes only: the pair is named (slow after re-measurement: nothing can localise it);
      more suspects than passing nodes before round 3 (or no node passing): widespread, one FAIL
        naming every suspect.
    -> (findings under 'inter-node', suspects: sorted node names implicated: before round 3 the nodes
        to give suspect_round, after it the nodes the findings name). One PASS finding with the
        reference and the count of measurements when nothing is slow."""
    results = list(results or [])
    if not results:
        return [], []
    d = screen_diagnose(results, min_busbw, cpu)
    ref, sus = d["ref"], d["suspects"]
    if not sus and not d["links"]:
        spread = f", spread {100 * ref['spread'] / ref['ref']:.1f}%" if ref["spread"] and ref["ref"] else ""
        return [finding("inter-node", "PASS", f"inter-node busbw: reference "
                        f"{_screen_ref_text(ref, 'GB/s', 'measurements')} over {len(d['rails'])} rail(s) and "
                        f"{len(d['nodes'])} node(s){spread}; "
                        + (f"none slow ({_screen_rule('net', cpu)})" if ref["count"] >= 2 else
                           "not judged against peers (one measurement is its own reference)"))], []
    if d["widespread"]:
        slow = sum(lv != "OK" for lv in d["levels"])
        return [dict(finding("inter-node", "FAIL", f"widespread: {len(sus)} node(s) implicated, more than the "
                             f"{len(d['passing'])} that passed, so no single node or link is to blame (a switch, "
                             f"the fabric or its configuration): {slow}/{len(results)} measurement(s) slow against "
                             f"the rails' references or the floor after re-measurement; suspects: "
                             f"{compress_hostlist(sus)}"
                             f"{_pair_floor_text(results, [i for i, lv in enumerate(d['levels']) if lv != 'OK'], d)}",
                             sus), widespread=True, evidence=f"{slow} slow measurement(s) after re-measurement",
                     action="nothing is drained: check the switches, the fabric and its configuration")], sus
    return _pair_node_findings(results, d) + _pair_link_findings(results, d), sus


def screen_band_names(manifest, records, screen):
    """The manifest's speed bands that judge this run's measurements (as judge_bands: BAND_MIN_RUNS runs or
    more, in the class of one of the run's nodes) -> sorted band names, [] without a manifest."""
    classes, out = (manifest or {}).get("classes") or {}, set()
    for cls, band, *_ in _band_points(screen, _host_classes(records or [])):
        b = ((classes.get(cls) or {}).get("bands") or {}).get(band)
        if b and b.get("runs", 1) >= BAND_MIN_RUNS:
            out.add(band)
    return sorted(out)


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


def screen_judged_against(screen, bands=None):
    """Per measurement, what it was judged against (screen_against): each GPU model's matmul TFLOPS and
    memory GB/s (peers, the table row, the floor), each class of intra-node busbw (peers, the floor; no
    table exists), the inter-node busbw (the measurements of the rails, the floor; no table exists), and
    with bands (screen_band_names' list; None: no manifest given) the manifest band. -> [entry], in the
    JSON as screen['judged_against'] and in the PERFORMANCE section."""
    cpu, band_set = bool(screen.get("cpu")), None if bands is None else set(bands)
    floors = {k: screen.get(k) for k in SCREEN_FLOOR_OPTIONS}
    out = [x["against"] for x in gpu_refs(screen.get("gpu") or [], floors, cpu, band_set).values()]
    out += list(intra_against(screen.get("intra") or [], screen.get("min_busbw_intra"), band_set).values())
    pairs = screen.get("pairs") or []
    if pairs:
        band = None if band_set is None else next((b for b in sorted(band_set) if b.startswith("inter.busbw/")), "")
        rails = len({m["rail"] for m in pairs})
        out.append(screen_against(f"inter-node busbw over {rails} rail(s)", len(pairs), "measurement", "rail",
                                  screen_reference(m.get("busbw") for m in pairs), "GB/s", None,
                                  screen.get("min_busbw_inter"), "min_busbw_inter", band,
                                  "none exists for inter-node busbw"))
    return out
GPU_FACT_KEYS = ("pcie_width", "pcie_width_max", "pcie_speed", "pcie_speed_max", "sm_mhz", "sm_max_mhz",
                 "throttle", "temp_c", "power_w", "ecc_uncorrected", "remap_pending", "remap_failure")


def gpu_fact_problems(row):
    """[(status, text)] for one GPU's facts (a judge_gpu_perf row with GPU_FACT_KEYS, each optional): under
    load, PCIe link below its maximum width or speed, clocks slowed by THROTTLE_FAULTS; from its node's one
    nvidia-smi call (read_node_smi), uncorrected ECC errors since the driver loaded or a pending row remap
    (WARN), a failed row remap (FAIL)."""
    out, g = [], row.get
    if g("pcie_width") and g("pcie_width_max") and g("pcie_width") < g("pcie_width_max"):
        out.append(("WARN", f"PCIe link x{g('pcie_width')} of x{g('pcie_width_max')} under load"))
    if g("pcie_speed") and g("pcie_speed_max") and g("pcie_speed") < g("pcie_speed_max"):
        out.append(("WARN", f"PCIe link {g('pcie_speed'):g} of {g('pcie_speed_max'):g} GT/s under load"))
    if int(g("throttle") or 0) & THROTTLE_FAULTS:
        clock = f" (SM {g('sm_mhz'):g} of {g('sm_max_mhz'):g} MHz)" if g("sm_mhz") and g("sm_max_mhz") else ""
        out.append(("WARN", f"clocks slowed under load: {', '.join(throttle_names(g('throttle')))}{clock}"))
    if g("ecc_uncorrected"):
        out.append(("WARN", f"{g('ecc_uncorrected'):g} uncorrected ECC error(s) since the driver loaded"))
    if g("remap_failure"):
        out.append(("FAIL", "row remapping failed: memory the GPU can no longer repair (replace it)"))
    elif g("remap_pending"):
        out.append(("WARN", "row remapping pending: reset the GPU to apply it"))
    return out


def judge_gpu_facts(per_rank):
    """Findings under 'gpu-perf' from each GPU's facts (gpu_fact_problems): one per GPU
    with a problem, or beyond SCREEN_LIST_MAX GPUs one per status listing the first ones and a count.
    No PASS finding: judge_gpu_perf gives it."""
    flagged = [(r, p) for r in sorted(per_rank or [], key=lambda r: r["rank"]) for p in [gpu_fact_problems(r)] if p]
    items = [(_screen_worst([s for s, _ in p]), r, "; ".join(t for _, t in p)) for r, p in flagged]
    return per_gpu_findings("gpu-perf", items, _gpu_who, "GPU(s) with a problem under load")


def per_gpu_findings(check, items, who, headline):
    """items [(status, rank record, text)] -> one finding per GPU, or beyond SCREEN_LIST_MAX GPUs one per
    status: '<n> <headline>: ' the first ones (who(record): text) and a count of the rest."""
    if len(items) <= SCREEN_LIST_MAX:
        return [finding(check, st, f"{who(r)}: {txt}", [r.get("host")], [r["rank"]]) for st, r, txt in items]
    out = []
    for status in ("FAIL", "WARN"):
        sel = [(r, txt) for st, r, txt in items if st == status]
        if sel:
            more = f"; and {len(sel) - SCREEN_LIST_MAX} more" if len(sel) > SCREEN_LIST_MAX else ""
            out.append(finding(check, status, f"{len(sel)} {headline}: " + "; ".join(
                f"{who(r)}: {txt}" for r, txt in sel[:SCREEN_LIST_MAX]) + more,
                [r.get("host") for r, _ in sel], [r["rank"] for r, _ in sel]))
    return out


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
