"""Safe YAML loading that refuses duplicate keys.

PyYAML's ``safe_load`` silently keeps the last of two equal keys; in a quantization config that hides
typos and merge accidents, so we reject them with the line number of the second occurrence.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from msquant.errors import ConfigError, ConfigIssue

__all__ = ["load_yaml_file", "load_yaml_text"]

MAX_CONFIG_BYTES = 4 * 1024 * 1024


class _UniqueKeySafeLoader(yaml.SafeLoader):
    """SafeLoader whose mappings raise on a repeated key."""


def _construct_unique_mapping(
    loader: _UniqueKeySafeLoader, node: yaml.MappingNode
) -> dict[Any, Any]:
    loader.flatten_mapping(node)
    seen: dict[Any, int] = {}
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=True)
        if key in seen:
            raise yaml.constructor.ConstructorError(
                "while constructing a mapping",
                node.start_mark,
                f"found duplicate key {key!r} (first defined on line {seen[key] + 1})",
                key_node.start_mark,
            )
        seen[key] = key_node.start_mark.line
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
        return yaml.load(text, Loader=_UniqueKeySafeLoader)  # noqa: S506 - SafeLoader subclass
    except yaml.YAMLError as exc:
        detail = " ".join(str(exc).split())
        raise ConfigError([ConfigIssue("", f"not valid YAML: {detail}")], source) from exc


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
