// amp_f8_amax, the first of a cast's two launches (float8.cu): each job's amaxes, of the whole
// matrix, of each row and of each column as the job asks, atomicMax on the float bits into
// buffers the host zeroed.

namespace amp_f8 {

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

template __global__ void amp_f8_amax<float>(const AMP_F8_GRID_CONSTANT amp_f8::Meta);
template __global__ void amp_f8_amax<__half>(const AMP_F8_GRID_CONSTANT amp_f8::Meta);
template __global__ void amp_f8_amax<__nv_bfloat16>(const AMP_F8_GRID_CONSTANT amp_f8::Meta);
