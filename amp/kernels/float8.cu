// FP8 casts for amp's float8 linears (amp/kernels/float8.py): from a bf16, fp16 or fp32 matrix,
// the FP8 matrix and its transpose, each scaled per tensor, per row or per column, in one read;
// and the rowwise recipe's output scaling (a matmul's bf16 output times the outer product of
// its operands' inverse scales), in place.
//
// Dynamic scaling needs the amax before the first value is cast, so a cast is two launches:
//   amp_f8_amax  reads the matrix once: the amax of the whole, of each row and of each column
//                (what the job asks), atomicMax on the float bits (order-free, NaN-propagating)
//                into a zeroed buffer;
//   amp_f8_cast  reads it again, tile by tile: scales from the amaxes (torchao's formula, in
//                double), the row-major FP8 tile written from registers, the transposed one staged
//                in shared memory and written 16 bytes a thread; the scales and their inverses
//                written once.
// Both take many matrices (a step's weights) in one launch: a Meta holds their jobs by value.
//
// This file is the part they share: the jobs and their Meta, the input types on their bits, a
// tile's thread layout and loads. The module (amp/kernels/_sources.py's FLOAT8_FILES) adds, in
// order: float8_amax.cu (amp_f8_amax), float8_formats.cu (the FP8 formats and the scales),
// float8_cast.cu (amp_f8_cast), float8_scale_outer.cu (amp_f8_scale_outer, the output scaling).
// CuPy compiles them concatenated, as one RawModule (amp/kernels/_cupy_float8.py).
//
// Numerics are torch's ops in amp/kernels/_torch_float8.py: scale = float(max / max(amax, 1e-12))
// in double (rounded down to a power of 2 by exp2(floor(log2)) where asked), x * scale in float
// with round to nearest (inline PTX: CuPy's -ftz=true would flush subnormals), saturated to the
// FP8 range, rounded to nearest even. Compute capability 8.9 and up convert with cvt.satfinite;
// elsewhere (and on the CPU emulation in tests/helpers/cuda_emulation) on the bits.

#include <cuda_fp16.h>
#include <cuda_bf16.h>

#ifndef AMP_F8_JOBS
#define AMP_F8_JOBS 24
#endif

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 700
#define AMP_F8_GRID_CONSTANT
#else
#define AMP_F8_GRID_CONSTANT __grid_constant__
#endif

namespace amp_f8 {

constexpr int kThreads = 256;
constexpr int kTile = 128;  // rows and columns of a tile
constexpr double kEps = 1e-12;  // torchao's EPS: the smallest amax a scale is made from

// One matrix to cast. Mirrored field for field by a numpy dtype (amp/kernels/_float8_layout.py).
struct Job {
  unsigned long long src;        // rows x cols, row-major, of the kernel's input type
  unsigned long long out;        // rows x cols FP8, or 0: no row-major layout
  unsigned long long out_t;      // cols x rows FP8 (the transpose), or 0
  unsigned long long amax;       // out's amax as float bits: 1 value, or one per row
  unsigned long long amax_t;     // out_t's: 1 value, or one per column
  unsigned long long scale;      // float: out's scales (1 or rows) ...
  unsigned long long inverse;    // ... and their inverses
  unsigned long long scale_t;    // out_t's (1 or cols)
  unsigned long long inverse_t;
  long long rows, cols;
  long long first_tile;          // tiles of the jobs before this one
  int per_row, per_col;          // out scaled per row, out_t per column (else per tensor)
};

struct Meta {
  Job jobs[AMP_F8_JOBS];
  long long tiles;
  int njobs;
};

#ifdef AMP_F8_META_BYTES
static_assert(sizeof(Meta) == AMP_F8_META_BYTES, "Meta layout differs from the host's");
#endif

struct alignas(16) Vec16 {
  unsigned int w[4];
};

__device__ __forceinline__ float mul_rn(float a, float b) {
  float r;
  asm("mul.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
}

__device__ __forceinline__ float div_rn(float a, float b) {
  float r;
  asm("div.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
}

// The input types on their bits: an element's value, and the float bits of an |element| (for
// the amax: the order of the bits of |x| is the order of the values, NaN above infinity).
template <typename In> struct Elem;
template <> struct Elem<__nv_bfloat16> {
  static constexpr int kVec = 8;  // elements in 16 bytes
  static constexpr unsigned int kAbs = 0x7fffu;
  __device__ static float value(unsigned int bits) { return __uint_as_float(bits << 16); }
  __device__ static unsigned int amax_bits(unsigned int abs) { return abs << 16; }
};
template <> struct Elem<__half> {
  static constexpr int kVec = 8;
  static constexpr unsigned int kAbs = 0x7fffu;
  // On the bits (NVRTC has no memcpy to make a __half of them); exact, subnormals too.
  __device__ static float value(unsigned int bits) {
    const unsigned int sign = (bits & 0x8000u) << 16;
    const unsigned int exponent = (bits >> 10) & 0x1fu, mantissa = bits & 0x3ffu;
    if (exponent == 0x1fu) return __uint_as_float(sign | 0x7f800000u | (mantissa << 13));
    if (exponent != 0) return __uint_as_float(sign | ((exponent + 112u) << 23) | (mantissa << 13));
    // mantissa * 2**-24: a normal float, exactly
    return __uint_as_float(sign | __float_as_uint(mul_rn(static_cast<float>(mantissa), 0x1p-24f)));
  }
  __device__ static unsigned int amax_bits(unsigned int abs) { return __float_as_uint(value(abs)); }
};
template <> struct Elem<float> {
  static constexpr int kVec = 4;
  static constexpr unsigned int kAbs = 0x7fffffffu;
  __device__ static float value(unsigned int bits) { return __uint_as_float(bits); }
  __device__ static unsigned int amax_bits(unsigned int abs) { return abs; }
};

// A tile's thread layout: each thread reads 16 bytes of a row per pass.
template <typename In> struct Layout {
  static constexpr int kVec = Elem<In>::kVec;
  static constexpr int kLanes = kTile / kVec;             // threads per tile row
  static constexpr int kRowsPerPass = kThreads / kLanes;
  static constexpr int kPasses = kTile / kRowsPerPass;
};

template <typename In>
__device__ __forceinline__ unsigned int element(const Vec16& v, int i) {
  if constexpr (sizeof(In) == 4) {
    return v.w[i];
  } else {
    return (v.w[i / 2] >> (16 * (i % 2))) & 0xffffu;
  }
}

// The 16 bytes of row r from column c (zeros past the matrix's edges).
template <typename In>
__device__ __forceinline__ Vec16 load(const Job& job, long long r, long long c, bool vectors) {
  constexpr int kVec = Elem<In>::kVec;
  Vec16 v = {{0u, 0u, 0u, 0u}};
  if (r >= job.rows) return v;
  const long long first = r * job.cols + c;
  if (vectors && c + kVec <= job.cols) {
    return reinterpret_cast<const Vec16*>(job.src)[first / kVec];
  }
  for (int i = 0; i < kVec && c + i < job.cols; ++i) {
    if constexpr (sizeof(In) == 4) {
      v.w[i] = reinterpret_cast<const unsigned int*>(job.src)[first + i];
    } else {
      const unsigned int bits = reinterpret_cast<const unsigned short*>(job.src)[first + i];
      v.w[i / 2] |= bits << (16 * (i % 2));
    }
  }
  return v;
}

// The job of global tile `tile`: the last with first_tile <= tile (jobs without tiles share their
// first tile with the next and are never chosen).
__device__ __forceinline__ int job_of(const Meta& meta, long long tile) {
  int lo = 0, hi = meta.njobs - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (meta.jobs[mid].first_tile <= tile) lo = mid; else hi = mid - 1;
  }
  return lo;
}

__device__ __forceinline__ long long column_tiles(const Job& job) {
  return (job.cols + kTile - 1) / kTile;
}

}  // namespace amp_f8
