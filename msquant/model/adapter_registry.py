"""Model-adapter registry: ``config.model_type`` -> :class:`~msquant.model.adapter.ModelAdapter`.

Built-in adapters and third-party plugins are found the same way, through the entry-point group
``msquant.model_adapters`` (``model_type = "package.module:AdapterClass"``; one class may be listed
under several model types); classes can also be registered explicitly on a registry instance. A
model type no adapter claims gets the default adapter (the generic heuristics), so registering an
adapter changes nothing for any other architecture. The engine never imports a concrete adapter.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

from torch import nn

from msquant.errors import RegistryError
from msquant.model.adapter import ModelAdapter
from msquant.registry_base import (
    PluginError,
    PluginProblem,
    claim,
    plugin_classes,
    qualified_name,
    register_plugins,
)

__all__ = [
    "MODEL_ADAPTER_GROUP",
    "ModelAdapterRegistry",
    "adapter_for",
    "default_adapter_registry",
    "model_type_of",
]

#: The entry-point group model adapters are registered in (``model_type = "package.module:Class"``).
MODEL_ADAPTER_GROUP = "msquant.model_adapters"
logger = logging.getLogger(__name__)


class ModelAdapterRegistry:
    """A mapping from ``model_type`` names to adapter classes, with strict registration rules.

    :param adapters: ``(model_type, adapter class)`` pairs to register first.
    """

    def __init__(self, adapters: Iterable[tuple[str, type[ModelAdapter]]] = ()) -> None:
        self._classes: dict[str, type[ModelAdapter]] = {}
        self._problems: dict[str, PluginProblem] = {}
        for model_type, cls in adapters:
            self.register(model_type, cls)

    def register(self, model_type: str, cls: type[ModelAdapter]) -> type[ModelAdapter]:
        """Register ``cls`` for ``model_type`` (as in ``config.json``).

        :raises RegistryError: when ``cls`` is not a ModelAdapter subclass, the name is empty, or
            the model type is already claimed by another class (listing both).
        """
        if not (isinstance(cls, type) and issubclass(cls, ModelAdapter)):
            raise RegistryError(
                f"model adapter for {model_type!r} must be a msquant.plugin.ModelAdapter subclass, "
                f"got {cls!r}"
            )
        if not isinstance(model_type, str) or not model_type:
            raise RegistryError(
                f"{cls.__qualname__} must be registered under a non-empty model_type, "
                f"got {model_type!r}"
            )
        return claim(self._classes, model_type, cls, "model adapter for model type")

    def load_entry_points(self, group: str = MODEL_ADAPTER_GROUP) -> ModelAdapterRegistry:
        """Register every adapter advertised in the entry-point ``group``; returns ``self``.
        A plugin that cannot be registered is set aside: :meth:`get` refuses its model type
        (the default adapter would silently misread such a model)."""
        found, problems = plugin_classes(group, ModelAdapter, "model adapter")
        self._problems.update(
            register_plugins(
                group,
                found,
                problems,
                lambda ep, cls: self.register(ep.name, cls),
                lambda name: self._classes.pop(name, None),
                "model adapter",
            )
        )
        return self

    def get(self, model_type: str | None) -> ModelAdapter:
        """The adapter for ``model_type``; the default :class:`ModelAdapter` for a type no
        adapter claims (or None).

        :raises PluginError: when the adapter plugin of that model type was set aside.
        """
        if model_type in self._problems:
            raise PluginError(self._problems[model_type])
        cls = self._classes.get(model_type) if model_type else None
        return (cls or ModelAdapter)()

    def for_model(self, model: nn.Module) -> ModelAdapter:
        """The adapter for ``model``, chosen by its ``config.model_type``."""
        model_type = model_type_of(model)
        adapter = self.get(model_type)
        if type(adapter) is not ModelAdapter:
            logger.debug(
                "model type %s: model adapter %s", model_type, qualified_name(type(adapter))
            )
        return adapter

    def model_types(self) -> list[str]:
        """The model types with an adapter of their own, sorted."""
        return sorted(self._classes)

    def __contains__(self, model_type: object) -> bool:
        return model_type in self._classes

    def __len__(self) -> int:
        return len(self._classes)


def model_type_of(model: nn.Module | Any) -> str | None:
    """``config.model_type`` of a model (or of a config object), None when it has none."""
    config = getattr(model, "config", model)
    model_type = getattr(config, "model_type", None)
    return model_type if isinstance(model_type, str) and model_type else None


def default_adapter_registry() -> ModelAdapterRegistry:
    """A new registry holding every adapter installed in the ``msquant.model_adapters`` group
    (a fresh one per call: msquant keeps no global mutable state)."""
    return ModelAdapterRegistry().load_entry_points()


def adapter_for(model: nn.Module) -> ModelAdapter:
    """The installed adapter for ``model``'s ``config.model_type`` (the default one when none
    claims it).

    :raises PluginError: when the adapter plugin of its model type was set aside (broken, or
        its model type claimed twice).
    """
    return default_adapter_registry().for_model(model)
