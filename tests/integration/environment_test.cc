// Faults of the environment are errors, never signals (issue 9): a second daemon on a root
// that one already uses; and a container's small /dev/shm, which no longer limits what
// trainers register (arenas and control blocks are memfds, not /dev/shm files).
#include <catch2/catch.hpp>

#include <fmt/format.h>

#include "tests/integration/common.h"

using namespace ckpt::testing;

TEST_CASE("a second daemon on the same root refuses to start, naming the first") {
  TempDir dir;
  Daemon first(dir);
  first.Start();
  TempDir socket_dir("/tmp");
  auto second = Run({Runfile("daemon/ckptd"), "--root", first.root(), "--socket",
                     socket_dir / "second.sock", "--staging-bytes", "64M"},
                    dir.path(), std::chrono::seconds(30));
  CHECK(second.exit_code != 0);
  CHECK(Contains(second.err + second.out, "another ckptd (pid"));
  CHECK(Contains(second.err + second.out, "--root " + first.root()));
  // The first one is untouched and keeps serving.
  CHECK(first.Ctl({"status"}).exit_code == 0);
  CHECK(first.Stop() == 0);
  // Once it is gone the root is free again.
  Daemon again(dir);
  again.Start();
  CHECK(again.Ctl({"status"}).exit_code == 0);
}

TEST_CASE("a /dev/shm smaller than what trainers register does not limit them") {
  TempDir dir;
  TempDir socket_dir("/tmp");
  std::string socket = socket_dir / "ckptd.sock";
  std::string helper = Runfile("tests/integration/trainer_helper");
  // A private mount namespace with a 96 MiB /dev/shm, like a small container's.
  std::string script = fmt::format(R"sh(
mount -t tmpfs -o size=96m tmpfs /dev/shm || {{ echo "cannot mount a tmpfs"; exit 70; }}
{ckptd} --root {root} --socket {socket} --staging-bytes 256M > {log} 2>&1 &
daemon=$!
for i in $(seq 100); do [ -S {socket} ] && break; sleep 0.1; done
{helper} --socket {socket} --job small --bytes 4000000 save --step 1 --wait-committed; echo "small=$?"
{helper} --socket {socket} --job big --bytes 200000000 save --step 1 --wait-committed; echo "big=$?"
{ctl} --socket {socket} list; echo "list=$?"
echo "in-dev-shm=$(ls /dev/shm | wc -l)"
kill -TERM $daemon; wait $daemon; echo "daemon=$?"
)sh",
                                   fmt::arg("ckptd", Runfile("daemon/ckptd")),
                                   fmt::arg("root", dir / "root"), fmt::arg("socket", socket),
                                   fmt::arg("log", dir / "ckptd.log"), fmt::arg("helper", helper),
                                   fmt::arg("ctl", Runfile("client/ckptctl")));
  auto r = Run({"/usr/bin/unshare", "-m", "/bin/sh", "-c", script}, dir.path(), std::chrono::seconds(90));
  INFO(r.out << r.err);
  REQUIRE(r.exit_code == 0);  // the test runs as root, like the rest of the suite
  CHECK(Contains(r.out, "small=0"));
  CHECK(Contains(r.out, "big=0"));  // 200 MB of arenas beside a 96 MiB /dev/shm
  CHECK(Contains(r.out, "list=0"));
  CHECK(Contains(r.out, "small"));
  CHECK(Contains(r.out, "big"));
  CHECK(Contains(r.out, "in-dev-shm=0"));  // nothing of ckptd's or the trainers' is there
  CHECK(Contains(r.out, "daemon=0"));
}
