"""Every mistake a new user makes, end to end with real processes: exit 2, exactly one FAILURE line on
stdout naming the flag or variable as written, no traceback, nothing run (torch is never imported)."""
import pytest

from conftest import failures, run_tool, spawn

RANK1 = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}


def one_line(r):
    """The one FAILURE line of a process that must have stopped on a usage error."""
    assert r.returncode == 2, r.stdout + r.stderr
    assert "Traceback" not in r.stdout + r.stderr
    assert "Total Execution Ranks" not in r.stdout              # nothing was run
    lines = failures(r.stdout)
    assert len(lines) == 1 and r.stdout.strip() == lines[0], r.stdout
    return lines[0]


@pytest.mark.parametrize("args,env,want", [
    ([], {"MASTER_PORT": "abc"}, "FAILURE: contract: MASTER_PORT='abc' is not an integer"),
    ([], {"MASTER_PORT": "70000"}, "FAILURE: contract: MASTER_PORT=70000 is above 65535"),
    ([], dict(RANK1, RANK="2"), "FAILURE: contract: RANK=2 is not below WORLD_SIZE=2"),
    ([], dict(RANK1, MASTER_PORT="abc"), "FAILURE: contract: MASTER_PORT='abc' is not an integer"),
    (["--timeout=-5"], RANK1, "FAILURE: usage: --timeout='-5' is outside 1-86400 seconds"),
    ([], {"WORLD_SIZE": "4"}, "FAILURE: contract: WORLD_SIZE='4' is set but RANK is not"),
    ([], {"LOCAL_RANK": "0"}, "FAILURE: contract: LOCAL_RANK='0' is set but RANK is not"),
    ([], {"RANK": "0"}, "FAILURE: contract: WORLD_SIZE is not set"),
    ([], {"AIV_TIMEOUT": "abc"}, "FAILURE: usage: AIV_TIMEOUT='abc' is not a number"),
    (["--timeout", "inf"], {}, "FAILURE: usage: --timeout='inf' is not a finite number of seconds"),
    (["--rollcall-timeout", "nan"], {}, "FAILURE: usage: --rollcall-timeout='nan' is not a finite number"),
    (["--timeout=1e-9"], {}, "FAILURE: usage: --timeout='1e-9' is outside 1-86400 seconds"),
    ([], {"AIV_ROLLCALL_TIMEOUT": "-5"}, "FAILURE: usage: AIV_ROLLCALL_TIMEOUT='-5' is outside"),
    (["--nproc", "100000"], {}, "FAILURE: usage: --nproc=100000 is more ranks than this machine holds"),
    ([], {"AIV_NPROC": "100000"}, "FAILURE: usage: AIV_NPROC=100000 is more ranks than this machine holds"),
    ([], {"AIV_BANDWIDTH": "maybe"}, "FAILURE: usage: AIV_BANDWIDTH='maybe' is not a list of sizes"),
    (["--min-busbw", "5"], {"AIV_BANDWIDTH": "0"},
     "FAILURE: usage: --min-busbw needs the bandwidth probe, which AIV_BANDWIDTH turns off"),
    ([], {"AIV_STRICT": "maybe"}, "FAILURE: usage: AIV_STRICT='maybe' is neither on"),
    (["--time", "5"], {}, "FAILURE: usage: unknown option '--time' (did you mean --timeout?)"),
    (["--soak", "-1"], {}, "FAILURE: usage: --soak='-1' is not 0 (off) or 1-86400 seconds"),
    (["--soak", "abc"], {}, "FAILURE: usage: --soak='abc' is not a number"),
    (["--soak=0.5"], {}, "FAILURE: usage: --soak='0.5' is not 0 (off) or 1-86400 seconds"),
    ([], {"AIV_SOAK": ""}, "FAILURE: usage: AIV_SOAK is empty; give a number of seconds, or 0 for no soak"),
    (["--json", "/nonexistent-aiv-dir/v.json"], {},
     "FAILURE: usage: --json='/nonexistent-aiv-dir/v.json' names directory /nonexistent-aiv-dir, which does not exist"),
    (["--json", "/proc/aiv-verdict.json"], {}, "FAILURE: usage: --json='/proc/aiv-verdict.json' cannot be written"),
])
def test_one_line_naming_what_was_written(args, env, want):
    r = run_tool(args, env=env, timeout=60)
    assert one_line(r).startswith(want)


def test_flag_errors_show_usage_on_stderr_only():
    r = run_tool(["--backend", "mpi"], timeout=60)
    assert one_line(r) == "FAILURE: usage: --backend='mpi' is not auto, nccl or gloo"
    assert r.stderr.startswith("usage: ddp_mesh_ping.py")


def test_json_in_a_file_not_a_directory_is_refused_before_the_run(tmp_path):
    (tmp_path / "file").write_text("")
    target = tmp_path / "file" / "v.json"
    r = run_tool([], env={"AIV_JSON": target}, timeout=60)
    assert one_line(r) == f"FAILURE: usage: AIV_JSON='{target}' names {tmp_path / 'file'}, which is not a directory"


def test_rank_1_with_its_own_bad_value_speaks_and_rank_0_names_it_missing():
    """Rank 0 cannot see rank 1's LOCAL_RANK: rank 1 says it (once for its node); rank 0 reports the roll call."""
    res, _ = spawn(2, args=["--rollcall-timeout", 15, "--timeout", 30], env={"LOCAL_WORLD_SIZE": 2},
                   per_rank={1: {"LOCAL_RANK": "abc"}}, timeout=120)
    (rc0, out0), (rc1, out1) = res
    assert rc1 == 2 and failures(out1) == ["FAILURE: contract: LOCAL_RANK='abc' is not an integer"], out1
    contract = [ln for ln in failures(out0 + out1) if ln.startswith("FAILURE: contract:")]
    assert contract == ["FAILURE: contract: LOCAL_RANK='abc' is not an integer"]
    assert rc0 == 3 and any("rank(s) 1 did not check in" in ln for ln in failures(out0)), out0
    assert "Traceback" not in out0 + out1


def test_the_same_own_mistake_on_every_rank_of_a_node_is_said_once():
    res, _ = spawn(2, env={"LOCAL_RANK": "abc", "LOCAL_WORLD_SIZE": 2}, timeout=60)
    assert [rc for rc, _ in res] == [2, 2]
    both = "".join(out for _, out in res)
    assert failures(both) == ["FAILURE: contract: LOCAL_RANK='abc' is not an integer"], both
    assert "Traceback" not in both


def test_a_shared_mistake_is_said_by_rank_0_alone():
    res, _ = spawn(2, args=["--timeout=abc"], env={"LOCAL_WORLD_SIZE": 2}, timeout=60)
    (rc0, out0), (rc1, out1) = res
    assert (rc0, rc1) == (2, 2) and failures(out0) == ["FAILURE: usage: --timeout='abc' is not a number"]
    assert not failures(out1) and "Traceback" not in out0 + out1
