// A real Ceph cluster with an S3 gateway (tools/ceph.sh) for the tests that need an object
// store: started once per test binary, the first time a test asks for it, and stopped when
// the binary exits. Not a fake: a test that cannot start it fails, naming why.
#pragma once

#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <fstream>
#include <map>
#include <string>

#include <catch2/catch.hpp>
#include <fmt/format.h>

#include "storage/s3_config.h"
#include "tests/fakes/temp_dir.h"

namespace ckpt::testing {

class CephCluster {
 public:
  static CephCluster& Get() {
    static CephCluster cluster;
    return cluster;
  }

  // The bucket's options: endpoint, keys, path-style addressing.
  storage::S3Options Options() const {
    storage::S3Options o;
    o.bucket = env_.at("CKPTD_TEST_BUCKET");
    o.endpoint = env_.at("AWS_ENDPOINT_URL_S3");
    o.region = env_.at("AWS_REGION");
    o.credentials.access_key = env_.at("AWS_ACCESS_KEY_ID");
    o.credentials.secret_key = env_.at("AWS_SECRET_ACCESS_KEY");
    return o;
  }
  const std::map<std::string, std::string>& env() const { return env_; }
  // A prefix no other case of this binary uses.
  std::string FreshPrefix() { return "case-" + std::to_string(++cases_); }

  // A signed request to the gateway with curl (what no Store call makes: listing unfinished
  // multipart uploads, beginning one as a killed writer would leave it): the answer's body.
  std::string Curl(const std::string& method, const std::string& path_and_query) {
    const std::string out = dir_.path() + "/curl.out";
    const std::string command = fmt::format(
        "/usr/bin/curl -sS --fail -X {} --aws-sigv4 aws:amz:{}:s3 --user '{}:{}' -H "
        "'x-amz-content-sha256: UNSIGNED-PAYLOAD' '{}/{}{}' >{} 2>&1",
        method, env_.at("AWS_REGION"), env_.at("AWS_ACCESS_KEY_ID"), env_.at("AWS_SECRET_ACCESS_KEY"),
        env_.at("AWS_ENDPOINT_URL_S3"), env_.at("CKPTD_TEST_BUCKET"), path_and_query, out);
    const int rc = std::system(command.c_str());
    std::ifstream in(out);
    std::string body((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    if (rc != 0) FAIL("curl -X " << method << " " << path_and_query << " failed: " << body);
    return body;
  }
  // The multipart uploads begun and neither completed nor aborted under `prefix`/: the
  // answer's XML (one <UploadId> each).
  std::string UnfinishedUploads(const std::string& prefix) {
    return Curl("GET", "?prefix=" + prefix + "%2F&uploads=");
  }

  // A CephFS of the same cluster, mounted with ceph-fuse (tools/ceph.sh fs), the first time
  // a test asks: its mount point.
  const std::string& FileSystem() {
    if (!cephfs_.empty()) return cephfs_;
    std::string output;
    if (int rc = Script("fs", &output); rc != 0) {
      FAIL("could not add CephFS with tools/ceph.sh fs (exit " << rc << "):\n" << output);
    }
    cephfs_ = dir_.path() + "/ceph/cephfs";  // where tools/ceph.sh fs mounts it
    return cephfs_;
  }

  ~CephCluster() { (void)std::system((script_ + " stop " + dir_.path() + "/ceph >/dev/null 2>&1").c_str()); }

 private:
  CephCluster() {
    const char* srcdir = std::getenv("TEST_SRCDIR");
    const char* workspace = std::getenv("TEST_WORKSPACE");
    script_ = srcdir && workspace ? std::string(srcdir) + "/" + workspace + "/tools/ceph.sh" : "tools/ceph.sh";
    std::string output;
    const int rc = Script("start", &output);
    std::ifstream env(dir_.path() + "/ceph/s3.env");
    std::string line;
    while (std::getline(env, line)) {
      if (auto eq = line.find('='); eq != std::string::npos) env_[line.substr(0, eq)] = line.substr(eq + 1);
    }
    if (rc != 0 || env_.size() < 5) {
      FAIL("could not start a Ceph cluster with tools/ceph.sh (exit " << rc << "):\n" << output);
    }
  }

  // Runs `tools/ceph.sh COMMAND <dir>/ceph`; its exit code, and what it printed in `output`.
  int Script(const std::string& command, std::string* output) {
    const std::string log = dir_.path() + "/ceph-" + command + ".log";
    const int rc = std::system((script_ + " " + command + " " + dir_.path() + "/ceph >" + log + " 2>&1").c_str());
    std::ifstream in(log);
    output->assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
    return rc;
  }

  TempDir dir_{"/tmp"};
  std::string script_;
  std::map<std::string, std::string> env_;
  std::atomic<int> cases_{0};
  std::string cephfs_;
};

}  // namespace ckpt::testing
