// How the fused steps walk a chunk: each thread steps kStepElements consecutive elements per trip
// (step_lists.cu's groups), step_math.cu's element functions stepping them.

namespace amp {

// The group of a trip that lane `lane` steps: its first element (in the chunk) and how many of
// its elements lie in the chunk's n.
__device__ __forceinline__ int group_count(long long i, long long n) {
  const long long left = n - i;
  return left <= 0 ? 0 : (left < kStepElements ? static_cast<int>(left) : kStepElements);
}

// The trips over one chunk's n elements, each lane's group from element i: trip(i, count, vector)
// where `vector` (a compile-time constant) says all kStepElements are in the chunk and every list
// aligned. Every lane of a warp makes the same trips (the coded moments' stores shuffle): the
// warps' trips over whole groups first, then the one trip of the tail (or all, unaligned), so the
// whole-group trips compile without the tail's branches.
template <typename Trip>
__device__ __forceinline__ void trips(long long n, bool aligned, const Trip& trip) {
  const int lane = threadIdx.x % kWarp;
  long long base = (threadIdx.x - lane) * kStepElements;
  if (aligned) {
#pragma unroll 1
    for (; base + kWarp * kStepElements <= n; base += kTrip) {
      trip(base + lane * kStepElements, kStepElements, Vector<true>());
    }
  }
#pragma unroll 1
  for (; base < n; base += kTrip) {
    const long long i = base + lane * kStepElements;
    trip(i, group_count(i, n), Vector<false>());
  }
}

// Steps one chunk of AdamW / Adam: its n elements from `grad` (times *inv where inv is given),
// the master and the moments in their forms, at the step of `s`.
template <bool Decay, bool Decoupled, typename G, typename Master, typename Moment>
__device__ __forceinline__ void adam_trips(const G* grad, const MasterList<Master>& master,
                                           const MomentList<Moment, true>& exp_avg,
                                           const MomentList<Moment, false>& exp_avg_sq,
                                           long long n, const AdamScalars& s, const float* inv) {
  using GradBits = typename Bits<G>::type;
  const GradBits* grad_bits = reinterpret_cast<const GradBits*>(grad);
  const float scale = inv != nullptr ? *inv : 1.0f;  // (a branch per element would double the loop)
  const int lane = threadIdx.x % kWarp;
  const bool aligned = group_aligned(grad_bits) && master.aligned() && exp_avg.aligned() &&
                       exp_avg_sq.aligned();
  trips(n, aligned, [&](long long i, int count, auto vector) {
    float g[kStepElements], p[kStepElements], m[kStepElements], v[kStepElements];
    float root[kStepElements];
    load_floats<G>(grad_bits + i, count, vector, g);
    master.load(i, count, vector, p);
    exp_avg.load(i, count, vector, m);
    exp_avg_sq.load(i, count, vector, v);
#pragma unroll
    for (int k = 0; k < kStepElements; ++k) {
      g[k] = mul_rn(g[k], scale);  // by 1 without a scaler: the same bits where they count
      adam_element<Decay, Decoupled>(s, g[k], p[k], m[k], v[k], root[k]);
    }
    master.store(i, count, vector, p);
    exp_avg.store(i, count, vector, lane, m, root);
    exp_avg_sq.store(i, count, vector, lane, v, root);
  });
}

// adam_trips with the group's weight decay as compile-time constants (no branch per element).
template <typename G, typename Master, typename Moment>
__device__ __forceinline__ void adam_chunk(const G* grad, const MasterList<Master>& master,
                                           const MomentList<Moment, true>& exp_avg,
                                           const MomentList<Moment, false>& exp_avg_sq,
                                           long long n, const AdamScalars& s, bool decoupled,
                                           bool decay, const float* inv) {
  if (!decay) {
    adam_trips<false, false>(grad, master, exp_avg, exp_avg_sq, n, s, inv);
  } else if (decoupled) {
    adam_trips<true, true>(grad, master, exp_avg, exp_avg_sq, n, s, inv);
  } else {
    adam_trips<true, false>(grad, master, exp_avg, exp_avg_sq, n, s, inv);
  }
}

// Steps one chunk of SGD, as adam_chunk; `buffer` is read and written only with momentum, and
// not read at the first step (the buffers start as the gradients).
template <typename G, typename Master, typename Moment>
__device__ __forceinline__ void sgd_chunk(const G* grad, const MasterList<Master>& master,
                                          const MomentList<Moment, true>& buffer, long long n,
                                          const SgdScalars& s, bool decay, bool with_momentum,
                                          bool nesterov, bool first_step, const float* inv) {
  using GradBits = typename Bits<G>::type;
  const GradBits* grad_bits = reinterpret_cast<const GradBits*>(grad);
  const float scale = inv != nullptr ? *inv : 1.0f;
  const int lane = threadIdx.x % kWarp;
  const bool aligned = group_aligned(grad_bits) && master.aligned() && buffer.aligned();
  trips(n, aligned, [&](long long i, int count, auto vector) {
    float g[kStepElements], p[kStepElements], buf[kStepElements];
    load_floats<G>(grad_bits + i, count, vector, g);
    master.load(i, count, vector, p);
    if (with_momentum && !first_step) {
      buffer.load(i, count, vector, buf);
    } else {
#pragma unroll
      for (int k = 0; k < kStepElements; ++k) buf[k] = 0.0f;
    }
#pragma unroll
    for (int k = 0; k < kStepElements; ++k) {
      g[k] = mul_rn(g[k], scale);  // by 1 without a scaler: the same bits where they count
      sgd_element(s, decay, with_momentum, nesterov, g[k], p[k], buf[k], first_step);
    }
    master.store(i, count, vector, p);
    if (with_momentum) buffer.store(i, count, vector, lane, buf, buf);
  });
}

}  // namespace amp
