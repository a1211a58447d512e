// The compact forms of O2's state, one element at a time (amp/kernels/_codecs.py, operation by
// operation): a master as its bf16 weight and an int8 correction or an int16 remainder, a moment
// as 8-bit codes with one FP32 scale per block of 32 elements, a bf16 second moment rounded
// stochastically.

namespace amp {

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

// A block's divisor: its scale where the scale is > 0 (on the bits: a subnormal scale counts,
// NaN does not), else 1.
__device__ __forceinline__ float block_divisor(unsigned int scale_bits) {
  return scale_bits != 0u && scale_bits <= 0x7f800000u ? __uint_as_float(scale_bits) : 1.0f;
}

// The codes' values before their block's scale, one table of 256 per kind, computed by every
// block at its start as _codecs.py computes them for each element (the decode of a code is then a
// table read and a multiply: no division per element). Softsign codes: y = z / (2 - |z|) with
// z = code / 127, at index code & 0xff. Square-root codes: code / 255 (the root over the scale).
constexpr int kCodes = 256;

__device__ __forceinline__ float signed_code_value(int index) {
  const float z = div_rn(static_cast<float>(static_cast<signed char>(index)), 127.0f);
  return div_rn(z, sub_rn(2.0f, abs_bits(z)));
}

__device__ __forceinline__ float unsigned_code_value(int index) {
  return div_rn(static_cast<float>(index), 255.0f);
}

// The signed code of `value` in a block of divisor `divisor`: softsign 2y / (1 + |y|) of
// y = value / divisor onto -127..127, rounded to nearest even.
__device__ AMP_RARE signed char signed_code(float value, float divisor) {
  const float y = div_rn(value, divisor);
  const float z = div_rn(mul_rn(y, 2.0f), add_rn(abs_bits(y), 1.0f));
  return static_cast<signed char>(static_cast<int>(rintf(mul_rn(z, 127.0f))));
}

// The unsigned code of rounded value `t` of a square root `root`: at most 255, a positive root
// never code 0.
__device__ __forceinline__ unsigned char unsigned_code_of(float t, float root) {
  int code = static_cast<int>(floorf(t));
  if (code > 255) code = 255;
  const unsigned int root_bits = __float_as_uint(root);
  if (code == 0 && root_bits != 0u && root_bits <= 0x7f800000u) code = 1;  // root > 0
  return static_cast<unsigned char>(code);
}

// The unsigned code of a square root `root` in a block of divisor `divisor`: root / divisor onto
// 0..255, rounded stochastically by `noise` (dither's).
__device__ AMP_RARE unsigned char unsigned_code(float root, float divisor, float noise) {
  const float y = div_rn(root, divisor);
  return unsigned_code_of(add_rn(mul_rn(y, 255.0f), noise), root);
}

// The same codes without their divisions where the result is certain. A code is an integer the
// exact operations round to (signed: rint of 127 z; unsigned: floor of 255 y + noise); the exact
// value those operations round lies within 4e-5 of the true quotients' (a few roundings of
// 2**-24, times at most 255), and the approximation below (the reciprocal of the divisor, rounded;
// __fdividef's 2-ulp quotient) within 7e-5 of it too. So where the approximation lies further than
// kCodeMargin from a rounding boundary (signed: k + 1/2; unsigned: k), its rounding is the code;
// nearer (about 1 value in 4,000), the exact operations decide. Only for a divisor within
// 2**-100..2**100, where no product flushes or overflows (codes_approximable). The products and
// sums are the non-flushing ones (CuPy's -ftz=true): __fdividef flushes a subnormal quotient
// and rintf / floorf a subnormal operand to 0, where the code is 0 (floorf's are not negative).
constexpr float kCodeMargin = 0x1p-12f;

__device__ __forceinline__ bool codes_approximable(float divisor) {
  const unsigned int bits = __float_as_uint(divisor);
  return bits >= 0x0d800000u && bits <= 0x71800000u;
}

// signed_code's result where certain (`certain` false: signed_code decides), given `inverse`:
// 1 / divisor rounded.
__device__ __forceinline__ signed char signed_code_fast(float value, float inverse,
                                                        bool& certain) {
  const float y = mul_rn(value, inverse);
  const float t = __fdividef(mul_rn(y, 254.0f), add_rn(abs_bits(y), 1.0f));  // 127 z
  const float nearest = rintf(t);
  certain = abs_bits(sub_rn(t, nearest)) < 0.5f - kCodeMargin;
  return static_cast<signed char>(static_cast<int>(nearest));
}

// unsigned_code's result where certain, as signed_code_fast.
__device__ __forceinline__ unsigned char unsigned_code_fast(float root, float inverse,
                                                            float noise, bool& certain) {
  const float t = fma_rn(mul_rn(root, inverse), 255.0f, noise);
  const float rest = sub_rn(t, floorf(t));
  certain = rest > kCodeMargin && rest < 1.0f - kCodeMargin;
  return unsigned_code_of(t, root);
}

// A 32-bit hash (_codecs._mix's, whose int64 arithmetic this uint32 one wraps as).
__device__ __forceinline__ unsigned int mix(unsigned int x) {
  x ^= x >> 16;
  x *= 0x7FEB352Du;
  x ^= x >> 15;
  x *= 0x2C1B3C6Du;
  return x ^ (x >> 16);
}

// The step's half of the dither's bits: the high 16 bits of the hash of the step count.
__device__ __forceinline__ unsigned int dither_salt(unsigned int step) {
  return mix(step * 0x61C88647u) >> 16;
}

// 16 random bits (_codecs.dither_bits'): the high 16 bits of the hash of element `index` of its
// tensor (modulo 2**16) xor the step's salt.
__device__ __forceinline__ unsigned int dither_bits(long long index, unsigned int salt) {
  return (mix(static_cast<unsigned int>(index & 0xFFFF)) >> 16) ^ salt;
}

// Uniform in [0, 1), a multiple of 2**-16: _codecs.dither_bits' bits times 2**-16.
__device__ __forceinline__ float dither(long long index, unsigned int salt) {
  return mul_rn(static_cast<float>(dither_bits(index, salt)), 1.52587890625e-05f);  // exact
}

// A non-negative value's bf16 bits, rounded stochastically by 16 random bits
// (_codecs.bf16_stochastic).
__device__ __forceinline__ unsigned short bf16_stochastic(float value, unsigned int bits) {
  return static_cast<unsigned short>((__float_as_uint(value) + bits) >> 16);
}

}  // namespace amp
