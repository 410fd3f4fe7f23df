// An experiment, not part of the tracer: op-level statistics taken from torch's C++
// RecordFunction callbacks (the hook torch.profiler uses) instead of a Python dispatch mode,
// to measure what an op capture in compiled code would cost (benchmarks/op_observer.py).
//
// It keeps a row per tensor argument and result of each outermost op on the calling thread
// (ops a kernel calls from inside another op are not seen, like the dispatch mode does not
// see them), with min, max, sum, sum of squares, NaN and zero counts of float32 tensors, and
// reuses the statistics of a tensor seen before at the same address, size and version (an
// op's output is the next op's input). What it lacks against the tracer: record names (module
// scope, call counts), source lines, filters, other dtypes, the step file.
#include <torch/extension.h>
#include <ATen/record_function.h>

#include <cmath>
#include <cstdint>
#include <unordered_map>
#include <vector>

namespace {

struct Row {
    const char* op;
    int direction;  // 0 argument, 1 result
    int index;
    int64_t numel;
    float min, max;
    double sum, sumsq;
    int64_t nan, zeros;
};

struct Key {
    uintptr_t address;
    int64_t numel;
    int64_t version;
    bool operator==(const Key& o) const {
        return address == o.address && numel == o.numel && version == o.version;
    }
};

struct KeyHash {
    size_t operator()(const Key& k) const {
        return std::hash<uintptr_t>()(k.address) ^ (static_cast<size_t>(k.numel) * 0x9E3779B1u) ^
               (static_cast<size_t>(k.version) << 7);
    }
};

std::vector<Row> rows;
std::unordered_map<Key, size_t, KeyHash> seen;  // -> index of the row that has the statistics
at::CallbackHandle handle = 0;
bool with_statistics = true;
thread_local int depth = 0;

void measure(const at::Tensor& t, Row& r) {
    r.numel = t.defined() ? t.numel() : 0;
    r.min = INFINITY;
    r.max = -INFINITY;
    r.sum = r.sumsq = 0;
    r.nan = r.zeros = 0;
    if (!with_statistics || !t.defined() || !t.is_cpu() || t.layout() != at::kStrided ||
        t.scalar_type() != at::kFloat || !t.is_contiguous() || r.numel == 0) {
        return;
    }
    if (!t.is_inference()) {
        Key key{reinterpret_cast<uintptr_t>(t.const_data_ptr()), r.numel,
                static_cast<int64_t>(t._version())};
        auto hit = seen.find(key);
        if (hit != seen.end()) {
            const Row& first = rows[hit->second];
            r.min = first.min;
            r.max = first.max;
            r.sum = first.sum;
            r.sumsq = first.sumsq;
            r.nan = first.nan;
            r.zeros = first.zeros;
            return;
        }
        seen.emplace(key, rows.size());
    }
    const float* p = t.const_data_ptr<float>();
    float lo = INFINITY, hi = -INFINITY;
    double sum = 0, sumsq = 0;
    int64_t nan = 0, zeros = 0;
    constexpr int64_t kBlock = 4096;  // float sums over short runs, then double
    for (int64_t b = 0; b < r.numel; b += kBlock) {
        const int64_t e = std::min(r.numel, b + kBlock);
        float s = 0, q = 0;
        for (int64_t i = b; i < e; i++) {
            const float v = p[i];
            nan += v != v;
            zeros += v == 0.0f;
            lo = v < lo ? v : lo;
            hi = v > hi ? v : hi;
            s += v;
            q += v * v;
        }
        sum += s;
        sumsq += q;
    }
    r.min = lo;
    r.max = hi;
    r.sum = sum;
    r.sumsq = sumsq;
    r.nan = nan;
    r.zeros = zeros;
}

void keep(const at::RecordFunction& fn, c10::ArrayRef<const c10::IValue> values, int direction) {
    int index = 0;
    auto add = [&](const at::Tensor& t) {
        Row r{fn.name(), direction, index++};
        measure(t, r);
        rows.push_back(r);
    };
    for (const auto& v : values) {
        if (v.isTensor()) {
            add(v.toTensor());
        } else if (v.isTensorList()) {
            for (const at::Tensor& t : v.toTensorList()) {
                add(t);
            }
        }
    }
}

}  // namespace

void start(bool statistics) {
    if (handle != 0) {
        throw std::runtime_error("op_observer: already started");
    }
    with_statistics = statistics;
    rows.reserve(1 << 16);
    handle = at::addGlobalCallback(
        at::RecordFunctionCallback(
            [](const at::RecordFunction& fn) -> std::unique_ptr<at::ObserverContext> {
                if (depth++ == 0) {
                    keep(fn, fn.inputs(), 0);
                }
                return nullptr;
            },
            [](const at::RecordFunction& fn, at::ObserverContext*) {
                if (--depth == 0) {
                    const auto& out = fn.outputs();
                    keep(fn, c10::ArrayRef<const c10::IValue>(out.data(), out.size()), 1);
                }
            })
            .needsInputs(true)
            .needsOutputs(true)
            .scopes({at::RecordScope::FUNCTION, at::RecordScope::BACKWARD_FUNCTION}));
}

int64_t stop() {
    if (handle != 0) {
        at::removeCallback(handle);
        handle = 0;
    }
    const int64_t n = static_cast<int64_t>(rows.size());
    rows.clear();
    seen.clear();
    return n;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.def("start", &start, "observe every outermost op; statistics of float32 tensors if asked");
    m.def("stop", &stop, "stop observing; returns the number of rows kept, and drops them");
}
