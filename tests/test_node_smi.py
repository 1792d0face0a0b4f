"""The node's one nvidia-smi call: parsed per GPU by UUID, bounded, shared with the node's ranks, and a
visible note when it could not be read. The real runs put a fake `nvidia-smi` first on PATH (this machine
has none) that counts its calls."""
import json
import os
import shlex
import stat
import time

from conftest import aiv, rec, run_tool

ROWS = "GPU-aaaa, 0, No, No\nGPU-bbbb, 3, Yes, No\nGPU-cccc, [N/A], [N/A], [N/A]\n"


def fake_smi(tmp_path, body):
    """An executable named nvidia-smi in tmp_path/bin: appends its arguments to calls.txt, then runs body."""
    log = tmp_path / "calls.txt"
    script = tmp_path / "bin" / "nvidia-smi"
    script.parent.mkdir(exist_ok=True)
    script.write_text(f"#!/bin/bash\nprintf '%s\\n' \"$*\" >> {shlex.quote(str(log))}\n{body}\n")
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return script, log


def calls(log):
    return log.read_text().splitlines() if log.exists() else []


# ---------------------------------------------------------------- plain data
def test_parse_node_smi_keys_every_gpu_by_uuid():
    got = aiv.parse_node_smi(ROWS + "garbage line\n, 1, No, No\n")
    assert got == {"GPU-aaaa": {"ecc_uncorrected": 0.0, "remap_pending": False, "remap_failure": False},
                   "GPU-bbbb": {"ecc_uncorrected": 3.0, "remap_pending": True, "remap_failure": False},
                   "GPU-cccc": {}}
    assert aiv.parse_node_smi("") == {}


def test_rank_0_attaches_each_ranks_gpu_row_by_uuid():
    node = {"smi": {"gpus": aiv.parse_node_smi(ROWS)}}
    recs = [rec(0, gpu={"uuid": "GPU-bbbb", "name": "H200"}, node=node), rec(1, gpu={"uuid": "GPU-aaaa"}, node=False),
            rec(2, host="node2", gpu={"uuid": "GPU-zzzz"})]
    posts = {r: {"rank": r, "tflops": 1.0, "hbm_gbps": 1.0} for r in range(3)}
    rows = aiv.screen_gpu_rows(recs, posts)
    assert rows[0]["ecc_uncorrected"] == 3.0 and rows[0]["remap_pending"] is True
    assert rows[1]["ecc_uncorrected"] == 0.0 and "ecc_uncorrected" not in rows[2]
    (f,) = aiv.judge_gpu_facts(rows)
    assert f["status"] == "WARN" and f["ranks"] == [0] and "3 uncorrected ECC error(s)" in f["reason"]


def gpu_recs(smi, host="node1", n=2):
    recs = [rec(i, host=host, local_rank=i, gpu={"uuid": f"GPU-{i}{i}", "name": "H200"}, node=i == 0)
            for i in range(n)]
    recs[0]["node"]["smi"] = smi
    return recs


def test_unread_node_facts_are_a_warn_naming_node_gpus_facts_and_bound():
    (w,) = aiv.judge_node_smi(gpu_recs({"unread": "nvidia-smi gave no answer within 15s", "bound": 15.0}))
    assert w["check"] == "day0" and w["status"] == "WARN" and w["ranks"] == [0, 1]
    assert (w["hosts"], w["involved"], w["blame"]) == ([], ["node1"], "not-collected")  # said, never blamed
    assert w["reason"].startswith("node1: nvidia-smi gave no answer within 15s: uncorrected ECC errors "
                                  "and row remapping not read for GPU 0 (GPU-00, rank 0), GPU 1 (GPU-11, rank 1)")
    assert w in aiv.judge_day0(gpu_recs({"unread": "nvidia-smi gave no answer within 15s", "bound": 15.0}))
    # answered, but without a row for one rank's GPU: that GPU is named
    (w,) = aiv.judge_node_smi(gpu_recs({"gpus": {"GPU-00": {"ecc_uncorrected": 0.0}}}))
    assert w["ranks"] == [1] and "no row for GPU 1 (GPU-11, rank 1)" in w["reason"]
    assert aiv.judge_node_smi(gpu_recs({"gpus": {"GPU-00": {}, "GPU-11": {}}})) == []
    # CPU ranks (no GPU to name) and a node where nvidia-smi is absent (no smi at all)
    cpu = [rec(0), rec(1, node=False)]
    cpu[0]["node"]["smi"] = {"unread": "nvidia-smi exited 9: NVML init failed", "bound": 15.0}
    (w,) = aiv.judge_node_smi(cpu)
    assert "exited 9: NVML init failed (bound 15s): uncorrected ECC errors and row remapping not read for its GPUs" \
        in w["reason"] and w["ranks"] == [0, 1]
    assert aiv.judge_node_smi([rec(0), rec(1, node=False)]) == []


def test_screen_facts_not_read_under_load_are_a_line_of_the_report():
    rows = [{"rank": 3, "host": "node1", "local_rank": 3, "uuid": "GPU-33", "model": "H200", "tflops": 700.0,
             "hbm_gbps": 4000.0, "smi_unread": aiv.SCREEN_SMI_S}]
    text = "\n".join(aiv.render_performance({"gpu": rows}))
    assert (f"not read (nvidia-smi gave no answer within {aiv.SCREEN_SMI_S:g}s): SM clock, clock limits, temperature "
            f"and power under load of rank 3 node1 GPU 3 GPU-33") in text


# ---------------------------------------------------------------- the call itself, bounded
def test_read_node_smi_one_call_for_all_gpus_and_bounded(tmp_path):
    exe, log = fake_smi(tmp_path, f"printf '%s' {shlex.quote(ROWS)}")
    got = aiv.read_node_smi(str(exe))
    assert set(got["gpus"]) == {"GPU-aaaa", "GPU-bbbb", "GPU-cccc"}
    (args,) = calls(log)
    assert args.startswith("--query-gpu=uuid,") and "-i" not in args.split()
    exe, _ = fake_smi(tmp_path, "echo 'NVIDIA-SMI has failed' >&2; exit 9")
    assert aiv.read_node_smi(str(exe)) == {"unread": "nvidia-smi exited 9: NVIDIA-SMI has failed",
                                           "bound": aiv.NODE_SMI_S}
    exe, _ = fake_smi(tmp_path, "sleep 60")  # a child of the script: the whole group is killed at the bound
    t = time.monotonic()
    assert aiv.read_node_smi(str(exe), 0.5) == {"unread": "nvidia-smi gave no answer within 0.5s", "bound": 0.5}
    assert time.monotonic() - t < 5


# ---------------------------------------------------------------- real local gloo runs with a fake nvidia-smi
def run_with(tmp_path, body, *args):
    exe, log = fake_smi(tmp_path, body)
    js = tmp_path / "v.json"
    r = run_tool(["--nproc", 2, "--skip-screen", "--json", js, *args],
                 env={"PATH": f"{exe.parent}:{os.environ['PATH']}"})
    return r, json.loads(js.read_text()), calls(log)


def test_one_nvidia_smi_per_node_not_per_rank(tmp_path):
    r, v, made = run_with(tmp_path, f"printf '%s' {shlex.quote(ROWS)}", "--timeout", 60)
    assert r.returncode == 0, r.stdout + r.stderr
    assert len(made) == 1, made                                   # 2 ranks on one node: one call
    (leader,) = [x for x in v["ranks"] if x.get("node")]
    assert set(leader["node"]["smi"]["gpus"]) == {"GPU-aaaa", "GPU-bbbb", "GPU-cccc"}
    assert "not read" not in r.stdout


def test_a_silent_nvidia_smi_is_a_visible_warn_not_silence(tmp_path):
    """nvidia-smi never answers: the node's facts are "not read" in a WARN naming the node and the bound; the
    run still ends (a WARN, exit 0), the telemetry waiting a quarter of its bound at most."""
    t = time.monotonic()
    r, v, made = run_with(tmp_path, "sleep 600", "--timeout", 20)
    assert r.returncode == 0, r.stdout + r.stderr
    # a run that waited for this nvidia-smi could not end within half of its sleep, however loaded the machine
    assert len(made) == 1 and time.monotonic() - t < 300
    host = v["ranks"][0]["host"]
    (w,) = [f for f in v["findings"] if f["check"] == "day0" and "not read" in f["reason"]]
    assert w["status"] == "WARN" and w["involved"] == [host] and w["hosts"] == [] and w["ranks"] == [0, 1]
    assert w["reason"].startswith(f"{host}: nvidia-smi gave no answer within ")
    assert "uncorrected ECC errors and row remapping not read" in w["reason"]
    assert f"[WARN] day0: {host}: nvidia-smi gave no answer within " in r.stdout
