"""Weights a fold would change for more than the layer it is checked on.

The checks of :mod:`msquant.check` prove a transform on one decoder layer. A weight that the model
also uses elsewhere (a block shared by several layers, as Zamba's shared attention is, or a
weight tied to one outside the layer) would change for every other user too, which no check of
this layer sees: such a fold is refused.
"""

from __future__ import annotations

from collections.abc import Iterable

from torch import nn

__all__ = ["shared_weight_problems"]


def _inside(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def shared_weight_problems(model: nn.Module, layer_name: str, modules: Iterable[str]) -> list[str]:
    """One message per parameter of ``modules`` (full module names) that the model also holds
    under a name outside the decoder layer ``layer_name``."""
    wanted = {
        id(parameter): f"{module}.{name}"
        for module in modules
        for name, parameter in model.get_submodule(module).named_parameters(recurse=False)
    }
    if not wanted:
        return []
    elsewhere: dict[int, list[str]] = {}
    for name, parameter in model.named_parameters(remove_duplicate=False):
        if id(parameter) in wanted and not _inside(name, layer_name):
            elsewhere.setdefault(id(parameter), []).append(name)
    return [
        f"{wanted[key]} is also the model's {', '.join(names)}: a fold into it would change "
        f"{'that module' if len(names) == 1 else 'those modules'} too"
        for key, names in elsewhere.items()
    ]
