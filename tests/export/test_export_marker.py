"""The JSON files msquant writes beside an export (the export marker, the swap journal) are read
back only when they are what msquant wrote: a regular file holding a JSON object. A symbolic link
is never followed (it was planted, not written), and garbage reads as no file at all."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from msquant.export.marker import (
    EXPORT_MARKER,
    read_export_marker,
    read_json_object,
    write_export_marker,
)
from msquant.export.recovery import journal_path, write_journal


def test_a_written_marker_reads_back_with_its_files(tmp_path: Path) -> None:
    (tmp_path / "model.safetensors").write_bytes(b"weights")
    write_export_marker(tmp_path, {"msquant_version": "0.0.test"})
    marker = read_export_marker(tmp_path)
    assert marker is not None
    data = json.loads((tmp_path / EXPORT_MARKER).read_text(encoding="utf-8"))
    assert data["msquant_version"] == "0.0.test" and "model.safetensors" in data["files"]


@pytest.mark.parametrize(
    ("content", "reason"),
    [
        ("{not json", "not JSON"),
        ("[1, 2]", "not an object"),
        ('{"files": {}}', "no msquant_version: not msquant's"),
        (b"\xff\xfe", "not UTF-8"),
    ],
)
def test_a_marker_msquant_did_not_write_marks_nothing(
    tmp_path: Path, content: str | bytes, reason: str
) -> None:
    path = tmp_path / EXPORT_MARKER
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content, encoding="utf-8")
    assert read_export_marker(tmp_path) is None, reason


def test_symbolic_links_are_never_followed(tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    write_export_marker(elsewhere, {"msquant_version": "0.0.test"})
    export = tmp_path / "export"
    export.mkdir()
    os.symlink(elsewhere / EXPORT_MARKER, export / EXPORT_MARKER)
    assert read_export_marker(elsewhere) is not None
    assert read_export_marker(export) is None
    target = tmp_path / "out"
    write_journal(target, {"backup": None, "checkpoint": False, "staging_inode": 1})
    journal = journal_path(target)
    assert read_json_object(journal) == {"backup": None, "checkpoint": False, "staging_inode": 1}
    planted = tmp_path / "other"
    os.replace(journal, tmp_path / "journal.json")
    os.symlink(tmp_path / "journal.json", journal_path(planted))
    assert read_json_object(journal_path(planted)) is None
    assert read_json_object(tmp_path / "missing.json") is None
