/* C++ workload for the unwinder and demangling tests: the hot method lives in a class template inside
 * nested namespaces, called through two non-inline functions, all built without frame pointers.
 * Build: g++ -O2 -fomit-frame-pointer -g -o unwind_template unwind_template.cpp
 * usage: unwind_template SECONDS [gate]  -- runs for SECONDS of its own CPU time (so a busy machine gives
 * it as many samples as an idle one); with "gate", waits for a line on stdin before it starts.
 * Hot method: fleet::kernels::Accumulator<double>::churn(long), under run_batch() <- drive() <- main.
 * Prints "done N" (N: rounds). */
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>

namespace fleet {
namespace kernels {

template <typename T>
class Accumulator {
  public:
    explicit Accumulator(T seed) : value_(seed) {}
    __attribute__((noinline)) T churn(long n) {
        for (long i = 0; i < n; i++)
            value_ = value_ * static_cast<T>(1.0000001) + static_cast<T>(i % 7);
        return value_;
    }

  private:
    T value_;
};

}  // namespace kernels
}  // namespace fleet

static volatile double sink;

__attribute__((noinline)) double run_batch(fleet::kernels::Accumulator<double> &acc) {
    double x = acc.churn(200000);
    sink = x;
    return x * 0.5;
}

static double thread_cpu_s() {
    timespec ts;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

__attribute__((noinline)) long drive(double seconds) {
    fleet::kernels::Accumulator<double> acc(1.0);
    const double end = thread_cpu_s() + seconds;
    long rounds = 0;
    while (thread_cpu_s() < end) {
        sink = run_batch(acc);
        rounds++;
    }
    return rounds;
}

int main(int argc, char **argv) {
    if (argc < 2) return 2;
    if (argc > 2 && !std::strcmp(argv[2], "gate")) {
        char line[8];
        if (!std::fgets(line, sizeof line, stdin)) return 2;
    }
    std::printf("done %ld\n", drive(std::atof(argv[1])));
    return 0;
}
