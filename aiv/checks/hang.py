"""Floor 3: who is behind in a phase that did not finish, from plain data: the last collective each rank
issued (its post when rank 0 asked: torch's flight recorder, else the rank's own record), and NCCL's own
view of the job (its RAS STATUS) beside ours. Pure functions; judge_unfinished and screen_stuck use them."""
from ..core.base import compress_hostlist, format_ranges, group_by

# What a late rank was doing when rank 0 asked, per group (issued_states):
#   behind   outside any collective, and it never issued one that a peer of the group issued: the rank
#            itself stopped the group (evidence "never-issued")
#   waiting  inside a collective call (its own record says so: every call passes RankRun.issuing; torch's
#            recorder does not always mark a finished gloo collective completed): it waits for its peers
#   idle     outside any collective, every collective its peers issued issued too
#   between  outside any collective for less than BETWEEN_S: between two calls, not stopped (a snapshot of a
#            rank that is progressing, one call behind its peers for microseconds, is no evidence)
#   unposted no post came back within ISSUED_S (alive, but its record was not collected)
ISSUED_STATES = ("behind", "waiting", "idle", "between", "unposted")
BETWEEN_S = 1.0  # a rank outside any collective call for less than this is between two calls
# a rank behind its peers, by how (hang.issued_states' 'how'): outside any collective; inside the call but its
# backend never saw it (its recorder lacks what its peers' recorders hold); its entry scheduled, never started
BEHIND_WORDS = {None: "alive, outside any collective; numbered by {src}",
                "unseen": "alive, inside the collective call but its backend never saw it: torch's flight recorder "
                          "holds it on its peers, not on this rank",
                "unstarted": "alive, its entry stayed scheduled in torch's flight recorder while its peers' started"}


def ranks_text(ranks):
    """[0, 2, 3, 4] -> '0, 2-4'."""
    return format_ranges(ranks).replace(",", ", ")


def group_key(ranks):
    """The key of a process group in a rank's issued record: its ranks, '0-15' (the world's too)."""
    return format_ranges(ranks)


def own_completed(post, key):
    """How many collectives a rank's own record says it finished on the group `key` (its set-up, number 0, not
    counted): the last one's number when it finished, else one fewer."""
    last = ((post or {}).get("own") or {}).get(key)
    if not last or not isinstance(last[1], int):
        return 0
    return last[1] if last[2] else last[1] - 1


def recorder_live(post, key):
    """Whether torch's flight recorder is live on this rank for the group `key`: it could be read, and it holds
    the group's collectives if the rank's own record says it finished one there (a recorder switched off or
    overwritten holds nothing where the rank did finish collectives: then it is no evidence)."""
    fr = post.get("fr")
    return isinstance(fr, dict) and (fr.get(key) is not None or own_completed(post, key) == 0)


def issued_source(posts, ranks, key=None):
    """'recorder' when torch's flight recorder is live on every rank of `ranks` that posted (recorder_live) and
    holds entries of the group on at least one of them (then its sequence numbers are comparable across them,
    and a rank whose recorder lacks what its peers' hold never issued it to its backend), else 'own' (each
    rank's own record of what it issued). Without a key: whether every posting rank's recorder held entries."""
    got = [posts[r] for r in ranks if posts.get(r) is not None]
    if key is None:
        return "recorder" if got and all(p.get("fr") for p in got) else "own"
    held = any((p.get("fr") or {}).get(key) for p in got)
    return "recorder" if got and held and all(recorder_live(p, key) for p in got) else "own"


def issued_last(post, key, source):
    """[op, seq, done(, state)] of the last collective a rank issued on the group `key` (None: none), from
    `source` (the recorder's entries carry its state: scheduled, started, completed)."""
    last = ((post.get("fr") if source == "recorder" else post.get("own")) or {}).get(key)
    return list(last) if last else None


def _late_state(post, x, front, source, started):
    """One late rank's place (ISSUED_STATES) and, when it is behind on the recorder's evidence although its own
    record says it is inside the call, how: 'unseen' (its backend never saw the collective its peers' recorders
    hold) or 'unstarted' (its entry stayed scheduled while a peer's started)."""
    inside = post.get("inflight")
    lags = front is not None and (x is None or x[1] < front)  # behind the furthest collective a peer issued
    idle_brief, inside_brief = (s is not None and s < BETWEEN_S for s in (post.get("idle_s"), post.get("inflight_s")))
    if source == "recorder" and lags:
        if not inside:
            return ("between", None) if idle_brief else ("behind", None)
        return ("between", None) if inside_brief else ("behind", "unseen")
    if source == "recorder" and inside and x and x[1] == front and started and len(x) > 3 and \
            x[3] == "scheduled" and not inside_brief:
        return "behind", "unstarted"
    if inside:  # its own record: the main thread is inside a collective call right now
        return "waiting", None
    if idle_brief:
        return "between", None
    return ("behind", None) if lags else ("idle", None)


def issued_states(ranks, posts, late, key):
    """The group `key` of `ranks`, from each rank's post ({rank: post or None}; a post: {'own': {key: [op, seq,
    done]}, 'fr': the same from torch's flight recorder with its state, {} when it holds nothing of this
    rank's groups, None when it cannot be read, 'inflight': key of the collective call the rank's main thread
    is inside, or None, 'inflight_s': for how long, 'idle_s': seconds since it left its last call}). A rank's
    place comes from `source` (issued_source); whether it is inside a call, from its own record (_late_state).
    -> {'source', 'key', 'front': [op, seq] of the furthest collective a rank issued (None: none), 'issuers':
    ranks that issued it, 'last': {rank: [op, seq, done(, state)] or None}, 'states': {rank: one of
    ISSUED_STATES} for the late ranks, 'how': {rank: 'unseen'|'unstarted'} of the behind ranks that are inside
    the call}."""
    source = issued_source(posts, ranks, key)
    last = {r: issued_last(posts[r], key, source) for r in ranks if posts.get(r) is not None}
    front = max((x[1] for x in last.values() if x), default=None)
    fop = next((x[0] for x in last.values() if x and x[1] == front), None)
    started = any(x and x[1] == front and len(x) > 3 and x[3] in ("started", "completed") for x in last.values())
    places = {r: _late_state(posts[r], last.get(r), front, source, started) if posts.get(r) is not None
              else ("unposted", None) for r in late}
    states = {r: s for r, (s, _) in places.items()}
    how = {r: h for r, (_, h) in places.items() if h}
    issuers = sorted(r for r, x in last.items() if x and x[1] == front and how.get(r) != "unstarted")
    return {"source": source, "key": key, "front": None if front is None else [fop, front], "issuers": issuers,
            "last": last, "states": states, "how": how}


def op_text(front):
    """['all_reduce', 3] -> 'all_reduce #3'; the process group's own set-up has no number."""
    op, seq = front
    return op if not seq else f"{op} #{seq}"


def on_hosts(ranks, host_of, limit=16):
    """'rank 1 (node2)' or 'ranks 4-7 (node2), 9 (node3)'; at most `limit` hosts, then a count."""
    by_host = group_by(sorted(ranks), lambda r: host_of.get(r, "?"))
    items = [f"{format_ranges(rs)} ({h})" for h, rs in list(by_host.items())[:limit]]
    more = f" and {len(by_host) - limit} more node(s)" if len(by_host) > limit else ""
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(items) + more


def never_issued_text(behind, an, host_of):
    """The greppable words for ranks that never issued a collective their peers issued:
    'rank 1 (n1) never issued all_reduce #3 that ranks 0, 2-15 issued'; a rank whose entry stayed scheduled
    while its peers' started: 'rank 1 (n1) never started all_reduce #3 that ranks 0, 2-15 started'."""
    who = "rank" if len(an["issuers"]) == 1 else "ranks"
    how = an.get("how") or {}
    by_verb = group_by(behind, lambda r: "started" if how.get(r) == "unstarted" else "issued")
    return "; ".join(f"{on_hosts(by_verb[verb], host_of)} never {verb} {op_text(an['front'])} that {who} "
                     f"{ranks_text(an['issuers'])} {verb}" for verb in ("issued", "started") if verb in by_verb)


def never_finished_text(ranks, phase, finished, host_of):
    """'rank 1 (n1) never finished its part of screen-gpu that ranks 0, 2-3 finished' (a phase whose work
    is each rank's own: the others did theirs and wait)."""
    who = "rank" if len(finished) == 1 else "ranks"
    return f"{on_hosts(ranks, host_of)} never finished its part of {phase} that {who} {ranks_text(finished)} finished"


def unlocalised_record(why, localise):
    """The finding's record of a FAIL that names no host: why, and what would localise it."""
    return {"why": why, "localise": localise}


def unlocalised_words(u):
    return f"no host is named: {u['why']}; to localise it: {u['localise']}"


RERUN_HINT = ("a re-run (a rank that again never issues or finishes its part is named), or py-spy dump --pid "
              "<pid> on the hosts above (where each rank's main thread is)")
LINK_HINT = ("a re-run with one end left out (sbatch --exclude=<node>): a hang that follows a node is that node's, "
             "one that stays with the other nodes is the fabric's; NCCL_DEBUG=INFO names the peer whose "
             "connection failed")
FABRIC_HINT = ("the screen's pair results (inter-node rows above), or a re-run with NCCL_DEBUG=INFO (NCCL's WARN "
               "lines name the peer whose connection failed)")


# -- NCCL's own view: its RAS service (NCCL >= 2.24; JSON from 2.28.7), read by rank 0 beside ours
def ras_world(ras, world):
    """The job's world communicator in a RAS STATUS document (size == world, the one listing most ranks), or
    None. Any other shape (not a document, communicators not a list, ranks not a list) is no communicator."""
    comms = (ras or {}).get("communicators") if isinstance(ras, dict) else None
    comms = [c for c in comms if isinstance(c, dict) and c.get("size") == world] if isinstance(comms, list) else []
    return max(comms, key=lambda c: len(_items(c.get("ranks"))), default=None)


def _items(value):
    """A list in NCCL's document, else nothing (a reply of another shape is never trusted)."""
    return value if isinstance(value, list) else []


def _obj(value):
    return value if isinstance(value, dict) else {}


def _rank_of(entry):
    """An entry's int rank (a bool, a string, a missing rank: None)."""
    r = entry.get("rank") if isinstance(entry, dict) else None
    return r if isinstance(r, int) and not isinstance(r, bool) and r >= 0 else None


def ras_rank_states(comm):
    """{rank: {'state': 'present'|'missing', 'count': collectives issued (sum of collective_counts) or None,
    'error': async_error or abort_flag seen, 'dead': RAS considers it dead, 'unresponsive'}} of one
    communicator, and the number of entries of a shape NCCL does not write (no int rank, a status or counts
    that is not an object): those are skipped, never guessed. -> (states, skipped)."""
    out, skipped = {}, 0
    for r in _items(comm.get("ranks")):
        rank, st, counts = _rank_of(r), _obj(_obj(r).get("status")), _obj(r).get("collective_counts")
        if rank is None or (counts is not None and not isinstance(counts, dict)):
            skipped += 1
            continue
        total = sum(v for v in counts.values() if isinstance(v, int) and not isinstance(v, bool)) if counts else None
        out[rank] = {"state": "present", "count": total, "init": st.get("init_state"),
                     "error": bool(st.get("async_error")) or bool(st.get("abort_flag"))}
    for r in _items(comm.get("missing_ranks")):
        rank = _rank_of(r)
        if rank is None:
            skipped += 1
            continue
        st = _obj(r.get("status"))
        out[rank] = {"state": "missing", "dead": bool(st.get("considered_dead")),
                     "unresponsive": bool(st.get("unresponsive"))}
    return out, skipped


def _nccl_word(s, top):
    """NCCL's word for one rank: 'absent' (not in RAS's reply), 'missing', 'error', 'behind' (fewer collectives
    than top), or 'ok'."""
    if s is None:
        return "absent"
    if s["state"] == "missing":
        return "missing"
    if s["error"]:
        return "error"
    if top is not None and s.get("count") is not None and s["count"] < top:
        return "behind"
    return "ok"


def nccl_view(ras, world, host_of, kinds, named):
    """NCCL's view beside ours (never decides the verdict). ras: {'ok': True, 'data': STATUS JSON} or {'ok':
    False, 'why': ...}; kinds: {rank: our word for it: 'dead'|'frozen'|'silent'|'behind'|'waiting'|...};
    named: the ranks our finding names. -> {'read': bool, 'why'?, 'agree': bool|None, 'ranks': {rank: {'ours',
    'nccl', 'agree'}}, 'nccl_version', 'words'}. Per rank NCCL says 'missing' (RAS lost it: dead or
    unresponsive), 'error' (an async error or abort on it), 'behind' (fewer collectives than the most any rank
    of the communicator issued), or 'ok'; ours 'named' for a rank we name by its process, else 'behind'
    (never issued), else 'ok'. They agree where both say the rank stopped the job or both say it did not."""
    if not isinstance(ras, dict) or not ras.get("ok"):
        why = str(_obj(ras).get("why") or "not read")
        return {"read": False, "why": why, "agree": None, "ranks": {},
                "words": f"NCCL's own view (RAS) not read: {why}"}
    data = ras.get("data") if isinstance(ras.get("data"), dict) else {}
    version = data.get("nccl_version") if isinstance(data.get("nccl_version"), str) else None
    head = f"NCCL's own view (RAS{', NCCL ' + version if version else ''})"
    comm = ras_world(data, world)
    states, skipped = ras_rank_states(comm) if comm is not None else ({}, 0)
    if not states:
        why = (f"RAS listed no communicator of the job's {world} rank(s)" if comm is None else
               f"RAS listed the job's communicator with no rank it could read ({skipped} entr(ies) of another shape)")
        return dict({"read": True, "why": why, "agree": None, "ranks": {}, "nccl_version": version},
                    **({} if comm is None else {"skipped": skipped}), words=f"{head}: {why}")
    top = max((s["count"] for s in states.values() if s.get("count") is not None), default=None)
    rows = {}
    for r in range(world):
        s, ours = states.get(r), kinds.get(r, "ok")
        nccl, ours = _nccl_word(s, top), ours if ours in ("dead", "frozen", "silent", "behind") else "ok"
        agree = (r in named or ours != "ok") == (nccl in ("missing", "error", "behind")) or nccl == "absent"
        rows[r] = {"ours": ours, "nccl": nccl, "agree": agree, "count": (s or {}).get("count")}
    differ = sorted(r for r, x in rows.items() if not x["agree"])
    marked = sorted(r for r, x in rows.items() if x["nccl"] != "ok" and x["nccl"] != "absent")
    if differ:
        parts = [f"{on_hosts([r], host_of)}: ours {rows[r]['ours']}, NCCL's {rows[r]['nccl']}" for r in differ[:8]]
        words = f"{head} differs on {len(differ)} rank(s): " + "; ".join(parts) + (" ..." if len(differ) > 8 else "")
    elif marked:
        words = f"{head} agrees: " + "; ".join(f"{on_hosts([r], host_of)} {rows[r]['nccl']}" for r in marked[:8])
    else:
        counts = f"each issued {top} collective(s)" if top is not None else "no counts"
        words = f"{head} agrees: no rank missing, in error or behind ({counts})"
    if skipped:
        words += f"; {skipped} entr{'y' if skipped == 1 else 'ies'} of its reply not of NCCL's shape skipped"
    return {"skipped": skipped, "read": True, "agree": not differ, "ranks": {str(r): x for r, x in rows.items()},
            "nccl_version": version, "missing": [r for r, x in rows.items() if x["nccl"] == "missing"],
            "hosts": compress_hostlist(sorted({host_of.get(r, "?") for r in marked})) if marked else "",
            "words": words}
