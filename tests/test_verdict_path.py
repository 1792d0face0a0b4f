"""The verdict's path and its bounds, with real processes: a rank that fails before the roll call tells rank 0
why, so the run ends in seconds and not at the roll call's bound (naming its host for its own fault, nobody for
the tool's); the probes before torch are bounded (a manifest that never answers). That the verdict's lines
come once, after the files asked for were tried, is held in tests/test_sinks.py."""
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from conftest import SCRIPT, aiv, clean_env, describe, failures, finish, free_port, tool_ranks

SOFTWARE = str(Path(__file__).resolve().parent / "software")
R = 240  # the roll call's bound: the run must end long before it


def nodes(tmp_path, world, per_rank, args=()):
    port = free_port()
    envs = [clean_env({"RANK": r, "LOCAL_RANK": 0, "WORLD_SIZE": world, "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": port, "SLURMD_NODENAME": f"n{r}", "AIV_JSON": tmp_path / "v.json",
                       **per_rank.get(r, {})}) for r in range(world)]
    procs = tool_ranks(envs, ["--rollcall-timeout", R, "--skip-screen", *args], text=True, stdout=subprocess.PIPE,
                       stderr=subprocess.PIPE)
    t = time.monotonic()
    try:  # rank 0's verdict: a rank still starting when it came waits for the store up to R, by design
        procs[0].wait(R + 60)
    except subprocess.TimeoutExpired:
        pass
    took = time.monotonic() - t
    out = finish(procs, 15)  # a rank that came after the verdict waits for a store that is gone: not this test's
    return out, took, json.loads((tmp_path / "v.json").read_text())


def test_a_rank_whose_torch_is_too_old_tells_rank_0_and_the_run_ends_in_seconds(tmp_path):
    """torch 2.3 on n1 (tests/software: the version it reports): n1 says so and tells rank 0 through the store's
    wire; rank 0 ends the roll call at once naming n1 (its own software), never waiting out the bound."""
    out, took, v = nodes(tmp_path, 3, {1: {"PYTHONPATH": SOFTWARE, "TEST_TORCH_VERSION": "2.3.0"}})
    assert out[0][0] == aiv.EXIT_FAIL, describe(out)
    (line,) = [ln for ln in failures(out[0][1]) if ln.startswith("FAILURE: local:")]
    assert "rank 1 (n1)" in line and "2.3.0" in line, line
    assert (v["failed_hosts"], v["exit_code"]) == (["n1"], aiv.EXIT_FAIL), v
    assert took < R / 2, f"{took:.0f} s: the roll call waited for the rank that had already failed\n{describe(out)}"


def test_the_tools_own_error_before_the_roll_call_ends_the_run_naming_nobody(tmp_path):
    """The tool's own error in rank 1's local phase: rank 0 hears of it at once, `internal`, exit 4, no host."""
    out, took, v = nodes(tmp_path, 3, {1: {"AIV_FAILPOINT": "raise:local:1"}})
    assert out[0][0] == aiv.EXIT_INTERNAL, describe(out)
    assert any(ln.startswith("FAILURE: internal:") and "rank 1" in ln for ln in failures(out[0][1])), describe(out)
    assert (v["failed_hosts"], v["exclude"]) == ([], ""), v
    assert took < R / 2, f"{took:.0f} s\n{describe(out)}"


def test_a_manifest_that_never_answers_is_one_usage_line_within_its_bound(tmp_path):
    """--manifest on storage that hangs (a FIFO nobody writes: a read that never returns): the probe before
    torch gives up after OUTPUT_S with one line, exit 2; before, rank 0 hung there for ever."""
    fifo = tmp_path / "manifest.json"
    os.mkfifo(fifo)
    t = time.monotonic()
    r = subprocess.run([sys.executable, str(SCRIPT), "--manifest", str(fifo)], env=clean_env(), text=True,
                       capture_output=True, timeout=aiv.OUTPUT_S + 120)
    took = time.monotonic() - t
    assert r.returncode == aiv.EXIT_USAGE, r.stdout + r.stderr
    (line,) = failures(r.stdout)
    assert line.startswith("FAILURE: usage: --manifest and --save-manifest did not answer within "), line
    assert aiv.OUTPUT_S <= took, took


def test_the_other_ranks_wait_for_a_verdict_slow_to_write_its_files(tmp_path):
    """Rank 0 writes the files asked for before it publishes its code: on slow storage (a pause there, longer
    than --timeout + RANK0_GRACE) the other ranks saw its `deciding` mark and waited for its code up to
    VERDICT_S, instead of speaking for a rank 0 alive and deciding (exit 3, nobody named)."""
    t, pause = 10, 30  # the pause 5 s past the others' backstop (forked ranks reach the files in seconds)
    assert t + aiv.RANK0_GRACE < pause < aiv.VERDICT_S
    out, took, v = nodes(tmp_path, 3, {0: {"AIV_FAILPOINT": f"pause={pause}:files:0"}}, args=("--timeout", t))
    assert [code for code, _, _ in out] == [aiv.EXIT_PASS] * 3, describe(out)
    assert sum(ln.startswith("Verdict:") for _, o, _ in out for ln in o.splitlines()) == 1, describe(out)
    assert not any(failures(o) for _, o, _ in out), describe(out)
    assert v["exit_code"] == aiv.EXIT_PASS and took >= pause, (v, took)


def test_rank_0s_crash_in_the_verdict_is_one_internal_line_naming_no_host(tmp_path):
    """The tool's own error at the start of rank 0's verdict, outside the report's guard: the last-resort
    `internal` line, ending with the mark of a line that names no host, exit 4."""
    out, took, _ = nodes(tmp_path, 2, {0: {"AIV_FAILPOINT": "raise:verdict:0"}}, args=("--timeout", 30))
    assert out[0][0] == aiv.EXIT_INTERNAL, describe(out)
    (line,) = [ln for ln in failures(out[0][1]) if "giving the verdict" in ln]
    assert line.startswith("FAILURE: internal:") and line.endswith(aiv.NO_HOST_MARK), line
