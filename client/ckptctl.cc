// ckptctl: the operator's view of ckptd (status, list, show, verify, delete), and export of a
// step's files without a daemon (client/export_command.h).
#include <grpcpp/grpcpp.h>
#include <google/protobuf/util/json_util.h>

#include <CLI/CLI.hpp>
#include <fmt/chrono.h>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cstdlib>
#include <ctime>
#include <cctype>
#include <fstream>
#include <iostream>
#include <optional>
#include <vector>

#include "client/export_command.h"
#include "common/status.h"
#include "format/checkpoint_store.h"
#include "format/verify.h"
#include "proto/format_replies.h"
#include "storage/open_store.h"
#include "client/table.h"
#include "proto/admin.grpc.pb.h"
#include "proto/health.grpc.pb.h"

namespace {

using namespace ::ckptd::v1;

struct Options {
  std::string socket = "/run/ckptd/ckptd.sock";
  std::string addr;
  std::string token_file;
  std::string token;  // read from token_file
  std::string job;
  bool json = false;
  uint64_t step = 0;
  // list and verify straight from the files (no daemon): a root or s3://bucket/prefix.
  std::string root;
  std::string s3_endpoint;
  std::string s3_credentials_file;
  std::string service;  // health: "" (ready), ckptd.v1.Trainer (the same), ckptd.v1.Admin (alive)
  int timeout_s = 5;    // health
};

std::string Bytes(uint64_t n) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double v = static_cast<double>(n);
  int u = 0;
  while (v >= 1024 && u < 4) {
    v /= 1024;
    ++u;
  }
  return u == 0 ? fmt::format("{} B", n) : fmt::format("{:.1f} {}", v, units[u]);
}

std::string Steps(const google::protobuf::RepeatedField<uint64_t>& steps) {
  if (steps.empty()) return "-";
  return fmt::format("{}", fmt::join(steps, ","));
}

std::string Json(const google::protobuf::Message& m) {
  std::string out;
  google::protobuf::util::JsonPrintOptions options;
  options.add_whitespace = true;
  options.always_print_primitive_fields = true;
  options.preserve_proto_field_names = true;
  (void)google::protobuf::util::MessageToJsonString(m, &out, options);
  return out;
}

int Fail(const std::string& what, const grpc::Status& s, const Options& o) {
  std::string where = o.addr.empty() ? o.socket : o.addr;
  if (s.error_code() == grpc::StatusCode::UNAVAILABLE) {
    std::cerr << fmt::format("ckptctl: cannot reach ckptd at {}: {}\n", where, s.error_message());
  } else {
    std::cerr << fmt::format("ckptctl {}: {}\n", what, s.error_message());
  }
  return 1;
}

class Ctl {
 public:
  explicit Ctl(const Options& o) : o_(o) {
    std::string target = o.addr.empty() ? "unix:" + o.socket : o.addr;
    stub_ = Admin::NewStub(grpc::CreateChannel(target, grpc::InsecureChannelCredentials()));
  }

  std::unique_ptr<grpc::ClientContext> Context(int seconds = 30) {
    auto ctx = std::make_unique<grpc::ClientContext>();
    ctx->set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(seconds));
    if (!o_.token.empty()) ctx->AddMetadata("x-ckptd-admin-token", o_.token);
    return ctx;
  }

  // grpc.health.v1 Check, for probes: 0 SERVING, 1 NOT_SERVING (or an unknown service),
  // 2 unreachable or no answer within --timeout.
  int Health() {
    const std::string target = o_.addr.empty() ? "unix:" + o_.socket : o_.addr;
    auto stub = grpc::health::v1::Health::NewStub(grpc::CreateChannel(target, grpc::InsecureChannelCredentials()));
    grpc::health::v1::HealthCheckRequest request;
    request.set_service(o_.service);
    grpc::health::v1::HealthCheckResponse response;
    grpc::Status s = stub->Check(Context(o_.timeout_s).get(), request, &response);
    const std::string what = o_.service.empty() ? "ckptd" : o_.service;
    if (s.error_code() == grpc::StatusCode::UNAVAILABLE || s.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED) {
      std::cerr << fmt::format("ckptctl health: cannot reach ckptd at {} within {} s: {}\n",
                               o_.addr.empty() ? o_.socket : o_.addr, o_.timeout_s, s.error_message());
      return 2;
    }
    if (!s.ok()) {
      std::cerr << fmt::format("ckptctl health: {}: {}\n", what, s.error_message());
      return 1;
    }
    const bool serving = response.status() == grpc::health::v1::HealthCheckResponse::SERVING;
    std::cout << what << ": " << grpc::health::v1::HealthCheckResponse::ServingStatus_Name(response.status())
              << (serving || !o_.service.empty() ? "" : " (ckptctl status says why: the group)") << "\n";
    return serving ? 0 : 1;
  }

  int Status() {
    StatusReply r;
    grpc::Status s = stub_->Status(Context().get(), StatusRequest(), &r);
    if (!s.ok()) return Fail("status", s, o_);
    if (o_.json) {
      std::cout << Json(r) << "\n";
      return 0;
    }
    std::cout << fmt::format("ckptd {}  up {:.1f} s  root {}\n", r.version(), r.uptime_s(), r.root());
    if (!r.remote().empty()) std::cout << fmt::format("remote    {}\n", r.remote());
    std::cout << fmt::format("staging   {} of {} in use{}\n", Bytes(r.staging_bytes_used()),
                             Bytes(r.staging_bytes_total()),
                             r.staging_prefaulted() ? "" : " (still being pre-faulted)");
    std::cout << fmt::format(
        "counters  staged {}  rejected {}  committed {}  failed {}  persisted {}\n\n",
        r.snapshots_staged(), r.snapshots_rejected(), r.checkpoints_committed(),
        r.checkpoints_failed(), Bytes(r.bytes_persisted()));
    ckpt::Table sessions({"JOB", "RANK", "PID", "TENSORS", "BYTES", "STAGED", "COMMITTED", "ALIVE"});
    for (const auto& x : r.sessions()) {
      sessions.Add({x.job(), fmt::format("{}/{}", x.rank(), x.world_size()), std::to_string(x.pid()),
                    std::to_string(x.tensors()), Bytes(x.bytes()), std::to_string(x.last_staged_step()),
                    std::to_string(x.last_committed_step()), x.trainer_alive() ? "yes" : "no"});
    }
    std::cout << "SESSIONS\n" << (r.sessions().empty() ? "(none)\n" : sessions.Render()) << "\n";
    if (r.group().enabled()) PrintGroup(r.group());
    ckpt::Table jobs({"JOB", "LATEST", "GLOBAL", "REMOTE", "PENDING", "IN MEMORY"});
    for (const auto& j : r.jobs()) {
      jobs.Add({j.job(), j.has_committed() ? std::to_string(j.latest_committed_step()) : "-",
                j.has_global() ? std::to_string(j.latest_global_step()) : "-",
                j.has_remote() ? std::to_string(j.latest_remote_step()) : "-",
                Steps(j.pending_steps()), Steps(j.hot_steps())});
    }
    std::cout << "JOBS\n" << (r.jobs().empty() ? "(none)\n" : jobs.Render());
    ckpt::Table flight({"JOB", "STEP", "STATE", "SCOPE", "AGE", "MISSING RANKS"});
    for (const auto& j : r.jobs()) {
      for (const auto& f : j.in_flight()) {
        std::vector<uint32_t> missing(f.missing_ranks().begin(), f.missing_ranks().end());
        flight.Add({j.job(), std::to_string(f.step()), f.state(), f.scope(),
                    fmt::format("{:.1f} s", f.age_s()),
                    missing.empty() ? "-" : fmt::format("{}", fmt::join(missing, ","))});
      }
    }
    if (!flight.empty()) std::cout << "\nSTEPS IN FLIGHT\n" << flight.Render();
    ckpt::Table uploads({"JOB", "STEP", "STATE", "DONE", "AGE", "LAST ERROR"});
    for (const auto& j : r.jobs()) {
      for (const auto& u : j.uploads()) {
        uploads.Add({j.job(), std::to_string(u.step()), u.state(),
                     fmt::format("{} of {}", Bytes(u.bytes_done()), Bytes(u.bytes_total())),
                     fmt::format("{:.1f} s", u.age_s()), u.last_error().empty() ? "-" : u.last_error()});
      }
    }
    if (!uploads.empty()) std::cout << "\nUPLOADS\n" << uploads.Render();
    if (!r.recent_errors().empty()) {
      std::cout << "\nRECENT ERRORS\n";
      for (const auto& e : r.recent_errors()) std::cout << "  " << e << "\n";
    }
    return 0;
  }

  static void PrintGroup(const ckptd::v1::GroupStatus& g) {
    std::cout << fmt::format("group     node {} of {}  listening on {}  coordinator {}  {}{}\n",
                             g.node_rank(), g.num_nodes(), g.address(), g.coordinator(),
                             g.joined() ? "joined" : "NOT JOINED", g.tls() ? "  (TLS)" : "");
    if (!g.last_error().empty()) std::cout << "          last error: " << g.last_error() << "\n";
    ckpt::Table members({"NODE", "ADDRESS", "STATE", "LAST HEARTBEAT"});
    for (const auto& m : g.members()) {
      members.Add({std::to_string(m.node_rank()), m.address().empty() ? "-" : m.address(),
                   m.state(),
                   m.last_heartbeat_age_s() < 0 ? "never"
                                                : fmt::format("{:.1f} s ago", m.last_heartbeat_age_s())});
    }
    std::cout << "MEMBERS\n" << (g.members().empty() ? "(not heard from the coordinator)\n"
                                                        : members.Render())
              << "\n";
  }

  int List() {
    ListRequest req;
    req.set_job(o_.job);
    ListReply r;
    grpc::Status s = stub_->List(Context().get(), req, &r);
    if (!s.ok()) return Fail("list", s, o_);
    return PrintList(r, o_);
  }

  // --job may be left out when the daemon holds exactly one job.
  std::optional<std::string> Job() {
    if (!o_.job.empty()) return o_.job;
    ListReply r;
    grpc::Status s = stub_->List(Context().get(), ListRequest(), &r);
    if (!s.ok()) {
      Fail("list", s, o_);
      return std::nullopt;
    }
    std::set<std::string> jobs;
    for (const auto& c : r.checkpoints()) jobs.insert(c.job());
    if (jobs.size() == 1) return *jobs.begin();
    std::cerr << (jobs.empty() ? "ckptctl: no checkpoints exist\n"
                               : fmt::format("ckptctl: several jobs ({}); pass --job\n",
                                             fmt::join(jobs, ", ")));
    return std::nullopt;
  }

  // The checkpoint that show/verify/delete name: --job (or the only job) and STEP.
  std::optional<CheckpointRef> Ref() {
    auto job = Job();
    if (!job) return std::nullopt;
    CheckpointRef ref;
    ref.set_job(*job);
    ref.set_step(o_.step);
    return ref;
  }

  int Show() {
    auto ref = Ref();
    if (!ref) return 1;
    ShowReply r;
    grpc::Status s = stub_->Show(Context().get(), *ref, &r);
    if (!s.ok()) return Fail("show", s, o_);
    std::cout << r.manifest_json() << "\n";
    return 0;
  }

  int Verify() {
    auto ref = Ref();
    if (!ref) return 1;
    const std::string& job = ref->job();
    VerifyReply r;
    grpc::Status s = stub_->Verify(Context(3600).get(), *ref, &r);
    if (!s.ok()) return Fail("verify", s, o_);
    return PrintVerify(r, job, o_);
  }

  static int PrintVerify(const VerifyReply& r, const std::string& job, const Options& o_) {
    if (o_.json) {
      std::cout << Json(r) << "\n";
    } else if (r.ok()) {
      std::cout << fmt::format("step {} of job {}: OK ({} checked)\n", o_.step, job,
                               Bytes(r.bytes_checked()));
      if (!r.skipped_ranks().empty()) {
        std::vector<uint32_t> skipped(r.skipped_ranks().begin(), r.skipped_ranks().end());
        std::cout << fmt::format("  ranks {} are held by other nodes: verify them there\n",
                                 fmt::join(skipped, ","));
      }
    } else {
      std::cout << fmt::format("step {} of job {}: DAMAGED\n", o_.step, job);
      for (const auto& p : r.problems()) std::cout << "  " << p << "\n";
    }
    return r.ok() ? 0 : 3;
  }

  static int PrintList(const ListReply& r, const Options& o) {
    if (o.json) {
      std::cout << Json(r) << "\n";
      const bool unreadable = std::any_of(r.checkpoints().begin(), r.checkpoints().end(),
                                          [](const auto& c) { return !c.error().empty(); });
      return unreadable || !r.errors().empty() ? 3 : 0;  // the same exit code as the table's
    }
    ckpt::Table t({"JOB", "STEP", "RANKS", "TENSORS", "SIZE", "WRITTEN (UTC)", "WHERE", "KIND"});
    std::vector<std::string> errors;
    for (const auto& c : r.checkpoints()) {
      if (!c.error().empty()) {
        t.Add({c.job(), std::to_string(c.step()), "?", "?", "?", "UNREADABLE (below)",
               fmt::format("{}", fmt::join(c.tiers(), ",")), "?"});
        errors.push_back(fmt::format("step {} of job {}: {}", c.step(), c.job(), c.error()));
        continue;
      }
      t.Add({c.job(), std::to_string(c.step()), std::to_string(c.world_size()),
             std::to_string(c.tensors()), Bytes(c.bytes()),
             fmt::format("{:%Y-%m-%d %H:%M:%S}", fmt::gmtime(static_cast<std::time_t>(c.unix_time()))),
             fmt::format("{}", fmt::join(c.tiers(), ",")),
             c.flags().empty() ? "full" : fmt::format("{}", fmt::join(c.flags(), ","))});
    }
    std::cout << (r.checkpoints().empty() ? "no checkpoints\n" : t.Render());
    for (const std::string& e : errors) std::cout << "  " << e << "\n";
    for (const std::string& e : r.errors()) std::cout << "  " << e << "\n";
    return errors.empty() && r.errors().empty() ? 0 : 3;
  }

  int Delete() {
    auto ref = Ref();
    if (!ref) return 1;
    const std::string& job = ref->job();
    DeleteReply r;
    grpc::Status s = stub_->Delete(Context().get(), *ref, &r);
    if (!s.ok()) return Fail("delete", s, o_);
    if (o_.json) {
      std::cout << fmt::format("{{\"deleted\": {{\"job\": \"{}\", \"step\": {}}}}}\n", job, o_.step);
    } else {
      std::cout << fmt::format("deleted step {} of job {}\n", o_.step, job);
    }
    return 0;
  }

 private:
  const Options& o_;
  std::unique_ptr<Admin::Stub> stub_;
};

}  // namespace

// list and verify from the files alone (a root on disk, or an object store): what the
// daemon's admin service answers, computed here, printed the same way.
int Offline(const Options& o, bool list) {
  auto objects = ckpt::storage::OpenStore(o.root, ckpt::MakePosixFilesystem(),
                                          {o.s3_endpoint, o.s3_credentials_file});
  if (!objects.ok()) {
    std::cerr << "ckptctl: " << ckpt::Message(objects.status()) << "\n";
    return 2;
  }
  ckpt::format::CheckpointStore store(*objects, o.root);
  if (list) {
    auto listed = ckpt::format::ListCheckpoints(store, o.job);
    if (!listed.ok()) {
      std::cerr << "ckptctl list: " << ckpt::Message(listed.status()) << "\n";
      return 4;
    }
    ListReply r;
    for (const auto& c : *listed) {
      auto* info = r.add_checkpoints();
      ckpt::ToProto(c, info);
      info->add_tiers(ckpt::storage::IsS3Url(o.root) ? "remote" : "local");
    }
    return Ctl::PrintList(r, o);
  }
  std::string job = o.job;
  if (job.empty()) {
    auto jobs = store.ListJobs();
    if (!jobs.ok() || jobs->size() != 1) {
      std::cerr << "ckptctl verify: pass --job (" << (jobs.ok() ? std::to_string(jobs->size()) : ckpt::Message(jobs.status()))
                << " jobs under " << o.root << ")\n";
      return 1;
    }
    job = jobs->front();
  }
  auto report = ckpt::format::VerifyCheckpoint(store, job, o.step);
  if (!report.ok()) {
    std::cerr << "ckptctl verify: " << ckpt::Message(report.status()) << "\n";
    return absl::IsNotFound(report.status()) ? 1 : 4;
  }
  VerifyReply r;
  ckpt::ToProto(*report, &r);
  return Ctl::PrintVerify(r, job, o);
}

int main(int argc, char** argv) {
  Options o;
  if (const char* env = std::getenv("CKPTD_SOCKET")) o.socket = env;
  CLI::App app{"ckptctl: inspect and manage ckptd checkpoints"};
  app.require_subcommand(1);
  app.add_option("--socket", o.socket, "ckptd Unix socket (env CKPTD_SOCKET)")->capture_default_str();
  app.add_option("--addr", o.addr, "ckptd admin HOST:PORT instead of the socket");
  app.add_option("--token-file", o.token_file,
                 "file holding the admin token (delete over --addr; env CKPTD_ADMIN_TOKEN_FILE)")
      ->envname("CKPTD_ADMIN_TOKEN_FILE");
  app.add_option("--job", o.job, "job name (optional when only one job exists)");
  app.add_flag("--json", o.json, "machine-readable output");
  auto* status = app.add_subcommand("status", "what the daemon is doing");
  auto* list = app.add_subcommand("list", "committed checkpoints");
  auto* show = app.add_subcommand("show", "print a checkpoint's manifest");
  auto* verify = app.add_subcommand("verify", "re-read a checkpoint and check every checksum");
  auto* del = app.add_subcommand("delete", "delete a committed checkpoint");
  auto* health = app.add_subcommand(
      "health", "is ckptd ready (exit 0), not ready (1: not joined to its group, or a member lost), "
                "or unreachable (2)? For probes");
  health->add_option("--service", o.service,
                     "\"\" (ready), ckptd.v1.Trainer (the same), ckptd.v1.Admin (alive: serving at all)");
  health->add_option("--timeout", o.timeout_s, "seconds to wait for an answer")->capture_default_str();
  health->fallthrough();
  for (auto* sub : {show, verify, del}) sub->add_option("STEP", o.step, "step number")->required();
  for (auto* sub : {status, list, show, verify, del}) sub->fallthrough();
  for (auto* sub : {list, verify}) {
    sub->add_option("--root", o.root, "read a checkpoint root, or s3://bucket/prefix, directly "
                    "(no daemon)");
    sub->add_option("--s3-endpoint", o.s3_endpoint,
                    "S3 endpoint URL (default AWS_ENDPOINT_URL_S3, AWS_ENDPOINT_URL, else AWS)");
    sub->add_option("--s3-credentials-file", o.s3_credentials_file,
                    "S3 keys in the AWS credentials-file format, mode 0600");
  }
  ckpt::ctl::ExportArgs e;
  if (const char* env = std::getenv("CKPTD_ROOT")) e.root = env;
  auto* exp = app.add_subcommand("export", "write a step as Hugging Face / safetensors files, from its files alone");
  exp->fallthrough();
  exp->add_option("STEP", e.step, "step number")->required();
  exp->add_option("OUT", e.out, "folder (hf, full) or file (safetensors) to create")->required();
  exp->add_option("--root", e.root, "ckptd's checkpoint root, or s3://bucket/prefix (env CKPTD_ROOT)")
      ->capture_default_str();
  exp->add_option("--s3-endpoint", e.s3_endpoint,
                  "S3 endpoint URL (default AWS_ENDPOINT_URL_S3, AWS_ENDPOINT_URL, else AWS)");
  exp->add_option("--s3-credentials-file", e.s3_credentials_file,
                  "S3 keys in the AWS credentials-file format, mode 0600 (default: the AWS "
                  "environment variables, then ~/.aws/credentials)");
  exp->add_option("--format", e.format, "hf: sharded safetensors + index; safetensors: one file; "
                  "full: everything, optimizer and train state included")
      ->check(CLI::IsMember({"hf", "safetensors", "full"}))->capture_default_str();
  exp->add_option("--max-shard-size", e.max_shard_size, "hf: largest file (5GB, 500MB, 2GiB)")->capture_default_str();
  exp->add_option("--buffer-size", e.buffer_size, "memory for tensor data: read, converted and "
                  "written this much at a time")->capture_default_str();
  exp->add_option("--dtype", e.dtype, "convert floating-point tensors: bf16, fp16 or fp32");
  exp->add_option("--rename", e.rename_file, "JSON file of \"old\": \"new\" names (\"prefix.*\" rules too)");
  exp->add_option("--include", e.include, "only tensors matching these shell patterns");
  exp->add_option("--exclude", e.exclude, "leave out tensors matching these shell patterns");
  exp->add_option("--with", e.with, "copy these files into the folder (a model's config.json, "
                  "tokenizer files)");
  bool no_progress = false;
  exp->add_flag("--no-progress", no_progress, "no progress bar on a terminal");
  CLI11_PARSE(app, argc, argv);
  if (exp->parsed()) {
    e.job = o.job;
    e.json = o.json;
    e.progress = !no_progress;
    return ckpt::ctl::RunExport(e);
  }
  if (!o.token_file.empty()) {
    std::ifstream in(o.token_file);
    if (!in || !std::getline(in, o.token)) {
      std::cerr << fmt::format("ckptctl: cannot read --token-file {}\n", o.token_file);
      return 2;
    }
    while (!o.token.empty() && std::isspace(static_cast<unsigned char>(o.token.back()))) {
      o.token.pop_back();
    }
  }
  if (!o.root.empty() && (list->parsed() || verify->parsed())) return Offline(o, list->parsed());
  if (!o.root.empty()) {
    std::cerr << "ckptctl: --root reads files without ckptd: only list, verify and export take it\n";
    return 2;
  }
  Ctl ctl(o);
  if (health->parsed()) return ctl.Health();
  if (status->parsed()) return ctl.Status();
  if (list->parsed()) return ctl.List();
  if (show->parsed()) return ctl.Show();
  if (verify->parsed()) return ctl.Verify();
  return ctl.Delete();
}
