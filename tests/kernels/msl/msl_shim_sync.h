// msl_shim_sync.h -- barriers, SIMD-group functions, atomics, call sites.
// Part of msl_shim.h; include that header, not this one.
#ifndef MLX_SPEC_MSL_MSL_SHIM_SYNC_H
#define MLX_SPEC_MSL_MSL_SHIM_SYNC_H

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

#endif  // MLX_SPEC_MSL_MSL_SHIM_SYNC_H
