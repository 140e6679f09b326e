"""The documentation says what the code does (issue 46): README.md and every docs/*.md page are checked against the
real command line and config tree, so a renamed flag or key fails here instead of misleading a reader.

- every ``gemline <subcommand>`` shown in a code block or in inline code is a subcommand of the real parser
  (``gemline.cli.build_parser``), and every ``--flag`` after it is one of that subcommand's flags (ingest, build
  and demo pass Beam's PipelineOptions flags through, so those count there too);
- every ``--set KEY=VALUE`` shown is read by the config loader the commands use (``gemline.config.load_config`` of
  ``parse_set_flags``): an unknown or moved key fails, and so does a value of the wrong type unless it is a
  placeholder (``S``, ``...``);
- every ``python -m benchmarks.X`` names a module of ``benchmarks/`` (docs/results/*.md too);
- every relative markdown link resolves to a file (docs/results/*.md too);
- README.md stays a front door: fewer than 300 lines;
- docs/configuration.md is the reference generated from the typed config tree (:func:`config_reference`).

docs/configuration.md is generated: after a change to a config dataclass, regenerate it with
``python tests/test_docs.py`` from the repository root.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import json
import re
import shlex
import sys
import textwrap
import typing
from functools import lru_cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # `python tests/test_docs.py` regenerates the reference from the repository root
    sys.path.insert(0, str(ROOT))

README = ROOT / "README.md"
DOCS = ROOT / "docs"
CONFIG_REFERENCE = DOCS / "configuration.md"
README_MAX_LINES = 300

FENCE = re.compile(r"^\s*```")
INLINE = re.compile(r"`([^`\n]+)`")
COMMAND = re.compile(r"(?:^|[\s/(\[])gemline\s+([a-z][a-z-]*)")
BENCHMARK = re.compile(r"python -m benchmarks\.([A-Za-z_][A-Za-z0-9_]*)")
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
PLACEHOLDER_VALUE = re.compile(r"^(?:[A-Z][A-Z_]*|\.\.\.|.*\.\.\..*|<.*>)$")


def guide_pages() -> list[Path]:
    """README.md and the user's guide (docs/*.md): the pages whose commands are checked against the CLI."""
    return [README, *sorted(DOCS.glob("*.md"))]


def all_pages() -> list[Path]:
    """The guide and the results notebook (docs/results/*.md): the pages whose links and benchmarks are checked."""
    return [*guide_pages(), *sorted((DOCS / "results").glob("*.md"))]


def snippets(text: str) -> list[str]:
    """The code a page shows: each line of a fenced code block, and each inline code span outside them."""
    out: list[str] = []
    in_fence = False
    for line in text.splitlines():
        if FENCE.match(line):
            in_fence = not in_fence
            continue
        if in_fence:
            out.append(line)
        else:
            out += INLINE.findall(line)
    return out


def _tokens(text: str) -> list[str]:
    """``text`` split as a shell would (quotes kept together), a ``#`` comment dropped; plain split if unbalanced."""
    text = re.split(r"(?:^|\s)#", text, maxsplit=1)[0]
    try:
        return shlex.split(text)
    except ValueError:
        return text.split()


def _flag(token: str) -> str | None:
    """The ``--flag`` a token names (``[--nproc`` -> ``--nproc``, ``--lake=L`` -> ``--lake``), or None."""
    token = token.strip("[](),;")
    if not token.startswith("--") or token == "--":
        return None
    return token.split("=", 1)[0]


@lru_cache(maxsize=1)
def _subcommands() -> dict[str, argparse.ArgumentParser]:
    from gemline.cli import build_parser

    parser = build_parser()
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


@lru_cache(maxsize=1)
def _beam_flags() -> frozenset[str]:
    """Every flag of Beam's PipelineOptions (what ingest, build and demo pass through untouched)."""
    from apache_beam.options.pipeline_options import PipelineOptions

    def subclasses(cls: type) -> list[type]:
        return [s for c in cls.__subclasses__() for s in (c, *subclasses(c))]

    parser = argparse.ArgumentParser(conflict_handler="resolve")
    for cls in set(subclasses(PipelineOptions)):
        try:
            cls._add_argparse_args(parser)  # type: ignore[attr-defined]
        except argparse.ArgumentError:
            pass
    return frozenset(parser._option_string_actions)


def command_problems(snippet: str) -> list[str]:
    """What is wrong with the ``gemline`` commands in one snippet: an unknown subcommand, or a flag its parser
    lacks."""
    problems: list[str] = []
    subcommands = _subcommands()
    for match in COMMAND.finditer(snippet):
        name = match.group(1)
        if name not in subcommands:
            problems.append(f"`gemline {name}`: no such subcommand (known: {', '.join(sorted(subcommands))})")
            continue
        parser = subcommands[name]
        tokens = _tokens(snippet[match.end():])
        nested = next((a for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)
        shown = f"gemline {name}"
        if nested is not None:
            if not tokens or tokens[0].strip("[]") not in nested.choices:
                if tokens and not tokens[0].startswith("-"):
                    problems.append(f"`{shown} {tokens[0]}`: no such action (known: {', '.join(nested.choices)})")
                continue
            parser = nested.choices[tokens[0].strip("[]")]
            shown = f"{shown} {tokens[0].strip('[]')}"
            tokens = tokens[1:]
        passthrough = bool(parser.get_default("passthrough"))
        for token in tokens:
            if token.startswith("gemline") or token in ("&&", ";"):
                break  # the next command in the snippet has its own match
            flag = _flag(token)
            if flag is None or flag in parser._option_string_actions:
                continue
            if passthrough and flag in _beam_flags():
                continue
            problems.append(f"`{shown} {flag}`: {shown} has no such flag")
    return problems


def set_problems(snippet: str) -> list[str]:
    """What is wrong with the ``--set KEY=VALUE`` pairs in one snippet, by the loader the commands use."""
    from gemline.config import load_config, parse_set_flags
    from gemline.errors import BadConfigError

    problems: list[str] = []
    tokens = _tokens(snippet)
    for i, token in enumerate(tokens[:-1]):
        if token.strip("[") != "--set":
            continue
        pair = tokens[i + 1]
        while pair.endswith("]") and pair.count("]") > pair.count("["):
            pair = pair[:-1]  # `[--set KEY=VALUE]`: the optional flag's bracket, not a TOML list's
        if "=" not in pair:
            continue  # `--set KEY=VALUE` written as prose, or a flag with its value elsewhere
        key, value = pair.split("=", 1)
        if re.fullmatch(r"[A-Z_]+", key) or key.endswith(".KEY") or key == "section.key":
            continue  # the placeholders KEY=VALUE and section.key=value
        try:
            load_config(None, parse_set_flags([pair]))
        except (BadConfigError, ValueError) as exc:
            message = str(exc)
            key_error = message.startswith(("unknown config key", "config key", "cannot set"))
            if key_error or not PLACEHOLDER_VALUE.match(value):
                problems.append(f"`--set {pair}`: {message}")
    return problems


def page_problems(path: Path) -> list[str]:
    """Every command, flag and --set problem of one guide page, each with its line."""
    problems = []
    for snippet in snippets(path.read_text(encoding="utf-8")):
        problems += [f"{path.relative_to(ROOT)}: {p}" for p in command_problems(snippet) + set_problems(snippet)]
    return problems


@pytest.mark.parametrize("page", guide_pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_commands_flags_and_settings_exist(page: Path) -> None:
    problems = page_problems(page)
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("page", all_pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_benchmark_modules_and_links_exist(page: Path) -> None:
    text = page.read_text(encoding="utf-8")
    problems = [f"python -m benchmarks.{m}: no benchmarks/{m}.py" for m in BENCHMARK.findall(text)
                if not (ROOT / "benchmarks" / f"{m}.py").is_file()]
    for target in LINK.findall(text):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue
        if not (page.parent / target.split("#", 1)[0]).exists():
            problems.append(f"link ({target}) resolves to no file")
    assert not problems, f"{page.relative_to(ROOT)}:\n" + "\n".join(problems)


def test_the_guide_pages_exist_and_the_readme_links_each() -> None:
    readme = README.read_text(encoding="utf-8")
    pages = sorted(DOCS.glob("*.md"))
    assert len(pages) >= 10
    unlinked = [p.name for p in pages if f"docs/{p.name}" not in readme]
    assert not unlinked, f"README.md does not link {unlinked}"
    assert "docs/results/README.md" in readme


def test_readme_is_a_front_door() -> None:
    lines = README.read_text(encoding="utf-8").count("\n")
    assert lines < README_MAX_LINES, f"README.md has {lines} lines; move detail into docs/ (limit {README_MAX_LINES})"


def test_readme_keeps_the_setup_commands() -> None:
    """`make demo` and `make test` are the two set-up commands; .ci/run calls `make test`."""
    readme = README.read_text(encoding="utf-8")
    assert re.search(r"^make demo\b", readme, re.M) and re.search(r"^make test\b", readme, re.M)
    assert "make test" in (ROOT / ".ci" / "run").read_text(encoding="utf-8")


@pytest.mark.parametrize("snippet, expected", [
    ("gemline nosuch --lake L", "no such subcommand"),
    (".venv/bin/gemline train --once --no-such-flag", "has no such flag"),
    ("gemline quality nosuch 3", "no such action"),
    ("gemline ingest --runner DataflowRunner --project P --no-such-beam-flag 1", "has no such flag"),
    ("gemline build --set build.no_such_key=1", "unknown config key"),
    ("gemline train --set trainer.gem_layers=3", "moved to"),
    ("gemline train --set trainer.batch_size=many", "expected int"),
])
def test_the_checks_catch_a_wrong_line(snippet: str, expected: str) -> None:
    problems = command_problems(snippet) + set_problems(snippet)
    assert any(expected in p for p in problems), problems


@pytest.mark.parametrize("snippet", [
    ".venv/bin/gemline train --once | --follow [--from-scratch] # continuous",
    "gemline ingest --runner FlinkRunner --flink_master=HOST:8081 --environment_type=LOOPBACK",
    "gemline cluster up --workers 2",
    "gemline quality release 3 --table events --reason \"a known replay\"",
    "gemline compare --holdout-last-day --lake L --set trainer.seed=S",
    "gemline run --set 'distill.variants=[\"alone\",\"aux_head\"]'",
])
def test_the_checks_pass_a_right_line(snippet: str) -> None:
    assert command_problems(snippet) + set_problems(snippet) == []


# The configuration reference, generated from the typed config tree (gemline.config.GemlineConfig).

REFERENCE_HEADER = """\
# Configuration reference

Generated from the typed config tree (`gemline/config.py` and the sections it composes) by
`python tests/test_docs.py`; `tests/test_docs.py` checks that this page matches the code. Do not edit it by hand.

Every command but `broker` and `cluster up` takes `--config FILE` (a TOML file whose sections mirror this tree),
`--lake DIR` and `--set section.key=value` (repeatable; nested sections are dotted, `--set trainer.gem.layers=3`).
TOML values are typed: `batch_size = "64"` or `compile = "yes"` is a one-line error naming the key (write
`batch_size = 64`, `compile = true`). `--set` values are text, parsed into the key's type; a list takes
`--set trainer.hidden_dims=64,32` or the TOML `--set 'trainer.hidden_dims=[64, 32]'` (strings quoted). A key that
moved into a section (`trainer.gem_layers`, `trainer.kernel_backend`, `build.compact_min_files`, ...) is a one-line
error naming its new key. A default of `(preset)` comes from `trainer.gem.preset`; `none` is TOML's absent value
(`--set KEY=none`).

`gemline run` saves its non-default settings with the lake, and commands started alone on that lake later take
them as defaults: see [run-and-metrics.md](run-and-metrics.md#running-again-on-the-same-lake).
"""


def _field_docs(cls: type) -> tuple[dict[str, str], set[str]]:
    """Each field's attribute docstring (the string after it in the class body), and the fields whose default is
    the preset sentinel ``_PRESET``."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = typing.cast(ast.ClassDef, tree.body[0]).body
    docs: dict[str, str] = {}
    preset: set[str] = set()
    for node, after in zip(body, [*body[1:], None]):
        if not isinstance(node, ast.AnnAssign) or not isinstance(node.target, ast.Name):
            continue
        name = node.target.id
        if isinstance(node.value, ast.Name) and node.value.id == "_PRESET":
            preset.add(name)
        if isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant) and isinstance(after.value.value, str):
            docs[name] = after.value.value
    return docs, preset


def _one_line(doc: str) -> str:
    """A docstring's first paragraph on one line, safe in a table cell."""
    paragraph = inspect.cleandoc(doc).split("\n\n")[0]
    return " ".join(paragraph.split()).replace("|", "\\|")


def _type_name(hint: typing.Any) -> str:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is type(None):
        return "none"
    if origin is typing.Literal:
        return " or ".join(json.dumps(a) for a in args)
    if origin is typing.Union or type(hint).__name__ == "UnionType":
        return " or ".join(_type_name(a) for a in args)
    if origin is tuple:
        return f"list of {_type_name(args[0])}"
    if origin is dict:
        return f"table of {_type_name(args[1])}"
    return getattr(hint, "__name__", str(hint))


def _default_text(value: typing.Any) -> str:
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, (tuple, list)):
        return "[" + ", ".join(_default_text(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{}" if not value else json.dumps(value)
    return repr(value)


def config_reference() -> str:
    """docs/configuration.md: per section, each key's dotted name, type, default and the first paragraph of its
    docstring, walked from ``GemlineConfig`` in field order."""
    from gemline.config import GemlineConfig

    sections: list[str] = []

    def walk(cls: type, prefix: str) -> None:
        hints = typing.get_type_hints(cls)
        docs, preset = _field_docs(cls)
        instance = cls()
        rows, nested = [], []
        for f in dataclasses.fields(typing.cast(typing.Any, cls)):
            hint = hints[f.name]
            if isinstance(hint, type) and dataclasses.is_dataclass(hint):
                nested.append((hint, f"{prefix}{f.name}."))
                continue
            default = "(preset)" if f.name in preset else _default_text(getattr(instance, f.name))
            meaning = _one_line(docs.get(f.name, ""))
            rows.append(f"| `{prefix}{f.name}` | {_type_name(hint).replace('|', chr(92) + '|')} | "
                        f"`{default}` | {meaning} |")
        title = f"`[{prefix.rstrip('.')}]`" if prefix else "Top level"
        summary = _one_line(cls.__doc__ or "")
        if rows:
            sections.append(f"## {title}\n\n{summary}\n\n| key | type | default | meaning |\n|---|---|---|---|\n"
                            + "\n".join(rows) + "\n")
        for sub, sub_prefix in nested:
            walk(sub, sub_prefix)

    walk(GemlineConfig, "")
    return REFERENCE_HEADER + "\n" + "\n".join(sections)


def test_configuration_reference_matches_the_config_tree() -> None:
    assert CONFIG_REFERENCE.read_text(encoding="utf-8") == config_reference(), (
        "docs/configuration.md is out of date with the config dataclasses: regenerate it with "
        "`python tests/test_docs.py` from the repository root")


if __name__ == "__main__":
    CONFIG_REFERENCE.write_text(config_reference(), encoding="utf-8")
    print(f"wrote {CONFIG_REFERENCE.relative_to(ROOT)}")
