"""Run msModelSlim 26.1.0 with ``quarot`` before ``linear_quant`` on tiny Qwen3 models: the oracle of
msquant's offline rotation (compared by ``tests/oracle/test_quarot_oracle.py``, marker
``msmodelslim``).

msModelSlim rotates only through model adapters that describe the rotation (its ``default``
adapter does not), so the models run through its own adapters: the Qwen3 ones through its Qwen3
adapter (``--model_type Qwen3-32B``), the Qwen3-MoE one (8 experts) through its Qwen3-MoE adapter
(``--model_type Qwen3-30B``). Their norm scales are random (the tiny models are built with ones),
so that folding them into the linears is exercised; hidden size 64 and head_dim 16 are powers of
two, where msModelSlim's Hadamard matrices are Sylvester's and its rotation is reproducible. Same
cache, environment and calibration file as :mod:`msmodelslim_run`.

Usage (from the repository root)::

    python tests/oracle/quarot_run.py [--cache DIR] [--venv DIR]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path
from typing import Any

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))

import msmodelslim_run as oracle  # noqa: E402

logger = logging.getLogger("quarot_run")

#: The tiny models: name -> (tiny_models arch, tie_word_embeddings, msModelSlim's --model_type).
#: The tied Qwen3 equals the untied one but for the head; msModelSlim 26.1.0 (with transformers
#: 5.24) exports no tied model, rotated or not (its saver refuses the shared head and embedding
#: tensor), so only the untied one has a cached export (:data:`EXPORTED`).
MODELS: dict[str, tuple[str, bool, str]] = {
    "qwen3_rot": ("qwen3", False, "Qwen3-32B"),
    "qwen3_rot_tied": ("qwen3", True, "Qwen3-32B"),
    "qwen3_moe_rot": ("qwen3_moe", False, "Qwen3-30B"),
}
EXPORTED = ("qwen3_rot",)
MODEL_TYPE = "Qwen3-32B"
#: The models msModelSlim rotates only with transformers 4 (:data:`TF4_VENV`): its Qwen3-MoE
#: adapter names every expert's linears (``mlp.experts.3.gate_proj``), which transformers 5's
#: fused experts module does not have ("Qwen3MoeExperts has no attribute `0`"); msModelSlim
#: 26.1.0 recommends transformers 4.57.6.
TF4_MODELS = ("qwen3_moe_rot",)
#: The environment with msModelSlim 26.1.0 and transformers 4.57.6 (scripts/msmodelslim_env.sh
#: VENV 4.57.6).
TF4_VENV = Path(
    os.environ.get(
        "MSQUANT_MSMODELSLIM_TF4_VENV", Path.home() / ".cache/msquant/msmodelslim-tf4-venv"
    )
)
#: The schemes run behind ``quarot`` (names of :data:`msmodelslim_run.SCHEMES`).
SCHEMES = ("w8a8_dynamic", "w4a8_dynamic")


def config_for(scheme: str, dataset: Path) -> dict[str, Any]:
    """msModelSlim's config: ``quarot`` with its defaults, then the scheme's ``linear_quant``."""
    config = oracle.config_for(oracle.SCHEMES[scheme], dataset)
    config["metadata"]["config_id"] = f"oracle-quarot-{scheme}"
    config["spec"]["process"].insert(0, {"type": "quarot"})
    return config


def build_model(name: str, folder: Path) -> Path:
    """The tiny float32 model (2 layers, hidden 64, head_dim 16) with random norm scales."""
    if (folder / "config.json").is_file():
        return folder
    import torch
    from transformers import AutoModelForCausalLM

    sys.path.insert(0, str(oracle.TESTS))
    from tiny_models import build_tiny_model

    arch, tied, _ = MODELS[name]
    build_tiny_model(folder, arch, tie_word_embeddings=tied)
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    generator = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for parameter_name, parameter in model.named_parameters():
            if "norm" in parameter_name:
                parameter.copy_(torch.rand(parameter.shape, generator=generator) + 0.5)
    model.save_pretrained(str(folder))
    if name in TF4_MODELS:
        _readable_by_transformers_4(folder)
    return folder


def _readable_by_transformers_4(folder: Path) -> None:
    """Add the keys transformers 4.57 reads where 5.24 writes others (both read the result
    alike): the expert count (``num_local_experts`` -> ``num_experts``, else 4.57 builds 128
    experts), ``rope_theta`` beside ``rope_parameters``, and a tokenizer class it knows."""
    config_file = folder / "config.json"
    config = json.loads(config_file.read_text(encoding="utf-8"))
    if "num_local_experts" in config:
        config["num_experts"] = config["num_local_experts"]
    config["rope_theta"] = config["rope_parameters"]["rope_theta"]
    config_file.write_text(json.dumps(config, indent=2), encoding="utf-8")
    tokenizer_file = folder / "tokenizer_config.json"
    tokenizer = json.loads(tokenizer_file.read_text(encoding="utf-8"))
    tokenizer["tokenizer_class"] = "PreTrainedTokenizerFast"
    tokenizer_file.write_text(json.dumps(tokenizer, indent=2), encoding="utf-8")


def export_dir(cache: Path, name: str, scheme: str) -> Path:
    """Where msModelSlim's export of (``name``, quarot + ``scheme``) lives."""
    return cache / "exports" / f"{name}-quarot-{scheme}"


def config_path(cache: Path, scheme: str) -> Path:
    """The YAML both tools run for quarot + ``scheme``."""
    return cache / "configs" / f"quarot-{scheme}.yaml"


def ensure_export(cache: Path, venv: Path, name: str, scheme: str) -> Path:
    """msModelSlim's export of quarot + ``scheme`` on model ``name``, made if missing."""
    save = export_dir(cache, name, scheme)
    if (save / "quant_model_description.json").is_file():
        return save
    model = build_model(name, cache / "models" / name)
    dataset = oracle.write_calibration(cache / "calib.jsonl")
    config = config_path(cache, scheme)
    config.parent.mkdir(parents=True, exist_ok=True)
    config.write_text(yaml.safe_dump(config_for(scheme, dataset)), encoding="utf-8")
    save.parent.mkdir(parents=True, exist_ok=True)
    log = save.parent / f"{save.name}.log"
    seconds = oracle.run_msmodelslim(venv, model, config, save, log, MODELS[name][2])
    logger.info("%s quarot %s: msmodelslim ran in %.1f s -> %s", name, scheme, seconds, save)
    return save


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cache", type=Path, default=oracle.DEFAULT_CACHE)
    parser.add_argument("--venv", type=Path, default=oracle.DEFAULT_VENV)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    failed = 0
    runs = [(name, args.venv) for name in EXPORTED] + [(name, TF4_VENV) for name in TF4_MODELS]
    for name, venv in runs:
        for scheme in SCHEMES:
            try:
                ensure_export(args.cache, venv, name, scheme)
            except RuntimeError as exc:
                failed += 1
                logger.error("%s quarot %s: %s", name, scheme, exc)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
