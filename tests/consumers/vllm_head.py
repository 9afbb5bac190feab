"""vLLM 0.33.0's real ``ParallelLMHead``: vocabulary padding, parameters and weight loader.

:mod:`vllm_engine` stubs ``vllm.model_executor.layers.vocab_parallel_embedding`` (the other checks
need its classes only for ``isinstance`` in vLLM's quantization configs). For the quantized-head
vocabulary check (issue 13 §1 #4) the real file is executed here, unchanged, under a private
module name: its ``ParallelLMHead`` pads the vocabulary to a multiple of 64, lets the method that
vLLM's config picked for ``lm_head`` create the parameters of the padded head, and its
``weight_loader`` copies the checkpoint's tensors into them. The method is the real config's
answer for the harness's stand-in head (the class vLLM's quantization code checks with
``isinstance``), handed to the real head as ``quant_method``, which vLLM's constructor accepts
for preselected methods (with the ``scheme`` compressed-tensors' ``get_quant_method`` sets on
the layer).
"""

from __future__ import annotations

import importlib.util
import sys
import types
from typing import Any

import torch
import vllm_engine
from architectures import EngineModule

MODULE = "vllm.model_executor.layers.vocab_parallel_embedding"
#: The private name the real file is executed under (suffixed with the vLLM release).
ALIAS = "msquant_consumers_vllm_vocab_parallel_embedding"


def real_vocab_module() -> types.ModuleType:
    """vLLM's ``vocab_parallel_embedding.py`` from the wheel, executed once."""
    source = vllm_engine.load_vllm()
    alias = f"{ALIAS}_{source.release.version.replace('.', '_')}"  # one per vLLM release
    if alias not in sys.modules:
        path = source.path_of(MODULE.replace(".", "/") + ".py")
        spec = importlib.util.spec_from_file_location(alias, path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[alias] = module
        spec.loader.exec_module(module)
    return sys.modules[alias]


def lm_head(config: Any, module: EngineModule) -> torch.nn.Module:
    """vLLM's real ``ParallelLMHead`` for ``module`` with the method ``config`` picks for
    ``lm_head`` (its own unquantized method when the config picks none)."""
    vocab = real_vocab_module()
    stand_in = vllm_engine.ParallelLMHead(module)
    method = config.get_quant_method(stand_in, prefix=module.prefix)
    # compressed-tensors' get_quant_method also sets the layer's `scheme`, which its
    # create_weights reads from the layer: the real head carries the one set on the stand-in
    head_class = type(
        "ParallelLMHead", (vocab.ParallelLMHead,), {"scheme": getattr(stand_in, "scheme", None)}
    )
    return head_class(
        module.output_size,
        module.input_size,
        params_dtype=vllm_engine.PARAMS_DTYPE,
        prefix=module.prefix,
        quant_method=method,
    )
