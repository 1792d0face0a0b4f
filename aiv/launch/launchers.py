"""Floor 2: the one table of launch contracts (LAUNCHERS): what each launcher gives a process, and how the
node count, this node's index, the ranks per node and the rendezvous are read from it; the reading of a
per-node launch (one process per node or pod: Kubeflow Trainer v2, PyTorchJob v1, an Indexed Job, JobSet,
LeaderWorkerSet, Volcano), where this tool starts the node's ranks; and the words that say which contract
a run read."""
import contextlib
import json
import re
import socket
from typing import NamedTuple

from ..core.base import UsageError
from .contract import MPI_LOCAL_VARS, MPI_RANK_VARS, _int_var, _pick, check_host, under_torchrun

TORCHRUN_PORT = 29500   # torchrun's default --master-port: the port where a launcher names a master but no port
LAUNCH_VAR = "_AIV_LAUNCH"  # set by this tool's own launcher on its ranks: which contract it read, in words


class Launcher(NamedTuple):
    key: str
    name: str
    recognised: str   # the variables that select this row
    gives: str        # what the launcher sets in the process's environment
    nodes: str        # where the node count comes from
    node: str         # where this node's index comes from
    ranks: str        # ranks per node, and who starts them
    rendezvous: str   # MASTER_ADDR:MASTER_PORT, from where
    per_node: bool    # True: one process per node or pod, and this tool starts that node's ranks


_ONE_PER_GPU = "one per GPU, 2 CPU ranks without one; `PET_NPROC_PER_NODE` or `--nproc` to choose"
LAUNCHERS = (
    Launcher("slurm", "Slurm srun", "`SLURM_PROCID` in an srun step",
             "`SLURM_PROCID`, `SLURM_NTASKS`, `SLURM_LOCALID`, `SLURM_JOB_NODELIST`, `SLURM_JOB_ID`, "
             "`SLURM_STEP_NUM_NODES`, `SLURM_STEP_TASKS_PER_NODE`",
             "`SLURM_STEP_NUM_NODES` (the expectation)", "its host in `SLURM_JOB_NODELIST`",
             "srun's tasks, one per GPU (`SLURM_LOCALID`)",
             "first host of `SLURM_JOB_NODELIST`, port from `SLURM_JOB_ID` (or `MASTER_ADDR`, `MASTER_PORT`)", False),
    Launcher("torchrun", "torchrun", "`TORCHELASTIC_RUN_ID`",
             "`RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `LOCAL_WORLD_SIZE`, `GROUP_RANK`, `GROUP_WORLD_SIZE`, "
             "`MASTER_ADDR`, `MASTER_PORT`, `TORCHELASTIC_RUN_ID`",
             "`GROUP_WORLD_SIZE` (the expectation)", "`GROUP_RANK`", "torchrun's workers (`LOCAL_WORLD_SIZE`)",
             "`MASTER_ADDR`:`MASTER_PORT`, the agent's store", False),
    Launcher("mpi", "mpirun", "`OMPI_COMM_WORLD_RANK`, `PMIX_RANK` or `PMI_RANK`",
             "`OMPI_COMM_WORLD_RANK`, `OMPI_COMM_WORLD_SIZE`, `OMPI_COMM_WORLD_LOCAL_RANK` (Open MPI), `PMIX_RANK` "
             "(PMIx), `PMI_RANK`, `PMI_SIZE`, `MPI_LOCALRANKID` (MPICH, Intel MPI); no rendezvous",
             "the ranks' hosts", "the rank's host", "mpirun's processes (`OMPI_COMM_WORLD_LOCAL_RANK`)",
             "`MASTER_ADDR`, `MASTER_PORT` exported to every rank (`mpirun -x`)", False),
    Launcher("trainer-v2", "Kubeflow Trainer v2", "`PET_NODE_RANK` or `PET_NNODES`, no `RANK`",
             "`PET_NNODES`, `PET_NPROC_PER_NODE` (a number, or `auto` where the pod has GPUs), `PET_NODE_RANK` (the "
             "pod's completion index), `PET_MASTER_ADDR` (`<trainjob>-node-0-0.<trainjob>`), `PET_MASTER_PORT` "
             "(29500); an init container gets them through `envInjection`",
             "`PET_NNODES`", "`PET_NODE_RANK`", _ONE_PER_GPU, "`PET_MASTER_ADDR`:`PET_MASTER_PORT`", True),
    Launcher("pytorchjob", "PyTorchJob v1", "`RANK` and `WORLD_SIZE` without `LOCAL_RANK`",
             "`MASTER_ADDR` (`<job>-master-0`), `MASTER_PORT` (23456), `WORLD_SIZE` (pods x `nprocPerNode`; pods "
             "where it is `auto`), `RANK` (the pod's index: master 0, worker i+1); since 1.7 also `PET_NNODES`, "
             "`PET_NODE_RANK`, `PET_NPROC_PER_NODE` (`auto` by default), `PET_MASTER_ADDR`, `PET_MASTER_PORT`",
             "`PET_NNODES`, else `WORLD_SIZE`", "`RANK` (the pod's index)",
             _ONE_PER_GPU + " (a pod of several GPUs without either: exit 2)", "`MASTER_ADDR`:`MASTER_PORT`", True),
    Launcher("indexed-job", "Indexed Job", "`JOB_COMPLETION_INDEX`",
             "`JOB_COMPLETION_INDEX` (the hostname is `<job>-<index>`); the manifest sets `PET_NNODES`, "
             "`MASTER_ADDR` (pod 0 through a headless Service), `MASTER_PORT`",
             "`PET_NNODES`", "`JOB_COMPLETION_INDEX`", _ONE_PER_GPU,
             "`MASTER_ADDR`:`MASTER_PORT` (29500 when unset)", True),
    Launcher("jobset", "JobSet", "`JOB_COMPLETION_INDEX` and `JOBSET_NAME`",
             "no variable of its own: its Jobs are Indexed (`JOB_COMPLETION_INDEX`), its labels "
             "(`jobset.sigs.k8s.io/jobset-name`, `job-index`, `job-global-index`, `replicatedjob-name`) reach the "
             "environment through the downward API; the manifest sets `JOBSET_NAME`, `PET_NNODES`, `MASTER_ADDR` "
             "(`<jobset>-<job>-0-0.<jobset>`), `MASTER_PORT`",
             "`PET_NNODES`", "`JOB_COMPLETION_INDEX` (one Job of N pods)", _ONE_PER_GPU,
             "`MASTER_ADDR`:`MASTER_PORT` (29500 when unset)", True),
    Launcher("lws", "LeaderWorkerSet", "`LWS_GROUP_SIZE`, `LWS_WORKER_INDEX` or `LWS_LEADER_ADDRESS`",
             "`LWS_LEADER_ADDRESS` (`<lws>-<group>.<subdomain>.<namespace>`), `LWS_GROUP_SIZE` (leader and "
             "workers), `LWS_WORKER_INDEX` (0 on the leader)",
             "`LWS_GROUP_SIZE`", "`LWS_WORKER_INDEX`", _ONE_PER_GPU,
             "`LWS_LEADER_ADDRESS`:`MASTER_PORT` (29500 when unset)", True),
    Launcher("volcano", "Volcano", "`VC_TASK_INDEX`, `VC_<TASK>_HOSTS` or `VC_<TASK>_NUM`",
             "env plugin: `VC_TASK_INDEX` (the pod's index in its task); svc plugin: `VC_<TASK>_HOSTS`, "
             "`VC_<TASK>_NUM`; pytorch plugin (main containers only): `MASTER_ADDR`, `MASTER_PORT` (23456), "
             "`WORLD_SIZE` (pods), `RANK` (master 0, worker i+1)",
             "`WORLD_SIZE` (pytorch plugin), else `VC_<TASK>_NUM` (svc plugin, a job of one task)",
             "`RANK` (pytorch plugin), else `VC_TASK_INDEX`", _ONE_PER_GPU,
             "`MASTER_ADDR`:`MASTER_PORT` (pytorch plugin), else the first of `VC_<TASK>_HOSTS`:29500", True),
    Launcher("env", "any launcher", "`RANK` and `LOCAL_RANK`",
             "`RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `MASTER_ADDR`, `MASTER_PORT`",
             "the ranks' hosts", "the rank's host", "the launcher's processes (`LOCAL_RANK`)",
             "`MASTER_ADDR`:`MASTER_PORT`", False),
    Launcher("local", "local mode", "none of the above",
             "nothing", "1", "0", "one per GPU, 2 CPU ranks without one (`--nproc`)",
             "127.0.0.1 (or a `MASTER_ADDR` of this machine), a free port (or `MASTER_PORT`)", True),
)
BY_KEY = {launcher.key: launcher for launcher in LAUNCHERS}
GENERIC_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")  # any launcher's
LWS_VARS = ("LWS_GROUP_SIZE", "LWS_WORKER_INDEX", "LWS_LEADER_ADDRESS")


def node_name(env):
    """The name this process's node goes by in the report, the JSON and `exclude`: Slurm's node name, the
    Kubernetes node a pod runs on (NODE_NAME from the downward API's spec.nodeName, read only inside a
    pod), else the host name."""
    if env.get("SLURMD_NODENAME"):
        return env["SLURMD_NODENAME"]
    if env.get("KUBERNETES_SERVICE_HOST") and env.get("NODE_NAME", "").strip():
        return env["NODE_NAME"].strip()
    return socket.gethostname()


# ---------------------------------------------------------------------------- per-node launches
def _count(env, var):
    """A node count: a number, or torchrun's elastic 'min:max' when min == max."""
    raw = env[var].strip()
    m = re.fullmatch(r"(\d+):(\d+)", raw)
    if m and m.group(1) == m.group(2):
        return int(m.group(1))
    if m:
        raise UsageError(f"{var}={raw!r} is an elastic range: a preflight needs a fixed node count; set {var} to "
                         "one number")
    return _int_var(env, var, lo=1, hi=100_000)


def _first(env, launcher, fact, sources, read, fix):
    """The value of `fact` from the first of the variables `sources` that is set (read(env, variable)); every
    other one set must agree (else one line naming both). -> (value, variable)."""
    got = [(var, read(env, var)) for var in sources if var in env]
    if not got:
        raise UsageError(f"{launcher}: {fact} is not set: set {' or '.join(sources)}{fix}")
    var, value = got[0]
    for other, v in got[1:]:
        if v != value:
            raise UsageError(f"{launcher}: {var}={env.get(var, value)!s} and {other}={env.get(other, v)!s} disagree on "
                             f"{fact}: set one of them, or make them equal")
    return value, var


def _nproc(env):
    """PET_NPROC_PER_NODE: a number of ranks for this node, or None for one per GPU (auto, gpu, or unset)."""
    raw = env.get("PET_NPROC_PER_NODE")
    if raw is None or raw.strip().lower() in ("auto", "gpu"):
        return None
    if not raw.strip().isdigit():
        raise UsageError(f"PET_NPROC_PER_NODE={raw!r} is not a number nor auto: set the ranks per node, or auto for "
                         "one per GPU")
    return ("PET_NPROC_PER_NODE", _int_var(env, "PET_NPROC_PER_NODE", lo=1, hi=1024))


def _volcano_task(env):
    """The svc plugin's one task: (its VC_<TASK>_NUM, its first host), or a line naming what to set."""
    nums = sorted(v for v in env if re.fullmatch(r"VC_\w+_NUM", v))
    tasks = [v[3:-4] for v in nums if f"VC_{v[3:-4]}_HOSTS" in env]
    if len(tasks) != 1:
        what = (f"a job of {len(tasks)} tasks ({', '.join(f'VC_{t}_NUM' for t in tasks)})" if tasks else
                f"{', '.join(nums)} without its VC_<TASK>_HOSTS" if nums else
                "no svc plugin variables (VC_<TASK>_NUM, VC_<TASK>_HOSTS)")
        index = (f"VC_TASK_INDEX={env['VC_TASK_INDEX']} is a pod's index within its task, and "
                 if "VC_TASK_INDEX" in env else "")
        raise UsageError(f"Volcano: {index}this pod has {what}: enable the pytorch plugin (RANK, WORLD_SIZE, "
                         "MASTER_ADDR, MASTER_PORT), or set PET_NNODES, PET_NODE_RANK and MASTER_ADDR")
    t = tasks[0]
    hosts = [h.strip() for h in env[f"VC_{t}_HOSTS"].split(",") if h.strip()]
    if not hosts:
        raise UsageError(f"Volcano: VC_{t}_HOSTS is empty: the svc plugin names no host")
    return f"VC_{t}_NUM", f"VC_{t}_HOSTS", check_host(f"VC_{t}_HOSTS", hosts[0])


def allocated_gpus(env):
    """The GPUs the pod was given, from the NVIDIA device plugin's NVIDIA_VISIBLE_DEVICES when it lists them (UUIDs
    or indices; not all, none, void or a path): the same on every pod of one template, whatever the driver still
    shows, so that a GPU lost on one node fails that node's rank instead of changing the world size. None: unknown."""
    raw = env.get("NVIDIA_VISIBLE_DEVICES", "").strip()
    items = [x.strip() for x in raw.split(",") if x.strip()]
    if not items or any(x.lower() in ("all", "none", "void") or "/" in x for x in items):
        return None
    return len(items)


def which_node_launcher(env):
    """The key of the per-node launcher this environment is, or None (a per-process launch or local mode)."""
    rank_var = _pick(env, "RANK", "SLURM_PROCID", *MPI_RANK_VARS)
    if LAUNCH_VAR in env or under_torchrun(env) or rank_var not in (None, "RANK"):
        return None  # this tool's own ranks, torchrun's workers, an srun task or an MPI rank
    if rank_var == "RANK" and _pick(env, "LOCAL_RANK", "SLURM_LOCALID", *MPI_LOCAL_VARS):
        return None  # one process per rank
    if any(v in env for v in LWS_VARS):
        return "lws"
    if "VC_TASK_INDEX" in env or any(re.fullmatch(r"VC_\w+_(HOSTS|NUM)", v) for v in env):  # env or svc plugin
        return "volcano"
    if rank_var is None and "PET_NODE_RANK" in env:
        return "trainer-v2"
    if rank_var == "RANK" and ("PET_NNODES" in env or "PET_NODE_RANK" in env):
        return "pytorchjob"
    if "JOB_COMPLETION_INDEX" in env:
        return "jobset" if env.get("JOBSET_NAME", "").strip() else "indexed-job"
    if "PET_NNODES" in env:
        return "trainer-v2"
    if rank_var == "RANK" and "WORLD_SIZE" in env:
        return "pytorchjob"
    return None


def _one_launch(env, name, nnodes, nodes_from):
    """One node by this launcher's count and several by another's (a pod with two launchers' variables): a
    UsageError, never a local run alone."""
    more = [f"{v}={env[v].strip()}" for v in ("PET_NNODES", "LWS_GROUP_SIZE", "VC_WORKER_NUM")
            if env.get(v, "").strip().isdigit() and int(env[v]) > 1]
    if nnodes == 1 and more:
        raise UsageError(f"{name}: {nodes_from}={nnodes} (one node), but {', '.join(more)} say this pod is one of "
                         "several: the environment mixes two launchers' variables; give the pod one launcher's",
                         own=True)


def read_node_launch(env):
    """A per-node launch: {'launcher', 'name', 'nnodes', 'node_rank', 'nproc' ((variable, n) or None: one per GPU),
    'master_addr', 'master_port', 'from' (fact -> the variable it came from), 'world_given' (a WORLD_SIZE to
    hold to the launch: world_mismatch), 'ambiguous' (RANK may count processes)}, or None when the environment is a
    per-process launch or local mode. Contradictory or missing variables: UsageError, one line naming them."""
    key = which_node_launcher(env)
    if key is None:
        return None
    name, fix, where = BY_KEY[key].name, "", ""
    nodes, index, addrs = ["PET_NNODES"], ["PET_NODE_RANK"], ["MASTER_ADDR", "PET_MASTER_ADDR"]
    ports, known = ["MASTER_PORT", "PET_MASTER_PORT"], {}  # known: an address read already (Volcano's first host)
    default_port, world_var, ambiguous = TORCHRUN_PORT, "WORLD_SIZE", False  # WORLD_SIZE: held to the launch
    if key == "trainer-v2":
        index.append("JOB_COMPLETION_INDEX")
        addrs.reverse()
        ports.reverse()
    elif key == "pytorchjob":
        if "PET_NNODES" not in env:
            nodes, world_var = ["WORLD_SIZE"], None
        index.append("RANK")
        ambiguous = "PET_NNODES" not in env and "PET_NODE_RANK" not in env
        default_port = None
    elif key in ("indexed-job", "jobset"):
        index.insert(0, "JOB_COMPLETION_INDEX")
        fix, where = " (the Job's completions)", ": pod 0 through the headless Service, e.g. <job>-0.<service>"
    elif key == "lws":
        nodes.insert(0, "LWS_GROUP_SIZE")
        index.insert(0, "LWS_WORKER_INDEX")
        addrs.insert(0, "LWS_LEADER_ADDRESS")
    elif key == "volcano" and "RANK" in env:  # the pytorch plugin: one process per pod, RANK its index
        nodes, world_var = ["WORLD_SIZE", "PET_NNODES"], None
        index = ["RANK", "PET_NODE_RANK"]
        default_port = None
    elif key == "volcano":
        if "PET_NNODES" in env:  # set by hand: PET_NODE_RANK is the node's index (VC_TASK_INDEX is per task)
            index = index if "PET_NODE_RANK" in env else ["VC_TASK_INDEX"]
        else:
            num, hosts_var, first = _volcano_task(env)
            nodes, index = [num], ["VC_TASK_INDEX", "PET_NODE_RANK"]
            addrs.append(hosts_var)
            known[hosts_var] = first
            fix = " (Volcano's env plugin sets VC_TASK_INDEX)"
    nnodes, nodes_from = _first(env, name, "the node count", nodes, _count, fix)
    _one_launch(env, name, nnodes, nodes_from)
    node_rank, node_from = _first(env, name, "this node's index", index,
                                  lambda e, v: _int_var(e, v, lo=0, hi=100_000), fix if key == "volcano" else "")
    if node_rank >= nnodes:
        raise UsageError(f"{name}: {node_from}={node_rank} is not below {nodes_from}={nnodes}", own=True)
    addr, addr_from = _first(env, name, "the master's address", addrs, lambda e, v: known.get(v) or check_host(v, e[v]),
                             f" (the host of node 0{where})")
    if default_port is not None and not any(var in env for var in ports):
        port, port_from = default_port, f"torchrun's default {default_port}: no MASTER_PORT"
    else:
        port, port_var = _first(env, name, "the master's port", ports, lambda e, v: _int_var(e, v, lo=1, hi=65535), "")
        port_from = f"port from {port_var}"
    return {"launcher": key, "name": name, "nnodes": nnodes, "node_rank": node_rank, "nproc": _nproc(env),
            "master_addr": addr, "master_port": port, "port_from": port_from,
            "from": {"nodes": nodes_from, "node": node_from, "master": addr_from},
            "world_given": _int_var(env, world_var, lo=1, hi=100_000_000) if world_var in env else None,
            "ambiguous": ambiguous}


def check_pet_beside_ranks(env, world):
    """A per-process launch (RANK and LOCAL_RANK) beside torchrun's PET_NNODES and a numeric PET_NPROC_PER_NODE
    that make another world size: one line naming them (torchrun's workers and this tool's own ranks excepted)."""
    if LAUNCH_VAR in env or under_torchrun(env) or "PET_NNODES" not in env:
        return
    nproc, nnodes = _nproc(env), _count(env, "PET_NNODES")
    if nproc is not None and nnodes * nproc[1] != world:
        raise UsageError(f"PET_NNODES={nnodes} x PET_NPROC_PER_NODE={nproc[1]} make {nnodes * nproc[1]} ranks, but "
                         f"WORLD_SIZE={world}: set WORLD_SIZE to the ranks of the whole job, or unset the PET_* "
                         "variables that belong to another launch")


def ambiguous_rank(env, gpus):
    """The line for RANK and WORLD_SIZE without LOCAL_RANK on a node of several GPUs, where nothing says whether
    RANK counts pods or processes."""
    return UsageError(f"RANK={env['RANK']} and WORLD_SIZE={env['WORLD_SIZE']} are set but LOCAL_RANK is not, on a "
                      f"node with {gpus} GPUs: RANK may count pods (PyTorchJob v1: one process per pod) or processes; "
                      f"set PET_NPROC_PER_NODE={gpus} (nprocPerNode) or --nproc {gpus} when it counts pods (this tool "
                      "then starts one rank per GPU), or LOCAL_RANK when every process is one rank")


def world_mismatch(node, nproc):
    """A WORLD_SIZE beside a per-node launch that is neither its pods nor its ranks: the line, or None."""
    given, world = node["world_given"], node["nnodes"] * nproc
    if given is None or given in (node["nnodes"], world):
        return None
    return UsageError(f"{node['name']}: {node['from']['nodes']}={node['nnodes']} node(s) x {nproc} rank(s) per node "
                      f"make {world} ranks, but WORLD_SIZE={given}: set WORLD_SIZE to {world} (ranks) or "
                      f"{node['nnodes']} (pods), or unset it")


# ---------------------------------------------------------------------------- the words for the header
def describe_node(node, nproc, why):
    """A per-node launch in words (the contract line's `how`; `why`: how the ranks per node were chosen)."""
    f = node["from"]
    return (f"{node['name']} ({f['nodes']}, {f['node']}, {f['master']}): node {node['node_rank']} of "
            f"{node['nnodes']}, {nproc} rank(s) per node started by this tool ({why}), rank = node x {nproc} + "
            "local rank")


def describe_contract(contract, env):
    """{'launch', 'how', 'port_from'} of a per-process contract: what this tool's own launcher said
    (LAUNCH_VAR), else which launcher's variables were read."""
    with contextlib.suppress(KeyError, ValueError):
        told = json.loads(env[LAUNCH_VAR])
        if isinstance(told, dict) and all(isinstance(told.get(k), str) for k in ("launch", "how", "port_from")):
            return {k: told[k] for k in ("launch", "how", "port_from")}
    names = ", ".join(contract.get("vars", ()))
    launch = {"slurm": "Slurm srun", "mpi": "mpirun"}.get(contract.get("source")) or (
        "torchrun" if under_torchrun(env) else "RANK, WORLD_SIZE, LOCAL_RANK")
    return {"launch": launch, "how": f"{launch}: {names}, one process per rank started by the launcher",
            "port_from": f"port from {contract.get('port_source', 'MASTER_PORT')}"}
