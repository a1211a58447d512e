// The fused steps over compact state (the "compact" family): AdamW / Adam and SGD as steps.cu's,
// the master held as a bf16 weight and an int8 correction or int16 remainder (or FP32, with its
// low-precision copy), the moments FP32, bf16 or 8-bit codes with a scale per 32 elements.

// The blocks of 512 threads an SM holds at once, asked of the compiler: two (64 registers a
// thread: no spill on sm_90 but a few bytes in three exact-master variants with FP32 moments, which
// amp_adam takes), one for the 8-bit codes' kernels, which need more.
template <typename Moment> struct StepBlocks { static constexpr int value = 2; };
template <> struct StepBlocks<amp::Codes8> { static constexpr int value = 1; };

// AdamW / Adam over lists (gradient G, master, master's second list, exp_avg, exp_avg_sq,
// exp_avg's scales, exp_avg_sq's scales, step). Master amp::Compact: lists 1 and 2 are the bf16
// weight and the int8 correction; amp::Remainder: the bf16 weight and the int16 remainder;
// amp::Exact<L>: the FP32 master and its copy in L (null: none). Moment float / __nv_bfloat16:
// the moments as held, lists 5 and 6 null; amp::Codes8: int8 softsign and uint8 square-root codes,
// lists 5 and 6 their FP32 scales per 32 elements (`chunk` must be a multiple of 32). Each element
// is decoded, stepped by amp::adam_element and encoded. `starts` (null: all 0): each tensor's first
// element in its whole tensor (a shard's), where its second moment's dither begins; a coded one's
// a multiple of 32. Nothing happens where *found != 0; amp_compact_count_steps then adds the step.
template <typename G, typename Master, typename Moment>
__global__ void __launch_bounds__(amp::kBlock, StepBlocks<Moment>::value)
amp_compact_adam(const AMP_GRID_CONSTANT amp::Meta<8> meta, const float* inv, const float* found,
                 double lr, double beta1, double beta2, double eps, double weight_decay,
                 long long decoupled, const long long* starts, long long chunk) {
  if (found != nullptr && *found != 0.0f) return;
  const float* tables = amp::CodeTables<Moment>::build();
  const int total = meta.chunk_start[meta.ntensors];
  int scalars_of = -1;  // the tensor whose step `s` and `salt` hold
  amp::AdamScalars s;
  unsigned int salt = 0;
  for (int c = blockIdx.x; c < total; c += gridDim.x) {
    const int t = amp::tensor_of(meta, c);
    long long first, n;
    amp::chunk_range(meta, t, c, chunk, first, n);
    if (t != scalars_of) {
      const float step = amp::add_rn(*reinterpret_cast<const float*>(meta.ptr[7][t]), 1.0f);
      s = amp::adam_scalars(lr, beta1, beta2, eps, weight_decay, step);
      salt = amp::dither_salt(static_cast<unsigned int>(step));
      scalars_of = t;
    }
    const amp::MasterList<Master> master(meta.ptr[1][t], meta.ptr[2][t], first);
    const amp::MomentList<Moment, true> exp_avg(meta.ptr[3][t], meta.ptr[5][t], first, salt,
                                                tables);
    const amp::MomentList<Moment, false> exp_avg_sq(meta.ptr[4][t], meta.ptr[6][t], first, salt,
                                                    tables, starts != nullptr ? starts[t] : 0);
    amp::adam_chunk(reinterpret_cast<const G*>(meta.ptr[0][t]) + first, master, exp_avg,
                    exp_avg_sq, n, s, decoupled != 0, weight_decay != 0.0, inv);
  }
}

// The step counts of an amp_compact_adam launch's tensors (list 7), as amp_count_steps.
__global__ void __launch_bounds__(amp::kBlock)
amp_compact_count_steps(const AMP_GRID_CONSTANT amp::Meta<8> meta, const float* found) {
  amp::count_steps(meta, 7, found);
}

// SGD over compact state, as amp_compact_adam: lists (gradient G, master, master's second list,
// momentum buffer, its scales, unused); the buffer lists are null without momentum. first_step:
// the buffers start as the gradients (not read), as torch's first step.
template <typename G, typename Master, typename Moment>
__global__ void __launch_bounds__(amp::kBlock, StepBlocks<Moment>::value)
amp_compact_sgd(const AMP_GRID_CONSTANT amp::Meta<6> meta, const float* inv, const float* found,
                double lr, double momentum, double dampening, double weight_decay,
                long long nesterov, long long first_step, long long chunk) {
  if (found != nullptr && *found != 0.0f) return;
  const float* tables = amp::CodeTables<Moment>::build();
  const amp::SgdScalars s = amp::sgd_scalars(lr, momentum, dampening, weight_decay);
  const bool with_momentum = momentum != 0.0;
  const int total = meta.chunk_start[meta.ntensors];
  for (int c = blockIdx.x; c < total; c += gridDim.x) {
    const int t = amp::tensor_of(meta, c);
    long long first, n;
    amp::chunk_range(meta, t, c, chunk, first, n);
    const amp::MasterList<Master> master(meta.ptr[1][t], meta.ptr[2][t], first);
    const amp::MomentList<Moment, true> buffer(meta.ptr[3][t], meta.ptr[4][t], first, 0u, tables);
    amp::sgd_chunk(reinterpret_cast<const G*>(meta.ptr[0][t]) + first, master, buffer, n, s,
                   weight_decay != 0.0, with_momentum, nesterov != 0, first_step != 0, inv);
  }
}
