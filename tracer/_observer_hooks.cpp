// tracer._observer: the module hooks' records in one call, and their gradient hooks in C++
// (see _observer.cpp and tracer/_module_hooks.py).
//
// The Python module hooks name the call and count it; `record_call` then does the rest of
// what tracer._module_hooks' `_record` does in Python: the source line (the observer's own
// frame walk), the forward records, and a gradient hook on each tensor that requires grad.
// The gradient hooks are C++ tensor hooks (what Python's `Tensor.register_hook` makes, less
// its Python): autograd calls them without the GIL, and they record the gradient once per
// step under the name of the call's tensor, as the Python hooks do.
#include "_observer.h"

#include <pybind11/stl.h>

namespace sleuth_observer {

Context Observer::module_context(int scope_id, int phase, int call, int source,
                                 const char* who) const {
    if (scope_id < 0 || scope_id >= static_cast<int>(scope_names.size())) {
        throw std::invalid_argument(std::string(who) + ": unknown scope id " +
                                    std::to_string(scope_id));
    }
    Context c;
    c.info = const_cast<OpInfo*>(&module_info);  // read only: the op id of module records
    c.scope = scope_id;
    c.phase = phase;
    c.call = call;
    c.source = source;
    return c;
}

void Observer::record_all(const std::vector<at::Tensor>& tensors, const Context& c,
                          int direction, int first) {
    for (size_t i = 0; i < tensors.size(); i++) {
        if (tensors[i].defined()) {
            record(tensors[i], c, direction, first + static_cast<int>(i), true);
        }
    }
}

bool Observer::record_call(int scope_id, int direction, int call,
                           const std::vector<at::Tensor>& tensors, bool forward, bool hook) {
    Context c = module_context(scope_id, 0, call, 0, "record_call");
    for (const at::Tensor& t : tensors) {
        if (t.defined() && !plain(t)) return false;
    }
    const int dir = direction ? 1 : 0;
    if (forward) {
        c.source = source_here(false);
        if (c.source < 0) return false;
        std::lock_guard<std::mutex> lock(mu);
        record_all(tensors, c, dir, 0);
    }
    if (hook) {
        const int64_t gen = generation.load();
        for (size_t i = 0; i < tensors.size(); i++) {
            const at::Tensor& t = tensors[i];
            if (!t.defined() || !t.requires_grad()) continue;
            const GradKey key{scope_id, dir, static_cast<int>(i), call};
            t.register_hook([key, gen](const at::Tensor& grad) {
                instance()->on_grad(key, gen, grad);
            });
        }
    }
    return true;
}

void Observer::on_grad(const GradKey& key, int64_t gen, const at::Tensor& grad) {
    if (gen != generation.load() || !capturing.load() || paused.load() || !grad.defined()) {
        return;
    }
    try {
        py::gil_scoped_acquire gil;  // before the lock, as everywhere (drain holds the GIL)
        const int source = source_here(false);
        const Context c = module_context(key.scope, 1, key.call, source < 0 ? 0 : source,
                                         "gradient hook");
        std::lock_guard<std::mutex> lock(mu);
        if (!grads_seen.insert(key).second) return;  // recomputation hooked it again
        record(grad, c, key.direction, key.index, true);
    } catch (const std::exception& e) {
        // an exception must not escape into the backward pass: the next drain raises it
        fail(e.what());
    }
}

}  // namespace sleuth_observer
