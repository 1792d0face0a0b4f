"""The shipped operator manifests' own preflight containers (command, args, env), started as their operators
start them: k8s/pytorchjob.yaml with training-operator's variables in the main container, k8s/volcano-job.yaml
with the pytorch, env and svc plugins', k8s/leaderworkerset.yaml's init container with LWS's. Each pod a real
process in a UTS and mount namespace of its own (tests/test_k8s_launchers.py's pods); one rank per pod (CPU ranks
of pods sharing a loaded 2-core machine). The only test knobs: a free port for the manifests' 29500, the venv."""
import os
import shutil

import pytest
import yaml
from test_k8s_launchers import K8S, contract_line, manifest_argv, manifest_env, passed, pods

from conftest import free_port


@pytest.fixture(autouse=True)
def namespaces():
    if os.geteuid() != 0 or not shutil.which("unshare"):
        if os.environ.get("CI") == "true":
            pytest.fail("needs root and unshare (util-linux) for a UTS and a mount namespace per pod")
        pytest.skip("needs root and unshare (util-linux) for a UTS and a mount namespace per pod")


def test_pytorchjob_manifest_master_and_worker_pass(tmp_path):
    job = yaml.safe_load((K8S / "pytorchjob.yaml").read_text())
    name, reps, port = job["metadata"]["name"], job["spec"]["pytorchReplicaSpecs"], free_port()
    nodes = 1 + reps["Worker"]["replicas"]
    master = f"{name}-master-0"
    specs = []
    for i, (kind, host) in enumerate([("Master", master)] + [("Worker", f"{name}-worker-{w}")
                                                             for w in range(reps["Worker"]["replicas"])]):
        (c,) = reps[kind]["template"]["spec"]["containers"]
        assert c["name"] == "pytorch"  # the operator writes its variables into this container only
        operator = dict(MASTER_ADDR=master, MASTER_PORT=port, WORLD_SIZE=nodes, RANK=i, PET_MASTER_ADDR=master,
                        PET_MASTER_PORT=port, PET_NNODES=nodes, PET_NODE_RANK=i, PET_NPROC_PER_NODE="auto")
        specs.append((host, manifest_env(c, i, **operator), manifest_argv(c, "--nproc", "1")))
    out0 = passed(pods(specs, tmp_path), nodes, nodes, "PyTorchJob v1, this tool starting 1 rank(s) per node")
    assert f"PyTorchJob v1 (PET_NNODES, PET_NODE_RANK, MASTER_ADDR): node 0 of {nodes}" in contract_line(out0)


def test_volcano_manifest_master_and_worker_pass(tmp_path):
    job = yaml.safe_load((K8S / "volcano-job.yaml").read_text())
    name, tasks, port = job["metadata"]["name"], job["spec"]["tasks"], free_port()
    assert set(job["spec"]["plugins"]) == {"pytorch", "env", "svc"}
    hosts = {t["name"]: [f"{name}-{t['name']}-{i}" for i in range(t["replicas"])] for t in tasks}
    nodes = sum(len(h) for h in hosts.values())
    plugins = {"MASTER_ADDR": f"{hosts['master'][0]}.{name}", "MASTER_PORT": port, "WORLD_SIZE": nodes}
    for t in tasks:  # the svc plugin's hosts and counts
        plugins[f"VC_{t['name'].upper()}_HOSTS"] = ",".join(f"{h}.{name}" for h in hosts[t["name"]])
        plugins[f"VC_{t['name'].upper()}_NUM"] = t["replicas"]
    specs, rank = [], 0
    for t in tasks:
        (c,) = t["template"]["spec"]["containers"]
        for i, host in enumerate(hosts[t["name"]]):
            env = manifest_env(c, rank, **plugins, RANK=rank, VC_TASK_INDEX=i)
            specs.append((host, env, manifest_argv(c, "--nproc", "1")))
            rank += 1
    out0 = passed(pods(specs, tmp_path), nodes, nodes, "Volcano, this tool starting 1 rank(s) per node")
    assert f"Volcano (WORLD_SIZE, RANK, MASTER_ADDR): node 0 of {nodes}" in contract_line(out0)


def test_leaderworkerset_manifest_init_containers_pass(tmp_path):
    lws = yaml.safe_load((K8S / "leaderworkerset.yaml").read_text())
    name, tmpl = lws["metadata"]["name"], lws["spec"]["leaderWorkerTemplate"]
    assert lws["spec"]["startupPolicy"] == "LeaderCreated"  # LeaderReady deadlocks an init-container preflight
    (c,) = tmpl["workerTemplate"]["spec"]["initContainers"]
    size, port = tmpl["size"], free_port()
    leader = f"{name}-0"
    injected = {"LWS_LEADER_ADDRESS": f"{leader}.{name}.default", "LWS_GROUP_SIZE": size}
    specs = [(leader if i == 0 else f"{leader}-{i}",
              manifest_env(c, i, **injected, LWS_WORKER_INDEX=i, MASTER_PORT=port), manifest_argv(c, "--nproc", "1"))
             for i in range(size)]
    out0 = passed(pods(specs, tmp_path), size, size, "LeaderWorkerSet, this tool starting 1 rank(s) per node")
    assert f"LeaderWorkerSet (LWS_GROUP_SIZE, LWS_WORKER_INDEX, LWS_LEADER_ADDRESS): node 0 of {size}" \
        in contract_line(out0)
