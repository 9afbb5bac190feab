"""The streaming safetensors writer: files the safetensors library and transformers read back bit
for bit, the same shards and index as the former buffering writer, and no tensor held in memory."""

from __future__ import annotations

import gc
import json
import shutil
import sys
import tracemalloc
import weakref
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from msquant.export import safetensors_file, shards
from msquant.plugin.export import ShardedSafetensorsWriter, hf_weights_writer, unique_state_items


def raw(tensor: torch.Tensor) -> bytes:
    """The tensor's bytes (bitwise comparison, NaN patterns included)."""
    return tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def assert_bit_identical(
    loaded: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]
) -> None:
    assert sorted(loaded) == sorted(expected)
    for name, tensor in expected.items():
        assert loaded[name].dtype == tensor.dtype, name
        assert loaded[name].shape == tensor.shape, name
        assert raw(loaded[name]) == raw(tensor.detach()), name


def random_bits(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """A tensor of ``dtype`` whose bytes are random (every bit pattern, NaNs included)."""
    count = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
    generator = torch.Generator().manual_seed(seed)
    data = torch.randint(0, 256, (count,), dtype=torch.uint8, generator=generator)
    return data.view(dtype).reshape(shape)


def read_header(path: Path) -> tuple[int, dict[str, Any]]:
    """A safetensors file's header length and its JSON header, read independently."""
    with open(path, "rb") as handle:
        length = int.from_bytes(handle.read(8), "little")
        return length, json.loads(handle.read(length))


def assert_aligned(path: Path) -> None:
    """Every tensor starts at a file position that is a multiple of its element size."""
    length, header = read_header(path)
    loaded = load_file(str(path))
    for name, entry in header.items():
        if name != "__metadata__":
            start = entry["data_offsets"][0]
            assert (8 + length + start) % loaded[name].element_size() == 0, name


def every_dtype() -> dict[str, torch.Tensor]:
    """One tensor per supported dtype, plus 0-dim, empty, non-contiguous and parameter inputs."""
    tensors = {
        f"{dtype}".removeprefix("torch."): random_bits((3, 5), dtype, seed)
        for seed, dtype in enumerate(
            [torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64]
            + [torch.int32, torch.int16, torch.int8, torch.uint8, torch.complex64]
        )
    }
    for name in ["float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "uint16", "uint32", "uint64"]:
        if hasattr(torch, name):
            tensors[name] = random_bits((4, 3), getattr(torch, name), len(tensors))
    tensors["bool"] = torch.tensor([[True, False, True], [False, False, True]])
    tensors["scalar_bf16"] = torch.tensor(-1.5, dtype=torch.bfloat16)
    tensors["scalar_i64"] = torch.tensor(2**40 + 3)
    tensors["empty_f32"] = torch.empty(0, 3)
    tensors["empty_bf16"] = torch.empty(2, 0, dtype=torch.bfloat16)
    tensors["transposed"] = torch.arange(12, dtype=torch.float32).reshape(3, 4).t()
    tensors["parameter"] = torch.nn.Parameter(torch.randn(2, 3))
    return tensors


def test_every_dtype_reloads_bit_identical(tmp_path: Path) -> None:
    tensors = every_dtype()
    assert "float8_e4m3fn" in tensors  # torch 2.13 has fp8: the case must not be skipped silently
    writer = ShardedSafetensorsWriter(tmp_path, "w", None)
    for name, tensor in tensors.items():
        writer.add(name, tensor)
    assert writer.close() == {name: "w.safetensors" for name in tensors}
    assert [p.name for p in tmp_path.iterdir()] == ["w.safetensors"]  # no temporaries left
    assert_bit_identical(load_file(str(tmp_path / "w.safetensors")), tensors)
    with safe_open(str(tmp_path / "w.safetensors"), framework="pt") as handle:
        assert handle.metadata() == {"format": "pt"}
        assert sorted(handle.keys()) == sorted(tensors)
        assert raw(handle.get_tensor("bfloat16")) == raw(tensors["bfloat16"])
        assert handle.get_slice("float32")[1:2].shape == (1, 5)
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    assert writer.total_bytes == nbytes
    assert_aligned(tmp_path / "w.safetensors")


def test_tensors_are_aligned_whatever_the_order_they_come_in(tmp_path: Path) -> None:
    """An odd-sized int8 tensor first would misalign everything after it in insertion order."""
    tensors = {
        "i8": torch.tensor([1, 2, 3], dtype=torch.int8),
        "f32": torch.tensor([1.5]),
        "bool": torch.tensor([True]),
        "f16": torch.tensor([2.5], dtype=torch.float16),
        "f64": torch.tensor([3.5], dtype=torch.float64),
        "f32_b": torch.tensor([4.5, 5.5, 6.5]),
    }
    writer = ShardedSafetensorsWriter(tmp_path, "w", 40)
    for name, tensor in tensors.items():
        writer.add(name, tensor)
    writer.close()
    files = sorted(tmp_path.glob("*.safetensors"))
    assert len(files) == 1  # 3 + 4 + 1 + 2 + 8 + 12 = 30 bytes
    assert_aligned(files[0])
    _, header = read_header(files[0])
    assert header["f64"]["data_offsets"] == [0, 8]
    assert header["i8"]["data_offsets"] == [26, 29]
    assert_bit_identical(load_file(str(files[0])), tensors)


def test_file_layout_follows_the_format(tmp_path: Path) -> None:
    """8-byte little-endian header length, JSON padded with spaces to 8 bytes, then the data."""
    writer = ShardedSafetensorsWriter(tmp_path, "w", None)
    writer.add("a", torch.tensor([1.0, 2.0], dtype=torch.float16))
    writer.add("b.c", torch.tensor([7], dtype=torch.int8))
    writer.close()
    content = (tmp_path / "w.safetensors").read_bytes()
    length, _ = read_header(tmp_path / "w.safetensors")
    assert length % 8 == 0
    text = content[8 : 8 + length].decode("utf-8")
    assert text.startswith("{") and text.rstrip(" ").endswith("}")  # space padding only
    assert json.loads(text) == {
        "__metadata__": {"format": "pt"},
        "a": {"dtype": "F16", "shape": [2], "data_offsets": [0, 4]},
        "b.c": {"dtype": "I8", "shape": [1], "data_offsets": [4, 5]},
    }
    assert content[8 + length :] == raw(torch.tensor([1.0, 2.0], dtype=torch.float16)) + b"\x07"


def test_bytes_are_written_when_added(tmp_path: Path) -> None:
    """Changing a tensor after ``add`` does not change the file: its bytes are already on disk."""
    writer = ShardedSafetensorsWriter(tmp_path, "w", None)
    tensor = torch.ones(4)
    writer.add("t", tensor)
    [data_file] = tmp_path.iterdir()
    assert data_file.name.startswith(".") and data_file.read_bytes() == raw(torch.ones(4))
    tensor.zero_()
    writer.close()
    assert torch.equal(load_file(str(tmp_path / "w.safetensors"))["t"], torch.ones(4))


class LegacyWriter:
    """The former buffering writer (whole shards in memory, ``save_file``), as the reference."""

    def __init__(self, directory: Path, prefix: str, limit: int | None, plain: bool) -> None:
        self.directory, self.prefix, self.limit, self.plain = directory, prefix, limit, plain
        self.pending: dict[str, torch.Tensor] = {}
        self.pending_bytes = 0
        self.shards: list[tuple[Path, list[str]]] = []
        self.total_bytes = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        data = tensor.detach().contiguous().clone()
        size = data.numel() * data.element_size()
        if self.limit is not None and self.pending and self.pending_bytes + size > self.limit:
            self.flush()
        self.pending[name] = data
        self.pending_bytes += size
        self.total_bytes += size

    def flush(self) -> None:
        if self.pending:
            path = self.directory / f".{self.prefix}-part{len(self.shards) + 1}.tmp"
            save_file(self.pending, str(path), metadata={"format": "pt"})
            self.shards.append((path, list(self.pending)))
            self.pending, self.pending_bytes = {}, 0

    def close(self, prefix: str | None) -> dict[str, str]:
        self.prefix = prefix or self.prefix
        if self.limit is None or (self.plain and not self.shards):
            name = f"{self.prefix}.safetensors"
            save_file(self.pending, str(self.directory / name), metadata={"format": "pt"})
            return {tensor: name for tensor in self.pending}
        self.flush()
        if not self.shards:
            path = self.directory / f".{self.prefix}-part1.tmp"
            save_file({}, str(path), metadata={"format": "pt"})
            self.shards.append((path, []))
        weight_map = {}
        for number, (tmp, names) in enumerate(self.shards, start=1):
            final = f"{self.prefix}-{number:05d}-of-{len(self.shards):05d}.safetensors"
            tmp.rename(self.directory / final)
            weight_map.update({tensor: final for tensor in names})
        index = {
            "metadata": {"total_size": self.total_bytes},
            "weight_map": dict(sorted(weight_map.items())),
        }
        (self.directory / f"{self.prefix}.safetensors.index.json").write_text(json.dumps(index))
        return weight_map


# name: (tensor sizes in elements, dtype, limit in bytes, plain_when_single, final prefix,
#        shards expected by the rule "a new shard starts when a non-empty one would pass the
#        limit"; 0 = one plain file without index)
CASES: dict[str, tuple[list[int], torch.dtype, int | None, bool, str | None, int]] = {
    "shards": ([100] * 7 + [600], torch.float32, 1000, False, None, 5),
    "exact_fit_then_new_shard": ([125, 125, 1, 250, 250], torch.float32, 1000, False, None, 4),
    "oversized_first_and_last": ([300, 10, 10, 400], torch.float32, 1000, False, None, 3),
    "empty_tensors_at_boundaries": ([250, 0, 0, 1, 0, 250], torch.float32, 1000, False, None, 3),
    "bf16": ([250, 250, 500, 1], torch.bfloat16, 1000, False, None, 3),
    "int8_plain_but_too_big": ([400] * 7, torch.int8, 1000, True, None, 4),
    "plain_single": ([100] * 7, torch.float32, 10**6, True, None, 0),
    "one_indexed_shard": ([100] * 7, torch.float32, 10**6, False, None, 1),
    "unlimited": ([100] * 7 + [600], torch.float32, None, False, None, 0),
    "renamed_at_close": ([200, 200], torch.float32, 1000, False, "final", 2),
    "nothing_sharded": ([], torch.float32, 1000, False, None, 1),
    "nothing_plain": ([], torch.float32, 1000, True, None, 0),
    "nothing_unlimited": ([], torch.float32, None, False, "final", 0),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_same_shards_and_index_as_the_buffering_writer(case: str, tmp_path: Path) -> None:
    sizes, dtype, limit, plain, prefix, expected_shards = CASES[case]
    tensors = {f"layer.{i}.w": torch.full((n,), i + 1).to(dtype) for i, n in enumerate(sizes)}
    streamed, legacy = tmp_path / "streamed", tmp_path / "legacy"
    streamed.mkdir()
    legacy.mkdir()
    writer = ShardedSafetensorsWriter(streamed, "w", limit, plain)
    reference = LegacyWriter(legacy, "w", limit, plain)
    for name, tensor in tensors.items():
        writer.add(name, tensor)
        reference.add(name, tensor)
    weight_map = writer.close(prefix)
    assert weight_map == reference.close(prefix)
    assert writer.total_bytes == reference.total_bytes
    files = sorted(p.name for p in streamed.iterdir())  # hidden temporaries included
    assert files == sorted(p.name for p in legacy.iterdir())
    stem = prefix or "w"
    if expected_shards:
        shard_names = [
            f"{stem}-{i:05d}-of-{expected_shards:05d}.safetensors"
            for i in range(1, 1 + expected_shards)
        ]
        assert files == sorted([*shard_names, f"{stem}.safetensors.index.json"])
    else:
        assert files == [f"{stem}.safetensors"]
    for name in files:
        if name.endswith(".json"):
            assert json.loads((streamed / name).read_text()) == json.loads(
                (legacy / name).read_text()
            )
        else:
            assert_bit_identical(load_file(str(streamed / name)), load_file(str(legacy / name)))
            part = load_file(str(streamed / name))
            assert all(weight_map[tensor] == name for tensor in part)
            assert sum(t.nbytes for t in part.values()) <= (limit or 10**9) or len(part) == 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shard_bytes", [None, 40_000])
def test_transformers_loads_a_model_written_by_the_writer(
    dtype: torch.dtype, shard_bytes: int | None, tiny_llama: Path, tmp_path: Path
) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=dtype)
    out = tmp_path / "model"
    out.mkdir()
    if shard_bytes is None:
        writer = hf_weights_writer(out, 0)
    else:
        writer = ShardedSafetensorsWriter(out, "model", shard_bytes)
    for name, tensor in unique_state_items(model):
        writer.add(name, tensor)
    writer.close()
    shutil.copy(tiny_llama / "config.json", out / "config.json")
    written = sorted(p.name for p in out.glob("*.safetensors"))
    assert (len(written) > 1) == (shard_bytes is not None)
    reloaded = AutoModelForCausalLM.from_pretrained(out, dtype=dtype)
    expected = model.state_dict()
    actual = reloaded.state_dict()
    assert sorted(actual) == sorted(expected)
    assert all(raw(actual[k]) == raw(expected[k]) and actual[k].dtype == dtype for k in expected)


def large_live_tensors(min_bytes: int) -> int:
    """How many tensors of at least ``min_bytes`` the Python garbage collector can reach."""
    gc.collect()
    return sum(
        1
        for obj in gc.get_objects()
        if issubclass(type(obj), torch.Tensor) and obj.numel() * obj.element_size() >= min_bytes
    )


def test_added_tensors_are_not_held_in_memory(tmp_path: Path) -> None:
    """50 tensors of 8 MB in one unlimited file: none is kept alive (not even a copy), and
    assembling the 400 MB file allocates chunks, not the whole shard, on the Python side."""
    count, numel = 50, 2 * 1024**2  # float32: 8 MiB each
    before = large_live_tensors(numel * 4)
    writer = ShardedSafetensorsWriter(tmp_path, "w", None)
    refs = []
    tracemalloc.start()
    try:
        for i in range(count):
            tensor = torch.full((numel,), float(i))
            refs.append(weakref.ref(tensor))
            writer.add(f"t{i}", tensor)
            del tensor
            assert refs[-1]() is None  # the writer kept no reference to the input
        assert large_live_tensors(numel * 4) == before  # nor to a copy of it
        writer.close()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 4 * safetensors_file.COPY_CHUNK_BYTES  # Python-side peak: a few chunks at most
    path = tmp_path / "w.safetensors"
    assert [p.name for p in tmp_path.iterdir()] == ["w.safetensors"]
    assert path.stat().st_size > count * numel * 4
    with safe_open(str(path), framework="pt") as handle:
        for i in (0, 17, count - 1):
            assert torch.equal(handle.get_tensor(f"t{i}"), torch.full((numel,), float(i)))
    path.unlink()  # 400 MB: do not keep it among pytest's retained temporary folders


def test_errors(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    writer = ShardedSafetensorsWriter(tmp_path, "w", None)
    with pytest.raises(
        ValueError, match=r"cannot store dtype torch\.complex128; supported: .*bfloat16"
    ):
        writer.add("c", torch.zeros(2, dtype=torch.complex128))
    with pytest.raises(ValueError, match="'__metadata__' is reserved"):
        writer.add("__metadata__", torch.zeros(1))
    with pytest.raises(ValueError, match=r"'m' is on the meta device .* in after_layer"):
        writer.add("m", torch.zeros(2, device="meta"))
    writer.add("c", torch.zeros(2))  # a refused tensor does not take its name
    with pytest.raises(ValueError, match="tensor 'c' written twice"):
        writer.add("c", torch.zeros(2))
    writer.close()
    with pytest.raises(RuntimeError, match="writer is closed"):
        writer.add("d", torch.zeros(1))
    with pytest.raises(RuntimeError, match="writer is already closed"):
        writer.close()
    assert list(load_file(str(tmp_path / "w.safetensors"))) == ["c"]
    monkeypatch.setattr(sys, "byteorder", "big")
    with pytest.raises(RuntimeError, match="needs a little-endian host; this one is big-endian"):
        ShardedSafetensorsWriter(tmp_path, "x", None)


def test_a_failed_shard_write_propagates(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Failures while assembling a shard (disk full) reach the caller (the run's staging folder is
    then discarded)."""

    def disk_full(path: Path, entries: object, data_paths: object) -> None:
        raise OSError(28, "No space left on device", str(path))

    writer = ShardedSafetensorsWriter(tmp_path, "w", 10)
    writer.add("a", torch.zeros(2))
    monkeypatch.setattr(shards, "write_shard_file", disk_full)
    with pytest.raises(OSError, match="No space left"):
        writer.add("b", torch.zeros(2))  # starts a new shard: completes the first one
