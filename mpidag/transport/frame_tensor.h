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

#define MPIDAG_TENSOR_FACTS_CAPSULE "_mpidag_torch.tensor_facts"
#define MPIDAG_FACTS_DIMS 8

/* What the encoder asks of a tensor it sends, read from the C++ tensor in one call (the same
 * values as its Python attributes, without ten Python calls). */
typedef struct {
    PyObject *dtype;  /* borrowed: the torch.dtype (torch keeps it alive) */
    int64_t nbytes;   /* numel * element size */
    int ndim;
    int64_t sizes[MPIDAG_FACTS_DIMS];
    int requires_grad;
    int contiguous;   /* is_contiguous() */
    int copyable;     /* contiguous, neither conjugated nor negated: its bytes as they are */
    const void *data; /* data_ptr() where copyable and nbytes > 0, else NULL */
} mpidag_tensor_facts;

/* tensor_facts(obj, facts): 1 when obj is a torch.Tensor or nn.Parameter (not a subclass of
 * the user's, no tensor subclass dispatch, no functorch wrapper), strided, on the CPU, of at
 * most MPIDAG_FACTS_DIMS dimensions, with facts filled; 0 for anything else (the caller
 * reads the Python attributes, which give the same values or raise the same errors as
 * before). Never sets an exception. */
typedef int (*mpidag_tensor_facts_fn)(PyObject *obj, mpidag_tensor_facts *facts);

#endif
