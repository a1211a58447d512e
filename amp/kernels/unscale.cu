// Unscale in place with inf/NaN detection, and the check alone (the "unscale" family).

// tensors *= *inv_scale in place; *found_inf = 1 if any element was inf/NaN.
template <typename T>
__global__ void __launch_bounds__(amp::kBlock)
amp_unscale(const AMP_GRID_CONSTANT amp::Meta<1> meta, const float* inv_scale, float* found_inf,
            long long chunk) {
  amp::scale_all<T, T, false, 1>(meta, inv_scale, found_inf, chunk);
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
