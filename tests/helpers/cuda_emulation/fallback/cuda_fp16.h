// __half for the CUDA emulation where CUDA's headers are not installed: the type and the two
// conversions multi_tensor.cu uses, exact (round to nearest even, subnormals kept) on the bits.
#pragma once
#include <string.h>

struct __half {
  unsigned short __x;
};

inline float __half2float(__half h) {
  const unsigned int sign = static_cast<unsigned int>(h.__x & 0x8000u) << 16;
  unsigned int exponent = (h.__x >> 10) & 0x1fu;
  unsigned int mantissa = h.__x & 0x3ffu;
  unsigned int bits;
  if (exponent == 0x1fu) {
    bits = sign | 0x7f800000u | (mantissa << 13);  // inf, NaN
  } else if (exponent != 0) {
    bits = sign | ((exponent + 112u) << 23) | (mantissa << 13);
  } else if (mantissa == 0) {
    bits = sign;
  } else {  // subnormal: normalise (every half subnormal is a normal float)
    exponent = 113u;
    while ((mantissa & 0x400u) == 0) {
      mantissa <<= 1;
      --exponent;
    }
    bits = sign | (exponent << 23) | ((mantissa & 0x3ffu) << 13);
  }
  float out;
  memcpy(&out, &bits, sizeof(out));
  return out;
}

inline __half __float2half_rn(float f) {
  unsigned int bits;
  memcpy(&bits, &f, sizeof(bits));
  const unsigned int sign = (bits >> 16) & 0x8000u;
  const unsigned int magnitude = bits & 0x7fffffffu;
  unsigned int out;
  if (magnitude > 0x7f800000u) {
    out = 0x7e00u | ((magnitude >> 13) & 0x3ffu);  // a quiet NaN
  } else if (magnitude >= 0x477ff000u) {
    out = 0x7c00u;  // 65520 and up round to infinity
  } else if (magnitude >= 0x38800000u) {  // a normal half
    const unsigned int rebiased = magnitude - 0x38000000u;
    out = (rebiased + 0xfffu + ((rebiased >> 13) & 1u)) >> 13;
  } else {  // a subnormal half or zero: round magnitude * 2**24 to an integer
    const unsigned int shift = 126u - (magnitude >> 23);  // 14 or more
    const unsigned int mantissa = (magnitude & 0x7fffffu) | (magnitude >= 0x800000u ? 0x800000u : 0u);
    const unsigned int effective = magnitude >= 0x800000u ? shift : 125u;  // float subnormals
    if (effective >= 32u) {
      out = 0;
    } else {
      out = mantissa >> effective;
      const unsigned int rest = mantissa & ((1u << effective) - 1u);
      const unsigned int half = 1u << (effective - 1u);
      if (rest > half || (rest == half && (out & 1u))) ++out;
    }
  }
  __half h;
  h.__x = static_cast<unsigned short>(sign | out);
  return h;
}
