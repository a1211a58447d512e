"""Loss scaling: the loss scalers and their checkpoint, GradScaler, scale_loss and the finite-loss
flag. scale_loss drives the gradient stash and skip decision of the optimizers it unscales for
(amp/weights), which sit below it; unscaling runs on amp/kernels."""
