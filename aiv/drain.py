"""Floor 5 (runtime): --drain on: the scontrol calls (one show, one update), within DRAIN_S. What to drain and
why is aiv/outputs.py's drain_plan (pure)."""
import time

from .base import compress_hostlist, finding
from .deadlines import DRAIN_S
from .files import run_bounded
from .outputs import drain_command, drain_keeps, parse_scontrol_nodes


def _scontrol(argv, until):
    """One scontrol call within the time left -> (rc, stdout, message). rc None: missing or silent."""
    r = run_bounded(argv, max(0.1, until - time.monotonic()))
    if "unread" in r:
        why = r["unread"]
        if "could not run" in why and "No such file" in why:
            return None, "", "scontrol is not on PATH"
        if "gave no answer" in why:
            return None, "", f"scontrol did not answer within {DRAIN_S:g}s (slurmctld unreachable?)" + (
                f"; {why.split(': ', 1)[1]}" if r.get("stuck") else "")
        return None, "", why
    msg = " ".join((r["err"] or r["out"] or "").split())[:300]
    return r["rc"], r["out"], msg or f"exit status {r['rc']}"


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
