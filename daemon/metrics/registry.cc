#include "daemon/metrics/registry.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <set>

namespace ckpt::metrics {
namespace {

// Label values: backslash, double quote and line feed escaped. HELP: backslash and line feed.
std::string Escape(const std::string& s, bool quotes) {
  std::string out;
  out.reserve(s.size());
  for (char c : s) {
    if (c == '\\') {
      out += "\\\\";
    } else if (c == '\n') {
      out += "\\n";
    } else if (c == '"' && quotes) {
      out += "\\\"";
    } else {
      out += c;
    }
  }
  return out;
}

}  // namespace

std::string FormatValue(double v) {
  if (std::isnan(v)) return "NaN";
  if (std::isinf(v)) return v > 0 ? "+Inf" : "-Inf";
  return fmt::format("{}", v);
}

Histogram::Histogram(const std::vector<double>& bounds)
    : bounds_(bounds), counts_(new std::atomic<uint64_t>[bounds.size() + 1]) {
  for (size_t i = 0; i <= bounds_.size(); ++i) counts_[i].store(0, std::memory_order_relaxed);
}

void Histogram::Observe(double v) {
  size_t i = std::lower_bound(bounds_.begin(), bounds_.end(), v) - bounds_.begin();
  counts_[i].fetch_add(1, std::memory_order_relaxed);
  sum_.fetch_add(v, std::memory_order_relaxed);
}

Histogram::Values Histogram::Read() const {
  Values values;
  uint64_t running = 0;
  for (size_t i = 0; i <= bounds_.size(); ++i) {
    running += counts_[i].load(std::memory_order_relaxed);
    values.cumulative.push_back(running);
  }
  values.sum = sum_.load(std::memory_order_relaxed);
  return values;
}

const std::vector<double>& SecondsBuckets() {
  static const std::vector<double> kBuckets = {0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
                                               0.5,   1,      2.5,   5,    10,    30,   60,  120,
                                               300,   600};
  return kBuckets;
}

template <typename Metric>
Metric& Family<Metric>::With(LabelValues values) {
  values.resize(spec_.labels.size());
  std::lock_guard lock(mu_);
  auto it = series_.find(values);
  if (it != series_.end()) return *it->second;
  if (series_.size() >= spec_.max_series && spec_.fold_label >= 0) {
    values[spec_.fold_label] = kOther;
    it = series_.find(values);
    if (it != series_.end()) return *it->second;
  }
  std::unique_ptr<Metric> made;
  if constexpr (std::is_same_v<Metric, metrics::Histogram>) {
    made = std::make_unique<Metric>(bounds_);
  } else {
    made = std::make_unique<Metric>();
  }
  return *series_.emplace(std::move(values), std::move(made)).first->second;
}

template <typename Metric>
void Family<Metric>::Render(Exposition& out) const {
  std::lock_guard lock(mu_);
  if constexpr (std::is_same_v<Metric, metrics::Histogram>) {
    std::vector<std::pair<LabelValues, Histogram::Values>> rows;
    for (const auto& [values, h] : series_) rows.emplace_back(values, h->Read());
    out.Histogram(spec_, rows, bounds_);
  } else {
    std::vector<std::pair<LabelValues, double>> rows;
    for (const auto& [values, m] : series_) rows.emplace_back(values, m->value());
    out.Samples(spec_, rows, std::is_same_v<Metric, Counter>);
  }
}

template class Family<Counter>;
template class Family<Gauge>;
template class Family<metrics::Histogram>;

void Exposition::Header(const FamilySpec& spec, const char* type) {
  out_ += fmt::format("# HELP {} {}\n# TYPE {} {}\n", spec.name, Escape(spec.help, false), spec.name, type);
}

void Exposition::Sample(const std::string& name, const std::vector<std::string>& labels,
                        const LabelValues& values, double value, const char* extra_label,
                        const std::string& extra_value) {
  out_ += name;
  if (!labels.empty() || extra_label != nullptr) {
    out_ += '{';
    bool first = true;
    for (size_t i = 0; i < labels.size(); ++i) {
      out_ += fmt::format("{}{}=\"{}\"", first ? "" : ",", labels[i], Escape(i < values.size() ? values[i] : "", true));
      first = false;
    }
    if (extra_label != nullptr) out_ += fmt::format("{}{}=\"{}\"", first ? "" : ",", extra_label, extra_value);
    out_ += '}';
  }
  out_ += ' ';
  out_ += FormatValue(value);
  out_ += '\n';
}

void Exposition::Samples(const FamilySpec& spec, const std::vector<std::pair<LabelValues, double>>& rows,
                         bool counter) {
  Header(spec, counter ? "counter" : "gauge");
  for (const auto& [values, value] : rows) Sample(spec.name, spec.labels, values, value);
}

void Exposition::Histogram(const FamilySpec& spec,
                           const std::vector<std::pair<LabelValues, Histogram::Values>>& rows,
                           const std::vector<double>& bounds) {
  Header(spec, "histogram");
  for (const auto& [values, h] : rows) {
    for (size_t i = 0; i <= bounds.size(); ++i) {
      Sample(spec.name + "_bucket", spec.labels, values, static_cast<double>(h.cumulative[i]), "le",
             i < bounds.size() ? FormatValue(bounds[i]) : "+Inf");
    }
    Sample(spec.name + "_sum", spec.labels, values, h.sum);
    Sample(spec.name + "_count", spec.labels, values, static_cast<double>(h.cumulative.back()));
  }
}

std::vector<std::pair<LabelValues, double>> FoldRows(std::vector<std::pair<LabelValues, double>> rows,
                                                     size_t max_rows, size_t fold_label, bool keep_max) {
  std::set<std::string> kept;
  std::vector<std::pair<LabelValues, double>> out;
  std::map<LabelValues, double> folded;
  for (auto& [values, value] : rows) {
    const std::string& v = values.at(fold_label);
    if (kept.count(v) != 0 || kept.size() < max_rows) {
      kept.insert(v);
      out.emplace_back(std::move(values), value);
      continue;
    }
    values[fold_label] = kOther;
    auto [it, added] = folded.emplace(values, value);
    if (!added) it->second = keep_max ? std::max(it->second, value) : it->second + value;
  }
  for (auto& [values, value] : folded) out.emplace_back(values, value);
  return out;
}

template <typename Metric>
Family<Metric>& Registry::Add(FamilySpec spec, std::vector<double> bounds) {
  std::shared_ptr<Family<Metric>> family(new Family<Metric>(std::move(spec), std::move(bounds)));
  std::lock_guard lock(mu_);
  families_.push_back(family);
  render_.push_back([f = family.get()](Exposition& out) { f->Render(out); });
  return *family;
}

Family<Counter>& Registry::AddCounter(FamilySpec spec) { return Add<Counter>(std::move(spec), {}); }
Family<Gauge>& Registry::AddGauge(FamilySpec spec) { return Add<Gauge>(std::move(spec), {}); }
Family<metrics::Histogram>& Registry::AddHistogram(FamilySpec spec, std::vector<double> bounds) {
  return Add<metrics::Histogram>(std::move(spec), std::move(bounds));
}

void Registry::Render(Exposition& out) const {
  std::vector<std::function<void(Exposition&)>> render;
  {
    std::lock_guard lock(mu_);
    render = render_;
  }
  for (const auto& r : render) r(out);
}

std::string Registry::Render() const {
  Exposition out;
  Render(out);
  return out.Take();
}

}  // namespace ckpt::metrics
