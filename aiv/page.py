"""Floor 4: --html: one self-contained page per run (inline SVG, no external resources)."""
import html

from .base import _screen_key, _screen_sorted, compress_hostlist
from .deadlines import PHASES
from .render import action_lines
from .screen_judge import _screen_hca, gpu_levels, screen_diagnose
from .screen_plan import screen_fractions


# One self-contained page of the run (--html): the verdict, findings, topology, per-GPU bars, per-rail
# heat maps and the phase timeline, as inline SVG drawn here; every text from the state is escaped.
def _html_css():
    """The page's inline style sheet."""
    return """
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
.hostl span,#culprits span{display:inline-block;background:#fde7e7;color:#8a1414;border-radius:4px;padding:0 6px;
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
svg text{font:11px system-ui,sans-serif;fill:#4a5563}svg .lab{font:10px ui-monospace,monospace}
.b-OK{fill:#3aa76d}.b-WARN{fill:#e3a008}.b-FAIL{fill:#d43d3d}.rng{fill:#9fd3b4}
.l-ref{stroke:#1d2430;stroke-width:1}.l-WARN{stroke:#e3a008;stroke-dasharray:5 3}
.l-FAIL{stroke:#d43d3d;stroke-dasharray:5 3}
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


def _html_hosts(hosts, limit=64, cls="hostl"):
    """Hosts as escaped chips, the first `limit` of them, then a count."""
    hosts = list(hosts or [])
    chips = "".join(f"<span>{_html_e(h)}</span>" for h in hosts[:limit])
    more = f' <span class="muted">and {len(hosts) - limit} more</span>' if len(hosts) > limit else ""
    return f'<span class="{cls}">{chips}{more}</span>' if hosts else '<span class="muted">none</span>'


def _html_verdict(state):
    """The verdict banner: PASS/FAIL, exit code, time, host, world size."""
    v = "PASS" if state.get("verdict") == "PASS" else "FAIL"
    facts = [("exit code", state.get("exit_code")), ("started", state.get("started_at")), ("host", state.get("host")),
             ("world size", state.get("world_size")), ("backend", state.get("backend")),
             ("elapsed", f"{_html_n(state.get('elapsed_s'))} s"), ("tool", state.get("version")),
             ("ranks reported", state.get("ranks_reported"))]
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
    failed = state.get("failed_hosts") or []
    exclude = state.get("exclude") or ""
    links = state.get("suspect_links") or []
    lk = "".join(f"<li><code>{_html_e(' - '.join(map(str, s.get('hosts') or [])))}</code> rail {_html_e(s.get('rail'))}"
                 f": {_html_n(s.get('busbw'))} GB/s ({_html_n(s.get('ratio'), 2)} of the rail's reference)</li>"
                 for s in links)
    cmd = state.get("drain_command") or ""
    drain = state.get("drain") or {}
    dtext = ("drained" if drain.get("done") else f"recommended (--drain {_html_e(drain.get('mode'))})") if cmd else ""
    ex = f'<code id="exclude">{_html_e(exclude)}</code>' if exclude else '<span class="muted">-</span>'
    skipped = drain.get("skipped") if drain.get("mode") not in (None, "off") else None
    return ('<section id="actions"><h2>Culprits and actions</h2><div class="card">'
            f'<p><b>Failed hosts:</b> <span id="culprits">{_html_hosts(failed, 256)}</span></p>'
            f'<p><b>Exclude:</b> {ex}</p>'
            + (f'<p><b>Suspect links</b> (the path, not either node):</p><ul id="suspect-links">{lk}</ul>'
               if lk else "")
            + ('<p><b>What to do</b>:</p><ul id="finding-actions">'
               + "".join(f"<li>{_html_e(a)}</li>" for a in action_lines(state.get("findings") or [])) + "</ul>"
               if action_lines(state.get("findings") or []) else "")
            + (f'<p><b>Drain</b> ({dtext}):</p><pre class="cmd" id="drain">{_html_e(cmd)}</pre>' if cmd else "")
            + (f'<p class="muted small">Drain: nothing drained: {_html_e(skipped)}</p>' if skipped else "")
            + "</div></section>")


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
    return ('<section id="numerics"><h2>Numerics</h2><div class="card"><p class="muted small">Each rank\'s largest '
            'error against the fp64 reference, as a fraction of the tolerance (1 or more: off the reference); '
            '"named": a numerics FAIL names the rank (bits unlike its peers\', or off the reference).</p><table>'
            "<tr><th>rank</th><th>host</th><th>GPU</th><th>worst check</th><th>error / tolerance</th><th></th></tr>"
            f"{body}</table>{more}</div></section>")


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
    return (f'<section id="nccl-view"><h2>NCCL\'s own view</h2><div class="card"><p>{_html_e(v.get("words"))}</p>'
            f"{table}</div></section>")


def _html_gpu_levels(screen):
    """gpu_levels (the judge's references and levels), for the page."""
    return gpu_levels(screen)


def _html_worst(levels):
    """The worst of 'FAIL', 'WARN', 'OK' (None/empty: 'NA')."""
    levels = set(levels)
    return next((x for x in ("FAIL", "WARN", "OK") if x in levels), "NA")


def _html_node_levels(state):
    """{host: 'FAIL'|'WARN'} for flagged nodes: failed hosts, hosts of WARN/FAIL findings, suspect links."""
    out = {}
    for s in state.get("suspect_links") or []:
        for h in s.get("hosts") or []:
            out[h] = "WARN"
    for f in state.get("findings") or []:
        if f.get("status") in ("WARN", "FAIL"):
            for h in f.get("hosts") or []:
                out[h] = _html_worst([out.get(h), f["status"]])
    for h in state.get("failed_hosts") or []:
        out[h] = "FAIL"
    return out


def _html_nodes(state):
    """{host: [rank record or screen row, ...]} in natural order (ranks, else the screen's GPU rows)."""
    recs = state.get("ranks") or ((state.get("screen") or {}).get("gpu")) or []
    nodes = {}
    for r in sorted(recs, key=lambda r: (_screen_key(r.get("host")), r.get("local_rank") or 0)):
        nodes.setdefault(r.get("host"), []).append(r)
    return nodes


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
    nodes, flags = _html_nodes(state), _html_node_levels(state)
    if not nodes:
        return ""
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


def _html_gpu_bars(items, lo, hi, w, h):
    """Bars of [(label, ratio, level)] from the bottom of a [lo, hi] ratio axis, one per GPU."""
    bw = w / max(len(items), 1)
    out = []
    for i, (label, ratio, lv) in enumerate(items):
        y = h - h * (min(max(ratio, lo), hi) - lo) / (hi - lo)
        out.append(f'<rect x="{40 + i * bw:.1f}" y="{y:.1f}" width="{max(bw - (bw > 3), 0.6):.1f}" height="{h - y:.1f}"'
                   f' class="b-{lv}"><title>{_html_e(label)}</title></rect>')
    return "".join(out)


def _html_gpu_ranges(groups, lo, hi, w, h):
    """At scale, one column per node: its GPUs' ratio range, flagged GPUs as dots."""
    bw = w / max(len(groups), 1)

    def y(r):
        return h - h * (min(max(r, lo), hi) - lo) / (hi - lo)

    out = []
    for i, (host, items) in enumerate(groups):
        rs = [r for _, r, _ in items]
        x = 40 + i * bw
        out.append(f'<rect x="{x:.1f}" y="{y(max(rs)):.1f}" width="{max(bw, 0.8):.2f}" '
                   f'height="{max(y(min(rs)) - y(max(rs)), 1):.1f}" class="rng"><title>{_html_e(host)}: '
                   f'{min(rs):.3f}-{max(rs):.3f}</title></rect>')
        out += [f'<circle cx="{x + bw / 2:.1f}" cy="{y(r):.1f}" r="3" class="b-{lv}"><title>{_html_e(label)}</title>'
                f'</circle>' for label, r, lv in items if lv != "OK"]
    return "".join(out)


def _html_gpu_chart(screen, gl, refs, metric, unit):
    """One metric's per-GPU ratio chart: reference line at 1.0, the FAIL and WARN fractions dashed."""
    fail, warn = screen_fractions("gpu", bool(screen.get("cpu")))
    rows = sorted(screen.get("gpu") or [], key=lambda r: (_screen_key(r.get("host")), r.get("local_rank") or 0))
    items = [(r.get("host"), f"{r.get('host')} rank {r.get('rank')} local {r.get('local_rank')}: "
              f"{gl[r['rank']][metric][0]:.1f} {unit} = {gl[r['rank']][metric][1]:.3f} of the reference",
              gl[r["rank"]][metric][1], gl[r["rank"]][metric][2]) for r in rows if metric in gl.get(r.get("rank"), {})]
    if not items:
        return ""
    lo = min(min(0.6, fail - 0.1), min(x[2] for x in items) - 0.05)
    hi = max(1.1, max(x[2] for x in items) + 0.02)
    w, h = 1080, 120
    if len(items) <= 512:
        body = _html_gpu_bars([x[1:] for x in items], lo, hi, w, h)
    else:
        groups = {}
        for host, *rest in items:
            groups.setdefault(host, []).append(rest)
        body = _html_gpu_ranges(list(groups.items()), lo, hi, w, h)
    lines = ""
    for frac, cls in ((1.0, "l-ref"), (warn, "l-WARN"), (fail, "l-FAIL")):
        if frac is not None:
            y = h - h * (frac - lo) / (hi - lo)
            lines += (f'<line x1="40" x2="{40 + w}" y1="{y:.1f}" y2="{y:.1f}" class="{cls}"/>'
                      f'<text x="36" y="{y + 4:.1f}" text-anchor="end">{frac:.2f}</text>')
    ref_txt = "; ".join(f"{_html_e(m)}: {_html_n(r['ref'])} {unit} ({_html_e(r['how'])}"
                        + (f" of {r['count']})" if not r["how"].startswith("table") else ")")
                        for (m, k), r in sorted(refs.items()) if k == metric and r["ref"])
    slow = sum(x[3] != "OK" for x in items)
    return (f'<h3>{unit} per GPU <span class="muted small">(ratio to the model reference: {ref_txt}; {slow} slow)'
            f'</span></h3><svg id="gpu-{metric}" width="100%" viewBox="0 0 {w + 44} {h + 6}" preserveAspectRatio="none"'
            f' role="img">{body}{lines}</svg>')


def _html_gpus(screen, gl, refs):
    """The per-GPU TFLOPS and memory GB/s section."""
    if not screen or not screen.get("gpu"):
        return ""
    charts = "".join(_html_gpu_chart(screen, gl, refs, m, u) for m, u in (("tflops", "TFLOPS"), ("hbm_gbps", "GB/s")))
    note = ("one column per node (range of its GPUs; slow GPUs as dots)" if len(screen["gpu"]) > 512
            else "one bar per GPU")
    legend = ('<span class="legend small"><i class="OK"></i>OK<i class="WARN g"></i>WARN<i class="FAIL g"></i>FAIL'
              f' &nbsp; {note}, in node order</span>')
    return f'<section id="gpu-perf"><h2>GPU speed</h2><div class="card">{legend}{charts}</div></section>'


def _html_cell_class(level, ratio):
    """Heat map colour class: k0/k1 OK (near/below the reference), k2 WARN, k3 FAIL, k4 not measured."""
    if ratio is None:
        return "k4"
    return {"FAIL": "k3", "WARN": "k2"}.get(level, "k0" if ratio >= 0.97 else "k1")


def _html_axis(nodes, c):
    """Node-name labels along the top and left of a heat map (every k-th one when there are many)."""
    step = max(1, len(nodes) // 8) if len(nodes) > 24 else 1
    out = []
    for i in range(0, len(nodes), step):
        p = 90 + (i + 0.5) * c
        out.append(f'<text class="lab" x="86" y="{p + 3:.1f}" text-anchor="end">{_html_e(nodes[i])}</text>'
                   f'<text class="lab" transform="translate({p + 3:.1f},86) rotate(-60)">{_html_e(nodes[i])}</text>')
    return "".join(out)


def _html_rail_marks(pairs, idx, rail, d, c, bad):
    """Measured cells of one rail (upper triangle: row = the first node in natural order), culprit
    crosses and suspect-link boxes."""
    mw, cells, slow, boxes = (c - 1 if c > 6 else 3.0), [], [], []
    ref = d["refs"][rail]["ref"] or 1.0
    lone = {i for i in d["suspect_links"]}
    for k, m in enumerate(pairs):
        if m["rail"] != rail:
            continue
        bw = m.get("busbw")
        cls = _html_cell_class(d["levels"][k], None if bw is None else float(bw) / ref)
        tip = f"{' - '.join(m['nodes'])} rail {rail} round {m.get('round')}: {_html_n(bw)} GB/s"
        tip += f" ({float(bw) / ref:.2f})" if bw is not None else " (failed)"
        ns, w = sorted(idx[n] for n in m["nodes"]), mw if cls in ("k0", "k1") else max(mw, 6.0)
        for a, b in ((ns[i], ns[j]) for i in range(len(ns)) for j in range(i + 1, len(ns))):
            x, y = 90 + (b + 0.5) * c - w / 2, 90 + (a + 0.5) * c - w / 2
            (cells if w == mw else slow).append(f'<rect x="{x:.1f}" y="{y:.1f}" width="{w:.1f}" height="{w:.1f}" '
                                                f'class="{cls}"><title>{_html_e(tip)}</title></rect>')
            if k in lone:
                boxes.append(f'<rect x="{x - 2:.1f}" y="{y - 2:.1f}" width="{w + 4:.1f}" height="{w + 4:.1f}" '
                             f'class="suspect"><title>suspect link: {_html_e(tip)}</title></rect>')
    crosses = "".join(_html_cross(idx[n], n, c, len(idx)) for n in bad)
    return crosses + "".join(cells) + "".join(slow) + "".join(boxes)


def _html_cross(i, node, c, n):
    """A culprit node's row and column outlined."""
    t, p, size = max(c, 3.0), 90 + (i + 0.5) * c, n * c
    return (f'<g class="culprit" data-host="{_html_e(node)}"><title>culprit: {_html_e(node)}</title>'
            f'<rect class="culprit" x="90" y="{p - t / 2:.1f}" width="{size:.1f}" height="{t:.1f}"/>'
            f'<rect class="culprit" x="{p - t / 2:.1f}" y="90" width="{t:.1f}" height="{size:.1f}"/></g>')


def _html_rail_bad(pairs, rail, d, failed):
    """Nodes outlined on a rail: the judge's (node, rail) culprits, and failed hosts in a slow measurement there."""
    slow = {n for k, m in enumerate(pairs) if m["rail"] == rail and d["levels"][k] != "OK" for n in m["nodes"]}
    return _screen_sorted({n for n, r in d["culprits"] if r == rail} | (slow & set(failed)))


def _html_heatmap(pairs, rail, d, failed, size):
    """One rail's node-by-node busbw heat map (an SVG, id heatmap-rail-<rail>)."""
    nodes = d["nodes"]
    idx = {n: i for i, n in enumerate(nodes)}
    c = size / max(len(nodes), 1)
    ref = d["refs"][rail]
    bad = _html_rail_bad(pairs, rail, d, failed)
    nslow = sum(1 for k, m in enumerate(pairs) if m["rail"] == rail and d["levels"][k] != "OK")
    hcas = {n: h for m in pairs if m["rail"] == rail for n in m["nodes"] for h in [_screen_hca(m, n)] if h}
    hca = ", ".join(sorted(set(hcas.values()), key=_screen_key)) or None
    cap = (f"rail {_html_e(rail)}{' (' + _html_e(hca) + ')' if hca else ''}: reference {_html_n(ref['ref'])} GB/s "
           f"({_html_e(ref['how'])} of {ref['count']}), {nslow} slow"
           + (f", culprit {_html_e(compress_hostlist(bad))}" if bad else ""))
    svg = (f'<svg id="heatmap-rail-{_html_e(rail)}" width="{size + 100:.0f}" height="{size + 100:.0f}" '
           f'viewBox="0 0 {size + 100:.0f} {size + 100:.0f}" role="img"><title>{cap}</title>'
           f'<rect class="grid" x="90" y="90" width="{size:.1f}" height="{size:.1f}"/>{_html_axis(nodes, c)}'
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
    fail, warn = screen_fractions("net", bool(screen.get("cpu")))
    legend = (f'<span class="legend small"><i class="k0"></i>&ge; 0.97<i class="k1"></i>OK<i class="k2"></i>WARN '
              f'(&lt; {warn or 0:.2f})<i class="k3"></i>FAIL (&lt; {fail:.2f})<i class="k4"></i>failed'
              '<i style="border:2px solid #b00020"></i>culprit row/column<i style="border:2px dashed #5465ff"></i>'
              'suspect link &nbsp; cells: measured pairs only, ratio to the rail\'s reference</span>')
    return (f'<section id="pairs"><h2>Inter-node busbw per rail</h2><div class="card">{legend}'
            f'<div class="hms">{maps}</div></div></section>')


def _html_phase_spans(state):
    """[(phase, start, seconds)]: phase_starts when given (then only the phases of PHASES: the other timings,
    import_torch or a screen round's group creation, lie inside one of them), else the phases end to end in
    PHASES order."""
    phases = state.get("phases") or {}
    starts = state.get("phase_starts") or {}
    order = [p for p in PHASES if p in phases] + ([] if starts else [p for p in phases if p not in PHASES])
    out, t = [], 0.0
    for p in order:
        d = float(phases.get(p) or 0.0)
        s = float(starts[p]) if p in starts and starts[p] is not None else t
        out.append((p, s, d))
        t = max(t, s + d)
    return out


def _html_timeline(state):
    """Horizontal bars, one per phase, on a seconds axis."""
    spans = _html_phase_spans(state)
    if not spans:
        return ""
    end = max([s + d for _, s, d in spans] + [float(state.get("elapsed_s") or 0.0), 0.001])
    w, rh = 900.0, 18
    rows = []
    for i, (p, s, d) in enumerate(spans):
        y = 8 + i * rh
        cls = "ph s" if p.startswith("screen") else "ph"
        rows.append(f'<text x="126" y="{y + 12}" text-anchor="end">{_html_e(p)}</text>'
                    f'<rect x="{130 + w * s / end:.1f}" y="{y + 2}" width="{max(w * d / end, 1):.1f}" height="13" '
                    f'class="{cls}"><title>{_html_e(p)}: {s:.3f} s + {d:.3f} s</title></rect>'
                    f'<text x="{134 + w * (s + d) / end:.1f}" y="{y + 12}">{d:.2f} s</text>')
    h = 8 + len(spans) * rh
    ticks = "".join(f'<line x1="{130 + w * t / end:.1f}" x2="{130 + w * t / end:.1f}" y1="4" y2="{h}" '
                    f'stroke="#e3e8ee"/><text x="{130 + w * t / end:.1f}" y="{h + 14}" text-anchor="middle">{t:g} s'
                    '</text>' for t in _html_ticks(end))
    return (f'<section id="timeline"><h2>Phase timeline</h2><div class="card"><svg width="100%" viewBox="0 0 '
            f'{w + 200:.0f} {h + 20}" role="img">{ticks}{"".join(rows)}</svg></div></section>')


def _html_ticks(end):
    """About six round tick values from 0 to end."""
    raw = end / 6
    step = next(s * m for m in (0.01, 0.1, 1, 10, 100, 1000) for s in (1, 2, 5) if s * m >= raw)
    return [round(i * step, 6) for i in range(int(end / step) + 1)]


def render_html(state):
    """One run's verdict as a self-contained HTML page (inline CSS and SVG, no script, nothing fetched),
    a pure function of the run's JSON state: verdict, findings, culprits and actions, topology,
    per-GPU speed against the model references, per-rail inter-node busbw heat maps, phase timeline."""
    screen = state.get("screen") or {}
    gl, refs = _html_gpu_levels(screen)
    title = f"{state.get('verdict') or 'FAIL'} - ai-infra-validator - {state.get('host') or ''}"
    body = (_html_verdict(state) + _html_findings(state) + _html_actions(state) + _html_topology(state, gl)
            + _html_gpus(screen, gl, refs) + _html_numerics(state) + _html_nccl_view(state)
            + _html_pairs(screen, state.get("failed_hosts") or []) + _html_timeline(state))
    return (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>{_html_e(title)}</title>'
            f'<meta name="viewport" content="width=device-width,initial-scale=1"><style>{_html_css()}</style></head>'
            f'<body><main>{body}<p class="muted small">ai-infra-validator {_html_e(state.get("version"))}, schema '
            f'{_html_e(state.get("schema_version"))}</p></main></body></html>\n')
