"""Reading what a run is given, from local files only: a Hugging Face model folder (checks, config,
weightless model, weights whole or streamed layer by layer, tokenizer), checked to be the
checkpoint on disk whole and finite, and the calibration texts."""
