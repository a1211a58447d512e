// Multi-tensor kernels for amp: unscale with inf/NaN detection, scaled copy (model grads -> FP32
// master grads, FP32 masters -> model params), scaled accumulate, and the L2 norm.
//
// Plain CUDA C++: nvcc compiles it on its own (CI does, for sm_70/80/90), and CuPy loads it as a
// RawModule. The host passes one Meta struct by value per launch: per-tensor pointers, element
// counts and the prefix sum of chunks. A block finds the tensor of its chunk by binary search, so
// there is no per-block table and no cap on blocks per launch.
//
// Numerics match torch's: values are read as float, multiplied and added in float with round to
// nearest, and stored with round to nearest even (one rounding into the destination's type). The
// L2 norm sums squares in double. CuPy always compiles with -ftz=true, which would
// flush subnormals in float arithmetic; the multiply and add are therefore written in inline PTX
// (mul.rn.f32 / add.rn.f32, which take no .ftz), and the bfloat16 store is done on the bits.

#include <cuda_fp16.h>
#include <cuda_bf16.h>

#ifndef AMP_MAX_TENSORS_D1
#define AMP_MAX_TENSORS_D1 144
#endif
#ifndef AMP_MAX_TENSORS_D2
#define AMP_MAX_TENSORS_D2 104
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
