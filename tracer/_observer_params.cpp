// tracer._observer: the parameter records of a step (param, grad, update) in compiled code
// (see _observer.cpp and Dumper._record_params in tracer/_dumper.py).
//
// At level module with the observer and statistics only, the parameter records are most of
// what is left in Python per record: a copy of each parameter before the optimizer step and
// three records after it. Here `snapshot` copies every parameter into its buffer (the
// statistics kernel's copy_stats: the copy's statistics in the same pass, kept for its param
// record) and `record_params` keeps the three records of each parameter as rows, in the order
// the Python path writes them, with the same values: a param record of the pre-step copy
// (of the parameter itself at a step end without an optimizer step), the gradient, and the
// update `parameter - copy` (float32: the kernel's difference statistics, nothing written;
// other dtypes: a difference computed by torch).
#include "_observer.h"

#include <ATen/ops/sub.h>
#include <pybind11/stl.h>

namespace sleuth_observer {

namespace {

bool dense_cpu(const at::Tensor& t) {
    return t.defined() && t.device().is_cpu() && t.layout() == at::kStrided &&
           t.has_storage() && t.is_contiguous() && !t.is_conj() && !t.is_neg() &&
           t.numel() > 0 && Observer::plain(t);
}

}  // namespace

bool Observer::snapshot(const std::vector<at::Tensor>& buffers,
                        const std::vector<at::Tensor>& params) {
    if (buffers.size() != params.size()) {
        throw std::invalid_argument("snapshot: as many buffers as parameters");
    }
    for (size_t i = 0; i < params.size(); i++) {
        const at::Tensor& p = params[i];
        const at::Tensor& b = buffers[i];
        if (!dense_cpu(p) || !dense_cpu(b) || code_of(p.scalar_type()) < 0 ||
            b.scalar_type() != p.scalar_type() || b.sizes() != p.sizes()) {
            return false;
        }
    }
    std::lock_guard<std::mutex> lock(mu);
    snapshots.clear();
    for (size_t i = 0; i < params.size(); i++) {
        const at::Tensor& p = params[i];
        const at::Tensor& b = buffers[i];
        raw_stats_t stats{};
        const int code = code_of(p.scalar_type());
        if (kernel->copy_stats(b.data_ptr(), p.const_data_ptr(), p.numel(), code, threads,
                               &stats) != 0) {
            throw std::runtime_error("snapshot: the statistics kernel failed");
        }
        // the kernel wrote it behind torch's back: what was known of its memory is stale
        b.unsafeGetTensorImpl()->bump_version();
        snapshots[b.unsafeGetTensorImpl()] = {static_cast<int64_t>(b._version()), stats};
    }
    return true;
}

void Observer::stats_row(const Context& c, int direction, const at::Tensor& like,
                         const raw_stats_t& stats) {
    rows.push_back(Row{c.scope, c.info->id, c.phase, direction, 0, c.call, c.source,
                       code_of(like.scalar_type()), like.scalar_type(), like.numel(),
                       like.sizes().vec(), stats, at::Tensor(), true, -1, std::string()});
}

void Observer::record_params(
        int call, PyObject* source,
        const std::vector<std::tuple<int, at::Tensor, std::optional<at::Tensor>,
                                     std::optional<at::Tensor>>>& entries) {
    std::vector<Context> contexts;  // checked before anything is kept
    const int source_id = source_of(source);
    for (const auto& e : entries) {
        contexts.push_back(module_context(std::get<0>(e), 2, call, source_id, "record_params"));
    }
    std::lock_guard<std::mutex> lock(mu);
    for (size_t k = 0; k < entries.size(); k++) {
        const auto& [sid, param, grad, before] = entries[k];
        const Context& c = contexts[k];
        const bool with_update = before.has_value() && before->defined();
        const at::Tensor& held = with_update ? *before : param;
        auto snap = with_update ? snapshots.find(held.unsafeGetTensorImpl()) : snapshots.end();
        if (snap != snapshots.end() &&
            snap->second.first == static_cast<int64_t>(held._version())) {
            stats_row(c, 2, held, snap->second.second);
        } else {
            record(held, c, 2, 0, true);
        }
        if (grad.has_value() && grad->defined()) record(*grad, c, 3, 0, true);
        if (!with_update) continue;
        if (param.scalar_type() == at::kFloat && dense_cpu(param) && dense_cpu(held) &&
            held.scalar_type() == at::kFloat && held.sizes() == param.sizes()) {
            raw_stats_t stats{};
            if (kernel->diff_stats(param.const_data_ptr<float>(), held.const_data_ptr<float>(),
                                   nullptr, param.numel(), threads, &stats) != 0) {
                throw std::runtime_error("record_params: the statistics kernel failed");
            }
            stats_row(c, 4, param, stats);
        } else {
            at::Tensor update = own([&] { return at::sub(param, held); });
            record(update, c, 4, 0, false);
        }
    }
    snapshots.clear();
}

}  // namespace sleuth_observer
