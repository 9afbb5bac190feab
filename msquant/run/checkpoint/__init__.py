"""Checkpoints of a run, and ``--resume``: a killed run continues after its last finished layer.

A checkpointed run keeps its work in a folder named after the save path,
``.{save_path name}.msquant-partial`` beside it::

    .msquant-owner            says msquant created the folder (one without it is never used)
    export/                   the staging folder: moved to the save path once the run is complete
    layers/00000.safetensors  the quantized linears of each finished decoder layer (and its
                              other tensors in a run that transforms weights in memory)
    layers/outside.safetensors  quantized linears outside the layers (the head), at the end
                              (and the other tensors outside the layers, as above)
    hidden-00004-rank0.safetensors  the hidden states entering the next layer (calibrated runs;
                              the transform probe's too), one file per process of a
                              ``dp_layer_wise`` group (its share)
    progress.json             the latest checkpoint, replaced atomically after every layer
    .msquant-scratch-*/       a streamed run's scratch folders (offload index), one per process

``progress.json`` holds the run's fingerprint (versions, config and calibration hashes, model
files, device kind, number of processes), how many layers are finished, the run report's
per-layer records, what the processors recorded of their weight transforms (``ctx.transforms``)
and, per process, its hidden-state file and every processor's
:meth:`~msquant.plugin.Processor.resume_state` (the savers' writer states, in process 0's entry). It is
written to a temporary file, flushed to the disk and renamed over the previous one, after the
files it names (the layer's quantized linears, every process's new hidden states); so whenever a
process is killed, the folder holds one complete checkpoint.

``quantize(..., resume=True)`` (``msquant quant ... --resume``) checks the fingerprint against
the new run's (a difference is a :class:`ResumeError` naming it), captures the calibration inputs
again (cheap and deterministic: embeddings and masks), rebuilds the finished layers'
:class:`~msquant.plugin.QuantizedLinear` modules from ``layers/`` (weightless in a streamed run, as its
released layers are), restores the hidden states, the report and the processors, and runs the
remaining layers. A run whose processors transform weights (smoothing, rotation) also takes up the
probe's hidden states, ``ctx.transforms`` and, with the model in memory, the finished layers'
float tensors; what ``setup`` changed outside the layers (quarot's rotated embedding and head) is
derived again by the resumed run's ``setup``, whose fingerprints must be the checkpoint's.
The export is byte-identical to an uninterrupted run's, the report too apart from its
``*seconds`` fields. A checkpoint of stage ``finished`` (every saver has finalised) resumes
straight at the read-back check, the evaluation and the report.

``dp_layer_wise`` groups (:mod:`msquant.contracts.distributed`): process 0 owns the folder. It alone takes
the lock, decides how the run uses the folder (fresh, resumed, refused: every process gets its
decision, or its error), writes the layer store and ``progress.json``; every process writes its
own hidden-state file, and process 0 commits a layer's checkpoint only once all of them are on
disk (their names and sizes are gathered first). A resumed group must have as many processes as
the interrupted one (each takes up its own share of the hidden states); processes other than 0
rebuild no layer (they run no saver and check nothing). Every process must see the folder at the
same path: for several nodes, a save path on a shared file system.

Policy: every run whose processors are all resumable is checkpointed (opt out with
``checkpoints=False``). A run that fails with an exception removes the folder, as a failed run
always removed its staging folder (nothing is left behind, on a full disk least of all); a run
that is stopped after a checkpoint (killed, ``KeyboardInterrupt`` from Ctrl-C, ``SystemExit``, or
in a ``dp_layer_wise`` group the loss of another process: :class:`~msquant.contracts.distributed.PeerLostError`)
keeps it for ``--resume``, with a warning saying so. The save path itself is never touched
before the export is complete. A later run of the same save path without ``--resume`` is refused
while such a folder exists, unless ``overwrite`` discards it. The folder is removed once the
export is in place.
"""
