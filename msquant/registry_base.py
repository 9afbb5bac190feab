"""What the four registries (processors, quantization methods, export formats, model adapters)
share: reading their entry-point group, and claiming a name.

It sits at the root of the engine, below ``plugin/`` and ``model/``, because the model-adapter
registry (``model/``) may not import ``plugin/``. Each registry keeps its own rules (what a class
must define); this module finds the entry points, loads each once and checks that it holds the
kind of object the group is for.

A third-party plugin is isolated from the runs that do not use it: an entry point that cannot be
imported (an exception, or ``SystemExit`` / ``KeyboardInterrupt`` raised by its import), that names
the wrong kind of object, or whose name another plugin (a built-in one included) also claims is
set aside as a :class:`PluginProblem`, logged once as a warning, and the registry goes on without
it. A run that asks for that name gets a :class:`PluginError` (exit 2) naming the distribution and
the entry point; no run can be ended, or turned into a success, by a plugin it does not use. A
real Ctrl-C or SIGTERM while a plugin is imported still stops the command.
"""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from importlib.metadata import EntryPoint, entry_points
from types import FrameType
from typing import Any, TypeVar

from msquant.errors import PluginError, RegistryError

__all__ = [
    "PluginError",
    "PluginProblem",
    "check_entry_point_name",
    "claim",
    "distinct_entry_points",
    "load_plugin",
    "plugin_classes",
    "plugin_instances",
    "plugin_problems_named",
    "qualified_name",
    "register_plugins",
]

T = TypeVar("T")
logger = logging.getLogger(__name__)

#: The plugin problems of the latest scan of each group, by group and name: a config naming a
#: set-aside plugin is told why (:func:`plugin_problems_named`); and the problems already warned
#: about (once per process). Like ``sys.modules``, they record facts about the installed
#: packages, not the state of a run.
_PROBLEMS: dict[str, dict[str, PluginProblem]] = {}
_WARNED: set[PluginProblem] = set()
#: The distribution of an entry point not read from an installed package.
UNKNOWN = "an unknown distribution"


def distribution_of(ep: EntryPoint) -> str:
    """The name of the distribution that declares ``ep`` (``an unknown distribution`` when the
    entry point was not read from an installed package)."""
    dist = getattr(ep, "dist", None)
    name = getattr(dist, "name", None) if dist is not None else None
    return str(name) if name else UNKNOWN


@dataclass(frozen=True)
class PluginProblem:
    """An entry point set aside: which plugin, of which distribution, and why.

    :param what: the kind of plugin (``processor``, ``export format``...).
    :param reason: what went wrong, completing "the plugin ... " (``failed to import: ...``).
    :param others: the other entry points claiming the same name (a name claimed twice).
    """

    group: str
    name: str
    value: str
    distribution: str
    what: str
    reason: str
    others: tuple[tuple[str, str], ...] = ()

    @classmethod
    def of(cls, ep: EntryPoint, what: str, reason: str) -> PluginProblem:
        return cls(ep.group, ep.name, ep.value, distribution_of(ep), what, reason)

    @property
    def distributions(self) -> list[str]:
        """Every distribution involved, this one first, each once."""
        return list(dict.fromkeys([self.distribution, *(d for d, _ in self.others)]))

    def describe(self) -> str:
        """One sentence naming the plugin, its distribution and entry point, and the problem."""
        return (
            f"the {self.what} plugin {self.name!r} (distribution {self.distribution}, entry point "
            f"{self.name} = {self.value} in group {self.group}) {self.reason}"
        )

    def fix(self) -> str:
        """How to get rid of the problem."""
        third_party = [d for d in self.distributions if d not in ("msquant", UNKNOWN)]
        if UNKNOWN in self.distributions and not third_party:
            return "fix or uninstall the package that declares that entry point"
        if self.others:
            uninstall = " or ".join(f"{d} (pip uninstall {d})" for d in third_party)
            return f"uninstall {uninstall or 'one of them'}, or ask its authors to register another name"
        if third_party:
            return f"fix or uninstall {third_party[0]} (pip uninstall {third_party[0]})"
        return "reinstall msquant (pip install -e .)"

    def message(self) -> str:
        """The message of a run that asks for this plugin's name."""
        return f"{self.describe()}; {self.fix()}"


def distinct_entry_points(found: Iterable[EntryPoint]) -> list[EntryPoint]:
    """``found`` sorted by name and value, each pair once (the same distribution may be visible
    twice on ``sys.path``)."""
    return sorted(
        {(ep.name, ep.value): ep for ep in found}.values(), key=lambda e: (e.name, e.value)
    )


@contextmanager
def _signals_noted() -> Iterator[list[int]]:
    """While a plugin is imported, note SIGINT and SIGTERM (then handled as before): an interrupt
    the user sent stops the command, a ``KeyboardInterrupt`` the plugin raised does not."""
    noted: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield noted
        return
    previous: dict[int, Any] = {
        int(signum): signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGTERM)
    }

    def note(signum: int, frame: FrameType | None) -> None:
        noted.append(signum)
        handler = previous[signum]
        if callable(handler):
            handler(signum, frame)
        elif handler == signal.SIG_DFL:
            signal.signal(signum, signal.SIG_DFL)
            signal.raise_signal(signum)

    for signum, handler in previous.items():
        if handler != signal.SIG_IGN and handler is not None:
            signal.signal(signum, note)
    try:
        yield noted
    finally:
        for signum, handler in previous.items():
            if handler is not None:
                signal.signal(signum, handler)


def load_plugin(ep: EntryPoint, what: str) -> object:
    """The object ``ep`` names.

    :param what: the kind of plugin (``processor``, ``export format``), for the message.
    :raises PluginError: naming the distribution and the entry point when it cannot be imported,
        whatever its import raises (``SystemExit`` and ``KeyboardInterrupt`` included); a real
        Ctrl-C or SIGTERM during the import is raised as it came.
    """
    with _signals_noted() as noted:
        try:
            return ep.load()
        except BaseException as exc:
            if noted or isinstance(exc, GeneratorExit):
                raise
            reason = f"failed to import: {_raised(exc)}"
            raise PluginError(PluginProblem.of(ep, what, reason)) from exc


def _raised(exc: BaseException) -> str:
    """``SystemExit(0)``, ``ImportError: No module named 'x'``: what an import raised."""
    if isinstance(exc, SystemExit | KeyboardInterrupt):
        return f"its import raised {type(exc).__name__}({', '.join(map(repr, exc.args))})"
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _warn_once(problem: PluginProblem) -> None:
    """Log ``problem`` the first time this process meets it."""
    if problem not in _WARNED:
        _WARNED.add(problem)
        logger.warning(
            "%s; it is ignored, and runs that use %r are refused until then",
            problem.message(),
            problem.name,
        )


def plugin_problems_named(name: object) -> list[PluginProblem]:
    """The problems, in the latest scan of each group, of the plugins registered as ``name``
    (for the message of a config that asks for it)."""
    return [found[name] for _, found in sorted(_PROBLEMS.items()) if name in found]


def _scan(
    group: str, what: str, accept: Callable[[object], str | None]
) -> tuple[list[tuple[EntryPoint, Any]], list[PluginProblem]]:
    """Every distinct entry point of ``group`` loaded, with the problems of those that failed
    (``accept`` says what is wrong with a loaded object, or None)."""
    found: list[tuple[EntryPoint, Any]] = []
    problems: list[PluginProblem] = []
    for ep in distinct_entry_points(entry_points(group=group)):
        try:
            obj = load_plugin(ep, what)
        except PluginError as exc:
            problems.append(exc.problem)
            continue
        wrong = accept(obj)
        if wrong is not None:
            problems.append(PluginProblem.of(ep, what, wrong))
            continue
        found.append((ep, obj))
    return found, problems


def plugin_classes(
    group: str, base: type[T], what: str
) -> tuple[list[tuple[EntryPoint, type[T]]], list[PluginProblem]]:
    """Every distinct entry point of ``group`` with the class it names, in name order, and the
    problems of those that could not be loaded or name no subclass of ``base`` (named in the
    message by its public spelling, ``msquant.plugin.<name>``)."""

    def accept(obj: object) -> str | None:
        if isinstance(obj, type) and issubclass(obj, base):
            return None
        return f"is not a msquant.plugin.{base.__name__} subclass"

    return _scan(group, what, accept)


def plugin_instances(
    group: str, kind: type[T], what: str
) -> tuple[list[tuple[EntryPoint, T]], list[PluginProblem]]:
    """Every distinct entry point of ``group`` with the object it names (an instance of
    ``kind``), in name order, and the problems of the others."""

    def accept(obj: object) -> str | None:
        return None if isinstance(obj, kind) else f"is not a msquant.plugin.{kind.__name__}"

    return _scan(group, what, accept)


def register_plugins(
    group: str,
    found: Iterable[tuple[EntryPoint, T]],
    problems: Iterable[PluginProblem],
    register: Callable[[EntryPoint, T], object],
    unregister: Callable[[str], object],
    what: str,
) -> dict[str, PluginProblem]:
    """Register each loaded entry point of ``group`` with ``register``; returns the problems by
    name (recorded as the group's latest, each warned about once): the loading problems, an
    object ``register`` refuses (:class:`RegistryError`), and a name two entry points claim,
    which is then taken from both (``unregister``): neither may be used while the other is
    installed.
    """
    by_name: dict[str, PluginProblem] = {p.name: p for p in problems}
    owners: dict[str, EntryPoint] = {}
    for ep, obj in found:
        if ep.name in by_name:
            continue
        try:
            register(ep, obj)
        except RegistryError as exc:
            owner = owners.pop(ep.name, None)
            if owner is None:
                by_name[ep.name] = PluginProblem.of(ep, what, f"is refused: {exc}")
                continue
            unregister(ep.name)
            by_name[ep.name] = _claimed_twice(owner, ep, what)
            continue
        owners[ep.name] = ep
    for problem in by_name.values():
        _warn_once(problem)
    _PROBLEMS[group] = dict(by_name)
    return by_name


def _claimed_twice(first: EntryPoint, second: EntryPoint, what: str) -> PluginProblem:
    """The problem of a name two entry points claim, told from the side of the third-party one
    (a plugin re-registering one of msquant's own names is that plugin's problem)."""
    culprit, other = (first, second) if distribution_of(second) == "msquant" else (second, first)
    other_dist = distribution_of(other)
    owner = "msquant's built-in" if other_dist == "msquant" else f"distribution {other_dist}'s"
    reason = (
        f"claims the name {culprit.name!r}, which {owner} entry point {other.name} = "
        f"{other.value} claims too; msquant cannot tell which one a config means"
    )
    problem = PluginProblem.of(culprit, what, reason)
    return PluginProblem(
        problem.group, problem.name, problem.value, problem.distribution, what, reason,
        ((other_dist, other.value),),
    )  # fmt: skip


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
