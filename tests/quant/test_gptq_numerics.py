"""GPTQ's defaults and the ``ext.numerics`` switch: what a config resolves to, what is refused,
and how act-order is recorded in the compressed-tensors export."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from conftest import CALIB_TXT, CliResult

import msquant
import msquant.plugin
import msquant.plugin.numerics
import msquant.plugin.planning
from msquant.processors.linear_quant.config import LinearQuantConfig
from msquant.processors.linear_quant.processor import LinearQuantProcessor
from msquant.processors.methods.gptq import GPTQ_NUMERICS, GPTQExt


def _config(
    ext: dict[str, Any], dynamic: dict[str, Any] | None = None, **weight: Any
) -> dict[str, Any]:
    entry: dict[str, Any] = {
        "type": "linear_quant",
        "qconfig": {
            "weight": {
                "dtype": "int4",
                "scope": "per_group",
                "symmetric": True,
                "method": "gptq",
                "ext": {"group_size": 32, **ext},
                **weight,
            }  # fmt: skip
        },
    }
    if dynamic is not None:
        entry["dynamic"] = dynamic
    return {
        "apiversion": "modelslim_v1",
        "spec": {"process": [entry], "save": [{"type": "compressed_tensors"}]},
    }


def test_numerics_pick_the_defaults_and_explicit_keys_win() -> None:
    default = GPTQExt()
    assert default.numerics == "msquant"
    assert default.resolved_desc_act() is GPTQ_NUMERICS["msquant"].desc_act is True
    assert default.resolved_calib_inputs() == GPTQ_NUMERICS["msquant"].calib_inputs
    assert default.resolved_true_sequential() == GPTQ_NUMERICS["msquant"].true_sequential
    limit = GPTQ_NUMERICS["msquant"].full_range_max_bits
    assert [default.resolved_full_range(b) for b in (2, 3, 4, 8)] == [
        b <= limit for b in (2, 3, 4, 8)
    ]
    assert not default.resolved_full_range(8)  # int8 keeps msModelSlim's grid
    mse_limit = GPTQ_NUMERICS["msquant"].mse_max_bits
    assert [default.resolved_mse(b) for b in (4, 8)] == [4 <= mse_limit, 8 <= mse_limit]
    assert not GPTQExt(mse=False).resolved_mse(4)

    ms = GPTQExt(numerics="msmodelslim")
    assert (ms.resolved_desc_act(), ms.resolved_calib_inputs(), ms.resolved_true_sequential()) == (
        False, "float", False,
    )  # fmt: skip
    assert not any(ms.resolved_full_range(b) or ms.resolved_mse(b) for b in range(2, 9))
    assert not ms.resolved_static_groups()

    mixed = GPTQExt(
        numerics="msmodelslim", desc_act=True, full_range=True, calib_inputs="quantized"
    )
    assert mixed.resolved_desc_act() and mixed.resolved_full_range(8)
    assert mixed.resolved_calib_inputs() == "quantized"
    assert not GPTQExt(desc_act=False).resolved_desc_act()
    assert not GPTQExt(full_range=False).resolved_full_range(4)


def test_processor_follows_the_resolved_options() -> None:
    """The run's choices: quantized inputs ask the runner for the extra forward; the grid is
    chosen per module width (a rule's int8 keeps msModelSlim's grid under numerics msquant)."""
    config = _config({}, dynamic={r".*down_proj": {"bits": 8}})
    proc = LinearQuantProcessor(LinearQuantConfig.model_validate(config["spec"]["process"][0]))
    assert proc.calibrate_on_quantized is (GPTQ_NUMERICS["msquant"].calib_inputs == "quantized")
    assert proc.base_scheme.desc_act is True
    assert bool(proc.base_scheme.mse) is (GPTQ_NUMERICS["msquant"].mse_max_bits >= 4)
    int4 = msquant.plugin.planning.resolve_module_scheme(
        "model.layers.0.mlp.up_proj", proc.base_scheme, proc.rules
    )
    int8 = msquant.plugin.planning.resolve_module_scheme(
        "model.layers.0.mlp.down_proj", proc.base_scheme, proc.rules
    )
    assert (int4.bits, int8.bits) == (4, 8)
    full_range = GPTQ_NUMERICS["msquant"].full_range_max_bits >= 4
    assert proc.method.solve_options(int4).full_range is full_range
    assert proc.method.solve_options(int8).full_range is False

    ms = _config({"numerics": "msmodelslim"})
    proc = LinearQuantProcessor(LinearQuantConfig.model_validate(ms["spec"]["process"][0]))
    assert not proc.calibrate_on_quantized and proc.base_scheme.desc_act is False
    assert proc.base_scheme.mse == 0.0
    assert proc.method.solve_options(proc.base_scheme.resolved()).full_range is False


@pytest.mark.parametrize(
    ("ext", "origin"),
    [
        (
            {"desc_act": True, "static_groups": False},
            "static_groups: false cannot go with desc_act: true",
        ),
        ({"static_groups": False}, "desc_act, on by default with numerics: msquant"),
    ],
)
def test_act_order_with_explicit_dynamic_groups_is_refused(
    ext: dict[str, Any], origin: str, tmp_path: Path, run_cli: Callable[..., CliResult]
) -> None:
    """msquant's act-order runs with static groups only; an explicit ``static_groups: false``
    with it is an error naming both ways out, not a silent override."""
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(_config(ext)))
    result = run_cli("validate", path)
    assert result.code == 2
    assert "spec.process[0].qconfig.weight.ext:" in result.err
    assert origin in result.err
    assert "drop static_groups, or set desc_act: false" in result.err
    assert "Traceback" not in result.err
    # without act-order, dynamic groups are fine
    fine = tmp_path / "fine.yaml"
    fine.write_text(yaml.safe_dump(_config({"desc_act": False, "static_groups": False})))
    assert run_cli("validate", fine).code == 0


def test_a_rule_asking_for_act_order_with_dynamic_groups_is_refused(
    tmp_path: Path, run_cli: Callable[..., CliResult]
) -> None:
    path = tmp_path / "rule.yaml"
    rule = r".*\.1\..*"
    path.write_text(
        yaml.safe_dump(
            _config({"numerics": "msmodelslim"}, {rule: {"desc_act": True, "static_groups": False}})
        )
    )
    result = run_cli("validate", path)
    assert result.code == 2
    assert f'dynamic["{rule}"].static_groups' in result.err
    assert "static_groups: false cannot go with desc_act: true" in result.err
    # a rule turning static groups off where the entry's act-order applies is refused too
    path.write_text(yaml.safe_dump(_config({}, {rule: {"static_groups": False}})))
    result = run_cli("validate", path)
    assert result.code == 2 and "cannot go with the entry's act-order" in result.err
    # ... and accepted when the rule also turns act-order off
    path.write_text(
        yaml.safe_dump(_config({}, {rule: {"static_groups": False, "desc_act": False}}))
    )
    assert run_cli("validate", path).code == 0


@pytest.mark.parametrize(
    ("ext", "message"),
    [
        (
            {"calib_input": "float"},
            "qconfig.weight.ext.calib_input: unknown gptq option; valid: numerics, ",
        ),
        (
            {"numerics": "msmodelslimx"},
            "qconfig.weight.ext.numerics: Input should be 'msquant' or 'msmodelslim'",
        ),
        (
            {"calib_inputs": "fp32"},
            "qconfig.weight.ext.calib_inputs: Input should be 'quantized' or 'float'",
        ),
        (
            {"true_sequential": "yes please"},
            "qconfig.weight.ext.true_sequential: Input should be a valid boolean",
        ),
    ],
)
def test_new_options_are_validated_and_unknown_keys_still_rejected(
    ext: dict[str, Any], message: str, tmp_path: Path, run_cli: Callable[..., CliResult]
) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(_config(ext)))
    result = run_cli("validate", path)
    assert result.code == 2
    assert message in result.err


def _groups(folder: Path) -> list[dict[str, Any]]:
    config = json.loads((folder / "config.json").read_text())["quantization_config"]
    return list(config["config_groups"].values())


def test_compressed_tensors_records_act_order_as_weight(tiny_llama: Path, tmp_path: Path) -> None:
    """Act-order modules are described with ``actorder: "weight"`` (compressed-tensors 0.20's
    QuantizationArgs accept it: vLLM 0.33 / 0.34 needs no g_idx for it); msModelSlim numerics and
    round-to-nearest write no actorder; the export still verifies and decodes as before."""
    from compressed_tensors.quantization import ActivationOrdering, QuantizationArgs

    runs = {
        "default": _config({}),
        "msmodelslim": _config({"numerics": "msmodelslim"}),
        "minmax": _config({}, method="minmax"),
    }
    runs["minmax"]["spec"]["process"][0]["qconfig"]["weight"]["ext"] = {"group_size": 32}
    found = {}
    for name, config in runs.items():
        save = tmp_path / name
        msquant.quantize(
            tiny_llama, save, config, calib_path=CALIB_TXT, max_calib_tokens=32, progress=False
        )
        groups = _groups(save)
        assert len(groups) == 1 and groups[0]["targets"] == ["Linear"]
        weights = groups[0]["weights"]
        found[name] = weights.get("actorder")
        args = QuantizationArgs.model_validate(weights)  # what compressed-tensors accepts
        assert args.actorder == (ActivationOrdering.WEIGHT if found[name] else None)
        assert msquant.verify_export(save, model_path=tiny_llama).ok
    assert found == {"default": "weight", "msmodelslim": None, "minmax": None}


def test_gptq_export_of_act_order_keeps_desc_act_false(tiny_llama: Path, tmp_path: Path) -> None:
    """The default act-order runs with static groups: the GPTQ checkpoint's group index is
    trivial, so it says ``desc_act: false`` (vLLM 0.33 / 0.34 refuses ``desc_act: true`` with groups)."""
    import torch
    from safetensors.torch import load_file

    config = _config({})
    config["spec"]["save"] = [{"type": "gptq_saver"}]
    save = tmp_path / "gptq"
    msquant.quantize(
        tiny_llama, save, config, calib_path=CALIB_TXT, max_calib_tokens=32, progress=False
    )
    qconfig = json.loads((save / "config.json").read_text())["quantization_config"]
    assert qconfig["desc_act"] is False and qconfig["group_size"] == 32
    tensors = {}
    for shard in save.glob("*.safetensors"):
        tensors.update(load_file(str(shard)))
    g_idx = tensors["model.layers.0.mlp.down_proj.g_idx"]
    assert torch.equal(g_idx, torch.arange(g_idx.numel(), dtype=torch.int32) // 32)


@pytest.mark.parametrize(("group", "bits"), [(16, 4), (None, 4), (32, 8)])
def test_default_numerics_solve_matches_the_float64_reference(group: int | None, bits: int) -> None:
    """What the default numerics give a module (act-order with static groups, ``full_range`` at
    4 bits, msModelSlim's grid at 8) equals the float64 reference GPTQ with those options, and
    ``numerics: msmodelslim`` equals the reference without them."""
    import torch
    from gptq_reference import reference_gptq
    from quant.test_gptq import assert_matches_oracle, hessian_of, make_layer

    weight, x = make_layer(16, 64, rows=256, seed=5)
    hessian = hessian_of(x)
    for numerics in ("msquant", "msmodelslim"):
        ext = GPTQExt(numerics=numerics)  # type: ignore[arg-type]
        desc_act, full_range = ext.resolved_desc_act(), ext.resolved_full_range(bits)
        assert (desc_act, full_range) == (
            (True, bits <= 4) if numerics == "msquant" else (False, False)
        )
        ref = reference_gptq(
            weight, hessian, bits, True, group, 0.01, 32, desc_act=desc_act, full_range=full_range
        )
        exact = msquant.plugin.numerics.gptq_quantize(
            weight, hessian, bits=bits, symmetric=True, group_size=group, block_size=32,
            desc_act=desc_act, full_range=full_range, solve_dtype=torch.float64,
        )  # fmt: skip
        assert_matches_oracle(exact, ref, exact=True)
