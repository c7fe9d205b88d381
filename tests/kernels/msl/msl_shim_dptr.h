// msl_shim_dptr.h -- checked device pointers for debug builds.
// Part of msl_shim.h; include that header, not this one.
#ifndef MLX_SPEC_MSL_MSL_SHIM_DPTR_H
#define MLX_SPEC_MSL_MSL_SHIM_DPTR_H

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

#endif  // MLX_SPEC_MSL_MSL_SHIM_DPTR_H
