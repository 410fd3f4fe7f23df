/* The step file's tables packed from their rows: `pack_rows`, part of tracer._fused.
 *
 * A step's /records table is built from row tuples (RECORD_FIELDS order) made by the writers
 * and the op observer. numpy builds it column by column from Python objects: zip(*rows), one
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
PyObject *fused_pack_rows(PyObject *self, PyObject *args) {
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

/* The checksum HDF5 puts after its metadata blocks (object headers, superblock version 2):
 * Bob Jenkins' lookup3 `hashlittle` with an initial value of 0, written here from the
 * algorithm's published description. tracer/_template.py recomputes it after patching the
 * values of a step file's attributes into an image HDF5 wrote, and checks it against the
 * checksums HDF5 itself wrote before it trusts the image. */
#define ROT32(x, k) (((x) << (k)) | ((x) >> (32 - (k))))

static uint32_t lookup3(const uint8_t *k, size_t length, uint32_t initval) {
    uint32_t a, b, c;
    a = b = c = 0xdeadbeefu + (uint32_t)length + initval;
    while (length > 12) {
        a += (uint32_t)k[0] | (uint32_t)k[1] << 8 | (uint32_t)k[2] << 16 | (uint32_t)k[3] << 24;
        b += (uint32_t)k[4] | (uint32_t)k[5] << 8 | (uint32_t)k[6] << 16 | (uint32_t)k[7] << 24;
        c += (uint32_t)k[8] | (uint32_t)k[9] << 8 | (uint32_t)k[10] << 16 | (uint32_t)k[11] << 24;
        /* mix */
        a -= c; a ^= ROT32(c, 4);  c += b;
        b -= a; b ^= ROT32(a, 6);  a += c;
        c -= b; c ^= ROT32(b, 8);  b += a;
        a -= c; a ^= ROT32(c, 16); c += b;
        b -= a; b ^= ROT32(a, 19); a += c;
        c -= b; c ^= ROT32(b, 4);  b += a;
        length -= 12;
        k += 12;
    }
    if (length == 0) return c;
    /* the last 1-12 bytes, the missing ones counted as zero */
    uint8_t tail[12] = {0};
    memcpy(tail, k, length);
    a += (uint32_t)tail[0] | (uint32_t)tail[1] << 8 | (uint32_t)tail[2] << 16 |
         (uint32_t)tail[3] << 24;
    b += (uint32_t)tail[4] | (uint32_t)tail[5] << 8 | (uint32_t)tail[6] << 16 |
         (uint32_t)tail[7] << 24;
    c += (uint32_t)tail[8] | (uint32_t)tail[9] << 8 | (uint32_t)tail[10] << 16 |
         (uint32_t)tail[11] << 24;
    /* final */
    c ^= b; c -= ROT32(b, 14);
    a ^= c; a -= ROT32(c, 11);
    b ^= a; b -= ROT32(a, 25);
    c ^= b; c -= ROT32(b, 16);
    a ^= c; a -= ROT32(c, 4);
    b ^= a; b -= ROT32(a, 14);
    c ^= b; c -= ROT32(b, 24);
    return c;
}

/* lookup3(buffer, start, stop) -> int: the checksum of buffer[start:stop]. */
PyObject *fused_lookup3(PyObject *self, PyObject *args) {
    (void)self;
    Py_buffer view;
    Py_ssize_t start, stop;
    if (!PyArg_ParseTuple(args, "y*nn", &view, &start, &stop)) return NULL;
    if (start < 0 || stop < start || stop > view.len) {
        PyBuffer_Release(&view);
        PyErr_Format(PyExc_ValueError, "lookup3: range %zd:%zd outside a buffer of %zd bytes",
                     start, stop, view.len);
        return NULL;
    }
    uint32_t h = lookup3((const uint8_t *)view.buf + start, (size_t)(stop - start), 0);
    PyBuffer_Release(&view);
    return PyLong_FromUnsignedLong(h);
}
