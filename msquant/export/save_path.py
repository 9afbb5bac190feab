"""Which save paths a run may write to, checked before any work and again at the final swap.

The save path is replaced as a whole when the export is complete (:mod:`msquant.export.staging`),
so anything it holds then is deleted. It is therefore accepted only when that deletes nothing
msquant did not write:

* a path that does not exist yet, or an empty folder;
* with ``overwrite``, a previous msquant export: a folder whose ``msquant_export.json`` lists every
  file in it (:mod:`msquant.export.marker`). A file the list does not name (notes, evaluation
  results), a folder written by another tool, or an export of an msquant that did not record its
  files is refused, even with ``overwrite``.

Refused outright, whatever they hold: a symbolic link (the swap would replace the link, not what it
points to), the model folder, a folder inside it or one containing it (the export would replace
the model), and the current directory or one containing it.
"""

from __future__ import annotations

import os
from pathlib import Path

from msquant.errors import OutputPathError
from msquant.export.marker import EXPORT_MARKER, read_export_marker

__all__ = ["check_save_path", "save_path_problem"]

_SHOWN_ENTRIES = 5


def _listing(entries: list[str]) -> str:
    shown = ", ".join(entries[:_SHOWN_ENTRIES])
    more = len(entries) - _SHOWN_ENTRIES
    return shown + (f" and {more} more" if more > 0 else "")


def _contains(outer: Path, inner: Path) -> bool:
    return inner == outer or outer in inner.parents


def _spellings(path: Path) -> list[Path]:
    """``path`` with its symbolic links resolved, and as written (absolute, ``..`` folded)."""
    return list(dict.fromkeys([Path(os.path.realpath(path)), Path(os.path.normpath(path))]))


def _model_overlap(path: Path, model_path: str | Path) -> str | None:
    """How the save path overlaps the model folder, or None. Both are compared as written and
    with their links resolved: a save path inside the model folder through a symbolic link
    (``model/link/out``, ``link`` pointing elsewhere) is refused like one inside it."""
    model_given = Path(model_path).expanduser().absolute()
    for save in _spellings(path):
        for model in _spellings(model_given):
            if save == model:
                return f"is the model folder {model}"
            if _contains(model, save):
                return f"lies inside the model folder {model}"
            if _contains(save, model):
                return f"contains the model folder {model}"
    return None


def _overlap_problem(path: Path, model_path: str | Path | None) -> str | None:
    """Why ``path`` may not be written because of where it lies, or None."""
    real = Path(os.path.realpath(path))
    if model_path is not None:
        where = _model_overlap(path, model_path)
        if where is not None:
            return (
                f"save path {path} {where}: the export replaces the save path as a whole, "
                "which would delete or mix with the model's files; choose a folder outside the model"
            )
    try:
        cwd = Path(os.path.realpath(Path.cwd()))
    except OSError:  # the current directory was removed: nothing to protect
        return None
    if _contains(real, cwd):
        return (
            f"save path {path} is the current directory or contains it: the export replaces the "
            "save path as a whole once it is complete, which would pull the directory from under "
            f"this shell; pass a new folder instead, e.g. {path / 'out'}"
        )
    return None


def save_path_problem(path: Path, overwrite: bool) -> str | None:
    """Why the export may not replace ``path`` now (an absolute path), or None when it may.

    This is the part of :func:`check_save_path` that depends on what the folder holds; the final
    swap checks it again, because files may appear in the save path during a run.
    """
    if path.is_symlink():
        target = os.readlink(path)
        return (
            f"save path {path} is a symbolic link (to {target}); the export would replace the link, "
            "not the folder it points to: pass the real folder path or a new one"
        )
    if path.exists() and not path.is_dir():
        return f"save path {path} exists and is a file; pass a directory path"
    try:
        if not path.is_dir() or not any(path.iterdir()):
            return None
        marker = read_export_marker(path)
        unrecorded = None if marker is None or marker.files is None else marker.unrecorded()
    except OSError as error:
        return f"cannot read the save path {path} ({error}); choose a folder you can read"
    if marker is None:
        return (
            f"save path {path} is a non-empty directory that does not hold a previous export "
            f"(no {EXPORT_MARKER}, the file msquant writes into its exports); msquant replaces "
            "only its own exports, so that no unrelated file is deleted: choose a new or empty "
            "directory"
        )
    if marker.files is None:
        return (
            f"save path {path} holds an export of an msquant that did not record its files in "
            f"{EXPORT_MARKER}, so msquant cannot tell its files from yours; delete it yourself or "
            "choose another path"
        )
    if unrecorded:
        return (
            f"save path {path} holds a previous export and {len(unrecorded)} entr"
            f"{'y' if len(unrecorded) == 1 else 'ies'} msquant did not write ({_listing(unrecorded)}); "
            f"replacing the export would delete {'it' if len(unrecorded) == 1 else 'them'}: move "
            f"{'it' if len(unrecorded) == 1 else 'them'} out of the folder, or choose another path"
        )
    if not overwrite:
        return (
            f"save path {path} holds a previous export; pass --overwrite (Python: "
            "overwrite=True) to replace it once the new export is complete, or choose another path"
        )
    return None


def check_save_path(
    save_path: str | Path, overwrite: bool = False, model_path: str | Path | None = None
) -> Path:
    """Validate a save path before any work starts; returns it as an absolute path.

    :param model_path: the model folder the run reads (the save path may not overlap it).
    :raises OutputPathError: when the path may not be written (see the module docstring), or its
        nearest existing ancestor is a file or not writable.
    """
    path = Path(save_path).expanduser().absolute()
    problem = _overlap_problem(path, model_path) or save_path_problem(path, overwrite)
    if problem is not None:
        raise OutputPathError(problem)
    ancestor = path.parent
    while not ancestor.exists():
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise OutputPathError(f"cannot create {path}: {ancestor} is a file")
    if not os.access(ancestor, os.W_OK | os.X_OK):
        raise OutputPathError(f"cannot write to {ancestor} (permission denied)")
    return path
