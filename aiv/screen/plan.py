"""Floor 3: the performance screen's plan: rounds of node pairs per rail, suspects, re-measurements,
the groups each rank joins; levels against the reference. Plain data only."""
from ..checks.hang import (
    LINK_HINT,
    group_key,
    issued_states,
    never_finished_text,
    never_issued_text,
    on_hosts,
    unlocalised_words,
)
from ..checks.judge import (
    PROCESS_KINDS,
    hang_culprits,
    judge_unfinished,
    screen_reference,
    unfinished_kind,
    unfinished_parts,
)
from ..core.base import EXIT_FAIL, EXIT_TIMEOUT, _screen_key, _screen_median, _screen_sorted, finding, format_ranges
from ..core.deadlines import PHASE_CHECK, PHASES

# The performance screen finds the slow or broken part: a GPU, a node's NVLink/PCIe, a node's NIC on
# one rail, a whole node's network, or one path between two nodes. The runtime measures; these pure
# functions plan the rounds and judge plain data. Units: TFLOPS = 1e12 FLOP/s, GB/s = 1e9 B/s.
#
# Every judgement compares a value with a robust reference of its peers, like for like (same GPU model
# for GPU numbers; same ranks per node and GPU model for intra-node groups; same rail for inter-node
# pair measurements). Faults only LOWER numbers, so the
# reference is the upper quartile (the maximum below SCREEN_QUARTILE_MIN values): up to three
# quarters of the values may be low without dragging it down (at 4 nodes, half of all pair
# measurements involve a bad node). A WARN must also lie outside the peers' own noise
# (SCREEN_NOISE_SIGMAS standard deviations, estimated from the upper half of the values), so
# run-to-run noise over thousands of measurements names no one; a FAIL needs no such margin. A GPU is
# also judged against its model's row of the per-model table (GPU_TABLE), whatever the number of its
# peers, and every value against its floor (--min-*); screen_judged_against says, per measurement, which
# of these it had (a single value is no peer reference: its own maximum).
#
# Flow for the runtime (rank 0 plans and judges, every rank measures): per GPU, all ranks at once -> the
# per_rank rows of judge_gpu_perf; screen_loop(records, measure) (aiv/screen/loop.py says how: the rounds of
# screen_rounds, one 2- or 3-rank group per rail, every slow measurement again, the suspect round) -> the
# intra and pair rows; findings = judge_screen(screen); report = render_performance(screen).
SCREEN_GPU_FAIL = 0.80      # GPU TFLOPS or memory GB/s below 0.80 of its model's reference: FAIL
SCREEN_GPU_WARN = 0.90      # ... below 0.90: WARN
SCREEN_NET_FAIL = 0.70      # all_reduce busbw (intra-node group, inter-node pair) below 0.70 of the reference: FAIL
SCREEN_NET_WARN = 0.85      # ... below 0.85: WARN
SCREEN_CPU_FAIL = 0.10      # cpu=True: FAIL only below 0.10 of the reference and never WARN (ranks share cores)
SCREEN_NOISE_SIGMAS = 6.0   # a WARN must also lie this many peer standard deviations below the reference
SCREEN_LIST_MAX = 16        # more flagged GPUs or nodes than this: one finding lists the first ones and a count


def screen_rounds(nodes):
    """The schedule's rounds of inter-node groups. nodes: node names (any order, duplicates ignored).
    -> [round, ...], round = [group, ...], group = tuple of node names in natural sorted order s[0..N-1].

    N >= 4, h = N // 2: round 1 pairs s[i] with s[i + h] (the two halves, so in rack-ordered names
    every pair crosses the fabric), round 2 pairs s[i] with s[h + (i + 1) % h]: the partner shifted by
    one, never the same for h >= 2. Odd N: the last node s[N-1] joins round 1's last pair and round 2's
    first pair (groups of three); for N >= 7 no two nodes share a group in both rounds. Every node is
    in exactly one group per round. The number of rounds never grows with N.
    Exceptions, because groups of 2 and 3 cannot do better:
      N = 2: one round, the single pair (a fault can only be named as the pair).
      N = 3: three rounds, the three pairs, one per round (the third node idles); a group of three
             cannot tell its members apart. No suspect round follows: every pair is measured.
      N = 5: one pair meets twice (s[3] and s[4]: round 2's group of three must take two members of
             one round-1 group); the suspect round separates them.
      N < 2: no rounds."""
    s = _screen_sorted(nodes)
    n = len(s)
    if n < 2:
        return []
    if n == 2:
        return [[(s[0], s[1])]]
    if n == 3:
        return [[(s[0], s[1])], [(s[0], s[2])], [(s[1], s[2])]]
    h = n // 2
    r1 = [[s[i], s[i + h]] for i in range(h)]
    r2 = [[s[i], s[h + (i + 1) % h]] for i in range(h)]
    if n % 2:
        r1[-1].append(s[-1])
        r2[0].append(s[-1])
    return [[tuple(g) for g in r1], [tuple(g) for g in r2]]


def suspect_round(suspects, passing, met=()):
    """The third round: each suspect paired with a distinct passing node.
    suspects: node names; passing: node names in order of preference (nodes that were in no slow
    measurement first); met: groups already measured (tuples of names), whose pairs are avoided while
    another passing node is free. -> [(suspect, passing_node), ...] in natural order of the suspects,
    [] without suspects, or None when there are more suspects than passing nodes: the fault is
    widespread and no third round is run (judge_pairs then FAILs naming every suspect)."""
    sus = _screen_sorted(suspects)
    if not sus:
        return []
    taken = set(sus)
    free = [p for p in dict.fromkeys(passing) if p not in taken]
    if len(sus) > len(free):
        return None
    seen = {frozenset((a, b)) for g in met for a in g for b in g if a != b}
    out = []
    for s in sus:
        pick = next((p for p in free if frozenset((s, p)) not in seen), free[0])
        free.remove(pick)
        out.append((s, pick))
    return out


def screen_fractions(kind, cpu=False):
    """(fail_fraction, warn_fraction or None) for kind 'gpu' or 'net'; cpu=True: (SCREEN_CPU_FAIL, None)."""
    if cpu:
        return SCREEN_CPU_FAIL, None
    return (SCREEN_GPU_FAIL, SCREEN_GPU_WARN) if kind == "gpu" else (SCREEN_NET_FAIL, SCREEN_NET_WARN)


def screen_level(value, ref, fail, warn=None, floor=None):
    """'FAIL', 'WARN' or 'OK' for one value. ref: a screen_reference() dict; fail, warn: fractions of
    ref['ref'] (warn None: never WARN); floor: an absolute minimum (below it: FAIL), or None. A value of
    None (not measured) is 0.0. A WARN also needs the value SCREEN_NOISE_SIGMAS spreads below ref."""
    value = 0.0 if value is None else float(value)
    if floor is not None and value < floor:
        return "FAIL"
    r = ref.get("ref")
    if not r or r <= 0:
        return "OK"
    if value < fail * r:
        return "FAIL"
    if warn is not None and value < warn * r and value < r - SCREEN_NOISE_SIGMAS * ref.get("spread", 0.0):
        return "WARN"
    return "OK"


def screen_rail_refs(results):
    """Like for like: {rail: screen_reference of that rail's measurements}. A rail whose own reference is
    below SCREEN_NET_FAIL of the median of the rails' references (slow nearly everywhere) is judged
    against that median instead, so a rail that is broken on most nodes still fails."""
    refs = {rail: screen_reference(m.get("busbw") for m in results if m["rail"] == rail)
            for rail in sorted({m["rail"] for m in results})}
    mid = _screen_median([r["ref"] for r in refs.values() if r["ref"]])
    for rail, r in refs.items():
        if mid and (r["ref"] or 0.0) < SCREEN_NET_FAIL * mid:
            refs[rail] = dict(r, ref=mid, how="median of the rails")
    return refs


def screen_pair_levels(results, min_busbw=None, cpu=False):
    """-> (refs per rail, ['FAIL'|'WARN'|'OK' per measurement against its rail's reference])."""
    fail, warn = screen_fractions("net", cpu)
    refs = screen_rail_refs(results)
    return refs, [screen_level(m.get("busbw"), refs[m["rail"]], fail, warn, min_busbw) for m in results]


# -- the runtime's plain data: the rounds' groups, each rank's part, the rows the judges take, who hung
def screen_round_label(name):
    """A batch's name in words: 'intra' -> 'the intra-node round', 'p2' -> 'round 2', 'b5' -> 'batch 5'."""
    return "the intra-node round" if name == "intra" else f"round {name[1:]}" if name[:1] == "p" else \
        f"batch {name[1:]}"


def screen_layout(records):
    """{host: {local_rank: rank}} from the gathered records."""
    by_node = {}
    for r in records:
        by_node.setdefault(r["host"], {})[r["local_rank"]] = r["rank"]
    return by_node


def screen_rail_groups(node_groups, by_node):
    """Per group of nodes, one group per rail (a local rank present on each of them):
    [{'ranks': sorted global ranks, 'nodes': [host, ...], 'rail': local rank}]."""
    return [{"ranks": sorted(by_node[n][rail] for n in nodes), "nodes": list(nodes), "rail": rail}
            for nodes in node_groups for rail in sorted(set.intersection(*(set(by_node.get(n, {})) for n in nodes)))]


def screen_plan(records):
    """The screen's rounds of groups, in the order they run: [(name, groups)]: 'intra' (one group of
    all the ranks of each node with two or more, rail None), then 'p1', 'p2' (and 'p3' for three
    nodes) from screen_rounds, one group per rail (screen_rail_groups). records: the gathered
    records ({'rank', 'host', 'local_rank'})."""
    by_node = screen_layout(records)
    intra = [{"ranks": sorted(lr.values()), "nodes": [h], "rail": None}
             for h, lr in sorted(by_node.items(), key=lambda x: _screen_key(x[0])) if len(lr) > 1]
    return [("intra", intra)] + [(f"p{i}", screen_rail_groups(rnd, by_node))
                                 for i, rnd in enumerate(screen_rounds(by_node), 1)]


def screen_rank_plans(rounds, world):
    """Each rank's part of the rounds: {rank: {name: entry}}; entry = {'mode': 'none' (no group in the
    round), 'world' (one group of every rank: the default group serves) or 'split' (the groups are
    split off the default group), 'g': this rank's group (sorted ranks) or None, and with 'split' for a
    rank in no group 'other': a group of the round (NCCL's split needs one to leave)}."""
    plans = {r: {} for r in range(world)}
    for name, groups in rounds:
        mode = "none" if not groups else \
            "world" if len(groups) == 1 and groups[0]["ranks"] == list(range(world)) else "split"
        mine = {r: g["ranks"] for g in groups for r in g["ranks"]}
        for r in range(world):
            e = plans[r][name] = {"mode": mode, "g": mine.get(r)}
            if mode == "split" and r not in mine:
                e["other"] = groups[0]["ranks"]
    return plans


def screen_split_groups(rounds, world):
    """How many groups the rounds make by splitting the default group (screen_rank_plans' 'split' mode)."""
    return sum(len(gs) for _, gs in rounds if gs and not (len(gs) == 1 and gs[0]["ranks"] == list(range(world))))


def screen_measured(groups, posts):
    """The groups whose members all posted a busbw, each with the slowest member's busbw and time:
    [dict(group, busbw=, time_us=)]. posts: {rank: {'busbw', 'time_us', ...}}."""
    out = []
    for g in groups:
        ps = [posts.get(r) for r in g["ranks"]]
        if all(p and p.get("busbw") is not None for p in ps):
            slow = min(ps, key=lambda p: p["busbw"])
            out.append(dict(g, busbw=slow["busbw"], time_us=slow.get("time_us")))
    return out


def screen_pair_hca(ranks, posts, records):
    """{host: HCA} of a pair group's ranks: what each rank's NCCL log showed (its post's 'hca'), else the
    HCA nearest its GPU in sysfs (its record's gpu 'hca'); None where none is known ('' in a post: sockets,
    no HCA, and no sysfs guess either). records: the gathered records, or {rank: record}."""
    recs = records if isinstance(records, dict) else {r["rank"]: r for r in records}
    out = {}
    for r in ranks:
        h = (posts.get(r) or {}).get("hca")
        rec = recs.get(r) or {}
        if h is None:
            h = (rec.get("gpu") or {}).get("hca")
        if h and rec.get("host"):
            out[rec["host"]] = h
    return out or None


def screen_creation(groups, posts):
    """Seconds a round's group creation took: per group its last member's time (the others also waited
    for the last to arrive), the slowest group's; 0.0 when nothing was created."""
    per = [min(posts[r].get("split_s") or 0.0 for r in g["ranks"] if r in posts)
           for g in groups if any(r in posts for r in g["ranks"])]
    return max(per, default=0.0)


def screen_gpu_rows(records, posts, cpu=False):
    """judge_gpu_perf's per_rank rows: each posting rank's record facts and its measurement, with its GPU's
    row of its node's one nvidia-smi call (node.smi.gpus, by UUID: ECC and row remapping) where there is one."""
    smi = {u: row for rec in records
           for u, row in (((rec.get("node") or {}).get("smi") or {}).get("gpus") or {}).items()}
    return [{"rank": rec["rank"], "host": rec["host"], "local_rank": rec["local_rank"], "uuid": g.get("uuid"),
             "model": g.get("name") or ("cpu" if cpu else None), **(smi.get(g.get("uuid")) or {}),
             **{k: v for k, v in posts[rec["rank"]].items() if k != "rank"}}
            for rec in sorted(records, key=lambda r: r["rank"]) if posts.get(rec["rank"]) is not None
            for g in [rec.get("gpu") or {}]]


def _screen_group_words(g):
    if g.get("gpu"):
        return f"the GPU of rank {g['ranks'][0]} on {g['nodes'][0]}, measured again"
    if g.get("gpus"):
        return f"GPUs {g['gpus'][0]} and {g['gpus'][1]} of {g['nodes'][0]} (ranks {format_ranges(g['ranks'])})"
    if g.get("rail") is None:
        return f"the intra-node group of {g['nodes'][0]} (ranks {format_ranges(g['ranks'])})"
    if len(g["nodes"]) == 2:
        return f"link between {g['nodes'][0]} and {g['nodes'][1]} on rail {g['rail']}"
    return f"links among {', '.join(g['nodes'])} on rail {g['rail']}"


def _stuck_states(hung, loose, stuck, issued, host_of):
    """What each unfinished rank of a screen round issued last: ({rank: 'behind'|'waiting'|'idle'|'unposted'|...},
    [words naming the members that never issued their group's collective]); ({}, []) when not asked."""
    states, behind_words = {}, []
    if issued is None:
        return states, behind_words
    for g in hung:
        an = issued_states(g["ranks"], issued, [r for r in g["ranks"] if r in stuck], group_key(g["ranks"]))
        states.update(an["states"])
        behind = [r for r in g["ranks"] if an["states"].get(r) == "behind"]
        if behind:
            behind_words.append(never_issued_text(behind, an, host_of))
    for r in loose:  # in no group of the round: its part was its post alone
        if r in stuck:
            p = issued.get(r)
            states[r] = "unposted" if p is None else "waiting" if p.get("inflight") else "idle"
    return states, behind_words


def screen_stuck(phase, how, world, rounds, posted, host_of, live, errors, silent_hosts=(), issued=None):
    """Who did not finish a screen round (one FAIL finding under PHASE_CHECK[phase]), or None when every
    rank posted every round. rounds: [(name, groups)] of the phase in the order they ran; posted: {name:
    ranks that posted it}; how: 'did not complete within 30s', 'failed', ...; live, errors, silent_hosts
    as judge_unfinished; issued: {rank: its post of what it issued last, or None} (None: not asked). The
    first round some rank did not post names its groups with a member missing (the node pair and rail, or
    the node) and the missing ranks in no group of it. The culprits follow judge_unfinished's law: a rank's
    own process state (dead, frozen, unreachable) anywhere; a signal or the tool's own error names nobody;
    an error a rank reported itself; a member that never issued its group's collective while the other end
    did, or a rank outside any collective that never finished its part of the round while others did.
    Else (both ends inside the collective: the link; records not collected) no host is named, and the
    finding says why and what would localise it."""
    todo = [(n, gs, m) for n, gs in rounds for m in [sorted(set(range(world)) - set(posted.get(n) or ()))] if m]
    if not todo:
        return None
    name, groups, missing = todo[0]
    label = screen_round_label(name)
    hung = [g for g in groups if set(g["ranks"]) & set(missing)]
    loose = sorted(set(missing) - {r for g in hung for r in g["ranks"]})
    kinds = {r: unfinished_kind(r, live, errors, host_of, silent_hosts) for r in range(world)}
    hard = [r for r in range(world) if kinds[r] in PROCESS_KINDS]
    if not hard and any(kinds[r] in ("terminated", "internal") for r in range(world)):
        return judge_unfinished(phase, f"{label} {how}", world, host_of,  # as judge_unfinished: nobody's fault
                                {r: -1 if r in missing else PHASES.index(phase) for r in range(world)}, live, errors)
    stuck = [r for r in missing if kinds[r] == "stuck"]
    states, behind_words = _stuck_states(hung, loose, stuck, issued, host_of)
    done = sorted(set(range(world)) - set(missing))
    all_issued = None
    if stuck and hung and all(states.get(r) == "waiting" for r in stuck):
        all_issued = (f"every member of {_screen_group_words(hung[0])}{' and the others' if len(hung) > 1 else ''} "
                      "issued its all_reduce and it did not finish: the link, which neither end's own state singles "
                      "out", LINK_HINT)
    culprits, _, _, evidence, unloc = hang_culprits(kinds, missing, world, states, bool(done), issued is not None,
                                                    all_issued)
    idle = [r for r in culprits if evidence == "never-issued" and states.get(r) == "idle"]
    what = [_screen_group_words(g) for g in hung[:8]] + ([f"{len(hung) - 8} more group(s)"] if len(hung) > 8 else [])
    what += [f"{on_hosts(loose, host_of)} (in no group of {label})"] if loose else []
    parts = behind_words + ([never_finished_text(idle, label, done, host_of)] if idle and evidence ==
                            "never-issued" else [])
    named = set(culprits)

    def ranks_of(k):  # those of kind k; the ones named for never issuing are said above
        return ([r for r in missing if kinds[r] == k and not (evidence == "never-issued" and r in named)]
                + [r for r in hard if kinds[r] == k and r not in missing])
    parts += unfinished_parts(ranks_of, states, named, host_of, issued is not None)
    first_err = next((errors[r]["line"] for r in culprits if r in errors), None)
    reason = (f"{'; '.join(what)} {how} ({'; '.join(parts)}); {world - len(missing)}/{world} rank(s) finished "
              f"{label}" + (f"; first error: {first_err}" if first_err else "")
              + (f"; {unlocalised_words(unloc)}" if unloc else ""))
    code = EXIT_FAIL if any(kinds[r] == "dead" for r in hard) else \
        EXIT_FAIL if evidence in ("own", "everyone") and all(kinds[r] in ("error", "terminated") for r in missing) \
        else EXIT_TIMEOUT
    check = "gpu-perf" if hung and all(g.get("gpu") for g in hung) else \
        "intra-node" if hung and all(g.get("rail") is None for g in hung) else PHASE_CHECK[phase]
    f = finding(check, "FAIL", reason, _screen_sorted(host_of.get(r, "?") for r in culprits), culprits, code=code)
    f["blame"] = evidence
    if unloc:
        f["unlocalised"] = unloc
    return f


def _per_status(items, status_of):
    """Beyond SCREEN_LIST_MAX flagged items, one finding per status: [(status, its items, '; and <n> more'
    past the first SCREEN_LIST_MAX, or '')] for FAIL, then WARN, where there are any."""
    return [(s, sel, f"; and {len(sel) - SCREEN_LIST_MAX} more" if len(sel) > SCREEN_LIST_MAX else "")
            for s in ("FAIL", "WARN") for sel in [[x for x in items if status_of(x) == s]] if sel]


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
    if band:
        got.append(f"the manifest band {band}")
    elif band is not None:
        miss.append(("a manifest band", "no manifest band"))
    head = f"{what} ({count} {noun}{s})"
    text = (f"{head}: no reference: {', '.join(n for _, n in miss)}" if not got else
            f"{head}: against {', '.join(got)}" + (f"; not against {', '.join(m for m, _ in miss)}" if miss else ""))
    return {"measurement": what, "count": count, "peers": p, "table": table, "floor": floor,
            "band": band or None, "judged": bool(got), "missing": [m for m, _ in miss], "text": text}
