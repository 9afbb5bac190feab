"""Issue 13 §1 #5 / #12 with the engines' own code: GPTQ layers that are not whole Marlin tiles.

The export's ``down_proj`` has 160 input features (Marlin tiles: output % 64 and input % 128);
every other layer, the fused ``gate_up_proj`` (2 x 160 = 320 outputs) included, is aligned.
vLLM 0.33's Marlin kernel accepts the layer (``MarlinLinearKernel.can_implement``) and zero-pads
it to whole tiles (``marlin_padded_nk``); SGLang 0.5.23 picks Marlin for the checkpoint without
looking at shapes and its kernel's weight preparation computes the shape check and ignores the
answer, handing Marlin the misaligned shape. msquant's warning says both, naming the same layer.
Opt-in (``pytest -m consumers``).
"""

from __future__ import annotations

import dataclasses

import pytest
import sglang_engine
import torch
import vllm_engine
from architectures import EngineModule, engine_modules
from cases import GPTQ_MISALIGNED
from exports import Export, ExportFactory
from loading import loading_problems, read_tensor_table

import msquant

pytestmark = [pytest.mark.consumers, pytest.mark.usefixtures("vllm")]

DOWN_PROJ = "model.layers.0.mlp.down_proj"
GATE_UP = "model.layers.0.mlp.gate_up_proj"


def _module(export: Export, engine: str, prefix: str) -> EngineModule:
    modules = engine_modules(export.model_dir, engine)  # type: ignore[arg-type]
    return next(m for m in modules if m.prefix == prefix)


def _marlin_warning(export: Export) -> str:
    [warning] = [w for w in export.warnings if w.startswith("gptq_saver: Marlin")]
    return warning


def test_msquant_names_only_the_misaligned_layer_per_engine(make_export: ExportFactory) -> None:
    export = make_export(GPTQ_MISALIGNED)
    warning = _marlin_warning(export)
    assert f"{DOWN_PROJ} [out 128, in 160, group_size 32]" in warning
    assert "gate_up_proj" not in warning and "gate_proj" not in warning
    assert "vLLM 0.33 / 0.34 zero-pads them to whole tiles and loads the checkpoint" in warning
    assert "SGLang 0.5.23 runs its Marlin kernels on them without checking" in warning
    [note] = [w for w in msquant.verify_export(export.path).warnings if "Marlin" in w]
    assert f"(2 layers: {DOWN_PROJ}, model.layers.1.mlp.down_proj)" in note


def test_vllm_accepts_and_pads_the_misaligned_layer(make_export: ExportFactory) -> None:
    export = make_export(GPTQ_MISALIGNED)
    config = vllm_engine.quant_config_for(export.path, "llama")
    modules = engine_modules(export.model_dir, "vllm")
    resolutions = [vllm_engine.resolve(config, m) for m in modules]
    assert loading_problems(resolutions, read_tensor_table(export.path)) == []
    from vllm.model_executor.kernels.linear.mixed_precision.marlin import MarlinLinearKernel
    from vllm.model_executor.kernels.linear.mixed_precision.MPLinearKernel import (
        MPLinearLayerConfig,
    )
    from vllm.model_executor.layers.quantization.utils import marlin_utils

    def kernel_config(prefix: str) -> MPLinearLayerConfig:
        """The kernel description vLLM's AutoGPTQLinearMethod.create_weights builds."""
        module = _module(export, "vllm", prefix)
        layer = vllm_engine.LAYER_CLASSES[module.cls](module)
        method = config.get_quant_method(layer, prefix=prefix)
        vllm_engine.create_weights(method, layer, module)
        names = [f.name for f in dataclasses.fields(MPLinearLayerConfig)]
        return MPLinearLayerConfig(**{n: getattr(method.kernel.config, n) for n in names})

    down = kernel_config(DOWN_PROJ)
    assert down.partition_weight_shape == (160, 128) and down.group_size == 32
    assert MarlinLinearKernel.can_implement(down) == (True, None)
    assert marlin_utils.marlin_padded_nk(128, 160, 32) == (128, 192)  # (n, k) padded
    # the strict check vLLM used to apply still says no
    fits, reason = marlin_utils.check_marlin_supports_shape(128, 160, 160, 32)
    assert not fits and "min_thread_k = 128" in (reason or "")
    gate_up = kernel_config(GATE_UP)
    assert gate_up.partition_weight_shape == (128, 320)
    assert marlin_utils.marlin_padded_nk(320, 128, 32) == (320, 128)  # no padding


def test_sglang_runs_marlin_on_the_misaligned_layer_unchecked(make_export: ExportFactory) -> None:
    export = make_export(GPTQ_MISALIGNED)
    hf_config = sglang_engine.hf_quantization_config(export.path)
    assert sglang_engine.detect_method(hf_config) == "gptq_marlin"  # shapes are not consulted
    config = sglang_engine.quant_config_for(export.path, "llama")
    modules = engine_modules(export.model_dir, "sglang")
    resolutions = [sglang_engine.resolve(config, m) for m in modules]
    assert loading_problems(resolutions, read_tensor_table(export.path)) == []
    from sglang.srt.layers.quantization import marlin_utils

    fits, reason = marlin_utils.check_marlin_supports_shape(128, 160, 160, 32)
    assert not fits and "min_thread_k = 128" in (reason or "")
    layer, method = sglang_engine.build(config, _module(export, "sglang", DOWN_PROJ))
    assert type(method).__name__ == "GPTQMarlinLinearMethod"
    sglang_engine.REPACK_CALLS.clear()
    with sglang_engine.cuda_device(), torch.no_grad():
        method.process_weights_after_loading(layer)  # computes the check, ignores its answer
    assert sglang_engine.REPACK_CALLS == [sglang_engine.RepackCall(160, 128, 4)]
    assert layer.scheme.kernel.kernel_config.partition_weight_shape == (160, 128)
