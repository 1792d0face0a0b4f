"""Launched the way Kubernetes launches it, for real: one process per "pod", each in a UTS namespace of its
own (its own hostname) and a mount namespace of its own (its own /etc/hosts, where the manifests' DNS names
of pod 0 resolve), with each launcher's exact environment. Where a pod runs one process for its node (Kubeflow
Trainer v2, PyTorchJob v1, an Indexed Job, JobSet, LeaderWorkerSet, Volcano) the tool starts the node's ranks;
the shipped manifests' own containers (command, env) are what runs. The only test knob: a free port replaces
the manifests' 29500 (other runs share this machine's network), and the performance screen is off
(AIV_SKIP_SCREEN: CPU ranks of pods sharing a loaded 2-core machine measure nothing a launch contract is about)."""
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import fork_server as forks
import psutil
import pytest
import yaml

from conftest import ROOT, SCRIPT, aiv, clean_env, failures, finish, fork_server, free_port, stand_in_venv, state

K8S = ROOT / "k8s"
SECRET = "5e" * 32
ARGS = ["--timeout", "60", "--rollcall-timeout", "120"]


def _skip_or_fail(msg):
    if os.environ.get("CI") == "true":
        pytest.fail(msg)
    pytest.skip(msg)


@pytest.fixture(autouse=True)
def namespaces():
    if os.geteuid() != 0 or not shutil.which("unshare"):
        _skip_or_fail("needs root and unshare (util-linux) for a UTS and a mount namespace per pod")


def pods(specs, tmp_path, timeout=300):
    """specs: [(hostname, env, argv)], argv the pod's command. Each pod: its own hostname, and an /etc/hosts
    in which every name of names() resolves to 127.0.0.1. -> [(rc, stdout)]"""
    hosts = tmp_path / "hosts"
    names = {h for h, _, _ in specs} | {v for _, env, _ in specs for k, v in env.items()
                                        if k.endswith(("MASTER_ADDR", "LEADER_ADDRESS"))}
    hosts.write_text("127.0.0.1 localhost\n" + "".join(f"127.0.0.1 {n}\n" for n in sorted(names)))
    procs = [pod_popen(host, hosts, argv, env=clean_env(dict({"AIV_SKIP_SCREEN": "on"}, **env)),
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for host, env, argv in specs]
    return [(rc, out) for rc, out, _ in finish(procs, timeout)]


def pod_popen(host, hosts, argv, **kwargs):
    """A pod's process: `argv` with its own hostname and `hosts` as its /etc/hosts (a UTS and a mount namespace of
    its own). A run of the tool is forked from the fork server, which enters the namespaces in the child (torch
    imported once); any other command, or a start the fork cannot reproduce, runs under unshare."""
    return forks.ToolPopen([str(a) for a in argv], server=fork_server(), pod=(host, str(hosts)), **kwargs)


def tool(*args):
    return [sys.executable, str(SCRIPT), *ARGS, *args]


def passed(results, world, nodes, launch):
    """Every pod exited 0; pod 0 printed the report of `world` ranks on `nodes` nodes, read from `launch`."""
    (rc0, out0), rest = results[0], results[1:]
    assert rc0 == 0 and all(rc == 0 for rc, _ in rest), "\n".join(out for _, out in results)
    assert f"Total Execution Ranks: {world}" in out0.splitlines() and aiv.SUCCESS_LINE in out0
    assert f"nodes={nodes} ranks_reported={world}/{world}" in out0
    header = next(ln for ln in out0.splitlines() if ln.startswith("Master: "))
    assert f"launch: {launch}" in header and "local mode" not in out0
    for _, out in rest:  # another node's log: one line of what its ranks got, no report, no success line
        assert "the verdict they got: exit 0" in out and aiv.SUCCESS_LINE not in out
    return out0


def contract_line(out):
    return next(ln for ln in out.splitlines() if "] contract: " in ln)


# ---------------------------------------------------------------------------- Kubeflow Trainer v2
def trainer_env(i, port, nodes=2, **extra):
    """What Trainer v2's Torch plugin injects (pkg/runtime/framework/plugins/torch/torch.go), plus the
    completion index of its JobSet's Indexed Job."""
    return {"PET_NNODES": nodes, "PET_NPROC_PER_NODE": "auto", "PET_NODE_RANK": i, "JOB_COMPLETION_INDEX": i,
            "PET_MASTER_ADDR": "pretrain-node-0-0.pretrain", "PET_MASTER_PORT": port, **extra}


def runtime_init_container():
    doc = yaml.safe_load((K8S / "trainer-v2-runtime.yaml").read_text())
    (job,) = doc["spec"]["template"]["spec"]["replicatedJobs"]
    (init,) = job["template"]["spec"]["template"]["spec"]["initContainers"]
    return init


def manifest_env(container, index, **given):
    """A container's env as the kubelet makes it: values, the completion index, the node's name, the jobset
    label, the Secret (the test's own); `given` wins (the platform's own variables)."""
    out, jobset = {}, given.pop("_jobset", "jobset")
    for e in container.get("env", []):
        if "value" in e:
            out[e["name"]] = e["value"]
            continue
        ref = e["valueFrom"]
        path = ref.get("fieldRef", {}).get("fieldPath", "")
        if "job-completion-index" in path:
            out[e["name"]] = index
        elif path == "spec.nodeName":
            out[e["name"]] = f"knode{index}"
        elif "jobset-name" in path:
            out[e["name"]] = jobset
        elif "secretKeyRef" in ref:
            out[e["name"]] = SECRET
    out["KUBERNETES_SERVICE_HOST"] = "10.96.0.1"  # every pod has it: NODE_NAME is read
    out["PYTORCH_ENV"] = stand_in_venv()  # the parameter: a venv (this test's, whose python forks the run)
    return {**out, **given}


def manifest_argv(container, *args):
    """The container's command and args, the ConfigMap's mount path replaced by this repository's file."""
    mount = next(m["mountPath"] for m in container["volumeMounts"] if m["name"] == "tool")
    cmd = [c.replace(f"{mount}/ddp_mesh_ping.py", str(SCRIPT)) for c in container["command"]]
    return [*cmd, *container.get("args", []), *ARGS, *args]


def test_trainer_v2_two_pods_of_two_ranks_pass_as_one_job_of_four(tmp_path):
    """Before: each pod ran a local 2-rank job of its own and printed SUCCESS; no byte crossed between them.
    The runtime's init container (k8s/trainer-v2-runtime.yaml) with what envInjection gives it."""
    init, port = runtime_init_container(), free_port()
    specs = [(f"pretrain-node-0-{i}", manifest_env(init, i, **trainer_env(i, port)), manifest_argv(init))
             for i in range(2)]
    out0 = passed(pods(specs, tmp_path), 4, 2, "Kubeflow Trainer v2, this tool starting 2 rank(s) per node")
    assert "node=knode0 " in out0 and "node=knode1 " in out0  # NODE_NAME: the Kubernetes nodes are named
    assert contract_line(out0).endswith("; Kubeflow Trainer v2 (PET_NNODES, PET_NODE_RANK, PET_MASTER_ADDR): node "
                                        "0 of 2, 2 rank(s) per node started by this tool (CPU ranks: no GPU "
                                        "visible), rank = node x 2 + local rank")
    assert "(port from PET_MASTER_PORT)" in out0
    assert "[PASS] rendezvous: side channel authenticated" in out0 and SECRET not in out0


def test_a_pod_of_a_two_node_job_alone_never_passes_as_a_local_job(tmp_path):
    """PET_NNODES=2 and only node 0 started: the roll call waits for the other node's ranks and names them."""
    specs = [("pretrain-node-0-0", trainer_env(0, free_port()), tool("--rollcall-timeout", "8"))]
    ((rc, out),) = pods(specs, tmp_path)
    assert rc == aiv.EXIT_TIMEOUT and "Total Execution Ranks: 4" in out and aiv.SUCCESS_LINE not in out, out
    assert "local mode" not in out and failures(out) and failures(out)[0].startswith("FAILURE: rendezvous:")


# ---------------------------------------------------------------------------- PyTorchJob v1
@pytest.mark.parametrize("operator", ["1.6", "1.8"])
def test_pytorchjob_v1_two_pods_pass_each_the_launcher_of_its_ranks(tmp_path, operator):
    """WORLD_SIZE = pods, RANK = the pod's index, no LOCAL_RANK (training-operator <= 1.6; 1.7+ adds the PET_*
    names): before, `FAILURE: contract: LOCAL_RANK is not set`."""
    port = free_port()

    def env(i):
        e = {"MASTER_ADDR": "train-master-0", "MASTER_PORT": port, "WORLD_SIZE": 2, "RANK": i,
             "PYTHONUNBUFFERED": 1}
        if operator == "1.8":
            e.update(PET_MASTER_ADDR="train-master-0", PET_MASTER_PORT=port, PET_NNODES=2, PET_NODE_RANK=i,
                     PET_NPROC_PER_NODE="auto")
        return e
    specs = [(h, env(i), tool()) for i, h in enumerate(("train-master-0", "train-worker-0"))]
    out0 = passed(pods(specs, tmp_path), 4, 2, "PyTorchJob v1, this tool starting 2 rank(s) per node")
    names = "WORLD_SIZE, RANK" if operator == "1.6" else "PET_NNODES, PET_NODE_RANK"
    assert f"PyTorchJob v1 ({names}, MASTER_ADDR): node 0 of 2, 2 rank(s) per node" in contract_line(out0)
    assert "rank = node x 2 + local rank" in contract_line(out0)


@pytest.mark.parametrize("env,want", [
    ({"PET_NNODES": "2", "PET_NPROC_PER_NODE": "2", "PET_NODE_RANK": "0", "PET_MASTER_ADDR": "127.0.0.1",
      "PET_MASTER_PORT": "29500", "WORLD_SIZE": "3"},
     "FAILURE: contract: Kubeflow Trainer v2: PET_NNODES=2 node(s) x 2 rank(s) per node make 4 ranks, but "
     "WORLD_SIZE=3: set WORLD_SIZE to 4 (ranks) or 2 (pods), or unset it"),
    ({"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "m", "MASTER_PORT": "23456", "CUDA_VISIBLE_DEVICES": "0,1,2,3"},
     "FAILURE: contract: RANK=1 and WORLD_SIZE=2 are set but LOCAL_RANK is not, on a node with 4 GPUs: RANK may "
     "count pods (PyTorchJob v1: one process per pod) or processes; set PET_NPROC_PER_NODE=4 (nprocPerNode) or "
     "--nproc 4 when it counts pods (this tool then starts one rank per GPU), or LOCAL_RANK when every process is "
     "one rank"),
    ({"PET_NNODES": "2", "PET_NODE_RANK": "1", "JOB_COMPLETION_INDEX": "0", "PET_MASTER_ADDR": "m",
      "PET_MASTER_PORT": "29500"},
     "FAILURE: contract: Kubeflow Trainer v2: PET_NODE_RANK=1 and JOB_COMPLETION_INDEX=0 disagree on this node's "
     "index: set one of them, or make them equal"),
    ({"MASTER_ADDR": "node1"}, "FAILURE: contract: MASTER_ADDR='node1' is set but RANK is not: a master on another "
     "machine is half a multi-node launch"),
])
def test_a_contradictory_or_insufficient_environment_is_one_line_and_exit_2(tmp_path, env, want):
    ((rc, out),) = pods([("pod-0", env, tool())], tmp_path, timeout=60)
    assert rc == aiv.EXIT_USAGE and failures(out) == [out.strip()] and out.strip().startswith(want), out
    assert "Total Execution Ranks" not in out and "Traceback" not in out


# ---------------------------------------------------------------------------- Indexed Job, JobSet
def test_indexed_job_manifest_two_pods_pass(tmp_path):
    """k8s/indexed-job.yaml's container, as the Job controller starts it: JOB_COMPLETION_INDEX, the hostname
    <job>-<index>, the manifest's env (PET_NNODES, MASTER_ADDR of pod 0 through the headless Service)."""
    docs = list(yaml.safe_load_all((K8S / "indexed-job.yaml").read_text()))
    job = next(d for d in docs if d["kind"] == "Job")
    (c,) = job["spec"]["template"]["spec"]["containers"]
    name, port = job["metadata"]["name"], free_port()
    specs = [(f"{name}-{i}", manifest_env(c, i, JOB_COMPLETION_INDEX=i, MASTER_PORT=port), manifest_argv(c))
             for i in range(job["spec"]["completions"])]
    out0 = passed(pods(specs, tmp_path), 4, 2, "Indexed Job, this tool starting 2 rank(s) per node")
    assert "Indexed Job (PET_NNODES, JOB_COMPLETION_INDEX, MASTER_ADDR): node 0 of 2" in contract_line(out0)
    assert f"Master: {name}-0.{name}:{port} (port from MASTER_PORT)" in out0


def test_jobset_manifest_preflight_two_pods_pass(tmp_path):
    """k8s/jobset.yaml's preflight replicated job: pod <jobset>-preflight-0-<i>, JOBSET_NAME from its label."""
    js = yaml.safe_load((K8S / "jobset.yaml").read_text())
    rjob = next(r for r in js["spec"]["replicatedJobs"] if r["name"] == "preflight")
    (c,) = rjob["template"]["spec"]["template"]["spec"]["containers"]
    name, port = js["metadata"]["name"], free_port()
    specs = [(f"{name}-preflight-0-{i}", manifest_env(c, i, JOB_COMPLETION_INDEX=i, MASTER_PORT=port, _jobset=name),
              manifest_argv(c, "--nproc", "1")) for i in range(2)]
    out0 = passed(pods(specs, tmp_path), 2, 2, "JobSet, this tool starting 1 rank(s) per node")
    assert "JobSet (PET_NNODES, JOB_COMPLETION_INDEX, MASTER_ADDR): node 0 of 2, 1 rank(s) per node started by " \
           "this tool (--nproc=1)" in contract_line(out0)


# ---------------------------------------------------------------------------- LeaderWorkerSet, Volcano
def test_leaderworkerset_leader_and_worker_pass(tmp_path):
    """LWS_LEADER_ADDRESS, LWS_GROUP_SIZE, LWS_WORKER_INDEX (lws pkg/utils/pod/pod_utils.go); no port: 29500
    unless MASTER_PORT says (here it does: a free one)."""
    port = free_port()
    env = {"LWS_LEADER_ADDRESS": "vllm-0.vllm.default", "LWS_GROUP_SIZE": 2, "MASTER_PORT": port}
    specs = [(h, dict(env, LWS_WORKER_INDEX=i), tool("--nproc", "1")) for i, h in enumerate(("vllm-0", "vllm-0-1"))]
    out0 = passed(pods(specs, tmp_path), 2, 2, "LeaderWorkerSet, this tool starting 1 rank(s) per node")
    assert "LeaderWorkerSet (LWS_GROUP_SIZE, LWS_WORKER_INDEX, LWS_LEADER_ADDRESS): node 0 of 2" in contract_line(out0)


def test_volcano_pytorch_plugin_master_and_worker_pass(tmp_path):
    """The pytorch plugin's MASTER_ADDR, MASTER_PORT, WORLD_SIZE (pods) and RANK (master 0, worker i+1) beside the
    env plugin's VC_TASK_INDEX (0 in both: each pod is the first of its task)."""
    port = free_port()
    env = {"MASTER_ADDR": "vj-master-0.vj", "MASTER_PORT": port, "WORLD_SIZE": 2, "VC_TASK_INDEX": 0,
           "VK_TASK_INDEX": 0, "VC_MASTER_NUM": 1, "VC_MASTER_HOSTS": "vj-master-0.vj", "VC_WORKER_NUM": 1,
           "VC_WORKER_HOSTS": "vj-worker-0.vj"}
    specs = [(h, dict(env, RANK=i), tool("--nproc", "1")) for i, h in enumerate(("vj-master-0", "vj-worker-0"))]
    out0 = passed(pods(specs, tmp_path), 2, 2, "Volcano, this tool starting 1 rank(s) per node")
    assert "Volcano (WORLD_SIZE, RANK, MASTER_ADDR): node 0 of 2" in contract_line(out0)


# ---------------------------------------------------------------------------- mpirun
def test_mpirun_environment_one_rank_per_process_passes(tmp_path):
    """Open MPI's variables, one rank per process (mpirun starts them), the master exported with -x."""
    port = free_port()
    env = {"OMPI_COMM_WORLD_SIZE": 2, "OMPI_COMM_WORLD_LOCAL_RANK": 0, "OMPI_COMM_WORLD_LOCAL_SIZE": 1,
           "MASTER_ADDR": "mpi-0", "MASTER_PORT": port}
    specs = [(f"mpi-{i}", dict(env, OMPI_COMM_WORLD_RANK=i, PMIX_RANK=i), tool()) for i in range(2)]
    results = pods(specs, tmp_path)
    assert [rc for rc, _ in results] == [0, 0], "\n".join(o for _, o in results)
    out0 = results[0][1]
    assert "Total Execution Ranks: 2" in out0 and "launch: mpirun " in out0 and "nodes=2 ranks_reported=2/2" in out0
    assert contract_line(out0).endswith("; mpirun: OMPI_COMM_WORLD_RANK, OMPI_COMM_WORLD_SIZE, "
                                        "OMPI_COMM_WORLD_LOCAL_RANK, one process per rank started by the launcher")


@pytest.mark.parametrize("drop", ["MASTER_ADDR", "OMPI_COMM_WORLD_RANK"])
def test_mpirun_environment_is_never_a_silent_local_job(tmp_path, drop):
    env = {"OMPI_COMM_WORLD_RANK": 0, "OMPI_COMM_WORLD_SIZE": 2, "OMPI_COMM_WORLD_LOCAL_RANK": 0,
           "MASTER_ADDR": "mpi-0", "MASTER_PORT": free_port()}
    env.pop(drop)
    ((rc, out),) = pods([("mpi-0", env, tool())], tmp_path, timeout=60)
    assert rc == aiv.EXIT_USAGE and len(failures(out)) == 1 and out.strip().startswith("FAILURE: contract: "), out
    assert "Total Execution Ranks" not in out and re.search(r"MASTER_ADDR|RANK", out)


# ---------------------------------------------------------------------------- the per-node launcher's guarantees
def test_sigterm_to_another_nodes_launcher_stops_its_ranks_and_every_pod_exits_with_a_verdict(tmp_path):
    """Pod 1 deleted mid-run (the kubelet's SIGTERM to its process): its launcher passes the signal to its
    ranks, which stop; it exits 5 (interrupted) with one line; rank 0 gives the verdict on pod 0, blaming no
    host, and pod 0 exits with it. Rank 0 waits in init (a test pause) so that the signal lands mid-run."""
    mark, jp, port = tmp_path / "mark", tmp_path / "v.json", free_port()
    hosts = tmp_path / "hosts"
    hosts.write_text("127.0.0.1 localhost\n127.0.0.1 pretrain-node-0-0.pretrain\n")
    procs = []
    for i in range(2):
        env = clean_env(trainer_env(i, port, AIV_FAILPOINT="pause=120:init:0", AIV_FAILPOINT_MARK=mark))
        argv = [sys.executable, SCRIPT, "--timeout", "15", "--rollcall-timeout", "120", "--skip-screen", "--json", jp]
        procs.append(pod_popen(f"pretrain-node-0-{i}", hosts, argv, env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True))
    end = time.monotonic() + 180
    while not mark.exists() and time.monotonic() < end and all(p.poll() is None for p in procs):
        time.sleep(0.1)
    assert mark.exists(), "\n".join(o for _, o, _ in finish(procs, 5))
    ranks = [c for c in psutil.Process(procs[1].pid).children() if str(SCRIPT) in c.cmdline()]
    assert len(ranks) == 2
    procs[1].send_signal(signal.SIGTERM)
    (rc0, out0, _), (rc1, out1, _) = finish(procs, 180)
    assert not any(state(r) not in (psutil.STATUS_ZOMBIE, "gone") for r in ranks), out1
    assert rc1 == aiv.EXIT_INTERRUPTED and failures(out1) == [ln for ln in out1.splitlines() if "FAILURE" in ln]
    assert failures(out1)[0].startswith("FAILURE: interrupted: the launcher of node 1 (pretrain-node-0-1) was "
                                        "interrupted by SIGTERM: its ranks 2-3 stopped"), out1
    d = json.loads(jp.read_text())
    assert rc0 == d["exit_code"] != 0 and d["failed_hosts"] == [] and aiv.SUCCESS_LINE not in out0, out0
    assert "Traceback" not in out0 + out1


def test_a_pod_given_gpus_it_cannot_use_fails_naming_its_node_never_a_cpu_run(tmp_path):
    """NVIDIA_VISIBLE_DEVICES lists the pod's GPU (the device plugin's allocation) but CUDA is unusable here:
    the rank FAILs on its device, naming the node; before, a pod like this ran 2 CPU ranks and passed."""
    env = trainer_env(0, free_port(), nodes=1, NVIDIA_VISIBLE_DEVICES="GPU-8f3c2a", NODE_NAME="knode7",
                      KUBERNETES_SERVICE_HOST="10.96.0.1")
    ((rc, out),) = pods([("pretrain-node-0-0", env, tool("--skip-screen"))], tmp_path)
    assert rc == aiv.EXIT_FAIL and "Total Execution Ranks: 1" in out and aiv.SUCCESS_LINE not in out, out
    assert any(ln.startswith("FAILURE: device:") and "knode7" in ln for ln in failures(out)), out
