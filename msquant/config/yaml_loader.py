"""Safe YAML loading that refuses duplicate keys and hostile documents.

PyYAML's ``safe_load`` silently keeps the last of two equal keys; in a quantization config that hides
typos and merge accidents, so we reject them with the line number of the second occurrence. Keys
brought in by a merge key (``<<: *base``) may be overridden, as YAML defines.

A small file can still describe a huge value: aliases share one node many times ("billion laughs":
nine levels of nine aliases make 387 million strings once expanded, as the config hash and the
schema validation do), and deep nesting exhausts Python's recursion. A document is refused when it
nests deeper than :data:`MAX_DEPTH`, holds more than :data:`MAX_NODES` values with its aliases
expanded, or refers to itself.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from msquant.errors import ConfigError, ConfigIssue

__all__ = ["load_yaml_file", "load_yaml_text"]

MAX_CONFIG_BYTES = 4 * 1024 * 1024
#: Deepest nesting of mappings and lists accepted (real configs nest about 6 deep).
MAX_DEPTH = 64
#: Most values (mappings, lists and scalars, aliases expanded) a document may hold.
MAX_NODES = 1_000_000
_MERGE_TAG = "tag:yaml.org,2002:merge"


class _UniqueKeySafeLoader(yaml.SafeLoader):
    """SafeLoader whose mappings raise on a repeated key."""


def _construct_unique_mapping(
    loader: _UniqueKeySafeLoader, node: yaml.MappingNode
) -> dict[Any, Any]:
    seen: dict[Any, int] = {}
    for key_node, _ in node.value:
        if key_node.tag == _MERGE_TAG:  # merged keys may be overridden by the mapping's own
            continue
        key = loader.construct_object(key_node, deep=True)
        try:
            hash(key)
        except TypeError:
            continue  # construct_mapping reports the unhashable key
        if key in seen:
            raise yaml.constructor.ConstructorError(
                "while constructing a mapping",
                node.start_mark,
                f"found duplicate key {key!r} (first defined on line {seen[key] + 1})",
                key_node.start_mark,
            )
        seen[key] = key_node.start_mark.line
    loader.flatten_mapping(node)
    return loader.construct_mapping(node, deep=True)


_UniqueKeySafeLoader.add_constructor(
    yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG,
    _construct_unique_mapping,
)


def load_yaml_text(text: str, source: str = "<string>") -> Any:
    """Parse YAML text with the safe loader, rejecting duplicate keys.

    :param text: the YAML document.
    :param source: a name for the document used in error messages (usually the file path).
    :raises ConfigError: on a syntax error or a duplicate key.
    """
    try:
        data = yaml.load(text, Loader=_UniqueKeySafeLoader)  # noqa: S506 - SafeLoader subclass
    except yaml.YAMLError as exc:
        detail = " ".join(str(exc).split())
        raise ConfigError([ConfigIssue("", f"not valid YAML: {detail}")], source) from exc
    except RecursionError:
        raise ConfigError([ConfigIssue("", _too_deep())], source) from None
    problem = _size_problem(data)
    if problem is not None:
        raise ConfigError([ConfigIssue("", problem)], source)
    return data


def _too_deep() -> str:
    return (
        f"the document nests mappings or lists more than {MAX_DEPTH} levels deep; a config "
        "nests about 6 levels: check the brackets"
    )


class _TooLarge(Exception):
    def __init__(self, problem: str) -> None:
        super().__init__(problem)
        self.problem = problem


def _size_problem(data: Any) -> str | None:
    """Why ``data`` is too deep, too large with its aliases expanded, or recursive; None if not.

    Shared nodes (aliases) are counted once per use but visited once (memoized), so the count
    costs the size of the document, not of its expansion.
    """
    sizes: dict[int, int] = {}
    active: set[int] = set()

    def size(value: Any, depth: int) -> int:
        if not isinstance(value, dict | list):
            return 1
        key = id(value)
        if key in sizes:
            return sizes[key]
        if depth > MAX_DEPTH:
            raise _TooLarge(_too_deep())
        if key in active:
            raise _TooLarge("the document refers to itself (a recursive alias); write it out")
        active.add(key)
        children = [*value.keys(), *value.values()] if isinstance(value, dict) else value
        total = 1
        for child in children:
            total += size(child, depth + 1)
            if total > MAX_NODES:
                raise _TooLarge(
                    f"the document holds more than {MAX_NODES} values once its aliases (*name) "
                    "are expanded; a config needs far fewer: remove the aliases that multiply "
                    "its size"
                )
        active.discard(key)
        sizes[key] = total
        return total

    try:
        size(data, 0)
    except _TooLarge as too_large:
        return too_large.problem
    return None


def load_yaml_file(path: str | Path) -> Any:
    """Read and parse a YAML config file.

    :raises ConfigError: if the file is missing, unreadable, too large, or not valid YAML.
    """
    file = Path(path)
    if not file.is_file():
        what = "is a directory" if file.is_dir() else "does not exist"
        raise ConfigError([ConfigIssue("", f"config file {what}; pass a .yaml file")], str(file))
    if file.stat().st_size > MAX_CONFIG_BYTES:
        raise ConfigError(
            [ConfigIssue("", f"config file is larger than {MAX_CONFIG_BYTES} bytes")], str(file)
        )
    try:
        text = file.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError([ConfigIssue("", f"cannot read config file: {exc}")], str(file)) from exc
    return load_yaml_text(text, str(file))
