/* The step file's tables packed from their rows: `pack_rows`, part of tracer.storage._stats_kernel.
 *
 * A step's /records table is built from row tuples (RECORD_FIELDS order) made by the writers.
 * numpy builds it column by column from Python objects: zip(*rows), one
 * array per column, the string columns encoded value by value; that took 0.7 ms for a tiny
 * step's 204 module records and 2 ms for its 685 op records, inside the training step (the sync
 * writer) or holding the GIL against it (the async writer). Here it is two passes over the
 * tuples: the widths of the string columns (fixed-length UTF-8 as wide as their longest value,
 * docs/dump-format.md), then every value copied into a zeroed buffer laid out as numpy lays
 * out the packed structured dtype (fields in order, no padding, native byte order).
 *
 * Whatever numpy would convert differently (a value of another type than the column's, an int
 * out of int32 range, a str that is not valid UTF-8) makes it answer None, and the caller
 * builds the table with numpy: the two give the same array wherever this one answers.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define MAX_COLUMNS 64

static Py_ssize_t kind_size(char kind) {
    switch (kind) {
        case 'q': case 'd': return 8;
        case 'i': return 4;
        case 's': return 1; /* at least one byte wide, as numpy makes an all-empty column */
        default: return -1;
    }
}

/* An int or an integer with __index__ (numpy's); others (floats, strings) numpy converts. */
static int integral(PyObject *v) { return PyLong_Check(v) || PyIndex_Check(v); }

/* One value into `dst`; 0, or -1 when numpy must convert it instead (no error set). */
static int put_value(char *dst, char kind, PyObject *v) {
    switch (kind) {
        case 'q': {
            if (!integral(v)) return -1;
            long long x = PyLong_AsLongLong(v);
            if (x == -1 && PyErr_Occurred()) { PyErr_Clear(); return -1; }
            int64_t y = (int64_t)x;
            memcpy(dst, &y, 8);
            return 0;
        }
        case 'i': {
            if (!integral(v)) return -1;
            long long x = PyLong_AsLongLong(v);
            if ((x == -1 && PyErr_Occurred()) || x < INT32_MIN || x > INT32_MAX) {
                PyErr_Clear();
                return -1;
            }
            int32_t y = (int32_t)x;
            memcpy(dst, &y, 4);
            return 0;
        }
        case 'd': {
            if (!PyFloat_Check(v) && !integral(v)) return -1;
            double x = PyFloat_AsDouble(v);
            if (x == -1.0 && PyErr_Occurred()) { PyErr_Clear(); return -1; }
            memcpy(dst, &x, 8);
            return 0;
        }
        default: { /* 's', checked and measured in the first pass */
            Py_ssize_t len;
            const char *s = PyUnicode_AsUTF8AndSize(v, &len);
            if (s == NULL) { PyErr_Clear(); return -1; }
            memcpy(dst, s, (size_t)len);
            return 0;
        }
    }
}

/* pack_rows(rows: list[tuple], kinds: bytes) -> (bytearray, widths) | None
 *
 * kinds: one letter a column: 'q' int64, 'i' int32, 'd' float64, 's' str. widths: every
 * column's width in bytes (a str column's: its longest UTF-8 value, at least 1). */
PyObject *kernel_pack_rows(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *rows;
    const char *kinds;
    Py_ssize_t ncol;
    if (!PyArg_ParseTuple(args, "O!y#", &PyList_Type, &rows, &kinds, &ncol)) return NULL;
    if (ncol < 1 || ncol > MAX_COLUMNS) {
        PyErr_Format(PyExc_ValueError, "pack_rows: %zd columns (1 to %d)", ncol, MAX_COLUMNS);
        return NULL;
    }
    Py_ssize_t widths[MAX_COLUMNS], offsets[MAX_COLUMNS];
    for (Py_ssize_t c = 0; c < ncol; c++) {
        widths[c] = kind_size(kinds[c]);
        if (widths[c] < 0) {
            PyErr_Format(PyExc_ValueError, "pack_rows: unknown column kind %c", kinds[c]);
            return NULL;
        }
    }
    Py_ssize_t n = PyList_GET_SIZE(rows);
    for (Py_ssize_t r = 0; r < n; r++) { /* shapes, str types, string widths */
        PyObject *row = PyList_GET_ITEM(rows, r);
        if (!PyTuple_Check(row) || PyTuple_GET_SIZE(row) != ncol) Py_RETURN_NONE;
        for (Py_ssize_t c = 0; c < ncol; c++) {
            if (kinds[c] != 's') continue;
            PyObject *v = PyTuple_GET_ITEM(row, c);
            if (!PyUnicode_Check(v)) Py_RETURN_NONE;
            Py_ssize_t len;
            if (PyUnicode_AsUTF8AndSize(v, &len) == NULL) { PyErr_Clear(); Py_RETURN_NONE; }
            if (len > widths[c]) widths[c] = len;
        }
    }
    Py_ssize_t itemsize = 0;
    for (Py_ssize_t c = 0; c < ncol; c++) {
        offsets[c] = itemsize;
        itemsize += widths[c];
    }
    if (n > 0 && itemsize > PY_SSIZE_T_MAX / n) return PyErr_NoMemory();
    PyObject *buf = PyByteArray_FromStringAndSize(NULL, n * itemsize);
    if (buf == NULL) return NULL;
    char *base = PyByteArray_AS_STRING(buf);
    memset(base, 0, (size_t)(n * itemsize));
    for (Py_ssize_t r = 0; r < n; r++) {
        PyObject *row = PyList_GET_ITEM(rows, r);
        char *item = base + r * itemsize;
        for (Py_ssize_t c = 0; c < ncol; c++) {
            if (put_value(item + offsets[c], kinds[c], PyTuple_GET_ITEM(row, c)) < 0) {
                Py_DECREF(buf);
                Py_RETURN_NONE;
            }
        }
    }
    PyObject *w = PyTuple_New(ncol);
    if (w == NULL) {
        Py_DECREF(buf);
        return NULL;
    }
    for (Py_ssize_t c = 0; c < ncol; c++) {
        PyObject *x = PyLong_FromSsize_t(widths[c]);
        if (x == NULL) {
            Py_DECREF(w);
            Py_DECREF(buf);
            return NULL;
        }
        PyTuple_SET_ITEM(w, c, x);
    }
    PyObject *out = PyTuple_Pack(2, buf, w);
    Py_DECREF(buf);
    Py_DECREF(w);
    return out;
}
