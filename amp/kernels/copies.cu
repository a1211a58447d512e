// Scaled copies and accumulates between lists of tensors (the "copies" family): model gradients
// into FP32 master gradients, FP32 masters into model parameters.

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
