"""Red-team replays (issue 24): ``msquant verify`` read files outside the export it was given.

It hashed any path ``msquant_export.json`` listed (``../secret``, an absolute path): whether the
reported checksum matched told whoever wrote the marker something about a file they could not
read (a hash oracle). It also followed shards that were symbolic links out of the export. Now a
marker entry that is not a plain relative path inside the export is an error and is never opened,
and a link out of the export refuses the folder before any file is read (``msquant eval`` too).
Links inside the export and a Hugging Face cache snapshot's links into its ``blobs`` are followed.
"""

from __future__ import annotations

import builtins
import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest
from replay import CALIB_TXT, Cli, quant_args, replay

import msquant.verify.tensors


def _export(case: Path, run_cli: Cli) -> Path:
    assert replay(run_cli, case, *quant_args(case)).code == 0
    return case / "out"


def _shard(out: Path) -> Path:
    [file] = [p for p in out.glob("*.safetensors") if not p.name.startswith(".")]
    return file


@pytest.fixture
def opened(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """Every path the process opens (Python's ``open`` and ``os.open``, safetensors' reader)."""
    paths: list[Path] = []
    real_open, real_os_open, real_safe_open = (
        builtins.open,
        os.open,
        msquant.verify.tensors.safe_open,
    )

    def spy_open(file, *args, **kwargs):  # type: ignore[no-untyped-def]
        if isinstance(file, str | os.PathLike):
            paths.append(Path(os.path.realpath(file)))
        return real_open(file, *args, **kwargs)

    def spy_os_open(file, *args, **kwargs):  # type: ignore[no-untyped-def]
        paths.append(Path(os.path.realpath(file)))
        return real_os_open(file, *args, **kwargs)

    def spy_safe_open(file, *args, **kwargs):  # type: ignore[no-untyped-def]
        paths.append(Path(os.path.realpath(file)))
        return real_safe_open(file, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", spy_open)
    monkeypatch.setattr(os, "open", spy_os_open)
    monkeypatch.setattr(msquant.verify.tensors, "safe_open", spy_safe_open)
    return paths


def test_v_marker_entries_out_of_the_export_are_never_opened(
    case: Path, run_cli: Cli, opened: list[Path]
) -> None:
    out = _export(case, run_cli)
    secret = case / "secret.txt"
    secret.write_text("the secret")
    digest = {"bytes": 10, "sha256": hashlib.sha256(b"the secret").hexdigest()}
    marker = json.loads((out / "msquant_export.json").read_text())
    (out / "link_dir").mkdir()
    names = ["../secret.txt", str(secret), "link_dir/../../secret.txt", "./config.json", "a//b"]
    for name in names:
        marker["files"][name] = digest
    (out / "msquant_export.json").write_text(json.dumps(marker, indent=2))
    opened.clear()
    outcome = replay(run_cli, case, "verify", out)
    assert outcome.code == 2
    for name in names:
        assert (
            f"msquant_export.json lists {name!r}, which is not a file inside the export"
            in outcome.err
        ), outcome.err
    assert Path(os.path.realpath(secret)) not in opened
    real_out = Path(os.path.realpath(out))
    assert opened and all(real_out in p.parents for p in opened), sorted(set(opened))


def test_v_a_shard_linked_out_of_the_export_is_refused(
    case: Path, run_cli: Cli, opened: list[Path]
) -> None:
    """The shard moved elsewhere and linked: the bytes and checksum are the export's, so verify
    said OK while reading a file outside the folder it was given."""
    out = _export(case, run_cli)
    shard = _shard(out)
    elsewhere = case / "elsewhere"
    elsewhere.mkdir()
    moved = elsewhere / shard.name
    shutil.move(shard, moved)
    shard.symlink_to(os.path.relpath(moved, out))
    opened.clear()
    outcome = replay(run_cli, case, "verify", out)
    outcome.refused(
        rf"holds 1 symbolic link\(s\) to files outside it \({shard.name} -> {moved}\); msquant "
        "reads only the export's own files: replace each link by a copy of its target"
    )
    assert opened == []
    evaluated = replay(run_cli, case, "eval", out, "--data", CALIB_TXT, "--max_samples", "1")
    evaluated.refused(rf"holds 1 symbolic link\(s\) to files outside it \({shard.name} -> ")


def test_v_a_linked_folder_and_a_linked_config_are_refused(case: Path, run_cli: Cli) -> None:
    out = _export(case, run_cli)
    (case / "elsewhere").mkdir()
    (out / "optional").symlink_to(case / "elsewhere")
    config = out / "config.json"
    shutil.copy(config, case / "config.json")
    config.unlink()
    config.symlink_to(case / "config.json")
    outcome = replay(run_cli, case, "verify", out)
    outcome.refused(
        r"holds 2 symbolic link\(s\) to files outside it \(config.json -> .*; optional -> "
    )


def test_v_links_inside_the_export_and_a_cache_snapshot_are_followed(
    case: Path, run_cli: Cli
) -> None:
    """Controls: a link that stays inside the export, and an export laid out as a Hugging Face
    cache snapshot (every file a link into the repository's blobs folder), verify."""
    out = _export(case, run_cli)
    shard = _shard(out)
    (out / "blobs").mkdir()
    shutil.move(shard, out / "blobs" / "shard")
    shard.symlink_to("blobs/shard")
    assert replay(run_cli, case, "verify", out).code == 0
    shutil.move(out / "blobs" / "shard", shard.with_name("real"))
    shard.unlink()
    shard.with_name("real").rename(shard)
    (out / "blobs").rmdir()
    repo = case / "models--org--tiny"
    snapshot = repo / "snapshots" / "0123abc"
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for file in sorted(out.rglob("*")):
        if file.is_dir():
            continue
        blob = repo / "blobs" / hashlib.sha256(file.read_bytes()).hexdigest()
        shutil.copy(file, blob)
        target = snapshot / file.relative_to(out)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.symlink_to(os.path.relpath(blob, target.parent))
    outcome = replay(run_cli, case, "verify", snapshot)
    assert outcome.code == 0, outcome.err
