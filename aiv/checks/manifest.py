"""Floor 3: the cluster manifest: --save-manifest, --manifest (drift is a finding), --diff-manifest."""
import collections
import json
import math
import re

from ..core.base import (
    CHECKS,
    VERSION,
    compress_hostlist,
    expand_hostlist,
    finding,
    format_ranges,
    group_by,
)
from ..core.blame import unlocalised
from ..core.names import PROBED_PACKAGES
from .judge import _by_host, _import_state, screen_reference

# Accept once, gate forever. --save-manifest PATH writes the state a PASS saw (its WARNs recorded as
# accepted), grouped by node class and keeping the hosts each value was accepted on; --manifest PATH
# judges later runs against it (check `manifest`); --diff-manifest A B prints what changed between two
# files. A class is what a node is, not what a job was given: the node's own GPU count (the driver's
# list), bands keyed by what they depend on (GPU model; ranks per node; rails per pair).
# In memory a class is "expanded": {'hosts': set, 'values': {field: {host: value}}, ...}; on disk each
# field is a list of variants {'value': v, 'hosts': hostlist} (see docs/manifest.md, Schema).
MANIFEST_SCHEMA_VERSION = 2  # 1: classes and bands keyed by the job's GPUs; refused with how to re-save
MANIFEST_TOOL = "ai-infra-validator"
INTRA_TRANSPORTS = ("P2P", "SHM", "NVLS")  # the rest (NET/*, COLLNET) carry the path between nodes
TRANSPORT_RANK = {"NET/Socket": 0, "NET/other": 1, "SHM": 2, "P2P": 3, "NET/IB": 4, "COLLNET": 5, "NVLS": 5}
BAND_MIN_RUNS = 3  # a speed band judges only once this many accepted runs built it (see merge_bands)
BAND_WINDOW = 5    # a band spans the last this many accepted runs (older ones age out; see merge_bands)


def _lower_fails(old, new):
    """A downgrade (below the accepted) FAILs; an upgrade is a change to review (WARN)."""
    try:
        return "FAIL" if new < old else "WARN"
    except TypeError:  # a hand-edited value of another type: not comparable, so not known to be better
        return "FAIL"


def _transport_severity(old, new):
    """FAIL when the path lost its best transport or gained a worse one (NET/IB -> NET/Socket, P2P -> SHM)."""
    o = [TRANSPORT_RANK.get(k, 1) for k in old if isinstance(k, str)] if isinstance(old, list) else []
    n = [TRANSPORT_RANK.get(k, 1) for k in new]
    return "FAIL" if not o or max(n) < max(o) or min(n) < min(o) else "WARN"


# (field, what a finding calls it, severity of a change: FAIL, WARN or a function of old, new), in listing order.
MANIFEST_FIELDS = (
    ("driver", "driver", "FAIL"), ("cuda", "CUDA", "FAIL"), ("nccl", "NCCL", "FAIL"),
    ("torch", "torch", "FAIL"), ("gpu_model", "GPU model", "FAIL"),
    ("gpus_per_node", "GPUs per node", "FAIL"), ("gpu_memory", "GPU memory", "FAIL"),
    ("ib_ports", "IB port count", "FAIL"), ("ib_rate", "IB rate", "FAIL"),
    ("pcie_width", "PCIe link width", _lower_fails), ("pcie_speed", "PCIe link speed", _lower_fails),
    ("transport_intra", "NCCL transport within the node", _transport_severity),
    ("transport_inter", "NCCL transport between nodes", _transport_severity),
    ("torchvision", "torchvision", "WARN"), ("torchaudio", "torchaudio", "WARN"),
    ("python", "Python", "WARN"), ("kernel", "kernel", "WARN"), ("os", "OS", "WARN"),
    ("ib_state", "IB port state", "WARN"), ("ifaces", "interfaces", "WARN"),
    ("env", "environment", "WARN"),
)
FIELD_NAMES = tuple(f[0] for f in MANIFEST_FIELDS)


def _low(values):
    return min((v for v in values if v is not None), default=None)


def _gpu_fields(rs, node, load):
    """GPU fields of a node: its own GPU count from the driver's list (else the most its ranks could
    see), each model's memory, the PCIe link read under load by the screen (load: {rank: screen row})."""
    gs = [r["gpu"] for r in rs if r.get("gpu")]
    if not gs:
        return dict.fromkeys(("gpu_model", "gpus_per_node", "gpu_memory", "pcie_width", "pcie_speed"))
    distinct = {g.get("uuid") or g.get("pci") or i for i, g in enumerate(gs)}
    sized = [g for g in gs if isinstance(g.get("vram"), int) and g["vram"] > 0]
    memory = {m: max(vs) for m, vs in group_by(sized, lambda g: str(g.get("name")), lambda g: g["vram"]).items()}
    links = [load[r["rank"]] for r in rs if r.get("rank") in load]
    return {"gpu_model": "+".join(sorted({str(g.get("name")) for g in gs})),
            "gpus_per_node": node.get("gpus_driver") or max(len(distinct), node.get("gpus_visible") or 0),
            "gpu_memory": memory or None,
            "pcie_width": _low(x.get("pcie_width") for x in links),
            "pcie_speed": _low(x.get("pcie_speed") for x in links)}


def _node_fields(node):
    ib, imports = node.get("ib"), node.get("imports") or {}
    active = [p["rate_gbps"] for p in ib or [] if p.get("state") == "ACTIVE" and p.get("rate_gbps")]
    down = [f"{p.get('port')} {p.get('state')}" for p in ib or [] if p.get("state") != "ACTIVE"]
    return {"driver": node.get("driver"), "kernel": node.get("kernel"), "os": node.get("os"),
            "ib_ports": len(ib) if ib is not None else None, "ib_rate": min(active) if active else None,
            "ib_state": (", ".join(down) or "all ACTIVE") if ib else None,
            "ifaces": sorted(node["ifaces"]) if node.get("ifaces") is not None else None,
            "env": node.get("env"),
            **{name: (None if _import_state(imports.get(name)) == "-" else _import_state(imports.get(name)))
               for name in PROBED_PACKAGES}}


def _transport_fields(rs):
    kinds = sorted(set().union(*(r["transport"] for r in rs if r.get("transport") is not None)))
    intra = [k for k in kinds if k in INTRA_TRANSPORTS]
    inter = [k for k in kinds if k not in INTRA_TRANSPORTS]
    return {"transport_intra": intra or None, "transport_inter": inter or None}  # a path not used: unmeasured


def screen_load(screen):
    """{rank: the screen's GPU row} (its PCIe link read under load), {} when the screen did not run."""
    return {g["rank"]: g for g in (screen or {}).get("gpu") or [] if isinstance(g, dict) and "rank" in g}


def host_view(rs, load=None):
    """(fields, class key) of one node from its rank records and the screen's rows (screen_load); a field
    this run did not measure is None."""
    rs = sorted(rs, key=lambda r: r.get("local_rank", 0))
    node = next((r["node"] for r in rs if r.get("node")), {}) or {}
    v = rs[0].get("versions") or {}
    fields = dict(_gpu_fields(rs, node, load or {}), **_node_fields(node), **_transport_fields(rs),
                  **{k: v.get(k) for k in ("torch", "cuda", "nccl", "python")})
    key = {"gpu_model": fields["gpu_model"], "gpus_per_node": fields["gpus_per_node"], "ib_ports": fields["ib_ports"],
           "ib_rate_gbps": max((p["rate_gbps"] for p in node.get("ib") or [] if p.get("rate_gbps")), default=None)}
    return {f: fields[f] for f in FIELD_NAMES}, key


def class_name(key):
    """'NVIDIA H200 x8, IB 8x400G': GPU model x GPUs per node x fabric shape (IB port count and rate)."""
    gpu = f"{key.get('gpu_model')} x{key.get('gpus_per_node')}" if key.get("gpu_model") else "no GPU"
    n = key.get("ib_ports")
    ib = "IB unknown" if n is None else f"IB {n}x{key.get('ib_rate_gbps') or 0:g}G" if n else "no IB"
    return f"{gpu}, {ib}"


def _canon(v):
    return json.dumps(v, sort_keys=True, default=str)


def _hosts_in(x):
    return list(x) if isinstance(x, list) else expand_hostlist(x) if x else []


def _hosts_out(hosts):
    """A Slurm hostlist string when it expands back to exactly these names, else the sorted list."""
    hs = sorted(set(hosts))
    text = compress_hostlist(hs)
    try:
        return text if sorted(expand_hostlist(text)) == hs else hs
    except ValueError:
        return hs


def _hl(hosts):
    return compress_hostlist(sorted(set(hosts))) or "-"


def _expand_class(c):
    values = {field: hv for field, variants in (c.get("fields") or {}).items()
              if (hv := {h: var["value"] for var in variants for h in _hosts_in(var.get("hosts"))})}
    return {"key": c.get("key") or {}, "hosts": set(_hosts_in(c.get("hosts"))), "values": values,
            "runs": c.get("runs", 1), "first_accepted_at": c.get("first_accepted_at"),
            "last_accepted_at": c.get("last_accepted_at"), "bands": c.get("bands") or {}}


def _pack_class(x):
    fields = {}
    for field in sorted(x["values"], key=lambda f: (FIELD_NAMES.index(f) if f in FIELD_NAMES else 99, f)):
        groups = {}
        for h, v in x["values"][field].items():
            groups.setdefault(_canon(v), (v, []))[1].append(h)
        fields[field] = [{"value": v, "hosts": _hosts_out(hs)}
                         for v, hs in sorted(groups.values(), key=lambda g: (-len(g[1]), _canon(g[0])))]
    return {"key": x["key"], "hosts": _hosts_out(x["hosts"]), "runs": x["runs"],
            "first_accepted_at": x["first_accepted_at"], "last_accepted_at": x["last_accepted_at"],
            "fields": fields, "bands": x["bands"]}


def _manifest_doc(classes, written_at, accepted=()):
    return {"schema_version": MANIFEST_SCHEMA_VERSION, "tool": MANIFEST_TOOL, "version": VERSION,
            "written_at": written_at, "classes": {k: _pack_class(x) for k, x in sorted(classes.items()) if x["hosts"]},
            "accepted_warns": list(accepted)}


def manifest_from_records(records, written_at, screen=None, findings=()):
    """The manifest of one accepted run: each node under its class, every measured field per host, the
    class's speed bands from the screen, and the run's WARNs as accepted (accepted_warns)."""
    classes, load = {}, screen_load(screen)
    for h, rs in sorted(_by_host(records).items()):
        fields, key = host_view(rs, load)
        x = classes.setdefault(class_name(key), {"key": key, "hosts": set(), "values": {}, "runs": 1, "bands": {},
                                                 "first_accepted_at": written_at, "last_accepted_at": written_at})
        x["hosts"].add(h)
        for f, v in fields.items():
            if v is not None:
                x["values"].setdefault(f, {})[h] = v
    for cls, bands in screen_bands(screen, records).items():
        if cls in classes:
            classes[cls]["bands"] = bands
    return _manifest_doc(classes, written_at, accepted_warns(findings or (), written_at))


def _band_from(window, runs):
    """A band over its window of accepted runs [{'ref', 'lo', 'hi'}]: lo the lowest, hi the highest, ref the mean."""
    return {"ref": sum(w["ref"] for w in window) / len(window), "lo": min(w["lo"] for w in window),
            "hi": max(w["hi"] for w in window), "runs": runs, "window": window}


def merge_bands(old, new):
    """Bands over a window: {name: {'ref', 'lo', 'hi', 'runs', 'window'}} -> the window holds the last
    BAND_WINDOW accepted runs (a slow run long ago ages out instead of lowering the band for ever), lo/hi/ref
    are taken over it, runs count every accepted run. A band judges only from BAND_MIN_RUNS runs on."""
    out = dict(old)
    for name, b in new.items():
        a = old.get(name)
        if not a:
            out[name] = b
            continue
        window = [{k: w[k] for k in ("ref", "lo", "hi")} for w in (a.get("window") or [a]) + (b.get("window") or [b])]
        out[name] = _band_from(window[-BAND_WINDOW:], a.get("runs", 1) + b.get("runs", 1))
    return out


def warn_key(f):
    """A WARN's stable key: its check and reason with its own hosts and the decimal numbers in it (rates,
    sizes, times that vary from run to run) masked, so that a WARN accepted on gpu[001-016] is known again
    on a subset of them. Where the masking misses, the WARN shows as new: never silently accepted."""
    text, hosts = f["reason"], sorted(set(f.get("hosts") or ()), key=len, reverse=True)
    for h in ([compress_hostlist(sorted(hosts))] if hosts else []) + hosts:
        text = text.replace(h, "<host>")
    return f"{f['check']}: " + re.sub(r"\d+\.\d+", "<n>", text)


def accepted_warns(findings, when):
    """This run's WARNs as a save accepts them: [{'check', 'key', 'hosts', 'reason', 'accepted_at'}]. The
    `manifest` check's own WARNs are not kept: the save takes the new values, so they are gone."""
    out = {}
    for f in findings:
        if f["status"] == "WARN" and f["check"] != "manifest":
            e = out.setdefault(warn_key(f), {"check": f["check"], "key": warn_key(f), "hosts": set(),
                                             "reason": f["reason"], "accepted_at": when})
            e["hosts"] |= set(f.get("hosts") or ())
    return [dict(e, hosts=_hosts_out(e["hosts"])) for _, e in sorted(out.items())]


def merge_accepted(old, new, run_hosts):
    """Accepted WARNs after a save of the nodes run_hosts: their earlier acceptances give way to this run's."""
    out = {}
    for e in old:
        hs = set(_hosts_in(e.get("hosts"))) - run_hosts
        if hs or not e.get("hosts"):
            out[e["key"]] = dict(e, hosts=hs)
    for e in new:
        out[e["key"]] = dict(e, hosts=set(_hosts_in(e.get("hosts"))) | out.get(e["key"], {}).get("hosts", set()))
    return [dict(e, hosts=_hosts_out(e["hosts"])) for _, e in sorted(out.items())]


def mark_accepted(manifest, findings):
    """findings with each WARN the manifest accepted (same key, its hosts among the accepted ones) marked
    'accepted': True (rendered '(accepted in manifest)'); a new WARN stays a plain WARN."""
    index = {}
    for e in (manifest or {}).get("accepted_warns") or []:
        index.setdefault(e["key"], set()).update(_hosts_in(e.get("hosts")))
    return [dict(f, accepted=True) if f["status"] == "WARN" and warn_key(f) in index
            and set(f.get("hosts") or ()) <= index[warn_key(f)] else f for f in findings]


def merge_manifests(old, new):
    """A save onto an existing manifest. Classes add up (hosts union); a host accepted again takes this run's
    values (fields this run did not measure keep their earlier ones) and leaves any other class it was in;
    bands widen. The written_at is the new one."""
    if not old:
        return new
    run_hosts = {h for c in new["classes"].values() for h in _hosts_in(c.get("hosts"))}
    accepted = merge_accepted(old.get("accepted_warns") or [], new.get("accepted_warns") or [], run_hosts)
    out = {k: _expand_class(c) for k, c in old["classes"].items()}
    for key, c in new["classes"].items():
        n = _expand_class(c)
        for o in (o for k, o in out.items() if k != key):  # a host accepted again leaves its other classes
            o["hosts"] -= n["hosts"]
            o["values"] = {f: {h: v for h, v in hv.items() if h not in n["hosts"]} for f, hv in o["values"].items()}
        o = out.setdefault(key, dict(n, hosts=set(), values={}, runs=0, bands={}))
        o["hosts"] |= n["hosts"]
        for field, hv in n["values"].items():
            o["values"].setdefault(field, {}).update(hv)
        o.update(runs=o["runs"] + n["runs"], bands=merge_bands(o["bands"], n["bands"]),
                 first_accepted_at=min(filter(None, [o["first_accepted_at"], n["first_accepted_at"]]), default=None),
                 last_accepted_at=max(filter(None, [o["last_accepted_at"], n["last_accepted_at"]]), default=None))
    return _manifest_doc(out, new["written_at"], accepted)


def _fmt(field, v):
    if v is None:
        return "-"
    if field == "gpu_memory" and isinstance(v, dict):
        return ", ".join(f"{m} {_fmt(field, n)}" for m, n in sorted(v.items()))
    if isinstance(v, (int, float)) and not isinstance(v, bool) and field in ("gpu_memory", "ib_rate", "pcie_speed"):
        return f"{int(v) >> 20} MiB" if field == "gpu_memory" else f"{v:g} {'Gb/s' if field == 'ib_rate' else 'GT/s'}"
    if field == "pcie_width":
        return f"x{v}"
    if isinstance(v, list):
        return ",".join(map(str, v)) or "none"
    return str(v)


def _changes(field, old, new):
    """[(label, old text, new text)] of one host's change; the environment per variable."""
    if field != "env":
        return [(field, _fmt(field, old), _fmt(field, new))]
    old, new = (x if isinstance(x, dict) else {} for x in (old, new))
    return [(f"env.{k}", old.get(k, "(unset)"), new.get(k, "(unset)"))
            for k in sorted(set(old) | set(new)) if old.get(k) != new.get(k)]


def _most_common(hv):
    counts = {}
    for v in hv.values():
        counts.setdefault(_canon(v), [v, 0])[1] += 1
    return max(counts.values(), key=lambda c: (c[1], _canon(c[0])))[0] if counts else None


def _project(field, new, accepted):
    """gpu_memory is compared model by model, for the models both sides know: a job given some GPUs of a
    mixed node sees fewer models, and a changed model is gpu_model's finding already."""
    if field != "gpu_memory" or not isinstance(new, dict):
        return new, accepted
    known = {m for a in accepted if isinstance(a, dict) for m in a}
    new = {m: v for m, v in new.items() if m in known} or None
    return new, [{m: a[m] for m in new or () if m in a} if isinstance(a, dict) else a for a in accepted]


def _judge_host(h, fields, cls, listed, drift, unchecked):
    """Compare one node's fields with its class: its own accepted values when listed, else any of the class's."""
    for field, _, severity in MANIFEST_FIELDS:
        hv = cls["values"].get(field) or {}
        new, accepted = _project(field, fields[field], ([hv[h]] if h in hv else []) if listed else list(hv.values()))
        if new is None or not accepted:
            unchecked.add(field)
            continue
        if _canon(new) in {_canon(v) for v in accepted}:
            continue
        old = accepted[0] if listed else _most_common(dict(enumerate(accepted)))
        text = "; ".join(f"{lab[4:]} {o} -> {n}" if field == "env" else f"{o} -> {n}"
                         for lab, o, n in _changes(field, old, new))
        sev = severity if isinstance(severity, str) else severity(old, new)
        drift.setdefault((field, sev), {}).setdefault(text, []).append(h)


def judge_manifest(manifest, records, screen=None):
    """This run against an accepted manifest (None: no --manifest). A listed host is judged field by field
    against its own accepted values in the class it was accepted in; an unlisted host by its class key
    (an unknown class is a WARN). The PCIe link is the screen's reading under load (screen: this run's screen,
    None when skipped). Unmeasured fields are not checked; hosts not in this run are not judged."""
    if not manifest:
        return []
    classes = {k: _expand_class(c) for k, c in manifest["classes"].items()}
    index = {h: k for k, x in sorted(classes.items()) for h in sorted(x["hosts"])}
    drift, unchecked, unknown, counts = {}, set(), {}, [[], []]
    load = screen_load(screen)
    slow = {h for f in judge_bands(manifest, records, screen)  # not a match: judge_bands FAILs it, named or not
            for h in f["hosts"] + f.get("involved", [])}
    for h, rs in sorted(_by_host(records).items()):
        fields, key = host_view(rs, load)
        listed = h in index
        cls = classes.get(index[h] if listed else class_name(key))
        if cls is None:
            unknown.setdefault(class_name(key), []).append(h)
            continue
        if h not in slow:
            counts[0 if listed else 1].append(h)
        _judge_host(h, fields, cls, listed, drift, unchecked)
    return _manifest_findings(drift, unknown, counts, unchecked, sorted(classes))


def _manifest_findings(drift, unknown, counts, unchecked, accepted):
    """counts: [listed hosts, hosts judged by class] that match (the PASS names them)."""
    out = []
    labels = {f: lab for f, lab, _ in MANIFEST_FIELDS}
    for (field, sev), texts in sorted(drift.items(), key=lambda d: (d[0][1] != "FAIL", FIELD_NAMES.index(d[0][0]))):
        hosts = [h for hs in texts.values() for h in hs]
        out.append(finding("manifest", sev, f"{labels[field]} differs from the manifest: " + "; ".join(
            f"{t} on {_hl(hs)}" for t, hs in sorted(texts.items())), hosts, blame="manifest"))
    for key, hosts in sorted(unknown.items()):
        out.append(finding("manifest", "WARN", f"{_hl(hosts)} not in the manifest, and its class '{key}' was never "
                           f"accepted (accepted: {'; '.join(accepted) or 'none'})", hosts, blame="manifest"))
    if not out and counts[0] + counts[1]:
        skipped = [f for f in FIELD_NAMES if f in unchecked]
        out.append(finding("manifest", "PASS", f"{len(counts[0]) + len(counts[1])} node(s) match the manifest "
                           f"({len(counts[0])} listed, {len(counts[1])} judged by class)"
                           + (f"; not checked (not measured): {', '.join(skipped)}" if skipped else ""),
                           counts[0] + counts[1]))
    return out


def _is_num(v):
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _is_count(v):
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


# What a manifest value must be, by kind: (test, words for the problem line).
VALUE_KINDS = {"text": (lambda v: isinstance(v, str), "a string"), "count": (_is_count, "an integer >= 0"),
               "runs": (lambda v: _is_count(v) and v >= 1, "an integer >= 1"),
               "rate": (lambda v: _is_num(v) and v > 0, "a finite number > 0"),
               "memory": (lambda v: isinstance(v, dict) and bool(v) and all(_is_count(n) and n > 0 for n in v.values()),
                          "an object {GPU model: bytes > 0}"),
               "names": (lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v), "a list of strings"),
               "env": (lambda v: isinstance(v, dict) and all(isinstance(x, str) for x in v.values()),
                       "an object {variable: string}"),
               "when": (lambda v: v is None or isinstance(v, str), "a string or null")}
FIELD_KINDS = dict({f: "text" for f in FIELD_NAMES}, gpus_per_node="count", ib_ports="count", pcie_width="count",
                   ib_rate="rate", pcie_speed="rate", gpu_memory="memory", transport_intra="names",
                   transport_inter="names", ifaces="names", env="env")
KEY_KINDS = {"gpu_model": "text", "gpus_per_node": "count", "ib_ports": "count", "ib_rate_gbps": "rate"}
CLASS_KEYS = ("key", "hosts", "runs", "first_accepted_at", "last_accepted_at", "fields", "bands")
CLASS_KINDS = {"runs": "runs", "first_accepted_at": "when", "last_accepted_at": "when"}
ACCEPTED_KINDS = {"check": "text", "key": "text", "reason": "text", "accepted_at": "when"}
SPAN_KEYS = ("ref", "lo", "hi")


def _qn(name):
    return json.dumps(name)


def _first_problem(problems):
    return next(filter(None, problems), None)


def _kind_problem(where, v, kind):
    ok, words = VALUE_KINDS[kind]
    return None if ok(v) else f"{where}: {json.dumps(v, default=str)[:60]} is not {words}"


def _kinds_problem(where, x, kinds):
    """The first value of x ({key: value}) not of its kind (kinds: {key: a kind of VALUE_KINDS}), or None."""
    return _first_problem(_kind_problem(f"{where}.{k}", x[k], kind) for k, kind in kinds.items())


def _hosts_problem(where, x):
    if isinstance(x, list):
        return None if all(isinstance(h, str) and h for h in x) else f"{where}: a list of host names must hold names"
    if not isinstance(x, str):
        return f"{where}: {json.dumps(x, default=str)[:60]} is not a hostlist"
    try:
        expand_hostlist(x) if x else None
    except (ValueError, TypeError) as e:
        return f"{where}: {x[:60]!r} is not a hostlist ({e})"
    return None


def _object_problem(where, x, keys):
    """x an object of exactly these keys."""
    if not isinstance(x, dict):
        return f"{where}: not an object"
    extra = [k for k in x if k not in keys]
    missing = [k for k in keys if k not in x]
    return (f"{where}: unknown key {_qn(extra[0])}" if extra else
            f"{where}: {_qn(missing[0])} is missing" if missing else None)


def _span_problem(where, w, keys=SPAN_KEYS):
    """A band (keys: its own) or one run of its window: an object of keys; ref, lo, hi finite and above 0, lo
    not above hi."""
    return (_object_problem(where, w, keys) or _kinds_problem(where, w, dict.fromkeys(SPAN_KEYS, "rate"))
            or (f"{where}: lo {w['lo']:g} is above hi {w['hi']:g}" if w["lo"] > w["hi"] else None))


def _band_problem(where, b):
    problem = (_span_problem(where, b, (*SPAN_KEYS, "runs", "window"))
               or _kind_problem(f"{where}.runs", b["runs"], "runs"))
    if problem or not isinstance(b["window"], list) or not b["window"]:
        return problem or f"{where}.window: not a non-empty list"
    return _first_problem(_span_problem(f"{where}.window[{i}]", w) for i, w in enumerate(b["window"]))


def _fields_problem(where, fields):
    if not isinstance(fields, dict):
        return f"{where}: not an object"
    for field, variants in fields.items():
        at = f"{where}.{field}"
        if field not in FIELD_KINDS:
            return f"{at}: unknown field (known: {', '.join(FIELD_NAMES)})"
        if not isinstance(variants, list):
            return f"{at}: not a list of {{value, hosts}}"
        if problem := _first_problem(_object_problem(f"{at}[{i}]", var, ("value", "hosts"))
                                     or _kind_problem(f"{at}[{i}].value", var["value"], FIELD_KINDS[field])
                                     or _hosts_problem(f"{at}[{i}].hosts", var["hosts"])
                                     for i, var in enumerate(variants)):
            return problem
    return None


def _class_problem(name, c):
    where = f"classes[{_qn(name)}]"
    return (_object_problem(where, c, CLASS_KEYS) or _object_problem(f"{where}.key", c["key"], KEY_KINDS)
            or _kinds_problem(f"{where}.key", c["key"], {k: v for k, v in KEY_KINDS.items() if c["key"][k] is not None})
            or _hosts_problem(f"{where}.hosts", c["hosts"]) or _kinds_problem(where, c, CLASS_KINDS)
            or _fields_problem(f"{where}.fields", c["fields"])
            or (None if isinstance(c["bands"], dict) else f"{where}.bands: not an object")
            or _first_problem(_band_problem(f"{where}.bands[{_qn(k)}]", b) for k, b in c["bands"].items()))


def _accepted_problem(entries):
    if not isinstance(entries, list):
        return "accepted_warns: not a list"
    return _first_problem(_object_problem(at, e, (*ACCEPTED_KINDS, "hosts")) or _kinds_problem(at, e, ACCEPTED_KINDS)
                          or _hosts_problem(f"{at}.hosts", e["hosts"])
                          or (None if e["check"] in CHECKS else f"{at}.check: {e['check'][:60]!r} is not a check name")
                          for at, e in ((f"accepted_warns[{i}]", e) for i, e in enumerate(entries)))


def _schema_problem(data):
    sv = data.get("schema_version")
    if not isinstance(sv, int) or isinstance(sv, bool) or sv < 1:
        return f"schema_version {sv!r} is not a positive integer"
    if sv > MANIFEST_SCHEMA_VERSION:
        return (f"schema_version {sv} is newer than the {MANIFEST_SCHEMA_VERSION} this tool reads (written by "
                f"ai-infra-validator {data.get('version', '?')}, this is {VERSION}): use that version or newer")
    if sv < MANIFEST_SCHEMA_VERSION:
        return (f"schema_version {sv} is an old manifest (its node classes and speed bands follow the GPUs a job "
                f"was given, not the node's own); this tool reads {MANIFEST_SCHEMA_VERSION}: move the file aside "
                f"and accept the nodes again with --save-manifest")
    return None


def manifest_problem(data):
    """Why data is not a manifest this tool can use (one line naming the field: classes["C"].bands["B"].lo),
    or None. Every field of every class is checked, so that a manifest that loads is judged without error."""
    if not isinstance(data, dict) or data.get("tool") != MANIFEST_TOOL:
        return "not an ai-infra-validator manifest (no \"tool\": \"ai-infra-validator\")"
    top = ("schema_version", "tool", "version", "written_at", "classes", "accepted_warns")
    problem = (_schema_problem(data) or _object_problem("manifest", data, top)
               or _kind_problem("version", data["version"], "text")
               or _kind_problem("written_at", data["written_at"], "when"))
    if problem:
        return problem
    if not isinstance(data["classes"], dict):
        return "classes: not an object"
    seen = {}
    for name, c in data["classes"].items():
        if problem := _class_problem(name, c):
            return problem
        for h in _hosts_in(c["hosts"]):
            if h in seen:
                return f"host {h} is listed in two classes: '{seen[h]}' and '{name}'"
            seen[h] = name
    return _accepted_problem(data["accepted_warns"])


def manifest_refusal(state):
    """Why this run's state may not be accepted ('' when it may: a PASS; its WARNs are saved as accepted)."""
    if state.get("verdict") != "PASS":
        return f"the verdict is {state.get('verdict')} (exit {state.get('exit_code')})"
    return ""


BAND_SLACK = 0.9      # a measurement below this fraction of its band's lowest accepted value is "below the band"
BAND_SLACK_CPU = 0.1  # on CPU ranks share cores: only a collapse counts (as in the screen's own judge)


def _band_gpu_words(g):
    """'node1 GPU 3 (GPU-..., rank 3)': the GPU of one screen row by node, local index, UUID and rank."""
    uuid = f"{g['uuid']}, " if g.get("uuid") else ""
    return f"{g.get('host')} GPU {g.get('local_rank', '-')} ({uuid}rank {g.get('rank', '-')})"


def _band_points(screen, host_class):
    """(class, band, value, hosts, ranks, where, tries) of each measurement of one screen, the band named by what
    the value depends on: 'gpu.tflops/<model>', 'gpu.hbm_gbps/<model>' per GPU, 'intra.busbw/<n> ranks' per node
    (ranks per node), 'inter.busbw/<k> rails' per pair of nodes of one class (rails the pair ran at once).
    ranks: the ranks measured; where: the words naming them (a GPU by node, index, UUID and rank); tries: how
    many times the value was measured (the best counting)."""
    screen = screen or {}
    for g in screen.get("gpu") or []:
        cls, model = host_class.get(g.get("host")), g.get("model") or "unknown"
        ranks, where = [g["rank"]] if g.get("rank") is not None else [], _band_gpu_words(g)
        tries = int(g.get("tries") or 1)
        yield cls, f"gpu.tflops/{model}", g.get("tflops"), [g.get("host")], ranks, where, tries
        yield cls, f"gpu.hbm_gbps/{model}", g.get("hbm_gbps"), [g.get("host")], ranks, where, tries
    for n in screen.get("intra") or []:
        ranks = list(n.get("ranks") or ())
        yield host_class.get(n.get("host")), f"intra.busbw/{len(ranks)} ranks", n.get("busbw"), \
            [n.get("host")], ranks, f"{n.get('host')} (ranks {format_ranges(ranks) or '-'})", \
            max(int(n.get("tries") or 1), len(n.get("values") or ()))
    pairs = screen.get("pairs") or []
    rails = collections.Counter((pr.get("round"), tuple(sorted(pr.get("nodes") or ()))) for pr in pairs)
    for pr in pairs:
        hosts, ranks = sorted(pr.get("nodes") or ()), list(pr.get("ranks") or ())
        classes = {host_class.get(h) for h in hosts}
        if len(classes) == 1:
            rail = f" rail {pr['rail']}" if pr.get("rail") is not None else ""
            yield classes.pop(), f"inter.busbw/{rails[(pr.get('round'), tuple(hosts))]} rails", pr.get("busbw"), \
                hosts, ranks, f"{compress_hostlist(hosts)}{rail} (ranks {format_ranges(ranks) or '-'})", \
                int(pr.get("tries") or 1)


def _host_classes(records):
    return {h: class_name(host_view(rs)[1]) for h, rs in _by_host(records).items()}


def screen_bands(screen, records):
    """The speed bands of one accepted run, per node class: {class: {band: {'ref', 'lo', 'hi', 'runs': 1,
    'window': [one entry]}}}. ref is the screen's own reference (upper quartile of the peers), lo/hi the
    extremes; merge_bands keeps the last BAND_WINDOW accepted runs, and they judge from BAND_MIN_RUNS runs on."""
    samples = {}
    for cls, band, v, *_ in _band_points(screen, _host_classes(records)):
        if cls is not None and _is_num(v) and v > 0:
            samples.setdefault(cls, {}).setdefault(band, []).append(float(v))
    return {cls: {b: _band_from([{"ref": screen_reference(v)["ref"], "lo": min(v), "hi": max(v)}], 1)
                  for b, v in sorted(bands.items())} for cls, bands in samples.items()}


def judge_bands(manifest, records, screen):
    """This run's screen against the accepted bands of each node's class (bands of BAND_MIN_RUNS runs or
    more, of the same GPU model, ranks per node or rails per pair): a measurement below BAND_SLACK (on CPU
    BAND_SLACK_CPU) x the band's lowest value in its window FAILs, naming its host when it was measured again
    (a value of one host measured once, or of a pair of nodes, names none: _below_band)."""
    if not manifest or not screen:
        return []
    slack = BAND_SLACK_CPU if screen.get("cpu") else BAND_SLACK
    return [f for cls, band, v, hosts, ranks, where, tries in _band_points(screen, _host_classes(records))
            for f in _below_band(manifest, cls, band, v, hosts, slack, ranks, where, tries)]


def _below_band(manifest, cls, band, value, hosts, slack, ranks=(), where=None, tries=1):
    b = ((manifest.get("classes") or {}).get(cls) or {}).get("bands", {}).get(band)
    if not b or b.get("runs", 1) < BAND_MIN_RUNS or not _is_num(value) or value >= slack * b["lo"]:
        return []
    f = finding("manifest", "FAIL", f"{band} {value:.4g} on {where or compress_hostlist(sorted(hosts))} is "
                f"below the accepted band of {cls} ({b['lo']:.4g}-{b['hi']:.4g}, reference {b['ref']:.4g}, "
                f"{b['runs']} runs; FAIL below {slack:g} x its lowest)", hosts, ranks, blame="manifest")
    if len(set(hosts)) > 1:  # a pair of nodes: the value is the link's, neither end is singled out
        return [unlocalised(f, "link", "the screen's inter-node rows, which measure each node with other partners")]
    return [f if tries >= 2 else unlocalised(f, "once", "a re-run: a value below the band again names its host")]


def diff_manifests(a, b):
    """Lines 'class/field: old -> new (hosts)' from manifest a to b: hosts joining or leaving a class; per
    field, hosts in both whose value changed and new hosts whose value is none of a's; bands."""
    ca, cb = ({k: _expand_class(c) for k, c in m["classes"].items()} for m in (a, b))
    out = []
    for key in sorted(set(ca) | set(cb)):
        x, y = ca.get(key), cb.get(key)
        hx, hy = (x or {}).get("hosts", set()), (y or {}).get("hosts", set())
        if hx != hy:
            out.append(f"{key}/hosts: {_hl(hx)} -> {_hl(hy)} ({_hl(hx ^ hy)})")
        if x and y:
            out += _diff_fields(key, x["values"], y["values"])
            if _canon(x["bands"]) != _canon(y["bands"]):
                out.append(f"{key}/bands: {_canon(x['bands'])} -> {_canon(y['bands'])} ({_hl(hx | hy)})")
    wa, wb = ({e["key"]: set(_hosts_in(e["hosts"])) for e in m.get("accepted_warns") or []} for m in (a, b))
    out += [f"accepted WARN {k}: {_hl(wa.get(k, ()))} -> {_hl(wb.get(k, ()))}"
            for k in sorted(set(wa) | set(wb)) if wa.get(k) != wb.get(k)]
    return out


def _diff_fields(key, va, vb):
    out = []
    for field in sorted(set(va) | set(vb), key=lambda f: (FIELD_NAMES.index(f) if f in FIELD_NAMES else 99, f)):
        a, b = va.get(field, {}), vb.get(field, {})
        known, groups = {_canon(v) for v in a.values()}, {}
        for h, new in sorted(b.items()):
            if h not in a and _canon(new) in known:
                continue
            old = a[h] if h in a else _most_common(a)
            for label, o, n in (_changes(field, old, new) if _canon(old) != _canon(new) else []):
                groups.setdefault((label, o, n), []).append(h)
        out += [f"{key}/{label}: {o} -> {n} ({_hl(hs)})" for (label, o, n), hs in sorted(groups.items())]
    return out


