"""apex.multi_tensor_apply: `multi_tensor_applier`, importable (apex code imports it at module
level) and `available = False`, so code that checks it takes its torch path. Its kernels came
from apex's compiled `amp_C`, which does not exist here: calling it raises, naming torch's
multi-tensor (`torch._foreach_*`) functions."""


class MultiTensorApply:
    available = False
    warned = False

    def __init__(self, chunk_size):
        self.chunk_size = chunk_size

    def __call__(self, op, noop_flag_buffer, tensor_lists, *args):
        raise RuntimeError(
            f"apex.multi_tensor_apply.multi_tensor_applier({getattr(op, '__name__', op)!r}, ...) "
            "needs apex's compiled amp_C kernels, which amp's apex compatibility package does "
            "not have (multi_tensor_applier.available is False). Use torch's multi-tensor "
            "functions: torch._foreach_mul_ for multi_tensor_scale, torch._foreach_norm for "
            "multi_tensor_l2norm, or torch.optim's foreach=True / fused=True optimizers."
        )


multi_tensor_applier = MultiTensorApply(2048 * 32)

__all__ = ["MultiTensorApply", "multi_tensor_applier"]
