"""How a run holds its save path: what a killed run left beside it recovered first, the lock held
until the export is in place, and the folder the savers write into.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from msquant.contracts.distributed import Distributed
from msquant.errors import OutputPathError
from msquant.export.recovery import SavePathLock, recover_save_path
from msquant.export.staging import StagedOutputDir, check_save_path
from msquant.run.agree import agree
from msquant.run.checkpoint.folder import RunCheckpoints

__all__ = ["recover_early", "locked_save_path", "output_folder"]


def recover_early(target: Path) -> None:
    """Finish or undo what a killed run left beside the save path before it is checked, so that
    the check sees the save path as the killed run should have left it (a previous export put
    back, a finished export's stale checkpoint folder gone). Skipped while another run holds
    the save path (the check refuses this run then anyway)."""
    if not target.parent.is_dir():
        return
    try:
        with SavePathLock(target):
            recover_save_path(target)
    except OutputPathError:
        return


@contextmanager
def locked_save_path(
    target: Path,
    overwrite: bool,
    model_path: str | Path,
    dist: Distributed,
    open_run_checkpoints: Callable[[], RunCheckpoints | None],
) -> Iterator[RunCheckpoints | None]:
    """Hold the save path's lock for the rest of the run (process 0 of a ``dp_layer_wise``
    group; every process learns whether it got it): recover what a killed run left beside the
    save path, check the save path again (recovery may have put a previous export back), then
    decide how the run uses its checkpoint folder (``open_run_checkpoints``), which it yields."""
    lock = SavePathLock(target) if dist.is_main else None
    error: Exception | None = None
    if lock is not None:
        try:
            lock.__enter__()
        except Exception as caught:
            error, lock = caught, None
    try:
        if lock is not None:
            try:
                recover_save_path(target)
                check_save_path(target, overwrite, model_path)
            except Exception as caught:
                error = caught
        agree(dist, error)
        yield open_run_checkpoints()
    finally:
        if lock is not None:
            lock.__exit__(None, None, None)


@contextmanager
def output_folder(
    target: Path,
    overwrite: bool,
    dist: Distributed,
    checkpoints: RunCheckpoints | None = None,
) -> Iterator[Path]:
    """Process 0 writes into the staging folder of the save path; the other processes of a
    ``dp_layer_wise`` group run no saver and get an empty scratch folder. A checkpointed run
    stages in its checkpoint folder, kept when the run is killed (:mod:`msquant.run.checkpoint`)."""
    if checkpoints is not None and dist.is_main:
        with StagedOutputDir(
            target,
            overwrite,
            staging=checkpoints.export_dir,
            checkpoint_dir=checkpoints.directory,
        ) as staging:
            yield staging
    elif dist.is_main:
        with StagedOutputDir(target, overwrite) as staging:
            yield staging
    else:
        with tempfile.TemporaryDirectory(prefix=".msquant-worker-") as scratch:
            yield Path(scratch)
