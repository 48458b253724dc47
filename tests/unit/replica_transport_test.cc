// Fragments between daemons over real gRPC on loopback (issue 25): a peer's Replicas service
// keeps what arrives whole and unchanged, refuses what does not, answers only to the group
// token, and serves fragments back.
#include <catch2/catch.hpp>

#include <grpcpp/grpcpp.h>
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <memory>
#include <string>

#include "common/status.h"
#include "daemon/replicate/erasure_code.h"
#include "daemon/replicate/fetch_channel.h"
#include "daemon/replicate/replica_client.h"
#include "daemon/replicate/replica_service.h"
#include "daemon/replicate/shard_fragments.h"
#include "format/checksum.h"
#include "proto/replicas.grpc.pb.h"
#include "tests/fakes/sanitizer_slowdown.h"

using namespace ckpt::replicate;
using namespace std::chrono_literals;

namespace {

constexpr char kToken[] = "replica-test-token-0123456789abcdef";

// A peer: its store and its Replicas service on a loopback port.
struct Peer {
  explicit Peer(size_t budget) : store(budget, {}), service(store, kToken) {
    grpc::ServerBuilder builder;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
    builder.RegisterService(&service);
    server = builder.BuildAndStart();
  }
  ~Peer() { server->Shutdown(std::chrono::system_clock::now() + 5s); }
  ReplicaClient Client(const std::string& token = kToken) const {
    // Fragments of a few hundred KB in 64 KiB chunks: several chunks each, and few bytes
    // for the sanitizers' builds to watch cross gRPC's own (uninstrumented) threads.
    return ReplicaClient(grpc::CreateChannel("127.0.0.1:" + std::to_string(port), grpc::InsecureChannelCredentials()),
                         token, 10s * ckpt::testing::kSanitizerSlowdown, 64 << 10);
  }

  FragmentStore store;
  ReplicaService service;
  int port = 0;
  std::unique_ptr<grpc::Server> server;
};

// The 4+2 fragments of a shard of `bytes`: of 400 KB, 100 KB each (two chunks); of 1.2 MB,
// 300 KB each (five chunks).
std::vector<HeldFragment> Fragments(size_t bytes, uint64_t step = 5) {
  std::vector<uint8_t> data(bytes);
  for (size_t i = 0; i < bytes; ++i) data[i] = static_cast<uint8_t>(i * 131 + (i >> 12));
  auto code = ErasureCode::Make(4, 2);
  REQUIRE(code.ok());
  auto fragments = CodeShard(*code, "llm", step, 3, 25, 77, data);
  REQUIRE(fragments.ok());
  return *std::move(fragments);
}

}  // namespace

TEST_CASE("a fragment sent in chunks is held whole by the peer, sealed, and served back") {
  Peer peer(size_t{256} << 20);
  REQUIRE(peer.server != nullptr);
  ReplicaClient client = peer.Client();
  auto fragments = Fragments(1'200'000);  // 300 KB fragments: five chunks each
  for (int i = 0; i < 3; ++i) {
    absl::Status sent = client.Put(1000, fragments[static_cast<size_t>(i)]);
    INFO(sent);
    REQUIRE(sent.ok());
  }
  auto held = peer.store.Find(fragments[1].id);
  REQUIRE(held != nullptr);
  CHECK(held->bytes == fragments[1].bytes);
  CHECK(held->meta.checksum == fragments[1].meta.checksum);
  REQUIRE(client.Seal("llm", 5, 3, 3).ok());
  CHECK(absl::IsFailedPrecondition(client.Seal("llm", 5, 3, 4)));
  auto back = client.Get(fragments[2].id);
  REQUIRE(back.ok());
  CHECK(back->bytes == fragments[2].bytes);
  CHECK(back->meta.data_bytes == 1'200'000);
  // Three of the six and one fragment kept elsewhere rebuild the shard.
  std::vector<std::shared_ptr<const HeldFragment>> four;
  for (int i = 0; i < 3; ++i) {
    auto got = client.Get(fragments[static_cast<size_t>(i)].id);
    REQUIRE(got.ok());
    four.push_back(std::make_shared<const HeldFragment>(*std::move(got)));
  }
  four.push_back(std::make_shared<const HeldFragment>(fragments[5]));
  auto rebuilt = RebuildShard(four);
  REQUIRE(rebuilt.ok());
  CHECK(rebuilt->size() == 1'200'000);
  CHECK(static_cast<uint8_t>((*rebuilt)[12345]) == static_cast<uint8_t>(12345 * 131 + (12345 >> 12)));
  auto missing = client.Get({"llm", 5, 3, 25, 4});
  CHECK(absl::IsNotFound(missing.status()));
}

TEST_CASE("a peer refuses a fragment damaged on the way, one that does not fit, and a caller without the token") {
  auto fragments = Fragments(400'000);
  SECTION("damaged") {
    Peer peer(size_t{64} << 20);
    HeldFragment damaged = fragments[0];
    damaged.bytes[1000] ^= 1;
    auto refused = peer.Client().Put(1000, damaged);
    CHECK(absl::IsDataLoss(refused));
    CHECK_THAT(ckpt::Message(refused), Catch::Contains("damaged on the way"));
    CHECK(peer.store.used() == 0);
    CHECK(peer.service.receiving() == 0);
  }
  SECTION("larger than the budget, and more than fits beside what is held") {
    Peer peer(150'000);  // one 100 KB fragment fits, two do not
    ReplicaClient client = peer.Client();
    absl::Status first = client.Put(1000, fragments[0]);
    INFO(first);
    REQUIRE(first.ok());
    auto full = client.Put(1000, fragments[1]);
    INFO(full);
    CHECK(absl::IsResourceExhausted(full));
    CHECK_THAT(ckpt::Message(full), Catch::Contains("--replica-bytes"));
    Peer small(50'000);
    CHECK(absl::IsResourceExhausted(small.Client().Put(1000, fragments[0])));
    CHECK(small.service.receiving() == 0);
  }
  SECTION("the wrong token") {
    Peer peer(size_t{64} << 20);
    ReplicaClient stranger = peer.Client("not-the-group-token-000000000000000");
    CHECK(absl::IsUnauthenticated(stranger.Put(1000, fragments[0])));
    CHECK(absl::IsUnauthenticated(stranger.Seal("llm", 5, 3, 1)));
    REQUIRE(peer.Client().Put(1000, fragments[0]).ok());
    CHECK(absl::IsUnauthenticated(stranger.Get(fragments[0].id).status()));
    CHECK(peer.store.Held().size() == 1);
  }
  SECTION("a header that claims fewer bytes than are sent") {
    Peer peer(size_t{64} << 20);
    HeldFragment lying = fragments[0];
    lying.meta.data_bytes = 1000;  // fragments of 256 bytes, and 100 KB sent
    auto refused = peer.Client().Put(1000, lying);
    CHECK(absl::IsInvalidArgument(refused));
    CHECK_THAT(ckpt::Message(refused), Catch::Contains("more than the 256 bytes its header gives it"));
    CHECK(peer.service.receiving() == 0);
  }
}

namespace {

// Fetches fragment `index` of rank 25's shard of step 5 through `fetch` with `ticket`,
// into `into` (sized for it), for a 4+2 code of data up to `max`.
absl::StatusOr<FragmentMeta> Fetch(const FetchServer& fetch, const std::string& ticket, uint32_t index,
                                   std::string& into, uint64_t max = 1 << 30) {
  return FetchFragment("127.0.0.1", fetch.port(), ticket, {"llm", 5, 3, 25, index}, 4, max,
                       [&](const FragmentMeta& meta) {
                         into.assign(ErasureCode::FragmentBytes(meta.data_bytes, 4), '\0');
                         return into.data();
                       },
                       5s * ckpt::testing::kSanitizerSlowdown);
}

}  // namespace

TEST_CASE("the fetch channel serves a held fragment for a ticket of its job and owner, and nothing without one") {
  Peer peer(size_t{64} << 20);
  auto fragments = Fragments(400'000);
  for (int i = 0; i < 2; ++i) REQUIRE(peer.Client().Put(1000, fragments[static_cast<size_t>(i)]).ok());
  auto fetch = FetchServer::Start(peer.store, "127.0.0.1");
  REQUIRE(fetch.ok());
  const std::string ticket = (*fetch)->Issue("llm", 3);
  CHECK(ticket.size() == kFetchTicketBytes);
  std::string got;
  auto meta = Fetch(**fetch, ticket, 1, got);
  INFO(meta.status());
  REQUIRE(meta.ok());
  CHECK(got == fragments[1].bytes);
  CHECK(meta->checksum == fragments[1].meta.checksum);
  CHECK(meta->data_bytes == 400'000);
  // Nothing for a guessed ticket, a ticket of another owner or job, or a fragment not held.
  std::string none;
  std::string guessed = ticket;
  guessed[0] ^= 1;
  CHECK(absl::IsNotFound(Fetch(**fetch, guessed, 1, none).status()));
  CHECK(absl::IsNotFound(Fetch(**fetch, (*fetch)->Issue("llm", 4), 1, none).status()));
  CHECK(absl::IsNotFound(Fetch(**fetch, (*fetch)->Issue("other", 3), 1, none).status()));
  CHECK(absl::IsNotFound(Fetch(**fetch, ticket, 5, none).status()));
  CHECK(none.empty());
  // A fragment coding more than the reader's shard holds is refused before its bytes are read.
  auto large = Fetch(**fetch, ticket, 0, none, 399'999);
  CHECK(absl::IsDataLoss(large.status()));
  CHECK(none.empty());
  // A client that connects and says nothing holds a connection for the server's timeout at
  // most; the server still answers others meanwhile.
  int idle = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = htons(static_cast<uint16_t>((*fetch)->port()));
  REQUIRE(::connect(idle, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0);
  std::string again;
  CHECK(Fetch(**fetch, ticket, 0, again).ok());
  ::close(idle);
  (*fetch)->Stop();
}

TEST_CASE("the Replicas service hands out the fetch channel's port and a ticket with what it holds") {
  Peer peer(size_t{64} << 20);
  auto fragments = Fragments(400'000);
  REQUIRE(peer.Client().Put(1000, fragments[0]).ok());
  auto fetch = FetchServer::Start(peer.store, "127.0.0.1");
  REQUIRE(fetch.ok());
  peer.service.set_fetch(fetch->get());
  FetchGrant grant;
  auto held = peer.Client().List("llm", 3, &grant);
  REQUIRE(held.ok());
  CHECK(grant.port == (*fetch)->port());
  CHECK(grant.ticket.size() == kFetchTicketBytes);
  std::string got;
  REQUIRE(Fetch(**fetch, grant.ticket, 0, got).ok());
  CHECK(got == fragments[0].bytes);
  // Without the group token, no ticket.
  FetchGrant none;
  CHECK(absl::IsUnauthenticated(peer.Client("not-the-group-token-000000000000000").List("llm", 3, &none).status()));
  CHECK(none.ticket.empty());
  (*fetch)->Stop();
}
