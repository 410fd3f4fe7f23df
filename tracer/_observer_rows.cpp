// tracer._observer: source lines, and the /records rows handed to the Python writer (see
// _observer.cpp).
#include "_observer.h"

#include <frameobject.h>
#include <torch/csrc/utils/pybind.h>

namespace sleuth_observer {

// flag of a code object (see classify_code), asked once and the code held from then on
int Observer::code_flag(PyObject* code) {
    auto it = code_flags.find(code);
    if (it != code_flags.end()) return it->second;
    const int flag = classify_code(py::handle(code)).cast<int>();
    Py_INCREF(code);
    code_flags.emplace(code, flag);
    return flag;
}

int Observer::source_here(bool cached) {
    PyFrameObject* frame = PyThreadState_GetFrame(PyThreadState_Get());
    if (frame == nullptr) return 0;
#if PY_VERSION_HEX >= 0x030B0000
    // the same frame at the same instruction (every op of one backward pass): the same line.
    // The frame is held while cached, so no other frame can take its address meanwhile.
    PyObject* start = reinterpret_cast<PyObject*>(frame);
    PyCodeObject* start_code = PyFrame_GetCode(frame);
    Py_DECREF(start_code);  // its code_flags entry holds it once a walk has passed it
    const int lasti = PyFrame_GetLasti(frame);
    if (cached && start == last_frame &&
        reinterpret_cast<PyObject*>(start_code) == last_code && lasti == last_lasti) {
        Py_DECREF(frame);
        return last_source;
    }
    if (cached) Py_INCREF(start);
#endif
    int result = 0;
    while (frame != nullptr) {
        PyCodeObject* code = PyFrame_GetCode(frame);
        const int flag = code_flag(reinterpret_cast<PyObject*>(code));
        if (flag == 0) {
            result = source_id(reinterpret_cast<PyObject*>(code), PyFrame_GetLineNumber(frame));
        } else if (flag >= 2) {  // torch rebuilding a received tensor, or torch.compile tracing
            result = -1;
        }
        Py_DECREF(code);
        PyFrameObject* back = flag == 1 ? PyFrame_GetBack(frame) : nullptr;
        Py_DECREF(frame);
        frame = back;
    }
#if PY_VERSION_HEX >= 0x030B0000
    if (cached) {
        forget_frame();
        last_frame = start;
        last_code = reinterpret_cast<PyObject*>(start_code);
        last_lasti = lasti;
        last_source = result;
    }
#endif
    return result;
}

void Observer::forget_frame() {
    PyObject* frame = last_frame;
    last_frame = last_code = nullptr;
    last_lasti = -1;
    Py_XDECREF(frame);  // a finished frame's locals (tensors) go with it
}

int Observer::source_id(PyObject* code, int line) {
    const int c = code_ids.emplace(code, static_cast<int>(code_ids.size())).first->second;
    uint64_t key = (static_cast<uint64_t>(c) << 32) | static_cast<uint32_t>(line);
    auto it = source_ids.find(key);
    if (it != source_ids.end()) return it->second;
    int id = static_cast<int>(sources.size());
    sources.emplace_back(format_source(py::handle(code), line));
    source_ids.emplace(key, id);
    return id;
}

PyObject* Observer::cached_str(const std::string& text) {
    auto it = strings.find(text);
    if (it != strings.end()) {
        Py_INCREF(it->second);
        return it->second;
    }
    PyObject* s =
        PyUnicode_FromStringAndSize(text.data(), static_cast<Py_ssize_t>(text.size()));
    if (s == nullptr) throw py::error_already_set();
    if (strings.size() < 65536) {
        Py_INCREF(s);
        strings.emplace(text, s);
    }
    return s;
}

const std::string& Observer::prefix(int scope_id, int op_id) {
    uint64_t key = (static_cast<uint64_t>(scope_id) << 32) | static_cast<uint32_t>(op_id);
    auto it = prefixes.find(key);
    if (it != prefixes.end()) return it->second;
    std::string text = scope_names.at(scope_id).cast<std::string>();
    if (op_id != module_info.id) text += "::" + op_names.at(op_id).cast<std::string>();
    text += ".";
    return prefixes.emplace(key, std::move(text)).first->second;
}

py::tuple Observer::drain(int64_t seq, py::object place) {
    std::vector<Row> taken;
    std::vector<Chunk> full;
    {
        std::lock_guard<std::mutex> lock(mu);
        taken.swap(rows);
        full.swap(chunks);
        kept_bytes = 0;
        if (!error.empty()) {
            std::string what = "the op observer failed: " + error;
            error.clear();
            throw std::runtime_error(what);
        }
    }
    std::vector<int64_t> bases;
    for (Chunk& chunk : full) {
        at::Tensor used = own([&] { return chunk.data.narrow(0, 0, chunk.used); });
        {
            std::lock_guard<std::mutex> lock(mu);  // until the writer gives it back
            if (lent.size() >= 4 * kSpareChunks) lent.clear();  // a writer that never did
            lent.emplace(chunk.data.storage().unsafeGetStorageImpl(), chunk.data);
        }
        bases.push_back(place(used).cast<int64_t>());
    }
    std::vector<std::pair<int64_t, int64_t>> where(taken.size(), {-1, 0});
    {
        std::lock_guard<std::mutex> lock(mu);
        for (Placement& p : placements) {
            if (p.absolute < 0 && p.chunk < static_cast<int>(bases.size())) {
                p.absolute = bases[p.chunk] + p.offset;
            }
        }
        for (size_t i = 0; i < taken.size(); i++) {
            const Row& r = taken[i];
            if (r.placement >= 0) {
                const Placement& p = placements.at(r.placement);
                where[i] = {p.absolute + r.delta, r.nbytes >= 0 ? r.nbytes : p.nbytes};
            }
        }
    }
    static const char* phases[3] = {"forward", "backward", "optimizer"};
    static const char* directions[5] = {"input", "output", "param", "grad", "update"};
    py::str phase_s[3] = {py::str(phases[0]), py::str(phases[1]), py::str(phases[2])};
    py::str dir_s[5] = {py::str(directions[0]), py::str(directions[1]), py::str(directions[2]),
                        py::str(directions[3]), py::str(directions[4])};
    py::str empty("");
    py::int_ minus_one(-1), zero(0);
    py::list out(taken.size());
    int64_t kept = 0;  // (fields, tensor, stable) items for the Python writer
    std::string name, shape;
    for (size_t i = 0; i < taken.size(); i++) {
        Row& r = taken[i];
        PyObject* module = scope_names.at(scope_modules.at(r.scope)).ptr();
        PyObject* op = op_names.at(r.op).ptr();
        name = prefix(r.scope, r.op);
        name += phases[r.phase];
        name += '.';
        name += std::to_string(r.call);
        name += '.';
        name += directions[r.direction];
        name += '.';
        name += std::to_string(r.index);
        PyObject* pname = PyUnicode_FromStringAndSize(name.data(),
                                                      static_cast<Py_ssize_t>(name.size()));
        if (pname == nullptr) throw py::error_already_set();
        PyObject* source = sources.at(r.source).ptr();
        if (r.code < 0) {
            py::object meta = py::reinterpret_steal<py::object>(PyTuple_Pack(
                8, pname, module, op, phase_s[r.phase].ptr(), dir_s[r.direction].ptr(),
                py::int_(r.index).ptr(), py::int_(r.call).ptr(), source));
            Py_DECREF(pname);
            out[i] = py::make_tuple(meta, r.kept, r.stable);
            kept++;
            continue;
        }
        shape.clear();
        for (size_t k = 0; k < r.shape.size(); k++) {
            if (k) shape += ',';
            shape += std::to_string(r.shape[k]);
        }
        const raw_stats_t& st = r.stats;
        double mn = st.mn, mx = st.mx, mean, norm;
        if (st.nan) {
            mn = mx = mean = norm = NAN;
        } else {
            mean = st.sum / static_cast<double>(r.numel);
            norm = std::sqrt(st.sq);
        }
        const int bits = kCodeBits[r.code];
        uint64_t ck = st.checksum;
        if (bits < 64) ck &= (1ULL << bits) - 1;
        int64_t checksum = static_cast<int64_t>(ck);
        if (bits < 64 && (ck >> (bits - 1))) {
            checksum = static_cast<int64_t>(ck) - (1LL << bits);
        }
        PyObject* row = PyTuple_New(24);
        if (row == nullptr) {
            Py_DECREF(pname);
            throw py::error_already_set();
        }
        auto set = [&](Py_ssize_t k, PyObject* v) { PyTuple_SET_ITEM(row, k, v); };
        auto borrowed = [&](Py_ssize_t k, PyObject* v) {
            Py_INCREF(v);
            PyTuple_SET_ITEM(row, k, v);
        };
        set(0, PyLong_FromLongLong(seq + static_cast<int64_t>(i)));
        set(1, pname);
        borrowed(2, module);
        borrowed(3, op);
        borrowed(4, phase_s[r.phase].ptr());
        borrowed(5, dir_s[r.direction].ptr());
        set(6, PyLong_FromLong(r.index));
        set(7, PyLong_FromLong(r.call));
        set(8, cached_str(dtype_name(r.dtype)));
        set(9, cached_str(shape));
        set(10, PyLong_FromLongLong(r.numel));
        set(11, PyFloat_FromDouble(mn));
        set(12, PyFloat_FromDouble(mx));
        set(13, PyFloat_FromDouble(mean));
        set(14, PyFloat_FromDouble(norm));
        set(15, PyLong_FromUnsignedLongLong(st.nan));
        set(16, PyLong_FromUnsignedLongLong(st.posinf));
        set(17, PyLong_FromUnsignedLongLong(st.neginf));
        set(18, PyLong_FromUnsignedLongLong(st.zeros));
        set(19, PyLong_FromLongLong(checksum));
        borrowed(20, source);
        if (r.placement >= 0) {
            set(21, PyLong_FromLongLong(where[i].first));
            set(22, PyLong_FromLongLong(where[i].second));
            set(23, cached_str(r.strides));
        } else {
            borrowed(21, minus_one.ptr());
            borrowed(22, zero.ptr());
            borrowed(23, empty.ptr());
        }
        // str, int and float items only: it can be in no reference cycle, and the collector
        // need not scan it (the flight recorder keeps the last steps' rows)
        PyObject_GC_UnTrack(row);
        PyList_SET_ITEM(out.ptr(), static_cast<Py_ssize_t>(i), row);  // steals; slot empty
        continue;
    }
    return py::make_tuple(out, kept);
}

}  // namespace sleuth_observer
