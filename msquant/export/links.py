"""Which files of a folder msquant may read: the folder's own, never one reached through a link
out of it nor named by a path that climbs out of it.

A folder msquant reads on a user's behalf (a model to copy files from, an export to verify) may
come from someone else. A symbolic link in it (``model.safetensors -> /etc/shadow``) or a path
its metadata names (``"../../home/me/.ssh/id_rsa"`` in a file list) would make msquant read,
hash or copy a file outside it, and report something about that file. Links that stay inside the
folder are harmless and followed; so are the links of a Hugging Face cache snapshot
(``models--org--name/snapshots/<rev>/x -> ../../blobs/<sha>``), whose files all lie in the
repository's cache folder.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["link_roots", "links_leaving", "member", "resolves_inside"]


def link_roots(folder: Path) -> list[Path]:
    """Where the files of ``folder`` may really lie: the folder itself (its real path) and, for a
    Hugging Face cache snapshot (``models--org--name/snapshots/<rev>``), the repository's cache
    folder."""
    real = Path(os.path.realpath(folder))
    roots = [real]
    if real.parent.name == "snapshots":
        roots.append(real.parent.parent)
    return roots


def resolves_inside(path: Path, roots: list[Path]) -> bool:
    """Whether ``path``, every link on the way resolved, lies in one of ``roots``."""
    real = Path(os.path.realpath(path))
    return any(root == real or root in real.parents for root in roots)


def links_leaving(folder: Path) -> list[tuple[str, Path]]:
    """Every symbolic link under ``folder`` (files and folders, at any depth, never following
    one) that resolves outside it: ``(path relative to folder, real target)``, sorted."""
    roots = link_roots(folder)
    found: list[tuple[str, Path]] = []
    for directory, folders, files in os.walk(folder, followlinks=False):
        for name in sorted([*folders, *files]):
            path = Path(directory) / name
            if path.is_symlink() and not resolves_inside(path, roots):
                found.append((path.relative_to(folder).as_posix(), Path(os.path.realpath(path))))
    return sorted(found)


def member(root: Path, name: object) -> Path | None:
    """``root / name`` when ``name`` is a relative POSIX path of plain components (no absolute
    path, no ``..``, ``.`` or empty component) that resolves inside ``root``; None otherwise."""
    if not isinstance(name, str) or not name or "\0" in name:
        return None
    parts = name.split("/")
    if any(part in ("", ".", "..") for part in parts):
        return None
    path = root.joinpath(*parts)
    return path if resolves_inside(path, link_roots(root)) else None
