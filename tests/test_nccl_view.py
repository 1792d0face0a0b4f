"""NCCL's own view beside ours, and the transport never silently unjudged.

The RAS reader against real sockets: a small server speaking NCCL's RAS client protocol (as NCCL's
src/ras/client_support.cc answers it), one that accepts and never answers, one that answers garbage, none
listening. The comparison of NCCL's view with ours is a pure function of plain data. The transport is read
from real files: the private log, the operator's NCCL_DEBUG_FILE (%h and %p expanded as NCCL does), and
judged or said not judged, with why."""
import json
import os
import socket
import subprocess
import sys
import threading
import time

import pytest

from conftest import aiv, rec

RAS_DOC = {
    "nccl_version": "2.28.9", "cuda_runtime_version": 13000, "cuda_driver_version": 13000,
    "timestamp": "2026-12-06 10:00:00", "communicators_count": 1,
    "communicators": [{
        "hash": "0x1f", "secondary_hash": "0x2:0x3", "size": 3, "ranks_count": 2, "missing_ranks_count": 1,
        "ranks": [{"rank": r, "host": "10.0.0.1", "pid": 100 + r, "cuda_dev": r, "nvml_dev": r,
                   "status": {"init_state": 0, "async_error": 0, "finalize_called": False, "destroy_flag": False,
                              "abort_flag": False},
                   "collective_counts": {"Broadcast": 1, "Reduce": 0, "AllGather": 0, "ReduceScatter": 0,
                                         "AllReduce": 3}} for r in (0, 1)],
        "missing_ranks": [{"rank": 2, "host": "10.0.0.2", "pid": 102, "cuda_dev": 0, "nvml_dev": 0,
                           "status": {"unresponsive": True, "considered_dead": False}}]}],
    "ras": {"collection_time_sec": 2.001, "timeouts_count": 1}}


class FakeRas:
    """A real listening socket on 127.0.0.1 answering one connection as `mode` says: 'nccl' (NCCL's RAS: the
    handshake, OK to TIMEOUT and SET FORMAT json, then the document and close), 'silent' (accepts, never
    answers), 'garbage' (an HTTP error line), 'old' (no JSON: NCCL before 2.28.7), 'notjson' (STATUS in text).
    `got`: the lines the client sent."""

    def __init__(self, mode, doc=None):
        self.mode, self.doc, self.got = mode, doc or RAS_DOC, []
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(4)
        self.port = self.sock.getsockname()[1]
        self.stop = threading.Event()
        threading.Thread(target=self.serve, daemon=True).start()

    def serve(self):
        with self.sock:
            conn, _ = self.sock.accept()
            with conn:
                if self.mode == "silent":
                    self.stop.wait(60)
                    return
                f = conn.makefile("rb")
                for raw in f:
                    line = raw.decode().strip()
                    self.got.append(line)
                    if self.mode == "garbage":
                        conn.sendall(b"HTTP/1.1 400 Bad Request\r\n\r\n")
                        return
                    if line.startswith("CLIENT PROTOCOL"):
                        conn.sendall(b"SERVER PROTOCOL 2\n")
                    elif line.startswith("TIMEOUT"):
                        conn.sendall(b"OK\n")
                    elif line.startswith("SET FORMAT"):
                        conn.sendall(b"ERROR: Invalid command\n" if self.mode == "old" else b"OK\n")
                    elif line == "STATUS":
                        body = b"NCCL version 2.28.9\n" if self.mode == "notjson" else json.dumps(self.doc).encode()
                        for i in range(0, len(body), 97):  # in pieces, as a socket may deliver it
                            conn.sendall(body[i:i + 97])
                        return


@pytest.fixture
def fake():
    servers = []

    def make(mode, doc=None):
        servers.append(FakeRas(mode, doc))
        return servers[-1]
    yield make
    for s in servers:
        s.stop.set()


def test_ras_reader_speaks_the_protocol_and_returns_the_document(fake):
    s = fake("nccl")
    got = aiv.ras_status("127.0.0.1", s.port, 5)
    assert got["ok"] and got["data"] == RAS_DOC, got
    assert s.got == ["CLIENT PROTOCOL 2", "TIMEOUT 4", "SET FORMAT json", "STATUS"]


def test_ras_reader_is_bounded_against_a_server_that_never_answers(fake):
    s = fake("silent")
    t = time.monotonic()
    got = aiv.ras_status("127.0.0.1", s.port, 1.5)
    assert not got["ok"] and "did not answer the handshake within 1.5s" in got["why"], got
    assert time.monotonic() - t < 30  # bounded: it returned (the bound itself is 1.5 s)


@pytest.mark.parametrize("mode,why", [("garbage", "not as NCCL's RAS (SERVER PROTOCOL)"),
                                      ("old", "does not answer in JSON (NCCL older than 2.28.7?)"),
                                      ("notjson", "answered STATUS with something that is not JSON")])
def test_ras_reader_says_why_an_answer_is_not_nccls_view(fake, mode, why):
    got = aiv.ras_status("127.0.0.1", fake(mode).port, 5)
    assert not got["ok"] and why in got["why"], got


def test_ras_reader_with_nothing_listening():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    got = aiv.ras_status("127.0.0.1", port, 2)
    assert not got["ok"] and got["why"].startswith(f"nothing listens on 127.0.0.1:{port} (RAS off"), got


@pytest.mark.parametrize("spec,want", [(None, ("localhost", 28028)), ("10.0.0.5:29000", ("10.0.0.5", 29000)),
                                       ("[::1]:28100", ("::1", 28100)), ("node7", ("node7", 28028)),
                                       (":28200", ("localhost", 28200))])
def test_ras_address(spec, want):
    assert aiv.ras_addr({"NCCL_RAS_ADDR": spec} if spec else {}) == want


# -- NCCL's view beside ours (pure)
HOSTS3 = {0: "n0", 1: "n1", 2: "n2"}


def test_nccl_view_agrees_where_both_name_the_same_rank():
    v = aiv.nccl_view({"ok": True, "data": RAS_DOC}, 3, HOSTS3, {2: "dead"}, [2])
    assert v["agree"] is True and v["ranks"]["2"] == {"ours": "dead", "nccl": "missing", "agree": True, "count": None}
    assert v["words"].startswith("NCCL's own view (RAS, NCCL 2.28.9) agrees: rank 2 (n2) missing"), v["words"]
    assert v["missing"] == [2]


def test_nccl_view_differs_and_says_on_which_ranks():
    """We saw rank 2 running and named rank 1 (never issued); NCCL lost rank 2 and counts rank 1 like rank 0."""
    v = aiv.nccl_view({"ok": True, "data": RAS_DOC}, 3, HOSTS3, {1: "behind"}, [1])
    assert v["agree"] is False and {r for r, x in v["ranks"].items() if not x["agree"]} == {"1", "2"}
    assert v["words"].startswith("NCCL's own view (RAS, NCCL 2.28.9) differs on 2 rank(s): rank 1 (n1): ours "
                                 "behind, NCCL's ok; rank 2 (n2): ours ok, NCCL's missing"), v["words"]


def test_nccl_view_counts_a_rank_behind_like_ours():
    doc = json.loads(json.dumps(RAS_DOC))
    comm = doc["communicators"][0]
    comm["missing_ranks"] = []
    comm["ranks"].append(dict(comm["ranks"][0], rank=2, collective_counts={"AllReduce": 2, "Broadcast": 1}))
    v = aiv.nccl_view({"ok": True, "data": doc}, 3, HOSTS3, {2: "behind"}, [2])
    assert v["agree"] and v["ranks"]["2"]["nccl"] == "behind" and v["ranks"]["2"]["count"] == 3, v
    v = aiv.nccl_view({"ok": True, "data": doc}, 4, {**HOSTS3, 3: "n3"}, {}, [])
    assert v["agree"] is None and "listed no communicator of the job's 4 rank(s)" in v["words"]
    v = aiv.nccl_view({"ok": False, "why": "nothing listens on localhost:28028 (RAS off ...)"}, 3, HOSTS3, {}, [])
    assert not v["read"] and v["words"] == ("NCCL's own view (RAS) not read: nothing listens on localhost:28028 "
                                            "(RAS off ...)")


MALFORMED = [
    ("a rank entry without an int rank", lambda c: c["ranks"].append({"host": "10.0.0.3", "status": {}})),
    ("a string rank", lambda c: c["ranks"].append(dict(c["ranks"][0], rank="1"))),
    ("a status that is not an object", lambda c: c["ranks"][0].update(status="OK")),
    ("counts that are not an object", lambda c: c["ranks"][1].update(collective_counts=[3, 1])),
    ("a missing rank that is a string", lambda c: c["missing_ranks"].append("rank 2")),
    ("a missing rank's status that is a list", lambda c: c["missing_ranks"][0].update(status=[1])),
    ("ranks that are not a list", lambda c: c.update(ranks={"0": {}})),
    ("missing_ranks that are null", lambda c: c.update(missing_ranks=None)),
]


@pytest.mark.parametrize("what,spoil", MALFORMED, ids=[m[0] for m in MALFORMED])
def test_nccl_view_reads_a_malformed_reply_without_raising(what, spoil):
    """A RAS reply of a shape NCCL does not write: never an exception (it was a KeyError/AttributeError on the
    watchdog's path: a named hang became `internal`, exit 4, nobody named); entries that cannot be read are
    skipped and said."""
    doc = json.loads(json.dumps(RAS_DOC))
    spoil(doc["communicators"][0])
    v = aiv.nccl_view({"ok": True, "data": doc}, 3, HOSTS3, {2: "dead"}, [2])
    assert v["read"] and set(v["ranks"]) <= {"0", "1", "2"}, v
    if v.get("skipped"):
        assert "not of NCCL's shape skipped" in v["words"], v["words"]


@pytest.mark.parametrize("ras", [None, "STATUS", {"ok": True, "data": "text"}, {"ok": True, "data": {
    "communicators": "none"}}, {"ok": True, "data": {"communicators": [{"size": 3, "ranks": "all"}]}},
    {"ok": True, "data": {"nccl_version": 228, "communicators": [None, 3]}}, {"ok": False, "why": None}])
def test_nccl_view_of_any_other_shape_says_it_was_not_read(ras):
    v = aiv.nccl_view(ras, 3, HOSTS3, {}, [])
    assert v["agree"] is None and v["words"].startswith("NCCL's own view (RAS"), v


class _Rank0:
    """What Coordinator.nccl_view_add reads of rank 0: the world and the hosts."""
    world, host_of = 2, {0: "n0", 1: "n1"}


@pytest.mark.parametrize("reply", [{"ok": True, "data": {"communicators": [{"size": 2, "ranks": [
    {"rank": 0, "status": "ok"}, {"status": {}}], "missing_ranks": [{"rank": "1"}]}]}},
    {"ok": True, "data": {"communicators": [{"size": 2, "ranks": [{"rank": 0, "collective_counts": {"x": 1}}]}]}},
    {"ok": True, "data": {"communicators": [{"size": 2, "ranks": [{"rank": 0, "collective_counts": 5}]}]}}])
def test_a_named_hang_keeps_its_culprit_and_code_whatever_nccl_says(reply, monkeypatch):
    """Rank 1 never issued all_reduce #2 (judge_unfinished names n1, exit 3); NCCL's view, malformed or not, is
    added beside it by rank 0's own code path (Coordinator.nccl_view_add): the culprit, the hosts, the blame and
    the exit code stay; the words say what NCCL's view was."""
    w = aiv.group_key(range(2))
    issued = {0: {"own": {w: ["all_reduce", 2, False]}, "fr": None, "inflight": w, "idle_s": None},
              1: {"own": {w: ["all_reduce", 1, True]}, "fr": None, "inflight": None, "idle_s": 30.0}}
    coll = aiv.PHASES.index("collective")
    f = aiv.judge_unfinished("collective", "all_reduce did not complete within 8s", 2, _Rank0.host_of,
                             {0: coll - 1, 1: coll - 1}, {0: "running", 1: "running"}, {}, None, (), issued)
    before = (f["hosts"], f["ranks"], f["blame"], f["code"], aiv.verdict_code([f]))
    assert before[:3] == (["n1"], [1], "never-issued"), f
    done = threading.Thread(target=lambda: None)
    done.start()
    aiv.Coordinator.nccl_view_add(_Rank0(), f, (done, {"ras": reply}), {0: "running", 1: "running"}, set(), issued)
    assert (f["hosts"], f["ranks"], f["blame"], f["code"], aiv.verdict_code([f])) == before, f
    assert "NCCL's own view (RAS" in f["reason"] and f["nccl_view"]["words"] in f["reason"]
    monkeypatch.setattr(aiv, "nccl_view", lambda *a: 1 / 0)  # a reader bug of our own: still the same verdict
    aiv.Coordinator.nccl_view_add(_Rank0(), f, (done, {"ras": reply}), {}, set(), issued)
    assert (f["hosts"], f["ranks"], f["blame"], f["code"]) == before[:4]
    assert f["nccl_view"]["read"] is False and "could not be read (ZeroDivisionError" in f["nccl_view"]["words"]


def test_the_page_shows_nccls_view_where_a_finding_carries_it():
    v = aiv.nccl_view({"ok": True, "data": RAS_DOC}, 3, HOSTS3, {1: "behind"}, [1])
    f = dict(aiv.finding("collective", "FAIL", "x", ["n1"], [1], code=aiv.EXIT_TIMEOUT), nccl_view=v)
    page = aiv.render_html({"findings": [f], "ranks": [{"rank": r, "host": h} for r, h in HOSTS3.items()]})
    assert '<section id="nccl-view">' in page and "differs" in page and "NCCL&#x27;s own view" in page
    assert '<section id="nccl-view">' not in aiv.render_html({"findings": [dict(f, nccl_view=None)]})


# -- the transport: judged from the file NCCL's lines went to, or said not judged, and why
INFO = ("gpu1:123:456 [0] NCCL INFO NET/Socket : Using [0]eth0:10.0.0.1<0>\n"
        "gpu1:123:456 [0] NCCL INFO Channel 00/0 : 0[0] -> 8[0] [send] via NET/Socket/0\n")


def ib_node():
    return {"ib": [{"port": "mlx5_0:1", "state": "ACTIVE", "rate_gbps": 400.0}], "memlock": "unlimited"}


def nccl_rec(rank, host, facts):
    r = rec(rank, host, gpu={"uuid": f"GPU-{rank}", "index": 0}, node=ib_node())
    return aiv.with_results([r], [dict(facts, rank=rank)])[0]


@pytest.fixture
def env_kept(monkeypatch):
    """NcclLog.capture sets NCCL_DEBUG_FILE and NCCL_DEBUG in os.environ: restored after the test."""
    for v in ("NCCL_DEBUG_FILE", "NCCL_DEBUG", "NCCL_DEBUG_SUBSYS"):
        monkeypatch.setenv(v, "x")  # tracked: whatever the code sets is undone after the test
        monkeypatch.delenv(v)
    return monkeypatch


def test_the_operators_nccl_debug_file_is_read_with_h_and_p_expanded(tmp_path, env_kept):
    """NCCL_DEBUG_FILE=.../nccl.%h.%p with NCCL_DEBUG=INFO: the rank reads its own expanded file, and an
    IB-to-socket fallback there FAILs (it PASSed silently with no row)."""
    env = {"NCCL_DEBUG_FILE": str(tmp_path / "nccl.%h.%p"), "NCCL_DEBUG": "INFO"}
    log = aiv.NcclLog.capture("nccl", 0, env)
    assert log.source == "operator" and "NCCL_DEBUG_FILE" not in os.environ  # the operator's setting kept as is
    path = tmp_path / f"nccl.{socket.gethostname().split('.')[0]}.{os.getpid()}"
    assert log.readable() == str(path)
    path.write_text(INFO)
    facts = log.facts()
    assert facts["transport"] == ["NET/Socket"] and facts["nccl_log"]["read"] and bool(log)
    (f,) = aiv.judge_transport([nccl_rec(0, "gpu1", facts)])
    assert f["status"] == "FAIL" and f["hosts"] == ["gpu1"] and "NCCL used NET/Socket although" in f["reason"]


@pytest.mark.parametrize("env,words", [
    ({"NCCL_DEBUG": "INFO"}, "NCCL_DEBUG=INFO (the job's own setting) sends NCCL's lines to the job's stdout, "
                             "which the tool cannot read"),
    ({"NCCL_DEBUG_FILE": "nccl.%h.%p", "NCCL_DEBUG": "WARN"}, "holds no INFO line of NCCL (NCCL writes them there only "
                                                               "with NCCL_DEBUG=INFO)"),
    ({"NCCL_DEBUG_FILE": "nccl.%h.%p", "NCCL_DEBUG": "INFO", "NCCL_DEBUG_SUBSYS": "^INIT,NET"},
     "no line of NCCL's channels (NCCL_DEBUG_SUBSYS=^INIT,NET leaves out INIT and NET)")])
def test_a_transport_that_could_not_be_read_is_a_warn_saying_why(tmp_path, env_kept, env, words):
    env = {k: str(tmp_path / v) if k == "NCCL_DEBUG_FILE" else v for k, v in env.items()}
    log = aiv.NcclLog.capture("nccl", 0, env)
    if log.readable():  # the operator's file exists, with what NCCL_DEBUG and NCCL_DEBUG_SUBSYS let in
        open(log.readable(), "w").write(INFO if env.get("NCCL_DEBUG") == "INFO" else
                                        "gpu1:1:2 [0] NCCL WARN something\n")
    facts = log.facts()
    assert facts["transport"] is None and facts["nccl_log"]["read"] is False, facts
    ok = nccl_rec(1, "gpu2", {"transport": ["NET/IB"], "nccl_net": [], "nccl_log": {"source": "private", "read": True}})
    found = aiv.judge_transport([nccl_rec(0, "gpu1", facts), ok])
    assert [f["status"] for f in found] == ["PASS", "WARN"], found
    assert found[0]["hosts"] == ["gpu2"] and found[0]["reason"] == "NCCL transports: NET/IB on gpu2"
    assert found[1]["reason"].startswith("NCCL's transport was not judged on gpu1: ") and words in found[1]["reason"]
    assert found[1]["reason"].endswith("an InfiniBand-to-socket fallback there would pass unseen")
    assert aiv.apply_strict(found, True)[1]["status"] == "FAIL"


def test_the_private_log_is_read_and_gloo_has_no_transport_row(tmp_path, env_kept):
    log = aiv.NcclLog.capture("nccl", 3, {})
    try:
        assert log.source == "private" and os.environ["NCCL_DEBUG_FILE"] == log.path
        open(log.path, "w").write(INFO.replace("NET/Socket/0", "NET/IB/0/GDRDMA"))
        facts = log.facts()
        assert facts["transport"] == ["NET/IB"] and facts["nccl_log"] == {"source": "private", "path": log.path,
                                                                           "read": True}
    finally:
        log.drop()
    assert aiv.NcclLog.capture("gloo", 0, {}).facts() == {"transport": None, "nccl_net": None, "nccl_log": None}
    assert aiv.judge_transport([aiv.with_results([rec(0, "n1")], [{"rank": 0}])[0]]) == []  # gloo: nothing to judge


def test_no_temporary_directory_for_nccls_log_is_no_crash_before_the_verdict(env_kept, monkeypatch):
    """A rank makes NCCL's private log as it starts, before any verdict can be given: no temporary directory
    there (mkstemp fails) leaves it without the file and without NCCL's variables, and keeps the error for
    phase_local to raise where the backend is NCCL (an internal verdict naming nobody), instead of a crash that
    rank 0 would read as a node whose rank never checked in."""
    import types

    def no_tmp(*a, **k):
        raise FileNotFoundError(2, "No usable temporary directory found")
    monkeypatch.setattr(aiv.tempfile, "mkstemp", no_tmp)
    for v in ("TORCH_CPP_LOG_LEVEL", "TORCH_NCCL_ASYNC_ERROR_HANDLING", "TORCH_FR_BUFFER_SIZE",
              "TORCH_NCCL_TRACE_BUFFER_SIZE"):
        monkeypatch.setenv(v, "x")  # tracked: what the rank sets is undone after the test
        monkeypatch.delenv(v)
    rank = types.SimpleNamespace(env={}, args=types.SimpleNamespace(backend="auto"), rank=1)
    aiv.RankSetup.own_environment(rank)
    assert rank.nccl.path is None and isinstance(rank.nccl_unmade, FileNotFoundError)
    assert "NCCL_DEBUG_FILE" not in os.environ and "NCCL_DEBUG" not in os.environ
    assert os.environ["TORCH_FR_BUFFER_SIZE"] == "2000"  # torch's variables set all the same


def test_nccl_diag_lines_are_picked_from_a_log():
    text = "gpu1:12 NCCL DIAG GPU pair 0-1: NVLink bandwidth 12 GB/s below 300\n" + INFO
    assert aiv.nccl_diag_lines(text) == ["gpu1:12 NCCL DIAG GPU pair 0-1: NVLink bandwidth 12 GB/s below 300"]
    assert aiv.nccl_subsys_hides_channels("COLL,P2P") and not aiv.nccl_subsys_hides_channels("INIT")
    assert not aiv.nccl_subsys_hides_channels(None) and not aiv.nccl_subsys_hides_channels("^INIT")


# -- torch's flight recorder, read the way a rank answers rank 0
def test_the_flight_recorder_holds_what_a_gloo_rank_issued():
    """A real 1-rank gloo group in a child process: the recorder's last collective on the world group, by the
    group's name (the recorder is on in torch 2.13 by default; the rank sets TORCH_FR_BUFFER_SIZE anyway). torch
    retires a gloo collective's entry on its worker thread, which may run after the call returned (a busy machine:
    'scheduled' for a moment): the record reads it completed within 30 s."""
    code = ("import os, sys, json, time; os.environ['TORCH_FR_BUFFER_SIZE'] = '200'\n"
            "sys.path.insert(0, sys.argv[1]); import ddp_mesh_ping as aiv\n"
            "import torch, torch.distributed as dist\n"
            "dist.init_process_group('gloo', rank=0, world_size=1, store=dist.HashStore())\n"
            "x = torch.ones(2)\n"
            "[dist.all_reduce(x) for _ in range(3)]\n"
            "i = aiv.Issued(); i.names[dist.group.WORLD.group_name] = '0'\n"
            "with_start = (i.start('all_reduce', '0'), i.record(torch))[1]\n"
            "i.done('0'); end = time.monotonic() + 30; after = i.record(torch)\n"
            "while not (after['fr'] or {}).get('0', [0, 0, False])[2] and time.monotonic() < end:\n"
            "    time.sleep(0.05); after = i.record(torch)\n"
            "print(json.dumps([with_start, after, aiv.recorder_last(torch, {})]))\n"
            "dist.destroy_process_group()\n")  # gloo's threads torn down before exit, not by it (an abort, at times)
    r = subprocess.run([sys.executable, "-c", code, str(aiv.__file__.rsplit("/", 1)[0])], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    during, after, unknown = json.loads(r.stdout.splitlines()[-1])
    assert during["inflight"] == "0" and during["idle_s"] is None and during["own"] == {"0": ["all_reduce", 1, False]}
    assert after["fr"]["0"][:2] == ["all_reduce", 3] and after["inflight"] is None and after["idle_s"] >= 0
    assert after["fr"]["0"][2:] == [True, "completed"]
    assert unknown == {}  # a group the rank does not know is no entry (the recorder was read: not None)
