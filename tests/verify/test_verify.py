"""``msquant verify``: exports read back by independent readers, checked, and corrupted on purpose.

The exports checked here are written by the tests themselves from the format specifications
(``shared/reference/formats.md`` 3.1-3.2, ``msmodelslim.md`` 7), not by msquant's exporters:
tensors are packed with a bit-list packer that is first pinned to compressed-tensors' own packer.
Each export must verify cleanly (against the in-memory reference and the original weights), then
each corruption must produce an error naming the damaged tensor or file.
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
import yaml
from conftest import EXAMPLES, CliResult
from safetensors.torch import load_file, save_file

import msquant
import msquant.plugin
import msquant.plugin.numerics
from msquant import ExportReadError, ExportVerificationError
from msquant.plugin import QuantizedWeight
from msquant.verify import relative_error_bound, verify_export
from msquant.verify.unpack import unpack_int4_pairs, unpack_int32_stream

# --- a synthetic one-layer model --------------------------------------------------------------

L0 = "model.layers.0"
Q, K, V, O_PROJ = (f"{L0}.self_attn.{p}_proj" for p in "qkvo")
GATE, UP, DOWN = (f"{L0}.mlp.{p}_proj" for p in ("gate", "up", "down"))
SHAPES = {Q: (64, 64), K: (32, 64), V: (32, 64), O_PROJ: (64, 64), GATE: (96, 64), UP: (96, 64)}
SHAPES[DOWN] = (64, 96)
FLOATS = {
    "model.embed_tokens.weight": (40, 64),
    f"{L0}.input_layernorm.weight": (64,),
    "model.norm.weight": (64,),
    "lm_head.weight": (40, 64),
}
Scheme = tuple[int, bool, int | None]  # bits, symmetric, group_size


def original_weights(seed: int = 0) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    tensors = {
        f"{m}.weight": torch.randn(shape, generator=generator) * 0.02 for m, shape in SHAPES.items()
    }
    for name, shape in FLOATS.items():
        tensors[name] = torch.randn(shape, generator=generator) * (0.02 if len(shape) == 2 else 1)
    tensors[f"{O_PROJ}.bias"] = torch.randn(64, generator=generator) * 0.01
    return tensors


@pytest.fixture(scope="module")
def original(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, torch.Tensor]]:
    """The float 'model' folder (safetensors + config.json) and its tensors."""
    folder = tmp_path_factory.mktemp("float_model")
    tensors = original_weights()
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 64}))
    return folder, tensors


def reference_for(
    tensors: dict[str, torch.Tensor], schemes: dict[str, Scheme]
) -> dict[str, QuantizedWeight]:
    """The in-memory result: msquant's round-to-nearest of each selected weight."""
    return {
        module: msquant.plugin.numerics.quantize_weight_minmax(
            tensors[f"{module}.weight"], bits, sym, group
        )
        for module, (bits, sym, group) in schemes.items()
    }


# --- packers written from the specifications --------------------------------------------------


def pack_bits(values: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Unsigned values packed densely into int32 words along ``dim``, LSB first (bit-list method)."""
    data = values.to(torch.int64).movedim(dim, -1)
    count = data.shape[-1]
    stream = ((data.unsqueeze(-1) >> torch.arange(bits)) & 1).reshape(
        *data.shape[:-1], count * bits
    )
    stream = F.pad(stream, (0, (-count * bits) % 32))
    words = (stream.reshape(*data.shape[:-1], -1, 32) << torch.arange(32)).sum(-1)
    words = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    return words.movedim(-1, dim).contiguous()


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """msModelSlim int4: column 2i in the low nibble, 2i+1 in the high nibble of one int8."""
    low = codes[:, 0::2].to(torch.int16) & 0xF
    high = codes[:, 1::2].to(torch.int16) & 0xF
    byte = low | (high << 4)
    return torch.where(byte >= 128, byte - 256, byte).to(torch.int8)


def write_weights(
    folder: Path, stem: str, tensors: dict[str, torch.Tensor], shards: int = 1
) -> None:
    """One ``{stem}.safetensors`` or ``shards`` files plus a Hugging Face index."""
    folder.mkdir(parents=True, exist_ok=True)
    if shards == 1:
        save_file(tensors, str(folder / f"{stem}.safetensors"), metadata={"format": "pt"})
        return
    names = sorted(tensors)
    weight_map = {}
    for i in range(shards):
        file = f"{stem}-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: tensors[n].contiguous() for n in names[i::shards]}
        save_file(part, str(folder / file), metadata={"format": "pt"})
        weight_map.update({n: file for n in part})
    index = {"metadata": {"total_size": 0}, "weight_map": weight_map}
    (folder / f"{stem}.safetensors.index.json").write_text(json.dumps(index))


ASCEND_SCHEMES: dict[str, Scheme] = {m: (8, True, None) for m in (Q, K, V, O_PROJ)}
ASCEND_SCHEMES.update({GATE: (4, False, 32), UP: (4, False, 32)})


def write_ascend(
    folder: Path,
    tensors: dict[str, torch.Tensor],
    reference: dict[str, QuantizedWeight],
    shards: int = 2,
) -> Path:
    """msModelSlim v1 layout: W8A16 ``[out, in]``, W4A16 ``[out, in/2]``, float32 scale/offset."""
    stored: dict[str, torch.Tensor] = {}
    types: dict[str, str] = {}
    for name, tensor in tensors.items():
        module = name.removesuffix(".weight")
        if module not in reference:
            stored[name], types[name] = tensor, "FLOAT"
            continue
        q = reference[module]
        kind = "W8A16" if q.bits == 8 else "W4A16"
        stored[name] = q.codes if q.bits == 8 else pack_nibbles(q.codes)
        stored[f"{module}.weight_scale"] = q.scale
        stored[f"{module}.weight_offset"] = q.offset
        types.update({f"{module}.{s}": kind for s in ("weight", "weight_scale", "weight_offset")})
    groups = {q.group_size for q in reference.values() if q.group_size}
    description = {
        **types,
        "version": "1.0.0",
        "model_quant_type": "W4A16" if "W4A16" in types.values() else "W8A16",
        "metadata": {},
        "group_size": max(groups) if groups else 0,
        "optional": {},
    }
    write_weights(folder, "quant_model_weights", stored, shards)
    (folder / "quant_model_description.json").write_text(json.dumps(description, indent=4))
    (folder / "config.json").write_text(json.dumps({"model_type": "llama"}))
    return folder


GPTQ_SCHEMES: dict[str, Scheme] = {m: (4, True, 32) for m in (Q, K, V, O_PROJ, GATE, UP)}


def gptq_tensors(q: QuantizedWeight, module: str, v2: bool) -> dict[str, torch.Tensor]:
    """GPTQ layout: qweight [in*b/32, out], qzeros [G, out*b/32] (v1: zero-1), scales fp16."""
    half = 2 ** (q.bits - 1)
    zeros = q.offset.to(torch.int64) + half  # unsigned zero points [out, G]
    stored_zeros = zeros if v2 else zeros - 1
    return {
        f"{module}.qweight": pack_bits((q.codes.to(torch.int64) + half).t(), q.bits, 0),
        f"{module}.qzeros": pack_bits(stored_zeros.t() & (2**q.bits - 1), q.bits, 1),
        f"{module}.scales": q.scale.t().contiguous().to(torch.float16),
        f"{module}.g_idx": (torch.arange(q.shape[1]) // q.effective_group_size).to(torch.int32),
    }


def write_gptq(
    folder: Path,
    tensors: dict[str, torch.Tensor],
    reference: dict[str, QuantizedWeight],
    qconfig: dict[str, Any],
    v2: bool = False,
) -> Path:
    stored = {
        name: tensor
        for name, tensor in tensors.items()
        if name.removesuffix(".weight") not in reference
    }
    for module, q in reference.items():
        stored.update(gptq_tensors(q, module, v2))
    fmt = "gptq_v2" if v2 else "gptq"
    config = {
        "quant_method": "gptq",
        "format": fmt,
        "checkpoint_format": fmt,
        "pack_dtype": "int32",
        "lm_head": False,
        "desc_act": False,
        "meta": {"quantizer": ["msquant:0.1.0"]},
        **qconfig,
    }
    write_weights(folder, "model", stored)
    (folder / "config.json").write_text(
        json.dumps({"model_type": "llama", "quantization_config": config})
    )
    (folder / "quantize_config.json").write_text(json.dumps(config))
    return folder


CT_GROUPS = {
    "group_0": (["re:.*self_attn\\.[qkvo]_proj$"], 4, True, 32),
    "group_1": (["re:.*mlp\\.(gate|up)_proj$"], 8, False, None),
}


def write_ct(
    folder: Path,
    tensors: dict[str, torch.Tensor],
    groups: dict[str, tuple[list[str], int, bool, int | None]],
    ignore: list[str],
) -> tuple[Path, dict[str, QuantizedWeight]]:
    """compressed-tensors ``pack-quantized``, packed with compressed-tensors' own packer."""
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    stored: dict[str, torch.Tensor] = {}
    reference: dict[str, QuantizedWeight] = {}
    config_groups = {}
    for name, (targets, bits, sym, size) in groups.items():
        config_groups[name] = {
            "targets": targets,
            "format": "pack-quantized",
            "weights": {
                "num_bits": bits,
                "type": "int",
                "symmetric": sym,
                "strategy": "group" if size else "channel",
                "group_size": size,
                "dynamic": False,
            },
            "input_activations": None,
            "output_activations": None,
        }
        pattern = targets[0].removeprefix("re:")
        for module in SHAPES:
            if re.match(pattern, module):
                reference[module] = q = msquant.plugin.numerics.quantize_weight_minmax(
                    tensors[f"{module}.weight"], bits, sym, size
                )
                stored[f"{module}.weight_packed"] = pack_to_int32(q.codes, bits)
                stored[f"{module}.weight_scale"] = q.scale.to(torch.bfloat16)
                stored[f"{module}.weight_shape"] = torch.tensor(q.shape, dtype=torch.int64)
                if not sym:
                    zero = q.offset.to(torch.int8)
                    stored[f"{module}.weight_zero_point"] = pack_to_int32(zero, bits, packed_dim=0)
    for name, tensor in tensors.items():
        if name.removesuffix(".weight") not in reference:
            stored[name] = tensor
    config = {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "quantization_status": "compressed",
        "config_groups": config_groups,
        "ignore": ignore,
    }
    write_weights(folder, "model", stored)
    (folder / "config.json").write_text(
        json.dumps({"model_type": "llama", "quantization_config": config})
    )
    return folder, reference


# --- editing helpers -------------------------------------------------------------------------


def edit_tensors(folder: Path, change: Callable[[dict[str, torch.Tensor]], None]) -> None:
    """Apply ``change`` to the tensors of every safetensors file in ``folder`` (in place)."""
    for file in sorted(folder.glob("*.safetensors")):
        tensors = load_file(str(file))
        change(tensors)
        save_file(tensors, str(file), metadata={"format": "pt"})


def edit_json(path: Path, change: Callable[[dict[str, Any]], None]) -> None:
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))


def set_tensor(name: str, make: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[Path], None]:
    def change(tensors: dict[str, torch.Tensor]) -> None:
        if name in tensors:
            tensors[name] = make(tensors[name]).contiguous()

    return lambda folder: edit_tensors(folder, change)


def assert_errors(report: msquant.VerifyReport, *fragments: str) -> None:
    """Some error contains every fragment (the damaged tensor's name among them)."""
    assert not report.ok
    assert any(all(f in error for f in fragments) for error in report.errors), report.errors


# --- unpackers: byte-level pins --------------------------------------------------------------


def test_unpack_int32_stream_hand_computed_words() -> None:
    # 4-bit: values 1..8 in one word, LSB first -> 0x87654321
    word = torch.tensor([[0x87654321 - 2**32]], dtype=torch.int32)
    values, clean = unpack_int32_stream(word, 4, 8, 1)
    assert values.tolist() == [[1, 2, 3, 4, 5, 6, 7, 8]] and clean
    # 3-bit: 11 values span 33 bits; value 10 (= 0b101) straddles words 0 and 1
    words = torch.tensor([[0x40000007], [0x00000001]], dtype=torch.int32)
    values, clean = unpack_int32_stream(words, 3, 11, 0)
    assert values[:, 0].tolist() == [7] + [0] * 9 + [5] and clean
    # 2-bit along dim 0, and a padding bit left set after the last value
    values, clean = unpack_int32_stream(torch.tensor([[0b111001]], dtype=torch.int32), 2, 2, 0)
    assert values.tolist() == [[1], [2]] and not clean
    with pytest.raises(ValueError, match="expected 1"):
        unpack_int32_stream(torch.zeros(1, 2, dtype=torch.int32), 8, 4, 1)


def test_unpack_int4_pairs_low_nibble_first() -> None:
    packed = torch.tensor([[0x21, -1, 0x8F - 256, 0x70]], dtype=torch.int8)
    assert unpack_int4_pairs(packed).tolist() == [[1, 2, -1, -1, -1, -8, 0, 7]]


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_test_packer_matches_compressed_tensors(bits: int) -> None:
    """The packer used to build the GPTQ exports below is compressed-tensors' layout exactly."""
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    codes = torch.randint(-(2 ** (bits - 1)), 2 ** (bits - 1), (6, 40), dtype=torch.int8)
    unsigned = codes.to(torch.int64) + 2 ** (bits - 1)
    assert torch.equal(pack_bits(unsigned, bits, 1), pack_to_int32(codes, bits))
    assert torch.equal(pack_bits(unsigned, bits, 0), pack_to_int32(codes, bits, packed_dim=0))
    values, clean = unpack_int32_stream(pack_to_int32(codes, bits), bits, 40, 1)
    assert torch.equal(values, unsigned) and clean


# --- Ascend -----------------------------------------------------------------------------------


@pytest.fixture
def ascend(
    original: tuple[Path, dict[str, torch.Tensor]], tmp_path: Path
) -> tuple[Path, dict[str, QuantizedWeight]]:
    reference = reference_for(original[1], ASCEND_SCHEMES)
    return write_ascend(tmp_path / "ascend", original[1], reference), reference


def test_ascend_export_verifies(
    ascend: tuple[Path, dict[str, QuantizedWeight]], original: tuple[Path, dict[str, torch.Tensor]]
) -> None:
    folder, reference = ascend
    report = verify_export(folder, reference=reference, model_path=original[0])
    assert report.ok, report.errors
    assert report.format == "ascend"
    assert [e.name for e in report.layers] == sorted(ASCEND_SCHEMES)
    gate, q = report.layer(GATE), report.layer(Q)
    assert (gate.scheme, gate.bits, gate.group_size, gate.symmetric) == ("W4A16", 4, 32, False)
    assert (q.scheme, q.bits, q.group_size, q.symmetric) == ("W8A16", 8, None, True)
    for entry in report.layers:
        assert entry.max_code_mismatch == 0
        assert entry.relative_error is not None and 0 < entry.relative_error < entry.error_bound
    assert report.layer(GATE).relative_error > 10 * report.layer(Q).relative_error  # 4 vs 8 bits
    notes = "\n".join(report.warnings)
    assert "no W4A16 linear scheme" in notes and GATE in notes
    assert "sign flipped" in notes  # asymmetric offsets through npu_weight_quant_batchmatmul
    assert report.to_dict()["ok"] is True and json.dumps(report.to_dict())


def _flip_nibbles(t: torch.Tensor) -> torch.Tensor:
    out = t.clone()
    byte = int(out[3, 5]) & 0xFF
    swapped = ((byte & 0xF) << 4) | (byte >> 4)
    if swapped == byte:  # make sure the byte changes
        swapped = byte ^ 0x01
    out[3, 5] = swapped - 256 if swapped >= 128 else swapped
    return out


def _nan(t: torch.Tensor) -> torch.Tensor:
    out = t.clone()
    out[1, 0] = float("nan")
    return out


def _drop_description(key: str) -> Callable[[Path], None]:
    return lambda f: edit_json(f / "quant_model_description.json", lambda d: d.pop(key))


def _index_to_missing_file(folder: Path) -> None:
    def change(data: dict[str, Any]) -> None:
        data["weight_map"][f"{O_PROJ}.weight_scale"] = (
            "quant_model_weights-00003-of-00003.safetensors"
        )

    edit_json(folder / "quant_model_weights.safetensors.index.json", change)


def _set_offset(value: float) -> Callable[[torch.Tensor], torch.Tensor]:
    def make(t: torch.Tensor) -> torch.Tensor:
        out = t.clone()
        out[0, 0] = value
        return out

    return make


ASCEND_CORRUPTIONS: dict[str, tuple[Callable[[Path], None], tuple[str, ...]]] = {
    "wrong_scale_shape": (
        set_tensor(f"{Q}.weight_scale", lambda t: t.repeat(1, 3)),
        (f"{Q}.weight_scale", "shape [64, 3]"),
    ),
    "transposed_non_square": (
        set_tensor(f"{K}.weight", lambda t: t.t()),
        (f"{K}.weight_scale", "does not fit"),
    ),
    "transposed_square": (
        set_tensor(f"{Q}.weight", lambda t: t.t()),
        (f"{Q}.weight", "relative error"),
    ),
    "flipped_nibble": (
        set_tensor(f"{GATE}.weight", _flip_nibbles),
        (f"{GATE}.weight", "differ from the in-memory"),
    ),
    "wrong_dtype": (
        set_tensor(f"{V}.weight_offset", lambda t: t.half()),
        (f"{V}.weight_offset", "dtype F16"),
    ),
    "nan_scale": (set_tensor(f"{UP}.weight_scale", _nan), (f"{UP}.weight_scale", "non-finite")),
    "offset_out_of_int4": (
        set_tensor(f"{UP}.weight_offset", _set_offset(9.0)),
        (f"{UP}.weight_offset", "outside the 4-bit"),
    ),
    "missing_tensor": (
        lambda f: edit_tensors(f, lambda t: t.pop(f"{K}.weight_offset", None)),
        (f"{K}.weight_offset", "no such tensor is stored"),
    ),
    "missing_description_entry": (
        _drop_description(f"{O_PROJ}.weight_scale"),
        (f"{O_PROJ}.weight_scale", "missing from quant_model_description.json"),
    ),
    "description_names_ghost": (
        lambda f: edit_json(
            f / "quant_model_description.json", lambda d: d.update({f"{L0}.ghost.weight": "FLOAT"})
        ),
        (f"{L0}.ghost.weight", "no such tensor"),
    ),
    "missing_global_key": (_drop_description("group_size"), ("lacks the global key 'group_size'",)),
    "global_group_size_differs": (
        lambda f: edit_json(
            f / "quant_model_description.json", lambda d: d.update({"group_size": 64})
        ),
        ("group_size 64 but per-group layers use [32]",),
    ),
    "index_names_missing_file": (
        _index_to_missing_file,
        ("missing file quant_model_weights-00003-of-00003", f"{O_PROJ}.weight_scale"),
    ),
    "unknown_type": (
        lambda f: edit_json(
            f / "quant_model_description.json",
            lambda d: d.update({f"{DOWN}.weight": "W4A4_MXFP4_DUALSCALE"}),
        ),
        (f"{DOWN}.weight", "W4A4_MXFP4_DUALSCALE", "not supported"),
    ),
}


@pytest.mark.parametrize("corruption", sorted(ASCEND_CORRUPTIONS))
def test_ascend_corruption_is_named(
    corruption: str,
    ascend: tuple[Path, dict[str, QuantizedWeight]],
    original: tuple[Path, dict[str, torch.Tensor]],
) -> None:
    folder, reference = ascend
    damage, fragments = ASCEND_CORRUPTIONS[corruption]
    damage(folder)
    report = verify_export(folder, reference=reference, model_path=original[0])
    assert_errors(report, *fragments)


def test_ascend_fused_shards_with_different_types_fail(
    original: tuple[Path, dict[str, torch.Tensor]], tmp_path: Path
) -> None:
    schemes = {**ASCEND_SCHEMES, V: (4, True, None)}
    folder = write_ascend(tmp_path / "mixed", original[1], reference_for(original[1], schemes))
    report = verify_export(folder)
    assert_errors(report, f"{L0}.self_attn.qkv_proj", f"{V}: W4A16 per-channel", f"{Q}: W8A16")


def test_ascend_skipped_fused_shard_fails(
    original: tuple[Path, dict[str, torch.Tensor]], tmp_path: Path
) -> None:
    schemes = {k: v for k, v in ASCEND_SCHEMES.items() if k != UP}
    folder = write_ascend(tmp_path / "skip_up", original[1], reference_for(original[1], schemes))
    assert_errors(verify_export(folder), f"{L0}.mlp.gate_up_proj", f"{UP}: FLOAT")


def test_mindie_naming_single_file(
    original: tuple[Path, dict[str, torch.Tensor]], tmp_path: Path
) -> None:
    schemes = {m: (8, True, None) for m in (Q, K, V, O_PROJ, GATE, UP)}
    reference = reference_for(original[1], schemes)
    folder = write_ascend(tmp_path / "mindie", original[1], reference, shards=1)
    (folder / "quant_model_weights.safetensors").rename(
        folder / "quant_model_weight_w8a16.safetensors"
    )
    (folder / "quant_model_description.json").rename(folder / "quant_model_description_w8a16.json")
    report = verify_export(folder, reference=reference, model_path=original[0])
    assert report.ok, report.errors
    assert report.format == "mindie"
    assert any("reads quant_model_description.json only" in w for w in report.warnings)
    (folder / "quant_model_description_w8a16.json").rename(
        folder / "quant_model_description_w4a16.json"
    )
    (folder / "quant_model_weight_w8a16.safetensors").rename(
        folder / "quant_model_weight_w4a16.safetensors"
    )
    assert_errors(verify_export(folder), "file name says w4a16 but model_quant_type is W8A16")


def test_reference_and_export_must_hold_the_same_modules(
    ascend: tuple[Path, dict[str, QuantizedWeight]],
) -> None:
    folder, reference = ascend
    extra = dict(reference)
    extra[DOWN] = msquant.plugin.numerics.quantize_weight_minmax(torch.randn(64, 96), 8, True)
    del extra[O_PROJ]
    report = verify_export(folder, reference=extra)
    assert_errors(report, DOWN, "quantized in memory but not stored quantized")
    assert_errors(report, O_PROJ, "stored quantized but not quantized in memory")
    # a scale off by more than float32 rounding is caught, one within it is not
    shifted = dict(reference)
    q = reference[K]
    shifted[K] = QuantizedWeight(q.codes, q.scale * (1 + 1e-3), q.offset, q.bits, q.symmetric, None)
    assert_errors(verify_export(folder, reference=shifted), f"{K}.weight_scale", "float32 rounding")
    shifted[K] = QuantizedWeight(q.codes, q.scale * (1 + 5e-8), q.offset, q.bits, q.symmetric, None)
    assert verify_export(folder, reference=shifted).ok


# --- GPTQ -------------------------------------------------------------------------------------

GPTQ_BASE = {"bits": 4, "group_size": 32, "sym": True}


@pytest.fixture
def gptq(
    original: tuple[Path, dict[str, torch.Tensor]], tmp_path: Path
) -> tuple[Path, dict[str, QuantizedWeight]]:
    reference = reference_for(original[1], GPTQ_SCHEMES)
    return write_gptq(tmp_path / "gptq", original[1], reference, GPTQ_BASE), reference


def test_gptq_v1_sym_export_verifies(
    gptq: tuple[Path, dict[str, QuantizedWeight]], original: tuple[Path, dict[str, torch.Tensor]]
) -> None:
    folder, reference = gptq
    report = verify_export(folder, reference=reference, model_path=original[0])
    assert report.ok, report.errors
    assert report.format == "gptq"
    assert [e.name for e in report.layers] == sorted(GPTQ_SCHEMES)
    for entry in report.layers:
        assert (entry.bits, entry.group_size, entry.symmetric, entry.max_code_mismatch) == (
            4,
            32,
            True,
            0,
        )
        assert entry.relative_error is not None and entry.relative_error < relative_error_bound(4)
    # vLLM-servable apart from the Marlin shape rule (the test layers are narrower than 128)
    assert not any("asymmetric" in w for w in report.warnings)
    assert any("Marlin" in w for w in report.warnings)


@pytest.mark.parametrize(
    ("bits", "sym", "group", "v2"),
    [(4, False, 32, True), (8, True, None, False), (3, False, 32, False), (2, True, 16, True)],
)
def test_gptq_variants_verify_with_consumer_notes(
    bits: int,
    sym: bool,
    group: int | None,
    v2: bool,
    original: tuple[Path, dict[str, torch.Tensor]],
    tmp_path: Path,
) -> None:
    reference = reference_for(original[1], {m: (bits, sym, group) for m in GPTQ_SCHEMES})
    if not v2:  # v1 stores zero-1: keep every zero point >= 1 so the export is representable
        reference = {
            m: QuantizedWeight(
                q.codes, q.scale, q.offset.clamp(min=1 - 2 ** (bits - 1)), bits, sym, group
            )
            if not sym
            else q
            for m, q in reference.items()
        }
    qconfig = {"bits": bits, "group_size": group or -1, "sym": sym}
    if not sym:
        qconfig["meta"] = {"quantizer": ["gptqmodel:7.7.0"]}
    folder = write_gptq(tmp_path / "g", original[1], reference, qconfig, v2=v2)
    report = verify_export(folder, reference=reference)
    assert report.ok, report.errors
    assert {(e.bits, e.group_size) for e in report.layers} == {(bits, group)}
    notes = "\n".join(report.warnings)
    assert ("asymmetric layers are refused" in notes) == (not sym)
    assert ("only as 4 or 8 bits" in notes) == (bits not in (4, 8))


def test_gptq_v1_cannot_store_a_zero_point_of_zero(
    original: tuple[Path, dict[str, torch.Tensor]], tmp_path: Path
) -> None:
    """Zero point 0 is written by v1 as (0 - 1) mod 16 = 15: the values decode, but kernels that
    add 1 to whole words corrupt the neighbour; gptq_v2 stores the same weights cleanly."""
    reference = reference_for(original[1], {m: (4, False, 32) for m in GPTQ_SCHEMES})
    q = reference[UP]
    offset = q.offset.clone()
    offset[5, 1] = -8  # unsigned zero point 0
    reference[UP] = QuantizedWeight(q.codes, q.scale, offset, 4, False, 32)
    qconfig = {**GPTQ_BASE, "sym": False}
    v1 = write_gptq(tmp_path / "v1", original[1], reference, qconfig)
    report = verify_export(v1, reference=reference)
    assert report.errors == [
        f"{UP}.qzeros: 1 zero point(s) of 0 stored as 15: v1 'gptq' stores zero-1, and GPTQModel's "
        "word-wise +1 carries into the next column's zero point; write checkpoint_format gptq_v2"
    ]
    assert report.layer(UP).max_code_mismatch == 0  # decoded values still match the reference
    v2 = write_gptq(tmp_path / "v2", original[1], reference, qconfig, v2=True)
    assert verify_export(v2, reference=reference).ok


def test_gptq_dynamic_rules_resolve_per_module(
    original: tuple[Path, dict[str, torch.Tensor]], tmp_path: Path
) -> None:
    schemes = {**GPTQ_SCHEMES, GATE: (8, True, 64), UP: (8, True, 64)}
    reference = reference_for(original[1], schemes)
    dynamic = {"-:.*down_proj": {}, "+:.*mlp\\..*": {"bits": 8, "group_size": 64}}
    folder = write_gptq(tmp_path / "dyn", original[1], reference, {**GPTQ_BASE, "dynamic": dynamic})
    report = verify_export(folder, reference=reference, model_path=original[0])
    assert report.ok, report.errors
    assert (report.layer(UP).bits, report.layer(UP).group_size) == (8, 64)
    assert any("transformers + optimum ignore" in w for w in report.warnings)
    # a rule matching only the v shard: vLLM matches rules against the fused name qkv_proj
    dynamic_v = {"+:.*v_proj": {"bits": 8}, **dynamic}
    schemes_v = {**schemes, Q: (8, True, 32), K: (8, True, 32), V: (8, True, 32)}
    folder = write_gptq(
        tmp_path / "dyn_v",
        original[1],
        reference_for(original[1], schemes_v),
        {**GPTQ_BASE, "dynamic": dynamic_v},
    )
    # q and k resolve to 4 bits (their tensors say 8): shape errors, and the fused shards differ
    report = verify_export(folder)
    assert_errors(report, f"{Q}.qweight", "expected [8, 64]")
    assert_errors(report, f"{L0}.self_attn.qkv_proj", f"{V}: int8 group 32 sym")


def _zero_point_zero(folder: Path) -> None:
    """A v1 asym checkpoint whose first zero point is 0, written as (0 - 1) & 15 = 15."""

    def change(tensors: dict[str, torch.Tensor]) -> None:
        words = tensors[f"{Q}.qzeros"].to(torch.int64) & 0xFFFFFFFF
        words[0, 0] = (words[0, 0] & ~0xF) | 0xF
        tensors[f"{Q}.qzeros"] = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)

    edit_tensors(folder, change)


def _shuffled_g_idx(t: torch.Tensor) -> torch.Tensor:
    return t.flip(0).contiguous()


def _flip_code(t: torch.Tensor) -> torch.Tensor:
    out = t.clone()
    out[0, 0] = int(out[0, 0]) ^ 0x1
    return out


GPTQ_CORRUPTIONS: dict[str, tuple[Callable[[Path], None], tuple[str, ...]]] = {
    "transposed_qweight": (
        set_tensor(f"{K}.qweight", lambda t: t.t()),
        (f"{K}.qweight", "transposed"),
    ),
    "flipped_code": (set_tensor(f"{V}.qweight", _flip_code), (f"{V}.qweight", "1 code(s) differ")),
    "zero_point_zero_in_v1": (
        _zero_point_zero,
        (f"{Q}.qzeros", "1 zero point(s) of 0 stored as 15"),
    ),
    "non_trivial_g_idx": (
        set_tensor(f"{O_PROJ}.g_idx", _shuffled_g_idx),
        (f"{O_PROJ}.g_idx", "desc_act false"),
    ),
    "nan_scale": (
        set_tensor(f"{UP}.scales", lambda t: _nan(t.float()).half()),
        (f"{UP}.scales", "non-finite"),
    ),
    "missing_g_idx": (
        lambda f: edit_tensors(f, lambda t: t.pop(f"{GATE}.g_idx")),
        (f"{GATE}.g_idx", "missing"),
    ),
    "extra_float_weight": (
        lambda f: edit_tensors(f, lambda t: t.update({f"{GATE}.weight": torch.zeros(96, 64)})),
        (f"{GATE}.weight", "unexpected tensor for GPTQ layer"),
    ),
    "missing_sym_key": (
        lambda f: edit_json(f / "config.json", lambda d: d["quantization_config"].pop("sym")),
        ("lacks 'sym'",),
    ),
    "quantize_config_disagrees": (
        lambda f: edit_json(f / "quantize_config.json", lambda d: d.update({"group_size": 64})),
        ("quantize_config.json group_size=64",),
    ),
    "scales_shape": (
        set_tensor(f"{O_PROJ}.scales", lambda t: t[:1]),
        (f"{O_PROJ}.scales", "expected [2, 64]"),
    ),
}


@pytest.mark.parametrize("corruption", sorted(GPTQ_CORRUPTIONS))
def test_gptq_corruption_is_named(
    corruption: str, gptq: tuple[Path, dict[str, QuantizedWeight]]
) -> None:
    folder, reference = gptq
    damage, fragments = GPTQ_CORRUPTIONS[corruption]
    damage(folder)
    assert_errors(verify_export(folder, reference=reference), *fragments)


def test_gptq_g_idx_selects_the_group_of_each_column(
    gptq: tuple[Path, dict[str, QuantizedWeight]], original: tuple[Path, dict[str, torch.Tensor]]
) -> None:
    """Groups stored in swapped order with a g_idx pointing at them dequantize to the same
    weight: consistent under desc_act true (a note for vLLM), an error under desc_act false."""
    folder, _ = gptq

    def swap_groups(tensors: dict[str, torch.Tensor]) -> None:
        for part in ("scales", "qzeros"):
            if f"{Q}.{part}" in tensors:
                tensors[f"{Q}.{part}"] = tensors[f"{Q}.{part}"].flip(0).contiguous()
        if f"{Q}.g_idx" in tensors:
            tensors[f"{Q}.g_idx"] = (1 - tensors[f"{Q}.g_idx"]).contiguous()

    edit_tensors(folder, swap_groups)
    assert_errors(
        verify_export(folder), f"{Q}.g_idx", "non-trivial group order with desc_act false"
    )
    for name in ("config.json", "quantize_config.json"):
        qconfig = json.loads((folder / name).read_text())
        target = qconfig.get("quantization_config", qconfig)
        target["desc_act"] = True
        (folder / name).write_text(json.dumps(qconfig))
    report = verify_export(folder, model_path=original[0])
    assert report.ok, report.errors
    assert report.layer(Q).relative_error < relative_error_bound(4) / 4
    notes = "\n".join(report.warnings)
    assert "refuses desc_act=true with group_size != -1" in notes
    assert "g_idx is trivial but desc_act is true" in notes and K in notes


def test_gptq_sym_with_non_symmetric_qzeros_fails(
    original: tuple[Path, dict[str, torch.Tensor]], tmp_path: Path
) -> None:
    """Symmetric config, asymmetric zero points stored: vLLM would ignore them, transformers not."""
    reference = reference_for(original[1], {m: (4, False, 32) for m in GPTQ_SCHEMES})
    reference = {
        m: QuantizedWeight(q.codes, q.scale, q.offset.clamp(min=-7), 4, False, 32)
        for m, q in reference.items()
    }
    folder = write_gptq(tmp_path / "g", original[1], reference, GPTQ_BASE)
    assert_errors(verify_export(folder), ".qzeros", "sym is true but")


# --- compressed-tensors -----------------------------------------------------------------------

CT_IGNORE = ["lm_head", DOWN]


@pytest.fixture
def ct(
    original: tuple[Path, dict[str, torch.Tensor]], tmp_path: Path
) -> tuple[Path, dict[str, QuantizedWeight]]:
    return write_ct(tmp_path / "ct", original[1], CT_GROUPS, CT_IGNORE)


def test_compressed_tensors_export_verifies(
    ct: tuple[Path, dict[str, QuantizedWeight]], original: tuple[Path, dict[str, torch.Tensor]]
) -> None:
    folder, reference = ct
    report = verify_export(folder, reference=reference, model_path=original[0])
    assert report.ok, report.errors
    assert report.format == "compressed-tensors"
    assert (report.layer(Q).scheme, report.layer(Q).bits, report.layer(Q).group_size) == (
        "group_0",
        4,
        32,
    )
    assert (report.layer(UP).bits, report.layer(UP).symmetric) == (8, False)
    assert all(e.max_code_mismatch == 0 for e in report.layers)
    assert any("dequantize=True" in w and GATE in w for w in report.warnings)


def test_compressed_tensors_3bit_dense_packing(
    original: tuple[Path, dict[str, torch.Tensor]], tmp_path: Path
) -> None:
    groups = {"g": (["re:.*_proj$"], 3, False, 32)}
    folder, reference = write_ct(tmp_path / "ct3", original[1], groups, ["lm_head"])
    report = verify_export(folder, reference=reference, model_path=original[0])
    assert report.ok, report.errors
    assert {e.bits for e in report.layers} == {3}


def _ct_config(change: Callable[[dict[str, Any]], None]) -> Callable[[Path], None]:
    return lambda f: edit_json(f / "config.json", lambda d: change(d["quantization_config"]))


CT_CORRUPTIONS: dict[str, tuple[Callable[[Path], None], tuple[str, ...]]] = {
    "wrong_weight_shape": (
        set_tensor(f"{K}.weight_shape", lambda t: t.flip(0)),
        (f"{K}.weight_packed", "weight_shape [64, 32]"),
    ),
    "zero_point_for_sym": (
        lambda f: edit_tensors(
            f, lambda t: t.update({f"{Q}.weight_zero_point": torch.zeros(8, 2, dtype=torch.int32)})
        ),
        (f"{Q}.weight_zero_point", "symmetric"),
    ),
    "missing_zero_point": (
        lambda f: edit_tensors(f, lambda t: t.pop(f"{GATE}.weight_zero_point")),
        (f"{GATE}.weight_zero_point", "missing"),
    ),
    "extra_float_weight": (
        lambda f: edit_tensors(f, lambda t: t.update({f"{K}.weight": torch.zeros(32, 64)})),
        (
            f"{K}.weight: unexpected tensor for compressed layer {K} (expected weight_packed, "
            "weight_scale, weight_shape, weight_zero_point, bias)",
        ),
    ),
    "flipped_code": (
        set_tensor(f"{O_PROJ}.weight_packed", _flip_code),
        (f"{O_PROJ}.weight_packed", "differ from the in-memory"),
    ),
    "status": (
        _ct_config(lambda q: q.update({"quantization_status": "frozen"})),
        ("quantization_status 'frozen'",),
    ),
    "actorder_group": (
        _ct_config(
            lambda q: q["config_groups"]["group_0"]["weights"].update({"actorder": "group"})
        ),
        ("group_0.weights", "actorder 'group'"),
    ),
    "unknown_arg": (
        _ct_config(lambda q: q["config_groups"]["group_1"]["weights"].update({"bogus": 1})),
        ("group_1.weights", "bogus"),
    ),
    "ignored_but_quantized": (
        _ct_config(lambda q: q["ignore"].append(V)),
        (f"{V}.weight_packed", "ignore lists"),
    ),
    "targeted_but_float": (
        _ct_config(
            lambda q: (
                q["ignore"].remove(DOWN) or q["config_groups"]["group_1"]["targets"].append(DOWN)
            )
        ),
        (f"{DOWN}.weight", "stored in float but group_1 targets"),
    ),
}


@pytest.mark.parametrize("corruption", sorted(CT_CORRUPTIONS))
def test_compressed_tensors_corruption_is_named(
    corruption: str, ct: tuple[Path, dict[str, QuantizedWeight]]
) -> None:
    folder, reference = ct
    damage, fragments = CT_CORRUPTIONS[corruption]
    damage(folder)
    assert_errors(verify_export(folder, reference=reference), *fragments)


def test_compressed_tensors_fused_shards_in_different_groups_fail(
    original: tuple[Path, dict[str, torch.Tensor]], tmp_path: Path
) -> None:
    groups = {
        "group_0": (["re:.*self_attn\\.[qko]_proj$"], 4, True, 32),
        "group_1": (["re:.*(v_proj|mlp\\.(gate|up)_proj)$"], 8, True, None),
    }
    folder, _ = write_ct(tmp_path / "ct", original[1], groups, CT_IGNORE)
    assert_errors(
        verify_export(folder), f"{L0}.self_attn.qkv_proj", f"{V}: int8 per-channel sym (group_1)"
    )


# --- folders that are not exports -------------------------------------------------------------


def test_unreadable_folders_raise_input_errors(
    tmp_path: Path, original: tuple[Path, dict[str, torch.Tensor]]
) -> None:
    with pytest.raises(ExportReadError, match="does not exist"):
        verify_export(tmp_path / "nowhere")
    with pytest.raises(ExportReadError, match="holds no export msquant can verify"):
        verify_export(original[0])  # a float model: no description, no quantization_config
    (tmp_path / "bnb").mkdir()  # a quant_method no registered format reads
    (tmp_path / "bnb" / "config.json").write_text(
        json.dumps({"quantization_config": {"quant_method": "bitsandbytes"}})
    )
    with pytest.raises(ExportReadError, match="'bitsandbytes'"):
        verify_export(tmp_path / "bnb")


def test_truncated_shard_is_reported(ascend: tuple[Path, dict[str, QuantizedWeight]]) -> None:
    folder, _ = ascend
    shard = folder / "quant_model_weights-00001-of-00002.safetensors"
    shard.write_bytes(shard.read_bytes()[:100])
    assert_errors(
        verify_export(folder),
        "quant_model_weights-00001-of-00002.safetensors",
        "not a readable safetensors",
    )


# --- a real msquant export --------------------------------------------------------------------


@pytest.fixture(scope="module")
def real_export(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``ascendv1_saver`` W8A16 per-group asym (down_proj skipped) of the tiny Llama."""
    config = yaml.safe_load((EXAMPLES / "w8a16_per_group_asym_minmax_skip_down.yaml").read_text())
    out = tmp_path_factory.mktemp("real") / "out"
    msquant.quantize(tiny_llama, out, config, progress=False)
    return out


def test_real_ascend_export_matches_reference_and_model(
    real_export: Path, tiny_llama: Path
) -> None:
    weights = load_file(str(tiny_llama / "model.safetensors"))
    reference = {
        name.removesuffix(".weight"): msquant.plugin.numerics.quantize_weight_minmax(
            tensor, 8, False, 32
        )
        for name, tensor in weights.items()
        if name.endswith("_proj.weight") and "down_proj" not in name
    }
    report = msquant.check_export(real_export, reference=reference, model_path=tiny_llama)
    assert report.format == "ascend" and len(report.layers) == 12
    for entry in report.layers:
        assert (entry.bits, entry.group_size, entry.symmetric, entry.max_code_mismatch) == (
            8,
            32,
            False,
            0,
        )
        assert entry.relative_error is not None and 1e-4 < entry.relative_error < 0.01
    assert any("per-channel only" in w for w in report.warnings)


def test_check_export_raises_naming_the_tensor(real_export: Path, tmp_path: Path) -> None:
    damaged = tmp_path / "damaged"
    shutil.copytree(real_export, damaged)
    name = "model.layers.1.self_attn.o_proj.weight_scale"
    edit_tensors(damaged, lambda t: t.update({name: -t[name]}) if name in t else None)
    with pytest.raises(ExportVerificationError, match=f"{name}: .* scale\\(s\\) <= 0") as caught:
        msquant.check_export(damaged)
    assert not caught.value.report.ok and isinstance(caught.value, msquant.MsquantError)


# --- command line -----------------------------------------------------------------------------


def test_cli_verify_table_json_and_exit_codes(
    real_export: Path, tiny_llama: Path, tmp_path: Path, run_cli: Callable[..., CliResult]
) -> None:
    result = run_cli("verify", real_export, "--model_path", tiny_llama)
    assert result.code == 0, result.err
    assert (
        "model.layers.0.self_attn.q_proj" in result.out
        and "OK: 12 quantized layer(s)" in result.out
    )
    result = run_cli("verify", real_export, "--json")
    data = json.loads(result.out)
    assert result.code == 0 and data["ok"] is True and data["format"] == "ascend"
    assert len(data["layers"]) == 12 and data["layers"][0]["relative_error"] is None

    damaged = tmp_path / "damaged"
    shutil.copytree(real_export, damaged)
    edit_json(damaged / "quant_model_description.json", lambda d: d.pop("model.norm.weight"))
    result = run_cli("verify", damaged, "--json")
    assert result.code == 2
    assert json.loads(result.out)["ok"] is False
    assert "model.norm.weight is stored but missing from quant_model_description.json" in result.err

    result = run_cli("verify", tmp_path / "missing")
    assert result.code == 2 and "does not exist" in result.err and "Traceback" not in result.err
    result = run_cli("verify", real_export, "--model_path", tmp_path / "no_model")
    assert result.code == 2 and "is not a folder" in result.err and "Traceback" not in result.err


def test_cli_verify_reads_every_saver_subfolder(
    original: tuple[Path, dict[str, torch.Tensor]],
    tmp_path: Path,
    run_cli: Callable[..., CliResult],
) -> None:
    write_ascend(
        tmp_path / "run" / "ascendv1_saver", original[1], reference_for(original[1], ASCEND_SCHEMES)
    )
    write_gptq(
        tmp_path / "run" / "gptq_saver",
        original[1],
        reference_for(original[1], GPTQ_SCHEMES),
        GPTQ_BASE,
    )
    result = run_cli("verify", tmp_path / "run", "--json", "--model_path", original[0])
    data = json.loads(result.out)
    assert result.code == 0 and data["ok"] is True
    assert [e["format"] for e in data["exports"]] == ["ascend", "gptq"]


def test_cli_quant_passes_overwrite_and_no_verify(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, run_cli: Callable[..., CliResult]
) -> None:
    seen: dict[str, Any] = {}

    def fake_quantize(*args: Any, **kwargs: Any) -> Any:
        seen.update(kwargs)
        raise msquant.OutputPathError("stop here")

    monkeypatch.setattr("msquant.cli.quant.quantize", fake_quantize)
    base = [
        "quant",
        "--model_path",
        tmp_path,
        "--save_path",
        tmp_path / "o",
        "--quant_type",
        "w8a16",
    ]
    assert run_cli(*base).code == 2
    assert (seen["verify"], seen["overwrite"]) == (True, False)
    assert run_cli(*base, "--no-verify", "--overwrite").code == 2
    assert (seen["verify"], seen["overwrite"]) == (False, True)


def test_cli_quant_reports_a_failed_verification(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, run_cli: Callable[..., CliResult]
) -> None:
    report = msquant.VerifyReport(
        "gptq", tmp_path, errors=["model.x.qweight: shape [1, 2], expected [2, 1]"]
    )

    def failing(*args: Any, **kwargs: Any) -> Any:
        raise ExportVerificationError(report)

    monkeypatch.setattr("msquant.cli.quant.quantize", failing)
    result = run_cli(
        "quant", "--model_path", tmp_path, "--save_path", tmp_path / "o", "--quant_type", "w8a16"
    )
    assert result.code == 2
    assert "failed verification (1 error)" in result.err and "model.x.qweight" in result.err
    assert "nothing was written" in result.err and "Traceback" not in result.err


def test_cli_quant_prints_the_consumer_warnings_of_its_verification(
    tiny_llama: Path, tmp_path: Path, run_cli: Callable[..., CliResult]
) -> None:
    """The read-back check's consumer notes describe the files a user deploys: ``quant`` prints
    them (it used to log them at DEBUG, so only ``msquant verify`` showed them)."""
    config = tmp_path / "asym.yaml"
    weight = {"scope": "per_group", "dtype": "int4", "symmetric": False, "method": "minmax"}
    weight["ext"] = {"group_size": 32}
    entry = {"type": "linear_quant", "qconfig": {"weight": weight}}
    spec = {"process": [entry], "save": [{"type": "gptq_saver"}]}
    config.write_text(yaml.safe_dump({"apiversion": "modelslim_v1", "spec": spec}))
    out = tmp_path / "out"
    args = ("--model_path", tiny_llama, "--save_path", out, "--config_path", config)
    result = run_cli("quant", *args, "--calib_path", EXAMPLES.parent / "tests/data/calib.txt")
    assert result.code == 0, result.err
    verify_lines = [
        line for line in result.err.splitlines() if "verify: gptq_saver export: " in line
    ]
    assert verify_lines and all("WARNING" in line for line in verify_lines), result.err
    assert any(
        "vLLM 0.33 / 0.34 / SGLang load GPTQ only as 4/8-bit symmetric (Marlin): asymmetric layers are "
        "refused" in line
        for line in verify_lines
    )
    # the same notes msquant verify reports for the folder
    report = verify_export(out)
    assert any(note in line for line in verify_lines for note in report.warnings)
