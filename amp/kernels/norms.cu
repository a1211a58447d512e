// The L2 norm of a list of tensors (the "norms" family): sums of squares per chunk in double, then
// their sum in one block.

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
