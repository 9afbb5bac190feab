"""The AWQ ``quantization_config`` (transformers' ``AwqConfig`` keys, which vLLM reads too): one
scheme for the model (4 bits, one group size, zero points), and the linear layers kept in float
in ``modules_to_not_convert`` (vLLM matches it as substrings of module names and looks a fused
layer up through its shards; the fused name of a float q/k/v or gate/up group is listed too, for
loaders that look it up by that name)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from msquant.plugin import ModelAdapter

__all__ = ["QUANT_METHOD", "VERSION", "build_quantization_config"]

QUANT_METHOD = "awq"
VERSION = "gemm"


def build_quantization_config(
    group_size: int, float_linears: Iterable[str], adapter: ModelAdapter
) -> dict[str, Any]:
    """The ``quantization_config`` for 4-bit weights in groups of ``group_size``.

    :param float_linears: the linear layers (and MoE routers) left in float, as stored.
    :param adapter: the model's adapter (:func:`msquant.plugin.adapter_for`): which float linears vLLM
        loads as one fused matrix, whose fused name is listed too.
    """
    names = list(dict.fromkeys(float_linears))
    fused = [group.fused_name for group in adapter.fused_groups(names)]
    return {
        "quant_method": QUANT_METHOD,
        "bits": 4,
        "group_size": group_size,
        "zero_point": True,
        "version": VERSION,
        "modules_to_not_convert": names + [name for name in fused if name not in names] or None,
    }
