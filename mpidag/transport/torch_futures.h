/* The C API that _mpidag_torch (torch_native.cpp, C++ against torch) gives _mpidag_fastpath
 * (mpidag/agent/fastpath.c, no torch) through a capsule: the futures of rpc_async, made and
 * completed in C++ instead of through torch._C.Future's Python bindings. */
#ifndef MPIDAG_TORCH_FUTURES_H
#define MPIDAG_TORCH_FUTURES_H

#include <Python.h>

#define MPIDAG_TORCH_FUTURES_CAPSULE "_mpidag_torch.futures"

typedef struct {
    /* new_future(type): a new instance of type (torch._C.Future or a Python subclass of it)
     * holding a new future of no devices, what type() with torch._C.Future.__init__(self, [])
     * makes, without its __init__ (a subclass's own attributes are the caller's); NULL with an
     * exception set. */
    PyObject *(*new_future)(PyTypeObject *type);
    /* set_result(future, value): torch._C.Future.set_result(future, value) with the GIL held
     * throughout: the future's callbacks run on this thread, and those of Python take the GIL
     * they already have (the plain path completes only futures without callbacks of the
     * user's); a new reference to None, or NULL with torch's error set (a future completed
     * twice: RuntimeError). */
    PyObject *(*set_result)(PyObject *future, PyObject *value);
} mpidag_torch_futures;

#endif
