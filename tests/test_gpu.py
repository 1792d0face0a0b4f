"""The NCCL path on real GPUs. Skipped without CUDA; run on a GPU node with
    python -m pytest -v tests/test_gpu.py
(keep site safety variables such as NCCL_NVLS_ENABLE=0 exported where the host requires them)."""
import json
import os
import subprocess
import sys
import time

import pytest

from conftest import aiv, failures, run_tool, spawn

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device on this machine", allow_module_level=True)
NGPU = torch.cuda.device_count()
two_gpus = pytest.mark.skipif(NGPU < 2, reason="needs 2 GPUs")


def gpu_apps():
    """The compute processes NVML lists now: {pid: command line}."""
    r = subprocess.run(["nvidia-smi", "--query-compute-apps=pid", "--format=csv,noheader"], capture_output=True,
                       text=True, timeout=30)
    out = {}
    for pid in r.stdout.split():
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                out[int(pid)] = f.read().replace(b"\0", b" ").decode(errors="replace")[:160]
        except OSError:
            out[int(pid)] = "?"
    return out


@pytest.fixture(autouse=True)
def leaves_the_gpu_as_it_found_it():
    """Each test leaves the GPUs, this process's environment and its children as it found them: a process left
    on a GPU would make the next test's node gate see that GPU busy (not judged). A leftover fails the test that
    left it, and is killed so that the next test starts clean."""
    env, apps = dict(os.environ), gpu_apps()
    yield
    left = {}
    for _ in range(40):  # a process that is ending leaves NVML's list within seconds
        left = {p: c for p, c in gpu_apps().items() if p not in apps}
        if not left:
            break
        time.sleep(0.25)
    for pid in set(left) - {os.getpid()}:  # this process itself, holding a context, is said, never killed
        try:
            os.kill(pid, 9)
        except OSError:
            pass
    changed = sorted(k for k in set(env) | set(os.environ) if env.get(k) != os.environ.get(k)
                     and k != "PYTEST_CURRENT_TEST")  # pytest's own, set for each phase of a test
    os.environ.clear()
    os.environ.update(env)
    assert not left and not changed, f"left on the GPUs: {left}; environment changed: {changed}"


def test_local_mode_one_rank_per_gpu(tmp_path):
    log, jp = tmp_path / "gpu.log", tmp_path / "gpu.json"
    r = run_tool(["--json", jp, "--timeout", 120])
    log.write_text(r.stdout)
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"Total Execution Ranks: {NGPU}" in r.stdout and r.stdout.splitlines()[-1] == aiv.SUCCESS_LINE
    d = json.loads(jp.read_text())
    assert d["backend"] == "nccl" and len({x["gpu"]["uuid"] for x in d["ranks"]}) == NGPU
    assert all(x["gpu"]["pci"] and x["versions"]["nccl"] for x in d["ranks"])
    if NGPU > 1:
        assert "peer access" in r.stdout
        assert any(t in r.stdout for t in ("transport=P2P", "transport=SHM", "transport=NET"))
    v = run_tool(["--verify-log", log, "--expect-world-size", NGPU])
    assert v.returncode == 0, v.stdout


def test_srun_style_launch():
    n = min(NGPU, 2)
    env = {"SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "0", "SLURM_JOB_NUM_NODES": "1", "SLURM_NTASKS": str(n),
           "SLURM_TASKS_PER_NODE": str(n), "SLURMD_NODENAME": "gpubox"}
    res, _ = spawn(n, env=env, args=["--timeout", 120])
    assert [rc for rc, _ in res] == [0] * n, res[0][1]
    assert "node=gpubox nodes=1 ranks_per_node=%d local_ranks=%s" % (n, "0" if n == 1 else f"0-{n - 1}") in res[0][1]


@two_gpus
def test_two_ranks_on_one_gpu_fail_before_nccl():
    res, _ = spawn(2, env={"CUDA_VISIBLE_DEVICES": "0"}, args=["--timeout", 60])
    (rc0, out0), (rc1, _) = res
    assert rc0 == 1 and rc1 == 1, out0
    (line,) = failures(out0)
    assert line.startswith("FAILURE: gpu-affinity: rank 0 (") and "and rank 1 (" in line and "GPU-" in line
    assert "Duplicate GPU" not in out0 and "init:" not in out0      # judged from the roll call


@two_gpus
def test_local_rank_beyond_visible_gpus_is_named():
    res, _ = spawn(3, env={"CUDA_VISIBLE_DEVICES": "0,1"}, args=["--timeout", 60])
    rc0, out0 = res[0]
    assert rc0 == 1
    assert any(f.startswith("FAILURE: device: rank 2 (") and "LOCAL_RANK=2 but only 2 GPU(s) visible" in f
               for f in failures(out0)), out0
    assert all("Traceback" not in out for _, out in res)


def test_numa_and_affinity_reported(tmp_path):
    jp = tmp_path / "v.json"
    r = run_tool(["--json", jp])
    assert r.returncode == 0
    for x in json.loads(jp.read_text())["ranks"]:
        assert "numa" in x["gpu"] and x["cpus"]
    assert "numa=" in r.stdout


def test_bandwidth_probe_on_gpus():
    r = run_tool(["--bandwidth=1M,64M"])
    assert r.returncode == 0, r.stdout
    if NGPU > 1:
        line = next(ln for ln in r.stdout.splitlines() if ln.strip().startswith("busbw size=64.0MiB"))
        assert float(line.split("busbw=")[-1].rstrip("GB/s")) > 1.0


def test_soak_on_every_gpu(tmp_path):
    """--soak 20: every GPU loaded at once, its TFLOPS windows and (through NVML or nvidia-smi) its clocks,
    temperature, power and clock-event reasons sampled; a healthy GPU passes (a SW power cap is normal)."""
    jp = tmp_path / "soak.json"
    r = run_tool(["--soak", 20, "--json", jp, "--timeout", 120])
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"] soak: {NGPU} GPU(s) loaded at once for 20s: TFLOPS last/first window min" in r.stdout
    assert "\nSOAK\n" in r.stdout and f"[PASS] soak: {NGPU} GPU(s) held their speed over" in r.stdout
    sk = json.loads(jp.read_text())["soak"]
    assert sk["cpu"] is False and sk["dtype"] == "bfloat16" and len(sk["gpus"]) == NGPU
    for g in sk["gpus"]:
        assert g["verdict"] == "PASS" and g["uuid"] and g["device"] is not None, g
        assert g["tflops_first"] > 10 and 0.95 <= g["tflops_last"] / g["tflops_first"] and len(g["tflops_windows"]) >= 4
        assert g["telemetry"] in ("nvml", "nvidia-smi") and g["samples"] >= 5, g
        assert g["temp_max_c"] and g["sm_min_mhz"] and g["sm_rated_mhz"] and g["power_max_w"], g
        assert not (g["throttle_seen"] or 0) & aiv.SOAK_FAULTS, g


BUSY_HOST = """
import json, sys, threading
sys.path.insert(0, sys.argv[2])
import torch
import ddp_mesh_ping as aiv

def spin(stop):  # pure Python, holding the interpreter lock as long as the interpreter lets it
    x = 0
    while not stop.is_set():
        for i in range(10000):
            x += i * i

quiet = aiv.screen_measure_gpu(torch, 0, "gpu")
stop = threading.Event()
threads = [threading.Thread(target=spin, args=(stop,), daemon=True) for _ in range(int(sys.argv[1]))]
for t in threads:
    t.start()
try:
    box = aiv.start_screen_gpu(torch, 0)
    try:
        busy = aiv.take_screen_gpu(box)
    except aiv.HostStarved:
        busy = None
finally:
    stop.set()
    for t in threads:
        t.join()
print(json.dumps({"quiet": quiet, "busy": busy, "graph": bool(aiv.graph_timing(torch))}, default=str))
"""


@pytest.mark.parametrize("hogs", [1, 4])
def test_device_timed_screen_holds_beside_a_busy_host(hogs):
    """The screen's GPU numbers are the device's: measured on a thread while other threads of the same process
    keep the interpreter lock busy (one: as a rank's DDP imports do; four), they stay within 5% of a quiet
    measurement, and with in-graph timing (torch >= 2.9) there is a number every time. Before it (gated
    blocks) four spinning threads can starve the measuring thread of the lock: then HostStarved, which
    screen-gpu answers by measuring again on its quiet main thread, never a slow number. In a process of its
    own: the test process keeps no CUDA context (the node gate's tests below see every process on the GPU)."""
    import subprocess
    import sys
    from pathlib import Path
    r = subprocess.run([sys.executable, "-c", BUSY_HOST, str(hogs), str(Path(__file__).resolve().parent.parent)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    d = json.loads(r.stdout.strip().splitlines()[-1])
    quiet, busy = d["quiet"], d["busy"]
    if busy is None:
        assert hogs > 1 and not d["graph"], "a busy thread must not starve the measurement"
        return
    for key in ("tflops", "hbm_gbps"):
        assert busy[key] >= 0.95 * quiet[key], (key, quiet, busy)


def test_screen_measured_while_the_rank_waits(tmp_path):
    """One rank per GPU: the device measurement runs on its own thread from the local checks on; screen-gpu
    takes it, so the screen phase is shorter than the measurement itself, and the run still passes."""
    jp = tmp_path / "r.json"
    r = run_tool(["--json", jp, "--timeout", 120])
    assert r.returncode == 0, r.stdout + r.stderr
    phases = json.loads(jp.read_text())["phases"]
    assert phases["gpu_measure"] > 0 and phases["screen-gpu"] < phases["gpu_measure"], phases


def test_a_gpu_computing_wrong_is_named(tmp_path):
    """Silent data corruption on one GPU, injected from outside the tool (tests/sdc/sitecustomize.py on the last
    rank's PYTHONPATH: one element of every matmul-family result slightly wrong). With two or more GPUs the
    numerics check names that rank, its host and its GPU's UUID; with one GPU (nothing to compare its bits with)
    it is off the fp64 reference, and the FAIL names the rank without blaming its host."""
    from pathlib import Path
    n, jp = min(NGPU, 4), tmp_path / "v.json"
    bad = n - 1
    res, _ = spawn(n, args=["--timeout", 120, "--json", jp, "--skip-screen"],
                   per_rank={bad: {"PYTHONPATH": str(Path(__file__).resolve().parent / "sdc")}})
    assert [rc for rc, _ in res] == [1] * n, res[0][1]
    out = res[0][1]
    (line,) = failures(out)
    assert line.startswith(f"FAILURE: numerics: rank {bad} on ") and aiv.SUCCESS_LINE not in out, line
    d = json.loads(jp.read_text())
    uuid = d["ranks"][bad]["gpu"]["uuid"]
    assert d["ranks"][bad]["numerics"]["checks"]["matmul-fp32"]["off"] is True
    if n > 1:
        assert uuid in line and "computes wrong numbers" in line and d["failed_hosts"] == [d["ranks"][bad]["host"]]
    else:
        assert "the only rank of its model and software" in line and d["failed_hosts"] == []
    for r in range(n - 1):  # the healthy GPUs: every check within its tolerance, and the same bits among them
        checks = d["ranks"][r]["numerics"]["checks"]
        assert not any(p["off"] for p in checks.values()), checks
        assert {c: p["digest"] for c, p in checks.items()} == {
            c: p["digest"] for c, p in d["ranks"][0]["numerics"]["checks"].items()}


def test_numerics_pass_on_healthy_gpus_and_are_deterministic(tmp_path):
    """Every GPU of the host: the numerics check passes, its bits the same on every GPU of one model, twice."""
    probe = ("import json, sys, torch, ddp_mesh_ping as aiv\n"  # a process of its own: no CUDA context is left
             "print(json.dumps([aiv.numerics_measure(torch, 0, 'gpu') for _ in range(2)]))")  # in this one
    p = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300,
                       cwd=os.path.dirname(aiv.__file__))
    assert p.returncode == 0, p.stderr
    a, b = json.loads(p.stdout.splitlines()[-1])
    assert {c: p["digest"] for c, p in a["checks"].items()} == {c: p["digest"] for c, p in b["checks"].items()}
    assert not any(p["off"] for p in a["checks"].values()) and "matmul-tf32" in a["checks"]
    jp = tmp_path / "v.json"
    r = run_tool(["--json", jp, "--timeout", 120, "--skip-screen"])
    assert r.returncode == 0, r.stdout + r.stderr
    found = [f for f in json.loads(jp.read_text())["findings"] if f["check"] == "numerics"]
    assert [f["status"] for f in found] == ["PASS", "PASS"], found


HOG = """
import sys, time, torch
a = torch.randn(8192, 8192, device="cuda:0", dtype=torch.bfloat16)
print("hog running", flush=True)
end = time.time() + float(sys.argv[1])
while time.time() < end:
    for _ in range(20):
        a @ a
    torch.cuda.synchronize()
"""


def test_a_gpu_slowed_by_a_second_process_is_measured_again_and_named(tmp_path):
    """A second process looping bf16 matmuls on GPU 0 (a real slowdown, to about half its speed): the screen
    measures GPU 0 again before naming it; slow again, it is named with its host (`persisted`), and its row
    says it was measured twice and what the first value was."""
    import subprocess
    import sys
    hog = subprocess.Popen([sys.executable, "-c", HOG, "240"], stdout=subprocess.PIPE, text=True)
    try:
        assert hog.stdout.readline().strip() == "hog running"
        jp = tmp_path / "v.json"
        r = run_tool(["--json", jp, "--timeout", 120], env={"CUDA_VISIBLE_DEVICES": "0"})
    finally:
        hog.kill()
        hog.wait()
    d = json.loads(jp.read_text())
    assert r.returncode == aiv.EXIT_FAIL, r.stdout + r.stderr
    row = d["screen"]["gpu"][0]
    assert row["tries"] == 2 and row["first"]["tflops"] > 0, row
    (f,) = [f for f in d["findings"] if f["check"] == "gpu-perf" and f["status"] == "FAIL"]
    assert f["blame"] == "persisted" and f["hosts"] == [d["host"]] and d["failed_hosts"] == [d["host"]], f
    assert "measured again" in f["evidence"]


# ---------------------------------------------------------------------------- the node gate (--node-check)
def node_check(tmp_path, *args, env=None):
    jp = tmp_path / f"node-{len(list(tmp_path.iterdir()))}.json"
    r = run_tool(["--node-check", *args, "--json", jp], env=dict({"SLURMD_NODENAME": "gpunode"}, **(env or {})),
                 timeout=120)
    d = json.loads(jp.read_text())
    r.stdout += "\n--- the pass's JSON: " + json.dumps({k: d.get(k) for k in ("verdict", "elapsed_s", "devices",
                                                                               "skipped", "cpu", "phases")})
    return r, d


def test_node_check_passes_every_gpu_within_its_budget(tmp_path, record_property):
    r, d = node_check(tmp_path, "health")
    assert r.returncode == 0 and d["verdict"] == "PASS", r.stdout + r.stderr
    assert d["elapsed_s"] < d["budget_s"] and len(d["devices"]["compute"]) == NGPU and not d["cpu"]
    assert {f["check"] for f in d["findings"]} >= {"gpu-count", "gpu-procs", "gpu-health", "numerics", "gpu-perf"}
    for i, m in d["measured"].items():
        assert m["speed"]["tflops"] > 10 and not any(p["off"] for p in m["numerics"]["checks"].values()), (i, m)
    if NGPU > 1 and not d["skipped"]:
        assert d["allreduce"]["ok"] is True and min(d["allreduce"]["busbw"]) > 1.0
    record_property("node_check_gpu_wall_s", d["elapsed_s"])


@pytest.fixture
def hog():
    """A second process looping bf16 matmuls on GPU 0 (as a previous job's leftover would), listed by NVML."""
    import subprocess
    import sys
    import time
    code = ("import time, torch\n"
            "a = torch.randn(8192, 8192, device='cuda:0', dtype=torch.bfloat16)\n"
            "t = time.time()\n"
            "while time.time() - t < 120:\n"
            "    a @ a\n"
            "    torch.cuda.synchronize()\n")
    p = subprocess.Popen([sys.executable, "-c", code])
    try:
        for _ in range(120):
            apps = subprocess.run(["nvidia-smi", "--query-compute-apps=pid", "--format=csv,noheader"],
                                  capture_output=True, text=True).stdout.split()
            if str(p.pid) in apps:
                break
            time.sleep(0.5)
        yield p.pid
    finally:
        p.kill()
        p.wait()


def test_node_check_prolog_names_the_foreign_pid_and_health_calls_the_gpu_busy(tmp_path, hog):
    env = {"SLURM_JOB_ID": "4242", "SLURM_JOB_GPUS": "0", "SLURM_SCRIPT_CONTEXT": "prolog_slurmd"}
    r, d = node_check(tmp_path, env=env)
    assert r.returncode == 1, r.stdout + r.stderr
    (f,) = [f for f in d["findings"] if f["status"] == "FAIL"]
    assert f["check"] == "gpu-procs" and f["gpus"] == [0] and f["pids"] == [hog] and f["blame"] == "own", f
    assert f"GPU 0 held by pid {hog}" in r.stdout and "holds" in f["reason"]
    r, d = node_check(tmp_path, "health")
    assert "0" in d["devices"]["busy"] and "0" not in d["measured"], r.stdout + r.stderr
    if NGPU == 1:  # the node's only GPU busy: nothing of the node was judged, so no PASS (npd: unknown, not OK)
        assert r.returncode == 0 and d["verdict"] == "NOT ASSESSED", r.stdout + r.stderr
        assert "every GPU busy, none judged" in r.stdout
        r, d = node_check(tmp_path, "npd")
        assert r.returncode == 2 and r.stdout.startswith("NOT ASSESSED: every GPU busy, none judged"), r.stdout
    else:  # the others judged: a PASS that says GPU 0 was busy, not judged
        assert r.returncode == 0 and d["verdict"] == "PASS", r.stdout + r.stderr
        assert "busy, not judged: GPU 0" in r.stdout and set(d["devices"]["compute"]) == set(range(1, NGPU))


def test_node_check_names_a_gpu_computing_wrong(tmp_path):
    """The SDC injector on the last GPU's worker: with two or more GPUs a numerics FAIL naming that GPU drains
    (npd 1); with one GPU off the reference alone it is a 'tie' (the preflight's word): a FAIL that names no node
    (npd 2)."""
    from pathlib import Path
    bad = NGPU - 1
    env = {"PYTHONPATH": str(Path(__file__).resolve().parent / "sdc"), "NUMERICS_FAULT_LOCAL_RANK": str(bad)}
    r, d = node_check(tmp_path, "npd", env=env)
    (f,) = [f for f in d["findings"] if f["status"] == "FAIL"][:1]
    assert f["check"] == "numerics" and bad in f["gpus"], d["findings"]
    if NGPU > 1:
        assert r.returncode == 1 and f["blame"] in ("reference", "majority") and f["hosts"] == ["gpunode"]
        assert r.stdout.startswith(f"FAIL: GPU {bad} computes wrong numbers"), r.stdout
    else:
        assert r.returncode == 2 and f["blame"] == "tie" and f["hosts"] == [], r.stdout
def test_nccls_ras_answers_status_for_a_one_rank_group():
    """NCCL's own view as the verdict reads it: a 1-rank NCCL group on cuda:0 answers RAS STATUS in JSON."""
    import subprocess
    import sys
    from pathlib import Path
    script = Path(__file__).resolve().parent.parent / "bench" / "gpu_ras.py"
    r = subprocess.run([sys.executable, str(script), "--ranks", "1"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    line = next(json.loads(ln) for ln in r.stdout.splitlines() if ln.startswith("{"))
    assert line["ras_ok"] and line["ras_world"]["size"] == 1, line
    assert line["view"].startswith("NCCL's own view (RAS, NCCL "), line


@two_gpus
def test_a_rank_alive_before_its_all_reduce_is_named_alone_on_nccl(tmp_path):
    """Rank 1 (its own simulated host) stalls before its all_reduce on NCCL: only its host, by what it never
    issued; NCCL's view is read beside ours and said in the same line."""
    jp = tmp_path / "v.json"
    per = {r: {"SLURMD_NODENAME": f"n{r}", "LOCAL_RANK": r} for r in range(2)}
    res, _ = spawn(2, env={"AIV_FAILPOINT": "stall=90:collective:1", "AIV_JSON": jp}, per_rank=per,
                   args=["--timeout", 30])
    assert res[0][0] == aiv.EXIT_TIMEOUT, res[0][1]
    (line,) = failures(res[0][1])
    assert "rank 1 (n1) never issued all_reduce #" in line and "NCCL's own view (RAS" in line, line
    d = json.loads(jp.read_text())
    assert d["failed_hosts"] == ["n1"] and any(f.get("nccl_view") for f in d["findings"]), d["failures"]


def test_transport_not_judged_with_the_jobs_own_nccl_debug_info():
    """NCCL_DEBUG=INFO (NCCL's lines to stdout): the run passes, and a WARN says the transport was not judged."""
    r = run_tool(["--timeout", 120], env={"NCCL_DEBUG": "INFO"})
    assert r.returncode == 0, r.stdout + r.stderr
    assert "[WARN] transport: NCCL's transport was not judged on " in r.stdout, r.stdout
