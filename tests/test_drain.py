"""--drain: which verdicts drain which hosts (drain_plan, pure), the scontrol line (a shell reads it back
as the same argv), `scontrol show node -o` parsed, and drain_apply against real scontrol stand-ins on
PATH (missing, refused with scontrol's own message, silent past DRAIN_S, a node drained for another
reason). The real drain on a real slurmctld is in tests/test_slurm.py."""
import json
import os
import shlex
import stat

import pytest

from conftest import aiv, spawn


def fail(check, hosts, code=aiv.EXIT_FAIL, blame=None, **kw):
    """A FAIL of `check` naming `hosts`, standing on `blame` (default: the first evidence its check may drain on,
    as its judge would say it)."""
    blame = blame or next(iter(aiv.CHECK_RULES[check]["drain"]), None)
    return dict(aiv.finding(check, "FAIL", f"{check} went wrong on {','.join(hosts) or 'nobody'}", hosts,
                            code=code, blame=blame), **kw)


SLOW = fail("inter-node", ["node3"])


def plan(findings, mode="recommend", nodes=4, job="42", max_nodes=None):
    return aiv.drain_plan(findings, mode, nodes, job, max_nodes)


def test_a_host_culprit_is_recommended_with_the_exact_command():
    p = plan([SLOW, aiv.finding("gpu-perf", "PASS", "ok")])
    assert p["hosts"] == ["node3"] and p["skipped"] is None and not p["done"]
    assert p["reason"] == "aiv: inter-node: inter-node went wrong on node3 (job 42)"
    assert shlex.split(p["command"]) == p["argv"] == [
        "scontrol", "update", "nodename=node3", "state=drain", f"reason={p['reason']}"]


@pytest.mark.parametrize("why, findings", [
    ("the run passed", [aiv.finding("gpu-perf", "PASS", "ok"), aiv.finding("fabric", "WARN", "slow", ["node3"])]),
    ("interrupted", [SLOW, fail("interrupted", [], aiv.EXIT_INTERRUPTED)]),
    ("the tool's own error", [SLOW, fail("internal", [], aiv.EXIT_INTERNAL)]),
    ("failed authentication", [SLOW, fail("rendezvous", [], tamper=True)]),
    ("widespread", [fail("inter-node", ["node1", "node2", "node3"], widespread=True)]),
    ("no failed check names a host", [fail("layout", ["node2"], aiv.EXIT_USAGE), fail("world-size", [])]),
    ("no failed check names a host", [fail("rendezvous", ["node1"], blame="own")]),  # its own state: not persistent
    # named, but on evidence its check does not declare persistent: a rank that never issued a collective, a
    # GPU measured once (never reaches here named: the gate strips it), software unlike the others on a tie
    ("no failed check names a host", [fail("collective", ["node2"], aiv.EXIT_TIMEOUT, blame="never-issued")]),
    ("no failed check names a host", [fail("gpu-perf", ["node2"], blame="once")]),
    ("no failed check names a host", [aiv.unlocalised(fail("versions", ["node1", "node2"]), "tie")]),
    # a check that declares no drain (a WARN made a FAIL by --strict)
    ("no failed check names a host", aiv.apply_strict([aiv.finding("numa", "WARN", "far", ["node2"], blame="own")],
                                                      True)),
    # a WARN made a FAIL by --strict on evidence its check does drain on: a kernel unlike the majority's
    ("no failed check names a host", aiv.apply_strict([aiv.finding("versions", "WARN", "kernel differs", ["node2"],
                                                                   blame="majority")], True)),
    ("not a Slurm job", None),
])
def test_nothing_is_drained_without_evidence_that_persists(why, findings):
    p = plan(findings or [SLOW], job=None if findings is None else "42")
    assert p["hosts"] == [] and p["command"] == "" and why in p["skipped"], p


def test_ranks_that_never_checked_in_drain_their_host():
    assert plan([fail("rendezvous", ["node2"], aiv.EXIT_TIMEOUT)])["hosts"] == ["node2"]


def test_more_culprits_than_the_cap_drain_nobody_and_say_why():
    many = [fail("gpu-perf", [f"node{i}"]) for i in range(1, 4)]
    assert aiv.drain_max(None, 20) == 2 and aiv.drain_max(None, 4) == 1 and aiv.drain_max(5, 4) == 5
    p = plan(many, nodes=20)
    assert p["hosts"] == []
    assert "3 culprit node(s), more than the 2 --drain-max allows (of 20 node(s))" in p["skipped"]
    assert plan(many, nodes=20, max_nodes=3)["hosts"] == ["node1", "node2", "node3"]


def test_off_plans_nothing_and_every_culprit_is_in_one_command():
    assert plan([SLOW], mode="off")["command"] == ""
    p = plan([fail("gpu-perf", ["gpu-10"]), fail("ddp", ["gpu-2"], aiv.EXIT_TIMEOUT)], nodes=20)
    assert p["hosts"] == ["gpu-2", "gpu-10"] and "nodename=gpu-[2,10]" in p["command"]


def test_a_reason_with_quotes_and_shell_characters_stays_one_argument():
    f = dict(SLOW, reason="it's \"slow\" $(rm -rf /) `x`; " + "y" * 300)
    p = plan([f])
    assert shlex.split(p["command"]) == p["argv"] and len(p["reason"]) <= aiv.DRAIN_REASON_MAX
    assert p["reason"].startswith("aiv: inter-node: it's") and p["reason"].endswith("... (job 42)")


SHOW = ("NodeName=node3 Arch=x86_64 CoresPerSocket=1 CPUAlloc=1 State=MIXED+DRAIN ThreadsPerCore=1 "
        "Partitions=debug BootTime=None Reason=bad fan in slot 2 [root@2026-12-02T10:00:00] Comment=(null)\n"
        "NodeName=node4 Arch=x86_64 State=ALLOCATED+DRAIN Reason=aiv: gpu-perf: old (job 7) "
        "[root@2026-12-01T09:00:00]\n"
        "NodeName=node5 Arch=x86_64 State=ALLOCATED Partitions=debug\n")


def test_scontrol_show_node_is_parsed_and_foreign_drains_are_kept():
    nodes = aiv.parse_scontrol_nodes(SHOW)
    assert nodes == {"node3": ("MIXED+DRAIN", "bad fan in slot 2"), "node4": ("ALLOCATED+DRAIN", "aiv: gpu-perf: old "
                                                                            "(job 7)"), "node5": ("ALLOCATED", "")}
    assert aiv.drain_keeps(nodes) == {"node3": "bad fan in slot 2"}  # ours (node4) is drained again


# ---------------------------------------------------------------- drain_apply with scontrol stand-ins
def fake_scontrol(tmp_path, update, show=SHOW):
    """A real executable named scontrol first on PATH: `show` prints `show`; `update` runs the shell
    snippet `update`; every call is appended to calls.txt."""
    log = tmp_path / "calls.txt"
    script = tmp_path / "bin" / "scontrol"
    script.parent.mkdir(exist_ok=True)
    script.write_text(f"""#!/bin/bash
printf '%s\\n' "$*" >> {shlex.quote(str(log))}
if [ "$1" = show ]; then printf '%s' {shlex.quote(show)}; exit 0; fi
{update}
""")
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return script.parent, log


def apply_with(monkeypatch, bindir, hosts=("node3", "node5")):
    monkeypatch.setenv("PATH", f"{bindir}:{os.environ['PATH']}")
    p = plan([fail("gpu-perf", list(hosts))], nodes=40)
    return aiv.drain_apply(p)


def test_apply_drains_the_rest_in_one_update_and_keeps_a_foreign_reason(tmp_path, monkeypatch):
    bindir, log = fake_scontrol(tmp_path, "exit 0")
    p, warns = apply_with(monkeypatch, bindir)
    assert warns == [] and p["done"] and p["hosts"] == ["node5"] and p["kept"] == {"node3": "bad fan in slot 2"}
    calls = log.read_text().splitlines()
    assert calls == ["show node -o node[3,5]", f"update nodename=node5 state=drain reason={p['reason']}"]
    assert any("node3 keeps its own reason: 'bad fan in slot 2'" in ln for ln in aiv.render_drain(p))


def test_refused_is_a_warn_quoting_scontrol(tmp_path, monkeypatch):
    bindir, _ = fake_scontrol(tmp_path, 'echo "slurm_update error: Invalid user id" >&2; exit 1')
    p, (w,) = apply_with(monkeypatch, bindir)
    assert not p["done"] and w["status"] == "WARN" and w["check"] == "drain"
    assert "scontrol refused: slurm_update error: Invalid user id" in w["reason"] and "scontrol update" in w["reason"]


def test_missing_or_silent_scontrol_is_a_warn_within_the_bound(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # nothing there
    _, (w,) = aiv.drain_apply(plan([SLOW]))
    assert "scontrol is not on PATH" in w["reason"] and w["status"] == "WARN"
    bindir, _ = fake_scontrol(tmp_path, "exit 0", show="")
    (bindir / "scontrol").write_text("#!/bin/bash\nexec /bin/sleep 60\n")
    monkeypatch.setattr(aiv, "DRAIN_S", 0.5)
    _, (w,) = apply_with(monkeypatch, bindir)
    assert "did not answer within 0.5s" in w["reason"]


def test_a_run_with_a_culprit_prints_the_command_and_puts_it_in_the_json(tmp_path):
    """A real gloo run whose rank 1 dies in the collective, under SLURM_JOB_ID: the report and the JSON carry
    the drain command for rank 1's host; with --drain on and a refusing scontrol the WARN stands beside the
    FAIL and the exit code is the FAIL's."""
    bindir, log = fake_scontrol(tmp_path, 'echo "slurm_update error: Invalid user id" >&2; exit 1', show="")
    js = tmp_path / "v.json"
    env = {"SLURM_JOB_ID": "4242", "AIV_FAILPOINT": "die:collective:1", "AIV_JSON": js, "AIV_DRAIN": "on",
           "AIV_JOB_SECRET": "s" * 64, "PATH": f"{bindir}:{os.environ['PATH']}"}
    ((rc, out), _), _ = spawn(2, args=["--skip-screen", "--timeout", "20"], env=env)
    v = json.loads(js.read_text())
    assert rc == v["exit_code"] != 0, out
    host = v["failed_hosts"][0]
    assert v["drain"]["reason"].startswith("aiv: collective: ") and v["drain"]["reason"].endswith("(job 4242)")
    assert f"nodename={host}" in v["drain_command"] and not v["drain"]["done"]
    assert "[WARN] drain: nothing drained: scontrol refused: slurm_update error: Invalid user id" in out
    assert log.read_text().splitlines()[0] == f"show node -o {host}"


def test_the_tools_own_error_in_the_report_drains_nobody(tmp_path):
    """Rank 1 dies in the collective (a culprit) and then rendering the report raises (the tool's own
    error): with --drain on no scontrol runs at all, and the JSON says why."""
    bindir, log = fake_scontrol(tmp_path, "exit 0", show="")
    js = tmp_path / "v.json"
    env = {"SLURM_JOB_ID": "4243", "AIV_FAILPOINT": "die:collective:1,raise:report:0", "AIV_JSON": js,
           "AIV_DRAIN": "on", "AIV_JOB_SECRET": "s" * 64, "PATH": f"{bindir}:{os.environ['PATH']}"}
    ((rc, out), _), _ = spawn(2, args=["--skip-screen", "--timeout", "20"], env=env)
    v = json.loads(js.read_text())
    assert "FAILURE: internal: " in out and v["failed_hosts"], out
    assert v["drain_command"] == "" and "the tool's own error" in v["drain"]["skipped"] and not log.exists()
