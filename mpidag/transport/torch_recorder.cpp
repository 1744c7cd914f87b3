// ContextRecorder: what distributed autograd does for every message of a context and for a
// context's life, in C++ (part of _mpidag_torch; see torch_native.cpp for the rest).
//
// mpidag.dist_autograd.context.ContextContainer is the agent's call observer: the agent (its
// compiled call path and its Python one) calls outgoing/sent on the caller, received at
// dispatch, serving/served around the served function, replying/sent for a result; a
// context is made by new_context (the caller's `with`) or incoming (the first message on
// another rank) and dropped by release (the `with` block's end) and release_id (the
// autograd.release message). Where this module is built, the container's class has
// ContextRecorder as its first base: those ten methods are this type's, working on the
// container's own Python objects (its context table, lock and released ids, the
// thread-local current context, the contexts' dicts and sets under their locks, the
// IdGenerator's counter), so the tables Python reads (the engine, debug_info,
// _send_functions, ...) stay the only ones. A DistAutogradContext, a SendFunction and a
// RecvRecord are made through their slots (checked at binding against what new_ctx,
// new_send and new_record fill); `sent` walks the graph behind a send function as
// SendFunction.prepare does (send_reach of the other translation unit, the Reach made
// through its slots); the release message goes by the agent's compiled notify.
//
// Anything rare goes to the container's Python methods, which it inherits: a late message
// of a released context (_late logs it), the recv of a message under a functorch transform
// (record_recv), a custom Function's node to walk (SendFunction.prepare), a walk that
// fails (_unprepared logs it), and a release message the compiled notify does not take
// (_tell_released: no compiled path, a closed agent, a failed peer, a first message).
// _bind_recorder(...) hands the recorder the objects it works on, once, from the
// container's __init__; an unbound recorder refuses every call.

#include <torch/csrc/python_headers.h>

#include <torch/csrc/autograd/python_variable.h>

#include <structmember.h>

#include <array>

#include "slots.h"
#include "torch_records.h"

namespace {

// interned names
PyObject *s_ctx, *s_acquire, *s_release, *s_record_recv, *s_prepare,
    *s_unprepared, *s_requires_grad, *s_next, *s_active, *s_append, *s_late,
    *s_tell_released, *s_ticket;

enum Ref {
  R_CONTEXTS,       // dict: context id -> DistAutogradContext (the container's `contexts`)
  R_CURRENT,        // the threading.local whose `ctx` is the thread's context
  R_IDS,            // the agent's IdGenerator (its next() raises the overflow)
  R_COUNTER,        // its itertools.count
  R_SEND_TYPE,      // SendFunction
  R_RECORD_TYPE,    // RecvRecord
  R_LIVE_SENDS,     // LiveCount of the send functions
  R_LIVE_RECVS,     // LiveCount of the recv records
  R_NATIVE,         // this module (the send functions' `native`)
  R_FUNCTORCH,      // torch._C._are_functorch_transforms_active
  R_CALL,           // the kind of a call (mpidag.agent.messages.CALL)
  R_PARAMETER,      // torch.nn.Parameter
  R_ZEROS,          // (0, 0)
  // member descriptors (slots) of Envelope, DistAutogradContext and RecvRecord
  R_ENV_CONTEXT_ID, R_ENV_SRC, R_ENV_MESSAGE_ID, R_ENV_KIND, R_ENV_TENSORS,
  R_CTX_CONTAINER, R_CTX_CONTEXT_ID, R_CTX_RELEASED, R_CTX_LOCK, R_CTX_KNOWN, R_CTX_SENDS,
  R_CTX_RECVS,
  R_RECORD_WHAT, R_RECORD_TICKET, R_RECORD_NODE, R_RECORD_CONTEXT_ID, R_RECORD_MESSAGE_ID,
  R_RECORD_PEER, R_RECORD_N_OUTPUTS,
  R_SEND_WALKING, R_SEND_TENSORS, R_SEND_EDGES, R_SEND_REACH, R_SEND_WHAT, R_SEND_TICKET,
  R_SEND_MESSAGE_ID, R_SEND_PEER, R_SEND_NATIVE,
  R_REACH_SUCC, R_REACH_LEAF_EDGES, R_REACH_RECV_EDGES, R_REACH_RECV_NODES,
  // what a send function's walk needs (SendFunction.prepare's edges_and_reach)
  R_EDGE_TYPE,      // torch.autograd.graph.GradientEdge
  R_RECV_TYPES,     // frozenset of the recv node types
  R_ACCUMULATE,     // AccumulateGrad's node type
  R_REACH_TYPE,     // mpidag.dist_autograd.graph.Reach
  // the contexts' life (new_context, incoming, release, release_id)
  R_LOCK,           // the container's lock (its context table and released ids)
  R_RELEASED,       // deque of the released context ids (oldest first)
  R_RELEASED_SET,   // set of the same ids
  R_CTX_TYPE,       // DistAutogradContext
  R_ALLOCATE_LOCK,  // what makes a context's lock: this module's Lock type
  R_CTX_GRADIENTS, R_CTX_PASSES,
  R_RANK,           // this rank (an int)
  R_WALKING_LOCK,   // what makes a send function's walking lock (Lock, or a test's)
  // the release message (release_ctx): the agent's compiled notify(dst, func, args) -> True
  // when it sent the message (else None: the Python _tell_released sends it), or None
  R_NOTIFY,
  R_RELEASE_HANDLER,  // the autograd.release handler (its message's function)
  N_REFS
};

struct ContextRecorder {
  PyObject_HEAD
  PyObject* refs[N_REFS];
  long long id_base;  // this rank's bits of every id
  long long id_max;   // the largest counter value
  Py_ssize_t released_memory;  // how many released ids are remembered (the deque's maxlen)
};

// ------------------------------------------------------------------------------ helpers
int unbound(ContextRecorder* self) {
  if (self->refs[R_CONTEXTS] != nullptr) return 0;
  PyErr_SetString(PyExc_RuntimeError,
                  "this ContextRecorder was never bound (_bind_recorder: the context "
                  "container's __init__ binds it)");
  return 1;
}

// obj's slot (a new reference), or nullptr with an error (AttributeError if unset);
// straight at its offset (slots.h)
PyObject* get(ContextRecorder* self, Ref descr, PyObject* obj) {
  return mpidag_slot_get(self->refs[descr], obj);
}

int set(ContextRecorder* self, Ref descr, PyObject* obj, PyObject* value) {
  return mpidag_slot_set(self->refs[descr], obj, value);
}

// whether a tensor requires grad: read from the C++ tensor for torch.Tensor and
// nn.Parameter, the Python attribute for anything else (a subclass may override it);
// -1: error
int requires_grad(ContextRecorder* self, PyObject* t) {
  if (THPVariable_CheckExact(t) || Py_TYPE(t) == reinterpret_cast<PyTypeObject*>(
                                                     self->refs[R_PARAMETER])) {
    return THPVariable_Unpack(t).requires_grad() ? 1 : 0;
  }
  PyObject* flag = PyObject_GetAttr(t, s_requires_grad);
  if (flag == nullptr) return -1;
  int truth = PyObject_IsTrue(flag);
  Py_DECREF(flag);
  return truth;
}

// a new id of this rank: what IdGenerator.next() returns
PyObject* next_id(ContextRecorder* self) {
  PyObject* value = PyIter_Next(self->refs[R_COUNTER]);
  if (value == nullptr) {
    if (!PyErr_Occurred())
      PyErr_SetString(PyExc_RuntimeError, "the id counter stopped");
    return nullptr;
  }
  long long counter = PyLong_AsLongLong(value);
  Py_DECREF(value);
  if (counter == -1 && PyErr_Occurred()) return nullptr;
  if (counter > self->id_max)  // exhausted: IdGenerator.next() says so
    return PyObject_CallMethodNoArgs(self->refs[R_IDS], s_next);
  return PyLong_FromLongLong(self->id_base | counter);
}

// ------------------------------------------------------------------------ Lock
// _mpidag_torch.Lock: threading.Lock's interface (acquire(blocking=True, timeout=-1),
// release, locked, with), for the locks this module takes on every recorded message (the
// container's, each context's, each send function's walking lock): taken here by a C call
// instead of a method call whose arguments are parsed (threading.Lock's acquire: ~450
// instructions from C, ~40 here). A wait releases the GIL; signals are handled during it
// as threading.Lock's are.
struct Lock {
  PyObject_HEAD
  PyThread_type_lock lock;
  bool locked;
};

PyTypeObject lock_type = {PyVarObject_HEAD_INIT(nullptr, 0)};

// take it, waiting up to timeout_us (-1: for ever, 0: not at all): 1 taken, 0 not, -1 error
int lock_take(Lock* self, PY_TIMEOUT_T timeout_us) {
  PyLockStatus r = PyThread_acquire_lock_timed(self->lock, 0, 0);
  if (r != PY_LOCK_ACQUIRED && timeout_us != 0) {
    do {
      Py_BEGIN_ALLOW_THREADS
      r = PyThread_acquire_lock_timed(self->lock, timeout_us, 1);
      Py_END_ALLOW_THREADS
      // a signal: its Python handler runs here (an exception ends the wait)
      if (r == PY_LOCK_INTR && Py_MakePendingCalls() < 0) return -1;
    } while (r == PY_LOCK_INTR);  // (a timed wait starts again with its whole timeout)
  }
  if (r != PY_LOCK_ACQUIRED) return 0;
  self->locked = true;
  return 1;
}

int lock_give(Lock* self) {
  if (!self->locked) {
    PyErr_SetString(PyExc_RuntimeError, "release unlocked lock");
    return -1;
  }
  self->locked = false;
  PyThread_release_lock(self->lock);
  return 0;
}

PyObject* lock_new(PyTypeObject* type, PyObject* args, PyObject* kwargs) {
  if (PyTuple_GET_SIZE(args) != 0 || (kwargs != nullptr && PyDict_GET_SIZE(kwargs) != 0)) {
    PyErr_SetString(PyExc_TypeError, "Lock() takes no arguments");
    return nullptr;
  }
  auto* self = reinterpret_cast<Lock*>(type->tp_alloc(type, 0));
  if (self == nullptr) return nullptr;
  self->lock = PyThread_allocate_lock();
  self->locked = false;
  if (self->lock == nullptr) {
    Py_DECREF(self);
    PyErr_SetString(PyExc_MemoryError, "cannot allocate a lock");
    return nullptr;
  }
  return reinterpret_cast<PyObject*>(self);
}

void lock_dealloc(PyObject* obj) {
  auto* self = reinterpret_cast<Lock*>(obj);
  if (self->lock != nullptr) {
    if (self->locked) PyThread_release_lock(self->lock);
    PyThread_free_lock(self->lock);
  }
  Py_TYPE(obj)->tp_free(obj);
}

// acquire(blocking=True, timeout=-1) -> bool, as threading.Lock's
PyObject* lock_acquire(PyObject* obj, PyObject* const* args, Py_ssize_t nargs,
                       PyObject* kwnames) {
  PyObject* given[2] = {nullptr, nullptr};
  static const char* names[2] = {"blocking", "timeout"};
  if (nargs > 2) {
    PyErr_SetString(PyExc_TypeError, "acquire() takes at most 2 arguments");
    return nullptr;
  }
  for (Py_ssize_t i = 0; i < nargs; i++) given[i] = args[i];
  Py_ssize_t nkw = kwnames != nullptr ? PyTuple_GET_SIZE(kwnames) : 0;
  for (Py_ssize_t k = 0; k < nkw; k++) {
    PyObject* key = PyTuple_GET_ITEM(kwnames, k);
    int i = PyUnicode_CompareWithASCIIString(key, names[0]) == 0   ? 0
            : PyUnicode_CompareWithASCIIString(key, names[1]) == 0 ? 1
                                                                   : -1;
    if (i < 0 || given[i] != nullptr) {
      PyErr_Format(PyExc_TypeError, "acquire() got an unexpected or repeated argument %R",
                   key);
      return nullptr;
    }
    given[i] = args[nargs + k];
  }
  int blocking = given[0] == nullptr ? 1 : PyObject_IsTrue(given[0]);
  if (blocking < 0) return nullptr;
  double timeout = given[1] == nullptr ? -1.0 : PyFloat_AsDouble(given[1]);
  if (timeout == -1.0 && PyErr_Occurred()) return nullptr;
  if (!blocking && timeout != -1.0) {
    PyErr_SetString(PyExc_ValueError, "can't specify a timeout for a non-blocking call");
    return nullptr;
  }
  if (timeout < 0 && timeout != -1.0) {
    PyErr_SetString(PyExc_ValueError, "timeout value must be positive");
    return nullptr;
  }
  PY_TIMEOUT_T us = -1;
  if (!blocking) {
    us = 0;
  } else if (timeout >= 0) {
    if (timeout * 1e6 >= static_cast<double>(PY_TIMEOUT_MAX)) {
      PyErr_SetString(PyExc_OverflowError, "timeout value is too large");
      return nullptr;
    }
    us = static_cast<PY_TIMEOUT_T>(timeout * 1e6);
  }
  int taken = lock_take(reinterpret_cast<Lock*>(obj), us);
  if (taken < 0) return nullptr;
  return PyBool_FromLong(taken);
}

PyObject* lock_enter(PyObject* obj, PyObject*) {
  if (lock_take(reinterpret_cast<Lock*>(obj), -1) < 0) return nullptr;
  Py_RETURN_TRUE;
}

PyObject* lock_release(PyObject* obj, PyObject*) {
  if (lock_give(reinterpret_cast<Lock*>(obj)) < 0) return nullptr;
  Py_RETURN_NONE;
}

PyObject* lock_exit(PyObject* obj, PyObject* const*, Py_ssize_t) {
  return lock_release(obj, nullptr);
}

PyObject* lock_locked(PyObject* obj, PyObject*) {
  return PyBool_FromLong(reinterpret_cast<Lock*>(obj)->locked);
}

PyObject* lock_repr(PyObject* obj) {
  return PyUnicode_FromFormat("<%s _mpidag_torch.Lock object at %p>",
                              reinterpret_cast<Lock*>(obj)->locked ? "locked" : "unlocked",
                              obj);
}

PyMethodDef lock_methods[] = {
    {"acquire", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(lock_acquire)),
     METH_FASTCALL | METH_KEYWORDS,
     "acquire(blocking=True, timeout=-1) -> bool: take the lock (as threading.Lock's)"},
    {"release", lock_release, METH_NOARGS, "release(): give the lock back"},
    {"locked", lock_locked, METH_NOARGS, "locked() -> bool: whether it is taken"},
    {"__enter__", lock_enter, METH_NOARGS, "take the lock, waiting as long as it takes"},
    {"__exit__", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(lock_exit)),
     METH_FASTCALL, "give the lock back"},
    {nullptr, nullptr, 0, nullptr}};

// lock.acquire() (0), or -1: a C call for this module's Lock, the method for any other
// (a threading.Lock, or what a test injects)
int acquire(PyObject* lock) {
  if (Py_IS_TYPE(lock, &lock_type))
    return lock_take(reinterpret_cast<Lock*>(lock), -1) < 0 ? -1 : 0;
  PyObject* held = PyObject_CallMethodNoArgs(lock, s_acquire);
  Py_XDECREF(held);
  return held == nullptr ? -1 : 0;
}

// lock.release(), keeping the error of what ran under it (rc < 0); returns rc, or -1
int release(PyObject* lock, int rc) {
  PyObject *type = nullptr, *value = nullptr, *tb = nullptr;
  if (Py_IS_TYPE(lock, &lock_type) && reinterpret_cast<Lock*>(lock)->locked) {
    lock_give(reinterpret_cast<Lock*>(lock));  // (cannot fail here; rc's error stays set)
    return rc;
  }
  if (rc < 0) PyErr_Fetch(&type, &value, &tb);
  PyObject* freed = PyObject_CallMethodNoArgs(lock, s_release);
  if (freed == nullptr) {
    Py_XDECREF(type);
    Py_XDECREF(value);
    Py_XDECREF(tb);
    return -1;
  }
  Py_DECREF(freed);
  if (type != nullptr) PyErr_Restore(type, value, tb);
  return rc;
}

// one slot of an object made through its slots, and its value (a new reference, stolen)
struct Field {
  Ref slot;
  PyObject* value;
};

// a new object of the type refs[type_ref] with exactly `fields` set, as its __init__ sets
// them (the slot lists are checked at binding); nullptr with the error if making a value
// failed (a nullptr value) or setting one did. The values are stolen either way.
template <size_t N>
PyObject* through_slots(ContextRecorder* self, Ref type_ref, Field (&fields)[N]) {
  auto* type = reinterpret_cast<PyTypeObject*>(self->refs[type_ref]);
  bool made = true;
  for (auto& field : fields) made = made && field.value != nullptr;
  PyObject* obj = made ? type->tp_alloc(type, 0) : nullptr;
  int rc = obj == nullptr ? -1 : 0;
  for (auto& field : fields) {
    if (rc == 0 && set(self, field.slot, obj, field.value) < 0) rc = -1;
    Py_XDECREF(field.value);
  }
  if (rc < 0) Py_CLEAR(obj);
  return obj;
}

// a new DistAutogradContext(self, context_id), made through its slots
PyObject* new_ctx(ContextRecorder* self, PyObject* context_id) {
  PyObject* lock = PyObject_CallNoArgs(self->refs[R_ALLOCATE_LOCK]);
  if (lock == nullptr) return nullptr;
  Field fields[] = {{R_CTX_CONTAINER, Py_NewRef(reinterpret_cast<PyObject*>(self))},
                    {R_CTX_CONTEXT_ID, Py_NewRef(context_id)}, {R_CTX_LOCK, lock},
                    {R_CTX_SENDS, PyDict_New()}, {R_CTX_RECVS, PyDict_New()},
                    {R_CTX_KNOWN, PySet_New(nullptr)}, {R_CTX_GRADIENTS, Py_NewRef(Py_None)},
                    {R_CTX_PASSES, PyDict_New()}, {R_CTX_RELEASED, Py_NewRef(Py_False)}};
  return through_slots(self, R_CTX_TYPE, fields);
}

// a new SendFunction(message_id, dst, tensors, what, live_sends, native), made through its
// slots: counted among the live send functions, its walking lock made by refs[R_WALKING_LOCK]
PyObject* new_send(ContextRecorder* self, PyObject* message_id, PyObject* dst,
                   PyObject* tensors, PyObject* what) {
  PyObject* ticket = PyObject_CallMethodNoArgs(self->refs[R_LIVE_SENDS], s_ticket);
  if (ticket == nullptr) return nullptr;
  PyObject* walking = PyObject_CallNoArgs(self->refs[R_WALKING_LOCK]);
  if (walking == nullptr) {
    Py_DECREF(ticket);
    return nullptr;
  }
  Field fields[] = {{R_SEND_TICKET, ticket}, {R_SEND_NATIVE, Py_NewRef(self->refs[R_NATIVE])},
                    {R_SEND_MESSAGE_ID, Py_NewRef(message_id)}, {R_SEND_PEER, Py_NewRef(dst)},
                    {R_SEND_TENSORS, Py_NewRef(tensors)}, {R_SEND_EDGES, PyList_New(0)},
                    {R_SEND_WHAT, Py_NewRef(what)}, {R_SEND_REACH, Py_NewRef(Py_None)},
                    {R_SEND_WALKING, walking}};
  return through_slots(self, R_SEND_TYPE, fields);
}

// a new RecvRecord(context_id, message_id, src, 0, what, live_recvs), made through its
// slots (record_recv of the other translation unit sets its node and outputs)
PyObject* new_record(ContextRecorder* self, PyObject* context_id, PyObject* message_id,
                     PyObject* src, PyObject* what) {
  PyObject* ticket = PyObject_CallMethodNoArgs(self->refs[R_LIVE_RECVS], s_ticket);
  if (ticket == nullptr) return nullptr;
  PyObject* zero = PyTuple_GET_ITEM(self->refs[R_ZEROS], 0);
  Field fields[] = {{R_RECORD_TICKET, ticket}, {R_RECORD_NODE, Py_NewRef(Py_None)},
                    {R_RECORD_CONTEXT_ID, Py_NewRef(context_id)},
                    {R_RECORD_MESSAGE_ID, Py_NewRef(message_id)},
                    {R_RECORD_PEER, Py_NewRef(src)}, {R_RECORD_N_OUTPUTS, Py_NewRef(zero)},
                    {R_RECORD_WHAT, Py_NewRef(what)}};
  return through_slots(self, R_RECORD_TYPE, fields);
}

// remember a released context id (under the container's lock): ContextContainer._remember
int remember(ContextRecorder* self, PyObject* context_id) {
  PyObject *released = self->refs[R_RELEASED], *ids = self->refs[R_RELEASED_SET];
  Py_ssize_t n = PyObject_Length(released);
  if (n < 0) return -1;
  if (n == self->released_memory) {
    PyObject* oldest = PySequence_GetItem(released, 0);
    int rc = oldest == nullptr ? -1 : PySet_Discard(ids, oldest);
    Py_XDECREF(oldest);
    if (rc < 0) return -1;
  }
  PyObject* done = PyObject_CallMethodOneArg(released, s_append, context_id);
  Py_XDECREF(done);
  return done == nullptr ? -1 : PySet_Add(ids, context_id);
}

// self.active = whether the container has a context (the agent reads it)
int set_active(PyObject* obj, bool active) {
  return PyObject_SetAttr(obj, s_active, active ? Py_True : Py_False);
}

// with ctx.lock: ctx.known_workers.add(worker); table[key] = value (table may be nullptr)
int locked_record(ContextRecorder* self, PyObject* ctx, PyObject* worker, Ref table_descr,
                  PyObject* key, PyObject* value) {
  PyObject* lock = get(self, R_CTX_LOCK, ctx);
  if (lock == nullptr) return -1;
  PyObject* known = get(self, R_CTX_KNOWN, ctx);
  PyObject* table = known != nullptr && key != nullptr ? get(self, table_descr, ctx) : nullptr;
  if (known == nullptr || (key != nullptr && table == nullptr)) {
    Py_DECREF(lock);
    Py_XDECREF(known);
    return -1;
  }
  int rc = acquire(lock);
  if (rc == 0) {
    rc = worker == nullptr ? 0 : PySet_Add(known, worker);
    if (rc == 0 && key != nullptr) rc = PyDict_SetItem(table, key, value);
    rc = release(lock, rc);
  }
  Py_DECREF(lock);
  Py_DECREF(known);
  Py_XDECREF(table);
  return rc;
}

// ContextContainer.record_send: (context_id, message_id) of a message to dst in ctx (None:
// no context), a SendFunction of the tensors that require grad kept under a new message id
PyObject* record_send(ContextRecorder* self, PyObject* ctx, PyObject* dst, PyObject* tensors,
                      PyObject* what) {
  if (ctx == Py_None) return Py_NewRef(self->refs[R_ZEROS]);
  PyObject* released = get(self, R_CTX_RELEASED, ctx);
  if (released == nullptr) return nullptr;
  int is_released = PyObject_IsTrue(released);
  Py_DECREF(released);
  if (is_released < 0) return nullptr;
  if (is_released) return Py_NewRef(self->refs[R_ZEROS]);
  PyObject* seq = PySequence_Fast(tensors, "the tensors of a message must be a sequence");
  if (seq == nullptr) return nullptr;
  Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
  PyObject** items = PySequence_Fast_ITEMS(seq);
  PyObject* grad = PyList_New(0);
  if (grad == nullptr) {
    Py_DECREF(seq);
    return nullptr;
  }
  for (Py_ssize_t i = 0; i < n; i++) {
    int wants = requires_grad(self, items[i]);
    if (wants < 0 || (wants && PyList_Append(grad, items[i]) < 0)) {
      Py_DECREF(seq);
      Py_DECREF(grad);
      return nullptr;
    }
  }
  Py_DECREF(seq);
  PyObject* context_id = get(self, R_CTX_CONTEXT_ID, ctx);
  if (context_id == nullptr) {
    Py_DECREF(grad);
    return nullptr;
  }
  PyObject* result = nullptr;
  if (PyList_GET_SIZE(grad) == 0) {  // only the context travels: no send function
    if (locked_record(self, ctx, dst, R_CTX_SENDS, nullptr, nullptr) == 0) {
      PyObject* zero = PyTuple_GET_ITEM(self->refs[R_ZEROS], 1);
      result = PyTuple_Pack(2, context_id, zero);
    }
  } else {
    PyObject* message_id = next_id(self);
    if (message_id != nullptr) {
      PyObject* send = new_send(self, message_id, dst, grad, what);
      if (send != nullptr &&
          locked_record(self, ctx, dst, R_CTX_SENDS, message_id, send) == 0)
        result = PyTuple_Pack(2, context_id, message_id);
      Py_XDECREF(send);
      Py_DECREF(message_id);
    }
  }
  Py_DECREF(context_id);
  Py_DECREF(grad);
  return result;
}

// ContextContainer.record_recv's common case: the tensors as received in ctx (a new
// reference), those that require grad made outputs of one new recv node
PyObject* record_recv(ContextRecorder* self, PyObject* container, PyObject* ctx,
                      PyObject* message_id, PyObject* src, PyObject* tensors,
                      PyObject* what) {
  PyObject* functorch = PyObject_CallNoArgs(self->refs[R_FUNCTORCH]);
  if (functorch == nullptr) return nullptr;
  int transformed = PyObject_IsTrue(functorch);
  Py_DECREF(functorch);
  if (transformed < 0) return nullptr;
  if (transformed || !PyList_Check(tensors))  // the Python records (RecvRPC.apply)
    return PyObject_CallMethodObjArgs(container, s_record_recv, ctx, message_id, src,
                                      tensors, what, nullptr);
  int any = 0;
  for (Py_ssize_t i = 0; i < PyList_GET_SIZE(tensors) && !any; i++) {
    PyObject* t = PyList_GET_ITEM(tensors, i);
    if (!THPVariable_Check(t))  // record_recv's own error
      return PyObject_CallMethodObjArgs(container, s_record_recv, ctx, message_id, src,
                                        tensors, what, nullptr);
    any = requires_grad(self, t);
    if (any < 0) return nullptr;
  }
  if (!any) return Py_NewRef(tensors);  // nothing to record
  PyObject* context_id = get(self, R_CTX_CONTEXT_ID, ctx);
  if (context_id == nullptr) return nullptr;
  PyObject* record = new_record(self, context_id, message_id, src, what);
  Py_DECREF(context_id);
  if (record == nullptr) return nullptr;
  PyObject* recv_args[2] = {record, tensors};
  PyObject* result = mpidag::record_recv(nullptr, recv_args, 2);
  if (result != nullptr &&
      locked_record(self, ctx, nullptr, R_CTX_RECVS, message_id, record) < 0)
    Py_CLEAR(result);
  Py_DECREF(record);
  return result;
}

// ContextContainer.incoming: the context a message from src belongs to, made if new (a
// new reference; None: released)
PyObject* incoming_ctx(ContextRecorder* self, PyObject* context_id, PyObject* src) {
  PyObject* contexts = self->refs[R_CONTEXTS];
  PyObject* ctx = PyDict_GetItemWithError(contexts, context_id);
  if (ctx == nullptr) {
    if (PyErr_Occurred() || acquire(self->refs[R_LOCK]) < 0) return nullptr;
    int rc = 0;
    ctx = PyDict_GetItemWithError(contexts, context_id);
    Py_XINCREF(ctx);
    if (ctx == nullptr && !PyErr_Occurred()) {
      int late = PySet_Contains(self->refs[R_RELEASED_SET], context_id);
      if (late > 0) {
        ctx = Py_NewRef(Py_None);
      } else if (late == 0) {
        ctx = new_ctx(self, context_id);
        if (ctx != nullptr && (PyDict_SetItem(contexts, context_id, ctx) < 0 ||
                               set_active(reinterpret_cast<PyObject*>(self), true) < 0))
          Py_CLEAR(ctx);
      }
    }
    if (ctx == nullptr) rc = -1;
    if (release(self->refs[R_LOCK], rc) < 0) {
      Py_XDECREF(ctx);
      return nullptr;
    }
    if (ctx == Py_None) {  // a late message of a released context: logged, not recorded
      PyObject* logged = PyObject_CallMethodObjArgs(reinterpret_cast<PyObject*>(self), s_late,
                                                    context_id, src, nullptr);
      Py_XDECREF(logged);
      if (logged == nullptr) Py_CLEAR(ctx);
      return ctx;
    }
  } else {
    Py_INCREF(ctx);
  }
  PyObject* known = get(self, R_CTX_KNOWN, ctx);
  int is_known = known == nullptr ? -1 : PySet_Contains(known, src);
  Py_XDECREF(known);
  if (is_known == 0)  // (an answer's sender is known: the call went there)
    is_known = locked_record(self, ctx, src, R_CTX_SENDS, nullptr, nullptr);
  if (is_known < 0) Py_CLEAR(ctx);
  return ctx;
}

// the release of context_id to each of `peers` but from_rank (it told this one) and this
// rank, by the agent's compiled notify where it takes the message: a new list of the ranks
// it did not take (no compiled path, a closed agent, a failed peer, an error: the Python
// _tell_released sends or skips those, and logs what fails), or nullptr with an error
PyObject* tell_released(ContextRecorder* self, PyObject* context_id, PyObject* peers,
                        PyObject* from_rank) {
  PyObject *notify = self->refs[R_NOTIFY], *args = nullptr;
  PyObject* rest = PyList_New(0);
  for (Py_ssize_t i = 0; rest != nullptr && i < PyList_GET_SIZE(peers); i++) {
    PyObject* peer = PyList_GET_ITEM(peers, i);
    int skip = PyObject_RichCompareBool(peer, from_rank, Py_EQ);
    if (skip == 0) skip = PyObject_RichCompareBool(peer, self->refs[R_RANK], Py_EQ);
    if (skip != 0) {
      if (skip < 0) Py_CLEAR(rest);
      continue;
    }
    PyObject* sent = nullptr;
    if (notify != Py_None) {
      if (args == nullptr) args = PyTuple_Pack(2, context_id, self->refs[R_RANK]);
      if (args == nullptr) {
        Py_CLEAR(rest);
        continue;
      }
      PyObject* argv[3] = {peer, self->refs[R_RELEASE_HANDLER], args};
      sent = PyObject_Vectorcall(notify, argv, 3, nullptr);
      if (sent == nullptr) PyErr_Clear();  // (Python tries again and logs the error)
    }
    if (sent != Py_True && PyList_Append(rest, peer) < 0) Py_CLEAR(rest);
    Py_XDECREF(sent);
  }
  Py_XDECREF(args);
  return rest;
}

// ContextContainer.release: drop ctx here; then tell the ranks it exchanged messages with,
// but from_rank
PyObject* release_ctx(ContextRecorder* self, PyObject* ctx, PyObject* from_rank) {
  PyObject* obj = reinterpret_cast<PyObject*>(self);
  PyObject* contexts = self->refs[R_CONTEXTS];
  PyObject* context_id = get(self, R_CTX_CONTEXT_ID, ctx);
  if (context_id == nullptr) return nullptr;
  if (acquire(self->refs[R_LOCK]) < 0) {
    Py_DECREF(context_id);
    return nullptr;
  }
  PyObject* current = PyDict_GetItemWithError(contexts, context_id);
  int rc = current == nullptr && PyErr_Occurred() ? -1 : 0;
  bool ours = current == ctx;
  if (rc == 0 && ours) {
    rc = PyDict_DelItem(contexts, context_id);
    if (rc == 0) rc = set_active(obj, PyDict_GET_SIZE(contexts) > 0);
    if (rc == 0) rc = remember(self, context_id);
  }
  if (release(self->refs[R_LOCK], rc) < 0 || !ours) {
    Py_DECREF(context_id);
    if (PyErr_Occurred()) return nullptr;
    Py_RETURN_NONE;
  }
  // with ctx.lock: released, the ranks to tell, the records dropped
  PyObject* lock = get(self, R_CTX_LOCK, ctx);
  PyObject* peers = nullptr;
  if (lock != nullptr && acquire(lock) == 0) {
    rc = set(self, R_CTX_RELEASED, ctx, Py_True);
    PyObject* known = rc == 0 ? get(self, R_CTX_KNOWN, ctx) : nullptr;
    peers = known != nullptr ? PySequence_List(known) : nullptr;
    Py_XDECREF(known);
    rc = peers == nullptr || PyList_Sort(peers) < 0 ? -1 : 0;
    const Ref tables[3] = {R_CTX_SENDS, R_CTX_RECVS, R_CTX_PASSES};
    for (int i = 0; i < 3 && rc == 0; i++) {
      PyObject* table = get(self, tables[i], ctx);
      if (table == nullptr) {
        rc = -1;
      } else {
        if (PyDict_Check(table)) PyDict_Clear(table);  // (frees the graph's records)
        Py_DECREF(table);
      }
    }
    if (release(lock, rc) < 0) Py_CLEAR(peers);
  }
  Py_XDECREF(lock);
  PyObject* rest = peers != nullptr ? tell_released(self, context_id, peers, from_rank)
                                    : nullptr;
  Py_XDECREF(peers);
  PyObject* result = nullptr;
  if (rest != nullptr) {
    result = PyList_GET_SIZE(rest) == 0
        ? Py_NewRef(Py_None)
        : PyObject_CallMethodObjArgs(obj, s_tell_released, context_id, rest, from_rank,
                                     nullptr);
    Py_DECREF(rest);
  }
  Py_DECREF(context_id);
  return result;
}

int check_args(Py_ssize_t nargs, Py_ssize_t want, const char* signature) {
  if (nargs == want) return 0;
  PyErr_Format(PyExc_TypeError, "%s takes %zd arguments (%zd given)", signature, want, nargs);
  return -1;
}

// ------------------------------------------------------------------------------ methods
// outgoing(dst, tensors, what) -> (context_id, message_id)
PyObject* outgoing(PyObject* obj, PyObject* const* args, Py_ssize_t nargs) {
  auto* self = reinterpret_cast<ContextRecorder*>(obj);
  if (check_args(nargs, 3, "outgoing(dst, tensors, what)") < 0 || unbound(self))
    return nullptr;
  PyObject* ctx = PyObject_GetAttr(self->refs[R_CURRENT], s_ctx);
  if (ctx == nullptr) return nullptr;
  PyObject* result;
  if (ctx == Py_None) {
    result = Py_NewRef(self->refs[R_ZEROS]);
  } else {
    PyObject* container = get(self, R_CTX_CONTAINER, ctx);
    if (container == nullptr) {
      result = nullptr;
    } else {
      result = container == obj ? record_send(self, ctx, args[0], args[1], args[2])
                                : Py_NewRef(self->refs[R_ZEROS]);
      Py_DECREF(container);
    }
  }
  Py_DECREF(ctx);
  return result;
}

// replying(context_id, dst, tensors, what) -> message_id
PyObject* replying(PyObject* obj, PyObject* const* args, Py_ssize_t nargs) {
  auto* self = reinterpret_cast<ContextRecorder*>(obj);
  if (check_args(nargs, 4, "replying(context_id, dst, tensors, what)") < 0 || unbound(self))
    return nullptr;
  PyObject* ctx = PyDict_GetItemWithError(self->refs[R_CONTEXTS], args[0]);
  if (ctx == nullptr && PyErr_Occurred()) return nullptr;
  Py_XINCREF(ctx);
  PyObject* ids = record_send(self, ctx != nullptr ? ctx : Py_None, args[1], args[2], args[3]);
  Py_XDECREF(ctx);
  if (ids == nullptr) return nullptr;
  PyObject* message_id = Py_NewRef(PyTuple_GET_ITEM(ids, 1));
  Py_DECREF(ids);
  return message_id;
}

// received(env, what) -> the message's context, or None (released)
PyObject* received(PyObject* obj, PyObject* const* args, Py_ssize_t nargs) {
  auto* self = reinterpret_cast<ContextRecorder*>(obj);
  if (check_args(nargs, 2, "received(env, what)") < 0 || unbound(self)) return nullptr;
  PyObject *env = args[0], *what = args[1];
  PyObject* context_id = get(self, R_ENV_CONTEXT_ID, env);
  PyObject* src = context_id != nullptr ? get(self, R_ENV_SRC, env) : nullptr;
  if (src == nullptr) {
    Py_XDECREF(context_id);
    return nullptr;
  }
  PyObject* ctx = PyDict_GetItemWithError(self->refs[R_CONTEXTS], context_id);
  int known = 0;
  if (ctx != nullptr) {
    Py_INCREF(ctx);
    PyObject* workers = get(self, R_CTX_KNOWN, ctx);
    known = workers == nullptr ? -1 : PySet_Contains(workers, src);
    Py_XDECREF(workers);
  } else if (PyErr_Occurred()) {
    known = -1;
  }
  if (known == 0) {  // new here, or from a new peer
    Py_XDECREF(ctx);
    ctx = incoming_ctx(self, context_id, src);
  }
  Py_DECREF(context_id);
  if (known < 0 || ctx == nullptr) {
    Py_XDECREF(ctx);
    Py_DECREF(src);
    return nullptr;
  }
  PyObject* message_id = ctx != Py_None ? get(self, R_ENV_MESSAGE_ID, env) : nullptr;
  int recorded = message_id == nullptr ? (ctx != Py_None ? -1 : 0)
                                       : PyObject_IsTrue(message_id);
  if (recorded > 0) {
    // a call's name is kept uncalled (serving names its record once unpickled); any other
    // name may hold the message (an answer's holds the pending call): called now
    PyObject* kind = get(self, R_ENV_KIND, env);
    int is_call = kind == nullptr ? -1 : PyObject_RichCompareBool(kind, self->refs[R_CALL],
                                                                  Py_EQ);
    Py_XDECREF(kind);
    PyObject* name = is_call < 0 ? nullptr : is_call ? Py_NewRef(what)
                                                     : PyObject_CallNoArgs(what);
    PyObject* tensors = name != nullptr ? get(self, R_ENV_TENSORS, env) : nullptr;
    PyObject* result = tensors != nullptr
        ? record_recv(self, obj, ctx, message_id, src, tensors, name) : nullptr;
    if (result == nullptr || (result != tensors && set(self, R_ENV_TENSORS, env, result) < 0))
      recorded = -1;
    Py_XDECREF(result);
    Py_XDECREF(tensors);
    Py_XDECREF(name);
  }
  Py_XDECREF(message_id);
  Py_DECREF(src);
  if (recorded < 0) {
    Py_DECREF(ctx);
    return nullptr;
  }
  return ctx;
}

// serving(state, message_id, what) -> the thread's context before (for served)
PyObject* serving(PyObject* obj, PyObject* const* args, Py_ssize_t nargs) {
  auto* self = reinterpret_cast<ContextRecorder*>(obj);
  if (check_args(nargs, 3, "serving(state, message_id, what)") < 0 || unbound(self))
    return nullptr;
  PyObject *state = args[0], *message_id = args[1];
  int named = state == Py_None ? 0 : PyObject_IsTrue(message_id);
  if (named < 0) return nullptr;
  if (named) {  // the recv record named once its call is unpickled
    PyObject* recvs = get(self, R_CTX_RECVS, state);
    if (recvs == nullptr) return nullptr;
    PyObject* record = PyDict_GetItemWithError(recvs, message_id);
    Py_XINCREF(record);
    Py_DECREF(recvs);
    if (record == nullptr && PyErr_Occurred()) return nullptr;
    if (record != nullptr) {
      PyObject* name = PyObject_CallNoArgs(args[2]);
      int rc = name == nullptr ? -1 : set(self, R_RECORD_WHAT, record, name);
      Py_XDECREF(name);
      Py_DECREF(record);
      if (rc < 0) return nullptr;
    }
  }
  PyObject* previous = PyObject_GetAttr(self->refs[R_CURRENT], s_ctx);
  if (previous == nullptr) return nullptr;
  if (PyObject_SetAttr(self->refs[R_CURRENT], s_ctx, state) < 0) {
    Py_DECREF(previous);
    return nullptr;
  }
  return previous;
}

// served(token): the thread's context back to what serving() returned
PyObject* served(PyObject* obj, PyObject* token) {
  auto* self = reinterpret_cast<ContextRecorder*>(obj);
  if (unbound(self) || PyObject_SetAttr(self->refs[R_CURRENT], s_ctx, token) < 0)
    return nullptr;
  Py_RETURN_NONE;
}

// SendFunction.prepare's common case: the edges of the send function's tensors and the
// Reach of torch's C++ walk behind them, in one call of send_reach, under its lock; 1
// where Python must prepare it (a custom Function's node among the edges, or prepared
// already), 0 done, -1 error
int prepare(ContextRecorder* self, PyObject* send) {
  PyObject* lock = get(self, R_SEND_WALKING, send);
  if (lock == nullptr) return -1;
  if (acquire(lock) < 0) {
    Py_DECREF(lock);
    return -1;
  }
  int rc = 1;
  PyObject* tensors = get(self, R_SEND_TENSORS, send);
  if (tensors == nullptr) {
    rc = -1;
  } else if (tensors != Py_None) {
    PyObject* argv[4] = {tensors, self->refs[R_EDGE_TYPE], self->refs[R_RECV_TYPES],
                         self->refs[R_ACCUMULATE]};
    PyObject* found = mpidag::send_reach(nullptr, argv, 4);
    PyObject* walked = found != nullptr ? PyTuple_GET_ITEM(found, 1) : nullptr;
    if (found == nullptr) {
      rc = -1;
    } else if (walked != Py_None) {  // (None: Python walks it)
      auto* reach_type = reinterpret_cast<PyTypeObject*>(self->refs[R_REACH_TYPE]);
      PyObject* reach = reach_type->tp_alloc(reach_type, 0);
      const Ref parts[4] = {R_REACH_SUCC, R_REACH_LEAF_EDGES, R_REACH_RECV_EDGES,
                            R_REACH_RECV_NODES};
      rc = reach == nullptr ? -1 : 0;
      for (int i = 0; i < 4 && rc == 0; i++)
        rc = set(self, parts[i], reach, PyTuple_GET_ITEM(walked, i));
      if (rc == 0 && (set(self, R_SEND_EDGES, send, PyTuple_GET_ITEM(found, 0)) < 0 ||
                      set(self, R_SEND_REACH, send, reach) < 0 ||
                      set(self, R_SEND_TENSORS, send, Py_None) < 0))
        rc = -1;
      Py_XDECREF(reach);
      PyObject* what = rc == 0 ? get(self, R_SEND_WHAT, send) : nullptr;
      if (what != nullptr && !PyUnicode_Check(what)) {  // the name now: the callable may
        PyObject* name = PyObject_CallNoArgs(what);      // hold the call's arguments
        if (name == nullptr || set(self, R_SEND_WHAT, send, name) < 0) rc = -1;
        Py_XDECREF(name);
      } else if (what == nullptr) {
        rc = -1;
      }
      Py_XDECREF(what);
    }
    Py_XDECREF(found);
  }
  Py_XDECREF(tensors);
  rc = release(lock, rc);
  Py_DECREF(lock);
  return rc;
}

// sent(context_id, message_id): the send function just sent walks its graph (never raises
// for the walk: the backward pass walks it again and reports what fails)
PyObject* sent(PyObject* obj, PyObject* const* args, Py_ssize_t nargs) {
  auto* self = reinterpret_cast<ContextRecorder*>(obj);
  if (check_args(nargs, 2, "sent(context_id, message_id)") < 0 || unbound(self))
    return nullptr;
  PyObject* ctx = PyDict_GetItemWithError(self->refs[R_CONTEXTS], args[0]);
  if (ctx == nullptr) {
    if (PyErr_Occurred()) return nullptr;
    Py_RETURN_NONE;
  }
  Py_INCREF(ctx);
  PyObject* sends = get(self, R_CTX_SENDS, ctx);
  Py_DECREF(ctx);
  if (sends == nullptr) return nullptr;
  PyObject* send = PyDict_GetItemWithError(sends, args[1]);
  Py_XINCREF(send);
  Py_DECREF(sends);
  if (send == nullptr) {
    if (PyErr_Occurred()) return nullptr;
    Py_RETURN_NONE;
  }
  int rc = prepare(self, send);
  PyObject* reach = rc == 0 ? Py_NewRef(Py_None)
                  : rc > 0  ? PyObject_CallMethodNoArgs(send, s_prepare) : nullptr;
  if (reach == nullptr) {
    PyObject *type, *exc, *tb;
    PyErr_Fetch(&type, &exc, &tb);
    PyErr_NormalizeException(&type, &exc, &tb);
    if (exc != nullptr && tb != nullptr) PyException_SetTraceback(exc, tb);
    reach = exc == nullptr ? nullptr
                           : PyObject_CallMethodObjArgs(obj, s_unprepared, send, exc, nullptr);
    Py_XDECREF(type);
    Py_XDECREF(exc);
    Py_XDECREF(tb);
  }
  Py_DECREF(send);
  if (reach == nullptr) return nullptr;
  Py_DECREF(reach);
  Py_RETURN_NONE;
}

// incoming(context_id, src) -> the context, made if new; None: released
PyObject* incoming(PyObject* obj, PyObject* const* args, Py_ssize_t nargs) {
  auto* self = reinterpret_cast<ContextRecorder*>(obj);
  if (check_args(nargs, 2, "incoming(context_id, src)") < 0 || unbound(self)) return nullptr;
  return incoming_ctx(self, args[0], args[1]);
}

// new_context() -> a new context of this rank, in the table
PyObject* new_context(PyObject* obj, PyObject* /*unused*/) {
  auto* self = reinterpret_cast<ContextRecorder*>(obj);
  if (unbound(self)) return nullptr;
  PyObject* context_id = next_id(self);
  PyObject* ctx = context_id != nullptr ? new_ctx(self, context_id) : nullptr;
  if (ctx != nullptr) {
    int rc = acquire(self->refs[R_LOCK]);
    if (rc == 0) {
      rc = PyDict_SetItem(self->refs[R_CONTEXTS], context_id, ctx);
      if (rc == 0) rc = set_active(obj, true);
      rc = release(self->refs[R_LOCK], rc);
    }
    if (rc < 0) Py_CLEAR(ctx);
  }
  Py_XDECREF(context_id);
  return ctx;
}

// release(ctx, from_rank=None): drop ctx here and tell every rank it exchanged messages with
PyObject* release_method(PyObject* obj, PyObject* const* args, Py_ssize_t nargs,
                         PyObject* kwnames) {
  auto* self = reinterpret_cast<ContextRecorder*>(obj);
  static const char* usage = "release(ctx, from_rank=None)";
  Py_ssize_t n_kw = kwnames == nullptr ? 0 : PyTuple_GET_SIZE(kwnames);
  PyObject* from_rank = nargs > 1 ? args[1] : Py_None;
  if (nargs < 1 || nargs + n_kw > 2 ||
      (n_kw == 1 && PyUnicode_CompareWithASCIIString(PyTuple_GET_ITEM(kwnames, 0),
                                                     "from_rank") != 0)) {
    PyErr_Format(PyExc_TypeError, "%s: takes ctx and from_rank", usage);
    return nullptr;
  }
  if (n_kw == 1) from_rank = args[nargs];
  if (unbound(self)) return nullptr;
  if (!PyObject_TypeCheck(args[0], reinterpret_cast<PyTypeObject*>(self->refs[R_CTX_TYPE]))) {
    PyErr_Format(PyExc_TypeError, "%s: ctx must be a DistAutogradContext, got %R", usage,
                 Py_TYPE(args[0]));
    return nullptr;
  }
  return release_ctx(self, args[0], from_rank);
}

// release_id(context_id, from_rank): the context ended on from_rank (the autograd.release
// handler)
PyObject* release_id(PyObject* obj, PyObject* const* args, Py_ssize_t nargs) {
  auto* self = reinterpret_cast<ContextRecorder*>(obj);
  if (check_args(nargs, 2, "release_id(context_id, from_rank)") < 0 || unbound(self))
    return nullptr;
  PyObject* ctx = PyDict_GetItemWithError(self->refs[R_CONTEXTS], args[0]);
  if (ctx != nullptr) {
    Py_INCREF(ctx);
    PyObject* result = release_ctx(self, ctx, args[1]);
    Py_DECREF(ctx);
    return result;
  }
  if (PyErr_Occurred() || acquire(self->refs[R_LOCK]) < 0) return nullptr;
  if (release(self->refs[R_LOCK], remember(self, args[0])) < 0) return nullptr;
  Py_RETURN_NONE;
}

// the member descriptor cls.name, or nullptr with a TypeError (sources changed without a
// rebuild: the container then keeps its Python hooks)
PyObject* member(PyObject* cls, const char* name) {
  PyObject* d = PyObject_GetAttrString(cls, name);
  if (d == nullptr) return nullptr;
  if (mpidag_slot_check(d, reinterpret_cast<PyTypeObject*>(cls)->tp_name, name) < 0) {
    Py_DECREF(d);
    return nullptr;
  }
  return d;
}

// _bind_recorder(contexts, current, ids, SendFunction, RecvRecord, DistAutogradContext,
//                Envelope, live_sends, live_recvs, native, functorch_active, call_kind,
//                Parameter, GradientEdge, recv_types, AccumulateGrad, Reach, lock, released,
//                released_set, rank, walking_lock, notify, release_handler)
PyObject* bind_recorder(PyObject* obj, PyObject* args, PyObject* kwargs) {
  auto* self = reinterpret_cast<ContextRecorder*>(obj);
  static const char* names[] = {"contexts", "current", "ids", "SendFunction", "RecvRecord",
                                "DistAutogradContext", "Envelope", "live_sends",
                                "live_recvs", "native", "functorch_active", "call_kind",
                                "Parameter", "GradientEdge", "recv_types", "AccumulateGrad",
                                "Reach", "lock", "released", "released_set", "rank",
                                "walking_lock", "notify", "release_handler", nullptr};
  PyObject *contexts, *current, *ids, *send_type, *record_type, *ctx_type, *env_type,
      *live_sends, *live_recvs, *native, *functorch, *call_kind, *parameter, *edge_type,
      *recv_types, *accumulate, *reach_type, *lock, *released, *released_set, *rank,
      *walking_lock, *notify, *release_handler;
  if (!PyArg_ParseTupleAndKeywords(
          args, kwargs, "O!OOO!O!O!O!OOOOOO!O!O!O!O!OOO!O!OOO:_bind_recorder",
          const_cast<char**>(names), &PyDict_Type, &contexts, &current, &ids, &PyType_Type,
          &send_type, &PyType_Type, &record_type, &PyType_Type, &ctx_type, &PyType_Type,
          &env_type, &live_sends, &live_recvs, &native, &functorch, &call_kind, &PyType_Type,
          &parameter, &PyType_Type, &edge_type, &PyFrozenSet_Type, &recv_types, &PyType_Type,
          &accumulate, &PyType_Type, &reach_type, &lock, &released, &PySet_Type,
          &released_set, &PyLong_Type, &rank, &walking_lock, &notify, &release_handler))
    return nullptr;
  if (!PyCallable_Check(walking_lock) || (notify != Py_None && !PyCallable_Check(notify))) {
    PyErr_SetString(PyExc_TypeError, "walking_lock must be callable, notify callable or None");
    return nullptr;
  }
  // new_ctx, new_send and new_record fill exactly these slots, as the __init__ do
  struct {
    PyObject* cls;
    const char* format;
    std::array<const char*, 10> names;
  } layouts[] = {
      {ctx_type, "(ssssssssss)", {"container", "context_id", "lock", "sends", "recvs",
                                  "known_workers", "_gradients", "passes", "released",
                                  "__weakref__"}},
      {send_type, "(ssssssssss)", {"_ticket", "message_id", "peer", "_tensors", "_edges",
                                   "_what", "reach", "_walking", "_native", "__weakref__"}},
      {record_type, "(ssssssss)", {"_ticket", "context_id", "message_id", "peer",
                                   "n_outputs", "_what", "node", "__weakref__"}}};
  for (auto& layout : layouts) {
    const auto& n = layout.names;
    PyObject* expected = Py_BuildValue(layout.format, n[0], n[1], n[2], n[3], n[4], n[5],
                                       n[6], n[7], n[8], n[9]);
    PyObject* declared = expected != nullptr
        ? PyObject_GetAttrString(layout.cls, "__slots__") : nullptr;
    int same = declared != nullptr ? PyObject_RichCompareBool(declared, expected, Py_EQ) : -1;
    Py_XDECREF(expected);
    Py_XDECREF(declared);
    if (same <= 0) {
      if (same == 0)
        PyErr_Format(PyExc_TypeError, "%R's slots are not the ones this build fills: rebuild "
                     "mpidag's C++ module (python -m mpidag.transport.wire_build)", layout.cls);
      return nullptr;
    }
  }
  PyObject* maxlen = PyObject_GetAttrString(released, "maxlen");
  Py_ssize_t released_memory = maxlen != nullptr && maxlen != Py_None
      ? PyLong_AsSsize_t(maxlen) : -1;
  Py_XDECREF(maxlen);
  if (released_memory <= 0) {
    if (!PyErr_Occurred())
      PyErr_SetString(PyExc_TypeError, "released must be a deque with a maxlen");
    return nullptr;
  }
  // each context's lock: this module's Lock (the container's is one too: the compiled
  // container makes it so before it binds)
  PyObject* allocate_lock = Py_NewRef(reinterpret_cast<PyObject*>(&lock_type));
  PyObject* refs[N_REFS] = {};
  PyObject* base = PyObject_GetAttrString(ids, "base");
  PyObject* max = base != nullptr ? PyObject_GetAttrString(ids, "max_counter") : nullptr;
  refs[R_COUNTER] = max != nullptr ? PyObject_GetAttrString(ids, "counter") : nullptr;
  long long id_base = base != nullptr ? PyLong_AsLongLong(base) : -1;
  long long id_max = max != nullptr ? PyLong_AsLongLong(max) : -1;
  Py_XDECREF(base);
  Py_XDECREF(max);
  refs[R_CONTEXTS] = Py_NewRef(contexts);
  refs[R_CURRENT] = Py_NewRef(current);
  refs[R_IDS] = Py_NewRef(ids);
  refs[R_SEND_TYPE] = Py_NewRef(send_type);
  refs[R_RECORD_TYPE] = Py_NewRef(record_type);
  refs[R_LIVE_SENDS] = Py_NewRef(live_sends);
  refs[R_LIVE_RECVS] = Py_NewRef(live_recvs);
  refs[R_NATIVE] = Py_NewRef(native);
  refs[R_FUNCTORCH] = Py_NewRef(functorch);
  refs[R_CALL] = Py_NewRef(call_kind);
  refs[R_PARAMETER] = Py_NewRef(parameter);
  refs[R_EDGE_TYPE] = Py_NewRef(edge_type);
  refs[R_RECV_TYPES] = Py_NewRef(recv_types);
  refs[R_ACCUMULATE] = Py_NewRef(accumulate);
  refs[R_REACH_TYPE] = Py_NewRef(reach_type);
  refs[R_LOCK] = Py_NewRef(lock);
  refs[R_RANK] = Py_NewRef(rank);
  refs[R_RELEASED] = Py_NewRef(released);
  refs[R_RELEASED_SET] = Py_NewRef(released_set);
  refs[R_CTX_TYPE] = Py_NewRef(ctx_type);
  refs[R_ALLOCATE_LOCK] = allocate_lock;
  refs[R_ZEROS] = Py_BuildValue("(ii)", 0, 0);
  refs[R_WALKING_LOCK] = Py_NewRef(walking_lock);
  refs[R_NOTIFY] = Py_NewRef(notify);
  refs[R_RELEASE_HANDLER] = Py_NewRef(release_handler);
  struct {
    Ref ref;
    PyObject* cls;
    const char* name;
  } slots[] = {{R_ENV_CONTEXT_ID, env_type, "context_id"}, {R_ENV_SRC, env_type, "src"},
               {R_ENV_MESSAGE_ID, env_type, "message_id"}, {R_ENV_KIND, env_type, "kind"},
               {R_ENV_TENSORS, env_type, "tensors"},
               {R_CTX_CONTAINER, ctx_type, "container"},
               {R_CTX_CONTEXT_ID, ctx_type, "context_id"},
               {R_CTX_RELEASED, ctx_type, "released"}, {R_CTX_LOCK, ctx_type, "lock"},
               {R_CTX_KNOWN, ctx_type, "known_workers"}, {R_CTX_SENDS, ctx_type, "sends"},
               {R_CTX_RECVS, ctx_type, "recvs"}, {R_RECORD_WHAT, record_type, "_what"},
               {R_SEND_WALKING, send_type, "_walking"}, {R_SEND_TENSORS, send_type, "_tensors"},
               {R_SEND_EDGES, send_type, "_edges"}, {R_SEND_REACH, send_type, "reach"},
               {R_SEND_WHAT, send_type, "_what"}, {R_REACH_SUCC, reach_type, "succ"},
               {R_REACH_LEAF_EDGES, reach_type, "leaf_edges"},
               {R_REACH_RECV_EDGES, reach_type, "recv_edges"},
               {R_REACH_RECV_NODES, reach_type, "recv_nodes"},
               {R_CTX_GRADIENTS, ctx_type, "_gradients"}, {R_CTX_PASSES, ctx_type, "passes"},
               {R_RECORD_TICKET, record_type, "_ticket"}, {R_RECORD_NODE, record_type, "node"},
               {R_RECORD_CONTEXT_ID, record_type, "context_id"},
               {R_RECORD_MESSAGE_ID, record_type, "message_id"},
               {R_RECORD_PEER, record_type, "peer"},
               {R_RECORD_N_OUTPUTS, record_type, "n_outputs"},
               {R_SEND_TICKET, send_type, "_ticket"},
               {R_SEND_MESSAGE_ID, send_type, "message_id"}, {R_SEND_PEER, send_type, "peer"},
               {R_SEND_NATIVE, send_type, "_native"}};
  bool ok = !PyErr_Occurred() && refs[R_COUNTER] != nullptr && refs[R_ZEROS] != nullptr;
  for (auto& slot : slots) {
    if (!ok) break;
    refs[slot.ref] = member(slot.cls, slot.name);
    ok = refs[slot.ref] != nullptr;
  }
  if (!ok) {
    for (auto*& ref : refs) Py_CLEAR(ref);
    return nullptr;
  }
  for (int i = 0; i < N_REFS; i++) Py_XSETREF(self->refs[i], refs[i]);
  self->id_base = id_base;
  self->id_max = id_max;
  self->released_memory = released_memory;
  Py_RETURN_NONE;
}

int recorder_traverse(PyObject* obj, visitproc visit, void* arg) {
  auto* self = reinterpret_cast<ContextRecorder*>(obj);
  for (auto* ref : self->refs) Py_VISIT(ref);
  return 0;
}

int recorder_clear(PyObject* obj) {
  auto* self = reinterpret_cast<ContextRecorder*>(obj);
  for (auto*& ref : self->refs) Py_CLEAR(ref);
  return 0;
}

void recorder_dealloc(PyObject* obj) {
  PyObject_GC_UnTrack(obj);
  recorder_clear(obj);
  Py_TYPE(obj)->tp_free(obj);
}

#define FASTCALL(f) reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(f))

PyMethodDef recorder_methods[] = {
    {"outgoing", FASTCALL(outgoing), METH_FASTCALL,
     "outgoing(dst, tensors, what) -> (context_id, message_id) of a request from this thread"},
    {"replying", FASTCALL(replying), METH_FASTCALL,
     "replying(context_id, dst, tensors, what) -> the message id of a reply (0: none)"},
    {"received", FASTCALL(received), METH_FASTCALL,
     "received(env, what) -> the context of a message that arrived (recorded), or None"},
    {"serving", FASTCALL(serving), METH_FASTCALL,
     "serving(state, message_id, what) -> the thread's context before (for served)"},
    {"served", served, METH_O, "served(token): the thread's context back"},
    {"sent", FASTCALL(sent), METH_FASTCALL,
     "sent(context_id, message_id): the send function just sent walks its graph"},
    {"incoming", FASTCALL(incoming), METH_FASTCALL,
     "incoming(context_id, src) -> the context a message from src belongs to, made if new "
     "(None: released)"},
    {"new_context", new_context, METH_NOARGS, "new_context() -> a new context of this rank"},
    {"release", FASTCALL(release_method), METH_FASTCALL | METH_KEYWORDS,
     "release(ctx, from_rank=None): drop ctx here and tell every rank it exchanged messages "
     "with"},
    {"release_id", FASTCALL(release_id), METH_FASTCALL,
     "release_id(context_id, from_rank): the context ended on from_rank"},
    {"_bind_recorder", FASTCALL(bind_recorder), METH_VARARGS | METH_KEYWORDS,
     "_bind_recorder(contexts=, current=, ids=, ...): the objects the hooks work on"},
    {nullptr, nullptr, 0, nullptr}};

PyTypeObject recorder_type = {PyVarObject_HEAD_INIT(nullptr, 0)};

}  // namespace

int mpidag::add_context_recorder(PyObject* module) {
  struct {
    PyObject** name;
    const char* text;
  } names[] = {{&s_ctx, "ctx"},           {&s_acquire, "acquire"},
               {&s_release, "release"},
               {&s_record_recv, "record_recv"}, {&s_prepare, "prepare"},
               {&s_unprepared, "_unprepared"}, {&s_requires_grad, "requires_grad"},
               {&s_next, "next"}, {&s_active, "active"}, {&s_append, "append"},
               {&s_late, "_late"}, {&s_tell_released, "_tell_released"},
               {&s_ticket, "ticket"}};
  for (auto& n : names) {
    *n.name = PyUnicode_InternFromString(n.text);
    if (*n.name == nullptr) return -1;
  }
  recorder_type.tp_name = "_mpidag_torch.ContextRecorder";
  recorder_type.tp_basicsize = sizeof(ContextRecorder);
  recorder_type.tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC;
  recorder_type.tp_doc =
      "distributed autograd's per-message hooks and context life (the first base of the "
      "compiled ContextContainer)";
  recorder_type.tp_new = PyType_GenericNew;
  recorder_type.tp_traverse = recorder_traverse;
  recorder_type.tp_clear = recorder_clear;
  recorder_type.tp_dealloc = recorder_dealloc;
  recorder_type.tp_methods = recorder_methods;
  if (PyType_Ready(&recorder_type) < 0) return -1;
  lock_type.tp_name = "_mpidag_torch.Lock";
  lock_type.tp_basicsize = sizeof(Lock);
  lock_type.tp_flags = Py_TPFLAGS_DEFAULT;
  lock_type.tp_doc =
      "Lock(): threading.Lock's interface, taken by ContextRecorder with a C call (the "
      "locks of the compiled context container, its contexts and their send functions)";
  lock_type.tp_new = lock_new;
  lock_type.tp_dealloc = lock_dealloc;
  lock_type.tp_repr = lock_repr;
  lock_type.tp_methods = lock_methods;
  if (PyType_Ready(&lock_type) < 0) return -1;
  if (PyModule_AddObjectRef(module, "Lock", reinterpret_cast<PyObject*>(&lock_type)) < 0)
    return -1;
  return PyModule_AddObjectRef(module, "ContextRecorder",
                               reinterpret_cast<PyObject*>(&recorder_type));
}
