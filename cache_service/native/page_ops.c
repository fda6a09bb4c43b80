/* The page index's loops (cache_service/page_index.py) in C.
 *
 * The index is a Python dict per namespace, page hash -> bit mask of the holders of that page
 * (a Python int: two bits per pool, so past 32 pools a mask outgrows 64 bits). Route walks a
 * prompt's hash chain in it, and every page a tree caches or evicts and every page a routed
 * prompt promises is added to or removed from it (and counted: a page several routed prompts of
 * one pool promise is that pool's once, cache_service/routed.py): at fleet scale these loops ran thousands of
 * times a second in bytecode. Here they run over the same dicts and ints through the C API, so
 * the Python code and this give the same answers on the same objects (tests/cache/test_page_index.py
 * runs both).
 */

#define PY_SSIZE_T_CLEAN
#include <Python.h>

/* add(pages, hashes, bit) -> count: pages[h] = bit, or held | bit, for each h of `hashes`. */
static PyObject *add(PyObject *self, PyObject *args) {
    PyObject *pages, *hashes, *bit;
    if (!PyArg_ParseTuple(args, "O!OO", &PyDict_Type, &pages, &hashes, &bit))
        return NULL;
    PyObject *it = PyObject_GetIter(hashes);
    if (it == NULL)
        return NULL;
    Py_ssize_t n = 0;
    PyObject *h;
    while ((h = PyIter_Next(it)) != NULL) {
        PyObject *held = PyDict_GetItemWithError(pages, h); /* borrowed */
        int rc = -1;
        if (held != NULL) {
            PyObject *mask = PyNumber_Or(held, bit);
            if (mask != NULL) {
                rc = PyDict_SetItem(pages, h, mask);
                Py_DECREF(mask);
            }
        } else if (!PyErr_Occurred()) {
            rc = PyDict_SetItem(pages, h, bit); /* one holder: its own bit object, no new int */
        }
        Py_DECREF(h);
        if (rc < 0) {
            Py_DECREF(it);
            return NULL;
        }
        n++;
    }
    Py_DECREF(it);
    if (PyErr_Occurred())
        return NULL;
    return PyLong_FromSsize_t(n);
}

/* remove(pages, hashes, keep) -> count: pages[h] &= keep (keep = ~bit), the entry dropped when
 * no holder is left, for each h of `hashes`. */
static PyObject *remove_bits(PyObject *self, PyObject *args) {
    PyObject *pages, *hashes, *keep;
    if (!PyArg_ParseTuple(args, "O!OO", &PyDict_Type, &pages, &hashes, &keep))
        return NULL;
    PyObject *it = PyObject_GetIter(hashes);
    if (it == NULL)
        return NULL;
    Py_ssize_t n = 0;
    PyObject *h;
    while ((h = PyIter_Next(it)) != NULL) {
        PyObject *held = PyDict_GetItemWithError(pages, h); /* borrowed */
        int rc = 0;
        if (held != NULL) {
            PyObject *mask = PyNumber_And(held, keep);
            if (mask == NULL) {
                rc = -1;
            } else {
                int nonzero = PyObject_IsTrue(mask);
                rc = nonzero < 0 ? -1 : nonzero ? PyDict_SetItem(pages, h, mask) : PyDict_DelItem(pages, h);
                Py_DECREF(mask);
            }
        } else if (PyErr_Occurred()) {
            rc = -1;
        }
        Py_DECREF(h);
        if (rc < 0) {
            Py_DECREF(it);
            return NULL;
        }
        n++;
    }
    Py_DECREF(it);
    if (PyErr_Occurred())
        return NULL;
    return PyLong_FromSsize_t(n);
}

/* out[bit] = depth for each set bit of `mask` (steals nothing). */
static int put_bits(PyObject *out, PyObject *mask, Py_ssize_t depth) {
    PyObject *value = PyLong_FromSsize_t(depth);
    if (value == NULL)
        return -1;
    Py_INCREF(mask);
    int rc = 0;
    for (;;) {
        int nonzero = PyObject_IsTrue(mask);
        if (nonzero <= 0) {
            rc = nonzero;
            break;
        }
        PyObject *neg = PyNumber_Negative(mask);
        PyObject *low = neg != NULL ? PyNumber_And(mask, neg) : NULL;
        Py_XDECREF(neg);
        PyObject *rest = low != NULL ? PyNumber_Xor(mask, low) : NULL;
        if (rest == NULL || PyDict_SetItem(out, low, value) < 0) {
            Py_XDECREF(low);
            Py_XDECREF(rest);
            rc = -1;
            break;
        }
        Py_DECREF(low);
        Py_DECREF(mask);
        mask = rest;
    }
    Py_DECREF(mask);
    Py_DECREF(value);
    return rc;
}

/* depths(pages, hashes, mask) -> {holder bit: leading pages of the chain it holds} for the
 * holders in `mask` that hold the first page; stops at the first page no holder has. */
static PyObject *depths(PyObject *self, PyObject *args) {
    PyObject *pages, *hashes, *mask;
    if (!PyArg_ParseTuple(args, "O!OO", &PyDict_Type, &pages, &hashes, &mask))
        return NULL;
    PyObject *out = PyDict_New();
    if (out == NULL)
        return NULL;
    PyObject *it = PyObject_GetIter(hashes);
    if (it == NULL) {
        Py_DECREF(out);
        return NULL;
    }
    PyObject *zero = PyLong_FromLong(0);
    PyObject *held = mask;
    Py_INCREF(held);
    Py_ssize_t depth = 0;
    PyObject *h;
    int failed = zero == NULL;
    while (!failed && (h = PyIter_Next(it)) != NULL) {
        PyObject *got = PyDict_GetItemWithError(pages, h); /* borrowed */
        Py_DECREF(h);
        if (got == NULL && PyErr_Occurred()) {
            failed = 1;
            break;
        }
        PyObject *deeper = PyNumber_And(got != NULL ? got : zero, held);
        if (deeper == NULL) {
            failed = 1;
            break;
        }
        int same = PyObject_RichCompareBool(deeper, held, Py_EQ);
        if (same < 0) {
            Py_DECREF(deeper);
            failed = 1;
            break;
        }
        if (!same) { /* some holders end here (most pages: none do) */
            if (depth) { /* holders without the first page are left out */
                PyObject *inv = PyNumber_Invert(deeper);
                PyObject *ending = inv != NULL ? PyNumber_And(held, inv) : NULL;
                Py_XDECREF(inv);
                if (ending == NULL || put_bits(out, ending, depth) < 0) {
                    Py_XDECREF(ending);
                    Py_DECREF(deeper);
                    failed = 1;
                    break;
                }
                Py_DECREF(ending);
            }
            int any = PyObject_IsTrue(deeper);
            Py_DECREF(held);
            held = deeper;
            if (any <= 0) {
                failed = any < 0;
                depth = 0; /* nothing left to put */
                goto done;
            }
        } else {
            Py_DECREF(deeper);
        }
        depth++;
    }
    if (!failed && PyErr_Occurred())
        failed = 1;
    if (!failed && depth && put_bits(out, held, depth) < 0)
        failed = 1;
done:
    Py_DECREF(it);
    Py_DECREF(held);
    Py_XDECREF(zero);
    if (failed) {
        Py_DECREF(out);
        return NULL;
    }
    return out;
}

/* count_add(counts, hashes) -> the hashes whose count went from 0 to 1 (counts[h] += 1 each). */
static PyObject *count_add(PyObject *self, PyObject *args) {
    PyObject *counts, *hashes;
    if (!PyArg_ParseTuple(args, "O!O", &PyDict_Type, &counts, &hashes))
        return NULL;
    PyObject *fresh = PyList_New(0);
    PyObject *it = fresh != NULL ? PyObject_GetIter(hashes) : NULL;
    if (it == NULL) {
        Py_XDECREF(fresh);
        return NULL;
    }
    PyObject *one = PyLong_FromLong(1);
    PyObject *h;
    int failed = one == NULL;
    while (!failed && (h = PyIter_Next(it)) != NULL) {
        PyObject *n = PyDict_GetItemWithError(counts, h); /* borrowed */
        if (n != NULL) {
            PyObject *more = PyNumber_Add(n, one);
            failed = more == NULL || PyDict_SetItem(counts, h, more) < 0;
            Py_XDECREF(more);
        } else {
            failed = PyErr_Occurred() != NULL || PyDict_SetItem(counts, h, one) < 0 || PyList_Append(fresh, h) < 0;
        }
        Py_DECREF(h);
    }
    Py_DECREF(it);
    Py_XDECREF(one);
    if (failed || PyErr_Occurred()) {
        Py_DECREF(fresh);
        return NULL;
    }
    return fresh;
}

/* count_remove(counts, hashes) -> the hashes whose count went to 0 (dropped from `counts`);
 * KeyError for a hash not counted (after the hashes before it were taken off). */
static PyObject *count_remove(PyObject *self, PyObject *args) {
    PyObject *counts, *hashes;
    if (!PyArg_ParseTuple(args, "O!O", &PyDict_Type, &counts, &hashes))
        return NULL;
    PyObject *gone = PyList_New(0);
    PyObject *it = gone != NULL ? PyObject_GetIter(hashes) : NULL;
    if (it == NULL) {
        Py_XDECREF(gone);
        return NULL;
    }
    PyObject *one = PyLong_FromLong(1);
    PyObject *h;
    int failed = one == NULL;
    while (!failed && (h = PyIter_Next(it)) != NULL) {
        PyObject *n = PyDict_GetItemWithError(counts, h); /* borrowed */
        if (n == NULL) {
            if (!PyErr_Occurred())
                PyErr_SetObject(PyExc_KeyError, h);
            failed = 1;
        } else {
            PyObject *left = PyNumber_Subtract(n, one);
            int nonzero = left != NULL ? PyObject_IsTrue(left) : -1;
            if (nonzero < 0)
                failed = 1;
            else if (nonzero)
                failed = PyDict_SetItem(counts, h, left) < 0;
            else
                failed = PyDict_DelItem(counts, h) < 0 || PyList_Append(gone, h) < 0;
            Py_XDECREF(left);
        }
        Py_DECREF(h);
    }
    Py_DECREF(it);
    Py_XDECREF(one);
    if (failed || PyErr_Occurred()) {
        Py_DECREF(gone);
        return NULL;
    }
    return gone;
}

static PyMethodDef methods[] = {
    {"add", add, METH_VARARGS, "add(pages, hashes, bit) -> count: each page's holders gain `bit`"},
    {"remove", remove_bits, METH_VARARGS, "remove(pages, hashes, keep) -> count: each page's holders & keep"},
    {"count_add", count_add, METH_VARARGS, "count_add(counts, hashes) -> hashes counted for the first time"},
    {"count_remove", count_remove, METH_VARARGS, "count_remove(counts, hashes) -> hashes no longer counted"},
    {"depths", depths, METH_VARARGS, "depths(pages, hashes, mask) -> {holder bit: leading pages held}"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_page_ops", NULL, -1, methods};

PyMODINIT_FUNC PyInit__page_ops(void) { return PyModule_Create(&module); }
