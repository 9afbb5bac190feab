"""``float_sparse``: msModelSlim's W16A16S float sparsity (ADMM pruning of the linear weights)."""
