// The test hook of cpu_kernels.h's Status: the next n parallel-region bodies of any kernel fail as an
// allocation would (std::bad_alloc), so that tests can check the MemoryError path.
#include "cpu_kernels.h"

extern "C" void lt_debug_fail_allocations(int n) { lintrans_cpu::failing_allocations().store(n); }
