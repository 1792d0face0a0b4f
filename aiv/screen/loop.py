"""Floor 3: the screen's control loop, screen_loop(records, measure): the batches of groups that run at
once, what is measured again, which known-good nodes a slow node is measured beside, how a node slow
inside is localised to a GPU or a GPU pair, and when to stop. Plain data in, the screen dict that
judge_screen judges out; measure() is its only effect (the runtime's collectives, or a simulation)."""
from collections import Counter

from ..checks.judge import screen_reference
from ..core.base import _screen_key, finding
from .gpu import judge_gpu_perf, judge_gpu_transients
from .judge import intra_levels, judge_intra, judge_pairs, screen_best, screen_suspect_links, screen_third_round
from .plan import (
    screen_fractions,
    screen_layout,
    screen_level,
    screen_measured,
    screen_pair_hca,
    screen_pair_levels,
    screen_rail_groups,
    screen_rounds,
)

# Blame only what persists. Every slow measurement is measured again before it counts, and the best
# value counts (faults only lower numbers; a burst of another job's traffic halves one measurement,
# not three). A node slow inside (its all_reduce) is measured again, from its third try on beside
# SCREEN_CONTROLS known-good nodes of its class in the same batch; slow in every try, it is localised:
# each GPU pair of the node (a ring first: every GPU with its two neighbours; then, when no pair of the
# ring is slow, every other pair) beside the same pairs of the controls, so the finding names the GPU
# (slow with two partners, at speed with none) or the GPU pair. A node slow in every try whose pairs are
# all at speed is measured SCREEN_CONFIRM_TRIES more times before it is named as a whole. A measurement
# slow at first and at speed again is a transient: a WARN that names no host (judge_transients).
SCREEN_TRIES = 4          # a slow pair measurement (between nodes, or two GPUs of a node): at most this many times
SCREEN_INTRA_TRIES = 4    # a slow node's all_reduce inside the node: at most this many times before localising
SCREEN_CONFIRM_TRIES = 1  # ... and this many more when every GPU pair of it is at speed
SCREEN_CONTROL_TRY = 3    # from this try on a slow node is measured beside its controls
SCREEN_CONTROLS = 2       # known-good nodes of its class measured beside a slow node
SCREEN_BATCHES_MAX = 40   # the loop's own bound: a healthy screen takes at most 16 batches, one with a fault 24


def _pack(bundles):
    """One batch: the bundles (lists of groups that must run together) in order, each taken whole when
    its ranks are free; a group already in the batch (a control shared by two slow nodes) is taken once."""
    used, keys, out = set(), set(), []
    for b in bundles:
        new = [g for g in b if tuple(g["ranks"]) not in keys]
        rs = {r for g in new for r in g["ranks"]}
        if rs & used or len(rs) != sum(len(g["ranks"]) for g in new):
            continue
        used |= rs
        keys |= {tuple(g["ranks"]) for g in new}
        out += new
    return out


def _ring(lrs):
    """Each GPU with its two neighbours in local-rank order: [(a, b)], a before b, each pair once."""
    return list(dict.fromkeys(tuple(sorted(e)) for e in zip(lrs, lrs[1:] + lrs[:1], strict=True) if e[0] != e[1]))


def _matchings(edges):
    """edges ordered so that consecutive ones share no GPU where possible (the packer then fills each
    batch): greedy rounds of disjoint edges."""
    left, out = list(edges), []
    while left:
        used, rnd = set(), []
        for e in list(left):
            if not set(e) & used:
                rnd.append(e)
                used |= set(e)
                left.remove(e)
        out += rnd
    return out


class _Loop:
    def __init__(self, records, measure, min_intra=None, min_inter=None, cpu=False):
        self.records, self.measure, self.cpu = {r["rank"]: r for r in records}, measure, cpu
        self.min_intra, self.min_inter = min_intra, min_inter
        self.by_node = screen_layout(records)
        model = {r["rank"]: (r.get("gpu") or {}).get("name") for r in records}
        self.intra = {h: {"host": h, "busbw": None, "ranks": sorted(lr.values()), "model": model.get(min(lr.values())),
                          "time_us": None, "tries": 0, "values": []}
                      for h, lr in sorted(self.by_node.items(), key=lambda x: _screen_key(x[0])) if len(lr) > 1}
        self.rounds = [screen_rail_groups(rnd, self.by_node) for rnd in screen_rounds(self.by_node)]
        self.pairs, self.third, self.todo3, self.batches, self.done = [], None, [], [], 0
        self.local = {}      # host -> localisation state
        self.controls = {}   # host -> its control nodes

    # ---------------------------------------------------------------- groups
    def g_intra(self, h):
        return {"ranks": self.intra[h]["ranks"], "nodes": [h], "rail": None, "kind": "intra"}

    def g_gpus(self, h, e):
        lr = self.by_node[h]
        return {"ranks": sorted(lr[x] for x in e), "nodes": [h], "rail": None, "kind": "gpu-pair", "gpus": list(e)}

    def edge_bundle(self, h, e):
        """GPU pair e of node h with the same pair on each of h's controls: measured in one batch."""
        return [self.g_gpus(h, e)] + [dict(self.g_gpus(c, e), control=h) for c in self.local[h]["controls"]]

    # ---------------------------------------------------------------- levels
    def intra_level(self):
        rows = [r for r in self.intra.values() if r["tries"]]
        return {h: lv for h, (lv, _) in intra_levels(rows, self.min_intra, self.cpu)[1].items()} if rows else {}

    def pair_levels(self):
        return screen_pair_levels(self.pairs, self.min_inter, self.cpu)[1] if self.pairs else []

    def edge_levels(self, h):
        """{edge: level} of node h's measured GPU pairs against the same pair on its controls (and on h
        itself: a reference from the best values, the upper quartile from 4 values on)."""
        st, fail, warn = self.local[h], *screen_fractions("net", self.cpu)
        out = {}
        for e, vs in st["edges"].items():
            if not vs:
                continue
            peers = [max(c) for c in st["ctrl"].get(e, {}).values() if c] + [max(vs)]
            ref = screen_reference(peers) if len(peers) > 1 else \
                screen_reference(max(v) for v in st["edges"].values() if v)
            st["refs"][e] = ref["ref"]
            out[e] = screen_level(max(vs), ref, fail, warn)
        return out

    def pick_controls(self, h, levels):
        if h in self.controls:
            return self.controls[h]
        cls = (len(self.intra[h]["ranks"]), self.intra[h]["model"])
        busy = {c for cs in self.controls.values() for c in cs}
        ok = [x for x in self.intra if x != h and levels.get(x) == "OK" and x not in self.local
              and (len(self.intra[x]["ranks"]), self.intra[x]["model"]) == cls
              and sorted(self.by_node[x]) == sorted(self.by_node[h])]
        pick = ([x for x in ok if x not in busy] + [x for x in ok if x in busy])[:SCREEN_CONTROLS]
        self.controls[h] = pick
        return pick

    # ---------------------------------------------------------------- what to measure next
    def wants(self):
        """Bundles of groups wanted now, in order of priority; [] when the screen is done."""
        if self.intra and not any(r["tries"] for r in self.intra.values()):
            return [[self.g_intra(h)] for h in self.intra], "intra"
        ilv, plv = self.intra_level(), self.pair_levels()
        slow = [i for i, lv in enumerate(plv) if lv != "OK" and self.pairs[i].get("tries", 1) < SCREEN_TRIES]
        while not slow and self.done < len(self.rounds):  # each pair round's slow ones again before the next
            self.done += 1
            if self.rounds[self.done - 1]:
                return [[dict(g, kind="pair", round=self.done)] for g in self.rounds[self.done - 1]], f"p{self.done}"
        out = self.local_wants(ilv)
        for h, r in self.intra.items():
            if h in self.local or ilv.get(h, "OK") == "OK" or r["tries"] >= SCREEN_INTRA_TRIES:
                continue
            ctrl = self.pick_controls(h, ilv) if r["tries"] + 1 >= SCREEN_CONTROL_TRY else []
            out.append([self.g_intra(h)] + [dict(self.g_intra(c), control=h) for c in ctrl])
        out += [[{"ranks": m["ranks"], "nodes": list(m["nodes"]), "rail": m["rail"], "kind": "pair",
                  "round": m["round"], "redo": i}] for i in slow for m in [self.pairs[i]]]
        if self.third is None and not slow and self.pairs:
            self.third = screen_third_round(self.pairs, self.min_inter, self.cpu)
            if self.third["groups"]:
                self.todo3 = [dict(g, kind="pair", round=3)
                              for g in screen_rail_groups(self.third["groups"], self.by_node)]
        out += [[g] for g in self.todo3]
        return out, None

    def local_wants(self, ilv):
        """Localisation of the nodes slow in every try: their GPU pairs beside the controls' same pairs,
        the slow ones again, the remaining pairs when the ring shows none slow, then the node itself."""
        for h, r in self.intra.items():  # slow in every try, three GPUs or more: its GPU pairs, a ring first
            if h not in self.local and len(r["ranks"]) >= 3 and r["tries"] >= SCREEN_INTRA_TRIES \
                    and ilv.get(h, "OK") != "OK":
                self.local[h] = {"stage": 1, "edges": {e: [] for e in _matchings(_ring(sorted(self.by_node[h])))},
                                 "ctrl": {}, "refs": {}, "controls": self.pick_controls(h, ilv), "result": None}
        out = []
        for h, st in self.local.items():
            if st["result"] is not None:
                continue
            todo = [e for e, vs in st["edges"].items() if not vs]
            if todo:
                out += [self.edge_bundle(h, e) for e in todo]
                continue
            lv = self.edge_levels(h)
            redo = [e for e, x in lv.items() if x != "OK" and len(st["edges"][e]) < SCREEN_TRIES]
            if redo:
                out += [[self.g_gpus(h, e)] for e in redo]
                continue
            if any(x != "OK" for x in lv.values()):
                st["result"] = "localised"
                continue
            if st["stage"] == 1:
                lrs = sorted(self.by_node[h])
                rest = [e for e in _matchings([(a, b) for i, a in enumerate(lrs) for b in lrs[i + 1:]])
                        if e not in st["edges"]]
                st["stage"] = 2
                if rest:
                    st["edges"].update({e: [] for e in rest})
                    out += [self.edge_bundle(h, e) for e in rest]
                    continue
            if self.intra[h]["tries"] < SCREEN_INTRA_TRIES + SCREEN_CONFIRM_TRIES and ilv.get(h, "OK") != "OK":
                out.append([self.g_intra(h)] + [dict(self.g_intra(c), control=h) for c in st["controls"]])
                continue
            st["result"] = "unlocalised"
        return out

    # ---------------------------------------------------------------- results
    def take(self, batch, posts):
        got = {tuple(m["ranks"]): m for m in screen_measured(batch, posts)}
        res = [(g, *((got[k]["busbw"], got[k].get("time_us")) if k in got else (None, None)))
               for g in batch for k in [tuple(g["ranks"])]]
        beside = {g["nodes"][0]: bw for g, bw, _ in res if g["kind"] == "intra"}
        for g, bw, us in res:
            h = g["nodes"][0]
            if g["kind"] == "intra" and "control" not in g:
                self.take_intra(h, bw, us, beside)
            elif g["kind"] == "gpu-pair":
                e, v = tuple(g["gpus"]), 0.0 if bw is None else bw
                if "control" not in g and h in self.local:
                    self.local[h]["edges"][e].append(v)
                for st in self.local.values():
                    if h in st["controls"]:
                        st["ctrl"].setdefault(e, {}).setdefault(h, []).append(v)
            elif g["kind"] == "pair" and "redo" in g:
                self.pairs[g["redo"]] = screen_best([self.pairs[g["redo"]]], [dict(g, busbw=bw, time_us=us)])[0]
            elif g["kind"] == "pair":
                self.pairs.append({"round": g["round"], "nodes": list(g["nodes"]), "rail": g["rail"], "busbw": bw,
                                   "hca": screen_pair_hca(g["ranks"], posts, self.records), "ranks": g["ranks"],
                                   "time_us": us})
        took = {tuple(g["ranks"]) for g in batch if g["kind"] == "pair" and "redo" not in g}
        self.todo3 = [g for g in self.todo3 if tuple(g["ranks"]) not in took]

    def take_intra(self, h, bw, us, beside):
        r = self.intra[h]
        r["tries"] += 1
        r["values"].append(bw)
        if r["busbw"] is None or (bw or 0.0) > r["busbw"]:
            r["busbw"], r["time_us"] = bw, us
        ctrl = {c: beside[c] for c in self.controls.get(h, []) if c in beside}
        if ctrl and r["tries"] > 1:
            r.setdefault("beside", []).append({"try": r["tries"], "busbw": bw, "controls": ctrl})

    # ---------------------------------------------------------------- the loop
    def run(self):
        while len(self.batches) < SCREEN_BATCHES_MAX:
            bundles, name = self.wants()
            batch = _pack(bundles)
            if not batch:
                break
            name = name or f"b{len(self.batches) + 1}"
            batch = [dict(g, batch=name) for g in batch]
            posts = self.measure(batch) or {}
            self.batches.append({"name": name, "groups": len(batch), "kinds": dict(Counter(g["kind"] for g in batch))})
            self.take(batch, posts)
        return self.result()

    def result(self):
        intra = []
        for h, r in self.intra.items():
            if not r["tries"]:
                continue
            row = {k: r[k] for k in ("host", "busbw", "ranks", "model", "time_us")}
            if r["tries"] > 1:
                row.update(tries=r["tries"], first=r["values"][0], values=r["values"])
                if r.get("beside"):
                    row["beside"] = r["beside"]
            if h in self.local:
                row["local"] = self.local_result(h)
            intra.append(row)
        return {"intra": intra, "pairs": self.pairs,
                "suspect_links": screen_suspect_links(self.pairs, self.min_inter, self.cpu),
                "third": self.third or {"suspects": [], "passing": [], "groups": []},
                "batches": self.batches}

    def local_result(self, h):
        """{'controls', 'pairs': [{'gpus', 'ranks', 'busbw' (best), 'tries', 'ref', 'level'}], 'gpus': GPUs
        slow with two or more partners and at speed with none, 'links': slow pairs no such GPU explains,
        'wide': every pair slow, 'result': 'localised'|'unlocalised'|None}."""
        st = self.local[h]
        lv = self.edge_levels(h)
        lr = self.by_node[h]
        pairs = [{"gpus": list(e), "ranks": sorted(lr[x] for x in e), "busbw": max(vs), "tries": len(vs),
                  "ref": st["refs"].get(e), "level": lv[e]} for e, vs in sorted(st["edges"].items()) if vs]
        slow = {e for e, x in lv.items() if x != "OK"}
        n_slow, n_ok = Counter(g for e in slow for g in e), Counter(g for e in lv if e not in slow for g in e)
        gpus = sorted(g for g, c in n_slow.items() if c >= 2 and not n_ok[g])
        links = [list(e) for e in sorted(slow) if not set(e) & set(gpus)]
        return {"controls": st["controls"], "pairs": pairs, "gpus": gpus, "links": links,
                "wide": bool(slow) and len(slow) == len(lv), "result": st["result"]}


def screen_loop(records, measure, min_busbw_intra=None, min_busbw_inter=None, cpu=False):
    """The screen's network rounds as one loop. records: the gathered records ({'rank', 'host',
    'local_rank', 'gpu': {'name'}}); measure(groups) runs every group of one batch at once (each rank in
    at most one group) and returns {rank: {'busbw': GB/s, 'time_us': us, ...}}, each member posting its
    group's result (a pair rank may add 'hca'). A group: {'ranks', 'nodes', 'rail' (None inside a node),
    'kind': 'intra'|'pair'|'gpu-pair', 'batch': the batch's name ('intra', 'p1', 'p2', 'p3', then 'b<k>')},
    a pair also 'round', a GPU pair 'gpus' (local ranks).
    Batches: the intra-node round (every node of two or more ranks), the pair rounds of screen_rounds
    (every rail), then, packed together while their ranks are free: the re-measurements and localisations
    of the comment above, and the suspect round (screen_third_round) once the pair rounds are settled.
    -> {'intra': judge_intra's rows (re-measured ones with 'tries', 'first', 'values', 'beside';
    localised ones with 'local'), 'pairs': judge_pairs' rows, 'suspect_links', 'third', 'batches':
    [{'name', 'groups', 'kinds'}]}."""
    return _Loop(records, measure, min_busbw_intra, min_busbw_inter, cpu).run()


def judge_transients(screen):
    """Measurements slow at first and at speed when measured again (screen_loop's re-measurements: a
    burst of another job's traffic, a moment of contention): one WARN per check that names no host, so
    that --drain never acts on it, with what was seen. -> findings under 'intra-node' / 'inter-node'."""
    cpu, out = bool(screen.get("cpu")), []
    intra = [p for p in screen.get("intra") or [] if p.get("tries", 1) > 1]
    if intra:
        refs, levels = intra_levels(screen.get("intra") or [], screen.get("min_busbw_intra"), cpu)
        seen = [(p, refs[levels[p["host"]][1]]["ref"] or 1.0) for p in intra if levels[p["host"]][0] == "OK"]
        if seen:
            out.append(_transient_finding("intra-node", [
                f"{p['host']} " + " then ".join(f"{float(v or 0.0) / r:.2f}" for v in p.get("values") or [])
                for p, r in seen], "node(s)"))
    pairs = screen.get("pairs") or []
    if pairs:
        refs, levels = screen_pair_levels(pairs, screen.get("min_busbw_inter"), cpu)
        seen = [m for m, lv in zip(pairs, levels, strict=True) if lv == "OK" and m.get("tries", 1) > 1]
        if seen:
            ratio = lambda m, v: float(v or 0.0) / (refs[m["rail"]]["ref"] or 1.0)  # noqa: E731
            out.append(_transient_finding("inter-node", [
                f"{'<->'.join(m['nodes'])} rail {m['rail']} {ratio(m, m.get('first')):.2f} then "
                f"{ratio(m, m.get('busbw')):.2f} (best of {m['tries']})" for m in seen],
                "measurement(s) between nodes"))
    return out


def _transient_finding(check, items, noun):
    shown = "; ".join(items[:8]) + (f"; and {len(items) - 8} more" if len(items) > 8 else "")
    return dict(finding(check, "WARN", f"{len(items)} {noun} slow at first and at speed when measured again "
                        f"(ratio to the reference, each try): {shown}: a transient (another job's traffic, a burst), "
                        "no host is named"),
                evidence=f"{len(items)} {noun} slow once, at speed in a later try", transient=True,
                action="none now: nothing is drained; re-run the preflight if the same node or link recurs")


def judge_screen(screen):
    """Every screen judgement. screen: the dict render_performance takes (screen_loop's and the GPU
    screen's). -> findings: judge_gpu_perf, judge_gpu_transients, judge_intra, judge_pairs, judge_transients."""
    cpu = bool(screen.get("cpu"))
    return (judge_gpu_perf(screen.get("gpu") or [], screen.get("min_tflops"), screen.get("min_hbm"), cpu)
            + judge_gpu_transients(screen.get("gpu") or [], screen, cpu)  # the floors: min_tflops, min_hbm
            + judge_intra(screen.get("intra") or [], screen.get("min_busbw_intra"), cpu)
            + judge_pairs(screen.get("pairs") or [], screen.get("min_busbw_inter"), cpu)[0]
            + judge_transients(screen))
