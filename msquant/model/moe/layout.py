"""Which modules hold fused MoE experts, and whether :class:`UnfusedExperts` can reproduce them.

transformers (5.x) holds the routed experts of an MoE block in one module with 3-D parameters
``gate_up_proj [E, 2I, H]`` and ``down_proj [E, H, I]``; a module is accepted only when its
parameters, flags, gating and forward signature are exactly that layout, so the unfused forward
computes the same thing.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping

from torch import nn

from msquant.errors import ModelLoadError
from msquant.model.moe.experts import FUSED_PARAMS

__all__ = ["FORWARD_ARGS", "SUPPORTED_FLAGS", "find_fused_experts"]

#: The forward arguments of transformers' experts modules (called by the MoE block with the
#: router's choice): ``hidden_states [T, H]``, ``top_k_index [T, K]``, ``top_k_weights [T, K]``.
FORWARD_ARGS: tuple[str, str, str] = ("hidden_states", "top_k_index", "top_k_weights")

#: Layout flags that ``transformers.integrations.moe.use_experts_implementation`` sets on every
#: experts module, with the only values whose semantics :class:`UnfusedExperts` reproduces.
SUPPORTED_FLAGS: Mapping[str, bool] = {
    "has_gate": True,
    "has_bias": False,
    "is_transposed": False,
    "is_concatenated": True,
    "has_post_expert_norm": False,
}


def _looks_like_experts(name: str, module: nn.Module) -> bool:
    """Whether ``module`` holds fused experts: direct 3-D parameters in a module that says it
    holds experts (an expert count, transformers' experts-layout flags, or "expert" in its class
    or attribute name). Built-in torch modules (``nn.Conv1d``'s 3-D kernel) are never experts."""
    if type(module).__module__.startswith("torch.nn"):
        return False
    if not any(p.ndim == 3 for p in module.parameters(recurse=False)):
        return False
    leaf = name.rpartition(".")[2]
    return (
        hasattr(module, "num_experts")
        or any(hasattr(module, flag) for flag in SUPPORTED_FLAGS)
        or "expert" in type(module).__name__.lower()
        or "expert" in leaf.lower()
    )


def _layout_problems(module: nn.Module) -> list[str]:
    """Why ``module`` is not a fused experts module :class:`UnfusedExperts` can reproduce
    (empty when it is)."""
    params = dict(module.named_parameters(recurse=False))
    if set(params) != set(FUSED_PARAMS):
        return [
            f"its parameters are {sorted(params)}, expected exactly {list(FUSED_PARAMS)} "
            "(no biases, no per-expert scales)"
        ]
    problems = []
    gate_up, down = params["gate_up_proj"], params["down_proj"]
    if gate_up.ndim != 3 or down.ndim != 3:
        return [
            f"gate_up_proj {tuple(gate_up.shape)} and down_proj {tuple(down.shape)} must be 3-D"
        ]
    num_experts, two_inter, hidden = gate_up.shape
    declared = getattr(module, "num_experts", num_experts)
    if declared != num_experts:
        problems.append(f"num_experts is {declared} but gate_up_proj has {num_experts} experts")
    if two_inter % 2 or tuple(down.shape) != (num_experts, hidden, two_inter // 2):
        problems.append(
            f"gate_up_proj {tuple(gate_up.shape)} and down_proj {tuple(down.shape)} are not "
            "[E, 2I, H] and [E, H, I]"
        )
    for flag, value in SUPPORTED_FLAGS.items():
        if getattr(module, flag, value) != value:
            problems.append(f"{flag}={getattr(module, flag)!r} (supported: {value})")
    if not callable(getattr(module, "act_fn", None)):
        problems.append("it has no act_fn")
    problems.extend(_gate_problems(module))
    problems.extend(_forward_problems(module))
    return problems


def _gate_problems(module: nn.Module) -> list[str]:
    """A class that overrides transformers' ``_apply_gate`` (e.g. clamped or interleaved gating)
    computes something else than ``act(gate) * up``."""
    apply_gate = getattr(type(module), "_apply_gate", None)
    if apply_gate is None or apply_gate.__module__ == "transformers.integrations.moe":
        return []
    return [f"it defines its own gating ({apply_gate.__qualname__})"]


def _forward_problems(module: nn.Module) -> list[str]:
    """The module must be called as ``forward(hidden_states, top_k_index, top_k_weights)``."""
    try:
        names = tuple(inspect.signature(module.forward).parameters)[: len(FORWARD_ARGS)]
    except (TypeError, ValueError):  # pragma: no cover - builtins without a signature
        names = ()
    if names != FORWARD_ARGS:
        return [f"its forward takes {names}, expected {FORWARD_ARGS}"]
    return []


def find_fused_experts(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(name, module)`` of every fused experts module of ``model``, in model order.

    :raises ModelLoadError: when a module holds experts in a layout msquant cannot unfuse; the
        message names every such module, its class and what differs.
    """
    found, refused = [], []
    for name, module in model.named_modules():
        if not _looks_like_experts(name, module):
            continue
        problems = _layout_problems(module)
        if problems:
            refused.append(f"{name} ({type(module).__name__}): {'; '.join(problems)}")
        else:
            found.append((name, module))
    if refused:
        raise ModelLoadError(
            "cannot split the MoE experts of this model into per-expert linear layers: "
            + " | ".join(refused)
            + ". msquant supports experts holding gate_up_proj [E, 2I, H] and down_proj [E, H, I] "
            "called as forward(hidden_states, top_k_index, top_k_weights) (Qwen2/3-MoE, Mixtral, "
            "DeepSeek-V3, Qwen3-VL-MoE in transformers 5)"
        )
    return found
