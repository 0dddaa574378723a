#include "standin.h"

typedef struct {
    char busIdLegacy[16];
    unsigned int domain, bus, device, pciDeviceId, pciSubSystemId;
    char busId[32];
} nvmlPciInfo_t;
typedef struct {
    unsigned char clusterUuid[16];
    int status;
    unsigned int cliqueId;
    unsigned char state;
} nvmlGpuFabricInfo_t;

static char ids[16][32];
static int ngpus;

int nvmlInitWithFlags(unsigned int flags) {
    (void)flags;
    switch (rm_state()) {
    case 0: return 9;           /* NVML_ERROR_DRIVER_NOT_LOADED */
    case 2: return 18;          /* NVML_ERROR_LIB_RM_VERSION_MISMATCH */
    }
    ngpus = busids(ids, 16);
    return 0;
}
int nvmlInit_v2(void) { return nvmlInitWithFlags(0); }
int nvmlInit(void) { return nvmlInitWithFlags(0); }
int nvmlShutdown(void) { return 0; }
const char *nvmlErrorString(int rc) {
    switch (rc) {
    case 9: return "Driver Not Loaded";
    case 18: return "RM has detected an NVML/RM version mismatch.";
    default: return "Unknown Error";
    }
}
int nvmlSystemGetDriverVersion(char *buf, unsigned int len) { snprintf(buf, len, "%s", STANDIN_VERSION); return 0; }
int nvmlSystemGetCudaDriverVersion(int *v) { *v = 12020; return 0; }
int nvmlSystemGetCudaDriverVersion_v2(int *v) { *v = 12020; return 0; }
int nvmlDeviceGetCount_v2(unsigned int *c) { *c = ngpus; return 0; }
int nvmlDeviceGetHandleByIndex_v2(unsigned int i, void **h) {
    if ((int)i >= ngpus) return 2;  /* NVML_ERROR_INVALID_ARGUMENT */
    *h = (void *)(long)(i + 1);
    return 0;
}
int nvmlDeviceGetPciInfo_v3(void *h, nvmlPciInfo_t *p) {
    int i = (int)(long)h - 1;
    memset(p, 0, sizeof *p);
    upper_bus(ids[i], p->busId, sizeof p->busId, 1);
    return 0;
}
int nvmlDeviceGetPersistenceMode(void *h, int *mode) {
    (void)h;
#ifdef STANDIN_PERSISTENCE_OFF
    *mode = 0;                  /* NVML_FEATURE_DISABLED */
#else
    *mode = 1;                  /* NVML_FEATURE_ENABLED */
#endif
    return 0;
}
int nvmlDeviceGetGpuFabricInfo(void *h, nvmlGpuFabricInfo_t *f) {
    (void)h;
#ifdef STANDIN_FABRIC_STATE
    memset(f, 0, sizeof *f);
    f->state = STANDIN_FABRIC_STATE;
    f->status = 0;
    return 0;
#else
    (void)f;
    return 3;                   /* NVML_ERROR_NOT_SUPPORTED: no NVSwitch fabric */
#endif
}
