"""The built-in quantization methods of ``linear_quant`` (``qconfig.weight.method``), registered
through the ``msquant.methods`` entry-point group: :mod:`.minmax` (round-to-nearest),
:mod:`.gptq` and :mod:`.hessian_clip` (activation-aware clipping). Their typed ``ext`` options
share the fields of :mod:`.options`."""
