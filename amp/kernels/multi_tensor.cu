// Multi-tensor kernels for amp, the part every family of them shares: the launch metadata, the
// float arithmetic that keeps torch's rounding under -ftz=true, the element types' conversions.
// The families (amp/kernels/_sources.py) each add their files to this one and compile alone:
// scale.cu + unscale.cu (unscale with inf/NaN detection, the check alone), scale.cu + copies.cu
// (scaled copies and accumulates between model and master tensors), norms.cu (the L2 norm),
// step_math.cu + codecs.cu + step_lists.cu + step_loop.cu + steps.cu (the fused master steps of
// AdamW/Adam and SGD over FP32 masters) or + compact.cu (the same steps over compact state: a
// master as its bf16 weight and int8 correction or int16 remainder, moments in bf16 or in 8 bits
// with a scale per 32 elements).
//
// Plain CUDA C++: nvcc compiles the files concatenated (CI does, for sm_75/80/90), and CuPy loads
// each family as a RawModule (the step families a RawModule per kernel), instantiating the names
// _sources.py lists; nvcc builds take those names' addresses (_sources.source's `instantiate`).
// The host passes one Meta struct by value per launch: per-tensor pointers, element counts and
// the prefix sum of chunks. A block finds the tensor of its chunk by binary search, so there is
// no per-block table and no cap on blocks per launch.
//
// Numerics match torch's: values are read as float, multiplied and added in float with round to
// nearest, and stored with round to nearest even (one rounding into the destination's type). The
// L2 norm sums squares in double. The fused steps compute torch's formula operation by operation
// (step_math.cu). CuPy always compiles with -ftz=true, which would flush subnormals in float
// arithmetic; the float arithmetic is therefore written in inline PTX (mul/add/sub/div/sqrt/fma
// .rn.f32, which take no .ftz), and the bfloat16 store is done on the bits.

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
#ifndef AMP_MAX_TENSORS_D8
#define AMP_MAX_TENSORS_D8 48
#endif

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 700
#define AMP_GRID_CONSTANT
#else
#define AMP_GRID_CONSTANT __grid_constant__
#endif

// A function called on a rare path, kept out of line on the GPU so that the common path's code
// stays small (the emulated grid, compiled by g++, inlines as it likes).
#ifdef __CUDA_ARCH__
#define AMP_RARE __noinline__
#else
#define AMP_RARE
#endif

namespace amp {

constexpr int kBlock = 512;  // threads per block

template <int Depth> struct MaxTensors;
template <> struct MaxTensors<1> { static constexpr int value = AMP_MAX_TENSORS_D1; };
template <> struct MaxTensors<2> { static constexpr int value = AMP_MAX_TENSORS_D2; };
template <> struct MaxTensors<4> { static constexpr int value = AMP_MAX_TENSORS_D4; };
template <> struct MaxTensors<6> { static constexpr int value = AMP_MAX_TENSORS_D6; };
template <> struct MaxTensors<8> { static constexpr int value = AMP_MAX_TENSORS_D8; };

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
#ifdef AMP_META_BYTES_D8
static_assert(sizeof(Meta<8>) == AMP_META_BYTES_D8, "Meta<8> layout differs from the host's");
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

// -x on the bits (neg.f32 under -ftz=true would flush a subnormal x).
__device__ __forceinline__ float negate(float x) {
  return __uint_as_float(__float_as_uint(x) ^ 0x80000000u);
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

// The chunk of tensor t that block-stride index c covers: (first element, element count).
template <int Depth>
__device__ __forceinline__ void chunk_range(const Meta<Depth>& meta, int t, int c, long long chunk,
                                            long long& first, long long& n) {
  first = static_cast<long long>(c - meta.chunk_start[t]) * chunk;
  const long long remaining = meta.numel[t] - first;
  n = remaining < chunk ? remaining : chunk;
}

}  // namespace amp
