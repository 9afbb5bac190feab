"""The folders msquant keeps beside a save path, the lock of a save path, and recovery after a kill.

Beside a save path ``NAME`` msquant may create, and only while it holds ``NAME``'s lock:

=================================  ==========================================================
``.NAME.msquant-lock``             the lock: every run of ``NAME`` holds it from before it writes
                                   anything until its export is in place (a second run is refused)
``.NAME.msquant-staging-*``        holds ``export/``, the export being written by a run without
                                   checkpoints
``.NAME.msquant-scratch-*``        a streamed run's scratch folder (without checkpoints)
``.NAME.msquant-partial``          a checkpointed run's folder (:mod:`msquant.run.checkpoint`)
``.NAME.msquant-old-*``            the previous export, moved aside during the final swap
``.NAME.msquant-commit.json``      the swap's journal: written before the first rename, removed
                                   after the last clean-up step
``.NAME.msquant-kept-*``           a finished export whose swap was refused (files appeared in the
                                   save path during the run); never removed by msquant
=================================  ==========================================================

A run killed at any moment leaves some of them. The next run of ``NAME`` (any run, ``--resume``
or not) takes the lock and then calls :func:`recover_save_path`, which uses the journal to finish
or undo an interrupted swap (so that the save path holds either the previous export or the new
one), and removes what is provably stale: staging and scratch folders (their run is dead, since
the lock was free). Folders msquant creates carry an owner file (:func:`make_owned_dir`); one
without it (a user's folder or a planted symbolic link with the same name) is never emptied.
"""

from __future__ import annotations

import contextlib
import glob
import json
import logging
import os
import shutil
from pathlib import Path
from types import TracebackType
from typing import Any

from filelock import FileLock, Timeout

from msquant.errors import OutputPathError
from msquant.export.marker import read_json_object

__all__ = [
    "fsync_directory",
    "OWNER_FILE",
    "SavePathLock",
    "is_owned_dir",
    "journal_path",
    "make_owned_dir",
    "mark_owned",
    "owned_dir_problem",
    "recover_save_path",
    "remove_journal",
    "sibling",
    "write_journal",
]

logger = logging.getLogger(__name__)

OWNER_FILE = ".msquant-owner"
LOCK_INFIX = ".msquant-lock"
STAGING_INFIX = ".msquant-staging-"
SCRATCH_INFIX = ".msquant-scratch-"
OLD_INFIX = ".msquant-old-"
KEPT_INFIX = ".msquant-kept-"
JOURNAL_INFIX = ".msquant-commit.json"
PARTIAL_INFIX = ".msquant-partial"


def sibling(target: Path, infix: str) -> Path:
    """``.NAME{infix}`` beside ``target`` (a prefix for the ``-*`` kinds)."""
    return target.parent / f".{target.name}{infix}"


def journal_path(target: Path) -> Path:
    """The swap journal of ``target``."""
    return sibling(target, JOURNAL_INFIX)


# -- folders msquant owns ------------------------------------------------------------------------


def make_owned_dir(path: Path, purpose: str) -> None:
    """Create ``path`` (it must not exist: ``os.mkdir`` refuses an existing name, a symbolic link
    included) and mark it as msquant's (:func:`mark_owned`)."""
    os.mkdir(path)
    mark_owned(path, purpose)


def mark_owned(path: Path, purpose: str) -> None:
    """Write the owner file into ``path``, a folder msquant has just created, saying what it is
    for."""
    (path / OWNER_FILE).write_text(json.dumps({"purpose": purpose}) + "\n", encoding="utf-8")


def is_owned_dir(path: Path) -> bool:
    """Whether ``path`` is a real folder (not a link) that msquant created."""
    return (
        not path.is_symlink()
        and path.is_dir()
        and (path / OWNER_FILE).is_file()
        and not (path / OWNER_FILE).is_symlink()
    )


def owned_dir_problem(path: Path, what: str) -> str | None:
    """Why msquant may not use or empty ``path`` (an existing entry named like one of its own
    folders), or None when it may: it does not exist, msquant created it, or it is an empty
    folder (nothing to lose; a run killed between creating it and marking it leaves one)."""
    if not os.path.lexists(path):
        return None
    if path.is_symlink():
        return (
            f"{path} ({what}) is a symbolic link to {os.readlink(path)}; msquant did not create it "
            "and will not write into or empty what it points to: remove the link, or choose "
            "another save path"
        )
    if not path.is_dir():
        return (
            f"{path} ({what}) exists and is a file, not a folder msquant created: remove or rename "
            "it, or choose another save path"
        )
    if not is_owned_dir(path) and any(path.iterdir()):
        return (
            f"{path} ({what}) exists but msquant did not create it (it has no {OWNER_FILE}); "
            "msquant will not empty a folder it did not create: move it away, or choose another "
            "save path"
        )
    return None


def _remove_tree(path: Path) -> bool:
    """Remove a folder msquant wrote (never follows links); False when something stayed."""
    if path.is_symlink():
        return False
    shutil.rmtree(path, ignore_errors=True)
    return not os.path.lexists(path)


# -- the lock ------------------------------------------------------------------------------------


class SavePathLock:
    """Exclusive lock of a save path, held by a run from before it writes anything beside the save
    path until its export is in place (a :mod:`filelock` lock on ``.NAME.msquant-lock``, removed
    on release; a killed run's lock is released by the operating system)."""

    def __init__(self, target: Path) -> None:
        self.target = target
        self.path = sibling(target, LOCK_INFIX)
        self._lock = FileLock(str(self.path), blocking=False, thread_local=False)

    def __enter__(self) -> SavePathLock:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._lock.acquire()
        except Timeout:
            raise OutputPathError(
                f"another msquant run is writing to {self.target} (it holds {self.path}); wait "
                "for it to end, or choose another save path"
            ) from None
        except OSError as error:
            raise OutputPathError(f"cannot lock {self.path}: {error}") from error
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        try:
            self.path.unlink(missing_ok=True)  # before the release: no one else holds it yet
        finally:
            self._lock.release()


# -- the swap journal and recovery ---------------------------------------------------------------


def write_journal(target: Path, entry: dict[str, Any]) -> None:
    """Record, durably, the swap about to happen: ``staging_inode`` (the staged export's inode:
    once it is at ``target`` the swap is done), ``backup`` (where the previous export goes, or
    None), ``checkpoint`` (whether a checkpoint folder goes after the swap)."""
    path = journal_path(target)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as handle:
        handle.write(json.dumps(entry) + "\n")
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)
    fsync_directory(target.parent)


def remove_journal(target: Path) -> None:
    """The swap and its clean-up are done."""
    journal_path(target).unlink(missing_ok=True)
    fsync_directory(target.parent)


def fsync_directory(directory: Path) -> None:
    """Make renames in ``directory`` durable (best effort: not every platform can); the run's
    checkpoint writes use it too."""
    try:
        handle = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(handle)
    except OSError:
        pass
    finally:
        os.close(handle)


def _read_journal(target: Path) -> dict[str, Any] | None:
    return read_json_object(journal_path(target))


def _swap_done(target: Path, journal: dict[str, Any]) -> bool:
    try:
        stat = os.lstat(target)
    except OSError:
        return False
    return [stat.st_dev, stat.st_ino] == journal.get("staging_inode")


def _finish_swap(target: Path, journal: dict[str, Any]) -> None:
    """The staged export is in place: do the clean-up the killed run did not."""
    backup = journal.get("backup")
    if backup and os.path.lexists(target.parent / backup):
        _remove_tree(target.parent / backup)
        logger.warning("removed the previous export a killed run had replaced (%s)", backup)
    partial = sibling(target, PARTIAL_INFIX)
    if journal.get("checkpoint") and is_owned_dir(partial):
        _remove_tree(partial)
        logger.warning(
            "removed the checkpoint folder %s of a run killed after its export was in place",
            partial,
        )


def _undo_swap(target: Path, journal: dict[str, Any]) -> None:
    """The staged export is not in place: put the previous export back if it was moved aside."""
    backup = journal.get("backup")
    if not backup or not os.path.lexists(target.parent / backup):
        return
    if os.path.lexists(target):
        logger.warning(
            "a killed run left the previous export of %s in %s, but %s exists now; move the one "
            "you want to keep into place yourself",
            target,
            target.parent / backup,
            target,
        )
        return
    os.replace(target.parent / backup, target)
    logger.warning("restored the previous export of %s, which a killed run had moved aside", target)


def recover_save_path(target: Path) -> None:
    """Bring the surroundings of ``target`` back to a clean state after a killed run; call it
    while holding :class:`SavePathLock`.

    Finishes an interrupted swap whose new export is in place (removing the previous export and
    the checkpoint folder) or undoes it (restoring the previous export), then removes staging and
    scratch folders of dead runs. Leaves alone the checkpoint folder of a run that can be
    resumed, kept exports (``-kept-``), and anything not named like msquant's folders.
    """
    journal = _read_journal(target)
    if journal is not None:
        if _swap_done(target, journal):
            _finish_swap(target, journal)
        else:
            _undo_swap(target, journal)
        remove_journal(target)
    for infix in (STAGING_INFIX, SCRATCH_INFIX):
        for stale in sorted(target.parent.glob(glob.escape(sibling(target, infix).name) + "*")):
            if not is_owned_dir(stale):  # a name like ours is not enough: only if empty
                with contextlib.suppress(OSError):
                    os.rmdir(stale)
                continue
            if _remove_tree(stale):
                logger.info("removed %s, left by a killed run", stale.name)
    for old in sorted(target.parent.glob(glob.escape(sibling(target, OLD_INFIX).name) + "*")):
        logger.warning(
            "%s holds an export an earlier run replaced but could not delete; delete it yourself",
            old,
        )
