// Reduction of one 16-byte chunk, shared by the CPU path and the kernel so that both compute the same bits.
// Inputs are combined in fixed rank order with fp32 accumulation (int32 in wrapping 32-bit integers), then
// rounded once to the output dtype (round to nearest even), so every rank produces identical output.
#pragma once

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "layout.h"

#ifdef __CUDACC__
#include <cuda_fp16.h>
#endif

#ifdef __CUDACC__
#define ROCENANTE_UNROLL _Pragma("unroll")
#else
#define ROCENANTE_UNROLL
#endif

namespace rocenante {

// The bits of a value as another type of the same size. memcpy is the portable spelling on the host and in
// device code alike; both compilers turn it into a register move.
template <class To, class From>
ROCENANTE_HD To bit_cast(const From& v) {
  static_assert(sizeof(To) == sizeof(From), "bit_cast needs two types of one size");
  To out;
  memcpy(&out, &v, sizeof(To));
  return out;
}

ROCENANTE_HD float bf16_to_float(uint16_t h) { return bit_cast<float>(uint32_t(h) << 16); }
ROCENANTE_HD uint16_t float_to_bf16(float f) {
  const uint32_t b = bit_cast<uint32_t>(f);
  if ((b & 0x7FFFFFFFu) > 0x7F800000u) return uint16_t((b >> 16) | 0x40);  // NaN stays a (quiet) NaN
  return uint16_t((b + 0x7FFFu + ((b >> 16) & 1u)) >> 16);                  // round to nearest even
}

ROCENANTE_HD float fp16_to_float(uint16_t h) {
#ifdef __CUDACC__
  return __half2float(__ushort_as_half(h));
#elif defined(__aarch64__)
  return float(bit_cast<__fp16>(h));  // AArch64's IEEE half: GCC before 13 has no _Float16 in C++ there
#else
  return float(bit_cast<_Float16>(h));
#endif
}
ROCENANTE_HD uint16_t float_to_fp16(float f) {
#ifdef __CUDACC__
  return __half_as_ushort(__float2half_rn(f));
#elif defined(__aarch64__)
  return bit_cast<uint16_t>(__fp16(f));  // IEEE conversion, round to nearest even
#else
  return bit_cast<uint16_t>(_Float16(f));  // IEEE conversion, round to nearest even
#endif
}

// Element access inside a chunk held as four 32-bit words (little-endian, as in memory).
template <DType D>
struct Chunk;

template <>
struct Chunk<DType::kFloat32> {
  using Acc = float;
  static constexpr int kElems = 4;
  static ROCENANTE_HD Acc load(const uint32_t* w, int i) { return bit_cast<float>(w[i]); }
  static ROCENANTE_HD void store(uint32_t* w, int i, Acc v) { w[i] = bit_cast<uint32_t>(v); }
};
template <>
struct Chunk<DType::kInt32> {
  using Acc = int32_t;
  static constexpr int kElems = 4;
  static ROCENANTE_HD Acc load(const uint32_t* w, int i) { return int32_t(w[i]); }
  static ROCENANTE_HD void store(uint32_t* w, int i, Acc v) { w[i] = uint32_t(v); }
};
template <DType D>
struct Chunk16 {
  using Acc = float;
  static constexpr int kElems = 8;
  static ROCENANTE_HD Acc load(const uint32_t* w, int i) {
    const uint16_t h = uint16_t(w[i / 2] >> (16 * (i % 2)));
    return D == DType::kBFloat16 ? bf16_to_float(h) : fp16_to_float(h);
  }
  static ROCENANTE_HD void store(uint32_t* w, int i, Acc v) {
    const uint32_t h = D == DType::kBFloat16 ? float_to_bf16(v) : float_to_fp16(v);
    const int shift = 16 * (i % 2);
    w[i / 2] = (w[i / 2] & ~(0xFFFFu << shift)) | (h << shift);
  }
};
template <>
struct Chunk<DType::kFloat16> : Chunk16<DType::kFloat16> {};
template <>
struct Chunk<DType::kBFloat16> : Chunk16<DType::kBFloat16> {};

// max and min follow torch.maximum / torch.minimum: a NaN on any rank wins (a != a only for NaN; integers never),
// so the result does not depend on which rank holds it.
template <ReduceOp Op, typename T>
ROCENANTE_HD T combine(T a, T b) {
  if constexpr (Op == ReduceOp::kMax) return a > b || a != a ? a : b;
  if constexpr (Op == ReduceOp::kMin) return a < b || a != a ? a : b;
  if constexpr (std::is_integral_v<T>) return T(uint32_t(a) + uint32_t(b));  // wraps, like NCCL's int32 sum
  return a + b;                                                              // kSum and kAvg
}

// acc = (first ? chunk : acc op chunk), element-wise.
template <DType D, ReduceOp Op>
ROCENANTE_HD void accumulate(typename Chunk<D>::Acc (&acc)[Chunk<D>::kElems], const uint32_t (&w)[4], bool first) {
ROCENANTE_UNROLL
  for (int i = 0; i < Chunk<D>::kElems; ++i) {
    const auto v = Chunk<D>::load(w, i);
    acc[i] = first ? v : combine<Op>(acc[i], v);
  }
}

template <DType D, ReduceOp Op>
ROCENANTE_HD void finish(const typename Chunk<D>::Acc (&acc)[Chunk<D>::kElems], int world, uint32_t (&w)[4]) {
ROCENANTE_UNROLL
  for (int i = 0; i < Chunk<D>::kElems; ++i) {
    auto v = acc[i];
    if constexpr (Op == ReduceOp::kAvg) v = v / float(world);
    Chunk<D>::store(w, i, v);
  }
}

// Calls f.template operator()<D, Op>() for the runtime pair; int32 has no avg (refused before this point).
template <typename F>
void dispatch_dtype_op(DType d, ReduceOp op, F&& f) {
  auto with_op = [&](auto dtag) {
    constexpr DType D = decltype(dtag)::value;
    switch (op) {
      case ReduceOp::kSum: return f.template operator()<D, ReduceOp::kSum>();
      case ReduceOp::kAvg:
        if constexpr (D != DType::kInt32) return f.template operator()<D, ReduceOp::kAvg>();
        break;
      case ReduceOp::kMax: return f.template operator()<D, ReduceOp::kMax>();
      case ReduceOp::kMin: return f.template operator()<D, ReduceOp::kMin>();
    }
  };
  switch (d) {
    case DType::kFloat32: return with_op(std::integral_constant<DType, DType::kFloat32>{});
    case DType::kFloat16: return with_op(std::integral_constant<DType, DType::kFloat16>{});
    case DType::kBFloat16: return with_op(std::integral_constant<DType, DType::kBFloat16>{});
    case DType::kInt32: return with_op(std::integral_constant<DType, DType::kInt32>{});
  }
}

}  // namespace rocenante
