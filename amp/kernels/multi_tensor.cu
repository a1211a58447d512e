// Multi-tensor kernels for amp: unscale with inf/NaN detection, scaled copy (model grads -> FP32
// master grads, FP32 masters -> model params), scaled accumulate, the L2 norm, the inf/NaN check
// alone, and the fused master step of AdamW/Adam and SGD (one pass per chunk: the low-precision
// gradient unscaled, the FP32 master and the optimizer's state updated in place, the
// low-precision weight written), also over compact state (a master as its bf16 weight and int8
// correction, moments in bf16 or in 8 bits with a scale per 32 elements: one warp per block of
// 32, its scale a warp reduction).
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
#ifndef AMP_MAX_TENSORS_D8
#define AMP_MAX_TENSORS_D8 48
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

// first_step: the buffer starts as the gradient (torch's first step; buf is not read).
__device__ __forceinline__ void sgd_element(const SgdScalars& s, bool decay, bool with_momentum,
                                            bool nesterov, float g, float& p, float& buf,
                                            bool first_step = false) {
  if (decay) g = fma_rn(s.weight_decay, p, g);
  if (with_momentum) {
    buf = first_step ? g : fma_rn(s.one_minus_dampening, g, mul_rn(buf, s.momentum));
    g = nesterov ? fma_rn(s.momentum, buf, g) : buf;
  }
  p = fma_rn(s.minus_lr, g, p);
}

// -- compact state (amp/kernels/_codecs.py, operation by operation) ------------------------------

constexpr int kWarp = 32;  // threads per warp = elements per block of an 8-bit moment's scale

// The kinds of master and moments the compact kernels take (template parameters).
struct Compact {};                      // a bf16 weight and an int8 correction
struct Remainder {};                    // a bf16 weight and an int16 remainder (exact)
template <typename L> struct Exact {};  // an FP32 master and its copy in L (a null pointer: none)
struct Codes8 {};                       // int8 softsign codes (signed), uint8 square-root codes

__device__ __forceinline__ float abs_bits(float x) {  // |x| on the bits: nothing flushed
  return __uint_as_float(__float_as_uint(x) & 0x7fffffffu);
}

// A master's FP32 value from its bf16 weight bits and int8 correction: integer arithmetic, exact.
__device__ __forceinline__ float compact_decode(unsigned short weight, signed char correction) {
  const int high = weight;
  const int magnitude_high = high & 0x7fff;
  int magnitude = (magnitude_high << 16) + static_cast<int>(correction) * 256;
  if (magnitude_high >= 0x7f80) magnitude = magnitude_high << 16;
  const unsigned int sign = high >= 0x8000 ? 0x80000000u : 0u;
  return __uint_as_float(static_cast<unsigned int>(magnitude) | sign);
}

// The bf16 weight bits and int8 correction of an FP32 value: the weight its rounding to nearest
// even (torch's cast), the correction the rest in 1/256 of the weight's ulp, rounded to nearest
// even and kept within -127..127; inf, overflow and NaN as _codecs.py. Integer arithmetic.
__device__ __forceinline__ void compact_encode(float x, unsigned short& weight,
                                               signed char& correction) {
  const unsigned int bits = __float_as_uint(x);
  unsigned int magnitude = bits & 0x7fffffffu;
  const bool nan = magnitude > 0x7f800000u;
  if (nan) magnitude = 0;
  unsigned int high = (magnitude + 0x7fffu + ((magnitude >> 16) & 1u)) >> 16;
  const int rest = static_cast<int>(magnitude) - static_cast<int>(high << 16);  // +-0x8000
  int low = (rest + 0x7f + ((rest >> 8) & 1)) >> 8;  // arithmetic shifts: floor
  low = low < -127 ? -127 : (low > 127 ? 127 : low);
  if (nan || high >= 0x7f80u) low = 0;
  if (nan) high = 0x7fc0u;
  weight = static_cast<unsigned short>(high | ((bits >> 31) << 15));
  correction = static_cast<signed char>(low);
}

// A master's FP32 value from its bf16 weight bits and int16 remainder: the weight's bits shifted
// up by 16 plus the remainder, exact (uint32 arithmetic wraps as _codecs.py's int64 one is cut).
__device__ __forceinline__ float remainder_decode(unsigned short weight, short remainder) {
  return __uint_as_float((static_cast<unsigned int>(weight) << 16) +
                         static_cast<unsigned int>(static_cast<int>(remainder)));
}

// The bf16 weight bits and int16 remainder of an FP32 value: the bits split at bit 16, the weight
// rounded to nearest with ties away from zero (the remainder of a tie rounded down to even would
// not fit), a NaN a quiet NaN of its sign with remainder 0 (_codecs.py).
__device__ __forceinline__ void remainder_encode(float x, unsigned short& weight,
                                                 short& remainder) {
  const unsigned int bits = __float_as_uint(x);
  const unsigned int low = bits & 0xffffu;
  const unsigned int up = low >= 0x8000u ? 1u : 0u;
  if ((bits & 0x7fffffffu) > 0x7f800000u) {
    weight = static_cast<unsigned short>((bits >> 16) | 0x40u);
    remainder = 0;
    return;
  }
  weight = static_cast<unsigned short>((bits >> 16) + up);
  remainder = static_cast<short>(static_cast<int>(low) - static_cast<int>(up << 16));
}

// The largest of the warp's 32 values (non-negative floats' bits: their order is the values'),
// in every lane; a fixed butterfly, so every lane gets the same bits.
__device__ __forceinline__ unsigned int warp_max(unsigned int x) {
#pragma unroll
  for (int offset = kWarp / 2; offset > 0; offset >>= 1) {
    const unsigned int other = __shfl_xor_sync(0xffffffffu, x, offset);
    x = other > x ? other : x;
  }
  return x;
}

// A block's divisor: its scale where the scale is > 0 (on the bits: a subnormal scale counts,
// NaN does not), else 1.
__device__ __forceinline__ float block_divisor(unsigned int scale_bits) {
  return scale_bits != 0u && scale_bits <= 0x7f800000u ? __uint_as_float(scale_bits) : 1.0f;
}

// Softsign codes: value = y * scale with y = z / (2 - |z|), z = code / 127.
__device__ __forceinline__ float signed_decode(signed char code, float scale) {
  const float z = div_rn(static_cast<float>(code), 127.0f);
  return mul_rn(div_rn(z, sub_rn(2.0f, abs_bits(z))), scale);
}

// Each lane's code of `value` (lanes past the tensor pass 0: the zero padding) and the block's
// scale, its largest magnitude.
__device__ __forceinline__ signed char signed_encode(float value, float& scale) {
  const unsigned int scale_bits = warp_max(__float_as_uint(value) & 0x7fffffffu);
  scale = __uint_as_float(scale_bits);
  const float y = div_rn(value, block_divisor(scale_bits));
  const float z = div_rn(mul_rn(y, 2.0f), add_rn(abs_bits(y), 1.0f));
  return static_cast<signed char>(static_cast<int>(rintf(mul_rn(z, 127.0f))));
}

// Square-root codes: value = r * r with r = code / 255 * scale.
__device__ __forceinline__ float unsigned_decode(unsigned char code, float scale) {
  const float root = mul_rn(div_rn(static_cast<float>(code), 255.0f), scale);
  return mul_rn(root, root);
}

// A 32-bit hash (_codecs._mix's, whose int64 arithmetic this uint32 one wraps as).
__device__ __forceinline__ unsigned int mix(unsigned int x) {
  x ^= x >> 16;
  x *= 0x7FEB352Du;
  x ^= x >> 15;
  x *= 0x2C1B3C6Du;
  return x ^ (x >> 16);
}

// 16 random bits (_codecs.dither_bits'): the high 16 bits of the hash of element `index` of its
// tensor (modulo 2**16) xor those of the hash of the step count.
__device__ __forceinline__ unsigned int dither_bits(long long index, unsigned int step) {
  return (mix(static_cast<unsigned int>(index & 0xFFFF)) >> 16) ^ (mix(step * 0x61C88647u) >> 16);
}

// Uniform in [0, 1), a multiple of 2**-16 (_codecs.dither's).
__device__ __forceinline__ float dither(long long index, unsigned int step) {
  return static_cast<float>(dither_bits(index, step)) * 1.52587890625e-05f;  // 2**-16, exact
}

// A non-negative value to bf16, rounded stochastically by 16 random bits (_codecs.bf16_stochastic).
__device__ __forceinline__ __nv_bfloat16 bf16_stochastic(float value, unsigned int bits) {
  return __ushort_as_bfloat16(static_cast<unsigned short>((__float_as_uint(value) + bits) >> 16));
}

// As signed_encode, over the square roots (the scale is the largest root), rounded
// stochastically by `noise` (dither's); a positive value is never code 0.
__device__ __forceinline__ unsigned char unsigned_encode(float value, float noise, float& scale) {
  const float root = sqrt_rn(value);
  const unsigned int scale_bits = warp_max(__float_as_uint(root) & 0x7fffffffu);
  scale = __uint_as_float(scale_bits);
  const float y = div_rn(root, block_divisor(scale_bits));
  int code = static_cast<int>(floorf(add_rn(mul_rn(y, 255.0f), noise)));
  if (code > 255) code = 255;
  const unsigned int root_bits = __float_as_uint(root);
  if (code == 0 && root_bits != 0u && root_bits <= 0x7f800000u) code = 1;  // root > 0
  return static_cast<unsigned char>(code);
}

// A chunk's master in a compact step, in its form (lists 1 and 2 of the launch): a compact one's
// bf16 weight and int8 correction, an exact one's bf16 weight and int16 remainder, or an FP32
// master and its low-precision copy (or none).
template <typename Master> struct MasterList;

template <> struct MasterList<Compact> {
  unsigned short* weight;
  signed char* correction;
  __device__ __forceinline__ MasterList(unsigned long long first_list,
                                        unsigned long long second_list, long long first)
      : weight(reinterpret_cast<unsigned short*>(first_list) + first),
        correction(reinterpret_cast<signed char*>(second_list) + first) {}
  __device__ __forceinline__ float load(long long i) const {
    return compact_decode(weight[i], correction[i]);
  }
  __device__ __forceinline__ void store(long long i, float value) const {
    unsigned short high;
    signed char low;
    compact_encode(value, high, low);
    weight[i] = high;
    correction[i] = low;
  }
};

template <> struct MasterList<Remainder> {
  unsigned short* weight;
  short* remainder;
  __device__ __forceinline__ MasterList(unsigned long long first_list,
                                        unsigned long long second_list, long long first)
      : weight(reinterpret_cast<unsigned short*>(first_list) + first),
        remainder(reinterpret_cast<short*>(second_list) + first) {}
  __device__ __forceinline__ float load(long long i) const {
    return remainder_decode(weight[i], remainder[i]);
  }
  __device__ __forceinline__ void store(long long i, float value) const {
    unsigned short high;
    short low;
    remainder_encode(value, high, low);
    weight[i] = high;
    remainder[i] = low;
  }
};

template <typename L> struct MasterList<Exact<L>> {
  float* master;
  L* low;  // null: no copy
  __device__ __forceinline__ MasterList(unsigned long long first_list,
                                        unsigned long long second_list, long long first)
      : master(reinterpret_cast<float*>(first_list) + first),
        low(second_list != 0 ? reinterpret_cast<L*>(second_list) + first : nullptr) {}
  __device__ __forceinline__ float load(long long i) const { return master[i]; }
  __device__ __forceinline__ void store(long long i, float value) const {
    master[i] = value;
    if (low != nullptr) low[i] = from_float<L>(value);
  }
};

// A chunk's moment in a compact step: FP32 or bf16 as held, or 8-bit codes (softsign where
// Signed, else square roots) with their blocks' scales. Element i's block is `block` (i / 32).
// `step`: the step count, which dithers the second moment's codes (unsigned_encode).
template <typename Moment, bool Signed> struct MomentList {  // Moment: float or __nv_bfloat16
  Moment* held;
  __device__ __forceinline__ MomentList(unsigned long long list, unsigned long long, long long first,
                                        unsigned int = 0u)
      : held(list != 0 ? reinterpret_cast<Moment*>(list) + first : nullptr) {}
  __device__ __forceinline__ float load(long long i, long long) const {
    return to_float<Moment>(held[i]);
  }
  // Called by every lane of the warp (`in`: whether element i is in the tensor).
  __device__ __forceinline__ void store(long long i, long long, bool in, bool, float value) const {
    if (in) held[i] = from_float<Moment>(value);
  }
};

// A bf16 second moment: rounded stochastically in a step (_codecs.bf16_stochastic).
template <> struct MomentList<__nv_bfloat16, false> {
  __nv_bfloat16* held;
  long long first;
  unsigned int step;
  __device__ __forceinline__ MomentList(unsigned long long list, unsigned long long, long long first,
                                        unsigned int step = 0u)
      : held(list != 0 ? reinterpret_cast<__nv_bfloat16*>(list) + first : nullptr),
        first(first),
        step(step) {}
  __device__ __forceinline__ float load(long long i, long long) const {
    return to_float<__nv_bfloat16>(held[i]);
  }
  __device__ __forceinline__ void store(long long i, long long, bool in, bool, float value) const {
    if (in) held[i] = bf16_stochastic(value, dither_bits(first + i, step));
  }
};

template <> struct MomentList<Codes8, true> {
  signed char* codes;
  float* scales;
  __device__ __forceinline__ MomentList(unsigned long long list, unsigned long long scale_list,
                                        long long first, unsigned int = 0u)
      : codes(list != 0 ? reinterpret_cast<signed char*>(list) + first : nullptr),
        scales(scale_list != 0 ? reinterpret_cast<float*>(scale_list) + first / kWarp : nullptr) {}
  __device__ __forceinline__ float load(long long i, long long block) const {
    return signed_decode(codes[i], scales[block]);
  }
  // Every lane of the warp calls it (the block's scale is a warp reduction); lane 0 (`leader`)
  // writes the scale; lanes past the tensor (`in` false) pass 0, the zero padding.
  __device__ __forceinline__ void store(long long i, long long block, bool in, bool leader,
                                        float value) const {
    float scale;
    const signed char code = signed_encode(value, scale);
    if (in) codes[i] = code;
    if (leader) scales[block] = scale;
  }
};

template <> struct MomentList<Codes8, false> {
  unsigned char* codes;
  float* scales;
  long long first;  // the chunk's first element in its tensor, and the step: the dither's key
  unsigned int step;
  __device__ __forceinline__ MomentList(unsigned long long list, unsigned long long scale_list,
                                        long long first, unsigned int step = 0u)
      : codes(list != 0 ? reinterpret_cast<unsigned char*>(list) + first : nullptr),
        scales(scale_list != 0 ? reinterpret_cast<float*>(scale_list) + first / kWarp : nullptr),
        first(first),
        step(step) {}
  __device__ __forceinline__ float load(long long i, long long block) const {
    return unsigned_decode(codes[i], scales[block]);
  }
  __device__ __forceinline__ void store(long long i, long long block, bool in, bool leader,
                                        float value) const {
    float scale;
    const unsigned char code = unsigned_encode(value, dither(first + i, step), scale);
    if (in) codes[i] = code;
    if (leader) scales[block] = scale;
  }
};

// The step counts of a launch's tensors (list `list`), one more each unless *found != 0 (block 0
// does it).
template <int Depth>
__device__ __forceinline__ void count_steps(const Meta<Depth>& meta, int list, const float* found) {
  if (blockIdx.x != 0 || (found != nullptr && *found != 0.0f)) return;
  for (int t = threadIdx.x; t < meta.ntensors; t += blockDim.x) {
    float* step = reinterpret_cast<float*>(meta.ptr[list][t]);
    *step = add_rn(*step, 1.0f);
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

// The fused step of AdamW / Adam over compact state, as amp_adam: lists (gradient G, master,
// master's second list, exp_avg, exp_avg_sq, exp_avg's scales, exp_avg_sq's scales, step).
// Master amp::Compact: lists 1 and 2 are the bf16 weight and the int8 correction; amp::Remainder:
// the bf16 weight and the int16 remainder; amp::Exact<L>: the FP32 master and its copy in L (null:
// none). Moment float / __nv_bfloat16: the moments as held, lists 5 and 6 null; amp::Codes8: int8 softsign and uint8 square-root codes, lists 5 and
// 6 their fp32 scales per 32 elements. Each element is decoded, stepped by amp::adam_element and
// encoded; a warp takes 32 elements at a time, a block of the 8-bit moments (`chunk` must be a
// multiple of 32), and lane 0 writes its scales. Nothing happens where *found != 0;
// amp_compact_count_steps then adds the step.
template <typename G, typename Master, typename Moment>
__global__ void __launch_bounds__(amp::kBlock)
amp_compact_adam(const AMP_GRID_CONSTANT amp::Meta<8> meta, const float* inv, const float* found,
                 double lr, double beta1, double beta2, double eps, double weight_decay,
                 long long decoupled, long long chunk) {
  if (found != nullptr && *found != 0.0f) return;
  const float scale = inv != nullptr ? *inv : 1.0f;
  const int total = meta.chunk_start[meta.ntensors];
  const int lane = threadIdx.x % amp::kWarp;
  const long long warp_first = threadIdx.x - lane;
  for (int c = blockIdx.x; c < total; c += gridDim.x) {
    const int t = amp::tensor_of(meta, c);
    long long first, n;
    amp::chunk_range(meta, t, c, chunk, first, n);
    const float step = *reinterpret_cast<const float*>(meta.ptr[7][t]) + 1.0f;
    const amp::AdamScalars s = amp::adam_scalars(lr, beta1, beta2, eps, weight_decay, step);
    const G* grad = reinterpret_cast<const G*>(meta.ptr[0][t]) + first;
    const amp::MasterList<Master> master(meta.ptr[1][t], meta.ptr[2][t], first);
    const amp::MomentList<Moment, true> exp_avg(meta.ptr[3][t], meta.ptr[5][t], first);
    const amp::MomentList<Moment, false> exp_avg_sq(meta.ptr[4][t], meta.ptr[6][t], first,
                                                     static_cast<unsigned int>(step));
    for (long long base = warp_first; base < n; base += amp::kBlock) {  // the same in a warp
      const long long i = base + lane, block = base / amp::kWarp;
      const bool in = i < n;
      float m = 0.0f, v = 0.0f;
      if (in) {
        float g = amp::to_float<G>(grad[i]);
        if (inv != nullptr) g = amp::mul_rn(g, scale);
        float p = master.load(i);
        m = exp_avg.load(i, block);
        v = exp_avg_sq.load(i, block);
        amp::adam_element(s, decoupled != 0, weight_decay != 0.0, g, p, m, v);
        master.store(i, p);
      }
      exp_avg.store(i, block, in, lane == 0, m);
      exp_avg_sq.store(i, block, in, lane == 0, v);
    }
  }
}

// The step counts of an amp_compact_adam launch's tensors (list 7), as amp_count_steps.
__global__ void __launch_bounds__(amp::kBlock)
amp_compact_count_steps(const AMP_GRID_CONSTANT amp::Meta<8> meta, const float* found) {
  amp::count_steps(meta, 7, found);
}

// The fused step of SGD over compact state, as amp_compact_adam: lists (gradient G, master,
// master's second list, momentum buffer, its scales, unused); the buffer lists are null without
// momentum. first_step: the buffers start as the gradients (not read), as torch's first step.
template <typename G, typename Master, typename Moment>
__global__ void __launch_bounds__(amp::kBlock)
amp_compact_sgd(const AMP_GRID_CONSTANT amp::Meta<6> meta, const float* inv, const float* found,
                double lr, double momentum, double dampening, double weight_decay,
                long long nesterov, long long first_step, long long chunk) {
  if (found != nullptr && *found != 0.0f) return;
  const float scale = inv != nullptr ? *inv : 1.0f;
  amp::SgdScalars s;
  s.weight_decay = static_cast<float>(weight_decay);
  s.momentum = static_cast<float>(momentum);
  s.one_minus_dampening = static_cast<float>(1.0 - dampening);
  s.minus_lr = static_cast<float>(-lr);
  const bool with_momentum = momentum != 0.0;
  const bool first = first_step != 0;
  const int total = meta.chunk_start[meta.ntensors];
  const int lane = threadIdx.x % amp::kWarp;
  const long long warp_first = threadIdx.x - lane;
  for (int c = blockIdx.x; c < total; c += gridDim.x) {
    const int t = amp::tensor_of(meta, c);
    long long first_element, n;
    amp::chunk_range(meta, t, c, chunk, first_element, n);
    const G* grad = reinterpret_cast<const G*>(meta.ptr[0][t]) + first_element;
    const amp::MasterList<Master> master(meta.ptr[1][t], meta.ptr[2][t], first_element);
    const amp::MomentList<Moment, true> buffer(meta.ptr[3][t], meta.ptr[4][t], first_element);
    for (long long base = warp_first; base < n; base += amp::kBlock) {  // the same in a warp
      const long long i = base + lane, block = base / amp::kWarp;
      const bool in = i < n;
      float buf = 0.0f;
      if (in) {
        float g = amp::to_float<G>(grad[i]);
        if (inv != nullptr) g = amp::mul_rn(g, scale);
        float p = master.load(i);
        if (with_momentum && !first) buf = buffer.load(i, block);
        amp::sgd_element(s, weight_decay != 0.0, with_momentum, nesterov != 0, g, p, buf, first);
        master.store(i, p);
      }
      if (with_momentum) buffer.store(i, block, in, lane == 0, buf);
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

// The compact steps: G the gradient's type; the master compact, or exact with a copy of the
// types amp_adam writes (float: none); the moments FP32, bf16 or 8-bit codes.
#define AMP_COMPACT_KERNELS(G, Master, Moment)                                                      \
  template __global__ void amp_compact_adam<G, Master, Moment>(                                    \
      const AMP_GRID_CONSTANT amp::Meta<8>, const float*, const float*, double, double, double,    \
      double, double, long long, long long);                                                       \
  template __global__ void amp_compact_sgd<G, Master, Moment>(                                     \
      const AMP_GRID_CONSTANT amp::Meta<6>, const float*, const float*, double, double, double,    \
      double, long long, long long, long long);
#define AMP_COMPACT_MOMENTS(G, Master)                                                              \
  AMP_COMPACT_KERNELS(G, Master, float)                                                            \
  AMP_COMPACT_KERNELS(G, Master, __nv_bfloat16)                                                    \
  AMP_COMPACT_KERNELS(G, Master, amp::Codes8)
AMP_COMPACT_MOMENTS(__nv_bfloat16, amp::Compact)
AMP_COMPACT_MOMENTS(__half, amp::Compact)
AMP_COMPACT_MOMENTS(float, amp::Compact)
AMP_COMPACT_MOMENTS(__nv_bfloat16, amp::Remainder)
AMP_COMPACT_MOMENTS(__half, amp::Remainder)
AMP_COMPACT_MOMENTS(float, amp::Remainder)
AMP_COMPACT_MOMENTS(__half, amp::Exact<__half>)
AMP_COMPACT_MOMENTS(__nv_bfloat16, amp::Exact<__nv_bfloat16>)
AMP_COMPACT_MOMENTS(float, amp::Exact<float>)
AMP_COMPACT_MOMENTS(float, amp::Exact<__half>)
AMP_COMPACT_MOMENTS(float, amp::Exact<__nv_bfloat16>)
