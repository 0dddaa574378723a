/* Stand-ins of NVIDIA's libnvidia-ml.so.1 and libcuda.so.1 for driverd's tests (never shipped): built by
 * tests/cudastandin/__init__.py with -D settings per scenario. Like the real libraries they compare their
 * own version with the loaded kernel module's (/proc/driver/nvidia/version of the test's host tree,
 * STANDIN_RM_FILE) and refuse on a difference: NVML with LIB_RM_VERSION_MISMATCH (18), cuInit with
 * CUDA_ERROR_SYSTEM_DRIVER_MISMATCH (803). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#ifndef STANDIN_VERSION
#error STANDIN_VERSION
#endif
#ifndef STANDIN_BUSIDS
#define STANDIN_BUSIDS ""
#endif

/* 0: no driver loaded (no version file), 1: matches, 2: another version is loaded */
static int rm_state(void) {
    FILE *f = fopen(STANDIN_RM_FILE, "r");
    char buf[512] = {0};
    if (!f) return 0;
    size_t n = fread(buf, 1, sizeof buf - 1, f);
    fclose(f);
    buf[n] = 0;
    return strstr(buf, "  " STANDIN_VERSION " ") ? 1 : 2;
}

static int busids(char out[][32], int max) {
    char copy[1024];
    int n = 0;
    strncpy(copy, STANDIN_BUSIDS, sizeof copy - 1);
    copy[sizeof copy - 1] = 0;
    for (char *t = strtok(copy, ","); t && n < max; t = strtok(NULL, ",")) {
        strncpy(out[n], t, 31);
        out[n][31] = 0;
        n++;
    }
    return n;
}

/* "0000:3b:00.0" -> "0000:3B:00.0" (how CUDA prints it) or "00000000:3B:00.0" (NVML) */
static void upper_bus(const char *in, char *out, size_t len, int nvml_width) {
    char tmp[64];
    snprintf(tmp, sizeof tmp, nvml_width ? "0000%s" : "%s", in);
    for (size_t i = 0; i < len - 1 && tmp[i]; i++) out[i] = (tmp[i] >= 'a' && tmp[i] <= 'f') ? tmp[i] - 32 : tmp[i];
    out[strlen(tmp) < len ? strlen(tmp) : len - 1] = 0;
}
