"""Replacing every fused experts module of a model by per-expert linear layers, and the record
(:class:`MoEInfo`) of what was replaced.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from torch import nn

from msquant.model.moe.experts import ROLES, UnfusedExperts
from msquant.model.moe.layout import find_fused_experts

__all__ = ["MoEInfo", "UnfusedMoE", "unfuse_experts"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class UnfusedMoE:
    """One experts module that :func:`unfuse_experts` replaced.

    :param name: full module name, e.g. ``model.layers.1.mlp.experts``.
    :param source_class: class of the fused module, e.g. ``Qwen2MoeExperts``.
    :param num_experts: E.
    :param hidden_size: H (``in_features`` of gate/up, ``out_features`` of down).
    :param intermediate_size: I (``out_features`` of gate/up, ``in_features`` of down).
    """

    name: str
    source_class: str
    num_experts: int
    hidden_size: int
    intermediate_size: int

    def expert_name(self, expert: int) -> str:
        """Full module name of one expert (``...experts.3``)."""
        return f"{self.name}.{expert}"

    def linear_names(self) -> list[str]:
        """Full names of the expert Linears, expert by expert (gate, up, down)."""
        return [f"{self.expert_name(e)}.{role}" for e in range(self.num_experts) for role in ROLES]


@dataclass(frozen=True)
class MoEInfo:
    """What :func:`unfuse_experts` did: the replaced modules, in model order (empty: nothing was
    fused), and the experts modules the model already held one module per expert.

    :param split: names of experts modules that are ``nn.ModuleList`` s of per-expert MLPs
        (transformers 4), left as they are; their Linears count as experts too.
    """

    modules: tuple[UnfusedMoE, ...] = ()
    split: tuple[str, ...] = ()

    def __bool__(self) -> bool:
        """Whether experts were unfused (the model's names then differ from the checkpoint's)."""
        return bool(self.modules)

    def linear_names(self) -> list[str]:
        """Full names of every expert Linear created."""
        return [name for module in self.modules for name in module.linear_names()]

    def expert_of(self, linear_name: str) -> str | None:
        """The expert module (``...experts.3``) a Linear belongs to, None if it is no expert's."""
        for module in self.modules:
            prefix = module.name + "."
            if linear_name.startswith(prefix):
                index, _, role = linear_name[len(prefix) :].partition(".")
                if index.isdigit() and role in ROLES:
                    return module.expert_name(int(index))
        for experts in self.split:
            index, _, rest = linear_name.removeprefix(experts + ".").partition(".")
            if linear_name.startswith(experts + ".") and index.isdigit() and rest:
                return f"{experts}.{index}"
        return None


def unfuse_experts(model: nn.Module) -> MoEInfo:
    """Replace every fused experts module of ``model`` by an :class:`UnfusedExperts` (in place).

    Every layout is checked before anything is replaced, so on error the model is unchanged.
    Works on ``meta`` models too (planning). Dense models are left alone (empty result).

    :raises ModelLoadError: an experts module has a layout msquant cannot reproduce.
    """
    unfused = []
    for name, fused in find_fused_experts(model):
        replacement = UnfusedExperts.from_fused(fused)
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name), child, replacement)
        unfused.append(
            UnfusedMoE(
                name=name,
                source_class=replacement.source_class,
                num_experts=replacement.num_experts,
                hidden_size=replacement.hidden_dim,
                intermediate_size=replacement.intermediate_dim,
            )
        )
        del fused
    if unfused:
        logger.info(
            "split %d MoE expert modules (%s, %d experts each) into per-expert linear layers",
            len(unfused),
            unfused[0].source_class,
            unfused[0].num_experts,
        )
    split = tuple(
        name
        for name, module in model.named_modules()
        if name.rpartition(".")[2] == "experts" and isinstance(module, nn.ModuleList)
    )
    return MoEInfo(tuple(unfused), split)
