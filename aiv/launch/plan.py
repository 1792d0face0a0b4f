"""Floor 6: what a command line becomes (help, version, verify-log, diff-manifest, local, rank)."""
import argparse
import os
import re
import socket
import tempfile

from ..checks.collect import count_visible_gpus, gpus_expected
from ..core.base import VERSION, UsageError, human_bytes, read_text
from .contract import _int_var, read_contract
from .launchers import (
    allocated_gpus,
    ambiguous_rank,
    check_pet_beside_ranks,
    describe_contract,
    describe_node,
    read_node_launch,
    world_mismatch,
)
from .options import RANK_MEM_CPU, RANK_MEM_GPU, RANKS_PER_CORE, build_parser, parse_args

# Set by a launcher that starts several ranks per node (srun, torchrun, mpirun, local mode): then a
# rank's own usage error is said once per node. A process started by hand has no siblings: it speaks.
LAUNCHER_VARS = ("SLURM_STEP_ID", "SLURM_STEPID", "TORCHELASTIC_RUN_ID", "LOCAL_WORLD_SIZE",
                 "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK")


def usable_cores():
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def mem_available(root="/"):
    """Bytes this process may still use: MemAvailable, lowered to what a cgroup v2 memory limit has
    left; None when unknown."""
    m = re.search(r"^MemAvailable:\s+(\d+) kB", read_text(os.path.join(root, "proc/meminfo"), ""), re.M)
    avail = int(m.group(1)) << 10 if m else None
    m = re.search(r"^0::/(\S*)", read_text(os.path.join(root, "proc/self/cgroup"), ""), re.M)
    if m:
        d = os.path.join(root, "sys/fs/cgroup", m.group(1))
        limit = read_text(os.path.join(d, "memory.max"), "").strip()
        used = read_text(os.path.join(d, "memory.current"), "").strip()
        if limit.isdigit() and used.isdigit():
            left = max(0, int(limit) - int(used))
            avail = left if avail is None else min(avail, left)
    return avail


def check_nproc(args, gpu, root="/"):
    """An explicit --nproc beyond what this machine holds (the rule above) is a usage error."""
    n, name = args.nproc, getattr(args, "origin", {}).get("nproc", "--nproc")
    cores, avail, per = usable_cores(), mem_available(root), RANK_MEM_GPU if gpu else RANK_MEM_CPU
    if n > RANKS_PER_CORE * cores:
        raise UsageError(f"{name}={n} is more ranks than this machine holds: at most {RANKS_PER_CORE} per CPU "
                         f"core, {RANKS_PER_CORE * cores} on the {cores} core(s) this process may use")
    if avail is not None and n * per > avail:
        raise UsageError(f"{name}={n} is more ranks than this machine holds: {n} x {human_bytes(per)} per "
                         f"{'GPU' if gpu else 'CPU'} rank, but {human_bytes(avail)} of memory is available")


def json_problem(path):
    """Why rank 0 could not write its verdict to path (None: it can): the directory must exist and take
    a new file, which is tried by creating and removing one."""
    d = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        return "is a directory"
    if not os.path.exists(d):
        return f"names directory {d}, which does not exist"
    if not os.path.isdir(d):
        return f"names {d}, which is not a directory"
    try:
        fd, probe = tempfile.mkstemp(prefix=".aiv-probe-", dir=d)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        return f"cannot be written: no file can be created in {d} ({e.strerror or e})"
    return None


def check_json_target(args):
    """--json, --metrics and --html PATH, tried by rank 0 and the local launcher before torch is imported: an
    output that cannot be written is a usage error now, not a warning after the run."""
    for dest in ("json", "metrics", "html"):
        path = getattr(args, dest, None)
        if path is not None and (problem := json_problem(path)):
            name = getattr(args, "origin", {}).get(dest, "--" + dest)
            raise UsageError(" ".join(f"FAILURE: usage: {name}={path!r} {problem}".split()))


def _line(check, e):
    """A UsageError from a check, as the exact line to print (one line, whatever the input held)."""
    return UsageError(" ".join(f"FAILURE: {check}: {e}".split()), own=e.own)


def _local(args, env, root):
    """Local mode's launch plan: launch_plan's, plus the port (None: a free one at launch), the master (a
    MASTER_ADDR of this machine is kept) and the words for the header."""
    try:
        port = _int_var(env, "MASTER_PORT", lo=1, hi=65535) if "MASTER_PORT" in env else None
    except UsageError as e:
        raise _line("contract", e) from None
    try:
        out = dict(launch_plan(args, env, root), port=port)
    except UsageError as e:
        raise _line("usage", e) from None
    addr = env.get("MASTER_ADDR", "").strip() or "127.0.0.1"
    how = f"local mode, no launcher variables: {out['nproc']} rank(s) on this machine ({_ranks_why(args, out)})"
    return dict(out, master_addr=addr, launch="local mode",
                port_from="port from MASTER_PORT" if port else "a free port", how=how)


def _ranks_why(args, lp):
    """How launch_plan chose the ranks per node, in words."""
    if args.nproc:
        return f"{getattr(args, 'origin', {}).get('nproc', '--nproc')}={args.nproc}"
    if lp["backend"] == "gloo" or args.backend == "gloo":
        return "CPU ranks: " + ("--backend gloo" if args.backend == "gloo" else "no GPU visible")
    return "one per GPU"


def _node_launch(args, env, root, node):
    """A per-node launch (read_node_launch): this node's ranks as local mode chooses them (one per GPU, 2 CPU
    ranks), or as PET_NPROC_PER_NODE or --nproc says; numbered as torchrun numbers them. A RANK that may count
    processes on a node of several GPUs, PET_NPROC_PER_NODE against --nproc, or a WORLD_SIZE that is neither
    the pods nor the ranks: one line."""
    stated = node["nproc"]
    if stated and args.nproc and args.nproc != stated[1]:
        name = getattr(args, "origin", {}).get("nproc", "--nproc")
        raise _line("contract", UsageError(f"{stated[0]}={stated[1]} and {name}={args.nproc} disagree on the ranks per "
                                           "node: give one of them"))
    if stated and not args.nproc:
        args = argparse.Namespace(**vars(args))
        args.nproc, args.origin = stated[1], dict(getattr(args, "origin", {}), nproc=stated[0])
    try:
        lp = launch_plan(args, env, root)
    except UsageError as e:
        raise _line("usage", e) from None
    why, alloc, gpu_ranks = _ranks_why(args, lp), allocated_gpus(env), lp["backend"] is None and args.backend != "gloo"
    if alloc and not args.nproc and gpu_ranks and alloc != lp["nproc"]:  # the pod's allocation
        lp, why = dict(lp, nproc=alloc), f"one per GPU allocated: NVIDIA_VISIBLE_DEVICES lists {alloc}"
    if node["ambiguous"] and not args.nproc and gpu_ranks and lp["nproc"] > 1:
        raise _line("contract", ambiguous_rank(env, lp["nproc"]))
    bad = world_mismatch(node, lp["nproc"])
    if bad:
        raise _line("contract", bad)
    how = describe_node(node, lp["nproc"], why)
    return dict(lp, port=node["master_port"], master_addr=node["master_addr"], port_from=node["port_from"],
                launch=f"{node['name']}, this tool starting {lp['nproc']} rank(s) per node", how=how,
                node={k: node[k] for k in ("launcher", "nnodes", "node_rank")})


def plan(argv, env, root="/"):
    """(argv, env) -> what this process does, without importing torch or writing anything:
    {"mode": "help"|"version", "text"}, {"mode": "verify-log"|"node-check", "args"}, {"mode": "rank", "args",
    "contract"} or {"mode": "local", "args", "launch"}; with "check_json" where this process is the one
    to try --json (rank 0's node). A per-node launch (Kubeflow Trainer v2, PyTorchJob v1, an Indexed Job,
    JobSet, LeaderWorkerSet, Volcano) is mode "local" with launch["node"]: this process starts its node's
    ranks. Raises UsageError whose message is the exact line to print."""
    argv = list(argv)
    words = argv[:argv.index("--")] if "--" in argv else argv
    if "-h" in words or "--help" in words:
        return {"mode": "help", "text": build_parser().format_help()}
    if "--version" in words:
        return {"mode": "version", "text": f"ai-infra-validator {VERSION}"}
    try:
        args = parse_args(argv, env)
    except UsageError as e:
        raise _line("usage", e) from None
    for mode in ("verify-log", "diff-manifest", "node-check"):  # node-check: this node alone, no launch contract
        if getattr(args, mode.replace("-", "_")) is not None:    # (a prolog's environment is a job's)
            return {"mode": mode, "args": args}
    try:
        node = read_node_launch(env)  # one process per node or pod: this tool starts the node's ranks
        contract = None if node else read_contract(env)
        if contract is not None:
            check_pet_beside_ranks(env, contract["world_size"])
            contract.update(describe_contract(contract, env))
    except UsageError as e:
        raise _line("contract", e) from None
    if node is not None:
        return {"mode": "local", "args": args, "launch": _node_launch(args, env, root, node),
                "check_json": node["node_rank"] == 0}
    if contract is not None:
        return {"mode": "rank", "args": args, "contract": contract, "check_json": contract["rank"] == 0}
    return {"mode": "local", "args": args, "launch": _local(args, env, root), "check_json": True}


def free_port(host="127.0.0.1"):
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def launch_plan(args, env, root="/"):
    """Local mode: {'nproc', 'backend'} (backend: the flag to add, None to let each rank choose), or
    a UsageError. One rank per visible GPU; where GPUs are expected but none is visible, still one rank
    per listed device, so that each rank FAILs naming torch's reason instead of a CPU run passing.
    An explicit --nproc is held to what the machine holds (check_nproc)."""
    if args.backend == "gloo":
        out = {"nproc": args.nproc or 2, "backend": None}
    else:
        gpus = count_visible_gpus(env, root)
        if not gpus and gpus_expected(env, root):
            cvd = env.get("CUDA_VISIBLE_DEVICES")
            gpus = len([x for x in cvd.split(",") if x.strip()]) if cvd else allocated_gpus(env) or 1
        if args.backend == "nccl" and not gpus:
            name = getattr(args, "origin", {}).get("backend", "--backend")
            raise UsageError(f"{name}=nccl but no GPU is visible on {socket.gethostname()} and none is expected")
        out = {"nproc": args.nproc or gpus, "backend": None} if gpus else {"nproc": args.nproc or 2, "backend": "gloo"}
    if args.nproc:
        check_nproc(args, gpu=args.backend != "gloo" and out["backend"] is None, root=root)
    return out
