"""``compressed_tensors``: a Hugging Face checkpoint in compressed-tensors ``pack-quantized`` format.

Sample yaml::

    spec:
      process:
        - type: linear_quant
          qconfig:
            weight: {scope: per_group, dtype: int4, symmetric: true, method: minmax,
                     ext: {group_size: 32}}
      save:
        - type: compressed_tensors
          part_file_size: 4   # GiB per shard; 0 = one model.safetensors

Files written: ``model.safetensors`` (or ``model-0000i-of-0000N.safetensors`` plus
``model.safetensors.index.json``), the model's config/tokenizer files, and ``config.json`` carrying
a ``quantization_config`` with ``quant_method: compressed-tensors``.

Per quantized linear ``P`` (weight-only int, 2 to 8 bits, int8 included: compressed-tensors' own
format inference picks ``pack-quantized`` for every weight-only int scheme):

* ``P.weight_packed`` int32 ``[out, ceil(in * b / 32)]``: unsigned codes ``q + 2^(b-1)`` packed
  densely along the input dimension, least significant bits first;
* ``P.weight_scale`` ``[out, G]`` in the dtype of the float weight it replaced (``G = 1``
  per-channel, ``in / group_size`` per-group);
* ``P.weight_shape`` int64 ``[2]`` = ``[out, in]``;
* asymmetric only: ``P.weight_zero_point`` int32 ``[ceil(out * b / 32), G]``, unsigned zero points
  packed along the *output* dimension;
* ``P.bias`` (if any) in the same dtype as the scale.

Dequantization: ``w = (unsigned_code - unsigned_zero) * scale`` (zero ``2^(b-1)`` when symmetric).
Other tensors keep their dtype; tied weights are stored once.

With ``linear_quant``'s ``qconfig.act`` (int8 W8A8 for vLLM's ``CompressedTensorsW8A8Int8``: int8
per-channel symmetric weights with per-token dynamic or calibrated per-tensor static activations,
format ``int-quantized``, the layout llm-compressor 0.14 writes for the same scheme):

* ``P.weight`` int8 ``[out, in]`` (signed codes), ``P.weight_scale`` float32 ``[out, 1]``;
* static activations: ``P.input_scale`` float32 ``[1]`` and, when asymmetric,
  ``P.input_zero_point`` int8 ``[1]`` (``x ~ (q_x - zero_point) * input_scale``);
* the group's ``input_activations``: ``{num_bits: 8, type: int, symmetric, strategy: token,
  dynamic: true}`` or ``{..., strategy: tensor, dynamic: false}``.

vLLM loads one input scale (and zero point) per fused layer (q/k/v, gate/up): the shards must
hold equal ones, which they do when they read the same input (checked; refused otherwise).
SGLang 0.5.23 loads these layers but quantizes activations per token whatever is stored, and
refuses int8 W8A8 MoE experts on GPUs (warned at plan time: :mod:`msquant.processors.sglang_limits`).
int4 weights with int8 activations (W4A8_DYNAMIC) are refused at plan time: export them with
``ascendv1_saver``.

MX layers (W8A8_MXFP8, W4A4_MXFP4; the groups are compressed-tensors' ``MXFP8`` / ``MXFP4``
presets, formats ``mxfp8-quantized`` / ``mxfp4-pack-quantized``): ``P.weight`` ``float8_e4m3fn``
``[out, in]`` (MXFP8) or ``P.weight_packed`` uint8 ``[out, in / 2]`` (MXFP4, element ``2i`` in the
low nibble), ``P.weight_scale`` uint8 E8M0 ``[out, in / 32]``. vLLM 0.33 / 0.34 quantize their
activations only on SM100+ GPUs (warned at plan time); W4A8_MXFP is refused at plan time (no
engine reads it from compressed-tensors as MXFP8 activations; docs/formats.md, MX).

``quantization_config``: one ``config_groups`` entry per distinct scheme (bits, symmetry,
channel/group, group size, and ``actorder: "weight"`` for modules GPTQ solved in act-order).
The most common scheme targets the class ``Linear``; the others list
their exact module names, which take precedence over class targets in compressed-tensors and vLLM.
Every ``nn.Linear`` left unquantized (``lm_head`` included) and every MoE router is listed by name
in ``ignore``: transformers 5's routers are not ``nn.Linear`` (``Qwen3MoeTopKRouter``), but vLLM
builds Qwen3-MoE's ``mlp.gate`` as a linear layer that takes the ``Linear`` target unless ignored,
and then finds no packed router weight (llm-compressor's MoE recipes ignore the routers too).
Layers that vLLM fuses (q/k/v, gate/up) must share one scheme, or the export is refused.

A head quantized with ``linear_quant``'s ``lm_head: true`` is packed like any linear (written when
the runner's head stage reaches this saver) and always named in the targets of its config group
(before ``Linear`` when it shares the most common scheme): vLLM 0.33 / 0.34 and SGLang give the head, a
``ParallelLMHead``, a compressed-tensors scheme only when a target names it, and transformers
matches it either way. It is not in ``ignore``.

Which consumer loads what (compressed-tensors 0.20.1, transformers 5.24, vLLM 0.33 / 0.34, SGLang 0.5.23):

* vLLM: symmetric and asymmetric, 2-8 bits, channel or group (``CompressedTensorsWNA16``), mixed
  precision included, a named quantized head included.
* SGLang: weight-only 4 and 8 bits only (its WNA16 scheme refuses other widths); a warning lists
  the layers of other widths.
* int3/5/6/7 are packed densely across int32 words, the layout of compressed-tensors 0.18 and
  later; compressed-tensors 0.17 (the version vLLM 0.33 / 0.34 pin) packs those widths otherwise, and
  transformers with it fails to load such an export. A warning says so (2, 4 and 8 bits pack the
  same in every version).
* transformers (+ ``compressed-tensors``): symmetric with the default loader
  (``AutoModelForCausalLM.from_pretrained(path)``); asymmetric only with
  ``quantization_config=CompressedTensorsConfig(dequantize=True)`` (the default loader expects an
  unpacked zero point); mixed precision (several groups) only with the default loader
  (``dequantize=True`` decompresses every layer with one group's scheme and fails), hence only when
  every group is symmetric.

Lifecycle: ``setup`` records the float dtype of every linear; ``after_layer`` checks the layer's
fused groups and queues its tensors (written shard by shard; the head stage alike); ``finalize``
adds the remaining tensors, refuses an export with nothing quantized, and writes ``config.json``.
Resumable: a checkpoint holds the writer's state and the schemes recorded so far. The format's
code is in :mod:`msquant.processors.formats.compressed_tensors` (``packer``, ``config``,
``consumers``); this module is the processor around it (:class:`msquant.plugin.Saver`).
"""

from __future__ import annotations

import logging
from collections.abc import Hashable
from typing import Literal

import torch
from pydantic import Field
from torch import nn

from msquant.plugin import QuantizedLinear, RunContext, Saver, SaverConfig, SaverState
from msquant.plugin.export import write_hf_config
from msquant.plugin.numerics import value_type_named
from msquant.plugin.planning import ModelPlan, PlanReview
from msquant.processors.formats.compressed_tensors.config import (
    MX_FORMATS,
    WeightScheme,
    build_quantization_config,
)
from msquant.processors.formats.compressed_tensors.consumers import (
    activation_warnings,
    consumer_warnings,
    mx_plan_findings,
    transformers_loading_note,
)
from msquant.processors.formats.compressed_tensors.packer import (
    pack_float_quantized_tensors,
    pack_int_quantized_tensors,
    pack_mx_tensors,
    pack_quantized_tensors,
)
from msquant.processors.sglang_limits import sglang_plan_warnings

__all__ = ["CompressedTensorsSaverConfig", "CompressedTensorsSaver", "CompressedTensorsSaverState"]

logger = logging.getLogger(__name__)

UNQUANTIZED = "unquantized"


class CompressedTensorsSaverConfig(SaverConfig):
    """Config of ``compressed_tensors``."""

    type: Literal["compressed_tensors"] = "compressed_tensors"


class CompressedTensorsSaverState(SaverState):
    """The compressed-tensors saver's record: the scheme of every quantized linear written."""

    schemes: dict[str, WeightScheme] = Field(default_factory=dict)


class CompressedTensorsSaver(Saver):
    """A compressed-tensors checkpoint (int, FP8, MX) for vLLM, vLLM-Ascend and transformers.

    ``pack-quantized`` int 2-8 bit, int8 / FP8 W8A8, MXFP8 / MXFP4 (module docstring)."""

    type_name = "compressed_tensors"
    config_class = CompressedTensorsSaverConfig
    config: CompressedTensorsSaverConfig
    state_class = CompressedTensorsSaverState
    state: CompressedTensorsSaverState
    weights_prefix = "model"
    #: int8 W8A8 (vLLM's CompressedTensorsW8A8Int8); W4A8_DYNAMIC is refused at plan time.
    writes_activations = True
    #: MX: W8A8_MXFP8 (``mxfp8-quantized``) and W4A4_MXFP4 (``mxfp4-pack-quantized``); not
    #: W4A8_MXFP (mxfp4 weights, mxfp8 activations), which no engine reads as such from
    #: compressed-tensors (``consumers.W4A8_MXFP_REFUSAL``).
    activation_schemes = ("W8A8", "W8A8_DYNAMIC", "WFP8AFP8_DYNAMIC", "W8A8_MXFP8", "W4A4_MXFP4")
    #: Integer codes, FP8 (``float-quantized``) and MX (``mxfp8-quantized``,
    #: ``mxfp4-pack-quantized``).
    value_families = ("int", "fp8", "mx")

    def prepare(self, ctx: RunContext) -> None:
        # The float dtype each linear had before quantization: scales and bias are stored in it.
        # Not checkpointed: a resumed run calls setup on the float model too, so they are equal.
        self.float_dtypes: dict[str, torch.dtype] = {
            name: module.weight.dtype
            for name, module in ctx.model.named_modules()
            if isinstance(module, nn.Linear)
        }
        self.default_dtype = _float_dtype(ctx.model)

    def pack(self, ctx: RunContext, name: str, module: QuantizedLinear) -> dict[str, torch.Tensor]:
        dtype = self.float_dtypes.get(name, self.default_dtype)
        if module.value_type.family == "fp8":
            return pack_float_quantized_tensors(name, module.qweight, module.bias, dtype)
        if module.value_type.family == "mx":
            return pack_mx_tensors(name, module.qweight, module.act, module.bias, dtype)
        if module.act is not None:
            return pack_int_quantized_tensors(name, module.qweight, module.act, module.bias, dtype)
        return pack_quantized_tensors(name, module.qweight, module.bias, dtype)

    def record_quantized(self, name: str, module: QuantizedLinear, packed: list[str]) -> None:
        self.state.schemes[name] = WeightScheme.of(module)

    def fused_scheme(self, name: str, module: QuantizedLinear | None) -> tuple[Hashable, str]:
        if module is None:
            return UNQUANTIZED, UNQUANTIZED
        scheme = WeightScheme.of(module)
        act = module.act
        if act is None or act.dynamic:
            return scheme, str(scheme)
        # vLLM loads one static input scale / zero point per fused layer
        return (scheme, act.scale, act.offset), (
            f"{scheme} input_scale {act.scale:.6g} zero_point {act.offset:g}"
        )

    def fused_message(self, prefix: str, problems: list[str]) -> str:
        return "compressed_tensors: vLLM requires one scheme per fused layer: " + "; ".join(
            problems
        )

    def finish_layers(self, ctx: RunContext) -> None:
        """Quantized linears outside the decoder layers (checked and packed like the others)."""
        self.check_fused(ctx.model, "")
        self.write_quantized(ctx, ctx.model, "")

    def write_config(self, ctx: RunContext) -> None:
        schemes, head = self.state.schemes, self.state.head
        routers = self.adapter.routers(ctx.model)
        ignore = [
            name
            for name, module in ctx.model.named_modules()
            if (isinstance(module, nn.Linear) or name in routers) and name not in schemes
        ]
        # targets and ignore name modules as the checkpoint (and vLLM's model) does
        quantization_config = build_quantization_config(
            {ctx.disk_name(name): scheme for name, scheme in schemes.items()},
            [ctx.disk_name(name) for name in ignore],
            None if head is None else ctx.disk_name(head),
        )
        write_hf_config(
            ctx.model_path, self.directory, quantization_config, config_updates=ctx.config_updates
        )
        logger.info(
            "compressed_tensors: %d quantized linear(s) in %d config group(s), %d ignored, "
            "%.1f MiB",
            len(schemes),
            len(quantization_config["config_groups"]),
            len(ignore),
            self.writer.total_bytes / 2**20,
        )
        logger.info("compressed_tensors: %s", transformers_loading_note(schemes.values()))
        on_disk = {ctx.disk_name(name): scheme for name, scheme in schemes.items()}
        for message in consumer_warnings(on_disk) + activation_warnings(on_disk):
            logger.warning("compressed_tensors: %s", message)

    def review_plan(self, plan: ModelPlan, model: nn.Module) -> PlanReview:
        """Before weights load: what SGLang's model classes cannot load from this export
        (:mod:`msquant.processors.sglang_limits`), what vLLM computes otherwise for MX layers
        (warned), the MX scheme no engine reads from compressed-tensors (W4A8_MXFP, refused;
        :func:`~msquant.processors.formats.compressed_tensors.consumers.mx_plan_findings`) and
        MX value types without a compressed-tensors format (a value type added later, refused
        rather than written under another type's format)."""
        acts = {
            row.module: row.act
            for row in plan.rows
            if not row.skipped and row.act is not None and row.value_type in MX_FORMATS
        }
        errors, mx_warnings = mx_plan_findings(acts)
        other_mx = sorted(
            {
                row.value_type
                for row in plan.rows
                if not row.skipped
                and row.value_type is not None
                and row.value_type not in MX_FORMATS
                and value_type_named(row.value_type).family == "mx"
            }
        )
        if other_mx:
            errors.append(
                f"{', '.join(other_mx)} codes have no compressed-tensors format (it writes "
                f"{', '.join(f'{k} as {v}' for k, v in MX_FORMATS.items())}, the formats vLLM "
                "and vLLM-Ascend read); export them with type: ascendv1_saver"
            )
        warnings = sglang_plan_warnings(plan, model, compressed_tensors=True) + mx_warnings
        return PlanReview(
            errors=[f"compressed_tensors: {message}" for message in errors],
            warnings=[f"compressed_tensors: {message}" for message in warnings],
        )


def _float_dtype(model: nn.Module) -> torch.dtype:
    """The dtype of the model's first floating-point parameter (float32 if it has none)."""
    for parameter in model.parameters():
        if parameter.dtype.is_floating_point:
            return parameter.dtype
    return torch.float32
