"""A Slurm task's `python ddp_mesh_ping.py ARGS`, forked from the tests' fork server (fork_server.py) instead of
importing torch again: the stand-in python of the Slurm tests' venv (and of the Kubernetes manifests' pods, whose
shell execs `$PYTORCH_ENV/bin/python`: test_k8s_launchers.py).

The Slurm tests' jobs run the batch file with PYTORCH_ENV set to a directory whose bin/python is this stand-in
(task_python writes it). slurmstepd starts it as it would start python, in the node's namespaces. When its
arguments are the tool's script and the fork server agrees (fork_server.refusal: the same script, an environment
torch reads the same), it asks the server for the run: the server forks a child that enters this process's network,
UTS and mount namespaces, takes its CPU affinity and its parent (enter_task), its descriptors 0-2, environment,
directory and umask, and becomes the run. This process stays as the task Slurm sees: the signals a step's task
gets (SIGTERM, SIGINT, SIGCONT, ...) go on to the child; a SIGKILL ends it, and the server kills the child when it
sees it gone; the child's end is its end (its exit status, or the same signal). Anything else (another script,
`-c`, a refusal, no server) is python itself: exec, as before. TEST_FORK_LOG=FILE (the task's, or the one set
where the stand-in was written): each plain start of the tool, and why.

What differs from an exec'd python: the run is not a descendant of slurmstepd (so Slurm's process tracking sees
this stand-in, which lives exactly as long as the run), and what fork_server.py says of any forked run."""
import os
import signal
import socket
import sys

import fork_server as forks

FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2,
             signal.SIGALRM, signal.SIGCONT)


def task_python(directory, server):
    """Make `directory`/bin/python the stand-in for runs of `server`'s script (a PYTORCH_ENV for the batch file);
    returns `directory`."""
    here = os.path.dirname(os.path.abspath(__file__))
    bin_dir = os.path.join(directory, "bin")
    os.makedirs(bin_dir, exist_ok=True)
    path = os.path.join(bin_dir, "python")
    with open(path, "w") as f:
        f.write(f"#!{server.python} -IS\nimport sys\nsys.path.insert(0, {here!r})\nimport fork_task\n"
                f"fork_task.main({server.python!r}, {server.path!r}, {server.script!r}, "
                f"{os.environ.get('TEST_FORK_LOG')!r})\n")
    os.chmod(path, 0o755)
    return directory


def _plain(python, args, why, log):
    forks.said_plain({"TEST_FORK_LOG": log} if log else os.environ, f"a stand-in python on {socket.gethostname()}", why,
                     [python, *args])
    os.execv(python, [python, *args])


def main(python, path, script, log=None):
    """The stand-in's run: python `python`, the fork server at `path` serving `script`, TEST_FORK_LOG `log` when
    the task's environment has none (a prolog's)."""
    args = sys.argv[1:]
    if not args or os.path.realpath(args[0]) != os.path.realpath(script):
        os.execv(python, [python, *args])  # not a run of the tool: python itself
    pending, child = [], []

    def forward(sig, _frame):
        if child:
            os.kill(child[0], sig)
        else:
            pending.append(sig)
    for sig in FORWARDED:
        signal.signal(sig, forward)
    umask = os.umask(0)
    os.umask(umask)
    msg = {"argv": [python, *args], "env": dict(os.environ), "cwd": os.getcwd(), "setsid": True, "pgid": None,
           "umask": umask, "task": True}
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        reply = forks._exchange(conn, path, msg, [0, 1, 2])
    except (OSError, ValueError) as e:
        reply = {"refused": f"the fork server did not answer: {e}"}
    if "pid" not in reply:
        conn.close()
        for sig in FORWARDED:
            signal.signal(sig, signal.SIG_DFL)
        _plain(python, args, reply.get("refused", "refused"), log)
    child.append(reply["pid"])
    for sig in pending:
        os.kill(child[0], sig)
    conn.settimeout(None)
    data = b""
    while b"\n" not in data:
        chunk = conn.recv(4096)
        if not chunk:
            break
        data += chunk
    rc = forks.json.loads(data.split(b"\n", 1)[0])["rc"] if b"\n" in data else -signal.SIGKILL
    if rc >= 0:
        os._exit(rc)
    for sig in FORWARDED:
        signal.signal(sig, signal.SIG_DFL)
    os.kill(os.getpid(), -rc)
    os._exit(128 - rc)
