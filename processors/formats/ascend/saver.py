"""``ascendv1_saver``: msModelSlim v1 deployment weights for vLLM-Ascend and MindIE.

Sample yaml::

    spec:
      save:
        - type: ascendv1_saver
          part_file_size: 4   # GiB per shard; 0 = one quant_model_weights.safetensors

Files written (msModelSlim 26.1 layout):

* ``quant_model_weights-0000i-of-0000N.safetensors`` + ``quant_model_weights.safetensors.index.json``
  (or one ``quant_model_weights.safetensors`` when ``part_file_size`` is 0);
* ``quant_model_description.json``: every tensor typed ``W8A16``, ``W4A16`` or ``FLOAT``, plus
  ``version``, ``model_quant_type``, ``metadata``, ``group_size`` and ``optional``;
* with ``dynamic_cache`` (int8 KV cache): ``<attention>.k_proj.kv_cache_scale`` /
  ``kv_cache_offset`` and the ``v_proj`` ones, typed ``C8``, and the globals ``kv_cache_type`` and
  ``kv_quant_type``, both ``C8`` (docs/ascend-format.md, "C8");
* with ``float_sparse``: the pruned linears' ``weight`` (and ``bias``) in the model's dtype,
  typed ``W16A16S`` (docs/ascend-format.md, "W16A16S");
* the model's config/tokenizer files, ``quantization_config`` removed from ``config.json``, and the
  config used as ``{model_type}_best_practice.yaml``.

Per quantized linear ``P``: ``P.weight`` int8 ``[out, in]``, ``P.weight_scale`` and ``P.weight_offset``
float32 ``[out, 1]`` (per-channel) or ``[out, in/group_size]`` (per-group), ``P.bias`` float32
(``FLOAT``). Other tensors keep their dtype and are ``FLOAT``. Dequantization:
``w = (weight - weight_offset) * weight_scale``.

W4A16 (``dtype: int4``): ``P.weight`` is int8 ``[out, in/2]`` holding two signed int4 codes per
byte along the input dimension (column ``2i`` in the low nibble, ``2i+1`` in the high nibble, as
msModelSlim packs int4); scale and offset as for W8A16. No vLLM-Ascend release has a W4A16 *linear*
scheme yet (vllm-project/vllm-ascend#6481), so such exports are for MindIE or later releases.

Output head (``linear_quant`` with ``lm_head: true``): written when the runner's head stage
reaches this saver, as ``lm_head.weight`` int8 (``W8A16``; ``W4A16`` packed as above) with
``lm_head.weight_scale`` / ``lm_head.weight_offset`` of the same type in the description.
msModelSlim itself never quantizes the head (it visits decoder layers only). vLLM-Ascend's
``AscendModelSlimConfig`` gives its ``ParallelLMHead`` (a ``VocabParallelEmbedding``) the linear
scheme of ``lm_head.weight``'s type, so a per-channel W8A16 head loads there (read in its source,
not run on hardware); MindIE support is unknown. A warning says so.

Fused layers: vLLM-Ascend loads q/k/v and gate/up as one matrix and raises ``ValueError`` when the
shards' types differ, so such an export is refused here with the layers named.

vLLM-Ascend (``--quantization ascend``) loads per-channel W8A16 linear layers only; before
weights load (``review_plan``, also shown by ``msquant plan``) a warning names, with the
consumer, the layers it cannot load or may compute wrongly: W4A16 linear layers (no W4A16
linear scheme), per-group W8A16 (its scheme is per-channel only), quantized MoE experts (no
W8A16 MoE scheme; its W4A16 MoE scheme reads llm-compressor's int32 layout) and asymmetric
weights (it passes ``weight_offset`` unchanged to ``npu_weight_quant_batchmatmul``, which CANN
documents as ``(weight + offset) * scale``, while this format means ``(weight - offset) *
scale``: the sign is unsettled until checked on hardware). They are warnings, not errors: the
same files serve MindIE, and msModelSlim writes these types itself.

Lifecycle (:class:`msquant.plugin.Saver`): ``after_layer`` queues the layer's tensors (written shard by
shard; the head stage alike); ``finalize`` adds the remaining tensors (embeddings, final norm, a
float head) and writes the description and copied files. Resumable: a checkpoint holds the
writer's state and the types recorded so far. The tensors are packed by
:mod:`msquant.processors.formats.ascend.packer`, the description built by
:mod:`msquant.processors.formats.ascend.config`; this module is the processor around them.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Hashable
from typing import Any, Literal

import torch
from pydantic import Field
from torch import nn

from msquant.plugin import (
    DecoderLayer,
    MsquantInputError,
    QuantizationError,
    QuantizedLinear,
    RunContext,
    Saver,
    SaverConfig,
    SaverState,
)
from msquant.plugin.export import ShardedSafetensorsWriter, copy_model_files, safe_file_stem
from msquant.plugin.model import parse_expert_linear
from msquant.plugin.planning import ModelPlan, PlanReview, PlanRow
from msquant.processors.formats.ascend.config import (
    DESCRIPTION_FILE,
    HEAD_WARNING,
    KV_CACHE_TYPE,
    description_globals,
    model_quant_type,
    ordered_description,
)
from msquant.processors.formats.ascend.fa_quant import (
    EXTRAS_KEY,
    FA_QUANT,
    FA_QUANT_GLOBAL,
    FA_QUANT_STATIC,
    FAQuantRecord,
)
from msquant.processors.formats.ascend.fp8 import FP8_TYPE
from msquant.processors.formats.ascend.layer_types import W16A16S
from msquant.processors.formats.ascend.mx import MX_TYPES
from msquant.processors.formats.ascend.packer import FLOAT, ascend_module_tensors, quant_type

__all__ = ["AscendV1SaverConfig", "AscendV1Saver", "AscendSaverState"]

logger = logging.getLogger(__name__)
#: The folder of the tensors processors ship beside the weights (msModelSlim's ``optional/``).
OPTIONAL_FOLDER = "optional"

WEIGHTS_PREFIX = "quant_model_weights"

#: How many module names a plan warning lists before "and N more".
LISTED_MODULES = 4
VLLM_ASCEND_ASYM = (
    "asymmetric weights: vLLM-Ascend passes weight_offset unchanged to "
    "torch_npu.npu_weight_quant_batchmatmul (antiquant_offset), which CANN documents as "
    "(weight + offset) * scale, while this format (msModelSlim's) means (weight - offset) * scale; "
    "until that is checked on Ascend hardware the offset's sign is unsettled there, so for "
    "vLLM-Ascend quantize with symmetric: true (offset 0); msModelSlim writes this convention for MindIE: "
    "{names}"
)
VLLM_ASCEND_MOE = (
    "vLLM-Ascend cannot load these MoE experts: it has no W8A16 scheme for MoE layers, and its "
    "W4A16 MoE scheme reads llm-compressor's int32 weight_packed layout, not this format's int8 "
    "pairs; for vLLM-Ascend keep the experts in float (exclude: ['*.experts.*']); MindIE support "
    "is unknown: {names}"
)
VLLM_ASCEND_W4A16 = (
    "vLLM-Ascend has no W4A16 linear scheme (vllm-ascend#6481), so these W4A16 layers do not load "
    "there; for vLLM-Ascend use dtype: int8 (W8A16); the export is for MindIE and later "
    "releases: {names}"
)
VLLM_ASCEND_W4A8 = (
    "vLLM-Ascend serves W4A8_DYNAMIC for MoE experts only: 0.30.0rc2 removed the W4A8_DYNAMIC "
    "linear scheme (NotImplementedError), and 0.26.0rc1's deprecated one needs per-group weights "
    "(it divides by the description's group_size, 0 here, when it creates the parameters), so "
    "these dense W4A8_DYNAMIC layers do not load in either; msModelSlim's W4A8 practices quantize "
    "attention and dense MLPs W8A8_DYNAMIC (int8 weights) and the experts W4A8_DYNAMIC: {names}"
)
VLLM_ASCEND_W4A8_MOE_GROUPED = (
    "W4A8_DYNAMIC MoE experts beside per-group layers: the description's one global group_size "
    "is then the largest group size ({group}), which vLLM-Ascend reads as the experts' own: "
    "0.30.0rc2 refuses them (ValueError: per-group W4A8_DYNAMIC MoE is no longer supported) and "
    "0.26.0rc1 builds them per-group and finds no weight_scale_second / weight_offset_second; "
    "for vLLM-Ascend quantize every layer per-channel: {names}"
)
VLLM_ASCEND_W8A8_DEQ = (
    "W8A8 layers of a float32 model: deq_scale is stored as int64 (float32 bits), msModelSlim's "
    "encoding for float16 and float32 models, which vLLM-Ascend 0.26 loads when serving in "
    "float16 (--dtype float16); served in bfloat16 it creates a float32 deq_scale that the int64 "
    "tensor does not fit (export a bfloat16 copy of the model for bfloat16 serving): {names}"
)
VLLM_ASCEND_FP8 = (
    "vLLM-Ascend 0.30 names the W8A8 fp8 layer W8A8FP8_DYNAMIC and has no scheme for this "
    "format's (msModelSlim's) WFP8AFP8_DYNAMIC type, so it refuses these layers by name "
    "(NotImplementedError); for vLLM-Ascend write the compressed_tensors export of the same "
    "config (spec.save: [{{type: compressed_tensors}}]), which its compressed-tensors path loads: "
    "{names}"
)
VLLM_ASCEND_PER_GROUP = (
    "vLLM-Ascend's W8A16 scheme is per-channel only (weight_scale [out, 1]), so these per-group "
    "W8A16 layers do not load there; for vLLM-Ascend use scope: per_channel (msModelSlim writes "
    "per-group W8A16 alike, for MindIE): {names}"
)


class AscendV1SaverConfig(SaverConfig):
    """Config of ``ascendv1_saver``."""

    type: Literal["ascendv1_saver"] = "ascendv1_saver"
    part_file_size: int = Field(4, ge=0, description="Shard size in GiB; 0 writes a single file.")
    ext: dict[str, Any] = Field(
        default_factory=dict, description="Reserved (msModelSlim compatibility)."
    )


class AscendSaverState(SaverState):
    """The Ascend savers' record: every written tensor's type, the per-group sizes seen."""

    types: dict[str, str] = Field(default_factory=dict)
    group_sizes: set[int] = Field(default_factory=set)
    #: ``fa3_quant``: attention point -> its ``quant_type`` string; whether a branch is static.
    fa_quant_types: dict[str, str] = Field(default_factory=dict)
    fa_static: bool = False


class AscendV1Saver(Saver):
    """Writes the Ascend (msModelSlim v1) export as layers finish."""

    type_name = "ascendv1_saver"
    config_class = AscendV1SaverConfig
    config: AscendV1SaverConfig
    state_class = AscendSaverState
    state: AscendSaverState
    #: File name stem of the weights (``mindie_format_saver`` changes it and the description's).
    weights_prefix = WEIGHTS_PREFIX
    #: Written when a config's ``spec.save`` is empty (msModelSlim's default format).
    default_saver = True
    #: W8A8 and W8A8_DYNAMIC (msModelSlim's layout).
    writes_activations = True
    activation_schemes = (
        "W8A8",
        "W8A8_MIX",
        "W8A8_DYNAMIC",
        "W4A8_DYNAMIC",
        *MX_TYPES,
        FP8_TYPE,
    )
    #: Integer codes and the MX value types (:mod:`msquant.processors.formats.ascend.mx`).
    value_families = ("int", "mx", "fp8")
    #: The int8 KV cache's scales and offsets (``dynamic_cache``).
    tensor_kinds = (KV_CACHE_TYPE, W16A16S)

    def check_model(self, model: nn.Module, layers: list[DecoderLayer]) -> list[str]:
        model_type = str(getattr(getattr(model, "config", None), "model_type", "unknown"))
        try:
            safe_file_stem(model_type, "model_type")
        except MsquantInputError as error:
            return [f"{self.type_name}: {error}"]
        return []

    def review_plan(self, plan: ModelPlan, model: nn.Module) -> PlanReview:
        """Before weights load, warn about what vLLM-Ascend cannot load or may mis-compute.

        Warnings, not errors: the same files serve MindIE, msModelSlim itself writes these
        types (its configs must run unchanged here), and the offset sign is not settled yet.
        """
        rows = [row for row in plan.rows if not row.skipped and row.bits is not None]
        linears = [row for row in rows if parse_expert_linear(row.module) is None]
        weight_only = [row for row in rows if row.act is None]
        found = [
            (
                VLLM_ASCEND_MOE,
                [row for row in weight_only if parse_expert_linear(row.module)],
            ),
            (VLLM_ASCEND_W4A16, [row for row in linears if row.bits == 4 and row.act is None]),
            (VLLM_ASCEND_W4A8, [row for row in linears if row.act == "W4A8_DYNAMIC"]),
            (
                VLLM_ASCEND_PER_GROUP,
                [row for row in linears if row.bits == 8 and row.act is None and _grouped(row)],
            ),
            (VLLM_ASCEND_ASYM, [row for row in rows if row.sym is False]),
            (VLLM_ASCEND_FP8, [row for row in rows if row.act == FP8_TYPE]),
        ]
        grouped = sorted({row.group_size for row in rows if _grouped(row) and row.group_size})
        w4a8_experts = [
            row for row in rows if row.act == "W4A8_DYNAMIC" and parse_expert_linear(row.module)
        ]
        if grouped and w4a8_experts:
            found.append(
                (
                    VLLM_ASCEND_W4A8_MOE_GROUPED.replace("{group}", str(grouped[-1])),
                    w4a8_experts,
                )
            )
        if model_float_dtype(model) == torch.float32:
            found.append((VLLM_ASCEND_W8A8_DEQ, [row for row in rows if row.act == "W8A8"]))
        return PlanReview(
            warnings=[
                f"{self.type_name}: " + message.format(names=_listing([r.module for r in hit]))
                for message, hit in found
                if hit
            ]
        )

    # --- fa3_quant ---------------------------------------------------------------------------

    def prepare(self, ctx: RunContext) -> None:
        """Take part in ``fa3_quant``'s record: this saver writes its scales."""
        record = ctx.extras.setdefault(EXTRAS_KEY, FAQuantRecord())
        record.writers.append(self.type_name)
        self.fa_record: FAQuantRecord = record

    def after_layer(self, ctx: RunContext, layer: DecoderLayer) -> None:
        super().after_layer(ctx, layer)
        self.write_fa_quant(layer.name)

    def write_fa_quant(self, layer: str) -> None:
        """The layer's FA3 tensors (typed ``FAQuant``) and its points' ``quant_type`` strings."""
        for name, tensor in self.fa_record.tensors.get(layer, {}).items():
            self.add(name, tensor)
            self.state.types[name] = FA_QUANT
        prefix = f"{layer}."
        for point, kind in self.fa_record.quant_types.items():
            if point.startswith(prefix):
                self.state.fa_quant_types[point] = kind
        self.state.fa_static = self.state.fa_static or self.fa_record.static

    # --- the format ------------------------------------------------------------------------

    def pack(self, ctx: RunContext, name: str, module: QuantizedLinear) -> dict[str, torch.Tensor]:
        return ascend_module_tensors(name, module, model_float_dtype(ctx.model))

    def add(self, name: str, tensor: torch.Tensor) -> None:
        super().add(name, tensor)
        self.state.types.setdefault(name, FLOAT)

    def record_quantized(self, name: str, module: QuantizedLinear, packed: list[str]) -> None:
        kind = quant_type(module, name)
        for tensor_name in packed:
            if tensor_name != f"{name}.bias":
                self.state.types[tensor_name] = kind
        if module.group_size is not None:
            self.state.group_sizes.add(module.group_size)

    def record_extra(self, name: str, kind: str) -> None:
        self.state.types[name] = kind

    def fused_scheme(self, name: str, module: QuantizedLinear | None) -> tuple[Hashable, str]:
        if module is None:
            return FLOAT, FLOAT
        scope = "per-channel" if module.group_size is None else f"group {module.group_size}"
        kind = "sym" if module.symmetric else "asym"
        text = f"{quant_type(module, name)} {scope} {kind}"
        return text, text

    def fused_message(self, prefix: str, problems: list[str]) -> str:
        return f"{self.type_name}: the export would not load in vLLM-Ascend:\n" + "\n".join(
            f"  - {p}" for p in problems
        )

    def write_remaining(self, ctx: RunContext) -> None:
        """Every tensor not written yet, as FLOAT; tied tensors stored once but described under
        each name (``self.aliases``)."""
        self.aliases: dict[str, str] = {}
        seen: dict[tuple[int, tuple[int, ...], torch.dtype], str] = {}
        self.model_order = list(ctx.model.state_dict())
        remaining: dict[str, torch.Tensor] = {}
        for name, tensor in ctx.model.state_dict().items():
            if tensor.is_meta:
                # a layer a streamed run released after after_layer wrote it: no storage to
                # compare (every meta tensor has data_ptr 0), and nothing left to write
                if name not in self.state.written:
                    raise QuantizationError(f"{name} was released before {self.type_name} wrote it")
                continue
            key = (tensor.data_ptr(), tuple(tensor.shape), tensor.dtype)
            if tensor.numel() and key in seen:
                self.aliases[name] = seen[key]
                continue
            seen[key] = name
            remaining[name] = tensor
        self.write_tensors(remaining)

    def write_config(self, ctx: RunContext) -> None:
        described = ordered_description(self.state.types, self.aliases, self.model_order)
        # keyed by the checkpoint's names, as the weights are stored
        description: dict[str, Any] = {
            ctx.disk_name(name): kind for name, kind in described.items()
        }
        for point, kind in self.state.fa_quant_types.items():
            description[f"{ctx.disk_name(point)}.quant_type"] = kind
        if self.state.fa_static:
            description[FA_QUANT_GLOBAL] = FA_QUANT_STATIC
        description.update(self.description_globals())
        description["optional"] = self.write_optional(ctx)
        (self.directory / self.description_file()).write_text(
            json.dumps(description, indent=4) + "\n", encoding="utf-8"
        )
        copy_model_files(ctx.model_path, self.directory, ctx.config_updates)
        if ctx.config_text is not None:
            stem = safe_file_stem(ctx.model_type, "model_type")
            (self.directory / f"{stem}_best_practice.yaml").write_text(
                ctx.config_text, encoding="utf-8"
            )
        logger.info(
            "%s: %d tensors (%.1f MiB), model_quant_type %s",
            self.type_name,
            len(self.state.types),
            self.writer.total_bytes / 2**20,
            description["model_quant_type"],
        )

    def write_optional(self, ctx: RunContext) -> dict[str, Any]:
        """The tensors processors ship beside the weights (``ctx.optional_tensors``, e.g.
        ``quarot``'s ``global_rotation``): each scope in ``optional/<scope>.safetensors``, named
        in the description as msModelSlim does (``optional.<scope>.rotation_map.<tensor>`` = the
        file's path relative to the export)."""
        described: dict[str, Any] = {}
        for scope, tensors in sorted(ctx.optional_tensors.items()):
            stem = safe_file_stem(scope, "optional scope")
            folder = self.directory / OPTIONAL_FOLDER
            folder.mkdir(exist_ok=True)
            writer = ShardedSafetensorsWriter(folder, stem, None)
            for name, tensor in tensors.items():
                writer.add(name, tensor.detach().cpu().contiguous())
            writer.close()
            path = f"{OPTIONAL_FOLDER}/{stem}.safetensors"
            described[scope] = {"rotation_map": dict.fromkeys(tensors, path)}
        return described

    def description_file(self) -> str:
        """The description's file name."""
        return DESCRIPTION_FILE

    def model_quant_type(self) -> str:
        """The highest-priority type among the written tensors (msModelSlim's rule)."""
        return model_quant_type(self.state.types.values())

    def description_globals(self) -> dict[str, Any]:
        """The description's global keys (warning about several group sizes and a quantized
        head, which msModelSlim never writes)."""
        sizes = sorted(self.state.group_sizes)
        if len(sizes) > 1:
            logger.warning(
                "per-group layers use different group sizes %s; the description holds one global "
                "group_size (%d), as msModelSlim writes it",
                sizes,
                max(sizes),
            )
        head = self.state.head
        if head is not None:
            kind = self.state.types[f"{head}.weight"]
            logger.warning("%s: %s", self.type_name, HEAD_WARNING.format(head=head, kind=kind))
        kv_cache = KV_CACHE_TYPE in self.state.types.values()
        return description_globals(self.model_quant_type(), sizes, kv_cache)


def model_float_dtype(model: nn.Module) -> torch.dtype:
    """The model's floating dtype (its first floating parameter's; float32 if none): W8A8's
    ``deq_scale`` is float32 for bf16 models and int64-encoded otherwise."""
    for parameter in model.parameters():
        if parameter.is_floating_point():
            return parameter.dtype
    return torch.float32


def _grouped(row: PlanRow) -> bool:
    """Whether a plan row is per-group (``group_size`` -1 is per-channel)."""
    return row.group_size is not None and row.group_size != -1


def _listing(names: list[str]) -> str:
    more = len(names) - LISTED_MODULES
    return ", ".join(names[:LISTED_MODULES]) + (f" and {more} more" if more > 0 else "")
