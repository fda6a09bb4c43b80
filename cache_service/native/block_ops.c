/* The block allocator's bulk operations (cache_service/block_allocator.py) in C.
 *
 * The allocator's state lives in two Python-owned uint32 buffers: the refcount of every block
 * and a free list of fixed capacity (num_blocks) whose first `nfree` entries are the free blocks.
 * These functions read and write them in place. At page size 1 a request moves hundreds of
 * block ids per call, and a Python or numpy round per id list costs more than the tree's own
 * work; here an id costs a few nanoseconds.
 *
 * Every call is all or nothing: ids are range-checked first (IndexError, nothing changed), and
 * a refusal (a free block increfed, a block freed more often than it is referenced) undoes what
 * the call had done and reports the position of the offending id for the caller to raise.
 */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

typedef struct {
    Py_buffer view;
    uint32_t *data;
    Py_ssize_t len;
} U32Buffer;

static int get_u32(PyObject *obj, U32Buffer *out, const char *what) {
    if (PyObject_GetBuffer(obj, &out->view, PyBUF_WRITABLE | PyBUF_FORMAT | PyBUF_C_CONTIGUOUS) < 0)
        return -1;
    if (out->view.itemsize != 4 || out->view.format == NULL || strcmp(out->view.format, "I") != 0) {
        PyBuffer_Release(&out->view);
        PyErr_Format(PyExc_TypeError, "%s must be a writable uint32 ('I') buffer", what);
        return -1;
    }
    out->data = (uint32_t *)out->view.buf;
    out->len = out->view.len / 4;
    return 0;
}

/* The allocator's two buffers; on failure neither is held. */
static int get_state(PyObject *rc_obj, PyObject *free_obj, U32Buffer *rc, U32Buffer *fl) {
    if (get_u32(rc_obj, rc, "refcount") < 0)
        return -1;
    if (get_u32(free_obj, fl, "free list") < 0) {
        PyBuffer_Release(&rc->view);
        return -1;
    }
    return 0;
}

/* The ids of a list or tuple as uint32, range-checked against `limit`; NULL with an exception
 * set otherwise. The caller frees the array with PyMem_Free. */
static uint32_t *read_ids(PyObject *ids, Py_ssize_t limit, Py_ssize_t *count) {
    PyObject *seq = PySequence_Fast(ids, "block ids must be a sequence of ints");
    if (seq == NULL)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    uint32_t *out = PyMem_Malloc((size_t)(n ? n : 1) * sizeof(uint32_t));
    if (out == NULL) {
        Py_DECREF(seq);
        PyErr_NoMemory();
        return NULL;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        long long v = PyLong_AsLongLong(items[i]);
        if (v == -1 && PyErr_Occurred()) {
            PyMem_Free(out);
            Py_DECREF(seq);
            return NULL;
        }
        if (v < 0 || v >= limit) {
            PyMem_Free(out);
            Py_DECREF(seq);
            PyErr_Format(PyExc_IndexError, "block id %lld out of range [0, %zd)", v, limit);
            return NULL;
        }
        out[i] = (uint32_t)v;
    }
    Py_DECREF(seq);
    *count = n;
    return out;
}

/* take(refcount, free, nfree, n) -> list: the last n entries of the free list, last first,
 * each given refcount 1 (the caller checked n <= nfree and lowers nfree by n). */
static PyObject *take(PyObject *self, PyObject *args) {
    PyObject *rc_obj, *free_obj;
    Py_ssize_t nfree, n;
    if (!PyArg_ParseTuple(args, "OOnn", &rc_obj, &free_obj, &nfree, &n))
        return NULL;
    U32Buffer rc, fl;
    if (get_state(rc_obj, free_obj, &rc, &fl) < 0)
        return NULL;
    PyObject *out = NULL;
    if (n < 0 || nfree > fl.len || n > nfree) {
        PyErr_SetString(PyExc_ValueError, "take: n must be within the free list");
        goto done;
    }
    out = PyList_New(n);
    if (out == NULL)
        goto done;
    for (Py_ssize_t i = 0; i < n; i++) {
        uint32_t b = fl.data[nfree - 1 - i];
        if (b >= rc.len) {
            Py_CLEAR(out);
            PyErr_Format(PyExc_IndexError, "free list holds block %u out of range", b);
            goto done;
        }
        PyObject *v = PyLong_FromUnsignedLong(b);
        if (v == NULL) {
            Py_CLEAR(out);
            goto done;
        }
        PyList_SET_ITEM(out, i, v);
    }
    for (Py_ssize_t i = 0; i < n; i++)
        rc.data[fl.data[nfree - 1 - i]] = 1;
done:
    PyBuffer_Release(&rc.view);
    PyBuffer_Release(&fl.view);
    return out;
}

/* incref(refcount, ids) -> int: -1 when every id got one more reference, else the position of
 * the first id whose block is free (nothing changed); OverflowError (nothing changed) where a
 * refcount would pass 2**32 - 1. */
static PyObject *incref(PyObject *self, PyObject *args) {
    PyObject *rc_obj, *ids_obj;
    if (!PyArg_ParseTuple(args, "OO", &rc_obj, &ids_obj))
        return NULL;
    U32Buffer rc;
    if (get_u32(rc_obj, &rc, "refcount") < 0)
        return NULL;
    Py_ssize_t n = 0;
    uint32_t *ids = read_ids(ids_obj, rc.len, &n);
    PyObject *out = NULL;
    if (ids == NULL)
        goto done;
    Py_ssize_t bad = -1;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (rc.data[ids[i]] == 0) {
            bad = i;
            break;
        }
    }
    if (bad < 0) {
        Py_ssize_t i = 0;
        for (; i < n && rc.data[ids[i]] < UINT32_MAX; i++)
            rc.data[ids[i]] += 1;
        if (i < n) {  /* a refcount would wrap to 0 (a held block would look free): undo */
            while (i-- > 0)
                rc.data[ids[i]] -= 1;
            PyErr_SetString(PyExc_OverflowError, "incref: a block's refcount would exceed 2**32 - 1");
            goto done;
        }
    }
    out = PyLong_FromSsize_t(bad);
done:
    PyMem_Free(ids);
    PyBuffer_Release(&rc.view);
    return out;
}

/* release(refcount, free, nfree, ids) -> int: drops one reference per id in order, appending
 * each block that reaches 0 to the free list; the new nfree (>= 0), or -(i + 1) where id i was
 * freed more often than referenced (everything undone). */
static PyObject *release(PyObject *self, PyObject *args) {
    PyObject *rc_obj, *free_obj, *ids_obj;
    Py_ssize_t nfree;
    if (!PyArg_ParseTuple(args, "OOnO", &rc_obj, &free_obj, &nfree, &ids_obj))
        return NULL;
    U32Buffer rc, fl;
    if (get_state(rc_obj, free_obj, &rc, &fl) < 0)
        return NULL;
    PyObject *out = NULL;
    Py_ssize_t n = 0;
    uint32_t *ids = NULL;
    if (nfree < 0 || nfree > fl.len) {
        PyErr_SetString(PyExc_ValueError, "release: nfree out of range");
        goto done;
    }
    ids = read_ids(ids_obj, rc.len, &n);
    if (ids == NULL)
        goto done;
    Py_ssize_t at = nfree;
    for (Py_ssize_t i = 0; i < n; i++) {
        uint32_t b = ids[i];
        uint32_t count = rc.data[b];
        if (count == 0 || (count == 1 && at >= fl.len)) {
            for (Py_ssize_t j = 0; j < i; j++)  /* undo, then report position i */
                rc.data[ids[j]] += 1;
            out = PyLong_FromSsize_t(-(i + 1));
            goto done;
        }
        rc.data[b] = count - 1;
        if (count == 1)
            fl.data[at++] = b;
    }
    out = PyLong_FromSsize_t(at);
done:
    PyMem_Free(ids);
    PyBuffer_Release(&rc.view);
    PyBuffer_Release(&fl.view);
    return out;
}

static PyMethodDef methods[] = {
    {"take", take, METH_VARARGS, "take(refcount, free, nfree, n) -> list of n blocks, refcount 1 each"},
    {"incref", incref, METH_VARARGS, "incref(refcount, ids) -> -1, or the position of a free block"},
    {"release", release, METH_VARARGS, "release(refcount, free, nfree, ids) -> new nfree, or -(i + 1)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_block_ops", NULL, -1, methods};

PyMODINIT_FUNC PyInit__block_ops(void) { return PyModule_Create(&module); }
