/* _mpidag_fastpath: the agent's path of a plain call in C (see mpidag/agent/fastpath.py).
 *
 * A *plain* call names a module-level function or a handler that the caller's codec has
 * already given a reference (see encoding.py), carries no keyword arguments and only
 * plain values (None, bool, int, float, str, bytes, complex; a tuple of at most 8), and
 * returns a plain value; it is made outside any profiler. Inside a distributed autograd
 * context it is recorded here too: the agent's call observer is called where the Python
 * path calls it (see "the call observer" below).
 * Most of a training job's small control calls, and every no-op benchmark, are plain.
 * For them this module does in C what the Python of calls.py, serving.py, sending.py and
 * the transport's send_now does, with the same objects (PendingCall, Envelope), the same
 * bytes on the wire, the same message counters and the same errors:
 *
 *   Core.send_call(...)   the caller: request id, call record, deadline, frame 0, send;
 *   Core.rpc(...)         rpc_sync's and rpc_async's caller side for common arguments;
 *   Core.dispatch(env)    the leader: a RESULT completes its call record here (and the
 *                         answers of rpc_async waiting behind it, see drain_results); a
 *                         CALL becomes a work item (a ServeWork) that runs the function and
 *                         sends the answer; anything else goes to the agent's Python;
 *   Core.step(wait)       the progress engine's leader step (ProgressEngine.set_step): the
 *                         after-poll hook, one poll (the transport's loopback queue, its
 *                         frame-0 probe and the C frame-0 decoder, which also makes the
 *                         tensors inline in frame 0, without the Python of poll), then
 *                         dispatch; False when nothing arrived;
 *   Core.reply(...)       the answer of a call made after its function returned (an
 *                         asynchronous handler's future): in C when it is plain;
 *   Counters              the per-peer message counts of graceful shutdown, changed
 *                         atomically under the GIL by C and Python alike;
 *   plain_pickle(obj)     the pickle of a plain value as this module writes it (see "plain
 *                         values as pickle bytes"; for the tests and the Python encoder).
 *
 * Anything that is not plain (kwargs, a new function, a profiler, a test's send hook, a
 * failed peer, a message to this rank) goes, untouched,
 * to the Python code it would have taken, which also raises every error the user sees.
 * A flag bit of the header (FLAG_PLAIN) says that the pickle after the function
 * reference (or the result's) holds plain values only, so the receiver may unpickle it
 * without the tensor table. Dense contiguous CPU tensors (exactly torch.Tensor; inside
 * frame 0 when they fit, else in frames of their own) may be arguments too:
 * FLAG_TENSOR_SLOTS says the pickle is (args, kwargs, slots), args with None where slots[i] >= 0 names the tensor
 * env.tensors[slots[i]]; and a lone such tensor may be the result (frames' lone-tensor
 * payload, as the Python path sends it).
 *
 * Needs neither MPI nor torch headers: the transport's send_frame0 (send_now for a message
 * with frames after frame 0) and the frame codec are called as Python callables (the
 * codec and send_frame0 are C in the compiled build).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>
#include <math.h>
#include <time.h>

#include "../transport/torch_futures.h"
#include "../transport/frame_tensor.h"
#include "../transport/slots.h"
#include "../transport/doorbell.h"

#define VERSION 16

/* the protocol's constants (messages.py); Core.__init__ checks them against Python's */
#define CALL 1
#define RESULT 2
#define NOTIFY 4
#define CONTROL 5
#define FLAG_HANDLER 1
#define FLAG_FUNCTION_REF 2
#define FLAG_PLAIN 4
#define FLAG_TENSOR_SLOTS 8
/* the most arguments of a call this path takes (each tensor is looked for among those
 * before it): a gradient message of MAX_BATCH recv functions carries 4 plain values and
 * the gradients of each function, often more than one */
#define MAX_ARGS 64
#define ALIGN 16

/* ================================================================== Counters */

typedef struct {
    PyObject_HEAD
    Py_ssize_t size;
    long long *sent_to;
    long long *processed_from;
} Counters;

static int Counters_init(Counters *self, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"world_size", NULL};
    Py_ssize_t size;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "n", kwlist, &size))
        return -1;
    if (size < 1) {
        PyErr_Format(PyExc_ValueError, "world_size must be at least 1, got %zd", size);
        return -1;
    }
    PyMem_Free(self->sent_to);
    PyMem_Free(self->processed_from);
    self->sent_to = PyMem_Calloc(size, sizeof(long long));
    self->processed_from = PyMem_Calloc(size, sizeof(long long));
    if (self->sent_to == NULL || self->processed_from == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    self->size = size;
    return 0;
}

static void Counters_dealloc(Counters *self)
{
    PyMem_Free(self->sent_to);
    PyMem_Free(self->processed_from);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int rank_of(Counters *self, PyObject *arg, Py_ssize_t *rank)
{
    Py_ssize_t r = PyLong_AsSsize_t(arg);
    if (r == -1 && PyErr_Occurred())
        return -1;
    if (r < 0 || r >= self->size) {
        PyErr_Format(PyExc_IndexError, "rank %zd is outside the world of size %zd", r,
                     self->size);
        return -1;
    }
    *rank = r;
    return 0;
}

#define COUNTER_METHOD(name, body)                                                         \
    static PyObject *Counters_##name(Counters *self, PyObject *arg)                        \
    {                                                                                      \
        Py_ssize_t r;                                                                      \
        if (rank_of(self, arg, &r) < 0)                                                    \
            return NULL;                                                                   \
        body;                                                                              \
        Py_RETURN_NONE;                                                                    \
    }

COUNTER_METHOD(sent, self->sent_to[r]++)
COUNTER_METHOD(unsent, self->sent_to[r]--)
COUNTER_METHOD(processed, self->processed_from[r]++)
COUNTER_METHOD(answered, (self->sent_to[r]++, self->processed_from[r]++))

static PyObject *Counters_totals(Counters *self, PyObject *failed)
{
    long long sent = 0, processed = 0;
    int any_failed = PyAnySet_Check(failed) ? PySet_GET_SIZE(failed) > 0
                                            : PyObject_IsTrue(failed);
    if (any_failed < 0)
        return NULL;
    for (Py_ssize_t r = 0; r < self->size; r++) {
        if (any_failed) {
            PyObject *key = PyLong_FromSsize_t(r);
            if (key == NULL)
                return NULL;
            int in = PySequence_Contains(failed, key);
            Py_DECREF(key);
            if (in < 0)
                return NULL;
            if (in)
                continue;
        }
        sent += self->sent_to[r];
        processed += self->processed_from[r];
    }
    return Py_BuildValue("(LL)", sent, processed);
}

static PyObject *Counters_sum(long long *values, Py_ssize_t n)
{
    long long total = 0;
    for (Py_ssize_t r = 0; r < n; r++)
        total += values[r];
    return PyLong_FromLongLong(total);
}

static PyObject *Counters_sent_total(Counters *self, void *Py_UNUSED(closure))
{
    return Counters_sum(self->sent_to, self->size);
}

static PyObject *Counters_processed_total(Counters *self, void *Py_UNUSED(closure))
{
    return Counters_sum(self->processed_from, self->size);
}

static PyMethodDef Counters_methods[] = {
    {"sent", (PyCFunction)Counters_sent, METH_O, "a message was sent to rank"},
    {"unsent", (PyCFunction)Counters_unsent, METH_O, "a send to rank failed: uncount it"},
    {"processed", (PyCFunction)Counters_processed, METH_O,
     "a message from rank is handled"},
    {"answered", (PyCFunction)Counters_answered, METH_O,
     "a request from rank is answered: sent and processed at once"},
    {"totals", (PyCFunction)Counters_totals, METH_O,
     "(sent, processed) over the ranks not in the set failed"},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef Counters_getset[] = {
    {"sent_total", (getter)Counters_sent_total, NULL, "messages sent", NULL},
    {"processed_total", (getter)Counters_processed_total, NULL, "messages handled", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject CountersType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "_mpidag_fastpath.Counters",
    .tp_basicsize = sizeof(Counters),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Per-peer message counts (sent to each rank, handled from each), atomic "
              "under the GIL.",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Counters_init,
    .tp_dealloc = (destructor)Counters_dealloc,
    .tp_methods = Counters_methods,
    .tp_getset = Counters_getset,
};

/* ================================================================== LiveCount */
/* How many objects of one kind are alive (distributed autograd's send functions and recv
 * records: debug_info's num_live_*): each object holds a Ticket from ticket(), counted when
 * made and, from the ticket's dealloc, when freed. What the Python LiveCount does with a
 * __del__ per object, without a Python call when the object dies. The counts change under
 * the GIL, atomically all the same. */

typedef struct {
    PyObject_HEAD
    long long made, freed;
} LiveCount;

typedef struct {
    PyObject_HEAD
    LiveCount *count;
} Ticket;

static void Ticket_dealloc(Ticket *self)
{
    __atomic_fetch_add(&self->count->freed, 1, __ATOMIC_RELAXED);
    Py_DECREF(self->count);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyTypeObject TicketType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "_mpidag_fastpath.Ticket",
    .tp_basicsize = sizeof(Ticket),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "One live object of a LiveCount: counted as freed when it goes.",
    .tp_dealloc = (destructor)Ticket_dealloc,
};

static PyObject *LiveCount_ticket(LiveCount *self, PyObject *Py_UNUSED(ignored))
{
    Ticket *ticket = PyObject_New(Ticket, &TicketType);
    if (ticket == NULL)
        return NULL;
    ticket->count = (LiveCount *)Py_NewRef((PyObject *)self);
    __atomic_fetch_add(&self->made, 1, __ATOMIC_RELAXED);
    return (PyObject *)ticket;
}

static PyObject *LiveCount_live(LiveCount *self, void *Py_UNUSED(closure))
{
    long long freed = __atomic_load_n(&self->freed, __ATOMIC_RELAXED);
    return PyLong_FromLongLong(__atomic_load_n(&self->made, __ATOMIC_RELAXED) - freed);
}

static PyMethodDef LiveCount_methods[] = {
    {"ticket", (PyCFunction)LiveCount_ticket, METH_NOARGS,
     "ticket() -> Ticket: one more object alive, until the ticket goes"},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef LiveCount_getset[] = {
    {"live", (getter)LiveCount_live, NULL, "objects whose ticket is still alive", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject LiveCountType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "_mpidag_fastpath.LiveCount",
    .tp_basicsize = sizeof(LiveCount),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "LiveCount(): how many objects holding one of its tickets are alive.",
    .tp_new = PyType_GenericNew,
    .tp_methods = LiveCount_methods,
    .tp_getset = LiveCount_getset,
};

/* ================================================================== Core */

enum { ENV_KIND, ENV_REQUEST_ID, ENV_FLAGS, ENV_CONTEXT_ID, ENV_MESSAGE_ID, ENV_PAYLOAD,
       ENV_TENSORS, ENV_SRC, N_ENV };
static const char *ENV_FIELDS[N_ENV] = {"kind", "request_id", "flags", "context_id",
                                        "message_id", "payload", "tensors", "src"};
enum { PC_REQUEST_ID, PC_FUTURE, PC_DST, PC_STARTED, PC_DEADLINE, PC_FUNC, PC_SECONDS,
       PC_ARGS, PC_DONE, PC_VALUE, PC_ERROR, N_PC };
static const char *PC_FIELDS[N_PC] = {"request_id", "future", "dst", "started", "deadline",
                                      "func", "seconds", "args", "done", "value", "error"};

/* the objects a Core works with; each a new reference (see Core_init's keywords) */
enum {
    O_CALLS,            /* OutgoingCalls: .open, .default_timeout */
    O_PENDING,          /* its table of calls: dict request_id -> PendingCall */
    O_PEERS_FAILED,     /* set of failed ranks (Peers.failed) */
    O_PREFIXES,         /* CallCodec: func -> (reference prefix, flag) */
    O_TARGETS,          /* CallCodec: reference prefix -> (func, namespace, name) */
    O_ID_COUNTER,       /* IdGenerator's itertools.count */
    O_COUNTERS,         /* Counters */
    O_TRANSPORT,        /* .send_hook, .send_frame0, .send_now */
    O_TRANSPORT_FAILED, /* set of failed ranks (the transport's) */
    O_FRAMES,           /* mpidag.transport.frames: .encode */
    O_PLUGINS,          /* .observer.active */
    O_FUTURE_TYPE,      /* RpcFuture */
    O_FUTURE_INIT,      /* torch._C.Future.__init__ (what RpcFuture.__init__ calls) */
    O_ENGINE,           /* the progress engine (RpcFuture.engine) */
    O_SET_RESULT,       /* set_result(future, value): RpcFuture's, unbound */
    O_WAKE,             /* engine.wake_waiters() */
    O_POLL,             /* transport.poll(): the next message, or None at once */
    O_REQUEUE,          /* transport.requeue(env): it is the next one poll() returns */
    O_OBSERVING,        /* () -> whether served calls take the observed path */
    O_DUMPS,            /* pickle.dumps */
    O_LOADS,            /* pickle.loads */
    O_HANDLER_TYPE,     /* Handler */
    O_ENVELOPE,         /* Envelope */
    O_PENDING_CALL,     /* PendingCall */
    O_PY_DISPATCH,      /* the agent's Python dispatch(env) */
    O_PY_COMPLETE,      /* OutgoingCalls.complete(env) */
    O_PY_SERVE,         /* Server.serve_call(env): the Python work item */
    O_PY_REPLY_VALUE,   /* Server.reply_value(env, value, (func, args)) */
    O_PY_FAIL,          /* Server.fail_call(env, func, exc) */
    O_FAILED_ERROR,     /* Peers.failed_error(rank) */
    O_WORKER_FAILED,    /* WorkerFailedError */
    O_BY_NAME,          /* Peers.by_name: worker name -> WorkerInfo */
    O_PEERS_LEFT,       /* set of ranks that shut down alone (Peers.left) */
    O_CALL_PROFILING,   /* () -> whether a call made now is profiled */
    O_TENSOR_TYPE,      /* torch.Tensor */
    O_STRIDED,          /* torch.strided */
    O_LONE_TENSOR,      /* frames' payload of a result that is one tensor (bytes) */
    O_LOOPBACK,         /* transport.loopback: the deque poll() empties first */
    O_DECODE_MESSAGE,   /* frames.decode_message(frame0, src) -> (env, header | None) */
    O_RECEIVE_REST,     /* transport.receive_rest(env, header, frame0, src) */
    O_POLL_WAIT,        /* transport.poll_wait(seconds), or None */
    O_DESCRIBE,         /* handlers.describe(func, args) -> str */
    O_DESCRIBED,        /* handlers.DESCRIBED: describe's names of module-level functions */
    O_PEER_NAMES,       /* Peers.names: the workers' names by rank (a tuple) */
    O_NOT_RECORDED,     /* OutgoingCalls.result_not_recorded(env, call, exc) */
    O_PY_UNSENDABLE,    /* Server.reply_unsendable(env, value, exc) */
    O_PY_SERVE_NOTIFY,  /* Server.serve_notify(env): a notification's Python path */
    O_PY_NOTIFY_FAILED, /* Server.notify_failed(env, exc): log a failed notification */
    O_CFUTURE,          /* torch._C.Future: what an asynchronous handler answers with */
    O_PY_ANSWER_WHEN_DONE, /* Server.answer_when_done(env, future, (func, args)) */
    O_TORCH_FUTURES,    /* _mpidag_torch's futures_api capsule (torch_futures.h), or None */
    O_TICK_HOOKS,       /* the layers' after-poll hooks: the live list of (queue, hook) */
    O_EXPIRE_DUE,       /* OutgoingCalls.expire_due(): expire the calls past their deadline */
    O_PROFILER_GLOBALS, /* torch.autograd.profiler's globals (._is_profiler_enabled) */
    O_PROFILER_ENABLED, /* torch._C._autograd._profiler_enabled() */
    O_OBSERVING_GLOBALS, /* mpidag._remote_profiling's globals (._observing) */
    O_TENSOR_FACTS,     /* _mpidag_torch's tensor_facts_api capsule (frame_tensor.h), or None */
    O_INTERRUPT,        /* engine.interrupt: the transport's interrupt_wait() */
    O_DOORBELL,         /* engine.doorbell: rung in C when it is a Doorbell (doorbell.h) */
    N_OBJECTS
};
static const char *OBJECT_NAMES[N_OBJECTS] = {
    "calls", "pending", "peers_failed", "prefixes", "targets", "id_counter", "counters",
    "transport", "transport_failed", "frames", "plugins", "future_type", "future_init",
    "engine", "set_result",
    "wake_waiters", "poll", "requeue",
    "observing", "dumps", "loads", "handler_type", "envelope", "pending_call",
    "py_dispatch", "py_complete", "py_serve", "py_reply_value", "py_fail",
    "failed_error", "worker_failed_error", "by_name", "peers_left", "call_profiling",
    "tensor_type", "strided", "lone_tensor", "loopback", "decode_message",
    "receive_rest", "poll_wait", "describe", "described", "peer_names",
    "result_not_recorded", "py_unsendable", "py_serve_notify",
    "py_notify_failed", "cfuture_type", "py_answer_when_done", "torch_futures",
    "tick_hooks", "expire_due", "profiler_globals", "profiler_enabled", "observing_globals",
    "tensor_facts", "interrupt", "doorbell"};

typedef struct {
    PyObject_HEAD
    PyObject *o[N_OBJECTS];
    PyObject *env_slots[N_ENV];
    PyObject *pc_slots[N_PC];
    long long id_base, id_max;
    long rank;
    Py_ssize_t payload_limit, inline_limit;
    PyObject *protocol; /* pickle.HIGHEST_PROTOCOL */
    int proto;          /* the same, as a C int (plain_pickle writes protocol 4 and up) */
    PyObject *empty_dict, *empty_tuple;
    /* rpc_async's futures made and completed in C++ (torch_futures= a capsule), or NULL:
     * through torch._C.Future's Python bindings */
    const mpidag_torch_futures *torch_futures;
    /* a tensor's layout, device, contiguity and size read in C++ (tensor_facts= a capsule),
     * or NULL: through its Python attributes */
    mpidag_tensor_facts_fn tensor_facts;
    /* the engine's doorbell when it is this module's (rung with a C call), or NULL:
     * engine.wake_waiters() while engine.waiting_users */
    Doorbell *doorbell;
    /* the leader's tick: expire_due() at most every expiry_interval seconds */
    double expiry_interval, next_expiry;
    /* interned attribute names */
    PyObject *s_open, *s_default_timeout, *s_send_hook, *s_send_frame0, *s_send_now,
        *s_encode, *s_observer, *s_active, *s_user_callbacks, *s_asynchronous, *s_wrapped_async,
        *s_layout, *s_is_cpu, *s_is_contiguous,
        *s_nbytes, *s_cpu, *s_id, *s_engine, *s_popleft, *s_probe_frame0,
        *s_outgoing, *s_received, *s_serving, *s_served, *s_replying, *s_sent, *s_mode,
        *s_control, *s_done, *s_value, *s_is_profiler_enabled, *s_observing,
        *s_earliest_deadline, *s_fn, *s_waiting_users;
} Core;

static PyTypeObject *ServeWorkType;

/* ------------------------------------------------------------------ helpers */
/* obj's slot (see slots.h): a new reference, or NULL with an error */
static PyObject *slot_get(PyObject *descr, PyObject *obj)
{
    return mpidag_slot_get(descr, obj);
}

/* steals value */
static int slot_set(PyObject *descr, PyObject *obj, PyObject *value)
{
    if (value == NULL)
        return -1;
    int rc = mpidag_slot_set(descr, obj, value);
    Py_DECREF(value);
    return rc;
}

static long long slot_ll(PyObject *descr, PyObject *obj, int *ok)
{
    PyObject *value = slot_get(descr, obj);
    if (value == NULL) {
        *ok = 0;
        return 0;
    }
    long long v = PyLong_AsLongLong(value);
    Py_DECREF(value);
    if (v == -1 && PyErr_Occurred())
        *ok = 0;
    return v;
}

static int is_plain_type(PyTypeObject *t)
{
    return t == &_PyNone_Type || t == &PyBool_Type || t == &PyLong_Type ||
           t == &PyFloat_Type || t == &PyUnicode_Type || t == &PyBytes_Type ||
           t == &PyComplex_Type;
}

/* frames.is_plain: a plain value, or a tuple of at most 8 of them */
static int is_plain(PyObject *obj)
{
    if (is_plain_type(Py_TYPE(obj)))
        return 1;
    if (!PyTuple_CheckExact(obj) || PyTuple_GET_SIZE(obj) > 8)
        return 0;
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(obj); i++)
        if (!is_plain_type(Py_TYPE(PyTuple_GET_ITEM(obj, i))))
            return 0;
    return 1;
}

/* the truth of value, a new reference that this drops (NULL: the error of making it): 1, 0,
 * or -1 on error */
static int truth_of(PyObject *value)
{
    if (value == NULL)
        return -1;
    int truth = PyObject_IsTrue(value);
    Py_DECREF(value);
    return truth;
}

/* 1 when rank is in the set (0 when the set is empty), -1 on error */
static int in_set(PyObject *set, long rank)
{
    if (PySet_GET_SIZE(set) == 0)
        return 0;
    PyObject *key = PyLong_FromLong(rank);
    if (key == NULL)
        return -1;
    int in = PySet_Contains(set, key);
    Py_DECREF(key);
    return in;
}

static double monotonic_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts); /* what time.monotonic() reads on Linux */
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* The raised exception, normalised with its traceback (a new reference), the error cleared */
static PyObject *take_error(void)
{
    PyObject *type, *exc, *tb;
    PyErr_Fetch(&type, &exc, &tb);
    PyErr_NormalizeException(&type, &exc, &tb);
    if (tb != NULL && exc != NULL)
        PyException_SetTraceback(exc, tb);
    Py_XDECREF(type);
    Py_XDECREF(tb);
    return exc;
}

/* an Envelope made through its slots (no __init__); steals payload and tensors (NULL:
 * none); NULL on error */
static PyObject *make_envelope(Core *self, int kind, PyObject *request_id, int flags,
                               long long context_id, long long message_id,
                               PyObject *payload, PyObject *tensors)
{
    PyTypeObject *type = (PyTypeObject *)self->o[O_ENVELOPE];
    PyObject *env = type->tp_alloc(type, 0);
    if (env == NULL) {
        Py_DECREF(payload);
        Py_XDECREF(tensors);
        return NULL;
    }
    PyObject *values[N_ENV] = {PyLong_FromLong(kind), Py_NewRef(request_id),
                               PyLong_FromLong(flags), PyLong_FromLongLong(context_id),
                               PyLong_FromLongLong(message_id), payload,
                               tensors != NULL ? tensors : PyList_New(0), PyLong_FromLong(-1)};
    int rc = 0;
    for (int i = 0; i < N_ENV; i++)
        if (values[i] == NULL)
            rc = -1;
    for (int i = 0; i < N_ENV; i++) {
        if (rc == 0 && mpidag_slot_set(self->env_slots[i], env, values[i]) < 0)
            rc = -1;
        Py_XDECREF(values[i]);
    }
    if (rc < 0)
        Py_CLEAR(env);
    return env;
}

/* 1: the transport's plain send may carry a message to dst now (no test hook, dst another
 * live rank); 0: leave it to the Python path; -1: error */
static int can_send(Core *self, long dst)
{
    if (dst == self->rank || dst < 0 || dst >= ((Counters *)self->o[O_COUNTERS])->size)
        return 0;
    PyObject *hook = PyObject_GetAttr(self->o[O_TRANSPORT], self->s_send_hook);
    if (hook == NULL)
        return -1;
    int none = hook == Py_None;
    Py_DECREF(hook);
    if (!none)
        return 0;
    int in = in_set(self->o[O_TRANSPORT_FAILED], dst);
    return in < 0 ? -1 : !in;
}

/* 1 when obj.name (obj.name() with call) is expected, 0 when not, -1 on error */
static int attr_is(PyObject *obj, PyObject *name, int call, PyObject *expected)
{
    PyObject *value = call ? PyObject_CallMethodNoArgs(obj, name) : PyObject_GetAttr(obj, name);
    if (value == NULL)
        return -1;
    int is = value == expected;
    Py_DECREF(value);
    return is;
}

/* 1 when t may travel by the plain path: exactly torch.Tensor, strided, on the CPU,
 * contiguous (of any size: one that does not fit in frame 0 travels in a frame of its
 * own, see send_message). 0: not such a tensor; -1: error */
static int plain_tensor(Core *self, PyObject *t)
{
    if (Py_TYPE(t) != (PyTypeObject *)self->o[O_TENSOR_TYPE])
        return 0;
    mpidag_tensor_facts facts;
    if (self->tensor_facts != NULL && self->tensor_facts(t, &facts))
        return facts.contiguous; /* (strided and on the CPU, read in C++) */
    int ok = attr_is(t, self->s_layout, 0, self->o[O_STRIDED]);
    if (ok == 1)
        ok = attr_is(t, self->s_is_cpu, 0, Py_True);
    if (ok == 1)
        ok = attr_is(t, self->s_is_contiguous, 1, Py_True);
    return ok;
}

/* 1 when the tensors (plain ones) all fit in frame 0, as frames.encode packs them (each
 * 16-aligned, inline_limit bytes in all); 0 when not; -1 on error */
static int fits_frame0(Core *self, PyObject *tensors, Py_ssize_t n_tensors)
{
    Py_ssize_t inline_bytes = 0;
    for (Py_ssize_t i = 0; i < n_tensors; i++) {
        mpidag_tensor_facts facts;
        if (self->tensor_facts != NULL &&
                self->tensor_facts(PyList_GET_ITEM(tensors, i), &facts)) {
            inline_bytes += ((Py_ssize_t)facts.nbytes + ALIGN - 1) & ~(Py_ssize_t)(ALIGN - 1);
            if (inline_bytes > self->inline_limit)
                return 0;
            continue;
        }
        PyObject *nbytes = PyObject_GetAttr(PyList_GET_ITEM(tensors, i), self->s_nbytes);
        if (nbytes == NULL)
            return -1;
        Py_ssize_t n = PyLong_AsSsize_t(nbytes);
        Py_DECREF(nbytes);
        if (n == -1 && PyErr_Occurred())
            return -1;
        inline_bytes += (n + ALIGN - 1) & ~(Py_ssize_t)(ALIGN - 1);
        if (inline_bytes > self->inline_limit)
            return 0;
    }
    return 1;
}

/* a new list of n "cpu" (where each tensor of a plain message lands), or NULL */
static PyObject *cpu_devices(Core *self, Py_ssize_t n)
{
    PyObject *devices = PyList_New(n);
    for (Py_ssize_t i = 0; devices != NULL && i < n; i++)
        PyList_SET_ITEM(devices, i, Py_NewRef(self->s_cpu));
    return devices;
}

/* module.name (a new reference): the entry of its dict, where a module's getattr finds a
 * name that its type does not have, without the generic lookup; PyObject_GetAttr where
 * the dict has none (a module-level __getattr__) or module is not a module */
static PyObject *module_attr(PyObject *module, PyObject *name)
{
    if (PyModule_CheckExact(module)) {
        PyObject *value = PyDict_GetItemWithError(PyModule_GetDict(module), name);
        if (value != NULL)
            return Py_NewRef(value);
        if (PyErr_Occurred())
            return NULL;
    }
    return PyObject_GetAttr(module, name);
}

/* env (its payload inside frame 0, its tensors plain CPU ones) handed to the transport: by
 * the codec and the transport's send_frame0 when the whole message fits in frame 0, else
 * by transport.send_now, which sends the tensors that do not fit in frames of their own on
 * a data tag (and returns once they are received). 0, or -1 */
static int send_message(Core *self, long dst, PyObject *env, Py_ssize_t n_tensors)
{
    if (n_tensors > 0) {
        PyObject *tensors = slot_get(self->env_slots[ENV_TENSORS], env);
        if (tensors == NULL)
            return -1;
        int fits = PyList_Check(tensors) ? fits_frame0(self, tensors, n_tensors) : 0;
        Py_DECREF(tensors);
        if (fits < 0)
            return -1;
        if (!fits) { /* transport.send_now(dst, env, devices) */
            PyObject *devices = cpu_devices(self, n_tensors);
            PyObject *rank = devices != NULL ? PyLong_FromLong(dst) : NULL;
            PyObject *result = NULL;
            if (rank != NULL) {
                PyObject *args[4] = {self->o[O_TRANSPORT], rank, env, devices};
                result = PyObject_VectorcallMethod(self->s_send_now, args, 4, NULL);
            }
            Py_XDECREF(devices);
            Py_XDECREF(rank);
            if (result == NULL)
                return -1;
            Py_DECREF(result);
            return 0;
        }
    }
    PyObject *encode = module_attr(self->o[O_FRAMES], self->s_encode);
    if (encode == NULL)
        return -1;
    PyObject *devices = cpu_devices(self, n_tensors);
    PyObject *tag = PyLong_FromLong(0);
    PyObject *encoded = NULL;
    if (devices != NULL && tag != NULL) {
        PyObject *args[3] = {env, devices, tag};
        encoded = PyObject_Vectorcall(encode, args, 3, NULL);
    }
    Py_DECREF(encode);
    Py_XDECREF(devices);
    Py_XDECREF(tag);
    if (encoded == NULL)
        return -1;
    if (!PyTuple_Check(encoded) || PyTuple_GET_SIZE(encoded) != 2 ||
        PyObject_Length(PyTuple_GET_ITEM(encoded, 1)) != 0) {
        Py_DECREF(encoded);
        PyErr_SetString(PyExc_RuntimeError,
                        "frames.encode did not put the whole message in frame 0");
        return -1;
    }
    /* transport.send_frame0(dst, frame): looked up by name each time (a profiler or a test
     * may wrap it), without making a bound method */
    PyObject *result = NULL;
    PyObject *rank = PyLong_FromLong(dst);
    if (rank != NULL) {
        PyObject *args[3] = {self->o[O_TRANSPORT], rank, PyTuple_GET_ITEM(encoded, 0)};
        result = PyObject_VectorcallMethod(self->s_send_frame0, args, 3, NULL);
        Py_DECREF(rank);
    }
    Py_DECREF(encoded);
    if (result == NULL)
        return -1;
    Py_DECREF(result);
    return 0;
}

/* ------------------------------------------------------------------ init */
static int Core_init(Core *self, PyObject *args, PyObject *kwds)
{
    if (PyTuple_GET_SIZE(args) != 0 || kwds == NULL) {
        PyErr_SetString(PyExc_TypeError, "Core takes keyword arguments only");
        return -1;
    }
    for (int i = 0; i < N_OBJECTS; i++) {
        PyObject *value = PyDict_GetItemString(kwds, OBJECT_NAMES[i]);
        if (value == NULL) {
            PyErr_Format(PyExc_TypeError, "Core needs %s=", OBJECT_NAMES[i]);
            return -1;
        }
        Py_XSETREF(self->o[i], Py_NewRef(value));
    }
    if (!PyDict_CheckExact(self->o[O_PENDING]) || !PyDict_CheckExact(self->o[O_PREFIXES]) ||
        !PyDict_CheckExact(self->o[O_TARGETS]) || !PyAnySet_Check(self->o[O_PEERS_FAILED]) ||
        !PyAnySet_Check(self->o[O_TRANSPORT_FAILED]) ||
        !PyAnySet_Check(self->o[O_PEERS_LEFT]) || !PyDict_Check(self->o[O_BY_NAME]) ||
        !PyType_Check(self->o[O_ENVELOPE]) || !PyType_Check(self->o[O_PENDING_CALL]) ||
        !PyType_Check(self->o[O_FUTURE_TYPE]) || !PyDict_Check(self->o[O_PROFILER_GLOBALS]) ||
        !PyDict_Check(self->o[O_OBSERVING_GLOBALS]) ||
        !PyObject_TypeCheck(self->o[O_COUNTERS], &CountersType)) {
        PyErr_SetString(PyExc_TypeError, "Core: an argument has the wrong type");
        return -1;
    }
    PyObject *numbers[5] = {PyDict_GetItemString(kwds, "id_base"),
                            PyDict_GetItemString(kwds, "id_max"),
                            PyDict_GetItemString(kwds, "rank"),
                            PyDict_GetItemString(kwds, "payload_limit"),
                            PyDict_GetItemString(kwds, "inline_limit")};
    PyObject *protocol = PyDict_GetItemString(kwds, "protocol");
    PyObject *interval = PyDict_GetItemString(kwds, "expiry_interval");
    if (numbers[0] == NULL || numbers[1] == NULL || numbers[2] == NULL ||
        numbers[3] == NULL || numbers[4] == NULL || protocol == NULL || interval == NULL) {
        PyErr_SetString(PyExc_TypeError, "Core needs id_base=, id_max=, rank=, "
                                         "payload_limit=, inline_limit=, protocol=, "
                                         "expiry_interval=");
        return -1;
    }
    if (!PyList_CheckExact(self->o[O_TICK_HOOKS])) {
        PyErr_SetString(PyExc_TypeError, "Core: tick_hooks= must be a list");
        return -1;
    }
    self->expiry_interval = PyFloat_AsDouble(interval);
    if (self->expiry_interval == -1.0 && PyErr_Occurred())
        return -1;
    self->next_expiry = 0.0;
    if (!PyBytes_CheckExact(self->o[O_LONE_TENSOR])) {
        PyErr_SetString(PyExc_TypeError, "Core: lone_tensor= must be bytes");
        return -1;
    }
    self->id_base = PyLong_AsLongLong(numbers[0]);
    self->id_max = PyLong_AsLongLong(numbers[1]);
    self->rank = PyLong_AsLong(numbers[2]);
    self->payload_limit = PyLong_AsSsize_t(numbers[3]);
    self->inline_limit = PyLong_AsSsize_t(numbers[4]);
    if (PyErr_Occurred())
        return -1;
    Py_XSETREF(self->protocol, Py_NewRef(protocol));
    self->proto = (int)PyLong_AsLong(protocol);
    if (self->proto == -1 && PyErr_Occurred())
        return -1;
    if (self->proto > 5)
        self->proto = 5; /* the newest protocol whose opcodes plain_write knows */
    for (int i = 0; i < N_ENV; i++) {
        PyObject *d = PyObject_GetAttrString(self->o[O_ENVELOPE], ENV_FIELDS[i]);
        if (d == NULL)
            return -1;
        Py_XSETREF(self->env_slots[i], d);
        if (mpidag_slot_check(d, "Envelope", ENV_FIELDS[i]) < 0)
            return -1;
    }
    for (int i = 0; i < N_PC; i++) {
        PyObject *d = PyObject_GetAttrString(self->o[O_PENDING_CALL], PC_FIELDS[i]);
        if (d == NULL)
            return -1;
        Py_XSETREF(self->pc_slots[i], d);
        if (mpidag_slot_check(d, "PendingCall", PC_FIELDS[i]) < 0)
            return -1;
    }
    self->torch_futures = NULL;
    if (self->o[O_TORCH_FUTURES] != Py_None) {
        self->torch_futures = (const mpidag_torch_futures *)PyCapsule_GetPointer(
            self->o[O_TORCH_FUTURES], MPIDAG_TORCH_FUTURES_CAPSULE);
        if (self->torch_futures == NULL)
            return -1;
    }
    self->doorbell = PyObject_TypeCheck(self->o[O_DOORBELL], &DoorbellType)
        ? (Doorbell *)self->o[O_DOORBELL] : NULL;
    self->tensor_facts = NULL;
    if (self->o[O_TENSOR_FACTS] != Py_None) {
        self->tensor_facts = (mpidag_tensor_facts_fn)PyCapsule_GetPointer(
            self->o[O_TENSOR_FACTS], MPIDAG_TENSOR_FACTS_CAPSULE);
        if (self->tensor_facts == NULL)
            return -1;
    }
    if (self->empty_dict == NULL && (self->empty_dict = PyDict_New()) == NULL)
        return -1;
    if (self->empty_tuple == NULL && (self->empty_tuple = PyTuple_New(0)) == NULL)
        return -1;
#define NAME(field, text)                                                                  \
    if (self->field == NULL && (self->field = PyUnicode_InternFromString(text)) == NULL)   \
        return -1;
    NAME(s_open, "open") NAME(s_default_timeout, "default_timeout")
    NAME(s_send_hook, "send_hook") NAME(s_send_frame0, "send_frame0")
    NAME(s_send_now, "send_now")
    NAME(s_encode, "encode") NAME(s_observer, "observer") NAME(s_active, "active")
    NAME(s_user_callbacks, "user_callbacks") NAME(s_asynchronous, "asynchronous")
    NAME(s_wrapped_async, "_wrapped_async_rpc_function")
    NAME(s_layout, "layout") NAME(s_is_cpu, "is_cpu") NAME(s_is_contiguous, "is_contiguous")
    NAME(s_nbytes, "nbytes") NAME(s_cpu, "cpu") NAME(s_id, "id") NAME(s_engine, "engine")
    NAME(s_popleft, "popleft") NAME(s_probe_frame0, "probe_frame0")
    NAME(s_outgoing, "outgoing") NAME(s_received, "received") NAME(s_serving, "serving")
    NAME(s_served, "served") NAME(s_replying, "replying") NAME(s_sent, "sent")
    NAME(s_mode, "mode") NAME(s_control, "control") NAME(s_done, "done") NAME(s_fn, "fn")
    NAME(s_value, "value") NAME(s_is_profiler_enabled, "_is_profiler_enabled")
    NAME(s_observing, "_observing") NAME(s_earliest_deadline, "earliest_deadline")
    NAME(s_waiting_users, "waiting_users")
#undef NAME
    return 0;
}

static int Core_traverse(Core *self, visitproc visit, void *arg)
{
    for (int i = 0; i < N_OBJECTS; i++)
        Py_VISIT(self->o[i]);
    return 0;
}

static int Core_clear(Core *self)
{
    for (int i = 0; i < N_OBJECTS; i++)
        Py_CLEAR(self->o[i]);
    return 0;
}

static void Core_dealloc(Core *self)
{
    PyObject_GC_UnTrack(self);
    Core_clear(self);
    for (int i = 0; i < N_ENV; i++)
        Py_XDECREF(self->env_slots[i]);
    for (int i = 0; i < N_PC; i++)
        Py_XDECREF(self->pc_slots[i]);
    Py_XDECREF(self->protocol);
    Py_XDECREF(self->empty_dict);
    Py_XDECREF(self->empty_tuple);
    PyObject *names[] = {self->s_open, self->s_default_timeout, self->s_send_hook,
                         self->s_send_frame0, self->s_send_now, self->s_encode,
                         self->s_observer,
                         self->s_active, self->s_user_callbacks, self->s_asynchronous,
                         self->s_wrapped_async, self->s_layout, self->s_is_cpu,
                         self->s_is_contiguous,
                         self->s_nbytes, self->s_cpu, self->s_id, self->s_engine,
                         self->s_popleft, self->s_probe_frame0, self->s_outgoing,
                         self->s_received, self->s_serving, self->s_served,
                         self->s_replying, self->s_sent, self->s_mode, self->s_control,
                         self->s_done, self->s_value, self->s_is_profiler_enabled,
                         self->s_observing, self->s_earliest_deadline};
    for (size_t i = 0; i < sizeof(names) / sizeof(names[0]); i++)
        Py_XDECREF(names[i]);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

#define READY(self)                                                                        \
    if ((self)->o[0] == NULL) {                                                            \
        PyErr_SetString(PyExc_RuntimeError, "Core is not initialised (or was cleared)");   \
        return NULL;                                                                       \
    }

/* ------------------------------------------------ the call observer (autograd) */
/* A call in a distributed autograd context takes this path too: the agent's call observer
 * (plugins.observer, the context container) is called here where the Python path calls it
 * (outgoing/sent on the caller, received at dispatch and serving/served around the
 * function on the callee, replying/sent for a result with tensors, and the result's
 * received, as OutgoingCalls.complete records it), with the same arguments; the names of the
 * recorded messages are lazy (MessageName, below). */

/* The lazy name of a recorded message: a MessageName called gives the string the agent's
 * Python names it with (OutgoingCalls.arguments_sent, Server.arguments_from,
 * arguments_served, result_sent, and the result's name in OutgoingCalls._observe_result),
 * made here: describe's cached name of the function (handlers.DESCRIBED; else
 * handlers.describe itself) and the peer's worker name. A recorded message is named once,
 * when first read (a send function right after its walk, a received call once unpickled, a
 * result at once); until then the name holds the function and its arguments. */
enum { NAME_ARGUMENTS_SENT, NAME_ARGUMENTS_FROM, NAME_ARGUMENTS_SERVED, NAME_RESULT_SENT,
       NAME_RESULT_FROM, N_NAME_KINDS };
/* each kind's text: before the function's name, and between it and the peer's (the
 * arguments of a call from a peer name no function) */
static const char *NAME_TEXTS[N_NAME_KINDS][2] = {
    {"the arguments of ", " sent to "}, {"the arguments of a call from ", NULL},
    {"the arguments of ", " from "}, {"the result of ", " sent to "},
    {"the result of ", " from "}};
static PyObject *name_texts[N_NAME_KINDS][2]; /* the same as str objects (module init) */

/* what a MessageName holds: describe, its cache, the called function and its arguments
 * (NULL for NAME_ARGUMENTS_FROM; args NULL: None), the peer's worker name */
enum { HELD_DESCRIBE, HELD_DESCRIBED, HELD_FUNC, HELD_ARGS, HELD_PEER, N_HELD };

typedef struct {
    PyObject_HEAD
    PyObject *held[N_HELD];
    int kind;
} MessageName;

static int MessageName_traverse(MessageName *self, visitproc visit, void *arg)
{
    for (int i = 0; i < N_HELD; i++)
        Py_VISIT(self->held[i]);
    return 0;
}

static int MessageName_clear(MessageName *self)
{
    for (int i = 0; i < N_HELD; i++)
        Py_CLEAR(self->held[i]);
    return 0;
}

static void MessageName_dealloc(MessageName *self)
{
    PyObject_GC_UnTrack(self);
    (void)MessageName_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* describe(func, args): its cached name, else handlers.describe's (a new reference) */
static PyObject *describe_call(MessageName *self)
{
    PyObject *func = self->held[HELD_FUNC];
    PyObject *name = PyDict_GetItemWithError(self->held[HELD_DESCRIBED], func);
    if (name != NULL)
        return Py_NewRef(name);
    if (PyErr_Occurred()) {
        if (!PyErr_ExceptionMatches(PyExc_TypeError)) /* describe's own: unhashable */
            return NULL;
        PyErr_Clear();
    }
    PyObject *args = self->held[HELD_ARGS];
    PyObject *argv[2] = {func, args != NULL ? args : Py_None};
    return PyObject_Vectorcall(self->held[HELD_DESCRIBE], argv, 2, NULL);
}

/* the concatenation of the n strings parts (str objects), or NULL */
static PyObject *joined(PyObject *const *parts, int n)
{
    Py_ssize_t length = 0;
    Py_UCS4 widest = 0;
    for (int i = 0; i < n; i++) {
        if (!PyUnicode_Check(parts[i])) {
            PyErr_Format(PyExc_TypeError, "a message name's part must be a str, not %.100s",
                         Py_TYPE(parts[i])->tp_name);
            return NULL;
        }
        length += PyUnicode_GET_LENGTH(parts[i]);
        Py_UCS4 most = PyUnicode_MAX_CHAR_VALUE(parts[i]);
        widest = most > widest ? most : widest;
    }
    PyObject *text = PyUnicode_New(length, widest);
    Py_ssize_t at = 0;
    for (int i = 0; text != NULL && i < n; i++) {
        if (PyUnicode_CopyCharacters(text, at, parts[i], 0, PyUnicode_GET_LENGTH(parts[i])) < 0)
            Py_CLEAR(text);
        else
            at += PyUnicode_GET_LENGTH(parts[i]);
    }
    return text;
}

static PyObject *MessageName_call(MessageName *self, PyObject *args, PyObject *kwargs)
{
    if (PyTuple_GET_SIZE(args) != 0 || (kwargs != NULL && PyDict_GET_SIZE(kwargs) != 0)) {
        PyErr_SetString(PyExc_TypeError, "a message name takes no arguments");
        return NULL;
    }
    PyObject *const *texts = name_texts[self->kind];
    PyObject *peer = self->held[HELD_PEER];
    if (texts[1] == NULL) {
        PyObject *parts[2] = {texts[0], peer};
        return joined(parts, 2);
    }
    PyObject *called = self->held[HELD_FUNC] != NULL ? describe_call(self)
                                                     : PyUnicode_FromString("a call");
    if (called == NULL)
        return NULL;
    PyObject *parts[4] = {texts[0], called, texts[1], peer};
    PyObject *name = joined(parts, 4);
    Py_DECREF(called);
    return name;
}

static PyObject *MessageName_repr(MessageName *self)
{
    return PyUnicode_FromFormat("<the lazy name of a message (kind %d) with %S>", self->kind,
                                self->held[HELD_PEER]);
}

static PyTypeObject MessageNameType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "_mpidag_fastpath.MessageName",
    .tp_basicsize = sizeof(MessageName),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "The lazy name of a recorded message: called, the string (made by the compiled "
              "call path).",
    .tp_dealloc = (destructor)MessageName_dealloc,
    .tp_traverse = (traverseproc)MessageName_traverse,
    .tp_clear = (inquiry)MessageName_clear,
    .tp_call = (ternaryfunc)MessageName_call,
    .tp_repr = (reprfunc)MessageName_repr,
};

/* the lazy name of a message of kind `kind` exchanged with rank (func: the called function
 * with its args, or NULL), or NULL */
static PyObject *lazy_name(Core *self, int kind, PyObject *func, PyObject *args, long rank)
{
    PyObject *names = self->o[O_PEER_NAMES];
    if (!PyTuple_Check(names) || rank < 0 || rank >= PyTuple_GET_SIZE(names)) {
        PyErr_Format(PyExc_IndexError, "no worker name for rank %ld", rank);
        return NULL;
    }
    MessageName *name = PyObject_GC_New(MessageName, &MessageNameType);
    if (name == NULL)
        return NULL;
    name->held[HELD_DESCRIBE] = Py_NewRef(self->o[O_DESCRIBE]);
    name->held[HELD_DESCRIBED] = Py_NewRef(self->o[O_DESCRIBED]);
    name->held[HELD_FUNC] = Py_XNewRef(func);
    name->held[HELD_ARGS] = Py_XNewRef(args);
    name->held[HELD_PEER] = Py_NewRef(PyTuple_GET_ITEM(names, rank));
    name->kind = kind;
    PyObject_GC_Track(name);
    return (PyObject *)name;
}

/* observer.method(*argv) (argv[0] is left free for the observer), or NULL */
static PyObject *call_observer(Core *self, PyObject *name, PyObject **argv, Py_ssize_t n)
{
    PyObject *observer = PyObject_GetAttr(self->o[O_PLUGINS], self->s_observer);
    if (observer == NULL)
        return NULL;
    argv[0] = observer;
    PyObject *r = PyObject_VectorcallMethod(name, argv, (size_t)n + 1, NULL);
    Py_DECREF(observer);
    return r;
}

/* observer.outgoing(dst, tensors, name): the header's ids of a call; 0, or -1 */
static int observe_outgoing(Core *self, long dst, PyObject *func, PyObject *args,
                            PyObject *tensors, long long *context_id, long long *message_id)
{
    PyObject *rank = PyLong_FromLong(dst);
    PyObject *name = lazy_name(self, NAME_ARGUMENTS_SENT, func, args, dst);
    PyObject *list = tensors != NULL ? Py_NewRef(tensors) : PyList_New(0);
    PyObject *ids = NULL;
    if (rank != NULL && name != NULL && list != NULL) {
        PyObject *argv[4] = {NULL, rank, list, name};
        ids = call_observer(self, self->s_outgoing, argv, 3);
    }
    Py_XDECREF(rank);
    Py_XDECREF(name);
    Py_XDECREF(list);
    if (ids == NULL)
        return -1;
    int rc = -1;
    if (PyTuple_Check(ids) && PyTuple_GET_SIZE(ids) == 2) {
        *context_id = PyLong_AsLongLong(PyTuple_GET_ITEM(ids, 0));
        *message_id = PyLong_AsLongLong(PyTuple_GET_ITEM(ids, 1));
        rc = PyErr_Occurred() ? -1 : 0;
    } else {
        PyErr_SetString(PyExc_TypeError, "the call observer's outgoing() must return "
                                         "(context_id, message_id)");
    }
    Py_DECREF(ids);
    return rc;
}

/* observer.sent(context_id, message_id): 0, or -1 */
static int observe_sent(Core *self, long long context_id, long long message_id)
{
    PyObject *c = PyLong_FromLongLong(context_id), *m = PyLong_FromLongLong(message_id);
    PyObject *r = NULL;
    if (c != NULL && m != NULL) {
        PyObject *argv[3] = {NULL, c, m};
        r = call_observer(self, self->s_sent, argv, 2);
    }
    Py_XDECREF(c);
    Py_XDECREF(m);
    Py_XDECREF(r);
    return r == NULL ? -1 : 0;
}

/* observer.received(env, name) of a CALL at dispatch, as Server.accept_call records it:
 * (state, None), or (None, the error) for the call's answer; NULL on a failure to say so */
static PyObject *observe_call(Core *self, PyObject *env, long src)
{
    PyObject *name = lazy_name(self, NAME_ARGUMENTS_FROM, NULL, NULL, src);
    if (name == NULL)
        return NULL;
    PyObject *argv[3] = {NULL, env, name};
    PyObject *state = call_observer(self, self->s_received, argv, 2);
    Py_DECREF(name);
    if (state == NULL) {
        PyObject *exc = take_error();
        if (exc == NULL)
            return NULL;
        PyObject *received = PyTuple_Pack(2, Py_None, exc);
        Py_DECREF(exc);
        return received;
    }
    PyObject *received = PyTuple_Pack(2, state, Py_None);
    Py_DECREF(state);
    return received;
}

/* observer.received(env, name) of call's result env, whose tensors require grad (what
 * OutgoingCalls.complete does): 1 recorded (env.tensors replaced), 0 the recording
 * failed and the call failed with its error (result_not_recorded), -1 an error */
static int observe_result(Core *self, PyObject *env, PyObject *call)
{
    int ok = 1;
    long src = (long)slot_ll(self->env_slots[ENV_SRC], env, &ok);
    if (!ok)
        return -1;
    PyObject *func = slot_get(self->pc_slots[PC_FUNC], call);
    PyObject *args = func != NULL ? slot_get(self->pc_slots[PC_ARGS], call) : NULL;
    PyObject *name = args != NULL ? lazy_name(self, NAME_RESULT_FROM, func, args, src) : NULL;
    Py_XDECREF(func);
    Py_XDECREF(args);
    if (name == NULL)
        return -1;
    PyObject *argv[3] = {NULL, env, name};
    PyObject *ctx = call_observer(self, self->s_received, argv, 2);
    Py_DECREF(name);
    if (ctx != NULL) {
        Py_DECREF(ctx);
        return 1;
    }
    PyObject *exc = take_error();
    if (exc == NULL)
        return -1;
    PyObject *failed_argv[3] = {env, call, exc};
    PyObject *r = PyObject_Vectorcall(self->o[O_NOT_RECORDED], failed_argv, 3, NULL);
    Py_DECREF(exc);
    if (r == NULL)
        return -1;
    Py_DECREF(r);
    return 0;
}

/* ------------------------------------------------------------------ the caller */

/* ------------------------------------------------ plain values as pickle bytes */
/* The pickle of a plain value (protocol 4 or 5, no frame, no memo), written here rather
 * than by pickle.dumps: the opcodes pickle's own C pickler writes for these types, which
 * every unpickler reads. pickle.dumps makes a 4 KiB output buffer per call, a request
 * glibc serves from its large bins after consolidating every small chunk freed since:
 * measured, the first dumps after a backward pass freed its graph took 40-60 us, the
 * next one 1.5 us. Writing here makes one bytes object of the exact size. */
#define PLAIN_DEPTH 3 /* (args, kwargs) and (holes, kwargs, slots) hold tuples of values */
#define PICKLE_PROTO 0x80
#define PICKLE_STOP '.'

/* the bytes of two's complement v, little-endian, that pickle's LONG1 needs (1-8) */
static int long1_size(long long v)
{
    for (int n = 1; n < 8; n++) {
        long long limit = 1LL << (8 * n - 1);
        if (v >= -limit && v < limit)
            return n;
    }
    return 8;
}

/* bytes the pickle opcodes of obj take; -1: not a value written here (no error set; a
 * str the UTF-8 codec refuses is one), -2: an error */
static Py_ssize_t plain_size(PyObject *obj, int depth)
{
    PyTypeObject *t = Py_TYPE(obj);
    if (obj == Py_None || t == &PyBool_Type)
        return 1;
    if (t == &PyLong_Type) {
        int overflow;
        long long v = PyLong_AsLongLongAndOverflow(obj, &overflow);
        if (overflow)
            return -1; /* pickle.dumps writes the long ones */
        if (v == -1 && PyErr_Occurred())
            return -2;
        if (v >= 0 && v <= 0xff)
            return 2;
        if (v >= 0 && v <= 0xffff)
            return 3;
        if (v >= -0x80000000LL && v <= 0x7fffffffLL)
            return 5;
        return 2 + long1_size(v);
    }
    if (t == &PyFloat_Type)
        return 9;
    if (t == &PyUnicode_Type) {
        Py_ssize_t n;
        if (PyUnicode_AsUTF8AndSize(obj, &n) == NULL) {
            PyErr_Clear(); /* lone surrogates: pickle.dumps writes them its way */
            return -1;
        }
        return n < 256 ? 2 + n : n <= 0xffffffffLL ? 5 + n : -1;
    }
    if (t == &PyBytes_Type) {
        Py_ssize_t n = PyBytes_GET_SIZE(obj);
        return n < 256 ? 2 + n : n <= 0xffffffffLL ? 5 + n : -1;
    }
    if (t == &PyDict_Type)
        return PyDict_GET_SIZE(obj) == 0 ? 1 : -1;
    if (t != &PyTuple_Type || depth >= PLAIN_DEPTH)
        return -1;
    Py_ssize_t n = PyTuple_GET_SIZE(obj), size = n == 0 ? 1 : n <= 3 ? 1 : 2;
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_ssize_t item = plain_size(PyTuple_GET_ITEM(obj, i), depth + 1);
        if (item < 0)
            return item;
        size += item;
    }
    return size;
}

static char *put_u32(char *p, Py_ssize_t n)
{
    for (int i = 0; i < 4; i++)
        *p++ = (char)((n >> (8 * i)) & 0xff);
    return p;
}

/* write the opcodes plain_size measured; returns the end */
static char *plain_write(char *p, PyObject *obj)
{
    PyTypeObject *t = Py_TYPE(obj);
    if (obj == Py_None) {
        *p++ = 'N';
    } else if (t == &PyBool_Type) {
        *p++ = obj == Py_True ? '\x88' : '\x89'; /* NEWTRUE, NEWFALSE */
    } else if (t == &PyLong_Type) {
        long long v = PyLong_AsLongLong(obj);
        int n;
        if (v >= 0 && v <= 0xff) {
            *p++ = 'K'; /* BININT1 */
            n = 1;
        } else if (v >= 0 && v <= 0xffff) {
            *p++ = 'M'; /* BININT2 */
            n = 2;
        } else if (v >= -0x80000000LL && v <= 0x7fffffffLL) {
            *p++ = 'J'; /* BININT */
            n = 4;
        } else {
            *p++ = '\x8a'; /* LONG1 */
            n = long1_size(v);
            *p++ = (char)n;
        }
        unsigned long long u = (unsigned long long)v;
        for (int i = 0; i < n; i++)
            *p++ = (char)((u >> (8 * i)) & 0xff);
    } else if (t == &PyFloat_Type) {
        *p++ = 'G'; /* BINFLOAT: big-endian */
        PyFloat_Pack8(PyFloat_AS_DOUBLE(obj), p, 0);
        p += 8;
    } else if (t == &PyUnicode_Type || t == &PyBytes_Type) {
        Py_ssize_t n;
        const char *data;
        if (t == &PyUnicode_Type) {
            data = PyUnicode_AsUTF8AndSize(obj, &n); /* (cached by plain_size) */
        } else {
            data = PyBytes_AS_STRING(obj);
            n = PyBytes_GET_SIZE(obj);
        }
        if (n < 256) {
            *p++ = t == &PyUnicode_Type ? '\x8c' : 'C'; /* SHORT_BINUNICODE, SHORT_BINBYTES */
            *p++ = (char)n;
        } else {
            *p++ = t == &PyUnicode_Type ? 'X' : 'B'; /* BINUNICODE, BINBYTES */
            p = put_u32(p, n);
        }
        memcpy(p, data, n);
        p += n;
    } else if (t == &PyDict_Type) {
        *p++ = '}'; /* EMPTY_DICT */
    } else {
        Py_ssize_t n = PyTuple_GET_SIZE(obj);
        if (n == 0) {
            *p++ = ')'; /* EMPTY_TUPLE */
            return p;
        }
        if (n > 3)
            *p++ = '('; /* MARK */
        for (Py_ssize_t i = 0; i < n; i++)
            p = plain_write(p, PyTuple_GET_ITEM(obj, i));
        *p++ = n > 3 ? 't' : (char)(0x84 + n); /* TUPLE, TUPLE1-3 */
    }
    return p;
}

/* The value of the pickle at p[0:n] when it holds only the opcodes plain_write writes,
 * protocol 4 or 5 (a new reference). NULL with no error set: not such a pickle (a
 * pickle.dumps of the same value has FRAME and MEMOIZE opcodes; a malformed one), which
 * pickle.loads then reads and judges; NULL with an error set: out of memory. Reads what
 * pickle.loads would make of the same bytes (UTF-8 with surrogatepass, as pickle), in
 * ~0.2k instructions instead of its ~1.3k (an Unpickler made and freed per call). */
#define PLAIN_STACK 80
static PyObject *plain_load(const void *data, Py_ssize_t n)
{
    const unsigned char *p = data;
    PyObject *stack[PLAIN_STACK];
    int marks[PLAIN_DEPTH + 1];
    int depth = 0, n_marks = 0;
    const unsigned char *end = p + n;
    if (n < 4 || p[0] != PICKLE_PROTO || p[1] < 4 || p[1] > 5)
        return NULL;
    p += 2;
#define NEED(k) if (end - p < (Py_ssize_t)(k)) goto not_plain
    while (p < end) {
        unsigned char op = *p++;
        PyObject *v;
        Py_ssize_t len;
        switch (op) {
        case 'N':
            v = Py_NewRef(Py_None);
            break;
        case 0x88: /* NEWTRUE */
            v = Py_NewRef(Py_True);
            break;
        case 0x89: /* NEWFALSE */
            v = Py_NewRef(Py_False);
            break;
        case 'K': /* BININT1 */
            NEED(1);
            v = PyLong_FromLong(p[0]);
            p += 1;
            break;
        case 'M': /* BININT2 */
            NEED(2);
            v = PyLong_FromLong(p[0] | p[1] << 8);
            p += 2;
            break;
        case 'J': { /* BININT: signed, little-endian */
            NEED(4);
            uint32_t u = (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 |
                         (uint32_t)p[3] << 24;
            v = PyLong_FromLong((int32_t)u);
            p += 4;
            break;
        }
        case 0x8a: { /* LONG1: two's complement, little-endian, 1-8 bytes here */
            NEED(1);
            int k = p[0];
            if (k < 1 || k > 8)
                goto not_plain;
            NEED(1 + k);
            unsigned long long u = 0;
            for (int i = 0; i < k; i++)
                u |= (unsigned long long)p[1 + i] << (8 * i);
            if (k < 8 && (p[k] & 0x80))
                u |= ~0ULL << (8 * k);
            v = PyLong_FromLongLong((long long)u);
            p += 1 + k;
            break;
        }
        case 'G': { /* BINFLOAT: big-endian */
            NEED(8);
            double d = PyFloat_Unpack8((const char *)p, 0);
            if (d == -1.0 && PyErr_Occurred())
                goto fail;
            v = PyFloat_FromDouble(d);
            p += 8;
            break;
        }
        case 0x8c: /* SHORT_BINUNICODE */
        case 'C':  /* SHORT_BINBYTES */
        case 'X':  /* BINUNICODE */
        case 'B':  /* BINBYTES */
            if (op == 0x8c || op == 'C') {
                NEED(1);
                len = p[0];
                p += 1;
            } else {
                NEED(4);
                len = (Py_ssize_t)((uint32_t)p[0] | (uint32_t)p[1] << 8 |
                                   (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24);
                p += 4;
            }
            NEED(len);
            if (op == 0x8c || op == 'X') {
                v = PyUnicode_DecodeUTF8((const char *)p, len, "surrogatepass");
                if (v == NULL && PyErr_ExceptionMatches(PyExc_UnicodeDecodeError)) {
                    PyErr_Clear(); /* pickle.loads raises its own error for it */
                    goto not_plain;
                }
            } else {
                v = PyBytes_FromStringAndSize((const char *)p, len);
            }
            p += len;
            break;
        case '}': /* EMPTY_DICT */
            v = PyDict_New();
            break;
        case ')': /* EMPTY_TUPLE */
            v = PyTuple_New(0);
            break;
        case '(': /* MARK */
            if (n_marks > PLAIN_DEPTH)
                goto not_plain;
            marks[n_marks++] = depth;
            continue;
        case 't':  /* TUPLE: the items since the mark */
        case 0x85: /* TUPLE1 */
        case 0x86: /* TUPLE2 */
        case 0x87: { /* TUPLE3 */
            int first;
            if (op == 't') {
                if (n_marks == 0)
                    goto not_plain;
                first = marks[--n_marks];
            } else {
                first = depth - (op - 0x84);
                if (first < (n_marks ? marks[n_marks - 1] : 0))
                    goto not_plain;
            }
            v = PyTuple_New(depth - first);
            if (v == NULL)
                goto fail;
            for (int i = first; i < depth; i++)
                PyTuple_SET_ITEM(v, i - first, stack[i]);
            depth = first;
            break;
        }
        case PICKLE_STOP:
            if (depth != 1 || n_marks != 0 || p != end)
                goto not_plain;
            return stack[0];
        default:
            goto not_plain;
        }
        if (v == NULL)
            goto fail;
        if (depth == PLAIN_STACK) {
            Py_DECREF(v);
            goto not_plain;
        }
        stack[depth++] = v;
    }
#undef NEED
not_plain: /* (no error set) */
fail:      /* (an error set) */
    for (int i = 0; i < depth; i++)
        Py_DECREF(stack[i]);
    return NULL;
}

/* pickle.loads of the plain pickle at p[0:n] (memory the caller holds): plain_load, else
 * pickle.loads of a view of it. A new reference, or NULL with an error set. */
static PyObject *plain_loads(Core *self, const void *p, Py_ssize_t n)
{
    PyObject *value = plain_load(p, n);
    if (value != NULL || PyErr_Occurred())
        return value;
    PyObject *view = PyMemoryView_FromMemory((char *)p, n, PyBUF_READ);
    if (view == NULL)
        return NULL;
    value = PyObject_CallOneArg(self->o[O_LOADS], view);
    Py_DECREF(view);
    return value;
}

/* prefix (bytes, or NULL) + the pickle of obj, a new bytes object; Py_None (a new
 * reference) when obj is not a value written here; NULL on error */
static PyObject *plain_pickle(PyObject *prefix, PyObject *obj, int protocol)
{
    Py_ssize_t body = protocol >= 4 ? plain_size(obj, 0) : -1;
    if (body < 0)
        return body == -1 ? Py_NewRef(Py_None) : NULL;
    Py_ssize_t n_prefix = prefix != NULL ? PyBytes_GET_SIZE(prefix) : 0;
    PyObject *out = PyBytes_FromStringAndSize(NULL, n_prefix + 2 + body + 1);
    if (out == NULL)
        return NULL;
    char *p = PyBytes_AS_STRING(out);
    if (n_prefix)
        memcpy(p, PyBytes_AS_STRING(prefix), n_prefix);
    p += n_prefix;
    *p++ = (char)PICKLE_PROTO;
    *p++ = (char)protocol;
    p = plain_write(p, obj);
    *p = PICKLE_STOP;
    return out;
}

/* ref + pickle of obj (a new bytes object), or NULL */
static PyObject *ref_and_pickle(Core *self, PyObject *ref, PyObject *obj)
{
    PyObject *written = plain_pickle(ref, obj, self->proto);
    if (written != Py_None)
        return written;
    Py_DECREF(written);
    PyObject *dump_args[2] = {obj, self->protocol};
    PyObject *pickled = PyObject_Vectorcall(self->o[O_DUMPS], dump_args, 2, NULL);
    if (pickled == NULL)
        return NULL;
    Py_ssize_t n_ref = PyBytes_GET_SIZE(ref), n_pickle = PyBytes_GET_SIZE(pickled);
    PyObject *payload = PyBytes_FromStringAndSize(NULL, n_ref + n_pickle);
    if (payload != NULL) {
        memcpy(PyBytes_AS_STRING(payload), PyBytes_AS_STRING(ref), n_ref);
        memcpy(PyBytes_AS_STRING(payload) + n_ref, PyBytes_AS_STRING(pickled), n_pickle);
    }
    Py_DECREF(pickled);
    return payload;
}

/* The payload of a call of args with tensors among them: ref + pickle of
 * (args with None for each tensor, kwargs, slots); *tensors the table (a tensor passed
 * twice is sent once). NULL with no error: a tensor that cannot travel this way. */
static PyObject *slotted_payload(Core *self, PyObject *ref, PyObject *args, PyObject *kwargs,
                                 PyObject **tensors)
{
    Py_ssize_t n = PyTuple_GET_SIZE(args);
    PyObject *holes = PyTuple_New(n), *slots = PyTuple_New(n), *table = PyList_New(0);
    PyObject *payload = NULL;
    if (holes == NULL || slots == NULL || table == NULL)
        goto done;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = PyTuple_GET_ITEM(args, i);
        Py_ssize_t slot = -1;
        if (!is_plain(item)) { /* (a tuple of plain values travels in the pickle) */
            for (Py_ssize_t j = 0; j < PyList_GET_SIZE(table); j++)
                if (PyList_GET_ITEM(table, j) == item)
                    slot = j;
            if (slot < 0) {
                int ok = plain_tensor(self, item);
                if (ok <= 0)
                    goto done;
                slot = PyList_GET_SIZE(table);
                if (PyList_Append(table, item) < 0)
                    goto done;
            }
        }
        PyObject *index = PyLong_FromSsize_t(slot);
        if (index == NULL)
            goto done;
        PyTuple_SET_ITEM(slots, i, index);
        PyTuple_SET_ITEM(holes, i, Py_NewRef(slot < 0 ? item : Py_None));
    }
    PyObject *three = PyTuple_Pack(3, holes, kwargs, slots);
    if (three == NULL)
        goto done;
    payload = ref_and_pickle(self, ref, three);
    Py_DECREF(three);
    if (payload != NULL)
        *tensors = Py_NewRef(table);
done:
    Py_XDECREF(holes);
    Py_XDECREF(slots);
    Py_XDECREF(table);
    return payload;
}

/* The call's payload: the function's reference, then the pickle of (args, kwargs) unless
 * both are empty; with tensors among the arguments, see slotted_payload (*tensors: their
 * table, else NULL). NULL with no error: not a call for this path. */
static PyObject *call_payload(Core *self, PyObject *func, PyObject *args, PyObject *kwargs,
                              int *flags, PyObject **tensors)
{
    *tensors = NULL;
    if (!PyTuple_CheckExact(args) || !PyDict_CheckExact(kwargs) || PyDict_GET_SIZE(kwargs) ||
        PyTuple_GET_SIZE(args) > MAX_ARGS)
        return NULL;
    PyObject *prefix = PyDict_GetItemWithError(self->o[O_PREFIXES], func); /* borrowed */
    if (prefix == NULL) { /* a new function (the Python path makes its reference), or one */
        PyErr_Clear();    /* that cannot be a key (unhashable: the Python checks say why) */
        return NULL;
    }
    if (!PyTuple_CheckExact(prefix) || PyTuple_GET_SIZE(prefix) != 2 ||
        !PyBytes_CheckExact(PyTuple_GET_ITEM(prefix, 0)))
        return NULL;
    long flag = PyLong_AsLong(PyTuple_GET_ITEM(prefix, 1));
    if (flag == -1 && PyErr_Occurred())
        return NULL;
    PyObject *ref = PyTuple_GET_ITEM(prefix, 0);
    if (!is_plain(args)) {
        for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(args); i++) { /* before allocating: */
            PyObject *item = PyTuple_GET_ITEM(args, i); /* the Python path sends anything */
            if (!is_plain(item) && Py_TYPE(item) != (PyTypeObject *)self->o[O_TENSOR_TYPE])
                return NULL; /* else (a plain value, a short tuple of them, a tensor), and */
        }                    /* would redo this work */
        *flags = (int)flag | FLAG_TENSOR_SLOTS;
        return slotted_payload(self, ref, args, kwargs, tensors);
    }
    *flags = (int)flag | FLAG_PLAIN;
    if (PyTuple_GET_SIZE(args) == 0)
        return Py_NewRef(ref);
    PyObject *both = PyTuple_Pack(2, args, kwargs);
    if (both == NULL)
        return NULL;
    PyObject *payload = ref_and_pickle(self, ref, both);
    Py_DECREF(both);
    return payload;
}

/* 1: the agent is open; 2: open, and the call observer records calls (a rank with an
 * autograd context: see observe_outgoing); 0: leave the call to Python; -1: error */
static int may_send_plain(Core *self, long dst, int record)
{
    int is_open = truth_of(PyObject_GetAttr(self->o[O_CALLS], self->s_open));
    if (is_open <= 0)
        return is_open; /* shut down: Python raises the error */
    int failed = in_set(self->o[O_PEERS_FAILED], dst);
    if (failed != 0)
        return failed < 0 ? -1 : 0;
    if (record) { /* the call observer (distributed autograd) records calls in a context */
        PyObject *observer = PyObject_GetAttr(self->o[O_PLUGINS], self->s_observer);
        if (observer == NULL)
            return -1;
        int active = truth_of(PyObject_GetAttr(observer, self->s_active));
        Py_DECREF(observer);
        if (active < 0)
            return -1;
        if (active) {
            int can = can_send(self, dst);
            return can == 1 ? 2 : can;
        }
    }
    return can_send(self, dst);
}

/* the bool of globals[name], or of fallback() where globals has no such name: 1, 0, -1 */
static int global_flag(PyObject *globals, PyObject *name, PyObject *fallback)
{
    PyObject *flag = PyDict_GetItemWithError(globals, name); /* borrowed */
    if (flag != NULL)
        return PyObject_IsTrue(flag);
    return PyErr_Occurred() ? -1 : truth_of(PyObject_CallNoArgs(fallback));
}

/* mpidag._remote_profiling.call_profiling() without its Python frame: torch.profiler runs
 * in this process (torch.autograd.profiler._is_profiler_enabled), or a profiler runs on
 * this thread (torch._C._autograd._profiler_enabled()); the Python function itself where
 * torch has no such global. 1, 0, or -1 with an error. */
static int call_profiling(Core *self)
{
    int on = global_flag(self->o[O_PROFILER_GLOBALS], self->s_is_profiler_enabled,
                         self->o[O_CALL_PROFILING]);
    return on != 0 ? on : truth_of(PyObject_CallNoArgs(self->o[O_PROFILER_ENABLED]));
}

/* mpidag._remote_profiling.observing() without its Python frame: torch.profiler runs, or
 * a server-wide profile or GIL profiling (its module's _observing). 1, 0, or -1. */
static int observing(Core *self)
{
    int on = global_flag(self->o[O_PROFILER_GLOBALS], self->s_is_profiler_enabled,
                         self->o[O_OBSERVING]);
    return on != 0 ? on : global_flag(self->o[O_OBSERVING_GLOBALS], self->s_observing,
                                      self->o[O_OBSERVING]);
}

/* An RpcFuture of the engine, made as RpcFuture.__init__ makes it (torch's C future with
 * no devices, then its engine), without its Python frame */
static PyObject *new_future(Core *self)
{
    PyTypeObject *type = (PyTypeObject *)self->o[O_FUTURE_TYPE];
    if (self->torch_futures != NULL) { /* torch's __init__ done in C++, no bindings */
        PyObject *future = self->torch_futures->new_future(type);
        if (future != NULL && PyObject_SetAttr(future, self->s_engine, self->o[O_ENGINE]) < 0)
            Py_CLEAR(future);
        return future;
    }
    PyObject *future = type->tp_new(type, self->empty_tuple, NULL);
    if (future == NULL)
        return NULL;
    PyObject *devices = PyList_New(0);
    PyObject *r = NULL;
    if (devices != NULL) {
        PyObject *init_args[2] = {future, devices};
        r = PyObject_Vectorcall(self->o[O_FUTURE_INIT], init_args, 2, NULL);
        Py_DECREF(devices);
    }
    if (r == NULL || PyObject_SetAttr(future, self->s_engine, self->o[O_ENGINE]) < 0) {
        Py_XDECREF(r);
        Py_DECREF(future);
        return NULL;
    }
    Py_DECREF(r);
    return future;
}

/* the call's (seconds, deadline) by torch's rule: negative or None is the default, 0 none */
/* the float attribute ``name`` of OutgoingCalls into *value: 0, or -1 with an error */
static int calls_float(Core *self, PyObject *name, double *value)
{
    PyObject *attr = PyObject_GetAttr(self->o[O_CALLS], name);
    if (attr == NULL)
        return -1;
    *value = PyFloat_AsDouble(attr);
    Py_DECREF(attr);
    return *value == -1.0 && PyErr_Occurred() ? -1 : 0;
}

static int resolve_timeout(Core *self, PyObject *timeout, double now, PyObject **seconds,
                           PyObject **deadline)
{
    double s;
    if (timeout == Py_None) {
        s = -1.0;
    } else {
        s = PyFloat_AsDouble(timeout);
        if (s == -1.0 && PyErr_Occurred())
            return -1;
    }
    if (s < 0 && calls_float(self, self->s_default_timeout, &s) < 0)
        return -1;
    *seconds = PyFloat_FromDouble(s);
    *deadline = s > 0 ? PyFloat_FromDouble(now + s) : Py_NewRef(Py_None);
    if (*seconds == NULL || *deadline == NULL) {
        Py_CLEAR(*seconds);
        Py_CLEAR(*deadline);
        return -1;
    }
    return 0;
}

/* OutgoingCalls.earliest_deadline lowered to ``deadline`` where that is earlier (as the
 * Python path does when it adds a call): the leader scans the table only once it passed */
static int note_deadline(Core *self, PyObject *deadline)
{
    if (deadline == Py_None)
        return 0;
    double known;
    if (calls_float(self, self->s_earliest_deadline, &known) < 0)
        return -1;
    if (PyFloat_AS_DOUBLE(deadline) >= known)
        return 0;
    return PyObject_SetAttr(self->o[O_CALLS], self->s_earliest_deadline, deadline);
}

static PyObject *new_pending_call(Core *self, PyObject *request_id, PyObject *future, long dst,
                                  double now, PyObject *seconds, PyObject *deadline,
                                  PyObject *func, PyObject *args)
{
    PyTypeObject *type = (PyTypeObject *)self->o[O_PENDING_CALL];
    PyObject *call = type->tp_alloc(type, 0);
    if (call == NULL)
        return NULL;
    PyObject **s = self->pc_slots;
    if (slot_set(s[PC_REQUEST_ID], call, Py_NewRef(request_id)) < 0 ||
        slot_set(s[PC_FUTURE], call, Py_NewRef(future)) < 0 ||
        slot_set(s[PC_DST], call, PyLong_FromLong(dst)) < 0 ||
        slot_set(s[PC_STARTED], call, PyFloat_FromDouble(now)) < 0 ||
        slot_set(s[PC_DEADLINE], call, Py_NewRef(deadline)) < 0 ||
        slot_set(s[PC_FUNC], call, Py_NewRef(func)) < 0 ||
        slot_set(s[PC_SECONDS], call, Py_NewRef(seconds)) < 0 ||
        slot_set(s[PC_ARGS], call, Py_NewRef(args)) < 0 ||
        slot_set(s[PC_DONE], call, Py_NewRef(Py_False)) < 0 ||
        slot_set(s[PC_VALUE], call, Py_NewRef(Py_None)) < 0 ||
        slot_set(s[PC_ERROR], call, Py_NewRef(Py_None)) < 0) {
        Py_DECREF(call);
        return NULL;
    }
    return call;
}

/* A failed send: the call (request_id; NULL for a notification) leaves the table, the
 * message is uncounted, and a failed peer's error names the worker (as Sender.send does).
 * Always returns NULL. */
static PyObject *send_failed(Core *self, PyObject *request_id, long dst)
{
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    if (request_id != NULL && PyDict_DelItem(self->o[O_PENDING], request_id) < 0)
        PyErr_Clear(); /* (expired meanwhile) */
    ((Counters *)self->o[O_COUNTERS])->sent_to[dst]--;
    if (type == NULL || !PyErr_GivenExceptionMatches(type, self->o[O_WORKER_FAILED])) {
        PyErr_Restore(type, value, tb);
        return NULL;
    }
    Py_XDECREF(type);
    Py_XDECREF(value);
    Py_XDECREF(tb);
    PyObject *rank = PyLong_FromLong(dst);
    if (rank == NULL)
        return NULL;
    PyObject *error = PyObject_CallOneArg(self->o[O_FAILED_ERROR], rank);
    Py_DECREF(rank);
    if (error != NULL) { /* raised "from None", as Sender.send does */
        PyException_SetCause(error, NULL);
        ((PyBaseExceptionObject *)error)->suppress_context = 1;
        PyErr_SetObject((PyObject *)Py_TYPE(error), error);
        Py_DECREF(error);
    }
    return NULL;
}

/* send_call(dst, func, args, kwargs, timeout, record, with_future) -> PendingCall | None */
static PyObject *Core_send_call(Core *self, PyObject *const *argv, Py_ssize_t nargs)
{
    READY(self)
    if (nargs != 7) {
        PyErr_SetString(PyExc_TypeError,
                        "send_call(dst, func, args, kwargs, timeout, record, with_future)");
        return NULL;
    }
    long dst = PyLong_AsLong(argv[0]);
    if (dst == -1 && PyErr_Occurred())
        return NULL;
    PyObject *func = argv[1], *args = argv[2], *kwargs = argv[3], *timeout = argv[4];
    int record = PyObject_IsTrue(argv[5]), with_future = PyObject_IsTrue(argv[6]);
    if (record < 0 || with_future < 0)
        return NULL;
    int ok = may_send_plain(self, dst, record);
    if (ok <= 0)
        return ok < 0 ? NULL : Py_NewRef(Py_None);
    int flags = 0;
    PyObject *tensors = NULL;
    PyObject *payload = call_payload(self, func, args, kwargs, &flags, &tensors);
    if (payload == NULL)
        return PyErr_Occurred() ? NULL : Py_NewRef(Py_None);
    Py_ssize_t n_tensors = tensors != NULL ? PyList_GET_SIZE(tensors) : 0;
    if (PyBytes_GET_SIZE(payload) > self->payload_limit) {
        Py_DECREF(payload);
        Py_XDECREF(tensors);
        Py_RETURN_NONE; /* a payload frame of its own: the Python path */
    }
    long long context_id = 0, message_id = 0; /* outside an autograd context: none */
    if (ok == 2 && observe_outgoing(self, dst, func, args, tensors, &context_id,
                                    &message_id) < 0) {
        Py_DECREF(payload);
        Py_XDECREF(tensors);
        return NULL;
    }
    PyObject *count = PyIter_Next(self->o[O_ID_COUNTER]);
    if (count == NULL) {
        Py_DECREF(payload);
        Py_XDECREF(tensors);
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_RuntimeError, "the request id counter ended");
        return NULL;
    }
    long long counter = PyLong_AsLongLong(count);
    Py_DECREF(count);
    if (counter == -1 && PyErr_Occurred()) {
        Py_DECREF(payload);
        Py_XDECREF(tensors);
        return NULL;
    }
    if (counter > self->id_max) {
        Py_DECREF(payload);
        Py_XDECREF(tensors);
        PyErr_Format(PyExc_OverflowError, "request id counter of rank %ld exhausted after "
                     "%lld ids", self->rank, self->id_max);
        return NULL;
    }
    PyObject *request_id = PyLong_FromLongLong(self->id_base | counter);
    PyObject *future = with_future ? new_future(self) : Py_NewRef(Py_None);
    PyObject *seconds = NULL, *deadline = NULL, *call = NULL, *env = NULL;
    double now = monotonic_s();
    if (request_id == NULL || future == NULL ||
        resolve_timeout(self, timeout, now, &seconds, &deadline) < 0)
        goto fail;
    call = new_pending_call(self, request_id, future, dst, now, seconds, deadline, func, args);
    if (call == NULL || PyDict_SetItem(self->o[O_PENDING], request_id, call) < 0)
        goto fail;
    if (note_deadline(self, deadline) < 0) {
        PyDict_DelItem(self->o[O_PENDING], request_id);
        goto fail;
    }
    env = make_envelope(self, CALL, request_id, flags, context_id, message_id, payload,
                        tensors);
    payload = tensors = NULL; /* (stolen) */
    if (env == NULL) {
        PyDict_DelItem(self->o[O_PENDING], request_id);
        goto fail;
    }
    ((Counters *)self->o[O_COUNTERS])->sent_to[dst]++;
    if (send_message(self, dst, env, n_tensors) < 0) {
        send_failed(self, request_id, dst);
        goto fail;
    }
    Py_DECREF(env);
    Py_DECREF(request_id);
    Py_DECREF(future);
    Py_DECREF(seconds);
    Py_DECREF(deadline);
    if (message_id && observe_sent(self, context_id, message_id) < 0)
        Py_CLEAR(call); /* (sent: as in Python, the error reaches the caller) */
    return call;
fail:
    Py_XDECREF(payload);
    Py_XDECREF(tensors);
    Py_XDECREF(env);
    Py_XDECREF(call);
    Py_XDECREF(request_id);
    Py_XDECREF(future);
    Py_XDECREF(seconds);
    Py_XDECREF(deadline);
    return NULL;
}

/* notify(dst, func, args) -> True | None: OutgoingCalls.notify for a plain notification
 * (a NOTIFY, or a CONTROL for a handler of mode "control"), sent here and counted; None: the
 * Python path sends it (and raises the errors the user sees). */
static PyObject *Core_notify(Core *self, PyObject *const *argv, Py_ssize_t nargs)
{
    READY(self)
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "notify(dst, func, args)");
        return NULL;
    }
    long dst = PyLong_AsLong(argv[0]);
    if (dst == -1 && PyErr_Occurred())
        return NULL;
    PyObject *func = argv[1], *args = argv[2];
    int ok = may_send_plain(self, dst, 0);
    if (ok <= 0)
        return ok < 0 ? NULL : Py_NewRef(Py_None);
    int kind = NOTIFY;
    if (PyObject_TypeCheck(func, (PyTypeObject *)self->o[O_HANDLER_TYPE])) {
        PyObject *mode = PyObject_GetAttr(func, self->s_mode);
        if (mode == NULL)
            return NULL;
        int control = PyUnicode_Check(mode) && PyUnicode_Compare(mode, self->s_control) == 0;
        Py_DECREF(mode);
        if (control)
            kind = CONTROL;
    }
    int flags = 0;
    PyObject *tensors = NULL;
    PyObject *payload = call_payload(self, func, args, self->empty_dict, &flags, &tensors);
    if (payload == NULL)
        return PyErr_Occurred() ? NULL : Py_NewRef(Py_None);
    if (PyBytes_GET_SIZE(payload) > self->payload_limit) {
        Py_DECREF(payload);
        Py_XDECREF(tensors);
        Py_RETURN_NONE;
    }
    Py_ssize_t n_tensors = tensors != NULL ? PyList_GET_SIZE(tensors) : 0;
    PyObject *zero = PyLong_FromLong(0);
    if (zero == NULL) {
        Py_DECREF(payload);
        Py_XDECREF(tensors);
        return NULL;
    }
    PyObject *env = make_envelope(self, kind, zero, flags, 0, 0, payload, tensors);
    Py_DECREF(zero);
    if (env == NULL)
        return NULL;
    ((Counters *)self->o[O_COUNTERS])->sent_to[dst]++;
    int rc = send_message(self, dst, env, n_tensors);
    Py_DECREF(env);
    if (rc < 0)
        return send_failed(self, NULL, dst);
    Py_RETURN_TRUE;
}

/* rpc(to, func, args, kwargs, timeout, with_future) -> PendingCall | RpcFuture | None:
 * rpc_sync's and rpc_async's whole caller side when every argument is of the common kind
 * (a worker name or rank, args a tuple or None, no kwargs, a timeout of seconds or the
 * default) and the call is plain; None: the API's Python checks and sends it (and raises
 * the errors the user sees). */
static PyObject *Core_rpc(Core *self, PyObject *const *argv, Py_ssize_t nargs)
{
    READY(self)
    if (nargs != 6) {
        PyErr_SetString(PyExc_TypeError, "rpc(to, func, args, kwargs, timeout, with_future)");
        return NULL;
    }
    PyObject *to = argv[0], *func = argv[1], *args = argv[2], *kwargs = argv[3],
             *timeout = argv[4];
    long dst;
    if (PyUnicode_CheckExact(to)) {
        PyObject *info = PyDict_GetItemWithError(self->o[O_BY_NAME], to);
        if (info == NULL)
            return PyErr_Occurred() ? NULL : Py_NewRef(Py_None);
        PyObject *id = PyObject_GetAttr(info, self->s_id);
        if (id == NULL)
            return NULL;
        dst = PyLong_AsLong(id);
        Py_DECREF(id);
        if (dst == -1 && PyErr_Occurred())
            return NULL;
    } else if (PyLong_CheckExact(to)) {
        dst = PyLong_AsLong(to);
        if (dst == -1 && PyErr_Occurred()) {
            PyErr_Clear();
            Py_RETURN_NONE;
        }
    } else {
        Py_RETURN_NONE;
    }
    if (dst < 0 || dst >= ((Counters *)self->o[O_COUNTERS])->size)
        Py_RETURN_NONE;
    if (args == Py_None)
        args = self->empty_tuple;
    if (kwargs == Py_None)
        kwargs = self->empty_dict;
    if (!PyTuple_CheckExact(args) || !PyDict_CheckExact(kwargs) || PyDict_GET_SIZE(kwargs))
        Py_RETURN_NONE;
    if (timeout != Py_None) {
        if (!PyFloat_CheckExact(timeout) && !PyLong_CheckExact(timeout))
            Py_RETURN_NONE;
        double t = PyFloat_AsDouble(timeout);
        if (t == -1.0 && PyErr_Occurred()) {
            PyErr_Clear();
            Py_RETURN_NONE;
        }
        if (!(t >= 0 && t < INFINITY) && t != -1.0)
            Py_RETURN_NONE; /* inf, NaN, negative: the Python checks */
    }
    int left = in_set(self->o[O_PEERS_LEFT], dst);
    if (left != 0)
        return left < 0 ? NULL : Py_NewRef(Py_None);
    int profiled = call_profiling(self);
    if (profiled != 0)
        return profiled < 0 ? NULL : Py_NewRef(Py_None);
    PyObject *rank = PyLong_FromLong(dst);
    if (rank == NULL)
        return NULL;
    PyObject *call_args[7] = {rank, func, args, kwargs, timeout, Py_True, argv[5]};
    PyObject *call = Core_send_call(self, call_args, 7);
    Py_DECREF(rank);
    if (call == NULL || call == Py_None || !PyObject_IsTrue(argv[5]))
        return call;
    PyObject *future = slot_get(self->pc_slots[PC_FUTURE], call);
    Py_DECREF(call);
    return future;
}

/* ------------------------------------------------------------------ answers */

/* A plain RESULT completes its call here (the caller wakes the waiters); 1 done, 0 leave
 * it to Python, -1 error. *with_future: the call was rpc_async's. */
static int complete_plain(Core *self, PyObject *env, long long flags, long src,
                          int *with_future)
{
    int ok = 1;
    long long message_id = slot_ll(self->env_slots[ENV_MESSAGE_ID], env, &ok);
    if (!ok)
        return -1;
    PyObject *tensors = slot_get(self->env_slots[ENV_TENSORS], env);
    if (tensors == NULL)
        return -1;
    PyObject *lone = NULL; /* the result, when it is one tensor (frames.loads' rule) */
    if (PyList_Check(tensors) && PyList_GET_SIZE(tensors) == 1 && !(flags & FLAG_PLAIN)) {
        PyObject *payload = slot_get(self->env_slots[ENV_PAYLOAD], env);
        if (payload == NULL) {
            Py_DECREF(tensors);
            return -1;
        }
        PyObject *expected = self->o[O_LONE_TENSOR];
        Py_buffer view;
        if (PyObject_GetBuffer(payload, &view, PyBUF_SIMPLE) == 0) {
            if (view.len == PyBytes_GET_SIZE(expected) &&
                memcmp(view.buf, PyBytes_AS_STRING(expected), view.len) == 0)
                lone = Py_NewRef(PyList_GET_ITEM(tensors, 0));
            PyBuffer_Release(&view);
        } else {
            PyErr_Clear();
        }
        Py_DECREF(payload);
    }
    int no_tensors = PyList_Check(tensors) && PyList_GET_SIZE(tensors) == 0;
    Py_DECREF(tensors);
    if (lone == NULL && !((flags & FLAG_PLAIN) && no_tensors))
        return 0;
    PyObject *request_id = slot_get(self->env_slots[ENV_REQUEST_ID], env);
    if (request_id == NULL) {
        Py_XDECREF(lone);
        return -1;
    }
    PyObject *call = PyDict_GetItemWithError(self->o[O_PENDING], request_id);
    if (call == NULL || Py_TYPE(call) != (PyTypeObject *)self->o[O_PENDING_CALL]) {
        Py_DECREF(request_id);
        Py_XDECREF(lone);
        return PyErr_Occurred() ? -1 : 0; /* late (timed out): Python logs it */
    }
    Py_INCREF(call);
    int result = -1;
    PyObject *value = NULL, *payload = NULL;
    PyObject *future = slot_get(self->pc_slots[PC_FUTURE], call);
    if (future == NULL)
        goto done;
    *with_future = future != Py_None;
    if (future != Py_None) {
        int has = truth_of(PyObject_GetAttr(future, self->s_user_callbacks));
        if (has != 0) {
            result = has < 0 ? -1 : 0; /* completed off the leader: Python */
            goto done;
        }
    }
    if (message_id) { /* the result's tensors require grad: its recv function */
        int recorded = observe_result(self, env, call);
        if (recorded <= 0) { /* 0: the call failed with the recording's error */
            result = recorded < 0 ? -1 : 1;
            goto done;
        }
        if (lone != NULL) { /* the recv function's output replaced the received tensor */
            PyObject *recorded_tensors = slot_get(self->env_slots[ENV_TENSORS], env);
            if (recorded_tensors == NULL)
                goto done;
            if (PyList_Check(recorded_tensors) && PyList_GET_SIZE(recorded_tensors) == 1)
                Py_SETREF(lone, Py_NewRef(PyList_GET_ITEM(recorded_tensors, 0)));
            Py_DECREF(recorded_tensors);
        }
    }
    if (lone != NULL) {
        value = Py_NewRef(lone);
    } else {
        payload = slot_get(self->env_slots[ENV_PAYLOAD], env);
        if (payload == NULL)
            goto done;
        Py_buffer view;
        if (PyObject_GetBuffer(payload, &view, PyBUF_SIMPLE) < 0)
            goto done;
        value = plain_loads(self, view.buf, view.len);
        PyBuffer_Release(&view);
        if (value == NULL) { /* Python says what could not be unpickled */
            PyErr_Clear();
            result = 0;
            goto done;
        }
    }
    if (PyDict_DelItem(self->o[O_PENDING], request_id) < 0) {
        /* completed meanwhile (expired by another thread while loads ran) */
        PyErr_Clear();
        ((Counters *)self->o[O_COUNTERS])->processed_from[src]++;
        result = 1;
        goto done;
    }
    if (future == Py_None) {
        if (slot_set(self->pc_slots[PC_VALUE], call, Py_NewRef(value)) < 0)
            goto processed;
    } else {
        PyObject *r;
        if (self->torch_futures != NULL) { /* no callback of the user's: the GIL kept */
            r = self->torch_futures->set_result(future, value);
        } else {
            PyObject *set_args[2] = {future, value};
            r = PyObject_Vectorcall(self->o[O_SET_RESULT], set_args, 2, NULL);
        }
        if (r == NULL)
            goto processed;
        Py_DECREF(r);
    }
    if (slot_set(self->pc_slots[PC_DONE], call, Py_NewRef(Py_True)) < 0)
        goto processed;
    result = 1;
processed:
    ((Counters *)self->o[O_COUNTERS])->processed_from[src]++;
done:
    Py_XDECREF(lone);
    Py_XDECREF(value);
    Py_XDECREF(payload);
    Py_XDECREF(future);
    Py_DECREF(call);
    Py_DECREF(request_id);
    return result;
}

/* ------------------------------------------------------------------ the callee */

/* the function a plain call's reference names, as CallCodec._resolve finds it in its table
 * (NULL with no error: not there yet, or replaced in its module: Python resolves it) */
static PyObject *resolve(Core *self, const char *buf, Py_ssize_t end)
{
    PyObject *key = PyBytes_FromStringAndSize(buf, end);
    if (key == NULL)
        return NULL;
    PyObject *entry = PyDict_GetItemWithError(self->o[O_TARGETS], key);
    Py_DECREF(key);
    if (entry == NULL || !PyTuple_CheckExact(entry) || PyTuple_GET_SIZE(entry) != 3)
        return NULL;
    PyObject *func = PyTuple_GET_ITEM(entry, 0), *namespace = PyTuple_GET_ITEM(entry, 1);
    if (namespace != Py_None) {
        if (!PyDict_Check(namespace))
            return NULL;
        PyObject *now = PyDict_GetItemWithError(namespace, PyTuple_GET_ITEM(entry, 2));
        if (now != func)
            return NULL;
    }
    return Py_NewRef(func);
}

/* getattr(obj, name, None) without making an AttributeError: 1 found (*value a new
 * reference), 0 not there (*value NULL), -1 error */
static int lookup_attr(PyObject *obj, PyObject *name, PyObject **value)
{
#if PY_VERSION_HEX >= 0x030D0000
    return PyObject_GetOptionalAttr(obj, name, value);
#else
    return _PyObject_LookupAttr(obj, name, value);
#endif
}

/* whether func answers with a future (handlers.is_asynchronous); -1 on error */
static int is_asynchronous(Core *self, PyObject *func)
{
    if (Py_TYPE(func) == (PyTypeObject *)self->o[O_HANDLER_TYPE]) {
        return truth_of(PyObject_GetAttr(func, self->s_asynchronous));
    }
    PyObject *wrapped; /* no AttributeError made for a function without it (0.3 us) */
    if (lookup_attr(func, self->s_wrapped_async, &wrapped) < 0)
        return -1;
    int is = wrapped != NULL && wrapped != Py_None;
    Py_XDECREF(wrapped);
    return is;
}

/* observer.replying(context_id, dst, [value], name): the message id of a result in an
 * autograd context (0: none of its tensors requires grad), or -1 with an error set */
static long long observe_replying(Core *self, long long context_id, long dst,
                                  PyObject *func, PyObject *args, PyObject *tensors)
{
    PyObject *name = lazy_name(self, NAME_RESULT_SENT, func, args, dst);
    PyObject *c = PyLong_FromLongLong(context_id), *rank = PyLong_FromLong(dst);
    PyObject *id = NULL;
    if (name != NULL && c != NULL && rank != NULL) {
        PyObject *argv[5] = {NULL, c, rank, tensors, name};
        id = call_observer(self, self->s_replying, argv, 4);
    }
    Py_XDECREF(name);
    Py_XDECREF(c);
    Py_XDECREF(rank);
    if (id == NULL)
        return -1;
    long long message_id = PyLong_AsLongLong(id);
    Py_DECREF(id);
    if (message_id < 0 && !PyErr_Occurred())
        PyErr_SetString(PyExc_ValueError, "the call observer's replying() gave a negative id");
    return PyErr_Occurred() ? -1 : message_id;
}

/* The answer of a served plain call: RESULT, counted as sent and the request as handled;
 * a value that is not plain, or a send the plain path cannot make, goes to Python. In an
 * autograd context (context_id) a lone tensor result is recorded as Server.reply_value
 * records it. */
static int answer(Core *self, PyObject *request, long src, long long context_id,
                  PyObject *func, PyObject *args, PyObject *value)
{
    int plain = is_plain(value);
    int lone = plain ? 0 : plain_tensor(self, value);
    if (lone < 0)
        return -1;
    int can = plain || lone ? can_send(self, src) : 0;
    if (can < 0)
        return -1;
    if (!can) {
        PyObject *call = PyTuple_Pack(2, func, args);
        if (call == NULL)
            return -1;
        PyObject *r = PyObject_CallFunctionObjArgs(self->o[O_PY_REPLY_VALUE], request, value,
                                                   call, NULL);
        Py_DECREF(call);
        Py_XDECREF(r);
        return r == NULL ? -1 : 0;
    }
    PyObject *payload, *tensors = NULL;
    if (lone) { /* frames.dumps' payload of a lone tensor, as the Python path sends it */
        payload = Py_NewRef(self->o[O_LONE_TENSOR]);
        if ((tensors = PyList_New(1)) == NULL) {
            Py_DECREF(payload);
            return -1;
        }
        PyList_SET_ITEM(tensors, 0, Py_NewRef(value));
    } else {
        payload = plain_pickle(NULL, value, self->proto);
        if (payload == Py_None) {
            Py_DECREF(payload);
            PyObject *dump_args[2] = {value, self->protocol};
            payload = PyObject_Vectorcall(self->o[O_DUMPS], dump_args, 2, NULL);
        }
        if (payload == NULL)
            return -1;
    }
    long long message_id = 0;
    if (lone && context_id) {
        message_id = observe_replying(self, context_id, src, func, args, tensors);
        if (message_id < 0) { /* the error is the answer, as in Python */
            Py_DECREF(payload);
            Py_DECREF(tensors);
            PyObject *exc = take_error();
            if (exc == NULL)
                return -1;
            PyObject *r = PyObject_CallFunctionObjArgs(self->o[O_PY_UNSENDABLE], request,
                                                       value, exc, NULL);
            Py_DECREF(exc);
            Py_XDECREF(r);
            return r == NULL ? -1 : 0;
        }
    }
    PyObject *request_id = slot_get(self->env_slots[ENV_REQUEST_ID], request);
    if (request_id == NULL) {
        Py_DECREF(payload);
        Py_XDECREF(tensors);
        return -1;
    }
    PyObject *reply = make_envelope(self, RESULT, request_id, lone ? 0 : FLAG_PLAIN,
                                    message_id ? context_id : 0, message_id, payload,
                                    tensors);
    Py_DECREF(request_id);
    if (reply == NULL)
        return -1;
    Counters *counters = (Counters *)self->o[O_COUNTERS];
    counters->sent_to[src]++;
    counters->processed_from[src]++; /* handled once its answer is on its way */
    int rc = send_message(self, src, reply, lone);
    Py_DECREF(reply);
    if (rc < 0 && PyErr_ExceptionMatches(self->o[O_WORKER_FAILED])) {
        PyErr_Clear(); /* the caller died meanwhile: nobody to answer */
        return 0;
    }
    if (rc == 0 && message_id)
        rc = observe_sent(self, context_id, message_id);
    return rc;
}

/* the arguments of a FLAG_TENSOR_SLOTS call: holes with slots[i] >= 0 filled from tensors
 * (NULL with no error: malformed, Python's decode says so) */
static PyObject *fill_slots(PyObject *holes, PyObject *slots, PyObject *tensors)
{
    Py_ssize_t n = PyTuple_GET_SIZE(holes);
    if (!PyTuple_CheckExact(slots) || PyTuple_GET_SIZE(slots) != n)
        return NULL;
    PyObject *args = PyTuple_New(n);
    if (args == NULL)
        return NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_ssize_t slot = PyLong_AsSsize_t(PyTuple_GET_ITEM(slots, i));
        if (slot == -1 && PyErr_Occurred()) {
            Py_DECREF(args);
            return NULL;
        }
        if (slot >= PyList_GET_SIZE(tensors) || slot < -1) {
            Py_DECREF(args);
            return NULL;
        }
        PyObject *item = slot < 0 ? PyTuple_GET_ITEM(holes, i) : PyList_GET_ITEM(tensors, slot);
        PyTuple_SET_ITEM(args, i, Py_NewRef(item));
    }
    return args;
}

/* func(*args, **kwargs); a Handler's fn is called directly (all Handler.__call__ does: one
 * Python frame less for every internal message, e.g. an RRef protocol step or the release
 * of an autograd context) */
static PyObject *call_function(Core *self, PyObject *func, PyObject *args, PyObject *kwargs)
{
    if (Py_TYPE(func) != (PyTypeObject *)self->o[O_HANDLER_TYPE])
        return PyObject_Call(func, args, kwargs);
    PyObject *fn = PyObject_GetAttr(func, self->s_fn);
    if (fn == NULL)
        return NULL;
    PyObject *value = PyObject_Call(fn, args, kwargs);
    Py_DECREF(fn);
    return value;
}

/* func(*args, **kwargs) served in autograd context state (the observer's serving/served
 * around it, as Server._serve_observed_call does; state NULL: no context): the value, or
 * NULL with the error the caller gets */
static PyObject *run_observed(Core *self, PyObject *env, long src, PyObject *state,
                              PyObject *func, PyObject *args, PyObject *kwargs)
{
    if (state == NULL)
        return call_function(self, func, args, kwargs);
    PyObject *name = lazy_name(self, NAME_ARGUMENTS_SERVED, func, args, src);
    PyObject *message_id = name != NULL ? slot_get(self->env_slots[ENV_MESSAGE_ID], env)
                                        : NULL;
    PyObject *token = NULL;
    if (message_id != NULL) {
        PyObject *argv[4] = {NULL, state, message_id, name};
        token = call_observer(self, self->s_serving, argv, 3);
    }
    Py_XDECREF(name);
    Py_XDECREF(message_id);
    if (token == NULL)
        return NULL;
    PyObject *value = call_function(self, func, args, kwargs);
    PyObject *type, *exc, *tb;
    PyErr_Fetch(&type, &exc, &tb);
    PyObject *argv[2] = {NULL, token};
    PyObject *r = call_observer(self, self->s_served, argv, 1);
    Py_DECREF(token);
    if (r == NULL) { /* its error replaces the function's outcome, as a finally block's */
        Py_XDECREF(type);
        Py_XDECREF(exc);
        Py_XDECREF(tb);
        Py_CLEAR(value);
        return NULL;
    }
    Py_DECREF(r);
    PyErr_Restore(type, exc, tb);
    return value;
}

/* The function, arguments and keyword arguments of a plain CALL or notification env (new
 * references): 1, 0 when it is not plain (Python decodes it; nothing was consumed), -1 on
 * an error */
static int unpack_plain(Core *self, PyObject *env, long long flags, PyObject **func,
                        PyObject **args, PyObject **kwargs)
{
    *func = *args = *kwargs = NULL;
    PyObject *payload = slot_get(self->env_slots[ENV_PAYLOAD], env);
    if (payload == NULL)
        return -1;
    Py_buffer view;
    if (PyObject_GetBuffer(payload, &view, PyBUF_SIMPLE) < 0) {
        Py_DECREF(payload);
        return -1;
    }
    int result = 0;
    PyObject *loaded = NULL, *tensors = NULL;
    const unsigned char *buf = view.buf;
    Py_ssize_t end = view.len >= 2 ? 2 + (buf[0] | buf[1] << 8) : view.len + 1;
    if (end > view.len)
        goto done; /* malformed: Python's decode says so */
    *func = resolve(self, view.buf, end);
    if (*func == NULL) {
        result = PyErr_Occurred() ? -1 : 0;
        goto done;
    }
    if (view.len == end) {
        *args = PyTuple_New(0);
        *kwargs = Py_NewRef(self->empty_dict);
        result = *args == NULL ? -1 : 1;
        goto done;
    }
    tensors = slot_get(self->env_slots[ENV_TENSORS], env);
    if (tensors == NULL) {
        result = -1;
        goto done;
    }
    if (!PyList_Check(tensors))
        goto done;
    int no_tensors = PyList_GET_SIZE(tensors) == 0;
    if (!((flags & FLAG_PLAIN) && no_tensors) && !(flags & FLAG_TENSOR_SLOTS))
        goto done;
    loaded = plain_loads(self, (const char *)view.buf + end, view.len - end);
    if (loaded == NULL) {
        PyErr_Clear(); /* Python's decode raises the error the caller gets */
        goto done;
    }
    if (!PyTuple_CheckExact(loaded) ||
        PyTuple_GET_SIZE(loaded) != (flags & FLAG_TENSOR_SLOTS ? 3 : 2) ||
        !PyTuple_CheckExact(PyTuple_GET_ITEM(loaded, 0)) ||
        !PyDict_CheckExact(PyTuple_GET_ITEM(loaded, 1)))
        goto done;
    if (flags & FLAG_TENSOR_SLOTS) {
        *args = fill_slots(PyTuple_GET_ITEM(loaded, 0), PyTuple_GET_ITEM(loaded, 2), tensors);
        if (*args == NULL) {
            result = PyErr_Occurred() ? -1 : 0;
            goto done;
        }
    } else {
        *args = Py_NewRef(PyTuple_GET_ITEM(loaded, 0));
    }
    *kwargs = Py_NewRef(PyTuple_GET_ITEM(loaded, 1));
    result = 1;
done:
    if (result != 1) {
        Py_CLEAR(*func);
        Py_CLEAR(*args);
        Py_CLEAR(*kwargs);
    }
    PyBuffer_Release(&view);
    Py_DECREF(payload);
    Py_XDECREF(loaded);
    Py_XDECREF(tensors);
    return result;
}

/* An asynchronous handler answered with *value. A future that completed with a value
 * becomes that value (0: answer it now); one still running, or failed, is answered by
 * Server.answer_when_done as the Python path answers it (1). Anything else is the
 * answer itself (0). -1 on error. */
static int answer_later(Core *self, PyObject *env, PyObject *func, PyObject *args,
                        PyObject **value)
{
    int is_future = PyObject_IsInstance(*value, self->o[O_CFUTURE]);
    if (is_future <= 0)
        return is_future;
    int finished = truth_of(PyObject_CallMethodNoArgs(*value, self->s_done));
    if (finished < 0)
        return -1;
    if (finished) {
        PyObject *result = PyObject_CallMethodNoArgs(*value, self->s_value);
        if (result != NULL) {
            Py_SETREF(*value, result);
            return 0;
        }
        PyErr_Clear(); /* failed: Python answers with its error */
    }
    PyObject *call = PyTuple_Pack(2, func, args);
    if (call == NULL)
        return -1;
    PyObject *r = PyObject_CallFunctionObjArgs(self->o[O_PY_ANSWER_WHEN_DONE], env, *value,
                                               call, NULL);
    Py_DECREF(call);
    if (r == NULL)
        return -1;
    Py_DECREF(r);
    return 1;
}

/* Serve a CALL: 1 served, 0 not plain (Python serves it; nothing was consumed), -1 error.
 * received: what the call observer recorded at dispatch (see observe_call), NULL outside
 * an autograd context. */
static int serve_plain(Core *self, PyObject *env, PyObject *received)
{
    int ok = 1;
    long long flags = slot_ll(self->env_slots[ENV_FLAGS], env, &ok);
    long src = (long)slot_ll(self->env_slots[ENV_SRC], env, &ok);
    long long context_id = slot_ll(self->env_slots[ENV_CONTEXT_ID], env, &ok);
    if (!ok)
        return -1;
    PyObject *state = NULL; /* the autograd context to serve in (borrowed) */
    if (received != NULL) {
        if (!PyTuple_CheckExact(received) || PyTuple_GET_SIZE(received) != 2 ||
            PyTuple_GET_ITEM(received, 1) != Py_None)
            return 0; /* the recording failed: Python answers with its error */
        state = PyTuple_GET_ITEM(received, 0);
        if (state == Py_None)
            state = NULL; /* a released context: served outside it */
    }
    if (!(flags & (FLAG_HANDLER | FLAG_FUNCTION_REF)) || src < 0 ||
        src >= ((Counters *)self->o[O_COUNTERS])->size)
        return 0;
    int observed = observing(self);
    if (observed != 0)
        return observed < 0 ? -1 : 0;
    PyObject *func, *args, *kwargs, *value = NULL;
    int result = unpack_plain(self, env, flags, &func, &args, &kwargs);
    if (result <= 0)
        return result;
    int asynchronous = is_asynchronous(self, func);
    if (asynchronous != 0 && (asynchronous < 0 ||
                              Py_TYPE(func) != (PyTypeObject *)self->o[O_HANDLER_TYPE])) {
        result = asynchronous < 0 ? -1 : 0; /* @async_execution: Python's rules */
        goto done;
    }
    value = run_observed(self, env, src, state, func, args,
                         PyDict_GET_SIZE(kwargs) ? kwargs : NULL);
    if (value != NULL && asynchronous) { /* a handler answering with a future */
        int later = answer_later(self, env, func, args, &value);
        if (later != 0) {
            result = later < 0 ? -1 : 1;
            goto done;
        }
    }
    if (value == NULL) { /* the caller gets the exception, with its type */
        PyObject *exc = take_error();
        PyObject *r = PyObject_CallFunctionObjArgs(self->o[O_PY_FAIL], env, func,
                                                   exc ? exc : Py_None, NULL);
        Py_XDECREF(exc);
        if (r == NULL)
            result = -1;
        Py_XDECREF(r);
        goto done;
    }
    if (answer(self, env, src, context_id, func, args, value) < 0)
        result = -1;
done:
    Py_DECREF(func);
    Py_DECREF(args);
    Py_DECREF(kwargs);
    Py_XDECREF(value);
    return result;
}

/* Run a plain NOTIFY or CONTROL message (Server.serve_notify): no answer; a failure of the
 * function is logged (Server.notify_failed) and the message counts as handled either way.
 * 1 run, 0 not plain (Python runs it; nothing was consumed), -1 error. */
static int notify_plain(Core *self, PyObject *env)
{
    int ok = 1;
    long long flags = slot_ll(self->env_slots[ENV_FLAGS], env, &ok);
    long src = (long)slot_ll(self->env_slots[ENV_SRC], env, &ok);
    if (!ok)
        return -1;
    if (!(flags & (FLAG_HANDLER | FLAG_FUNCTION_REF)) || src < 0 ||
        src >= ((Counters *)self->o[O_COUNTERS])->size)
        return 0;
    PyObject *func, *args, *kwargs;
    int result = unpack_plain(self, env, flags, &func, &args, &kwargs);
    if (result <= 0)
        return result;
    PyObject *value = call_function(self, func, args, PyDict_GET_SIZE(kwargs) ? kwargs : NULL);
    if (value == NULL) {
        PyObject *exc = take_error();
        PyObject *r = PyObject_CallFunctionObjArgs(self->o[O_PY_NOTIFY_FAILED], env,
                                                   exc ? exc : Py_None, NULL);
        Py_XDECREF(exc);
        if (r == NULL)
            result = -1;
        Py_XDECREF(r);
    }
    Py_XDECREF(value);
    Py_DECREF(func);
    Py_DECREF(args);
    Py_DECREF(kwargs);
    ((Counters *)self->o[O_COUNTERS])->processed_from[src]++;
    return result;
}

/* ------------------------------------------------------------------ ServeWork */
typedef struct {
    PyObject_HEAD
    Core *core;
    PyObject *env;
    PyObject *received; /* observe_call's (state, error) in an autograd context, or NULL */
    int kind;           /* CALL or NOTIFY (read from the header at dispatch) */
} ServeWork;

static int ServeWork_traverse(ServeWork *self, visitproc visit, void *arg)
{
    Py_VISIT(self->core);
    Py_VISIT(self->env);
    Py_VISIT(self->received);
    return 0;
}

static int ServeWork_clear(ServeWork *self)
{
    Py_CLEAR(self->core);
    Py_CLEAR(self->env);
    Py_CLEAR(self->received);
    return 0;
}

static void ServeWork_dealloc(ServeWork *self)
{
    PyObject_GC_UnTrack(self);
    ServeWork_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* the work item of an incoming CALL or NOTIFY: run it here, or through the Python server */
static PyObject *ServeWork_call(ServeWork *self, PyObject *Py_UNUSED(args),
                                PyObject *Py_UNUSED(kwds))
{
    Core *core = self->core;
    READY(core)
    if (self->kind == NOTIFY) {
        int run = notify_plain(core, self->env);
        if (run < 0)
            return NULL;
        if (run == 0)
            return PyObject_CallOneArg(core->o[O_PY_SERVE_NOTIFY], self->env);
        Py_RETURN_NONE;
    }
    int served = serve_plain(core, self->env, self->received);
    if (served < 0)
        return NULL;
    if (served == 0) {
        PyObject *argv[2] = {self->env, self->received};
        return PyObject_Vectorcall(core->o[O_PY_SERVE], argv, self->received ? 2 : 1, NULL);
    }
    Py_RETURN_NONE;
}

static PyType_Slot serve_work_slots[] = {
    {Py_tp_dealloc, ServeWork_dealloc},
    {Py_tp_traverse, ServeWork_traverse},
    {Py_tp_clear, ServeWork_clear},
    {Py_tp_call, ServeWork_call},
    {Py_tp_doc, "The work item of an incoming CALL or NOTIFY (run by the plain path if it "
                "can)."},
    {0, NULL},
};

static PyType_Spec serve_work_spec = {
    "_mpidag_fastpath.ServeWork", sizeof(ServeWork), 0,
    Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC, serve_work_slots,
};

/* The work item of a received CALL or NOTIFY (kind; steals received, NULL outside an
 * autograd context), or NULL */
static PyObject *new_serve_work(Core *self, PyObject *env, int kind, PyObject *received)
{
    ServeWork *work = PyObject_GC_New(ServeWork, ServeWorkType);
    if (work == NULL) {
        Py_XDECREF(received);
        return NULL;
    }
    work->core = (Core *)Py_NewRef(self);
    work->env = Py_NewRef(env);
    work->received = received;
    work->kind = kind;
    PyObject_GC_Track(work);
    return (PyObject *)work;
}

/* Wake the threads that wait for calls, after completions, as engine.wake_waiters does:
 * the engine's interrupt (C on the MPI transport), then the engine's doorbell: rung here
 * with a C call when it is this module's (an atomic increment, and a broadcast only while
 * a thread sleeps on it: no Python, no Python lock), else wake_waiters itself only while a
 * user thread waits (engine.waiting_users), which spares the common case its Python frame.
 * With done < 0 the error set stays the one raised. 0, or -1 with an error set. */
static int wake(Core *self, int done)
{
    PyObject *type, *exc, *tb;
    PyErr_Fetch(&type, &exc, &tb);
    PyObject *r = PyObject_CallNoArgs(self->o[O_INTERRUPT]);
    if (r != NULL && self->doorbell != NULL) {
        doorbell_ring(self->doorbell);
    } else if (r != NULL) {
        Py_DECREF(r);
        PyObject *waiting = PyObject_GetAttr(self->o[O_ENGINE], self->s_waiting_users);
        int any = waiting == NULL ? -1 : PyObject_IsTrue(waiting);
        Py_XDECREF(waiting);
        r = any < 0 ? NULL : any ? PyObject_CallNoArgs(self->o[O_WAKE]) : Py_NewRef(Py_None);
    }
    if (r == NULL) {
        if (type == NULL)
            PyErr_Fetch(&type, &exc, &tb);
        else
            PyErr_Clear();
    }
    Py_XDECREF(r);
    PyErr_Restore(type, exc, tb);
    return type != NULL || done < 0 ? -1 : 0;
}

/* The header fields the leader decides by, read from an Envelope's slots: its kind, flags,
 * context id and source, and whether that source is a rank of the world (a received
 * message; not the loopback notice of a failed peer's). 0, or -1 with an error set. */
typedef struct {
    long long kind, flags, context_id, src;
    int from_peer;
} Header;

static int read_header(Core *self, PyObject *env, Header *h)
{
    int ok = 1;
    h->kind = slot_ll(self->env_slots[ENV_KIND], env, &ok);
    h->flags = slot_ll(self->env_slots[ENV_FLAGS], env, &ok);
    h->context_id = slot_ll(self->env_slots[ENV_CONTEXT_ID], env, &ok);
    h->src = slot_ll(self->env_slots[ENV_SRC], env, &ok);
    h->from_peer = h->src >= 0 && h->src < ((Counters *)self->o[O_COUNTERS])->size;
    return ok ? 0 : -1;
}

/* The next message (a new reference), Py_None, or NULL with an error: what the transport's
 * poll_wait(seconds) (poll() for 0) returns. Where the transport publishes its frame-0
 * probe this is done here: its loopback queue first, then the probe, the C decoder of
 * frame 0, and transport.receive_rest only for a message with more than frame 0. */
static PyObject *receive(Core *self, double seconds)
{
    /* (looked up each time, as send_frame0 is: a profiler or a test may wrap it) */
    PyObject *probe = PyObject_GetAttr(self->o[O_TRANSPORT], self->s_probe_frame0);
    if (probe == NULL)
        return NULL;
    if (probe == Py_None) {
        Py_DECREF(probe);
        if (seconds > 0 && self->o[O_POLL_WAIT] != Py_None) {
            PyObject *wait = PyFloat_FromDouble(seconds);
            if (wait == NULL)
                return NULL;
            PyObject *env = PyObject_CallOneArg(self->o[O_POLL_WAIT], wait);
            Py_DECREF(wait);
            return env;
        }
        return PyObject_CallNoArgs(self->o[O_POLL]);
    }
    Py_ssize_t queued = PyObject_Length(self->o[O_LOOPBACK]);
    if (queued != 0) { /* (the GIL is held from the length to the pop) */
        Py_DECREF(probe);
        return queued < 0 ? NULL : PyObject_CallMethodNoArgs(self->o[O_LOOPBACK],
                                                             self->s_popleft);
    }
    PyObject *wait = PyFloat_FromDouble(seconds);
    if (wait == NULL) {
        Py_DECREF(probe);
        return NULL;
    }
    PyObject *got = PyObject_CallOneArg(probe, wait);
    Py_DECREF(wait);
    Py_DECREF(probe);
    if (got == NULL || got == Py_None)
        return got;
    if (!PyTuple_CheckExact(got) || PyTuple_GET_SIZE(got) != 2) {
        Py_DECREF(got);
        PyErr_SetString(PyExc_TypeError, "probe_frame0 must return (source, frame0) or None");
        return NULL;
    }
    PyObject *argv[3] = {NULL, PyTuple_GET_ITEM(got, 1), PyTuple_GET_ITEM(got, 0)};
    PyObject *decoded = PyObject_Vectorcall(self->o[O_DECODE_MESSAGE], argv + 1,
                                            2 | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL);
    if (decoded == NULL) {
        Py_DECREF(got);
        return NULL;
    }
    PyObject *env = NULL;
    if (!PyTuple_CheckExact(decoded) || PyTuple_GET_SIZE(decoded) != 2) {
        PyErr_SetString(PyExc_TypeError, "decode_message must return (envelope, header)");
    } else if (PyTuple_GET_ITEM(decoded, 1) == Py_None) {
        env = Py_NewRef(PyTuple_GET_ITEM(decoded, 0));
    } else {
        PyObject *rest[4] = {PyTuple_GET_ITEM(decoded, 0), PyTuple_GET_ITEM(decoded, 1),
                             PyTuple_GET_ITEM(got, 1), PyTuple_GET_ITEM(got, 0)};
        env = PyObject_Vectorcall(self->o[O_RECEIVE_REST], rest, 4, NULL);
    }
    Py_DECREF(decoded);
    Py_DECREF(got);
    return env;
}

/* The answers of rpc_async calls come in bursts: after completing one, the leader takes
 * those already waiting in the transport (at most DRAIN_MAX) and completes the plain ones
 * here, without a turn of the engine's loop each; the first message it does not complete
 * goes back to the front of the transport's queue (transport.requeue), so the engine
 * dispatches it next, in arrival order. 1, or -1 with an error set. */
#define DRAIN_MAX 64
static int drain_results(Core *self)
{
    for (int i = 0; i < DRAIN_MAX; i++) {
        PyObject *env = receive(self, 0.0);
        if (env == NULL)
            return -1;
        if (env == Py_None) {
            Py_DECREF(env);
            return 1;
        }
        int done = 0, with_future = 0;
        Header h;
        if (Py_TYPE(env) == (PyTypeObject *)self->o[O_ENVELOPE]) {
            if (read_header(self, env, &h) < 0)
                done = -1;
            else if (h.kind == RESULT && h.from_peer)
                done = complete_plain(self, env, h.flags, (long)h.src, &with_future);
        }
        if (done > 0) {
            Py_DECREF(env);
            continue;
        }
        PyObject *type, *exc, *tb;
        PyErr_Fetch(&type, &exc, &tb);
        PyObject *r = PyObject_CallOneArg(self->o[O_REQUEUE], env);
        Py_DECREF(env);
        if (r == NULL) {
            Py_XDECREF(type);
            Py_XDECREF(exc);
            Py_XDECREF(tb);
            return -1;
        }
        Py_DECREF(r);
        PyErr_Restore(type, exc, tb);
        return done < 0 ? -1 : 1;
    }
    return 1;
}

/* reply(env, value, call): the answer of the CALL env, (func, args) = call, sent here when
 * it is plain (or a lone tensor), else by Server.reply_value; for an answer made after
 * the call's function returned (an asynchronous handler's future) */
static PyObject *Core_reply(Core *self, PyObject *const *argv, Py_ssize_t nargs)
{
    READY(self)
    if (nargs != 3 || Py_TYPE(argv[0]) != (PyTypeObject *)self->o[O_ENVELOPE] ||
        !PyTuple_CheckExact(argv[2]) || PyTuple_GET_SIZE(argv[2]) != 2) {
        PyErr_SetString(PyExc_TypeError, "reply(env, value, (func, args))");
        return NULL;
    }
    int ok = 1;
    long src = (long)slot_ll(self->env_slots[ENV_SRC], argv[0], &ok);
    long long context_id = slot_ll(self->env_slots[ENV_CONTEXT_ID], argv[0], &ok);
    if (!ok)
        return NULL;
    if (answer(self, argv[0], src, context_id, PyTuple_GET_ITEM(argv[2], 0),
               PyTuple_GET_ITEM(argv[2], 1), argv[1]) < 0)
        return NULL;
    Py_RETURN_NONE;
}

/* dispatch(env) -> work item or None: what the progress engine's leader does with a
 * received message (see RpcAgent.dispatch) */
static PyObject *Core_dispatch(Core *self, PyObject *env)
{
    READY(self)
    if (Py_TYPE(env) != (PyTypeObject *)self->o[O_ENVELOPE])
        return PyObject_CallOneArg(self->o[O_PY_DISPATCH], env);
    Header h;
    if (read_header(self, env, &h) < 0)
        return NULL;
    if (h.kind == RESULT && h.from_peer) {
        int with_future = 0;
        int done = complete_plain(self, env, h.flags, (long)h.src, &with_future);
        if (done == 0)
            return PyObject_CallOneArg(self->o[O_PY_COMPLETE], env);
        if (done > 0 && with_future)
            done = drain_results(self);
        return wake(self, done) < 0 ? NULL : Py_NewRef(Py_None);
    }
    if (h.kind == CALL && h.from_peer) {
        PyObject *received = NULL;
        if (h.context_id) { /* recorded now, in arrival order (see Server.accept_call) */
            if (!(h.flags & (FLAG_HANDLER | FLAG_FUNCTION_REF)))
                return PyObject_CallOneArg(self->o[O_PY_DISPATCH], env);
            if ((received = observe_call(self, env, (long)h.src)) == NULL)
                return NULL;
        }
        return new_serve_work(self, env, CALL, received);
    }
    if (h.kind == CONTROL && h.context_id == 0 && h.from_peer) { /* run now, in order */
        int run = notify_plain(self, env);
        if (run != 0)
            return run < 0 ? NULL : Py_NewRef(Py_None);
    } else if (h.kind == NOTIFY && h.context_id == 0 && h.from_peer) {
        return new_serve_work(self, env, NOTIFY, NULL);
    }
    return PyObject_CallOneArg(self->o[O_PY_DISPATCH], env);
}

/* A dispatch error names the message it was about ("... from rank 1 failed"), raised from
 * the error itself (its cause). */
static void name_failed_message(int ok, long long kind, long long src)
{
    PyObject *cause = take_error();
    if (ok)
        PyErr_Format(PyExc_RuntimeError, "dispatch of a message of kind %lld from rank %lld "
                     "failed", kind, src);
    else
        PyErr_SetString(PyExc_RuntimeError, "dispatch of a message failed");
    if (cause == NULL)
        return;
    PyObject *error = take_error();
    PyException_SetCause(error, Py_NewRef(cause));
    PyException_SetContext(error, cause);
    PyErr_SetObject((PyObject *)Py_TYPE(error), error);
    Py_DECREF(error);
}

/* The leader's after-poll hook, RpcAgent._tick without its two Python frames a step: each
 * layer's hook whose queue holds work, then expire_due() when a scan is due (it keeps its
 * own interval too); 0, or -1 with the hook's error (raised before the poll: no message
 * is taken and lost with it). */
static int tick(Core *self)
{
    PyObject *hooks = self->o[O_TICK_HOOKS];
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(hooks); i++) {
        PyObject *entry = PyList_GET_ITEM(hooks, i);
        if (!PyTuple_Check(entry) || PyTuple_GET_SIZE(entry) != 2) {
            PyErr_SetString(PyExc_TypeError, "a tick hook must be a (queue, hook) tuple");
            return -1;
        }
        Py_INCREF(entry); /* (a hook may change the list) */
        int has_work = PyObject_IsTrue(PyTuple_GET_ITEM(entry, 0));
        PyObject *r = has_work > 0 ? PyObject_CallNoArgs(PyTuple_GET_ITEM(entry, 1))
                                   : (has_work == 0 ? Py_NewRef(Py_None) : NULL);
        Py_DECREF(entry);
        if (r == NULL)
            return -1;
        Py_DECREF(r);
    }
    double now = monotonic_s();
    if (now < self->next_expiry)
        return 0;
    self->next_expiry = now + self->expiry_interval;
    PyObject *r = PyObject_CallNoArgs(self->o[O_EXPIRE_DUE]);
    if (r == NULL)
        return -1;
    Py_DECREF(r);
    return 0;
}

/* step(wait) -> False, None or a work item: one step of the progress engine's leader
 * (ProgressEngine.set_step): the after-poll hook, one poll (waiting up to ``wait`` seconds
 * where the transport can), the dispatch of what arrived. False: nothing arrived; None:
 * the message was handled here. */
static PyObject *Core_step(Core *self, PyObject *arg)
{
    READY(self)
    double seconds = PyFloat_AsDouble(arg);
    if (seconds == -1.0 && PyErr_Occurred())
        return NULL;
    if (tick(self) < 0)
        return NULL;
    PyObject *env = receive(self, seconds);
    if (env == NULL)
        return NULL;
    if (env == Py_None) {
        Py_DECREF(env);
        Py_RETURN_FALSE;
    }
    PyObject *work = Core_dispatch(self, env);
    if (work == NULL) {
        int ok = 0;
        Header h = {0};
        if (Py_TYPE(env) == (PyTypeObject *)self->o[O_ENVELOPE]) {
            PyObject *type, *exc, *tb;
            PyErr_Fetch(&type, &exc, &tb);
            ok = read_header(self, env, &h) == 0;
            if (!ok)
                PyErr_Clear();
            PyErr_Restore(type, exc, tb);
        }
        name_failed_message(ok, h.kind, h.src);
    }
    Py_DECREF(env);
    return work;
}

/* message_name(kind, func, args, rank): the lazy name this path gives a recorded message
 * of kind kind ("arguments_sent", "arguments_from", "arguments_served", "result_sent",
 * "result_from"; func and args None for "arguments_from") exchanged with rank */
static PyObject *Core_message_name(Core *self, PyObject *const *argv, Py_ssize_t nargs)
{
    READY(self)
    static const char *kinds[N_NAME_KINDS] = {"arguments_sent", "arguments_from",
                                              "arguments_served", "result_sent",
                                              "result_from"};
    if (nargs != 4 || !PyUnicode_Check(argv[0])) {
        PyErr_SetString(PyExc_TypeError, "message_name(kind, func, args, rank)");
        return NULL;
    }
    long rank = PyLong_AsLong(argv[3]);
    if (rank == -1 && PyErr_Occurred())
        return NULL;
    for (int kind = 0; kind < N_NAME_KINDS; kind++) {
        if (PyUnicode_CompareWithASCIIString(argv[0], kinds[kind]) == 0) {
            PyObject *func = kind == NAME_ARGUMENTS_FROM ? NULL : argv[1];
            return lazy_name(self, kind, func, func != NULL ? argv[2] : NULL, rank);
        }
    }
    PyErr_Format(PyExc_ValueError, "no message name of kind %R", argv[0]);
    return NULL;
}

static PyMethodDef Core_methods[] = {
    {"send_call", (PyCFunction)(void (*)(void))Core_send_call, METH_FASTCALL,
     "send_call(dst, func, args, kwargs, timeout, record, with_future): send a plain CALL "
     "and return its PendingCall, or None when the call is not plain (send it in Python)"},
    {"notify", (PyCFunction)(void (*)(void))Core_notify, METH_FASTCALL,
     "notify(dst, func, args): send a plain notification (NOTIFY, or CONTROL for a control "
     "handler) and return True, or None when it is not plain (send it in Python)"},
    {"rpc", (PyCFunction)(void (*)(void))Core_rpc, METH_FASTCALL,
     "rpc(to, func, args, kwargs, timeout, with_future): rpc_sync's (PendingCall) or "
     "rpc_async's (RpcFuture) caller side for a plain call of common arguments, else None"},
    {"reply", (PyCFunction)(void (*)(void))Core_reply, METH_FASTCALL,
     "reply(env, value, (func, args)): answer the CALL env with value, in C when it is "
     "plain or a lone tensor, else through Server.reply_value"},
    {"step", (PyCFunction)Core_step, METH_O,
     "step(wait): the progress leader's step (hook, poll, dispatch): False when nothing "
     "arrived, None when the message was handled, else the work item to run"},
    {"dispatch", (PyCFunction)Core_dispatch, METH_O,
     "dispatch(env): complete a plain RESULT here, make a CALL's work item, else the "
     "agent's Python dispatch"},
    {"message_name", (PyCFunction)(void (*)(void))Core_message_name, METH_FASTCALL,
     "message_name(kind, func, args, rank): the lazy name this path gives a recorded "
     "message (kind: arguments_sent, arguments_from, arguments_served, result_sent or "
     "result_from); called, the string the agent's Python names it with"},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject CoreType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "_mpidag_fastpath.Core",
    .tp_basicsize = sizeof(Core),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "The plain-call path of one agent (see mpidag/agent/fastpath.py).",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Core_init,
    .tp_dealloc = (destructor)Core_dealloc,
    .tp_traverse = (traverseproc)Core_traverse,
    .tp_clear = (inquiry)Core_clear,
    .tp_methods = Core_methods,
};

/* ------------------------------------------------------------------ module */
static PyObject *module_is_plain(PyObject *Py_UNUSED(module), PyObject *obj)
{
    return PyBool_FromLong(is_plain(obj));
}

static PyObject *module_plain_pickle(PyObject *Py_UNUSED(module), PyObject *obj)
{
    return plain_pickle(NULL, obj, 5);
}

static PyObject *module_plain_load(PyObject *Py_UNUSED(module), PyObject *obj)
{
    Py_buffer view;
    if (PyObject_GetBuffer(obj, &view, PyBUF_SIMPLE) < 0)
        return NULL;
    PyObject *value = plain_load(view.buf, view.len);
    PyBuffer_Release(&view);
    if (value == NULL)
        return PyErr_Occurred() ? NULL : Py_BuildValue("(OO)", Py_False, Py_None);
    PyObject *pair = Py_BuildValue("(ON)", Py_True, value);
    return pair;
}

static PyMethodDef module_methods[] = {
    {"is_plain", module_is_plain, METH_O, "frames.is_plain in C (for the tests)"},
    {"plain_pickle", module_plain_pickle, METH_O,
     "plain_pickle(obj): the pickle the compiled path writes for a plain value, or None "
     "when it leaves obj to pickle.dumps (for the tests)"},
    {"plain_load", module_plain_load, METH_O,
     "plain_load(data) -> (True, value) when data holds only the opcodes plain_pickle "
     "writes, else (False, None): the compiled path then calls pickle.loads (for the "
     "tests)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef fastpath_module = {
    PyModuleDef_HEAD_INIT, "_mpidag_fastpath",
    "the agent's path of a plain call in C (see mpidag/agent/fastpath.py)", -1,
    module_methods,
};

/* module.name = the tuple of the C strings names (the slots this module fills) */
static int add_names(PyObject *module, const char *name, const char **names, int n)
{
    PyObject *tuple = PyTuple_New(n);
    if (tuple == NULL)
        return -1;
    for (int i = 0; i < n; i++) {
        PyObject *s = PyUnicode_FromString(names[i]);
        if (s == NULL) {
            Py_DECREF(tuple);
            return -1;
        }
        PyTuple_SET_ITEM(tuple, i, s);
    }
    int rc = PyModule_AddObjectRef(module, name, tuple);
    Py_DECREF(tuple);
    return rc;
}

PyMODINIT_FUNC PyInit__mpidag_fastpath(void)
{
    if (PyType_Ready(&CountersType) < 0 || PyType_Ready(&CoreType) < 0 ||
        PyType_Ready(&TicketType) < 0 || PyType_Ready(&LiveCountType) < 0 ||
        PyType_Ready(&MessageNameType) < 0 || PyType_Ready(&DoorbellType) < 0)
        return NULL;
    for (int kind = 0; kind < N_NAME_KINDS; kind++) {
        for (int i = 0; i < 2; i++) {
            const char *text = NAME_TEXTS[kind][i];
            if (text != NULL && name_texts[kind][i] == NULL &&
                (name_texts[kind][i] = PyUnicode_InternFromString(text)) == NULL)
                return NULL;
        }
    }
    ServeWorkType = (PyTypeObject *)PyType_FromSpec(&serve_work_spec);
    if (ServeWorkType == NULL)
        return NULL;
    PyObject *module = PyModule_Create(&fastpath_module);
    if (module == NULL)
        return NULL;
    if (PyModule_AddIntConstant(module, "VERSION", VERSION) < 0 ||
        PyModule_AddIntConstant(module, "FLAG_PLAIN", FLAG_PLAIN) < 0 ||
        PyModule_AddIntConstant(module, "FLAG_TENSOR_SLOTS", FLAG_TENSOR_SLOTS) < 0 ||
        PyModule_AddIntConstant(module, "CALL", CALL) < 0 ||
        PyModule_AddIntConstant(module, "RESULT", RESULT) < 0 ||
        PyModule_AddIntConstant(module, "NOTIFY", NOTIFY) < 0 ||
        PyModule_AddIntConstant(module, "CONTROL", CONTROL) < 0 ||
        PyModule_AddIntConstant(module, "FLAG_HANDLER", FLAG_HANDLER) < 0 ||
        PyModule_AddIntConstant(module, "FLAG_FUNCTION_REF", FLAG_FUNCTION_REF) < 0 ||
        PyModule_AddObjectRef(module, "Counters", (PyObject *)&CountersType) < 0 ||
        PyModule_AddObjectRef(module, "LiveCount", (PyObject *)&LiveCountType) < 0 ||
        PyModule_AddObjectRef(module, "Core", (PyObject *)&CoreType) < 0 ||
        PyModule_AddObjectRef(module, "Doorbell", (PyObject *)&DoorbellType) < 0 ||
        PyModule_AddObjectRef(module, "ServeWork", (PyObject *)ServeWorkType) < 0 ||
        add_names(module, "ENVELOPE_FIELDS", ENV_FIELDS, N_ENV) < 0 ||
        add_names(module, "PENDING_CALL_FIELDS", PC_FIELDS, N_PC) < 0) {
        Py_DECREF(module);
        return NULL;
    }
    return module;
}
