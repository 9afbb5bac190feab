"""The whole pipeline on a CUDA device, compared with the same run on the CPU.

Skipped where no CUDA device exists (CI has none); run on a GPU machine with
``python -m pytest tests/backends/test_cuda.py``. The GPU sums Hessians and runs the sweep in a different
order than the CPU, so a few codes may land on the other side of a rounding tie: the comparisons
allow a small share of differing codes and bound the scale differences, and both exports are
checked against the float model by the export verifier.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from ascend_reader import read_ascend_export
from conftest import CALIB_TXT

import msquant
import msquant.plugin
import msquant.plugin.numerics
from msquant import evaluate_perplexity
from msquant.backends import get_backend

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

GPTQ_GROUP = {
    "apiversion": "modelslim_v1",
    "spec": {
        "process": [
            {
                "type": "linear_quant",
                "qconfig": {
                    "weight": {
                        "scope": "per_group",
                        "dtype": "int4",
                        "symmetric": False,
                        "method": "gptq",
                        "ext": {"group_size": 32, "percdamp": 0.01, "block_size": 32},
                    }
                },
            }
        ],
        "save": [{"type": "ascendv1_saver"}],
    },
}

GPTQ_CHANNEL_ACT_ORDER = {
    "apiversion": "modelslim_v1",
    "spec": {
        "process": [
            {
                "type": "linear_quant",
                "qconfig": {
                    "weight": {
                        "scope": "per_channel",
                        "dtype": "int8",
                        "symmetric": True,
                        "method": "gptq",
                        "ext": {"desc_act": True},
                    }
                },
            }
        ],
        "save": [{"type": "ascendv1_saver"}],
    },
}


def _run(model: Path, save: Path, config: dict[str, object], device: str) -> None:
    msquant.quantize(
        model, save, config, device=device, calib_path=CALIB_TXT, max_calib_tokens=64,
        progress=False,
    )  # fmt: skip


def _compare_exports(cpu: Path, cuda: Path, max_share: float) -> None:
    """Same tensors and descriptions; codes equal and scales/offsets close but for a share of at
    most ``max_share`` of the entries (a group whose minimum or maximum moves by one rounding step
    gets another zero point, and its codes follow)."""
    a, b = read_ascend_export(cpu), read_ascend_export(cuda)
    assert a.description == b.description
    assert set(a.tensors) == set(b.tensors)
    for name, tensor in a.tensors.items():
        other = b.tensors[name]
        assert tensor.dtype == other.dtype and tensor.shape == other.shape, name
        if tensor.dtype == torch.int8:
            differ = tensor != other
        else:
            differ = ~torch.isclose(other.float(), tensor.float(), rtol=2e-3, atol=1e-5)
        share = float(differ.float().mean())
        assert share <= max_share, f"{name}: {100 * share:.2f}% of the entries differ"


@pytest.mark.parametrize("config", [GPTQ_GROUP, GPTQ_CHANNEL_ACT_ORDER], ids=["g32", "act_order"])
def test_cuda_run_matches_cpu_run(
    config: dict[str, object], tiny_llama: Path, tmp_path: Path
) -> None:
    _run(tiny_llama, tmp_path / "cpu", config, "cpu")
    _run(tiny_llama, tmp_path / "cuda", config, "cuda")
    _compare_exports(tmp_path / "cpu", tmp_path / "cuda", max_share=0.01)


def test_cuda_run_on_bf16_model_matches_cpu(tiny_llama_bf16: Path, tmp_path: Path) -> None:
    _run(tiny_llama_bf16, tmp_path / "cpu", GPTQ_GROUP, "cpu")
    _run(tiny_llama_bf16, tmp_path / "cuda", GPTQ_GROUP, "cuda")
    # bf16 layer outputs differ more between devices (different kernels), so more ties flip
    _compare_exports(tmp_path / "cpu", tmp_path / "cuda", max_share=0.05)


def test_cuda_run_twice_is_deterministic(tiny_llama: Path, tmp_path: Path) -> None:
    _run(tiny_llama, tmp_path / "one", GPTQ_GROUP, "cuda")
    _run(tiny_llama, tmp_path / "two", GPTQ_GROUP, "cuda")
    _compare_exports(tmp_path / "one", tmp_path / "two", max_share=0.0)


def test_cuda_perplexity_matches_cpu(tiny_llama: Path, tmp_path: Path) -> None:
    _run(tiny_llama, tmp_path / "export", GPTQ_GROUP, "cuda")
    for model in (tiny_llama, tmp_path / "export"):
        cpu = evaluate_perplexity(model, CALIB_TXT, seqlen=64, device="cpu")
        cuda = evaluate_perplexity(model, CALIB_TXT, seqlen=64, device="cuda")
        assert cuda.tokens == cpu.tokens
        assert cuda.ppl == pytest.approx(cpu.ppl, rel=1e-4)


def test_gptq_classes_on_cuda_match_float64_cpu() -> None:
    backend = get_backend("cuda")
    generator = torch.Generator().manual_seed(3)
    weight = torch.randn(96, 256, generator=generator)
    x = torch.randn(2048, 256, generator=generator) @ torch.randn(256, 256, generator=generator)
    results = []
    for device in ("cpu", "cuda"):
        gptq = msquant.plugin.numerics.WeightPerGroupGPTQ(
            bits=4, symmetric=True, group_size=64, name="probe"
        )
        for rows in x.to(device).split(256):
            gptq.add_batch(rows)
        results.append(gptq.quantize(weight.to(device), backend=get_backend(device)))
    cpu, cuda = results
    assert cuda.quantized.codes.device.type == "cuda"
    share = float((cuda.quantized.codes.cpu() != cpu.quantized.codes).float().mean())
    assert share <= 0.002, f"{100 * share:.2f}% of the codes differ"
    assert cuda.loss == pytest.approx(cpu.loss, rel=1e-3)
    backend.synchronize()
    assert backend.memory_allocated() > 0
