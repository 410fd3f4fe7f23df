// tracer._observer's types and its one Observer: what tracer/_observer.cpp (the callbacks and
// the Python module), _observer_store.cpp (statistics, tensor bytes, reuse) and
// _observer_rows.cpp (source lines, the rows handed to Python) share. See _observer.cpp.
#pragma once
#include <Python.h>
#include <ATen/core/Tensor.h>
#include <ATen/record_function.h>
#include <c10/core/StorageImpl.h>
#include <pybind11/pybind11.h>
#include <torch/csrc/autograd/function.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <mutex>
#include <optional>
#include <tuple>
#include <string>
#include <thread>
#include <unordered_map>
#include <unordered_set>
#include <vector>

extern "C" {
#include "_fused_api.h"
}

namespace py = pybind11;

namespace sleuth_observer {

constexpr int kNotWanted = -1;     // scope id: a module the filters leave out
constexpr int kRecomputing = -2;   // scope id: a forward re-run for activation recomputation
constexpr int kMaxFresh = 256;
constexpr int64_t kChunkBytes = 16 << 20;  // tensor bytes are kept in chunks this large
constexpr size_t kRecentSpans = 64;         // stored spans a strided view may point into
constexpr size_t kSpareChunks = 16;         // written chunks kept for reuse (256 MiB)
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

struct GradKey {             // a module call's gradient record: recorded once per step
    int scope, direction, index, call;
    bool operator==(const GradKey& o) const {
        return scope == o.scope && direction == o.direction && index == o.index &&
               call == o.call;
    }
};

struct GradKeyHash {
    size_t operator()(const GradKey& k) const {
        return (static_cast<size_t>(k.scope) * 0x9E3779B97F4A7C15ULL) ^
               (static_cast<size_t>(k.call) << 20) ^ (static_cast<size_t>(k.index) << 2) ^
               static_cast<size_t>(k.direction);
    }
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

inline thread_local ThreadState tls;

inline int code_of(at::ScalarType t) {
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

inline const char* dtype_name(at::ScalarType t) {
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
const int kCodeLastFloat = 2;  // codes 0-2: float32, bfloat16, float16

class Observer {
public:
    // Python callables: op name ("aten.mm") -> wanted; code object -> 0 user, 1 internal, 2
    // torch rebuilding a received tensor, 3 torch.compile tracing; (code, line) -> "file:line"
    py::object want_op, classify_code, format_source;
    std::vector<py::object> scope_names, op_names, sources;
    // the scope id whose name fills a row's module column: its own, or a parameter's owner
    std::vector<int> scope_modules;
    bool want_in = true, want_out = true, want_fw = true, want_bw = true, keep_bytes = false;
    int threads = 1;

    // (first sequence number, scope id) of every scope change this step, in order: a backward
    // node's module (see node_scope); the parameters' owning modules; the scope of `<none>`
    std::vector<std::pair<int64_t, int>> seq_scopes;
    std::unordered_map<c10::TensorImpl*, int> param_scopes;
    int none_scope = kNotWanted;

    std::atomic<bool> active{false};
    // the module hooks' gradient hooks record while this is set (a dumped step runs), and
    // only those registered since the last `configure` (an older Dumper's scope ids differ)
    std::atomic<bool> capturing{false};
    std::atomic<int64_t> generation{0};
    std::unordered_set<GradKey, GradKeyHash> grads_seen;  // this step's, under mu
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
    // chunks handed to the writer, by storage, until it has written them (`give_back`), and
    // written ones kept for reuse
    std::unordered_map<c10::StorageImpl*, at::Tensor> lent;
    std::vector<at::Tensor> spare;
    int64_t kept_bytes = 0;
    std::unordered_map<std::string, OpInfo> ops;
    std::unordered_map<uint64_t, int> calls;
    std::unordered_map<SpanKey, Seen, SpanHash> seen;
    std::unordered_map<uintptr_t, std::pair<at::Tensor, int64_t>> fresh;
    std::unordered_map<PyObject*, int> code_flags;      // holds a reference to each code
    std::unordered_map<uint64_t, int> source_ids;       // (code, line) -> index into sources
    std::unordered_map<PyObject*, int> code_ids;        // code -> small id for source_ids
    // the newest cached source walk's start frame (held) and code (held in code_flags), its
    // instruction and its result
    PyObject* last_frame = nullptr;
    PyObject* last_code = nullptr;
    int last_lasti = -1, last_source = 0;
    std::string error;

    // the op of module records ("", see record_module), and the source strings they came
    // with, each held, by identity: index into `sources`
    OpInfo module_info;
    std::unordered_map<PyObject*, int> source_objs;

    // "{module}::{op}." of a scope and op ("{module}." for a module record), and Python
    // strings reused from row to row
    std::unordered_map<uint64_t, std::string> prefixes;
    std::unordered_map<std::string, PyObject*> strings;  // shapes and dtypes, owned

    ~Observer() { stop(); }

    // -- the callbacks (_observer.cpp) --------------------------------------------------------
    void start();  // observe this thread's ops (and backward's on autograd's threads)
    void stop();
    void reset_step();
    std::unique_ptr<at::ObserverContext> on_start(const at::RecordFunction& fn);
    void on_end(const at::RecordFunction& fn, at::ObserverContext* base);
    void record_outputs(const at::RecordFunction& fn, const Context& c);
    // a failure inside a callback: recording stops, and the next drain raises it (an
    // exception must not escape into the op that torch is running)
    void fail(const char* what);
    // the op table entry of an op, made on first sight (under the GIL and the lock)
    OpInfo& info_for(const at::RecordFunction& fn);
    // the scope of the innermost autograd node running on this thread: the module that ran
    // when its forward op made it (the innermost, as `set_scope` said), found by sequence
    // number; an AccumulateGrad node's is the module owning its parameter
    int node_scope();

    // -- what a record keeps (_observer_store.cpp) --------------------------------------------
    void record(const at::Tensor& t, const Context& c, int direction, int index, bool stable);
    // a module call's forward inputs or outputs, or a gradient, recorded by the module hooks
    // (tracer._module_hooks): kept like an op's, under the name "{module}.{phase}.{call}.
    // {direction}.{first + i}" with `source` (a str, held) as its source line. Under the GIL.
    void record_module(int scope_id, int phase, int direction, int call, PyObject* source,
                       const std::vector<at::Tensor>& tensors, int first);

    // -- the module hooks' records in one call (_observer_hooks.cpp) ---------------------------
    // a module call's forward inputs or outputs (`forward`: recorded now, with the innermost
    // user frame's source line) and, with `hook`, a gradient hook on each that requires grad,
    // which records its gradient once per step in C++. False, with nothing done, where the
    // Python hooks must take them: a tensor subclass, or no source line of the step's own
    // (torch rebuilding a received tensor, torch.compile tracing). Under the GIL.
    bool record_call(int scope_id, int direction, int call,
                     const std::vector<at::Tensor>& tensors, bool forward, bool hook);
    // a gradient hook's call (autograd's thread, GIL not held)
    void on_grad(const GradKey& key, int64_t gen, const at::Tensor& grad);
    // the context of a module record: op "", scope, phase (0 forward, 1 backward, 2
    // optimizer), call, source; an unknown scope id raises, naming `who`
    Context module_context(int scope_id, int phase, int call, int source,
                           const char* who) const;
    // `record` of each defined tensor, indexed from `first` (under mu)
    void record_all(const std::vector<at::Tensor>& tensors, const Context& c, int direction,
                    int first);
    // a row of statistics taken already (no bytes): the param records of pre-step copies,
    // float32 updates
    void stats_row(const Context& c, int direction, const at::Tensor& like,
                   const raw_stats_t& stats);

    // -- the parameter records (_observer_params.cpp), under the GIL ---------------------------
    // copy each parameter into its buffer before the optimizer step, taking the copy's
    // statistics on the way (kept for the param record of the buffer); false, with nothing
    // copied, unless every pair is a dense CPU tensor of a kernel dtype and its buffer
    bool snapshot(const std::vector<at::Tensor>& buffers, const std::vector<at::Tensor>& params);
    // the param, grad and update records of each (scope, parameter, gradient, pre-step copy)
    // in that order, optimizer call `call`; the update is parameter - copy
    void record_params(int call, PyObject* source,
                       const std::vector<std::tuple<int, at::Tensor, std::optional<at::Tensor>,
                                                    std::optional<at::Tensor>>>& entries);
    // the statistics `snapshot` took, by buffer, with the buffer's version after the copy
    std::unordered_map<c10::TensorImpl*, std::pair<int64_t, raw_stats_t>> snapshots;
    int source_of(PyObject* source);  // index into `sources` of a str, held
    // room for `nbytes` in this drain period's chunks: (placement index, where to write)
    std::pair<int, uint8_t*> allocate(int64_t nbytes);
    // the writer has written a chunk `drain` handed it (a view of it): its memory may be reused
    void give_back(const at::Tensor& view);
    static std::string strides_of(const at::Tensor& t);
    // elements from a strided tensor's first to its last, or -1 for a negative stride
    static int64_t span_reach(const at::Tensor& t);
    // the newest stored span holding every element of `t` (same memory, same version): its
    // placement and `t`'s byte offset into it, or {-1, 0}
    std::pair<int, int64_t> within(const at::Tensor& t, int64_t first, int64_t end);
    void remember_span(const at::Tensor& t, int64_t nbytes, int placement);
    // the reuse entry of this dense CPU tensor's memory at its version, or null (under mu)
    const Seen* seen_now(const at::Tensor& t, int code);
    // what is known of a tensor an op writes without bumping its version
    void forget(const at::Tensor& t);
    // uninitialised memory (what aten::empty made) not written yet
    bool is_fresh(const at::Tensor& t);
    void remember_fresh(const at::Tensor& t);
    // (offset in /tensors, bytes) of a stored record of this dense CPU tensor's memory at its
    // current version, once drained; None otherwise
    py::object stored(const at::Tensor& t);

    // -- source lines and rows (_observer_rows.cpp), under the GIL -----------------------------
    // index into `sources` of the innermost user frame's "file:line"; -1 for a tensor torch is
    // rebuilding from another process, or ops torch.compile runs while it traces (neither is
    // the step's)
    // `cached`: the walk from the same frame at the same instruction as the last cached one
    // answers that one's result (the ops of one line, of one backward pass); the module
    // hooks' walks start in the tracer's own frames, the same for every call, and are not
    int source_here(bool cached = true);
    void forget_frame();  // drop the cached walk (under the GIL)
    int code_flag(PyObject* code);
    int source_id(PyObject* code, int line);
    PyObject* cached_str(const std::string& text);
    const std::string& prefix(int scope_id, int op_id);
    // the rows kept so far, in record order, numbered from `seq`: a /records row (a tuple in
    // RECORD_FIELDS order) where the statistics were taken here, else (RecordMeta fields,
    // tensor, stable) for the Python writer. Tensor bytes (mode tensor/full) go first: `place`
    // gets each chunk of them (a uint8 tensor) in order and answers the offset in /tensors
    // where the writer put it.
    // Answers (the list, how many of its items are not rows).
    py::tuple drain(int64_t seq, py::object place);

    // -- helpers ------------------------------------------------------------------------------
    // not a tensor subclass, fake or functional tensor (those go through Python)
    static bool plain(const at::Tensor& t) {
        return !t.key_set().has(c10::DispatchKey::Python) &&
               !t.key_set().has(c10::DispatchKey::Functionalize);
    }

    // runs `f` as the observer's own work: the ops it calls are not records
    template <typename F>
    static auto own(F&& f) {
        struct Busy {
            Busy() { tls.busy++; }
            ~Busy() { tls.busy--; }
        } busy;
        return f();
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

    static Observer* instance() {
        static Observer* one = new Observer();  // never freed: callbacks may outlive a module
        return one;
    }
};

}  // namespace sleuth_observer
