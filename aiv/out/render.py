"""Floor 4: the report: topology, environment, fabric, collectives, performance, soak, findings."""
import json
import re
from collections import Counter

from ..checks.judge import _by_host, _import_state, screen_reference
from ..core.base import (
    SUCCESS_LINE,
    _screen_median,
    _screen_sorted,
    compress_hostlist,
    finding_rows,
    format_ranges,
    group_by,
    human_bytes,
)
from ..core.deadlines import DRAIN_S, PHASES
from ..core.names import PROBED_PACKAGES, SMI_WHAT, throttle_names
from ..screen.gpu import GPU_FACT_KEYS, _gpu_flags, _table_rule, gpu_fact_problems, gpu_table_row
from ..screen.judge import SCREEN_RENDER_ALL, SCREEN_RENDER_SLOW, _intra_class_text, intra_levels, screen_diagnose
from ..screen.plan import SCREEN_CPU_FAIL, SCREEN_GPU_METRICS, _screen_ref_text, _screen_worst, _sn, screen_round_label
from ..screen.soak import SOAK_DECAY_FAIL, SOAK_DECAY_WARN, _soak_n, soak_problems, soak_verdict


def _lone_table_text(model, cpu):
    """What judged a lone GPU of its model: its table row, when it has one."""
    row = None if cpu else gpu_table_row(model)
    return (f"; judged against the table row {row['row']}: {_sn(row['tflops'])} TFLOPS, {row['hbm_gbps']:.0f} GB/s "
            f"({_table_rule()})") if row else ""


def _perf_gpu_lines(screen, cpu):
    per_rank, intra = screen.get("gpu") or [], screen.get("intra") or []
    refs, flags = _gpu_flags(per_rank, screen, cpu)
    irefs, ilevels = intra_levels(intra, screen.get("min_busbw_intra"), cpu)
    ibw = {p["host"]: p.get("busbw") for p in intra}
    L = [f"  gpu reference {m}: " + ", ".join(_screen_ref_text(refs[(m, k)], u, "GPUs")
                                             for k, u, _ in SCREEN_GPU_METRICS if refs[(m, k)]["count"])
         if max(refs[(m, k)]["count"] for k, _, _ in SCREEN_GPU_METRICS) >= 2 else
         f"  gpu reference {m}: none among peers (1 GPU of its model)" + _lone_table_text(m, cpu)
         for m in sorted({m for m, _ in refs})]
    L += [f"  intra-node reference{' ' + _intra_class_text(k) if len(irefs) > 1 else ''}: "
          + (_screen_ref_text(ref, "GB/s", "nodes") if ref["count"] >= 2 else "none among peers (1 node of its class)")
          for k, ref in sorted(irefs.items(), key=str)]
    by_host = group_by(per_rank, lambda r: r.get("host"))
    hosts = _screen_sorted(set(by_host) | set(ibw))
    collapse, healthy = len(hosts) > SCREEN_RENDER_ALL, []
    for h in hosts:
        rs = by_host.get(h, [])
        tf = [float(r["tflops"]) for r in rs if r.get("tflops") is not None]
        hb = [float(r["hbm_gbps"]) for r in rs if r.get("hbm_gbps") is not None]
        marks = [f"{'tflops' if k == 'tflops' else 'memory'} rank {rk} [{lv}]" for rk, (r, fl) in flags.items()
                 if r.get("host") == h for k, lv, _ in fl]
        if (ilv := ilevels.get(h, ("OK",))[0]) != "OK":
            marks.append(f"intra [{ilv}]")
        cells = f"gpus={len(rs)} " + (f"tflops min/med={_sn(min(tf))}/{_sn(_screen_median(tf))} " if tf else "")
        cells += f"mem min/med={min(hb):.0f}/{_screen_median(hb):.0f}GB/s " if hb else ""
        cells += f"intra={_sn(ibw[h])}GB/s" if ibw.get(h) is not None else "intra=-"
        if marks or not collapse:
            L.append(f"  node={h} {cells}" + (f"  <- slow: {', '.join(marks)}" if marks else ""))
        if not marks:
            healthy.append((h, tf, hb))
    if collapse and healthy:
        tf = [x for _, t, _ in healthy for x in t]
        hb = [x for _, _, b in healthy for x in b]
        ib = [float(ibw[h]) for h, _, _ in healthy if ibw.get(h) is not None]
        rng = " ".join(f"{k}={_sn(min(v))}-{_sn(max(v))}" for k, v in (("tflops", tf), ("mem", hb), ("intra", ib)) if v)
        L.append(f"  node={compress_hostlist([h for h, _, _ in healthy])} nodes={len(healthy)} {rng} (healthy)")
    return L


def _perf_pair_lines(screen, cpu):
    results = list(screen.get("pairs") or [])
    if not results:
        return []
    d = screen_diagnose(results, screen.get("min_busbw_inter"), cpu)
    per_rail = {rail: screen_reference(m.get("busbw") for m in results if m["rail"] == rail) for rail in d["rails"]}
    by_group = group_by(range(len(results)), lambda i: (results[i].get("round"), tuple(results[i]["nodes"])))
    rounds = Counter(r for r, _ in by_group)
    L = [f"  inter-node reference: {_screen_ref_text(d['ref'], 'GB/s', 'measurements')}; per rail: "
         + " ".join(f"{rail}:{_sn(per_rail[rail]['ref'])}" for rail in d["rails"]),
         "  groups per round: " + " ".join(f"{r}:{n}" for r, n in sorted(rounds.items(), key=lambda x: str(x[0])))
         + f"; {len(results)} measurement(s), {sum(lv != 'OK' for lv in d['levels'])} slow"]
    show_all = len(d["nodes"]) <= SCREEN_RENDER_ALL
    listed = [k for k, idx in by_group.items() if show_all or any(d["levels"][i] != "OK" for i in idx)]
    rows = []
    for rnd, g in listed:
        idx = sorted(by_group[(rnd, g)], key=lambda i: results[i]["rail"])
        cells = " ".join(f"{_sn(float(results[i].get('busbw') or 0))}" + ("!" if d["levels"][i] != "OK" else "")
                         for i in idx)
        bad = [i for i in idx if d["levels"][i] != "OK"]
        tail = (f"  <- slow rail {format_ranges(results[i]['rail'] for i in bad)} "
                f"[{_screen_worst([d['levels'][i] for i in bad])}]") if bad else ""
        rows.append(f"    round {rnd} {' <-> '.join(g)} GB/s by rail {format_ranges(results[i]['rail'] for i in idx)}: "
                    f"{cells}{tail}")
    if show_all:
        return L + rows
    return L + _at_most(rows, "slow group(s)") + [
        f"    ({len(by_group) - len(listed)} group(s) with every rail within the reference not shown)"]


def render_performance(screen):
    """The PERFORMANCE section as report lines. screen: {
      'gpu': judge_gpu_perf's per_rank, 'intra': judge_intra's per_node, 'pairs': judge_pairs' results
      (each optional), 'cpu': bool, 'min_tflops', 'min_hbm', 'min_busbw_intra', 'min_busbw_inter': floors or None,
      'splits': {round: seconds its group creation took} (optional)}; a per_rank row may carry the facts
      read under load (GPU_FACT_KEYS).
    Per node: TFLOPS min/median over its GPUs, memory GB/s min/median, intra-node busbw; the facts under
    load summed up, each GPU with a problem on a line of its own; per group and round the busbw of each
    rail (a slow rail's value marked '!', the row ending '<- slow ... [FAIL]'); the group creation times.
    Above SCREEN_RENDER_ALL nodes the healthy nodes collapse into one line with their ranges and only
    slow groups are listed (at most SCREEN_RENDER_SLOW, then a count), with the per-rail reference."""
    cpu = bool(screen.get("cpu"))
    L = [BAR, "PERFORMANCE", BAR]
    if cpu:
        L.append(f"  (CPU ranks: numbers are not comparable across ranks; only values below "
                 f"{SCREEN_CPU_FAIL:.2f} of the reference are judged)")
    if screen.get("gpu") or screen.get("intra"):
        L += _perf_gpu_lines(screen, cpu)
    L += _perf_fact_lines(screen) + _perf_pair_lines(screen, cpu)
    if screen.get("splits"):
        L.append("  group creation (each group's last member, the slowest group): "
                 + ", ".join(f"{screen_round_label(n)} {s:.2f}s" for n, s in screen["splits"].items()))
    if screen.get("judged_against"):
        L += ["  judged against (per measurement):"] + [f"    {a['text']}" for a in screen["judged_against"]]
    return L


def _at_most(lines, what):
    """The first SCREEN_RENDER_SLOW lines, then how many more there are (the JSON lists them all)."""
    more = len(lines) - SCREEN_RENDER_SLOW
    return lines[:SCREEN_RENDER_SLOW] + ([f"    ... and {more} more {what} (see --json)"] if more > 0 else [])


def _perf_fact_lines(screen):
    """The facts read under load summed up, each GPU with a problem on a line of its own; the GPUs not read."""
    gpus = screen.get("gpu") or []
    unread = _at_most([f"  not read (nvidia-smi gave no answer within {r['smi_unread']:g}s): {SMI_WHAT} of rank "
                       f"{r['rank']} {r.get('host')} GPU {r.get('local_rank')} {r.get('uuid') or '-'}"
                       for r in gpus if r.get("smi_unread")], "GPU(s) not read")
    rows = [r for r in gpus if any(r.get(k) is not None for k in GPU_FACT_KEYS)]
    if not rows:
        return unread
    links = [r for r in rows if r.get("pcie_width") and r.get("pcie_speed")]
    full = sum(r["pcie_width"] >= (r.get("pcie_width_max") or 0) and r["pcie_speed"] >= (r.get("pcie_speed_max") or 0)
               for r in links)
    sm = [float(r["sm_mhz"]) for r in rows if r.get("sm_mhz") is not None]
    limits = Counter(n for r in rows for n in throttle_names(r.get("throttle")))
    parts = [f"PCIe at its maximum width and speed on {full}/{len(links)}" if links else "PCIe link not readable",
             f"SM clock min/median {min(sm):.0f}/{_screen_median(sm):.0f} MHz" if sm else "clocks not read",
             "clock limits: " + (", ".join(f"{n} on {k}" for n, k in sorted(limits.items())) or "none"),
             f"uncorrected ECC errors on {sum(bool(r.get('ecc_uncorrected')) for r in rows)}"]
    bad = [(r, p) for r in rows for p in [gpu_fact_problems(r)] if p]
    return [f"  under load ({len(rows)} GPU(s)): " + "; ".join(parts)] + _at_most(
        [f"    rank {r['rank']} {r.get('host')} {r.get('uuid') or '-'}: " + "; ".join(t for _, t in p) for r, p in bad],
        "GPU(s)") + unread


def render_soak(soak):
    """The SOAK section as report lines. soak: {'seconds' (asked), 'cpu', 'dtype', 'n' (matmul size),
    'gpus': judge_soak's rows}. One line per GPU (above 64 only the GPUs with a problem, then a count)."""
    rows, cpu = soak.get("gpus") or [], bool(soak.get("cpu"))
    src = sorted({r.get("telemetry") for r in rows if r.get("telemetry")})
    L = [BAR, "SOAK", BAR,
         f"  {soak.get('seconds', 0):g}s of {soak.get('dtype')} matmul ({soak.get('n')}x{soak.get('n')}) on "
         f"{len(rows)} {'CPU rank(s)' if cpu else 'GPU(s)'} at once; telemetry: "
         + (", ".join(src) if src else "none" + (" (no GPU telemetry on CPU)" if cpu else ""))
         + (f"; decay FAIL below {SOAK_DECAY_FAIL:.2f}, WARN below {SOAK_DECAY_WARN:.2f} of the first window"
            if not cpu else "; CPU ranks share cores: decay shown, not judged")]
    show = [r for r in rows if len(rows) <= 64 or soak_problems(r, cpu)]
    for r in show:
        first, last = r.get("tflops_first"), r.get("tflops_last")
        ratio = f" ({last / first:.2f})" if first and last is not None else ""
        dev = f"cuda:{r['device']}" if r.get("device") is not None else "cpu"
        cells = [f"rank={r['rank']} node={r.get('host')} gpu={dev} uuid={_q(r.get('uuid'))}",
                 f"tflops first/last={_sn(first) if first else '-'}/{_sn(last) if last is not None else '-'}{ratio}"]
        if r.get("samples"):
            cells += [f"temp_max={_soak_n(r.get('temp_max_c'))}C",
                      f"sm_mhz min/max={_soak_n(r.get('sm_min_mhz'))}/{_soak_n(r.get('sm_max_seen_mhz'))} "
                      f"(rated {_soak_n(r.get('sm_rated_mhz'))})",
                      f"power_max={_soak_n(r.get('power_max_w'))}W",
                      "limits=" + (",".join(throttle_names(r.get("throttle_seen"))) or "none")]
        elif not cpu:
            cells.append("telemetry=none")
        L.append("  " + " ".join(cells) + f" [{soak_verdict(r, cpu)}]")
    if len(show) < len(rows):
        L.append(f"  ({len(rows) - len(show)} GPU(s) that held up not shown; see --json)")
    return L


BAR = "=" * 78


def _q(s):
    s = "-" if s is None or s == "" else str(s)
    return f'"{s}"' if re.search(r"\s", s) else s


def _node_of(rs):
    return next((r.get("node") for r in rs if r.get("node")), {}) or {}


def node_signature(rs):
    """What makes two nodes 'identical' for the collapsed topology view."""
    n, g = _node_of(rs), rs[0].get("gpu") or {}
    return json.dumps([len(rs), sorted(r["local_rank"] for r in rs) == list(range(len(rs))),
                       g.get("name"), g.get("vram"), rs[0]["versions"], n.get("os"), n.get("kernel"),
                       n.get("driver"), n.get("cpu_model"), n.get("cpus"),
                       [(p["port"], p["state"], p["rate_gbps"]) for p in n.get("ib") or []],
                       n.get("imports"), n.get("memlock"),
                       sorted(set().union(*[r.get("transport") or [] for r in rs]))], sort_keys=True, default=str)


def _phase_times(phases):
    """'import_torch=3.19 local=3.60 rollcall=0.63 ...' in the order of the run (JSON sorts its keys)."""
    order = ("import_torch",) + PHASES + ("imports", "gpu_measure")
    keys = sorted(phases, key=lambda k: (order.index(k) if k in order else len(order), k))
    return " ".join(f"{k}={phases[k]:.2f}" for k in keys)


def render_report(state):
    """The whole report as text. state: the dict also written as JSON. Identical nodes are grouped
    once (every flagged node alone) and each section renders the groups."""
    recs = state.get("ranks") or []
    flagged = {h for f in state.get("findings") or [] if f["status"] != "PASS" for h in f["hosts"]}
    hosts = _by_host(recs)  # groups: [(hosts, ranks of the first)], identical nodes together, a flagged node alone
    groups = [(hs, hosts[hs[0]]) for hs in group_by(
        hosts, lambda h: ("flagged", h) if h in flagged else node_signature(hosts[h])).values()]
    out = [s for section in (_render_topology, _render_environment, _render_fabric, _render_collectives)
           for s in section(state, recs, groups)]
    out += render_performance(state["screen"]) if state.get("screen") else []
    out += render_soak(state["soak"]) if state.get("soak") else []
    return "\n".join(out + _render_findings(state, recs, groups))


def _render_topology(state, recs, groups):
    L = [BAR, "CLUSTER HARDWARE TOPOLOGY REPORT", BAR,
         f"  nodes={len(_by_host(recs))} ranks_reported={len(recs)}/{state['world_size']} backend={state['backend']}"]
    for hs, rs in groups:
        g = rs[0].get("gpu") or {}
        gpus = f"{len(rs)}x{_q(g.get('name'))}" if g else "cpu"
        tail = f"ranks={format_ranges(r['rank'] for r in rs)}" if len(hs) == 1 else "ranks=various"
        locs = sorted(r["local_rank"] for r in rs)
        locs_s = format_ranges(locs) if len(set(locs)) == len(locs) else ",".join(map(str, locs))
        L.append(f"  node={compress_hostlist(hs)} nodes={len(hs)} ranks_per_node={len(rs)} "
                 f"local_ranks={locs_s} {tail} gpus={gpus}")
    show_all = len(recs) <= 64
    flagged_ranks = {r for f in state.get("findings") or [] if f["status"] != "PASS" for r in f["ranks"]}
    for r in sorted(recs, key=lambda r: r["rank"]):
        if show_all or r["rank"] in flagged_ranks:
            g = r.get("gpu") or {}
            dev = f"cuda:{r['device']}" if r.get("device") is not None else "cpu"
            L.append(f"    rank={r['rank']} node={r['host']} local_rank={r['local_rank']} device={dev} "
                     f"gpu={_q(g.get('name'))} vram={human_bytes(g.get('vram')) if g else '-'} "
                     f"uuid={_q(g.get('uuid'))} pci={_q(g.get('pci'))} numa={_q(g.get('numa'))} "
                     f"cpus={_q(r.get('cpus'))}")
    if not show_all:
        L.append(f"    ({len(recs)} ranks: per-rank lines shown only for ranks named in a finding; see --json)")
    for hs, rs in groups:
        n = _node_of(rs)
        if n.get("peer"):
            L.append(f"  peer access {compress_hostlist(hs)} (row i, col j: 1 = cuda:i can access cuda:j):")
            L.extend(f"    cuda:{i}  {' '.join(row)}" for i, row in enumerate(n["peer"]))
    return L


def _render_environment(state, recs, groups):
    L = [BAR, "NODE ENVIRONMENT DEEP DIVE", BAR]
    for hs, rs in groups:
        n, v = _node_of(rs), rs[0]["versions"]
        iv = {name: _import_state((n.get("imports") or {}).get(name)) for name in PROBED_PACKAGES}
        memlock = n.get("memlock") if n.get("memlock") == "unlimited" else human_bytes(n.get("memlock"))
        L.append(f"  node={compress_hostlist(hs)} os={_q(n.get('os'))} kernel={_q(n.get('kernel'))} "
                 f"cpu={_q(n.get('cpu_model'))} cpus={_q(n.get('cpus'))} mem={human_bytes(n.get('mem_total'))} "
                 f"driver={_q(n.get('driver'))}")
        L.append(f"    torch={v['torch']} cuda={_q(v['cuda'])} nccl={_q(v['nccl'])} python={v['python']} "
                 f"torchvision={iv['torchvision']} torchaudio={iv['torchaudio']} memlock={memlock} "
                 f"shm={human_bytes(n.get('shm'))}")
    return L


def _render_fabric(state, recs, groups):
    L = [BAR, "NETWORK INTERCONNECT & FABRIC STATUS", BAR]
    for hs, rs in groups:
        n = _node_of(rs)
        ibs = ",".join(f"{p['port']}:{p['state']}:{p['rate_gbps'] or 0:g}Gb/s" for p in n.get("ib") or []) or "none"
        ifs = ",".join(f"{k}({v[0] if v else '-'})" for k, v in sorted((n.get("ifaces") or {}).items())) or "-"
        tr = "+".join(sorted(set().union(*[r.get("transport") or [] for r in rs]))) or \
            ("TCP(gloo)" if state.get("backend") == "gloo" else "-")
        used = sorted({f"{r['gloo']['iface']}({r['gloo']['addr']})" for r in rs if r.get("gloo")}
                      | set().union(*[r.get("nccl_net") or [] for r in rs]))
        L.append(f"  node={compress_hostlist(hs)} ib={ibs} peermem={'yes' if n.get('peermem') else 'no'} "
                 f"transport={tr} ifaces={ifs if len(hs) == 1 else 'per-node'} "
                 f"used={(','.join(used) or '-') if len(hs) == 1 else 'per-node'}")
    env = state.get("env") or {}
    shown = " ".join(f"{k}={_q(v)}" for k, v in env.items() if k.startswith(("NCCL_", "GLOO_", "TORCH_NCCL_")))
    L.append("  env as set in the job: " + (shown or "(no NCCL_/GLOO_ variables set)"))
    loaded = sorted({r["versions"].get("nccl") for r in recs if r["versions"].get("nccl")})
    if "NCCL_VERSION" in env and loaded:
        L.append(f"    (NCCL_VERSION is a variable of the image; the NCCL torch loaded is {', '.join(loaded)})")
    return L


def _render_collectives(state, recs, groups):
    coll = state.get("collectives")
    if not coll:
        return []
    L = [BAR, "COLLECTIVES", BAR,
         f"  all_reduce exact: sum={coll['ar_sum']} expected={coll['ar_expected']} on {coll['ranks']} rank(s)",
         f"  DDP nn.Linear(10,10): global average loss={coll['loss']:.6f} "
         f"gradients_identical={'yes' if coll['grads_identical'] else 'NO'}"]
    return L + [f"  busbw size={human_bytes(b['bytes'])} time={b['time_us']:.1f}us algbw={b['algbw']:.2f}GB/s "
                f"busbw={b['busbw']:.2f}GB/s" for b in coll.get("bandwidth") or []]


def _render_findings(state, recs, groups):
    L = [BAR, "FINDINGS", BAR] + [f"  [{st}] {check}: {text}" for st, check, text in
                                   finding_rows(state.get("findings") or [])]
    L += [f"  NOTE: {n}" for n in state.get("notes") or []]
    L += [f"  ACTION: {a}" for a in action_lines(state.get("findings") or [])]
    L += [BAR, f"Ranks Reported: {len(recs)}/{state['world_size']}",
          f"Verdict: {state['verdict']} exit={state['exit_code']} elapsed={state['elapsed_s']:.2f}s "
          f"phases={_phase_times(state.get('phases') or {})}"]
    L += state.get("failures") or []
    L += render_drain(state.get("drain"))
    if state["verdict"] == "PASS":
        L.append(SUCCESS_LINE)
    return L


def action_lines(findings):
    """What to do about each WARN or FAIL that says (its action, and the evidence it stands on), once each:
    '<check> <hosts>: <action> (evidence: ...)'."""
    out = []
    for f in findings:
        if f["status"] == "PASS" or not (f.get("action") or f.get("evidence")):
            continue
        who = f" {compress_hostlist(f['hosts'])}" if f.get("hosts") else \
            f" {compress_hostlist(f['involved'])} (not blamed)" if f.get("involved") else ""
        act = f"nothing is drained: to localise it, {f['unlocalised']['localise']}" if f.get("unlocalised") else \
            f.get("action") or "see the finding"
        out.append(f"{f['check']}{who}: {act}" + (f" (evidence: {f['evidence']})" if f.get("evidence") else ""))
    return list(dict.fromkeys(out))


NO_HOST_MARK = "[no host named]"  # ends every FAILURE line that names no host: grep -v it for the localised ones


def failure_lines(findings):
    """One `FAILURE: <check>: <reason>` line per FAIL; a FAIL that names no host (after the gate) ends with
    NO_HOST_MARK, so that a grep tells an unlocalised line from one that names its culprits."""
    return [f"FAILURE: {f['check']}: {f['reason']}" + ("" if f.get("hosts") else f" {NO_HOST_MARK}")
            for f in findings if f["status"] == "FAIL"]


def render_drain(drain):
    """The report's drain lines (none when the mode is off or nothing needed draining)."""
    if not drain or drain["mode"] == "off" or drain.get("skipped") == "the run passed":
        return []
    if drain.get("skipped"):
        return [f"  DRAIN: nothing drained: {drain['skipped']}"]
    L = [f"  DRAIN: {n} keeps its own reason: {r!r}" for n, r in sorted(drain.get("kept", {}).items())]
    if drain["mode"] == "recommend":
        return L + [f"  DRAIN (recommended; --drain on runs it): {drain['command']}"]
    if drain.get("pending"):
        return L + [f"  DRAIN: draining {compress_hostlist(drain['hosts'])} now (scontrol, within {DRAIN_S:g}s; the "
                    f"outcome follows): {drain['command']}"]
    if drain.get("done"):
        return L + [f"  DRAIN: drained {compress_hostlist(drain['hosts'])}: {drain['command']}"]
    return L + (["  DRAIN: not drained (see the drain finding)"] if drain["hosts"] else [])
