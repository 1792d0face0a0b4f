#!/usr/bin/env python3
"""Build the shipped ddp_mesh_ping.py from the modules in aiv/.

The source of the tool is the package aiv/, one module per concern; operators run one file. This
script concatenates the modules in their build order (BUILD_ORDER) into ddp_mesh_ping.py: each module
under a banner naming its source file, its relative imports dropped (they only name what the modules
before it already define) and its standard-library imports gathered once at the top of the file.

  tools/build.py            write ddp_mesh_ping.py
  tools/build.py --order    print the modules in build order, one path a line
  tools/build.py --check    exit 1 when ddp_mesh_ping.py differs from what aiv/ builds, when a module
                            imports from a module after it (or from itself), when a pure module
                            imports the runtime, or when two modules define one top-level name

Standard library only: it runs with any python3 >= 3.9.
"""
import argparse
import ast
import difflib
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SRC = ROOT / "aiv"
OUT = ROOT / "ddp_mesh_ping.py"

# A module imports only from modules before it in this list.
BUILD_ORDER = (
    "base",          # constants, CHECKS, findings, hostlists, printing, the tool-error idiom
    "blame",         # the blame law: the evidence a finding stands on, each check's declaration, the gate
    "deadlines",     # the one table of bounds; Bound, the only place the watchdog is armed
    "files",         # atomic writes and file locks, each under a bound
    "contract",      # the launch variables (RANK, Slurm, torchrun, MPI), the job's secret
    "launchers",     # the one table of launch contracts; per-node launches (Kubernetes, Trainer v2)
    "options",       # the one parser of flags and AIV_* variables
    "interfaces",    # NCCL/GLOO_SOCKET_IFNAME, NCCL's own log lines
    "collect",       # facts of a rank and its node, one getter per fact
    "node_collect",  # --node-check: what a node reads alone without torch (nvidia-smi, PCI, kernel log, scontrol)
    "numerics_measure",  # the numerics check (silent data corruption): what each rank computes on its device
    "measure",       # what the screen and the soak measure on a device
    "numerics",      # the numerics check's judges: bits within a model and software, the fp64 reference
    "hang",          # who is behind in a phase that did not finish; NCCL's own view beside ours
    "judge",         # pure checks of the gathered records
    "manifest",      # --save-manifest / --manifest / --diff-manifest
    "screen_plan",   # the screen's rounds and groups
    "screen_gpu",    # the GPU screen's judges: peers, the per-model table, floors, measured again
    "screen_judge",  # the screen's judges: intra-node and inter-node busbw, node / rail / link culprits
    "soak",          # the soak's judges
    "screen_loop",   # the screen's control loop: batches, re-measurement, controls, localisation
    "node_judge",    # --node-check: contexts, the checks table, the judges of one node alone
    "render",        # the report
    "outputs",       # --drain and --metrics
    "node_report",   # --node-check: the summary line, the NPD line, the node's textfile
    "page",          # --html
    "verify_log",    # --verify-log
    "manifest_io",   # the manifest on disk: read before torch, saved under a lock, diffed
    "store",         # the side channel: keys, Seal, StoreProtocol
    "liveness",      # the node monitor
    "ras",           # NCCL's RAS service, read over its socket
    "background",    # a rank's work off its main thread; its NCCL log
    "drain",         # --drain on: the scontrol calls
    "conclusion",    # rank 0's verdict, given once: the gate, the report first, the files, the drain, the acks
    "screen_run",    # the collectives the screen asks for, on every rank
    "rank",          # RankRun: the phases, each under its bound
    "coordinator",   # rank 0: the roll call, the judges, the verdict
    "follower",      # every other rank
    "plan",          # what a command line becomes
    "local",         # the local launcher
    "node_workers",  # --node-check: the device workers (one process per device) and the check's handle on them
    "node_check",    # --node-check: the node gate's runtime (lock, workers, budget, Slurm, files)
    "main",          # the entry point
)
# The pure layer: judges, render, manifest, verify-log and what they stand on. None of these imports a
# module of the runtime, so each is a function of plain data that a test can call without a store.
RUNTIME = ("manifest_io", "store", "liveness", "ras", "background", "drain", "conclusion", "screen_run", "rank",
           "coordinator", "follower", "plan", "local", "node_workers", "node_check", "main")
PURE = tuple(m for m in BUILD_ORDER if m not in RUNTIME)
# The judge and report modules: functions of plain data with no effects. None imports what acts on the world
# (processes, threads, sockets, locks, native calls, torch); a check that needs one collects in a floor 2
# module or the runtime, and hands the judge plain data.
EFFECT_FREE = ("blame", "numerics", "hang", "judge", "manifest", "screen_plan", "screen_gpu", "screen_judge", "soak",
               "screen_loop", "node_judge", "render", "outputs", "page", "verify_log", "node_report")
EFFECTS = ("subprocess", "threading", "socket", "fcntl", "ctypes", "torch", "multiprocessing", "signal",
           "concurrent", "asyncio")

HEADER = """\
#!/usr/bin/env python3
# GENERATED FILE: do not edit. Built by tools/build.py from the modules in aiv/ (edit those, then run
# tools/build.py; tools/build.py --check fails when this file differs from what aiv/ builds). Each part
# below starts with a banner naming its source module.
"""
BANNER = "# " + "=" * 76 + " aiv/{name}.py"


class BuildError(Exception):
    pass


def module_path(name):
    return SRC / f"{name}.py"


def use_source(path):
    """Build from another copy of aiv/ (the tests use this on a copy they break on purpose)."""
    global SRC
    SRC = Path(path)


def parse(name):
    path = module_path(name)
    text = path.read_text()
    try:
        return text, ast.parse(text, filename=str(path))
    except SyntaxError as e:
        raise BuildError(f"{path}: {e}") from e


def relative_imports(tree):
    """[(module, [names], lineno)] for every `from .module import ...` at the top level."""
    return [(n.module, [a.name for a in n.names], n.lineno) for n in tree.body
            if isinstance(n, ast.ImportFrom) and n.level]


def top_names(tree):
    """The names a module defines at the top level (def, class, assignment)."""
    out = []
    for n in tree.body:
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.append((n.name, n.lineno))
        elif isinstance(n, (ast.Assign, ast.AnnAssign)):
            targets = n.targets if isinstance(n, ast.Assign) else [n.target]
            for t in targets:
                out.extend((x.id, n.lineno) for x in ast.walk(t) if isinstance(x, ast.Name))
    return out


def problems():
    """Everything wrong with the layering of aiv/, as lines (empty when none)."""
    out = []
    present = sorted(p.stem for p in SRC.glob("*.py") if p.stem != "__init__")
    for extra in sorted(set(present) - set(BUILD_ORDER)):
        out.append(f"aiv/{extra}.py is not in BUILD_ORDER (tools/build.py): add it where it belongs")
    for missing in [m for m in BUILD_ORDER if m not in present]:
        out.append(f"aiv/{missing}.py is in BUILD_ORDER but does not exist")
    pos = {m: i for i, m in enumerate(BUILD_ORDER)}
    tops = {m: {t for t, _ in top_names(parse(m)[1])} for m in BUILD_ORDER if m in present}
    defined = {}
    for name in BUILD_ORDER:
        if name not in present:
            continue
        _, tree = parse(name)
        for mod, _names, line in relative_imports(tree):
            src = f"aiv/{name}.py:{line}"
            if mod not in pos:
                out.append(f"{src}: imports from .{mod}, which is not a module of BUILD_ORDER")
            elif pos[mod] >= pos[name]:
                out.append(f"{src}: imports from .{mod}, which comes {'at' if mod == name else 'after'} "
                           f"{name} in the build order: no import runs back up")
            elif name in PURE and mod in RUNTIME:
                out.append(f"{src}: the pure module {name} imports the runtime module {mod}")
            else:
                out += [f"{src}: imports {x} from .{mod}, which does not define it" for x in _names
                        if x not in tops.get(mod, ())]
        if name in EFFECT_FREE:  # no effects in a judge or a report, at any depth of the module
            for n in ast.walk(tree):
                if isinstance(n, (ast.Import, ast.ImportFrom)) and not getattr(n, "level", 0):
                    mods = [a.name for a in n.names] if isinstance(n, ast.Import) else [n.module or ""]
                    out += [f"aiv/{name}.py:{n.lineno}: the judge/report module {name} imports {m}, which acts on "
                            "the world: collect in a floor 2 module or the runtime and hand it plain data"
                            for m in mods if m.split(".")[0] in EFFECTS]
        for n in tree.body:  # only `from .x import` and top-level standard imports are understood
            if isinstance(n, (ast.Import, ast.ImportFrom)) and not getattr(n, "level", 0):
                mods = [a.name for a in n.names] if isinstance(n, ast.Import) else [n.module]
                if any(m.split(".")[0] in ("aiv", "ddp_mesh_ping") for m in mods):
                    out.append(f"aiv/{name}.py:{n.lineno}: absolute import of the tool; use `from .module import`")
        seen = {}
        for n in tree.body:  # a def or class given twice: the later one wins wherever the name is called
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                if n.name in seen:
                    out.append(f"aiv/{name}.py:{n.lineno}: defines {n.name} again (first at line {seen[n.name]}): "
                               "the later definition replaces the first for every caller")
                seen.setdefault(n.name, n.lineno)
        for top, line in top_names(tree):
            if top in defined and defined[top][0] != name:
                out.append(f"aiv/{name}.py:{line}: defines {top}, already defined in aiv/{defined[top][0]}.py:"
                           f"{defined[top][1]}: one name, one definition")
            defined.setdefault(top, (name, line))
    return out


def strip_module(name):
    """A module's text for the built file: its docstring, standard imports and relative imports removed.
    -> (body, [standard import statements], docstring's first line)."""
    text, tree = parse(name)
    lines = text.splitlines(keepends=True)
    drop, std = set(), []
    doc = ast.get_docstring(tree)
    for n in tree.body:
        if isinstance(n, (ast.Import, ast.ImportFrom)):
            drop.update(range(n.lineno - 1, n.end_lineno))
            if not getattr(n, "level", 0):
                std.append(ast.get_source_segment(text, n))
        elif (isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant) and isinstance(n.value.value, str)
              and n is tree.body[0]):
            drop.update(range(n.lineno - 1, n.end_lineno))
        else:
            break  # the header ends at the first statement that is neither docstring nor import
    for n in tree.body:  # imports further down (after constants) are not allowed: they would be dropped silently
        if isinstance(n, (ast.Import, ast.ImportFrom)) and n.lineno - 1 not in drop:
            raise BuildError(f"aiv/{name}.py:{n.lineno}: a top-level import after the module's first statement; "
                             "put every top-level import at the top")
    body = "".join(ln for i, ln in enumerate(lines) if i not in drop).strip("\n")
    return body, std, (doc or "").strip().splitlines()[0] if doc else ""


def build():
    """The text of ddp_mesh_ping.py as aiv/ builds it."""
    bad = problems()
    if bad:
        raise BuildError("\n".join(bad))
    init = (SRC / "__init__.py").read_text()
    tree = ast.parse(init)
    if not (tree.body and isinstance(tree.body[0], ast.Expr) and isinstance(tree.body[0].value, ast.Constant)):
        raise BuildError("aiv/__init__.py must hold the tool's docstring (it becomes the shipped file's)")
    tool_doc = ast.get_source_segment(init, tree.body[0])
    parts, std = [], []
    for name in BUILD_ORDER:
        body, imports, doc = strip_module(name)
        std.extend(i for i in imports if i not in std)
        parts.append(BANNER.format(name=name) + (f"\n# {doc}" if doc else "") + "\n" + body + "\n")
    plain = sorted({i for i in std if i.startswith("import ")})
    froms = sorted({i for i in std if i.startswith("from ")})
    head = HEADER + tool_doc + "\n" + "\n".join(plain + froms) + "\n"
    return head + "\n\n" + "\n\n\n".join(parts)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--order", action="store_true", help="print the modules in build order, one path a line")
    ap.add_argument("--check", action="store_true", help="fail when ddp_mesh_ping.py is not what aiv/ builds")
    ap.add_argument("--output", type=Path, default=OUT, help="where to write (default: ddp_mesh_ping.py)")
    ap.add_argument("--src", type=Path, default=SRC, help="the source package (default: aiv/ beside tools/)")
    a = ap.parse_args(argv)
    use_source(a.src)
    if a.order:
        for name in BUILD_ORDER:
            print(f"aiv/{name}.py")
        return 0
    try:
        text = build()
    except BuildError as e:
        print(f"tools/build.py: {e}", file=sys.stderr)
        return 1
    if a.check:
        have = a.output.read_text() if a.output.exists() else ""
        if have != text:
            diff = list(difflib.unified_diff(text.splitlines(), have.splitlines(), "built from aiv/",
                                             str(a.output.name), lineterm="", n=1))
            print(f"tools/build.py --check: {a.output.name} differs from what aiv/ builds ({len(diff)} diff lines); "
                  "edit aiv/ and run tools/build.py, never the shipped file:", file=sys.stderr)
            print("\n".join(diff[:40]), file=sys.stderr)
            return 1
        print(f"tools/build.py --check: {a.output.name} is what aiv/ builds ({len(BUILD_ORDER)} modules)")
        return 0
    a.output.write_text(text)
    os.chmod(a.output, 0o755)
    print(f"tools/build.py: wrote {a.output.name} from {len(BUILD_ORDER)} modules ({text.count(chr(10))} lines)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
