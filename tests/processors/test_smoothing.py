"""The smoothing processors on tiny models: the smoothed float model computes what the original
does, the runner gives the processors after a smoothing processor their own passes over the
smoothed layer (and no forward when they gather nothing), configs are checked, and a smoothing +
W8A8_DYNAMIC run exports the smoothed weights."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import pytest
import torch
from rotation_helpers import save_with_random_norms
from safetensors.torch import load_file
from torch import nn

import msquant
from msquant import ConfigError
from msquant.backends import get_backend
from msquant.check.hooks import check_hook
from msquant.load.calibration import read_calibration_texts, tokenize_samples
from msquant.load.model_folder import load_causal_lm, load_tokenizer
from msquant.model.layers import find_decoder_layers
from msquant.model.subgraphs import default_subgraphs
from msquant.plugin import DecoderLayer, Processor, ProcessorConfig, RunContext, adapter_for
from msquant.plugin.checks import TransformProbe
from msquant.processors.smoothing.config import (
    FlexSmoothQuantConfig,
    IterSmoothConfig,
    SmoothQuantConfig,
)
from msquant.processors.smoothing.processor import (
    FlexSmoothQuantProcessor,
    IterSmoothProcessor,
    SmoothQuantProcessor,
)
from msquant.run.runner import calibration_stages, run_layer_wise

CALIB = Path(__file__).parents[1] / "data" / "calib.txt"
PROCESSORS: dict[str, Callable[[], Processor]] = {
    "iter_smooth": lambda: IterSmoothProcessor(IterSmoothConfig(type="iter_smooth")),
    "flex_smooth_quant": lambda: FlexSmoothQuantProcessor(
        FlexSmoothQuantConfig(type="flex_smooth_quant")
    ),
    "smooth_quant": lambda: SmoothQuantProcessor(SmoothQuantConfig(type="smooth_quant")),
}


class RecorderConfig(ProcessorConfig):
    type: Literal["recorder"] = "recorder"


class Recorder(Processor):
    """Records, in its own calibration pass, q_proj's weight and how often each layer ran."""

    type_name = "recorder"
    config_class = RecorderConfig

    def __init__(self, config: ProcessorConfig, calibrates: bool = True) -> None:
        super().__init__(config)
        self.requires_calibration = calibrates
        self.weights: dict[int, torch.Tensor] = {}
        self.passes: dict[int, int] = {}

    def before_pass(self, ctx: RunContext, layer: DecoderLayer, index: int) -> None:
        self.passes[layer.index] = self.passes.get(layer.index, 0) + 1
        q_proj = layer.module.get_submodule("self_attn.q_proj")
        assert isinstance(q_proj, nn.Linear)
        self.weights[layer.index] = q_proj.weight.detach().clone()


def _samples(model_dir: Path, count: int | None = 4) -> list[torch.Tensor]:
    return tokenize_samples(read_calibration_texts(CALIB)[:count], load_tokenizer(model_dir))


def _run(
    model_dir: Path, processors: list[Processor], tmp_path: Path, samples: int | None = 4
) -> nn.Module:
    """The model after ``processors`` ran over it (on the first ``samples`` calibration texts)."""
    model = load_causal_lm(model_dir)
    ctx = RunContext(model, model_dir, tmp_path, get_backend("cpu"), find_decoder_layers(model))
    run_layer_wise(ctx, processors, _samples(model_dir, samples), progress=False)
    return model


def _logits(model: nn.Module, samples: list[torch.Tensor]) -> list[torch.Tensor]:
    with torch.no_grad():
        return [model(input_ids=s).logits for s in samples]


@pytest.mark.parametrize("arch", ["llama", "qwen3", "qwen2"])
@pytest.mark.parametrize("name", list(PROCESSORS))
def test_smoothed_float_model_computes_the_same_outputs(
    arch: str, name: str, tiny_model_factory: Callable[..., Path], tmp_path: Path
) -> None:
    model_dir = tiny_model_factory(arch, num_layers=3)
    original = load_causal_lm(model_dir)
    samples = _samples(model_dir, 6)
    reference = _logits(original, samples)
    smoothed = _run(model_dir, [PROCESSORS[name]()], tmp_path)
    changed = [
        key
        for key, tensor in smoothed.state_dict().items()
        if key in original.state_dict() and not torch.equal(tensor, original.state_dict()[key])
    ]
    expected = {"input_layernorm", "q_proj", "k_proj", "v_proj", "post_attention_layernorm"}
    expected |= {"gate_proj", "up_proj"}
    if name != "smooth_quant":
        expected |= {"o_proj", "down_proj"}  # ov and up-down
    assert {key.split(".")[-2] for key in changed} == expected
    for ours, theirs in zip(_logits(smoothed, samples), reference, strict=True):
        torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", list(PROCESSORS))
def test_smoothing_a_norm_scaling_by_one_plus_weight_keeps_the_outputs(
    name: str, tiny_model_factory: Callable[..., Path], tmp_path: Path
) -> None:
    """Qwen3-Next's norms compute ``x / rms(x) * (1 + weight)`` (its adapter says so): the
    smoothing scales divide ``1 + weight``; dividing ``weight`` alone changed the logits by up to
    0.87 on this model."""
    model_dir = save_with_random_norms(
        tiny_model_factory("qwen3_next", num_layers=2), tmp_path / "random_norms"
    )
    original = load_causal_lm(model_dir)
    samples = _samples(model_dir, 6)
    reference = _logits(original, samples)
    smoothed = _run(model_dir, [PROCESSORS[name]()], tmp_path)
    norms = [
        key
        for key, tensor in smoothed.state_dict().items()
        if "layernorm" in key
        and key in original.state_dict()
        and not torch.equal(tensor, original.state_dict()[key])
    ]
    assert norms  # some norm-linear subgraph was smoothed
    for ours, theirs in zip(_logits(smoothed, samples), reference, strict=True):
        torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)


def test_later_processors_calibrate_on_the_smoothed_layer(
    tiny_model_factory: Callable[..., Path], tmp_path: Path
) -> None:
    """YAML order decides: a processor listed before the smoothing processor shares its pass and
    sees the layer as loaded; one listed after gets a pass of its own over the smoothed layer."""
    model_dir = tiny_model_factory("llama", num_layers=2)
    original = load_causal_lm(model_dir)
    before, after = Recorder(RecorderConfig()), Recorder(RecorderConfig())
    smoothing = PROCESSORS["iter_smooth"]()
    assert calibration_stages([before, smoothing, after]) == [[before, smoothing], [after]]
    model = _run(model_dir, [before, smoothing, after], tmp_path)
    for index in range(2):
        name = f"model.layers.{index}.self_attn.q_proj.weight"
        assert torch.equal(before.weights[index], original.state_dict()[name])
        assert torch.equal(after.weights[index], model.state_dict()[name])
        assert not torch.equal(after.weights[index], before.weights[index])
        assert before.passes[index] == after.passes[index] == 1


def test_processors_that_gather_nothing_cost_no_forward(
    tiny_model_factory: Callable[..., Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After a smoothing processor, processors that do not calibrate (data-free linear_quant,
    savers) get no pass: each layer runs once over the calibration set. The transform checks
    run the layer on the probe tokens besides: twice for the data-flow proof, once after the
    folds, once to push the probe to the next layer (counted apart)."""
    model_dir = tiny_model_factory("llama", num_layers=2)
    model = load_causal_lm(model_dir)
    calls: list[int] = []
    probe_calls: list[int] = []
    in_probe = [False]
    for layer in find_decoder_layers(model):
        # marked as a check's own hook: probe forwards detach every other (msquant.check.hooks)
        layer.module.register_forward_hook(
            check_hook(lambda *_, i=layer.index: (probe_calls if in_probe[0] else calls).append(i))
        )
    for method in ("run", "capture", "leave"):
        original = getattr(TransformProbe, method)

        def flagged(*args: Any, _original: Any = original, **kwargs: Any) -> Any:
            in_probe[0] = True
            try:
                return _original(*args, **kwargs)
            finally:
                in_probe[0] = False

        monkeypatch.setattr(TransformProbe, method, flagged)
    idle = Recorder(RecorderConfig(), calibrates=False)
    ctx = RunContext(model, model_dir, tmp_path, get_backend("cpu"), find_decoder_layers(model))
    samples = _samples(model_dir)
    run_layer_wise(ctx, [PROCESSORS["iter_smooth"](), idle], samples, progress=False)
    batches = len(msquant.run.capture.batch_samples(samples))  # type: ignore[attr-defined]
    # capture runs layer 0 once more, to learn its return convention
    assert calls == [0] * (batches + 1) + [1] * batches
    assert probe_calls == [0] + [0] * (2 + 1 + 1) + [1] * (2 + 1 + 1)
    assert idle.passes == {}


def test_without_a_rewriting_processor_the_schedule_is_one_group() -> None:
    first, second = Recorder(RecorderConfig()), Recorder(RecorderConfig(), calibrates=False)
    assert calibration_stages([first, second]) == [[first, second]]


def test_default_subgraphs_of_llama_and_moe_layers(
    tiny_model_factory: Callable[..., Path],
) -> None:
    model = load_causal_lm(tiny_model_factory("llama", num_layers=1))
    (layer,) = find_decoder_layers(model)
    found = [
        (s.kind, s.source.split(".")[-1], [t.split(".")[-1] for t in s.targets], s.heads)
        for s in default_subgraphs(model, layer)
    ]
    assert found == [
        ("norm-linear", "input_layernorm", ["q_proj", "k_proj", "v_proj"], None),
        ("norm-linear", "post_attention_layernorm", ["gate_proj", "up_proj"], None),
        ("ov", "v_proj", ["o_proj"], (4, 2)),
        ("up-down", "up_proj", ["down_proj"], None),
    ]


def test_moe_layers_smooth_the_attention_and_each_expert(
    tiny_model_factory: Callable[..., Path],
) -> None:
    """A MoE layer: the attention's subgraphs and one up-down per routed expert (the
    post-attention norm feeds the router too: no norm-linear there)."""
    model_dir = tiny_model_factory("qwen3_moe", num_layers=1)
    model = load_causal_lm(model_dir)
    adapter_for(model).unfuse_experts(model)
    (layer,) = find_decoder_layers(model)
    found = [(s.kind, s.source.split(".", 3)[-1]) for s in default_subgraphs(model, layer)]
    assert found == [("norm-linear", "input_layernorm"), ("ov", "self_attn.v_proj")] + [
        ("up-down", f"mlp.experts.{e}.up_proj") for e in range(8)
    ]


CONFIG = """
apiversion: modelslim_v1
spec:
  process:
    - {smoothing}
    - type: linear_quant
      qconfig:
        act: {{scope: per_token, dtype: int8, symmetric: true, method: minmax}}
        weight: {{scope: per_channel, dtype: int8, symmetric: true, method: minmax}}
  save:
    - type: ascendv1_saver
      part_file_size: 0
"""


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        ("{type: iter_smooth, symmetric: false}", "symmetric: false (msModelSlim's shift"),
        ("{type: iter_smooth, alpha: 1.5}", "must be strictly between 0 and 1"),
        ("{type: flex_smooth_quant, beta: 0}", "must be strictly between 0 and 1"),
        (
            "{type: iter_smooth, enable_subgraph_type: [norm-linear, qk]}",
            "unknown subgraph type 'qk'",
        ),
        ("{type: smooth_quant, enable_subgraph_type: [ov]}", "enable_subgraph_type"),
        ("{type: flex_smooth_quant, gamma: 0.5}", "gamma"),
    ],
)
def test_bad_smoothing_configs_are_refused(entry: str, message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        msquant.load_config_text(CONFIG.format(smoothing=entry), msquant.plugin.default_registry())


def test_a_model_without_subgraphs_is_refused_before_weights_load(
    tiny_model_factory: Callable[..., Path], tmp_path: Path
) -> None:
    config = tmp_path / "c.yaml"
    config.write_text(CONFIG.format(smoothing="{type: iter_smooth, include: ['*.nothing']}"))
    with pytest.raises(msquant.MsquantInputError, match="iter_smooth: no subgraph to smooth"):
        msquant.quantize(tiny_model_factory("llama"), tmp_path / "out", config, progress=False)


@pytest.mark.parametrize("smoothing", ["iter_smooth", "smooth_quant"])
def test_smoothed_w8a8_dynamic_export(
    smoothing: str, tiny_model_factory: Callable[..., Path], tmp_path: Path
) -> None:
    """The export carries the folded norms (smooth_quant: with msModelSlim's zero norm bias)
    and int8 weights quantized from the smoothed weights."""
    model_dir = tiny_model_factory("llama", num_layers=2)
    config = tmp_path / "c.yaml"
    config.write_text(CONFIG.format(smoothing=f"{{type: {smoothing}}}"))
    result = msquant.quantize(model_dir, tmp_path / "out", config, progress=False, calib_path=CALIB)
    assert result.quantized_modules
    tensors = load_file(str(tmp_path / "out" / "quant_model_weights.safetensors"))
    smoothed = _run(model_dir, [PROCESSORS[smoothing]()], tmp_path / "float", samples=None)
    state = smoothed.state_dict()
    norm = "model.layers.1.post_attention_layernorm"
    assert torch.equal(tensors[f"{norm}.weight"], state[f"{norm}.weight"])
    assert (f"{norm}.bias" in tensors) == (smoothing == "smooth_quant")
    if smoothing == "smooth_quant":
        assert not tensors[f"{norm}.bias"].any()
    weight = state["model.layers.1.mlp.up_proj.weight"]
    scale = tensors["model.layers.1.mlp.up_proj.weight_scale"]
    codes = tensors["model.layers.1.mlp.up_proj.weight"]
    expected = torch.round(weight / scale).clamp(-128, 127).to(torch.int8)
    assert (codes.int() - expected.int()).abs().max() <= 1
    assert (codes != expected).float().mean() < 0.01
    torch.testing.assert_close(scale.flatten(), weight.abs().amax(dim=1) / 127)


@pytest.mark.parametrize("smoothing", ["iter_smooth", "smooth_quant", "flex_smooth_quant"])
def test_smoothed_export_verifies_against_the_original_model(
    smoothing: str,
    tiny_model_factory: Callable[..., Path],
    tmp_path: Path,
    run_cli: Callable[..., Any],
) -> None:
    """A smoothed export differs from the float model tensor by tensor by design (folded norms,
    scaled weights): the run records the smoothing in msquant_export.json, and ``msquant verify
    --model_path`` then compares the original's tensor names and both models' logits on a few
    tokens, instead of reporting the folded norms as corrupted."""
    model_dir = tiny_model_factory("llama", num_layers=2)
    config = tmp_path / "c.yaml"
    config.write_text(CONFIG.format(smoothing=f"{{type: {smoothing}}}"))
    out = tmp_path / "out"
    msquant.quantize(model_dir, out, config, progress=False, calib_path=CALIB)
    marker = json.loads((out / "msquant_export.json").read_text(encoding="utf-8"))
    assert marker["weights_transformed_by"] == [smoothing]
    norm = "model.layers.1.post_attention_layernorm.weight"
    original = load_causal_lm(model_dir).state_dict()[norm]
    assert not torch.equal(load_file(str(out / "quant_model_weights.safetensors"))[norm], original)
    against_original = run_cli("verify", out, "--model_path", model_dir)
    assert against_original.code == 0, against_original.out + against_original.err
    assert "forward check (32 tokens" in against_original.out


GPTQ_CONFIG = """
apiversion: modelslim_v1
spec:
  process:
    - {type: flex_smooth_quant, alpha: 0.5, beta: 0.5}
    - type: linear_quant
      qconfig:
        weight: {scope: per_channel, dtype: int8, symmetric: true, method: gptq}
  save:
    - type: ascendv1_saver
      part_file_size: 0
"""


def test_gptq_after_smoothing_quantizes_the_smoothed_weights(
    tiny_model_factory: Callable[..., Path], tmp_path: Path
) -> None:
    """GPTQ's Hessians are gathered in a pass of their own over the smoothed layer: the exported
    codes dequantize close to the smoothed weights, not to the original ones."""
    model_dir = tiny_model_factory("llama", num_layers=2)
    config = tmp_path / "c.yaml"
    config.write_text(GPTQ_CONFIG)
    msquant.quantize(model_dir, tmp_path / "out", config, progress=False, calib_path=CALIB)
    tensors = load_file(str(tmp_path / "out" / "quant_model_weights.safetensors"))
    original = load_causal_lm(model_dir).state_dict()
    name = "model.layers.0.mlp.down_proj"
    dequantized = tensors[f"{name}.weight"].float() * tensors[f"{name}.weight_scale"]
    smoothing = FlexSmoothQuantProcessor(
        FlexSmoothQuantConfig(type="flex_smooth_quant", alpha=0.5, beta=0.5)
    )
    smoothed = _run(model_dir, [smoothing], tmp_path / "float", samples=None).state_dict()
    weight = smoothed[f"{name}.weight"]
    assert (dequantized - weight).norm() < 0.01 * weight.norm()
    assert (dequantized - original[f"{name}.weight"]).norm() > 0.05 * weight.norm()
    norm = "model.layers.0.post_attention_layernorm.weight"
    assert not torch.equal(tensors[norm], original[norm])


def test_smooth_quant_export_evaluates(
    tiny_model_factory: Callable[..., Path], tmp_path: Path
) -> None:
    """msquant eval reads an export whose norms carry smooth_quant's zero bias, and the smoothed
    W8A8_DYNAMIC model's perplexity stays close to the float model's."""
    model_dir = tiny_model_factory("llama", num_layers=2)
    config = tmp_path / "c.yaml"
    config.write_text(CONFIG.format(smoothing="{type: smooth_quant}"))
    msquant.quantize(model_dir, tmp_path / "out", config, progress=False, calib_path=CALIB)
    quantized = msquant.evaluate_perplexity(tmp_path / "out", CALIB, seqlen=64, max_samples=4)
    reference = msquant.evaluate_perplexity(model_dir, CALIB, seqlen=64, max_samples=4)
    assert abs(quantized.ppl / reference.ppl - 1) < 0.05


@pytest.mark.parametrize("limit", [5, 16, 40, 200])
def test_spaced_rows_are_the_evenly_spaced_rows_of_all_batches(limit: int) -> None:
    """The search rows gathered batch by batch are exactly the evenly spaced rows of all the
    recorded rows joined, whatever the batch sizes."""
    from msquant.processors.smoothing.statistics import InputStatistics, evenly_spaced

    linear = nn.Linear(6, 3)
    statistics = InputStatistics(keep_rows=True)
    statistics.hook("linear", linear)
    generator = torch.Generator().manual_seed(0)
    for tokens in (7, 1, 13, 30, 2, 11):  # 64 rows in 6 uneven batches
        linear(torch.randn(1, tokens, 6, generator=generator))
    statistics.unhook()
    every_row = torch.cat(statistics.rows["linear"], dim=0)
    assert every_row.shape == (64, 6)
    spaced = statistics.spaced_rows("linear", limit)
    assert spaced is not None
    assert torch.equal(spaced, every_row[evenly_spaced(64, limit)])
    assert spaced.shape[0] == min(limit, 64)
    assert torch.equal(spaced[0], every_row[0]) and torch.equal(spaced[-1], every_row[-1])
    assert statistics.spaced_rows("other", limit) is None
