"""The names a model's checkpoint uses on disk for msquant's (unfused) modules and tensors.

transformers converts some names when it loads and saves (``transformers.conversion_mapping``):
Mixtral's experts are ``block_sparse_moe.experts.3.w1`` on disk and ``mlp.experts`` (fused) in
the loaded model. :func:`checkpoint_names` replays transformers' own save-time conversion, so
exports are written under the names the engines load the original checkpoint with. Experts that
transformers saves still fused (Qwen3-VL-MoE) get the per-expert names the engines' MoE loaders
and msModelSlim use, ``<experts>.<e>.gate_proj`` / ``up_proj`` / ``down_proj``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, cast

import torch
from torch import nn

from msquant.errors import ModelLoadError
from msquant.model.moe.experts import FUSED_PARAMS, ROLES, UnfusedExperts

__all__ = ["CheckpointNames", "checkpoint_names", "disk_form", "from_disk_form"]


@dataclass(frozen=True)
class CheckpointNames:
    """msquant's names (the loaded, unfused model's) -> the names a checkpoint uses on disk.

    :param tensors: model tensor name -> disk tensor name, for every tensor transformers saves
        by renaming it (most are unchanged: ``lm_head.weight``).
    :param modules: model module name -> disk module name (expert Linears included), so that any
        tensor a saver derives from a module (``.qweight``, ``.weight_scale``, ...) keeps it.
    :param converted: model tensor names transformers saves through another conversion than a
        rename (e.g. MoonViT's ``q_proj`` / ``k_proj`` / ``v_proj``, concatenated into the
        checkpoint's ``wqkv``); they have no single disk name.
    :param converted_shapes: the disk tensors those conversions write, with their shapes.
    """

    tensors: Mapping[str, str]
    modules: Mapping[str, str]
    converted: frozenset[str] = field(default_factory=frozenset)
    converted_shapes: Mapping[str, tuple[int, ...]] = field(default_factory=dict)

    @property
    def is_identity(self) -> bool:
        """True when every name is saved unchanged (dense Llama-like models)."""
        return (
            not self.converted
            and all(k == v for k, v in self.tensors.items())
            and all(k == v for k, v in self.modules.items())
        )

    def prefixed(self, prefix: str) -> CheckpointNames:
        """The same names under ``prefix`` on disk (``thinker.``: an Omni model's thinker built
        from its config, whose checkpoint holds it under that prefix; transformers adds the
        prefix back on save only when it removed it on load)."""
        if not prefix:
            return self
        return CheckpointNames(
            tensors={k: prefix + v for k, v in self.tensors.items()},
            modules={k: prefix + v for k, v in self.modules.items()},
            converted=self.converted,
            converted_shapes={prefix + k: v for k, v in self.converted_shapes.items()},
        )

    def module_name(self, name: str) -> str:
        """Disk name of a module (e.g. ``model.layers.0.mlp.experts.3.gate_proj`` ->
        ``model.layers.0.block_sparse_moe.experts.3.w1`` for Mixtral).

        :raises LookupError: ``name`` is not a module with tensors of the model.
        """
        try:
            return self.modules[name]
        except KeyError:
            raise LookupError(f"{name} is not a module with weights of this model") from None

    def tensor_name(self, name: str) -> str:
        """Disk name of a tensor of the model, or of a new tensor of one of its modules
        (``<module>.<leaf>``, e.g. ``...experts.3.gate_proj.qweight``).

        :raises LookupError: the tensor's module is unknown, or transformers stores the tensor
            through a conversion that is not a rename.
        """
        if name in self.tensors:
            return self.tensors[name]
        if name in self.converted:
            raise LookupError(
                f"{name} is saved by transformers through a weight conversion (not a rename); "
                "msquant cannot name it on disk"
            )
        module, _, leaf = name.rpartition(".")
        if module in self.modules:
            return f"{self.modules[module]}.{leaf}"
        raise LookupError(f"{name} is not a tensor of this model nor of one of its modules")


def checkpoint_names(model: nn.Module) -> CheckpointNames:
    """The disk names of ``model``'s tensors and modules, from transformers' own conversion.

    Call it on the loaded model after :func:`unfuse_experts` (before quantization). It replays
    :func:`transformers.core_model_loading.revert_weight_conversion` (what ``save_pretrained``
    does) twice: on ``meta`` tensors shaped like the model's tensors, tracking which disk name
    each one ends up under (renames keep the tensor object); and, per unfused experts module, on
    the fused parameters it replaced filled with row numbers, reading back which expert and rows
    each per-expert disk tensor holds.

    :raises ModelLoadError: transformers would save an unfused experts module in a form that is
        not one tensor per expert projection (e.g. still fused).
    """
    try:
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:  # transformers 4 saves every tensor under its module's name
        tensors = {key: key for key in model.state_dict()}
        return CheckpointNames(tensors=tensors, modules=_module_names(tensors))

    unfused = {n: m for n, m in model.named_modules() if isinstance(m, UnfusedExperts)}
    probe: dict[str, torch.Tensor] = {}
    for key, value in model.state_dict(keep_vars=True).items():
        if not any(key.startswith(prefix + ".") for prefix in unfused):
            probe[key] = torch.empty(value.shape, dtype=value.dtype, device="meta")
    origin = {id(tensor): key for key, tensor in probe.items()}
    saved = revert_weight_conversion(cast(Any, model), probe) if probe else {}
    tensors = {origin[id(t)]: disk for disk, t in saved.items() if id(t) in origin}
    converted = frozenset(set(probe) - set(tensors))
    shapes = {disk: tuple(t.shape) for disk, t in saved.items() if id(t) not in origin}
    modules = _module_names(tensors)
    for name, experts in unfused.items():
        modules.update(_expert_disk_names(model, name, experts, revert_weight_conversion))
    return CheckpointNames(
        tensors=tensors, modules=modules, converted=converted, converted_shapes=shapes
    )


def disk_form(
    model: nn.Module, names: CheckpointNames, tensors: Mapping[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """``tensors`` (model names) as the checkpoint stores them: those transformers saves
    through a conversion (:attr:`CheckpointNames.converted`) replaced by what its own
    save-time conversion writes (e.g. ``q_proj`` / ``k_proj`` / ``v_proj`` -> ``wqkv``, in
    place of the first of them); the others unchanged (the writer renames them).

    :raises ModelLoadError: some of a conversion's tensors are missing (it would write a
        partial tensor: every disk tensor must come out with the shape the whole model's
        conversion gives it), or one is not floating point (a quantized tensor cannot be
        concatenated with float ones).
    """
    pending = {k: v for k, v in tensors.items() if k in names.converted}
    if not pending:
        return dict(tensors)
    integer = sorted(k for k, v in pending.items() if not v.is_floating_point())
    if integer:
        raise ModelLoadError(
            f"{', '.join(integer[:3])}: transformers stores {'these' if len(integer) > 1 else 'it'} "
            "on disk through a weight conversion (e.g. fused with other tensors), which msquant "
            "can only apply to float tensors; keep the layer float (exclude it)"
        )
    from transformers.core_model_loading import revert_weight_conversion

    saved = revert_weight_conversion(cast(Any, model), dict(pending))
    wrong = [
        f"{disk} {tuple(t.shape)} (the whole model gives {names.converted_shapes.get(disk)})"
        for disk, t in saved.items()
        if names.converted_shapes.get(disk) != tuple(t.shape)
    ]
    if wrong:
        raise ModelLoadError(
            f"transformers' conversion of {', '.join(sorted(pending)[:4])} gives "
            f"{'; '.join(wrong[:3])}: some of the tensors it combines were not written together"
        )
    result: dict[str, torch.Tensor] = {}
    for key, value in tensors.items():
        if key not in pending:
            result[key] = value
        elif not result.keys() & saved.keys():
            result.update(saved)
    return result


def _module_names(tensors: Mapping[str, str]) -> dict[str, str]:
    """Module renames implied by tensor renames that keep the leaf name (``a.b.weight`` ->
    ``x.y.weight`` gives ``a.b`` -> ``x.y``); a module whose tensors disagree is left out."""
    modules: dict[str, str] = {}
    conflicts: set[str] = set()
    for key, disk in tensors.items():
        module, _, leaf = key.rpartition(".")
        disk_module, _, disk_leaf = disk.rpartition(".")
        if leaf != disk_leaf or modules.get(module, disk_module) != disk_module:
            conflicts.add(module)
        modules[module] = disk_module
    return {k: v for k, v in modules.items() if k not in conflicts}


def _expert_disk_names(
    model: nn.Module,
    name: str,
    experts: UnfusedExperts,
    revert: Callable[[Any, dict[str, torch.Tensor]], dict[str, torch.Tensor]],
) -> dict[str, str]:
    """Disk module name of each expert Linear of ``experts`` (named ``name`` in ``model``).

    Probe: each fused parameter ``[E, R, C]`` becomes ``[E, R, 1]`` float64 holding a global row
    number (rows of different parameters never collide), so every tensor transformers saves
    tells which parameter, expert and rows it came from. transformers saves the experts either
    one tensor per expert projection (Qwen2/3-MoE, Mixtral: that tensor's name is the Linear's),
    or still fused, one 3-D tensor per parameter (Qwen3-VL-MoE's ``experts.gate_up_proj``): then
    each expert Linear is named as the engines and msModelSlim name per-expert layers,
    ``<experts on disk>.<e>.gate_proj`` / ``up_proj`` / ``down_proj``
    (:func:`_fused_disk_names`).
    """
    probe, spans = {}, {}
    offset = 0
    for param in FUSED_PARAMS:
        num_experts, rows, _ = experts.fused_shapes[param]
        ids = torch.arange(offset, offset + num_experts * rows, dtype=torch.float64)
        probe[f"{name}.{param}"] = ids.view(num_experts, rows, 1)
        spans[param] = (offset, rows)
        offset += num_experts * rows
    with _fused_stand_in(model, name, probe):
        saved = revert(model, probe)
    inter = experts.intermediate_dim
    expected = {  # (parameter, first row within the expert) -> role
        ("gate_up_proj", 0): "gate_proj",
        ("gate_up_proj", inter): "up_proj",
        ("down_proj", 0): "down_proj",
    }
    names: dict[str, str] = {}
    for disk, tensor in saved.items():
        whole = _fused_disk_names(name, experts, disk, tensor, spans)
        if whole is not None:
            names.update(whole)
            continue
        if tensor.ndim == 1:  # transformers 5.17 drops the probe's trailing 1-wide dimension
            tensor = tensor.unsqueeze(1)
        located = _locate(tensor, spans)
        role = expected.get((located[0], located[2])) if located else None
        if located is None or role is None or not disk.endswith(".weight"):
            raise ModelLoadError(
                f"{name} ({experts.source_class}): transformers saves it as {disk} with shape "
                f"{tuple(tensor.shape)}, neither one tensor per expert projection nor one whole "
                "fused parameter; msquant cannot name its per-expert layers on disk"
            )
        rows_expected = experts.hidden_dim if role == "down_proj" else inter
        if tensor.shape[0] != rows_expected:
            raise ModelLoadError(
                f"{name}: {disk} holds {tensor.shape[0]} rows, not {rows_expected}"
            )
        names[f"{name}.{located[1]}.{role}"] = disk.removesuffix(".weight")
    missing = [f"{name}.{e}.{r}" for e in range(experts.num_experts) for r in ROLES]
    missing = [m for m in missing if m not in names]
    if missing:
        raise ModelLoadError(
            f"{name} ({experts.source_class}): transformers' conversion gives no disk name for "
            f"{', '.join(missing[:4])}{' ...' if len(missing) > 4 else ''}"
        )
    return names


#: The expert Linears each fused parameter holds, in row order within an expert.
_FUSED_ROLES: Mapping[str, tuple[str, ...]] = {
    "gate_up_proj": ("gate_proj", "up_proj"),
    "down_proj": ("down_proj",),
}


def _fused_disk_names(
    name: str,
    experts: UnfusedExperts,
    disk: str,
    tensor: torch.Tensor,
    spans: Mapping[str, tuple[int, int]],
) -> dict[str, str] | None:
    """Per-expert disk names when transformers saves one fused parameter whole as ``disk``
    (its probe ``tensor`` is the parameter's ``[E, R, 1]`` probe unchanged, or transposed
    ``[E, 1, R]`` by a save-time ``Transpose``), None when ``tensor`` is not a whole parameter.

    The Linears of expert ``e`` are then ``<disk's module>.<e>.<role>``: the names vLLM's and
    vLLM-Ascend's MoE loaders read per-expert weights under (their expert-parameter mapping),
    and those msModelSlim exports such models with.
    """
    if tensor.ndim != 3:
        return None
    rows = tensor.reshape(tensor.shape[0], -1)
    for param, (offset, per_expert) in spans.items():
        num_experts = experts.fused_shapes[param][0]
        ids = torch.arange(offset, offset + num_experts * per_expert, dtype=torch.float64)
        if tuple(rows.shape) == (num_experts, per_expert) and torch.equal(
            rows.to(torch.float64), ids.view(num_experts, per_expert)
        ):
            module, _, leaf = disk.rpartition(".")
            if leaf != param:
                raise ModelLoadError(
                    f"{name} ({experts.source_class}): transformers saves its fused {param} as "
                    f"{disk}; msquant names per-expert layers only beside a fused tensor that "
                    f"keeps the name {param}"
                )
            return {
                f"{name}.{e}.{role}": f"{module}.{e}.{role}"
                for e in range(num_experts)
                for role in _FUSED_ROLES[param]
            }
    return None


@contextmanager
def _fused_stand_in(
    model: nn.Module, name: str, probe: Mapping[str, torch.Tensor]
) -> Iterator[None]:
    """Within the block, ``model``'s module ``name`` (the :class:`UnfusedExperts`) is replaced by
    one holding ``meta`` fused parameters shaped like ``probe``'s tensors.

    transformers' save-time conversions may read the model's parameter of a tensor they convert
    (``Transpose(check_dims=True)``, Qwen3-VL-MoE's experts: it transposes only a tensor whose
    shape differs from the parameter's); the unfused model has none. Shaped like the probe, the
    stand-in makes the conversion treat the probe as transformers treats the real parameter
    when it saves it (same shape as the model's).
    """
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name)
    original = parent._modules[child]
    stand_in = nn.Module()
    for key, tensor in probe.items():
        param = nn.Parameter(torch.empty(tensor.shape, device="meta"), requires_grad=False)
        stand_in.register_parameter(key.rpartition(".")[2], param)
    parent._modules[child] = stand_in
    try:
        yield
    finally:
        parent._modules[child] = original


def _locate(
    tensor: torch.Tensor, spans: Mapping[str, tuple[int, int]]
) -> tuple[str, int, int] | None:
    """``(parameter, expert, first row)`` of a probe slice holding consecutive rows of one
    expert, None for anything else (fused, transposed or mixed)."""
    if tensor.ndim != 2 or tensor.shape[1] != 1 or tensor.shape[0] == 0:
        return None
    ids = tensor[:, 0]
    first = int(ids[0].item())
    if not torch.equal(ids, torch.arange(first, first + ids.numel(), dtype=ids.dtype)):
        return None
    for param, (offset, rows) in sorted(spans.items(), key=lambda kv: -kv[1][0]):
        if first >= offset:
            expert, row = divmod(first - offset, rows)
            if row + ids.numel() > rows:
                return None
            return param, expert, row
    return None  # pragma: no cover - offsets start at 0


def from_disk_form(
    model: nn.Module, names: CheckpointNames, stored: Mapping[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """The model tensors held by converted disk tensors (the inverse of :func:`disk_form`):
    transformers' save-time conversion is replayed on the converted tensors filled with their
    element numbers, which shows where each element of each model tensor lands on disk.

    :param stored: disk name -> tensor, for disk tensors in :attr:`CheckpointNames.converted_shapes`.
    :returns: model name -> tensor, for every model tensor ``stored`` holds in full.
    :raises ModelLoadError: a stored tensor holds only part of a model tensor.
    """
    from transformers.core_model_loading import revert_weight_conversion

    state = model.state_dict()
    probe: dict[str, torch.Tensor] = {}
    spans: dict[str, tuple[int, torch.Size]] = {}
    start = 0
    for name in sorted(names.converted):
        shape = state[name].shape
        probe[name] = torch.arange(start, start + shape.numel(), dtype=torch.float64).reshape(shape)
        spans[name] = (start, shape)
        start += shape.numel()
    numbered = revert_weight_conversion(cast(Any, model), probe)
    found: dict[str, torch.Tensor] = {}
    filled: dict[str, int] = {}
    for disk, tensor in stored.items():
        ids = numbered[disk].reshape(-1).to(torch.int64)
        values = tensor.reshape(-1)
        for name, (first, shape) in spans.items():
            inside = (ids >= first) & (ids < first + shape.numel())
            if not bool(inside.any()):
                continue
            target = found.setdefault(name, torch.empty(shape.numel(), dtype=tensor.dtype))
            target[ids[inside] - first] = values[inside]
            filled[name] = filled.get(name, 0) + int(inside.sum())
    partial = [n for n, count in filled.items() if count != spans[n][1].numel()]
    if partial:
        raise ModelLoadError(
            f"the stored {', '.join(sorted(stored)[:3])} hold only part of "
            f"{', '.join(sorted(partial)[:3])}"
        )
    return {name: found[name].reshape(spans[name][1]) for name in found}
