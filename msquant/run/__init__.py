"""Run mechanics: ``quantize()`` as a sequence of named steps, the layer-wise runner, how a run
holds its model, calibration capture, the output head stage, the memory estimate and checkpoints."""
