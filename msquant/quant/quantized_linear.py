"""``QuantizedLinear``: the module that replaces an ``nn.Linear`` once its weight is quantized.

Its state dict is the msModelSlim W8A16 layout (``weight`` int8, ``weight_scale`` and
``weight_offset`` float32, optional ``bias``), so savers read it directly. Its forward dequantizes
the weight into the input's dtype, so later layers see the quantized model's behaviour. With an
activation scheme (``act``, W8A8 / W8A8_DYNAMIC) the forward also fake-quantizes its input as the
deployed kernel quantizes it; ``act`` is a plain attribute, not a buffer, so the state dict (and
every weight-only export) is unchanged, and the savers that write activation schemes read it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from msquant.quant.activation import ActivationQuant
from msquant.quant.quantized_weight import QuantizedWeight

__all__ = ["QuantizedLinear", "replace_module"]


class QuantizedLinear(nn.Module):
    """A linear layer with an integer weight and per-channel or per-group float parameters."""

    weight: torch.Tensor
    weight_scale: torch.Tensor
    weight_offset: torch.Tensor

    def __init__(
        self,
        qweight: QuantizedWeight,
        bias: torch.Tensor | None,
        method: str,
        act_order: bool = False,
        act: ActivationQuant | None = None,
    ) -> None:
        """:param act_order: GPTQ quantized the input columns by descending Hessian diagonal
        (static groups: the group of column ``i`` is still ``i // group_size``); exporters that
        record it (compressed-tensors ``actorder: "weight"``) read it here.
        :param act: how the input is quantized (None: float activations, weight-only)."""
        super().__init__()
        self.out_features, self.in_features = qweight.shape
        self.bits = qweight.bits
        #: What the codes are (:mod:`msquant.quant.value_types`); formats refuse those they
        #: cannot store.
        self.value_type = qweight.value_type
        self.symmetric = qweight.symmetric
        self.group_size = qweight.group_size
        self.method = method
        self.act_order = bool(act_order)
        self.act = act
        self.register_buffer("weight", qweight.codes)
        self.register_buffer("weight_scale", qweight.scale)
        self.register_buffer("weight_offset", qweight.offset)
        self.bias = (
            None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)
        )

    @classmethod
    def from_linear(
        cls,
        linear: nn.Linear,
        qweight: QuantizedWeight,
        method: str,
        act_order: bool = False,
        act: ActivationQuant | None = None,
    ) -> QuantizedLinear:
        """Build from the float layer it replaces (keeps the bias in its dtype)."""
        if qweight.shape != tuple(linear.weight.shape):
            raise ValueError(
                f"quantized weight {qweight.shape} does not fit linear {tuple(linear.weight.shape)}"
            )
        return cls(qweight, linear.bias, method, act_order, act).to(linear.weight.device)

    @property
    def qweight(self) -> QuantizedWeight:
        """The module's weight as the exporters' common representation."""
        return QuantizedWeight(
            self.weight,
            self.weight_scale,
            self.weight_offset,
            self.bits,
            self.symmetric,
            self.group_size,
            self.value_type,
        )

    def dequantized_weight(self) -> torch.Tensor:
        """The float32 fake-quantized weight ``(decode(weight) - offset) * scale``."""
        return self.qweight.dequantize()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.dequantized_weight().to(x.dtype)
        if self.act is not None:
            x = self.act.fake_quantize(x)
        bias = None if self.bias is None else self.bias.to(x.dtype)
        return F.linear(x, weight, bias)

    def extra_repr(self) -> str:
        scheme = self.value_type.describe(self.group_size, self.symmetric)
        order = ", act-order" if self.act_order else ""
        act = f", {self.act.describe()}" if self.act is not None else ""
        return (
            f"in={self.in_features}, out={self.out_features}, {scheme}, {self.method}{order}{act}"
        )


def replace_module(root: nn.Module, name: str, new: nn.Module) -> None:
    """Replace the submodule ``name`` (dotted path) of ``root`` by ``new``."""
    parent_name, _, child = name.rpartition(".")
    parent = root.get_submodule(parent_name) if parent_name else root
    setattr(parent, child, new)
