"""Reading safetensors checkpoints for verification: one file, or shards plus an index.

The headers are parsed here (8-byte little-endian length, then JSON) so names, dtypes and shapes
are known without loading any data; tensors are loaded one at a time when a layer is checked.
Every inconsistency (an index naming a missing file or tensor, a tensor in two files, an
unreadable file) is recorded as an error naming the file or tensor instead of raising.
"""

from __future__ import annotations

import json
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

import torch
from safetensors import safe_open

from msquant.verify.report import Findings

__all__ = ["TensorInfo", "TensorStore", "open_weights", "weight_files_present"]

# safetensors dtype codes -> torch dtypes (the ones an export can hold).
DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}
HEADER_LIMIT = 100 * 2**20  # safetensors itself refuses headers above 100 MB
SAFE_FILE_NAME = re.compile(r"^[A-Za-z0-9_.\-]+\.safetensors$")


@dataclass(frozen=True)
class TensorInfo:
    """Where a tensor is stored and what its header says."""

    file: str
    dtype: torch.dtype | None  # None for a dtype torch cannot hold
    dtype_code: str
    shape: tuple[int, ...]


class TensorStore:
    """The tensors of one checkpoint: header information for all, data loaded on request."""

    def __init__(self, directory: Path, infos: dict[str, TensorInfo], files: list[str]) -> None:
        self.directory = directory
        self.infos = infos
        self.files = files
        self._handles: dict[str, Any] = {}

    def __contains__(self, name: object) -> bool:
        return name in self.infos

    def names(self) -> list[str]:
        """Every tensor name, sorted."""
        return sorted(self.infos)

    def get(self, name: str) -> torch.Tensor:
        """Load one tensor (``KeyError`` when absent)."""
        info = self.infos[name]
        handle = self._handles.get(info.file)
        if handle is None:
            handle = safe_open(str(self.directory / info.file), framework="pt")
            self._handles[info.file] = handle
        return handle.get_tensor(name)

    def close(self) -> None:
        """Drop the open file handles."""
        self._handles.clear()

    def __enter__(self) -> TensorStore:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def read_header(path: Path) -> dict[str, TensorInfo]:
    """Tensor infos from a safetensors header.

    :raises ValueError: when the file is not a well-formed safetensors file.
    """
    size = path.stat().st_size
    with path.open("rb") as handle:
        prefix = handle.read(8)
        if len(prefix) < 8:
            raise ValueError("file shorter than the 8-byte header length")
        (length,) = struct.unpack("<Q", prefix)
        if length > HEADER_LIMIT or 8 + length > size:
            raise ValueError(f"header length {length} does not fit the file size {size}")
        header = json.loads(handle.read(length).decode("utf-8"))
    if not isinstance(header, dict):
        raise ValueError("header is not a JSON object")
    data_size = size - 8 - length
    infos = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        dtype_code = str(entry["dtype"])
        shape = tuple(int(d) for d in entry["shape"])
        begin, end = (int(v) for v in entry["data_offsets"])
        if not 0 <= begin <= end <= data_size:
            raise ValueError(f"tensor {name!r} lies outside the file's data")
        infos[name] = TensorInfo(path.name, DTYPES.get(dtype_code), dtype_code, shape)
    return infos


def weight_files_present(directory: Path, stem: str) -> bool:
    """Whether ``{stem}.safetensors`` or ``{stem}.safetensors.index.json`` exists."""
    return (directory / f"{stem}.safetensors").is_file() or (
        directory / f"{stem}.safetensors.index.json"
    ).is_file()


def open_weights(directory: Path, stem: str, findings: Findings) -> TensorStore | None:
    """Read the headers of ``{stem}.safetensors`` or of the shards its index lists.

    :returns: the store, or None when no weights could be found (an error is recorded).
    """
    index_path = directory / f"{stem}.safetensors.index.json"
    single = directory / f"{stem}.safetensors"
    if index_path.is_file():
        if single.is_file():
            findings.warn(
                f"both {single.name} and {index_path.name} exist; loaders use the index, "
                f"so {single.name} is ignored"
            )
        return _open_sharded(directory, index_path, stem, findings)
    if single.is_file():
        infos = _read_file(single, findings)
        return TensorStore(directory, infos or {}, [single.name])
    findings.error(f"no weights: neither {single.name} nor {index_path.name} is in {directory}")
    return None


def _read_file(path: Path, findings: Findings) -> dict[str, TensorInfo] | None:
    try:
        return read_header(path)
    except (OSError, ValueError, KeyError, TypeError, UnicodeDecodeError) as exc:
        findings.error(f"{path.name}: not a readable safetensors file ({exc})")
        return None


def _open_sharded(directory: Path, index_path: Path, stem: str, findings: Findings) -> TensorStore:
    weight_map = _read_index(index_path, findings)
    infos: dict[str, TensorInfo] = {}
    files = sorted(set(weight_map.values()))
    readable: set[str] = set()
    for file in files:
        headers = _read_shard(directory, index_path.name, file, weight_map, findings)
        if headers is None:
            continue
        readable.add(file)
        for name, info in headers.items():
            if weight_map.get(name) != file:
                findings.error(
                    f"tensor {name} is stored in {file} but {index_path.name} maps it to "
                    f"{weight_map.get(name, 'no file')}; loaders would not read it from {file}"
                )
            else:
                infos[name] = info
    for name, file in sorted(weight_map.items()):
        if name not in infos and file in readable:
            findings.error(
                f"{index_path.name} maps tensor {name} to {file}, which does not hold it"
            )
    shards = re.compile(rf"^{re.escape(stem)}-\d+-of-\d+\.safetensors$")
    stray = sorted(
        p.name for p in directory.iterdir() if shards.match(p.name) and p.name not in files
    )
    if stray:
        findings.warn(
            f"shard file(s) not listed in {index_path.name} are ignored by loaders: {stray}"
        )
    return TensorStore(directory, infos, files)


def _read_shard(
    directory: Path, index_name: str, file: str, weight_map: dict[str, str], findings: Findings
) -> dict[str, TensorInfo] | None:
    """Headers of one shard named by the index; None (and an error) when it cannot be read."""
    if not SAFE_FILE_NAME.match(file):
        findings.error(f"{index_name} names an unsafe or invalid file name {file!r}")
        return None
    path = directory / file
    if not path.is_file():
        missing = sorted(t for t, f in weight_map.items() if f == file)
        findings.error(
            f"{index_name} names the missing file {file} "
            f"(for {len(missing)} tensor(s): {', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''})"
        )
        return None
    return _read_file(path, findings)


def _read_index(index_path: Path, findings: Findings) -> dict[str, str]:
    try:
        data = json.loads(index_path.read_text(encoding="utf-8"))
        weight_map = data["weight_map"]
        if not isinstance(weight_map, dict):
            raise TypeError("weight_map is not an object")
    except (OSError, ValueError, KeyError, TypeError) as exc:
        findings.error(f"{index_path.name}: unreadable index ({exc})")
        return {}
    return {str(k): str(v) for k, v in weight_map.items()}
