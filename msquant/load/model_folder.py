"""Load a causal LM, its config and tokenizer from a local directory (never from a hub).

Only safetensors weights are loaded (pickled ``.bin`` checkpoints are refused), ``trust_remote_code``
is off unless asked for, and every failure becomes a :class:`ModelLoadError` that says what to fix.
A weight index may only name files inside the folder, and the loaded model must be the checkpoint
exactly (:mod:`msquant.load.integrity`): no tensor missing, none left over.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import nn

from msquant.errors import ModelLoadError
from msquant.load.integrity import check_loading_info
from msquant.model.adapter_registry import adapter_for
from msquant.model.vision import is_vision_language, other_parts, quantized_part

__all__ = [
    "check_model_dir",
    "load_model_config",
    "build_meta_model",
    "load_causal_lm",
    "load_tokenizer",
    "model_class_for",
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
    for index in sorted(directory.glob("*.safetensors.index.json")):
        _check_weight_index(index)
    return directory


def _check_weight_index(index: Path) -> None:
    """Every file a weight index names must be a safetensors file of the folder itself: an entry
    like ``../../elsewhere/x.safetensors`` would make transformers read weights from outside it."""
    try:
        data = json.loads(index.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise ModelLoadError(
            f"weight index {index} is not readable JSON ({_one_line(exc)})"
        ) from exc
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict):
        raise ModelLoadError(f"weight index {index} has no weight_map object; re-create the index")
    for tensor, file in weight_map.items():
        inside = isinstance(file, str) and Path(file).name == file and file not in ("", ".", "..")
        if not inside:
            raise ModelLoadError(
                f"weight index {index} maps {tensor} to {file!r}, which is not a file name inside "
                "the model folder; msquant reads weights only from the model folder itself: fix "
                "the index"
            )
        if not (index.parent / file).is_file():
            raise ModelLoadError(
                f"weight index {index} maps {tensor} to {file}, which is not in the model folder; "
                "copy the missing shard there or re-create the index"
            )


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
    """The ``transformers`` config of the model msquant loads from ``path``: the checkpoint's
    own, or the part of it that msquant quantizes (an Omni model's thinker,
    :func:`msquant.model.vision.quantized_part`)."""
    whole = _read_config(path, trust_remote_code)
    config, part = quantized_part(whole)
    if part is not None:
        logger.info(
            "%s holds a %s model; msquant loads and quantizes its %s (%s) and exports only its "
            "tensors, as msModelSlim does: the checkpoint's other parts (%s) are not written",
            path, whole.model_type, part.removesuffix("_config"), config.model_type,
            ", ".join(other_parts(whole.to_dict())) or "none",
        )  # fmt: skip
    return config


def _read_config(path: Path, trust_remote_code: bool) -> Any:
    """config.json as transformers reads it (checked first for what fails deep inside)."""
    from transformers import AutoConfig

    _check_dtype(path)
    _check_attention_heads(path)
    try:
        return AutoConfig.from_pretrained(
            str(path), trust_remote_code=trust_remote_code, local_files_only=True
        )
    except (OSError, ValueError, KeyError, TypeError, AttributeError, RecursionError) as exc:
        raise ModelLoadError(f"cannot read the model config in {path}: {_one_line(exc)}") from exc
    except Exception as exc:
        # huggingface_hub's StrictDataclassError (transformers 5 validates configs with it) is
        # no ValueError; it says what is wrong with the config, like the errors above.
        if type(exc).__module__.split(".")[0] != "huggingface_hub":
            raise
        raise ModelLoadError(f"cannot read the model config in {path}: {_one_line(exc)}") from exc


def _config_sections(path: Path) -> list[tuple[str, dict[str, Any]]]:
    """config.json's mapping and its ``text_config`` (prefix for messages, section); empty when
    the file is not readable JSON (transformers then says why)."""
    try:
        data = json.loads((path / "config.json").read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError, RecursionError):
        return []
    if not isinstance(data, dict):
        return []
    sections = [("", data)]
    if isinstance(data.get("text_config"), dict):
        sections.append(("text_config.", data["text_config"]))
    return sections


def _check_attention_heads(path: Path) -> None:
    """The attention heads must split the hidden size (when ``head_dim`` is not given) and the
    key/value heads the attention heads: transformers otherwise fails deep inside (5.x) or
    builds a model whose attention cannot run (4.x)."""
    for prefix, section in _config_sections(path):
        hidden = _positive_int(section.get("hidden_size"))
        heads = _positive_int(section.get("num_attention_heads"))
        kv_heads = _positive_int(section.get("num_key_value_heads"))
        if heads is None:
            continue
        if hidden is not None and section.get("head_dim") is None and hidden % heads:
            raise ModelLoadError(
                f"config.json in {path} says {prefix}hidden_size {hidden} and "
                f"{prefix}num_attention_heads {heads}, which does not divide it: each head "
                "takes hidden_size / num_attention_heads channels; fix config.json (or give "
                "head_dim)"
            )
        if kv_heads is not None and heads % kv_heads:
            raise ModelLoadError(
                f"config.json in {path} says {prefix}num_attention_heads {heads} and "
                f"{prefix}num_key_value_heads {kv_heads}, which does not divide it: each "
                "key/value head serves the same number of attention heads; fix config.json"
            )


def _positive_int(value: object) -> int | None:
    """``value`` when it is an int > 0 (a bool is not), else None."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def _check_dtype(path: Path) -> None:
    """``dtype`` (or the older ``torch_dtype``) in config.json, and in its ``text_config``, must
    name a torch dtype (transformers fails on others with an AttributeError deep inside)."""
    for prefix, section in _config_sections(path):
        for key in ("dtype", "torch_dtype"):
            value = section.get(key)
            if value is None or value == "auto":
                continue
            if not isinstance(value, str) or not isinstance(
                getattr(torch, value, None), torch.dtype
            ):
                raise ModelLoadError(
                    f"config.json in {path} says {prefix}{key} {value!r}, which is not a torch "
                    "dtype; write the checkpoint's dtype there (float32, bfloat16 or float16)"
                )


def model_class_for(config: Any) -> Any:
    """The transformers auto class that builds ``config``'s whole model with its checkpoint's
    names: ``AutoModelForImageTextToText`` for a vision-language model (Qwen3-VL, Qwen3.5,
    InternVL, ...: ``model.language_model.*`` beside ``model.visual.*``; some, Qwen3.5, also
    have a text-only causal-LM class that would drop the vision tower), else
    ``AutoModelForCausalLM``."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    return AutoModelForImageTextToText if is_vision_language(config) else AutoModelForCausalLM


def build_meta_model(config: Any, trust_remote_code: bool = False) -> nn.Module:
    """A weightless (meta-device) instance of the model, for planning before weights are loaded
    (fused MoE experts split into per-expert linear layers by the model's adapter,
    :mod:`msquant.model.moe`)."""
    try:
        with torch.device("meta"):
            model = model_class_for(config).from_config(config, trust_remote_code=trust_remote_code)
    except (ValueError, KeyError, ImportError) as exc:
        raise ModelLoadError(
            f"model type {getattr(config, 'model_type', '?')!r} is not a causal LM transformers can "
            f"build: {_one_line(exc)} (pass --trust_remote_code for models with custom code)"
        ) from exc
    adapter_for(model).unfuse_experts(model)  # plans and checks see one linear per expert
    return model


def load_causal_lm(path: Path, trust_remote_code: bool = False, **placement: Any) -> nn.Module:
    """Load the model on CPU in its checkpoint dtype, safetensors only, in eval mode.

    :param placement: ``device_map`` / ``offload_folder`` for ``from_pretrained`` (a streamed
        run leaves the decoder layers on disk, :mod:`msquant.load.streaming`).
    """
    config = load_model_config(path, trust_remote_code)
    # a part of the checkpoint (an Omni model's thinker) is built from its own config
    whole = _read_config(path, trust_remote_code)
    part = {"config": config} if config.model_type != whole.model_type else {}
    auto_class = model_class_for(config)
    with _captured_load_report() as report:
        try:
            loaded: Any = auto_class.from_pretrained(
                str(path),
                **part,
                dtype="auto",
                use_safetensors=True,
                trust_remote_code=trust_remote_code,
                local_files_only=True,
                output_loading_info=True,
                **placement,
            )
        except (OSError, ValueError, KeyError, RuntimeError, ImportError, AttributeError) as exc:
            details = f"\n{report[0]}" if report else ""
            raise ModelLoadError(
                f"cannot load the model in {path}: {_one_line(exc)}{details}"
            ) from exc
    model, info = loaded
    check_loading_info(info, path, getattr(model, "config", None))
    model.eval()
    return model


_ANSI = re.compile(r"\x1b\[[0-9;]*m")


@contextmanager
def _captured_load_report() -> Iterator[list[str]]:
    """Keep transformers' "LOAD REPORT" table off the terminal while loading: msquant reports
    the same problems itself, as one error. The captured text is yielded, for the errors that
    refer to it."""
    captured: list[str] = []

    class _Capture(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            captured.append(_ANSI.sub("", record.getMessage()))

    source = logging.getLogger("transformers.modeling_utils")
    handler = _Capture(logging.WARNING)
    propagate = source.propagate
    source.addHandler(handler)
    source.propagate = False
    try:
        yield captured
    finally:
        source.removeHandler(handler)
        source.propagate = propagate


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
