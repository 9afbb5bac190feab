"""vLLM 0.33.0 / 0.34.0's own compressed-tensors code against msquant's MX exports (issue 26).

The real ``CompressedTensorsConfig`` (``_get_scheme_from_parts``: ``_is_mxfp4`` / ``_is_mxfp8``,
float group-32 symmetric weights, the latter with ``scale_dtype`` uint8) picks the real
``CompressedTensorsW8A8Mxfp8`` (W8A8_MXFP8 export) or ``CompressedTensorsW4A4Mxfp4`` (W4A4_MXFP4
export) for every quantized linear, fused q/k/v and gate/up included, and their own
``create_weights`` create the parameters every exported tensor must fill (name, shape, dtype).
Only the kernel choice is recorded instead of made (it needs the GPU's capability and
FlashInfer): the MXFP4 scheme must ask for MXFP4 dynamic activations (vLLM's ``kMxfp4Dynamic``),
not the FP8 ones of ``CompressedTensorsW4A8Mxfp4``. Opt-in (``pytest -m consumers``).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import vllm_engine
from act_cases import ActExportCase
from architectures import engine_modules
from exports import ExportFactory
from loading import loading_problems, read_tensor_table

pytestmark = [pytest.mark.consumers, pytest.mark.usefixtures("vllm")]


def mx(dtype: str) -> dict[str, Any]:
    return {"dtype": dtype, "scope": "per_block", "symmetric": True, "method": "minmax"}


#: (case, the scheme vLLM must pick, the weight parameter, its dtype, input columns per byte)
CASES = [
    (
        ActExportCase("ct_w8a8_mxfp8", "llama", "compressed_tensors", mx("mxfp8"), act=mx("mxfp8")),
        "CompressedTensorsW8A8Mxfp8",
        "weight",
        torch.float8_e4m3fn,
        1,
    ),
    (
        ActExportCase("ct_w4a4_mxfp4", "llama", "compressed_tensors", mx("mxfp4"), act=mx("mxfp4")),
        "CompressedTensorsW4A4Mxfp4",
        "weight_packed",
        torch.uint8,
        2,
    ),
]


@pytest.mark.parametrize(
    ("case", "scheme_name", "weight_name", "weight_dtype", "per_byte"),
    CASES,
    ids=[case[0].name for case in CASES],
)
def test_vllm_picks_the_mx_scheme_for_every_linear_and_every_tensor_loads(
    case: ActExportCase,
    scheme_name: str,
    weight_name: str,
    weight_dtype: torch.dtype,
    per_byte: int,
    make_export: ExportFactory,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    export = make_export(case)
    modules = engine_modules(export.model_dir, "vllm")
    vllm_engine.load_vllm()
    vllm_engine.MX_KERNELS.clear()
    made: list[str] = []
    from vllm.model_executor.layers.quantization.compressed_tensors import compressed_tensors

    real = getattr(compressed_tensors, scheme_name)

    class Recorded(real):  # type: ignore[misc, valid-type]
        """The real scheme; records that vLLM constructed it."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            made.append(scheme_name)
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(compressed_tensors, scheme_name, Recorded)
    resolutions = vllm_engine.resolve_export(export.path, case.arch, modules)
    assert [r.error for r in resolutions if r.error] == []
    assert loading_problems(resolutions, read_tensor_table(export.path)) == []
    linear = [r for r in resolutions if r.module.kind == "linear"]
    assert len(linear) >= 4 and {r.method for r in linear} == {"CompressedTensorsLinearMethod"}
    assert len(made) == len(linear)  # fused q/k/v and gate/up: one scheme each
    for resolution in linear:
        params = resolution.params
        rows, columns = resolution.module.output_size, resolution.module.input_size
        assert (params[weight_name].dtype, tuple(params[weight_name].shape)) == (
            weight_dtype,
            (rows, columns // per_byte),
        )
        assert (params["weight_scale"].dtype, tuple(params["weight_scale"].shape)) == (
            torch.uint8,
            (rows, columns // 32),
        )
        assert set(params) == {weight_name, "weight_scale"}
    kinds = {kind for kind, _ in vllm_engine.MX_KERNELS}
    assert kinds == {"mxfp8" if per_byte == 1 else "mxfp4"}
    if per_byte == 2:  # W4A4: MXFP4 dynamic activations asked for, not FP8 (W4A8Mxfp4)
        from vllm.model_executor.layers.quantization.utils.quant_utils import kMxfp4Dynamic

        assert all(
            args["activation_quant_key"] == kMxfp4Dynamic for _, args in vllm_engine.MX_KERNELS
        )
    head = next(r for r in resolutions if r.module.kind == "lm_head")
    assert not head.quantized
