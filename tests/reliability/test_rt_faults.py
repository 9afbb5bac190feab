"""Red-team replays: kills, signals, a full disk, damaged checkpoints and concurrent runs
(F-rows). Kills are real: a forked child SIGKILLs itself on entering the named function."""

from __future__ import annotations

import errno
import shutil
import signal
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from replay import (
    GPTQ_YAML,
    KILLED,
    Cli,
    export_files,
    kill_on_entry,
    needs_fork,
    on_entry,
    pause_on_entry,
    quant_args,
    replay,
    run_forked,
)
from safetensors import SafetensorError

import msquant.export.shards
import msquant.run.checkpoint.durable
import msquant.run.checkpoint.opening
from msquant.export.staging import StagedOutputDir
from msquant.load.streaming import StreamedWeights
from msquant.run.checkpoint.folder import RunCheckpoints

pytestmark = needs_fork
# What a killed run leaves and the next run removes: its lock file, its scratch folders.
KILLED_LEFTOVERS = [".out.msquant-lock", ".out.msquant-partial/.msquant-scratch-"]


def _beside(case: Path) -> list[str]:
    """What lies beside the save path: msquant's hidden folders and files, if any."""
    return sorted(p.name for p in case.iterdir() if p.name.startswith(".out"))


def _hidden_temporaries(out: Path) -> list[str]:
    return sorted(p.name for p in out.rglob(".*") if p.name.endswith(".tmp"))


def test_f6_kill_at_the_finished_checkpoint_leaves_no_temporaries(
    case: Path, run_cli: Cli, exported: Any
) -> None:
    """Killed after progress.json said "finished", before the writers' temporaries went: the
    resumed export shipped 12 MB of hidden .tmp files."""
    args = quant_args(case)
    killed = run_forked(
        args,
        case.parent / "run.log",
        lambda: kill_on_entry(msquant.export.shards.remove_temporaries),
    )
    assert killed == KILLED
    resumed = replay(run_cli, case, *args, "--resume")
    resumed.succeeded()
    assert "resuming after the export files were written" in resumed.err
    assert _hidden_temporaries(case / "out") == []
    assert export_files(case / "out") == export_files(exported())
    assert _beside(case) == []


@pytest.mark.parametrize("rerun", [[], ["--resume"], ["--overwrite"]])
def test_f6b_kill_after_the_swap_leaves_no_stale_checkpoint(
    case: Path, run_cli: Cli, exported: Any, rerun: list[str]
) -> None:
    """Killed after the export was moved into place, before the checkpoint folder went: 4.9 MB
    stayed, and both the same command and --resume were refused with misleading messages."""
    args = quant_args(case)
    assert (
        run_forked(args, case.parent / "run.log", lambda: kill_on_entry(StagedOutputDir._clean_up))
        == KILLED
    )
    assert export_files(case / "out") == export_files(exported())
    outcome = replay(run_cli, case, *args, *rerun)
    assert (
        "removed the checkpoint folder" in outcome.err
        and "killed after its export was in place" in outcome.err
    )
    if rerun == ["--overwrite"]:
        outcome.succeeded()
    else:
        assert outcome.code == 2
        outcome.one_error("holds a previous export; pass --overwrite")  # it is there, complete
    assert _beside(case) == []
    assert export_files(case / "out") == export_files(exported())


@pytest.mark.parametrize("rerun", [["--overwrite"], ["--overwrite", "--resume"]])
def test_f8_kill_between_the_two_renames_of_the_swap(
    case: Path, run_cli: Cli, exported: Any, rerun: list[str]
) -> None:
    """The previous export sat hidden in .out.msquant-old-* forever and the save path was empty."""
    (case / "gptq.yaml").write_text(GPTQ_YAML)
    assert replay(run_cli, case, *quant_args(case, config="gptq.yaml")).code == 0  # the old export
    old = export_files(case / "out")
    args = quant_args(case, "--overwrite")
    assert (
        run_forked(
            args, case.parent / "run.log", lambda: kill_on_entry(StagedOutputDir._move_into_place)
        )
        == KILLED
    )
    assert not (case / "out").exists()  # the window: the old export is aside, the new not in
    outcome = replay(run_cli, case, *quant_args(case, *rerun))
    assert "restored the previous export" in outcome.err
    outcome.succeeded()
    assert export_files(case / "out") == export_files(exported()) != old
    assert _beside(case) == []


def test_f8_the_restored_export_is_the_old_one(case: Path, run_cli: Cli) -> None:
    """A run refused after the recovery leaves the old export in place, untouched."""
    assert replay(run_cli, case, *quant_args(case)).code == 0
    old = export_files(case / "out")
    args = quant_args(case, "--overwrite")
    assert (
        run_forked(
            args, case.parent / "run.log", lambda: kill_on_entry(StagedOutputDir._move_into_place)
        )
        == KILLED
    )
    outcome = replay(run_cli, case, *quant_args(case))  # no --overwrite: recovered, then refused
    assert outcome.code == 2 and "restored the previous export" in outcome.err
    outcome.one_error("holds a previous export; pass --overwrite")
    assert export_files(case / "out") == old
    assert _beside(case) == [".out.msquant-partial"]  # the new run's work, for --resume


@pytest.mark.parametrize("where", ["materialize", "staging"])
def test_f10_a_killed_run_without_checkpoints_leaves_nothing_for_long(
    case: Path, run_cli: Cli, where: str
) -> None:
    """Its staging and scratch folders accumulated: no later run removed them."""
    args = quant_args(case, "--no_checkpoints")
    point = StreamedWeights.materialize if where == "materialize" else StagedOutputDir._commit
    assert (
        run_forked(
            args,
            case.parent / "run.log",
            lambda: kill_on_entry(point, call=2 if where == "materialize" else 1),
        )
        == KILLED
    )
    left = _beside(case)
    assert any(".msquant-staging-" in name for name in left), left
    if where == "materialize":
        assert any(".msquant-scratch-" in name for name in left), left
    replay(run_cli, case, *args).succeeded()
    assert _beside(case) == []


def test_f12_sigterm_keeps_the_work_and_says_how_to_resume(
    case: Path, run_cli: Cli, exported: Any
) -> None:
    """SIGTERM (a scheduler's preemption) died on the default handler, without the hint."""
    args = quant_args(case)
    log = case.parent / "run.log"
    code = run_forked(
        args,
        log,
        lambda: on_entry(
            RunCheckpoints.commit_layer, lambda: signal.raise_signal(signal.SIGTERM), call=2
        ),
    )
    assert code == 143
    text = log.read_text()
    assert "msquant: terminated (SIGTERM); nothing was written to the save path" in text
    assert "run the same command with --resume to continue" in text
    resumed = replay(run_cli, case, *args, "--resume")
    resumed.succeeded()
    assert export_files(case / "out") == export_files(exported())


def test_f17_a_resume_with_another_model_names_both_paths_whole(case: Path, run_cli: Cli) -> None:
    args = quant_args(case)
    assert (
        run_forked(
            args,
            case.parent / "run.log",
            lambda: kill_on_entry(RunCheckpoints.commit_layer, call=2),
        )
        == KILLED
    )
    shutil.copytree(case / "model", case / "model_copy")
    resumed = quant_args(case, "--resume")
    resumed[resumed.index(case / "model")] = case / "model_copy"
    replay(run_cli, case, *resumed).refused(
        rf"model path: {case / 'model'} then, {case / 'model_copy'} now", stale=KILLED_LEFTOVERS
    )


def test_f19_a_damaged_checkpoint_is_refused_and_kept(case: Path, run_cli: Cli) -> None:
    """The docs said "nothing changed", but the refusal deleted the folder."""
    args = quant_args(case)
    assert (
        run_forked(
            args,
            case.parent / "run.log",
            lambda: kill_on_entry(RunCheckpoints.commit_layer, call=2),
        )
        == KILLED
    )
    layer = case / ".out.msquant-partial" / "layers" / "00000.safetensors"
    layer.write_bytes(b"\x80\x04not a safetensors file but a pickle")
    replay(run_cli, case, *args, "--resume").refused(
        r"00000\.safetensors is missing or damaged", stale=KILLED_LEFTOVERS
    )
    replay(run_cli, case, *args, "--overwrite").succeeded()  # as the message says
    assert _beside(case) == []


def test_f21_a_damaged_hidden_state_checkpoint_is_refused(case: Path, run_cli: Cli) -> None:
    """A bit-flipped hidden-state file resumed silently to another export."""
    args = quant_args(case, config="gptq.yaml")
    assert (
        run_forked(
            args,
            case.parent / "run.log",
            lambda: kill_on_entry(RunCheckpoints.commit_layer, call=2),
        )
        == KILLED
    )
    [hidden] = (case / ".out.msquant-partial").glob("hidden-*.safetensors")
    data = bytearray(hidden.read_bytes())
    data[-100] ^= 0xFF
    hidden.write_bytes(bytes(data))
    replay(run_cli, case, *args, "--resume").refused(
        r"the hidden states of the checkpoint .* missing or damaged", stale=KILLED_LEFTOVERS
    )


@pytest.mark.parametrize("how", ["oserror", "safetensors"])
def test_f22_a_full_disk_is_one_message(
    case: Path, run_cli: Cli, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    """A traceback and "please report it" for ENOSPC; the clean-up was already right."""
    if how == "oserror":

        def full(*args: Any) -> None:
            raise OSError(errno.ENOSPC, "No space left on device")

        monkeypatch.setattr(
            msquant.export.shards.ShardedSafetensorsWriter, "_append", staticmethod(full)
        )
    else:

        def full_rust(*args: Any, **kwargs: Any) -> None:
            raise SafetensorError(
                "Error while serializing: I/O error: No space left on device (os error 28)"
            )

        monkeypatch.setattr(msquant.run.checkpoint.durable, "save_file", full_rust)
    replay(run_cli, case, *quant_args(case)).refused(
        r"the disk is full \(.*No space left on device.*\); free space, or choose a --save_path"
    )


@pytest.mark.parametrize("first_flags", [["--no_checkpoints"], []])
def test_f23_f24_two_runs_on_one_save_path(
    case: Path, run_cli: Cli, first_flags: list[str]
) -> None:
    """With --no_checkpoints both runs exited 0 and the later silently replaced the earlier."""
    ready, go = case.parent / "ready", case.parent / "go"
    first = quant_args(case, *first_flags)
    log = case.parent / "first.log"
    codes: list[int] = []

    def first_run() -> None:  # paused with the save path locked, until the second run is done
        pause = lambda: pause_on_entry(msquant.run.checkpoint.opening.open_checkpoints, ready, go)  # noqa: E731
        codes.append(run_forked(first, log, pause))

    thread = threading.Thread(target=first_run)
    thread.start()
    deadline = time.monotonic() + 60
    while not ready.exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert ready.exists(), log.read_text()
    second = replay(run_cli, case, *quant_args(case, "--no_checkpoints"))
    go.touch()
    thread.join()
    assert codes == [0], log.read_text()
    assert second.code == 2
    second.one_error(r"another msquant run is writing to .*out \(it holds .*\.out\.msquant-lock\)")
    assert second.added == second.removed == second.changed == []  # the first run is paused
    assert (case / "out" / "msquant_export.json").is_file()
    assert _beside(case) == []
