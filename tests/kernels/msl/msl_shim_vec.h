// msl_shim_vec.h -- vector types vec<T, N> (float4, half2, ...).
// Part of msl_shim.h; include that header, not this one.
#ifndef MLX_SPEC_MSL_MSL_SHIM_VEC_H
#define MLX_SPEC_MSL_MSL_SHIM_VEC_H

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
}  // namespace metal

#endif  // MLX_SPEC_MSL_MSL_SHIM_VEC_H
