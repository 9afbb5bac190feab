"""Atomic output directories: write everything into a staging folder, then swap it into place.

A failed or interrupted run removes its staging folder and leaves the save path exactly as it was.
A resumable run (:mod:`msquant.resume`) stages into a folder it owns and keeps across runs
(``staging=``): that folder is then left in place on failure, for its owner to keep or remove.
A previous export at the save path is replaced only when the caller asks for it (``overwrite``,
the CLI's ``--overwrite``), and only after the new one is complete. A folder holding anything
else is never touched.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from pathlib import Path
from types import TracebackType

from msquant.errors import OutputPathError

__all__ = ["EXPORT_MARKERS", "check_save_path", "StagedOutputDir"]

logger = logging.getLogger(__name__)

# Files that identify a folder as a previous msquant/msModelSlim export, which may be replaced.
EXPORT_MARKERS = ("quant_model_description*.json", "quantize_config.json", "msquant_export.json")


def _is_previous_export(directory: Path) -> bool:
    return any(any(directory.glob(pattern)) for pattern in EXPORT_MARKERS)


def check_save_path(save_path: str | Path, overwrite: bool = False) -> Path:
    """Validate a save path before any work starts.

    Accepted: a path that does not exist yet (its parent is created), an empty directory, or, with
    ``overwrite``, a directory holding a previous export (replaced on success).

    :raises OutputPathError: when the path is a file, holds a previous export and ``overwrite`` is
        false, holds unrelated files (even with ``overwrite``), or cannot be written.
    """
    path = Path(save_path).expanduser().absolute()
    if path.exists() and not path.is_dir():
        raise OutputPathError(f"save path {path} exists and is a file; pass a directory path")
    if path.is_dir() and any(path.iterdir()):
        if not _is_previous_export(path):
            raise OutputPathError(
                f"save path {path} is a non-empty directory that does not hold a previous export; "
                "choose a new or empty directory so that no unrelated file is overwritten"
            )
        if not overwrite:
            raise OutputPathError(
                f"save path {path} holds a previous export; pass --overwrite (Python: "
                "overwrite=True) to replace it once the new export is complete, or choose another path"
            )
    ancestor = path.parent
    while not ancestor.exists():
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise OutputPathError(f"cannot create {path}: {ancestor} is a file")
    if not os.access(ancestor, os.W_OK | os.X_OK):
        raise OutputPathError(f"cannot write to {ancestor} (permission denied)")
    return path


class StagedOutputDir:
    """Context manager yielding a staging folder beside ``save_path``; committed on clean exit.

    Usage::

        with StagedOutputDir(save_path) as staging:
            write_everything_into(staging)
        # save_path now holds exactly what was written; on an exception it is untouched

    :param staging: stage into this folder (created if missing, its contents kept) instead of a
        new random one; on failure it is left as it is, for the caller to keep (a resumable run's
        checkpoints) or remove. It must be on the file system of the save path.
    """

    def __init__(
        self, save_path: str | Path, overwrite: bool = False, staging: Path | None = None
    ) -> None:
        self.target = check_save_path(save_path, overwrite)
        self.caller_staging = staging
        self.staging: Path | None = None

    def __enter__(self) -> Path:
        self.target.parent.mkdir(parents=True, exist_ok=True)
        if self.caller_staging is not None:
            self.caller_staging.mkdir(parents=True, exist_ok=True)
            self.staging = self.caller_staging
            return self.staging
        self.staging = Path(
            tempfile.mkdtemp(prefix=f".{self.target.name}.msquant-staging-", dir=self.target.parent)
        )
        return self.staging

    @staticmethod
    def _apply_umask(directory: Path) -> None:
        """Give the export ordinary permissions (mkdtemp and some writers create owner-only files)."""
        umask = os.umask(0)
        os.umask(umask)
        directory.chmod(0o777 & ~umask)
        for path in directory.rglob("*"):
            path.chmod((0o777 if path.is_dir() else 0o666) & ~umask)

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        assert self.staging is not None
        if exc_type is not None:
            if self.caller_staging is None:
                shutil.rmtree(self.staging, ignore_errors=True)
            return
        self._commit(self.staging)

    def _commit(self, staging: Path) -> None:
        self._apply_umask(staging)
        backup: Path | None = None
        if self.target.exists():
            backup = Path(
                tempfile.mkdtemp(prefix=f".{self.target.name}.msquant-old-", dir=self.target.parent)
            )
            os.rmdir(backup)
            os.replace(self.target, backup)
        try:
            os.replace(staging, self.target)
        except OSError:
            if backup is not None:
                os.replace(backup, self.target)
            shutil.rmtree(staging, ignore_errors=True)
            raise
        if backup is not None:
            shutil.rmtree(backup, ignore_errors=True)
        logger.info("output written to %s", self.target)
