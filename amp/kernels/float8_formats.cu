// The FP8 formats of amp_f8_cast (float8_cast.cu): a float's FP8 bits, saturated and rounded to
// nearest even (cvt.satfinite from compute capability 8.9, else on the bits), and the scales
// made from the amaxes, with their inverses.

namespace amp_f8 {

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

}  // namespace amp_f8
