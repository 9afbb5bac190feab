"""Processor registry: YAML ``type`` name -> processor class.

Built-in processors and third-party plugins are found the same way, through the entry-point group
``msquant.processors`` (``name = "package.module:ProcessorClass"``); classes can also be registered
explicitly on a registry instance. The engine never imports a concrete processor. A broken plugin
is set aside (:mod:`msquant.registry_base`): only a config that names it is refused.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Literal, get_args, get_origin

from msquant.contracts.processor import Processor, ProcessorConfig, Stage
from msquant.errors import RegistryError
from msquant.registry_base import (
    PluginError,
    PluginProblem,
    claim,
    plugin_classes,
    register_plugins,
)

__all__ = ["ENTRY_POINT_GROUP", "ProcessorRegistry", "default_registry"]

#: The entry-point group processors are registered in (``name = "package.module:Class"``).
ENTRY_POINT_GROUP = "msquant.processors"
logger = logging.getLogger(__name__)


class ProcessorRegistry:
    """A mapping from processor type names to processor classes, with strict registration rules."""

    def __init__(self, processors: Iterable[type[Processor]] = ()) -> None:
        self._classes: dict[str, type[Processor]] = {}
        self._problems: dict[str, PluginProblem] = {}
        for cls in processors:
            self.register(cls)

    def register(self, cls: type[Processor], name: str | None = None) -> type[Processor]:
        """Register ``cls`` under ``name`` (default: ``cls.type_name``); usable as a decorator.

        :raises RegistryError: when the class is malformed or the name is already taken by another class.
        """
        _check_processor_class(cls)
        key = name or cls.type_name
        if key != cls.type_name:
            raise RegistryError(
                f"processor {cls.__module__}.{cls.__qualname__} declares type_name "
                f"{cls.type_name!r} but is registered as {key!r}; the two must be equal"
            )
        return claim(self._classes, key, cls, "processor type")

    def load_entry_points(self, group: str = ENTRY_POINT_GROUP) -> ProcessorRegistry:
        """Register every processor advertised in the entry-point ``group``; returns ``self``.
        A plugin that cannot be registered is set aside: :meth:`get` refuses its name."""
        found, problems = plugin_classes(group, Processor, "processor")
        self._problems.update(
            register_plugins(
                group,
                found,
                problems,
                lambda ep, cls: self.register(cls, ep.name),
                lambda name: self._classes.pop(name, None),
                "processor",
            )
        )
        return self

    def problem(self, name: str) -> PluginProblem | None:
        """Why the plugin registered as ``name`` was set aside, or None."""
        return self._problems.get(name)

    def get(self, name: str) -> type[Processor]:
        """The class registered as ``name``.

        :raises PluginError: when the plugin of that name was set aside (broken, or its name
            claimed twice).
        :raises KeyError: listing the registered names when ``name`` is unknown.
        """
        if name in self._problems:
            raise PluginError(self._problems[name])
        try:
            return self._classes[name]
        except KeyError:
            known = ", ".join(sorted(self._classes)) or "(none)"
            raise KeyError(f"unknown processor type {name!r}; registered types: {known}") from None

    def names(self, stage: Stage | None = None) -> list[str]:
        """Sorted registered names, optionally only those of one stage."""
        return sorted(n for n, c in self._classes.items() if stage is None or c.stage == stage)

    def config_classes(self, stage: Stage) -> list[type[ProcessorConfig]]:
        """Config classes of one stage, in name order (used to build the spec schema)."""
        return [self._classes[n].config_class for n in self.names(stage)]

    def __contains__(self, name: object) -> bool:
        return name in self._classes

    def __len__(self) -> int:
        return len(self._classes)


def _check_processor_class(cls: type[Processor]) -> None:
    if not (isinstance(cls, type) and issubclass(cls, Processor)):
        raise RegistryError(f"{cls!r} is not a msquant.plugin.Processor subclass")
    for attr in ("type_name", "config_class"):
        if not hasattr(cls, attr):
            raise RegistryError(
                f"processor {cls.__qualname__} must define class attribute {attr!r}"
            )
    if not isinstance(cls.type_name, str) or not cls.type_name:
        raise RegistryError(f"{cls.__qualname__}.type_name must be a non-empty string")
    config_class = cls.config_class
    if not (isinstance(config_class, type) and issubclass(config_class, ProcessorConfig)):
        raise RegistryError(
            f"{cls.__qualname__}.config_class must subclass msquant.plugin.ProcessorConfig"
        )
    # The spec schema discriminates entries on ``type``: it must be exactly Literal[type_name].
    type_field = config_class.model_fields.get("type")
    annotation = type_field.annotation if type_field is not None else None
    if get_origin(annotation) is not Literal or get_args(annotation) != (cls.type_name,):
        raise RegistryError(
            f"{cls.__qualname__}.config_class ({config_class.__qualname__}) must declare "
            f"type: Literal[{cls.type_name!r}], got {annotation!r}"
        )
    if cls.stage not in ("process", "save"):
        raise RegistryError(
            f"{cls.__qualname__}.stage must be 'process' or 'save', got {cls.stage!r}"
        )


def default_registry() -> ProcessorRegistry:
    """A new registry holding every processor installed in the ``msquant.processors`` group.

    A fresh registry per call keeps msquant free of global mutable state; embedders that add their
    own processors build one with this function and then call :meth:`ProcessorRegistry.register`.
    """
    return ProcessorRegistry().load_entry_points()
