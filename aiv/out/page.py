"""Floor 4: --html: one self-contained page per run (inline SVG, no external resources)."""
import functools
import html
import itertools
import math

from ..core.base import _screen_key, _screen_sorted, compress_hostlist, group_by
from ..core.deadlines import PHASES
from ..screen.gpu import band_level, gpu_levels, gpu_refs, judging_lines
from ..screen.judge import _intra_class, _intra_class_text, _screen_hca, intra_levels, screen_diagnose
from ..screen.plan import _s3, screen_fractions
from .render import action_lines

# One self-contained page of the run (--html): the verdict, findings, topology, per-GPU bars, per-rail
# heat maps and the phase timeline, as inline SVG drawn here; every text from the state is escaped.
HTML_CSS = """
body{font:14px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;margin:0;background:#f4f6f9;color:#1d2430}
main{max-width:1180px;margin:0 auto;padding:18px 22px 40px}
h2{font-size:17px;margin:26px 0 8px;border-bottom:1px solid #d5dbe3;padding-bottom:4px}
h3{font-size:14px;margin:12px 0 4px}
.card{background:#fff;border:1px solid #dde3ea;border-radius:8px;padding:12px 16px;margin:8px 0}
#verdict{display:flex;gap:22px;align-items:center;color:#fff;border-radius:10px;padding:16px 22px}
#verdict.PASS{background:#1f8a4c}#verdict.FAIL{background:#c23030}
#verdict .big{font-size:44px;font-weight:800;letter-spacing:2px}
#verdict dl{display:grid;grid-template-columns:auto auto auto auto;gap:2px 14px;margin:0}
#verdict dt{opacity:.8}#verdict dd{margin:0;font-weight:600}
pre,code{font:12px/1.4 ui-monospace,SFMono-Regular,Menlo,monospace}
pre{white-space:pre-wrap;word-break:break-word;background:#fbf3f3;border-left:4px solid #c23030;
padding:8px 10px;margin:6px 0}
pre.cmd{background:#f3f5f9;border-left-color:#5465ff}
table{border-collapse:collapse;width:100%}
td,th{text-align:left;vertical-align:top;padding:4px 8px;border-bottom:1px solid #eef1f5}
.st{font-weight:700;border-radius:4px;padding:1px 6px;color:#fff;font-size:12px}
.st.FAIL{background:#c23030}.st.WARN{background:#d18b00}.st.PASS{background:#1f8a4c}
.chip{display:inline-block;background:#fde7e7;color:#8a1414;border-radius:4px;padding:0 6px;
margin:2px 3px 0 0;font:12px ui-monospace,monospace}
.muted{color:#6b7685}.small{font-size:12px}
.nodes{display:grid;grid-template-columns:repeat(auto-fill,minmax(150px,1fr));gap:6px}
.node{background:#fff;border:1px solid #dde3ea;border-radius:6px;padding:4px 7px;font-size:12px}
.node b{font:600 12px ui-monospace,monospace}.node.FAIL{border:2px solid #c23030;background:#fff4f4}
.node.WARN{border:2px solid #d18b00;background:#fffaf0}
.gpus{display:flex;flex-wrap:wrap;gap:2px;margin-top:3px}.g{width:14px;height:14px;border-radius:2px;display:inline-block}
.dots{display:flex;flex-wrap:wrap;gap:2px;margin:6px 0}
.dots i{width:8px;height:8px;border-radius:1px;display:inline-block}
.OK{background:#3aa76d}.WARN.g,.dots .WARN{background:#e3a008}.FAIL.g,.dots .FAIL{background:#d43d3d}
.NA{background:#c5ccd6}
svg text{font:11px system-ui,sans-serif;fill:#4a5563}svg .lab{font:10px ui-monospace,monospace;fill:#1d2430}
.b-OK{fill:#3aa76d}.b-WARN{fill:#e3a008}.b-FAIL{fill:#d43d3d}.b-NA{fill:#c5ccd6}.rng-top{fill:#1d2430}
.chart{overflow-x:auto}.tick{stroke:#e3e8ee}.unit{font-weight:600}
svg .val{font:600 10px ui-monospace,monospace;fill:#1d2430;paint-order:stroke;stroke:#fff;stroke-width:3px}
svg .val.v-FAIL{fill:#a11616}
.jl{stroke-width:1.4}.lead{stroke:#aab3bf;stroke-width:.8}.j-ref,.j-row{stroke:#1d2430}.j-warn{stroke:#d18b00;
stroke-dasharray:5 3}.j-fail{stroke:#d43d3d;stroke-dasharray:5 3}.j-floor{stroke:#a11616;stroke-width:2}
.j-band{stroke:#7a3fd1;stroke-dasharray:2 2;stroke-width:1.8}.j-row{stroke-dasharray:8 3 2 3}
svg text.jlab{font:11px system-ui,sans-serif;stroke:none}svg text.j-warn{fill:#9a6700}svg text.j-fail,
svg text.j-floor{fill:#a11616}svg text.j-band{fill:#5b2ca0}svg text.j-ref,svg text.j-row{fill:#1d2430}
.brk{fill:none;stroke:#1d2430;stroke-width:1.4}svg .brk-t{font-style:italic}
svg .cv{font:9px ui-monospace,monospace;fill:#fff}svg .cv.c-k1,svg .cv.c-k2{fill:#1d2430}
.k0{fill:#1f8a4c;background:#1f8a4c}.k1{fill:#7cc79a;background:#7cc79a}.k2{fill:#e3a008;background:#e3a008}
.k3{fill:#d43d3d;background:#d43d3d}.k4{fill:#5a0d0d;background:#5a0d0d}
.hm{background:#fff;border:1px solid #dde3ea;border-radius:6px;padding:6px}.hm svg{display:block}
.hms{display:flex;flex-wrap:wrap;gap:10px}.culprit{fill:rgba(176,0,32,.07);stroke:#b00020;stroke-width:1.6}
.suspect{fill:none;stroke:#5465ff;stroke-width:1.6;stroke-dasharray:3 2}.grid{fill:#f7f9fb;stroke:#e3e8ee}
.ph{fill:#5b8def}.ph.s{fill:#8e6bd8}.legend i{display:inline-block;width:11px;height:11px;margin:0 3px 0 10px;
vertical-align:-1px;border-radius:2px}
details summary{cursor:pointer;color:#3a4656}
"""


def _html_e(x):
    """HTML-escaped text of any value (None: '')."""
    return html.escape("" if x is None else str(x), quote=True)


def _html_n(x, nd=1):
    """A number as short text ('-' when missing)."""
    return "-" if x is None else f"{float(x):.{nd}f}"


def _html_hosts(hosts, limit=64):
    """Hosts as escaped chips, the first `limit` of them, then a count."""
    hosts = list(hosts or [])
    chips = "".join(f'<span class="chip">{_html_e(h)}</span>' for h in hosts[:limit])
    more = f' <span class="muted">and {len(hosts) - limit} more</span>' if len(hosts) > limit else ""
    return f'<span class="hostl">{chips}{more}</span>' if hosts else '<span class="muted">none</span>'


def _html_section(sid, title, inner):
    """A section of the page: its id, its heading, its content on a card."""
    return f'<section id="{sid}"><h2>{title}</h2><div class="card">{inner}</div></section>'


def _html_verdict(state):
    """The verdict banner: PASS/FAIL, exit code, time, host, world size."""
    v = "PASS" if state.get("verdict") == "PASS" else "FAIL"
    facts = [(k, f"{_html_n(state.get(key))} s" if key == "elapsed_s" else state.get(key)) for k, key in (
        ("exit code", "exit_code"), ("started", "started_at"), ("host", "host"), ("world size", "world_size"),
        ("backend", "backend"), ("elapsed", "elapsed_s"), ("tool", "version"), ("ranks reported", "ranks_reported"))]
    dl = "".join(f"<dt>{_html_e(k)}</dt><dd>{_html_e(x)}</dd>" for k, x in facts if x is not None)
    return f'<section id="verdict" class="{v}"><div class="big">{v}</div><dl>{dl}</dl></section>'


def _html_findings(state):
    """The FAILURE lines, every WARN/FAIL finding with its hosts, the PASS ones folded away."""
    fails = "".join(f"<pre>{_html_e(x)}</pre>" for x in state.get("failures") or [])
    rows, passed = [], []
    for f in state.get("findings") or []:
        st = f.get("status") if f.get("status") in ("PASS", "WARN", "FAIL") else "FAIL"
        row = (f'<tr><td><span class="st {st}">{st}</span></td><td><code>{_html_e(f.get("check"))}</code></td>'
               f'<td>{_html_e(f.get("reason"))}</td><td>{_html_hosts(f.get("hosts"), 16)}</td></tr>')
        (passed if st == "PASS" else rows).append(row)
    head = "<tr><th>status</th><th>check</th><th>reason</th><th>hosts</th></tr>"
    body = f"<table>{head}{''.join(rows)}</table>" if rows else '<p class="muted">no WARN or FAIL finding</p>'
    folded = (f"<details><summary>{len(passed)} passing check(s)</summary><table>{''.join(passed)}</table></details>"
              if passed else "")
    return f'<section id="findings"><h2>Findings</h2>{fails}<div class="card">{body}{folded}</div></section>'


def _html_actions(state):
    """Culprits (failed_hosts), the exclude list, suspect links and the drain command."""
    findings, exclude = state.get("findings") or [], state.get("exclude") or ""
    cmd, drain = state.get("drain_command") or "", state.get("drain") or {}
    lk = "".join(f"<li><code>{_html_e(' - '.join(map(str, s.get('hosts') or [])))}</code> rail {_html_e(s.get('rail'))}"
                 f": {_html_n(s.get('busbw'))} GB/s ({_html_n(s.get('ratio'), 2)} of the rail's reference)</li>"
                 for s in state.get("suspect_links") or [])
    dtext = "drained" if drain.get("done") else f"recommended (--drain {_html_e(drain.get('mode'))})"
    skipped = drain.get("skipped") if drain.get("mode") not in (None, "off") else None
    unl = "".join(f"<li>{_html_e(f['check'])}: {_html_e(f['unlocalised']['why'])}; to localise it: "
                  f"{_html_e(f['unlocalised']['localise'])}"
                  + (f" (involves {_html_e(compress_hostlist(f['involved']))}, none of them blamed)"
                     if f.get("involved") else "") + "</li>"
                  for f in findings if f["status"] == "FAIL" and f.get("unlocalised"))
    todo = "".join(f"<li>{_html_e(a)}</li>" for a in action_lines(findings))
    parts = [f'<p><b>Failed hosts:</b> <span id="culprits">{_html_hosts(state.get("failed_hosts"), 256)}</span></p>',
             "<p><b>Exclude:</b> " + (f'<code id="exclude">{_html_e(exclude)}</code>' if exclude
                                      else '<span class="muted">-</span>') + "</p>",
             unl and f'<p><b>Not localised</b> (these FAILs name no host):</p><ul id="unlocalised">{unl}</ul>',
             lk and f'<p><b>Suspect links</b> (the path, not either node):</p><ul id="suspect-links">{lk}</ul>',
             todo and f'<p><b>What to do</b>:</p><ul id="finding-actions">{todo}</ul>',
             cmd and f'<p><b>Drain</b> ({dtext}):</p><pre class="cmd" id="drain">{_html_e(cmd)}</pre>',
             skipped and f'<p class="muted small">Drain: nothing drained: {_html_e(skipped)}</p>']
    return _html_section("actions", "Culprits and actions", "".join(p for p in parts if p))


def _html_numerics(state, limit=64):
    """The numerics check: per rank its worst error against the fp64 reference as a fraction of the tolerance,
    the ranks a numerics FAIL names first (then the worst, up to `limit`); nothing when no rank carries it."""
    named = {r for f in state.get("findings") or [] if f.get("check") == "numerics" and f.get("status") == "FAIL"
             for r in f.get("ranks") or []}
    rows = []
    for r in state.get("ranks") or []:
        checks = (r.get("numerics") or {}).get("checks") or {}
        ratios = {c: p["err"] / p["tol"] for c, p in checks.items() if p.get("tol") and p.get("err") is not None}
        if checks:
            worst = max(ratios, key=ratios.get) if ratios else None
            rows.append((r.get("rank") not in named, -(ratios.get(worst) or 0), r, worst, ratios.get(worst)))
    if not rows:
        return ""
    rows.sort(key=lambda x: (x[0], x[1], x[2].get("rank", 0)))
    body = "".join(
        f'<tr><td>{_html_e(r.get("rank"))}</td><td><code>{_html_e(r.get("host"))}</code></td>'
        f'<td><code>{_html_e((r.get("gpu") or {}).get("uuid") or "CPU")}</code></td><td>{_html_e(worst)}</td>'
        f'<td>{_html_n(ratio, 3)}</td><td>' + ('<span class="st FAIL">named</span>' if not clean else "") + "</td></tr>"
        for clean, _, r, worst, ratio in rows[:limit])
    more = f'<p class="muted small">and {len(rows) - limit} more rank(s)</p>' if len(rows) > limit else ""
    return _html_section("numerics", "Numerics", '<p class="muted small">Each rank\'s largest error against the fp64 '
                         'reference, as a fraction of the tolerance (1 or more: off the reference); "named": a '
                         'numerics FAIL names the rank (bits unlike its peers\', or off the reference).</p><table>'
                         "<tr><th>rank</th><th>host</th><th>GPU</th><th>worst check</th><th>error / tolerance</th>"
                         f"<th></th></tr>{body}</table>{more}")


def _html_nccl_view(state, limit=64):
    """NCCL's own view beside ours, where a finding carries one (a collective that did not finish on NCCL):
    per rank what we saw and what NCCL's RAS said, differences first; nothing otherwise."""
    views = [f["nccl_view"] for f in state.get("findings") or [] if isinstance(f.get("nccl_view"), dict)]
    if not views:
        return ""
    v, hosts = views[0], {r.get("rank"): r.get("host") for r in state.get("ranks") or []}
    rows = sorted(((int(r), x) for r, x in (v.get("ranks") or {}).items()),
                  key=lambda y: (y[1].get("agree", True), y[0]))
    body = "".join(f'<tr><td>{r}</td><td><code>{_html_e(hosts.get(r))}</code></td><td>{_html_e(x.get("ours"))}</td>'
                   f'<td>{_html_e(x.get("nccl"))}</td><td>{_html_e(x.get("count"))}</td><td>'
                   + ("" if x.get("agree") else '<span class="st WARN">differs</span>') + "</td></tr>"
                   for r, x in rows[:limit])
    head = "<tr><th>rank</th><th>host</th><th>ours</th><th>NCCL's</th><th>collectives (NCCL)</th><th></th></tr>"
    table = f"<table>{head}{body}</table>" if body else ""
    return _html_section("nccl-view", "NCCL's own view", f"<p>{_html_e(v.get('words'))}</p>{table}")


def _html_worst(levels):
    """The worst of 'FAIL', 'WARN', 'OK' (None/empty: 'NA')."""
    levels = set(levels)
    return next((x for x in ("FAIL", "WARN", "OK") if x in levels), "NA")


def _html_gpu_cell(r, gl):
    """One GPU square of a node card, coloured by its worst screen level."""
    g = r.get("gpu") or {}
    lv = gl.get(r.get("rank"), {})
    vals = " ".join(f"{_html_n(lv[m][0])} {u} ({_html_n(lv[m][1], 2)})"
                    for m, u in (("tflops", "TFLOPS"), ("hbm_gbps", "GB/s")) if m in lv)
    tip = (f"rank {r.get('rank')}, local rank {r.get('local_rank')}, {g.get('name') or r.get('model') or 'no GPU'} "
           f"{g.get('uuid') or r.get('uuid') or ''} {vals}")
    return f'<i class="g {_html_worst(x[2] for x in lv.values())}" title="{_html_e(tip)}"></i>'


def _html_node_card(host, recs, flag, gl):
    """A node: name, rank range, its GPUs."""
    ranks = sorted(r.get("rank") for r in recs if r.get("rank") is not None)
    span = f"ranks {ranks[0]}-{ranks[-1]}" if len(ranks) > 1 else (f"rank {ranks[0]}" if ranks else "")
    cells = "".join(_html_gpu_cell(r, gl) for r in recs)
    return (f'<div class="node {flag or ""}" data-host="{_html_e(host)}"><b>{_html_e(host)}</b> '
            f'<span class="muted">{span}</span><div class="gpus">{cells}</div></div>')


def _html_topology(state, gl):
    """Nodes with their ranks and GPUs; beyond 64 nodes a dot per node, and cards for the flagged ones."""
    recs = state.get("ranks") or ((state.get("screen") or {}).get("gpu")) or []  # else the screen's GPU rows
    nodes = group_by(sorted(recs, key=lambda r: (_screen_key(r.get("host")), r.get("local_rank") or 0)),
                     lambda r: r.get("host"))  # {host: [rank record, ...]} in natural order
    if not nodes:
        return ""
    # flagged nodes, {host: 'FAIL'|'WARN'}: the hosts the gated WARN/FAIL findings name (blame_gate), the same as
    # failed_hosts for the FAILs. A suspect link colours no node: it is the path's (the pair view).
    named = [(h, f["status"]) for f in state.get("findings") or [] if f.get("status") in ("WARN", "FAIL")
             for h in f.get("hosts") or []]
    flags = {h: _html_worst(st) for h, st in group_by(named, lambda x: x[0], lambda x: x[1]).items()}
    rpn = sorted({len(v) for v in nodes.values()})
    models = sorted({(r.get("gpu") or {}).get("name") or r.get("model") or "no GPU" for v in nodes.values() for r in v})
    head = (f'<p>{len(nodes)} node(s), {sum(map(len, nodes.values()))} rank(s), {"/".join(map(str, rpn))} per node; '
            f'{_html_e(", ".join(models))}; {len(flags)} flagged</p>')
    if len(nodes) <= 64:
        cards = "".join(_html_node_card(h, v, flags.get(h), gl) for h, v in nodes.items())
        return f'<section id="topology"><h2>Topology</h2>{head}<div class="nodes">{cards}</div></section>'
    dots = "".join(f'<i class="{flags.get(h, "OK")}" title="{_html_e(h)}"></i>' for h in nodes)
    flagged = [h for h in nodes if h in flags][:64]
    cards = "".join(_html_node_card(h, nodes[h], flags[h], gl) for h in flagged)
    more = f'<p class="muted">and {len(flags) - 64} more flagged</p>' if len(flags) > 64 else ""
    return (f'<section id="topology"><h2>Topology</h2>{head}<div class="dots">{dots}</div>'
            f'<h3>Flagged nodes</h3><div class="nodes">{cards or "<span class=muted>none</span>"}</div>{more}'
            '</section>')


GPU_BARS_MAX = 512      # up to this many GPUs of one model a chart has one labelled bar each; beyond, a column
                        # per node (the range of its GPUs) and a labelled bar per GPU below a line
FLAGGED_BARS_MAX = 64   # ... at most this many of those (the lowest first), then a count
BREAK_RATIO = 2.0       # a line this far above every value and every reference is drawn above a broken axis


def _html_step(top, ticks=5):
    """A round tick step (1, 2 or 5 x 10^k, any k) giving about `ticks` ticks from 0 to top."""
    raw = max(top, 1e-12) / ticks
    mag = 10 ** math.floor(math.log10(raw))
    return next(m * mag for m in (1, 2, 5, 10) if m * mag >= raw)


def _html_label_ys(ys, lo, hi, gap=12.0):
    """Label positions for lines at ys: each as near its line as it can be, at least `gap` apart, within [lo, hi]."""
    order = sorted(range(len(ys)), key=lambda i: ys[i])
    out = [0.0] * len(ys)
    prev = lo - gap
    for i in order:
        out[i] = prev = max(ys[i], prev + gap)
    over = prev - hi  # pushed past the bottom: move the whole stack up as far as it needs
    return [y - over for y in out] if over > 0 else out


def _html_scale(vals, lines):
    """The judging lines drawn to scale, those far above every value and every reference (BREAK_RATIO: off the
    axis), and the axis's top."""
    core = max(vals + [ln["value"] for ln in lines if ln["kind"] not in ("floor", "band")] + [1e-12])
    broken = [ln for ln in lines if ln["value"] > BREAK_RATIO * core]
    shown = [ln for ln in lines if ln not in broken]
    return shown, broken, max([core] + [ln["value"] for ln in shown]) * 1.08


def _html_chart_geometry(bars, lines):
    """Where a chart's parts go: the axis's top and step, each bar's slot, the room for labels, the judging
    lines drawn to scale ('shown') and those above a broken axis ('broken')."""
    vals = [float(v) for _, v, _, _ in bars if v is not None]
    shown, broken, top = _html_scale(vals, lines)
    step = _html_step(top)
    top = math.ceil(top / step - 1e-9) * step
    n = max(len(bars), 1)
    slot = max(16.0, 680.0 / n)
    flat = slot >= 64  # room for labels written across
    name_h = 32 if flat else 10 + 6.2 * max([len(b[0]) for b in bars] + [4])
    val_h = 16 if slot >= 44 else 10 + 6.2 * max([len(_s3(v)) for v in vals] + [1])
    left, right, plot_h = 60, 330, 200
    y0 = 8 + (16 * len(broken) + 22 if broken else 0) + val_h  # the broken axis's lines above the values
    w = slot * n
    return {"top": top, "step": step, "slot": slot, "flat": flat, "name_h": name_h, "val_h": val_h, "left": left,
            "plot_h": plot_h, "y0": y0, "w": w, "broken": broken, "shown": shown,
            "width": left + w + right, "height": y0 + plot_h + name_h + 6}


def _html_chart_y(g, v):
    return g["y0"] + g["plot_h"] * (1 - min(max(float(v), 0.0), g["top"]) / g["top"])


def _html_chart_axis(g, unit):
    left, w, top = g["left"], g["w"], g["top"]
    out = [f'<rect class="grid" x="{left}" y="{g["y0"]:.1f}" width="{w:.1f}" height="{g["plot_h"]}"/>']
    t = 0.0
    while t <= top * (1 + 1e-9):
        yt = _html_chart_y(g, t)
        out.append(f'<line class="tick" x1="{left}" x2="{left + w:.1f}" y1="{yt:.1f}" y2="{yt:.1f}"/>'
                   f'<text x="{left - 5}" y="{yt + 4:.1f}" text-anchor="end">{_s3(t) if t else "0"}</text>')
        t += g["step"]
    out.append(f'<text class="unit" x="{left - 5}" y="{g["y0"] - g["val_h"] + 2:.1f}" text-anchor="end">'
               f'{_html_e(unit)}</text>')
    return out


def _html_chart_bar(g, i, name, v, lv, tip):
    """One bar, its value above it and its name below (across when there is room, else upright)."""
    slot, y0, plot_h = g["slot"], g["y0"], g["plot_h"]
    x, bw = g["left"] + i * slot, max(slot - (2 if slot > 6 else 0), 1.0)
    cx, out = x + slot / 2, []
    if v is None:
        out.append(f'<text class="val na" x="{cx:.1f}" y="{y0 + plot_h - 4:.1f}" text-anchor="middle">n/a</text>')
    else:
        yt = _html_chart_y(g, v)
        yb = min(yt, y0 + plot_h - 1)
        out.append(f'<rect class="bar b-{lv}" x="{x + 1:.1f}" y="{yb:.1f}" width="{bw:.1f}" '
                   f'height="{max(y0 + plot_h - yt, 1):.1f}" data-gpu="{_html_e(name)}" '
                   f'data-value="{float(v):.6g}" data-level="{lv}"><title>{_html_e(tip)}</title></rect>')
        vt, vy = _s3(v), yb - 3
        out.append(f'<text class="val v-{lv}" x="{cx:.1f}" y="{vy:.1f}" text-anchor="middle">{vt}</text>'
                   if slot >= 44 else
                   f'<text class="val v-{lv}" transform="translate({cx + 3.5:.1f},{vy:.1f}) rotate(-90)">'
                   f'{vt}</text>')
    ny = y0 + plot_h + 13
    if g["flat"]:
        host, _, rest = name.partition(" ")
        out.append(f'<text class="lab" x="{cx:.1f}" y="{ny:.1f}" text-anchor="middle">{_html_e(host)}</text>'
                   f'<text class="lab" x="{cx:.1f}" y="{ny + 12:.1f}" text-anchor="middle">{_html_e(rest)}</text>')
    else:
        out.append(f'<text class="lab" transform="translate({cx + 3.5:.1f},{y0 + plot_h + 6:.1f}) rotate(-90)" '
                   f'text-anchor="end">{_html_e(name)}</text>')
    return out


def _html_jline(ln, x1, x2, y, tail, label_x, label_y):
    """A judging line from x1 to x2 at height y (tail: the rest of its tag) and its label (coordinates as text)."""
    return (f'<line class="jl j-{ln["kind"]}" x1="{x1}" x2="{x2}" y1="{y}" y2="{y}" data-kind="{ln["kind"]}" '
            f'data-level="{ln["level"] or "ref"}" data-value="{ln["value"]:.6g}"{tail}',
            f'<text class="jlab j-{ln["kind"]}" x="{label_x}" y="{label_y}">{_html_e(ln["text"])}</text>')


def _html_chart_lines(g):
    """The judging lines: those to scale with their labels kept apart, those above the broken axis, the break."""
    left, w, shown, broken, out = g["left"], g["w"], g["shown"], g["broken"], []
    x2, xl = f"{left + w + 6:.1f}", f"{left + w + 14:.1f}"
    lys = _html_label_ys([_html_chart_y(g, ln["value"]) + 4 for ln in shown], g["y0"] + 4,
                         g["y0"] + g["plot_h"] + g["name_h"])
    for ln, ly in zip(shown, lys, strict=True):
        yl = f'{_html_chart_y(g, ln["value"]):.1f}'
        line, label = _html_jline(ln, left, x2, yl, f'><title>{_html_e(ln["text"])}</title></line>', xl, f"{ly:.1f}")
        out.append(f'{line}<line class="lead" x1="{x2}" x2="{left + w + 12:.1f}" y1="{yl}" y2="{ly - 4:.1f}"/>{label}')
    for k, ln in enumerate(broken):
        tail = f' data-broken="1"><title>{_html_e(ln["text"])}</title></line>'
        out.append("".join(_html_jline(ln, left, x2, 12 + 16 * k, tail, xl, 16 + 16 * k)))
    if broken:  # the break: a zigzag across the axis, and words that say so
        zy = 8 + 16 * len(broken) + 2
        out.append(f'<path class="brk" d="M{left - 8},{zy + 4} l4,-4 l4,8 l4,-8 l4,8 l4,-4"/>'
                   f'<text class="brk-t" x="{left + 14}" y="{zy + 8}">axis broken: the line(s) above lie far above '
                   f'every value (not to scale)</text>')
    return out


def _html_chart(cid, bars, lines, unit, caption):
    """One bar chart on an axis from 0 in the values' unit, every bar labelled with what it measures and its value,
    every line it was judged against drawn and named (judging_lines). bars: [(name, value or None, level, tip)];
    a line far above everything else (BREAK_RATIO) is drawn above a broken axis, clearly marked."""
    g = _html_chart_geometry(bars, lines)
    out = _html_chart_axis(g, unit)
    for i, (name, v, lv, tip) in enumerate(bars):
        out += _html_chart_bar(g, i, name, v, lv, tip)
    out += _html_chart_lines(g)
    width, height = g["width"], g["height"]
    return (f'<h3>{caption}</h3><div class="chart"><svg id="{_html_e(cid)}" class="bars" width="{width:.0f}" '
            f'height="{height:.0f}" viewBox="0 0 {width:.0f} {height:.0f}" role="img">{"".join(out)}</svg></div>')


def _html_ranges(cid, groups, lines, unit, caption):
    """At scale, one column per node: the range of its GPUs' values, on the same axis and lines as _html_chart.
    groups: [(host, [value, ...], worst level)]."""
    shown, over, top = _html_scale([v for _, vs, _ in groups for v in vs], lines)
    left, right, h, w = 60, 330, 160, 700.0
    bw, y = w / max(len(groups), 1), functools.partial(_html_chart_y, {"y0": 8, "plot_h": h, "top": top})
    out = [f'<rect class="grid" x="{left}" y="8" width="{w:.0f}" height="{h}"/>']
    step = _html_step(top)
    out += [f'<text x="{left - 5}" y="{y(i * step) + 4:.1f}" text-anchor="end">{_s3(i * step) if i else 0}</text>'
            for i in range(int(top / step) + 1)]
    for i, (host, vs, lv) in enumerate(groups):  # a bar up to the node's lowest GPU, its range above it
        tip = f"{_html_e(host)}: {_s3(min(vs))}-{_s3(max(vs))} {_html_e(unit)} [{lv}]"
        out.append(f'<rect x="{left + i * bw:.2f}" y="{y(min(vs)):.1f}" width="{max(bw, 0.8):.2f}" '
                   f'height="{max(8 + h - y(min(vs)), 1):.1f}" class="rng b-{lv}" data-gpu="{_html_e(host)}" '
                   f'data-value="{min(vs):.6g}" data-level="{lv}"><title>{tip}</title></rect>'
                   f'<rect x="{left + i * bw:.2f}" y="{y(max(vs)):.1f}" width="{max(bw, 0.8):.2f}" '
                   f'height="{max(y(min(vs)) - y(max(vs)), 1):.1f}" class="rng-top"><title>{tip}</title></rect>')
    every = max(1, len(groups) // 16)
    out += [f'<text class="lab" x="{left + (i + 0.5) * bw:.1f}" y="{h + 22}" text-anchor="middle">'
            f'{_html_e(groups[i][0])}</text>' for i in range(0, len(groups), every)]
    lys = _html_label_ys([y(ln["value"]) + 4 for ln in shown], 12, h + 8)
    out += ["".join(_html_jline(ln, left, f"{left + w + 6:.0f}", f'{y(ln["value"]):.1f}', "/>", f"{left + w + 14:.0f}",
                                f"{ly:.1f}")) for ln, ly in zip(shown, lys, strict=True)]
    note = ("; off the axis: " + "; ".join(_html_e(ln["text"]) for ln in over)) if over else ""
    return (f'<h3>{caption}</h3><p class="muted small">one column per node: the range of its GPUs, in node order '
            f'(node names every {every}){note}</p><div class="chart"><svg id="{_html_e(cid)}" class="ranges" '
            f'width="{left + w + right:.0f}" height="{h + 32}" viewBox="0 0 {left + w + right:.0f} {h + 32}" '
            f'role="img">{"".join(out)}</svg></div>')


def _html_gpu_chart(screen, gl, refs, metric, unit, model=None):
    """One model's chart of one metric: a bar per GPU (its node and local rank, its value) against every line
    that judged it (gpu_refs, judging_lines): its model's peers, the table row, the floor, a manifest band."""
    cpu, bands = bool(screen.get("cpu")), screen.get("bands") or []
    rows = sorted((r for r in screen.get("gpu") or [] if model is None or (r.get("model") or "unknown") == model),
                  key=lambda r: (_screen_key(r.get("host")), r.get("local_rank") or 0))
    if not rows:
        return ""
    model = model or rows[0].get("model") or "unknown"
    ref = gpu_refs(rows, {k: screen.get(k) for k in ("min_tflops", "min_hbm")}, cpu)[(model, metric)]
    fail, warn = screen_fractions("gpu", cpu)
    mine = [b for b in bands if b["band"] == f"gpu.{metric}/{model}"]
    lines = judging_lines(ref["peers"], fail, warn, ref["table"], ref["floor"],
                          "min_tflops" if metric == "tflops" else "min_hbm", mine)
    bars = []
    for r in rows:
        v = gl.get(r.get("rank"), {}).get(metric)
        value = v[0] if v else None
        lv = _html_worst([v[2] if v else "NA", band_level(value, r.get("host"), mine)])
        tip = (f"{r.get('host')} rank {r.get('rank')} local rank {r.get('local_rank')} {r.get('uuid') or ''}: "
               + (f"{_s3(value)} {unit} = {v[1]:.3f} of the reference [{lv}]" if v else "not measured"))
        bars.append((f"{r.get('host')} {'rank' if cpu else 'GPU'} {r.get('local_rank')}", value, lv, tip))  # its label
    slow = [b for b in bars if b[2] in ("FAIL", "WARN")]
    caption = (f"{_html_e(unit)} per {'CPU rank' if cpu else 'GPU'} of {_html_e(model)} <span class=\"muted small\">"
               f"({len(bars)} {'rank' if cpu else 'GPU'}(s), "
               f"{len(slow)} below a line{'; CPU ranks: nothing WARNs' if cpu else ''})</span>")
    slug = "".join(c if c.isalnum() else "-" for c in str(model)).strip("-").lower()
    cid = f"gpu-{metric}" + ("" if len(screen.get("gpu_models") or [model]) == 1 else f"-{slug}")
    if len(bars) <= GPU_BARS_MAX:
        return _html_chart(cid, bars, lines, unit, caption)
    groups = group_by([(r.get("host"), b) for b, r in zip(bars, rows, strict=True) if b[1] is not None],
                      lambda x: x[0], lambda x: x[1])
    flagged = sorted(slow, key=lambda b: b[1] if b[1] is not None else -1.0)
    more = (f'<p class="muted small">and {len(flagged) - FLAGGED_BARS_MAX} more GPU(s) below a line (the JSON and '
            'the report list them)</p>' if len(flagged) > FLAGGED_BARS_MAX else "")
    part = (_html_chart(cid + "-flagged", flagged[:FLAGGED_BARS_MAX], lines, unit,
                        f"{_html_e(unit)} of the GPUs below a line, lowest first") + more if flagged
            else '<p class="muted small">no GPU below a line</p>')
    ranges = [(h, [b[1] for b in bs], _html_worst(["OK"] + [b[2] for b in bs])) for h, bs in groups.items()]
    return _html_ranges(cid, ranges, lines, unit, caption) + part


def _html_gpus(screen, gl, refs):
    """The per-GPU TFLOPS and memory GB/s section: per model and metric one chart."""
    if not screen or not screen.get("gpu"):
        return ""
    models = sorted({r.get("model") or "unknown" for r in screen["gpu"]})
    scr = dict(screen, gpu_models=models)
    charts = "".join(_html_gpu_chart(scr, gl, refs, m, u, model) for model in models
                     for m, u in (("tflops", "TFLOPS"), ("hbm_gbps", "GB/s")))
    return _html_section("gpu-perf", "GPU speed", _html_legend(screen) + charts)


def _html_legend(screen):
    """The bars' colours, and what the lines are."""
    return ('<p class="legend small"><i class="OK"></i>OK<i class="WARN g"></i>WARN<i class="FAIL g"></i>FAIL'
            ' &nbsp; each bar is one measurement, labelled with what it measures and its value; each line is one it '
            'was judged against, named on the right: a bar below a red line FAILs, below an amber one WARNs'
            + (" (CPU ranks share cores: only a collapse FAILs, nothing WARNs)" if screen.get("cpu") else "")
            + "</p>")


def _html_intra(screen):
    """The intra-node busbw section: per class of node (ranks per node, GPU model) a bar per node against the
    lines that judged it (its class's peers, --min-busbw-intra, a manifest band)."""
    rows = [p for p in (screen or {}).get("intra") or [] if p.get("host") is not None]
    if not rows:
        return ""
    cpu, bands = bool(screen.get("cpu")), screen.get("bands") or []
    refs, levels = intra_levels(rows, screen.get("min_busbw_intra"), cpu)
    fail, warn = screen_fractions("net", cpu)
    charts = []
    for k, cls in enumerate(sorted(refs, key=str)):
        mine = [p for p in rows if _intra_class(p) == cls]
        band = [b for b in bands if b["band"] == f"intra.busbw/{cls[0] or 0} ranks"]
        lines = judging_lines(refs[cls], fail, warn, None, screen.get("min_busbw_intra"), "min_busbw_intra", band,
                              "nodes")
        bars = [(str(p["host"]), v, lv, f"{p['host']}: intra-node all_reduce busbw "
                 + (f"{_s3(v)} GB/s [{lv}]" if v is not None else "failed"))
                for p in sorted(mine, key=lambda p: _screen_key(p["host"])) for v in [p.get("busbw")]
                for lv in [_html_worst([levels[p["host"]][0], band_level(v, p["host"], band)])]]
        alone = "" if refs[cls].get("count", 0) >= 2 else "; one node: no peers to judge it against"
        charts.append(_html_chart(f"intra-{k}", bars, lines, "GB/s",
                                  f"intra-node busbw of {_html_e(_intra_class_text(cls))} <span class=\"muted small\">"
                                  f"({len(bars)} node(s){alone})</span>"))
    return _html_section("intra", "Intra-node busbw", _html_legend(screen) + "".join(charts))


CELL_NUMBERS_MIN = 26.0  # a heat-map cell at least this many pixels wide shows its busbw in figures
SLOW_ROWS_MAX = 64       # the table of slow inter-node measurements lists at most this many, lowest first


def _html_rail_marks(pairs, idx, rail, d, c, bad):
    """Measured cells of one rail (upper triangle: row = the first node in natural order), culprit
    crosses and suspect-link boxes."""
    mw, cells, slow, boxes = (c - 1 if c > 6 else 3.0), [], [], []
    ref = d["refs"][rail]["ref"] or 1.0
    lone = set(d["suspect_links"])
    for k, m in enumerate(pairs):
        if m["rail"] != rail:
            continue
        bw = m.get("busbw")
        ratio = None if bw is None else float(bw) / ref
        # the colour: k0/k1 OK (near/below the reference), k2 WARN, k3 FAIL, k4 not measured
        cls = "k4" if ratio is None else {"FAIL": "k3", "WARN": "k2"}.get(d["levels"][k])
        cls = cls or ("k0" if ratio >= 0.97 else "k1")
        tip = f"{' - '.join(m['nodes'])} rail {rail} round {m.get('round')}: {_html_n(bw)} GB/s"
        tip += " (failed)" if ratio is None else f" ({ratio:.2f})"
        ns, w = sorted(idx[n] for n in m["nodes"]), mw if cls in ("k0", "k1") else max(mw, 6.0)
        for a, b in itertools.combinations(ns, 2):
            x, y = 90 + (b + 0.5) * c - w / 2, 90 + (a + 0.5) * c - w / 2
            (cells if w == mw else slow).append(f'<rect x="{x:.1f}" y="{y:.1f}" width="{w:.1f}" height="{w:.1f}" '
                                                f'class="{cls}"><title>{_html_e(tip)}</title></rect>')
            if c >= CELL_NUMBERS_MIN:  # the value itself, where the cell holds it
                cells.append(f'<text class="cv c-{cls}" x="{x + w / 2:.1f}" y="{y + w / 2 + 3:.1f}" '
                             f'text-anchor="middle">{"failed" if bw is None else _s3(bw)}</text>')
            if k in lone:
                boxes.append(f'<rect x="{x - 2:.1f}" y="{y - 2:.1f}" width="{w + 4:.1f}" height="{w + 4:.1f}" '
                             f'class="suspect"><title>suspect link: {_html_e(tip)}</title></rect>')
    t, size = max(c, 3.0), len(idx) * c  # a culprit node's row and column outlined
    crosses = "".join(f'<g class="culprit" data-host="{_html_e(n)}"><title>culprit: {_html_e(n)}</title>'
                      f'<rect class="culprit" x="90" y="{p - t / 2:.1f}" width="{size:.1f}" height="{t:.1f}"/>'
                      f'<rect class="culprit" x="{p - t / 2:.1f}" y="90" width="{t:.1f}" height="{size:.1f}"/></g>'
                      for n in bad for p in [90 + (idx[n] + 0.5) * c])
    return crosses + "".join(cells) + "".join(slow) + "".join(boxes)


def _html_heatmap(pairs, rail, d, failed, size):
    """One rail's node-by-node busbw heat map (an SVG, id heatmap-rail-<rail>)."""
    nodes, ref = d["nodes"], d["refs"][rail]
    idx, c = {n: i for i, n in enumerate(nodes)}, size / max(len(nodes), 1)
    slow = [m for k, m in enumerate(pairs) if m["rail"] == rail and d["levels"][k] != "OK"]
    in_slow = {n for m in slow for n in m["nodes"]}  # outlined: the judge's culprits, failed hosts in a slow pair
    bad = _screen_sorted({n for n, r in d["culprits"] if r == rail} | (in_slow & set(failed)))
    hcas = {n: h for m in pairs if m["rail"] == rail for n in m["nodes"] for h in [_screen_hca(m, n)] if h}
    hca = ", ".join(sorted(set(hcas.values()), key=_screen_key)) or None
    cap = (f"rail {_html_e(rail)}{' (' + _html_e(hca) + ')' if hca else ''}: reference {_html_n(ref['ref'])} GB/s "
           f"({_html_e(ref['how'])} of {ref['count']}), {len(slow)} slow"
           + (f", culprit {_html_e(compress_hostlist(bad))}" if bad else ""))
    step = max(1, len(nodes) // 8) if len(nodes) > 24 else 1  # node names along the top and left: every k-th
    axis = "".join(f'<text class="lab" x="86" y="{p + 3:.1f}" text-anchor="end">{_html_e(nodes[i])}</text>'
                   f'<text class="lab" transform="translate({p + 3:.1f},86) rotate(-60)">{_html_e(nodes[i])}</text>'
                   for i in range(0, len(nodes), step) for p in [90 + (i + 0.5) * c])
    svg = (f'<svg id="heatmap-rail-{_html_e(rail)}" width="{size + 100:.0f}" height="{size + 100:.0f}" '
           f'viewBox="0 0 {size + 100:.0f} {size + 100:.0f}" role="img"><title>{cap}</title>'
           f'<rect class="grid" x="90" y="90" width="{size:.1f}" height="{size:.1f}"/>{axis}'
           f'{_html_rail_marks(pairs, idx, rail, d, c, bad)}</svg>')
    return f'<div class="hm"><div class="small">{cap}</div>{svg}</div>'


def _html_pairs(screen, failed):
    """The inter-node section: one heat map per rail, coloured by the ratio to that rail's reference."""
    pairs = [m for m in (screen or {}).get("pairs") or [] if m.get("nodes") and m.get("rail") is not None]
    if not pairs:
        return ""
    d = screen_diagnose(pairs, screen.get("min_busbw_inter"), bool(screen.get("cpu")))
    n = len(d["nodes"])
    size = max(120.0, min(420.0, 28.0 * n)) if len(d["rails"]) > 1 else max(160.0, min(720.0, 28.0 * n))
    maps = "".join(_html_heatmap(pairs, rail, d, failed, size) for rail in d["rails"])
    cpu, floor = bool(screen.get("cpu")), screen.get("min_busbw_inter")
    fail, warn = screen_fractions("net", cpu)
    rule = (f"FAIL below {fail:.2f} of the rail's reference; CPU ranks: nothing WARNs" if cpu else
            f"WARN below {warn:.2f} of the rail's reference (and 6 spreads below it), FAIL below {fail:.2f}")
    rule += f"; FAIL below --min-busbw-inter {floor:g} GB/s" if floor is not None else ""
    legend = ('<p class="legend small"><i class="k0"></i>OK, at 0.97 of the reference or more<i class="k1"></i>OK'
              '<i class="k2"></i>WARN<i class="k3"></i>FAIL<i class="k4"></i>failed'
              '<i style="border:2px solid #b00020"></i>culprit row/column<i style="border:2px dashed #5465ff"></i>'
              f'suspect link</p><p class="small">Cells: the measured pairs only, each with its busbw in GB/s where the '
              f'cell holds it; {rule}.</p>')
    return _html_section("pairs", "Inter-node busbw per rail",
                         f'{legend}<div class="hms">{maps}</div>{_html_slow_pairs(pairs, d, floor)}')


def _html_slow_pairs(pairs, d, floor):
    """The inter-node measurements below a line, lowest ratio first: nodes, rail, busbw, the rail's reference,
    the ratio, the level (what a heat map too dense for figures cannot show)."""
    slow = sorted((k for k, lv in enumerate(d["levels"]) if lv != "OK"),
                  key=lambda k: (float(pairs[k].get("busbw") or 0.0) / (d["refs"][pairs[k]["rail"]]["ref"] or 1.0)))
    if not slow:
        return '<p class="muted small">no inter-node measurement below a line</p>'
    rows = []
    for k in slow[:SLOW_ROWS_MAX]:
        m, ref, bw = pairs[k], d["refs"][pairs[k]["rail"]], pairs[k].get("busbw")
        below = floor is not None and float(bw or 0.0) < floor
        rows.append(f'<tr><td><span class="st {d["levels"][k]}">{d["levels"][k]}</span></td>'
                    f'<td><code>{_html_e(" - ".join(map(str, m["nodes"])))}</code></td><td>{_html_e(m["rail"])}</td>'
                    f'<td>{"failed" if bw is None else _s3(bw)}</td><td>{_s3(ref["ref"] or 0)} '
                    f'({_html_e(ref["how"])})</td><td>{float(bw or 0.0) / (ref["ref"] or 1.0):.2f}'
                    + (f" (below --min-busbw-inter {floor:g})" if below else "") + "</td></tr>")
    more = (f'<p class="muted small">and {len(slow) - SLOW_ROWS_MAX} more</p>' if len(slow) > SLOW_ROWS_MAX else "")
    return ('<h3>Inter-node measurements below a line</h3><table id="slow-pairs"><tr><th>level</th><th>nodes</th>'
            '<th>rail</th><th>busbw GB/s</th><th>the rail\'s reference GB/s</th><th>ratio</th></tr>'
            f'{"".join(rows)}</table>{more}')


def _html_timeline(state):
    """Horizontal bars, one per phase, on a seconds axis: at phase_starts when given (then only the phases of
    PHASES: the other timings, import_torch or a screen round's group creation, lie inside one of them), else
    the phases end to end in PHASES order."""
    phases, starts = state.get("phases") or {}, state.get("phase_starts") or {}
    spans, t = [], 0.0  # (phase, start, seconds)
    for p in [p for p in PHASES if p in phases] + ([] if starts else [p for p in phases if p not in PHASES]):
        d = float(phases.get(p) or 0.0)
        s = float(starts[p]) if p in starts and starts[p] is not None else t
        spans.append((p, s, d))
        t = max(t, s + d)
    if not spans:
        return ""
    end = max([s + d for _, s, d in spans] + [float(state.get("elapsed_s") or 0.0), 0.001])
    w, rh = 900.0, 18
    rows = [f'<text x="126" y="{y + 12}" text-anchor="end">{_html_e(p)}</text>'
            f'<rect x="{130 + w * s / end:.1f}" y="{y + 2}" width="{max(w * d / end, 1):.1f}" height="13" '
            f'class="ph{" s" if p.startswith("screen") else ""}"><title>{_html_e(p)}: {s:.3f} s + {d:.3f} s</title>'
            f'</rect><text x="{134 + w * (s + d) / end:.1f}" y="{y + 12}">{d:.2f} s</text>'
            for i, (p, s, d) in enumerate(spans) for y in [8 + i * rh]]
    h = 8 + len(spans) * rh
    step = _html_step(end, 6)
    ticks = "".join(f'<line x1="{130 + w * t / end:.1f}" x2="{130 + w * t / end:.1f}" y1="4" y2="{h}" '
                    f'stroke="#e3e8ee"/><text x="{130 + w * t / end:.1f}" y="{h + 14}" text-anchor="middle">{t:g} s'
                    '</text>' for t in (round(i * step, 6) for i in range(int(end / step) + 1)))
    return _html_section("timeline", "Phase timeline", f'<svg width="100%" viewBox="0 0 {w + 200:.0f} {h + 20}" '
                         f'role="img">{ticks}{"".join(rows)}</svg>')


def render_html(state):
    """One run's verdict as a self-contained HTML page (inline CSS and SVG, no script, nothing fetched),
    a pure function of the run's JSON state: verdict, findings, culprits and actions, topology,
    per-GPU speed against the model references, per-rail inter-node busbw heat maps, phase timeline."""
    screen = state.get("screen") or {}
    gl, refs = gpu_levels(screen)
    title = f"{state.get('verdict') or 'FAIL'} - ai-infra-validator - {state.get('host') or ''}"
    body = (_html_verdict(state) + _html_findings(state) + _html_actions(state) + _html_topology(state, gl)
            + _html_gpus(screen, gl, refs) + _html_intra(screen) + _html_numerics(state) + _html_nccl_view(state)
            + _html_pairs(screen, state.get("failed_hosts") or []) + _html_timeline(state))
    return (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>{_html_e(title)}</title>'
            f'<meta name="viewport" content="width=device-width,initial-scale=1"><style>{HTML_CSS}</style></head>'
            f'<body><main>{body}<p class="muted small">ai-infra-validator {_html_e(state.get("version"))}, schema '
            f'{_html_e(state.get("schema_version"))}</p></main></body></html>\n')
