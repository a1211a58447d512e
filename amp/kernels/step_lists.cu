// The lists a fused step reads and writes, in each form of the master and of the moments, a group
// of kStepElements consecutive elements at a time (codecs.cu's element codecs): each list in one
// vector access (8 one-byte codes: 64 bits; 8 bf16: 128 bits), the four lanes holding a block of
// 32 elements reducing its scale in two shuffles. step_loop.cu walks a chunk in such groups.

namespace amp {

constexpr int kStepElements = 8;                        // elements a thread steps per trip
constexpr int kGroupLanes = kWarp / kStepElements;      // lanes that hold a block of 32 elements
constexpr long long kTrip = kBlock * kStepElements;     // elements a block steps per trip

template <typename T>
struct alignas(sizeof(T) * kStepElements) Group {
  T x[kStepElements];
};

// Whether a group is accessed as one vector: a compile-time constant, so that the whole-group
// trips carry none of the tail's branches.
template <bool Value> struct Vector {
  static constexpr bool value = Value;
};

template <typename T>
__device__ __forceinline__ bool group_aligned(const T* p) {  // a null list is no obstacle
  return reinterpret_cast<unsigned long long>(p) % sizeof(Group<T>) == 0;
}

// The group at p: `count` elements of the tensor (the rest read as 0); `vector`: all of them, p
// aligned, one access.
template <typename T, bool V>
__device__ __forceinline__ void load_group(const T* p, int count, Vector<V>,
                                           T (&out)[kStepElements]) {
  if constexpr (V) {
    const Group<T> group = *reinterpret_cast<const Group<T>*>(p);
#pragma unroll
    for (int k = 0; k < kStepElements; ++k) out[k] = group.x[k];
  } else {
#pragma unroll
    for (int k = 0; k < kStepElements; ++k) out[k] = k < count ? p[k] : T(0);
  }
}

template <typename T, bool V>
__device__ __forceinline__ void store_group(T* p, int count, Vector<V>,
                                            const T (&in)[kStepElements]) {
  if constexpr (V) {
    Group<T> group;
#pragma unroll
    for (int k = 0; k < kStepElements; ++k) group.x[k] = in[k];
    *reinterpret_cast<Group<T>*>(p) = group;
  } else {
#pragma unroll
    for (int k = 0; k < kStepElements; ++k) {
      if (k < count) p[k] = in[k];
    }
  }
}

// Elements are moved as their bits: a 16-bit float as unsigned short.
template <typename T> struct Bits { using type = T; };
template <> struct Bits<__half> { using type = unsigned short; };
template <> struct Bits<__nv_bfloat16> { using type = unsigned short; };

template <typename T> __device__ __forceinline__ float bits_to_float(typename Bits<T>::type x) {
  return to_float<T>(x);
}
template <> __device__ __forceinline__ float bits_to_float<__half>(unsigned short x) {
  return to_float<__half>(__ushort_as_half(x));
}
template <> __device__ __forceinline__ float bits_to_float<__nv_bfloat16>(unsigned short x) {
  return __uint_as_float(static_cast<unsigned int>(x) << 16);
}

template <typename T> __device__ __forceinline__ typename Bits<T>::type float_to_bits(float x) {
  return from_float<T>(x);
}
template <> __device__ __forceinline__ unsigned short float_to_bits<__half>(float x) {
  return __half_as_ushort(from_float<__half>(x));
}
template <> __device__ __forceinline__ unsigned short float_to_bits<__nv_bfloat16>(float x) {
  return __bfloat16_as_ushort(from_float<__nv_bfloat16>(x));
}

// The group of `count` elements of type T at p as floats (0 past the tensor).
template <typename T, typename V>
__device__ __forceinline__ void load_floats(const typename Bits<T>::type* p, int count, V vector,
                                            float (&out)[kStepElements]) {
  typename Bits<T>::type bits[kStepElements];
  load_group(p, count, vector, bits);
#pragma unroll
  for (int k = 0; k < kStepElements; ++k) out[k] = bits_to_float<T>(bits[k]);
}

template <typename T, typename V>
__device__ __forceinline__ void store_floats(typename Bits<T>::type* p, int count, V vector,
                                             const float (&values)[kStepElements]) {
  typename Bits<T>::type bits[kStepElements];
#pragma unroll
  for (int k = 0; k < kStepElements; ++k) bits[k] = float_to_bits<T>(values[k]);
  store_group(p, count, vector, bits);
}

// A chunk's master in its form (the launch's two lists for it): a compact one's bf16 weight and
// int8 correction, an exact one's bf16 weight and int16 remainder, or an FP32 master and its
// low-precision copy (or none). Groups of elements from element i of the chunk.
template <typename Master> struct MasterList;

template <typename Low, float (*Decode)(unsigned short, Low),
          void (*Encode)(float, unsigned short&, Low&)>
struct SplitMaster {  // a bf16 weight and the rest of the value in Low
  unsigned short* weight;
  Low* rest;
  __device__ __forceinline__ SplitMaster(unsigned long long weight_list,
                                         unsigned long long rest_list, long long first)
      : weight(reinterpret_cast<unsigned short*>(weight_list) + first),
        rest(reinterpret_cast<Low*>(rest_list) + first) {}
  __device__ __forceinline__ bool aligned() const {
    return group_aligned(weight) && group_aligned(rest);
  }
  template <typename V>
  __device__ __forceinline__ void load(long long i, int count, V vector,
                                       float (&out)[kStepElements]) const {
    unsigned short high[kStepElements];
    Low low[kStepElements];
    load_group(weight + i, count, vector, high);
    load_group(rest + i, count, vector, low);
#pragma unroll
    for (int k = 0; k < kStepElements; ++k) out[k] = Decode(high[k], low[k]);
  }
  template <typename V>
  __device__ __forceinline__ void store(long long i, int count, V vector,
                                        const float (&values)[kStepElements]) const {
    unsigned short high[kStepElements];
    Low low[kStepElements];
#pragma unroll
    for (int k = 0; k < kStepElements; ++k) Encode(values[k], high[k], low[k]);
    store_group(weight + i, count, vector, high);
    store_group(rest + i, count, vector, low);
  }
};

template <> struct MasterList<Compact>
    : SplitMaster<signed char, compact_decode, compact_encode> {
  using SplitMaster::SplitMaster;
};
template <> struct MasterList<Remainder>
    : SplitMaster<short, remainder_decode, remainder_encode> {
  using SplitMaster::SplitMaster;
};

template <typename L> struct MasterList<Exact<L>> {
  float* master;
  typename Bits<L>::type* low;  // null: no copy
  __device__ __forceinline__ MasterList(unsigned long long master_list,
                                        unsigned long long low_list, long long first)
      : master(reinterpret_cast<float*>(master_list) + first),
        low(low_list != 0 ? reinterpret_cast<typename Bits<L>::type*>(low_list) + first
                          : nullptr) {}
  __device__ __forceinline__ bool aligned() const {
    return group_aligned(master) && group_aligned(low);
  }
  template <typename V>
  __device__ __forceinline__ void load(long long i, int count, V vector,
                                       float (&out)[kStepElements]) const {
    load_floats<float>(master + i, count, vector, out);
  }
  template <typename V>
  __device__ __forceinline__ void store(long long i, int count, V vector,
                                        const float (&values)[kStepElements]) const {
    store_floats<float>(master + i, count, vector, values);
    if (low != nullptr) store_floats<L>(low + i, count, vector, values);
  }
};

// A chunk's moment: FP32 or bf16 as held, or 8-bit codes (softsign where Signed, else square
// roots) with their blocks' scales. store() is called by every lane of the warp (a coded block's
// scale is a reduction over its kGroupLanes lanes); `roots`: sqrt of the values, which square-root
// codes take. `salt` (dither_salt of the step) dithers a second moment's rounding, drawn by the
// element's index in the whole tensor: `origin` is the row's first (a shard's start, else 0).
template <typename Moment, bool Signed> struct MomentList {  // Moment: float or __nv_bfloat16
  typename Bits<Moment>::type* held;
  long long first;  // the dither's index of the chunk's first element
  unsigned int salt;
  __device__ __forceinline__ MomentList(unsigned long long list, unsigned long long,
                                        long long first, unsigned int salt, const float*,
                                        long long origin = 0)
      : held(list != 0 ? reinterpret_cast<typename Bits<Moment>::type*>(list) + first : nullptr),
        first(origin + first), salt(salt) {}
  __device__ __forceinline__ bool aligned() const { return group_aligned(held); }
  template <typename V>
  __device__ __forceinline__ void load(long long i, int count, V vector,
                                       float (&out)[kStepElements]) const {
    load_floats<Moment>(held + i, count, vector, out);
  }
  template <typename V>
  __device__ __forceinline__ void store(long long i, int count, V vector, int,
                                        const float (&values)[kStepElements],
                                        const float (&)[kStepElements]) const {
    if constexpr (Signed || sizeof(Moment) == sizeof(float)) {
      store_floats<Moment>(held + i, count, vector, values);
    } else {  // a bf16 second moment: rounded stochastically (_codecs.bf16_stochastic)
      unsigned short bits[kStepElements];
#pragma unroll
      for (int k = 0; k < kStepElements; ++k) {
        bits[k] = bf16_stochastic(values[k], dither_bits(first + i + k, salt));
      }
      store_group(held + i, count, vector, bits);
    }
  }
};

// The largest of a block's values (non-negative floats' bits: their order is the values'), from
// each lane's largest, in each of its kGroupLanes lanes; a fixed butterfly, so all get the same.
__device__ __forceinline__ unsigned int block_max(unsigned int x) {
#pragma unroll
  for (int offset = kGroupLanes / 2; offset > 0; offset >>= 1) {
    const unsigned int other = __shfl_xor_sync(0xffffffffu, x, offset);
    x = other > x ? other : x;
  }
  return x;
}

template <bool Signed> struct MomentList<Codes8, Signed> {
  unsigned char* codes;  // read as unsigned: the table's index
  float* scales;
  const float* table;  // code_tables(): the softsign table, then the square-root one
  long long first;  // the dither's index of the chunk's first element
  unsigned int salt;
  __device__ __forceinline__ MomentList(unsigned long long list, unsigned long long scale_list,
                                        long long first, unsigned int salt, const float* tables,
                                        long long origin = 0)
      : codes(list != 0 ? reinterpret_cast<unsigned char*>(list) + first : nullptr),
        scales(scale_list != 0 ? reinterpret_cast<float*>(scale_list) + first / kWarp : nullptr),
        table(tables + (Signed ? 0 : kCodes)), first(origin + first), salt(salt) {}
  __device__ __forceinline__ bool aligned() const { return group_aligned(codes); }
  template <typename V>
  __device__ __forceinline__ void load(long long i, int count, V vector,
                                       float (&out)[kStepElements]) const {
    unsigned char code[kStepElements];
    load_group(codes + i, count, vector, code);
    const float scale = count > 0 ? scales[i / kWarp] : 0.0f;
#pragma unroll
    for (int k = 0; k < kStepElements; ++k) {
      const float value = mul_rn(table[code[k]], scale);  // (the root, for square-root codes)
      out[k] = k < count ? (Signed ? value : mul_rn(value, value)) : 0.0f;
    }
  }
  // The block's scale is its largest magnitude (of root, for square-root codes; elements past the
  // tensor count as the zero padding); the leader of its lanes writes it.
  template <typename V>
  __device__ __forceinline__ void store(long long i, int count, V vector, int lane,
                                        const float (&values)[kStepElements],
                                        const float (&roots)[kStepElements]) const {
    unsigned int largest = 0;
#pragma unroll
    for (int k = 0; k < kStepElements; ++k) {
      const unsigned int magnitude = __float_as_uint(Signed ? values[k] : roots[k]) & 0x7fffffffu;
      if (k < count && magnitude > largest) largest = magnitude;
    }
    const unsigned int scale_bits = block_max(largest);
    const float divisor = block_divisor(scale_bits);
    const float inverse = div_rn(1.0f, divisor);
    float noise[kStepElements];
    unsigned char code[kStepElements];
    unsigned int uncertain = codes_approximable(divisor) ? 0u : (1u << kStepElements) - 1u;
#pragma unroll
    for (int k = 0; k < kStepElements; ++k) {
      if (!Signed) noise[k] = dither(first + i + k, salt);
      bool certain;
      code[k] = Signed ? static_cast<unsigned char>(signed_code_fast(values[k], inverse, certain))
                       : unsigned_code_fast(roots[k], inverse, noise[k], certain);
      uncertain |= certain ? 0u : 1u << k;
    }
    if (uncertain != 0u) {  // the exact operations, for the few codes the fast ones leave open
#pragma unroll
      for (int k = 0; k < kStepElements; ++k) {
        if ((uncertain >> k) & 1u) {
          code[k] = Signed ? static_cast<unsigned char>(signed_code(values[k], divisor))
                           : unsigned_code(roots[k], divisor, noise[k]);
        }
      }
    }
    store_group(codes + i, count, vector, code);
    if (lane % kGroupLanes == 0 && count > 0) scales[i / kWarp] = __uint_as_float(scale_bits);
  }
};

// The code tables of a block whose moments are 8-bit codes, in shared memory (null for other
// moments): every thread of the block calls it, and waits at its barrier.
template <typename Moment> struct CodeTables {
  __device__ static __forceinline__ const float* build() { return nullptr; }
};
template <> struct CodeTables<Codes8> {
  __device__ static __forceinline__ const float* build() {
    __shared__ float tables[2 * kCodes];
    for (int i = threadIdx.x; i < 2 * kCodes; i += blockDim.x) {
      tables[i] = i < kCodes ? signed_code_value(i) : unsigned_code_value(i - kCodes);
    }
    __syncthreads();
    return tables;
  }
};

}  // namespace amp
