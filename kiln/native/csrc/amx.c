/* Linux hands out the AMX tile registers' state only on request (arch_prctl), once per process:
 * kiln_amx_ready asks, and says 0 where the library was built without AMX tiles or the kernel
 * refuses; the tile kernels' callers then take their other paths. */
#include "kernels.h"

#if defined(__AMX_TILE__)
#include <sys/syscall.h>
#include <unistd.h>

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

int kiln_amx_ready(void) {
    static int state; /* 0 not asked yet, 1 granted, -1 refused */
    int s = __atomic_load_n(&state, __ATOMIC_ACQUIRE);
    if (s == 0) {
        s = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0 ? 1 : -1;
        __atomic_store_n(&state, s, __ATOMIC_RELEASE);
    }
    return s == 1;
}
#else
int kiln_amx_ready(void) { return 0; }
#endif
