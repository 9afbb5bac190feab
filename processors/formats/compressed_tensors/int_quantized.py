"""Reading int8 W8A8 compressed-tensors layers (``int-quantized``): the config group's
``input_activations`` and one layer's tensors, as vLLM's ``CompressedTensorsW8A8Int8`` loads them.

Per layer ``P``: ``P.weight`` int8 ``[out, in]`` (signed codes), ``P.weight_scale`` float
``[out, 1]`` (per-channel symmetric weights); static per-tensor activations add ``P.input_scale``
float ``[1]`` and, asymmetric only, ``P.input_zero_point`` int8 ``[1]``; per-token dynamic
activations store nothing (each token is scaled at run time). Pure helpers: the reader
(:mod:`.reader`) owns the findings and the tensor store.
"""

from __future__ import annotations

from typing import Any

import torch

from msquant.plugin import ActivationQuant, DecodedLayer, Findings

__all__ = [
    "INT_PARTS",
    "INT_QUANTIZED",
    "input_scheme",
    "decode_int_layer",
    "activation_of",
]

INT_QUANTIZED = "int-quantized"
#: What an int-quantized layer may store (besides ``bias``).
INT_PARTS = ("weight", "weight_scale", "input_scale", "input_zero_point")
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
#: The activation strategies vLLM's W8A8 int8 scheme loads: static per-tensor, dynamic per-token.
STRATEGIES = {"tensor": False, "token": True}
#: vLLM's ``_is_dynamic_token_w8a8`` accepts asymmetric per-token activations, but msquant writes
#: (and verifies) symmetric ones only.
SYMMETRIC_TOKEN = "per-token activations must be symmetric (msquant writes and verifies these)"


def input_scheme(args: object, where: str, findings: Findings) -> tuple[str, bool] | None:
    """``(strategy, symmetric)`` of a config group's ``input_activations``, or None with the
    problem recorded: int8, ``strategy: tensor`` with ``dynamic: false`` or ``strategy: token``
    with ``dynamic: true``."""
    if not isinstance(args, dict):
        findings.error(f"{where} must be an object")
        return None
    strategy, dynamic = args.get("strategy"), args.get("dynamic", False)
    symmetric = args.get("symmetric", True)
    problems = []
    if args.get("type", "int") != "int" or args.get("num_bits") != 8:
        problems.append(f"int8 expected, got {args.get('type', 'int')} {args.get('num_bits')!r}")
    if strategy not in STRATEGIES:
        problems.append(f"strategy {strategy!r} is not tensor or token")
    elif dynamic is not STRATEGIES[strategy]:
        problems.append(
            f"strategy {strategy} needs dynamic: {str(STRATEGIES[strategy]).lower()} "
            "(vLLM's W8A8 int8 scheme: static per-tensor or dynamic per-token)"
        )
    if not isinstance(symmetric, bool):
        problems.append("symmetric must be true or false")
    elif strategy == "token" and not symmetric:
        problems.append(SYMMETRIC_TOKEN)
    if problems:
        findings.error(f"{where}: " + "; ".join(problems))
        return None
    return str(strategy), bool(symmetric)


def decode_int_layer(
    module: str,
    group: str,
    strategy: str,
    input_symmetric: bool,
    tensors: dict[str, torch.Tensor],
    findings: Findings,
) -> DecodedLayer | None:
    """The decoded layer of an int-quantized module from its stored ``tensors`` (leaf name ->
    tensor, the ones present), or None with the problems recorded."""
    weight, scale = tensors.get("weight"), tensors.get("weight_scale")
    ok = True
    if weight is None or weight.dtype != torch.int8 or weight.dim() != 2:
        found = "missing" if weight is None else f"{weight.dtype} {list(weight.shape)}"
        findings.error(f"{module}.weight: expected int8 [out, in] ({group}), found {found}")
        return None
    out_features = int(weight.shape[0])
    if scale is None or scale.dtype not in FLOAT_DTYPES or tuple(scale.shape) != (out_features, 1):
        found = "missing" if scale is None else f"{scale.dtype} {list(scale.shape)}"
        findings.error(
            f"{module}.weight_scale: expected float [{out_features}, 1] (per-channel), found {found}"
        )
        ok = False
    ok = _check_input_tensors(module, strategy, input_symmetric, tensors, findings) and ok
    if not ok or scale is None:
        return None
    return DecodedLayer.symmetric_per_channel(
        module,
        group,
        weight.to(torch.int32),
        scale,
        scale_dtype=scale.dtype,
        tensors=(f"{module}.weight", f"{module}.weight_scale", f"{module} (symmetric)"),
    )


def _check_input_tensors(
    module: str,
    strategy: str,
    symmetric: bool,
    tensors: dict[str, torch.Tensor],
    findings: Findings,
) -> bool:
    scale, zero = tensors.get("input_scale"), tensors.get("input_zero_point")
    before = len(findings.errors)
    if strategy == "token":
        for leaf, tensor in (("input_scale", scale), ("input_zero_point", zero)):
            if tensor is not None:
                findings.error(
                    f"{module}.{leaf}: stored for dynamic per-token activations, which have none"
                )
        return len(findings.errors) == before
    if scale is None or scale.dtype not in FLOAT_DTYPES or tuple(scale.shape) != (1,):
        found = "missing" if scale is None else f"{scale.dtype} {list(scale.shape)}"
        findings.error(f"{module}.input_scale: expected float [1] (static), found {found}")
    elif not (bool(torch.isfinite(scale).all()) and float(scale[0]) > 0):
        findings.error(f"{module}.input_scale: {float(scale[0])} is not a finite scale > 0")
    if symmetric and zero is not None:
        findings.error(f"{module}.input_zero_point: stored for symmetric activations")
    if not symmetric and (zero is None or zero.dtype != torch.int8 or tuple(zero.shape) != (1,)):
        found = "missing" if zero is None else f"{zero.dtype} {list(zero.shape)}"
        findings.error(
            f"{module}.input_zero_point: expected int8 [1] (asymmetric static activations, the "
            f"dtype vLLM loads), found {found}"
        )
    return len(findings.errors) == before


def activation_of(
    strategy: str, symmetric: bool, tensors: dict[str, torch.Tensor]
) -> ActivationQuant:
    """How the deployed layer quantizes its input, from a decoded layer's stored tensors."""
    if strategy == "token":
        return ActivationQuant("per_token")
    scale = float(tensors["input_scale"].to(torch.float32)[0])
    zero = tensors.get("input_zero_point")
    offset = 0.0 if zero is None else float(zero.to(torch.int32)[0])
    return ActivationQuant("per_tensor", symmetric, scale, offset)


def fused_key(strategy: str, tensors: dict[str, Any]) -> tuple[float, float] | None:
    """What fused shards of static layers must share (vLLM loads one input scale and zero point
    per fused layer): ``(input_scale, zero_point)``; None for dynamic activations."""
    if strategy == "token" or "input_scale" not in tensors:
        return None
    zero = tensors.get("input_zero_point")
    return float(tensors["input_scale"][0]), 0.0 if zero is None else float(zero[0])
