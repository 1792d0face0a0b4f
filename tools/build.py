#!/usr/bin/env python3
"""Build the shipped ddp_mesh_ping.py from the modules in aiv/.

The source of the tool is the package aiv/: rooms (core, launch, checks, screen, node, out, run), each a
folder of modules, one module per concern; operators run one file. This script concatenates the modules
in their build order (BUILD_ORDER, paths such as "core/base") into ddp_mesh_ping.py: each module under a
banner naming its source file, its relative imports (`from .x import`, `from ..room.x import`) dropped
(they only name what the modules before it already define) and its standard-library imports gathered
once at the top of the file.

  tools/build.py            write ddp_mesh_ping.py
  tools/build.py --order    print the modules in build order, one path a line
  tools/build.py --check    exit 1 when ddp_mesh_ping.py differs from what aiv/ builds, when a module
                            imports from a module after it (or from itself), when a pure module
                            imports the runtime, when an effect-free module acts on the world or
                            imports, however deep, a module that does (the chain is named), when
                            two modules define one top-level name, a class one method twice, or when
                            a class is over 300 lines (MAX_CLASS_LINES)

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
    # core: the floor every mode stands on
    "core/base",          # constants, CHECKS, findings, hostlists, the tool-error idiom
    "core/names",         # the names collectors and judges share: probed packages, clock reasons, drain prefix
    "core/blame",         # the blame law: the evidence a finding stands on, each check's declaration, the gate
    "core/deadlines",     # the one table of bounds, plain numbers
    "core/speak",         # emit: one line printed under a lock, a reader gone away survived; Findings, one owner
    "core/bounds",        # Bound, the only place the watchdog is armed; the watchdog; within, bounded
    "core/files",         # atomic writes and file locks, each under a bound
    # launch: how the tool is started
    "launch/contract",    # the launch variables (RANK, Slurm, torchrun, MPI), the job's secret
    "launch/launchers",   # the one table of launch contracts; per-node launches (Kubernetes, Trainer v2)
    "launch/options",     # the one parser of flags and AIV_* variables
    # the facts: what a rank, a node and a device read or measure
    "checks/interfaces",  # NCCL/GLOO_SOCKET_IFNAME, NCCL's own log lines
    "checks/collect",     # facts of a rank and its node, one getter per fact
    "node/collect",       # --node-check: what a node reads alone without torch (nvidia-smi, PCI, kernel log, scontrol)
    "checks/numerics_measure",  # the numerics check (silent data corruption): what each rank computes on its device
    "screen/measure",     # what the screen and the soak measure on a device
    # the judges: functions of plain data
    "checks/numerics",    # the numerics check's judges: bits within a model and software, the fp64 reference
    "checks/hang",        # who is behind in a phase that did not finish; NCCL's own view beside ours
    "checks/judge",       # pure checks of the gathered records
    "checks/manifest",    # --save-manifest / --manifest / --diff-manifest
    "screen/plan",        # the screen's rounds and groups
    "screen/gpu",         # the GPU screen's judges: peers, the per-model table, floors, measured again
    "screen/judge",       # the screen's judges: intra-node and inter-node busbw, node / rail / link culprits
    "screen/soak",        # the soak's judges
    "screen/loop",        # the screen's control loop: batches, re-measurement, controls, localisation
    "node/judge",         # --node-check: contexts, the checks table, the judges of one node alone
    # the words: what a verdict becomes
    "out/render",         # the report
    "out/outputs",        # --drain and --metrics
    "node/report",        # --node-check: the summary line, the NPD line, the node's textfile
    "out/page",           # --html
    "out/verify_log",     # --verify-log
    # the runtime
    "checks/manifest_io", # the manifest on disk: read before torch, saved under a lock, diffed
    "run/store",          # the side channel: keys, Seal, StoreProtocol
    "run/liveness",       # the node monitor
    "run/ras",            # NCCL's RAS service, read over its socket
    "run/background",     # a rank's work off its main thread; its NCCL log
    "out/drain",          # --drain on: the scontrol calls
    "run/conclusion",     # rank 0's verdict, given once: the gate, the report first, the files, the drain, the acks
    "screen/run",         # the collectives the screen asks for, on every rank
    "run/setup",          # a rank's set-up: before torch, the local phase, a node leader's work beside the phases
    "run/guard",          # what guards a rank's phases: each bound, an error's verdict, signals, helpers, the way out
    "run/rank",           # RankRun: the phases, each under its bound
    "run/coordinator",    # rank 0: the roll call (the store served, every check-in waited for), the judges, naming
                          # who did not finish a phase (or was already stopped when a signal came), the verdict
    "run/follower",       # every other rank
    # the face: what a command line becomes, and the entry point
    "launch/plan",        # what a command line becomes
    "launch/local",       # the local launcher
    "node/workers",       # --node-check: the device workers (one process per device) and the check's handle on them
    "node/lock",          # --node-check: the lock, one pass on the GPUs at a time
    "node/check",         # --node-check: the node gate's runtime (lock, workers, budget, Slurm, files)
    "main",               # the entry point
)
# The pure layer: judges, render, manifest, verify-log and what they stand on. None of these imports a
# module of the runtime, so each is a function of plain data that a test can call without a store.
RUNTIME = ("checks/manifest_io", "run/store", "run/liveness", "run/ras", "run/background", "out/drain",
           "run/conclusion", "screen/run", "run/setup", "run/guard", "run/rank", "run/coordinator", "run/follower",
           "launch/plan", "launch/local", "node/workers", "node/lock", "node/check", "main")
PURE = tuple(m for m in BUILD_ORDER if m not in RUNTIME)
# The judge and report modules, and the floor they stand on: functions of plain data with no effects. None
# reaches what acts on the world (processes, threads, sockets, locks, native calls, torch), in its own text or
# through any module it imports, however deep; a check that needs one collects in a floor 2 module or the
# runtime, and hands the judge plain data.
EFFECT_FREE = ("core/base", "core/names", "core/blame", "core/deadlines", "checks/numerics", "checks/hang",
               "checks/judge", "checks/manifest", "screen/plan", "screen/gpu", "screen/judge", "screen/soak",
               "screen/loop", "node/judge", "out/render", "out/outputs", "out/page", "out/verify_log", "node/report")
EFFECTS = ("subprocess", "threading", "socket", "fcntl", "ctypes", "torch", "multiprocessing", "signal",
           "concurrent", "asyncio", "importlib", "pty", "_thread", "_posixsubprocess")
# The ways around an import of EFFECTS: os's own process calls (os.exec*, os.spawn*, os.posix_spawn* by
# prefix), and the builtins that import or run any code by name.
OS_EFFECTS = ("system", "popen", "fork", "forkpty", "kill", "killpg", "exec", "spawn", "posix_spawn")
BUILTIN_EFFECTS = ("__import__", "import_module", "exec", "eval")
# The only functions that write this process's environment (os.environ, os.putenv, os.unsetenv): a rank sets its
# variables once, as it starts, while it has one thread (glibc's setenv may free the array another thread's
# getenv is reading: that thread dies of SIGSEGV). A child's environment is passed as env=, never written here.
ENV_WRITERS = {("run/setup", "own_environment"), ("run/background", "capture")}
ENV_METHODS = ("update", "setdefault", "pop", "popitem", "clear", "__setitem__", "__delitem__")
# No class over this many lines (its `class` line to its last): a longer one holds more than one concern; split it
# by concern (a mixin or a collaborator each, as RankRun's RankSetup and RankGuard).
MAX_CLASS_LINES = 300

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


_PARSED = {}


def parse(name):
    """(text, tree) of a module; parsed once per text, whichever copy of aiv/ it is read from (the rules read each
    module often, and the tests build copies that differ from aiv/ in one module)."""
    path = module_path(name)
    text = path.read_text()
    if text not in _PARSED:
        try:
            _PARSED[text] = text, ast.parse(text, filename=str(path))
        except SyntaxError as e:
            raise BuildError(f"{path}: {e}") from e
    return _PARSED[text]


def resolve(name, level, module):
    """The module of BUILD_ORDER that `from <level dots><module> import` names in module `name`, e.g.
    ("screen/gpu", 2, "core.base") -> "core/base"; None when it leaves aiv/ or names no module."""
    pkg = name.split("/")[:-1]
    if not module or level - 1 > len(pkg):
        return None
    return "/".join(pkg[:len(pkg) - (level - 1)] + module.split("."))


def relative_imports(tree, name=""):
    """[(module, [names], lineno)] for every relative import at the top level of module `name`, the module
    as a path of BUILD_ORDER ("core/base"; None for one that names no module, e.g. `from . import x`)."""
    return [(resolve(name, n.level, n.module), [a.name for a in n.names], n.lineno) for n in tree.body
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


def present_modules():
    """The modules under SRC as BUILD_ORDER names them ("core/base"), the rooms' __init__.py left out."""
    return sorted(p.relative_to(SRC).with_suffix("").as_posix() for p in SRC.rglob("*.py") if p.name != "__init__.py")


def room_problems():
    """A room is a folder of aiv/ whose __init__.py holds its docstring only (the build drops it: an import
    or a definition there would be lost from the shipped file)."""
    out = []
    for room in sorted({p.parent for p in SRC.rglob("*.py")} - {SRC}):
        init = room / "__init__.py"
        where = f"aiv/{room.relative_to(SRC).as_posix()}/__init__.py"
        if not init.exists():
            out.append(f"{where} is missing: a room holds a docstring that says what it is for")
            continue
        body = ast.parse(init.read_text()).body
        if not (len(body) == 1 and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
                and isinstance(body[0].value.value, str)):
            out.append(f"{where}: a room's __init__.py holds its docstring only (the build drops everything else)")
    return out


def is_os_effect(attr):
    return attr in OS_EFFECTS or attr.startswith(("exec", "spawn", "posix_spawn"))


def effects(tree):
    """[(lineno, what)] for everything in a module that acts on the world (at any depth of its text): an
    import of EFFECTS, os's process calls, the builtins that import or run code by name."""
    out, os_names = [], {"os"}
    for n in ast.walk(tree):
        if isinstance(n, ast.Import):
            os_names |= {a.asname for a in n.names if a.name == "os" and a.asname}
            out += [(n.lineno, f"imports {a.name}") for a in n.names if a.name.split(".")[0] in EFFECTS]
        elif isinstance(n, ast.ImportFrom) and not n.level:
            mod = n.module or ""
            if mod.split(".")[0] in EFFECTS:
                out.append((n.lineno, f"imports {mod}"))
            out += [(n.lineno, f"imports {mod}.{a.name}") for a in n.names
                    if (mod == "os" and is_os_effect(a.name)) or a.name in BUILTIN_EFFECTS]
        elif isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id in os_names \
                and is_os_effect(n.attr):
            out.append((n.lineno, f"calls os.{n.attr}"))
        elif isinstance(n, ast.Attribute) and n.attr in BUILTIN_EFFECTS:
            out.append((n.lineno, f"uses {n.attr}"))
        elif isinstance(n, ast.Name) and n.id in BUILTIN_EFFECTS:
            out.append((n.lineno, f"uses {n.id}"))
    return sorted(set(out))


def effect_problems(modules):
    """An effect-free module that acts on the world, or imports (at any depth of the import graph) a module
    that does: each named once, with the chain of imports that reaches it."""
    imports = {m: [(resolve(m, n.level, n.module), n.lineno) for n in parse(m)[1].body
                   if isinstance(n, ast.ImportFrom) and n.level] for m in modules}
    acts = {}

    def act(m):  # only the modules a judge reaches are walked
        if m not in acts:
            acts[m] = effects(parse(m)[1])
        return acts[m]
    out = []
    for name in (m for m in EFFECT_FREE if m in imports):
        out += [f"aiv/{name}.py:{line}: the judge/report module {name} {what}, which acts on the world: "
                "collect in a floor 2 module or the runtime and hand it plain data" for line, what in act(name)]
        chains, todo = {name: [name]}, [name]
        while todo:  # breadth first: the shortest chain to each module
            here = todo.pop(0)
            for mod, _ in imports.get(here, ()):
                if mod in imports and mod not in chains:
                    chains[mod] = chains[here] + [mod]
                    todo.append(mod)
        for mod, chain in chains.items():
            if mod != name and act(mod):
                line, what = act(mod)[0]
                first = next(ln for m, ln in imports[name] if m == chain[1])
                out.append(f"aiv/{name}.py:{first}: the judge/report module {name} reaches an effect through "
                           f"{' -> '.join(chain)}: aiv/{mod}.py:{line} {what}; import what a judge needs from an "
                           "effect-free module (core/names.py for the names a collector and a judge share)")
    return out


def _is_environ(n):
    return isinstance(n, ast.Attribute) and n.attr == "environ" and isinstance(n.value, ast.Name) and n.value.id == "os"


def env_writes(tree):
    """[(lineno, enclosing function)] for each write to this process's environment in a module."""
    out = []

    def walk(node, func):
        for child in ast.iter_child_nodes(node):
            here = child.name if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) else func
            write = False
            if isinstance(child, ast.Subscript) and _is_environ(child.value):
                write = isinstance(child.ctx, (ast.Store, ast.Del))
            elif isinstance(child, ast.Call) and isinstance(child.func, ast.Attribute):
                f = child.func
                write = (_is_environ(f.value) and f.attr in ENV_METHODS) or (
                    isinstance(f.value, ast.Name) and f.value.id == "os" and f.attr in ("putenv", "unsetenv"))
            if write:
                out.append((child.lineno, func))
            walk(child, here)
    walk(tree, None)
    return out


def env_write_problems(name, tree):
    return [f"aiv/{name}.py:{line}: {func or 'module level'} writes this process's environment: only "
            f"{', '.join(f'{m}.{f}' for m, f in sorted(ENV_WRITERS))} do (ENV_WRITERS: once, as a rank starts, before "
            "its first thread; a child's environment goes as env=)" for line, func in env_writes(tree)
            if (name, func) not in ENV_WRITERS]


_CLASSES = {}


def statements(tree):
    """Every statement of a tree, at any depth: a statement lives only in another's body (or an except's, a match
    case's), so the expressions, most of a tree's nodes, are not walked."""
    todo = [tree]
    while todo:
        n = todo.pop()
        for field in ("body", "orelse", "finalbody", "handlers", "cases"):
            kids = getattr(n, field, None)
            if isinstance(kids, list):
                todo.extend(kids)
        if isinstance(n, ast.stmt):
            yield n


def classes(tree):
    """Every class of a module, at any depth (walked once per tree)."""
    if id(tree) not in _CLASSES:
        _CLASSES[id(tree)] = tree, sorted((n for n in statements(tree) if isinstance(n, ast.ClassDef)),
                                          key=lambda n: n.lineno)
    return _CLASSES[id(tree)][1]


def duplicate_methods(name, tree):
    """A method defined twice in one class: the later replaces the first for every caller (a property's
    setter and deleter, and typing's overloads, are the same name on purpose)."""
    out = []
    for cls in classes(tree):
        seen = {}
        for n in cls.body:
            if not isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            decos = [ast.unparse(d) for d in n.decorator_list]
            if any(d.endswith((".setter", ".deleter")) or d.split(".")[-1] == "overload" for d in decos):
                continue
            if n.name in seen:
                out.append(f"aiv/{name}.py:{n.lineno}: class {cls.name} defines {n.name} again (first at line "
                           f"{seen[n.name]}): the later definition replaces the first for every caller")
            seen.setdefault(n.name, n.lineno)
    return out


def long_classes(name, tree):
    """A class over MAX_CLASS_LINES lines, at any depth of the module."""
    return [f"aiv/{name}.py:{n.lineno}: class {n.name} is {n.end_lineno - n.lineno + 1} lines, over the "
            f"{MAX_CLASS_LINES} a class may hold: split it by concern (a mixin or a collaborator each)"
            for n in classes(tree) if n.end_lineno - n.lineno + 1 > MAX_CLASS_LINES]


def problems():
    """Everything wrong with the layering of aiv/, as lines (empty when none)."""
    out = room_problems()
    present = present_modules()
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
        for n in (n for n in tree.body if isinstance(n, ast.ImportFrom) and n.level):
            mod, _names, line = resolve(name, n.level, n.module), [a.name for a in n.names], n.lineno
            src, said = f"aiv/{name}.py:{line}", "." * n.level + (n.module or "")
            if mod not in pos:
                out.append(f"{src}: imports from {said}, which is not a module of BUILD_ORDER "
                           "(write `from .module import name` or `from ..room.module import name`)")
            elif pos[mod] >= pos[name]:
                out.append(f"{src}: imports from {said} (aiv/{mod}.py), which comes "
                           f"{'at' if mod == name else 'after'} {name} in the build order: no import runs back up")
            elif name in PURE and mod in RUNTIME:
                out.append(f"{src}: the pure module {name} imports the runtime module {mod}")
            else:
                out += [f"{src}: imports {x} from {said}, which does not define it" for x in _names
                        if x not in tops.get(mod, ())]
        for n in tree.body:  # only `from .x import` and top-level standard imports are understood
            if isinstance(n, (ast.Import, ast.ImportFrom)) and not getattr(n, "level", 0):
                mods = [a.name for a in n.names] if isinstance(n, ast.Import) else [n.module]
                if any(m.split(".")[0] in ("aiv", "ddp_mesh_ping") for m in mods):
                    out.append(f"aiv/{name}.py:{n.lineno}: absolute import of the tool; use `from .module import` "
                               "or `from ..room.module import`")
        out += duplicate_methods(name, tree) + long_classes(name, tree) + env_write_problems(name, tree)
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
    return out + effect_problems([m for m in BUILD_ORDER if m in present])


def segment(lines, n):
    """The source of statement n from the module's lines (ast.get_source_segment, without its re-split of the
    whole text for every call)."""
    part = lines[n.lineno - 1:n.end_lineno]
    if len(part) == 1:
        return part[0][n.col_offset:n.end_col_offset]
    return part[0][n.col_offset:] + "".join(part[1:-1]) + part[-1][:n.end_col_offset]


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
                std.append(segment(lines, n))
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
