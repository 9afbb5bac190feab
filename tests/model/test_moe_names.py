"""Mixtral-style MoE checkpoints: exports name every tensor as the original checkpoint does.

transformers 5 loads Mixtral's ``block_sparse_moe.experts.<e>.{w1,w3,w2}`` and
``block_sparse_moe.gate`` into ``mlp.experts`` / ``mlp.gate``; msquant splits the experts into
``mlp.experts.<e>.{gate,up,down}_proj`` linears. Every exporter must write the checkpoint's names
again (tensors and the module names of its metadata), so that vLLM, vLLM-Ascend, MindIE and
transformers load the export as they load the original model. The expected names are spelled out
here by hand (Mixtral's layout), independently of msquant's mapping.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, ClassVar, Literal

import pytest
import torch
from ascend_reader import read_ascend_export
from conftest import CALIB_TXT, NEEDS_MOE_TRANSFORMERS
from safetensors import safe_open

import msquant
import msquant.plugin
from msquant import verify_export
from msquant.plugin import (
    DecoderLayer,
    Processor,
    ProcessorConfig,
    QuantizedLinear,
    QuantizedWeight,
    RunContext,
)
from msquant.run.checkpoint.folder import RunCheckpoints
from msquant.run.checkpoint.layout import PROGRESS_FILE, partial_path

pytestmark = NEEDS_MOE_TRANSFORMERS

SAVERS = ("ascendv1_saver", "gptq_saver", "compressed_tensors", "mindie_format_saver")
NUM_EXPERTS = 4
#: Mixtral's projection names on disk.
DISK_ROLES = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}
#: The tensors each format stores for a quantized linear in place of its ``weight``.
QUANTIZED_LEAVES = {
    "ascendv1_saver": ("weight", "weight_scale", "weight_offset"),
    "mindie_format_saver": ("weight", "weight_scale", "weight_offset"),
    "gptq_saver": ("qweight", "qzeros", "scales", "g_idx"),
    "compressed_tensors": ("weight_packed", "weight_scale", "weight_shape"),
}
IDS = torch.tensor([[5, 17, 42, 99, 7, 250, 3, 64, 128, 11, 300, 2]])


def mixtral_disk_name(name: str) -> str:
    """Mixtral's checkpoint name of a module (or tensor) of msquant's loaded model."""
    name = re.sub(
        r"\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)(?=\.|$)",
        lambda m: f".block_sparse_moe.experts.{m[1]}.{DISK_ROLES[m[2]]}",
        name,
    )
    return re.sub(r"\.mlp\.gate(?=\.|$)", ".block_sparse_moe.gate", name)


# -- a process step that keeps the in-memory result --------------------------------------------

CAPTURED: dict[str, dict[str, QuantizedWeight]] = {}


class _CaptureConfig(ProcessorConfig):
    type: Literal["capture_qweights"] = "capture_qweights"
    key: str


class _Capture(Processor):
    """Copies every quantized linear of each finished layer into ``CAPTURED[key]``, under
    msquant's module names (runs after ``linear_quant``, before the layer is released)."""

    type_name: ClassVar[str] = "capture_qweights"
    config_class = _CaptureConfig
    stage = "process"
    resumable = True  # it changes nothing; resumed runs simply capture fewer layers
    config: _CaptureConfig

    def after_layer(self, ctx: RunContext, layer: DecoderLayer) -> None:
        store = CAPTURED.setdefault(self.config.key, {})
        for name, module in layer.module.named_modules(prefix=layer.name):
            if isinstance(module, QuantizedLinear):
                q = module.qweight
                store[name] = QuantizedWeight(
                    q.codes.clone(), q.scale.clone(), q.offset.clone(), q.bits, q.symmetric,
                    q.group_size,
                )  # fmt: skip


def _registry() -> msquant.plugin.ProcessorRegistry:
    registry = msquant.plugin.default_registry()
    registry.register(_Capture)
    return registry


def _config(runner: str, key: str, savers: tuple[str, ...], mixed: bool) -> dict[str, Any]:
    """GPTQ int4 group 32 symmetric everywhere; ``mixed``: layer 1's attention in int8 and its
    experts left in float, so that the metadata (GPTQ dynamic rules, compressed-tensors config
    groups and ignore, Ascend types) names modules, experts included."""
    weight = {
        "dtype": "int4",
        "scope": "per_group",
        "symmetric": True,
        "method": "gptq",
        "ext": {"group_size": 32},
    }
    entry: dict[str, Any] = {"type": "linear_quant", "qconfig": {"weight": weight}}
    if mixed:
        entry["dynamic"] = {r"model\.layers\.1\.self_attn\..*": {"bits": 8}}
        entry["exclude"] = ["model.layers.1.mlp.experts.*"]
    return {
        "apiversion": "modelslim_v1",
        "spec": {
            "runner": runner,
            "process": [entry, {"type": "capture_qweights", "key": key}],
            "save": [{"type": saver} for saver in savers],
        },
    }


def _quantize(
    model: Path,
    save: Path,
    runner: str = "layer_wise",
    key: str = "mixed",
    savers: tuple[str, ...] = SAVERS,
    mixed: bool = True,
    **kwargs: Any,
) -> dict[str, QuantizedWeight]:
    """Run the pipeline; returns the in-memory quantized weights it captured."""
    CAPTURED.pop(key, None)
    msquant.quantize(
        model,
        save,
        _config(runner, key, savers, mixed),
        calib_path=CALIB_TXT,
        max_calib_tokens=24,
        progress=False,
        registry=_registry(),
        **kwargs,
    )
    return CAPTURED.pop(key, {})


@pytest.fixture(scope="module")
def mixtral(tiny_model_factory: Callable[..., Path]) -> Path:
    return tiny_model_factory("mixtral", num_layers=2, intermediate_size=32)


Export = tuple[Path, dict[str, QuantizedWeight]]


@pytest.fixture(scope="module")
def exports(mixtral: Path, tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Export]:
    """The export folder of a runner (the four savers in one run, mixed config) and the
    run's in-memory quantized weights."""
    cache: dict[str, Export] = {}

    def run(runner: str) -> Export:
        if runner not in cache:
            save = tmp_path_factory.mktemp(runner) / "out"
            cache[runner] = (save, _quantize(mixtral, save, runner, key=runner))
        return cache[runner]

    return run


def _tensor_names(folder: Path) -> set[str]:
    names: set[str] = set()
    for path in folder.glob("*.safetensors"):
        with safe_open(str(path), framework="pt") as handle:
            names.update(handle.keys())
    return names


def _expected_names(original: set[str], quantized: set[str], saver: str) -> set[str]:
    """The original checkpoint's names, each quantized module's ``weight`` replaced by the
    format's tensors."""
    expected = original - {f"{module}.weight" for module in quantized}
    return expected | {f"{m}.{leaf}" for m in quantized for leaf in QUANTIZED_LEAVES[saver]}


LAYER1_EXPERTS = [
    f"model.layers.1.block_sparse_moe.experts.{e}.{role}"
    for e in range(NUM_EXPERTS)
    for role in DISK_ROLES.values()
]


@pytest.mark.parametrize("runner", ["layer_wise", "model_wise"])
def test_every_export_uses_the_checkpoints_names(
    runner: str, mixtral: Path, exports: Callable[[str], Export]
) -> None:
    """Exactly the original checkpoint's tensor names, quantized weights replaced by the format's
    tensors; the export reads back equal to the in-memory result and to the original's floats."""
    save, in_memory = exports(runner)
    quantized = {mixtral_disk_name(name) for name in in_memory}
    assert "model.layers.0.block_sparse_moe.experts.3.w1" in quantized
    # every linear but layer 1's experts (the router is not a Linear)
    assert len(quantized) == 2 * 4 + 3 * NUM_EXPERTS
    original = _tensor_names(mixtral)
    assert "model.layers.1.block_sparse_moe.gate.weight" in original
    for saver in SAVERS:
        folder = save / saver
        names = _tensor_names(folder)
        assert names == _expected_names(original, quantized, saver), saver
        assert not any(".mlp." in name for name in names), saver
        for index in folder.glob("*.index.json"):
            assert set(json.loads(index.read_text())["weight_map"]) == names
        report = verify_export(folder, reference=_disk_keyed(in_memory), model_path=mixtral)
        assert report.ok, (saver, report.errors)
        assert {layer.name for layer in report.layers} == quantized


def _disk_keyed(weights: dict[str, QuantizedWeight]) -> dict[str, QuantizedWeight]:
    return {mixtral_disk_name(name): weight for name, weight in weights.items()}


def test_ascend_description_and_dequantized_experts(exports: Callable[[str], Export]) -> None:
    save, in_memory = exports("layer_wise")
    export = read_ascend_export(save / "ascendv1_saver")
    types = export.types
    assert set(types) == set(export.tensors)  # every stored tensor described, by its own name
    prefix = "model.layers.0.block_sparse_moe"
    assert types[f"{prefix}.experts.2.w3.weight"] == "W4A16"
    assert types[f"{prefix}.experts.2.w3.weight_offset"] == "W4A16"
    assert types[f"{prefix}.gate.weight"] == "FLOAT"
    assert types["model.layers.1.block_sparse_moe.experts.0.w2.weight"] == "FLOAT"
    assert types["model.layers.1.self_attn.k_proj.weight_scale"] == "W8A16"
    experts = [name for name in in_memory if ".mlp.experts." in name]
    assert len(experts) == NUM_EXPERTS * 3
    for name in experts:
        torch.testing.assert_close(
            export.dequantized(mixtral_disk_name(name)),
            in_memory[name].dequantize(),
            rtol=0,
            atol=0,
            msg=name,
        )
    mindie = read_ascend_export(
        save / "mindie_format_saver",
        "quant_model_weight_w4a16",
        "quant_model_description_w4a16.json",
    )
    assert mindie.description == export.description
    assert set(mindie.tensors) == set(export.tensors)


def _rule_targets(rules: dict[str, Any], sign: str, names: list[str]) -> set[str]:
    """Which of ``names`` the GPTQ ``dynamic`` rules of ``sign`` (``+`` or ``-``) match."""
    patterns = [rule[2:] for rule in rules if rule.startswith(f"{sign}:")]
    return {name for name in names if any(re.match(p, name) for p in patterns)}


def test_gptq_and_compressed_tensors_metadata_name_disk_modules(
    exports: Callable[[str], Export],
) -> None:
    save, _ = exports("layer_wise")
    gptq = json.loads((save / "gptq_saver" / "config.json").read_text())["quantization_config"]
    assert (gptq["bits"], gptq["group_size"]) == (4, 32)
    rules = gptq["dynamic"]
    assert not any("mlp" in rule for rule in rules), rules
    # vLLM matches the fused names: q/k/v as qkv_proj, Mixtral's w1/w3 as w13
    experts = [
        f"model.layers.{i}.block_sparse_moe.experts.{e}.{p}"
        for i in (0, 1)
        for e in range(NUM_EXPERTS)
        for p in ("w13", "w2")
    ]
    attention = [f"model.layers.{i}.self_attn.{p}" for i in (0, 1) for p in ("qkv_proj", "o_proj")]
    layer1 = {name for name in experts + attention if ".layers.1." in name}
    assert _rule_targets(rules, "-", experts + attention) == layer1 - set(attention)
    # vLLM's FusedMoE looks the rules up by the experts module's name
    modules = [f"model.layers.{i}.block_sparse_moe.experts" for i in (0, 1)]
    assert _rule_targets(rules, "-", modules) == {modules[1]}
    assert _rule_targets(rules, "-", LAYER1_EXPERTS) == set(LAYER1_EXPERTS)  # GPTQModel's names
    assert _rule_targets(rules, "+", attention) == layer1 & set(attention)
    assert {value.get("bits") for rule, value in rules.items() if rule[0] == "+"} == {8}

    ct = json.loads((save / "compressed_tensors" / "config.json").read_text())
    ct_config = ct["quantization_config"]
    by_bits = {g["weights"]["num_bits"]: g["targets"] for g in ct_config["config_groups"].values()}
    assert by_bits == {
        4: ["Linear"],
        8: [f"model.layers.1.self_attn.{p}" for p in ("q_proj", "k_proj", "v_proj", "o_proj")],
    }
    routers = {f"model.layers.{i}.block_sparse_moe.gate" for i in (0, 1)}
    assert set(ct_config["ignore"]) == {*LAYER1_EXPERTS, *routers, "lm_head"}


def _float_logits(model_dir: Path, weights: dict[str, torch.Tensor]) -> torch.Tensor:
    """Logits of the original model (transformers' fused experts) with the given weights (keyed
    by Mixtral's disk module names) put in place by hand: w1 is the first (gate) half of an
    expert's ``gate_up_proj``, w3 the second (up) half, w2 its ``down_proj``."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir)).eval()
    with torch.no_grad():
        for disk, weight in weights.items():
            match = re.fullmatch(r"(.+)\.block_sparse_moe\.experts\.(\d+)\.(w[123])", disk)
            if match is None:
                model.get_submodule(disk).weight.copy_(weight)
                continue
            experts = model.get_submodule(f"{match[1]}.mlp.experts")
            expert, role = int(match[2]), match[3]
            inter = experts.down_proj.shape[-1]
            if role == "w2":
                experts.down_proj[expert].copy_(weight)
            else:
                rows = slice(0, inter) if role == "w1" else slice(inter, 2 * inter)
                experts.gate_up_proj[expert, rows].copy_(weight)
        return model(IDS).logits.float()


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def test_transformers_loads_the_compressed_tensors_export(mixtral: Path, tmp_path: Path) -> None:
    """transformers maps the per-expert w1/w3/w2 tensors back into its fused experts, as it does
    for the original checkpoint; the logits are the in-memory quantized model's.

    One scheme for every linear: transformers 5.24 dequantizes the fused experts of a
    compressed-tensors checkpoint with one config group's scheme, and cannot merge float experts
    with quantized ones (whatever the names: Qwen3-MoE exports fail alike)."""
    pytest.importorskip("compressed_tensors")
    from transformers import AutoModelForCausalLM

    save = tmp_path / "out"
    in_memory = _quantize(mixtral, save, key="uniform", savers=("compressed_tensors",), mixed=False)
    assert len(in_memory) == 2 * (4 + 3 * NUM_EXPERTS)
    loaded = AutoModelForCausalLM.from_pretrained(str(save)).eval()
    with torch.no_grad():
        logits = loaded(IDS).logits.float()
    dequantized = {mixtral_disk_name(n): w.dequantize() for n, w in in_memory.items()}
    expected = _float_logits(mixtral, dequantized)
    assert _relative(logits, expected) <= 1e-5
    # a mix-up of w1 and w3 (gate and up) would show: the logits move by far more than that
    swap = {"w1": "w3", "w3": "w1"}
    swapped = {re.sub(r"w[13]$", lambda m: swap[m[0]], n): w for n, w in dequantized.items()}
    assert _relative(_float_logits(mixtral, swapped), expected) > 1e-3  # measured 1e-2


def _same_files(got: Path, expected: Path, skip: tuple[str, ...] = ()) -> None:
    """The savers' folders hold the same files, byte for byte (those ending with ``skip``
    aside)."""
    for saver in SAVERS:
        files = sorted(p.name for p in (expected / saver).iterdir())
        assert files == sorted(p.name for p in (got / saver).iterdir()), saver
        assert any(name.endswith(".safetensors") for name in files)
        for name in files:
            if name.endswith(skip):
                continue
            same = (got / saver / name).read_bytes() == (expected / saver / name).read_bytes()
            assert same, f"{saver}/{name} differs"


def test_streamed_and_whole_model_exports_are_identical(exports: Callable[[str], Export]) -> None:
    # the config copied beside the Ascend weights names its runner
    _same_files(exports("model_wise")[0], exports("layer_wise")[0], skip=("_best_practice.yaml",))


@contextmanager
def _killed_after_layer(index: int) -> Iterator[None]:
    """Interrupt the run right after the checkpoint of decoder layer ``index``."""
    commit_layer = RunCheckpoints.commit_layer

    def commit_then_die(self: RunCheckpoints, ctx: RunContext, *args: Any) -> None:
        commit_layer(self, ctx, *args)
        if args[1].index == index:
            raise KeyboardInterrupt

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(RunCheckpoints, "commit_layer", commit_then_die)
        with pytest.raises(KeyboardInterrupt):
            yield


def test_killed_mixtral_run_resumes_to_the_same_export(
    mixtral: Path, exports: Callable[[str], Export], tmp_path: Path
) -> None:
    """Savers record model names in their checkpoints and write disk names: a run killed after
    layer 0 and resumed writes the uninterrupted run's files."""
    save = tmp_path / "out"
    with _killed_after_layer(0):
        _quantize(mixtral, save, key="layer_wise")
    assert (partial_path(save) / PROGRESS_FILE).is_file()
    _quantize(mixtral, save, key="layer_wise", resume=True)
    _same_files(save, exports("layer_wise")[0])


def test_disk_name_maps_modules_and_their_tensors_and_keeps_the_rest() -> None:
    from msquant.contracts.context import DiskNamed, disk_name
    from msquant.model.checkpoint_names import CheckpointNames

    expert = "model.layers.0.mlp.experts.1.up_proj"
    names = CheckpointNames(
        tensors={f"{expert}.weight": mixtral_disk_name(f"{expert}.weight")},
        modules={expert: mixtral_disk_name(expert)},
    )
    assert disk_name(names, expert) == "model.layers.0.block_sparse_moe.experts.1.w3"
    assert (
        disk_name(names, f"{expert}.qzeros")
        == "model.layers.0.block_sparse_moe.experts.1.w3.qzeros"
    )
    assert disk_name(names, "model.layers.0") == "model.layers.0"  # no tensors: kept
    assert disk_name(None, f"{expert}.qzeros") == f"{expert}.qzeros"

    reads: list[str] = []

    class Lazy(dict[str, int]):
        def __getitem__(self, key: str) -> int:
            reads.append(key)
            return super().__getitem__(key)

    view = DiskNamed(Lazy({expert: 1, "lm_head": 2}), lambda n: disk_name(names, n))
    assert sorted(view) == ["lm_head", "model.layers.0.block_sparse_moe.experts.1.w3"]
    assert reads == []  # keys only until a value is asked for
    assert view["model.layers.0.block_sparse_moe.experts.1.w3"] == 1 and reads == [expert]
    assert expert not in view
    with pytest.raises(
        ValueError, match="lm_head and model.layers.0.mlp.experts.1.up_proj are both"
    ):
        DiskNamed({expert: 1, "lm_head": 2}, lambda n: "same")


def test_writer_stores_renamed_tensors_and_restores_them(tmp_path: Path) -> None:
    from msquant.plugin.export import ShardedSafetensorsWriter

    first = ShardedSafetensorsWriter(tmp_path, "model", 1 << 20, rename=mixtral_disk_name)
    first.add("model.layers.0.mlp.experts.2.down_proj.qweight", torch.zeros(2, dtype=torch.int32))
    state = json.loads(json.dumps(first.state()))  # as a checkpoint holds it
    with pytest.raises(
        ValueError, match=r"stored as 'model.layers.0.block_sparse_moe.gate.weight'"
    ):
        first.add("model.layers.0.block_sparse_moe.gate.weight", torch.zeros(1))
        first.add("model.layers.0.mlp.gate.weight", torch.zeros(1))
    # a resumed run's writer continues from the stored names
    resumed = ShardedSafetensorsWriter(tmp_path, "model", 1 << 20, rename=mixtral_disk_name)
    resumed.restore(state)
    resumed.add("model.layers.0.mlp.gate.weight", torch.ones(1))
    weight_map = resumed.close()
    assert sorted(weight_map) == [
        "model.layers.0.block_sparse_moe.experts.2.w2.qweight",
        "model.layers.0.block_sparse_moe.gate.weight",
    ]
    assert _tensor_names(tmp_path) == set(weight_map)


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe"])
def test_moe_exports_are_evaluated_from_their_files(
    arch: str, tiny_model_factory: Callable[..., Path], tmp_path: Path
) -> None:
    """``msquant eval`` on an MoE export rebuilds the model, splits its experts and reads every
    expert (under the checkpoint's names) back: the perplexity is the in-memory quantized
    model's, which a whole-model run evaluates directly."""
    model_dir = tiny_model_factory(arch, num_layers=2, intermediate_size=32)
    config = _config("model_wise", f"eval-{arch}", ("ascendv1_saver", "gptq_saver"), mixed=False)
    config["spec"]["process"] = config["spec"]["process"][:1]
    result = msquant.quantize(
        model_dir, tmp_path / "out", config, calib_path=CALIB_TXT, max_calib_tokens=24,
        progress=False, eval_data=CALIB_TXT, eval_seqlen=16,
    )  # fmt: skip
    assert result.report.evaluation is not None
    in_memory = result.report.evaluation.nll
    for saver in ("ascendv1_saver", "gptq_saver"):
        read_back = msquant.evaluate_perplexity(tmp_path / "out" / saver, CALIB_TXT, seqlen=16)
        assert read_back.nll == pytest.approx(in_memory, rel=1e-5), saver
