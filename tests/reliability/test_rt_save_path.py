"""Red-team replays: save paths that held data msquant must not delete (S-rows).

Before issue 14 a folder counted as "a previous export" when any of several marker files was in
it, the save path was checked only before the run, and the checkpoint folder beside it was
emptied without asking what it was: the float model, user notes inside an export, files added
during a run and a planted symlink's target were deleted.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import pytest
from replay import Cli, quant_args, replay

import msquant.export.staging
import msquant.run.steps


def _export(case: Path, run_cli: Cli, *extra: object) -> None:
    assert replay(run_cli, case, *quant_args(case, *extra)).code == 0


@pytest.mark.parametrize("where", ["same", "inside", "containing"])
def test_s2_s3_the_model_folder_is_never_a_save_path(case: Path, run_cli: Cli, where: str) -> None:
    """S2: the model folder with a quantize_config.json (as GPTQ-era repos ship) and notes,
    --overwrite: the float model and the notes were deleted."""
    model = case / "model"
    (model / "quantize_config.json").write_text('{"bits": 4}')
    (model / "NOTES.md").write_text("mine")
    save = {"same": model, "inside": model / "quant_out", "containing": case}[where]
    expected = {
        "same": "is the model folder",
        "inside": "lies inside the model folder",
        "containing": "contains the model folder",
    }[where]
    outcome = replay(run_cli, case, *quant_args(case, "--save_path", save, "--overwrite"))
    outcome.refused(rf"save path .* {expected} .*: .*choose a folder outside the model")


def test_s6_overwrite_keeps_user_files_inside_an_export(case: Path, run_cli: Cli) -> None:
    """Notes and evaluation results kept in an export folder were deleted by --overwrite."""
    _export(case, run_cli)
    (case / "out" / "NOTES.md").write_text("precious")
    (case / "out" / "eval_results").mkdir()
    (case / "out" / "eval_results" / "run1.json").write_text("{}")
    replay(run_cli, case, *quant_args(case, "--overwrite")).refused(
        r"holds a previous export and 2 entries msquant did not write \(NOTES\.md, "
        r"eval_results/\); replacing the export would delete them: move them out"
    )


def test_s6_a_folder_of_another_tool_is_not_an_export(case: Path, run_cli: Cli) -> None:
    """Only msquant's own marker, listing every file, makes a folder replaceable."""
    out = case / "out"
    out.mkdir()
    (out / "quant_model_description.json").write_text("{}")  # msModelSlim's file, not ours
    replay(run_cli, case, *quant_args(case, "--overwrite")).refused(
        r"does not hold a previous export \(no msquant_export\.json"
    )


def test_s8_a_clean_previous_export_is_replaced(case: Path, run_cli: Cli) -> None:
    _export(case, run_cli)
    before = (case / "out" / "msquant_export.json").read_text()
    outcome = replay(run_cli, case, *quant_args(case, "--overwrite"))
    outcome.succeeded()
    assert outcome.added == outcome.removed == []
    assert (case / "out" / "msquant_export.json").read_text() == before


def test_s11_an_undeletable_previous_export_is_reported(
    case: Path, run_cli: Cli, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A previous export that cannot be deleted (chattr +i) was left hidden without a word."""
    _export(case, run_cli)
    rmtree = shutil.rmtree

    def undeletable_old_export(path: Any, *args: Any, **kwargs: Any) -> None:
        if ".msquant-old-" not in str(path):
            rmtree(path, *args, **kwargs)

    monkeypatch.setattr(msquant.export.staging.shutil, "rmtree", undeletable_old_export)
    outcome = replay(run_cli, case, *quant_args(case, "--overwrite"))
    assert outcome.code == 0
    old = [p for p in outcome.added if "/" not in p]
    assert len(old) == 1 and old[0].startswith(".out.msquant-old-")
    assert (
        f"could not delete all of the previous export, moved aside to {case / old[0]}"
        in outcome.err
    )


@pytest.mark.parametrize("kind", ["empty", "export", "dangling"])
def test_s13_to_s15_a_symlinked_save_path_is_refused_before_the_run(
    case: Path, run_cli: Cli, kind: str
) -> None:
    """The link was replaced by a folder (S13, S14), or the run crashed at its end (S15)."""
    target = case / "elsewhere"
    if kind == "empty":
        target.mkdir()
    elif kind == "export":
        _export(case, run_cli, "--save_path", target)
    os.symlink(target, case / "out")
    replay(run_cli, case, *quant_args(case, "--overwrite")).refused(
        rf"save path .*out is a symbolic link \(to {target}\).*pass the real folder path"
    )


def test_s16_a_user_folder_named_like_the_checkpoint_folder(case: Path, run_cli: Cli) -> None:
    planted = case / ".out.msquant-partial"
    (planted / "sub").mkdir(parents=True)
    (planted / "important.txt").write_text("mine")
    (planted / "sub" / "x").write_text("mine too")
    replay(run_cli, case, *quant_args(case)).refused(
        r"\.out\.msquant-partial \(msquant's checkpoint folder of this save path\) exists but "
        r"msquant did not create it"
    )


def test_s17_a_planted_symlink_cannot_make_a_run_delete_its_target(
    case: Path, run_cli: Cli
) -> None:
    """In a shared folder anyone could plant the link; the victim's next run emptied its target."""
    victim = case / "victim_home"
    (victim / "photos").mkdir(parents=True)
    (victim / "doc1.txt").write_text("data")
    os.symlink(victim, case / ".out.msquant-partial")
    replay(run_cli, case, *quant_args(case)).refused(
        r"\.out\.msquant-partial .* is a symbolic link to"
    )
    replay(run_cli, case, *quant_args(case, "--overwrite")).refused(r"is a symbolic link to")
    replay(run_cli, case, *quant_args(case, "--resume")).refused(r"is a symbolic link to")


def test_s18_a_file_named_like_the_checkpoint_folder(case: Path, run_cli: Cli) -> None:
    (case / ".out.msquant-partial").write_text("a file")
    replay(run_cli, case, *quant_args(case)).refused(
        r"exists and is a file, not a folder msquant created"
    )


def test_s19_the_current_directory_is_refused(
    case: Path, run_cli: Cli, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The export was committed, then the run exited 1 (its cwd had been swapped away)."""
    here = case / "a" / "b"
    here.mkdir(parents=True)
    monkeypatch.chdir(here)
    for save in (".", ".."):
        replay(run_cli, case, *quant_args(case, "--save_path", save)).refused(
            r"save path .* is the current directory or contains it: .*pass a new folder instead"
        )


def _drop_files_during_the_run(monkeypatch: pytest.MonkeyPatch, save: Path) -> None:
    """Files appear in the save path after the export files are written, before the swap."""
    write_marker = msquant.run.steps.mark_export

    def then_a_user_writes(*args: Any) -> None:
        write_marker(*args)
        (save / "mydata").mkdir(parents=True, exist_ok=True)
        (save / "user_notes.txt").write_text("mine")
        (save / "mydata" / "results.csv").write_text("1,2")

    monkeypatch.setattr(msquant.run.steps, "mark_export", then_a_user_writes)


def test_s20_files_added_during_a_run_are_kept(
    case: Path, run_cli: Cli, monkeypatch: pytest.MonkeyPatch
) -> None:
    """They were deleted at the final swap, without --overwrite ever being given. The finished
    export is kept beside the save path instead."""
    _drop_files_during_the_run(monkeypatch, case / "out")
    outcome = replay(run_cli, case, *quant_args(case, "--no_checkpoints"))
    assert outcome.code == 2
    outcome.one_error(
        r"save path .*out is a non-empty directory that does not hold a previous export.*\n"
        r"the finished export is kept in .*\.out\.msquant-kept-\w+/export; move it"
    )
    assert (case / "out" / "user_notes.txt").read_text() == "mine"
    assert (case / "out" / "mydata" / "results.csv").read_text() == "1,2"
    kept = [p for p in case.iterdir() if p.name.startswith(".out.msquant-kept-")]
    assert len(kept) == 1 and (kept[0] / "export" / "msquant_export.json").is_file()
    assert sorted(p.name for p in case.iterdir() if p.name.startswith(".out")) == [kept[0].name]


def test_s20_a_checkpointed_run_moves_its_export_in_with_resume(
    case: Path, run_cli: Cli, monkeypatch: pytest.MonkeyPatch, exported: Any
) -> None:
    with monkeypatch.context() as patch:
        _drop_files_during_the_run(patch, case / "out")
        outcome = replay(run_cli, case, *quant_args(case))
    assert outcome.code == 2
    outcome.one_error(
        r"the finished export is kept in .*\.out\.msquant-partial: once the save "
        r"path is cleared, run the same command with --resume"
    )
    assert (case / "out" / "user_notes.txt").read_text() == "mine"
    shutil.move(case / "out", case / "moved_away")
    resumed = replay(run_cli, case, *quant_args(case, "--resume"))
    resumed.succeeded()
    assert "resuming after the export files were written" in resumed.err
    assert sorted(p.name for p in case.iterdir() if p.name.startswith(".")) == []
    from replay import export_files

    assert export_files(case / "out") == export_files(exported())


def test_recovery_touches_only_its_own_save_paths_folders(case: Path, run_cli: Cli) -> None:
    """A save path named like a glob pattern (``out[1]``) must not take ``out1``'s folders for
    stale ones of its own: those may belong to a run of ``out1`` going on right now."""
    from msquant.export.recovery import make_owned_dir

    other = case / ".out1.msquant-staging-abcd1234"
    make_owned_dir(other, "staging folder of an export")
    mine = case / ".out[1].msquant-staging-abcd1234"
    make_owned_dir(mine, "staging folder of an export")
    outcome = replay(run_cli, case, *quant_args(case, "--save_path", case / "out[1]"))
    outcome.succeeded()
    assert other.is_dir() and not mine.exists()
