"""What SGLang 0.5.23 cannot serve, or serves otherwise, although the export is right: its model
classes' and quantization schemes' own limits.

The GPTQ and compressed-tensors savers call these checks on the plan (before weights load) and
warn; vLLM 0.33 / 0.34 loads every case below (and uses static activation scales). Each was established
by running SGLang's own code from its wheel on msquant's exports (``tests/consumers/
test_sglang.py``, ``test_sglang_w8a8.py``):

* Mixtral: ``MixtralForCausalLM`` builds ``lm_head`` without the quantization config, so a
  quantized head is never read;
* DeepSeek-V2/V3: the loader (``deepseek_common/deepseek_weight_loader.py``) concatenates each
  layer's ``q_a_proj`` and ``kv_a_proj_with_mqa`` tensors along dimension 0 into
  ``fused_qkv_a_proj_with_mqa``, whose ``ReplicatedLinear.weight_loader`` asserts equal shapes:
  GPTQ's packed tensors, compressed-tensors' weight-only ``weight_shape`` (``[4]`` against
  ``[2]``) and static W8A8's per-tensor ``input_scale`` (``[2]`` against ``[1]``) do not fit;
  int8 W8A8 with per-token activations (``weight`` ``[out, in]``, ``weight_scale`` ``[out, 1]``
  only) does, and loads;
* compressed-tensors only: Llama, Qwen2/3, Mistral, Mixtral and Qwen2-MoE declare no
  ``packed_modules_mapping``, so fused layers (``qkv_proj``, ``gate_up_proj``) are matched by
  their fused name and get the ``Linear`` group's scheme whatever their shards' group or
  ``ignore`` says; and Mixtral experts are looked up as ``experts.N.gate_proj``, not by the
  checkpoint's ``experts.N.w1``, so experts left float are built quantized;
* compressed-tensors int8 W8A8 (``qconfig.act``): static per-tensor activations load, but
  ``CompressedTensorsW8A8Int8.apply_weights`` quantizes every token itself
  (``per_token_quant_int8``) and never reads the stored ``input_scale`` / ``input_zero_point``;
  and int8 W8A8 MoE experts are refused on a GPU (``CompressedTensorsConfig.get_moe_scheme``
  raises ``NotImplementedError``: "implemented only for NPU").
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from torch import nn

from msquant.plugin import ModelAdapter, adapter_for
from msquant.plugin.model import FusedGroup
from msquant.plugin.planning import ModelPlan, PlanRow

__all__ = ["sglang_plan_warnings"]

ENGINE = "SGLang 0.5.23"
#: Model types whose SGLang class declares no ``packed_modules_mapping``.
UNMAPPED_MODEL_TYPES = frozenset({"llama", "qwen2", "qwen3", "mistral", "mixtral", "qwen2_moe"})
DEEPSEEK_MODEL_TYPES = frozenset({"deepseek_v2", "deepseek_v3"})
DEEPSEEK_JOINED = ("q_a_proj", "kv_a_proj_with_mqa")
#: ``PlanRow.act`` of compressed-tensors int8 W8A8 (static per-tensor, dynamic per-token).
INT8_W8A8 = ("W8A8", "W8A8_DYNAMIC")
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


#: Why SGLang's joined a-projection cannot take these tensors, by how the layers are stored.
DEEPSEEK_REASONS = {
    "gptq": "GPTQ's packed qweight / qzeros / scales / g_idx cannot be joined that way",
    "weight_only": "compressed-tensors' two weight_shape vectors give [4] against the [2] it builds",
    "static": "the two per-tensor input_scale tensors give [2] against the [1] it builds",
}


def _deepseek_kind(rows: list[PlanRow], compressed_tensors: bool) -> str | None:
    """Which :data:`DEEPSEEK_REASONS` applies to one layer's quantized a-projections (None: the
    joined layer loads: compressed-tensors int8 W8A8 with per-token activations, whose
    ``weight [out, in]`` and ``weight_scale [out, 1]`` concatenate along dimension 0)."""
    if not compressed_tensors:
        return "gptq"
    if all(row.act == "W8A8_DYNAMIC" for row in rows):
        return None
    return "static" if any(row.act == "W8A8" for row in rows) else "weight_only"


def _deepseek_joined(rows: dict[str, PlanRow], compressed_tensors: bool) -> list[str]:
    layers: dict[str, list[PlanRow]] = {}
    for name, row in rows.items():
        parent, _, leaf = name.rpartition(".")
        if leaf in DEEPSEEK_JOINED and _quantized(row):
            layers.setdefault(parent, []).append(row)
    by_kind: dict[str, list[str]] = {}
    for layer in sorted(layers):
        kind = _deepseek_kind(layers[layer], compressed_tensors)
        if kind is not None:
            by_kind.setdefault(kind, []).append(layer)
    return [
        f"{ENGINE} concatenates each layer's q_a_proj and kv_a_proj_with_mqa tensors along "
        "dimension 0 into one fused_qkv_a_proj_with_mqa (its DeepSeek weight loader), whose "
        f"weight loader needs the joined shapes to match: {DEEPSEEK_REASONS[kind]}, so it cannot "
        f"load this checkpoint ({_listing(layers_of_kind)}; vLLM can); for SGLang keep them "
        "float: exclude ['*q_a_proj', '*kv_a_proj_with_mqa']"
        + ("" if kind == "gptq" else ", or quantize them int8 W8A8 with per-token activations")
        for kind, layers_of_kind in by_kind.items()
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


def _w8a8_experts(rows: dict[str, PlanRow]) -> list[str]:
    """compressed-tensors int8 W8A8 MoE experts: SGLang builds them only on NPU."""
    experts = sorted(
        {
            name.rpartition(".experts.")[0] + ".experts"
            for name, row in rows.items()
            if ".experts." in name and _quantized(row) and row.act in INT8_W8A8
        }
    )
    if not experts:
        return []
    return [
        f"{ENGINE} cannot load int8 W8A8 MoE experts on a GPU: its compressed-tensors MoE scheme "
        "for them is implemented only for NPU (CompressedTensorsConfig.get_moe_scheme raises "
        f"NotImplementedError), so it cannot load this checkpoint ({_listing(experts)}; vLLM "
        "can); for SGLang on a GPU keep the experts float: exclude ['*mlp.experts.*']"
    ]


def _static_activations(rows: dict[str, PlanRow]) -> list[str]:
    """compressed-tensors int8 W8A8 with static activations: loaded, scales unused."""
    static = [name for name, row in rows.items() if _quantized(row) and row.act == "W8A8"]
    if not static:
        return []
    return [
        f"{ENGINE} loads these static int8 W8A8 layers but does not use their activation scales: "
        "CompressedTensorsW8A8Int8.apply_weights quantizes each token's activations itself "
        "(per_token_quant_int8, symmetric) and never reads the stored input_scale / "
        "input_zero_point, so SGLang serves them as per-token W8A8, not the calibrated static "
        f"scheme msquant evaluated ({_listing(static)}); vLLM uses the stored scales"
    ]


def sglang_plan_warnings(plan: ModelPlan, model: nn.Module, compressed_tensors: bool) -> list[str]:
    """The warnings for what SGLang cannot serve, or serves otherwise, in an export of ``plan``
    (see the module doc).

    :param compressed_tensors: the export is compressed-tensors (else GPTQ), which adds the
        ``packed_modules_mapping``, Mixtral ``ignore`` and int8 W8A8 limits.
    """
    rows = {row.module: row for row in plan.rows}
    model_type = plan.model_type
    adapter = adapter_for(model)  # the model's head and fused matrices
    warnings = []
    if model_type == "mixtral":
        warnings += _mixtral_head(rows, model, adapter)
    if model_type in DEEPSEEK_MODEL_TYPES:
        warnings += _deepseek_joined(rows, compressed_tensors)
    if compressed_tensors and model_type in UNMAPPED_MODEL_TYPES:
        warnings += _fused_outside_linear_group(rows, model_type, adapter)
    if compressed_tensors and model_type == "mixtral":
        warnings += _mixtral_float_experts(rows)
    if compressed_tensors:
        warnings += _w8a8_experts(rows) + _static_activations(rows)
    return warnings
