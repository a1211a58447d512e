"""apex.parallel.SyncBatchNorm and convert_syncbn_model, on torch.nn.SyncBatchNorm.

On CUDA (and torch's other accelerators) torch's SyncBatchNorm does the work. On CPU, where
torch's refuses to synchronise, the batch statistics are all-reduced here (two small
collectives: the sums and counts, then the squared deviations; their gradients all-reduced in
backward), in float32, with torch's running-statistics update (unbiased variance).
apex's `channel_last=True` (channels in the last dimension of the input) and `fuse_relu`
(with the optional residual `z` added before the ReLU) are honoured.
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F


class _AllReduceSum(torch.autograd.Function):
    """The sum over ranks, whose gradient is the sum over ranks of the gradients."""

    @staticmethod
    def forward(ctx, tensor, group):
        ctx.group = group
        tensor = tensor.clone()
        dist.all_reduce(tensor, group=group)
        return tensor

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def all_reduce(tensor, group):
    return _AllReduceSum.apply(tensor, group)


class SyncBatchNorm(torch.nn.SyncBatchNorm):
    def __init__(
        self,
        num_features,
        eps=1e-5,
        momentum=0.1,
        affine=True,
        track_running_stats=True,
        process_group=None,
        channel_last=False,
        fuse_relu=False,
        device=None,
        dtype=None,
    ):
        super().__init__(
            num_features, eps, momentum, affine, track_running_stats, process_group, device, dtype
        )
        self.channel_last = channel_last
        self.fuse_relu = fuse_relu

    def forward(self, input, z=None):
        channels_last = self.channel_last and input.dim() > 2
        x = input.movedim(-1, 1) if channels_last else input
        out = self._normalise(x)
        if channels_last:
            out = out.movedim(1, -1)
        if z is not None:
            out = out + z
        return F.relu(out) if self.fuse_relu else out

    def _group(self):
        return self.process_group or dist.group.WORLD

    def _normalise(self, x):
        if x.device.type != "cpu":
            return super().forward(x)
        if self.training and dist.is_initialized() and dist.get_world_size(self._group()) > 1:
            return self._cpu_synchronised(x)
        # Once a process group exists, torch's SyncBatchNorm refuses CPU input even in a
        # one-rank group; plain batch norm is what it would compute there.
        return torch.nn.modules.batchnorm._BatchNorm.forward(self, x)

    def _cpu_synchronised(self, x):
        self._check_input_dim(x)
        group = self._group()
        momentum = 0.0 if self.momentum is None else self.momentum
        if self.track_running_stats:
            self.num_batches_tracked.add_(1)
            if self.momentum is None:  # cumulative moving average, as torch
                momentum = 1.0 / self.num_batches_tracked.item()
        dims = [0, *range(2, x.dim())]
        shape = [1, -1] + [1] * (x.dim() - 2)
        values = x.float()
        local_count = values.new_tensor([x.numel() / x.size(1)])
        totals = all_reduce(torch.cat([values.sum(dims), local_count]), group=group)
        count = totals[-1].detach()
        if count.item() <= 1:
            raise ValueError(
                "SyncBatchNorm expected more than 1 value per channel when training over all "
                f"ranks; got input size {tuple(x.shape)} with {int(count.item())} in all."
            )
        mean = totals[:-1] / count
        centered = values - mean.view(shape)
        var = all_reduce(centered.pow(2).sum(dims), group=group) / count
        out = centered * torch.rsqrt(var + self.eps).view(shape)
        if self.weight is not None:
            out = out * self.weight.float().view(shape) + self.bias.float().view(shape)
        if self.track_running_stats:
            with torch.no_grad():
                unbiased = var * (count / (count - 1))
                self.running_mean.mul_(1 - momentum).add_(
                    mean.to(self.running_mean), alpha=momentum
                )
                self.running_var.mul_(1 - momentum).add_(
                    unbiased.to(self.running_var), alpha=momentum
                )
        return out.to(x.dtype)


def convert_syncbn_model(module, process_group=None, channel_last=False):
    """Replace every BatchNorm (not InstanceNorm) in `module` by apex.parallel.SyncBatchNorm,
    sharing its running statistics and copying its weight and bias, as apex did; returns the
    converted module (a new one where `module` itself is a BatchNorm)."""
    converted = module
    if isinstance(module, torch.nn.modules.batchnorm._BatchNorm) and not isinstance(
        module, torch.nn.modules.instancenorm._InstanceNorm
    ):
        # On the layer's device and in its dtype, as apex (which took the layer's tensors): a
        # model converted after .cuda() or .double() keeps working.
        like = module.weight if module.affine else module.running_mean
        factory = {} if like is None else {"device": like.device, "dtype": like.dtype}
        converted = SyncBatchNorm(
            module.num_features,
            module.eps,
            module.momentum,
            module.affine,
            module.track_running_stats,
            process_group,
            channel_last=channel_last,
            **factory,
        )
        converted.running_mean = module.running_mean
        converted.running_var = module.running_var
        converted.num_batches_tracked = module.num_batches_tracked
        if module.affine:
            with torch.no_grad():
                for name in ("weight", "bias"):
                    # A frozen layer stays frozen: the optimizer built next must not train it.
                    new, old = getattr(converted, name), getattr(module, name)
                    new.copy_(old)
                    new.requires_grad_(old.requires_grad)
        converted.train(module.training)
    for name, child in module.named_children():
        converted.add_module(name, convert_syncbn_model(child, process_group, channel_last))
    return converted


def create_syncbn_process_group(group_size):
    """apex's helper: split the world into groups of `group_size` consecutive ranks and return
    this rank's group (None for group_size 0: the whole world)."""
    if group_size == 0:
        return None
    world_size = dist.get_world_size()
    if group_size < 0 or world_size % group_size:
        raise ValueError(
            f"create_syncbn_process_group: group_size must divide the world size {world_size}; "
            f"got {group_size}."
        )
    rank, mine = dist.get_rank(), None
    for first in range(0, world_size, group_size):
        group = dist.new_group(ranks=list(range(first, first + group_size)))  # every rank joins
        if first <= rank < first + group_size:
            mine = group
    return mine
