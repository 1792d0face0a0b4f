"""The manual against the code: README's length and index, every relative link and anchor, the check names,
the variables the pages name, the usage lines they quote, the worst-case bounds, and what tests/run.sh does
with a file. (The options, metrics and GPU tables are checked beside their code: test_options_doc.py,
test_metrics.py, test_screen.py.)"""
import json
import re
import subprocess
import sys
from types import SimpleNamespace

import pytest

import conftest
from conftest import ROOT, aiv, clean_env, run_tool

README = ROOT / "README.md"
DOCS = ROOT / "docs"
PAGES = [README, *sorted(DOCS.glob("*.md")), ROOT / "bench" / "RESULTS.md"]
VAR = re.compile(r"\bAIV_[A-Z0-9_]*[A-Z0-9]\b")


def prose(text):
    """The text without fenced code blocks (their lines blanked, so line numbers stay)."""
    out, fenced = [], False
    for ln in text.splitlines():
        if ln.lstrip().startswith("```"):
            fenced = not fenced
            out.append("")
        else:
            out.append("" if fenced else ln)
    return "\n".join(out)


def slug(heading):
    """GitHub's anchor for a heading: lower case, punctuation dropped (not - or _), spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(path):
    seen, out = {}, set()
    for ln in prose(path.read_text()).splitlines():
        m = re.match(r"#{1,6} (.+)", ln)
        if m:
            s = slug(m.group(1))
            n = seen.get(s, 0)
            seen[s] = n + 1
            out.add(s if n == 0 else f"{s}-{n}")
    return out


def links(path):
    """(target) of every Markdown link outside code, e.g. 'slurm.md#7-gate-the-training-job'."""
    text = re.sub(r"`[^`]*`", "", prose(path.read_text()))
    return re.findall(r"\[[^\]]*\]\(([^)\s]+)\)", text)


def flat(path):
    return " ".join(path.read_text().split())


def section(path, title):
    """The lines of a '## title' section, up to the next heading of level 1 or 2."""
    text = path.read_text().split(f"\n## {title}\n", 1)[1]
    return re.split(r"\n#{1,2} ", text, maxsplit=1)[0].splitlines()


# ---------------------------------------------------------------------------- README and the index
def test_readme_is_at_most_300_lines():
    assert len(README.read_text().splitlines()) <= 300


def test_readme_indexes_every_page_and_every_page_exists():
    indexed = [t for t in links(README) if t.startswith("docs/") and t.endswith(".md")]
    table = [ln for ln in section(README, "Documentation") if ln.startswith("| [")]
    listed = [re.search(r"\]\((docs/[^)#]+\.md)\)", ln).group(1) for ln in table if "](docs/" in ln]
    assert len(set(listed)) >= 5
    for page in set(indexed) | set(listed):
        assert (ROOT / page).is_file(), page
    assert sorted(set(listed)) == sorted(f"docs/{p.name}" for p in DOCS.glob("*.md")), "a page the index lacks"


def test_the_two_commands_and_the_stable_strings_are_in_the_readme():
    text = README.read_text()
    assert "PYTORCH_ENV=$HOME/aiv-env ./bootstrap_env.sh && $HOME/aiv-env/bin/python ddp_mesh_ping.py\n" in text
    assert "\ntests/run.sh\n" in text
    assert aiv.SUCCESS_LINE == "SUCCESS: DDP Multi-Node AllReduce Ring Complete!" and aiv.SUCCESS_LINE in text
    assert "Total Execution Ranks: N" in text


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_and_anchor_resolves(page):
    bad = []
    for target in links(page):
        if re.match(r"[a-z]+:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            bad.append(f"{target}: no such file")
        elif anchor and (dest.suffix != ".md" or anchor not in anchors(dest)):
            bad.append(f"{target}: no such anchor in {dest.name}")
    assert not bad, bad


# ---------------------------------------------------------------------------- checks
def test_the_checks_table_names_every_check_once():
    rows = [ln for ln in section(DOCS / "checks.md", "The checks") if ln.startswith("| `")]
    names = [n for ln in rows for n in re.findall(r"`([a-z0-9-]+)`", ln.split(" | ")[0])]
    assert sorted(names) == sorted(aiv.CHECKS)


# ---------------------------------------------------------------------------- kinds of claims that drifted
NUMBER_WORDS = ("no", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven", "twelve")


def table_rows(path, title, first_col):
    """The cells of each row of the table in '## title' whose first cell matches first_col (a regex)."""
    lines = section(path, title)
    rows = [ln for i, ln in enumerate(lines) if re.match(rf"\| {first_col} \|", ln)
            and not (i + 1 < len(lines) and lines[i + 1].startswith("|---"))]  # the header row is no claim
    return [[c.strip() for c in ln.strip()[1:-1].split("|")] for ln in rows]


def test_phase_names_and_counts_are_the_codes():
    """The phases table lists PHASES in order (after the contract, which is no phase of the run), each bounded
    by what deadlines() gives it; every count of the screen's phases anywhere in the pages is
    len(SCREEN_PHASES) (they said four; there are two)."""
    rows = table_rows(DOCS / "checks.md", "Phases", r"[a-z0-9-]+")
    assert [r[0] for r in rows] == ["contract", *aiv.PHASES]
    t, r, soak = 111.0, 222.0, 33.0
    table = aiv.deadlines(t, r, soak)
    words = {r: "`--rollcall-timeout`", t: "`--timeout`", soak + t: "SECONDS + `--timeout`"}
    for phase, *_, bound in rows[1:]:
        assert bound == words[table[phase]], (phase, bound)
    counted = []
    for page in PAGES:
        for sentence in re.split(r"(?<=[.;:])\s", " ".join(prose(page.read_text()).split())):
            for m in re.finditer(r"\b(\w+) (?:screen )?phases\b", sentence):
                n = m.group(1).lower()
                if ("screen" in sentence or page.name == "screen.md") and n in NUMBER_WORDS:
                    counted.append((page.name, m.group(0)))
                    assert NUMBER_WORDS.index(n) == len(aiv.SCREEN_PHASES), (page.name, sentence)
    assert len(counted) >= 3, counted


def test_which_checks_fail_or_warn_is_the_codes():
    """checks.md's FAIL and WARN columns are filled exactly where CHECK_LEVELS (which finding() enforces) says
    the check can FAIL or WARN (they listed `output` under WARN, though it FAILs); every finding the source
    makes with a literal check and level is one CHECK_LEVELS allows."""
    import ast
    rows = table_rows(DOCS / "checks.md", "The checks", r"`[a-z0-9-]+`")
    said = {re.match(r"`([a-z0-9-]+)`", r[0]).group(1): {lv for lv, cell in zip(("FAIL", "WARN"), r[1:3],
                                                                                   strict=True) if cell}
            for r in rows}
    assert said == {c: set(levels) for c, levels in aiv.CHECK_LEVELS.items()}
    made = set()
    for path in (ROOT / "aiv").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and getattr(node.func, "id", None) == "finding" and len(node.args) >= 2
                    and all(isinstance(a, ast.Constant) for a in node.args[:2])):
                made.add((node.args[0].value, node.args[1].value, path.name))
    assert len(made) > 40
    bad = [m for m in made if m[1] != "PASS" and m[1] not in aiv.CHECK_LEVELS[m[0]]]
    assert not bad, bad
    with pytest.raises(ValueError, match="CHECK_LEVELS"):
        aiv.finding("numa", "FAIL", "a NUMA mismatch is a WARN")


def test_what_each_bound_bounds_is_the_codes():
    """design.md's deadlines table gives every entry of deadlines() once, bound by what the code bounds it
    with (--timeout said to bound the verdict; VERDICT_S does); the options table says which phases
    --timeout and --rollcall-timeout bound, by name."""
    t, r, soak = 111.0, 222.0, 33.0
    table = aiv.deadlines(t, r, soak)
    expr = {"`--rollcall-timeout` R": r, "`--timeout` T": t, "`--soak` S + `--timeout` T": soak + t,
            "`MANIFEST_LOCK_S`": aiv.MANIFEST_LOCK_S, "`VERDICT_S`": aiv.VERDICT_S}
    seen = []
    for cells in table_rows(DOCS / "design.md", "Deadlines", r"[a-z][^|]*"):
        names = re.findall(r"[a-z][a-z0-9-]*", cells[0].split("(")[0])
        bound = next((k for k in sorted(expr, key=len, reverse=True) if cells[1].startswith(k)), None)
        assert bound, cells
        for name in names:
            assert table[name] == expr[bound], (name, cells[1])
        seen += names
    assert sorted(seen) == sorted(table)
    rows = {re.match(r"\| `(--[a-z-]+)", ln).group(1): ln for ln in (DOCS / "options.md").read_text().splitlines()
            if ln.startswith("| `--")}
    for flag, value in (("--timeout", t), ("--rollcall-timeout", r)):
        named = re.findall(r"`([a-z][a-z0-9-]*)`", rows[flag].split(" | ")[3].split(";")[0])
        assert named == [p for p in aiv.PHASES if table[p] == value], (flag, named)
    assert "`VERDICT_S`" in rows["--timeout"] and "`soak`" in rows["--timeout"]


def paragraphs(path):
    """(first line number, last line number, text) of each paragraph of prose (no code, tables or headings)."""
    out, cur, start = [], [], 0
    for i, ln in enumerate(prose(path.read_text()).splitlines() + [""], 1):
        if not ln.strip() or ln.startswith(("#", "|")):
            if cur:
                out.append((start, i - 1, " ".join(cur)))
            cur = []
            continue
        if not cur:
            start = i
        cur.append(ln.strip())
    return out


def test_every_source_path_the_pages_name_exists():
    """A page that names a module of the source (`aiv/core/blame.py`, `aiv/out/`) names one that is there:
    a module moved to another room takes its mentions with it."""
    named = {(page.name, m.group(0).rstrip("/.")) for page in PAGES
             for m in re.finditer(r"(?<![\w/.~-])aiv/(?:[a-z_]+/)*(?:[a-z_]+\.py)?", page.read_text())}
    assert len(named) > 20
    missing = sorted((page, path) for page, path in named if not (ROOT / path).exists())
    assert not missing, missing


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_garbled_or_unterminated_sentence(page):
    """A lint for what drifted: a phrase said twice back to back ('2.8 or newer**: 2.8 or newer**'), a
    paragraph that stops mid-sentence (on a comma or 'and'), two paragraphs in a row that open alike ('All
    three files (four with the page) ...' / 'All three files ...')."""
    bad, last, end = [], None, -9
    for n, n_end, text in paragraphs(page):
        words = re.findall(r"[\w.'-]+", re.sub(r"`[^`]*`", " ", text).lower())  # code spans may repeat
        for k in (3, 4, 5, 6):
            for i in range(len(words) - 2 * k + 1):
                if words[i:i + k] == words[i + k:i + 2 * k]:
                    bad.append(f"line {n}: said twice: {' '.join(words[i:i + k])}")
        if re.search(r"(,|;|\band|\bthe|\bof)$", text.rstrip("*_ ")):
            bad.append(f"line {n}: ends mid-sentence: ...{text[-60:]}")
        head = " ".join(words[:3])
        if last == head and len(words) >= 3 and n == end + 2:  # the one right before, with one blank line between
            bad.append(f"line {n}: opens like the paragraph before: {head}")
        last, end = head, n_end
    assert not bad, bad


# ---------------------------------------------------------------------------- variables
def _file_texts():
    files = [ROOT / "submit_smoke_test.sbatch", ROOT / "bootstrap_env.sh", ROOT / ".ci" / "run",
             *(ROOT / "tests").glob("*.sh"), *(ROOT / "tests").glob("*/*.sh"), *(ROOT / "tests").glob("*.py"),
             *(ROOT / "bench").glob("*.py"), *(ROOT / "bench").glob("*.sh")]
    texts = {f: f.read_text(errors="replace") for f in files if f.name != "test_docs.py"}
    tool = (ROOT / "ddp_mesh_ping.py").read_text()
    start = tool.index("\nOWNED_VARS = {")  # the list of names is no reader of them
    texts[ROOT / "ddp_mesh_ping.py"] = tool[:start] + tool[tool.index("\n}\n", start) + 3:]
    return texts


def read_somewhere(name, texts):
    """Whether any file reads the variable: $NAME / ${NAME in shell; get("NAME"), ["NAME"] (not assigned),
    "NAME" in ..., or a constant holding the name, in Python."""
    q = f"[\"']{name}[\"']"
    shell = re.compile(rf"\$\{{?{name}\b")
    py = re.compile(rf"(?:get(?:env)?|pop)\(\s*{q}|\[\s*{q}\s*\](?!\s*=[^=])|{q}\s+(?:not\s+)?in\b"
                    rf"|^\s*[A-Z_][A-Z0-9_]*(?:\s*,\s*[A-Z_][A-Z0-9_]*)*\s*=\s*{q}", re.M)
    return any((py if f.suffix == ".py" or f.name == "ddp_mesh_ping.py" else shell).search(t)
               for f, t in texts.items())


def option_vars():
    return {a.env for a in aiv.build_parser()._actions if getattr(a, "env", None)}


def test_every_variable_the_pages_name_is_one_the_code_reads():
    texts = _file_texts()
    known = option_vars() | set(aiv.REMOVED_VARS)
    quotes = re.compile(r"`FAILURE: [^`]*`")  # a quoted usage line may name a misspelled variable
    named = {v: p.relative_to(ROOT) for p in PAGES for v in VAR.findall(quotes.sub("", p.read_text()))}
    stale = {v: str(p) for v, p in named.items() if v not in known and not read_somewhere(v, texts)}
    assert not stale, f"documented but read by nothing: {stale}"


def test_every_variable_read_beyond_the_options_is_in_the_table_of_other_variables():
    texts = _file_texts()
    owned = {v for names in aiv.OWNED_VARS.values() for v in names}
    read = {v for v in owned if read_somewhere(v, texts)}
    rows = [ln for ln in section(DOCS / "options.md", "Other variables") if ln.startswith("| `")]
    table = {re.match(r"\| `([A-Z0-9_]+)`", ln).group(1) for ln in rows}
    assert table == read


# ---------------------------------------------------------------------------- quoted usage lines
PLAN_CASES = [
    (["--timeout", "-1"], {}),
    ([], {"AIV_" + "TIMOUT": "5"}),  # misspelled on purpose (spelled in two parts: no variable of the repo)
    ([], {"AIV_TIMEOUT": "abc"}),
    ([], {"RANK": "0", "WORLD_SIZE": "two", "LOCAL_RANK": "0"}),
    ([], {"PET_NNODES": "2", "PET_NPROC_PER_NODE": "2", "PET_NODE_RANK": "0", "PET_MASTER_ADDR": "127.0.0.1",
          "PET_MASTER_PORT": "29500", "WORLD_SIZE": "3"}),  # docs/kubernetes.md
    ([], {"MASTER_ADDR": "node1"}),
]


def bad_band_manifest(tmp_path):
    """m.json in tmp_path: a manifest whose speed band lacks 'lo' (the example in docs/manifest.md)."""
    from test_manifest import H200, valid_manifest
    m, _, _ = valid_manifest()
    cls = m["classes"].pop(H200)
    m["classes"]["NVIDIA H200 x8, IB 8x400G"] = cls
    del cls["bands"]["gpu.tflops/NVIDIA H200"]["lo"]
    (tmp_path / "m.json").write_text(json.dumps(m))


def quoted_usage_lines():
    """Every complete `FAILURE: usage: ...` / `FAILURE: contract: ...` the pages quote (no <placeholder>, no ...)."""
    out = {}
    for p in PAGES:
        for q in re.findall(r"`(FAILURE: (?:usage|contract): [^`]+)`", flat(p)):
            if "<" not in q and "..." not in q:
                out[q] = p.relative_to(ROOT)
    return out


def test_the_timeout_line_in_when_it_fails_is_what_the_tool_prints():
    r = run_tool(["--timeout", "-1"], timeout=60)
    (line,) = [ln for ln in r.stdout.splitlines() if ln.startswith("FAILURE:")]
    assert r.returncode == 2
    rows = [ln for ln in section(DOCS / "checks.md", "When it fails") if "--timeout" in ln]
    assert rows and all(f"`{line}`" in ln for ln in rows), (line, rows)


def test_every_quoted_usage_line_is_what_the_tool_prints(tmp_path):
    printed = set()
    for argv, env in PLAN_CASES:
        with pytest.raises(aiv.UsageError) as e:
            aiv.plan(argv, env)
        printed.add(str(e.value))
    bad_band_manifest(tmp_path)
    r = run_tool(["--manifest", "m.json"], cwd=tmp_path, timeout=60)
    assert r.returncode == 2, r.stdout + r.stderr
    printed |= {ln for ln in r.stdout.splitlines() if ln.startswith("FAILURE:")}
    quoted = quoted_usage_lines()
    assert len(quoted) >= 4
    stale = {q: str(p) for q, p in quoted.items() if q not in printed}
    assert not stale, f"quoted in the docs, not printed by the tool: {stale}"


# ---------------------------------------------------------------------------- bounds
def _coefficients(**kw):
    """worst_case as kR * R + kT * T + c seconds (it is linear in the two bounds)."""
    def w(t, r):
        return aiv.worst_case(aiv.deadlines(t, r), **kw)
    t, r = aiv.TIMEOUT_DEFAULT, aiv.ROLLCALL_DEFAULT
    kt, kr = (w(2 * t, r) - w(t, r)) / t, (w(t, 2 * r) - w(t, r)) / r
    return f"{kr:g}R + {kt:g}T + {w(t, r) - kr * r - kt * t:g} s"


def test_the_worst_cases_the_pages_state_are_the_codes():
    assert f"Worst case, from start to verdict: {_coefficients()}" in flat(DOCS / "design.md")
    assert f"default bounds and `--bandwidth`: {_coefficients(bandwidth=True)}," in flat(DOCS / "slurm.md")


# ---------------------------------------------------------------------------- tests/run.sh FILE
def test_every_bench_script_is_named_under_benchmarks():
    """A script added to bench/ without a word in docs/development.md's Benchmarks is one nobody reruns."""
    text = "\n".join(section(DOCS / "development.md", "Benchmarks"))
    scripts = sorted(p.name for p in (ROOT / "bench").iterdir() if p.suffix in (".py", ".sh"))
    assert scripts and [s for s in scripts if f"`bench/{s}`" not in text] == []


def test_run_sh_with_a_file_runs_that_file_only():
    """The pages say `tests/run.sh FILE` runs one file: collected, its tests and no other file's."""
    need = "import torch, numpy, psutil, pytest, hypothesis, prometheus_client, selenium, kubernetes_validate, yaml"
    if subprocess.run([sys.executable, "-c", need], capture_output=True).returncode:
        pytest.skip("this venv lacks what tests/run.sh needs (it would build its own)")
    assert "`tests/run.sh FILE` runs" in flat(README) + flat(DOCS / "development.md")
    r = subprocess.run([str(ROOT / "tests" / "run.sh"), "tests/test_options_doc.py", "--collect-only", "-qq",
                        "-p", "no:cacheprovider"], cwd=ROOT, capture_output=True, text=True, timeout=300,
                       env=clean_env({"AIV_TEST_ENV": sys.prefix}))
    ids = [ln for ln in r.stdout.splitlines() if "::" in ln]
    assert r.returncode == 0 and ids, r.stdout[-2000:] + r.stderr[-2000:]
    assert all(i.startswith("tests/test_options_doc.py::") for i in ids), [i for i in ids if "options_doc" not in i][:5]


def test_the_suite_is_dealt_to_the_workers_in_shares_of_equal_cost():
    """What tests/run.sh and docs/development.md say of the order: every file _COST names exists (a renamed
    file would silently count as quick); the order is a permutation cut by worksteal into shares whose
    costs differ by less than one test's; the tests of each file with a cluster of its own (_TOGETHER), cut into
    that many runs of their file's order, lead a share each, one after another; every share ends with its quick
    tests."""
    assert sorted(set(conftest._COST) - {p.name for p in (ROOT / "tests").glob("test_*.py")}) == []
    files = {name: int(cost * 3) + 2 for name, cost in conftest._COST.items()}
    files.update({name: 10 * cut for name, cut in conftest._TOGETHER.items()})  # as the files are: about 10 a run
    files["test_quick.py"] = 40
    items = [SimpleNamespace(path=ROOT / "tests" / name, nodeid=f"tests/{name}::t{i}")
             for name, n in files.items() for i in range(n)]
    for workers in (1, 3, 4, 5):
        order = conftest.dealt(items, workers)
        assert sorted(map(id, order)) == sorted(map(id, items))
        shares, left = [], list(order)
        for w in range(workers):  # worksteal's cut
            n = len(left) // (workers - w)
            shares.append(left[:n])
            left = left[n:]
        costs = [sum(conftest._COST.get(i.path.name, 0.1) for i in share) for share in shares]
        assert max(costs) - min(costs) < max(conftest._COST.values()), costs
        for name, cut in conftest._TOGETHER.items():  # each cluster's file: runs of its order, at a share's head
            mine, runs = [i for i in items if i.path.name == name], min(cut, workers)
            heads = [[i for i in share if i.path.name == name] for share in shares]
            assert [h for h in heads if h] == [[i for k, i in enumerate(mine) if k * runs // len(mine) == w]
                                               for w in range(runs)], name
            for share, h in zip(shares, heads, strict=True):
                at = [k for k, i in enumerate(share) if i.path.name == name]
                assert at == list(range(at[0], at[0] + len(h))) if h else True, name  # one after another
                assert all(i.path.name in conftest._TOGETHER for i in share[:at[-1] + 1]) if h else True, name
        for share in shares:
            quick = [conftest._COST.get(i.path.name, 0.1) < 1.0 for i in share]
            assert quick == sorted(quick), "a quick test before a test of real processes"
            runs = [i.path.name for k, i in enumerate(share) if not k or share[k - 1].path.name != i.path.name]
            assert len(runs) == len(set(runs)), runs  # a file's tests one after another: its fixtures made once
