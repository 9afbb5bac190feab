"""An msquant export rebuilt as a float model, through the dequantizing reader its registered
format provides (:mod:`msquant.contracts.format`; written from the format's specification,
independently of its saver), so any verifiable format, a third party's included, is evaluable.

The float model is built from the export's ``config.json``, its float tensors are loaded as
stored, and each quantized linear gets its dequantized weight ``(codes - offset) * scale`` cast
to the model dtype. What is evaluated is thus exactly what a consumer that dequantizes the
checkpoint computes, not msquant's in-memory result. ``msquant eval`` evaluates it, and
``msquant verify --model_path`` compares its logits with the original's (:mod:`.forward`).

Activation schemes (W8A8, W8A8_DYNAMIC, ...): a reader that knows them has an
``activation_of(module) -> ActivationQuant | None`` method (optional; the Ascend reader's gives
the stored per-tensor parameters or per-token); each such layer then fake-quantizes its input in a
forward pre-hook, as the deployed kernel quantizes it, so the perplexity reflects W8A8, not only
the weights.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from msquant.contracts.format import FormatRegistry
from msquant.errors import ModelLoadError
from msquant.load.model_folder import load_model_config, model_class_for
from msquant.model.adapter_registry import adapter_for
from msquant.model.checkpoint_names import CheckpointNames, from_disk_form
from msquant.model.vision import part_prefix
from msquant.quant.activation import ActivationQuant
from msquant.verify.base import ExportReader, export_config
from msquant.verify.detect import open_reader
from msquant.verify.errors import ExportReadError
from msquant.verify.report import Findings

__all__ = ["MAX_LISTED_ERRORS", "load_export"]

logger = logging.getLogger(__name__)


MAX_LISTED_ERRORS = 5


def load_export(
    path: Path,
    trust_remote_code: bool,
    formats: FormatRegistry | None = None,
    simulate_activations: bool = True,
) -> nn.Module:
    """The float model of the export in ``path``, every quantized linear dequantized.

    :param formats: the export formats to detect and read with (default: every installed one).
    :param simulate_activations: give each layer whose format stores an activation scheme a
        hook that fake-quantizes its input (what ``msquant eval`` scores); False keeps the
        activations in float (what the weights alone compute: ``verify``'s forward check).

    :raises ExportReadError: when the export cannot be read back consistently.
    :raises ModelLoadError: when its ``config.json`` does not build a model.
    """
    findings = Findings()
    reader = open_reader(path, findings, formats)
    try:
        _raise_on_errors(path, reader, findings)
        model = _empty_model(path, trust_remote_code)
        adapter = adapter_for(model)
        adapter.unfuse_experts(model)  # MoE exports hold one quantized Linear per expert
        # the export uses the checkpoint's names; a model built from config (not loaded) lacks
        # the prefix of the checkpoint's part it is (an Omni model's ``thinker.``)
        names = adapter.checkpoint_names(model).prefixed(part_prefix(export_config(path) or {}))
        tensor_of = {disk: mine for mine, disk in names.tensors.items()}
        for mine, disk in names.modules.items():  # float experts under renamed modules
            for kind in ("weight", "bias"):
                tensor_of.setdefault(f"{disk}.{kind}", f"{mine}.{kind}")
        module_of = {disk: mine for mine, disk in names.modules.items()}
        assert reader.store is not None
        dtype = next(model.parameters()).dtype
        covered = _load_float_tensors(model, reader, path, tensor_of, names)
        for stored_name in reader.quantized_modules():
            layer = reader.decode(stored_name)
            _raise_on_errors(path, reader, findings)
            assert layer is not None
            module_name = module_of.get(stored_name, stored_name)
            weight = _linear_weight(model, module_name, path)
            if tuple(weight.shape) != layer.shape:
                raise ExportReadError(
                    f"{path}: {module_name} decodes to shape {list(layer.shape)} but the model "
                    f"built from config.json has {list(weight.shape)}"
                )
            with torch.no_grad():
                weight.copy_(layer.dequantize().to(dtype))
            covered.add(f"{module_name}.weight")
            if simulate_activations:
                _simulate_activations(model, module_name, reader, stored_name)
    finally:
        if reader.store is not None:
            reader.store.close()
    _check_covered(model, covered, path)
    model.eval()
    return model


def _simulate_activations(
    model: nn.Module, module_name: str, reader: ExportReader, stored_name: str
) -> None:
    """Give the rebuilt layer its stored activation scheme, if the reader knows one."""
    activation_of = getattr(reader, "activation_of", None)
    act: ActivationQuant | None = activation_of(stored_name) if activation_of else None
    if act is None:
        return

    def quantize_input(_module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        return (act.fake_quantize(args[0]), *args[1:])

    model.get_submodule(module_name).register_forward_pre_hook(quantize_input)


def _raise_on_errors(path: Path, reader: ExportReader, findings: Findings) -> None:
    if reader.store is None and not findings.errors:
        findings.error("no weights found")
    if not findings.errors:
        return
    listed = "; ".join(findings.errors[:MAX_LISTED_ERRORS])
    more = len(findings.errors) - MAX_LISTED_ERRORS
    extra = f" (and {more} more)" if more > 0 else ""
    raise ExportReadError(
        f"{reader.format_name} export {path} cannot be read back: {listed}{extra}; "
        f"run `msquant verify {path}` for the full report"
    )


def _empty_model(path: Path, trust_remote_code: bool) -> nn.Module:
    """The model class of the export's config with freshly initialized weights (overwritten next)."""
    config = load_model_config(path, trust_remote_code)
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # weights are dequantized here: build the float model
    dtype = getattr(config, "dtype", None) or torch.float32
    try:
        model = model_class_for(config).from_config(
            config, dtype=dtype, trust_remote_code=trust_remote_code
        )
    except (ValueError, KeyError, ImportError, TypeError) as exc:
        raise ModelLoadError(
            f"cannot build the model of {path} from its config.json: {exc} "
            "(pass --trust_remote_code for models with custom code)"
        ) from exc
    return model


def _load_float_tensors(
    model: nn.Module,
    reader: ExportReader,
    path: Path,
    tensor_of: Mapping[str, str],
    names: CheckpointNames,
) -> set[str]:
    """Copy the stored float tensors into the model; the names of the parameters set.

    :param tensor_of: stored name -> the model's name, where they differ.
    :param names: the checkpoint's names, for the tensors transformers stores converted
        (MoonViT's ``wqkv`` holds the model's ``q_proj`` / ``k_proj`` / ``v_proj``).
    """
    assert reader.store is not None
    state = model.state_dict()
    covered: set[str] = set()
    unexpected: list[str] = []
    converted: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for stored_name in reader.float_tensors():
            name = tensor_of.get(stored_name, stored_name)
            if name not in state:
                if stored_name in names.converted_shapes:
                    converted[stored_name] = reader.store.get(stored_name)
                else:
                    unexpected.append(stored_name)
                continue
            tensor = reader.store.get(stored_name)
            if tuple(tensor.shape) != tuple(state[name].shape):
                raise ExportReadError(
                    f"{path}: {name} is stored with shape {list(tensor.shape)} but the model "
                    f"built from config.json has {list(state[name].shape)}"
                )
            state[name].copy_(tensor)
            covered.add(name)
        for name, tensor in (from_disk_form(model, names, converted) if converted else {}).items():
            state[name].copy_(tensor)
            covered.add(name)
    if unexpected:
        logger.warning(
            "%s: %d stored tensor(s) the model does not have were ignored: %s",
            path,
            len(unexpected),
            ", ".join(unexpected[:MAX_LISTED_ERRORS]),
        )
    return covered


def _linear_weight(model: nn.Module, name: str, path: Path) -> torch.Tensor:
    """The weight of the quantized layer ``name`` in the rebuilt model."""
    try:
        module = model.get_submodule(name)
    except AttributeError:
        raise ExportReadError(
            f"{path}: quantized layer {name} is not a module of the model built from config.json"
        ) from None
    weight = getattr(module, "weight", None)
    if not isinstance(weight, torch.Tensor):
        raise ExportReadError(f"{path}: quantized layer {name} has no weight in the model")
    return weight


def _check_covered(model: nn.Module, covered: set[str], path: Path) -> None:
    """Every parameter (tied ones once) must come from the export, none left at its random init."""
    missing = [name for name, _ in model.named_parameters() if name not in covered]
    if missing:
        raise ExportReadError(
            f"{path}: the export holds no value for {len(missing)} parameter(s) of the model: "
            f"{', '.join(missing[:MAX_LISTED_ERRORS])}"
        )
