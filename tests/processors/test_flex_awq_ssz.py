"""The ``flex_awq_ssz`` processor (issue 25): the smoothed float model computes what the original
does (and the run's per-layer check catches a fold that does not), the shipped W4A8 practices'
entry runs end to end, a norm feeding more than three linears is searched on its first two, the
``--model_type`` restriction follows ``flex_smooth_quant``'s, and bad configs get exact messages.
tests/oracle/test_msmodelslim_awq.py compares the exports with msModelSlim's bit for bit."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

import msquant
from msquant import ConfigError, TransformCheckError
from msquant.backends import get_backend
from msquant.load.calibration import read_calibration_texts, tokenize_samples
from msquant.load.model_folder import load_causal_lm, load_tokenizer
from msquant.model.layers import find_decoder_layers
from msquant.plugin import RunContext
from msquant.plugin.model import SmoothingSubgraph
from msquant.processors.smoothing import folding
from msquant.processors.smoothing.awq_processor import FlexAwqSszProcessor
from msquant.processors.smoothing.config import FlexAwqSszConfig
from msquant.processors.smoothing.msmodelslim_adapters import msmodelslim_types
from msquant.run.runner import run_layer_wise

CALIB = Path(__file__).parents[1] / "data" / "calib.txt"
ACT = {"scope": "per_token", "dtype": "int8", "symmetric": True, "method": "minmax"}
W4_SSZ = {"scope": "per_channel", "dtype": "int4", "symmetric": True, "method": "ssz", "ext": {"step": 10}}  # fmt: skip
QCONFIG = {"act": ACT, "weight": W4_SSZ}
YAML_QCONFIG = (
    "{act: {scope: per_token, dtype: int8, symmetric: true, method: minmax}, "
    "weight: {scope: per_channel, dtype: int4, symmetric: true, method: ssz, ext: {step: 10}}}"
)
CONFIG = """
apiversion: modelslim_v1
spec:
  process:
    - {smoothing}
    - type: linear_quant
      qconfig: {qconfig}
  save:
    - type: ascendv1_saver
      part_file_size: 0
"""


def _processor(**fields: Any) -> FlexAwqSszProcessor:
    return FlexAwqSszProcessor(FlexAwqSszConfig(type="flex_awq_ssz", qconfig=QCONFIG, **fields))


def _samples(model_dir: Path, count: int | None = 4) -> list[torch.Tensor]:
    return tokenize_samples(read_calibration_texts(CALIB)[:count], load_tokenizer(model_dir))


def _logits(model: nn.Module, samples: list[torch.Tensor]) -> list[torch.Tensor]:
    with torch.no_grad():
        return [model(input_ids=s).logits for s in samples]


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("alpha", [0.5, None])
def test_smoothed_float_model_computes_the_same_outputs(
    arch: str, alpha: float | None, tiny_model_factory: Callable[..., Path], tmp_path: Path
) -> None:
    model_dir = tiny_model_factory(arch, num_layers=2)
    original = load_causal_lm(model_dir)
    samples = _samples(model_dir, 6)
    reference = _logits(original, samples)
    model = load_causal_lm(model_dir)
    ctx = RunContext(model, model_dir, tmp_path, get_backend("cpu"), find_decoder_layers(model))
    run_layer_wise(ctx, [_processor(alpha=alpha)], _samples(model_dir), progress=False)
    state = original.state_dict()
    changed = {
        key.split(".")[-2]
        for key, tensor in model.state_dict().items()
        if key in state and not torch.equal(tensor, state[key])
    }
    every = {"input_layernorm", "q_proj", "k_proj", "v_proj", "o_proj", "post_attention_layernorm"}
    every |= {"gate_proj", "up_proj", "down_proj"}
    if alpha is not None:
        assert changed == every
    else:  # searched: a subgraph whose best alpha is 0 keeps its weights (scales of 1)
        assert changed and changed <= every
    for ours, theirs in zip(_logits(model, samples), reference, strict=True):
        torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)


def test_the_run_checks_each_fold(
    tiny_model_factory: Callable[..., Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A fold that forgets the producer's side changes the layer's function: the run's check
    after the folds stops it, naming the processor and the subgraph."""
    monkeypatch.setattr(folding, "fold_into_linear_rows", lambda *args: None)
    config = tmp_path / "c.yaml"
    smoothing = f"{{type: flex_awq_ssz, alpha: 0.5, enable_subgraph_type: [up-down], qconfig: {YAML_QCONFIG}}}"
    config.write_text(CONFIG.format(smoothing=smoothing, qconfig=YAML_QCONFIG))
    with pytest.raises(TransformCheckError, match=r"flex_awq_ssz.*up-down mlp\.up_proj"):
        msquant.quantize(
            tiny_model_factory("llama", num_layers=2),
            tmp_path / "out",
            config,
            progress=False,
            calib_path=CALIB,
        )
    assert not (tmp_path / "out").exists()


def test_shipped_w4a8_entry_runs_and_verifies(
    tiny_model_factory: Callable[..., Path], tmp_path: Path, run_cli: Callable[..., Any]
) -> None:
    """msModelSlim's W4A8 practices' entry (up-down only, layer 0 left out) before W4A8_DYNAMIC
    ssz: layer 0's MLP is quantized as without smoothing, the export verifies against the
    original model's logits."""
    model_dir = tiny_model_factory("llama", num_layers=2)
    smoothing = (
        f"{{type: flex_awq_ssz, alpha: 0.5, qconfig: {YAML_QCONFIG}, enable_subgraph_type: "
        "['up-down'], include: ['*'], exclude: ['model.layers.0.*']}"
    )
    config = tmp_path / "c.yaml"
    config.write_text(CONFIG.format(smoothing=smoothing, qconfig=YAML_QCONFIG))
    plain_config = tmp_path / "plain.yaml"
    plain_config.write_text(CONFIG.replace("    - {smoothing}\n", "").format(qconfig=YAML_QCONFIG))
    msquant.quantize(model_dir, tmp_path / "out", config, progress=False, calib_path=CALIB)
    msquant.quantize(model_dir, tmp_path / "plain", plain_config, progress=False, calib_path=CALIB)
    ours = load_file(str(tmp_path / "out" / "quant_model_weights.safetensors"))
    plain = load_file(str(tmp_path / "plain" / "quant_model_weights.safetensors"))
    changed = {name for name in plain if not torch.equal(ours[name], plain[name])}
    # up_proj's rows are divided by the scales, which its per-channel steps absorb (same codes)
    assert {
        "model.layers.1.mlp.down_proj.weight",
        "model.layers.1.mlp.up_proj.weight_scale",
    } <= changed
    assert all(
        n.startswith(("model.layers.1.mlp.up_proj.", "model.layers.1.mlp.down_proj."))
        for n in changed
    )
    verified = run_cli("verify", tmp_path / "out", "--model_path", model_dir)
    assert verified.code == 0, verified.out + verified.err


class _NormFeedingFour(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(8, elementwise_affine=True, bias=False)
        self.a, self.b, self.c, self.d = (nn.Linear(8, n, bias=False) for n in (3, 5, 7, 9))


@pytest.mark.parametrize(("names", "searched_rows"), [("abcd", 3 + 5), ("abc", 3 + 5 + 7)])
def test_a_norm_feeding_more_than_three_linears_is_searched_on_the_first_two(
    names: str, searched_rows: int
) -> None:
    model = _NormFeedingFour()
    seen: list[tuple[int, int]] = []

    def fake_quant(weight: torch.Tensor) -> torch.Tensor:
        seen.append(tuple(weight.shape))  # type: ignore[arg-type]
        return weight

    rule = folding.ScaleRule("awq", None, 0.0, fake_quant=fake_quant)
    subgraph = SmoothingSubgraph("norm-linear", "norm", tuple(names), norm_offset=0.0)
    rows = torch.randn(16, 8)
    folding.smooth_subgraph(model, subgraph, rule, rows.abs().mean(dim=0), rows)
    assert set(seen) == {(searched_rows, 8)}
    assert len(seen) == 21  # one quantization per candidate


def test_model_type_restriction_follows_flex_smooth_quant() -> None:
    """msModelSlim's flex_awq_ssz asks the adapter through FlexSmoothQuantInterface."""
    for name in ("Qwen3-8B", "DeepSeek-V3.2", "GLM-5", "DeepSeek-V4-Pro", "QwQ-32B", "default"):
        assert msmodelslim_types("flex_awq_ssz", name) == msmodelslim_types(
            "flex_smooth_quant", name
        )
    assert "up-down" in msmodelslim_types("flex_awq_ssz", "DeepSeek-V3.2")
    assert msmodelslim_types("flex_awq_ssz", "QwQ-32B") == ("norm-linear",)


ENTRY_CONFIG = """
apiversion: modelslim_v1
spec:
  process:
    - {smoothing}
  save:
    - type: ascendv1_saver
"""


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        (
            "{type: flex_awq_ssz}",
            "spec.process[0]: Value error, flex_awq_ssz needs qconfig: the quantization its "
            "alpha search measures (as msModelSlim requires)",
        ),
        (
            "{type: flex_awq_ssz, qconfig: {weight: {scope: per_channel, dtype: int4, "
            "symmetric: true, method: ssz}}}",
            "spec.process[0].qconfig.act: flex_awq_ssz searches under per_token int8 symmetric "
            "minmax activations (msModelSlim's W8A8 / W4A8 dynamic), got float activations (act "
            "unset); write act: {scope: per_token, dtype: int8, symmetric: true, method: minmax}",
        ),
        (
            "{type: flex_awq_ssz, qconfig: {act: {scope: per_tensor, dtype: int8, symmetric: "
            "false, method: minmax}, weight: {scope: per_channel, dtype: int8, symmetric: true, "
            "method: minmax}}}",
            "spec.process[0].qconfig.act: flex_awq_ssz searches under per_token int8 symmetric "
            "minmax activations (msModelSlim's W8A8 / W4A8 dynamic), got per_tensor int8 "
            "asymmetric minmax;",
        ),
        (
            "{type: flex_awq_ssz, qconfig: {act: %s, weight: {scope: per_channel, dtype: int4, "
            "symmetric: true, method: gptq}}}",
            "spec.process[0].qconfig.weight.method: flex_awq_ssz quantizes its candidates with "
            "method minmax, ssz (data-free, as msModelSlim's search needs), not gptq",
        ),
        (
            "{type: flex_awq_ssz, qconfig: {act: %s, weight: {scope: per_group, dtype: int4, "
            "symmetric: true, method: minmax, ext: {group_size: 32}}}}",
            "spec.process[0].qconfig.weight: flex_awq_ssz searches under symmetric per_channel "
            "int4 / int8 weights (msModelSlim's dynamic fake-quantized layers), got per_group "
            "int4 symmetric; write dtype: int4 or int8, scope: per_channel, symmetric: true",
        ),
        (
            "{type: flex_awq_ssz, qconfig: {act: %s, weight: {scope: per_channel, dtype: int4, "
            "symmetric: true, method: ssz, ext: {steps: 10}}}}",
            "spec.process[0].qconfig.weight.ext.steps: unknown ssz option; valid: step, group_size",
        ),
        (
            "{type: flex_awq_ssz, alpha: 1.5, qconfig: {act: %s, weight: {scope: per_channel, "
            "dtype: int4, symmetric: true, method: ssz}}}",
            "spec.process[0].alpha: Value error, must be strictly between 0 and 1 (msModelSlim's "
            "range), got 1.5",
        ),
        (
            "{type: flex_awq_ssz, gamma: 1, qconfig: {act: %s, weight: {scope: per_channel, "
            "dtype: int4, symmetric: true, method: ssz}}}",
            "spec.process[0].gamma: unknown key; valid keys here: type, include, exclude, "
            "qconfig, alpha, beta, enable_subgraph_type",
        ),
        (
            "{type: flex_awq_ssz, enable_subgraph_type: [qk], qconfig: {act: %s, weight: "
            "{scope: per_channel, dtype: int4, symmetric: true, method: ssz}}}",
            "spec.process[0].enable_subgraph_type[0]: unknown subgraph type 'qk'",
        ),
    ],
)
def test_bad_configs_are_refused(entry: str, message: str) -> None:
    act = "{scope: per_token, dtype: int8, symmetric: true, method: minmax}"
    text = ENTRY_CONFIG.format(smoothing=entry.replace("%s", act))
    with pytest.raises(ConfigError, match=re.escape(message)):
        msquant.load_config_text(text, msquant.plugin.default_registry())


def test_a_beta_is_accepted_and_ignored(caplog: pytest.LogCaptureFixture) -> None:
    text = ENTRY_CONFIG.format(
        smoothing=f"{{type: flex_awq_ssz, beta: 0.3, qconfig: {YAML_QCONFIG}}}"
    )
    msquant.load_config_text(text, msquant.plugin.default_registry())
    assert "flex_awq_ssz: beta 0.3 is ignored" in caplog.text
    assert _processor(alpha=0.4, beta=0.3).rule().alpha_beta(None, torch.ones(2, 2)) == (0.4, 0.0)
