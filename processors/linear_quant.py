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

Lifecycle:

* ``check_config``: the ``(dtype, scope, method)`` combination is implemented, ``ext`` is valid for
  the method, activations are float (weight-only quantization), every ``dynamic`` rule is a valid
  regex with known override keys.
* ``check_model`` (meta model): the resolved group size divides the ``in_features`` of every
  selected layer (naming the rule that set it); the shards of a fused layer (q/k/v, gate/up), and
  all experts of an MoE experts module (one FusedMoE layer in vLLM), that this entry selects
  resolve alike; with ``lm_head: true`` the model has a linear output head (and,
  for GPTQ, a final norm to calibrate it on). A head tied to the embeddings is refused by
  :func:`msquant.check_plan`. Cross-entry checks (overlaps, fused layers split between
  entries) and warnings (include patterns or rules matching nothing, rules that vLLM would match
  differently on fused names) come from :func:`msquant.check_plan` through :meth:`plan_modules`.
* ``before_pass`` (``method: gptq``): a forward hook on each selected ``nn.Linear`` of the pass
  feeds its inputs to a :class:`~msquant.WeightPerChannelGPTQ` / :class:`~msquant.WeightPerGroupGPTQ`
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
from collections.abc import Mapping, Sequence
from dataclasses import replace
from functools import cached_property
from typing import Any, Literal

import torch
from pydantic import Field, ValidationError
from torch import nn
from torch.utils.hooks import RemovableHandle
from tqdm.auto import tqdm

from msquant import (
    BASE_SOURCE,
    DYNAMIC_KEYS,
    GPTQ_ONLY_KEYS,
    WEIGHT_METHODS,
    BaseScheme,
    ConfigIssue,
    DecoderLayer,
    DynamicRule,
    FusedGroup,
    GPTQExt,
    LinearQConfig,
    MinMaxExt,
    ModuleDecision,
    ModuleReport,
    MSEOptions,
    NotImplementedYetError,
    OutputHeadStage,
    Processor,
    ProcessorConfig,
    QDType,
    QScope,
    QuantizedLinear,
    QuantizedWeight,
    ResolvedScheme,
    RunContext,
    WeightPerChannelGPTQ,
    WeightPerGroupGPTQ,
    balanced_owners,
    divisors,
    engine_names,
    expert_fallback,
    expert_group_problems,
    expert_groups,
    find_final_norm,
    find_output_head,
    first_matching_pattern,
    fused_group_problems,
    fused_groups,
    moe_routers,
    parse_dynamic,
    parse_expert_linear,
    pattern_problem,
    quantize_weight_minmax,
    relative_output_errors,
    replace_module,
    resolve_module_scheme,
    unmatched_patterns,
    validation_message,
)

__all__ = ["LinearQuantConfig", "LinearQuantProcessor"]

#: Why an MoE router stays float whatever the entry selects (see :func:`msquant.moe_routers`).
ROUTER_REASON = "MoE router: kept float (vLLM, vLLM-Ascend and SGLang load routers unquantized)"

logger = logging.getLogger(__name__)

DYNAMIC_DESCRIPTION = (
    "GPTQModel-compatible per-module overrides: regex on the full module name (matched with "
    "re.match, from the start) -> overrides. A `-:` prefix leaves the matched modules in float "
    "(value {}); `+:` or no prefix overrides keys of qconfig for them: "
    f"{', '.join(DYNAMIC_KEYS)} (bits 2-8; group_size -1 = per-channel). Negative rules are tried "
    "first, then the first matching positive rule decides alone (keys it lacks come from "
    "qconfig, never from a later rule). A rule written for the name vLLM and SGLang load a fused "
    "layer or MoE experts module under ('.*qkv_proj', '.*gate_up_proj', "
    "'-:.*\\.0\\.mlp\\.experts$'), matching none of its shards' own names, applies to every "
    "shard. Quote patterns with single quotes in YAML ('.*\\.0\\..*'); `msquant plan` shows which "
    "rule decides each module."
)

LM_HEAD_DESCRIPTION = (
    "Also quantize the output head (lm_head), after the last decoder layer (GPTQ calibrates it on "
    "the final norm of the last layer's outputs); GPTQModel's flag. Only this flag selects the "
    "head: include/exclude globs (even `*`) never do. The head takes qconfig unless a dynamic "
    "rule matches its name ('lm_head': {bits: 8} overrides, '-:lm_head' keeps it in float); a "
    "positive rule matching lm_head without this flag only warns. Refused when the head is tied "
    "to the input embeddings (tie_word_embeddings)."
)


class LinearQuantConfig(ProcessorConfig):
    """Config of ``linear_quant``."""

    type: Literal["linear_quant"] = "linear_quant"
    qconfig: LinearQConfig
    include: list[str] = Field(
        default_factory=lambda: ["*"],
        description="Module-name globs to quantize (braces expanded: model.layers.{0,1}.*).",
    )
    exclude: list[str] = Field(
        default_factory=list, description="Module-name globs to skip (wins; braces expanded)."
    )
    lm_head: bool = Field(False, description=LM_HEAD_DESCRIPTION)
    dynamic: dict[str, Any] = Field(
        default_factory=dict,
        description=DYNAMIC_DESCRIPTION,
        json_schema_extra={
            "additionalProperties": {
                "type": "object",
                "properties": {key: {} for key in DYNAMIC_KEYS},
                "additionalProperties": False,
            }
        },
    )


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
        self.method = self.config.qconfig.weight.method
        self.requires_calibration = self.method == "gptq"
        self.calibrate_on_quantized = (
            isinstance(self.ext, GPTQExt) and self.ext.resolved_calib_inputs() == "quantized"
        )
        self._pass_plan: dict[str, int] = {}  # this layer's module -> calibration pass
        self._apply_after: dict[int, list[str]] = {}  # pass -> modules quantized after it
        self._gptq: dict[str, WeightPerChannelGPTQ | WeightPerGroupGPTQ] = {}
        self._hooks: list[RemovableHandle] = []
        self._last_input: tuple[torch.Tensor, str] | None = None
        self._share_with: dict[str, str] = {}  # module -> module whose Hessian it shares
        self._solved: dict[str, tuple[QuantizedWeight, ModuleReport]] = {}  # this layer's GPTQ

    @classmethod
    def check_config(cls, config: ProcessorConfig) -> list[ConfigIssue]:
        assert isinstance(config, LinearQuantConfig)
        issues: list[ConfigIssue] = [
            ConfigIssue(f"{key}[{index}]", problem)
            for key in ("include", "exclude")
            for index, pattern in enumerate(getattr(config, key))
            if (problem := pattern_problem(pattern)) is not None
        ]
        act = config.qconfig.act
        if act.dtype is not QDType.FLOAT:
            issues.append(
                ConfigIssue(
                    "qconfig.act.dtype",
                    f"activation quantization ({act.dtype.value}) is not implemented; valid: float "
                    "(weight-only, e.g. W8A16) - or omit qconfig.act",
                )
            )
        weight = config.qconfig.weight
        method = WEIGHT_METHODS.get(weight.method)
        issues += parse_dynamic(config.dynamic, cls._dynamic_keys(weight.method))[1]
        if method is None:
            issues.append(
                ConfigIssue(
                    "qconfig.weight.method",
                    f"unknown method {weight.method!r}; valid: {', '.join(sorted(WEIGHT_METHODS))}",
                )
            )
            return issues
        if weight.dtype not in method.dtypes or weight.scope not in method.scopes:
            combos = ", ".join(
                f"({d.value}, {s.value})"
                for d in sorted(method.dtypes, key=lambda d: d.value)
                for s in sorted(method.scopes, key=lambda s: s.value)
            )
            issues.append(
                ConfigIssue(
                    "qconfig.weight",
                    f"(dtype {weight.dtype.value}, scope {weight.scope.value}) is not implemented for "
                    f"method {method.name}; implemented (dtype, scope): {combos}",
                )
            )
        ext = None
        try:
            ext = method.ext_model.model_validate(weight.ext)
        except ValidationError as exc:
            for err in exc.errors(include_url=False):
                loc = "".join(f".{p}" for p in err["loc"])
                message = validation_message(err).removeprefix("Value error, ")
                if err["type"] == "extra_forbidden":
                    message = f"unknown {method.name} option; valid: {', '.join(method.ext_model.model_fields)}"
                issues.append(ConfigIssue(f"qconfig.weight.ext{loc}", message))
        if isinstance(ext, GPTQExt):
            issues += cls._act_order_rule_issues(config, ext)
        if "group_size" in weight.ext and weight.scope is QScope.PER_CHANNEL:
            logger.warning("qconfig.weight.ext.group_size is ignored with scope per_channel")
        return issues

    @staticmethod
    def _act_order_rule_issues(config: LinearQuantConfig, ext: GPTQExt) -> list[ConfigIssue]:
        """A positive rule setting ``static_groups: false`` for modules that run act-order (its
        own ``desc_act: true``, or the entry's): refused, since act-order runs with static groups
        only (a non-trivial group index, which vLLM refuses, would be needed)."""
        rules, _ = parse_dynamic(config.dynamic, DYNAMIC_KEYS)
        issues = []
        for rule in rules:
            overrides = rule.overrides
            if rule.negative or overrides.get("static_groups") is not False:
                continue
            if not overrides.get("desc_act", ext.resolved_desc_act()):
                continue
            origin = "desc_act: true" if "desc_act" in overrides else "the entry's act-order"
            issues.append(
                ConfigIssue(
                    f"{rule.source}.static_groups",
                    f"static_groups: false cannot go with {origin}: act-order runs with static "
                    "groups only (the group index stays trivial, as vLLM requires); drop "
                    "static_groups from the rule, or add desc_act: false to it",
                )
            )
        return issues

    @staticmethod
    def _dynamic_keys(method: str) -> tuple[str, ...]:
        """The ``dynamic`` override keys valid for ``method`` (GPTQ-only keys need gptq)."""
        if method == "gptq":
            return DYNAMIC_KEYS
        return tuple(key for key in DYNAMIC_KEYS if key not in GPTQ_ONLY_KEYS)

    @cached_property
    def ext(self) -> MinMaxExt | GPTQExt:
        """The validated ``ext`` options of the configured method (defaults filled in)."""
        weight = self.config.qconfig.weight
        ext = WEIGHT_METHODS[weight.method].ext_model.model_validate(weight.ext)
        assert isinstance(ext, MinMaxExt | GPTQExt)
        return ext

    @property
    def group_size(self) -> int | None:
        """Base group width for per_group, None for per_channel (rules may override it)."""
        if self.config.qconfig.weight.scope is not QScope.PER_GROUP:
            return None
        return self.ext.group_size

    def _entry_mse(self) -> bool:
        """The MSE scale search of this entry (GPTQ: set, or ``numerics``' default for the
        qconfig's width; rules may still turn it on or off per module)."""
        ext = self.ext
        if isinstance(ext, GPTQExt):
            return ext.resolved_mse(self.config.qconfig.weight.dtype.bits)
        return ext.mse

    @cached_property
    def base_scheme(self) -> BaseScheme:
        """The scheme ``qconfig`` gives every selected module no rule overrides."""
        weight = self.config.qconfig.weight
        ext = self.ext
        scheme = BaseScheme(
            bits=weight.dtype.bits,
            group_size=-1 if self.group_size is None else self.group_size,
            sym=weight.symmetric,
            mse=ext.mse_norm if self._entry_mse() else 0.0,
            mse_norm=ext.mse_norm,
        )
        if isinstance(ext, GPTQExt):
            scheme = replace(
                scheme,
                desc_act=ext.resolved_desc_act(),
                percdamp=ext.percdamp,
                static_groups=ext.resolved_static_groups(),
            )
        return scheme

    @cached_property
    def rules(self) -> tuple[DynamicRule, ...]:
        """The ``dynamic`` rules in evaluation order (negative first); validated by check_config."""
        rules, issues = parse_dynamic(self.config.dynamic, self._dynamic_keys(self.method))
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
            of (:func:`msquant.engine_names`); ``dynamic`` rules written for them apply to it.
        """
        if head:
            if not self.config.lm_head:
                return ModuleDecision(None, self.method, "lm_head: false")
            return ModuleDecision(
                resolve_module_scheme(name, self.base_scheme, self.rules), self.method
            )
        excluded = _glob_match(name, self.config.exclude)
        if excluded is not None:
            return ModuleDecision(None, self.method, f"exclude {excluded}")
        if _glob_match(name, self.config.include) is None:
            return ModuleDecision(None, self.method)
        return ModuleDecision(
            resolve_module_scheme(name, self.base_scheme, self.rules, groups), self.method
        )

    def selected(self, layer: DecoderLayer) -> list[tuple[str, nn.Linear, ResolvedScheme]]:
        """The layer's linear modules this processor quantizes, with their resolved scheme
        (modules a ``-:`` rule skips are left out)."""
        chosen = []
        head = isinstance(layer, OutputHeadStage)
        routers = moe_routers(layer.module, layer.name)
        linears = list(layer.named_linears())
        groups = engine_names(name for name, _ in linears)
        for name, module in linears:
            if name in routers:
                continue
            scheme = self.decide(name, head, groups.get(name, ())).scheme
            if scheme is not None and not scheme.skipped:
                chosen.append((name, module, scheme))
        return chosen

    # -- planning (msquant.ModulePlanner) -------------------------------------------------------

    def plan_modules(
        self, model: nn.Module, layers: Sequence[DecoderLayer]
    ) -> Mapping[str, ModuleDecision]:
        """Decision for every linear layer of the decoder layers, plus the output head when
        ``lm_head`` is set or a positive rule matches it (so the plan shows why it stays float)."""
        decisions = {}
        for layer in layers:
            routers = moe_routers(layer.module, layer.name)
            names = [name for name, _ in layer.named_linears()]
            groups = engine_names(names)
            for name in names:
                decisions[name] = (
                    ModuleDecision(None, self.method, ROUTER_REASON)
                    if name in routers
                    else self.decide(name, groups=groups.get(name, ()))
                )
        head = self._head_name(model)
        if head is not None and (self.config.lm_head or self._positive_rules_matching(head)):
            decisions[head] = self.decide(head, head=True)
        return decisions

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
        method = WEIGHT_METHODS[self.config.qconfig.weight.method]
        if not method.implemented:
            raise NotImplementedYetError(
                f"linear_quant method {method.name!r} is not implemented yet in this msquant version; "
                "use method: minmax (round-to-nearest) for now"
            )
        decisions = self.plan_modules(model, layers)
        problems = []
        for layer in layers:
            for name, module in layer.named_linears():
                scheme = decisions[name].scheme
                if scheme is not None and not scheme.skipped:
                    problems += self._divisor_problem(name, module, scheme)
        if self.config.lm_head:
            problems += self._head_problems(model, layers, decisions)
        return problems + self._fused_problems(decisions)

    def _head_problems(
        self,
        model: nn.Module,
        layers: Sequence[DecoderLayer],
        decisions: Mapping[str, ModuleDecision],
    ) -> list[str]:
        """``lm_head: true`` needs a linear output head (and a final norm to calibrate GPTQ on)."""
        found = find_output_head(model)
        kind = type(model).__name__
        if found is None:
            return [f"lm_head: true, but {kind} has no output head (get_output_embeddings)"]
        name, module = found
        if not isinstance(module, nn.Linear):
            return [
                f"lm_head: true, but the output head {name} of {kind} is a "
                f"{type(module).__name__}, not an nn.Linear; set lm_head: false"
            ]
        scheme = decisions[name].scheme
        if scheme is None or scheme.skipped:
            return []
        problems = self._divisor_problem(name, module, scheme, fix="set lm_head: false")
        if self.method == "gptq" and find_final_norm(model, list(layers)) is None:
            problems.append(
                f"lm_head: true with method gptq, but the final norm of {kind} (its head's input "
                "is the final norm of the last decoder layer's output) was not found; use method "
                "minmax for the head (a separate linear_quant entry) or set lm_head: false"
            )
        return problems

    def _divisor_problem(
        self,
        name: str,
        module: nn.Linear,
        scheme: ResolvedScheme,
        fix: str = "exclude this layer",
    ) -> list[str]:
        """The group size (from qconfig or a rule) must divide the module's input width."""
        group_size = scheme.group_size_or_none
        if group_size is None or module.in_features % group_size == 0:
            return []
        from_rule = any(
            rule.source == scheme.decided_by and "group_size" in rule.overrides
            for rule in self.rules
        )
        origin = f", group_size set by {scheme.decided_by}" if from_rule else ""
        return [
            f"{name}: group_size {group_size} does not divide in_features {module.in_features} "
            f"(weight [{module.out_features}, {module.in_features}]{origin}); "
            f"valid group sizes: {divisors(module.in_features)} - or {fix}"
        ]

    @staticmethod
    def _fused_problems(decisions: Mapping[str, ModuleDecision]) -> list[str]:
        """Fused layers (q/k/v, gate/up) and MoE experts modules whose members this entry all
        selects but resolves differently (splits involving other entries are checked by
        msquant.check_plan)."""
        schemes: dict[str, tuple[object, ...]] = {}
        describe: dict[str, str] = {}
        for group in [*fused_groups(decisions), *expert_groups(decisions)]:
            found = [decisions[m].scheme for m in group.members]
            if any(scheme is None for scheme in found):
                continue
            for member, scheme in zip(group.members, found, strict=True):
                assert scheme is not None
                schemes[member] = scheme.signature()
                describe[member] = f"{scheme.describe()} by {scheme.decided_by}"
        problems = fused_group_problems(schemes, describe)
        problems += expert_group_problems(schemes, describe)
        return [f"linear_quant: {problem}" for problem in problems]

    # -- quantization ---------------------------------------------------------------------------

    def _mse(self, scheme: ResolvedScheme) -> MSEOptions | None:
        """The MSE search options of a module (grid and shrink from ext, norm from the scheme)."""
        if not scheme.mse:
            return None
        return MSEOptions(grid=self.ext.mse_grid, maxshrink=self.ext.mse_maxshrink, norm=scheme.mse)

    def _new_gptq(
        self, name: str, in_features: int, scheme: ResolvedScheme
    ) -> WeightPerChannelGPTQ | WeightPerGroupGPTQ:
        """A GPTQ quantizer for one module: ``ext`` with the module's resolved overrides."""
        assert isinstance(self.ext, GPTQExt)
        ext = self.ext.model_dump()
        for key in ("numerics", "calib_inputs", "true_sequential"):  # the run's, not the solve's
            ext.pop(key)
        ext.pop("expert_min_tokens")  # decided here, before the solve (see _expert_fallback)
        ext.pop("experts_per_pass")  # the runner's passes (see calibration_passes)
        ext.update(
            percdamp=scheme.percdamp,
            desc_act=scheme.desc_act,
            static_groups=scheme.static_groups,
            mse=bool(scheme.mse),
            mse_norm=scheme.mse or ext["mse_norm"],
            group_size=scheme.group_size_or_none,
            full_range=self._full_range(scheme),
        )
        if scheme.group_size_or_none is None:
            ext.pop("static_groups")  # meaningless without groups
            return WeightPerChannelGPTQ.from_ext(scheme.bits, scheme.sym, ext, name)
        return WeightPerGroupGPTQ.from_ext(scheme.bits, scheme.sym, ext, name)

    def calibration_passes(self, layer: DecoderLayer) -> int:
        """One pass; one per slice of ``ext.experts_per_pass`` MoE experts; with
        ``true_sequential``, that for each submodule (attention, MLP) of the layer in turn."""
        if self.method != "gptq":
            return 1
        plan, _ = self._plan_passes(layer)
        return 1 + max(plan.values(), default=0)

    def _expert_slice(self, name: str) -> int:
        """0 for every module but the MoE experts past the first ``ext.experts_per_pass``
        (expert ``e`` is in slice ``e // experts_per_pass``)."""
        per_pass = getattr(self.ext, "experts_per_pass", None)
        expert = parse_expert_linear(name)
        return 0 if per_pass is None or expert is None else expert[1] // per_pass

    def _true_sequential(self) -> bool:
        return isinstance(self.ext, GPTQExt) and self.ext.resolved_true_sequential()

    def _plan_passes(self, layer: DecoderLayer) -> tuple[dict[str, int], dict[int, list[str]]]:
        """The calibration pass gathering each selected module's Hessian, and with
        ``true_sequential`` the modules quantized right after each pass.

        Without ``true_sequential`` a layer has one stage; with it, one stage per direct submodule
        of the layer holding selected linears (``self_attn``, ``mlp``, ...), in the layer's
        registration order, which is the order of the forward for the decoder layers of
        transformers. Each stage gets one pass per slice of MoE experts it holds; a stage's
        modules are quantized after its last pass, so later stages calibrate through them.
        """
        selected = [name for name, _, _ in self.selected(layer)]
        if not self._true_sequential():
            return {name: self._expert_slice(name) for name in selected}, {}
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
                plan[name] = first + self._expert_slice(name)
            last = max(plan[name] for name in members)
            apply_after[last] = members
            first = last + 1
        return plan, apply_after

    def before_layer(self, ctx: RunContext, layer: DecoderLayer) -> None:
        self._solved.clear()
        self._pass_plan, self._apply_after = (
            self._plan_passes(layer) if self.method == "gptq" else ({}, {})
        )

    def _pass_of(self, name: str) -> int:
        """The calibration pass gathering a module's Hessian in the current layer."""
        return self._pass_plan[name]

    def before_pass(self, ctx: RunContext, layer: DecoderLayer, index: int) -> None:
        """Hook the modules whose Hessians this pass gathers."""
        if self.method != "gptq":
            return
        for name, module, scheme in self.selected(layer):
            if self._pass_of(name) != index:
                continue
            self._gptq[name] = self._new_gptq(name, module.in_features, scheme)

            def accumulate(
                _: nn.Module, args: tuple[torch.Tensor, ...], __: torch.Tensor, name: str = name
            ) -> None:
                self._accumulate(name, args[0])

            self._hooks.append(module.register_forward_hook(accumulate))

    def after_pass(self, ctx: RunContext, layer: DecoderLayer, index: int) -> None:
        """Solve the modules of this pass and free their Hessians; the layer keeps its float
        weights (the next pass, and the next layer's inputs, are computed with them)."""
        self._unhook()
        if self.method != "gptq":
            return
        modules = [m for m in self.selected(layer) if self._pass_of(m[0]) == index]
        if modules:
            self._solved.update(self._solve_gptq(ctx, layer, modules))
        done = set(self._apply_after.get(index, ()))
        if done:  # true_sequential: later passes calibrate through these quantized modules
            self._apply(ctx, [m for m in self.selected(layer) if m[0] in done])

    def _unhook(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()
        self._last_input = None
        self._share_with.clear()

    def _accumulate(self, name: str, x: torch.Tensor) -> None:
        """Feed one module's input to its Hessian, sharing one Hessian between modules that read
        the very same input tensor (q/k/v, gate/up): identical sums at a fraction of the cost.

        Sharing is decided on the first calibration batch and must hold for every later batch.
        """
        last = self._last_input
        if last is not None and last[0] is x and last[1] != name:
            owner = self._share_with.get(last[1], last[1])
            if name not in self._share_with:
                if self._gptq[name].nsamples:
                    raise RuntimeError(f"{name}: its input became shared after the first batch")
                self._share_with[name] = owner
                self._gptq[name].accumulator = self._gptq[owner].accumulator
                logger.debug("%s shares the Hessian of %s (same input)", name, owner)
            elif self._share_with[name] != owner:
                raise RuntimeError(f"{name}: its input is no longer the input of {owner}")
            return
        if name in self._share_with:
            raise RuntimeError(
                f"{name}: its input is no longer the input of {self._share_with[name]}"
            )
        self._gptq[name].add_batch(x)
        self._last_input = (x, name)

    def after_layer(self, ctx: RunContext, layer: DecoderLayer) -> None:
        self._unhook()
        self._apply(ctx, self.selected(layer))

    def _apply(
        self, ctx: RunContext, modules: Sequence[tuple[str, nn.Linear, ResolvedScheme]]
    ) -> None:
        """Quantize ``modules`` (round-to-nearest, or the GPTQ results of their pass) and replace
        each with a ``QuantizedLinear``."""
        for name, module, scheme in modules:
            if self.method == "gptq":
                qweight, report = self._solved.pop(name)
            else:
                qweight = self._quantize_rtn(module, scheme, name)
                report = self._module_report(name, scheme)
            ctx.report.add_module(report)
            if scheme.decided_by != BASE_SOURCE:
                logger.debug("%s: %s (%s)", name, scheme.describe(), scheme.decided_by)
            act_order = self.method == "gptq" and scheme.desc_act and not report.fallback
            replace_module(
                ctx.model,
                name,
                QuantizedLinear.from_linear(module, qweight, self.method, act_order),
            )

    def _solve_gptq(
        self,
        ctx: RunContext,
        layer: DecoderLayer,
        modules: Sequence[tuple[str, nn.Linear, ResolvedScheme]],
    ) -> dict[str, tuple[QuantizedWeight, ModuleReport]]:
        """GPTQ results of the layer's selected modules, by name.

        In a ``dp_layer_wise`` group the Hessians are first summed over the processes (each saw
        its share of the calibration batches); each module is then solved by one process (shared
        out by cost, ``out * in^2 + in^3 / 3``) and its result broadcast to the others.
        """
        dist = ctx.dist
        if dist.active:
            reduced: set[int] = set()
            for name, _, _ in modules:  # the same order, and the same sharing, in every process
                accumulator = self._gptq[name].accumulator
                if id(accumulator) not in reduced:
                    reduced.add(id(accumulator))
                    accumulator.all_reduce(dist.all_reduce_sum)
        solved: dict[str, tuple[QuantizedWeight, ModuleReport]] = {}
        for name, module, scheme in modules:
            reason = self._expert_fallback(ctx, name, module)
            if reason is not None:  # the same decision in every process (summed token counts)
                logger.info("%s: round-to-nearest instead of GPTQ: %s", name, reason)
                solved[name] = (
                    self._quantize_rtn(module, scheme, name),
                    replace(
                        self._module_report(name, scheme),
                        tokens=self._gptq[name].nsamples,
                        fallback=reason,
                    ),
                )
        modules = [m for m in modules if m[0] not in solved]
        if dist.active:
            costs = [
                m.out_features * m.in_features**2 + m.in_features**3 / 3 for _, m, _ in modules
            ]
            owners = balanced_owners(costs, dist.world_size)
        else:
            owners = [dist.rank] * len(modules)
        mine = [m for m, owner in zip(modules, owners, strict=True) if owner == dist.rank]
        for name, module, scheme in tqdm(
            mine,
            desc=layer.name,
            unit="linear",
            leave=False,
            disable=not ctx.progress or len(mine) < 2,
        ):
            solved[name] = self._quantize_gptq(ctx, name, module, scheme)
        self._gptq.clear()  # solved here or elsewhere: drop the Hessian references
        if dist.active:
            for (name, _, _), owner in zip(modules, owners, strict=True):
                mine_solved = solved.get(name)
                payload = None
                if mine_solved is not None:
                    payload = (_on_cpu(mine_solved[0]), mine_solved[1])
                received = dist.broadcast_object(payload, owner)
                assert received is not None, f"{name}: process {owner} sent no result"
                solved[name] = received
        return solved

    def _expert_fallback(self, ctx: RunContext, name: str, module: nn.Linear) -> str | None:
        """Why an MoE expert's linear layer is rounded to nearest instead of solved (too few
        calibration tokens were routed to it: a Hessian of fewer rows than about twice its
        columns makes GPTQ fit the calibration tokens and do worse than rounding), or None."""
        if ctx.experts.expert_of(name) is None:
            return None
        tokens = self._gptq[name].nsamples
        ratio = self.ext.expert_min_tokens
        if expert_fallback(tokens, module.in_features, ratio) == "gptq":
            return None
        return (
            f"MoE expert received {tokens} calibration token(s), fewer than "
            f"{ratio:g} x in_features {module.in_features} (ext.expert_min_tokens)"
        )

    def _quantize_rtn(
        self, module: nn.Linear, scheme: ResolvedScheme, name: str
    ) -> QuantizedWeight:
        """Round-to-nearest weight of ``module`` with its resolved scheme (``minmax``)."""
        return quantize_weight_minmax(
            module.weight, scheme.bits, scheme.sym, scheme.group_size_or_none, name=name,
            mse=self._mse(scheme), full_range=self._full_range(scheme),
        )  # fmt: skip

    def _full_range(self, scheme: ResolvedScheme) -> bool:
        """The grid of a module: ``ext.full_range``, or for GPTQ left unset, ``ext.numerics``'
        default for the module's width."""
        if isinstance(self.ext, GPTQExt):
            return self.ext.resolved_full_range(scheme.bits)
        return self.ext.full_range

    def _quantize_gptq(
        self, ctx: RunContext, name: str, module: nn.Linear, scheme: ResolvedScheme
    ) -> tuple[QuantizedWeight, ModuleReport]:
        """GPTQ-quantize ``module``; its report entry carries the output errors (GPTQ and
        round-to-nearest, on the calibration Hessian, read before the quantizer is dropped; the
        accumulator is not freed here since q/k/v or gate/up may share it)."""
        quantizer = self._gptq[name]
        result = quantizer.quantize(module.weight, backend=ctx.backend)
        hessian, _ = quantizer.accumulator.raw_sum()
        rtn = self._quantize_rtn(module, scheme, name)
        errors = relative_output_errors(
            module.weight, [result.quantized.dequantize(), rtn.dequantize()], hessian
        )
        logger.debug(
            "%s: GPTQ loss %.4g, percdamp %.4g (%d retries), %d dead columns, output error %.4g "
            "(round-to-nearest %.4g), %.2f s",
            name, result.loss, result.percdamp, result.damp_retries, result.dead_columns,
            errors[0], errors[1], result.seconds,
        )  # fmt: skip
        report = replace(
            self._module_report(name, scheme),
            gptq_loss=result.loss,
            percdamp=result.percdamp,
            damp_retries=result.damp_retries,
            dead_columns=result.dead_columns,
            output_error=errors[0],
            rtn_output_error=errors[1],
            solve_seconds=result.seconds,
            tokens=result.nsamples,
        )
        return result.quantized, report

    def _module_report(self, name: str, scheme: ResolvedScheme) -> ModuleReport:
        """The scheme part of a module's report entry (GPTQ adds its solve statistics)."""
        return ModuleReport(
            name=name,
            method=self.method,
            bits=scheme.bits,
            group_size=scheme.group_size_or_none,
            symmetric=scheme.sym,
        )


def _on_cpu(qweight: QuantizedWeight) -> QuantizedWeight:
    """The same weight with its tensors in host memory (to send it to the other processes)."""
    return replace(
        qweight, codes=qweight.codes.cpu(), scale=qweight.scale.cpu(), offset=qweight.offset.cpu()
    )
