/* The C API that _mpidag_torch (torch_native.cpp, C++ against torch) gives _mpidag_frames
 * (frames.c, no torch) through a capsule: the tensor of an inline frame-0 spec. */
#ifndef MPIDAG_FRAME_TENSOR_H
#define MPIDAG_FRAME_TENSOR_H

#include <Python.h>
#include <stdint.h>

#define MPIDAG_FRAME_TENSOR_CAPSULE "_mpidag_torch.frame_tensor"

/* frame_tensor(frame, offset, dtype, ndim, sizes, requires_grad): a new reference to the
 * tensor of dtype (a torch.dtype) and sizes[0..ndim) whose bytes start at offset in frame (a
 * buffer: kept alive and exported until the tensor's storage goes), requires_grad set when
 * asked; NULL with an exception set. */
typedef PyObject *(*mpidag_frame_tensor_fn)(PyObject *frame, Py_ssize_t offset, PyObject *dtype,
                                            int ndim, const int64_t *sizes, int requires_grad);

#endif
