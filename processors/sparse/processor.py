"""``float_sparse``: msModelSlim 26.1.0's float sparsity (W16A16S), its processor of that name.

Sample yaml (msModelSlim's practice ``qwen3/qwen3-32b-dense-w16a16s.yaml``)::

    spec:
      process:
        - type: float_sparse
          sparse_ratio: 0.4      # share of each selected linear's weights set to zero, [0, 1]
          include: ["*"]         # globs on linear names; empty = all
          exclude: []
      save:
        - type: ascendv1_saver

Per decoder layer, every selected ``nn.Linear`` gathers the statistics of its calibration inputs
(one sample at a time, through the layer as the processors before this one left it), then its
weight is pruned by ADMM and rounded as msModelSlim does (:mod:`msquant.processors.sparse.admm`):
at least ``int(sparse_ratio * numel)`` zeros per weight, the weight stays in the model's dtype.
The next layer calibrates on the pruned layer's outputs, as in msModelSlim. The Ascend export
types the pruned linears' ``weight`` (and ``bias``) ``W16A16S``; ``model_quant_type`` is
``W16A16S`` when nothing ranks higher. A saver that does not store W16A16S refuses the run.

Refused: a selected linear that a later ``spec.process`` entry quantizes (msModelSlim's
sparse linears are no longer ``nn.Linear`` there and stay float; msquant does not quantize a
pruned weight), and runs over several processes (msModelSlim's processor is not distributed).
"""

from __future__ import annotations

import logging
from typing import Literal

import torch
from pydantic import Field
from torch import nn
from torch.utils.hooks import RemovableHandle

from msquant.plugin import (
    ConfigIssue,
    DecoderLayer,
    Processor,
    ProcessorConfig,
    QuantizationError,
    RunContext,
)
from msquant.plugin.model import is_selected, unmatched_patterns
from msquant.processors.sparse.admm import InputStats, sparsify

__all__ = ["FloatSparseConfig", "FloatSparseProcessor", "W16A16S"]

logger = logging.getLogger(__name__)

#: The description type of a pruned linear's tensors (the Ascend saver's ``tensor_kinds``).
W16A16S = "W16A16S"


class FloatSparseConfig(ProcessorConfig):
    """Config of ``float_sparse`` (msModelSlim's fields: ``sparse_ratio``, ``include``,
    ``exclude``)."""

    type: Literal["float_sparse"] = "float_sparse"
    sparse_ratio: float = Field(
        default=0.3, description="Share of each selected linear's weights set to zero, in [0, 1]."
    )
    include: list[str] = Field(
        default_factory=list, description="Globs on linear module names; empty = all."
    )
    exclude: list[str] = Field(default_factory=list, description="Globs that win over include.")


class FloatSparseProcessor(Processor):
    """`float_sparse`: prunes the selected linears by ADMM to W16A16S (module docstring)."""

    type_name = "float_sparse"
    config_class = FloatSparseConfig
    config: FloatSparseConfig
    requires_calibration = True
    calibrate_on_quantized = True
    batch_calibration = False

    def __init__(self, config: ProcessorConfig) -> None:
        super().__init__(config)
        self._stats: dict[str, InputStats] = {}
        self._hooks: list[RemovableHandle] = []
        self._pruned: list[str] = []
        self._seen: set[str] = set()
        self._exported: list[str] = []

    @classmethod
    def check_config(cls, config: ProcessorConfig) -> list[ConfigIssue]:
        assert isinstance(config, FloatSparseConfig)
        ratio = config.sparse_ratio
        if not 0.0 <= ratio <= 1.0:
            return [ConfigIssue("sparse_ratio", f"{ratio} is outside [0, 1]")]
        return []

    def _linears(self, layer: DecoderLayer) -> list[tuple[str, nn.Linear]]:
        """The selected ``nn.Linear`` modules of ``layer``, ``(full name, module)``."""
        include = self.config.include or ["*"]
        found = []
        for name, module in layer.module.named_modules(prefix=layer.name):
            if isinstance(module, nn.Linear):
                self._seen.add(name)
                if is_selected(name, include, self.config.exclude):
                    found.append((name, module))
        return found

    def check_model(self, model: nn.Module, layers: list[DecoderLayer]) -> list[str]:
        if not any(self._linears(layer) for layer in layers):
            return ["float_sparse: include / exclude select no nn.Linear of a decoder layer"]
        return []

    def setup(self, ctx: RunContext) -> None:
        if ctx.dist.world_size > 1:
            raise QuantizationError(
                "float_sparse: the inputs' Hessians are gathered in one process (as msModelSlim's "
                "processor, which does not support distributed runs); run it in one process"
            )
        self._seen.clear()

    def before_layer(self, ctx: RunContext, layer: DecoderLayer) -> None:
        """Drop the previous layer's tensors from ``ctx.export_tensors``: every saver wrote them
        in its ``after_layer``, and a streamed run must be able to release their storage."""
        for key in self._exported:
            ctx.export_tensors.pop(key, None)
        self._exported.clear()

    def before_pass(self, ctx: RunContext, layer: DecoderLayer, index: int) -> None:
        if index != 0:
            return
        self._check_still_float(ctx)
        for name, module in self._linears(layer):
            stats = InputStats(module.in_features, module.weight.device)
            self._stats[name] = stats

            def gather(
                _: nn.Module,
                args: tuple[torch.Tensor, ...],
                __: torch.Tensor,
                s: InputStats = stats,
            ) -> None:
                s.add(args[0].detach())

            self._hooks.append(module.register_forward_hook(gather))

    def after_pass(self, ctx: RunContext, layer: DecoderLayer, index: int) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()

    def after_layer(self, ctx: RunContext, layer: DecoderLayer) -> None:
        """Prune each selected linear and hand its tensors to the savers as W16A16S."""
        for name, module in self._linears(layer):
            stats = self._stats.pop(name, None)
            if stats is None or stats.samples == 0:
                raise QuantizationError(f"float_sparse: no calibration input reached {name}")
            with torch.no_grad():
                module.weight.copy_(sparsify(module.weight, stats, self.config.sparse_ratio))
            zeros = int((module.weight == 0).sum())
            logger.debug(
                "float_sparse: %s: %d of %d weights zero", name, zeros, module.weight.numel()
            )
            for leaf, tensor in (("weight", module.weight), ("bias", module.bias)):
                if tensor is not None:
                    # under the model's name: it replaces the model's tensor in the export
                    ctx.export_tensors[f"{name}.{leaf}"] = (W16A16S, tensor)
                    self._exported.append(f"{name}.{leaf}")
            self._pruned.append(name)
        self._stats.clear()

    def finalize(self, ctx: RunContext) -> None:
        self._check_still_float(ctx)
        include = [p for p in self.config.include if p != "*"]
        for kind, patterns in (("include", include), ("exclude", self.config.exclude)):
            for pattern in unmatched_patterns(self._seen, patterns):
                logger.warning("float_sparse: %s pattern %r matches no linear", kind, pattern)

    def _check_still_float(self, ctx: RunContext) -> None:
        """Refuse pruned linears that a later ``spec.process`` entry replaced (quantized)."""
        for name in self._pruned:
            if not isinstance(ctx.model.get_submodule(name), nn.Linear):
                raise QuantizationError(
                    f"float_sparse: {name} was pruned (W16A16S) and then replaced by a later "
                    "spec.process entry (quantized); msquant does not quantize a pruned weight "
                    "(msModelSlim leaves W16A16S linears float): exclude the pruned linears "
                    "from that entry, or from float_sparse"
                )
        self._pruned.clear()
