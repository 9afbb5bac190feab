"""``linear_quant``'s checks on the weightless model (before any weight loads): group sizes
dividing the input widths, the output head, fused layers and MoE experts resolving alike."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from torch import nn

from msquant.plugin import DecoderLayer, DynamicRule, QuantMethod, ResolvedScheme
from msquant.plugin.model import (
    expert_group_problems,
    expert_groups,
    find_final_norm,
    find_output_head,
    fused_group_problems,
    fused_groups,
)
from msquant.plugin.numerics import divisors
from msquant.plugin.planning import ModuleDecision

__all__ = ["divisor_problem", "head_problems", "fused_problems"]


def divisor_problem(
    name: str,
    module: nn.Linear,
    scheme: ResolvedScheme,
    rules: Sequence[DynamicRule],
    fix: str = "exclude this layer",
) -> list[str]:
    """The group size (from qconfig or a rule) must divide the module's input width."""
    group_size = scheme.group_size
    if group_size is None or module.in_features % group_size == 0:
        return []
    from_rule = any(
        rule.source == scheme.decided_by and "group_size" in rule.overrides for rule in rules
    )
    origin = f", group_size set by {scheme.decided_by}" if from_rule else ""
    return [
        f"{name}: group_size {group_size} does not divide in_features {module.in_features} "
        f"(weight [{module.out_features}, {module.in_features}]{origin}); "
        f"valid group sizes: {divisors(module.in_features)} - or {fix}"
    ]


def head_problems(
    model: nn.Module,
    layers: Sequence[DecoderLayer],
    decisions: Mapping[str, ModuleDecision],
    method: QuantMethod,
    rules: Sequence[DynamicRule],
) -> list[str]:
    """``lm_head: true`` needs a linear output head (and, for a calibrated method, a final norm
    to calibrate it on)."""
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
    problems = divisor_problem(name, module, scheme, rules, fix="set lm_head: false")
    if method.calibrated and find_final_norm(model, list(layers)) is None:
        problems.append(
            f"lm_head: true with method {method.name}, but the final norm of {kind} (its head's "
            "input is the final norm of the last decoder layer's output) was not found; use method "
            "minmax for the head (a separate linear_quant entry) or set lm_head: false"
        )
    return problems


def fused_problems(decisions: Mapping[str, ModuleDecision]) -> list[str]:
    """Fused layers (q/k/v, gate/up) and MoE experts modules whose members this entry all
    selects but resolves differently (splits involving other entries are checked by
    msquant.plugin.planning.check_plan)."""
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
