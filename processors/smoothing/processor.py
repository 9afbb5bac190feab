"""The smoothing processors ``smooth_quant``, ``iter_smooth`` and ``flex_smooth_quant`` (and the
base of ``flex_awq_ssz``, :mod:`.awq_processor`).

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

The smoothed float layer computes the same function as the original, up to float rounding, and
proves it during the run (:mod:`msquant.check`, on the run's probe tokens): in ``before_layer``
every norm's form is measured (its ``offset + weight`` gain; LayerNorm or RMSNorm), no folded
weight may be shared outside the layer, and each subgraph's data flow is shown on data (scaling
the producer's output channels scales its readers' inputs and nothing else; a routed expert
msquant split itself is exact by construction, ``SmoothingSubgraph.exact_by``, as the probe tokens
may not reach it; experts in a layout msquant does not know are refused); in ``after_pass``
the layer's output is compared with the one before after each subgraph's fold. A subgraph whose
names do not match the model's wiring is refused there, naming the layer and the pair, before
anything is written.
"""

from __future__ import annotations

import logging
from dataclasses import replace

import torch
from torch import nn

from msquant.plugin import (
    CalibrationSize,
    ConfigIssue,
    DecoderLayer,
    ModelAdapter,
    Processor,
    ProcessorConfig,
    QuantizationError,
    RunContext,
    TransformCheckError,
    adapter_for,
)
from msquant.plugin.checks import (
    FlowPair,
    FunctionCheck,
    LayerSnapshot,
    TransformProbe,
    layer_fingerprint,
    ov_channel_map,
    prove_flow,
    shared_weight_problems,
)
from msquant.plugin.model import (
    SmoothingSubgraph,
    first_matching_pattern,
    norm_form_problem,
    unknown_expert_modules,
)
from msquant.processors.smoothing.config import (
    FlexSmoothQuantConfig,
    IterSmoothConfig,
    SmoothingConfig,
    SmoothQuantConfig,
    smoothing_issues,
)
from msquant.processors.smoothing.folding import MAX_SEARCH_TOKENS, ScaleRule, smooth_subgraph
from msquant.processors.smoothing.memory import smoothing_memory
from msquant.processors.smoothing.msmodelslim_adapters import nothing_to_smooth, restricted_types
from msquant.processors.smoothing.statistics import InputStatistics

__all__ = ["FlexSmoothQuantProcessor", "IterSmoothProcessor", "SmoothQuantProcessor"]

logger = logging.getLogger(__name__)

#: What a user can do when a subgraph's data flow does not hold on the model.
FIX = (
    ". The subgraphs come from the model adapter (module names; docs/developer/add-model-adapter.md): "
    "an architecture wired otherwise needs an adapter declaring its norm_layout or "
    "smoothing_subgraphs; or leave the subgraph out (exclude, enable_subgraph_type)"
)


def _short(name: str, layer: DecoderLayer) -> str:
    prefix = layer.name + "."
    return name[len(prefix) :] if name.startswith(prefix) else name


def _label(subgraph: SmoothingSubgraph, layer: DecoderLayer) -> str:
    targets = ", ".join(_short(t, layer) for t in subgraph.targets)
    return f"{subgraph.kind} {_short(subgraph.source, layer)} -> {targets}"


def flow_pair(model: nn.Module, subgraph: SmoothingSubgraph, layer: DecoderLayer) -> FlowPair:
    """The data flow a subgraph's fold relies on: its source's output channels are its targets'
    input channels (through the key/value heads for ``ov``)."""
    channel_map = None
    if subgraph.kind == "ov" and subgraph.heads is not None:
        heads, kv_heads = subgraph.heads
        source = model.get_submodule(subgraph.source)
        assert isinstance(source, nn.Linear)
        channel_map = ov_channel_map(heads, kv_heads, source.out_features)
    return FlowPair(_label(subgraph, layer), subgraph.source, subgraph.targets, channel_map)


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
    #: nothing carries from one layer to the next (statistics are a layer's own); the
    #: checkpoint holds the finished layers' smoothed float tensors
    resumable = True

    def __init__(self, config: ProcessorConfig) -> None:
        super().__init__(config)
        self._statistics = InputStatistics(self.keeps_rows)
        self._subgraphs: list[SmoothingSubgraph] = []
        self._adapter: ModelAdapter | None = None
        self._reference: torch.Tensor | None = None
        self._fingerprint: tuple[tuple[int, int, int], ...] | None = None
        #: the types this entry smooths in the run (``setup``: ``--model_type`` may restrict them)
        self._types = self.config.subgraph_types

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
        kinds = self._types
        chosen = [
            s
            for s in adapter.smoothing_subgraphs(model, layer)
            if s.kind in kinds
            and first_matching_pattern(s.source, include) is not None
            and first_matching_pattern(s.source, exclude) is None
        ]
        return sorted(chosen, key=lambda s: kinds.index(s.kind))

    def unknown_experts(self, layers: list[DecoderLayer]) -> list[str]:
        """The routed experts modules this entry would smooth (up-down, selected by its globs
        as their up_proj would be) whose layout msquant does not know."""
        if "up-down" not in self._types:
            return []
        include = self.config.include or ["*"]
        exclude = self.config.exclude or []
        return [
            name
            for layer in layers
            for name in unknown_expert_modules(layer)
            if first_matching_pattern(f"{name}.0.up_proj", include) is not None
            and first_matching_pattern(f"{name}.0.up_proj", exclude) is None
        ]

    def check_model(self, model: nn.Module, layers: list[DecoderLayer]) -> list[str]:
        unknown = self.unknown_experts(layers)
        if unknown:
            return [
                f"{self.type_name}: up-down smoothing of the routed experts of "
                f"{', '.join(unknown)} (type {type(model.get_submodule(unknown[0])).__name__}): "
                "msquant smooths experts held as one MLP per expert (up_proj, down_proj linear "
                "layers; transformers' fused gate_up_proj / down_proj are split so) and cannot "
                "prove a fold into this layout keeps the function; exclude them (e.g. exclude: "
                "['*mlp.experts.*']) or drop up-down from enable_subgraph_type"
            ]
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

    def memory_bytes(
        self, model: nn.Module, layer: DecoderLayer, calibration: CalibrationSize
    ) -> dict[str, int]:
        """Statistics, search rows and the largest fold's working copies (:mod:`.memory`)."""
        subgraphs = self.selected_subgraphs(model, layer)
        return smoothing_memory(model, subgraphs, calibration, self.keeps_rows)

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
        name = ctx.msmodelslim_model_type  # --model_type: msModelSlim's adapter decides types
        self._types = restricted_types(self.type_name, self.config.subgraph_types, name)
        if name is not None and not any(self.selected_subgraphs(ctx.model, x) for x in ctx.layers):
            raise QuantizationError(nothing_to_smooth(self.type_name, self.config, name))

    def before_layer(self, ctx: RunContext, layer: DecoderLayer) -> None:
        """Select the layer's subgraphs, measure their norms and prove their data flow."""
        self._statistics.clear()
        self._reference = self._fingerprint = None
        self._subgraphs = self._with_norm_forms(
            ctx.model, self.selected_subgraphs(ctx.model, layer)
        )
        if ctx.probe is not None and self._subgraphs:
            self._prove(ctx.probe, ctx.model, layer)

    def _with_norm_forms(
        self, model: nn.Module, subgraphs: list[SmoothingSubgraph]
    ) -> list[SmoothingSubgraph]:
        """``subgraphs`` with each norm's measured gain offset (a norm of another form, or one
        contradicting the offset the adapter declares, is refused)."""
        measured = []
        for subgraph in subgraphs:
            if subgraph.kind != "norm-linear":
                measured.append(subgraph)
                continue
            norm = model.get_submodule(subgraph.source)
            form, problem = norm_form_problem(
                norm, subgraph.source, subgraph.norm_offset, allow_centered=True, allow_bias=True
            )
            if problem is not None or form is None:
                raise TransformCheckError(f"{self.type_name}: {problem}{FIX}")
            measured.append(replace(subgraph, norm_offset=form.offset))
        return measured

    def _prove(self, probe: TransformProbe, model: nn.Module, layer: DecoderLayer) -> None:
        """Refuse folds into weights shared outside the layer; prove every subgraph's data flow
        on the probe and keep the layer's output as the reference of the function check."""
        modules = [name for s in self._subgraphs for name in (s.source, *s.targets)]
        shared = shared_weight_problems(model, layer.name, dict.fromkeys(modules))
        if shared:
            raise TransformCheckError(f"{self.type_name}: {layer.name}: " + "; ".join(shared) + FIX)
        # a routed expert msquant split itself is exact by construction (the probe tokens may
        # not reach it); every fold is still covered by the layer's function check
        pairs = [flow_pair(model, s, layer) for s in self._subgraphs if s.exact_by is None]
        self._reference = prove_flow(probe, model, pairs, self.type_name, fix=FIX)
        self._fingerprint = layer_fingerprint(layer.module)

    def before_pass(self, ctx: RunContext, layer: DecoderLayer, index: int) -> None:
        if index != 0:
            return
        for subgraph in self._subgraphs:
            first = subgraph.targets[0]
            self._statistics.hook(first, ctx.model.get_submodule(first))

    def after_pass(self, ctx: RunContext, layer: DecoderLayer, index: int) -> None:
        """Fold every subgraph's scales (in priority order) once its statistics are in, then
        check that the layer still computes what it did."""
        self._statistics.unhook()
        if index != 0:
            return
        check = snapshot = None
        if ctx.probe is not None and self._subgraphs:
            unchanged = layer_fingerprint(layer.module) == self._fingerprint
            reference = self._reference if unchanged else None
            check = FunctionCheck(ctx.probe, self.type_name, reference, fix=FIX)
            snapshot = LayerSnapshot(layer.module)
        folded = [s for s in self._subgraphs if self._fold(ctx.model, layer, s)]
        if check is not None and snapshot is not None and folded:
            self._check_folds(ctx.model, layer, folded, check, snapshot)
        for subgraph in folded:
            if subgraph.kind == "norm-linear":
                self._record_norm(ctx, subgraph.source)
        self._statistics.clear()
        self._reference = None

    def _fold(self, model: nn.Module, layer: DecoderLayer, subgraph: SmoothingSubgraph) -> bool:
        """Compute and fold one subgraph's scales; False when it saw no calibration token."""
        first = subgraph.targets[0]
        act_max = self._act_statistic(first)
        if act_max is None:
            logger.warning(
                "%s: %s saw no calibration token, left unsmoothed", self.type_name, first
            )
            return False
        rows = self._statistics.spaced_rows(first, MAX_SEARCH_TOKENS) if self.keeps_rows else None
        scales = smooth_subgraph(model, subgraph, self.rule(), act_max, rows)
        self._prepare_source(model, subgraph)
        logger.debug(
            "%s: %s, scales in [%.3g, %.3g]",
            self.type_name,
            _label(subgraph, layer),
            float(scales.min()),
            float(scales.max()),
        )
        return True

    def _act_statistic(self, name: str) -> torch.Tensor | None:
        """The per-channel activation statistic of the scales: the absolute maximum of the
        input of ``name`` over the calibration tokens (None when it saw none)."""
        return self._statistics.channel_max.get(name)

    def _check_folds(
        self,
        model: nn.Module,
        layer: DecoderLayer,
        folded: list[SmoothingSubgraph],
        check: FunctionCheck,
        snapshot: LayerSnapshot,
    ) -> None:
        """One check of the layer after all of its folds; when it fails, the layer is put back
        and folded again one subgraph at a time, each checked, so that the message names the
        fold that changes the layer's function (the run stops either way)."""
        try:
            check.verify(f"the folds of {', '.join(_label(s, layer) for s in folded)}")
        except TransformCheckError:
            snapshot.restore()
            for subgraph in folded:
                self._fold(model, layer, subgraph)
                check.verify(f"the {_label(subgraph, layer)} fold")
            raise

    def _prepare_source(self, model: nn.Module, subgraph: SmoothingSubgraph) -> None:
        """Hook for a processor that changes a smoothed subgraph's source module."""

    def _record_norm(self, ctx: RunContext, norm: str) -> None:
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
        self._reference = self._fingerprint = None


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
