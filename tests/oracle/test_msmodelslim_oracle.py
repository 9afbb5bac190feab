"""msModelSlim 26.1.0 as the oracle of the activation schemes (opt-in: ``pytest -m msmodelslim``).

For each scheme of :data:`msmodelslim_run.SCHEMES` on tiny Llama / Qwen2 / Qwen3 models, msModelSlim's
own export (made by ``msmodelslim_run.py`` in ``$MSQUANT_ORACLE_CACHE``, with the environment of
``scripts/msmodelslim_env.sh`` in ``$MSQUANT_MSMODELSLIM_VENV``) is compared with what msquant's
numerics compute from the float model and the same calibration file; on float32 models every
compared tensor is bit-identical:

* the layout: tensor names, dtypes and shapes, the description file's per-tensor types and
  ``model_quant_type`` (the facts in docs/ascend-format.md, "Activation schemes");
* W8A8 static: ``input_scale`` / ``input_offset`` from :class:`msquant.quant.activation.OnlineMinMax`
  run on the calibration set as msModelSlim runs it (weights and activations fake-quantized while
  calibrating), the int8 weight codes, ``deq_scale`` and ``quant_bias``;
* W8A8_DYNAMIC / W4A8_DYNAMIC: the weight codes and scales, the int4 row packing and ``scale_bias``.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from safetensors.torch import load_file
from torch import nn
from transformers import AutoModelForCausalLM, AutoTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parent))

import msmodelslim_run as oracle  # noqa: E402

from msquant.quant.activation import OnlineMinMax  # noqa: E402
from msquant.quant.int_quant import dequantize, minmax_qparams, quantize  # noqa: E402
from msquant.quant.w8a8_params import (  # noqa: E402
    decode_deq_scale,
    deq_scale,
    encode_deq_scale,
    quant_bias,
    scale_bias,
    unpack_int4_rows,
)

pytestmark = pytest.mark.msmodelslim

CACHE = Path(os.environ.get("MSQUANT_ORACLE_CACHE", oracle.DEFAULT_CACHE))
VENV = Path(os.environ.get("MSQUANT_MSMODELSLIM_VENV", oracle.DEFAULT_VENV))
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
#: Row-parallel layers (vLLM's RowParallelLinear): their W4A8 scale_bias has 16 columns.
ROW_PARALLEL = ("o_proj", "down_proj")
#: Per scheme: the suffixes msModelSlim writes for each quantized linear, with their dtypes.
LAYOUT: dict[str, dict[str, torch.dtype]] = {
    "W8A8": {
        "weight": torch.int8,
        "input_scale": torch.float32,
        "input_offset": torch.float32,
        "quant_bias": torch.int32,
        "deq_scale": torch.int64,  # float32 for bf16 models
    },
    "W8A8_DYNAMIC": {
        "weight": torch.int8,
        "weight_scale": torch.float32,
        "weight_offset": torch.float32,
    },
    "W4A8_DYNAMIC": {
        "weight": torch.int8,
        "weight_scale": torch.float32,
        "weight_offset": torch.float32,
        "scale_bias": torch.float32,
    },
}
CASES = [
    (arch, scheme)
    for arch in ("llama", "qwen2", "qwen3")
    for scheme in oracle.SCHEMES
    # smoothing schemes change the float weights first: test_msmodelslim_smoothing.py compares
    # them; schemes with their own spec (prior stages, groups): test_msmodelslim_semantics.py
    if oracle.SCHEMES[scheme].refused is None
    and not oracle.SCHEMES[scheme].smoothing
    and oracle.SCHEMES[scheme].process is None
] + [
    ("llama_bf16", "w8a8_asym"),
    ("llama_bf16", "w8a8_dynamic"),
    # transformers 5 holds Qwen3-MoE's experts as fused 3-D parameters, not nn.Linear: msModelSlim
    # (even through its Qwen3-MoE adapter) leaves them float, under transformers' fused names
    ("qwen3_moe", "w8a8_dynamic"),
    ("qwen3_moe", "w4a8_dynamic"),
]


def _venv() -> Path:
    return oracle.require_venv(VENV)


def _export(arch: str, scheme: str) -> Path:
    return oracle.ensure_export(CACHE, _venv(), arch, scheme)


def _float_model(arch: str) -> tuple[nn.Module, Any]:
    folder = CACHE / "models" / arch
    model = AutoModelForCausalLM.from_pretrained(folder, dtype="auto").eval()
    return model, AutoTokenizer.from_pretrained(folder)


def _linears(model: nn.Module) -> dict[str, nn.Linear]:
    return {
        name: module
        for name, module in model.named_modules()
        if isinstance(module, nn.Linear) and ".layers." in name
    }


def _weight_codes(weight: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    scale, offset = minmax_qparams(weight, bits, True, None)
    return quantize(weight, scale, offset, bits, None), scale


def _calibrate_static(arch: str, symmetric: bool) -> dict[str, OnlineMinMax]:
    """msModelSlim's W8A8 calibration replayed with msquant's numerics: sample by sample, each
    linear widens its running range, then computes with fake-quantized input and weight."""
    model, tokenizer = _float_model(arch)
    observers: dict[str, OnlineMinMax] = {}
    for name, module in _linears(model).items():
        codes, scale = _weight_codes(module.weight.data, 8)
        fake_weight = dequantize(codes, scale, torch.zeros_like(scale), None).to(
            module.weight.dtype
        )
        observer = observers[name] = OnlineMinMax(symmetric)
        module.forward = _fake_forward(observer, fake_weight, module.bias)  # type: ignore[method-assign]
    texts = oracle.calibration_texts()
    with torch.no_grad():
        for text in texts:
            model(**tokenizer(text, return_tensors="pt", padding=True))
    return observers


def _fake_forward(
    observer: OnlineMinMax, weight: torch.Tensor, bias: torch.Tensor | None
) -> Callable[[torch.Tensor], torch.Tensor]:
    def forward(x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(observer.observe(x), weight, bias)

    return forward


@pytest.fixture(scope="module")
def loaded() -> Callable[[str, str], tuple[dict[str, torch.Tensor], dict[str, Any]]]:
    cache: dict[tuple[str, str], tuple[dict[str, torch.Tensor], dict[str, Any]]] = {}

    def load(arch: str, scheme: str) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        if (arch, scheme) not in cache:
            folder = _export(arch, scheme)
            tensors = load_file(str(folder / "quant_model_weights.safetensors"))
            description = json.loads((folder / "quant_model_description.json").read_text())
            cache[arch, scheme] = (tensors, description)
        return cache[arch, scheme]

    return load


def _assert_bf16_close(
    name: str, tensors: dict[str, torch.Tensor], codes: torch.Tensor, in_scale: float | None
) -> None:
    """bf16 models: msModelSlim computes scales in bf16, msquant in float32 (a deliberate
    difference, docs/ascend-format.md): codes differ by at most one step, in about a tenth of places,
    and ``input_scale`` by a few percent (bf16 roundings accumulated over the online calibration;
    1.5 % measured on layer 0's down_proj)."""
    diff = (tensors[f"{name}.weight"].to(torch.int16) - codes.to(torch.int16)).abs()
    assert int(diff.max()) <= 1, name
    assert float((diff == 0).float().mean()) >= 0.85, name  # measured: 89 % on q_proj
    if in_scale is not None:
        assert float(tensors[f"{name}.input_scale"]) == pytest.approx(in_scale, rel=0.03), name


@pytest.mark.parametrize(("arch", "scheme"), CASES)
def test_layout_and_description(
    arch: str, scheme: str, loaded: Callable[..., tuple[dict[str, torch.Tensor], dict[str, Any]]]
) -> None:
    tensors, description = loaded(arch, scheme)
    quant_type = oracle.SCHEMES[scheme].quant_type
    model, _ = _float_model(arch)
    float_state = model.state_dict()
    layout = dict(LAYOUT[quant_type])
    if quant_type == "W8A8" and model.dtype == torch.bfloat16:
        layout["deq_scale"] = torch.float32
    expected: dict[str, tuple[torch.dtype, tuple[int, ...], str]] = {}
    for name, module in _linears(model).items():
        out_features, in_features = module.weight.shape
        shapes = {
            "weight": (
                out_features // 2 if quant_type == "W4A8_DYNAMIC" else out_features,
                in_features,
            ),
            "input_scale": (1,),
            "input_offset": (1,),
            "quant_bias": (out_features,),
            "deq_scale": (out_features,),
            "weight_scale": (out_features, 1),
            "weight_offset": (out_features, 1),
            "scale_bias": (out_features, 16 if name.endswith(ROW_PARALLEL) else 1),
        }
        for suffix, dtype in layout.items():
            expected[f"{name}.{suffix}"] = (dtype, shapes[suffix], quant_type)
        if module.bias is not None:
            expected[f"{name}.bias"] = (module.bias.dtype, (out_features,), "FLOAT")
    for key, value in float_state.items():
        if not any(key.startswith(f"{name}.") for name in _linears(model)):
            expected[key] = (value.dtype, tuple(value.shape), "FLOAT")
    got = {key: (t.dtype, tuple(t.shape), description[key]) for key, t in tensors.items()}
    assert got == expected
    # model_quant_type: W4A8_DYNAMIC is not in msModelSlim's priority list, so it stays FLOAT
    assert description["model_quant_type"] == (
        "FLOAT" if quant_type == "W4A8_DYNAMIC" else quant_type
    )
    extra = {k: v for k, v in description.items() if k not in tensors}
    assert extra == {
        "version": "1.0.0",
        "model_quant_type": description["model_quant_type"],
        "metadata": {},
        "group_size": 0,
        "optional": {},
    }


@pytest.mark.parametrize(
    ("arch", "scheme"), [c for c in CASES if oracle.SCHEMES[c[1]].quant_type == "W8A8"]
)
def test_w8a8_static_numerics(
    arch: str, scheme: str, loaded: Callable[..., tuple[dict[str, torch.Tensor], dict[str, Any]]]
) -> None:
    tensors, _ = loaded(arch, scheme)
    symmetric = oracle.SCHEMES[scheme].qconfig["act"]["symmetric"]
    observers = _calibrate_static(arch, symmetric)
    model, _ = _float_model(arch)
    bf16 = model.dtype == torch.bfloat16
    for name, module in _linears(model).items():
        in_scale, in_offset = observers[name].qparams()
        codes, weight_scale = _weight_codes(module.weight.data, 8)
        if bf16:
            _assert_bf16_close(name, tensors, codes, in_scale)
            continue
        assert float(tensors[f"{name}.input_scale"]) == in_scale, name
        assert float(tensors[f"{name}.input_offset"]) == in_offset, name
        assert torch.equal(tensors[f"{name}.weight"], codes), name
        want = deq_scale(float(tensors[f"{name}.input_scale"]), weight_scale)
        assert torch.equal(decode_deq_scale(tensors[f"{name}.deq_scale"]), want), name
        assert torch.equal(tensors[f"{name}.deq_scale"], encode_deq_scale(want, model.dtype)), name
        bias = quant_bias(codes, float(tensors[f"{name}.input_offset"]))
        assert torch.equal(tensors[f"{name}.quant_bias"], bias), name
        if module.bias is not None:
            assert torch.equal(tensors[f"{name}.bias"], module.bias.data), name


@pytest.mark.parametrize(
    ("arch", "scheme"), [c for c in CASES if oracle.SCHEMES[c[1]].quant_type != "W8A8"]
)
def test_dynamic_scheme_weights(
    arch: str, scheme: str, loaded: Callable[..., tuple[dict[str, torch.Tensor], dict[str, Any]]]
) -> None:
    tensors, _ = loaded(arch, scheme)
    int4 = oracle.SCHEMES[scheme].quant_type == "W4A8_DYNAMIC"
    model, _ = _float_model(arch)
    for name, module in _linears(model).items():
        codes, weight_scale = _weight_codes(module.weight.data, 4 if int4 else 8)
        if model.dtype == torch.bfloat16:
            _assert_bf16_close(name, tensors, codes, None)
            continue
        stored = tensors[f"{name}.weight"]
        assert torch.equal(unpack_int4_rows(stored) if int4 else stored, codes), name
        assert torch.equal(tensors[f"{name}.weight_scale"], weight_scale), name
        assert not tensors[f"{name}.weight_offset"].any(), name
        if int4:
            chunks = 16 if name.endswith(ROW_PARALLEL) else 1
            want = scale_bias(codes, tensors[f"{name}.weight_scale"], chunks)
            assert torch.equal(tensors[f"{name}.scale_bias"], want), name


def test_w4a8_per_group_is_refused_by_msmodelslim(tmp_path: Path) -> None:
    """msModelSlim 26.1.0 has no W4A8_DYNAMIC layer with per-group int4 weights: the run fails when
    deploying (UnsupportedError 301), so per-channel is the only W4A8_DYNAMIC it exports."""
    scheme = oracle.SCHEMES["w4a8_dynamic_g32"]
    assert scheme.refused is not None
    with pytest.raises(RuntimeError) as info:
        oracle.ensure_export(tmp_path, _venv(), "llama", scheme.name)
    message = str(info.value)
    assert scheme.refused in message
    assert "scope=per_group, dtype=int4" in message and "scope=per_channel, dtype=int4" in message


# --- msquant's own export against msModelSlim's ----------------------------------------------

#: The schemes msquant exports, on the dense tiny models (transformers 5 fuses Qwen3-MoE's experts,
#: which msModelSlim then leaves float under fused names while msquant quantizes each expert).
MSQUANT_CASES = [
    (arch, scheme)
    for arch in ("llama", "qwen2", "qwen3", "llama_bf16")
    for scheme in ("w8a8_asym", "w8a8_sym", "w8a8_dynamic", "w4a8_dynamic")
    if arch != "llama_bf16" or scheme in ("w8a8_asym", "w8a8_dynamic")
]


def _msquant_export(arch: str, scheme: str, save: Path) -> tuple[dict[str, torch.Tensor], Any]:
    """msquant run on the oracle's model with the very YAML msModelSlim ran (its ``spec.dataset``
    is the oracle's calibration file), read back."""
    import msquant

    _export(arch, scheme)  # makes the config file, the model and the calibration file too
    config = CACHE / "configs" / f"{scheme}.yaml"
    msquant.quantize(CACHE / "models" / arch, save, config, progress=False)
    tensors = load_file(str(save / "quant_model_weights.safetensors"))
    return tensors, json.loads((save / "quant_model_description.json").read_text())


def _differences(ours: dict[str, torch.Tensor], theirs: dict[str, torch.Tensor]) -> list[str]:
    return [name for name in sorted(theirs) if not torch.equal(ours[name], theirs[name])]


@pytest.mark.parametrize(("arch", "scheme"), MSQUANT_CASES)
def test_msquant_export_equals_msmodelslim(
    arch: str,
    scheme: str,
    tmp_path: Path,
    loaded: Callable[..., tuple[dict[str, torch.Tensor], dict[str, Any]]],
) -> None:
    """Same model, same YAML, same calibration file: on float32 models every tensor of the two
    exports is bit-identical and the description files are equal. On the bf16 model the layout
    and description are equal and the numbers differ as documented (msModelSlim computes scales in
    bf16, msquant in float32)."""
    theirs, their_description = loaded(arch, scheme)
    ours, our_description = _msquant_export(arch, scheme, tmp_path / "out")
    assert our_description == their_description
    assert {k: (t.dtype, t.shape) for k, t in ours.items()} == {
        k: (t.dtype, t.shape) for k, t in theirs.items()
    }
    differing = _differences(ours, theirs)
    model, _ = _float_model(arch)
    if model.dtype != torch.bfloat16:
        assert differing == []
        return
    for name in _linears(model):
        static = f"{name}.input_scale" in theirs
        in_scale = float(ours[f"{name}.input_scale"]) if static else None
        _assert_bf16_close(name, theirs, ours[f"{name}.weight"], in_scale)
    assert all(".layers." in name for name in differing)  # FLOAT tensors are identical


def test_per_group_w4a8_dynamic_is_refused_by_msquant_too(tmp_path: Path) -> None:
    """Per-group int4 weights with per-token activations, which msModelSlim 26.1.0 cannot export
    (``test_w4a8_per_group_is_refused_by_msmodelslim``), are refused by msquant before any work,
    naming the schemes that are implemented."""
    import msquant
    import msquant.plugin

    scheme = oracle.SCHEMES["w4a8_dynamic_g32"]
    dataset = oracle.write_calibration(tmp_path / "calib.jsonl")
    config = tmp_path / "w4a8_dynamic_g32.yaml"  # the YAML msModelSlim refuses in that test
    config.write_text(yaml.safe_dump(oracle.config_for(scheme, dataset)), encoding="utf-8")
    with pytest.raises(msquant.ConfigError) as info:
        msquant.load_config(config, msquant.plugin.default_registry())
    message = str(info.value)
    assert "qconfig.weight" in message and "scope: per_group" in message
    assert "W4A8_DYNAMIC = " in message
