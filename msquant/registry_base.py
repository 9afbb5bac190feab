"""What the four registries (processors, quantization methods, export formats, model adapters)
share: reading their entry-point group, and claiming a name.

It sits at the root of the engine, below ``plugin/`` and ``model/``, because the model-adapter
registry (``model/``) may not import ``plugin/``. Each registry keeps its own rules (what a class
must define); this module finds the entry points, loads each once and checks that it holds the
kind of object the group is for, so that a broken plugin is reported by name instead of being
swallowed or failing later, and refuses a name that two different plugins claim.
"""

from __future__ import annotations

from collections.abc import Iterable
from importlib.metadata import EntryPoint, entry_points
from typing import TypeVar

from msquant.errors import RegistryError

__all__ = [
    "check_entry_point_name",
    "claim",
    "distinct_entry_points",
    "load_plugin",
    "plugin_classes",
    "plugin_instances",
    "qualified_name",
]

T = TypeVar("T")


def distinct_entry_points(found: Iterable[EntryPoint]) -> list[EntryPoint]:
    """``found`` sorted by name and value, each pair once (the same distribution may be visible
    twice on ``sys.path``)."""
    return sorted(
        {(ep.name, ep.value): ep for ep in found}.values(), key=lambda e: (e.name, e.value)
    )


def load_plugin(ep: EntryPoint, what: str) -> object:
    """The object ``ep`` names.

    :param what: the kind of plugin, for the message (``processor``, ``export format``).
    :raises RegistryError: naming the entry point when it cannot be imported (a broken plugin is
        reported, not swallowed).
    """
    try:
        return ep.load()
    except Exception as exc:
        raise RegistryError(
            f"cannot load {what} plugin {ep.name!r} from entry point {ep.value!r}: {exc}"
        ) from exc


def plugin_classes(group: str, base: type[T], what: str) -> list[tuple[EntryPoint, type[T]]]:
    """Every distinct entry point of ``group`` with the class it names, in name order.

    :param base: the class each must subclass; named in the message by its public spelling
        (``msquant.plugin.<name>``).
    :raises RegistryError: for an entry point that cannot be loaded or is not such a subclass.
    """
    found: list[tuple[EntryPoint, type[T]]] = []
    for ep in distinct_entry_points(entry_points(group=group)):
        obj = load_plugin(ep, what)
        if not (isinstance(obj, type) and issubclass(obj, base)):
            raise RegistryError(
                f"entry point {ep.name!r} = {ep.value!r} is not a "
                f"msquant.plugin.{base.__name__} subclass"
            )
        found.append((ep, obj))
    return found


def plugin_instances(group: str, kind: type[T], what: str) -> list[tuple[EntryPoint, T]]:
    """Every distinct entry point of ``group`` with the object it names, each an instance of
    ``kind``, in name order.

    :raises RegistryError: for an entry point that cannot be loaded or holds another object.
    """
    found: list[tuple[EntryPoint, T]] = []
    for ep in distinct_entry_points(entry_points(group=group)):
        obj = load_plugin(ep, what)
        if not isinstance(obj, kind):
            raise RegistryError(
                f"entry point {ep.name!r} = {ep.value!r} is not a msquant.plugin.{kind.__name__}"
            )
        found.append((ep, obj))
    return found


def check_entry_point_name(ep: EntryPoint, name: str, what: str) -> None:
    """Refuse an entry point registered under another name than the one its object declares
    (``name``): the YAML, the registry and the entry point must agree on one name.

    :raises RegistryError: naming both.
    """
    if name != ep.name:
        raise RegistryError(
            f"entry point {ep.name!r} = {ep.value!r} names the {what} {name!r}; the two names "
            "must be equal"
        )


def claim(table: dict[str, type[T]], key: str, cls: type[T], what: str) -> type[T]:
    """Put ``cls`` under ``key`` in ``table``; registering the same class again is a no-op.

    :param what: what ``key`` names, for the message (``processor type``, ``model type``).
    :raises RegistryError: when another class holds ``key`` (both named).
    """
    existing = table.get(key)
    if existing is not None and existing is not cls:
        raise RegistryError(
            f"{what} {key!r} is registered twice: by {qualified_name(existing)} and "
            f"{qualified_name(cls)}"
        )
    table[key] = cls
    return cls


def qualified_name(cls: type) -> str:
    """``module.QualifiedName`` of a class, as messages and logs name a plugin."""
    return f"{cls.__module__}.{cls.__qualname__}"
