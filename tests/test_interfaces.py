"""NCCL_SOCKET_IFNAME / GLOO_SOCKET_IFNAME matching follows each variable's own syntax."""
import socket

import pytest

from conftest import aiv

NAMES = ["lo", "eth0", "eth1", "ens5f0", "docker0", "ib0"]


@pytest.mark.parametrize("spec,selected", [
    ("eth", ["eth0", "eth1"]),                 # prefixes
    ("eth0", ["eth0"]),
    ("=eth", []),                              # '=': exact names only
    ("=eth1", ["eth1"]),
    ("^docker,lo", ["eth0", "eth1", "ens5f0", "ib0"]),   # '^': exclude prefixes
    ("^=eth0", ["lo", "eth1", "ens5f0", "docker0", "ib0"]),
    ("ens,ib", ["ens5f0", "ib0"]),
    ("eth9", []),
])
def test_nccl_selection(spec, selected):
    assert aiv.nccl_ifname_select(spec, NAMES) == selected


def test_gloo_needs_exact_names():
    assert aiv.gloo_ifname_select("eth0,ib0", set(NAMES)) == (["eth0", "ib0"], [])
    assert aiv.gloo_ifname_select("eth", set(NAMES)) == ([], ["eth"])      # no prefix matching in gloo


IFACES = {"lo": {"up": True, "addrs": ["127.0.0.1"]}, "eth0": {"up": True, "addrs": ["10.0.0.5"]},
          "eth1": {"up": False, "addrs": ["10.1.0.5"]}, "eth2": {"up": True, "addrs": []}}


def test_check_passes_with_usable_interface():
    out = aiv.check_interfaces({"NCCL_SOCKET_IFNAME": "eth", "GLOO_SOCKET_IFNAME": "eth0"}, IFACES, "n1")
    assert [f["status"] for f in out] == ["PASS", "PASS"]


@pytest.mark.parametrize("var,val,needle", [
    ("NCCL_SOCKET_IFNAME", "eth9", "matches no interface"),
    ("NCCL_SOCKET_IFNAME", "=eth1", "none is up with an address"),      # down
    ("NCCL_SOCKET_IFNAME", "eth2", "none is up with an address"),       # no address
    ("GLOO_SOCKET_IFNAME", "eth9", "eth9 is absent, down or has no address"),
    ("GLOO_SOCKET_IFNAME", "eth0,eth1", "eth1 is absent, down"),        # gloo needs every one
])
def test_check_fails_naming_variable_value_host_and_what_exists(var, val, needle):
    (f,) = aiv.check_interfaces({var: val}, IFACES, "gpu-n07")
    assert f["status"] == "FAIL" and f["check"] == "interface"
    assert var in f["reason"] and val in f["reason"] and "gpu-n07" in f["reason"] and needle in f["reason"]
    assert "eth0(up:10.0.0.5)" in f["reason"]      # lists the interfaces that do exist
    assert f["hosts"] == ["gpu-n07"]


def test_unset_variables_are_not_checked():
    assert aiv.check_interfaces({}, IFACES, "n1") == []


def test_real_interfaces_of_this_host():
    ifaces = aiv.list_interfaces()
    assert "lo" in ifaces and "127.0.0.1" in ifaces["lo"]["addrs"] and ifaces["lo"]["up"]
    assert set(ifaces) == {n for _, n in socket.if_nameindex()}
