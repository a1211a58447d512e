// The fused steps' arithmetic, one element at a time: torch's AdamW / Adam and SGD, every
// operation rounded as torch's own fused kernel rounds it on the device the step runs on.
//
// The torch backend steps CPU tensors with torch's CPU fused kernels, and CUDA tensors it cannot
// give the CuPy kernels with torch's CUDA ones; the two round differently. So the source holds
// both formulas: torch's CPU one by default (the emulated grid checks it against the torch backend
// on the CPU), torch's CUDA one where AMP_TORCH_CUDA_ADAM is defined, as the CuPy build defines it
// (amp/kernels/_sources.py: on a GPU amp's masters are then torch's CUDA fused AdamW's bit for
// bit). SGD rounds alike on both.

namespace amp {

#ifndef AMP_TORCH_CUDA_ADAM

// The hyperparameters of one parameter group, as float where torch's CPU kernel uses them as
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
// Decay: weight_decay != 0; Decoupled: AdamW. `root`: sqrt(v), which an 8-bit second moment's code
// reuses.
template <bool Decay, bool Decoupled>
__device__ __forceinline__ void adam_element(const AdamScalars& s, float g, float& p, float& m,
                                             float& v, float& root) {
  if (Decay) {
    if (Decoupled) p = mul_rn(p, s.decay);
    else g = fma_rn(s.weight_decay, p, g);
  }
  m = fma_rn(s.one_minus_beta1, sub_rn(g, m), m);
  v = fma_rn(mul_rn(s.one_minus_beta2, g), g, mul_rn(v, s.beta2));
  root = sqrt_rn(v);
  const float d = add_rn(div_rn(root, s.bias_correction2_sqrt), s.eps);
  p = sub_rn(p, div_rn(mul_rn(s.step_size, m), d));
}

#else  // AMP_TORCH_CUDA_ADAM

// torch's CUDA fused Adam (aten/src/ATen/native/cuda/fused_adam_utils.cuh, torch 2.11 to 2.13):
// the hyperparameters cast to float, the bias corrections in float from powf (CUDA's libdevice,
// as torch's pow_ calls it) and a float square root.
struct AdamScalars {
  float minus_lr_weight_decay;  // -(lr * wd), the product rounded (AdamW)
  float weight_decay;           // (Adam: added to the gradient)
  float beta1, beta2, eps, step_size, bias_correction2_sqrt;
};

__device__ __forceinline__ AdamScalars adam_scalars(double lr, double beta1, double beta2,
                                                    double eps, double weight_decay, float step) {
  AdamScalars s;
  const float lr_float = static_cast<float>(lr);
  s.weight_decay = static_cast<float>(weight_decay);
  s.minus_lr_weight_decay = negate(mul_rn(lr_float, s.weight_decay));
  s.beta1 = static_cast<float>(beta1);
  s.beta2 = static_cast<float>(beta2);
  s.eps = static_cast<float>(eps);
  s.step_size = div_rn(lr_float, sub_rn(1.0f, powf(s.beta1, step)));
  s.bias_correction2_sqrt = sqrt_rn(sub_rn(1.0f, powf(s.beta2, step)));
  return s;
}

// One element of torch's CUDA adam_math, with the fused multiply-adds nvcc makes of it (read off
// its SASS: the weight decay's multiply and add fused, the rest as written):
//   AdamW: p = fma(-(lr wd), p, p)     Adam: g = fma(p, wd, g)
//   m = fma(b1, m, fma(-b1, g, g))
//   v = fma(b2, v, fma(-b2, g g, g g))
//   d = sqrt(v) / sqrt(1 - b2^t) + eps
//   p = p - (lr / (1 - b1^t)) m / d
template <bool Decay, bool Decoupled>
__device__ __forceinline__ void adam_element(const AdamScalars& s, float g, float& p, float& m,
                                             float& v, float& root) {
  if (Decay) {
    if (Decoupled) p = fma_rn(s.minus_lr_weight_decay, p, p);
    else g = fma_rn(p, s.weight_decay, g);
  }
  m = fma_rn(s.beta1, m, fma_rn(negate(s.beta1), g, g));
  const float g2 = mul_rn(g, g);
  v = fma_rn(s.beta2, v, fma_rn(negate(s.beta2), g2, g2));
  root = sqrt_rn(v);
  const float d = add_rn(div_rn(root, s.bias_correction2_sqrt), s.eps);
  p = sub_rn(p, div_rn(mul_rn(s.step_size, m), d));
}

#endif  // AMP_TORCH_CUDA_ADAM

// One element of torch's SGD (its for-loop and foreach implementations, and its fused kernels):
//   g = fma(wd, p, g); buf = fma(1 - dampening, g, buf * momentum);
//   g = nesterov ? fma(momentum, buf, g) : buf; p = fma(-lr, g, p)
struct SgdScalars {
  float weight_decay, momentum, one_minus_dampening, minus_lr;
};

__device__ __forceinline__ SgdScalars sgd_scalars(double lr, double momentum, double dampening,
                                                  double weight_decay) {
  SgdScalars s;
  s.weight_decay = static_cast<float>(weight_decay);
  s.momentum = static_cast<float>(momentum);
  s.one_minus_dampening = static_cast<float>(1.0 - dampening);
  s.minus_lr = static_cast<float>(-lr);
  return s;
}

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
