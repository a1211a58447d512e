// amp_f8_cast, the second of a cast's two launches (after float8_amax.cu's): each job's FP8
// layouts from its amaxes, tile by tile (float8.cu's loads, float8_formats.cu's conversions and
// scales), the transposed tile staged in shared memory; the scales and their inverses written once.

namespace amp_f8 {

// A tile's FP8 bytes, staged for the transposed write.
struct alignas(16) Staged {
  unsigned char bytes[kTile][kTile];
};

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

}  // namespace amp_f8

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

#define AMP_F8_CAST(In)                                                                         \
  template __global__ void amp_f8_cast<In, 0>(const AMP_F8_GRID_CONSTANT amp_f8::Meta, long long); \
  template __global__ void amp_f8_cast<In, 1>(const AMP_F8_GRID_CONSTANT amp_f8::Meta, long long);
AMP_F8_CAST(float)
AMP_F8_CAST(__half)
AMP_F8_CAST(__nv_bfloat16)
#undef AMP_F8_CAST
