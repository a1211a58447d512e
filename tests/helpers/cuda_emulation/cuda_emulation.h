// CUDA on the CPU, for tests: g++ compiles amp/kernels/multi_tensor.cu unmodified with this
// header force-included (-include), and every launch runs the grid on the calling thread.
//
// - A block's threads are fibers (ucontext) that meet at __syncthreads / __syncthreads_or. Between
//   two barriers each thread runs alone, in the order the launch asks for (forward, reversed,
//   shuffled), so a result that depends on the order of threads within a phase shows up.
//   Blocks run one after another, in the same order.
// - __shared__ is a static thread_local: one copy per OS thread, shared by the block that runs.
// - Inline PTX: the instructions the source uses (mul/add/sub/div/sqrt/fma .rn.f32) are computed
//   exactly, with subnormals kept whatever the emulated flush-to-zero mode (see AMP_EMU_PTX).
// - -ftz=true (which CuPy always appends) is emulated by the x86 MXCSR FTZ and DAZ bits for the
//   whole launch, so plain float arithmetic flushes subnormal inputs and results as on the GPU.
// - __half / __nv_bfloat16 come from CUDA's own headers (their host code) when they are on the
//   include path, else from fallback/ (exact software conversions).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <math.h>
#include <stddef.h>
#include <string.h>
#include <ucontext.h>

#include <cstdint>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#if defined(__x86_64__) || defined(__i386__)
#include <xmmintrin.h>
#define AMP_EMU_HAS_FTZ 1
#else
#define AMP_EMU_HAS_FTZ 0
#endif

// The CUDA keywords. CUDA's headers define them as empty for host compilers, __shared__ too,
// which would give each thread its own array: redefine them all.
#undef __global__
#undef __device__
#undef __host__
#undef __forceinline__
#undef __launch_bounds__
#undef __grid_constant__
#undef __shared__
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline __attribute__((always_inline))
#define __launch_bounds__(...)
#define __grid_constant__
#define __shared__ static thread_local

namespace amp_emu {

struct Dim3 {
  unsigned int x = 0, y = 0, z = 0;
};

enum Order { kForward = 0, kReversed = 1, kShuffled = 2 };

struct LaunchSpec {
  unsigned int grid;
  unsigned int block;
  int order;               // an Order, for the threads within a phase and for the blocks
  unsigned long long seed;  // for kShuffled
  int ftz;                 // emulate -ftz=true
};

struct Fiber {
  enum State { kReady, kWaiting, kDone };
  ucontext_t context;
  Dim3 thread;
  State state = kReady;
  int barrier_kind = 0;  // 0: __syncthreads, 1: __syncthreads_or
  int predicate = 0;
  int result = 0;
};

struct Grid {
  Dim3 grid_dim, block_dim, block;
  ucontext_t scheduler;
  std::vector<Fiber> fibers;
  void (*body)(void*) = nullptr;
  void* body_argument = nullptr;
  std::string error;
};

inline thread_local Grid* grid = nullptr;
inline thread_local Fiber* fiber = nullptr;
inline thread_local std::vector<char> stacks;
constexpr size_t kStackBytes = 64 * 1024;

inline const Dim3& thread_index() { return fiber->thread; }

// A thread arrives at a barrier: hand control back to the scheduler until every thread of the
// block has arrived; then all get the barrier's result.
inline int barrier(int kind, int predicate) {
  Fiber* self = fiber;
  self->state = Fiber::kWaiting;
  self->barrier_kind = kind;
  self->predicate = predicate;
  swapcontext(&self->context, &grid->scheduler);
  return self->result;
}

inline void fiber_entry() {
  grid->body(grid->body_argument);
  fiber->state = Fiber::kDone;  // returning resumes the scheduler (uc_link)
}

inline std::vector<unsigned int> permutation(unsigned int n, int order, unsigned long long seed) {
  std::vector<unsigned int> out(n);
  for (unsigned int i = 0; i < n; ++i) out[i] = order == kReversed ? n - 1 - i : i;
  if (order == kShuffled) {
    unsigned long long state = seed * 0x9e3779b97f4a7c15ull + 1;
    for (unsigned int i = n; i > 1; --i) {  // Fisher-Yates with splitmix64
      state += 0x9e3779b97f4a7c15ull;
      unsigned long long z = state;
      z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
      z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
      z ^= z >> 31;
      std::swap(out[i - 1], out[z % i]);
    }
  }
  return out;
}

// Runs block grid->block to completion, phase by phase. False (and grid->error) when the
// block's threads do not meet at one barrier.
inline bool run_block(const LaunchSpec& spec, unsigned long long block_seed) {
  const unsigned int n = spec.block;
  for (unsigned int t = 0; t < n; ++t) {
    Fiber& f = grid->fibers[t];
    f.state = Fiber::kReady;
    f.thread.x = t;
    getcontext(&f.context);
    f.context.uc_stack.ss_sp = stacks.data() + static_cast<size_t>(t) * kStackBytes;
    f.context.uc_stack.ss_size = kStackBytes;
    f.context.uc_link = &grid->scheduler;
    makecontext(&f.context, fiber_entry, 0);
  }
  for (unsigned long long phase = 0;; ++phase) {
    for (unsigned int t : permutation(n, spec.order, block_seed + phase)) {
      fiber = &grid->fibers[t];
      swapcontext(&grid->scheduler, &fiber->context);
    }
    fiber = nullptr;
    unsigned int done = 0, kinds[2] = {0, 0};
    int any = 0;
    for (const Fiber& f : grid->fibers) {
      if (f.state == Fiber::kDone) {
        ++done;
      } else {
        ++kinds[f.barrier_kind];
        any |= f.predicate;
      }
    }
    if (done == n) return true;
    if (done != 0 || (kinds[0] != 0 && kinds[1] != 0)) {
      grid->error = "block " + std::to_string(grid->block.x) + ", barrier " +
                    std::to_string(phase) + ": " + std::to_string(done) + " threads returned, " +
                    std::to_string(kinds[0]) + " wait at __syncthreads, " +
                    std::to_string(kinds[1]) + " at __syncthreads_or (all must meet at one)";
      return false;
    }
    const int result = kinds[1] != 0 ? any : 0;
    for (Fiber& f : grid->fibers) {
      f.result = result;
      f.state = Fiber::kReady;
    }
  }
}

template <typename Body>
void call_body(void* body) {
  (*static_cast<Body*>(body))();
}

// cudaLaunchKernel's contract: args[i] points at the bytes of parameter i. sizes[i] is what the
// host packed, checked against the kernel's parameter type (a mismatch is a host-side bug that a
// GPU would not report). Returns 0, or 1 with a message in `error`.
template <typename... Params>
int launch(void (*kernel)(Params...), const LaunchSpec& spec, void* const* args,
           const long long* sizes, int count, char* error, size_t error_bytes) {
  std::tuple<std::decay_t<Params>...> values;
  std::string message;
  constexpr long long expected[] = {static_cast<long long>(sizeof(std::decay_t<Params>))...};
  if (count != static_cast<int>(sizeof...(Params))) {
    message = "the kernel takes " + std::to_string(sizeof...(Params)) + " arguments, got " +
              std::to_string(count);
  }
  for (int i = 0; message.empty() && i < count; ++i) {
    if (sizes[i] != expected[i]) {
      message = "argument " + std::to_string(i) + " has " + std::to_string(sizes[i]) +
                " bytes, the kernel's parameter " + std::to_string(expected[i]);
    }
  }
  if (message.empty() && (spec.grid == 0 || spec.block == 0 || spec.block > 1024)) {
    message = "invalid launch configuration";
  }
  if (message.empty()) {
    std::apply([&](auto&... value) {
      int i = 0;
      ((memcpy(&value, args[i++], sizeof(value))), ...);
    }, values);
    auto body = [&] { std::apply(kernel, values); };
    Grid state;
    state.grid_dim.x = spec.grid;
    state.grid_dim.y = state.grid_dim.z = 1;
    state.block_dim.x = spec.block;
    state.block_dim.y = state.block_dim.z = 1;
    state.fibers.resize(spec.block);
    state.body = call_body<decltype(body)>;
    state.body_argument = &body;
    if (stacks.size() < spec.block * kStackBytes) stacks.resize(spec.block * kStackBytes);
    grid = &state;
#if AMP_EMU_HAS_FTZ
    const unsigned int csr = _mm_getcsr();
    if (spec.ftz) _mm_setcsr(csr | 0x8040u);  // FTZ (bit 15) and DAZ (bit 6)
#endif
    for (unsigned int b : permutation(spec.grid, spec.order, spec.seed)) {
      state.block.x = b;
      if (!run_block(spec, spec.seed + 7919ull * b)) break;
    }
#if AMP_EMU_HAS_FTZ
    _mm_setcsr(csr);
#endif
    grid = nullptr;
    message = state.error;
  }
  if (message.empty()) return 0;
  snprintf(error, error_bytes, "%s", message.c_str());
  return 1;
}

namespace ptx {

enum Opcode { kMul, kAdd, kSub, kDiv, kSqrt, kFma, kUnknown };

// The inline-PTX statements the shim computes, as the source writes them (whitespace aside):
// `asm("<opcode> %0, %1[, %2[, %3]];" : "=f"(r) : "f"(a)[, "f"(b)[, "f"(c)]])`.
constexpr const char* kStatements[] = {
    "\"mul.rn.f32%0,%1,%2;\":\"=f\"(r):\"f\"(a),\"f\"(b)",
    "\"add.rn.f32%0,%1,%2;\":\"=f\"(r):\"f\"(a),\"f\"(b)",
    "\"sub.rn.f32%0,%1,%2;\":\"=f\"(r):\"f\"(a),\"f\"(b)",
    "\"div.rn.f32%0,%1,%2;\":\"=f\"(r):\"f\"(a),\"f\"(b)",
    "\"sqrt.rn.f32%0,%1;\":\"=f\"(r):\"f\"(a)",
    "\"fma.rn.f32%0,%1,%2,%3;\":\"=f\"(r):\"f\"(a),\"f\"(b),\"f\"(c)",
};

constexpr bool same_but_spaces(const char* text, const char* pattern) {
  while (true) {
    while (*text == ' ') ++text;
    if (*text != *pattern) return false;
    if (*text == '\0') return true;
    ++text;
    ++pattern;
  }
}

constexpr Opcode opcode(const char* statement) {
  for (int i = 0; i < kUnknown; ++i) {
    if (same_but_spaces(statement, kStatements[i])) return static_cast<Opcode>(i);
  }
  return kUnknown;
}

// .rn without .ftz: round to nearest even, subnormal inputs and results kept, whatever the
// emulated -ftz mode. The empty asm statements pin the arithmetic between the MXCSR writes.
template <Opcode op>
inline float execute(float a, float b, float c) {
#if AMP_EMU_HAS_FTZ
  const unsigned int csr = _mm_getcsr();
  _mm_setcsr(csr & ~0x8040u);
  __asm__ volatile("" : "+x"(a), "+x"(b), "+x"(c));
#endif
  float r;
  switch (op) {
    case kMul: r = a * b; break;
    case kAdd: r = a + b; break;
    case kSub: r = a - b; break;
    case kDiv: r = a / b; break;
    case kSqrt: r = sqrtf(a); break;
    default: r = fmaf(a, b, c); break;
  }
#if AMP_EMU_HAS_FTZ
  __asm__ volatile("" : "+x"(r));
  _mm_setcsr(csr);
#endif
  return r;
}

// Operands a statement does not name: the macro below passes a, b and c to every statement, and
// a function of one or two operands finds these (its own a, b shadow them).
inline float b = 0.0f, c = 0.0f;

}  // namespace ptx
}  // namespace amp_emu

using amp_emu::ptx::b;
using amp_emu::ptx::c;

#define threadIdx (::amp_emu::thread_index())
#define blockIdx (::amp_emu::grid->block)
#define blockDim (::amp_emu::grid->block_dim)
#define gridDim (::amp_emu::grid->grid_dim)

inline void __syncthreads() { ::amp_emu::barrier(0, 0); }
inline int __syncthreads_or(int predicate) { return ::amp_emu::barrier(1, predicate != 0); }

inline unsigned int __float_as_uint(float x) {
  unsigned int bits;
  memcpy(&bits, &x, sizeof(bits));
  return bits;
}

inline float __uint_as_float(unsigned int bits) {
  float x;
  memcpy(&x, &bits, sizeof(x));
  return x;
}

// Inline PTX. g++ cannot take PTX, and a macro cannot split the operand lists, so the statement
// is stringized and matched whole against the ones the shim knows, with their operand names
// (r = op(a[, b[, c]]), as in multi_tensor.cu). Any other inline PTX fails the build here.
#define asm(...)                                                                              \
  do {                                                                                        \
    constexpr ::amp_emu::ptx::Opcode amp_emu_opcode = ::amp_emu::ptx::opcode(#__VA_ARGS__);  \
    static_assert(amp_emu_opcode != ::amp_emu::ptx::kUnknown,                                 \
                  "inline PTX the CUDA emulation does not compute; it knows "                 \
                  "asm(\"mul|add|sub|div.rn.f32 %0, %1, %2;\" : \"=f\"(r) : \"f\"(a), \"f\"(b)) "  \
                  "and sqrt.rn.f32 / fma.rn.f32 with one / three operands");                   \
    r = ::amp_emu::ptx::execute<amp_emu_opcode>(a, b, c);                                     \
  } while (0)
