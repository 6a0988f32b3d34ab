// What lets a CPU graph (cpu_graph.py) replay a step's kernels with one call from Python.
//
// Through ctypes, each kernel call costs about 1.5 us before the kernel starts (libffi set up
// anew, every argument converted), and a batch-1 decode step makes some 300 of them: 0.6-0.9 ms
// of a 5-7 ms step, as much as its attention. So every entry point `name` also gets a twin,
// `name_words`, which takes its arguments as an array of 64-bit words. Words are all one type, so
// cpu_graph.cpp can call any kernel's twin through one function pointer type, and a replay runs a
// whole list of recorded calls from C++; the compiler turns each word back into its parameter's
// type, from the kernel's own signature, so nothing here repeats the signatures.
#pragma once
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>

// A word as a parameter of type T: a pointer, an integer (two's complement, so -1 survives), or a
// float (its bits, in the low half).
template <typename T>
static inline T from_word(uint64_t word) {
  if constexpr (std::is_pointer_v<T>) {
    return reinterpret_cast<T>(static_cast<uintptr_t>(word));
  } else if constexpr (std::is_floating_point_v<T>) {
    static_assert(sizeof(T) == sizeof(uint32_t), "a float argument is a float32");
    const uint32_t bits = static_cast<uint32_t>(word);
    T x;
    std::memcpy(&x, &bits, sizeof x);
    return x;
  } else {
    return static_cast<T>(static_cast<int64_t>(word));
  }
}

// kernel(words[0], words[1], ...): its error code, or 0 for a kernel that returns none.
template <typename R, typename... A, size_t... I>
static inline int call_with_words(R (*kernel)(A...), const uint64_t* words, std::index_sequence<I...>) {
  if constexpr (std::is_void_v<R>) {
    kernel(from_word<A>(words[I])...);
    return 0;
  } else {
    return kernel(from_word<A>(words[I])...);
  }
}
template <typename R, typename... A>
static inline int call_with_words(R (*kernel)(A...), const uint64_t* words) {
  return call_with_words(kernel, words, std::index_sequence_for<A...>{});
}

#define REPLAYABLE(name) \
  extern "C" int name##_words(const uint64_t* words) { return call_with_words(name, words); }
