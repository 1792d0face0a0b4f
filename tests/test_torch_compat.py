"""docs/install.md's table of what each torch gives (Supported torch) against the torch these tests run on:
every row's probe (tests/torch_probes.py) agrees with the columns it can be held to (a version at or below
this one that has it, at or above this one that lacks it: what torch added stays), every fallback the table
names is in the code, and the floor it states is TORCH_FLOOR. bench/torch_compat.sh runs this file on each
version of the table."""
import re

import pytest
from torch_probes import PROBES, torch_version

from conftest import ROOT, aiv

INSTALL = ROOT / "docs" / "install.md"


def version(text):
    return tuple(int(x) for x in re.findall(r"\d+", text)[:3])


def table():
    """(the versions of the header, {first cell: [cells]}) of the table in '## Supported torch'."""
    text = INSTALL.read_text().split("\n## Supported torch\n", 1)[1].split("\n## ", 1)[0]
    rows = [[c.strip() for c in ln.strip()[1:-1].split("|")] for ln in text.splitlines() if ln.startswith("| ")]
    head, body = rows[0], rows[1:]
    return [version(h) for h in head[1:-1]], {r[0]: r[1:] for r in body}


def test_every_row_has_a_probe_and_every_probe_a_row():
    _, rows = table()
    assert sorted(rows) == sorted(PROBES)


@pytest.mark.parametrize("what", sorted(PROBES))
def test_the_row_is_what_this_torch_gives(what):
    versions, rows = table()
    here, has = version(torch_version()), PROBES[what]()
    if has is None:
        pytest.skip(f"{what}: does not apply to torch {torch_version()}")
    for v, cell in zip(versions, rows[what][:-1], strict=True):
        if cell.startswith("yes") and v <= here:
            assert has, f"{what}: the table says torch {v} has it, torch {torch_version()} does not"
        if cell.startswith("no") and v >= here:
            assert not has, f"{what}: the table says torch {v} lacks it, torch {torch_version()} has it"


def test_every_fallback_the_table_names_is_in_the_code():
    _, rows = table()
    for what, cells in rows.items():
        names = re.findall(r"\(`([A-Za-z_.]+)`[;)]", cells[-1])
        assert names or cells[-1] == "-", f"{what}: its fallback names no function"
        for name in names:
            obj = aiv
            for part in name.split("."):
                obj = getattr(obj, part, None)
            assert callable(obj), f"{what}: {name} is not in ddp_mesh_ping.py"


def test_the_floor_the_page_states_is_the_codes():
    floor = ".".join(map(str, aiv.TORCH_FLOOR))
    text = " ".join(INSTALL.read_text().split())
    assert f"**Supported torch: {floor} or newer**" in text and f"older than the oldest supported {floor}" in text
    versions, _ = table()
    assert versions[0][:2] == aiv.TORCH_FLOOR  # the table's first column is the floor
    assert aiv.torch_floor_problem(".".join(map(str, versions[0]))) is None
    below = f"{aiv.TORCH_FLOOR[0]}.{aiv.TORCH_FLOOR[1] - 1}.0"
    assert aiv.torch_floor_problem(below) == f"torch {below} is older than the oldest supported {floor}"
