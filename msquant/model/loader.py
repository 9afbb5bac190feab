"""Load a causal LM, its config and tokenizer from a local directory (never from a hub).

Only safetensors weights are loaded (pickled ``.bin`` checkpoints are refused), ``trust_remote_code``
is off unless asked for, and every failure becomes a :class:`ModelLoadError` that says what to fix.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
from torch import nn

from msquant.errors import ModelLoadError

__all__ = [
    "check_model_dir",
    "load_model_config",
    "build_meta_model",
    "load_causal_lm",
    "load_tokenizer",
]

logger = logging.getLogger(__name__)


def check_model_dir(path: str | Path) -> Path:
    """Validate that ``path`` is a local model directory with a config and safetensors weights."""
    directory = Path(path)
    if not directory.exists():
        raise ModelLoadError(f"model path {directory} does not exist; pass a local model directory")
    if not directory.is_dir():
        raise ModelLoadError(
            f"model path {directory} is not a directory; pass a local model directory"
        )
    if not (directory / "config.json").is_file():
        raise ModelLoadError(
            f"model path {directory} has no config.json; is it a Hugging Face model folder?"
        )
    if not any(directory.glob("*.safetensors")):
        pickles = sorted(p.name for p in directory.glob("*.bin"))
        hint = (
            f" It holds pickled weights ({', '.join(pickles[:3])}); msquant does not load pickles - "
            "convert them to safetensors first."
            if pickles
            else ""
        )
        raise ModelLoadError(f"model path {directory} has no *.safetensors weights.{hint}")
    for file in sorted(directory.glob("*.safetensors")):
        _check_safetensors_header(file)
    return directory


def _check_safetensors_header(file: Path) -> None:
    """Open a safetensors file's header (cheap, no tensor data) so corrupt files fail early."""
    from safetensors import safe_open

    try:
        with safe_open(str(file), framework="pt") as handle:
            handle.keys()
    except Exception as exc:  # SafetensorError, OSError: report as a model problem, not a crash
        raise ModelLoadError(
            f"weights file {file} is not a readable safetensors file ({_one_line(exc)}); "
            "re-download or re-convert the checkpoint"
        ) from exc


def load_model_config(path: Path, trust_remote_code: bool = False) -> Any:
    """The model's ``transformers`` config."""
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(
            str(path), trust_remote_code=trust_remote_code, local_files_only=True
        )
    except (OSError, ValueError, KeyError) as exc:
        raise ModelLoadError(f"cannot read the model config in {path}: {_one_line(exc)}") from exc


def build_meta_model(config: Any, trust_remote_code: bool = False) -> nn.Module:
    """A weightless (meta-device) instance of the model, for planning before weights are loaded
    (fused MoE experts split into per-expert linear layers, :mod:`msquant.model.moe`)."""
    from transformers import AutoModelForCausalLM

    from msquant.model.moe import unfuse_experts

    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
    except (ValueError, KeyError, ImportError) as exc:
        raise ModelLoadError(
            f"model type {getattr(config, 'model_type', '?')!r} is not a causal LM transformers can "
            f"build: {_one_line(exc)} (pass --trust_remote_code for models with custom code)"
        ) from exc
    unfuse_experts(model)  # plans and checks see one linear layer per expert, as runs do
    return model


def load_causal_lm(path: Path, trust_remote_code: bool = False, **placement: Any) -> nn.Module:
    """Load the model on CPU in its checkpoint dtype, safetensors only, in eval mode.

    :param placement: ``device_map`` / ``offload_folder`` for ``from_pretrained`` (a streamed
        run leaves the decoder layers on disk, :mod:`msquant.model.streaming`).
    """
    from transformers import AutoModelForCausalLM

    try:
        model = AutoModelForCausalLM.from_pretrained(
            str(path),
            dtype="auto",
            use_safetensors=True,
            trust_remote_code=trust_remote_code,
            local_files_only=True,
            **placement,
        )
    except (OSError, ValueError, KeyError, RuntimeError, ImportError) as exc:
        raise ModelLoadError(f"cannot load the model in {path}: {_one_line(exc)}") from exc
    model.eval()
    return model


def load_tokenizer(path: Path, trust_remote_code: bool = False) -> Any:
    """The tokenizer saved beside the model."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(
            str(path), trust_remote_code=trust_remote_code, local_files_only=True
        )
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ModelLoadError(
            f"cannot load a tokenizer from {path}: {_one_line(exc)}; "
            "calibration needs the model's tokenizer files beside its weights"
        ) from exc


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return text if len(text) <= 400 else text[:400] + "..."
