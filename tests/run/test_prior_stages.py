"""``spec.prior``: msModelSlim 26.1.0 reloads the weights after each prior stage, so a stage
changes nothing in its export; msquant validates the stages, checks their datasets and
processors against the model, warns, and does not run them (the same export as without them)."""

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

    def setup(self, ctx: RunContext) -> None:
        ScaleWeights.seen.append((id(self), -1, 0))

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


NOTE = (
    "spec.prior[0] ({kinds}) is not run: msModelSlim 26.1.0 reloads the model's weights after "
    "each prior stage, so what the stage changes never reaches spec.process or its export"
)


@pytest.mark.parametrize("runner", ["layer_wise", "model_wise"])
def test_a_prior_stage_is_not_run_and_the_export_is_the_one_without_it(
    tiny_llama: Path, tmp_path: Path, runner: str, caplog: pytest.LogCaptureFixture
) -> None:
    ScaleWeights.seen.clear()
    own = tmp_path / "prior.jsonl"
    own.write_text('{"inputs_pretokenized": "a short prior text"}\n' * 3, encoding="utf-8")
    prior = [
        {"process": [{"type": "scale_weights", "factor": 2.0}], "dataset": str(own)},
        {"process": [{"type": "scale_weights", "factor": 3.0}]},
    ]
    with caplog.at_level("WARNING", logger="msquant.config.spec"):
        run = msquant.quantize(
            tiny_llama, tmp_path / "prior", cfg(prior, MINMAX, W8A8, runner=runner),
            calib_path=CALIB_TXT, progress=False, registry=registry(),
        )  # fmt: skip
    assert len(run.quantized_modules) == 14
    assert ScaleWeights.seen == []  # neither stage ran: no setup, no layer
    mine = weights_of(tmp_path / "prior")
    plain = weights_of(_plain_export(tiny_llama, tmp_path, runner))
    assert mine.keys() == plain.keys()
    assert [n for n in mine if not torch.equal(mine[n], plain[n])] == []
    notes = [r.getMessage() for r in caplog.records if "is not run" in r.getMessage()]
    assert len(notes) == 2
    assert NOTE.format(kinds="scale_weights") in notes[0]
    assert notes[1].startswith("<mapping>: spec.prior[1] (scale_weights) is not run")
    assert notes[0].endswith("Move the entries into spec.process to apply them")


def test_a_prior_smoothing_stage_changes_nothing(tiny_llama: Path, tmp_path: Path) -> None:
    """msModelSlim's own case (tests/oracle: bit-identical to its export): ``iter_smooth`` in a
    prior stage, W8A8_DYNAMIC in spec.process, exports what W8A8_DYNAMIC alone exports."""
    dynamic = copy.deepcopy(MINMAX)
    dynamic["qconfig"]["act"] = {
        "dtype": "int8", "scope": "per_token", "symmetric": True, "method": "minmax"
    }  # fmt: skip
    smooth = {"type": "iter_smooth", "alpha": 0.9}
    for name, prior, process in (
        ("prior", [{"process": [smooth]}], [dynamic]),
        ("plain", [], [dynamic]),
        ("smoothed", [], [smooth, dynamic]),
    ):
        msquant.quantize(
            tiny_llama, tmp_path / name, cfg(prior, *process), calib_path=CALIB_TXT,
            progress=False,
        )  # fmt: skip
    mine, plain = weights_of(tmp_path / "prior"), weights_of(tmp_path / "plain")
    assert [n for n in mine if not torch.equal(mine[n], plain[n])] == []
    norm = "model.layers.0.input_layernorm.weight"
    assert not torch.equal(weights_of(tmp_path / "smoothed")[norm], plain[norm])


def _plain_export(model: Path, tmp_path: Path, runner: str) -> Path:
    out = tmp_path / "plain"
    msquant.quantize(
        model, out, cfg([], MINMAX, W8A8, runner=runner), calib_path=CALIB_TXT, progress=False
    )
    return out


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
        "registered process types: dynamic_cache, fa3_quant, flex_awq_ssz, flex_smooth_quant, "
        "float_sparse, group, "
        "iter_smooth, linear_quant, online_quarot, quarot, smooth_quant"
        in found["spec.prior[1].process[1].type"]
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


def test_a_prior_processor_that_cannot_apply_is_refused_before_loading(
    tiny_llama: Path, tmp_path: Path
) -> None:
    """msModelSlim would run the stage and fail; msquant refuses before any weight loads."""
    prior = [{"process": [{"type": "iter_smooth", "include": ["*.no_such_norm"]}]}]
    with pytest.raises(msquant.QuantizationError) as info:
        msquant.quantize(
            tiny_llama, tmp_path / "out", cfg(prior, MINMAX), calib_path=CALIB_TXT,
            progress=False,
        )  # fmt: skip
    assert "the spec.prior stages cannot be applied to this model (1 problem)" in str(info.value)
    assert "spec.prior[0]: iter_smooth: no subgraph to smooth in LlamaForCausalLM" in str(
        info.value
    )
    assert not (tmp_path / "out").exists()


def test_validation_warns_about_each_prior_stage(caplog: pytest.LogCaptureFixture) -> None:
    data = cfg([{"process": [MINMAX, {"type": "iter_smooth"}]}], MINMAX)
    with caplog.at_level("WARNING", logger="msquant.config.spec"):
        validate_config(data, msquant.plugin.default_registry(), "x.yaml")
    (note,) = [r.getMessage() for r in caplog.records]
    assert note.startswith("x.yaml: " + NOTE.format(kinds="linear_quant, iter_smooth"))
