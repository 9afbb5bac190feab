"""Built-in model adapters: per-architecture knowledge the generic heuristics lack, each registered
for its ``config.model_type`` in the ``msquant.model_adapters`` entry-point group."""
