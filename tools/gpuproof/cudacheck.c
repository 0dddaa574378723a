/* A CUDA workload in a few lines for the GPU-host proof (tools/gpuproof/run.sh; never shipped): run inside
 * a container started through driverd's runtime configuration and CDI spec, it dlopens the libcuda.so.1
 * the container was given, creates a context on every GPU and round-trips 64 MiB through its memory.
 * Exit 0 only when every GPU passed. Built on the build host: gcc -O2 -o cudacheck cudacheck.c -ldl */
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef int (*fn_i)(unsigned);
typedef int (*fn_pi)(int *);
typedef int (*fn_get)(int *, int);
typedef int (*fn_name)(char *, int, int);
typedef int (*fn_retain)(void **, int);
typedef int (*fn_rel)(int);
typedef int (*fn_set)(void *);
typedef int (*fn_alloc)(unsigned long long *, size_t);
typedef int (*fn_free)(unsigned long long);
typedef int (*fn_h2d)(unsigned long long, const void *, size_t);
typedef int (*fn_d2h)(void *, unsigned long long, size_t);
typedef int (*fn_err)(int, const char **);

#define SYM(t, n) t n = (t)dlsym(h, #n); if (!n) { fprintf(stderr, "missing %s\n", #n); return 2; }

static const char *ename(fn_err f, int rc) { const char *s = 0; if (f && f(rc, &s) == 0 && s) return s; return "?"; }

int main(void) {
    void *h = dlopen("libcuda.so.1", RTLD_NOW);
    if (!h) { printf("dlopen libcuda.so.1: %s\n", dlerror()); return 1; }
    fn_err cuGetErrorName = (fn_err)dlsym(h, "cuGetErrorName");
    SYM(fn_i, cuInit) SYM(fn_pi, cuDriverGetVersion) SYM(fn_pi, cuDeviceGetCount) SYM(fn_get, cuDeviceGet)
    SYM(fn_name, cuDeviceGetName) SYM(fn_name, cuDeviceGetPCIBusId) SYM(fn_retain, cuDevicePrimaryCtxRetain)
    SYM(fn_rel, cuDevicePrimaryCtxRelease_v2) SYM(fn_set, cuCtxSetCurrent) SYM(fn_alloc, cuMemAlloc_v2)
    SYM(fn_free, cuMemFree_v2) SYM(fn_h2d, cuMemcpyHtoD_v2) SYM(fn_d2h, cuMemcpyDtoH_v2)
    int rc = cuInit(0), ver = 0, n = 0, bad = 0;
    if (rc) { printf("cuInit: %s\n", ename(cuGetErrorName, rc)); return 1; }
    cuDriverGetVersion(&ver);
    cuDeviceGetCount(&n);
    printf("CUDA driver API %d, %d GPU(s)\n", ver, n);
    size_t sz = 64u << 20;
    unsigned char *a = malloc(sz), *b = malloc(sz);
    for (size_t i = 0; i < sz; i++) a[i] = (unsigned char)(i * 7 + 3);
    for (int i = 0; i < n; i++) {
        int d; void *ctx; unsigned long long p; char name[128], bus[32];
        cuDeviceGet(&d, i); cuDeviceGetName(name, sizeof name, d); cuDeviceGetPCIBusId(bus, sizeof bus, d);
        if ((rc = cuDevicePrimaryCtxRetain(&ctx, d)) || (rc = cuCtxSetCurrent(ctx)) || (rc = cuMemAlloc_v2(&p, sz))) {
            printf("GPU %d %s %s: %s\n", i, bus, name, ename(cuGetErrorName, rc)); bad++; continue;
        }
        memset(b, 0, sz);
        rc = cuMemcpyHtoD_v2(p, a, sz);
        if (!rc) rc = cuMemcpyDtoH_v2(b, p, sz);
        cuMemFree_v2(p);
        cuDevicePrimaryCtxRelease_v2(d);
        int same = !rc && memcmp(a, b, sz) == 0;
        printf("GPU %d %s %s: context ok, 64 MiB round trip %s\n", i, bus, name, rc ? ename(cuGetErrorName, rc) : same ? "ok" : "MISMATCH");
        bad += !same;
    }
    return bad ? 1 : 0;
}
