"""YAML spec validation: msModelSlim-compatible files load, and every mistake is located by path."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from msquant import (
    ConfigError,
    ConfigIssue,
    MsquantInputError,
    QuantConfig,
    config_json_schema,
    load_config,
    load_config_text,
    validate_config,
)
from msquant.config.yaml_loader import MAX_CONFIG_BYTES
from msquant.plugin import ActQConfig, ProcessorRegistry, QDType, QScope, default_registry

EXAMPLES = Path(__file__).resolve().parents[2] / "yaml_examples"
EXAMPLE_FILES = sorted(EXAMPLES.glob("*.yaml"))

# The user's two msModelSlim examples, verbatim (comments aside): they must validate unchanged.
USER_PER_CHANNEL_GPTQ = """\
spec:
  process:
    - type: "linear_quant"
      qconfig:
        weight:
          scope: "per_channel"
          dtype: "int8"
          symmetric: true
          method: "gptq"
          ext:
            percdamp: 0.01
            block_size: 128
"""

USER_PER_GROUP_GPTQ = """\
spec:
  process:
    - type: "linear_quant"
      qconfig:
        weight:
          scope: "per_group"
          dtype: "int8"
          symmetric: true
          method: "gptq"
          ext:
            percdamp: 0.01
            block_size: 128
            group_size: 128
"""

W = "spec.process[0].qconfig.weight"


@pytest.fixture(scope="module")
def registry() -> ProcessorRegistry:
    return default_registry()


def linear_quant(weight: str, extra: str = "", qconfig_extra: str = "") -> str:
    """A one-processor config whose ``qconfig.weight`` is the flow mapping ``weight``."""
    return (
        "spec:\n"
        "  process:\n"
        "    - type: linear_quant\n"
        f"      qconfig: {{{qconfig_extra}weight: {weight}}}\n"
        f"{extra}"
    )


def config_error(text: str, registry: ProcessorRegistry, source: str = "cfg.yaml") -> ConfigError:
    with pytest.raises(ConfigError) as info:
        load_config_text(text, registry, source)
    err = info.value
    assert isinstance(err, MsquantInputError)
    assert err.issues, "a ConfigError must carry at least one issue"
    assert all(isinstance(i, ConfigIssue) for i in err.issues)
    return err


def issue_at(err: ConfigError, path: str) -> ConfigIssue:
    found = [i for i in err.issues if i.path == path]
    assert found, f"no issue at {path!r}; issues: {[str(i) for i in err.issues]}"
    return found[0]


# --- the shipped examples and the user's files ---------------------------------------------------


def test_examples_folder_holds_the_user_files() -> None:
    names = {p.name for p in EXAMPLE_FILES}
    assert {"w8a16_per_channel_gptq.yaml", "w8a16_per_group_gptq.yaml"} <= names
    assert len(EXAMPLE_FILES) >= 4


@pytest.mark.parametrize("path", EXAMPLE_FILES, ids=lambda p: p.name)
def test_every_example_validates(path: Path, registry: ProcessorRegistry) -> None:
    config = load_config(path, registry)
    assert isinstance(config, QuantConfig)
    assert config.apiversion == "modelslim_v1"
    assert config.spec.process, "an example should quantize something"
    for entry in [*config.spec.process, *config.spec.save]:
        assert entry.type in registry
    # What was validated is what the file says (nothing silently dropped or renamed).
    raw = yaml.safe_load(path.read_text(encoding="utf-8"))
    assert [e.type for e in config.spec.process] == [e["type"] for e in raw["spec"]["process"]]
    dumped = config.model_dump(mode="json", exclude_unset=True)
    assert dumped["spec"]["process"] == raw["spec"]["process"]


@pytest.mark.parametrize(
    ("filename", "text", "scope", "ext"),
    [
        (
            "w8a16_per_channel_gptq.yaml",
            USER_PER_CHANNEL_GPTQ,
            QScope.PER_CHANNEL,
            {"percdamp": 0.01, "block_size": 128},
        ),
        (
            "w8a16_per_group_gptq.yaml",
            USER_PER_GROUP_GPTQ,
            QScope.PER_GROUP,
            {"percdamp": 0.01, "block_size": 128, "group_size": 128},
        ),
    ],
)
def test_user_gptq_examples_validate_unchanged(
    filename: str, text: str, scope: QScope, ext: dict, registry: ProcessorRegistry
) -> None:
    file = EXAMPLES / filename
    # The shipped file is the user's example (same document), not an edited variant.
    assert yaml.safe_load(file.read_text(encoding="utf-8")) == yaml.safe_load(text)
    for config in (load_config_text(text, registry, filename), load_config(file, registry)):
        (entry,) = config.spec.process
        weight = entry.qconfig.weight
        assert entry.type == "linear_quant"
        assert weight.scope is scope
        assert weight.dtype is QDType.INT8
        assert weight.symmetric is True
        assert weight.method == "gptq"
        assert weight.ext.model_dump(exclude_unset=True) == ext
        assert entry.qconfig.act.dtype is QDType.FLOAT
        assert config.spec.save == []  # the default saver is chosen at run time
        assert config.apiversion == "modelslim_v1"


# --- defaults and required fields ----------------------------------------------------------------


def test_documented_defaults_apply(registry: ProcessorRegistry) -> None:
    config = load_config_text(linear_quant("{method: minmax}"), registry)
    (entry,) = config.spec.process
    weight = entry.qconfig.weight
    assert weight.scope is QScope.PER_CHANNEL
    assert weight.dtype is QDType.INT8
    assert weight.symmetric is True
    assert weight.ext.model_fields_set == set()
    assert entry.qconfig.act == ActQConfig()
    assert entry.qconfig.act.dtype is QDType.FLOAT
    assert entry.include == ["*"]
    assert entry.exclude == []
    assert config.apiversion == "modelslim_v1"
    assert config.spec.runner.value == "auto"
    assert config.spec.save == []
    assert config.spec.dataset is None


def test_explicit_values_override_defaults(registry: ProcessorRegistry) -> None:
    text = linear_quant(
        "{method: minmax, scope: per_group, symmetric: false, ext: {group_size: 32}}"
    )
    weight = load_config_text(text, registry).spec.process[0].qconfig.weight
    assert (weight.scope, weight.symmetric, weight.ext.model_dump(exclude_unset=True)) == (
        QScope.PER_GROUP,
        False,
        {"group_size": 32},
    )


def test_method_is_required(registry: ProcessorRegistry) -> None:
    err = config_error(linear_quant("{dtype: int8, scope: per_channel}"), registry)
    assert "required" in issue_at(err, f"{W}.method").message.lower()


def test_weight_is_required(registry: ProcessorRegistry) -> None:
    text = "spec:\n  process:\n    - type: linear_quant\n      qconfig: {act: {dtype: float}}\n"
    err = config_error(text, registry)
    assert "required" in issue_at(err, "spec.process[0].qconfig.weight").message.lower()


def test_empty_spec_is_valid(registry: ProcessorRegistry) -> None:
    config = load_config_text("spec: {}\n", registry)
    assert config.spec.process == [] and config.spec.save == []


# --- unknown keys at every level -----------------------------------------------------------------

UNKNOWN_KEYS = [
    (
        "metadata",
        "metadata: {config_id: x, bogus: 1}\n" + linear_quant("{method: minmax}"),
        "metadata.bogus",
        ["config_id", "score", "label"],
    ),
    (
        "spec",
        linear_quant("{method: minmax}", extra="  bogus: 1\n"),
        "spec.bogus",
        ["runner", "prior", "process", "save", "dataset"],
    ),
    (
        "process_entry",
        linear_quant("{method: minmax}", extra="      bogus: 1\n"),
        "spec.process[0].bogus",
        ["type", "qconfig", "include", "exclude"],
    ),
    (
        "save_entry",
        linear_quant("{method: minmax}", extra="  save:\n    - {type: ascendv1_saver, bogus: 1}\n"),
        "spec.save[0].bogus",
        ["type", "part_file_size", "ext"],
    ),
    (
        "qconfig",
        linear_quant("{method: minmax}", qconfig_extra="bogus: 1, "),
        "spec.process[0].qconfig.bogus",
        ["act", "weight"],
    ),
    (
        "act",
        linear_quant("{method: minmax}", qconfig_extra="act: {dtype: float, bogus: 1}, "),
        "spec.process[0].qconfig.act.bogus",
        ["dtype", "scope", "symmetric", "method", "ext"],
    ),
    (
        "weight",
        linear_quant("{method: minmax, bogus: 1}"),
        f"{W}.bogus",
        ["dtype", "scope", "symmetric", "method", "ext"],
    ),
    (
        "weight_typo",
        linear_quant("{method: minmax, symetric: false}"),
        f"{W}.symetric",
        ["symmetric"],
    ),
    (
        "ext_minmax",
        linear_quant("{method: minmax, ext: {bogus: 1}}"),
        f"{W}.ext.bogus",
        ["group_size"],
    ),
    (
        "ext_gptq",
        linear_quant("{method: gptq, ext: {percdamp: 0.01, damp: 0.1}}"),
        f"{W}.ext.damp",
        ["percdamp", "block_size", "group_size"],
    ),
]


@pytest.mark.parametrize(
    ("text", "path", "valid"), [c[1:] for c in UNKNOWN_KEYS], ids=[c[0] for c in UNKNOWN_KEYS]
)
def test_unknown_keys_rejected_with_path_and_valid_keys(
    text: str, path: str, valid: list[str], registry: ProcessorRegistry
) -> None:
    err = config_error(text, registry, "my_config.yaml")
    issue = issue_at(err, path)
    assert "unknown" in issue.message
    for key in valid:
        assert key in issue.message, f"valid key {key!r} not listed in {issue.message!r}"
    assert len(err.issues) == 1, [str(i) for i in err.issues]
    report = str(err)
    assert "my_config.yaml" in report and path in report


def test_report_names_the_file(tmp_path: Path, registry: ProcessorRegistry) -> None:
    file = tmp_path / "typo.yaml"
    file.write_text(linear_quant("{method: minmax, bogus: 1}"), encoding="utf-8")
    with pytest.raises(ConfigError) as info:
        load_config(file, registry)
    assert info.value.source == str(file)
    report = str(info.value)
    assert str(file) in report.splitlines()[0]
    assert f"{W}.bogus: unknown key" in report
    assert "1 error" in report


# --- wrong types and out-of-range values ---------------------------------------------------------

SAVER = "  save:\n    - type: ascendv1_saver\n      part_file_size: {}\n"
WRONG_VALUES = [
    (
        "symmetric_maybe",
        linear_quant("{method: minmax, symmetric: maybe}"),
        f"{W}.symmetric",
        "bool",
    ),
    ("symmetric_list", linear_quant("{method: minmax, symmetric: [1]}"), f"{W}.symmetric", "bool"),
    (
        "part_file_size_negative",
        linear_quant("{method: minmax}", extra=SAVER.format(-1)),
        "spec.save[0].part_file_size",
        "greater than or equal to 0",
    ),
    (
        "part_file_size_text",
        linear_quant("{method: minmax}", extra=SAVER.format("big")),
        "spec.save[0].part_file_size",
        "integer",
    ),
    (
        "block_size_zero",
        linear_quant("{method: gptq, ext: {block_size: 0}}"),
        f"{W}.ext.block_size",
        "greater than 0",
    ),
    (
        "block_size_bool",
        linear_quant("{method: gptq, ext: {block_size: true}}"),
        f"{W}.ext.block_size",
        "integer",
    ),
    (
        "block_size_float",
        linear_quant("{method: gptq, ext: {block_size: 64.5}}"),
        f"{W}.ext.block_size",
        "integer",
    ),
    (
        "percdamp_zero",
        linear_quant("{method: gptq, ext: {percdamp: 0}}"),
        f"{W}.ext.percdamp",
        "greater than 0",
    ),
    (
        "percdamp_text",
        linear_quant("{method: gptq, ext: {percdamp: lots}}"),
        f"{W}.ext.percdamp",
        "number",
    ),
    (
        "group_size_zero",
        linear_quant("{method: minmax, scope: per_group, ext: {group_size: 0}}"),
        f"{W}.ext.group_size",
        "greater than 0",
    ),
    (
        "group_size_string",
        linear_quant("{method: minmax, scope: per_group, ext: {group_size: '64'}}"),
        f"{W}.ext.group_size",
        "integer",
    ),
    (
        "include_not_list",
        linear_quant("{method: minmax}", extra="      include: '*'\n"),
        "spec.process[0].include",
        "list",
    ),
    ("process_not_list", "spec:\n  process: {type: linear_quant}\n", "spec.process", "list"),
    ("spec_not_mapping", "spec: 3\n", "spec", "dictionary"),
    ("runner_unknown", "spec: {runner: fast}\n", "spec.runner", "layer_wise"),
    (
        "score_negative",
        "metadata: {score: -1}\nspec: {}\n",
        "metadata.score",
        "greater than or equal",
    ),
    ("dataset_list", "spec: {dataset: [a.jsonl]}\n", "spec.dataset", "string"),
]


@pytest.mark.parametrize(
    ("text", "path", "needle"), [c[1:] for c in WRONG_VALUES], ids=[c[0] for c in WRONG_VALUES]
)
def test_wrong_types_and_values(
    text: str, path: str, needle: str, registry: ProcessorRegistry
) -> None:
    err = config_error(text, registry)
    assert needle in issue_at(err, path).message


# --- processor types -----------------------------------------------------------------------------


def test_unknown_processor_type_lists_registered_types(registry: ProcessorRegistry) -> None:
    err = config_error(
        "spec:\n  process:\n    - type: linear_quantize\n      qconfig: {}\n", registry
    )
    issue = issue_at(err, "spec.process[0].type")
    assert "linear_quantize" in issue.message
    assert "registered" in issue.message and "linear_quant" in issue.message.replace(
        "linear_quantize", ""
    )
    # No follow-on noise from validating the entry against some other processor's schema.
    assert len(err.issues) == 1, [str(i) for i in err.issues]


def test_unknown_save_type_lists_savers(registry: ProcessorRegistry) -> None:
    err = config_error(
        linear_quant("{method: minmax}", extra="  save:\n    - type: gguf\n"), registry
    )
    issue = issue_at(err, "spec.save[0].type")
    assert "gguf" in issue.message and "ascendv1_saver" in issue.message


def test_processor_in_the_wrong_stage_is_rejected(registry: ProcessorRegistry) -> None:
    err = config_error("spec:\n  save:\n    - type: linear_quant\n", registry)
    issue = issue_at(err, "spec.save[0].type")
    assert "linear_quant" in issue.message and "ascendv1_saver" in issue.message


def test_missing_processor_type_is_rejected(registry: ProcessorRegistry) -> None:
    text = "spec:\n  process:\n    - qconfig: {weight: {method: minmax}}\n"
    issue = issue_at(config_error(text, registry), "spec.process[0].type")
    assert "type" in issue.message and "linear_quant" in issue.message


def test_processor_entry_must_be_a_mapping(registry: ProcessorRegistry) -> None:
    err = config_error("spec:\n  process: [linear_quant]\n", registry)
    assert issue_at(err, "spec.process[0]")


# --- enum values and unimplemented combinations --------------------------------------------------


@pytest.mark.parametrize(
    ("weight", "path", "listed"),
    [
        ("{method: minmax, dtype: int3}", f"{W}.dtype", ["int8", "int4", "float"]),
        ("{method: minmax, dtype: INT8x}", f"{W}.dtype", ["int8"]),
        (
            "{method: minmax, scope: per_row}",
            f"{W}.scope",
            ["per_channel", "per_group", "per_tensor"],
        ),
    ],
    ids=["dtype_int3", "dtype_garbage", "scope_per_row"],
)
def test_unknown_enum_values_list_valid_ones(
    weight: str, path: str, listed: list[str], registry: ProcessorRegistry
) -> None:
    issue = issue_at(config_error(linear_quant(weight), registry), path)
    for value in listed:
        assert value in issue.message


@pytest.mark.parametrize(
    ("weight", "path", "echo"),
    [
        ("{method: minmax, scope: per_tensorx}", f"{W}.scope", "got 'per_tensorx'"),
        ("{method: minmax, dtype: int9}", f"{W}.dtype", "got 'int9'"),
        ("{method: minmax, symmetric: maybe}", f"{W}.symmetric", "got 'maybe'"),
        ("{method: minmax, scope: }", f"{W}.scope", "got an empty value (null)"),
        ("{method: gptq, ext: {percdamp: lots}}", f"{W}.ext.percdamp", "got 'lots'"),
    ],
    ids=["enum", "dtype", "bool", "null", "ext"],
)
def test_bad_values_are_echoed(
    weight: str, path: str, echo: str, registry: ProcessorRegistry
) -> None:
    """The message repeats the value that was given, not only what was expected."""
    issue = issue_at(config_error(linear_quant(weight), registry), path)
    assert issue.message.endswith(echo), issue.message


def test_bad_dynamic_override_value_is_echoed(registry: ProcessorRegistry) -> None:
    text = linear_quant("{method: gptq}") + '      dynamic: {"+:.*q_proj": {sym: sometimes}}\n'
    issue = issue_at(config_error(text, registry), 'spec.process[0].dynamic["+:.*q_proj"].sym')
    assert issue.message.endswith("got 'sometimes'"), issue.message


def test_long_values_are_shortened_in_messages(registry: ProcessorRegistry) -> None:
    issue = issue_at(
        config_error(linear_quant("{method: minmax, scope: " + "x" * 500 + "}"), registry),
        f"{W}.scope",
    )
    assert "got 'xxx" in issue.message and issue.message.endswith("...")
    assert len(issue.message) < 300


@pytest.mark.parametrize(
    "weight",
    [
        "{method: minmax, dtype: mxfp4}",
        "{method: minmax, scope: per_tensor}",
        "{method: minmax, scope: per_block}",
        "{method: minmax, dtype: float}",
        "{method: gptq, dtype: fp8_e4m3, scope: per_group}",
        "{method: gptq, scope: per_token}",
    ],
)
def test_unimplemented_weight_combinations(weight: str, registry: ProcessorRegistry) -> None:
    err = config_error(linear_quant(weight), registry)
    message = issue_at(err, W).message
    assert "not implemented" in message
    for combo in (
        "(int8, per_channel)",
        "(int8, per_group)",
        "(int4, per_channel)",
        "(int4, per_group)",
    ):
        assert combo in message


def test_unimplemented_activation_schemes_name_the_implemented_ones(
    registry: ProcessorRegistry,
) -> None:
    text = linear_quant("{method: minmax}", qconfig_extra="act: {dtype: int4, method: minmax}, ")
    message = issue_at(config_error(text, registry), "spec.process[0].qconfig.act").message
    assert "act {dtype: int4, scope: per_tensor, symmetric: true, method: minmax}" in message
    assert "not implemented" in message and "W8A8 = " in message and "W8A8_DYNAMIC = " in message


def test_unknown_method_lists_methods(registry: ProcessorRegistry) -> None:
    message = issue_at(config_error(linear_quant("{method: awq}"), registry), f"{W}.method").message
    assert "awq" in message and "minmax" in message and "gptq" in message


def test_prior_stage_entries_are_validated_as_process_entries(registry: ProcessorRegistry) -> None:
    load_config_text("spec:\n  prior: [{process: [], dataset: boolq.jsonl}]\n", registry)
    err = config_error("spec:\n  prior: [{process: [{type: flatquant}]}]\n", registry)
    assert (
        "unknown processor type 'flatquant'"
        in issue_at(err, "spec.prior[0].process[0].type").message
    )


def test_apiversion_must_be_modelslim_v1(registry: ProcessorRegistry) -> None:
    err = config_error("apiversion: modelslim_v2\n" + linear_quant("{method: minmax}"), registry)
    assert "modelslim_v1" in issue_at(err, "apiversion").message
    assert (
        load_config_text("apiversion: modelslim_v1\nspec: {}\n", registry).apiversion
        == "modelslim_v1"
    )


# --- several problems in one report --------------------------------------------------------------


def test_schema_errors_are_reported_together(registry: ProcessorRegistry) -> None:
    text = (
        "apiversion: modelslim_v1\n"
        "bogus_top: 1\n"
        "spec:\n"
        "  runner: fast\n"
        "  process:\n"
        "    - type: linear_quant\n"
        "      qconfig:\n"
        "        weight: {method: minmax, symmetric: maybe}\n"
        "  save:\n"
        "    - {type: ascendv1_saver, part_file_size: -1}\n"
    )
    err = config_error(text, registry, "multi.yaml")
    assert len(err.issues) >= 3
    for path in ("spec.runner", f"{W}.symmetric", "spec.save[0].part_file_size"):
        issue_at(err, path)
    # Keys beside apiversion/metadata/spec are ignored, as msModelSlim ignores them (YAML anchors).
    assert not [issue for issue in err.issues if "bogus_top" in issue.path]
    assert f"({len(err.issues)} errors)" in str(err)


def test_semantic_errors_are_reported_together(registry: ProcessorRegistry) -> None:
    text = linear_quant("{method: minmax, dtype: mxfp8}", qconfig_extra="act: {dtype: int8}, ")
    err = config_error(text, registry)
    assert len(err.issues) == 2
    issue_at(err, "spec.process[0].qconfig.act")
    issue_at(err, W)


def test_an_unknown_ext_key_is_a_schema_error_with_its_path(registry: ProcessorRegistry) -> None:
    """``ext`` is typed per method: an unknown key is refused by the schema (with every other
    schema error, before the semantic checks), naming the method's valid options."""
    text = linear_quant("{method: minmax, ext: {bogus: 1}, symmetric: maybe}")
    err = config_error(text, registry)
    assert len(err.issues) == 2
    assert issue_at(err, f"{W}.ext.bogus").message == (
        "unknown minmax option; valid: group_size, mse, mse_grid, mse_maxshrink, mse_norm, "
        "full_range, expert_min_tokens, axes"
    )
    issue_at(err, f"{W}.symmetric")
    gptq = config_error(linear_quant("{method: gptq, ext: {percdampp: 0.1}}"), registry)
    assert issue_at(gptq, f"{W}.ext.percdampp").message.startswith(
        "unknown gptq option; valid: numerics, percdamp, block_size, group_size, desc_act"
    )


def test_errors_of_several_entries_name_each_index(registry: ProcessorRegistry) -> None:
    text = (
        "spec:\n  process:\n"
        "    - {type: linear_quant, qconfig: {weight: {method: minmax, bogus: 1}}}\n"
        "    - {type: linear_quant, qconfig: {weight: {method: minmax}}}\n"
        "    - {type: linear_quant, qconfig: {weight: {method: minmax, dtype: int3}}}\n"
    )
    err = config_error(text, registry)
    issue_at(err, "spec.process[0].qconfig.weight.bogus")
    issue_at(err, "spec.process[2].qconfig.weight.dtype")
    assert not any(i.path.startswith("spec.process[1]") for i in err.issues)


# --- YAML parsing --------------------------------------------------------------------------------


def test_duplicate_keys_are_rejected_with_lines(registry: ProcessorRegistry) -> None:
    text = (
        "spec:\n"  # line 1
        "  process:\n"  # line 2
        "    - type: linear_quant\n"  # line 3
        "      qconfig:\n"  # line 4
        "        weight: {method: minmax}\n"  # line 5
        "        weight: {method: gptq}\n"  # line 6
    )
    message = str(config_error(text, registry, "dup.yaml"))
    assert "duplicate key 'weight'" in message
    assert "line 5" in message and "line 6" in message
    assert "dup.yaml" in message


def test_duplicate_top_level_key_is_rejected(registry: ProcessorRegistry) -> None:
    message = str(config_error("spec: {}\nmetadata: {}\nspec: {}\n", registry))
    assert "duplicate key 'spec'" in message and "line 1" in message and "line 3" in message


@pytest.mark.parametrize(
    ("text", "line"),
    [
        ("spec:\n  process: [\n", "line 3"),
        ("spec:\n  process:\n    - type: linear_quant\n   qconfig: {}\n", "line 4"),
        ("spec:\n\tprocess: []\n", "line 2"),
    ],
    ids=["unclosed_flow", "bad_indent", "tab"],
)
def test_invalid_yaml_syntax(text: str, line: str, registry: ProcessorRegistry) -> None:
    err = config_error(text, registry)
    assert len(err.issues) == 1
    assert "not valid YAML" in err.issues[0].message
    assert line in err.issues[0].message


@pytest.mark.parametrize(
    ("text", "kind"),
    [
        ("- a\n- b\n", "list"),
        ("just a string\n", "str"),
        ("42\n", "int"),
        ("", "empty"),
        ("# c\n", "empty"),
    ],
)
def test_document_must_be_a_mapping(text: str, kind: str, registry: ProcessorRegistry) -> None:
    err = config_error(text, registry)
    (issue,) = err.issues
    assert issue.path == ""
    assert "mapping" in issue.message and kind in issue.message
    assert str(issue).startswith("<root>:")


@pytest.mark.parametrize(
    "tag",
    [
        "!!python/object/apply:os.mkdir [{marker}]",
        "!!python/object/new:os.mkdir [{marker}]",
        "!!python/name:os.system",
        "!!python/object:argparse.Namespace {{a: 1}}",
    ],
    ids=["apply", "new", "name", "object"],
)
def test_python_tags_are_refused(tag: str, tmp_path: Path, registry: ProcessorRegistry) -> None:
    marker = tmp_path / "pwned"
    text = "spec:\n  dataset: " + tag.format(marker=json.dumps(str(marker))) + "\n"
    err = config_error(text, registry)
    assert "not valid YAML" in err.issues[0].message
    assert "python/" in err.issues[0].message
    assert not marker.exists(), "the YAML loader executed code"


def test_validate_config_accepts_a_parsed_mapping(registry: ProcessorRegistry) -> None:
    data = yaml.safe_load(USER_PER_GROUP_GPTQ)
    config = validate_config(data, registry, "<mapping>")
    assert config.spec.process[0].qconfig.weight.ext.group_size == 128
    data["spec"]["process"][0]["qconfig"]["weight"]["bogus"] = 1
    with pytest.raises(ConfigError) as info:
        validate_config(data, registry, "<mapping>")
    assert issue_at(info.value, f"{W}.bogus")
    assert "<mapping>" in str(info.value)


# --- config files --------------------------------------------------------------------------------


def test_missing_config_file(tmp_path: Path, registry: ProcessorRegistry) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml", registry)


def test_config_path_is_a_directory(tmp_path: Path, registry: ProcessorRegistry) -> None:
    with pytest.raises(ConfigError, match="is a directory"):
        load_config(tmp_path, registry)


def test_config_file_not_utf8(tmp_path: Path, registry: ProcessorRegistry) -> None:
    file = tmp_path / "latin1.yaml"
    file.write_bytes("spec: {}\n# caf\xe9\n".encode("latin-1"))
    with pytest.raises(ConfigError, match="cannot read config file"):
        load_config(file, registry)


def test_oversized_config_file(tmp_path: Path, registry: ProcessorRegistry) -> None:
    file = tmp_path / "huge.yaml"
    file.write_text("spec: {}\n" + "#" * MAX_CONFIG_BYTES + "\n", encoding="utf-8")
    with pytest.raises(ConfigError, match="larger than"):
        load_config(file, registry)


# --- CLI: validate and schema --------------------------------------------------------------------


@pytest.mark.parametrize("path", EXAMPLE_FILES, ids=lambda p: p.name)
def test_cli_validate_examples(path: Path, run_cli: Callable[..., Any]) -> None:
    result = run_cli("validate", path)
    assert result.code == 0, result.err
    assert f"{path}: valid" in result.err


def test_cli_validate_all_examples_at_once(run_cli: Callable[..., Any]) -> None:
    result = run_cli("validate", *EXAMPLE_FILES)
    assert result.code == 0, result.err
    assert result.err.count(": valid") == len(EXAMPLE_FILES)


def test_cli_validate_bad_file(tmp_path: Path, run_cli: Callable[..., Any]) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(linear_quant("{method: minmax, symmetric: maybe, bogus: 1}"), encoding="utf-8")
    good = EXAMPLES / "w8a16_per_channel_minmax.yaml"
    result = run_cli("validate", good, bad)
    assert result.code == 2
    assert f"{good}: valid" in result.err
    assert str(bad) in result.err
    assert f"{W}.symmetric" in result.err and f"{W}.bogus: unknown key" in result.err
    assert "Traceback" not in result.err
    assert result.out == ""


def test_cli_validate_missing_file(tmp_path: Path, run_cli: Callable[..., Any]) -> None:
    result = run_cli("validate", tmp_path / "missing.yaml")
    assert result.code == 2
    assert "does not exist" in result.err and "Traceback" not in result.err


def test_cli_validate_needs_a_file(run_cli: Callable[..., Any]) -> None:
    with pytest.raises(SystemExit) as info:
        run_cli("validate")
    assert info.value.code == 2


def test_cli_schema_is_json_with_processors(run_cli: Callable[..., Any]) -> None:
    result = run_cli("schema")
    assert result.code == 0, result.err
    schema = json.loads(result.out)
    assert {"apiversion", "metadata", "spec"} <= set(schema["properties"])
    # Top-level keys beside these are allowed (msModelSlim's configs hold YAML anchors there).
    assert "additionalProperties" not in schema
    assert schema["$defs"]["Spec"].get("additionalProperties") is False
    assert "linear_quant" in result.out and "ascendv1_saver" in result.out
    assert schema == config_json_schema(default_registry())


def test_schema_entries_are_discriminated_by_type() -> None:
    schema = config_json_schema(default_registry())
    spec = schema["$defs"]["Spec"]["properties"]
    assert "linear_quant" in json.dumps(spec["process"])
    assert "ascendv1_saver" not in json.dumps(spec["process"])
    assert "ascendv1_saver" in json.dumps(spec["save"])
