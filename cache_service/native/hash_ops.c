/* The chained page hash of cache_service/page_hash.py in C: one pass over a prompt's encoded
 * tokens, XXH3 per page, instead of a Python loop that slices and calls per page. Same outputs
 * (tests/cache/test_page_hash.py compares both on random prompts, namespaces and page sizes). */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

#define XXH_INLINE_ALL
#include "third_party/xxhash.h"

/* page_hashes(raw, page_bytes, parent_hash, ns_seed) -> [hash of each whole page of raw]:
 * h_i = XXH3_64(page_i, seed = h_{i-1} ^ ns_seed), h_{-1} = parent_hash; a trailing partial page
 * is ignored. raw: any bytes-like object (encoded tokens). */
static PyObject *page_hashes(PyObject *self, PyObject *args) {
    Py_buffer raw;
    Py_ssize_t page_bytes;
    unsigned long long parent, ns_seed;
    if (!PyArg_ParseTuple(args, "y*nKK", &raw, &page_bytes, &parent, &ns_seed))
        return NULL;
    if (page_bytes <= 0) {
        PyBuffer_Release(&raw);
        PyErr_SetString(PyExc_ValueError, "page_bytes must be > 0");
        return NULL;
    }
    Py_ssize_t pages = raw.len / page_bytes;
    PyObject *out = PyList_New(pages);
    if (out == NULL) {
        PyBuffer_Release(&raw);
        return NULL;
    }
    const char *data = (const char *)raw.buf;
    XXH64_hash_t h = (XXH64_hash_t)parent;
    for (Py_ssize_t i = 0; i < pages; i++) {
        h = XXH3_64bits_withSeed(data + i * page_bytes, (size_t)page_bytes, h ^ (XXH64_hash_t)ns_seed);
        PyObject *value = PyLong_FromUnsignedLongLong(h);
        if (value == NULL) {
            Py_DECREF(out);
            PyBuffer_Release(&raw);
            return NULL;
        }
        PyList_SET_ITEM(out, i, value);
    }
    PyBuffer_Release(&raw);
    return out;
}

static PyMethodDef methods[] = {
    {"page_hashes", page_hashes, METH_VARARGS,
     "page_hashes(raw, page_bytes, parent_hash, ns_seed) -> [chained XXH3 of each whole page]"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_hash_ops", NULL, -1, methods};

PyMODINIT_FUNC PyInit__hash_ops(void) { return PyModule_Create(&module); }
