// msl_shim_types.h -- scalar types: half, bfloat16_t and their arithmetic.
// Part of msl_shim.h; include that header, not this one.
#ifndef MLX_SPEC_MSL_MSL_SHIM_TYPES_H
#define MLX_SPEC_MSL_MSL_SHIM_TYPES_H

// ---------------------------------------------------------------------------
// Scalar types
// ---------------------------------------------------------------------------
typedef unsigned int uint;
typedef unsigned short ushort;
typedef unsigned char uchar;
typedef unsigned long ulong;
typedef _Float16 half;
typedef half float16_t;

namespace msl {

inline uint32_t f32_bits(float f) {
  uint32_t u;
  __builtin_memcpy(&u, &f, 4);
  return u;
}
inline float bits_f32(uint32_t u) {
  float f;
  __builtin_memcpy(&f, &u, 4);
  return f;
}
// float -> bfloat16 with round-to-nearest-even (NaN stays a quiet NaN).
inline uint16_t float_to_bf16_bits(float f) {
  uint32_t u = f32_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) {
    return static_cast<uint16_t>((u >> 16) | 0x40u);
  }
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

}  // namespace msl

// bfloat16 stored as its 16 bits; arithmetic happens in float and is rounded
// back, like MLX's bfloat16_t: bf op bf -> bf, bf op float -> float,
// bf op half -> float, bf op int -> bf.
struct bfloat16_t {
  uint16_t bits_;
  bfloat16_t() = default;
  bfloat16_t(float f) : bits_(msl::float_to_bf16_bits(f)) {}
  template <class T,
            class = typename std::enable_if<std::is_arithmetic<T>::value>::type>
  bfloat16_t(T v) : bits_(msl::float_to_bf16_bits(static_cast<float>(v))) {}
  bfloat16_t(half v) : bits_(msl::float_to_bf16_bits(static_cast<float>(v))) {}
  operator float() const {
    return msl::bits_f32(static_cast<uint32_t>(bits_) << 16);
  }
  static bfloat16_t from_bits(uint16_t b) {
    bfloat16_t r;
    r.bits_ = b;
    return r;
  }
};
typedef bfloat16_t bfloat;

namespace msl {

template <class T>
struct is_bf16 : std::is_same<typename std::remove_cv<T>::type, bfloat16_t> {};
template <class T>
struct is_half : std::is_same<typename std::remove_cv<T>::type, half> {};
template <class T>
struct is_num
    : std::integral_constant<bool, std::is_arithmetic<T>::value ||
                                       is_half<T>::value || is_bf16<T>::value> {
};
template <class T>
struct is_float_like
    : std::integral_constant<bool, std::is_floating_point<T>::value ||
                                       is_half<T>::value || is_bf16<T>::value> {
};
// Result type of a binary bf16 operation with T.
template <class T, class = void>
struct bf16_result {
  typedef bfloat16_t type;
};  // integers
template <class T>
struct bf16_result<T, typename std::enable_if<std::is_floating_point<T>::value>::type> {
  typedef T type;
};
template <>
struct bf16_result<half> {
  typedef float type;
};
template <>
struct bf16_result<bfloat16_t> {
  typedef bfloat16_t type;
};

}  // namespace msl

#define MSL_BF16_BINOP(op)                                                   \
  inline bfloat16_t operator op(bfloat16_t a, bfloat16_t b) {                \
    return bfloat16_t(static_cast<float>(a) op static_cast<float>(b));       \
  }                                                                          \
  template <class T, class = typename std::enable_if<                        \
                         msl::is_num<T>::value && !msl::is_bf16<T>::value>::type> \
  inline typename msl::bf16_result<T>::type operator op(bfloat16_t a, T b) { \
    typedef typename msl::bf16_result<T>::type R;                            \
    typedef typename std::conditional<std::is_same<R, double>::value, double, \
                                      float>::type C;                        \
    return R(static_cast<C>(static_cast<float>(a)) op static_cast<C>(b));    \
  }                                                                          \
  template <class T, class = typename std::enable_if<                        \
                         msl::is_num<T>::value && !msl::is_bf16<T>::value>::type> \
  inline typename msl::bf16_result<T>::type operator op(T a, bfloat16_t b) { \
    typedef typename msl::bf16_result<T>::type R;                            \
    typedef typename std::conditional<std::is_same<R, double>::value, double, \
                                      float>::type C;                        \
    return R(static_cast<C>(a) op static_cast<C>(static_cast<float>(b)));    \
  }                                                                          \
  template <class T>                                                         \
  inline bfloat16_t& operator op##=(bfloat16_t & a, T b) {                   \
    a = bfloat16_t(static_cast<float>(a) op static_cast<float>(b));          \
    return a;                                                                \
  }
MSL_BF16_BINOP(+)
MSL_BF16_BINOP(-)
MSL_BF16_BINOP(*)
MSL_BF16_BINOP(/)
#undef MSL_BF16_BINOP

#define MSL_BF16_CMP(op)                                                     \
  inline bool operator op(bfloat16_t a, bfloat16_t b) {                      \
    return static_cast<float>(a) op static_cast<float>(b);                   \
  }                                                                          \
  template <class T, class = typename std::enable_if<                        \
                         msl::is_num<T>::value && !msl::is_bf16<T>::value>::type> \
  inline bool operator op(bfloat16_t a, T b) {                               \
    return static_cast<float>(a) op static_cast<float>(b);                   \
  }                                                                          \
  template <class T, class = typename std::enable_if<                        \
                         msl::is_num<T>::value && !msl::is_bf16<T>::value>::type> \
  inline bool operator op(T a, bfloat16_t b) {                               \
    return static_cast<float>(a) op static_cast<float>(b);                   \
  }
MSL_BF16_CMP(==)
MSL_BF16_CMP(!=)
MSL_BF16_CMP(<)
MSL_BF16_CMP(<=)
MSL_BF16_CMP(>)
MSL_BF16_CMP(>=)
#undef MSL_BF16_CMP

inline bfloat16_t operator-(bfloat16_t a) {
  return bfloat16_t::from_bits(static_cast<uint16_t>(a.bits_ ^ 0x8000u));
}
inline bfloat16_t operator+(bfloat16_t a) { return a; }
inline bfloat16_t& operator++(bfloat16_t& a) { return a += 1.0f; }
inline bfloat16_t& operator--(bfloat16_t& a) { return a -= 1.0f; }

#endif  // MLX_SPEC_MSL_MSL_SHIM_TYPES_H
