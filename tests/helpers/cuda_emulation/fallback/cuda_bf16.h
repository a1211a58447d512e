// __nv_bfloat16 for the CUDA emulation where CUDA's headers are not installed: the type and the
// bit casts multi_tensor.cu uses (it converts on the bits itself).
#pragma once

struct __nv_bfloat16 {
  unsigned short __x;
};

inline unsigned short __bfloat16_as_ushort(__nv_bfloat16 h) { return h.__x; }

inline __nv_bfloat16 __ushort_as_bfloat16(unsigned short bits) {
  __nv_bfloat16 h;
  h.__x = bits;
  return h;
}
