"""Floor 5 (runtime): rank 0's verdict, given once. Conclusion takes the run's facts as plain data (copied
under the run's lock when the verdict began), the findings and a store client, and: audits the side
channel, passes every finding through the blame gate (with the run's hosts), plans the drain, writes the
files asked for (each within OUTPUT_S; one that could not be written is an `output` FAIL of this verdict),
and only then prints the report block with the run's one `Verdict:` line and publishes the code every rank
exits with; then runs the drain (its outcome written into the files), saves the manifest and keeps the store
up for the acknowledgements. No rank object in here: its inputs are explicit."""
import contextlib
import ipaddress
import sys
import time

from ..checks.judge import apply_strict, judge_channel, judge_forged, judge_store_peers
from ..checks.manifest_io import note_manifest_save
from ..core.base import (
    EXIT_PASS,
    _counts,
    elapsed,
    finding,
    first_line,
    internal_finding,
    print_traceback,
    verdict_code,
    where_raised,
)
from ..core.blame import blame_gate
from ..core.bounds import bounded, within
from ..core.deadlines import AUDIT_S, OUTPUT_S, STORE_OP_S
from ..core.files import write_json_atomic, write_text_atomic
from ..core.speak import emit
from ..out.drain import drain_apply
from ..out.outputs import drain_blocker, drain_plan, render_metrics, verdict_state
from ..out.page import render_html
from ..out.render import failure_lines, render_drain, render_report
from .store import store_peers


def write_json_within(path, state, first=False):
    """--json (path; None: not asked), within OUTPUT_S (shared storage can hang). -> None, or why it could not be
    written (also said on stderr). Rank 0's verdict and a rank speaking for rank 0 both write through it."""
    if path:
        try:
            within(lambda: write_json_atomic(path, state, first), OUTPUT_S, f"writing --json {path}")
        except OSError as e:  # BoundPassed too
            why = e.strerror or str(e)
            emit(f"WARNING: could not write --json {path}: {why}", sys.stderr)
            return why
    return None


class Conclusion:
    """One verdict. run: the run's facts (Coordinator.snapshot): host, world, addr, port, records, host_of,
    gone (ranks found dead or frozen), serving, forged, authenticated, expect, env, the report's facts
    (verdict_state) and acks_s; args: the options (json, metrics, html, drain, drain_max, strict,
    save_manifest, manifest_data); client: a store client or None; progress(key, **kw) prints a progress line;
    failpoint(name, only) is the tests' fault injection; on_code(code) tells the caller the code as it stands
    (the verdict's own bound exits with it)."""

    def __init__(self, run, args, client, progress, failpoint, on_code):
        self.run, self.args, self.client = run, args, client
        self.progress, self.failpoint, self.on_code = progress, failpoint, on_code
        self.drain = None

    def give(self, found, code):
        """-> the exit code, decided once (decide: the outputs asked for are written first, and one that could
        not be is a FAIL of the verdict), then the report block with the run's one `Verdict:` line, then the
        code published on the store: every rank exits with it. After it only the drain's outcome and the
        manifest's lines follow (neither changes the code)."""
        run = self.run  # the run's hosts and its allocation's node count, for the gate's minority guard
        hosts = set(run["host_of"].values()) | {rec["host"] for rec in run["records"]}
        found = blame_gate(list(found) + self.side_channel(), hosts, run["expect"].get("nodes") or 0)  # the law
        st, text = self.decide(found, code)
        code = st["exit_code"]
        self.on_code(code)
        self.progress("verdict", verdict="PASS" if code == EXIT_PASS else "FAIL", code=code, counts=_counts(found))
        emit(text)  # the verdict's lines before anything slower (scontrol, the manifest, the acknowledgements)
        if self.client is not None:
            with contextlib.suppress(Exception):
                self.client.publish_verdict(code)
        if self.drain["mode"] == "on" and self.drain["hosts"]:
            self.drain, warns = drain_apply(self.drain)
            self.drain = dict(self.drain, pending=False)
            found += warns
            st = self.state(found, code)
            emit("\n".join(render_drain(self.drain) + [f"  [{f['status']}] {f['check']}: {f['reason']}"
                                                       for f in warns]))
            self.write_files(st)  # the drain's outcome into the files; one that fails now is said on stderr
        if getattr(self.args, "save_manifest", None):  # after the report and the JSON: shared storage may be slow
            before = len(st["findings"])
            note_manifest_save(self.args, st)  # manifest: --save-manifest, on a PASS only (its WARNs accepted)
            emit("\n".join([f"  [{f['status']}] {f['check']}: {f['reason']}" for f in st["findings"][before:]]
                           + [f"  NOTE: {n}" for n in st.get("notes") or []]))
            write_json_within(self.args.json, st)
        if self.client is not None:
            self.wait_acks(code)
        return code

    def decide(self, found, code):
        """The verdict, whole: the drain planned, the report rendered, the files asked for written (each within
        OUTPUT_S). A file that could not be written is an `output` FAIL (never a silent exit 0): the report is
        rendered again with it, and the files that were written are written again, so that they say what the
        log says. -> (state, the report's text). `found` grows with what it adds."""
        st, text = self.report(found, code)
        if self.drain["hosts"] and drain_blocker(found):  # the report itself failed: the tool's error
            st, text = self.report(found, st["exit_code"])
        failed = set()
        self.failpoint("files", only=("pause",))  # the tests' slow shared storage
        for _ in range(2):  # the files, then once more those written, when one could not be
            unwritten = self.write_files(st, skip=failed)
            if failed and not unwritten:
                break
            found += [finding("output", "FAIL", f"--{flag} {path} could not be written: {why}; the verdict is in "
                              "this log (fix the path or its storage)") for flag, path, why in unwritten]
            failed |= {flag for flag, _, _ in unwritten}
            if not failed:
                break
            st, text = self.report(found, code)
            self.on_code(st["exit_code"])  # the verdict's own bound, should the second writes not finish
        return st, text

    # ---------------------------------------------------------------- the state and the report
    def state(self, found, code):
        return verdict_state(dict(self.run, elapsed_s=elapsed()), found, verdict_code(found) or code, self.drain)

    def report(self, found, code):
        """The drain planned, then -> (state, the report's text). A report that cannot be rendered is an
        `internal` FAIL (added to `found`): its text is the `Verdict:` line and the FAILURE lines alone."""
        try:
            self.drain = self.plan_drain(found, verdict_code(found) or code)
            self.failpoint("report", only=("raise",))
            st = self.state(found, code)
            return st, render_report(st)
        except Exception as e:
            print_traceback(e)
            found.append(internal_finding(e, f"rank 0 on {self.run['host']}, rendering the report"))
            self.drain = self.plan_drain(found, verdict_code(found) or code)
            st = self.state(found, code)
            return st, "\n".join([f"Verdict: {st['verdict']} exit={st['exit_code']} (the report could not be "
                                  "rendered: the lines below)"] + failure_lines(found))

    def plan_drain(self, found, code):
        """--drain at the verdict (drain_plan, pure): what to drain, or why nothing; run once the verdict's lines
        are out (drain_apply, bounded by DRAIN_S), its WARN joining the findings, the verdict unchanged."""
        run = self.run
        nodes = run["expect"].get("nodes") or len({rec["host"] for rec in run["records"]}) or 1
        plan = drain_plan(found if code != EXIT_PASS else [], self.args.drain, nodes, run["env"].get("SLURM_JOB_ID"),
                          self.args.drain_max)
        return dict(plan, pending=plan["mode"] == "on" and bool(plan["hosts"]))

    # ---------------------------------------------------------------- the side channel's audit
    def side_channel(self):
        """The side channel's findings: every value refused (judge_forged), connections from outside the run's
        nodes (judge_store_peers), and whether the channel was authenticated."""
        run, strict = self.run, self.args.strict
        master, forged = f"{run['addr']}:{run['port']}", list(run["forged"])
        if self.client is not None:
            ranks, hosts = sorted(run["host_of"]), sorted(set(run["host_of"].values()))
            forged = bounded(lambda: self.client.clone().audit(ranks, hosts), AUDIT_S) or forged  # its own connection
        out = judge_forged(forged, master)
        if run["serving"] and run["records"]:
            allowed = {a for rec in run["records"] for a in rec.get("addrs") or ()}
            peers = {ip for ip in store_peers(run["port"]) or () if not ipaddress.ip_address(ip).is_loopback}
            out += apply_strict(judge_store_peers(peers, allowed, run["authenticated"], master), strict)
        if run["records"] and not forged:
            nodes = len({rec["host"] for rec in run["records"]})
            out += apply_strict(judge_channel(run["authenticated"], nodes, master), strict)
        return out

    # ---------------------------------------------------------------- the files
    def write_files(self, st, skip=()):
        """--json, then --metrics and --html (but those in `skip`), each within OUTPUT_S. -> [(flag, path, why)]
        of those that could not be written (each also said on stderr); a page that cannot be rendered is the
        tool's error, and counts as not written."""
        out = []
        why = write_json_within(self.args.json, st) if "json" not in skip else None
        if why:
            out.append(("json", self.args.json, why))
        for dest, render in (("metrics", render_metrics), ("html", render_html)):
            path = getattr(self.args, dest, None)
            if not path or dest in skip:
                continue
            try:
                text = render(st)
            except Exception as e:  # the tool's own error: said, and the output counts as not written
                print_traceback(e)
                out.append((dest, path, f"the tool could not render it ({first_line(e)} in {where_raised(e)})"))
                continue
            try:
                within(lambda p=path, t=text: write_text_atomic(p, t), OUTPUT_S, f"writing --{dest} {path}")
            except OSError as e:  # BoundPassed too
                emit(f"WARNING: could not write --{dest} {path}: {first_line(e)}", sys.stderr)
                out.append((dest, path, e.strerror or first_line(e)))
        return out

    # ---------------------------------------------------------------- the acknowledgements
    def listeners(self):
        """Who will acknowledge the verdict: (ranks, how many). After the roll call the live ranks; before it
        (None, the number that checked in so far): each has a listener on the verdict key."""
        run = self.run
        if run["host_of"]:
            ranks = [r for r in run["host_of"] if r and r not in run["gone"]]
            return ranks, len(ranks)
        return None, max(0, bounded(lambda: self.client.count("arrived"), STORE_OP_S, 1) - 1)

    def wait_acks(self, code):
        """Keep the store up until every listener acknowledged (their sealed ack/<rank>; the counter only wakes
        the check), within the acks' bound. A verdict written over from outside is put back at once."""
        (ranks, n), end, polls = self.listeners(), time.monotonic() + self.run["acks_s"], 0
        client = self.client
        while n > 0 and time.monotonic() < end:
            try:
                if client.count("acks") >= n and (ranks is None or client.acked(ranks)):
                    return
                polls += 1
                if polls % 5 == 0 and not client.verdict_holds(code):
                    client.publish_verdict(code)
                    emit(f"WARNING: rendezvous: the verdict key at {self.run['addr']}:{self.run['port']} was written "
                         "over from outside the job after the verdict; rank 0 put its own back (no rank takes a "
                         "forged code)", sys.stderr)
            except Exception:
                return
            time.sleep(0.02)
