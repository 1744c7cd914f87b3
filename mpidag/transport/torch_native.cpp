// _mpidag_torch: mpidag's C++ against torch, where Python's torch API costs most per message.
//
// Seven parts, each doing what torch's own C++ does (torch/csrc/distributed/autograd/utils.cpp,
// torch/csrc/utils/tensor_new.cpp):
//
// 1. Frame-0 tensors for the C codec (_mpidag_frames): frame_tensor(frame, offset, dtype,
//    ndim, sizes, requires_grad), reached through the capsule FRAME_TENSOR_CAPSULE, makes
//    the tensor of an inline spec as a view of frame 0's bytes (at::from_blob holding a
//    buffer view of the frame) in one step: what torch.frombuffer, .view(*sizes) and
//    .requires_grad_() do in three Python calls. And the other way, for the encoder:
//    tensor_facts(tensor, &facts), through the capsule TENSOR_FACTS_CAPSULE, reads what the
//    codec writes of a tensor it sends (dtype, sizes, nbytes, requires_grad, whether its
//    bytes can be copied as they are, where they are) from the C++ tensor in one call
//    instead of ten Python attribute reads and method calls.
// 2. The per-message records of distributed autograd (mpidag.dist_autograd.native):
//    record_recv(record, tensors)  the received tensors that require grad become outputs of
//                                 one new RecvRpcBackward node, a C++ node of this module's
//                                 own (no autograd.Function, no Python forward, no anchor
//                                 input: like torch's, it has no next edges); returns the
//                                 new list of tensors. The node holds the Python record;
//                                 its Python type (RecvRpcBackward) reads it as `.record`;
//                                 record.node becomes a weak reference to the node.
//    gradient_edges(tensors, GradientEdge)  one GradientEdge(node, output_nr) per tensor,
//                                 where torch's C++ gradient_edge() finds it (a leaf's
//                                 gradient accumulator without the view Python needs); None
//                                 where a Python node (a custom Function's output) or a
//                                 tensor that does not require grad asks for the Python way.
//    reach(edges, recv_types, AccumulateGrad)  the walk of mpidag.dist_autograd.graph.Reach
//                                 over torch's C++ nodes (None where it starts at a Python
//                                 node); send_reach(tensors, ...) gradient_edges and reach
//                                 of a send function's tensors in one call.
// 3. One call of torch's engine for a region of a backward pass (mpidag.dist_autograd.graph):
//    run_grad(outputs, grads, inputs, keep_graph)  what torch.autograd.grad(outputs, inputs,
//                                 grads, retain_graph=keep_graph, allow_unused=True) does
//                                 with GradientEdges, without its Python (argument checks
//                                 the engine repeats, the context stash per call: ~30 us
//                                 and more per node); None where an edge starts at a Python
//                                 node (the Python call then runs).
// 4. The futures of rpc_async, reached by the compiled call path (_mpidag_fastpath) through
//    the capsule MPIDAG_TORCH_FUTURES_CAPSULE (torch_futures.h): new_future(type) builds the
//    instance torch._C.Future.__init__(self, []) builds, in place, without pybind11's
//    dispatcher and its conversion of the device list (0.4-0.8 us of the 5-8 us a call
//    costs its caller); set_result(future, value) completes it without dropping the GIL
//    (torch's binding drops and retakes it around markCompleted, a wake-up of the thread
//    that issues calls on every answer).
// 5. ReceivePool: the memory of received tensors (mpidag.transport.buffers.ReceiveBufferCache
//    uses it where it is built). empty(sizes, dtype) gives an uninitialized tensor:
//    at::empty below min_cached bytes, else at::from_blob over a block of private
//    anonymous memory (huge pages where the kernel allows) that goes back to the pool when
//    the tensor's storage dies (its deleter, any thread, with or without the GIL); free
//    blocks are reused most recently freed first, the oldest unmapped beyond `limit` bytes.
//    What the Python cache does with an mmap, a numpy array, a weakref.finalize and two
//    views (17 us a 1 MiB tensor here) in one call.
// 6. ContextRecorder, in the module's second translation unit (torch_recorder.cpp, sharing
//    torch_records.h): distributed autograd's per-message hooks and a context's life, the
//    first base class of the compiled ContextContainer; it calls record_recv and
//    send_reach above without a Python call.
// 7. DisjointPlan, in the third translation unit (torch_plan.cpp): one rank's plan of a
//    backward pass where its sources reach disjoint parts of the graph (the common case of
//    mpidag.dist_autograd.graph.Plan), calling run_grad above without a Python call.
//
// Built per virtual environment against that environment's torch (python -m
// mpidag.transport.wire_build, run by scripts/setup.sh; mpidag.transport.torch_native loads
// it); mpidag runs the Python code it replaces where it is not built or not loadable.
// VERSION changes whenever what Python or frames.c may expect of this module does.

#include <torch/csrc/python_headers.h>

#include <torch/csrc/Exceptions.h>

#include <ATen/ATen.h>
#include <torch/csrc/Dtype.h>

#include <torch/csrc/autograd/edge.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/autograd/python_cpp_function.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/csrc/jit/python/pybind_utils.h>
#include <torch/csrc/utils/pybind.h>

#include "frame_tensor.h"
#include "torch_futures.h"
#include "torch_records.h"

#include <sys/mman.h>

#include <deque>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace {

constexpr long VERSION = 14;

#ifndef MPIDAG_TORCH_VERSION  // torch.__version__ at build time (the build defines it)
#error "build with -DMPIDAG_TORCH_VERSION=\"<torch.__version__>\" (mpidag's wire_build does)"
#endif

using torch::autograd::Edge;
using torch::autograd::Engine;
using torch::autograd::Node;
using torch::autograd::variable_list;

// torch keeps nodes in c10::intrusive_ptr (2.13 and 2.14) or std::shared_ptr (older releases)
using NodePtr = decltype(std::declval<Edge>().function);
constexpr bool kSharedNodes = std::is_same_v<NodePtr, std::shared_ptr<Node>>;
using WeakNodePtr =
    std::conditional_t<kSharedNodes, std::weak_ptr<Node>, c10::weak_intrusive_ptr<Node>>;

template <class T, class... Args>
NodePtr make_node(Args&&... args) {
  if constexpr (kSharedNodes) {
    return std::make_shared<T>(std::forward<Args>(args)...);
  } else {
    return c10::make_intrusive<T>(std::forward<Args>(args)...);
  }
}

// A Python reference that may be dropped on any thread (autograd frees nodes on its own).
struct PyRef {
  PyObject* obj;
  explicit PyRef(PyObject* o) : obj(o) { Py_INCREF(o); }
  PyRef(const PyRef&) = delete;
  PyRef& operator=(const PyRef&) = delete;
  ~PyRef() { reset(); }
  void reset() {
    PyObject* held = obj;
    obj = nullptr;
    if (held == nullptr || !Py_IsInitialized()) return;  // interpreter gone: keep it
    PyGILState_STATE gil = PyGILState_Ensure();
    Py_DECREF(held);
    PyGILState_Release(gil);
  }
};

// A node holding a Python object until autograd lets go of it. With intrusive_ptr nodes a
// weak reference (WeakNode below) keeps a dead node's memory, so the object is dropped in
// release_resources(), when the last strong reference goes, not in the destructor.
template <bool kIntrusive, class Base = Node>
struct HoldingNode : Base {
  PyRef held;
  explicit HoldingNode(PyObject* obj) : held(obj) {}
};

template <class Base>
struct HoldingNode<true, Base> : Base {
  PyRef held;
  explicit HoldingNode(PyObject* obj) : held(obj) {}
  void release_resources() override {
    Base::release_resources();
    held.reset();
  }
};

constexpr const char* kRecvName = "torch::distributed::autograd::RecvRpcBackward";

// The receiver's node of one message. The distributed engine stops at it and sends the
// gradients of its outputs to the rank they came from; a plain local backward() that
// reaches it runs apply(), an error that says what to do instead (the record's text).
struct RecvRpcBackward final : HoldingNode<!kSharedNodes> {
  explicit RecvRpcBackward(PyObject* record) : HoldingNode(record) {}

  std::string name() const override { return kRecvName; }

  variable_list apply(variable_list&& /*grads*/) override {
    std::string text = "a local backward() reached tensors received over RPC";
    PyGILState_STATE gil = PyGILState_Ensure();
    PyObject* said = held.obj == nullptr ? nullptr
        : PyObject_CallMethod(held.obj, "local_backward_error", nullptr);
    if (said != nullptr && PyUnicode_Check(said)) {
      const char* utf8 = PyUnicode_AsUTF8(said);
      if (utf8 != nullptr) text = utf8;
    }
    Py_XDECREF(said);
    PyErr_Clear();
    PyGILState_Release(gil);
    throw std::runtime_error(text);
  }
};

PyObject* recv_type = nullptr;  // RecvRpcBackward's Python type (torch's node wrapper)

PyObject* recv_record_get(PyObject* self, void* /*unused*/) {
  auto& cdata = reinterpret_cast<torch::autograd::THPCppFunction*>(self)->cdata;
  auto* node = dynamic_cast<RecvRpcBackward*>(cdata.get());
  if (node == nullptr) {
    PyErr_SetString(PyExc_TypeError, "not a RecvRpcBackward node");
    return nullptr;
  }
  PyObject* record = node->held.obj != nullptr ? node->held.obj : Py_None;
  Py_INCREF(record);
  return record;
}

PyGetSetDef recv_properties[] = {
    {"next_functions", torch::autograd::THPCppFunction_next_functions, nullptr, nullptr,
     nullptr},
    {"requires_grad", torch::autograd::THPCppFunction_requires_grad, nullptr, nullptr,
     nullptr},
    {"metadata", torch::autograd::THPCppFunction_metadata, nullptr, nullptr, nullptr},
    {"_input_metadata", torch::autograd::THPCppFunction_input_metadata, nullptr, nullptr,
     nullptr},
    {"record", recv_record_get, nullptr, "the message's record (mpidag's RecvRecord)",
     nullptr},
    {nullptr, nullptr, nullptr, nullptr, nullptr}};

PyMethodDef recv_methods[] = {
    {"_register_hook_dict", torch::autograd::THPCppFunction_register_hook_dict, METH_O,
     nullptr},
    {"register_hook", torch::autograd::THPCppFunction_register_hook, METH_O, nullptr},
    {"register_prehook", torch::autograd::THPCppFunction_register_prehook, METH_O, nullptr},
    {"name", torch::autograd::THPCppFunction_name, METH_NOARGS, nullptr},
    {"_sequence_nr", torch::autograd::THPCppFunction_sequence_nr, METH_NOARGS, nullptr},
    {nullptr, nullptr, 0, nullptr}};

PyTypeObject recv_pytype;

// ------------------------------------------------------------------ frame-0 tensors
// The RuntimeError of a C++ exception (a torch error's text without its C++ backtrace).
PyObject* raise_from(const std::exception& e) {
  const auto* torch_error = dynamic_cast<const c10::Error*>(&e);
  PyErr_SetString(PyExc_RuntimeError,
                  torch_error != nullptr ? torch_error->what_without_backtrace() : e.what());
  return nullptr;
}

void release_buffer(Py_buffer* view) {
  if (Py_IsInitialized()) {  // else the interpreter is gone, and the frame with it
    PyGILState_STATE gil = PyGILState_Ensure();
    PyBuffer_Release(view);
    PyGILState_Release(gil);
  }
  delete view;
}

PyObject* frame_tensor(PyObject* frame, Py_ssize_t offset, PyObject* dtype, int ndim,
                       const int64_t* sizes, int requires_grad) {
  if (!THPDtype_Check(dtype)) {
    PyErr_SetString(PyExc_TypeError, "frame_tensor: dtype must be a torch.dtype");
    return nullptr;
  }
  at::ScalarType type = reinterpret_cast<THPDtype*>(dtype)->scalar_type;
  int64_t count = 1;
  for (int d = 0; d < ndim; d++) {
    if (sizes[d] < 0 || __builtin_mul_overflow(count, sizes[d], &count)) {
      PyErr_SetString(PyExc_ValueError, "frame_tensor: a negative size, or too many elements");
      return nullptr;
    }
  }
  auto* view = new Py_buffer;
  if (PyObject_GetBuffer(frame, view, PyBUF_SIMPLE) < 0) {
    delete view;
    return nullptr;
  }
  int64_t nbytes = 0;
  if (__builtin_mul_overflow(count, static_cast<int64_t>(c10::elementSize(type)), &nbytes) ||
      offset < 0 || nbytes > view->len - offset) {
    PyErr_Format(PyExc_ValueError, "frame_tensor: %lld bytes at offset %zd do not fit in a "
                 "frame of %zd bytes", static_cast<long long>(nbytes), offset, view->len);
    PyBuffer_Release(view);
    delete view;
    return nullptr;
  }
  try {
    at::Tensor tensor = at::from_blob(
        static_cast<char*>(view->buf) + offset, c10::IntArrayRef(sizes, ndim),
        [view](void* /*data*/) { release_buffer(view); }, at::TensorOptions().dtype(type));
    if (requires_grad) tensor.set_requires_grad(true);
    return THPVariable_Wrap(std::move(tensor));
  }
  catch (const std::exception& e) {
    return raise_from(e);
  }
}

static_assert(std::is_same_v<decltype(&frame_tensor), mpidag_frame_tensor_fn>,
              "frame_tensor must be what frame_tensor.h promises frames.c");

// The type of torch.nn.Parameter (set at import): tensor_facts takes it as a plain tensor
// (its __torch_function__ is torch's disabled one, so its attributes are torch.Tensor's).
PyTypeObject* parameter_type = nullptr;

int tensor_facts(PyObject* obj, mpidag_tensor_facts* facts) {
  if (!THPVariable_CheckExact(obj) && Py_TYPE(obj) != parameter_type) return 0;
  try {
    const at::Tensor& t = THPVariable_Unpack(obj);
    if (!t.defined() || t.layout() != c10::kStrided || !t.device().is_cpu() ||
        t.key_set().has_any(c10::python_ks) || t.key_set().has_any(c10::functorch_transforms_ks))
      return 0;
    int64_t ndim = t.dim();
    if (ndim > MPIDAG_FACTS_DIMS) return 0;
    facts->dtype = reinterpret_cast<PyObject*>(torch::getTHPDtype(t.scalar_type()));
    facts->nbytes = static_cast<int64_t>(t.numel()) * static_cast<int64_t>(t.element_size());
    facts->ndim = static_cast<int>(ndim);
    auto sizes = t.sizes();
    for (int64_t d = 0; d < ndim; d++) facts->sizes[d] = sizes[d];
    facts->requires_grad = t.requires_grad() ? 1 : 0;
    facts->contiguous = t.is_contiguous() ? 1 : 0;
    facts->copyable = facts->contiguous && !t.is_conj() && !t.is_neg();
    facts->data = facts->copyable && facts->nbytes > 0 ? t.const_data_ptr() : nullptr;
    return 1;
  }
  catch (const std::exception&) {  // (the Python attributes raise it again, as before)
    return 0;
  }
}

static_assert(std::is_same_v<decltype(&tensor_facts), mpidag_tensor_facts_fn>,
              "tensor_facts must be what frame_tensor.h promises frames.c");

// tensor_facts(tensor) from Python (for tests): (dtype, nbytes, sizes, requires_grad,
// contiguous, copyable, data_ptr) or None
PyObject* tensor_facts_py(PyObject* /*module*/, PyObject* obj) {
  mpidag_tensor_facts facts;
  if (!tensor_facts(obj, &facts)) Py_RETURN_NONE;
  PyObject* sizes = PyTuple_New(facts.ndim);
  if (sizes == nullptr) return nullptr;
  for (int d = 0; d < facts.ndim; d++) {
    PyObject* size = PyLong_FromLongLong(facts.sizes[d]);
    if (size == nullptr) {
      Py_DECREF(sizes);
      return nullptr;
    }
    PyTuple_SET_ITEM(sizes, d, size);
  }
  return Py_BuildValue("(OLNiiiN)", facts.dtype, static_cast<long long>(facts.nbytes), sizes,
                       facts.requires_grad, facts.contiguous, facts.copyable,
                       PyLong_FromVoidPtr(const_cast<void*>(facts.data)));
}

// frame_tensor(frame, offset, dtype, sizes, requires_grad) from Python (for tests)
PyObject* frame_tensor_py(PyObject* /*module*/, PyObject* args) {
  PyObject *frame, *dtype, *sizes;
  Py_ssize_t offset;
  int requires_grad;
  if (!PyArg_ParseTuple(args, "OnOO!p:frame_tensor", &frame, &offset, &dtype, &PyTuple_Type,
                        &sizes, &requires_grad))
    return nullptr;
  Py_ssize_t ndim = PyTuple_GET_SIZE(sizes);
  std::vector<int64_t> dims(static_cast<size_t>(ndim));
  for (Py_ssize_t d = 0; d < ndim; d++) {
    dims[d] = PyLong_AsLongLong(PyTuple_GET_ITEM(sizes, d));
    if (dims[d] == -1 && PyErr_Occurred()) return nullptr;
  }
  return frame_tensor(frame, offset, dtype, static_cast<int>(ndim), dims.data(),
                      requires_grad);
}

// ------------------------------------------------------------------ weak node references
// record.node: called, the node's Python object while the graph holds the node, else None
// (what weakref.ref gives the Python records; torch's node wrappers take no weak references).
struct WeakNode {
  PyObject_HEAD
  WeakNodePtr node;
};

PyObject* weak_node_call(PyObject* self, PyObject* args, PyObject* kwargs) {
  if (!PyArg_ParseTuple(args, ":WeakNode")) return nullptr;
  if (kwargs != nullptr && PyDict_GET_SIZE(kwargs) != 0) {
    PyErr_SetString(PyExc_TypeError, "a weak node reference takes no arguments");
    return nullptr;
  }
  NodePtr node = reinterpret_cast<WeakNode*>(self)->node.lock();
  if (!node) Py_RETURN_NONE;
  return torch::autograd::functionToPyObject(node);
}

void weak_node_dealloc(PyObject* self) {
  reinterpret_cast<WeakNode*>(self)->node.~WeakNodePtr();
  Py_TYPE(self)->tp_free(self);
}

PyTypeObject weak_node_type = {PyVarObject_HEAD_INIT(nullptr, 0)};

PyObject* new_weak_node(const NodePtr& node) {
  PyObject* self = weak_node_type.tp_alloc(&weak_node_type, 0);
  if (self == nullptr) return nullptr;
  new (&reinterpret_cast<WeakNode*>(self)->node) WeakNodePtr(node);
  return self;
}

// --------------------------------------------------------------------------- functions
PyObject* n_outputs_name = nullptr;  // "n_outputs"
PyObject* node_name = nullptr;       // "node"

// Whether a received tensor that requires grad is held by nothing but its message (the list
// of its tensors): its Python object has no other reference, its TensorImpl no other
// owner, and it is a fresh leaf (no gradient, no accumulator, no hooks, not a view; what
// the decoder makes). Then record_recv may make it the recv node's output in place.
bool received_alone(PyObject* item, const at::Tensor& tensor) {
  if (Py_REFCNT(item) != 1 || tensor.use_count() != 1 || tensor.is_view() ||
      !tensor.is_leaf()) {
    return false;
  }
  auto* var = reinterpret_cast<THPVariable*>(item);
  if (var->backward_hooks != nullptr || var->post_accumulate_grad_hooks != nullptr) {
    return false;
  }
  auto* meta = torch::autograd::impl::get_autograd_meta(tensor);
  return meta != nullptr && meta->requires_grad_ && !meta->grad_.defined() &&
         meta->grad_accumulator_.expired() && meta->hooks_.empty() &&
         meta->cpp_hooks_list_ == nullptr && meta->post_acc_grad_hooks_ == nullptr &&
         !meta->retains_grad_ && meta->fw_grad_ == nullptr;
}

PyObject* record_recv(PyObject* /*module*/, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 2) {
    PyErr_SetString(PyExc_TypeError, "record_recv(record, tensors) takes 2 arguments");
    return nullptr;
  }
  PyObject* record = args[0];
  THPObjectPtr tensors(PySequence_Fast(args[1], "record_recv: tensors must be a sequence"));
  if (!tensors) return nullptr;
  Py_ssize_t n = PySequence_Fast_GET_SIZE(tensors.get());
  PyObject** items = PySequence_Fast_ITEMS(tensors.get());
  for (Py_ssize_t i = 0; i < n; i++) {
    if (!THPVariable_Check(items[i])) {
      PyErr_SetString(PyExc_TypeError, "record_recv: every item must be a tensor");
      return nullptr;
    }
  }
  PyObject* result = PyList_New(n);
  if (result == nullptr) return nullptr;
  try {
    NodePtr node = make_node<RecvRpcBackward>(record);
    long outputs = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
      PyObject* item = items[i];
      const at::Tensor& tensor = THPVariable_Unpack(item);
      if (!tensor.requires_grad()) {
        Py_INCREF(item);
        PyList_SET_ITEM(result, i, item);
        continue;
      }
      outputs++;
      if (received_alone(item, tensor)) {
        // nobody else holds the received tensor: it becomes the node's output itself, as
        // its detached copy would (same storage, version counter and metadata), without
        // the copy's TensorImpl, autograd metadata and Python object
        at::Tensor out = tensor;
        out.set_requires_grad(false);
        torch::autograd::set_history(out, node);
        Py_INCREF(item);
        PyList_SET_ITEM(result, i, item);
        continue;
      }
      at::Tensor out = tensor.detach();
      torch::autograd::set_history(out, node);
      PyObject* wrapped = THPVariable_Wrap(std::move(out));
      if (wrapped == nullptr) {
        Py_DECREF(result);
        return nullptr;
      }
      PyList_SET_ITEM(result, i, wrapped);
    }
    PyObject* count = PyLong_FromLong(outputs);
    PyObject* weak = new_weak_node(node);
    int failed = count == nullptr || weak == nullptr ||
                 PyObject_SetAttr(record, n_outputs_name, count) < 0 ||
                 PyObject_SetAttr(record, node_name, weak) < 0;
    Py_XDECREF(count);
    Py_XDECREF(weak);
    if (failed) {
      Py_DECREF(result);
      return nullptr;
    }
    return result;
  }
  catch (const std::exception& e) {
    Py_DECREF(result);
    return raise_from(e);
  }
}

// GradientEdge(node, output_nr) (a NamedTuple: a tuple of its type, ownership_token None)
// without the call of its Python __new__; steals node
PyObject* new_edge(PyObject* edge_type, PyObject* node, uint32_t output_nr) {
  PyObject* number = PyLong_FromUnsignedLong(output_nr);
  auto* type = reinterpret_cast<PyTypeObject*>(edge_type);
  PyObject* edge = number == nullptr ? nullptr : type->tp_alloc(type, 3);
  if (edge == nullptr) {
    Py_DECREF(node);
    Py_XDECREF(number);
    return nullptr;
  }
  Py_INCREF(Py_None);
  PyTuple_SET_ITEM(edge, 0, node);
  PyTuple_SET_ITEM(edge, 1, number);
  PyTuple_SET_ITEM(edge, 2, Py_None);
  return edge;
}

PyObject* gradient_edges(PyObject* /*module*/, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 2 || !PyList_Check(args[0])) {
    PyErr_SetString(PyExc_TypeError, "gradient_edges(tensors: list, GradientEdge)");
    return nullptr;
  }
  PyObject* tensors = args[0];
  PyObject* edge_type = args[1];
  if (!PyType_Check(edge_type) ||
      !PyType_IsSubtype(reinterpret_cast<PyTypeObject*>(edge_type), &PyTuple_Type)) {
    PyErr_SetString(PyExc_TypeError, "gradient_edges: GradientEdge must be a tuple type "
                    "(torch.autograd.graph.GradientEdge)");
    return nullptr;
  }
  Py_ssize_t n = PyList_GET_SIZE(tensors);
  PyObject* result = PyList_New(n);
  if (result == nullptr) return nullptr;
  try {
    for (Py_ssize_t i = 0; i < n; i++) {
      PyObject* item = PyList_GET_ITEM(tensors, i);
      PyObject* edge = nullptr;
      if (THPVariable_Check(item)) {
        const at::Tensor& tensor = THPVariable_Unpack(item);
        if (tensor.requires_grad()) {
          Edge found = torch::autograd::impl::gradient_edge(tensor);
          if (found.function) {
            PyObject* node = torch::autograd::functionToPyObject(found.function);
            if (node == nullptr) {
              Py_DECREF(result);
              return nullptr;
            }
            if (torch::autograd::THPCppFunction_Check(node)) {  // a native node owns
              edge = new_edge(edge_type, node, found.input_nr);  // the graph behind it
              if (edge == nullptr) {
                Py_DECREF(result);
                return nullptr;
              }
            } else {
              Py_DECREF(node);  // a Python node: the Python way keeps the graph alive
            }
          }
        }
      }
      if (edge == nullptr) {
        Py_INCREF(Py_None);
        edge = Py_None;
      }
      PyList_SET_ITEM(result, i, edge);
    }
    return result;
  }
  catch (const std::exception& e) {
    Py_DECREF(result);
    return raise_from(e);
  }
}

// reach(edges, recv_types, AccumulateGrad) -> (succ, leaf_edges, recv_edges, recv_nodes), or
// None where an edge's node is a Python node (a custom Function's: Python walks from it).
// The depth-first walk of mpidag.dist_autograd.graph.Reach over torch's C++ nodes: succ maps
// every node reached, but leaves and recv nodes (where the walk stops), to its
// next_functions tuple (built as THPCppFunction_next_functions builds it); leaf_edges and
// recv_edges are the (node, input_nr) keys into leaves and recv nodes behind the edges'
// nodes; recv_nodes the recv nodes among the edges' nodes and behind them.
struct Walk {
  PyObject* recv_types;  // a frozenset of node types
  PyObject* acc_type;    // AccumulateGrad's Python type
  THPObjectPtr succ{PyDict_New()}, leaf_edges{PySet_New(nullptr)},
      recv_edges{PySet_New(nullptr)}, recv_nodes{PySet_New(nullptr)};
  std::vector<std::pair<Node*, PyObject*>> stack;  // node, its Python object (a succ key)

  bool ok() const { return succ && leaf_edges && recv_edges && recv_nodes; }

  // 1: a leaf, 2: a recv node, 0: neither; -1: an error
  int kind(PyObject* node) const {
    if (reinterpret_cast<PyObject*>(Py_TYPE(node)) == acc_type) return 1;
    int recv = PySet_Contains(recv_types, reinterpret_cast<PyObject*>(Py_TYPE(node)));
    return recv < 0 ? -1 : recv ? 2 : 0;
  }

  // node (borrowed) joins the walk unless seen: 0 done, -1 an error
  int visit(Node* cnode, PyObject* node) {
    int seen = PyDict_Contains(succ.get(), node);
    if (seen != 0) return seen < 0 ? -1 : 0;
    if (PyDict_SetItem(succ.get(), node, empty_tuple()) < 0) return -1;
    stack.emplace_back(cnode, node);  // borrowed: succ holds it
    return 0;
  }

  static PyObject* empty_tuple() {
    static PyObject* empty = PyTuple_New(0);
    return empty;
  }

  // the next_functions of one node, classifying each next node; nullptr on an error
  PyObject* expand(Node* cnode) {
    const auto n = cnode->num_outputs();
    THPObjectPtr nexts(PyTuple_New(static_cast<Py_ssize_t>(n)));
    if (!nexts) return nullptr;
    for (uint32_t i = 0; i < n; i++) {
      const Edge& edge = cnode->next_edge(i);
      PyObject* next = torch::autograd::functionToPyObject(edge.function);
      if (next == nullptr) return nullptr;
      PyObject* number = PyLong_FromUnsignedLong(edge.input_nr);
      PyObject* key = number == nullptr ? nullptr : PyTuple_New(2);
      if (key == nullptr) {
        Py_DECREF(next);
        Py_XDECREF(number);
        return nullptr;
      }
      PyTuple_SET_ITEM(key, 0, next);
      PyTuple_SET_ITEM(key, 1, number);
      PyTuple_SET_ITEM(nexts.get(), i, key);
      if (next == Py_None) continue;
      int seen = PyDict_Contains(succ.get(), next);
      if (seen < 0) return nullptr;
      if (seen) continue;
      switch (kind(next)) {
        case 1:
          if (PySet_Add(leaf_edges.get(), key) < 0) return nullptr;
          break;
        case 2:
          if (PySet_Add(recv_edges.get(), key) < 0 || PySet_Add(recv_nodes.get(), next) < 0)
            return nullptr;
          break;
        case 0:
          if (visit(edge.function.get(), next) < 0) return nullptr;
          break;
        default:
          return nullptr;
      }
    }
    return nexts.release();
  }
};

PyObject* reach(PyObject* /*module*/, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 3 || !PyList_Check(args[0]) || !PyFrozenSet_Check(args[1]) ||
      !PyType_Check(args[2])) {
    PyErr_SetString(PyExc_TypeError,
                    "reach(edges: list, recv_types: frozenset, AccumulateGrad: type)");
    return nullptr;
  }
  if (Walk::empty_tuple() == nullptr) return nullptr;
  Walk walk{args[1], args[2]};
  if (!walk.ok()) return nullptr;
  PyObject* edges = args[0];
  try {
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(edges); i++) {
      PyObject* edge = PyList_GET_ITEM(edges, i);
      if (edge == Py_None) continue;
      if (!PyTuple_Check(edge) || PyTuple_GET_SIZE(edge) < 2) {
        PyErr_SetString(PyExc_TypeError, "reach: every edge must be a GradientEdge or None");
        return nullptr;
      }
      PyObject* node = PyTuple_GET_ITEM(edge, 0);
      if (node == Py_None) continue;
      switch (walk.kind(node)) {
        case 1:
          continue;
        case 2:
          if (PySet_Add(walk.recv_nodes.get(), node) < 0) return nullptr;
          continue;
        case 0:
          break;
        default:
          return nullptr;
      }
      if (!torch::autograd::THPCppFunction_Check(node)) Py_RETURN_NONE;  // Python walks it
      auto* cpp = reinterpret_cast<torch::autograd::THPCppFunction*>(node);
      if (walk.visit(cpp->cdata.get(), node) < 0) return nullptr;
    }
    while (!walk.stack.empty()) {
      auto [cnode, node] = walk.stack.back();
      walk.stack.pop_back();
      PyObject* nexts = walk.expand(cnode);
      if (nexts == nullptr || PyDict_SetItem(walk.succ.get(), node, nexts) < 0) {
        Py_XDECREF(nexts);
        return nullptr;
      }
      Py_DECREF(nexts);
    }
  }
  catch (const std::exception& e) {
    return raise_from(e);
  }
  return PyTuple_Pack(4, walk.succ.get(), walk.leaf_edges.get(), walk.recv_edges.get(),
                      walk.recv_nodes.get());
}

// send_reach(tensors, GradientEdge, recv_types, AccumulateGrad) -> (edges, reach): what a
// send function needs of its tensors in one call, gradient_edges(tensors) and reach() of
// those edges; reach is None where Python must do either (an edge is None: a custom
// Function's output or a tensor without grad)
PyObject* send_reach(PyObject* module, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 4) {
    PyErr_SetString(PyExc_TypeError,
                    "send_reach(tensors, GradientEdge, recv_types, AccumulateGrad)");
    return nullptr;
  }
  THPObjectPtr edges(gradient_edges(module, args, 2));
  if (!edges) return nullptr;
  for (Py_ssize_t i = 0; i < PyList_GET_SIZE(edges.get()); i++) {
    if (PyList_GET_ITEM(edges.get(), i) == Py_None)
      return PyTuple_Pack(2, edges.get(), Py_None);
  }
  PyObject* walk_args[3] = {edges.get(), args[2], args[3]};
  THPObjectPtr walked(reach(module, walk_args, 3));
  if (!walked) return nullptr;
  return PyTuple_Pack(2, edges.get(), walked.get());
}

// ------------------------------------------------------------------ one engine call
// The C++ edge of a (node, output_nr) tuple (a GradientEdge or a plain tuple); false where
// the node is not a C++ node (a custom Function's Python node: the Python call runs) or
// the tuple is malformed (a TypeError is set: see error).
bool cpp_edge(PyObject* item, Edge& edge, bool& error) {
  if (!PyTuple_Check(item) || PyTuple_GET_SIZE(item) < 2) {
    PyErr_SetString(PyExc_TypeError, "run_grad: every edge must be a (node, number) tuple");
    error = true;
    return false;
  }
  PyObject* node = PyTuple_GET_ITEM(item, 0);
  if (!torch::autograd::THPCppFunction_Check(node)) return false;
  unsigned long number = PyLong_AsUnsignedLong(PyTuple_GET_ITEM(item, 1));
  if (number == static_cast<unsigned long>(-1) && PyErr_Occurred()) {
    error = true;
    return false;
  }
  edge = Edge(reinterpret_cast<torch::autograd::THPCppFunction*>(node)->cdata,
              static_cast<uint32_t>(number));
  return true;
}

// run_grad(outputs: list, grads: list[Tensor], inputs: list, keep_graph: bool)
//   -> tuple[Tensor | None] | None
// torch.autograd.grad(outputs, inputs, grads, retain_graph=keep_graph, allow_unused=True)
// with edges for outputs and inputs, as torch's THPEngine_run_backward runs it (torch's
// default engine, the GIL released while it runs, torch's errors translated as torch
// translates them); None where an edge starts at a Python node.
PyObject* run_grad(PyObject* /*module*/, PyObject* const* args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  if (nargs != 4 || !PyList_Check(args[0]) || !PyList_Check(args[1]) ||
      !PyList_Check(args[2])) {
    PyErr_SetString(PyExc_TypeError,
                    "run_grad(outputs: list, grads: list, inputs: list, keep_graph: bool)");
    return nullptr;
  }
  Py_ssize_t n_roots = PyList_GET_SIZE(args[0]);
  if (n_roots == 0 || PyList_GET_SIZE(args[1]) != n_roots) {
    PyErr_SetString(PyExc_ValueError, "run_grad: one gradient per output, at least one");
    return nullptr;
  }
  int keep = PyObject_IsTrue(args[3]);
  if (keep < 0) return nullptr;
  torch::autograd::edge_list roots, outputs;
  variable_list grads;
  roots.reserve(n_roots);
  grads.reserve(n_roots);
  bool error = false;
  for (Py_ssize_t i = 0; i < n_roots; i++) {
    Edge edge;
    if (!cpp_edge(PyList_GET_ITEM(args[0], i), edge, error)) {
      if (error) return nullptr;
      Py_RETURN_NONE;
    }
    PyObject* grad = PyList_GET_ITEM(args[1], i);
    if (!THPVariable_Check(grad)) {
      PyErr_SetString(PyExc_TypeError, "run_grad: every gradient must be a tensor");
      return nullptr;
    }
    roots.push_back(std::move(edge));
    grads.push_back(THPVariable_Unpack(grad));
  }
  Py_ssize_t n_inputs = PyList_GET_SIZE(args[2]);
  if (n_inputs == 0) {
    PyErr_SetString(PyExc_ValueError, "run_grad: no inputs (the edges to stop at)");
    return nullptr;
  }
  outputs.reserve(n_inputs);
  for (Py_ssize_t i = 0; i < n_inputs; i++) {
    Edge edge;
    if (!cpp_edge(PyList_GET_ITEM(args[2], i), edge, error)) {
      if (error) return nullptr;
      Py_RETURN_NONE;
    }
    outputs.push_back(std::move(edge));
  }
  variable_list results;
  {
    pybind11::gil_scoped_release no_gil;
    results = Engine::get_default_engine().execute(roots, grads, keep != 0,
                                                   /*create_graph=*/false,
                                                   /*accumulate_grad=*/false, outputs);
  }
  THPObjectPtr tuple(PyTuple_New(n_inputs));
  if (!tuple) return nullptr;
  for (Py_ssize_t i = 0; i < n_inputs; i++) {
    PyObject* item = nullptr;
    if (static_cast<size_t>(i) < results.size() && results[i].defined()) {
      item = THPVariable_Wrap(results[i]);
      if (item == nullptr) return nullptr;
    } else {
      Py_INCREF(Py_None);
      item = Py_None;
    }
    PyTuple_SET_ITEM(tuple.get(), i, item);
  }
  return tuple.release();
  END_HANDLE_TH_ERRORS
}

// ------------------------------------------------------------ 4. rpc_async's futures

using torch::jit::PythonFutureWrapper;
using FutureHolder = std::shared_ptr<PythonFutureWrapper>;

// pybind11's record of torch._C.Future (looked up once, by its Python type)
pybind11::detail::type_info* future_info = nullptr;
PyTypeObject* cfuture_type = nullptr;

bool futures_ready() {
  if (future_info != nullptr) return true;
  THPObjectPtr torch_c(PyImport_ImportModule("torch._C"));
  if (!torch_c) return false;
  THPObjectPtr type(PyObject_GetAttrString(torch_c.get(), "Future"));
  if (!type) return false;
  if (!PyType_Check(type.get())) {
    PyErr_SetString(PyExc_TypeError, "torch._C.Future is not a type");
    return false;
  }
  auto* info = pybind11::detail::get_type_info(reinterpret_cast<PyTypeObject*>(type.get()));
  if (info == nullptr || info->type != reinterpret_cast<PyTypeObject*>(type.get())) {
    PyErr_SetString(PyExc_TypeError, "torch._C.Future is not the pybind11 class of futures");
    return false;
  }
  // new_future hands pybind11's init_instance a std::shared_ptr holder: only right for a
  // class held by one (torch 2.13 and 2.14 hold PythonFutureWrapper so)
#if PYBIND11_VERSION_MAJOR >= 3
  bool shared_holder = info->holder_enum_v == pybind11::detail::holder_enum_t::std_shared_ptr;
#else
  bool shared_holder = !info->default_holder &&
                       info->holder_size_in_ptrs == pybind11::detail::size_in_ptrs(
                                                        sizeof(FutureHolder));
#endif
  if (!shared_holder) {
    PyErr_SetString(PyExc_TypeError,
                    "torch._C.Future is not held by a std::shared_ptr in this torch");
    return false;
  }
  cfuture_type = reinterpret_cast<PyTypeObject*>(type.release());  // (kept)
  future_info = info;
  return true;
}

// What pybind11's factory __init__ of torch._C.Future does (torch/csrc/jit/python/init.cpp:
// a PythonFutureWrapper of a new ivalue::Future of PyObjectType and no devices, held by a
// shared_ptr), on an instance that type's tp_new allocated.
PyObject* new_future(PyTypeObject* type) {
  if (!futures_ready()) return nullptr;
  if (!PyType_IsSubtype(type, cfuture_type)) {
    PyErr_Format(PyExc_TypeError, "new_future: %s is not a torch._C.Future", type->tp_name);
    return nullptr;
  }
  THPObjectPtr self(type->tp_new(type, THPObjectPtr(PyTuple_New(0)).get(), nullptr));
  if (!self) return nullptr;
  HANDLE_TH_ERRORS
  auto* inst = reinterpret_cast<pybind11::detail::instance*>(self.get());
  auto v_h = inst->get_value_and_holder(future_info, /*throw_if_missing=*/true);
  FutureHolder holder = std::make_shared<PythonFutureWrapper>(
      c10::make_intrusive<c10::ivalue::Future>(c10::PyObjectType::get(),
                                               std::vector<c10::Device>{}));
  v_h.value_ptr() = holder.get();
  v_h.type->init_instance(inst, &holder);  // the holder, and the instance registered
  return self.release();
  END_HANDLE_TH_ERRORS
}

// torch._C.Future.set_result (PythonFutureWrapper::markCompleted) without its release of
// the GIL around ivalue::Future::markCompleted.
PyObject* set_result(PyObject* future, PyObject* value) {
  if (!futures_ready()) return nullptr;
  if (!PyObject_TypeCheck(future, cfuture_type)) {
    PyErr_Format(PyExc_TypeError, "set_result: a torch._C.Future expected, got %s",
                 Py_TYPE(future)->tp_name);
    return nullptr;
  }
  HANDLE_TH_ERRORS
  auto* inst = reinterpret_cast<pybind11::detail::instance*>(future);
  auto v_h = inst->get_value_and_holder(future_info, /*throw_if_missing=*/true);
  if (!v_h.holder_constructed()) {
    PyErr_SetString(PyExc_RuntimeError, "set_result: the future was never initialised");
    return nullptr;
  }
  auto* wrapper = v_h.value_ptr<PythonFutureWrapper>();
  c10::IValue ivalue = torch::jit::toIValue(value, c10::PyObjectType::get());
  wrapper->fut->markCompleted(std::move(ivalue));
  Py_RETURN_NONE;
  END_HANDLE_TH_ERRORS
}

mpidag_torch_futures futures_api = {new_future, set_result};

// futures_problem() -> None, or why the two cannot be used with this torch (then the
// compiled call path leaves its futures to torch's bindings)
PyObject* futures_problem_py(PyObject* /*module*/, PyObject* /*unused*/) {
  if (futures_ready()) Py_RETURN_NONE;
  PyObject *type, *value, *traceback;
  PyErr_Fetch(&type, &value, &traceback);
  PyObject* text = value != nullptr ? PyObject_Str(value) : PyUnicode_FromString("unknown");
  Py_XDECREF(type);
  Py_XDECREF(value);
  Py_XDECREF(traceback);
  return text;
}

// Python faces of the two, for tests: new_future(type), set_future_result(future, value)
PyObject* new_future_py(PyObject* /*module*/, PyObject* type) {
  if (!PyType_Check(type)) {
    PyErr_SetString(PyExc_TypeError, "new_future(type): a type expected");
    return nullptr;
  }
  return new_future(reinterpret_cast<PyTypeObject*>(type));
}

PyObject* set_future_result_py(PyObject* /*module*/, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 2) {
    PyErr_SetString(PyExc_TypeError, "set_future_result(future, value)");
    return nullptr;
  }
  return set_result(args[0], args[1]);
}

// ------------------------------------------------------------------ the receive pool
struct PoolBlock {
  void* memory;
  size_t size;
};

// The state a ReceivePool shares with the deleters of the tensors it gave out (they may
// outlive it): free blocks, oldest first, under one mutex.
struct PoolState {
  std::mutex mutex;
  std::deque<PoolBlock> free;  // oldest first
  size_t free_bytes = 0;
  int64_t limit = 0;
  bool closed = false;  // the pool object is gone: returning blocks are unmapped
  uint64_t hits = 0, misses = 0;

  // a block of exactly `size` bytes, the most recently freed one of that size: nullptr if none
  void* take(size_t size) {
    std::lock_guard<std::mutex> lock(mutex);
    for (auto it = free.rbegin(); it != free.rend(); ++it) {
      if (it->size == size) {
        void* memory = it->memory;
        free.erase(std::next(it).base());
        free_bytes -= size;
        hits++;
        return memory;
      }
    }
    misses++;
    return nullptr;
  }

  void give_back(void* memory, size_t size) {
    std::vector<PoolBlock> unmap;
    {
      std::lock_guard<std::mutex> lock(mutex);
      if (closed || limit <= 0) {
        unmap.push_back({memory, size});
      } else {
        free.push_back({memory, size});
        free_bytes += size;
        while (free_bytes > static_cast<size_t>(limit) && !free.empty()) {
          unmap.push_back(free.front());  // the least recently freed
          free_bytes -= free.front().size;
          free.pop_front();
        }
      }
    }
    for (const PoolBlock& block : unmap) munmap(block.memory, block.size);
  }

  void clear(bool close) {
    std::deque<PoolBlock> unmap;
    {
      std::lock_guard<std::mutex> lock(mutex);
      unmap.swap(free);
      free_bytes = 0;
      closed = closed || close;
    }
    for (const PoolBlock& block : unmap) munmap(block.memory, block.size);
  }
};

struct ReceivePool {
  PyObject_HEAD
  std::shared_ptr<PoolState>* state;  // (a pointer: the object is made by tp_alloc)
  int64_t min_cached, size_class;
};

PyTypeObject receive_pool_type = {PyVarObject_HEAD_INIT(nullptr, 0)};

int receive_pool_init(PyObject* self, PyObject* args, PyObject* kwargs) {
  static const char* names[] = {"limit", "min_cached", "size_class", nullptr};
  long long limit, min_cached, size_class;
  if (!PyArg_ParseTupleAndKeywords(args, kwargs, "LLL:ReceivePool", const_cast<char**>(names),
                                   &limit, &min_cached, &size_class))
    return -1;
  if (min_cached < 1 || size_class < 4096) {
    PyErr_SetString(PyExc_ValueError, "ReceivePool: min_cached >= 1 and size_class >= 4096");
    return -1;
  }
  auto* pool = reinterpret_cast<ReceivePool*>(self);
  if (pool->state == nullptr) pool->state = new std::shared_ptr<PoolState>(new PoolState);
  (*pool->state)->limit = limit;
  pool->min_cached = min_cached;
  pool->size_class = size_class;
  return 0;
}

void receive_pool_dealloc(PyObject* self) {
  auto* pool = reinterpret_cast<ReceivePool*>(self);
  if (pool->state != nullptr) {
    (*pool->state)->clear(/*close=*/true);  // tensors still out unmap their blocks later
    delete pool->state;
  }
  Py_TYPE(self)->tp_free(self);
}

// empty(sizes: tuple, dtype[, nbytes]) -> Tensor (nbytes: what the sender said, checked)
PyObject* receive_pool_empty(PyObject* self, PyObject* const* args, Py_ssize_t nargs) {
  auto* pool = reinterpret_cast<ReceivePool*>(self);
  if (nargs < 2 || nargs > 3 || !PyTuple_Check(args[0]) || !THPDtype_Check(args[1])) {
    PyErr_SetString(PyExc_TypeError,
                    "ReceivePool.empty(sizes: tuple, dtype: torch.dtype[, nbytes: int])");
    return nullptr;
  }
  if (pool->state == nullptr) {
    PyErr_SetString(PyExc_RuntimeError, "ReceivePool.empty: the pool was not initialized");
    return nullptr;
  }
  at::ScalarType type = reinterpret_cast<THPDtype*>(args[1])->scalar_type;
  Py_ssize_t ndim = PyTuple_GET_SIZE(args[0]);
  std::vector<int64_t> sizes(static_cast<size_t>(ndim));
  int64_t nbytes = static_cast<int64_t>(c10::elementSize(type));
  for (Py_ssize_t d = 0; d < ndim; d++) {
    sizes[d] = PyLong_AsLongLong(PyTuple_GET_ITEM(args[0], d));
    if (sizes[d] == -1 && PyErr_Occurred()) return nullptr;
    if (sizes[d] < 0 || __builtin_mul_overflow(nbytes, sizes[d], &nbytes)) {
      PyErr_SetString(PyExc_ValueError, "ReceivePool.empty: a negative size, or too many bytes");
      return nullptr;
    }
  }
  if (nargs == 3) {
    long long expected = PyLong_AsLongLong(args[2]);
    if (expected == -1 && PyErr_Occurred()) return nullptr;
    if (expected != nbytes) {
      PyErr_Format(PyExc_ValueError, "ReceivePool.empty: %lld bytes expected, the sizes and "
                   "dtype make %lld", expected, static_cast<long long>(nbytes));
      return nullptr;
    }
  }
  std::shared_ptr<PoolState> state = *pool->state;
  try {
    auto options = at::TensorOptions().dtype(type);
    if (nbytes < pool->min_cached || state->limit <= 0)
      return THPVariable_Wrap(at::empty(sizes, options));
    size_t size = static_cast<size_t>((nbytes + pool->size_class - 1) / pool->size_class *
                                      pool->size_class);
    void* memory = state->take(size);
    if (memory == nullptr) {
      // private, not shared: shmem-backed pages made a 64 MiB MPI echo 2.6x slower here,
      // and huge pages need private memory
      memory = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
      if (memory == MAP_FAILED) {
        PyErr_SetFromErrno(PyExc_MemoryError);
        return nullptr;
      }
#ifdef MADV_HUGEPAGE
      madvise(memory, size, MADV_HUGEPAGE);
#endif
    }
    at::Tensor tensor;
    try {
      tensor = at::from_blob(
          memory, sizes, [state, size](void* data) { state->give_back(data, size); }, options);
    }
    catch (...) {
      state->give_back(memory, size);
      throw;
    }
    return THPVariable_Wrap(std::move(tensor));
  }
  catch (const std::exception& e) {
    return raise_from(e);
  }
}

PyObject* receive_pool_clear(PyObject* self, PyObject* /*unused*/) {
  auto* pool = reinterpret_cast<ReceivePool*>(self);
  if (pool->state != nullptr) (*pool->state)->clear(/*close=*/false);
  Py_RETURN_NONE;
}

PyObject* receive_pool_counter(PyObject* self, void* which) {
  auto* pool = reinterpret_cast<ReceivePool*>(self);
  if (pool->state == nullptr) return PyLong_FromLong(0);
  PoolState& state = **pool->state;
  std::lock_guard<std::mutex> lock(state.mutex);
  switch (reinterpret_cast<intptr_t>(which)) {
    case 0: return PyLong_FromUnsignedLongLong(state.hits);
    case 1: return PyLong_FromUnsignedLongLong(state.misses);
    case 2: return PyLong_FromSize_t(state.free_bytes);
    default: return PyLong_FromLongLong(state.limit);
  }
}

PyMethodDef receive_pool_methods[] = {
    {"empty", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(receive_pool_empty)),
     METH_FASTCALL,
     "empty(sizes: tuple, dtype[, nbytes]) -> Tensor: uninitialized, contiguous; from a "
     "recycled block from min_cached bytes on (nbytes: the size expected, checked)"},
    {"clear", receive_pool_clear, METH_NOARGS, "clear(): unmap the free blocks"},
    {nullptr, nullptr, 0, nullptr}};

PyGetSetDef receive_pool_getset[] = {
    {"hits", receive_pool_counter, nullptr, "tensors made from a free block", (void*)0},
    {"misses", receive_pool_counter, nullptr, "tensors that needed a new block", (void*)1},
    {"free_bytes", receive_pool_counter, nullptr, "bytes in free blocks", (void*)2},
    {"limit", receive_pool_counter, nullptr, "most bytes kept in free blocks", (void*)3},
    {nullptr, nullptr, nullptr, nullptr, nullptr}};

PyMethodDef module_methods[] = {
    {"frame_tensor", frame_tensor_py, METH_VARARGS,
     "frame_tensor(frame, offset, dtype, sizes: tuple, requires_grad) -> Tensor: the tensor "
     "whose bytes start at offset in frame (a view of them, no copy); frames.c calls the "
     "same function through the capsule frame_tensor_api"},
    {"tensor_facts", tensor_facts_py, METH_O,
     "tensor_facts(tensor) -> (dtype, nbytes, sizes, requires_grad, contiguous, copyable, "
     "data_ptr) or None: what the C codec and call path read of a tensor they send, through "
     "the capsule tensor_facts_api (None: they ask the tensor's Python attributes)"},
    {"record_recv", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(record_recv)),
     METH_FASTCALL,
     "record_recv(record, tensors) -> list: the tensors requiring grad become outputs of a "
     "new RecvRpcBackward node holding record (record.n_outputs and record.node are set)"},
    {"gradient_edges",
     reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(gradient_edges)),
     METH_FASTCALL,
     "gradient_edges(tensors, GradientEdge) -> list: each tensor's gradient edge, or None "
     "where Python must find it"},
    {"reach", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(reach)),
     METH_FASTCALL,
     "reach(edges, recv_types: frozenset, AccumulateGrad) -> (succ, leaf_edges, recv_edges, "
     "recv_nodes): the walk of mpidag.dist_autograd.graph.Reach, or None where it starts at "
     "a Python node"},
    {"send_reach", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(send_reach)),
     METH_FASTCALL,
     "send_reach(tensors, GradientEdge, recv_types, AccumulateGrad) -> (edges, reach): "
     "gradient_edges() and reach() of a send function's tensors in one call (reach None: "
     "Python walks)"},
    {"run_grad", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(run_grad)),
     METH_FASTCALL,
     "run_grad(outputs, grads, inputs, keep_graph) -> tuple: torch.autograd.grad(outputs, "
     "inputs, grads, retain_graph=keep_graph, allow_unused=True) of (node, number) edges in "
     "one C++ call (None where an edge starts at a Python node)"},
    {"futures_problem", futures_problem_py, METH_NOARGS,
     "futures_problem() -> None, or why new_future and set_future_result cannot be used"},
    {"new_future", new_future_py, METH_O,
     "new_future(type) -> type instance: a new torch._C.Future (or subclass) of no devices, "
     "without __init__; fastpath.c calls the same function through the capsule futures_api"},
    {"set_future_result",
     reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(set_future_result_py)),
     METH_FASTCALL,
     "set_future_result(future, value): torch._C.Future.set_result without dropping the GIL"},
    {nullptr, nullptr, 0, nullptr}};

PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_mpidag_torch",
                          "mpidag's C++ against torch (see torch_native.cpp)", -1,
                          module_methods};

}  // namespace

// the records for torch_recorder.cpp's ContextRecorder (torch_records.h)
PyObject* mpidag::record_recv(PyObject* module, PyObject* const* args, Py_ssize_t nargs) {
  return ::record_recv(module, args, nargs);
}

PyObject* mpidag::send_reach(PyObject* module, PyObject* const* args, Py_ssize_t nargs) {
  return ::send_reach(module, args, nargs);
}

PyObject* mpidag::run_grad(PyObject* module, PyObject* const* args, Py_ssize_t nargs) {
  return ::run_grad(module, args, nargs);
}

PyObject* mpidag::reach(PyObject* module, PyObject* const* args, Py_ssize_t nargs) {
  return ::reach(module, args, nargs);
}

PyMODINIT_FUNC PyInit__mpidag_torch(void) {
  n_outputs_name = PyUnicode_InternFromString("n_outputs");
  node_name = PyUnicode_InternFromString("node");
  if (n_outputs_name == nullptr || node_name == nullptr) return nullptr;

  weak_node_type.tp_name = "_mpidag_torch.WeakNode";
  weak_node_type.tp_basicsize = sizeof(WeakNode);
  weak_node_type.tp_flags = Py_TPFLAGS_DEFAULT;
  weak_node_type.tp_doc = "a weak reference to an autograd node: called, the node or None";
  weak_node_type.tp_call = weak_node_call;
  weak_node_type.tp_dealloc = weak_node_dealloc;
  if (PyType_Ready(&weak_node_type) < 0) return nullptr;

  receive_pool_type.tp_name = "_mpidag_torch.ReceivePool";
  receive_pool_type.tp_basicsize = sizeof(ReceivePool);
  receive_pool_type.tp_flags = Py_TPFLAGS_DEFAULT;
  receive_pool_type.tp_doc =
      "ReceivePool(limit, min_cached, size_class): the memory of received tensors, recycled";
  receive_pool_type.tp_new = PyType_GenericNew;
  receive_pool_type.tp_init = receive_pool_init;
  receive_pool_type.tp_dealloc = receive_pool_dealloc;
  receive_pool_type.tp_methods = receive_pool_methods;
  receive_pool_type.tp_getset = receive_pool_getset;
  if (PyType_Ready(&receive_pool_type) < 0) return nullptr;

  torch::autograd::_initFunctionPyTypeObject(recv_pytype, kRecvName, recv_properties,
                                              recv_methods);
  recv_type = reinterpret_cast<PyObject*>(&recv_pytype);
  Py_INCREF(recv_type);
  torch::autograd::registerCppFunction(typeid(RecvRpcBackward), &recv_pytype);

  PyObject* module = PyModule_Create(&module_def);
  if (module == nullptr) return nullptr;
  PyObject* parameter_module = PyImport_ImportModule("torch.nn.parameter");
  if (parameter_module == nullptr) return nullptr;
  PyObject* parameter = PyObject_GetAttrString(parameter_module, "Parameter");
  Py_DECREF(parameter_module);
  if (parameter == nullptr) return nullptr;
  if (!PyType_Check(parameter)) {
    Py_DECREF(parameter);
    PyErr_SetString(PyExc_TypeError, "torch.nn.parameter.Parameter is not a type");
    return nullptr;
  }
  parameter_type = reinterpret_cast<PyTypeObject*>(parameter);  // (kept: torch never frees it)

  PyObject* api = PyCapsule_New(reinterpret_cast<void*>(&frame_tensor),
                                MPIDAG_FRAME_TENSOR_CAPSULE, nullptr);
  PyObject* facts = PyCapsule_New(reinterpret_cast<void*>(&tensor_facts),
                                  MPIDAG_TENSOR_FACTS_CAPSULE, nullptr);
  PyObject* futures = PyCapsule_New(reinterpret_cast<void*>(&futures_api),
                                    MPIDAG_TORCH_FUTURES_CAPSULE, nullptr);
  if (api == nullptr || futures == nullptr || facts == nullptr) {
    Py_XDECREF(api);
    Py_XDECREF(facts);
    Py_XDECREF(futures);
    Py_DECREF(module);
    return nullptr;
  }
  Py_INCREF(recv_type);
  Py_INCREF(&weak_node_type);
  if (PyModule_AddObjectRef(module, "ReceivePool",
                            reinterpret_cast<PyObject*>(&receive_pool_type)) < 0 ||
      PyModule_AddObject(module, "RecvRpcBackward", recv_type) < 0 ||
      PyModule_AddObject(module, "WeakNode", reinterpret_cast<PyObject*>(&weak_node_type)) < 0 ||
      PyModule_AddObject(module, "frame_tensor_api", api) < 0 ||
      PyModule_AddObject(module, "tensor_facts_api", facts) < 0 ||
      PyModule_AddObject(module, "futures_api", futures) < 0 ||
      mpidag::add_context_recorder(module) < 0 || mpidag::add_disjoint_plan(module) < 0 ||
      mpidag::add_pass_core(module) < 0 ||
      PyModule_AddIntConstant(module, "VERSION", VERSION) < 0 ||
      PyModule_AddStringConstant(module, "TORCH_VERSION", MPIDAG_TORCH_VERSION) < 0) {
    Py_DECREF(module);
    return nullptr;
  }
  return module;
}
