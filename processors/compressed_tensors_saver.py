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
(before ``Linear`` when it shares the most common scheme): vLLM 0.33 and SGLang give the head, a
``ParallelLMHead``, a compressed-tensors scheme only when a target names it, and transformers
matches it either way. It is not in ``ignore``.

Which consumer loads what (compressed-tensors 0.20.1, transformers 5.24, vLLM 0.33, SGLang 0.5.23):

* vLLM: symmetric and asymmetric, 2-8 bits, channel or group (``CompressedTensorsWNA16``), mixed
  precision included, a named quantized head included.
* SGLang: weight-only 4 and 8 bits only (its WNA16 scheme refuses other widths); a warning lists
  the layers of other widths.
* int3/5/6/7 are packed densely across int32 words, the layout of compressed-tensors 0.18 and
  later; compressed-tensors 0.17 (the version vLLM 0.33 pins) packs those widths otherwise, and
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
Resumable: a checkpoint holds the writer's state and the schemes recorded so far.
"""

from __future__ import annotations

import dataclasses
import logging
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import torch
from pydantic import Field
from torch import nn

from msquant import (
    DecoderLayer,
    ModelPlan,
    OutputHeadStage,
    PlanReview,
    Processor,
    ProcessorConfig,
    QuantizationError,
    QuantizedLinear,
    QuantizedWeight,
    RunContext,
    ShardedSafetensorsWriter,
    fused_group_problems,
    hf_weights_writer,
    moe_routers,
    pack_int32,
    unique_state_items,
    write_hf_config,
)
from msquant.processors.sglang_limits import sglang_plan_warnings

__all__ = [
    "COMPRESSED_TENSORS_VERSION",
    "CompressedTensorsSaverConfig",
    "CompressedTensorsSaver",
    "WeightScheme",
    "pack_quantized_tensors",
    "build_quantization_config",
    "transformers_loading_note",
    "consumer_warnings",
]

logger = logging.getLogger(__name__)

#: The compressed-tensors release this layout and config were verified against (written as
#: ``version``; compressed-tensors itself is only a test dependency).
COMPRESSED_TENSORS_VERSION = "0.20.1"
FORMAT = "pack-quantized"
#: compressed-tensors' ``actorder`` for GPTQ act-order with static groups (alias ``static``):
#: accepted by compressed-tensors 0.20 and vLLM 0.33, which need no ``g_idx`` for it.
ACTORDER_WEIGHT = "weight"
MIN_BITS, MAX_BITS = 2, 8
UNQUANTIZED = "unquantized"
#: Widths SGLang's compressed-tensors WNA16 scheme loads.
SGLANG_BITS = (4, 8)
#: Widths whose dense packing (across int32 words) needs compressed-tensors >= 0.18.
DENSE_PACKING_BITS = (3, 5, 6, 7)
SGLANG_BITS_WARNING = (
    "SGLang 0.5.23 loads compressed-tensors weight-only layers of 4 or 8 bits only; these layers "
    "are {kinds} and do not load there: {names} (vLLM loads 2-8 bits)"
)
PACKING_WARNING = (
    "{kinds} layers are packed densely across int32 words, the layout of compressed-tensors 0.18 "
    "and later; compressed-tensors 0.17 and earlier pack {widths}-bit weights otherwise, and vLLM "
    "0.33 pins compressed-tensors 0.17.0: a loader that unpacks with compressed-tensors 0.17 "
    "(transformers with it fails to load this export) needs compressed-tensors >= 0.18 installed; "
    "vLLM 0.33 creates parameters of the dense shapes for these widths (its kernels were not run "
    "on them here); 4 or 8 bits avoid both: {names}"
)


class CompressedTensorsSaverConfig(ProcessorConfig):
    """Config of ``compressed_tensors``."""

    type: Literal["compressed_tensors"] = "compressed_tensors"
    part_file_size: int = Field(4, ge=0, description="Shard size in GiB; 0 writes a single file.")


@dataclass(frozen=True)
class WeightScheme:
    """One weight quantization scheme: what a compressed-tensors config group describes.

    :param num_bits: code width.
    :param symmetric: no zero point stored.
    :param group_size: group width over input columns, or ``None`` for per-channel.
    :param actorder: ``"weight"`` when GPTQ quantized the modules in act-order with static
        groups (compressed-tensors' and llm-compressor's name; the stored layout is unchanged,
        there is no ``g_idx``), else None.
    """

    num_bits: int
    symmetric: bool
    group_size: int | None
    actorder: str | None = None

    @classmethod
    def of(cls, module: QuantizedLinear) -> WeightScheme:
        """The scheme of a quantized linear."""
        actorder = ACTORDER_WEIGHT if getattr(module, "act_order", False) else None
        return cls(module.bits, module.symmetric, module.group_size, actorder)

    @property
    def strategy(self) -> str:
        """compressed-tensors' ``strategy``: ``channel`` or ``group``."""
        return "channel" if self.group_size is None else "group"

    def weights_args(self) -> dict[str, Any]:
        """The ``weights`` entry of a config group (valid ``QuantizationArgs`` keys only)."""
        args: dict[str, Any] = {
            "num_bits": self.num_bits,
            "type": "int",
            "symmetric": self.symmetric,
            "strategy": self.strategy,
        }
        if self.group_size is not None:
            args["group_size"] = self.group_size
        args["dynamic"] = False
        if self.actorder is not None:
            args["actorder"] = self.actorder
        return args

    def __str__(self) -> str:
        scope = "per_channel" if self.group_size is None else f"per_group({self.group_size})"
        order = f" actorder {self.actorder}" if self.actorder else ""
        return f"int{self.num_bits} {scope} {'sym' if self.symmetric else 'asym'}{order}"


def _checked_scale(name: str, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``scale`` cast to ``dtype``, refusing values that overflow or flush to zero there."""
    cast = scale.to(dtype)
    lost = ~torch.isfinite(cast) | ((cast == 0) & (scale != 0))
    if bool(lost.any()):
        bad = scale[lost]
        raise QuantizationError(
            f"{name}: {int(lost.sum())} weight scale(s) (e.g. {float(bad[0]):.3g}) are not "
            f"representable in the model dtype {dtype} that compressed-tensors stores scales in; "
            "exclude this layer or export from a float32 / bfloat16 copy of the model"
        )
    return cast


def pack_quantized_tensors(
    name: str, qweight: QuantizedWeight, bias: torch.Tensor | None, dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    """The ``pack-quantized`` tensors of one quantized linear ``name`` (pure; inputs unchanged).

    :param dtype: the float dtype of the weight this linear replaced (scales and bias use it).
    :raises QuantizationError: for a bit width outside 2-8, scales not representable in ``dtype``,
        or zero points that are not integers in the code range.
    """
    bits = qweight.bits
    if not MIN_BITS <= bits <= MAX_BITS:
        raise QuantizationError(
            f"{name}: compressed-tensors pack-quantized stores {MIN_BITS}-{MAX_BITS} bit weights, "
            f"got int{bits}"
        )
    tensors = {
        f"{name}.weight_packed": pack_int32(qweight.unsigned_codes(), bits, dim=1),
        f"{name}.weight_scale": _checked_scale(name, qweight.scale, dtype),
        f"{name}.weight_shape": torch.tensor(qweight.shape, dtype=torch.int64),
    }
    if not qweight.symmetric:
        try:
            zero_points = qweight.unsigned_zero_points()
        except ValueError as exc:
            raise QuantizationError(f"{name}: {exc}") from exc
        tensors[f"{name}.weight_zero_point"] = pack_int32(zero_points, bits, dim=0)
    if bias is not None:
        tensors[f"{name}.bias"] = bias.detach().to(dtype)
    return tensors


def build_quantization_config(
    schemes: Mapping[str, WeightScheme], ignore: Iterable[str], head: str | None = None
) -> dict[str, Any]:
    """``config.json``'s ``quantization_config`` for quantized modules ``schemes`` (name -> scheme).

    The most common scheme (ties: the first met) targets the class ``Linear``; every other scheme
    lists its modules by exact name, which wins over a class target in compressed-tensors and vLLM.
    The named groups come first: compressed-tensors scans targets in config order when it applies
    the config, and warns about exact names it never reached behind ``Linear``. For the same reason
    a quantized output head sharing the most common scheme is named before ``Linear``: vLLM and
    SGLang quantize the head only when a target names it.

    :param schemes: quantized module name -> scheme, in model order.
    :param ignore: names of the linear layers (and routers) left unquantized.
    :param head: the quantized output head's name (one of ``schemes``), None when it is float.
    :raises QuantizationError: when ``schemes`` is empty.
    """
    if not schemes:
        raise QuantizationError(
            "compressed_tensors: no linear layer was quantized, so there is nothing to export in "
            "compressed-tensors format; add a linear_quant process entry that selects some layers"
        )
    ranked = [scheme for scheme, _ in Counter(schemes.values()).most_common()]
    targets: dict[WeightScheme, list[str]] = {
        scheme: [name for name, found in schemes.items() if found == scheme]
        for scheme in ranked[1:]
    }
    base = ranked[0]
    targets[base] = [head] if head is not None and schemes.get(head) == base else []
    targets[base].append("Linear")
    groups = {
        f"group_{index}": {
            "targets": names,
            "weights": scheme.weights_args(),
            "input_activations": None,
            "output_activations": None,
            "format": FORMAT,
        }
        for index, (scheme, names) in enumerate(targets.items())
    }
    return {
        "quant_method": "compressed-tensors",
        "version": COMPRESSED_TENSORS_VERSION,
        "format": FORMAT,
        "quantization_status": "compressed",
        "global_compression_ratio": None,
        "kv_cache_scheme": None,
        "sparsity_config": {},
        "ignore": list(ignore),
        "config_groups": groups,
    }


class CompressedTensorsSaver(Processor):
    """A compressed-tensors ``pack-quantized`` checkpoint (int 2-8 bit) for vLLM and transformers."""

    type_name = "compressed_tensors"
    config_class = CompressedTensorsSaverConfig
    stage = "save"
    config: CompressedTensorsSaverConfig
    resumable = True

    def setup(self, ctx: RunContext) -> None:
        # tensors are recorded under the model's names and stored under the checkpoint's
        self.writer: ShardedSafetensorsWriter = hf_weights_writer(
            self.output_dir(ctx), self.config.part_file_size, rename=ctx.disk_name
        )
        # The float dtype each linear had before quantization: scales and bias are stored in it.
        self.float_dtypes: dict[str, torch.dtype] = {
            name: module.weight.dtype
            for name, module in ctx.model.named_modules()
            if isinstance(module, nn.Linear)
        }
        self.default_dtype = _float_dtype(ctx.model)
        self.schemes: dict[str, WeightScheme] = {}
        self.handled: set[str] = set()  # state-dict names written or replaced by packed tensors
        self.head: str | None = None  # the output head, when its stage ran quantized

    def after_layer(self, ctx: RunContext, layer: DecoderLayer) -> None:
        if isinstance(layer, OutputHeadStage) and isinstance(layer.module, QuantizedLinear):
            self.head = layer.name
        self._check_fused(layer.module, layer.name)
        self._write_quantized(layer.module, layer.name)
        self._write_rest(layer.module.state_dict(prefix=f"{layer.name}."))

    def resume_state(self, ctx: RunContext) -> dict[str, Any]:
        # float_dtypes and default_dtype come from the float model in setup, which a resumed run
        # calls before it rebuilds the finished layers: the same values
        return {
            "writer": self.writer.state(),
            "schemes": {name: dataclasses.asdict(s) for name, s in self.schemes.items()},
            "handled": sorted(self.handled),
            "head": self.head,
        }

    def restore(self, ctx: RunContext, state: dict[str, Any]) -> None:
        self.writer.restore(state["writer"])
        self.schemes = {name: WeightScheme(**s) for name, s in state["schemes"].items()}
        self.handled = set(state["handled"])
        self.head = state["head"]

    def finalize(self, ctx: RunContext) -> None:
        self._check_fused(ctx.model, "")
        self._write_quantized(ctx.model, "")  # quantized linears outside the decoder layers
        routers = moe_routers(ctx.model)
        ignore = [
            name
            for name, module in ctx.model.named_modules()
            if (isinstance(module, nn.Linear) or name in routers) and name not in self.schemes
        ]
        # targets and ignore name modules as the checkpoint (and vLLM's model) does
        quantization_config = build_quantization_config(
            {ctx.disk_name(name): scheme for name, scheme in self.schemes.items()},
            [ctx.disk_name(name) for name in ignore],
            None if self.head is None else ctx.disk_name(self.head),
        )
        self._write_rest(dict(unique_state_items(ctx.model)))
        self.writer.close()
        write_hf_config(ctx.model_path, self.output_dir(ctx), quantization_config)
        logger.info(
            "compressed_tensors: %d quantized linear(s) in %d config group(s), %d ignored, "
            "%.1f MiB",
            len(self.schemes),
            len(quantization_config["config_groups"]),
            len(ignore),
            self.writer.total_bytes / 2**20,
        )
        logger.info("compressed_tensors: %s", transformers_loading_note(self.schemes.values()))
        for message in consumer_warnings(
            {ctx.disk_name(name): scheme for name, scheme in self.schemes.items()}
        ):
            logger.warning("compressed_tensors: %s", message)

    def review_plan(self, plan: ModelPlan, model: nn.Module) -> PlanReview:
        """Before weights load: what SGLang's model classes cannot load from this export
        (:mod:`msquant.processors.sglang_limits`)."""
        warnings = sglang_plan_warnings(plan, model, compressed_tensors=True)
        return PlanReview(warnings=[f"compressed_tensors: {message}" for message in warnings])

    def _check_fused(self, root: nn.Module, prefix: str) -> None:
        """Refuse shards of one vLLM-fused matrix that differ in scheme (or in being skipped)."""
        schemes: dict[str, WeightScheme | str] = {}
        for name, module in root.named_modules(prefix=prefix):
            if isinstance(module, QuantizedLinear):
                schemes[name] = WeightScheme.of(module)
            elif isinstance(module, nn.Linear):
                schemes[name] = UNQUANTIZED
        problems = fused_group_problems(schemes)
        if problems:
            raise QuantizationError(
                "compressed_tensors: vLLM requires one scheme per fused layer: "
                + "; ".join(problems)
            )

    def _write_quantized(self, root: nn.Module, prefix: str) -> None:
        """Queue the packed tensors of every quantized linear under ``root`` not yet written."""
        for name, module in root.named_modules(prefix=prefix):
            if not isinstance(module, QuantizedLinear) or name in self.schemes:
                continue
            dtype = self.float_dtypes.get(name, self.default_dtype)
            packed = pack_quantized_tensors(name, module.qweight, module.bias, dtype)
            for tensor_name, tensor in packed.items():
                self.writer.add(tensor_name, tensor)
            self.schemes[name] = WeightScheme.of(module)
            # The module's own state (int8 weight, float32 scale/offset) is replaced by ``packed``.
            self.handled.update(f"{name}.{key}" for key in module.state_dict())
            self.handled.update(packed)

    def _write_rest(self, state: Mapping[str, torch.Tensor]) -> None:
        """Queue, as they are, the tensors of ``state`` not written or replaced yet."""
        for name, tensor in state.items():
            if name not in self.handled:
                self.writer.add(name, tensor)
                self.handled.add(name)


def transformers_loading_note(schemes: Iterable[WeightScheme]) -> str:
    """How transformers can load an export holding ``schemes`` (formats.md 4.1; vLLM loads all)."""
    distinct = set(schemes)
    symmetric = all(scheme.symmetric for scheme in distinct)
    if symmetric:
        return "transformers loads it with AutoModelForCausalLM.from_pretrained(path)"
    if len(distinct) == 1:
        return (
            "asymmetric: transformers loads it only with "
            "quantization_config=CompressedTensorsConfig(dequantize=True)"
        )
    return (
        "asymmetric mixed precision: transformers cannot load it (its default loader rejects "
        "packed zero points; dequantize=True decompresses every layer with one group's scheme); "
        "vLLM can"
    )


def _listing(names: list[str], shown: int = 6) -> str:
    more = len(names) - shown
    return ", ".join(names[:shown]) + (f" and {more} more" if more > 0 else "")


def consumer_warnings(schemes: Mapping[str, WeightScheme]) -> list[str]:
    """What SGLang and compressed-tensors 0.17 (pinned by vLLM 0.33) do not load among the
    quantized modules ``schemes`` (name -> scheme, in model order)."""
    warnings = []
    odd = {name: s for name, s in schemes.items() if s.num_bits not in SGLANG_BITS}
    if odd:
        kinds = ", ".join(sorted({f"int{s.num_bits}" for s in odd.values()}))
        warnings.append(SGLANG_BITS_WARNING.format(kinds=kinds, names=_listing(list(odd))))
    dense = {name: s for name, s in schemes.items() if s.num_bits in DENSE_PACKING_BITS}
    if dense:
        widths = sorted({s.num_bits for s in dense.values()})
        warnings.append(
            PACKING_WARNING.format(
                kinds=", ".join(f"int{b}" for b in widths),
                widths="/".join(str(b) for b in widths),
                names=_listing(list(dense)),
            )
        )
    return warnings


def _float_dtype(model: nn.Module) -> torch.dtype:
    """The dtype of the model's first floating-point parameter (float32 if it has none)."""
    for parameter in model.parameters():
        if parameter.dtype.is_floating_point:
            return parameter.dtype
    return torch.float32
