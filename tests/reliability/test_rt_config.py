"""Red-team replays: hostile and broken config files (Y-rows of docs/reliability.md)."""

from __future__ import annotations

import json
import time
from pathlib import Path

from replay import Cli, quant_args, replay

BASE = """\
apiversion: modelslim_v1
{extra}spec:
  process:
    - type: linear_quant
      qconfig:
        weight: {{dtype: int4, scope: per_group, symmetric: true, method: minmax, ext: {{group_size: 32}}}}
{rules}"""


def _write(root: Path, name: str, text: str) -> Path:
    path = root / name
    path.write_text(text, encoding="utf-8")
    return path


def _alias_bomb(levels: int) -> str:
    lines = ["  label:", '    a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    previous = "a"
    for name in "bcdefghijk"[: levels - 1]:
        lines.append(f"    {name}: &{name} [" + ",".join([f"*{previous}"] * 9) + "]")
        previous = name
    return BASE.format(extra="metadata:\n" + "\n".join(lines) + "\n", rules="")


def test_y2_alias_bomb_in_a_free_form_field_is_refused(case: Path, run_cli: Cli) -> None:
    """Nine levels of nine aliases: 387 million strings once expanded (the config hash did)."""
    bomb = _write(case, "bomb.yaml", _alias_bomb(9))
    started = time.monotonic()
    replay(run_cli, case, "validate", bomb).invalid(r"more than 1000000 values once its aliases")
    args = quant_args(case, config="bomb.yaml")
    replay(run_cli, case, *args).refused(r"more than 1000000 values once its aliases")
    assert time.monotonic() - started < 30


def test_y2_a_few_aliases_stay_valid(case: Path, run_cli: Cli) -> None:
    """The cap is on the expanded size, not on aliases: a small shared block is fine."""
    assert replay(run_cli, case, "validate", _write(case, "small.yaml", _alias_bomb(3))).code == 0


def test_y6_y7_deep_nesting_is_an_input_error(case: Path, run_cli: Cli) -> None:
    sequence = _write(case, "deep_seq.yaml", "a: " + "[" * 20000 + "]" * 20000 + "\n")
    mapping = _write(case, "deep_map.yaml", "a: " + "{a: " * 20000 + "1" + "}" * 20000 + "\n")
    for config in (sequence, mapping):
        replay(run_cli, case, "validate", config).invalid(r"more than 64 levels deep")
    moderate = _write(case, "moderate.yaml", "a: " + "[" * 100 + "]" * 100 + "\n")
    replay(run_cli, case, "validate", moderate).invalid(r"more than 64 levels deep")


def test_y22_infinite_percdamp_is_refused_before_loading(case: Path, run_cli: Cli) -> None:
    """It was valid, then failed after the model loaded, advising to raise percdamp."""
    text = BASE.format(extra="", rules="").replace("method: minmax", "method: gptq")
    text = text.replace("ext: {group_size: 32}", "ext: {group_size: 32, percdamp: .inf}")
    config = _write(case, "inf.yaml", text)
    replay(run_cli, case, "validate", config).invalid(r"percdamp: Input should be a finite number")


def test_y27_catastrophic_rule_regex_is_refused_at_once(case: Path, run_cli: Cli) -> None:
    """``(.*)*`` nested five times hung plan and quant for minutes on every module name."""
    rules = "      dynamic:\n        '(.*)*(.*)*(.*)*(.*)*(.*)*X': {bits: 8}\n"
    config = _write(case, "redos.yaml", BASE.format(extra="", rules=rules))
    started = time.monotonic()
    pattern = r"dynamic\[.*\(\.\*\)\*.*exponential time"
    replay(run_cli, case, "validate", config).invalid(pattern)
    plan = ["plan", "--model_path", case / "model", "--config_path", config]
    outcome = replay(run_cli, case, *plan)
    assert (
        outcome.code == 2 and "exponential time" in outcome.err and "Traceback" not in outcome.err
    )
    replay(run_cli, case, *quant_args(case, config="redos.yaml")).refused(pattern)
    many = _write(
        case,
        "many.yaml",
        BASE.format(extra="", rules="      dynamic:\n        '.*.*.*.*.*.*X': {bits: 8}\n"),
    )
    replay(run_cli, case, "validate", many).invalid(r"6 unbounded quantifiers")
    assert time.monotonic() - started < 30


def test_y33_merge_key_overrides_are_standard_yaml(case: Path, run_cli: Cli) -> None:
    """``<<: *base`` then ``dtype: int8``: the mapping's own key wins, as YAML defines; two
    equal keys written out are still refused."""
    text = """\
apiversion: modelslim_v1
spec:
  process:
    - type: linear_quant
      qconfig:
        weight:
          <<: &base {dtype: int4, scope: per_channel, symmetric: true, method: minmax}
          dtype: int8
"""
    config = _write(case, "merge.yaml", text)
    assert replay(run_cli, case, "validate", config).code == 0
    plan = replay(
        run_cli, case, "plan", "--model_path", case / "model", "--config_path", config, "--json"
    )
    assert plan.code == 0, plan.err
    assert {row["bits"] for row in json.loads(plan.out)["rows"]} == {8}
    duplicate = _write(
        case,
        "dup.yaml",
        text.replace("          dtype: int8\n", "          dtype: int8\n          dtype: int4\n"),
    )
    replay(run_cli, case, "validate", duplicate).invalid(
        r"found duplicate key 'dtype' \(first defined on line 8\)"
    )


def test_y3_y5_tags_and_duplicates_stay_refused(case: Path, run_cli: Cli) -> None:
    """Controls that held in the red-team run: a ``!!python`` tag is never constructed."""
    marker = case / "pwned"
    tag = _write(
        case, "tag.yaml", f"apiversion: !!python/object/apply:os.system ['touch {marker}']\n"
    )
    replay(run_cli, case, "validate", tag).invalid(r"could not determine a constructor")
    assert not marker.exists()
