"""A pod that is one of several never PASSes alone: a PyTorchJob v1 init container gets none of the operator's
variables (they go into the main containers only) and no JOB_COMPLETION_INDEX, so without a launch contract the
tool would run local mode in each pod and each would PASS with nothing between the nodes tested. Inside a pod
(KUBERNETES_SERVICE_HOST) whose name is a replica's (<job>-master-N, <job>-worker-N) it stops with one contract
line instead (exit 2); given the contract of a one-node job it runs that node alone, on purpose. Real processes,
each in a UTS namespace of its own named as the pod (tests/test_k8s_launchers.py's pods)."""
import os
import shutil

import pytest
from test_k8s_launchers import pods, tool

from conftest import aiv, free_port

POD_ENV = {"KUBERNETES_SERVICE_HOST": "10.96.0.1", "KUBERNETES_SERVICE_PORT": "443", "NODE_NAME": "gpu-node-7",
           "PYTORCH_ENV": ""}  # what an init container of k8s/pytorchjob.yaml's shape sees: nothing of the operator


@pytest.fixture(autouse=True)
def namespaces():
    if os.geteuid() != 0 or not shutil.which("unshare"):
        if os.environ.get("CI") == "true":
            pytest.fail("needs root and unshare (util-linux) for a UTS namespace per pod")
        pytest.skip("needs root and unshare (util-linux) for a UTS namespace per pod")


def test_a_pytorchjob_init_container_stops_instead_of_passing_alone(tmp_path):
    results = pods([("train-master-0", POD_ENV, tool()), ("train-worker-0", POD_ENV, tool())], tmp_path, 120)
    for (rc, out), host, role in zip(results, ("train-master-0", "train-worker-0"), ("master", "worker"), strict=True):
        assert rc == 2 and aiv.SUCCESS_LINE not in out and "local mode" not in out, out
        (line,) = [ln for ln in out.splitlines() if ln.startswith("FAILURE: contract:")]
        assert f"this pod, {host}, is a {role} replica of a multi-pod job (train)" in line, line
        assert "PET_NNODES=1 PET_NODE_RANK=0 MASTER_ADDR=127.0.0.1" in line


def test_one_node_on_purpose_is_a_one_node_contract(tmp_path):
    env = dict(POD_ENV, PET_NNODES="1", PET_NODE_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    ((rc, out),) = pods([("train-worker-1", env, tool())], tmp_path, 240)
    assert rc == 0 and aiv.SUCCESS_LINE in out and "Total Execution Ranks: 2" in out, out


@pytest.mark.parametrize("env, host, why", [
    (POD_ENV, "train-worker-12", "this pod, train-worker-12, is a worker replica of a multi-pod job (train)"),
    (POD_ENV, "my-job-master-0.my-job.ns.svc", "this pod, my-job-master-0, is a master replica of a multi-pod job "
                                               "(my-job)"),
    (POD_ENV, "debug-7f9c4", None),                 # a pod of one (a Deployment's, a plain Job's): local mode
    (POD_ENV, "aiv-node-check-x2kq9", None),        # the node gate's DaemonSet pod
    ({"NODE_NAME": "n"}, "train-worker-0", None),  # not inside a pod: a machine so named runs local mode
])
def test_what_makes_a_pod_one_of_several(env, host, why):
    assert aiv.pod_of_several(env, host) == why
