"""Floor 6: the local launcher: one rank per visible GPU, or --nproc gloo ranks on CPU; the whole job in
local mode, or this node's ranks of a per-node launch (Kubeflow Trainer v2, PyTorchJob v1, Kubernetes Jobs)."""
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time

from ..checks.judge import STOPPED_WORDS
from ..core.base import EXIT_FAIL, EXIT_INTERRUPTED, EXIT_PASS, EXIT_TIMEOUT, format_ranges
from ..core.deadlines import ACKS_S, LAUNCHER_SLACK_S, NAMING_S, deadlines, worst_case
from ..core.speak import emit
from ..run.liveness import launch_key, sweep_said
from .contract import SECRET_VAR
from .launchers import LAUNCH_VAR
from .plan import free_port


def die_with_parent(sig):
    """A Popen preexec_fn: the child gets `sig` when the process that started it dies (prctl
    PR_SET_PDEATHSIG), and ends at once where that process is already gone."""
    import ctypes
    libc, parent = ctypes.CDLL(None, use_errno=True), os.getpid()

    def arm():
        libc.prctl(1, int(sig), 0, 0, 0)  # 1: PR_SET_PDEATHSIG
        if os.getppid() != parent:
            os._exit(EXIT_TIMEOUT)
    return arm


class Forward:
    """The local launcher's SIGTERM and SIGINT: passed to its ranks as SIGTERM (they give their verdict);
    the launcher then waits for them, bounded, and exits with it."""

    def __init__(self, procs):
        self.procs, self.sig = procs, None
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self.take)

    def take(self, signum, frame):
        self.sig = self.sig or signum
        for p in self.procs:
            if p.poll() is None:
                with contextlib.suppress(OSError):
                    p.send_signal(signal.SIGTERM)


def _start_ranks(cmd, env, launch, node, nproc, base, world, port):
    """This node's ranks base..base+nproc-1 of `world`, each its own session, dying with this process."""
    keep = SECRET_VAR in env or node["nnodes"] > 1  # exported, or other nodes could not know one made here
    secret = {} if keep else {SECRET_VAR: os.urandom(32).hex()}  # in the environment only
    told = json.dumps({"launch": launch.get("launch", "local mode"), "how": launch.get("how", "local mode"),
                       "port_from": launch.get("port_from") or "a free port"})
    expect = {"AIV_EXPECT_NODES": str(node["nnodes"]), "AIV_EXPECT_RANKS_PER_NODE": str(nproc),
              "AIV_EXPECT_WORLD_SIZE": str(world), **env}  # the launch's shape, unless exported
    envs = [dict(expect, **secret, RANK=str(base + r), LOCAL_RANK=str(r), WORLD_SIZE=str(world),
                 LOCAL_WORLD_SIZE=str(nproc), MASTER_ADDR=launch.get("master_addr") or "127.0.0.1",
                 MASTER_PORT=str(port), PYTHONUNBUFFERED="1", **{LAUNCH_VAR: told}) for r in range(nproc)]
    return [subprocess.Popen(cmd, env=e, stdin=subprocess.DEVNULL, start_new_session=True,
                             preexec_fn=die_with_parent(signal.SIGTERM)) for e in envs]


def _launcher_verdict(procs, alive, sig, base, nproc, node):
    """The launcher's exit code from its ranks' (alive: those it had to kill; sig: the signal it was given),
    with one line where that code is not rank 0's own."""
    # the verdict: rank 0's code; on another node of a per-node launch, the one its ranks got from rank 0
    first = "rank 0" if base == 0 else f"rank {base} (this node's first)"
    if alive and (procs[0] in alive or procs[0].returncode == EXIT_PASS):
        emit(f"FAILURE: launch: local ranks {format_ranges(base + procs.index(p) for p in alive)} still running at "
             f"the launcher's deadline; killed")
        return EXIT_TIMEOUT
    codes = [p.returncode for p in procs]
    if codes[0] < 0 and sig:
        emit(f"FAILURE: interrupted: the launcher was interrupted by {signal.Signals(sig).name} before {first} "
             f"(pid {procs[0].pid}) gave a verdict; {STOPPED_WORDS}")
        return EXIT_INTERRUPTED
    if codes[0] < 0:
        emit(f"FAILURE: launch: {first} (pid {procs[0].pid}) died with signal {-codes[0]} before its verdict")
        return EXIT_FAIL
    if codes[0] == EXIT_PASS and any(c for p, c in zip(procs, codes, strict=True) if p not in alive):
        bad = [(base + r, c) for r, c in enumerate(codes) if c]
        emit(f"FAILURE: launch: {first} passed but " + ", ".join(f"rank {r} exited {c}" for r, c in bad))
        return EXIT_FAIL
    if base and sig and codes[0] >= 128:  # this node's ranks stopped on its own signal
        emit(f"FAILURE: interrupted: the launcher of node {node['node_rank']} ({socket.gethostname()}) was "
             f"interrupted by {signal.Signals(sig).name}: its ranks {format_ranges(range(base, base + nproc))} "
             f"stopped before rank 0's verdict; {STOPPED_WORDS}")
        return EXIT_INTERRUPTED
    if base:  # another node's log says what its ranks got (rank 0's node prints the report)
        emit(f"node {node['node_rank']} of {node['nnodes']} ({socket.gethostname()}): ranks "
             f"{format_ranges(range(base, base + nproc))} ended; the verdict they got: exit {codes[0]}")
    return codes[0]


def launch_local(args, argv, env, launch):
    """Become the launcher of this machine's ranks, one per GPU or --nproc CPU ranks, as plan() planned it
    (launch: its 'nproc', 'backend', 'port', 'master_addr', and the words of its contract). Local mode: the
    whole job. A per-node launch (launch['node']: 'nnodes', 'node_rank'): this node's ranks of a job over
    several nodes, numbered as torchrun numbers them (node_rank x nproc + local rank), meeting at the
    launcher's master. The ranks share a fresh AIV_JOB_SECRET on one node (unless one is exported), die
    with the launcher (die_with_parent) and get its SIGTERM/SIGINT (Forward)."""
    nproc, node = launch["nproc"], launch.get("node") or {"nnodes": 1, "node_rank": 0}
    base, world = node["node_rank"] * nproc, node["nnodes"] * nproc
    port = launch["port"] or free_port()
    cmd = [sys.executable, os.path.abspath(__file__)] + list(argv)
    if launch["backend"] and not any(a == "--backend" or a.startswith("--backend=") for a in argv):
        cmd.append(f"--backend={launch['backend']}")
    procs = _start_ranks(cmd, env, launch, node, nproc, base, world, port)
    fwd = Forward(procs)
    # The ranks bound themselves; this is the launcher's own backstop. Once rank 0 has given
    # its verdict the others get a grace period to read it, then are killed (e.g. a frozen rank).
    deadline = time.monotonic() + worst_case(deadlines(args.timeout, args.rollcall_timeout, args.soak), True,
                                             soak=bool(args.soak)) + LAUNCHER_SLACK_S
    while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
        if procs[0].poll() is not None:
            deadline = min(deadline, time.monotonic() + 5.0)
        elif fwd.sig or (procs[1:] and all(p.poll() is not None for p in procs[1:])):  # rank 0 reporting, or frozen
            deadline = min(deadline, time.monotonic() + NAMING_S + ACKS_S + 5.0)
        time.sleep(0.05)
    alive = [p for p in procs if p.poll() is None]
    for p in alive:
        p.kill()
    for p in procs:
        p.wait()
    sweep_said(launch_key(os.getpid()))  # the ranks' speak-once markers: their launch is over
    return _launcher_verdict(procs, alive, fwd.sig, base, nproc, node)
