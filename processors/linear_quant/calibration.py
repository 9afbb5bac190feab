"""The calibration side of ``linear_quant`` for methods that learn from data (``calibrated``):
which pass gathers each module's Hessian, and the Hessians themselves while a pass runs.

Pure bookkeeping, no numerics: the quantizers come from the method object
(:meth:`msquant.plugin.QuantMethod.new_quantizer`), the solve is the method's too.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from msquant.plugin import CalibratedQuantizer, DecoderLayer
from msquant.plugin.model import parse_expert_linear

__all__ = ["HessianCollector", "plan_passes"]

logger = logging.getLogger(__name__)


def _expert_slice(name: str, experts_per_pass: int | None) -> int:
    """0 for every module but the MoE experts past the first ``experts_per_pass`` (expert ``e``
    is in slice ``e // experts_per_pass``)."""
    expert = parse_expert_linear(name)
    return 0 if experts_per_pass is None or expert is None else expert[1] // experts_per_pass


def plan_passes(
    layer: DecoderLayer,
    selected: Sequence[str],
    true_sequential: bool,
    experts_per_pass: int | None,
) -> tuple[dict[str, int], dict[int, list[str]]]:
    """The calibration pass gathering each selected module's Hessian, and with
    ``true_sequential`` the modules quantized right after each pass.

    Without ``true_sequential`` a layer has one stage; with it, one stage per direct submodule
    of the layer holding selected linears (``self_attn``, ``mlp``, ...), in the layer's
    registration order, which is the order of the forward for the decoder layers of
    transformers. Each stage gets one pass per slice of MoE experts it holds; a stage's
    modules are quantized after its last pass, so later stages calibrate through them.
    """
    if not true_sequential:
        return {name: _expert_slice(name, experts_per_pass) for name in selected}, {}
    order = {child: i for i, (child, _) in enumerate(layer.module.named_children())}
    prefix = f"{layer.name}."

    def stage(name: str) -> int:
        child = name[len(prefix) :].split(".")[0] if name.startswith(prefix) else ""
        return order.get(child, -1)

    plan: dict[str, int] = {}
    apply_after: dict[int, list[str]] = {}
    first = 0
    for key in sorted({stage(name) for name in selected}):
        members = [name for name in selected if stage(name) == key]
        for name in members:
            plan[name] = first + _expert_slice(name, experts_per_pass)
        last = max(plan[name] for name in members)
        apply_after[last] = members
        first = last + 1
    return plan, apply_after


class HessianCollector:
    """The quantizers of one calibration pass, fed by forward hooks on their modules.

    Modules that read the very same input tensor (q/k/v, gate/up) share one Hessian: identical
    sums at a fraction of the cost. Sharing is decided on the first calibration batch and must
    hold for every later batch.
    """

    def __init__(self) -> None:
        self.quantizers: dict[str, CalibratedQuantizer] = {}
        self._hooks: list[RemovableHandle] = []
        self._last_input: tuple[torch.Tensor, str] | None = None
        self._share_with: dict[str, str] = {}  # module -> module whose Hessian it shares

    def hook(self, name: str, module: nn.Module, quantizer: CalibratedQuantizer) -> None:
        """Feed ``module``'s inputs to ``quantizer`` while the pass runs."""
        self.quantizers[name] = quantizer

        def accumulate(
            _: nn.Module, args: tuple[torch.Tensor, ...], __: torch.Tensor, name: str = name
        ) -> None:
            self.accumulate(name, args[0])

        self._hooks.append(module.register_forward_hook(accumulate))

    def unhook(self) -> None:
        """Remove the hooks (the quantizers stay until :meth:`clear`)."""
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()
        self._last_input = None
        self._share_with.clear()

    def clear(self) -> None:
        """Drop the quantizers (and their Hessians)."""
        self.quantizers.clear()

    def accumulate(self, name: str, x: torch.Tensor) -> None:
        """Feed one module's input to its Hessian, or share the Hessian of the module that read
        the same tensor just before."""
        last = self._last_input
        quantizers = self.quantizers
        if last is not None and last[0] is x and last[1] != name:
            owner = self._share_with.get(last[1], last[1])
            if name not in self._share_with:
                if quantizers[name].nsamples:
                    raise RuntimeError(f"{name}: its input became shared after the first batch")
                self._share_with[name] = owner
                quantizers[name].accumulator = quantizers[owner].accumulator
                logger.debug("%s shares the Hessian of %s (same input)", name, owner)
            elif self._share_with[name] != owner:
                raise RuntimeError(f"{name}: its input is no longer the input of {owner}")
            return
        if name in self._share_with:
            raise RuntimeError(
                f"{name}: its input is no longer the input of {self._share_with[name]}"
            )
        quantizers[name].add_batch(x)
        self._last_input = (x, name)

    def all_reduce(self, names: Sequence[str], reduce: Callable[[torch.Tensor], None]) -> None:
        """Sum the Hessians of ``names`` over a process group, each shared one once (the same
        order, and the same sharing, in every process)."""
        reduced: set[int] = set()
        for name in names:
            accumulator = self.quantizers[name].accumulator
            if id(accumulator) not in reduced:
                reduced.add(id(accumulator))
                accumulator.all_reduce(reduce)
