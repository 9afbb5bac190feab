"""Every function-preserving transform proves itself during the run (issue 23): smoothing and
quarot keep Gemma 2/3's function with their adapter and refuse what they cannot prove (a model
wired otherwise than its names say, a sandwich norm with learned gains, a weight shared between
layers, an embedding transformed before the first layer), with exit code 2 and a message naming
the layer and the pair; the run report records what each layer proved and what it cost."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from rotation_helpers import TOKENS, save_with_random_norms
from torch import nn

import msquant
from msquant import TransformCheckError
from msquant.load.calibration import read_calibration_texts, tokenize_samples
from msquant.load.model_folder import load_causal_lm, load_tokenizer
from msquant.plugin import Processor, RunContext, adapter_for
from msquant.plugin.devices import get_backend
from msquant.processors.quarot.config import QuaRotConfig
from msquant.processors.quarot.processor import QuaRot
from msquant.processors.smoothing import processor as smoothing_processor
from msquant.processors.smoothing.config import IterSmoothConfig, SmoothQuantConfig
from msquant.processors.smoothing.processor import IterSmoothProcessor, SmoothQuantProcessor
from msquant.run.runner import run_layer_wise

CALIB = Path(__file__).parents[1] / "data" / "calib.txt"
CONFIG = """
apiversion: modelslim_v1
spec:
  process:
    - {transform}
    - type: linear_quant
      qconfig:
        act: {{scope: per_token, dtype: int8, symmetric: true, method: minmax}}
        weight: {{scope: per_channel, dtype: int8, symmetric: true, method: minmax}}
  save:
    - type: ascendv1_saver
      part_file_size: 0
"""


@pytest.fixture(scope="module")
def random_norms(
    tiny_model_factory: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory
) -> Callable[[str], Path]:
    cache: dict[str, Path] = {}

    def build(arch: str) -> Path:
        if arch not in cache:
            source = tiny_model_factory(arch, num_layers=2)
            cache[arch] = save_with_random_norms(source, tmp_path_factory.mktemp(arch))
        return cache[arch]

    return build


def _samples(model_dir: Path) -> list[torch.Tensor]:
    return tokenize_samples(read_calibration_texts(CALIB)[:4], load_tokenizer(model_dir))


def _run(model: nn.Module, processors: list[Processor], samples: list[torch.Tensor]) -> RunContext:
    adapter = adapter_for(model)
    ctx = RunContext(model, Path("."), Path("."), get_backend("cpu"), adapter.decoder_layers(model))
    run_layer_wise(ctx, processors, samples, progress=False)
    return ctx


def _logits(model: nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=TOKENS).logits


def _relative(got: torch.Tensor, reference: torch.Tensor) -> float:
    return float((got - reference).abs().max() / (reference.max() - reference.min()))


@pytest.mark.parametrize("arch", ["gemma2", "gemma3_text"])
@pytest.mark.parametrize("name", ["iter_smooth", "smooth_quant"])
def test_gemma_is_smoothed_exactly_with_its_adapter(
    arch: str, name: str, random_norms: Callable[[str], Path]
) -> None:
    """The adapter's norm layout (the MLP reads pre_feedforward_layernorm) and the measured
    ``1 + weight`` gains: the smoothed model computes the original logits (they moved by 80-130 %
    of their range before)."""
    model_dir = random_norms(arch)
    model = load_causal_lm(model_dir)
    reference = _logits(model)
    processor = (
        IterSmoothProcessor(IterSmoothConfig(type="iter_smooth"))
        if name == "iter_smooth"
        else SmoothQuantProcessor(SmoothQuantConfig(type="smooth_quant"))
    )
    ctx = _run(model, [processor], _samples(model_dir))
    assert _relative(_logits(model), reference) < 1e-5
    checks = [c for c in ctx.report.transform_checks if c.processor == name]
    assert [c.layer for c in checks] == [0, 1]
    assert all(c.flow_checks > 0 and c.function_checks > 0 for c in checks)
    assert all(c.function_error is not None and c.function_error < 1e-4 for c in checks)


def test_gemma_under_llama_names_is_refused_naming_the_pair(
    random_norms: Callable[[str], Path],
) -> None:
    """Without its adapter (a model type msquant does not know, laid out as Gemma 3), the
    Llama names pair post_attention_layernorm with gate/up_proj: refused at the first layer,
    before anything is folded."""
    model_dir = random_norms("gemma3_text")
    model = load_causal_lm(model_dir)
    model.config.model_type = "gemma3_text_unknown"
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(
        TransformCheckError,
        match=r"iter_smooth: model\.layers\.0: the data flow the transform relies on does not hold "
        r"on this model \(checked on \d+ calibration tokens\): norm-linear post_attention_layernorm "
        r"-> mlp\.gate_proj, mlp\.up_proj: the input of mlp\.gate_proj, mlp\.up_proj does not follow "
        r"post_attention_layernorm's output channel by channel .*an architecture wired otherwise "
        r"needs an adapter declaring its norm_layout",
    ):
        _run(
            model, [IterSmoothProcessor(IterSmoothConfig(type="iter_smooth"))], _samples(model_dir)
        )
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_a_wrong_fold_is_caught_by_the_function_check_naming_the_subgraph(
    tiny_model_factory: Callable[..., Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A fold that forgets the target side of up-down (the data flow holds; the fold is wrong):
    the layer's output moves; the layer is put back and folded again one subgraph at a time, and
    the run stops naming the layer and the subgraph."""
    model_dir = tiny_model_factory("llama", num_layers=2)
    model = load_causal_lm(model_dir)
    real = smoothing_processor.smooth_subgraph

    def forgetful(model: nn.Module, subgraph: Any, *args: Any) -> torch.Tensor:
        if subgraph.kind != "up-down":
            return real(model, subgraph, *args)
        down = model.get_submodule(subgraph.targets[0])
        saved = down.weight.detach().clone()
        scales = real(model, subgraph, *args)
        with torch.no_grad():
            down.weight.copy_(saved)  # the columns of down_proj left unscaled
        return scales

    monkeypatch.setattr(smoothing_processor, "smooth_subgraph", forgetful)
    with pytest.raises(
        TransformCheckError,
        match=r"iter_smooth: model\.layers\.0: after the up-down mlp\.up_proj -> mlp\.down_proj fold "
        r"the layer computes something else on \d+ calibration tokens \(its outputs moved by "
        r"[0-9.e+-]+ of what the layer adds to its input; at most 0\.001 is float rounding\)",
    ):
        _run(
            model, [IterSmoothProcessor(IterSmoothConfig(type="iter_smooth"))], _samples(model_dir)
        )


def test_a_weight_shared_between_layers_is_refused(tiny_model_factory: Callable[..., Path]) -> None:
    model_dir = tiny_model_factory("llama", num_layers=2)
    model = load_causal_lm(model_dir)
    model.model.layers[1].mlp.up_proj = model.model.layers[0].mlp.up_proj
    with pytest.raises(
        TransformCheckError,
        match=r"model\.layers\.0\.mlp\.up_proj\.weight is also the model's "
        r"model\.layers\.1\.mlp\.up_proj\.weight: a fold into it would change that module too",
    ):
        _run(
            model, [IterSmoothProcessor(IterSmoothConfig(type="iter_smooth"))], _samples(model_dir)
        )


def test_quarot_refuses_sandwich_norms_with_learned_gains(
    random_norms: Callable[[str], Path],
) -> None:
    model = load_causal_lm(random_norms("gemma3_text"))
    with pytest.raises(
        TransformCheckError,
        match=r"quarot: model\.layers\.0\.post_attention_layernorm normalises a block's output "
        r"before the residual add with a gain that differs between channels \([0-9.]+ to "
        r"[0-9.]+\): a rotation of the residual stream cannot pass through it",
    ):
        _run(model, [QuaRot(QuaRotConfig(type="quarot"))], _samples(random_norms("gemma3_text")))


def test_quarot_rotates_sandwich_norms_with_one_gain_exactly(
    tiny_model_factory: Callable[..., Path],
) -> None:
    """A freshly built Gemma 3 has every gain 1 + 0: the output norms commute with the
    rotation, which the layer's check proves."""
    model_dir = tiny_model_factory("gemma3_text", num_layers=2)
    model = load_causal_lm(model_dir)
    reference = _logits(model)
    ctx = _run(model, [QuaRot(QuaRotConfig(type="quarot"))], _samples(model_dir))
    assert _relative(_logits(model), reference) < 1e-5
    assert [c.layer for c in ctx.report.transform_checks] == [0, 1]


class _ChannelScaledEmbedding(nn.Embedding):
    """An embedding whose output is scaled channel by channel (not a rotation's business)."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        scale = torch.linspace(0.5, 1.5, self.embedding_dim)
        return super().forward(ids) * scale


def test_quarot_refuses_an_embedding_transformed_before_the_first_layer(
    tiny_model_factory: Callable[..., Path],
) -> None:
    model_dir = tiny_model_factory("llama", num_layers=2)
    model = load_causal_lm(model_dir)
    table = model.model.embed_tokens.weight
    embedding = _ChannelScaledEmbedding(table.shape[0], table.shape[1])
    embedding.weight = table
    model.model.embed_tokens = embedding
    with pytest.raises(
        TransformCheckError,
        match=r"quarot: after rotating the input embedding, the hidden states entering the first "
        r"decoder layer are not the original ones rotated \(error [0-9.e+-]+ on \d+ calibration "
        r"tokens\)",
    ):
        _run(model, [QuaRot(QuaRotConfig(type="quarot"))], _samples(model_dir))


class _ScaledHead(nn.Linear):
    """An output head that scales its input channels before the product."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x * torch.linspace(0.5, 1.5, self.in_features), self.weight)


def test_quarot_refuses_a_head_that_is_not_a_plain_linear_of_the_stream(
    tiny_model_factory: Callable[..., Path],
) -> None:
    model_dir = tiny_model_factory("llama", num_layers=2)
    model = load_causal_lm(model_dir)
    head = _ScaledHead(model.lm_head.in_features, model.lm_head.out_features, bias=False)
    head.weight = model.lm_head.weight
    model.lm_head = head
    with pytest.raises(
        TransformCheckError,
        match=r"quarot: after folding the final norm into the output head and rotating both, the "
        r"head's logits moved by [0-9.e+-]+ \(relative\) on random hidden states",
    ):
        _run(model, [QuaRot(QuaRotConfig(type="quarot"))], _samples(model_dir))


def test_quarot_without_calibration_checks_on_random_tokens(
    tiny_model_factory: Callable[..., Path], tmp_path: Path
) -> None:
    """A quarot + W8A16 run needs no calibration data: the probe is 256 seeded random token
    ids, and the report records each layer's checks and their time."""
    model_dir = tiny_model_factory("llama", num_layers=2)
    config = tmp_path / "c.yaml"
    config.write_text(
        "apiversion: modelslim_v1\nspec:\n  process:\n    - type: quarot\n"
        "    - type: linear_quant\n      qconfig:\n        weight: {scope: per_channel, "
        "dtype: int8, symmetric: true, method: minmax}\n  save:\n    - type: ascendv1_saver\n"
    )
    msquant.quantize(model_dir, tmp_path / "out", config, progress=False)
    report = json.loads((tmp_path / "out" / "quant_report.json").read_text(encoding="utf-8"))
    assert report["probe_tokens"] == 256
    assert [c["layer"] for c in report["transform_checks"]] == [0, 1]
    assert all(
        c["processor"] == "quarot" and c["function_error"] < 1e-3
        for c in report["transform_checks"]
    )
    assert all(layer["check_seconds"] > 0 for layer in report["layers"])


def test_the_cli_refuses_a_post_norm_model_with_exit_code_2(
    tiny_model_factory: Callable[..., Path], tmp_path: Path, run_cli: Callable[..., Any]
) -> None:
    """OLMo 2 normalises each block's output (post_attention_layernorm) and has no input norm:
    msModelSlim's W8A8_DYNAMIC practice with iter_smooth is refused, nothing is written."""
    model_dir = tiny_model_factory("olmo2", num_layers=2)
    config = tmp_path / "c.yaml"
    config.write_text(CONFIG.format(transform="{type: iter_smooth}"))
    out = tmp_path / "out"
    result = run_cli(
        "quant", "--model_path", model_dir, "--save_path", out, "--config_path", config,
        "--calib_path", CALIB,
    )  # fmt: skip
    assert result.code == 2, result.out + result.err
    assert "iter_smooth: model.layers.0: the data flow the transform relies on" in result.err
    assert "post_attention_layernorm" in result.err
    assert not out.exists()


def test_a_smoothed_run_reports_its_checks(
    tiny_model_factory: Callable[..., Path], tmp_path: Path
) -> None:
    model_dir = tiny_model_factory("llama", num_layers=2)
    config = tmp_path / "c.yaml"
    config.write_text(CONFIG.format(transform="{type: iter_smooth}"))
    msquant.quantize(model_dir, tmp_path / "out", config, progress=False, calib_path=CALIB)
    report = json.loads((tmp_path / "out" / "quant_report.json").read_text(encoding="utf-8"))
    checks = report["transform_checks"]
    assert [(c["layer"], c["processor"]) for c in checks] == [
        (0, "iter_smooth"),
        (1, "iter_smooth"),
    ]
    # 3 + 2 + 1 + 1 readers and the whole layer; one check of the layer after its 4 folds
    assert all(c["flow_checks"] == 8 and c["function_checks"] == 1 for c in checks)
    assert all(c["flow_error"] < 1e-4 and c["function_error"] < 1e-3 for c in checks)
    assert all(c["function_tolerance"] == 1e-3 for c in checks)
    assert report["probe_tokens"] > 0
