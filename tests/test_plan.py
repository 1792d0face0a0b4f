"""plan(): every (argv, env) is a plan or the one line to print, decided without torch; the rules of
who prints a usage error; the --nproc rule; the --json probe."""
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import ROOT, aiv

OPTIONS = [a for a in aiv.build_parser()._actions if hasattr(a, "conv")]
FLAGS = [a.option_strings[0] for a in OPTIONS]
GOOD = {"--backend": ["auto", "gloo"], "--timeout": ["5", "120", "2.5"], "--rollcall-timeout": ["30", "1e2"],
        "--expect-world-size": ["2", "4"], "--expect-nodes": ["1"], "--expect-ranks-per-node": ["2"],
        "--strict": ["on", "0", "YES"], "--json": ["/tmp/aiv-plan-test.json"], "--nproc": ["2", "3"],
        "--bandwidth": ["1M", "64K,1M", "off", "on", "0"], "--min-busbw": ["1.5"], "--sysfs-root": ["/"],
        "--verify-log": ["x.log"], "--save-manifest": ["/tmp/aiv-plan-m.json"], "--manifest": ["/tmp/aiv-plan-m.json"],
        "--diff-manifest": ["/tmp/aiv-plan-m.json"], "--skip-screen": ["on", "off"], "--skip-numerics": ["on", "off"],
        "--min-tflops": ["1.5"],
        "--min-hbm": ["100"], "--min-busbw-intra": ["10"], "--min-busbw-inter": ["5"],
        "--drain": ["off", "recommend", "on"], "--drain-max": ["1", "8"], "--metrics": ["/tmp/aiv-plan-test.prom"],
        "--html": ["/tmp/aiv-plan-test.html"], "--soak": ["0", "30", "2.5", "off"], "--node-budget": ["25", "5.5"],
        "--node-lock-dir": ["/run/aiv"],
        "--expect-gpus": ["0", "8"], "--undrain": ["on", "off"], "--node-check": ["health", "prolog", "npd"]}
TORCHRUN = {"RANK": "1", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "MASTER_ADDR": "node1", "MASTER_PORT": "29500"}
SLURM = {"SLURM_PROCID": "3", "SLURM_NTASKS": "4", "SLURM_LOCALID": "1", "SLURM_JOB_ID": "77", "SLURM_STEP_ID": "0",
         "SLURM_JOB_NODELIST": "gpu[1-2]", "SLURM_TASKS_PER_NODE": "2(x2)"}
LAUNCH = sorted(set(TORCHRUN) | set(SLURM) | {"LOCAL_WORLD_SIZE", "CUDA_VISIBLE_DEVICES"})
VARS = {a.env: GOOD[a.option_strings[0]] for a in OPTIONS if a.env}
JUNK = ["", " ", "-1", "-5", "0", "1", "65536", "1e-9", "0.5", "inf", "nan", "-inf", "1e400", "abc", "mpi", "maybe",
        "12Q", "0,1M", "65G", "1MB", "/nonexistent/x.json", "node[1-2]", "n[", "bad host;rm", "٣", "1_0",
        "99999999999999999999999"]
junk = st.sampled_from(JUNK) | st.text(st.characters(exclude_characters="\x00"), max_size=10)


@st.composite
def argvs(draw):
    """Mostly valid flags and values, with a wrong value, an unknown flag or a stray word mixed in."""
    out = []
    for _ in range(draw(st.integers(0, 5))):
        flag = draw(st.sampled_from(FLAGS))
        kind = draw(st.sampled_from(["good", "good", "good", "bad", "stray"]))
        val = draw(st.sampled_from(GOOD[flag])) if kind == "good" else draw(junk)
        if kind == "stray":
            out.append(draw(st.sampled_from([val, "--bogus", "--time", "-x", "-", "--", "foo", "--help"])))
        elif flag == "--strict" and draw(st.booleans()):
            out.append(flag)
        else:
            out += [f"{flag}={val}"] if draw(st.booleans()) else [flag, val]
    return out


@st.composite
def envs(draw):
    """No launch variables, torchrun's or Slurm's; some changed to junk or removed; AIV_* variables."""
    env = dict(draw(st.sampled_from([TORCHRUN, {}, SLURM, {}])))
    for var in draw(st.lists(st.sampled_from(LAUNCH), max_size=3)):
        if draw(st.booleans()):
            env.pop(var, None)
        else:
            env[var] = draw(junk | st.sampled_from(["0", "1", "2", "4", "29500", "node1"]))
    for var in draw(st.lists(st.sampled_from(sorted(VARS)), max_size=3)):
        env[var] = draw(st.sampled_from(VARS[var]) | junk)
    if draw(st.sampled_from([False] * 20 + [True])):
        env["AIV_VERIFY_LOG"] = draw(junk)
    return env


def check_plan_or_line(argv, env):
    try:
        p = aiv.plan(argv, env)
    except aiv.UsageError as e:
        line = str(e)
        assert line.startswith(("FAILURE: usage: ", "FAILURE: contract: ")) and len(line.splitlines()) == 1, line
        if line.startswith("FAILURE: usage: ") and not argv:  # only variables given: one of them is named
            assert line.split()[2].startswith("AIV_"), line
        return None
    if p["mode"] in ("help", "version"):
        return p
    assert p["mode"] in ("local", "rank", "verify-log", "diff-manifest", "node-check")
    a = p["args"]
    if p["mode"] == "diff-manifest":  # two paths (a stray word after the flag's one value is the second)
        assert len(a.diff_manifest) == 2 and all(x.strip() for x in a.diff_manifest), a.diff_manifest
    assert 1 <= a.timeout <= aiv.SECONDS_MAX and 1 <= a.rollcall_timeout <= aiv.SECONDS_MAX
    assert a.backend in ("auto", "nccl", "gloo") and a.strict in (True, False)
    assert a.bandwidth is None or all(1 <= n <= aiv.SIZE_MAX for n in a.bandwidth)
    if p["mode"] == "rank":
        c = p["contract"]
        assert 0 <= c["local_rank"] <= c["rank"] < c["world_size"] and 1 <= c["master_port"] <= 65535
    if p["mode"] == "local":
        assert p["launch"]["nproc"] >= 1 and p["launch"]["port"] in (None, *range(1, 65536))
    return p


@settings(max_examples=500, deadline=None)
@given(argvs(), envs())
def test_every_input_is_a_plan_or_one_usage_line(argv, env):
    check_plan_or_line(argv, env)


NO_TORCH = r"""
import sys
sys.path.insert(0, sys.argv[1])
import ddp_mesh_ping as m
base = {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
cases = [([], {}), (["--timeout", "abc"], {}), ([], {"AIV_TIMEOUT": "inf"}), ([], base),
         (["--json", "/tmp/v.json"], base), ([], {"WORLD_SIZE": "4"}), ([], {"MASTER_PORT": "abc"}),
         (["--nproc", "100000"], {}), (["--help"], {}), (["--verify-log", "x.log"], {})]
modes = []
for argv, env in cases:
    try:
        p = m.plan(argv, env)
        modes.append(p["mode"])
        if p.get("check_json"):
            m.check_json_target(p["args"])
    except m.UsageError:
        modes.append("usage")
assert "torch" not in sys.modules, "plan() imported torch"
print(" ".join(modes))
"""


def test_plan_never_imports_torch():
    r = subprocess.run([sys.executable, "-c", NO_TORCH, str(ROOT)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.split() == ["local", "usage", "usage", "rank", "rank", "usage", "usage", "usage", "help",
                                "verify-log"]


BASE = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}


def line(argv=(), env=None):
    with pytest.raises(aiv.UsageError) as e:
        aiv.plan(list(argv), env or {})
    return str(e.value), e.value.own


@pytest.mark.parametrize("raw", ["inf", "nan", "-inf", "1e-9", "-5", "0", "abc", "86401"])
@pytest.mark.parametrize("flag", ["--timeout", "--rollcall-timeout"])
def test_bad_timeouts_name_the_flag_or_variable_as_written(flag, raw):
    assert line([f"{flag}={raw}"])[0].startswith(f"FAILURE: usage: {flag}={raw!r} ")
    var = "AIV_" + flag[2:].upper().replace("-", "_")
    got = line([], {var: raw})[0]
    assert got.startswith(f"FAILURE: usage: {var}={raw!r} ") and "--" not in got


def test_modes():
    local = aiv.plan([], {})
    assert local["mode"] == "local" and local["check_json"] and local["launch"]["port"] is None
    assert aiv.plan([], {"MASTER_PORT": "29511"})["launch"]["port"] == 29511
    rank = aiv.plan(["--timeout", "7"], BASE)
    assert rank["mode"] == "rank" and rank["contract"]["rank"] == 1 and not rank["check_json"]
    assert rank["args"].timeout == 7.0 and rank["args"].origin == {"timeout": "--timeout"}
    assert aiv.plan(["--verify-log", "x.log"], {"SLURM_JOB_ID": "5"})["mode"] == "verify-log"  # no contract read
    assert aiv.plan(["--timeout", "abc", "--help"], {})["mode"] == "help"
    assert aiv.plan(["--version"], {})["text"] == f"ai-infra-validator {aiv.VERSION}"


@pytest.mark.parametrize("env,named", [
    ({"WORLD_SIZE": "4"}, "WORLD_SIZE='4' is set but RANK is not"),
    ({"LOCAL_RANK": "0"}, "LOCAL_RANK='0' is set but RANK is not"),
    ({"WORLD_SIZE": "2", "LOCAL_RANK": "1"}, "WORLD_SIZE='2' and LOCAL_RANK='1' are set but RANK is not"),
    ({"RANK": "0"}, "WORLD_SIZE is not set"),
])
def test_a_partial_launch_environment_is_never_a_local_run(env, named):
    text, _ = line([], env)
    assert text.startswith(f"FAILURE: contract: {named}")


@pytest.mark.parametrize("port", ["abc", "0", "65536", "", "80.5"])
def test_local_mode_master_port_is_checked(port):
    assert line([], {"MASTER_PORT": port})[0].startswith("FAILURE: contract: MASTER_PORT")


@pytest.mark.parametrize("env,own", [
    (dict(BASE, LOCAL_RANK="abc"), True), (dict(BASE, RANK="2"), True), (dict(BASE, LOCAL_RANK="2", RANK="1"), True),
    ({"WORLD_SIZE": "4"}, True), (dict(BASE, MASTER_PORT="abc"), False), (dict(BASE, WORLD_SIZE="x"), False),
])
def test_own_values_are_marked(env, own):
    assert line([], env)[1] is own


def test_one_grammar_for_switches_and_sizes():
    for word, on in (("1", True), ("ON", True), ("yes", True), ("True", True), ("0", False), ("off", False),
                     ("No", False), ("FALSE", False)):
        assert aiv.parse_args([], {"AIV_STRICT": word}).strict is on
        assert aiv.parse_args([f"--strict={word}"], {}).strict is on
        assert (aiv.parse_args([], {"AIV_BANDWIDTH": word}).bandwidth is not None) is on
        assert (aiv.parse_args([f"--bandwidth={word}"], {}).bandwidth is not None) is on
    assert aiv.parse_args(["--strict"], {}).strict is True
    assert aiv.parse_args(["--bandwidth", "0"], {}).bandwidth is None
    assert aiv.parse_args(["--bandwidth=1k,2M,1g"], {}).bandwidth == [1 << 10, 2 << 20, 1 << 30]
    assert aiv.parse_args(["--min-busbw", "5"], {}).bandwidth == aiv._sizes(aiv.DEFAULT_BW_SIZES)
    for bad in ("1MB", "12Q", "0,1M", "65G", "-1M", "1.5M"):
        assert line([f"--bandwidth={bad}"])[0].startswith(f"FAILURE: usage: --bandwidth={bad!r} ")
    assert line(["--min-busbw=5"], {"AIV_BANDWIDTH": "off"})[0] == (
        "FAILURE: usage: --min-busbw needs the bandwidth probe, which AIV_BANDWIDTH turns off")


@pytest.mark.parametrize("argv,env,want", [
    (["--time", "5"], {}, "FAILURE: usage: unknown option '--time' (did you mean --timeout?)"),
    (["run"], {}, "FAILURE: usage: unexpected argument 'run': ddp_mesh_ping.py takes options only (see --help)"),
    (["--timeout"], {}, "FAILURE: usage: --timeout: expected one argument"),
    (["--json="], {}, "FAILURE: usage: --json is empty; give a path"),
    ([], {"AIV_STRICT": ""}, "FAILURE: usage: AIV_STRICT is empty; give on or off, or unset it"),
    ([], {"AIV_BACKEND": "mpi"}, "FAILURE: usage: AIV_BACKEND='mpi' is not auto, nccl or gloo"),
    (["--timeout", "5"], {"AIV_TIMEOUT": "abc"}, None),  # the flag wins; the variable is not read
])
def test_messages(argv, env, want):
    if want is None:
        assert aiv.plan(argv, env)["args"].timeout == 5.0
    else:
        assert line(argv, env)[0] == want


def fake_args(nproc=None, backend="auto", origin=None):
    return SimpleNamespace(nproc=nproc, backend=backend, origin=origin or {})


def test_nproc_rule(monkeypatch, tmp_path):
    monkeypatch.setattr(aiv, "usable_cores", lambda: 2)
    monkeypatch.setattr(aiv, "mem_available", lambda root="/": 3 << 30)
    root = str(tmp_path)
    assert aiv.launch_plan(fake_args(nproc=6), {}, root)["nproc"] == 6          # 6 x 512 MiB = 3 GiB
    with pytest.raises(aiv.UsageError, match=r"^--nproc=9 is more ranks .* at most 4 per CPU core, 8 on the 2"):
        aiv.launch_plan(fake_args(nproc=9), {}, root)
    with pytest.raises(aiv.UsageError, match=r"^AIV_NPROC=7 is more ranks .* 7 x 512.0MiB per CPU rank, but 3.0GiB"):
        aiv.launch_plan(fake_args(nproc=7, origin={"nproc": "AIV_NPROC"}), {}, root)
    with pytest.raises(aiv.UsageError, match="per GPU rank"):
        aiv.launch_plan(fake_args(nproc=3), {"CUDA_VISIBLE_DEVICES": "0,1"}, root)
    monkeypatch.setattr(aiv, "usable_cores", lambda: 1)
    assert aiv.launch_plan(fake_args(), {}, root)["nproc"] == 2                  # the default is never refused
    monkeypatch.setattr(aiv, "mem_available", lambda root="/": None)             # unknown memory: cores only
    assert aiv.launch_plan(fake_args(nproc=4), {}, root)["nproc"] == 4


def test_mem_available_reads_meminfo_and_the_cgroup_limit(tmp_path):
    (tmp_path / "proc/self").mkdir(parents=True)
    (tmp_path / "proc/meminfo").write_text("MemTotal: 100 kB\nMemAvailable:    8388608 kB\n")
    assert aiv.mem_available(str(tmp_path)) == 8 << 30
    (tmp_path / "proc/self/cgroup").write_text("0::/job/42\n")
    cg = tmp_path / "sys/fs/cgroup/job/42"
    cg.mkdir(parents=True)
    (cg / "memory.max").write_text(f"{4 << 30}\n")
    (cg / "memory.current").write_text(f"{1 << 30}\n")
    assert aiv.mem_available(str(tmp_path)) == 3 << 30
    (cg / "memory.max").write_text("max\n")
    assert aiv.mem_available(str(tmp_path)) == 8 << 30
    assert aiv.mem_available(str(tmp_path / "none")) is None


def test_json_problem(tmp_path):
    (tmp_path / "file").write_text("")
    assert aiv.json_problem(str(tmp_path / "v.json")) is None
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".aiv-probe-")]
    assert aiv.json_problem(str(tmp_path)) == "is a directory"
    assert aiv.json_problem(str(tmp_path / "no/v.json")) == f"names directory {tmp_path / 'no'}, which does not exist"
    assert aiv.json_problem(str(tmp_path / "file/v.json")) == f"names {tmp_path / 'file'}, which is not a directory"
    assert aiv.json_problem("/proc/v.json").startswith("cannot be written: no file can be created in /proc")
    args = SimpleNamespace(json=str(tmp_path / "no/v.json"), origin={"json": "AIV_JSON"})
    with pytest.raises(aiv.UsageError, match=r"^FAILURE: usage: AIV_JSON='.*/no/v.json' names directory"):
        aiv.check_json_target(args)


@pytest.mark.parametrize("env,own,spoken", [
    ({}, False, "emit"),                                           # local mode: one process, it prints
    ({"RANK": "1"}, False, "emit"),                                # started by hand: nobody else would speak
    ({"RANK": "0", "LOCAL_WORLD_SIZE": "2"}, False, "emit"),       # under a launcher, rank 0 speaks for all
    ({"RANK": "1", "LOCAL_WORLD_SIZE": "2"}, False, None),         # ... and the others stay silent
    ({"RANK": "1", "SLURM_STEP_ID": "0"}, True, "node"),           # its own value: once per node
    ({"RANK": "x", "SLURM_STEP_ID": "0"}, False, "node"),          # rank unknown: once per node
])
def test_who_prints(monkeypatch, capsys, env, own, spoken):
    said = []
    monkeypatch.setattr(aiv, "speak_once_per_node", lambda text, env, local_rank=0, topic="": said.append(text))
    assert aiv.report_usage(aiv.UsageError("FAILURE: contract: X", own=own), env) == aiv.EXIT_USAGE
    out = capsys.readouterr().out.splitlines()
    assert (out, said) == {"emit": (["FAILURE: contract: X"], []), "node": ([], ["FAILURE: contract: X"]),
                           None: ([], [])}[spoken]
