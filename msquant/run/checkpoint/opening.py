"""Deciding, before any work, how a run uses the checkpoint folder of its save path: fresh,
resumed, refused, or not checkpointed at all.
"""

from __future__ import annotations

import logging
import shutil
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from msquant.contracts.distributed import SINGLE, Distributed
from msquant.contracts.processor import flatten_processors
from msquant.errors import OutputPathError
from msquant.export.recovery import owned_dir_problem
from msquant.run.agree import agree
from msquant.run.checkpoint.fingerprint import fingerprint_differences
from msquant.run.checkpoint.folder import RunCheckpoints
from msquant.run.checkpoint.layout import PROGRESS_FILE, ResumeError, partial_path
from msquant.run.checkpoint.progress import describe_progress, read_progress

if TYPE_CHECKING:
    from msquant.contracts.processor import Processor

__all__ = ["checkpoint_blocker", "open_checkpoints"]

logger = logging.getLogger(__name__)


def checkpoint_blocker(processors: Sequence[Processor], enabled: bool = True) -> str | None:
    """Why this run cannot be checkpointed, or None when it can (the same in every process of a
    ``dp_layer_wise`` group: pass all the run's processors, savers included)."""
    if not enabled:
        return "checkpoints are turned off (--no_checkpoints; Python: checkpoints=False)"
    for processor in flatten_processors(processors):
        if not processor.resumable:
            return (
                f"processor {processor.type_name} cannot be resumed (it does not set "
                "Processor.resumable)"
            )
    return None


def _discard(directory: Path) -> None:
    """Remove an interrupted run's folder (its owner checked already; the caller holds the save
    path's lock, so no run uses it; process 0 of a ``dp_layer_wise`` group alone gets here)."""
    shutil.rmtree(directory, ignore_errors=True)


def open_checkpoints(
    save_path: str | Path,
    fingerprint: Mapping[str, Any],
    *,
    resume: bool,
    overwrite: bool,
    blocker: str | None,
    dist: Distributed = SINGLE,
) -> RunCheckpoints | None:
    """Decide, before any work, how this run uses the checkpoint folder of ``save_path``.

    In a ``dp_layer_wise`` group process 0 decides (it alone reads and changes the folder) and
    every process gets its decision or its error; every process must call this.

    :param fingerprint: the run's :func:`run_fingerprint` (the number of processes is added here).
    :param blocker: why this run cannot be checkpointed (:func:`checkpoint_blocker`), or None.
    :returns: the run's checkpoints (resuming or fresh), or None when it is not checkpointed.
    :raises ResumeError: ``resume`` with nothing to resume, another run's inputs (another number
        of processes included), an unreadable checkpoint or a run that cannot be checkpointed; or
        an interrupted run left for this save path while neither ``resume`` nor ``overwrite``
        says what to do with it.
    """
    fingerprint = {**fingerprint, "world_size": dist.world_size}
    directory = partial_path(save_path)
    decision: tuple[bool, dict[str, Any] | None] | None = None
    error: Exception | None = None
    if dist.is_main:
        try:
            decision = _decide(save_path, directory, fingerprint, resume, overwrite, blocker)
        except Exception as caught:  # every process must learn of it
            error = caught
    agree(dist, error)
    decision = dist.broadcast_object(decision, 0)
    assert decision is not None
    checkpointed, progress = decision
    if not checkpointed:
        return None
    return RunCheckpoints(directory, fingerprint, progress, dist)


def _decide(
    save_path: str | Path,
    directory: Path,
    fingerprint: Mapping[str, Any],
    resume: bool,
    overwrite: bool,
    blocker: str | None,
) -> tuple[bool, dict[str, Any] | None]:
    """What :func:`open_checkpoints` does with the folder: (checkpointed, checkpoint to resume)."""
    problem = owned_dir_problem(directory, "msquant's checkpoint folder of this save path")
    if problem is not None:
        raise OutputPathError(problem)
    interrupted = (directory / PROGRESS_FILE).is_file()
    if resume and blocker is not None:
        raise ResumeError(f"--resume: this run is not checkpointed: {blocker}")
    if resume:
        return True, _resume_progress(save_path, directory, fingerprint, interrupted)
    if interrupted and not overwrite:
        raise ResumeError(
            f"an interrupted run of {Path(save_path)} is kept in {directory} ({describe_progress(directory)}): "
            "add --resume (Python: resume=True) to continue it, or --overwrite to start over "
            "and discard it"
        )
    if interrupted:
        logger.warning(
            "--overwrite: discarding the interrupted run in %s (%s)",
            directory,
            describe_progress(directory),
        )
    if blocker is not None:
        if directory.exists():
            _discard(directory)
        logger.info("no checkpoints: %s", blocker)
        return False, None
    return True, None


def _resume_progress(
    save_path: str | Path, directory: Path, fingerprint: Mapping[str, Any], interrupted: bool
) -> dict[str, Any] | None:
    """The checkpoint ``--resume`` continues from (None: start from the first layer)."""
    if not directory.is_dir():
        raise ResumeError(
            f"--resume: there is no interrupted run of {Path(save_path)} to resume (no {directory}); "
            "run without --resume"
        )
    if not interrupted:
        logger.warning(
            "--resume: the interrupted run in %s had not finished a layer; starting from the first",
            directory,
        )
        return None
    progress = read_progress(directory)
    differences = fingerprint_differences(progress.get("fingerprint", {}), fingerprint)
    if differences:
        raise ResumeError(
            f"--resume: the interrupted run in {directory} was started with other inputs, so its "
            "layers cannot be reused:\n"
            + "\n".join(f"  - {line}" for line in differences)
            + "\nrerun with the same inputs and --resume, or drop --resume and pass --overwrite "
            "to start over"
        )
    return progress
