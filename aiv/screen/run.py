"""Floor 5 (runtime): the performance screen on the ranks: the collectives the screen loop asks for.
Every rank's part (ScreenRunner), rank 0's (ScreenCoordinator: it runs screen_loop, whose measure()
publishes each batch on the store and collects the posts) and the other ranks' (ScreenFollower: each
batch read from the store, its group's all_reduce run and posted, until rank 0 says the screen is done)."""
import contextlib
import datetime
import time

from ..checks.hang import group_key
from ..checks.judge import apply_strict, finished_by
from ..core.base import EXIT_TIMEOUT, Verdict, _counts, _screen_median, verdict_code
from ..core.deadlines import NAMING_S, PHASE_WHAT, TORCH_BACKSTOP_S
from .gpu import gpu_remeasured, gpu_suspects, judge_gpu_facts, screen_band_lines
from .judge import screen_band_names, screen_judged_against
from .loop import judge_screen, screen_loop
from .measure import HostStarved, can_split, screen_busbw, screen_measure_gpu, split_problem, take_screen_gpu
from .plan import screen_creation, screen_gpu_rows, screen_rank_plans, screen_split_groups, screen_stuck


class ScreenRunner:
    """Every rank's part of the performance screen (SCREEN_PHASES): its own device measurement, and in
    screen-net each batch's part: its group made (when new), the batch's start gate, its group's all_reduce
    busbw, its post. Mixed into RankRun: the plumbing it uses (store, watchdog, deadlines, devices) is the
    rank's; the roles add screen_together (the gate) and phase_screen_net."""

    def phase_screen_gpu(self):
        """Every rank at once: its device's matmul and memory-copy speed, and on GPU the facts read under
        load, posted on the store."""
        self.failpoint("screen-gpu")
        row = None
        if self.bg.gpu is not None:  # measured on its own thread since the local checks (start_screen_gpu)
            with contextlib.suppress(HostStarved):  # the rank's own threads held the interpreter: again, below
                row = take_screen_gpu(self.bg.gpu)
            with self.state_lock:
                self.times["gpu_measure"] = self.bg.gpu["secs"]
        if row is None:  # CPU ranks (their own CPU clock), or a starved measuring thread: on a quiet process
            row = self.measure_quiet()
        self.proto.screen_post("gpu", self.rank, row, self.world)
        self.failpoint("done-screen-gpu")

    def screen_batch(self, e):
        """This rank's part of one batch: e = {'name', 'key', 'g': its group's ranks or None, 'rail', 'make':
        the batch's group creation (screen_rank_plans' entry) or None when every group exists}. Every rank
        posts, also outside any group, so that rank 0 sees who finished the batch."""
        name, made = e["name"], 0.0
        if e.get("make"):
            group, made = self.screen_group(name, e["make"], e["key"])
            if e["make"].get("g"):
                self.my_groups[tuple(e["make"]["g"])] = group
        self.round_gate(name)
        post = {"split_s": round(made, 3)}
        if e.get("gpu"):  # measured again: a slow GPU is named only when slow again
            post["gpu"] = None  # the interpreter starved: the first measurement stands alone (named once)
            with contextlib.suppress(HostStarved):
                post["gpu"] = self.measure_quiet()
        if e.get("g"):
            with self.issuing("all_reduce (busbw)", e["g"]):
                bw, sec = screen_busbw(self.torch, self.dist, self.my_groups[tuple(e["g"])], len(e["g"]),
                                       self._device(), self._kind())
            post.update(busbw=float(f"{bw:.4g}"), time_us=round(sec * 1e6, 1))
            if e.get("rail") is not None and self.nccl:
                post["hca"] = self.nccl.hca_since_last()  # this pair's connections, from NCCL's log
        self.proto.screen_post(name, self.rank, post, self.world)

    def measure_quiet(self):
        """This rank's device measured (again) on a quiet process, its background work done first (HostStarved
        when the interpreter was starved all the same)."""
        self.quiesce()
        g = self.identity.get("gpu") or {}
        return screen_measure_gpu(self.torch, self._device(), self._kind(), g.get("uuid"), g.get("pci"),
                                  self.args.sysfs_root)

    def round_gate(self, name):
        """Every rank starts `name` together (the soak's load, a screen batch): this rank posts that it is
        ready, then the role's screen_together (rank 0 opens the gate once every rank is ready)."""
        self.proto.screen_post(f"{name}-ready", self.rank, {}, self.world)
        self.screen_together(name)

    def screen_group(self, name, entry, key):
        """(this rank's new group of the batch or None, seconds its creation took). One creation per batch
        with new groups: on NCCL one collective call of every rank splits the world (split_group;
        new_subgroups_by_enumeration before torch 2.6); on gloo only the members meet (new_group with local
        synchronisation), and a rank in no new group makes a group of itself, so that every rank's count of
        groups (part of torch's hashed group names) stays equal. Groups are kept, never destroyed: a
        destroy can hang on a broken peer, and the process ends soon after."""
        mine, dist, t = entry.get("g"), self.dist, time.monotonic()
        if entry["mode"] != "split":
            return (dist.group.WORLD if entry["mode"] == "world" else None), 0.0
        kw = {"timeout": datetime.timedelta(seconds=self.bound.seconds + TORCH_BACKSTOP_S)}  # our bound fires first
        if self.backend != "nccl":
            with self.issuing("new_group", mine or [self.rank], seq=0):
                group = dist.new_group(mine or [self.rank], use_local_synchronization=True, **kw)
        elif can_split(self.torch, dist):
            import inspect
            params = inspect.signature(dist.split_group).parameters
            with self.issuing("split_group"):
                group = dist.split_group(split_ranks=[mine or entry["other"]],
                                         **{k: v for k, v in kw.items() if k in params})
        else:
            every = self.proto.screen_plan(key, "all", self.screen_left())[name]
            with self.issuing("new_subgroups_by_enumeration"):
                group = dist.new_subgroups_by_enumeration(every, **kw)[0]
        if group is not None and (mine or self.backend != "nccl"):  # torch's name of it: its flight recorder's
            self.issued.names[group.group_name] = group_key(mine or [self.rank])
        self.screen_groups.append(group)
        made = time.monotonic() - t
        with self.state_lock:
            self.times[f"groups-{name}"] = round(made, 3)
        return (group if mine else None), made

    def screen_left(self):
        """Seconds this rank still waits within the phase's bound + its role's grace (the others: counted from
        rank 0's gate, + RANK0_GRACE)."""
        return self.bound.left(self.bound.grace)

    def _kind(self):
        return "gpu" if self.backend == "nccl" else "cpu"


class ScreenFollower:
    """Every rank but 0: the batches rank 0 publishes (screen/q<k>/<rank>), each run and posted, until
    rank 0 says the screen is done; then rank 0's gate (or its verdict, read by the listener)."""

    def phase_screen_net(self):
        self.failpoint("screen-net")
        for k in range(1, 1 << 20):
            e = self.proto.screen_plan(f"q{k}", self.rank, self.screen_left())
            if e.get("done"):
                break
            self.screen_batch(e)
        self.proto.wait_gate("screen", self.screen_left())

    def screen_together(self, name):
        """Every group of a batch starts together: wait for rank 0's gate (it opens it once every rank posted
        that its group is made)."""
        self.proto.wait_gate(f"round-{name}", self.screen_left() + NAMING_S)


class ScreenCoordinator:
    """Rank 0's part of the screen: the batches (screen_loop, each through measure()), the collection of
    every rank's posts within the phase's bound, the screen's judgement, and who did not finish."""

    def phase_screen_gpu(self):
        """Rank 0 also collects every rank's GPU row."""
        t = time.monotonic()
        self.screen_start()
        super().phase_screen_gpu()
        rows = screen_gpu_rows(self.records, self.screen_collect(["gpu"])["gpu"], self.screen["cpu"])
        with self.state_lock:
            self.screen["gpu"] = rows
        tf, hb = [r["tflops"] for r in rows], [r["hbm_gbps"] for r in rows]
        self.progress("screen_gpu", n=len(rows), what="CPU rank(s)" if self.screen["cpu"] else "GPU(s)",
                      tflops=f"{min(tf):.2f}/{_screen_median(tf):.2f}", hbm=f"{min(hb):.1f}/{_screen_median(hb):.1f}",
                      secs=time.monotonic() - t)

    def screen_start(self):
        a = self.args
        self.screen_rounds = {"screen-net": []}
        self.screen_made = set()
        screen = {"cpu": self.backend != "nccl", "min_tflops": a.min_tflops, "min_hbm": a.min_hbm,
                  "min_busbw_intra": a.min_busbw_intra, "min_busbw_inter": a.min_busbw_inter,
                  "gpu": [], "intra": [], "pairs": [], "splits": {}}
        why = split_problem(self.torch, self.dist) if self.backend == "nccl" else None
        if why:  # named in the report and the JSON (screen_degraded_note), never chosen silently
            screen["no_split"] = {"why": why, "groups": 0}
        with self.state_lock:
            self.screen = screen

    def phase_screen_net(self):
        """The network screen: screen_loop decides every batch (intra-node, the pair rounds, re-measurements
        beside known-good nodes, the suspect round, the localisation inside a slow node); each runs through
        screen_measure. Then the screen's judgement: a FAIL ends the run before the full-job collectives."""
        t, a = time.monotonic(), self.args
        self.failpoint("screen-net")
        self.gpu_remeasure()
        net = screen_loop(self.records, self.screen_measure, a.min_busbw_intra, a.min_busbw_inter, self.screen["cpu"])
        full = dict(self.screen, **net)
        judged = screen_judged_against(full, screen_band_names(a.manifest_data, self.records, full))  # no --manifest:
        # no band, said as such
        bands = screen_band_lines(a.manifest_data, self.records, full) if a.manifest_data else None
        with self.state_lock:  # the page draws each band's FAIL line beside the screen's own
            self.screen.update(net, judged_against=judged, **({"bands": bands} if bands is not None else {}))
        rounds = self.screen_rounds["screen-net"]
        self.proto.screen_publish(f"q{len(rounds) + 1}", {r: {"done": True} for r in range(self.world)})
        found = apply_strict(judge_screen(self.screen) + judge_gpu_facts(self.screen.get("gpu")), a.strict)
        self.findings += found
        self.progress("screen_net", detail=self.net_detail(), counts=_counts(found), secs=time.monotonic() - t)
        if verdict_code(self.findings):
            raise Verdict(verdict_code(self.findings))
        self.proto.open_gate("screen")

    def gpu_remeasure(self):
        """The GPUs the screen found slow (gpu_suspects) measured again, all at once in one batch, before any is
        named: their rows merged (gpu_remeasured: the better value counts, 'tries' 2)."""
        sc = self.screen
        suspects = gpu_suspects(sc.get("gpu"), sc, sc["cpu"])
        if not suspects:
            return
        posts = self.screen_measure([{"batch": "gpu-again", "ranks": [r], "nodes": [self.host_of.get(r, "?")],
                                      "rail": None, "gpu": True} for r in suspects])
        rows = gpu_remeasured(sc["gpu"], {r: (posts.get(r) or {}).get("gpu") for r in suspects})
        with self.state_lock:
            sc["gpu"] = rows

    def screen_measure(self, groups):
        """screen_loop's measure(): the batch's groups published on the store (each rank its part under
        screen/q<k>/<rank>), rank 0's own part run, every rank's post collected. -> {rank: post}."""
        rounds, name = self.screen_rounds["screen-net"], groups[0]["batch"]
        rounds.append((name, groups))  # for screen_stuck: the batches in the order they run
        key = f"q{len(rounds)}"
        new = [g for g in groups if tuple(g["ranks"]) not in self.screen_made and not g.get("gpu")]
        self.screen_made |= {tuple(g["ranks"]) for g in new}
        make = screen_rank_plans([(name, new)], self.world) if new else {}
        if new and self.screen.get("no_split"):
            with self.state_lock:
                self.screen["no_split"]["groups"] += screen_split_groups([(name, new)], self.world)
        if new and self.backend == "nccl" and not can_split(self.torch, self.dist):  # every rank enumerates them
            self.proto.screen_publish(key, {"all": {name: [g["ranks"] for g in new]}})
        mine = {r: g for g in groups for r in g["ranks"]}
        plans = {r: {"name": name, "key": key, "g": mine[r]["ranks"] if r in mine else None,
                     "rail": mine[r]["rail"] if r in mine else None, "make": make[r][name] if make else None}
                 for r in range(self.world)}
        for r, g in mine.items():
            if g.get("gpu"):  # a device measured again, no group: screen_batch's gpu_again
                plans[r].update(g=None, gpu=True)
        self.proto.screen_publish(key, plans)
        self.screen_batch(plans[0])
        return self.screen_collect([name])[name]

    def screen_together(self, name):
        """Every group of a batch starts together: once every rank has posted that its group is made (within
        the phase's bound, else it names the batch's groups), rank 0 opens the gate."""
        self.screen_wait(f"{name}-ready")
        self.failpoint(f"round-{name}")  # a test holds the run here (pause=S) between two batches
        self.proto.open_gate(f"round-{name}")

    def screen_collect(self, names):
        """Every rank's posts of the batches, waited for within the phase's bound. A batch left incomplete
        ends the run here, naming its groups (as the watchdog does when rank 0 is itself blocked in one)."""
        out = {}
        for name in names:
            self.screen_wait(name)
            out[name] = self.proto.screen_posts(name)
            made = screen_creation(self.round_groups().get(name) or [], out[name])
            if made:
                with self.state_lock:
                    self.screen["splits"][name] = made
        return out

    def screen_wait(self, name):
        """Every rank's post of `name` (a batch, the soak) within the phase's bound, else the run ends here naming
        who did not post."""
        if not self.proto.screen_wait(name, self.screen_left()):
            raise Verdict(EXIT_TIMEOUT, [self.unfinished(self.phase, self.proto, self.bound.cause())])

    def round_groups(self):
        return dict(r for rs in self.screen_rounds.values() for r in rs)

    def screen_unfinished(self, phase, client, cause, live, errors, silent, stamps, issued=None):
        """A screen phase that did not finish: (the finding naming the groups whose members did not post a
        batch, or None; the stamps for judge_unfinished, where a post of the GPU round counts as finishing
        it: rank 0 posts before it waits for the others)."""
        if phase == "screen-gpu":
            return None, finished_by(stamps, client.screen_posts("gpu"), phase)
        rounds = self.screen_rounds.get(phase) or []
        posted = {n: self.round_posted(client, n) for n, _ in rounds}
        how = cause[len(PHASE_WHAT[phase]):].strip() if cause.startswith(PHASE_WHAT[phase]) else cause
        return screen_stuck(phase, how, self.world, rounds, posted, self.host_of, live, errors, silent, issued), stamps

    def round_posted(self, client, name):
        """Ranks that did their part of a batch: posted it, or, while the batch's start gate is not complete,
        posted that their group was made (they wait at the gate for the others, not stuck themselves)."""
        ready = set(client.screen_posts(f"{name}-ready"))
        return set(client.screen_posts(name)) | (ready if len(ready) < self.world else set())

    def net_detail(self):
        """The screen-net progress line: batches, the intra-node and the inter-node measurements."""
        sc, batches = self.screen, self.screen.get("batches") or []
        intra, pairs = sc.get("intra") or [], sc.get("pairs") or []
        made = sum(sc["splits"].values())
        parts = [f"{len(batches)} batch(es)"]
        if intra:
            bws = [r["busbw"] for r in intra if r.get("busbw") is not None] or [0.0]
            parts.append(f"intra-node {len(intra)} node(s), busbw min/median {min(bws):.2f}/{_screen_median(bws):.2f}"
                         " GB/s")
        else:
            parts.append("no node runs two or more ranks")
        if pairs:
            bws = [r["busbw"] or 0.0 for r in pairs]
            rnds = len({r["round"] for r in pairs})
            parts.append(f"inter-node {len(pairs)} group measurement(s) in {rnds} round(s), busbw min/median "
                         f"{min(bws):.2f}/{_screen_median(bws):.2f} GB/s")
        else:
            parts.append("one node: no pairs between nodes")
        third = sc.get("third") or {}
        if third.get("groups"):
            parts.append(f"round 3 for suspect(s) {', '.join(third['suspects'][:4])}")
        return "; ".join(parts) + f"; groups made in {made:.2f}s"
