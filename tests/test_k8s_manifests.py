"""The manifests under k8s/, offline: every core kind (Service, Job, ...) against Kubernetes' own OpenAPI
schemas (kubernetes-validate, strict: no unknown field, at the pinned versions it ships); every custom
resource (Kubeflow Trainer v2's ClusterTrainingRuntime and TrainJob, JobSet, PyTorchJob, MPIJob,
LeaderWorkerSet, Volcano's Job) against the field names of its published API types, its embedded Job and pod
templates against the core schemas; what ties the files together (names, DNS names, node counts, the
envInjection target); the kustomize base's one node count; every image's torch against the tool's floor; the
shipped file against ConfigMap's size limit; the pods' securityContext, requests, tolerations and TTL; and the
wait recipe of docs/kubernetes.md against a stand-in kubectl."""
import os
import re
import shutil
import subprocess
import sys
import textwrap
import time

import psutil
import pytest
import yaml

from conftest import ROOT, aiv

kubernetes_validate = pytest.importorskip("kubernetes_validate")
K8S = ROOT / "k8s"
KUSTOMIZATION = K8S / "kustomization.yaml"
FILES = sorted(f for f in K8S.glob("*.yaml") if f != KUSTOMIZATION)
# Kubernetes versions whose schemas kubernetes-validate ships: podFailurePolicy is GA in 1.31; the newest.
VERSIONS = ("1.31.0", "1.37.0")


def docs(path):
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def kind_of(doc):
    return doc["apiVersion"].rsplit("/", 1)[0] if "/" in doc["apiVersion"] else "", doc["kind"]


# ---------------------------------------------------------------------------- custom resources' fields
# Our own test data: the field names of the published API types, written down from their Go sources
# (json tags), at the commits read: kubeflow/trainer 8c0f505 pkg/apis/trainer/v1alpha1/{trainingruntime,
# trainjob}_types.go; kubernetes-sigs/jobset 08dfbdf api/jobset/v1alpha2/jobset_types.go. A dict is an
# object of those fields only; [schema] a list of it; a tuple the allowed values (an enum); ANY a value whose
# keys are the user's (labels) or a core type; JOB a batch/v1 JobTemplateSpec (checked as a Job, below).
ANY, JOB, POD = "any", "job-template", "pod-template"
META = {"name": str, "namespace": str, "labels": ANY, "annotations": ANY}
JOBSET_SPEC = {
    "replicatedJobs": [{"name": str, "groupName": str, "template": JOB, "replicas": int,
                        "dependsOn": [{"name": str, "status": ("Ready", "Complete")}]}],
    "network": {"enableDNSHostnames": bool, "subdomain": str, "publishNotReadyAddresses": bool},
    "successPolicy": {"operator": ("All", "Any"), "targetReplicatedJobs": [str]},
    "failurePolicy": {"maxRestarts": int, "restartStrategy": ("Recreate", "BlockingRecreate", "InPlaceRestart"),
                      "rules": ANY},
    "startupPolicy": {"startupPolicyOrder": ("AnyOrder", "InOrder")},
    "suspend": bool, "coordinator": {"replicatedJob": str, "jobIndex": int, "podIndex": int}, "managedBy": str,
    "ttlSecondsAfterFinished": int, "volumeClaimPolicies": ANY,
}
RUNTIME_SPEC = {
    "mlPolicy": {"numNodes": int,
                 "torch": {"envInjection": {"targets": [{"jobName": str, "containerNames": [str]}]}},
                 "mpi": ANY, "flux": ANY, "jax": ANY, "xgboost": ANY},
    "podGroupPolicy": ANY,
    "template": {"metadata": META, "spec": JOBSET_SPEC},
}
TRAINJOB_SPEC = {
    "runtimeRef": {"name": str, "apiGroup": str, "kind": str},
    "initializer": ANY,
    "trainer": {"image": str, "command": [str], "args": [str], "env": ANY, "numNodes": int,
                "resourcesPerNode": {"limits": ANY, "requests": ANY, "claims": ANY}, "numProcPerNode": int},
    "runtimePatches": ANY, "suspend": bool, "activeDeadlineSeconds": int, "managedBy": str,
}
# kubeflow/training-operator pkg/apis/kubeflow.org/v1 (pytorchjob_types.go, common_types.go), kubeflow/mpi-operator
# pkg/apis/kubeflow/v2beta1/types.go, kubernetes-sigs/lws api/leaderworkerset/v1/leaderworkerset_types.go,
# volcano-sh/apis pkg/apis/batch/v1alpha1/job.go: the fields the manifests use and their neighbours.
REPLICA = {"replicas": int, "template": POD, "restartPolicy": ("Always", "OnFailure", "Never", "ExitCode")}
RUN_POLICY = {"cleanPodPolicy": ("All", "Running", "None"), "ttlSecondsAfterFinished": int,
              "activeDeadlineSeconds": int, "backoffLimit": int, "suspend": bool, "managedBy": str,
              "schedulingPolicy": {"minAvailable": int, "queue": str, "minResources": ANY, "priorityClass": str,
                                   "scheduleTimeoutSeconds": int}}
PYTORCHJOB_SPEC = {"runPolicy": RUN_POLICY, "elasticPolicy": ANY, "nprocPerNode": str,
                   "pytorchReplicaSpecs": {"Master": REPLICA, "Worker": REPLICA}}
MPIJOB_SPEC = {"slotsPerWorker": int, "runPolicy": RUN_POLICY, "sshAuthMountPath": str,
               "mpiImplementation": ("OpenMPI", "Intel", "MPICH"), "launcherCreationPolicy": str,
               "mpiReplicaSpecs": {"Launcher": REPLICA, "Worker": REPLICA}}
LWS_SPEC = {"replicas": int, "startupPolicy": ("LeaderCreated", "LeaderReady"), "rolloutStrategy": ANY,
            "networkConfig": {"subdomainPolicy": ("Shared", "UniquePerReplica")},
            "leaderWorkerTemplate": {"leaderTemplate": POD, "workerTemplate": POD, "size": int,
                                     "restartPolicy": ("RecreateGroupOnPodRestart", "Default", "None"),
                                     "subGroupPolicy": ANY}}
VOLCANO_SPEC = {"schedulerName": str, "minAvailable": int, "queue": str, "maxRetry": int,
                "ttlSecondsAfterFinished": int, "priorityClassName": str, "minSuccess": int, "volumes": ANY,
                "plugins": {str: [str]}, "runningEstimate": ANY,
                "policies": [{"event": str, "events": [str], "action": str, "exitCode": int, "timeout": str}],
                "tasks": [{"name": str, "replicas": int, "minAvailable": int, "template": POD, "maxRetry": int,
                           "policies": ANY, "topologyPolicy": str, "dependsOn": ANY}]}
CUSTOM = {("trainer.kubeflow.org", "ClusterTrainingRuntime"): ("v1alpha1", RUNTIME_SPEC),
          ("trainer.kubeflow.org", "TrainingRuntime"): ("v1alpha1", RUNTIME_SPEC),
          ("trainer.kubeflow.org", "TrainJob"): ("v1alpha1", TRAINJOB_SPEC),
          ("jobset.x-k8s.io", "JobSet"): ("v1alpha2", JOBSET_SPEC),
          ("kubeflow.org", "PyTorchJob"): ("v1", PYTORCHJOB_SPEC),
          ("kubeflow.org", "MPIJob"): ("v2beta1", MPIJOB_SPEC),
          ("leaderworkerset.x-k8s.io", "LeaderWorkerSet"): ("v1", LWS_SPEC),
          ("batch.volcano.sh", "Job"): ("v1alpha1", VOLCANO_SPEC)}


def unknown_fields(value, schema, path):
    """Where `value` leaves `schema`: [(path, why)]. Job templates met on the way are collected in JOBS."""
    if schema == ANY:
        return []
    if schema in (JOB, POD):
        (JOBS if schema == JOB else PODS).append((path, value))
        return []
    if isinstance(schema, tuple):
        return [] if value in schema else [(path, f"{value!r} is not one of {schema}")]
    if isinstance(schema, list):
        if not isinstance(value, list):
            return [(path, "is not a list")]
        return [bad for i, v in enumerate(value) for bad in unknown_fields(v, schema[0], f"{path}[{i}]")]
    if isinstance(schema, dict) and list(schema) == [str]:  # a map: the user's keys, the values' schema
        return [bad for k, v in (value or {}).items() for bad in unknown_fields(v, schema[str], f"{path}.{k}")]
    if isinstance(schema, dict):
        if not isinstance(value, dict):
            return [(path, "is not an object")]
        return [bad for k, v in value.items() for bad in
                (unknown_fields(v, schema[k], f"{path}.{k}") if k in schema else [(f"{path}.{k}", "no such field")])]
    return [] if isinstance(value, schema) and not (schema is int and isinstance(value, bool)) else \
        [(path, f"is not a {schema.__name__}")]


JOBS, PODS = [], []


def as_job(template, name):
    """A JobTemplateSpec as the batch/v1 Job it becomes."""
    return {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": name, **template.get("metadata", {})},
            "spec": template["spec"]}


ALL = [(f, i, d) for f in FILES for i, d in enumerate(docs(f))]


def test_there_are_the_manifests_the_docs_promise():
    kinds = {kind_of(d) for _, _, d in ALL}
    assert {("", "Service"), ("batch", "Job"), ("trainer.kubeflow.org", "ClusterTrainingRuntime"),
            ("trainer.kubeflow.org", "TrainJob"), ("jobset.x-k8s.io", "JobSet"), ("kubeflow.org", "PyTorchJob"),
            ("kubeflow.org", "MPIJob"), ("leaderworkerset.x-k8s.io", "LeaderWorkerSet"),
            ("batch.volcano.sh", "Job")} <= kinds


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("path,i,doc", [a for a in ALL if kind_of(a[2]) not in CUSTOM],
                         ids=lambda x: x.name if hasattr(x, "name") else None)
def test_core_kinds_validate_against_kubernetes_schemas(path, i, doc, version):
    kubernetes_validate.validate(doc, version, strict=True)


@pytest.mark.parametrize("path,i,doc", [a for a in ALL if kind_of(a[2]) in CUSTOM],
                         ids=lambda x: x.name if hasattr(x, "name") else None)
def test_custom_resources_use_their_published_field_names(path, i, doc):
    group, kind = kind_of(doc)
    version, spec = CUSTOM[(group, kind)]
    assert doc["apiVersion"] == f"{group}/{version}"
    JOBS.clear()
    PODS.clear()
    bad = unknown_fields(doc, {"apiVersion": str, "kind": str, "metadata": META, "spec": spec}, kind)
    assert not bad, bad
    assert JOBS or PODS or kind == "TrainJob"
    for _, template in JOBS:  # the embedded Job templates: core kinds, strictly
        for v in VERSIONS:
            kubernetes_validate.validate(as_job(template, "x"), v, strict=True)
    for _, template in PODS:  # the embedded pod templates: core/v1 PodTemplateSpec, strictly
        for v in VERSIONS:
            kubernetes_validate.validate({"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "x"},
                                          "template": template}, v, strict=True)


def test_validation_needs_no_network(tmp_path):
    """kubernetes-validate reads the schemas it ships: the CLI passes every core file without a network."""
    if os.geteuid() != 0 or not shutil.which("unshare"):
        pytest.skip("needs root and unshare for a network namespace without interfaces")
    core = [str(f) for f in FILES if all(kind_of(d) not in CUSTOM for d in docs(f))]
    assert core
    r = subprocess.run(["unshare", "--net", sys.executable, "-m", "kubernetes_validate", "--strict", "-k",
                        VERSIONS[0], *core], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr


def test_a_misspelled_field_is_caught_in_both_kinds_of_file():
    """The two checks can fail: a core field and a custom resource's field, each misspelled once."""
    job = next(d for _, _, d in ALL if d["kind"] == "Job")
    broken = yaml.safe_load(yaml.safe_dump(job))
    broken["spec"]["template"]["spec"]["subDomain"] = broken["spec"]["template"]["spec"].pop("subdomain")
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, VERSIONS[0], strict=True)
    rt = next(d for _, _, d in ALL if d["kind"] == "ClusterTrainingRuntime")
    broken = yaml.safe_load(yaml.safe_dump(rt))
    broken["spec"]["mlPolicy"]["torch"]["envInjections"] = broken["spec"]["mlPolicy"]["torch"].pop("envInjection")
    assert unknown_fields(broken["spec"], RUNTIME_SPEC, "spec") == [("spec.mlPolicy.torch.envInjections",
                                                                     "no such field")]


# ---------------------------------------------------------------------------- what ties them together
def env_of(container):
    return {e["name"]: e.get("value") for e in container.get("env", [])}


def pod_spec(job_template):
    return job_template["spec"]["template"]["spec"]


def test_indexed_job_meets_at_pod_0_through_its_headless_service():
    svc, job = (next(d for d in docs(K8S / "indexed-job.yaml") if d["kind"] == k) for k in ("Service", "Job"))
    spec, pod = job["spec"], job["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    env = env_of(c)
    assert svc["spec"]["clusterIP"] == "None" and svc["spec"]["publishNotReadyAddresses"] is True
    assert svc["spec"]["selector"] == {"batch.kubernetes.io/job-name": job["metadata"]["name"]}
    assert pod["subdomain"] == svc["metadata"]["name"] and pod["restartPolicy"] == "Never"
    assert env["MASTER_ADDR"] == f"{job['metadata']['name']}-0.{svc['metadata']['name']}"
    assert spec["completionMode"] == "Indexed" and spec["completions"] == spec["parallelism"] == int(env["PET_NNODES"])
    anti = pod["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][0]
    assert anti["topologyKey"] == "kubernetes.io/hostname"  # one pod per node


def test_jobset_gates_training_on_a_complete_preflight():
    js = docs(K8S / "jobset.yaml")[0]
    name, jobs = js["metadata"]["name"], {r["name"]: r for r in js["spec"]["replicatedJobs"]}
    assert jobs["train"]["dependsOn"] == [{"name": "preflight", "status": "Complete"}]
    assert list(jobs)[0] == "preflight" and js["spec"]["failurePolicy"]["maxRestarts"] == 0
    pre = jobs["preflight"]
    (c,) = pod_spec(pre["template"])["containers"]
    env, spec = env_of(c), pre["template"]["spec"]
    assert pre.get("replicas", 1) == 1 and spec["completions"] == spec["parallelism"] == int(env["PET_NNODES"])
    subdomain = js["spec"].get("network", {}).get("subdomain", name)
    assert env["MASTER_ADDR"] == f"{name}-preflight-0-0.{subdomain}"
    assert js["spec"]["network"]["publishNotReadyAddresses"] is True


def test_trainer_runtime_injects_the_pet_variables_into_the_preflight_init_container():
    rt = docs(K8S / "trainer-v2-runtime.yaml")[0]
    (tj,) = docs(K8S / "trainer-v2-trainjob.yaml")
    (target,) = rt["spec"]["mlPolicy"]["torch"]["envInjection"]["targets"]
    jobs = {r["name"]: r for r in rt["spec"]["template"]["spec"]["replicatedJobs"]}
    pod = pod_spec(jobs[target["jobName"]]["template"])
    assert pod["restartPolicy"] == "Never" and jobs[target["jobName"]]["template"]["spec"]["backoffLimit"] == 0
    inits = {c["name"]: c for c in pod["initContainers"]}
    assert set(target["containerNames"]) <= set(inits) and [c["name"] for c in pod["containers"]] == ["node"]
    assert rt["spec"]["template"]["spec"]["network"]["publishNotReadyAddresses"] is True
    assert tj["spec"]["runtimeRef"]["name"] == rt["metadata"]["name"]
    gpus = {c["resources"]["limits"]["nvidia.com/gpu"] for c in inits.values()}
    assert gpus == {tj["spec"]["trainer"]["resourcesPerNode"]["limits"]["nvidia.com/gpu"]}
    assert not any(v.startswith("PET_") for c in inits.values() for v in env_of(c))  # the plugin's to set


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name)
def test_every_preflight_container_runs_the_tool_from_the_configmap_with_a_venv_or_the_images_python(path):
    found = []
    for d in docs(path):
        text = yaml.safe_dump(d)
        if "ddp_mesh_ping.py" in text and "--node-check" in text:  # the node gate: its own page's contract
            assert "npd" in text, text
            found.append(d)
        elif "ddp_mesh_ping.py" in text:
            found.append(d)
            assert '${PYTORCH_ENV:+$PYTORCH_ENV/bin/}python' in text and "name: ai-infra-validator" in text
            assert ("spec.nodeName" in text or d["kind"] == "MPIJob") and "AIV_JOB_SECRET" in text
    assert found or path.name == "trainer-v2-trainjob.yaml"


# ---------------------------------------------------------------------------- the pages against the table and the files
PAGE = ROOT / "docs" / "kubernetes.md"


def flat(text):
    return " ".join(text.split())


def test_the_contract_tables_are_the_code():
    text = PAGE.read_text()
    rows = [f"| {x.name} | {x.recognised} | {x.nodes} | {x.node} | {x.ranks} | {x.rendezvous} |" for x in aiv.LAUNCHERS]
    gives = [f"| {x.name} | {x.gives} |" for x in aiv.LAUNCHERS]
    lines = text.splitlines()
    for table in (rows, gives):
        start = lines.index(table[0])
        assert lines[start:start + len(table)] == table and not lines[start + len(table)].startswith("|")


def test_every_file_the_page_names_exists_and_every_manifest_is_named():
    named = set(re.findall(r"`(k8s/[\w.-]+\.yaml)`", PAGE.read_text()))
    assert named == {f"k8s/{f.name}" for f in [*FILES, KUSTOMIZATION]}


def test_every_yaml_example_on_the_page_is_cut_from_a_shipped_file():
    blocks = re.findall(r"```yaml\n(.*?)```", PAGE.read_text(), re.S)
    assert len(blocks) >= 4
    files = [f.read_text().splitlines() for f in [*FILES, KUSTOMIZATION]]
    for block in blocks:
        want = textwrap.dedent(block).splitlines()
        assert any(textwrap.dedent("\n".join(lines[i:i + len(want)])).splitlines() == want
                   for lines in files for i in range(len(lines))), block


def test_the_node_gate_section_points_to_its_page():
    section = PAGE.read_text().split("\n## Node gate (Node Problem Detector)\n", 1)[1]
    assert "docs/node-gate.md" in section.split("\n## ", 1)[0]


def launcher_sentence():
    """The README's sentence, from the table: the named launchers in its order, then any launcher's variables."""
    names = [x.name for x in aiv.LAUNCHERS if x.key not in ("slurm", "env", "local")]
    generic = ", ".join(f"`{v}`" for v in aiv.GENERIC_VARS)
    return (f"works the same under {', '.join(names[:-1])} or {names[-1]}, or any launcher that sets {generic}, "
            "and with none of them it is its own launcher on the local machine")


@pytest.mark.parametrize("page", ["README.md", "docs/launchers.md"])
def test_the_launcher_sentence_is_the_table(page):
    assert launcher_sentence() in flat((ROOT / page).read_text())
    assert [x.key for x in aiv.LAUNCHERS if x.per_node and x.key != "local"] == [
        "trainer-v2", "pytorchjob", "indexed-job", "jobset", "lws", "volcano"]


# ---------------------------------------------------------------------------- images, size, pods, the base, the wait
# NGC's PyTorch containers by release: the torch each ships (the NGC release notes' support matrix).
NGC_TORCH = {"24.07": (2, 4), "24.10": (2, 5), "25.01": (2, 6), "25.06": (2, 8)}
SITE_BUILT = ("registry.example.com/",)  # placeholders the page says to build (the node gate's NPD image)


def image_torch(image):
    """The torch an image ships, from its tag: NGC's table, or pytorch/pytorch:<version>-..."""
    m = re.fullmatch(r"nvcr\.io/nvidia/pytorch:(\d\d\.\d\d)-py3", image)
    if m:
        return NGC_TORCH[m.group(1)]  # a release not in the table: add its row from NGC's support matrix
    m = re.fullmatch(r"(?:docker\.io/)?pytorch/pytorch:(\d+)\.(\d+)(?:\.\d+)?-.*", image)
    assert m, f"{image}: no known torch version: name it in NGC_TORCH or use a pytorch/pytorch tag"
    return int(m.group(1)), int(m.group(2))


def images():
    return [(f.name, m) for f in [*FILES] for m in re.findall(r"^\s*image:\s*(\S+)", f.read_text(), re.M)]


def test_every_image_ships_a_torch_within_the_tools_floor():
    found = [(name, image) for name, image in images() if not image.startswith(SITE_BUILT)]
    assert len(found) >= 8
    for name, image in found:
        assert image_torch(image) >= aiv.TORCH_FLOOR, f"{name}: {image} ships torch {image_torch(image)}, " \
                                                      f"older than the tool's floor {aiv.TORCH_FLOOR}"
    assert image_torch("nvcr.io/nvidia/pytorch:25.01-py3") < (2, 8) <= image_torch("nvcr.io/nvidia/pytorch:25.06-py3")


def test_the_shipped_file_fits_a_configmap_with_margin():
    """A ConfigMap holds at most 1 MiB; client-side apply also writes the whole file into the 256 KiB
    last-applied annotation, which it already exceeds: the page says to apply server-side."""
    size = (ROOT / "ddp_mesh_ping.py").stat().st_size
    assert size <= 0.9 * 1024 * 1024, f"ddp_mesh_ping.py is {size} bytes: deliver it in an image (docs/kubernetes.md)"
    assert size > 256 * 1024  # the page's reason for server-side apply still holds
    text = flat(PAGE.read_text())
    assert "kubectl apply --server-side" in text and "256 KiB" in text and "COPY ddp_mesh_ping.py" in text


def pod_templates(doc):
    """(where, pod spec) of every pod a document makes."""
    kind, spec = doc["kind"], doc.get("spec", {})
    if kind == "Job" and doc["apiVersion"] == "batch/v1":
        return [("Job", spec["template"]["spec"])]
    if kind == "JobSet":
        return [(r["name"], pod_spec(r["template"])) for r in spec["replicatedJobs"]]
    if kind in ("PyTorchJob", "MPIJob"):
        reps = spec.get("pytorchReplicaSpecs") or spec.get("mpiReplicaSpecs")
        return [(k, r["template"]["spec"]) for k, r in reps.items()]
    if kind == "LeaderWorkerSet":
        t = spec["leaderWorkerTemplate"]
        return [(k, t[k]["spec"]) for k in ("leaderTemplate", "workerTemplate") if k in t]
    if kind == "Job":  # Volcano's
        return [(t["name"], t["template"]["spec"]) for t in spec["tasks"]]
    return []


def preflight_containers(pod):
    """The containers that run the tool's ranks (an MPIJob's workers, not its launcher, which runs mpirun)."""
    return [c for c in pod.get("initContainers", []) + pod["containers"]
            if ("ddp_mesh_ping.py" in yaml.safe_dump(c) and "mpirun" not in yaml.safe_dump(c))
            or c["name"] == "worker"]


# the preflight pods that Pod Security "restricted" admits; MPIJob's run sshd (root), the node gate reads the host
RESTRICTED = ("indexed-job.yaml", "jobset.yaml", "pytorchjob.yaml", "leaderworkerset.yaml", "volcano-job.yaml")


@pytest.mark.parametrize("name", RESTRICTED)
def test_the_preflight_pods_meet_pod_security_restricted(name):
    for d in docs(K8S / name):
        for where, pod in pod_templates(d):
            cs = preflight_containers(pod)
            if not cs:
                continue  # a training Job of the JobSet: the user's
            sc = pod.get("securityContext", {})
            assert sc.get("runAsNonRoot") is True and sc["seccompProfile"]["type"] == "RuntimeDefault", where
            assert not pod.get("hostNetwork") and not pod.get("hostPID") and not pod.get("hostIPC"), where
            assert all("hostPath" not in v for v in pod.get("volumes", [])), where
            for c in cs:
                csc = c["securityContext"]
                assert csc["allowPrivilegeEscalation"] is False and csc["capabilities"]["drop"] == ["ALL"], where
                assert not csc.get("privileged") and "add" not in csc["capabilities"], where


PREFLIGHTS = ("indexed-job.yaml", "jobset.yaml", "pytorchjob.yaml", "leaderworkerset.yaml", "volcano-job.yaml",
              "mpijob.yaml")


@pytest.mark.parametrize("name", PREFLIGHTS)
def test_the_preflight_pods_request_tolerate_and_are_cleaned_up(name):
    text = (K8S / name).read_text()
    for d in docs(K8S / name):
        pods = [(w, p) for w, p in pod_templates(d) if preflight_containers(p)]
        assert pods or d["kind"] == "Service"
        for where, pod in pods:
            assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
            for c in preflight_containers(pod):
                res = c["resources"]
                assert res["limits"]["nvidia.com/gpu"] and res["requests"]["cpu"] and res["requests"]["memory"]
                shm = [v for v in pod["volumes"] if v["name"] == "shm"]
                assert shm and shm[0]["emptyDir"]["medium"] == "Memory", where
        if d["kind"] in ("Job", "JobSet", "PyTorchJob", "MPIJob"):  # run to an end: cleaned up
            spec = d["spec"]
            assert (spec.get("runPolicy") or spec)["ttlSecondsAfterFinished"] > 0, name
    if name != "leaderworkerset.yaml":  # a long-running group: no TTL
        assert "ttlSecondsAfterFinished" in text
    assert "NCCL_IB_HCA" in text and "IPC_LOCK" in text and "rdma" in text  # the knobs, commented


def test_the_kustomize_base_writes_the_node_count_once():
    k = yaml.safe_load(KUSTOMIZATION.read_text())
    (gen,) = k["configMapGenerator"]
    (lit,) = gen["literals"]
    nodes = int(lit.split("=", 1)[1])
    assert k["resources"] == ["indexed-job.yaml"]
    job = next(d for d in docs(K8S / "indexed-job.yaml") if d["kind"] == "Job")
    (rep,) = k["replacements"]
    (target,) = rep["targets"]
    values = []
    for path in target["fieldPaths"]:  # each path resolves in the Job, and holds the same count already
        node = job
        for part in path.split("."):
            m = re.fullmatch(r"\[name=(.+)\]", part)
            node = next(x for x in node if x["name"] == m.group(1)) if m else node[part]
        values.append(int(node))
    assert values == [nodes] * 3 and len(values) == 3
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl not installed: the replacements were checked by hand above, not built")
    out = subprocess.run([kubectl, "kustomize", str(K8S)], capture_output=True, text=True, timeout=60)
    if out.returncode != 0 and "unknown command" in out.stderr:
        pytest.skip("this kubectl has no kustomize")
    assert out.returncode == 0, out.stderr
    built = [d for d in yaml.safe_load_all(out.stdout) if d]
    assert [d["kind"] for d in built] == ["Service", "Job"]  # the parameters are not applied


# The stand-in kubectl: `wait --for=condition=<c>` returns when the Job's condition <c> turns True (after the
# seconds FAKE_<C>_S, never when unset); `get ... -o jsonpath=...Complete...` prints True once complete.
FAKE_KUBECTL = r"""#!/bin/bash
cond() { local v="FAKE_${1^^}_S"; [ -n "${!v:-}" ] && [ "$(( $(date +%s) - T0 ))" -ge "${!v}" ]; }
case "$1" in
  wait) c=$(printf '%s\n' "$@" | sed -n 's/^--for=condition=//p')
        while ! cond "$c"; do sleep 0.2; done; echo "job.batch/aiv-preflight condition met" ;;
  get)  if printf '%s\n' "$@" | grep -q Complete && cond complete; then echo True; fi ;;
esac
"""


def wait_recipe():
    (block,) = [b for b in re.findall(r"```bash\n(.*?)```", PAGE.read_text(), re.S) if "wait -n" in b]
    return block


@pytest.mark.parametrize("outcome, secs", [("failed", 1), ("complete", 1)])
def test_the_wait_recipe_returns_on_fail_as_fast_as_on_pass(tmp_path, outcome, secs):
    fake = tmp_path / "kubectl"
    fake.write_text(FAKE_KUBECTL)
    fake.chmod(0o755)
    script = tmp_path / "wait.sh"
    script.write_text("set -u\n" + wait_recipe())
    env = dict(os.environ, PATH=f"{tmp_path}:{os.environ['PATH']}", T0=str(int(time.time())),
               **{f"FAKE_{outcome.upper()}_S": str(secs)})
    t = time.monotonic()
    r = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, timeout=60)
    took = time.monotonic() - t
    assert took < 15, took  # not the 20 minutes of a wait for the other condition
    assert (r.returncode, r.stdout.split()[-1]) == ((0, "PASS") if outcome == "complete" else (1, "FAIL")), r
    assert not [p for p in psutil.process_iter(["cmdline"]) if str(fake) in " ".join(p.info["cmdline"] or [])]
