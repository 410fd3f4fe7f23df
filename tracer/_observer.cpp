// tracer._observer: the op level's compiled capture ("op_capture": "observer", docs/tracer.md).
//
// A thread-local RecordFunction callback (the hook torch.profiler uses) sees every aten op the
// training thread calls, and the ops of backward formulas on the threads autograd runs them
// on, without Python per op. It records the ops the Python dispatch mode (tracer/_op_mode.py)
// records: the outermost op of each call that is not CompositeImplicitAutograd (those
// decompose before a dispatch mode sees them; their callees are recorded instead), scoped to
// the innermost running module in forward (set by the module hooks, `set_scope`) and, in
// backward, to the module that ran when the forward op made the autograd node now running
// (by sequence number; an AccumulateGrad node's module owns its parameter). Names, call
// counts, source lines, filters and the left-out uninitialised outputs follow the dispatch
// mode. A CPU tensor of a dtype the statistics kernel reads (tracer._fused, through its C API)
// has its statistics taken here, reusing those of the same memory at the same version, and in
// tensor/full mode its bytes copied into chunks (a view of stored bytes points into them);
// every other tensor (CUDA, float64, complex) is kept as a detached copy and handed to the
// Python writer at the next drain. `drain` turns what was kept into /records rows in order.
#include <torch/extension.h>
#include <ATen/record_function.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/impl/TorchDispatchModeTLS.h>
#include <ATen/SequenceNumber.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/accumulate_grad.h>

#include <Python.h>
#include <frameobject.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

extern "C" {
#include "_fused_api.h"
}

namespace py = pybind11;

namespace {

constexpr int kNotWanted = -1;     // scope id: a module the filters leave out
constexpr int kRecomputing = -2;   // scope id: a forward re-run for activation recomputation
constexpr int kMaxFresh = 256;
constexpr int64_t kChunkBytes = 16 << 20;  // tensor bytes are kept in chunks this large
constexpr size_t kRecentSpans = 64;         // stored spans a strided view may point into
const char kEvaluate[] = "autograd::engine::evaluate_function: ";

struct OpInfo {
    int id = 0;              // index into Observer::op_names
    bool op = false;         // an aten op that may be recorded (not a composite, not a marker)
    bool wanted = false;     // the op filters keep it
    bool mutates = false;    // writes an argument (in place, out=, BatchNorm's running stats)
    bool unbumped = false;   // writes arguments without bumping their versions (BatchNorm)
    bool view = false;       // its outputs alias an argument
    std::vector<int> uninitialised;  // output positions holding no values (aten::empty & co)
};

struct Row {
    int scope, op, phase, direction, index, call, source;
    int code;                // the kernel's dtype code, or -1: `kept` goes to the Python writer
    at::ScalarType dtype;
    int64_t numel;
    std::vector<int64_t> shape;
    raw_stats_t stats;
    at::Tensor kept;
    bool stable;
    int placement;           // index into Observer::placements of its stored bytes, or -1
    std::string strides;     // of the stored bytes ("" C-contiguous)
    int64_t delta = 0;       // its first byte's offset into the placement (a view inside it)
    int64_t nbytes = -1;     // its byte range when shorter than the placement's
};

struct Span {                // stored bytes that later views may point into (tensor mode)
    int64_t start, end;      // addresses
    c10::StorageImpl* impl;
    c10::weak_intrusive_ptr<c10::StorageImpl> storage;
    int64_t version;
    int placement;
};

struct Chunk {
    at::Tensor data;         // uint8, handed to the Python writer at the next drain
    int64_t used;
};

struct Placement {
    int chunk;               // index into Observer::chunks until placed
    int64_t offset, nbytes;
    int64_t absolute;        // offset in the step file's /tensors once placed, else -1
};

struct Seen {
    c10::weak_intrusive_ptr<c10::StorageImpl> storage;
    int64_t version;
    raw_stats_t stats;
    int placement;           // its stored bytes (tensor/full mode), or -1
};

struct SpanKey {
    uintptr_t address;
    int64_t numel;
    int code;
    bool operator==(const SpanKey& o) const {
        return address == o.address && numel == o.numel && code == o.code;
    }
};

struct SpanHash {
    size_t operator()(const SpanKey& k) const {
        return std::hash<uintptr_t>()(k.address) ^
               (static_cast<size_t>(k.numel) * 0x9E3779B97F4A7C15ULL) ^ static_cast<size_t>(k.code);
    }
};

struct Context : at::ObserverContext {
    bool evaluate = false;   // an autograd node's evaluate_function: pops the node scope
    OpInfo* info = nullptr;  // a recorded op
    int scope = 0, phase = 0, call = 0, source = 0;
    bool skip_outputs = false;
    std::vector<at::Tensor> written;  // an unbumped op's arguments, forgotten again at its end
};

struct NodeScope {
    int64_t seq;                   // the node's sequence number (-1: AccumulateGrad)
    torch::autograd::Node* node;   // set for AccumulateGrad: its parameter names the scope
    int scope;                     // resolved on first use; INT32_MIN until then
};

struct ThreadState {
    int inside = 0;           // recorded ops running on this thread
    int busy = 0;             // > 0 while the observer itself runs ops (copies)
    std::vector<NodeScope> nodes;  // autograd nodes running on this thread, innermost last
};

thread_local ThreadState tls;

int code_of(at::ScalarType t) {
    switch (t) {
    case at::kFloat: return 0;
    case at::kBFloat16: return 1;
    case at::kHalf: return 2;
    case at::kLong: return 3;
    case at::kInt: return 4;
    case at::kShort: return 5;
    case at::kChar: return 6;
    case at::kByte: return 7;
    case at::kBool: return 7;
    default: return -1;
    }
}

const char* dtype_name(at::ScalarType t) {
    switch (t) {
    case at::kFloat: return "float32";
    case at::kBFloat16: return "bfloat16";
    case at::kHalf: return "float16";
    case at::kLong: return "int64";
    case at::kInt: return "int32";
    case at::kShort: return "int16";
    case at::kChar: return "int8";
    case at::kByte: return "uint8";
    case at::kBool: return "bool";
    default: return "";
    }
}

const int kCodeBits[8] = {32, 16, 16, 64, 32, 16, 8, 8};

class Observer {
public:
    // Python callables: op name ("aten.mm") -> wanted; code object -> 0 user, 1 internal, 2
    // torch rebuilding a received tensor; (code, line) -> "file:line"
    py::object want_op, classify_code, format_source;
    std::vector<py::object> scope_names, op_names, sources;
    bool want_in = true, want_out = true, want_fw = true, want_bw = true, keep_bytes = false;
    int threads = 1;

    // (first sequence number, scope id) of every scope change this step, in order: a backward
    // node's module (see node_scope); the parameters' owning modules; the scope of `<none>`
    std::vector<std::pair<int64_t, int>> seq_scopes;
    std::unordered_map<c10::TensorImpl*, int> param_scopes;
    int none_scope = kNotWanted;

    std::atomic<bool> active{false};
    std::atomic<bool> paused{false};
    std::atomic<int> scope{0};
    std::thread::id owner;
    at::CallbackHandle handle = 0;
    const fused_api_t* kernel = nullptr;

    std::mutex mu;  // rows, counters, reuse table, caches (backward may run on other threads)
    std::vector<Row> rows;
    std::vector<Chunk> chunks;          // tensor bytes since the last drain
    std::vector<Placement> placements;  // this step's stored bytes
    std::vector<Span> recent;           // the newest stored dense spans, oldest first
    int64_t kept_bytes = 0;
    std::unordered_map<std::string, OpInfo> ops;
    std::unordered_map<uint64_t, int> calls;
    std::unordered_map<SpanKey, Seen, SpanHash> seen;
    std::unordered_map<uintptr_t, std::pair<at::Tensor, int64_t>> fresh;
    std::unordered_map<PyObject*, int> code_flags;      // holds a reference to each code
    std::unordered_map<uint64_t, int> source_ids;       // (code, line) -> index into sources
    std::unordered_map<PyObject*, int> code_ids;        // code -> small id for source_ids
    PyObject* last_frame = nullptr;  // the newest source walk's start (a borrowed identity)
    int last_lasti = -1, last_source = 0;
    std::string error;

    ~Observer() { stop(); }

    void stop() {
        if (handle != 0) {
            at::removeCallback(handle);
            handle = 0;
        }
        active = false;
    }

    // -- op table, under the GIL ------------------------------------------------------------
    OpInfo& info_for(const at::RecordFunction& fn) {
        std::string name = fn.name();
        auto it = ops.find(name);
        if (it != ops.end()) return it->second;
        OpInfo info;
        auto opname = fn.operator_name();
        if (opname.has_value() && name.find("::") != std::string::npos) {
            auto handle_opt = c10::Dispatcher::singleton().findOp(*opname);
            bool composite = handle_opt.has_value() &&
                handle_opt->hasKernelForDispatchKey(c10::DispatchKey::CompositeImplicitAutograd);
            info.op = !composite;
            std::string dotted = name;
            dotted.replace(dotted.find("::"), 2, ".");
            info.id = static_cast<int>(op_names.size());
            op_names.emplace_back(py::str(dotted));
            info.wanted = info.op && want_op(op_names.back()).cast<bool>();
            if (handle_opt.has_value() && handle_opt->hasSchema()) {
                const auto& schema = handle_opt->schema();
                for (const auto& a : schema.arguments()) {
                    if (a.alias_info() != nullptr && a.alias_info()->isWrite()) info.mutates = true;
                }
                if (!info.mutates) {
                    for (const auto& r : schema.returns()) {
                        if (r.alias_info() != nullptr) info.view = true;
                    }
                }
            } else {
                info.mutates = info.unbumped = true;  // no schema: assume the worst
            }
            if (dotted.find("batch_norm") != std::string::npos ||
                dotted.find("instance_norm") != std::string::npos) {
                info.mutates = info.unbumped = true;  // running statistics, unmarked
                info.view = false;
            }
            static const char* empties[] = {"aten.empty", "aten.empty_like", "aten.empty_strided",
                                            "aten.new_empty", "aten.new_empty_strided",
                                            "aten.empty_permuted"};
            for (const char* e : empties) {
                if (dotted == e) info.uninitialised = {0};
            }
            if (dotted == "aten.mkldnn_rnn_layer") info.uninitialised = {3};
        }
        return ops.emplace(std::move(name), std::move(info)).first->second;
    }

    // -- source lines and node scopes, under the GIL ------------------------------------------
    // index into `sources` of the innermost user frame's "file:line"; -1 for a tensor torch is
    // rebuilding from another process (not the step's)
    int source_here() {
        PyThreadState* ts = PyThreadState_Get();
        PyFrameObject* frame = PyThreadState_GetFrame(ts);
        if (frame == nullptr) return 0;
#if PY_VERSION_HEX >= 0x030B0000
        int lasti = PyFrame_GetLasti(frame);
        if (reinterpret_cast<PyObject*>(frame) == last_frame && lasti == last_lasti) {
            Py_DECREF(frame);
            return last_source;
        }
        PyObject* start = reinterpret_cast<PyObject*>(frame);
#endif
        int result = 0;
        while (frame != nullptr) {
            PyCodeObject* code = PyFrame_GetCode(frame);
            PyObject* key = reinterpret_cast<PyObject*>(code);
            auto it = code_flags.find(key);
            int flag;
            if (it == code_flags.end()) {
                flag = classify_code(py::handle(key)).cast<int>();
                Py_INCREF(key);
                code_flags.emplace(key, flag);
            } else {
                flag = it->second;
            }
            if (flag == 0) {
                int line = PyFrame_GetLineNumber(frame);
                result = source_id(key, line);
                Py_DECREF(code);
                Py_DECREF(frame);
                frame = nullptr;
                break;
            }
            Py_DECREF(code);
            if (flag == 2) {
                result = -1;
                Py_DECREF(frame);
                frame = nullptr;
                break;
            }
            PyFrameObject* back = PyFrame_GetBack(frame);
            Py_DECREF(frame);
            frame = back;
        }
#if PY_VERSION_HEX >= 0x030B0000
        last_frame = start;  // compared by identity only: a live frame keeps its address
        last_lasti = lasti;
        last_source = result;
#endif
        return result;
    }

    int source_id(PyObject* code, int line) {
        auto cid = code_ids.find(code);
        int c = cid == code_ids.end() ? -1 : cid->second;
        if (c < 0) {
            c = static_cast<int>(code_ids.size());
            code_ids.emplace(code, c);
        }
        uint64_t key = (static_cast<uint64_t>(c) << 32) | static_cast<uint32_t>(line);
        auto it = source_ids.find(key);
        if (it != source_ids.end()) return it->second;
        int id = static_cast<int>(sources.size());
        sources.emplace_back(format_source(py::handle(code), line));
        source_ids.emplace(key, id);
        return id;
    }

    // the scope of the innermost autograd node running on this thread: the module that ran
    // when its forward op made it (the innermost, as `set_scope` said), found by sequence
    // number; an AccumulateGrad node's is the module owning its parameter
    int node_scope() {
        if (tls.nodes.empty()) return none_scope;
        NodeScope& ns = tls.nodes.back();
        if (ns.scope != INT32_MIN) return ns.scope;
        int found = none_scope;
        if (ns.seq >= 0) {
            // the last scope change at or before the node's number
            auto it = std::upper_bound(
                seq_scopes.begin(), seq_scopes.end(), ns.seq,
                [](int64_t v, const std::pair<int64_t, int>& e) { return v < e.first; });
            if (it != seq_scopes.begin()) found = std::prev(it)->second;
        } else if (ns.node != nullptr) {
            auto* acc = static_cast<torch::autograd::AccumulateGrad*>(ns.node);
            auto p = param_scopes.find(acc->variable.unsafeGetTensorImpl());
            if (p != param_scopes.end()) found = p->second;
        }
        ns.scope = found;
        return found;
    }

    // -- records ------------------------------------------------------------------------------
    static bool plain(const at::Tensor& t) {
        return t.defined() && !t.key_set().has(c10::DispatchKey::Python) &&
               !t.key_set().has(c10::DispatchKey::Functionalize);
    }

    // -- tensor bytes (mode tensor/full) ----------------------------------------------------
    // runs `f` as the observer's own work: the ops it calls are not records
    template <typename F>
    static auto own(F&& f) {
        struct Busy {
            Busy() { tls.busy++; }
            ~Busy() { tls.busy--; }
        } busy;
        return f();
    }

    // room for `nbytes` in this drain period's chunks: (placement index, where to write)
    std::pair<int, uint8_t*> allocate(int64_t nbytes) {
        if (chunks.empty() || chunks.back().used + nbytes > chunks.back().data.numel()) {
            const int64_t size = std::max<int64_t>(kChunkBytes, nbytes);
            chunks.push_back(Chunk{own([&] { return at::empty({size}, at::kByte); }), 0});
        }
        Chunk& chunk = chunks.back();
        uint8_t* where = chunk.data.data_ptr<uint8_t>() + chunk.used;
        placements.push_back(
            Placement{static_cast<int>(chunks.size()) - 1, chunk.used, nbytes, -1});
        chunk.used += nbytes;
        kept_bytes += nbytes;
        return {static_cast<int>(placements.size()) - 1, where};
    }

    static std::string strides_of(const at::Tensor& t) {
        if (t.is_contiguous()) return "";
        std::string out;
        for (int64_t k = 0; k < t.dim(); k++) {
            if (k) out += ',';
            out += std::to_string(t.stride(k));
        }
        return out;
    }

    // a strided CPU tensor's bytes from its first element to its last, when they are few
    // enough (an expand, a slice of a little more than itself): -1 otherwise, or when a
    // stride is negative
    static int64_t span_elements(const at::Tensor& t) {
        const int64_t span = span_reach(t);
        return span > 0 && span <= 2 * t.numel() ? span : -1;
    }

    // elements from a strided tensor's first to its last, or -1 for a negative stride
    static int64_t span_reach(const at::Tensor& t) {
        int64_t last = 0;
        for (int64_t k = 0; k < t.dim(); k++) {
            if (t.stride(k) < 0) return -1;
            last += (t.size(k) - 1) * t.stride(k);
        }
        return last + 1;
    }

    // -- records ------------------------------------------------------------------------------
    void record(const at::Tensor& t, const Context& c, int direction, int index, bool stable) {
        Row r{c.scope, c.info->id, c.phase, direction, index, c.call, c.source, -1,
              t.scalar_type(), t.numel(), t.sizes().vec(), raw_stats_t{}, at::Tensor(), stable,
              -1, std::string()};
        const int code = code_of(t.scalar_type());
        const bool cpu = code >= 0 && t.device().is_cpu() && t.layout() == at::kStrided &&
            t.has_storage() && !t.is_conj() && r.numel > 0;
        if (cpu && !t.is_neg() && t.is_non_overlapping_and_dense()) {
            // a dense tensor's elements fill one span from data_ptr: its statistics are those
            // of the span whatever the strides, and a transpose shares its base's bytes
            const void* address = t.const_data_ptr();
            const bool reusable = stable && !t.is_inference();
            SpanKey key{reinterpret_cast<uintptr_t>(address), r.numel, code};
            const int64_t version = reusable ? static_cast<int64_t>(t._version()) : 0;
            if (reusable) {
                auto it = seen.find(key);
                if (it != seen.end() && it->second.version == version &&
                    it->second.storage.lock().get() == t.storage().unsafeGetStorageImpl() &&
                    (!keep_bytes || it->second.placement >= 0)) {
                    r.code = code;
                    r.stats = it->second.stats;
                    r.placement = it->second.placement;
                    if (keep_bytes) r.strides = strides_of(t);
                    rows.push_back(std::move(r));
                    return;
                }
            }
            int status;
            const int64_t nbytes = r.numel * static_cast<int64_t>(t.element_size());
            if (keep_bytes) {
                const int64_t first = reinterpret_cast<int64_t>(address);
                auto [inside, delta] = within(t, first, first + nbytes);
                r.strides = strides_of(t);
                if (inside >= 0) {  // a view of bytes stored already: statistics only
                    status = kernel->stats(address, r.numel, code, threads, &r.stats);
                    r.placement = inside;
                    r.delta = delta;
                    r.nbytes = nbytes;
                } else {
                    auto [placement, where] = allocate(nbytes);
                    status = kernel->copy_stats(where, address, r.numel, code, threads, &r.stats);
                    r.placement = placement;
                    if (status == 0) remember_span(t, nbytes, placement);
                }
            } else {
                status = kernel->stats(address, r.numel, code, threads, &r.stats);
            }
            if (status == 0) {
                r.code = code;
                if (reusable) {
                    seen.erase(key);
                    seen.emplace(key, Seen{t.storage().getWeakStorageImpl(), version, r.stats,
                                           r.placement});
                }
                rows.push_back(std::move(r));
                return;
            }
        }
        if (cpu) {
            // strided with gaps, overlapping (an expand) or negated: the statistics of a C-order
            // copy; its bytes, the span it reads with its strides when that is short, else the
            // copy
            at::Tensor flat = own([&] { return t.is_neg() ? t.resolve_neg().contiguous()
                                                         : t.contiguous(); });
            const int64_t span = keep_bytes && !t.is_neg() ? span_elements(t) : -1;
            const int64_t width = static_cast<int64_t>(t.element_size());
            int status;
            if (!keep_bytes) {
                status = kernel->stats(flat.const_data_ptr(), r.numel, code, threads, &r.stats);
            } else if (const int64_t first = reinterpret_cast<int64_t>(t.const_data_ptr()),
                       reach = span_reach(t);
                       reach > 0 && within(t, first, first + reach * width).first >= 0) {
                // its elements lie inside bytes stored already (a split, a slice): no copy
                auto [inside, delta] = within(t, first, first + reach * width);
                r.placement = inside;
                r.delta = delta;
                r.nbytes = reach * width;
                r.strides = strides_of(t);
                status = kernel->stats(flat.const_data_ptr(), r.numel, code, threads, &r.stats);
            } else if (span > 0) {
                auto [placement, where] = allocate(span * width);
                std::memcpy(where, t.const_data_ptr(), static_cast<size_t>(span * width));
                r.placement = placement;
                r.strides = strides_of(t);
                status = kernel->stats(flat.const_data_ptr(), r.numel, code, threads, &r.stats);
            } else {
                auto [placement, where] = allocate(r.numel * width);
                r.placement = placement;
                status = kernel->copy_stats(where, flat.const_data_ptr(), r.numel, code, threads,
                                            &r.stats);
            }
            if (status == 0) {
                r.code = code;
                rows.push_back(std::move(r));
                return;
            }
        }
        // the Python writer takes it at the next drain, from a copy made now (the op's next
        // callers may write the tensor in place)
        r.kept = own([&] { return t.device().is_meta() ? t.detach() : t.detach().clone(); });
        kept_bytes += static_cast<int64_t>(t.numel()) * static_cast<int64_t>(t.element_size());
        rows.push_back(std::move(r));
    }

    bool is_fresh(const at::Tensor& t) {
        if (fresh.empty() || !t.defined() || t.layout() != at::kStrided || t.is_inference() ||
            !t.has_storage()) {
            return false;
        }
        auto it = fresh.find(reinterpret_cast<uintptr_t>(t.const_data_ptr()));
        return it != fresh.end() && static_cast<int64_t>(t._version()) == it->second.second;
    }

    void remember_fresh(const at::Tensor& t) {
        if (!t.defined() || t.layout() != at::kStrided || t.is_inference() || !t.has_storage()) {
            return;
        }
        if (fresh.size() >= kMaxFresh) fresh.clear();
        fresh[reinterpret_cast<uintptr_t>(t.const_data_ptr())] = {t, t._version()};
    }

    void forget(const at::Tensor& t) {
        if (!t.defined() || !t.has_storage() || t.layout() != at::kStrided) return;
        const int code = code_of(t.scalar_type());
        seen.erase(SpanKey{reinterpret_cast<uintptr_t>(t.const_data_ptr()), t.numel(), code});
        c10::StorageImpl* impl = t.storage().unsafeGetStorageImpl();
        for (auto& span : recent) {
            if (span.impl == impl) span.placement = -1;
        }
    }

    // the newest stored span holding every element of `t` (same memory, same version): its
    // placement and `t`'s byte offset into it, or {-1, 0}
    std::pair<int, int64_t> within(const at::Tensor& t, int64_t first, int64_t end) {
        c10::StorageImpl* impl = t.storage().unsafeGetStorageImpl();
        const int64_t version = t.is_inference() ? -1 : static_cast<int64_t>(t._version());
        for (auto it = recent.rbegin(); it != recent.rend(); ++it) {
            if (it->placement >= 0 && it->impl == impl && it->version == version &&
                it->start <= first && end <= it->end && it->storage.lock().get() == impl) {
                return {it->placement, first - it->start};
            }
        }
        return {-1, 0};
    }

    void remember_span(const at::Tensor& t, int64_t nbytes, int placement) {
        if (t.is_inference()) return;
        const int64_t start = reinterpret_cast<int64_t>(t.const_data_ptr());
        if (recent.size() >= kRecentSpans) recent.erase(recent.begin());
        recent.push_back(Span{start, start + nbytes, t.storage().unsafeGetStorageImpl(),
                              t.storage().getWeakStorageImpl(),
                              static_cast<int64_t>(t._version()), placement});
    }

    template <typename F>
    static void each_tensor(c10::ArrayRef<const c10::IValue> values, F&& f) {
        for (const auto& v : values) {
            // an undefined tensor is None in Python, a wrapped number a Python number: neither
            // is a record, nor counted
            if (v.isTensor()) {
                const at::Tensor& t = v.toTensor();
                if (t.defined() && !t.unsafeGetTensorImpl()->is_wrapped_number()) f(t);
            } else if (v.isTensorList()) {
                for (const at::Tensor& t : v.toTensorList()) {
                    if (t.defined()) f(t);
                }
            } else if (v.isList()) {
                for (const c10::IValue& item : v.toListRef()) {
                    if (item.isTensor() && item.toTensor().defined()) f(item.toTensor());
                }
            }
        }
    }

    std::unique_ptr<at::ObserverContext> on_start(const at::RecordFunction& fn) {
        if (!active.load(std::memory_order_relaxed) || tls.busy) return nullptr;
        if (fn.scope() == at::RecordScope::BACKWARD_FUNCTION) return nullptr;
        const char* name = fn.name();
        if (std::strncmp(name, kEvaluate, sizeof(kEvaluate) - 1) == 0) {
            // the engine sets the node it evaluates before this record starts
            auto current = torch::autograd::get_current_node();
            int64_t seq = -1;
            torch::autograd::Node* node = nullptr;
            if (current) {
                const uint64_t nr = current->sequence_nr();
                if (nr != UINT64_MAX) {
                    seq = static_cast<int64_t>(nr);
                } else if (current->name() == "torch::autograd::AccumulateGrad") {
                    node = current.get();  // kept alive by the graph task while it runs
                }
            }
            tls.nodes.push_back(NodeScope{seq, node, INT32_MIN});
            auto ctx = std::make_unique<Context>();
            ctx->evaluate = true;
            return ctx;
        }
        const bool backward = !tls.nodes.empty();
        if (paused.load(std::memory_order_relaxed)) return nullptr;
        if (tls.inside > 0) return nullptr;  // an op a recorded op calls is not a record
        if (!backward && std::this_thread::get_id() != owner) return nullptr;
        if (backward ? (!want_bw || at::GradMode::is_enabled()) : !want_fw) return nullptr;
        if (c10::impl::TorchDispatchModeTLS::stack_len() > 0) return nullptr;
        bool python_tensor = false;
        each_tensor(fn.inputs(), [&](const at::Tensor& t) {
            if (t.defined() && !plain(t)) python_tensor = true;
        });
        if (python_tensor) return nullptr;  // FakeTensor tracing (torch.export) and subclasses
        // the GIL only where Python objects are read (a new op, the source line), and never
        // taken while holding the lock (drain holds the GIL, then takes the lock)
        OpInfo* found = nullptr;
        {
            std::lock_guard<std::mutex> lock(mu);
            auto it = ops.find(name);
            if (it != ops.end()) found = &it->second;
        }
        if (found == nullptr) {
            py::gil_scoped_acquire gil;
            std::lock_guard<std::mutex> lock(mu);
            found = &info_for(fn);  // nodes of an unordered_map keep their address
        }
        OpInfo& info = *found;
        if (!info.op) return nullptr;  // composite: its callees are the records
        if (info.unbumped) {
            // it writes arguments without bumping their version (BatchNorm's running
            // statistics): forget what is known of every argument (again when it returns)
            std::lock_guard<std::mutex> lock(mu);
            each_tensor(fn.inputs(), [&](const at::Tensor& t) { forget(t); });
        }
        if (!info.wanted) return nullptr;
        int s;
        if (backward) {
            std::lock_guard<std::mutex> lock(mu);
            s = node_scope();
        } else {
            s = scope.load(std::memory_order_relaxed);
        }
        if (s < 0) return nullptr;  // filtered out, or recomputing
        int source;
        {
            py::gil_scoped_acquire gil;
            source = source_here();
        }
        if (source < 0) return nullptr;  // torch rebuilding a tensor another process sent
        std::lock_guard<std::mutex> lock(mu);
        auto ctx = std::make_unique<Context>();
        ctx->info = &info;
        ctx->scope = s;
        ctx->phase = backward ? 1 : 0;
        ctx->source = source;
        uint64_t key = (static_cast<uint64_t>(s) << 34) | (static_cast<uint64_t>(info.id) << 2) |
                       static_cast<uint64_t>(ctx->phase);
        ctx->call = calls[key]++;
        // an in-place op's arguments carry their version from before it here, its outputs the
        // bumped one: both may take part in reuse, unless it writes without bumping
        const bool stable = !info.unbumped;
        if (info.unbumped) {  // inputs() is valid here only: keep what to forget at the end
            each_tensor(fn.inputs(), [&](const at::Tensor& t) { ctx->written.push_back(t); });
        }
        bool any_fresh = false;
        int index = 0;
        each_tensor(fn.inputs(), [&](const at::Tensor& t) {
            if (is_fresh(t)) {
                // uninitialised memory (what aten::empty made): not a record; its first record
                // is the output of the op that writes it
                any_fresh = true;
                if (info.mutates) fresh.erase(reinterpret_cast<uintptr_t>(t.const_data_ptr()));
            } else if (want_in && t.defined()) {
                record(t, *ctx, 0, index, stable);
            }
            index++;
        });
        ctx->skip_outputs = any_fresh && info.view;  // a view of uninitialised memory
        tls.inside++;
        return ctx;
    }

    void on_end(const at::RecordFunction& fn, at::ObserverContext* base) {
        if (base == nullptr) return;
        auto* ctx = static_cast<Context*>(base);
        if (ctx->evaluate) {
            if (!tls.nodes.empty()) tls.nodes.pop_back();
            return;
        }
        tls.inside--;
        std::lock_guard<std::mutex> lock(mu);  // no Python object is touched here: no GIL
        record_outputs(fn, *ctx);
    }

    void record_outputs(const at::RecordFunction& fn, const Context& c) {
        Context const* ctx = &c;
        if (!active.load(std::memory_order_relaxed)) return;
        const OpInfo& info = *ctx->info;
        if ((!want_out && info.uninitialised.empty()) || ctx->skip_outputs) return;
        const auto& outs = fn.outputs();
        int index = 0;
        size_t next_left_out = 0;
        each_tensor(c10::ArrayRef<const c10::IValue>(outs.data(), outs.size()),
                    [&](const at::Tensor& t) {
            if (next_left_out < info.uninitialised.size() &&
                info.uninitialised[next_left_out] == index) {
                next_left_out++;
                remember_fresh(t);
            } else if (want_out && t.defined()) {
                record(t, *ctx, 1, index, !info.unbumped);
            }
            index++;
        });
        for (const at::Tensor& t : ctx->written) forget(t);
    }

    // a failure inside a callback: recording stops, and the next drain raises it (an
    // exception must not escape into the op that torch is running)
    void fail(const char* what) {
        active = false;
        std::lock_guard<std::mutex> lock(mu);
        if (error.empty()) error = what;
        tls.inside = 0;
    }

    // -- Python side ----------------------------------------------------------------------
    void start() {
        if (handle != 0) return;
        owner = std::this_thread::get_id();
        active = true;
        handle = at::addThreadLocalCallback(
            at::RecordFunctionCallback(
                [](const at::RecordFunction& fn) -> std::unique_ptr<at::ObserverContext> {
                    Observer* o = instance();
                    try {
                        return o->on_start(fn);
                    } catch (const std::exception& e) {
                        o->fail(e.what());
                        return nullptr;
                    }
                },
                [](const at::RecordFunction& fn, at::ObserverContext* ctx) {
                    Observer* o = instance();
                    try {
                        o->on_end(fn, ctx);
                    } catch (const std::exception& e) {
                        o->fail(e.what());
                    }
                })
                .needsInputs(true)
                .needsOutputs(true)
                .needsIds(false)
                .scopes({at::RecordScope::FUNCTION, at::RecordScope::BACKWARD_FUNCTION}));
    }

    void reset_step() {
        std::lock_guard<std::mutex> lock(mu);
        calls.clear();
        seen.clear();
        fresh.clear();
        seq_scopes.clear();
        placements.clear();
        chunks.clear();
        recent.clear();
        last_frame = nullptr;
        last_lasti = -1;
    }

    // "{module}::{op}." of a scope and op, and Python strings reused from row to row
    std::unordered_map<uint64_t, std::string> prefixes;
    std::unordered_map<std::string, PyObject*> strings;  // shapes and dtypes, owned

    PyObject* cached_str(const std::string& text) {
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

    const std::string& prefix(int scope_id, int op_id) {
        uint64_t key = (static_cast<uint64_t>(scope_id) << 32) | static_cast<uint32_t>(op_id);
        auto it = prefixes.find(key);
        if (it != prefixes.end()) return it->second;
        std::string text = scope_names.at(scope_id).cast<std::string>() + "::" +
                           op_names.at(op_id).cast<std::string>() + ".";
        return prefixes.emplace(key, std::move(text)).first->second;
    }

    // the rows kept so far, in record order, numbered from `seq`: a /records row (a tuple in
    // RECORD_FIELDS order) where the statistics were taken here, else (RecordMeta fields,
    // tensor, stable) for the Python writer
    //
    // Tensor bytes (mode tensor/full) go first: `place` gets each chunk of them (a uint8
    // tensor) in order and answers the offset in /tensors where the writer put it.
    py::list drain(int64_t seq, py::object place) {
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
            at::Tensor used = chunk.data.narrow(0, 0, chunk.used);
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
        static const char* phases[2] = {"forward", "backward"};
        static const char* directions[2] = {"input", "output"};
        py::str phase_s[2] = {py::str(phases[0]), py::str(phases[1])};
        py::str dir_s[2] = {py::str(directions[0]), py::str(directions[1])};
        py::str empty("");
        py::int_ minus_one(-1), zero(0);
        py::list out(taken.size());
        std::string name, shape;
        for (size_t i = 0; i < taken.size(); i++) {
            Row& r = taken[i];
            PyObject* module = scope_names.at(r.scope).ptr();
            PyObject* op = op_names.at(r.op).ptr();
            name = prefix(r.scope, r.op);
            name += phases[r.phase];
            name += '.';
            name += std::to_string(r.call);
            name += r.direction ? ".output." : ".input.";
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
            PyList_SET_ITEM(out.ptr(), static_cast<Py_ssize_t>(i), row);  // steals; slot empty
            continue;
        }
        return out;
    }

    // (offset in /tensors, bytes) of a stored record of this dense CPU tensor's memory at its
    // current version, once drained; None otherwise
    py::object stored(const at::Tensor& t) {
        const int code = code_of(t.scalar_type());
        if (code < 0 || !t.device().is_cpu() || t.layout() != at::kStrided || !t.has_storage() ||
            t.numel() == 0 || t.is_inference() || !t.is_non_overlapping_and_dense()) {
            return py::none();
        }
        std::lock_guard<std::mutex> lock(mu);
        auto it = seen.find(SpanKey{reinterpret_cast<uintptr_t>(t.const_data_ptr()), t.numel(),
                                    code});
        if (it == seen.end() || it->second.placement < 0 ||
            it->second.version != static_cast<int64_t>(t._version()) ||
            it->second.storage.lock().get() != t.storage().unsafeGetStorageImpl()) {
            return py::none();
        }
        const Placement& p = placements.at(it->second.placement);
        if (p.absolute < 0) return py::none();
        return py::make_tuple(p.absolute, p.nbytes);
    }

    static Observer* instance() {
        static Observer* one = new Observer();  // never freed: callbacks may outlive a module
        return one;
    }
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.doc() = "the op level's compiled capture (tracer/_observer.cpp)";
    m.def("configure", [](py::object want_op, py::object classify_code, py::object format_source,
                          bool want_in, bool want_out, bool want_fw,
                          bool want_bw, bool keep_bytes, int threads, py::capsule kernel) {
        Observer* o = Observer::instance();
        if (o->handle != 0) throw std::runtime_error("the op observer is running");
        auto* api = static_cast<const fused_api_t*>(
            PyCapsule_GetPointer(kernel.ptr(), FUSED_API_CAPSULE));
        if (api == nullptr) throw py::error_already_set();
        if (api->version != FUSED_API_VERSION) {
            throw std::runtime_error("tracer._fused and tracer._observer were built from "
                                     "different sources: rebuild both (setup.py build_ext)");
        }
        o->kernel = api;
        o->want_op = std::move(want_op);
        o->classify_code = std::move(classify_code);
        o->format_source = std::move(format_source);
        o->want_in = want_in;
        o->want_out = want_out;
        o->want_fw = want_fw;
        o->want_bw = want_bw;
        o->keep_bytes = keep_bytes;
        o->threads = threads;
        for (auto& kv : o->code_flags) Py_DECREF(kv.first);
        o->code_flags.clear();
        o->ops.clear();
        o->prefixes.clear();
        o->op_names.clear();
        o->scope_names.clear();
        o->sources.assign(1, py::str(""));
        o->source_ids.clear();
        o->code_ids.clear();
        o->rows.clear();
    });
    m.def("add_scope", [](py::str name) {
        Observer* o = Observer::instance();
        o->scope_names.emplace_back(std::move(name));
        return static_cast<int>(o->scope_names.size()) - 1;
    }, "register a module name; returns its scope id");
    m.def("set_scope", [](int id, bool recomputing) {
        Observer* o = Observer::instance();
        o->scope.store(recomputing ? kRecomputing : id, std::memory_order_relaxed);
        const int64_t seq = static_cast<int64_t>(at::sequence_number::peek());
        auto& changes = o->seq_scopes;
        if (changes.empty() || changes.back().second != id) {
            if (!changes.empty() && changes.back().first == seq) {
                changes.back().second = id;  // no autograd node was made in between
            } else {
                changes.emplace_back(seq, id);
            }
        }
        return o->kept_bytes;
    }, "the module forward ops run in from now on (id -1: filtered out), recomputing or not; "
       "returns the bytes of tensors kept for the Python writer");
    m.def("set_params", [](const std::vector<std::pair<at::Tensor, int>>& params, int none) {
        Observer* o = Observer::instance();
        o->param_scopes.clear();
        for (const auto& p : params) {
            o->param_scopes.emplace(p.first.unsafeGetTensorImpl(), p.second);
        }
        o->none_scope = none;
    }, "the scope ids of the parameters' owning modules (their AccumulateGrad nodes) and of "
       "<none>");
    m.def("start", []() { Observer::instance()->start(); },
          "observe this thread's ops (and backward's on autograd's threads)");
    m.def("stop", []() { Observer::instance()->stop(); });
    m.def("pause", [](bool on) { Observer::instance()->paused.store(on); });
    m.def("reset_step", []() { Observer::instance()->reset_step(); });
    m.def("pending", []() {
        Observer* o = Observer::instance();
        std::lock_guard<std::mutex> lock(o->mu);
        return static_cast<int64_t>(o->rows.size()) + (o->error.empty() ? 0 : 1);
    }, "rows kept (plus one for a failure to report)");
    m.def("stored", [](const at::Tensor& t) { return Observer::instance()->stored(t); },
          "(offset, nbytes) in /tensors of a drained record of this tensor's memory, or None");
    m.def("drain", [](int64_t seq, py::object place) {
        return Observer::instance()->drain(seq, std::move(place));
    }, "the kept records as rows numbered from seq (tensor bytes first, through place)");
}
