"""The quantization plan: which scheme every linear layer gets, and who decided, before any weight
is loaded.

Quantizing processors (``linear_quant``) describe their per-module decisions through the
:class:`~msquant.planning.model.ModulePlanner` protocol; this package combines the decisions of
every ``spec.process`` entry on a weightless (meta) copy of the model and checks what no single
entry can see:

* a module selected by two entries is an error (naming the module and both ``spec.process[i]``);
* an output head (``lm_head``) tied to the input embeddings cannot be quantized (error naming the
  model, ``tie_word_embeddings`` and the fix);
* the shards of a layer vLLM fuses (q/k/v, gate/up) must resolve alike across entries (the
  entries check their own shards in ``check_model``);
* warnings: ``include`` patterns and ``dynamic`` rules matching nothing, and rules that match a
  fused name (what vLLM / SGLang match) differently from its shards (what msquant matches);
* what the savers' consumers will not load: processors implementing :class:`~msquant.planning.model.PlanReviewer`
  (savers, usually) check the finished plan and add their own errors and warnings, so that a
  run refuses or warns before weights load and ``msquant plan`` shows the same messages.

Modules: :mod:`~msquant.planning.model` (the plan's data and the protocols processors implement),
:mod:`~msquant.planning.analysis` (:func:`~msquant.planning.analysis.check_plan` is what a run calls after
the processors' own ``check_model``), :mod:`~msquant.planning.problems` (the cross-entry checks),
:mod:`~msquant.planning.build` (``msquant plan``: :func:`~msquant.planning.build.plan` and
:func:`~msquant.planning.build.build_plan` return the table) and :mod:`~msquant.planning.render`.
"""
