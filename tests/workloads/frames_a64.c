/* AArch64 frames of every shape the unwind tables hold, for tests/agent/test_unwind_tables_aarch64.py (built
 * there with aarch64-linux-gnu-gcc, never run): a leaf that keeps its return address in x30, frames whose
 * x29/x30 record lies at the top (small frames) or at the bottom of 8 KB of locals (GCC 12 puts callee
 * saves below the locals: slots counted from sp), and one over 32 KB (beyond what a row holds). */
#include <stdio.h>
#include <string.h>

__attribute__((noinline)) long frames_leaf(long x) { return x * 3 + 1; }

__attribute__((noinline)) long frames_small(long n) { return frames_leaf(n) + frames_leaf(n + 1); }

__attribute__((noinline)) long frames_big(long n) {
    char buf[8192];
    snprintf(buf, sizeof buf, "%ld", n);
    return (long)strlen(buf) + frames_small(n);
}

__attribute__((noinline)) long frames_huge(long n) {
    char buf[70000];
    snprintf(buf, sizeof buf, "%ld", n);
    return (long)strlen(buf) + frames_big(n);
}

int main(int argc, char **argv) {
    (void)argv;
    printf("%ld\n", frames_huge(argc));
    return 0;
}
