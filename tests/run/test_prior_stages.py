"""``spec.prior``: stages run over the whole model before ``spec.process``, each on its own
calibration set (msModelSlim's semantics), streamed or in memory."""

from __future__ import annotations

import copy
import shutil
from pathlib import Path
from typing import Any, ClassVar, Literal

import pytest
import torch
from conftest import CALIB_TXT
from safetensors.torch import load_file, save_file

import msquant
from msquant import ConfigError
from msquant.config.spec import validate_config
from msquant.load.calibration import read_calibration_texts, tokenize_samples
from msquant.load.model_folder import load_tokenizer
from msquant.plugin import DecoderLayer, Processor, ProcessorConfig, RunContext

MINMAX = {
    "type": "linear_quant",
    "qconfig": {
        "weight": {"dtype": "int8", "scope": "per_channel", "symmetric": True, "method": "minmax"}
    },
    "exclude": ["*down_proj"],
}
W8A8 = {
    "type": "linear_quant",
    "qconfig": {
        "act": {"dtype": "int8", "scope": "per_tensor", "symmetric": False, "method": "minmax"},
        "weight": {"dtype": "int8", "scope": "per_channel", "symmetric": True, "method": "minmax"},
    },
    "include": ["*down_proj"],
}


class _ScaleConfig(ProcessorConfig):
    type: Literal["scale_weights"] = "scale_weights"
    module: str = "self_attn.q_proj"
    factor: float = 2.0


class ScaleWeights(Processor):
    """Test processor: multiplies one linear's weight of every layer by ``factor``, and records
    the calibration tokens each layer's forward saw (when calibrating)."""

    type_name = "scale_weights"
    config_class = _ScaleConfig
    config: _ScaleConfig
    requires_calibration = True
    seen: ClassVar[list[tuple[int, int, int]]] = []

    def before_layer(self, ctx: RunContext, layer: DecoderLayer) -> None:
        def record(module: torch.nn.Module, args: Any, kwargs: Any) -> None:
            hidden = args[0] if args else kwargs["hidden_states"]
            ScaleWeights.seen.append((id(self), layer.index, hidden.shape[0] * hidden.shape[1]))

        self.hook = layer.module.register_forward_pre_hook(record, with_kwargs=True)

    def after_layer(self, ctx: RunContext, layer: DecoderLayer) -> None:
        self.hook.remove()
        linear = layer.module.get_submodule(self.config.module)
        linear.weight.data.mul_(self.config.factor)


def registry() -> msquant.plugin.ProcessorRegistry:
    found = msquant.plugin.default_registry()
    found.register(ScaleWeights)
    return found


def cfg(prior: list[dict[str, Any]], *process: dict[str, Any], **spec: Any) -> dict[str, Any]:
    return {
        "apiversion": "modelslim_v1",
        "spec": {"prior": prior, "process": [copy.deepcopy(p) for p in process], **spec},
    }


def scaled_copy(model: Path, target: Path, module: str, factor: float) -> Path:
    """The model folder with ``module``'s weight of every layer multiplied on disk."""
    shutil.copytree(model, target)
    for shard in target.glob("*.safetensors"):
        tensors = load_file(shard)
        for name in tensors:
            if name.endswith(f"{module}.weight"):
                tensors[name] = tensors[name] * factor
        save_file(tensors, shard, metadata={"format": "pt"})
    return target


def weights_of(export: Path) -> dict[str, torch.Tensor]:
    found: dict[str, torch.Tensor] = {}
    for shard in sorted(export.glob("*.safetensors")):
        found.update(load_file(shard))
    return found


@pytest.mark.parametrize("runner", ["layer_wise", "model_wise"])
def test_main_stage_quantizes_the_model_the_prior_stage_changed(
    tiny_llama: Path, tmp_path: Path, runner: str
) -> None:
    prior = [{"process": [{"type": "scale_weights", "factor": 2.0}]}]
    run = msquant.quantize(
        tiny_llama, tmp_path / "prior", cfg(prior, MINMAX, W8A8, runner=runner),
        calib_path=CALIB_TXT, progress=False, registry=registry(),
    )  # fmt: skip
    assert len(run.quantized_modules) == 14
    doubled = scaled_copy(tiny_llama, tmp_path / "doubled", "self_attn.q_proj", 2.0)
    msquant.quantize(
        doubled, tmp_path / "direct", cfg([], MINMAX, W8A8, runner=runner),
        calib_path=CALIB_TXT, progress=False,
    )  # fmt: skip
    mine, direct = weights_of(tmp_path / "prior"), weights_of(tmp_path / "direct")
    plain = weights_of(_plain_export(tiny_llama, tmp_path, runner))
    assert mine.keys() == direct.keys()
    assert [n for n in mine if not torch.equal(mine[n], direct[n])] == []
    scale = "model.layers.0.self_attn.q_proj.weight_scale"
    # the prior stage changed what was quantized (the same codes at twice the scale)
    assert torch.allclose(mine[scale], 2 * plain[scale])


def _plain_export(model: Path, tmp_path: Path, runner: str) -> Path:
    out = tmp_path / "plain"
    msquant.quantize(
        model, out, cfg([], MINMAX, W8A8, runner=runner), calib_path=CALIB_TXT, progress=False
    )
    return out


def test_prior_stage_calibrates_on_its_own_dataset(tiny_llama: Path, tmp_path: Path) -> None:
    own = tmp_path / "prior.jsonl"
    own.write_text('{"inputs_pretokenized": "a short prior text"}\n' * 3, encoding="utf-8")
    ScaleWeights.seen.clear()
    prior = [
        {"process": [{"type": "scale_weights", "factor": 1.0}], "dataset": str(own)},
        {"process": [{"type": "scale_weights", "factor": 1.0}]},  # falls back to the main set
    ]
    msquant.quantize(
        tiny_llama, tmp_path / "out", cfg(prior, MINMAX), calib_path=CALIB_TXT,
        progress=False, registry=registry(),
    )  # fmt: skip
    tokenizer = load_tokenizer(tiny_llama)
    prior_tokens = sum(s.numel() for s in tokenize_samples(read_calibration_texts(own), tokenizer))
    main = tokenize_samples(read_calibration_texts(CALIB_TXT), tokenizer)
    main_tokens = sum(s.numel() for s in main)
    assert prior_tokens != main_tokens
    stages = list(dict.fromkeys(owner for owner, _, _ in ScaleWeights.seen))
    assert len(stages) == 2  # the prior stages ran in order, each over every layer
    tokens = {(stages.index(o), layer): 0 for o, layer, _ in ScaleWeights.seen}
    for owner, layer, count in ScaleWeights.seen:
        tokens[(stages.index(owner), layer)] += count
    assert tokens == {(0, 0): prior_tokens, (0, 1): prior_tokens, (1, 0): main_tokens,
                      (1, 1): main_tokens}  # fmt: skip


def test_prior_errors_name_the_stage_entry() -> None:
    bad = copy.deepcopy(MINMAX)
    bad["qconfig"]["weight"]["dtype"] = "int3"
    asym_tokens = copy.deepcopy(MINMAX)
    asym_tokens["qconfig"]["act"] = {
        "dtype": "int8", "scope": "per_token", "symmetric": False, "method": "minmax"
    }  # fmt: skip
    data = cfg(
        [{"process": [MINMAX, bad]}, {"process": [asym_tokens, {"type": "ascendv1_saver"}]}],
        MINMAX,
    )
    data["spec"]["prior"][0]["datset"] = "x.jsonl"
    with pytest.raises(ConfigError) as info:
        validate_config(data, msquant.plugin.default_registry())
    found = {issue.path: issue.message for issue in info.value.issues}
    assert set(found) == {
        "spec.prior[0].process[1].qconfig.weight.dtype",
        "spec.prior[0].datset",
        "spec.prior[1].process[1].type",
        "spec.prior[1].process[0].qconfig.act",
    }
    assert (
        "registered process types: flex_smooth_quant, group, iter_smooth, linear_quant, "
        "online_quarot, quarot, smooth_quant" in found["spec.prior[1].process[1].type"]
    )
    assert found["spec.prior[0].datset"] == "unknown key; valid keys here: process, dataset"


def test_prior_dataset_missing_is_refused_before_loading(tiny_llama: Path, tmp_path: Path) -> None:
    prior = [{"process": [{"type": "scale_weights"}], "dataset": str(tmp_path / "nope.jsonl")}]
    with pytest.raises(msquant.MsquantInputError, match="nope.jsonl"):
        msquant.quantize(
            tiny_llama, tmp_path / "out", cfg(prior, MINMAX), calib_path=CALIB_TXT,
            progress=False, registry=registry(),
        )  # fmt: skip
    assert not (tmp_path / "out").exists()


def test_a_run_with_prior_stages_writes_no_checkpoints(tiny_llama: Path, tmp_path: Path) -> None:
    prior = [{"process": [{"type": "scale_weights", "factor": 1.0}]}]
    with pytest.raises(msquant.MsquantInputError, match="spec.prior stages"):
        msquant.quantize(
            tiny_llama, tmp_path / "out", cfg(prior, MINMAX), calib_path=CALIB_TXT,
            progress=False, registry=registry(), resume=True,
        )  # fmt: skip
