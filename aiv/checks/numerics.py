"""Floor 3: how the numerics check (silent data corruption) is judged: every rank's results (numerics_measure)
grouped by GPU model and software, bit for bit within a group and against the fp64 reference; the DDP step's
local gradients; the soak's repeats. Pure functions of plain data."""
from ..core.base import EXIT_INTERNAL, compress_hostlist, finding, format_ranges, group_by
from ..core.blame import unlocalised
from ..core.names import NUMERICS_CHECKS, NUMERICS_WHAT

NUMERICS_LIST_MAX = 16       # beyond this many culprits, one finding lists the first ones and a count
NUMERICS_ACTION = ("drain it and run the vendor's diagnostics before it returns to service (DCGM level 3: "
                   "dcgmi diag -r 3)")
NUMERICS_CPU_ACTION = "drain it and run the vendor's CPU and memory diagnostics before it returns to service"


def numerics_group(model, software, driver=None, cpu_model=None):
    """The words that name "the same model and software": results in one group must agree bit for bit."""
    sw = software or {}
    if sw.get("sms") is not None:
        head = f"{model} ({sw['sms']} SMs, compute {sw.get('cc')})"
        soft = (f"torch {sw.get('torch')}, CUDA {sw.get('cuda')}, cuBLAS {sw.get('cublas') or '?'}, driver "
                f"{driver or '?'}" + (f", BLAS {sw['blas']}" if sw.get("blas") else "")
                + ("" if sw.get("bf16_reduced", True) else ", bf16 reductions in fp32"))
    else:
        head = f"CPU {cpu_model or model or '?'} ({sw.get('isa') or '?'})"
        soft = f"torch {sw.get('torch')}"
    return f"{head}; {soft}" + "".join(f", {k}={v}" for k, v in sorted((sw.get("env") or {}).items()))


def numerics_rows(records, posts=None, field="numerics"):
    """judge_numerics' rows from the gathered records: each rank's post (posts: rank -> post, else the record's
    own `field`), with its host, GPU (UUID, CUDA index, model) and group (numerics_group; the driver and the
    CPU model from its node's facts). Ranks without a post are left out."""
    node = {rec.get("host"): rec["node"] for rec in records if isinstance(rec.get("node"), dict)}
    rows = []
    for rec in sorted(records, key=lambda r: r["rank"]):
        post = (posts or {}).get(rec["rank"]) if posts is not None else rec.get(field)
        if not isinstance(post, dict):
            continue
        g, facts = rec.get("gpu") or {}, node.get(rec.get("host")) or {}
        model = g.get("name") or "CPU"
        rows.append({"rank": rec["rank"], "host": rec.get("host"), "local_rank": rec.get("local_rank"),
                     "device": rec.get("device"), "uuid": g.get("uuid"), "model": model,
                     "group": numerics_group(model, post.get("software"), facts.get("driver"), facts.get("cpu_model")),
                     "checks": post.get("checks") or {}, "error": post.get("error"),
                     "internal": post.get("internal"), "unread": post.get("unread")})
    return rows


def _who(r):
    if r.get("uuid") or r.get("device") is not None:
        return (f"rank {r['rank']} on {r.get('host')} (GPU {r.get('uuid') or 'UUID unknown'}, cuda:{r.get('device')}, "
                f"local rank {r.get('local_rank')}, {r.get('model')})")
    return f"rank {r['rank']} on {r.get('host')} (CPU)"


def _ranks_words(rows, limit=8):
    by = group_by(rows, lambda r: r.get("host"), lambda r: r["rank"])
    parts = [f"rank(s) {format_ranges(v)} ({h})" for h, v in list(by.items())[:limit]]
    return ", ".join(parts) + (f" and {len(by) - limit} more node(s)" if len(by) > limit else "")


def _n(x):
    return "?" if x is None else f"{x:.3g}"


def _off_words(c, p, detail_only=False):
    """Check c of a rank off the fp64 reference: by how much and where (detail_only: that alone), and why its
    reference is not believed."""
    at = ", ".join(map(str, p.get("at") or []))
    ratio = _n((p.get("err") or 0) / p["tol"]) if p.get("tol") else "?"
    detail = (f"max abs error {_n(p.get('abs'))} at element ({at}) ({_n(p.get('value'))} where fp64 gives "
              f"{_n(p.get('ref'))}: rel {_n(p.get('rel'))}, {ratio}x the tolerance)")
    return detail if detail_only else (f"{c} ({NUMERICS_WHAT.get(c, c)}) is off the fp64 reference: {detail}"
                                       + (f"; {p['reference']}" if p.get("reference") else ""))


def _check_order(names):
    return sorted(names, key=lambda c: (NUMERICS_CHECKS.index(c) if c in NUMERICS_CHECKS else 99, c))


def _numerics_bits(c, on, culprits):
    """Check c among the ranks `on` the reference: a strict majority of bits names the minority (added to
    culprits). -> the classes {digest: rows} where there is no majority (a tie), else None."""
    by = group_by(on, lambda r: r["checks"][c].get("digest"))
    top = max(by.values(), key=len, default=[])
    if len(by) > 1 and 2 * len(top) <= len(on):
        return by
    for r in [r for rs_ in by.values() if rs_ is not top for r in rs_]:
        culprits.setdefault(r["rank"], (r, []))[1].append(_bits_words(c, r, len(top)))
    return None


def _numerics_tie(group, c, by, culprits):
    """No majority on check c: explained when every class but one holds only culprits (the others' bits
    are then named against it), else one FAIL naming the ranks that disagree, no host blamed (or None)."""
    clean = [d for d, rs_ in by.items() if not all(r["rank"] in culprits for r in rs_)]
    if len(clean) == 1:
        for r in [r for d, rs_ in by.items() if d != clean[0] for r in rs_]:
            culprits[r["rank"]][1].append(_bits_words(c, r, len(by[clean[0]])))
        return None
    ranks = [r for rs_ in by.values() for r in rs_]
    return finding("numerics", "FAIL", f"{len(ranks)} rank(s) of {group} disagree bit for bit on {c} "
                   f"({NUMERICS_WHAT.get(c, c)}): {len(by)} distinct results ("
                   + " | ".join(_ranks_words(rs_) for rs_ in by.values())
                   + ") and none is off the fp64 reference beyond the tolerance: one of them computes wrong "
                   "and this run cannot tell which (no majority): run dcgmi diag -r 3 on "
                   f"{compress_hostlist(sorted({r.get('host') for r in ranks}))}, or rerun with a third "
                   "device of the model; no host blamed", ranks=[r["rank"] for r in ranks], blame="tie")


def judge_numerics(rows, stage="numerics check"):
    """The numerics findings (check 'numerics') of rows [{'rank', 'host', 'local_rank', 'device', 'uuid', 'model',
    'group', 'checks': {check: {'digest', 'off', 'err', 'tol', 'abs', 'rel', 'at', 'value', 'ref'}}, 'error',
    'internal', 'unread'}] (numerics_rows). Within a group (one model and one software) every result must have
    the same bits, and every result must lie within the tolerance of the fp64 reference. Per check and group:
      - every rank of a group of two or more off the reference: ONE finding about the model or the software,
        no host blamed (the same fault everywhere is not a host's);
      - the only rank of its group off the reference: FAIL naming it, no host blamed (the GPU cannot be told
        from the software with nothing to compare);
      - otherwise each rank off the reference is a culprit, and among the others a strict majority of bits
        names the minority; with no majority (two ranks, a tie), the ranks already culprits by another check
        explain the disagreement, else one FAIL names the ranks that disagree, no host blamed.
    A rank whose check raised a torch error FAILs (its host); the tool's own error is `internal`; a check not
    finished in time WARNs. -> findings; a PASS when every result agrees."""
    rows = sorted(rows or [], key=lambda r: r["rank"])
    if not rows:
        return []
    out, culprits, groups = [], {}, {}
    for r in rows:
        if unjudged := _numerics_unjudged(r, stage):
            out.append(unjudged)
        elif r.get("checks"):
            groups.setdefault(r["group"], []).append(r)
    ties = []
    for group, rs in groups.items():
        for c in _check_order({c for r in rs for c in r["checks"]}):
            have = [r for r in rs if c in r["checks"]]
            off = [r for r in have if r["checks"][c].get("off")]
            if off and len(off) == len(have):
                out.append(_numerics_all_off(group, c, have, off))
                continue
            for r in off:
                culprits.setdefault(r["rank"], (r, []))[1].append(_off_words(c, r["checks"][c]))
            if tie := _numerics_bits(c, [r for r in have if not r["checks"][c].get("off")], culprits):
                ties.append((group, c, tie))
    # after every check: a tie is explained by culprits of any check
    out += filter(None, [_numerics_tie(group, c, by, culprits) for group, c, by in ties])
    out += _numerics_culprits(culprits, stage)
    if not out:
        out.append(_numerics_pass(groups, stage))
    return out


def _numerics_unjudged(r, stage):
    """The finding of a row whose numbers could not be judged (the tool's error, a torch error on its device,
    a check not finished in time), or None."""
    if r.get("internal"):
        return finding("internal", "FAIL", f"{_who(r)}: the {stage} failed: {r['internal']}: a bug in the "
                       "tool, not a fault of the cluster: no host is blamed", code=EXIT_INTERNAL)
    if r.get("error"):
        return finding("numerics", "FAIL", f"{_who(r)}: the {stage} could not run on its device: "
                       f"{r['error']}: {NUMERICS_ACTION}", [r.get("host")], [r["rank"]], blame="own")
    if r.get("unread") is not None:
        return unlocalised(finding("numerics", "WARN", f"{_who(r)}: the {stage} did not finish within "
                                   f"{r['unread']:g}s: its numbers were not checked", [r.get("host")], [r["rank"]]),
                           "not-collected", "a re-run: the numbers checked in time name their host if wrong")
    return None


def _numerics_all_off(group, c, have, off):
    """Every rank of a group off the reference on check c: the lone rank of its group, or one finding about
    the model or the software; no host blamed."""
    worst = max(off, key=lambda r: r["checks"][c].get("err") or 0)
    p = worst["checks"][c]
    if len(have) == 1:
        return finding("numerics", "FAIL", f"{_who(worst)}: {_off_words(c, p)}; the only rank of its model and "
                       f"software ({group}) in this run, so its device cannot be told from the software: run dcgmi "
                       f"diag -r 3 on {worst.get('host')}, or run with a second device of the model; no host blamed",
                       ranks=[worst["rank"]], blame="tie")
    same = len({r["checks"][c].get("digest") for r in have}) == 1
    return finding("numerics", "FAIL", f"every one of the {len(have)} rank(s) of {group} computes "
                   f"{c} ({NUMERICS_WHAT.get(c, c)}) off the fp64 reference"
                   + (" with the same bits" if same else ", and their bits differ")
                   + f" (worst: {_ranks_words([worst])}: {_off_words(c, p, True)}): a fault of the software "
                   "(torch, CUDA, cuBLAS, driver) or of the model, not of a host: no host blamed; "
                   "report it with this line, and try another software version",
                   ranks=[r["rank"] for r in have], blame="everyone")


def _numerics_culprits(culprits, stage):
    """One FAIL per culprit rank {rank: (row, [what it got wrong])}, at most NUMERICS_LIST_MAX, then one for
    the rest."""
    out = []
    items = sorted(culprits.values(), key=lambda x: x[0]["rank"])
    for r, texts in items[:NUMERICS_LIST_MAX]:
        action = NUMERICS_ACTION if r.get("uuid") or r.get("device") is not None else NUMERICS_CPU_ACTION
        out.append(finding("numerics", "FAIL", f"{_who(r)} computes wrong numbers in the {stage}: "
                           + "; ".join(texts) + f": {action}", [r.get("host")], [r["rank"]],
                           blame=_culprit_blame(texts)))
    if len(items) > NUMERICS_LIST_MAX:
        rest = [r for r, _ in items[NUMERICS_LIST_MAX:]]
        out.append(finding("numerics", "FAIL", f"and {len(rest)} more rank(s) compute wrong numbers in the {stage}: "
                           f"{_ranks_words(rest)}: see the JSON's ranks[].numerics", [r.get("host") for r in rest],
                           [r["rank"] for r in rest],
                           blame=_culprit_blame([t for _, ts in items[NUMERICS_LIST_MAX:] for t in ts])))
    return out


def _culprit_blame(texts):
    """The evidence a culprit's texts stand on: off the fp64 reference its peers meet ('reference'), else bits
    unlike a strict majority of its peers ('majority')."""
    return "reference" if any("off the fp64 reference" in t for t in texts) else "majority"


def _numerics_pass(groups, stage):
    """The PASS of groups {group: [rows]} that agree and lie within the tolerance."""
    judged = [r for rs in groups.values() for r in rs]
    names = _check_order({c for r in judged for c in r["checks"]})
    worst = max((r["checks"][c].get("err") or 0) / r["checks"][c]["tol"] for r in judged for c in r["checks"]
                if r["checks"][c].get("tol"))
    return finding("numerics", "PASS", f"{stage}: {len(judged)} rank(s) in {len(groups)} group(s) of model "
                   f"and software agree bit for bit on {', '.join(names)}, each within the tolerance of "
                   f"the fp64 reference (worst {worst:.2g} of it)")


def _bits_words(c, r, agree):
    p = r["checks"][c]
    ratio = _n((p.get("err") or 0) / p["tol"]) if p.get("tol") else "?"
    return (f"{c} ({NUMERICS_WHAT.get(c, c)}): its bits differ from those of the {agree} other rank(s) of its model "
            f"and software, which agree; its largest deviation from fp64 is {_n(p.get('abs'))} at element "
            f"({', '.join(map(str, p.get('at') or []))}), within the tolerance ({ratio} of it)")


def judge_numerics_records(records):
    """judge_numerics of the telemetry's numerics (the records gathered at telemetry), [] when no rank has one."""
    return judge_numerics(numerics_rows(records))


def judge_ddp_grads(records, results):
    """judge_numerics of the DDP step's local gradients (each rank's results['grads_local'], posted with its
    results), [] when no rank checked them."""
    software = {rec["rank"]: (rec.get("numerics") or {}).get("software") for rec in records}
    posts = {res["rank"]: {"checks": {"ddp-grad": res["grads_local"]}, "software": software.get(res["rank"])}
             for res in results or [] if isinstance(res.get("grads_local"), dict)}
    return judge_numerics(numerics_rows(records, posts), "DDP step's local backward (before the all-reduce)")


def judge_numerics_soak(rows):
    """--soak: a rank whose repeats of the numerics under load differed from its own first result FAILs under
    'numerics' (an intermittent fault), naming it; every rank that repeated differing: one finding without a
    host (the software is not deterministic). rows: the soak's rows (judge_soak's) with numerics_repeats,
    numerics_mismatches, numerics_first_bad. [] when no row repeated."""
    done = [r for r in rows or [] if r.get("numerics_repeats")]
    if not done:
        return []
    bad = [r for r in done if r.get("numerics_mismatches")]
    if not bad:
        return [finding("numerics", "PASS", f"soak: {sum(r['numerics_repeats'] for r in done)} repeat(s) of the "
                        f"bf16 and fp32 matmuls on {len(done)} rank(s) under sustained load, each identical to its "
                        "own first result")]

    def first(r):
        fb = (r.get("numerics_first_bad") or [{}])[0]
        return (f"first at {fb.get('t')}s: {fb.get('check')}, max abs difference {_n(fb.get('abs'))} at element "
                f"({', '.join(map(str, fb.get('at') or []))})") if fb else "no detail"
    if len(bad) == len(done) > 1:
        return [finding("numerics", "FAIL", f"soak: every one of the {len(done)} rank(s) gave results under sustained "
                        f"load whose bits differ from its own first result ({_ranks_words(bad)}; {first(bad[0])}): "
                        "the software is not deterministic here, not a host's fault: no host blamed",
                        ranks=[r["rank"] for r in bad], blame="everyone")]
    return [finding("numerics", "FAIL", f"{_who(r)}: under sustained load (--soak) {r['numerics_mismatches']} of "
                    f"{r['numerics_repeats']} repeat(s) of its matmuls differed from its own first result "
                    f"({first(r)}): an intermittent fault: {NUMERICS_ACTION}", [r.get("host")], [r["rank"]],
                    blame="own") for r in bad]
