"""What SGLang 0.5.23 cannot serve although the export is right: its model classes' own limits.

The GPTQ and compressed-tensors savers call these checks on the plan (before weights load) and
warn; vLLM 0.33 loads every case below. Each was established by running SGLang's own loading code
from its wheel on msquant's exports (``tests/consumers/test_sglang.py``):

* Mixtral: ``MixtralForCausalLM`` builds ``lm_head`` without the quantization config, so a
  quantized head is never read;
* DeepSeek-V2/V3: the loader concatenates each layer's ``q_a_proj`` and ``kv_a_proj_with_mqa``
  along dimension 0 (``fused_qkv_a_proj_with_mqa``), which packed quantized tensors do not allow;
* compressed-tensors only: Llama, Qwen2/3, Mistral, Mixtral and Qwen2-MoE declare no
  ``packed_modules_mapping``, so fused layers (``qkv_proj``, ``gate_up_proj``) are matched by
  their fused name and get the ``Linear`` group's scheme whatever their shards' group or
  ``ignore`` says; and Mixtral experts are looked up as ``experts.N.gate_proj``, not by the
  checkpoint's ``experts.N.w1``, so experts left float are built quantized.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from torch import nn

from msquant.plugin import FusedGroup, ModelAdapter, ModelPlan, PlanRow, adapter_for

__all__ = ["sglang_plan_warnings"]

ENGINE = "SGLang 0.5.23"
#: Model types whose SGLang class declares no ``packed_modules_mapping``.
UNMAPPED_MODEL_TYPES = frozenset({"llama", "qwen2", "qwen3", "mistral", "mixtral", "qwen2_moe"})
DEEPSEEK_MODEL_TYPES = frozenset({"deepseek_v2", "deepseek_v3"})
DEEPSEEK_JOINED = ("q_a_proj", "kv_a_proj_with_mqa")
#: Modules a message lists before "and N more".
LISTED = 4


def _listing(names: Sequence[str]) -> str:
    more = len(names) - LISTED
    return ", ".join(names[:LISTED]) + (f" and {more} more" if more > 0 else "")


def _quantized(row: PlanRow) -> bool:
    return not row.skipped


def _scheme(row: PlanRow) -> tuple[object, ...]:
    return ("float",) if row.skipped else (row.bits, row.group_size, row.sym)


def _mixtral_head(rows: dict[str, PlanRow], model: nn.Module, adapter: ModelAdapter) -> list[str]:
    found = adapter.output_head(model)
    if found is None or found[0] not in rows or not _quantized(rows[found[0]]):
        return []
    return [
        f"{ENGINE} builds Mixtral's {found[0]} without the quantization config "
        "(MixtralForCausalLM), so it cannot load this quantized lm_head (vLLM does); to serve with "
        "SGLang set lm_head: false"
    ]


def _deepseek_joined(rows: dict[str, PlanRow]) -> list[str]:
    layers = sorted(
        {
            name.rpartition(".")[0]
            for name, row in rows.items()
            if name.rpartition(".")[2] in DEEPSEEK_JOINED and _quantized(row)
        }
    )
    if not layers:
        return []
    return [
        f"{ENGINE} concatenates each layer's q_a_proj and kv_a_proj_with_mqa along dimension 0 "
        "(fused_qkv_a_proj_with_mqa), which quantized GPTQ / compressed-tensors tensors do not "
        f"allow, so it cannot load this checkpoint ({_listing(layers)}; vLLM can); for SGLang keep "
        "them float: exclude ['*q_a_proj', '*kv_a_proj_with_mqa']"
    ]


def _fused_outside_linear_group(
    rows: dict[str, PlanRow], model_type: str, adapter: ModelAdapter
) -> list[str]:
    """compressed-tensors: fused layers whose shards are not in the most common (``Linear``)
    scheme, which SGLang's unmapped model classes give them anyway."""
    counts = Counter(_scheme(row) for row in rows.values() if _quantized(row))
    if not counts:
        return []
    base = counts.most_common(1)[0][0]
    # MoE experts are loaded through SGLang's FusedMoE, not its packed-module lookup
    groups: list[FusedGroup] = [
        g for g in adapter.fused_groups(rows) if ".experts." not in g.fused_name
    ]
    odd = [g.fused_name for g in groups if any(_scheme(rows[m]) != base for m in g.members)]
    if not odd:
        return []
    return [
        f"{ENGINE}'s {model_type} class declares no packed_modules_mapping, so it matches "
        "compressed-tensors targets and ignore against the fused names (qkv_proj, gate_up_proj) "
        "and gives these fused layers the `Linear` group's scheme, although their shards are "
        f"stored otherwise (another group or float): {_listing(odd)}; vLLM loads them; for SGLang "
        "give fused layers the most common scheme"
    ]


def _mixtral_float_experts(rows: dict[str, PlanRow]) -> list[str]:
    experts = sorted(
        {
            name.rpartition(".experts.")[0] + ".experts"
            for name, row in rows.items()
            if ".experts." in name and row.skipped
        }
    )
    if not experts:
        return []
    return [
        f"{ENGINE} looks Mixtral's experts up in compressed-tensors `ignore` as experts.N.gate_proj, "
        "not by the checkpoint's experts.N.w1 / w2 / w3, so experts left float are built quantized "
        f"and not loaded ({_listing(experts)}); vLLM loads them; for SGLang quantize every expert"
    ]


def sglang_plan_warnings(plan: ModelPlan, model: nn.Module, compressed_tensors: bool) -> list[str]:
    """The warnings for what SGLang cannot serve in an export of ``plan`` (see the module doc).

    :param compressed_tensors: the export is compressed-tensors (else GPTQ), which adds the
        ``packed_modules_mapping`` and Mixtral ``ignore`` limits.
    """
    rows = {row.module: row for row in plan.rows}
    model_type = plan.model_type
    adapter = adapter_for(model)  # the model's head and fused matrices
    warnings = []
    if model_type == "mixtral":
        warnings += _mixtral_head(rows, model, adapter)
    if model_type in DEEPSEEK_MODEL_TYPES:
        warnings += _deepseek_joined(rows)
    if compressed_tensors and model_type in UNMAPPED_MODEL_TYPES:
        warnings += _fused_outside_linear_group(rows, model_type, adapter)
    if compressed_tensors and model_type == "mixtral":
        warnings += _mixtral_float_experts(rows)
    return warnings
