/*
 * A fake CUDA driver (libcuda.so) for machines without a GPU: enough of the
 * driver API, with the semantics the crate relies on, to run tests/cuda.rs,
 * tests/cuda_faults.rs, tests/cuda_memory.rs and the examples on a CPU, and
 * a user's crate's CUDA path, device memory and copies included
 * (docs/testing.md). Where the crate's correctness depends on a driver
 * rule, the fake keeps that rule at least as strictly as the real driver; each rule cites the CUDA driver API reference
 * (https://docs.nvidia.com/cuda/cuda-driver-api/, "Modules"), CUDA 12 and 13.
 *
 * - Two devices, each with a primary context. Retain and release are
 *   counted; the context is torn down on the last release, and its handles
 *   are then refused (cuDevicePrimaryCtxRelease: "the primary context is
 *   destroyed when its usage count reaches zero").
 * - The current context is per host thread (cuCtxSetCurrent: "binds the
 *   specified CUDA context to the calling CPU thread"). A context torn down
 *   stays current on the threads that had it, and every call there fails
 *   with CUDA_ERROR_CONTEXT_IS_DESTROYED (cuCtxDestroy: "If the context is
 *   current to other threads, then the context will remain current to those
 *   threads, and attempting to access the context from those threads will
 *   result in the error CUDA_ERROR_CONTEXT_IS_DESTROYED").
 *   Once the device's primary context is retained anew (under the same
 *   handle), what those threads' old binding does is a thing the docs are
 *   silent on: by default the fake does what the real driver did when
 *   measured (an H200, driver 13000): calls through the old binding
 *   succeed again. FAKE_CUDA_STRICT_REBIND=1 takes the strict reading
 *   instead: CUDA_ERROR_CONTEXT_IS_DESTROYED until cuCtxSetCurrent binds
 *   again. scripts/fake-cuda.sh runs the CUDA tests in both modes.
 * - Every call on a
 *   stream, event, module or kernel is refused with
 *   CUDA_ERROR_INVALID_CONTEXT unless that handle's own context is current:
 *   stricter than the driver, which checks this for some calls only, so a
 *   crate that forgets to bind (on a waiter thread, say) fails here.
 *   cuStreamWaitEvent is the exception the docs make: "hEvent may be from a
 *   different context or device than hStream". Device memory calls are the
 *   other (see "Device memory and copies"): they take the context their
 *   stream or device address names.
 * - Handles of two contexts in one call: cuEventRecord with an event and a
 *   stream of different contexts, and cuEventElapsedTime (either name) with
 *   events of different contexts, are CUDA_ERROR_INVALID_HANDLE whichever
 *   context is current, checked before the current context is (cuEventRecord:
 *   "hEvent and hStream must be from the same context"; the status is the
 *   one the real driver returned, measured on an H200, driver 13000).
 * - cuCtxGetId gives each context a number unique for the life of the
 *   process (cuCtxGetId: "The Id is unique for the life of the program for
 *   this instance of CUDA"): a primary context made again under the same
 *   handle gets a new one.
 * - Device time is the host's monotonic clock. Work launched on a stream
 *   starts when the stream's earlier work ends; `sleep_ns` runs for its
 *   argument, `write_u32` to an address below 4096 faults its context
 *   (CUDA_ERROR_ILLEGAL_ADDRESS) when it starts.
 * - After a sticky fault every call on that context fails with it, binding
 *   it current and destroying its handles included ("This leaves the process
 *   in an inconsistent state and any further CUDA work will return the same
 *   error"); a destroy still frees the handle.
 * - Events record when their stream's queued work ends; a query compares
 *   with now, a synchronize sleeps until then. An event never recorded is
 *   complete (cuEventQuery). Elapsed time refuses DISABLE_TIMING events and
 *   answers CUDA_ERROR_NOT_READY unless both events are complete
 *   (cuEventElapsedTime), under both names real drivers export.
 * - Default streams (cuda.h, "Stream handles"): NULL and CU_STREAM_LEGACY
 *   (0x1) are the context's legacy default stream, which waits for all
 *   blocking streams of its context and which they wait for;
 *   CU_STREAM_PER_THREAD (0x2) is the calling thread's own default stream
 *   (blocking, so it also orders with the legacy stream). Streams created
 *   with CU_STREAM_NON_BLOCKING (cudarc's) do neither.
 * - Stream capture and graphs: see "Stream capture" below.
 * - cuCtxSynchronize waits for every stream of the current context, and so
 *   does cuModuleLoadData, with every other call held until it returns (see
 *   there).
 * - Lazy loading (the default on Linux since CUDA 12.2; CUDA C++ Programming
 *   Guide, "Lazy Loading"): a function from cuModuleGetFunction is loaded at
 *   its first launch, with the same wait as a module load, unless cuFuncLoad
 *   loaded it first or CUDA_MODULE_LOADING=EAGER (see cuLaunchKernel).
 *
 * - Process exit (see "Driver teardown" below): cuInit registers an exit
 *   handler (FAKE_CUDA_TEARDOWN_AT_HOST_ALLOC=1: the first cuMemHostAlloc
 *   does) after which every call returns CUDA_ERROR_DEINITIALIZED; on
 *   demand it frees the contexts' memory too (fakeCudaTeardownFrees).
 * - Elapsed time under both names, each counted (see "Elapsed time" below);
 *   built with -DFAKE_CUDA_NO_ELAPSED_V2 it exports only the legacy name.
 *   A test sets the next time a thread reads (fakeCudaNextElapsed).
 * - cuEventRecord numbers the records of each stream (see "Record order").
 * - Page-locked, device-mapped host memory and cuStreamWriteValue64, each
 *   refusable on demand (see "Host-mapped memory and stream writes").
 * - Device memory (synchronous and stream-ordered allocation and free),
 *   copies host to device, device to host and device to device (and
 *   between contexts), and sets, synchronous and Async, made in stream
 *   order by the copy engine thread and waited for as the driver's "API
 *   synchronization behavior" page says; no event or synchronize reports
 *   work done before the bytes queued ahead of it are there (see "Device
 *   memory and copies").
 *
 * Test hooks (not driver API): fakeCudaLiveEvents(device),
 * fakeCudaEventsCreated(device), fakeCudaPrimaryRetains(device), how
 * often a primary context was made and asked about (fakeCudaPrimaryMade,
 * fakeCudaPrimaryStateAsks),
 * fakeCudaFailNextQuery(status), the flags of this thread's last event
 * made (fakeCudaLastEventFlags), and the capture races of "Stream capture"
 * (fakeCudaCaptureInNextRecord, fakeCudaLastRecordCapture), a record
 * refused (fakeCudaFailNextRecord) or held in the call
 * (fakeCudaHoldNextRecord, fakeCudaRecordHeld), the
 * stream writes' refusals and counts (fakeCudaRefuseProgressWord,
 * fakeCudaHostAllocations, fakeCudaStreamWrites, fakeCudaWritesAfterFree,
 * fakeCudaPendingWrites, fakeCudaHostMemoryCalls), a write held in the call
 * (fakeCudaHoldNextWrite, fakeCudaWriteHeld), page-locked calls that
 * synchronize (fakeCudaHostMemorySynchronizes), a word write captured
 * unseen (fakeCudaCaptureNextWordWrite, fakeCudaLaunchRaceGraph), and the
 * live device allocations (fakeCudaDeviceAllocations), found by the tests
 * with dlsym.
 *
 * It validates nothing of PTX or of real hardware; scripts/fake-cuda.sh
 * builds it and runs the CUDA tests against it.
 */
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

enum {
    SUCCESS = 0,
    INVALID_VALUE = 1,
    OUT_OF_MEMORY = 2,
    DEINITIALIZED = 4,
    NO_DEVICE = 100,
    INVALID_DEVICE = 101,
    INVALID_CONTEXT = 201,
    INVALID_HANDLE = 400,
    NOT_FOUND = 500,
    NOT_READY = 600,
    ILLEGAL_ADDRESS = 700,
    NOT_SUPPORTED = 801,
    CONTEXT_IS_DESTROYED = 709,
    ILLEGAL_STATE = 401,
    STREAM_CAPTURE_UNSUPPORTED = 900,
    STREAM_CAPTURE_INVALIDATED = 901,
    STREAM_CAPTURE_MERGE = 902,
    STREAM_CAPTURE_ISOLATION = 905,
    STREAM_CAPTURE_IMPLICIT = 906,
    CAPTURED_EVENT = 907,
    STREAM_CAPTURE_WRONG_THREAD = 908,
};

#define DEVICES 2
#define EVENT_DISABLE_TIMING 0x2
#define STREAM_NON_BLOCKING 0x1
#define STREAM_LEGACY ((void *)0x1)
#define STREAM_PER_THREAD ((void *)0x2)

typedef struct ctx ctx_t;

typedef enum { CREATED, LEGACY, PER_THREAD } stream_kind;

typedef struct stream {
    ctx_t *ctx;
    stream_kind kind;
    unsigned flags;
    pthread_t owner; /* for PER_THREAD */
    int64_t busy_until;
    int capture; /* the capture it is part of (see "Stream capture"), or 0 */
    int records; /* cuEventRecord calls on it (see "Record order") */
    struct stream *next;
} stream_t;

struct ctx {
    int device;
    int retains;
    int generation; /* bumped on each teardown */
    int64_t fault_at;
    stream_t legacy;
    stream_t *streams; /* created and per-thread streams */
    int live_events;
    int created_events;
    int switches; /* cuCtxSetCurrent calls that made it current */
    int made;     /* retains that made the primary context (from none) */
    int state_asks; /* cuDevicePrimaryCtxGetState calls about it */
};

typedef struct {
    ctx_t *ctx;
    int generation;
    int recorded;
    int64_t at;
    unsigned flags;
    int capture; /* the capture its last record was made in, or 0 */
} event_t;

typedef struct { ctx_t *ctx; int generation; } module_t;
typedef struct { module_t *module; int kind; int loaded; } function_t;
enum { SLEEP_NS = 1, WRITE_U32 = 2 };

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static ctx_t contexts[DEVICES] = {
    {.device = 0, .fault_at = INT64_MAX},
    {.device = 1, .fault_at = INT64_MAX},
};
static __thread ctx_t *current;
/* The generation of `current` when this thread bound it. */
static __thread int bound_generation;
/* Test hook: the status the next cuEventQuery returns (0: none injected). */
static int next_query_status;

/* ---- Driver teardown at process exit ----
 * The real driver tears itself down in an exit handler while the process's
 * other threads still run, and answers them with CUDA_ERROR_DEINITIALIZED:
 * "This indicates that the CUDA driver is in the process of shutting down"
 * (CUresult, https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__TYPES.html).
 * The fake registers its handler at cuInit (the docs do not say when a driver
 * does: with FAKE_CUDA_TEARDOWN_AT_HOST_ALLOC=1, at the first page-locked
 * allocation, as it returns); from then on every call returns
 * 4 (the error lookups excepted: they name it), and calls blocked in a
 * synchronize return it too. fakeCudaTeardown() starts the same teardown
 * now, for a test; fakeCudaCallsAfterTeardown() counts the calls answered
 * after it (a synchronize blocked across it, answered as it ends, counts).
 * What the teardown does to the process's page-locked memory the docs do not
 * say: by default it stays mapped; after fakeCudaTeardownFrees(1) (which
 * returns the previous setting) the teardown frees every context's memory,
 * as a context's destruction does ("Destroy all allocations",
 * cuDevicePrimaryCtxReset), and a read of a freed word faults (see
 * "Host-mapped memory and stream writes"). The crate must be right under
 * both. */
static atomic_int torn_down;
static atomic_int calls_after_teardown;
static atomic_int teardown_frees;
static pthread_once_t teardown_registered = PTHREAD_ONCE_INIT;
static int teardown_at_host_alloc;

static void free_context_memory(ctx_t *c);

static void teardown(void) {
    atomic_store(&torn_down, 1);
    if (!atomic_load(&teardown_frees)) return;
    pthread_mutex_lock(&lock);
    for (int device = 0; device < DEVICES; device++) free_context_memory(&contexts[device]);
    pthread_mutex_unlock(&lock);
    /* A real teardown is not instant: it destroys every context. This one
     * lasts 50 ms past the free, so a thread that still reads freed memory
     * faults before the process is gone. */
    usleep(50000);
}
static void register_teardown(void) { atexit(teardown); }

/* ---- Fork ----
 * "CUDA does not duplicate any of its internal data structures or threads
 * to other processes upon a call to fork. Any use of CUDA after a call to
 * fork and before a subsequent call to exec has undefined behavior"
 * (NVIDIA's CUDA C++ guidelines). The fake notes the process that called
 * cuInit, and a call from a fork of it (through any entry point that asks
 * whether the driver is shut down: nearly all) aborts that process, so a
 * test sees it. */
static atomic_int init_pid;

static void forked_call(void) {
    int pid = atomic_load(&init_pid);
    if (pid != 0 && pid != (int)getpid()) {
        static const char why[] = "fake libcuda: a CUDA call in a forked child\n";
        (void)!write(2, why, sizeof why - 1);
        abort();
    }
}
/* ---- end of fork ---- */

/* Whether the driver is shut down; counts the call that asked. */
static int deinitialized(void) {
    forked_call();
    if (!atomic_load(&torn_down)) return 0;
    atomic_fetch_add(&calls_after_teardown, 1);
    return 1;
}

int fakeCudaTeardown(int unused) {
    (void)unused;
    teardown();
    return 0;
}

int fakeCudaTeardownFrees(int frees) { return atomic_exchange(&teardown_frees, frees); }

int fakeCudaCallsAfterTeardown(int unused) {
    (void)unused;
    return atomic_load(&calls_after_teardown);
}
/* ---- end of driver teardown ---- */

static int64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

static void sleep_until(int64_t deadline) {
    for (;;) {
        int64_t left = deadline - now_ns();
        if (left <= 0 || atomic_load(&torn_down)) return;
        /* In slices of at most 1 ms, so a teardown ends the sleep. */
        if (left > 1000000) left = 1000000;
        struct timespec t = {left / 1000000000, left % 1000000000};
        nanosleep(&t, NULL);
    }
}

static int64_t max64(int64_t a, int64_t b) { return a > b ? a : b; }
static int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

/* The sticky fault, once device time has reached it. */
static int faulted(const ctx_t *c) { return now_ns() >= c->fault_at; }

static int is_context(const void *handle) {
    for (int d = 0; d < DEVICES; d++)
        if (handle == &contexts[d]) return 1;
    return 0;
}

/* Rebinding after a primary context is made again (see the header): 0 by
 * default, as the real driver measured; FAKE_CUDA_STRICT_REBIND=1 makes a
 * thread's binding to a torn-down context refused until it binds again. */
static int strict_rebind;
/* FAKE_CUDA_NO_MEMORY_POOLS=1: no stream-ordered allocation (see "Device
 * memory and copies"). */
static int no_memory_pools;

__attribute__((constructor)) static void read_modes(void) {
    const char *strict = getenv("FAKE_CUDA_STRICT_REBIND");
    strict_rebind = strict != NULL && strcmp(strict, "1") == 0;
    const char *pools = getenv("FAKE_CUDA_NO_MEMORY_POOLS");
    no_memory_pools = pools != NULL && strcmp(pools, "1") == 0;
    const char *at_alloc = getenv("FAKE_CUDA_TEARDOWN_AT_HOST_ALLOC");
    teardown_at_host_alloc = at_alloc != NULL && strcmp(at_alloc, "1") == 0;
}

/* Whether this thread's binding of `c` is to a context torn down since: in
 * the lenient mode, only while no context has been made again under it. */
static int stale_binding(const ctx_t *c) {
    if (bound_generation == c->generation) return 0;
    return strict_rebind || c->retains == 0;
}

/* A handle of context `c` (made in `generation`) may be used now. */
static int usable(const ctx_t *c, int generation) {
    if (deinitialized()) return DEINITIALIZED;
    if (current == NULL || current != c) return INVALID_CONTEXT;
    if (stale_binding(c)) return CONTEXT_IS_DESTROYED;
    if (c->retains == 0 || c->generation != generation) return CONTEXT_IS_DESTROYED;
    if (faulted(c)) return ILLEGAL_ADDRESS;
    return SUCCESS;
}

/* The current context, ready for work. */
static int current_usable(void) {
    if (deinitialized()) return DEINITIALIZED;
    if (current == NULL) return INVALID_CONTEXT;
    return usable(current, current->generation);
}

/* The stream a handle names on this thread, in the current context; NULL if
 * the handle is a created stream of another (or no) current context. Called
 * with the lock held. */
static stream_t *stream_of(void *handle) {
    if (current == NULL) return NULL;
    if (handle == NULL || handle == STREAM_LEGACY) return &current->legacy;
    if (handle == STREAM_PER_THREAD) {
        pthread_t self = pthread_self();
        for (stream_t *s = current->streams; s; s = s->next)
            if (s->kind == PER_THREAD && pthread_equal(s->owner, self)) return s;
        stream_t *s = calloc(1, sizeof *s);
        if (s == NULL) return NULL;
        s->ctx = current;
        s->kind = PER_THREAD;
        s->owner = self;
        s->next = current->streams;
        current->streams = s;
        return s;
    }
    stream_t *s = handle;
    return s->ctx == current ? s : NULL;
}

static int blocking(const stream_t *s) {
    return s->kind == PER_THREAD || (s->kind == CREATED && !(s->flags & STREAM_NON_BLOCKING));
}

/* When new work on `s` may start: after its own work, and after what the
 * legacy default stream orders it behind. Called with the lock held. */
static int64_t ready_at(const stream_t *s) {
    int64_t at = max64(now_ns(), s->busy_until);
    const ctx_t *c = s->ctx;
    if (s->kind == LEGACY) {
        for (const stream_t *o = c->streams; o; o = o->next)
            if (blocking(o)) at = max64(at, o->busy_until);
    } else if (blocking(s)) {
        at = max64(at, c->legacy.busy_until);
    }
    return at;
}

/*
 * Stream capture (cuStreamBeginCapture_v2, cuStreamEndCapture,
 * cuStreamIsCapturing, cuThreadExchangeStreamCaptureMode; driver API
 * "Stream Management"), with the rules an H200 on driver 13.0 showed:
 * - Work and records on a capturing stream are captured, not run: an event
 *   recorded there is a node of the graph. Querying or synchronizing it while
 *   the capture goes on is CUDA_ERROR_CAPTURED_EVENT ("the operation is not
 *   permitted on an event which was last recorded in a capturing stream"),
 *   and the query invalidates the capture (measured); once the capture has
 *   ended (or was invalidated), the event is CUDA_ERROR_INVALID_VALUE until
 *   recorded again outside a capture (measured).
 * - A capturing stream waiting on an event recorded outside the capture is
 *   CUDA_ERROR_STREAM_CAPTURE_ISOLATION ("a dependency would have been
 *   created which crosses the capture sequence boundary"), on an event of
 *   another capture CUDA_ERROR_STREAM_CAPTURE_MERGE ("would have resulted in
 *   a merge of two independent capture sequences"); both invalidate the
 *   captures involved (measured). A stream that is not capturing and waits
 *   on an event of an ongoing capture joins that capture.
 * - "Potentially unsafe API calls" (here cuEventQuery, cuEventSynchronize,
 *   cuStreamSynchronize, cuCtxSynchronize and cuEventElapsedTime; measured:
 *   cuEventCreate, cuEventRecord, cuEventDestroy, cuStreamWaitEvent on other
 *   streams, cuStreamIsCapturing and cuCtxSetCurrent are not) are
 *   prohibited by cuThreadExchangeStreamCaptureMode's rules: in
 *   CU_STREAM_CAPTURE_MODE_GLOBAL (every thread's default) "if the local
 *   thread has an ongoing capture sequence that was not initiated with
 *   CU_STREAM_CAPTURE_MODE_RELAXED at cuStreamBeginCapture, or if any other
 *   thread has a concurrent capture sequence initiated with
 *   CU_STREAM_CAPTURE_MODE_GLOBAL, this thread is prohibited from potentially
 *   unsafe API calls"; in THREAD_LOCAL only the first half applies; RELAXED
 *   "is not prohibited". A prohibited call returns
 *   CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED and invalidates the captures that
 *   prohibit it (measured); cuStreamEndCapture then answers
 *   CUDA_ERROR_STREAM_CAPTURE_INVALIDATED. cuEventElapsedTime is in the
 *   list on the strict reading (not measured).
 * - cuStreamEndCapture of a capture begun in a mode other than RELAXED must
 *   come from the thread that began it (CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD).
 *   A graph launched later runs its captured sleeps back to back.
 * - cuStreamGetCaptureInfo_v2 gives the status and the capture's id, "unique
 *   over the lifetime of the process", valid only while the status is
 *   ACTIVE; its other outputs are optional. It and cuStreamIsCapturing,
 *   called on the legacy stream while a blocking stream of its context
 *   captures, return CUDA_ERROR_STREAM_CAPTURE_IMPLICIT ("If called on
 *   CU_STREAM_LEGACY (the NULL stream) while a stream not created with
 *   CU_STREAM_NON_BLOCKING is capturing"); so do records, waits, launches
 *   and synchronizes there ("a disallowed implicit dependency on a current
 *   capture sequence from cudaStreamLegacy", CUresult), invalidating that
 *   capture (the strict reading: a capture the crate breaks fails a test).
 * - Races another thread could make, made repeatable (test hooks):
 *   fakeCudaCaptureInNextRecord(1) ends, right after the calling thread's
 *   next captured cuEventRecord, the capture that took it (as a thread
 *   ending it then would); (2) begins a relaxed capture of the stream just
 *   before the next record and ends it just after, all inside the call;
 *   (3) begins it there and leaves it going on (ended by the test).
 *   fakeCudaLastRecordCapture() is the capture id that took the calling
 *   thread's last record (0: none), the truth for a test to check against.
 */
enum { CAPTURE_NONE = 0, CAPTURE_ACTIVE = 1, CAPTURE_INVALIDATED = 2, CAPTURE_ENDED = 3 };
enum { MODE_GLOBAL = 0, MODE_THREAD_LOCAL = 1, MODE_RELAXED = 2 };
#define CAPTURES 65536

/* A cuStreamWriteValue64 captured into a graph: where and what, and when in
 * the graph's run (the captured sleeps before it). */
typedef struct {
    unsigned long long *host;
    unsigned long long value;
    int64_t offset;
} graph_write_t;

typedef struct {
    int state;
    int mode;
    pthread_t owner;
    int64_t duration; /* of the sleeps captured */
    graph_write_t *writes; /* the word writes captured, in order */
    int nwrites, capacity;
} capture_t;

typedef struct {
    ctx_t *ctx;
    int64_t duration;
    graph_write_t *writes;
    int nwrites;
} graph_t;

/* Indexed by capture id; 0 is "none". */
static capture_t captures[CAPTURES];
static int next_capture = 1;
static __thread int capture_mode = MODE_GLOBAL;

/* Whether capture `id` has begun and not ended. Called with the lock held. */
static int ongoing(int id) {
    return id > 0 && (captures[id].state == CAPTURE_ACTIVE || captures[id].state == CAPTURE_INVALIDATED);
}

static void invalidate(int id) {
    if (id > 0 && captures[id].state == CAPTURE_ACTIVE) captures[id].state = CAPTURE_INVALIDATED;
}

/* A potentially unsafe call on this thread: CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED
 * when prohibited, invalidating the captures that prohibit it. Called with
 * the lock held. */
static int unsafe_call(void) {
    if (capture_mode == MODE_RELAXED) return SUCCESS;
    pthread_t self = pthread_self();
    int prohibited = 0;
    for (int id = 1; id < next_capture; id++) {
        if (!ongoing(id)) continue;
        capture_t *c = &captures[id];
        int mine = pthread_equal(c->owner, self);
        if ((mine && c->mode != MODE_RELAXED) ||
            (!mine && c->mode == MODE_GLOBAL && capture_mode == MODE_GLOBAL)) {
            invalidate(id);
            prohibited = 1;
        }
    }
    return prohibited ? STREAM_CAPTURE_UNSUPPORTED : SUCCESS;
}

/* The capture a blocking stream of `s`'s context makes, when `s` is the
 * legacy stream (see above), or 0. Called with the lock held. */
static int implicit_capture(const stream_t *s) {
    if (s->kind != LEGACY) return 0;
    for (const stream_t *o = s->ctx->streams; o; o = o->next)
        if (blocking(o) && ongoing(o->capture)) return o->capture;
    return 0;
}

/* Work or a wait on `s` (the legacy stream) that would depend on a capture
 * implicitly: CUDA_ERROR_STREAM_CAPTURE_IMPLICIT, invalidating it. Called
 * with the lock held. */
static int implicit_dependency(const stream_t *s) {
    int id = implicit_capture(s);
    if (id == 0) return SUCCESS;
    invalidate(id);
    return STREAM_CAPTURE_IMPLICIT;
}

/* A query or synchronize of `e`: refused if its last record was captured.
 * Called with the lock held. */
static int captured_event_use(const event_t *e) {
    if (e->capture == 0) return SUCCESS;
    if (captures[e->capture].state == CAPTURE_ACTIVE) {
        invalidate(e->capture);
        return CAPTURED_EVENT;
    }
    return INVALID_VALUE;
}

/* Work queued on `s`: 1 if it is captured instead of run (adding `sleep` to
 * the capture), 0 if it runs, or a negative status. Called with the lock
 * held. */
static int captured_work(const stream_t *s, int64_t sleep) {
    if (!ongoing(s->capture)) return 0;
    if (captures[s->capture].state == CAPTURE_INVALIDATED) return -STREAM_CAPTURE_INVALIDATED;
    captures[s->capture].duration += sleep;
    return 1;
}

/* cuStreamWaitEvent under capture: 1 when handled (joined, or within one
 * capture), 0 for an ordinary wait, or a negative status. Called with the
 * lock held. */
static int capture_wait(stream_t *s, const event_t *e) {
    if (ongoing(s->capture)) {
        if (captures[s->capture].state == CAPTURE_INVALIDATED) return -STREAM_CAPTURE_INVALIDATED;
        if (e->capture == s->capture) return 1;
        if (ongoing(e->capture)) {
            invalidate(e->capture);
            invalidate(s->capture);
            return -STREAM_CAPTURE_MERGE;
        }
        if (e->capture != 0) return -INVALID_VALUE;
        invalidate(s->capture);
        return -STREAM_CAPTURE_ISOLATION;
    }
    if (e->capture == 0) return 0;
    if (!ongoing(e->capture)) return -INVALID_VALUE;
    s->capture = e->capture;
    return 1;
}

int cuGetErrorName(int error, const char **name) {
    switch (error) {
    case SUCCESS: *name = "CUDA_SUCCESS"; break;
    case INVALID_VALUE: *name = "CUDA_ERROR_INVALID_VALUE"; break;
    case OUT_OF_MEMORY: *name = "CUDA_ERROR_OUT_OF_MEMORY"; break;
    case NOT_SUPPORTED: *name = "CUDA_ERROR_NOT_SUPPORTED"; break;
    case DEINITIALIZED: *name = "CUDA_ERROR_DEINITIALIZED"; break;
    case NO_DEVICE: *name = "CUDA_ERROR_NO_DEVICE"; break;
    case INVALID_DEVICE: *name = "CUDA_ERROR_INVALID_DEVICE"; break;
    case INVALID_CONTEXT: *name = "CUDA_ERROR_INVALID_CONTEXT"; break;
    case INVALID_HANDLE: *name = "CUDA_ERROR_INVALID_HANDLE"; break;
    case NOT_FOUND: *name = "CUDA_ERROR_NOT_FOUND"; break;
    case NOT_READY: *name = "CUDA_ERROR_NOT_READY"; break;
    case ILLEGAL_ADDRESS: *name = "CUDA_ERROR_ILLEGAL_ADDRESS"; break;
    case CONTEXT_IS_DESTROYED: *name = "CUDA_ERROR_CONTEXT_IS_DESTROYED"; break;
    case ILLEGAL_STATE: *name = "CUDA_ERROR_ILLEGAL_STATE"; break;
    case STREAM_CAPTURE_UNSUPPORTED: *name = "CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED"; break;
    case STREAM_CAPTURE_INVALIDATED: *name = "CUDA_ERROR_STREAM_CAPTURE_INVALIDATED"; break;
    case STREAM_CAPTURE_MERGE: *name = "CUDA_ERROR_STREAM_CAPTURE_MERGE"; break;
    case STREAM_CAPTURE_ISOLATION: *name = "CUDA_ERROR_STREAM_CAPTURE_ISOLATION"; break;
    case STREAM_CAPTURE_IMPLICIT: *name = "CUDA_ERROR_STREAM_CAPTURE_IMPLICIT"; break;
    case CAPTURED_EVENT: *name = "CUDA_ERROR_CAPTURED_EVENT"; break;
    case STREAM_CAPTURE_WRONG_THREAD: *name = "CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD"; break;
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

int cuInit(unsigned flags) {
    (void)flags;
    if (deinitialized()) return DEINITIALIZED;
    int none = 0;
    atomic_compare_exchange_strong(&init_pid, &none, (int)getpid());
    if (!teardown_at_host_alloc) pthread_once(&teardown_registered, register_teardown);
    return SUCCESS;
}
int cuDriverGetVersion(int *version) { *version = 12080; return SUCCESS; }
int cuDeviceGetCount(int *count) {
    if (deinitialized()) return DEINITIALIZED;
    *count = DEVICES;
    return SUCCESS;
}

int cuDeviceGet(int *device, int ordinal) {
    if (deinitialized()) return DEINITIALIZED;
    if (ordinal < 0 || ordinal >= DEVICES) return INVALID_DEVICE;
    *device = ordinal;
    return SUCCESS;
}

static int refuse_word_mask; /* see fakeCudaRefuseProgressWord */

int cuDeviceGetAttribute(int *value, int attribute, int device) {
    if (deinitialized()) return DEINITIALIZED;
    if (value == NULL) return INVALID_VALUE;
    if (device < 0 || device >= DEVICES) return INVALID_DEVICE;
    /* 19: CU_DEVICE_ATTRIBUTE_CAN_MAP_HOST_MEMORY; 122:
     * CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS (its number in CUDA
     * 12 and 13 headers); 115: CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED
     * (see "Device memory and copies"). Every other attribute reads 0. */
    pthread_mutex_lock(&lock);
    int no_memops = refuse_word_mask & 1, no_mapping = refuse_word_mask & 16;
    pthread_mutex_unlock(&lock);
    *value = (attribute == 19 && !no_mapping) || (attribute == 122 && !no_memops) ||
             (attribute == 115 && !no_memory_pools);
    return SUCCESS;
}

static void run_due(int64_t until);
static void drop_copies(const void *p, size_t size);
static void free_device_memory(ctx_t *c);

int cuDevicePrimaryCtxRetain(void **context, int device) {
    if (deinitialized()) return DEINITIALIZED;
    if (device < 0 || device >= DEVICES) return INVALID_DEVICE;
    pthread_mutex_lock(&lock);
    ctx_t *c = &contexts[device];
    if (c->retains++ == 0) {
        c->made++;
        c->legacy = (stream_t){.ctx = c, .kind = LEGACY};
        c->streams = NULL;
    }
    pthread_mutex_unlock(&lock);
    *context = c;
    return SUCCESS;
}

int cuDevicePrimaryCtxRelease_v2(int device) {
    if (deinitialized()) return DEINITIALIZED;
    if (device < 0 || device >= DEVICES) return INVALID_DEVICE;
    pthread_mutex_lock(&lock);
    ctx_t *c = &contexts[device];
    if (c->retains == 0) {
        pthread_mutex_unlock(&lock);
        return INVALID_CONTEXT;
    }
    if (--c->retains == 0) {
        /* Torn down: the copies due by now are made, its streams go, its
         * other handles are refused from now on (the generation changes),
         * and its queued copies with them. */
        run_due(now_ns());
        for (stream_t *s = c->streams, *next; s; s = next) {
            next = s->next;
            free(s);
        }
        c->streams = NULL;
        free_context_memory(c);
        c->generation++;
    }
    pthread_mutex_unlock(&lock);
    return SUCCESS;
}

int cuDevicePrimaryCtxGetState(int device, unsigned *flags, int *active) {
    if (deinitialized()) return DEINITIALIZED;
    if (device < 0 || device >= DEVICES) return INVALID_DEVICE;
    if (flags == NULL || active == NULL) return INVALID_VALUE;
    pthread_mutex_lock(&lock);
    *flags = 0;
    *active = contexts[device].retains > 0;
    contexts[device].state_asks++;
    pthread_mutex_unlock(&lock);
    return SUCCESS;
}

int cuCtxGetCurrent(void **context) {
    if (deinitialized()) return DEINITIALIZED;
    *context = current;
    return SUCCESS;
}

/* Unique for the life of the process: the device and the context's
 * generation. */
int cuCtxGetId(void *context, unsigned long long *id) {
    if (id == NULL) return INVALID_VALUE;
    pthread_mutex_lock(&lock);
    ctx_t *c = context != NULL ? context : current;
    int status = c == NULL || !is_context(c) ? INVALID_CONTEXT
                 : context == NULL && stale_binding(c) ? CONTEXT_IS_DESTROYED
                 : c->retains == 0 ? CONTEXT_IS_DESTROYED
                                   : SUCCESS;
    if (status == SUCCESS) *id = (unsigned long long)c->generation * DEVICES + (unsigned)c->device + 1;
    pthread_mutex_unlock(&lock);
    return status;
}

int cuCtxSetCurrent(void *context) {
    if (deinitialized()) return DEINITIALIZED;
    if (context == NULL) {
        current = NULL;
        return SUCCESS;
    }
    if (!is_context(context)) return INVALID_CONTEXT;
    ctx_t *c = context;
    pthread_mutex_lock(&lock);
    int status = c->retains == 0 ? CONTEXT_IS_DESTROYED : faulted(c) ? ILLEGAL_ADDRESS : SUCCESS;
    if (status == SUCCESS) {
        c->switches++;
        current = c;
        bound_generation = c->generation;
    }
    pthread_mutex_unlock(&lock);
    return status;
}

/* The end of a synchronize of `c`'s work, once device time has passed it:
 * the copies due by now are made first (see run_due), so the caller finds
 * their bytes. */
static int synchronized(ctx_t *c) {
    pthread_mutex_lock(&lock);
    run_due(now_ns());
    pthread_mutex_unlock(&lock);
    if (deinitialized()) return DEINITIALIZED;
    return faulted(c) ? ILLEGAL_ADDRESS : SUCCESS;
}

int cuCtxSynchronize(void) {
    pthread_mutex_lock(&lock);
    int status = current_usable();
    if (status == SUCCESS) status = unsafe_call();
    int64_t until = 0;
    if (status == SUCCESS) {
        until = current->legacy.busy_until;
        for (stream_t *s = current->streams; s; s = s->next) until = max64(until, s->busy_until);
    }
    ctx_t *c = current;
    pthread_mutex_unlock(&lock);
    if (status != SUCCESS) return status;
    sleep_until(min64(until, c->fault_at));
    return synchronized(c);
}

int cuStreamCreate(void **stream, unsigned flags) {
    pthread_mutex_lock(&lock);
    int status = current_usable();
    stream_t *s = NULL;
    if (status == SUCCESS) {
        s = calloc(1, sizeof *s);
        if (s == NULL) {
            status = INVALID_VALUE;
        } else {
            s->ctx = current;
            s->kind = CREATED;
            s->flags = flags;
            s->next = current->streams;
            current->streams = s;
        }
    }
    pthread_mutex_unlock(&lock);
    if (status == SUCCESS) *stream = s;
    return status;
}

int cuStreamDestroy_v2(void *stream) {
    if (deinitialized()) return DEINITIALIZED;
    if (stream == NULL || stream == STREAM_LEGACY || stream == STREAM_PER_THREAD)
        return INVALID_HANDLE;
    pthread_mutex_lock(&lock);
    stream_t *s = stream;
    ctx_t *c = s->ctx;
    int status = current == c ? (faulted(c) ? ILLEGAL_ADDRESS : SUCCESS) : INVALID_CONTEXT;
    if (status != INVALID_CONTEXT) {
        /* Unlinked and freed even after a fault, as its context's resources
         * are. */
        for (stream_t **link = &c->streams; *link; link = &(*link)->next) {
            if (*link == s) {
                *link = s->next;
                free(s);
                break;
            }
        }
    }
    pthread_mutex_unlock(&lock);
    return status;
}

int cuStreamSynchronize(void *stream) {
    pthread_mutex_lock(&lock);
    int status = current_usable();
    stream_t *s = status == SUCCESS ? stream_of(stream) : NULL;
    if (status == SUCCESS && s == NULL) status = INVALID_CONTEXT;
    /* A capturing stream has nothing to wait for: synchronizing it is
     * CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED, and invalidates the capture. */
    if (status == SUCCESS && ongoing(s->capture)) {
        invalidate(s->capture);
        status = STREAM_CAPTURE_UNSUPPORTED;
    }
    if (status == SUCCESS) status = implicit_dependency(s);
    if (status == SUCCESS) status = unsafe_call();
    int64_t until = s ? ready_at(s) : 0;
    ctx_t *c = current;
    pthread_mutex_unlock(&lock);
    if (status != SUCCESS) return status;
    sleep_until(min64(until, c->fault_at));
    return synchronized(c);
}

/* The flags of the last event made on this thread (-1: none yet). */
static __thread int last_event_flags = -1;

int fakeCudaLastEventFlags(int unused) {
    (void)unused;
    return last_event_flags;
}

int cuEventCreate(void **event, unsigned flags) {
    last_event_flags = (int)flags;
    pthread_mutex_lock(&lock);
    int status = current_usable();
    event_t *e = NULL;
    if (status == SUCCESS) {
        e = calloc(1, sizeof *e);
        if (e == NULL) {
            status = INVALID_VALUE;
        } else {
            e->ctx = current;
            e->generation = current->generation;
            e->flags = flags;
            current->live_events++;
            current->created_events++;
        }
    }
    pthread_mutex_unlock(&lock);
    if (status == SUCCESS) *event = e;
    return status;
}

/* ---- Record order ----
 * Each stream numbers its records (1, 2, ...), in the order the driver
 * takes them: a stream's work runs in issue order ("Stream ordered
 * semantics", CUDA Programming Guide; cuEventRecord captures "the contents
 * of hStream at the time of this call",
 * https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__EVENT.html).
 * fakeCudaLastRecordNumber() is the number of the calling thread's last
 * record, so a test can compare a fence's sequence with its record's
 * place. */
static __thread int last_record;
/* The capture that took this thread's last record, and the race to make in
 * its next one (see "Stream capture"). */
static __thread int last_record_capture;
static __thread int capture_in_next_record;

int fakeCudaLastRecordNumber(int unused) {
    (void)unused;
    return last_record;
}

int fakeCudaLastRecordCapture(int unused) {
    (void)unused;
    return last_record_capture;
}

/* A call held by a test hook: the next such call, on any thread, stops
 * just before it returns (outside the lock) until released. */
typedef struct {
    atomic_int armed, released, held;
} hold_t;

/* Arm `h` (1) for the next call, or release (0) the call it holds. */
static int hold_arm(hold_t *h, int arm) {
    if (arm) {
        atomic_store(&h->released, 0);
        atomic_store(&h->armed, 1);
    } else {
        atomic_store(&h->released, 1);
    }
    return 0;
}

/* Where a held call stops, if `h` was armed for it. */
static void hold_here(hold_t *h) {
    if (!atomic_exchange(&h->armed, 0)) return;
    atomic_store(&h->held, 1);
    while (!atomic_load(&h->released)) sched_yield();
    atomic_store(&h->held, 0);
}

/* Test hook: the next cuEventRecord is held (as a real record takes
 * microseconds): fakeCudaHoldNextRecord(1) arms it, (0) releases it;
 * fakeCudaRecordHeld() is 1 while a record is stopped there. */
static hold_t record_hold;

int fakeCudaHoldNextRecord(int arm) { return hold_arm(&record_hold, arm); }

int fakeCudaRecordHeld(int unused) {
    (void)unused;
    return atomic_load(&record_hold.held);
}

int fakeCudaCaptureInNextRecord(int race) {
    capture_in_next_record = race;
    return 0;
}

/* End capture `id` as cuStreamEndCapture does (its graph is dropped).
 * Called with the lock held. */
static void end_capture(ctx_t *c, int id) {
    captures[id].state = CAPTURE_ENDED;
    free(captures[id].writes);
    captures[id].writes = NULL;
    captures[id].nwrites = captures[id].capacity = 0;
    if (c->legacy.capture == id) c->legacy.capture = 0;
    for (stream_t *o = c->streams; o; o = o->next)
        if (o->capture == id) o->capture = 0;
}
/* ---- end of record order ---- */

/* Test hook: the calling thread's next cuEventRecord returns `status`
 * (nonzero) and records nothing, as a refused record: fakeCudaFailNextRecord. */
static __thread int next_record_status;

int fakeCudaFailNextRecord(int status) {
    next_record_status = status;
    return 0;
}

int cuEventRecord(void *event, void *stream) {
    event_t *e = event;
    if (next_record_status != SUCCESS) {
        int refused = next_record_status;
        next_record_status = SUCCESS;
        return refused;
    }
    pthread_mutex_lock(&lock);
    /* A stream of another context is refused first, whichever is current
     * (see the header). A default-stream handle names the current
     * context's. */
    int is_default = stream == NULL || stream == STREAM_LEGACY || stream == STREAM_PER_THREAD;
    const ctx_t *stream_ctx = is_default ? current : ((stream_t *)stream)->ctx;
    int status = stream_ctx != NULL && stream_ctx != e->ctx ? INVALID_HANDLE
                                                              : usable(e->ctx, e->generation);
    stream_t *s = status == SUCCESS ? stream_of(stream) : NULL;
    if (status == SUCCESS && s != NULL && s->ctx == e->ctx) status = implicit_dependency(s);
    int race = status == SUCCESS ? capture_in_next_record : 0;
    if ((race == 2 || race == 3) && s != NULL && s->ctx == e->ctx && !ongoing(s->capture) &&
        s->kind != LEGACY && next_capture < CAPTURES) {
        int id = next_capture++;
        captures[id] = (capture_t){.state = CAPTURE_ACTIVE, .mode = MODE_RELAXED, .owner = pthread_self()};
        s->capture = id;
    }
    if (status == SUCCESS) {
        int captured = s == NULL || s->ctx != e->ctx ? 0 : captured_work(s, 0);
        if (s == NULL || s->ctx != e->ctx) {
            status = INVALID_HANDLE;
        } else if (captured < 0) {
            status = -captured;
        } else if (captured) {
            e->capture = s->capture;
            e->recorded = 1;
            e->at = INT64_MAX;
            last_record_capture = s->capture;
            if (race != 0) {
                if (race != 3) end_capture(s->ctx, s->capture);
                capture_in_next_record = 0;
            }
        } else {
            e->capture = 0;
            e->at = ready_at(s);
            e->recorded = 1;
            last_record = ++s->records;
            last_record_capture = 0;
        }
    }
    pthread_mutex_unlock(&lock);
    hold_here(&record_hold);
    /* A real cuEventRecord takes microseconds; yielding here widens the
     * window in which a caller's work just after the call races another
     * thread's record on the same stream (see "Record order"). */
    sched_yield();
    return status;
}

int cuEventQuery(void *event) {
    event_t *e = event;
    pthread_mutex_lock(&lock);
    int injected = next_query_status;
    next_query_status = 0;
    pthread_mutex_unlock(&lock);
    if (injected != 0) return injected;
    pthread_mutex_lock(&lock);
    int status = usable(e->ctx, e->generation);
    if (status == SUCCESS) status = captured_event_use(e);
    if (status == SUCCESS) status = unsafe_call();
    int64_t now = now_ns();
    run_due(now);
    int done = !e->recorded || now >= e->at;
    pthread_mutex_unlock(&lock);
    if (status != SUCCESS) return status;
    return done ? SUCCESS : NOT_READY;
}

int cuEventSynchronize(void *event) {
    event_t *e = event;
    pthread_mutex_lock(&lock);
    int status = usable(e->ctx, e->generation);
    if (status == SUCCESS) status = captured_event_use(e);
    if (status == SUCCESS) status = unsafe_call();
    int64_t until = e->recorded ? e->at : 0;
    ctx_t *c = e->ctx;
    pthread_mutex_unlock(&lock);
    if (status != SUCCESS) return status;
    sleep_until(min64(until, c->fault_at));
    return synchronized(c);
}

int cuEventDestroy_v2(void *event) {
    event_t *e = event;
    pthread_mutex_lock(&lock);
    int status = usable(e->ctx, e->generation);
    int freed = status == SUCCESS || status == ILLEGAL_ADDRESS;
    if (freed) e->ctx->live_events--;
    pthread_mutex_unlock(&lock);
    if (freed) free(e);
    return status;
}

/* fakeCudaNextElapsed: the next time this thread reads, in microseconds. */
static __thread int next_elapsed_set, next_elapsed_us;

static int elapsed(float *ms, void *start, void *end) {
    event_t *a = start, *b = end;
    pthread_mutex_lock(&lock);
    /* Events of two contexts are refused first, whichever is current (see
     * the header). */
    int status = a->ctx != b->ctx || a->generation != b->generation ? INVALID_HANDLE
                                                                      : usable(b->ctx, b->generation);
    if (status == SUCCESS && ((a->flags | b->flags) & EVENT_DISABLE_TIMING))
        status = INVALID_HANDLE;
    if (status == SUCCESS && (!a->recorded || !b->recorded)) status = INVALID_HANDLE;
    if (status == SUCCESS && (a->capture != 0 || b->capture != 0)) status = INVALID_VALUE;
    if (status == SUCCESS) status = unsafe_call();
    int64_t now = now_ns();
    if (status == SUCCESS && (now < a->at || now < b->at)) status = NOT_READY;
    if (status == SUCCESS) *ms = (float)((double)(b->at - a->at) / 1e6);
    if (status == SUCCESS && next_elapsed_set) *ms = (float)next_elapsed_us / 1000.0f;
    if (status == SUCCESS) next_elapsed_set = 0;
    pthread_mutex_unlock(&lock);
    return status;
}

/* ---- Elapsed time ----
 * Both names, as real drivers export them (CUDA 12.8 added _v2, and CUDA 13
 * headers map the legacy name to it; both measured present on a 13.0
 * driver, giving the same times). Built with -DFAKE_CUDA_NO_ELAPSED_V2 the
 * fake is an older driver, with the legacy name only. Each name counts its
 * calls on the calling thread (so tests running beside each other do not
 * count each other's): fakeCudaElapsedCalls(0) the legacy name's, (1) the
 * _v2's. The cross-context rule is the driver's (measured: a 13.0 driver
 * answers CUDA_ERROR_INVALID_HANDLE for events of two contexts; elapsed()).
 * fakeCudaNextElapsed(us) makes the next time this thread reads, once the
 * call succeeds, `us` microseconds (negative too: a stop reached before its
 * start), so a test checks how the milliseconds are read. */
static __thread int elapsed_calls[2];

int cuEventElapsedTime(float *ms, void *start, void *end) {
    elapsed_calls[0]++;
    return elapsed(ms, start, end);
}
#ifndef FAKE_CUDA_NO_ELAPSED_V2
int cuEventElapsedTime_v2(float *ms, void *start, void *end) {
    elapsed_calls[1]++;
    return elapsed(ms, start, end);
}
#endif

int fakeCudaNextElapsed(int us) {
    next_elapsed_us = us;
    next_elapsed_set = 1;
    return 0;
}

int fakeCudaElapsedCalls(int v2) {
    if (v2 < 0 || v2 > 1) return -1;
    return elapsed_calls[v2];
}
/* ---- end of elapsed time ---- */

int cuStreamWaitEvent(void *stream, void *event, unsigned flags) {
    (void)flags;
    event_t *e = event;
    pthread_mutex_lock(&lock);
    int status = current_usable();
    stream_t *s = status == SUCCESS ? stream_of(stream) : NULL;
    if (status == SUCCESS && s == NULL) status = INVALID_CONTEXT;
    /* The event may be another context's, even another device's. */
    if (status == SUCCESS && (e->ctx->retains == 0 || e->ctx->generation != e->generation))
        status = INVALID_HANDLE;
    if (status == SUCCESS) status = implicit_dependency(s);
    int handled = status == SUCCESS ? capture_wait(s, e) : 0;
    if (handled < 0) status = -handled;
    if (status == SUCCESS && !handled && e->recorded) s->busy_until = max64(s->busy_until, e->at);
    pthread_mutex_unlock(&lock);
    return status;
}

/* Load code into the current context: wait for every stream of it, with
 * the lock (and so every other call) held (see cuModuleLoadData). */
static void load_code(void) {
    int64_t until = current->legacy.busy_until;
    for (stream_t *o = current->streams; o; o = o->next) until = max64(until, o->busy_until);
    sleep_until(min64(until, current->fault_at));
    run_due(now_ns());
}

int cuModuleLoadData(void **module, const void *image) {
    pthread_mutex_lock(&lock);
    int status = current_usable();
    module_t *m = NULL;
    if (status == SUCCESS && (image == NULL || strstr((const char *)image, ".entry") == NULL))
        status = INVALID_VALUE;
    if (status == SUCCESS) {
        m = calloc(1, sizeof *m);
        if (m == NULL) status = INVALID_VALUE;
        else *m = (module_t){current, current->generation};
    }
    if (status == SUCCESS) {
        /* Loading a module synchronizes its context, and the driver's other
         * calls wait meanwhile: the CUDA Programming Guide (Lazy Loading,
         * "Potential Hazards") warns that loading kernels "might require
         * context synchronization", and on an H200 (driver 13.0) a load on
         * one thread made other threads' next calls return only after their
         * kernels, queued before it, had ended. The lock is held for the
         * wait, so every call of every thread waits (stricter than a
         * per-context wait, which affects timing only). */
        load_code();
    }
    pthread_mutex_unlock(&lock);
    if (status == SUCCESS) *module = m;
    return status;
}

int cuModuleGetFunction(void **function, void *module, const char *name) {
    module_t *m = module;
    pthread_mutex_lock(&lock);
    int status = usable(m->ctx, m->generation);
    pthread_mutex_unlock(&lock);
    if (status != SUCCESS) return status;
    int kind = strcmp(name, "sleep_ns") == 0 ? SLEEP_NS : strcmp(name, "write_u32") == 0 ? WRITE_U32 : 0;
    if (kind == 0) return NOT_FOUND;
    function_t *f = calloc(1, sizeof *f);
    if (f == NULL) return INVALID_VALUE;
    /* Lazy unless CUDA_MODULE_LOADING=EAGER: "When function loading mode is
     * set to LAZY the function retrieved may be partially loaded"
     * (cuModuleEnumerateFunctions); the fake always takes that case. */
    const char *mode = getenv("CUDA_MODULE_LOADING");
    *f = (function_t){m, kind, mode != NULL && strcmp(mode, "EAGER") == 0};
    *function = f;
    return SUCCESS;
}

/* cuFuncLoad (CUDA 12.4): "Finalizes function loading for function. Calling
 * this API with a fully loaded function has no effect." */
int cuFuncLoad(void *function) {
    function_t *f = function;
    if (f == NULL) return INVALID_HANDLE;
    pthread_mutex_lock(&lock);
    int status = usable(f->module->ctx, f->module->generation);
    if (status == SUCCESS && !f->loaded) {
        load_code();
        f->loaded = 1;
    }
    pthread_mutex_unlock(&lock);
    return status;
}

int cuLaunchKernel(void *function, unsigned gx, unsigned gy, unsigned gz, unsigned bx,
                   unsigned by, unsigned bz, unsigned shared, void *stream, void **params,
                   void **extra) {
    (void)gx; (void)gy; (void)gz; (void)bx; (void)by; (void)bz; (void)shared; (void)extra;
    function_t *f = function;
    if (params == NULL || params[0] == NULL) return INVALID_VALUE;
    uint64_t argument = *(uint64_t *)params[0];
    pthread_mutex_lock(&lock);
    int status = usable(f->module->ctx, f->module->generation);
    stream_t *s = status == SUCCESS ? stream_of(stream) : NULL;
    if (status == SUCCESS && (s == NULL || s->ctx != f->module->ctx)) status = INVALID_HANDLE;
    if (status == SUCCESS) status = implicit_dependency(s);
    /* A function left partly loaded is loaded by its launch: "CUDA APIs may
     * load the function automatically when called with partially loaded
     * function handle" (cuModuleEnumerateFunctions), and "Loading kernels
     * might require context synchronization" (Programming Guide, "Lazy
     * Loading"): the launch waits as a module load does. */
    if (status == SUCCESS && !f->loaded) {
        load_code();
        f->loaded = 1;
    }
    int captured = status == SUCCESS ? captured_work(s, f->kind == SLEEP_NS ? (int64_t)argument : 0) : 0;
    if (captured < 0) status = -captured;
    if (status == SUCCESS && !captured) {
        int64_t start = ready_at(s);
        if (f->kind == SLEEP_NS) {
            s->busy_until = start + (int64_t)argument;
        } else {
            if (argument < 4096 && start < s->ctx->fault_at) s->ctx->fault_at = start;
            s->busy_until = start;
        }
    }
    pthread_mutex_unlock(&lock);
    return status;
}

int cuStreamBeginCapture_v2(void *stream, int mode) {
    pthread_mutex_lock(&lock);
    int status = current_usable();
    stream_t *s = status == SUCCESS ? stream_of(stream) : NULL;
    if (status == SUCCESS && s == NULL) status = INVALID_CONTEXT;
    if (status == SUCCESS && mode != MODE_GLOBAL && mode != MODE_THREAD_LOCAL && mode != MODE_RELAXED)
        status = INVALID_VALUE;
    /* "Capture may not be initiated if stream is CU_STREAM_LEGACY." */
    if (status == SUCCESS && s->kind == LEGACY) status = STREAM_CAPTURE_UNSUPPORTED;
    if (status == SUCCESS && ongoing(s->capture)) status = ILLEGAL_STATE;
    if (status == SUCCESS && next_capture >= CAPTURES) status = INVALID_VALUE; /* the fake's limit */
    if (status == SUCCESS) {
        int id = next_capture++;
        captures[id] = (capture_t){.state = CAPTURE_ACTIVE, .mode = mode, .owner = pthread_self()};
        s->capture = id;
    }
    pthread_mutex_unlock(&lock);
    return status;
}

int cuStreamEndCapture(void *stream, void **graph) {
    pthread_mutex_lock(&lock);
    int status = current_usable();
    stream_t *s = status == SUCCESS ? stream_of(stream) : NULL;
    if (status == SUCCESS && s == NULL) status = INVALID_CONTEXT;
    if (status == SUCCESS && !ongoing(s->capture)) status = ILLEGAL_STATE;
    capture_t *c = status == SUCCESS ? &captures[s->capture] : NULL;
    if (status == SUCCESS && c->mode != MODE_RELAXED && !pthread_equal(c->owner, pthread_self()))
        status = STREAM_CAPTURE_WRONG_THREAD;
    graph_t *g = NULL;
    if (status == SUCCESS) {
        int id = s->capture;
        if (c->state == CAPTURE_INVALIDATED) {
            status = STREAM_CAPTURE_INVALIDATED;
        } else {
            g = calloc(1, sizeof *g);
            if (g == NULL) {
                status = INVALID_VALUE;
            } else {
                /* The captured word writes are the graph's nodes now. */
                *g = (graph_t){current, c->duration, c->writes, c->nwrites};
                c->writes = NULL;
                c->nwrites = c->capacity = 0;
            }
        }
        end_capture(current, id);
    }
    pthread_mutex_unlock(&lock);
    if (graph) *graph = g;
    return status;
}

int cuStreamGetCaptureInfo_v2(void *stream, int *capture_status, unsigned long long *id,
                              void **graph, const void **dependencies, size_t *count) {
    if (capture_status == NULL) return INVALID_VALUE;
    pthread_mutex_lock(&lock);
    int status = current_usable();
    stream_t *s = status == SUCCESS ? stream_of(stream) : NULL;
    if (status == SUCCESS && s == NULL) status = INVALID_CONTEXT;
    if (status == SUCCESS && implicit_capture(s) != 0) status = STREAM_CAPTURE_IMPLICIT;
    if (status == SUCCESS) {
        *capture_status = ongoing(s->capture) ? captures[s->capture].state : CAPTURE_NONE;
        if (id != NULL && *capture_status == CAPTURE_ACTIVE) *id = (unsigned long long)s->capture;
        /* The fake keeps no graph nodes: the optional outputs say "none". */
        if (graph != NULL) *graph = NULL;
        if (dependencies != NULL) *dependencies = NULL;
        if (count != NULL) *count = 0;
    }
    pthread_mutex_unlock(&lock);
    return status;
}

int cuStreamIsCapturing(void *stream, int *capture_status) {
    return cuStreamGetCaptureInfo_v2(stream, capture_status, NULL, NULL, NULL, NULL);
}

int cuThreadExchangeStreamCaptureMode(int *mode) {
    if (mode == NULL || *mode < MODE_GLOBAL || *mode > MODE_RELAXED) return INVALID_VALUE;
    int previous = capture_mode;
    capture_mode = *mode;
    *mode = previous;
    return SUCCESS;
}

/* A graph from a capture: instantiated as a copy, launched as its captured
 * sleeps back to back, its captured word writes (see "Host-mapped memory and
 * stream writes") made again at their places in the run: "cuGraphLaunch
 * executes graph" with the nodes the capture put there (cuStreamBeginCapture:
 * "all operations pushed into the stream will not be executed, but will
 * instead be captured into a graph"), as often as it is launched. */
static void free_graph(graph_t *g) {
    if (g == NULL) return;
    free(g->writes);
    free(g);
}

int cuGraphInstantiateWithFlags(void **exec, void *graph, unsigned long long flags) {
    (void)flags;
    graph_t *g = graph, *x = malloc(sizeof *x);
    if (g == NULL || x == NULL) { free(x); return INVALID_VALUE; }
    *x = *g;
    x->writes = NULL;
    if (g->nwrites > 0) {
        x->writes = malloc((size_t)g->nwrites * sizeof *x->writes);
        if (x->writes == NULL) { free(x); return INVALID_VALUE; }
        memcpy(x->writes, g->writes, (size_t)g->nwrites * sizeof *x->writes);
    }
    *exec = x;
    return SUCCESS;
}

static int capture_write(int id, unsigned long long *host, unsigned long long value);
static int replay_writes(const graph_t *x, stream_t *s, int64_t start);

int cuGraphLaunch(void *exec, void *stream) {
    graph_t *x = exec;
    pthread_mutex_lock(&lock);
    int status = usable(x->ctx, x->ctx->generation);
    stream_t *s = status == SUCCESS ? stream_of(stream) : NULL;
    if (status == SUCCESS && s == NULL) status = INVALID_HANDLE;
    int captured = status == SUCCESS ? captured_work(s, 0) : 0;
    if (captured < 0) status = -captured;
    if (status == SUCCESS && captured) {
        /* Launched into another capture: its nodes join that graph. */
        for (int i = 0; i < x->nwrites && status == SUCCESS; i++)
            status = capture_write(s->capture, x->writes[i].host, x->writes[i].value);
        captures[s->capture].duration += x->duration;
    }
    if (status == SUCCESS && !captured) {
        int64_t start = ready_at(s);
        s->busy_until = start + x->duration;
        replay_writes(x, s, start);
    }
    pthread_mutex_unlock(&lock);
    return status;
}

int cuGraphUpload(void *exec, void *stream) { (void)exec; (void)stream; return SUCCESS; }
int cuGraphExecDestroy(void *exec) { free_graph(exec); return SUCCESS; }
int cuGraphDestroy(void *graph) { free_graph(graph); return SUCCESS; }

/* ---- Host-mapped memory and stream writes ----
 * Driver API "Memory Management" and "Stream Memory Operations":
 * - cuMemHostAlloc "allocates bytesize bytes of host memory that is
 *   page-locked and accessible to the device", in the current context; flags
 *   PORTABLE (0x1), DEVICEMAP (0x2) and WRITECOMBINED (0x4), any other bit
 *   CUDA_ERROR_INVALID_VALUE. Its contents are not zeroed (the docs do
 *   not say they are). The memory is freed with its context
 *   (cuDevicePrimaryCtxRelease tearing it down), its pending writes
 *   dropped.
 * - cuMemHostGetDevicePointer_v2: "Flags provided for future releases. For
 *   now, it must be set to 0"; only for memory allocated with DEVICEMAP, of
 *   the current context unless PORTABLE. The device address is the host
 *   address plus DEVICE_ALIAS, never the host address itself, so a caller
 *   that passes a host pointer to a device call fails here.
 * - cuMemFreeHost of the start of a live allocation. The docs do not say
 *   which context must be current; the fake takes the strict reading (the
 *   allocation's own; the crate binds it before freeing, so it is right
 *   under either reading). Freeing while a write queued to it is still to
 *   come in device time (due after now, before a fault) is the caller's
 *   bug (on a GPU the device would write into freed memory): counted
 *   (fakeCudaWritesAfterFree), and the write dropped, never made.
 * - cuStreamWriteValue64_v2 (the name CUDA 12 headers map
 *   cuStreamWriteValue64 to): flags 0 (DEFAULT: "the write is preceded by a
 *   memory barrier") or 1 (NO_MEMORY_BARRIER); the address "must be aligned
 *   to 8 bytes" and here must be a device address of mapped memory of the
 *   stream's context. On a capturing stream the write is captured, not run
 *   ("all operations pushed into the stream will not be executed, but will
 *   instead be captured into a graph", cuStreamBeginCapture): it stays in
 *   the graph and is made at each cuGraphLaunch, at its place after the
 *   graph's captured sleeps; one whose memory is freed by then is counted
 *   in fakeCudaWritesAfterFree and never made.
 *   Otherwise it lands when the stream gets there (after its queued work; it
 *   takes no device time itself), through one copy-engine thread, as an
 *   atomic store with release order; a write due at or after its context's
 *   fault never lands (a faulted context runs nothing more). Writes of one
 *   stream land in the order queued.
 * - fakeCudaRefuseProgressWord(mask) sets refusals and returns the previous
 *   mask: 1 attribute 122 reads 0, 2 cuMemHostAlloc is
 *   CUDA_ERROR_OUT_OF_MEMORY, 4 cuMemHostGetDevicePointer_v2 and 8
 *   cuStreamWriteValue64_v2 are CUDA_ERROR_NOT_SUPPORTED, 16 attribute 19
 *   reads 0. fakeCudaStreamWrites
 *   (0: accepted, 1: of those, captured) counts the calling thread's writes;
 *   fakeCudaHostAllocations(device) the live allocations of that device's
 *   context; fakeCudaPendingWrites() the writes queued, not landed yet.
 *   Queueing a write and landing one cost O(log n) (see push_write).
 * - Freed host memory is unmapped, and its addresses are never given out
 *   again: a read or write of it faults the process (SIGSEGV), where a
 *   real driver's freed memory may read anything, or fault too.
 * - fakeCudaHostMemoryCalls(all) counts the calling thread's cuMemHostAlloc and
 *   cuMemFreeHost calls (refused ones too), or with all = 1 every thread's; fakeCudaHostMemorySynchronizes(1)
 *   makes both wait for the context's queued work before returning (see
 *   host_memory_synchronize for the documents that allow it) and returns
 *   the previous setting.
 * - fakeCudaCaptureNextWordWrite(1) arms, for the calling thread's next
 *   cuStreamWriteValue64 on a created stream not capturing, the race of
 *   another thread that begins a relaxed capture of the stream just before
 *   the write and ends it just after (all inside the call): the write goes
 *   into that capture's graph, which the fake keeps for the calling thread.
 *   fakeCudaLaunchRaceGraph() launches that graph, as its thread would, on
 *   its context's legacy stream, and returns how many of its writes target
 *   freed memory (-1: no such graph, or its context is gone).
 */
#define DEVICE_ALIAS 0x100000000000ULL
#define MEMHOSTALLOC_PORTABLE 0x1
#define MEMHOSTALLOC_DEVICEMAP 0x2
#define MEMHOSTALLOC_WRITECOMBINED 0x4

typedef struct host_alloc {
    void *p;
    size_t size;
    ctx_t *ctx;
    unsigned flags;
    struct host_alloc *next;
} host_alloc_t;

/* A write queued to land: the queue is a binary min-heap on (at, seq), so
 * queueing and landing one cost O(log n) however many are pending (a stream
 * with 50,000 writes queued makes the next no dearer), and writes due at the
 * same time land in the order queued. A write dropped by a free keeps its
 * place with host = NULL until it comes out. */
typedef struct dev_alloc dev_alloc_t;

typedef struct {
    _Atomic unsigned long long *host; /* a word write's target; NULL for a copy or set */
    unsigned long long value;
    int64_t at;
    unsigned long long seq;
    ctx_t *ctx;
    /* A copy or set (see "Device memory and copies"): `bytes` bytes into
     * `dst`, from `src` or (src NULL) of the `elem`-byte pattern `value`. */
    int generation; /* of ctx when queued: a context made again runs none */
    unsigned char *dst;
    const unsigned char *src;
    size_t bytes;
    unsigned elem;
    dev_alloc_t *holds[2]; /* the device allocations it keeps alive */
    void *staging; /* its own copy of a pageable source, freed with it */
    int *made; /* set once made, for a caller waiting on it */
    int dropped; /* its memory freed: never made */
} pending_write_t;

static host_alloc_t *host_allocs;
static pending_write_t *pending; /* the heap */
static size_t pending_len, pending_capacity;
static unsigned long long pending_seq;
static pthread_cond_t write_queued;
static int engine_started;
/* When the copy engine wakes next (INT64_MAX: when signalled). */
static int64_t engine_wake = INT64_MAX;
static int writes_after_free;
static __thread int writes_accepted, writes_captured;
/* See fakeCudaHostMemorySynchronizes and fakeCudaHostMemoryCalls. */
static int host_memory_synchronizes;
static __thread int host_memory_calls;
static _Atomic int host_memory_calls_all;
/* See fakeCudaCaptureNextWordWrite and fakeCudaLaunchRaceGraph. */
static __thread int capture_next_word_write;
static __thread graph_t *race_graph;
static __thread int race_generation;

static int earlier(const pending_write_t *a, const pending_write_t *b) {
    return a->at < b->at || (a->at == b->at && a->seq < b->seq);
}

/* Queue a write. Called with the lock held; 0 or OUT_OF_MEMORY. */
static int push_write(pending_write_t w) {
    if (pending_len == pending_capacity) {
        size_t capacity = pending_capacity ? pending_capacity * 2 : 64;
        pending_write_t *grown = realloc(pending, capacity * sizeof *grown);
        if (grown == NULL) return OUT_OF_MEMORY;
        pending = grown;
        pending_capacity = capacity;
    }
    w.seq = pending_seq++;
    size_t i = pending_len++;
    while (i > 0 && earlier(&w, &pending[(i - 1) / 2])) {
        pending[i] = pending[(i - 1) / 2];
        i = (i - 1) / 2;
    }
    pending[i] = w;
    return SUCCESS;
}

/* Take the earliest write out. Called with the lock held, pending_len > 0. */
static pending_write_t pop_write(void) {
    pending_write_t top = pending[0], last = pending[--pending_len];
    size_t i = 0;
    for (;;) {
        size_t child = 2 * i + 1;
        if (child >= pending_len) break;
        if (child + 1 < pending_len && earlier(&pending[child + 1], &pending[child])) child++;
        if (!earlier(&pending[child], &last)) break;
        pending[i] = pending[child];
        i = child;
    }
    if (pending_len > 0) pending[i] = last;
    return top;
}

/* The allocation holding [p, p + size), or NULL. Called with the lock held. */
static host_alloc_t *host_alloc_of(const void *p, size_t size) {
    for (host_alloc_t *a = host_allocs; a; a = a->next)
        if ((const char *)p >= (char *)a->p && (const char *)p + size <= (char *)a->p + a->size)
            return a;
    return NULL;
}

/* Drop the pending writes into [p, p + size); the count is of those the
 * device had yet to make (due after now, before a fault): one due by now
 * has landed in device time, the copy engine just has not run yet. Called
 * with the lock held. */
static int drop_writes(const void *p, size_t size) {
    int dropped = 0;
    int64_t now = now_ns();
    for (size_t i = 0; i < pending_len; i++) {
        pending_write_t *w = &pending[i];
        if (w->host != NULL && (const char *)w->host >= (const char *)p &&
            (const char *)w->host < (const char *)p + size) {
            dropped += w->at > now && w->at < w->ctx->fault_at;
            w->host = NULL;
            w->dropped = 1;
        }
    }
    return dropped;
}

/* Freed memory is replaced by an inaccessible mapping, kept for the life of
 * the process: a reader or writer of a freed word faults, and a later
 * allocation never gets its address (whose words an old pointer would then
 * alias unseen). */
static void free_host_alloc(host_alloc_t *a) {
    if (mmap(a->p, a->size, PROT_NONE, MAP_FIXED | MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0) ==
        MAP_FAILED)
        abort();
    free(a);
}

static void free_context_memory(ctx_t *c) {
    for (host_alloc_t **link = &host_allocs; *link;) {
        host_alloc_t *a = *link;
        if (a->ctx == c) {
            drop_writes(a->p, a->size);
            drop_copies(a->p, a->size);
            *link = a->next;
            free_host_alloc(a);
        } else {
            link = &a->next;
        }
    }
    free_device_memory(c);
}

static void make_copy(pending_write_t *w);

/* Make the queued writes, copies and sets due by `until` (device time).
 * They land in queue order; a stream's later one is never due before its
 * earlier one (its stream gets there later), and one queued after an event
 * another stream waits on is due no earlier than that event. The copy
 * engine calls this as each comes due, and every call that answers that
 * device work is done (an event's query or synchronize, a stream's or
 * context's synchronize, a module load, a context's teardown) calls it
 * first, so no caller sees an event complete before the bytes queued ahead
 * of it are there. Called with the lock held. */
static void run_due(int64_t until) {
    while (pending_len > 0 && pending[0].at <= until) {
        pending_write_t w = pop_write();
        if (w.host == NULL) {
            make_copy(&w);
        } else if (w.at < w.ctx->fault_at) {
            atomic_store_explicit(w.host, w.value, memory_order_release);
        }
    }
}

static void *copy_engine(void *unused) {
    (void)unused;
    pthread_mutex_lock(&lock);
    for (;;) {
        run_due(now_ns());
        engine_wake = pending_len > 0 ? pending[0].at : INT64_MAX;
        if (engine_wake == INT64_MAX) {
            pthread_cond_wait(&write_queued, &lock);
        } else {
            struct timespec t = {engine_wake / 1000000000, engine_wake % 1000000000};
            pthread_cond_timedwait(&write_queued, &lock, &t);
        }
    }
    return NULL;
}

static int queue_op(pending_write_t w);

/* Queue `host` to be set to `value` at `at` (device time) by `c`'s device.
 * Called with the lock held. */
static int queue_write(unsigned long long *host, unsigned long long value, int64_t at, ctx_t *c) {
    return queue_op((pending_write_t){.host = (_Atomic unsigned long long *)host, .value = value,
                                      .at = at, .ctx = c});
}

/* Queue a write, copy or set to be made at `w.at`. Called with the lock
 * held. */
static int queue_op(pending_write_t w) {
    int64_t at = w.at;
    int status = push_write(w);
    if (status != SUCCESS) return status;
    if (!engine_started) {
        pthread_condattr_t attr;
        pthread_condattr_init(&attr);
        pthread_condattr_setclock(&attr, CLOCK_MONOTONIC);
        pthread_cond_init(&write_queued, &attr);
        pthread_t engine;
        engine_started = pthread_create(&engine, NULL, copy_engine, NULL) == 0;
        if (engine_started) pthread_detach(engine);
    }
    /* The engine is woken only when this write is due before it would wake
     * anyway: a write behind many others costs no scan. */
    if (at < engine_wake) {
        engine_wake = at;
        pthread_cond_signal(&write_queued);
    }
    return SUCCESS;
}

/* Add a word write to capture `id`'s graph. Called with the lock held. */
static int capture_write(int id, unsigned long long *host, unsigned long long value) {
    capture_t *c = &captures[id];
    if (c->nwrites == c->capacity) {
        int capacity = c->capacity ? c->capacity * 2 : 8;
        graph_write_t *grown = realloc(c->writes, (size_t)capacity * sizeof *grown);
        if (grown == NULL) return OUT_OF_MEMORY;
        c->writes = grown;
        c->capacity = capacity;
    }
    c->writes[c->nwrites++] = (graph_write_t){host, value, c->duration};
    return SUCCESS;
}

/* Queue graph `x`'s word writes, launched on `s` at `start`: the count of
 * those whose memory is freed already (the device would write into freed
 * memory; counted in fakeCudaWritesAfterFree, never made). Called with the
 * lock held. */
static int replay_writes(const graph_t *x, stream_t *s, int64_t start) {
    int freed = 0;
    for (int i = 0; i < x->nwrites; i++) {
        const graph_write_t *w = &x->writes[i];
        if (host_alloc_of(w->host, 8) == NULL) {
            freed++;
            continue;
        }
        queue_write(w->host, w->value, start + w->offset, s->ctx);
    }
    writes_after_free += freed;
    return freed;
}

/* Page-locked allocation and free may hold the caller until the context's
 * device work is done: "Two commands from different streams cannot run
 * concurrently if any one of the following operations is issued in-between
 * them by the host thread: a page-locked host memory allocation, ..." (CUDA
 * C++ Programming Guide, "Implicit Synchronization"), and cudaFreeHost /
 * cudaFree "may synchronize" (CUDA Runtime API, "API synchronization
 * behavior"). With fakeCudaHostMemorySynchronizes(1) the fake does so: the
 * call returns once every stream of `c` has finished its queued work (as
 * cuCtxSynchronize would wait). Called without the lock. */
static void host_memory_synchronize(ctx_t *c) {
    pthread_mutex_lock(&lock);
    int64_t until = 0;
    if (host_memory_synchronizes && c != NULL) {
        until = c->legacy.busy_until;
        for (stream_t *s = c->streams; s; s = s->next) until = max64(until, s->busy_until);
        until = min64(until, c->fault_at);
    }
    pthread_mutex_unlock(&lock);
    sleep_until(until);
    pthread_mutex_lock(&lock);
    run_due(now_ns());
    pthread_mutex_unlock(&lock);
}

int cuMemHostAlloc(void **pp, size_t bytesize, unsigned flags) {
    if (deinitialized()) return DEINITIALIZED;
    host_memory_calls++;
    atomic_fetch_add(&host_memory_calls_all, 1);
    pthread_mutex_lock(&lock);
    int status = current_usable();
    if (status == SUCCESS && (pp == NULL || bytesize == 0 || (flags & ~7u) != 0)) status = INVALID_VALUE;
    if (status == SUCCESS && (refuse_word_mask & 2)) status = OUT_OF_MEMORY;
    host_alloc_t *a = NULL;
    ctx_t *c = current;
    if (status == SUCCESS) {
        size_t size = (bytesize + 4095) & ~(size_t)4095;
        a = calloc(1, sizeof *a);
        void *p = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (a == NULL || p == MAP_FAILED) {
            if (p != MAP_FAILED) munmap(p, size);
            free(a);
            status = OUT_OF_MEMORY;
        } else {
            /* Not zeroed: the driver does not say it is. */
            memset(p, 0xa5, size);
            *a = (host_alloc_t){.p = p, .size = size, .ctx = current, .flags = flags, .next = host_allocs};
            host_allocs = a;
            *pp = p;
        }
    }
    pthread_mutex_unlock(&lock);
    if (status == SUCCESS) host_memory_synchronize(c);
    if (status == SUCCESS && teardown_at_host_alloc) pthread_once(&teardown_registered, register_teardown);
    return status;
}

int cuMemHostGetDevicePointer_v2(unsigned long long *pdptr, void *p, unsigned flags) {
    if (deinitialized()) return DEINITIALIZED;
    pthread_mutex_lock(&lock);
    int status = current_usable();
    host_alloc_t *a = status == SUCCESS ? host_alloc_of(p, 1) : NULL;
    if (status == SUCCESS && (pdptr == NULL || flags != 0 || a == NULL || !(a->flags & MEMHOSTALLOC_DEVICEMAP)))
        status = INVALID_VALUE;
    if (status == SUCCESS && a->ctx != current && !(a->flags & MEMHOSTALLOC_PORTABLE))
        status = INVALID_CONTEXT;
    if (status == SUCCESS && (refuse_word_mask & 4)) status = NOT_SUPPORTED;
    if (status == SUCCESS) *pdptr = (unsigned long long)(uintptr_t)p + DEVICE_ALIAS;
    pthread_mutex_unlock(&lock);
    return status;
}

int cuMemFreeHost(void *p) {
    if (deinitialized()) return DEINITIALIZED;
    host_memory_calls++;
    atomic_fetch_add(&host_memory_calls_all, 1);
    pthread_mutex_lock(&lock);
    host_alloc_t **link = &host_allocs;
    while (*link && (*link)->p != p) link = &(*link)->next;
    int status = *link == NULL ? INVALID_VALUE : (*link)->ctx != current ? INVALID_CONTEXT : SUCCESS;
    if (status == SUCCESS) status = current_usable();
    ctx_t *c = current;
    /* After a sticky fault the call fails with it but still frees, as the
     * handle destroys do (see the header). */
    if (status == SUCCESS || (status == ILLEGAL_ADDRESS && *link != NULL)) {
        host_alloc_t *a = *link;
        writes_after_free += drop_writes(a->p, a->size);
        drop_copies(a->p, a->size);
        *link = a->next;
        free_host_alloc(a);
    }
    pthread_mutex_unlock(&lock);
    if (status == SUCCESS) host_memory_synchronize(c);
    return status;
}

/* Test hook: the next cuStreamWriteValue64 is held: fakeCudaHoldNextWrite(1)
 * arms it, (0) releases it; fakeCudaWriteHeld() is 1 while a write is
 * stopped there. */
static hold_t write_hold;

int cuStreamWriteValue64_v2(void *stream, unsigned long long addr, unsigned long long value,
                            unsigned flags) {
    if (deinitialized()) return DEINITIALIZED;
    pthread_mutex_lock(&lock);
    int status = current_usable();
    stream_t *s = status == SUCCESS ? stream_of(stream) : NULL;
    if (status == SUCCESS && s == NULL) status = INVALID_CONTEXT;
    if (status == SUCCESS) status = implicit_dependency(s);
    host_alloc_t *a = NULL;
    if (status == SUCCESS) {
        a = addr % 8 == 0 && addr >= DEVICE_ALIAS ? host_alloc_of((void *)(uintptr_t)(addr - DEVICE_ALIAS), 8) : NULL;
        if (flags > 1 || a == NULL || !(a->flags & MEMHOSTALLOC_DEVICEMAP) ||
            (a->ctx != s->ctx && !(a->flags & MEMHOSTALLOC_PORTABLE)))
            status = INVALID_VALUE;
    }
    if (status == SUCCESS && (refuse_word_mask & 8)) status = NOT_SUPPORTED;
    /* The race of fakeCudaCaptureNextWordWrite: another thread begins a
     * relaxed capture of the stream just before the write and ends it just
     * after, keeping the graph. */
    int race = status == SUCCESS && capture_next_word_write && !ongoing(s->capture) &&
               s->kind != LEGACY && next_capture < CAPTURES;
    int race_id = 0;
    if (race) {
        race_id = next_capture++;
        captures[race_id] = (capture_t){.state = CAPTURE_ACTIVE, .mode = MODE_RELAXED, .owner = pthread_self()};
        s->capture = race_id;
        capture_next_word_write = 0;
    }
    int captured = status == SUCCESS ? captured_work(s, 0) : 0;
    if (captured < 0) status = -captured;
    unsigned long long *host = (unsigned long long *)(uintptr_t)(addr - DEVICE_ALIAS);
    /* "When a stream is in capture mode, all operations pushed into the
     * stream will not be executed, but will instead be captured into a
     * graph" (cuStreamBeginCapture): the write is a node, made at each
     * launch (see cuGraphLaunch). */
    if (status == SUCCESS && captured) status = capture_write(s->capture, host, value);
    if (race) {
        capture_t *c = &captures[race_id];
        graph_t *g = calloc(1, sizeof *g);
        if (g != NULL) {
            *g = (graph_t){s->ctx, c->duration, c->writes, c->nwrites};
            c->writes = NULL;
            c->nwrites = c->capacity = 0;
        }
        free_graph(race_graph);
        race_graph = g;
        race_generation = s->ctx->generation;
        end_capture(s->ctx, race_id);
    }
    if (status == SUCCESS) {
        writes_accepted++;
        writes_captured += captured;
    }
    if (status == SUCCESS && !captured) {
        /* No device time, but later work on the stream (and, from the
         * legacy stream, on the blocking ones) comes after it, as after
         * write_u32; this also keeps a stream's writes in order. */
        s->busy_until = ready_at(s);
        status = queue_write(host, value, s->busy_until, s->ctx);
    }
    pthread_mutex_unlock(&lock);
    hold_here(&write_hold);
    return status;
}

int fakeCudaHoldNextWrite(int arm) { return hold_arm(&write_hold, arm); }

int fakeCudaWriteHeld(int unused) {
    (void)unused;
    return atomic_load(&write_hold.held);
}

int fakeCudaRefuseProgressWord(int mask) {
    pthread_mutex_lock(&lock);
    int previous = refuse_word_mask;
    refuse_word_mask = mask;
    pthread_mutex_unlock(&lock);
    return previous;
}

int fakeCudaHostAllocations(int device) {
    if (device < 0 || device >= DEVICES) return -1;
    pthread_mutex_lock(&lock);
    int live = 0;
    for (host_alloc_t *a = host_allocs; a; a = a->next) live += a->ctx == &contexts[device];
    pthread_mutex_unlock(&lock);
    return live;
}

int fakeCudaStreamWrites(int captured) { return captured ? writes_captured : writes_accepted; }

int fakeCudaWritesAfterFree(int unused) {
    (void)unused;
    pthread_mutex_lock(&lock);
    int count = writes_after_free;
    pthread_mutex_unlock(&lock);
    return count;
}

int fakeCudaPendingWrites(int unused) {
    (void)unused;
    pthread_mutex_lock(&lock);
    int count = 0;
    for (size_t i = 0; i < pending_len; i++) count += pending[i].host != NULL;
    pthread_mutex_unlock(&lock);
    return count;
}

int fakeCudaHostMemorySynchronizes(int on) {
    pthread_mutex_lock(&lock);
    int previous = host_memory_synchronizes;
    host_memory_synchronizes = on;
    pthread_mutex_unlock(&lock);
    return previous;
}

int fakeCudaHostMemoryCalls(int all) {
    return all ? atomic_load(&host_memory_calls_all) : host_memory_calls;
}

int fakeCudaCaptureNextWordWrite(int arm) {
    capture_next_word_write = arm;
    return 0;
}

int fakeCudaLaunchRaceGraph(int unused) {
    (void)unused;
    pthread_mutex_lock(&lock);
    graph_t *x = race_graph;
    int freed = -1;
    /* As a user's thread would launch it: on the context's legacy stream,
     * while the context lives (it is not torn down and made again since). */
    if (x != NULL && x->ctx->retains > 0 && x->ctx->generation == race_generation && !faulted(x->ctx)) {
        stream_t *s = &x->ctx->legacy;
        int64_t start = ready_at(s);
        s->busy_until = start + x->duration;
        freed = replay_writes(x, s, start);
    }
    pthread_mutex_unlock(&lock);
    return freed;
}
/* ---- end of host-mapped memory and stream writes ---- */

/* ---- Device memory and copies ----
 * Driver API "Memory Management" and the "API synchronization behavior"
 * page (https://docs.nvidia.com/cuda/cuda-driver-api/api-sync-behavior.html),
 * for the calls cudarc 0.19's safe API makes (CudaStream::alloc, alloc_zeros,
 * memset_zeros, memcpy_htod/dtoh/dtod, clone_htod/dtoh/dtod, a CudaSlice's
 * drop) and their synchronous forms:
 * - Device memory is host memory the fake allocates, at device addresses
 *   of its own (from DEVICE_MEMORY_BASE, never handed out twice, with a gap
 *   after each allocation), so a host pointer, a freed or unknown address
 *   or a range past an allocation's end is CUDA_ERROR_INVALID_VALUE, never a
 *   crash. 4 GiB per device (cuDeviceTotalMem_v2, cuMemGetInfo_v2); more is
 *   CUDA_ERROR_OUT_OF_MEMORY. New memory reads 0xa5 bytes: "The memory is
 *   not cleared" (cuMemAlloc).
 * - The context of a call: the docs are silent on whether the memory
 *   calls need their context current, and these calls are the user's, not
 *   the crate's (cudarc 0.19 frees a CudaSlice on drop with cuMemFreeAsync,
 *   or a stream synchronize and cuMemFree_v2, without binding its context
 *   when it tracks no events for the slice; a tokio task drops it on
 *   whichever worker thread it resumed on). So the fake reads them the
 *   lenient way, never stricter than the driver: a call with a created
 *   stream takes the stream's context, and cuMemFree_v2 and the synchronous
 *   copies and sets the context of the allocation their device address is
 *   in (with unified addressing a device pointer names its context;
 *   cuMemcpyPeer: the contexts given), whatever is current. Only a call
 *   whose handles name no context needs one current: cuMemAlloc_v2
 *   ("Allocates bytesize bytes of linear memory on the device"; cuMemAlloc
 *   allocates in the current context), cuMemGetInfo_v2, and the default
 *   streams (NULL, CU_STREAM_LEGACY, CU_STREAM_PER_THREAD, the current
 *   context's), else CUDA_ERROR_INVALID_CONTEXT. The named context is
 *   checked as a current one is: torn down (CUDA_ERROR_CONTEXT_IS_DESTROYED,
 *   and the calling thread's stale binding of it where it is current) or
 *   faulted (the sticky fault).
 * - cuMemAlloc_v2 ("If bytesize is 0, cuMemAlloc() returns
 *   CUDA_ERROR_INVALID_VALUE") and cuMemFree_v2 of an allocation's start,
 *   whichever context is current; after a sticky fault it fails with the
 *   fault but still frees.
 * - Stream-ordered allocation: attribute 115
 *   (CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED) reads 1, as on current
 *   GPUs, so cudarc allocates with cuMemAllocAsync and frees with
 *   cuMemFreeAsync; FAKE_CUDA_NO_MEMORY_POOLS=1 makes it read 0 (cudarc then
 *   uses cuMemAlloc_v2, and a stream synchronize and cuMemFree_v2 on drop).
 *   cuMemAllocAsync's memory is there at once (zero bytes is allowed: cudarc's
 *   CudaStream::null asks for it); after cuMemFreeAsync the address is
 *   refused by every call ("After this API returns, accessing the memory from
 *   any subsequent work launched on the GPU ... results in undefined
 *   behavior"), and copies queued before it still run: each queued copy or
 *   set keeps the memory it touches until it is made.
 * - Device addresses are checked against the context they are used in: the
 *   stream's (for a synchronous copy, the first device address's), or for
 *   cuMemcpyPeer(Async) the context given with each (the strict reading:
 *   another context's memory is CUDA_ERROR_INVALID_VALUE).
 *   Device addresses of mapped page-locked memory
 *   (cuMemHostGetDevicePointer_v2) are device memory here too.
 * - Copies (cuMemcpyHtoD/DtoH/DtoD_v2, their Async_v2 forms, cuMemcpyPeer
 *   and cuMemcpyPeerAsync) and sets (cuMemsetD8/D16/D32_v2 and Async) are
 *   queued on their stream (the synchronous forms on the context's legacy
 *   default stream: they are the calls "that operate on a stream implicitly",
 *   "Stream synchronization behavior") and made in stream order, by the copy
 *   engine thread, when the stream gets there: after the work queued before
 *   them, the sleep kernel's included, and before any event recorded after
 *   them completes (see run_due). They take no device time; a faulted
 *   context makes none due at or after its fault. A copy or set on a
 *   capturing stream is CUDA_ERROR_NOT_SUPPORTED: the fake's graphs hold
 *   sleeps and word writes only.
 * - How long the calling thread waits, from the sync page: "For transfers
 *   from pageable host memory to device memory, a stream sync is performed
 *   before the copy is initiated. The function will return once the pageable
 *   buffer has been copied to the staging memory ..., but the DMA to final
 *   destination may not have completed" (cuMemcpyHtoD_v2: the source is
 *   copied at the call, the call returns once the legacy stream gets there,
 *   the bytes land after); "For transfers from pinned host memory to device
 *   memory, the function is synchronous with respect to the host" and "For
 *   transfers from device to either pageable or pinned host memory, the
 *   function returns only once the copy has completed" (returns once made);
 *   "For transfers from device memory to device memory, no host-side
 *   synchronization is performed" (returns at once). Async forms: "For all
 *   other transfers, the function should be fully asynchronous" (pinned host
 *   memory: returns at once; the host bytes are read or written when the
 *   copy is made, so a reader must wait for the stream); "For transfers
 *   between device memory and pageable host memory, the function might be
 *   synchronous with respect to host" and "If pageable memory must first be
 *   staged to pinned memory, the driver may synchronize with the stream and
 *   stage the copy": a pageable source is copied at the call (returns at
 *   once, as cudarc's clone_htod of a temporary needs), a pageable
 *   destination is written before the call returns (as cudarc's clone_dtoh
 *   needs, and as the CUDA 11 page said outright: "For transfers from device
 *   memory to pageable host memory, the function will return only once the
 *   copy has completed"). Sets: "The synchronous memset functions are
 *   asynchronous with respect to the host except when the target is pinned
 *   host memory ... The Async versions are always asynchronous" (a
 *   synchronous set of mapped page-locked memory returns once made).
 *   "Pinned" is memory from cuMemHostAlloc; a host range that runs past the
 *   end of such an allocation is CUDA_ERROR_INVALID_VALUE.
 * - Freeing page-locked memory drops the copies queued to or from it (never
 *   made, as its word writes); a context torn down makes those due by then
 *   and drops the rest, and frees its device memory.
 */
#define DEVICE_MEMORY_BASE 0x200000000000ULL
#define DEVICE_MEMORY_TOTAL ((size_t)4 << 30)

struct dev_alloc {
    unsigned long long dptr;
    size_t size;
    unsigned char *bytes;
    ctx_t *ctx;
    int refs; /* the table's while live, and each queued copy's or set's */
    struct dev_alloc *next;
};

static dev_alloc_t *dev_allocs; /* the live allocations */
static unsigned long long next_dptr = DEVICE_MEMORY_BASE;
static size_t dev_bytes[DEVICES]; /* live bytes of each device */

static void unref(dev_alloc_t *a) {
    if (a != NULL && --a->refs == 0) {
        free(a->bytes);
        free(a);
    }
}

/* Make a queued copy or set (popped by run_due), unless dropped, due at or
 * after its context's fault, or of a context torn down since. Called with
 * the lock held. */
static void make_copy(pending_write_t *w) {
    if (!w->dropped && w->at < w->ctx->fault_at && w->ctx->generation == w->generation) {
        if (w->src != NULL) {
            memmove(w->dst, w->src, w->bytes);
        } else if (w->elem == 1) {
            memset(w->dst, (int)(w->value & 0xff), w->bytes);
        } else {
            uint16_t v16 = (uint16_t)w->value;
            uint32_t v32 = (uint32_t)w->value;
            const void *pattern = w->elem == 2 ? (const void *)&v16 : (const void *)&v32;
            for (size_t i = 0; i + w->elem <= w->bytes; i += w->elem) memcpy(w->dst + i, pattern, w->elem);
        }
        if (w->made != NULL) *w->made = 1;
    }
    free(w->staging);
    unref(w->holds[0]);
    unref(w->holds[1]);
}

static int overlaps(const void *a, size_t an, const void *b, size_t bn) {
    const char *x = a, *y = b;
    return x < y + bn && y < x + an;
}

/* Drop the queued copies and sets that touch [p, p + size). Called with the
 * lock held. */
static void drop_copies(const void *p, size_t size) {
    for (size_t i = 0; i < pending_len; i++) {
        pending_write_t *w = &pending[i];
        if (w->host == NULL && !w->dropped &&
            (overlaps(w->dst, w->bytes, p, size) || (w->src != NULL && overlaps(w->src, w->bytes, p, size))))
            w->dropped = 1;
    }
}

/* Drop the queued copy numbered `seq`, if still queued: its caller stops
 * waiting for it. Called with the lock held. */
static void drop_op(unsigned long long seq) {
    for (size_t i = 0; i < pending_len; i++) {
        if (pending[i].seq == seq) {
            pending[i].dropped = 1;
            pending[i].made = NULL;
        }
    }
}

/* Unlink and release an allocation. Called with the lock held. */
static void free_device(dev_alloc_t **link) {
    dev_alloc_t *a = *link;
    *link = a->next;
    dev_bytes[a->ctx->device] -= a->size;
    unref(a);
}

static void free_device_memory(ctx_t *c) {
    for (dev_alloc_t **link = &dev_allocs; *link;) {
        if ((*link)->ctx == c) free_device(link);
        else link = &(*link)->next;
    }
}

/* The link to the live allocation starting at `dptr`, or to NULL. */
static dev_alloc_t **alloc_at(unsigned long long dptr) {
    dev_alloc_t **link = &dev_allocs;
    while (*link && (*link)->dptr != dptr) link = &(*link)->next;
    return link;
}

static int alloc_device(unsigned long long *dptr, size_t bytesize, ctx_t *c) {
    if (bytesize > DEVICE_MEMORY_TOTAL - dev_bytes[c->device]) return OUT_OF_MEMORY;
    dev_alloc_t *a = calloc(1, sizeof *a);
    unsigned char *bytes = malloc(bytesize > 0 ? bytesize : 1);
    if (a == NULL || bytes == NULL) {
        free(a);
        free(bytes);
        return OUT_OF_MEMORY;
    }
    memset(bytes, 0xa5, bytesize);
    *a = (dev_alloc_t){.dptr = next_dptr, .size = bytesize, .bytes = bytes, .ctx = c, .refs = 1, .next = dev_allocs};
    next_dptr += ((bytesize + 4095) & ~(unsigned long long)4095) + 4096;
    dev_allocs = a;
    dev_bytes[c->device] += bytesize;
    *dptr = a->dptr;
    return SUCCESS;
}

/* Context `c`, named by a handle of a memory call, may be used now,
 * current or not, and whatever the calling thread's binding (see "The
 * context of a call" above). Called with the lock held. */
static int named_usable(const ctx_t *c) {
    if (deinitialized()) return DEINITIALIZED;
    if (c->retains == 0) return CONTEXT_IS_DESTROYED;
    if (faulted(c)) return ILLEGAL_ADDRESS;
    return SUCCESS;
}

/* The stream a memory call's handle names: a created stream in its own
 * context, a default stream in the current one. Found also after a sticky
 * fault (the status then), for a free. Called with the lock held. */
static int memory_stream(void *handle, stream_t **s) {
    *s = NULL;
    int status;
    if (handle == NULL || handle == STREAM_LEGACY || handle == STREAM_PER_THREAD) {
        status = current_usable();
        if (status == SUCCESS || status == ILLEGAL_ADDRESS) *s = stream_of(handle);
    } else {
        stream_t *named = handle;
        status = named_usable(named->ctx);
        if (status == SUCCESS || status == ILLEGAL_ADDRESS) *s = named;
    }
    return status == SUCCESS && *s == NULL ? INVALID_CONTEXT : status;
}

int cuMemAlloc_v2(unsigned long long *dptr, size_t bytesize) {
    if (deinitialized()) return DEINITIALIZED;
    pthread_mutex_lock(&lock);
    int status = current_usable();
    if (status == SUCCESS && (dptr == NULL || bytesize == 0)) status = INVALID_VALUE;
    if (status == SUCCESS) status = alloc_device(dptr, bytesize, current);
    pthread_mutex_unlock(&lock);
    return status;
}

int cuMemAllocAsync(unsigned long long *dptr, size_t bytesize, void *stream) {
    if (deinitialized()) return DEINITIALIZED;
    pthread_mutex_lock(&lock);
    stream_t *s;
    int status = memory_stream(stream, &s);
    if (status == SUCCESS) status = implicit_dependency(s);
    if (status == SUCCESS && ongoing(s->capture)) status = NOT_SUPPORTED;
    if (status == SUCCESS && dptr == NULL) status = INVALID_VALUE;
    if (status == SUCCESS) status = alloc_device(dptr, bytesize, s->ctx);
    pthread_mutex_unlock(&lock);
    return status;
}

int cuMemFree_v2(unsigned long long dptr) {
    if (deinitialized()) return DEINITIALIZED;
    pthread_mutex_lock(&lock);
    dev_alloc_t **link = alloc_at(dptr);
    int status = *link != NULL ? named_usable((*link)->ctx) : current == NULL ? INVALID_CONTEXT : INVALID_VALUE;
    if (*link != NULL && (status == SUCCESS || status == ILLEGAL_ADDRESS)) free_device(link);
    pthread_mutex_unlock(&lock);
    return status;
}

int cuMemFreeAsync(unsigned long long dptr, void *stream) {
    if (deinitialized()) return DEINITIALIZED;
    pthread_mutex_lock(&lock);
    stream_t *s;
    int status = memory_stream(stream, &s);
    /* After a sticky fault the call fails with it but still frees. */
    int fault = status == ILLEGAL_ADDRESS;
    if (fault) status = s == NULL ? INVALID_CONTEXT : SUCCESS;
    dev_alloc_t **link = alloc_at(dptr);
    if (status == SUCCESS && (*link == NULL || (*link)->ctx != s->ctx)) status = INVALID_VALUE;
    if (status == SUCCESS && !fault) status = implicit_dependency(s);
    if (status == SUCCESS && !fault && ongoing(s->capture)) status = NOT_SUPPORTED;
    if (status == SUCCESS) free_device(link);
    if (status == SUCCESS && fault) status = ILLEGAL_ADDRESS;
    pthread_mutex_unlock(&lock);
    return status;
}

int cuMemGetInfo_v2(size_t *free_bytes, size_t *total) {
    if (deinitialized()) return DEINITIALIZED;
    pthread_mutex_lock(&lock);
    int status = current_usable();
    if (status == SUCCESS && (free_bytes == NULL || total == NULL)) status = INVALID_VALUE;
    if (status == SUCCESS) {
        *total = DEVICE_MEMORY_TOTAL;
        *free_bytes = DEVICE_MEMORY_TOTAL - dev_bytes[current->device];
    }
    pthread_mutex_unlock(&lock);
    return status;
}

int cuDeviceTotalMem_v2(size_t *bytes, int device) {
    if (deinitialized()) return DEINITIALIZED;
    if (bytes == NULL) return INVALID_VALUE;
    if (device < 0 || device >= DEVICES) return INVALID_DEVICE;
    *bytes = DEVICE_MEMORY_TOTAL;
    return SUCCESS;
}

/* One end of a copy: a device address (of `ctx`, or NULL: of the stream's
 * context) or host memory. */
typedef struct {
    int device;
    unsigned long long address;
    void *ctx;
    const void *host;
} end_t;

#define ON_DEVICE(address, ctx) ((end_t){1, (address), (ctx), NULL})
#define ON_HOST(pointer) ((end_t){0, 0, NULL, (pointer)})

/* Where an end's bytes are. */
enum { PAGEABLE, PINNED, DEVICE_MEMORY, MAPPED };

/* Resolve `e` for `bytes` bytes in context `c`: its bytes, the device
 * allocation holding them (or NULL) and its kind; or a status. Called with
 * the lock held. */
static int resolve(end_t e, const ctx_t *c, size_t bytes, unsigned char **p, dev_alloc_t **hold, int *kind) {
    *hold = NULL;
    if (!e.device) {
        if (e.host == NULL) return INVALID_VALUE;
        *p = (unsigned char *)(uintptr_t)e.host;
        *kind = PAGEABLE;
        for (host_alloc_t *a = host_allocs; a; a = a->next) {
            if (!overlaps(e.host, bytes, a->p, a->size)) continue;
            /* Page-locked only if wholly inside one allocation. */
            if ((const char *)e.host < (char *)a->p || bytes > a->size - (size_t)((const char *)e.host - (char *)a->p))
                return INVALID_VALUE;
            *kind = PINNED;
        }
        return SUCCESS;
    }
    if (e.ctx != NULL) {
        if (!is_context(e.ctx) || ((ctx_t *)e.ctx)->retains == 0) return INVALID_CONTEXT;
        c = e.ctx;
    }
    unsigned long long d = e.address;
    for (dev_alloc_t *a = dev_allocs; a; a = a->next) {
        if (d < a->dptr || d - a->dptr > a->size || bytes > a->size - (d - a->dptr)) continue;
        if (a->ctx != c) return INVALID_VALUE;
        *p = a->bytes + (d - a->dptr);
        *hold = a;
        *kind = DEVICE_MEMORY;
        return SUCCESS;
    }
    if (d >= DEVICE_ALIAS) {
        host_alloc_t *a = host_alloc_of((void *)(uintptr_t)(d - DEVICE_ALIAS), bytes);
        if (a != NULL && (a->flags & MEMHOSTALLOC_DEVICEMAP) && (a->ctx == c || (a->flags & MEMHOSTALLOC_PORTABLE))) {
            *p = (unsigned char *)(uintptr_t)(d - DEVICE_ALIAS);
            *kind = MAPPED;
            return SUCCESS;
        }
    }
    return INVALID_VALUE;
}

/* The context a device end names: the one given with it (cuMemcpyPeer), or
 * the one whose allocation (or mapped page-locked memory) holds its address;
 * NULL for a host end or an unknown address. Called with the lock held. */
static ctx_t *named_context(const end_t *e) {
    if (e == NULL || !e->device) return NULL;
    if (e->ctx != NULL) return is_context(e->ctx) && ((ctx_t *)e->ctx)->retains > 0 ? e->ctx : NULL;
    unsigned long long d = e->address;
    for (dev_alloc_t *a = dev_allocs; a; a = a->next)
        if (d >= a->dptr && d - a->dptr < (a->size > 0 ? a->size : 1)) return a->ctx;
    if (d >= DEVICE_ALIAS) {
        host_alloc_t *a = host_alloc_of((void *)(uintptr_t)(d - DEVICE_ALIAS), 1);
        if (a != NULL && (a->flags & MEMHOSTALLOC_DEVICEMAP)) return a->ctx;
    }
    return NULL;
}

/* How long a call waits for what it queued (see the header of this part). */
enum { NO_WAIT, STREAM_WAIT, MADE_WAIT };

/* Queue a copy (`src` non-NULL) or a set of `bytes` bytes of the
 * `elem`-byte pattern `value` on `stream` (the legacy stream for a
 * synchronous form, `sync_api`), and wait as its form and memory say. */
static int transfer(void *stream, int sync_api, end_t dst, const end_t *src, unsigned value, unsigned elem,
                    size_t bytes) {
    if (deinitialized()) return DEINITIALIZED;
    pthread_mutex_lock(&lock);
    stream_t *s = NULL;
    int status;
    if (sync_api) {
        /* On the legacy stream of the context its device addresses name. */
        ctx_t *c = named_context(&dst);
        if (c == NULL) c = named_context(src);
        status = c != NULL ? named_usable(c) : current_usable();
        if (status == SUCCESS) s = c != NULL ? &c->legacy : &current->legacy;
    } else {
        status = memory_stream(stream, &s);
    }
    if (status == SUCCESS) status = implicit_dependency(s);
    if (status == SUCCESS && ongoing(s->capture)) status = NOT_SUPPORTED;
    /* Larger than any allocation: refused before any arithmetic on it. */
    if (status == SUCCESS && bytes > ((size_t)1 << 46)) status = INVALID_VALUE;
    if (status != SUCCESS || bytes == 0) {
        pthread_mutex_unlock(&lock);
        return status;
    }
    pending_write_t w = {.ctx = s->ctx, .generation = s->ctx->generation, .bytes = bytes, .elem = elem, .value = value};
    int dst_kind = PAGEABLE, src_kind = DEVICE_MEMORY;
    status = resolve(dst, s->ctx, bytes, &w.dst, &w.holds[0], &dst_kind);
    unsigned char *from = NULL;
    if (status == SUCCESS && src != NULL) status = resolve(*src, s->ctx, bytes, &from, &w.holds[1], &src_kind);
    int wait = NO_WAIT;
    if (status == SUCCESS) {
        if (src == NULL) {
            wait = sync_api && dst_kind == MAPPED ? MADE_WAIT : NO_WAIT;
        } else if (dst_kind == PAGEABLE) {
            wait = MADE_WAIT;
        } else if (dst_kind == PINNED || src_kind == PINNED) {
            wait = sync_api ? MADE_WAIT : NO_WAIT;
        } else if (src_kind == PAGEABLE) {
            w.staging = malloc(bytes);
            if (w.staging == NULL) status = OUT_OF_MEMORY;
            else memcpy(w.staging, from, bytes);
            from = w.staging;
            wait = sync_api ? STREAM_WAIT : NO_WAIT;
        }
        w.src = from;
    }
    int made = 0;
    int64_t at = 0, fault_at = 0;
    unsigned long long seq = pending_seq;
    ctx_t *c = s->ctx;
    if (status == SUCCESS) {
        at = ready_at(s);
        fault_at = c->fault_at;
        w.at = at;
        if (wait == MADE_WAIT) w.made = &made;
        if (w.holds[0] != NULL) w.holds[0]->refs++;
        if (w.holds[1] != NULL) w.holds[1]->refs++;
        status = queue_op(w);
        if (status == SUCCESS) {
            s->busy_until = at;
        } else {
            unref(w.holds[0]);
            unref(w.holds[1]);
        }
    }
    if (status != SUCCESS) free(w.staging);
    pthread_mutex_unlock(&lock);
    if (status != SUCCESS || wait == NO_WAIT) return status;
    sleep_until(min64(at, fault_at));
    if (wait == STREAM_WAIT) {
        if (deinitialized()) return DEINITIALIZED;
        return faulted(c) ? ILLEGAL_ADDRESS : SUCCESS;
    }
    pthread_mutex_lock(&lock);
    run_due(now_ns());
    if (!made) {
        /* Not made, and never to be: the caller's memory is its own again. */
        drop_op(seq);
        status = atomic_load(&torn_down) ? DEINITIALIZED
                 : faulted(c)            ? ILLEGAL_ADDRESS
                 : c->generation != w.generation ? CONTEXT_IS_DESTROYED
                                                 : INVALID_VALUE;
    }
    pthread_mutex_unlock(&lock);
    return status;
}

int cuMemcpyHtoD_v2(unsigned long long dst, const void *src, size_t bytes) {
    end_t from = ON_HOST(src);
    return transfer(NULL, 1, ON_DEVICE(dst, NULL), &from, 0, 0, bytes);
}

int cuMemcpyDtoH_v2(void *dst, unsigned long long src, size_t bytes) {
    end_t from = ON_DEVICE(src, NULL);
    return transfer(NULL, 1, ON_HOST(dst), &from, 0, 0, bytes);
}

int cuMemcpyDtoD_v2(unsigned long long dst, unsigned long long src, size_t bytes) {
    end_t from = ON_DEVICE(src, NULL);
    return transfer(NULL, 1, ON_DEVICE(dst, NULL), &from, 0, 0, bytes);
}

int cuMemcpyHtoDAsync_v2(unsigned long long dst, const void *src, size_t bytes, void *stream) {
    end_t from = ON_HOST(src);
    return transfer(stream, 0, ON_DEVICE(dst, NULL), &from, 0, 0, bytes);
}

int cuMemcpyDtoHAsync_v2(void *dst, unsigned long long src, size_t bytes, void *stream) {
    end_t from = ON_DEVICE(src, NULL);
    return transfer(stream, 0, ON_HOST(dst), &from, 0, 0, bytes);
}

int cuMemcpyDtoDAsync_v2(unsigned long long dst, unsigned long long src, size_t bytes, void *stream) {
    end_t from = ON_DEVICE(src, NULL);
    return transfer(stream, 0, ON_DEVICE(dst, NULL), &from, 0, 0, bytes);
}

int cuMemcpyPeer(unsigned long long dst, void *dst_ctx, unsigned long long src, void *src_ctx, size_t bytes) {
    if (dst_ctx == NULL || src_ctx == NULL) return INVALID_CONTEXT;
    end_t from = ON_DEVICE(src, src_ctx);
    return transfer(NULL, 1, ON_DEVICE(dst, dst_ctx), &from, 0, 0, bytes);
}

int cuMemcpyPeerAsync(unsigned long long dst, void *dst_ctx, unsigned long long src, void *src_ctx, size_t bytes,
                      void *stream) {
    if (dst_ctx == NULL || src_ctx == NULL) return INVALID_CONTEXT;
    end_t from = ON_DEVICE(src, src_ctx);
    return transfer(stream, 0, ON_DEVICE(dst, dst_ctx), &from, 0, 0, bytes);
}

/* A set of `count` `elem`-byte values; the address must be aligned to one. */
static int set(unsigned long long dst, unsigned value, unsigned elem, size_t count, void *stream, int sync_api) {
    if (count > ((size_t)1 << 46) || dst % elem != 0) {
        if (deinitialized()) return DEINITIALIZED;
        return INVALID_VALUE;
    }
    return transfer(stream, sync_api, ON_DEVICE(dst, NULL), NULL, value, elem, count * elem);
}

int cuMemsetD8_v2(unsigned long long dst, unsigned char value, size_t count) {
    return set(dst, value, 1, count, NULL, 1);
}
int cuMemsetD16_v2(unsigned long long dst, unsigned short value, size_t count) {
    return set(dst, value, 2, count, NULL, 1);
}
int cuMemsetD32_v2(unsigned long long dst, unsigned value, size_t count) {
    return set(dst, value, 4, count, NULL, 1);
}
int cuMemsetD8Async(unsigned long long dst, unsigned char value, size_t count, void *stream) {
    return set(dst, value, 1, count, stream, 0);
}
int cuMemsetD16Async(unsigned long long dst, unsigned short value, size_t count, void *stream) {
    return set(dst, value, 2, count, stream, 0);
}
int cuMemsetD32Async(unsigned long long dst, unsigned value, size_t count, void *stream) {
    return set(dst, value, 4, count, stream, 0);
}

/* Test hook: the live device allocations of device's context. */
int fakeCudaDeviceAllocations(int device) {
    if (device < 0 || device >= DEVICES) return -1;
    pthread_mutex_lock(&lock);
    int live = 0;
    for (dev_alloc_t *a = dev_allocs; a; a = a->next) live += a->ctx == &contexts[device];
    pthread_mutex_unlock(&lock);
    return live;
}
/* ---- end of device memory and copies ---- */

/* Test hooks: not part of the driver API. */
int fakeCudaLiveEvents(int device) {
    if (device < 0 || device >= DEVICES) return -1;
    pthread_mutex_lock(&lock);
    int live = contexts[device].live_events;
    pthread_mutex_unlock(&lock);
    return live;
}

/* The next cuEventQuery returns `status`, whatever it is: a status the
 * caller's bindings may not know (a newer driver's). */
int fakeCudaFailNextQuery(int status) {
    pthread_mutex_lock(&lock);
    next_query_status = status;
    pthread_mutex_unlock(&lock);
    return 0;
}

int fakeCudaEventsCreated(int device) {
    if (device < 0 || device >= DEVICES) return -1;
    pthread_mutex_lock(&lock);
    int created = contexts[device].created_events;
    pthread_mutex_unlock(&lock);
    return created;
}

/* How many times cuCtxSetCurrent made device's context current. */
int fakeCudaContextSwitches(int device) {
    if (device < 0 || device >= DEVICES) return -1;
    pthread_mutex_lock(&lock);
    int switches = contexts[device].switches;
    pthread_mutex_unlock(&lock);
    return switches;
}

/* How many times device's primary context was made (retained from none),
 * and asked about with cuDevicePrimaryCtxGetState. */
int fakeCudaPrimaryMade(int device) {
    if (device < 0 || device >= DEVICES) return -1;
    pthread_mutex_lock(&lock);
    int made = contexts[device].made;
    pthread_mutex_unlock(&lock);
    return made;
}

int fakeCudaPrimaryStateAsks(int device) {
    if (device < 0 || device >= DEVICES) return -1;
    pthread_mutex_lock(&lock);
    int asks = contexts[device].state_asks;
    pthread_mutex_unlock(&lock);
    return asks;
}

int fakeCudaPrimaryRetains(int device) {
    if (device < 0 || device >= DEVICES) return -1;
    pthread_mutex_lock(&lock);
    int retains = contexts[device].retains;
    pthread_mutex_unlock(&lock);
    return retains;
}
