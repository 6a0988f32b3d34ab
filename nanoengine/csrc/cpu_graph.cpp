// A CPU graph's replay (cpu_graph.py) of a run of recorded kernel calls, made in turn from C++
// rather than one ctypes call each: a step is a kernel's `name_words` twin (cpu_graph.h) and the
// words of the arguments it was recorded with.
#include <cstdint>

struct Step {
  int (*kernel)(const uint64_t* words);
  const uint64_t* words;
};

// Makes steps[0 .. n-1] in order. Returns n, or the index of the first step whose kernel refused
// its arguments (returned an error code, having changed nothing); the steps after it are not made.
extern "C" int replay(const Step* steps, int n) {
  for (int i = 0; i < n; i++)
    if (steps[i].kernel(steps[i].words) != 0) return i;
  return n;
}
