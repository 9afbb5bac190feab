"""GPTQModel ``dynamic`` rule semantics (msquant.quant.rules): parsing, validation, resolution.

The resolution is checked against the rules stated in the reference notes (formats.md 1.1, 1.3,
1.4) and, on random rule sets, against an independent transcription of vLLM's
``get_dynamic_override`` (iterate the rules in saved order - negatives first - and return at the
first match).
"""

from __future__ import annotations

import random
import re
from typing import Any

import pytest

import msquant
import msquant.plugin
import msquant.plugin.planning
from msquant.plugin import BaseScheme, DynamicRule
from msquant.plugin.model import FusedGroup
from msquant.plugin.planning import parse_dynamic, resolve_module_scheme

BASE = BaseScheme(bits=4, group_size=128, sym=True, desc_act=False, percdamp=0.01, mse=0.0)
Q = "model.layers.0.self_attn.q_proj"
K = "model.layers.0.self_attn.k_proj"
DOWN = "model.layers.0.mlp.down_proj"


def rules(mapping: dict[str, dict[str, Any]]) -> tuple[DynamicRule, ...]:
    parsed, issues = parse_dynamic(mapping)
    assert not issues, issues
    return parsed


def test_no_rule_gives_the_base_scheme() -> None:
    scheme = resolve_module_scheme(Q, BASE, ())
    assert (scheme.bits, scheme.group_size, scheme.sym, scheme.skipped) == (4, 128, True, False)
    assert scheme.decided_by == "qconfig"


def test_first_matching_rule_wins() -> None:
    found = rules({".*q_proj": {"bits": 8}, ".*proj": {"bits": 2}})
    assert resolve_module_scheme(Q, BASE, found).bits == 8
    assert resolve_module_scheme(Q, BASE, found).decided_by == 'dynamic[".*q_proj"]'
    assert resolve_module_scheme(K, BASE, found).bits == 2
    assert resolve_module_scheme(K, BASE, found).decided_by == 'dynamic[".*proj"]'


def test_no_fall_through_missing_keys_come_from_the_base() -> None:
    """A {"bits": 8} rule shadows a later {"group_size": 32} rule (formats.md 1.1, [ran])."""
    found = rules({r".*\.0\..*": {"bits": 8}, ".*q_proj": {"group_size": 32, "sym": False}})
    scheme = resolve_module_scheme(Q, BASE, found)
    assert (scheme.bits, scheme.group_size, scheme.sym) == (8, 128, True)
    other = resolve_module_scheme("model.layers.1.self_attn.q_proj", BASE, found)
    assert (other.bits, other.group_size, other.sym) == (4, 32, False)


def test_negative_rules_are_evaluated_first_whatever_the_order_written() -> None:
    found = rules({".*": {"bits": 8}, "-:.*down_proj": {}, "+:.*q_proj": {"bits": 2}})
    assert [r.key for r in found] == ["-:.*down_proj", ".*", "+:.*q_proj"]
    down = resolve_module_scheme(DOWN, BASE, found)
    assert down.skipped and down.decided_by == 'dynamic["-:.*down_proj"]'
    assert down.describe() == "not quantized"
    # the positive ".*" written before "+:.*q_proj" wins for q_proj
    assert resolve_module_scheme(Q, BASE, found).bits == 8
    # resolve_module_scheme orders by itself, even when handed positive rules first
    reversed_rules = tuple(reversed(found))
    assert resolve_module_scheme(DOWN, BASE, reversed_rules).skipped


def test_patterns_are_anchored_at_the_start_only() -> None:
    bare = DynamicRule.parse("q_proj", {"bits": 8})
    assert not bare.matches(Q)  # re.match: a bare name does not match the full module name
    assert bare.matches("q_proj_x")  # ... but it is not anchored at the end
    dotted = DynamicRule.parse(".*q_proj", {"bits": 8})
    assert dotted.matches(Q) and dotted.matches(Q + "_extra")
    anchored = DynamicRule.parse("^model\\.layers\\.0\\.self_attn\\.q_proj$", {"bits": 8})
    assert anchored.matches(Q) and not anchored.matches(Q + "_extra")
    assert resolve_module_scheme(Q, BASE, (bare,)).decided_by == "qconfig"


def test_plus_prefix_is_the_same_as_no_prefix() -> None:
    plus, bare = (
        DynamicRule.parse("+:.*q_proj", {"bits": 8}),
        DynamicRule.parse(".*q_proj", {"bits": 8}),
    )
    assert plus.pattern == bare.pattern == ".*q_proj"
    assert not plus.negative and not bare.negative
    assert (
        resolve_module_scheme(Q, BASE, (plus,)).bits
        == resolve_module_scheme(Q, BASE, (bare,)).bits
        == 8
    )


def test_override_keys() -> None:
    found = rules(
        {
            ".*q_proj": {"group_size": -1, "desc_act": True, "damp_percent": 0.1, "mse": True},
            ".*k_proj": {"percdamp": 0.2, "mse": 3.0, "static_groups": True, "sym": False},
            ".*v_proj": {"mse": False, "bits": 3},
        }
    )
    q = resolve_module_scheme(Q, BASE, found)
    assert (q.group_size, q.desc_act, q.percdamp) == (None, True, 0.1)  # -1: per-channel
    assert q.mse == 2.4  # mse: true turns the search on with the base norm
    assert q.describe() == "int4 per-channel sym act-order"
    k = resolve_module_scheme(K, BASE, found)
    assert (k.percdamp, k.mse, k.static_groups, k.sym) == (0.2, 3.0, True, False)
    v = resolve_module_scheme("model.layers.0.self_attn.v_proj", BASE, found)
    assert (v.bits, v.mse, v.describe()) == (3, 0.0, "int3 group 128 sym")


def test_mse_true_uses_the_entry_norm() -> None:
    base = BaseScheme(bits=4, group_size=-1, sym=True, mse=0.0, mse_norm=3.5)
    assert resolve_module_scheme(Q, base, rules({".*": {"mse": True}})).mse == 3.5
    on = BaseScheme(bits=4, group_size=-1, sym=True, mse=2.0, mse_norm=2.0)
    assert resolve_module_scheme(Q, on, rules({".*": {"mse": 0}})).mse == 0.0


@pytest.mark.parametrize(
    ("dynamic", "path", "message"),
    [
        (
            {"+:.*q_proj": {"foo": 1}},
            'dynamic["+:.*q_proj"].foo',
            "unknown dynamic override; valid: bits, group_size",
        ),
        (
            {".*(q_proj": {"bits": 8}},
            'dynamic[".*(q_proj"]',
            "invalid regular expression '.*(q_proj'",
        ),
        ({"-:.*[": {}}, 'dynamic["-:.*["]', "invalid regular expression '.*['"),
        ({".*": {"bits": 9}}, 'dynamic[".*"].bits', "less than or equal to 8"),
        ({".*": {"bits": 1}}, 'dynamic[".*"].bits', "greater than or equal to 2"),
        ({".*": {"bits": True}}, 'dynamic[".*"].bits', "valid integer"),
        ({".*": {"bits": "8"}}, 'dynamic[".*"].bits', "valid integer"),
        ({".*": {"group_size": 0}}, 'dynamic[".*"].group_size', "-1 (per-channel) or a positive"),
        ({".*": {"group_size": -2}}, 'dynamic[".*"].group_size', "-1 (per-channel) or a positive"),
        ({".*": {"sym": "yes"}}, 'dynamic[".*"].sym', "valid boolean"),
        ({".*": {"damp_percent": 0}}, 'dynamic[".*"].damp_percent', "greater than 0"),
        ({".*": {"mse": -1}}, 'dynamic[".*"].mse', "expected true, false or a norm >= 0"),
        ({".*": {"damp_percent": 0.1, "percdamp": 0.1}}, 'dynamic[".*"].percdamp', "not both"),
        ({"-:.*down": {"bits": 8}}, 'dynamic["-:.*down"]', "takes no overrides"),
        ({".*": [8]}, 'dynamic[".*"]', "must be a mapping"),
    ],
)
def test_invalid_rules_are_reported_with_their_path(
    dynamic: dict[str, Any], path: str, message: str
) -> None:
    found, issues = parse_dynamic(dynamic)
    assert found == ()
    assert [issue.path for issue in issues] == [path]
    assert message in issues[0].message


def test_gptq_only_keys_are_refused_where_not_allowed() -> None:
    allowed = [
        k
        for k in msquant.plugin.planning.DYNAMIC_KEYS
        if k not in msquant.plugin.planning.GPTQ_ONLY_KEYS
    ]
    _, issues = parse_dynamic(
        {".*": {"desc_act": True, "bits": 8}}, allowed, {"desc_act": ["gptq"]}
    )
    assert [(i.path, i.message.split(";")[0]) for i in issues] == [
        ('dynamic[".*"].desc_act', "applies to method gptq only")
    ]


def test_null_value_is_an_empty_override() -> None:
    (rule,) = rules({"-:.*down": None})  # type: ignore[dict-item]
    assert rule.negative and dict(rule.overrides) == {}


def test_errors_carry_the_full_yaml_path() -> None:
    config = {
        "apiversion": "modelslim_v1",
        "spec": {
            "process": [
                {
                    "type": "linear_quant",
                    "qconfig": {
                        "weight": {"dtype": "int4", "scope": "per_group", "method": "minmax"}
                    },
                    "dynamic": {
                        "+:.*q_proj": {"foo": 1},
                        ".*(": {},
                        ".*k_proj": {"desc_act": True},
                    },
                }
            ]
        },
    }
    with pytest.raises(msquant.ConfigError) as info:
        msquant.validate_config(config, msquant.plugin.default_registry())
    paths = [issue.path for issue in info.value.issues]
    assert paths == [
        'spec.process[0].dynamic["+:.*q_proj"].foo',
        'spec.process[0].dynamic[".*("]',
        'spec.process[0].dynamic[".*k_proj"].desc_act',
    ]
    assert "invalid regular expression '.*('" in str(info.value)


# -- vLLM's fused names ----------------------------------------------------------------------


QKV = FusedGroup("model.layers.0.self_attn.qkv_proj", (Q, K, "model.layers.0.self_attn.v_proj"))
GATE_UP = FusedGroup(
    "model.layers.0.mlp.gate_up_proj",
    ("model.layers.0.mlp.gate_proj", "model.layers.0.mlp.up_proj"),
)


@pytest.mark.parametrize(
    ("pattern", "group", "fused", "members"),
    [
        # formats.md 1.4 [ran]: q/k/gate do not match the fused name, v and up do
        (".*q_proj", QKV, False, ("q_proj",)),
        (".*k_proj", QKV, False, ("k_proj",)),
        (".*v_proj", QKV, True, ("v_proj",)),
        (".*gate_proj", GATE_UP, False, ("gate_proj",)),
        (".*up_proj", GATE_UP, True, ("up_proj",)),
        (r".*mlp\.(?:gate|up)_proj", GATE_UP, False, ("gate_proj", "up_proj")),
    ],
)
def test_rules_matching_fused_names_differently_are_found(
    pattern: str, group: FusedGroup, fused: bool, members: tuple[str, ...]
) -> None:
    (found,) = msquant.plugin.planning.fused_name_mismatches(
        [DynamicRule.parse(pattern, {"bits": 8})], [group]
    )
    assert found.fused_matched is fused
    assert tuple(m.rpartition(".")[2] for m in found.members_matched) == members
    text = found.describe()
    assert group.fused_name in text and "vLLM" in text


@pytest.mark.parametrize(
    "pattern",
    [
        r".*\.0\..*",
        r".*(?:q|k|v|qkv)_proj",
        r".*\.1\..*",
        r".*\.0\..*(?:gate|up).*",
        "-:.*down_proj",
    ],
)
def test_rules_treating_fused_layers_alike_are_not_reported(pattern: str) -> None:
    rule = DynamicRule.parse(pattern)
    assert msquant.plugin.planning.fused_name_mismatches([rule], [QKV, GATE_UP]) == []


# -- an independent transcription of vLLM's get_dynamic_override --------------------------------


def vllm_dynamic_override(
    dynamic: dict[str, dict[str, Any]], name: str, key: str, default: Any
) -> Any:
    """formats.md 1.3: rules in file order (GPTQModel saved negatives first); ``-:`` -> False."""
    for pattern, overrides in dynamic.items():
        if pattern.startswith("-:"):
            if re.match(pattern[2:], name):
                return False
        elif re.match(pattern.removeprefix("+:"), name):
            return overrides.get(key, default)
    return default


def gptqmodel_saved_order(dynamic: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """GPTQModel re-orders the dict: all negative rules first, each group in insertion order."""
    negatives = {k: v for k, v in dynamic.items() if k.startswith("-:")}
    return negatives | {k: v for k, v in dynamic.items() if not k.startswith("-:")}


def test_resolution_agrees_with_vllm_on_random_rule_sets() -> None:
    rng = random.Random(0)
    names = [
        f"model.layers.{layer}.{part}"
        for layer in range(12)
        for part in ("self_attn.q_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.down_proj")
    ]
    fragments = [r"\.1\.", r"\.1", r"\.(?:2|3)\.", "q_proj", "proj", "mlp", "down", r"\.1[01]\."]
    for _ in range(200):
        dynamic: dict[str, dict[str, Any]] = {}
        for _ in range(rng.randint(1, 5)):
            prefix = rng.choice(["", "+:", "-:"])
            body = ".*" + rng.choice(fragments) + rng.choice(["", ".*"])
            if rng.random() < 0.15:
                body = rng.choice(fragments)  # a pattern without a leading .*
            overrides = (
                {}
                if prefix == "-:"
                else {
                    k: v
                    for k, v in (
                        ("bits", rng.choice([2, 3, 8])),
                        ("group_size", rng.choice([-1, 32])),
                    )
                    if rng.random() < 0.7
                }
            )
            dynamic[prefix + body] = overrides
        found = rules(dynamic)
        saved = gptqmodel_saved_order(dynamic)
        for name in names:
            scheme = resolve_module_scheme(name, BASE, found)
            expected_bits = vllm_dynamic_override(saved, name, "bits", BASE.bits)
            if expected_bits is False:
                assert scheme.skipped, (dynamic, name)
                continue
            assert not scheme.skipped, (dynamic, name)
            assert scheme.bits == expected_bits, (dynamic, name)
            group_size = -1 if scheme.group_size is None else scheme.group_size  # vLLM's -1
            base_group = -1 if BASE.group_size is None else BASE.group_size
            assert group_size == vllm_dynamic_override(saved, name, "group_size", base_group)
