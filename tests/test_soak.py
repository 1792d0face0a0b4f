"""The soak (--soak SECONDS): its judge on plain data, its windows and telemetry summary, its sampler
with a real nvidia-smi stand-in (answering, and never answering), and real gloo runs: a pass with the
SOAK section and the JSON, a soak longer than --timeout that blames no one, a rank frozen in the soak."""
import json
import re
import sys
import time

import pytest
import torch
from test_hangs import HOST, Ranks

from conftest import ROOT, aiv, failures, rec, run_tool


def gpu(rank, first=700.0, last=None, host="gpu-1", seen=0x4, samples=30, temp=68.0, counts=None, **kw):
    """One GPU's soak row as rank 0 judges it: healthy (a SW power cap, as on a loaded H200) unless told."""
    r = {"rank": rank, "host": host, "local_rank": rank % 8, "device": rank % 8, "uuid": f"GPU-{rank:04d}",
         "model": "NVIDIA H200", "seconds": 30.0, "tflops_first": first,
         "tflops_last": first * 0.99 if last is None else last, "telemetry": "nvml", "samples": samples,
         "temp_max_c": temp, "sm_min_mhz": 1830.0, "sm_max_seen_mhz": 1980.0, "sm_rated_mhz": 1980.0,
         "power_max_w": 698.0, "throttle_seen": seen,
         "throttle_counts": counts if counts is not None else {n: samples for n in aiv.throttle_names(seen)}}
    r.update(kw)
    return r


def test_healthy_gpus_pass_with_their_numbers():
    (f,) = aiv.judge_soak([gpu(r) for r in range(8)])
    assert f["check"] == "soak" and f["status"] == "PASS" and f["hosts"] == [] and f["ranks"] == []
    assert "8 GPU(s) held their speed over 30s" in f["reason"] and "the slowest held 0.99" in f["reason"]
    assert "max temperature 68 C" in f["reason"] and "sw-power-cap on 8" in f["reason"]


def test_decay_fails_naming_the_gpu_with_its_numbers():
    rows = [gpu(r) for r in range(8)]
    rows[5] = gpu(5, first=700.0, last=560.0, host="gpu-2")
    (f,) = aiv.judge_soak(rows)
    assert f["status"] == "FAIL" and f["hosts"] == ["gpu-2"] and f["ranks"] == [5]
    assert "rank 5 on gpu-2 (GPU cuda:5, local rank 5, GPU-0005, NVIDIA H200)" in f["reason"]
    assert "matmul slowed from 700.0 to 560.0 TFLOPS (0.80 of the first window) over 30s of load" in f["reason"]
    assert "while the SW power cap was active" in f["reason"]


@pytest.mark.parametrize("ratio,status", [(0.899, "FAIL"), (0.93, "WARN"), (0.951, None), (1.02, None)])
def test_decay_thresholds(ratio, status):
    got = [f["status"] for f in aiv.judge_soak([gpu(0, first=100.0, last=100.0 * ratio)])]
    assert got == ([status] if status else ["PASS"])


@pytest.mark.parametrize("bit,name", [(0x40 | 0x8, "hw-thermal"), (0x20, "sw-thermal"), (0x80 | 0x8, "hw-power-brake"),
                                      (0x8, "hw-slowdown")])
def test_heat_or_power_brake_fails_without_decay(bit, name):
    row = gpu(3, seen=0x4 | bit, temp=91.0, counts={"sw-power-cap": 30, name: 4, "hw-slowdown": 4},
              sm_min_mhz=1110.0)
    (f,) = aiv.judge_soak([gpu(0), row])
    assert f["status"] == "FAIL" and f["ranks"] == [3] and f["hosts"] == ["gpu-1"]
    assert f"{name} in 4/30 samples" in f["reason"] and "max 91 C" in f["reason"]
    assert "SM 1110-1980 MHz of 1980" in f["reason"] and "max 698 W" in f["reason"]
    assert "sw-power-cap" not in f["reason"]  # the benign limit is no evidence


def test_sw_power_cap_alone_is_at_most_a_warn():
    assert [f["status"] for f in aiv.judge_soak([gpu(0, seen=0x4 | 0x1)])] == ["PASS"]
    (f,) = aiv.judge_soak([gpu(0, seen=0x4, first=100.0, last=93.0)])
    assert f["status"] == "WARN" and "while the SW power cap was active" in f["reason"]


def test_no_telemetry_says_so():
    cpu = [gpu(r, telemetry=None, samples=0, seen=None, counts={}, temp_max_c=None, device=None, uuid=None)
           for r in range(2)]
    (f,) = aiv.judge_soak(cpu, cpu=True)
    assert f["status"] == "PASS" and "2 CPU rank(s) ran 30s of load at once (decay not judged" in f["reason"]
    assert "no GPU telemetry on CPU" in f["reason"]
    (f,) = aiv.judge_soak(cpu)
    assert f["status"] == "PASS" and "no telemetry on 2 GPU(s)" in f["reason"] and "TFLOPS alone" in f["reason"]
    assert "no GPU telemetry on CPU" in "\n".join(aiv.render_soak({"seconds": 2, "cpu": True, "gpus": cpu}))


def test_cpu_decay_is_shown_not_judged():
    """CPU ranks share cores with each other and the machine's other work: their decay is that noise."""
    (f,) = aiv.judge_soak([gpu(0, first=0.08, last=0.02, telemetry=None, samples=0)], cpu=True)
    assert f["status"] == "PASS" and "the slowest held 0.25 of its first window" in f["reason"]


def test_too_short_to_time_and_empty():
    assert aiv.judge_soak([]) == []
    (f,) = aiv.judge_soak([gpu(0, tflops_first=None, tflops_last=None)])
    assert f["status"] == "PASS" and "too short to time windows" in f["reason"]


def test_many_flagged_gpus_are_one_finding_per_status():
    rows = [gpu(r, host=f"n{r // 8}", last=500.0) for r in range(40)] + [gpu(40, last=660.0)]
    fs = aiv.judge_soak(rows)
    assert [f["status"] for f in fs] == ["FAIL", "WARN"]
    assert fs[0]["reason"].startswith("40 GPU(s) did not hold up") and "and 24 more" in fs[0]["reason"]
    assert len(fs[0]["ranks"]) == 40 and fs[1]["ranks"] == [40]


def test_windows_and_summary():
    assert aiv.soak_windows([]) == (0, [])
    w, win = aiv.soak_windows([10.0] * 40 + [8.0] * 40)
    assert w == 8 and win[0] == 10.0 and win[-1] == 8.0 and len(win) == 10
    w, win = aiv.soak_windows([1.0, 3.0, 2.0, 5.0, 4.0], cpu=True)  # short: 1-block windows, the best on CPU
    assert w == 1 and win == [1.0, 3.0, 2.0, 5.0, 4.0]
    assert aiv.soak_windows([2.0, 1.0, 9.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0], cpu=True) == (2, [2.0, 9.0, 5.0, 8.0])
    w, win = aiv.soak_windows([1.0] * 2000)
    assert len(win) <= aiv.SOAK_WINDOWS_MAX
    s = aiv.soak_summary([{"sm_mhz": 1980, "sm_max_mhz": 1980, "temp_c": 60, "power_w": 650.0, "throttle": 0x4},
                          {"sm_mhz": 1410, "sm_max_mhz": 1980, "temp_c": 88, "power_w": 700.0, "throttle": 0x4 | 0x48},
                          {"temp_c": 70}])
    assert s == {"samples": 3, "temp_max_c": 88, "sm_min_mhz": 1410, "sm_max_seen_mhz": 1980, "sm_rated_mhz": 1980,
                 "power_max_w": 700.0, "throttle_seen": 0x4c,
                 "throttle_counts": {"sw-power-cap": 2, "hw-slowdown": 1, "hw-thermal": 1},
                 "throttle_reasons": ["sw-power-cap", "hw-slowdown", "hw-thermal"]}
    assert aiv.soak_summary([])["throttle_seen"] is None


def test_rows_carry_the_record_facts_and_the_verdict():
    recs = [rec(r, host="gpu-1", gpu={"index": r, "name": "NVIDIA H200", "uuid": f"GPU-{r}"}) for r in range(2)]
    posts = {r: {k: v for k, v in gpu(r, last=500.0 if r else None).items()
                 if k not in ("host", "local_rank", "device", "uuid", "model")} for r in range(2)}
    rows = aiv.soak_rows(recs, posts)
    assert [(r["rank"], r["device"], r["uuid"], r["model"], r["verdict"]) for r in rows] == \
        [(0, 0, "GPU-0", "NVIDIA H200", "PASS"), (1, 1, "GPU-1", "NVIDIA H200", "FAIL")]


def test_render_shows_every_gpu_and_its_verdict():
    rows = [gpu(0), gpu(1, seen=0x4 | 0x48, counts={"hw-thermal": 2, "hw-slowdown": 2})]
    text = "\n".join(aiv.render_soak({"seconds": 30, "cpu": False, "dtype": "bfloat16", "n": 8192, "gpus": rows}))
    assert "30s of bfloat16 matmul (8192x8192) on 2 GPU(s) at once; telemetry: nvml" in text
    assert ("rank=0 node=gpu-1 gpu=cuda:0 uuid=GPU-0000 tflops first/last=700.0/693.0 (0.99) temp_max=68C "
            "sm_mhz min/max=1830/1980 (rated 1980) power_max=698W limits=sw-power-cap [PASS]") in text
    assert "limits=sw-power-cap,hw-slowdown,hw-thermal [FAIL]" in text


# ---------------------------------------------------------------------------- the sampler, with a real child
def fake_smi(tmp_path, monkeypatch, body):
    exe = tmp_path / "nvidia-smi"
    exe.write_text("#!/bin/sh\n" + body + "\n")
    exe.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:/usr/bin:/bin")
    monkeypatch.setitem(sys.modules, "pynvml", None)  # no NVML: the sampler falls back to nvidia-smi


def test_sampler_reads_nvidia_smi_and_the_judge_names_the_heat(tmp_path, monkeypatch):
    fake_smi(tmp_path, monkeypatch, 'echo "1410, 1980, 0x0000000000000048, 91, 655.50"')
    s = aiv.SoakSampler("GPU-0001")
    time.sleep(2.5)
    samples = s.stop()
    assert s.source == "nvidia-smi" and len(samples) >= 2
    assert samples[0]["throttle"] == 0x48 and samples[0]["temp_c"] == 91.0 and "ecc_uncorrected" not in samples[0]
    row = gpu(1, **aiv.soak_summary(samples))
    (f,) = aiv.judge_soak([row])
    assert f["status"] == "FAIL" and f"hw-thermal in {len(samples)}/{len(samples)} samples" in f["reason"]


def test_a_silent_nvidia_smi_never_holds_the_soak(tmp_path, monkeypatch):
    fake_smi(tmp_path, monkeypatch, "exec sleep 60")
    s = aiv.SoakSampler("GPU-0001")
    time.sleep(0.3)
    t = time.monotonic()
    assert s.stop() == [] and time.monotonic() - t <= aiv.SCREEN_SMI_S + 1.5
    assert aiv.SoakSampler(None).source is None  # no UUID (CPU): no telemetry, no thread


def test_measure_on_cpu_starts_at_the_gate_and_times_windows():
    started = []
    row = aiv.soak_measure(torch, torch.device("cpu"), "cpu", 1.0, start=lambda: started.append(time.monotonic()))
    assert len(started) == 1 and row["telemetry"] is None and row["samples"] == 0 and row["dtype"] == "float32"
    # the load lasts the seconds asked and ends (however loaded the machine: no count of blocks is promised);
    # its windows are soak_windows' of the blocks it timed
    assert 1.0 <= row["seconds"] < 60 and row["blocks"] >= 1
    w, windows = aiv.soak_windows([1.0] * row["blocks"], cpu=True)
    assert len(row["tflops_windows"]) == len(windows) >= 1
    assert row["tflops_first"] > 0 and row["tflops_last"] > 0


# ---------------------------------------------------------------------------- real runs
def test_local_run_soaks_and_reports(tmp_path):
    jp, log = tmp_path / "v.json", tmp_path / "run.log"
    r = run_tool(["--nproc", 2, "--soak", 2, "--timeout", 60, "--json", jp])
    log.write_text(r.stdout)
    assert r.returncode == 0, r.stdout + r.stderr
    out, lines = r.stdout, r.stdout.splitlines()
    assert "] soak: 2 CPU rank(s) loaded at once for 2s: TFLOPS last/first window min" in out
    assert lines.index("PERFORMANCE") < lines.index("SOAK") < lines.index("FINDINGS")
    assert [ln.split()[0] for ln in lines if ln.startswith("  rank=") and " tflops first/last=" in ln] == \
        ["rank=0", "rank=1"]
    assert "(no GPU telemetry on CPU)" in out and "[PASS] soak: 2 CPU rank(s) ran " in out
    assert out.index("screen-net:") < out.index("] soak:") < out.index("] collective:")
    d = json.loads(jp.read_text())
    sk = d["soak"]
    assert sk["seconds"] == 2 and sk["cpu"] is True and [g["rank"] for g in sk["gpus"]] == [0, 1]
    assert all(g["tflops_first"] > 0 and g["tflops_last"] > 0 and g["telemetry"] is None and g["verdict"] == "PASS"
               and g["model"] == "cpu" and g["throttle_reasons"] == [] for g in sk["gpus"])
    assert d["phases"]["soak"] >= 2 and d["deadlines"]["soak"] == 62
    assert run_tool(["--verify-log", log, "--expect-world-size", 2]).returncode == 0


def test_a_soak_longer_than_timeout_blames_no_one(tmp_path):
    """The soak's bound is --soak + --timeout: a 12 s soak under --timeout 10 passes, with --skip-screen."""
    jp = tmp_path / "v.json"
    r = run_tool(["--nproc", 2, "--skip-screen", "--timeout", 10, "--json", jp], env={"AIV_SOAK": "12"})
    assert r.returncode == 0, r.stdout + r.stderr
    assert "PERFORMANCE" not in r.stdout and "] soak: 2 CPU rank(s) loaded at once for 12s" in r.stdout
    d = json.loads(jp.read_text())
    assert d["screen"] is None and 12 <= d["phases"]["soak"] < 22 and d["deadlines"]["soak"] == 22


def test_a_rank_frozen_in_the_soak_is_named():
    # --timeout bounds init too: 15 s, as 10 s was passed by init_process_group of 3 ranks on a loaded 2-core
    # machine; no warm imports (DDP's, never reached here) competing with init for the CPU
    w = Ranks(3, ["--timeout", 15, "--soak", 3, "--skip-screen"], env={"AIV_FAILPOINT": "hang:soak:1"})
    try:
        w.wait([0, 2], timeout=120)
    finally:
        w.kill_rest()
    assert w.rc(0) == 3, w.out[0]
    (line,) = failures(w.out[0])
    assert line.startswith("FAILURE: soak: the soak (sustained matmul on every GPU at once) did not complete")
    assert f"rank 1 ({HOST}) frozen (process stopped)" in line and "rank 2" not in line, line


def test_the_batch_files_time_limit_covers_a_60s_soak():
    """The promise of docs/screen.md: the batch file's --time covers the worst case with AIV_SOAK=60."""
    text = (ROOT / "submit_smoke_test.sbatch").read_text()
    h, m, s = map(int, re.search(r"^#SBATCH --time=(\d+):(\d\d):(\d\d)$", text, re.M).groups())
    grace = int(re.search(r"^AIV_STEP_GRACE=\$\{AIV_STEP_GRACE:-(\d+)\}$", text, re.M).group(1))
    kill = int(re.search(r"^AIV_STEP_KILL_WAIT=\$\{AIV_STEP_KILL_WAIT:-(\d+)\}$", text, re.M).group(1))
    worst = aiv.worst_case(aiv.deadlines(aiv.TIMEOUT_DEFAULT, aiv.ROLLCALL_DEFAULT, 60), bandwidth=True, soak=True)
    assert h * 3600 + m * 60 + s >= worst + aiv.RANK0_GRACE + grace + kill + 60
    page = " ".join((ROOT / "docs" / "screen.md").read_text().split())
    assert "with a soak of up to 60 s (`AIV_SOAK=60 sbatch ...`)" in page
