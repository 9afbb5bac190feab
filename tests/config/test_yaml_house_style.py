"""msModelSlim's YAML house style: anchors beside ``spec``, brace globs, warnings for patterns that
match nothing, one-pass error reports (issue 16, section 3)."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

import msquant
import msquant.plugin
import msquant.plugin.planning
from msquant import ConfigError, load_config_text
from msquant.model.matching import MAX_EXPANSIONS, expand_braces, glob_matches
from msquant.plugin import ProcessorRegistry, default_registry
from msquant.plugin.model import (
    first_matching_pattern,
    is_selected,
    pattern_problem,
    unmatched_patterns,
)

# The shape of msModelSlim's best practices: a scheme defined once as an anchor beside spec.
ANCHORED = """\
apiversion: modelslim_v1
default_w8a16: &w8a16
  weight: {scope: per_channel, dtype: int8, symmetric: true, method: minmax}
spec:
  process:
    - type: linear_quant
      qconfig: *w8a16
      exclude: ["model.layers.{0,1}.mlp.down_proj"]
"""


@pytest.fixture(scope="module")
def registry() -> ProcessorRegistry:
    return default_registry()


@pytest.fixture(scope="module")
def weightless_llama(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama's config with a dummy weights file (planning reads no weight)."""
    folder = tmp_path_factory.mktemp("weightless")
    shutil.copy(tiny_llama / "config.json", folder / "config.json")
    save_file({"unrelated": torch.zeros(1)}, str(folder / "model.safetensors"))
    return folder


# --- extra top-level keys ------------------------------------------------------------------------


def test_anchor_beside_spec_is_accepted_and_used(registry: ProcessorRegistry) -> None:
    config = load_config_text(ANCHORED, registry)
    (entry,) = config.spec.process
    assert entry.qconfig.weight.dtype.value == "int8"  # type: ignore[attr-defined]
    assert "default_w8a16" not in config.model_dump()


def test_misspelt_top_level_key_is_warned_about(
    registry: ProcessorRegistry, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="msquant.config.spec"):
        config = load_config_text("apiversion: modelslim_v1\nspce: {}\n", registry, "x.yaml")
    assert config.spec.process == []
    assert any(
        "top-level key 'spce' in x.yaml is ignored" in r.message
        and "did you mean 'spec'" in r.message
        for r in caplog.records
    ), caplog.text


def test_anchor_holder_key_is_not_warned_about(
    registry: ProcessorRegistry, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="msquant.config.spec"):
        load_config_text(ANCHORED, registry)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text


# --- brace globs ---------------------------------------------------------------------------------

BRACES = [
    ("model.layers.{0,1}.mlp.down_proj", "model.layers.1.mlp.down_proj", True),
    ("model.layers.{0,1}.mlp.down_proj", "model.layers.2.mlp.down_proj", False),
    ("model.layers.{0..3}.*", "model.layers.3.self_attn.q_proj", True),
    ("model.layers.{0..3}.*", "model.layers.30.self_attn.q_proj", False),
    ("*.{q,k}_proj", "model.layers.0.self_attn.k_proj", True),
    ("*.{q,k}_proj", "model.layers.0.self_attn.v_proj", False),
    ("*layers.{1{0,1},2}.mlp*", "model.layers.11.mlp.up_proj", True),  # nested
    ("*layers.{1{0,1},2}.mlp*", "model.layers.1.mlp.up_proj", False),
    ("*layers.\\{0,1\\}.mlp*", "model.layers.{0,1}.mlp.up_proj", True),  # escaped: literal
    ("*Q_proj", "model.layers.0.self_attn.q_proj", False),  # case-sensitive, as on Linux
]


@pytest.mark.parametrize(("pattern", "name", "expected"), BRACES)
def test_brace_globs_match_as_msmodelslim(pattern: str, name: str, expected: bool) -> None:
    assert glob_matches(name, pattern) is expected


def test_brace_expansion_lists_the_globs() -> None:
    assert expand_braces("a.{0,1}.b") == ["a.0.b", "a.1.b"]
    assert expand_braces("a.{8..10}") == ["a.8", "a.9", "a.10"]
    assert expand_braces("plain*") == ["plain*"]


def test_brace_globs_in_selection_helpers() -> None:
    name = "model.layers.0.mlp.down_proj"
    assert not is_selected(name, ["*"], ["model.layers.{0,1}.mlp.down_proj"])
    assert is_selected(name, ["*"], ["model.layers.{2,3}.mlp.down_proj"])
    assert first_matching_pattern(name, ["*q_proj", "*.{0,5}.mlp.*"]) == "*.{0,5}.mlp.*"
    assert unmatched_patterns([name], ["*.{0,1}.mlp.*", "*.{7,8}.*"]) == ["*.{7,8}.*"]


def test_huge_brace_expansion_is_refused_with_its_path(registry: ProcessorRegistry) -> None:
    pattern = f"model.layers.{{0..{MAX_EXPANSIONS}}}.*"
    problem = pattern_problem(pattern)
    assert problem is not None and f"more than {MAX_EXPANSIONS} globs" in problem
    text = ANCHORED.replace(
        'exclude: ["model.layers.{0,1}.mlp.down_proj"]', f'exclude: ["*", "{pattern}"]'
    )
    with pytest.raises(ConfigError) as info:
        load_config_text(text, registry)
    assert [str(i) for i in info.value.issues] == [f"spec.process[0].exclude[1]: {problem}"]
    assert not glob_matches("model.layers.0.mlp", pattern)
    with pytest.raises(ValueError, match="globs"):
        expand_braces(pattern)


def _plan(folder: Path, **fields: Any) -> msquant.plugin.planning.ModelPlan:
    weight = {"dtype": "int8", "scope": "per_channel", "symmetric": True, "method": "minmax"}
    entry = {"type": "linear_quant", "qconfig": {"weight": weight}, **fields}
    config = {"apiversion": "modelslim_v1", "spec": {"process": [entry]}}
    return msquant.plugin.planning.build_plan(folder, config)


def test_brace_exclude_keeps_those_layers_float_in_the_plan(weightless_llama: Path) -> None:
    result = _plan(weightless_llama, exclude=["model.layers.{0,1}.mlp.down_proj"])
    quantized = {row.module for row in result.rows if row.bits is not None}
    assert "model.layers.0.mlp.down_proj" not in quantized
    assert "model.layers.1.mlp.down_proj" not in quantized
    assert "model.layers.1.mlp.up_proj" in quantized
    assert len(quantized) == 12  # 2 layers x 7 linears, less the two down_proj
    assert not result.warnings


# --- patterns that match nothing -----------------------------------------------------------------


def test_every_unmatched_include_and_exclude_pattern_is_warned(weightless_llama: Path) -> None:
    result = _plan(
        weightless_llama,
        include=["*", "*qkv_proj"],
        exclude=["model.layers.{5,6}.mlp.down_proj", "*down_proj"],
    )
    assert result.ok
    assert result.warnings == [
        "spec.process[0]: linear_quant include pattern(s) matched no decoder linear layer: "
        "['*qkv_proj'] (globs match the full module name, e.g. *q_proj or model.layers.0.*)",
        "spec.process[0]: linear_quant exclude pattern(s) matched no decoder linear layer: "
        "['model.layers.{5,6}.mlp.down_proj'] (globs match the full module name, e.g. *q_proj or "
        "model.layers.0.*)",
    ]


# --- the whole file's errors in one pass ---------------------------------------------------------

ONE_PASS = """\
apiversion: modelslim_v1
spec:
  process:
    - type: flatquant
      online: true
    - type: linear_quant
      qconfig:
        weight: {scope: per_channel, dtype: int8, symmetric: true, method: minmax}
      exclude: ["{0..99999}"]
    - type: linear_quant
      qconfig:
        weight: {scope: per_channel, dtype: int8, symmetric: maybe, method: minmax}
  save:
    - type: ascendv1_saver
      part_file_size: -1
"""


def test_unknown_processor_does_not_hide_other_errors(registry: ProcessorRegistry) -> None:
    with pytest.raises(ConfigError) as info:
        load_config_text(ONE_PASS, registry, "mixed.yaml")
    paths = [issue.path for issue in info.value.issues]
    assert paths == [
        "spec.process[0].type",  # schema: unknown processor
        "spec.process[2].qconfig.weight.symmetric",  # schema: not a boolean
        "spec.save[0].part_file_size",  # schema: negative
        "spec.process[1].exclude[0]",  # semantic, from linear_quant's check_config
    ], [str(i) for i in info.value.issues]
    assert "unknown processor type 'flatquant'" in info.value.issues[0].message
    assert "(4 errors)" in str(info.value)


def test_prior_entries_are_checked_with_schema_errors(registry: ProcessorRegistry) -> None:
    act = "{dtype: int8, scope: per_token, symmetric: false, method: minmax}"
    weight = "{dtype: int8, scope: per_channel, symmetric: true, method: minmax}"
    prior = f"{{process: [{{type: linear_quant, qconfig: {{act: {act}, weight: {weight}}}}}]}}"
    text = f"spec:\n  prior: [{prior}]\n  process:\n    - type: flatquant\n"
    with pytest.raises(ConfigError) as info:
        load_config_text(text, registry)
    assert [issue.path for issue in info.value.issues] == [
        "spec.process[0].type",
        "spec.prior[0].process[0].qconfig.act",
    ]
