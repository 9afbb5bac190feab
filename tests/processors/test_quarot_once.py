"""``quarot`` listed twice is refused at validation (issue 23, item 5): the export ships one
rotation (``optional/quarot.safetensors``), so a model rotated twice would ship a matrix it does
not carry. Wherever the second entry sits (``spec.process``, ``spec.prior``, a ``group``) the
error names both entries' YAML paths, and ``msquant quant`` exits with 2 before loading weights."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import msquant
import msquant.plugin
from msquant import ConfigError

W8A16 = {
    "type": "linear_quant",
    "qconfig": {
        "weight": {"scope": "per_channel", "dtype": "int8", "symmetric": True, "method": "minmax"}
    },
}


def _spec(**spec: Any) -> dict[str, Any]:
    return {"apiversion": "modelslim_v1", "spec": spec}


@pytest.mark.parametrize(
    ("config", "first", "second"),
    [
        (
            _spec(process=[{"type": "quarot"}, W8A16, {"type": "quarot", "block_size": 16}]),
            "spec.process[0]",
            "spec.process[2]",
        ),
        (
            _spec(prior=[{"process": [{"type": "quarot"}]}], process=[{"type": "quarot"}, W8A16]),
            "spec.prior[0].process[0]",
            "spec.process[0]",
        ),
        (
            _spec(
                process=[
                    {"type": "quarot"},
                    {"type": "group", "configs": [{"type": "quarot"}, W8A16]},
                ]
            ),
            "spec.process[0]",
            "spec.process[1].configs[0]",
        ),
        (  # the same with export_extra_info off on one: still two rotations, one matrix
            _spec(
                process=[{"type": "quarot"}, {"type": "quarot", "export_extra_info": False}, W8A16]
            ),
            "spec.process[0]",
            "spec.process[1]",
        ),
    ],
    ids=["process", "prior_and_process", "in_a_group", "one_without_export"],
)
def test_second_quarot_is_refused_naming_both_entries(
    config: dict[str, Any], first: str, second: str
) -> None:
    with pytest.raises(ConfigError) as caught:
        msquant.validate_config(config, msquant.plugin.default_registry())
    issues = {issue.path: issue.message for issue in caught.value.issues}
    assert list(issues) == [second]
    message = issues[second]
    assert message.startswith(f"quarot is listed more than once ({first} and {second}): ")
    assert "optional/quarot.safetensors" in message and "Keep one quarot entry" in message


def test_every_extra_entry_is_reported_also_beside_schema_errors() -> None:
    """A third entry is a second issue; a schema error elsewhere does not hide them."""
    config = _spec(
        process=[
            {"type": "quarot"},
            {"type": "quarot"},
            {"type": "quarot"},
            {"type": "linear_quant"},
        ]
    )
    with pytest.raises(ConfigError) as caught:
        msquant.validate_config(config, msquant.plugin.default_registry())
    issues = {issue.path: issue.message for issue in caught.value.issues}
    assert "spec.process[3].qconfig" in issues
    assert "(spec.process[0] and spec.process[1])" in issues["spec.process[1]"]
    assert "(spec.process[0] and spec.process[2])" in issues["spec.process[2]"]


def test_one_quarot_with_other_processors_validates() -> None:
    config = _spec(process=[{"type": "quarot"}, {"type": "group", "configs": [W8A16]}])
    msquant.validate_config(config, msquant.plugin.default_registry())


def test_quant_exits_2_before_loading_weights(
    tiny_llama: Path, tmp_path: Path, run_cli: Callable[..., Any]
) -> None:
    config = tmp_path / "twice.yaml"
    config.write_text(
        "apiversion: modelslim_v1\nspec:\n  process:\n    - type: quarot\n"
        "    - type: group\n      configs:\n        - type: quarot\n"
        "        - type: linear_quant\n          qconfig:\n            weight: "
        "{scope: per_channel, dtype: int8, symmetric: true, method: minmax}\n",
        encoding="utf-8",
    )
    result = run_cli(
        "quant",
        "--model_path",
        tiny_llama,
        "--save_path",
        tmp_path / "out",
        "--config_path",
        config,
    )
    assert result.code == 2
    assert "spec.process[1].configs[0]: quarot is listed more than once" in result.err
    assert "Traceback" not in result.err
    assert not (tmp_path / "out").exists()
