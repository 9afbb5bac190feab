"""What a processor is told about a run when it says how much memory it holds (``--max_memory``).

The memory estimate (:mod:`msquant.run.memory_estimate`) runs on the weightless model before any
weight is loaded. It counts the runner's own memory (the layer's weights, the calibration hidden
states, the layer's call arguments, one batch's forward) and asks every processor, through
:meth:`msquant.plugin.Processor.memory_bytes`, what it holds on top while the run works on one
decoder layer; the processors are told the calibration set's size in a :class:`CalibrationSize`.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["CalibrationSize"]


@dataclass(frozen=True)
class CalibrationSize:
    """The calibration data a layer sees, as the memory estimate knows it before the run.

    :param tokens: calibration tokens pushed through each layer by this process (0 when no
        processor calibrates).
    :param longest: tokens of the longest calibration sample.
    :param batch_tokens: the most tokens of one calibration batch.
    :param dtype_bytes: bytes of one value of the model's activations (its dtype: 2 for
        bfloat16, 4 for float32).
    """

    tokens: int
    longest: int
    batch_tokens: int
    dtype_bytes: int
