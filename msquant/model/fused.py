"""Linear layers that serving engines fuse into one matrix, and the check that they agree.

vLLM and vLLM-Ascend load q/k/v as one ``qkv_proj`` and gate/up as one ``gate_up_proj`` (DeepSeek:
``q_a_proj`` + ``kv_a_proj_with_mqa`` as ``fused_qkv_a_proj``; MoE experts: ``w1`` + ``w3``). The
shards of a fused matrix must share one quantization scheme (bits, group size, symmetry, skip), or
the engine refuses the checkpoint (vLLM-Ascend: ``ValueError``) or, worse, mis-dequantizes it.

MoE experts go further: vLLM and vLLM-Ascend load every expert of one experts module
(``model.layers.3.mlp.experts.<e>.{gate,up,down}_proj``, Mixtral's ``...experts.<e>.w1/w2/w3``)
as a single ``FusedMoE`` layer with one quantization method, looked up by the experts module's
name; per-expert schemes cannot reach it, so the whole module must share one scheme.
"""

from __future__ import annotations

import re
from collections.abc import Hashable, Iterable, Mapping
from dataclasses import dataclass

__all__ = [
    "FUSED_SHARDS",
    "FusedGroup",
    "engine_names",
    "expert_groups",
    "expert_group_problems",
    "fused_groups",
    "fused_group_problems",
    "parse_expert_linear",
]

#: ``<experts module>.<expert index>.<projection>``: a linear layer of one MoE expert.
_EXPERT_LINEAR = re.compile(r"^(?P<experts>.+\.experts)\.(?P<index>\d+)\.(?P<proj>[^.]+)$")
#: Members listed per scheme in an experts-module message (the rest are counted).
_LISTED_EXPERTS = 3

#: fused name -> the sibling module names it is built from (vLLM's ``packed_modules_mapping``).
FUSED_SHARDS: Mapping[str, tuple[str, ...]] = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
    "fused_qkv_a_proj": ("q_a_proj", "kv_a_proj_with_mqa"),
    "w13": ("w1", "w3"),
}


@dataclass(frozen=True)
class FusedGroup:
    """One fused matrix: e.g. ``model.layers.0.self_attn.qkv_proj`` from its three shards."""

    fused_name: str
    members: tuple[str, ...]


def fused_groups(
    module_names: Iterable[str], shards: Mapping[str, tuple[str, ...]] = FUSED_SHARDS
) -> list[FusedGroup]:
    """The fused groups present among ``module_names`` (full dotted names), in name order.

    A group is reported when at least two of its shards exist under the same parent module.

    :param shards: fused name -> shard names; a model adapter passes its own table
        (:attr:`msquant.model.adapter.ModelAdapter.fused_shards`), the default is vLLM's generic one.
    """
    names = set(module_names)
    groups = []
    parents = sorted({name.rpartition(".")[0] for name in names})
    for parent in parents:
        prefix = f"{parent}." if parent else ""
        for fused, members in shards.items():
            present = tuple(prefix + s for s in members if prefix + s in names)
            if len(present) >= 2:
                groups.append(FusedGroup(prefix + fused, present))
    return groups


def parse_expert_linear(name: str) -> tuple[str, int] | None:
    """``(experts module, expert index)`` of an MoE expert's linear layer
    (``model.layers.3.mlp.experts.17.up_proj`` -> ``("model.layers.3.mlp.experts", 17)``), None
    for any other name (shared experts included: they are not routed)."""
    match = _EXPERT_LINEAR.match(name)
    return None if match is None else (match["experts"], int(match["index"]))


def expert_groups(module_names: Iterable[str]) -> list[FusedGroup]:
    """The MoE experts modules among ``module_names``: one group per ``<...>.experts`` module
    holding linear layers of at least two experts, its members in name order (every projection
    of every expert: vLLM loads them all as one ``FusedMoE`` layer)."""
    found: dict[str, list[str]] = {}
    indexes: dict[str, set[str]] = {}
    for name in module_names:
        match = _EXPERT_LINEAR.match(name)
        if match:
            found.setdefault(match["experts"], []).append(name)
            indexes.setdefault(match["experts"], set()).add(match["index"])
    return [
        FusedGroup(experts, tuple(sorted(found[experts])))
        for experts in sorted(found)
        if len(indexes[experts]) >= 2
    ]


def engine_names(
    module_names: Iterable[str], shards: Mapping[str, tuple[str, ...]] = FUSED_SHARDS
) -> dict[str, tuple[FusedGroup, ...]]:
    """For each module that serving engines load as part of a bigger one, the groups they look its
    quantization up by: the fused matrix (``...self_attn.qkv_proj`` for ``q_proj``) and, for an
    MoE expert's linear layer, the whole experts module (``model.layers.3.mlp.experts``).

    vLLM and SGLang match ``dynamic`` rules against these names only, never against the shards'
    (see :func:`msquant.plugin.planning.resolve_module_scheme`). Modules loaded as themselves are absent.

    :param shards: the fused table, as in :func:`fused_groups`.
    """
    names = list(module_names)
    found: dict[str, list[FusedGroup]] = {}
    for group in [*fused_groups(names, shards), *expert_groups(names)]:
        for member in group.members:
            found.setdefault(member, []).append(group)
    return {name: tuple(groups) for name, groups in found.items()}


def fused_group_problems(
    schemes: Mapping[str, Hashable],
    describe: Mapping[str, str] | None = None,
    shards: Mapping[str, tuple[str, ...]] = FUSED_SHARDS,
) -> list[str]:
    """One message per fused group whose members resolve to different schemes.

    :param schemes: module name -> any comparable description of its quantization (include
        unquantized modules, e.g. as ``"FLOAT"``, so a skipped shard is caught too).
    :param describe: optional module name -> human-readable scheme for the message (defaults to
        ``str`` of the scheme).
    :param shards: the fused table, as in :func:`fused_groups`.
    """
    problems = []
    text = describe or {}
    for group in fused_groups(schemes, shards):
        found = {name: schemes[name] for name in group.members}
        if len(set(found.values())) > 1:
            parts = ", ".join(f"{name}: {text.get(name, str(found[name]))}" for name in found)
            problems.append(
                f"{group.fused_name} is loaded as one fused matrix by vLLM / vLLM-Ascend, but its "
                f"shards differ ({parts}); give them the same quantization (or skip all of them)"
            )
    return problems


def expert_group_problems(
    schemes: Mapping[str, Hashable], describe: Mapping[str, str] | None = None
) -> list[str]:
    """One message per MoE experts module whose expert linear layers resolve to different
    schemes (arguments as :func:`fused_group_problems`).

    Checked on the planned schemes, before the run: a stored export cannot tell a group as wide
    as the row (``down_proj`` of a narrow expert) from per-channel, so it is not rechecked there.
    """
    problems = []
    text = describe or {}
    for group in expert_groups(schemes):
        by_scheme: dict[Hashable, list[str]] = {}
        for name in group.members:
            by_scheme.setdefault(schemes[name], []).append(name)
        if len(by_scheme) > 1:
            problems.append(
                f"{group.fused_name} ({len(group.members)} expert linear layers) is loaded as one "
                "FusedMoE layer with a single quantization by vLLM / vLLM-Ascend, but its experts "
                f"differ ({_expert_parts(by_scheme, text)}); give every expert of the module the "
                "same quantization (or skip all of them)"
            )
    return problems


def _expert_parts(by_scheme: Mapping[Hashable, list[str]], describe: Mapping[str, str]) -> str:
    """``int4 group 32 sym: a, b, c and 45 more; not quantized: d`` (largest share first)."""
    parts = []
    for scheme, names in sorted(by_scheme.items(), key=lambda item: -len(item[1])):
        shown = ", ".join(names[:_LISTED_EXPERTS])
        more = len(names) - _LISTED_EXPERTS
        label = describe.get(names[0], str(scheme))
        parts.append(f"{label}: {shown}" + (f" and {more} more" if more > 0 else ""))
    return "; ".join(parts)
