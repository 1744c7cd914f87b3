// PassCore: the event loop and the termination counts of one rank's share of a distributed
// backward pass in C++ (part of _mpidag_torch; see torch_native.cpp for the rest).
//
// mpidag.dist_autograd.engine.PassState is the pass in Python: post() queues an event and
// runs the queue unless another thread does, _handle() runs one event, _send() and _call()
// send gradient messages (calls of the termination protocol, counted until answered, or
// notifications handed over to the rank whose call engaged this one), _answered() counts
// an answer in, _maybe_finish() answers the engaging call once nothing is left, and
// _own_report() is what this rank tells in its answers. PassCore is the base of
// engine.NativePassState, which inherits everything else from PassState: it replaces those
// methods (but _handle) with these, for the case every pipeline stage, parameter server and
// the design document's example is in, where the pass's plan is a DisjointPlan (see
// torch_plan.cpp) and its step() runs an event's regions and finds its gradient messages;
// the events it cannot run that way (SMART mode's questions, a plan of graph.Plan, a
// running profiler, a message the plan does not take) go to PassState._handle, and a
// gradient compact_grads does not take to PassState._send.
//
// The counts (deficit, handed_over, handed_to_me), the parent, the errors and the reports
// are members of this type, read and written by Python's methods too; the GIL guards them:
// every check and change of them below runs without a Python call in between (Python's
// PassState keeps its threading.Lock for its own methods, which do the same under it).
//
//   PassCore.configure(dict)  once, by engine.py: the event types, pack_answer,
//                             merge_answer, the event numbers, the Python fallbacks, ...
//   core._bind()              at the end of NativePassState.__init__: what every event
//                             reads (the agent, the context, the handler, the flags)

#include <torch/csrc/python_headers.h>

#include <torch/csrc/utils/object_ptr.h>

#include <structmember.h>

#include <deque>

#include "torch_records.h"

namespace {

// what engine.py hands over once (PassCore.configure)
struct Config {
  PyObject* roots_event = nullptr;      // the event types
  PyObject* gradients_event = nullptr;
  PyObject* resolve_event = nullptr;
  PyObject* event_numbers = nullptr;    // itertools.count: the events' numbers
  PyObject* profiler = nullptr;         // torch.autograd.profiler (_is_profiler_enabled)
  PyObject* merge_answer = nullptr;     // engine.merge_answer (a report that is a dict)
  PyObject* merge = nullptr;            // engine._merge
  PyObject* pack_answer = nullptr;      // engine.pack_answer (a report to say something)
  PyObject* py_send = nullptr;          // PassState._send, _own_report: the Python ones
  PyObject* py_own_report = nullptr;
  PyObject* dropped = nullptr;          // callable(record): a fired recv of another context
  PyObject* handed_key = nullptr;       // engine._HANDED_OVER
  PyObject* max_batch = nullptr;        // engine.MAX_BATCH
  // what _make_plan needs: engine._disjoint_terms ((watch, direct) or None: no DisjointPlan
  // now), PassState._make_plan and _plan_of (the other plans), the recv node types, torch's
  // AccumulateGrad, this module, graph's globals (engine_grad and drop_unrun_tasks, read at
  // each plan, as graph.make_plan reads them)
  PyObject* disjoint_terms = nullptr;
  PyObject* py_make_plan = nullptr;
  PyObject* py_plan_of = nullptr;
  PyObject* recv_types = nullptr;
  PyObject* acc_type = nullptr;
  PyObject* native = nullptr;
  PyObject* graph_globals = nullptr;
  long compact_min = 0;                 // engine.COMPACT_MIN_NUMEL
  long retain = 1, smart = 2, no_gradient = 4, to_parent = 8, expanded = 16;  // the flags
} C;

PyObject *s_reply, *s_to_parent, *s_message_id, *s_grads, *s_edges, *s_plan, *s_native_step,
    *s_make_plan, *s_handle, *s_failed, *s_caller, *s_seq, *s_add, *s_set_result,
    *s_set_exception, *s_call, *s_notify, *s_add_internal_callback, *s_answered, *s_record,
    *s_value, *s_dict, *s_pop, *s_agent, *s_ctx, *s_context_id, *s_pass_id, *s_autograd,
    *s_gradients_handler, *s_retain_graph, *s_smart, *s_root, *s_rank, *s_gradients,
    *s_passes, *s_lock, *s_enter, *s_exit, *s_complete, *s_unreached, *s_recvs,
    *s_profiler_enabled, *s_sends, *s_tensors, *s_reach, *s_prepare, *s_edges_slot,
    *s_source_of, *s_source_send, *s_step, *s_answer_unreached, *s_disjoint_plan,
    *s_engine_grad, *s_drop_unrun_tasks;

struct PassCore {
  PyObject_HEAD
  // the termination state (members: Python's methods read and write them too)
  PyObject* parent;       // the engaging call's answer (a Future), or None
  PyObject* parent_rank;  // the rank that made it, or None
  PyObject* errors;       // list
  PyObject* reports;      // dict: rank -> (event number, unused, waiting, waiting ids)
  Py_ssize_t deficit;     // calls made and not answered yet
  Py_ssize_t handed_over;   // notifications sent to the parent since engaged
  Py_ssize_t handed_to_me;  // notifications handed over to this rank, not processed yet
  char running;             // a thread runs the queue
  std::deque<PyObject*>* events;  // owned references
  // what every event reads (_bind)
  PyObject *agent, *ctx, *context_id, *pass_id, *handler, *rank;
  PyObject* gradients;  // ctx.gradients, read when the first leaf gradient is stored
  int retain_graph, smart, root;
};

PyTypeObject core_type = {PyVarObject_HEAD_INIT(nullptr, 0)};

int core_traverse(PyObject* self_, visitproc visit, void* arg) {
  auto* self = reinterpret_cast<PassCore*>(self_);
  Py_VISIT(self->parent);
  Py_VISIT(self->parent_rank);
  Py_VISIT(self->errors);
  Py_VISIT(self->reports);
  Py_VISIT(self->agent);
  Py_VISIT(self->ctx);
  Py_VISIT(self->handler);
  Py_VISIT(self->gradients);
  if (self->events != nullptr) {
    for (PyObject* event : *self->events) Py_VISIT(event);
  }
  return 0;
}

int core_clear(PyObject* self_) {
  auto* self = reinterpret_cast<PassCore*>(self_);
  Py_CLEAR(self->parent);
  Py_CLEAR(self->parent_rank);
  Py_CLEAR(self->errors);
  Py_CLEAR(self->reports);
  Py_CLEAR(self->agent);
  Py_CLEAR(self->ctx);
  Py_CLEAR(self->context_id);
  Py_CLEAR(self->pass_id);
  Py_CLEAR(self->handler);
  Py_CLEAR(self->gradients);
  Py_CLEAR(self->rank);
  if (self->events != nullptr) {
    while (!self->events->empty()) {
      PyObject* event = self->events->front();
      self->events->pop_front();
      Py_DECREF(event);
    }
  }
  return 0;
}

void core_dealloc(PyObject* self_) {
  auto* self = reinterpret_cast<PassCore*>(self_);
  PyObject_GC_UnTrack(self_);
  core_clear(self_);
  delete self->events;
  self->events = nullptr;
  Py_TYPE(self_)->tp_free(self_);
}

PyObject* core_new(PyTypeObject* type, PyObject* /*args*/, PyObject* /*kwargs*/) {
  auto* self = reinterpret_cast<PassCore*>(type->tp_alloc(type, 0));
  if (self == nullptr) return nullptr;
  self->parent = Py_NewRef(Py_None);
  self->parent_rank = Py_NewRef(Py_None);
  self->errors = PyList_New(0);
  self->reports = PyDict_New();
  self->events = new std::deque<PyObject*>;
  if (self->errors == nullptr || self->reports == nullptr) {
    Py_DECREF(self);
    return nullptr;
  }
  return reinterpret_cast<PyObject*>(self);
}

// getattr(obj, name) as a truth value; -1 on an error
int attr_true(PyObject* obj, PyObject* name) {
  THPObjectPtr value(PyObject_GetAttr(obj, name));
  return value ? PyObject_IsTrue(value.get()) : -1;
}

// _bind(): what every event reads, from the attributes PassState.__init__ set
PyObject* core_bind(PyObject* self_, PyObject* /*unused*/) {
  auto* self = reinterpret_cast<PassCore*>(self_);
  THPObjectPtr agent(PyObject_GetAttr(self_, s_agent)), ctx(PyObject_GetAttr(self_, s_ctx));
  THPObjectPtr autograd(PyObject_GetAttr(self_, s_autograd));
  THPObjectPtr pass_id(PyObject_GetAttr(self_, s_pass_id));
  if (!agent || !ctx || !autograd || !pass_id) return nullptr;
  THPObjectPtr context_id(PyObject_GetAttr(ctx.get(), s_context_id));
  THPObjectPtr handler(PyObject_GetAttr(autograd.get(), s_gradients_handler));
  THPObjectPtr rank(PyObject_GetAttr(agent.get(), s_rank));
  if (!context_id || !handler || !rank) return nullptr;
  int retain = attr_true(self_, s_retain_graph), smart = attr_true(self_, s_smart);
  int root = attr_true(self_, s_root);
  if (retain < 0 || smart < 0 || root < 0) return nullptr;
  Py_XSETREF(self->agent, agent.release());
  Py_XSETREF(self->ctx, ctx.release());
  Py_XSETREF(self->pass_id, pass_id.release());
  Py_XSETREF(self->context_id, context_id.release());
  Py_XSETREF(self->handler, handler.release());
  Py_XSETREF(self->rank, rank.release());
  self->retain_graph = retain;
  self->smart = smart;
  self->root = root;
  Py_RETURN_NONE;
}

bool bound(PassCore* self) {
  if (self->agent != nullptr && C.roots_event != nullptr) return true;
  PyErr_SetString(PyExc_RuntimeError, "PassCore: configure() and _bind() come first");
  return false;
}

// ------------------------------------------------------------------- messages out
// _call(peer, handler, args): a call of the termination protocol, counted until answered
PyObject* call_counted(PassCore* self, PyObject* peer, PyObject* handler, PyObject* args) {
  self->deficit++;
  THPObjectPtr kwargs(PyDict_New());
  THPObjectPtr zero(PyLong_FromLong(0));
  PyObject* fut = nullptr;
  if (kwargs && zero) {
    PyObject* call[7] = {self->agent, peer, handler, args, kwargs.get(), zero.get(), Py_False};
    THPObjectPtr names(PyTuple_Pack(1, s_record));
    if (names) {
      fut = PyObject_VectorcallMethod(s_call, call, 6, names.get());
    }
  }
  if (fut == nullptr) {
    self->deficit--;
    return nullptr;
  }
  THPObjectPtr owned(fut);
  THPObjectPtr callback(PyObject_GetAttr(reinterpret_cast<PyObject*>(self), s_answered));
  if (!callback) return nullptr;
  return PyObject_CallMethodOneArg(fut, s_add_internal_callback, callback.get());
}

PyObject* core_call(PyObject* self_, PyObject* const* args, Py_ssize_t nargs) {
  auto* self = reinterpret_cast<PassCore*>(self_);
  if (nargs != 3) {
    PyErr_SetString(PyExc_TypeError, "_call(peer, handler, args)");
    return nullptr;
  }
  if (!bound(self)) return nullptr;
  return call_counted(self, args[0], args[1], args[2]);
}

// _send(peer, message_id, grads): PassState._send (grads None: SMART's "no gradient")
PyObject* send_grads(PassCore* self, PyObject* peer, PyObject* message_id, PyObject* grads) {
  THPObjectPtr compacted;
  PyObject *sent = nullptr, *shapes = Py_None;
  if (grads != Py_None && PyObject_Length(grads) > 0) {
    THPObjectPtr min(PyLong_FromLong(C.compact_min));
    if (!min) return nullptr;
    PyObject* call[2] = {grads, min.get()};
    compacted = THPObjectPtr(mpidag::compact_grads(nullptr, call, 2));
    if (!compacted) return nullptr;
    if (compacted.get() == Py_None) {  // a tensor subclass: the Python function's
      PyObject* py[4] = {reinterpret_cast<PyObject*>(self), peer, message_id, grads};
      return PyObject_Vectorcall(C.py_send, py, 4, nullptr);
    }
    sent = PyTuple_GET_ITEM(compacted.get(), 0);
    shapes = PyTuple_GET_ITEM(compacted.get(), 1);
  } else if (PyErr_Occurred()) {
    return nullptr;
  }
  // (no Python call from here to the count: the GIL keeps it whole)
  int to_parent = 0;
  if (self->parent != Py_None && self->parent_rank != Py_None) {
    to_parent = PyObject_RichCompareBool(peer, self->parent_rank, Py_EQ);
    if (to_parent < 0) return nullptr;
  }
  if (to_parent) self->handed_over++;
  long flags = (self->retain_graph ? C.retain : 0) | (self->smart ? C.smart : 0) |
               (grads == Py_None ? C.no_gradient : 0) | (to_parent ? C.to_parent : 0) |
               (shapes != Py_None ? C.expanded : 0);
  const Py_ssize_t n = sent == nullptr ? 0 : PyList_GET_SIZE(sent);
  const Py_ssize_t n_shapes = shapes == Py_None ? 0 : PyList_GET_SIZE(shapes);
  THPObjectPtr args(PyTuple_New(4 + n + n_shapes));
  THPObjectPtr flag(PyLong_FromLong(flags));
  if (!args || !flag) {
    if (to_parent) self->handed_over--;
    return nullptr;
  }
  PyTuple_SET_ITEM(args.get(), 0, Py_NewRef(self->context_id));
  PyTuple_SET_ITEM(args.get(), 1, Py_NewRef(self->pass_id));
  PyTuple_SET_ITEM(args.get(), 2, Py_NewRef(message_id));
  PyTuple_SET_ITEM(args.get(), 3, flag.release());
  for (Py_ssize_t i = 0; i < n; i++)
    PyTuple_SET_ITEM(args.get(), 4 + i, Py_NewRef(PyList_GET_ITEM(sent, i)));
  for (Py_ssize_t i = 0; i < n_shapes; i++)
    PyTuple_SET_ITEM(args.get(), 4 + n + i, Py_NewRef(PyList_GET_ITEM(shapes, i)));
  if (!to_parent) return call_counted(self, peer, self->handler, args.get());
  // the parent waits for it in this rank's place: no answer to wait for
  PyObject* call[4] = {self->agent, peer, self->handler, args.get()};
  PyObject* done = PyObject_VectorcallMethod(s_notify, call, 4, nullptr);
  if (done == nullptr) self->handed_over--;
  return done;
}

PyObject* core_send(PyObject* self_, PyObject* const* args, Py_ssize_t nargs) {
  auto* self = reinterpret_cast<PassCore*>(self_);
  if (nargs != 3) {
    PyErr_SetString(PyExc_TypeError, "_send(peer, message_id, grads)");
    return nullptr;
  }
  if (!bound(self)) return nullptr;
  return send_grads(self, args[0], args[1], args[2]);
}

// fn() (0, or -1 with an error set) with ctx.lock held, through its __enter__ and __exit__;
// -1 where fn or the lock failed
template <class Fn>
int with_ctx_lock(PyObject* ctx, Fn fn) {
  THPObjectPtr lock(PyObject_GetAttr(ctx, s_lock));
  THPObjectPtr entered(lock ? PyObject_CallMethodNoArgs(lock.get(), s_enter) : nullptr);
  if (!entered) return -1;
  int done = fn();
  PyObject *type, *value, *traceback;
  PyErr_Fetch(&type, &value, &traceback);
  PyObject* exit_args[4] = {lock.get(), Py_None, Py_None, Py_None};
  THPObjectPtr left(PyObject_VectorcallMethod(s_exit, exit_args, 4, nullptr));
  if (!left) {
    Py_XDECREF(type);
    Py_XDECREF(value);
    Py_XDECREF(traceback);
    return -1;
  }
  PyErr_Restore(type, value, traceback);
  return done;
}

// ------------------------------------------------------------------ termination
// this rank's report: {rank: (event number, unused RPC results, [], [])} for a DisjointPlan
// whose context has no recv function its sources miss (the common case); Python's
// _own_report for the rest
PyObject* own_report(PassCore* self) {
  PyObject* me = reinterpret_cast<PyObject*>(self);
  THPObjectPtr plan(PyObject_GetAttr(me, s_plan));
  THPObjectPtr step(plan ? PyObject_GetAttr(me, s_native_step) : nullptr);
  THPObjectPtr unreached(step ? PyObject_GetAttr(me, s_unreached) : nullptr);
  THPObjectPtr recvs(unreached ? PyObject_GetAttr(self->ctx, s_recvs) : nullptr);
  if (!recvs) return nullptr;
  if (plan.get() == Py_None) return PyDict_New();
  bool simple = step.get() != Py_None && PyTuple_Check(unreached.get()) &&
                PyTuple_GET_SIZE(unreached.get()) == 2 && PyDict_Check(recvs.get()) &&
                PyList_Check(PyTuple_GET_ITEM(unreached.get(), 1)) &&
                PyList_GET_SIZE(PyTuple_GET_ITEM(unreached.get(), 1)) == 0;
  if (simple) {
    Py_ssize_t count = PyLong_AsSsize_t(PyTuple_GET_ITEM(unreached.get(), 0));
    if (count == -1 && PyErr_Occurred()) return nullptr;
    simple = count == PyDict_GET_SIZE(recvs.get());
  }
  if (!simple) return PyObject_CallOneArg(C.py_own_report, me);
  THPObjectPtr seq(PyObject_GetAttr(me, s_seq));
  THPObjectPtr a(PyList_New(0)), b(PyList_New(0)), c(PyList_New(0));
  if (!seq || !a || !b || !c) return nullptr;
  THPObjectPtr entry(PyTuple_Pack(4, seq.get(), a.get(), b.get(), c.get()));
  THPObjectPtr report(PyDict_New());
  if (!entry || !report || PyDict_SetItem(report.get(), self->rank, entry.get()) < 0)
    return nullptr;
  return report.release();
}

// pack_answer(report, handed_over): flat where nobody says anything (engine.pack_answer)
PyObject* pack(PyObject* report, Py_ssize_t handed_over) {
  if (PyDict_GET_SIZE(report) <= 3) {
    THPObjectPtr flat(PyList_New(0));
    THPObjectPtr count(PyLong_FromSsize_t(handed_over));
    if (!flat || !count || PyList_Append(flat.get(), count.get()) < 0) return nullptr;
    Py_ssize_t pos = 0;
    PyObject *rank, *entry;
    bool quiet = true;
    while (quiet && PyDict_Next(report, &pos, &rank, &entry)) {
      quiet = PyTuple_Check(entry) && PyTuple_GET_SIZE(entry) == 4;
      for (Py_ssize_t i = 1; quiet && i < 4; i++) {
        PyObject* said = PyTuple_GET_ITEM(entry, i);
        quiet = PyList_Check(said) && PyList_GET_SIZE(said) == 0;
      }
      if (quiet && (PyList_Append(flat.get(), rank) < 0 ||
                    PyList_Append(flat.get(), PyTuple_GET_ITEM(entry, 0)) < 0))
        return nullptr;
    }
    if (quiet) return PyList_AsTuple(flat.get());
  }
  THPObjectPtr count(PyLong_FromSsize_t(handed_over));
  if (!count) return nullptr;
  PyObject* call[2] = {report, count.get()};
  return PyObject_Vectorcall(C.pack_answer, call, 2, nullptr);
}

// _maybe_finish(): answers the engaging call once nothing is left (None; nullptr: an error)
PyObject* maybe_finish(PassCore* self) {
  if (self->running || !self->events->empty() || self->deficit || self->parent == Py_None ||
      (self->handed_to_me && PyList_GET_SIZE(self->errors) == 0))
    Py_RETURN_NONE;  // (a failed pass does not wait for notifications whose count was lost)
  // made first (an allocation may run the garbage collector, and so other threads), then
  // checked again and taken in one go, with no Python call in between
  THPObjectPtr fresh_errors(PyList_New(0)), fresh_reports(PyDict_New());
  if (!fresh_errors || !fresh_reports) return nullptr;
  if (self->running || !self->events->empty() || self->deficit || self->parent == Py_None ||
      (self->handed_to_me && PyList_GET_SIZE(self->errors) == 0))
    Py_RETURN_NONE;
  THPObjectPtr parent(self->parent), errors(self->errors), report(self->reports);
  const Py_ssize_t handed_over = self->handed_over;
  self->parent = Py_NewRef(Py_None);
  self->handed_over = 0;
  PyObject* old_rank = self->parent_rank;
  self->parent_rank = Py_NewRef(Py_None);
  self->errors = fresh_errors.release();
  self->reports = fresh_reports.release();
  Py_DECREF(old_rank);
  PyObject* me = reinterpret_cast<PyObject*>(self);
  THPObjectPtr own(own_report(self));
  if (!own) return nullptr;
  PyObject* call[2] = {report.get(), own.get()};
  THPObjectPtr merged(PyObject_Vectorcall(C.merge, call, 2, nullptr));
  if (!merged) return nullptr;
  const bool failed = PyList_GET_SIZE(errors.get()) > 0;
  if (!self->root) {
    int forget = failed ? 1 : 0;
    if (!forget) {
      THPObjectPtr plan(PyObject_GetAttr(me, s_plan));
      if (!plan) return nullptr;
      forget = plan.get() == Py_None ? 0 : attr_true(plan.get(), s_complete);
      if (forget < 0) return nullptr;
    }
    if (forget) {  // with ctx.lock: drop this pass from ctx.passes if it is still there
      THPObjectPtr passes(PyObject_GetAttr(self->ctx, s_passes));
      if (!passes) return nullptr;
      int done = with_ctx_lock(self->ctx, [&] {
        PyObject* mine = PyDict_Check(passes.get())
                             ? PyDict_GetItemWithError(passes.get(), self->pass_id) : nullptr;
        if (mine == me) return PyDict_DelItem(passes.get(), self->pass_id);
        return PyErr_Occurred() ? -1 : 0;
      });
      if (done < 0) return nullptr;
    }
  }
  if (failed) {
    PyObject* first = PyList_GET_ITEM(errors.get(), 0);
    if (handed_over) {  // the parent waits for them: their count goes with the error
      THPObjectPtr dict(PyObject_GetAttr(first, s_dict));
      THPObjectPtr count(dict ? PyLong_FromSsize_t(handed_over) : nullptr);
      if (!count || PyObject_SetItem(dict.get(), C.handed_key, count.get()) < 0) return nullptr;
    }
    return PyObject_CallMethodOneArg(parent.get(), s_set_exception, first);
  }
  THPObjectPtr answer(pack(report.get(), handed_over));
  if (!answer) return nullptr;
  return PyObject_CallMethodOneArg(parent.get(), s_set_result, answer.get());
}

PyObject* core_maybe_finish(PyObject* self_, PyObject* /*unused*/) {
  auto* self = reinterpret_cast<PassCore*>(self_);
  if (!bound(self)) return nullptr;
  return maybe_finish(self);
}

// merge a flat answer (handed_over, rank, seq, ...) into reports with no Python call (the
// entry of a rank with the later event number wins); false: not flat
bool merge_flat(PassCore* self, PyObject* answer, Py_ssize_t* handed, int* error) {
  *error = 0;
  if (!PyTuple_Check(answer) || PyTuple_GET_SIZE(answer) % 2 != 1) return false;
  if (PyTuple_GET_SIZE(answer) == 2 && PyDict_Check(PyTuple_GET_ITEM(answer, 1))) return false;
  for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(answer); i++) {
    if (!PyLong_CheckExact(PyTuple_GET_ITEM(answer, i))) return false;
  }
  *handed = PyLong_AsSsize_t(PyTuple_GET_ITEM(answer, 0));
  for (Py_ssize_t i = 1; i < PyTuple_GET_SIZE(answer); i += 2) {
    PyObject *rank = PyTuple_GET_ITEM(answer, i), *seq = PyTuple_GET_ITEM(answer, i + 1);
    // made first: an allocation may run the garbage collector, and so other threads
    THPObjectPtr a(PyList_New(0)), b(PyList_New(0)), c(PyList_New(0));
    THPObjectPtr entry(a && b && c ? PyTuple_Pack(4, seq, a.get(), b.get(), c.get()) : nullptr);
    if (!entry) {
      *error = 1;
      return true;
    }
    PyObject* old = PyDict_GetItemWithError(self->reports, rank);  // (ints: no Python call)
    if (old == nullptr && PyErr_Occurred()) {
      *error = 1;
      return true;
    }
    if (old != nullptr && PyTuple_Check(old) && PyTuple_GET_SIZE(old) > 0 &&
        PyLong_CheckExact(PyTuple_GET_ITEM(old, 0)) &&
        PyLong_AsLongLong(seq) < PyLong_AsLongLong(PyTuple_GET_ITEM(old, 0)))
      continue;  // (the later event number wins)
    if (PyDict_SetItem(self->reports, rank, entry.get()) < 0) {
      *error = 1;
      return true;
    }
  }
  return true;
}

// _answered(fut): an answer of the termination protocol counted in
PyObject* core_answered(PyObject* self_, PyObject* fut) {
  auto* self = reinterpret_cast<PassCore*>(self_);
  if (!bound(self)) return nullptr;
  THPObjectPtr value(PyObject_CallMethodNoArgs(fut, s_value));
  if (!value) {  // the error it holds (engine's future_error: its traceback cleared)
    PyObject *type, *error, *traceback;
    PyErr_Fetch(&type, &error, &traceback);
    PyErr_NormalizeException(&type, &error, &traceback);
    Py_XDECREF(type);
    Py_XDECREF(traceback);
    if (error == nullptr) return nullptr;
    THPObjectPtr owned(error);
    PyException_SetTraceback(error, Py_None);
    THPObjectPtr dict(PyObject_GetAttr(error, s_dict));  // (its count travels with it)
    THPObjectPtr handed;
    if (dict) {
      PyObject* call[3] = {dict.get(), C.handed_key, nullptr};
      THPObjectPtr zero(PyLong_FromLong(0));
      call[2] = zero.get();
      if (zero) handed = THPObjectPtr(PyObject_VectorcallMethod(s_pop, call, 3, nullptr));
    }
    if (!handed) return nullptr;
    Py_ssize_t n = PyLong_AsSsize_t(handed.get());
    if (n == -1 && PyErr_Occurred()) return nullptr;
    self->deficit--;
    self->handed_to_me += n;
    if (PyList_Append(self->errors, error) < 0) return nullptr;
    return maybe_finish(self);
  }
  Py_ssize_t handed = 0;
  int error = 0;
  if (merge_flat(self, value.get(), &handed, &error)) {
    if (error) return nullptr;
  } else {  // a report that says something: merged in Python while the call still counts
    PyObject* call[2] = {self->reports, value.get()};
    THPObjectPtr count(PyObject_Vectorcall(C.merge_answer, call, 2, nullptr));
    if (!count) return nullptr;
    handed = PyLong_AsSsize_t(count.get());
    if (handed == -1 && PyErr_Occurred()) return nullptr;
  }
  self->deficit--;
  self->handed_to_me += handed;
  return maybe_finish(self);
}

// ------------------------------------------------------------------------- plan
// this rank's recv functions no source of the plan reaches, checked: _unreached set to
// (count, []) where every one of the context's is reached (the common case, which
// own_report reads); else, in SMART mode, PassState._answer_unreached says "no gradient"
// for the others. -1 on an error
int check_unreached(PassCore* self, PyObject* plan) {
  PyObject* me = reinterpret_cast<PyObject*>(self);
  THPObjectPtr recvs(PyObject_GetAttr(self->ctx, s_recvs));
  THPObjectPtr reached(recvs ? PySet_New(nullptr) : nullptr);
  if (!reached) return -1;
  if (!PyDict_Check(recvs.get())) {
    PyErr_SetString(PyExc_TypeError, "PassCore._make_plan: ctx.recvs is a dict");
    return -1;
  }
  Py_ssize_t pos = 0;
  PyObject *node, *bit;
  while (PyDict_GET_SIZE(recvs.get()) > 0 &&
         PyDict_Next(mpidag::plan_recv_mask(plan), &pos, &node, &bit)) {
    THPObjectPtr record(PyObject_GetAttr(node, s_record));
    THPObjectPtr context_id(record ? PyObject_GetAttr(record.get(), s_context_id) : nullptr);
    if (!context_id) return -1;
    int mine = PyObject_RichCompareBool(context_id.get(), self->context_id, Py_EQ);
    if (mine < 0) return -1;
    if (!mine) continue;  // (another context's recv function: not this context's question)
    THPObjectPtr message_id(PyObject_GetAttr(record.get(), s_message_id));
    if (!message_id || PySet_Add(reached.get(), message_id.get()) < 0) return -1;
  }
  // (from here to the count no Python call: the context's recv functions read at once)
  bool all = true;
  pos = 0;
  PyObject *message_id, *record;
  while (all && PyDict_Next(recvs.get(), &pos, &message_id, &record)) {
    int found = PySet_Contains(reached.get(), message_id);
    if (found < 0) return -1;
    all = found == 1;
  }
  if (all) {
    THPObjectPtr none(PyList_New(0));
    THPObjectPtr count(none ? PyLong_FromSsize_t(PyDict_GET_SIZE(recvs.get())) : nullptr);
    THPObjectPtr unreached(count ? PyTuple_Pack(2, count.get(), none.get()) : nullptr);
    return unreached ? PyObject_SetAttr(me, s_unreached, unreached.get()) : -1;
  }
  if (!self->smart) return 0;  // (listed by Python when a report needs them)
  THPObjectPtr answered(PyObject_CallMethodNoArgs(me, s_answer_unreached));
  return answered ? 0 : -1;
}

// a send function's reach and edges, walked now where its walk has not run yet
// (SendFunction.prepare); false on an error
bool send_source(PyObject* send, THPObjectPtr& reach, THPObjectPtr& edges) {
  THPObjectPtr tensors(PyObject_GetAttr(send, s_tensors));
  if (!tensors) return false;
  reach = THPObjectPtr(PyObject_GetAttr(send, s_reach));
  if (!reach) return false;
  if (tensors.get() != Py_None || reach.get() == Py_None) {  // (prepare's lock, its walk)
    reach = THPObjectPtr(PyObject_CallMethodNoArgs(send, s_prepare));
    if (!reach) return false;
  }
  edges = THPObjectPtr(PyObject_GetAttr(send, s_edges_slot));
  return static_cast<bool>(edges);
}

// _make_plan(root_edges): PassState._make_plan, in C++ up to a DisjointPlan: the sources
// (root_edges, None off the root's rank, then every send function of the context), their
// reaches (the roots' walked here, the send functions' walked when they were sent),
// disjoint_plan() of them, its source ids, its step, the unreached check. What is not a
// DisjointPlan (hooks held back by a running grad(), a Python walk, shared nodes, a
// watched leaf) is PassState._plan_of's, with the sources found here
PyObject* core_make_plan(PyObject* self_, PyObject* root_edges) {
  auto* self = reinterpret_cast<PassCore*>(self_);
  if (!bound(self)) return nullptr;
  THPObjectPtr terms(PyObject_CallNoArgs(C.disjoint_terms));
  if (!terms) return nullptr;
  if (terms.get() == Py_None || (root_edges != Py_None && !PyList_Check(root_edges))) {
    PyObject* call[2] = {self_, root_edges};
    return PyObject_Vectorcall(C.py_make_plan, call, 2, nullptr);
  }
  THPObjectPtr sends_dict(PyObject_GetAttr(self->ctx, s_sends));
  if (!sends_dict) return nullptr;
  if (!PyDict_Check(sends_dict.get())) {
    PyErr_SetString(PyExc_TypeError, "PassCore._make_plan: ctx.sends is a dict");
    return nullptr;
  }
  THPObjectPtr sends;
  if (with_ctx_lock(self->ctx, [&] {
        sends = THPObjectPtr(PyDict_Values(sends_dict.get()));
        return sends ? 0 : -1;
      }) < 0)
    return nullptr;
  const Py_ssize_t first = root_edges == Py_None ? 0 : 1;
  const Py_ssize_t n = first + PyList_GET_SIZE(sends.get());
  THPObjectPtr sources(PyList_New(n)), reaches(PyList_New(n)), py_reaches(PyList_New(n));
  THPObjectPtr source_send(PyList_New(n)), source_of(PyDict_New());
  if (!sources || !reaches || !py_reaches || !source_send || !source_of) return nullptr;
  bool walked = true;  // every reach is known here (the roots' need no Python walk)
  if (first) {
    PyObject* call[3] = {root_edges, C.recv_types, C.acc_type};
    PyObject* root_reach = mpidag::reach(C.native, call, 3);
    if (root_reach == nullptr) return nullptr;
    walked = root_reach != Py_None;
    PyList_SET_ITEM(sources.get(), 0, Py_NewRef(root_edges));
    PyList_SET_ITEM(reaches.get(), 0, root_reach);
    PyList_SET_ITEM(py_reaches.get(), 0, Py_NewRef(Py_None));  // (graph.make_plan walks it)
    PyList_SET_ITEM(source_send.get(), 0, Py_NewRef(Py_None));
  }
  for (Py_ssize_t i = first; i < n; i++) {
    PyObject* send = PyList_GET_ITEM(sends.get(), i - first);
    THPObjectPtr reach, edges, message_id(PyObject_GetAttr(send, s_message_id));
    THPObjectPtr index(message_id ? PyLong_FromSsize_t(i) : nullptr);
    if (!index || !send_source(send, reach, edges) ||
        PyDict_SetItem(source_of.get(), message_id.get(), index.get()) < 0)
      return nullptr;
    PyList_SET_ITEM(sources.get(), i, edges.release());
    PyList_SET_ITEM(py_reaches.get(), i, Py_NewRef(reach.get()));
    PyList_SET_ITEM(reaches.get(), i, reach.release());
    PyList_SET_ITEM(source_send.get(), i, Py_NewRef(send));
  }
  if (PyObject_SetAttr(self_, s_source_of, source_of.get()) < 0 ||
      PyObject_SetAttr(self_, s_source_send, source_send.get()) < 0)
    return nullptr;
  THPObjectPtr plan;
  if (walked && n > 0) {
    if (!PyTuple_Check(terms.get()) || PyTuple_GET_SIZE(terms.get()) != 2) {
      PyErr_SetString(PyExc_TypeError, "PassCore._make_plan: terms are (watch, direct)");
      return nullptr;
    }
    // (looked up at each plan, as graph.make_plan does: a profile may wrap them)
    PyObject* engine_grad = PyDict_GetItemWithError(C.graph_globals, s_engine_grad);
    PyObject* drop = engine_grad ? PyDict_GetItemWithError(C.graph_globals, s_drop_unrun_tasks)
                                 : nullptr;
    THPObjectPtr made(drop ? PyObject_GetAttr(C.native, s_disjoint_plan) : nullptr);
    if (!made) {
      if (!PyErr_Occurred())
        PyErr_SetString(PyExc_RuntimeError, "PassCore._make_plan: graph.engine_grad is gone");
      return nullptr;
    }
    PyObject* call[9] = {sources.get(), reaches.get(), C.recv_types, C.acc_type,
                         PyTuple_GET_ITEM(terms.get(), 0), engine_grad, drop, C.native,
                         PyTuple_GET_ITEM(terms.get(), 1)};
    plan = THPObjectPtr(PyObject_Vectorcall(made.get(), call, 9, nullptr));
    if (!plan) return nullptr;
  }
  if (!plan || !mpidag::is_disjoint_plan(plan.get())) {  // graph.Plan's case
    PyObject* call[4] = {self_, sources.get(), py_reaches.get(), walked ? Py_False : Py_True};
    return PyObject_Vectorcall(C.py_plan_of, call, 4, nullptr);
  }
  mpidag::plan_share_sources(plan.get(), source_of.get());
  THPObjectPtr step(PyObject_GetAttr(plan.get(), s_step));
  if (!step || PyObject_SetAttr(self_, s_plan, plan.get()) < 0 ||
      PyObject_SetAttr(self_, s_native_step, step.get()) < 0 || check_unreached(self, plan.get()) < 0)
    return nullptr;
  Py_RETURN_NONE;
}

// ---------------------------------------------------------------------- events
// the gradients of the unwatched leaves an event reached ([(tensor, grad)]); nullptr on an
// error. A roots or gradients event of a DisjointPlan's pass runs here, with no Python
// frame; the rest in PassState._handle.
PyObject* handle(PassCore* self, PyObject* event) {
  PyObject* me = reinterpret_cast<PyObject*>(self);
  PyObject* type = reinterpret_cast<PyObject*>(Py_TYPE(event));
  const bool roots = type == C.roots_event;
  int profiling = 0;
  if (roots || type == C.gradients_event) {
    profiling = attr_true(C.profiler, s_profiler_enabled);
    if (profiling < 0) return nullptr;
  }
  if ((!roots && type != C.gradients_event) || profiling)
    return PyObject_CallMethodOneArg(me, s_handle, event);
  THPObjectPtr plan(PyObject_GetAttr(me, s_plan));
  if (!plan) return nullptr;
  if (plan.get() == Py_None) {
    THPObjectPtr edges(roots ? PyObject_GetAttr(event, s_edges) : Py_NewRef(Py_None));
    if (!edges) return nullptr;
    THPObjectPtr made(PyObject_CallMethodOneArg(me, s_make_plan, edges.get()));
    if (!made) return nullptr;
  }
  THPObjectPtr step(PyObject_GetAttr(me, s_native_step));
  if (!step) return nullptr;
  if (step.get() == Py_None) return PyObject_CallMethodOneArg(me, s_handle, event);
  THPObjectPtr seq(PyIter_Next(C.event_numbers));
  if (!seq || PyObject_SetAttr(me, s_seq, seq.get()) < 0) return nullptr;
  THPObjectPtr message_id(roots ? Py_NewRef(Py_None) : PyObject_GetAttr(event, s_message_id));
  THPObjectPtr grads(message_id ? PyObject_GetAttr(event, s_grads) : nullptr);
  if (!grads) return nullptr;
  PyObject* call[5] = {message_id.get(), grads.get(), self->retain_graph ? Py_True : Py_False,
                       self->context_id, C.max_batch};
  THPObjectPtr done(PyObject_Vectorcall(step.get(), call, 5, nullptr));
  if (!done) return nullptr;
  if (done.get() == Py_None)  // a message the plan does not take: Python raises its error
    return PyObject_CallMethodOneArg(me, s_handle, event);
  PyObject *leaves = PyTuple_GET_ITEM(done.get(), 0), *sends = PyTuple_GET_ITEM(done.get(), 1);
  PyObject* foreign = PyTuple_GET_ITEM(done.get(), 2);
  for (Py_ssize_t i = 0; foreign != Py_None && i < PyList_GET_SIZE(foreign); i++) {
    THPObjectPtr said(PyObject_CallOneArg(C.dropped, PyList_GET_ITEM(foreign, i)));
    if (!said) return nullptr;
  }
  for (Py_ssize_t i = 0; i < PyList_GET_SIZE(sends); i++) {
    PyObject* send = PyList_GET_ITEM(sends, i);
    THPObjectPtr sent(send_grads(self, PyTuple_GET_ITEM(send, 0), PyTuple_GET_ITEM(send, 1),
                                 PyTuple_GET_ITEM(send, 2)));
    if (!sent) return nullptr;
  }
  return Py_NewRef(leaves);
}

// PassState._failed(exc) for the Exception set; false where it is no Exception (left set)
// or _failed raised
bool failed(PassCore* self) {
  if (!PyErr_ExceptionMatches(PyExc_Exception)) return false;
  PyObject *type, *value, *traceback;
  PyErr_Fetch(&type, &value, &traceback);
  PyErr_NormalizeException(&type, &value, &traceback);
  if (traceback != nullptr) PyException_SetTraceback(value, traceback);
  Py_XDECREF(type);
  Py_XDECREF(traceback);
  THPObjectPtr exc(value);
  THPObjectPtr said(PyObject_CallMethodOneArg(reinterpret_cast<PyObject*>(self), s_failed,
                                              exc.get()));
  return said != nullptr;
}

// post(event): queue an event and process the queue unless another thread already does
PyObject* core_post(PyObject* self_, PyObject* event) {
  auto* self = reinterpret_cast<PassCore*>(self_);
  if (!bound(self)) return nullptr;
  PyObject* type = reinterpret_cast<PyObject*>(Py_TYPE(event));
  bool answered = type == C.gradients_event || type == C.resolve_event;
  THPObjectPtr caller;
  if (answered && self->parent == Py_None) {  // engaged, maybe: its caller, found first
    THPObjectPtr reply(PyObject_GetAttr(event, s_reply));
    if (!reply) return nullptr;
    if (reply.get() != Py_None) {
      caller = THPObjectPtr(PyObject_CallMethodOneArg(self_, s_caller, event));
      if (!caller) return nullptr;
    }
  }
  // (from here to the queue's check no Python call: the GIL keeps it whole)
  if (answered && self->parent == Py_None && caller) {
    THPObjectPtr reply(PyObject_GetAttr(event, s_reply));
    if (!reply) return nullptr;
    if (reply.get() != Py_None) {  // engaged: answered when everything is done
      if (PyObject_SetAttr(event, s_reply, Py_None) < 0) return nullptr;
      Py_SETREF(self->parent, reply.release());
      Py_SETREF(self->parent_rank, caller.release());
    }
  }
  self->events->push_back(Py_NewRef(event));
  if (self->running) Py_RETURN_NONE;
  self->running = 1;
  while (!self->events->empty()) {
    THPObjectPtr ev(self->events->front());  // (the queue's reference)
    self->events->pop_front();
    PyObject* et = reinterpret_cast<PyObject*>(Py_TYPE(ev.get()));
    THPObjectPtr reply(et == C.gradients_event || et == C.resolve_event
                           ? PyObject_GetAttr(ev.get(), s_reply) : Py_NewRef(Py_None));
    THPObjectPtr leaves(reply ? handle(self, ev.get()) : nullptr);
    if (!leaves) {
      if (!reply || !failed(self)) {
        self->running = 0;
        return nullptr;
      }
    }
    if (reply.get() != Py_None) {  // the answer first: the caller's pass waits for it
      THPObjectPtr report(own_report(self));
      THPObjectPtr answer(report ? pack(report.get(), 0) : nullptr);
      THPObjectPtr set(answer ? PyObject_CallMethodOneArg(reply.get(), s_set_result,
                                                          answer.get()) : nullptr);
      if (!set) {
        self->running = 0;
        return nullptr;
      }
    }
    if (leaves && leaves.get() != Py_None) {  // into the context (the pass still runs)
      THPObjectPtr pairs(PySequence_Fast(leaves.get(), "the leaves' gradients are a list"));
      // (ctx.gradients takes the context's lock the first time: not read at _bind, which
      // runs under it)
      if (pairs && PySequence_Fast_GET_SIZE(pairs.get()) > 0 && self->gradients == nullptr)
        self->gradients = PyObject_GetAttr(self->ctx, s_gradients);
      for (Py_ssize_t i = 0; pairs && self->gradients != nullptr &&
                             i < PySequence_Fast_GET_SIZE(pairs.get()); i++) {
        PyObject* pair = PySequence_Fast_GET_ITEM(pairs.get(), i);
        THPObjectPtr var(PySequence_GetItem(pair, 0));
        THPObjectPtr grad(var ? PySequence_GetItem(pair, 1) : nullptr);
        PyObject* call[3] = {self->gradients, var.get(), grad.get()};
        THPObjectPtr added(grad ? PyObject_VectorcallMethod(s_add, call, 3, nullptr) : nullptr);
        if (!added) break;
      }
      if (PyErr_Occurred() && !failed(self)) {
        self->running = 0;
        return nullptr;
      }
    }
    if (et == C.gradients_event) {
      int to_parent = attr_true(ev.get(), s_to_parent);
      if (to_parent < 0) {
        self->running = 0;
        return nullptr;
      }
      if (to_parent) self->handed_to_me--;  // handed over by a rank this one engaged
    }
  }
  self->running = 0;
  return maybe_finish(self);
}

// ---------------------------------------------------------------------- the type
PyObject* core_configure(PyObject* /*cls*/, PyObject* config) {
  if (!PyDict_Check(config)) {
    PyErr_SetString(PyExc_TypeError, "PassCore.configure(dict)");
    return nullptr;
  }
  struct Entry {
    const char* name;
    PyObject** slot;
  } entries[] = {{"RootsEvent", &C.roots_event},       {"GradientsEvent", &C.gradients_event},
                 {"ResolveEvent", &C.resolve_event},   {"event_numbers", &C.event_numbers},
                 {"profiler", &C.profiler},            {"merge_answer", &C.merge_answer},
                 {"merge", &C.merge},                  {"pack_answer", &C.pack_answer},
                 {"py_send", &C.py_send},              {"py_own_report", &C.py_own_report},
                 {"dropped", &C.dropped},              {"handed_key", &C.handed_key},
                 {"max_batch", &C.max_batch},          {"disjoint_terms", &C.disjoint_terms},
                 {"py_make_plan", &C.py_make_plan},    {"py_plan_of", &C.py_plan_of},
                 {"recv_types", &C.recv_types},        {"AccumulateGrad", &C.acc_type},
                 {"native", &C.native},                {"graph_globals", &C.graph_globals}};
  for (const Entry& entry : entries) {
    PyObject* value = PyDict_GetItemString(config, entry.name);  // borrowed
    if (value == nullptr) {
      PyErr_Format(PyExc_KeyError, "PassCore.configure: %s is missing", entry.name);
      return nullptr;
    }
    Py_XSETREF(*entry.slot, Py_NewRef(value));
  }
  struct Flag {
    const char* name;
    long* slot;
  } flags[] = {{"COMPACT_MIN_NUMEL", &C.compact_min}, {"RETAIN_GRAPH", &C.retain},
               {"SMART", &C.smart},                   {"NO_GRADIENT", &C.no_gradient},
               {"TO_PARENT", &C.to_parent},           {"EXPANDED", &C.expanded}};
  for (const Flag& flag : flags) {
    PyObject* value = PyDict_GetItemString(config, flag.name);
    if (value == nullptr) {
      PyErr_Format(PyExc_KeyError, "PassCore.configure: %s is missing", flag.name);
      return nullptr;
    }
    *flag.slot = PyLong_AsLong(value);
    if (*flag.slot == -1 && PyErr_Occurred()) return nullptr;
  }
  Py_RETURN_NONE;
}

PyMethodDef core_methods[] = {
    {"configure", core_configure, METH_O | METH_CLASS,
     "configure(dict): what engine.py hands over once (see torch_pass.cpp)"},
    {"_bind", core_bind, METH_NOARGS, "_bind(): what every event reads, once"},
    {"post", core_post, METH_O, "post(event): PassState.post"},
    {"_send", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(core_send)),
     METH_FASTCALL, "_send(peer, message_id, grads): PassState._send"},
    {"_call", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(core_call)),
     METH_FASTCALL, "_call(peer, handler, args): PassState._call"},
    {"_answered", core_answered, METH_O, "_answered(fut): PassState._answered"},
    {"_maybe_finish", core_maybe_finish, METH_NOARGS, "PassState._maybe_finish"},
    {"_make_plan", core_make_plan, METH_O,
     "_make_plan(root_edges): PassState._make_plan, in C++ for a DisjointPlan"},
    {nullptr, nullptr, 0, nullptr}};

PyMemberDef core_members[] = {
    {"parent", T_OBJECT, offsetof(PassCore, parent), 0, "the engaging call's answer, or None"},
    {"parent_rank", T_OBJECT, offsetof(PassCore, parent_rank), 0, "the rank that made it"},
    {"errors", T_OBJECT, offsetof(PassCore, errors), 0, "this rank's errors of the pass"},
    {"reports", T_OBJECT, offsetof(PassCore, reports), 0, "the reports merged so far"},
    {"deficit", T_PYSSIZET, offsetof(PassCore, deficit), 0, "calls not answered yet"},
    {"handed_over", T_PYSSIZET, offsetof(PassCore, handed_over), 0,
     "notifications sent to the parent since engaged"},
    {"handed_to_me", T_PYSSIZET, offsetof(PassCore, handed_to_me), 0,
     "notifications handed over to this rank, not processed yet"},
    {"running", T_BOOL, offsetof(PassCore, running), 0, "a thread runs the queue"},
    {nullptr, 0, 0, 0, nullptr}};

}  // namespace

int mpidag::add_pass_core(PyObject* module) {
  struct Name {
    PyObject** slot;
    const char* text;
  } names[] = {{&s_reply, "reply"}, {&s_to_parent, "to_parent"}, {&s_message_id, "message_id"},
               {&s_grads, "grads"}, {&s_edges, "edges"}, {&s_plan, "plan"},
               {&s_native_step, "native_step"}, {&s_make_plan, "_make_plan"},
               {&s_handle, "_handle"}, {&s_failed, "_failed"}, {&s_caller, "_caller"},
               {&s_seq, "seq"}, {&s_add, "add"}, {&s_set_result, "set_result"},
               {&s_set_exception, "set_exception"}, {&s_call, "call"}, {&s_notify, "notify"},
               {&s_add_internal_callback, "add_internal_callback"}, {&s_answered, "_answered"},
               {&s_record, "record"}, {&s_value, "value"}, {&s_dict, "__dict__"},
               {&s_pop, "pop"}, {&s_agent, "agent"}, {&s_ctx, "ctx"},
               {&s_context_id, "context_id"}, {&s_pass_id, "pass_id"},
               {&s_autograd, "autograd"}, {&s_gradients_handler, "gradients_handler"},
               {&s_retain_graph, "retain_graph"}, {&s_smart, "smart"}, {&s_root, "root"},
               {&s_rank, "rank"}, {&s_gradients, "gradients"}, {&s_passes, "passes"},
               {&s_lock, "lock"}, {&s_enter, "__enter__"}, {&s_exit, "__exit__"},
               {&s_complete, "complete"}, {&s_unreached, "_unreached"},
               {&s_recvs, "recvs"}, {&s_profiler_enabled, "_is_profiler_enabled"},
               {&s_sends, "sends"}, {&s_tensors, "_tensors"}, {&s_reach, "reach"},
               {&s_prepare, "prepare"}, {&s_edges_slot, "_edges"}, {&s_source_of, "source_of"},
               {&s_source_send, "source_send"}, {&s_step, "step"},
               {&s_answer_unreached, "_answer_unreached"}, {&s_disjoint_plan, "disjoint_plan"},
               {&s_engine_grad, "engine_grad"}, {&s_drop_unrun_tasks, "drop_unrun_tasks"}};
  for (const Name& name : names) {
    *name.slot = PyUnicode_InternFromString(name.text);
    if (*name.slot == nullptr) return -1;
  }
  core_type.tp_name = "_mpidag_torch.PassCore";
  core_type.tp_basicsize = sizeof(PassCore);
  core_type.tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC;
  core_type.tp_doc =
      "the event loop and termination counts of one rank's share of a backward pass "
      "(engine.NativePassState's base; see torch_pass.cpp)";
  core_type.tp_new = core_new;
  core_type.tp_dealloc = core_dealloc;
  core_type.tp_traverse = core_traverse;
  core_type.tp_clear = core_clear;
  core_type.tp_methods = core_methods;
  core_type.tp_members = core_members;
  if (PyType_Ready(&core_type) < 0) return -1;
  return PyModule_AddObjectRef(module, "PassCore", reinterpret_cast<PyObject*>(&core_type));
}
