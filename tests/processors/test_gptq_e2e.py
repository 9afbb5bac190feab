"""GPTQ through the whole pipeline: the user's two msModelSlim YAMLs run unchanged on a tiny model.

With ``ext.numerics: msmodelslim`` the runner feeds every linear layer the float model's
activations (msModelSlim's schedule) and GPTQ runs without act-order, so the export must equal,
code for code, msModelSlim-style GPTQ run directly on Hessians built from the float model's own
forward over the same calibration samples. With the default numerics each layer is calibrated on
the outputs of the already quantized previous layers, with act-order: the export must equal GPTQ
run directly (act-order on) on Hessians built from a forward of the model whose earlier layers
hold the export's dequantized weights; and it must differ from the msModelSlim run.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from ascend_reader import AscendExport, read_ascend_export
from conftest import CALIB_TXT, EXAMPLES, CliResult
from torch import nn

import msquant
import msquant.plugin
import msquant.plugin.numerics
from msquant.load.calibration import read_calibration_texts, tokenize_samples
from msquant.load.model_folder import load_causal_lm, load_tokenizer
from msquant.processors.methods.gptq import GPTQExt
from msquant.run.capture import batch_samples

SEED_YAMLS = ["w8a16_per_channel_gptq.yaml", "w8a16_per_group_gptq.yaml"]
GPTQ_YAMLS = [*SEED_YAMLS, "w8a16_per_group64_gptq_asym.yaml"]


@pytest.fixture(scope="module")
def tiny_llama_128(tiny_model_factory: Callable[..., Path]) -> Path:
    """hidden 128 / intermediate 256: the seed YAMLs' group_size 128 divides every layer."""
    return tiny_model_factory("llama", hidden_size=128, intermediate_size=256)


def _layer_inputs(
    model_dir: Path, max_tokens: int, export: AscendExport | None = None
) -> dict[str, list[torch.Tensor]]:
    """Inputs of every decoder linear layer per calibration batch (equal-length samples stacked
    as the runner stacks them: the same rows, and the same float summation order in every
    product), in a forward of the float model, or with ``export``, layer by layer: the inputs of
    layer ``L`` come from a forward in which layers ``0 .. L-1`` hold the export's dequantized
    weights (layer ``L`` itself still float)."""
    model = load_causal_lm(model_dir)
    samples = tokenize_samples(
        read_calibration_texts(CALIB_TXT), load_tokenizer(model_dir), max_tokens
    )
    layers = model.model.layers
    inputs: dict[str, list[torch.Tensor]] = {}
    for index in range(len(layers)):
        handles = []
        for sub, module in layers[index].named_modules():
            if isinstance(module, nn.Linear):
                name = f"model.layers.{index}.{sub}"

                def record(
                    _: nn.Module, args: tuple[torch.Tensor, ...], __: object, name: str = name
                ) -> None:
                    inputs.setdefault(name, []).append(args[0].detach().clone())

                handles.append(module.register_forward_hook(record))
        with torch.no_grad():
            for ids in batch_samples(samples):
                model(input_ids=ids)
        for handle in handles:
            handle.remove()
        if export is not None:  # the next layer sees this one quantized
            with torch.no_grad():
                for sub, module in layers[index].named_modules():
                    if isinstance(module, nn.Linear):
                        module.weight.copy_(export.dequantized(f"model.layers.{index}.{sub}"))
    return inputs


def _run_example(
    example: str, numerics: str | None, model_dir: Path, save: Path, run: Callable[..., CliResult]
) -> tuple[dict[str, Any], AscendExport]:
    """Run an example YAML (with ``ext.numerics`` set unless None) through the CLI; returns its
    ``qconfig.weight`` and the export."""
    config = yaml.safe_load((EXAMPLES / example).read_text())
    weight_cfg = config["spec"]["process"][0]["qconfig"]["weight"]
    if numerics is not None:
        weight_cfg["ext"]["numerics"] = numerics
    path = save.parent / f"{save.name}.yaml"
    path.write_text(yaml.safe_dump(config))
    result = run(
        "quant", "--model_path", model_dir, "--save_path", save, "--config_path", path,
        "--calib_path", CALIB_TXT, "--max_calib_tokens", "48", "--no_progress",
    )  # fmt: skip
    assert result.code == 0, result.err
    return weight_cfg, read_ascend_export(save)


@pytest.mark.parametrize("numerics", ["msmodelslim", None])
@pytest.mark.parametrize("example", GPTQ_YAMLS)
def test_seed_yaml_runs_and_matches_direct_gptq(
    example: str,
    numerics: str | None,
    tiny_llama_128: Path,
    tmp_path: Path,
    run_cli: Callable[..., CliResult],
) -> None:
    weight_cfg, export = _run_example(example, numerics, tiny_llama_128, tmp_path / "out", run_cli)
    ext = copy.deepcopy(weight_cfg["ext"])
    resolved = GPTQExt.model_validate(ext)
    per_group = weight_cfg["scope"] == "per_group"
    original = load_causal_lm(tiny_llama_128).state_dict()
    quantized_inputs = resolved.resolved_calib_inputs() == "quantized"
    assert quantized_inputs == (numerics is None)  # the default calibrates on quantized outputs
    inputs = _layer_inputs(tiny_llama_128, 48, export if quantized_inputs else None)
    assert sorted(export.quantized_modules()) == sorted(inputs)
    assert export.description["group_size"] == (ext["group_size"] if per_group else 0)

    bits = 8
    options = {
        key: value
        for key, value in ext.items()
        if key not in ("group_size", "numerics", "static_groups")
    }
    options.update(
        desc_act=resolved.resolved_desc_act(), full_range=resolved.resolved_full_range(bits)
    )
    assert options["desc_act"] == (numerics is None or bool(ext.get("desc_act")))
    for module, xs in inputs.items():
        weight = original[f"{module}.weight"]
        symmetric = weight_cfg.get("symmetric", True)
        gptq: (
            msquant.plugin.numerics.WeightPerChannelGPTQ
            | msquant.plugin.numerics.WeightPerGroupGPTQ
        )
        if per_group:
            gptq = msquant.plugin.numerics.WeightPerGroupGPTQ(
                symmetric=symmetric,
                group_size=ext["group_size"],
                static_groups=resolved.resolved_static_groups(),
                name=module,
                **options,
            )
        else:
            gptq = msquant.plugin.numerics.WeightPerChannelGPTQ(
                symmetric=symmetric, name=module, **options
            )
        for x in xs:
            gptq.add_batch(x)
        direct = gptq.quantize(weight).quantized
        codes = export.tensors[f"{module}.weight"]
        assert codes.dtype == torch.int8
        mismatched = int((codes != direct.codes).sum())
        assert mismatched <= max(2, codes.numel() // 5000), f"{module}: {mismatched} codes differ"
        torch.testing.assert_close(
            export.tensors[f"{module}.weight_scale"], direct.scale, rtol=1e-6, atol=0
        )
        # GPTQ beats round-to-nearest on the calibration activations it was fitted to
        x = torch.cat([t.reshape(-1, t.shape[-1]) for t in xs])
        rtn = msquant.plugin.numerics.quantize_weight_minmax(
            weight, 8, True, ext["group_size"] if per_group else None
        )
        reference = x @ weight.T
        gptq_err = (x @ export.dequantized(module).T - reference).norm()
        rtn_err = (x @ rtn.dequantize().T - reference).norm()
        assert gptq_err <= rtn_err * 1.0001, f"{module}: GPTQ {gptq_err:.3g} > RTN {rtn_err:.3g}"


def test_default_numerics_differ_from_msmodelslim(
    tiny_llama_128: Path, tmp_path: Path, run_cli: Callable[..., CliResult]
) -> None:
    """The switch matters: the seed YAML unchanged and with ``numerics: msmodelslim`` give
    different codes in the second layer (act-order, and its inputs come from the quantized first
    layer) and in the first (act-order)."""
    example = SEED_YAMLS[0]
    _, default = _run_example(example, None, tiny_llama_128, tmp_path / "default", run_cli)
    _, msmodelslim = _run_example(example, "msmodelslim", tiny_llama_128, tmp_path / "ms", run_cli)
    for layer in (0, 1):
        name = f"model.layers.{layer}.mlp.down_proj.weight"
        differing = int((default.tensors[name] != msmodelslim.tensors[name]).sum())
        assert differing > default.tensors[name].numel() // 100, (name, differing)


def test_per_group_seed_yaml_names_the_layer_when_group_size_does_not_divide(
    tiny_llama: Path, tmp_path: Path, run_cli: Callable[..., CliResult]
) -> None:
    """hidden 64: group_size 128 cannot divide; refused before weights load, layer and choices named."""
    result = run_cli(
        "quant", "--model_path", tiny_llama, "--save_path", tmp_path / "out",
        "--config_path", EXAMPLES / "w8a16_per_group_gptq.yaml", "--calib_path", CALIB_TXT,
    )  # fmt: skip
    assert result.code == 2
    assert (
        "model.layers.0.self_attn.q_proj: group_size 128 does not divide in_features 64"
        in result.err
    )
    assert "valid group sizes: 1, 2, 4, 8, 16, 32, 64" in result.err
    assert not (tmp_path / "out").exists()


def test_modules_reading_the_same_input_share_one_hessian() -> None:
    """q/k/v (and gate/up) read one tensor: one Hessian is accumulated and shared, consistently."""
    from msquant.processors.linear_quant.config import LinearQuantConfig
    from msquant.processors.linear_quant.processor import LinearQuantProcessor

    config = LinearQuantConfig.model_validate({"qconfig": {"weight": {"method": "gptq"}}})
    proc = LinearQuantProcessor(config)
    collector = proc._collector
    collector.quantizers = {
        n: msquant.plugin.numerics.WeightPerChannelGPTQ(name=n) for n in ("q", "k", "o")
    }
    for _ in range(2):
        shared, other = torch.randn(5, 8), torch.randn(5, 8)
        collector.accumulate("q", shared)
        collector.accumulate("k", shared)
        collector.accumulate("o", other)
    quantizers = collector.quantizers
    assert quantizers["k"].accumulator is quantizers["q"].accumulator
    assert quantizers["o"].accumulator is not quantizers["q"].accumulator
    assert quantizers["q"].nsamples == quantizers["o"].nsamples == 10
    collector.accumulate("q", torch.randn(5, 8))
    with pytest.raises(RuntimeError, match="k: its input is no longer the input of q"):
        collector.accumulate("k", torch.randn(5, 8))


def _true_sequential_inputs(
    model_dir: Path, max_tokens: int, export: AscendExport
) -> dict[str, list[torch.Tensor]]:
    """Inputs of every decoder linear with float calibration inputs and ``true_sequential``: the
    float model's forward, except that a layer's MLP linears read the output of that layer's
    attention holding the export's dequantized weights (the earlier layers stay float)."""
    floating = _layer_inputs(model_dir, max_tokens)
    model = load_causal_lm(model_dir)
    samples = tokenize_samples(
        read_calibration_texts(CALIB_TXT), load_tokenizer(model_dir), max_tokens
    )
    inputs = {name: xs for name, xs in floating.items() if ".self_attn." in name}
    for index, layer in enumerate(model.model.layers):
        originals = {}
        with torch.no_grad():
            for sub, module in layer.self_attn.named_modules():
                if isinstance(module, nn.Linear):
                    originals[sub] = module.weight.detach().clone()
                    module.weight.copy_(export.dequantized(f"model.layers.{index}.self_attn.{sub}"))
        handles = []
        for sub, module in layer.mlp.named_modules():
            if isinstance(module, nn.Linear):
                name = f"model.layers.{index}.mlp.{sub}"

                def record(
                    _: nn.Module, args: tuple[torch.Tensor, ...], __: object, name: str = name
                ) -> None:
                    inputs.setdefault(name, []).append(args[0].detach().clone())

                handles.append(module.register_forward_hook(record))
        with torch.no_grad():
            for ids in batch_samples(samples):
                model(input_ids=ids)
            for sub, weight in originals.items():  # later layers see the float model again
                layer.self_attn.get_submodule(sub).weight.copy_(weight)
        for handle in handles:
            handle.remove()
    return inputs


def test_true_sequential_calibrates_the_mlp_on_the_quantized_attention(
    tiny_llama_128: Path, tmp_path: Path, run_cli: Callable[..., CliResult]
) -> None:
    """``true_sequential: true`` (here with msModelSlim's numerics otherwise): the attention's
    linears equal GPTQ on the float model's inputs, the MLP's equal GPTQ on inputs computed
    through the quantized attention of the same layer, and differ from the plain run's."""
    config = yaml.safe_load((EXAMPLES / SEED_YAMLS[0]).read_text())
    weight_cfg = config["spec"]["process"][0]["qconfig"]["weight"]
    weight_cfg["ext"].update(numerics="msmodelslim", true_sequential=True)
    path = tmp_path / "ts.yaml"
    path.write_text(yaml.safe_dump(config))
    result = run_cli(
        "quant", "--model_path", tiny_llama_128, "--save_path", tmp_path / "out",
        "--config_path", path, "--calib_path", CALIB_TXT, "--max_calib_tokens", "48",
        "--no_progress",
    )  # fmt: skip
    assert result.code == 0, result.err
    export = read_ascend_export(tmp_path / "out")
    _, plain = _run_example(
        SEED_YAMLS[0], "msmodelslim", tiny_llama_128, tmp_path / "plain", run_cli
    )
    original = load_causal_lm(tiny_llama_128).state_dict()
    inputs = _true_sequential_inputs(tiny_llama_128, 48, export)
    assert sorted(inputs) == sorted(export.quantized_modules())
    for module, xs in inputs.items():
        gptq = msquant.plugin.numerics.WeightPerChannelGPTQ(
            name=module, percdamp=0.01, block_size=128
        )
        for x in xs:
            gptq.add_batch(x)
        direct = gptq.quantize(original[f"{module}.weight"]).quantized
        codes = export.tensors[f"{module}.weight"]
        mismatched = int((codes != direct.codes).sum())
        assert mismatched <= max(2, codes.numel() // 5000), f"{module}: {mismatched} codes differ"
        changed = int((codes != plain.tensors[f"{module}.weight"]).sum())
        if ".mlp." in module:
            assert changed > codes.numel() // 1000, (module, changed)
        else:
            assert changed == 0, module  # the attention is calibrated as in the plain run
