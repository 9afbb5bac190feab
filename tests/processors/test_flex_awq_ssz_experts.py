"""``flex_awq_ssz`` on routed MoE experts (issue 25: msModelSlim's DeepSeek-V3.2 and GLM-5 / 5.1
W4A8 practices): one up-down subgraph per expert (``experts.{e}.up_proj -> down_proj``) and the
shared experts' pair, statistics on the tokens routed to the expert, the fold keeping the float
model's function, the search picking what a direct float64 evaluation of its objective picks,
and a layout msquant does not know refused."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import msquant
from msquant.load.calibration import read_calibration_texts, tokenize_samples
from msquant.load.model_folder import load_causal_lm, load_tokenizer
from msquant.model.layers import find_decoder_layers
from msquant.plugin import RunContext, adapter_for
from msquant.plugin.devices import get_backend
from msquant.processors.smoothing.awq_processor import FlexAwqSszProcessor
from msquant.processors.smoothing.awq_search import ALPHA_GRID
from msquant.processors.smoothing.config import FlexAwqSszConfig
from msquant.run.runner import run_layer_wise

CALIB = Path(__file__).parents[1] / "data" / "calib.txt"
ACT = {"scope": "per_token", "dtype": "int8", "symmetric": True, "method": "minmax"}
W4_SSZ = {"scope": "per_channel", "dtype": "int4", "symmetric": True, "method": "ssz", "ext": {"step": 10}}  # fmt: skip
W8_MINMAX = {"scope": "per_channel", "dtype": "int8", "symmetric": True, "method": "minmax"}
#: the practices' entry: up-down, the dense layer and the shared experts left out
PRACTICE = {"enable_subgraph_type": ["up-down"], "exclude": ["model.layers.0.*", "*mlp.shared_experts.*"]}  # fmt: skip
MOE = ["deepseek_v3", "glm4_moe"]
EPS32 = torch.finfo(torch.float32).eps


def _processor(weight: dict[str, Any] = W4_SSZ, **fields: Any) -> FlexAwqSszProcessor:
    config = FlexAwqSszConfig(type="flex_awq_ssz", qconfig={"act": ACT, "weight": weight}, **fields)
    return FlexAwqSszProcessor(config)


def _samples(model_dir: Path, count: int = 4) -> list[torch.Tensor]:
    return tokenize_samples(read_calibration_texts(CALIB)[:count], load_tokenizer(model_dir))


def _logits(model: nn.Module, samples: list[torch.Tensor]) -> list[torch.Tensor]:
    with torch.no_grad():
        return [model(input_ids=s).logits for s in samples]


def _load(model_dir: Path) -> nn.Module:
    """The model with its experts split per expert (as a run splits them)."""
    model = load_causal_lm(model_dir)
    adapter_for(model).unfuse_experts(model)
    return model


def _smooth(model_dir: Path, tmp_path: Path, processor: FlexAwqSszProcessor) -> nn.Module:
    model = _load(model_dir)
    ctx = RunContext(model, model_dir, tmp_path, get_backend("cpu"), find_decoder_layers(model))
    run_layer_wise(ctx, [processor], _samples(model_dir), progress=False)
    return model


def _moe_model(factory: Callable[..., Path], arch: str, **kwargs: Any) -> Path:
    return factory(arch, num_layers=3, dtype=torch.float64, **kwargs)


@pytest.mark.parametrize("arch", [*MOE, "qwen3_moe"])
def test_moe_layers_name_each_experts_up_down(
    arch: str, tiny_model_factory: Callable[..., Path]
) -> None:
    """A MoE layer's up-down subgraphs: the shared experts' pair (DeepSeek, GLM), then one per
    routed expert, exact by construction (msquant's own per-expert MLP)."""
    model = _load(tiny_model_factory(arch, num_layers=2))
    layer = find_decoder_layers(model)[1]
    pairs = [
        (
            s.source.removeprefix("model.layers.1."),
            s.targets,
            s.exact_by and "ExpertMLP" in s.exact_by,
        )
        for s in adapter_for(model).smoothing_subgraphs(model, layer)
        if s.kind == "up-down"
    ]
    routed = [
        (
            f"mlp.experts.{e}.up_proj",
            (f"model.layers.1.mlp.experts.{e}.down_proj",),
            True,
        )
        for e in range(8)
    ]
    shared = (
        []
        if arch == "qwen3_moe"
        else [
            ("mlp.shared_experts.up_proj", ("model.layers.1.mlp.shared_experts.down_proj",), None)
        ]
    )
    assert pairs == shared + routed


@pytest.mark.parametrize("arch", MOE)
@pytest.mark.parametrize("alpha", [0.5, None])
def test_smoothed_float_moe_model_computes_the_same_outputs(
    arch: str, alpha: float | None, tiny_model_factory: Callable[..., Path], tmp_path: Path
) -> None:
    """The practices' entry smooths exactly the routed experts' up_proj / down_proj of the MoE
    layers and the float64 model computes the same logits."""
    model_dir = _moe_model(tiny_model_factory, arch)
    original = load_causal_lm(model_dir, experts_implementation="eager")
    samples = _samples(model_dir, 6)
    reference = _logits(original, samples)
    model = _smooth(model_dir, tmp_path, _processor(alpha=alpha, **PRACTICE))
    theirs = _load(model_dir)  # split as well, unsmoothed
    after, before = model.state_dict(), theirs.state_dict()
    moved = {k for k in after if not torch.equal(after[k], before[k])}
    roles = {re.sub(r"experts\.\d+\.", "experts.E.", k.removeprefix("model.")) for k in moved}
    allowed = {f"layers.{i}.mlp.experts.E.{p}_proj.weight" for i in (1, 2) for p in ("up", "down")}
    assert roles <= allowed
    if alpha is not None:  # every expert that saw a token: both layers
        assert {r.split(".")[1] for r in roles} == {"1", "2"}
    assert all(torch.equal(after[k], before[k]) for k in after if ".mlp.experts." not in k)
    for ours, expected in zip(_logits(model, samples), reference, strict=True):
        torch.testing.assert_close(ours, expected, rtol=1e-10, atol=1e-10)


def _routed_down_inputs(model_dir: Path, layer: int, expert: int) -> torch.Tensor:
    """float64 reference: the input rows of expert ``expert``'s down_proj in layer ``layer``,
    computed from transformers' own (fused) model: the tokens its router sends to the expert,
    in token order, through the fused weights' slices."""
    from transformers import AutoModelForCausalLM

    fused = AutoModelForCausalLM.from_pretrained(
        str(model_dir), dtype=torch.float64, experts_implementation="eager"
    ).eval()
    moe = fused.model.layers[layer].mlp
    rows: list[torch.Tensor] = []

    def record(module: nn.Module, args: tuple[Any, ...], _output: Any) -> None:
        hidden, top_k_index = args[0], args[1]
        tokens = (top_k_index == expert).any(dim=-1)
        x = hidden[tokens]
        inter = moe.experts.down_proj.shape[2]
        gate_up = moe.experts.gate_up_proj[expert]
        rows.append(moe.experts.act_fn(x @ gate_up[:inter].T) * (x @ gate_up[inter:].T))

    handle = moe.experts.register_forward_hook(record)
    with torch.no_grad():
        for sample in _samples(model_dir):
            fused(input_ids=sample)
    handle.remove()
    return torch.cat(rows).detach()


def _direct_alpha(act: torch.Tensor, weight: torch.Tensor) -> float:
    """float64: the grid's alpha with the smallest relative RMS error of the product smoothed
    by ``max|act|^alpha`` and quantized (int8 per-channel weights, int8 per-input-channel
    activations), a tie going to the later alpha: the objective evaluated directly."""
    best, best_error = ALPHA_GRID[0], float("inf")
    reference = act @ weight.T
    for alpha in ALPHA_GRID:
        scale = act.abs().amax(dim=0, keepdim=True) ** alpha
        w = weight * scale
        w_step = (w.abs().amax(dim=1, keepdim=True) / 127).clamp(min=EPS32)
        w_q = torch.round(w / w_step).clamp(-128, 127) * w_step
        x = act / scale
        x_step = (x.abs().amax(dim=0) / 127).clamp(min=EPS32)
        x_q = torch.round(x / x_step).clamp(-128, 127) * x_step
        error = float(((x_q @ w_q.T - reference) ** 2).mean().sqrt() / (reference**2).mean().sqrt())
        if error <= best_error:
            best, best_error = alpha, error
    return best


@pytest.mark.parametrize("arch", MOE)
def test_each_expert_is_searched_and_scaled_on_its_routed_tokens(
    arch: str, tiny_model_factory: Callable[..., Path], tmp_path: Path
) -> None:
    """Per routed expert of the last MoE layer: the folded scales are ``mean|x|^alpha`` over the
    tokens routed to it (from transformers' fused model), with the ``alpha`` a direct float64
    evaluation of the search objective picks on those tokens."""
    model_dir = _moe_model(tiny_model_factory, arch)
    model = _smooth(model_dir, tmp_path, _processor(W8_MINMAX, **PRACTICE))
    plain = _load(model_dir)
    checked = 0
    for expert in range(8):
        act = _routed_down_inputs(model_dir, 2, expert)
        if act.shape[0] == 0:
            continue
        name = f"model.layers.2.mlp.experts.{expert}.down_proj"
        before = plain.get_submodule(name).weight.detach()
        after = model.get_submodule(name).weight.detach()
        alpha = _direct_alpha(act, before)
        expected = (act.abs().mean(dim=0) ** alpha).clamp(min=1e-5)
        # 1e-6: the run's layer input differs from transformers' own forward by float64
        # rounding; the neighbouring alpha moves the scales by percents
        torch.testing.assert_close(after, before * expected, rtol=1e-6, atol=0)
        up = f"model.layers.2.mlp.experts.{expert}.up_proj"
        torch.testing.assert_close(
            model.get_submodule(up).weight.detach(),
            plain.get_submodule(up).weight.detach() / expected[:, None],
            rtol=1e-6,
            atol=0,
        )
        checked += 1
    assert checked >= 4


def test_an_expert_without_tokens_is_left_unsmoothed(
    tiny_model_factory: Callable[..., Path], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """msModelSlim skips an expert that saw no calibration token; so does msquant (warning)."""
    model_dir = _moe_model(tiny_model_factory, "deepseek_v3")
    model = _load(model_dir)
    layer = find_decoder_layers(model)[2]
    router = layer.module.get_submodule("mlp.gate")
    with torch.no_grad():  # sigmoid scores are below 1: the router never picks expert 7
        router.e_score_correction_bias[7] = -10.0
    ctx = RunContext(model, model_dir, tmp_path, get_backend("cpu"), find_decoder_layers(model))
    before = model.get_submodule("model.layers.2.mlp.experts.7.down_proj").weight.detach().clone()
    run_layer_wise(ctx, [_processor(alpha=0.5, **PRACTICE)], _samples(model_dir), progress=False)
    after = model.get_submodule("model.layers.2.mlp.experts.7.down_proj").weight
    assert torch.equal(after, before)
    assert "model.layers.2.mlp.experts.7.down_proj saw no calibration token" in caplog.text


class _OtherExperts(nn.Module):
    """Experts in a layout msquant does not know (one packed weight)."""

    def __init__(self) -> None:
        super().__init__()
        self.packed = nn.Parameter(torch.zeros(4, 4))


def test_experts_in_an_unknown_layout_are_refused(
    tiny_model_factory: Callable[..., Path],
) -> None:
    model = _load(tiny_model_factory("deepseek_v3", num_layers=2))
    model.model.layers[1].mlp.experts = _OtherExperts()
    layers = find_decoder_layers(model)
    problems = _processor(enable_subgraph_type=["up-down"]).check_model(model, layers)
    assert len(problems) == 1
    assert "model.layers.1.mlp.experts (type _OtherExperts)" in problems[0]
    assert "cannot prove a fold into this layout keeps the function" in problems[0]
    # left out by the globs: nothing to refuse
    assert (
        _processor(enable_subgraph_type=["up-down"], exclude=["*mlp.experts.*"]).check_model(
            model, layers
        )
        == []
    )


SHIPPED = """
apiversion: modelslim_v1
spec:
  process:
    - type: flex_awq_ssz
      qconfig: {act: {scope: per_token, dtype: int8, symmetric: true, method: minmax},
                weight: {scope: per_channel, dtype: int4, symmetric: true, method: ssz, ext: {step: 10}}}
      enable_subgraph_type: ['up-down']
      include: ['*']
      exclude: ['model.layers.0.*', '*mlp.shared_experts.*']
    - type: group
      configs:
        - type: linear_quant
          qconfig: {act: {scope: per_token, dtype: int8, symmetric: true, method: minmax},
                    weight: {scope: per_channel, dtype: int8, symmetric: true, method: minmax}}
          include: ['*']
          exclude: ['*mlp.experts.*']
        - type: linear_quant
          qconfig: {act: {scope: per_token, dtype: int8, symmetric: true, method: minmax},
                    weight: {scope: per_channel, dtype: int4, symmetric: true, method: ssz}}
          include: ['*mlp.experts.*']
  save:
    - type: ascendv1_saver
      part_file_size: 0
"""


@pytest.mark.parametrize("model_type", [None, "DeepSeek-V3.2"])
def test_practice_entry_exports_and_verifies(
    model_type: str | None,
    tiny_model_factory: Callable[..., Path],
    tmp_path: Path,
    run_cli: Callable[..., Any],
) -> None:
    """The practices' entry runs (also under their --model_type) and the export verifies
    against the original model."""
    model_dir = tiny_model_factory("deepseek_v3", num_layers=2)
    config = tmp_path / "c.yaml"
    config.write_text(SHIPPED)
    msquant.quantize(
        model_dir, tmp_path / "out", config, progress=False, calib_path=CALIB, model_type=model_type
    )
    result = run_cli("verify", str(tmp_path / "out"), "--model_path", str(model_dir))
    assert result.code == 0, result.output
