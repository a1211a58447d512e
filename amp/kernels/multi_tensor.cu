// Multi-tensor kernels for amp: unscale with inf/NaN detection, scaled copy (model grads -> FP32
// master grads, FP32 masters -> model params), scaled accumulate, the L2 norm, the inf/NaN check
// alone, and the fused master step of AdamW/Adam and SGD (one pass per chunk: the low-precision
// gradient unscaled, the FP32 master and the optimizer's state updated in place, the
// low-precision weight written).
//
// Plain CUDA C++: nvcc compiles it on its own (CI does, for sm_70/80/90), and CuPy loads it as a
// RawModule. The host passes one Meta struct by value per launch: per-tensor pointers, element
// counts and the prefix sum of chunks. A block finds the tensor of its chunk by binary search, so
// there is no per-block table and no cap on blocks per launch.
//
// Numerics match torch's: values are read as float, multiplied and added in float with round to
// nearest, and stored with round to nearest even (one rounding into the destination's type). The
// L2 norm sums squares in double. The fused steps compute torch's formula operation by operation
// (each rounded once, with the fused multiply-adds torch's CPU kernels use: see adam_element).
// CuPy always compiles with -ftz=true, which would flush subnormals in float arithmetic; the float
// arithmetic is therefore written in inline PTX (mul/add/sub/div/sqrt/fma .rn.f32, which take no
// .ftz), and the bfloat16 store is done on the bits.

#include <cuda_fp16.h>
#include <cuda_bf16.h>

#ifndef AMP_MAX_TENSORS_D1
#define AMP_MAX_TENSORS_D1 144
#endif
#ifndef AMP_MAX_TENSORS_D2
#define AMP_MAX_TENSORS_D2 104
#endif
#ifndef AMP_MAX_TENSORS_D4
#define AMP_MAX_TENSORS_D4 64
#endif
#ifndef AMP_MAX_TENSORS_D6
#define AMP_MAX_TENSORS_D6 48
#endif

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 700
#define AMP_GRID_CONSTANT
#else
#define AMP_GRID_CONSTANT __grid_constant__
#endif

namespace amp {

constexpr int kBlock = 512;  // threads per block
constexpr int kVec = 4;      // elements per vector access
constexpr int kUnroll = 2;   // vectors per thread per iteration

template <int Depth> struct MaxTensors;
template <> struct MaxTensors<1> { static constexpr int value = AMP_MAX_TENSORS_D1; };
template <> struct MaxTensors<2> { static constexpr int value = AMP_MAX_TENSORS_D2; };
template <> struct MaxTensors<4> { static constexpr int value = AMP_MAX_TENSORS_D4; };
template <> struct MaxTensors<6> { static constexpr int value = AMP_MAX_TENSORS_D6; };

// Mirrored field for field by a numpy dtype on the host (amp/kernels/_layout.py).
template <int Depth>
struct Meta {
  unsigned long long ptr[Depth][MaxTensors<Depth>::value];  // data pointers, list by list
  long long numel[MaxTensors<Depth>::value];                 // elements per tensor
  int chunk_start[MaxTensors<Depth>::value + 1];             // first chunk of each tensor
  int ntensors;
};

#ifdef AMP_META_BYTES_D1
static_assert(sizeof(Meta<1>) == AMP_META_BYTES_D1, "Meta<1> layout differs from the host's");
#endif
#ifdef AMP_META_BYTES_D2
static_assert(sizeof(Meta<2>) == AMP_META_BYTES_D2, "Meta<2> layout differs from the host's");
#endif
#ifdef AMP_META_BYTES_D4
static_assert(sizeof(Meta<4>) == AMP_META_BYTES_D4, "Meta<4> layout differs from the host's");
#endif
#ifdef AMP_META_BYTES_D6
static_assert(sizeof(Meta<6>) == AMP_META_BYTES_D6, "Meta<6> layout differs from the host's");
#endif

__device__ __forceinline__ float mul_rn(float a, float b) {
  float r;
  asm("mul.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
}

__device__ __forceinline__ float add_rn(float a, float b) {
  float r;
  asm("add.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
}

__device__ __forceinline__ float sub_rn(float a, float b) {
  float r;
  asm("sub.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
}

__device__ __forceinline__ float div_rn(float a, float b) {
  float r;
  asm("div.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
}

__device__ __forceinline__ float sqrt_rn(float a) {
  float r;
  asm("sqrt.rn.f32 %0, %1;" : "=f"(r) : "f"(a));
  return r;
}

// a * b + c with one rounding.
__device__ __forceinline__ float fma_rn(float a, float b, float c) {
  float r;
  asm("fma.rn.f32 %0, %1, %2, %3;" : "=f"(r) : "f"(a), "f"(b), "f"(c));
  return r;
}

__device__ __forceinline__ bool is_nonfinite(float x) {
  return (__float_as_uint(x) & 0x7f800000u) == 0x7f800000u;
}

template <typename T> __device__ __forceinline__ float to_float(T x);
template <> __device__ __forceinline__ float to_float<float>(float x) { return x; }
template <> __device__ __forceinline__ float to_float<__half>(__half x) { return __half2float(x); }
template <> __device__ __forceinline__ float to_float<__nv_bfloat16>(__nv_bfloat16 x) {
  return __uint_as_float(static_cast<unsigned int>(__bfloat16_as_ushort(x)) << 16);
}

template <typename T> __device__ __forceinline__ T from_float(float x);
template <> __device__ __forceinline__ float from_float<float>(float x) { return x; }
template <> __device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
  // Round to nearest even on the bits (as c10::BFloat16 does); NaN becomes a quiet NaN.
  unsigned int bits = __float_as_uint(x);
  unsigned short out;
  if ((bits & 0x7fffffffu) > 0x7f800000u) {
    out = static_cast<unsigned short>((bits >> 16) | 0x0040u);
  } else {
    out = static_cast<unsigned short>((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
  }
  return __ushort_as_bfloat16(out);
}

// float -> double, exact. -ftz=true flushes a subnormal source of the conversion (cvt.ftz), so
// zeros and subnormals are converted from their bits.
__device__ __forceinline__ double to_double(float x) {
  const unsigned int bits = __float_as_uint(x);
  if ((bits & 0x7f800000u) != 0) return static_cast<double>(x);
  const double magnitude = static_cast<double>(bits & 0x7fffffu) * 0x1p-149;
  return (bits >> 31) != 0 ? -magnitude : magnitude;
}

// double (not negative) -> float, round to nearest even. Below float's normal range -ftz=true
// would flush the conversion to zero: there the float's bits are the value in units of 2**-149.
__device__ __forceinline__ float to_float_keeping_subnormals(double x) {
  if (!(x < 0x1p-126)) return static_cast<float>(x);
  return __uint_as_float(static_cast<unsigned int>(rint(x * 0x1p149)));
}

template <typename T>
struct alignas(sizeof(T) * kVec) Vec {
  T x[kVec];
};

// The tensor owning global chunk `chunk`: the last t with chunk_start[t] <= chunk (tensors with
// no chunks share their start with the next tensor and are never chosen).
template <int Depth>
__device__ __forceinline__ int tensor_of(const Meta<Depth>& meta, int chunk) {
  int lo = 0, hi = meta.ntensors - 1;
  while (lo < hi) {
    int mid = (lo + hi + 1) >> 1;
    if (meta.chunk_start[mid] <= chunk) lo = mid; else hi = mid - 1;
  }
  return lo;
}

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

// The chunk of tensor t that block-stride index c covers: (first element, element count).
template <int Depth>
__device__ __forceinline__ void chunk_range(const Meta<Depth>& meta, int t, int c, long long chunk,
                                            long long& first, long long& n) {
  first = static_cast<long long>(c - meta.chunk_start[t]) * chunk;
  const long long remaining = meta.numel[t] - first;
  n = remaining < chunk ? remaining : chunk;
}

// The hyperparameters of one parameter group, as float where torch's CPU kernels use them as
// float, and the bias corrections of a step (computed in double, as torch does).
struct AdamScalars {
  float decay;          // 1 - lr * weight_decay (AdamW)
  float weight_decay;   // (Adam: added to the gradient)
  float one_minus_beta1, beta2, one_minus_beta2, eps, step_size, bias_correction2_sqrt;
};

__device__ __forceinline__ AdamScalars adam_scalars(double lr, double beta1, double beta2,
                                                    double eps, double weight_decay, float step) {
  AdamScalars s;
  s.decay = static_cast<float>(1.0 - lr * weight_decay);
  s.weight_decay = static_cast<float>(weight_decay);
  s.one_minus_beta1 = static_cast<float>(1.0 - beta1);
  s.beta2 = static_cast<float>(beta2);
  s.one_minus_beta2 = static_cast<float>(1.0 - beta2);
  s.eps = static_cast<float>(eps);
  const double bias_correction1 = 1.0 - pow(beta1, static_cast<double>(step));
  s.step_size = static_cast<float>(lr / bias_correction1);
  s.bias_correction2_sqrt = static_cast<float>(sqrt(1.0 - pow(beta2, static_cast<double>(step))));
  return s;
}

// One element of torch's AdamW / Adam (torch 2.13's fused CPU kernel, which the for-loop and
// foreach implementations match but for the last update), every operation rounded once:
//   AdamW: p = p * (1 - lr wd)         Adam: g = fma(wd, p, g)
//   m = fma(1 - b1, g - m, m)          (torch's lerp)
//   v = fma((1 - b2) g, g, v b2)       (mul_ then addcmul_)
//   d = sqrt(v) / sqrt(1 - b2^t) + eps
//   p = p - (lr / (1 - b1^t)) m / d
__device__ __forceinline__ void adam_element(const AdamScalars& s, bool decoupled, bool decay,
                                             float g, float& p, float& m, float& v) {
  if (decay) {
    if (decoupled) p = mul_rn(p, s.decay);
    else g = fma_rn(s.weight_decay, p, g);
  }
  m = fma_rn(s.one_minus_beta1, sub_rn(g, m), m);
  v = fma_rn(mul_rn(s.one_minus_beta2, g), g, mul_rn(v, s.beta2));
  const float d = add_rn(div_rn(sqrt_rn(v), s.bias_correction2_sqrt), s.eps);
  p = sub_rn(p, div_rn(mul_rn(s.step_size, m), d));
}

// One element of torch's SGD (its for-loop and foreach implementations):
//   g = fma(wd, p, g); buf = fma(1 - dampening, g, buf * momentum);
//   g = nesterov ? fma(momentum, buf, g) : buf; p = fma(-lr, g, p)
struct SgdScalars {
  float weight_decay, momentum, one_minus_dampening, minus_lr;
};

__device__ __forceinline__ void sgd_element(const SgdScalars& s, bool decay, bool with_momentum,
                                            bool nesterov, float g, float& p, float& buf) {
  if (decay) g = fma_rn(s.weight_decay, p, g);
  if (with_momentum) {
    buf = fma_rn(s.one_minus_dampening, g, mul_rn(buf, s.momentum));
    g = nesterov ? fma_rn(s.momentum, buf, g) : buf;
  }
  p = fma_rn(s.minus_lr, g, p);
}

}  // namespace amp

// tensors *= *inv_scale in place; *found_inf = 1 if any element was inf/NaN.
template <typename T>
__global__ void __launch_bounds__(amp::kBlock)
amp_unscale(const AMP_GRID_CONSTANT amp::Meta<1> meta, const float* inv_scale, float* found_inf,
            long long chunk) {
  amp::scale_all<T, T, false, 1>(meta, inv_scale, found_inf, chunk);
}

// dst = src * *scale (scale == nullptr: plain conversion); src checked when found_inf is given.
template <typename In, typename Out>
__global__ void __launch_bounds__(amp::kBlock)
amp_scale_copy(const AMP_GRID_CONSTANT amp::Meta<2> meta, const float* scale, float* found_inf,
               long long chunk) {
  amp::scale_all<In, Out, false, 2>(meta, scale, found_inf, chunk);
}

// dst = dst + src * *scale, each operation rounded; only src is checked.
template <typename In, typename Out>
__global__ void __launch_bounds__(amp::kBlock)
amp_scale_add(const AMP_GRID_CONSTANT amp::Meta<2> meta, const float* scale, float* found_inf,
              long long chunk) {
  amp::scale_all<In, Out, true, 2>(meta, scale, found_inf, chunk);
}

// partial[first_chunk + c] = sum of squares of chunk c of this launch, in double (a fixed order:
// deterministic). The square of a float is exact in double and never flushes or overflows, where
// in float squares below 2**-126 flush to zero under -ftz=true and squares above 2**128 are inf.
template <typename T>
__global__ void __launch_bounds__(amp::kBlock)
amp_sum_squares(const AMP_GRID_CONSTANT amp::Meta<1> meta, double* partial,
                long long first_chunk, long long chunk) {
  __shared__ double shared[amp::kBlock];
  const int total = meta.chunk_start[meta.ntensors];
  for (int c = blockIdx.x; c < total; c += gridDim.x) {
    const int t = amp::tensor_of(meta, c);
    const long long first = static_cast<long long>(c - meta.chunk_start[t]) * chunk;
    const long long remaining = meta.numel[t] - first;
    const long long n = remaining < chunk ? remaining : chunk;
    const T* src = reinterpret_cast<const T*>(meta.ptr[0][t]) + first;
    double sum = 0.0;
    for (long long i = threadIdx.x; i < n; i += amp::kBlock) {
      const double value = amp::to_double(amp::to_float<T>(src[i]));
      sum = fma(value, value, sum);
    }
    shared[threadIdx.x] = sum;
    __syncthreads();
    for (int width = amp::kBlock / 2; width > 0; width >>= 1) {
      if (threadIdx.x < width) shared[threadIdx.x] += shared[threadIdx.x + width];
      __syncthreads();
    }
    if (threadIdx.x == 0) partial[first_chunk + c] = shared[0];
    __syncthreads();
  }
}

// *out = sqrt(sum of partial[0..count)), one block, fixed order, in double; rounded to float.
__global__ void __launch_bounds__(amp::kBlock)
amp_norm_finalize(const double* partial, long long count, float* out) {
  __shared__ double shared[amp::kBlock];
  double sum = 0.0;
  for (long long i = threadIdx.x; i < count; i += amp::kBlock) sum += partial[i];
  shared[threadIdx.x] = sum;
  __syncthreads();
  for (int width = amp::kBlock / 2; width > 0; width >>= 1) {
    if (threadIdx.x < width) shared[threadIdx.x] += shared[threadIdx.x + width];
    __syncthreads();
  }
  if (threadIdx.x == 0) *out = amp::to_float_keeping_subnormals(sqrt(shared[0]));
}

// *found_inf = 1 if any element is inf/NaN, and chunk_bad[first_chunk + c] = whether chunk c of
// this launch holds one (every chunk is written: nothing to clear); nothing else is written.
template <typename T>
__global__ void __launch_bounds__(amp::kBlock)
amp_check(const AMP_GRID_CONSTANT amp::Meta<1> meta, float* found_inf, unsigned char* chunk_bad,
          long long first_chunk, long long chunk) {
  const int total = meta.chunk_start[meta.ntensors];
  bool any = false;
  for (int c = blockIdx.x; c < total; c += gridDim.x) {
    const int t = amp::tensor_of(meta, c);
    long long first, n;
    amp::chunk_range(meta, t, c, chunk, first, n);
    const T* src = reinterpret_cast<const T*>(meta.ptr[0][t]) + first;
    const bool bad = __syncthreads_or(amp::any_nonfinite<T>(src, n));
    if (threadIdx.x == 0) chunk_bad[first_chunk + c] = bad ? 1 : 0;
    any |= bad;
  }
  if (any && threadIdx.x == 0) *found_inf = 1.0f;
}

// The fused master step of AdamW (decoupled) / Adam over lists (gradient G, FP32 master, exp_avg,
// exp_avg_sq, low-precision weight L or 0, step): the gradient times *inv (none: inv == nullptr),
// the master and the moments updated in place, the weight written, at step *step + 1. Nothing
// happens where *found != 0 (a skipped step); amp_count_steps then adds the step.
template <typename G, typename L>
__global__ void __launch_bounds__(amp::kBlock)
amp_adam(const AMP_GRID_CONSTANT amp::Meta<6> meta, const float* inv, const float* found,
         double lr, double beta1, double beta2, double eps, double weight_decay,
         long long decoupled, long long chunk) {
  if (found != nullptr && *found != 0.0f) return;
  const float scale = inv != nullptr ? *inv : 1.0f;
  const int total = meta.chunk_start[meta.ntensors];
  for (int c = blockIdx.x; c < total; c += gridDim.x) {
    const int t = amp::tensor_of(meta, c);
    long long first, n;
    amp::chunk_range(meta, t, c, chunk, first, n);
    const float step = *reinterpret_cast<const float*>(meta.ptr[5][t]) + 1.0f;
    const amp::AdamScalars s = amp::adam_scalars(lr, beta1, beta2, eps, weight_decay, step);
    const G* grad = reinterpret_cast<const G*>(meta.ptr[0][t]) + first;
    float* master = reinterpret_cast<float*>(meta.ptr[1][t]) + first;
    float* exp_avg = reinterpret_cast<float*>(meta.ptr[2][t]) + first;
    float* exp_avg_sq = reinterpret_cast<float*>(meta.ptr[3][t]) + first;
    L* low = meta.ptr[4][t] ? reinterpret_cast<L*>(meta.ptr[4][t]) + first : nullptr;
    for (long long i = threadIdx.x; i < n; i += amp::kBlock) {
      float g = amp::to_float<G>(grad[i]);
      if (inv != nullptr) g = amp::mul_rn(g, scale);
      float p = master[i], m = exp_avg[i], v = exp_avg_sq[i];
      amp::adam_element(s, decoupled != 0, weight_decay != 0.0, g, p, m, v);
      master[i] = p;
      exp_avg[i] = m;
      exp_avg_sq[i] = v;
      if (low != nullptr) low[i] = amp::from_float<L>(p);
    }
  }
}

// The step counts of an amp_adam launch's tensors (list 5), one more each unless *found != 0
// (block 0 does it: the launch's grid is the amp_adam launch's).
__global__ void __launch_bounds__(amp::kBlock)
amp_count_steps(const AMP_GRID_CONSTANT amp::Meta<6> meta, const float* found) {
  if (blockIdx.x != 0 || (found != nullptr && *found != 0.0f)) return;
  for (int t = threadIdx.x; t < meta.ntensors; t += blockDim.x) {
    float* step = reinterpret_cast<float*>(meta.ptr[5][t]);
    *step = amp::add_rn(*step, 1.0f);
  }
}

// The fused master step of SGD over lists (gradient G, FP32 master, momentum buffer or 0,
// low-precision weight L or 0), as amp_adam.
template <typename G, typename L>
__global__ void __launch_bounds__(amp::kBlock)
amp_sgd(const AMP_GRID_CONSTANT amp::Meta<4> meta, const float* inv, const float* found,
        double lr, double momentum, double dampening, double weight_decay, long long nesterov,
        long long chunk) {
  if (found != nullptr && *found != 0.0f) return;
  const float scale = inv != nullptr ? *inv : 1.0f;
  amp::SgdScalars s;
  s.weight_decay = static_cast<float>(weight_decay);
  s.momentum = static_cast<float>(momentum);
  s.one_minus_dampening = static_cast<float>(1.0 - dampening);
  s.minus_lr = static_cast<float>(-lr);
  const bool with_momentum = momentum != 0.0;
  const int total = meta.chunk_start[meta.ntensors];
  for (int c = blockIdx.x; c < total; c += gridDim.x) {
    const int t = amp::tensor_of(meta, c);
    long long first, n;
    amp::chunk_range(meta, t, c, chunk, first, n);
    const G* grad = reinterpret_cast<const G*>(meta.ptr[0][t]) + first;
    float* master = reinterpret_cast<float*>(meta.ptr[1][t]) + first;
    float* buffer = with_momentum ? reinterpret_cast<float*>(meta.ptr[2][t]) + first : nullptr;
    L* low = meta.ptr[3][t] ? reinterpret_cast<L*>(meta.ptr[3][t]) + first : nullptr;
    for (long long i = threadIdx.x; i < n; i += amp::kBlock) {
      float g = amp::to_float<G>(grad[i]);
      if (inv != nullptr) g = amp::mul_rn(g, scale);
      float p = master[i], buf = with_momentum ? buffer[i] : 0.0f;
      amp::sgd_element(s, weight_decay != 0.0, with_momentum, nesterov != 0, g, p, buf);
      master[i] = p;
      if (with_momentum) buffer[i] = buf;
      if (low != nullptr) low[i] = amp::from_float<L>(p);
    }
  }
}

// Every variant amp launches, instantiated so that nvcc compiles all of them too. CuPy finds
// them by these names (amp/kernels/_cupy_backend.py).
template __global__ void amp_unscale<float>(const AMP_GRID_CONSTANT amp::Meta<1>, const float*, float*, long long);
template __global__ void amp_unscale<__half>(const AMP_GRID_CONSTANT amp::Meta<1>, const float*, float*, long long);
template __global__ void amp_unscale<__nv_bfloat16>(const AMP_GRID_CONSTANT amp::Meta<1>, const float*, float*, long long);

#define AMP_PAIR_KERNELS(In, Out)                                                                   \
  template __global__ void amp_scale_copy<In, Out>(const AMP_GRID_CONSTANT amp::Meta<2>, const float*, float*,        \
                                                    long long);                                      \
  template __global__ void amp_scale_add<In, Out>(const AMP_GRID_CONSTANT amp::Meta<2>, const float*, float*,         \
                                                   long long);
AMP_PAIR_KERNELS(float, float)
AMP_PAIR_KERNELS(__half, float)
AMP_PAIR_KERNELS(__nv_bfloat16, float)
AMP_PAIR_KERNELS(float, __half)
AMP_PAIR_KERNELS(float, __nv_bfloat16)
AMP_PAIR_KERNELS(__half, __half)
AMP_PAIR_KERNELS(__nv_bfloat16, __nv_bfloat16)

template __global__ void amp_sum_squares<float>(const AMP_GRID_CONSTANT amp::Meta<1>, double*, long long, long long);
template __global__ void amp_sum_squares<__half>(const AMP_GRID_CONSTANT amp::Meta<1>, double*, long long, long long);
template __global__ void amp_sum_squares<__nv_bfloat16>(const AMP_GRID_CONSTANT amp::Meta<1>, double*, long long, long long);

template __global__ void amp_check<float>(const AMP_GRID_CONSTANT amp::Meta<1>, float*, unsigned char*, long long, long long);
template __global__ void amp_check<__half>(const AMP_GRID_CONSTANT amp::Meta<1>, float*, unsigned char*, long long, long long);
template __global__ void amp_check<__nv_bfloat16>(const AMP_GRID_CONSTANT amp::Meta<1>, float*, unsigned char*, long long, long long);

// G: the gradient's type; L: the low-precision weight's (float: none is written).
#define AMP_STEP_KERNELS(G, L)                                                                                 \
  template __global__ void amp_adam<G, L>(const AMP_GRID_CONSTANT amp::Meta<6>, const float*, const float*,       \
                                          double, double, double, double, double, long long, long long);      \
  template __global__ void amp_sgd<G, L>(const AMP_GRID_CONSTANT amp::Meta<4>, const float*, const float*,        \
                                         double, double, double, double, long long, long long);
AMP_STEP_KERNELS(__half, __half)
AMP_STEP_KERNELS(__nv_bfloat16, __nv_bfloat16)
AMP_STEP_KERNELS(float, float)
