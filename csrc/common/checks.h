// Input checks shared by every op. Each message names the argument it is about.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <string>
#include <type_traits>

namespace ampkernels {

// Numbers are formatted with std::to_string, not streamed: on the GPU machine's toolchain (gcc 13 headers against
// the libstdc++ torch 2.11 loads) streaming an integer from this extension into an ostringstream crashes inside
// libstdc++'s num_put (cuda-gdb backtrace), which turns every error message into a segfault.
template <typename T, std::enable_if_t<std::is_arithmetic_v<T> && !std::is_same_v<T, bool>, int> = 0>
std::string printable(T v) {
  return std::to_string(v);
}
inline const char* printable(bool v) { return v ? "true" : "false"; }
template <typename T, std::enable_if_t<!std::is_arithmetic_v<T>, int> = 0>
const T& printable(const T& v) {
  return v;
}

// Sizes and strides, formatted through std::to_string as above.
inline std::string list_of(at::IntArrayRef v) {
  std::string s = "[";
  for (size_t i = 0; i < v.size(); ++i) s += (i ? ", " : "") + std::to_string(v[i]);
  return s + "]";
}

template <typename... Args>
std::string message(const Args&... args) {
  return c10::str(printable(args)...);
}

}  // namespace ampkernels

// Classes bound with pybind11 (bindings.cpp) get pybind11's own hidden visibility, which GCC otherwise warns about.
#if defined(__GNUC__)
#define AMPK_HIDDEN __attribute__((visibility("hidden")))
#else
#define AMPK_HIDDEN
#endif

#define AMPK_CHECK_ARG(cond, arg, ...) \
  TORCH_CHECK(cond, ::ampkernels::message("ampkernels: argument '", arg, "': ", __VA_ARGS__))

#define AMPK_CHECK_SCALAR_FLOAT(t, arg)                                                                   \
  do {                                                                                                    \
    AMPK_CHECK_ARG((t).scalar_type() == at::kFloat, arg, "expected a float32 tensor, got ", (t).scalar_type()); \
    AMPK_CHECK_ARG((t).numel() == 1, arg, "expected a 1-element tensor, got ", (t).numel(), " elements");  \
  } while (0)

#define AMPK_CHECK_SAME_DEVICE(t, ref, arg)                                                                  \
  AMPK_CHECK_ARG((t).device() == (ref).device(), arg, "expected a tensor on ", (ref).device(), ", got one on ", \
                 (t).device())

namespace ampkernels {

// The gradient dtypes the multi-tensor kernels take (mixed freely in one call).
inline bool is_supported_grad_dtype(at::ScalarType t) {
  return t == at::kFloat || t == at::kHalf || t == at::kBFloat16 || t == at::kDouble;
}

}  // namespace ampkernels
