"""The README and docs/ do not rot: their commands parse, the scripts and links they name exist, their Python compiles,
and the README's test command is the one CI runs."""

import re
import shlex
import subprocess
from pathlib import Path

import pytest

from hf_normswap.cli import build_parser


ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").rglob("*.md"))]
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.DOTALL | re.MULTILINE)
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
COMMANDS = ("convert", "heal", "compare", "push", "export-native")


def blocks(page: Path, language: str) -> list[str]:
    return [body for kind, body in FENCE.findall(page.read_text()) if kind == language]


def shell_commands(page: Path) -> list[list[str]]:
    """The commands of a page's bash blocks, as argument lists: `\\` continues a line, `&&` starts a command."""
    commands = []
    for body in blocks(page, "bash"):
        for line in body.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            while "&&" in words:
                commands.append(words[: words.index("&&")])
                words = words[words.index("&&") + 1 :]
            commands.append(words)
    return [words for words in commands if words]


def cases(select) -> list:
    """One test case per (item, label) that `select` finds in a page, named by the page and the label."""
    return [
        pytest.param(item, id=f"{page.relative_to(ROOT)}: {label}") for page in PAGES for item, label in select(page)
    ]


def cli_commands(page: Path):
    """The `hf-normswap ...` commands."""
    return [(words, shlex.join(words)) for words in shell_commands(page) if words[0] == "hf-normswap"]


def scripts(page: Path):
    """The scripts a command runs (`python scripts/NAME.py`, `torchrun ... scripts/NAME.py`)."""
    named = {word for words in shell_commands(page) for word in words if word.startswith("scripts/")}
    return [(name, name) for name in sorted(named)]


def bash_blocks(page: Path):
    return [(body, f"bash block {number}") for number, body in enumerate(blocks(page, "bash"), 1)]


def python_blocks(page: Path):
    return [(body, f"python block {number}") for number, body in enumerate(blocks(page, "python"), 1)]


def links(page: Path):
    """The relative links and images, outside code blocks."""
    text = FENCE.sub("", page.read_text())
    targets = {target for target in LINK.findall(text) if not re.match(r"[a-z]+:", target)}
    return [((page, target), target) for target in sorted(targets)]


def anchors(page: Path) -> set[str]:
    """The `#fragment`s of a page's headings, as GitHub writes them."""
    headings = re.findall(r"^#+ (.+)$", FENCE.sub("", page.read_text()), re.MULTILINE)
    return {re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-") for heading in headings}


@pytest.mark.parametrize("words", cases(cli_commands))
def test_command_parses(words, capsys):
    try:
        build_parser().parse_args(words[1:])
    except SystemExit:
        pytest.fail(f"{shlex.join(words)}: {capsys.readouterr().err.strip()}", pytrace=False)


@pytest.mark.parametrize("name", cases(scripts))
def test_script_exists(name):
    assert (ROOT / name).is_file(), f"{name} does not exist"


@pytest.mark.parametrize("source", cases(bash_blocks))
def test_bash_block_is_valid_bash(source):
    """What a reader pastes parses (`bash -n`), and no line ends in an escaped backslash (which bash reads as a
    backslash, then the next line as a command of its own)."""
    checked = subprocess.run(["bash", "-n"], input=source, capture_output=True, text=True)
    assert checked.returncode == 0, checked.stderr
    assert not re.search(r"\\\\\n", source), "a line ends in \\\\, not \\"


@pytest.mark.parametrize("source", cases(python_blocks))
def test_python_block_compiles(source):
    compile(source, "<docs>", "exec")


@pytest.mark.parametrize("link", cases(links))
def test_link_resolves(link):
    page, target = link
    path, _, fragment = target.partition("#")
    destination = (page.parent / path).resolve() if path else page
    assert destination.is_file(), f"{page.relative_to(ROOT)}: {target} points at no file"
    if fragment and destination.suffix == ".md":
        assert fragment in anchors(destination), f"{page.relative_to(ROOT)}: no heading for #{fragment}"


def test_readme_test_command_is_what_ci_runs():
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    test = next(line for line in ci if line.startswith("python -m pytest"))
    install = next(shlex.split(line) for line in ci if "pip install" in line and " -e " in line)
    extras = install[install.index("-e") + 1]
    assert f'pip install -e "{extras}" && {test}' in README.read_text().splitlines()


def test_readme_shows_every_command_and_stays_short():
    shown = {words[1] for words in shell_commands(README) if words[0] == "hf-normswap" and len(words) > 1}
    assert set(COMMANDS) <= shown
    assert len(README.read_text().splitlines()) < 200


@pytest.mark.parametrize("page", PAGES, ids=lambda page: str(page.relative_to(ROOT)))
def test_docs_table_rows_stay_under_200_characters(page):
    long = [
        number for number, line in enumerate(page.read_text().splitlines(), 1) if line[:1] == "|" and len(line) > 200
    ]
    assert not long, f"{page.relative_to(ROOT)}: table rows over 200 characters at lines {long}"
