"""vLLM 0.33.0 / 0.34.0's own compressed-tensors code against msquant's FP8 W8A8 export (issue 26).

The real ``CompressedTensorsConfig`` (``_get_scheme_from_parts``: ``float-quantized`` is an
activation-quantization format, ``_is_fp8_w8a8``: float channel weights, float dynamic inputs,
SM 8.9+ capability) picks ``CompressedTensorsW8A8Fp8`` for every quantized linear, fused q/k/v and
gate/up included, and leaves the head unquantized. The scheme class itself (its kernels need
CUDA) is replaced by a recorder of the arguments vLLM constructs it with; the recorder creates the
parameters as vLLM's ``fp8_utils.create_fp8_weight_parameter`` / ``create_fp8_scale_parameter``
do for the channel strategy (``float8_e4m3fn`` ``[out, in]`` weight, float32 ``[out, 1]`` scale,
no ``input_scale`` for dynamic inputs: transcribed from 0.34.0 ``fp8_utils.py:1376-1411`` and
``schemes/compressed_tensors_w8a8_fp8.py``), and every exported tensor must fill one of them.
Opt-in (``pytest -m consumers``).
"""

from __future__ import annotations

import importlib
from typing import Any

import pytest
import torch
import vllm_engine
from act_cases import ActExportCase
from architectures import engine_modules
from exports import ExportFactory
from loading import loading_problems, read_tensor_table

pytestmark = [pytest.mark.consumers, pytest.mark.usefixtures("vllm")]

CT_MODULE = "vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors"
FP8 = {"dtype": "fp8_e4m3", "symmetric": True, "method": "minmax"}
CASES = {
    case.name: case
    for case in (
        ActExportCase(
            "ct_w8a8_fp8",
            "llama",
            "compressed_tensors",
            {**FP8, "scope": "per_channel"},
            act={**FP8, "scope": "per_token"},
        ),
    )
}


class RecordedW8A8Fp8:
    """Stands for ``CompressedTensorsW8A8Fp8``: keeps what vLLM passes it."""

    made: list[dict[str, Any]] = []

    def __init__(self, weight_quant: Any, is_static_input_scheme: Any) -> None:
        self.weight_quant = weight_quant
        self.is_static_input_scheme = is_static_input_scheme
        RecordedW8A8Fp8.made.append(
            {"weight_quant": weight_quant, "static": is_static_input_scheme}
        )

    @classmethod
    def get_min_capability(cls) -> int:
        """vLLM's value (``compressed_tensors_w8a8_fp8.py``: Lovelace and up)."""
        return 89

    def create_weights(
        self,
        layer: torch.nn.Module,
        input_size_per_partition: int,
        output_partition_sizes: list[int],
        input_size: int,
        output_size: int,
        params_dtype: torch.dtype,
        weight_loader: Any,
        **kwargs: Any,
    ) -> None:
        rows = sum(output_partition_sizes)
        # ModelWeightParameter / ChannelQuantScaleParameter: sharded along output_dim 0
        for name, data in (
            ("weight", torch.empty(rows, input_size_per_partition, dtype=torch.float8_e4m3fn)),
            ("weight_scale", torch.empty(rows, 1, dtype=torch.float32)),
        ):
            param = torch.nn.Parameter(data, requires_grad=False)
            param.output_dim = 0  # type: ignore[attr-defined]
            layer.register_parameter(name, param)
        if self.is_static_input_scheme:
            scale = torch.empty(len(output_partition_sizes), dtype=torch.float32)
            layer.register_parameter("input_scale", torch.nn.Parameter(scale, requires_grad=False))


@pytest.mark.parametrize("case", list(CASES.values()), ids=list(CASES))
def test_vllm_picks_w8a8_fp8_for_every_linear_and_every_tensor_loads(
    case: ActExportCase, make_export: ExportFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    export = make_export(case)
    modules = engine_modules(export.model_dir, "vllm")
    vllm_engine.load_vllm()
    monkeypatch.setattr(
        importlib.import_module(CT_MODULE), "CompressedTensorsW8A8Fp8", RecordedW8A8Fp8
    )
    RecordedW8A8Fp8.made.clear()
    resolutions = vllm_engine.resolve_export(export.path, case.arch, modules)
    assert [r.error for r in resolutions if r.error] == []
    assert loading_problems(resolutions, read_tensor_table(export.path)) == []
    linear = [r for r in resolutions if r.module.kind == "linear"]
    assert len(linear) >= 4 and {r.method for r in linear} == {"CompressedTensorsLinearMethod"}
    assert len(RecordedW8A8Fp8.made) == len(linear)  # fused q/k/v and gate/up: one each
    for made in RecordedW8A8Fp8.made:
        args = made["weight_quant"]
        assert (args.num_bits, args.type, args.strategy, args.symmetric, args.dynamic) == (
            8,
            "float",
            "channel",
            True,
            False,
        )
        assert not made["static"]  # dynamic per-token FP8 inputs: no input_scale
    for resolution in linear:
        params = resolution.params
        rows, columns = resolution.module.output_size, resolution.module.input_size
        assert (params["weight"].dtype, params["weight"].shape) == (
            torch.float8_e4m3fn,
            (rows, columns),
        )
        assert "input_scale" not in params
    head = next(r for r in resolutions if r.module.kind == "lm_head")
    assert not head.quantized
