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

The new export is one of :data:`CONFIGS`: int4 weight-only (``minmax``), and the calibrated
configs whose checkpoints hold more (static activation ranges; smoothing and rotation, whose
checkpoints keep the probe's hidden states and the transforms' records, and whose resumed runs
derive quarot's rotation again; quarot once more with the model in memory, whose checkpoints keep
the rotated float tensors): the marker's ``transforms`` must be the new export's too.

The default suite kills at the commit steps (:data:`COMMIT_STEPS`: the swap, its recovery and
the steps that write or remove the checkpoint folder) of checkpointed and unchecked runs of the
``minmax`` config, and at the checkpoint steps of its resumed runs; the rest of the sweep (the
layer store, fingerprints, marker helpers, and the swap again in resumed runs: about 120 more
kill points, 3 to 4 minutes on two cores) and every kill point of the other configs (about 150
each) run with ``pytest -m faults`` (``-k quarot`` and the like for one config).
"""

from __future__ import annotations

import inspect
import json
import shutil
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from types import FrameType, ModuleType
from typing import Any

import pytest
from replay import (
    CALIB_TXT,
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
_QUANT = """\
    - type: linear_quant
      qconfig:
        act: {{dtype: int8, scope: {act}, symmetric: {symmetric}, method: minmax}}
        weight: {{dtype: int8, scope: per_channel, symmetric: true, method: minmax}}
"""
_DYNAMIC = _QUANT.format(act="per_token", symmetric="true")
_STATIC = _QUANT.format(act="per_tensor", symmetric="false")
_HEADER = "apiversion: modelslim_v1\nspec:\n  process:\n"
#: The new export's config of each sweep (the default suite kills ``minmax`` runs only).
CONFIGS = {
    "minmax": NEW_YAML,
    "w8a8_static": _HEADER + _STATIC,
    "iter_smooth": _HEADER + "    - type: iter_smooth\n" + _DYNAMIC,
    "flex_smooth": _HEADER + "    - type: flex_smooth_quant\n" + _STATIC,
    "quarot": _HEADER + "    - type: quarot\n" + _DYNAMIC,
    # the model in memory: the checkpoint also keeps the rotated float tensors
    "quarot_model_wise": _HEADER.replace("spec:\n", "spec:\n  runner: model_wise\n")
    + "    - type: quarot\n"
    + _DYNAMIC,
}
#: The calibration every config but ``minmax`` takes (the command line's and the reference's).
CALIBRATION = ("--calib_path", CALIB_TXT, "--max_calib_tokens", "32")


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
    """(point, scenario, config) triples; those outside the default suite marked ``faults``.
    The default kills ``minmax`` runs at the commit steps in checkpointed and unchecked runs,
    and at the checkpoint folder's steps (those of :data:`CHECKPOINT_MODULES`, which restore)
    in resumed runs too."""
    triples = []
    for config in CONFIGS:
        for name in sorted(FUNCTIONS):
            for scenario in SCENARIOS:
                default = (
                    config == "minmax"
                    and name in COMMIT_STEPS
                    and (scenario != "resumed" or name.startswith(CHECKPOINT_MODULES))
                )
                marks = () if default else (pytest.mark.faults,)
                case_id = f"{name}-{scenario}" + ("" if config == "minmax" else f"-{config}")
                triples.append(pytest.param(name, scenario, config, marks=marks, id=case_id))
    return triples


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
def exports(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """The export an uninterrupted run writes: ``old`` (int8, the previous export of every
    case) or the new one of a :data:`CONFIGS` entry (built once, when first asked for)."""
    import msquant

    root = tmp_path_factory.mktemp("exports")
    built: dict[str, Path] = {}

    def build(name: str) -> Path:
        if name not in built:
            config = root / f"{name}.yaml"
            config.write_text(MINMAX_YAML if name == "old" else CONFIGS[name])
            calibration = {} if name in ("old", "minmax") else {"calib_path": CALIB_TXT}
            if calibration:
                calibration["max_calib_tokens"] = 32
            msquant.quantize(tiny_llama, root / name, config, progress=False, **calibration)
            built[name] = root / name
        return built[name]

    return build


def _beside(case: Path) -> list[str]:
    return sorted(p.name for p in case.iterdir() if p.name.startswith(".out"))


def _prepare(
    case: Path, exports: Callable[[str], Path], scenario: str, config: str
) -> list[object]:
    """The case's previous export and command line (the new export of ``config``); for
    ``resumed``, a run killed after its first layer first (the command then resumes it)."""
    shutil.copytree(exports("old"), case / "out")
    (case / "new.yaml").write_text(CONFIGS[config])
    flags = ["--overwrite"] + (["--no_checkpoints"] if scenario == "no_checkpoints" else [])
    if config != "minmax":
        flags += CALIBRATION
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
    exports: Callable[[str], Path], tmp_path_factory: pytest.TempPathFactory, tiny_llama: Path
) -> Callable[[str], dict[str, set[str]]]:
    """The functions each scenario's run of a config enters (one traced run per scenario and
    config, when first asked for)."""
    traced: dict[str, dict[str, set[str]]] = {}

    def trace(config: str) -> dict[str, set[str]]:
        if config in traced:
            return traced[config]
        result = {}
        for scenario in SCENARIOS:
            root = tmp_path_factory.mktemp(f"trace_{config}_{scenario}")
            case = root / "case"
            case.mkdir()
            shutil.copytree(tiny_llama, case / "model")
            (case / "w8.yaml").write_text(MINMAX_YAML)
            args = _prepare(case, exports, scenario, config)
            names = root / "entered.txt"
            record = lambda names=names: _record_entries(names)  # noqa: E731
            assert run_forked(args, root / "run.log", record) == 0
            result[scenario] = set(names.read_text().split())
        traced[config] = result
        return result

    return trace


def test_the_scenarios_enter_the_commit_steps(
    entered: Callable[[str], dict[str, set[str]]],
) -> None:
    traced = entered("minmax")
    for scenario in SCENARIOS:
        for step in ("_commit", "_move_aside", "_move_into_place", "_clean_up"):
            assert f"staging.StagedOutputDir.{step}" in traced[scenario], scenario
        assert "recovery.recover_save_path" in traced[scenario]
    assert "folder.RunCheckpoints.commit_layer" in traced["checkpointed"]
    assert "folder.RunCheckpoints.restore" in traced["resumed"]
    assert "folder.RunCheckpoints.commit_layer" not in traced["no_checkpoints"]


def _transforms(export: Path) -> Any:
    """What the marker records of the export's weight transforms (None: nothing)."""
    return json.loads((export / "msquant_export.json").read_text()).get("transforms")


@pytest.mark.parametrize(("point", "scenario", "config"), _kill_points())
def test_kill_on_entry(
    point: str,
    scenario: str,
    config: str,
    case: Path,
    run_cli: Cli,
    exports: Callable[[str], Path],
    entered: Callable[[str], dict[str, set[str]]],
) -> None:
    if point not in entered(config)[scenario]:
        pytest.skip(f"a {scenario} run does not enter {point}")
    new_export = exports(config)
    old, new = export_files(exports("old")), export_files(new_export)
    args = _prepare(case, exports, scenario, config)
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
    assert _transforms(case / "out") == _transforms(new_export)
    assert _beside(case) == []
