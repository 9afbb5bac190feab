"""Linear layers that serving engines fuse into one matrix, and the check that they agree.

vLLM and vLLM-Ascend load q/k/v as one ``qkv_proj`` and gate/up as one ``gate_up_proj`` (DeepSeek:
``q_a_proj`` + ``kv_a_proj_with_mqa`` as ``fused_qkv_a_proj``; MoE experts: ``w1`` + ``w3``). The
shards of a fused matrix must share one quantization scheme (bits, group size, symmetry, skip), or
the engine refuses the checkpoint (vLLM-Ascend: ``ValueError``) or, worse, mis-dequantizes it.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Mapping
from dataclasses import dataclass

__all__ = ["FUSED_SHARDS", "FusedGroup", "fused_groups", "fused_group_problems"]

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


def fused_groups(module_names: Iterable[str]) -> list[FusedGroup]:
    """The fused groups present among ``module_names`` (full dotted names), in name order.

    A group is reported when at least two of its shards exist under the same parent module.
    """
    names = set(module_names)
    groups = []
    parents = sorted({name.rpartition(".")[0] for name in names})
    for parent in parents:
        prefix = f"{parent}." if parent else ""
        for fused, shards in FUSED_SHARDS.items():
            present = tuple(prefix + s for s in shards if prefix + s in names)
            if len(present) >= 2:
                groups.append(FusedGroup(prefix + fused, present))
    return groups


def fused_group_problems(
    schemes: Mapping[str, Hashable], describe: Mapping[str, str] | None = None
) -> list[str]:
    """One message per fused group whose members resolve to different schemes.

    :param schemes: module name -> any comparable description of its quantization (include
        unquantized modules, e.g. as ``"FLOAT"``, so a skipped shard is caught too).
    :param describe: optional module name -> human-readable scheme for the message (defaults to
        ``str`` of the scheme).
    """
    problems = []
    for group in fused_groups(schemes):
        found = {name: schemes[name] for name in group.members}
        if len(set(found.values())) > 1:
            text = describe or {}
            parts = ", ".join(f"{name}: {text.get(name, str(found[name]))}" for name in found)
            problems.append(
                f"{group.fused_name} is loaded as one fused matrix by vLLM / vLLM-Ascend, but its "
                f"shards differ ({parts}); give them the same quantization (or skip all of them)"
            )
    return problems
