// msl_shim_math.h -- metal:: math, numeric_limits, precise:: and fast::.
// Part of msl_shim.h; include that header, not this one.
#ifndef MLX_SPEC_MSL_MSL_SHIM_MATH_H
#define MLX_SPEC_MSL_MSL_SHIM_MATH_H

namespace metal {

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

#endif  // MLX_SPEC_MSL_MSL_SHIM_MATH_H
