"""What an engine's modules would read from a checkpoint folder, compared with what it holds.

An engine adapter resolves every :class:`~architectures.EngineModule` to a :class:`Resolution`: the
quantization method the engine's own code picked and the parameters that method created
(names, shapes, dtypes, and vLLM's ``output_dim`` metadata). :func:`loading_problems` then checks
each parameter against the export's tensors the way the engines' weight loaders combine them:

* a linear layer's parameter ``x`` is filled from ``<shard>.x`` of each shard, concatenated along
  the parameter's output dimension (q/k/v, gate/up, ...), or along the module's fixed
  ``concat_dim`` where the engine's loader concatenates the tensors itself (SGLang's DeepSeek
  a-projection);
* an experts layer's ``w13_x`` from every expert's gate and up ``x`` (one dimension doubled),
  ``w2_x`` from its down projection (transposed first where the engine's loader transposes
  them: SGLang's compressed-tensors WNA16 MoE);
* integer parameters need integer tensors of the same dtype, float parameters any float tensor
  (the loaders cast), or any tensor for parameters the engine fills by casting integers;
* an export tensor of the module that no parameter reads is a problem too (the loaders either fail
  on it or skip it, leaving a parameter uninitialised).

Biases (and DeepSeek's router ``e_score_correction_bias``) are created by the layer, not by the
quantization method, so they are not compared.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch
from architectures import Engine, EngineModule, engine_modules
from safetensors.torch import load_file

#: safetensors dtype names of integer tensors, by torch dtype.
INT_DTYPES = {
    torch.int32: "I32",
    torch.int64: "I64",
    torch.int8: "I8",
    torch.uint8: "U8",
    # an FP8 parameter takes FP8 only (copy_ would convert a wider float silently)
    torch.float8_e4m3fn: "F8_E4M3",
}
FLOAT_NAMES = {"F16", "BF16", "F32", "F64"}


@dataclass(frozen=True)
class TensorInfo:
    shape: tuple[int, ...]
    dtype: str


def read_tensor_table(folder: Path) -> dict[str, TensorInfo]:
    """Every tensor's shape and dtype, from the safetensors headers in ``folder``."""
    table: dict[str, TensorInfo] = {}
    for path in sorted(folder.glob("*.safetensors")):
        with path.open("rb") as handle:
            size = int.from_bytes(handle.read(8), "little")
            header = json.loads(handle.read(size))
        header.pop("__metadata__", None)
        for name, info in header.items():
            table[name] = TensorInfo(tuple(info["shape"]), info["dtype"])
    return table


def read_tensors(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the safetensors files in ``folder``."""
    tensors: dict[str, torch.Tensor] = {}
    for path in sorted(folder.glob("*.safetensors")):
        tensors.update(load_file(str(path)))
    return tensors


def int8_linears(model_dir: Path, folder: Path, engine: Engine = "vllm") -> list[EngineModule]:
    """``engine``'s linear modules whose shards the export in ``folder`` stores as int8 (routers
    and other float linears left out)."""
    table = read_tensor_table(folder)
    return [
        m
        for m in engine_modules(model_dir, engine)
        if m.kind == "linear" and table[f"{m.shards[0]}.weight"].dtype == "I8"
    ]


@dataclass(frozen=True)
class ParamInfo:
    shape: tuple[int, ...]
    dtype: torch.dtype
    output_dim: int | None = None


@dataclass
class Resolution:
    """What an engine's code decided for one module.

    :param method: class name of the quantization method (``None``: the engine raised).
    :param params: parameters the method created.
    :param error: the engine's exception (type and message) when it refused the module.
    :param optional: parameter names the loader may leave at their initial value.
    :param ignored_leaves: checkpoint tensor leaves the engine drops on purpose (vLLM: ``g_idx``).
    :param cast: float parameters the engine's loader fills from integer tensors by casting
        (SGLang's Marlin MoE ``w13_qzeros`` / ``w2_qzeros``).
    :param transposed: experts parameters the engine's loader fills with each checkpoint tensor
        transposed (``.t()``; SGLang's compressed-tensors WNA16 MoE).
    """

    module: EngineModule
    method: str | None
    params: dict[str, ParamInfo] = field(default_factory=dict)
    error: str | None = None
    optional: frozenset[str] = frozenset()
    ignored_leaves: frozenset[str] = frozenset()
    cast: frozenset[str] = frozenset()
    transposed: frozenset[str] = frozenset()

    @property
    def quantized(self) -> bool:
        return self.method is not None and "Unquantized" not in self.method


def param_infos(module: torch.nn.Module) -> dict[str, ParamInfo]:
    """The parameters a quantization method registered on a (stub) layer."""
    return {
        name: ParamInfo(tuple(param.shape), param.dtype, getattr(param, "output_dim", None))
        for name, param in module.named_parameters(recurse=False)
        if param is not None
    }


def _dtype_problem(where: str, param: ParamInfo, tensor: TensorInfo) -> str | None:
    if param.dtype.is_floating_point and param.dtype not in INT_DTYPES:
        # vLLM keeps the experts' compressed-tensors weight_shape in a float tensor (copy_ casts)
        if tensor.dtype not in FLOAT_NAMES and not where.endswith(".weight_shape"):
            return (
                f"{where}: the engine creates a float parameter, the export stores {tensor.dtype}"
            )
        return None
    wanted = INT_DTYPES.get(param.dtype, str(param.dtype))
    if tensor.dtype != wanted:
        return f"{where}: the engine creates {wanted}, the export stores {tensor.dtype}"
    return None


def _linear_problems(
    resolution: Resolution, table: Mapping[str, TensorInfo]
) -> tuple[list[str], set[str]]:
    module = resolution.module
    problems: list[str] = []
    used: set[str] = set()
    for name, param in resolution.params.items():
        sources = [f"{shard}.{name}" for shard in module.shards]
        missing = [s for s in sources if s not in table]
        if missing:
            if name not in resolution.optional:
                problems.append(
                    f"{module.prefix}.{name} {list(param.shape)}: the export lacks {missing}"
                )
            continue
        used.update(sources)
        infos = [table[s] for s in sources]
        for source, info in zip(sources, infos, strict=True):
            problem = None if name in resolution.cast else _dtype_problem(source, param, info)
            if problem:
                problems.append(problem)
        if module.concat_dim is not None and len(sources) > 1:
            problem = _concat_problem(f"{module.prefix}.{name}", param, infos, module.concat_dim)
            if problem:
                problems.append(problem)
            continue
        dim = param.output_dim
        if dim is None or len(sources) == 1:
            # one shard, or metadata every shard fills alike (compressed-tensors' weight_shape)
            bad = [s for s, i in zip(sources, infos, strict=True) if i.shape != param.shape]
            if bad:
                problems.append(
                    f"{module.prefix}.{name}: engine shape {list(param.shape)}, export "
                    f"{[list(table[s].shape) for s in bad]}"
                )
            continue
        expected_rest = param.shape[:dim] + param.shape[dim + 1 :]
        total = sum(info.shape[dim] if len(info.shape) > dim else -1 for info in infos)
        rest_ok = all(info.shape[:dim] + info.shape[dim + 1 :] == expected_rest for info in infos)
        if not rest_ok or total != param.shape[dim]:
            problems.append(
                f"{module.prefix}.{name}: engine shape {list(param.shape)} (output dim {dim}), "
                f"export {[list(i.shape) for i in infos]}"
            )
    return problems, used


def _concat_problem(where: str, param: ParamInfo, infos: list[TensorInfo], dim: int) -> str | None:
    """Whether the shards' tensors, concatenated along ``dim`` by the engine's loader, give the
    parameter's shape (None) or not (the problem)."""
    shapes = [list(info.shape) for info in infos]
    rest = {tuple(s[:dim] + s[dim + 1 :]) for s in shapes}
    if len(rest) != 1 or any(len(s) <= dim for s in shapes):
        return (
            f"{where}: the engine's loader concatenates {shapes} along dimension {dim}, which "
            "their other dimensions do not allow"
        )
    joined = list(shapes[0])
    joined[dim] = sum(s[dim] for s in shapes)
    if tuple(joined) != param.shape:
        return (
            f"{where}: the engine's loader concatenates {shapes} along dimension {dim} into "
            f"{joined}, the engine's parameter is {list(param.shape)}"
        )
    return None


def _expert_problems(
    resolution: Resolution, table: Mapping[str, TensorInfo]
) -> tuple[list[str], set[str]]:
    module = resolution.module
    problems: list[str] = []
    used: set[str] = set()
    for name, param in resolution.params.items():
        group, _, leaf = name.partition("_")
        roles = {"w13": (0, 1), "w2": (2,)}.get(group)
        if roles is None or not leaf:
            problems.append(f"{module.prefix}.{name}: not an experts parameter the harness knows")
            continue
        per_expert = param.shape[1:]
        for expert in range(module.num_experts):
            sources = [f"{module.expert_shard(expert, role)}.{leaf}" for role in roles]
            missing = [s for s in sources if s not in table]
            if missing:
                if name not in resolution.optional:
                    problems.append(
                        f"{module.prefix}.{name} {list(param.shape)}: the export lacks {missing}"
                    )
                break
            used.update(sources)
            infos = [table[s] for s in sources]
            for source, info in zip(sources, infos, strict=True):
                cast = name in resolution.cast
                problem = None if cast else _dtype_problem(source, param, info)
                if problem:
                    problems.append(problem)
            shapes = [
                i.shape[::-1] if name in resolution.transposed and len(i.shape) == 2 else i.shape
                for i in infos
            ]
            if not _fits_expert_slot(per_expert, shapes):
                problems.append(
                    f"{module.prefix}.{name}: engine slot {list(per_expert)} per expert, export "
                    f"{[list(i.shape) for i in infos]} for expert {expert}"
                )
                break
    return problems, used


def _fits_expert_slot(slot: tuple[int, ...], shapes: list[tuple[int, ...]]) -> bool:
    """Whether one expert's shard tensors fill ``slot``: one shard of the slot's shape, or equal
    shards stacked along exactly one dimension, or (per-shard metadata of at most one dimension,
    such as a scalar input scale or a ``weight_shape`` pair) repeated. A matrix shard as large as
    the whole slot does not fit it twice: gate and up each the size of ``w13`` is a mismatch."""
    if len(shapes) == 1:
        return shapes[0] == slot
    if len(set(shapes)) != 1 or len(shapes[0]) != len(slot):
        return False
    shard = shapes[0]
    if shard == slot:
        return len(slot) <= 1
    differing = [d for d in range(len(slot)) if slot[d] != shard[d]]
    return len(differing) == 1 and slot[differing[0]] == shard[differing[0]] * len(shapes)


def loading_problems(
    resolutions: Iterable[Resolution], table: Mapping[str, TensorInfo]
) -> list[str]:
    """Every mismatch between what the engine's modules read and what the export holds."""
    problems: list[str] = []
    for resolution in resolutions:
        module = resolution.module
        if resolution.error is not None:
            problems.append(f"{module.prefix}: the engine refuses it: {resolution.error}")
            continue
        if module.kind == "experts":
            found, used = _expert_problems(resolution, table)
        else:
            found, used = _linear_problems(resolution, table)
        problems += found
        stray = sorted(
            name
            for name in _module_tensors(module, table)
            if name not in used
            and name.rpartition(".")[2] not in resolution.ignored_leaves
            and not name.endswith("bias")  # layer-owned: .bias, a router's e_score_correction_bias
        )
        if stray:
            problems.append(
                f"{module.prefix} ({resolution.method}): the export holds tensors its parameters "
                f"do not read: {stray[:4]}{' ...' if len(stray) > 4 else ''}"
            )
    return problems


def _module_tensors(module: EngineModule, table: Mapping[str, TensorInfo]) -> list[str]:
    prefixes = tuple(f"{shard}." for shard in module.shards)
    return [
        name
        for name in table
        if name.startswith(prefixes) and name.count(".") == _depth(name, prefixes)
    ]


def _depth(name: str, prefixes: tuple[str, ...]) -> int:
    """Tensors directly under a shard (``<shard>.<leaf>``), not under a child module."""
    for prefix in prefixes:
        if name.startswith(prefix):
            return prefix.count(".")
    return -1
