"""MkDocs hook: the parts of the site that come from the code, so they cannot drift from it.

* ``reference/cli.md``: the marker ``<!-- cli-reference -->`` is replaced by every command of
  :func:`pgcdc_dagster.cli.build_parser`, its help, usage and arguments. Every command must
  also be named in README.md (``pgcdc <command>``).
* ``reference/configuration.md``: the table between ``<!-- settings-table -->`` and
  ``<!-- /settings-table -->`` is hand-written (a variable and what it means); the hook adds
  each field's type and default from
  :class:`pgcdc_dagster.engine.settings.ReplicationSettings`, and fails the build when a
  field has no row or a row names no field. The table between ``<!-- other-variables -->``
  and ``<!-- /other-variables -->`` lists the variables read outside the settings; each must
  be read somewhere in the package, and every ``PGCDC_*`` name the package mentions must be in
  one of the two tables.
* ``contributing.md``: the marker ``<!-- failpoints -->`` is replaced by every crash point of
  :data:`pgcdc_dagster.engine.failpoints.POINTS` and what is durable when it fires.
* ``architecture.md``: every module and package of ``pgcdc_dagster`` must be named in the
  layout tables between ``<!-- layout-table -->`` and ``<!-- /layout-table -->`` (a
  ``pgcdc_dagster/...`` path in each row's first column), and every path named there must
  exist.
* ``benchmarks/README.md``, ``benchmarks/HISTORY.md`` and ``CHANGELOG.md`` become the pages
  ``benchmarks/latest.md``, ``benchmarks/history.md`` and ``changelog.md``: they live outside
  ``docs/``, where a strict build cannot link to them.
* A file named in code (`` `engine/settings.py` ``, `` `test_cli.py` ``) in a docs page or in
  README.md must exist: in the repository, or under ``pgcdc_dagster/``,
  ``pgcdc_dagster_tests/`` or ``benchmarks/``. A module renamed without its docs fails the
  build.
* Relative links that leave ``docs/`` (written so that they work when the Markdown is read in
  the repository) are rewritten: to those pages, or, for a file the site does not hold (a
  benchmark script, a module), to its plain text. A link to nothing fails the build.
"""

from __future__ import annotations

import argparse
import ast
import os
import posixpath
import re
from functools import cache
from pathlib import Path
from typing import Any

from mkdocs.config.defaults import MkDocsConfig
from mkdocs.exceptions import PluginError
from mkdocs.structure.files import File, Files
from mkdocs.structure.pages import Page

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "pgcdc_dagster"

MIRRORED = {  # a repository file -> the site page that carries it
    "benchmarks/README.md": "benchmarks/latest.md",
    "benchmarks/HISTORY.md": "benchmarks/history.md",
    "CHANGELOG.md": "changelog.md",
}
ORIGIN = {page: source for source, page in MIRRORED.items()}

CLI_MARKER = "<!-- cli-reference -->"
FAILPOINTS_MARKER = "<!-- failpoints -->"
SETTINGS_TABLE = ("<!-- settings-table -->", "<!-- /settings-table -->")
OTHER_TABLE = ("<!-- other-variables -->", "<!-- /other-variables -->")
LAYOUT_TABLE = ("<!-- layout-table -->", "<!-- /layout-table -->")

FENCE = re.compile(r"^(```|~~~).*?^\1\s*$", re.M | re.S)
LINK = re.compile(r"(?<!!)\[(?P<text>[^\]\n]*)\]\((?P<target>[^)\s]+)\)")


# -- the repository's own Markdown files --------------------------------------------------------


def on_files(files: Files, config: MkDocsConfig) -> Files:
    for source, page in MIRRORED.items():
        if files.get_file_from_path(page) is not None:
            raise PluginError(f"docs/{page} exists, but the hook generates it from {source}")
        content = (REPO / source).read_text(encoding="utf-8")
        files.append(File.generated(config, page, content=content))
    return files


def on_page_markdown(markdown: str, page: Page, config: MkDocsConfig, files: Files) -> str:
    src = page.file.src_uri
    if src not in ORIGIN:
        check_named_files(markdown, f"docs/{src}")
    markdown = _outside_links(markdown, src)
    if src == "reference/cli.md":
        markdown = _fill(markdown, src, CLI_MARKER, cli_reference())
    elif src == "reference/configuration.md":
        markdown = configuration_reference(markdown)
    elif src == "architecture.md":
        check_layout(markdown)
    elif src == "contributing.md":
        markdown = _fill(markdown, src, FAILPOINTS_MARKER, failpoints_table())
    return markdown


def _outside_links(markdown: str, src: str) -> str:
    """Links as the repository reads them, made into links the site holds (see the module)."""
    here = posixpath.dirname(ORIGIN.get(src, f"docs/{src}"))
    site_dir = posixpath.dirname(src)

    def rewrite(match: re.Match[str]) -> str:
        text, target = match["text"], match["target"]
        if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith(("#", "/")):
            return match[0]
        path, _, anchor = target.partition("#")
        anchor = f"#{anchor}" if anchor else ""
        resolved = posixpath.normpath(posixpath.join(here, path))
        if resolved.startswith("docs/"):
            new = resolved.removeprefix("docs/")
        elif resolved in MIRRORED:
            new = MIRRORED[resolved]
        elif (REPO / resolved).exists():
            return text  # a script or a module: named, not linked
        else:
            raise PluginError(
                f"{ORIGIN.get(src, 'docs/' + src)}: the link {target!r} leads nowhere"
            )
        return f"[{text}]({posixpath.relpath(new, site_dir or '.')}{anchor})"

    out, last = [], 0
    for fence in FENCE.finditer(markdown):  # code blocks hold no links
        out.append(LINK.sub(rewrite, markdown[last : fence.start()]))
        out.append(fence[0])
        last = fence.end()
    out.append(LINK.sub(rewrite, markdown[last:]))
    return "".join(out)


def _fill(markdown: str, src: str, marker: str, content: str) -> str:
    if markdown.count(marker) != 1:
        raise PluginError(f"docs/{src}: the marker {marker} must appear once")
    return markdown.replace(marker, content)


def _between(markdown: str, markers: tuple[str, str], where: str) -> tuple[str, str, str]:
    begin, end = markers
    if markdown.count(begin) != 1 or markdown.count(end) != 1:
        raise PluginError(f"{where}: the markers {begin} and {end} must appear once each")
    head, rest = markdown.split(begin)
    body, tail = rest.split(end)
    return head, body, tail


def _table_rows(body: str) -> list[list[str]]:
    """The rows of the one Markdown table in ``body``, header and rule left out."""
    lines = [line.strip() for line in body.strip().splitlines() if line.strip()]
    if len(lines) < 2 or not re.fullmatch(r"\|?[\s:|-]+\|?", lines[1]):
        raise PluginError(f"expected a Markdown table, found: {body.strip()[:80]!r}")
    rows = []
    for line in lines[2:]:
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line.strip().strip("|"))]
        rows.append(cells)
    return rows


# -- files named in the docs ----------------------------------------------------------------------

NAMED_FILE = re.compile(r"`((?:[\w.-]+/)*[\w-]+\.(?:py|md|yaml|toml))`")
SEARCHED = ("", "pgcdc_dagster/", "pgcdc_dagster_tests/", "benchmarks/")


def check_named_files(markdown: str, where: str) -> None:
    missing = sorted(
        {
            name
            for name in NAMED_FILE.findall(markdown)
            if not any((REPO / f"{base}{name}").exists() for base in SEARCHED)
        }
    )
    if missing:
        raise PluginError(f"{where} names files that do not exist: {', '.join(missing)}")


def on_post_build(config: MkDocsConfig) -> None:
    check_named_files((REPO / "README.md").read_text(encoding="utf-8"), "README.md")


# -- the CLI reference ----------------------------------------------------------------------------


def cli_reference() -> str:
    from pgcdc_dagster.cli import build_parser

    parser = build_parser()
    commands = _subcommands(parser)
    _check_readme_names(commands)
    out = [
        "```",
        _usage(parser),
        "```",
        "",
        parser.description or "",
        "",
        _arguments_table(parser),
    ]
    for name, (help_text, sub) in commands.items():
        out += [
            "",
            f"## `pgcdc {name}`",
            "",
            _sentence(help_text),
            "",
            "```",
            _usage(sub),
            "```",
        ]
        table = _arguments_table(sub)
        if table:
            out += ["", table]
    return "\n".join(out) + "\n"


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, tuple[str, Any]]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {a.dest: a.help or "" for a in action._choices_actions}
            return {name: (helps.get(name, ""), sub) for name, sub in action.choices.items()}
    raise PluginError("pgcdc_dagster.cli.build_parser() has no subcommands")


def _usage(parser: argparse.ArgumentParser) -> str:
    old = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = "100"  # the same wrapping on every machine
    try:
        return parser.format_usage().strip()
    finally:
        if old is None:
            del os.environ["COLUMNS"]
        else:
            os.environ["COLUMNS"] = old


def _arguments_table(parser: argparse.ArgumentParser) -> str:
    rows = []
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction | argparse._SubParsersAction):
            continue
        if action.option_strings:
            name = ", ".join(f"`{o}`" for o in action.option_strings)
            if action.nargs != 0:
                name += f" `{action.metavar or action.dest.upper()}`"
        else:
            name = f"`{action.metavar or action.dest}`"
            if action.nargs in ("+", "*"):
                name += " ..."
        if action.choices:
            name += ": " + " \\| ".join(f"`{c}`" for c in action.choices)
        default = action.default
        shown = (
            ""
            if default is None or default is False or default == argparse.SUPPRESS
            else f"`{default}`"
        )
        rows.append(f"| {name} | {_cell(action.help or '')} | {shown} |")
    if not rows:
        return ""
    return "\n".join(["| argument | what | default |", "|---|---|---|", *rows])


def _check_readme_names(commands: dict[str, Any]) -> None:
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    missing = [name for name in commands if not re.search(rf"pgcdc {re.escape(name)}\b", readme)]
    if missing:
        raise PluginError(
            "README.md names no line for the command(s) "
            + ", ".join(f"'pgcdc {n}'" for n in missing)
            + ": give each command a line in its command list"
        )


def _sentence(text: str) -> str:
    text = text.strip()
    return (text[:1].upper() + text[1:] + ("" if text.endswith(".") else ".")) if text else ""


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


# -- the failpoints ------------------------------------------------------------------------------


def failpoints_table() -> str:
    from pgcdc_dagster.engine.failpoints import POINTS

    rows = [f"| `{name}` | {_cell(what)} |" for name, what in POINTS.items()]
    return "\n".join(["| point | what is durable when it fires |", "|---|---|", *rows]) + "\n"


# -- the configuration reference ------------------------------------------------------------------


def configuration_reference(markdown: str) -> str:
    from pgcdc_dagster.engine.settings import PREFIX, ReplicationSettings

    where = "docs/reference/configuration.md"
    fields = ReplicationSettings.model_fields
    head, body, tail = _between(markdown, SETTINGS_TABLE, where)
    rows = _table_rows(body)
    described: dict[str, str] = {}
    for cells in rows:
        variable = _variable(cells[0], where)
        name = variable.removeprefix(PREFIX).lower()
        if not variable.startswith(PREFIX) or name not in fields:
            raise PluginError(
                f"{where}: the row {variable} names no field of ReplicationSettings "
                "(pgcdc_dagster/engine/settings.py): remove it, or move it to the table of "
                "variables read elsewhere"
            )
        if name in described:
            raise PluginError(f"{where}: {variable} has two rows")
        described[name] = cells[1] if len(cells) > 1 else ""
    missing = [f"{PREFIX}{name.upper()}" for name in fields if name not in described]
    if missing:
        raise PluginError(
            f"{where}: no row for {', '.join(missing)} (a field of ReplicationSettings): add "
            "one saying what it means"
        )
    table = ["| variable | meaning | type | default |", "|---|---|---|---|"]
    for name, meaning in described.items():
        kind, default = _describe(name)
        table.append(f"| `{PREFIX}{name.upper()}` | {meaning} | {kind} | {default} |")

    other_head, other_body, other_tail = _between(tail, OTHER_TABLE, where)
    others = [_variable(cells[0], where) for cells in _table_rows(other_body)]
    sources = _package_text()
    for variable in others:
        if variable.startswith(PREFIX) and variable.removeprefix(PREFIX).lower() in fields:
            raise PluginError(
                f"{where}: {variable} is a field of ReplicationSettings now: move its row into "
                "the settings table"
            )
        if variable not in sources:
            raise PluginError(f"{where}: {variable} is read nowhere in pgcdc_dagster: remove it")
    named = set(re.findall(r"\bPGCDC_[A-Z0-9_]*[A-Z0-9]\b", sources))
    unlisted = sorted(
        v for v in named - set(others) if v.removeprefix(PREFIX).lower() not in fields
    )
    if unlisted:
        raise PluginError(
            f"{where}: the package names {', '.join(unlisted)}, which neither table lists"
        )
    return "".join([head, "\n".join(table), "\n", other_head, other_body, other_tail])


def _variable(cell: str, where: str) -> str:
    match = re.fullmatch(r"`([A-Z][A-Z0-9_]*)`", cell.strip())
    if not match:
        raise PluginError(f"{where}: a row's first cell must be one `VARIABLE`, not {cell!r}")
    return match[1]


@cache
def _package_text() -> str:
    texts = [p.read_text(encoding="utf-8") for p in sorted(PACKAGE.rglob("*.py"))]
    texts += [(REPO / name).read_text(encoding="utf-8") for name in ("dagster.yaml",)]
    return "\n".join(texts)


_NOT_ACCEPTED = object()


def _accepts(name: str, text: str) -> Any:
    """What the settings make of ``text`` for field ``name``, or ``_NOT_ACCEPTED``."""
    from pydantic import ValidationError

    from pgcdc_dagster.engine.settings import ReplicationSettings

    try:
        return getattr(ReplicationSettings.model_validate({name: text}), name)
    except (ValidationError, ValueError):
        return _NOT_ACCEPTED


def _describe(name: str) -> tuple[str, str]:
    """A field's type as its variable is written, and its default in the same form."""
    from typing import Literal, get_args, get_origin

    from pgcdc_dagster.engine.settings import MiB, ReplicationSettings

    field = ReplicationSettings.model_fields[name]
    default = field.get_default(call_default_factory=True)
    literal = [a for a in _flatten(field.annotation) if get_origin(a) is Literal]

    if _accepts(name, "2MB") == 2 * MiB:
        kind = "size: bytes, or with a unit (`512MB`, `1GB`)"
        shown = _size(default)
    elif _accepts(name, "2m") == 120.0:
        kind = "duration: seconds, or `90s`, `30m`, `12h`, `7d`"
        if _accepts(name, "forever") is None:
            kind += ", `forever`"
        shown = "`forever`" if default is None else f"`{_duration(default)}`"
    elif literal:
        kind = " \\| ".join(f"`{v}`" for v in get_args(literal[0]))
        shown = f"`{default}`"
    elif isinstance(default, bool):
        kind = "`on` \\| `off`"
        shown = "`on`" if default else "`off`"
    elif isinstance(_accepts(name, "spark.a=1; spark.b=2"), dict):
        kind = "`spark.*` settings: `key=value` pairs separated by `;`"
        shown = "none" if not default else f"`{default}`"
    elif isinstance(_accepts(name, "public.a, public.b"), tuple):
        kind = "comma list of `schema.table`"
        shown = "unset" if default is None else f"`{default}`"
    else:
        kind = _number_kind(field)
        if _accepts(name, "all") is None:
            kind += ", or `all`"
        if default is None:
            shown = "unset"
        elif isinstance(default, int) and default >= MiB and default % MiB == 0:
            shown = f"`{default}` ({_binary(default)})"
        elif isinstance(default, float) and default.is_integer():
            shown = f"`{int(default)}`"
        elif default == "":
            shown = "unset"
        else:
            shown = f"`{default}`"
    return kind, shown


def _flatten(annotation: Any) -> list[Any]:
    from typing import Union, get_args, get_origin

    if get_origin(annotation) in (Union, type(int | None)):
        return [x for a in get_args(annotation) for x in _flatten(a)]
    return [annotation]


def _number_kind(field: Any) -> str:
    from typing import Annotated, get_args, get_origin

    base: Any = None
    bounds = list(field.metadata)
    for member in _flatten(field.annotation):
        if get_origin(member) is Annotated:
            base, *extra = get_args(member)
            bounds += extra
        elif member is not type(None):
            base = member
    words: dict[Any, str] = {int: "integer", float: "number", str: "text"}
    kind = words.get(base, f"`{getattr(base, '__name__', base)}`")
    for bound in bounds:
        if getattr(bound, "gt", None) is not None:
            kind += f" > {bound.gt}"
        if getattr(bound, "ge", None) is not None:
            kind += f" ≥ {bound.ge}"
    return kind


def _size(value: int) -> str:
    for unit, size in (("TB", 1024**4), ("GB", 1024**3), ("MB", 1024**2), ("kB", 1024)):
        if value and value % size == 0:
            return f"`{value // size}{unit}`"
    return f"`{value}`"


def _binary(value: int) -> str:
    for unit, size in (("TiB", 1024**4), ("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if value and value % size == 0:
            return f"{value // size} {unit}"
    return f"{value} bytes"


def _duration(seconds: float) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds and seconds % size == 0:
            return f"{int(seconds // size)}{unit}"
    return f"{seconds:g}s"


# -- the architecture page's layout ---------------------------------------------------------------


def check_layout(markdown: str) -> None:
    where = "docs/architecture.md"
    _, body, _ = _between(markdown, LAYOUT_TABLE, where)
    listed = set()
    for line in body.splitlines():
        if not line.startswith("|") or re.fullmatch(r"\|?[\s:|-]+\|?", line.strip()):
            continue  # not a table row, or a table's rule
        first = line.strip().strip("|").split("|")[0].strip()
        if first.lower() in ("module", "path", "package"):
            continue  # a table's header
        match = re.fullmatch(r"`(pgcdc_dagster/[\w/]*?(?:\.py|/))`", first)
        if not match:
            raise PluginError(f"{where}: a layout row must start with a `pgcdc_dagster/...` path")
        listed.add(match[1])
    present = set()
    for path in PACKAGE.rglob("*.py"):
        relative = path.relative_to(REPO).as_posix()
        if "__pycache__" in relative:
            continue
        if path.name == "__init__.py":
            present.add(posixpath.dirname(relative) + "/")
        else:
            present.add(relative)
    present.discard("pgcdc_dagster/")
    problems = []
    if missing := sorted(present - listed):
        problems.append("not described: " + ", ".join(missing))
    if gone := sorted(listed - present):
        problems.append("described but absent: " + ", ".join(gone))
    if problems:
        raise PluginError(
            f"{where}: the layout table does not match the package ({'; '.join(problems)})"
        )


# -- a module's docstring, for whoever edits the layout -------------------------------------------


def first_lines() -> dict[str, str]:
    """Each module's first docstring line: ``python docs/hooks/reference.py`` prints them, a
    start for the layout table."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))) or ""
        found[path.relative_to(REPO).as_posix()] = doc.split("\n\n")[0].replace("\n", " ")
    return found


if __name__ == "__main__":
    for module, line in first_lines().items():
        print(f"{module}: {line}")
