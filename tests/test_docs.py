"""The documentation stays in sync with the code: generated reference, examples, flags, links."""

from __future__ import annotations

import argparse
import importlib.util
import re
import sys
from pathlib import Path
from types import ModuleType

import pytest

from msquant.cli.parser import build_parser

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs"
EXAMPLES = REPO / "yaml_examples"
GENERATOR = REPO / "scripts" / "gen_yaml_reference.py"

# In docs/examples.md each example is introduced by this marker line, followed by its YAML block.
EXAMPLE_BLOCK = re.compile(r"^File: `yaml_examples/([^`]+)`\n.*?^```yaml\n(.*?)^```$", re.M | re.S)
MARKDOWN_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _load_generator() -> ModuleType:
    """Import scripts/gen_yaml_reference.py as a module (scripts/ is not a package)."""
    name = "gen_yaml_reference"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, GENERATOR)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses resolve annotations through sys.modules
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]  # a failed import is not cached: the next test shows its own error
        raise
    return module


def test_yaml_reference_is_up_to_date() -> None:
    """docs/yaml-reference.md equals what the generator produces from the current schema."""
    assert _load_generator().main(["--check"]) == 0, (
        "docs/yaml-reference.md is out of date; run: python scripts/gen_yaml_reference.py"
    )


def test_generator_check_detects_stale_and_missing_files(tmp_path: Path) -> None:
    generator = _load_generator()
    target = tmp_path / "reference.md"
    assert generator.main(["--check", "--output", str(target)]) == 1
    assert generator.main(["--output", str(target)]) == 0
    assert generator.main(["--check", "--output", str(target)]) == 0
    target.write_text(target.read_text(encoding="utf-8") + "edited by hand\n", encoding="utf-8")
    assert generator.main(["--check", "--output", str(target)]) == 1


def test_yaml_reference_documents_every_method_and_processor() -> None:
    import msquant
    import msquant.plugin

    text = (DOCS / "yaml-reference.md").read_text(encoding="utf-8")
    registry = msquant.plugin.default_registry()
    for name in registry.names():
        if registry.get(name).__module__.startswith("msquant."):
            assert f"type: {name}`" in text, name
    methods = msquant.plugin.default_method_registry()
    for method in map(methods.get, methods.names()):
        assert f"`method: {method.name}`" in text, method.name
        for option in method.options_class.model_fields:
            assert f"| `{option}` |" in text, f"{method.name}.{option}"


def test_every_example_is_in_the_docs_verbatim() -> None:
    """Each yaml_examples/*.yaml appears in docs/examples.md, and the shown text is the file's."""
    shown = {
        name: body
        for name, body in EXAMPLE_BLOCK.findall((DOCS / "examples.md").read_text(encoding="utf-8"))
    }
    files = {path.name: path for path in sorted(EXAMPLES.glob("*.yaml"))}
    assert files, "no yaml_examples found"
    assert sorted(shown) == sorted(files), (
        "docs/examples.md and yaml_examples/ list different files"
    )
    for name, path in files.items():
        assert shown[name] == path.read_text(encoding="utf-8"), (
            f"the copy of {name} in docs/examples.md differs from yaml_examples/{name}"
        )


def _options(parser: argparse.ArgumentParser) -> set[str]:
    found: set[str] = set()
    for action in parser._actions:  # argparse has no public accessor for its actions
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                found |= _options(sub)
        found |= {s for s in action.option_strings if s.startswith("--") and s != "--help"}
    return found


def test_cli_page_documents_every_flag() -> None:
    text = (DOCS / "cli.md").read_text(encoding="utf-8")
    parser = build_parser()
    missing = sorted(flag for flag in _options(parser) if f"`{flag}" not in text)
    assert not missing, f"docs/cli.md does not document {missing}"
    subcommands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for name in subcommands.choices:
        assert f"## `msquant {name}`" in text, name


def _slug(heading: str) -> str:
    """GitHub's anchor for a Markdown heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    text = page.read_text(encoding="utf-8")
    explicit = set(re.findall(r'<a id="([^"]+)"></a>', text))
    headings = {_slug(h) for h in re.findall(r"^#{1,6} (.+)$", text, re.M)}
    return explicit | headings


@pytest.mark.parametrize("page", sorted(DOCS.rglob("*.md")), ids=lambda p: str(p.relative_to(DOCS)))
def test_relative_links_resolve(page: Path) -> None:
    """Links between doc pages point at existing files and, when they name one, existing anchors."""
    text = re.sub(r"^```.*?^```$", "", page.read_text(encoding="utf-8"), flags=re.M | re.S)
    for target in MARKDOWN_LINK.findall(text):
        if re.match(r"^[a-z]+:", target):  # http:, https:, mailto:
            continue
        path_part, _, anchor = target.partition("#")
        destination = (page.parent / path_part).resolve() if path_part else page
        assert destination.exists(), f"{page.name}: broken link {target}"
        if anchor and destination.suffix == ".md":
            assert anchor in _anchors(destination), f"{page.name}: no anchor #{anchor} in {target}"
