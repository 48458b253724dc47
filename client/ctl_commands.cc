#include "client/ctl_commands.h"

#include <grpcpp/grpcpp.h>
#include <sys/stat.h>
#include <unistd.h>

#include <fmt/chrono.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cerrno>
#include <ctime>
#include <iostream>
#include <set>
#include <thread>
#include <vector>

#include "client/ctl_exit.h"
#include "client/progress_bar.h"
#include "client/proto_json.h"
#include "client/table.h"
#include "proto/health.grpc.pb.h"

namespace ckpt::ctl {
namespace {

using namespace ::ckptd::v1;
using Clock = std::chrono::steady_clock;

constexpr double kCallSeconds = 30;      // status, list, show, delete, health
constexpr double kVerifySeconds = 3600;  // verify re-reads every byte

double Seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

// The files stored with a step, by name: the first few and how many more (--json lists all);
// no spaces, so that scripts that split a row into words still find the columns after it.
std::string FileNames(const google::protobuf::RepeatedPtrField<std::string>& files) {
  if (files.empty()) return "-";
  constexpr int kShown = 3;
  std::vector<std::string> shown(files.begin(), files.begin() + std::min(files.size(), kShown));
  return fmt::format("{}{}", fmt::join(shown, ","),
                     files.size() > kShown ? fmt::format(",+{}", files.size() - kShown) : "");
}

std::string Steps(const google::protobuf::RepeatedField<uint64_t>& steps) {
  if (steps.empty()) return "-";
  return fmt::format("{}", fmt::join(steps, ","));
}

void PrintJson(const nlohmann::json& j) {
  std::cout << j.dump(2, ' ', false, nlohmann::json::error_handler_t::replace) << "\n";
}

void PrintGroup(const GroupStatus& g) {
  std::cout << fmt::format("group     node {} of {}  listening on {}  coordinator {}  {}{}\n", g.node_rank(),
                           g.num_nodes(), g.address(), g.coordinator(), g.joined() ? "joined" : "NOT JOINED",
                           g.tls() ? "  (TLS)" : "");
  if (!g.last_error().empty()) std::cout << "          last error: " << g.last_error() << "\n";
  ckpt::Table members({"NODE", "ADDRESS", "STATE", "LAST HEARTBEAT", "DOMAIN"});
  for (const auto& m : g.members()) {
    members.Add({std::to_string(m.node_rank()), m.address().empty() ? "-" : m.address(), m.state(),
                 m.last_heartbeat_age_s() >= 0 ? fmt::format("{:.1f} s ago", m.last_heartbeat_age_s())
                 : m.state() == "waiting"      ? "never"
                                               : "-",  // only the coordinator's status has ages
                 m.failure_domain().empty() ? "-" : m.failure_domain()});
  }
  std::cout << "MEMBERS\n" << (g.members().empty() ? "(not heard from the coordinator)\n" : members.Render()) << "\n";
  if (g.replication().empty()) return;
  std::cout << fmt::format("replicas  {}  this node's fragments to nodes {}  holding {} of {} for peers{}\n",
                           g.replication(), fmt::join(g.replica_holders(), ","), HumanBytes(g.replica_bytes_used()),
                           HumanBytes(g.replica_bytes_total()),
                           g.failure_domain().empty() ? "" : "  domain " + g.failure_domain());
  if (!g.placement_warning().empty()) std::cout << "          WARNING: " << g.placement_warning() << "\n";
  ckpt::Table held({"JOB", "OF NODE", "STEP", "FRAGMENTS", "BYTES", "SEALED"});
  for (const auto& h : g.held_replicas()) {
    held.Add({h.job(), std::to_string(h.owner()), std::to_string(h.step()), std::to_string(h.fragments()),
              HumanBytes(h.bytes()), h.sealed() ? "yes" : "no (arriving, or given up)"});
  }
  if (!held.empty()) std::cout << "HELD FOR PEERS\n" << held.Render();
  std::cout << "\n";
}

// A job's line of a status reply, or null.
const JobStatus* FindJob(const StatusReply& r, const std::string& job) {
  for (const auto& j : r.jobs()) {
    if (j.job() == job) return &j;
  }
  return nullptr;
}

}  // namespace

int Report(const Options& o, const std::string& command, int exit_code, const std::string& sentence) {
  if (o.json) {
    PrintJson({{"error", {{"command", command}, {"exit_code", exit_code}, {"message", sentence}}}});
  } else {
    std::cerr << "ckptctl " << command << ": " << sentence << "\n";
  }
  return exit_code;
}

Commands::Commands(const Options& o) : o_(o) {
  channel_ = grpc::CreateChannel(o.addr.empty() ? "unix:" + o.socket : o.addr, grpc::InsecureChannelCredentials());
  stub_ = Admin::NewStub(channel_);
}

std::optional<std::string> Commands::Connect() {
  const auto deadline = std::chrono::system_clock::now() +
                        std::chrono::milliseconds(static_cast<int64_t>(o_.dial_timeout_s * 1000));
  if (channel_->WaitForConnected(deadline)) return std::nullopt;
  if (o_.addr.empty()) {
    struct stat st {};
    if (::stat(o_.socket.c_str(), &st) != 0 && errno == ENOENT) {
      return fmt::format("no ckptd listens at {} (the socket does not exist): is ckptd running? (--socket, "
                         "or CKPTD_SOCKET)",
                         o_.socket);
    }
    if (::access(o_.socket.c_str(), W_OK) != 0) {  // the socket, or a directory above it
      return fmt::format("this user may not connect to ckptd at {} (permission denied): the socket (mode "
                         "0660) is for ckptd's group: join it",
                         o_.socket);
    }
  }
  return fmt::format("could not connect to ckptd at {} within {} s (--dial-timeout): is it running, and "
                     "not stopped?",
                     o_.Where(), o_.dial_timeout_s);
}

std::unique_ptr<grpc::ClientContext> Commands::Context(double default_s) {
  auto ctx = std::make_unique<grpc::ClientContext>();
  const double seconds = o_.timeout_s > 0 ? o_.timeout_s : default_s;
  ctx->set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(static_cast<int64_t>(seconds * 1000)));
  if (!o_.token.empty()) ctx->AddMetadata("x-ckptd-admin-token", o_.token);
  return ctx;
}

int Commands::Failed(const std::string& command, const grpc::Status& s, double seconds) {
  const double waited = o_.timeout_s > 0 ? o_.timeout_s : seconds;
  return Report(o_, command, ExitFor(s), Explain(s, o_.Where(), static_cast<int>(waited)));
}

std::optional<std::string> Commands::Job(const std::string& command, int* exit_code) {
  if (!o_.job.empty()) return o_.job;
  ListReply r;
  grpc::Status s = stub_->List(Context(kCallSeconds).get(), ListRequest(), &r);
  if (!s.ok()) {
    *exit_code = Failed(command, s, kCallSeconds);
    return std::nullopt;
  }
  std::set<std::string> jobs;
  for (const auto& c : r.checkpoints()) jobs.insert(c.job());
  if (jobs.size() == 1) return *jobs.begin();
  *exit_code = Report(o_, command, kError,
                      jobs.empty() ? "no checkpoints exist, so no job to pick: pass --job"
                                   : fmt::format("several jobs ({}): pass --job", fmt::join(jobs, ", ")));
  return std::nullopt;
}

std::optional<CheckpointRef> Commands::Ref(const std::string& command, int* exit_code) {
  if (auto why = Connect()) {
    *exit_code = Report(o_, command, kUnreachable, *why);
    return std::nullopt;
  }
  std::optional<std::string> job = Job(command, exit_code);
  if (!job) return std::nullopt;
  CheckpointRef ref;
  ref.set_job(*job);
  ref.set_step(*o_.step);
  return ref;
}

int Commands::Status() {
  if (auto why = Connect()) return Report(o_, "status", kUnreachable, *why);
  StatusReply r;
  grpc::Status s = stub_->Status(Context(kCallSeconds).get(), StatusRequest(), &r);
  if (!s.ok()) return Failed("status", s, kCallSeconds);
  if (o_.json) {
    nlohmann::json j = ProtoToJson(r);
    j["config"] = nlohmann::json::parse(r.config_json(), nullptr, false);  // an object, not a string
    j.erase("config_json");
    PrintJson(j);
    return kOk;
  }
  std::cout << fmt::format("ckptd {}  up {:.1f} s  root {}\n", r.version(), r.uptime_s(), r.root());
  if (!r.remote().empty()) std::cout << fmt::format("remote    {}\n", r.remote());
  std::cout << fmt::format("staging   {} of {} in use{}\n", HumanBytes(r.staging_bytes_used()),
                           HumanBytes(r.staging_bytes_total()), r.staging_prefaulted() ? "" : " (still being pre-faulted)");
  std::cout << fmt::format("counters  staged {}  rejected {}  committed {}  failed {}  persisted {}\n\n",
                           r.snapshots_staged(), r.snapshots_rejected(), r.checkpoints_committed(),
                           r.checkpoints_failed(), HumanBytes(r.bytes_persisted()));
  ckpt::Table sessions({"JOB", "RANK", "PID", "TENSORS", "BYTES", "STAGED", "COMMITTED", "ALIVE"});
  for (const auto& x : r.sessions()) {
    sessions.Add({x.job(), fmt::format("{}/{}", x.rank(), x.world_size()), std::to_string(x.pid()),
                  std::to_string(x.tensors()), HumanBytes(x.bytes()), std::to_string(x.last_staged_step()),
                  std::to_string(x.last_committed_step()), x.trainer_alive() ? "yes" : "no"});
  }
  std::cout << "SESSIONS\n" << (r.sessions().empty() ? "(none)\n" : sessions.Render()) << "\n";
  if (r.group().enabled()) PrintGroup(r.group());
  ckpt::Table jobs({"JOB", "LATEST", "GLOBAL", "REMOTE", "PENDING", "IN MEMORY"});
  for (const auto& j : r.jobs()) {
    jobs.Add({j.job(), j.has_committed() ? std::to_string(j.latest_committed_step()) : "-",
              j.has_global() ? std::to_string(j.latest_global_step()) : "-",
              j.has_remote() ? std::to_string(j.latest_remote_step()) : "-", Steps(j.pending_steps()),
              Steps(j.hot_steps())});
  }
  std::cout << "JOBS\n" << (r.jobs().empty() ? "(none)\n" : jobs.Render());
  ckpt::Table flight({"JOB", "STEP", "STATE", "SCOPE", "AGE", "MISSING RANKS"});
  for (const auto& j : r.jobs()) {
    for (const auto& f : j.in_flight()) {
      std::vector<uint32_t> missing(f.missing_ranks().begin(), f.missing_ranks().end());
      flight.Add({j.job(), std::to_string(f.step()), f.state(), f.scope(), fmt::format("{:.1f} s", f.age_s()),
                  missing.empty() ? "-" : fmt::format("{}", fmt::join(missing, ","))});
    }
  }
  if (!flight.empty()) std::cout << "\nSTEPS IN FLIGHT\n" << flight.Render();
  ckpt::Table uploads({"JOB", "STEP", "STATE", "DONE", "AGE", "LAST ERROR"});
  for (const auto& j : r.jobs()) {
    for (const auto& u : j.uploads()) {
      uploads.Add({j.job(), std::to_string(u.step()), u.state(),
                   fmt::format("{} of {}", HumanBytes(u.bytes_done()), HumanBytes(u.bytes_total())),
                   fmt::format("{:.1f} s", u.age_s()), u.last_error().empty() ? "-" : u.last_error()});
    }
  }
  if (!uploads.empty()) std::cout << "\nUPLOADS\n" << uploads.Render();
  ckpt::Table replication({"JOB", "STEP", "REPLICATION", "SENT", "TIME", "WHY"});
  for (const auto& j : r.jobs()) {
    for (const auto& s : j.replication()) {
      replication.Add({j.job(), std::to_string(s.step()), s.state(), HumanBytes(s.bytes_sent()),
                       s.state() == "replicated" ? fmt::format("{:.2f} s", s.seconds()) : "-",
                       s.why().empty() ? "-" : s.why()});
    }
  }
  if (!replication.empty()) std::cout << "\nPEER REPLICAS (this node's steps)\n" << replication.Render();
  if (!r.recent_errors().empty()) {
    std::cout << "\nRECENT ERRORS\n";
    for (const auto& e : r.recent_errors()) std::cout << "  " << e << "\n";
  }
  return kOk;
}

int Commands::List() {
  if (auto why = Connect()) return Report(o_, "list", kUnreachable, *why);
  ListRequest req;
  req.set_job(o_.job);
  ListReply r;
  grpc::Status s = stub_->List(Context(kCallSeconds).get(), req, &r);
  if (!s.ok()) return Failed("list", s, kCallSeconds);
  return PrintList(r, o_);
}

int Commands::PrintList(const ListReply& r, const Options& o) {
  const bool unreadable = std::any_of(r.checkpoints().begin(), r.checkpoints().end(),
                                      [](const auto& c) { return !c.error().empty(); });
  const int code = unreadable || !r.errors().empty() ? kDamaged : kOk;
  if (o.json) {
    PrintJson(ProtoToJson(r));
    return code;
  }
  ckpt::Table t({"JOB", "STEP", "RANKS", "TENSORS", "SIZE", "WRITTEN (UTC)", "FILES", "WHERE", "KIND"});
  std::vector<std::string> errors;
  for (const auto& c : r.checkpoints()) {
    if (!c.error().empty()) {
      t.Add({c.job(), std::to_string(c.step()), "?", "?", "?", "UNREADABLE (below)", "?",
             fmt::format("{}", fmt::join(c.tiers(), ",")), "?"});
      errors.push_back(fmt::format("step {} of job {}: {}", c.step(), c.job(), c.error()));
      continue;
    }
    t.Add({c.job(), std::to_string(c.step()), std::to_string(c.world_size()), std::to_string(c.tensors()),
           c.referenced_bytes() == 0
               ? HumanBytes(c.bytes())
               : fmt::format("{} (+{} referenced)", HumanBytes(c.bytes()), HumanBytes(c.referenced_bytes())),
           fmt::format("{:%Y-%m-%d %H:%M:%S}", fmt::gmtime(static_cast<std::time_t>(c.unix_time()))),
           FileNames(c.files()), fmt::format("{}", fmt::join(c.tiers(), ",")),
           c.flags().empty() ? "full" : fmt::format("{}", fmt::join(c.flags(), ","))});
  }
  std::cout << (r.checkpoints().empty() ? "no checkpoints\n" : t.Render());
  for (const std::string& e : errors) std::cout << "  " << e << "\n";
  for (const std::string& e : r.errors()) std::cout << "  " << e << "\n";
  return code;
}

int Commands::Show() {
  int code = kError;
  std::optional<CheckpointRef> ref = Ref("show", &code);
  if (!ref) return code;
  ShowReply r;
  grpc::Status s = stub_->Show(Context(kCallSeconds).get(), *ref, &r);
  if (!s.ok()) return Failed("show", s, kCallSeconds);
  std::cout << r.manifest_json() << "\n";  // the manifest itself (docs/format.md), with or without --json
  return kOk;
}

int Commands::Verify() {
  int code = kError;
  std::optional<CheckpointRef> ref = Ref("verify", &code);
  if (!ref) return code;
  std::optional<ProgressBar> bar = VerifyProgress(o_);
  auto context = Context(kVerifySeconds);
  std::unique_ptr<grpc::ClientReader<VerifyUpdate>> stream = stub_->VerifyWithProgress(context.get(), *ref);
  VerifyUpdate update;
  std::optional<VerifyReply> result;
  while (stream->Read(&update)) {
    if (bar) bar->Update(update.bytes_checked(), update.bytes_total());
    if (update.has_result()) result = update.result();
  }
  grpc::Status s = stream->Finish();
  if (!s.ok()) return Failed("verify", s, kVerifySeconds);
  if (!result) return Report(o_, "verify", kError, "ckptd ended the verify without a result");
  return PrintVerify(*result, ref->job(), *o_.step, o_);
}

std::optional<ProgressBar> Commands::VerifyProgress(const Options& o) {
  if (o.progress_lines) return ProgressBar("verify", ProgressBar::Style::kLines);
  if (!o.json && o.progress && ::isatty(STDERR_FILENO)) return ProgressBar("verify", ProgressBar::Style::kBar);
  return std::nullopt;
}

int Commands::PrintVerify(const VerifyReply& r, const std::string& job, uint64_t step, const Options& o) {
  if (o.json) {
    nlohmann::json j = {{"job", job}, {"step", step}};
    j.update(ProtoToJson(r));
    PrintJson(j);
  } else if (r.ok()) {
    std::cout << fmt::format("step {} of job {}: OK ({} checked)\n", step, job, HumanBytes(r.bytes_checked()));
    if (r.bytes_referenced() != 0) {
      std::cout << fmt::format("  of which {} referenced in {} files of earlier steps:\n",
                               HumanBytes(r.bytes_referenced()), r.referenced_files_size());
      for (const std::string& file : r.referenced_files()) std::cout << "    " << file << "\n";
    }
    if (!r.skipped_ranks().empty()) {
      std::vector<uint32_t> skipped(r.skipped_ranks().begin(), r.skipped_ranks().end());
      std::cout << fmt::format("  ranks {} are held by other nodes: verify them there\n", fmt::join(skipped, ","));
    }
  } else {
    std::cout << fmt::format("step {} of job {}: DAMAGED\n", step, job);
    for (const auto& p : r.problems()) std::cout << "  " << p << "\n";
  }
  return r.ok() ? kOk : kDamaged;
}

int Commands::Delete() {
  int code = kError;
  std::optional<CheckpointRef> ref = Ref("delete", &code);
  if (!ref) return code;
  const std::string& job = ref->job();
  DeleteReply r;
  grpc::Status s = stub_->Delete(Context(kCallSeconds).get(), *ref, &r);
  if (!s.ok()) return Failed("delete", s, kCallSeconds);
  if (o_.json) {
    nlohmann::json deleted = {{"job", job}, {"step", *o_.step}};
    if (!r.note().empty()) deleted["note"] = r.note();
    PrintJson({{"deleted", deleted}});
  } else {
    std::cout << fmt::format("deleted step {} of job {}{}\n", *o_.step, job, r.note().empty() ? "" : "; " + r.note());
  }
  return kOk;
}

int Commands::Health() {
  const std::string what = o_.service.empty() ? "ckptd" : o_.service;
  if (auto why = Connect()) return Report(o_, "health", kUnreachable, *why);
  auto stub = grpc::health::v1::Health::NewStub(channel_);
  grpc::health::v1::HealthCheckRequest request;
  request.set_service(o_.service);
  grpc::health::v1::HealthCheckResponse response;
  grpc::Status s = stub->Check(Context(5).get(), request, &response);
  if (!s.ok()) return Failed("health", s, 5);
  const bool serving = response.status() == grpc::health::v1::HealthCheckResponse::SERVING;
  const std::string status = grpc::health::v1::HealthCheckResponse::ServingStatus_Name(response.status());
  if (o_.json) {
    PrintJson({{"service", o_.service}, {"status", status}});
  } else {
    std::cout << what << ": " << status << (serving || !o_.service.empty() ? "" : " (ckptctl status says why: the group)")
              << "\n";
  }
  return serving ? kOk : kError;
}

int Commands::WaitReady() {
  const auto started = Clock::now();
  const std::optional<Clock::time_point> deadline =
      o_.timeout_s > 0 ? std::optional(started + std::chrono::milliseconds(static_cast<int64_t>(o_.timeout_s * 1000)))
                       : std::nullopt;
  std::string last;
  while (true) {
    // A fresh channel each time: gRPC backs off reconnecting a failed one for up to minutes,
    // and a daemon that is starting should be seen within a fraction of a second.
    channel_ = grpc::CreateChannel(o_.addr.empty() ? "unix:" + o_.socket : o_.addr,
                                   grpc::InsecureChannelCredentials());
    stub_ = Admin::NewStub(channel_);
    std::string now;
    struct stat st {};
    if (o_.addr.empty() && ::stat(o_.socket.c_str(), &st) != 0 && errno == ENOENT) {
      // Not there yet: no need to spend --dial-timeout finding out.
      now = fmt::format("no ckptd listens at {} yet (the socket does not exist)", o_.socket);
    } else if (auto why = Connect()) {
      now = *why;
    } else {
      auto health = grpc::health::v1::Health::NewStub(channel_);
      grpc::ClientContext ctx;
      ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
      grpc::health::v1::HealthCheckResponse response;
      grpc::Status s = health->Check(&ctx, grpc::health::v1::HealthCheckRequest(), &response);
      if (s.ok() && response.status() == grpc::health::v1::HealthCheckResponse::SERVING) {
        if (o_.json) {
          PrintJson({{"ready", true}, {"waited_seconds", Seconds(Clock::now() - started)}});
        } else {
          std::cout << fmt::format("ckptd at {}: ready\n", o_.Where());
        }
        return kOk;
      }
      now = s.ok() ? fmt::format("ckptd at {} is not ready yet (not joined to its group: ckptctl status says why)",
                                 o_.Where())
                   : fmt::format("ckptd at {} did not answer: {}", o_.Where(), s.error_message());
    }
    if (now != last && o_.progress) std::cerr << fmt::format("[{:.1f} s] {}\n", Seconds(Clock::now() - started), now);
    last = now;
    if (deadline && Clock::now() >= *deadline) {
      return Report(o_, "wait", kUnreachable, fmt::format("not ready within {} s: {}", o_.timeout_s, now));
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
  }
}

std::optional<std::string> Commands::Root() {
  if (Connect()) return std::nullopt;
  StatusReply r;
  if (!stub_->Status(Context(5).get(), StatusRequest(), &r).ok() || r.root().empty()) return std::nullopt;
  return r.root();
}

int Commands::Wait() {
  if (auto why = Connect()) return Report(o_, "wait", kUnreachable, *why);
  if (o_.job.empty()) return Report(o_, "wait", kUsage, "wait needs --job (the job whose step to wait for)");
  const std::string& job = o_.job;
  const auto started = Clock::now();
  const std::optional<Clock::time_point> deadline =
      o_.timeout_s > 0 ? std::optional(started + std::chrono::milliseconds(static_cast<int64_t>(o_.timeout_s * 1000)))
                       : std::nullopt;
  auto status = [&](StatusReply& r) -> grpc::Status {
    return stub_->Status(Context(10).get(), StatusRequest(), &r);
  };
  // Without STEP: the next step committed after now.
  std::optional<uint64_t> baseline;
  StatusReply r;
  if (grpc::Status s = status(r); !s.ok()) return Failed("wait", s, 10);
  if (const JobStatus* j = FindJob(r, job); j != nullptr && j->has_committed()) baseline = j->latest_committed_step();
  // A job this ckptd knows nothing of (no steps, no sessions) is a misspelling more often
  // than a job about to start: waiting for it needs a --timeout.
  const bool known = FindJob(r, job) != nullptr ||
                     std::any_of(r.sessions().begin(), r.sessions().end(), [&](const auto& s) { return s.job() == job; });
  if (!known && !deadline) {
    return Report(o_, "wait", kError,
                  fmt::format("ckptd at {} knows no job {} (no steps, no sessions): check --job, or give a "
                              "--timeout to wait for it to start",
                              o_.Where(), job));
  }
  bool seen_in_flight = false;
  std::string last_line;
  while (true) {
    const JobStatus* j = FindJob(r, job);
    // Committed: the step is the job's latest (or, with STEP, among its committed steps).
    if (j != nullptr && j->has_committed()) {
      bool done = false;
      uint64_t committed = j->latest_committed_step();
      if (!o_.step) {
        done = !baseline || committed != *baseline;
      } else if (committed == *o_.step) {
        done = true;
      } else {
        ListRequest req;
        req.set_job(job);
        ListReply listed;
        if (stub_->List(Context(10).get(), req, &listed).ok()) {
          done = std::any_of(listed.checkpoints().begin(), listed.checkpoints().end(),
                             [&](const auto& c) { return c.step() == *o_.step && c.error().empty(); });
        }
        if (done) committed = *o_.step;
      }
      if (done) {
        if (o_.json) {
          PrintJson({{"job", job}, {"step", committed}, {"committed", true}});
        } else {
          std::cout << fmt::format("step {} of job {} committed\n", committed, job);
        }
        return kOk;
      }
    }
    // What is happening to it, a line per change.
    std::string line = "no step in flight";
    bool target_in_flight = false;
    if (j != nullptr) {
      for (const auto& f : j->in_flight()) {
        if (o_.step && f.step() != *o_.step) continue;
        target_in_flight = true;
        std::vector<uint32_t> missing(f.missing_ranks().begin(), f.missing_ranks().end());
        line = fmt::format("step {}: {} ({}){}", f.step(), f.state(), f.scope(),
                           missing.empty() ? "" : fmt::format(", waiting for ranks {}", fmt::join(missing, ",")));
        break;
      }
    }
    if (o_.progress && !o_.json && line != last_line) std::cerr << "ckptctl wait: " << line << "\n";
    last_line = line;
    // A step that was in flight and left without committing failed: say why, from ckptd's
    // recent errors.
    if (o_.step && seen_in_flight && !target_in_flight) {
      std::string why = "it left the steps in flight without being committed";
      const std::string tag = fmt::format("[{} s{}]", job, *o_.step);
      for (const auto& e : r.recent_errors()) {
        if (e.find(tag) != std::string::npos || e.find(fmt::format(" s{}] ", *o_.step)) != std::string::npos) why = e;
      }
      return Report(o_, "wait", kError, fmt::format("step {} of job {} failed: {}", *o_.step, job, why));
    }
    seen_in_flight = seen_in_flight || target_in_flight;
    if (deadline && Clock::now() >= *deadline) {
      return Report(o_, "wait", kUnreachable,
                    fmt::format("step {} of job {} not committed within {} s ({})",
                                o_.step ? std::to_string(*o_.step) : "after the latest", job, o_.timeout_s, line));
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    if (grpc::Status s = status(r); !s.ok()) return Failed("wait", s, 10);
  }
}

}  // namespace ckpt::ctl
