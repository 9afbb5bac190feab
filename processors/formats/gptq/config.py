"""The GPTQ ``quantization_config`` (also ``quantize_config.json``): the base scheme, GPTQModel
``dynamic`` rules for modules quantized otherwise or left in float, and
``modules_in_block_to_quantize`` for transformers + optimum (pure functions over rule units).

Rules are full-name regexes written so that they also match the names vLLM matches them against:
the fused ``qkv_proj`` / ``gate_up_proj`` (and the fused matrices the model's adapter names), and
the experts module of an MoE layer, which vLLM loads as one FusedMoE layer and looks up by that
name only.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from msquant.plugin import ModelAdapter, QuantizationError, QuantizedLinear
from msquant.plugin.export import __version__
from msquant.plugin.model import parse_expert_linear
from msquant.processors.formats.gptq.scheme import (
    CheckpointFormat,
    GPTQScheme,
    LinearLike,
    MaybeScheme,
    gptq_error,
    listing,
)

__all__ = [
    "QUANTIZE_CONFIG_FILE",
    "RuleUnit",
    "layers_pattern",
    "layer_units",
    "disk_units",
    "experts_module_units",
    "is_experts_unit",
    "dynamic_rules",
    "modules_in_block_to_quantize",
    "base_scheme",
    "head_unit",
    "build_quantization_config",
]

QUANTIZE_CONFIG_FILE = "quantize_config.json"


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
    layer_name: str,
    linears: Mapping[str, tuple[MaybeScheme, LinearLike]],
    adapter: ModelAdapter,
) -> list[RuleUnit]:
    """The rule units of one decoder layer (fused groups and single linear layers), in module order.

    :param linears: full module name -> (scheme, module) of every linear layer of the layer;
        fused members must already be known to agree.
    :param adapter: the model's adapter (:func:`msquant.plugin.adapter_for`): which linears vLLM loads as
        one fused matrix, so that a group gets one rule matching the fused name too (Qwen3.5's
        ``in_proj_qkvz`` as well as ``qkv_proj``).
    """
    prefix = f"{layer_name}."
    units = []
    grouped: set[str] = set()
    for group in adapter.fused_groups(linears):
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


def disk_units(
    disk_name: Callable[[str], str],
    layer_name: str,
    linears: Mapping[str, tuple[MaybeScheme, LinearLike]],
    adapter: ModelAdapter,
) -> list[RuleUnit]:
    """The rule units of one decoder layer under the checkpoint's names (what the ``dynamic``
    rules of the exported config must match: vLLM and GPTQModel name modules as the checkpoint);
    ``adapter`` as in :func:`layer_units`.

    :raises QuantizationError: a linear layer's disk name is outside the layer's disk name (the
        rules are written relative to the layer).
    """
    disk_layer = disk_name(layer_name)
    disk_linears = {disk_name(name): value for name, value in linears.items()}
    outside = [name for name in disk_linears if not name.startswith(f"{disk_layer}.")]
    if outside:
        raise QuantizationError(
            f"gptq_saver: {layer_name}: the checkpoint names {listing(outside)} outside the "
            f"layer's own name {disk_layer}, so no `dynamic` rule can be written for them"
        )
    return layer_units(disk_layer, disk_linears, adapter)


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
            raise gptq_error(
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
        "quantizer": [f"msquant:{__version__}"],
        "msquant_methods": sorted(set(methods)),
    }
    return config
