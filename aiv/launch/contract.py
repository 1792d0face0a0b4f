"""Floor 2: the launch contract: RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT, the Slurm and
torchrun fallbacks, the expectations a launcher states, and the job's secret."""
import contextlib
import re
import socket

from ..core.base import UsageError, expand_hostlist, parse_tasks_per_node

OWN_VARS = ("RANK", "LOCAL_RANK", "SLURM_PROCID", "SLURM_LOCALID")  # differ per rank: rank 0 cannot see them


def _int_var(env, name, lo=None, hi=None):
    raw, own = env.get(name), name in OWN_VARS
    if raw is None or raw.strip() == "":
        raise UsageError(f"{name} is empty", own)
    try:
        val = int(raw.strip())
    except ValueError:
        raise UsageError(f"{name}={raw!r} is not an integer", own) from None
    if lo is not None and val < lo:
        raise UsageError(f"{name}={val} is below {lo}", own)
    if hi is not None and val > hi:
        raise UsageError(f"{name}={val} is above {hi}", own)
    return val


def _pick(env, *names):
    return next((n for n in names if n in env), None)


def derive_port(job_id):
    """Port used when Slurm gives no MASTER_PORT: deterministic per job, in 49152-65535."""
    return 49152 + job_id % 16384


def in_batch_shell(env):
    """True in an sbatch/salloc shell: a job exists but no srun step started this process."""
    return ("SLURM_JOB_ID" in env and "RANK" not in env
            and "SLURM_STEP_ID" not in env and "SLURM_STEPID" not in env)


def this_machine(addr):
    """Whether a MASTER_ADDR names this machine: a loopback address, localhost, or this host's own name."""
    a = addr.strip().strip("[]").lower()
    host = socket.gethostname().lower()
    return a in ("localhost", "::1", host, host.split(".")[0]) or a.startswith("127.")


REPLICA_POD = re.compile(r"(.+)-(master|worker)-(\d+)")  # PyTorchJob's, MPIJob's and Volcano's pod names


def pod_of_several(env, host=None):
    """Why this process, with no launch variables, is one pod of a multi-pod job, or None: inside a pod
    (KUBERNETES_SERVICE_HOST) whose name is a replica's, <job>-master-N or <job>-worker-N (a PyTorchJob v1
    init container, a pod whose launcher writes its variables into other containers). Alone it would test
    its own node and PASS with nothing between the nodes tested."""
    if not env.get("KUBERNETES_SERVICE_HOST"):
        return None
    host = (host or socket.gethostname()).split(".")[0]
    m = REPLICA_POD.fullmatch(host)
    return f"this pod, {host}, is a {m.group(2)} replica of a multi-pod job ({m.group(1)})" if m else None


def _no_rank(env):
    """No RANK (nor SLURM_PROCID): local mode, unless the environment is half a launch contract: a size or
    local rank without a rank, an MPI launcher's variables, or a master that is another machine (a multi-node
    hint, never replaced by 127.0.0.1)."""
    if in_batch_shell(env):
        raise UsageError("running in the Slurm batch shell, not as an srun task: launch it with "
                         "srun (one task per GPU), e.g. srun python ddp_mesh_ping.py")
    partial = [f"{v}={env[v]!r}" for v in ("WORLD_SIZE", "LOCAL_RANK", *MPI_SIZE_VARS, *MPI_LOCAL_VARS) if v in env]
    if partial:
        raise UsageError(" and ".join(partial) + (" are" if len(partial) > 1 else " is") + " set but RANK is not: a "
                         "rank needs RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT; unset them all to "
                         "run in local mode", own=True)
    for var in ("MASTER_ADDR", "PET_MASTER_ADDR"):
        if env.get(var) is not None and not this_machine(env[var]):
            raise UsageError(f"{var}={env[var]!r} is set but RANK is not: a master on another machine is half a "
                             "multi-node launch; give each process RANK, WORLD_SIZE, LOCAL_RANK and MASTER_PORT, or, "
                             "one process per node, PET_NNODES and PET_NODE_RANK (this tool then starts the node's "
                             f"ranks); unset {var} to run in local mode on this machine")
    several = pod_of_several(env)
    if several:
        raise UsageError(f"{several}, but no launch variables reach this container (a PyTorchJob v1 init "
                         "container gets none of the operator's): alone it would test this node only. Run it as "
                         "the main container, or give it PET_NNODES, PET_NODE_RANK, MASTER_ADDR and MASTER_PORT; "
                         "to test this node alone on purpose, PET_NNODES=1 PET_NODE_RANK=0 MASTER_ADDR=127.0.0.1")


# An MPI launcher's rank variables (Open MPI, PMIx, MPICH/Hydra and Intel MPI), read after torchrun's and
# Slurm's names: under srun --mpi=pmix Slurm's own come first.
MPI_RANK_VARS = ("OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK")
MPI_SIZE_VARS = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE")
MPI_LOCAL_VARS = ("OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "PMI_LOCAL_RANK")


def _rank_names(env):
    """The variables that give rank, world size and local rank (torchrun's names, then Slurm's, then an
    MPI launcher's). A launch that gives only part of them is one line naming what is missing."""
    names = {"RANK": _pick(env, "RANK", "SLURM_PROCID", *MPI_RANK_VARS),
             "WORLD_SIZE": _pick(env, "WORLD_SIZE", "SLURM_NTASKS", "SLURM_STEP_NUM_TASKS", *MPI_SIZE_VARS),
             "LOCAL_RANK": _pick(env, "LOCAL_RANK", "SLURM_LOCALID", *MPI_LOCAL_VARS)}
    mpi = names["RANK"] in MPI_RANK_VARS
    for wanted, var in names.items():
        if var is None:
            raise UsageError(f"{wanted} is not set (nor its Slurm or MPI fallback)" + (
                f": the MPI launcher set {names['RANK']} but not {wanted}; export {wanted} for each rank "
                "(mpirun -x) or launch with srun or torchrun" if mpi else
                ": set LOCAL_RANK for each process (its index on its node); for one process per node or pod, set "
                "PET_NNODES and PET_NODE_RANK instead of RANK and this tool starts the node's ranks"
                if wanted == "LOCAL_RANK" else ""), own=wanted != "WORLD_SIZE")
    return names


def check_host(var, addr):
    """A master's host name or address as given in `var`, stripped (and its [] of IPv6); UsageError if it is none."""
    addr = addr.strip()
    if not addr or not re.fullmatch(r"[A-Za-z0-9_.:%\-\[\]]{1,253}", addr):
        raise UsageError(f"{var}={addr!r} is not a host name or address")
    return addr.strip("[]")


def _master(env):
    """(address, port, the variable the port came from)."""
    addr_var, addr = "MASTER_ADDR", env.get("MASTER_ADDR")
    if addr is None and env.get("SLURM_JOB_NODELIST"):
        addr_var = "SLURM_JOB_NODELIST"
        try:
            addr = expand_hostlist(env["SLURM_JOB_NODELIST"])[0]
        except ValueError as e:
            raise UsageError(f"SLURM_JOB_NODELIST={env['SLURM_JOB_NODELIST']!r}: {e}") from None
    if addr is None:
        raise UsageError("MASTER_ADDR is not set (nor SLURM_JOB_NODELIST)")
    addr = check_host(addr_var, addr)
    if "MASTER_PORT" in env:
        return addr, _int_var(env, "MASTER_PORT", lo=1, hi=65535), "MASTER_PORT"
    if "SLURM_JOB_ID" in env:
        return addr, derive_port(_int_var(env, "SLURM_JOB_ID", lo=0)), "SLURM_JOB_ID"
    raise UsageError("MASTER_PORT is not set (nor SLURM_JOB_ID to derive one)")


def read_contract(env):
    """The launch contract as a dict, or None for local mode. Raises UsageError (own=True when the
    mistake is in this rank's own values)."""
    if _pick(env, "RANK", "SLURM_PROCID", *MPI_RANK_VARS) is None:
        _no_rank(env)
        return None
    if in_batch_shell(env):
        raise UsageError("SLURM_PROCID is set but no srun step started this process (batch shell): "
                         "launch it with srun (one task per GPU), e.g. srun python ddp_mesh_ping.py")
    names = _rank_names(env)
    world = _int_var(env, names["WORLD_SIZE"], lo=1, hi=1_000_000)
    rank = _int_var(env, names["RANK"], lo=0)
    if rank >= world:
        raise UsageError(f"{names['RANK']}={rank} is not below {names['WORLD_SIZE']}={world}", own=True)
    local_rank = _int_var(env, names["LOCAL_RANK"], lo=0, hi=1023)
    if local_rank > rank:
        raise UsageError(f"{names['LOCAL_RANK']}={local_rank} is larger than {names['RANK']}={rank}", own=True)
    try:
        addr, port, port_src = _master(env)
    except UsageError as e:
        if names["RANK"] in MPI_RANK_VARS:  # mpirun sets no rendezvous of its own
            raise UsageError(f"{e}: under an MPI launcher ({names['RANK']} is set) export MASTER_ADDR (the host of "
                             "rank 0) and MASTER_PORT to every rank, e.g. mpirun -x MASTER_ADDR=node1 -x "
                             "MASTER_PORT=29500") from None
        raise
    source = "slurm" if names["RANK"] == "SLURM_PROCID" else "mpi" if names["RANK"] in MPI_RANK_VARS else "env"
    return {"rank": rank, "world_size": world, "local_rank": local_rank,
            "master_addr": addr, "master_port": port, "port_source": port_src, "source": source,
            "vars": [names["RANK"], names["WORLD_SIZE"], names["LOCAL_RANK"]]}


def slurm_expected_hosts(env, world):
    """rank -> expected host from Slurm's layout (block distribution), or {}."""
    nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST")
    tpn = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE")
    if not nodelist or not tpn or "cyclic" in env.get("SLURM_DISTRIBUTION", ""):
        return {}
    try:
        hosts = expand_hostlist(nodelist)
        counts = parse_tasks_per_node(tpn)
    except ValueError:
        return {}
    if len(hosts) != len(counts) or sum(counts) != world:
        return {}
    return dict(enumerate(h for h, c in zip(hosts, counts, strict=True) for _ in range(c)))


def slurm_expectations(env):
    """Default expected shape from what Slurm launched (the srun step first, then the job); absent keys mean no
    expectation, and an uneven layout (e.g. 2,1) sets no ranks-per-node."""
    out = {}
    for key, names in (("world_size", ("SLURM_STEP_NUM_TASKS", "SLURM_NTASKS")),
                       ("nodes", ("SLURM_STEP_NUM_NODES", "SLURM_JOB_NUM_NODES"))):
        for var in names:
            with contextlib.suppress(ValueError):
                if env.get(var):
                    out[key] = int(env[var])
                    break
    layout = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE")
    if layout:
        with contextlib.suppress(ValueError):
            counts = set(parse_tasks_per_node(layout))
            if len(counts) == 1:
                out["ranks_per_node"] = counts.pop()
            return out
    with contextlib.suppress(ValueError):
        if env.get("SLURM_NTASKS_PER_NODE"):
            out["ranks_per_node"] = int(env["SLURM_NTASKS_PER_NODE"])
    return out


def under_torchrun(env):
    return "TORCHELASTIC_RUN_ID" in env


def launcher_store(env):
    """(key prefix, serve) of the side channel. torch's rule (_create_c10d_store): with
    TORCHELASTIC_USE_AGENT_STORE=True every rank, rank 0 included, is a client of the agent's store at
    MASTER_ADDR:MASTER_PORT; otherwise rank 0 serves it. The agent's store outlives worker restarts,
    so the keys carry the run id and the restart count."""
    if not under_torchrun(env):
        return "aiv", True
    prefix = f"aiv/{env['TORCHELASTIC_RUN_ID']}/{env.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    return prefix, env.get("TORCHELASTIC_USE_AGENT_STORE", "").strip().lower() != "true"


def launcher_expectations(env):
    """The expected shape from the launcher: torchrun's WORLD_SIZE / LOCAL_WORLD_SIZE / GROUP_WORLD_SIZE
    (under `srun torchrun`, Slurm's task counts are agents, not ranks), else what Slurm launched."""
    if not under_torchrun(env):
        return slurm_expectations(env)
    out = {}
    for key, var in (("world_size", "WORLD_SIZE"), ("ranks_per_node", "LOCAL_WORLD_SIZE"),
                     ("nodes", "GROUP_WORLD_SIZE")):
        with contextlib.suppress(KeyError, ValueError):
            out[key] = int(env[var])
    return out


SECRET_VAR, SECRET_MIN = "AIV_JOB_SECRET", 32  # the job's secret: the batch file and local mode make 64 hex digits


def job_secret(env):
    """The job's secret (bytes), None when unset; UsageError when it is too weak to authenticate. The
    value is never echoed: not here, not in the report, the JSON or the manifest."""
    raw = env.get(SECRET_VAR)
    if raw is None:
        return None
    if len(raw.strip()) < SECRET_MIN:
        raise UsageError(f"{SECRET_VAR} is set but holds {len(raw.strip())} character(s), fewer than {SECRET_MIN}: too "
                         "weak to authenticate the side channel; unset it, or export a fresh one: export "
                         f"{SECRET_VAR}=$(python3 -c 'import secrets; print(secrets.token_hex(32))')")
    return raw.strip().encode()
