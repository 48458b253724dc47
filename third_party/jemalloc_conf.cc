// jemalloc's options for ckptd's binaries, read by jemalloc when it starts (the
// MALLOC_CONF environment variable still overrides them).
//
// background_thread: jemalloc returns freed memory to the system (madvise) from threads of
// its own, not inside whichever malloc call happens to run its decay. Without them node 0's
// first step at 10,000 x 8 x 200 (gigabytes of parsed structures, freed once summarized)
// was returned during the next steps' prepares: a fifth of their CPU in madvise, measured
// with perf (docs/benchmarks.md).
extern "C" {
extern const char* malloc_conf;
const char* malloc_conf = "background_thread:true";
}
