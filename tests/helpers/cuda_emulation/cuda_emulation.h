// CUDA on the CPU, for tests: g++ compiles amp/kernels/multi_tensor.cu and float8*.cu unmodified
// with this header force-included (-include), and every launch runs the grid on the calling
// thread.
//
// - A block's threads are fibers that meet at __syncthreads / __syncthreads_or. Between
//   two barriers each thread runs alone, in the order the launch asks for (forward, reversed,
//   shuffled), so a result that depends on the order of threads within a phase shows up.
//   Blocks run one after another, in the same order. On x86-64 a fiber switch saves the
//   callee-saved registers and swaps stacks (a few nanoseconds; glibc's swapcontext makes a
//   system call for the signal mask, about half a microsecond); elsewhere, and where a shadow
//   stack is in force, the fibers are ucontexts.
// - __shfl_xor_sync (int, unsigned int, float; the full warp, width 32): a thread waits there until
//   all 32 threads of its warp do, then each gets its partner's value and the warp runs on, in the
//   launch's order, while the other warps wait where they are. A warp whose threads do not all
//   reach the shuffle (some returned or wait at a block barrier) is an error, as on the GPU.
// - __shared__ is a static thread_local: one copy per OS thread, shared by the block that runs.
// - atomicMax (unsigned int): a plain read-modify-write, atomic since one thread runs at a time.
// - __fdividef: the rounded quotient (the GPU's is within 2 ulps of it).
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

#ifndef AMP_EMU_FAST_SWITCH  // -DAMP_EMU_FAST_SWITCH=0: ucontexts everywhere
#if defined(__x86_64__)
#define AMP_EMU_FAST_SWITCH 1
#else
#define AMP_EMU_FAST_SWITCH 0
#endif
#endif
#if AMP_EMU_FAST_SWITCH
// amp_emu_switch(save, load): pushes the callee-saved registers, stores the stack pointer in
// *save, loads `load` and pops the registers saved there (the System V ABI leaves the rest to the
// caller; MXCSR and the x87 control word are the launch's in every fiber).
extern "C" void amp_emu_switch(void** save, void* load);
__asm__(
    ".text\n"
    ".p2align 4\n"
    ".weak amp_emu_switch\n"
    ".hidden amp_emu_switch\n"
    ".type amp_emu_switch, @function\n"
    "amp_emu_switch:\n"
    "  pushq %rbp\n  pushq %rbx\n  pushq %r12\n  pushq %r13\n  pushq %r14\n  pushq %r15\n"
    "  movq %rsp, (%rdi)\n"
    "  movq %rsi, %rsp\n"
    "  popq %r15\n  popq %r14\n  popq %r13\n  popq %r12\n  popq %rbx\n  popq %rbp\n"
    "  ret\n"
    ".size amp_emu_switch, .-amp_emu_switch\n");
#endif

struct Fiber {
  enum State { kReady, kWaiting, kDone };
  ucontext_t context;
  void* stack_pointer = nullptr;  // the fast switch's saved stack
  Dim3 thread;
  State state = kReady;
  int barrier_kind = 0;  // 0: __syncthreads, 1: __syncthreads_or, 2: a warp shuffle
  int predicate = 0;
  int result = 0;
  // A warp shuffle: the mask, this thread's value and lane mask, and what it receives.
  unsigned int shuffle_mask = 0, shuffle_value = 0, shuffled = 0;
  int lane_mask = 0, width = 0;
};

constexpr unsigned int kWarp = 32;
constexpr int kShuffle = 2;  // Fiber::barrier_kind of a thread waiting at a warp shuffle

struct Grid {
  Dim3 grid_dim, block_dim, block;
  ucontext_t scheduler;
  void* scheduler_stack_pointer = nullptr;
  bool fast = false;  // the fibers switch with amp_emu_switch, else with swapcontext
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

// The running fiber hands control back to the scheduler; the scheduler runs fiber f until it does.
inline void leave(Fiber* self) {
#if AMP_EMU_FAST_SWITCH
  if (grid->fast) {
    amp_emu_switch(&self->stack_pointer, grid->scheduler_stack_pointer);
    return;
  }
#endif
  swapcontext(&self->context, &grid->scheduler);
}

inline void enter(Fiber* f) {
#if AMP_EMU_FAST_SWITCH
  if (grid->fast) {
    amp_emu_switch(&grid->scheduler_stack_pointer, f->stack_pointer);
    return;
  }
#endif
  swapcontext(&grid->scheduler, &f->context);
}

// Whether a CET shadow stack is in force (rdssp reads 0 where it is not: a no-op on CPUs without
// CET). Returns through swapped stacks would not match it; swapcontext keeps it.
inline bool shadow_stack() {
#if AMP_EMU_FAST_SWITCH
  unsigned long long pointer = 0;
  __asm__ volatile("rdsspq %0" : "+r"(pointer));
  return pointer != 0;
#else
  return true;
#endif
}

// A thread arrives at a barrier: hand control back to the scheduler until every thread of the
// block has arrived; then all get the barrier's result.
inline int barrier(int kind, int predicate) {
  Fiber* self = fiber;
  self->state = Fiber::kWaiting;
  self->barrier_kind = kind;
  self->predicate = predicate;
  leave(self);
  return self->result;
}

// A thread arrives at __shfl_xor_sync: hand control back until all threads of its warp have
// arrived (run_block exchanges their values).
inline unsigned int shuffle_xor(unsigned int mask, unsigned int value, int lane_mask, int width) {
  Fiber* self = fiber;
  self->state = Fiber::kWaiting;
  self->barrier_kind = kShuffle;
  self->shuffle_mask = mask;
  self->shuffle_value = value;
  self->lane_mask = lane_mask;
  self->width = width;
  leave(self);
  return self->shuffled;
}

// Exchanges the values of every warp whose threads all wait at a shuffle and makes them ready.
// Returns how many warps it released, or -1 (and grid->error) for a shuffle it cannot compute.
inline int exchange_warps() {
  const unsigned int n = static_cast<unsigned int>(grid->fibers.size());
  int released = 0;
  for (unsigned int first = 0; first < n; first += kWarp) {
    bool all = first + kWarp <= n;
    for (unsigned int t = first; all && t < first + kWarp; ++t) {
      const Fiber& f = grid->fibers[t];
      all = f.state == Fiber::kWaiting && f.barrier_kind == kShuffle;
    }
    if (!all) continue;
    for (unsigned int t = first; t < first + kWarp; ++t) {
      const Fiber& f = grid->fibers[t];
      if (f.shuffle_mask != 0xffffffffu || f.width != static_cast<int>(kWarp)) {
        grid->error = "block " + std::to_string(grid->block.x) + ", thread " + std::to_string(t) +
                      ": the emulation computes __shfl_xor_sync over the full warp only (mask "
                      "0xffffffff, width 32)";
        return -1;
      }
    }
    for (unsigned int t = first; t < first + kWarp; ++t) {
      Fiber& f = grid->fibers[t];
      const unsigned int source = first + (((t - first) ^ static_cast<unsigned int>(f.lane_mask)) & (kWarp - 1));
      f.shuffled = grid->fibers[source].shuffle_value;
    }
    for (unsigned int t = first; t < first + kWarp; ++t) grid->fibers[t].state = Fiber::kReady;
    ++released;
  }
  return released;
}

inline void fiber_entry() {
  grid->body(grid->body_argument);
  fiber->state = Fiber::kDone;  // returning resumes the scheduler (uc_link)
}

// A fiber's first frame under the fast switch: the switch's `ret` lands here.
[[noreturn]] inline void fast_fiber_entry() {
  fiber_entry();
#if AMP_EMU_FAST_SWITCH
  void* finished;
  amp_emu_switch(&finished, grid->scheduler_stack_pointer);
#endif
  __builtin_unreachable();
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
    char* stack = stacks.data() + static_cast<size_t>(t) * kStackBytes;
    if (grid->fast) {
      // The frame amp_emu_switch pops: six registers, then fast_fiber_entry as the return
      // address, above it a slot that leaves the stack as a call would (16-byte aligned + 8).
      void** top = reinterpret_cast<void**>(
          reinterpret_cast<uintptr_t>(stack + kStackBytes) & ~static_cast<uintptr_t>(15));
      *--top = nullptr;
      *--top = reinterpret_cast<void*>(&fast_fiber_entry);
      for (int i = 0; i < 6; ++i) *--top = nullptr;
      f.stack_pointer = top;
      continue;
    }
    getcontext(&f.context);
    f.context.uc_stack.ss_sp = stack;
    f.context.uc_stack.ss_size = kStackBytes;
    f.context.uc_link = &grid->scheduler;
    makecontext(&f.context, fiber_entry, 0);
  }
  unsigned long long round = 0;  // seeds the order of each pass
  for (unsigned long long phase = 0;; ++phase) {
    // Every ready thread runs until it waits or returns; warps whose threads all wait at a
    // shuffle exchange and run again, until none does.
    for (int released = 1; released > 0;) {
      for (unsigned int t : permutation(n, spec.order, block_seed + round++)) {
        if (grid->fibers[t].state != Fiber::kReady) continue;
        fiber = &grid->fibers[t];
        enter(fiber);
      }
      fiber = nullptr;
      released = exchange_warps();
      if (released < 0) return false;
    }
    unsigned int done = 0, kinds[3] = {0, 0, 0};
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
    if (kinds[kShuffle] != 0) {
      grid->error = "block " + std::to_string(grid->block.x) + ", barrier " +
                    std::to_string(phase) + ": " + std::to_string(kinds[kShuffle]) +
                    " threads wait at __shfl_xor_sync for threads of their warp that " +
                    std::to_string(done) + " returned, " + std::to_string(kinds[0] + kinds[1]) +
                    " wait at a block barrier (a warp's 32 threads must all reach it)";
      return false;
    }
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
    state.fast = AMP_EMU_FAST_SWITCH && !shadow_stack();
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

// Warp shuffles over the full warp (see the header's comment); 4-byte values as CUDA has them.
inline unsigned int __shfl_xor_sync(unsigned int mask, unsigned int var, int laneMask,
                                    int width = 32) {
  return ::amp_emu::shuffle_xor(mask, var, laneMask, width);
}
inline int __shfl_xor_sync(unsigned int mask, int var, int laneMask, int width = 32) {
  return static_cast<int>(
      ::amp_emu::shuffle_xor(mask, static_cast<unsigned int>(var), laneMask, width));
}
inline float __shfl_xor_sync(unsigned int mask, float var, int laneMask, int width = 32) {
  unsigned int bits;
  memcpy(&bits, &var, sizeof(bits));
  bits = ::amp_emu::shuffle_xor(mask, bits, laneMask, width);
  float out;
  memcpy(&out, &bits, sizeof(out));
  return out;
}

// One thread runs at a time (blocks one after another, a block's threads between barriers one
// by one), so the read-modify-write is atomic.
inline unsigned int atomicMax(unsigned int* address, unsigned int value) {
  const unsigned int old = *address;
  if (value > old) *address = value;
  return old;
}

// The GPU's approximate division (2 ulps): here the rounded quotient, which the source may take as
// any value within that error (it uses it only where every such value gives the same result).
inline float __fdividef(float a, float b) { return a / b; }

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
