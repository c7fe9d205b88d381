// msl_shim.h -- a C++17 stand-in for the subset of the Metal Shading Language
// that MLX custom kernels (mx.fast.metal_kernel) use.
//
// Kernel bodies are compiled as ordinary C++ against this header and run by
// msl_runtime.cpp, which executes every GPU thread as a fiber so that SIMD
// collectives and threadgroup barriers behave like they do on the GPU.  See
// tests/msl/README.md for the supported subset and its limits.
//
// The file has two parts:
//   * the ABI shared with the runtime (plain C structs and functions), always;
//   * the MSL vocabulary (types, math, simd_*, atomics, address spaces),
//     unless MSL_SHIM_ABI_ONLY is defined (the runtime defines it).
#ifndef MLX_SPEC_MSL_SHIM_H
#define MLX_SPEC_MSL_SHIM_H

#include <stddef.h>
#include <stdint.h>

#include <type_traits>

// ---------------------------------------------------------------------------
// ABI between generated kernels, the runtime and the Python harness.
// ---------------------------------------------------------------------------
extern "C" {

typedef struct msl_launch_desc {
  uint32_t grid[3];       // threads, like dispatchThreads
  uint32_t tg[3];         // threadgroup size (already clipped to the grid)
  uint32_t nargs;         // entries in args / lo / hi
  uint32_t workers;       // OS threads running threadgroups
  uint32_t schedule;      // 0: threads in index order, 1: reverse order
  uint32_t simd_width;    // lanes per SIMD group (32 on Apple GPUs)
  uint64_t stack_bytes;   // stack size of each GPU thread
  void* const* args;      // one pointer per kernel parameter
  const char* const* lo;  // first valid byte of each buffer (debug checks)
  const char* const* hi;  // one past the last valid byte
} msl_launch_desc;

typedef struct msl_thread_info {
  uint32_t thread_position_in_grid[3];
  uint32_t thread_position_in_threadgroup[3];
  uint32_t threadgroup_position_in_grid[3];
  uint32_t threads_per_threadgroup[3];
  uint32_t dispatch_threads_per_threadgroup[3];
  uint32_t threads_per_grid[3];
  uint32_t threadgroups_per_grid[3];
  uint32_t grid_origin[3];
  uint32_t thread_index_in_threadgroup;
  uint32_t thread_index_in_simdgroup;
  uint32_t simdgroup_index_in_threadgroup;
  uint32_t simdgroups_per_threadgroup;
  uint32_t threads_per_simdgroup;
  uint32_t thread_execution_width;
  uint32_t thread_index_in_quadgroup;
  uint32_t quadgroup_index_in_threadgroup;
  uint32_t quadgroups_per_threadgroup;
  uint32_t dispatch_simdgroups_per_threadgroup;
  uint32_t dispatch_quadgroups_per_threadgroup;
} msl_thread_info;

// What a lane sees after a SIMD collective: every lane's contribution.
typedef struct msl_simd_view {
  const unsigned char* slots;  // width slots of slot_bytes bytes each
  uint32_t active;             // bit i set: lane i took part
  uint32_t lane;               // the caller's lane
  uint32_t width;              // SIMD width
  uint32_t slot_bytes;
} msl_simd_view;

typedef void (*msl_thread_fn)(const msl_launch_desc*, const msl_thread_info*);

#define MSL_RT_API __attribute__((visibility("default")))

// Runtime entry points (msl_runtime.cpp).  `site` packs where the call is in
// the kernel text: file (0 source, 1 header) << 28 | line << 10 | column.
MSL_RT_API const msl_simd_view* msl_rt_simd(const char* op, uint32_t site,
                                 const void* value, uint32_t size);
MSL_RT_API void msl_rt_barrier(const char* op, uint32_t site);
MSL_RT_API void* msl_rt_tg_alloc(int id, size_t size, size_t align);
MSL_RT_API void msl_rt_fail(const char* message) __attribute__((noreturn));
MSL_RT_API void msl_rt_fail_oob(const char* buffer, const void* addr, size_t size,
                     const char* lo, const char* hi)
    __attribute__((noreturn));
MSL_RT_API int msl_rt_launch(const msl_launch_desc* d, msl_thread_fn fn, char* err,
                  size_t err_cap);
}  // extern "C"

#ifndef MSL_SHIM_ABI_ONLY

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

// ---------------------------------------------------------------------------
// Vector types: vec<T, N> with .x .y .z .w (no swizzles).
// ---------------------------------------------------------------------------
namespace metal {

template <class T, int N>
struct vec;

namespace detail {
template <class A>
struct comp_count {
  static constexpr int value = 1;
};
template <class T, int N>
struct comp_count<vec<T, N>> {
  static constexpr int value = N;
};
template <class... A>
struct total_count;
template <>
struct total_count<> {
  static constexpr int value = 0;
};
template <class A, class... R>
struct total_count<A, R...> {
  static constexpr int value =
      comp_count<typename std::decay<A>::type>::value + total_count<R...>::value;
};
template <class V>
inline void fill(V&, int) {}
template <class V, class A, class... R>
inline void fill(V& v, int i, const A& a, const R&... r);
template <class V, class T, int M, class... R>
inline void fill(V& v, int i, const vec<T, M>& a, const R&... r);
template <class V, class A, class... R>
inline void fill(V& v, int i, const A& a, const R&... r) {
  v[i] = static_cast<typename V::value_type>(a);
  fill(v, i + 1, r...);
}
template <class V, class T, int M, class... R>
inline void fill(V& v, int i, const vec<T, M>& a, const R&... r) {
  for (int k = 0; k < M; ++k) v[i + k] = static_cast<typename V::value_type>(a[k]);
  fill(v, i + M, r...);
}
}  // namespace detail

#define MSL_VEC_BODY(N)                                                      \
  typedef T value_type;                                                      \
  static constexpr int size = N;                                             \
  vec() = default;                                                           \
  template <class S, class = typename std::enable_if<                        \
                         msl::is_num<S>::value>::type>                       \
  vec(S s) {                                                                 \
    for (int i = 0; i < N; ++i) (*this)[i] = static_cast<T>(s);              \
  }                                                                          \
  template <class U>                                                         \
  explicit vec(const vec<U, N>& o) {                                         \
    for (int i = 0; i < N; ++i) (*this)[i] = static_cast<T>(o[i]);           \
  }                                                                          \
  template <class A, class B, class... R,                                    \
            class = typename std::enable_if<                                 \
                detail::total_count<A, B, R...>::value == N>::type>          \
  vec(const A& a, const B& b, const R&... r) {                               \
    detail::fill(*this, 0, a, b, r...);                                      \
  }                                                                          \
  template <class I>                                                         \
  T& operator[](I i) {                                                       \
    return elem(static_cast<int>(i));                                        \
  }                                                                          \
  template <class I>                                                         \
  const T& operator[](I i) const {                                           \
    return const_cast<vec*>(this)->elem(static_cast<int>(i));                \
  }

template <class T>
struct alignas(2 * sizeof(T)) vec<T, 2> {
  T x, y;
  MSL_VEC_BODY(2)
  T& elem(int i) { return i == 0 ? x : y; }
};
template <class T>
struct alignas(4 * sizeof(T)) vec<T, 3> {
  T x, y, z;
  MSL_VEC_BODY(3)
  T& elem(int i) { return i == 0 ? x : (i == 1 ? y : z); }
};
template <class T>
struct alignas(4 * sizeof(T)) vec<T, 4> {
  T x, y, z, w;
  MSL_VEC_BODY(4)
  T& elem(int i) { return i == 0 ? x : (i == 1 ? y : (i == 2 ? z : w)); }
};
#undef MSL_VEC_BODY

template <class T>
struct is_vec : std::false_type {};
template <class T, int N>
struct is_vec<vec<T, N>> : std::true_type {};

#define MSL_VEC_ARITH(op)                                                    \
  template <class T, int N>                                                  \
  inline vec<T, N> operator op(const vec<T, N>& a, const vec<T, N>& b) {     \
    vec<T, N> r;                                                             \
    for (int i = 0; i < N; ++i) r[i] = static_cast<T>(a[i] op b[i]);         \
    return r;                                                                \
  }                                                                          \
  template <class T, int N, class S,                                         \
            class = typename std::enable_if<msl::is_num<S>::value>::type>    \
  inline vec<T, N> operator op(const vec<T, N>& a, S s) {                    \
    vec<T, N> r;                                                             \
    for (int i = 0; i < N; ++i) r[i] = static_cast<T>(a[i] op static_cast<T>(s)); \
    return r;                                                                \
  }                                                                          \
  template <class T, int N, class S,                                         \
            class = typename std::enable_if<msl::is_num<S>::value>::type>    \
  inline vec<T, N> operator op(S s, const vec<T, N>& a) {                    \
    vec<T, N> r;                                                             \
    for (int i = 0; i < N; ++i) r[i] = static_cast<T>(static_cast<T>(s) op a[i]); \
    return r;                                                                \
  }                                                                          \
  template <class T, int N>                                                  \
  inline vec<T, N>& operator op##=(vec<T, N>& a, const vec<T, N>& b) {       \
    for (int i = 0; i < N; ++i) a[i] = static_cast<T>(a[i] op b[i]);         \
    return a;                                                                \
  }                                                                          \
  template <class T, int N, class S,                                         \
            class = typename std::enable_if<msl::is_num<S>::value>::type>    \
  inline vec<T, N>& operator op##=(vec<T, N>& a, S s) {                      \
    for (int i = 0; i < N; ++i) a[i] = static_cast<T>(a[i] op static_cast<T>(s)); \
    return a;                                                                \
  }
MSL_VEC_ARITH(+)
MSL_VEC_ARITH(-)
MSL_VEC_ARITH(*)
MSL_VEC_ARITH(/)
MSL_VEC_ARITH(%)
MSL_VEC_ARITH(&)
MSL_VEC_ARITH(|)
MSL_VEC_ARITH(^)
MSL_VEC_ARITH(<<)
MSL_VEC_ARITH(>>)
#undef MSL_VEC_ARITH

#define MSL_VEC_CMP(op)                                                      \
  template <class T, int N>                                                  \
  inline vec<bool, N> operator op(const vec<T, N>& a, const vec<T, N>& b) {  \
    vec<bool, N> r;                                                          \
    for (int i = 0; i < N; ++i) r[i] = a[i] op b[i];                         \
    return r;                                                                \
  }                                                                          \
  template <class T, int N, class S,                                         \
            class = typename std::enable_if<msl::is_num<S>::value>::type>    \
  inline vec<bool, N> operator op(const vec<T, N>& a, S s) {                 \
    vec<bool, N> r;                                                          \
    for (int i = 0; i < N; ++i) r[i] = a[i] op static_cast<T>(s);            \
    return r;                                                                \
  }                                                                          \
  template <class T, int N, class S,                                         \
            class = typename std::enable_if<msl::is_num<S>::value>::type>    \
  inline vec<bool, N> operator op(S s, const vec<T, N>& a) {                 \
    vec<bool, N> r;                                                          \
    for (int i = 0; i < N; ++i) r[i] = static_cast<T>(s) op a[i];            \
    return r;                                                                \
  }
MSL_VEC_CMP(==)
MSL_VEC_CMP(!=)
MSL_VEC_CMP(<)
MSL_VEC_CMP(<=)
MSL_VEC_CMP(>)
MSL_VEC_CMP(>=)
MSL_VEC_CMP(&&)
MSL_VEC_CMP(||)
#undef MSL_VEC_CMP

template <class T, int N>
inline vec<T, N> operator-(const vec<T, N>& a) {
  vec<T, N> r;
  for (int i = 0; i < N; ++i) r[i] = static_cast<T>(-a[i]);
  return r;
}
template <class T, int N>
inline vec<T, N> operator+(const vec<T, N>& a) {
  return a;
}
template <class T, int N>
inline vec<T, N> operator~(const vec<T, N>& a) {
  vec<T, N> r;
  for (int i = 0; i < N; ++i) r[i] = static_cast<T>(~a[i]);
  return r;
}
template <class T, int N>
inline vec<bool, N> operator!(const vec<T, N>& a) {
  vec<bool, N> r;
  for (int i = 0; i < N; ++i) r[i] = !a[i];
  return r;
}

template <int N>
inline bool all(const vec<bool, N>& v) {
  for (int i = 0; i < N; ++i)
    if (!v[i]) return false;
  return true;
}
template <int N>
inline bool any(const vec<bool, N>& v) {
  for (int i = 0; i < N; ++i)
    if (v[i]) return true;
  return false;
}
inline bool all(bool b) { return b; }
inline bool any(bool b) { return b; }

#define MSL_VEC_TYPEDEFS(T, name)        \
  typedef vec<T, 2> name##2;             \
  typedef vec<T, 3> name##3;             \
  typedef vec<T, 4> name##4;
MSL_VEC_TYPEDEFS(float, float)
MSL_VEC_TYPEDEFS(half, half)
MSL_VEC_TYPEDEFS(bfloat16_t, bfloat)
MSL_VEC_TYPEDEFS(int, int)
MSL_VEC_TYPEDEFS(unsigned int, uint)
MSL_VEC_TYPEDEFS(short, short)
MSL_VEC_TYPEDEFS(unsigned short, ushort)
MSL_VEC_TYPEDEFS(char, char)
MSL_VEC_TYPEDEFS(unsigned char, uchar)
MSL_VEC_TYPEDEFS(long, long)
MSL_VEC_TYPEDEFS(unsigned long, ulong)
MSL_VEC_TYPEDEFS(bool, bool)
#undef MSL_VEC_TYPEDEFS

// ---------------------------------------------------------------------------
// Math.  Everything is computed in float (or double) and rounded back, so
// half/bfloat results are at least as accurate as the GPU's.
// ---------------------------------------------------------------------------
namespace detail {
template <class T>
struct calc {
  typedef typename std::conditional<std::is_same<T, double>::value, double,
                                    float>::type type;
};
}  // namespace detail

#define MSL_MATH1(name, fexpr, dexpr)                                        \
  inline float name(float x) { return fexpr; }                               \
  inline double name(double x) { return dexpr; }                            \
  inline half name(half x) { return static_cast<half>(name(static_cast<float>(x))); } \
  inline bfloat16_t name(bfloat16_t x) {                                     \
    return bfloat16_t(name(static_cast<float>(x)));                          \
  }                                                                          \
  template <class T, class = typename std::enable_if<                        \
                         std::is_integral<T>::value>::type>                  \
  inline float name(T x) {                                                   \
    return name(static_cast<float>(x));                                      \
  }                                                                          \
  template <class T, int N>                                                  \
  inline vec<T, N> name(const vec<T, N>& v) {                                \
    vec<T, N> r;                                                             \
    for (int i = 0; i < N; ++i) r[i] = name(v[i]);                           \
    return r;                                                                \
  }

MSL_MATH1(exp, __builtin_expf(x), __builtin_exp(x))
MSL_MATH1(exp2, __builtin_exp2f(x), __builtin_exp2(x))
MSL_MATH1(exp10, __builtin_powf(10.0f, x), __builtin_pow(10.0, x))
MSL_MATH1(log, __builtin_logf(x), __builtin_log(x))
MSL_MATH1(log2, __builtin_log2f(x), __builtin_log2(x))
MSL_MATH1(log10, __builtin_log10f(x), __builtin_log10(x))
MSL_MATH1(log1p, __builtin_log1pf(x), __builtin_log1p(x))
MSL_MATH1(expm1, __builtin_expm1f(x), __builtin_expm1(x))
MSL_MATH1(sqrt, __builtin_sqrtf(x), __builtin_sqrt(x))
MSL_MATH1(rsqrt, 1.0f / __builtin_sqrtf(x), 1.0 / __builtin_sqrt(x))
MSL_MATH1(cbrt, __builtin_cbrtf(x), __builtin_cbrt(x))
MSL_MATH1(sin, __builtin_sinf(x), __builtin_sin(x))
MSL_MATH1(cos, __builtin_cosf(x), __builtin_cos(x))
MSL_MATH1(tan, __builtin_tanf(x), __builtin_tan(x))
MSL_MATH1(asin, __builtin_asinf(x), __builtin_asin(x))
MSL_MATH1(acos, __builtin_acosf(x), __builtin_acos(x))
MSL_MATH1(atan, __builtin_atanf(x), __builtin_atan(x))
MSL_MATH1(sinh, __builtin_sinhf(x), __builtin_sinh(x))
MSL_MATH1(cosh, __builtin_coshf(x), __builtin_cosh(x))
MSL_MATH1(tanh, __builtin_tanhf(x), __builtin_tanh(x))
MSL_MATH1(asinh, __builtin_asinhf(x), __builtin_asinh(x))
MSL_MATH1(acosh, __builtin_acoshf(x), __builtin_acosh(x))
MSL_MATH1(atanh, __builtin_atanhf(x), __builtin_atanh(x))
MSL_MATH1(erf, __builtin_erff(x), __builtin_erf(x))
MSL_MATH1(floor, __builtin_floorf(x), __builtin_floor(x))
MSL_MATH1(ceil, __builtin_ceilf(x), __builtin_ceil(x))
MSL_MATH1(round, __builtin_roundf(x), __builtin_round(x))
MSL_MATH1(rint, __builtin_rintf(x), __builtin_rint(x))
MSL_MATH1(trunc, __builtin_truncf(x), __builtin_trunc(x))
MSL_MATH1(fabs, __builtin_fabsf(x), __builtin_fabs(x))
MSL_MATH1(fract, x - __builtin_floorf(x), x - __builtin_floor(x))
MSL_MATH1(saturate, x < 0.0f ? 0.0f : (x > 1.0f ? 1.0f : x),
          x < 0.0 ? 0.0 : (x > 1.0 ? 1.0 : x))
MSL_MATH1(sign, x > 0.0f ? 1.0f : (x < 0.0f ? -1.0f : x * 0.0f),
          x > 0.0 ? 1.0 : (x < 0.0 ? -1.0 : x * 0.0))
#undef MSL_MATH1

// abs: floating types via fabs, integers natively.
inline float abs(float x) { return __builtin_fabsf(x); }
inline double abs(double x) { return __builtin_fabs(x); }
inline half abs(half x) { return static_cast<half>(__builtin_fabsf(static_cast<float>(x))); }
inline bfloat16_t abs(bfloat16_t x) {
  return bfloat16_t::from_bits(static_cast<uint16_t>(x.bits_ & 0x7fffu));
}
template <class T, class = typename std::enable_if<std::is_integral<T>::value>::type>
inline T abs(T x) {
  return std::is_signed<T>::value ? static_cast<T>(x < 0 ? -x : x) : x;
}
template <class T, int N>
inline vec<T, N> abs(const vec<T, N>& v) {
  vec<T, N> r;
  for (int i = 0; i < N; ++i) r[i] = abs(v[i]);
  return r;
}

template <class T>
inline bool isnan(T x) {
  return static_cast<float>(x) != static_cast<float>(x);
}
inline bool isnan(double x) { return x != x; }
template <class T>
inline bool isinf(T x) {
  return __builtin_isinf(static_cast<float>(x));
}
template <class T>
inline bool isfinite(T x) {
  return __builtin_isfinite(static_cast<float>(x));
}
template <class T>
inline bool signbit(T x) {
  return __builtin_signbit(static_cast<float>(x));
}
template <class T, int N>
inline vec<bool, N> isnan(const vec<T, N>& v) {
  vec<bool, N> r;
  for (int i = 0; i < N; ++i) r[i] = isnan(v[i]);
  return r;
}
template <class T, int N>
inline vec<bool, N> isinf(const vec<T, N>& v) {
  vec<bool, N> r;
  for (int i = 0; i < N; ++i) r[i] = isinf(v[i]);
  return r;
}

namespace detail {
template <class A, class B>
struct promote {
  typedef decltype(A() + B()) type;
};
template <class A>
struct promote<A, A> {
  typedef A type;
};
}  // namespace detail

}  // namespace metal

namespace metal {
namespace detail {
template <class R>
inline R fmax_impl(R a, R b) {
  typedef typename calc<R>::type C;
  C x = static_cast<C>(a), y = static_cast<C>(b);
  if (x != x) return b;
  if (y != y) return a;
  return x < y ? b : a;
}
template <class R>
inline R fmin_impl(R a, R b) {
  typedef typename calc<R>::type C;
  C x = static_cast<C>(a), y = static_cast<C>(b);
  if (x != x) return b;
  if (y != y) return a;
  return y < x ? b : a;
}
}  // namespace detail

// max / min: floats follow fmax/fmin (a NaN operand is ignored), integers
// compare; mixed scalar types promote like arithmetic does.
template <class A, class B,
          class = typename std::enable_if<msl::is_num<A>::value &&
                                          msl::is_num<B>::value>::type>
inline typename detail::promote<A, B>::type max(A a, B b) {
  typedef typename detail::promote<A, B>::type R;
  if (msl::is_float_like<R>::value) return detail::fmax_impl<R>(R(a), R(b));
  return R(a) < R(b) ? R(b) : R(a);
}
template <class A, class B,
          class = typename std::enable_if<msl::is_num<A>::value &&
                                          msl::is_num<B>::value>::type>
inline typename detail::promote<A, B>::type min(A a, B b) {
  typedef typename detail::promote<A, B>::type R;
  if (msl::is_float_like<R>::value) return detail::fmin_impl<R>(R(a), R(b));
  return R(b) < R(a) ? R(b) : R(a);
}
template <class T, int N>
inline vec<T, N> max(const vec<T, N>& a, const vec<T, N>& b) {
  vec<T, N> r;
  for (int i = 0; i < N; ++i) r[i] = max(a[i], b[i]);
  return r;
}
template <class T, int N>
inline vec<T, N> min(const vec<T, N>& a, const vec<T, N>& b) {
  vec<T, N> r;
  for (int i = 0; i < N; ++i) r[i] = min(a[i], b[i]);
  return r;
}
template <class T, int N, class S, class = typename std::enable_if<msl::is_num<S>::value>::type>
inline vec<T, N> max(const vec<T, N>& a, S b) {
  return max(a, vec<T, N>(b));
}
template <class T, int N, class S, class = typename std::enable_if<msl::is_num<S>::value>::type>
inline vec<T, N> min(const vec<T, N>& a, S b) {
  return min(a, vec<T, N>(b));
}
template <class A, class B>
inline auto fmax(A a, B b) -> decltype(max(a, b)) {
  return max(a, b);
}
template <class A, class B>
inline auto fmin(A a, B b) -> decltype(min(a, b)) {
  return min(a, b);
}
template <class X, class L, class H>
inline auto clamp(X x, L lo, H hi) -> decltype(min(max(x, lo), hi)) {
  return min(max(x, lo), hi);
}

template <class A, class B>
inline auto pow(A a, B b) -> typename detail::promote<A, B>::type {
  typedef typename detail::promote<A, B>::type R;
  typedef typename detail::calc<R>::type C;
  return R(__builtin_pow(static_cast<double>(static_cast<C>(a)),
                         static_cast<double>(static_cast<C>(b))));
}
template <class T, int N>
inline vec<T, N> pow(const vec<T, N>& a, const vec<T, N>& b) {
  vec<T, N> r;
  for (int i = 0; i < N; ++i) r[i] = pow(a[i], b[i]);
  return r;
}
template <class A, class B>
inline auto powr(A a, B b) -> decltype(pow(a, b)) {
  return pow(a, b);
}
template <class A, class B>
inline auto atan2(A a, B b) -> typename detail::promote<A, B>::type {
  typedef typename detail::promote<A, B>::type R;
  return R(__builtin_atan2f(static_cast<float>(a), static_cast<float>(b)));
}
template <class A, class B>
inline auto fmod(A a, B b) -> typename detail::promote<A, B>::type {
  typedef typename detail::promote<A, B>::type R;
  return R(__builtin_fmodf(static_cast<float>(a), static_cast<float>(b)));
}
template <class A, class B>
inline auto copysign(A a, B b) -> typename detail::promote<A, B>::type {
  typedef typename detail::promote<A, B>::type R;
  return R(__builtin_copysignf(static_cast<float>(a), static_cast<float>(b)));
}
template <class A, class B>
inline auto divide(A a, B b) -> decltype(a / b) {
  return a / b;
}
// fma is fused (one rounding), as on the GPU.
inline float fma(float a, float b, float c) { return __builtin_fmaf(a, b, c); }
inline double fma(double a, double b, double c) { return __builtin_fma(a, b, c); }
inline half fma(half a, half b, half c) {
  return static_cast<half>(__builtin_fma(static_cast<double>(a), static_cast<double>(b),
                                         static_cast<double>(c)));
}
inline bfloat16_t fma(bfloat16_t a, bfloat16_t b, bfloat16_t c) {
  return bfloat16_t(__builtin_fmaf(float(a), float(b), float(c)));
}
template <class A, class B, class C,
          class = typename std::enable_if<!(std::is_same<A, B>::value &&
                                            std::is_same<B, C>::value)>::type>
inline float fma(A a, B b, C c) {
  return __builtin_fmaf(static_cast<float>(a), static_cast<float>(b), static_cast<float>(c));
}
template <class T, int N>
inline vec<T, N> fma(const vec<T, N>& a, const vec<T, N>& b, const vec<T, N>& c) {
  vec<T, N> r;
  for (int i = 0; i < N; ++i) r[i] = fma(a[i], b[i], c[i]);
  return r;
}
template <class X, class Y, class A>
inline auto mix(X x, Y y, A a) -> decltype(x + (y - x) * a) {
  return x + (y - x) * a;
}
template <class E, class X>
inline X step(E edge, X x) {
  return x < edge ? X(0) : X(1);
}

// select(a, b, c) = c ? b : a
template <class T>
inline T select(T a, T b, bool c) {
  return c ? b : a;
}
template <class T, int N>
inline vec<T, N> select(const vec<T, N>& a, const vec<T, N>& b, const vec<bool, N>& c) {
  vec<T, N> r;
  for (int i = 0; i < N; ++i) r[i] = c[i] ? b[i] : a[i];
  return r;
}
template <class T, int N>
inline vec<T, N> select(const vec<T, N>& a, const vec<T, N>& b, bool c) {
  return c ? b : a;
}

template <class T, int N>
inline T dot(const vec<T, N>& a, const vec<T, N>& b) {
  T s = a[0] * b[0];
  for (int i = 1; i < N; ++i) s += a[i] * b[i];
  return s;
}
template <class T, int N>
inline T length_squared(const vec<T, N>& a) {
  return dot(a, a);
}
template <class T, int N>
inline T length(const vec<T, N>& a) {
  return sqrt(dot(a, a));
}
template <class T, int N>
inline vec<T, N> normalize(const vec<T, N>& a) {
  return a * rsqrt(dot(a, a));
}
template <class T>
inline vec<T, 3> cross(const vec<T, 3>& a, const vec<T, 3>& b) {
  return vec<T, 3>(a.y * b.z - a.z * b.y, a.z * b.x - a.x * b.z, a.x * b.y - a.y * b.x);
}

// Integer helpers.
template <class T>
inline T popcount(T x) {
  return static_cast<T>(__builtin_popcountll(static_cast<unsigned long long>(x) &
                                             (~0ull >> (64 - 8 * sizeof(T)))));
}
template <class T>
inline T clz(T x) {
  typedef typename std::make_unsigned<T>::type U;
  U u = static_cast<U>(x);
  if (u == 0) return static_cast<T>(8 * sizeof(T));
  return static_cast<T>(__builtin_clzll(u) - (64 - 8 * sizeof(T)));
}
template <class T>
inline T ctz(T x) {
  typedef typename std::make_unsigned<T>::type U;
  U u = static_cast<U>(x);
  if (u == 0) return static_cast<T>(8 * sizeof(T));
  return static_cast<T>(__builtin_ctzll(u));
}
template <class T>
inline T mulhi(T a, T b) {
  typedef typename std::conditional<std::is_signed<T>::value, long long,
                                    unsigned long long>::type W;
  static_assert(sizeof(T) <= 4, "mulhi: 64-bit not supported");
  return static_cast<T>((static_cast<W>(a) * static_cast<W>(b)) >> (8 * sizeof(T)));
}

// as_type<T>(x): reinterpret the bits.
template <class To, class From>
inline To as_type(const From& x) {
  static_assert(sizeof(To) == sizeof(From), "as_type: sizes differ");
  To r;
  __builtin_memcpy(&r, &x, sizeof(To));
  return r;
}

// numeric_limits
template <class T>
struct numeric_limits;
template <>
struct numeric_limits<float> {
  static constexpr float max() { return __FLT_MAX__; }
  static constexpr float min() { return __FLT_MIN__; }
  static constexpr float lowest() { return -__FLT_MAX__; }
  static constexpr float epsilon() { return __FLT_EPSILON__; }
  static constexpr float infinity() { return __builtin_inff(); }
  static constexpr float quiet_NaN() { return __builtin_nanf(""); }
  static constexpr bool is_signed = true;
  static constexpr int digits = 24;
};
template <>
struct numeric_limits<half> {
  static half max() { return static_cast<half>(65504.0f); }
  static half min() { return static_cast<half>(6.103515625e-05f); }
  static half lowest() { return static_cast<half>(-65504.0f); }
  static half epsilon() { return static_cast<half>(0.0009765625f); }
  static half infinity() { return static_cast<half>(__builtin_inff()); }
  static half quiet_NaN() { return static_cast<half>(__builtin_nanf("")); }
  static constexpr bool is_signed = true;
  static constexpr int digits = 11;
};
template <>
struct numeric_limits<bfloat16_t> {
  static bfloat16_t max() { return bfloat16_t::from_bits(0x7f7f); }
  static bfloat16_t min() { return bfloat16_t::from_bits(0x0080); }
  static bfloat16_t lowest() { return bfloat16_t::from_bits(0xff7f); }
  static bfloat16_t epsilon() { return bfloat16_t::from_bits(0x3c00); }
  static bfloat16_t infinity() { return bfloat16_t::from_bits(0x7f80); }
  static bfloat16_t quiet_NaN() { return bfloat16_t::from_bits(0x7fc0); }
  static constexpr bool is_signed = true;
  static constexpr int digits = 8;
};
#define MSL_INT_LIMITS(T, MIN, MAX)                     \
  template <>                                           \
  struct numeric_limits<T> {                            \
    static constexpr T max() { return MAX; }            \
    static constexpr T min() { return MIN; }            \
    static constexpr T lowest() { return MIN; }         \
    static constexpr bool is_signed = (MIN) != 0;       \
    static constexpr int digits = 8 * sizeof(T) - ((MIN) != 0); \
  };
MSL_INT_LIMITS(bool, false, true)
MSL_INT_LIMITS(signed char, -__SCHAR_MAX__ - 1, __SCHAR_MAX__)
MSL_INT_LIMITS(char, -__SCHAR_MAX__ - 1, __SCHAR_MAX__)
MSL_INT_LIMITS(unsigned char, 0, 0xff)
MSL_INT_LIMITS(short, -__SHRT_MAX__ - 1, __SHRT_MAX__)
MSL_INT_LIMITS(unsigned short, 0, 0xffff)
MSL_INT_LIMITS(int, -__INT_MAX__ - 1, __INT_MAX__)
MSL_INT_LIMITS(unsigned int, 0u, 0xffffffffu)
MSL_INT_LIMITS(long, -__LONG_MAX__ - 1, __LONG_MAX__)
MSL_INT_LIMITS(unsigned long, 0ul, ~0ul)
MSL_INT_LIMITS(long long, -__LONG_LONG_MAX__ - 1, __LONG_LONG_MAX__)
MSL_INT_LIMITS(unsigned long long, 0ull, ~0ull)
#undef MSL_INT_LIMITS

// precise:: and fast:: spell the same functions (this harness has one math
// mode: correctly rounded libm calls).
#define MSL_MATH_USING                                                        \
  using metal::exp;                                                          \
  using metal::exp2;                                                         \
  using metal::exp10;                                                        \
  using metal::log;                                                          \
  using metal::log2;                                                         \
  using metal::log10;                                                        \
  using metal::sqrt;                                                         \
  using metal::rsqrt;                                                        \
  using metal::sin;                                                          \
  using metal::cos;                                                          \
  using metal::tan;                                                          \
  using metal::asin;                                                         \
  using metal::acos;                                                         \
  using metal::atan;                                                         \
  using metal::atan2;                                                        \
  using metal::sinh;                                                         \
  using metal::cosh;                                                         \
  using metal::tanh;                                                         \
  using metal::pow;                                                          \
  using metal::powr;                                                         \
  using metal::divide;                                                       \
  using metal::max;                                                          \
  using metal::min;                                                          \
  using metal::fmax;                                                         \
  using metal::fmin;                                                         \
  using metal::clamp;                                                        \
  using metal::abs;                                                          \
  using metal::fabs;                                                         \
  using metal::floor;                                                        \
  using metal::ceil;                                                         \
  using metal::round;                                                        \
  using metal::trunc;                                                        \
  using metal::fma;                                                          \
  using metal::normalize;                                                    \
  using metal::length;                                                       \
  using metal::saturate;
namespace precise {
MSL_MATH_USING
}
namespace fast {
MSL_MATH_USING
}
#undef MSL_MATH_USING

}  // namespace metal

// ---------------------------------------------------------------------------
// Checked device pointers (debug builds).  A dptr<T> carries the bounds of
// the buffer it points into; every dereference is checked, pointer
// arithmetic is free to leave the buffer as long as nothing is accessed.
// ---------------------------------------------------------------------------
namespace msl {

template <class T>
struct dptr {
  T* p_;
  const char* lo_;
  const char* hi_;
  const char* name_;

  typedef T element_type;
  dptr() = default;
  dptr(T* p, const char* lo, const char* hi, const char* name)
      : p_(p), lo_(lo), hi_(hi), name_(name) {}
  template <class U, class = typename std::enable_if<std::is_convertible<U*, T*>::value>::type>
  dptr(const dptr<U>& o) : p_(o.p_), lo_(o.lo_), hi_(o.hi_), name_(o.name_) {}

  T* check(T* q) const {
    const char* c = reinterpret_cast<const char*>(q);
    if (c < lo_ || c + sizeof(T) > hi_ || c + sizeof(T) < c) {
      msl_rt_fail_oob(name_, q, sizeof(T), lo_, hi_);
    }
    return q;
  }
  template <class I, class = typename std::enable_if<std::is_integral<I>::value ||
                                                     std::is_enum<I>::value>::type>
  T& operator[](I i) const {
    return *check(p_ + i);
  }
  T& operator*() const { return *check(p_); }
  T* operator->() const { return check(p_); }
  operator T*() const { return p_; }
  template <class U>
  explicit operator U*() const {
    return (U*)(p_);
  }
  template <class I, class = typename std::enable_if<std::is_integral<I>::value>::type>
  dptr operator+(I i) const {
    dptr r = *this;
    r.p_ += i;
    return r;
  }
  template <class I, class = typename std::enable_if<std::is_integral<I>::value>::type>
  dptr operator-(I i) const {
    dptr r = *this;
    r.p_ -= i;
    return r;
  }
  ptrdiff_t operator-(const dptr& o) const { return p_ - o.p_; }
  ptrdiff_t operator-(T* o) const { return p_ - o; }
  template <class I, class = typename std::enable_if<std::is_integral<I>::value>::type>
  dptr& operator+=(I i) {
    p_ += i;
    return *this;
  }
  template <class I, class = typename std::enable_if<std::is_integral<I>::value>::type>
  dptr& operator-=(I i) {
    p_ -= i;
    return *this;
  }
  dptr& operator++() {
    ++p_;
    return *this;
  }
  dptr& operator--() {
    --p_;
    return *this;
  }
  dptr operator++(int) {
    dptr r = *this;
    ++p_;
    return r;
  }
  dptr operator--(int) {
    dptr r = *this;
    --p_;
    return r;
  }
};
template <class I, class T, class = typename std::enable_if<std::is_integral<I>::value>::type>
inline dptr<T> operator+(I i, const dptr<T>& d) {
  return d + i;
}

template <class T>
struct is_dptr : std::false_type {};
template <class T>
struct is_dptr<dptr<T>> : std::true_type {};

// reinterpret_cast<> in kernel text is rewritten to msl::reinterpret_ptr<>,
// so a checked pointer keeps its bounds when its element type changes.
template <class To, class From,
          class = typename std::enable_if<!is_dptr<typename std::decay<From>::type>::value>::type>
inline To reinterpret_ptr(From&& x) {
  return reinterpret_cast<To>(x);
}
template <class To, class U>
inline typename std::enable_if<std::is_pointer<To>::value,
                               dptr<typename std::remove_pointer<To>::type>>::type
reinterpret_ptr(const dptr<U>& x) {
  return dptr<typename std::remove_pointer<To>::type>(
      reinterpret_cast<To>(x.p_), x.lo_, x.hi_, x.name_);
}

template <class T>
inline T* raw(T* p) {
  return p;
}
template <class T>
inline T* raw(const dptr<T>& p) {
  return p.check(p.p_);
}

template <class T>
struct identity {
  typedef T type;
};

inline void* tg_alloc(int id, size_t size, size_t align) {
  return msl_rt_tg_alloc(id, size, align);
}

inline void failf(const char* fmt, ...) __attribute__((noreturn, format(printf, 1, 2)));
inline void failf(const char* fmt, ...) {
  char buf[512];
  __builtin_va_list ap;
  __builtin_va_start(ap, fmt);
  __builtin_vsnprintf(buf, sizeof buf, fmt, ap);
  __builtin_va_end(ap);
  msl_rt_fail(buf);
}

}  // namespace msl

// ---------------------------------------------------------------------------
// Barriers, SIMD-group functions, atomics
// ---------------------------------------------------------------------------
namespace metal {

enum class mem_flags : uint32_t {
  mem_none = 0,
  mem_device = 1,
  mem_threadgroup = 2,
  mem_texture = 4,
  mem_threadgroup_imageblock = 8,
  mem_object_data = 16,
};
inline constexpr mem_flags operator|(mem_flags a, mem_flags b) {
  return static_cast<mem_flags>(static_cast<uint32_t>(a) | static_cast<uint32_t>(b));
}
inline constexpr mem_flags operator&(mem_flags a, mem_flags b) {
  return static_cast<mem_flags>(static_cast<uint32_t>(a) & static_cast<uint32_t>(b));
}
enum class thread_scope { thread_scope_thread, thread_scope_simdgroup, thread_scope_threadgroup, thread_scope_device };

// `site` identifies the call in the kernel text; the harness fills it in by
// rewriting every call to __msl_at<site>::name(...).
inline void threadgroup_barrier(mem_flags, uint32_t site = 0) {
  msl_rt_barrier("threadgroup_barrier", site);
}
inline void simdgroup_barrier(mem_flags, uint32_t site = 0) {
  msl_rt_simd("simdgroup_barrier", site, nullptr, 0);
}
template <class... A>
inline void atomic_thread_fence(A...) {}

namespace detail {
template <class T>
inline const msl_simd_view* exchange(const char* op, uint32_t site, const T& x) {
  static_assert(sizeof(T) <= 64, "SIMD collectives take values of at most 64 bytes");
  return msl_rt_simd(op, site, &x, sizeof(T));
}
template <class T>
inline T lane_value(const msl_simd_view* v, uint32_t lane) {
  T r;
  if (lane >= v->width || !((v->active >> lane) & 1u)) {
    // Reading an inactive lane is undefined on the GPU: hand back poison.
    __builtin_memset(&r, 0xff, sizeof(T));
    return r;
  }
  __builtin_memcpy(&r, v->slots + lane * v->slot_bytes, sizeof(T));
  return r;
}
// Pairwise tree over lanes in index order: the order of the xor butterfly
// (1, 2, 4, 8, 16), so every lane gets the same bits.
template <class T, class Op>
inline T tree_reduce(const msl_simd_view* v, Op op) {
  T vals[64];
  uint64_t have = 0;
  for (uint32_t i = 0; i < v->width; ++i) {
    if ((v->active >> i) & 1u) {
      vals[i] = lane_value<T>(v, i);
      have |= 1ull << i;
    }
  }
  for (uint32_t s = 1; s < v->width; s *= 2) {
    for (uint32_t i = 0; i + s < v->width; i += 2 * s) {
      uint32_t j = i + s;
      if ((have >> j) & 1u) {
        if ((have >> i) & 1u) {
          vals[i] = op(vals[i], vals[j]);
        } else {
          vals[i] = vals[j];
          have |= 1ull << i;
        }
      }
    }
  }
  return vals[0];
}
template <class T, class Op>
inline T prefix_scan(const msl_simd_view* v, Op op, bool inclusive, T identity) {
  T acc = identity;
  bool first = true;
  uint32_t end = inclusive ? v->lane + 1 : v->lane;
  for (uint32_t i = 0; i < end; ++i) {
    if ((v->active >> i) & 1u) {
      T x = lane_value<T>(v, i);
      acc = first ? x : op(acc, x);
      first = false;
    }
  }
  return acc;
}
inline uint32_t first_lane(const msl_simd_view* v) { return __builtin_ctz(v->active); }
}  // namespace detail

template <class T>
inline T simd_sum(T x, uint32_t site = 0) {
  auto v = detail::exchange("simd_sum", site, x);
  return detail::tree_reduce<T>(v, [](const T& a, const T& b) { return T(a + b); });
}
template <class T>
inline T simd_product(T x, uint32_t site = 0) {
  auto v = detail::exchange("simd_product", site, x);
  return detail::tree_reduce<T>(v, [](const T& a, const T& b) { return T(a * b); });
}
template <class T>
inline T simd_max(T x, uint32_t site = 0) {
  auto v = detail::exchange("simd_max", site, x);
  return detail::tree_reduce<T>(v, [](const T& a, const T& b) { return T(max(a, b)); });
}
template <class T>
inline T simd_min(T x, uint32_t site = 0) {
  auto v = detail::exchange("simd_min", site, x);
  return detail::tree_reduce<T>(v, [](const T& a, const T& b) { return T(min(a, b)); });
}
template <class T>
inline T simd_and(T x, uint32_t site = 0) {
  auto v = detail::exchange("simd_and", site, x);
  return detail::tree_reduce<T>(v, [](const T& a, const T& b) { return T(a & b); });
}
template <class T>
inline T simd_or(T x, uint32_t site = 0) {
  auto v = detail::exchange("simd_or", site, x);
  return detail::tree_reduce<T>(v, [](const T& a, const T& b) { return T(a | b); });
}
template <class T>
inline T simd_xor(T x, uint32_t site = 0) {
  auto v = detail::exchange("simd_xor", site, x);
  return detail::tree_reduce<T>(v, [](const T& a, const T& b) { return T(a ^ b); });
}
inline bool simd_all(bool x, uint32_t site = 0) {
  auto v = detail::exchange("simd_all", site, x);
  return detail::tree_reduce<bool>(v, [](bool a, bool b) { return a && b; });
}
inline bool simd_any(bool x, uint32_t site = 0) {
  auto v = detail::exchange("simd_any", site, x);
  return detail::tree_reduce<bool>(v, [](bool a, bool b) { return a || b; });
}
template <class T>
inline T simd_prefix_exclusive_sum(T x, uint32_t site = 0) {
  auto v = detail::exchange("simd_prefix_exclusive_sum", site, x);
  return detail::prefix_scan<T>(v, [](const T& a, const T& b) { return T(a + b); }, false, T(0));
}
template <class T>
inline T simd_prefix_inclusive_sum(T x, uint32_t site = 0) {
  auto v = detail::exchange("simd_prefix_inclusive_sum", site, x);
  return detail::prefix_scan<T>(v, [](const T& a, const T& b) { return T(a + b); }, true, T(0));
}
template <class T>
inline T simd_prefix_exclusive_product(T x, uint32_t site = 0) {
  auto v = detail::exchange("simd_prefix_exclusive_product", site, x);
  return detail::prefix_scan<T>(v, [](const T& a, const T& b) { return T(a * b); }, false, T(1));
}
template <class T>
inline T simd_prefix_inclusive_product(T x, uint32_t site = 0) {
  auto v = detail::exchange("simd_prefix_inclusive_product", site, x);
  return detail::prefix_scan<T>(v, [](const T& a, const T& b) { return T(a * b); }, true, T(1));
}

inline void check_lane(const char* op, uint32_t want, const msl_simd_view* v) {
  if (want >= v->width) {
    msl::failf("%s: lane %u reads lane %u, outside the %u-lane SIMD group "
               "(does the kernel assume a different SIMD width?)",
               op, v->lane, want, v->width);
  }
}
template <class T>
inline T simd_broadcast(T x, ushort lane, uint32_t site = 0) {
  auto v = detail::exchange("simd_broadcast", site, x);
  check_lane("simd_broadcast", lane, v);
  return detail::lane_value<T>(v, lane);
}
template <class T>
inline T simd_broadcast_first(T x, uint32_t site = 0) {
  auto v = detail::exchange("simd_broadcast_first", site, x);
  return detail::lane_value<T>(v, detail::first_lane(v));
}
template <class T>
inline T simd_shuffle(T x, ushort lane, uint32_t site = 0) {
  auto v = detail::exchange("simd_shuffle", site, x);
  check_lane("simd_shuffle", lane, v);
  return detail::lane_value<T>(v, lane);
}
template <class T>
inline T simd_shuffle_xor(T x, ushort mask, uint32_t site = 0) {
  auto v = detail::exchange("simd_shuffle_xor", site, x);
  uint32_t src = v->lane ^ mask;
  check_lane("simd_shuffle_xor", src, v);
  return detail::lane_value<T>(v, src);
}
template <class T>
inline T simd_shuffle_down(T x, ushort delta, uint32_t site = 0) {
  auto v = detail::exchange("simd_shuffle_down", site, x);
  uint32_t src = v->lane + delta;
  return src >= v->width ? x : detail::lane_value<T>(v, src);
}
template <class T>
inline T simd_shuffle_up(T x, ushort delta, uint32_t site = 0) {
  auto v = detail::exchange("simd_shuffle_up", site, x);
  return delta > v->lane ? x : detail::lane_value<T>(v, v->lane - delta);
}
template <class T>
inline T simd_shuffle_rotate_down(T x, ushort delta, uint32_t site = 0) {
  auto v = detail::exchange("simd_shuffle_rotate_down", site, x);
  return detail::lane_value<T>(v, (v->lane + delta) % v->width);
}
template <class T>
inline T simd_shuffle_rotate_up(T x, ushort delta, uint32_t site = 0) {
  auto v = detail::exchange("simd_shuffle_rotate_up", site, x);
  return detail::lane_value<T>(v, (v->lane + v->width - delta % v->width) % v->width);
}
inline bool simd_is_first(uint32_t site = 0) {
  auto v = detail::exchange("simd_is_first", site, 0);
  return v->lane == detail::first_lane(v);
}
struct simd_vote {
  typedef uint64_t vote_t;
  uint64_t v_;
  uint64_t active_;
  explicit operator vote_t() const { return v_; }
  bool all() const { return v_ == active_; }
  bool any() const { return v_ != 0; }
};
inline simd_vote simd_ballot(bool x, uint32_t site = 0) {
  auto v = detail::exchange("simd_ballot", site, x);
  uint64_t bits = 0;
  for (uint32_t i = 0; i < v->width; ++i) {
    if (((v->active >> i) & 1u) && detail::lane_value<bool>(v, i)) bits |= 1ull << i;
  }
  return simd_vote{bits, v->active};
}

// Atomics.  Memory orders are accepted and ignored (Metal only has relaxed).
enum memory_order {
  memory_order_relaxed,
  memory_order_acquire,
  memory_order_release,
  memory_order_acq_rel,
  memory_order_seq_cst
};
template <class T>
struct atomic {
  T v_;
};
typedef atomic<int> atomic_int;
typedef atomic<unsigned int> atomic_uint;
typedef atomic<float> atomic_float;
typedef atomic<bool> atomic_bool;
typedef atomic<unsigned long> atomic_ulong;
typedef atomic<long> atomic_long;

template <class T>
inline T atomic_load_explicit(const volatile atomic<T>* a, memory_order = memory_order_relaxed) {
  T r;
  __atomic_load(const_cast<T*>(&a->v_), &r, __ATOMIC_RELAXED);
  return r;
}
template <class T>
inline void atomic_store_explicit(volatile atomic<T>* a, typename msl::identity<T>::type v,
                                  memory_order = memory_order_relaxed) {
  __atomic_store(const_cast<T*>(&a->v_), &v, __ATOMIC_RELAXED);
}
template <class T>
inline T atomic_exchange_explicit(volatile atomic<T>* a, typename msl::identity<T>::type v,
                                  memory_order = memory_order_relaxed) {
  T r;
  __atomic_exchange(const_cast<T*>(&a->v_), &v, &r, __ATOMIC_RELAXED);
  return r;
}
template <class T>
inline bool atomic_compare_exchange_weak_explicit(volatile atomic<T>* a, T* expected,
                                                  typename msl::identity<T>::type desired,
                                                  memory_order = memory_order_relaxed,
                                                  memory_order = memory_order_relaxed) {
  return __atomic_compare_exchange(const_cast<T*>(&a->v_), expected, &desired, false,
                                   __ATOMIC_RELAXED, __ATOMIC_RELAXED);
}
template <class T>
inline bool atomic_compare_exchange_strong_explicit(volatile atomic<T>* a, T* expected,
                                                    typename msl::identity<T>::type desired,
                                                    memory_order = memory_order_relaxed,
                                                    memory_order = memory_order_relaxed) {
  return __atomic_compare_exchange(const_cast<T*>(&a->v_), expected, &desired, false,
                                   __ATOMIC_RELAXED, __ATOMIC_RELAXED);
}
namespace detail {
template <class T, class F>
inline T atomic_rmw(volatile atomic<T>* a, F f) {
  T* p = const_cast<T*>(&a->v_);
  T old;
  __atomic_load(p, &old, __ATOMIC_RELAXED);
  T want;
  do {
    want = f(old);
  } while (!__atomic_compare_exchange(p, &old, &want, true, __ATOMIC_RELAXED, __ATOMIC_RELAXED));
  return old;
}
}  // namespace detail
#define MSL_ATOMIC_RMW(name, expr)                                                      \
  template <class T>                                                                    \
  inline T atomic_fetch_##name##_explicit(volatile atomic<T>* a,                        \
                                          typename msl::identity<T>::type v,            \
                                          memory_order = memory_order_relaxed) {        \
    return detail::atomic_rmw(a, [v](T o) { return static_cast<T>(expr); });           \
  }
MSL_ATOMIC_RMW(add, o + v)
MSL_ATOMIC_RMW(sub, o - v)
MSL_ATOMIC_RMW(and, o & v)
MSL_ATOMIC_RMW(or, o | v)
MSL_ATOMIC_RMW(xor, o ^ v)
MSL_ATOMIC_RMW(max, o < v ? v : o)
MSL_ATOMIC_RMW(min, v < o ? v : o)
#undef MSL_ATOMIC_RMW

// The same functions taking checked pointers (debug builds): the object is
// bounds-checked, then the plain version runs.
#define MSL_ATOMIC_DPTR1(name)                                                        \
  template <class T, class... A>                                                      \
  inline auto name(const msl::dptr<atomic<T>>& p, A... args)                          \
      -> decltype(name(static_cast<atomic<T>*>(nullptr), args...)) {                  \
    return name(msl::raw(p), args...);                                                \
  }                                                                                   \
  template <class T, class... A>                                                      \
  inline auto name(const msl::dptr<const atomic<T>>& p, A... args)                    \
      -> decltype(name(static_cast<const atomic<T>*>(nullptr), args...)) {            \
    return name(msl::raw(p), args...);                                                \
  }
MSL_ATOMIC_DPTR1(atomic_load_explicit)
MSL_ATOMIC_DPTR1(atomic_store_explicit)
MSL_ATOMIC_DPTR1(atomic_exchange_explicit)
MSL_ATOMIC_DPTR1(atomic_compare_exchange_weak_explicit)
MSL_ATOMIC_DPTR1(atomic_compare_exchange_strong_explicit)
MSL_ATOMIC_DPTR1(atomic_fetch_add_explicit)
MSL_ATOMIC_DPTR1(atomic_fetch_sub_explicit)
MSL_ATOMIC_DPTR1(atomic_fetch_and_explicit)
MSL_ATOMIC_DPTR1(atomic_fetch_or_explicit)
MSL_ATOMIC_DPTR1(atomic_fetch_xor_explicit)
MSL_ATOMIC_DPTR1(atomic_fetch_max_explicit)
MSL_ATOMIC_DPTR1(atomic_fetch_min_explicit)
#undef MSL_ATOMIC_DPTR1

// A few helpers from MLX's own kernel utilities that custom kernels use.
template <typename IdxT = int64_t, class Shape, class Strides>
inline IdxT elem_to_loc(IdxT elem, Shape shape, Strides strides, int ndim) {
  IdxT loc = 0;
  for (int i = ndim - 1; i >= 0 && elem > 0; --i) {
    loc += static_cast<IdxT>(elem % shape[i]) * static_cast<IdxT>(strides[i]);
    elem /= shape[i];
  }
  return loc;
}

}  // namespace metal

using namespace metal;

template <class T>
struct Limits {
  static T max() { return metal::numeric_limits<T>::max(); }
  static T min() { return metal::numeric_limits<T>::lowest(); }
  static T finite_max() { return metal::numeric_limits<T>::max(); }
  static T finite_min() { return metal::numeric_limits<T>::lowest(); }
};
template <>
struct Limits<float> {
  static float max() { return __builtin_inff(); }
  static float min() { return -__builtin_inff(); }
  static float finite_max() { return __FLT_MAX__; }
  static float finite_min() { return -__FLT_MAX__; }
};
template <>
struct Limits<half> {
  static half max() { return static_cast<half>(__builtin_inff()); }
  static half min() { return static_cast<half>(-__builtin_inff()); }
  static half finite_max() { return static_cast<half>(65504.0f); }
  static half finite_min() { return static_cast<half>(-65504.0f); }
};
template <>
struct Limits<bfloat16_t> {
  static bfloat16_t max() { return bfloat16_t::from_bits(0x7f80); }
  static bfloat16_t min() { return bfloat16_t::from_bits(0xff80); }
  static bfloat16_t finite_max() { return bfloat16_t::from_bits(0x7f7f); }
  static bfloat16_t finite_min() { return bfloat16_t::from_bits(0xff7f); }
};

// Call sites: every collective in kernel text becomes __msl_at<site>::f(...).
template <uint32_t S>
struct __msl_at {
  static void threadgroup_barrier(metal::mem_flags f) { metal::threadgroup_barrier(f, S); }
  static void simdgroup_barrier(metal::mem_flags f) { metal::simdgroup_barrier(f, S); }
#define MSL_AT1(name) \
  template <class T>  \
  static T name(T x) { return metal::name(x, S); }
#define MSL_AT2(name)                   \
  template <class T>                    \
  static T name(T x, ushort k) {        \
    return metal::name(x, k, S);        \
  }
  MSL_AT1(simd_sum)
  MSL_AT1(simd_product)
  MSL_AT1(simd_max)
  MSL_AT1(simd_min)
  MSL_AT1(simd_and)
  MSL_AT1(simd_or)
  MSL_AT1(simd_xor)
  MSL_AT1(simd_prefix_exclusive_sum)
  MSL_AT1(simd_prefix_inclusive_sum)
  MSL_AT1(simd_prefix_exclusive_product)
  MSL_AT1(simd_prefix_inclusive_product)
  MSL_AT1(simd_broadcast_first)
  MSL_AT2(simd_broadcast)
  MSL_AT2(simd_shuffle)
  MSL_AT2(simd_shuffle_xor)
  MSL_AT2(simd_shuffle_down)
  MSL_AT2(simd_shuffle_up)
  MSL_AT2(simd_shuffle_rotate_down)
  MSL_AT2(simd_shuffle_rotate_up)
#undef MSL_AT1
#undef MSL_AT2
  static bool simd_all(bool x) { return metal::simd_all(x, S); }
  static bool simd_any(bool x) { return metal::simd_any(x, S); }
  static bool simd_is_first() { return metal::simd_is_first(S); }
  static metal::simd_vote simd_ballot(bool x) { return metal::simd_ballot(x, S); }
};

namespace msl {
inline metal::uint3 u3(const uint32_t* a) { return metal::uint3(a[0], a[1], a[2]); }
}  // namespace msl

// Constants from metal_stdlib.
#define MAXFLOAT __FLT_MAX__
#define FLT_MAX __FLT_MAX__
#define FLT_MIN __FLT_MIN__
#define FLT_EPSILON __FLT_EPSILON__
#define HALF_MAX 65504.0f
#define HALF_MIN 6.103515625e-05f
#define INFINITY __builtin_inff()
#define HUGE_VALF __builtin_inff()
#define NAN __builtin_nanf("")
#define M_E_F 2.71828182845904523536f
#define M_LOG2E_F 1.44269504088896340736f
#define M_LOG10E_F 0.434294481903251827651f
#define M_LN2_F 0.693147180559945309417f
#define M_LN10_F 2.30258509299404568402f
#define M_PI_F 3.14159265358979323846f
#define M_PI_2_F 1.57079632679489661923f
#define M_PI_4_F 0.785398163397448309616f
#define M_1_PI_F 0.318309886183790671538f
#define M_2_PI_F 0.636619772367581343076f
#define M_2_SQRTPI_F 1.12837916709551257390f
#define M_SQRT2_F 1.41421356237309504880f
#define M_SQRT1_2_F 0.707106781186547524401f

// Address spaces and kernel-language keywords: no meaning on the CPU.  These
// come last so that no system header sees them.
#define device
#define constant
#define thread
#define threadgroup
#define threadgroup_imageblock
#define ray_data
#define object_data
#define METAL_FUNC inline
#define METAL_PRAGMA_UNROLL

#endif  // MSL_SHIM_ABI_ONLY
#endif  // MLX_SPEC_MSL_SHIM_H
