// Faults of the environment are errors, never signals (issue 9): a second daemon on a root
// that one already uses; and a container's small /dev/shm, which no longer limits what
// trainers register (arenas and control blocks are memfds, not /dev/shm files).
#include <catch2/catch.hpp>

#include <fmt/format.h>

#include <fstream>
#include <sstream>

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

TEST_CASE("a trainer that reaches ckptd's socket directory under another path registers, saves and restores") {
  // A container's volume: ckptd serves /inside/ckptd.sock in its own mount namespace, where
  // /inside is the trainer's /outside (a bind mount, like a volume mounted at another path,
  // or a trainer on the host beside ckptd in a container). The trainer must reach everything
  // through the socket it was given, never through the paths ckptd sees.
  TempDir dir;
  TempDir outside("/tmp");
  TempDir inside("/tmp");
  std::string helper = Runfile("tests/integration/trainer_helper");
  std::string script = fmt::format(R"sh(
/usr/bin/unshare -m /bin/sh -c 'mount --bind {outside} {inside} && exec {ckptd} --root {root} --socket {inside}/ckptd.sock --staging-bytes 64M' > {log} 2>&1 &
daemon=$!
for i in $(seq 300); do [ -S {outside}/ckptd.sock ] && break; sleep 0.1; done
echo "inside-empty=$(ls {inside} | wc -l)"
{helper} --socket {outside}/ckptd.sock --job moved --bytes 4000000 save --step 3 --wait-committed; echo "save=$?"
{helper} --socket {outside}/ckptd.sock --job moved --bytes 4000000 check --step 3; echo "check=$?"
kill -TERM $daemon; wait $daemon; echo "daemon=$?"
)sh",
                                   fmt::arg("ckptd", Runfile("daemon/ckptd")), fmt::arg("root", dir / "root"),
                                   fmt::arg("outside", outside.path()), fmt::arg("inside", inside.path()),
                                   fmt::arg("log", dir / "ckptd.log"), fmt::arg("helper", helper));
  auto r = Run({"/bin/sh", "-c", script}, dir.path(), std::chrono::seconds(120));
  std::stringstream log;
  log << std::ifstream(dir / "ckptd.log").rdbuf();
  INFO(r.out << r.err << log.str());
  REQUIRE(r.exit_code == 0);
  CHECK(Contains(r.out, "inside-empty=0"));  // the trainer's view of ckptd's path holds nothing
  CHECK(Contains(r.out, "save=0"));
  CHECK(Contains(r.out, "check=0"));
  CHECK(Contains(r.out, "daemon=0"));
}
