// A kernel and CUDA-runtime tracer for one process (CUPTI's activity API, as PyTorch's profiler uses
// it), for machines where Nsight Systems is missing: loaded with ctypes before the CUDA backend
// starts, `trace_start()` records every kernel, copy and runtime call until `trace_stop(path)` writes
// them as text lines "kind start_ns end_ns name" (kind K kernel, M copy, R runtime call).
// Build: nvcc -shared -Xcompiler -fPIC -o cupti_trace.so cupti_trace.c -lcupti
#include <cupti.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define BUF_SIZE (8 * 1024 * 1024)

static FILE *out = NULL;
static char **lines = NULL;
static size_t n_lines = 0, cap_lines = 0;

static void keep(const char *kind, unsigned long long start, unsigned long long end, const char *name) {
    char buf[512];
    snprintf(buf, sizeof buf, "%s %llu %llu %s", kind, start, end, name ? name : "?");
    if (n_lines == cap_lines) {
        cap_lines = cap_lines ? 2 * cap_lines : 65536;
        lines = (char **)realloc(lines, cap_lines * sizeof(char *));
    }
    lines[n_lines++] = strdup(buf);
}

static void CUPTIAPI on_request(uint8_t **buffer, size_t *size, size_t *max_records) {
    *buffer = (uint8_t *)aligned_alloc(8, BUF_SIZE);
    *size = BUF_SIZE;
    *max_records = 0;
}

static void CUPTIAPI on_complete(CUcontext ctx, uint32_t stream, uint8_t *buffer, size_t size, size_t valid) {
    CUpti_Activity *record = NULL;
    (void)ctx, (void)stream, (void)size;
    while (cuptiActivityGetNextRecord(buffer, valid, &record) == CUPTI_SUCCESS) {
        if (record->kind == CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL || record->kind == CUPTI_ACTIVITY_KIND_KERNEL) {
            CUpti_ActivityKernel10 *k = (CUpti_ActivityKernel10 *)record;
            keep("K", k->start, k->end, k->name);
        } else if (record->kind == CUPTI_ACTIVITY_KIND_MEMCPY) {
            CUpti_ActivityMemcpy6 *m = (CUpti_ActivityMemcpy6 *)record;
            char name[64];
            snprintf(name, sizeof name, "memcpy-kind%u-%llub", (unsigned)m->copyKind, (unsigned long long)m->bytes);
            keep("M", m->start, m->end, name);
        } else if (record->kind == CUPTI_ACTIVITY_KIND_RUNTIME || record->kind == CUPTI_ACTIVITY_KIND_DRIVER) {
            CUpti_ActivityAPI *a = (CUpti_ActivityAPI *)record;
            const char *name = NULL;
            cuptiGetCallbackName(record->kind == CUPTI_ACTIVITY_KIND_RUNTIME ? CUPTI_CB_DOMAIN_RUNTIME_API
                                                                             : CUPTI_CB_DOMAIN_DRIVER_API,
                                 a->cbid, &name);
            keep(record->kind == CUPTI_ACTIVITY_KIND_RUNTIME ? "R" : "D", a->start, a->end, name);
        }
    }
    free(buffer);
}

int trace_start(void) {
    if (cuptiActivityRegisterCallbacks(on_request, on_complete) != CUPTI_SUCCESS) return -1;
    if (cuptiActivityEnable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL) != CUPTI_SUCCESS) return -2;
    if (cuptiActivityEnable(CUPTI_ACTIVITY_KIND_MEMCPY) != CUPTI_SUCCESS) return -3;
    if (cuptiActivityEnable(CUPTI_ACTIVITY_KIND_RUNTIME) != CUPTI_SUCCESS) return -4;
    return 0;
}

unsigned long long trace_now(void) {
    uint64_t t = 0;
    cuptiGetTimestamp(&t);
    return (unsigned long long)t;
}

long trace_stop(const char *path) {
    cuptiActivityFlushAll(1);
    cuptiActivityDisable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL);
    cuptiActivityDisable(CUPTI_ACTIVITY_KIND_MEMCPY);
    cuptiActivityDisable(CUPTI_ACTIVITY_KIND_RUNTIME);
    out = fopen(path, "w");
    if (!out) return -1;
    for (size_t i = 0; i < n_lines; ++i) {
        fprintf(out, "%s\n", lines[i]);
        free(lines[i]);
    }
    fclose(out);
    long n = (long)n_lines;
    n_lines = 0;
    return n;
}
