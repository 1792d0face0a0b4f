"""The table of launch contracts, without processes: which launcher each environment is, what a per-node
launch reads from it, every contradiction one line, and no environment that spans nodes ever a local job
(the real runs, one process per pod: test_k8s_launchers.py)."""
import json

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from test_plan import check_plan_or_line

from conftest import aiv

TRAINER = {"PET_NNODES": "2", "PET_NPROC_PER_NODE": "auto", "PET_NODE_RANK": "1", "JOB_COMPLETION_INDEX": "1",
           "PET_MASTER_ADDR": "tj-node-0-0.tj", "PET_MASTER_PORT": "29500"}
PYTORCHJOB = {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "job-master-0", "MASTER_PORT": "23456"}
PYTORCHJOB_17 = dict(PYTORCHJOB, PET_NNODES="2", PET_NODE_RANK="1", PET_NPROC_PER_NODE="auto",
                     PET_MASTER_ADDR="job-master-0", PET_MASTER_PORT="23456")
INDEXED = {"JOB_COMPLETION_INDEX": "1", "PET_NNODES": "2", "MASTER_ADDR": "aiv-0.aiv", "MASTER_PORT": "29500"}
JOBSET = dict(INDEXED, JOBSET_NAME="js", MASTER_ADDR="js-preflight-0-0.js")
LWS = {"LWS_LEADER_ADDRESS": "l-0.l.ns", "LWS_GROUP_SIZE": "2", "LWS_WORKER_INDEX": "1"}
VOLCANO = {"VC_TASK_INDEX": "0", "RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "vj-master-0.vj",
           "MASTER_PORT": "23456"}
VOLCANO_SVC = {"VC_TASK_INDEX": "1", "VC_WORKER_NUM": "2", "VC_WORKER_HOSTS": "vj-worker-0.vj,vj-worker-1.vj"}
PER_NODE = {"trainer-v2": TRAINER, "pytorchjob": PYTORCHJOB, "pytorchjob-1.7": PYTORCHJOB_17, "indexed-job": INDEXED,
            "jobset": JOBSET, "lws": LWS, "volcano": VOLCANO, "volcano-svc": VOLCANO_SVC}


@pytest.mark.parametrize("name", PER_NODE)
def test_each_per_node_launcher_is_this_nodes_launcher(name):
    p = aiv.plan([], PER_NODE[name])
    launch, key = p["launch"], name.split("-1.7")[0].split("-svc")[0]
    assert p["mode"] == "local" and launch["nproc"] == 2  # 2 CPU ranks: no GPU here
    assert launch["node"] == {"launcher": key, "nnodes": 2, "node_rank": 1}
    assert launch["launch"] == f"{aiv.BY_KEY[key].name}, this tool starting 2 rank(s) per node"
    assert launch["how"].startswith(aiv.BY_KEY[key].name + " (") and "rank = node x 2 + local rank" in launch["how"]
    assert p["check_json"] is False  # node 1: rank 0's node tries --json and reads the manifests


def test_the_master_and_port_each_launcher_gives():
    got = {n: (aiv.plan([], e)["launch"]["master_addr"], aiv.plan([], e)["launch"]["port"],
               aiv.plan([], e)["launch"]["port_from"]) for n, e in PER_NODE.items()}
    assert got["trainer-v2"] == ("tj-node-0-0.tj", 29500, "port from PET_MASTER_PORT")
    assert got["pytorchjob"] == ("job-master-0", 23456, "port from MASTER_PORT")
    assert got["lws"] == ("l-0.l.ns", 29500, "torchrun's default 29500: no MASTER_PORT")
    assert got["volcano-svc"] == ("vj-worker-0.vj", 29500, "torchrun's default 29500: no MASTER_PORT")


@pytest.mark.parametrize("env,ranks", [
    (dict(TRAINER, PET_NPROC_PER_NODE="3"), 3),
    (dict(TRAINER, WORLD_SIZE="4"), 2),                 # WORLD_SIZE as the ranks: agrees
    (dict(TRAINER, WORLD_SIZE="2"), 2),                 # ... or as the pods (PyTorchJob 1.7's with auto)
])
def test_ranks_per_node_and_a_world_size_that_agrees(env, ranks):
    assert aiv.plan([], env)["launch"]["nproc"] == ranks


@pytest.mark.parametrize("argv,env,words", [
    ([], dict(TRAINER, JOB_COMPLETION_INDEX="0"), "PET_NODE_RANK=1 and JOB_COMPLETION_INDEX=0 disagree"),
    ([], dict(TRAINER, WORLD_SIZE="3"), "make 4 ranks, but WORLD_SIZE=3"),
    ([], dict(TRAINER, PET_NNODES="1:4"), "PET_NNODES='1:4' is an elastic range"),
    ([], dict(TRAINER, PET_NODE_RANK="2", JOB_COMPLETION_INDEX="2"), "PET_NODE_RANK=2 is not below PET_NNODES=2"),
    ([], dict(TRAINER, PET_NPROC_PER_NODE="cpu"), "PET_NPROC_PER_NODE='cpu' is not a number nor auto"),
    (["--nproc", "2"], dict(TRAINER, PET_NPROC_PER_NODE="3"), "PET_NPROC_PER_NODE=3 and --nproc=2 disagree"),
    ([], dict(TRAINER, MASTER_ADDR="other"), "PET_MASTER_ADDR=tj-node-0-0.tj and MASTER_ADDR=other disagree"),
    ([], dict(PYTORCHJOB_17, PET_NODE_RANK="0"), "PET_NODE_RANK=0 and RANK=1 disagree"),
    ([], dict(PYTORCHJOB, CUDA_VISIBLE_DEVICES="0,1"), "RANK=1 and WORLD_SIZE=2 are set but LOCAL_RANK is not, on a "
                                                       "node with 2 GPUs"),
    ([], {k: v for k, v in INDEXED.items() if k != "PET_NNODES"}, "Indexed Job: the node count is not set: set "
                                                                   "PET_NNODES (the Job's completions)"),
    ([], {k: v for k, v in INDEXED.items() if k != "MASTER_ADDR"}, "Indexed Job: the master's address is not set"),
    ([], {"LWS_GROUP_SIZE": "2"}, "LeaderWorkerSet: this node's index is not set: set LWS_WORKER_INDEX"),
    ([], dict(VOLCANO_SVC, VC_MASTER_NUM="1", VC_MASTER_HOSTS="m"), "a job of 2 tasks (VC_MASTER_NUM, VC_WORKER_NUM)"),
    ([], {"VC_TASK_INDEX": "0"}, "no svc plugin variables"),
    ([], {"MASTER_ADDR": "node1"}, "MASTER_ADDR='node1' is set but RANK is not"),
    ([], {"PET_MASTER_ADDR": "node1"}, "PET_MASTER_ADDR='node1' is set but RANK is not"),
    ([], {"OMPI_COMM_WORLD_SIZE": "2"}, "OMPI_COMM_WORLD_SIZE='2' is set but RANK is not"),
    ([], {"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "3", "MASTER_ADDR": "a", "MASTER_PORT": "1", "PET_NNODES": "2",
          "PET_NPROC_PER_NODE": "2"}, "PET_NNODES=2 x PET_NPROC_PER_NODE=2 make 4 ranks, but WORLD_SIZE=3"),
])
def test_every_contradiction_is_one_contract_line(argv, env, words):
    with pytest.raises(aiv.UsageError) as e:
        aiv.plan(argv, env)
    line = str(e.value)
    assert line.startswith("FAILURE: contract: ") and words in line and "\n" not in line, line


def test_a_rank_without_local_rank_and_without_world_size_says_what_to_set():
    with pytest.raises(aiv.UsageError, match="WORLD_SIZE is not set"):
        aiv.plan([], {"RANK": "0", "MASTER_ADDR": "a", "MASTER_PORT": "1"})
    with pytest.raises(aiv.UsageError, match="set LOCAL_RANK for each process .* PET_NNODES and PET_NODE_RANK"):
        aiv.read_contract(dict(PYTORCHJOB))  # read as one process per rank: the line says what to set


def test_local_mode_says_so_and_keeps_a_master_of_this_machine():
    p = aiv.plan([], {"MASTER_ADDR": "localhost", "MASTER_PORT": "29511"})
    assert p["launch"]["master_addr"] == "localhost" and p["launch"]["launch"] == "local mode"
    assert p["launch"]["port_from"] == "port from MASTER_PORT" and p["launch"]["how"].startswith("local mode, no ")
    assert aiv.plan([], {})["launch"]["port_from"] == "a free port"


def test_per_process_launchers_keep_their_contract_and_say_which():
    base = {"RANK": "1", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "MASTER_ADDR": "n1", "MASTER_PORT": "29500"}
    torchrun = dict(base, TORCHELASTIC_RUN_ID="x", PET_NNODES="1:4", PET_NODE_RANK="0")  # torchrun's own PET_*
    assert aiv.plan([], torchrun)["contract"]["launch"] == "torchrun"
    assert aiv.plan([], base)["contract"]["launch"] == "RANK, WORLD_SIZE, LOCAL_RANK"
    slurm = {"SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_LOCALID": "1", "SLURM_STEP_ID": "0",
             "SLURM_JOB_ID": "5", "SLURM_JOB_NODELIST": "n[1-2]"}
    c = aiv.plan([], slurm)["contract"]
    assert (c["launch"], c["port_from"]) == ("Slurm srun", "port from SLURM_JOB_ID")
    assert c["how"] == "Slurm srun: SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID, one process per rank started by " \
                       "the launcher"


def test_this_tools_own_ranks_read_the_words_their_launcher_gave():
    told = {"launch": "Indexed Job, this tool starting 2 rank(s) per node", "how": "Indexed Job (...)",
            "port_from": "port from MASTER_PORT"}
    env = dict(INDEXED, RANK="3", LOCAL_RANK="1", WORLD_SIZE="4", _AIV_LAUNCH=json.dumps(told))
    c = aiv.plan([], env)["contract"]
    assert (c["rank"], c["world_size"]) == (3, 4) and {k: c[k] for k in told} == told


def test_node_name_is_slurms_then_the_pods_node_then_the_host(monkeypatch):
    monkeypatch.setattr(aiv.socket, "gethostname", lambda: "pod-1")
    assert aiv.node_name({"SLURMD_NODENAME": "gpu1", "NODE_NAME": "k1", "KUBERNETES_SERVICE_HOST": "x"}) == "gpu1"
    assert aiv.node_name({"NODE_NAME": "k1", "KUBERNETES_SERVICE_HOST": "10.96.0.1"}) == "k1"
    assert aiv.node_name({"NODE_NAME": "k1"}) == "pod-1"  # outside a pod NODE_NAME may mean anything


K8S_VARS = sorted({k for e in PER_NODE.values() for k in e} | {"LOCAL_RANK", "JOBSET_NAME", "WORLD_SIZE"})
VALUES = ["0", "1", "2", "3", "auto", "1:4", "", "x", "a-0.a", "127.0.0.1", "29500", "65536", "-1", "vj-0.vj,vj-1.vj"]


@settings(max_examples=400, deadline=None)
@example(name="volcano-svc", changed={}, dropped=["VC_TASK_INDEX", "VC_WORKER_HOSTS"])  # VC_WORKER_NUM=2 alone
@given(st.sampled_from(sorted(PER_NODE)), st.dictionaries(st.sampled_from(K8S_VARS), st.sampled_from(VALUES),
                                                          max_size=4), st.lists(st.sampled_from(K8S_VARS), max_size=3))
def test_any_kubernetes_environment_is_a_plan_or_one_line_and_never_local_when_it_spans_nodes(name, changed, dropped):
    env = dict(PER_NODE[name], **changed)
    for var in dropped:
        env.pop(var, None)
    p = check_plan_or_line([], env)
    if p is None or p["mode"] != "local":
        return
    node = p["launch"].get("node")
    counts = [int(env[v]) for v in ("PET_NNODES", "LWS_GROUP_SIZE", "VC_WORKER_NUM") if env.get(v, "").isdigit()]
    if any(c > 1 for c in counts):  # the environment says several nodes: this pod is one node of them
        assert node is not None and node["nnodes"] > 1, (env, p["launch"])


@pytest.mark.parametrize("value,n", [("GPU-a,GPU-b", 2), ("0,1,2", 3), ("all", None), ("void", None), ("none", None),
                                     ("", None), ("/var/run/nvidia-container-devices", None)])
def test_the_pods_gpu_allocation(value, n):
    assert aiv.allocated_gpus({"NVIDIA_VISIBLE_DEVICES": value}) == n
    assert bool(aiv.gpus_expected({"NVIDIA_VISIBLE_DEVICES": value}, "/nonexistent")) is (n is not None)


def test_a_pod_starts_one_rank_per_gpu_it_was_given_whatever_the_driver_shows():
    """Every pod of one template gets the same ranks per node: a GPU lost on one node fails that node's rank
    (no GPU visible: GPU ranks that fail, never a CPU run) instead of changing the world size."""
    env = dict(TRAINER, NVIDIA_VISIBLE_DEVICES="GPU-a,GPU-b,GPU-c")
    launch = aiv.plan([], env)["launch"]
    assert (launch["nproc"], launch["backend"]) == (3, None)
    assert aiv.plan(["--backend", "gloo"], env)["launch"]["nproc"] == 2
