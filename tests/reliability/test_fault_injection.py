"""Kill the process on entering each function of the staging, recovery, checkpoint and marker
code, and check that nothing is lost (issue 14's fault injection).

Every function defined in :mod:`msquant.export.staging`, :mod:`msquant.export.recovery`,
:mod:`msquant.export.marker`, :mod:`msquant.run.agree` and :mod:`msquant.run.checkpoint` (methods,
properties and context managers included) is a kill point. For each, a forked ``msquant quant
--overwrite`` over a previous export SIGKILLs itself the first time the function is entered, in
three scenarios: a checkpointed run, a run with ``--no_checkpoints``, and a ``--resume`` of a run
killed after its first layer. Then:

1. once the save path is recovered (:func:`~msquant.export.recovery.recover_save_path`, what any
   next run does first), it holds either the previous export or the new one, byte for byte;
2. the same command run again (with ``--resume`` when a checkpoint folder is kept) exits 0 with
   the new export, and nothing is left beside the save path.

A traced run of each scenario first records which of these functions it enters; a function it
never enters is skipped for that scenario (a kill there cannot happen).

The default suite kills at the commit steps (:data:`COMMIT_STEPS`: the swap, its recovery and
the steps that write or remove the checkpoint folder) of checkpointed and unchecked runs, and at
the checkpoint steps of resumed runs; the rest of the sweep (the layer store, fingerprints,
marker helpers, and the swap again in resumed runs: about 120 more kill points, 3 to 4 minutes
on two cores) runs with ``pytest -m faults``.
"""

from __future__ import annotations

import inspect
import shutil
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from types import FrameType, ModuleType
from typing import Any

import pytest
from replay import (
    KILLED,
    MINMAX_YAML,
    Cli,
    export_files,
    kill_on_entry,
    needs_fork,
    quant_args,
    replay,
    run_forked,
)

import msquant.export.marker
import msquant.export.recovery
import msquant.export.staging
import msquant.run.agree
import msquant.run.checkpoint.durable
import msquant.run.checkpoint.fingerprint
import msquant.run.checkpoint.folder
import msquant.run.checkpoint.layout
import msquant.run.checkpoint.opening
import msquant.run.checkpoint.progress
import msquant.run.checkpoint.restore
import msquant.run.checkpoint.store
from msquant.export.recovery import recover_save_path
from msquant.run.checkpoint.folder import RunCheckpoints
from msquant.run.checkpoint.layout import partial_path

pytestmark = needs_fork

MODULES: tuple[ModuleType, ...] = (
    msquant.export.staging,
    msquant.export.recovery,
    msquant.export.marker,
    msquant.run.agree,
    msquant.run.checkpoint.layout,
    msquant.run.checkpoint.fingerprint,
    msquant.run.checkpoint.durable,
    msquant.run.checkpoint.store,
    msquant.run.checkpoint.progress,
    msquant.run.checkpoint.opening,
    msquant.run.checkpoint.folder,
    msquant.run.checkpoint.restore,
)
#: The short names of the checkpoint folder's modules (kill points of resumed runs too).
CHECKPOINT_MODULES = ("agree.", "layout.", "fingerprint.", "durable.", "store.", "progress.",
                      "opening.", "folder.", "restore.")  # fmt: skip
NEW_YAML = MINMAX_YAML.replace(
    "dtype: int8, scope: per_channel", "dtype: int4, scope: per_group, ext: {group_size: 32}"
)


def _functions() -> Iterator[tuple[str, Callable[..., Any]]]:
    """Every function and method defined in :data:`MODULES`, by qualified name."""
    for module in MODULES:
        short = module.__name__.rsplit(".", 1)[-1]
        for name, value in vars(module).items():
            if getattr(value, "__module__", None) != module.__name__:
                continue
            if inspect.isfunction(value):
                yield f"{short}.{name}", value
            elif inspect.isclass(value):
                for attribute, member in vars(value).items():
                    if isinstance(member, staticmethod | classmethod):
                        member = member.__func__
                    if isinstance(member, property):
                        member = member.fget
                    if inspect.isfunction(member):
                        yield f"{short}.{name}.{attribute}", member


FUNCTIONS = dict(_functions())
SCENARIOS = ("checkpointed", "no_checkpoints", "resumed")
#: Kill points of the default suite: every function of the swap and its recovery, and the
#: steps that write or remove the checkpoint folder and its progress file.
COMMIT_STEPS = frozenset(
    name
    for name in FUNCTIONS
    if name.startswith(("staging.", "recovery."))
    or name
    in {
        "marker.write_export_marker",
        "opening._decide",
        "opening._discard",
        "durable._replace_durably",
        "durable.save_tensors_atomically",
        "durable.write_json_atomically",
        "opening.open_checkpoints",
        "folder.RunCheckpoints.guard",
        "folder.RunCheckpoints._prepare",
        "folder.RunCheckpoints._empty",
        "folder.RunCheckpoints._remove",
        "folder.RunCheckpoints._keep_or_remove",
        "folder.RunCheckpoints.keep_layer",
        "folder.RunCheckpoints.commit_layer",
        "folder.RunCheckpoints.commit_finished",
        "folder.RunCheckpoints._write_progress",
        "folder.RunCheckpoints._save_hidden",
        "folder.RunCheckpoints._remove_hidden",
        "folder.RunCheckpoints.restore",
        "folder.RunCheckpoints.restore_finished",
        "restore.take_up_finished",
    }
)


def _kill_points() -> list[Any]:
    """(point, scenario) pairs; those outside the default suite marked ``faults``. The default
    kills at the commit steps in checkpointed and unchecked runs, and at the checkpoint
    folder's steps (those of :data:`CHECKPOINT_MODULES`, which restore) in resumed runs too."""
    pairs = []
    for name in sorted(FUNCTIONS):
        for scenario in SCENARIOS:
            default = name in COMMIT_STEPS and (
                scenario != "resumed" or name.startswith(CHECKPOINT_MODULES)
            )
            marks = () if default else (pytest.mark.faults,)
            pairs.append(pytest.param(name, scenario, marks=marks, id=f"{name}-{scenario}"))
    return pairs


def test_the_kill_points_cover_the_commit_steps() -> None:
    """The swap's steps are functions of their own, so a kill can land between any two."""
    for step in ("_commit", "_move_aside", "_move_into_place", "_clean_up", "_refuse"):
        assert f"staging.StagedOutputDir.{step}" in FUNCTIONS
    for step in ("write_journal", "remove_journal", "recover_save_path", "SavePathLock.__exit__"):
        assert f"recovery.{step}" in FUNCTIONS
    assert "folder.RunCheckpoints.commit_layer" in FUNCTIONS
    assert len(FUNCTIONS) > 60
    assert COMMIT_STEPS <= set(FUNCTIONS)


@pytest.fixture(scope="module")
def exports(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The previous export (int8) and the new one (int4) an uninterrupted run writes."""
    import msquant

    root = tmp_path_factory.mktemp("exports")
    built = {}
    for name, text in (("old", MINMAX_YAML), ("new", NEW_YAML)):
        config = root / f"{name}.yaml"
        config.write_text(text)
        msquant.quantize(tiny_llama, root / name, config, progress=False)
        built[name] = root / name
    return built


def _beside(case: Path) -> list[str]:
    return sorted(p.name for p in case.iterdir() if p.name.startswith(".out"))


def _prepare(case: Path, exports: dict[str, Path], scenario: str) -> list[object]:
    """The case's previous export and command line; for ``resumed``, a run killed after its
    first layer first (the command then resumes it)."""
    shutil.copytree(exports["old"], case / "out")
    (case / "new.yaml").write_text(NEW_YAML)
    flags = ["--overwrite"] + (["--no_checkpoints"] if scenario == "no_checkpoints" else [])
    args = quant_args(case, *flags, config="new.yaml")
    if scenario == "resumed":
        first = run_forked(
            args, case.parent / "first.log", lambda: kill_on_entry(RunCheckpoints.commit_layer, 2)
        )
        assert first == KILLED
        args = [*args, "--resume"]
    return args


def _record_entries(log: Path) -> None:
    """In the child: append the name of each function of :data:`FUNCTIONS` it enters to ``log``."""
    names = {inspect.unwrap(f).__code__: name for name, f in FUNCTIONS.items()}
    seen: set[str] = set()

    def watch(frame: FrameType, event: str, arg: Any) -> None:
        name = names.get(frame.f_code) if event == "call" else None
        if name is not None and name not in seen:
            seen.add(name)
            with open(log, "a", encoding="utf-8") as handle:
                handle.write(name + "\n")

    sys.setprofile(watch)


@pytest.fixture(scope="module")
def entered(
    exports: dict[str, Path], tmp_path_factory: pytest.TempPathFactory, tiny_llama: Path
) -> dict[str, set[str]]:
    """The functions each scenario's run enters (one traced run per scenario)."""
    result = {}
    for scenario in SCENARIOS:
        root = tmp_path_factory.mktemp(f"trace_{scenario}")
        case = root / "case"
        case.mkdir()
        shutil.copytree(tiny_llama, case / "model")
        (case / "w8.yaml").write_text(MINMAX_YAML)
        args = _prepare(case, exports, scenario)
        names = root / "entered.txt"
        record = lambda names=names: _record_entries(names)  # noqa: E731
        assert run_forked(args, root / "run.log", record) == 0
        result[scenario] = set(names.read_text().split())
    return result


def test_the_scenarios_enter_the_commit_steps(entered: dict[str, set[str]]) -> None:
    for scenario in SCENARIOS:
        for step in ("_commit", "_move_aside", "_move_into_place", "_clean_up"):
            assert f"staging.StagedOutputDir.{step}" in entered[scenario], scenario
        assert "recovery.recover_save_path" in entered[scenario]
    assert "folder.RunCheckpoints.commit_layer" in entered["checkpointed"]
    assert "folder.RunCheckpoints.restore" in entered["resumed"]
    assert "folder.RunCheckpoints.commit_layer" not in entered["no_checkpoints"]


@pytest.mark.parametrize(("point", "scenario"), _kill_points())
def test_kill_on_entry(
    point: str,
    scenario: str,
    case: Path,
    run_cli: Cli,
    exports: dict[str, Path],
    entered: dict[str, set[str]],
) -> None:
    if point not in entered[scenario]:
        pytest.skip(f"a {scenario} run does not enter {point}")
    old, new = export_files(exports["old"]), export_files(exports["new"])
    args = _prepare(case, exports, scenario)
    log = case.parent / "run.log"

    code = run_forked(args, log, lambda: kill_on_entry(FUNCTIONS[point]))

    assert code == KILLED, log.read_text()[-3000:]
    recover_save_path(case / "out")  # what the next run does first
    at_save_path = export_files(case / "out") if (case / "out").exists() else None
    assert at_save_path in (old, new), "neither the previous nor the new export is in place"
    rerun = [a for a in args if a != "--resume"]
    if partial_path(case / "out").exists():
        rerun.append("--resume")
    outcome = replay(run_cli, case, *rerun)
    assert outcome.code == 0, outcome.err
    assert export_files(case / "out") == new
    assert _beside(case) == []
