"""What the vLLM and SGLang harnesses (:mod:`vllm_engine`, :mod:`sglang_engine`) set up alike:
stand-ins for the engines' linear layer classes, and the small stubs their quantization code
calls the same way in both (``set_weight_attrs``, the weight-scale enum, a weight loader that
is never run).

Both engines descend from one design, so their quantization methods ask the same questions of a
layer (``isinstance`` against ``LinearBase`` and its subclasses; ``prefix``, ``input_size``,
``output_partition_sizes``, ``params_dtype``, ``tp_size``). Each harness gets classes of its own
from :func:`linear_classes`, so the two engines, installed in one process, never share a class.
"""

from __future__ import annotations

import enum
import types
from typing import Any, NamedTuple

import torch
from architectures import EngineModule

__all__ = [
    "FusedMoeWeightScaleSupported",
    "LinearClasses",
    "fill_linear_classes",
    "linear_classes",
    "noop",
    "parameter",
    "set_weight_attrs",
    "weight_loader",
]


class LinearClasses(NamedTuple):
    """One engine's stand-ins for ``LinearBase`` and its five subclasses, in this order."""

    base: type[torch.nn.Module]
    column: type[torch.nn.Module]
    merged_column: type[torch.nn.Module]
    qkv: type[torch.nn.Module]
    row: type[torch.nn.Module]
    replicated: type[torch.nn.Module]


def linear_classes(engine: str, params_dtype: torch.dtype, **attributes: Any) -> LinearClasses:
    """New classes named as the engine names them: ``LinearBase(module)`` holds what the
    quantization method registers, at tensor-parallel size 1.

    :param engine: named in the base class's docstring.
    :param attributes: extra class attributes of the base (SGLang's ``scheme = None``).
    """

    def __init__(self: torch.nn.Module, module: EngineModule) -> None:
        torch.nn.Module.__init__(self)
        self.prefix = module.prefix
        self.input_size = module.input_size
        self.output_size = module.output_size
        self.output_partition_sizes = list(module.output_sizes)
        self.params_dtype = params_dtype
        self.tp_size = 1
        self.tp_rank = 0  # vLLM's LinearBase (linear.py:303 of 0.34.0), read by vLLM-Ascend 0.30

    doc = f"{engine}'s ``LinearBase``: holds what the quantization method registers."
    base = type(
        "LinearBase", (torch.nn.Module,), {"__init__": __init__, "__doc__": doc, **attributes}
    )
    column = type("ColumnParallelLinear", (base,), {})
    return LinearClasses(
        base=base,
        column=column,
        merged_column=type("MergedColumnParallelLinear", (column,), {}),
        qkv=type("QKVParallelLinear", (column,), {}),
        row=type("RowParallelLinear", (base,), {}),
        replicated=type("ReplicatedLinear", (base,), {}),
    )


def fill_linear_classes(module: types.ModuleType, classes: LinearClasses) -> None:
    """Put the classes into the engine's stubbed ``linear`` module under their own names."""
    for cls in classes:
        setattr(module, cls.__name__, cls)


def set_weight_attrs(weight: torch.Tensor, attrs: dict[str, Any] | None) -> None:
    """Both engines' ``set_weight_attrs``: refuses to overwrite an attribute."""
    for key, value in (attrs or {}).items():
        assert not hasattr(weight, key), f"Overwriting existing tensor attribute: {key}"
        setattr(weight, key, value)


def parameter(data: torch.Tensor, **attributes: Any) -> torch.nn.Parameter:
    """A frozen parameter carrying ``attributes`` (as the unquantized methods create them)."""
    created = torch.nn.Parameter(data, requires_grad=False)
    set_weight_attrs(created, attributes)
    return created


class FusedMoeWeightScaleSupported(enum.Enum):
    """Both engines' ``FusedMoeWeightScaleSupported``: how an MoE scale is laid out."""

    TENSOR = "tensor"
    CHANNEL = "channel"
    GROUP = "group"
    BLOCK = "block"


def weight_loader(*args: Any, **kwargs: Any) -> None:
    """The ``weight_loader`` the layers pass to ``create_weights``; never called."""
    raise NotImplementedError("the consumer harness compares shapes; it loads no weights")


def noop(*args: Any, **kwargs: Any) -> None:
    """A stub for an engine function whose effect the harness does not need."""
    return None
