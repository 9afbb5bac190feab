"""The one place the four registries read their entry-point groups and claim names
(``msquant/registry_base.py``): found once each in name order, broken or wrong plugins set aside
and reported by name, a name two classes claim refused."""

from __future__ import annotations

import signal
from collections.abc import Callable
from importlib.metadata import EntryPoint
from pathlib import Path

import pytest

from msquant import MsquantInputError, RegistryError
from msquant.registry_base import (
    check_entry_point_name,
    claim,
    distinct_entry_points,
    load_plugin,
    plugin_classes,
    plugin_instances,
)

GROUP = "msquant.test_group"


class Base:
    """A plugin base class for these tests."""


class Child(Base):
    """A valid plugin class."""


class Other(Base):
    """A second valid plugin class."""


INSTANCE = Child()


@pytest.fixture
def advertise(monkeypatch: pytest.MonkeyPatch) -> Callable[..., None]:
    """Make the entry-point group hold the given ``(name, value)`` pairs."""

    def fake(*specs: tuple[str, str]) -> None:
        points = [EntryPoint(name, value, GROUP) for name, value in specs]
        monkeypatch.setattr(
            "msquant.registry_base.entry_points",
            lambda *, group: [ep for ep in points if ep.group == group],
        )

    return fake


def test_entry_points_are_sorted_and_each_pair_kept_once() -> None:
    found = [
        EntryPoint("b", "m:B", GROUP),
        EntryPoint("a", "m:A", GROUP),
        EntryPoint("b", "m:B", GROUP),  # one distribution visible twice on sys.path
        EntryPoint("a", "m:Z", GROUP),
    ]
    assert [(e.name, e.value) for e in distinct_entry_points(found)] == [
        ("a", "m:A"),
        ("a", "m:Z"),
        ("b", "m:B"),
    ]


def test_classes_are_loaded_in_name_order(advertise: Callable[..., None]) -> None:
    advertise(("second", f"{__name__}:Other"), ("first", f"{__name__}:Child"))
    found, problems = plugin_classes(GROUP, Base, "thing")
    assert [(ep.name, cls) for ep, cls in found] == [("first", Child), ("second", Other)]
    assert problems == []


def test_a_plugin_that_cannot_be_imported_is_set_aside_and_named(
    advertise: Callable[..., None],
) -> None:
    advertise(("broken", "no_such_module_xyz:Thing"), ("fine", f"{__name__}:Child"))
    found, problems = plugin_classes(GROUP, Base, "test thing")
    assert [ep.name for ep, _ in found] == ["fine"]
    [problem] = problems
    assert problem.message() == (
        "the test thing plugin 'broken' (distribution an unknown distribution, entry point "
        f"broken = no_such_module_xyz:Thing in group {GROUP}) failed to import: "
        "ModuleNotFoundError: No module named 'no_such_module_xyz'; fix or uninstall the package "
        "that declares that entry point"
    )


def test_system_exit_and_keyboard_interrupt_raised_by_an_import_are_the_plugins_problem(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An import that raises SystemExit(0) once ended every msquant command with exit 0."""
    monkeypatch.syspath_prepend(str(tmp_path))
    for module, statement in (
        ("rt_exits", "raise SystemExit(0)"),
        ("rt_ctrl_c", "raise KeyboardInterrupt"),
    ):
        (tmp_path / f"{module}.py").write_text(statement + "\n")
        with pytest.raises(RegistryError) as info:
            load_plugin(EntryPoint("x", f"{module}:Thing", GROUP), "thing")
        assert isinstance(info.value, MsquantInputError)  # exit 2
        raised = "SystemExit(0)" if module == "rt_exits" else "KeyboardInterrupt()"
        assert f"failed to import: its import raised {raised}" in str(info.value)


def test_a_real_interrupt_during_an_import_still_stops(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "rt_slow.py").write_text(
        "import os, signal\nos.kill(os.getpid(), signal.SIGINT)\nimport time\ntime.sleep(5)\n"
    )
    # Python's own SIGINT handler, as in a user's process (pytest-xdist's workers ignore SIGINT).
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            load_plugin(EntryPoint("x", "rt_slow:Thing", GROUP), "thing")
    finally:
        signal.signal(signal.SIGINT, previous)


def test_an_object_of_the_wrong_kind_is_named_with_the_public_spelling(
    advertise: Callable[..., None],
) -> None:
    advertise(("wrong", "json:dumps"))
    assert plugin_classes(GROUP, Base, "thing")[1][0].reason == (
        "is not a msquant.plugin.Base subclass"
    )
    assert plugin_instances(GROUP, Base, "thing")[1][0].reason == "is not a msquant.plugin.Base"


def test_instances_are_loaded(advertise: Callable[..., None]) -> None:
    advertise(("one", f"{__name__}:INSTANCE"))
    found, _ = plugin_instances(GROUP, Base, "thing")
    assert [(ep.name, obj) for ep, obj in found] == [("one", INSTANCE)]
    advertise(("cls", f"{__name__}:Child"))  # a class where an instance is expected
    found, problems = plugin_instances(GROUP, Base, "thing")
    assert found == [] and problems[0].reason == "is not a msquant.plugin.Base"


def test_a_name_claimed_by_two_classes_is_refused() -> None:
    table: dict[str, type[Base]] = {}
    assert claim(table, "x", Child, "thing") is Child
    assert claim(table, "x", Child, "thing") is Child  # the same class again: harmless
    with pytest.raises(RegistryError) as info:
        claim(table, "x", Other, "thing")
    assert str(info.value) == (
        f"thing 'x' is registered twice: by {__name__}.Child and {__name__}.Other"
    )
    assert table == {"x": Child}


def test_an_entry_point_must_carry_its_objects_name() -> None:
    ep = EntryPoint("alias", "m:Thing", GROUP)
    check_entry_point_name(EntryPoint("thing", "m:Thing", GROUP), "thing", "thing")
    with pytest.raises(RegistryError) as info:
        check_entry_point_name(ep, "thing", "export format")
    assert str(info.value) == (
        "entry point 'alias' = 'm:Thing' names the export format 'thing'; the two names must be "
        "equal"
    )
