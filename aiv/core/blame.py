"""Floor 1: the blame law, in one place. A host is named (failed_hosts, exclude, a drain) only on evidence
that singles it out; every judge says which evidence its finding stands on (a finding's `blame`: a kind below), and
every finding passes through blame_gate at the verdict, which keeps a finding's hosts only when its
evidence singles a host out and its check declares that evidence (CHECK_RULES). A finding whose evidence
does not single a host out still FAILs (the cluster is not ready), names no host, and says why and what
would localise it. A check drains only on evidence it declares persistent (`drain`, with `why`)."""
from .base import CHECKS

# Evidence that singles a host out: a finding standing on it may name the host.
LOCALISING = {
    "process": "its own process state: dead, frozen or unreachable",
    "own": "its own state, seen on its host by its own rank: a local check, a device error, a counter, a process "
           "of its own",
    "persisted": "a measurement that persisted when measured again",
    "majority": "a fact unlike a strict majority of its class",
    "reference": "a result off the fp64 reference that its peers of the same model and software meet",
    "manifest": "a fact unlike the accepted manifest",
    "never-issued": "a collective it never issued while its peers did",
}

# Evidence that does not: the finding names no host. Each with why, and what would localise it.
UNLOCALISED = {
    "everyone": ("every member of its class, or most of them, alike: none is singled out",
                 "an accepted --manifest (docs/manifest.md) or the per-model table says which value is right"),
    "tie": ("no strict majority: the values split evenly, so this run cannot tell which side is wrong",
            "a run with a third node of the class, or an accepted --manifest (docs/manifest.md)"),
    "not-collected": ("the evidence did not come back from every node in time",
                      "a re-run: the facts that did not come back name their host when they do"),
    "once": ("measured once, not again", "a re-run: a value slow again when measured again names its host"),
    "all-issued": ("every rank issued the collective and none finished: the fabric between them, not a host",
                   "the screen's pair results (the inter-node rows), or a run with the screen on"),
    "stuck": ("alive but did not finish within its bound, and nothing shows what held it: a slow or loaded node is "
              "not a broken one",
              "a re-run: a rank stuck again is named by the collective it never issued; on a loaded node a longer "
              "bound (--timeout, --rollcall-timeout)"),
    "signal": ("a signal stopped the run from outside (scancel, the time limit, preemption, Ctrl-C)",
               "nothing on the cluster: resubmit"),
    "tool": ("the tool's own error, not a fault of the cluster", "a report of the line and the traceback"),
    "launch": ("how the launcher placed the ranks, not a fault of a node",
               "the launch command and the allocation (docs/slurm.md)"),
    "widespread": ("more nodes implicated than passed: a switch, the fabric or its configuration",
                   "the switches and the fabric's configuration; then a re-run"),
    "link": ("the path between the nodes, not either node: each is at speed with other partners",
             "the cables and the switch path between them; a re-run with other partners"),
    "forged": ("a value on the side channel failed authentication: the run's evidence came through a store written "
               "from outside the job, so no host is named on it",
               "a re-run with the job's secret (AIV_JOB_SECRET) on a MASTER_PORT nothing else reaches"),
    "undeclared": ("its check declares no evidence that names a host",
                   "a report of this line: a check must declare its evidence (docs/development.md)"),
}
EVIDENCE = tuple(LOCALISING) + tuple(UNLOCALISED)


NODE_CONTEXTS = ("prolog", "epilog", "health", "npd")  # the node gate's (--node-check CONTEXT)
NODE_COMPUTE = ("prolog", "health", "npd")  # where it computes; the epilog stays passive (the next job waits on it)


def rule(names=(), drain=(), why=None, contexts=("job",)):
    """A check's declaration: the evidence on which it may name a host (names), the part of it on which it may
    drain (drain: a subset of names, each with `why` that evidence persists) and where it runs (contexts:
    'job', the preflight; the node gate's NODE_CONTEXTS, where a FAIL on drain evidence fails a prolog or an
    epilog, drains the node or raises the NPD condition)."""
    names, drain = tuple(names), tuple(drain)
    if not set(names) <= set(LOCALISING) or not set(drain) <= set(names) or (drain and not why):
        raise ValueError(f"rule(names={names}, drain={drain}): names must be localising evidence, drain a part of "
                         "them, and a drain must say why its evidence persists")
    return {"names": names, "drain": drain, "why": why, "contexts": tuple(contexts)}


_PROCESS_WHY = ("a rank whose process died, froze or whose node stopped answering in the middle of a run is a "
                "fault of its node (its GPU, kernel, memory or network) that a re-run there meets again")
_NODE = ("job",) + NODE_COMPUTE  # checks the node gate (--node-check) also makes, where it computes
# Every check of CHECKS, declared. A check not declared here names no host and drains nothing.
CHECK_RULES = {
    "usage": rule(), "contract": rule(), "launch": rule(), "layout": rule(),
    "world-size": rule(("majority",)),  # a process launched with another WORLD_SIZE than most nodes' ranks
    "bandwidth": rule(), "internal": rule(), "interrupted": rule(), "output": rule(), "drain": rule(),
    "local": rule(("own", "majority"), ("own",), "a rank's own software or configuration on its host (a missing "
                  "numpy, an old torch, an interface) stays until the node is fixed"),
    "device": rule(("own", "majority"), ("own", "majority"), "a GPU that CUDA cannot use, or a node whose ranks "
                   "chose another backend than the rest, stays so until the node is repaired", _NODE),
    "interface": rule(("own", "majority"), ("own", "majority"), "a node's interfaces and the address its hostname "
                      "maps to stay until the node is reconfigured"),
    "rendezvous": rule(("process", "own"), ("process",), _PROCESS_WHY + "; so does a rank that never checked in "
                       "while its peers did"),
    "gpu-affinity": rule(("majority",), ("majority",), "a node that binds two ranks to one GPU, unlike the other "
                         "nodes, does so from its own configuration (gres.conf, its slurmd) on every run"),
    "numa": rule(("own",)),
    "versions": rule(("majority", "manifest"), ("majority", "manifest"), "software installed on a node stays "
                     "until it is reinstalled"),
    "imports": rule(("own", "majority")),
    "fabric": rule(("own", "majority")),
    "day0": rule(("own",)),
    "init": rule(("process", "own", "never-issued"), ("process",), _PROCESS_WHY),
    "telemetry": rule(("process", "own", "never-issued"), ("process",), _PROCESS_WHY),
    "collective": rule(("process", "own", "never-issued", "majority"), ("process",), _PROCESS_WHY),
    "ddp": rule(("process", "own", "never-issued", "majority"), ("process",), _PROCESS_WHY),
    "verdict": rule(("process", "own"), ("process",), _PROCESS_WHY),
    "transport": rule(("own",), ("own",), "NCCL falling back to sockets on a node whose InfiniBand ports are "
                      "ACTIVE is its own libraries or device access, which stay until fixed"),
    "manifest": rule(("manifest",), ("manifest",), "a node unlike the accepted manifest stays so until it is "
                     "reinstalled or the manifest is accepted anew", ("job",) + NODE_CONTEXTS),
    "gpu-perf": rule(("persisted", "own", "process", "never-issued"), ("persisted", "own", "process"),
                     "a GPU slow again when measured again, or whose row remapping failed, stays so until it "
                     "is repaired; " + _PROCESS_WHY, _NODE),
    "intra-node": rule(("persisted", "own", "process", "never-issued"), ("persisted", "own", "process"),
                       "a node slow inside in every try, beside known-good nodes, or whose own all-reduce returns "
                       "wrong sums, stays so until its NVLink, NVSwitch or PCIe is repaired; " + _PROCESS_WHY, _NODE),
    "inter-node": rule(("persisted", "process", "never-issued"), ("persisted", "process"),
                       "a node slow with two different partners after re-measurement and fine with none stays so "
                       "until its NIC, cable or switch port is repaired; " + _PROCESS_WHY),
    "soak": rule(("persisted", "own", "process"), ("persisted", "own", "process"),
                 "a GPU that slows down, overheats or brakes over a sustained load does so again under the next "
                 "job's load; " + _PROCESS_WHY),
    "numerics": rule(("reference", "majority", "own"), ("reference", "majority", "own"),
                     "a GPU that computed wrong bits (off the fp64 reference its peers meet, unlike a strict "
                     "majority of them, or unlike its own first result) computes wrong again: silent data "
                     "corruption persists until the GPU is replaced", _NODE),
    "gpu-count": rule(("own",), ("own",), "a GPU the node should have (--expect-gpus, the job's SLURM_JOB_GPUS, the "
                      "node's gres, the GPUs on its PCI bus) that NVML does not list stays missing until the node is "
                      "repaired", NODE_CONTEXTS),
    "gpu-procs": rule(("own",), ("own",), "a process holding the job's GPU before the job starts or after it ended, "
                      "still there a second later, outlived its own job; a busy GPU beside jobs is never judged",
                      NODE_CONTEXTS),
    "gpu-health": rule(("own",), ("own",), "a failed row remap is memory the GPU can no longer repair: it stays "
                       "until the GPU is replaced (NVIDIA's RMA policy); uncorrected ECC counts and a pending remap "
                       "(contained, applied at the next GPU reset), the PCIe link and clocks under load and Xid lines "
                       "WARN and drain nothing", NODE_CONTEXTS),
}


def drains_in(f, context):
    """Whether finding f drains its hosts in `context` ('job', or one of NODE_CONTEXTS): drainable, and its check
    runs there (CHECK_RULES' contexts)."""
    return drainable(f) and context in CHECK_RULES[f["check"]]["contexts"]


if set(CHECK_RULES) != set(CHECKS):  # a new check declares itself here (docs/development.md: adding a check)
    raise ValueError(f"CHECK_RULES and CHECKS differ: {sorted(set(CHECKS) ^ set(CHECK_RULES))}")


def localises(f):
    """Whether finding f may name its hosts: its evidence singles a host out and its check declares that."""
    return f.get("blame") in CHECK_RULES.get(f["check"], {}).get("names", ())  # rule(): names are LOCALISING


def unlocalised(f, kind, localise=None, why=None):
    """f (a new dict) naming no host: evidence `kind` (a key of UNLOCALISED), its hosts kept as `involved`, the
    reason saying that no host is named, why, and what would localise it."""
    default_why, default_how = UNLOCALISED[kind]
    said = f.get("unlocalised") or {}  # a judge's own words win over the kind's defaults
    why, how = why or said.get("why") or default_why, localise or said.get("localise") or default_how
    out = dict(f, blame=kind, hosts=[], involved=sorted(set(f.get("involved") or []) | set(f.get("hosts") or [])),
               unlocalised={"why": why, "localise": how})
    if not any(w in out["reason"] for w in ("no host is named", "no host blamed", "no host is blamed")):
        out["reason"] = f"{out['reason']}; no host is named: {why}; to localise it: {how}"
    return out


def blame_gate(findings, hosts=(), nodes=0):
    """The one gate every finding passes at the verdict (pure); every sink (report, ACTION, JSON, metrics, page,
    drain, the fallback verdicts) reads the hosts of what it returns, never a finding's own. hosts: the run's
    hosts (the roll call's), nodes: the allocation's node count where known. In order:
    - a WARN or FAIL keeps its hosts only when localises(f); one naming hosts without such evidence is turned
      into unlocalised(f, ...) (its evidence kept when it is an UNLOCALISED kind, else 'undeclared');
    - a FAIL carrying `tamper` (a value on the side channel refused) names nobody, and no finding names a host
      (`forged`): the run's evidence came through that store;
    - a finding naming more than half of the run's hosts, or FAILs naming more than half of them together,
      name none (`widespread`, marked so: nothing is drained), on any evidence: "most of the job" is not a
      host's fault. A run of one host (or a call that gives neither hosts nor nodes) has no such guard.
    PASS findings are untouched. -> new findings."""
    out = [f if f["status"] == "PASS" or localises(f) or not (f["hosts"] or f.get("blame") in UNLOCALISED)
           else unlocalised(f, f.get("blame") if f.get("blame") in UNLOCALISED else "undeclared") for f in findings]
    if any(f.get("tamper") and f["status"] == "FAIL" for f in out):
        return [unlocalised(f, "forged") if f["status"] != "PASS" and f["hosts"] else f for f in out]
    return _widespread(out, hosts, nodes)


def _widespread(findings, hosts, nodes):
    """blame_gate's minority guard: the findings that would name more than half of the run's hosts, made
    `widespread` (see blame_gate)."""
    named = {h for f in findings if f["status"] != "PASS" for h in f["hosts"]}
    failed = {h for f in findings if f["status"] == "FAIL" for h in f["hosts"]}
    n = max(len(set(hosts) | named), nodes or 0)
    if n < 2 or not (hosts or nodes):  # the run's hosts not known (a unit of a judge): nothing to weigh against
        return findings
    out = []
    for f in findings:
        wide = f["hosts"] if 2 * len(f["hosts"]) > n else failed if f["status"] == "FAIL" and 2 * len(failed) > n \
            else None
        if f["status"] != "PASS" and wide:
            why = (f"it would name {len(wide)} of the run's {n} nodes, more than half: a cause that wide is a switch, "
                   "the fabric, the software image or their configuration, not those nodes")
            f = dict(unlocalised(f, "widespread", why=why), widespread=True)
        out.append(f)
    return out


def blamed_hosts(findings):
    """The hosts the gated findings blame: every FAIL's hosts (blame_gate has already taken them away where the
    run's evidence came through a store written from outside, or where they are most of the run)."""
    return sorted({h for f in findings if f["status"] == "FAIL" and localises(f) for h in f["hosts"]})


def drainable(f):
    """Whether a gated FAIL may drain its hosts: its check declares its evidence persistent (CHECK_RULES
    drain); a check that says nothing drains nothing, and a WARN made a FAIL by --strict (`strict`) never
    drains."""
    return (f["status"] == "FAIL" and bool(f["hosts"]) and localises(f) and not f.get("strict")
            and f.get("blame") in CHECK_RULES[f["check"]]["drain"])


def strict_majority(groups):
    """{value: [members]} -> the value a strict majority of all members share, or None (a tie, or no value
    held by more than half)."""
    total = sum(len(v) for v in groups.values())
    return next((value for value, members in groups.items() if 2 * len(members) > total), None)


def odd_ones(groups):
    """{value: [members]} of one class -> (the members unlike the strict majority, evidence kind): ([], None)
    when all agree; (members, 'majority') with a strict majority; (every member, 'tie') without one."""
    if len(groups) <= 1:
        return [], None
    top = strict_majority(groups)
    if top is None:
        return sorted({m for v in groups.values() for m in v}, key=str), "tie"
    return sorted({m for v, ms in groups.items() if v != top for m in ms}, key=str), "majority"


def minority_kind(bad, members):
    """The evidence kind of `bad` among `members` (both sets of hosts): 'majority' when the bad ones are a strict
    minority (each is unlike a strict majority), 'tie' at half, 'everyone' beyond."""
    bad, members = set(bad), set(members)
    if 2 * len(bad) < len(members):
        return "majority"
    return "tie" if 2 * len(bad) == len(members) else "everyone"
