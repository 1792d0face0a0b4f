"""Floor 5 (runtime): --drain on: the scontrol calls (one show, one update), within DRAIN_S. What to drain and
why is aiv/out/outputs.py's drain_plan (pure)."""
import subprocess
import time

from ..core.base import compress_hostlist, finding
from ..core.deadlines import DRAIN_S
from .outputs import drain_command, drain_keeps, parse_scontrol_nodes


def _scontrol(argv, until):
    """One scontrol call within the time left -> (rc, stdout, message). rc None: missing or silent."""
    try:
        p = subprocess.run(argv, capture_output=True, text=True, timeout=max(0.1, until - time.monotonic()),
                           stdin=subprocess.DEVNULL)
    except FileNotFoundError:
        return None, "", "scontrol is not on PATH"
    except subprocess.TimeoutExpired:
        return None, "", f"scontrol did not answer within {DRAIN_S:g}s (slurmctld unreachable?)"
    except OSError as e:
        return None, "", f"scontrol could not run: {e.strerror or e}"
    msg = " ".join((p.stderr or p.stdout or "").split())[:300]
    return p.returncode, p.stdout, msg or f"exit status {p.returncode}"


def drain_apply(plan):
    """--drain on: one `scontrol show node` (nodes drained for another reason keep it), then one
    `scontrol update` for the rest, both within DRAIN_S. -> (plan with 'done'/'kept'/'hosts', findings:
    a WARN quoting scontrol when it is missing, refused or silent; never a FAIL)."""
    until = time.monotonic() + DRAIN_S
    rc, out, msg = _scontrol(["scontrol", "show", "node", "-o", compress_hostlist(plan["hosts"])], until)
    if rc != 0:
        return plan, [finding("drain", "WARN", f"nothing drained: `scontrol show node` failed: {msg}; run by hand: "
                              f"{plan['command']}", plan["hosts"])]
    kept = drain_keeps(parse_scontrol_nodes(out))
    hosts = [h for h in plan["hosts"] if h not in kept]
    plan = dict(plan, kept=kept, hosts=hosts)
    if hosts:
        argv, line = drain_command(hosts, plan["reason"])
        plan.update(argv=argv, command=line)
        rc, _, msg = _scontrol(argv, until)
        if rc != 0:
            return plan, [finding("drain", "WARN", f"nothing drained: scontrol refused: {msg}; an operator can "
                                  f"run: {plan['command']}", hosts)]
    return dict(plan, done=bool(hosts)), []
