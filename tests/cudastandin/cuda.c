#include "standin.h"

static char ids[16][32];
static int ngpus = -1;

int cuInit(unsigned int flags) {
    (void)flags;
#ifdef STANDIN_HANG
    for (;;) pause();           /* a wedged GPU: cuInit never returns */
#endif
    switch (rm_state()) {
    case 0: return 100;         /* CUDA_ERROR_NO_DEVICE */
    case 2: return 803;         /* CUDA_ERROR_SYSTEM_DRIVER_MISMATCH */
    }
    ngpus = busids(ids, 16);
    return ngpus ? 0 : 100;
}
int cuGetErrorName(int rc, const char **s) {
    switch (rc) {
    case 0: *s = "CUDA_SUCCESS"; return 0;
    case 2: *s = "CUDA_ERROR_OUT_OF_MEMORY"; return 0;
    case 3: *s = "CUDA_ERROR_NOT_INITIALIZED"; return 0;
    case 100: *s = "CUDA_ERROR_NO_DEVICE"; return 0;
    case 101: *s = "CUDA_ERROR_INVALID_DEVICE"; return 0;
    case 803: *s = "CUDA_ERROR_SYSTEM_DRIVER_MISMATCH"; return 0;
    }
    *s = 0;
    return 1;
}
int cuDriverGetVersion(int *v) { *v = 12020; return 0; }
int cuDeviceGetCount(int *c) { if (ngpus < 0) return 3; *c = ngpus; return 0; }
int cuDeviceGet(int *d, int ordinal) { if (ordinal >= ngpus) return 101; *d = ordinal; return 0; }
int cuDeviceGetPCIBusId(char *buf, int len, int d) { upper_bus(ids[d], buf, len, 0); return 0; }
int cuDeviceGetName(char *buf, int len, int d) { snprintf(buf, len, "Stand-in GPU %d", d); return 0; }
#ifdef STANDIN_TOGETHER
static volatile int in_retain = 0;
#endif
int cuDevicePrimaryCtxRetain(void **ctx, int d) {
#ifdef STANDIN_FAIL_DEVICE
    if (d == STANDIN_FAIL_DEVICE) return 2;
#endif
#ifdef STANDIN_HANG_DEVICE
    if (d == STANDIN_HANG_DEVICE) for (;;) pause();      /* one wedged GPU: its context never comes */
#endif
#ifdef STANDIN_TOGETHER
    /* every GPU's context is made at once or not at all: each waits (up to 20 s: a busy machine) until all are being made,
     * so a check that makes them one after the other gets CUDA_ERROR_UNKNOWN (999) on the first */
    __sync_add_and_fetch(&in_retain, 1);
    for (int i = 0; i < 2000 && in_retain < ngpus; i++) usleep(10000);
    if (in_retain < ngpus) return 999;
#endif
    *ctx = (void *)(long)(d + 1);
    return 0;
}
int cuDevicePrimaryCtxRelease_v2(int d) { (void)d; return 0; }
int cuCtxSetCurrent(void *ctx) { (void)ctx; return 0; }
int cuMemAlloc_v2(unsigned long long *p, size_t n) { void *m = malloc(n); if (!m) return 2; *p = (unsigned long long)m; return 0; }
int cuMemFree_v2(unsigned long long p) { free((void *)p); return 0; }
int cuMemcpyHtoD_v2(unsigned long long dst, const void *src, size_t n) {
    memcpy((void *)dst, src, n);
#ifdef STANDIN_CORRUPT
    ((unsigned char *)dst)[n / 2] ^= 0xff;   /* memory that does not hold what was written */
#endif
    return 0;
}
int cuMemcpyDtoH_v2(void *dst, unsigned long long src, size_t n) { memcpy(dst, (void *)src, n); return 0; }
