/* mpidag/transport/slots.h: the __slots__ of mpidag's own Python classes (Envelope,
 * PendingCall, the distributed autograd records), read and written by its compiled
 * modules (_mpidag_frames, _mpidag_fastpath, _mpidag_torch) straight at their offsets.
 *
 * A module binds each slot once, by its class's member descriptor, and checks it with
 * mpidag_slot_check (an object slot, writable, no audit flag). An access then reads the
 * descriptor's offset and checks the object's type itself: a read is a type compare and
 * a load (~10 instructions) instead of the generic protocol (tp_descr_get -> member_get
 * -> PyMember_GetOne, ~45), which a no-op round trip paid ~100 times. An object of
 * another type goes through the descriptor protocol, so its TypeError is CPython's own,
 * and an unset slot raises the AttributeError CPython raises. Callers hold the GIL.
 *
 * Header only (static inline), for C and C++.
 */
#ifndef MPIDAG_SLOTS_H
#define MPIDAG_SLOTS_H

#include <Python.h>
#include <structmember.h>

/* 0 if descr is a member descriptor of an object slot that Python code may set (what
 * `__slots__` makes); else -1 with a TypeError that names owner.name ("owner" is for the
 * message only) and says to rebuild: the Python classes changed without a rebuild. */
static inline int mpidag_slot_check(PyObject *descr, const char *owner, const char *name)
{
    if (PyObject_TypeCheck(descr, &PyMemberDescr_Type)) {
        PyMemberDef *member = ((PyMemberDescrObject *)descr)->d_member;
        if (member->type == T_OBJECT_EX && member->flags == 0)
            return 0;
    }
    PyErr_Format(PyExc_TypeError,
                 "%s.%s is not a writable __slots__ entry (it is %R): rebuild mpidag's compiled "
                 "modules (python -m mpidag.transport.wire_build)", owner, name, descr);
    return -1;
}

/* Whether obj is an instance of the class that defined descr (the slot is at its offset). */
static inline int mpidag_slot_applies(PyObject *descr, PyObject *obj)
{
    PyTypeObject *type = PyDescr_TYPE(descr);
    return Py_IS_TYPE(obj, type) || PyType_IsSubtype(Py_TYPE(obj), type);
}

static inline PyObject **mpidag_slot_address(PyObject *descr, PyObject *obj)
{
    return (PyObject **)((char *)obj + ((PyMemberDescrObject *)descr)->d_member->offset);
}

static inline void mpidag_slot_unset(PyObject *descr, PyObject *obj)
{
    PyErr_Format(PyExc_AttributeError, "'%.200s' object has no attribute '%s'",
                 Py_TYPE(obj)->tp_name, ((PyMemberDescrObject *)descr)->d_member->name);
}

/* obj's slot: a new reference, or NULL with an AttributeError (unset) or a TypeError. */
static inline PyObject *mpidag_slot_get(PyObject *descr, PyObject *obj)
{
    if (!mpidag_slot_applies(descr, obj))
        return Py_TYPE(descr)->tp_descr_get(descr, obj, (PyObject *)Py_TYPE(obj));
    PyObject *value = *mpidag_slot_address(descr, obj);
    if (value == NULL) {
        mpidag_slot_unset(descr, obj);
        return NULL;
    }
    Py_INCREF(value);
    return value;
}

/* Sets obj's slot to value (borrowed, as tp_descr_set; NULL deletes it): 0, or -1 with
 * an error. */
static inline int mpidag_slot_set(PyObject *descr, PyObject *obj, PyObject *value)
{
    if (!mpidag_slot_applies(descr, obj))
        return Py_TYPE(descr)->tp_descr_set(descr, obj, value);
    PyObject **address = mpidag_slot_address(descr, obj);
    PyObject *old = *address;
    if (value == NULL && old == NULL) {
        mpidag_slot_unset(descr, obj);
        return -1;
    }
    Py_XINCREF(value);
    *address = value;
    Py_XDECREF(old);
    return 0;
}

#endif /* MPIDAG_SLOTS_H */
