"""Floor 2: the one parser of flags and AIV_* variables (one grammar for both; the command line wins)."""
import argparse
import difflib
import math
import os
import re

from ..core.base import DESCRIPTION, ENV_DENY_WORDS, UsageError, human_bytes
from ..core.deadlines import NODE_BUDGET_DEFAULT, ROLLCALL_DEFAULT, TIMEOUT_DEFAULT
from ..core.names import DRAIN_PREFIX
from .contract import job_secret

# One grammar for every flag and AIV_* variable: on = 1/on/yes/true, off = 0/off/no/false (any case);
# sizes are bytes with binary K/M/G suffixes (1M = 2^20); an empty value is a mistake, not a default.
# Converters raise ValueError(the predicate: "is not a number"); parse_args names the flag or the
# variable as the user wrote it.
ON_WORDS, OFF_WORDS = ("1", "on", "yes", "true"), ("0", "off", "no", "false")
SECONDS_MAX = 86400.0      # a phase bound above a day is a typo (and overflows the store's timedelta)
SIZE_MAX = 64 << 30        # one all_reduce buffer: more than any GPU holds is a typo
DEFAULT_BW_SIZES = "1M,16M,256M,1G"


def _number(text):
    try:
        return float(text)
    except ValueError:
        raise ValueError("is not a number") from None


def _positive_float(text):
    v = _number(text)
    if not (v > 0 and math.isfinite(v)):
        raise ValueError("is not a finite number > 0")
    return v


def _seconds(text):
    v = _number(text)
    if not math.isfinite(v):
        raise ValueError("is not a finite number of seconds")
    if not 1 <= v <= SECONDS_MAX:
        raise ValueError(f"is outside 1-{SECONDS_MAX:g} seconds")
    return v


def _soak(text):
    """--soak: 0 or an off word: no soak; else seconds of load, 1 to SECONDS_MAX."""
    if text.strip().lower() in OFF_WORDS:
        return 0.0
    v = _number(text)
    if not (math.isfinite(v) and (v == 0 or 1 <= v <= SECONDS_MAX)):
        raise ValueError(f"is not 0 (off) or 1-{SECONDS_MAX:g} seconds")
    return v


def _int_from(low):
    def conv(text):
        try:
            v = int(text)
        except ValueError:
            raise ValueError("is not an integer") from None
        if v < low:
            raise ValueError(f"is below {low}")
        return v
    return conv


def _one_of(words):
    def conv(text):
        if text not in words:
            raise ValueError("is not " + ", ".join(words[:-1]) + " or " + words[-1])
        return text
    return conv


_positive_int, _count_arg = _int_from(1), _int_from(0)
NODE_CHECK_WORDS = ("prolog", "epilog", "health", "npd", "auto")
# Where the verdict goes besides the log and the JSON: Slurm's node state (drain), Prometheus text, one
# page. Each is planned or rendered by a pure function of the verdict's state; only drain_apply acts.
DRAIN_MODES = ("off", "recommend", "on")
_node_check, _backend, _drain_mode = _one_of(NODE_CHECK_WORDS), _one_of(("auto", "nccl", "gloo")), _one_of(DRAIN_MODES)


def _switch(text):
    word = text.strip().lower()
    if word in ON_WORDS or word in OFF_WORDS:
        return word in ON_WORDS
    raise ValueError("is neither on (1/on/yes/true) nor off (0/off/no/false)")


def _sizes(text):
    """'1M,64MiB,1G' -> bytes; an on word: the default sizes; 0 or an off word: None (no probe)."""
    word = text.strip().lower()
    if word in ON_WORDS or word in OFF_WORDS:
        return _sizes(DEFAULT_BW_SIZES) if word in ON_WORDS else None
    out = []
    for part in text.split(","):
        m = re.fullmatch(r"\s*([0-9]+)\s*(?:([KMG])(?:iB)?)?\s*", part, re.I)
        if not m:
            raise ValueError(f"is not a list of sizes (bytes with binary K/M/G suffixes, e.g. {DEFAULT_BW_SIZES}; "
                             f"0 or off for none)")
        n = int(m.group(1)) << {"": 0, "K": 10, "M": 20, "G": 30}[(m.group(2) or "").upper()]
        if not 1 <= n <= SIZE_MAX:
            raise ValueError(f"has a size outside 1 B-{human_bytes(SIZE_MAX)}")
        out.append(n)
    return out


def _directory(text):
    if not os.path.isdir(text):
        raise ValueError("is not a directory")
    return text


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        raise UsageError(message[len("argument "):] if message.startswith("argument ") else message)


WANT = {_backend: "auto, nccl or gloo", _seconds: "a number of seconds", _positive_int: "a whole number",
        _switch: "on or off", _sizes: "sizes, on or off", _positive_float: "a number", str: "a path",
        _directory: "a directory", _drain_mode: "off, recommend or on",
        _soak: "a number of seconds, or 0 for no soak", _count_arg: "a whole number (0 or more)",
        _node_check: "prolog, epilog, health, npd or auto"}  # what an empty value should have been


def _opt(p, flag, conv, shown, text, env=True, want=None, **kw):
    """One option: its converter, its variable (AIV_<OPTION>, or none), its default as --help and the
    options page (docs/options.md) show it, and what an empty value should have been."""
    var = "AIV_" + flag[2:].upper().replace("-", "_") if env else None
    a = p.add_argument(flag, help=f"{text} (default: {shown}; variable: {var or 'none'})".replace("%", "%%"), **kw)
    a.conv, a.env, a.shown, a.want = conv, var, shown, want or WANT[conv]
    return a


# --nproc: what one machine holds. A gloo rank peaks at ~0.3 GiB resident (CPU torch 2.x: the
# interpreter, torch and a gloo group; measured with 2 and 4 ranks), and the node's import probe and
# liveness monitor add ~0.3 GiB once: 512 MiB per CPU rank covers both. A rank that drives a GPU also
# holds a CUDA context in host memory: 1.5 GiB. A rank is idle but for its start (import torch, 1-2
# CPU seconds) and milliseconds of collectives, so 4 ranks per core start within seconds, far inside
# the roll-call bound, and leave the machine usable. Only an explicit --nproc is held to this rule.
RANKS_PER_CORE = 4
RANK_MEM_CPU = 512 << 20
RANK_MEM_GPU = 1536 << 20

EPILOG = "\n".join((
    "Values: on = 1/on/yes/true, off = 0/off/no/false (any case); sizes are bytes with binary K/M/G",
    f"suffixes (1M = 2^20); seconds are 1-{SECONDS_MAX:g}. Flags are spelled out in full. A malformed or",
    "empty flag, AIV_* variable or launch variable is one FAILURE line and exit 2; nothing runs.",
    f"--nproc: at most {RANKS_PER_CORE} ranks per CPU core this process may use, and one rank per",
    f"{human_bytes(RANK_MEM_CPU)} (CPU) or {human_bytes(RANK_MEM_GPU)} (GPU) of MemAvailable or of what the "
    "memory cgroup has left.",
    "--verify-log has no variable: an exported AIV_VERIFY_LOG would turn every later run, Slurm jobs",
    "included, into a log check; setting it is a usage error. Nor has --node-check (every run a node check).",
    "Exit codes: 0 PASS, 1 FAIL, 2 USAGE, 3 TIMEOUT, 4 INTERNAL, 5 INTERRUPTED."))


def build_parser():
    p = _Parser(prog="ddp_mesh_ping.py", description=DESCRIPTION, add_help=False, allow_abbrev=False,
                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=EPILOG)
    p.add_argument("-h", "--help", action="store_true", help="show this help and exit")
    _opt(p, "--backend", _backend, "auto", "auto: nccl when CUDA is available, else gloo", default="auto",
         metavar="{auto,nccl,gloo}")
    _opt(p, "--timeout", _seconds, f"{TIMEOUT_DEFAULT:g}", "seconds each phase after the roll call may take: init, "
         "telemetry, collective, ddp, bandwidth, verdict", default=TIMEOUT_DEFAULT, metavar="SECONDS")
    _opt(p, "--rollcall-timeout", _seconds, f"{ROLLCALL_DEFAULT:g}", "seconds for every rank to start and check "
         "in; absorbs start-up skew such as thousands of ranks importing torch from shared storage",
         default=ROLLCALL_DEFAULT, metavar="SECONDS")
    for what, text in (("world-size", "N ranks in all"), ("nodes", "N nodes"),
                       ("ranks-per-node", "N ranks on every node")):
        _opt(p, f"--expect-{what}", _positive_int, "from Slurm", f"FAIL unless the run has {text}", metavar="N")
    _opt(p, "--strict", _switch, "off", "turn every WARN into a FAIL (exit 1; such a FAIL never drains a node); "
         "no value: on", nargs="?", const="on", default=False, metavar="on/off")
    _opt(p, "--json", str, "none", "rank 0 writes the verdict as JSON here; tried before the run", metavar="PATH")
    _opt(p, "--nproc", _positive_int, "GPUs, or 2", "local mode (or a pod's per-node launch): ranks here (see the "
         "rule below); --node-check on a node without GPUs: the CPU workers standing in for GPUs", metavar="N")
    _opt(p, "--bandwidth", _sizes, "off", f"measure all_reduce bus bandwidth; no value or on: {DEFAULT_BW_SIZES}; "
         "0 or off: no probe", nargs="?", const="on", metavar="SIZES")
    _opt(p, "--min-busbw", _positive_float, "none", "FAIL when the largest size's busbw is below this (GB/s, "
         "1e9 B/s); implies --bandwidth", metavar="GBPS")
    _opt(p, "--verify-log", str, "none", "check a saved log and exit", env=False, metavar="FILE",
         want="the path of a saved log")
    _opt(p, "--save-manifest", str, "none", "on a PASS, save (merge into) the accepted state of the nodes as a "
         "manifest, its WARNs recorded as accepted", metavar="PATH")
    _opt(p, "--manifest", str, "none", "judge this run against a saved manifest (check 'manifest')", metavar="PATH")
    _opt(p, "--diff-manifest", str, "none", "print the differences between two manifests and exit: 0 equal, "
         "1 different, 2 unreadable", env=False, nargs=2, metavar=("A", "B"))
    p.set_defaults(manifest_data=None)  # the --manifest file, read up front by rank 0 (manifest_preflight)
    _screen_options(p)
    _output_options(p)
    _node_options(p)
    _opt(p, "--sysfs-root", _directory, "/", "root for /sys, /proc/driver and /dev/kmsg reads (tests)", default="/",
         metavar="DIR")
    p.add_argument("--version", action="store_true", help="print the version and exit")
    return p


def _screen_options(p):
    """Performance screen (section `screen`): on by default, floors in the units of the report."""
    _opt(p, "--skip-screen", _switch, "off", "skip the performance screen (GPU matmul and memory, intra-node and "
         "inter-node busbw); no value: on", nargs="?", const="on", default=False, metavar="on/off")
    _opt(p, "--skip-numerics", _switch, "off", "skip the numerics check (every rank's matmuls compared bit for bit "
         "with its model's peers and with an fp64 reference; the DDP step's local gradients); no value: on",
         nargs="?", const="on", default=False, metavar="on/off")
    _opt(p, "--min-tflops", _positive_float, "none", "screen: FAIL a GPU whose dense matmul is below this (bf16 on "
         "GPU, fp32 on CPU)", metavar="TFLOPS")
    _opt(p, "--min-hbm", _positive_float, "none", "screen: FAIL a GPU whose device-memory copy is below this (GB/s, "
         "read + write)", metavar="GBPS")
    _opt(p, "--min-busbw-intra", _positive_float, "none", "screen: FAIL a node whose all_reduce busbw inside the "
         "node is below this (GB/s)", metavar="GBPS")
    _opt(p, "--min-busbw-inter", _positive_float, "none", "screen: FAIL an inter-node measurement (a pair on one "
         "rail) below this busbw (GB/s)", metavar="GBPS")
    _opt(p, "--soak", _soak, "0", "after the screen, bf16 matmul on every GPU at once for SECONDS (fp32 on CPU), "
         "sampling clocks, temperature, power and clock-event reasons; FAIL a GPU whose speed decays or whose "
         "clocks slow for heat or a power brake; 0: no soak", default=0.0, metavar="SECONDS")


def _output_options(p):
    """Where the verdict goes besides the log and the JSON (section `outputs`)."""
    _opt(p, "--drain", _drain_mode, "recommend", "on a FAIL whose culprits are hosts: 'on' drains them in Slurm "
         f"(scontrol, reason '{DRAIN_PREFIX} ...'), 'recommend' prints the command, 'off' neither",
         default="recommend", metavar="{off,recommend,on}")
    _opt(p, "--drain-max", _positive_int, "10% of the nodes, at least 1", "more culprits than this: nothing is "
         "drained (a cause that wide is rarely the nodes)", metavar="N")
    _opt(p, "--metrics", str, "none", "rank 0 writes the run as Prometheus text here (atomically: the "
         "node_exporter textfile collector's convention); tried before the run", metavar="PATH")
    _opt(p, "--html", str, "none", "rank 0 writes one self-contained page of the run here (the batch file: "
         "ai_infra_smoke_test_<jobid>.html); tried before the run", metavar="PATH")


def _node_options(p):
    """The node gate (docs/node-gate.md): this node alone, as Slurm's Prolog/Epilog/HealthCheckProgram or NPD's
    plugin."""
    _opt(p, "--node-check", _node_check, "none", "check this node alone and exit: prolog, epilog, health "
         "(HealthCheckProgram) or npd (Node Problem Detector); no value or auto: Slurm's SLURM_SCRIPT_CONTEXT, else "
         "health. Exit 1 only on a FAIL whose evidence singles the node out; the tool's own trouble exits 0 (npd: 2)",
         env=False, nargs="?", const="auto", metavar="CONTEXT", want="prolog, epilog, health, npd or auto")
    _opt(p, "--node-budget", _seconds, f"{NODE_BUDGET_DEFAULT:g}", "--node-check: seconds for the whole check; "
         "what does not fit is skipped and named", default=NODE_BUDGET_DEFAULT, metavar="SECONDS")
    _opt(p, "--expect-gpus", _count_arg, "the job's GPUs, the node's gres, its PCI bus", "--node-check: FAIL unless "
         "the node lists N GPUs; 0: a node without GPUs (CPU workers stand in)", metavar="N")
    _opt(p, "--undrain", _switch, "off", "--node-check health with --drain on: a pass resumes the node when the "
         "check's own drain names a check that passed now; no value: on", nargs="?", const="on", default=False,
         metavar="on/off")
    _opt(p, "--node-lock-dir", _directory, "/run/aiv (root), else the user's own", "--node-check: the directory of "
         "the node's lock (one pass on the GPUs at a time): owned by the user that runs the check, writable by no "
         "one else; never a job's TMPDIR", metavar="DIR")


_UNSET = object()
REMOVED_VARS = {"AIV_VERIFY_LOG": "is no longer read (left exported it turned every later run, Slurm jobs "
                                  "included, into a log check): unset it and use --verify-log FILE"}


# AIV_* variables that are no option of the tool, by their owner (a test checks this list against the
# names those files use). Any other AIV_* variable is a usage error naming the closest known one.
OWNED_VARS = {
    "the tool": ("AIV_FAILPOINT", "AIV_FAILPOINT_MARK", "AIV_JOB_SECRET", "AIV_WARM_IMPORTS"),
    "submit_smoke_test.sbatch": ("AIV_CPU_BIND", "AIV_SCRIPT", "AIV_STEP_GRACE", "AIV_STEP_KILL_WAIT"),
    "tests and bench": ("AIV_ARTIFACTS", "AIV_SIM_NODES", "AIV_SIM_TRIALS", "AIV_SLURM_DIR", "AIV_SLURM_INSTALL",
                        "AIV_SLURM_SUBNET", "AIV_TEST_ENV", "AIV_TEST_FORK"),
}


def unknown_var(env, parser):
    """The first AIV_* variable nobody reads, as a usage error naming the closest known one (None: none)."""
    known = [a.env for a in parser._actions if getattr(a, "env", None)]
    known += [v for names in OWNED_VARS.values() for v in names] + list(REMOVED_VARS)
    for var in sorted(v for v in env if v.startswith("AIV_") and v not in known):
        near = difflib.get_close_matches(var, known, n=1, cutoff=0.6)
        secret = any(w in name for name in [var] + near for w in ENV_DENY_WORDS)  # a misspelled AIV_JOB_SECRET too
        shown = "(value not shown)" if secret else repr(env[var][:60])
        return UsageError(f"{var}={shown} is not a variable of ddp_mesh_ping.py"
                          + (f" (did you mean {near[0]}?)" if near else " (see --help)"))
    return None


def _given(action, name, value):
    """A flag's or variable's text, converted; UsageError naming it as the user wrote it."""
    if isinstance(value, list):  # nargs=2 (--diff-manifest A B)
        return [_given(action, name, v) for v in value]
    if not value.strip():
        raise UsageError(f"{name} is empty; give {action.want}" + (", or unset it" if name.startswith("AIV_") else ""))
    try:
        return action.conv(value)
    except ValueError as e:
        raise UsageError(f"{name}={value!r} {e}") from None


def output_paths_from_argv(argv, env):
    """--json and --metrics read without the parser (a --node-check usage error still writes them): the flags,
    else AIV_JSON, AIV_METRICS. -> [(flag, path)]."""
    out = []
    for flag, var in (("--json", "AIV_JSON"), ("--metrics", "AIV_METRICS")):
        given = [a.split("=", 1)[1] if a != flag else after for a, after in zip(argv, [*argv[1:], "--"], strict=False)
                 if a.startswith(flag + "=") or a == flag and not after.startswith("--")]  # the last one wins
        path = (given or [""])[-1] or env.get(var)
        if path:
            out.append((flag, path))
    return out


def parse_args(argv, env):
    """Flags win over AIV_<OPTION> variables; every value goes through its option's converter, and the
    result records where each came from (args.origin: dest -> the flag or variable). UsageError else."""
    for var, why in REMOVED_VARS.items():
        if var in env:
            raise UsageError(f"{var}={env[var]!r} {why}")
    parser = build_parser()
    if unknown := unknown_var(env, parser):
        raise unknown
    job_secret(env)  # too short: a usage error (its value is never shown)
    opts = [a for a in parser._actions if hasattr(a, "conv")]
    ns, extra = parser.parse_known_args(list(argv), argparse.Namespace(**{a.dest: _UNSET for a in opts}))
    if extra:  # the first argument argparse did not take, with the likely flag meant
        if extra[0] in ("-", "--") or not extra[0].startswith("-"):
            raise UsageError(f"unexpected argument {extra[0]!r}: ddp_mesh_ping.py takes options only (see --help)")
        flags = [o for a in parser._actions for o in a.option_strings if o.startswith("--")]
        near = difflib.get_close_matches(extra[0].split("=", 1)[0], flags, n=1) if extra[0].startswith("--") else []
        raise UsageError(f"unknown option {extra[0]!r}" + (f" (did you mean {near[0]}?)" if near else " (see --help)"))
    ns.origin = {}
    for a in opts:
        flag, raw = a.option_strings[0], getattr(ns, a.dest)
        if raw is _UNSET and a.env in env:
            flag, raw = a.env, env[a.env]
        if raw is not _UNSET:
            ns.origin[a.dest] = flag
        setattr(ns, a.dest, a.default if raw is _UNSET else _given(a, flag, raw))
    if ns.min_busbw and not ns.bandwidth:
        if "bandwidth" in ns.origin:
            raise UsageError(f"{ns.origin['min_busbw']} needs the bandwidth probe, which "
                             f"{ns.origin['bandwidth']} turns off")
        ns.bandwidth = _sizes(DEFAULT_BW_SIZES)
    return ns
