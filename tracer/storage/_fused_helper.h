/* tracer.storage._fused's helper thread (included by _fused.c, after run_chunks).
 *
 * One helper thread, started on first use, does two kinds of work:
 *
 * Shared jobs (run_shared): the caller and the helper take the chunks of one large tensor from
 * an atomic counter until none is left, so a helper that is slow to wake (an idle virtual CPU
 * can take hundreds of microseconds) costs nothing: the caller just does more chunks. Each
 * chunk's sums land in its own slot and are combined in chunk order, so the result never
 * depends on who did what. The caller closes the job when its loop ends and waits only for a
 * chunk the helper is still computing. A caller that finds the helper in use by another
 * thread works alone.
 *
 * Queued jobs (queue_submit / queue_collect): the statistics of a tensor the caller does not
 * wait for; the helper computes them alone, in submission order, and the caller collects the
 * result later. The caller must keep the memory alive and unchanged until it collects. A full
 * queue, or a helper that could not start, answers -1 and the caller computes the statistics
 * itself. A shared job posted while the helper runs a queued one is done by its caller alone.
 *
 * After a job the helper spins (yielding the core) for SPIN_NS, since hooks call in bursts,
 * then sleeps. After fork() the child starts its own helper; jobs queued in the parent are
 * lost to the child (collect answers "lost"). */
#ifndef _WIN32
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <time.h>
#define HAVE_HELPER 1
#define SPIN_NS 2000000
enum { JOB_IDLE = 0, JOB_POSTED = 1, JOB_RUNNING = 2, JOB_DONE = 3, JOB_CLOSED = 4 };
static pthread_mutex_t helper_mu = PTHREAD_MUTEX_INITIALIZER;  /* with helper_cv: sleeping */
static pthread_cond_t helper_cv = PTHREAD_COND_INITIALIZER;
static pthread_mutex_t helper_owner = PTHREAD_MUTEX_INITIALIZER;  /* held by the caller using it */
static pthread_mutex_t helper_start_mu = PTHREAD_MUTEX_INITIALIZER;
static int helper_started = 0, helper_failed = 0;
static atomic_int job_state = JOB_IDLE;
static atomic_llong job_next;  /* the next chunk to take */
static struct {
    const work_t *work;
    int64_t nchunks;
    acc_t acc;  /* the helper's min/max/counts */
    double *sums, *sqs;
    float *scratch[2];  /* OP_DIFF without dst: the caller's, the helper's */
} job;

/* The queue: QSLOTS slots used round-robin by ticket number (ticket % QSLOTS). A slot is
 * FREE, QUEUED (submitted, not computed), DONE (result ready) or LOST (queued before a fork,
 * in the child). Tickets are handed out under q_mu; the helper alone advances q_head. */
#define QSLOTS 256
#define QMAX_CHUNKS 64 /* queued tensors hold at most 64 chunks (4M elements) */
enum { SLOT_FREE = 0, SLOT_QUEUED = 1, SLOT_DONE = 2, SLOT_LOST = 3 };
typedef struct {
    atomic_int state;
    long long ticket;
    work_t work;
    acc_t acc;
    uint64_t nan, pinf, ninf;
    double sums[QMAX_CHUNKS], sqs[QMAX_CHUNKS];
} slot_t;
static slot_t slots[QSLOTS];
static pthread_mutex_t q_mu = PTHREAD_MUTEX_INITIALIZER;
static atomic_llong q_tail;  /* the next ticket to hand out */
static atomic_llong q_head;  /* the next ticket the helper computes */
static pthread_mutex_t done_mu = PTHREAD_MUTEX_INITIALIZER;  /* with done_cv: collectors */
static pthread_cond_t done_cv = PTHREAD_COND_INITIALIZER;
static atomic_int done_waiters;

static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

/* Take chunks until none is left; min/max/counts into acc, sums into the job's slots. */
static void take_chunks(acc_t *acc, float *scratch) {
    for (;;) {
        int64_t c = atomic_fetch_add_explicit(&job_next, 1, memory_order_relaxed);
        if (c >= job.nchunks) return;
        run_chunks(job.work, c, c + 1, acc, job.sums, job.sqs, scratch);
    }
}

static void count_special(const work_t *w, uint64_t *nan, uint64_t *pinf, uint64_t *ninf);

/* Compute one queued job completely (combined sums, NaN/Inf counts) into its slot. */
static void run_queued(slot_t *slot) {
    const work_t *w = &slot->work;
    int64_t nchunks = (w->count + CHUNK - 1) / CHUNK;
    acc_t acc = {INFINITY, -INFINITY, 0.0, 0.0, 0, 0};
    run_chunks(w, 0, nchunks, &acc, slot->sums, slot->sqs, NULL);
    for (int64_t c = 0; c < nchunks; c++) {
        acc.sum += slot->sums[c];
        acc.sq += slot->sqs[c];
    }
    slot->nan = slot->pinf = slot->ninf = 0;
    if (isnan(acc.sum) || isinf(acc.mn) || isinf(acc.mx))
        count_special(w, &slot->nan, &slot->pinf, &slot->ninf);
    slot->acc = acc;
    atomic_store(&slot->state, SLOT_DONE);
    if (atomic_load(&done_waiters) > 0) {
        pthread_mutex_lock(&done_mu);
        pthread_cond_broadcast(&done_cv);
        pthread_mutex_unlock(&done_mu);
    }
}

static int helper_has_work(void) {
    return atomic_load_explicit(&job_state, memory_order_acquire) == JOB_POSTED ||
           atomic_load_explicit(&q_head, memory_order_acquire) <
               atomic_load_explicit(&q_tail, memory_order_acquire);
}

static void *helper_main(void *arg) {
    (void)arg;
    int64_t until = now_ns() + SPIN_NS;
    unsigned spins = 0;
    for (;;) {
        int expected = JOB_POSTED;
        if (atomic_compare_exchange_strong_explicit(&job_state, &expected, JOB_RUNNING,
                                                    memory_order_acquire,
                                                    memory_order_relaxed)) {
            acc_t acc = {INFINITY, -INFINITY, 0.0, 0.0, 0, 0};
            take_chunks(&acc, job.scratch[1]);
            job.acc = acc;
            atomic_store_explicit(&job_state, JOB_DONE, memory_order_release);
            until = now_ns() + SPIN_NS;
            continue;
        }
        long long head = atomic_load_explicit(&q_head, memory_order_relaxed);
        if (head < atomic_load_explicit(&q_tail, memory_order_acquire)) {
            run_queued(&slots[head % QSLOTS]);
            atomic_store_explicit(&q_head, head + 1, memory_order_release);
            until = now_ns() + SPIN_NS;
            continue;
        }
        if ((++spins & 63) == 0) {
            if (now_ns() > until) { /* idle: sleep until there is work */
                pthread_mutex_lock(&helper_mu);
                while (!helper_has_work()) pthread_cond_wait(&helper_cv, &helper_mu);
                pthread_mutex_unlock(&helper_mu);
                until = now_ns() + SPIN_NS;
            }
            sched_yield();
        }
    }
    return NULL;
}

static void wake_helper(void) {
    pthread_mutex_lock(&helper_mu); /* it checks for work with this held before sleeping */
    pthread_cond_signal(&helper_cv);
    pthread_mutex_unlock(&helper_mu);
}

static void helper_after_fork(void) {
    pthread_mutex_init(&helper_mu, NULL);
    pthread_cond_init(&helper_cv, NULL);
    pthread_mutex_init(&helper_owner, NULL);
    pthread_mutex_init(&helper_start_mu, NULL);
    pthread_mutex_init(&q_mu, NULL);
    pthread_mutex_init(&done_mu, NULL);
    pthread_cond_init(&done_cv, NULL);
    helper_started = 0;
    helper_failed = 0;
    atomic_store(&job_state, JOB_IDLE);
    atomic_store(&done_waiters, 0);
    for (int i = 0; i < QSLOTS; i++)
        if (atomic_load(&slots[i].state) == SLOT_QUEUED) atomic_store(&slots[i].state, SLOT_LOST);
    atomic_store(&q_head, atomic_load(&q_tail));
}

/* Start the helper if it is not running; 0 when it cannot run. */
static int helper_start(void) {
    int ok;
    pthread_mutex_lock(&helper_start_mu);
    if (!helper_started && !helper_failed) {
        pthread_t t;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        if (pthread_create(&t, &attr, helper_main, NULL) != 0) helper_failed = 1;
        else helper_started = 1;
        pthread_attr_destroy(&attr);
    }
    ok = helper_started;
    pthread_mutex_unlock(&helper_start_mu);
    return ok;
}

/* 1 when the helper is ours until we unlock helper_owner; 0 when the caller works alone. */
static int helper_acquire(void) {
    if (helper_failed || pthread_mutex_trylock(&helper_owner) != 0) return 0;
    if (!helper_start()) {
        pthread_mutex_unlock(&helper_owner);
        return 0;
    }
    return 1;
}

/* All chunks, shared with the helper; its min/max/counts are merged into acc. */
static void run_shared(const work_t *w, int64_t nchunks, acc_t *acc, double *sums, double *sqs,
                       float *scratch0, float *scratch1) {
    job.work = w; job.nchunks = nchunks;
    job.sums = sums; job.sqs = sqs;
    job.scratch[0] = scratch0; job.scratch[1] = scratch1;
    atomic_store_explicit(&job_next, 0, memory_order_relaxed);
    atomic_store_explicit(&job_state, JOB_POSTED, memory_order_release);
    wake_helper();
    take_chunks(acc, scratch0);
    int expected = JOB_POSTED;
    if (atomic_compare_exchange_strong_explicit(&job_state, &expected, JOB_CLOSED,
                                                memory_order_acq_rel, memory_order_acquire)) {
        atomic_store_explicit(&job_state, JOB_IDLE, memory_order_release);
        return; /* the helper never started on it */
    }
    unsigned spins = 0; /* it is running: at most the chunk it holds is left */
    while (atomic_load_explicit(&job_state, memory_order_acquire) != JOB_DONE)
        if ((++spins & 63) == 0) sched_yield();
    acc_t other = job.acc;
    atomic_store_explicit(&job_state, JOB_IDLE, memory_order_release);
    acc->mn = other.mn < acc->mn ? other.mn : acc->mn;
    acc->mx = other.mx > acc->mx ? other.mx : acc->mx;
    acc->zeros += other.zeros;
    acc->checksum += other.checksum;
}

/* Queue the statistics of `w` (OP_STATS, at most QMAX_CHUNKS chunks); its ticket, or -1 when
 * the caller must compute them itself (queue full, helper not running). */
static long long queue_submit(const work_t *w) {
    if ((w->count + CHUNK - 1) / CHUNK > QMAX_CHUNKS || !helper_start()) return -1;
    pthread_mutex_lock(&q_mu);
    long long ticket = atomic_load(&q_tail);
    slot_t *slot = &slots[ticket % QSLOTS];
    if (atomic_load(&slot->state) != SLOT_FREE) { /* its last job is not collected yet */
        pthread_mutex_unlock(&q_mu);
        return -1;
    }
    slot->ticket = ticket;
    slot->work = *w;
    atomic_store(&slot->state, SLOT_QUEUED);
    atomic_store_explicit(&q_tail, ticket + 1, memory_order_release);
    pthread_mutex_unlock(&q_mu);
    wake_helper();
    return ticket;
}

/* The slot of `ticket`, or NULL when no such job is outstanding. */
static slot_t *queue_slot(long long ticket) {
    if (ticket < 0) return NULL;
    slot_t *slot = &slots[ticket % QSLOTS];
    int state = atomic_load(&slot->state);
    if (state == SLOT_FREE || slot->ticket != ticket) return NULL;
    return slot;
}

/* Wait until the job of `slot` is computed (or lost); its final state. */
static int queue_wait(slot_t *slot) {
    int state;
    unsigned spins = 0;
    while ((state = atomic_load(&slot->state)) == SLOT_QUEUED && spins < 4096)
        if ((++spins & 63) == 0) sched_yield();
    if (state != SLOT_QUEUED) return state;
    pthread_mutex_lock(&done_mu);
    atomic_fetch_add(&done_waiters, 1);
    while ((state = atomic_load(&slot->state)) == SLOT_QUEUED)
        pthread_cond_wait(&done_cv, &done_mu);
    atomic_fetch_sub(&done_waiters, 1);
    pthread_mutex_unlock(&done_mu);
    return state;
}
#else
#define HAVE_HELPER 0
#endif
