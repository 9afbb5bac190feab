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

Lifecycle: ``after_layer`` queues the layer's tensors (written shard by shard; the head stage
alike); ``finalize`` adds the remaining tensors (embeddings, final norm, a float head) and writes
the description and copied files. Resumable: a checkpoint holds the writer's state and the types
recorded so far.
"""

from __future__ import annotations

import json
import logging
from typing import Any, Literal

import torch
from pydantic import Field
from torch import nn

from msquant import (
    DecoderLayer,
    ModelPlan,
    MsquantInputError,
    OutputHeadStage,
    PlanReview,
    PlanRow,
    Processor,
    ProcessorConfig,
    QuantizationError,
    QuantizedLinear,
    RunContext,
    ShardedSafetensorsWriter,
    copy_model_files,
    fused_group_problems,
    pack_int4_pairs,
    parse_expert_linear,
    safe_file_stem,
)

__all__ = ["AscendV1SaverConfig", "AscendV1Saver", "QUANT_TYPE_PRIORITY"]

logger = logging.getLogger(__name__)

WEIGHTS_PREFIX = "quant_model_weights"
DESCRIPTION_FILE = "quant_model_description.json"
DESCRIPTION_VERSION = "1.0.0"
GIB = 1024**3
# msModelSlim's order for the global ``model_quant_type`` (the highest type present wins); W4A16,
# which msModelSlim v1 does not export, ranks above W8A16 (the more compressed weight type).
QUANT_TYPE_PRIORITY = ("FLOAT", "W16A16S", "W8A16", "W4A16", "W8A8_DYNAMIC", "W8A8_MIX", "W8A8")
QUANT_TYPES_BY_BITS = {8: "W8A16", 4: "W4A16"}
HEAD_WARNING = (
    "{head} is written {kind}, which msModelSlim never does (it keeps the head FLOAT): vLLM-Ascend "
    "loads a quantized head through the linear scheme of its type (per-channel W8A16 only; read "
    "in its source, not verified on hardware); MindIE support is unknown"
)


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
VLLM_ASCEND_PER_GROUP = (
    "vLLM-Ascend's W8A16 scheme is per-channel only (weight_scale [out, 1]), so these per-group "
    "W8A16 layers do not load there; for vLLM-Ascend use scope: per_channel (msModelSlim writes "
    "per-group W8A16 alike, for MindIE): {names}"
)


class AscendV1SaverConfig(ProcessorConfig):
    """Config of ``ascendv1_saver``."""

    type: Literal["ascendv1_saver"] = "ascendv1_saver"
    part_file_size: int = Field(4, ge=0, description="Shard size in GiB; 0 writes a single file.")
    ext: dict[str, Any] = Field(
        default_factory=dict, description="Reserved (msModelSlim compatibility)."
    )


class AscendV1Saver(Processor):
    """Writes the Ascend (msModelSlim v1) export as layers finish."""

    type_name = "ascendv1_saver"
    config_class = AscendV1SaverConfig
    stage = "save"
    config: AscendV1SaverConfig

    #: File name stem of the weights and the description (``mindie_format_saver`` changes them).
    weights_prefix = WEIGHTS_PREFIX
    plain_when_single = False
    resumable = True
    #: Written when a config's ``spec.save`` is empty (msModelSlim's default format).
    default_saver = True

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
        found = (
            (VLLM_ASCEND_MOE, [row for row in rows if parse_expert_linear(row.module)]),
            (VLLM_ASCEND_W4A16, [row for row in linears if row.bits == 4]),
            (VLLM_ASCEND_PER_GROUP, [row for row in linears if row.bits == 8 and _grouped(row)]),
            (VLLM_ASCEND_ASYM, [row for row in rows if row.sym is False]),
        )
        return PlanReview(
            warnings=[
                f"{self.type_name}: " + message.format(names=_listing([r.module for r in hit]))
                for message, hit in found
                if hit
            ]
        )

    def setup(self, ctx: RunContext) -> None:
        size = self.config.part_file_size
        self.directory = self.output_dir(ctx)
        # tensors are recorded under the model's names and stored under the checkpoint's
        self.writer = ShardedSafetensorsWriter(
            self.directory,
            self.weights_prefix,
            size * GIB if size else None,
            self.plain_when_single,
            rename=ctx.disk_name,
        )
        self.types: dict[str, str] = {}
        self.group_sizes: set[int] = set()
        self.head: str | None = None  # the output head, when its stage ran quantized

    def after_layer(self, ctx: RunContext, layer: DecoderLayer) -> None:
        if isinstance(layer, OutputHeadStage) and isinstance(layer.module, QuantizedLinear):
            self.head = layer.name
        self._check_fused(layer)
        self._write_module(layer.module, layer.name + ".")

    def resume_state(self, ctx: RunContext) -> dict[str, Any]:
        return {
            "writer": self.writer.state(),
            "types": self.types,
            "group_sizes": sorted(self.group_sizes),
            "head": self.head,
        }

    def restore(self, ctx: RunContext, state: dict[str, Any]) -> None:
        self.writer.restore(state["writer"])
        self.types = dict(state["types"])
        self.group_sizes = {int(size) for size in state["group_sizes"]}
        self.head = state["head"]

    def _check_fused(self, layer: DecoderLayer) -> None:
        """Refuse layers whose fused shards (q/k/v, gate/up) would get different types."""
        schemes = {}
        for name, module in layer.module.named_modules(prefix=layer.name):
            if isinstance(module, QuantizedLinear):
                scope = "per-channel" if module.group_size is None else f"group {module.group_size}"
                kind = "sym" if module.symmetric else "asym"
                schemes[name] = f"{_quant_type(module, name)} {scope} {kind}"
            elif isinstance(module, nn.Linear):
                schemes[name] = "FLOAT"
        problems = fused_group_problems(schemes)
        if problems:
            raise QuantizationError(
                f"{self.type_name}: the export would not load in vLLM-Ascend:\n"
                + "\n".join(f"  - {p}" for p in problems)
            )

    def finalize(self, ctx: RunContext) -> None:
        written = set(self.types)
        aliases: dict[str, str] = {}
        seen: dict[tuple[int, tuple[int, ...], torch.dtype], str] = {}
        state = ctx.model.state_dict()
        for name, tensor in state.items():
            if tensor.is_meta:
                # a layer a streamed run released after after_layer wrote it: no storage to
                # compare (every meta tensor has data_ptr 0), and nothing left to write
                if name not in written:
                    raise QuantizationError(f"{name} was released before {self.type_name} wrote it")
                continue
            key = (tensor.data_ptr(), tuple(tensor.shape), tensor.dtype)
            if tensor.numel() and key in seen:
                # Tied weights are stored once, as Hugging Face does, but still described: vLLM-Ascend
                # looks up e.g. "lm_head.weight" in the description even when the head is tied.
                aliases[name] = seen[key]
                continue
            seen[key] = name
            if name not in written:
                self._add(name, tensor, "FLOAT")
        self._close_writer()
        described = {
            **self.types,
            **{alias: self.types[target] for alias, target in aliases.items()},
        }
        order = [n for n in state if n in described]
        order += [n for n in described if n not in state]
        # keyed by the checkpoint's names, as the weights are stored
        description = {ctx.disk_name(name): described[name] for name in order}
        description.update(self._globals())
        (self.directory / self._description_file()).write_text(
            json.dumps(description, indent=4) + "\n", encoding="utf-8"
        )
        copy_model_files(ctx.model_path, self.directory)
        if ctx.config_text is not None:
            stem = safe_file_stem(ctx.model_type, "model_type")
            (self.directory / f"{stem}_best_practice.yaml").write_text(
                ctx.config_text, encoding="utf-8"
            )
        logger.info(
            "%s: %d tensors (%.1f MiB), model_quant_type %s",
            self.type_name,
            len(self.types),
            self.writer.total_bytes / 2**20,
            description["model_quant_type"],
        )

    def _write_module(self, root: nn.Module, prefix: str) -> None:
        for module_name, module in root.named_modules(prefix=prefix.rstrip(".")):
            if not isinstance(module, QuantizedLinear):
                continue
            quant_type = _quant_type(module, module_name)
            weight = module.weight
            if quant_type == "W4A16":
                if weight.shape[1] % 2:
                    raise QuantizationError(
                        f"{module_name}: W4A16 packs two int4 codes per byte along in_features, "
                        f"which is odd ({weight.shape[1]}); exclude this layer or use int8"
                    )
                weight = pack_int4_pairs(weight)
            self._add(f"{module_name}.weight", weight, quant_type)
            self._add(f"{module_name}.weight_scale", module.weight_scale, quant_type)
            self._add(f"{module_name}.weight_offset", module.weight_offset, quant_type)
            if module.bias is not None:
                self._add(f"{module_name}.bias", module.bias.float(), "FLOAT")
            if module.group_size is not None:
                self.group_sizes.add(module.group_size)
        for name, tensor in root.state_dict(prefix=prefix).items():
            if name not in self.types:
                self._add(name, tensor, "FLOAT")

    def _add(self, name: str, tensor: torch.Tensor, quant_type: str) -> None:
        self.writer.add(name, tensor)
        self.types[name] = quant_type

    def _close_writer(self) -> None:
        self.writer.close()

    def _description_file(self) -> str:
        return DESCRIPTION_FILE

    def model_quant_type(self) -> str:
        """The highest-priority type among the written tensors (msModelSlim's rule)."""
        present = set(self.types.values())
        return max(present, key=QUANT_TYPE_PRIORITY.index) if present else "FLOAT"

    def _globals(self) -> dict[str, Any]:
        model_type = self.model_quant_type()
        if len(self.group_sizes) > 1:
            logger.warning(
                "per-group layers use different group sizes %s; the description holds one global "
                "group_size (%d), as msModelSlim writes it",
                sorted(self.group_sizes),
                max(self.group_sizes),
            )
        if self.head is not None:
            kind = self.types[f"{self.head}.weight"]
            logger.warning("%s: %s", self.type_name, HEAD_WARNING.format(head=self.head, kind=kind))
        return {
            "version": DESCRIPTION_VERSION,
            "model_quant_type": model_type,
            "metadata": {},
            "group_size": max(self.group_sizes) if self.group_sizes else 0,
            "optional": {},
        }


def _grouped(row: PlanRow) -> bool:
    """Whether a plan row is per-group (``group_size`` -1 is per-channel)."""
    return row.group_size is not None and row.group_size != -1


def _listing(names: list[str]) -> str:
    more = len(names) - LISTED_MODULES
    return ", ".join(names[:LISTED_MODULES]) + (f" and {more} more" if more > 0 else "")


def _quant_type(module: QuantizedLinear, name: str) -> str:
    """``W8A16`` or ``W4A16`` from the module's bit width; other widths have no Ascend type."""
    quant_type = QUANT_TYPES_BY_BITS.get(module.bits)
    if quant_type is None:
        raise QuantizationError(
            f"{name}: the Ascend format has no weight-only type for int{module.bits}; valid: int8 "
            "(W8A16) and int4 (W4A16). Export other widths with type: compressed_tensors"
        )
    return quant_type
