"""The launch contract and the options: every malformed value is a named error."""
import re

import pytest

from conftest import aiv

BASE = {"RANK": "1", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "MASTER_ADDR": "node1", "MASTER_PORT": "29500"}


def test_torchrun_names():
    c = aiv.read_contract(BASE)
    got = (c["rank"], c["world_size"], c["local_rank"], c["master_addr"], c["master_port"])
    assert got == (1, 4, 1, "node1", 29500)
    assert c["source"] == "env"


def test_no_distributed_environment_is_local_mode():
    assert aiv.read_contract({"HOME": "/root"}) is None


def test_slurm_fallback_names_first_host_and_derived_port():
    env = {"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1", "SLURM_STEP_ID": "0",
           "SLURM_JOB_ID": "1234", "SLURM_JOB_NODELIST": "gpu-a[07-08]"}
    c = aiv.read_contract(env)
    assert (c["rank"], c["world_size"], c["local_rank"]) == (5, 8, 1)
    assert c["master_addr"] == "gpu-a07"
    assert c["master_port"] == aiv.derive_port(1234) and 49152 <= c["master_port"] <= 65535
    assert c["port_source"] == "SLURM_JOB_ID" and c["source"] == "slurm"


def test_torchrun_names_win_over_slurm():
    env = dict(BASE, SLURM_PROCID="7", SLURM_NTASKS="16", SLURM_STEP_ID="0", SLURM_JOB_ID="9")
    c = aiv.read_contract(env)
    assert (c["rank"], c["world_size"]) == (1, 4)


@pytest.mark.parametrize("env", [
    {"SLURM_JOB_ID": "12", "SLURM_PROCID": "0", "SLURM_NTASKS": "4"},   # sbatch shell carries PROCID=0
    {"SLURM_JOB_ID": "12"},                                            # salloc shell
])
def test_batch_shell_is_told_to_use_srun(env):
    with pytest.raises(aiv.UsageError, match="srun"):
        aiv.read_contract(env)


@pytest.mark.parametrize("var,value,match", [
    ("RANK", "", "RANK is empty"),
    ("RANK", "x", "RANK='x' is not an integer"),
    ("RANK", "-1", "RANK=-1 is below 0"),
    ("RANK", "4", "RANK=4 is not below WORLD_SIZE=4"),
    ("WORLD_SIZE", "0", "WORLD_SIZE=0 is below 1"),
    ("WORLD_SIZE", "2.5", "WORLD_SIZE='2.5' is not an integer"),
    ("LOCAL_RANK", "abc", "LOCAL_RANK='abc'"),
    ("LOCAL_RANK", "3", "LOCAL_RANK=3 is larger than RANK=1"),
    ("MASTER_PORT", "0", "MASTER_PORT=0 is below 1"),
    ("MASTER_PORT", "65536", "MASTER_PORT=65536 is above 65535"),
    ("MASTER_PORT", "http", "MASTER_PORT='http' is not an integer"),
    ("MASTER_ADDR", "", "MASTER_ADDR=''"),
    ("MASTER_ADDR", "bad host;rm", "is not a host name"),
])
def test_malformed_values_name_the_variable(var, value, match):
    with pytest.raises(aiv.UsageError, match=match.replace("(", r"\(").replace("[", r"\[")):
        aiv.read_contract(dict(BASE, **{var: value}))


@pytest.mark.parametrize("missing", ["WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"])
def test_missing_variable_is_named(missing):
    env = {k: v for k, v in BASE.items() if k != missing}
    with pytest.raises(aiv.UsageError, match=missing):
        aiv.read_contract(env)


def test_options_from_environment_and_flag_wins():
    a = aiv.parse_args([], {"AIV_TIMEOUT": "42", "AIV_EXPECT_NODES": "3", "AIV_STRICT": "1", "AIV_JSON": "/x.json"})
    assert (a.timeout, a.expect_nodes, a.strict, a.json) == (42.0, 3, True, "/x.json")
    b = aiv.parse_args(["--timeout", "7", "--expect-nodes=5"], {"AIV_TIMEOUT": "42", "AIV_EXPECT_NODES": "3"})
    assert (b.timeout, b.expect_nodes) == (7.0, 5)
    assert aiv.parse_args([], {"AIV_STRICT": "0"}).strict is False


@pytest.mark.parametrize("argv,env", [
    (["--timeout", "abc"], {}), (["--timeout", "0"], {}), (["--expect-nodes", "-2"], {}),
    (["--backend", "mpi"], {}), ([], {"AIV_TIMEOUT": "soon"}), ([], {"AIV_STRICT": "maybe"}),
    (["--bandwidth=12Q"], {}), (["--no-such-flag"], {}),
])
def test_bad_options_are_usage_errors(argv, env):
    with pytest.raises(aiv.UsageError):
        aiv.parse_args(argv, env)


def test_bandwidth_sizes():
    a = aiv.parse_args(["--bandwidth=1M,64MiB,1G"], {})
    assert a.bandwidth == [1 << 20, 64 << 20, 1 << 30]
    assert aiv.parse_args(["--bandwidth"], {}).bandwidth == aiv._sizes(aiv.DEFAULT_BW_SIZES)
    assert aiv.parse_args([], {"AIV_BANDWIDTH": "1"}).bandwidth == aiv._sizes(aiv.DEFAULT_BW_SIZES)
    assert aiv.parse_args([], {"AIV_BANDWIDTH": "4M"}).bandwidth == [4 << 20]
    assert aiv.parse_args([], {}).bandwidth is None


def test_slurm_expectations_and_expected_hosts():
    env = {"SLURM_NTASKS": "6", "SLURM_JOB_NUM_NODES": "3", "SLURM_TASKS_PER_NODE": "2(x3)",
           "SLURM_JOB_NODELIST": "n[1-3]"}
    assert aiv.slurm_expectations(env) == {"world_size": 6, "nodes": 3, "ranks_per_node": 2}
    assert aiv.slurm_expected_hosts(env, 6) == {0: "n1", 1: "n1", 2: "n2", 3: "n2", 4: "n3", 5: "n3"}
    assert aiv.slurm_expected_hosts(dict(env, SLURM_DISTRIBUTION="cyclic"), 6) == {}
    assert "ranks_per_node" not in aiv.slurm_expectations(dict(env, SLURM_TASKS_PER_NODE="3,2,1"))


def test_safe_env_allow_list_never_leaks_secrets():
    env = {"NCCL_DEBUG": "WARN", "HF_TOKEN": "hf_abc", "AWS_SECRET_ACCESS_KEY": "s3cr3t", "DB_PASSWORD": "pw",
           "NCCL_SECRET_PASSWORD": "x", "MASTER_ADDR": "n1", "HOME": "/root", "SLURM_JOB_ID": "4"}
    out = aiv.safe_env(env)
    assert out == {"NCCL_DEBUG": "WARN", "MASTER_ADDR": "n1", "SLURM_JOB_ID": "4"}


def test_step_layout_wins_and_uneven_layout_sets_no_ranks_per_node():
    job = {"SLURM_NTASKS": "16", "SLURM_JOB_NUM_NODES": "2", "SLURM_NTASKS_PER_NODE": "8",
           "SLURM_TASKS_PER_NODE": "8(x2)"}
    assert aiv.slurm_expectations(job) == {"world_size": 16, "nodes": 2, "ranks_per_node": 8}
    step = dict(job, SLURM_STEP_NUM_TASKS="3", SLURM_STEP_NUM_NODES="2", SLURM_STEP_TASKS_PER_NODE="2,1")
    assert aiv.slurm_expectations(step) == {"world_size": 3, "nodes": 2}


@pytest.mark.parametrize("env, want", [
    ({"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "8", "OMPI_COMM_WORLD_LOCAL_RANK": "3",
      "MASTER_ADDR": "n1", "MASTER_PORT": "29500"}, (3, 8, 3)),
    ({"PMI_RANK": "1", "PMI_SIZE": "2", "MPI_LOCALRANKID": "0", "MASTER_ADDR": "n1", "MASTER_PORT": "29500"},
     (1, 2, 0)),
    ({"PMIX_RANK": "5", "OMPI_COMM_WORLD_SIZE": "6", "OMPI_COMM_WORLD_LOCAL_RANK": "1", "MASTER_ADDR": "n1",
      "MASTER_PORT": "29500"}, (5, 6, 1)),
])
def test_an_mpi_launch_is_read(env, want):
    c = aiv.read_contract(env)
    assert (c["rank"], c["world_size"], c["local_rank"]) == want and c["source"] == "mpi"


@pytest.mark.parametrize("env, words", [
    ({"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_RANK": "0"},
     "under an MPI launcher (OMPI_COMM_WORLD_RANK is set) export MASTER_ADDR"),
    ({"PMIX_RANK": "0"}, "the MPI launcher set PMIX_RANK but not WORLD_SIZE"),
])
def test_an_incomplete_mpi_launch_is_one_line_never_a_local_run(env, words):
    """Before: an MPI launch without RANK silently ran a local job of its own on every rank and passed."""
    with pytest.raises(aiv.UsageError, match=re.escape(words)):
        aiv.read_contract(env)


def test_a_srun_pmix_launch_reads_slurms_own_names_first():
    env = {"SLURM_PROCID": "2", "SLURM_NTASKS": "4", "SLURM_LOCALID": "0", "PMIX_RANK": "9",
           "MASTER_ADDR": "n1", "MASTER_PORT": "29500", "SLURM_STEP_ID": "0", "SLURM_JOB_ID": "7"}
    c = aiv.read_contract(env)
    assert c["rank"] == 2 and c["source"] == "slurm"
