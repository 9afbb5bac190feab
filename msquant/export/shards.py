"""Sharded safetensors writing with a Hugging Face style index.

Tensors are buffered until a shard reaches the size limit, then written; final names
``{prefix}-00001-of-0000N.safetensors`` are known only at the end, so shards are renamed on
:meth:`ShardedSafetensorsWriter.close`, which also writes ``{prefix}.safetensors.index.json``
(``{"metadata": {"total_size": bytes}, "weight_map": {tensor: file}}``). Without a size limit one
``{prefix}.safetensors`` file is written and no index.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors.torch import save_file

__all__ = ["ShardedSafetensorsWriter"]


class ShardedSafetensorsWriter:
    """Accumulates named tensors and writes them as one file or as size-limited shards.

    :param directory: folder to write into (normally a staging folder).
    :param prefix: file name stem, e.g. ``quant_model_weights``.
    :param max_shard_bytes: shard size limit; ``None`` writes a single unsharded file.
    :param plain_when_single: when everything fits in one shard, write the unsharded
        ``{prefix}.safetensors`` without an index (formats whose readers expect one plain file).
    """

    def __init__(
        self,
        directory: Path,
        prefix: str,
        max_shard_bytes: int | None,
        plain_when_single: bool = False,
    ) -> None:
        self.directory = directory
        self.prefix = prefix
        self.max_shard_bytes = max_shard_bytes
        self.plain_when_single = plain_when_single
        self._pending: dict[str, torch.Tensor] = {}
        self._pending_bytes = 0
        self._shards: list[tuple[Path, list[str]]] = []
        self._names: set[str] = set()
        self.total_bytes = 0
        self.closed = False

    def add(self, name: str, tensor: torch.Tensor) -> None:
        """Queue one tensor (copied to contiguous CPU memory); names must be unique."""
        if self.closed:
            raise RuntimeError("writer is closed")
        if name in self._names:
            raise ValueError(f"tensor {name!r} written twice")
        self._names.add(name)
        data = tensor.detach().to("cpu").contiguous().clone()
        size = data.numel() * data.element_size()
        limit = self.max_shard_bytes
        if limit is not None and self._pending and self._pending_bytes + size > limit:
            self._flush()
        self._pending[name] = data
        self._pending_bytes += size
        self.total_bytes += size

    def _flush(self) -> None:
        if not self._pending:
            return
        path = self.directory / f".{self.prefix}-part{len(self._shards) + 1}.tmp"
        save_file(self._pending, str(path), metadata={"format": "pt"})
        self._shards.append((path, list(self._pending)))
        self._pending = {}
        self._pending_bytes = 0

    def close(self, prefix: str | None = None) -> dict[str, str]:
        """Write what is pending, give shards their final names; returns the weight map.

        :param prefix: final file name stem when it is only known at the end (default: the
            constructor's ``prefix``).
        """
        if self.closed:
            raise RuntimeError("writer is already closed")
        self.closed = True
        if prefix is not None:
            self.prefix = prefix
        if self.max_shard_bytes is None or (self.plain_when_single and not self._shards):
            name = f"{self.prefix}.safetensors"
            save_file(self._pending, str(self.directory / name), metadata={"format": "pt"})
            weight_map = {tensor: name for tensor in self._pending}
            self._pending = {}
            return weight_map
        self._flush()
        count = max(len(self._shards), 1)
        if not self._shards:  # nothing written: still produce one (empty) shard for consumers
            save_file(
                {}, str(self.directory / f".{self.prefix}-part1.tmp"), metadata={"format": "pt"}
            )
            self._shards.append((self.directory / f".{self.prefix}-part1.tmp", []))
        weight_map = {}
        for number, (tmp_path, names) in enumerate(self._shards, start=1):
            final = f"{self.prefix}-{number:05d}-of-{count:05d}.safetensors"
            os.replace(tmp_path, self.directory / final)
            weight_map.update({tensor: final for tensor in names})
        index = {
            "metadata": {"total_size": self.total_bytes},
            "weight_map": dict(sorted(weight_map.items())),
        }
        index_path = self.directory / f"{self.prefix}.safetensors.index.json"
        index_path.write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")
        return weight_map
