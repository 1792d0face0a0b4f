"""Floor 5 (runtime): the side channel: one TCPStore, every value sealed with the job's secret and
bound to the run (Seal), the keys and the waits of the protocol (StoreProtocol)."""
import contextlib
import datetime
import hashlib
import hmac
import ipaddress
import json
import os
import resource
import time

from ..checks.judge import stray_reason
from ..core.base import group_by
from ..core.deadlines import FORGED_POLL_S, PHASES


def fd_limit_problem(world, nodes):
    """Rank 0's store holds two connections per rank (main and listener) and two per node (its monitor and
    its leader's beat). Raise the soft RLIMIT_NOFILE to the hard limit; a hard limit too low is a message, else None."""
    need = 2 * world + 2 * nodes + 64
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < need:
        return (f"the open-files hard limit (ulimit -Hn) is {hard}, below the {need} the store needs for "
                f"{world} ranks on {nodes} node(s) (2 per rank + 2 per node + 64): raise it for the job")
    if soft != resource.RLIM_INFINITY and soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return None


def norm_ip(text):
    """'0000:...:0001' -> '::1', '::ffff:10.0.0.1' -> '10.0.0.1' (None: not an address)."""
    try:
        ip = ipaddress.ip_address(text.split("%", 1)[0])
    except ValueError:
        return None
    return str(getattr(ip, "ipv4_mapped", None) or ip)


def store_peers(port):
    """The remote addresses of the TCP connections this process accepted on `port` (rank 0's store):
    a set of IPs, None when psutil cannot tell."""
    try:
        import psutil
        me = psutil.Process()
        conns = me.net_connections("tcp") if hasattr(me, "net_connections") else me.connections("tcp")
    except Exception:
        return None
    return {norm_ip(c.raddr.ip) for c in conns if c.laddr and c.laddr.port == port and c.raddr} - {None}


def run_base(env):
    """'<job>.<step>' from Slurm ('' outside Slurm): the part of the run id that binds a record to its job."""
    return ".".join(env.get(v, "") for v in ("SLURM_JOB_ID", "SLURM_STEP_ID")).strip(".")


def store_timed_out(exc):
    """Whether `exc` is the store's own timeout (torch's DistStoreError 'wait timeout', or TimeoutError). A store
    that is gone, and the tool's own error, are not: raised to the phase (is_tool_error), never 'not arrived'."""
    return isinstance(exc, TimeoutError) or (type(exc).__name__ == "DistStoreError" and "timeout" in str(exc).lower())


class Forged(Exception):
    """A store value that is not this run's: it did not carry the job's secret, or it was replayed
    from another run. key: the store key; raw: what the value said (quoted, never believed)."""

    def __init__(self, key, raw, why):
        super().__init__(f"{key}: {why}")
        self.key, self.raw, self.why = key, raw, why


class Seal:
    """Every value on the side channel is '<tag>|<run id>|<payload>', tag = HMAC-SHA256 of (run id, key,
    payload) with the job's secret ('-' without one). The run id is '<job>.<step>.<nonce>'; rank 0 picks
    the nonce and publishes the run id in the world record, so a record of another run (another job,
    step or roll call) is refused even when it carries the secret. Without a secret, values are only
    checked for their run id: the report says the channel is not authenticated."""

    def __init__(self, secret=None, base=""):
        self.secret, self.base, self.run = secret, base, None

    @property
    def authenticated(self):
        return self.secret is not None

    def tag(self, run, key, payload):
        if self.secret is None:
            return "-"
        return hmac.new(self.secret, f"{run}\0{key}\0{payload}".encode(), hashlib.sha256).hexdigest()

    def seal(self, key, payload, run=None):
        run = run or self.run
        return f"{self.tag(run, key, payload)}|{run}|{payload}"

    def unseal(self, key, value, world=False):
        """The payload of a value under `key`, or Forged. world: the world record, which sets the run id
        (its job and step must be ours, when we know them)."""
        text = value.decode(errors="replace") if isinstance(value, bytes) else value
        parts = text.split("|", 2)
        if len(parts) != 3 or not parts[1]:
            raise Forged(key, text, "did not carry the job's secret" if self.secret is not None
                         else "was not written by this tool (no run id)")
        tag, run, payload = parts
        if self.secret is not None and not hmac.compare_digest(tag, self.tag(run, key, payload)):
            raise Forged(key, payload, "did not carry the job's secret" + (" (it is unsigned)" if tag == "-" else ""))
        if world:
            if self.base and run.rsplit(".", 1)[0] != self.base:
                raise Forged(key, payload, f"is a record of another job or step (run {run}, this is {self.base})")
        elif run != self.run:
            raise Forged(key, payload, f"is a replay of another run (run {run}, this is {self.run})")
        return payload


def store_server(dist, addr, port, t, listen_fd):
    """The store's server on a socket rank 0 bound itself. torch 2.4's server (libuv) takes no listen fd
    (NotImplementedError), and its legacy one (use_libuv=False) wakes no wait on a compare_set (every gate
    would hang): there the socket is closed and the server binds the same port itself, on every interface."""
    try:
        return dist.TCPStore(addr, port, None, True, t, wait_for_workers=False, master_listen_fd=listen_fd)
    except NotImplementedError:
        with contextlib.suppress(OSError):
            os.close(listen_fd)
        return dist.TCPStore(addr, port, None, True, t, wait_for_workers=False)


class SealedStore:
    """The side channel's wire, under every key of StoreProtocol: the store (under the run's prefix; raw,
    the bare client), each value written sealed (Seal) and read only when it unseals; a value that does
    not is refused, kept in `forged` (shared by the clones) and, by a rank other than 0, told to rank 0."""

    def __init__(self, store, raw=None, prefix=None, seal=None, shared=None):
        self.store, self.raw, self.prefix = store, raw, prefix
        self.seal = seal if seal is not None else Seal()
        # shared by the clones: forged [{key, why, claim, seen_by}], mine {key: the sealed value this process
        # wrote last}, lists {appended keys read} (what audit() checks again at the verdict)
        self.shared = shared if shared is not None else {"forged": [], "mine": {}, "lists": set()}
        self.forged = self.shared["forged"]
        self.rank = self.world = None
        self.tells = False  # refusals are reported to rank 0 (every process but rank 0's)

    @property
    def run(self):
        """The run id (rank 0 publishes it; the others read it at the check-in)."""
        return self.seal.run

    def _wait(self, keys, seconds):
        self.store.wait(keys, datetime.timedelta(seconds=max(0.001, seconds)))

    # -- sealing
    def _set(self, key, payload):
        """Write a key only this process writes (or writes first), as compare_set from the value it wrote
        last: a value someone else put there in between comes back, and is refused unless it unseals (a
        forger that writes before the owner is found by the owner; one that writes after, by audit())."""
        val = self.seal.seal(key, payload)
        got = self.store.compare_set(key, self.shared["mine"].get(key, ""), val)
        if got != val.encode():
            self._open(key, got)
            self.store.set(key, val)
        self.shared["mine"][key] = val

    def _multi_set(self, keys, payloads):
        vals = [self.seal.seal(k, p) for k, p in zip(keys, payloads, strict=True)]
        self.store.multi_set(keys, vals)
        self.shared["mine"].update(zip(keys, vals, strict=True))

    def _append(self, key, payload):
        self.store.append(key, self.seal.seal(key, payload) + "\n")

    def _open(self, key, value, default=None, read=None):
        """The payload of a sealed value (read: value -> payload, or Forged; default unseal); `default` (and the
        forgery kept) when it does not unseal."""
        try:
            return read(value) if read else self.seal.unseal(key, value)
        except Forged as e:
            self.refuse(e)
            return default

    def _lines(self, key):
        """The payloads of an appended key's sealed lines (forged lines dropped)."""
        self.shared["lists"].add(key)
        if not self.store.check([key]):
            return []
        lines = self.store.get(key).decode(errors="replace").splitlines()
        return [p for p in (self._open(key, ln) for ln in lines if ln) if p is not None]

    def _wait_valid(self, key, seconds, read=None):
        """Wait for `key` to hold a value that unseals (read: as _open's), within `seconds`. A forged value is
        refused and waited past: the real writer may still overwrite it. TimeoutError when none came."""
        end = time.monotonic() + seconds
        while True:
            self._wait([key], end - time.monotonic())
            got = self._open(key, self.store.get(key), read=read)
            if got is not None:
                return got
            if time.monotonic() >= end:
                raise TimeoutError(f"{key} held no value of this run within {seconds:g}s")
            time.sleep(FORGED_POLL_S)

    def refuse(self, exc):
        """Keep a forgery (once per key and reason); a rank other than 0 also tells rank 0 (best effort)."""
        claim = exc.raw if isinstance(exc.raw, str) else str(exc.raw)
        try:
            said = json.loads(claim)
        except ValueError:
            said = None
        if isinstance(said, dict):  # what it claimed to be, for the line: its rank and host
            claim = json.dumps({k: said[k] for k in ("rank", "host") if k in said})
        entry = {"key": exc.key, "why": exc.why, "claim": claim[:300], "seen_by": self.rank}
        if self._known(entry):
            return
        self.forged.append(entry)
        if self.tells and self.seal.run:
            with contextlib.suppress(Exception):
                self._append("forged", json.dumps(entry))

    def forgeries(self):
        """Rank 0: every forgery seen, its own and those the others reported."""
        self.forged.extend(e for e in map(json.loads, self._lines("forged")) if not self._known(e))
        return list(self.forged)

    def _known(self, entry):
        """Whether a forgery of this key, for this reason, is kept already."""
        return any(f["key"] == entry.get("key") and f["why"] == entry.get("why") for f in self.forged)

    def _existing(self, keys):
        """The keys of `keys` that exist (one round trip when all do): a read never waits for a key."""
        if not keys or self.store.check(keys):
            return keys
        return [k for k in keys if self.store.check([k])]

    def _values(self, keys):
        return self.store.multi_get(keys) if keys else []

    def count(self, key):
        """A counter (arrived, hellos, nerr, acks, posts/<name>/n): a count to watch, a wake-up; counters cannot be
        sealed, so the sealed records they count (the identities, errors(), posts(), acked()) are what counts."""
        return self.store.add(key, 0)


class StoreRollCall:
    """The roll call's keys (StoreProtocol lists them), mixed into StoreProtocol: the world record and its run
    id, each rank's check-in, who arrived, their identities, each node's ranks for its monitor."""

    def publish_world(self, world):
        """Rank 0, before its check-in: the world size every rank is held to, and the run id."""
        nonce = os.urandom(8).hex()
        self.seal.run, self.world = f"{self.seal.base}.{nonce}" if self.seal.base else nonce, world
        self._set("world", json.dumps({"world": world, "run": self.seal.run}))

    def read_world(self, value):
        """The world record -> {'world', 'run'} (Forged when it is not this job's, or its run id is not the
        one it is sealed with)."""
        payload = self.seal.unseal("world", value, world=True)
        w = json.loads(payload)
        if value.decode(errors="replace").split("|", 2)[1] != w.get("run"):
            raise Forged("world", payload, "carries a run id other than the one it is sealed with")
        return w

    def _world(self):
        """The world record if there is one that unseals (a forged one is refused), else None; never waits."""
        has = self.store.check(["world"])
        return self._open("world", self.store.get("world"), read=self.read_world) if has else None

    def adopt_run(self):
        """Before its check-in (an error, a signal): take the run id from the world record, if there is one
        that unseals, so that the report is bound to this run. -> whether a run id is known."""
        w = self._world()
        if w is not None:
            self.seal.run = w["run"]
        return self.seal.run is not None

    def check_in(self, rank, identity, world, seconds):
        """Claim the rank (the first claimant's 'pid P on HOST' stays in who/<rank>) and check in; a
        process that is no rank of rank 0's world (stray_reason) is posted under `strays` instead, and
        wakes rank 0's roll call. A claim that does not unseal is refused (and reported) and replaced
        by ours. -> None, or the stray's (check, reason)."""
        w = self._wait_valid("world", seconds, self.read_world)
        world0, self.seal.run, self.world, self.rank = int(w["world"]), w["run"], int(w["world"]), rank
        self.tells = rank != 0
        if self.forged and self.tells:  # refused before the run id was known: rank 0 hears of them now
            for e in list(self.forged):
                with contextlib.suppress(Exception):
                    self._append("forged", json.dumps(dict(e, seen_by=rank)))
        who = self.seal.seal(f"who/{rank}", f"pid {identity['pid']} on {identity['host']}")
        stray = stray_reason(rank, world, world0, None)  # a stray of another world claims no rank
        if stray is None:
            got = self.store.compare_set(f"who/{rank}", "", who)
            if got != who.encode() and self._open(f"who/{rank}", got) is None:  # a forged claim: ours instead
                got = self.store.compare_set(f"who/{rank}", got, who)
            first = None if got == who.encode() else self._open(f"who/{rank}", got, "an unreadable claim")
            stray = stray_reason(rank, world, world0, first)
        if stray is not None:
            entry = {"rank": rank, "host": identity["host"], "pid": identity["pid"], "check": stray[0],
                     "why": stray[1]}
            self._append("strays", json.dumps(entry))
            self.wake_roll_call("stray")
            return stray
        self._set(f"id/{rank}", json.dumps(identity, default=str))
        self._set(f"stamp/{rank}", "0")
        if self.store.add("arrived", 1) == world:
            self._set("all_arrived", "1")
        return None

    def is_run(self, run):
        """Whether this store is the run whose run id is `run`."""
        return (self._world() or {}).get("run") == run

    def strays(self):
        return [json.loads(p) for p in self._lines("strays")]

    def wait_all(self, seconds):
        """Whether all_arrived was set within `seconds` (a wake-up only: the records are what counts)."""
        try:
            self._wait(["all_arrived"], seconds)
        except Exception as e:
            if not store_timed_out(e):
                raise
            return False
        return self._open("all_arrived", self.store.get("all_arrived")) is not None

    def all_in(self, world):
        """Whether every rank's record is there (one round trip)."""
        return self.store.check([f"id/{r}" for r in range(world)])

    def said_hello(self, ranks):
        """The ranks of `ranks` whose process said hello (reached the store, not checked in yet)."""
        return [r for r in ranks if self.store.check([f"hello/{r}"])]

    def missing(self, world):
        have = set(self._existing([f"id/{r}" for r in range(world)]))
        return [r for r in range(world) if f"id/{r}" not in have]

    def identities(self, ranks):
        """The identities of `ranks` that unseal (a forged one is kept in `forged`, not returned)."""
        vals = self._values([f"id/{r}" for r in ranks])
        out = [self._open(f"id/{r}", v) for r, v in zip(ranks, vals, strict=True)]
        return [json.loads(p) for p in out if p is not None]

    def prepare(self, records):
        """Rank 0, before the go: each node's ranks and PIDs, empty liveness and error keys (so that
        no later read waits on a key that was never written)."""
        nodes = group_by(records, lambda rec: rec["host"], lambda rec: [rec["rank"], rec["pid"], rec.get("pid_start")])
        self._multi_set([f"node/{h}" for h in nodes] + [f"live/{h}" for h in nodes],
                        [json.dumps(v) for v in nodes.values()] + ["{}"] * len(nodes))
        self.store.multi_set([f"beat/{h}" for h in nodes], ["0"] * len(nodes))
        self.store.set("errors", "")

    def node_ranks(self, host):
        """A node's [[rank, pid, start], ...] (None when the record does not unseal)."""
        payload = self._open(f"node/{host}", self.store.get(f"node/{host}"))
        return None if payload is None else json.loads(payload)


class StoreProtocol(StoreRollCall, SealedStore):
    """The run's side channel: one TCPStore that every rank reaches, served by rank 0 (or, under
    torchrun, by the agent). A TCPStore client serialises its operations, so each thread that
    blocks on the store has its own connection (clone()). Every value is sealed (Seal: the job's
    secret and the run id); a value that does not unseal is never believed: it is dropped and kept in
    `forged` (shared by the clones), and a rank other than 0 reports it to rank 0 under `forged`.
    Counters (arrived, nerr, acks, screen/<round>/n) cannot be signed: they only wake a reader, who
    then counts the sealed records. Every key, under one prefix:

      world          {"world": N, "run": run id}: the world size every rank is held to, and the
                     run id every value is bound to (said markers, node monitors)   rank 0, first
      who/<rank>     'pid P on HOST' of the rank's first claimant (compare_set)   each rank
      strays         processes refused at the check-in (JSON lines, stray_reason)   a stray
      id/<rank>      identity at the roll call (JSON)             each rank
      arrived        ranks checked in (counter); all_arrived      each rank; the last one
      hello/<rank>, hellos  its process reached the store (its host, unsigned: a wake-up; a forged one only keeps
                     the roll call at its own bound); how many (counter)   each rank but 0, before torch
      node/<host>    [[rank, pid], ...] of a node, for its monitor rank 0
      stamp/<rank>   index in PHASES of the last phase finished   each rank
      live/<host>    {"seq": n, "ranks": {rank: state}}           each node's monitor
      monitor/<host> the monitor's check of its own client (unsigned: read by nobody else)   each node's monitor
      gate/<name>    rank 0's go after the roll call and the judge rank 0
      errors, nerr   error lines (JSON, appended) and their count  any rank
      forged         values a rank refused (JSON lines: key, why, claim)   any rank but 0
      verdict        rank 0's exit code: listeners exit with it   rank 0
      ask            rank 0's question when a phase did not finish ('1'): each rank's listener, which waits
                     on this key, answers under posts/issued; set to 'verdict' after the verdict (the
                     listener then takes the verdict)   rank 0
      ack/<rank>, acks  a rank read the verdict; how many did (counter)   each rank
      screen/q<k>/<rank>                                          rank 0
                     the rank's part of the screen loop's k-th batch (JSON: its group, the batch's group
                     creation from screen_rank_plans), or {"done": true} after the last batch
      screen/<round> a batch's measurements, one JSON line per rank (appended): gpu, intra, p1-p3, b<k>
                     (every rank posts every batch it reaches, also outside any group)   each rank
      screen/<round>/n, screen/<round>/all  posts counted; set by the last of the world  each rank
      gate/screen    rank 0's go after the screen's judgement     rank 0
      posts/<name>   a fan-in to rank 0, one JSON line per rank (appended): telemetry (identity and
                     node facts), results (the collectives' and DDP step's), issued (the last collective
                     each rank issued on each of its groups, when rank 0 asked)   each rank
      posts/<name>/n, posts/<name>/all  posts counted; set by the last of the world   each rank
    Measurements travel here, not through a collective of the world, so that a hung group of two
    nodes cannot hang the others: rank 0 waits for the keys within the phase's bound and names the
    groups whose members did not post. The telemetry and the results come here too (not gather_object,
    which on NCCL is world - 1 point-to-point connections into rank 0): rank 0 reads the whole world's
    posts in one read of one key. Nothing here is unpickled: every payload is JSON or a number.
    """

    @classmethod
    def open(cls, dist, addr, port, timeout, prefix, listen_fd=None, seal=None):
        """Serve the store on a socket rank 0 bound itself (listen_fd), or connect to it."""
        t = datetime.timedelta(seconds=timeout)
        raw = store_server(dist, addr, port, t, listen_fd) if listen_fd is not None else \
            dist.TCPStore(addr, port, None, False, t)
        p = cls(dist.PrefixStore(prefix, raw), raw, prefix, seal)
        p.dial = lambda: dist.PrefixStore(prefix, dist.TCPStore(addr, port, None, False, t))
        return p

    dial = None  # open(): a new client connection to the same store (clone() where torch has no Store.clone)

    def clone(self):
        """Another connection to the same store, for another thread: Store.clone (torch >= 2.8), else a new
        TCPStore client to the same host:port with the same timeout (dial)."""
        try:
            store = self.store.clone() if hasattr(self.store, "clone") or self.dial is None else self.dial()
        except NotImplementedError:
            if self.dial is None:
                raise
            store = self.dial()
        c = StoreProtocol(store, None, self.prefix, self.seal, self.shared)
        c.rank, c.world, c.tells, c.dial = self.rank, self.world, self.tells, self.dial
        return c

    # -- progress and liveness
    def stamp(self, rank, phase):
        self._set(f"stamp/{rank}", str(PHASES.index(phase)))

    def stamps(self, world):
        """{rank: index in PHASES}; a forged stamp counts as the check-in's (0)."""
        vals = self.store.multi_get([f"stamp/{r}" for r in range(world)])
        return {r: int(self._open(f"stamp/{r}", v, "0")) for r, v in enumerate(vals)}

    def post_live(self, host, seq, states):
        self._set(f"live/{host}", json.dumps({"seq": seq, "ranks": states}))

    def live(self, hosts):
        vals = self.store.multi_get([f"live/{h}" for h in hosts])
        return {h: json.loads(self._open(f"live/{h}", v, "{}")) for h, v in zip(hosts, vals, strict=True)}

    def beat(self, host):
        """A node leader's beat thread, every liveness period: the node's ranks reach the store. A bare
        counter (a forged one can only keep a node from being called unreachable, never blame one)."""
        self.store.add(f"beat/{host}", 1)

    def beats(self, hosts):
        """{host: its beat count} (0 where there is none: a read never waits for a key)."""
        keys = self._existing([f"beat/{h}" for h in hosts])
        got = dict(zip(keys, self._values(keys), strict=True))
        return {h: int(v) if (v := got.get(f"beat/{h}", b"0")).isdigit() else 0 for h in hosts}

    def settled_live(self, hosts, budget):
        """Liveness once every node has posted after this call (or its ranks are all gone), within `budget`
        seconds. -> ({rank: state}, silent, quiet). silent: nodes whose monitor posted nothing in the window (it
        stopped, or never posted since the go) and whose leader's beat did not move either (or never beat):
        unreachable, so that the ranks on other nodes, hung behind it, are not named in its place. quiet: the
        monitor silent while the leader still beats: the tool's own monitor slow or stopped, never evidence
        against the node."""
        first, beats, end = self.live(hosts), self.beats(hosts), time.monotonic() + budget
        while True:
            cur = self.live(hosts)
            stale = {h for h in hosts if cur[h].get("seq", -1) <= first[h].get("seq", -1)
                     and not (cur[h].get("ranks") and all(s == "gone" for s in cur[h]["ranks"].values()))}
            if not stale or time.monotonic() >= end:
                break
            time.sleep(0.2)
        moved = {h for h, n in self.beats(sorted(stale)).items() if n > beats[h]}
        silent = {h for h in stale if h not in moved}
        live = {int(r): s for snap in cur.values() for r, s in (snap.get("ranks") or {}).items()}
        return live, silent, stale - silent

    # -- performance screen
    def screen_publish(self, name, plans):
        """Rank 0: each rank's part of a plan ({rank: dict}) under screen/<name>/<rank>, in one write."""
        ranks = sorted(plans)
        self._multi_set([f"screen/{name}/{r}" for r in ranks], [json.dumps(plans[r]) for r in ranks])

    def screen_plan(self, name, rank, seconds):
        return json.loads(self._wait_valid(f"screen/{name}/{rank}", seconds))

    def screen_post(self, rnd, rank, data, world):
        self._fan_post(f"screen/{rnd}", rank, data, world)

    def screen_wait(self, rnd, seconds):
        return self._fan_wait(f"screen/{rnd}", seconds)[0]

    def screen_posts(self, rnd):
        return self._fan_in(f"screen/{rnd}")

    # -- fan-in to rank 0: the telemetry and the results (posts/<name>), the screen's rounds (screen/<round>)
    def post(self, name, rank, data):
        self._fan_post(f"posts/{name}", rank, data, self.world)

    def posts(self, name):
        return self._fan_in(f"posts/{name}")

    def wait_posts(self, name, seconds):
        """{rank: its post} once the whole world posted `name`, or what came within `seconds`."""
        got = self._fan_wait(f"posts/{name}", seconds)[1]
        return self.posts(name) if got is None else got

    def _fan_post(self, key, rank, data, world):
        """This rank's part of the fan-in `key`: one sealed JSON line appended to it; the last rank of the world
        to post sets <key>/all (the counter <key>/n only wakes rank 0)."""
        self._append(key, json.dumps(dict(data, rank=rank), default=str))
        if self.store.add(f"{key}/n", 1) == world:
            self._set(f"{key}/all", "1")

    def _fan_in(self, key):
        """{rank: its post} of the fan-in `key`, so far: one read of the list (sealed posts only)."""
        return {int(e["rank"]): e for e in map(json.loads, self._lines(key))}

    def _fan_wait(self, key, seconds):
        """Whether every rank posted to the fan-in `key` within `seconds`, and its posts as last read (None: not
        read): <key>/all wakes the wait, the sealed posts of the whole world end it (a forged line or a counter
        bumped from outside only makes rank 0 read again, every FORGED_POLL_S)."""
        end = time.monotonic() + seconds
        while True:
            try:
                self._wait([f"{key}/all"], end - time.monotonic())
            except Exception as e:  # the bound passed: what came is what there is
                if not store_timed_out(e):
                    raise
                return False, None
            got = None if self.world is None else self._fan_in(key)
            if got is None or len(got) >= self.world:
                return True, got
            if time.monotonic() >= end:
                return False, got
            time.sleep(FORGED_POLL_S)

    # -- gates, errors, verdict
    def open_gate(self, name, value="go"):
        self._set(f"gate/{name}", value)

    def wait_gate(self, name, seconds):
        return self._wait_valid(f"gate/{name}", seconds)

    def report_error(self, rank, phase, line, code, term=False, internal=False, host=None):
        if self.seal.run is None and not self.adopt_run():  # no run to report into yet
            return
        entry = {"rank": rank, "phase": phase, "line": line, "code": code, "term": term, "internal": internal,
                 "host": host}
        self._append("errors", json.dumps(entry))
        self.store.add("nerr", 1)

    def wake_roll_call(self, why):
        """Wake rank 0's roll call before every rank checked in (a stray, a rank that failed its local phase)."""
        self._set("all_arrived", why)

    def errors(self):
        """{rank: {'line', 'term', 'internal', 'phase', 'host', 'code'}}: the first report of each rank (term: it was
        terminated by a signal; internal: it hit the tool's own error)."""
        out = {}
        for e in map(json.loads, self._lines("errors")):
            entry = out.setdefault(int(e["rank"]), {"line": e["line"], "term": False, "internal": False,
                                                    **{k: e.get(k) for k in ("phase", "host", "code")}})
            for k in ("term", "internal"):
                entry[k] = entry[k] or bool(e.get(k))
        return out

    def post_deciding(self):
        """Rank 0, as its verdict starts (before the files asked for, which come before the code): the other
        ranks that see it wait up to VERDICT_S for the code instead of RANK0_GRACE."""
        self._set("deciding", "1")

    def deciding(self):
        """Whether rank 0 posted that its verdict started (a value not of this run is refused: False)."""
        return bool(self.store.check(["deciding"])) and self._open("deciding", self.store.get("deciding")) == "1"

    def publish_verdict(self, code):
        """The verdict, then `ask` (the listeners wait on it: it wakes them, and they find the verdict)."""
        self._set("verdict", str(code))
        self._set("ask", "verdict")

    def ask(self):
        """Rank 0, a phase did not finish: every live rank's listener posts what it issued last (posts/issued)."""
        self._set("ask", "1")

    def wait_ask(self, seconds):
        """A listener: rank 0's question or its verdict, within `seconds`. -> 'ask' or 'verdict'."""
        return "verdict" if self._wait_valid("ask", seconds) == "verdict" else "ask"

    def verdict_holds(self, code):
        """Rank 0, while it waits for the acks: whether the verdict key still holds its sealed code
        (a value written over it from outside is refused by every listener)."""
        return self._open("verdict", self.store.get("verdict")) == str(code)

    def wait_verdict(self, seconds):
        return int(self._wait_valid("verdict", seconds))

    def ack(self, rank):
        self._set(f"ack/{rank}", "1")
        self.store.add("acks", 1)

    def acked(self, ranks):
        """Whether every one of `ranks` left its sealed acknowledgement."""
        keys = [f"ack/{r}" for r in ranks]
        if not keys or not self.store.check(keys):
            return not keys
        return all(self._open(k, v) == "1" for k, v in zip(keys, self.store.multi_get(keys), strict=True))

    def audit(self, ranks, hosts):
        """Rank 0, before it publishes the verdict: every value the run wrote, checked once more, so that a value
        written from outside is found even where nobody read it after (a stamp on a passing run, a screen post
        after its round was judged). Rank 0's own values must still be its own; each rank's identity, claim and
        stamp, each node's liveness and every appended list read so far must unseal; a verdict key before the
        verdict is foreign. -> the forgeries (forgeries())."""
        mine = dict(self.shared["mine"])
        keys = self._existing(sorted(mine))
        for k, v in zip(keys, self._values(keys), strict=True):
            if v.decode(errors="replace") != mine[k]:
                self._open(k, v)  # written over: refused unless it is one of this run's values
        others = [f"{kind}/{r}" for r in ranks for kind in ("id", "who", "stamp")] + [f"live/{h}" for h in hosts]
        others = self._existing([k for k in others if k not in mine])
        if "verdict" not in mine and self.store.check(["verdict"]):  # there before rank 0's: foreign
            others.append("verdict")
        for k, v in zip(others, self._values(others), strict=True):
            self._open(k, v)
        for key in sorted(self.shared["lists"] | {"errors", "strays"}):
            self._lines(key)
        return self.forgeries()

