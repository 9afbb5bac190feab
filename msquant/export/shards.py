"""Sharded safetensors writing with a Hugging Face style index, streamed to disk.

:meth:`ShardedSafetensorsWriter.add` writes each tensor's bytes at once to a hidden data file of the
current shard and keeps only its header entry (dtype, shape, byte range), so an export never holds
the quantized model in memory. A shard has one data file per element size
(``.{prefix}-part{n}.data{k}.tmp``, k = 8, 4, 2, 1 bytes) so that, concatenated largest first,
every tensor starts at a multiple of its element size, as ``safetensors.torch.save_file`` also
guarantees (memory-mapping readers and some accelerators need aligned tensors). When a shard
reaches the size limit (or on :meth:`~ShardedSafetensorsWriter.close`) it is assembled as a
safetensors file: 8-byte little-endian header length, the JSON header padded with spaces to a
multiple of 8 bytes, then the data files copied in chunks, and the data files are deleted. While a
shard is assembled its bytes are on disk twice; memory never holds more than one chunk.

Final names ``{prefix}-00001-of-0000N.safetensors`` are known only at the end, so shards are renamed
on close, which also writes ``{prefix}.safetensors.index.json`` (``{"metadata": {"total_size":
bytes}, "weight_map": {tensor: file}}``). Without a size limit one ``{prefix}.safetensors`` file is
written and no index.

Checkpoints (``msquant quant --resume``): :meth:`ShardedSafetensorsWriter.state` describes what is
on disk so far (header entries, shard files, data-file lengths) as JSON, and
:meth:`ShardedSafetensorsWriter.restore` continues a fresh writer from such a description after a
kill, truncating the data files back to the recorded lengths (bytes of a half-written layer after
the checkpoint are dropped). From its first :meth:`~ShardedSafetensorsWriter.state` on, a writer
deletes no file that the latest durable checkpoint may still need: data files of an assembled shard
are deleted one checkpoint later, and :meth:`~ShardedSafetensorsWriter.close` links the final
files instead of renaming the hidden ones, so even a kill while the files are finalised leaves the
last checkpoint intact. The hidden files left behind are removed with :func:`remove_temporaries`
once the run no longer needs them.

The safetensors library has no streaming writer, hence this implementation of its (small) format;
the bytes of one file are :mod:`msquant.export.safetensors_file`'s.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from msquant.errors import QuantizationError
from msquant.export.safetensors_file import (
    METADATA_KEY,
    require_little_endian,
    safetensors_dtype,
    write_shard_file,
)
from msquant.quant.finite import non_finite_count

__all__ = [
    "TEMPORARY_GLOB",
    "ShardedSafetensorsWriter",
    "WriterStateError",
    "remove_temporaries",
]

logger = logging.getLogger(__name__)

#: Names of the hidden files a writer creates beside its outputs (data files of a shard being
#: filled, shards assembled before their final name is known).
TEMPORARY_GLOB = ".*-part*.tmp"


@dataclass
class _Stream:
    """The bytes of a shard's tensors of one element size, appended to a hidden data file."""

    path: Path
    nbytes: int = 0


@dataclass
class _Shard:
    """One shard being filled: its data files and the header entries of the tensors in it.

    Entry offsets are relative to the tensor's stream until :meth:`layout` places the streams.
    """

    number: int
    entries: dict[str, dict[str, Any]] = field(default_factory=dict)
    stream_of: dict[str, int] = field(default_factory=dict)
    streams: dict[int, _Stream] = field(default_factory=dict)
    nbytes: int = 0

    def layout(self) -> tuple[dict[str, dict[str, Any]], list[Path]]:
        """Header entries with offsets in the data section, and the data files in their order.

        Streams go largest element size first: each stream's length is a multiple of its element
        size, so every tensor after them stays aligned to its own element size.
        """
        order = sorted(self.streams, reverse=True)
        base: dict[int, int] = {}
        start = 0
        for size in order:
            base[size] = start
            start += self.streams[size].nbytes
        entries = {}
        for name, entry in self.entries.items():
            begin, end = entry["data_offsets"]
            offset = base[self.stream_of[name]]
            entries[name] = {**entry, "data_offsets": [begin + offset, end + offset]}
        return entries, [self.streams[size].path for size in order]


class WriterStateError(ValueError):
    """A checkpointed writer state does not match the files on disk (or this writer)."""


def remove_temporaries(directory: Path) -> int:
    """Delete the hidden files writers left under ``directory`` (:data:`TEMPORARY_GLOB`, at any
    depth): a checkpointed writer keeps them until the run no longer needs its checkpoints.

    :returns: how many files were deleted.
    """
    count = 0
    for path in sorted(directory.rglob(TEMPORARY_GLOB)):
        if path.is_file():
            path.unlink()
            count += 1
    return count


def _fsync(path: Path) -> None:
    """Flush ``path``'s bytes to the disk (a checkpoint must survive more than the process)."""
    with open(path, "rb") as handle:
        os.fsync(handle.fileno())


class ShardedSafetensorsWriter:
    """Streams named tensors to disk as one file or as size-limited shards.

    A new shard starts when adding a tensor would take a non-empty shard past ``max_shard_bytes``
    (so a tensor larger than the limit gets a shard of its own).

    :param directory: folder to write into (normally a staging folder).
    :param prefix: file name stem, e.g. ``quant_model_weights``.
    :param max_shard_bytes: shard size limit; ``None`` writes a single unsharded file.
    :param plain_when_single: when everything fits in one shard, write the unsharded
        ``{prefix}.safetensors`` without an index (formats whose readers expect one plain file).
    :param rename: maps each name given to :meth:`add` to the name stored in the file (e.g.
        :meth:`msquant.plugin.RunContext.disk_name`, the checkpoint's names of a model whose modules
        transformers renames at load); names are stored as given when None. Checkpoint states
        hold the stored names, so a restored writer needs the same ``rename``.
    """

    def __init__(
        self,
        directory: Path,
        prefix: str,
        max_shard_bytes: int | None,
        plain_when_single: bool = False,
        rename: Callable[[str], str] | None = None,
    ) -> None:
        require_little_endian()
        self.directory = directory
        self.prefix = prefix
        self.max_shard_bytes = max_shard_bytes
        self.plain_when_single = plain_when_single
        self.rename = rename
        self._current: _Shard | None = None
        self._shards: list[tuple[Path, list[str]]] = []
        self._names: set[str] = set()
        self.total_bytes = 0
        self.closed = False
        # Checkpointed (after the first state() or a restore()): superseded files are deleted
        # only once no durable checkpoint can need them; see state().
        self._checkpointed = False
        self._obsolete: list[Path] = []  # superseded since the latest state()
        self._obsolete_before: list[Path] = []  # superseded before it (deleted at the next)
        self._synced: set[Path] = set()  # assembled shards already flushed to the disk

    def add(self, name: str, tensor: torch.Tensor) -> None:
        """Write one tensor's bytes to the current shard's data file, under ``rename(name)``;
        stored names must be unique."""
        if self.closed:
            raise RuntimeError("writer is closed")
        stored = name if self.rename is None else self.rename(name)
        if stored in self._names:
            shown = repr(name) if stored == name else f"{name!r} (stored as {stored!r})"
            raise ValueError(f"tensor {shown} written twice")
        name = stored
        if name == METADATA_KEY:
            raise ValueError(f"{METADATA_KEY!r} is reserved by the safetensors format")
        if tensor.is_meta:
            raise ValueError(
                f"tensor {name!r} is on the meta device (a layer a streamed run already released): "
                "savers must write a layer's tensors in after_layer"
            )
        dtype_name = safetensors_dtype(tensor.dtype)
        data = tensor.detach().to("cpu").contiguous()
        bad = non_finite_count(data)
        if bad:
            raise QuantizationError(
                f"tensor {name} {tuple(data.shape)} contains {bad} NaN/Inf value(s); an export "
                "never holds them (the checkpoint, or a value computed from it, is broken)"
            )
        self._names.add(name)
        size = data.numel() * data.element_size()
        limit = self.max_shard_bytes
        current = self._current
        if limit is not None and current and current.entries and current.nbytes + size > limit:
            self._flush()
        shard = self._shard()
        stream = self._stream(shard, data.element_size())
        self._append(stream, data)
        shard.entries[name] = {
            "dtype": dtype_name,
            "shape": list(data.shape),
            "data_offsets": [stream.nbytes, stream.nbytes + size],
        }
        shard.stream_of[name] = data.element_size()
        stream.nbytes += size
        shard.nbytes += size
        self.total_bytes += size

    def _shard(self) -> _Shard:
        """The shard being filled, started when there is none."""
        if self._current is None:
            self._current = _Shard(len(self._shards) + 1)
        return self._current

    def _stream(self, shard: _Shard, element_size: int) -> _Stream:
        """The shard's data file for tensors of ``element_size``, created empty on first use."""
        if element_size not in shard.streams:
            path = self.directory / f".{self.prefix}-part{shard.number}.data{element_size}.tmp"
            path.write_bytes(b"")  # truncates anything left by an earlier run
            shard.streams[element_size] = _Stream(path)
        return shard.streams[element_size]

    @staticmethod
    def _append(stream: _Stream, data: torch.Tensor) -> None:
        """Append the raw bytes of contiguous CPU tensor ``data`` to the stream's data file."""
        raw = data.reshape(-1).view(torch.uint8).numpy()
        with open(stream.path, "ab") as handle:
            handle.write(raw.data)
            if handle.tell() != stream.nbytes + raw.nbytes:
                raise OSError(f"{stream.path}: short write")

    def _assemble(self, shard: _Shard, path: Path) -> None:
        """Write ``shard`` as the safetensors file ``path`` and discard its data files."""
        entries, data_paths = shard.layout()
        write_shard_file(path, entries, data_paths)
        self._discard(data_paths)

    def _discard(self, paths: Sequence[Path]) -> None:
        """Delete superseded files now, or (checkpointed) once no checkpoint can need them."""
        if self._checkpointed:
            self._obsolete.extend(paths)
            return
        for path in paths:
            path.unlink()

    def _flush(self) -> None:
        """Complete the current shard under a hidden temporary name (renamed on close)."""
        shard = self._current
        if shard is None or not shard.entries:
            return
        path = self.directory / f".{self.prefix}-part{len(self._shards) + 1}.tmp"
        self._assemble(shard, path)
        self._shards.append((path, list(shard.entries)))
        self._current = None

    def close(self, prefix: str | None = None) -> dict[str, str]:
        """Complete the last shard, give shards their final names; returns the weight map.

        :param prefix: final file name stem when it is only known at the end (default: the
            constructor's ``prefix``).
        """
        if self.closed:
            raise RuntimeError("writer is already closed")
        self.closed = True
        if prefix is not None:
            self.prefix = prefix
        if self.max_shard_bytes is None or (self.plain_when_single and not self._shards):
            return self._close_plain()
        self._flush()
        if not self._shards:  # nothing written: still produce one (empty) shard for consumers
            self._flush_empty()
        count = len(self._shards)
        weight_map = {}
        for number, (tmp_path, names) in enumerate(self._shards, start=1):
            final = f"{self.prefix}-{number:05d}-of-{count:05d}.safetensors"
            self._publish(tmp_path, self.directory / final)
            weight_map.update({tensor: final for tensor in names})
        index = {
            "metadata": {"total_size": self.total_bytes},
            "weight_map": dict(sorted(weight_map.items())),
        }
        index_path = self.directory / f"{self.prefix}.safetensors.index.json"
        index_path.write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")
        return weight_map

    def _publish(self, tmp_path: Path, final: Path) -> None:
        """Give an assembled shard its final name: renamed, or (checkpointed) hard-linked so that
        the hidden file the latest checkpoint names stays until :func:`remove_temporaries`."""
        if not self._checkpointed:
            os.replace(tmp_path, final)
            return
        final.unlink(missing_ok=True)  # written by a run killed while it closed
        try:
            os.link(tmp_path, final)
        except OSError as error:  # a file system without hard links
            logger.debug("%s: cannot hard-link (%s); renaming it", tmp_path, error)
            os.replace(tmp_path, final)

    def _close_plain(self) -> dict[str, str]:
        """Write everything (one shard at most) as the unsharded ``{prefix}.safetensors``."""
        name = f"{self.prefix}.safetensors"
        shard = self._shard()
        self._assemble(shard, self.directory / name)
        self._current = None
        return {tensor: name for tensor in shard.entries}

    def _flush_empty(self) -> None:
        """Record a shard without tensors (written as a header-only file)."""
        shard = self._shard()
        path = self.directory / f".{self.prefix}-part1.tmp"
        self._assemble(shard, path)
        self._shards.append((path, []))
        self._current = None

    # -- checkpoints ------------------------------------------------------------------------------

    def state(self) -> dict[str, Any]:
        """A JSON-able description of everything written so far, for a checkpoint.

        The files it names are flushed to the disk and kept until a later checkpoint supersedes
        it: from this call on, files are deleted one :meth:`state` later than they would be
        (the caller writes each state durably before asking for the next one).

        :raises RuntimeError: when the writer is closed.
        """
        if self.closed:
            raise RuntimeError("a closed writer has no checkpoint state")
        for path in self._obsolete_before:
            path.unlink(missing_ok=True)
        self._obsolete_before, self._obsolete = self._obsolete, []
        self._checkpointed = True
        shards = []
        for path, names in self._shards:
            if path not in self._synced:
                _fsync(path)
                self._synced.add(path)
            shards.append({"file": path.name, "bytes": path.stat().st_size, "names": names})
        return {
            "prefix": self.prefix,
            "max_shard_bytes": self.max_shard_bytes,
            "plain_when_single": self.plain_when_single,
            "total_bytes": self.total_bytes,
            "shards": shards,
            "current": None if self._current is None else self._current_state(self._current),
        }

    @staticmethod
    def _current_state(shard: _Shard) -> dict[str, Any]:
        """The shard being filled: its header entries and the length of each data file."""
        for stream in shard.streams.values():
            _fsync(stream.path)
        return {
            "number": shard.number,
            "nbytes": shard.nbytes,
            "entries": shard.entries,
            "stream_of": shard.stream_of,
            "streams": {
                str(size): {"file": stream.path.name, "nbytes": stream.nbytes}
                for size, stream in shard.streams.items()
            },
        }

    def restore(self, state: Mapping[str, Any]) -> None:
        """Continue from :meth:`state`'s description, written by a run that was then killed.

        Data files are truncated back to their recorded lengths; hidden files of this writer
        that the state does not name (written after the checkpoint) are deleted.

        :raises WriterStateError: when the state is for another writer (prefix, size limit) or
            a file it names is missing or shorter than recorded.
        :raises RuntimeError: when this writer has already written something.
        """
        if self.closed or self._names or self._current is not None or self._shards:
            raise RuntimeError("restore() needs a writer that has written nothing yet")
        settings = {
            "prefix": self.prefix,
            "max_shard_bytes": self.max_shard_bytes,
            "plain_when_single": self.plain_when_single,
        }
        for key, value in settings.items():
            if state.get(key) != value:
                raise WriterStateError(
                    f"the checkpoint is for a writer with {key} {state.get(key)!r}, not {value!r}"
                )
        keep = set()
        for shard in state["shards"]:
            path = self.directory / shard["file"]
            self._check_length(path, int(shard["bytes"]), exact=True)
            self._shards.append((path, list(shard["names"])))
            self._names.update(shard["names"])
            keep.add(path)
        if state["current"] is not None:
            self._current = self._restore_current(state["current"])
            self._names.update(self._current.entries)
            keep.update(stream.path for stream in self._current.streams.values())
        self.total_bytes = int(state["total_bytes"])
        for path in self.directory.glob(f".{self.prefix}-part*.tmp"):
            if path not in keep:
                path.unlink()
        self._synced = set(keep)
        self._checkpointed = True

    def _restore_current(self, current: Mapping[str, Any]) -> _Shard:
        """The shard being filled, its data files truncated to the recorded lengths."""
        shard = _Shard(
            int(current["number"]),
            entries={name: dict(entry) for name, entry in current["entries"].items()},
            stream_of={name: int(size) for name, size in current["stream_of"].items()},
            nbytes=int(current["nbytes"]),
        )
        for size, recorded in current["streams"].items():
            path = self.directory / recorded["file"]
            nbytes = int(recorded["nbytes"])
            self._check_length(path, nbytes, exact=False)
            os.truncate(path, nbytes)
            shard.streams[int(size)] = _Stream(path, nbytes)
        return shard

    @staticmethod
    def _check_length(path: Path, nbytes: int, exact: bool) -> None:
        """``path`` holds ``nbytes`` bytes (at least that many unless ``exact``)."""
        if not path.is_file():
            raise WriterStateError(f"{path} is missing")
        size = path.stat().st_size
        if size < nbytes or (exact and size != nbytes):
            raise WriterStateError(f"{path} holds {size} bytes, the checkpoint recorded {nbytes}")
