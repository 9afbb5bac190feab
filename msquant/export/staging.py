"""Atomic output directories: write everything into a staging folder, then swap it into place.

A failed or interrupted run removes its staging folder and leaves the save path exactly as it was.
A resumable run (:mod:`msquant.run.checkpoint`) stages into a folder it owns and keeps across runs
(``staging=``): that folder is then left in place on failure, for its owner to keep or remove.

The final swap checks the save path again (:func:`~msquant.export.save_path.save_path_problem`):
files that appeared in it during the run make the swap refused, and the finished export is kept
beside it instead of deleting them. A previous export is replaced only when the caller asks for
it (``overwrite``, the CLI's ``--overwrite``). The swap is journaled
(:mod:`msquant.export.recovery`): a process killed between its steps leaves either the previous
export or the new one at the save path once the next run has recovered.
"""

from __future__ import annotations

import errno
import logging
import os
import secrets
import shutil
import tempfile
from pathlib import Path
from types import TracebackType

from msquant.errors import OutputPathError
from msquant.export.recovery import (
    KEPT_INFIX,
    OLD_INFIX,
    STAGING_INFIX,
    mark_owned,
    remove_journal,
    sibling,
    write_journal,
)
from msquant.export.save_path import check_save_path, save_path_problem

__all__ = ["CommitRefusedError", "StagedOutputDir", "check_save_path"]

logger = logging.getLogger(__name__)

EXPORT_SUBDIR = "export"


class CommitRefusedError(OutputPathError):
    """The export is complete, but the save path changed during the run so that replacing it
    would delete files msquant did not write; the export is kept (the message says where)."""


class StagedOutputDir:
    """Context manager yielding a staging folder beside ``save_path``; committed on clean exit.

    Usage::

        with StagedOutputDir(save_path) as staging:
            write_everything_into(staging)
        # save_path now holds exactly what was written; on an exception it is untouched

    Hold the save path's :class:`~msquant.export.recovery.SavePathLock` around it, so that no
    other run writes to the same save path.

    :param staging: stage into this folder (created if missing, its contents kept) instead of a
        new one; on failure it is left as it is, for the caller to keep (a resumable run's
        checkpoints) or remove. It must be on the file system of the save path.
    :param checkpoint_dir: the checkpoint folder ``staging`` lies in, removed once the export is
        in place (as a journaled step of the swap, so that a kill cannot leave it stale).
    """

    def __init__(
        self,
        save_path: str | Path,
        overwrite: bool = False,
        staging: Path | None = None,
        *,
        checkpoint_dir: Path | None = None,
    ) -> None:
        self.target = check_save_path(save_path, overwrite)
        self.overwrite = overwrite
        self.caller_staging = staging
        self.checkpoint_dir = checkpoint_dir
        self.staging: Path | None = None
        self._holder: Path | None = None  # the owned folder holding a staging folder of ours

    def __enter__(self) -> Path:
        self.target.parent.mkdir(parents=True, exist_ok=True)
        if self.caller_staging is not None:
            self.caller_staging.mkdir(parents=True, exist_ok=True)
            self.staging = self.caller_staging
            return self.staging
        self._holder = _new_sibling(self.target, STAGING_INFIX)
        mark_owned(self._holder, "staging folder of an export")
        self.staging = self._holder / EXPORT_SUBDIR
        self.staging.mkdir()
        return self.staging

    @staticmethod
    def _apply_umask(directory: Path) -> None:
        """Give the export ordinary permissions (mkdtemp and some writers create owner-only files)."""
        umask = os.umask(0)
        os.umask(umask)
        directory.chmod(0o777 & ~umask)
        for path in directory.rglob("*"):
            if not path.is_symlink():
                path.chmod((0o777 if path.is_dir() else 0o666) & ~umask)

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        assert self.staging is not None
        if exc_type is not None:
            if self._holder is not None:
                shutil.rmtree(self._holder, ignore_errors=True)
            return
        self._commit(self.staging)

    # -- the swap: each step a function of its own (the fault-injection tests kill at each) -------

    def _commit(self, staging: Path) -> None:
        """Check the save path again, then swap the export into place (journaled)."""
        self._apply_umask(staging)
        problem = save_path_problem(self.target, self.overwrite)
        if problem is not None:
            self._refuse(problem)
        replacing = self.target.is_dir() and any(self.target.iterdir())
        backup = _free_sibling(self.target, OLD_INFIX) if replacing else None
        stat = os.lstat(staging)
        write_journal(
            self.target,
            {
                "staging_inode": [stat.st_dev, stat.st_ino],
                "backup": None if backup is None else backup.name,
                "checkpoint": self.checkpoint_dir is not None,
            },
        )
        try:
            if backup is not None:
                self._move_aside(backup)
            self._move_into_place(staging)
        except OSError as error:
            if backup is not None and os.path.lexists(backup) and not os.path.lexists(self.target):
                os.replace(backup, self.target)
            remove_journal(self.target)
            if error.errno in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR, errno.EISDIR):
                self._refuse(f"save path {self.target} changed during the final swap ({error})")
            raise
        self._clean_up(backup)
        remove_journal(self.target)
        logger.info("output written to %s", self.target)

    def _move_aside(self, backup: Path) -> None:
        """Move the previous export out of the way (it is deleted once the new one is in place)."""
        os.replace(self.target, backup)

    def _move_into_place(self, staging: Path) -> None:
        """Rename the staged export to the save path (absent, or an empty folder)."""
        os.replace(staging, self.target)

    def _clean_up(self, backup: Path | None) -> None:
        """Delete the previous export, the staging holder and the checkpoint folder."""
        if backup is not None:
            shutil.rmtree(backup, ignore_errors=True)
            if os.path.lexists(backup):
                logger.warning(
                    "could not delete all of the previous export, moved aside to %s; delete it "
                    "yourself",
                    backup,
                )
        if self._holder is not None:
            shutil.rmtree(self._holder, ignore_errors=True)
        if self.checkpoint_dir is not None:
            shutil.rmtree(self.checkpoint_dir, ignore_errors=True)

    def _refuse(self, problem: str) -> None:
        """Keep the finished export and say where, instead of replacing the save path."""
        if self.checkpoint_dir is not None:
            where = (
                f"the finished export is kept in {self.checkpoint_dir}: once the save path is "
                "cleared, run the same command with --resume to move it into place"
            )
        else:
            assert self._holder is not None
            kept = _free_sibling(self.target, KEPT_INFIX)
            os.replace(self._holder, kept)
            self._holder = None
            where = (
                f"the finished export is kept in {kept / EXPORT_SUBDIR}; move it where you want it"
            )
        raise CommitRefusedError(f"{problem}\n{where}")


def _new_sibling(target: Path, infix: str) -> Path:
    """A new, uniquely named folder ``.NAME{infix}XXXXXXXX`` beside ``target`` (created empty)."""
    return Path(tempfile.mkdtemp(prefix=sibling(target, infix).name, dir=target.parent))


def _free_sibling(target: Path, infix: str) -> Path:
    """A name ``.NAME{infix}XXXXXXXX`` beside ``target`` that does not exist (nothing is created:
    a kill leaves no empty folder behind)."""
    while True:
        path = sibling(target, infix + secrets.token_hex(4))
        if not os.path.lexists(path):
            return path
