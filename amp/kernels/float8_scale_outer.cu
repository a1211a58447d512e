// amp_f8_scale_outer: the rowwise recipe's output scaling, in place (float8.cu's 16-byte vectors
// and non-flushing product).

namespace amp_f8 {

// bf16 <- float, round to nearest even on the bits (as c10::BFloat16); NaN stays a quiet NaN.
__device__ __forceinline__ unsigned int bf16_bits(float x) {
  const unsigned int bits = __float_as_uint(x);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return (bits >> 16) | 0x0040u;
  return (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
}

}  // namespace amp_f8

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
