"""The README and the manual in docs/: the site builds (strict, offline), the README stays a
front door (8 KiB, links that resolve), and what the pages show is what the code does: the
cheap commands they print run, the specs they print validate, the validation example prints
what the page says, and the parameter counts and published rows are `show`'s.

The quickstart's output excerpt is checked against a real (tiny) run in test_quickstart.py.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import re
import shlex
import subprocess
import sys
from functools import cache
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from tests.fixtures.docs_pages import DOCS, PAGES, PLACEHOLDER, README, code_blocks, commands

ROOT = Path(__file__).resolve().parents[2]
README_LIMIT = 8192


# ---------------------------------------------------------------- reading the pages


CHEAP = ("validate", "show", "stages")


def runnable(command: str) -> bool:
    """A command a test can run in moments: validate, show, stages or any --help, written
    out in full (no CFG, [options] or ... placeholders)."""
    words = shlex.split(command)[1:]
    return (
        not PLACEHOLDER.search(command)
        and bool(words)
        and (words[0] in CHEAP or "--help" in words or "-h" in words)
    )


def cli_group() -> click.Group:
    """The click group behind the `allattn-pipe` console script, wherever pyproject.toml
    says it lives."""
    entry = re.search(
        r'^allattn-pipe\s*=\s*"([\w.]+):\w+"', (ROOT / "pyproject.toml").read_text(), re.M
    ).group(1)
    module = importlib.import_module(entry)
    groups = [
        v for v in vars(module).values() if isinstance(v, click.Group) and "run" in v.commands
    ]
    assert groups, f"no click group with a `run` command in {module.__name__}"
    return groups[0]


def invoke(args: list[str], cwd: Path):
    """The command in this process (one import of torch for them all), stderr apart."""
    try:
        runner = CliRunner(mix_stderr=False)  # click 8.1
    except TypeError:
        runner = CliRunner()  # click 8.2+: stderr is always apart
    old = Path.cwd()
    os.chdir(cwd)
    try:
        return runner.invoke(cli_group(), args, prog_name="allattn-pipe")
    finally:
        os.chdir(old)


def shown(result) -> str:
    return result.stdout + result.stderr


@cache
def show(config: str) -> str:
    result = invoke(["show", config], ROOT)
    assert result.exit_code == 0, shown(result)
    return result.stdout


# ---------------------------------------------------------------- the site


def test_mkdocs_builds_strict_and_offline(tmp_path):
    for module in ("mkdocs", "material"):
        if importlib.util.find_spec(module) is None:
            pytest.skip(
                f"{module} is not installed: pip install -e '.[test]' "
                f"(or pip install mkdocs mkdocs-material)"
            )
    site = tmp_path / "site"
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "mkdocs",
            "build",
            "--strict",
            "-f",
            str(ROOT / "mkdocs.yml"),
            "-d",
            str(site),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    pages = {p.stem for p in DOCS.glob("*.md")}
    built = {p.parent.name if p.parent != site else "index" for p in site.glob("**/index.html")}
    assert pages <= built, f"pages not in the site: {sorted(pages - built)}"
    # no web fonts or other remote assets: the site reads offline, the build needs no network
    for html in site.glob("**/*.html"):
        assert "fonts.googleapis" not in html.read_text(encoding="utf-8"), html


def test_every_page_is_in_the_nav():
    import yaml

    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    assert config["docs_dir"] == "docs"
    nav = {next(iter(entry.values())) for entry in config["nav"]}
    assert nav == {p.name for p in DOCS.glob("*.md")}
    assert "reference.md" in nav


# ---------------------------------------------------------------- the README


def test_readme_is_a_front_door():
    size = len(README.read_bytes())
    assert size <= README_LIMIT, f"README.md is {size:,} bytes, over {README_LIMIT:,}"
    text = README.read_text(encoding="utf-8")
    # the two set-up commands, exactly
    assert re.search(r"^    make quickstart(\s|$)", text, re.M)
    assert re.search(r"^    make test(\s|$)", text, re.M)


@pytest.mark.parametrize(
    "page",
    [README, ROOT / "launch" / "README.md"]
    + [ROOT / tools / "README.md" for tools in ("bench", "reproduce", "quality", "gpu")],
    ids=lambda p: str(p.relative_to(ROOT)),
)
def test_relative_links_resolve(page):
    text = page.read_text(encoding="utf-8")
    links = re.findall(r"\]\(([^)\s]+)\)", text)
    assert links or page != README
    for link in links:
        if re.match(r"^[a-z][a-z0-9+.-]*:", link) or link.startswith("#"):
            continue  # a URL, or an anchor of the page itself
        target = (page.parent / link.split("#")[0]).resolve()
        assert target.exists(), f"{page.name}: link {link} -> {target} does not exist"


# ---------------------------------------------------------------- what the pages show


def page_commands() -> list[tuple[str, str]]:
    return [(page.name, c) for page in PAGES for c in commands(page) if runnable(c)]


def test_the_pages_show_cheap_commands():
    shown_commands = page_commands()
    assert len(shown_commands) >= 8, shown_commands
    assert any(c.split()[1] == "validate" for _, c in shown_commands)
    assert any("--help" in c for _, c in shown_commands)


@pytest.mark.parametrize(
    "page, command", page_commands(), ids=[f"{p}: {c}" for p, c in page_commands()]
)
def test_shown_command_runs(page, command, monkeypatch):
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    result = invoke(shlex.split(command)[1:], ROOT)
    assert result.exit_code == 0, f"{page}: `{command}` exited {result.exit_code}:\n{shown(result)}"


def test_published_rows_are_what_show_prints():
    """Every `published: ...` line a page shows is printed by `show` of a paper config."""
    lines = {
        line.strip()
        for page in PAGES
        for block in code_blocks(page)
        for line in block.splitlines()
        if line.strip().startswith("published: ")
    }
    assert lines
    outputs = [show(str(cfg.relative_to(ROOT))) for cfg in sorted(ROOT.glob("configs/*.yaml"))]
    for line in lines:
        assert any(line in out for out in outputs), line


def test_parameter_counts_in_the_tables_are_shows():
    """The model-family table's counts (`38.5M / 38.3M` for `enwik8_small.yaml` /
    `text8_small.yaml`) are `show`'s counts, rounded."""
    rows = [
        line
        for page in PAGES
        for line in page.read_text(encoding="utf-8").splitlines()
        if re.match(r"^\| `configs/[^|]*\.yaml`", line)
    ]
    assert rows
    checked = 0
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        names = re.findall(r"`([^`]+\.yaml)`", cells[0])
        counts = [c.strip() for c in cells[-1].split("/")]
        assert len(names) == len(counts), row
        first = Path(names[0])
        for name, count in zip(names, counts, strict=False):
            path = ROOT / (name if "/" in name else first.parent / name)
            out = show(str(path.relative_to(ROOT)))
            n = int(re.search(r"^parameters: ([\d,]+)", out, re.M).group(1).replace(",", ""))
            assert f"{n / 1e6:.1f}M" == count, f"{name}: show counts {n:,}, the page {count}"
            checked += 1
    assert checked >= 5


def test_specs_on_the_pages_validate(tmp_path):
    """A YAML block that is a whole spec (it lists `stages:`) is a valid one. extending.md's
    names the example plugin's kinds: tests/plugins validates and runs it where that is
    installed."""
    specs = [
        (page.name, block)
        for page in PAGES
        if page.name != "extending.md"
        for block in code_blocks(page)
        if re.search(r"^stages:", block, re.M)
    ]
    assert specs
    for i, (page, block) in enumerate(specs):
        path = tmp_path / f"spec{i}.yaml"
        path.write_text(block)
        result = invoke(["validate", str(path)], ROOT)
        assert result.exit_code == 0, f"{page}: the spec\n{block}\nis refused:\n{shown(result)}"


def test_validation_example_prints_what_the_page_shows(tmp_path):
    """configs.md's bad.yaml and the errors it shows for it, exactly."""
    text = (DOCS / "configs.md").read_text(encoding="utf-8")
    spec = re.search(r"A file `bad.yaml`.*?```yaml\n(.*?)```", text, re.S).group(1)
    transcript = next(
        b
        for b in code_blocks(DOCS / "configs.md")
        if b.startswith("$ allattn-pipe validate bad.yaml")
    )
    expected = transcript.splitlines()[1:]
    (tmp_path / "bad.yaml").write_text(spec)
    (tmp_path / "configs").symlink_to(ROOT / "configs")
    result = invoke(["validate", "bad.yaml"], tmp_path)
    assert result.exit_code == 2
    assert result.stderr.splitlines() == expected


def cli_commands(group: click.Group, prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    out = []
    for name, command in sorted(group.commands.items()):
        if command.hidden:
            continue
        out.append(prefix + (name,))
        if isinstance(command, click.Group):
            out += cli_commands(command, prefix + (name,))
    return out


def test_readme_lists_every_command_and_each_has_help():
    """The README's command list is the CLI's: every command is there, and its --help runs."""
    text = README.read_text(encoding="utf-8")
    found = cli_commands(cli_group())
    assert len(found) >= 10
    for path in found:
        if not isinstance(cli_group().commands[path[0]], click.Group) or len(path) > 1:
            assert re.search(rf"^    allattn-pipe {' '.join(path)}(\s|$)", text, re.M), (
                f"README's commands lack {' '.join(path)}"
            )
        result = invoke([*path, "--help"], ROOT)
        assert result.exit_code == 0, shown(result)
        assert "Usage: allattn-pipe" in result.stdout


# ---------------------------------------------------------------- the pictures

IMAGES = DOCS / "img"
IMAGE = re.compile(r"!\[[^\]]*\]\(([^)\s]+)\)")
MAKER = re.compile(r"python -m \w|allattn-pipe \w")
MAKER_LINES = 4
"""A picture's page names the command that makes it within this many lines of it."""
PICTURE_LIMIT = 150 * 1024

PICTURES = {
    "allattn_layer.png": "models.md",
    "stages.png": "design.md",
    "quickstart_curves.png": "tracking.md",
    "quickstart_spans.png": "tracking.md",
    "quickstart_persistent_share.png": "tracking.md",
}
"""The pictures issue 37 asked for, each on the page that describes what it shows."""


def embedded_images() -> list[tuple[Path, int, str]]:
    """(page, line index, target) of every `![...](...)` image on the pages."""
    return [
        (page, i, target)
        for page in PAGES
        for i, line in enumerate(page.read_text(encoding="utf-8").splitlines())
        for target in IMAGE.findall(line)
    ]


def test_every_embedded_image_is_a_file_in_docs_img():
    found = embedded_images()
    assert found
    for page, i, target in found:
        where = f"{page.name}:{i + 1}: {target}"
        # the site builds and reads offline: no picture from the web
        assert not re.match(r"^[a-z][a-z0-9+.-]*:", target), f"{where} is not a local file"
        path = (page.parent / target).resolve()
        assert path.parent == IMAGES.resolve(), f"{where} is not in docs/img"
        assert path.is_file(), f"{where} does not exist"


def test_every_picture_in_docs_img_is_shown_with_the_command_that_makes_it():
    shown_at = embedded_images()
    pictures = sorted(p for p in IMAGES.iterdir() if not p.name.startswith("."))
    assert pictures
    for picture in pictures:
        assert picture.stat().st_size <= PICTURE_LIMIT, (
            f"docs/img/{picture.name} is {picture.stat().st_size:,} bytes, over {PICTURE_LIMIT:,}"
        )
        places = [(page, i) for page, i, target in shown_at if Path(target).name == picture.name]
        assert places, f"docs/img/{picture.name} is shown on no page"
        for page, i in places:
            lines = page.read_text(encoding="utf-8").splitlines()
            near = lines[max(0, i - MAKER_LINES) : i + MAKER_LINES + 1]
            assert any(MAKER.search(line) for line in near), (
                f"{page.name}:{i + 1}: docs/img/{picture.name} is shown with no command that "
                f"makes it (`python -m ...` or `allattn-pipe ...`) within {MAKER_LINES} lines"
            )


@pytest.mark.parametrize("picture, page", sorted(PICTURES.items()))
def test_the_asked_for_pictures_are_on_their_pages(picture, page):
    pages = {p.name for p, _, target in embedded_images() if Path(target).name == picture}
    assert page in pages, f"docs/img/{picture} is not shown on {page} (shown on {sorted(pages)})"


def test_the_diagrams_command_writes_every_diagram(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "reproduce.diagrams", "--out", str(tmp_path / "img")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    written = sorted((tmp_path / "img").iterdir())
    assert [p.name for p in written] == ["allattn_layer.png", "stages.png"]
    for path in written:
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", path.name
        assert 0 < path.stat().st_size <= PICTURE_LIMIT, path.name
        assert path.name in done.stdout


def test_the_stages_diagram_names_what_the_stages_write():
    """Every file and directory the diagram shows under a stage is a name in that stage's
    module (or a stages module it imports from: finetune shares train's)."""
    from reproduce.diagrams import STAGE_OUTPUTS

    for stage, outputs in STAGE_OUTPUTS.items():
        module = ROOT / "stages" / f"{stage}.py"
        source = module.read_text(encoding="utf-8")
        for imported in re.findall(r"^from stages\.(\w+) import", source, re.M):
            source += (ROOT / "stages" / f"{imported}.py").read_text(encoding="utf-8")
        # the directories (`files/`; not `step-N/`, the trainer's) and the files
        names = [n for text in outputs for n in re.findall(r"(?<![\w-])(\w+)/", text)]
        names += [n for text in outputs for n in re.findall(r"\b(\w+\.(?:json|png))\b", text)]
        assert names, stage
        for name in names:
            assert name.removesuffix(".json").removesuffix(".png") in source, (
                f"the diagram shows {stage}/{name}, which stages/{stage}.py never names"
            )
