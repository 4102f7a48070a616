/*
 * A fake CUDA driver (libcuda.so) for machines without a GPU: just enough of
 * the driver API, with the semantics the crate relies on, to run
 * tests/cuda.rs, tests/cuda_faults.rs and the examples on a CPU.
 *
 * - Device time is the host's monotonic clock. A kernel launched on a stream
 *   starts when the stream's earlier work ends; `sleep_ns` runs for its
 *   argument, `write_u32` faults the context (sticky CUDA_ERROR_ILLEGAL_ADDRESS)
 *   when it starts.
 * - Events record the time their stream's queued work ends; a query compares
 *   with now, a synchronize sleeps until then. An event never recorded is
 *   complete. Elapsed time refuses events created with DISABLE_TIMING.
 * - Every call on a stream, event, module or kernel needs a current context
 *   on the calling thread (CUDA_ERROR_INVALID_CONTEXT otherwise): that checks
 *   the crate binds the context on every thread, waiter threads included.
 *
 * It validates nothing of PTX or of real hardware; scripts/fake-cuda.sh
 * builds it and runs the CUDA tests against it.
 */
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

enum {
    SUCCESS = 0,
    INVALID_VALUE = 1,
    NO_DEVICE = 100,
    INVALID_CONTEXT = 201,
    INVALID_HANDLE = 400,
    NOT_FOUND = 500,
    NOT_READY = 600,
    ILLEGAL_ADDRESS = 700,
};

#define EVENT_DISABLE_TIMING 0x2

typedef struct { int64_t busy_until; } stream_t;
typedef struct { int recorded; int64_t at; unsigned flags; } event_t;

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static int context_tag;
static __thread void *current;
static stream_t default_stream;
static int64_t fault_at = INT64_MAX;
static int module_tag, sleep_tag, write_tag;

static int64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

static void sleep_until(int64_t deadline) {
    for (;;) {
        int64_t left = deadline - now_ns();
        if (left <= 0) return;
        struct timespec t = {left / 1000000000, left % 1000000000};
        nanosleep(&t, NULL);
    }
}

/* The sticky fault, once device time has reached it. */
static int faulted(void) { return now_ns() >= fault_at; }

static stream_t *stream_of(void *handle) {
    if (handle == NULL || handle == (void *)0x1 || handle == (void *)0x2) return &default_stream;
    return (stream_t *)handle;
}

/* Every call that needs a context and a healthy device starts here. */
#define CHECK()                                   \
    do {                                          \
        if (current == NULL) return INVALID_CONTEXT; \
        if (faulted()) return ILLEGAL_ADDRESS;    \
    } while (0)

int cuGetErrorName(int error, const char **name) {
    switch (error) {
    case SUCCESS: *name = "CUDA_SUCCESS"; break;
    case INVALID_VALUE: *name = "CUDA_ERROR_INVALID_VALUE"; break;
    case NO_DEVICE: *name = "CUDA_ERROR_NO_DEVICE"; break;
    case INVALID_CONTEXT: *name = "CUDA_ERROR_INVALID_CONTEXT"; break;
    case INVALID_HANDLE: *name = "CUDA_ERROR_INVALID_HANDLE"; break;
    case NOT_FOUND: *name = "CUDA_ERROR_NOT_FOUND"; break;
    case NOT_READY: *name = "CUDA_ERROR_NOT_READY"; break;
    case ILLEGAL_ADDRESS: *name = "CUDA_ERROR_ILLEGAL_ADDRESS"; break;
    default: return INVALID_VALUE;
    }
    return SUCCESS;
}

int cuGetErrorString(int error, const char **text) {
    const char *name;
    if (cuGetErrorName(error, &name) != SUCCESS) return INVALID_VALUE;
    *text = error == ILLEGAL_ADDRESS ? "an illegal memory access was encountered (fake driver)"
                                     : "reported by the fake driver";
    return SUCCESS;
}

int cuInit(unsigned flags) { (void)flags; return SUCCESS; }
int cuDriverGetVersion(int *version) { *version = 12000; return SUCCESS; }
int cuDeviceGetCount(int *count) { *count = 1; return SUCCESS; }

int cuDeviceGet(int *device, int ordinal) {
    if (ordinal != 0) return INVALID_VALUE;
    *device = 0;
    return SUCCESS;
}

int cuDeviceGetAttribute(int *value, int attribute, int device) {
    (void)attribute; (void)device;
    *value = 0;
    return SUCCESS;
}

int cuDevicePrimaryCtxRetain(void **context, int device) {
    (void)device;
    *context = &context_tag;
    return SUCCESS;
}

int cuDevicePrimaryCtxRelease_v2(int device) { (void)device; return SUCCESS; }
int cuCtxGetCurrent(void **context) { *context = current; return SUCCESS; }
int cuCtxSetCurrent(void *context) { current = context; return SUCCESS; }

int cuCtxSynchronize(void) {
    CHECK();
    pthread_mutex_lock(&lock);
    int64_t until = default_stream.busy_until;
    pthread_mutex_unlock(&lock);
    sleep_until(until);
    return faulted() ? ILLEGAL_ADDRESS : SUCCESS;
}

int cuStreamCreate(void **stream, unsigned flags) {
    (void)flags;
    if (current == NULL) return INVALID_CONTEXT;
    stream_t *created = calloc(1, sizeof *created);
    if (created == NULL) return INVALID_VALUE;
    *stream = created;
    return SUCCESS;
}

int cuStreamDestroy_v2(void *stream) {
    if (current == NULL) return INVALID_CONTEXT;
    if (stream_of(stream) != &default_stream) free(stream);
    return SUCCESS;
}

int cuStreamSynchronize(void *stream) {
    CHECK();
    pthread_mutex_lock(&lock);
    int64_t until = stream_of(stream)->busy_until;
    pthread_mutex_unlock(&lock);
    sleep_until(until < fault_at ? until : fault_at);
    return faulted() ? ILLEGAL_ADDRESS : SUCCESS;
}

int cuEventCreate(void **event, unsigned flags) {
    if (current == NULL) return INVALID_CONTEXT;
    if (faulted()) return ILLEGAL_ADDRESS;
    event_t *created = calloc(1, sizeof *created);
    if (created == NULL) return INVALID_VALUE;
    created->flags = flags;
    *event = created;
    return SUCCESS;
}

int cuEventRecord(void *event, void *stream) {
    CHECK();
    event_t *e = event;
    pthread_mutex_lock(&lock);
    stream_t *s = stream_of(stream);
    int64_t now = now_ns();
    e->at = s->busy_until > now ? s->busy_until : now;
    e->recorded = 1;
    pthread_mutex_unlock(&lock);
    return SUCCESS;
}

int cuEventQuery(void *event) {
    CHECK();
    event_t *e = event;
    pthread_mutex_lock(&lock);
    int done = !e->recorded || now_ns() >= e->at;
    pthread_mutex_unlock(&lock);
    return done ? SUCCESS : NOT_READY;
}

int cuEventSynchronize(void *event) {
    CHECK();
    event_t *e = event;
    pthread_mutex_lock(&lock);
    int64_t until = e->recorded ? e->at : 0;
    pthread_mutex_unlock(&lock);
    sleep_until(until < fault_at ? until : fault_at);
    return faulted() ? ILLEGAL_ADDRESS : SUCCESS;
}

int cuEventDestroy_v2(void *event) {
    if (current == NULL) return INVALID_CONTEXT;
    free(event);
    return SUCCESS;
}

/* Only the _v2 name, as a CUDA 13 header would call: the crate must find it. */
int cuEventElapsedTime_v2(float *ms, void *start, void *end) {
    CHECK();
    event_t *a = start, *b = end;
    if ((a->flags | b->flags) & EVENT_DISABLE_TIMING) return INVALID_HANDLE;
    if (!a->recorded || !b->recorded) return INVALID_HANDLE;
    int64_t now = now_ns();
    if (now < a->at || now < b->at) return NOT_READY;
    *ms = (float)((double)(b->at - a->at) / 1e6);
    return SUCCESS;
}

int cuStreamWaitEvent(void *stream, void *event, unsigned flags) {
    (void)flags;
    CHECK();
    event_t *e = event;
    pthread_mutex_lock(&lock);
    stream_t *s = stream_of(stream);
    if (e->recorded && e->at > s->busy_until) s->busy_until = e->at;
    pthread_mutex_unlock(&lock);
    return SUCCESS;
}

int cuModuleLoadData(void **module, const void *image) {
    CHECK();
    if (image == NULL || strstr((const char *)image, ".entry") == NULL) return INVALID_VALUE;
    *module = &module_tag;
    return SUCCESS;
}

int cuModuleGetFunction(void **function, void *module, const char *name) {
    CHECK();
    if (module != &module_tag) return INVALID_HANDLE;
    if (strcmp(name, "sleep_ns") == 0) *function = &sleep_tag;
    else if (strcmp(name, "write_u32") == 0) *function = &write_tag;
    else return NOT_FOUND;
    return SUCCESS;
}

int cuLaunchKernel(void *function, unsigned gx, unsigned gy, unsigned gz, unsigned bx,
                   unsigned by, unsigned bz, unsigned shared, void *stream, void **params,
                   void **extra) {
    (void)gx; (void)gy; (void)gz; (void)bx; (void)by; (void)bz; (void)shared; (void)extra;
    CHECK();
    if (params == NULL || params[0] == NULL) return INVALID_VALUE;
    uint64_t argument = *(uint64_t *)params[0];
    pthread_mutex_lock(&lock);
    stream_t *s = stream_of(stream);
    int64_t now = now_ns();
    int64_t start = s->busy_until > now ? s->busy_until : now;
    if (function == &sleep_tag) {
        s->busy_until = start + (int64_t)argument;
    } else if (function == &write_tag) {
        if (argument < 4096 && start < fault_at) fault_at = start;
        s->busy_until = start;
    } else {
        pthread_mutex_unlock(&lock);
        return INVALID_HANDLE;
    }
    pthread_mutex_unlock(&lock);
    return SUCCESS;
}
