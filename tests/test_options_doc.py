"""The options table (docs/options.md) and --help describe the same options: flags, variables and defaults."""
import re

from conftest import ROOT, aiv


def readme_options():
    """flag -> (variable or None, default) from the options table of docs/options.md (before its first section)."""
    section = (ROOT / "docs" / "options.md").read_text().split("\n## ", 1)[0]
    rows = {}
    for ln in section.splitlines():
        if ln.startswith("| `--"):
            option, variable, default = (c.strip() for c in ln.strip("| \n").split(" | ")[:3])
            flag = re.match(r"`(--[a-z-]+)", option).group(1)
            names = re.findall(r"AIV_[A-Z_]+", variable)
            assert len(names) <= 1 and (names or variable.startswith("none")), ln
            rows[flag] = (names[0] if names else None, default)
    return rows


def parser_options():
    """flag -> (variable or None, default) as build_parser() declares them."""
    return {a.option_strings[0]: (a.env, a.shown) for a in aiv.build_parser()._actions if hasattr(a, "conv")}


def test_readme_table_and_parser_agree():
    readme, parser = readme_options(), parser_options()
    assert sorted(f for f in readme if f not in ("--help", "--version")) == sorted(parser)
    for flag in parser:
        assert readme[flag] == parser[flag], flag


def test_every_flag_of_the_parser_is_in_the_table():
    """--help and --version too (flags only: no variable, no default)."""
    readme = readme_options()
    flags = {o for a in aiv.build_parser()._actions for o in a.option_strings if o.startswith("--")}
    assert sorted(readme) == sorted(flags)
    assert readme["--version"] == readme["--help"] == (None, "none")


def test_shown_defaults_are_the_real_defaults():
    for a in aiv.build_parser()._actions:
        if hasattr(a, "conv") and isinstance(a.default, float):
            assert a.shown == f"{a.default:g}", a.option_strings
    assert parser_options()["--timeout"][1] == f"{aiv.TIMEOUT_DEFAULT:g}"
    assert parser_options()["--rollcall-timeout"][1] == f"{aiv.ROLLCALL_DEFAULT:g}"
    assert aiv.parse_args([], {}).bandwidth is None and aiv.parse_args([], {}).strict is False


def test_help_names_every_variable_and_default():
    text = " ".join(aiv.build_parser().format_help().split())
    for flag, (var, shown) in parser_options().items():
        assert flag in text and f"variable: {var or 'none'})" in text, flag
        assert f"(default: {' '.join(shown.split())};" in text, flag
    assert "AIV_VERIFY_LOG" in text  # why the log check has no variable
