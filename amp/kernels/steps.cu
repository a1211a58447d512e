// The fused master steps over FP32 masters and moments in torch's format (the "steps" family):
// AdamW / Adam and SGD, one pass per chunk (the low-precision gradient unscaled, the FP32 master
// and the optimizer's state updated in place, the low-precision weight written).

// Over lists (gradient G, FP32 master, exp_avg, exp_avg_sq, low-precision weight L or 0, step):
// the gradient times *inv (none: inv == nullptr), the master and the moments updated in place,
// the weight written, at step *step + 1. Nothing happens where *found != 0 (a skipped step);
// amp_count_steps then adds the step.
template <typename G, typename L>
__global__ void __launch_bounds__(amp::kBlock)
amp_adam(const AMP_GRID_CONSTANT amp::Meta<6> meta, const float* inv, const float* found,
         double lr, double beta1, double beta2, double eps, double weight_decay,
         long long decoupled, long long chunk) {
  if (found != nullptr && *found != 0.0f) return;
  const int total = meta.chunk_start[meta.ntensors];
  int scalars_of = -1;  // the tensor whose step `s` holds: a block's chunks follow each other
  amp::AdamScalars s;
  for (int c = blockIdx.x; c < total; c += gridDim.x) {
    const int t = amp::tensor_of(meta, c);
    long long first, n;
    amp::chunk_range(meta, t, c, chunk, first, n);
    if (t != scalars_of) {
      const float step = amp::add_rn(*reinterpret_cast<const float*>(meta.ptr[5][t]), 1.0f);
      s = amp::adam_scalars(lr, beta1, beta2, eps, weight_decay, step);
      scalars_of = t;
    }
    const amp::MasterList<amp::Exact<L>> master(meta.ptr[1][t], meta.ptr[4][t], first);
    const amp::MomentList<float, true> exp_avg(meta.ptr[2][t], 0, first, 0u, nullptr);
    const amp::MomentList<float, false> exp_avg_sq(meta.ptr[3][t], 0, first, 0u, nullptr);
    amp::adam_chunk(reinterpret_cast<const G*>(meta.ptr[0][t]) + first, master, exp_avg,
                    exp_avg_sq, n, s, decoupled != 0, weight_decay != 0.0, inv);
  }
}

// The step counts of an amp_adam launch's tensors (list 5), one more each unless *found != 0
// (block 0 does it: the launch's grid is the amp_adam launch's).
__global__ void __launch_bounds__(amp::kBlock)
amp_count_steps(const AMP_GRID_CONSTANT amp::Meta<6> meta, const float* found) {
  amp::count_steps(meta, 5, found);
}

// The fused master step of SGD over lists (gradient G, FP32 master, momentum buffer or 0,
// low-precision weight L or 0), as amp_adam.
template <typename G, typename L>
__global__ void __launch_bounds__(amp::kBlock)
amp_sgd(const AMP_GRID_CONSTANT amp::Meta<4> meta, const float* inv, const float* found,
        double lr, double momentum, double dampening, double weight_decay, long long nesterov,
        long long chunk) {
  if (found != nullptr && *found != 0.0f) return;
  const amp::SgdScalars s = amp::sgd_scalars(lr, momentum, dampening, weight_decay);
  const bool with_momentum = momentum != 0.0;
  const int total = meta.chunk_start[meta.ntensors];
  for (int c = blockIdx.x; c < total; c += gridDim.x) {
    const int t = amp::tensor_of(meta, c);
    long long first, n;
    amp::chunk_range(meta, t, c, chunk, first, n);
    const amp::MasterList<amp::Exact<L>> master(meta.ptr[1][t], meta.ptr[3][t], first);
    const amp::MomentList<float, true> buffer(with_momentum ? meta.ptr[2][t] : 0, 0, first, 0u,
                                              nullptr);
    amp::sgd_chunk(reinterpret_cast<const G*>(meta.ptr[0][t]) + first, master, buffer, n, s,
                   weight_decay != 0.0, with_momentum, nesterov != 0, false, inv);
  }
}
