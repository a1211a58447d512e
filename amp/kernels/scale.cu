// The element loops of the unscale, copy and check kernels (unscale.cu, copies.cu): a chunk read
// in vectors of kVec elements, kUnroll of them in flight per thread, the rest one by one.

namespace amp {

constexpr int kVec = 4;      // elements per vector access
constexpr int kUnroll = 2;   // vectors per thread per iteration

template <typename T>
struct alignas(sizeof(T) * kVec) Vec {
  T x[kVec];
};

// Calls op(in_value) -> out_value over every element of `chunk` of tensor `t`, reading list 0
// (type In) and writing list Depth-1 (type Out); `bad` collects non-finite inputs.
template <typename In, typename Out, bool Accumulate, bool Check, int Depth>
__device__ __forceinline__ void scale_chunk(const Meta<Depth>& meta, int t, long long first,
                                            long long n, float scale, bool use_scale, bool& bad) {
  const In* src = reinterpret_cast<const In*>(meta.ptr[0][t]) + first;
  Out* dst = reinterpret_cast<Out*>(meta.ptr[Depth - 1][t]) + first;
  const bool aligned = ((reinterpret_cast<unsigned long long>(src) % sizeof(Vec<In>)) == 0) &&
                       ((reinterpret_cast<unsigned long long>(dst) % sizeof(Vec<Out>)) == 0);
  long long done = 0;
  if (aligned) {
    const long long vectors = n / kVec;
    const Vec<In>* src_v = reinterpret_cast<const Vec<In>*>(src);
    Vec<Out>* dst_v = reinterpret_cast<Vec<Out>*>(dst);
    // kUnroll independent vector loads per thread are in flight before the first store.
    for (long long base = threadIdx.x; base < vectors; base += kBlock * kUnroll) {
      Vec<In> in[kUnroll];
      Vec<Out> out[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const long long v = base + u * kBlock;
        if (v < vectors) {
          in[u] = src_v[v];
          if (Accumulate) out[u] = dst_v[v];
        }
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const long long v = base + u * kBlock;
        if (v < vectors) {
#pragma unroll
          for (int k = 0; k < kVec; ++k) {
            float value = to_float<In>(in[u].x[k]);
            if (Check) bad |= is_nonfinite(value);
            if (use_scale) value = mul_rn(value, scale);
            if (Accumulate) value = add_rn(to_float<Out>(out[u].x[k]), value);
            out[u].x[k] = from_float<Out>(value);
          }
          dst_v[v] = out[u];
        }
      }
    }
    done = vectors * kVec;
  }
  for (long long i = done + threadIdx.x; i < n; i += kBlock) {
    float value = to_float<In>(src[i]);
    if (Check) bad |= is_nonfinite(value);
    if (use_scale) value = mul_rn(value, scale);
    if (Accumulate) value = add_rn(to_float<Out>(dst[i]), value);
    dst[i] = from_float<Out>(value);
  }
}

template <typename In, typename Out, bool Accumulate, int Depth>
__device__ __forceinline__ void scale_all(const Meta<Depth>& meta, const float* scale_ptr,
                                          float* found_inf, long long chunk) {
  // scale_ptr == nullptr: convert only; found_inf == nullptr: no check.
  const bool use_scale = scale_ptr != nullptr;
  const float scale = use_scale ? *scale_ptr : 1.0f;
  const int total = meta.chunk_start[meta.ntensors];
  bool bad = false;
  for (int c = blockIdx.x; c < total; c += gridDim.x) {
    const int t = tensor_of(meta, c);
    const long long first = static_cast<long long>(c - meta.chunk_start[t]) * chunk;
    const long long remaining = meta.numel[t] - first;
    const long long n = remaining < chunk ? remaining : chunk;
    if (found_inf != nullptr) {
      scale_chunk<In, Out, Accumulate, true, Depth>(meta, t, first, n, scale, use_scale, bad);
    } else {
      scale_chunk<In, Out, Accumulate, false, Depth>(meta, t, first, n, scale, use_scale, bad);
    }
  }
  // One write per block; the flag is only ever set, never cleared.
  if (__syncthreads_or(bad) && threadIdx.x == 0 && found_inf != nullptr) {
    *found_inf = 1.0f;
  }
}

// Whether any of the n values at src is inf/NaN (this thread's share; the caller reduces).
template <typename T>
__device__ __forceinline__ bool any_nonfinite(const T* src, long long n) {
  bool bad = false;
  const bool aligned = (reinterpret_cast<unsigned long long>(src) % sizeof(Vec<T>)) == 0;
  long long done = 0;
  if (aligned) {
    const long long vectors = n / kVec;
    const Vec<T>* src_v = reinterpret_cast<const Vec<T>*>(src);
    for (long long v = threadIdx.x; v < vectors; v += kBlock) {
      const Vec<T> in = src_v[v];
#pragma unroll
      for (int k = 0; k < kVec; ++k) bad |= is_nonfinite(to_float<T>(in.x[k]));
    }
    done = vectors * kVec;
  }
  for (long long i = done + threadIdx.x; i < n; i += kBlock) bad |= is_nonfinite(to_float<T>(src[i]));
  return bad;
}

}  // namespace amp
