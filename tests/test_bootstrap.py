"""Tests of bootstrap_env.sh: the real script, run as a subprocess, builds real venvs.

No package index is contacted: the tests write a wheelhouse of tiny stand-in packages named torch,
torchvision, torchaudio, psutil and numpy (each with a __version__; one broken torchaudio whose
import raises), and run the script with FIND_LINKS=<wheelhouse>, EXTRA_PIP_ARGS=--no-index and
specs pinned to those versions.  The machine's own pip configuration is switched off
(PIP_CONFIG_FILE=/dev/null, no PIP_* variables) so only the wheelhouse is seen.

    python -m pytest -q tests/test_bootstrap.py
"""

import base64
import hashlib
import os
import re
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "bootstrap_env.sh"
RUN_TIMEOUT = 240

KNOBS = ("PYTORCH_ENV", "PYTHON", "TORCH_SPEC", "TORCHVISION_SPEC", "TORCHAUDIO_SPEC", "PSUTIL_SPEC",
         "NUMPY_SPEC", "INDEX_URL", "EXTRA_INDEX_URL", "FIND_LINKS", "EXTRA_PIP_ARGS", "UPGRADE_PIP",
         "TORCH_BUILD", "INDEX_RETRIES", "INDEX_TIMEOUT", "INDEX_FALLBACK", "PYTHONPATH", "PYTHONHOME",
         "VIRTUAL_ENV")

TORCH_INIT = '''\
__version__ = "1.0.0+cpu"


class version:
    cuda = "12.8"
    hip = None


class cuda:
    @staticmethod
    def is_available():
        return False

    @staticmethod
    def device_count():
        return 0
'''

BROKEN_TORCHAUDIO_INIT = '''\
raise OSError("libtorchaudio.so: cannot load the extension\\n"
              "undefined symbol: _ZN3c1017fake_symbol_for_testsEv")
'''

# a torchaudio whose compiled extension says CUDA 13.2, as the real one registers torch.ops._torchaudio
TORCHAUDIO_CUDA_13_2 = '''\
__version__ = "1.0.3"
import torch


class _torchaudio:
    @staticmethod
    def cuda_version():
        return 13020


torch.ops = type("ops", (), {"_torchaudio": _torchaudio})
'''

# (distribution, wheel version, files, Requires-Dist)
FAKES = [
    ("torch", "1.0.0+cpu", {"torch/__init__.py": TORCH_INIT}, []),
    ("torchvision", "1.0.0", {"torchvision/__init__.py": '__version__ = "1.0.0"\nimport torch\n'}, ["torch"]),
    ("torchaudio", "1.0.0", {"torchaudio/__init__.py": '__version__ = "1.0.0"\nimport torch\n'}, ["torch"]),
    ("torchaudio", "1.0.1", {"torchaudio/__init__.py": BROKEN_TORCHAUDIO_INIT}, ["torch"]),
    ("psutil", "1.0.0", {"psutil/__init__.py": '__version__ = "1.0.0"\n'}, []),
    ("numpy", "1.0.0", {"numpy/__init__.py": '__version__ = "1.0.0"\n'}, []),
    ("numpy", "1.0.1", {"numpy/__init__.py": '__version__ = "1.0.1"\n'}, []),
]

SPECS = {
    "TORCH_SPEC": "torch==1.0.0",
    "TORCHVISION_SPEC": "torchvision==1.0.0",
    "TORCHAUDIO_SPEC": "torchaudio==1.0.0",
    "PSUTIL_SPEC": "psutil==1.0.0",
    "NUMPY_SPEC": "numpy==1.0.0",
}

EXPECTED_VERSIONS = ["torch 1.0.0+cpu", "torchvision 1.0.0", "torchaudio 1.0.0", "psutil 1.0.0", "numpy 1.0.0"]


def write_wheel(wheelhouse, name, version, files, requires):
    """A pure-Python wheel written directly as a zip (no build backend, no network)."""
    distinfo = f"{name}-{version}.dist-info"
    contents = dict(files)
    contents[f"{distinfo}/METADATA"] = (
        f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
        + "".join(f"Requires-Dist: {r}\n" for r in requires))
    contents[f"{distinfo}/WHEEL"] = "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
    record = []
    for path, text in contents.items():
        data = text.encode()
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        record.append(f"{path},sha256={digest},{len(data)}")
    record.append(f"{distinfo}/RECORD,,")
    contents[f"{distinfo}/RECORD"] = "\n".join(record) + "\n"
    with zipfile.ZipFile(wheelhouse / f"{name}-{version}-py3-none-any.whl", "w") as zf:
        for path, text in contents.items():
            zf.writestr(path, text)


def venv_capable_python():
    """A python3 whose `-m venv` works: the system one first, then PATH's, then this one."""
    for cand in ("/usr/bin/python3", shutil.which("python3"), sys.executable):
        if cand and os.access(cand, os.X_OK):
            r = subprocess.run([cand, "-c", "import venv, ensurepip"], capture_output=True)
            if r.returncode == 0:
                return cand
    return None


@pytest.fixture(scope="module")
def wheelhouse(tmp_path_factory):
    d = tmp_path_factory.mktemp("wheelhouse")
    for name, version, files, requires in FAKES:
        write_wheel(d, name, version, files, requires)
    return d


@pytest.fixture(scope="module")
def base_env(wheelhouse):
    py = venv_capable_python()
    if py is None:
        pytest.skip("no python3 with the venv and ensurepip modules here")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_") and k not in KNOBS}
    env.update(SPECS)
    env.update(PYTHON=py, FIND_LINKS=str(wheelhouse), EXTRA_PIP_ARGS="--no-index",
               PIP_CONFIG_FILE=os.devnull, PIP_NO_INPUT="1")
    return env


def run(env, *args, script=SCRIPT, prefix=(), cwd=None, **overrides):
    """Run the script with env plus overrides (None removes a variable); the result gets .elapsed."""
    e = dict(env)
    for k, v in overrides.items():
        if v is None:
            e.pop(k, None)
        else:
            e[k] = v
    t0 = time.monotonic()
    r = subprocess.run([*prefix, "bash", str(script), *args], env=e, cwd=cwd or REPO,
                       capture_output=True, text=True, timeout=RUN_TIMEOUT)
    r.elapsed = time.monotonic() - t0
    return r


def show(r):
    return f"rc={r.returncode} ({r.elapsed:.1f} s)\n--- stdout\n{r.stdout}\n--- stderr\n{r.stderr}"


def error_lines(r):
    return [ln for ln in r.stderr.splitlines() if ln.startswith("ERROR")]


def tree(root):
    """(path, size, mtime) of every file in the venv except bytecode caches."""
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d != "__pycache__"]
        for f in filenames:
            p = os.path.join(dirpath, f)
            st = os.lstat(p)
            out.append((os.path.relpath(p, root), st.st_size, st.st_mtime_ns))
    return sorted(out)


@pytest.fixture(scope="module")
def built(base_env, tmp_path_factory):
    """One fresh build, shared by the tests that only read it."""
    env_dir = tmp_path_factory.mktemp("shared") / "apps" / "pytorch_env"
    r = run(base_env, PYTORCH_ENV=str(env_dir))
    return r, env_dir


def test_fresh_build_prints_every_version(built, base_env):
    r, env_dir = built
    assert r.returncode == 0, show(r)
    lines = r.stdout.splitlines()
    for want in EXPECTED_VERSIONS:
        assert want in lines, show(r)
    assert "CUDA available: False (torch built for CUDA 12.8; no usable GPU on this node)" in lines, show(r)
    assert f"pytorch env at {env_dir} is ready" in r.stdout, show(r)
    assert lines[-2] == f"Run: {env_dir}/bin/python {REPO}/ddp_mesh_ping.py", show(r)
    assert f"PYTORCH_ENV={env_dir} sbatch submit_smoke_test.sbatch" in lines[-1], show(r)
    assert not error_lines(r) and "Traceback" not in r.stderr, show(r)
    if base_env["PYTHON"].startswith("/usr/bin/"):
        assert "WARNING" not in r.stderr, show(r)  # a system python: nothing to warn about
    assert (env_dir / "pyvenv.cfg").is_file()
    # the packages live in the venv, not somewhere else on the path
    where = subprocess.run([str(env_dir / "bin" / "python"), "-I", "-c", "import torch; print(torch.__file__)"],
                           capture_output=True, text=True)
    assert where.stdout.startswith(str(env_dir)), where


def test_rerun_changes_nothing_and_skips_pip(built, base_env):
    first, env_dir = built
    assert first.returncode == 0, show(first)
    before = tree(env_dir)
    r = run(base_env, PYTORCH_ENV=str(env_dir))
    assert r.returncode == 0, show(r)
    assert f"pytorch env at {env_dir} is up to date; nothing changed" in r.stdout, show(r)
    for want in EXPECTED_VERSIONS:
        assert want in r.stdout.splitlines(), show(r)
    assert "==> pip install" not in r.stdout and "upgrading pip" not in r.stdout, show(r)
    assert r.stdout.splitlines()[-2].startswith("Run: "), show(r)
    assert tree(env_dir) == before
    assert r.elapsed < first.elapsed and r.elapsed < 30, (first.elapsed, r.elapsed)


def installed(env_dir, name):
    """The version of distribution `name` in the venv (None: not installed), read by the venv's python."""
    r = subprocess.run([str(env_dir / "bin" / "python"), "-I", "-c",
                        f"import importlib.metadata as m; print(m.version({name!r}))"],
                       capture_output=True, text=True)
    return r.stdout.strip() if r.returncode == 0 else None


def record(env_dir):
    """The record as a dict."""
    lines = (env_dir / "bootstrap_env.record").read_text().splitlines()
    return dict(ln.split("=", 1) for ln in lines if not ln.startswith("#"))


def changed_line(r):
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("changed: ")]
    assert len(lines) == 1, show(r)
    return lines[0]


def torch_wheel(where, version):
    write_wheel(where, "torch", version, {"torch/__init__.py": TORCH_INIT.replace("1.0.0+cpu", version)}, [])


def without_pip_cli(env_dir):
    """Makes `python -m pip` impossible in the venv until the returned function is called."""
    main = next(env_dir.glob("lib/python3*/site-packages/pip/__main__.py"))
    off = main.with_name("__main__.py.off")
    main.rename(off)
    return lambda: off.rename(main)


def copy_of_built(built, tmp_path):
    """A copy of the shared fresh build, for tests that change it (quicker than building one)."""
    first, src = built
    assert first.returncode == 0, show(first)
    env_dir = tmp_path / "pytorch_env"
    shutil.copytree(src, env_dir, symlinks=True)
    return env_dir


def test_changed_source_or_spec_updates_the_venv(built, base_env, tmp_path, wheelhouse):
    env_dir = copy_of_built(built, tmp_path)
    env = dict(base_env, UPGRADE_PIP="0", PYTORCH_ENV=str(env_dir))
    assert installed(env_dir, "torch") == "1.0.0+cpu"
    assert record(env_dir)["find-links"] == str(wheelhouse)
    assert record(env_dir)["torch"] == "torch==1.0.0"

    # another wheelhouse with another build of the same pinned version: pip alone would keep the
    # installed one (torch==1.0.0 is satisfied by 1.0.0+cpu); the bootstrap reinstalls from there
    other = tmp_path / "wheelhouse-cu126"
    other.mkdir()
    for whl in wheelhouse.glob("*.whl"):
        if not whl.name.startswith("torch-"):
            shutil.copy(whl, other)
    torch_wheel(other, "1.0.0+cu126")
    r = run(env, "--find-links", str(other))
    assert r.returncode == 0, show(r)
    assert changed_line(r) == f"changed: find-links {wheelhouse} -> {other}", show(r)
    assert "torch 1.0.0+cu126" in r.stdout.splitlines(), show(r)
    assert installed(env_dir, "torch") == "1.0.0+cu126"
    assert "nothing changed" not in r.stdout and "creating the venv" not in r.stdout, show(r)
    assert f"pytorch env at {env_dir} is ready" in r.stdout, show(r)
    assert record(env_dir)["find-links"] == str(other)

    # the same request again: nothing to do, and pip is not even started (it could not be)
    before = tree(env_dir)
    restore = without_pip_cli(env_dir)
    try:
        r = run(env, FIND_LINKS=str(other))
    finally:
        restore()
    assert r.returncode == 0, show(r)
    assert f"pytorch env at {env_dir} is up to date; nothing changed" in r.stdout, show(r)
    assert "torch 1.0.0+cu126" in r.stdout.splitlines(), show(r)
    steps = [ln for ln in r.stdout.splitlines() if ln.startswith("==> ")]
    assert steps == [f"==> checking the venv at {env_dir} ({env_dir}/bin/python)"], show(r)
    assert "changed: " not in r.stdout and not r.stderr, show(r)
    assert tree(env_dir) == before

    # a package index instead of the wheelhouse, and another torch version from it
    index = tmp_path / "index"
    for whl in other.glob("*.whl"):
        if not whl.name.startswith("torch-"):
            name = whl.name.split("-")[0]
            (index / name).mkdir(parents=True, exist_ok=True)
            shutil.copy(whl, index / name)
    (index / "torch").mkdir()
    torch_wheel(index / "torch", "1.0.1")
    for d in index.iterdir():
        links = "".join(f'<a href="{w.name}">{w.name}</a>\n' for w in d.glob("*.whl"))
        (d / "index.html").write_text(f"<html><body>\n{links}</body></html>\n")
    url = index.as_uri()
    r = run(env, "--index-url", url, FIND_LINKS=None, EXTRA_PIP_ARGS=None, TORCH_SPEC="torch==1.0.1")
    assert r.returncode == 0, show(r)
    assert changed_line(r) == (f"changed: index-url (pip default) -> {url}; find-links {other} -> (none); "
                               "torch==1.0.0 -> torch==1.0.1"), show(r)
    assert installed(env_dir, "torch") == "1.0.1"
    assert "torch 1.0.1" in r.stdout.splitlines(), show(r)
    rec = record(env_dir)
    assert (rec["index-url"], rec["find-links"], rec["torch"]) == (url, "", "torch==1.0.1")

    # a package left out is uninstalled; the rest stays
    r = run(env, "--index-url", url, FIND_LINKS=None, EXTRA_PIP_ARGS=None, TORCH_SPEC="torch==1.0.1",
            TORCHAUDIO_SPEC="")
    assert r.returncode == 0, show(r)
    assert changed_line(r) == "changed: torchaudio==1.0.0 -> (left out)", show(r)
    assert installed(env_dir, "torchaudio") is None
    assert not list(env_dir.glob("lib/python3*/site-packages/torchaudio"))
    assert not [ln for ln in r.stdout.splitlines() if ln.startswith("torchaudio ")], show(r)
    assert installed(env_dir, "torch") == "1.0.1"

    r = run(env, "--index-url", url, FIND_LINKS=None, EXTRA_PIP_ARGS=None, TORCH_SPEC="torch==1.0.1",
            TORCHAUDIO_SPEC="")
    assert r.returncode == 0 and "nothing changed" in r.stdout and "==> pip" not in r.stdout, show(r)


def free_port():
    with socket.socket() as sk:
        sk.bind(("127.0.0.1", 0))
        return sk.getsockname()[1]


@pytest.fixture
def cuda_index(tmp_path, wheelhouse):
    """A package index served over HTTP on 127.0.0.1 (python -m http.server) whose torch is a CUDA 13.0 build
    (1.0.0+cu130, torch.version.cuda '13.0'), at /simple and at the build-specific paths /whl/cu128 (which
    should serve CUDA 12.8 and does not) and /whl/cu130. -> its base URL."""
    root = tmp_path / "served"
    simple = root / "simple"
    for whl in wheelhouse.glob("*.whl"):
        name = whl.name.split("-")[0]
        if name != "torch":
            (simple / name).mkdir(parents=True, exist_ok=True)
            shutil.copy(whl, simple / name)
    (simple / "torch").mkdir(parents=True)
    init = TORCH_INIT.replace("1.0.0+cpu", "1.0.0+cu130").replace('cuda = "12.8"', 'cuda = "13.0"')
    write_wheel(simple / "torch", "torch", "1.0.0+cu130", {"torch/__init__.py": init}, [])
    for d in simple.iterdir():
        links = "".join(f'<a href="{w.name}">{w.name}</a>\n' for w in d.glob("*.whl"))
        (d / "index.html").write_text(f"<html><body>\n{links}</body></html>\n")
    (root / "whl").mkdir()
    for tag in ("cu128", "cu130"):
        (root / "whl" / tag).symlink_to(simple, target_is_directory=True)
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1",
                               "--directory", str(root)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert time.monotonic() < deadline and server.poll() is None, "the test index did not start"
                time.sleep(0.1)
        yield f"http://127.0.0.1:{port}"
    finally:
        server.kill()
        server.wait()


def test_torch_of_another_build_than_asked_is_one_error_line(built, base_env, tmp_path, cuda_index):
    """Before: with the CPU index unreachable, pip retried it for every package, an extra index supplied a
    CUDA torch (3 GB, minutes), and the bootstrap said "ready". Now: the index of the build asked for does not
    answer -> one ERROR line at once, nothing installed, pip never run; INDEX_FALLBACK=1 takes the other
    sources' build with one WARNING naming it (pip retried each page INDEX_RETRIES (1) time, not its own 5), and
    a re-run keeps it. A CUDA-specific index that serves another CUDA is an error; one that serves its own CUDA
    is ready, and then unchanged."""
    env_dir = copy_of_built(built, tmp_path)
    env = {k: v for k, v in base_env.items() if k not in ("FIND_LINKS", "EXTRA_PIP_ARGS")}
    env.update(UPGRADE_PIP="1", PYTORCH_ENV=str(env_dir))
    dead = f"http://127.0.0.1:{free_port()}/simple"  # nothing listens there
    args = ("--cpu", "--index-url", dead, "--extra-index-url", f"{cuda_index}/simple")
    r = run(env, *args)
    assert r.returncode == 1 and r.elapsed < 60, show(r)
    (err,) = error_lines(r)
    assert err.startswith(f"ERROR: package index {dead} does not answer (") and err.endswith(
        "and a CPU build was asked (--cpu): nothing installed; give a source that answers (--index-url, "
        "--find-links), or INDEX_FALLBACK=1 to take the build the other sources have"), show(r)
    assert "pip install" not in r.stdout and "upgrading pip" not in r.stdout, show(r)
    assert installed(env_dir, "torch") == "1.0.0+cpu"  # untouched

    env.update(UPGRADE_PIP="0", INDEX_FALLBACK="1")
    r = run(env, *args)
    assert r.returncode == 0 and not error_lines(r) and f"pytorch env at {env_dir} is ready" in r.stdout, show(r)
    assert installed(env_dir, "torch") == "1.0.0+cu130"
    (w,) = [ln for ln in r.stderr.splitlines() if "INDEX_FALLBACK=1 took" in ln]
    assert w.startswith(f"WARNING: torch 1.0.0+cu130 in {env_dir} is a CUDA 13.0 build, but a CPU build was asked "
                        f"(--cpu): {dead} did not answer ("), show(r)
    assert re.search(r"pip spent [\d.]+ s retrying [1-9]\d* page\(s\) of it \([1-9]\d* retries\)", w), show(r)
    retries = re.findall(r"Retrying \(Retry\(total=(\d+)", r.stdout + r.stderr)
    assert retries and set(retries) == {"0"}, show(r)  # one retry per page (INDEX_RETRIES=1), not pip's 5
    r = run(env, *args)
    assert r.returncode == 0 and "nothing changed" in r.stdout and "kept (INDEX_FALLBACK=1)" in r.stderr, show(r)
    env.pop("INDEX_FALLBACK")

    r = run(env, "--index-url", f"{cuda_index}/whl/cu128")
    assert r.returncode == 1, show(r)
    (err,) = error_lines(r)
    assert err == (f"ERROR: torch 1.0.0+cu130 in {env_dir} is a CUDA 13.0 build, but a CUDA 12.8 build was asked "
                   f"(index {cuda_index}/whl/cu128); give a source that has the build asked for (or "
                   "EXTRA_PIP_ARGS=--force-reinstall once it answers), then re-run"), show(r)

    r = run(env, "--index-url", f"{cuda_index}/whl/cu130")
    assert r.returncode == 0 and f"pytorch env at {env_dir} is ready" in r.stdout and not error_lines(r), show(r)
    r = run(env, "--index-url", f"{cuda_index}/whl/cu130")
    assert r.returncode == 0 and "nothing changed" in r.stdout, show(r)
    r = run(env, "--index-url", f"{cuda_index}/whl/cu130", TORCH_BUILD="cpu9")
    assert r.returncode == 2 and "TORCH_BUILD must be cpu, cuXYZ" in error_lines(r)[0], show(r)


def test_venv_without_record_other_python_and_drift(built, base_env, tmp_path, wheelhouse):
    env_dir = copy_of_built(built, tmp_path)
    env = dict(base_env, UPGRADE_PIP="0", PYTORCH_ENV=str(env_dir))
    rec_file = env_dir / "bootstrap_env.record"
    written = rec_file.read_text()
    version = subprocess.run([base_env["PYTHON"], "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
                             capture_output=True, text=True).stdout.strip()
    assert record(env_dir)["python"] == f"{os.path.realpath(base_env['PYTHON'])} (Python {version})", written

    # a venv from an older bootstrap (no record): checked with pip as before, then recorded
    rec_file.unlink()
    r = run(env)
    assert r.returncode == 0, show(r)
    assert "has no record" in r.stdout and "nothing changed" in r.stdout, show(r)
    assert "==> pip install" not in r.stdout and "changed: " not in r.stdout, show(r)
    assert rec_file.read_text() == written

    # installed packages changed by hand: the record is not trusted blindly
    pip = subprocess.run([str(env_dir / "bin" / "python"), "-m", "pip", "install", "-q", "--no-index",
                          "--find-links", str(wheelhouse), "numpy==1.0.1"],
                         capture_output=True, text=True, env=base_env)
    assert pip.returncode == 0, pip.stderr
    r = run(env)
    assert r.returncode == 0, show(r)
    assert "(numpy 1.0.1 installed, numpy==1.0.0 wanted)" in r.stdout, show(r)
    assert "numpy 1.0.0" in r.stdout.splitlines() and installed(env_dir, "numpy") == "1.0.0", show(r)

    # recorded with another python: the venv is rebuilt with this one
    old_python = "/opt/python3.9/bin/python3.9 (Python 3.9)"
    rec_file.write_text(written.replace(record(env_dir)["python"], old_python))
    marker = env_dir / "left-by-the-old-venv"
    marker.write_text("")
    r = run(env)
    assert r.returncode == 0, show(r)
    assert changed_line(r) == f"changed: python {old_python} -> {record(env_dir)['python']}", show(r)
    assert "rebuilding it from scratch" in r.stdout and "creating the venv" in r.stdout, show(r)
    assert not marker.exists()
    assert rec_file.read_text() == written
    for want in EXPECTED_VERSIONS:
        assert want in r.stdout.splitlines(), show(r)


def test_broken_package_then_fixed_spec(base_env, tmp_path, wheelhouse):
    env_dir = tmp_path / "pytorch_env"
    # the --find-links flag stands in for FIND_LINKS here
    env = dict(base_env)
    env.pop("FIND_LINKS")
    r = run(env, "--find-links", str(wheelhouse), PYTORCH_ENV=str(env_dir), TORCHAUDIO_SPEC="torchaudio==1.0.1")
    assert r.returncode == 1, show(r)
    errs = error_lines(r)
    assert len(errs) == 1, show(r)
    assert "torchaudio" in errs[0] and errs[0].endswith(
        "OSError: undefined symbol: _ZN3c1017fake_symbol_for_testsEv"), show(r)
    assert "Traceback" not in r.stderr, show(r)
    assert "torch 1.0.0+cpu" in r.stdout.splitlines(), show(r)
    assert "is ready" not in r.stdout, show(r)

    # same spec again: pip has nothing to do, the import still fails
    r = run(env, "--find-links", str(wheelhouse), PYTORCH_ENV=str(env_dir), TORCHAUDIO_SPEC="torchaudio==1.0.1")
    assert r.returncode == 1, show(r)
    assert len(error_lines(r)) == 1 and "torchaudio" in error_lines(r)[0], show(r)
    assert "==> pip install" not in r.stdout, show(r)

    # a working spec: the existing venv is updated, not reported as unchanged
    r = run(env, "--find-links", str(wheelhouse), PYTORCH_ENV=str(env_dir))
    assert r.returncode == 0, show(r)
    assert "==> pip install" in r.stdout and "nothing changed" not in r.stdout, show(r)
    assert "torchaudio 1.0.0" in r.stdout.splitlines(), show(r)
    assert "creating the venv" not in r.stdout, show(r)

    r = run(env, "--find-links", str(wheelhouse), PYTORCH_ENV=str(env_dir))
    assert r.returncode == 0 and "nothing changed" in r.stdout, show(r)


def test_existing_non_venv_path_is_refused(base_env, tmp_path):
    data_dir = tmp_path / "pytorch_env"
    data_dir.mkdir()
    (data_dir / "results.csv").write_text("keep me\n")
    r = run(base_env, PYTORCH_ENV=str(data_dir))
    assert r.returncode == 2, show(r)
    errs = error_lines(r)
    assert len(errs) == 1 and str(data_dir) in errs[0] and "not a Python venv" in errs[0], show(r)
    assert r.stderr.strip() == errs[0], show(r)
    assert sorted(p.name for p in data_dir.iterdir()) == ["results.csv"]

    a_file = tmp_path / "env_file"
    a_file.write_text("")
    r = run(base_env, PYTORCH_ENV=str(a_file))
    assert r.returncode == 2, show(r)
    assert len(error_lines(r)) == 1 and "not a directory" in error_lines(r)[0], show(r)


def test_empty_directory_is_used_and_private_python_warned(base_env, tmp_path):
    # an empty directory made beforehand (e.g. by an admin, with the right owner) is used as is
    env_dir = tmp_path / "pytorch_env"
    env_dir.mkdir()
    # a base interpreter only its owner can reach (as with pyenv under /root): the venv would not
    # run for other users, which is worth a warning, not a refusal
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    os.chmod(private, 0o700)
    (private / "python3").symlink_to(base_env["PYTHON"])
    r = run(base_env, PYTORCH_ENV=str(env_dir), PYTHON=str(private / "python3"), UPGRADE_PIP="0")
    assert r.returncode == 0, show(r)
    assert (env_dir / "pyvenv.cfg").is_file() and "numpy 1.0.0" in r.stdout.splitlines(), show(r)
    assert "upgrading pip" not in r.stdout, show(r)
    warnings = [ln for ln in r.stderr.splitlines() if ln.startswith("WARNING")]
    assert len(warnings) == 1, show(r)
    assert f"the venv will link to {private}/python3 (" in warnings[0], show(r)
    assert "other users cannot run it" in warnings[0], show(r)


def _unprivileged_prefix():
    """Command prefix that runs as an unprivileged user, or () when we already are one."""
    if os.geteuid() != 0:
        return ()
    if shutil.which("runuser"):
        return ("runuser", "-u", "nobody", "--")
    if shutil.which("setpriv"):
        return ("setpriv", "--reuid=65534", "--regid=65534", "--clear-groups")
    pytest.skip("running as root without runuser or setpriv")


def test_prefix_not_writable(base_env):
    prefix = _unprivileged_prefix()
    # a root-owned world-readable tree; the script is copied in so the unprivileged user can read it
    top = Path(tempfile.mkdtemp(prefix="aiv-ro-"))
    try:
        script = top / "bootstrap_env.sh"
        shutil.copy(SCRIPT, script)
        apps = top / "apps"
        apps.mkdir()
        target = apps / "pytorch_env"
        os.chmod(top, 0o755)
        os.chmod(apps, 0o555)
        # (the wheelhouse lies under root's private pytest directory: leave FIND_LINKS out)
        r = run(base_env, script=script, prefix=(*prefix, "env", f"PYTORCH_ENV={target}"), cwd=top,
                PYTORCH_ENV=str(target), FIND_LINKS=None)
        assert r.returncode == 2, show(r)
        errs = error_lines(r)
        assert len(errs) == 1 and r.stderr.strip() == errs[0], show(r)
        assert f"cannot create {target}: {apps} is not writable" in errs[0], show(r)
        assert not target.exists()

        if prefix and not os.path.exists("/shared"):
            # the default path, run by a user who is not allowed to create /shared
            r = run(base_env, script=script, prefix=(*prefix, "env", "-u", "PYTORCH_ENV"), cwd=top,
                    PYTORCH_ENV=None, FIND_LINKS=None)
            assert r.returncode == 2, show(r)
            assert "cannot create /shared/apps/pytorch_env: / is not writable by user nobody" in r.stderr, show(r)
    finally:
        os.chmod(apps, 0o755)
        shutil.rmtree(top)


def test_python_without_ensurepip(base_env, tmp_path):
    # what Debian's python3 looks like without python3-venv: `import ensurepip` fails
    shim = tmp_path / "shim"
    (shim / "ensurepip").mkdir(parents=True)
    (shim / "ensurepip" / "__init__.py").write_text(
        "raise ModuleNotFoundError(\"No module named 'ensurepip'\", name='ensurepip')\n")
    fake_python = tmp_path / "python3"
    fake_python.write_text(f'#!/bin/sh\nPYTHONPATH={shim} exec {base_env["PYTHON"]} "$@"\n')
    fake_python.chmod(0o755)
    target = tmp_path / "pytorch_env"
    r = run(base_env, PYTORCH_ENV=str(target), PYTHON=str(fake_python))
    assert r.returncode == 2, show(r)
    errs = error_lines(r)
    assert len(errs) == 1 and r.stderr.strip() == errs[0], show(r)
    assert "ensurepip" in errs[0] and re.search(r"apt-get install python3\.\d+-venv", errs[0]), show(r)
    assert not target.exists()

    r = run(base_env, PYTORCH_ENV=str(target), PYTHON=str(tmp_path / "no-such-python"))
    assert r.returncode == 2 and len(error_lines(r)) == 1, show(r)
    assert not target.exists()


def test_help_and_bad_arguments(base_env):
    r = run(base_env, "--help")
    assert r.returncode == 0, show(r)
    for knob in ("PYTORCH_ENV", "PYTHON", "TORCH_SPEC", "TORCHVISION_SPEC", "TORCHAUDIO_SPEC", "PSUTIL_SPEC",
                 "NUMPY_SPEC", "INDEX_URL", "EXTRA_INDEX_URL", "FIND_LINKS", "EXTRA_PIP_ARGS", "UPGRADE_PIP",
                 "TORCH_BUILD", "INDEX_RETRIES", "INDEX_TIMEOUT", "--cpu", "--index-url", "--extra-index-url",
                 "--find-links"):
        assert knob in r.stdout, knob
    assert "set -e" not in r.stdout
    for args in (["--bogus"], ["--index-url"], ["--extra-index-url"]):
        r = run(base_env, *args, PYTORCH_ENV="/nonexistent/never/made")
        assert r.returncode == 2 and len(error_lines(r)) == 1, show(r)
    r = run(base_env, PYTORCH_ENV="/nonexistent/never/made", FIND_LINKS="/nonexistent/wheelhouse")
    assert r.returncode == 2 and "FIND_LINKS" in r.stderr, show(r)
    assert not os.path.exists("/nonexistent")


def test_script_is_executable_and_shellcheck_clean():
    assert os.stat(SCRIPT).st_mode & stat.S_IXUSR
    assert SCRIPT.read_text().startswith("#!/usr/bin/env bash\n")
    if not shutil.which("shellcheck"):
        pytest.skip("shellcheck not installed")
    r = subprocess.run(["shellcheck", "-S", "style", str(SCRIPT)], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def test_torchvision_or_torchaudio_of_another_build_than_torch_is_one_error_line(base_env, tmp_path, wheelhouse):
    """Before: a torchaudio built for CUDA 13.2 sat beside a torch for 13.0 without a word. Now: another build
    label, or a torch requirement the installed torch does not meet, is one ERROR line and exit 1."""
    house = tmp_path / "wheelhouse-mixed"
    house.mkdir()
    for whl in wheelhouse.glob("*.whl"):
        shutil.copy(whl, house)
    write_wheel(house, "torchaudio", "1.0.0+cu132", {"torchaudio/__init__.py": '__version__ = "1.0.0+cu132"\n'},
                ["torch"])
    write_wheel(house, "torchvision", "1.0.2", {"torchvision/__init__.py": '__version__ = "1.0.2"\n'},
                ["torch==2.0.0"])
    env_dir = tmp_path / "env"
    r = run(base_env, PYTORCH_ENV=str(env_dir), FIND_LINKS=str(house), TORCHAUDIO_SPEC="torchaudio==1.0.0+cu132")
    assert r.returncode == 1 and "is ready" not in r.stdout, show(r)
    (err,) = error_lines(r)
    assert err.startswith("ERROR: torchaudio 1.0.0+cu132 is built for cu132, torch 1.0.0+cpu for cpu (in "), show(r)
    assert "install all three from one source" in err
    # a torchvision whose metadata wants another torch (installed with --no-deps, as a later hand install might)
    r = run(base_env, PYTORCH_ENV=str(env_dir), FIND_LINKS=str(house), TORCHVISION_SPEC="torchvision==1.0.2",
            EXTRA_PIP_ARGS="--no-index --no-deps")
    (err,) = error_lines(r)
    assert r.returncode == 1 and err.startswith("ERROR: torchvision 1.0.2 requires torch==2.0.0, torch 1.0.0+cpu is "
                                                "installed"), show(r)
    # PyPI's shape: no build label in the metadata, one in what the package reports when imported
    write_wheel(house, "torchaudio", "1.0.2", {"torchaudio/__init__.py": '__version__ = "1.0.2+cu132"\n'}, ["torch"])
    r = run(base_env, PYTORCH_ENV=str(env_dir), FIND_LINKS=str(house), TORCHAUDIO_SPEC="torchaudio==1.0.2")
    (err,) = error_lines(r)
    assert r.returncode == 1 and err.startswith("ERROR: torchaudio 1.0.2+cu132 is built for cu132, torch 1.0.0+cpu "
                                                "for cpu (in "), show(r)
    # no label anywhere, but its compiled extension reports another CUDA than torch.version.cuda (12.8)
    write_wheel(house, "torchaudio", "1.0.3", {"torchaudio/__init__.py": TORCHAUDIO_CUDA_13_2}, ["torch"])
    r = run(base_env, PYTORCH_ENV=str(env_dir), FIND_LINKS=str(house), TORCHAUDIO_SPEC="torchaudio==1.0.3")
    (err,) = error_lines(r)
    assert r.returncode == 1 and err.startswith("ERROR: torchaudio 1.0.3 is built for CUDA 13.2, torch 1.0.0+cpu for "
                                                "CUDA 12.8 (in "), show(r)
    # (torchaudio==1.0.0 would keep 1.0.0+cu132: a local label matches a spec without one) left out: ready
    r = run(base_env, PYTORCH_ENV=str(env_dir), FIND_LINKS=str(house), TORCHAUDIO_SPEC="")
    assert r.returncode == 0 and "is ready" in r.stdout and not error_lines(r), show(r)
    assert installed(env_dir, "torchaudio") is None and installed(env_dir, "torchvision") == "1.0.0"


def test_the_readme_names_the_cpu_build():
    readme = (REPO / "README.md").read_text()
    assert "./bootstrap_env.sh --cpu" in " ".join(readme.split())

