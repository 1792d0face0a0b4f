"""Floor 5 (runtime): the performance screen on the ranks: the collectives the plan asks for."""
import contextlib
import datetime
import time

from .base import EXIT_TIMEOUT, Verdict, _counts, _screen_median, verdict_code
from .deadlines import NAMING_S, PHASE_WHAT, PHASES, RANK0_GRACE, TORCH_BACKSTOP_S
from .judge import apply_strict
from .measure import HostStarved, can_split, screen_busbw, screen_measure_gpu, split_problem, take_screen_gpu
from .screen_judge import (
    _screen_names,
    judge_gpu_facts,
    judge_screen,
    screen_band_names,
    screen_best,
    screen_judged_against,
    screen_suspect_links,
    screen_third_round,
)
from .screen_plan import (
    SCREEN_REMEASURE_ROUNDS,
    screen_creation,
    screen_gpu_rows,
    screen_layout,
    screen_measured,
    screen_pair_hca,
    screen_plan,
    screen_rail_groups,
    screen_rank_plans,
    screen_remeasure_plan,
    screen_split_groups,
    screen_stuck,
)


class ScreenRunner:
    """The performance screen's four phases (SCREEN_PHASES), a role of every rank: its own
    measurements, its groups and the gates between rounds; on rank 0 also the plan of the rounds, the
    collection of every rank's posts and the screen's judgement. Mixed into RankRun: the plumbing it
    uses (store, watchdog, deadlines, devices) is the rank's."""

    @property
    def is0(self):
        return self.rank == 0

    def phase_screen_gpu(self):
        """Every rank at once: its device's matmul and memory-copy speed, and on GPU the facts read under
        load, posted on the store. Rank 0 first publishes every rank's groups of the rounds to come."""
        t = time.monotonic()
        if self.is0:
            self.screen_start()
        self.failpoint("screen-gpu")
        row = None
        if self.bg.gpu is not None:  # measured on its own thread since the local checks (start_screen_gpu)
            with contextlib.suppress(HostStarved):  # the rank's own threads held the interpreter: again, below
                row = take_screen_gpu(self.bg.gpu)
            self.times["gpu_measure"] = self.bg.gpu["secs"]
        if row is None:  # CPU ranks (their own CPU clock), or a starved measuring thread: on a quiet process
            self.quiesce()
            g = self.identity.get("gpu") or {}
            row = screen_measure_gpu(self.torch, self._device(), self._kind(), g.get("uuid"), g.get("pci"),
                                     self.args.sysfs_root)
        self.proto.screen_post("gpu", self.rank, row, self.world)
        if not self.is0:
            return
        rows = self.screen["gpu"] = screen_gpu_rows(self.records, self.screen_collect(["gpu"])["gpu"],
                                                    self.screen["cpu"])
        tf, hb = [r["tflops"] for r in rows], [r["hbm_gbps"] for r in rows]
        self.progress("screen_gpu", n=len(rows), what="CPU rank(s)" if self.screen["cpu"] else "GPU(s)",
                      tflops=f"{min(tf):.2f}/{_screen_median(tf):.2f}", hbm=f"{min(hb):.1f}/{_screen_median(hb):.1f}",
                      secs=time.monotonic() - t)

    def phase_screen_intra(self):
        """All ranks of each node in one group (one split of the world): all_reduce busbw inside the node."""
        t = time.monotonic()
        self.failpoint("screen-intra")
        self.screen_round("intra", self.plan()["intra"])
        if self.is0:
            got = screen_measured(self.screen_rounds["screen-intra"][0][1], self.screen_collect(["intra"])["intra"])
            model = {r["rank"]: (r.get("gpu") or {}).get("name") for r in self.records}
            self.screen["intra"] = [{"host": m["nodes"][0], "busbw": m["busbw"], "ranks": m["ranks"],
                                     "model": model.get(m["ranks"][0]),
                                     "time_us": m["time_us"]} for m in got]
            self.progress("screen_intra", detail=self._bw_detail(got, ["intra"], "no node runs two or more ranks"),
                          secs=time.monotonic() - t)

    def phase_screen_pairs(self):
        """Rounds 1 and 2 (all three for three nodes): per group of nodes and rail, the same local rank of
        each node in one group (one split of the world per round); all_reduce busbw between nodes."""
        t = time.monotonic()
        self.failpoint("screen-pairs")
        names = sorted(n for n in self.plan() if n != "intra")
        rows = []
        for name in names:
            self.screen_round(name, self.plan()[name])
            rows += self.screen_remeasure(name, rows if self.is0 else [])
        if self.is0:
            self.screen["pairs"] = rows
            self.progress("screen_pairs", detail=self._bw_detail(rows, names, "one node: no pairs between nodes"),
                          secs=time.monotonic() - t)

    def phase_screen_suspect(self):
        """Round 3: each suspect of rounds 1-2 with a node that passed, every rail (rank 0 plans it on the
        store). Then rank 0 judges the whole screen: a FAIL ends the run before the full-job collectives."""
        t = time.monotonic()
        if self.is0:
            self.screen_third()
        self.failpoint("screen-suspect")
        plan = self.proto.screen_plan("plan3", self.rank, self.D[self.phase] + RANK0_GRACE)
        rows = []
        for name in sorted(plan):
            self.screen_round(name, plan[name])
            rows += self.screen_remeasure(name, self.screen["pairs"] + rows if self.is0 else [])
        if not self.is0:
            self.proto.wait_gate("screen", self.D[self.phase] + RANK0_GRACE)
            return
        self.screen["pairs"] += rows
        self.screen["suspect_links"] = screen_suspect_links(self.screen["pairs"], self.args.min_busbw_inter,
                                                            self.screen["cpu"])
        found = apply_strict(judge_screen(self.screen) + judge_gpu_facts(self.screen.get("gpu")), self.args.strict)
        self.screen["judged_against"] = screen_judged_against(  # no --manifest: no band, said as such
            self.screen, screen_band_names(self.args.manifest_data, self.records, self.screen))
        self.findings += found
        self.progress("screen_suspect", detail=self._third_detail(rows), counts=_counts(found),
                      secs=time.monotonic() - t)
        if verdict_code(self.findings):
            raise Verdict(verdict_code(self.findings))
        self.proto.open_gate("screen")

    def screen_start(self):
        """Rank 0: the rounds' groups from the gathered records; each rank's part on the store."""
        rounds, a = screen_plan(self.records), self.args
        self.screen_rounds = {"screen-intra": rounds[:1], "screen-pairs": rounds[1:], "screen-suspect": []}
        self.screen = {"cpu": self.backend != "nccl", "min_tflops": a.min_tflops, "min_hbm": a.min_hbm,
                       "min_busbw_intra": a.min_busbw_intra, "min_busbw_inter": a.min_busbw_inter,
                       "gpu": [], "intra": [], "pairs": [], "splits": {}}
        why = split_problem(self.torch, self.dist) if self.backend == "nccl" else None
        if why:  # named in the report and the JSON (screen_degraded_note), never chosen silently
            self.screen["no_split"] = {"why": why, "groups": screen_split_groups(rounds, self.world)}
        self.screen_publish("plan", rounds)

    def screen_third(self):
        """Rank 0: round 3 from the measurements so far (screen_third_round); each rank's part on the store."""
        third = screen_third_round(self.screen["pairs"], self.args.min_busbw_inter, self.screen["cpu"])
        groups = screen_rail_groups(third["groups"] or [], screen_layout(self.records))
        self.screen["third"] = third
        self.screen_rounds["screen-suspect"] = [("p3", groups)] if groups else []
        if self.screen.get("no_split"):
            self.screen["no_split"]["groups"] += screen_split_groups(self.screen_rounds["screen-suspect"], self.world)
        self.screen_publish("plan3", self.screen_rounds["screen-suspect"])

    def screen_publish(self, name, rounds):
        self.proto.screen_publish(name, screen_rank_plans(rounds, self.world))
        if self.backend == "nccl" and not can_split(self.torch, self.dist):  # every rank enumerates every group
            self.proto.screen_publish(name, {"all": {n: [g["ranks"] for g in gs] for n, gs in rounds}})

    def plan(self):
        """This rank's part of the rounds 'intra', 'p1', 'p2' (and 'p3' for three nodes)."""
        if self.my_plan is None:
            self.my_plan = self.proto.screen_plan("plan", self.rank, self.D[self.phase] + RANK0_GRACE)
        return self.my_plan

    def screen_round(self, name, entry):
        """This rank's part of one round: its group, made here; the group's all_reduce busbw; the post
        (every rank posts, also outside any group, so that rank 0 sees who finished the round)."""
        group, made = self.screen_group(name, entry)
        self.my_groups[name] = group
        self.round_gate(name)
        post = {"split_s": round(made, 3)}
        if group is not None:
            bw, sec = screen_busbw(self.torch, self.dist, group, len(entry["g"]), self._device(), self._kind())
            post.update(busbw=float(f"{bw:.4g}"), time_us=round(sec * 1e6, 1))
            if self.phase != "screen-intra" and self.nccl:
                post["hca"] = self.nccl_hca()
        self.proto.screen_post(name, self.rank, post, self.world)

    def nccl_hca(self):
        """The HCA of this rank's connections since the last call (a pair round's communicator), from NCCL's
        log (parse_nccl_hca)."""
        return self.nccl.hca_since_last()

    def round_gate(self, name):
        """Every group of a round starts together: each rank posts that its group is made; rank 0, once
        every rank has (within the phase's bound, else it names the round's groups), opens the gate."""
        self.proto.screen_post(f"{name}-ready", self.rank, {}, self.world)
        end = self.phase_t0 + self.D[self.phase]
        if not self.is0:
            self.proto.wait_gate(f"round-{name}", end + RANK0_GRACE + NAMING_S - time.monotonic())
            return
        if not self.proto.screen_wait(f"{name}-ready", end - time.monotonic()):
            cause = f"{PHASE_WHAT[self.phase]} did not complete within {self.D[self.phase]:g}s"
            raise Verdict(EXIT_TIMEOUT, [self.unfinished(self.phase, self.proto, cause)])
        self.failpoint(f"round-{name}")  # a test holds the run here (pause=S) between two rounds
        self.proto.open_gate(f"round-{name}")

    def screen_remeasure(self, name, before):
        """After pair round `name`: its slow measurements re-measured with the groups already made, in up to
        SCREEN_REMEASURE_ROUNDS gated rounds <name>r1..r3 (screen_remeasure_plan: r1 all of them, r2 and r3
        half each); the best value counts (screen_best). Rank 0 decides against `before` and the round and
        publishes each re-measure round on the store. -> rank 0: the round's rows; others: []."""
        rows = self.screen_pair_rows([name]) if self.is0 else []
        for k in range(1, SCREEN_REMEASURE_ROUNDS + 1):
            redo = f"{name}r{k}"
            if self.is0:
                todo = screen_remeasure_plan(rows, before, k, self.args.min_busbw_inter, self.screen["cpu"])
                if todo:  # for screen_stuck: the rounds in the order they run
                    rnds = self.screen_rounds[self.phase]
                    at = max(i for i, (n, _) in enumerate(rnds) if n == name or n.startswith(name + "r"))
                    rnds.insert(at + 1, (redo, todo))
                self.proto.screen_publish(f"redo-{redo}", {"all": todo})
            todo = self.proto.screen_plan(f"redo-{redo}", "all", self.phase_t0 + self.D[self.phase]
                                          + RANK0_GRACE - time.monotonic())
            if not todo:
                break
            mine = next((g for g in todo if self.rank in g["ranks"]), None)
            self.round_gate(redo)
            post = {}
            if mine is not None:
                bw, sec = screen_busbw(self.torch, self.dist, self.my_groups[name], len(mine["ranks"]),
                                       self._device(), self._kind())
                post = {"busbw": float(f"{bw:.4g}"), "time_us": round(sec * 1e6, 1)}
            self.proto.screen_post(redo, self.rank, post, self.world)
            if self.is0:
                rows = screen_best(rows, screen_measured(todo, self.screen_collect([redo])[redo]))
        return rows

    def screen_group(self, name, entry):
        """(this rank's group of the round or None, seconds its creation took). One creation per round: on
        NCCL one collective call of every rank splits the world (split_group; new_subgroups_by_enumeration
        before torch 2.6); on gloo only the members meet (new_group with local synchronisation), and a rank
        in no group makes a group of itself, so that every rank's count of groups (part of torch's hashed
        group names) stays equal. Groups are kept, never destroyed: a destroy can hang on a broken peer,
        and the process ends soon after."""
        mine, dist, t = entry.get("g"), self.dist, time.monotonic()
        if entry["mode"] != "split":
            return (dist.group.WORLD if entry["mode"] == "world" else None), 0.0
        kw = {"timeout": datetime.timedelta(seconds=self.D[self.phase] + TORCH_BACKSTOP_S)}  # our bound fires first
        if self.backend != "nccl":
            group = dist.new_group(mine or [self.rank], use_local_synchronization=True, **kw)
        elif can_split(self.torch, dist):
            import inspect
            params = inspect.signature(dist.split_group).parameters
            group = dist.split_group(split_ranks=[mine or entry["other"]],
                                     **{k: v for k, v in kw.items() if k in params})
        else:
            src = "plan3" if self.phase == "screen-suspect" else "plan"
            every = self.proto.screen_plan(src, "all", self.D[self.phase])[name]
            group = dist.new_subgroups_by_enumeration(every, **kw)[0]
        self.screen_groups.append(group)
        made = time.monotonic() - t
        self.times[f"groups-{name}"] = round(made, 3)
        return (group if mine else None), made

    def screen_collect(self, names):
        """Rank 0: every rank's posts of the rounds, waited for within the phase's bound. A round left
        incomplete ends the run here, naming its groups (as the watchdog does when rank 0 is itself
        blocked in one)."""
        end, out = self.phase_t0 + self.D[self.phase], {}
        for name in names:
            if not self.proto.screen_wait(name, end - time.monotonic()):
                cause = f"{PHASE_WHAT[self.phase]} did not complete within {self.D[self.phase]:g}s"
                raise Verdict(EXIT_TIMEOUT, [self.unfinished(self.phase, self.proto, cause)])
            out[name] = self.proto.screen_posts(name)
            made = screen_creation(self.round_groups().get(name) or [], out[name])
            if made:
                self.screen["splits"][name] = made
        return out

    def round_groups(self):
        return dict(r for rs in self.screen_rounds.values() for r in rs)

    def screen_pair_rows(self, names):
        """Rank 0: judge_pairs' rows of the rounds `names` (their posts collected)."""
        groups = self.round_groups()
        posts = self.screen_collect(names)
        return [{"round": int(n[1:]), "nodes": m["nodes"], "rail": m["rail"], "busbw": m["busbw"],
                 "hca": screen_pair_hca(m["ranks"], posts[n], self.records),
                 "ranks": m["ranks"], "time_us": m["time_us"]}
                for n in names for m in screen_measured(groups[n], posts[n])]

    def screen_unfinished(self, phase, client, cause, live, errors, silent, stamps):
        """Rank 0, a screen phase that did not finish: (the finding naming the groups whose members did not
        post a round, or None; the stamps for judge_unfinished, where a post of the GPU round counts as
        finishing it: rank 0 posts before it waits for the others)."""
        if phase == "screen-gpu":
            posted, idx = set(client.screen_posts("gpu")), PHASES.index(phase)
            return None, {r: max(s, idx) if r in posted else s for r, s in stamps.items()}
        rounds = self.screen_rounds.get(phase) or []
        posted = {n: self.round_posted(client, n) for n, _ in rounds}
        how = cause[len(PHASE_WHAT[phase]):].strip() if cause.startswith(PHASE_WHAT[phase]) else cause
        return screen_stuck(phase, how, self.world, rounds, posted, self.host_of, live, errors, silent), stamps

    def round_posted(self, client, name):
        """Ranks that did their part of a round: posted it, or, while the round's start gate is not complete,
        posted that their group was made (they wait at the gate for the others, not stuck themselves)."""
        ready = set(client.screen_posts(f"{name}-ready"))
        return set(client.screen_posts(name)) | (ready if len(ready) < self.world else set())

    def _bw_detail(self, rows, names, none):
        if not rows:
            return none
        bws = [r["busbw"] for r in rows]
        made = sum(self.screen["splits"].get(n, 0.0) for n in names)
        return (f"{len(rows)} group measurement(s) in {len(names)} round(s), busbw min/median "
                f"{min(bws):.2f}/{_screen_median(bws):.2f} GB/s, groups made in {made:.2f}s")

    def _third_detail(self, rows):
        third = self.screen.get("third") or {}
        if not self.screen["pairs"]:
            return "no pairs between nodes"
        if third.get("groups") is None:
            return f"widespread: {len(third.get('suspects') or [])} suspect node(s), no round 3"
        if not rows:
            return "no round 3 (" + ("no suspect" if not third.get("suspects") else "every pair measured") + ")"
        return (f"round 3 for suspect(s) {_screen_names(third['suspects'])}: "
                + self._bw_detail(rows, ["p3"], ""))

    def _kind(self):
        return "gpu" if self.backend == "nccl" else "cpu"
