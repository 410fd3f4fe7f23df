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
#include "_observer.h"

#include <torch/extension.h>
#include <ATen/SequenceNumber.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/impl/TorchDispatchModeTLS.h>
#include <torch/csrc/autograd/functions/accumulate_grad.h>

namespace sleuth_observer {

OpInfo& Observer::info_for(const at::RecordFunction& fn) {
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

int Observer::node_scope() {
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

std::unique_ptr<at::ObserverContext> Observer::on_start(const at::RecordFunction& fn) {
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
    bool python_tensor = false;
    each_tensor(fn.inputs(), [&](const at::Tensor& t) { python_tensor |= !plain(t); });
    if (python_tensor) return nullptr;  // FakeTensor tracing (torch.export) and subclasses
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
        } else if (want_in) {
            record(t, *ctx, 0, index, stable);
        }
        index++;
    });
    ctx->skip_outputs = any_fresh && info.view;  // a view of uninitialised memory
    tls.inside++;
    return ctx;
}

void Observer::on_end(const at::RecordFunction& fn, at::ObserverContext* base) {
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

void Observer::record_outputs(const at::RecordFunction& fn, const Context& c) {
    if (!active.load(std::memory_order_relaxed)) return;
    const OpInfo& info = *c.info;
    if ((!want_out && info.uninitialised.empty()) || c.skip_outputs) return;
    const auto& outs = fn.outputs();
    int index = 0;
    size_t next_left_out = 0;
    each_tensor(c10::ArrayRef<const c10::IValue>(outs.data(), outs.size()),
                [&](const at::Tensor& t) {
        if (next_left_out < info.uninitialised.size() &&
            info.uninitialised[next_left_out] == index) {
            next_left_out++;
            remember_fresh(t);
        } else if (want_out) {
            record(t, c, 1, index, !info.unbumped);
        }
        index++;
    });
    for (const at::Tensor& t : c.written) forget(t);
}

void Observer::fail(const char* what) {
    active = false;
    std::lock_guard<std::mutex> lock(mu);
    if (error.empty()) error = what;
    tls.inside = 0;
}

void Observer::start() {
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

void Observer::reset_step() {
    std::lock_guard<std::mutex> lock(mu);
    calls.clear();
    seen.clear();
    grads_seen.clear();
    fresh.clear();
    seq_scopes.clear();
    placements.clear();
    chunks.clear();
    recent.clear();
    forget_frame();
}

void Observer::stop() {
    if (handle != 0) {
        at::removeCallback(handle);
        handle = 0;
    }
    active = false;
    forget_frame();
}

}  // namespace sleuth_observer

using sleuth_observer::Observer;
using sleuth_observer::kRecomputing;

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.doc() = "the op level's compiled capture (tracer/_observer.cpp)";
    m.def("configure", [](py::object want_op, py::object classify_code, py::object format_source,
                          bool want_in, bool want_out, bool want_fw,
                          bool want_bw, bool keep_bytes, int threads, py::capsule kernel) {
        Observer* o = Observer::instance();
        // still registered: its Dumper was dropped unclosed (the Python side lets one Dumper
        // at a time use the observer); what it kept is dropped with it
        o->stop();
        {
            std::lock_guard<std::mutex> lock(o->mu);
            o->rows.clear();
            o->chunks.clear();
            o->error.clear();
        }
        auto* api = static_cast<const fused_api_t*>(
            PyCapsule_GetPointer(kernel.ptr(), FUSED_API_CAPSULE));
        if (api == nullptr) throw py::error_already_set();
        if (api->version != FUSED_API_VERSION) {
            throw std::runtime_error("tracer._fused and tracer._observer were built from "
                                     "different sources: rebuild both (setup.py build_ext)");
        }
        o->generation++;  // the gradient hooks of an earlier configuration record no more
        o->capturing = false;
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
        o->op_names.emplace_back(py::str(""));  // the op of module records
        o->module_info = sleuth_observer::OpInfo{};
        o->module_info.id = 0;
        o->module_info.op = o->module_info.wanted = true;
        for (auto& kv : o->source_objs) Py_DECREF(kv.first);
        o->source_objs.clear();
        o->scope_names.clear();
        o->scope_modules.clear();
        o->snapshots.clear();
        o->sources.assign(1, py::str(""));
        o->source_ids.clear();
        o->code_ids.clear();
    });
    m.def("add_scope", [](py::str name, int module) {
        Observer* o = Observer::instance();
        const int id = static_cast<int>(o->scope_names.size());
        if (module >= id) throw std::invalid_argument("add_scope: unknown module scope id");
        o->scope_names.emplace_back(std::move(name));
        o->scope_modules.push_back(module < 0 ? id : module);
        return id;
    }, py::arg("name"), py::arg("module") = -1,
       "register a module name (or a parameter's, with its owner's scope id as `module`); "
       "returns its scope id");
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
    m.def("give_back", [](const at::Tensor& view) { Observer::instance()->give_back(view); },
          "the writer has written a chunk of tensor bytes drain handed it");
    m.def("stored", [](const at::Tensor& t) { return Observer::instance()->stored(t); },
          "(offset, nbytes) in /tensors of a drained record of this tensor's memory, or None");
    m.def("record", [](int scope_id, int phase, int direction, int call, py::str source,
                       const std::vector<at::Tensor>& tensors, int first) {
        Observer::instance()->record_module(scope_id, phase, direction, call, source.ptr(),
                                            tensors, first);
    }, "keep a module record of each tensor (phase 0 forward, 1 backward; direction 0 input, "
       "1 output), indexed from first");
    m.def("record_call", [](int scope_id, int direction, int call,
                            const std::vector<at::Tensor>& tensors, bool forward, bool hook) {
        return Observer::instance()->record_call(scope_id, direction, call, tensors, forward,
                                                 hook);
    }, "a module call's inputs (direction 0) or outputs (1): forward records now, and "
       "gradient hooks that record in C++; False where the Python hooks must take them");
    m.def("snapshot", [](const std::vector<at::Tensor>& buffers,
                         const std::vector<at::Tensor>& params) {
        return Observer::instance()->snapshot(buffers, params);
    }, "copy each parameter into its buffer, keeping the copy's statistics; False, with "
       "nothing copied, where any pair is not dense CPU tensors of a kernel dtype");
    m.def("record_params", [](int call, py::str source,
                              const std::vector<std::tuple<int, at::Tensor,
                                                           std::optional<at::Tensor>,
                                                           std::optional<at::Tensor>>>& entries) {
        Observer::instance()->record_params(call, source.ptr(), entries);
    }, "the param, grad and update records of each (scope id, parameter, gradient or None, "
       "pre-step copy or None)");
    m.def("capture", [](bool on) { Observer::instance()->capturing.store(on); },
          "whether the gradient hooks record (a dumped step runs)");
    m.def("drain", [](int64_t seq, py::object place) {
        return Observer::instance()->drain(seq, std::move(place));
    }, "the kept records as rows numbered from seq (tensor bytes first, through place)");
}
