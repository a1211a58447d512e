"""O2/O3 weights: model casting with FP32 batch norm, FP32 master weights and shadows, the
optimizer instrumentation (with scale_loss's gradient stash and the skip decision of its steps)
and optimizer state that carry the masters, and the distributed engines amp refuses or follows
(weights/engines.py)."""
