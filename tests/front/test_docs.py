"""The docs run as written: every code block docs/ marks as runnable runs, as a stranger would
run it, in an empty folder against the installed package (the README's, against the installed
wheel: tests/front/test_wheel.py); the output the docs show is what it prints; and the front page
stays a front page (short, no dated measurement log, every docs page in its contents list, no
broken link).

The markers (docs/writing-docs.md): ``<!-- run: FILE.py -->`` before a ``python`` block writes it
as FILE.py and runs ``python FILE.py``; ``<!-- run -->`` before a ``sh`` block runs it with bash;
``, exit N`` expects exit status N (default 0); ``<!-- output -->`` before a block holds lines the
previous run must print, in order, ``...`` standing for any text. The blocks of one page run in
order in one folder, so a shell block can run the script a python block wrote.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# The front page answers what a stranger asks first (what is checked, what cannot be judged, what
# to do when it is slow, how it compares); every reference table lives in docs/.
FRONT_PAGE_LINES = 260

FENCE = re.compile(r"^```(\w*)\n(.*?)^```\n", re.S | re.M)
MARKER = re.compile(r"<!--\s*(run|output)\b(.*?)-->\s*\Z", re.S)
RUN_ARGS = re.compile(r"^(?::\s*(?P<file>[\w.-]+\.py)?)?\s*(?:,?\s*exit\s+(?P<exit>\d+))?\s*$")


@dataclasses.dataclass
class Block:
    page: str
    line: int
    kind: str  # "run" or "output"
    lang: str
    code: str
    file: str | None = None
    exit: int = 0


def _blocks(page: pathlib.Path) -> list[Block]:
    """The marked blocks of a page, in order; a marker that marks nothing is an error."""
    text = page.read_text()
    name = page.name if page.parent == ROOT else f"{page.parent.name}/{page.name}"
    blocks = []
    marked = set()
    for fence in FENCE.finditer(text):
        before = text[: fence.start()].rstrip() + "\n"
        last = before.rstrip().rsplit("\n", 1)[-1]
        marker = MARKER.search(last)
        if marker is None:
            continue
        line = text.count("\n", 0, fence.start()) + 1
        marked.add(line - 1)
        kind, args = marker.group(1), marker.group(2).strip()
        block = Block(name, line, kind, fence.group(1), fence.group(2))
        if kind == "run":
            parsed = RUN_ARGS.match(args)
            assert parsed, f"{name}:{line}: cannot read the marker <!-- run{args} -->"
            block.file = parsed.group("file")
            block.exit = int(parsed.group("exit") or 0)
            if block.lang == "python":
                assert block.file, f"{name}:{line}: a python block needs a file: <!-- run: X.py -->"
            else:
                assert block.lang in ("sh", "bash", "shell"), (
                    f"{name}:{line}: only python and sh blocks run, not {block.lang!r}"
                )
                assert block.file is None, f"{name}:{line}: a shell block takes no file name"
        else:
            assert blocks and blocks[-1].kind == "run", (
                f"{name}:{line}: <!-- output --> must follow a run block"
            )
        blocks.append(block)
    for number, line_text in enumerate(text.splitlines(), 1):
        if re.match(r"\s*<!--\s*(run|output)\b", line_text):
            assert number in marked or number + 1 in marked, (
                f"{name}:{number}: this marker is not right before a fenced block"
            )
    return blocks


def _runnable_pages() -> list[pathlib.Path]:
    """The docs pages with blocks to run here; the README's run from the installed wheel
    instead (tests/front/test_wheel.py), as a stranger follows it."""
    return [page for page in PAGES[1:] if any(b.kind == "run" for b in _blocks(page))]


def _squeeze(line: str) -> str:
    return " ".join(line.split())


def _pattern(shown: str) -> re.Pattern:
    return re.compile(".*".join(re.escape(part) for part in _squeeze(shown).split("...")))


def assert_prints(shown: str, actual: str, where: str) -> None:
    """Every shown line (but blank ones and ``...``) matches a line of ``actual``, in order;
    whitespace runs are alike, ``...`` inside a line stands for any text."""
    lines = [_squeeze(line) for line in actual.splitlines()]
    at = 0
    for wanted in shown.splitlines():
        if _squeeze(wanted) in ("", "..."):
            continue
        pattern = _pattern(wanted)
        for i in range(at, len(lines)):
            if pattern.fullmatch(lines[i]):
                at = i + 1
                break
        else:
            raise AssertionError(
                f"{where}: the docs show\n    {wanted.strip()}\nbut the run "
                f"printed (from line {at + 1} on):\n{actual}"
            )


def _environment() -> dict[str, str]:
    """The installed package's interpreter and commands first on PATH; nothing of the checkout."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "PYTEST_"))}
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    return env


@pytest.mark.slow
@pytest.mark.parametrize("page", _runnable_pages(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_the_marked_blocks_of_a_page_run_as_written(page, tmp_path):
    env = _environment()
    last = None
    for block in _blocks(page):
        where = f"{block.page}:{block.line}"
        if block.kind == "output":
            assert_prints(block.code, last, where)
            continue
        if block.lang == "python":
            (tmp_path / block.file).write_text(block.code)
            argv = ["python", block.file]
        else:
            argv = ["bash", "-e", "-o", "pipefail", "-c", block.code]
        done = subprocess.run(
            argv,
            cwd=tmp_path,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            timeout=600,
        )
        last = done.stdout
        assert done.returncode == block.exit, (
            f"{where}: exit status {done.returncode}, the docs say {block.exit}:\n{last}"
        )


def test_the_doc_block_test_reads_the_markers_and_compares_loosely(tmp_path):
    page = tmp_path / "page.md"
    page.write_text(
        "<!-- run: a.py, exit 3 -->\n```python\nraise SystemExit(3)\n```\n\n"
        "<!-- output -->\n```\nx\n```\n\n<!-- run -->\n```sh\necho hi\n```\n"
        "```python\nnot run\n```\n"
    )
    blocks = _blocks(page)
    page.write_text("<!-- run: a.py -->\n\nsome text\n```python\npass\n```\n")
    with pytest.raises(AssertionError, match="not right before a fenced block"):
        _blocks(page)
    assert [(b.kind, b.lang, b.file, b.exit) for b in blocks] == [
        ("run", "python", "a.py", 3),
        ("output", "", None, 0),
        ("run", "sh", None, 0),
    ]
    printed = "10 examples equivalent in 9.01 s\nnoise\nstep  W  rank\n0     2  0     fc1.weight\n"
    assert_prints(
        "10 examples equivalent in ... s\n...\nstep W rank\n0 2 0 fc1.weight", printed, "here"
    )
    with pytest.raises(AssertionError, match="the docs show"):
        assert_prints("step W rank\n10 examples equivalent in ... s", printed, "here")  # order
    with pytest.raises(AssertionError, match="the docs show"):
        assert_prints("0 2 0 fc2.weight", printed, "here")


def test_the_front_page_is_short_and_no_measurement_log():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= FRONT_PAGE_LINES, (
        f"README.md has {len(text.splitlines())} lines; the front page keeps to "
        f"{FRONT_PAGE_LINES}: move reference material to a docs/ page (docs/writing-docs.md)"
    )
    dated = re.findall(r"\b20\d\d-\d\d-\d\d\b", text)
    assert not dated, f"dated measurements belong in docs/figures.md, not the README: {dated}"


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_every_docs_page_is_in_the_contents_and_every_link_resolves():
    readme = (ROOT / "README.md").read_text()
    contents = re.search(r"<!-- contents.*?-->(.*?)<!-- /contents -->", readme, re.S)
    assert contents, "README.md has no <!-- contents --> list"
    listed = set(re.findall(r"\]\((docs/[^)#]+\.md)\)", contents.group(1)))
    pages = {p.relative_to(ROOT).as_posix() for p in (ROOT / "docs").glob("*.md")}
    assert pages - listed == set(), (
        f"docs pages missing from the README's contents list: {sorted(pages - listed)}"
    )
    broken = []
    for page in PAGES:
        text = re.sub(r"`[^`\n]*`", "", FENCE.sub("", page.read_text()))  # code is no link
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"\w+://", target):
                continue
            path, _, anchor = target.partition("#")
            file = (page.parent / path).resolve() if path else page
            if not file.exists():
                broken.append(f"{page.name}: {target}")
            elif anchor and file.suffix == ".md":
                headings = re.findall(r"^#+ (.*)$", file.read_text(), re.M)
                if anchor not in {_slug(h) for h in headings}:
                    broken.append(f"{page.name}: {target} (no such heading)")
    assert not broken, broken


#: Pages for maintainers, which map the private floors on purpose (docs/architecture.md).
MAINTAINERS = {"architecture.md"}


@pytest.mark.parametrize(
    "page", [p for p in PAGES if p.name not in MAINTAINERS], ids=lambda p: p.name
)
def test_a_users_page_names_only_public_names(page):
    # What a user may import is public; a private floor (ddpcheck._runs...) can move any day.
    private = re.findall(r"\bddpcheck\._(?!_)\w+[\w.]*", page.read_text())
    assert not private, f"{page.name} names private modules: {sorted(set(private))}"
