/* doorbell.h: the progress engine's Doorbell in C (see mpidag/transport/doorbell.py, whose
 * Python Doorbell has the same interface and is the fallback).
 *
 * A user thread that waits for its call while another thread leads waits here, outside
 * Python and without the GIL, until the doorbell's generation moves on: a completion, a
 * vacant leadership or the engine's stop rings it. Ringing is one atomic increment, and a
 * broadcast only while a thread sleeps in wait(); the completion path in C
 * (_mpidag_fastpath's wake) rings it with a C call, so handing a reply from the leader to
 * the thread that waits for it runs no Python and takes no Python lock. The waiter's
 * first moments are spent yielding the core (sched_yield, ~0.5 us each) with the GIL
 * released and the generation read between yields, instead of re-taking the GIL for every
 * yield as Python's os.sched_yield loop had to.
 *
 * No wake-up is lost: a waiter reads the generation (``seen``) before it looks at its
 * condition, and wait(seen, ...) returns at once when the generation is already past
 * ``seen``. The sleeper count and the generation are sequentially consistent atomics: a
 * ringer that reads no sleeper rang before the sleeper's count, so the sleeper's own read
 * of the generation, after its count, sees the ring and it does not sleep.
 *
 * Included by fastpath.c only (one definition of the type). */
#ifndef MPIDAG_DOORBELL_H
#define MPIDAG_DOORBELL_H

#include <Python.h>
#include <errno.h>
#include <math.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <time.h>

/* the longest one wait() sleeps (seconds): callers loop, and a longer timeout is cut */
#define DOORBELL_MAX_WAIT 3600.0

typedef struct {
    PyObject_HEAD
    _Atomic unsigned long long generation;
    _Atomic int sleepers; /* threads in pthread_cond_timedwait (changed under mutex) */
    pthread_mutex_t mutex;
    pthread_cond_t cond;  /* on CLOCK_MONOTONIC */
    int ready;            /* mutex and cond were initialized */
} Doorbell;

/* Move the generation on and wake every sleeper; any thread, with or without the GIL. */
static void doorbell_ring(Doorbell *bell)
{
    atomic_fetch_add(&bell->generation, 1);
    if (atomic_load(&bell->sleepers) > 0) {
        pthread_mutex_lock(&bell->mutex);
        pthread_cond_broadcast(&bell->cond);
        pthread_mutex_unlock(&bell->mutex);
    }
}

/* Without the GIL: yield up to spins times, then sleep up to timeout seconds, until the
 * generation is not seen; returns the generation then. */
static unsigned long long doorbell_wait(Doorbell *bell, unsigned long long seen,
                                        double timeout, long spins)
{
    unsigned long long now = atomic_load(&bell->generation);
    for (long i = 0; i < spins && now == seen; i++) {
        sched_yield();
        now = atomic_load(&bell->generation);
    }
    if (now != seen || !(timeout > 0.0))
        return now;
    struct timespec deadline;
    clock_gettime(CLOCK_MONOTONIC, &deadline);
    double whole = floor(timeout);
    deadline.tv_sec += (time_t)whole;
    deadline.tv_nsec += (long)((timeout - whole) * 1e9);
    if (deadline.tv_nsec >= 1000000000L) {
        deadline.tv_sec += 1;
        deadline.tv_nsec -= 1000000000L;
    }
    pthread_mutex_lock(&bell->mutex);
    atomic_fetch_add(&bell->sleepers, 1);
    while ((now = atomic_load(&bell->generation)) == seen) {
        if (pthread_cond_timedwait(&bell->cond, &bell->mutex, &deadline) == ETIMEDOUT) {
            now = atomic_load(&bell->generation);
            break;
        }
    }
    atomic_fetch_sub(&bell->sleepers, 1);
    pthread_mutex_unlock(&bell->mutex);
    return now;
}

static PyObject *Doorbell_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    if (PyTuple_GET_SIZE(args) != 0 || (kwds != NULL && PyDict_GET_SIZE(kwds) != 0)) {
        PyErr_SetString(PyExc_TypeError, "Doorbell() takes no arguments");
        return NULL;
    }
    Doorbell *self = (Doorbell *)type->tp_alloc(type, 0);
    if (self == NULL)
        return NULL;
    atomic_init(&self->generation, 0);
    atomic_init(&self->sleepers, 0);
    pthread_condattr_t attr;
    int rc = pthread_condattr_init(&attr);
    if (rc == 0) {
        rc = pthread_condattr_setclock(&attr, CLOCK_MONOTONIC);
        if (rc == 0)
            rc = pthread_cond_init(&self->cond, &attr);
        pthread_condattr_destroy(&attr);
    }
    if (rc == 0 && (rc = pthread_mutex_init(&self->mutex, NULL)) != 0)
        pthread_cond_destroy(&self->cond);
    if (rc != 0) {
        Py_DECREF(self);
        errno = rc;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    self->ready = 1;
    return (PyObject *)self;
}

static void Doorbell_dealloc(Doorbell *self)
{
    if (self->ready) {
        pthread_cond_destroy(&self->cond);
        pthread_mutex_destroy(&self->mutex);
    }
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *Doorbell_ring(Doorbell *self, PyObject *Py_UNUSED(ignored))
{
    doorbell_ring(self);
    Py_RETURN_NONE;
}

static PyObject *Doorbell_wait(Doorbell *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs < 2 || nargs > 3) {
        PyErr_SetString(PyExc_TypeError, "wait(seen, timeout, spins=0)");
        return NULL;
    }
    unsigned long long seen = PyLong_AsUnsignedLongLong(args[0]);
    if (seen == (unsigned long long)-1 && PyErr_Occurred())
        return NULL;
    double timeout = PyFloat_AsDouble(args[1]);
    if (timeout == -1.0 && PyErr_Occurred())
        return NULL;
    if (isnan(timeout)) {
        PyErr_SetString(PyExc_ValueError, "wait(): timeout must be a number of seconds, "
                                          "got nan");
        return NULL;
    }
    if (timeout > DOORBELL_MAX_WAIT)
        timeout = DOORBELL_MAX_WAIT;
    long spins = 0;
    if (nargs == 3 && (spins = PyLong_AsLong(args[2])) == -1 && PyErr_Occurred())
        return NULL;
    unsigned long long now;
    Py_BEGIN_ALLOW_THREADS
    now = doorbell_wait(self, seen, timeout, spins);
    Py_END_ALLOW_THREADS
    return PyLong_FromUnsignedLongLong(now);
}

static PyObject *Doorbell_generation(Doorbell *self, void *Py_UNUSED(closure))
{
    return PyLong_FromUnsignedLongLong(atomic_load(&self->generation));
}

static PyObject *Doorbell_sleepers(Doorbell *self, void *Py_UNUSED(closure))
{
    return PyLong_FromLong(atomic_load(&self->sleepers));
}

static PyMethodDef Doorbell_methods[] = {
    {"ring", (PyCFunction)Doorbell_ring, METH_NOARGS,
     "ring(): move the generation on and wake every thread in wait()"},
    {"wait", (PyCFunction)(void (*)(void))Doorbell_wait, METH_FASTCALL,
     "wait(seen, timeout, spins=0) -> generation: without the GIL, yield the core up to "
     "spins times, then sleep up to timeout seconds, until the generation is not seen"},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef Doorbell_getset[] = {
    {"generation", (getter)Doorbell_generation, NULL,
     "how many times it rang (read it before looking at the condition waited for)", NULL},
    {"sleepers", (getter)Doorbell_sleepers, NULL, "threads asleep in wait() now", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject DoorbellType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "_mpidag_fastpath.Doorbell",
    .tp_basicsize = sizeof(Doorbell),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Doorbell(): where user threads wait for a completion or the leadership, "
              "without the GIL; rung by the compiled completion path in C "
              "(mpidag/transport/doorbell.py has the same in Python).\n\n"
              "    >>> bell = Doorbell(); seen = bell.generation\n"
              "    >>> bell.ring(); bell.wait(seen, 1.0) == seen + 1\n"
              "    True",
    .tp_new = Doorbell_new,
    .tp_dealloc = (destructor)Doorbell_dealloc,
    .tp_methods = Doorbell_methods,
    .tp_getset = Doorbell_getset,
};

#endif
