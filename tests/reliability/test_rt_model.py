"""Red-team replays: damaged, inconsistent and hostile model folders (M-rows).

Before issue 14 most of these exited 0 with a wrong export (transformers initialised what the
checkpoint lacked at random and dropped what it did not expect) or crashed with a traceback.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from replay import Cli, quant_args, replay
from safetensors.torch import load_file, save_file


def _edit_weights(model: Path, edit: object) -> None:
    file = model / "model.safetensors"
    tensors = load_file(file)
    edit(tensors)  # type: ignore[operator]
    save_file(tensors, file, metadata={"format": "pt"})


def _edit_config(model: Path, **changes: object) -> None:
    path = model / "config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config, indent=2))


def _use_model_wise(case: Path) -> None:
    config = case / "w8.yaml"
    config.write_text(config.read_text().replace("spec:\n", "spec:\n  runner: model_wise\n"))


@pytest.mark.parametrize("runner", ["layer_wise", "model_wise"])
@pytest.mark.parametrize(
    "tensor",
    ["lm_head.weight", "model.norm.weight", "model.layers.1.mlp.down_proj.weight"],
)
def test_m9_to_m12_a_missing_tensor_is_named(
    case: Path, run_cli: Cli, tensor: str, runner: str
) -> None:
    """M11 (head), M12 (norm), M10/M9 (a decoder weight, model_wise / streamed): exit 0 with a
    random tensor in the export, or a traceback, before."""
    _edit_weights(case / "model", lambda t: t.pop(tensor))
    if runner == "model_wise":
        _use_model_wise(case)
    replay(run_cli, case, *quant_args(case)).refused(
        rf"1 tensor\(s\) the model needs are missing from the checkpoint \({tensor}\)"
    )


def test_m13_config_with_fewer_layers_than_the_checkpoint(case: Path, run_cli: Cli) -> None:
    """Exported a 1-layer model, silently dropping half the checkpoint, before."""
    _edit_config(case / "model", num_hidden_layers=1)
    replay(run_cli, case, *quant_args(case)).refused(
        r"9 tensor\(s\) of the checkpoint have no place in the model \(model\.layers\.1\..*"
        r"num_hidden_layers 1, the checkpoint holds layers up to index 1"
    )


def test_m14_config_with_more_layers_than_the_checkpoint(case: Path, run_cli: Cli) -> None:
    _edit_config(case / "model", num_hidden_layers=3)
    replay(run_cli, case, *quant_args(case)).refused(
        r"9 tensor\(s\) the model needs are missing .*model\.layers\.2\..*num_hidden_layers 3"
    )


def test_m5_another_architecture_on_these_weights(case: Path, run_cli: Cli) -> None:
    _edit_config(case / "model", model_type="bert", architectures=["BertModel"])
    outcome = replay(run_cli, case, *quant_args(case))
    assert outcome.code == 2 and outcome.added == [] and outcome.changed == []
    outcome.one_error(r"model|bert")


def test_m15_a_dtype_torch_does_not_have(case: Path, run_cli: Cli) -> None:
    _edit_config(case / "model", dtype="float7")
    replay(run_cli, case, *quant_args(case)).refused(
        r"says dtype 'float7', which is not a torch dtype"
    )


def test_m17_extra_tensor_is_named(case: Path, run_cli: Cli) -> None:
    """An extra tensor was dropped silently (counted good then): now named, like any mismatch."""
    _edit_weights(case / "model", lambda t: t.update({"model.extra.weight": torch.ones(2)}))
    replay(run_cli, case, *quant_args(case)).refused(
        r"have no place in the model \(model\.extra\.weight\)"
    )


@pytest.mark.parametrize(
    ("tensor", "config"),
    [
        ("model.embed_tokens.weight", "w8.yaml"),  # M20
        ("model.layers.0.input_layernorm.weight", "w8.yaml"),  # M20
        ("model.norm.weight", "w8.yaml"),
        ("model.layers.1.self_attn.k_proj.weight", "gptq.yaml"),  # M19: was blamed on o_proj's data
    ],
)
def test_m19_m20_nan_in_any_tensor_is_named(
    case: Path, run_cli: Cli, tensor: str, config: str
) -> None:
    def poison(tensors: dict[str, torch.Tensor]) -> None:
        tensors[tensor].view(-1)[3] = float("nan")

    _edit_weights(case / "model", poison)
    replay(run_cli, case, *quant_args(case, config=config)).refused(
        rf"{tensor}: the checkpoint's tensor .* contains 1 NaN/Inf value\(s\)"
    )


def _shard(model: Path, traversal: str) -> None:
    """Split the weights into two shards with an index whose second entry is ``traversal``."""
    tensors = load_file(model / "model.safetensors")
    (model / "model.safetensors").unlink()
    names = sorted(tensors)
    first, second = names[: len(names) // 2], names[len(names) // 2 :]
    save_file(
        {n: tensors[n] for n in first}, model / "model-00001-of-00002.safetensors", {"format": "pt"}
    )
    outside = model.parent / "outside"
    outside.mkdir()
    save_file(
        {n: tensors[n] for n in second},
        outside / "model-00002-of-00002.safetensors",
        {"format": "pt"},
    )
    weight_map = {n: "model-00001-of-00002.safetensors" for n in first}
    weight_map.update({n: traversal for n in second})
    index = {"metadata": {}, "weight_map": weight_map}
    (model / "model.safetensors.index.json").write_text(json.dumps(index))


@pytest.mark.parametrize("runner", ["layer_wise", "model_wise"])
def test_m29_an_index_pointing_outside_the_model_folder(
    case: Path, run_cli: Cli, runner: str
) -> None:
    """A traceback (streamed) or weights read from outside the folder (model_wise), before."""
    _shard(case / "model", "../outside/model-00002-of-00002.safetensors")
    if runner == "model_wise":
        _use_model_wise(case)
    replay(run_cli, case, *quant_args(case)).refused(
        r"maps .* to '\.\./outside/model-00002-of-00002\.safetensors', which is not a file name inside the model folder"
    )


def test_m31_a_stray_export_file_in_the_model_folder_is_not_copied(
    case: Path, run_cli: Cli
) -> None:
    """It overwrote the saver's own description, and the read-back blamed the export."""
    (case / "model" / "quant_model_description.json").write_text('{"stray": "FLOAT"}')
    (case / "model" / "quant_report.json").write_text("{}")
    outcome = replay(run_cli, case, *quant_args(case))
    outcome.succeeded()
    description = json.loads((case / "out" / "quant_model_description.json").read_text())
    assert "stray" not in description and description["model_quant_type"] == "W8A16"
    assert json.loads((case / "out" / "quant_report.json").read_text()) != {}


def test_m32_links_out_of_the_model_folder_are_refused(case: Path, run_cli: Cli) -> None:
    """Their targets' contents were copied into the (often published) export."""
    secret = case / "secret.txt"
    secret.write_text("password")
    os.symlink(secret, case / "model" / "special_notes.txt")
    replay(run_cli, case, *quant_args(case)).refused(
        r"special_notes\.txt is a symbolic link to .*secret\.txt, outside the model folder"
    )


def test_m32_links_inside_the_model_folder_are_followed(case: Path, run_cli: Cli) -> None:
    """A Hugging Face cache snapshot is all links (into its blobs/): those stay usable."""
    model = case / "model"
    (model / "real_template.jinja").write_text("{{ messages }}")
    os.symlink("real_template.jinja", model / "chat_template.jinja")
    replay(run_cli, case, *quant_args(case)).succeeded()
    assert (case / "out" / "chat_template.jinja").read_text() == "{{ messages }}"


def test_m_hf_cache_snapshot_links_into_blobs_are_followed(case: Path, run_cli: Cli) -> None:
    repo = case / "models--org--tiny"
    snapshot = repo / "snapshots" / "abc123"
    blobs = repo / "blobs"
    snapshot.mkdir(parents=True)
    blobs.mkdir()
    for file in sorted((case / "model").iterdir()):
        blob = blobs / f"blob-{file.name}"
        file.rename(blob)
        os.symlink(os.path.relpath(blob, snapshot), snapshot / file.name)
    args = quant_args(case)
    args[args.index(case / "model")] = snapshot
    replay(run_cli, case, *args).succeeded()
    assert json.loads((case / "out" / "config.json").read_text())["model_type"] == "llama"
