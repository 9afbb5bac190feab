"""What no single ``spec.process`` entry can see, found across the entries of a plan: errors
(modules selected twice, fused groups split, a tied head quantized, nothing quantized) and warnings
(rules matching nothing, rules matching a fused name differently from its shards).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence

from torch import nn

from msquant.model.adapter import ModelAdapter
from msquant.model.fused import FusedGroup, expert_groups, fused_groups
from msquant.model.head import head_is_tied, tied_head_message
from msquant.planning.model import ModuleDecision, PlanRow, entry_path, source_of
from msquant.quant.rules import DynamicRule, FusedNameMismatch, fused_name_mismatches

__all__ = [
    "LISTED",
    "listing",
    "overlap_errors",
    "fused_errors",
    "tied_head_errors",
    "nothing_quantized_errors",
    "rule_warnings",
]


#: How many modules a message lists before "and N more".
LISTED = 4


def listing(names: Sequence[str]) -> str:
    """The first :data:`LISTED` names, then how many more there are."""
    shown = ", ".join(names[:LISTED])
    return shown + (f" and {len(names) - LISTED} more" if len(names) > LISTED else "")


def overlap_errors(
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
        f"{entry_path(a)} and {entry_path(b)} both select {listing(names)}: a module may be "
        "quantized by one linear_quant entry only; narrow their include / exclude patterns "
        "(or use one entry with dynamic rules)"
        for (a, b), names in pairs.items()
    ]


def fused_errors(
    groups: Sequence[FusedGroup],
    selected_by: Mapping[str, list[tuple[int, ModuleDecision]]],
    rows: Mapping[str, PlanRow],
    adapter: ModelAdapter,
) -> list[str]:
    """Fused groups (and MoE experts modules) split across entries (or between an entry and
    no entry).

    Groups of the generic table whose shards are all selected by one and the same entry are that
    entry's own ``check_model`` business (so a run reports them once); the groups only the model's
    adapter knows (e.g. Qwen3.5's ``in_proj_qkvz``) are checked here whoever selects them, since
    the processors check the generic table (:func:`msquant.plugin.model.fused_groups`).

    :param adapter: the model's adapter, which knows its fused matrices.
    """
    names = [member for group in groups for member in group.members]
    generic = {group.fused_name for group in [*fused_groups(names), *expert_groups(names)]}
    members: dict[str, tuple[object, ...]] = {}
    describe: dict[str, str] = {}
    for group in groups:
        owners = {tuple(i for i, _ in selected_by.get(m, [])) for m in group.members}
        one_entry = len(owners) == 1 and len(next(iter(owners))) == 1
        if one_entry and group.fused_name in generic:
            continue
        for member in group.members:
            selecting = selected_by.get(member, [])
            if selecting:
                index, decision = selecting[0]
                assert decision.scheme is not None
                members[member] = decision.scheme.signature()
                describe[member] = (
                    f"{decision.scheme.describe()} by {source_of(index, decision.scheme)}"
                )
            else:
                members[member] = ("skipped",)
                describe[member] = f"not quantized ({rows[member].decided_by})"
    return adapter.fused_group_problems(members, describe) + adapter.expert_group_problems(
        members, describe
    )


def tied_head_errors(
    model: nn.Module,
    selected_by: Mapping[str, list[tuple[int, ModuleDecision]]],
    adapter: ModelAdapter,
) -> list[str]:
    """A quantized output head must not share its weight with the input embeddings."""
    found = adapter.output_head(model)
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


#: How to write a float export on purpose, appended to the refusals below.
FLOAT_EXPORT_HINT = (
    "; to write the float model on purpose, pass --allow_float_export (Python: "
    "allow_float_export=True)"
)


def nothing_quantized_errors(
    rows: Sequence[PlanRow], planners: int, transforms: Sequence[str] = ()
) -> list[str]:
    """A run that would quantize no linear layer is refused before any weight is loaded (its
    export would be the float model under a quantized format's name), unless the user asks for
    a float export. Only asked when every ``spec.process`` entry plans its modules or only
    transforms weights (``transforms``: the types of those, a rotation or a smoothing): another
    plugin processor may quantize modules the plan cannot see."""
    if any(not row.skipped for row in rows):
        return []
    if not planners and transforms:
        return [
            f"spec.process transforms the weights ({', '.join(dict.fromkeys(transforms))}) but "
            "has no entry that quantizes linear layers, so the export would be a float model "
            "under a quantized format's name; add a linear_quant entry after it (as "
            "yaml_examples/w8a8_dynamic_iter_smooth.yaml does)" + FLOAT_EXPORT_HINT
        ]
    if not planners:
        return [
            "spec.process has no entry that quantizes linear layers, so the export would be the "
            "float model; add a linear_quant entry" + FLOAT_EXPORT_HINT
        ]
    reasons = Counter(row.decided_by for row in rows).most_common()
    shown = "; ".join(f"{count} {reason}" for reason, count in reasons[:LISTED])
    more = f"; and {len(reasons) - LISTED} more reason(s)" if len(reasons) > LISTED else ""
    return [
        f"the config quantizes none of the model's {len(rows)} linear layer(s) ({shown}{more}), "
        "so the export would be the float model; check the entries' include / exclude patterns "
        "and dynamic rules against the module names (msquant plan lists every module and what "
        "decided it)" + FLOAT_EXPORT_HINT
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


def rule_warnings(
    index: int,
    rules: Sequence[DynamicRule],
    selected: Sequence[str],
    groups: Sequence[FusedGroup],
    adapter: ModelAdapter,
    head: str | None = None,
) -> list[str]:
    """Rules matching none of the entry's modules, and fused-name mismatches.

    :param adapter: the model's adapter (the names engines load modules under).
    :param head: the output head's name: a rule matching it while the entry does not select the
        head is explained by the entry's own notes (``lm_head: false``), not reported here.
    """
    warnings = []
    # a rule may be written against the names engines load modules under (qkv_proj, ...experts)
    reachable = [
        *selected,
        *{g.fused_name for found in adapter.engine_names(selected).values() for g in found},
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
