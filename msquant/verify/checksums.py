"""Compare an export's files with the sizes and sha256 msquant recorded when it wrote them.

Decoding the tensors finds what breaks the format (shapes, dtypes, impossible values); it cannot
see a code changed by one or a scale doubled without the original model, nor a damaged float
tensor at all. The checksums in ``msquant_export.json`` (:mod:`msquant.export.marker`) see every
changed byte. They catch accidents (a bad copy, a truncated download, a disk error), not
deliberate tampering: whoever can change a file can rewrite the marker too.
"""

from __future__ import annotations

from pathlib import Path

from msquant.export.marker import EXPORT_MARKER, ExportMarker, read_export_marker
from msquant.verify.report import Findings

__all__ = ["check_checksums", "find_marker"]

_SHOWN = 5


def find_marker(path: Path) -> tuple[ExportMarker, str] | None:
    """The marker that lists the files of the export folder ``path``, and ``path``'s place in it:
    ``path``'s own, or (an export of a run with several savers, one per subfolder) its parent's
    when that one names ``path`` as a saver's folder."""
    own = read_export_marker(path)
    if own is not None:
        return own, ""
    parent = read_export_marker(path.parent)
    if parent is None:
        return None
    savers = parent.data.get("savers")
    if isinstance(savers, list) and any(
        isinstance(s, dict) and s.get("path") == path.name for s in savers
    ):
        return parent, path.name
    return None


def check_checksums(path: Path, findings: Findings) -> bool:
    """Record an error for every file of the export at ``path`` that is missing or differs from
    its recorded size and sha256, and a warning for files the marker does not list.

    :returns: whether checksums were found (False for an export without them: another tool's,
        or an msquant one from before checksums were recorded).
    """
    found = find_marker(path)
    if found is None or found[0].files is None:
        return False
    marker, subfolder = found
    missing, changed, outside = marker.changed_files(subfolder)
    for name in outside:
        findings.error(
            f"{EXPORT_MARKER} lists {name!r}, which is not a file inside the export (an absolute "
            "path, '..' or a symbolic link out of it); verify reads no file outside the export, "
            "so this entry was not checked: the marker was edited, rewrite the export"
        )
    for name in changed:
        findings.error(
            f"{name}: its bytes differ from the sha256 recorded in {EXPORT_MARKER} when the "
            "export was written (the file was changed or damaged since; copy the export again)"
        )
    for name in missing:
        findings.error(f"{name}: listed in {EXPORT_MARKER} but missing from the export")
    prefix = f"{subfolder}/" if subfolder else ""
    extra = [name for name in marker.unrecorded() if name.startswith(prefix)]
    if extra:
        shown = ", ".join(extra[:_SHOWN]) + (
            f" and {len(extra) - _SHOWN} more" if len(extra) > _SHOWN else ""
        )
        findings.warn(f"{len(extra)} file(s) not written by msquant: {shown}")
    return True
