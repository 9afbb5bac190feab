"""Per-module quantization rules: GPTQModel-compatible ``dynamic`` overrides and their resolution.

A ``dynamic`` mapping (the format GPTQModel writes and vLLM / SGLang read) maps a regex on the full
module name to overrides of the base scheme::

    {"-:.*down_proj": {},                         # negative: leave these modules in float
     "+:.*\\.0\\..*": {"bits": 8},                # positive ("+:" or no prefix): override keys
     ".*\\.1\\..*": {"group_size": 64}}

Semantics, exactly as GPTQModel's (``gptqmodel/quantization/config.py``):

* patterns are matched with :func:`re.match` (anchored at the start, not the end) against the full
  dotted name, e.g. ``model.layers.0.self_attn.q_proj``, so a bare ``q_proj`` matches nothing;
* negative rules are evaluated first, then positive ones, each group in the order written;
* the first matching rule decides: a negative one skips the module; a positive one overrides the
  keys it names and every other key comes from the base scheme; later rules are never consulted
  (no fall-through).

Everything here is pure (no model, no torch): :func:`parse_dynamic` validates a mapping into
:class:`DynamicRule` objects, :func:`resolve_module_scheme` decides one module, and
:func:`fused_name_mismatches` finds rules that treat a fused layer (``qkv_proj``) differently
from its shards, which matters because vLLM matches rules against the fused names. A rule written
against the names vLLM and SGLang match and none of the shards' own names (``.*qkv_proj``,
``.*gate_up_proj``, an MoE ``...experts$`` module) applies to every shard, as those engines read it
back (:func:`written_for_engine_name`).
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Annotated, Any

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    ValidationError,
    field_validator,
)

from msquant.errors import ConfigIssue, validation_message
from msquant.model.fused import FusedGroup
from msquant.quant.regex_safety import pattern_risk
from msquant.quant.value_types import ValueType, int_value_type, value_type_named

__all__ = [
    "NEGATIVE_PREFIX",
    "POSITIVE_PREFIX",
    "BASE_SOURCE",
    "DYNAMIC_KEYS",
    "GPTQ_ONLY_KEYS",
    "DEFAULT_MSE_NORM",
    "DynamicOverrides",
    "DynamicRule",
    "BaseScheme",
    "ResolvedScheme",
    "FusedNameMismatch",
    "rule_source",
    "parse_dynamic",
    "ordered_rules",
    "resolve_module_scheme",
    "written_for_engine_name",
    "fused_name_mismatches",
]

NEGATIVE_PREFIX = "-:"
POSITIVE_PREFIX = "+:"
#: ``decided_by`` of a module that no rule matched: the entry's own ``qconfig`` decided.
BASE_SOURCE = "qconfig"
#: MSE norm used when a rule turns MSE on with ``mse: true`` and the base has none configured.
DEFAULT_MSE_NORM = 2.4

#: Keys applying only to GPTQ (a ``method: minmax`` entry refuses them).
GPTQ_ONLY_KEYS = ("desc_act", "damp_percent", "percdamp", "static_groups")

GroupSize = Annotated[
    StrictInt,
    Field(
        description="Input columns per group; -1 = per-channel (GPTQModel's convention).",
    ),
]


class DynamicOverrides(BaseModel):
    """The keys one positive ``dynamic`` rule may override (GPTQModel's names).

    ``damp_percent`` is GPTQModel's name for msModelSlim's ``percdamp``; either may be used. ``mse``
    is GPTQModel's: ``false`` / ``0`` turns the MSE scale search off, ``true`` turns it on with the
    base norm, a positive number turns it on with that norm (``sum |w - w_q|^mse``).
    """

    model_config = ConfigDict(extra="forbid")

    bits: StrictInt | None = Field(None, ge=2, le=8, description="Code width, 2 to 8.")
    group_size: GroupSize | None = None
    sym: StrictBool | None = Field(None, description="Symmetric (true) or asymmetric (false).")
    desc_act: StrictBool | None = Field(None, description="GPTQ act-order (GPTQ only).")
    damp_percent: StrictFloat | None = Field(
        None, gt=0, allow_inf_nan=False, description="GPTQ damping (GPTQ only)."
    )
    percdamp: StrictFloat | None = Field(
        None, gt=0, allow_inf_nan=False, description="Same as damp_percent (GPTQ only)."
    )
    mse: bool | float | None = Field(
        None, description="MSE scale search: false/0 off, true on, a number = its norm."
    )
    static_groups: StrictBool | None = Field(None, description="GPTQ static groups (GPTQ only).")

    @field_validator("mse", mode="before")
    @classmethod
    def _check_mse(cls, value: Any) -> Any:
        """``true``/``false``, or a finite norm >= 0 (GPTQModel's float ``mse``)."""
        if value is None or isinstance(value, bool):
            return value
        if isinstance(value, int | float) and math.isfinite(value) and value >= 0:
            return float(value)
        raise ValueError(f"expected true, false or a norm >= 0, got {value!r}")

    def normalized(self) -> dict[str, Any]:
        """The keys set, with ``damp_percent`` renamed to ``percdamp`` and GPTQModel's
        ``group_size: -1`` turned into msquant's per-channel encoding, None."""
        values = self.model_dump(exclude_none=True)
        if "damp_percent" in values:
            values["percdamp"] = values.pop("damp_percent")
        if values.get("group_size") == -1:
            values["group_size"] = None
        return values


#: Every key a positive rule may hold.
DYNAMIC_KEYS: tuple[str, ...] = tuple(DynamicOverrides.model_fields)


def rule_source(key: str) -> str:
    """How a rule is named in messages and plans: ``dynamic["-:.*down_proj"]``."""
    return f'dynamic["{key}"]'


@dataclass(frozen=True)
class DynamicRule:
    """One validated ``dynamic`` rule.

    :param key: the key as written (prefix included), e.g. ``"-:.*down_proj"``.
    :param negative: ``-:`` rule (do not quantize).
    :param regex: the compiled pattern (prefix removed).
    :param overrides: normalized keys of a positive rule (see :meth:`DynamicOverrides.normalized`).
    """

    key: str
    negative: bool
    regex: re.Pattern[str]
    overrides: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def parse(cls, key: str, overrides: Mapping[str, Any] | None = None) -> DynamicRule:
        """Build one rule (for tests and Python callers).

        :raises ValueError: for an invalid regex or override.
        """
        rules, issues = parse_dynamic({key: dict(overrides or {})})
        if issues:
            raise ValueError("; ".join(str(issue) for issue in issues))
        return rules[0]

    @property
    def pattern(self) -> str:
        """The regex without its ``-:`` / ``+:`` prefix."""
        return self.regex.pattern

    @property
    def source(self) -> str:
        """``dynamic["<key>"]``."""
        return rule_source(self.key)

    def matches(self, name: str) -> bool:
        """Whether the rule applies to the full module name ``name`` (``re.match``)."""
        return self.regex.match(name) is not None


def _split_key(key: str) -> tuple[bool, str]:
    """``(negative, pattern)`` of a rule key (GPTQModel strips ``-:`` / ``+:``)."""
    if key.startswith(NEGATIVE_PREFIX):
        return True, key[len(NEGATIVE_PREFIX) :]
    if key.startswith(POSITIVE_PREFIX):
        return False, key[len(POSITIVE_PREFIX) :]
    return False, key


def _override_issues(
    key: str, overrides: Any, allowed: Sequence[str], accepted_by: Mapping[str, Sequence[str]]
) -> tuple[dict[str, Any], list[ConfigIssue]]:
    """Validate one rule's override mapping; issue paths are ``dynamic["key"].field``."""
    path = rule_source(key)
    if overrides is None:
        overrides = {}
    if not isinstance(overrides, Mapping):
        kind = type(overrides).__name__
        return {}, [ConfigIssue(path, f"a rule's value must be a mapping of overrides, got {kind}")]
    issues = []
    for name in overrides:
        if name not in DYNAMIC_KEYS:
            issues.append(
                ConfigIssue(
                    f"{path}.{name}", f"unknown dynamic override; valid: {', '.join(DYNAMIC_KEYS)}"
                )
            )
        elif name not in allowed:
            issues.append(
                ConfigIssue(
                    f"{path}.{name}",
                    f"applies to method {' or '.join(accepted_by.get(name, ())) or '(none)'} "
                    f"only; valid here: {', '.join(allowed)}",
                )
            )
    if issues:
        return {}, issues
    try:
        parsed = DynamicOverrides.model_validate(dict(overrides))
    except ValidationError as exc:
        for err in exc.errors(include_url=False):
            field_name = str(err["loc"][0]) if err["loc"] else ""
            issues.append(
                ConfigIssue(f"{path}.{field_name}" if field_name else path, validation_message(err))
            )
        return {}, issues
    if parsed.group_size is not None and parsed.group_size != -1 and parsed.group_size <= 0:
        issues.append(
            ConfigIssue(
                f"{path}.group_size",
                f"must be -1 (per-channel) or a positive group width, got {parsed.group_size}",
            )
        )
    if parsed.damp_percent is not None and parsed.percdamp is not None:
        issues.append(
            ConfigIssue(f"{path}.percdamp", "give damp_percent or percdamp, not both (same key)")
        )
    return parsed.normalized(), issues


def parse_dynamic(
    dynamic: Mapping[str, Any],
    allowed: Sequence[str] = DYNAMIC_KEYS,
    accepted_by: Mapping[str, Sequence[str]] | None = None,
) -> tuple[tuple[DynamicRule, ...], list[ConfigIssue]]:
    """Validate a ``dynamic`` mapping into rules in evaluation order (negatives first).

    :param dynamic: rule key -> overrides, in the order written.
    :param allowed: the override keys valid for the entry's method.
    :param accepted_by: for a key not in ``allowed``, the methods that accept it (named in the
        message).
    :returns: the rules (only when there is no issue) and the issues, each located at
        ``dynamic["<key>"]`` or ``dynamic["<key>"].<override>`` (relative to the entry).
    """
    rules: list[DynamicRule] = []
    issues: list[ConfigIssue] = []
    for key, overrides in dynamic.items():
        if not isinstance(key, str):
            issues.append(ConfigIssue(rule_source(str(key)), "a rule key must be a string regex"))
            continue
        negative, pattern = _split_key(key)
        try:
            regex = re.compile(pattern)
        except re.error as error:
            issues.append(
                ConfigIssue(rule_source(key), f"invalid regular expression {pattern!r}: {error}")
            )
            continue
        risk = pattern_risk(pattern)
        if risk is not None:
            issues.append(ConfigIssue(rule_source(key), f"regular expression {pattern!r}: {risk}"))
            continue
        if negative:
            if overrides:
                issues.append(
                    ConfigIssue(
                        rule_source(key),
                        "a negative (-:) rule leaves modules in float and takes no overrides; "
                        "use {} (or drop the -: prefix to override keys)",
                    )
                )
                continue
            rules.append(DynamicRule(key, True, regex))
            continue
        values, problems = _override_issues(key, overrides, allowed, accepted_by or {})
        issues.extend(problems)
        if not problems:
            rules.append(DynamicRule(key, False, regex, values))
    return (ordered_rules(rules) if not issues else ()), issues


def ordered_rules(rules: Iterable[DynamicRule]) -> tuple[DynamicRule, ...]:
    """GPTQModel's evaluation (and save) order: negative rules first, each group as written."""
    rules = list(rules)
    return tuple([r for r in rules if r.negative] + [r for r in rules if not r.negative])


@dataclass(frozen=True)
class BaseScheme:
    """An entry's own scheme (its ``qconfig``), which positive rules override key by key.

    :param bits: code width.
    :param group_size: input columns per group, None for per-channel.
    :param sym: symmetric quantization.
    :param desc_act: GPTQ act-order (always False for minmax).
    :param percdamp: GPTQ damping (None for minmax).
    :param mse: MSE scale search norm, 0.0 when off.
    :param static_groups: GPTQ static groups.
    :param mse_norm: the norm ``mse: true`` turns on (the entry's ``ext.mse_norm``).
    :param value_type: the codes' value type name (:mod:`msquant.quant.value_types`) when
        it is not the integer type of ``bits`` (``mxfp8``), else None.
    """

    bits: int
    group_size: int | None
    sym: bool
    desc_act: bool = False
    percdamp: float | None = None
    mse: float = 0.0
    static_groups: bool = False
    mse_norm: float = DEFAULT_MSE_NORM
    value_type: str | None = None

    def resolved(self, decided_by: str = BASE_SOURCE) -> ResolvedScheme:
        """This scheme, unmodified, as a module's result."""
        return ResolvedScheme(
            self.bits,
            self.group_size,
            self.sym,
            self.desc_act,
            self.percdamp,
            self.mse,
            self.static_groups,
            skipped=False,
            decided_by=decided_by,
            value_type=self.value_type,
        )


@dataclass(frozen=True)
class ResolvedScheme:
    """What one module gets: a scheme, or ``skipped`` (left in float), and the rule that decided.

    :param decided_by: :data:`BASE_SOURCE` (``"qconfig"``) when no rule matched, else the rule's
        :func:`rule_source`, e.g. ``dynamic["-:.*down_proj"]``.
    """

    bits: int
    group_size: int | None
    sym: bool
    desc_act: bool
    percdamp: float | None
    mse: float
    static_groups: bool
    skipped: bool
    decided_by: str
    #: The value type's name when it is not ``int<bits>`` (``mxfp8``), else None.
    value_type: str | None = None

    @property
    def values(self) -> ValueType:
        """The codes' value type (:mod:`msquant.quant.value_types`)."""
        return (
            int_value_type(self.bits)
            if self.value_type is None
            else value_type_named(self.value_type)
        )

    def signature(self) -> tuple[object, ...]:
        """What the shards of a fused layer must share: skip decision, value type, bits, group
        size, sym, act order."""
        if self.skipped:
            return ("skipped",)
        return (self.bits, self.group_size, self.sym, self.desc_act, self.value_type)

    def describe(self) -> str:
        """e.g. ``int4 group 32 sym``, ``int8 per-channel asym act-order``, ``mxfp8 block 32``,
        ``not quantized``."""
        if self.skipped:
            return "not quantized"
        text = self.values.describe(self.group_size, self.sym)
        return text + (" act-order" if self.desc_act else "")


def _apply(base: BaseScheme, overrides: Mapping[str, Any], decided_by: str) -> ResolvedScheme:
    """``base`` with a positive rule's keys; keys it lacks keep the base values."""
    scheme = base.resolved(decided_by)
    values = dict(overrides)
    if "mse" in values:
        mse = values["mse"]
        if isinstance(mse, bool):
            mse = (base.mse or base.mse_norm) if mse else 0.0
        values["mse"] = float(mse)
    return replace(scheme, **values)


def written_for_engine_name(rule: DynamicRule, group: FusedGroup) -> bool:
    r"""Whether ``rule`` names the fused layer / experts module ``group`` as vLLM and SGLang see it
    and none of its members by their own names (``.*qkv_proj``, ``-:.*mlp\.experts$``): such a
    rule is meant for the whole group."""
    return rule.matches(group.fused_name) and not any(rule.matches(m) for m in group.members)


def resolve_module_scheme(
    name: str,
    base: BaseScheme,
    rules: Sequence[DynamicRule],
    groups: Sequence[FusedGroup] = (),
) -> ResolvedScheme:
    """The scheme of module ``name`` under ``rules`` (GPTQModel semantics, see the module doc).

    Negative rules are tried before positive ones whatever order ``rules`` is in; the first match
    decides and no later rule is consulted.

    :param groups: the fused layers / MoE experts modules serving engines load ``name`` as part of
        (:func:`msquant.plugin.model.engine_names`). A rule written for one of them
        (:func:`written_for_engine_name`) applies to ``name`` as vLLM and SGLang apply it when
        they read it back: ``.*qkv_proj`` reaches ``q_proj``, ``k_proj`` and ``v_proj``.
    """
    for rule in ordered_rules(rules):
        if not (rule.matches(name) or any(written_for_engine_name(rule, g) for g in groups)):
            continue
        if rule.negative:
            return replace(base.resolved(rule.source), skipped=True)
        return _apply(base, rule.overrides, rule.source)
    return base.resolved()


@dataclass(frozen=True)
class FusedNameMismatch:
    """A rule that matches a fused layer's name differently from its shards' names.

    vLLM and SGLang match ``dynamic`` rules against the fused name (``...self_attn.qkv_proj``);
    msquant and GPTQModel against each shard (``q_proj``, ``k_proj``, ``v_proj``).

    :param fused_matched: the rule matches the fused name.
    :param members_matched: the shards it matches.
    """

    rule: DynamicRule
    group: FusedGroup
    fused_matched: bool
    members_matched: tuple[str, ...]

    def describe(self) -> str:
        """e.g. ``matches model.layers.0.self_attn.qkv_proj, the fused name vLLM and SGLang match
        rules against, but only v_proj of its shards q_proj, k_proj, v_proj here``."""
        leaves = ", ".join(m.rpartition(".")[2] for m in self.group.members)
        hit = ", ".join(m.rpartition(".")[2] for m in self.members_matched) or "none"
        if self.fused_matched:
            return (
                f"matches {self.group.fused_name}, the fused name vLLM and SGLang match rules "
                f"against, but only {hit} of its shards {leaves} here"
            )
        return (
            f"matches {hit} of the shards {leaves} here, but not {self.group.fused_name}, the "
            "fused name vLLM and SGLang match rules against"
        )


def fused_name_mismatches(
    rules: Iterable[DynamicRule], groups: Iterable[FusedGroup]
) -> list[FusedNameMismatch]:
    """Every (rule, fused group) where the rule does not match the fused name and the shards'
    own names alike: it matches the fused name and some (not all) shards, or some shard but not
    the fused name. A rule matching the fused name and no shard is written for vLLM's names and
    applies to every shard (:func:`written_for_engine_name`): not a mismatch."""
    found = []
    groups = list(groups)
    for rule in rules:
        for group in groups:
            fused = rule.matches(group.fused_name)
            members = tuple(m for m in group.members if rule.matches(m))
            consistent = (fused and len(members) in (0, len(group.members))) or (
                not fused and not members
            )
            if not consistent:
                found.append(FusedNameMismatch(rule, group, fused, members))
    return found
