"""Streamed weights: a model whose decoder layers stay on disk until the runner needs them.

transformers loads the model with every decoder layer offloaded to ``"disk"`` through accelerate.
For a safetensors checkpoint accelerate's offload index points into the original shard files, so
nothing is copied; only weights that transformers converts while loading (for instance experts
that it fuses) are re-saved into the offload folder. msquant takes the per-tensor sources from
accelerate's hooks, removes the hooks (the runner places layers itself), and then materialises one
layer at a time (:meth:`StreamedWeights.materialize`) and returns it to the meta device once its
export is written (:meth:`StreamedWeights.release`). Peak memory is then one layer plus the
modules outside the layer stack, whatever the depth of the model.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import inspect
import logging
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import nn

from msquant.errors import ModelLoadError
from msquant.load.integrity import check_finite
from msquant.load.model_folder import load_causal_lm

__all__ = [
    "StreamedWeights",
    "collect_new_objects_only",
    "load_causal_lm_streaming",
    "streaming_device_map",
    "trim_host_memory",
]

logger = logging.getLogger(__name__)

TensorSource = Callable[[], torch.Tensor]


class StreamedWeights:
    """Where each offloaded tensor of a model is, and how to load it back.

    :param sources: full tensor name (``model.layers.3.mlp.down_proj.weight``) -> a function
        reading that tensor from disk.
    """

    def __init__(self, sources: dict[str, TensorSource]) -> None:
        self.sources = sources
        self.loaded_bytes = 0

    def __contains__(self, name: object) -> bool:
        return name in self.sources

    def __len__(self) -> int:
        return len(self.sources)

    def materialize(self, module: nn.Module, prefix: str) -> None:
        """Read every meta parameter and buffer of ``module`` (full name ``prefix``) from disk.

        :raises ModelLoadError: for a meta tensor that has no source on disk, or a tensor holding
            NaN/Inf.
        """
        for name, tensor in _tensors(module):
            if not tensor.is_meta:
                continue
            full = f"{prefix}.{name}" if prefix else name
            source = self.sources.get(full)
            if source is None:
                raise ModelLoadError(
                    f"{full} is not loaded and has no source in the checkpoint; this model cannot "
                    "be streamed: set spec.runner: model_wise to load it whole"
                )
            value = source()
            if tuple(value.shape) != tuple(tensor.shape):
                raise ModelLoadError(
                    f"{full}: the checkpoint holds shape {tuple(value.shape)}, the model expects "
                    f"{tuple(tensor.shape)}"
                )
            check_finite([(full, value)])
            _set_tensor(module, name, value.to(tensor.dtype))
            self.loaded_bytes += value.numel() * value.element_size()

    @staticmethod
    def release(module: nn.Module) -> None:
        """Return every parameter and buffer of ``module`` to the meta device (frees its memory),
        then hand the freed memory back to the operating system (:func:`trim_host_memory`).

        The module keeps its structure (quantized modules included), so names and shapes can still
        be listed; reading a released tensor's data is an error.
        """
        module.to("meta")
        trim_host_memory()


def trim_host_memory() -> None:
    """Collect garbage and ask the C allocator to return free heap memory to the system.

    glibc keeps freed blocks of up to 32 MiB in its heap once larger ones were freed (its mmap
    threshold grows), so without this the resident memory of a streamed run grew by about one
    layer's worth per layer although nothing was alive (measured: 432 MiB flat with the trim,
    1.86 GiB after 16 layers without). A no-op where the C library has no ``malloc_trim``.

    Without the collection (the reference cycles holding a layer's tensors are broken at their
    source) a random 12-layer model peaked lower, but SmolLM2-135M's CLI run peaked at 941 MiB
    instead of 858 MiB, so it stays; inside the layer loop it traverses only the objects made
    since the loop began (:func:`collect_new_objects_only`), not the whole process's
    (docs/performance.md).
    """
    gc.collect()
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)


@contextmanager
def collect_new_objects_only() -> Iterator[None]:
    """Within the block, collections leave alone every object alive when it began.

    A full collection traverses every tracked object of the process (the imported libraries',
    the model's modules): 0.25-0.5 s per layer on SmolLM2-135M, where the per-layer collection
    of :func:`trim_host_memory` only needs what the layer made. The objects alive at entry are
    moved to the collector's permanent generation (``gc.freeze``, after one full collection so
    that no garbage is frozen) and given back on exit (``gc.unfreeze``). Cyclic garbage made of
    objects that were alive at entry waits until the block ends. Where objects are frozen
    already (the embedding application froze them), it leaves the collector's state alone.
    """
    if gc.get_freeze_count() > 0:
        yield
        return
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def _find_malloc_trim() -> Callable[[int], int] | None:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim: Callable[[int], int] = libc.malloc_trim
    except (OSError, AttributeError):
        return None
    return trim


_MALLOC_TRIM = _find_malloc_trim()


def _tensors(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Parameters and buffers of ``module`` by relative name (tied tensors once)."""
    seen: set[int] = set()
    result = []
    for name, tensor in [*module.named_parameters(), *module.named_buffers()]:
        if id(tensor) not in seen:
            seen.add(id(tensor))
            result.append((name, tensor))
    return result


def _set_tensor(module: nn.Module, name: str, value: torch.Tensor) -> None:
    """Replace the parameter or buffer ``name`` (dotted, relative to ``module``) by ``value``."""
    owner_name, _, attr = name.rpartition(".")
    owner = module.get_submodule(owner_name) if owner_name else module
    if attr in owner._parameters:
        old = owner._parameters[attr]
        requires_grad = bool(old.requires_grad) if old is not None else False
        owner._parameters[attr] = nn.Parameter(value, requires_grad=requires_grad)
    else:
        owner._buffers[attr] = value


def streaming_device_map(model: nn.Module, streamed: Sequence[str]) -> dict[str, str]:
    """An accelerate ``device_map`` that puts the ``streamed`` modules on ``"disk"`` and every
    other module on ``"cpu"`` (the modules on the paths to them are split into their children).

    :raises ModelLoadError: when a module on such a path holds tensors of its own (no device map
        can then place it apart from its children).
    """
    targets = set(streamed)
    device_map: dict[str, str] = {}

    def visit(module: nn.Module, prefix: str) -> None:
        own = [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]
        if own:
            raise ModelLoadError(
                f"{prefix or type(module).__name__} holds tensors of its own beside the decoder "
                "layers; this model cannot be streamed: set spec.runner: model_wise"
            )
        for name, child in module.named_children():
            full = f"{prefix}.{name}" if prefix else name
            if full in targets:
                device_map[full] = "disk"
            elif any(t.startswith(full + ".") for t in targets):
                visit(child, full)
            else:
                device_map[full] = "cpu"

    visit(model, "")
    missing = targets - set(device_map)
    if missing:
        raise ModelLoadError(f"modules to stream not found in the model: {sorted(missing)}")
    return device_map


def load_causal_lm_streaming(
    path: Path,
    meta_model: nn.Module,
    streamed: Sequence[str],
    offload_dir: Path,
    trust_remote_code: bool = False,
) -> tuple[nn.Module, StreamedWeights]:
    """Load the model with the ``streamed`` modules (the decoder layers) left on disk.

    :param meta_model: a weightless instance of the same model (for the module tree).
    :param offload_dir: an empty folder for the tensors transformers converts while loading
        (fused experts, say); the caller removes it after the run.
    :returns: the model (streamed modules on the meta device, the rest on the CPU in the
        checkpoint's dtype, eval mode) and the sources of its offloaded tensors.
    """
    from accelerate.hooks import remove_hook_from_module

    device_map = streaming_device_map(meta_model, streamed)
    model = load_causal_lm(
        path, trust_remote_code, device_map=device_map, offload_folder=str(offload_dir)
    )
    sources = _offloaded_sources(model)
    remove_hook_from_module(model, recurse=True)
    _drop_bound_forwards(model)
    logger.info(
        "streaming: %d tensors of %d module(s) stay on disk until their layer runs",
        len(sources),
        len(streamed),
    )
    return model, StreamedWeights(sources)


def _drop_bound_forwards(model: nn.Module) -> None:
    """Remove the ``forward`` attribute accelerate's hook removal leaves on each module (the
    module's own class ``forward``, bound to it), so that the class's is called again.

    That bound method refers back to its module: a reference cycle per module, which kept every
    float linear layer ``linear_quant`` replaced, with its weight, alive until the next full
    garbage collection (measured: 7 replaced layers and their weights per decoder layer).
    """
    for module in model.modules():
        bound = vars(module).get("forward")
        if (
            inspect.ismethod(bound)
            and bound.__self__ is module
            and bound.__func__ is getattr(type(module), "forward", None)
        ):
            del module.forward


def _offloaded_sources(model: nn.Module) -> dict[str, TensorSource]:
    """Tensor name -> loader, from the weights maps of accelerate's offload hooks."""
    sources: dict[str, TensorSource] = {}
    for module_name, module in model.named_modules():
        hook: Any = getattr(module, "_hf_hook", None)
        weights_map = getattr(hook, "weights_map", None)
        if not getattr(hook, "offload", False) or weights_map is None:
            continue
        for name, tensor in [
            *module.named_parameters(recurse=False),
            *module.named_buffers(recurse=False),
        ]:
            if tensor.is_meta:
                full = f"{module_name}.{name}" if module_name else name
                sources[full] = _loader(weights_map, name)
    return sources


def _loader(weights_map: Any, key: str) -> TensorSource:
    def load() -> torch.Tensor:
        return torch.as_tensor(weights_map[key])

    return load
