"""Floor 4: --verify-log: a whole log judged again, with no torch and no cluster."""
import contextlib
import re

from ..core.base import SUCCESS_LINE, expand_hostlist, parse_ranges

# A saved log passes only when it shows one clean PASS from start to end: the success line, no
# FAILURE line, a "Verdict: PASS exit=0" line, all ranks reported, an exact all_reduce, identical
# DDP gradients, no [FAIL] finding (no [WARN] either under --strict), and counts that agree with
# each other. Progress lines ("[  1.23s] phase: ...") are never read: they are not a stable format.
LOG_SECTIONS = ("CLUSTER HARDWARE TOPOLOGY REPORT", "NODE ENVIRONMENT DEEP DIVE",
                "NETWORK INTERCONNECT & FABRIC STATUS", "COLLECTIVES", "PERFORMANCE", "FINDINGS")
_LOG_FAILURE = re.compile(r"(?:\[[^\]]*\]\s*)?FAILURE:")   # also "[host:rank] FAILURE: ..."
_LOG_FINDING = re.compile(r"\[(PASS|WARN|FAIL)\]\s+\S+?:")
_LOG_SUM = re.compile(r"all_reduce exact:\s*sum=(\S+)\s+expected=(\S+)\s+on\s+(\S+)\s+rank")
_LOG_GRADS = re.compile(r"DDP\b.*\bgradients_identical=(\S*)")


def _log_int(text):
    """A plain non-negative decimal number, else None."""
    return int(text) if re.fullmatch(r"[0-9]+", text) else None


def _log_after(lines, prefix):
    """The rest of every line that starts with prefix, stripped."""
    return [s[len(prefix):].strip() for s in lines if s.startswith(prefix)]


def _verify_totals(lines, problems, facts):
    read = [(s, _log_int(m.group(1))) for s in lines for m in [re.search(r"Total Execution Ranks:\s*(\S+)", s)] if m]
    problems += [f"garbled 'Total Execution Ranks' line: {s[:80]}" for s, n in read if n is None]
    totals = [n for _, n in read if n is not None]
    if not totals:
        problems.append("no 'Total Execution Ranks: N' line")
    elif len(set(totals)) > 1:
        problems.append(f"'Total Execution Ranks' lines disagree: {sorted(set(totals))}")
    else:
        facts["world_size"] = totals[0]


def _verify_verdict(lines, problems, facts):
    """The success marker, no FAILURE line, and exactly one verdict: PASS with exit code 0 (several identical
    lines are fine)."""
    if SUCCESS_LINE not in lines:
        problems.append("success marker missing")
    problems += [f"failure reported: {s[:200]}" for s in lines if _LOG_FAILURE.match(s)]
    heads = list(dict.fromkeys(" ".join(v.split()[:2]) for v in _log_after(lines, "Verdict:")))  # each once
    if not heads:
        problems.append("no 'Verdict:' line")
        return
    if len(heads) > 1:
        problems.append(f"'Verdict:' lines disagree: {' | '.join(heads)}")
    problems += [f"verdict is 'Verdict: {h}', not 'Verdict: PASS exit=0'" for h in heads if h != "PASS exit=0"]
    facts["verdict"] = heads[0]


def _verify_ranks_reported(lines, world, problems):
    values = list(dict.fromkeys(_log_after(lines, "Ranks Reported:")))
    if not values:
        problems.append("no 'Ranks Reported: k/N' line")
    elif len(values) > 1:
        problems.append(f"'Ranks Reported' lines disagree: {' | '.join(values)}")
    for v in values:
        k, n = map(_log_int, v.partition("/")[::2])
        if k is None or n is None:
            problems.append(f"garbled 'Ranks Reported' line: {v[:80]}")
            continue
        if k != n:
            problems.append(f"Ranks Reported: {v}: {k} of {n} rank(s) reported")
        if world is not None and n != world:
            problems.append(f"Ranks Reported: {v} is out of {n} rank(s) but Total Execution Ranks is {world}")


def _sum_matches(text, want):
    """sum= is printed with :g (1.00324e+06 for large worlds); expected= is an exact integer."""
    with contextlib.suppress(OverflowError):
        if text == format(want, "g"):
            return True
    try:
        return float(text) == want
    except ValueError:
        return False


def _verify_collectives(lines, world, problems):
    sums = [m for m in map(_LOG_SUM.match, lines) if m]
    if not sums:
        problems.append("no 'all_reduce exact: sum=S expected=E' line (COLLECTIVES)")
    for m in sums:
        s_txt, e_txt, r_txt = m.groups()
        e, r = _log_int(e_txt), _log_int(r_txt)
        if e is None or r is None:
            problems.append(f"garbled all_reduce line: {m.group(0)[:100]}")
            continue
        if not _sum_matches(s_txt, e):
            problems.append(f"all_reduce sum={s_txt} but expected={e}")
        if world is not None and e != world * (world + 1) // 2:
            problems.append(f"all_reduce expected={e} but {world} ranks sum to {world * (world + 1) // 2}")
        if world is not None and r != world:
            problems.append(f"all_reduce ran on {r} rank(s) but Total Execution Ranks is {world}")
    grads = list(dict.fromkeys(m.group(1) for m in map(_LOG_GRADS.match, lines) if m))
    if not grads:
        problems.append("no 'gradients_identical=' line (COLLECTIVES)")
    problems += [f"DDP gradients_identical={g or '(empty)'}, not yes" for g in grads if g != "yes"]


def _verify_findings(lines, strict, problems, facts):
    if lines is None:
        problems.append("no FINDINGS section")
        return
    found = [(m.group(1), s) for s in lines for m in [_LOG_FINDING.match(s)] if m]
    problems += [f"finding: {s[:200]}" if st == "FAIL" else f"finding (a FAIL under --strict): {s[:200]}"
                 for st, s in found if st == "FAIL" or st == "WARN" and strict]
    facts["findings"] = {st: sum(x == st for x, _ in found) for st in ("PASS", "WARN", "FAIL")}


def _topology_line(s, problems):
    """(nodes, ranks_per_node) of one node= line of the topology section, or None."""
    kv = dict(re.findall(r"(\w+)=(\S+)", s))
    try:
        hs = expand_hostlist(kv["node"])
        n = int(kv["nodes"])
        k = int(kv["ranks_per_node"])
        locs = parse_ranges(kv["local_ranks"])
    except (KeyError, ValueError) as e:
        problems.append(f"garbled topology line ({e}): {s[:100]}")
        return None
    if len(hs) != n:
        problems.append(f"topology line lists {len(hs)} hosts but says nodes={n}: {s[:100]}")
    if sorted(locs) != list(range(k)):
        problems.append(f"node {kv['node']}: local ranks {kv['local_ranks']} are not 0..{k - 1}")
    return n, k


def _verify_topology(lines, problems, facts):
    """Nodes and ranks the topology section accounts for; returns the ranks-per-node values seen."""
    for s in lines:
        if s.startswith("nodes=") and (m := re.search(r"\bbackend=(\w+)", s)):
            facts["backend"] = m.group(1)
    shapes = [nk for s in lines if s.startswith("node=") for nk in [_topology_line(s, problems)] if nk]
    nodes, ranks, rpn_seen = sum(n for n, _ in shapes), sum(n * k for n, k in shapes), {k for _, k in shapes}
    if nodes == 0:
        problems.append("no node lines in the CLUSTER HARDWARE TOPOLOGY REPORT section")
        return rpn_seen
    facts.update(nodes=nodes, ranks_in_topology=ranks)
    if "world_size" in facts and ranks != facts["world_size"]:
        problems.append(f"topology accounts for {ranks} ranks but Total Execution Ranks is {facts['world_size']}")
    return rpn_seen


def _verify_versions(lines, problems, facts):
    found = {key: val for s in lines for key, val in re.findall(r"\b(torch|cuda|nccl)=(\S+)", s) if val != "-"}
    if not found.get("torch"):
        problems.append("torch version missing")
    if facts.get("backend") == "nccl" and not (found.get("cuda") and found.get("nccl")):
        problems.append("CUDA/NCCL versions missing for an nccl run")
    facts.update(torch=found.get("torch"), cuda=found.get("cuda"), nccl=found.get("nccl"))


def _verify_expect(expect, facts, rpn_seen, problems):
    if expect.get("world_size") is not None and facts.get("world_size") != expect["world_size"]:
        problems.append(f"Total Execution Ranks is {facts.get('world_size')}, expected {expect['world_size']}")
    if expect.get("nodes") is not None and facts.get("nodes", 0) != expect["nodes"]:
        problems.append(f"{facts.get('nodes', 0)} nodes in the topology, expected {expect['nodes']}")
    if expect.get("ranks_per_node") is not None and rpn_seen and rpn_seen != {expect["ranks_per_node"]}:
        problems.append(f"ranks per node {sorted(rpn_seen)}, expected {expect['ranks_per_node']}")


_LOG_KEEP = re.compile(r"Total Execution Ranks:|Verdict:|Ranks Reported:|node=|nodes=|\b(?:torch|cuda|nccl)=")
# every _LOG_KEEP match holds one of these: a substring test first (memchr-fast) spares the regex's scan of
# a long line that holds none of them (a megabyte of binary noise: 77 ms by the regex, 0.1 ms by these)
_LOG_KEEP_WORDS = ("Total Execution Ranks:", "Verdict:", "Ranks Reported:", "node=", "nodes=", "torch=", "cuda=",
                   "nccl=")


def _log_relevant(s):
    """Whether a stripped log line can matter to any check below (the others are dropped while reading)."""
    return (s in LOG_SECTIONS or s == SUCCESS_LINE or bool(_LOG_FAILURE.match(s) or _LOG_FINDING.match(s)
            or _LOG_SUM.match(s) or _LOG_GRADS.match(s)
            or any(w in s for w in _LOG_KEEP_WORDS) and _LOG_KEEP.search(s)))


LOG_CHUNK = 1 << 20  # a line longer than this is read in pieces, each judged as a line of its own


def read_log_lines(f):
    """The relevant stripped lines of a binary log file, read to its end one line (or LOG_CHUNK) at a
    time: memory holds the lines that matter, never the file."""
    return [s for raw in iter(lambda: f.readline(LOG_CHUNK), b"")
            for s in (x.strip() for x in raw.decode("utf-8", errors="replace").splitlines()) if _log_relevant(s)]


def verify_log(text, expect, strict=False):
    """Automation's check of a saved log (its text, or read_log_lines' list). Returns (ok, problems, facts); ok
    only for a clean PASS. strict: a [WARN] finding is a problem too (as --strict makes it a FAIL in a run)."""
    problems, facts = [], {"backend": None}
    lines = [ln.strip() for ln in text.splitlines()] if isinstance(text, str) else list(text)
    sections, section = {"": []}, ""  # {section title: its lines}; lines before the first section are under ''
    for s in lines:
        if s in LOG_SECTIONS:
            section = s
            sections.setdefault(s, [])
        else:
            sections[section].append(s)
    _verify_totals(lines, problems, facts)
    _verify_verdict(lines, problems, facts)
    _verify_ranks_reported(lines, facts.get("world_size"), problems)
    _verify_collectives(lines, facts.get("world_size"), problems)
    _verify_findings(sections.get("FINDINGS"), strict, problems, facts)
    rpn_seen = _verify_topology(sections.get("CLUSTER HARDWARE TOPOLOGY REPORT", []), problems, facts)
    _verify_versions(sections.get("NODE ENVIRONMENT DEEP DIVE", []), problems, facts)
    _verify_expect(expect, facts, rpn_seen, problems)
    return not problems, problems, facts
