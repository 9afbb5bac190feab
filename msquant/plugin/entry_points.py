"""What the registries (processors, export formats) share in reading their entry-point groups."""

from __future__ import annotations

from collections.abc import Iterable
from importlib.metadata import EntryPoint

from msquant.errors import RegistryError

__all__ = ["distinct_entry_points", "load_plugin"]


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
