// How fast fragments move between daemons (issue 25): the Replicas gRPC service
// (daemon/replicate/replica_service.h) on loopback, putting and getting fragments of
// --mib MiB on --streams connections at once (as a node sends to its holders, or a
// replacement fetches k fragments), against the machine's limit measured the same way in
// the same run: plain TCP on loopback, the same bytes, one connection per stream. Each figure is the best of --rounds after one untimed pass.
//
// And the restore's plain TCP fetch channel (fetch_channel.h) on the same fragments.
//
//   bazel run -c opt //tests/bench:replica_transport_bench -- [--mib 64] [--streams 4] [--rounds 3] [--json]
#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <grpcpp/grpcpp.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "common/status.h"
#include "daemon/replicate/erasure_code.h"
#include "tests/bench/best_of.h"
#include "daemon/replicate/fetch_channel.h"
#include "daemon/replicate/fragment_store.h"
#include "daemon/replicate/replica_client.h"
#include "daemon/replicate/replica_service.h"
#include "format/checksum.h"

namespace {

using namespace ckpt::replicate;
using Clock = std::chrono::steady_clock;
constexpr char kToken[] = "replica-transport-bench-token-0123456789";

// A figure from a failed call would be a lie: stop.
[[noreturn]] void Fail(const char* what, const absl::Status& status) {
  std::cerr << "replica_transport_bench: " << what << ": " << ckpt::Message(status) << "\n";
  std::exit(1);
}

using ckpt::bench::Best;

// `streams` TCP connections on loopback, each sending `bytes` in as few writes as the kernel
// takes to a reader that keeps them in one buffer: the limit of any transport on this
// machine (the fetch channel writes a fragment in one call too).
double TcpSeconds(size_t bytes, int streams, int rounds) {
  int listener = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ::bind(listener, reinterpret_cast<sockaddr*>(&addr), sizeof addr);
  socklen_t len = sizeof addr;
  ::getsockname(listener, reinterpret_cast<sockaddr*>(&addr), &len);
  ::listen(listener, streams);
  std::vector<std::string> sources(streams, std::string(bytes, 'x'));
  std::vector<std::unique_ptr<char[]>> sinks;
  for (int i = 0; i < streams; ++i) {
    sinks.emplace_back(new char[bytes]);
    std::memset(sinks.back().get(), 0, bytes);
  }
  double seconds = Best(rounds, [&] {
    std::vector<std::thread> threads;
    for (int i = 0; i < streams; ++i) {
      threads.emplace_back([&, i] {
        int fd = ::socket(AF_INET, SOCK_STREAM, 0);
        ::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr);
        for (size_t off = 0; off < bytes;) {
          ssize_t n = ::write(fd, sources[i].data() + off, bytes - off);
          if (n <= 0) break;
          off += static_cast<size_t>(n);
        }
        ::close(fd);
      });
      threads.emplace_back([&, i] {
        int fd = ::accept(listener, nullptr, nullptr);
        for (size_t off = 0; off < bytes;) {
          ssize_t n = ::read(fd, sinks[i].get() + off, bytes - off);
          if (n <= 0) break;
          off += static_cast<size_t>(n);
        }
        ::close(fd);
      });
    }
    for (auto& t : threads) t.join();
  });
  ::close(listener);
  return seconds;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"replica_transport_bench: fragments over the Replicas gRPC service against TCP on loopback"};
  size_t mib = 64;
  int streams = 4;
  int rounds = 3;
  bool json = false;
  app.add_option("--mib", mib, "each fragment");
  app.add_option("--streams", streams, "fragments moved at once, each on its own connection");
  app.add_option("--rounds", rounds);
  app.add_flag("--json", json);
  CLI11_PARSE(app, argc, argv);
  const size_t bytes = mib << 20;
  const double total = static_cast<double>(bytes) * streams;

  double tcp = TcpSeconds(bytes, streams, rounds);

  // A peer: its store and its Replicas service on a loopback port; each stream its own
  // channel, as each holder is its own daemon.
  FragmentStore store(2 * bytes * static_cast<size_t>(streams) + (64 << 20), {});
  ReplicaService service(store, kToken);
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
  builder.RegisterService(&service);
  builder.SetMaxReceiveMessageSize(64 << 20);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  std::vector<std::unique_ptr<ReplicaClient>> clients;
  for (int i = 0; i < streams; ++i) {
    grpc::ChannelArguments args;
    args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
    args.SetMaxReceiveMessageSize(64 << 20);
    clients.push_back(std::make_unique<ReplicaClient>(
        grpc::CreateCustomChannel("127.0.0.1:" + std::to_string(port), grpc::InsecureChannelCredentials(), args),
        kToken, std::chrono::seconds(120)));
  }
  // Fragments of one k = 1 code are the data itself: each stream's own.
  std::vector<HeldFragment> fragments;
  for (int i = 0; i < streams; ++i) {
    std::string data(bytes, static_cast<char>('a' + i));
    HeldFragment f;
    f.id = {"bench", 1, 7, static_cast<uint32_t>(i), 0};
    f.meta = {1, 1, bytes, 1, ckpt::format::ChecksumOf(data.data(), data.size())};
    f.bytes = std::move(data);
    fragments.push_back(std::move(f));
  }
  uint64_t step = 1;
  const double put = Best(rounds, [&] {
    ++step;  // a new step each round: a sealed step takes no more fragments
    std::vector<std::thread> threads;
    for (int i = 0; i < streams; ++i) {
      threads.emplace_back([&, i] {
        HeldFragment f = fragments[i];
        f.id.step = step;
        absl::Status s = clients[i]->Put(1000, f);
        if (!s.ok()) Fail("put", s);
      });
    }
    for (auto& t : threads) t.join();
    // Sealed and released, as a replicated step is: the store holds one step at a time.
    if (absl::Status s = store.Seal("bench", step, 7, static_cast<size_t>(streams)); !s.ok()) Fail("seal", s);
    if (absl::Status s = store.Release("bench", step, 7); !s.ok()) Fail("release", s);
  });
  const double get = Best(rounds, [&] {
    std::vector<std::thread> threads;
    for (int i = 0; i < streams; ++i) {
      threads.emplace_back([&, i] {
        FragmentId id = fragments[i].id;
        id.step = step;
        absl::StatusOr<HeldFragment> f = clients[i]->Get(id);
        if (!f.ok()) Fail("get", f.status());
      });
    }
    for (auto& t : threads) t.join();
  });
  // The restore's fetch channel: the same fragments over plain TCP, straight from the store
  // into buffers of the reader's (touched once, as a prefaulted staging block is).
  absl::StatusOr<std::unique_ptr<FetchServer>> fetch = FetchServer::Start(store, "127.0.0.1");
  if (!fetch.ok()) Fail("fetch channel", fetch.status());
  const std::string ticket = (*fetch)->Issue("bench", 7);
  std::vector<std::unique_ptr<char[]>> sinks;
  for (int i = 0; i < streams; ++i) {
    sinks.emplace_back(new char[bytes]);
    std::memset(sinks.back().get(), 0, bytes);
  }
  const double fetched = Best(rounds, [&] {
    std::vector<std::thread> threads;
    for (int i = 0; i < streams; ++i) {
      threads.emplace_back([&, i] {
        FragmentId id = fragments[i].id;
        id.step = step;
        absl::StatusOr<FragmentMeta> meta = FetchFragment(
            "127.0.0.1", (*fetch)->port(), ticket, id, 1, bytes, [&](const FragmentMeta&) { return sinks[i].get(); },
            std::chrono::seconds(60));
        if (!meta.ok()) Fail("fetch", meta.status());
      });
    }
    for (auto& t : threads) t.join();
  });
  (*fetch)->Stop();
  server->Shutdown();
  // Loopback TCP varies by a third from one second to the next here: the limit is the best
  // it did in this run, measured before and after the rest.
  tcp = std::min(tcp, TcpSeconds(bytes, streams, rounds));
  const auto gbps = [&](double s) { return total / s / 1e9; };
  if (json) {
    std::cout << nlohmann::json{{"fragment_bytes", bytes},   {"streams", streams},
                                {"tcp_gbps", gbps(tcp)},      {"put_gbps", gbps(put)},
                                {"get_gbps", gbps(get)},      {"put_of_tcp", tcp / put},
                                {"get_of_tcp", tcp / get},    {"fetch_channel_gbps", gbps(fetched)},
                                {"fetch_channel_of_tcp", tcp / fetched}}
                     .dump()
              << "\n";
  } else {
    std::cout << fmt::format("{} fragment(s) of {} MiB at once, best of {}:\n", streams, mib, rounds);
    std::cout << fmt::format("  TCP on loopback (the limit)  {:6.2f} GB/s\n", gbps(tcp));
    std::cout << fmt::format("  Replicas PutFragment         {:6.2f} GB/s  ({:.0f}% of the limit)\n", gbps(put),
                             100 * tcp / put);
    std::cout << fmt::format("  Replicas GetFragment         {:6.2f} GB/s  ({:.0f}% of the limit)\n", gbps(get),
                             100 * tcp / get);
    std::cout << fmt::format("  the restore's fetch channel  {:6.2f} GB/s  ({:.0f}% of the limit)\n", gbps(fetched),
                             100 * tcp / fetched);
  }
  return 0;
}
