"""O2/O3 weights: model casting with FP32 batch norm and the FP32 values amp keeps behind the
low-precision tensors (the optimizers' tables of masters, the models' buffer tables, their state
dicts); the owner of each optimizer's step (optimizer.py) and its parts: the gradient stash of
scale_loss, the fused master step, the deferred gradients, the skip reports; optimizer state that
carries the masters; and the distributed engines amp refuses or follows (engines.py), FSDP2's
shards at O2 among them (shards.py)."""
