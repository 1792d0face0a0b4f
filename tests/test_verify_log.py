"""--verify-log on the command line: an empty or unreadable path is a usage error, never a run."""
import pytest

from conftest import run_tool


@pytest.mark.parametrize("args,env,name", [
    (["--verify-log", ""], {}, "--verify-log"),
    (["--verify-log="], {}, "--verify-log"),
    (["--verify-log", "  "], {}, "--verify-log"),
    ([], {"AIV_VERIFY_LOG": ""}, "AIV_VERIFY_LOG"),
    (["--verify-log", ""], {"AIV_VERIFY_LOG": "x.log"}, "--verify-log"),
], ids=["flag", "flag-equals", "blank", "variable", "flag-wins"])
def test_empty_path_is_a_usage_error_not_a_run(args, env, name):
    r = run_tool(args, env=env, timeout=60)
    out = (r.stdout + r.stderr).strip().splitlines()
    assert r.returncode == 2, r.stdout + r.stderr
    assert out == [f"FAILURE: usage: {name} is empty; give the path of a saved log"]


def test_unreadable_path_is_a_usage_error(tmp_path):
    r = run_tool(["--verify-log", tmp_path / "absent.log"], timeout=60)
    out = (r.stdout + r.stderr).strip().splitlines()
    assert r.returncode == 2
    assert out == [f"FAILURE: usage: --verify-log: cannot read {tmp_path / 'absent.log'}: No such file or directory"]
    r = run_tool([], env={"AIV_VERIFY_LOG": tmp_path}, timeout=60)
    assert r.returncode == 2 and r.stdout.startswith("FAILURE: usage: AIV_VERIFY_LOG: cannot read ")


def test_empty_file_fails(tmp_path):
    p = tmp_path / "empty.log"
    p.write_text("")
    r = run_tool(["--verify-log", p], timeout=60)
    assert r.returncode == 1 and "verify-log: MISSING/BAD: success marker missing" in r.stdout
