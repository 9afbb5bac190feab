"""Loading Hugging Face causal LMs from local directories and walking their decoder layers."""
