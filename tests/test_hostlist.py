"""Slurm hostlist expansion, compression and rank ranges (examples and properties)."""
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import aiv


@pytest.mark.parametrize("text,hosts", [
    ("node1", ["node1"]),
    ("node[1-3]", ["node1", "node2", "node3"]),
    ("node[001-003,7]", ["node001", "node002", "node003", "node7"]),
    ("gpu-a[1-2],login-2", ["gpu-a1", "gpu-a2", "login-2"]),
    ("r1-n[08-10]", ["r1-n08", "r1-n09", "r1-n10"]),
    ("rack[1-2]-n[1-2]", ["rack1-n1", "rack1-n2", "rack2-n1", "rack2-n2"]),
    ("a[1,3],b[5-6]", ["a1", "a3", "b5", "b6"]),
])
def test_expand(text, hosts):
    assert aiv.expand_hostlist(text) == hosts


@pytest.mark.parametrize("text", ["", "node[", "node[1-", "node]1[", "n[3-1]", "n[a-b]", "n[1-2", ","])
def test_expand_rejects_garbage(text):
    with pytest.raises(ValueError):
        aiv.expand_hostlist(text)


@given(st.text(alphabet="ab12-[],0 ", max_size=30))
@settings(max_examples=400, deadline=None)
def test_expand_any_input_gives_hosts_or_valueerror(text):
    try:
        out = aiv.expand_hostlist(text)
    except ValueError:
        return
    assert out and all(isinstance(h, str) for h in out)


names = st.lists(st.tuples(st.sampled_from(["node", "gpu-a", "r1-n", "x"]), st.integers(0, 300)),
                 min_size=1, max_size=40, unique=True)


@given(names, st.booleans())
@settings(max_examples=300, deadline=None)
def test_compress_then_expand_roundtrip(pairs, padded):
    hosts = [f"{p}{str(n).zfill(3) if padded else n}" for p, n in pairs]
    assert sorted(aiv.expand_hostlist(aiv.compress_hostlist(hosts))) == sorted(set(hosts))


@given(st.lists(st.integers(0, 5000), max_size=60))
def test_ranges_roundtrip(nums):
    if nums:
        assert aiv.parse_ranges(aiv.format_ranges(nums)) == sorted(set(nums))


@pytest.mark.parametrize("text,counts", [("2(x3),1", [2, 2, 2, 1]), ("8", [8]), ("4(x2)", [4, 4])])
def test_tasks_per_node(text, counts):
    assert aiv.parse_tasks_per_node(text) == counts


@given(st.text(max_size=20))
def test_tasks_per_node_never_crashes(text):
    try:
        aiv.parse_tasks_per_node(text)
    except ValueError:
        pass


@given(st.dictionaries(st.sampled_from(["RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT",
                                        "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_JOB_ID",
                                        "SLURM_JOB_NODELIST", "SLURM_STEP_ID"]),
                       st.one_of(st.text(max_size=12), st.integers(-5, 70000).map(str)), max_size=11))
@settings(max_examples=600, deadline=None)
def test_contract_any_input_gives_contract_or_usage_error(env):
    try:
        c = aiv.read_contract(env)
    except aiv.UsageError as e:
        assert str(e)
        return
    if c is not None:
        assert 0 <= c["rank"] < c["world_size"] and 1 <= c["master_port"] <= 65535
        assert 0 <= c["local_rank"] <= c["rank"]
