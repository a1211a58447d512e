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

// One matrix to cast. Mirrored field for field by a numpy dtype (amp/kernels/_cupy_float8.py).
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

// A tile's FP8 bytes, staged for the transposed write.
struct alignas(16) Staged {
  unsigned char bytes[kTile][kTile];
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

__device__ __forceinline__ void amax_into(unsigned long long address, unsigned int bits) {
  atomicMax(reinterpret_cast<unsigned int*>(address), bits);
}

// The amaxes of one tile: of its rows and columns into the per-row / per-column amaxes, of the
// whole into the per-tensor ones, as the job asks.
template <typename In>
__device__ void amax_tile(const Job& job, long long local, unsigned int (*part)[kTile],
                          unsigned int* warp_max) {
  using L = Layout<In>;
  const int t = threadIdx.x, lane = t % L::kLanes, sub = t / L::kLanes;
  const long long tiles_c = column_tiles(job);
  const long long r0 = local / tiles_c * kTile, c0 = local % tiles_c * kTile;
  const bool vectors = job.cols % L::kVec == 0 && job.src % 16 == 0;
  const bool by_row = job.out != 0 && job.per_row;
  const bool by_col = job.out_t != 0 && job.per_col;
  Vec16 raw[L::kPasses];
#pragma unroll
  for (int p = 0; p < L::kPasses; ++p) {
    raw[p] = load<In>(job, r0 + p * L::kRowsPerPass + sub, c0 + lane * L::kVec, vectors);
  }
  unsigned int col_max[L::kVec] = {};
  unsigned int all = 0;
#pragma unroll
  for (int p = 0; p < L::kPasses; ++p) {
    unsigned int row = 0;
#pragma unroll
    for (int i = 0; i < L::kVec; ++i) {
      const unsigned int a = element<In>(raw[p], i) & Elem<In>::kAbs;
      col_max[i] = a > col_max[i] ? a : col_max[i];
      row = a > row ? a : row;
    }
    all = row > all ? row : all;
    if (by_row) {  // the row's threads are kLanes neighbours of one warp
#pragma unroll
      for (int offset = L::kLanes / 2; offset > 0; offset /= 2) {
        const unsigned int other = __shfl_xor_sync(0xffffffffu, row, offset);
        row = other > row ? other : row;
      }
      const long long r = r0 + p * L::kRowsPerPass + sub;
      if (lane == 0 && r < job.rows) {
        amax_into(job.amax + 4 * r, Elem<In>::amax_bits(row));
      }
    }
  }
  if (by_col) {
#pragma unroll
    for (int i = 0; i < L::kVec; ++i) part[sub][lane * L::kVec + i] = col_max[i];
  }
  // The whole tile: a warp's maximum, then the block's.
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) {
    const unsigned int other = __shfl_xor_sync(0xffffffffu, all, offset);
    all = other > all ? other : all;
  }
  if (t % 32 == 0) warp_max[t / 32] = all;
  __syncthreads();
  if (by_col && t < kTile && c0 + t < job.cols) {
    unsigned int m = 0;
    for (int s = 0; s < L::kRowsPerPass; ++s) m = part[s][t] > m ? part[s][t] : m;
    amax_into(job.amax_t + 4 * (c0 + t), Elem<In>::amax_bits(m));
  }
  if (t == 0) {
    unsigned int m = 0;
    for (int w = 0; w < kThreads / 32; ++w) m = warp_max[w] > m ? warp_max[w] : m;
    const unsigned int bits = Elem<In>::amax_bits(m);
    if (job.out != 0 && !job.per_row) amax_into(job.amax, bits);
    if (job.out_t != 0 && !job.per_col && job.amax_t != job.amax) amax_into(job.amax_t, bits);
  }
  __syncthreads();  // part and warp_max are the next tile's
}

// The FP8 formats: 0 = e4m3fn, 1 = e5m2.
template <int Format> struct F8;
template <> struct F8<0> {
  static constexpr int kMantissa = 3, kBias = 7;
  static constexpr unsigned int kMaxBits = 0x43e00000u;  // 448.0f
  static constexpr unsigned int kMaxCode = 0x7eu;
  static constexpr double kMax = 448.0;
};
template <> struct F8<1> {
  static constexpr int kMantissa = 2, kBias = 15;
  static constexpr unsigned int kMaxBits = 0x47600000u;  // 57344.0f
  static constexpr unsigned int kMaxCode = 0x7bu;
  static constexpr double kMax = 57344.0;
};

// float -> FP8 on the bits: NaN stays NaN (torch's 0x7f with the sign), values beyond the largest
// finite one (infinities too) saturate to it, the rest round to nearest even.
template <int Format>
__device__ __forceinline__ unsigned int to_f8_bits(float x) {
  using F = F8<Format>;
  const unsigned int bits = __float_as_uint(x);
  const unsigned int sign = (bits >> 24) & 0x80u;
  const unsigned int a = bits & 0x7fffffffu;
  if (a > 0x7f800000u) return sign | 0x7fu;
  if (a >= F::kMaxBits) return sign | F::kMaxCode;
  const unsigned int exponent = a >> 23;
  if (exponent < static_cast<unsigned int>(127 - F::kBias + 1)) {
    // Below the smallest normal FP8: an integer number of its smallest subnormal.
    const unsigned int mantissa = (a & 0x7fffffu) | (exponent != 0 ? 0x800000u : 0u);
    const int shift = 150 + 1 - F::kBias - F::kMantissa - (exponent != 0 ? exponent : 1);
    if (shift >= 25) return sign;  // less than half the smallest subnormal
    unsigned int q = mantissa >> shift;
    const unsigned int rest = mantissa & ((1u << shift) - 1u), half = 1u << (shift - 1);
    if (rest > half || (rest == half && (q & 1u))) ++q;
    return sign | q;
  }
  constexpr int kDrop = 23 - F::kMantissa;
  unsigned int v = a - (static_cast<unsigned int>(127 - F::kBias) << 23);
  v += ((1u << (kDrop - 1)) - 1u) + ((v >> kDrop) & 1u);
  return sign | (v >> kDrop);
}

// Two floats -> two FP8 bytes (lo in the low byte).
template <int Format>
__device__ __forceinline__ unsigned int pack2(float lo, float hi) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  unsigned short r;
  if (Format == 0) {
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(hi), "f"(lo));
  } else {
    asm("cvt.rn.satfinite.e5m2x2.f32 %0, %1, %2;" : "=h"(r) : "f"(hi), "f"(lo));
  }
  return r;
#else
  return to_f8_bits<Format>(lo) | (to_f8_bits<Format>(hi) << 8);
#endif
}

// torchao's amax_to_scale: float(max * (1 / max(amax, EPS))) in double (NaN stays NaN), rounded
// down to a power of 2 by exp2(floor(log2(scale))) where asked; and 1 / scale.
template <int Format>
__device__ __forceinline__ float scale_of(unsigned int amax_bits, bool power_of_2) {
  double amax = static_cast<double>(__uint_as_float(amax_bits));
  if (amax < kEps) amax = kEps;  // a subnormal amax flushed to 0 by -ftz lands here too
  float scale = static_cast<float>((1.0 / amax) * F8<Format>::kMax);
  if (power_of_2) scale = exp2f(floorf(log2f(scale)));
  return scale;
}

template <int Format>
__device__ __forceinline__ void write_scale(unsigned long long scale, unsigned long long inverse,
                                            long long index, float value) {
  reinterpret_cast<float*>(scale)[index] = value;
  reinterpret_cast<float*>(inverse)[index] = div_rn(1.0f, value);
}

// One tile cast: its scales, the row-major FP8 tile, the transposed one through `staged`.
template <typename In, int Format>
__device__ void cast_tile(const Job& job, long long local, bool power_of_2, float* row_scale,
                          float* col_scale, unsigned char (*staged)[kTile]) {
  using L = Layout<In>;
  constexpr int kVec = L::kVec;
  const int t = threadIdx.x, lane = t % L::kLanes, sub = t / L::kLanes;
  const long long tiles_c = column_tiles(job);
  const long long tr = local / tiles_c, tc = local % tiles_c;
  const long long r0 = tr * kTile, c0 = tc * kTile;
  if (t < kTile && job.out != 0) {
    const long long r = r0 + t;
    const long long index = job.per_row ? r : 0;
    const bool inside = r < job.rows;
    const float s = scale_of<Format>(
        inside || !job.per_row ? reinterpret_cast<const unsigned int*>(job.amax)[index] : 0u,
        power_of_2);
    row_scale[t] = s;
    if (job.per_row ? (tc == 0 && inside) : (local == 0 && t == 0)) {
      write_scale<Format>(job.scale, job.inverse, index, s);
    }
  }
  if (t >= kTile && job.out_t != 0) {
    const long long c = c0 + t - kTile;
    const long long index = job.per_col ? c : 0;
    const bool inside = c < job.cols;
    const float s = scale_of<Format>(
        inside || !job.per_col ? reinterpret_cast<const unsigned int*>(job.amax_t)[index] : 0u,
        power_of_2);
    col_scale[t - kTile] = s;
    if (job.per_col ? (tr == 0 && inside) : (local == 0 && t == kTile)) {
      write_scale<Format>(job.scale_t, job.inverse_t, index, s);
    }
  }
  const bool vectors = job.cols % kVec == 0 && job.src % 16 == 0;
  Vec16 raw[L::kPasses];  // every load in flight before the first store
#pragma unroll
  for (int p = 0; p < L::kPasses; ++p) {
    raw[p] = load<In>(job, r0 + p * L::kRowsPerPass + sub, c0 + lane * kVec, vectors);
  }
  __syncthreads();  // the scales
  const long long c = c0 + lane * kVec;
  const bool stores = job.cols % kVec == 0 && job.out % 16 == 0 && c + kVec <= job.cols;
  float s_t[kVec];  // this thread's columns' scales, read once (a strided read conflicts)
#pragma unroll
  for (int i = 0; i < kVec; ++i) s_t[i] = col_scale[lane * kVec + i];
#pragma unroll
  for (int p = 0; p < L::kPasses; ++p) {
    const int lr = p * L::kRowsPerPass + sub;
    const long long r = r0 + lr;
    float v[kVec];
#pragma unroll
    for (int i = 0; i < kVec; ++i) v[i] = Elem<In>::value(element<In>(raw[p], i));
    if (job.out != 0) {
      const float s = row_scale[lr];
      unsigned int words[kVec / 4];
#pragma unroll
      for (int w = 0; w < kVec / 4; ++w) {
        words[w] = pack2<Format>(mul_rn(v[4 * w], s), mul_rn(v[4 * w + 1], s)) |
                   (pack2<Format>(mul_rn(v[4 * w + 2], s), mul_rn(v[4 * w + 3], s)) << 16);
      }
      unsigned char* dst = reinterpret_cast<unsigned char*>(job.out) + r * job.cols + c;
      if (r < job.rows && stores) {
#pragma unroll
        for (int w = 0; w < kVec / 4; ++w) reinterpret_cast<unsigned int*>(dst)[w] = words[w];
      } else if (r < job.rows) {
        for (int i = 0; i < kVec && c + i < job.cols; ++i) {
          dst[i] = static_cast<unsigned char>(words[i / 4] >> (8 * (i % 4)));
        }
      }
    }
    if (job.out_t != 0) {
      unsigned int* dst = reinterpret_cast<unsigned int*>(&staged[lr][lane * kVec]);
#pragma unroll
      for (int w = 0; w < kVec / 4; ++w) {
        const float* s = s_t + 4 * w;
        dst[w] = pack2<Format>(mul_rn(v[4 * w], s[0]), mul_rn(v[4 * w + 1], s[1])) |
                 (pack2<Format>(mul_rn(v[4 * w + 2], s[2]), mul_rn(v[4 * w + 3], s[3])) << 16);
      }
    }
  }
  __syncthreads();  // the staged tile
  if (job.out_t != 0) {
    // Thread: 4 columns x 16 rows of the tile, written as 16 bytes of 4 rows of the transpose.
    const int group = t % 32, rows16 = t / 32;
    unsigned int w[16];
#pragma unroll
    for (int k = 0; k < 16; ++k) {
      w[k] = reinterpret_cast<const unsigned int*>(&staged[rows16 * 16 + k][0])[group];
    }
    const long long r = r0 + rows16 * 16;
    const bool whole = r + 16 <= job.rows && job.rows % 16 == 0 && job.out_t % 16 == 0;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const long long col = c0 + group * 4 + i;
      if (col >= job.cols) break;
      Vec16 q;
#pragma unroll
      for (int m = 0; m < 4; ++m) {
        q.w[m] = ((w[4 * m] >> (8 * i)) & 0xffu) | (((w[4 * m + 1] >> (8 * i)) & 0xffu) << 8) |
                 (((w[4 * m + 2] >> (8 * i)) & 0xffu) << 16) |
                 (((w[4 * m + 3] >> (8 * i)) & 0xffu) << 24);
      }
      unsigned char* dst = reinterpret_cast<unsigned char*>(job.out_t) + col * job.rows + r;
      if (whole) {
        *reinterpret_cast<Vec16*>(dst) = q;
      } else {
        for (int k = 0; k < 16 && r + k < job.rows; ++k) {
          dst[k] = static_cast<unsigned char>(q.w[k / 4] >> (8 * (k % 4)));
        }
      }
    }
  }
  __syncthreads();  // the scales and the staged tile are the next tile's
}

// bf16 <- float, round to nearest even on the bits (as c10::BFloat16); NaN stays a quiet NaN.
__device__ __forceinline__ unsigned int bf16_bits(float x) {
  const unsigned int bits = __float_as_uint(x);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return (bits >> 16) | 0x0040u;
  return (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
}

}  // namespace amp_f8

// The amaxes every job asks for, into buffers the host zeroed.
template <typename In>
__global__ void __launch_bounds__(amp_f8::kThreads)
    amp_f8_amax(const AMP_F8_GRID_CONSTANT amp_f8::Meta meta) {
  using namespace amp_f8;
  __shared__ unsigned int part[Layout<In>::kRowsPerPass][kTile];
  __shared__ unsigned int warp_max[kThreads / 32];
  for (long long tile = blockIdx.x; tile < meta.tiles; tile += gridDim.x) {
    const Job& job = meta.jobs[job_of(meta, tile)];
    amax_tile<In>(job, tile - job.first_tile, part, warp_max);
  }
}

// The FP8 layouts every job asks for, their scales and inverses, from amp_f8_amax's amaxes.
template <typename In, int Format>
__global__ void __launch_bounds__(amp_f8::kThreads)
    amp_f8_cast(const AMP_F8_GRID_CONSTANT amp_f8::Meta meta, long long power_of_2) {
  using namespace amp_f8;
  __shared__ float row_scale[kTile];
  __shared__ float col_scale[kTile];
  __shared__ Staged staged;
  // Last tile first: amp_f8_amax read the matrix first tile first, so its end is still in L2.
  for (long long k = blockIdx.x; k < meta.tiles; k += gridDim.x) {
    const long long tile = meta.tiles - 1 - k;
    const Job& job = meta.jobs[job_of(meta, tile)];
    cast_tile<In, Format>(job, tile - job.first_tile, power_of_2 != 0, row_scale, col_scale,
                          staged.bytes);
  }
}

// out (rows x cols bf16, row-major) *= row_inverse[r] * col_inverse[c], the product rounded to
// float first, as torch's `out *= a_inverse * b_inverse` (the rowwise recipe's matmuls without
// fast accumulation). A work item is one row's 2048 columns (8 a thread).
__global__ void __launch_bounds__(amp_f8::kThreads)
    amp_f8_scale_outer(unsigned long long out, long long rows, long long cols,
                       unsigned long long row_inverse, unsigned long long col_inverse) {
  using namespace amp_f8;
  constexpr long long kSpan = 8 * kThreads;
  const long long spans = (cols + kSpan - 1) / kSpan;
  const bool vectors = cols % 8 == 0 && out % 16 == 0;
  const float* rs = reinterpret_cast<const float*>(row_inverse);
  const float* cs = reinterpret_cast<const float*>(col_inverse);
  unsigned short* values = reinterpret_cast<unsigned short*>(out);
  for (long long item = blockIdx.x; item < rows * spans; item += gridDim.x) {
    const long long r = item / spans;
    const long long c = item % spans * kSpan + 8 * threadIdx.x;
    const float row = rs[r];
    unsigned short* at = values + r * cols + c;
    if (vectors && c + 8 <= cols) {
      const Vec16 v = *reinterpret_cast<const Vec16*>(at);
      Vec16 scaled = {{0u, 0u, 0u, 0u}};
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        const unsigned int bits = element<__nv_bfloat16>(v, i);
        const float x = mul_rn(__uint_as_float(bits << 16), mul_rn(row, cs[c + i]));
        scaled.w[i / 2] |= bf16_bits(x) << (16 * (i % 2));
      }
      *reinterpret_cast<Vec16*>(at) = scaled;
    } else {
      for (int i = 0; i < 8 && c + i < cols; ++i) {
        const float x = mul_rn(__uint_as_float(static_cast<unsigned int>(at[i]) << 16),
                               mul_rn(row, cs[c + i]));
        at[i] = static_cast<unsigned short>(bf16_bits(x));
      }
    }
  }
}

template __global__ void amp_f8_amax<float>(const AMP_F8_GRID_CONSTANT amp_f8::Meta);
template __global__ void amp_f8_amax<__half>(const AMP_F8_GRID_CONSTANT amp_f8::Meta);
template __global__ void amp_f8_amax<__nv_bfloat16>(const AMP_F8_GRID_CONSTANT amp_f8::Meta);
#define AMP_F8_CAST(In)                                                                         \
  template __global__ void amp_f8_cast<In, 0>(const AMP_F8_GRID_CONSTANT amp_f8::Meta, long long); \
  template __global__ void amp_f8_cast<In, 1>(const AMP_F8_GRID_CONSTANT amp_f8::Meta, long long);
AMP_F8_CAST(float)
AMP_F8_CAST(__half)
AMP_F8_CAST(__nv_bfloat16)
#undef AMP_F8_CAST
