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
names vLLM matches them against: the fused ``qkv_proj`` / ``gate_up_proj``, and the experts
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

* vLLM 0.33 and SGLang serve only 4/8-bit symmetric GPTQ (Marlin kernels); other results point
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

Lifecycle: ``after_layer`` checks and writes the layer's tensors (shard by shard) and records the
scheme of each of its linear layers (for the head stage, the head's); ``finalize`` adds the
remaining tensors (embeddings, final norm, a float head) and writes the configuration files.
Resumable: a checkpoint holds the writer's state and the units, names and format recorded so far.
"""

from __future__ import annotations

import dataclasses
import logging
import re
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import torch
from pydantic import Field
from torch import nn

import msquant
from msquant import (
    DecoderLayer,
    ModelPlan,
    OutputHeadStage,
    PlanReview,
    Processor,
    ProcessorConfig,
    QuantizationError,
    QuantizedLinear,
    RunContext,
    ShardedSafetensorsWriter,
    find_output_head,
    fused_group_problems,
    fused_groups,
    hf_weights_writer,
    pack_int32,
    parse_expert_linear,
    unique_state_items,
    write_hf_config,
)
from msquant.processors.sglang_limits import sglang_plan_warnings

__all__ = [
    "GPTQSaverConfig",
    "GPTQSaver",
    "GPTQScheme",
    "gptq_module_tensors",
    "head_unit",
    "build_quantization_config",
    "modules_in_block_to_quantize",
]

logger = logging.getLogger(__name__)

CheckpointFormat = Literal["gptq", "gptq_v2"]
CheckpointFormatChoice = Literal["auto", "gptq", "gptq_v2"]

QUANTIZE_CONFIG_FILE = "quantize_config.json"
SUPPORTED_BITS = (2, 3, 4, 8)
#: Bit widths GPTQModel stores only in its planar ``gptq_p`` format.
PLANAR_BITS = (5, 6, 7)
#: (bits, sym) pairs vLLM 0.33 / SGLang serve from a GPTQ checkpoint (``uint4b8``, ``uint8b128``).
VLLM_BITS = (4, 8)
MARLIN_OUT_MULTIPLE = 64
MARLIN_IN_MULTIPLE = 128
MARLIN_GROUP_SIZES = (-1, 32, 64, 128)
#: How many offending modules a warning lists before "and N more".
LISTED_MODULES = 6
CT_ALTERNATIVE = (
    "use `type: compressed_tensors` instead (pack-quantized, which vLLM serves asymmetric and "
    "2-8 bit)"
)

#: vLLM / SGLang pad the vocabulary to a multiple of this; a quantized head of another size does
#: not load into the padded parameters (``vocab_parallel_embedding.py``'s weight loader).
VOCAB_PADDING = 64

DYNAMIC_WARNING = (
    "the layers are not all quantized alike, so the checkpoint carries GPTQModel `dynamic` rules "
    "with other bits / group sizes / symmetry; vLLM, SGLang and GPTQModel apply them, but "
    "transformers (optimum) ignores them and expects every quantized linear layer of the decoder "
    "layers in the base scheme, so it cannot load this checkpoint; for transformers use "
    "`type: compressed_tensors`"
)

SKIPPED_NOTE = (
    "some linear layers of the decoder layers stay in float: `-:` rules in `dynamic` (vLLM, "
    "SGLang, GPTQModel) and the quantized ones in modules_in_block_to_quantize (transformers + "
    "optimum, vLLM)"
)

SGLANG_MOE_WARNING = (
    "the MoE experts of {experts} are stored {what}, which only `dynamic` rules say; SGLang's "
    "GPTQ MoE method ignores `dynamic` and builds every experts module with the base scheme "
    "({base}), then skips the checkpoint tensors that do not fit, serving uninitialised experts: "
    "SGLang cannot serve this checkpoint (vLLM and GPTQModel.load read the rules)"
)

TRANSFORMERS_RANDOM_WARNING = (
    "transformers + optimum (gptqmodel) load this checkpoint without an error but leave {what} "
    "randomly initialised (optimum replaces only the nn.Linear layers of the decoder layers; "
    "transformers 5 MoE experts are not nn.Linear): GPTQModel.load and vLLM load {them} "
    "correctly; for transformers export `type: compressed_tensors`, which transformers loads "
    "{them} from"
)

VOCAB_WARNING = (
    "{head} is quantized, but its {vocab} output rows (the vocabulary) are not a multiple of "
    f"{VOCAB_PADDING}: vLLM and SGLang pad the vocabulary to a multiple of {VOCAB_PADDING} and "
    "cannot load GPTQ head tensors of another width (qweight / qzeros / scales [..., {vocab}]); "
    "GPTQModel loads it; to serve with vLLM or SGLang set lm_head: false"
)


class GPTQSaverConfig(ProcessorConfig):
    """Config of ``gptq_saver``."""

    type: Literal["gptq_saver"] = "gptq_saver"
    part_file_size: int = Field(4, ge=0, description="Shard size in GiB; 0 writes a single file.")
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


@dataclass(frozen=True)
class GPTQScheme:
    """The per-module settings a GPTQ ``quantization_config`` expresses.

    ``group_size`` is -1 for per-channel weights, as GPTQ writes it.
    """

    bits: int
    group_size: int
    sym: bool

    @classmethod
    def of(cls, module: QuantizedLinear) -> GPTQScheme:
        """The scheme of a quantized linear layer."""
        group_size = -1 if module.group_size is None else module.group_size
        return cls(module.bits, group_size, module.symmetric)

    def describe(self) -> str:
        """Human-readable form, e.g. ``int4 group 32 sym``."""
        scope = "per-channel" if self.group_size == -1 else f"group {self.group_size}"
        return f"int{self.bits} {scope} {'sym' if self.sym else 'asym'}"

    def as_config(self) -> dict[str, Any]:
        """The ``bits`` / ``group_size`` / ``sym`` keys of a ``quantization_config``."""
        return {"bits": self.bits, "group_size": self.group_size, "sym": self.sym}

    def overrides(self, base: GPTQScheme) -> dict[str, Any]:
        """The keys of a positive ``dynamic`` rule: only those that differ from ``base``."""
        mine, theirs = self.as_config(), base.as_config()
        return {key: value for key, value in mine.items() if theirs[key] != value}

    @property
    def vllm_servable(self) -> bool:
        """Whether vLLM 0.33 / SGLang have a GPTQ kernel for it (4/8-bit symmetric)."""
        return self.sym and self.bits in VLLM_BITS


#: A linear layer's scheme, or ``None`` for a linear layer left in float.
MaybeScheme = GPTQScheme | None
#: A linear layer of a decoder layer, before or after quantization.
LinearLike = nn.Linear | QuantizedLinear


@dataclass(frozen=True)
class RuleUnit:
    """What one ``dynamic`` rule must cover inside a decoder layer: a linear layer, or a whole
    fused group (vLLM matches rules against the fused name, GPTQModel against each member's).

    :param layer: the decoder layer's full name, e.g. ``model.layers.0``.
    :param pattern: regex of the unit relative to the layer, e.g.
        ``self_attn\\.(?:q_proj|k_proj|v_proj|qkv_proj)``.
    :param scheme: the unit's scheme (shared by all members), ``None`` when left in float.
    :param name: the name vLLM sees (the fused name for a group).
    :param members: the Hugging Face module names the unit stands for.
    :param out_features: output width vLLM sees (summed over a fused group's members).
    :param in_features: input width.
    """

    layer: str
    pattern: str
    scheme: MaybeScheme
    name: str
    members: tuple[str, ...]
    out_features: int
    in_features: int


def _fail(name: str, message: str) -> QuantizationError:
    return QuantizationError(f"gptq_saver: {name}: {message}")


def check_bits(name: str, bits: int) -> None:
    """Refuse bit widths the (non-planar) GPTQ layout cannot hold.

    :raises QuantizationError: naming the module and the alternative.
    """
    if bits in SUPPORTED_BITS:
        return
    if bits in PLANAR_BITS:
        raise _fail(
            name,
            f"int{bits} weights need GPTQModel's planar gptq_p format, which this saver does not "
            f"write (GPTQ stores 2, 3, 4 or 8 bits); {CT_ALTERNATIVE}",
        )
    raise _fail(name, f"int{bits} weights cannot be stored as GPTQ (2, 3, 4 or 8 bits)")


def fp16_scales(name: str, scale: torch.Tensor) -> torch.Tensor:
    """``scale`` (float32 ``[out, G]``) as GPTQ's float16 ``scales [G, out]``.

    :raises QuantizationError: when a scale overflows float16 or a nonzero one flushes to 0.
    """
    half = scale.to(torch.float16)
    overflow = ~torch.isfinite(half)
    underflow = (half == 0) & (scale != 0)
    if bool(overflow.any()) or bool(underflow.any()):
        bad = scale[overflow | underflow]
        raise _fail(
            name,
            f"{bad.numel()} scale(s) are not representable in float16 (e.g. {float(bad[0]):.3g}; "
            "float16 holds about 6e-8 to 65504), which GPTQ requires; this weight cannot be "
            "exported as GPTQ",
        )
    return half.t().contiguous()


def stored_zero_points(
    zeros: torch.Tensor, bits: int, checkpoint_format: CheckpointFormat
) -> torch.Tensor:
    """The zero-point fields GPTQ stores: ``(zero - 1) mod 2^b`` for v1 ``gptq``, ``zero`` for
    ``gptq_v2``."""
    if checkpoint_format == "gptq":
        return torch.remainder(zeros - 1, 2**bits)
    return zeros


def check_v1_zero_points(name: str, zeros: torch.Tensor, symmetric: bool) -> None:
    """v1 ``gptq`` cannot hold an asymmetric zero point of 0 (``0 - 1`` wraps and carries)."""
    count = int((zeros == 0).sum()) if not symmetric else 0
    if count:
        raise _fail(
            name,
            f"{count} zero point(s) are 0, which the v1 `gptq` format cannot store (zero - 1 "
            "wraps to 2^bits - 1 and the loaders' word-wise +1 carries into the next column); "
            "set `checkpoint_format: gptq_v2` (or `auto`)",
        )


def _check_packable(name: str, bits: int, out_features: int, in_features: int) -> None:
    """GPTQ packs whole int32 words: ``in * b`` and ``out * b`` must be multiples of 32."""
    for what, width in (("in_features", in_features), ("out_features", out_features)):
        if width * bits % 32:
            raise _fail(
                name,
                f"{what} {width} times {bits} bits is not a multiple of 32, so the layer cannot "
                "be packed into GPTQ's int32 words",
            )


def gptq_module_tensors(
    name: str, module: QuantizedLinear, checkpoint_format: CheckpointFormat
) -> dict[str, torch.Tensor]:
    """The GPTQ tensors of one quantized linear layer ``name`` (CPU tensors, keyed by full name).

    Reads the layer's :class:`msquant.QuantizedWeight` without modifying it.

    :raises QuantizationError: for a bit width GPTQ cannot store, a shape that does not pack into
        whole words, scales not representable in float16, or a bias overflowing float16.
    """
    weight = module.qweight
    check_bits(name, weight.bits)
    out_features, in_features = weight.shape
    _check_packable(name, weight.bits, out_features, in_features)
    codes = weight.unsigned_codes().cpu()
    try:
        zeros = weight.unsigned_zero_points().cpu()
    except ValueError as error:
        raise _fail(name, str(error)) from error
    if checkpoint_format == "gptq":
        check_v1_zero_points(name, zeros, weight.symmetric)
    tensors = {
        f"{name}.qweight": pack_int32(codes.t(), weight.bits, dim=0),
        f"{name}.qzeros": pack_int32(
            stored_zero_points(zeros.t(), weight.bits, checkpoint_format), weight.bits, dim=1
        ),
        f"{name}.scales": fp16_scales(name, weight.scale.cpu()),
        f"{name}.g_idx": weight.g_idx(),
    }
    if module.bias is not None:
        bias = module.bias.detach().cpu().to(torch.float16)
        if not bool(torch.isfinite(bias).all()):
            raise _fail(name, "the bias overflows float16, which GPTQ stores it in")
        tensors[f"{name}.bias"] = bias
    return tensors


def _alternation(names: Iterable[str]) -> str:
    """``(?:a|b)`` of escaped names (the bare escaped name when there is one)."""
    escaped = [re.escape(n) for n in dict.fromkeys(names)]
    return escaped[0] if len(escaped) == 1 else f"(?:{'|'.join(escaped)})"


def layers_pattern(layer_names: list[str]) -> str:
    """A regex matching exactly the given decoder layer names (as a prefix of a module name).

    Layers under one parent with numeric indices become ``model\\.layers\\.(?:0|1|5)``.
    """
    parents = {name.rpartition(".")[0] for name in layer_names}
    indices = [name.rpartition(".")[2] for name in layer_names]
    if len(parents) == 1 and all(index.isdigit() for index in indices):
        (parent,) = parents
        return f"{re.escape(parent)}\\.{_alternation(indices)}" if parent else _alternation(indices)
    return _alternation(layer_names)


def layer_units(
    layer_name: str, linears: Mapping[str, tuple[MaybeScheme, LinearLike]]
) -> list[RuleUnit]:
    """The rule units of one decoder layer (fused groups and single linear layers), in module order.

    :param linears: full module name -> (scheme, module) of every linear layer of the layer;
        fused members must already be known to agree.
    """
    prefix = f"{layer_name}."
    units = []
    grouped: set[str] = set()
    for group in fused_groups(linears):
        parent, _, fused_leaf = group.fused_name.rpartition(".")
        leaves = [m.rpartition(".")[2] for m in group.members] + [fused_leaf]
        relative_parent = parent[len(prefix) :] if parent.startswith(prefix) else ""
        head = f"{re.escape(relative_parent)}\\." if relative_parent else ""
        first_scheme, first = linears[group.members[0]]
        units.append(
            RuleUnit(
                layer_name,
                head + _alternation(leaves),
                first_scheme,
                group.fused_name,
                group.members,
                sum(_features(linears[m][1])[0] for m in group.members),
                _features(first)[1],
            )
        )
        grouped.update(group.members)
    for name, (scheme, module) in linears.items():
        if name not in grouped:
            out_features, in_features = _features(module)
            relative = name[len(prefix) :] if name.startswith(prefix) else name
            units.append(
                RuleUnit(
                    layer_name,
                    re.escape(relative),
                    scheme,
                    name,
                    (name,),
                    out_features,
                    in_features,
                )
            )
    order = {name: position for position, name in enumerate(linears)}
    return sorted(units, key=lambda unit: order[unit.members[0]])


def _disk_units(
    ctx: RunContext, layer_name: str, linears: Mapping[str, tuple[MaybeScheme, LinearLike]]
) -> list[RuleUnit]:
    """The rule units of one decoder layer under the checkpoint's names (what the ``dynamic``
    rules of the exported config must match: vLLM and GPTQModel name modules as the checkpoint).

    :raises QuantizationError: a linear layer's disk name is outside the layer's disk name (the
        rules are written relative to the layer).
    """
    disk_layer = ctx.disk_name(layer_name)
    disk_linears = {ctx.disk_name(name): value for name, value in linears.items()}
    outside = [name for name in disk_linears if not name.startswith(f"{disk_layer}.")]
    if outside:
        raise QuantizationError(
            f"gptq_saver: {layer_name}: the checkpoint names {_listing(outside)} outside the "
            f"layer's own name {disk_layer}, so no `dynamic` rule can be written for them"
        )
    return layer_units(disk_layer, disk_linears)


def _features(module: LinearLike) -> tuple[int, int]:
    return int(module.out_features), int(module.in_features)


def _leaves(unit: RuleUnit) -> list[str]:
    """The last name parts a unit's rule must match: its members' and, for a fused group, the
    fused name vLLM uses."""
    leaves = [member.rpartition(".")[2] for member in unit.members]
    if len(unit.members) > 1:
        leaves.append(unit.name.rpartition(".")[2])
    return leaves


def experts_module_units(units: list[RuleUnit]) -> list[RuleUnit]:
    """``units`` with the units of each MoE experts module merged into one, in place of the first.

    vLLM builds all experts of a module as one FusedMoE layer and looks ``dynamic`` up by the
    experts module's own name (``model.layers.3.mlp.experts``); GPTQModel looks it up by every
    expert linear's name. The merged unit's pattern matches both:
    ``mlp\\.experts(?:\\.\\d+\\.(?:gate_proj|up_proj|gate_up_proj|down_proj))?``. All experts of
    a module share one scheme (the plan refuses anything else before weights load).

    :raises QuantizationError: when the experts of one module differ in scheme.
    """
    grouped: dict[str, list[RuleUnit]] = {}
    order: list[RuleUnit | str] = []
    for unit in units:
        found = parse_expert_linear(unit.members[0])
        if found is None:
            order.append(unit)
            continue
        if found[0] not in grouped:
            grouped[found[0]] = []
            order.append(found[0])
        grouped[found[0]].append(unit)
    merged = []
    for item in order:
        if isinstance(item, RuleUnit):
            merged.append(item)
            continue
        members = grouped[item]
        schemes = {unit.scheme for unit in members}
        if len(schemes) > 1:
            kinds = sorted("float" if s is None else s.describe() for s in schemes)
            raise _fail(
                item,
                f"its experts are quantized differently ({', '.join(kinds)}), but vLLM loads "
                "them as one FusedMoE layer with one scheme; give every expert the same one",
            )
        layer = members[0].layer
        relative = item[len(layer) + 1 :] if item.startswith(f"{layer}.") else item
        leaves = [leaf for unit in members for leaf in _leaves(unit)]
        merged.append(
            RuleUnit(
                layer,
                f"{re.escape(relative)}(?:\\.\\d+\\.{_alternation(leaves)})?",
                members[0].scheme,
                item,
                tuple(m for unit in members for m in unit.members),
                members[0].out_features,
                members[0].in_features,
            )
        )
    return merged


def is_experts_unit(unit: RuleUnit) -> bool:
    """Whether ``unit`` stands for a whole MoE experts module (see :func:`experts_module_units`)."""
    return (
        parse_expert_linear(unit.name) is None and parse_expert_linear(unit.members[0]) is not None
    )


def dynamic_rules(units: list[RuleUnit], base: GPTQScheme) -> dict[str, dict[str, Any]]:
    """GPTQModel ``dynamic`` rules: ``-:`` for float units, ``+:`` overrides for other schemes.

    Units with the same relative pattern and the same rule across layers share one rule; the
    units of an MoE experts module become one rule matching the module's name and its experts'
    (:func:`experts_module_units`). Negative rules come first (GPTQModel saves them so and vLLM
    applies rules in file order, first match wins); every pattern is anchored with ``$`` so it
    matches exactly the names it is written for.
    """
    negative: dict[str, list[str]] = {}
    positive: dict[tuple[str, tuple[tuple[str, Any], ...]], list[str]] = {}
    for unit in experts_module_units(units):
        if unit.scheme is None:
            negative.setdefault(unit.pattern, []).append(unit.layer)
        elif unit.scheme != base:
            key = (unit.pattern, tuple(unit.scheme.overrides(base).items()))
            positive.setdefault(key, []).append(unit.layer)
    rules: dict[str, dict[str, Any]] = {}
    for pattern, layers in negative.items():
        rules[f"-:{layers_pattern(layers)}\\.{pattern}$"] = {}
    for (pattern, override), layers in positive.items():
        rules[f"+:{layers_pattern(layers)}\\.{pattern}$"] = dict(override)
    return rules


def modules_in_block_to_quantize(
    units: list[RuleUnit], head: RuleUnit | None = None
) -> list[list[str]]:
    """``modules_in_block_to_quantize``: the quantized linear layers, one inner list per unit
    (a fused group's members together), the head last.

    transformers + optimum keep a decoder-layer linear in float unless its name *ends with* an
    entry (``sum(lists, [])``, so the value must be a list of lists); vLLM quantizes a linear
    (and, with ``lm_head: true``, the head) only when an entry is a *substring* of its name. An
    entry is the name relative to the decoder layer (``self_attn.q_proj``) when every linear layer
    whose name contains it is quantized, else the full name of each quantized one.
    """
    quantized = {member for unit in units if unit.scheme is not None for member in unit.members}
    every = [member for unit in units for member in unit.members]
    safe: dict[str, bool] = {}

    def only_quantized(entry: str) -> bool:
        if entry not in safe:
            safe[entry] = all(name in quantized for name in every if entry in name)
        return safe[entry]

    lists: list[list[str]] = []
    seen: set[str] = set()
    for unit in units:
        if unit.scheme is None:
            continue
        entries = []
        for member in unit.members:
            relative = member[len(unit.layer) + 1 :]
            entry = relative if relative and only_quantized(relative) else member
            if entry not in seen:
                seen.add(entry)
                entries.append(entry)
        if entries:
            lists.append(entries)
    if head is not None and head.scheme is not None:
        lists.append([head.name])
    return lists


def base_scheme(schemes: Iterable[MaybeScheme]) -> GPTQScheme:
    """The most common scheme among quantized modules (the first seen on a tie).

    :raises QuantizationError: when no module is quantized.
    """
    counts = Counter(scheme for scheme in schemes if scheme is not None)
    if not counts:
        raise QuantizationError(
            "gptq_saver: no linear layer was quantized, so there is nothing to export as GPTQ; "
            "add a linear_quant step to spec.process (or check its include/exclude patterns)"
        )
    return counts.most_common(1)[0][0]


def head_unit(name: str, module: QuantizedLinear) -> RuleUnit:
    """The rule unit of a quantized output head: its own exact pattern, outside any layer."""
    return RuleUnit(
        "",
        re.escape(name),
        GPTQScheme.of(module),
        name,
        (name,),
        int(module.out_features),
        int(module.in_features),
    )


def build_quantization_config(
    units: list[RuleUnit],
    checkpoint_format: CheckpointFormat,
    methods: Iterable[str],
    head: RuleUnit | None = None,
) -> dict[str, Any]:
    """The ``quantization_config`` (also ``quantize_config.json``) for the recorded units.

    :param head: the quantized output head (``lm_head: true``; its own ``+:`` rule when its scheme
        differs from the base), or None when the head stays in float.
    """
    schemes = [unit.scheme for unit in units for _ in unit.members]
    if head is not None and not any(scheme is not None for scheme in schemes):
        schemes.append(head.scheme)  # only the head is quantized: it sets the base
    base = base_scheme(schemes)
    config: dict[str, Any] = {
        "bits": base.bits,
        "group_size": base.group_size,
        "desc_act": False,
        "sym": base.sym,
        "lm_head": head is not None and head.scheme is not None,
        "method": "gptq",
        "quant_method": "gptq",
        "format": checkpoint_format,
        "checkpoint_format": checkpoint_format,
        "pack_dtype": "int32",
    }
    rules = dynamic_rules(units, base)
    if head is not None and head.scheme is not None and head.scheme != base:
        rules[f"+:{head.pattern}$"] = head.scheme.overrides(base)  # after the negative rules
    if rules:
        config["dynamic"] = rules
    if any(unit.scheme is None for unit in units):
        # transformers + optimum ignore `dynamic`: without this list they build the float layers
        # quantized and fail at the first forward
        config["modules_in_block_to_quantize"] = modules_in_block_to_quantize(units, head)
    config["meta"] = {
        "quantizer": [f"msquant:{msquant.__version__}"],
        "msquant_methods": sorted(set(methods)),
    }
    return config


def _listing(names: list[str]) -> str:
    shown = ", ".join(names[:LISTED_MODULES])
    more = len(names) - LISTED_MODULES
    return f"{shown} and {more} more" if more > 0 else shown


def vllm_problem_message(units: list[RuleUnit], checkpoint_format: CheckpointFormat) -> str | None:
    """Why vLLM 0.33 / SGLang cannot serve these units as GPTQ (None when they can)."""
    bad = [u for u in units if u.scheme is not None and not u.scheme.vllm_servable]
    if not bad:
        return None
    kinds = sorted({u.scheme.describe() for u in bad if u.scheme is not None})
    members = [name for unit in bad for name in unit.members]
    message = (
        f"{_listing(members)} ({', '.join(kinds)}): vLLM 0.33 and SGLang serve GPTQ checkpoints "
        "only 4- or 8-bit symmetric (transformers with optimum + gptqmodel and GPTQModel load "
        f"this one); for vLLM {CT_ALTERNATIVE}"
    )
    if checkpoint_format == "gptq" and any(not u.scheme.sym for u in bad if u.scheme is not None):
        message += (
            ". GPTQModel also refuses sym=false checkpoints in the v1 `gptq` format that gptqmodel "
            "did not make: set `checkpoint_format: gptq_v2` (transformers + optimum load both)"
        )
    return message


def marlin_problem_message(units: list[RuleUnit]) -> str | None:
    """Which quantized units do not fit the Marlin GPTQ kernels, and what each engine does with
    them (None if all fit).

    vLLM 0.33 refuses group sizes Marlin has no kernel for, and zero-pads layers whose widths are
    not whole Marlin tiles (``out % 64``, ``in % 128``); SGLang 0.5.23 has no other CUDA GPTQ
    kernel for such group sizes, and runs Marlin on misaligned layers without its shape check.
    MoE experts are not checked: vLLM picks their kernels per experts module (Marlin MoE, or its
    MoE WNA16 kernels when Marlin does not fit).
    """
    groups, shapes = [], []
    for unit in units:
        if unit.scheme is None or parse_expert_linear(unit.members[0]) is not None:
            continue
        shape = f"{unit.name} [out {unit.out_features}, in {unit.in_features}, group_size "
        shape += f"{unit.scheme.group_size}]"
        if unit.scheme.group_size not in MARLIN_GROUP_SIZES:
            groups.append(shape)
        elif unit.out_features % MARLIN_OUT_MULTIPLE or unit.in_features % MARLIN_IN_MULTIPLE:
            shapes.append(shape)
    parts = []
    if groups:
        parts.append(
            f"group sizes Marlin has no kernel for (it takes {list(MARLIN_GROUP_SIZES)}): "
            f"{_listing(groups)}; vLLM 0.33 refuses such layers (ValueError) and SGLang has no "
            "other CUDA GPTQ kernel, so neither serves this checkpoint; "
            "`type: compressed_tensors` (pack-quantized) is vLLM's other weight-only format"
        )
    if shapes:
        parts.append(
            f"widths that are not whole Marlin tiles (out_features % {MARLIN_OUT_MULTIPLE}, "
            f"in_features % {MARLIN_IN_MULTIPLE}, at tensor-parallel size 1): "
            f"{_listing(shapes)}; vLLM 0.33 zero-pads them to whole tiles and loads the "
            "checkpoint, but SGLang 0.5.23 runs its Marlin kernels on them without checking "
            "(its shape check's result is unused), so do not serve this checkpoint with SGLang"
        )
    if not parts:
        return None
    return "Marlin GPTQ kernels (vLLM, SGLang): " + "; ".join(parts)


def sglang_moe_message(units: list[RuleUnit], base: GPTQScheme) -> str | None:
    """Why SGLang cannot serve the MoE experts of these units (None when it can): its GPTQ MoE
    method ignores ``dynamic``, so every experts module must be quantized with the base scheme."""
    odd = [u for u in experts_module_units(units) if is_experts_unit(u) and u.scheme != base]
    if not odd:
        return None
    kinds = sorted({"in float" if u.scheme is None else f"as {u.scheme.describe()}" for u in odd})
    return SGLANG_MOE_WARNING.format(
        experts=_listing([u.name for u in odd]), what=" / ".join(kinds), base=base.describe()
    )


def transformers_random_message(units: list[RuleUnit], head: RuleUnit | None) -> str | None:
    """What transformers + optimum load without error but randomly initialised: a quantized head,
    quantized MoE experts (None when neither is exported)."""
    parts = []
    if any(is_experts_unit(u) and u.scheme is not None for u in experts_module_units(units)):
        parts.append("the MoE experts")
    if head is not None and head.scheme is not None:
        parts.append(f"the quantized output head ({head.name})")
    if not parts:
        return None
    them = "them" if len(parts) > 1 or parts[0].endswith("experts") else "it"
    return TRANSFORMERS_RANDOM_WARNING.format(what=" and ".join(parts), them=them)


def _unit_to_json(unit: RuleUnit) -> dict[str, Any]:
    """A rule unit as JSON (for checkpoints)."""
    scheme = None if unit.scheme is None else unit.scheme.as_config()
    return {**dataclasses.asdict(unit), "scheme": scheme, "members": list(unit.members)}


def _unit_from_json(data: Mapping[str, Any]) -> RuleUnit:
    """The rule unit :func:`_unit_to_json` described."""
    scheme = data["scheme"]
    return RuleUnit(
        layer=data["layer"],
        pattern=data["pattern"],
        scheme=None if scheme is None else GPTQScheme(**scheme),
        name=data["name"],
        members=tuple(data["members"]),
        out_features=int(data["out_features"]),
        in_features=int(data["in_features"]),
    )


class GPTQSaver(Processor):
    """Writes a GPTQ checkpoint (qweight, qzeros, scales, g_idx) as layers finish."""

    type_name = "gptq_saver"
    config_class = GPTQSaverConfig
    stage = "save"
    config: GPTQSaverConfig
    resumable = True

    def setup(self, ctx: RunContext) -> None:
        # tensors are recorded under the model's names and stored under the checkpoint's
        self.writer: ShardedSafetensorsWriter = hf_weights_writer(
            self.output_dir(ctx), self.config.part_file_size, rename=ctx.disk_name
        )
        self.written: set[str] = set()
        self.units: list[RuleUnit] = []
        self.quantized: set[str] = set()
        self.methods: set[str] = set()
        self.head: RuleUnit | None = None  # the quantized output head, once its stage ran
        choice = self.config.checkpoint_format
        self.format: CheckpointFormat | None = None if choice == "auto" else choice

    def resume_state(self, ctx: RunContext) -> dict[str, Any]:
        return {
            "writer": self.writer.state(),
            "written": sorted(self.written),
            "units": [_unit_to_json(unit) for unit in self.units],
            "quantized": sorted(self.quantized),
            "methods": sorted(self.methods),
            "head": None if self.head is None else _unit_to_json(self.head),
            "format": self.format,
        }

    def restore(self, ctx: RunContext, state: dict[str, Any]) -> None:
        self.writer.restore(state["writer"])
        self.written = set(state["written"])
        self.units = [_unit_from_json(unit) for unit in state["units"]]
        self.quantized = set(state["quantized"])
        self.methods = set(state["methods"])
        self.head = None if state["head"] is None else _unit_from_json(state["head"])
        self.format = state["format"]

    def _resolve_format(self, module: QuantizedLinear) -> CheckpointFormat:
        """The checkpoint format, fixed by ``auto`` at the first quantized layer."""
        if self.format is None:
            self.format = "gptq" if module.symmetric else "gptq_v2"
            logger.info("gptq_saver: checkpoint_format auto -> %s", self.format)
        return self.format

    def after_layer(self, ctx: RunContext, layer: DecoderLayer) -> None:
        if isinstance(layer, OutputHeadStage):
            self._write_head(ctx, layer)
            return
        linears = self._layer_linears(layer)
        for name, (scheme, _) in linears.items():
            if scheme is not None:
                check_bits(name, scheme.bits)
        self._check_fused(layer, linears)
        units = _disk_units(ctx, layer.name, linears)
        if self.config.strict:
            problem = vllm_problem_message(units, self.format or "gptq_v2")
            if problem:
                raise QuantizationError(f"gptq_saver (strict): {problem}")
        for name, (scheme, module) in linears.items():
            if scheme is not None and isinstance(module, QuantizedLinear):
                self._write_quantized(name, module)
        for name, tensor in layer.module.state_dict(prefix=f"{layer.name}.").items():
            if name not in self.written:
                self._add(name, tensor)
        self.units.extend(units)

    def _write_head(self, ctx: RunContext, stage: OutputHeadStage) -> None:
        """The head stage: a quantized head's GPTQ tensors (recorded for ``lm_head: true``), and
        whatever else the head holds as is."""
        module = stage.module
        if isinstance(module, QuantizedLinear):
            unit = head_unit(ctx.disk_name(stage.name), module)
            assert unit.scheme is not None
            check_bits(stage.name, unit.scheme.bits)
            if self.config.strict:
                problem = vllm_problem_message([unit], self.format or "gptq_v2")
                if problem:
                    raise QuantizationError(f"gptq_saver (strict): {problem}")
            self._write_quantized(stage.name, module)
            self.head = unit
        for name, tensor in module.state_dict(prefix=f"{stage.name}.").items():
            if name not in self.written:
                self._add(name, tensor)

    def finalize(self, ctx: RunContext) -> None:
        stray = sorted(
            name
            for name, module in ctx.model.named_modules()
            if isinstance(module, QuantizedLinear) and name not in self.quantized
        )
        if stray:
            raise QuantizationError(
                f"gptq_saver: quantized layers outside the decoder layers and the output head "
                f"({_listing(stray)}) are not supported"
            )
        quantization_config = build_quantization_config(
            self.units, self.format or "gptq", self.methods, self.head
        )
        for name, tensor in unique_state_items(ctx.model):
            if name not in self.written:
                self._add(name, tensor)
        self.writer.close()
        write_hf_config(
            ctx.model_path,
            self.output_dir(ctx),
            quantization_config,
            {QUANTIZE_CONFIG_FILE: quantization_config},
        )
        self._warn_consumers(quantization_config)
        logger.info(
            "gptq_saver: %d quantized layers, %d tensors (%.1f MiB), base %s, %d dynamic rule(s)",
            len(self.quantized),
            len(self.written),
            self.writer.total_bytes / 2**20,
            GPTQScheme(
                quantization_config["bits"],
                quantization_config["group_size"],
                quantization_config["sym"],
            ).describe(),
            len(quantization_config.get("dynamic", {})),
        )

    def _layer_linears(self, layer: DecoderLayer) -> dict[str, tuple[MaybeScheme, LinearLike]]:
        """Every linear layer of ``layer`` (quantized or float) with its scheme, in module order."""
        linears: dict[str, tuple[MaybeScheme, LinearLike]] = {}
        for sub, module in layer.module.named_modules():
            name = f"{layer.name}.{sub}"
            if isinstance(module, QuantizedLinear):
                linears[name] = (GPTQScheme.of(module), module)
            elif isinstance(module, nn.Linear):
                linears[name] = (None, module)
        return linears

    @staticmethod
    def _check_fused(
        layer: DecoderLayer, linears: Mapping[str, tuple[MaybeScheme, LinearLike]]
    ) -> None:
        """Refuse fused groups (q/k/v, gate/up) whose members differ: vLLM loads one matrix."""
        schemes = {
            name: "FLOAT" if scheme is None else scheme for name, (scheme, _) in linears.items()
        }
        describe = {
            name: "not quantized" if scheme is None else scheme.describe()
            for name, (scheme, _) in linears.items()
        }
        problems = fused_group_problems(schemes, describe)
        if problems:
            raise QuantizationError(
                f"gptq_saver: {layer.name}: "
                + "; ".join(problems)
                + " (GPTQ `dynamic` rules reach vLLM through the fused name)"
            )

    def _write_quantized(self, name: str, module: QuantizedLinear) -> None:
        for tensor_name, tensor in gptq_module_tensors(
            name, module, self._resolve_format(module)
        ).items():
            self._add(tensor_name, tensor)
        self.written.update(module.state_dict(prefix=f"{name}."))
        self.quantized.add(name)
        self.methods.add(module.method)

    def _add(self, name: str, tensor: torch.Tensor) -> None:
        self.writer.add(name, tensor)
        self.written.add(name)

    def _warn_consumers(self, quantization_config: Mapping[str, Any]) -> None:
        """Warn once per kind about what vLLM / SGLang / transformers will not load."""
        units = self.units + ([self.head] if self.head is not None else [])
        problem = vllm_problem_message(units, self.format or "gptq")
        if problem:
            logger.warning("gptq_saver: %s", problem)
        base = GPTQScheme(
            quantization_config["bits"],
            quantization_config["group_size"],
            quantization_config["sym"],
        )
        if any(u.scheme is not None and u.scheme != base for u in self.units):
            logger.warning("gptq_saver: %s", DYNAMIC_WARNING)
        elif "modules_in_block_to_quantize" in quantization_config:
            logger.info("gptq_saver: %s", SKIPPED_NOTE)
        for message in (
            sglang_moe_message(self.units, base),
            transformers_random_message(self.units, self.head),
            marlin_problem_message(units),
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
        found = find_output_head(model)
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
