"""The per-expert modules that replace a fused experts module: :class:`UnfusedExperts` holds one
:class:`ExpertMLP` (``gate_proj``, ``up_proj``, ``down_proj``) per expert with the fused module's
forward, so a hook on an expert's Linear sees exactly the tokens routed to that expert.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping

import torch
from torch import nn

__all__ = ["FUSED_PARAMS", "ROLES", "ROLE_PARAM", "ExpertMLP", "UnfusedExperts", "expert_slice"]

#: The 3-D parameters of the supported fused layout, in the order transformers defines them.
FUSED_PARAMS: tuple[str, str] = ("gate_up_proj", "down_proj")

ROLES: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")

#: The fused parameter holding each expert Linear's weight.
ROLE_PARAM: dict[str, str] = {
    "gate_proj": "gate_up_proj",
    "up_proj": "gate_up_proj",
    "down_proj": "down_proj",
}


def expert_slice(fused: torch.Tensor, expert: int, role: str) -> torch.Tensor:
    """The ``[out, in]`` weight of expert ``expert``'s Linear ``role`` inside its fused
    parameter in the model's layout (``gate_up_proj [E, 2I, H]``: gate rows first, then up;
    ``down_proj [E, H, I]``), a view of ``fused``."""
    if role == "down_proj":
        return fused[expert]
    inter = fused.shape[1] // 2
    return fused[expert, :inter] if role == "gate_proj" else fused[expert, inter:]


class ExpertMLP(nn.Module):
    """One expert: ``down_proj(act(gate_proj(x)) * up_proj(x))``, three bias-free Linears."""

    def __init__(self, gate_proj: nn.Linear, up_proj: nn.Linear, down_proj: nn.Linear) -> None:
        super().__init__()
        self.gate_proj = gate_proj
        self.up_proj = up_proj
        self.down_proj = down_proj

    def forward(
        self, x: torch.Tensor, act_fn: Callable[[torch.Tensor], torch.Tensor]
    ) -> torch.Tensor:
        """The expert's output for the tokens ``x [n, H]`` routed to it."""
        return self.down_proj(act_fn(self.gate_proj(x)) * self.up_proj(x))


class UnfusedExperts(nn.Module):
    """Drop-in replacement of a fused experts module, with one :class:`ExpertMLP` per expert.

    Children are named ``"0"``, ``"1"``, ... so the Linears are ``experts.{e}.gate_proj`` etc.
    The forward loops over the experts that received tokens, like transformers' eager one, and
    gives the same result in the same dtype; each expert gets its tokens in token order.

    :param experts: the experts, in index order.
    :param act_fn: the activation of the fused module (shared by all experts).
    :param source_class: class name of the replaced module, for reports and messages.
    :param fused_shapes: shapes of the replaced 3-D parameters (``gate_up_proj``, ``down_proj``);
        :func:`checkpoint_names` needs them to replay transformers' save-time conversion.
    """

    def __init__(
        self,
        experts: list[ExpertMLP],
        act_fn: Callable[[torch.Tensor], torch.Tensor],
        source_class: str,
        fused_shapes: Mapping[str, tuple[int, ...]],
    ) -> None:
        super().__init__()
        for index, expert in enumerate(experts):
            self.add_module(str(index), expert)
        self.act_fn = act_fn
        self.num_experts = len(experts)
        self.source_class = source_class
        self.fused_shapes = dict(fused_shapes)
        self.hidden_dim = experts[0].gate_proj.in_features
        self.intermediate_dim = experts[0].gate_proj.out_features

    def __getitem__(self, index: int) -> ExpertMLP:
        expert = self._modules[str(index)]
        assert isinstance(expert, ExpertMLP)
        return expert

    def __len__(self) -> int:
        return self.num_experts

    def __iter__(self) -> Iterator[ExpertMLP]:
        return (self[e] for e in range(self.num_experts))

    @classmethod
    def from_fused(cls, fused: nn.Module) -> UnfusedExperts:
        """Copy the expert slices of ``fused``'s 3-D parameters into per-expert Linears.

        Each Linear owns its own copy (so it can be freed as soon as it is quantized); the fused
        parameters are released when the caller drops ``fused``. The Linears keep the dtype,
        device (``meta`` included) and ``requires_grad`` of the fused parameters.
        """
        gate_up, down = (_param(fused, name) for name in FUSED_PARAMS)
        fused_params = {"gate_up_proj": gate_up, "down_proj": down}
        experts = []
        with torch.no_grad():
            for e in range(gate_up.shape[0]):
                linears = [
                    _linear_from(
                        expert_slice(fused_params[ROLE_PARAM[role]], e, role),
                        fused_params[ROLE_PARAM[role]].requires_grad,
                    )
                    for role in ROLES
                ]
                experts.append(ExpertMLP(*linears))
        shapes = {"gate_up_proj": tuple(gate_up.shape), "down_proj": tuple(down.shape)}
        act_fn: Callable[[torch.Tensor], torch.Tensor] = getattr(fused, "act_fn")  # noqa: B009
        return cls(experts, act_fn, type(fused).__name__, shapes)

    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        """Weighted sum of the chosen experts' outputs per token (``[T, H]``).

        :param hidden_states: ``[T, H]`` tokens.
        :param top_k_index: ``[T, K]`` chosen expert per token and slot (values
            ``>= num_experts`` mark a slot to skip, as in transformers' expert-parallel masking).
        :param top_k_weights: ``[T, K]`` routing weight per token and slot.
        """
        final = torch.zeros_like(hidden_states)
        top_k = top_k_index.shape[-1]
        with torch.no_grad():
            # Slots grouped by expert (token order kept inside a group): O(T*K), no [T, K, E] mask.
            flat = top_k_index.reshape(-1)
            order = torch.argsort(flat, stable=True)
            counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        start = 0
        for e, count in enumerate(counts[: self.num_experts]):
            if count:
                slots = order[start : start + count]
                token_idx, top_k_pos = slots // top_k, slots % top_k
                out = self[e](hidden_states[token_idx], self.act_fn)
                out = out * top_k_weights[token_idx, top_k_pos, None]
                final.index_add_(0, token_idx, out.to(final.dtype))
            start += count
        return final


def _param(module: nn.Module, name: str) -> torch.Tensor:
    """A direct parameter of ``module`` (checked by :func:`find_fused_experts`)."""
    param = module._parameters[name]
    assert param is not None
    return param


def _linear_from(weight: torch.Tensor, requires_grad: bool) -> nn.Linear:
    """A bias-free Linear owning a copy of the 2-D ``weight`` ``[out, in]`` (no random init)."""
    out_features, in_features = weight.shape
    linear = nn.Linear(in_features, out_features, bias=False, device="meta", dtype=weight.dtype)
    linear.weight = nn.Parameter(weight.detach().clone(), requires_grad=requires_grad)
    return linear
