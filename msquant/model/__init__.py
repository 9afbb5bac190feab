"""Architecture knowledge only: the :class:`~msquant.model.adapter.ModelAdapter` contract and its
registry keyed by ``config.model_type`` (:mod:`msquant.model.adapter_registry`), and the generic
heuristics the default adapter answers with (decoder layers, head and final norm, fused shard
groups, MoE experts, checkpoint names, module-name matching). Imports nothing from the run
mechanics, the report or the plugin layer."""
