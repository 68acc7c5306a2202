"""The documentation site: every public name is on an API page, and the examples on the pages run.

The site itself is built by `make docs` (`mkdocs build --strict`, which fails on any warning,
such as a cross-reference to an undocumented name). This file checks what the build cannot:
that nothing public is missing from the API pages, that the pages' directives name real
members, and that the code examples work.

Every Python code block of the README and of the pages under docs/ says what it is, in its
fence's info string:

- ```` ```python { .runnable } ````: run by this file. A page's runnable blocks run in order,
  in one namespace, as a reader would paste them; the README's run as written, in a fresh
  interpreter with none of the suite's XLA flags.
- ```` ```python { .fragment } ````: shown on purpose without being run: a piece of a larger
  program (names it leaves undefined, a real checkpoint, several processes), or an interface
  as it is declared.

A block that only includes an example program (`--8<-- "examples/..."`) needs neither: the
examples are run by tests/test_examples.py. Blocks in other languages (shell commands, text)
are not run. `test_every_python_block_is_run_or_a_fragment` fails on an unmarked one.
"""

import dataclasses
import importlib
import inspect
import json
import os
import re
import sys
import textwrap
import types
from pathlib import Path

import pytest

from . import _stall


ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
PUBLIC_MODULES = [
    "deltanet_cp",
    "deltanet_cp.chunkops",
    "deltanet_cp.data",
    "deltanet_cp.internal",
    "deltanet_cp.nn",
    "deltanet_cp.models",
    "deltanet_cp.interop",
    "deltanet_cp.testing",
]

_DIRECTIVE = re.compile(r"^(?P<indent>[ \t]*):::[ \t]+(?P<name>[\w.]+)[ \t]*$")
_FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})(?P<info>.*)$")


@dataclasses.dataclass
class Directive:
    page: str
    line: int
    name: str
    members: list[str] | bool | None  # None: no `members:` option given
    in_abstract_block: bool


def _pages() -> list[Path]:
    return sorted(DOCS.rglob("*.md"))


def _rel(page: Path) -> str:
    return str(page.relative_to(DOCS))


def _parse_members(block: list[str]) -> list[str] | bool | None:
    """The `members:` option of a directive's indented YAML block (a list, or true/false)."""
    for i, line in enumerate(block):
        m = re.match(r"^(\s*)members:\s*(\S*)\s*$", line)
        if not m:
            continue
        if m.group(2):
            return m.group(2).lower() == "true"
        indent = len(m.group(1))
        members = []
        for item in block[i + 1 :]:
            if not item.strip():
                continue
            mi = re.match(r"^(\s*)-\s*([\w.]+)\s*$", item)
            if not mi or len(mi.group(1)) < indent:
                break
            members.append(mi.group(2))
        return members
    return None


def _directives() -> list[Directive]:
    found = []
    for page in _pages():
        lines = page.read_text().splitlines()
        for i, line in enumerate(lines):
            m = _DIRECTIVE.match(line)
            if not m:
                continue
            indent = len(m.group("indent"))
            block = []
            for nxt in lines[i + 1 :]:
                if nxt.strip() and len(nxt) - len(nxt.lstrip()) <= indent:
                    break
                block.append(nxt)
            above = [ln for ln in lines[:i] if ln.strip()]
            in_abstract = (
                indent > 0 and bool(above) and above[-1].lstrip().startswith("??? abstract")
            )
            found.append(
                Directive(_rel(page), i + 1, m.group("name"), _parse_members(block), in_abstract)
            )
    return found


def _resolve(path: str) -> object:
    """Import `a.b.C.d` as the longest importable module prefix, then attribute lookups."""
    parts = path.split(".")
    for n in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:n]))
        except ImportError:
            continue
        for attr in parts[n:]:
            obj = getattr(obj, attr)
        return obj
    raise ImportError(path)


def _public_names(module_name: str) -> list[str]:
    module = importlib.import_module(module_name)
    names = getattr(module, "__all__", None)
    if names is None:  # fall back to what the module re-exports
        names = [
            n
            for n, v in vars(module).items()
            if not n.startswith("_") and not isinstance(v, types.ModuleType)
        ]
    return sorted(names)


@pytest.mark.parametrize("module_name", PUBLIC_MODULES)
def test_every_public_name_is_on_an_api_page(module_name):
    documented = {d.name for d in _directives()}
    missing = [n for n in _public_names(module_name) if f"{module_name}.{n}" not in documented]
    assert not missing, (
        f"Public names of `{module_name}` with no `::: {module_name}.NAME` directive on any page "
        f"under docs/: {missing}. Add them to the right page in docs/api/."
    )


def test_directives_name_real_objects_and_members():
    problems = []
    for d in _directives():
        where = f"{d.page}:{d.line} `::: {d.name}`"
        try:
            obj = _resolve(d.name)
        except (ImportError, AttributeError) as e:
            problems.append(f"{where}: cannot import it ({e})")
            continue
        if inspect.isclass(obj) and d.members is None:
            problems.append(f"{where}: a class needs an explicit `members:` option")
        for member in d.members if isinstance(d.members, list) else []:
            if not hasattr(obj, member):
                problems.append(f"{where}: lists member `{member}`, which it does not have")
    assert not problems, "\n".join(problems)


def test_abstract_bases_are_in_collapsible_blocks():
    problems = [
        f"{d.page}:{d.line} `::: {d.name}` is not inside a `??? abstract` block"
        for d in _directives()
        if d.name.rsplit(".", 1)[-1].startswith("Abstract") and not d.in_abstract_block
    ]
    assert not problems, "\n".join(problems)


def test_every_page_and_example_is_in_the_nav():
    config = (ROOT / "mkdocs.yml").read_text()
    nav = set(re.findall(r"^\s*-\s*(?:[^\n]*?:\s+)?([\w/.-]+\.md)\s*$", config, re.M))
    pages = {_rel(p) for p in _pages()}
    assert pages - nav == set(), f"pages missing from the nav of mkdocs.yml: {pages - nav}"
    assert nav - pages == set(), f"nav entries with no page under docs/: {nav - pages}"
    included = "\n".join(p.read_text() for p in _pages())
    examples = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "examples").glob("*.py"))
    missing = [e for e in examples if not re.search(f'--8<-- "{re.escape(e)}[:"]', included)]
    assert not missing, f'examples not shown on any page (`--8<-- "examples/..."`): {missing}'


def _blocks(page: Path) -> list[tuple[int, str, str]]:
    """Every fenced code block of a page: its first line, its info string and its dedented body."""
    blocks = []
    lines = page.read_text().splitlines()
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        fence, indent = m.group("fence"), m.group("indent")
        start = i
        body = []
        i += 1
        while i < len(lines) and not lines[i].strip().startswith(fence):
            body.append(lines[i][len(indent) :] if lines[i].startswith(indent) else lines[i])
            i += 1
        i += 1
        blocks.append((start + 1, m.group("info").strip(), textwrap.dedent("\n".join(body))))
    return blocks


def _runnable_blocks(page: Path) -> list[tuple[int, str]]:
    """The code blocks of a page whose fence is marked `{ .runnable }`, dedented."""
    return [(line, body) for line, info, body in _blocks(page) if re.search(_RUNNABLE, info)]


_RUNNABLE = r"\.runnable\b"
_FRAGMENT = r"\.fragment\b"


def test_every_python_block_is_run_or_a_fragment():
    unmarked = []
    for page in [ROOT / "README.md", *_pages()]:
        for line, info, body in _blocks(page):
            if info.split("{")[0].strip().lower() not in ("python", "py", "pycon"):
                continue
            if re.search(_RUNNABLE, info) or re.search(_FRAGMENT, info):
                continue
            code = [ln for ln in body.splitlines() if ln.strip()]
            if code and all(ln.startswith('--8<-- "examples/') for ln in code):
                continue  # an example program, run by tests/test_examples.py
            unmarked.append(f"{page.relative_to(ROOT)}:{line}")
    assert not unmarked, (
        "Python code blocks that are neither run nor marked as fragments: "
        f"{unmarked}. Mark each fence `python {{ .runnable }}` (and make it run, see "
        "tests/test_docs.py) or `python {{ .fragment }}`."
    )


# The runnable blocks run in child processes, not in pytest's: as a reader runs them, in a
# fresh interpreter without runtime type checking (they may set XLA_FLAGS before jax starts),
# and a crash in XLA fails the page rather than killing the test session. Rank promotion is an
# error there, as in the test suite, and the suite's persistent compilation cache serves them
# (tests/_compile_cache.py).
_RUNNER = r"""
import contextlib, io, json, sys, time, traceback

import jax

from tests import _compile_cache

jax.config.update("jax_numpy_rank_promotion", "raise")
_compile_cache.enable()  # the suite's persistent cache: a page compiled before loads

for page, blocks in json.load(sys.stdin).items():
    print(json.dumps({"start": page}), flush=True)
    namespace = {"__name__": "__docs__"}
    start = time.perf_counter()
    try:
        for line, code in blocks:
            with contextlib.redirect_stdout(io.StringIO()):
                exec(compile(code, f"docs/{page}:{line}", "exec"), namespace)
    except BaseException:
        print(json.dumps({"fail": page, "error": traceback.format_exc()}), flush=True)
    else:
        print(json.dumps({"ok": page, "seconds": time.perf_counter() - start}), flush=True)
"""
# Eight simulated CPU devices, as in conftest.py, and otherwise XLA's default flags: the
# pages run the programs a reader runs. (With XLA's most optimisations off they compiled 20%
# faster on a cold cache, 250 s against 300 s for all pages on 2 cores; the persistent cache
# makes the difference small, and a second run loads them: 160 s.)
_XLA_FLAGS = "--xla_force_host_platform_device_count=8"
# The front page (docs/index.md) runs with the README (`test_readme_and_front_page_run_as_written`),
# whose blocks it begins with.
_RUNNABLE_PAGES = [_rel(p) for p in _pages() if _runnable_blocks(p) and _rel(p) != "index.md"]


def _run_page(page: str) -> dict:
    """Run one page's blocks in a fresh process; its "ok" or "fail" event."""
    env = {k: v for k, v in os.environ.items() if k != "JAX_DISABLE_MOST_OPTIMIZATIONS"}
    env.update(XLA_FLAGS=_XLA_FLAGS, JAX_PLATFORMS="cpu")
    blocks = json.dumps({page: _runnable_blocks(DOCS / page)})
    try:
        result = _stall.run([sys.executable, "-c", _RUNNER], input=blocks, cwd=ROOT, env=env)
    except _stall.Stalled as e:
        return {"fail": page, "error": f"the process hung: {e}"}
    for line in result.stdout.splitlines():
        event = json.loads(line) if line.startswith("{") else {}
        if "ok" in event or "fail" in event:
            return event
    return {
        "fail": page,
        "error": f"the process died (exit code {result.returncode}) while running this page:"
        f"\n{result.stderr[-3000:]}",
    }


# Each page in a process of its own, so that the pages spread over the test processes as
# any other tests do (pytest-xdist), whatever the distribution. The pages run in the slow
# suite (CI runs it): they compile as a reader's run compiles, 280 s of the default suite's
# test time on 2 cores from a cold cache; the default suite runs the quickstart
# (`test_readme_and_front_page_run_as_written`).
@pytest.mark.slow
@pytest.mark.parametrize("page", _RUNNABLE_PAGES)
def test_runnable_examples(page):
    """A page's runnable blocks, in order, in one namespace (as a reader would run them)."""
    result = _run_page(page)
    if "fail" in result:
        pytest.fail(f"docs/{page}:\n{result['error']}", pytrace=False)


def _quickstart(page: Path) -> str:
    """The first runnable block after a page's `## Quickstart` heading."""
    text = page.read_text()
    offset = text[: text.index("## Quickstart")].count("\n") + 1
    return next(body for line, body in _runnable_blocks(page) if line > offset)


def test_readme_and_site_share_one_quickstart():
    assert _quickstart(ROOT / "README.md") == _quickstart(DOCS / "index.md"), (
        "README.md and docs/index.md must show the same quickstart: copy one onto the other."
    )


def _table_rows(text: str) -> list[str]:
    """The rows of every Markdown table in `text` (header and separator included)."""
    return [line.rstrip() for line in text.splitlines() if line.startswith("|")]


def test_readme_figures_are_the_benchmarks_pages():
    # The README's benchmark figures come from the run the benchmarks page reports: every
    # table row under its "## Benchmarks" heading stands on the page as it is, so a page
    # measured again cannot leave the README behind.
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("## Benchmarks") :]
    section = section[: section.find("\n## ", 1) if "\n## " in section[1:] else len(section)]
    rows = _table_rows(section)
    assert rows, "the README's benchmarks section shows the page's peer table"
    page = set(_table_rows((DOCS / "benchmarks.md").read_text()))
    stale = [row for row in rows if row not in page]
    assert not stale, (
        "README.md's benchmark rows must be the benchmarks page's (copy them from "
        f"docs/benchmarks.md): not on the page: {stale}"
    )


def test_readme_and_front_page_run_as_written():
    # In a fresh process, with no XLA flags of ours: the quickstart sets its own, for 4
    # simulated devices, before it imports jax. The check appended after it makes sure it did.
    # The front page begins with the README's blocks; its own blocks run on after them, as a
    # reader of the site runs them (the quickstart's 4 devices).
    readme = [body for _, body in _runnable_blocks(ROOT / "README.md")]
    front = [body for _, body in _runnable_blocks(DOCS / "index.md")]
    assert front[: len(readme)] == readme, (
        "docs/index.md must begin with README.md's runnable blocks (they run once, here): "
        "copy them onto it."
    )
    code = "\n".join(readme)
    flag = code.find("--xla_force_host_platform_device_count=4")
    assert 0 <= flag < code.find("import jax"), "the quickstart must set XLA_FLAGS first"
    code += "\nassert jax.device_count() == 4, jax.devices()\n"
    code += "\n".join(front[len(readme) :])
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    env["JAX_PLATFORMS"] = "cpu"
    result = _stall.run([sys.executable, "-c", code], env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "max error" in result.stdout, "the quickstart prints what it checks"


def test_dir_shows_only_the_api():
    # What `dir(deltanet_cp)` shows a user, in a fresh interpreter (pytest's jaxtyping import
    # hook adds names of its own here): the documented names, the public subpackages, and
    # nothing imported along the way (`importlib`, `jax`, ...).
    code = (
        "import json, types, deltanet_cp as d; print(json.dumps([(n, isinstance(getattr(d, n), "
        "types.ModuleType) and getattr(d, n).__name__ == 'deltanet_cp.' + n) for n in dir(d)]))"
    )
    result = _stall.run([sys.executable, "-c", code], cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    documented = {d.name for d in _directives()}
    stray = [
        n
        for n, submodule in json.loads(result.stdout.splitlines()[-1])
        if not n.startswith("_") and not submodule and f"deltanet_cp.{n}" not in documented
    ]
    assert not stray, f"names in dir(deltanet_cp) that are not documented API: {stray}"
