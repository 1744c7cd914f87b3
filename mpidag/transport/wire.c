/* _mpidag_wire: the MPI transport's frame-0 path in C (see mpidag/transport/wire.py).
 *
 * One Wire object per MPI transport owns, for its communicator:
 *   probe()           the next frame 0 (MPI_Improbe on any source, MPI_Mrecv into a new
 *                     bytearray), after completing the frame-0 sends that finished;
 *   send(dst, frame)  MPI_Isend of a frame 0, left in flight (its buffer held) if the
 *                     first MPI_Test does not complete it;
 *   complete_sends()  tests the oldest sends in order and releases the finished ones;
 *   send_tensor(dst, tag, t) / recv_tensor(src, tag, t)
 *                     a data frame (the frames after frame 0): the bytes of a dense CPU
 *                     tensor sent from, or received into, its own memory, whole (in
 *                     chunks of at most 1 GiB), without the GIL while MPI moves them;
 *   receive_rest(env, header, frame0, src)
 *                     FramedTransport.receive_rest for the common message: every tensor
 *                     on the CPU in a frame of its own (or empty), no payload frame, no
 *                     sparse tensor: each made by the receive cache (empty) and received
 *                     into (recv_tensor); any other message goes to the Python method
 *                     given to set_receiver().
 * The GIL is released around every MPI call, as mpi4py does, so a thread polling here never
 * holds up the serving threads, and a thread blocked inside MPI never holds the GIL.
 * The table of sends in flight is touched only with the GIL held; probe() and
 * complete_sends() are called by one thread at a time (the progress leader).
 * An MPI error raises mpi4py's MPI.Exception(error code), which the transport handles as it
 * handles mpi4py's own errors (a failed peer under ULFM).
 *
 * Built per virtual environment against the MPI that mpi4py uses, by
 * `python -m mpidag.transport.wire_build` (scripts/setup.sh runs it).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <mpi.h>
#include <stdint.h>
#include <time.h>

typedef struct {
    MPI_Request request;
    Py_buffer view; /* the frame's bytes, held until the send completes */
} InFlight;

typedef struct {
    PyObject_HEAD
    MPI_Comm comm;
    int tag;
    PyObject *error_class; /* MPI.Exception */
    /* set_receiver(): receive_rest's Python twin, empty(shape, dtype, nbytes) and
     * finish(tensor, spec) (frames.finish_tensor); NULL until then */
    PyObject *fallback, *empty, *finish;
    InFlight *sends;       /* a ring of sends in flight */
    Py_ssize_t head, count, capacity;
    volatile int interrupted; /* set by interrupt(): a waiting probe returns at once */
    int closed;               /* close(): the communicator is about to be freed */
} Wire;

/* After close() every call raises MPI_ERR_COMM, as mpi4py does for a freed communicator
 * (a thread still running user code after shutdown must get an error, not a crash). */
#define CHECK_OPEN(self)                                                                   \
    if ((self)->closed)                                                                    \
        return raise_mpi((self), MPI_ERR_COMM);

static PyObject *raise_mpi(Wire *self, int ierr)
{
    PyObject *exc = PyObject_CallFunction(self->error_class, "i", ierr);
    if (exc != NULL) {
        PyErr_SetObject((PyObject *)Py_TYPE(exc), exc);
        Py_DECREF(exc);
    }
    return NULL;
}

static int Wire_init(Wire *self, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"comm_handle", "tag", "error_class", NULL};
    PyObject *handle, *error_class;
    int tag;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OiO", kwlist, &handle, &tag, &error_class))
        return -1;
    /* mpi4py's MPI._handleof(comm): a pointer (Open MPI) or an int (MPICH), as an unsigned
     * 64-bit integer (MPICH's handles come sign-extended: 0xffffffff84000000) */
    unsigned long long value = PyLong_AsUnsignedLongLongMask(handle);
    if (value == (unsigned long long)-1 && PyErr_Occurred())
        return -1;
    self->comm = (MPI_Comm)(intptr_t)value;
    self->tag = tag;
    Py_INCREF(error_class);
    Py_XSETREF(self->error_class, error_class);
    return 0;
}

static void Wire_dealloc(Wire *self)
{
    /* sends still in flight keep their buffers: freeing memory MPI may still read is worse
     * than a leak (the transport waits for them at a graceful close) */
    PyMem_Free(self->sends);
    Py_XDECREF(self->error_class);
    Py_XDECREF(self->fallback);
    Py_XDECREF(self->empty);
    Py_XDECREF(self->finish);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* Test the oldest sends in order and release the finished ones; -1 with an error set. */
static int complete(Wire *self)
{
    while (self->count > 0) {
        InFlight *oldest = &self->sends[self->head];
        MPI_Request request = oldest->request;
        int done = 0, ierr;
        Py_BEGIN_ALLOW_THREADS
        ierr = MPI_Test(&request, &done, MPI_STATUS_IGNORE);
        Py_END_ALLOW_THREADS
        oldest = &self->sends[self->head]; /* the ring may have grown meanwhile */
        oldest->request = request;
        if (ierr == MPI_SUCCESS && !done)
            return 0;
        /* done, or a send to a rank that failed: dropped, and the error reported */
        PyBuffer_Release(&oldest->view);
        self->head = (self->head + 1) % self->capacity;
        self->count--;
        if (ierr != MPI_SUCCESS) {
            raise_mpi(self, ierr);
            return -1;
        }
    }
    return 0;
}

static int push(Wire *self, MPI_Request request, Py_buffer *view)
{
    if (self->count == self->capacity) {
        Py_ssize_t capacity = self->capacity ? self->capacity * 2 : 16;
        InFlight *ring = PyMem_Malloc(sizeof(InFlight) * capacity);
        if (ring == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        for (Py_ssize_t i = 0; i < self->count; i++)
            ring[i] = self->sends[(self->head + i) % self->capacity];
        PyMem_Free(self->sends);
        self->sends = ring;
        self->head = 0;
        self->capacity = capacity;
    }
    InFlight *slot = &self->sends[(self->head + self->count) % self->capacity];
    slot->request = request;
    slot->view = *view;
    self->count++;
    return 0;
}

static PyObject *Wire_send(Wire *self, PyObject *const *args, Py_ssize_t nargs)
{
    CHECK_OPEN(self)
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "send(dst, frame) takes 2 arguments");
        return NULL;
    }
    long dst = PyLong_AsLong(args[0]);
    if (dst == -1 && PyErr_Occurred())
        return NULL;
    if (dst < 0 || dst > INT_MAX) {
        PyErr_Format(PyExc_ValueError, "send(dst, frame): no rank %ld", dst);
        return NULL;
    }
    Py_buffer view;
    if (PyObject_GetBuffer(args[1], &view, PyBUF_SIMPLE) < 0)
        return NULL;
    if (view.len > INT_MAX) {
        PyBuffer_Release(&view);
        PyErr_SetString(PyExc_OverflowError, "a frame 0 is at most 2 GiB");
        return NULL;
    }
    MPI_Request request;
    int done = 0, ierr;
    Py_BEGIN_ALLOW_THREADS
    ierr = MPI_Isend(view.buf, (int)view.len, MPI_BYTE, (int)dst, self->tag, self->comm, &request);
    if (ierr == MPI_SUCCESS)
        ierr = MPI_Test(&request, &done, MPI_STATUS_IGNORE);
    Py_END_ALLOW_THREADS
    if (ierr != MPI_SUCCESS) {
        PyBuffer_Release(&view);
        return raise_mpi(self, ierr);
    }
    if (done) {
        PyBuffer_Release(&view);
    } else if (push(self, request, &view) < 0) {
        PyBuffer_Release(&view); /* (out of memory; the request stays with MPI) */
        return NULL;
    }
    Py_RETURN_NONE;
}

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* Probe until a frame 0 is there, ``seconds`` passed or interrupt() was called; with
 * ``seconds`` 0 exactly one MPI_Improbe. The GIL is released for the whole wait. */
static PyObject *receive(Wire *self, double seconds)
{
    CHECK_OPEN(self)
    if (self->count > 0 && complete(self) < 0)
        return NULL;
    int flag = 0, ierr, count = 0;
    MPI_Message message;
    MPI_Status status;
    Py_BEGIN_ALLOW_THREADS
    double until = seconds > 0 ? now_s() + seconds : 0.0;
    for (;;) {
        ierr = MPI_Improbe(MPI_ANY_SOURCE, self->tag, self->comm, &flag, &message, &status);
        if (ierr != MPI_SUCCESS || flag || until == 0.0 || self->interrupted)
            break;
        if (now_s() >= until)
            break;
    }
    if (ierr == MPI_SUCCESS && flag)
        ierr = MPI_Get_count(&status, MPI_BYTE, &count);
    Py_END_ALLOW_THREADS
    self->interrupted = 0;
    if (ierr != MPI_SUCCESS)
        return raise_mpi(self, ierr);
    if (!flag)
        Py_RETURN_NONE;
    int source = status.MPI_SOURCE;
    PyObject *frame = PyByteArray_FromStringAndSize(NULL, count);
    if (frame == NULL)
        return NULL; /* (the message stays matched and unreceived: out of memory) */
    char *buf = PyByteArray_AS_STRING(frame);
    Py_BEGIN_ALLOW_THREADS
    ierr = MPI_Mrecv(buf, count, MPI_BYTE, &message, MPI_STATUS_IGNORE);
    Py_END_ALLOW_THREADS
    if (ierr != MPI_SUCCESS) {
        Py_DECREF(frame);
        return raise_mpi(self, ierr);
    }
    return Py_BuildValue("(iN)", source, frame);
}

/* ------------------------------------------------------------------ data frames */
#define CHUNK ((Py_ssize_t)1 << 30) /* as transport.base.CHUNK: MPI counts stay below 2**31 */

/* 1 when obj.name() is expected (Py_True/Py_False), 0 when not, -1 on error */
static int method_is(PyObject *obj, const char *name, PyObject *expected)
{
    PyObject *value = PyObject_CallMethod(obj, name, NULL);
    if (value == NULL)
        return -1;
    int same = value == expected;
    Py_DECREF(value);
    return same;
}

/* *buf = t.data_ptr(): 0, or -1 on error */
static int tensor_address(PyObject *t, char **buf)
{
    PyObject *address = PyObject_CallMethod(t, "data_ptr", NULL);
    if (address == NULL)
        return -1;
    *buf = (char *)PyLong_AsVoidPtr(address);
    Py_DECREF(address);
    return *buf == NULL && PyErr_Occurred() ? -1 : 0;
}

/* The memory of tensor t when its bytes are its values: a CPU tensor, contiguous, with
 * neither a conjugate nor a negative bit (1, *buf and *nbytes set); 0 when not; -1 on
 * error. Read through the tensor's Python methods (this module has no torch headers). */
static int tensor_memory(PyObject *t, char **buf, Py_ssize_t *nbytes)
{
    PyObject *is_cpu = PyObject_GetAttrString(t, "is_cpu");
    if (is_cpu == NULL)
        return -1;
    int ok = is_cpu == Py_True;
    Py_DECREF(is_cpu);
    if (ok == 1)
        ok = method_is(t, "is_contiguous", Py_True);
    if (ok == 1)
        ok = method_is(t, "is_conj", Py_False);
    if (ok == 1)
        ok = method_is(t, "is_neg", Py_False);
    if (ok != 1)
        return ok;
    PyObject *size = PyObject_GetAttrString(t, "nbytes");
    if (size == NULL)
        return -1;
    *nbytes = PyLong_AsSsize_t(size);
    Py_DECREF(size);
    if (*nbytes == -1 && PyErr_Occurred())
        return -1;
    return tensor_address(t, buf) < 0 ? -1 : 1;
}

/* MPI moves nbytes at buf to (receive 0) or from (receive 1) peer on tag, whole: one chunk
 * after the other, each MPI_Isend or MPI_Irecv then MPI_Wait, as the Python transport's
 * _transfer does, without the GIL. 0, or -1 with the MPI error raised. */
static int move(Wire *self, int receive, int peer, int tag, char *buf, Py_ssize_t nbytes)
{
    int ierr = MPI_SUCCESS;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t offset = 0; offset < nbytes && ierr == MPI_SUCCESS; offset += CHUNK) {
        int count = (int)(nbytes - offset < CHUNK ? nbytes - offset : CHUNK);
        MPI_Request request;
        if (receive)
            ierr = MPI_Irecv(buf + offset, count, MPI_BYTE, peer, tag, self->comm, &request);
        else
            ierr = MPI_Isend(buf + offset, count, MPI_BYTE, peer, tag, self->comm, &request);
        if (ierr == MPI_SUCCESS)
            ierr = MPI_Wait(&request, MPI_STATUS_IGNORE);
    }
    Py_END_ALLOW_THREADS
    if (ierr != MPI_SUCCESS) {
        raise_mpi(self, ierr);
        return -1;
    }
    return 0;
}

/* send_tensor / recv_tensor: Py_True once moved, Py_False for a tensor that is not dense on
 * the CPU (nothing moved) */
static PyObject *transfer(Wire *self, PyObject *const *args, Py_ssize_t nargs, int receive)
{
    CHECK_OPEN(self)
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, receive ? "recv_tensor(src, tag, tensor)"
                                                 : "send_tensor(dst, tag, tensor)");
        return NULL;
    }
    long peer = PyLong_AsLong(args[0]), tag = PyLong_AsLong(args[1]);
    if ((peer == -1 || tag == -1) && PyErr_Occurred())
        return NULL;
    if (peer < 0 || peer > INT_MAX || tag < 0 || tag > INT_MAX) {
        PyErr_Format(PyExc_ValueError, "no rank %ld or tag %ld", peer, tag);
        return NULL;
    }
    char *buf = NULL;
    Py_ssize_t nbytes = 0;
    int ok = tensor_memory(args[2], &buf, &nbytes);
    if (ok <= 0)
        return ok < 0 ? NULL : Py_NewRef(Py_False);
    if (move(self, receive, (int)peer, (int)tag, buf, nbytes) < 0)
        return NULL;
    Py_RETURN_TRUE;
}

static PyObject *Wire_send_tensor(Wire *self, PyObject *const *args, Py_ssize_t nargs)
{
    return transfer(self, args, nargs, 0);
}

static PyObject *Wire_recv_tensor(Wire *self, PyObject *const *args, Py_ssize_t nargs)
{
    return transfer(self, args, nargs, 1);
}

/* ------------------------------------------------------------------ receive_rest */
/* interned attribute names of frames.Header, TensorSpec and Envelope */
static PyObject *s_payload_separate, *s_sparse, *s_specs, *s_data_tag, *s_device, *s_shape,
    *s_dtype, *s_nbytes, *s_inline_offset, *s_requires_grad, *s_tensors, *s_cpu;

static PyObject *Wire_set_receiver(Wire *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "set_receiver(fallback, empty, finish)");
        return NULL;
    }
    Py_XSETREF(self->fallback, Py_NewRef(args[0]));
    Py_XSETREF(self->empty, Py_NewRef(args[1]));
    Py_XSETREF(self->finish, Py_NewRef(args[2]));
    Py_RETURN_NONE;
}

/* the long of obj.name: 0, or -1 with an error set */
static int attr_long(PyObject *obj, PyObject *name, long long *value)
{
    PyObject *v = PyObject_GetAttr(obj, name);
    if (v == NULL)
        return -1;
    *value = PyLong_AsLongLong(v);
    Py_DECREF(v);
    return *value == -1 && PyErr_Occurred() ? -1 : 0;
}

/* 1 when this module receives the message of header, 0 when the Python method does, -1 on
 * error: no payload frame, no sparse tensor, every tensor for the CPU and in a frame of its
 * own or empty */
static int receives(PyObject *header, PyObject **specs)
{
    PyObject *v = PyObject_GetAttr(header, s_payload_separate);
    if (v == NULL)
        return -1;
    int separate = PyObject_IsTrue(v);
    Py_DECREF(v);
    if (separate != 0)
        return separate < 0 ? -1 : 0;
    if ((v = PyObject_GetAttr(header, s_sparse)) == NULL)
        return -1;
    int sparse = v != Py_None;
    Py_DECREF(v);
    if (sparse)
        return 0;
    if ((*specs = PyObject_GetAttr(header, s_specs)) == NULL)
        return -1;
    if (!PyList_CheckExact(*specs))
        return 0;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(*specs); i++) {
        PyObject *spec = PyList_GET_ITEM(*specs, i);
        PyObject *device = PyObject_GetAttr(spec, s_device);
        if (device == NULL)
            return -1;
        int cpu = PyObject_RichCompareBool(device, s_cpu, Py_EQ);
        Py_DECREF(device);
        if (cpu != 1)
            return cpu;
        long long offset, nbytes;
        if (attr_long(spec, s_inline_offset, &offset) < 0 ||
            attr_long(spec, s_nbytes, &nbytes) < 0)
            return -1;
        if (offset >= 0 && nbytes > 0)
            return 0; /* inline: a view of frame 0, which Python makes */
    }
    return 1;
}

/* The tensor of spec, received from src on tag into memory made by self->empty (the receive
 * cache: a new contiguous CPU tensor, so its address is all that is read of it); NULL on
 * error */
static PyObject *receive_tensor(Wire *self, PyObject *spec, int src, int tag)
{
    PyObject *shape = PyObject_GetAttr(spec, s_shape);
    PyObject *dtype = shape != NULL ? PyObject_GetAttr(spec, s_dtype) : NULL;
    PyObject *size = dtype != NULL ? PyObject_GetAttr(spec, s_nbytes) : NULL;
    PyObject *tensor = NULL;
    Py_ssize_t nbytes = size != NULL ? PyLong_AsSsize_t(size) : -1;
    if (nbytes >= 0) {
        PyObject *args[3] = {shape, dtype, size};
        tensor = PyObject_Vectorcall(self->empty, args, 3, NULL);
    }
    Py_XDECREF(shape);
    Py_XDECREF(dtype);
    Py_XDECREF(size);
    if (tensor == NULL || nbytes == 0)
        return tensor;
    char *buf = NULL;
    if (tensor_address(tensor, &buf) < 0 || move(self, 1, src, tag, buf, nbytes) < 0) {
        Py_DECREF(tensor);
        return NULL;
    }
    return tensor;
}

static PyObject *Wire_receive_rest(Wire *self, PyObject *const *args, Py_ssize_t nargs)
{
    CHECK_OPEN(self)
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "receive_rest(env, header, frame0, src)");
        return NULL;
    }
    if (self->fallback == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "receive_rest before set_receiver()");
        return NULL;
    }
    PyObject *env = args[0], *header = args[1], *specs = NULL;
    int ours = receives(header, &specs);
    if (ours <= 0) {
        Py_XDECREF(specs);
        return ours < 0 ? NULL : PyObject_Vectorcall(self->fallback, args, 4, NULL);
    }
    long src = PyLong_AsLong(args[3]);
    long long tag = 0;
    int ok = !(src == -1 && PyErr_Occurred()) && attr_long(header, s_data_tag, &tag) == 0;
    if (ok && (src < 0 || src > INT_MAX || tag < 0 || tag > INT_MAX)) {
        PyErr_Format(PyExc_ValueError, "receive_rest: no rank %ld or tag %lld", src, tag);
        ok = 0;
    }
    Py_ssize_t n = PyList_GET_SIZE(specs);
    PyObject *tensors = ok ? PyList_New(n) : NULL;
    for (Py_ssize_t i = 0; tensors != NULL && i < n; i++) {
        PyObject *spec = PyList_GET_ITEM(specs, i);
        PyObject *tensor = receive_tensor(self, spec, (int)src, (int)tag);
        PyObject *flag = tensor != NULL ? PyObject_GetAttr(spec, s_requires_grad) : NULL;
        int grad = flag != NULL ? PyObject_IsTrue(flag) : -1;
        Py_XDECREF(flag);
        if (grad == 1) { /* frames.finish_tensor: requires_grad where the dtype allows */
            PyObject *finish_args[2] = {tensor, spec};
            Py_SETREF(tensor, PyObject_Vectorcall(self->finish, finish_args, 2, NULL));
        }
        if (grad < 0 || tensor == NULL) {
            Py_XDECREF(tensor);
            Py_CLEAR(tensors);
            break;
        }
        PyList_SET_ITEM(tensors, i, tensor);
    }
    Py_DECREF(specs);
    if (tensors == NULL || PyObject_SetAttr(env, s_tensors, tensors) < 0) {
        Py_XDECREF(tensors);
        return NULL;
    }
    Py_DECREF(tensors);
    return Py_NewRef(env);
}

static PyObject *Wire_probe(Wire *self, PyObject *Py_UNUSED(ignored))
{
    return receive(self, 0.0);
}

static PyObject *Wire_probe_wait(Wire *self, PyObject *arg)
{
    double seconds = PyFloat_AsDouble(arg);
    if (seconds == -1.0 && PyErr_Occurred())
        return NULL;
    return receive(self, seconds > 0 ? seconds : 0.0);
}

static PyObject *Wire_close(Wire *self, PyObject *Py_UNUSED(ignored))
{
    self->closed = 1;
    Py_CLEAR(self->fallback); /* (the transport's method: a cycle through the transport) */
    Py_CLEAR(self->empty);
    Py_CLEAR(self->finish);
    self->interrupted = 1; /* a wait under way ends; the next call raises */
    Py_RETURN_NONE;
}

static PyObject *Wire_interrupt(Wire *self, PyObject *Py_UNUSED(ignored))
{
    self->interrupted = 1;
    Py_RETURN_NONE;
}

static PyObject *Wire_complete_sends(Wire *self, PyObject *Py_UNUSED(ignored))
{
    CHECK_OPEN(self)
    if (complete(self) < 0)
        return NULL;
    return PyLong_FromSsize_t(self->count);
}

static PyObject *Wire_in_flight(Wire *self, void *Py_UNUSED(closure))
{
    return PyLong_FromSsize_t(self->count);
}

static PyObject *library_version(PyObject *Py_UNUSED(module), PyObject *Py_UNUSED(ignored))
{
    char version[MPI_MAX_LIBRARY_VERSION_STRING];
    int length = 0;
    if (MPI_Get_library_version(version, &length) != MPI_SUCCESS) {
        PyErr_SetString(PyExc_RuntimeError, "MPI_Get_library_version failed");
        return NULL;
    }
    return PyUnicode_DecodeLatin1(version, length, "replace");
}

static PyMethodDef Wire_methods[] = {
    {"send", (PyCFunction)(void (*)(void))Wire_send, METH_FASTCALL,
     "send(dst, frame): start sending frame 0 to dst; it stays in flight if not done"},
    {"probe", (PyCFunction)Wire_probe, METH_NOARGS,
     "probe() -> (source, bytearray) | None: the next frame 0, received whole"},
    {"probe_wait", (PyCFunction)Wire_probe_wait, METH_O,
     "probe_wait(seconds) -> (source, bytearray) | None: probe() until a frame 0 arrives, "
     "seconds pass or interrupt() is called, without the GIL"},
    {"send_tensor", (PyCFunction)(void (*)(void))Wire_send_tensor, METH_FASTCALL,
     "send_tensor(dst, tag, tensor) -> bool: send the bytes of a dense CPU tensor whole, "
     "without the GIL; False (nothing sent) for any other tensor"},
    {"recv_tensor", (PyCFunction)(void (*)(void))Wire_recv_tensor, METH_FASTCALL,
     "recv_tensor(src, tag, tensor) -> bool: receive a data frame into the memory of a "
     "dense CPU tensor, whole, without the GIL; False (nothing received) for any other"},
    {"set_receiver", (PyCFunction)(void (*)(void))Wire_set_receiver, METH_FASTCALL,
     "set_receiver(fallback, empty, finish): what receive_rest calls (the Python "
     "receive_rest, the receive cache's empty(shape, dtype, nbytes), frames.finish_tensor)"},
    {"receive_rest", (PyCFunction)(void (*)(void))Wire_receive_rest, METH_FASTCALL,
     "receive_rest(env, header, frame0, src) -> env: the frames after frame 0 received "
     "into new tensors (env.tensors); the Python receive_rest for any other message"},
    {"close", (PyCFunction)Wire_close, METH_NOARGS,
     "close(): before the communicator is freed; every later call raises MPI_ERR_COMM"},
    {"interrupt", (PyCFunction)Wire_interrupt, METH_NOARGS,
     "interrupt(): the probe_wait() under way (or the next one) returns at once"},
    {"complete_sends", (PyCFunction)Wire_complete_sends, METH_NOARGS,
     "complete_sends() -> int: release the finished sends; how many are still in flight"},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef Wire_getset[] = {
    {"in_flight", (getter)Wire_in_flight, NULL, "frame-0 sends not yet complete", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject WireType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "_mpidag_wire.Wire",
    .tp_basicsize = sizeof(Wire),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Wire(comm_handle, tag, error_class): frame 0 to and from one communicator",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Wire_init,
    .tp_dealloc = (destructor)Wire_dealloc,
    .tp_methods = Wire_methods,
    .tp_getset = Wire_getset,
};

static PyMethodDef module_methods[] = {
    {"library_version", library_version, METH_NOARGS,
     "the MPI library this module was linked against (MPI_Get_library_version)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef wire_module = {
    PyModuleDef_HEAD_INIT, "_mpidag_wire",
    "mpidag's frame-0 path over MPI, in C (see mpidag/transport/wire.py)", -1, module_methods,
};

PyMODINIT_FUNC PyInit__mpidag_wire(void)
{
#define INTERN(var, text)                                                                  \
    if ((var = PyUnicode_InternFromString(text)) == NULL)                                  \
        return NULL;
    INTERN(s_payload_separate, "payload_separate") INTERN(s_sparse, "sparse")
    INTERN(s_specs, "specs") INTERN(s_data_tag, "data_tag") INTERN(s_device, "device")
    INTERN(s_shape, "shape") INTERN(s_dtype, "dtype") INTERN(s_nbytes, "nbytes")
    INTERN(s_inline_offset, "inline_offset") INTERN(s_requires_grad, "requires_grad")
    INTERN(s_tensors, "tensors") INTERN(s_cpu, "cpu")
#undef INTERN
    if (PyType_Ready(&WireType) < 0)
        return NULL;
    PyObject *module = PyModule_Create(&wire_module);
    if (module == NULL)
        return NULL;
    /* what mpidag/transport/wire.py expects (WIRE_VERSION): a build from older sources
     * is not used */
    if (PyModule_AddIntConstant(module, "VERSION", 5) < 0 ||
            PyModule_AddObjectRef(module, "Wire", (PyObject *)&WireType) < 0) {
        Py_DECREF(module);
        return NULL;
    }
    return module;
}
