"""What processor authors build on: the processor contract (:mod:`~msquant.plugin.processor`), the
registry that finds processors through entry points (:mod:`~msquant.plugin.registry`) and the run
context processors receive (:mod:`~msquant.plugin.context`)."""
