"""Reading FP8 W8A8 compressed-tensors layers (``float-quantized``): the config group's arguments
and one layer's tensors, as vLLM 0.33 / 0.34's ``CompressedTensorsW8A8Fp8`` loads them
(``compressed_tensors.py`` ``_is_fp8_w8a8``, ``schemes/compressed_tensors_w8a8_fp8.py``).

Per layer ``P``: ``P.weight`` ``float8_e4m3fn`` ``[out, in]``, ``P.weight_scale`` float ``[out, 1]``
(per-channel symmetric weights); per-token dynamic FP8 activations store nothing. The group:
``weights {num_bits: 8, type: float, symmetric: true, strategy: channel, dynamic: false}`` and
``input_activations {num_bits: 8, type: float, symmetric: true, strategy: token, dynamic: true}``
(compressed-tensors' ``FP8_DYNAMIC`` preset). Pure helpers: the reader (:mod:`.reader`) owns the
findings and the tensor store.
"""

from __future__ import annotations

from typing import Any

import torch

from msquant.plugin import DecodedLayer, Findings
from msquant.plugin.numerics import value_type_named

__all__ = [
    "FLOAT_QUANTIZED",
    "FP8_VALUE_TYPE",
    "FP8_WEIGHTS",
    "FP8_INPUTS",
    "float_group_problems",
    "decode_fp8_layer",
]

FLOAT_QUANTIZED = "float-quantized"
#: The value type of the weights and activations msquant writes and verifies in this format.
FP8_VALUE_TYPE = "fp8_e4m3"
#: The ``weights`` arguments of a verified FP8 group (``group_size`` may be absent or -1).
FP8_WEIGHTS = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "channel"}
#: The ``input_activations`` arguments of a verified FP8 group.
FP8_INPUTS = {
    "num_bits": 8,
    "type": "float",
    "symmetric": True,
    "strategy": "token",
    "dynamic": True,
}
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def float_group_problems(group: dict[str, Any]) -> list[str]:
    """What keeps a ``float-quantized`` config group from being the FP8 W8A8 scheme msquant
    verifies (per-channel weights, dynamic per-token activations), empty when nothing."""
    problems = []
    weights, inputs = group.get("weights"), group.get("input_activations")
    if not isinstance(weights, dict):
        return ["weights must be an object"]
    for key, want in FP8_WEIGHTS.items():
        if weights.get(key) != want:
            problems.append(f"weights.{key} {weights.get(key)!r}, expected {want!r}")
    if weights.get("dynamic") not in (None, False):
        problems.append("weights.dynamic must be false")
    if weights.get("group_size") not in (None, -1):
        problems.append(f"weights.group_size {weights.get('group_size')!r} with strategy channel")
    if not isinstance(inputs, dict):
        problems.append(
            "input_activations missing: weight-only FP8 (vLLM's CompressedTensorsW8A16Fp8) is "
            "not verified by msquant verify"
        )
    else:
        for key, want in FP8_INPUTS.items():
            if inputs.get(key) != want:
                problems.append(f"input_activations.{key} {inputs.get(key)!r}, expected {want!r}")
    if group.get("output_activations") is not None:
        problems.append("output_activations is set")
    return problems


def decode_fp8_layer(
    module: str, group: str, tensors: dict[str, torch.Tensor], findings: Findings
) -> DecodedLayer | None:
    """The decoded FP8 layer ``module`` from its stored ``tensors`` (leaf name -> tensor, the ones
    present), or None with the problems recorded."""
    weight, scale = tensors.get("weight"), tensors.get("weight_scale")
    if weight is None or weight.dtype != torch.float8_e4m3fn or weight.dim() != 2:
        found = "missing" if weight is None else f"{weight.dtype} {list(weight.shape)}"
        findings.error(
            f"{module}.weight: expected float8_e4m3fn [out, in] ({group}), found {found}"
        )
        return None
    out_features = int(weight.shape[0])
    if scale is None or scale.dtype not in FLOAT_DTYPES or tuple(scale.shape) != (out_features, 1):
        found = "missing" if scale is None else f"{scale.dtype} {list(scale.shape)}"
        findings.error(
            f"{module}.weight_scale: expected float [{out_features}, 1] (per-channel), found {found}"
        )
        return None
    for leaf in ("input_scale", "input_zero_point", "weight_zero_point"):
        if leaf in tensors:
            findings.error(f"{module}.{leaf}: stored for symmetric per-token FP8, which has none")
            return None
    return DecodedLayer.symmetric_per_channel(
        module,
        group,
        weight.view(torch.uint8),
        scale,
        scale_dtype=scale.dtype,
        tensors=(f"{module}.weight", f"{module}.weight_scale", f"{module} (symmetric)"),
        value_type=value_type_named(FP8_VALUE_TYPE),
    )
