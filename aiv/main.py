"""Floor 6: the entry point."""
import contextlib
import json
import os
import signal
import socket
import sys

from .checks.manifest_io import manifest_preflight, run_diff_manifest
from .core.base import (
    EXIT_FAIL,
    EXIT_INTERNAL,
    EXIT_PASS,
    EXIT_USAGE,
    UsageError,
    first_line,
    is_tool_error,
    where_raised,
)
from .core.bounds import BoundPassed, within
from .core.deadlines import OUTPUT_S
from .core.files import write_json_atomic
from .core.speak import emit, guard_std_streams
from .launch.local import launch_local
from .launch.options import build_parser
from .launch.plan import LAUNCHER_VARS, check_json_target, plan
from .node.check import node_check_usage, run_node_check
from .node.workers import WORKER_VAR, node_worker
from .out.outputs import fallback_verdict, rank0_lost
from .out.verify_log import read_log_lines, verify_log
from .run.coordinator import Coordinator
from .run.follower import Follower
from .run.guard import speak_once_per_node
from .run.liveness import node_monitor, proc_stat


def _rank_hint(env):
    """This process's rank when it can be read at all (to print usage errors once, not per rank)."""
    for var in ("RANK", "SLURM_PROCID"):
        with contextlib.suppress(KeyError, ValueError):
            return int(env[var])
    return None


def report_usage(e, env):
    """Print a usage error's one line where it belongs; returns EXIT_USAGE. A process started by hand
    speaks. Under a launcher, rank 0 speaks for what every rank shares (flags, AIV_* variables, WORLD_SIZE,
    MASTER_*), and a rank whose own values are wrong (or unreadable) speaks once per node, since rank 0
    cannot see them. argparse's usage text goes to stderr with a flag's line."""
    line, rank = str(e), _rank_hint(env)
    if any(v in env for v in LAUNCHER_VARS) and (e.own or rank is None):
        # once per node among the ranks one launcher started: the marker is keyed by the launcher's identity and
        # start time, and by MASTER_PORT, so every launch speaks
        try:
            local_rank = int(env.get("LOCAL_RANK") or env.get("SLURM_LOCALID") or 0)
        except ValueError:
            local_rank = 0
        parent_start = (proc_stat(os.getppid()) or ("", ""))[1]
        topic = f"usage-{parent_start}-{env.get('MASTER_PORT', '')}-{env.get('TORCHELASTIC_RESTART_COUNT', '')}"
        speak_once_per_node(line, env, local_rank, topic[:120])
    elif not any(v in env for v in LAUNCHER_VARS) or rank == 0:
        emit(line)
        if line.startswith("FAILURE: usage:"):
            emit(build_parser().format_usage().rstrip() + "  (--help for more)", sys.stderr)
    return EXIT_USAGE


def probe(fn, what, prefix="FAILURE: usage: "):
    """A probe of the run's files before torch (their directories on shared storage, the manifest), within
    OUTPUT_S: storage that does not answer is one usage line, never a hang before the run even starts."""
    try:
        return within(fn, OUTPUT_S, what)
    except BoundPassed:
        raise UsageError(f"{prefix}{what} did not answer within {OUTPUT_S:g}s (shared storage that hangs?): "
                         "point them at storage that answers, or leave them out") from None


FALLBACK_VAR = "_AIV_FALLBACK_VERDICT"  # set by submit_smoke_test.sbatch: write the verdict rank 0 left none of


def write_fallback(argv):
    """The batch file's verdict where rank 0 left none, through the one fallback writer (fallback_verdict, the
    gate): argv PATH CODE CHECK BLAME REASON [HOST]. Prints its FAILURE line and writes PATH unless a verdict
    JSON is there already (the first writer wins). -> 0 written (or already there), 1 not written."""
    path, code, check, blame, reason, *hosts = argv
    state = fallback_verdict([rank0_lost(reason, (hosts or [None])[0], blame, int(code), check)], int(code), None,
                             "submit_smoke_test.sbatch")
    emit("\n".join(state["failures"]))
    try:
        within(lambda: write_json_atomic(path, state, first=True), OUTPUT_S, f"writing the verdict JSON {path}")
    except OSError as e:  # BoundPassed too
        emit(f"WARNING: could not write the verdict JSON {path}: {first_line(e)}", sys.stderr)
        return EXIT_FAIL
    return EXIT_PASS


def rank_run(args, contract, env):
    """The role of this rank: Coordinator on rank 0, Follower on every other."""
    return (Coordinator if contract["rank"] == 0 else Follower)(args, contract, env)


def run_verify_log(args):
    """--verify-log FILE (never empty: plan() refuses that): 0 the log shows a clean PASS, 1 it does not,
    2 the file cannot be read."""
    try:
        with open(args.verify_log, "rb") as f:
            text = read_log_lines(f)
    except OSError as e:
        emit(f"FAILURE: usage: --verify-log: cannot read {args.verify_log}: {e.strerror or e}")
        return EXIT_USAGE
    ok, problems, facts = verify_log(text, {"world_size": args.expect_world_size, "nodes": args.expect_nodes,
                                            "ranks_per_node": args.expect_ranks_per_node}, strict=args.strict)
    for p in problems:
        emit(f"verify-log: MISSING/BAD: {p}")
    emit(f"verify-log: {'PASS' if ok else 'FAIL'} {args.verify_log} world_size={facts.get('world_size')} "
         f"nodes={facts.get('nodes')} torch={facts.get('torch')}")
    return EXIT_PASS if ok else EXIT_FAIL


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    guard_std_streams()  # a closed stdout or stderr: the lines go nowhere, the verdict and the files stay
    env = dict(os.environ)
    if "_AIV_NODE_MONITOR" in env:  # a node leader's liveness monitor (see node_monitor)
        try:
            return node_monitor(json.loads(env["_AIV_NODE_MONITOR"]))
        except Exception as e:  # a store that went away ends it quietly (the run ended); a bug says so
            if not is_tool_error(e):
                return 0
            emit(f"WARNING: the node monitor on {socket.gethostname()} stopped: {first_line(e)} in "
                 f"{where_raised(e)} (a bug in the tool): rank 0 reads this node's ranks from their beats alone",
                 sys.stderr)  # where a node monitor is started by hand; a rank's monitor has no stderr (srun)
            return EXIT_INTERNAL
    if FALLBACK_VAR in env:  # the batch file's verdict where rank 0 left none
        return write_fallback(argv)
    if WORKER_VAR in env:  # a device worker of --node-check
        return node_worker(json.loads(env[WORKER_VAR]))
    try:
        p = plan(argv, env)
        if p.get("check_json"):
            probe(lambda: check_json_target(p["args"]), "--json, --metrics and --html: their directories")
    except UsageError as e:
        if any(a == "--node-check" or a.startswith("--node-check=") for a in argv):
            return node_check_usage(e, argv, env)  # fail open: a wrong recipe never fails a prolog
        return report_usage(e, env)
    if p["mode"] in ("help", "version"):
        emit(p["text"].rstrip())
        return EXIT_PASS
    alone = {"verify-log": run_verify_log, "diff-manifest": lambda a: run_diff_manifest(a.diff_manifest),
             "node-check": lambda a: run_node_check(a, env)}  # no torch: a log, two files, this node alone
    if p["mode"] in alone:
        return alone[p["mode"]](p["args"])
    if p.get("check_json"):  # rank 0's process or its node's launcher: the manifests, before torch and NCCL
        try:
            probe(lambda: manifest_preflight(p["args"]), "--manifest and --save-manifest", prefix="")
        except UsageError as e:
            emit(f"FAILURE: usage: {e}")
            return EXIT_USAGE
    if p["mode"] == "local":
        return launch_local(p["args"], argv, env, p["launch"])
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT})  # taken by RankRun.on_signal only
    rank_run(p["args"], p["contract"], env).run()
    return EXIT_FAIL  # not reached: run() always exits the process


if __name__ == "__main__":
    sys.exit(main())
