"""Loss scaling: the loss scalers, GradScaler, scale_loss and its gradient stash, the finite-loss
flag, and the skip decisions of the steps an overflow skips. Unscaling runs on amp/kernels."""
