"""The contracts a plugin implements or receives, low in the engine: the processor and saver
bases, the quantization-method and export-format contracts with their registries, the run
context and what it carries (distribution, memory sizes, the transform log).

The engine imports these modules directly; plugin authors import the same objects from the
facade :mod:`msquant.plugin` (docs/api.md). Nothing here is re-exported, so importing one of
these modules runs no ``__init__`` that reaches back up into the engine.
"""
