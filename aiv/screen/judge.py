"""Floor 3: the screen's judges: per-GPU TFLOPS and GB/s against model peers and the table (and the
reference that judged each number, gpu_levels), intra-node and inter-node busbw, node / rail / link
culprits, GPU facts under load."""

from ..checks.judge import screen_reference
from ..core.base import _screen_key, _screen_median, _screen_sorted, compress_hostlist, finding, format_ranges, group_by
from ..core.blame import unlocalised
from .gpu import gpu_refs, screen_band_lines
from .plan import (
    SCREEN_FLOOR_OPTIONS,
    SCREEN_LIST_MAX,
    _per_status,
    _screen_names,
    _screen_ref_text,
    _screen_rule,
    _screen_worst,
    _sn,
    screen_against,
    screen_fractions,
    screen_level,
    screen_pair_levels,
    suspect_round,
)

SCREEN_RENDER_ALL = 16      # up to this many nodes the PERFORMANCE section shows every node and every group
SCREEN_RENDER_SLOW = 32     # beyond that, at most this many slow groups are listed (then a count)


def screen_best(rows, redone):
    """rows with re-measurements merged: per (nodes, rail) the best busbw counts; 'tries' counts the
    measurements and 'first' keeps the first value (a re-measured row). redone: screen_measured rows."""
    best = {(tuple(m["nodes"]), m["rail"]): m for m in redone}
    out = []
    for m in rows:
        r = best.get((tuple(m["nodes"]), m["rail"]))
        if r is not None:
            keep = m if (m.get("busbw") or 0.0) >= (r.get("busbw") or 0.0) else dict(m, busbw=r["busbw"],
                                                                                   time_us=r.get("time_us"))
            m = dict(keep, tries=m.get("tries", 1) + 1, first=m.get("first", m.get("busbw")))
        out.append(m)
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
    by_cls = group_by(per_node, _intra_class)
    refs = {k: screen_reference(p.get("busbw") for p in ps) for k, ps in by_cls.items()}
    peers = {k: r if r["count"] >= 2 else {} for k, r in refs.items()}  # one node is its own maximum: no peers
    return refs, {p["host"]: (screen_level(p.get("busbw"), peers[_intra_class(p)], fail, warn, min_busbw),
                              _intra_class(p)) for p in per_node}


def intra_against(per_node, min_busbw=None, bands=None):
    """What each class of intra-node rows was judged against (screen_against): its peers from 2 nodes on, the
    floor, the manifest band; never a table (no per-model numbers for NVLink/NVSwitch/PCIe busbw)."""
    by_cls = group_by(per_node, _intra_class)
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
            floor = min_busbw is not None and v < min_busbw
            why = (f"below the floor {min_busbw:g} GB/s (--min-busbw-intra, the floor decided)" if floor
                   else f"{v / ref['ref']:.2f} of the reference {_screen_ref_text(ref, 'GB/s')}"
                   + (f" of {_intra_class_text(cls)}" if len(refs) > 1 else "") + f" ({rule})")
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
    tries = {p["host"]: max(int(p.get("tries") or 1), len(p.get("values") or ())) for p in per_node}
    if len(flagged) <= SCREEN_LIST_MAX:
        return [_measured_blame(dict(finding("intra-node", lv, f"{txt}: NVLink/NVSwitch/PCIe inside the node; {ev}",
                                             [h], ranks), evidence=ev, action=act), [tries[h]])
                for lv, h, txt, (ev, act, ranks) in flagged]
    return [_measured_blame(dict(finding("intra-node", status, f"{len(sel)} node(s) slow inside: "
                                         + "; ".join(t for _, _, t, _ in sel[:SCREEN_LIST_MAX]) + more,
                                         [h for _, h, _, _ in sel]),
                                 evidence="; ".join(f"{h}: {e[0]}" for _, h, _, e in sel[:SCREEN_LIST_MAX]),
                                 action="drain them; run the vendor's diagnostics on each"),
                            [tries[h] for _, h, _, _ in sel])
            for status, sel, more in _per_status(flagged, lambda f: f[0])]


def _measured_blame(f, tries):
    """A screen finding's blame from how often each thing it names was measured: 'persisted' when every one was
    measured two or more times (slow each time), else 'once'."""
    if all(t >= 2 for t in tries):
        return dict(f, blame="persisted")
    return unlocalised(f, "once", "a re-run: a node slow again when measured again is named")


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
    (N >= 3), or no node passed at all. Also 'min_busbw' (for _pair_floor_text)."""
    refs, levels = screen_pair_levels(results, min_busbw, cpu)
    nodes = _screen_sorted(n for m in results for n in m["nodes"])
    ev = _pair_evidence(results, levels)
    # the node: slow with two different partners (or partner groups) and fine with none; a node slow only because
    # two of its partners were bad is fine with its suspect-round partner (a node that passed), and so is cleared
    culprits = {k for k, e in ev.items() if len(e["slow"]) >= 2 and not e["ok"]}
    links = [i for i, (m, level) in enumerate(zip(results, levels, strict=True))  # the link or path between them
             if level != "OK" and not any((n, m["rail"]) in culprits for n in m["nodes"])]
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
    return [{"hosts": _screen_sorted(m["nodes"]), "rail": m["rail"], "busbw": float(f"{bw:.4g}"),
             "ratio": round(bw / (d["refs"][m["rail"]]["ref"] or 1.0), 3)}
            for m in (results[i] for i in d["suspect_links"]) for bw in [float(m.get("busbw") or 0.0)]]


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
    out, by_node = [], group_by(d["culprits"], lambda c: c[0], lambda c: c[1])
    for n in _screen_sorted(by_node):
        rails = sorted(by_node[n])
        own = sorted({m["rail"] for m in results if n in m["nodes"]})
        slow = {rail: sorted(i for ids in ev[(n, rail)]["slow"].values() for i in ids) for rail in rails}
        parts, statuses, ratios = [], [], []
        for rail in rails:
            idx = slow[rail]
            # consistent evidence: the node is at least as bad as its least bad slow measurement
            statuses.append("WARN" if "WARN" in [d["levels"][i] for i in idx] else "FAIL")
            bw, ref = _screen_median([float(results[i].get("busbw") or 0.0) for i in idx]), d["refs"][rail]["ref"]
            parts.append(f"local rank {rail}" + (_screen_hca_text(results, idx, [n]) if len(rails) > 1 else "")
                         + f" {_sn(bw)} GB/s = {bw / ref:.2f} of the rail's reference {_sn(ref)} GB/s")
            ratios.append(bw / ref)
        partners = _screen_sorted(p for rail in rails for ps in ev[(n, rail)]["slow"] for p in ps)
        whole = len(rails) > 1 and rails == own
        # one rail: its HCA on this node beside it (node3 rail 2 (HCA mlx5_2))
        named = _screen_hca_text(results, slow[rails[0]], [n]) if len(rails) == 1 else ""
        if whole:
            speed = f"busbw median {_screen_median(ratios):.2f} of the rails' references"
            where = ("a node-wide network fault (its NICs or their switch ports together, or the host side: "
                     "PCIe, firmware)")
        else:
            speed = "; ".join(parts)
            where = "its NIC, cable or switch port on " + ("that rail" if len(rails) == 1 else "those rails")
        every = sorted(i for rail in rails for i in slow[rail])
        tries = max(results[i].get("tries", 1) for i in every)
        act = (f"drain {n}; its NICs together or the host side: check their PCIe links and firmware, run the "
               "vendor's diagnostics" if whole else
               f"drain {n}; reseat or replace the HCA or cable of {_screen_rails_text(rails, [])}{named}, then "
               "check its switch port")
        out.append(dict(finding("inter-node", _screen_worst(statuses),
                                f"node {n} is slow on {_screen_rails_text(rails, own if whole else [])}{named} with "
                                f"{len(partners)} different partner(s) ({_screen_names(partners)}) and fine with none, "
                                f"after re-measurement: {speed}: {where}{_pair_floor_text(results, every, d)}", [n],
                                blame="persisted"),
                        evidence=f"{len(every)} slow measurement(s) with {len(partners)} different partner(s) "
                                 f"({_screen_names(partners)}), each measured up to {tries} time(s), the best "
                                 f"counting; at speed with no partner", action=act))
    return out


def _pair_link_findings(results, d):
    """One finding per group whose slow measurements no culprit explains: the link or path between them.
    Both ends fine with other partners (after round 3): a suspect link, WARN at most, naming no host."""
    ev = _pair_evidence(results, d["levels"])
    groups = group_by(d["links"], lambda i: tuple(_screen_sorted(results[i]["nodes"])))
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
        f = dict(finding("inter-node", status, f"{what} on {on}: busbw "
                         f"{ratio:.2f} of the rail's reference after re-measurement{alone}"
                         f"{_pair_floor_text(results, idx, d)}", list(g)),
                 evidence=f"{len(idx)} slow measurement(s), each measured up to {tries} time(s), the best "
                          f"counting{alone}", action=act)
        # a link or a group names neither end: each is slow only with the other(s), and nothing tells which
        out.append(unlocalised(f, "tie" if d["two_nodes"] or len(g) == 3 else "link",
                               f"measure each of {' and '.join(g)} with a third node" if d["two_nodes"] else None,
                               None if not d["two_nodes"] else "two nodes only: the pair cannot be split"))
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
    Reference: per rail (screen_rail_refs), each measurement FAIL/WARN/OK against it (screen_level with
    SCREEN_NET_FAIL/SCREEN_NET_WARN). Localised per rail (screen_diagnose): a node slow with two different
    partners (or groups) and fine with none is named on that rail (the HCA named when known; on every rail:
    the node as a whole); a slow group none of whose members is such a node is the link or
    path between them, a suspect link when every member is fine with another partner there (WARN at most,
    no host named, the JSON's suspect_links), else both named; two nodes only: the pair is named (nothing
    can localise it); widespread (screen_diagnose): one FAIL naming every suspect.
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
        f = dict(finding("inter-node", "FAIL", f"widespread: {len(sus)} node(s) implicated, more than the "
                         f"{len(d['passing'])} that passed, so no single node or link is to blame (a switch, "
                         f"the fabric or its configuration): {slow}/{len(results)} measurement(s) slow against "
                         f"the rails' references or the floor after re-measurement; suspects: "
                         f"{compress_hostlist(sus)}"
                         f"{_pair_floor_text(results, [i for i, lv in enumerate(d['levels']) if lv != 'OK'], d)}",
                         sus), widespread=True, evidence=f"{slow} slow measurement(s) after re-measurement",
                 action="nothing is drained: check the switches, the fabric and its configuration")
        return [unlocalised(f, "widespread")], sus
    return _pair_node_findings(results, d) + _pair_link_findings(results, d), sus


def screen_band_names(manifest, records, screen):
    """The manifest's speed bands that judge this run's measurements (as judge_bands: BAND_MIN_RUNS runs or
    more, in the class of one of the run's nodes: screen_band_lines) -> sorted band names, [] without a manifest."""
    return sorted({b["band"] for b in screen_band_lines(manifest, records, screen)})


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


def screen_degraded_note(screen):
    """The report's and the JSON's note when the screen made its groups without split_group (screen['no_split']:
    {'why', 'groups'}), else None: each group then costs one call of every rank (new_group through
    new_subgroups_by_enumeration), thousands per round on a large job, where one split makes a round."""
    ns = (screen or {}).get("no_split")
    if not ns:
        return None
    return (f"screen ran in a degraded mode: {ns['why']}: {ns['groups']} groups made by world-wide new_group "
            f"(one call of every rank per group; split_group makes a round in one)")
