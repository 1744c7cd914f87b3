/* _mpidag_frames: frame 0's encoder and decoder in C (see mpidag/transport/frames.py).
 *
 * encode(env, devices, data_tag), decode_header(frame) and decode_message(frame) give
 * exactly what the Python functions of frames.py give, for the messages that make up the
 * hot path: a payload inside frame 0 and dense CPU tensors (inline, empty or in frames of
 * their own; decode_message makes the inline ones itself, as views of frame 0, with
 * torch.frombuffer, the one torch call this module makes). Anything else (a
 * payload frame, sparse COO tensors, a CUDA or non-contiguous tensor to inline, a dtype or
 * device not seen before) is handed to the Python function, which also raises the errors.
 * The envelope, header and spec objects are the Python classes of frames.py, filled through
 * their slots (no __init__ call). No MPI and no torch headers: tensors are read through
 * their Python attributes. configure() (frames.py calls it at import) hands over the
 * classes, the dtype table, the device tables and the Python fallbacks.
 *
 * Built per virtual environment by `python -m mpidag.transport.wire_build`.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#include "frame_tensor.h"
#include "slots.h"

#define HEADER_SIZE 49 /* struct "<BBBHIqqqQII" */
#define SPEC_FIXED 22  /* struct "<BBBBhqq", then ndim int64 */
#define ALIGN 16
#define WIRE_PAYLOAD_FRAME 1
#define WIRE_SPARSE 2
#define REQUIRES_GRAD 1
#define MAX_INLINE_TENSORS 64
#define VIEW_ARGS_MAX 8 /* dims passed to Tensor.view one by one */

static struct {
    int ready;
    PyObject *envelope, *header, *spec;            /* the dataclasses */
    PyObject *env_slots[8];                       /* Envelope's slot descriptors */
    PyObject *header_slots[6], *spec_slots[6];
    PyObject *dtypes;                              /* list: wire code -> torch.dtype */
    PyObject *dtype_codes;                         /* dict: torch.dtype -> wire code */
    PyObject *device_name;                         /* (type, index) -> "cuda:1" */
    PyObject *device_codes;                        /* dict: "cpu" -> (0, -1) */
    PyObject *strided;                             /* torch.strided */
    PyObject *encode_py, *decode_py, *decode_message_py; /* the Python functions */
    PyObject *frombuffer;                          /* torch.frombuffer */
    PyObject *grad_dtypes;                         /* list: wire code -> may require grad */
    PyObject *frombuffer_kwnames;                  /* ("dtype", "count", "offset") */
    mpidag_frame_tensor_fn frame_tensor;           /* _mpidag_torch's, or NULL */
    mpidag_tensor_facts_fn tensor_facts;           /* _mpidag_torch's, or NULL */
    PyObject *cpu;                                 /* "cpu" */
    Py_ssize_t inline_limit, payload_frame_limit;
    /* attribute names */
    PyObject *s_tensors, *s_payload, *s_kind, *s_flags, *s_request_id, *s_context_id,
        *s_message_id, *s_layout, *s_nbytes, *s_dtype, *s_is_cpu, *s_shape,
        *s_requires_grad, *s_is_contiguous, *s_is_conj, *s_is_neg, *s_data_ptr, *s_view,
        *s_requires_grad_;
} S;

static const char *ENV_FIELDS[8] = {"kind", "request_id", "flags", "context_id",
                                    "message_id", "payload", "tensors", "src"};
static const char *HEADER_FIELDS[6] = {"data_tag", "specs", "inline_start",
                                       "payload_length", "payload_separate", "sparse"};
static const char *SPEC_FIELDS[6] = {"dtype", "shape", "device", "requires_grad",
                                     "inline_offset", "nbytes"};

static Py_ssize_t align16(Py_ssize_t n) { return (n + ALIGN - 1) & ~(Py_ssize_t)(ALIGN - 1); }

/* ------------------------------------------------------------------ little endian */
static void put_u16(char *p, uint16_t v) { memcpy(p, &v, 2); }
static void put_u32(char *p, uint32_t v) { memcpy(p, &v, 4); }
static void put_i64(char *p, int64_t v) { memcpy(p, &v, 8); }
static uint16_t get_u16(const char *p) { uint16_t v; memcpy(&v, p, 2); return v; }
static uint32_t get_u32(const char *p) { uint32_t v; memcpy(&v, p, 4); return v; }
static int64_t get_i64(const char *p) { int64_t v; memcpy(&v, p, 8); return v; }

/* ------------------------------------------------------------------ slots */
static int set_slots(PyObject *obj, PyObject **descrs, PyObject **values, int n)
{
    /* steals the references of values[]; on failure they are released */
    int rc = 0;
    for (int i = 0; i < n; i++) {
        if (rc == 0 && mpidag_slot_set(descrs[i], obj, values[i]) < 0)
            rc = -1;
        Py_DECREF(values[i]);
    }
    return rc;
}

/* 0 when every one of ``values`` was made; else -1 with all of them released */
static int all_made(PyObject **values, int n)
{
    for (int i = 0; i < n; i++) {
        if (values[i] == NULL) {
            for (int j = 0; j < n; j++)
                Py_XDECREF(values[j]);
            return -1;
        }
    }
    return 0;
}

static PyObject *new_instance(PyObject *cls)
{
    PyTypeObject *type = (PyTypeObject *)cls;
    return type->tp_alloc(type, 0);
}

/* ------------------------------------------------------------------ configure */
static PyObject *slot_descr(PyObject *cls, const char *name)
{
    PyObject *descr = PyObject_GetAttrString(cls, name);
    if (descr != NULL && mpidag_slot_check(descr, ((PyTypeObject *)cls)->tp_name, name) < 0)
        Py_CLEAR(descr);
    return descr;
}

static PyObject *configure(PyObject *Py_UNUSED(module), PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"envelope", "header", "spec", "dtypes", "dtype_codes",
                             "device_name", "device_codes", "strided", "encode", "decode",
                             "decode_message", "frombuffer", "grad_dtypes", "inline_limit",
                             "payload_frame_limit", "frame_tensor", "tensor_facts", NULL};
    PyObject *o[13], *frame_tensor = Py_None, *tensor_facts = Py_None;
    Py_ssize_t inline_limit, payload_frame_limit;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O!O!O!O!O!OO!OOOOOO!nn|OO", kwlist,
                                     &PyType_Type, &o[0], &PyType_Type, &o[1],
                                     &PyType_Type, &o[2], &PyList_Type, &o[3],
                                     &PyDict_Type, &o[4], &o[5], &PyDict_Type, &o[6],
                                     &o[7], &o[8], &o[9], &o[10], &o[11], &PyList_Type,
                                     &o[12], &inline_limit, &payload_frame_limit,
                                     &frame_tensor, &tensor_facts))
        return NULL;
    void *frame_tensor_fn = NULL, *tensor_facts_fn = NULL; /* (None: not built) */
    if ((frame_tensor != Py_None && (frame_tensor_fn = PyCapsule_GetPointer(
             frame_tensor, MPIDAG_FRAME_TENSOR_CAPSULE)) == NULL) ||
        (tensor_facts != Py_None && (tensor_facts_fn = PyCapsule_GetPointer(
             tensor_facts, MPIDAG_TENSOR_FACTS_CAPSULE)) == NULL))
        return NULL;
    if (PyList_GET_SIZE(o[12]) != PyList_GET_SIZE(o[3])) {
        PyErr_SetString(PyExc_ValueError, "configure: one grad_dtypes entry per dtype");
        return NULL;
    }
    /* every slot checked before anything is kept: the C code writes at their offsets, so
     * a failed configure must leave the codec as it was (all of Envelope's, Header's and
     * TensorSpec's slots, the capsules' functions) */
    PyObject *slots[20] = {NULL};
    int made = 1;
    for (int i = 0; i < 8 && made; i++)
        made = (slots[i] = slot_descr(o[0], ENV_FIELDS[i])) != NULL;
    for (int i = 0; i < 6 && made; i++)
        made = (slots[8 + i] = slot_descr(o[1], HEADER_FIELDS[i])) != NULL &&
               (slots[14 + i] = slot_descr(o[2], SPEC_FIELDS[i])) != NULL;
    if (!made) {
        for (int i = 0; i < 20; i++)
            Py_XDECREF(slots[i]);
        return NULL;
    }
    S.frame_tensor = (mpidag_frame_tensor_fn)frame_tensor_fn;
    S.tensor_facts = (mpidag_tensor_facts_fn)tensor_facts_fn;
    for (int i = 0; i < 8; i++)
        Py_XSETREF(S.env_slots[i], slots[i]);
    for (int i = 0; i < 6; i++) {
        Py_XSETREF(S.header_slots[i], slots[8 + i]);
        Py_XSETREF(S.spec_slots[i], slots[14 + i]);
    }
    PyObject **dst[13] = {&S.envelope, &S.header, &S.spec, &S.dtypes, &S.dtype_codes,
                          &S.device_name, &S.device_codes, &S.strided, &S.encode_py,
                          &S.decode_py, &S.decode_message_py, &S.frombuffer,
                          &S.grad_dtypes};
    for (int i = 0; i < 13; i++)
        Py_XSETREF(*dst[i], Py_NewRef(o[i]));
    Py_XSETREF(S.frombuffer_kwnames, Py_BuildValue("(sss)", "dtype", "count", "offset"));
    if (S.frombuffer_kwnames == NULL)
        return NULL;
    S.inline_limit = inline_limit;
    S.payload_frame_limit = payload_frame_limit;
#define NAME(field, text) if ((S.field = PyUnicode_InternFromString(text)) == NULL) return NULL
    NAME(s_tensors, "tensors"); NAME(s_payload, "payload"); NAME(s_kind, "kind");
    NAME(s_flags, "flags"); NAME(s_request_id, "request_id");
    NAME(s_context_id, "context_id"); NAME(s_message_id, "message_id");
    NAME(s_layout, "layout"); NAME(s_nbytes, "nbytes"); NAME(s_dtype, "dtype");
    NAME(s_is_cpu, "is_cpu"); NAME(s_shape, "shape"); NAME(s_requires_grad, "requires_grad");
    NAME(s_is_contiguous, "is_contiguous"); NAME(s_is_conj, "is_conj");
    NAME(s_is_neg, "is_neg"); NAME(s_data_ptr, "data_ptr"); NAME(cpu, "cpu");
    NAME(s_view, "view"); NAME(s_requires_grad_, "requires_grad_");
#undef NAME
    S.ready = 1;
    Py_RETURN_NONE;
}

/* ------------------------------------------------------------------ encode */
/* value's integer; steals value (NULL: the error set stays) */
static int64_t as_i64(PyObject *value, int *ok)
{
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

static int64_t attr_i64(PyObject *obj, PyObject *name, int *ok)
{
    return as_i64(PyObject_GetAttr(obj, name), ok);
}

/* env's field number `slot` of ENV_FIELDS: through its slot for an Envelope (slots.h),
 * by name for any other object */
static PyObject *env_field(PyObject *env, int slot, PyObject *name)
{
    PyObject *descr = S.env_slots[slot];
    return mpidag_slot_applies(descr, env) ? mpidag_slot_get(descr, env)
                                           : PyObject_GetAttr(env, name);
}

/* 1: true, 0: false, -1: error */
static int attr_true(PyObject *obj, PyObject *name, int call)
{
    PyObject *value = call ? PyObject_CallMethodNoArgs(obj, name) : PyObject_GetAttr(obj, name);
    if (value == NULL)
        return -1;
    int truth = PyObject_IsTrue(value);
    Py_DECREF(value);
    return truth;
}

typedef struct {
    PyObject *tensor; /* borrowed (the env's list holds it) */
    int code, ndim, flags, dev_type, dev_index;
    int64_t offset, nbytes;
    PyObject *shape;    /* new reference; NULL where facts were read (sizes in dims) */
    const void *data;   /* inline: where its bytes are */
    int known;          /* read through tensor_facts: copyable and where say the rest */
    int copyable;
    const void *where;
    int64_t dims[MPIDAG_FACTS_DIMS];
} Part;

#define FALLBACK 1 /* hand the message to the Python encoder */

/* part's tensor and the wire codes of its dtype (a torch.dtype) and of the device it lands
 * on; 0, FALLBACK (a dtype or device the wire has no code for yet) or -1 (error). */
static int place(Part *part, PyObject *t, PyObject *dtype, PyObject *device)
{
    PyObject *code = PyDict_GetItemWithError(S.dtype_codes, dtype);
    if (code == NULL)
        return PyErr_Occurred() ? -1 : FALLBACK;
    PyObject *dev = PyDict_GetItemWithError(S.device_codes, device);
    if (dev == NULL)
        return PyErr_Occurred() ? -1 : FALLBACK;
    if (!PyTuple_Check(dev) || PyTuple_GET_SIZE(dev) != 2)
        return FALLBACK;
    part->tensor = t;
    part->code = (int)PyLong_AsLong(code);
    part->dev_type = (int)PyLong_AsLong(PyTuple_GET_ITEM(dev, 0));
    part->dev_index = (int)PyLong_AsLong(PyTuple_GET_ITEM(dev, 1));
    return PyErr_Occurred() ? -1 : 0;
}

/* Fill ``part`` for tensor ``t`` landing on ``device``; 0, FALLBACK or -1 (error). */
static int describe(PyObject *t, PyObject *device, Part *part)
{
    mpidag_tensor_facts facts;
    part->shape = NULL;
    part->data = NULL;
    part->known = S.tensor_facts != NULL && S.tensor_facts(t, &facts);
    if (part->known) { /* a strided CPU tensor read in C++: no Python attribute */
        int placed = place(part, t, facts.dtype, device);
        if (placed != 0)
            return placed;
        part->flags = facts.requires_grad ? REQUIRES_GRAD : 0;
        part->nbytes = facts.nbytes;
        part->ndim = facts.ndim;
        memcpy(part->dims, facts.sizes, sizeof(int64_t) * (size_t)facts.ndim);
        part->copyable = facts.copyable;
        part->where = facts.data;
        return 0;
    }
    PyObject *layout = PyObject_GetAttr(t, S.s_layout);
    if (layout == NULL)
        return -1;
    Py_DECREF(layout); /* (torch.strided lives on in torch) */
    if (layout != S.strided)
        return FALLBACK;
    int cpu = attr_true(t, S.s_is_cpu, 0);
    if (cpu <= 0)
        return cpu < 0 ? -1 : FALLBACK;
    PyObject *dtype = PyObject_GetAttr(t, S.s_dtype);
    if (dtype == NULL)
        return -1;
    int placed = place(part, t, dtype, device);
    Py_DECREF(dtype);
    if (placed != 0)
        return placed;
    int grad = attr_true(t, S.s_requires_grad, 0);
    if (grad < 0)
        return -1;
    part->flags = grad ? REQUIRES_GRAD : 0;
    int ok = 1;
    part->nbytes = attr_i64(t, S.s_nbytes, &ok);
    if (!ok)
        return -1;
    PyObject *shape = PyObject_GetAttr(t, S.s_shape);
    if (shape == NULL)
        return -1;
    if (!PyTuple_Check(shape) || PyTuple_GET_SIZE(shape) > 255) {
        Py_DECREF(shape);
        return FALLBACK;
    }
    part->shape = shape;
    part->ndim = (int)PyTuple_GET_SIZE(shape);
    part->data = NULL;
    return 0;
}

/* Where an inline tensor's bytes are, if its memory can be copied as it is (contiguous,
 * neither conjugated nor negated): 0, FALLBACK (copy it in Python) or -1 (error). */
static int inline_data(Part *part)
{
    if (part->known) {
        if (!part->copyable)
            return FALLBACK;
        part->data = part->where;
        return 0;
    }
    PyObject *t = part->tensor;
    int contiguous = attr_true(t, S.s_is_contiguous, 1);
    int conj = contiguous > 0 ? attr_true(t, S.s_is_conj, 1) : 0;
    int neg = contiguous > 0 && conj == 0 ? attr_true(t, S.s_is_neg, 1) : 0;
    if (contiguous < 0 || conj < 0 || neg < 0)
        return -1;
    if (!contiguous || conj || neg)
        return FALLBACK;
    PyObject *ptr = PyObject_CallMethodNoArgs(t, S.s_data_ptr);
    if (ptr == NULL)
        return -1;
    part->data = PyLong_AsVoidPtr(ptr);
    Py_DECREF(ptr);
    return PyErr_Occurred() ? -1 : 0;
}

static void put_header(char *p, int kind, int flags, int wire, int n_tensors,
                       uint32_t data_tag, int64_t request_id, int64_t context_id,
                       int64_t message_id, uint64_t payload_len, uint32_t specs_len,
                       uint32_t inline_len)
{
    p[0] = (char)kind;
    p[1] = (char)flags;
    p[2] = (char)wire;
    put_u16(p + 3, (uint16_t)n_tensors);
    put_u32(p + 5, data_tag);
    put_i64(p + 9, request_id);
    put_i64(p + 17, context_id);
    put_i64(p + 25, message_id);
    put_i64(p + 33, (int64_t)payload_len);
    put_u32(p + 41, specs_len);
    put_u32(p + 45, inline_len);
}

static PyObject *fallback_encode(PyObject *env, PyObject *devices, PyObject *tag)
{
    return PyObject_CallFunctionObjArgs(S.encode_py, env, devices, tag, NULL);
}

static PyObject *encode(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs,
                        PyObject *kwnames)
{
    /* encode(env, devices, data_tag), any of them by keyword, as the Python function */
    static const char *names[3] = {"env", "devices", "data_tag"};
    PyObject *given[3] = {NULL, NULL, NULL};
    Py_ssize_t nkw = kwnames ? PyTuple_GET_SIZE(kwnames) : 0;
    for (Py_ssize_t i = 0; i < nargs && i < 3; i++)
        given[i] = args[i];
    for (Py_ssize_t k = 0; k < nkw; k++) {
        int found = 0;
        for (int i = 0; i < 3; i++) {
            if (PyUnicode_CompareWithASCIIString(PyTuple_GET_ITEM(kwnames, k), names[i]) == 0
                    && given[i] == NULL) {
                given[i] = args[nargs + k];
                found = 1;
            }
        }
        if (!found)
            nargs = 99;
    }
    if (nargs > 3 || given[0] == NULL || given[1] == NULL || given[2] == NULL) {
        PyErr_SetString(PyExc_TypeError, "encode(env, devices, data_tag) takes 3 arguments");
        return NULL;
    }
    PyObject *env = given[0], *devices = given[1], *tag = given[2];
    long data_tag = PyLong_AsLong(tag);
    if (data_tag == -1 && PyErr_Occurred())
        return NULL;
    int ok = 1;
    int kind = (int)as_i64(env_field(env, 0, S.s_kind), &ok);
    int64_t request_id = ok ? as_i64(env_field(env, 1, S.s_request_id), &ok) : 0;
    int flags = ok ? (int)as_i64(env_field(env, 2, S.s_flags), &ok) : 0;
    int64_t context_id = ok ? as_i64(env_field(env, 3, S.s_context_id), &ok) : 0;
    int64_t message_id = ok ? as_i64(env_field(env, 4, S.s_message_id), &ok) : 0;
    if (!ok)
        return NULL;
    if (kind < 0 || kind > 255 || flags < 0 || flags > 255 || data_tag < 0)
        return fallback_encode(env, devices, tag); /* (struct's error, from Python) */
    PyObject *payload = env_field(env, 5, S.s_payload);
    if (payload == NULL)
        return NULL;
    PyObject *tensors = env_field(env, 6, S.s_tensors);
    if (tensors == NULL) {
        Py_DECREF(payload);
        return NULL;
    }
    PyObject *result = NULL, *frame = NULL, *separate = NULL;
    Py_buffer pay = {0};
    Part parts[MAX_INLINE_TENSORS];
    Py_ssize_t n = 0, n_parts = 0;
    if (PyObject_GetBuffer(payload, &pay, PyBUF_SIMPLE) < 0)
        goto done;
    if (!PyList_Check(tensors) || !PyList_Check(devices) || pay.len > S.payload_frame_limit)
        goto fall_back;
    n = PyList_GET_SIZE(tensors);
    if (n > MAX_INLINE_TENSORS || PyList_GET_SIZE(devices) != n)
        goto fall_back;
    /* specs, and where each tensor's bytes go */
    Py_ssize_t specs_len = 0, inline_total = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        Part *part = &parts[i];
        int rc = describe(PyList_GET_ITEM(tensors, i), PyList_GET_ITEM(devices, i), part);
        if (rc == 0)
            n_parts = i + 1; /* its shape is held, released at the end */
        if (rc == 0 && part->nbytes > 0 && inline_total + part->nbytes <= S.inline_limit)
            rc = inline_data(part);
        if (rc < 0)
            goto done;
        if (rc == FALLBACK)
            goto fall_back;
        specs_len += SPEC_FIXED + 8 * part->ndim;
        if (part->nbytes == 0) {
            part->offset = 0;
        } else if (part->data != NULL) {
            part->offset = inline_total;
            inline_total += align16(part->nbytes);
        } else {
            part->offset = -1;
        }
    }
    Py_ssize_t head_len = HEADER_SIZE + pay.len + specs_len;
    Py_ssize_t total = (n ? align16(head_len) : head_len) + inline_total;
    frame = PyBytes_FromStringAndSize(NULL, total);
    separate = PyList_New(0);
    if (frame == NULL || separate == NULL)
        goto done;
    char *p = PyBytes_AS_STRING(frame);
    put_header(p, kind, flags, 0, (int)n, (uint32_t)data_tag, request_id, context_id,
               message_id, (uint64_t)pay.len, (uint32_t)specs_len, (uint32_t)inline_total);
    memcpy(p + HEADER_SIZE, pay.buf, pay.len);
    char *q = p + HEADER_SIZE + pay.len;
    for (Py_ssize_t i = 0; i < n; i++) {
        Part *part = &parts[i];
        q[0] = (char)part->code;
        q[1] = (char)part->ndim;
        q[2] = (char)part->flags;
        q[3] = (char)part->dev_type;
        int16_t index = (int16_t)part->dev_index;
        memcpy(q + 4, &index, 2);
        put_i64(q + 6, part->offset);
        put_i64(q + 14, part->nbytes);
        for (int d = 0; d < part->ndim; d++) {
            long long size = part->shape == NULL ? part->dims[d]
                                                 : PyLong_AsLongLong(PyTuple_GET_ITEM(part->shape, d));
            if (size == -1 && PyErr_Occurred())
                goto done;
            put_i64(q + SPEC_FIXED + 8 * d, size);
        }
        q += SPEC_FIXED + 8 * part->ndim;
        if (part->offset < 0 && part->nbytes > 0 &&
            PyList_Append(separate, part->tensor) < 0)
            goto done;
    }
    if (n) {
        memset(q, 0, align16(head_len) - head_len);
        char *inline_base = p + align16(head_len);
        for (Py_ssize_t i = 0; i < n; i++) {
            Part *part = &parts[i];
            if (part->data == NULL)
                continue;
            memcpy(inline_base + part->offset, part->data, part->nbytes);
            memset(inline_base + part->offset + part->nbytes, 0,
                   align16(part->nbytes) - part->nbytes);
        }
    }
    result = PyTuple_Pack(2, frame, separate);
    goto done;
fall_back:
    result = fallback_encode(env, devices, tag);
done:
    for (Py_ssize_t i = 0; i < n_parts; i++)
        Py_CLEAR(parts[i].shape);
    Py_XDECREF(frame);
    Py_XDECREF(separate);
    if (pay.obj != NULL)
        PyBuffer_Release(&pay);
    Py_DECREF(payload);
    Py_DECREF(tensors);
    return result;
}

/* ------------------------------------------------------------------ decode */
static PyObject *device_name(int dev_type, int dev_index)
{
    if (dev_type == 0 && dev_index == -1)
        return Py_NewRef(S.cpu);
    return PyObject_CallFunction(S.device_name, "ii", dev_type, dev_index);
}

static PyObject *bad_frame(const char *what)
{
    PyErr_Format(PyExc_ValueError, "a malformed frame 0: %s", what);
    return NULL;
}

/* one tensor spec as frame 0 has it (see TensorSpec.unpack_from) */
typedef struct {
    int code, ndim, sflags, dev_type, dev_index;
    int64_t inline_offset, nbytes;
    const char *dims; /* ndim int64 */
} RawSpec;

#define FRAME_TENSOR_DIMS 64

/* The tensor of an inline CPU spec as a view of frame 0's bytes (frames.inline_tensor and
 * finish_tensor): _mpidag_torch's frame_tensor where configured, else torch.frombuffer,
 * .view(shape) unless 1-D, requires_grad_ where its flag says so and its dtype can. */
static PyObject *inline_tensor(PyObject *frame, Py_ssize_t inline_start, const RawSpec *r)
{
    int grad = (r->sflags & REQUIRES_GRAD) && PyList_GET_ITEM(S.grad_dtypes, r->code) == Py_True;
    if (S.frame_tensor != NULL && r->ndim <= FRAME_TENSOR_DIMS) {
        int64_t sizes[FRAME_TENSOR_DIMS];
        for (int d = 0; d < r->ndim; d++)
            sizes[d] = get_i64(r->dims + 8 * d);
        return S.frame_tensor(frame, inline_start + r->inline_offset,
                              PyList_GET_ITEM(S.dtypes, r->code), r->ndim, sizes, grad);
    }
    int64_t count = 1;
    for (int d = 0; d < r->ndim; d++)
        count *= get_i64(r->dims + 8 * d);
    PyObject *c = PyLong_FromLongLong(count);
    PyObject *offset = PyLong_FromLongLong(inline_start + r->inline_offset);
    PyObject *t = NULL;
    if (c != NULL && offset != NULL) {
        PyObject *argv[4] = {frame, PyList_GET_ITEM(S.dtypes, r->code), c, offset};
        t = PyObject_Vectorcall(S.frombuffer, argv, 1, S.frombuffer_kwnames);
    }
    Py_XDECREF(c);
    Py_XDECREF(offset);
    if (t != NULL && r->ndim != 1) { /* t.view(*sizes): 0.3 us less than t.view(shape) */
        PyObject *argv[1 + VIEW_ARGS_MAX] = {t};
        int n = r->ndim, made = 1;
        if (n == 0 || n > VIEW_ARGS_MAX) { /* t.view(()) or t.view(shape) */
            PyObject *shape = PyTuple_New(n);
            for (int d = 0; shape != NULL && d < n; d++) {
                PyObject *size = PyLong_FromLongLong(get_i64(r->dims + 8 * d));
                if (size == NULL)
                    Py_CLEAR(shape);
                else
                    PyTuple_SET_ITEM(shape, d, size);
            }
            argv[1] = shape;
            made = shape != NULL;
            n = 1;
        } else {
            for (int d = 0; d < n; d++)
                if ((argv[1 + d] = PyLong_FromLongLong(get_i64(r->dims + 8 * d))) == NULL)
                    made = 0;
        }
        PyObject *viewed = made ? PyObject_VectorcallMethod(S.s_view, argv, 1 + n, NULL)
                                : NULL;
        for (int d = 0; d < n; d++)
            Py_XDECREF(argv[1 + d]);
        Py_SETREF(t, viewed);
    }
    if (t != NULL && grad) {
        PyObject *argv[2] = {t, Py_True};
        PyObject *done = PyObject_VectorcallMethod(S.s_requires_grad_, argv, 2, NULL);
        if (done == NULL)
            Py_CLEAR(t);
        Py_XDECREF(done);
    }
    return t;
}

/* decode_header(frame, src) and decode_message(frame, src): make_tensors says whether a
 * message whose tensors all lie inline in frame 0, for the CPU, is finished here (its
 * tensors made, no Header: the message is complete) */
/* memoryview(frame)[start:start + n] (what frames.py's decoder makes of the payload). A
 * 1-D view of bytes, as every frame is (bytes, bytearray, a receive buffer), is made
 * narrower in place before anyone else sees it, as memoryview's own slicing narrows its
 * new view (buf, len and the shape; one byte per item, so no stride changes): 0.7k
 * instructions less a message than the slice, which makes a slice object and a second
 * view. Any other view is sliced. */
static PyObject *payload_view(PyObject *frame, Py_ssize_t start, Py_ssize_t n)
{
    PyObject *view = PyMemoryView_FromObject(frame);
    if (view == NULL)
        return NULL;
    Py_buffer *v = PyMemoryView_GET_BUFFER(view);
    if (v->ndim == 1 && v->itemsize == 1 && v->shape != NULL && v->strides != NULL &&
        v->strides[0] == 1 && v->suboffsets == NULL && start >= 0 && n >= 0 &&
        start + n <= v->len) {
        v->buf = (char *)v->buf + start;
        v->len = n;
        v->shape[0] = n;
        return view;
    }
    PyObject *slice = PySequence_GetSlice(view, start, start + n);
    Py_DECREF(view);
    return slice;
}

static PyObject *decode(PyObject *const *args, Py_ssize_t nargs, int make_tensors)
{
    if (nargs < 1 || nargs > 2) {
        PyErr_SetString(PyExc_TypeError, make_tensors ? "decode_message(frame, src=-1)"
                                                      : "decode_header(frame, src=-1)");
        return NULL;
    }
    PyObject *frame = args[0];
    long src = -1;
    if (nargs > 1 && (src = PyLong_AsLong(args[1])) == -1 && PyErr_Occurred())
        return NULL;
    Py_buffer buf;
    if (PyObject_GetBuffer(frame, &buf, PyBUF_SIMPLE) < 0)
        return NULL;
    const char *p = buf.buf;
    Py_ssize_t len = buf.len;
    PyObject *result = NULL, *payload = NULL, *env = NULL, *specs = NULL;
    RawSpec *raw = NULL;
    if (len < HEADER_SIZE) {
        bad_frame("shorter than its header");
        goto done;
    }
    int wire = (unsigned char)p[2];
    int n_tensors = get_u16(p + 3);
    if (wire & (WIRE_PAYLOAD_FRAME | WIRE_SPARSE)) {
        PyObject *fallback = make_tensors ? S.decode_message_py : S.decode_py;
        result = nargs > 1 ? PyObject_CallFunctionObjArgs(fallback, frame, args[1], NULL)
                           : PyObject_CallOneArg(fallback, frame);
        goto done;
    }
    uint32_t data_tag = get_u32(p + 5);
    int64_t payload_len = get_i64(p + 33);
    uint32_t specs_len = get_u32(p + 41);
    if (payload_len < 0 || HEADER_SIZE + payload_len + (Py_ssize_t)specs_len > len) {
        bad_frame("its parts are longer than the frame");
        goto done;
    }
    payload = payload_view(frame, HEADER_SIZE, payload_len);
    if (payload == NULL)
        goto done;
    env = new_instance(S.envelope);
    if (env == NULL)
        goto done;
    PyObject *tensor_list = PyList_New(0);
    PyObject *values[8] = {
        PyLong_FromLong((unsigned char)p[0]), PyLong_FromLongLong(get_i64(p + 9)),
        PyLong_FromLong((unsigned char)p[1]), PyLong_FromLongLong(get_i64(p + 17)),
        PyLong_FromLongLong(get_i64(p + 25)), Py_NewRef(payload), tensor_list,
        PyLong_FromLong(src)};
    if (all_made(values, 8) < 0 || set_slots(env, S.env_slots, values, 8) < 0)
        goto done;
    if (n_tensors == 0) {
        result = PyTuple_Pack(2, env, Py_None);
        goto done;
    }
    raw = PyMem_Malloc(sizeof(RawSpec) * (size_t)n_tensors);
    if (raw == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    Py_ssize_t pos = HEADER_SIZE + payload_len, end = pos + specs_len;
    Py_ssize_t dtype_count = PyList_GET_SIZE(S.dtypes);
    int all_inline = make_tensors; /* every tensor inline in frame 0, for the CPU */
    for (int i = 0; i < n_tensors; i++) {
        if (pos + SPEC_FIXED > end) {
            bad_frame("fewer tensor specs than tensors");
            goto done;
        }
        const char *q = p + pos;
        RawSpec *r = &raw[i];
        r->code = (unsigned char)q[0];
        r->ndim = (unsigned char)q[1];
        r->sflags = (unsigned char)q[2];
        r->dev_type = (unsigned char)q[3];
        int16_t dev_index;
        memcpy(&dev_index, q + 4, 2);
        r->dev_index = dev_index;
        r->inline_offset = get_i64(q + 6);
        r->nbytes = get_i64(q + 14);
        r->dims = q + SPEC_FIXED;
        if (r->code >= dtype_count || pos + SPEC_FIXED + 8 * r->ndim > end) {
            bad_frame("a tensor spec out of range");
            goto done;
        }
        all_inline = all_inline && r->dev_type == 0 && r->dev_index == -1 &&
                     r->inline_offset >= 0 && r->nbytes > 0 &&
                     align16(end) + r->inline_offset + r->nbytes <= len;
        pos += SPEC_FIXED + 8 * r->ndim;
    }
    if (pos != end) {
        bad_frame("its tensor specs do not fill their length");
        goto done;
    }
    if (all_inline) { /* the whole message is here: its tensors are views of frame 0 */
        PyObject *tensors = PyList_New(n_tensors);
        for (int i = 0; tensors != NULL && i < n_tensors; i++) {
            PyObject *t = inline_tensor(frame, align16(end), &raw[i]);
            if (t == NULL)
                Py_CLEAR(tensors);
            else
                PyList_SET_ITEM(tensors, i, t);
        }
        if (tensors == NULL ||
            mpidag_slot_set(S.env_slots[6], env, tensors) < 0) {
            Py_XDECREF(tensors);
            goto done;
        }
        Py_DECREF(tensors);
        result = PyTuple_Pack(2, env, Py_None);
        goto done;
    }
    specs = PyList_New(n_tensors);
    if (specs == NULL)
        goto done;
    for (int i = 0; i < n_tensors; i++) {
        const RawSpec *r = &raw[i];
        PyObject *shape = PyTuple_New(r->ndim);
        if (shape == NULL)
            goto done;
        for (int d = 0; d < r->ndim; d++) {
            PyObject *size = PyLong_FromLongLong(get_i64(r->dims + 8 * d));
            if (size == NULL) {
                Py_DECREF(shape);
                goto done;
            }
            PyTuple_SET_ITEM(shape, d, size);
        }
        PyObject *spec = new_instance(S.spec);
        if (spec == NULL) {
            Py_DECREF(shape);
            goto done;
        }
        PyList_SET_ITEM(specs, i, spec);
        PyObject *sv[6] = {Py_NewRef(PyList_GET_ITEM(S.dtypes, r->code)), shape,
                           device_name(r->dev_type, r->dev_index),
                           PyBool_FromLong(r->sflags & REQUIRES_GRAD),
                           PyLong_FromLongLong(r->inline_offset),
                           PyLong_FromLongLong(r->nbytes)};
        if (all_made(sv, 6) < 0 || set_slots(spec, S.spec_slots, sv, 6) < 0)
            goto done;
    }
    PyObject *header = new_instance(S.header);
    if (header == NULL)
        goto done;
    PyObject *hv[6] = {PyLong_FromUnsignedLong(data_tag), Py_NewRef(specs),
                       PyLong_FromSsize_t(align16(end)), PyLong_FromLongLong(payload_len),
                       Py_NewRef(Py_False), Py_NewRef(Py_None)};
    if (all_made(hv, 6) < 0 || set_slots(header, S.header_slots, hv, 6) < 0) {
        Py_DECREF(header);
        goto done;
    }
    result = PyTuple_Pack(2, env, header);
    Py_DECREF(header);
done:
    PyMem_Free(raw);
    Py_XDECREF(specs);
    Py_XDECREF(env);
    Py_XDECREF(payload);
    PyBuffer_Release(&buf);
    return result;
}

static PyObject *decode_header(PyObject *Py_UNUSED(module), PyObject *const *args,
                               Py_ssize_t nargs)
{
    return decode(args, nargs, 0);
}

static PyObject *decode_message(PyObject *Py_UNUSED(module), PyObject *const *args,
                                Py_ssize_t nargs)
{
    return decode(args, nargs, 1);
}

static PyObject *ready(PyObject *Py_UNUSED(module), PyObject *Py_UNUSED(ignored))
{
    return PyBool_FromLong(S.ready);
}

static PyObject *uses_torch_native(PyObject *Py_UNUSED(module), PyObject *Py_UNUSED(noargs))
{
    return PyBool_FromLong(S.frame_tensor != NULL);
}

static PyMethodDef methods[] = {
    {"uses_torch_native", uses_torch_native, METH_NOARGS,
     "uses_torch_native() -> bool: whether inline tensors are made by _mpidag_torch's "
     "frame_tensor (configure's frame_tensor capsule) rather than torch.frombuffer"},
    {"configure", (PyCFunction)(void (*)(void))configure, METH_VARARGS | METH_KEYWORDS,
     "configure(...): the classes, tables and Python fallbacks of frames.py"},
    {"encode", (PyCFunction)(void (*)(void))encode, METH_FASTCALL | METH_KEYWORDS,
     "encode(env, devices, data_tag) -> (frame0, separate): frames.encode in C"},
    {"decode_header", (PyCFunction)(void (*)(void))decode_header, METH_FASTCALL,
     "decode_header(frame, src=-1) -> (env, header | None): frames.decode_header in C"},
    {"decode_message", (PyCFunction)(void (*)(void))decode_message, METH_FASTCALL,
     "decode_message(frame, src=-1) -> (env, header | None): frames.decode_message in C"},
    {"ready", ready, METH_NOARGS, "whether configure() was called"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef frames_module = {
    PyModuleDef_HEAD_INIT, "_mpidag_frames",
    "frame 0's encoder and decoder in C (see mpidag/transport/frames.py)", -1, methods,
};

PyMODINIT_FUNC PyInit__mpidag_frames(void)
{
    PyObject *module = PyModule_Create(&frames_module);
    /* what frames.py expects (CODEC_VERSION): a build from older sources is not used */
    if (module != NULL && PyModule_AddIntConstant(module, "VERSION", 5) < 0)
        Py_CLEAR(module);
    return module;
}
