"""compressed-tensors exports as their consumers read them (issue 13, section 1, items 6-8).

vLLM's choice of config group per module (``consumer_rules.vllm_ct_group``, written from vLLM
0.33's ``compressed_tensors.py``) is checked for MoE routers and the output head; transformers
loads the exports (logits against an independently fake-quantized model); the saver's warnings
name what SGLang and compressed-tensors 0.17 (vLLM 0.33 / 0.34's pin) do not load.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import NEEDS_MOE_TRANSFORMERS
from consumer_rules import vllm_ct_group
from torch import nn
from transformers import AutoModelForCausalLM

import msquant
import msquant.plugin
import msquant.plugin.numerics

SAVER_LOGGER = "msquant.processors.formats.compressed_tensors.saver"
IDS = torch.tensor([[1, 5, 17, 42, 99, 200, 301, 7, 64, 128, 3, 250]])
DOCS = Path(__file__).resolve().parents[2] / "docs"


def _weight(bits: int, group_size: int | None = None) -> dict[str, Any]:
    weight: dict[str, Any] = {
        "dtype": "int8" if bits == 8 else "int4",
        "scope": "per_channel" if group_size is None else "per_group",
        "symmetric": True,
        "method": "minmax",
    }
    if group_size is not None:
        weight["ext"] = {"group_size": group_size}
    return weight


def _config(weight: dict[str, Any], **entry: Any) -> dict[str, Any]:
    return {
        "apiversion": "modelslim_v1",
        "spec": {
            "process": [{"type": "linear_quant", "qconfig": {"weight": weight}, **entry}],
            "save": [{"type": "compressed_tensors", "part_file_size": 0}],
        },
    }


def _export(model: Path, save: Path, config: dict[str, Any]) -> dict[str, Any]:
    msquant.quantize(model, save, config, progress=False)  # verifies the export itself
    return json.loads((save / "config.json").read_text())["quantization_config"]


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == SAVER_LOGGER and r.levelno == logging.WARNING
    ]


# --- item 6: MoE routers in ignore -----------------------------------------------------------------

#: arch -> (its routers' checkpoint names in a 2-layer model, tiny-model arguments)
ROUTERS: dict[str, tuple[list[str], dict[str, Any]]] = {
    "qwen3_moe": (["model.layers.0.mlp.gate", "model.layers.1.mlp.gate"], {"num_layers": 2}),
    "qwen2_moe": (
        [f"model.layers.{i}.mlp.{r}" for i in range(2) for r in ("gate", "shared_expert_gate")],
        {"num_layers": 2},
    ),
    "mixtral": (
        ["model.layers.0.block_sparse_moe.gate", "model.layers.1.block_sparse_moe.gate"],
        {"num_layers": 2, "intermediate_size": 32},
    ),
    "deepseek_v3": (["model.layers.1.mlp.gate"], {"num_layers": 2}),  # layer 0 is dense
}


@NEEDS_MOE_TRANSFORMERS
@pytest.mark.parametrize("arch", sorted(ROUTERS))
def test_every_moe_router_is_ignored(
    arch: str, tiny_model_factory: Callable[..., Path], tmp_path: Path
) -> None:
    """transformers 5 routers are not nn.Linear; vLLM builds them as linear layers that would
    take the ``Linear`` target, so each must be listed in ``ignore`` under its checkpoint name."""
    routers, kwargs = ROUTERS[arch]
    model = tiny_model_factory(arch, **kwargs)
    qc = _export(model, tmp_path / "out", _config(_weight(8)))
    for router in routers:
        assert router in qc["ignore"], router
        assert vllm_ct_group(qc, router) is None, router
    experts = "block_sparse_moe.experts.0.w1" if arch == "mixtral" else "mlp.experts.0.gate_proj"
    assert vllm_ct_group(qc, f"model.layers.1.{experts}") == "group_0"
    report = msquant.verify_export(tmp_path / "out", model_path=model)
    assert report.ok, report.errors
    assert not [w for w in report.warnings if "stored in float but" in w]  # nothing unlisted


# --- item 7: a quantized head is always named in its group's targets --------------------------------


def test_a_head_sharing_the_base_scheme_is_named_and_loads(
    tiny_llama: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING)
    qc = _export(tiny_llama, tmp_path / "out", _config(_weight(8), lm_head=True))
    [group] = qc["config_groups"].values()
    assert group["targets"] == ["lm_head", "Linear"]
    assert vllm_ct_group(qc, "lm_head", linear=False) == "group_0"  # vLLM's ParallelLMHead
    assert "lm_head" not in qc["ignore"]
    assert not [m for m in _warnings(caplog) if "lm_head" in m]  # the stale vLLM warning is gone
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="compressed_tensors"):
        loaded = AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"))
        with torch.no_grad():
            logits = loaded(IDS).logits.float()
    assert not [r for r in caplog.records if "Could not match" in r.getMessage()]
    reference = AutoModelForCausalLM.from_pretrained(str(tiny_llama)).eval()
    with torch.no_grad():
        for module in reference.modules():
            if isinstance(module, nn.Linear):  # the head included
                q = msquant.plugin.numerics.quantize_weight_minmax(module.weight, 8, True, None)
                module.weight.copy_(q.dequantize())
        expected = reference(IDS).logits
    assert float((logits - expected).abs().max() / expected.abs().max()) <= 1e-3
    notes = msquant.verify_export(tmp_path / "out").warnings
    assert not [w for w in notes if "ParallelLMHead" in w]


def test_a_float_head_stays_ignored(tiny_llama: Path, tmp_path: Path) -> None:
    qc = _export(tiny_llama, tmp_path / "out", _config(_weight(8)))
    assert qc["ignore"] == ["lm_head"]
    assert [g["targets"] for g in qc["config_groups"].values()] == [["Linear"]]
    assert vllm_ct_group(qc, "lm_head", linear=False) is None


# --- item 8: SGLang's 4/8 bits, compressed-tensors >= 0.18 for 3/5/6/7 bits ------------------------


def test_widths_sglang_and_compressed_tensors_0_17_do_not_load_are_named(
    tiny_llama: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, SAVER_LOGGER)
    mixed = _config(_weight(4, 32), dynamic={r".*\.1\.mlp\..*": {"bits": 3}})
    _export(tiny_llama, tmp_path / "int3", mixed)
    messages = _warnings(caplog)
    [sglang] = [m for m in messages if "SGLang" in m]
    assert "4 or 8 bits only" in sglang and "int3" in sglang
    assert "model.layers.1.mlp.gate_proj" in sglang and "self_attn" not in sglang
    [packing] = [m for m in messages if "compressed-tensors 0.18" in m]
    assert "vLLM 0.33 / 0.34 pin compressed-tensors 0.17.0" in packing and "int3" in packing
    notes = msquant.verify_export(tmp_path / "int3").warnings
    assert any("SGLang" in w and "model.layers.1.mlp.down_proj" in w for w in notes)
    assert any("compressed-tensors >= 0.18" in w for w in notes)
    caplog.clear()
    _export(tiny_llama, tmp_path / "int8", _config(_weight(8)))
    assert _warnings(caplog) == []


def test_int2_warns_for_sglang_but_packs_alike_in_every_version(
    tiny_llama: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, SAVER_LOGGER)
    _export(tiny_llama, tmp_path / "int2", _config(_weight(4, 32), dynamic={".*": {"bits": 2}}))
    messages = _warnings(caplog)
    assert [m for m in messages if "SGLang" in m] and not [m for m in messages if "0.18" in m]


def test_formats_doc_names_both_limits() -> None:
    text = (DOCS / "formats.md").read_text(encoding="utf-8")
    assert "**4 and 8 bits only**" in text
    assert "**compressed-tensors 0.18 and later**" in text
    assert "**vLLM 0.33 / 0.34 pin compressed-tensors 0.17.0**" in text
