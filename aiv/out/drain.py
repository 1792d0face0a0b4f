"""Floor 5 (runtime): the one drain, in the preflight (--drain on) and in the node gate (its prolog, epilog and
health variants, and health's --undrain): the scontrol calls (one show, one update), within DRAIN_S or the
node gate's bound. What to drain and why is aiv/out/outputs.py's drain_plan (pure), what to resume resume_plan."""
import time

from ..core.base import compress_hostlist, finding
from ..core.deadlines import DRAIN_S
from ..core.files import run_bounded
from .outputs import drain_command, drain_keeps, drain_plan, owned_reason, parse_scontrol_nodes, resume_plan


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


def drain_apply(plan, known=None, seconds=DRAIN_S):
    """--drain on: one `scontrol show node` (nodes drained for another reason keep it; known: {node: (state,
    reason)} already read, no show), then one `scontrol update` for the rest, both within `seconds`. -> (plan
    with 'done'/'kept'/'hosts', findings: a WARN quoting scontrol when it is missing, refused or silent; never
    a FAIL)."""
    until = time.monotonic() + seconds
    if known is None:
        rc, out, msg = _scontrol(["scontrol", "show", "node", "-o", compress_hostlist(plan["hosts"])], until)
        if rc != 0:
            return plan, [finding("drain", "WARN", f"nothing drained: `scontrol show node` failed: {msg}; run by "
                                  f"hand: {plan['command']}", plan["hosts"])]
        known = parse_scontrol_nodes(out)
    kept = drain_keeps(known)
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


def node_drain(ctx, verdict, findings, args, node, slurm, seconds):
    """The node gate's drain (NodeCheck's verdict told to Slurm): health drains this node on a FAIL that singles
    it out (--drain on) and resumes its own drain after a pass that judged the check that drained it
    (--undrain); prolog and epilog write the reason before their exit 1 (Slurm then drains the node; the
    prolog's job is requeued). A reason not ours is never touched; npd leaves Slurm alone. slurm: the node as
    `scontrol show node` gave it ({'state', 'reason'} or {'unread'}), or None. -> {'action', 'done', 'reason',
    'command', 'said'}."""
    out = {"action": "none", "done": False, "reason": "", "command": "", "said": ""}
    if ctx == "npd":
        return dict(out, said="NPD problem (exit 1): the condition turns True" if verdict["drainable"] else "")
    if not verdict["drainable"]:
        if ctx == "health" and args.undrain and verdict["verdict"] == "PASS":
            out.update(_node_resume(findings, node, slurm, seconds))
        return out
    plan = drain_plan(findings, args.drain, 1, None, context=ctx)
    out.update(action="drain", reason=plan["reason"], command=plan["command"])
    slurm_does = "; exit 1: Slurm drains the node" + (" and requeues the job" if ctx == "prolog" else "") \
        if ctx != "health" else ""
    if plan["skipped"] or args.drain != "on":
        return dict(out, said=(f"not drained: {plan['skipped']}" if plan["skipped"] else
                               f"not drained by the check (--drain {args.drain}): {plan['command']}") + slurm_does)
    if slurm and slurm.get("unread"):
        return dict(out, said=f"not drained: Slurm's view of the node was not read ({slurm['unread']})" + slurm_does)
    known = {node: (slurm.get("state") or "", slurm.get("reason") or "")} if slurm else None
    plan, warns = drain_apply(plan, known, seconds)
    if plan["kept"]:
        return dict(out, said=f"not drained by the check: already drained or down for another reason, kept "
                              f"({plan['kept'][node]!r})" + slurm_does)
    said = f"drained: {plan['reason']}" if plan["done"] else f"not drained: {warns[0]['reason']}"
    return dict(out, done=plan["done"], said=said + slurm_does)


def _node_resume(findings, node, slurm, seconds):
    """--undrain after a PASS: resume_plan, then its one scontrol update."""
    s = slurm or {}
    if s.get("unread") or "DRAIN" not in (s.get("state") or ""):
        return {}
    if not owned_reason(s.get("reason")):
        return {"said": f"left drained: its reason is not the node check's ({s.get('reason')!r})"}
    plan = resume_plan(node, s["reason"], findings)
    if plan["skipped"]:
        return {"action": "resume", "command": plan["command"], "said": f"left drained: {plan['skipped']}"}
    rc, _, msg = _scontrol(plan["argv"], time.monotonic() + seconds)
    return {"action": "resume", "done": rc == 0, "command": plan["command"],
            "said": "resumed our own drain: the check that drained it passed" if rc == 0 else f"not resumed: {msg}"}
