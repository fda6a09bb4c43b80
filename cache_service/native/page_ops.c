/* The page index's loops (cache_service/page_index.py) in C.
 *
 * The index is a Python dict per namespace (for a large namespace a list of dicts, shards chosen
 * by the hash's low bits), page hash -> bit mask of the holders of that page (a Python int: two
 * bits per pool, so past 32 pools a mask outgrows 64 bits). Route walks a
 * prompt's hash chain in it, and every page a tree caches or evicts and every page a routed
 * prompt promises is added to or removed from it (and counted: a page several routed prompts of
 * one pool promise is that pool's once, cache_service/routed.py): at fleet scale these loops ran thousands of
 * times a second in bytecode. Here they run over the same dicts and ints through the C API, so
 * the Python code and this give the same answers on the same objects (tests/cache/test_page_index.py
 * runs both).
 */

#define PY_SSIZE_T_CLEAN
#include <Python.h>

/* The dict of `pages` that holds hash `h`: `pages` itself when it is a dict, else the shard
 * h & (len - 1) of a list of dicts (its length a power of two; page_index.py). Borrowed. */
static PyObject *shard_of(PyObject *pages, PyObject *h) {
    if (PyDict_CheckExact(pages))
        return pages;
    unsigned long long key = PyLong_AsUnsignedLongLongMask(h);
    if (key == (unsigned long long)-1 && PyErr_Occurred())
        return NULL;
    PyObject *shard = PyList_GET_ITEM(pages, (Py_ssize_t)(key & (unsigned long long)(PyList_GET_SIZE(pages) - 1)));
    if (!PyDict_CheckExact(shard)) {
        PyErr_SetString(PyExc_TypeError, "a page index shard must be a dict");
        return NULL;
    }
    return shard;
}

/* `pages` as the loops take it: a dict, or a non-empty list of dicts whose length is a power of two. */
static int check_pages(PyObject *pages) {
    if (PyDict_CheckExact(pages))
        return 0;
    Py_ssize_t n = PyList_CheckExact(pages) ? PyList_GET_SIZE(pages) : 0;
    if (n <= 0 || (n & (n - 1))) {
        PyErr_SetString(PyExc_TypeError, "pages must be a dict or a list of 2^k dicts");
        return -1;
    }
    return 0;
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
    if (!PyArg_ParseTuple(args, "OOO", &pages, &hashes, &mask) || check_pages(pages) < 0)
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
        PyObject *shard = shard_of(pages, h);
        PyObject *got = shard != NULL ? PyDict_GetItemWithError(shard, h) : NULL; /* borrowed */
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

/* One change per hash of `hashes` to `dict` (`step`, with `arg`; `out`: a list it may append
 * to, or NULL). Returns the number of hashes, or `out` when one is kept; NULL on an error. */
typedef int (*HashStep)(PyObject *dict, PyObject *h, PyObject *arg, PyObject *out);

static PyObject *each_hash(PyObject *dict, PyObject *hashes, PyObject *arg, HashStep step, int keep_out) {
    PyObject *out = keep_out ? PyList_New(0) : NULL;
    if (keep_out && out == NULL)
        return NULL;
    PyObject *it = PyObject_GetIter(hashes);
    if (it == NULL) {
        Py_XDECREF(out);
        return NULL;
    }
    Py_ssize_t n = 0;
    int failed = 0;
    PyObject *h;
    while (!failed && (h = PyIter_Next(it)) != NULL) {
        PyObject *shard = shard_of(dict, h);
        failed = shard == NULL || step(shard, h, arg, out) < 0;
        Py_DECREF(h);
        n++;
    }
    Py_DECREF(it);
    if (failed || PyErr_Occurred()) {
        Py_XDECREF(out);
        return NULL;
    }
    return keep_out ? out : PyLong_FromSsize_t(n);
}

/* dict[h] = value, or dict[h] op value where h is there already (op: PyNumber_Or, PyNumber_Add). */
static int merge(PyObject *dict, PyObject *h, PyObject *value, binaryfunc op, PyObject *fresh) {
    PyObject *held = PyDict_GetItemWithError(dict, h); /* borrowed */
    if (held == NULL) {
        if (PyErr_Occurred() || PyDict_SetItem(dict, h, value) < 0)
            return -1;
        return fresh != NULL ? PyList_Append(fresh, h) : 0;
    }
    PyObject *merged = op(held, value);
    int rc = merged != NULL ? PyDict_SetItem(dict, h, merged) : -1;
    Py_XDECREF(merged);
    return rc;
}

/* dict[h] = dict[h] op value, the entry dropped (and h appended to `gone`) when that is 0;
 * a missing h: nothing when `missing_ok`, else KeyError (op: PyNumber_And, PyNumber_Subtract). */
static int reduce(PyObject *dict, PyObject *h, PyObject *value, binaryfunc op, PyObject *gone, int missing_ok) {
    PyObject *held = PyDict_GetItemWithError(dict, h); /* borrowed */
    if (held == NULL) {
        if (PyErr_Occurred())
            return -1;
        if (missing_ok)
            return 0;
        PyErr_SetObject(PyExc_KeyError, h);
        return -1;
    }
    PyObject *left = op(held, value);
    int nonzero = left != NULL ? PyObject_IsTrue(left) : -1;
    int rc = nonzero < 0 ? -1
             : nonzero ? PyDict_SetItem(dict, h, left)
             : PyDict_DelItem(dict, h) < 0 ? -1
             : gone != NULL ? PyList_Append(gone, h) : 0;
    Py_XDECREF(left);
    return rc;
}

static int add_step(PyObject *pages, PyObject *h, PyObject *bit, PyObject *out) {
    return merge(pages, h, bit, PyNumber_Or, NULL); /* one holder: its own bit object, no new int */
}

static int remove_step(PyObject *pages, PyObject *h, PyObject *keep, PyObject *out) {
    return reduce(pages, h, keep, PyNumber_And, NULL, 1);
}

static int count_add_step(PyObject *counts, PyObject *h, PyObject *one, PyObject *fresh) {
    return merge(counts, h, one, PyNumber_Add, fresh);
}

static int count_remove_step(PyObject *counts, PyObject *h, PyObject *one, PyObject *gone) {
    return reduce(counts, h, one, PyNumber_Subtract, gone, 0);
}

/* add(pages, hashes, bit) -> count: pages[h] = bit, or held | bit, for each h of `hashes`. */
static PyObject *add(PyObject *self, PyObject *args) {
    PyObject *pages, *hashes, *bit;
    if (!PyArg_ParseTuple(args, "OOO", &pages, &hashes, &bit) || check_pages(pages) < 0)
        return NULL;
    return each_hash(pages, hashes, bit, add_step, 0);
}

/* remove(pages, hashes, keep) -> count: pages[h] &= keep (keep = ~bit), the entry dropped when
 * no holder is left, for each h of `hashes`. */
static PyObject *remove_bits(PyObject *self, PyObject *args) {
    PyObject *pages, *hashes, *keep;
    if (!PyArg_ParseTuple(args, "OOO", &pages, &hashes, &keep) || check_pages(pages) < 0)
        return NULL;
    return each_hash(pages, hashes, keep, remove_step, 0);
}

/* count_add(counts, hashes) -> the hashes whose count went from 0 to 1 (counts[h] += 1 each). */
static PyObject *count_add(PyObject *self, PyObject *args) {
    PyObject *counts, *hashes;
    if (!PyArg_ParseTuple(args, "O!O", &PyDict_Type, &counts, &hashes))
        return NULL;
    PyObject *one = PyLong_FromLong(1);
    PyObject *fresh = one != NULL ? each_hash(counts, hashes, one, count_add_step, 1) : NULL;
    Py_XDECREF(one);
    return fresh;
}

/* count_remove(counts, hashes) -> the hashes whose count went to 0 (dropped from `counts`);
 * KeyError for a hash not counted (after the hashes before it were taken off). */
static PyObject *count_remove(PyObject *self, PyObject *args) {
    PyObject *counts, *hashes;
    if (!PyArg_ParseTuple(args, "O!O", &PyDict_Type, &counts, &hashes))
        return NULL;
    PyObject *one = PyLong_FromLong(1);
    PyObject *gone = one != NULL ? each_hash(counts, hashes, one, count_remove_step, 1) : NULL;
    Py_XDECREF(one);
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
