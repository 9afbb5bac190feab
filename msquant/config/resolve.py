"""A config given in any of the forms the API accepts, validated against the installed processors.

:func:`resolve_config` is the first step of every command that takes a config (``quantize``,
``plan``): it keeps the YAML text (the report records it) and the file's folder (a relative
``spec.dataset`` is read from there).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from msquant.config.spec import QuantConfig, validate_config
from msquant.config.yaml_loader import load_yaml_file
from msquant.contracts.registry import ProcessorRegistry

__all__ = ["ConfigLike", "ResolvedConfig", "resolve_config"]

#: What the API takes as a config: a YAML file path, a parsed mapping or a :class:`QuantConfig`.
ConfigLike = str | Path | Mapping[str, Any] | QuantConfig


@dataclass(frozen=True)
class ResolvedConfig:
    """A validated config and where it came from.

    :param config: the validated config.
    :param text: the YAML text, when the config came from a file.
    :param directory: the file's folder, when it came from a file.
    """

    config: QuantConfig
    text: str | None
    directory: Path | None


def resolve_config(config: ConfigLike, registry: ProcessorRegistry) -> ResolvedConfig:
    """Validate a config given as a YAML path, a parsed mapping, or a :class:`QuantConfig`."""
    if isinstance(config, QuantConfig):
        return ResolvedConfig(validate_config(config.model_dump(mode="json"), registry), None, None)
    if isinstance(config, Mapping):
        return ResolvedConfig(validate_config(dict(config), registry, "<mapping>"), None, None)
    path = Path(config)
    data = load_yaml_file(path)  # reports a missing, unreadable or malformed file
    text = path.read_text(encoding="utf-8")
    return ResolvedConfig(validate_config(data, registry, str(path)), text, path.parent)
