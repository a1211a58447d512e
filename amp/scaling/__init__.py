"""Loss scaling: the loss scalers, GradScaler, scale_loss and its gradient stash, and the skip
decisions and overflow reports of the steps an overflow skips. Unscaling runs on amp/kernels."""
