"""The smoothing processors ``smooth_quant``, ``iter_smooth`` and ``flex_smooth_quant``.

Sample yaml (msModelSlim's W8A8_DYNAMIC practice)::

    spec:
      process:
        - type: iter_smooth            # or flex_smooth_quant / smooth_quant
          alpha: 0.9
          enable_subgraph_type: ['norm-linear', 'ov', 'up-down']
        - type: linear_quant
          qconfig:
            act: {scope: per_token, dtype: int8, symmetric: true, method: minmax}
            weight: {scope: per_channel, dtype: int8, symmetric: true, method: minmax}

Lifecycle, per decoder layer: ``before_layer`` asks the model adapter for the layer's subgraphs
(:meth:`msquant.ModelAdapter.smoothing_subgraphs`) and keeps those of the enabled types whose
producing module the include/exclude globs select; ``before_pass`` hooks the first linear of each
to record the per-channel absolute maximum of its input (and, for the alpha/beta search, the input
rows); ``after_pass`` computes the scales and folds them into the weights, in msModelSlim's order
(up-down, ov, linear-linear, norm-linear). The processor sets ``rewrites_layer``: the processors
after it in ``spec.process`` gather their statistics (static activation ranges, GPTQ Hessians) in
passes of their own over the smoothed layer, and ``linear_quant`` quantizes the smoothed weights.
The smoothed float layer computes the same function as the original, up to float rounding.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from msquant import ConfigIssue, QuantizationError
from msquant.plugin import (
    DecoderLayer,
    ModelAdapter,
    Processor,
    ProcessorConfig,
    RunContext,
    SmoothingSubgraph,
    adapter_for,
    first_matching_pattern,
)
from msquant.processors.smoothing.config import (
    FlexSmoothQuantConfig,
    IterSmoothConfig,
    SmoothingConfig,
    SmoothQuantConfig,
    smoothing_issues,
)
from msquant.processors.smoothing.folding import MAX_SEARCH_TOKENS, ScaleRule, smooth_subgraph
from msquant.processors.smoothing.statistics import InputStatistics

__all__ = ["FlexSmoothQuantProcessor", "IterSmoothProcessor", "SmoothQuantProcessor"]

logger = logging.getLogger(__name__)


class SmoothingProcessor(Processor):
    """What the three smoothing processors share; subclasses give the config and the rule."""

    stage = "process"
    config: SmoothingConfig
    requires_calibration = True
    rewrites_layer = True
    #: folded norms and scaled weights compute what the original computes, tensor by tensor
    #: different: the export records it (and the smoothed norms' fingerprints), and
    #: ``msquant verify --model_path`` compares the outputs on a few tokens, not the tensors
    transforms_weights = True
    #: the input rows of each subgraph are kept for the alpha/beta search
    keeps_rows: bool = False

    def __init__(self, config: ProcessorConfig) -> None:
        super().__init__(config)
        self._statistics = InputStatistics(self.keeps_rows)
        self._subgraphs: list[SmoothingSubgraph] = []
        self._adapter: ModelAdapter | None = None

    @classmethod
    def check_config(cls, config: ProcessorConfig) -> list[ConfigIssue]:
        assert isinstance(config, SmoothingConfig)
        return smoothing_issues(config)

    def rule(self) -> ScaleRule:
        """How this processor turns statistics into scales."""
        raise NotImplementedError

    def selected_subgraphs(self, model: nn.Module, layer: DecoderLayer) -> list[SmoothingSubgraph]:
        """The layer's subgraphs this entry smooths, in the order their folds apply."""
        adapter = self._adapter or adapter_for(model)
        include = self.config.include or ["*"]
        exclude = self.config.exclude or []
        kinds = self.config.subgraph_types
        chosen = [
            s
            for s in adapter.smoothing_subgraphs(model, layer)
            if s.kind in kinds
            and first_matching_pattern(s.source, include) is not None
            and first_matching_pattern(s.source, exclude) is None
        ]
        return sorted(chosen, key=lambda s: kinds.index(s.kind))

    def check_model(self, model: nn.Module, layers: list[DecoderLayer]) -> list[str]:
        if any(self.selected_subgraphs(model, layer) for layer in layers):
            return []
        return [
            f"{self.type_name}: no subgraph to smooth in {type(model).__name__} (types "
            f"{', '.join(self.config.subgraph_types)}, include {self.config.include or ['*']}, "
            f"exclude {self.config.exclude or []}); the model adapter finds a norm feeding "
            "q/k/v_proj or gate/up_proj, v_proj -> o_proj and up_proj -> down_proj by name: "
            "check the globs, or give the architecture a model adapter that overrides "
            "smoothing_subgraphs"
        ]

    def setup(self, ctx: RunContext) -> None:
        """Statistics are maxima over the whole calibration set (and the search needs every
        token): a ``dp_layer_wise`` group, where each process sees its share, is refused."""
        if ctx.dist.world_size > 1:
            raise QuantizationError(
                f"{self.type_name}: smoothing statistics are taken over the whole calibration "
                f"set, which a dp_layer_wise group of {ctx.dist.world_size} processes would "
                "split; run it in one process (spec.runner: layer_wise, no --nproc / device list)"
            )
        self._adapter = adapter_for(ctx.model)

    def before_layer(self, ctx: RunContext, layer: DecoderLayer) -> None:
        self._statistics.clear()
        self._subgraphs = self.selected_subgraphs(ctx.model, layer)

    def before_pass(self, ctx: RunContext, layer: DecoderLayer, index: int) -> None:
        if index != 0:
            return
        for subgraph in self._subgraphs:
            first = subgraph.targets[0]
            self._statistics.hook(first, ctx.model.get_submodule(first))

    def after_pass(self, ctx: RunContext, layer: DecoderLayer, index: int) -> None:
        """Fold every subgraph's scales (in priority order) once its statistics are in."""
        self._statistics.unhook()
        if index != 0:
            return
        rule = self.rule()
        for subgraph in self._subgraphs:
            first = subgraph.targets[0]
            act_max = self._statistics.channel_max.get(first)
            if act_max is None:
                logger.warning(
                    "%s: %s saw no calibration token, left unsmoothed", self.type_name, first
                )
                continue
            rows = (
                self._statistics.spaced_rows(first, MAX_SEARCH_TOKENS) if self.keeps_rows else None
            )
            scales = smooth_subgraph(ctx.model, subgraph, rule, act_max, rows)
            self._prepare_source(ctx.model, subgraph)
            if subgraph.kind == "norm-linear":
                self._fingerprint(ctx, subgraph.source)
            logger.debug(
                "%s: %s %s -> %s, scales in [%.3g, %.3g]",
                self.type_name,
                subgraph.kind,
                subgraph.source,
                ", ".join(subgraph.targets),
                float(scales.min()),
                float(scales.max()),
            )
        self._statistics.clear()

    def _prepare_source(self, model: nn.Module, subgraph: SmoothingSubgraph) -> None:
        """Hook for a processor that changes a smoothed subgraph's source module."""

    def _fingerprint(self, ctx: RunContext, norm: str) -> None:
        """Record the weight and bias smoothing left a norm with (the scales folded in;
        ``msquant verify`` checks the exported norm against them)."""
        module = ctx.model.get_submodule(norm)
        for kind in ("weight", "bias"):
            tensor = getattr(module, kind, None)
            if isinstance(tensor, torch.Tensor):
                ctx.transforms.fingerprint(self.type_name, ctx.disk_name(f"{norm}.{kind}"), tensor)

    def after_layer(self, ctx: RunContext, layer: DecoderLayer) -> None:
        self._statistics.clear()
        self._subgraphs = []


class SmoothQuantProcessor(SmoothingProcessor):
    """``smooth_quant``: SmoothQuant with msModelSlim's fields (``alpha`` 0.5), norm -> linears.

    As msModelSlim does, each smoothed norm gets a bias (zero, since smoothing is symmetric) when
    it has none, so the export carries ``<norm>.bias`` beside ``<norm>.weight``, as its exports
    do (vLLM-Ascend's loader reads a norm bias for anti-outlier W8A8 models).
    """

    type_name = "smooth_quant"
    config_class = SmoothQuantConfig
    config: SmoothQuantConfig

    def rule(self) -> ScaleRule:
        return ScaleRule("iter", self.config.alpha, scale_min=1e-5)

    def _prepare_source(self, model: nn.Module, subgraph: SmoothingSubgraph) -> None:
        if subgraph.kind != "norm-linear":
            return
        norm = model.get_submodule(subgraph.source)
        if getattr(norm, "bias", None) is None:
            weight = norm.weight
            assert isinstance(weight, torch.Tensor)
            norm.bias = nn.Parameter(torch.zeros_like(weight), requires_grad=False)


class IterSmoothProcessor(SmoothingProcessor):
    """``iter_smooth`` (msModelSlim's defaults: ``alpha`` 0.9, ``scale_min`` 1e-5, all types)."""

    type_name = "iter_smooth"
    config_class = IterSmoothConfig
    config: IterSmoothConfig

    def rule(self) -> ScaleRule:
        return ScaleRule("iter", self.config.alpha, scale_min=self.config.scale_min)


class FlexSmoothQuantProcessor(SmoothingProcessor):
    """``flex_smooth_quant``: ``alpha`` / ``beta`` given, or searched per subgraph on a 0.05
    grid by the int8 error of the smoothed product (at most
    :data:`~msquant.processors.smoothing.folding.MAX_SEARCH_TOKENS` tokens)."""

    type_name = "flex_smooth_quant"
    config_class = FlexSmoothQuantConfig
    config: FlexSmoothQuantConfig

    def __init__(self, config: ProcessorConfig) -> None:
        assert isinstance(config, FlexSmoothQuantConfig)
        self.keeps_rows = config.alpha is None or config.beta is None
        super().__init__(config)

    def rule(self) -> ScaleRule:
        return ScaleRule("flex", self.config.alpha, self.config.beta)
