"""The tests' fork server: ranks of the tool started without importing torch again.

Each run of the tool the tests start as `python ddp_mesh_ping.py ARGS` imports torch (about 2 CPU-seconds on a
2-core machine), and the suite starts many hundreds of them. The fork server is a python of the test venv, one per
pytest process, started on the first request, that imports torch, torch.distributed and what DDP's constructor
imports once (import only: no thread, no computation, nothing that a fork breaks) and forks a child per request.
The child becomes what `python ddp_mesh_ping.py ARGS` would have been: its session or process group as the Popen
call asked, the caller's umask and working directory, stdin/stdout/stderr from the caller's file descriptors
(passed over the Unix socket), every other descriptor closed, the environment replaced wholesale,
/proc/<pid>/cmdline rewritten to `python ddp_mesh_ping.py ARGS` (the server's own command line carries the room: no
exec), sys.argv and sys.path[0] a script's, fresh sys.std* streams, then the script as `runpy.run_path(script,
run_name="__main__")` would run it, from a code object the server compiled once (a 15,000-line script is 0.3 CPU-s
to compile). An exit, an uncaught exception (its traceback on stderr, exit 1) or a signal ends it as it
would end a python (run_and_exit); the server reaps it and writes its return code (-signum for a signal, as Popen
says it) back on the request's connection. The child's own starts of `python ddp_mesh_ping.py ...` (the tool's
local launcher's ranks) are forked in place by the same rule (_in_place): children of the child, as exec would
make them; a start from a child with a second thread running (a node leader starting its monitor) is a fresh
python, which runs the code the server compiled (run_compiled). A child given pod=(hostname, hosts file) enters
a UTS and a mount namespace of its own first (enter_pod), as the tests' Kubernetes pods are. A request from a Slurm
task's stand-in (fork_task.py, task=True) is a child that enters the stand-in's namespaces, CPU affinity and parent
(enter_task), and that the server kills when the stand-in's connection closes (_orphaned).

Under xdist the session's controller starts a zygote (Zygote, `fork_server.py --zygote`): one python that imports
what a server imports, once, and forks each worker's server (zygote()), which then serves as one the worker
started (its owner the worker: it ends when the worker does, watched by a pidfd) without an import of its own (4
CPU-s a worker, all of them at the session's start, when every worker also collects the tests).

Cost, measured on 2 cores: a forked `--help` 0.07 CPU-s, a plain one 0.37. Two things keep a fork cheap: what the
server made is frozen for the garbage collector (gc.freeze: a collection in a child would write to every object,
each page a copy, 0.7 CPU-s a run), and a child ends without the interpreter's teardown (0.3 CPU-s).

The test side is `ToolPopen`, a subprocess.Popen whose start goes through the server: pipes, text mode,
communicate(), wait(timeout) and TimeoutExpired, poll(), kill(), terminate(), send_signal() and `with` are Popen's
own. A start the fork cannot reproduce is a plain Popen (`refusal` says why): another python or script, a shell,
preexec_fn, user/group, pass_fds, close_fds=False, an environment that changes what python or torch read when they
start (PYTHON* but PYTHONUNBUFFERED, which the child's streams honour, and a PYTHONPATH that only adds modules,
which the child puts on sys.path and whose sitecustomize it imports: pythonpath_refusal; LD_*, TORCH_*, PYTORCH_*,
OMP_*, MKL_*, KMP_*, GOMP_*, MALLOC_*, GLIBC_TUNABLES, LC_*, LANG, LANGUAGE differing from the server's; the server
imports torch with the values a rank sets before its own import where they are unset, TOOL_SETS, so unset counts
as those), a command line longer than the room, or a server that does not answer. AIV_TEST_FORK=1 (the default)
turns the server on; 0 makes every start a plain Popen. TEST_FORK_LOG=FILE: each plain start, and why (said_plain).

What differs from a fresh process, by construction: the rank's parent is the fork server (the same for every rank a
pytest process starts, as the pytest process was), /proc/<pid>/environ shows the server's starting environment
(os.environ and getenv are the request's), the command line ends in padding NULs, the string hash seed is the
server's, DDP's imports are done before the DDP step, the objects the child did not make are never collected,
no object's finaliser runs at the end, a PYTHONPATH's sitecustomize runs after the server's own sitecustomize
(where it had one) rather than instead of it, and after torch's import rather than before; a fresh python of
_in_place has the server's file in sys.orig_argv.
"""
import contextlib
import faulthandler
import gc
import inspect
import json
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

ROOM = 8192  # bytes of command line a child can have: the server's own argv carries them as padding
_SENSITIVE_PREFIXES = ("PYTHON", "LD_", "TORCH_", "PYTORCH_", "OMP_", "MKL_", "KMP_", "GOMP_", "MALLOC_", "LC_")
_SENSITIVE = ("GLIBC_TUNABLES", "LANG", "LANGUAGE")


# PYTHONUNBUFFERED: a forked child makes its std streams as python -u would (_stdio); PYTORCH_ENV: the tool's
# own (where its venv lives), which neither python nor torch reads
_HONOURED = ("PYTHONUNBUFFERED", "PYTORCH_ENV")
# What a rank of the tool sets, when unset, before it imports torch (aiv/run/setup.py, own_variables): the server
# imports torch as such a rank would, and a request that leaves one unset is one that sets it so
TOOL_SETS = {"TORCH_CPP_LOG_LEVEL": "FATAL", "TORCH_FR_BUFFER_SIZE": "2000", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "2"}


def sensitive(name):
    """Whether a variable changes what python or torch read as they start (so a fork cannot honour it)."""
    return (name.startswith(_SENSITIVE_PREFIXES) or name in _SENSITIVE) and name not in _HONOURED


def env_refusal(env, server_env):
    """Why a fork of a server started with `server_env` cannot run with `env`, or None (PYTHONPATH: see
    pythonpath_refusal)."""
    for k in sorted(set(env) | set(server_env)):
        if k != "PYTHONPATH" and sensitive(k) and env.get(k, TOOL_SETS.get(k)) != server_env.get(k, TOOL_SETS.get(k)):
            return f"{k} differs from the fork server's"
    return None


def _top_names(entry):
    """The top-level names a PYTHONPATH directory offers to import: its modules, extensions and directories (a
    directory may be a package or a namespace package's portion)."""
    try:
        names = os.listdir(entry)
    except OSError:  # not there (python keeps it on sys.path, and it offers nothing) or unreadable
        return set() if not os.path.exists(entry) else {None}
    return {n.split(".", 1)[0] for n in names if n != "__pycache__" and (os.path.isdir(os.path.join(entry, n))
                                                                     or n.endswith((".py", ".pyc", ".so")))}


def pythonpath_refusal(value, now, path):
    """Why a fork of a process whose PYTHONPATH is `now` (what it applied: the server's, or a forked child's)
    cannot honour PYTHONPATH=`value`, or None. A fork honours a PYTHONPATH whose directories add modules only:
    it puts them on sys.path where python would (after the script's directory) and imports their sitecustomize,
    as python's site does (apply_pythonpath). It cannot take back what this process imported or ran, so it
    refuses one that shadows a module importable from `path` (this process's sys.path without those
    directories: what it may have imported already), a usercustomize, an entry that is relative or not a
    directory, a change of a PYTHONPATH this process applied already, or the same one once its sitecustomize ran
    here (a fresh python would run it again, on a state without its effects)."""
    if value == now:
        return None if not (now and _sitecustomize(now)) else "this process ran its PYTHONPATH's sitecustomize"
    if now or not value:
        return "PYTHONPATH differs from the fork server's"
    import importlib.machinery
    entries = value.split(os.pathsep)
    if not all(os.path.isabs(e) for e in entries):  # (relative: to a directory this side cannot be sure of)
        return "PYTHONPATH with an empty or relative entry"
    entries = [os.path.normpath(e) for e in entries]
    search = [p for p in path if p and os.path.normpath(os.path.abspath(p)) not in entries]
    for entry in entries:
        for name in sorted(_top_names(entry), key=str):
            if name is None:
                return f"PYTHONPATH's {entry} is not a directory the fork can read"
            if name == "usercustomize" or name in sys.builtin_module_names or (
                    name != "sitecustomize" and importlib.machinery.PathFinder.find_spec(name, search)):
                return f"PYTHONPATH's {entry} shadows {name}, which the fork server may have imported"
    return None


def _sitecustomize(value):
    import importlib.machinery
    return importlib.machinery.PathFinder.find_spec("sitecustomize", [os.path.abspath(e)
                                                                       for e in value.split(os.pathsep)])


APPLIED = {"PYTHONPATH": None}  # what this process applied of a request's PYTHONPATH (apply_pythonpath)


def apply_pythonpath(value):
    """What python does at its start with PYTHONPATH=`value`, done in a forked child (pythonpath_refusal let it
    through): its directories on sys.path after the script's, then their sitecustomize imported, an error in it
    said as site says it (the server's own sitecustomize, where it had one, ran at its start: the request's runs
    as well, not instead)."""
    if not value or value == APPLIED["PYTHONPATH"]:
        return
    APPLIED["PYTHONPATH"] = value
    sys.path[1:1] = [os.path.abspath(e) for e in value.split(os.pathsep)]
    import importlib
    importlib.invalidate_caches()
    if _sitecustomize(value):
        sys.modules.pop("sitecustomize", None)
        try:
            import sitecustomize  # noqa: F401
        except ImportError as err:
            if err.name != "sitecustomize":
                _site_error(err)
        except Exception as err:
            _site_error(err)


def _site_error(err):
    sys.stderr.write(f"Error in sitecustomize; set PYTHONVERBOSE for traceback:\n{type(err).__name__}: {err}\n")


def cmdline(argv):
    return b"\0".join(os.fsencode(a) for a in argv) + b"\0"


def refusal(argv, env, server_env, python, script):
    """Why `argv` with `env` cannot be forked from a server of `python` serving `script`, or None."""
    if len(argv) < 2 or os.path.abspath(argv[0]) != os.path.abspath(python):
        return "another python"
    if os.path.realpath(argv[1]) != os.path.realpath(script):
        return "another script"
    if len(cmdline(argv)) > ROOM:
        return "a command line longer than the fork server's room"
    return env_refusal(env, server_env) or pythonpath_refusal(env.get("PYTHONPATH"), APPLIED["PYTHONPATH"]
                                                              or server_env.get("PYTHONPATH"), sys.path)


# ---------------------------------------------------------------------------- the server
def _send(conn, msg):
    try:
        conn.sendall(json.dumps(msg).encode() + b"\n")
    except OSError:  # the test side went away: nothing to tell
        pass


def _read_request(conn):
    conn.settimeout(30)
    data, fds = b"", []
    while not data.endswith(b"\n"):
        chunk, got, _, _ = socket.recv_fds(conn, 1 << 20, 8)
        fds += got
        if not chunk:
            break
        data += chunk
    return json.loads(data), fds


def _import_once():
    """What every child would import, imported once, then frozen: what the server made is never collected in a
    child (a collection walks every object, torch's are many, and in a forked child each page it writes to is a
    copy: 0.7 CPU-s a run; a fresh python has nothing to walk)."""
    import torch  # noqa: F401  (import only: no thread, no computation, before any fork)
    import torch._dynamo  # noqa: F401  (what DDP's constructor imports: 1-2 CPU-s more a rank that reaches it)
    import torch.distributed  # noqa: F401
    import torch.nn.parallel  # noqa: F401
    gc.freeze()


class _Refused(Exception):
    """A request the server will not fork (its reason)."""


def _woken_by_children():
    """A pipe's read end that a child's end (SIGCHLD) makes readable, for select."""
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *a: None)
    return wake_r


def serve(listen_fd, parent, script):
    """Accept requests until `parent` (its pytest process) goes; returns (request, fds) in a forked child only."""
    _import_once()
    owner = os.pidfd_open(parent)  # readable once the pytest process is gone (its parent, or not: a zygote's)
    lst = socket.socket(fileno=listen_fd)
    global CODE_FILE  # the script compiled once (0.3 CPU-s a start otherwise), before any fork
    CODE_FILE = save_compiled(script, os.path.join(os.path.dirname(lst.getsockname()), "code"))
    wake_r = _woken_by_children()
    server_env = dict(os.environ)
    SERVER_ENV.update(server_env)
    kids = {}  # pid -> the connection its status goes back on
    tasks = set()  # the pids of tasks' children (fork_task.py): killed when their stand-in goes
    while True:
        tied = [kids[p] for p in tasks if p in kids]
        ready, _, _ = select.select([lst, wake_r, owner, *tied], [], [], 1.0)
        if owner in ready:
            break
        if wake_r in ready:
            with contextlib.suppress(BlockingIOError):
                while os.read(wake_r, 512):
                    pass
        _reap(kids)
        _orphaned(kids, tasks, ready)
        if lst not in ready:
            continue
        try:
            conn, _ = lst.accept()
        except OSError:
            continue
        fds = []
        try:
            req, fds = _read_request(conn)
            why = _server_refusal(conn, req, fds, server_env, script)
            if why:
                raise _Refused(why)
            pid = os.fork()
        except Exception as e:  # a request we cannot serve: the caller starts python itself
            _send(conn, {"refused": str(e) if isinstance(e, _Refused) else f"{type(e).__name__}: {e}"})
            conn.close()
            for fd in fds:  # (the caller's pipes: a copy kept here would hold them open)
                os.close(fd)
            continue
        if pid == 0:
            signal.set_wakeup_fd(-1)
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            for c in kids.values():
                c.close()
            conn.close()
            lst.close()
            os.close(owner)
            return req, fds
        for fd in fds:
            os.close(fd)
        conn.settimeout(None)
        _send(conn, {"pid": pid})
        kids[pid] = conn
        if req.get("task"):
            tasks.add(pid)
    return None


def _orphaned(kids, tasks, ready):
    """A task's child whose stand-in went (its connection reads as closed: SIGKILLed by Slurm, as a step's task
    can be) is killed, as the process the stand-in would have exec'd would have died with it."""
    for pid in list(tasks):
        conn = kids.get(pid)
        if conn is None:
            tasks.discard(pid)
        elif conn in ready:
            with contextlib.suppress(OSError):
                if conn.recv(1):
                    continue
            tasks.discard(pid)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def zygote(listen_fd, parent):
    """`fork_server.py --zygote`: one python for a whole xdist session, started by its controller (`parent`),
    that imports what a server imports (_import_once) once and forks a server for each pytest worker that asks:
    a worker's server then costs no import of its own (4 CPU-s each, all at the session's start). A request
    brings the worker's listening socket, its pid (the server's owner: serve ends when it is gone), the script
    and the environment its server would have started with; one whose variables python or torch read at their
    start differ from the zygote's is refused (the worker then starts a server of its own). Returns
    (listening fd, owner, script) in a forked server only."""
    _import_once()
    lst = socket.socket(fileno=listen_fd)
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # its servers are reaped by the kernel
    here = dict(os.environ)
    owner = os.pidfd_open(parent)
    while True:
        ready, _, _ = select.select([lst, owner], [], [], 1.0)
        if owner in ready:
            return None
        if lst not in ready:
            continue
        fds = []
        try:
            conn, _ = lst.accept()
            req, fds = _read_request(conn)
            why = env_refusal(req["env"], here) if len(fds) == 1 else "not one descriptor"
            if why:
                raise ValueError(why)
            pid = os.fork()
        except Exception as e:  # a request we cannot serve: the worker starts a server of its own
            with contextlib.suppress(NameError):
                _send(conn, {"refused": f"{type(e).__name__}: {e}"})
                conn.close()
            for fd in fds:
                os.close(fd)
            continue
        if pid == 0:
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            conn.close()
            lst.close()
            os.close(owner)
            os.environ.clear()
            os.environ.update(req["env"])
            return fds[0], req["owner"], req["script"]
        os.close(fds[0])
        _send(conn, {"pid": pid})
        conn.close()


def _reap(kids):
    """Each child of the server that ended: its return code back on its request's connection."""
    while kids:
        pid, status = os.waitpid(-1, os.WNOHANG)
        if not pid:
            return
        conn = kids.pop(pid, None)
        if conn is not None:
            _send(conn, {"rc": os.waitstatus_to_exitcode(status)})
            conn.close()


def _server_refusal(conn, req, fds, server_env, script):
    import struct
    creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    peer, uid, _ = struct.unpack("3i", creds)
    if uid != os.getuid():
        return "another user"
    if len(fds) != 3:
        return "not three descriptors"
    if (req.get("pod") or req.get("task")) and os.geteuid() != 0:
        return "a pod's or a task's namespaces need root"
    req["peer"] = peer  # (a task's stand-in: the child enters its namespaces, enter_task)
    return refusal(req["argv"], req["env"], server_env, sys.executable, script)


def pod_argv(pod, argv):
    """`argv` in a pod of its own, as the tests' Kubernetes pods are started without the fork server: a UTS and a
    mount namespace of its own, hostname `pod[0]`, the file `pod[1]` as its /etc/hosts."""
    return ["unshare", "--uts", "--mount", "sh", "-c", 'mount --bind "$1" /etc/hosts && hostname "$2" && shift 2 && '
            'exec "$@"', "pod", pod[1], pod[0], *argv]


def enter_pod(hostname, hosts):
    """What pod_argv's unshare, mount and hostname do, done by this (single-threaded, forked) process itself: a
    new UTS and mount namespace (its mounts private, as unshare --mount makes them), `hosts` bound over
    /etc/hosts, the hostname set."""
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    clone_newns, clone_newuts, ms_bind, ms_rec, ms_private = 0x20000, 0x4000000, 4096, 16384, 1 << 18

    def ok(rc, what):
        if rc != 0:
            raise OSError(ctypes.get_errno(), f"{what}: {os.strerror(ctypes.get_errno())}")
    ok(libc.unshare(clone_newns | clone_newuts), "unshare")
    ok(libc.mount(b"none", b"/", None, ms_rec | ms_private, None), "mount --make-rprivate /")
    ok(libc.mount(os.fsencode(hosts), b"/etc/hosts", None, ms_bind, None), f"mount --bind {hosts} /etc/hosts")
    name = os.fsencode(hostname)
    ok(libc.sethostname(name, len(name)), "sethostname")


def enter_task(pid):
    """What the process `pid` (a task's stand-in, fork_task.py) would have exec'd shares with it, taken by this
    (single-threaded, forked) process: its network, UTS and mount namespaces (a node of the Slurm test cluster),
    its CPU affinity (srun's --cpu-bind), and its parent, as os.getppid() says it (the step's daemon, or rank 0's
    shell: a launch's identity, aiv's launch_key)."""
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    with open(f"/proc/{pid}/stat") as f:
        ppid = int(f.read().rsplit(")", 1)[1].split()[1])
    cpus = os.sched_getaffinity(pid)
    fds = [os.open(f"/proc/{pid}/ns/{ns}", os.O_RDONLY) for ns in ("net", "uts", "mnt")]
    try:
        for fd in fds:
            if libc.setns(fd, 0) != 0:
                raise OSError(ctypes.get_errno(), f"setns: {os.strerror(ctypes.get_errno())}")
    finally:
        for fd in fds:
            os.close(fd)
    os.sched_setaffinity(0, cpus)
    me, real = os.getpid(), os.getppid
    os.getppid = lambda: ppid if os.getpid() == me else real()  # (its own children, forked in place: their own)


def _set_cmdline(argv):
    """/proc/self/cmdline := argv, written over this process's own argument area (no exec)."""
    import ctypes
    with open("/proc/self/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    start, end = int(fields[45]), int(fields[46])  # arg_start, arg_end (stat fields 48 and 49)
    data = cmdline(argv)
    ctypes.memmove(start, data + b"\0" * (end - start - len(data)), end - start)


def _stdio(unbuffered):
    """Fresh sys.stdin/stdout/stderr on descriptors 0-2, as python makes them at its start."""
    import io
    made = []
    for fd, old in ((0, sys.__stdin__), (1, sys.__stdout__), (2, sys.__stderr__)):
        raw = io.FileIO(fd, "rb" if fd == 0 else "wb", closefd=False)
        if fd == 0:
            buf, lines = io.BufferedReader(raw), False
        elif unbuffered:
            buf, lines = raw, False
        else:
            buf, lines = io.BufferedWriter(raw), fd == 2 or raw.isatty()
        made.append(io.TextIOWrapper(buf, encoding=old.encoding, errors=old.errors, line_buffering=lines,
                                     write_through=bool(unbuffered and fd)))
    sys.stdin, sys.stdout, sys.stderr = made
    sys.__stdin__, sys.__stdout__, sys.__stderr__ = made


def _session(setsid, pgid):
    if setsid:
        os.setsid()
    elif pgid is not None:
        os.setpgid(0, pgid)


def _own_fds(fds):
    """Descriptors 0-2 := fds, every other descriptor closed."""
    high = [os.dup(fd) for fd in fds]  # out of 0-2 first: a source may be one of the targets
    for target, fd in enumerate(high):
        os.dup2(fd, target)
    for name in os.listdir("/proc/self/fd"):
        if int(name) > 2:
            try:
                os.close(int(name))
            except OSError:
                pass


def become(req, fds):
    """In the forked child: turn into `python SCRIPT ARGS` as the request describes, run it, and end as it ends."""
    def prepare():
        if req.get("task"):
            enter_task(req["peer"])
        _session(req.get("setsid"), req.get("pgid"))
        if req.get("pod"):
            enter_pod(*req["pod"])
        os.umask(req["umask"])
        os.chdir(req["cwd"])
        _own_fds(fds)
        faulthandler.enable(file=sys.__stderr__)  # (a crash of a forked run says where, on the caller's stderr)
    run_and_exit(prepare, lambda: _run_script(req["argv"], req["env"]))


def _run_script(argv, env):
    """The rest of becoming `python SCRIPT ARGS` (descriptors, session and directory already set): the
    environment, the command line, sys.argv, fresh std streams, then the script as __main__. The tool's own
    starts of `python SCRIPT ...` from here on (its local launcher's ranks) are forked in place (_in_place)."""
    os.environ.clear()
    os.environ.update(env)
    tempfile.tempdir = None  # gettempdir() reads TMPDIR again
    time.tzset()
    _stdio(bool(os.environ.get("PYTHONUNBUFFERED")))
    apply_pythonpath(env.get("PYTHONPATH"))
    subprocess.Popen._execute_child = _in_place(argv[1])
    _run_as_main(argv, compiled(argv[1]))


def _run_as_main(argv, code):
    """argv = [python, SCRIPT, ARGS...]: /proc/self/cmdline, sys.argv and sys.path[0] as python gives them to a
    script, then `code` (the script's, or None: runpy compiles it) run as runpy.run_path runs it; an uncaught
    exception is said as python says it (from the script's frames on), exit 1."""
    _set_cmdline(argv)
    script = argv[1]
    sys.argv = list(argv[1:])
    sys.path[0] = os.path.dirname(os.path.abspath(script))
    import runpy
    try:
        if code is None:
            runpy.run_path(script, run_name="__main__")
        else:  # what run_path does with the code it compiles: a fresh __main__, sys.argv[0] the script
            runpy._run_module_code(code, None, "__main__", pkg_name="", script_name=script)
    except (SystemExit, KeyboardInterrupt):
        raise
    except BaseException as e:  # python's own report of an uncaught exception: from the script's frames on
        tb = e.__traceback__
        while tb is not None and tb.tb_frame.f_code.co_filename != script:
            tb = tb.tb_next
        e.__traceback__ = tb or e.__traceback__
        sys.excepthook(type(e), e, e.__traceback__)
        sys.exit(1)


def said_plain(env, where, why, argv):
    """TEST_FORK_LOG=FILE (in `env`): a JSON line for each start of a tool's run that is a plain Popen (a fresh
    python importing torch), where it was started (the test, or in place under a forked run), why, and the
    command's first words: what keeps the suite's CPU up."""
    path = env.get("TEST_FORK_LOG")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps({"where": where, "why": why, "argv": argv[:3]}) + "\n")


_COMPILED = {}  # script -> (its size and mtime, its code), compiled in the server
CODE_FILE = None  # the server's compiled script on disk (save_compiled), for the fresh pythons of _in_place


def _key(script):
    """What says a script is unchanged: its size and mtime (a list, as the compiled file's JSON line keeps it)."""
    st = os.stat(script)
    return [st.st_size, st.st_mtime_ns]


def save_compiled(script, path):
    """The server's compiled script in `path` (its size and mtime on the first line, then marshal's bytes): a
    start _in_place cannot fork is a fresh python that loads it (run_compiled) instead of compiling again."""
    import marshal
    code = compiled(script)
    if code is None:
        return None
    with open(path + ".tmp", "wb") as f:
        f.write(json.dumps(_key(script)).encode() + b"\n" + marshal.dumps(code))
    os.replace(path + ".tmp", path)
    return path


def run_compiled(code_file, argv):
    """A fresh python started by _in_place (`python fork_server.py --compiled CODE_FILE SCRIPT ARGS`): the
    script's code from CODE_FILE where it is still the script's (its size and mtime), else compiled here, run
    as `python SCRIPT ARGS` would run it."""
    import marshal
    code = None
    try:
        with open(code_file, "rb") as f:
            key, data = f.read().split(b"\n", 1)
        if json.loads(key) == _key(argv[1]):
            code = marshal.loads(data)
    except (OSError, ValueError, EOFError, TypeError):
        pass
    _run_as_main(argv, code if code is not None else compiled(argv[1]))


def compiled(script):
    """The script's code object as python would compile it to run it, compiled once per content (its size and
    mtime); None where runpy's own run_path must run it (an unreadable file, or a runpy without the helper)."""
    if not hasattr(__import__("runpy"), "_run_module_code"):
        return None
    try:
        key = _key(script)
        if _COMPILED.get(script, (None,))[0] != key:
            with open(script, "rb") as f:
                _COMPILED[script] = key, compile(f.read(), script, "exec", dont_inherit=True)
    except (OSError, SyntaxError, ValueError):
        return None
    return _COMPILED[script][1]


_PLAIN_EXECUTE = subprocess.Popen._execute_child


def call_refusal(a, preexec_ok):
    """Why a Popen called with `a` (_execute_child's arguments by name) cannot be a fork, or None: a shell,
    another executable, pass_fds, close_fds=False, a user, group or umask, restore_signals=False, and a preexec_fn
    unless the fork runs it itself (preexec_ok)."""
    if a.get("shell") or a.get("executable") is not None:
        return "a shell or another executable"
    if (a.get("preexec_fn") is not None and not preexec_ok) or a.get("pass_fds") or not a.get("close_fds", True):
        return "preexec_fn, pass_fds or close_fds=False"
    if any(a.get(k) not in (None, -1) for k in ("uid", "gid", "gids", "umask")):
        return "user, group or umask"
    if not a.get("restore_signals", True):
        return "restore_signals=False"
    return None
SERVER_ENV = {}  # the server's starting environment (serve), what torch was imported under


def _in_place(script):
    """Popen._execute_child for a forked child: a start of `python SCRIPT ARGS` (this python, this script) that
    a fork can reproduce is forked from this process, which has torch imported, as a child of it (its parent is
    who asked, as with exec: PR_SET_PDEATHSIG, getppid, /proc see the same); any other start is Popen's own."""
    def execute(self, *args):
        a = dict(zip(_EXEC_PARAMS, args, strict=False))
        env = os.environ if a.get("env") is None else a["env"]
        env = {os.fsdecode(k): os.fsdecode(v) for k, v in env.items()}
        argv = a["args"] if isinstance(a["args"], (list, tuple)) else [a["args"]]
        argv = [os.fsdecode(x) for x in argv]
        why = refusal(argv, env, SERVER_ENV, sys.executable, script)
        if why is None:
            why = "an unknown Popen" if len(args) != len(_EXEC_PARAMS) else call_refusal(a, preexec_ok=True)
        where = f"in place, under {sys.argv[0]}, {os.environ.get('PYTEST_CURRENT_TEST')}"
        if why is None and threading.active_count() > 1:
            # a fork here could inherit a lock another thread holds: a fresh python (Popen's own start, this
            # process its parent), which runs the code the server compiled rather than compiling it again
            why = f"{threading.active_count()} threads: " + ", ".join(t.name for t in threading.enumerate())
            if CODE_FILE is not None and os.path.exists(CODE_FILE):
                said_plain(SERVER_ENV, where, why + " (the compiled script)", argv)
                fresh = [argv[0], os.path.abspath(__file__), "--compiled", CODE_FILE, *argv[1:]]
                return _PLAIN_EXECUTE(self, fresh, *args[1:])
        if why is not None:
            if why != "another python":  # (a start of another program is not one of ours to fork)
                said_plain(SERVER_ENV, where, why, argv)
            return _PLAIN_EXECUTE(self, *args)
        for stream in (sys.stdout, sys.stderr):  # nothing buffered here is written twice
            stream.flush()
        fds = [a["p2cread"] if a["p2cread"] != -1 else 0, a["c2pwrite"] if a["c2pwrite"] != -1 else 1,
               a["errwrite"] if a["errwrite"] != -1 else 2]
        pid = os.fork()
        if pid == 0:
            _child(argv, env, a, fds)
        self.pid, self._child_created = pid, True
        self._close_pipe_fds(a["p2cread"], a["p2cwrite"], a["c2pread"], a["c2pwrite"], a["errread"], a["errwrite"])
    return execute


def _child(argv, env, a, fds):
    """The forked child of _in_place: as _posixsubprocess orders it (session, descriptors, directory, preexec_fn),
    then the script; it ends here (run_and_exit) as python would end, never unwinding into the caller's frames."""
    def prepare():
        gc.freeze()  # what the caller made is never collected here (see _import_once)
        for sig in signal.valid_signals():  # a fresh python's handlers, not the caller's
            if callable(signal.getsignal(sig)) and sig != signal.SIGINT:
                signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.set_wakeup_fd(-1)
        pg = a.get("process_group")
        _session(a.get("start_new_session"), None if pg in (None, -1) else pg)
        _own_fds(fds)
        if a.get("cwd") is not None:
            os.chdir(a["cwd"])
        if a.get("preexec_fn") is not None:
            a["preexec_fn"]()
    run_and_exit(prepare, lambda: _run_script(argv, env))


def run_and_exit(prepare, run):
    """A forked process's life: prepare() (becoming the process: its failure is said as Popen's child says it,
    exit 255), run() (the script as __main__), then python's end of a process: non-daemon threads joined, atexit
    handlers run, std streams flushed, the exit status (SystemExit's code, a message on stderr; a
    KeyboardInterrupt: killed by SIGINT). It ends by os._exit, without the interpreter's teardown of every object:
    in a process forked from one that imported torch, that teardown copies every page it touches (0.3 CPU-s a
    run) and closes only what the kernel closes anyway (the tool closes the files it writes)."""
    code = 1
    try:
        prepare()
        try:
            run()
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
            if not isinstance(e.code, int) and e.code is not None:
                print(e.code, file=sys.stderr)
        except KeyboardInterrupt:
            code = -signal.SIGINT
        threading._shutdown()
        import atexit
        atexit._run_exitfuncs()
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
    except BaseException:  # the start itself failed: said as Popen's child would say it, exit 255
        import traceback
        traceback.print_exc()
        code = 255
    finally:
        if code == -signal.SIGINT:
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGINT)
        os._exit(code & 0xFF)


# ---------------------------------------------------------------------------- the test side
def enabled():
    return os.environ.get("AIV_TEST_FORK", "1") == "1"


ZYGOTE_VAR = "TEST_FORK_ZYGOTE"  # the socket of the session's zygote, where the controller started one (not AIV_*:
# the tool refuses a variable of its prefix it does not know, and some tests run it in their own environment)


def _ask(path, msg, fds):
    """One request to a server or a zygote at `path`: its JSON reply (raises OSError when none comes)."""
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    with conn:
        return _exchange(conn, path, msg, fds)


def _exchange(conn, path, msg, fds):
    """Connect `conn` to `path`, send `msg` with `fds`, and return the JSON line it answers (the first request
    waits for the imports: 300 s)."""
    conn.settimeout(300)
    conn.connect(path)
    socket.send_fds(conn, [json.dumps(msg).encode() + b"\n"], fds)
    data = b""
    while not data.endswith(b"\n"):
        chunk = conn.recv(4096)
        if not chunk:
            raise OSError("closed without a reply")
        data += chunk
    return json.loads(data)


def _listening(prefix, backlog):
    """(a private directory, the path of a Unix socket in it, that socket listening)."""
    where = tempfile.mkdtemp(prefix=prefix)
    path = os.path.join(where, "s")
    lst = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    lst.bind(path)
    lst.listen(backlog)
    return where, path, lst


class Zygote:
    """The session's zygote (zygote()), started by an xdist controller: its workers' servers are forked from it
    (Server, where ZYGOTE_VAR names its socket) instead of each importing torch."""

    def __init__(self, env, python=sys.executable):
        self.dir, self.path, lst = _listening("aiv-zygote-", 64)
        try:
            self.proc = subprocess.Popen([python, os.path.abspath(__file__), "--zygote", str(lst.fileno()),
                                          str(os.getpid()), " " * ROOM], pass_fds=[lst.fileno()],
                                         env={**TOOL_SETS, **env}, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
        finally:
            lst.close()

    def stop(self):
        """Kill it (where it still runs) and remove its directory."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        import shutil
        shutil.rmtree(self.dir, ignore_errors=True)


class _Forked:
    """A server the zygote forked (not this process's child): Popen's poll, kill and wait, through a pidfd."""

    def __init__(self, pid):
        self.pid, self.fd, self.returncode = pid, os.pidfd_open(pid), None

    def poll(self):
        if self.returncode is None and select.select([self.fd], [], [], 0)[0]:
            self.returncode = -signal.SIGKILL  # (its status is the zygote's to read: gone is what counts here)
        return self.returncode

    def kill(self):
        with contextlib.suppress(ProcessLookupError):
            signal.pidfd_send_signal(self.fd, signal.SIGKILL)

    def wait(self, timeout=None):
        select.select([self.fd], [], [], timeout)
        return self.poll()


class Server:
    """A fork server for this process, reached over a Unix socket in a private directory: forked by the session's
    zygote where there is one (ZYGOTE_VAR) and it agrees, else a python started here."""

    def __init__(self, script, env, python=sys.executable):
        self.script, self.env, self.python = str(script), {**TOOL_SETS, **env}, python
        self.dir, self.path, lst = _listening("aiv-fork-", 128)
        try:
            self.proc = self._from_zygote(lst)
            if self.proc is None:
                argv = [python, os.path.abspath(__file__), str(lst.fileno()), str(os.getpid()),
                        os.fsencode(self.script).hex(), " " * ROOM]
                self.proc = subprocess.Popen(argv, pass_fds=[lst.fileno()], env=self.env, stdin=subprocess.DEVNULL,
                                             stdout=subprocess.DEVNULL)
        finally:
            lst.close()  # the server's copy is the only one: a dead server refuses connections

    def _from_zygote(self, lst):
        zygote = os.environ.get(ZYGOTE_VAR)
        if not zygote or os.path.realpath(self.python) != os.path.realpath(sys.executable):
            return None
        try:
            reply = _ask(zygote, {"owner": os.getpid(), "script": self.script, "env": self.env}, [lst.fileno()])
        except (OSError, ValueError):
            return None
        return _Forked(reply["pid"]) if "pid" in reply else None

    def alive(self):
        return self.proc.poll() is None

    stop = Zygote.stop

    def request(self, argv, env, cwd, setsid, pgid, fds, pod=None):
        """-> (connection, pid); raises OSError or ValueError (the reason) when the server will not fork."""
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            umask = os.umask(0)
            os.umask(umask)
            msg = {"argv": list(argv), "env": env, "cwd": cwd, "setsid": setsid, "pgid": pgid, "umask": umask,
                   "pod": pod}
            reply = _exchange(conn, self.path, msg, fds)
            if "pid" not in reply:
                raise ValueError(reply.get("refused", "refused"))
            conn.settimeout(None)
            return conn, reply["pid"]
        except BaseException:
            conn.close()
            raise


_EXEC_PARAMS = list(inspect.signature(subprocess.Popen._execute_child).parameters)[1:]


class ToolPopen(subprocess.Popen):
    """subprocess.Popen whose child is forked by `server` when the fork can reproduce the start (`forked`; else
    `fallback` says why and it is a plain Popen). pod=(hostname, hosts file): the child in a pod of its own
    (enter_pod when forked, pod_argv's unshare when plain)."""

    def __init__(self, args, *, server=None, pod=None, **kwargs):
        self._server, self._conn, self._buf = server, None, b""
        self._pod = None if pod is None else (str(pod[0]), os.fspath(pod[1]))
        self._status_lock = threading.Lock()
        self.forked, self.fallback = False, None
        super().__init__(args, **kwargs)

    def _why_not(self, a):
        if self._server is None:
            return "no fork server"
        if not self._server.alive():
            return "the fork server is not running"
        why = call_refusal(a, preexec_ok=False)  # (a preexec_fn cannot travel to the server)
        if why:
            return why
        cwd = a.get("cwd")
        if cwd is not None and not os.path.isdir(cwd):
            return "no such working directory"
        env = os.environ if a.get("env") is None else a["env"]
        return refusal([os.fsdecode(x) for x in a["args"]], {os.fsdecode(k): os.fsdecode(v) for k, v in env.items()},
                       self._server.env, self._server.python, self._server.script)

    def _execute_child(self, *args):
        known = len(args) == len(_EXEC_PARAMS)
        a = dict(zip(_EXEC_PARAMS, args, strict=False))
        self.fallback = self._why_not(a) if known else "an unknown Popen"
        if self.fallback is None:
            fds = [a["p2cread"] if a["p2cread"] != -1 else 0, a["c2pwrite"] if a["c2pwrite"] != -1 else 1,
                   a["errwrite"] if a["errwrite"] != -1 else 2]
            env = os.environ if a.get("env") is None else a["env"]
            pg = a.get("process_group")
            try:
                self._conn, self.pid = self._server.request(
                    [os.fsdecode(x) for x in a["args"]], {os.fsdecode(k): os.fsdecode(v) for k, v in env.items()},
                    os.fsdecode(a["cwd"]) if a.get("cwd") is not None else os.getcwd(),
                    bool(a.get("start_new_session")), None if pg in (None, -1) else pg, fds, self._pod)
            except (OSError, ValueError) as e:
                self.fallback = f"the fork server did not fork: {e}"
            else:
                self.forked, self._child_created = True, True
                self._close_pipe_fds(a["p2cread"], a["p2cwrite"], a["c2pread"], a["c2pwrite"], a["errread"],
                                     a["errwrite"])
                return
        said_plain(os.environ, os.environ.get("PYTEST_CURRENT_TEST", "?"), self.fallback,
                   [os.fsdecode(x) for x in a["args"]] if known else [])
        if self._pod is not None:
            args = (pod_argv(self._pod, list(args[0])), *args[1:])
        super()._execute_child(*args)

    def _read_status(self, timeout):
        """Read the server's status line within `timeout` (None: until it comes); True once returncode is set."""
        if self.returncode is not None:
            return True
        ready, _, _ = select.select([self._conn], [], [], timeout)
        if not ready:
            return False
        chunk = self._conn.recv(4096)
        self._buf += chunk
        if b"\n" in self._buf:
            self.returncode = json.loads(self._buf.split(b"\n", 1)[0])["rc"]
        elif not chunk:  # the server went away without a status: the child's end is unknown
            self.returncode = -signal.SIGKILL
        if self.returncode is not None:
            self._conn.close()
        return self.returncode is not None

    def _internal_poll(self, *args, **kwargs):
        if not self.forked:
            return super()._internal_poll(*args, **kwargs)
        with self._status_lock:
            self._read_status(0)
        return self.returncode

    def _wait(self, timeout):
        if not self.forked:
            return super()._wait(timeout)
        end = None if timeout is None else time.monotonic() + timeout
        with self._status_lock:
            while not self._read_status(None if end is None else max(0.0, end - time.monotonic())):
                if end is not None and time.monotonic() >= end:
                    raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode


if __name__ == "__main__" and sys.argv[1:2] == ["--compiled"]:  # a fresh python of _in_place
    run_compiled(sys.argv[2], [sys.orig_argv[0], *sys.argv[3:]])
elif __name__ == "__main__" and sys.argv[1:2] == ["--zygote"]:  # argv: its listening fd, its controller's pid, room
    made = zygote(int(sys.argv[2]), int(sys.argv[3]))
    if made is None:
        sys.exit(0)
    job = serve(*made)
    if job is None:
        os._exit(0)
    become(*job)
elif __name__ == "__main__":
    # argv: the listening socket's fd, the parent's pid, the script in hex (so that no search of command lines
    # for the script's path takes the server for a run of the tool), the room for the children's command lines
    job = serve(int(sys.argv[1]), int(sys.argv[2]), os.fsdecode(bytes.fromhex(sys.argv[3])))
    if job is None:
        sys.exit(0)
    become(*job)
