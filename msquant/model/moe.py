"""Mixture-of-experts models as per-expert ``nn.Linear`` layers.

transformers (5.x) holds the routed experts of an MoE block FUSED: one module (``Qwen2MoeExperts``,
``MixtralExperts``, ``DeepseekV3Experts``, ...) with 3-D parameters ``gate_up_proj [E, 2I, H]`` and
``down_proj [E, H, I]``. Checkpoints on disk, and the engines that load them (vLLM, vLLM-Ascend,
SGLang), name every expert projection separately (``mlp.experts.3.gate_proj.weight``, Mixtral's
``block_sparse_moe.experts.3.w1.weight``); transformers converts between the two when it loads
and saves (``transformers.conversion_mapping``).

msquant quantizes ``nn.Linear`` modules and calibrates GPTQ through hooks on them, so this module:

- :func:`unfuse_experts` replaces each fused experts module by an :class:`UnfusedExperts` holding
  one :class:`ExpertMLP` (``gate_proj``, ``up_proj``, ``down_proj``) per expert, with the same
  forward; a hook on an expert's Linear then sees exactly the tokens routed to that expert;
- :func:`checkpoint_names` maps msquant's tensor and module names to the names on disk, by running
  transformers' own save-time conversion (:func:`revert_weight_conversion`) on probe tensors;
- :func:`checkpoint_sources` reads an unfused (e.g. meta, streamed) model's tensors, expert
  Linears included, from the per-expert tensors of the checkpoint;
- :class:`ExpertTokenCounter` counts the tokens each expert receives during calibration and
  :func:`expert_fallback` decides from that count whether GPTQ can be trusted for an expert.
"""

from __future__ import annotations

import inspect
import json
import logging
import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any, Literal, cast

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from msquant.errors import ModelLoadError

__all__ = [
    "DEFAULT_EXPERT_TOKEN_RATIO",
    "CheckpointNames",
    "ExpertMLP",
    "ExpertTokenCounter",
    "MoEInfo",
    "UnfusedExperts",
    "UnfusedMoE",
    "checkpoint_names",
    "checkpoint_sources",
    "expert_fallback",
    "find_fused_experts",
    "moe_routers",
    "unfuse_experts",
]

logger = logging.getLogger(__name__)

#: The 3-D parameters of the supported fused layout, in the order transformers defines them.
FUSED_PARAMS: tuple[str, str] = ("gate_up_proj", "down_proj")

#: The forward arguments of transformers' experts modules (called by the MoE block with the
#: router's choice): ``hidden_states [T, H]``, ``top_k_index [T, K]``, ``top_k_weights [T, K]``.
FORWARD_ARGS: tuple[str, str, str] = ("hidden_states", "top_k_index", "top_k_weights")

#: Layout flags that ``transformers.integrations.moe.use_experts_implementation`` sets on every
#: experts module, with the only values whose semantics :class:`UnfusedExperts` reproduces.
SUPPORTED_FLAGS: Mapping[str, bool] = {
    "has_gate": True,
    "has_bias": False,
    "is_transposed": False,
    "is_concatenated": True,
    "has_post_expert_norm": False,
}

#: Default of :func:`expert_fallback`: GPTQ needs at least ``2 * in_features`` calibration tokens
#: (see :func:`expert_fallback` for the measurement behind it).
DEFAULT_EXPERT_TOKEN_RATIO = 2.0

ROLES: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")


# --------------------------------------------------------------------------------------------
# Per-expert modules
# --------------------------------------------------------------------------------------------


class ExpertMLP(nn.Module):
    """One expert: ``down_proj(act(gate_proj(x)) * up_proj(x))``, three bias-free Linears."""

    def __init__(self, gate_proj: nn.Linear, up_proj: nn.Linear, down_proj: nn.Linear) -> None:
        super().__init__()
        self.gate_proj = gate_proj
        self.up_proj = up_proj
        self.down_proj = down_proj

    def forward(
        self, x: torch.Tensor, act_fn: Callable[[torch.Tensor], torch.Tensor]
    ) -> torch.Tensor:
        """The expert's output for the tokens ``x [n, H]`` routed to it."""
        return self.down_proj(act_fn(self.gate_proj(x)) * self.up_proj(x))


class UnfusedExperts(nn.Module):
    """Drop-in replacement of a fused experts module, with one :class:`ExpertMLP` per expert.

    Children are named ``"0"``, ``"1"``, ... so the Linears are ``experts.{e}.gate_proj`` etc.
    The forward loops over the experts that received tokens, like transformers' eager one, and
    gives the same result in the same dtype; each expert gets its tokens in token order.

    :param experts: the experts, in index order.
    :param act_fn: the activation of the fused module (shared by all experts).
    :param source_class: class name of the replaced module, for reports and messages.
    :param fused_shapes: shapes of the replaced 3-D parameters (``gate_up_proj``, ``down_proj``);
        :func:`checkpoint_names` needs them to replay transformers' save-time conversion.
    """

    def __init__(
        self,
        experts: list[ExpertMLP],
        act_fn: Callable[[torch.Tensor], torch.Tensor],
        source_class: str,
        fused_shapes: Mapping[str, tuple[int, ...]],
    ) -> None:
        super().__init__()
        for index, expert in enumerate(experts):
            self.add_module(str(index), expert)
        self.act_fn = act_fn
        self.num_experts = len(experts)
        self.source_class = source_class
        self.fused_shapes = dict(fused_shapes)
        self.hidden_dim = experts[0].gate_proj.in_features
        self.intermediate_dim = experts[0].gate_proj.out_features

    def __getitem__(self, index: int) -> ExpertMLP:
        expert = self._modules[str(index)]
        assert isinstance(expert, ExpertMLP)
        return expert

    def __len__(self) -> int:
        return self.num_experts

    def __iter__(self) -> Iterator[ExpertMLP]:
        return (self[e] for e in range(self.num_experts))

    @classmethod
    def from_fused(cls, fused: nn.Module) -> UnfusedExperts:
        """Copy the expert slices of ``fused``'s 3-D parameters into per-expert Linears.

        Each Linear owns its own copy (so it can be freed as soon as it is quantized); the fused
        parameters are released when the caller drops ``fused``. The Linears keep the dtype,
        device (``meta`` included) and ``requires_grad`` of the fused parameters.
        """
        gate_up, down = (_param(fused, name) for name in FUSED_PARAMS)
        num_experts, _, hidden = gate_up.shape
        inter = down.shape[2]
        experts = []
        with torch.no_grad():
            for e in range(num_experts):
                experts.append(
                    ExpertMLP(
                        _linear_from(gate_up[e, :inter], gate_up.requires_grad),
                        _linear_from(gate_up[e, inter:], gate_up.requires_grad),
                        _linear_from(down[e], down.requires_grad),
                    )
                )
        shapes = {"gate_up_proj": tuple(gate_up.shape), "down_proj": tuple(down.shape)}
        act_fn: Callable[[torch.Tensor], torch.Tensor] = getattr(fused, "act_fn")  # noqa: B009
        return cls(experts, act_fn, type(fused).__name__, shapes)

    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        """Weighted sum of the chosen experts' outputs per token (``[T, H]``).

        :param hidden_states: ``[T, H]`` tokens.
        :param top_k_index: ``[T, K]`` chosen expert per token and slot (values
            ``>= num_experts`` mark a slot to skip, as in transformers' expert-parallel masking).
        :param top_k_weights: ``[T, K]`` routing weight per token and slot.
        """
        final = torch.zeros_like(hidden_states)
        top_k = top_k_index.shape[-1]
        with torch.no_grad():
            # Slots grouped by expert (token order kept inside a group): O(T*K), no [T, K, E] mask.
            flat = top_k_index.reshape(-1)
            order = torch.argsort(flat, stable=True)
            counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        start = 0
        for e, count in enumerate(counts[: self.num_experts]):
            if count:
                slots = order[start : start + count]
                token_idx, top_k_pos = slots // top_k, slots % top_k
                out = self[e](hidden_states[token_idx], self.act_fn)
                out = out * top_k_weights[token_idx, top_k_pos, None]
                final.index_add_(0, token_idx, out.to(final.dtype))
            start += count
        return final


def _param(module: nn.Module, name: str) -> torch.Tensor:
    """A direct parameter of ``module`` (checked by :func:`find_fused_experts`)."""
    param = module._parameters[name]
    assert param is not None
    return param


def _linear_from(weight: torch.Tensor, requires_grad: bool) -> nn.Linear:
    """A bias-free Linear owning a copy of the 2-D ``weight`` ``[out, in]`` (no random init)."""
    out_features, in_features = weight.shape
    linear = nn.Linear(in_features, out_features, bias=False, device="meta", dtype=weight.dtype)
    linear.weight = nn.Parameter(weight.detach().clone(), requires_grad=requires_grad)
    return linear


# --------------------------------------------------------------------------------------------
# Detection and unfusing
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class UnfusedMoE:
    """One experts module that :func:`unfuse_experts` replaced.

    :param name: full module name, e.g. ``model.layers.1.mlp.experts``.
    :param source_class: class of the fused module, e.g. ``Qwen2MoeExperts``.
    :param num_experts: E.
    :param hidden_size: H (``in_features`` of gate/up, ``out_features`` of down).
    :param intermediate_size: I (``out_features`` of gate/up, ``in_features`` of down).
    """

    name: str
    source_class: str
    num_experts: int
    hidden_size: int
    intermediate_size: int

    def expert_name(self, expert: int) -> str:
        """Full module name of one expert (``...experts.3``)."""
        return f"{self.name}.{expert}"

    def linear_names(self) -> list[str]:
        """Full names of the expert Linears, expert by expert (gate, up, down)."""
        return [f"{self.expert_name(e)}.{role}" for e in range(self.num_experts) for role in ROLES]


@dataclass(frozen=True)
class MoEInfo:
    """What :func:`unfuse_experts` did: the replaced modules, in model order (empty: nothing was
    fused), and the experts modules the model already held one module per expert.

    :param split: names of experts modules that are ``nn.ModuleList`` s of per-expert MLPs
        (transformers 4), left as they are; their Linears count as experts too.
    """

    modules: tuple[UnfusedMoE, ...] = ()
    split: tuple[str, ...] = ()

    def __bool__(self) -> bool:
        """Whether experts were unfused (the model's names then differ from the checkpoint's)."""
        return bool(self.modules)

    def linear_names(self) -> list[str]:
        """Full names of every expert Linear created."""
        return [name for module in self.modules for name in module.linear_names()]

    def expert_of(self, linear_name: str) -> str | None:
        """The expert module (``...experts.3``) a Linear belongs to, None if it is no expert's."""
        for module in self.modules:
            prefix = module.name + "."
            if linear_name.startswith(prefix):
                index, _, role = linear_name[len(prefix) :].partition(".")
                if index.isdigit() and role in ROLES:
                    return module.expert_name(int(index))
        for experts in self.split:
            index, _, rest = linear_name.removeprefix(experts + ".").partition(".")
            if linear_name.startswith(experts + ".") and index.isdigit() and rest:
                return f"{experts}.{index}"
        return None


def _looks_like_experts(name: str, module: nn.Module) -> bool:
    """Whether ``module`` holds fused experts: direct 3-D parameters in a module that says it
    holds experts (an expert count, transformers' experts-layout flags, or "expert" in its class
    or attribute name). Built-in torch modules (``nn.Conv1d``'s 3-D kernel) are never experts."""
    if type(module).__module__.startswith("torch.nn"):
        return False
    if not any(p.ndim == 3 for p in module.parameters(recurse=False)):
        return False
    leaf = name.rpartition(".")[2]
    return (
        hasattr(module, "num_experts")
        or any(hasattr(module, flag) for flag in SUPPORTED_FLAGS)
        or "expert" in type(module).__name__.lower()
        or "expert" in leaf.lower()
    )


def _layout_problems(module: nn.Module) -> list[str]:
    """Why ``module`` is not a fused experts module :class:`UnfusedExperts` can reproduce
    (empty when it is)."""
    params = dict(module.named_parameters(recurse=False))
    if set(params) != set(FUSED_PARAMS):
        return [
            f"its parameters are {sorted(params)}, expected exactly {list(FUSED_PARAMS)} "
            "(no biases, no per-expert scales)"
        ]
    problems = []
    gate_up, down = params["gate_up_proj"], params["down_proj"]
    if gate_up.ndim != 3 or down.ndim != 3:
        return [
            f"gate_up_proj {tuple(gate_up.shape)} and down_proj {tuple(down.shape)} must be 3-D"
        ]
    num_experts, two_inter, hidden = gate_up.shape
    declared = getattr(module, "num_experts", num_experts)
    if declared != num_experts:
        problems.append(f"num_experts is {declared} but gate_up_proj has {num_experts} experts")
    if two_inter % 2 or tuple(down.shape) != (num_experts, hidden, two_inter // 2):
        problems.append(
            f"gate_up_proj {tuple(gate_up.shape)} and down_proj {tuple(down.shape)} are not "
            "[E, 2I, H] and [E, H, I]"
        )
    for flag, value in SUPPORTED_FLAGS.items():
        if getattr(module, flag, value) != value:
            problems.append(f"{flag}={getattr(module, flag)!r} (supported: {value})")
    if not callable(getattr(module, "act_fn", None)):
        problems.append("it has no act_fn")
    problems.extend(_gate_problems(module))
    problems.extend(_forward_problems(module))
    return problems


def _gate_problems(module: nn.Module) -> list[str]:
    """A class that overrides transformers' ``_apply_gate`` (e.g. clamped or interleaved gating)
    computes something else than ``act(gate) * up``."""
    apply_gate = getattr(type(module), "_apply_gate", None)
    if apply_gate is None or apply_gate.__module__ == "transformers.integrations.moe":
        return []
    return [f"it defines its own gating ({apply_gate.__qualname__})"]


def _forward_problems(module: nn.Module) -> list[str]:
    """The module must be called as ``forward(hidden_states, top_k_index, top_k_weights)``."""
    try:
        names = tuple(inspect.signature(module.forward).parameters)[: len(FORWARD_ARGS)]
    except (TypeError, ValueError):  # pragma: no cover - builtins without a signature
        names = ()
    if names != FORWARD_ARGS:
        return [f"its forward takes {names}, expected {FORWARD_ARGS}"]
    return []


def find_fused_experts(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(name, module)`` of every fused experts module of ``model``, in model order.

    :raises ModelLoadError: when a module holds experts in a layout msquant cannot unfuse; the
        message names every such module, its class and what differs.
    """
    found, refused = [], []
    for name, module in model.named_modules():
        if not _looks_like_experts(name, module):
            continue
        problems = _layout_problems(module)
        if problems:
            refused.append(f"{name} ({type(module).__name__}): {'; '.join(problems)}")
        else:
            found.append((name, module))
    if refused:
        raise ModelLoadError(
            "cannot split the MoE experts of this model into per-expert linear layers: "
            + " | ".join(refused)
            + ". msquant supports experts holding gate_up_proj [E, 2I, H] and down_proj [E, H, I] "
            "called as forward(hidden_states, top_k_index, top_k_weights) (Qwen2/3-MoE, Mixtral, "
            "DeepSeek-V3 in transformers 5)"
        )
    return found


def unfuse_experts(model: nn.Module) -> MoEInfo:
    """Replace every fused experts module of ``model`` by an :class:`UnfusedExperts` (in place).

    Every layout is checked before anything is replaced, so on error the model is unchanged.
    Works on ``meta`` models too (planning). Dense models are left alone (empty result).

    :raises ModelLoadError: an experts module has a layout msquant cannot reproduce.
    """
    unfused = []
    for name, fused in find_fused_experts(model):
        replacement = UnfusedExperts.from_fused(fused)
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name), child, replacement)
        unfused.append(
            UnfusedMoE(
                name=name,
                source_class=replacement.source_class,
                num_experts=replacement.num_experts,
                hidden_size=replacement.hidden_dim,
                intermediate_size=replacement.intermediate_dim,
            )
        )
        del fused
    if unfused:
        logger.info(
            "split %d MoE expert modules (%s, %d experts each) into per-expert linear layers",
            len(unfused),
            unfused[0].source_class,
            unfused[0].num_experts,
        )
    split = tuple(
        name
        for name, module in model.named_modules()
        if name.rpartition(".")[2] == "experts" and isinstance(module, nn.ModuleList)
    )
    return MoEInfo(tuple(unfused), split)


def moe_routers(module: nn.Module, prefix: str = "") -> set[str]:
    """Full names of the MoE routers in ``module``: a direct child of a module which also holds
    the ``experts`` that is an ``nn.Linear`` (Qwen2/3-MoE's and Mixtral's ``gate`` in
    transformers 4, Qwen2-MoE's ``shared_expert_gate``) or holds a 2-D ``weight`` of its own
    (transformers 5's router modules, e.g. ``Qwen3MoeTopKRouter``, which are not
    ``nn.Linear``). vLLM, vLLM-Ascend and SGLang build these unquantized, so msquant keeps them
    float whatever the config selects, and exports that list float layers list them too.

    :param prefix: the full name of ``module`` (e.g. ``model.layers.3``).
    """
    routers = set()
    for name, parent in module.named_modules(prefix=prefix):
        if not hasattr(parent, "experts"):
            continue
        for child_name, child in parent.named_children():
            if child_name != "experts" and _is_router(child):
                routers.add(f"{name}.{child_name}" if name else child_name)
    return routers


def _is_router(module: nn.Module) -> bool:
    """An ``nn.Linear``, or a module holding a 2-D ``weight`` parameter directly (a router that
    applies it with ``F.linear``); shared experts hold theirs in child linears."""
    if isinstance(module, nn.Linear):
        return True
    weight = dict(module.named_parameters(recurse=False)).get("weight")
    return weight is not None and weight.dim() == 2


# --------------------------------------------------------------------------------------------
# Names on disk
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CheckpointNames:
    """msquant's names (the loaded, unfused model's) -> the names a checkpoint uses on disk.

    :param tensors: model tensor name -> disk tensor name, for every tensor transformers saves
        by renaming it (most are unchanged: ``lm_head.weight``).
    :param modules: model module name -> disk module name (expert Linears included), so that any
        tensor a saver derives from a module (``.qweight``, ``.weight_scale``, ...) keeps it.
    :param converted: model tensor names transformers saves through another conversion than a
        rename (e.g. still-fused expert parameters); they have no single disk name.
    """

    tensors: Mapping[str, str]
    modules: Mapping[str, str]
    converted: frozenset[str] = field(default_factory=frozenset)

    @property
    def is_identity(self) -> bool:
        """True when every name is saved unchanged (dense Llama-like models)."""
        return (
            not self.converted
            and all(k == v for k, v in self.tensors.items())
            and all(k == v for k, v in self.modules.items())
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
    modules = _module_names(tensors)
    for name, experts in unfused.items():
        modules.update(_expert_disk_names(model, name, experts, revert_weight_conversion))
    return CheckpointNames(tensors=tensors, modules=modules, converted=converted)


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
    number (rows of different parameters never collide), so every per-expert tensor transformers
    saves tells which parameter, expert and rows it came from.
    """
    probe, spans = {}, {}
    offset = 0
    for param in FUSED_PARAMS:
        num_experts, rows, _ = experts.fused_shapes[param]
        ids = torch.arange(offset, offset + num_experts * rows, dtype=torch.float64)
        probe[f"{name}.{param}"] = ids.view(num_experts, rows, 1)
        spans[param] = (offset, rows)
        offset += num_experts * rows
    inter = experts.intermediate_dim
    expected = {  # (parameter, first row within the expert) -> role
        ("gate_up_proj", 0): "gate_proj",
        ("gate_up_proj", inter): "up_proj",
        ("down_proj", 0): "down_proj",
    }
    names: dict[str, str] = {}
    for disk, tensor in revert(model, probe).items():
        if tensor.ndim == 1:  # transformers 5.17 drops the probe's trailing 1-wide dimension
            tensor = tensor.unsqueeze(1)
        located = _locate(tensor, spans)
        role = expected.get((located[0], located[2])) if located else None
        if located is None or role is None or not disk.endswith(".weight"):
            raise ModelLoadError(
                f"{name} ({experts.source_class}): transformers saves it as {disk} with shape "
                f"{tuple(tensor.shape)}, not as one tensor per expert projection; msquant cannot "
                "name its per-expert layers on disk"
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


def checkpoint_sources(
    model: nn.Module, names: CheckpointNames, checkpoint_dir: Path
) -> dict[str, Callable[[], torch.Tensor]]:
    """Loaders reading each tensor of ``model`` from the checkpoint under its disk name.

    Every parameter and buffer of ``model`` (an unfused model, e.g. still on the ``meta``
    device) whose disk name is in ``checkpoint_dir``'s safetensors files gets a loader; the others
    (tied copies, non-persistent buffers, converted tensors) are left out. This lets a streamed
    run fill an unfused layer's expert Linears straight from the per-expert tensors on disk,
    never building the fused 3-D parameters.

    :raises ModelLoadError: the folder has no ``model.safetensors`` nor
        ``model.safetensors.index.json``.
    """
    files = _checkpoint_files(checkpoint_dir)
    sources: dict[str, Callable[[], torch.Tensor]] = {}
    for name, _ in [*model.named_parameters(), *model.named_buffers()]:
        try:
            disk = names.tensor_name(name)
        except LookupError:
            continue
        if disk in files:
            sources[name] = _safetensors_loader(files[disk], disk)
    return sources


def _checkpoint_files(checkpoint_dir: Path) -> dict[str, Path]:
    """Disk tensor name -> safetensors file holding it."""
    index = checkpoint_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        return {key: checkpoint_dir / file for key, file in weight_map.items()}
    single = checkpoint_dir / "model.safetensors"
    if not single.is_file():
        raise ModelLoadError(f"{checkpoint_dir} has no model.safetensors(.index.json)")
    from safetensors import safe_open

    with safe_open(str(single), framework="pt") as handle:
        return dict.fromkeys(handle.keys(), single)


def _safetensors_loader(file: Path, key: str) -> Callable[[], torch.Tensor]:
    def load() -> torch.Tensor:
        from safetensors import safe_open

        with safe_open(str(file), framework="pt") as handle:
            return handle.get_tensor(key)

    return load


# --------------------------------------------------------------------------------------------
# Calibration coverage
# --------------------------------------------------------------------------------------------


class ExpertTokenCounter:
    """Count the tokens each expert Linear receives while active (a context manager).

    Forward pre-hooks on every Linear of every :class:`UnfusedExperts` under ``module`` add the
    number of rows of their input; experts that receive nothing stay at 0. Use it around the
    calibration forwards of a layer (or of the whole model)::

        with ExpertTokenCounter(layer.module, prefix=layer.name) as counter:
            ...  # calibration forwards
        counter.counts  # {"model.layers.1.mlp.experts.0.gate_proj": 37, ...}

    :param module: the model, or one decoder layer.
    :param prefix: full name of ``module`` (names in :attr:`counts` are full model names).
    """

    def __init__(self, module: nn.Module, prefix: str = "") -> None:
        self._targets: list[tuple[str, nn.Linear]] = []
        self._experts: list[str] = []
        for sub, child in module.named_modules(prefix=prefix):
            if isinstance(child, UnfusedExperts):
                for e, expert in enumerate(child):
                    self._experts.append(f"{sub}.{e}")
                    for role in ROLES:
                        linear = getattr(expert, role)
                        self._targets.append((f"{sub}.{e}.{role}", linear))
        self.counts: dict[str, int] = {name: 0 for name, _ in self._targets}
        self._handles: list[RemovableHandle] = []

    def __enter__(self) -> ExpertTokenCounter:
        for name, linear in self._targets:
            self._handles.append(linear.register_forward_pre_hook(self._hook(name)))
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _hook(self, name: str) -> Callable[[nn.Module, tuple[Any, ...]], None]:
        def count(_: nn.Module, args: tuple[Any, ...]) -> None:
            self.counts[name] += math.prod(args[0].shape[:-1])

        return count

    def per_expert(self) -> dict[str, int]:
        """Tokens routed to each expert (``...experts.3`` -> n), from its ``gate_proj``."""
        return {expert: self.counts[f"{expert}.gate_proj"] for expert in self._experts}


def expert_fallback(
    token_count: int, in_features: int, threshold_ratio: float = DEFAULT_EXPERT_TOKEN_RATIO
) -> Literal["gptq", "rtn"]:
    """Whether an expert Linear calibrated on ``token_count`` tokens may be GPTQ-solved.

    GPTQ minimises the output error on the calibration tokens through the inverse of
    ``H = X^T X``. With fewer rows than ``in_features`` columns ``H`` is singular (only the
    damping fills the directions no token spanned) and near ``in_features`` rows it is badly
    conditioned, so the solve overfits the few tokens it saw. Measured on SmolLM2-135M
    activations (layers 3 and 9, gate_proj in 576 and down_proj in 1536, int4 g32 and int8
    per-channel, GPTQ from n tokens, output error on held-out texts relative to round-to-nearest):
    n = 0.5-1 x in_features gives 1.3-2.1x the round-to-nearest error in 6 of 8 cases (the
    double-descent peak), 2 x gives 0.55-1.37x, 4 x gives 0.46-1.11x. Hence the default ratio
    2.0: below ``2 * in_features`` tokens the expert is rounded to nearest (same format, bits and
    groups, so engines see no difference). An expert that received no token is always ``"rtn"``.

    :param token_count: tokens the Linear received during calibration.
    :param in_features: the Linear's input width (columns of its weight).
    :param threshold_ratio: GPTQ needs ``token_count >= threshold_ratio * in_features``.
    :raises ValueError: a negative count, a non-positive width or a negative/non-finite ratio.
    """
    if isinstance(token_count, bool) or not isinstance(token_count, int) or token_count < 0:
        raise ValueError(f"token_count must be an int >= 0, got {token_count!r}")
    if isinstance(in_features, bool) or not isinstance(in_features, int) or in_features <= 0:
        raise ValueError(f"in_features must be an int > 0, got {in_features!r}")
    if not isinstance(threshold_ratio, (int, float)) or not math.isfinite(threshold_ratio):
        raise ValueError(f"threshold_ratio must be a finite number >= 0, got {threshold_ratio!r}")
    if threshold_ratio < 0:
        raise ValueError(f"threshold_ratio must be a finite number >= 0, got {threshold_ratio!r}")
    if token_count == 0 or token_count < threshold_ratio * in_features:
        return "rtn"
    return "gptq"
