// Counters, gauges and histograms that every stage of the daemon updates, and their
// Prometheus text exposition (format 0.0.4), written here because Debian 12 packages no
// C++ Prometheus client: the format is small, and tests parse what this writes with the
// stock parser (prometheus_client.parser).
//
// Updates are lock-free atomics on a series found once; finding a series by its label
// values takes the family's mutex, which scrapes hold only while copying values out.
// Label values that a trainer chooses (job names, uids) are bounded: past a family's
// `max_series`, new values of its `fold_label` are counted under "_other", so a hostile
// trainer cannot grow the exposition without bound.
#pragma once

#include <atomic>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

namespace ckpt::metrics {

using LabelValues = std::vector<std::string>;

// The label value that stands for every value past a family's bound.
inline constexpr char kOther[] = "_other";

class Counter {
 public:
  void Add(double v = 1) { value_.fetch_add(v, std::memory_order_relaxed); }
  double value() const { return value_.load(std::memory_order_relaxed); }

 private:
  std::atomic<double> value_{0};
};

class Gauge {
 public:
  void Set(double v) { value_.store(v, std::memory_order_relaxed); }
  void Add(double v) { value_.fetch_add(v, std::memory_order_relaxed); }
  double value() const { return value_.load(std::memory_order_relaxed); }

 private:
  std::atomic<double> value_{0};
};

// Cumulative buckets as Prometheus defines them: an observation counts in every bucket
// whose upper bound is at least the value, and in +Inf.
class Histogram {
 public:
  explicit Histogram(const std::vector<double>& bounds);
  void Observe(double v);

  struct Values {
    std::vector<uint64_t> cumulative;  // per bound, then +Inf
    double sum = 0;
  };
  Values Read() const;

 private:
  const std::vector<double> bounds_;
  std::unique_ptr<std::atomic<uint64_t>[]> counts_;  // per bound, then +Inf (not cumulative)
  std::atomic<double> sum_{0};
};

// Seconds, from 1 ms to 10 minutes: a snapshot's release, a shard's write, a group round,
// an upload.
const std::vector<double>& SecondsBuckets();

// Names and help of a family; the label names, in the order label values are given.
struct FamilySpec {
  std::string name;
  std::string help;
  std::vector<std::string> labels;
  size_t max_series = 256;
  int fold_label = -1;  // the label whose new values past max_series become kOther
};

class Registry;
class Exposition;

template <typename Metric>
class Family {
 public:
  // The series of these label values (created at its first use; past the bound, the
  // series with the fold label set to kOther). The reference stays valid for the
  // registry's life.
  Metric& With(LabelValues values);

 private:
  friend class Registry;
  Family(FamilySpec spec, std::vector<double> bounds) : spec_(std::move(spec)), bounds_(std::move(bounds)) {}
  void Render(Exposition& out) const;

  const FamilySpec spec_;
  const std::vector<double> bounds_;  // histograms only
  mutable std::mutex mu_;
  std::map<LabelValues, std::unique_ptr<Metric>> series_;
};

// Writes families in the text exposition format: what scrape-time collectors call.
class Exposition {
 public:
  // One family of gauges (or counters, `counter`), a sample per row.
  void Samples(const FamilySpec& spec, const std::vector<std::pair<LabelValues, double>>& rows,
               bool counter = false);
  void Histogram(const FamilySpec& spec, const std::vector<std::pair<LabelValues, Histogram::Values>>& rows,
                 const std::vector<double>& bounds);
  std::string Take() { return std::move(out_); }

 private:
  void Header(const FamilySpec& spec, const char* type);
  void Sample(const std::string& name, const std::vector<std::string>& labels, const LabelValues& values,
              double value, const char* extra_label = nullptr, const std::string& extra_value = {});
  std::string out_;
};

// Rows whose `fold_label` goes past `max_rows` distinct values summed into kOther (or, with
// `keep_max`, the largest of them: ages): what a scrape-time collector of per-job or
// per-user figures does with a hostile number of them.
std::vector<std::pair<LabelValues, double>> FoldRows(std::vector<std::pair<LabelValues, double>> rows,
                                                     size_t max_rows, size_t fold_label, bool keep_max = false);

class Registry {
 public:
  Family<Counter>& AddCounter(FamilySpec spec);
  Family<Gauge>& AddGauge(FamilySpec spec);
  Family<metrics::Histogram>& AddHistogram(FamilySpec spec, std::vector<double> bounds = SecondsBuckets());
  // Every family, in the order added. A scrape then adds what it reads from elsewhere (the
  // staging pool, the sessions, the group's view, /proc) to the same exposition.
  void Render(Exposition& out) const;
  std::string Render() const;

 private:
  template <typename Metric>
  Family<Metric>& Add(FamilySpec spec, std::vector<double> bounds);

  mutable std::mutex mu_;
  std::vector<std::shared_ptr<void>> families_;  // owned; rendered through `render_`
  std::vector<std::function<void(Exposition&)>> render_;  // the families
};

// Prometheus' float syntax: shortest round trip, +Inf, -Inf, NaN.
std::string FormatValue(double v);

}  // namespace ckpt::metrics
