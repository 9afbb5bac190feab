"""Reading MX compressed-tensors layers (``mxfp8-quantized``, ``mxfp4-pack-quantized``): the
config group's arguments and one layer's tensors, as vLLM 0.33 / 0.34's
``CompressedTensorsW8A8Mxfp8`` / ``CompressedTensorsW4A4Mxfp4`` create them and vLLM-Ascend
0.30's ``W8A8_MXFP8`` / ``W4A4_MXFP4`` schemes read them.

Written from the layout (docs/formats.md), sharing no code with the packer; the nibble and E8M0
decoders are the numerics' own (``unpack_nibbles``, ``e8m0_scale``), as the Ascend reader's. Per
layer ``P``:

* MXFP8: ``P.weight`` ``float8_e4m3fn`` ``[out, in]``, the e4m3 elements;
* MXFP4: ``P.weight_packed`` uint8 ``[out, in / 2]``, e2m1 codes, element ``2i`` in the low nibble
  (compressed-tensors' ``unpack_fp4_from_uint8`` order);
* ``P.weight_scale`` uint8 ``[out, in / 32]``: the E8M0 byte ``b`` of each block of 32 input
  columns, the block's scale being ``2^(b - 127)`` (255 is E8M0's NaN);
* activations are quantized at run time per block of 32, nothing stored.

The group: ``weights {num_bits: 8 | 4, type: float, symmetric: true, strategy: group, group_size:
32, dynamic: false, scale_dtype: uint8}`` and ``input_activations`` the same but ``dynamic:
true`` (compressed-tensors' ``MXFP8`` / ``MXFP4`` presets). Pure helpers: the reader
(:mod:`.reader`) owns the findings and the tensor store.
"""

from __future__ import annotations

from typing import Any

import torch

from msquant.plugin import DecodedLayer, Findings
from msquant.plugin.numerics import e8m0_scale, unpack_nibbles, value_type_named

__all__ = [
    "MX_FORMAT_TYPES",
    "MX_PARTS",
    "mx_group_problems",
    "decode_mx_layer",
]

#: compressed-tensors format -> the MX value type its layers hold.
MX_FORMAT_TYPES = {"mxfp8-quantized": "mxfp8", "mxfp4-pack-quantized": "mxfp4"}
#: What an MX layer may store (besides ``bias``): the elements (``weight`` for MXFP8,
#: ``weight_packed`` for MXFP4) and the E8M0 scales.
MX_PARTS = ("weight", "weight_packed", "weight_scale")
BLOCK = 32
#: The accepted spellings of the uint8 ``scale_dtype`` (compressed-tensors writes ``torch.uint8``).
UINT8_NAMES = ("torch.uint8", "uint8")


def mx_group_problems(group: dict[str, Any], value_type: str) -> list[str]:
    """What keeps an MX config group from being the ``value_type`` scheme msquant verifies
    (group-32 symmetric float weights with uint8 scales, dynamic group-32 inputs of the same
    width), empty when nothing."""
    bits = value_type_named(value_type).bits
    want = {"num_bits": bits, "type": "float", "symmetric": True, "strategy": "group"}
    problems = []
    for key in ("weights", "input_activations"):
        args = group.get(key)
        if not isinstance(args, dict):
            problems.append(
                f"{key} must be an object"
                + (
                    " (weight-only MX is not a scheme msquant writes or verifies)"
                    if key == "input_activations"
                    else ""
                )
            )
            continue
        for field, value in want.items():
            if args.get(field) != value:
                problems.append(f"{key}.{field} {args.get(field)!r}, expected {value!r}")
        if args.get("group_size") != BLOCK:
            problems.append(f"{key}.group_size {args.get('group_size')!r}, expected {BLOCK}")
        dynamic = key == "input_activations"
        if bool(args.get("dynamic", False)) is not dynamic:
            problems.append(f"{key}.dynamic must be {str(dynamic).lower()}")
        if key == "weights" and args.get("scale_dtype") not in UINT8_NAMES:
            problems.append(
                f"weights.scale_dtype {args.get('scale_dtype')!r}, expected 'torch.uint8' "
                "(E8M0 scales; vLLM's _is_mxfp8 requires it)"
            )
    if group.get("output_activations") is not None:
        problems.append("output_activations is set")
    return problems


def decode_mx_layer(
    module: str,
    group: str,
    value_type: str,
    tensors: dict[str, torch.Tensor],
    findings: Findings,
) -> DecodedLayer | None:
    """The decoded MX layer ``module`` from its stored ``tensors`` (leaf name -> tensor, the
    :data:`MX_PARTS` present), or None with the problems recorded."""
    values = value_type_named(value_type)
    packed = value_type == "mxfp4"
    leaf, other = ("weight_packed", "weight") if packed else ("weight", "weight_packed")
    dtype = torch.uint8 if packed else torch.float8_e4m3fn
    stored = tensors.get(leaf)
    if other in tensors:
        findings.error(
            f"{module}.{other}: stored for a {value_type} layer ({group}), which has none"
        )
        return None
    if stored is None or stored.dtype != dtype or stored.dim() != 2:
        found = "missing" if stored is None else f"{stored.dtype} {list(stored.shape)}"
        shape = "[out, in / 2]" if packed else "[out, in]"
        findings.error(
            f"{module}.{leaf}: expected {str(dtype).removeprefix('torch.')} {shape} ({group}), "
            f"found {found}"
        )
        return None
    codes = unpack_nibbles(stored) if packed else stored.view(torch.uint8)
    out_features, in_features = codes.shape
    scale_bytes = tensors.get("weight_scale")
    blocks = (out_features, in_features // BLOCK)
    if (
        in_features % BLOCK
        or scale_bytes is None
        or scale_bytes.dtype != torch.uint8
        or tuple(scale_bytes.shape) != blocks
    ):
        found = (
            "missing" if scale_bytes is None else f"{scale_bytes.dtype} {list(scale_bytes.shape)}"
        )
        findings.error(
            f"{module}.weight_scale: expected uint8 E8M0 [out, in / {BLOCK}] = {list(blocks)} "
            f"(in {in_features}), found {found}"
        )
        return None
    return DecodedLayer.mx_blocks(
        module,
        group,
        codes,
        e8m0_scale(scale_bytes),
        value_type=values,
        block=BLOCK,
        tensors=(f"{module}.{leaf}", f"{module}.weight_scale"),
    )
