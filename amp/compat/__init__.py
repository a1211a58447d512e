"""What amp meets that others made: apex's `amp._amp_state`, optimizer wrappers such as apex's
LARC, and torch.distributed's engines (DDP, FSDP, ZeRO) and sharded tensors."""
