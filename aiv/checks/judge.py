"""Floor 3: pure checks of plain data -> findings (PASS / WARN / FAIL with hosts and ranks), and who is
to blame for a phase that did not finish."""
import json
import math

from ..core.base import (
    EXIT_FAIL,
    EXIT_INTERNAL,
    EXIT_INTERRUPTED,
    EXIT_TIMEOUT,
    EXIT_USAGE,
    _screen_quantile,
    compress_hostlist,
    finding,
    format_ranges,
    group_by,
    human_bytes,
    parse_ranges,
)
from ..core.blame import minority_kind, odd_ones, unlocalised
from ..core.deadlines import ISSUE_PHASES, ISSUED_S, NODE_SMI_S, PHASE_CHECK, PHASES
from ..core.names import NODE_SMI_WHAT, PROBED_PACKAGES, ib_hca_select
from .hang import (
    BEHIND_WORDS,
    FABRIC_HINT,
    RERUN_HINT,
    group_key,
    issued_states,
    never_finished_text,
    never_issued_text,
    on_hosts,
    op_text,
    ranks_text,
    unlocalised_record,
    unlocalised_words,
)
from .numerics import judge_numerics_records


def _by_host(records):
    return group_by(records, lambda r: r["host"])


def _rank_str(r):
    return f"rank {r['rank']} ({r['host']})"


def judge_world_size(world_size, expect):
    want = expect.get("world_size")
    if want not in (None, world_size):
        return [finding("world-size", "FAIL", f"WORLD_SIZE={world_size} but {want} ranks were expected")]
    said = "(no expectation set)" if want is None else "as expected"
    return [finding("world-size", "PASS", f"WORLD_SIZE={world_size} {said}")]


def stray_reason(rank, world, world0, first):
    """Why a process that checked in is not a rank of rank 0's run (None: it is one). first: the
    'pid P on HOST' that claimed this rank before it (None: its claim came first)."""
    if world != world0 or rank >= world0:
        beyond = f"RANK={rank} is not a rank of rank 0's world of {world0}" if rank >= world0 else ""
        other = f"it was launched with WORLD_SIZE={world}, rank 0 with WORLD_SIZE={world0}" if world != world0 else ""
        return "world-size", "; ".join(x for x in (beyond, other) if x)
    if first is not None:
        return "rendezvous", f"RANK={rank} is claimed twice: first by {first}"
    return None


def judge_strays(strays, hosts=()):
    """One FAIL per process refused at the roll call (stray_reason): the launch started a process that
    is not a rank of this run. A second claim of a rank names the stray's host (its own process: 'own'). A
    process launched with another WORLD_SIZE than rank 0's is unlike rank 0, which may be the odd one itself:
    its host is named only when the strays' hosts are a strict minority of every host seen (hosts: the run's,
    from the roll call); else no host is named."""
    out, seen = [], set(hosts) | {x["host"] for x in strays}
    odd = {x["host"] for x in strays if x["check"] == "world-size"}
    kind = minority_kind(odd, seen) if odd else "majority"
    for x in sorted(strays, key=lambda x: (x["rank"], x["host"], x["pid"])):
        f = finding(x["check"], "FAIL", f"a process with RANK={x['rank']} (pid {x['pid']} on {x['host']}) "
                    f"joined the roll call but is not a rank of this run: {x['why']}; two launches share "
                    f"MASTER_ADDR:MASTER_PORT, or the launcher gave out RANK/WORLD_SIZE wrong",
                    [x["host"]], [x["rank"]], blame="own" if x["check"] != "world-size" else "majority")
        out.append(f if x["check"] != "world-size" or kind == "majority" else unlocalised(
            f, kind, "the launch's WORLD_SIZE on every node (rank 0's node may be the odd one)"))
    return out

def forged_what(key, claim):
    """What a refused store value claimed to be, in words (the claim is quoted, never believed)."""
    try:
        c = json.loads(claim)
    except ValueError:
        c = None
    c = c if isinstance(c, dict) else {}
    kind, _, rest = key.partition("/")
    who = f" claiming rank {c['rank']}" if "rank" in c else ""
    if "/" not in rest and kind in ("screen", "posts"):  # one round's or one phase's post
        return f"a screen post{who} in round {rest}" if kind == "screen" else f"a {rest} post{who}"
    host = f" (claiming host {c['host']})" if c.get("host") else ""
    words = {"id": f"a record for rank {rest}{host}", "stamp": f"a progress stamp for rank {rest}",
             "live": f"a liveness post for node {rest}", "errors": f"an error report{who}",
             "gate": f"rank 0's gate {rest}", "ack": f"an acknowledgement for rank {rest}",
             "verdict": f"the verdict (claiming exit code {claim[:8]})", "world": "the world record",
             "who": f"a claim on rank {rest} ({claim[:80]})", "strays": f"a stray's record{who}",
             "node": f"the rank list of node {rest}", "all_arrived": "the roll call's all-arrived mark",
             "forged": "a report of a refused value", "screen": f"the screen plan {rest}"}
    return words.get(kind, f"the value of {key}")


def judge_forged(forged, master, limit=4):
    """One FAIL per store value that was refused (Seal): something outside the job wrote to the store, or
    a rank runs without the job's secret. Tamper findings name no host, and while one stands nobody is
    excluded: the run's own evidence came through that store (Coordinator.state)."""
    unsigned = ", or a rank of this job was started without its AIV_JOB_SECRET"
    out = [dict(finding("rendezvous", "FAIL", f"{forged_what(e['key'], e.get('claim') or '')} {e['why']}: something "
                        f"outside the job writes to MASTER_PORT ({master})"
                        f"{unsigned if 'unsigned' in e['why'] else ''}; no host is excluded on this run's evidence"),
                tamper=True) for e in forged[:limit]]
    if len(forged) > limit:
        out[-1]["reason"] += f" ({len(forged) - limit} more refused value(s) not shown)"
    return out


def judge_channel(authenticated, nodes, master):
    """Whether the side channel was authenticated: PASS with the job's secret, WARN without one on more
    than one node (anything that reaches MASTER_PORT could write the roll call and the verdict)."""
    if authenticated:
        return [finding("rendezvous", "PASS", "side channel authenticated: every value on the store carried the "
                        "job's secret (HMAC-SHA256) and this run's id")]
    if nodes > 1:
        return [finding("rendezvous", "WARN", f"side channel not authenticated: AIV_JOB_SECRET is not set, so "
                        f"anything that reaches MASTER_PORT ({master}) can write the roll call, the culprits and "
                        "the verdict; submit_smoke_test.sbatch sets one, under torchrun export one "
                        "(docs/launchers.md)")]
    return []


def judge_store_peers(peers, allowed, authenticated, master):
    """Connections to rank 0's store from an address that is no node of the run (peers, allowed: IP
    strings): WARN when every value is authenticated anyway, FAIL (no host excluded) when not."""
    outside = sorted(set(peers) - set(allowed))
    if not outside:
        return []
    what = (f"{len(outside)} connection source(s) to the store at {master} outside the run's nodes: "
            f"{', '.join(outside[:8])}{' ...' if len(outside) > 8 else ''}")
    if authenticated:
        return [finding("rendezvous", "WARN", f"{what}; the side channel is authenticated, so nothing they wrote "
                        "was believed")]
    return [dict(finding("rendezvous", "FAIL", f"{what}; the side channel is not authenticated (AIV_JOB_SECRET "
                         "unset), so what they wrote cannot be told from the run's own records; no host is excluded "
                         "on this run's evidence"), tamper=True)]


def judge_layout(records, expect):
    """Nodes count, ranks per node, local ranks 0..k-1 exactly once on every node. How the launcher placed
    the ranks is not a node's fault: the findings name no host (evidence 'launch')."""
    out = []
    hosts = _by_host(records)
    for host, rs in sorted(hosts.items()):
        locs = sorted(r["local_rank"] for r in rs)
        if locs != list(range(len(rs))):
            dups = sorted({x for x in locs if locs.count(x) > 1})
            gaps = sorted(set(range(len(rs))) - set(locs))
            what = "; ".join(f"{w} {format_ranges(xs)}" for w, xs in (("duplicate", dups), ("missing", gaps)) if xs)
            out.append(unlocalised(finding("layout", "FAIL", f"node {host} has local ranks "
                                           f"{','.join(map(str, locs))} ({what}), expected 0..{len(rs) - 1} once "
                                           "each", [host], [r["rank"] for r in rs]), "launch"))
    want_nodes = expect.get("nodes")
    if want_nodes is not None and want_nodes != len(hosts):
        out.append(finding("layout", "FAIL", f"{len(hosts)} node(s) reported ({compress_hostlist(sorted(hosts))}) "
                           f"but {want_nodes} were expected"))
    rpn = expect.get("ranks_per_node")
    out += [unlocalised(finding("layout", "FAIL", f"node {host} runs {len(rs)} ranks but {rpn} per node were "
                                "expected", [host], [r["rank"] for r in rs]), "launch")
            for host, rs in sorted(hosts.items()) if rpn is not None and len(rs) != rpn]
    counts = "/".join(map(str, sorted({len(rs) for rs in hosts.values()})))
    return out or [finding("layout", "PASS", f"{len(hosts)} node(s) x {counts} rank(s), local ranks 0..k-1 once on "
                           "every node")]


def judge_gpu_affinity(records):
    """No two ranks anywhere on one physical GPU (UUIDs are globally unique). A node that binds two ranks
    to one GPU is named when it is unlike a strict majority of the nodes (its own configuration); when most
    nodes do it, the launch does: FAIL, no host named."""
    gpu_recs = [r for r in records if r.get("gpu")]
    if not gpu_recs:
        return []
    out, seen = [], group_by(gpu_recs, lambda r: r["gpu"].get("uuid") or f"{r['host']}/{r['gpu'].get('pci')}")
    shared = [rs for _, rs in sorted(seen.items()) if len(rs) > 1]
    kind = minority_kind({r["host"] for rs in shared for r in rs}, {r["host"] for r in gpu_recs})
    for rs in shared:
        g = rs[0]["gpu"]
        f = finding("gpu-affinity", "FAIL", f"{' and '.join(_rank_str(r) for r in rs)} share one GPU "
                    f"{g.get('uuid') or '?'} (pci {g.get('pci') or '?'}, cuda:{rs[0].get('device')}, "
                    f"CUDA_VISIBLE_DEVICES={rs[0].get('cvd')})", [r["host"] for r in rs], [r["rank"] for r in rs],
                    blame="majority")
        out.append(f if kind == "majority" else unlocalised(
            f, kind, "the launch's GPU binding (--gpus-per-task, CUDA_VISIBLE_DEVICES) on every node"))
    return out or [finding("gpu-affinity", "PASS", f"{len(gpu_recs)} rank(s) on {len(seen)} distinct GPU(s)")]


def judge_numa(records):
    out = []
    for r in records:
        g = r.get("gpu") or {}
        if g.get("numa") is None or g["numa"] < 0 or not g.get("numa_cpus"):
            continue
        try:
            numa_cpus = set(parse_ranges(g["numa_cpus"]))
            aff = set(parse_ranges(r["cpus"]))
        except (ValueError, KeyError):
            continue
        if not numa_cpus & aff:
            out.append(finding("numa", "WARN", f"{_rank_str(r)} runs on CPUs {r['cpus']} but its GPU "
                               f"{g.get('pci')} is on NUMA node {g['numa']} (CPUs {g['numa_cpus']})",
                               [r["host"]], [r["rank"]], blame="own"))
    return out


def _spread(values):
    """{value: [hosts]} -> 'v1 on h[1-2]; v2 on h3'."""
    return "; ".join(f"{v} on {compress_hostlist(sorted(hs))}" for v, hs in sorted(values.items(), key=str))


def _differs(check, sev, text, values, localise=None, records=()):
    """A finding that `text` differs across nodes (values: {value: hosts}): the nodes unlike a strict majority
    named (evidence 'majority'; their ranks among `records`), or with no majority (a tie) one finding naming no host."""
    odd, kind = odd_ones(values)
    f = finding(check, sev, f"{text}: {_spread(values)}", odd, [r["rank"] for r in records if r["host"] in odd],
                blame="majority")
    return f if kind == "majority" else unlocalised(f, kind, localise)


def _node_facts_unread(records):
    """{host: why} of nodes whose facts were not collected (the node leader's facts carry an error)."""
    return {r["host"]: r["node"]["error"] for r in records
            if isinstance(r.get("node"), dict) and r["node"].get("error")}


VERSION_FIELDS = (("torch", "FAIL", lambda r: r["versions"]["torch"]),
                  ("CUDA", "FAIL", lambda r: r["versions"]["cuda"]),
                  ("NCCL", "FAIL", lambda r: r["versions"]["nccl"]),
                  ("GPU model", "FAIL", lambda r: (r.get("gpu") or {}).get("name")),
                  ("driver", "FAIL", lambda r: (r.get("node") or {}).get("driver")),
                  ("python", "WARN", lambda r: r["versions"]["python"]),
                  ("OS", "WARN", lambda r: (r.get("node") or {}).get("os")),
                  ("kernel", "WARN", lambda r: (r.get("node") or {}).get("kernel")))
NODE_VERSION_FIELDS = ("driver", "OS", "kernel")  # from the node leader's facts: absent where not collected


def judge_versions(records):
    """Software stack identical across nodes: FAIL for torch/CUDA/NCCL/driver/GPU model, WARN for the rest.
    The nodes unlike a strict majority are named; a tie names none (with two nodes, which is right cannot be
    told: an accepted --manifest decides). A node whose facts were not collected is left out of the node
    fields (a WARN says so), never compared as 'None'."""
    out, unread = [], _node_facts_unread(records)
    for label, sev, get in VERSION_FIELDS:
        values = {}
        for r in records:
            if label not in NODE_VERSION_FIELDS or (r.get("node") and r["host"] not in unread):
                values.setdefault(str(get(r)), set()).add(r["host"])
        if len(values) > 1:
            out.append(_differs("versions", sev, f"{label} differs across nodes", values,
                                "an accepted --manifest (docs/manifest.md), or a run with a third node of the class"))
    if unread:
        out.append(unlocalised(finding("versions", "WARN", f"driver, OS and kernel not compared on "
                                       f"{compress_hostlist(sorted(unread))}: the node facts were not collected ("
                                       f"{next(iter(unread.values()))})", sorted(unread)), "not-collected"))
    if not any(f["status"] == "FAIL" for f in out):
        v = records[0]["versions"]
        nodes = {r["host"] for r in records}
        where = "on all nodes" if not unread else \
            f"on the {len(nodes - set(unread))} of {len(nodes)} node(s) compared"
        driver = next(((r.get("node") or {}).get("driver") for r in records
                       if r.get("node") and r["host"] not in unread), None)
        out.insert(0, finding("versions", "PASS", f"torch {v['torch']}, CUDA {v['cuda'] or '-'}, NCCL "
                              f"{v['nccl'] or '-'}, driver {driver or '-'} identical {where}"))
    return out


def judge_imports(records):
    """torchvision / torchaudio import on every node (a WARN naming the node where not: its own state), at one
    version across nodes (WARN: the nodes unlike a strict majority)."""
    out, versions = [], {name: {} for name in PROBED_PACKAGES}
    for r in records:
        imp = (r.get("node") or {}).get("imports") or {}
        for name in PROBED_PACKAGES:
            st = imp.get(name)
            if st and not st.get("ok"):
                what = "is not installed" if _import_state(st) == "missing" else "does not import"
                out.append(finding("imports", "WARN", f"{name} {what} on {r['host']}: {st.get('error')}",
                                   [r["host"]], blame="own"))
            elif st:
                versions[name].setdefault(str(st.get("version")), set()).add(r["host"])
    return out + [_differs("versions", "WARN", f"{name} differs across nodes", values)
                  for name, values in versions.items() if len(values) > 1]


def judge_fabric(records, ib_hca=None):
    """IB ports (those NCCL_IB_HCA names, when set) ACTIVE and at their siblings' rate (WARN, the node's own
    state); a node's rate, or its having IB ports at all, unlike a strict majority of the nodes (WARN)."""
    out = []
    nodes = {r["host"]: r["node"] for r in records if r.get("node")}
    with_ib = {h: ps for h, n in nodes.items() if (ps := ib_hca_select(ib_hca, n.get("ib") or []))}
    if not with_ib:
        return [finding("fabric", "PASS", "no InfiniBand ports on any node (sockets only)")] if nodes else []
    node_max = {h: max((p["rate_gbps"] or 0) for p in ps) for h, ps in with_ib.items()}
    for h, ps in sorted(with_ib.items()):
        for p in ps:
            if p["state"] != "ACTIVE":
                out.append(finding("fabric", "WARN", f"{h} {p['port']} is {p['state']}", [h], blame="own"))
            elif (p["rate_gbps"] or 0) < node_max[h]:
                out.append(finding("fabric", "WARN", f"{h} {p['port']} runs at {p['rate_gbps']:g} Gb/s, "
                                   f"below {node_max[h]:g} Gb/s of its sibling ports", [h], blame="own"))
    rates = group_by(node_max, lambda h: f"{node_max[h]:g} Gb/s")
    if len(rates) > 1:
        out.append(_differs("fabric", "WARN", "the fastest InfiniBand port's rate differs across nodes", rates))
    missing = sorted(set(nodes) - set(with_ib))
    if missing:
        out.append(_differs("fabric", "WARN", "InfiniBand ports present on some nodes only",
                            {"present": set(with_ib), "absent": set(missing)}))
    n = sum(len(ps) for ps in with_ib.values())
    return out or [finding("fabric", "PASS", f"{n} InfiniBand port(s) ACTIVE at {max(node_max.values()):g} Gb/s on "
                           f"{len(with_ib)} node(s)")]


SHM_MIN = 1 << 30          # NCCL's SHM transport needs more than a container's 64 MiB default
GPU_BUSY_MIN = 2 << 30     # memory already used on a GPU before we allocate (our context is ~0.5 GiB)


def judge_day0(records):
    """The basics that break NCCL in practice (WARN, each the node's own state)."""
    out = []
    per_host = {h: len(rs) for h, rs in _by_host(records).items()}
    for r in records:
        n, h = r.get("node"), r["host"]
        g = r.get("gpu") or {}
        if g.get("mem_used") is not None and g["mem_used"] > GPU_BUSY_MIN:
            out.append(finding("day0", "WARN", f"{_rank_str(r)}: {human_bytes(g['mem_used'])} of GPU "
                               f"{g.get('pci')} already in use by other processes", [h], [r["rank"]], blame="own"))
        if not n:
            continue
        has_ib = any(p["state"] == "ACTIVE" for p in n.get("ib") or [])
        if has_ib and n.get("memlock") != "unlimited":
            out.append(finding("day0", "WARN", f"{h}: locked-memory limit is {human_bytes(n.get('memlock'))}, "
                               f"not unlimited (ulimit -l); RDMA registration can fail", [h], blame="own"))
        if n.get("shm") is not None and n["shm"] < SHM_MIN and per_host.get(h, 1) > 1:
            out.append(finding("day0", "WARN", f"{h}: /dev/shm is {human_bytes(n['shm'])}, below "
                               f"{human_bytes(SHM_MIN)}; NCCL's shared-memory transport can fail", [h], blame="own"))
        if has_ib and g and not n.get("peermem"):
            out.append(finding("day0", "WARN", f"{h}: InfiniBand present but nvidia_peermem is not loaded "
                               f"(no GPUDirect RDMA)", [h], blame="own"))
    return out + judge_node_smi(records)


def judge_node_smi(records):
    """A WARN per node whose GPU facts from its one nvidia-smi call (node.smi) were not read: no answer within
    its bound (NODE_SMI_S), an error, or no row for a rank's GPU. It names the node, the GPUs (index, UUID,
    rank), what was not read and the bound: facts never read are never a silent PASS, and never blame a host
    (evidence 'not-collected')."""
    out = []
    for h, rs in sorted(_by_host(records).items()):
        if not (smi := next((r["node"].get("smi") for r in rs if r.get("node")), None)):
            continue
        gpus = sorted((r for r in rs if (r.get("gpu") or {}).get("uuid")), key=lambda r: r["local_rank"])
        missing = gpus if smi.get("unread") else [r for r in gpus if r["gpu"]["uuid"].startswith("GPU-")
                                                  and r["gpu"]["uuid"] not in (smi.get("gpus") or {})]
        if not smi.get("unread") and not missing:
            continue
        who = ", ".join(f"GPU {r['local_rank']} ({r['gpu']['uuid']}, rank {r['rank']})" for r in missing[:4]) + (
            f" and {len(missing) - 4} more" if len(missing) > 4 else "")
        if smi.get("unread"):
            bound = f"{smi.get('bound', NODE_SMI_S):g}s"
            text = (f"{h}: {smi['unread']}" + ("" if bound in smi["unread"] else f" (bound {bound})")
                    + f": {NODE_SMI_WHAT} not read for {who or 'its GPUs'}; a slow nvidia-smi is often NVML "
                    f"starting without persistence mode (nvidia-smi -pm 1, or nvidia-persistenced)")
        else:
            text = f"{h}: nvidia-smi listed no row for {who}: {NODE_SMI_WHAT} not read"
        out.append(unlocalised(finding("day0", "WARN", text, [h], [r["rank"] for r in (missing or rs)]),
                               "not-collected", "a re-run once nvidia-smi answers on the node"))
    return out


def judge_local(records):
    """The local checks each rank ran before any communication; one finding per distinct
    reason (ranks of one host that share a misconfiguration are named together). A local check is the
    rank's own state on its host (evidence 'own')."""
    merged = group_by((f for r in records for f in r.get("local") or [] if f["status"] != "PASS"),
                      lambda f: (f["check"], f["status"], f["reason"]))
    return [dict(fs[0], blame=fs[0].get("blame") or "own", ranks=sorted({x for f in fs for x in f["ranks"]}))
            for fs in merged.values()]


def judge_device_use(records):
    """One backend on every rank (the nodes unlike a strict majority named); with gloo asked for explicitly,
    say which GPUs were not exercised."""
    seen = {b: set(hs) for b, hs in group_by(records, lambda r: r.get("backend"), lambda r: r["host"]).items()}
    if len(seen) > 1:
        return [_differs("device", "FAIL", "ranks chose different backends", seen, records=records)]
    unused = {r["host"]: r["gpus_expected"] for r in records if r.get("backend") == "gloo" and r.get("gpus_expected")
              and not any(f["check"] == "device" for f in r.get("local") or [])}
    if unused:
        return [finding("device", "PASS", f"backend gloo as asked: GPUs present on {compress_hostlist(sorted(unused))} "
                        f"({next(iter(unused.values()))}) were not exercised")]
    return []


def judge_gloo_address(records):
    """A multi-node gloo run whose chosen address is loopback cannot connect across nodes (FAIL: the nodes
    unlike a strict majority named, none when most or all nodes do it); else say which interface and address
    gloo uses on each node."""
    gl = [r for r in records if r.get("backend") == "gloo" and r.get("gloo")]
    if not gl:
        return []
    hosts = {r["host"] for r in records}
    machines = {r.get("loopback") or r["host"] for r in records}  # node names sharing one loopback are one
    loop = {r["host"]: r["gloo"] for r in gl if r["gloo"]["loopback"]}
    if len(machines) > 1 and loop:
        g = next(iter(loop.values()))
        f = finding("interface", "FAIL", f"gloo would use the loopback address {g['addr']} on "
                    f"{compress_hostlist(sorted(loop))} ({g['how']}) in a {len(hosts)}-node run: set "
                    f"GLOO_SOCKET_IFNAME to the interface that reaches the other nodes, or map the hostname "
                    f"to that interface's address", sorted(loop), [r["rank"] for r in gl if r["host"] in loop],
                    blame="majority")
        kind = minority_kind(loop, hosts)
        return [f if kind == "majority" else unlocalised(f, kind, "GLOO_SOCKET_IFNAME for every node")]
    used = group_by(gl, lambda r: f"{r['gloo']['iface']}({r['gloo']['addr']})", lambda r: r["host"])
    return [finding("interface", "PASS", "gloo uses " + _spread({k: set(v) for k, v in used.items()}))]


NO_TORCH = ("the python this launch ran cannot import torch (no venv, the wrong python, PYTORCH_ENV unset): the "
            "job's environment, not a fault of a node", "bootstrap_env.sh, or the job pointed at the shared venv "
            "(PYTORCH_ENV); a node is named only when it alone, of several, cannot import what a strict majority "
            "of the job's nodes import")


def judge_no_torch(reports, imported_hosts, nodes=None):
    """The ranks whose python could not import torch ({rank: {'line', 'host'}}, their reports at the roll call)
    among the hosts whose ranks did (imported_hosts); nodes: the job's node count where the launch says it. Their
    hosts are named (`majority`, exit 1) only when a strict majority of the job's nodes imported torch; else exit 2,
    no host (a rank alone: imported_hosts empty)."""
    ranks = sorted(reports)
    bad = {reports[r].get("host") or "?" for r in ranks}
    good, hl = set(imported_hosts) - bad, compress_hostlist(sorted(bad))
    total = max(len(good | bad), int(nodes or 0))
    line = reports[ranks[0]]["line"].split("; no host is named:")[0] if ranks else ""  # judged alone, it said so
    line += f"; rank(s) {format_ranges(ranks)} on {hl} cannot either" if len(ranks) > 1 else ""
    if ranks and len(good | bad) > 1 and 2 * len(good) > total:
        return [finding("local", "FAIL", f"{line}; {len(good)} of {total} node(s) import torch in this launch: {hl} "
                        "alone cannot", sorted(bad), ranks, code=EXIT_FAIL, blame="majority")]
    return [unlocalised(finding("local", "FAIL", line, sorted(bad), ranks, code=EXIT_USAGE), "launch", NO_TORCH[1],
                        NO_TORCH[0])] if ranks else []


def judge_pre(records, world_size, expect):
    """Stage 1, from the roll call alone, before NCCL exists. The layout is judged only over a
    complete roll call: a missing rank is the cause, not a layout fault."""
    complete = len(records) == world_size
    return (judge_local(records) + judge_device_use(records) + judge_world_size(world_size, expect)
            + (judge_layout(records, expect) if complete else []) + judge_gpu_affinity(records)
            + (judge_gloo_address(records) if complete else []))


def judge_gate(records, ib_hca=None):
    """Stage 2, from the gathered telemetry, before the collectives: node facts, and the numerics each rank
    computed (judge_numerics_records; nothing when the ranks carry none: --skip-numerics)."""
    return (judge_numa(records) + judge_versions(records) + judge_fabric(records, ib_hca) + judge_day0(records)
            + judge_numerics_records(records))


def judge_final(records, results, world_size, host_of=None, ib_disable=None, bandwidth=None, min_busbw=None):
    """Stage 3, after the collectives and the DDP step: packages, the collectives' values, NCCL's
    transport, the bandwidth probe (records: with_results applied)."""
    return (judge_imports(records) + judge_collectives(results, world_size, host_of)
            + judge_transport(records, ib_disable) + judge_bandwidth(bandwidth, min_busbw))


def judge_all(records, world_size, expect, ib_hca=None, results=None, ib_disable=None, bandwidth=None,
              min_busbw=None):
    """The stages the runtime runs, in one call, on the same functions (judge_pre at the roll call,
    judge_gate at the telemetry, judge_final after the DDP step; the manifest and screen judges follow in
    their own rooms). results: the DDP step's per-rank results (None: the run stopped before them)."""
    out = judge_pre(records, world_size, expect) + judge_gate(records, ib_hca)
    if results is not None:
        out += judge_final(with_results(records, results), results, world_size,
                           {r["rank"]: r["host"] for r in records}, ib_disable, bandwidth, min_busbw)
    else:
        out += judge_imports(records)
    return out


# What every rank's record holds, wherever the run stopped (the JSON's `ranks`): the roll call's identity,
# the telemetry's numerics digests and node facts (node leaders; null on the others), the DDP step's NCCL facts (null
# before it, and on gloo). A record is never patched: each phase's results make new ones (with_results).
RANK_IDENTITY = ("rank", "host", "hostname", "loopback", "local_rank", "backend", "device", "cvd", "gpu",
                 "gpus_expected", "gloo", "cpus", "versions", "local", "pid", "pid_start", "addrs")
RANK_FIELDS = RANK_IDENTITY + ("numerics", "node", "transport", "nccl_net", "nccl_log")


def rank_record(rec):
    """A rank's record in the declared schema (RANK_FIELDS, null where not measured), a new dict."""
    return {k: rec.get(k) for k in RANK_FIELDS}


def with_results(records, results):
    """New records with the DDP step's results of each rank: NCCL's transport and interfaces (and where its
    lines were read: nccl_log), and the node leader's package probe in its node facts."""
    by_rank = {res["rank"]: res for res in results or () if isinstance(res, dict) and "rank" in res}
    out = []
    for rec in records:
        rec, res = rank_record(rec), by_rank.get(rec["rank"])
        if res is not None:
            rec.update({k: res.get(k) for k in ("transport", "nccl_net", "nccl_log")})
            if rec["node"] is not None and res.get("imports") is not None:
                rec["node"] = dict(rec["node"], imports=res["imports"])
        out.append(rec)
    return out


def judge_collectives(results, world_size, host_of=None):
    """results: per rank {'rank', 'ar_ok', 'ar_sum', 'grads'} (grads: a digest of the gradient bytes);
    host_of: rank -> host (default: each result's own 'host'). A rank whose all_reduce result is wrong while
    a strict majority got the exact value is named (its result unlike theirs); every rank or no majority
    wrong: FAIL, no host. DDP gradients are compared across ranks (not with rank 0's): the ranks unlike a
    strict majority are named; a tie names none."""
    out = []
    host_of = host_of or {r["rank"]: r.get("host", "?") for r in results}
    want = world_size * (world_size + 1) // 2

    def who(rs):
        return ", ".join(f"rank {r['rank']} ({host_of.get(r['rank'], '?')})" for r in rs)
    bad = [r for r in results if not r["ar_ok"] or int(r["ar_sum"]) != want]
    if bad:
        f = finding("collective", "FAIL", "all_reduce returned wrong values on " + ", ".join(
            f"{who([r])} (sum {r['ar_sum']}, expected {want}{', pattern wrong' if not r['ar_ok'] else ''})"
            for r in bad), [host_of.get(r["rank"], "?") for r in bad], [r["rank"] for r in bad], blame="majority")
        if 2 * len(bad) >= len(results):  # no strict majority got the exact value: not a host's result
            f = unlocalised(f, "everyone" if len(bad) == len(results) else "tie",
                            "the screen's pair results and the numerics check (a GPU computing wrong), or a run "
                            "with more nodes")
        out.append(f)
    else:
        out.append(finding("collective", "PASS", f"all_reduce exact on {len(results)} rank(s): "
                           f"sum {want} = w(w+1)/2, element-wise pattern verified"))
    digests = group_by(results, lambda r: r["grads"] if isinstance(r["grads"], str) else repr(r["grads"]),
                       lambda r: r["rank"])
    if len(digests) > 1:
        odd, kind = odd_ones(digests)
        text = "; ".join(f"ranks {format_ranges(rs)}" if len(rs) > 1 else f"rank {rs[0]}" for rs in
                         sorted(digests.values(), key=len, reverse=True))
        named = [r for r in results if r["rank"] in odd]
        f = finding("ddp", "FAIL", f"DDP gradients after the all-reduce differ across ranks ({len(digests)} distinct "
                    f"results: {text}); unlike the {'majority' if kind == 'majority' else 'others'}: {who(named)}",
                    [host_of.get(r["rank"], "?") for r in named], [r["rank"] for r in named], blame="majority")
        out.append(f if kind == "majority" else unlocalised(f, kind, "a run with more ranks, and the numerics "
                                                                     "check's DDP-gradient rows"))
    else:
        out.append(finding("ddp", "PASS", f"DDP gradients identical on {len(results)} rank(s)"))
    return out


def judge_transport(records, ib_disable=None):
    """Per node, the transport NCCL used; sockets between nodes while IB is ACTIVE is a FAIL (every
    correctness check passes, at ~1/100 of the bandwidth). An NCCL rank whose transport was not read (its
    record's nccl_log says where NCCL's lines went: the job's stdout with the operator's NCCL_DEBUG=INFO, an
    operator's NCCL_DEBUG_FILE with no INFO line in it) is a WARN naming its nodes and why: a transport not
    judged is never a silent PASS."""
    per_host, unread = {}, {}
    for r in records:
        if r.get("transport") is not None:
            per_host.setdefault(r["host"], set()).update(r["transport"])
        elif r.get("backend") == "nccl":
            unread.setdefault(nccl_log_why(r.get("nccl_log")), set()).add(r["host"])
    nodes = {r["host"]: r.get("node") or {} for r in records if r.get("node")}
    out = []
    for h, kinds in sorted(per_host.items()):
        active = [p["port"] for p in nodes.get(h, {}).get("ib") or [] if p["state"] == "ACTIVE"]
        if "NET/Socket" in kinds and active and str(ib_disable).strip() != "1":
            out.append(finding("transport", "FAIL", f"{h}: NCCL used NET/Socket although InfiniBand port(s) "
                               f"{','.join(active[:4])} are ACTIVE and NCCL_IB_DISABLE is not 1 (IB not usable by "
                               f"NCCL: check the IB verbs libraries, NCCL_IB_HCA, /dev/infiniband access)", [h]))
    out += [finding("transport", "WARN", f"NCCL's transport was not judged on {compress_hostlist(sorted(hosts))}: "
                    f"{why}; an InfiniBand-to-socket fallback there would pass unseen", sorted(hosts))
            for why, hosts in sorted(unread.items())]
    if per_host and not any(f["status"] == "FAIL" for f in out):
        out.insert(0, finding("transport", "PASS", "NCCL transports: " + "; ".join(
            f"{'+'.join(sorted(k)) or 'none'} on {compress_hostlist(sorted(hs))}"
            for k, hs in group_by(per_host, lambda h: tuple(sorted(per_host[h]))).items()), sorted(per_host)))
    return out


def nccl_log_why(log):
    """Why NCCL's INFO lines of a rank were not read, from its record's nccl_log (NcclLog.facts)."""
    src, path = (log or {}).get("source"), (log or {}).get("path")
    if src == "stdout":
        return ("NCCL_DEBUG=INFO (the job's own setting) sends NCCL's lines to the job's stdout, which the tool cannot "
                "read: look for ' via NET/Socket' in this log, or set NCCL_DEBUG_FILE (the tool reads that file), or "
                "leave NCCL_DEBUG unset (the tool keeps NCCL's lines in a private file)")
    if src == "operator":
        hidden = (log or {}).get("subsys")
        return (f"the job's own NCCL_DEBUG_FILE ({path}) holds " + (
            f"no line of NCCL's channels (NCCL_DEBUG_SUBSYS={hidden} leaves out INIT and NET)" if hidden else
            "no INFO line of NCCL (NCCL writes them there only with NCCL_DEBUG=INFO)"))
    if src == "private":
        return f"NCCL wrote no INFO line to the rank's private log ({path})"
    return "the rank's NCCL log facts did not come with its results"
def judge_bandwidth(results, min_busbw=None):
    """results: [{'bytes', 'busbw', ...}] measured on the whole job; FAIL below --min-busbw."""
    if not results:
        return []
    top = max(results, key=lambda b: b["bytes"])
    txt = ", ".join(f"{human_bytes(b['bytes'])} {b['busbw']:.1f} GB/s" for b in results)
    if min_busbw is not None and top["busbw"] < min_busbw:
        return [finding("bandwidth", "FAIL", f"all_reduce busbw {top['busbw']:.1f} GB/s at "
                        f"{human_bytes(top['bytes'])} is below --min-busbw {min_busbw:g} GB/s ({txt})")]
    return [finding("bandwidth", "PASS", f"all_reduce busbw: {txt}")]


def apply_strict(findings, strict):
    """--strict: every WARN a FAIL, marked `strict` (named as its evidence allows, never drained: drainable)."""
    return [dict(f, status="FAIL", strict=True) if strict and f["status"] == "WARN" else f for f in findings]


UNFINISHED_WORDS = {"dead": "dead (process gone)", "frozen": "frozen (process stopped)",
                    "silent": "unreachable (its node's monitor and ranks stopped reporting)",
                    "error": "reported an error",
                    "stuck": "alive, not finished",
                    "terminated": "terminated by a signal (scancel, the time limit, preemption or the launcher)",
                    "internal": "hit an error inside the tool"}
# a live rank that did not finish, by what it posted when rank 0 asked (hang.issued_states); "behind" ranks
# are said with never_issued_text
ISSUED_WORDS = {"waiting": "alive, inside a collective (waiting for its peers)",
                "idle": "alive, outside any collective",
                "between": "alive, between two collective calls",
                "unposted": "alive, posted no record of what it issued within {s:g}s"}
PROCESS_KINDS = ("dead", "frozen", "silent")  # evidence of a rank's own process state
STOPPED_WORDS = "the run was stopped from outside, not by a fault of the cluster: no host is blamed"
NOT_BLAMED = " (not blamed)"


def unfinished_parts(ranks_of, states, named, host_of, by_issued):
    """The words for the ranks that did not finish, kind by kind (UNFINISHED_WORDS; ranks_of(kind): its
    ranks), the live ones ('stuck') by what they issued last (ISSUED_WORDS) when by_issued; where some rank
    is named (named), the others say they are not blamed."""
    parts = []
    for k, words in UNFINISHED_WORDS.items():
        rs = ranks_of(k)
        if k == "stuck" and by_issued:
            by_state = group_by(rs, states.get)
            parts += [f"{on_hosts(by_state[s], host_of)} {w.format(s=ISSUED_S)}" + (NOT_BLAMED if named else "")
                      for s, w in ISSUED_WORDS.items() if s in by_state]
            rs = [r for r in rs if states.get(r) not in ISSUED_WORDS]
        if rs:
            parts.append(f"{on_hosts(rs, host_of)} {words}" + (NOT_BLAMED if named and not set(rs) & named else ""))
    return parts


def finished_by(stamps, done, phase):
    """stamps ({rank: index in PHASES of its last finished phase}) with the ranks in `done` counted as having
    finished `phase` (they posted their part of it: they wait for rank 0, not stuck themselves)."""
    idx = PHASES.index(phase)
    return {r: max(s, idx) if r in done else s for r, s in stamps.items()}


def unfinished_kind(r, live, errors, host_of, silent_hosts=()):
    """A rank that did not finish: one key of UNFINISHED_WORDS (see judge_unfinished)."""
    e = errors.get(r, {})
    first = (("terminated", e.get("term")), ("internal", e.get("internal")), ("dead", live.get(r) == "gone"),
             ("frozen", live.get(r) == "stopped"), ("silent", host_of.get(r) in silent_hosts), ("error", r in errors))
    return next((kind for kind, seen in first if seen), "stuck")


def unreachable_hosts(silent, quiet, own_host, host_of, errors):
    """(unreachable, quiet) from settled_live's silent and quiet nodes. A silent node is unreachable only
    when nothing else shows it reaches the store: never rank 0's own node (rank 0 reads its ranks from
    /proc), never a node one of whose ranks posted an error report. The others join quiet: the tool's own
    monitor was slow or stopped there, a note in the verdict, no host blamed for it (not said of a node
    whose ranks all reported: what happened to them is said already)."""
    spoke = {host_of.get(r) for r in errors}
    unreachable = {h for h in silent if h != own_host and h not in spoke}
    told = {h for h in spoke if all(r in errors for r, x in host_of.items() if x == h)}
    return unreachable, (set(quiet) | set(silent)) - unreachable - told


def quiet_monitor_note(quiet, budget):
    """The verdict's note on node monitors that did not post while their nodes were otherwise seen."""
    return (f"note: the liveness monitor of {compress_hostlist(sorted(quiet))} posted nothing within {budget:g}s (the "
            "tool's own process, slow to start or to post under CPU load, or stopped) and nothing else showed "
            "the node unreachable: no host is blamed for it")


def hang_culprits(kinds, late, world, states, finished, recorded, all_issued=None):
    """The one blame law on work that did not finish, a phase of every rank or a screen round of groups:
    -> (culprits, check or None, code or None, evidence, unlocalised or None). kinds: {rank: UNFINISHED_WORDS
    key} of every rank; late: the ranks that did not finish; states: {rank: one of ISSUED_STATES} of the late
    live ranks, what they issued last (hang.issued_states of their group), "idle" for a rank outside any
    collective; finished: whether some rank finished; recorded: whether what the ranks issued was collected
    where the work issues collectives; all_issued: (words, hint) when the live ranks wait inside a collective
    every member of its group issued (the caller knows its groups), else None. In order: a rank's own process
    state anywhere in the world (dead, frozen, unreachable: also a rank that finished its part and then
    died), whatever else happened; a signal (`interrupted`) or the tool's own error (`internal`), whose
    consequences are nobody's fault; errors ranks reported themselves (when not every rank did); then, among
    the live ranks that did not finish, those that never issued a collective their peers issued, and, while
    a peer finished, those outside any collective that never finished their part. Anything else (every rank
    inside the collective, records not collected, every rank alike) FAILs naming no host, saying what would
    localise it."""
    hard = [r for r in range(world) if kinds[r] in PROCESS_KINDS]
    if hard:
        return hard, None, EXIT_FAIL if any(kinds[r] == "dead" for r in hard) else EXIT_TIMEOUT, "process", None
    if any(kinds[r] == "terminated" for r in range(world)):
        return [], "interrupted", EXIT_INTERRUPTED, "signal", None
    if any(kinds[r] == "internal" for r in range(world)):
        return [], "internal", EXIT_INTERNAL, "tool", None
    errs = [r for r in late if kinds[r] == "error"]
    if errs and len(errs) < world:
        return errs, None, None, "own", None
    if errs:
        return [], None, None, "everyone", unlocalised_record(
            "every rank reported an error of its own, so none is unlike its peers", RERUN_HINT)
    stuck = [r for r in late if kinds[r] == "stuck"]
    named = [r for r in stuck if states.get(r) == "behind" or (finished and states.get(r) == "idle")]
    if named:
        return named, None, EXIT_TIMEOUT, "never-issued", None
    if not stuck:
        return [], None, EXIT_TIMEOUT, "not-collected", unlocalised_record(
            "every rank did its part and none is behind; what held it back was not seen", RERUN_HINT)
    unposted = [r for r in stuck if states.get(r) == "unposted"]
    if unposted or not recorded:
        who = f"rank(s) {ranks_text(unposted)}" if unposted else "the ranks"
        return [], None, EXIT_TIMEOUT, "not-collected", unlocalised_record(
            f"what {who} issued last was not collected (a rank whose main thread holds the interpreter, or a "
            "store connection that did not answer), and no other evidence singles one out", RERUN_HINT)
    if all_issued:
        return [], None, EXIT_TIMEOUT, "all-issued", unlocalised_record(*all_issued)
    if all(states.get(r) == "idle" for r in stuck):
        return [], None, EXIT_TIMEOUT, "everyone", unlocalised_record(
            "every rank that did not finish is alive and outside any collective: none is behind another",
            RERUN_HINT)
    return [], None, EXIT_TIMEOUT, "not-collected", unlocalised_record(
        "the ranks that did not finish are alive and none is behind another (some inside a collective, some "
        "between calls), and no other evidence singles one out", RERUN_HINT)


def judge_unfinished(phase, cause, world, host_of, stamps, live, errors, code=None, silent_hosts=(), issued=None,
                     fabric_hint=None):
    """Who did not finish `phase` (one FAIL finding). A rank whose last stamp is before the phase is dead
    (its process is gone), frozen (stopped), unreachable (its node's monitor went silent), was terminated by
    a signal, hit the tool's own error, reported an error, or is alive: then, in a phase that issues
    collectives, what it posted when rank 0 asked (issued: {rank: post or None}; None: not asked) tells
    whether it never issued a collective its peers issued (named), waits inside one (not named), or is
    outside any. The culprits and the evidence: see hang_culprits. A run stopped by a signal with no
    other culprit is check `interrupted` (exit 5), one stopped by the tool's own error `internal` (exit 4),
    naming no host. Exit code otherwise: 1 when a rank is dead, 3 when one is frozen, unreachable or stuck,
    else `code` (the reported error's). A FAIL that names no host says so, why, and what would localise it
    (its 'unlocalised'); every finding carries its 'blame'.

    stamps: {rank: index in PHASES of its last finished phase}; live: {rank: running|stopped|gone};
    errors: {rank: {'line', 'term', 'internal'}}; host_of: {rank: host}."""
    idx = PHASES.index(phase)
    late = [r for r in range(world) if stamps.get(r, -1) < idx]
    finished = [r for r in range(world) if r not in late]
    kinds = {r: unfinished_kind(r, live, errors, host_of, silent_hosts) for r in range(world)}
    stuck = [r for r in late if kinds[r] == "stuck"]
    an = issued_states(range(world), issued, stuck, group_key(range(world))) if issued is not None else None
    states = an["states"] if an else {r: "idle" for r in stuck} if phase not in ISSUE_PHASES else {}
    waiting = [r for r in stuck if states.get(r) == "waiting"]
    all_issued = None
    if an and an["front"] and waiting:
        every = all((an["last"].get(r) or [None, -1])[1] == an["front"][1] for r in stuck)
        what = (f"every rank issued {op_text(an['front'])} and it did not finish" if every else
                f"ranks {ranks_text(waiting)} wait inside a collective and no rank is stopped outside one")
        all_issued = (f"{what}: the fabric or a link between the ranks, which no rank's own state singles out",
                      fabric_hint or FABRIC_HINT)
    culprits, check, ccode, evidence, unloc = hang_culprits(kinds, late, world, states, bool(finished),
                                                            bool(an) or phase not in ISSUE_PHASES, all_issued)
    code = ccode or code or EXIT_FAIL
    detail = _unfinished_detail(kinds, late, an, culprits, evidence, host_of, phase, finished)
    first_err = next((errors[r]["line"] for r in culprits or late if r in errors and not errors[r].get("term")), None)
    reason = (f"{cause}: {detail}; {len(finished)}/{world} rank(s) finished {phase}"
              + (f"; first error: {first_err}" if first_err else "")
              + (f"; {STOPPED_WORDS}" if check == "interrupted" else "")
              + ("; a bug in the tool, not a fault of the cluster: no host is blamed" if check == "internal" else "")
              + (f"; {unlocalised_words(unloc)}" if unloc else ""))
    f = finding(check or PHASE_CHECK[phase], "FAIL", reason, [host_of.get(r, "?") for r in culprits], culprits,
                code=code, blame=evidence)
    if unloc:
        f["unlocalised"] = unloc
    if an:
        f["issued"] = {"source": an["source"], "front": an["front"], "issuers": an["issuers"],
                       "states": {str(r): s for r, s in sorted(an["states"].items())},
                       "last": {str(r): x for r, x in sorted(an["last"].items())}}
    return f


def _unfinished_detail(kinds, late, an, culprits, evidence, host_of, phase, finished):
    """The finding's words: each rank that did not finish (or whose process is gone) by what it was doing;
    when some are named, the others say they are not."""
    named, parts = set(culprits), []
    shown = [r for r in sorted(kinds) if r in late or kinds[r] in PROCESS_KINDS + ("terminated", "internal")]
    states = an["states"] if an else {}
    if evidence == "never-issued":
        behind = [r for r in culprits if states.get(r) == "behind"]
        src = "torch's flight recorder" if (an or {}).get("source") == "recorder" else "its own record"
        hows = (an or {}).get("how") or {}
        by_how = group_by(behind, hows.get)
        parts += [f"{never_issued_text(by_how[h], an, host_of)} ({words.format(src=src)})"
                  for h, words in BEHIND_WORDS.items() if h in by_how]
        rest = [r for r in culprits if r not in behind]
        if rest:
            parts.append(never_finished_text(rest, phase, finished, host_of) + " (alive, outside any collective)")
    parts += unfinished_parts(
        lambda k: [r for r in shown if kinds[r] == k and r not in (named if evidence == "never-issued" else ())],
        states, named, host_of, bool(an))
    return "; ".join(parts) if parts else "no rank is behind"


SCREEN_QUARTILE_MIN = 4     # fewer values: the reference is their maximum
SCREEN_SPREAD_MIN = 8       # fewer values: no noise estimate (the WARN fraction alone decides)


def screen_reference(values):
    """Robust reference of peer measurements (None values are skipped).
    -> {'ref': float|None, 'spread': float, 'count': int, 'how': 'upper quartile'|'maximum'}.
    ref: the upper quartile, or the maximum below SCREEN_QUARTILE_MIN values. spread: the peers'
    standard deviation estimated from the upper half of the values only (their population standard
    deviation / 0.6028, the ratio for the upper half of a normal distribution), so low outliers do not
    widen it; 0.0 below SCREEN_SPREAD_MIN values."""
    v = sorted(float(x) for x in values if x is not None)
    n = len(v)
    if not n:
        return {"ref": None, "spread": 0.0, "count": 0, "how": "maximum"}
    quart = n >= SCREEN_QUARTILE_MIN
    spread = 0.0
    if n >= SCREEN_SPREAD_MIN:
        top = v[n // 2:]
        mean = sum(top) / len(top)
        spread = math.sqrt(sum((x - mean) ** 2 for x in top) / len(top)) / 0.6028
    return {"ref": _screen_quantile(v, 0.75) if quart else v[-1], "spread": spread, "count": n,
            "how": "upper quartile" if quart else "maximum"}


def _import_state(st):
    if not st:
        return "-"
    if st.get("ok"):
        return st.get("version") or "?"
    return "missing" if "ModuleNotFoundError" in (st.get("error") or "") else "BROKEN"
