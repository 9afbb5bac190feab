"""Which subgraph types msModelSlim 26.1.0 smooths, per ``--model_type`` (its model adapter).

msModelSlim's ``--model_type`` names a model adapter (an entry point of its
``msmodelslim.model_adapter.plugins`` group; an unknown name falls back to ``default`` with a
warning). ``iter_smooth`` and ``flex_smooth_quant`` ask that adapter for a layer's subgraphs when
it implements the processor's interface (``IterSmoothInterface``, ``FlexSmoothQuantInterface``),
and otherwise find them themselves by hooking the layer, which yields norm -> linears subgraphs
only. ``enable_subgraph_type`` then keeps the listed types of those. So the same YAML smooths
other subgraph types under different ``--model_type`` s: ``default`` and the Qwen2 / Qwen2.5
adapters (no smoothing interface) smooth norm-linear only, Qwen3's norm-linear, ov and up-down.

The table below was read from msModelSlim 26.1.0's installed adapters (each class's interfaces
and the ``subgraph_type`` values its ``get_adapter_config_for_subgraph`` writes; the
language-model adapters plus the multimodal ones whose text decoder is a causal LM) and checked
against its exports for ``default``, ``Qwen3-8B`` and ``QwQ-32B`` (``tests/oracle``).
``smooth_quant`` smooths norm-linear subgraphs under every adapter, so it is not in the table;
``flex_awq_ssz`` asks the adapter through ``FlexSmoothQuantInterface`` (its processor is
``flex_smooth_quant``'s sibling), so it smooths what ``flex_smooth_quant`` smooths.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from msquant.plugin.model import SubgraphType
from msquant.processors.smoothing.config import SmoothingConfig

__all__ = [
    "DEFAULT_TYPES",
    "MsModelSlimAdapter",
    "msmodelslim_adapter",
    "msmodelslim_types",
    "nothing_to_smooth",
    "restricted_types",
]

logger = logging.getLogger(__name__)

#: What msModelSlim's own search finds when the adapter does not answer: norm -> linears.
DEFAULT_TYPES: tuple[SubgraphType, ...] = ("norm-linear",)


@dataclass(frozen=True)
class MsModelSlimAdapter:
    """One msModelSlim model adapter as far as smoothing goes.

    :param name: its module in msModelSlim (``qwen3``, ``default``).
    :param types: the subgraph types its ``get_adapter_config_for_subgraph`` names.
    :param processors: the smoothing processors that ask it (the others find norm-linear
        subgraphs themselves).
    """

    name: str
    types: tuple[SubgraphType, ...] = ()
    processors: tuple[str, ...] = ()


_BOTH = ("iter_smooth", "flex_smooth_quant")
_ALL3: tuple[SubgraphType, ...] = ("norm-linear", "ov", "up-down")
_NORM_UP: tuple[SubgraphType, ...] = ("norm-linear", "up-down")
_NORM_OV: tuple[SubgraphType, ...] = ("norm-linear", "ov")

#: msModelSlim 26.1.0's adapters and the ``--model_type`` names that select them.
_ADAPTERS: dict[MsModelSlimAdapter, tuple[str, ...]] = {
    MsModelSlimAdapter("default"): ("default",),
    MsModelSlimAdapter("qwen1_5"): ("Qwen1.5-110B",),
    MsModelSlimAdapter("qwen2"): ("Qwen2-72B", "Qwen2-7B", "Qwen2-7B-Instruct"),
    MsModelSlimAdapter("qwen2_5"): (
        "Qwen2.5-7B-Instruct", "Qwen2.5-32B-Instruct", "Qwen2.5-72B-Instruct",
        "Qwen2.5-Coder-7B-Instruct", "DeepSeek-R1-Distill-Qwen-1.5B",
        "DeepSeek-R1-Distill-Qwen-7B",
    ),
    MsModelSlimAdapter("step3_5_flash"): ("Step-3.5-Flash",),
    MsModelSlimAdapter("qwq", _NORM_UP, ("iter_smooth",)): ("QwQ-32B", "Qwen-QwQ-32B"),
    MsModelSlimAdapter("qwen3", _ALL3, _BOTH): ("Qwen3-8B", "Qwen3-14B", "Qwen3-32B"),
    MsModelSlimAdapter("qwen3_moe", _ALL3, _BOTH): (
        "Qwen3-30B", "Qwen3-235B", "Qwen3-Coder-480B-A35B",
    ),
    MsModelSlimAdapter("qwen3_next", DEFAULT_TYPES, _BOTH): ("Qwen3-Next-80B-A3B-Instruct",),
    MsModelSlimAdapter("qwen3_5_moe", DEFAULT_TYPES, _BOTH): (
        "Qwen3.5-27B", "Qwen3.5-35B-A3B", "Qwen3.5-122B-A10B", "Qwen3.5-397B-A17B",
        "Qwen3.6-27B",
    ),
    MsModelSlimAdapter("deepseek_v3", _ALL3, _BOTH): (
        "DeepSeek-V3", "DeepSeek-V3-0324", "DeepSeek-V3.1", "DeepSeek-V3.1-Terminus",
        "DeepSeek-R1", "DeepSeek-R1-0528",
    ),
    MsModelSlimAdapter("deepseek_v3_2", _ALL3, ("flex_smooth_quant",)): (
        "DeepSeek-V3.2", "DeepSeek-V3.2-Exp",
    ),
    MsModelSlimAdapter("deepseek_v4", ("norm-linear", "up-down", "linear-linear"), _BOTH): (
        "DeepSeek-V4-Flash", "DeepSeek-V4-Pro",
    ),
    MsModelSlimAdapter("glm4_moe", _NORM_OV, _BOTH): ("GLM-4.5", "GLM-4.6", "GLM-4.7"),
    MsModelSlimAdapter("glm_5", _ALL3, ("flex_smooth_quant",)): ("GLM-5", "GLM-5.1"),
    MsModelSlimAdapter("kimi_k2", _NORM_OV, _BOTH): ("Kimi-K2-Instruct-0905", "Kimi-K2-Thinking"),
    MsModelSlimAdapter("kimi_k2_5", _ALL3, _BOTH): ("Kimi-K2.5", "Kimi-K2.6"),
    MsModelSlimAdapter("longcat_flash", _ALL3, _BOTH): ("LongCat-Flash-Chat",),
    MsModelSlimAdapter("minimax_m2", _ALL3, _BOTH): ("MiniMax-M2.7",),
    # multimodal adapters, for their language model
    MsModelSlimAdapter("qwen2_5_vl", _NORM_UP, _BOTH): (
        "Qwen2.5-VL-7B-Instruct", "Qwen2.5-VL-32B-Instruct", "Qwen2.5-VL-72B-Instruct",
    ),
    MsModelSlimAdapter("qwen2_5_omni_thinker", _NORM_UP, _BOTH): ("Qwen2.5-Omni-7B",),
    MsModelSlimAdapter("qwen3_vl", _ALL3, _BOTH): (
        "Qwen3-VL-4B-Instruct", "Qwen3-VL-32B-Instruct", "Qwen3-VL-Embedding-2B",
        "Qwen3-VL-Embedding-8B", "Qwen3-VL-Reranker-2B", "Qwen3-VL-Reranker-8B",
    ),
    MsModelSlimAdapter("qwen3_vl_moe", _ALL3, _BOTH): ("Qwen3-VL-30B-A3B", "Qwen3-VL-235B-A22B"),
    MsModelSlimAdapter("qwen3_omni_moe", _ALL3, _BOTH): (
        "Qwen3-Omni-30B-A3B-Instruct", "Qwen3-Omni-30B-A3B-Thinking",
    ),
    MsModelSlimAdapter("glm4_6v", _ALL3, _BOTH): ("GLM-4.6V",),
    MsModelSlimAdapter("internvl3_5", _ALL3, _BOTH): ("InternVL3_5-38B",),
    MsModelSlimAdapter("internvl3_5_moe", _NORM_OV, _BOTH): ("InternVL3_5-241B-A28B",),
}  # fmt: skip

_BY_NAME = {name: adapter for adapter, names in _ADAPTERS.items() for name in names}
#: Processors asking an adapter through another's interface: name -> the processor it stands for.
_SAME_INTERFACE = {"flex_awq_ssz": "flex_smooth_quant"}


def msmodelslim_adapter(model_type: str) -> MsModelSlimAdapter | None:
    """The adapter msModelSlim 26.1.0 selects for ``--model_type model_type``; None for a name it
    does not know (it then uses ``default``)."""
    return _BY_NAME.get(model_type)


def msmodelslim_types(processor: str, model_type: str) -> tuple[SubgraphType, ...]:
    """The subgraph types ``processor`` (``iter_smooth``, ``flex_smooth_quant``,
    ``flex_awq_ssz``) can smooth
    under msModelSlim's ``--model_type model_type`` (before ``enable_subgraph_type``)."""
    adapter = msmodelslim_adapter(model_type)
    asking = _SAME_INTERFACE.get(processor, processor)
    if adapter is None or asking not in adapter.processors:
        return DEFAULT_TYPES
    return adapter.types


def restricted_types(
    processor: str, types: tuple[SubgraphType, ...], model_type: str | None
) -> tuple[SubgraphType, ...]:
    """``types`` (an entry's ``enable_subgraph_type``, in fold order) as msModelSlim reads them
    under ``--model_type model_type``: those its adapter lets ``processor`` smooth; ``types``
    itself when the run names no ``--model_type`` (msquant's own rule: every type its model
    adapter finds). Logs what the name selects, and warns about a name msModelSlim does not
    know."""
    if model_type is None:
        return types
    adapter = msmodelslim_adapter(model_type)
    allowed = msmodelslim_types(processor, model_type)
    kept = tuple(t for t in types if t in allowed)
    if adapter is None:
        logger.warning(
            "--model_type %s is not one of msModelSlim 26.1.0's model adapters msquant knows; "
            "msModelSlim falls back to its default adapter for such a name, so %s smooths "
            "%s subgraphs only, as there",
            model_type,
            processor,
            ", ".join(DEFAULT_TYPES),
        )
    else:
        logger.info(
            "--model_type %s (msModelSlim's %s adapter): %s smooths %s subgraphs%s",
            model_type,
            adapter.name,
            processor,
            ", ".join(kept) or "no",
            f" (not {', '.join(t for t in types if t not in kept)})" if kept != types else "",
        )
    return kept


def nothing_to_smooth(processor: str, config: SmoothingConfig, model_type: str) -> str:
    """Why an entry smooths no subgraph of the model under ``--model_type model_type``."""
    return (
        f"{processor}: no subgraph to smooth under --model_type {model_type}: msModelSlim "
        f"26.1.0's adapter for that name lets {processor} smooth "
        f"{', '.join(msmodelslim_types(processor, model_type))} subgraphs, and the entry asks "
        f"for {', '.join(config.subgraph_types)} (include {config.include or ['*']}, exclude "
        f"{config.exclude or []}), so msModelSlim would smooth nothing; name other types, or "
        "drop the entry"
    )
