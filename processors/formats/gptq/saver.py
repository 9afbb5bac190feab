"""``gptq_saver``: GPTQ checkpoints (GPTQModel / AutoGPTQ layout) for vLLM, SGLang, transformers.

Sample yaml::

    spec:
      process:
        - type: linear_quant
          qconfig:
            weight: {scope: per_group, dtype: int4, symmetric: true, method: gptq,
                     ext: {group_size: 128}}
      save:
        - type: gptq_saver
          part_file_size: 4          # GiB per shard; 0 = one model.safetensors
          checkpoint_format: auto    # gptq (v1) when symmetric, gptq_v2 when asymmetric
          strict: false              # true: refuse what vLLM cannot serve instead of warning

Files written (a Hugging Face checkpoint folder):

* ``model-0000i-of-0000N.safetensors`` + ``model.safetensors.index.json`` (or one
  ``model.safetensors`` when ``part_file_size`` is 0);
* ``config.json`` with ``quantization_config``, and the identical ``quantize_config.json``;
* the model's tokenizer / generation files.

Per quantized linear ``P`` (``b`` bits, ``G`` groups): ``P.qweight`` int32 ``[in*b/32, out]``
(unsigned codes packed along the input dimension, least significant bits first), ``P.qzeros`` int32
``[G, out*b/32]`` (unsigned zero points packed along the output dimension; ``gptq`` stores
``(zero - 1) mod 2^b``, ``gptq_v2`` stores ``zero``; ``auto``, the default, writes ``gptq`` for
symmetric and ``gptq_v2`` for asymmetric weights, because v1 cannot store an asymmetric zero point
of 0: ``0 - 1`` wraps to ``2^b - 1``, and the loaders' word-wise ``+0x11111111`` then carries into
the next column), ``P.scales`` float16 ``[G, out]``, ``P.g_idx``
int32 ``[in]`` (always ``i // group_size``, hence ``desc_act: false``) and ``P.bias`` float16.
Dequantization: ``W[o, i] = scales[g, o] * (q[i, o] - zero[g, o])`` with ``g = g_idx[i]``. Every
other tensor keeps its dtype; tied weights are stored once.

The base ``quantization_config`` is the most common scheme (bits, group size, symmetry); modules
quantized otherwise get a positive ``dynamic`` rule, linear layers of the decoder layers left in
float a negative (``-:``) one. Rules are full-name regexes written so that they also match the
names vLLM matches them against: the fused ``qkv_proj`` / ``gate_up_proj`` (and the fused
matrices the model's adapter names, :func:`msquant.plugin.adapter_for`), and the experts
module of an MoE layer (``model.layers.N.mlp.experts``, Mixtral's
``...block_sparse_moe.experts``), which vLLM loads as one FusedMoE layer and looks up by that
name only; one rule per experts module matches that name and every expert linear in it
(GPTQModel's lookup). Layers vLLM fuses, and the experts of one module, must therefore share one
scheme, or the export is refused. When some decoder linears stay in float,
``modules_in_block_to_quantize`` lists the quantized ones (a list of lists of names relative to
the decoder layer, full names where a relative one would also name a float layer, plus
``lm_head`` for a quantized head): transformers + optimum ignore ``dynamic`` and read it (they
keep a linear float unless its name ends with an entry), and vLLM reads it instead of the file
metadata (a linear, or the head, is quantized when an entry is a substring of its name).

Output head (``linear_quant`` with ``lm_head: true``): ``lm_head.qweight/qzeros/scales/g_idx``
like any linear layer, written when the runner's head stage reaches this saver, and
``quantization_config.lm_head: true`` (vLLM and SGLang then load the head, a ``ParallelLMHead``,
with the GPTQ method and apply ``dynamic`` to the name ``lm_head``). A head quantized otherwise
than the base scheme gets its own positive rule ``+:lm_head$``; the head never decides the base
scheme unless nothing else is quantized. A float head is written as ``lm_head.weight`` with
``lm_head: false``. vLLM and SGLang pad the vocabulary to a multiple of 64, so they load a
quantized head only when its vocabulary is one: checked before weights load (a warning, an
error under ``strict: true``).

Consumers (warnings at quant time name them; ``strict: true`` turns the vLLM ones into errors):

* vLLM 0.33 / 0.34 and SGLang serve only 4/8-bit symmetric GPTQ (Marlin kernels); other results point
  to ``type: compressed_tensors``. Marlin takes group sizes -1/32/64/128 only (both engines
  refuse others); vLLM zero-pads layers whose widths are not whole Marlin tiles (out % 64,
  in % 128), SGLang runs Marlin on them unchecked, so such exports are not for SGLang.
* SGLang's GPTQ MoE method ignores ``dynamic``: MoE experts stored otherwise than the base scheme
  (float, other bits) cannot be served there.
* transformers (optimum + gptqmodel) loads every bit width and asymmetric weights, and float
  layers through ``modules_in_block_to_quantize``, but ignores ``dynamic``: exports whose
  quantized layers differ in scheme are for vLLM, SGLang and GPTQModel. It also loads a quantized
  ``lm_head`` and MoE experts without error but randomly initialised (``GPTQModel.load`` and vLLM
  load them; for transformers use ``type: compressed_tensors``).

Lifecycle (:class:`msquant.plugin.Saver`): ``after_layer`` checks and writes the layer's tensors (shard by
shard) and records the scheme of each of its linear layers (for the head stage, the head's);
``finalize`` adds the remaining tensors (embeddings, final norm, a float head) and writes the
configuration files. Resumable: a checkpoint holds the writer's state and the units, names and
format recorded so far. The format's code is in :mod:`msquant.processors.formats.gptq`
(``packer``, ``config``, ``consumers``); this module is the processor around it.
"""

from __future__ import annotations

import logging
from collections.abc import Hashable, Mapping
from typing import Any, Literal

import torch
from pydantic import Field
from torch import nn

from msquant.plugin import (
    DecoderLayer,
    NameSet,
    QuantizationError,
    QuantizedLinear,
    RunContext,
    Saver,
    SaverConfig,
    SaverState,
    adapter_for,
)
from msquant.plugin.export import write_hf_config
from msquant.plugin.model import OutputHeadStage
from msquant.plugin.planning import ModelPlan, PlanReview
from msquant.processors.formats.gptq.config import (
    QUANTIZE_CONFIG_FILE,
    RuleUnit,
    build_quantization_config,
    disk_units,
    head_unit,
)
from msquant.processors.formats.gptq.consumers import (
    DYNAMIC_WARNING,
    SKIPPED_NOTE,
    VOCAB_PADDING,
    VOCAB_WARNING,
    marlin_problem_message,
    sglang_moe_message,
    transformers_random_message,
    vllm_problem_message,
)
from msquant.processors.formats.gptq.packer import check_bits, gptq_module_tensors
from msquant.processors.formats.gptq.scheme import (
    CheckpointFormat,
    CheckpointFormatChoice,
    GPTQScheme,
    LinearLike,
    MaybeScheme,
    listing,
)
from msquant.processors.sglang_limits import sglang_plan_warnings

__all__ = ["GPTQSaverConfig", "GPTQSaver", "GPTQSaverState"]

logger = logging.getLogger(__name__)


class GPTQSaverConfig(SaverConfig):
    """Config of ``gptq_saver``."""

    type: Literal["gptq_saver"] = "gptq_saver"
    checkpoint_format: CheckpointFormatChoice = Field(
        "auto",
        description="`gptq` (v1, AutoGPTQ legacy: qzeros store zero - 1), `gptq_v2` (qzeros "
        "store the zero point; GPTQModel loads asymmetric v2 checkpoints from any quantizer) or "
        "`auto`: v1 when the first quantized layer is symmetric, v2 when it is asymmetric.",
    )
    strict: bool = Field(
        False,
        description="Refuse (instead of warning about) results vLLM cannot serve: asymmetric or "
        "not 4/8-bit weights, a quantized lm_head whose vocabulary is not a multiple of 64 "
        "(checked before weights load).",
    )


class GPTQSaverState(SaverState):
    """The GPTQ saver's record: the rule units of the written layers, the quantizer methods
    seen, the quantized head's unit and the checkpoint format (fixed by ``auto`` at the first
    quantized layer)."""

    units: list[RuleUnit] = Field(default_factory=list)
    methods: NameSet = Field(default_factory=set)
    head_unit: RuleUnit | None = None
    checkpoint_format: CheckpointFormat | None = None


class GPTQSaver(Saver):
    """Writes a GPTQ checkpoint (qweight, qzeros, scales, g_idx) as layers finish."""

    type_name = "gptq_saver"
    config_class = GPTQSaverConfig
    config: GPTQSaverConfig
    state_class = GPTQSaverState
    state: GPTQSaverState
    weights_prefix = "model"

    def prepare(self, ctx: RunContext) -> None:
        choice = self.config.checkpoint_format
        self.state.checkpoint_format = None if choice == "auto" else choice

    def _resolve_format(self, module: QuantizedLinear) -> CheckpointFormat:
        """The checkpoint format, fixed by ``auto`` at the first quantized layer."""
        if self.state.checkpoint_format is None:
            self.state.checkpoint_format = "gptq" if module.symmetric else "gptq_v2"
            logger.info("gptq_saver: checkpoint_format auto -> %s", self.state.checkpoint_format)
        return self.state.checkpoint_format

    def _check_strict(self, units: list[RuleUnit]) -> None:
        if self.config.strict:
            problem = vllm_problem_message(units, self.state.checkpoint_format or "gptq_v2")
            if problem:
                raise QuantizationError(f"gptq_saver (strict): {problem}")

    def check_layer(self, ctx: RunContext, layer: DecoderLayer) -> None:
        """Bit widths, fused groups and (``strict``) what vLLM cannot serve, before anything of
        the layer is written; the layer's rule units (the head's unit) are recorded."""
        if isinstance(layer, OutputHeadStage):
            if isinstance(layer.module, QuantizedLinear):
                unit = head_unit(ctx.disk_name(layer.name), layer.module)
                assert unit.scheme is not None
                check_bits(layer.name, unit.scheme.bits)
                self._check_strict([unit])
                self.state.head_unit = unit
            return
        linears = _layer_linears(layer)
        for name, (scheme, _) in linears.items():
            if scheme is not None:
                check_bits(name, scheme.bits)
        self.check_fused(layer.module, layer.name)
        units = disk_units(ctx.disk_name, layer.name, linears, self.adapter)
        self._check_strict(units)
        self.state.units.extend(units)

    def fused_scheme(self, name: str, module: QuantizedLinear | None) -> tuple[Hashable, str]:
        if module is None:
            return "FLOAT", "not quantized"
        scheme = GPTQScheme.of(module)
        return scheme, scheme.describe()

    def fused_message(self, prefix: str, problems: list[str]) -> str:
        return (
            f"gptq_saver: {prefix}: "
            + "; ".join(problems)
            + " (GPTQ `dynamic` rules reach vLLM through the fused name)"
        )

    def pack(self, ctx: RunContext, name: str, module: QuantizedLinear) -> dict[str, torch.Tensor]:
        return gptq_module_tensors(name, module, self._resolve_format(module))

    def record_quantized(self, name: str, module: QuantizedLinear, packed: list[str]) -> None:
        self.state.methods.add(module.method)

    def finish_layers(self, ctx: RunContext) -> None:
        stray = sorted(
            name
            for name, module in ctx.model.named_modules()
            if isinstance(module, QuantizedLinear) and name not in self.state.quantized
        )
        if stray:
            raise QuantizationError(
                f"gptq_saver: quantized layers outside the decoder layers and the output head "
                f"({listing(stray)}) are not supported"
            )

    def write_config(self, ctx: RunContext) -> None:
        state = self.state
        quantization_config = build_quantization_config(
            state.units, state.checkpoint_format or "gptq", state.methods, state.head_unit
        )
        write_hf_config(
            ctx.model_path,
            self.directory,
            quantization_config,
            {QUANTIZE_CONFIG_FILE: quantization_config},
            config_updates=ctx.config_updates,
        )
        self._warn_consumers(quantization_config)
        logger.info(
            "gptq_saver: %d quantized layers, %d tensors (%.1f MiB), base %s, %d dynamic rule(s)",
            len(state.quantized),
            len(state.written),
            self.writer.total_bytes / 2**20,
            _base(quantization_config).describe(),
            len(quantization_config.get("dynamic", {})),
        )

    def _warn_consumers(self, quantization_config: Mapping[str, Any]) -> None:
        """Warn once per kind about what vLLM / SGLang / transformers will not load."""
        units, head = self.state.units, self.state.head_unit
        every = units + ([head] if head is not None else [])
        problem = vllm_problem_message(every, self.state.checkpoint_format or "gptq")
        if problem:
            logger.warning("gptq_saver: %s", problem)
        base = _base(quantization_config)
        if any(u.scheme is not None and u.scheme != base for u in units):
            logger.warning("gptq_saver: %s", DYNAMIC_WARNING)
        elif "modules_in_block_to_quantize" in quantization_config:
            logger.info("gptq_saver: %s", SKIPPED_NOTE)
        for message in (
            sglang_moe_message(units, base),
            transformers_random_message(units, head),
            marlin_problem_message(every),
        ):
            if message:
                logger.warning("gptq_saver: %s", message)

    def review_plan(self, plan: ModelPlan, model: nn.Module) -> PlanReview:
        """Before weights load: a quantized head whose vocabulary vLLM / SGLang cannot load (an
        error under ``strict``), and what SGLang's model classes cannot load
        (:mod:`msquant.processors.sglang_limits`)."""
        review = PlanReview()
        review.warnings += [
            f"gptq_saver: {message}"
            for message in sglang_plan_warnings(plan, model, compressed_tensors=False)
        ]
        found = adapter_for(model).output_head(model)
        if found is None:
            return review
        name, module = found
        row = next((row for row in plan.rows if row.module == name), None)
        vocab = int(getattr(module, "out_features", 0))
        if row is None or row.skipped or vocab % VOCAB_PADDING == 0:
            return review
        message = VOCAB_WARNING.format(head=name, vocab=vocab)
        if self.config.strict:
            review.errors.append(f"gptq_saver (strict): {message}")
        else:
            review.warnings.append(f"gptq_saver: {message}")
        return review


def _base(quantization_config: Mapping[str, Any]) -> GPTQScheme:
    """The base scheme a written ``quantization_config`` states."""
    return GPTQScheme(
        quantization_config["bits"], quantization_config["group_size"], quantization_config["sym"]
    )


def _layer_linears(layer: DecoderLayer) -> dict[str, tuple[MaybeScheme, LinearLike]]:
    """Every linear layer of ``layer`` (quantized or float) with its scheme, in module order."""
    linears: dict[str, tuple[MaybeScheme, LinearLike]] = {}
    for sub, module in layer.module.named_modules():
        name = f"{layer.name}.{sub}"
        if isinstance(module, QuantizedLinear):
            linears[name] = (GPTQScheme.of(module), module)
        elif isinstance(module, nn.Linear):
            linears[name] = (None, module)
    return linears
