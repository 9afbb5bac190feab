"""The config of ``linear_quant`` and its semantic checks (no model needed).

``qconfig.weight`` is the union of the methods registered in the ``msquant.methods`` entry-point
group when this module is imported, discriminated on ``method``: each method's ``ext`` is typed
(unknown keys refused with their path), and ``msquant schema`` documents every key.
"""

from __future__ import annotations

import logging
from typing import Any, Literal

from pydantic import ConfigDict, Field

from msquant.plugin import (
    ConfigIssue,
    LinearQConfig,
    ProcessorConfig,
    QScope,
    default_method_registry,
)
from msquant.plugin.model import pattern_problem
from msquant.plugin.planning import DYNAMIC_KEYS, parse_dynamic
from msquant.processors.linear_quant.act import act_issues

__all__ = ["METHODS", "MethodQConfig", "LinearQuantConfig", "config_issues"]

logger = logging.getLogger(__name__)

#: The quantization methods installed (``qconfig.weight.method``), read once at import.
METHODS = default_method_registry()
_WEIGHT: Any = METHODS.weight_config_type()
#: For each ``dynamic`` override key, the methods accepting it (named when another refuses it).
RULE_KEY_METHODS = {
    key: [name for name in METHODS.names() if key in METHODS.get(name).rule_keys]
    for key in DYNAMIC_KEYS
}

DYNAMIC_DESCRIPTION = (
    "GPTQModel-compatible per-module overrides: regex on the full module name (matched with "
    "re.match, from the start) -> overrides. A `-:` prefix leaves the matched modules in float "
    "(value {}); `+:` or no prefix overrides keys of qconfig for them: "
    f"{', '.join(DYNAMIC_KEYS)} (bits 2-8; group_size -1 = per-channel). Negative rules are tried "
    "first, then the first matching positive rule decides alone (keys it lacks come from "
    "qconfig, never from a later rule). A rule written for the name vLLM and SGLang load a fused "
    "layer or MoE experts module under ('.*qkv_proj', '.*gate_up_proj', "
    "'-:.*\\.0\\.mlp\\.experts$', or a model adapter's fused names such as Qwen3.5's "
    "'.*in_proj_qkvz'), matching none of its shards' own names, applies to every shard. "
    "Quote patterns with single quotes in YAML ('.*\\.0\\..*'); `msquant plan` shows which "
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


class MethodQConfig(LinearQConfig):
    """``qconfig`` of ``linear_quant``: weights are required, activations default to float."""

    # ``weight``: the registered methods' union; the schema keeps the engine model's title.
    model_config = ConfigDict(extra="forbid", title="LinearQConfig")

    weight: _WEIGHT


class LinearQuantConfig(ProcessorConfig):
    """Config of ``linear_quant``."""

    type: Literal["linear_quant"] = "linear_quant"
    qconfig: MethodQConfig
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


def config_issues(config: LinearQuantConfig) -> list[ConfigIssue]:
    """What the schema cannot say: include/exclude globs that cannot be matched (bad braces,
    too many expansions), the activation scheme implemented (:mod:`.act`), the ``dynamic``
    rules valid for the method, the ``(dtype, scope)`` implemented by the method, and the
    method's own rule checks."""
    issues: list[ConfigIssue] = [
        ConfigIssue(f"{key}[{index}]", problem)
        for key in ("include", "exclude")
        for index, pattern in enumerate(getattr(config, key))
        if (problem := pattern_problem(pattern)) is not None
    ]
    weight = config.qconfig.weight
    issues += act_issues(config.qconfig.act, weight, config.lm_head, bool(config.dynamic))
    method = METHODS.get(weight.method)
    rules, rule_issues = parse_dynamic(config.dynamic, method.rule_keys, RULE_KEY_METHODS)
    issues += rule_issues
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
    issues += method(weight).config_issues(rules)
    if "group_size" in weight.ext.model_fields_set and weight.scope is QScope.PER_CHANNEL:
        logger.warning("qconfig.weight.ext.group_size is ignored with scope per_channel")
    return issues
