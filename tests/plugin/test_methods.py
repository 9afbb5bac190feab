"""Quantization methods as a registry (``msquant.methods``): the contract, the built-ins found
through entry points, the engine naming none of them, ``qconfig.weight`` typed per method, and a
third-party method (the one docs/developer/add-method.md shows) installed and run end to end."""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
from collections.abc import Callable
from importlib.metadata import EntryPoint
from pathlib import Path

import pytest
import torch
import yaml
from conftest import CliResult

import msquant
import msquant.plugin
import msquant.plugin.numerics
from msquant import RegistryError
from msquant.plugin import BaseScheme, MethodOptions, MethodRegistry, QDType, QScope, QuantMethod
from msquant.processors.methods.gptq import GPTQMethod
from msquant.processors.methods.minmax import MinMaxMethod
from msquant.processors.methods.ssz import SszMethod

REPO = Path(__file__).resolve().parents[2]
BUILTIN_METHODS = ("minmax", "gptq", "hessian_clip", "ssz")


class _NoOptions(MethodOptions):
    """No options."""


class _Rounder(QuantMethod):
    name = "test_rounder"
    options_class = _NoOptions
    dtypes = frozenset({QDType.INT8})
    scopes = frozenset({QScope.PER_CHANNEL})
    summary = "test"
    rule_keys = ("bits",)

    def base_scheme(self) -> BaseScheme:
        return BaseScheme(bits=8, group_size=None, sym=True)

    def quantize_rtn(self, weight, scheme, name):  # type: ignore[no-untyped-def]
        return msquant.plugin.numerics.quantize_weight_minmax(
            weight, scheme.bits, True, None, name=name
        )


# -- the registry ----------------------------------------------------------------------------------


def test_the_built_in_methods_come_from_entry_points() -> None:
    registry = msquant.plugin.default_method_registry()
    assert registry.names() == sorted(BUILTIN_METHODS)
    assert registry.get("gptq") is GPTQMethod and registry.get("minmax") is MinMaxMethod
    assert GPTQMethod.calibrated and not MinMaxMethod.calibrated
    with pytest.raises(KeyError, match=r"unknown method 'awq'; valid: gptq, hessian_clip, minmax"):
        registry.get("awq")


def test_registration_rules() -> None:
    registry = MethodRegistry([_Rounder])
    assert "test_rounder" in registry and _NoOptions.method_name == "test_rounder"
    registry.register(_Rounder)  # the same class again is fine

    class Rival(_Rounder):
        pass

    with pytest.raises(RegistryError, match=r"'test_rounder' is registered twice: by .*_Rounder"):
        registry.register(Rival)

    class NoOptions(QuantMethod):  # type: ignore[misc]
        name = "broken"

    with pytest.raises(RegistryError, match="must define class attribute 'options_class'"):
        registry.register(NoOptions)
    with pytest.raises(RegistryError, match="no quantization method is registered"):
        MethodRegistry().weight_config_type()


def test_an_entry_point_must_name_a_method_class_under_its_own_name(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def fake(*specs: tuple[str, str]) -> None:
        eps = [EntryPoint(name=n, value=v, group="msquant.methods") for n, v in specs]
        monkeypatch.setattr("msquant.registry_base.entry_points", lambda *, group: eps)

    fake(("alias", f"{__name__}:_Rounder"))
    with pytest.raises(
        RegistryError,
        match="names the quantization method 'test_rounder'; the two names must be equal",
    ):
        MethodRegistry().load_entry_points().get("alias")
    fake(("test_rounder", f"{__name__}:_NoOptions"))
    with pytest.raises(RegistryError, match="is not a msquant.plugin.QuantMethod subclass"):
        MethodRegistry().load_entry_points().get("test_rounder")
    fake(("test_rounder", "msquant_no_such_method_pkg:X"))
    with pytest.raises(
        RegistryError, match="quantization method plugin 'test_rounder' .* failed to"
    ):
        MethodRegistry().load_entry_points().get("test_rounder")
    fake(("test_rounder", f"{__name__}:_Rounder"))
    assert MethodRegistry().load_entry_points().names() == ["test_rounder"]


def _string_constants(path: Path) -> list[tuple[int, str]]:
    """String constants of a module's code, docstrings left out."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    return [
        (node.lineno, node.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant)
        and isinstance(node.value, str)
        and id(node) not in docstrings
    ]


#: Where the engine may still spell these words, and why: the GPTQ *format* (a checkpoint's
#: ``quant_method``) and the preset that writes a YAML document naming msModelSlim's method.
NOT_A_METHOD = (
    "msquant/verify/",
    "msquant/config/presets.py",
)


def test_the_method_decides_whether_an_moe_expert_is_solved() -> None:
    """``solves_expert`` (what linear_quant asks for each MoE expert): at least
    ``ext.expert_min_tokens`` x in_features tokens and one; a method may override it."""
    from msquant.processors.linear_quant.config import LinearQuantConfig

    weight = {"dtype": "int4", "scope": "per_group", "method": "gptq"}
    config = LinearQuantConfig.model_validate(
        {"qconfig": {"weight": {**weight, "ext": {"group_size": 32, "expert_min_tokens": 2.0}}}}
    )
    gptq = GPTQMethod(config.qconfig.weight)
    assert [gptq.solves_expert(n, 64) for n in (0, 127, 128)] == [False, False, True]
    zero = LinearQuantConfig.model_validate(
        {"qconfig": {"weight": {**weight, "ext": {"group_size": 32, "expert_min_tokens": 0.0}}}}
    )
    assert [GPTQMethod(zero.qconfig.weight).solves_expert(n, 64) for n in (0, 1)] == [False, True]

    class NeverSolves(GPTQMethod):
        def solves_expert(self, token_count: int, in_features: int) -> bool:
            return False

    assert NeverSolves(config.qconfig.weight).solves_expert(10**6, 64) is False


def test_the_engine_names_no_built_in_method() -> None:
    """No code of ``msquant/`` compares against, or builds, a built-in method's name: every
    method reaches the engine through the registry."""
    found = []
    for path in sorted((REPO / "msquant").rglob("*.py")):
        relative = path.relative_to(REPO).as_posix()
        if relative.startswith(NOT_A_METHOD):
            continue
        found += [
            f"{relative}:{line}: {value!r}"
            for line, value in _string_constants(path)
            if re.search(rf"\b({'|'.join(BUILTIN_METHODS)})\b", value)
            and not value.startswith(("msquant.", "GPTQ"))
        ]
    assert found == []


def test_the_scan_sees_a_method_name(tmp_path: Path) -> None:
    path = tmp_path / "m.py"
    path.write_text('"""Doc naming gptq."""\nif method == "gptq":\n    pass\n', encoding="utf-8")
    assert _string_constants(path) == [(2, "gptq")]


# -- qconfig.weight typed per method ----------------------------------------------------------------


def test_qconfig_weight_is_a_union_discriminated_on_method() -> None:
    from msquant.processors.linear_quant.config import LinearQuantConfig

    schema = LinearQuantConfig.model_json_schema()
    qconfig = schema["properties"]["qconfig"]["$ref"].rsplit("/", 1)[-1]
    weight = schema["$defs"][qconfig]["properties"]["weight"]
    assert weight["discriminator"]["propertyName"] == "method"
    assert sorted(weight["discriminator"]["mapping"]) == sorted(BUILTIN_METHODS)
    ext_keys = {
        name: set(schema["$defs"][cls.options_class.__name__]["properties"])
        for name, cls in (("gptq", GPTQMethod), ("minmax", MinMaxMethod))
    }
    assert {"percdamp", "numerics", "experts_per_pass", "mse_grid"} <= ext_keys["gptq"]
    assert {"group_size", "mse", "full_range"} <= ext_keys["minmax"]


def test_msquant_schema_documents_every_ext_key(run_cli: Callable[..., CliResult]) -> None:
    result = run_cli("schema")
    assert result.code == 0
    defs = json.loads(result.out)["$defs"]
    for cls in (GPTQMethod, MinMaxMethod, SszMethod):
        documented = defs[cls.options_class.__name__]["properties"]
        assert set(documented) == set(cls.options_class.model_fields)
        assert all(field.get("description") for field in documented.values()), cls.name
        assert defs[cls.options_class.__name__]["additionalProperties"] is False


def test_a_dumped_config_keeps_ext_as_written() -> None:
    """The copy of the config a saver writes beside an export holds ``ext`` as the YAML gave it
    (keys and order), not the method's defaults; it validates back to the same options."""
    from msquant.processors.linear_quant.config import LinearQuantConfig

    given = {"group_size": 64, "percdamp": 0.05, "mse": True}
    config = LinearQuantConfig.model_validate(
        {"qconfig": {"weight": {"method": "gptq", "scope": "per_group", "ext": given}}}
    )
    dumped = config.model_dump(mode="json")["qconfig"]["weight"]["ext"]
    assert list(dumped.items()) == list(given.items())
    again = LinearQuantConfig.model_validate(config.model_dump(mode="json"))
    assert again.qconfig.weight.ext == config.qconfig.weight.ext
    assert config.qconfig.weight.ext.block_size == 128  # the default is still there to read


def test_a_rule_key_of_another_method_names_the_methods_taking_it(
    tmp_path: Path, run_cli: Callable[..., CliResult]
) -> None:
    path = tmp_path / "c.yaml"
    entry = {"type": "linear_quant", "qconfig": {"weight": {"method": "minmax"}}}
    entry["dynamic"] = {".*": {"desc_act": True}}
    path.write_text(yaml.safe_dump({"spec": {"process": [entry]}}))
    result = run_cli("validate", path)
    assert result.code == 2
    assert (
        'spec.process[0].dynamic[".*"].desc_act: applies to method gptq only; valid here: bits, '
        "group_size, sym, mse" in result.err
    )


def test_damp_auto_increment_zero_is_refused_when_validated(
    tmp_path: Path, run_cli: Callable[..., CliResult]
) -> None:
    """Before, ``damp_auto_increment: 0`` validated (ge=0) and then failed inside the run when
    the quantizer checked it again (> 0); the options are now validated once, by the schema."""
    path = tmp_path / "c.yaml"
    entry = {"type": "linear_quant", "qconfig": {"weight": {"method": "gptq"}}}
    entry["qconfig"]["weight"]["ext"] = {"damp_auto_increment": 0}  # type: ignore[index]
    path.write_text(yaml.safe_dump({"spec": {"process": [entry]}}))
    result = run_cli("validate", path)
    assert result.code == 2
    assert (
        "spec.process[0].qconfig.weight.ext.damp_auto_increment: Input should be greater than 0"
        in result.err
    )


# -- a third-party method, installed through an entry point ------------------------------------------


def _doc_example() -> str:
    """The method module docs/developer/add-method.md shows."""
    text = (REPO / "docs" / "developer" / "add-method.md").read_text(encoding="utf-8")
    (code,) = [b for b in re.findall(r"```python\n(.*?)```", text, re.S) if "mypkg/absmax" in b]
    return code


def _install(site: Path) -> None:
    """A distribution ``mypkg`` on ``site`` advertising the doc's method in ``msquant.methods``."""
    (site / "mypkg").mkdir(parents=True)
    (site / "mypkg" / "__init__.py").write_text("")
    (site / "mypkg" / "absmax.py").write_text(_doc_example())
    info = site / "mypkg-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: mypkg\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(
        "[msquant.methods]\nabsmax_clip = mypkg.absmax:AbsMaxClip\n"
    )


def _msquant(site: Path, *args: str | Path) -> subprocess.CompletedProcess[str]:
    code = (
        f"import sys; sys.path.insert(0, {str(site)!r}); from msquant.cli import main; "
        "sys.exit(main(sys.argv[1:]))"
    )
    return subprocess.run(
        [sys.executable, "-c", code, *map(str, args)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=REPO,
    )


def test_a_plugin_method_validates_documents_and_runs(tiny_llama: Path, tmp_path: Path) -> None:
    """The doc's method, installed as a separate distribution: typed ``ext`` (an unknown key
    refused with the plugin's name), documented by ``msquant schema``, and a run whose export
    holds codes equal to the float64 reference of the method's numerics."""
    site = tmp_path / "site"
    _install(site)
    weight = {"method": "absmax_clip", "ext": {"clip": 0.5}}
    entry = {"type": "linear_quant", "qconfig": {"weight": weight}, "include": ["*o_proj"]}
    config = tmp_path / "plugin.yaml"
    config.write_text(
        yaml.safe_dump({"spec": {"process": [entry], "save": [{"type": "ascendv1_saver"}]}})
    )
    assert _msquant(site, "validate", config).returncode == 0

    bad = tmp_path / "bad.yaml"
    bad.write_text(config.read_text().replace("clip: 0.5", "clipp: 0.5"))
    refused = _msquant(site, "validate", bad)
    assert refused.returncode == 2
    assert (
        "spec.process[0].qconfig.weight.ext.clipp: unknown absmax_clip option; valid: clip"
        in refused.stderr
    )
    schema = json.loads(_msquant(site, "schema").stdout)
    assert "clip" in schema["$defs"]["AbsMaxExt"]["properties"]

    out = tmp_path / "out"
    run = _msquant(
        site, "quant", "--model_path", tiny_llama, "--save_path", out, "--config_path", config
    )
    assert run.returncode == 0, run.stderr
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    tensors = {}
    for shard in out.glob("quant_model_weight*.safetensors"):
        tensors.update(load_file(shard))
    model = AutoModelForCausalLM.from_pretrained(tiny_llama, torch_dtype=torch.float32)
    name = "model.layers.0.self_attn.o_proj"
    w = model.get_submodule(name).weight.detach().double()
    scale = (w.abs().amax(dim=1, keepdim=True) * 0.5 / 127).clamp(
        min=torch.finfo(torch.float32).eps
    )
    expected = torch.clamp(torch.round(w / scale), -128, 127)
    diff = (tensors[f"{name}.weight"].double() - expected).abs()
    assert diff.max() <= 1 and int((diff > 0).sum()) <= diff.numel() // 1000  # float32 ties
    assert torch.allclose(tensors[f"{name}.weight_scale"].double().flatten(), scale.flatten())
    unselected = name.replace("o_proj", "q_proj")
    assert tensors[f"{unselected}.weight"].is_floating_point()  # not selected: float
    description = json.loads((out / "quant_model_description.json").read_text())
    assert description[f"{name}.weight"] == "W8A16"
    assert description[f"{unselected}.weight"] == "FLOAT"
