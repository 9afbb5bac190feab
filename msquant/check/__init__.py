"""Proofs that a function-preserving transform (a smoothing fold, a rotation) keeps the model's
function, computed during the run on a few calibration tokens.

A transform of this kind changes weights into others that compute the same outputs, *provided*
its assumptions about the model hold: which module feeds which, what a norm computes, that a
weight is not shared with another layer. Names and adapters say what the assumptions are; this
package checks them on data, before and after the transform:

* :mod:`~msquant.check.flow`: the data flow of each pair a transform folds across (a norm and
  the linears reading it, a linear and the one reading its output channel by channel), proven
  by scaling the producer's output channels and watching the readers' inputs;
* :mod:`~msquant.check.function`: the layer's output on the probe tokens before and after the
  transform, compared (:mod:`~msquant.check.compare` holds the pure error measures);
* :mod:`~msquant.check.sharing`: weights a fold would change for more than this layer.

The runner provides the probe tokens and the hidden states entering the layer
(:class:`~msquant.check.base.LayerRunner`); a failed proof raises
:class:`msquant.TransformCheckError` (exit code 2) naming the layer, the pair and the fix.
"""
