// tracer._observer: what a record keeps: statistics, tensor bytes, the reuse table (see
// _observer.cpp).
#include "_observer.h"

#include <ATen/ops/empty.h>
#include <pybind11/stl.h>

namespace sleuth_observer {

std::pair<int, uint8_t*> Observer::allocate(int64_t nbytes) {
    if (chunks.empty() || chunks.back().used + nbytes > chunks.back().data.numel()) {
        const int64_t size = std::max<int64_t>(kChunkBytes, nbytes);
        at::Tensor data;
        if (size == kChunkBytes && !spare.empty()) {
            data = std::move(spare.back());  // memory faulted in already: a fresh chunk's
            spare.pop_back();                // first touch costs as much as the copy
        } else {
            data = own([&] { return at::empty({size}, at::kByte); });
        }
        chunks.push_back(Chunk{std::move(data), 0});
    }
    Chunk& chunk = chunks.back();
    uint8_t* where = chunk.data.data_ptr<uint8_t>() + chunk.used;
    placements.push_back(
        Placement{static_cast<int>(chunks.size()) - 1, chunk.used, nbytes, -1});
    chunk.used += nbytes;
    kept_bytes += nbytes;
    return {static_cast<int>(placements.size()) - 1, where};
}

void Observer::give_back(const at::Tensor& view) {
    std::lock_guard<std::mutex> lock(mu);
    auto it = lent.find(view.storage().unsafeGetStorageImpl());
    if (it == lent.end()) return;
    if (it->second.numel() == kChunkBytes && spare.size() < kSpareChunks) {
        spare.push_back(std::move(it->second));
    }
    lent.erase(it);
}

std::string Observer::strides_of(const at::Tensor& t) {
    if (t.is_contiguous()) return "";
    std::string out;
    for (int64_t k = 0; k < t.dim(); k++) {
        if (k) out += ',';
        out += std::to_string(t.stride(k));
    }
    return out;
}

int64_t Observer::span_reach(const at::Tensor& t) {
    int64_t last = 0;
    for (int64_t k = 0; k < t.dim(); k++) {
        if (t.stride(k) < 0) return -1;
        last += (t.size(k) - 1) * t.stride(k);
    }
    return last + 1;
}

void Observer::record(const at::Tensor& t, const Context& c, int direction, int index,
                      bool stable) {
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
        if (const Seen* hit = reusable ? seen_now(t, code) : nullptr) {
            r.code = code;
            r.stats = hit->stats;
            r.placement = hit->placement;
            if (keep_bytes) r.strides = strides_of(t);
            rows.push_back(std::move(r));
            return;
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
                SpanKey key{reinterpret_cast<uintptr_t>(address), r.numel, code};
                seen.erase(key);
                seen.emplace(key, Seen{t.storage().getWeakStorageImpl(),
                                       static_cast<int64_t>(t._version()), r.stats,
                                       r.placement});
            }
            rows.push_back(std::move(r));
            return;
        }
    }
    if (cpu && !keep_bytes && !t.is_neg() && code <= kCodeLastFloat && t.dim() <= 16 &&
        (threads <= 1 || r.numel < (int64_t{1} << 20))) {  // larger: the copy's threads win
        // strided with gaps or overlapping (an expand), statistics only: those of a C-order
        // copy, to the bit, read piece by piece (a split's q, k and v; the copy cost 4.7% of
        // a tiny op-level step)
        const int status = kernel->strided_stats(t.const_data_ptr(), r.numel, code,
                                                 static_cast<int>(t.dim()), t.sizes().data(),
                                                 t.strides().data(), &r.stats);
        if (status == 0) {
            r.code = code;
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
        const int64_t width = static_cast<int64_t>(t.element_size());
        // elements from its first to its last, when it reads them with its own strides
        const int64_t reach = keep_bytes && !t.is_neg() ? span_reach(t) : -1;
        const int64_t first = reinterpret_cast<int64_t>(t.const_data_ptr());
        const auto [inside, delta] = reach > 0 ? within(t, first, first + reach * width)
                                               : std::pair<int, int64_t>{-1, 0};
        int status;
        if (!keep_bytes) {
            status = kernel->stats(flat.const_data_ptr(), r.numel, code, threads, &r.stats);
        } else if (inside >= 0) {
            // its elements lie inside bytes stored already (a split, a slice): no copy
            r.placement = inside;
            r.delta = delta;
            r.nbytes = reach * width;
            r.strides = strides_of(t);
            status = kernel->stats(flat.const_data_ptr(), r.numel, code, threads, &r.stats);
        } else if (reach > 0 && reach <= 2 * r.numel) {
            // few more bytes than its own (an expand, a slice of little more): store the span
            auto [placement, where] = allocate(reach * width);
            std::memcpy(where, t.const_data_ptr(), static_cast<size_t>(reach * width));
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

int Observer::source_of(PyObject* source) {
    auto it = source_objs.find(source);
    if (it != source_objs.end()) return it->second;
    const int id = static_cast<int>(sources.size());
    sources.emplace_back(py::reinterpret_borrow<py::object>(source));
    Py_INCREF(source);  // the key stays this object
    source_objs.emplace(source, id);
    return id;
}

void Observer::record_module(int scope_id, int phase, int direction, int call,
                             PyObject* source, const std::vector<at::Tensor>& tensors,
                             int first) {
    Context c = module_context(scope_id, phase, call, 0, "record");
    c.source = source_of(source);
    std::lock_guard<std::mutex> lock(mu);
    record_all(tensors, c, direction ? 1 : 0, first);
}

bool Observer::is_fresh(const at::Tensor& t) {
    if (fresh.empty() || !t.defined() || t.layout() != at::kStrided || t.is_inference() ||
        !t.has_storage()) {
        return false;
    }
    auto it = fresh.find(reinterpret_cast<uintptr_t>(t.const_data_ptr()));
    return it != fresh.end() && static_cast<int64_t>(t._version()) == it->second.second;
}

void Observer::remember_fresh(const at::Tensor& t) {
    if (!t.defined() || t.layout() != at::kStrided || t.is_inference() || !t.has_storage()) {
        return;
    }
    if (fresh.size() >= kMaxFresh) fresh.clear();
    fresh[reinterpret_cast<uintptr_t>(t.const_data_ptr())] = {t, t._version()};
}

void Observer::forget(const at::Tensor& t) {
    if (!t.defined() || !t.has_storage() || t.layout() != at::kStrided) return;
    const int code = code_of(t.scalar_type());
    seen.erase(SpanKey{reinterpret_cast<uintptr_t>(t.const_data_ptr()), t.numel(), code});
    c10::StorageImpl* impl = t.storage().unsafeGetStorageImpl();
    for (auto& span : recent) {
        if (span.impl == impl) span.placement = -1;
    }
}

std::pair<int, int64_t> Observer::within(const at::Tensor& t, int64_t first, int64_t end) {
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

void Observer::remember_span(const at::Tensor& t, int64_t nbytes, int placement) {
    if (t.is_inference()) return;
    const int64_t start = reinterpret_cast<int64_t>(t.const_data_ptr());
    if (recent.size() >= kRecentSpans) recent.erase(recent.begin());
    recent.push_back(Span{start, start + nbytes, t.storage().unsafeGetStorageImpl(),
                          t.storage().getWeakStorageImpl(),
                          static_cast<int64_t>(t._version()), placement});
}

const Seen* Observer::seen_now(const at::Tensor& t, int code) {
    auto it = seen.find(SpanKey{reinterpret_cast<uintptr_t>(t.const_data_ptr()), t.numel(),
                                code});
    if (it == seen.end() || it->second.version != static_cast<int64_t>(t._version()) ||
        it->second.storage.lock().get() != t.storage().unsafeGetStorageImpl()) {
        return nullptr;
    }
    return &it->second;
}

py::object Observer::stored(const at::Tensor& t) {
    const int code = code_of(t.scalar_type());
    if (code < 0 || !t.device().is_cpu() || t.layout() != at::kStrided || !t.has_storage() ||
        t.numel() == 0 || t.is_inference() || !t.is_non_overlapping_and_dense()) {
        return py::none();
    }
    std::lock_guard<std::mutex> lock(mu);
    const Seen* hit = seen_now(t, code);
    if (hit == nullptr || hit->placement < 0) return py::none();
    const Placement& p = placements.at(hit->placement);
    if (p.absolute < 0) return py::none();
    return py::make_tuple(p.absolute, p.nbytes);
}

}  // namespace sleuth_observer
