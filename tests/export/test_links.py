"""Which paths of a folder msquant may read (msquant/export/links.py): plain relative names inside
it, links that stay inside it or in a Hugging Face cache repository, nothing else."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from msquant.export.links import link_roots, links_leaving, member


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    root = tmp_path / "export"
    (root / "sub").mkdir(parents=True)
    (root / "a.json").write_text("{}")
    (root / "sub" / "b.safetensors").write_text("x")
    (tmp_path / "outside.txt").write_text("secret")
    return root


@pytest.mark.parametrize(
    "name",
    ["../outside.txt", "/etc/passwd", "sub/../../outside.txt", "./a.json", "sub//b.safetensors",
     "sub/", "", "a\0.json", 3, None],
)  # fmt: skip
def test_names_that_leave_or_are_not_plain_are_refused(folder: Path, name: object) -> None:
    assert member(folder, name) is None


def test_plain_names_and_links_inside_are_members(folder: Path) -> None:
    assert member(folder, "a.json") == folder / "a.json"
    assert member(folder, "sub/b.safetensors") == folder / "sub" / "b.safetensors"
    assert member(folder, "missing.json") == folder / "missing.json"  # inside: reported missing
    (folder / "inner").symlink_to("sub")
    assert member(folder, "inner/b.safetensors") == folder / "inner" / "b.safetensors"
    assert links_leaving(folder) == []


def test_links_out_of_the_folder_are_found_at_any_depth(folder: Path) -> None:
    outside = folder.parent / "outside.txt"
    (folder / "sub" / "leak.json").symlink_to(outside)
    (folder / "away").symlink_to(folder.parent)
    (folder / "dangling").symlink_to(folder.parent / "nowhere")
    assert member(folder, "sub/leak.json") is None
    assert member(folder, "away/outside.txt") is None
    real = Path(os.path.realpath(folder.parent))
    assert links_leaving(folder) == [
        ("away", real),
        ("dangling", real / "nowhere"),
        ("sub/leak.json", real / "outside.txt"),
    ]


def test_a_cache_snapshot_may_link_into_its_repository(tmp_path: Path) -> None:
    repo = tmp_path / "models--org--name"
    snapshot = repo / "snapshots" / "abc"
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    (repo / "blobs" / "123").write_text("weights")
    (snapshot / "model.safetensors").symlink_to("../../blobs/123")
    assert link_roots(snapshot) == [Path(os.path.realpath(snapshot)), Path(os.path.realpath(repo))]
    assert member(snapshot, "model.safetensors") == snapshot / "model.safetensors"
    assert links_leaving(snapshot) == []
