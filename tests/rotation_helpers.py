"""Shared helpers of the ``quarot`` tests: tiny models with random norm scales, loaded in float64
with norms (and MoE routers) that compute in float64, and the processor's hooks run in memory."""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import AutoModelForCausalLM

import msquant
from msquant.evaluate.models import load_model_for_eval
from msquant.plugin import RunContext, adapter_for
from msquant.plugin.devices import get_backend
from msquant.plugin.model import measure_norm_form
from msquant.processors.quarot.config import QuaRotConfig
from msquant.processors.quarot.processor import QuaRot

TOKENS = torch.tensor([[5, 17, 42, 99, 3, 250, 7, 64, 128, 11, 300, 2]])


def randomize_norms(model: nn.Module, seed: int = 3) -> None:
    """Random norm scales (the tiny models are built with ones, or zeros for norms scaling by
    ``1 + weight``), so that folding them matters."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "norm" in name:
                values = torch.rand(parameter.shape, generator=generator) + 0.5
                parameter.copy_(values.to(parameter.dtype))


def load(path: Path, dtype: torch.dtype = torch.float32) -> nn.Module:
    """The saved model in ``dtype``, eval mode; in float64 its norms compute in float64 and its
    MoE experts are split into per-expert linears (transformers' fused experts kernel has no
    float64; the split computes the same)."""
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype)
    model.eval()
    if dtype == torch.float64:
        norms_in_float64(model)
        adapter_for(model).unfuse_experts(model)
    return model


def norms_in_float64(model: nn.Module) -> None:
    """transformers' RMSNorms compute in float32 whatever the model's dtype (1e-7 errors); the
    float64 reference tests make them compute in float64 too, before and after the rotation.
    The gain is ``offset + weight`` with the offset measured on each norm (1 for Qwen3-Next)."""

    def forward(self: nn.Module, x: torch.Tensor, offset: float = 0.0) -> torch.Tensor:
        eps = getattr(self, "variance_epsilon", getattr(self, "eps", 1e-6))
        scale = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
        return scale * (offset + self.weight)

    for module in model.modules():
        if type(module).__name__.endswith("RMSNorm"):
            form = measure_norm_form(module)
            assert form is not None, type(module).__name__
            module.forward = partial(forward, module, offset=form.offset)  # type: ignore[method-assign]


def rotate_in_memory(model: nn.Module, tmp_path: Path, **config: Any) -> tuple[QuaRot, RunContext]:
    """Split the experts as a run does, then run the processor's hooks (setup, then every
    layer's before_layer)."""
    adapter = adapter_for(model)
    adapter.unfuse_experts(model)
    processor = QuaRot(QuaRotConfig(**config))
    layers = adapter.decoder_layers(model)
    assert processor.check_model(model, layers) == []
    ctx = RunContext(
        model=model,
        model_path=tmp_path,
        output_dir=tmp_path,
        backend=get_backend("cpu"),
        layers=layers,
    )
    processor.setup(ctx)
    for layer in layers:
        processor.before_layer(ctx, layer)
    return processor, ctx


def save_with_random_norms(source: Path, target: Path) -> Path:
    """``source``'s model with :func:`randomize_norms` applied, saved to ``target`` with its
    tokenizer (float32)."""
    model = load(source)
    randomize_norms(model)
    model.save_pretrained(str(target))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (target / name).write_bytes((source / name).read_bytes())
    return target


def read_back(export: Path) -> nn.Module:
    """The float model of an export, as ``msquant eval`` reads it (quantized layers
    dequantized)."""
    model, _ = load_model_for_eval(export, False)
    return model


def rotated_run_logits(model: Path, out: Path, runner: str) -> tuple[torch.Tensor, torch.Tensor]:
    """A full ``msquant`` run of ``quarot`` alone (float export, Ascend format) with ``runner``:
    the export's logits read back and the original model's, on :data:`TOKENS`."""
    config = {
        "apiversion": "modelslim_v1",
        "spec": {
            "runner": runner,
            "process": [{"type": "quarot"}],
            "save": [{"type": "ascendv1_saver"}],
        },
    }
    msquant.quantize(str(model), str(out), config, progress=False, allow_float_export=True)
    with torch.no_grad():
        return read_back(out)(TOKENS).logits, load(model)(TOKENS).logits
