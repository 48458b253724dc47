// ckptctl: the operator's view of ckptd (status, health, list, show, verify, delete, wait:
// client/ctl_commands.h), and export of a step's files without a daemon
// (client/export_command.h). Exit codes: client/ctl_exit.h.
#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <optional>
#include <string>

#include "client/ctl_commands.h"
#include "client/ctl_exit.h"
#include "client/export_command.h"
#include "common/status.h"
#include "format/checkpoint_store.h"
#include "format/verify.h"
#include "proto/format_replies.h"
#include "storage/open_store.h"

namespace {

using namespace ::ckptd::v1;
using namespace ::ckpt::ctl;

constexpr char kVersion[] = "0.1.0";

// list and verify from the files alone (a root on disk, or an object store): what the
// daemon's admin service answers, computed here, printed the same way.
int Offline(const Options& o, bool list) {
  const std::string command = list ? "list" : "verify";
  // A root that is not there holds no checkpoints; saying "no checkpoints" would hide a typo.
  std::error_code ec;
  if (!ckpt::storage::IsS3Url(o.root) && !std::filesystem::is_directory(o.root, ec)) {
    return Report(o, command, kError,
                  fmt::format("--root {}: {}", o.root,
                              std::filesystem::exists(o.root, ec) ? "not a directory" : "no such directory"));
  }
  auto objects = ckpt::storage::OpenStore(o.root, ckpt::MakePosixFilesystem(),
                                          {o.s3_endpoint, o.s3_credentials_file});
  if (!objects.ok()) return Report(o, command, ExitFor(objects.status()), ckpt::Message(objects.status()));
  ckpt::format::CheckpointStore store(*objects, o.root);
  if (list) {
    auto listed = ckpt::format::ListCheckpoints(store, o.job);
    if (!listed.ok()) return Report(o, command, ExitFor(listed.status()), ckpt::Message(listed.status()));
    ListReply r;
    for (const auto& c : *listed) {
      auto* info = r.add_checkpoints();
      ckpt::ToProto(c, info);
      info->add_tiers(ckpt::storage::IsS3Url(o.root) ? "remote" : "local");
    }
    return Commands::PrintList(r, o);
  }
  std::string job = o.job;
  if (job.empty()) {
    auto jobs = store.ListJobs();
    if (!jobs.ok() || jobs->size() != 1) {
      return Report(o, command, kError,
                    fmt::format("pass --job ({} jobs under {})",
                                jobs.ok() ? std::to_string(jobs->size()) : ckpt::Message(jobs.status()), o.root));
    }
    job = jobs->front();
  }
  std::optional<ckpt::ctl::ProgressBar> bar = Commands::VerifyProgress(o);
  ckpt::format::VerifyOptions options;
  if (bar) {
    options.progress = [&](uint64_t checked, uint64_t total) {
      bar->Update(checked, total);
      return true;
    };
  }
  auto report = ckpt::format::VerifyCheckpoint(store, job, *o.step, options);
  if (!report.ok()) return Report(o, command, ExitFor(report.status()), ckpt::Message(report.status()));
  VerifyReply r;
  ckpt::ToProto(*report, &r);
  return Commands::PrintVerify(r, job, *o.step, o);
}

// A step number as a checkpoint directory names it: digits only (CLI11 would read -5 as
// 18446744073709551611).
const CLI::Validator kStepNumber(
    [](std::string& text) -> std::string {
      if (text.empty() || text.size() > 20 || text.find_first_not_of("0123456789") != std::string::npos) {
        return "a step is a number 0 or more, not \"" + text + "\"";
      }
      return "";
    },
    "STEP");

// A number of seconds, named in the message (CLI11's ranges print the largest double).
CLI::Validator Seconds(bool zero_allowed) {
  return CLI::Validator(
      [zero_allowed](std::string& text) -> std::string {
        char* end = nullptr;
        const double v = std::strtod(text.c_str(), &end);
        if (text.empty() || *end != '\0' || !std::isfinite(v) || v < 0 || (v == 0 && !zero_allowed)) {
          return fmt::format("seconds, a number {} 0, not \"{}\"", zero_allowed ? "of at least" : "greater than",
                             text);
        }
        return "";
      },
      zero_allowed ? "SECONDS>=0" : "SECONDS>0");
}

// The options every command takes, on the command line before or after the command, so
// that each command's --help lists them too.
void AddCommonOptions(CLI::App* app, Options& o) {
  app->add_option("--socket", o.socket, "ckptd Unix socket (env CKPTD_SOCKET)")->capture_default_str();
  app->add_option("--addr", o.addr, "ckptd admin HOST:PORT instead of the socket");
  app->add_option("--token-file", o.token_file,
                  "file holding the admin token (delete over --addr; env CKPTD_ADMIN_TOKEN_FILE)")
      ->envname("CKPTD_ADMIN_TOKEN_FILE");
  app->add_option("--job", o.job, "job name (optional when only one job exists)");
  app->add_flag("--json", o.json, "machine-readable output; errors as {\"error\": ...} on stdout");
  app->add_option("--dial-timeout", o.dial_timeout_s, "seconds to wait for a connection to ckptd")
      ->check(Seconds(/*zero_allowed=*/false))
      ->capture_default_str();
  app->add_option("--timeout", o.timeout_s,
                  "seconds a call may take (default: 30; verify 3600; wait: no limit)")
      ->check(Seconds(/*zero_allowed=*/true));
}

// Where list, verify and export read files without a daemon; also before the command
// (`ckptctl --root R list`), as every other option may be.
void AddRootOptions(CLI::App* app, Options& o) {
  app->add_option("--root", o.root, "read a checkpoint root, or s3://bucket/prefix, directly "
                  "(no daemon)");
  app->add_option("--s3-endpoint", o.s3_endpoint,
                  "S3 endpoint URL (default AWS_ENDPOINT_URL_S3, AWS_ENDPOINT_URL, else AWS)");
  app->add_option("--s3-credentials-file", o.s3_credentials_file,
                  "S3 keys in the AWS credentials-file format, mode 0600");
}

// A usage error as the rest of the output is: {"error": ...} on stdout under --json (looked
// for in argv: the parse that failed may not have reached it), else CLI11's text.
int UsageError(CLI::App& app, const CLI::ParseError& e, int argc, char** argv) {
  bool json = false;
  for (int i = 1; i < argc; ++i) json = json || std::string(argv[i]) == "--json";
  if (!json || e.get_exit_code() == 0) {
    const int code = app.exit(e);  // --help and --version succeed
    return code == 0 ? kOk : kUsage;
  }
  Options o;
  o.json = true;
  return Report(o, "ckptctl", kUsage, std::string(e.what()) + " (ckptctl --help lists the options)");
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  if (const char* env = std::getenv("CKPTD_SOCKET")) o.socket = env;
  CLI::App app{"ckptctl: inspect and manage ckptd checkpoints\n"
               "exit codes: 0 ok, 1 error, 2 ckptd unreachable or timed out, 3 damaged data, 64 usage"};
  app.require_subcommand(1);
  app.set_version_flag("--version", kVersion);
  AddCommonOptions(&app, o);
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

  auto* wait = app.add_subcommand(
      "wait", "wait until STEP of --job (or, without STEP, its next step) is committed: 0 committed, 1 "
              "failed, 2 not within --timeout; a line per change on stderr");
  wait->add_option("STEP", o.step, "step number")->check(kStepNumber);
  bool quiet = false;
  wait->add_flag("--quiet", quiet, "no progress lines");
  wait->add_flag("--ready", o.ready,
                 "wait instead until ckptd is there and ready (joined to its group): 0 ready, 2 not within "
                 "--timeout (scripts that start daemons and trainers together)");
  bool no_verify_progress = false;
  verify->add_flag("--no-progress", no_verify_progress, "no progress bar on a terminal");
  verify->add_flag("--progress", o.progress_lines, "progress lines on stderr even when it is not a terminal");
  for (auto* sub : {show, verify, del}) {
    sub->add_option("STEP", o.step, "step number")->required()->check(kStepNumber);
  }
  AddRootOptions(&app, o);
  for (auto* sub : {list, verify}) AddRootOptions(sub, o);
  ckpt::ctl::ExportArgs e;
  if (const char* env = std::getenv("CKPTD_ROOT")) e.root = env;
  auto* exp = app.add_subcommand("export", "write a step as Hugging Face / safetensors files, from its files alone");
  exp->fallthrough();
  exp->add_option("STEP", e.step, "step number")->required()->check(kStepNumber);
  exp->add_option("OUT", e.out, "folder (hf, full) or file (safetensors) to create")->required();
  auto* export_root = exp->add_option("--root", e.root,
                                      "ckptd's checkpoint root, or s3://bucket/prefix (default: the root of "
                                      "the ckptd at --socket, else CKPTD_ROOT, else /var/lib/ckptd)");
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
  for (auto* sub : {status, health, list, show, verify, del, wait, exp}) {
    AddCommonOptions(sub, o);
    sub->fallthrough();
  }
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return UsageError(app, e, argc, argv);  // the command line's fault (EX_USAGE)
  }
  if (exp->parsed()) {
    // --root and the S3 options before the command are export's too.
    if (export_root->count() == 0 && !o.root.empty()) e.root = o.root;
    if (e.s3_endpoint.empty()) e.s3_endpoint = o.s3_endpoint;
    if (e.s3_credentials_file.empty()) e.s3_credentials_file = o.s3_credentials_file;
    // The root of the daemon the command line names (--socket), unless one was given.
    if (export_root->count() == 0 && o.root.empty() && std::getenv("CKPTD_ROOT") == nullptr) {
      o.dial_timeout_s = std::min(o.dial_timeout_s, 1.0);
      if (std::optional<std::string> root = Commands(o).Root()) e.root = *root;
    }
    e.job = o.job;
    e.json = o.json;
    e.progress = !no_progress;
    return ckpt::ctl::RunExport(e);
  }
  if (!o.token_file.empty()) {
    std::ifstream in(o.token_file);
    if (!in || !std::getline(in, o.token)) {
      return Report(o, "ckptctl", kError, fmt::format("cannot read --token-file {}", o.token_file));
    }
    while (!o.token.empty() && std::isspace(static_cast<unsigned char>(o.token.back()))) {
      o.token.pop_back();
    }
  }
  o.progress = !quiet && !no_verify_progress;
  if (!o.root.empty() && (list->parsed() || verify->parsed())) return Offline(o, list->parsed());
  if (!o.root.empty()) {
    return Report(o, app.get_subcommands().front()->get_name(), kUsage,
                  "--root reads files without ckptd: only list, verify and export take it");
  }
  Commands ctl(o);
  if (wait->parsed() && o.ready) {
    if (o.step) return Report(o, "wait", kUsage, "wait --ready takes no STEP");
    return ctl.WaitReady();
  }
  if (wait->parsed()) return ctl.Wait();
  if (health->parsed()) return ctl.Health();
  if (status->parsed()) return ctl.Status();
  if (list->parsed()) return ctl.List();
  if (show->parsed()) return ctl.Show();
  if (verify->parsed()) return ctl.Verify();
  return ctl.Delete();
}
