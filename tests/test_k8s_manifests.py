"""The manifests under k8s/, offline: every core kind (Service, Job, ...) against Kubernetes' own OpenAPI
schemas (kubernetes-validate, strict: no unknown field, at the pinned versions it ships); every custom
resource (Kubeflow Trainer v2's ClusterTrainingRuntime and TrainJob, JobSet) against the field names of
its published API types, its embedded Job templates against the core schemas; and what ties the files
together (names, DNS names, node counts, the envInjection target)."""
import os
import re
import shutil
import subprocess
import sys
import textwrap

import pytest
import yaml

from conftest import ROOT, aiv

kubernetes_validate = pytest.importorskip("kubernetes_validate")
K8S = ROOT / "k8s"
FILES = sorted(K8S.glob("*.yaml"))
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
ANY, JOB = "any", "job-template"
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
CUSTOM = {("trainer.kubeflow.org", "ClusterTrainingRuntime"): ("v1alpha1", RUNTIME_SPEC),
          ("trainer.kubeflow.org", "TrainingRuntime"): ("v1alpha1", RUNTIME_SPEC),
          ("trainer.kubeflow.org", "TrainJob"): ("v1alpha1", TRAINJOB_SPEC),
          ("jobset.x-k8s.io", "JobSet"): ("v1alpha2", JOBSET_SPEC)}


def unknown_fields(value, schema, path):
    """Where `value` leaves `schema`: [(path, why)]. Job templates met on the way are collected in JOBS."""
    if schema == ANY:
        return []
    if schema == JOB:
        JOBS.append((path, value))
        return []
    if isinstance(schema, tuple):
        return [] if value in schema else [(path, f"{value!r} is not one of {schema}")]
    if isinstance(schema, list):
        if not isinstance(value, list):
            return [(path, "is not a list")]
        return [bad for i, v in enumerate(value) for bad in unknown_fields(v, schema[0], f"{path}[{i}]")]
    if isinstance(schema, dict):
        if not isinstance(value, dict):
            return [(path, "is not an object")]
        return [bad for k, v in value.items() for bad in
                (unknown_fields(v, schema[k], f"{path}.{k}") if k in schema else [(f"{path}.{k}", "no such field")])]
    return [] if isinstance(value, schema) and not (schema is int and isinstance(value, bool)) else \
        [(path, f"is not a {schema.__name__}")]


JOBS = []


def as_job(template, name):
    """A JobTemplateSpec as the batch/v1 Job it becomes."""
    return {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": name, **template.get("metadata", {})},
            "spec": template["spec"]}


ALL = [(f, i, d) for f in FILES for i, d in enumerate(docs(f))]


def test_there_are_the_manifests_the_docs_promise():
    kinds = {kind_of(d) for _, _, d in ALL}
    assert {("", "Service"), ("batch", "Job"), ("trainer.kubeflow.org", "ClusterTrainingRuntime"),
            ("trainer.kubeflow.org", "TrainJob"), ("jobset.x-k8s.io", "JobSet")} <= kinds


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
    bad = unknown_fields(doc, {"apiVersion": str, "kind": str, "metadata": META, "spec": spec}, kind)
    assert not bad, bad
    assert JOBS or kind == "TrainJob"
    for _, template in JOBS:  # the embedded Job templates: core kinds, strictly
        for v in VERSIONS:
            kubernetes_validate.validate(as_job(template, "x"), v, strict=True)


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
            assert "spec.nodeName" in text and "AIV_JOB_SECRET" in text
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
    assert named == {f"k8s/{f.name}" for f in FILES}


def test_every_yaml_example_on_the_page_is_cut_from_a_shipped_file():
    blocks = re.findall(r"```yaml\n(.*?)```", PAGE.read_text(), re.S)
    assert len(blocks) >= 4
    files = [f.read_text().splitlines() for f in FILES]
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
