"""``linear_quant``: quantize the weights of selected linear layers (msModelSlim's processor).

Sample yaml::

    spec:
      process:
        - type: linear_quant
          qconfig:
            weight: {scope: per_group, dtype: int4, symmetric: true, method: gptq,
                     ext: {percdamp: 0.01, group_size: 128}}
          include: ["*"]
          exclude: ["*down_proj"]
          dynamic:                                 # GPTQModel's per-module overrides
            '-:.*\\.0\\..*': {}                      # layer 0 stays in float
            '.*\\.(?:1[0-5])\\..*': {bits: 8}           # layers 10-15: int8, the rest from qconfig
            '.*\\.(?:1[6-9]|20|21)\\..*': {bits: 8, group_size: 64}

(Single quotes in YAML: inside double quotes a backslash starts an escape and ``"\\."`` is an error.)

Several entries may each quantize a different set of modules (a module selected by two entries is
refused). ``dynamic`` follows GPTQModel exactly (:mod:`msquant.quant.rules`): regexes matched with
``re.match`` on the full module name, ``-:`` rules (skip) first, then the first matching positive
rule overrides the keys it names (``bits`` 2-8, ``group_size`` with -1 = per-channel, ``sym``,
``desc_act``, ``damp_percent``/``percdamp``, ``mse``, ``static_groups``); no fall-through.

``lm_head: true`` (GPTQModel's flag) also quantizes the output head, as one more stage after the
last decoder layer (calibrated, for GPTQ, on the final norm of the last layer's outputs). Only this
flag selects the head: ``include`` / ``exclude`` globs are about the decoder layers and never
select it (``include: ["*"]`` leaves it in float). With the flag, a ``dynamic`` rule matching the
head's name (``lm_head``) overrides its keys like any module's, a ``-:`` rule keeps it in float;
without a matching rule it takes ``qconfig`` (GPTQModel instead defaults the head to int8 group 32
sym). A positive rule matching ``lm_head`` without the flag leaves the head in float and is
reported as a warning. Models whose head is tied to the input embeddings are refused.

The method (``qconfig.weight.method``) is an object from the ``msquant.methods`` registry
(:class:`msquant.plugin.QuantMethod`): this processor selects modules, resolves their schemes and drives
the calibration; what a module's quantized weight is, the method decides. The helpers live beside
this file: the config and its checks (:mod:`.config`), the checks on the weightless
model (:mod:`.checks`), the calibration passes and Hessians
(:mod:`.calibration`), the solves of a pass (:mod:`.solve`).

Lifecycle:

* ``check_config``: the ``(dtype, scope, method)`` combination is implemented (``ext`` is typed
  per method by the schema), activations are float (weight-only quantization), every ``dynamic``
  rule is a valid regex with known override keys.
* ``check_model`` (meta model): the resolved group size divides the ``in_features`` of every
  selected layer (naming the rule that set it); the shards of a fused layer (q/k/v, gate/up), and
  all experts of an MoE experts module (one FusedMoE layer in vLLM), that this entry selects
  resolve alike; with ``lm_head: true`` the model has a linear output head (and,
  for GPTQ, a final norm to calibrate it on). A head tied to the embeddings is refused by
  :func:`msquant.plugin.planning.check_plan`. Cross-entry checks (overlaps, fused layers split between
  entries) and warnings (include patterns or rules matching nothing, rules that vLLM would match
  differently on fused names) come from :func:`msquant.plugin.planning.check_plan` through :meth:`plan_modules`.
* ``before_pass`` (a calibrated method, e.g. ``gptq``): a forward hook on each selected
  ``nn.Linear`` of the pass feeds its inputs to the method's quantizer (:class:`~msquant.plugin.numerics.GPTQQuantizer`)
  Hessian while the runner pushes the calibration set through the layer. The layer's inputs are
  the outputs of the already quantized previous layers (``ext.calib_inputs: quantized``, the
  default: the processor sets ``calibrate_on_quantized``) or of the float model
  (``calib_inputs: float``, msModelSlim's schedule). There is one pass per layer, or with
  ``ext.experts_per_pass: k`` one per slice of ``k`` MoE experts (the first pass also holds every
  non-expert module): Hessian memory then holds ``k`` experts; with ``ext.true_sequential`` the
  passes go submodule by submodule of the layer (attention, then MLP).
* ``after_pass``: the hooks are removed and the pass's modules solved (their Hessians freed); the
  results wait for ``after_layer``, except with ``true_sequential``, where a submodule's linears
  are replaced after its last pass, so the next submodule's pass runs through them.
* ``after_layer``: each selected ``nn.Linear`` is quantized (round-to-nearest, or the GPTQ result
  of its pass) with its resolved scheme and replaced by a ``QuantizedLinear`` (whose state dict is
  the W8A16 layout savers write); modules skipped by a ``-:`` rule stay ``nn.Linear``.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from functools import cached_property

from torch import nn

from msquant.plugin import (
    ActivationQuant,
    BaseScheme,
    CalibrationSize,
    ConfigIssue,
    DecoderLayer,
    DynamicRule,
    ModelAdapter,
    ModuleReport,
    Processor,
    ProcessorConfig,
    QScope,
    QuantizationError,
    QuantizedLinear,
    QuantizedWeight,
    ResolvedScheme,
    RunContext,
    adapter_for,
)
from msquant.plugin.model import (
    FusedGroup,
    OutputHeadStage,
    engine_names,
    find_output_head,
    first_matching_pattern,
    moe_routers,
    parse_expert_linear,
    replace_module,
    unmatched_patterns,
)
from msquant.plugin.planning import (
    BASE_SOURCE,
    ModuleDecision,
    parse_dynamic,
    resolve_module_scheme,
)
from msquant.processors.linear_quant.act import (
    FP8_DTYPES,
    STATIC_SCHEMES,
    StaticActCalibration,
    act_scheme,
    fp8_activation,
    mx_activation,
)
from msquant.processors.linear_quant.calibration import HessianCollector, plan_passes
from msquant.processors.linear_quant.checks import divisor_problem, fused_problems, head_problems
from msquant.processors.linear_quant.config import METHODS, LinearQuantConfig, config_issues
from msquant.processors.linear_quant.memory import linear_quant_memory
from msquant.processors.linear_quant.solve import Selected, solve_modules

__all__ = ["LinearQuantConfig", "LinearQuantProcessor"]

#: Why an MoE router stays float whatever the entry selects (see :func:`msquant.plugin.model.moe_routers`).
ROUTER_REASON = "MoE router: kept float (vLLM, vLLM-Ascend and SGLang load routers unquantized)"

logger = logging.getLogger(__name__)


def _glob_match(name: str, patterns: Sequence[str]) -> str | None:
    """The first glob of ``patterns`` matching ``name`` (case-sensitive), or None."""
    return first_matching_pattern(name, patterns)


class LinearQuantProcessor(Processor):
    """Weight-only quantization of ``nn.Linear`` layers (decoder layers; the head on request)."""

    type_name = "linear_quant"
    config_class = LinearQuantConfig
    stage = "process"
    config: LinearQuantConfig
    #: Nothing is carried from one layer to the next (the report entries go to ctx.report).
    resumable = True

    def __init__(self, config: ProcessorConfig) -> None:
        super().__init__(config)
        weight = self.config.qconfig.weight
        self.method = METHODS.get(weight.method)(weight)
        #: W8A8 / W8A8_DYNAMIC / W4A8_DYNAMIC, or None for float activations (:mod:`.act`).
        self.act_scheme = act_scheme(self.config.qconfig.act, weight)
        static = self.act_scheme in STATIC_SCHEMES
        self.requires_calibration = self.method.calibrated or static
        self.calibrate_on_quantized = self.method.calibrated and self.method.calibrate_on_quantized
        # static ranges are gathered online, sample by sample in the dataset's order (msModelSlim)
        self.batch_calibration = not static
        self._act_calibration = (
            StaticActCalibration(
                self.config.qconfig.act.symmetric, pd_mix=self.act_scheme == "W8A8_MIX"
            )
            if static
            else None
        )
        self._rtn: dict[str, QuantizedWeight] = {}  # this layer's weights, quantized to calibrate
        self._pass_plan: dict[str, int] = {}  # this layer's module -> calibration pass
        self._apply_after: dict[int, list[str]] = {}  # pass -> modules quantized after it
        self._collector = HessianCollector()
        self._solved: dict[str, tuple[QuantizedWeight, ModuleReport]] = {}  # this layer's
        self._adapter: ModelAdapter | None = None  # the model's (set at plan time and in setup)

    def setup(self, ctx: RunContext) -> None:
        """Static activation ranges are calibrated online over the whole calibration set in
        order; a ``dp_layer_wise`` group would give each process its share (refused)."""
        if self._act_calibration is not None and ctx.dist.world_size > 1:
            raise QuantizationError(
                f"linear_quant: static per_tensor activations ({self.act_scheme}) are calibrated online, one "
                "sample after the other over the whole calibration set, which a dp_layer_wise "
                f"group of {ctx.dist.world_size} processes would split; run it in one process "
                "(spec.runner: layer_wise, no --nproc / device list) or use per_token activations"
            )
        self._adapter = adapter_for(ctx.model)

    @classmethod
    def check_config(cls, config: ProcessorConfig) -> list[ConfigIssue]:
        assert isinstance(config, LinearQuantConfig)
        return config_issues(config)

    @cached_property
    def base_scheme(self) -> BaseScheme:
        """The scheme ``qconfig`` gives every selected module no rule overrides."""
        return self.method.base_scheme()

    @cached_property
    def rules(self) -> tuple[DynamicRule, ...]:
        """The ``dynamic`` rules in evaluation order (negative first); validated by check_config."""
        rules, issues = parse_dynamic(self.config.dynamic, self.method.rule_keys)
        if issues:
            raise ValueError("; ".join(str(issue) for issue in issues))
        return rules

    def decide(
        self, name: str, head: bool = False, groups: Sequence[FusedGroup] = ()
    ) -> ModuleDecision:
        """What this entry does with module ``name``: not selected (with the exclude glob that
        dropped it), or its resolved scheme (possibly skipped by a ``-:`` rule).

        :param head: ``name`` is the output head, which only ``lm_head: true`` selects (globs
            never do); its ``dynamic`` rules apply as to any module.
        :param groups: the fused layers / experts modules serving engines load ``name`` as part
            of (:func:`msquant.plugin.model.engine_names`); ``dynamic`` rules written for them apply to it.
        """
        if head:
            if not self.config.lm_head:
                return ModuleDecision(None, self.method.name, "lm_head: false")
            return ModuleDecision(
                resolve_module_scheme(name, self.base_scheme, self.rules), self.method.name
            )
        excluded = _glob_match(name, self.config.exclude)
        if excluded is not None:
            return ModuleDecision(None, self.method.name, f"exclude {excluded}")
        if _glob_match(name, self.config.include) is None:
            return ModuleDecision(None, self.method.name)
        return ModuleDecision(
            resolve_module_scheme(name, self.base_scheme, self.rules, groups),
            self.method.name,
            act=self.act_scheme,
            data_free=not self.requires_calibration,
            static_act_only=self._act_calibration is not None and not self.method.calibrated,
        )

    def selected(self, layer: DecoderLayer) -> list[tuple[str, nn.Linear, ResolvedScheme]]:
        """The layer's linear modules this processor quantizes, with their resolved scheme
        (modules a ``-:`` rule skips are left out)."""
        chosen = []
        head = isinstance(layer, OutputHeadStage)
        routers = moe_routers(layer.module, layer.name)
        linears = list(layer.named_linears())
        groups = self._engine_names(name for name, _ in linears)
        for name, module in linears:
            if name in routers:
                continue
            scheme = self.decide(name, head, groups.get(name, ())).scheme
            if scheme is not None and not scheme.skipped:
                chosen.append((name, module, scheme))
        return chosen

    # -- planning (msquant.plugin.planning.ModulePlanner) ----------------------------------------------

    def plan_modules(
        self, model: nn.Module, layers: Sequence[DecoderLayer]
    ) -> Mapping[str, ModuleDecision]:
        """Decision for every linear layer of the decoder layers, plus the output head when
        ``lm_head`` is set or a positive rule matches it (so the plan shows why it stays float)."""
        decisions = {}
        self._adapter = adapter_for(model)
        for layer in layers:
            routers = moe_routers(layer.module, layer.name)
            names = [name for name, _ in layer.named_linears()]
            groups = self._engine_names(names)
            for name in names:
                decisions[name] = (
                    ModuleDecision(None, self.method.name, ROUTER_REASON)
                    if name in routers
                    else self.decide(name, groups=groups.get(name, ()))
                )
        head = self._head_name(model)
        if head is not None and (self.config.lm_head or self._positive_rules_matching(head)):
            decisions[head] = self.decide(head, head=True)
        return decisions

    def _engine_names(self, names: Iterable[str]) -> Mapping[str, tuple[FusedGroup, ...]]:
        """The fused layers / experts modules engines load ``names`` as part of, from the model's
        adapter (its own fused names, e.g. Qwen3.5's ``in_proj_qkvz``), so that a ``dynamic``
        rule written for a fused name reaches every shard; the generic table before a model is
        known."""
        if self._adapter is None:
            return engine_names(names)
        return self._adapter.engine_names(names)

    @staticmethod
    def _head_name(model: nn.Module) -> str | None:
        found = find_output_head(model)
        return found[0] if found is not None else None

    def _positive_rules_matching(self, name: str) -> list[DynamicRule]:
        return [rule for rule in self.rules if not rule.negative and rule.matches(name)]

    def uses_output_head(self, ctx: RunContext) -> bool:
        """Whether the run needs the head stage: ``lm_head`` set and no ``-:`` rule skips it."""
        head = self._head_name(ctx.model) if self.config.lm_head else None
        if head is None:
            return False
        scheme = self.decide(head, head=True).scheme
        return scheme is not None and not scheme.skipped

    def plan_rules(self) -> Sequence[DynamicRule]:
        """The ``dynamic`` rules in evaluation order."""
        return self.rules

    def plan_notes(self, model: nn.Module, layers: Sequence[DecoderLayer]) -> list[str]:
        """Include patterns that match no linear layer of the decoder layers, and settings that
        do not do what they seem to for the output head."""
        names = [name for layer in layers for name, _ in layer.named_linears()]
        notes = []
        for key in ("include", "exclude"):
            missing = unmatched_patterns(names, getattr(self.config, key))
            if missing:
                notes.append(
                    f"linear_quant {key} pattern(s) matched no decoder linear layer: {missing} "
                    "(globs match the full module name, e.g. *q_proj or model.layers.0.*)"
                )
        head = self._head_name(model)
        return notes + (self._head_notes(head) if head is not None else [])

    def _head_notes(self, head: str) -> list[str]:
        """Warnings about the head: rules matching it without ``lm_head``, excludes that do
        not apply to it, a ``-:`` rule cancelling ``lm_head: true``."""
        if not self.config.lm_head:
            return [
                f"{rule.source} matches {head}, but the output head is quantized only with "
                f"lm_head: true (GPTQModel's rule), so {head} stays in float; set lm_head: true "
                "to quantize it with this rule"
                for rule in self._positive_rules_matching(head)
            ]
        notes = []
        excluded = _glob_match(head, self.config.exclude)
        if excluded is not None:
            notes.append(
                f"exclude {excluded} matches {head}, but globs do not apply to the output head: "
                "lm_head: true quantizes it (set lm_head: false to keep it in float)"
            )
        scheme = self.decide(head, head=True).scheme
        if scheme is not None and scheme.skipped:
            notes.append(
                f"lm_head: true, but {scheme.decided_by} leaves {head} in float (negative rules "
                "win); drop one of the two"
            )
        return notes

    def check_model(self, model: nn.Module, layers: list[DecoderLayer]) -> list[str]:
        decisions = self.plan_modules(model, layers)
        problems = []
        for layer in layers:
            for name, module in layer.named_linears():
                scheme = decisions[name].scheme
                if scheme is not None and not scheme.skipped:
                    problems += divisor_problem(name, module, scheme, self.rules)
        if self.config.lm_head:
            problems += head_problems(model, layers, decisions, self.method, self.rules)
        if self.act_scheme in STATIC_SCHEMES:
            problems += [
                f"linear_quant: {name}: static per_tensor activations ({self.act_scheme}) on MoE experts are not "
                "implemented (vLLM-Ascend has no W8A8 or W8A8_MIX MoE scheme, as of 0.30.0rc2: its "
                "MoE schemes are dynamic): "
                "use act scope per_token (W8A8_DYNAMIC) or exclude the experts ('*.experts.*')"
                for name, decision in decisions.items()
                if decision.scheme is not None
                and not decision.scheme.skipped
                and parse_expert_linear(name) is not None
            ][:1]
        return problems + fused_problems(decisions)

    def memory_bytes(
        self, model: nn.Module, layer: DecoderLayer, calibration: CalibrationSize
    ) -> dict[str, int]:
        """The quantized copy of the layer's selected linears, and the Hessians, solves, fake-
        quantized weights or rounding copies of its method (:mod:`.memory`)."""
        if self._adapter is None:
            self._adapter = adapter_for(model)
        return linear_quant_memory(
            layer, self.selected(layer), self.method, self._act_calibration is not None
        )

    # -- calibration (methods that learn from data) ---------------------------------------------

    def calibration_passes(self, layer: DecoderLayer) -> int:
        """One pass; one per slice of ``ext.experts_per_pass`` MoE experts; with
        ``true_sequential``, that for each submodule (attention, MLP) of the layer in turn."""
        if not self.method.calibrated:
            return 1
        plan, _ = self._plan_passes(layer)
        return 1 + max(plan.values(), default=0)

    def _plan_passes(self, layer: DecoderLayer) -> tuple[dict[str, int], dict[int, list[str]]]:
        selected = [name for name, _, _ in self.selected(layer)]
        method = self.method
        return plan_passes(layer, selected, method.true_sequential, method.experts_per_pass)

    def before_layer(self, ctx: RunContext, layer: DecoderLayer) -> None:
        self._solved.clear()
        self._pass_plan, self._apply_after = (
            self._plan_passes(layer) if self.method.calibrated else ({}, {})
        )

    def before_pass(self, ctx: RunContext, layer: DecoderLayer, index: int) -> None:
        """Hook the modules whose Hessians this pass gathers, or whose static activation ranges
        it calibrates (W8A8: with their weights quantized, as msModelSlim calibrates)."""
        if self._act_calibration is not None and index == 0:
            for name, module, scheme in self.selected(layer):
                qweight = self._rtn[name] = self.method.quantize_rtn(module.weight, scheme, name)
                fake_weight = qweight.dequantize().to(module.weight.dtype)
                self._act_calibration.hook(name, module, fake_weight)
        if not self.method.calibrated:
            return
        for name, module, scheme in self.selected(layer):
            if self._pass_plan[name] == index:
                quantizer = self.method.new_quantizer(name, module.in_features, scheme)
                self._collector.hook(name, module, quantizer)

    def after_pass(self, ctx: RunContext, layer: DecoderLayer, index: int) -> None:
        """Solve the modules of this pass and free their Hessians; the layer keeps its float
        weights (the next pass, and the next layer's inputs, are computed with them)."""
        self._collector.unhook()
        if self._act_calibration is not None:
            self._act_calibration.unhook()
        if not self.method.calibrated:
            return
        modules = [m for m in self.selected(layer) if self._pass_plan[m[0]] == index]
        if modules:
            solved = solve_modules(
                ctx, layer, modules, self.method, self._collector, self._module_report
            )
            self._solved.update(solved)
        done = set(self._apply_after.get(index, ()))
        if done:  # true_sequential: later passes calibrate through these quantized modules
            self._apply(ctx, [m for m in self.selected(layer) if m[0] in done])

    def after_layer(self, ctx: RunContext, layer: DecoderLayer) -> None:
        self._collector.unhook()
        if self._act_calibration is not None:
            self._act_calibration.unhook()
        self._apply(ctx, self.selected(layer))
        self._rtn.clear()

    # -- quantization ---------------------------------------------------------------------------

    def _apply(self, ctx: RunContext, modules: Sequence[Selected]) -> None:
        """Quantize ``modules`` (round-to-nearest, or the solved results of their pass) and
        replace each with a ``QuantizedLinear``."""
        for name, module, scheme in modules:
            if self.method.calibrated:
                qweight, report = self._solved.pop(name)
            else:
                calibrated_with = self._rtn.pop(name, None)  # W8A8: quantized to calibrate
                qweight = calibrated_with or self.method.quantize_rtn(module.weight, scheme, name)
                report = self._module_report(name, scheme)
            ctx.report.add_module(report)
            if scheme.decided_by != BASE_SOURCE:
                logger.debug("%s: %s (%s)", name, scheme.describe(), scheme.decided_by)
            act_order = scheme.desc_act and not report.fallback
            replace_module(
                ctx.model,
                name,
                QuantizedLinear.from_linear(
                    module, qweight, self.method.name, act_order, self._activation(name)
                ),
            )

    def _activation(self, name: str) -> ActivationQuant | None:
        """The activation scheme of module ``name`` (calibrated for W8A8), None for float."""
        if self._act_calibration is not None:
            return self._act_calibration.take(name)
        if self.act_scheme in ("W8A8_DYNAMIC", "W4A8_DYNAMIC"):
            return ActivationQuant("per_token")
        act = self.config.qconfig.act
        if act.scope is QScope.PER_BLOCK:  # MX: dynamic, of the act dtype's value type
            return mx_activation(act)
        if act.dtype in FP8_DTYPES:  # W8A8 fp8: dynamic per token
            return fp8_activation(act)
        return None

    def _module_report(self, name: str, scheme: ResolvedScheme) -> ModuleReport:
        """The scheme part of a module's report entry (a solve adds its statistics)."""
        return ModuleReport(
            name=name,
            method=self.method.name,
            bits=scheme.bits,
            group_size=scheme.group_size,
            symmetric=scheme.sym,
            value_type=scheme.values.name,
        )
