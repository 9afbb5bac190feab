"""Export formats as a registry: format name -> how a folder is recognised and read back.

An :class:`ExportFormat` binds what the engine needs to know about one on-disk format without
naming it: how to recognise an export folder of it (``detect``), the reader that decodes it for
``msquant verify``, ``msquant eval`` and the read-back check every run makes (``reader``; a format
without one is written but never verified), and the savers (``spec.save`` types) whose output it
is. How a format packs its tensors and writes its quantization config is its savers' business
(:class:`msquant.plugin.Saver`); the engine only reads.

Built-in and third-party formats are found the same way, through the entry-point group
``msquant.formats`` (``name = "package.module:FORMAT"``, the object an :class:`ExportFormat`), or
registered explicitly on a :class:`FormatRegistry`. A fresh registry per call keeps msquant free
of global mutable state, as :func:`msquant.plugin.default_registry` does for processors.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from importlib.metadata import EntryPoint
from pathlib import Path
from typing import TYPE_CHECKING

from msquant.errors import RegistryError
from msquant.registry_base import (
    PluginError,
    PluginProblem,
    check_entry_point_name,
    plugin_instances,
    register_plugins,
)

if TYPE_CHECKING:
    from msquant.verify.base import ExportReader
    from msquant.verify.report import Findings

__all__ = ["FORMAT_ENTRY_POINT_GROUP", "ExportFormat", "FormatRegistry", "default_formats"]

#: The entry-point group export formats are registered in (``name = "package.module:OBJECT"``).
FORMAT_ENTRY_POINT_GROUP = "msquant.formats"
logger = logging.getLogger(__name__)

#: A reader factory: ``reader(folder, findings)`` runs the inventory checks and returns the reader.
ReaderFactory = Callable[[Path, "Findings"], "ExportReader"]


@dataclass(frozen=True)
class ExportFormat:
    """One export format, as the engine sees it.

    :param name: the format's name in reports and messages (``report.format``).
    :param description: how a folder of this format is recognised, for messages
        ("msquant verify reads ...") and docs.
    :param detect: whether a folder holds this format; reads only small metadata files. It may
        raise :class:`msquant.ExportReadError` for a metadata file it cannot parse.
    :param reader: the reader factory, or None for a format msquant writes but cannot read back
        (its exports are then not verified, and a streamed run cannot evaluate them).
    :param savers: the ``spec.save`` types whose output is this format.
    :param order: detection order, lowest first: a format whose folders may also satisfy another
        format's test must come before it (Ascend exports copy the model's ``config.json``).
    """

    name: str
    description: str
    detect: Callable[[Path], bool]
    reader: ReaderFactory | None = None
    savers: tuple[str, ...] = ()
    order: int = 100

    @property
    def verifiable(self) -> bool:
        """Whether msquant reads this format back (verify, eval, the run's read-back check)."""
        return self.reader is not None


class FormatRegistry:
    """Registered export formats, kept in detection order (``order``, then name)."""

    def __init__(self, formats: Iterable[ExportFormat] = ()) -> None:
        self._formats: dict[str, ExportFormat] = {}
        self._problems: dict[str, PluginProblem] = {}
        for fmt in formats:
            self.register(fmt)

    def register(self, fmt: ExportFormat) -> ExportFormat:
        """Add ``fmt``.

        :raises RegistryError: when ``fmt`` is not an :class:`ExportFormat`, its name is empty,
            or the name (or one of its savers) is already claimed by another format.
        """
        if not isinstance(fmt, ExportFormat):
            raise RegistryError(f"{fmt!r} is not a msquant.plugin.ExportFormat")
        if not fmt.name:
            raise RegistryError("an export format needs a non-empty name")
        existing = self._formats.get(fmt.name)
        if existing is not None and existing != fmt:
            raise RegistryError(f"export format {fmt.name!r} is registered twice")
        for other in self._formats.values():
            claimed = sorted(set(other.savers) & set(fmt.savers))
            if other.name != fmt.name and claimed:
                raise RegistryError(
                    f"saver(s) {', '.join(claimed)} claimed by two export formats: "
                    f"{other.name!r} and {fmt.name!r}"
                )
        self._formats[fmt.name] = fmt
        return fmt

    def load_entry_points(self, group: str = FORMAT_ENTRY_POINT_GROUP) -> FormatRegistry:
        """Register every format advertised in the entry-point ``group``; returns ``self``.
        A plugin that cannot be registered is set aside: :meth:`get` refuses its name, and
        :meth:`detect` does not know it."""
        found, problems = plugin_instances(group, ExportFormat, "export format")

        def register(ep: EntryPoint, fmt: ExportFormat) -> None:
            check_entry_point_name(ep, fmt.name, "export format")
            self.register(fmt)

        self._problems.update(
            register_plugins(
                group,
                found,
                problems,
                register,
                lambda name: self._formats.pop(name, None),
                "export format",
            )
        )
        return self

    def problems(self) -> list[PluginProblem]:
        """The format plugins set aside, in name order (a ``verify`` that recognises no format
        names them)."""
        return [self._problems[name] for name in sorted(self._problems)]

    def get(self, name: str) -> ExportFormat:
        """The format registered as ``name``.

        :raises PluginError: when the plugin of that name was set aside.
        :raises KeyError: listing the registered names when ``name`` is unknown.
        """
        if name in self._problems:
            raise PluginError(self._problems[name])
        try:
            return self._formats[name]
        except KeyError:
            known = ", ".join(self.names()) or "(none)"
            raise KeyError(f"unknown export format {name!r}; registered formats: {known}") from None

    def formats(self) -> list[ExportFormat]:
        """Every format, in detection order."""
        return sorted(self._formats.values(), key=lambda f: (f.order, f.name))

    def names(self) -> list[str]:
        """Every format's name, in detection order."""
        return [fmt.name for fmt in self.formats()]

    def detect(self, directory: Path) -> ExportFormat | None:
        """The first format (in detection order) that recognises ``directory``, or None."""
        return next((fmt for fmt in self.formats() if fmt.detect(directory)), None)

    def verifiable_savers(self) -> frozenset[str]:
        """The ``spec.save`` types whose output a registered reader understands."""
        return frozenset(s for fmt in self.formats() if fmt.verifiable for s in fmt.savers)

    def __contains__(self, name: object) -> bool:
        return name in self._formats

    def __len__(self) -> int:
        return len(self._formats)


def default_formats() -> FormatRegistry:
    """A new registry holding every format installed in the ``msquant.formats`` group."""
    return FormatRegistry().load_entry_points()
