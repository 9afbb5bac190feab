"""The Ascend description (``quant_model_description*.json``): every tensor's type plus the globals.

The description maps every stored tensor to ``W8A16``, ``W4A16`` or ``FLOAT`` (tied tensors,
stored once, are still described under each name: vLLM-Ascend looks up e.g. ``lm_head.weight``
even when the head is tied), plus ``version``, ``model_quant_type`` (the highest-priority type
present, msModelSlim's rule), ``metadata``, ``group_size`` (one global value, the largest per-group
size) and ``optional``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

__all__ = [
    "DESCRIPTION_FILE",
    "DESCRIPTION_VERSION",
    "KV_CACHE_TYPE",
    "KV_CACHE_GLOBALS",
    "QUANT_TYPE_PRIORITY",
    "HEAD_WARNING",
    "model_quant_type",
    "description_globals",
    "ordered_description",
]

DESCRIPTION_FILE = "quant_model_description.json"
DESCRIPTION_VERSION = "1.0.0"
# msModelSlim's order for the global ``model_quant_type`` (the highest type present wins); W4A16,
# which msModelSlim v1 does not export, ranks above W8A16 (the more compressed weight type).
QUANT_TYPE_PRIORITY = (
    "FLOAT",
    "W16A16S",
    "W8A16",
    "W4A16",
    "W8A8_DYNAMIC",
    "W8A8_MIX",
    "W8A8",
    "WFP8AFP8_DYNAMIC",
    "W8A8_MXFP8",
    "W4A8_MXFP",
    "W4A4_MXFP4",
)
#: The type of the int8 KV cache's tensors, and the globals naming it (msModelSlim 26.1.0).
KV_CACHE_TYPE = "C8"
KV_CACHE_GLOBALS = ("kv_cache_type", "kv_quant_type")
HEAD_WARNING = (
    "{head} is written {kind}, which msModelSlim never does (it keeps the head FLOAT): vLLM-Ascend "
    "loads a quantized head through the linear scheme of its type (per-channel W8A16 only; read "
    "in its source, not verified on hardware); MindIE support is unknown"
)


def model_quant_type(types: Iterable[str]) -> str:
    """The highest-priority type among the written tensors (msModelSlim's rule: a type outside
    its priority list, W4A8_DYNAMIC, is not counted, so a W4A8_DYNAMIC export says ``FLOAT``)."""
    present = {kind for kind in types if kind in QUANT_TYPE_PRIORITY}
    return max(present, key=QUANT_TYPE_PRIORITY.index) if present else "FLOAT"


def description_globals(
    quant_type: str, group_sizes: Iterable[int], kv_cache: bool = False
) -> dict[str, Any]:
    """The description's global keys (one global ``group_size``: the largest per-group size,
    as msModelSlim writes it; 0 when no layer is per-group), led by ``kv_cache_type`` and
    ``kv_quant_type`` (``C8``) when the export holds an int8 KV cache."""
    sizes = sorted(set(group_sizes))
    return {
        **dict.fromkeys(KV_CACHE_GLOBALS if kv_cache else (), KV_CACHE_TYPE),
        "version": DESCRIPTION_VERSION,
        "model_quant_type": quant_type,
        "metadata": {},
        "group_size": max(sizes) if sizes else 0,
        "optional": {},
    }


def ordered_description(
    types: Mapping[str, str], aliases: Mapping[str, str], model_order: Iterable[str]
) -> dict[str, str]:
    """Tensor name -> type, in the model's state-dict order, tied aliases described like their
    target, tensors the model does not name (none, normally) last.

    :param types: written tensor -> type.
    :param aliases: tied tensor not stored -> the stored tensor it shares.
    :param model_order: the model's state-dict names.
    """
    described = {**types, **{alias: types[target] for alias, target in aliases.items()}}
    order = list(model_order)
    known = set(order)
    names = [n for n in order if n in described] + [n for n in described if n not in known]
    return {name: described[name] for name in names}
