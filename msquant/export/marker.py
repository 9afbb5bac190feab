"""``msquant_export.json``: the marker msquant writes at the top of every export it makes.

The marker says what wrote the folder (version, model, savers) and lists every file of the export
with its size and sha256. The list serves two purposes:

* ``--overwrite`` replaces a folder only when it holds an msquant export and nothing else: a file
  the list does not name (notes, evaluation results a user added) makes the save path refused,
  so that replacing an export never deletes anything msquant did not write;
* ``msquant verify`` recomputes the checksums and reports a file that changed since it was
  written (a damaged copy or download), which the comparison of decoded values cannot always see
  (a code off by one, a flipped float bit).

Checksums detect accidents, not tampering: whoever can change a file can rewrite the marker.
The marker is deterministic (no timestamps), so two identical runs write identical markers: files
whose bytes differ between identical runs (the run report, with its timings) are listed without a
checksum (``{}``).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from msquant.export.links import member

__all__ = [
    "EXPORT_MARKER",
    "TRANSFORMED_KEY",
    "ExportMarker",
    "file_digests",
    "read_export_marker",
    "read_json_object",
    "sha256_file",
    "weights_transformed_by",
    "write_export_marker",
]

EXPORT_MARKER = "msquant_export.json"
#: The marker's list of processors that changed the float weights (``Processor.transforms_weights``).
TRANSFORMED_KEY = "weights_transformed_by"
#: Files listed without a checksum: their bytes differ between identical runs.
UNHASHED_FILES = ("quant_report.json",)
_CHUNK = 8 * 1024 * 1024


def sha256_file(path: Path) -> str:
    """The hex sha256 of a file's bytes, read in chunks (exports hold files of many GB)."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _relative(path: Path, root: Path) -> str:
    return path.relative_to(root).as_posix()


def file_digests(directory: Path) -> dict[str, dict[str, Any]]:
    """``{relative path: {"bytes", "sha256"}}`` of every regular file under ``directory`` but the
    marker itself (``{}`` for :data:`UNHASHED_FILES`), sorted by path (POSIX separators)."""
    files: dict[str, dict[str, Any]] = {}
    for path in sorted(directory.rglob("*")):
        name = _relative(path, directory)
        if name == EXPORT_MARKER or path.is_symlink() or not path.is_file():
            continue
        if path.name in UNHASHED_FILES:
            files[name] = {}
        else:
            files[name] = {"bytes": path.stat().st_size, "sha256": sha256_file(path)}
    return files


def write_export_marker(directory: Path, fields: Mapping[str, Any]) -> None:
    """Write the marker of the export in ``directory``: ``fields`` and the list of its files.

    Call it last: every file written after it is unknown to the list.
    """
    marker = {**fields, "files": file_digests(directory)}
    path = directory / EXPORT_MARKER
    tmp = path.with_name(f".{EXPORT_MARKER}.tmp")
    tmp.write_text(json.dumps(marker, indent=2) + "\n", encoding="utf-8")
    os.replace(tmp, path)


class ExportMarker:
    """A marker read back from a folder.

    :param root: the folder holding the marker (the save path).
    :param data: its JSON content.
    """

    def __init__(self, root: Path, data: Mapping[str, Any]) -> None:
        self.root = root
        self.data = dict(data)

    @property
    def files(self) -> dict[str, dict[str, Any]] | None:
        """The recorded files (None for a marker written before msquant recorded them)."""
        files = self.data.get("files")
        return files if isinstance(files, dict) else None

    def unrecorded(self) -> list[str]:
        """Entries under :attr:`root` that the marker does not list: files and links msquant did
        not write, and folders holding none of its files (relative paths, sorted).

        A folder whose files are all unrecorded is named once, not file by file.
        """
        recorded = set(self.files or {})
        folders = {folder for name in recorded for folder in _ancestors(name)}
        found: list[str] = []
        self._walk(self.root, recorded, folders, found)
        return sorted(found)

    def _walk(
        self, directory: Path, recorded: set[str], folders: set[str], found: list[str]
    ) -> None:
        for path in sorted(directory.iterdir()):
            name = _relative(path, self.root)
            if name == EXPORT_MARKER:
                continue
            if path.is_dir() and not path.is_symlink():
                if name in folders:
                    self._walk(path, recorded, folders, found)
                else:
                    found.append(name + "/")
            elif name not in recorded:
                found.append(name)

    def changed_files(self, subfolder: str = "") -> tuple[list[str], list[str], list[str]]:
        """Recorded files (under ``subfolder``, relative to :attr:`root`) that are missing, those
        whose size or sha256 differ from the recorded ones (files recorded without a checksum are
        only checked to exist), and names that are no file inside :attr:`root` (an absolute path,
        a ``..``, a link out of it: :func:`msquant.export.links.member`), which are never opened.
        """
        missing: list[str] = []
        changed: list[str] = []
        outside: list[str] = []
        prefix = f"{subfolder.strip('/')}/" if subfolder.strip("/") else ""
        for name, entry in sorted((self.files or {}).items()):
            if not name.startswith(prefix):
                continue
            path = member(self.root, name)
            if path is None:
                outside.append(name)
            elif not path.is_file():
                missing.append(name)
            elif not isinstance(entry, dict) or "sha256" not in entry:
                continue
            elif path.stat().st_size != entry.get("bytes") or sha256_file(path) != entry["sha256"]:
                changed.append(name)
        return missing, changed, outside


def _ancestors(name: str) -> list[str]:
    parts = name.split("/")[:-1]
    return ["/".join(parts[: i + 1]) for i in range(len(parts))]


def read_json_object(path: Path) -> dict[str, Any] | None:
    """The JSON object msquant wrote at ``path`` (the export marker, the swap journal); None when
    there is none, it is a symbolic link (never followed: it was not msquant's), or it is not a
    readable JSON object."""
    if path.is_symlink() or not path.is_file():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def weights_transformed_by(export: Path) -> list[str]:
    """The processors that changed the float weights of the export in ``export`` (its marker is
    there or, for a saver writing into a subfolder, one level up); empty when none did."""
    for folder in (export, export.parent):
        marker = read_export_marker(folder)
        if marker is not None:
            found = marker.data.get(TRANSFORMED_KEY, [])
            return [str(name) for name in found] if isinstance(found, list) else []
    return []


def read_export_marker(directory: Path) -> ExportMarker | None:
    """The marker at the top of ``directory``, or None when there is none or it is not a JSON
    object written by msquant (it then does not mark an export msquant may replace)."""
    data = read_json_object(directory / EXPORT_MARKER)
    if data is None or "msquant_version" not in data:
        return None
    return ExportMarker(directory, data)
