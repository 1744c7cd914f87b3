// DisjointPlan: one rank's plan of a distributed backward pass in C++, for the common case
// (part of _mpidag_torch; see torch_native.cpp for the rest).
//
// mpidag.dist_autograd.graph.Plan runs the regions of the local graph reached from a pass's
// sources (the roots of backward(), each send function of the context) as their gradients
// arrive. In the common case no node is reached from two sources (a pipeline stage, a
// parameter server, the design document's example: graph.Plan._build checks the same), no
// recv function is behind two of them and no leaf reached is watched (no tensor hook, no
// post-accumulate-grad hook, no DDP parameter): then every source is a region of its own,
// runnable as soon as its gradients arrive, each recv function it reaches fires with it and
// every leaf gradient goes to the context as it is. That plan needs no node masks, no
// buffers across arrivals and no Python frame per step: this type is it.
//
//   disjoint_plan(sources, reaches, recv_types, AccumulateGrad, watch, engine_grad,
//                 drop_unrun_tasks, native, direct) -> DisjointPlan | None
//     sources:  one list of GradientEdge|None per source; reaches: each source's Reach (its
//     succ dict, leaf_edges, recv_edges, recv_nodes sets), or the 4-tuple of them that the
//     module's reach() gives; watch: None or a callable of a
//     leaf tensor (DDP's); engine_grad: graph.engine_grad (called where the direct engine
//     call cannot run: a gradient off the CPU, direct false, a Python node); drop_unrun_tasks:
//     graph.drop_unrun_tasks (called when the direct engine call raises). None where the
//     case is not the common one: graph.Plan runs it.
//
// The plan has graph.Plan's surface as the engine uses it: arrive(index, grads, retain),
// arrive_many(arrivals, retain) -> (leaves, fired), complete, arrived, n_sources, sources,
// recv_mask, fired, leaf_mask ({}), completed ([]), take_completed(), waiting_sources() ([]:
// a region, a recv function or a leaf of an arrived source is done with it).

#include <torch/csrc/python_headers.h>

#include <ATen/ATen.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/utils/object_ptr.h>

#include <structmember.h>

#include <algorithm>
#include <cstring>
#include <unordered_set>
#include <utility>
#include <vector>

#include "torch_records.h"

namespace {

PyObject *s_succ, *s_leaf_edges, *s_recv_edges, *s_recv_nodes, *s_variable, *s_backward_hooks,
    *s_post_hooks, *s_record, *s_context_id, *s_peer, *s_message_id, *s_n_outputs;

// what one source's region needs at its arrival
struct Source {
  PyObject* edges = nullptr;         // its edges (borrowed: the plan's sources list holds it)
  PyObject* stops = nullptr;         // list: its leaf and recv edges, where the engine stops
  std::vector<PyObject*> recv_nodes;  // borrowed: the plan's recv_mask holds them
};

struct PlanState {
  std::vector<Source> sources;
  std::vector<char> arrived;
  Py_ssize_t n_arrived = 0;
  bool direct = false;  // the C++ engine call may run (torch's autograd log is not at DEBUG)
};

struct DisjointPlan {
  PyObject_HEAD
  PlanState* state;
  PyObject* sources;       // list of the sources' edge lists
  PyObject* recv_mask;     // dict: recv node -> its source's bit
  PyObject* fired;         // set of the recv nodes that fired
  PyObject* recv_buffers;  // dict: recv node -> {output number: gradient}
  PyObject* recv_types;    // frozenset of the recv node types
  PyObject* acc_type;      // AccumulateGrad
  PyObject* engine_grad;   // graph.engine_grad
  PyObject* drop;          // graph.drop_unrun_tasks
  PyObject* native;        // this module (engine_grad's first argument)
  PyObject* empty_dict;    // leaf_mask
  PyObject* source_of;     // dict: send message id -> source index (name_sources), or null
};

PyTypeObject plan_type = {PyVarObject_HEAD_INIT(nullptr, 0)};

void plan_dealloc(PyObject* self) {
  auto* plan = reinterpret_cast<DisjointPlan*>(self);
  if (plan->state != nullptr) {
    for (Source& source : plan->state->sources) Py_XDECREF(source.stops);
    delete plan->state;
  }
  Py_XDECREF(plan->sources);
  Py_XDECREF(plan->recv_mask);
  Py_XDECREF(plan->fired);
  Py_XDECREF(plan->recv_buffers);
  Py_XDECREF(plan->recv_types);
  Py_XDECREF(plan->acc_type);
  Py_XDECREF(plan->engine_grad);
  Py_XDECREF(plan->drop);
  Py_XDECREF(plan->native);
  Py_XDECREF(plan->empty_dict);
  Py_XDECREF(plan->source_of);
  Py_TYPE(self)->tp_free(self);
}

// 1: a leaf's gradient accumulator, 2: a recv node, 0: another node; -1: an error
int kind_of(DisjointPlan* plan, PyObject* node) {
  PyObject* type = reinterpret_cast<PyObject*>(Py_TYPE(node));
  if (type == plan->acc_type) return 1;
  int recv = PySet_Contains(plan->recv_types, type);
  return recv < 0 ? -1 : recv ? 2 : 0;
}

// whether leaf node's tensor is watched (graph.Plan._watch): 1 yes, 0 no, -1 an error
int watched(PyObject* node, PyObject* watch) {
  THPObjectPtr var(PyObject_GetAttr(node, s_variable));
  if (!var) return -1;
  for (PyObject* name : {s_backward_hooks, s_post_hooks}) {
    THPObjectPtr hooks(PyObject_GetAttr(var.get(), name));
    if (!hooks) return -1;
    int truth = PyObject_IsTrue(hooks.get());
    if (truth != 0) return truth;
  }
  if (watch == Py_None) return 0;
  THPObjectPtr said(PyObject_CallOneArg(watch, var.get()));
  return said ? PyObject_IsTrue(said.get()) : -1;
}

// adds grad into dict[key] (dict[key] + grad where one is there); -1 on an error
int accumulate(PyObject* dict, PyObject* key, PyObject* grad) {
  PyObject* old = PyDict_GetItemWithError(dict, key);  // borrowed
  if (old == nullptr) {
    if (PyErr_Occurred()) return -1;
    return PyDict_SetItem(dict, key, grad);
  }
  THPObjectPtr sum(PyNumber_Add(old, grad));
  return sum ? PyDict_SetItem(dict, key, sum.get()) : -1;
}

// 1 << i as a Python int (a source's bit in graph.Plan's masks); nullptr on an error
PyObject* source_bit(size_t i) {
  THPObjectPtr one(PyLong_FromLong(1)), shift(PyLong_FromSize_t(i));
  return one && shift ? PyNumber_Lshift(one.get(), shift.get()) : nullptr;
}

// calls each(item) for every item of a set (through its iterator: no private CPython API);
// -1 on an error or where each returns -1, 1 where each returns 1 (stop), else 0
template <class Each>
int for_each(PyObject* set, Each each) {
  THPObjectPtr it(PyObject_GetIter(set));
  if (!it) return -1;
  while (PyObject* item = PyIter_Next(it.get())) {
    int said = each(item);  // (borrowed: the set holds it)
    Py_DECREF(item);
    if (said != 0) return said;
  }
  return PyErr_Occurred() ? -1 : 0;
}

// disjoint_plan(...): see the file's text
PyObject* disjoint_plan(PyObject* /*module*/, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 9 || !PyList_Check(args[0]) || !PyList_Check(args[1]) ||
      !PyFrozenSet_Check(args[2]) || !PyType_Check(args[3])) {
    PyErr_SetString(PyExc_TypeError,
                    "disjoint_plan(sources: list, reaches: list, recv_types: frozenset, "
                    "AccumulateGrad: type, watch, engine_grad, drop_unrun_tasks, native, "
                    "direct: bool)");
    return nullptr;
  }
  PyObject *sources = args[0], *reaches = args[1], *watch = args[4];
  const Py_ssize_t n = PyList_GET_SIZE(sources);
  if (n == 0 || PyList_GET_SIZE(reaches) != n) Py_RETURN_NONE;
  int direct = PyObject_IsTrue(args[8]);
  if (direct < 0) return nullptr;

  auto* plan = PyObject_New(DisjointPlan, &plan_type);
  if (plan == nullptr) return nullptr;
  plan->state = nullptr;
  plan->recv_mask = plan->fired = plan->recv_buffers = plan->empty_dict = nullptr;
  plan->source_of = nullptr;
  plan->sources = Py_NewRef(sources);
  plan->recv_types = Py_NewRef(args[2]);
  plan->acc_type = Py_NewRef(args[3]);
  plan->engine_grad = Py_NewRef(args[5]);
  plan->drop = Py_NewRef(args[6]);
  plan->native = Py_NewRef(args[7]);
  THPObjectPtr owner(reinterpret_cast<PyObject*>(plan));  // freed on every early return
  plan->recv_mask = PyDict_New();
  plan->fired = PySet_New(nullptr);
  plan->recv_buffers = PyDict_New();
  plan->empty_dict = PyDict_New();
  if (!plan->recv_mask || !plan->fired || !plan->recv_buffers || !plan->empty_dict)
    return nullptr;
  plan->state = new PlanState;
  PlanState& state = *plan->state;
  state.direct = direct != 0;
  state.sources.resize(static_cast<size_t>(n));
  state.arrived.assign(static_cast<size_t>(n), 0);

  // each source's reach; the largest one is checked against the others' nodes, not copied
  std::vector<THPObjectPtr> succs(static_cast<size_t>(n));
  Py_ssize_t largest = 0, largest_size = -1;
  std::unordered_set<PyObject*> checked;  // leaves already found unwatched
  for (Py_ssize_t i = 0; i < n; i++) {
    PyObject* edges = PyList_GET_ITEM(sources, i);
    PyObject* reach = PyList_GET_ITEM(reaches, i);
    if (!PyList_Check(edges)) {
      PyErr_SetString(PyExc_TypeError, "disjoint_plan: every source is a list of edges");
      return nullptr;
    }
    Source& source = state.sources[static_cast<size_t>(i)];
    source.edges = edges;
    THPObjectPtr succ, leaf_edges, recv_edges, recv_nodes;
    if (PyTuple_Check(reach) && PyTuple_GET_SIZE(reach) == 4) {  // native.reach()'s tuple
      succ = THPObjectPtr(Py_NewRef(PyTuple_GET_ITEM(reach, 0)));
      leaf_edges = THPObjectPtr(Py_NewRef(PyTuple_GET_ITEM(reach, 1)));
      recv_edges = THPObjectPtr(Py_NewRef(PyTuple_GET_ITEM(reach, 2)));
      recv_nodes = THPObjectPtr(Py_NewRef(PyTuple_GET_ITEM(reach, 3)));
    } else {  // a graph.Reach
      succ = THPObjectPtr(PyObject_GetAttr(reach, s_succ));
      leaf_edges = THPObjectPtr(PyObject_GetAttr(reach, s_leaf_edges));
      recv_edges = THPObjectPtr(PyObject_GetAttr(reach, s_recv_edges));
      recv_nodes = THPObjectPtr(PyObject_GetAttr(reach, s_recv_nodes));
    }
    if (!succ || !leaf_edges || !recv_edges || !recv_nodes) return nullptr;
    if (!PyDict_Check(succ.get()) || !PyAnySet_Check(leaf_edges.get()) ||
        !PyAnySet_Check(recv_edges.get()) || !PyAnySet_Check(recv_nodes.get())) {
      PyErr_SetString(PyExc_TypeError, "disjoint_plan: a reach is (dict, set, set, set)");
      return nullptr;
    }
    // its recv nodes: a recv node behind two sources is not the common case
    THPObjectPtr mask(source_bit(static_cast<size_t>(i)));
    if (!mask) return nullptr;
    int said = for_each(recv_nodes.get(), [&](PyObject* node) {
      int seen = PyDict_Contains(plan->recv_mask, node);
      if (seen != 0) return seen;
      if (PyDict_SetItem(plan->recv_mask, node, mask.get()) < 0) return -1;
      source.recv_nodes.push_back(node);  // (borrowed: recv_mask holds it)
      return 0;
    });
    if (said < 0) return nullptr;
    if (said > 0) Py_RETURN_NONE;
    // where the engine stops: the leaf edges, then the recv edges (graph.Plan._run's order)
    source.stops = PyList_New(0);
    if (source.stops == nullptr) return nullptr;
    for (PyObject* set : {leaf_edges.get(), recv_edges.get()}) {
      if (for_each(set, [&](PyObject* key) { return PyList_Append(source.stops, key); }) < 0)
        return nullptr;
    }
    // the leaves reached, behind the source or as its edges: watched ones need graph.Plan
    auto check_leaf = [&](PyObject* leaf) {
      return checked.insert(leaf).second ? watched(leaf, watch) : 0;
    };
    said = for_each(leaf_edges.get(), [&](PyObject* key) {
      return check_leaf(PyTuple_GET_ITEM(key, 0));
    });
    for (Py_ssize_t e = 0; said == 0 && e < PyList_GET_SIZE(edges); e++) {
      PyObject* edge = PyList_GET_ITEM(edges, e);
      if (edge == Py_None) continue;
      if (!PyTuple_Check(edge) || PyTuple_GET_SIZE(edge) < 2) {
        PyErr_SetString(PyExc_TypeError, "disjoint_plan: an edge is a GradientEdge or None");
        return nullptr;
      }
      PyObject* leaf = PyTuple_GET_ITEM(edge, 0);
      if (reinterpret_cast<PyObject*>(Py_TYPE(leaf)) == plan->acc_type) said = check_leaf(leaf);
    }
    if (said < 0) return nullptr;
    if (said > 0) Py_RETURN_NONE;
    if (PyDict_GET_SIZE(succ.get()) > largest_size) {
      largest = i;
      largest_size = PyDict_GET_SIZE(succ.get());
    }
    succs[static_cast<size_t>(i)] = std::move(succ);
  }
  // no node in two reaches (graph._disjoint): the others' nodes once, then the largest's
  std::unordered_set<PyObject*> seen;
  for (Py_ssize_t i = 0; i < n; i++) {
    if (i == largest) continue;
    Py_ssize_t pos = 0;
    PyObject *node, *value;
    while (PyDict_Next(succs[static_cast<size_t>(i)].get(), &pos, &node, &value)) {
      if (!seen.insert(node).second) Py_RETURN_NONE;
    }
  }
  PyObject* big = succs[static_cast<size_t>(largest)].get();
  for (PyObject* node : seen) {
    int shared = PyDict_Contains(big, node);
    if (shared < 0) return nullptr;
    if (shared) Py_RETURN_NONE;
  }
  return owner.release();
}

// the (leaf tensor, gradient) pair of a leaf's gradient into leaves; -1 on an error
int add_leaf(PyObject* leaves, PyObject* node, PyObject* grad) {
  THPObjectPtr var(PyObject_GetAttr(node, s_variable));
  if (!var) return -1;
  THPObjectPtr pair(PyTuple_Pack(2, var.get(), grad));
  return pair ? PyList_Append(leaves, pair.get()) : -1;
}

// a recv node's gradient at output number key[1] into its buffer; -1 on an error
int add_recv(DisjointPlan* plan, PyObject* key, PyObject* grad) {
  PyObject* node = PyTuple_GET_ITEM(key, 0);
  PyObject* slots = PyDict_GetItemWithError(plan->recv_buffers, node);  // borrowed
  if (slots == nullptr) {
    if (PyErr_Occurred()) return -1;
    THPObjectPtr made(PyDict_New());
    if (!made || PyDict_SetItem(plan->recv_buffers, node, made.get()) < 0) return -1;
    slots = made.get();  // (the buffers hold it)
  }
  return accumulate(slots, PyTuple_GET_ITEM(key, 1), grad);
}

// one engine call: the gradients at stops of grads entering at outputs; nullptr on an error
PyObject* run_engine(DisjointPlan* plan, PyObject* outputs, PyObject* grads, PyObject* stops,
                     PyObject* retain) {
  bool cpu = plan->state->direct;
  for (Py_ssize_t i = 0; cpu && i < PyList_GET_SIZE(grads); i++) {
    PyObject* grad = PyList_GET_ITEM(grads, i);
    cpu = THPVariable_Check(grad) && THPVariable_Unpack(grad).is_cpu();
  }
  if (cpu) {
    PyObject* call[4] = {outputs, grads, stops, retain};
    PyObject* results = mpidag::run_grad(plan->native, call, 4);
    if (results == nullptr) {  // free what the failed call left queued, then raise
      PyObject *type, *value, *traceback;
      PyErr_Fetch(&type, &value, &traceback);
      PyObject* dropped = PyObject_CallNoArgs(plan->drop);
      Py_XDECREF(dropped);
      PyErr_Clear();
      PyErr_Restore(type, value, traceback);
      return nullptr;
    }
    if (results != Py_None) return results;
    Py_DECREF(results);  // a Python node: graph.engine_grad runs it
  }
  PyObject* call[5] = {plan->native, outputs, grads, stops, retain};
  return PyObject_Vectorcall(plan->engine_grad, call, 5, nullptr);
}

// the index of an arrival (index, grads), checked; -1 on an error (set)
Py_ssize_t arrival_index(DisjointPlan* plan, PyObject* arrival, PyObject** grads) {
  if (!PyTuple_Check(arrival) || PyTuple_GET_SIZE(arrival) != 2) {
    PyErr_SetString(PyExc_TypeError, "arrive_many: every arrival is (index, gradients)");
    return -1;
  }
  Py_ssize_t index = PyLong_AsSsize_t(PyTuple_GET_ITEM(arrival, 0));
  if (index == -1 && PyErr_Occurred()) return -1;
  PlanState& state = *plan->state;
  if (index < 0 || index >= static_cast<Py_ssize_t>(state.sources.size())) {
    PyErr_Format(PyExc_IndexError, "source %zd of a plan of %zu", index, state.sources.size());
    return -1;
  }
  *grads = PyTuple_GET_ITEM(arrival, 1);
  if (!PyList_Check(*grads)) {
    PyErr_SetString(PyExc_TypeError, "arrive_many: the gradients are a list");
    return -1;
  }
  return index;
}

// the positional arguments of a METH_FASTCALL | METH_KEYWORDS call whose last parameter,
// retain_graph, may be given by name (graph.Plan's signature); false on an error (set)
bool positional(const char* signature, PyObject* const* args, Py_ssize_t nargs,
                PyObject* kwnames, Py_ssize_t expected, std::vector<PyObject*>& out) {
  Py_ssize_t nkw = kwnames == nullptr ? 0 : PyTuple_GET_SIZE(kwnames);
  out.assign(args, args + nargs);
  if (nkw == 1 && nargs == expected - 1 &&
      PyUnicode_CompareWithASCIIString(PyTuple_GET_ITEM(kwnames, 0), "retain_graph") == 0) {
    out.push_back(args[nargs]);
  }
  if (static_cast<Py_ssize_t>(out.size()) != expected || (nkw != 0 && nargs != expected - 1)) {
    PyErr_SetString(PyExc_TypeError, signature);
    return false;
  }
  return true;
}

// arrive_many(arrivals: list[(index, grads)], retain_graph) -> (leaves, fired)
PyObject* plan_arrive_many(PyObject* self, PyObject* const* given, Py_ssize_t nargs,
                           PyObject* kwnames) {
  auto* plan = reinterpret_cast<DisjointPlan*>(self);
  std::vector<PyObject*> args;
  if (!positional("arrive_many(arrivals: list, retain_graph: bool)", given, nargs, kwnames, 2,
                  args))
    return nullptr;
  if (!PyList_Check(args[0])) {
    PyErr_SetString(PyExc_TypeError, "arrive_many(arrivals: list, retain_graph: bool)");
    return nullptr;
  }
  PlanState& state = *plan->state;
  PyObject* arrivals = args[0];
  const Py_ssize_t n = PyList_GET_SIZE(arrivals);
  std::vector<Py_ssize_t> indices(static_cast<size_t>(n));
  for (Py_ssize_t a = 0; a < n; a++) {  // check all before taking any
    PyObject* grads;
    Py_ssize_t index = arrival_index(plan, PyList_GET_ITEM(arrivals, a), &grads);
    if (index < 0) return nullptr;
    bool twice = state.arrived[static_cast<size_t>(index)] != 0;
    for (Py_ssize_t b = 0; b < a && !twice; b++) twice = indices[static_cast<size_t>(b)] == index;
    if (twice) {
      PyErr_Format(PyExc_RuntimeError, "source %zd of this backward pass got gradients twice",
                   index);
      return nullptr;
    }
    Py_ssize_t expected = PyList_GET_SIZE(state.sources[static_cast<size_t>(index)].edges);
    if (PyList_GET_SIZE(grads) != expected) {
      PyErr_Format(PyExc_RuntimeError, "source %zd expects %zd gradients, got %zd", index,
                   expected, PyList_GET_SIZE(grads));
      return nullptr;
    }
    indices[static_cast<size_t>(a)] = index;
  }
  THPObjectPtr leaves(PyList_New(0)), fired(PyList_New(0));
  THPObjectPtr outputs(PyList_New(0)), grads_in(PyList_New(0)), stops(PyList_New(0));
  if (!leaves || !fired || !outputs || !grads_in || !stops) return nullptr;
  for (Py_ssize_t a = 0; a < n; a++) {
    const Py_ssize_t index = indices[static_cast<size_t>(a)];
    state.arrived[static_cast<size_t>(index)] = 1;
    state.n_arrived++;
    Source& source = state.sources[static_cast<size_t>(index)];
    PyObject* grads = PyTuple_GET_ITEM(PyList_GET_ITEM(arrivals, a), 1);
    for (Py_ssize_t e = 0; e < PyList_GET_SIZE(grads); e++) {
      PyObject* key = PyList_GET_ITEM(source.edges, e);
      PyObject* grad = PyList_GET_ITEM(grads, e);
      if (key == Py_None || grad == Py_None || PyTuple_GET_ITEM(key, 0) == Py_None) continue;
      switch (kind_of(plan, PyTuple_GET_ITEM(key, 0))) {
        case 1:
          if (add_leaf(leaves.get(), PyTuple_GET_ITEM(key, 0), grad) < 0) return nullptr;
          break;
        case 2:
          if (add_recv(plan, key, grad) < 0) return nullptr;
          break;
        case 0: {  // into the region: two edges of one source to one node's input add up
          Py_ssize_t found = -1;
          for (Py_ssize_t o = 0; o < PyList_GET_SIZE(outputs.get()) && found < 0; o++) {
            int same = PyObject_RichCompareBool(PyList_GET_ITEM(outputs.get(), o), key, Py_EQ);
            if (same < 0) return nullptr;
            if (same) found = o;
          }
          if (found < 0) {
            if (PyList_Append(outputs.get(), key) < 0 || PyList_Append(grads_in.get(), grad) < 0)
              return nullptr;
          } else {
            PyObject* sum = PyNumber_Add(PyList_GET_ITEM(grads_in.get(), found), grad);
            if (sum == nullptr) return nullptr;
            PyList_SetItem(grads_in.get(), found, sum);  // (steals sum)
          }
          break;
        }
        default:
          return nullptr;
      }
    }
    if (n == 1) {
      stops = THPObjectPtr(Py_NewRef(source.stops));
    } else {  // several regions in one call: a leaf two of them reach is one stop
      for (Py_ssize_t s = 0; s < PyList_GET_SIZE(source.stops); s++) {
        PyObject* key = PyList_GET_ITEM(source.stops, s);
        int there = PySequence_Contains(stops.get(), key);
        if (there < 0 || (!there && PyList_Append(stops.get(), key) < 0)) return nullptr;
      }
    }
  }
  if (PyList_GET_SIZE(outputs.get()) > 0 && PyList_GET_SIZE(stops.get()) > 0) {
    THPObjectPtr results(run_engine(plan, outputs.get(), grads_in.get(), stops.get(), args[1]));
    if (!results) return nullptr;
    THPObjectPtr seq(PySequence_Fast(results.get(), "the engine's gradients are a sequence"));
    if (!seq) return nullptr;
    if (PySequence_Fast_GET_SIZE(seq.get()) != PyList_GET_SIZE(stops.get())) {
      PyErr_SetString(PyExc_RuntimeError, "the engine gave one gradient per stop, not as many");
      return nullptr;
    }
    for (Py_ssize_t s = 0; s < PyList_GET_SIZE(stops.get()); s++) {
      PyObject* grad = PySequence_Fast_GET_ITEM(seq.get(), s);
      if (grad == Py_None) continue;
      PyObject* key = PyList_GET_ITEM(stops.get(), s);
      int kind = kind_of(plan, PyTuple_GET_ITEM(key, 0));
      if (kind < 0) return nullptr;
      if ((kind == 1 ? add_leaf(leaves.get(), PyTuple_GET_ITEM(key, 0), grad)
                     : add_recv(plan, key, grad)) < 0)
        return nullptr;
    }
  }
  for (Py_ssize_t a = 0; a < n; a++) {  // every recv node of an arrived source fires
    Source& source = state.sources[static_cast<size_t>(indices[static_cast<size_t>(a)])];
    for (PyObject* node : source.recv_nodes) {
      if (PySet_Add(plan->fired, node) < 0) return nullptr;
      PyObject* slots = PyDict_GetItemWithError(plan->recv_buffers, node);  // borrowed
      THPObjectPtr taken(slots == nullptr ? PyDict_New() : Py_NewRef(slots));
      if (!taken || (slots == nullptr && PyErr_Occurred())) return nullptr;
      if (slots != nullptr && PyDict_DelItem(plan->recv_buffers, node) < 0) return nullptr;
      THPObjectPtr pair(PyTuple_Pack(2, node, taken.get()));
      if (!pair || PyList_Append(fired.get(), pair.get()) < 0) return nullptr;
    }
  }
  return PyTuple_Pack(2, leaves.get(), fired.get());
}

// arrive(index, grads, retain_graph): arrive_many([(index, grads)], retain_graph)
PyObject* plan_arrive(PyObject* self, PyObject* const* given, Py_ssize_t nargs,
                      PyObject* kwnames) {
  std::vector<PyObject*> args;
  if (!positional("arrive(index: int, grads: list, retain_graph: bool)", given, nargs, kwnames,
                  3, args))
    return nullptr;
  THPObjectPtr arrival(PyTuple_Pack(2, args[0], args[1]));
  if (!arrival) return nullptr;
  THPObjectPtr arrivals(PyList_New(1));
  if (!arrivals) return nullptr;
  PyList_SET_ITEM(arrivals.get(), 0, arrival.release());
  PyObject* call[2] = {arrivals.get(), args[2]};
  return plan_arrive_many(self, call, 2, nullptr);
}

// name_sources(ids): the message id of each source's send function (None: the roots), so
// that step() finds a gradient message's sources itself
PyObject* plan_name_sources(PyObject* self, PyObject* ids) {
  auto* plan = reinterpret_cast<DisjointPlan*>(self);
  const Py_ssize_t n = static_cast<Py_ssize_t>(plan->state->sources.size());
  if (!PyList_Check(ids) || PyList_GET_SIZE(ids) != n) {
    PyErr_Format(PyExc_TypeError, "name_sources(ids): a list of %zd message ids or None", n);
    return nullptr;
  }
  THPObjectPtr source_of(PyDict_New());
  if (!source_of) return nullptr;
  for (Py_ssize_t i = 0; i < n; i++) {
    PyObject* id = PyList_GET_ITEM(ids, i);
    if (id == Py_None) continue;
    THPObjectPtr index(PyLong_FromSsize_t(i));
    if (!index || PyDict_SetItem(source_of.get(), id, index.get()) < 0) return nullptr;
  }
  Py_XSETREF(plan->source_of, source_of.release());
  Py_RETURN_NONE;
}

// the arrivals [(index, grads)] of a gradient message for the send functions message_id (an
// int or a tuple of them: their gradients one after the other in grads, None: SMART's "no
// gradient"), as PassState._arrivals makes them; Py_None where the message does not fit the
// plan (an unknown id, a wrong count: PassState._arrivals raises the error); null: an error
PyObject* message_arrivals(DisjointPlan* plan, PyObject* message_id, PyObject* grads) {
  if (plan->source_of == nullptr) Py_RETURN_NONE;
  if (grads != Py_None && !PyList_Check(grads) && !PyTuple_Check(grads)) Py_RETURN_NONE;
  const bool many = PyTuple_Check(message_id);
  const Py_ssize_t n_ids = many ? PyTuple_GET_SIZE(message_id) : 1;
  const Py_ssize_t n_grads = grads == Py_None ? 0 : PySequence_Fast_GET_SIZE(grads);
  THPObjectPtr arrivals(PyList_New(n_ids));
  if (!arrivals) return nullptr;
  Py_ssize_t offset = 0;
  for (Py_ssize_t k = 0; k < n_ids; k++) {
    PyObject* id = many ? PyTuple_GET_ITEM(message_id, k) : message_id;
    PyObject* index = PyDict_GetItemWithError(plan->source_of, id);  // borrowed
    if (index == nullptr) {
      if (PyErr_Occurred()) return nullptr;
      Py_RETURN_NONE;
    }
    const Py_ssize_t i = PyLong_AsSsize_t(index);
    const Py_ssize_t n = PyList_GET_SIZE(plan->state->sources[static_cast<size_t>(i)].edges);
    THPObjectPtr part(PyList_New(n));
    if (!part) return nullptr;
    for (Py_ssize_t e = 0; e < n; e++) {
      PyObject* grad = Py_None;
      if (grads != Py_None) {
        if (offset + e >= n_grads) Py_RETURN_NONE;
        grad = PySequence_Fast_GET_ITEM(grads, offset + e);
      }
      PyList_SET_ITEM(part.get(), e, Py_NewRef(grad));
    }
    if (grads != Py_None) offset += n;
    PyObject* arrival = PyTuple_Pack(2, index, part.get());
    if (arrival == nullptr) return nullptr;
    PyList_SET_ITEM(arrivals.get(), k, arrival);
  }
  if (grads != Py_None && offset != n_grads) Py_RETURN_NONE;
  return arrivals.release();
}

// the gradient messages of the recv nodes that fired ([(node, {output: grad})], in firing
// order), as PassState._handle groups them: one a peer, up to max_batch recv functions each
// ((peer, message id, grads), or (peer, (ids...), their grads one after the other)); the
// records of another context than context_id go to foreign (made only when one is there)
PyObject* fired_messages(PyObject* fired, PyObject* context_id, Py_ssize_t max_batch,
                         THPObjectPtr& foreign) {
  THPObjectPtr by_peer(PyDict_New());  // peer -> [(message id, grads)], in firing order
  if (!by_peer) return nullptr;
  for (Py_ssize_t f = 0; f < PyList_GET_SIZE(fired); f++) {
    PyObject* pair = PyList_GET_ITEM(fired, f);
    PyObject* slots = PyTuple_GET_ITEM(pair, 1);
    THPObjectPtr record(PyObject_GetAttr(PyTuple_GET_ITEM(pair, 0), s_record));
    if (!record) return nullptr;
    THPObjectPtr ctx(PyObject_GetAttr(record.get(), s_context_id));
    if (!ctx) return nullptr;
    int same = PyObject_RichCompareBool(ctx.get(), context_id, Py_EQ);
    if (same < 0) return nullptr;
    if (!same) {
      if (!foreign) foreign = THPObjectPtr(PyList_New(0));
      if (!foreign || PyList_Append(foreign.get(), record.get()) < 0) return nullptr;
      continue;
    }
    THPObjectPtr peer(PyObject_GetAttr(record.get(), s_peer));
    THPObjectPtr id(PyObject_GetAttr(record.get(), s_message_id));
    THPObjectPtr count(PyObject_GetAttr(record.get(), s_n_outputs));
    if (!peer || !id || !count) return nullptr;
    const Py_ssize_t n = PyLong_AsSsize_t(count.get());
    if (n < 0) {
      if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "a record of -1 outputs");
      return nullptr;
    }
    THPObjectPtr grads(PyList_New(n));
    if (!grads) return nullptr;
    for (Py_ssize_t i = 0; i < n; i++) {
      THPObjectPtr key(PyLong_FromSsize_t(i));
      if (!key) return nullptr;
      PyObject* grad = PyDict_GetItemWithError(slots, key.get());  // borrowed
      if (grad == nullptr && PyErr_Occurred()) return nullptr;
      PyList_SET_ITEM(grads.get(), i, Py_NewRef(grad == nullptr ? Py_None : grad));
    }
    PyObject* ready = PyDict_GetItemWithError(by_peer.get(), peer.get());  // borrowed
    if (ready == nullptr) {
      if (PyErr_Occurred()) return nullptr;
      THPObjectPtr made(PyList_New(0));
      if (!made || PyDict_SetItem(by_peer.get(), peer.get(), made.get()) < 0) return nullptr;
      ready = made.get();  // (by_peer holds it)
    }
    THPObjectPtr item(PyTuple_Pack(2, id.get(), grads.get()));
    if (!item || PyList_Append(ready, item.get()) < 0) return nullptr;
  }
  THPObjectPtr sends(PyList_New(0));
  if (!sends) return nullptr;
  Py_ssize_t pos = 0;
  PyObject *peer, *ready;
  while (PyDict_Next(by_peer.get(), &pos, &peer, &ready)) {
    const Py_ssize_t n = PyList_GET_SIZE(ready);
    for (Py_ssize_t start = 0; start < n; start += max_batch) {
      const Py_ssize_t end = std::min(n, start + max_batch);
      THPObjectPtr send;
      if (end - start == 1) {
        PyObject* item = PyList_GET_ITEM(ready, start);
        send = THPObjectPtr(
            PyTuple_Pack(3, peer, PyTuple_GET_ITEM(item, 0), PyTuple_GET_ITEM(item, 1)));
      } else {
        THPObjectPtr ids(PyTuple_New(end - start)), flat(PyList_New(0));
        if (!ids || !flat) return nullptr;
        for (Py_ssize_t k = start; k < end; k++) {
          PyObject* item = PyList_GET_ITEM(ready, k);
          PyTuple_SET_ITEM(ids.get(), k - start, Py_NewRef(PyTuple_GET_ITEM(item, 0)));
          PyObject* grads = PyTuple_GET_ITEM(item, 1);
          for (Py_ssize_t g = 0; g < PyList_GET_SIZE(grads); g++) {
            if (PyList_Append(flat.get(), PyList_GET_ITEM(grads, g)) < 0) return nullptr;
          }
        }
        send = THPObjectPtr(PyTuple_Pack(3, peer, ids.get(), flat.get()));
      }
      if (!send || PyList_Append(sends.get(), send.get()) < 0) return nullptr;
    }
  }
  return sends.release();
}

// step(message_id, grads, retain_graph, context_id, max_batch) -> (leaves, sends, foreign)
// | None: one event of PassState._handle in one call. message_id None: the roots' gradients
// (source 0); else a gradient message's (see message_arrivals). sends: the gradient
// messages of the recv functions that fired (see fired_messages); foreign: None, or the
// records of fired recv functions of another context (dropped). None (nothing done): a
// message that does not fit the plan, whose error PassState's Python path raises.
PyObject* plan_step(PyObject* self, PyObject* const* args, Py_ssize_t nargs) {
  auto* plan = reinterpret_cast<DisjointPlan*>(self);
  if (nargs != 5) {
    PyErr_SetString(PyExc_TypeError,
                    "step(message_id, grads, retain_graph, context_id, max_batch)");
    return nullptr;
  }
  const Py_ssize_t max_batch = PyLong_AsSsize_t(args[4]);
  if (max_batch < 1) {
    if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "step: max_batch is at least 1");
    return nullptr;
  }
  THPObjectPtr arrivals;
  if (args[0] == Py_None) {
    if (!PyList_Check(args[1])) Py_RETURN_NONE;
    THPObjectPtr zero(PyLong_FromLong(0));
    THPObjectPtr arrival(zero ? PyTuple_Pack(2, zero.get(), args[1]) : nullptr);
    arrivals = THPObjectPtr(arrival ? PyList_New(1) : nullptr);
    if (!arrivals) return nullptr;
    PyList_SET_ITEM(arrivals.get(), 0, arrival.release());
  } else {
    arrivals = THPObjectPtr(message_arrivals(plan, args[0], args[1]));
    if (!arrivals) return nullptr;
    if (arrivals.get() == Py_None) return arrivals.release();
  }
  PyObject* call[2] = {arrivals.get(), args[2]};
  THPObjectPtr done(plan_arrive_many(self, call, 2, nullptr));
  if (!done) return nullptr;
  THPObjectPtr foreign;
  THPObjectPtr sends(fired_messages(PyTuple_GET_ITEM(done.get(), 1), args[3], max_batch, foreign));
  if (!sends) return nullptr;
  return PyTuple_Pack(3, PyTuple_GET_ITEM(done.get(), 0), sends.get(),
                      foreign ? foreign.get() : Py_None);
}

// t.contiguous() for a small strided CPU tensor that needs a copy: its elements gathered
// by a loop over its strides into a new tensor (at::empty, then memcpy of each element),
// without the copy kernel's machinery, whose first run after a few milliseconds of other
// work costs ~20 us (profile_backward_path.py, "the cost of a cold start"), ~10x its warm
// run: the first gradient message of a pass (a sum()'s expanded gradient) makes one on the
// critical path. Larger tensors and the rest take the kernel.
constexpr int64_t GATHER_MAX_NUMEL = 1 << 14;

at::Tensor dense_copy(const at::Tensor& t) {
  if (!t.is_cpu() || t.is_conj() || t.is_neg() || t.requires_grad() || t.is_quantized() ||
      t.numel() > GATHER_MAX_NUMEL || t.dim() > 8 || t.dim() == 0)
    return t.contiguous();
  at::Tensor out = at::empty(t.sizes(), t.options());
  const int64_t n = t.numel(), dims = t.dim();
  const size_t size = t.element_size();
  const auto sizes = t.sizes();
  const auto strides = t.strides();
  const char* src = static_cast<const char*>(t.const_data_ptr());
  char* dst = static_cast<char*>(out.data_ptr());
  int64_t index[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t at = 0;  // the element's offset from src, in elements
  for (int64_t i = 0; i < n; i++) {
    std::memcpy(dst + static_cast<size_t>(i) * size, src + at * static_cast<int64_t>(size),
                size);
    for (int64_t d = dims - 1; d >= 0; d--) {  // the next index, the last dimension first
      at += strides[d];
      if (++index[d] < sizes[d]) break;
      at -= strides[d] * sizes[d];
      index[d] = 0;
    }
  }
  return out;
}

// compact_grads(grads, min_numel) -> (sent, shapes | None) | None: engine._compact of each
// gradient in C++ (None: one that is not exactly a torch.Tensor, which the Python one does)
PyObject* compact_grads(PyObject* /*module*/, PyObject* const* args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  if (nargs != 2 || (!PyList_Check(args[0]) && !PyTuple_Check(args[0]))) {
    PyErr_SetString(PyExc_TypeError, "compact_grads(grads: list, min_numel: int)");
    return nullptr;
  }
  const long long min_numel = PyLong_AsLongLong(args[1]);
  if (min_numel == -1 && PyErr_Occurred()) return nullptr;
  const Py_ssize_t n = PySequence_Fast_GET_SIZE(args[0]);
  THPObjectPtr sent(PyList_New(n));
  if (!sent) return nullptr;
  THPObjectPtr shapes;
  for (Py_ssize_t i = 0; i < n; i++) {
    PyObject* grad = PySequence_Fast_GET_ITEM(args[0], i);
    PyObject* out = nullptr;  // new reference
    PyObject* shape = nullptr;
    if (grad == Py_None) {
      out = Py_NewRef(grad);
    } else {
      if (!THPVariable_CheckExact(grad)) Py_RETURN_NONE;
      const at::Tensor& t = THPVariable_Unpack(grad);
      if (t.layout() != at::kStrided || t.is_contiguous()) {
        out = Py_NewRef(grad);
      } else {
        at::Tensor distinct = t;
        if (t.numel() >= min_numel && t.dim() <= 8) {  // a broadcast: its distinct elements
          for (int64_t d = 0; d < t.dim(); d++) {
            if (t.stride(d) == 0 && t.size(d) > 1) distinct = distinct.narrow(d, 0, 1);
          }
        }
        if (!distinct.is_same(t)) {
          shape = PyTuple_New(t.dim());
          if (shape == nullptr) return nullptr;
          for (int64_t d = 0; d < t.dim(); d++) {
            PyObject* size = PyLong_FromLongLong(t.size(d));
            if (size == nullptr) {
              Py_DECREF(shape);
              return nullptr;
            }
            PyTuple_SET_ITEM(shape, d, size);
          }
        }
        out = THPVariable_Wrap(dense_copy(distinct));
        if (out == nullptr) {
          Py_XDECREF(shape);
          return nullptr;
        }
      }
    }
    PyList_SET_ITEM(sent.get(), i, out);
    if (shape != nullptr) {
      if (!shapes) {
        shapes = THPObjectPtr(PyList_New(n));
        if (!shapes) {
          Py_DECREF(shape);
          return nullptr;
        }
        for (Py_ssize_t k = 0; k < n; k++) PyList_SET_ITEM(shapes.get(), k, Py_NewRef(Py_None));
      }
      PyList_SetItem(shapes.get(), i, shape);  // (steals shape)
    }
  }
  return PyTuple_Pack(2, sent.get(), shapes ? shapes.get() : Py_None);
  END_HANDLE_TH_ERRORS
}

PyObject* plan_take_completed(PyObject* /*self*/, PyObject* /*unused*/) {
  return PyList_New(0);  // (no watched leaf: leaves go to the context as they arrive)
}

PyObject* plan_waiting_sources(PyObject* /*self*/, PyObject* /*unused*/) {
  return PyList_New(0);  // (every region and recv function of an arrived source is done)
}

PyObject* plan_complete(PyObject* self, void* /*unused*/) {
  PlanState& state = *reinterpret_cast<DisjointPlan*>(self)->state;
  return PyBool_FromLong(state.n_arrived == static_cast<Py_ssize_t>(state.sources.size()));
}

PyObject* plan_arrived(PyObject* self, void* /*unused*/) {
  PlanState& state = *reinterpret_cast<DisjointPlan*>(self)->state;
  THPObjectPtr mask(PyLong_FromLong(0));
  for (size_t i = 0; mask && i < state.sources.size(); i++) {
    if (!state.arrived[i]) continue;
    THPObjectPtr bit(source_bit(i));
    if (!bit) return nullptr;
    mask = THPObjectPtr(PyNumber_Or(mask.get(), bit.get()));
  }
  return mask.release();
}

PyObject* plan_n_sources(PyObject* self, void* /*unused*/) {
  return PyLong_FromSize_t(reinterpret_cast<DisjointPlan*>(self)->state->sources.size());
}

PyObject* plan_completed(PyObject* /*self*/, void* /*unused*/) { return PyList_New(0); }

PyMethodDef plan_methods[] = {
    {"arrive_many",
     reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(plan_arrive_many)),
     METH_FASTCALL | METH_KEYWORDS,
     "arrive_many(arrivals, retain_graph) -> (leaves, fired): graph.Plan.arrive_many"},
    {"arrive", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(plan_arrive)),
     METH_FASTCALL | METH_KEYWORDS, "arrive(index, grads, retain_graph) -> (leaves, fired)"},
    {"step", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(plan_step)),
     METH_FASTCALL,
     "step(message_id, grads, retain_graph, context_id, max_batch) -> (leaves, sends, "
     "foreign) | None: one event of the pass (message_id None: the roots)"},
    {"name_sources", plan_name_sources, METH_O,
     "name_sources(ids): each source's send message id (None: the roots), for step()"},
    {"take_completed", plan_take_completed, METH_NOARGS,
     "take_completed() -> []: no leaf of this plan is watched"},
    {"waiting_sources", plan_waiting_sources, METH_NOARGS,
     "waiting_sources() -> []: a region never waits for a second source"},
    {nullptr, nullptr, 0, nullptr}};

PyMemberDef plan_members[] = {
    {"sources", T_OBJECT, offsetof(DisjointPlan, sources), READONLY,
     "each source's edges (GradientEdge or None)"},
    {"recv_mask", T_OBJECT, offsetof(DisjointPlan, recv_mask), READONLY,
     "recv node -> the bit of the one source that reaches it"},
    {"fired", T_OBJECT, offsetof(DisjointPlan, fired), READONLY, "the recv nodes that fired"},
    {"leaf_mask", T_OBJECT, offsetof(DisjointPlan, empty_dict), READONLY,
     "watched leaves: none in this plan"},
    {nullptr, 0, 0, 0, nullptr}};

PyGetSetDef plan_getset[] = {
    {"complete", plan_complete, nullptr, "every source has arrived", nullptr},
    {"arrived", plan_arrived, nullptr, "the bits of the sources that arrived", nullptr},
    {"n_sources", plan_n_sources, nullptr, "how many sources", nullptr},
    {"completed", plan_completed, nullptr, "watched leaves completed: never any", nullptr},
    {nullptr, nullptr, nullptr, nullptr, nullptr}};

PyMethodDef plan_module_methods[] = {
    {"disjoint_plan",
     reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(disjoint_plan)),
     METH_FASTCALL,
     "disjoint_plan(sources, reaches, recv_types, AccumulateGrad, watch, engine_grad, "
     "drop_unrun_tasks, native, direct) -> DisjointPlan | None: graph.Plan for sources whose "
     "reaches share no node, recv function or watched leaf (None: another case)"},
    {"compact_grads",
     reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(compact_grads)),
     METH_FASTCALL,
     "compact_grads(grads, min_numel) -> (sent, shapes | None) | None: engine._compact of "
     "each gradient (None: one not exactly a torch.Tensor)"},
    {nullptr, nullptr, 0, nullptr}};

}  // namespace

PyObject* mpidag::compact_grads(PyObject* module, PyObject* const* args, Py_ssize_t nargs) {
  return ::compact_grads(module, args, nargs);
}

bool mpidag::is_disjoint_plan(PyObject* obj) { return Py_TYPE(obj) == &plan_type; }

void mpidag::plan_share_sources(PyObject* plan, PyObject* source_of) {
  Py_XSETREF(reinterpret_cast<DisjointPlan*>(plan)->source_of, Py_NewRef(source_of));
}

PyObject* mpidag::plan_recv_mask(PyObject* plan) {
  return reinterpret_cast<DisjointPlan*>(plan)->recv_mask;
}

int mpidag::add_disjoint_plan(PyObject* module) {
  s_succ = PyUnicode_InternFromString("succ");
  s_leaf_edges = PyUnicode_InternFromString("leaf_edges");
  s_recv_edges = PyUnicode_InternFromString("recv_edges");
  s_recv_nodes = PyUnicode_InternFromString("recv_nodes");
  s_variable = PyUnicode_InternFromString("variable");
  s_backward_hooks = PyUnicode_InternFromString("_backward_hooks");
  s_post_hooks = PyUnicode_InternFromString("_post_accumulate_grad_hooks");
  s_record = PyUnicode_InternFromString("record");
  s_context_id = PyUnicode_InternFromString("context_id");
  s_peer = PyUnicode_InternFromString("peer");
  s_message_id = PyUnicode_InternFromString("message_id");
  s_n_outputs = PyUnicode_InternFromString("n_outputs");
  if (!s_succ || !s_leaf_edges || !s_recv_edges || !s_recv_nodes || !s_variable ||
      !s_backward_hooks || !s_post_hooks || !s_record || !s_context_id || !s_peer ||
      !s_message_id || !s_n_outputs)
    return -1;
  plan_type.tp_name = "_mpidag_torch.DisjointPlan";
  plan_type.tp_basicsize = sizeof(DisjointPlan);
  plan_type.tp_flags = Py_TPFLAGS_DEFAULT;
  plan_type.tp_doc =
      "one rank's plan of a backward pass whose sources reach disjoint parts of its graph "
      "(made by disjoint_plan; graph.Plan's surface)";
  plan_type.tp_dealloc = plan_dealloc;
  plan_type.tp_methods = plan_methods;
  plan_type.tp_members = plan_members;
  plan_type.tp_getset = plan_getset;
  if (PyType_Ready(&plan_type) < 0) return -1;
  if (PyModule_AddObjectRef(module, "DisjointPlan", reinterpret_cast<PyObject*>(&plan_type)) < 0)
    return -1;
  return PyModule_AddFunctions(module, plan_module_methods);
}
