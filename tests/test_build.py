"""The house: the source in aiv/, one module per concern, built by tools/build.py into the one shipped
file. These tests hold the rules that keep it a house: the shipped file is what aiv/ builds, no import
runs back up the build order, the pure layer never touches the runtime, one name has one definition."""
import ast
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BUILD = ROOT / "tools" / "build.py"
sys.path.insert(0, str(ROOT / "tools"))
import build  # noqa: E402


def run_build(*args):
    return subprocess.run([sys.executable, str(BUILD), *map(str, args)], capture_output=True, text=True, timeout=60)


def run_check(src, tmp_path):
    """`tools/build.py --check --src SRC` as its main() runs it, in this process (no python to start, and the
    modules a test left as they are not parsed again): its exit code and what it said on stderr."""
    import contextlib
    import io
    before, err = build.SRC, io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            rc = build.main(["--check", "--src", str(src), "--output", str(tmp_path / "out.py")])
    finally:
        build.use_source(before)
    return subprocess.CompletedProcess([str(BUILD), "--check", "--src", str(src)], rc, "", err.getvalue())


def test_a_bad_source_fails_the_command_line_build_with_its_reason_on_stderr(tmp_path):
    """The command line itself (the other tests run its main() in process): exit 1, the reason on stderr."""
    src = _copy_source(tmp_path)
    _prepend_import(src / "checks" / "judge.py", "import subprocess")
    r = run_build("--check", "--src", src, "--output", tmp_path / "out.py")
    assert r.returncode == 1 and "the judge/report module checks/judge imports" in r.stderr, r.stderr
    assert (r.returncode, r.stderr) == (lambda c: (c.returncode, c.stderr))(run_check(src, tmp_path))


def test_order_lists_every_module_once_and_each_exists():
    r = run_build("--order")
    assert r.returncode == 0, r.stderr
    paths = r.stdout.split()
    assert len(paths) == len(set(paths)) >= 12
    assert paths[0] == "aiv/core/base.py" and paths[-1] == "aiv/main.py"
    assert sorted(paths) == sorted(f"aiv/{p.relative_to(ROOT / 'aiv').as_posix()}"
                                   for p in (ROOT / "aiv").rglob("*.py") if p.name != "__init__.py")


def test_every_module_is_at_most_900_lines():
    long = {p.relative_to(ROOT).as_posix(): n for p in (ROOT / "aiv").rglob("*.py")
            if (n := len(p.read_text().splitlines())) > 900}
    assert not long, f"modules over 900 lines: {long}"


def test_the_shipped_file_is_what_aiv_builds():
    r = run_build("--check")
    assert r.returncode == 0, r.stderr


def test_the_shipped_file_says_it_is_generated_in_its_first_lines():
    head = (ROOT / "ddp_mesh_ping.py").read_text().splitlines()[:4]
    assert head[0].startswith("#!")
    assert any("GENERATED" in ln and "aiv/" in ln and "do not edit" in ln for ln in head), head


def test_check_fails_after_a_one_line_hand_edit(tmp_path):
    edited = tmp_path / "ddp_mesh_ping.py"
    lines = (ROOT / "ddp_mesh_ping.py").read_text().splitlines(keepends=True)
    i = next(i for i, ln in enumerate(lines) if ln.startswith("SUCCESS_LINE"))
    lines[i] = lines[i].replace("Complete!", "Complete")
    edited.write_text("".join(lines))
    r = run_build("--check", "--output", edited)
    assert r.returncode == 1
    assert "differs from what aiv/ builds" in r.stderr and "Complete" in r.stderr


def _copy_source(tmp_path):
    src = tmp_path / "aiv"
    shutil.copytree(ROOT / "aiv", src)
    return src


def _prepend_import(path, line):
    text = path.read_text()
    doc_end = text.index('"""', 3) + 3
    path.write_text(text[:doc_end] + "\n" + line + "\n" + text[doc_end:])


@pytest.mark.parametrize("module, line, words", [
    ("checks/judge", "from ..run.coordinator import Coordinator", "comes after checks/judge"),
    ("core/deadlines", "from .deadlines import deadlines", "comes at core/deadlines"),
    ("screen/measure", "from ..main import main", "comes after screen/measure"),
    ("screen/gpu", "from .judge import judge_pairs", "comes after screen/gpu"),  # screen/judge, not checks/judge
])
def test_an_import_that_runs_back_up_fails_the_build(tmp_path, module, line, words):
    src = _copy_source(tmp_path)
    _prepend_import(src / f"{module}.py", line)
    r = run_check(src, tmp_path)
    assert r.returncode == 1
    assert f"aiv/{module}.py" in r.stderr and words in r.stderr, r.stderr


@pytest.mark.parametrize("module, line", [
    ("checks/judge", "import subprocess"), ("out/render", "import threading"), ("out/outputs", "import socket"),
    ("checks/manifest", "import fcntl"), ("checks/numerics", "import ctypes"), ("screen/gpu", "import torch"),
    ("core/blame", "from concurrent import futures"),
])
def test_a_judge_or_report_module_that_imports_an_effect_fails_the_build(tmp_path, module, line):
    """The judge and report modules are effect-free: no process, thread, socket, lock, native call or torch."""
    src = _copy_source(tmp_path)
    _prepend_import(src / f"{module}.py", line)
    r = run_check(src, tmp_path)
    assert r.returncode == 1
    assert f"the judge/report module {module} imports" in r.stderr, r.stderr
    assert set(build.EFFECT_FREE) <= set(build.PURE)


def _check(src, tmp_path):
    """build.py --check's problems with the copy `src` of aiv/, in this process (use_source)."""
    before = build.SRC
    build.use_source(src)
    try:
        found = build.problems()
    finally:
        build.use_source(before)
    assert found, f"{src}: the build found nothing wrong"
    return "\n".join(found)


def _append(path, text):
    with open(path, "a") as f:
        f.write("\n\n" + text)


@pytest.mark.parametrize("module, text, words", [
    ("out/page", "def _open(path):\n    import os\n    return os.system(f'xdg-open {path}')\n", "calls os.system"),
    ("out/render", "def _pager(text):\n    import os\n    return os.popen('less', 'w')\n", "calls os.popen"),
    ("checks/judge", "def _split():\n    import os\n    return os.fork()\n", "calls os.fork"),
    ("checks/hang", "def _stop(pid):\n    import os\n    os.kill(pid, 9)\n", "calls os.kill"),
    ("checks/hang", "def _stop(pgid):\n    import os\n    os.killpg(pgid, 9)\n", "calls os.killpg"),
    ("screen/judge", "def _again(argv):\n    import os\n    os.execvp(argv[0], argv)\n", "calls os.execvp"),
    ("screen/gpu", "def _smi():\n    import os\n    return os.spawnlp(0, 'nvidia-smi', 'nvidia-smi')\n",
     "calls os.spawnlp"),
    ("node/judge", "def _smi():\n    import os\n    return os.posix_spawn('/bin/true', ['true'], {})\n",
     "calls os.posix_spawn"),
    ("out/outputs", "def _run():\n    import os as o\n    return o.system('true')\n", "calls os.system"),
    ("screen/loop", "def _run():\n    from os import system\n    return system('true')\n", "imports os.system"),
    ("checks/manifest", "def _load(name):\n    import importlib\n    return importlib.import_module(name)\n",
     "imports importlib"),
    ("screen/soak", "def _load(name):\n    return __import__(name)\n", "uses __import__"),
    ("out/verify_log", "def _load():\n    return __builtins__.__import__('subprocess')\n", "uses __import__"),
    ("node/report", "def _run(code):\n    exec(code)\n", "uses exec"),
])
def test_a_judge_or_report_module_that_acts_through_a_bypass_fails_the_build(tmp_path, module, text, words):
    """Not only imports of subprocess and friends: os's own process calls, an import by name at run time,
    code run by name. Each is refused in an effect-free module, at any depth of its text."""
    src = _copy_source(tmp_path)
    _append(src / f"{module}.py", text)
    err = _check(src, tmp_path)
    assert f"aiv/{module}.py" in err and f"the judge/report module {module} {words}" in err, err


@pytest.mark.parametrize("module, line, chain, effect", [
    # a judge that imports a collector: the names it needs live in core/names.py
    ("checks/judge", "from ..checks.collect import pci_link", "checks/judge -> checks/collect",
     "aiv/checks/collect.py:"),
    # two modules deep: options is no effect, but it imports the launch contract, which imports socket
    ("out/outputs", "from ..launch.options import DRAIN_MODES", "out/outputs -> launch/options -> launch/contract",
     "imports socket"),
    ("out/verify_log", "from ..core.speak import emit", "out/verify_log -> core/speak", "imports threading"),
    ("screen/gpu", "from ..screen.measure import SMI_FIELDS", "screen/gpu -> screen/measure", "imports "),
    ("checks/numerics", "from ..checks.numerics_measure import NUMERICS_SHAPE",
     "checks/numerics -> checks/numerics_measure", "imports ctypes"),
])
def test_an_effect_reached_through_another_module_fails_the_build(tmp_path, module, line, chain, effect):
    """The rule is transitive over the import graph: the chain of imports that reaches the effect is named."""
    src = _copy_source(tmp_path)
    _prepend_import(src / f"{module}.py", line)
    err = _check(src, tmp_path)
    said = [ln for ln in err.splitlines() if f"the judge/report module {module} reaches an effect through {chain}:"
            in ln]
    assert said and effect in said[0], err


@pytest.mark.parametrize("module, line", [
    ("core/base", "import threading"), ("core/deadlines", "import threading"),
    ("core/names", "import subprocess"), ("core/blame", "import signal"),
])
def test_an_effect_in_the_floor_under_the_judges_fails_the_build_for_every_judge(tmp_path, module, line):
    """The floor every judge stands on (base, names, deadlines, blame) is effect-free too: an effect there is
    refused where it is, and in each judge that reaches it."""
    src = _copy_source(tmp_path)
    _prepend_import(src / f"{module}.py", line)
    err = _check(src, tmp_path)
    assert f"the judge/report module {module} {line.replace('import', 'imports', 1)}" in err, err
    assert "the judge/report module checks/judge reaches an effect through checks/judge -> " in err, err


def test_a_method_defined_twice_in_a_class_fails_the_build(tmp_path):
    """The later of two methods of one name silently replaces the first for every caller."""
    src = _copy_source(tmp_path)
    path = src / "core" / "speak.py"
    text = path.read_text()
    path.write_text(text.replace("    def code(self):", "    def snapshot(self):\n        return []\n\n"
                                 "    def code(self):", 1))
    err = _check(src, tmp_path)
    assert "aiv/core/speak.py" in err and "class Findings defines snapshot again" in err, err


def test_a_class_over_300_lines_fails_the_build(tmp_path):
    """A class longer than MAX_CLASS_LINES holds more than one concern: the build names it, its file and its
    length; one of exactly 300 lines passes."""
    src = _copy_source(tmp_path)
    _append(src / "out" / "page.py", "class _Long:\n" + "".join(f"    a{i} = {i}\n" for i in range(300)))
    _append(src / "out" / "render.py", "class _Fits:\n" + "".join(f"    a{i} = {i}\n" for i in range(299)))
    err = _check(src, tmp_path)
    assert build.MAX_CLASS_LINES == 300
    assert "aiv/out/page.py:" in err and "class _Long is 301 lines, over the 300" in err, err
    assert "_Fits" not in err, err
    r = run_check(src, tmp_path)
    assert r.returncode == 1 and "class _Long is 301 lines" in r.stderr, r.stderr


def test_a_property_and_its_setter_are_one_method(tmp_path):
    src = _copy_source(tmp_path)
    _append(src / "out" / "page.py", "class _Box:\n    @property\n    def size(self):\n        return 1\n\n"
            "    @size.setter\n    def size(self, v):\n        pass\n")
    before = build.SRC
    build.use_source(src)
    try:
        assert build.problems() == []
    finally:
        build.use_source(before)


def test_the_judges_import_no_effect_in_a_fresh_interpreter():
    """What the build's rule says, as Python sees it: importing every effect-free module loads no module that
    acts on the world (before: `import aiv.judge` loaded subprocess, threading, socket and ctypes)."""
    mods = ", ".join("aiv." + m.replace("/", ".") for m in build.EFFECT_FREE)
    code = ("import sys\n"
            f"sys.path.insert(0, {str(ROOT)!r})\n"
            "before = set(sys.modules)\n"
            f"import {mods}\n"
            "loaded = set(sys.modules) - before\n"
            "print(sorted(m for m in set(sys.modules) if m.split('.')[0] in ('subprocess', 'threading', 'socket', "
            "'ctypes')))\n"
            f"print(sorted(m for m in loaded if m.split('.')[0] in {tuple(build.EFFECTS)!r}))\n"
            "print(len([m for m in loaded if m.startswith('aiv.')]))\n")
    r = subprocess.run([sys.executable, "-I", "-S", "-B", "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    anywhere, loaded, ours = r.stdout.split("\n")[:3]
    assert anywhere == "[]" and loaded == "[]", r.stdout
    assert int(ours) >= len(build.EFFECT_FREE)


def test_an_imported_name_the_module_does_not_define_fails_the_build(tmp_path):
    """A function moved to another room: every `from .x import y` must name a y that x defines."""
    src = _copy_source(tmp_path)
    _prepend_import(src / "out" / "render.py", "from ..checks.judge import judge_gpu_perf")
    r = run_check(src, tmp_path)
    assert r.returncode == 1 and "imports judge_gpu_perf from ..checks.judge, which does not define it" in r.stderr, \
        r.stderr


def test_the_pure_layer_never_imports_the_runtime():
    """Judges, render, manifest, page and verify-log import nothing of store, rank, coordinator, follower,
    local: a judge is a function of plain data."""
    for name in build.PURE:
        tree = ast.parse((ROOT / "aiv" / f"{name}.py").read_text())
        for mod, _, line in build.relative_imports(tree, name):
            assert mod not in build.RUNTIME, f"aiv/{name}.py:{line} imports the runtime module {mod}"
    assert {"checks/judge", "out/render", "checks/manifest", "out/page", "out/verify_log",
            "screen/judge"} <= set(build.PURE)
    assert {"run/store", "run/rank", "run/coordinator", "run/follower", "launch/local"} <= set(build.RUNTIME)


def test_two_definitions_of_one_name_fail_the_build(tmp_path):
    src = _copy_source(tmp_path)
    with open(src / "out" / "page.py", "a") as f:
        f.write("\n\ndef render_report(*a):\n    return ''\n")
    r = run_check(src, tmp_path)
    assert r.returncode == 1
    assert "defines render_report, already defined in aiv/out/render.py" in r.stderr, r.stderr


def test_a_function_defined_twice_in_one_module_fails_the_build(tmp_path):
    """Two helpers of one name in one room: the later silently replaced the first for every caller."""
    src = _copy_source(tmp_path)
    with open(src / "out" / "page.py", "a") as f:
        f.write("\n\ndef _html_chart(*a):\n    return ''\n")
    r = run_check(src, tmp_path)
    assert r.returncode == 1 and "aiv/out/page.py" in r.stderr and "defines _html_chart again" in r.stderr, r.stderr


def test_a_module_missing_from_the_order_fails_the_build(tmp_path):
    src = _copy_source(tmp_path)
    (src / "stray.py").write_text('"""stray"""\nX = 1\n')
    r = run_check(src, tmp_path)
    assert r.returncode == 1 and "aiv/stray.py is not in BUILD_ORDER" in r.stderr


def test_a_module_in_a_room_missing_from_the_order_fails_the_build(tmp_path):
    src = _copy_source(tmp_path)
    (src / "screen" / "stray.py").write_text('"""stray"""\nX = 1\n')
    r = run_check(src, tmp_path)
    assert r.returncode == 1 and "aiv/screen/stray.py is not in BUILD_ORDER" in r.stderr, r.stderr


@pytest.mark.parametrize("init, words", [
    (None, "aiv/out/__init__.py is missing"),
    ('"""the words"""\nfrom .render import render_report\n', "aiv/out/__init__.py: a room's __init__.py holds its "
                                                               "docstring only"),
])
def test_a_room_holds_its_docstring_only(tmp_path, init, words):
    """The build drops a room's __init__.py: an import or a definition there would be lost from the shipped file."""
    src = _copy_source(tmp_path)
    if init is None:
        (src / "out" / "__init__.py").unlink()
    else:
        (src / "out" / "__init__.py").write_text(init)
    r = run_check(src, tmp_path)
    assert r.returncode == 1 and words in r.stderr, r.stderr


@pytest.mark.parametrize("line", ["from . import judge", "from ...aiv.core.base import finding",
                                  "from ..nowhere.base import finding"])
def test_a_relative_import_that_names_no_module_of_the_order_fails_the_build(tmp_path, line):
    src = _copy_source(tmp_path)
    _prepend_import(src / "screen" / "gpu.py", line)
    r = run_check(src, tmp_path)
    assert r.returncode == 1 and "aiv/screen/gpu.py" in r.stderr and "not a module of BUILD_ORDER" in r.stderr, r.stderr


def test_aiv_imports_as_a_package_without_the_runtime_pulling_torch():
    """Each module names what it uses from the modules before it, so aiv/ imports as a package; the pure
    layer and the side channel import without torch (torch is imported lazily where a rank needs it)."""
    code = ("import sys; sys.modules['torch'] = None\n"
            "import aiv.main, aiv.out.verify_log, aiv.checks.manifest, aiv.run.liveness\n"
            "assert aiv.main.main is not None\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr


def test_built_file_defines_what_each_module_defines():
    built = ast.parse((ROOT / "ddp_mesh_ping.py").read_text())
    names = {n for n, _ in build.top_names(built)}
    for name in build.BUILD_ORDER:
        tree = ast.parse((ROOT / "aiv" / f"{name}.py").read_text())
        missing = {n for n, _ in build.top_names(tree)} - names
        assert not missing, f"aiv/{name}.py: {missing} not in the built file"


def _cells(page, code=True):
    """The cells of a page's table rows; code=True: without their code quotes (`aiv/x.py` -> aiv/x.py)."""
    return [[c.strip().strip("`" if code else "") for c in ln.split("|")[1:-1]]
            for ln in page.read_text().splitlines() if ln.startswith("| ")]


def test_the_development_page_lists_every_module_in_build_order():
    rows = [c[1] for c in _cells(ROOT / "docs" / "development.md") if len(c) > 2 and c[1].startswith("aiv/")]
    assert rows == [f"aiv/{m}.py" for m in build.BUILD_ORDER]


def test_the_pages_list_every_room():
    """development.md's table of rooms and design.md's map name each folder of aiv/ once, and no other; the
    map names every module of its room."""
    import re
    rooms = sorted(p.name for p in (ROOT / "aiv").iterdir() if p.is_dir() and (p / "__init__.py").exists())
    assert len(rooms) >= 5
    said = [c[0] for c in _cells(ROOT / "docs" / "development.md") if c[0].startswith("aiv/") and c[0].endswith("/")]
    assert sorted(said) == [f"aiv/{r}/" for r in rooms]
    mapped = {c[0].strip("`"): c[2] for c in _cells(ROOT / "docs" / "design.md", code=False)
              if len(c) == 3 and c[0].endswith("/`")}
    assert sorted(mapped) == [f"{r}/" for r in rooms]
    for room, cell in mapped.items():
        have = {m.split("/")[1] for m in build.BUILD_ORDER if m.startswith(room)}
        assert have <= set(re.findall(r"`(\w+)`", cell)), (room, have - set(re.findall(r"`(\w+)`", cell)))


@pytest.mark.parametrize("module, text", [
    ("run/guard", "def _quiet():\n    import os\n    os.environ['NCCL_DEBUG'] = 'WARN'\n"),
    ("run/setup", "def _later():\n    import os\n    os.environ.setdefault('X', '1')\n"),
    ("out/drain", "def _gone():\n    import os\n    del os.environ['X']\n"),
    ("launch/local", "import os\nos.putenv('X', '1')\n")])
def test_a_write_to_the_process_environment_outside_its_one_place_fails_the_build(tmp_path, module, text):
    """The process environment is written in ENV_WRITERS only: once, as a rank starts, before its first thread
    (glibc's setenv may free the array another thread's getenv reads: a SIGSEGV of that rank, then a node named
    for the tool's own fault). Any other write, in any module, fails the build, naming where; the two writers
    pass."""
    src = _copy_source(tmp_path)
    _append(src / f"{module}.py", text)
    err = _check(src, tmp_path)
    assert f"aiv/{module}.py:" in err and "writes this process's environment: only run/background.capture, " \
        "run/setup.own_environment do" in err, err
    assert "own_environment writes" not in err and "capture writes" not in err, err
