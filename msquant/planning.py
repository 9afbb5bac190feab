"""The quantization plan: which scheme every linear layer gets, and who decided, before any weight
is loaded.

Quantizing processors (``linear_quant``) describe their per-module decisions through the
:class:`ModulePlanner` protocol; this module combines the decisions of every ``spec.process`` entry
on a weightless (meta) copy of the model and checks what no single entry can see:

* a module selected by two entries is an error (naming the module and both ``spec.process[i]``);
* an output head (``lm_head``) tied to the input embeddings cannot be quantized (error naming the
  model, ``tie_word_embeddings`` and the fix);
* the shards of a layer vLLM fuses (q/k/v, gate/up) must resolve alike across entries (the
  entries check their own shards in ``check_model``);
* warnings: ``include`` patterns and ``dynamic`` rules matching nothing, and rules that match a
  fused name (what vLLM / SGLang match) differently from its shards (what msquant matches);
* what the savers' consumers will not load: processors implementing :class:`PlanReviewer`
  (savers, usually) check the finished plan and add their own errors and warnings, so that a
  run refuses or warns before weights load and ``msquant plan`` shows the same messages.

:func:`check_plan` is what a run calls after the processors' own ``check_model``;
:func:`plan` / :func:`build_plan` (``msquant plan``) return the table.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from torch import nn

from msquant.config.processors import build_processors
from msquant.config.resolve import ConfigLike, resolve_config
from msquant.errors import QuantizationError
from msquant.load.model_folder import build_meta_model, check_model_dir, load_model_config
from msquant.model.fused import (
    FusedGroup,
    engine_names,
    expert_group_problems,
    expert_groups,
    fused_group_problems,
    fused_groups,
)
from msquant.model.head import find_output_head, head_is_tied, tied_head_message
from msquant.model.layers import DecoderLayer, find_decoder_layers
from msquant.plugin.registry import ProcessorRegistry, default_registry
from msquant.quant.rules import (
    BASE_SOURCE,
    DynamicRule,
    FusedNameMismatch,
    ResolvedScheme,
    fused_name_mismatches,
)

if TYPE_CHECKING:
    from msquant.plugin.processor import Processor

__all__ = [
    "ModuleDecision",
    "ModulePlanner",
    "PlanReview",
    "PlanReviewer",
    "PlanRow",
    "ModelPlan",
    "analyse_plan",
    "check_plan",
    "build_plan",
    "plan",
    "render_plan",
    "entry_path",
]

logger = logging.getLogger(__name__)

#: How many modules a message lists before "and N more".
LISTED = 4
NOT_SELECTED = "not selected by any quantizing entry"


@dataclass(frozen=True)
class ModuleDecision:
    """What one quantizing entry decides for one module it considers.

    :param scheme: the resolved scheme (possibly ``skipped`` by a negative rule) when the entry
        selects the module (its include/exclude match it); None when it does not.
    :param method: the entry's method (``minmax``, ``gptq``).
    :param reason: why an unselected module is not selected, e.g. ``exclude *down_proj``
        (empty when no include pattern matched it).
    """

    scheme: ResolvedScheme | None
    method: str
    reason: str = ""


@runtime_checkable
class ModulePlanner(Protocol):
    """A processor that can say, on the meta model, what it will do to each module."""

    def plan_modules(
        self, model: nn.Module, layers: Sequence[DecoderLayer]
    ) -> Mapping[str, ModuleDecision]:
        """Decision per module name for every module the entry considers (selected or not)."""
        ...

    def plan_rules(self) -> Sequence[DynamicRule]:
        """The entry's ``dynamic`` rules in evaluation order."""
        ...

    def plan_notes(self, model: nn.Module, layers: Sequence[DecoderLayer]) -> list[str]:
        """Warnings about the entry alone (e.g. include patterns matching nothing)."""
        ...


def entry_path(index: int) -> str:
    """``spec.process[index]``."""
    return f"spec.process[{index}]"


def _source(index: int, scheme: ResolvedScheme) -> str:
    """``spec.process[0]`` (its qconfig) or ``spec.process[0].dynamic["..."]``."""
    if scheme.decided_by == BASE_SOURCE:
        return entry_path(index)
    return f"{entry_path(index)}.{scheme.decided_by}"


@dataclass(frozen=True)
class PlanRow:
    """One linear layer of the plan.

    ``bits``, ``group_size`` (-1 = per-channel), ``sym``, ``desc_act`` and ``method`` are None for
    a module left in float; ``decided_by`` names the entry and rule, e.g.
    ``spec.process[0].dynamic["-:.*down.*"]`` or ``spec.process[0] exclude *down_proj``.
    """

    module: str
    bits: int | None
    group_size: int | None
    sym: bool | None
    desc_act: bool | None
    method: str | None
    skipped: bool
    decided_by: str
    entry: int | None

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready mapping."""
        return asdict(self)


@dataclass
class ModelPlan:
    """The plan of a whole model: rows in model order, errors (the run is refused) and warnings."""

    rows: list[PlanRow]
    errors: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    model_type: str = "unknown"

    @property
    def ok(self) -> bool:
        """No error: the config can be applied to this model."""
        return not self.errors

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready mapping (``msquant plan --json``)."""
        return {
            "ok": self.ok,
            "model_type": self.model_type,
            "rows": [row.to_dict() for row in self.rows],
            "errors": list(self.errors),
            "warnings": list(self.warnings),
        }


@dataclass
class PlanReview:
    """What a :class:`PlanReviewer` found in a plan: errors refuse the run, warnings are logged
    (both are shown by ``msquant plan``). Messages name the reviewer, e.g. ``gptq_saver: ...``."""

    errors: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)


@runtime_checkable
class PlanReviewer(Protocol):
    """A processor (usually a saver) that checks the whole plan against what the consumers of
    its output load, before any weight is loaded."""

    def review_plan(self, plan: ModelPlan, model: nn.Module) -> PlanReview:
        """Problems of ``plan`` (every linear layer's scheme, the output head included) for this
        processor's consumers; ``model`` is the weightless model the plan was made on."""
        ...


def _planners(processors: Sequence[Processor]) -> list[tuple[int, ModulePlanner]]:
    """The ``spec.process`` entries that plan modules, with their index in ``spec.process``."""
    found: list[tuple[int, ModulePlanner]] = []
    process = [p for p in processors if p.stage == "process"]
    for index, processor in enumerate(process):
        if isinstance(processor, ModulePlanner):
            found.append((index, processor))
    return found


def _module_names(
    layers: Sequence[DecoderLayer], decisions: Sequence[Mapping[str, ModuleDecision]]
) -> list[str]:
    """Every linear layer of the decoder layers, then any other module an entry considers."""
    names = [name for layer in layers for name, _ in layer.named_linears()]
    known = set(names)
    for entry in decisions:
        for name in entry:
            if name not in known:
                names.append(name)
                known.add(name)
    return names


def _row(
    name: str,
    decided: list[tuple[int, ModuleDecision]],
    selecting: list[tuple[int, ModuleDecision]],
) -> PlanRow:
    """The row of one module: the first selecting entry's scheme, or why it stays in float."""
    if selecting:
        index, decision = selecting[0]
        scheme = decision.scheme
        assert scheme is not None
        if scheme.skipped:
            return PlanRow(name, None, None, None, None, None, True, _source(index, scheme), index)
        return PlanRow(
            name,
            scheme.bits,
            scheme.group_size,
            scheme.sym,
            scheme.desc_act,
            decision.method,
            False,
            _source(index, scheme),
            index,
        )
    for index, decision in decided:
        if decision.reason:
            return PlanRow(
                name,
                None,
                None,
                None,
                None,
                None,
                True,
                f"{entry_path(index)} {decision.reason}",
                None,
            )
    return PlanRow(name, None, None, None, None, None, True, NOT_SELECTED, None)


def _listing(names: Sequence[str]) -> str:
    shown = ", ".join(names[:LISTED])
    return shown + (f" and {len(names) - LISTED} more" if len(names) > LISTED else "")


def _overlap_errors(
    selected_by: Mapping[str, list[tuple[int, ModuleDecision]]],
) -> list[str]:
    """One error per pair of entries selecting the same modules."""
    pairs: dict[tuple[int, int], list[str]] = {}
    for name, selecting in selected_by.items():
        indexes = [index for index, _ in selecting]
        for position, first in enumerate(indexes):
            for second in indexes[position + 1 :]:
                pairs.setdefault((first, second), []).append(name)
    return [
        f"{entry_path(a)} and {entry_path(b)} both select {_listing(names)}: a module may be "
        "quantized by one linear_quant entry only; narrow their include / exclude patterns "
        "(or use one entry with dynamic rules)"
        for (a, b), names in pairs.items()
    ]


def _fused_errors(
    groups: Sequence[FusedGroup],
    selected_by: Mapping[str, list[tuple[int, ModuleDecision]]],
    rows: Mapping[str, PlanRow],
) -> list[str]:
    """Fused groups (and MoE experts modules) split across entries (or between an entry and
    no entry).

    Groups whose shards are all selected by one and the same entry are that entry's own
    ``check_model`` business (so a run reports them once).
    """
    members: dict[str, tuple[object, ...]] = {}
    describe: dict[str, str] = {}
    for group in groups:
        owners = {tuple(i for i, _ in selected_by.get(m, [])) for m in group.members}
        if len(owners) == 1 and len(next(iter(owners))) == 1:
            continue
        for member in group.members:
            selecting = selected_by.get(member, [])
            if selecting:
                index, decision = selecting[0]
                assert decision.scheme is not None
                members[member] = decision.scheme.signature()
                describe[member] = (
                    f"{decision.scheme.describe()} by {_source(index, decision.scheme)}"
                )
            else:
                members[member] = ("skipped",)
                describe[member] = f"not quantized ({rows[member].decided_by})"
    return fused_group_problems(members, describe) + expert_group_problems(members, describe)


def _tied_head_errors(
    model: nn.Module, selected_by: Mapping[str, list[tuple[int, ModuleDecision]]]
) -> list[str]:
    """A quantized output head must not share its weight with the input embeddings."""
    found = find_output_head(model)
    if found is None:
        return []
    name = found[0]
    quantizing = [
        index
        for index, decision in selected_by.get(name, [])
        if decision.scheme is not None and not decision.scheme.skipped
    ]
    if not quantizing or not head_is_tied(model):
        return []
    return [tied_head_message(model, name, f"{entry_path(quantizing[0])} (lm_head: true)")]


def _nothing_quantized_errors(rows: Sequence[PlanRow], planners: int) -> list[str]:
    """A run that would quantize no linear layer is refused before any weight is loaded (its
    export would be the float model under a quantized format's name). Only asked when every
    ``spec.process`` entry plans its modules: a plugin processor that does not may quantize
    modules the plan cannot see."""
    if any(not row.skipped for row in rows):
        return []
    if not planners:
        return [
            "spec.process has no entry that quantizes linear layers, so the export would be the "
            "float model; add a linear_quant entry"
        ]
    reasons = Counter(row.decided_by for row in rows).most_common()
    shown = "; ".join(f"{count} {reason}" for reason, count in reasons[:LISTED])
    more = f"; and {len(reasons) - LISTED} more reason(s)" if len(reasons) > LISTED else ""
    return [
        f"the config quantizes none of the model's {len(rows)} linear layer(s) ({shown}{more}), "
        "so the export would be the float model; check the entries' include / exclude patterns "
        "and dynamic rules against the module names (msquant plan lists every module and what "
        "decided it)"
    ]


def _mismatch_warnings(index: int, mismatches: Sequence[FusedNameMismatch]) -> list[str]:
    """Rules matching a fused name differently from its shards, one warning per rule and kind."""
    kinds: dict[tuple[str, str, bool, tuple[str, ...]], list[FusedNameMismatch]] = {}
    for found in mismatches:
        leaf = found.group.fused_name.rpartition(".")[2]
        hit = tuple(m.rpartition(".")[2] for m in found.members_matched)
        kinds.setdefault((found.rule.key, leaf, found.fused_matched, hit), []).append(found)
    warnings = []
    for found_list in kinds.values():
        first = found_list[0]
        more = f" (and in {len(found_list) - 1} more layer(s))" if len(found_list) > 1 else ""
        shards = [m.rpartition(".")[2] for m in first.group.members]
        every = [*shards, first.group.fused_name.rpartition(".")[2]]
        warnings.append(
            f"{entry_path(index)}.{first.rule.source} {first.describe()}{more}; msquant applies "
            "rules to each Hugging Face module and its exports carry exact per-module rules, but "
            "in a vLLM / SGLang config this rule would act differently: make it match all of "
            f"{', '.join(every)} or none, e.g. (?:{'|'.join(every)})"
        )
    return warnings


def _rule_warnings(
    index: int,
    rules: Sequence[DynamicRule],
    selected: Sequence[str],
    groups: Sequence[FusedGroup],
    head: str | None = None,
) -> list[str]:
    """Rules matching none of the entry's modules, and fused-name mismatches.

    :param head: the output head's name: a rule matching it while the entry does not select the
        head is explained by the entry's own notes (``lm_head: false``), not reported here.
    """
    warnings = []
    # a rule may be written against the names engines load modules under (qkv_proj, ...experts)
    reachable = [
        *selected,
        *{g.fused_name for found in engine_names(selected).values() for g in found},
    ]
    for rule in rules:
        if head is not None and head not in selected and rule.matches(head):
            continue
        if not any(rule.matches(name) for name in reachable):
            example = selected[0] if selected else "model.layers.0.mlp.down_proj"
            warnings.append(
                f"{entry_path(index)}.{rule.source} matches none of the {len(selected)} module(s) "
                f"this entry selects (rules are matched with re.match from the start of the full "
                f"name, e.g. {example}: start them with .*)"
            )
    chosen = set(selected)
    mine = [g for g in groups if all(m in chosen for m in g.members)]
    warnings += _mismatch_warnings(index, fused_name_mismatches(rules, mine))
    return warnings


def analyse_plan(
    processors: Sequence[Processor], model: nn.Module, layers: Sequence[DecoderLayer]
) -> ModelPlan:
    """The plan of ``model`` (usually a meta model) under the ``spec.process`` entries, with the
    cross-entry errors and the warnings (the entries' own ``check_model`` errors are not included).
    """
    planners = _planners(processors)
    decisions = [planner.plan_modules(model, layers) for _, planner in planners]
    names = _module_names(layers, decisions)
    selected_by: dict[str, list[tuple[int, ModuleDecision]]] = {}
    rows = []
    for name in names:
        decided = [
            (index, found[name])
            for (index, _), found in zip(planners, decisions, strict=True)
            if name in found
        ]
        selecting = [(index, d) for index, d in decided if d.scheme is not None]
        if selecting:
            selected_by[name] = selecting
        rows.append(_row(name, decided, selecting))
    groups = fused_groups(names)
    by_name = {row.module: row for row in rows}
    errors = _overlap_errors(selected_by)
    errors += _fused_errors([*groups, *expert_groups(names)], selected_by, by_name)
    errors += _tied_head_errors(model, selected_by)
    process = [p for p in processors if p.stage == "process"]
    if len(planners) == len(process):  # a processor that does not plan may quantize on its own
        errors += _nothing_quantized_errors(rows, len(planners))
    head = find_output_head(model)
    warnings: list[str] = []
    for (index, planner), found in zip(planners, decisions, strict=True):
        warnings += [f"{entry_path(index)}: {note}" for note in planner.plan_notes(model, layers)]
        selected = [name for name, d in found.items() if d.scheme is not None]
        warnings += _rule_warnings(
            index, planner.plan_rules(), selected, groups, head[0] if head else None
        )
    model_type = str(getattr(getattr(model, "config", None), "model_type", "unknown"))
    result = ModelPlan(rows, errors, warnings, model_type)
    for processor in processors:
        if isinstance(processor, PlanReviewer):
            review = processor.review_plan(result, model)
            result.errors += review.errors
            result.warnings += review.warnings
    return result


def check_plan(
    processors: Sequence[Processor], model: nn.Module, layers: Sequence[DecoderLayer]
) -> list[str]:
    """The cross-entry problems of a run (logging the warnings): call it on the meta model after
    every processor's ``check_model``, before weights are loaded."""
    result = analyse_plan(processors, model, layers)
    for warning in result.warnings:
        logger.warning("%s", warning)
    return result.errors


def build_plan(
    model_path: str | Path,
    config: ConfigLike,
    *,
    trust_remote_code: bool = False,
    registry: ProcessorRegistry | None = None,
) -> ModelPlan:
    """The plan of a model folder under a config, with every problem a run would report before
    loading weights (the processors' ``check_model`` errors included). Nothing is quantized and no
    weight is read: the model is built on the meta device from its ``config.json``.

    :raises msquant.MsquantInputError: for an invalid config or model folder.
    """
    registry = registry if registry is not None else default_registry()
    resolved = resolve_config(config, registry)
    processors = build_processors(resolved.config, registry)
    model_dir = check_model_dir(model_path)
    meta_model = build_meta_model(
        load_model_config(model_dir, trust_remote_code), trust_remote_code
    )
    layers = find_decoder_layers(meta_model)
    own = [message for p in processors for message in p.check_model(meta_model, layers)]
    result = analyse_plan(processors, meta_model, layers)
    result.errors[:0] = own
    return result


def plan(
    model_path: str | Path,
    config: ConfigLike,
    *,
    trust_remote_code: bool = False,
    registry: ProcessorRegistry | None = None,
) -> list[PlanRow]:
    """Per linear layer: the bits, group size, symmetry, method, skip decision and deciding rule
    a run of ``config`` on ``model_path`` would use (``msquant plan``). Warnings are logged.

    :raises msquant.QuantizationError: listing every problem when the config cannot be applied
        to this model (the same problems ``quantize`` refuses before loading weights).
    :raises msquant.MsquantInputError: for an invalid config or model folder.
    """
    result = build_plan(model_path, config, trust_remote_code=trust_remote_code, registry=registry)
    for warning in result.warnings:
        logger.warning("%s", warning)
    if result.errors:
        count = len(result.errors)
        raise QuantizationError(
            f"the config cannot be applied to this model ({count} problem{'s' if count > 1 else ''}):\n"
            + "\n".join(f"  - {p}" for p in result.errors)
        )
    return result.rows


def _cell(value: object) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    return str(value)


def render_plan(result: ModelPlan) -> str:
    """A plain-text table of the plan followed by a summary, the errors and the warnings."""
    header = ("module", "bits", "group", "sym", "method", "skipped", "decided by")
    table: list[tuple[str, ...]] = [header]
    for row in result.rows:
        group = "channel" if row.group_size == -1 else _cell(row.group_size)
        table.append(
            (
                row.module,
                _cell(row.bits),
                group,
                _cell(row.sym),
                _cell(row.method),
                _cell(row.skipped),
                row.decided_by,
            )
        )
    widths = [max(len(line[i]) for line in table) for i in range(len(header))]
    lines = [
        "  ".join(cell.ljust(width) for cell, width in zip(line, widths, strict=True)).rstrip()
        for line in table
    ]
    quantized = [row for row in result.rows if not row.skipped]
    lines.append(
        f"{result.model_type}: {len(result.rows)} linear layer(s), {len(quantized)} quantized, "
        f"{len(result.rows) - len(quantized)} left in float"
    )
    for kind, messages in (("error", result.errors), ("warning", result.warnings)):
        if messages:
            lines.append(f"{len(messages)} {kind}(s):")
            lines += [f"  - {message}" for message in messages]
    lines.append("OK" if result.ok else "FAILED: the config cannot be applied to this model")
    return "\n".join(lines)
