// What the four translation units of _mpidag_torch share: torch_native.cpp's per-message
// records of distributed autograd, called by torch_recorder.cpp's ContextRecorder without a
// Python call, and the recorder's type, added to the module by torch_native.cpp's init.
#ifndef MPIDAG_TORCH_RECORDS_H
#define MPIDAG_TORCH_RECORDS_H

#include <Python.h>

namespace mpidag {

// record_recv(record, tensors) and send_reach(tensors, GradientEdge, recv_types,
// AccumulateGrad) of the module (torch_native.cpp), as METH_FASTCALL functions
PyObject* record_recv(PyObject* module, PyObject* const* args, Py_ssize_t nargs);
PyObject* send_reach(PyObject* module, PyObject* const* args, Py_ssize_t nargs);

// run_grad(outputs, grads, inputs, keep_graph) of the module (torch_native.cpp), for
// torch_plan.cpp's DisjointPlan
PyObject* run_grad(PyObject* module, PyObject* const* args, Py_ssize_t nargs);

// the ContextRecorder type (torch_recorder.cpp), made ready and added to module; -1: error
int add_context_recorder(PyObject* module);

// the DisjointPlan type and disjoint_plan() (torch_plan.cpp), added to module; -1: error
int add_disjoint_plan(PyObject* module);

// compact_grads(grads, min_numel) of the module (torch_plan.cpp), for torch_pass.cpp
PyObject* compact_grads(PyObject* module, PyObject* const* args, Py_ssize_t nargs);

// for torch_pass.cpp's PassCore._make_plan (torch_plan.cpp): whether obj is a DisjointPlan;
// its name_sources() with the {message id: source index} dict made already (the plan holds
// it); its recv_mask dict {recv node: source bit} (borrowed)
bool is_disjoint_plan(PyObject* obj);
void plan_share_sources(PyObject* plan, PyObject* source_of);
PyObject* plan_recv_mask(PyObject* plan);

// reach(edges, recv_types, AccumulateGrad) of the module (torch_native.cpp): a source's
// (succ, leaf_edges, recv_edges, recv_nodes), None where Python must walk
PyObject* reach(PyObject* module, PyObject* const* args, Py_ssize_t nargs);

// the PassCore type (torch_pass.cpp), added to module; -1: error
int add_pass_core(PyObject* module);

}  // namespace mpidag

#endif
