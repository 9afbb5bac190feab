"""The routers of MoE blocks: the modules that choose the experts, which engines keep float."""

from __future__ import annotations

from torch import nn

__all__ = ["moe_routers"]


def moe_routers(module: nn.Module, prefix: str = "") -> set[str]:
    """Full names of the MoE routers in ``module``: a direct child of a module which also holds
    the ``experts`` that is an ``nn.Linear`` (Qwen2/3-MoE's and Mixtral's ``gate`` in
    transformers 4, Qwen2-MoE's ``shared_expert_gate``) or holds a 2-D ``weight`` of its own
    (transformers 5's router modules, e.g. ``Qwen3MoeTopKRouter``, which are not
    ``nn.Linear``). vLLM, vLLM-Ascend and SGLang build these unquantized, so msquant keeps them
    float whatever the config selects, and exports that list float layers list them too.

    :param prefix: the full name of ``module`` (e.g. ``model.layers.3``).
    """
    routers = set()
    for name, parent in module.named_modules(prefix=prefix):
        if not hasattr(parent, "experts"):
            continue
        for child_name, child in parent.named_children():
            if child_name != "experts" and _is_router(child):
                routers.add(f"{name}.{child_name}" if name else child_name)
    return routers


def _is_router(module: nn.Module) -> bool:
    """An ``nn.Linear``, or a module holding a 2-D ``weight`` parameter directly (a router that
    applies it with ``F.linear``); shared experts hold theirs in child linears."""
    if isinstance(module, nn.Linear):
        return True
    weight = dict(module.named_parameters(recurse=False)).get("weight")
    return weight is not None and weight.dim() == 2
