// The group over real gRPC on 127.0.0.1 (port 0): a coordinator server, node clients,
// hostile peers (wrong token, garbage bytes, a silent connection), member loss, and
// mutual TLS with certificates made here by the openssl CLI.
#include <catch2/catch.hpp>

#include <arpa/inet.h>
#include <fmt/format.h>
#include <grpcpp/grpcpp.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <fstream>
#include <random>
#include <set>
#include <sstream>
#include <thread>

#include "storage/filesystem.h"
#include "common/status.h"
#include "tests/fakes/manifest_part.h"
#include "daemon/group/decision_log.h"
#include "daemon/group/group_client.h"
#include "daemon/group/group_member.h"
#include "daemon/group/group_server.h"
#include "format/manifest.h"
#include "daemon/group/part_values_proto.h"
#include "format/part_structure.h"
#include "daemon/schedule/save_clock.h"
#include "proto/group.grpc.pb.h"
#include "tests/fakes/temp_dir.h"
#include "tests/fakes/wait_until.h"

using namespace ckpt;
using namespace ckpt::group;
using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;
namespace pb = ckptd::group::v1;

namespace {

constexpr char kToken[] = "test-group-token-0123456789";

GroupOptions NodeOptions(uint32_t node, uint32_t nodes, std::string coordinator) {
  GroupOptions o;
  o.node_rank = node;
  o.num_nodes = nodes;
  o.coordinator = std::move(coordinator);
  o.listen_addr = "127.0.0.1:0";
  o.token = kToken;
  o.group_timeout = 3s;
  o.step_timeout = 10s;
  o.rpc_timeout = 2s;
  return o;
}

using ckpt::testing::ManifestPart;

format::Manifest Part(const std::string& job, uint64_t step, uint32_t world_size,
                       std::vector<uint32_t> ranks) {
  return ManifestPart(job, step, world_size, std::move(ranks));
}

// A coordinator (node 0) over a file decision log in a private directory.
struct Group {
  explicit Group(uint32_t nodes, GroupOptions base = NodeOptions(0, 3, "")) {
    base.num_nodes = nodes;
    options = base;
    log = MakeFileDecisionLog(MakePosixFilesystem(), dir / "decisions");
    auto started = StartGroupServer(options, 1000, log.get());
    REQUIRE(started.ok());
    server = std::move(*started);
  }

  GroupClientPtr Client(uint32_t node, std::string token = kToken) {
    GroupOptions o = options;
    o.node_rank = node;
    o.coordinator = server->address();
    o.token = std::move(token);
    auto client = MakeGrpcGroupClient(o, 2000 + node, fmt::format("127.0.0.1:{}", 9000 + node));
    REQUIRE(client.ok());
    return std::move(*client);
  }

  testing::TempDir dir;
  GroupOptions options;
  DecisionLogPtr log;
  GroupServerPtr server;
};

// A raw stub, for what GroupClient does not expose (Ping, malformed requests).
struct RawCall {
  explicit RawCall(const std::string& address, const std::string& token = kToken)
      : stub(pb::Group::NewStub(grpc::CreateChannel(address, grpc::InsecureChannelCredentials()))) {
    ctx.set_deadline(std::chrono::system_clock::now() + 3s);
    if (!token.empty()) ctx.AddMetadata("x-ckptd-group-token", token);
  }
  std::unique_ptr<pb::Group::Stub> stub;
  grpc::ClientContext ctx;
};

int ConnectTcp(const std::string& address) {
  size_t colon = address.rfind(':');
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(std::stoi(address.substr(colon + 1))));
  inet_pton(AF_INET, address.substr(0, colon).c_str(), &addr.sin_addr);
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  REQUIRE(fd >= 0);
  REQUIRE(::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0);
  return fd;
}

// Three participants gather distinct payloads through three clients at once.
void GatherDistinctAmongThree(std::vector<GroupClientPtr>& clients, const std::string& key) {
  std::vector<absl::StatusOr<GatherTable::Distinct>> results(3);
  std::vector<std::thread> threads;
  for (uint32_t p = 0; p < 3; ++p) {
    threads.emplace_back([&, p] { results[p] = clients[p]->GatherDistinct(key, p, 3, p == 1 ? "b" : "a", 3s); });
  }
  for (auto& t : threads) t.join();
  for (auto& r : results) {
    REQUIRE(r.ok());
    CHECK(r->payloads == std::vector<std::string>{"a", "b"});
    CHECK(r->senders == std::vector<uint32_t>{0, 1});
    CHECK(r->counts == std::vector<uint32_t>{2, 1});
  }
}

// Every node's two ranks gather distinct payloads at once (participant 2n and 2n + 1 on node
// n; participant 5 brings another list), each rank on its own thread as trainers do.
void GatherTwoRanksPerNode(std::vector<GroupClientPtr>& clients, const std::string& key) {
  const auto participants = static_cast<uint32_t>(2 * clients.size());
  std::vector<absl::StatusOr<GatherTable::Distinct>> results(participants);
  std::vector<std::thread> threads;
  for (uint32_t p = 0; p < participants; ++p) {
    threads.emplace_back([&, p] {
      results[p] = clients[p / 2]->GatherDistinct(key, p, participants, p == 5 ? "steps 1" : "steps 1 2", 10s);
    });
  }
  for (auto& t : threads) t.join();
  for (uint32_t p = 0; p < participants; ++p) {
    INFO("participant " << p);
    REQUIRE(results[p].ok());
    CHECK(results[p]->payloads == std::vector<std::string>{"steps 1 2", "steps 1"});
    CHECK(results[p]->senders == std::vector<uint32_t>{0, 5});
    CHECK(results[p]->counts == std::vector<uint32_t>{participants - 1, 1});
  }
}

// Three participants gather through three clients at once.
void GatherAmongThree(std::vector<GroupClientPtr>& clients, const std::string& key) {
  std::vector<absl::StatusOr<std::vector<std::string>>> results(3);
  std::vector<std::thread> threads;
  for (uint32_t p = 0; p < 3; ++p) {
    threads.emplace_back([&, p] {
      results[p] = clients[p]->Gather(key, p, 3, fmt::format("from-{}", p), 3s);
    });
  }
  for (auto& t : threads) t.join();
  for (auto& r : results) {
    REQUIRE(r.ok());
    CHECK(*r == std::vector<std::string>{"from-0", "from-1", "from-2"});
  }
}

}  // namespace

namespace {

// A prepare of node 0 (incarnation 2000) over a raw stub: the whole part, or only its values
// under `digest`.
grpc::Status RawPrepare(const std::string& address, const format::Manifest& part, const std::string& digest,
                        const format::PartValues* values, pb::PrepareReply* reply) {
  RawCall call(address);
  pb::PrepareRequest request;
  request.set_node_rank(0);
  request.set_incarnation(2000);
  request.set_job(part.job);
  request.set_step(part.step);
  request.set_world_size(part.world_size);
  for (const format::ManifestShard& s : part.shards) request.add_ranks(s.rank);
  request.set_attempt(1);
  if (digest.empty()) {
    request.set_manifest_part_json(format::ManifestToJson(part));
  } else {
    request.set_structure_digest(digest);
    ToProto(*values, request.mutable_values());
  }
  return call.stub->Prepare(&call.ctx, request, reply);
}

format::Manifest Checksummed(format::Manifest part, const std::string& checksum) {
  for (auto& [name, tensor] : part.tensors) {
    for (auto& piece : tensor.shards) piece.checksum = checksum;
  }
  return part;
}

}  // namespace

TEST_CASE("rpc: once the coordinator holds a part's structure, a prepare carries only its values") {
  Group g(2);
  auto node0 = g.Client(0);
  auto node1 = g.Client(1);
  REQUIRE(node0->Join(Clock::now() + 3s).ok());
  REQUIRE(node1->Join(Clock::now() + 3s).ok());
  const std::string address = g.server->address();

  // Step 1: node 0 names a structure the coordinator was never sent: it is asked for it.
  format::Manifest step1 = Checksummed(Part("job", 1, 2, {0}), "xxh3:0000000000000001");
  format::SplitResult split1 = format::SplitPart(step1);
  pb::PrepareReply reply;
  REQUIRE(RawPrepare(address, step1, split1.structure->digest, &split1.values, &reply).ok());
  CHECK(reply.need_structure());
  CHECK(reply.outcome() == pb::OUTCOME_PENDING);
  reply.Clear();
  REQUIRE(RawPrepare(address, step1, "", nullptr, &reply).ok());  // the whole part
  CHECK_FALSE(reply.need_structure());
  CHECK(reply.outcome() == pb::OUTCOME_PENDING);
  REQUIRE(node1->Prepare(Part("job", 1, 2, {1}), 1)->outcome == Outcome::kCommitted);

  // Step 2: the same structure, only values; the whole manifest carries them.
  format::Manifest step2 = Checksummed(Part("job", 2, 2, {0}), "xxh3:0000000000000002");
  format::SplitResult split2 = format::SplitPart(step2);
  REQUIRE(split2.structure->digest == split1.structure->digest);
  reply.Clear();
  REQUIRE(RawPrepare(address, step2, split2.structure->digest, &split2.values, &reply).ok());
  CHECK_FALSE(reply.need_structure());
  CHECK(reply.outcome() == pb::OUTCOME_PENDING);
  REQUIRE(node1->Prepare(Part("job", 2, 2, {1}), 1)->outcome == Outcome::kCommitted);
  // (node 1's second prepare went as values too: its client had the structure acknowledged)
  auto whole = node0->GetOutcome("job", 2, 100ms);
  REQUIRE(whole.ok());
  auto manifest = format::ParseManifest(whole->committed->manifest_json, "outcome");
  REQUIRE(manifest.ok());
  CHECK(manifest->tensors.at("w").shards[0].checksum == "xxh3:0000000000000002");
  CHECK(manifest->Shard(0)->bytes == 1000);

  // Values that do not fit the structure, or a prepare that says both: refused, named.
  format::PartValues short_values = split2.values;
  short_values.checksums.clear();
  short_values.xxh3.clear();
  reply.Clear();
  grpc::Status misfit = RawPrepare(address, Part("job", 3, 2, {0}), split2.structure->digest, &short_values, &reply);
  CHECK(misfit.error_code() == grpc::StatusCode::INVALID_ARGUMENT);
  CHECK_THAT(misfit.error_message(), Catch::Contains("values") && Catch::Contains("0 checksums"));
  {
    RawCall call(address);
    pb::PrepareRequest both;
    both.set_node_rank(0);
    both.set_incarnation(2000);
    both.set_job("job");
    both.set_step(3);
    both.set_world_size(2);
    both.add_ranks(0);
    both.set_structure_digest(split2.structure->digest);
    both.set_manifest_part_json(format::ManifestToJson(Part("job", 3, 2, {0})));
    grpc::Status s = call.stub->Prepare(&call.ctx, both, &reply);
    CHECK(s.error_code() == grpc::StatusCode::INVALID_ARGUMENT);
    CHECK_THAT(s.error_message(), Catch::Contains("not both"));
  }
  // A structure of another job under a request for this one is refused.
  format::Manifest other = Part("other", 3, 2, {0});
  format::SplitResult split_other = format::SplitPart(other);
  reply.Clear();
  REQUIRE(RawPrepare(address, other, "", nullptr, &reply).ok());
  format::Manifest mislabeled = Part("job", 3, 2, {0});
  reply.Clear();
  grpc::Status wrong_job = RawPrepare(address, mislabeled, split_other.structure->digest, &split_other.values, &reply);
  CHECK(wrong_job.error_code() == grpc::StatusCode::INVALID_ARGUMENT);
  CHECK_THAT(wrong_job.error_message(), Catch::Contains("structure_digest is for job other"));
}

namespace {

// A coordinator that only answers prepares, as told: committed, saying whether it keeps the
// job's checksums; it records what each prepare carried.
class ChecksumsCoordinator final : public pb::Group::Service {
 public:
  grpc::Status Prepare(grpc::ServerContext*, const pb::PrepareRequest* request, pb::PrepareReply* reply) override {
    std::lock_guard lock(mu);
    if (!request->structure_digest().empty() && !known.count(request->structure_digest())) {
      reply->set_need_structure(true);
      return grpc::Status::OK;
    }
    if (request->structure_digest().empty()) {
      auto part = format::ParseManifest(request->manifest_part_json(), "part", format::ManifestScope::kPart);
      if (!part.ok()) return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, Message(part.status()));
      known.insert(format::SplitPart(*part).structure->digest);
      carried.push_back("whole");
    } else if (request->values().checksums_withheld() > 0) {
      carried.push_back(fmt::format("count {}", request->values().checksums_withheld()));
      if (refuse_withheld) {  // as a coordinator on a shared root answers
        reply->set_outcome(pb::OUTCOME_ABORTED);
        reply->set_reason("needs every checksum");
        return grpc::Status::OK;
      }
    } else {
      carried.push_back(fmt::format("{} checksums", request->values().xxh3_size() + request->values().checksums_size()));
    }
    reply->set_outcome(pb::OUTCOME_COMMITTED);
    reply->mutable_committed()->set_node_ranks(static_cast<uint32_t>(request->ranks_size()));
    reply->mutable_committed()->set_checksums_unused(checksums_unused);
    return grpc::Status::OK;
  }
  std::mutex mu;
  std::set<std::string> known;
  std::vector<std::string> carried;
  bool checksums_unused = false;
  bool refuse_withheld = false;
};

}  // namespace

TEST_CASE("rpc: a node keeps its checksums while the coordinator says it keeps none of the job's, and sends them when "
          "it says it does") {
  ChecksumsCoordinator coordinator;
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
  builder.RegisterService(&coordinator);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  REQUIRE(server);
  GroupOptions o = NodeOptions(1, 2, fmt::format("127.0.0.1:{}", port));
  auto client = MakeGrpcGroupClient(o, 2001, "127.0.0.1:9001");
  REQUIRE(client.ok());
  auto prepare = [&](uint64_t step, bool unused_from_now) {
    {
      std::lock_guard lock(coordinator.mu);
      coordinator.checksums_unused = unused_from_now;
    }
    REQUIRE((*client)->Prepare(Part("job", step, 2, {1}), 1)->outcome == Outcome::kCommitted);
  };
  prepare(1, true);   // the structure, whole; the answer: checksums unused
  prepare(2, true);   // only their count
  prepare(3, false);  // only their count; the answer: used again
  prepare(4, true);   // every checksum; the answer: unused again
  {
    std::lock_guard lock(coordinator.mu);
    coordinator.refuse_withheld = true;  // restarted on a shared root, say
  }
  // Step 5 goes with only their count and is refused for it; step 6 sends them all.
  REQUIRE((*client)->Prepare(Part("job", 5, 2, {1}), 1)->outcome == Outcome::kAborted);
  prepare(6, true);
  const size_t checksums = format::SplitPart(Part("job", 1, 2, {1})).structure->checksums;
  REQUIRE(checksums > 0);
  const std::string count = fmt::format("count {}", checksums), all = fmt::format("{} checksums", checksums);
  std::lock_guard lock(coordinator.mu);
  CHECK(coordinator.carried == std::vector<std::string>{"whole", count, count, all, count, all});
  server->Shutdown();
}

TEST_CASE("rpc: a part larger than a message goes in chunks before its prepare; bad chunks are refused, named") {
  GroupOptions base = NodeOptions(0, 2, "");
  base.inline_part_bytes = 100;      // every part here is larger
  base.structure_chunk_bytes = 97;   // many chunks, the last one short
  Group g(2, base);
  auto node0 = g.Client(0);
  auto node1 = g.Client(1);
  REQUIRE(node0->Join(Clock::now() + 3s).ok());
  REQUIRE(node1->Join(Clock::now() + 3s).ok());
  for (uint64_t step = 1; step <= 2; ++step) {
    REQUIRE(node0->Prepare(Checksummed(Part("job", step, 2, {0}), "xxh3:000000000000000a"), 1)->outcome ==
            Outcome::kPending);
    REQUIRE(node1->Prepare(Part("job", step, 2, {1}), 1)->outcome == Outcome::kCommitted);
  }
  auto whole = node0->GetOutcome("job", 2, 100ms);
  REQUIRE(whole.ok());
  auto manifest = format::ParseManifest(whole->committed->manifest_json, "outcome");
  REQUIRE(manifest.ok());
  CHECK(manifest->tensors.at("w").shards[0].checksum == "xxh3:000000000000000a");

  const std::string address = g.server->address();
  const format::Manifest part = Part("job", 3, 2, {0});
  const std::string text = format::ManifestToJson(part);
  const std::string digest = format::SplitPart(part).structure->digest;
  auto chunk = [&](uint64_t offset, std::string data, std::string named = "", uint64_t total = 0,
                   uint64_t incarnation = 2000, pb::StructureChunkReply* reply = nullptr) {
    RawCall call(address);
    pb::StructureChunk request;
    request.set_node_rank(0);
    request.set_incarnation(incarnation);
    request.set_structure_digest(named.empty() ? digest : named);
    request.set_total_bytes(total != 0 ? total : text.size());
    request.set_offset(offset);
    request.set_data(std::move(data));
    pb::StructureChunkReply ignored;
    return call.stub->PutStructure(&call.ctx, request, reply != nullptr ? reply : &ignored);
  };
  // Out of order, beyond the end, empty, too large, from a stranger: refused, named.
  grpc::Status skipped = chunk(10, text.substr(10, 10));
  CHECK(skipped.error_code() == grpc::StatusCode::FAILED_PRECONDITION);
  CHECK_THAT(skipped.error_message(), Catch::Contains("from offset 0"));
  CHECK_THAT(chunk(0, text + "x").error_message(), Catch::Contains("beyond total_bytes"));
  CHECK_THAT(chunk(0, "").error_message(), Catch::Contains("no data"));
  CHECK_THAT(chunk(0, "x", "", uint64_t{8} << 30).error_message(), Catch::Contains("is not in 1.."));
  CHECK(chunk(0, text, "", 0, /*incarnation=*/77).error_code() == grpc::StatusCode::FAILED_PRECONDITION);
  // A whole part whose structure is not the one named: refused once complete.
  grpc::Status misnamed = chunk(0, text, "xxh3:0123456789abcdef");
  CHECK(misnamed.error_code() == grpc::StatusCode::INVALID_ARGUMENT);
  CHECK_THAT(misnamed.error_message(), Catch::Contains("not xxh3:0123456789abcdef as named"));
  // Not a manifest at all: refused, named.
  CHECK_THAT(chunk(0, std::string(text.size(), '{')).error_message(), Catch::Contains("the uploaded part"));
  // In two chunks, the second completes it.
  pb::StructureChunkReply reply;
  REQUIRE(chunk(0, text.substr(0, 50), "", 0, 2000, &reply).ok());
  CHECK_FALSE(reply.complete());
  REQUIRE(chunk(50, text.substr(50), "", 0, 2000, &reply).ok());
  CHECK(reply.complete());
}

TEST_CASE("rpc: three nodes join, prepare, long-poll the outcome and gather") {
  Group g(3);
  std::vector<GroupClientPtr> clients;
  for (uint32_t n = 0; n < 3; ++n) clients.push_back(g.Client(n));
  GroupViewData view;
  for (auto& c : clients) {
    auto joined = c->Join(Clock::now() + 3s);
    REQUIRE(joined.ok());
    view = *joined;
  }
  REQUIRE(view.members.size() == 3);
  for (const MemberView& m : view.members) CHECK(m.state == MemberState::kAlive);
  CHECK(view.members[2].address == "127.0.0.1:9002");

  auto first = clients[0]->Prepare(Part("job", 100, 4, {0, 1}), 1);
  REQUIRE(first.ok());
  CHECK(first->outcome == Outcome::kPending);
  REQUIRE(clients[1]->Prepare(Part("job", 100, 4, {2}), 1).ok());
  auto heartbeat = clients[1]->Heartbeat();
  REQUIRE(heartbeat.ok());
  REQUIRE(heartbeat->steps.size() == 1);
  CHECK(heartbeat->steps[0].missing_ranks == std::vector<uint32_t>{3});

  // Node 0 waits for the outcome while node 2 completes the step.
  absl::StatusOr<Decision> polled;
  Clock::duration poll_took{};
  std::thread poller([&] {
    auto start = Clock::now();
    polled = clients[0]->GetOutcome("job", 100, 5s);
    poll_took = Clock::now() - start;
  });
  std::this_thread::sleep_for(200ms);
  auto last = clients[2]->Prepare(Part("job", 100, 4, {3}), 1);
  poller.join();
  REQUIRE(last.ok());
  CHECK(last->outcome == Outcome::kCommitted);
  REQUIRE(polled.ok());
  CHECK(polled->outcome == Outcome::kCommitted);
  CHECK(poll_took < 3s);  // answered by the commit, not by the wait running out
  auto manifest = format::ParseManifest(polled->committed->manifest_json, "outcome");
  REQUIRE(manifest.ok());
  CHECK(manifest->nodes.size() == 3);
  // Node 0 hears the whole manifest; the others the step's header and their own share.
  REQUIRE(last->committed);
  CHECK(last->committed->manifest_json.empty());
  CHECK(last->committed->header.world_size == 4);
  CHECK(last->committed->header.nodes == 3);
  CHECK(last->committed->header.step_bytes == manifest->total_bytes());
  // Every node names the step by the same digest: of the coordinator's decision record.
  CHECK_FALSE(last->committed->header.digest.empty());
  CHECK(last->committed->header.digest == polled->committed->header.digest);
  CHECK(last->committed->shares.at(2) == NodeShare{1, manifest->Shard(3)->bytes, 1});  // attempt 1
  auto asked = clients[1]->GetOutcome("job", 100, 100ms);
  REQUIRE(asked.ok());
  CHECK(asked->committed->manifest_json.empty());
  CHECK(asked->committed->shares.at(1).ranks == 1);
  auto whole = clients[1]->GetOutcome("job", 100, 100ms, /*whole_manifest=*/true);
  REQUIRE(whole.ok());
  CHECK(whole->committed->manifest_json == polled->committed->manifest_json);
  CHECK(clients[1]->Heartbeat()->committed.at("job") == 100);

  // An undecided step's long poll answers pending when the wait runs out.
  REQUIRE(clients[0]->Prepare(Part("job", 101, 2, {0}), 1).ok());
  auto pending = clients[1]->GetOutcome("job", 101, 100ms);
  REQUIRE(pending.ok());
  CHECK(pending->outcome == Outcome::kPending);
  REQUIRE(clients[1]->Abort("job", 101, 1, 0, "rank 1 failed to write").ok());
  auto aborted = clients[0]->GetOutcome("job", 101, 0ms);
  REQUIRE(aborted.ok());
  CHECK(aborted->outcome == Outcome::kAborted);
  CHECK_THAT(aborted->reason, Catch::Contains("node 1: rank 1 failed to write"));
  CHECK(clients[0]->GetOutcome("job", 999, 0ms)->outcome == Outcome::kUnknown);

  GatherAmongThree(clients, "restore/job");
  GatherDistinctAmongThree(clients, "restore/distinct");

  // Barrier and broadcast are gathers too.
  // Assertions only on this thread: Catch2's are not thread-safe (TSan said so).
  std::vector<absl::Status> met(3);
  std::vector<absl::StatusOr<std::string>> got(3);
  std::vector<std::thread> threads;
  for (uint32_t p = 0; p < 3; ++p) {
    threads.emplace_back([&, p] {
      met[p] = Barrier(*clients[p], "barrier/b", p, 3, 3s);
      got[p] = Broadcast(*clients[p], "bcast/b", p, 3, 2, p == 2 ? "step 40" : "ignored", 3s);
    });
  }
  for (auto& t : threads) t.join();
  for (auto& m : met) CHECK(m.ok());
  for (auto& g : got) CHECK(*g == "step 40");
  CHECK(absl::IsInvalidArgument(Broadcast(*clients[0], "bcast/x", 0, 3, 3, "", 1s).status()));

  auto alone = clients[0]->Gather("barrier/alone", 0, 2, "", 200ms);
  CHECK(absl::IsDeadlineExceeded(alone.status()));
  CHECK_THAT(Message(alone.status()), Catch::Contains("missing: 1"));

  // Shutdown cancels a gather in flight, and later ones fail at once.
  auto start = std::chrono::steady_clock::now();
  std::thread waiter([&] { alone = clients[1]->Gather("barrier/never", 0, 2, "", 30s); });
  std::this_thread::sleep_for(100ms);
  clients[1]->CancelGathers("ckptd is shutting down");
  waiter.join();
  CHECK_THAT(Message(alone.status()), Catch::Contains("shutting down"));
  CHECK_THAT(Message(clients[1]->Gather("k", 0, 2, "", 30s).status()),
             Catch::Contains("shutting down"));
  CHECK(std::chrono::steady_clock::now() - start < 5s);
}

TEST_CASE("rpc: heartbeat replies carry only the members that changed; nodes still see every member") {
  Group g(3);
  auto node1 = g.Client(1);
  auto node2 = g.Client(2);
  REQUIRE(node1->Join(Clock::now() + 3s).ok());
  // Raw heartbeats of node 1 (incarnation 2001), as its client sends them.
  auto beat = [&](uint64_t known) {
    RawCall call(g.server->address());
    pb::HeartbeatRequest request;
    request.set_node_rank(1);
    request.set_incarnation(2001);
    request.set_known_members_version(known);
    pb::HeartbeatReply reply;
    REQUIRE(call.stub->Heartbeat(&call.ctx, request, &reply).ok());
    return reply.view();
  };
  pb::GroupView all = beat(0);
  CHECK(all.members_complete());
  CHECK(all.members_size() == 3);
  const uint64_t version = all.members_version();
  pb::GroupView nothing = beat(version);
  CHECK_FALSE(nothing.members_complete());
  CHECK(nothing.members_size() == 0);  // nothing changed: no member travels
  REQUIRE(node2->Join(Clock::now() + 3s).ok());
  pb::GroupView joined = beat(version);
  REQUIRE(joined.members_size() == 1);
  CHECK(joined.members(0).node_rank() == 2);
  CHECK(joined.members(0).state() == pb::MEMBER_ALIVE);
  CHECK(joined.members_version() > version);
  CHECK(beat(version + 1000).members_complete());  // a version it never had: everything

  // The client merges the changes: its view lists every member, the changed ones fresh.
  auto view = node1->Heartbeat();
  REQUIRE(view.ok());
  REQUIRE(view->members.size() == 3);
  CHECK(view->members[1].state == MemberState::kAlive);
  CHECK(view->members[2].state == MemberState::kAlive);
  CHECK(view->members[0].state == MemberState::kWaiting);
  auto again = node1->Heartbeat();
  REQUIRE(again.ok());
  CHECK(again->members.size() == 3);
}

TEST_CASE("rpc: requests are validated field by field") {
  Group g(2);
  auto client = g.Client(1);
  REQUIRE(client->Join(Clock::now() + 3s).ok());

  auto bad_job = client->Prepare(Part("../escape", 1, 1, {0}), 1);
  CHECK(absl::IsInvalidArgument(bad_job.status()));
  CHECK_THAT(Message(bad_job.status()), Catch::Contains("job"));

  auto huge_key = client->Gather(std::string(600, 'k'), 0, 1, "", 1s);
  CHECK(absl::IsInvalidArgument(huge_key.status()));
  CHECK_THAT(Message(huge_key.status()), Catch::Contains("key"));
  auto huge_payload = client->Gather("k", 0, 1, std::string((1 << 20) + 1, 'x'), 1s);
  CHECK(absl::IsInvalidArgument(huge_payload.status()));
  CHECK_THAT(Message(huge_payload.status()), Catch::Contains("payload"));

  {
    RawCall call(g.server->address());
    pb::PrepareRequest request;
    request.set_node_rank(1);
    request.set_incarnation(2001);
    request.set_job("job");
    request.set_step(1);
    request.set_world_size(2);
    request.add_ranks(1);
    request.set_manifest_part_json("{not json");
    pb::PrepareReply reply;
    grpc::Status s = call.stub->Prepare(&call.ctx, request, &reply);
    CHECK(s.error_code() == grpc::StatusCode::INVALID_ARGUMENT);
    CHECK_THAT(s.error_message(), Catch::Contains("manifest_part_json"));
  }
  {
    RawCall call(g.server->address());
    pb::JoinRequest request;
    request.set_node_rank(7);
    request.set_num_nodes(2);
    request.set_incarnation(5);
    pb::JoinReply reply;
    grpc::Status s = call.stub->Join(&call.ctx, request, &reply);
    CHECK(s.error_code() == grpc::StatusCode::INVALID_ARGUMENT);
    CHECK_THAT(s.error_message(), Catch::Contains("node_rank 7"));
  }
  // A node that has not joined under this incarnation cannot vote.
  GroupOptions stranger = g.options;
  stranger.node_rank = 0;
  stranger.coordinator = g.server->address();
  auto unjoined = MakeGrpcGroupClient(stranger, 77, "x");
  REQUIRE(unjoined.ok());
  CHECK(absl::IsFailedPrecondition((*unjoined)->Prepare(Part("job", 1, 2, {0}), 1).status()));
}

TEST_CASE("rpc: nodes' save clocks give every node the coordinator's one answer per step") {
  Group g(3);
  std::vector<GroupClientPtr> clients;
  std::vector<daemon::SaveClockPtr> clocks;
  for (uint32_t n = 0; n < 3; ++n) {
    clients.push_back(g.Client(n));
    clocks.push_back(daemon::MakeGroupSaveClock(*clients.back()));
  }
  auto ask = [&](uint32_t node, uint64_t step) {
    auto save = clocks[node]->ShouldSave({"job", 0, step, 300ms});
    REQUIRE(save.ok());
    return *save;
  };
  // Nodes reach each step at different moments, node 2 far behind; whatever the first node
  // to ask heard, every node hears.
  std::vector<bool> first;
  for (uint64_t step = 1; step <= 12; ++step) {
    first.push_back(ask(step % 2, step));
    std::this_thread::sleep_for(60ms);
  }
  for (uint64_t step = 1; step <= 12; ++step) {
    CHECK(ask((step + 1) % 2, step) == first[step - 1]);
    CHECK(ask(2, step) == first[step - 1]);
  }
  size_t saves = std::count(first.begin(), first.end(), true);
  CHECK(saves >= 1);  // 12 steps 60 ms apart cross the 300 ms interval at least once
  CHECK(saves <= 3);
  // Ranks configured with another interval are told so.
  auto other = clocks[1]->ShouldSave({"job", 0, 13, 1s});
  CHECK(absl::IsInvalidArgument(other.status()));
  CHECK_THAT(Message(other.status()), Catch::Contains("interval_seconds"));
  auto intruder = g.Client(1, "not-the-token");
  CHECK(absl::IsUnauthenticated(intruder->DecideSave({"job", 0, 1, 300ms}).status()));
}

TEST_CASE("rpc: a wrong token is refused on every call") {
  Group g(2);
  auto intruder = g.Client(1, "not-the-token");
  auto join = intruder->Join(Clock::now() + 3s);
  CHECK(absl::IsUnauthenticated(join.status()));
  CHECK_THAT(Message(join.status()), Catch::Contains("refused this node's group token"));
  CHECK(absl::IsUnauthenticated(intruder->Heartbeat().status()));
  CHECK(absl::IsUnauthenticated(intruder->Prepare(Part("job", 1, 2, {1}), 1).status()));
  CHECK(absl::IsUnauthenticated(intruder->Abort("job", 1, 1, 0, "x")));
  CHECK(absl::IsUnauthenticated(intruder->GetOutcome("job", 1, 1s).status()));
  CHECK(absl::IsUnauthenticated(intruder->Gather("k", 0, 2, "", 1s).status()));
  auto prefix = g.Client(1, std::string(kToken).substr(0, 10));
  CHECK(absl::IsUnauthenticated(prefix->Heartbeat().status()));
  for (std::string token : {std::string(), std::string("wrong")}) {
    RawCall call(g.server->address(), token);
    pb::PingReply reply;
    grpc::Status s = call.stub->Ping(&call.ctx, pb::PingRequest(), &reply);
    CHECK(s.error_code() == grpc::StatusCode::UNAUTHENTICATED);
  }
  RawCall call(g.server->address());
  pb::PingReply reply;
  REQUIRE(call.stub->Ping(&call.ctx, pb::PingRequest(), &reply).ok());
  CHECK(reply.coordinator());
  CHECK(reply.incarnation() == 1000);
}

TEST_CASE("rpc: a node other than 0 answers Ping only") {
  auto started = StartGroupServer(NodeOptions(1, 3, "127.0.0.1:1"), 55, nullptr);
  REQUIRE(started.ok());
  GroupServerPtr server = std::move(*started);
  CHECK(server->membership() == nullptr);
  CHECK(server->coordinator() == nullptr);
  {
    RawCall call(server->address());
    pb::PingReply reply;
    REQUIRE(call.stub->Ping(&call.ctx, pb::PingRequest(), &reply).ok());
    CHECK(reply.node_rank() == 1);
    CHECK_FALSE(reply.coordinator());
  }
  RawCall call(server->address());
  pb::JoinReply reply;
  grpc::Status s = call.stub->Join(&call.ctx, pb::JoinRequest(), &reply);
  CHECK(s.error_code() == grpc::StatusCode::FAILED_PRECONDITION);
  CHECK_THAT(s.error_message(), Catch::Contains("node 1 is not the coordinator (node 0 is)"));
}

TEST_CASE("rpc: binding an address that cannot be bound fails naming it") {
  Group g(2);
  GroupOptions o = g.options;
  // gRPC binds with SO_REUSEPORT, so a second server on a port in use may succeed on
  // Linux; an address that is not this host's never does.
  o.listen_addr = "192.0.2.1:0";
  auto foreign = StartGroupServer(o, 1, g.log.get());
  REQUIRE_FALSE(foreign.ok());
  CHECK_THAT(Message(foreign.status()), Catch::Contains("192.0.2.1:0"));
}

TEST_CASE("rpc: garbage bytes and silent connections do not stop the group") {
  Group g(3);
  int garbage = ConnectTcp(g.server->address());
  int silent = ConnectTcp(g.server->address());
  std::mt19937 random(42);
  std::string noise(64 << 10, '\0');
  for (char& c : noise) c = static_cast<char>(random());
  (void)::send(garbage, noise.data(), noise.size(), MSG_NOSIGNAL);
  // A second garbage peer that claims HTTP/2 and then talks nonsense.
  int half = ConnectTcp(g.server->address());
  std::string preface = "PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + noise.substr(0, 4096);
  (void)::send(half, preface.data(), preface.size(), MSG_NOSIGNAL);

  std::vector<GroupClientPtr> clients;
  for (uint32_t n = 0; n < 3; ++n) {
    clients.push_back(g.Client(n));
    REQUIRE(clients.back()->Join(Clock::now() + 3s).ok());
  }
  GatherAmongThree(clients, "after-garbage");
  ::close(garbage);
  ::close(silent);
  ::close(half);
}

TEST_CASE("rpc: a member whose heartbeats stop is lost and its undecided step aborts") {
  GroupOptions o = NodeOptions(0, 2, "");
  o.group_timeout = 300ms;
  Group g(2, o);
  auto node1 = g.Client(1);
  REQUIRE(node1->Join(Clock::now() + 3s).ok());
  REQUIRE(node1->Prepare(Part("job", 7, 2, {1}), 1).ok());
  REQUIRE(testing::WaitUntil(
      [&] { return g.server->membership()->View()[1].state == MemberState::kLost; }, 3s));
  auto outcome = node1->GetOutcome("job", 7, 0ms);
  REQUIRE(outcome.ok());
  CHECK(outcome->outcome == Outcome::kAborted);
  CHECK_THAT(outcome->reason, Catch::Contains("node 1"));
  CHECK_THAT(outcome->reason, Catch::Contains("lost"));
  auto heartbeat = node1->Heartbeat();
  CHECK(absl::IsFailedPrecondition(heartbeat.status()));
  REQUIRE(node1->Join(Clock::now() + 3s).ok());
  CHECK(g.server->membership()->View()[1].state == MemberState::kAlive);
}

TEST_CASE("rpc: a GroupMember keeps its node alive and rejoins a restarted coordinator") {
  GroupOptions o = NodeOptions(0, 2, "");
  o.group_timeout = 300ms;
  o.rpc_timeout = 500ms;
  Group g(2, o);
  const std::string address = g.server->address();
  auto client = g.Client(1);
  std::atomic<int> on_joined_calls{0};
  GroupOptions member_options = g.options;
  member_options.node_rank = 1;
  GroupMember member(member_options, *client, [&] { ++on_joined_calls; });
  REQUIRE(member.WaitJoined(3s));
  CHECK(on_joined_calls == 1);
  std::this_thread::sleep_for(700ms);  // more than two group timeouts
  CHECK(g.server->membership()->View()[1].state == MemberState::kAlive);
  CHECK(member.state().joined);
  CHECK(member.state().last_ok_age_s >= 0);

  // The coordinator restarts on the same address: it no longer knows node 1.
  g.server->Shutdown();
  g.server.reset();
  GroupOptions again = g.options;
  again.listen_addr = address;
  auto restarted = StartGroupServer(again, 1001, g.log.get());
  REQUIRE(restarted.ok());
  g.server = std::move(*restarted);
  REQUIRE(testing::WaitUntil([&] { return member.state().joins >= 2; }, 5s));
  CHECK(on_joined_calls >= 2);
  CHECK(g.server->membership()->View()[1].state == MemberState::kAlive);
}

TEST_CASE("rpc: shutdown answers waiting long polls; a waiting gather tries again until its deadline, then fails naming the coordinator") {
  Group g(2);
  auto client = g.Client(1);
  REQUIRE(client->Join(Clock::now() + 3s).ok());
  REQUIRE(client->Prepare(Part("job", 3, 2, {1}), 1).ok());
  absl::StatusOr<Decision> polled;
  absl::StatusOr<std::vector<std::string>> gathered;
  std::thread poller([&] { polled = client->GetOutcome("job", 3, 20s); });
  // A coordinator that stops may be restarting: the gather arrives again at whatever listens
  // at its address, until the gather's deadline.
  std::thread gatherer([&] { gathered = client->Gather("k", 0, 2, "", 3s); });
  std::this_thread::sleep_for(300ms);
  const std::string coordinator = g.server->address();
  auto start = Clock::now();
  g.server->Shutdown();
  poller.join();
  CHECK(Clock::now() - start < 3s);
  REQUIRE(polled.ok());
  CHECK(polled->outcome == Outcome::kPending);
  gatherer.join();
  CHECK(Clock::now() - start >= 2s);
  CHECK(Clock::now() - start < 10s);  // its deadline, and not much more
  REQUIRE_FALSE(gathered.ok());
  CHECK(absl::IsUnavailable(gathered.status()));
  CHECK(Message(gathered.status()) ==
        "group gather k: the coordinator at " + coordinator +
            " could not be reached before the gather's deadline (it is down or restarting)");
}

// ---- the relay tree ----

TEST_CASE("rpc: a relay tree of fan-out 2 carries prepares and polls; a relay that stops sends its nodes to node 0") {
  GroupOptions base = NodeOptions(0, 7, "");
  base.relay_fanout = 2;  // node 1 relays for 3 and 4, node 2 for 5 and 6
  base.group_timeout = 20s;
  Group g(7, base);
  // The clients outlive the relays, which forward through them.
  std::vector<GroupClientPtr> clients;
  std::vector<GroupServerPtr> relays(3);
  clients.push_back(g.Client(0));
  for (uint32_t n = 1; n < 7; ++n) {
    GroupOptions o = g.options;
    o.node_rank = n;
    o.coordinator = g.server->address();
    std::string address = fmt::format("127.0.0.1:{}", 9000 + n);
    if (n <= 2) {
      auto started = StartGroupServer(o, 2000 + n, nullptr);
      REQUIRE(started.ok());
      relays[n] = std::move(*started);
      address = relays[n]->address();
    }
    auto client = MakeGrpcGroupClient(o, 2000 + n, address);
    REQUIRE(client.ok());
    if (n <= 2) relays[n]->StartRelay(*(*client)->relay_upstream());
    clients.push_back(std::move(*client));
  }
  // Relays first, so that the nodes below hear them alive when they join. A node below a
  // relay hears only its relay when it joins (each join bringing every member cost node 0
  // O(nodes²) when a large group starts); its first heartbeat, through the relay, brings the
  // rest (below).
  for (uint32_t n = 0; n < 7; ++n) {
    INFO("node " << n);
    auto joined = clients[n]->Join(Clock::now() + 3s);
    REQUIRE(joined.ok());
    if (n <= 2) {
      CHECK(joined->members.size() == 7);
    } else {
      REQUIRE(joined->members.size() == 1);
      CHECK(joined->members[0].node == (n - 1) / 2);
      CHECK(joined->members[0].state == MemberState::kAlive);
    }
  }

  auto save = [&](uint64_t step) {
    for (uint32_t n : {3u, 4u, 5u, 6u, 1u, 2u}) {
      auto prepared = clients[n]->Prepare(Part("job", step, 7, {n}), 1);
      REQUIRE(prepared.ok());
      CHECK(prepared->outcome == Outcome::kPending);
    }
    auto last = clients[0]->Prepare(Part("job", step, 7, {0}), 1);
    REQUIRE(last.ok());
    CHECK(last->outcome == Outcome::kCommitted);
    for (uint32_t n = 1; n < 7; ++n) {
      INFO("node " << n << " step " << step);
      auto heard = clients[n]->GetOutcome("job", step, 5s);
      REQUIRE(heard.ok());
      REQUIRE(heard->outcome == Outcome::kCommitted);
      // Its own share, as the coordinator recorded it, whichever way the answer came.
      const auto& share = heard->committed->shares.at(n);
      CHECK(share.ranks == 1);
      CHECK(share.attempt == 1);
      CHECK(share.bytes == Part("job", step, 7, {n}).shards[0].bytes);
      CHECK(heard->committed->header.world_size == 7);
    }
  };
  save(10);
  // Heartbeats go the same way, and a node the coordinator does not know hears so through
  // its relay (it must join again), rather than calling the coordinator instead.
  for (uint32_t n = 3; n < 7; ++n) {
    auto view = clients[n]->Heartbeat();
    REQUIRE(view.ok());
    CHECK(view->members.size() == 7);
  }
  for (uint32_t n : {1u, 2u}) {
    INFO("relay " << n);
    Relay::Counters relayed = relays[n]->relayed();
    CHECK(relayed.prepares == 2);
    CHECK(relayed.outcome_polls == 2);
    CHECK(relayed.heartbeats == 2);
  }
  {
    GroupOptions o = g.options;
    o.node_rank = 5;
    o.coordinator = g.server->address();
    auto stranger = MakeGrpcGroupClient(o, 777, "127.0.0.1:9005");  // not node 5's incarnation
    REQUIRE(stranger.ok());
    REQUIRE((*stranger)->Join(Clock::now() + 3s).ok());  // learns the members, then...
    REQUIRE(clients[5]->Join(Clock::now() + 3s).ok());   // ...node 5 takes its rank back
    auto refused = (*stranger)->Heartbeat();
    CHECK(absl::IsFailedPrecondition(refused.status()));
    CHECK(relays[2]->relayed().heartbeats == 3);
  }

  // A restore's gather: each node merges its own ranks, each relay its subtree's, and
  // node 0 hears both relays' merges and the calls of nodes 0-2.
  GatherTwoRanksPerNode(clients, "restore/job");
  for (uint32_t n : {1u, 2u}) {
    INFO("relay " << n);
    Relay::Counters relayed = relays[n]->relayed();
    CHECK(relayed.gathers >= 2);  // each of its two children's, merged or not
    CHECK(relayed.gather_merges >= 1);
    CHECK(relayed.gather_merges <= relayed.gathers);
  }
  {
    // A gather that times out at node 0 (participant 1 never comes): node 3 hears node 0's
    // answer through its relay once, and keeps its relay for everything else.
    const auto start = Clock::now();
    auto alone = clients[3]->GatherDistinct("restore/short", 0, 2, "x", 700ms);
    CHECK(absl::IsDeadlineExceeded(alone.status()));
    CHECK_THAT(Message(alone.status()), Catch::Contains("missing: 1"));
    CHECK(Clock::now() - start < 1400ms);  // not asked again of node 0 directly
    const uint64_t heartbeats = relays[1]->relayed().heartbeats;
    REQUIRE(clients[3]->Heartbeat().ok());
    CHECK(relays[1]->relayed().heartbeats == heartbeats + 1);
  }

  // Node 1 stops relaying (its server is gone): nodes 3 and 4 call node 0 themselves, and
  // the next step commits as the one before.
  relays[1]->Shutdown();
  save(20);
  CHECK(relays[2]->relayed().prepares == 4);
  for (uint32_t n : {3u, 4u}) CHECK(clients[n]->Heartbeat().ok());
  // The gather too: nodes 3 and 4 send their ranks' merges to node 0 themselves.
  const uint64_t relayed_by_2 = relays[2]->relayed().gathers;
  GatherTwoRanksPerNode(clients, "restore/again");
  CHECK(relays[2]->relayed().gathers >= relayed_by_2 + 2);
}

TEST_CASE("rpc: merged gather arrivals are checked: one form per call, participants in range and named once") {
  Group g(2);
  auto merged = [](std::vector<std::pair<std::string, std::vector<uint32_t>>> by_payload) {
    pb::GatherRequest r;
    r.set_key("restore/raw");
    r.set_participants(4);
    r.set_participant(4);  // = participants: the merged form
    r.set_distinct(true);
    r.set_timeout_ms(200);
    for (auto& [payload, participants] : by_payload) {
      pb::GatherArrivals* a = r.add_merged();
      a->set_payload(payload);
      a->mutable_participants()->Add(participants.begin(), participants.end());
    }
    return r;
  };
  auto gather = [&](const pb::GatherRequest& r) {
    RawCall c(g.server->address());
    pb::GatherReply reply;
    return c.stub->Gather(&c.ctx, r, &reply);
  };
  pb::GatherRequest both = merged({{"x", {0, 1}}});
  both.set_payload("mine");
  grpc::Status s = gather(both);
  CHECK(s.error_code() == grpc::StatusCode::INVALID_ARGUMENT);
  CHECK_THAT(s.error_message(), Catch::Contains("merged arrivals (with participant = participants) or"));
  pb::GatherRequest as_zero = merged({{"x", {0, 1}}});
  as_zero.set_participant(0);
  CHECK(gather(as_zero).error_code() == grpc::StatusCode::INVALID_ARGUMENT);
  pb::GatherRequest not_distinct = merged({{"x", {0}}});
  not_distinct.set_distinct(false);
  s = gather(not_distinct);
  CHECK_THAT(s.error_message(), Catch::Contains("distinct gathers only"));
  s = gather(merged({{"x", {0, 1}}, {"y", {1}}}));
  CHECK_THAT(s.error_message(), Catch::Contains("participant 1 is named twice"));
  s = gather(merged({{"x", {0, 9}}}));
  CHECK_THAT(s.error_message(), Catch::Contains("participant 9 is not in 0..3"));
  s = gather(merged({{"x", {0, 1, 2}}, {"y", {3}}, {"z", {2}}}));
  CHECK_THAT(s.error_message(), Catch::Contains("name 5 participants, the gather has 4"));
  // A well-formed merge of all four completes the round at once.
  pb::GatherRequest all = merged({{"x", {0, 1, 3}}, {"y", {2}}});
  RawCall c(g.server->address());
  pb::GatherReply reply;
  REQUIRE(c.stub->Gather(&c.ctx, all, &reply).ok());
  CHECK(reply.payloads_size() == 2);
  CHECK(reply.counts(0) == 3);
  CHECK(reply.senders(1) == 2);
}

TEST_CASE("rpc: a batch of prepares is answered prepare by prepare; only relays and node 0 take batches") {
  Group g(3);
  auto other = StartGroupServer(NodeOptions(1, 3, g.server->address()), 3001, nullptr);
  REQUIRE(other.ok());
  for (uint32_t n = 0; n < 3; ++n) REQUIRE(g.Client(n)->Join(Clock::now() + 3s).ok());
  pb::PrepareBatchRequest batch;
  for (uint32_t n : {1u, 2u}) {
    pb::PrepareRequest* p = batch.add_prepares();
    format::Manifest part = Part("job", 4, 3, {n});
    p->set_node_rank(n);
    p->set_incarnation(2000 + n);
    p->set_job("job");
    p->set_step(4);
    p->set_world_size(n == 2 ? 0 : 3);  // node 2's is malformed
    p->add_ranks(n);
    p->set_attempt(1);
    p->set_manifest_part_json(format::ManifestToJson(part));
  }
  {
    RawCall call(g.server->address());
    pb::PrepareBatchReply reply;
    REQUIRE(call.stub->PrepareBatch(&call.ctx, batch, &reply).ok());
    REQUIRE(reply.results_size() == 2);
    CHECK(reply.results(0).code() == 0);
    CHECK(reply.results(0).reply().outcome() == pb::OUTCOME_PENDING);
    CHECK(reply.results(1).code() == static_cast<int>(grpc::StatusCode::INVALID_ARGUMENT));
    CHECK_THAT(reply.results(1).message(), Catch::Contains("world_size 0"));
  }
  {
    // Heartbeats of a batch hear at most two views, whatever versions they know: all
    // members (version 0), and the changes since the oldest version the others know.
    pb::HeartbeatBatchRequest heartbeats;
    for (uint64_t known : {0, 1, 3}) {
      pb::HeartbeatRequest* h = heartbeats.add_heartbeats();
      h->set_node_rank(static_cast<uint32_t>(heartbeats.heartbeats_size() - 1));
      h->set_incarnation(2000 + static_cast<uint64_t>(heartbeats.heartbeats_size() - 1));
      h->set_known_members_version(known);
    }
    RawCall call(g.server->address());
    pb::HeartbeatBatchReply reply;
    REQUIRE(call.stub->HeartbeatBatch(&call.ctx, heartbeats, &reply).ok());
    REQUIRE(reply.results_size() == 3);
    for (const auto& r : reply.results()) CHECK(r.code() == 0);
    REQUIRE(reply.views_size() == 2);
    const pb::GroupView& all = reply.views(static_cast<int>(reply.results(0).view()));
    CHECK(all.members_complete());
    CHECK(all.members_size() == 3);
    CHECK(reply.results(1).view() == reply.results(2).view());
    const pb::GroupView& changes = reply.views(static_cast<int>(reply.results(1).view()));
    CHECK_FALSE(changes.members_complete());
    CHECK(changes.members_size() == 3);  // all three joined after version 1
  }
  {
    // A node that does not relay (no StartRelay) refuses batches and outcome polls.
    RawCall call((*other)->address());
    pb::PrepareBatchReply reply;
    grpc::Status status = call.stub->PrepareBatch(&call.ctx, batch, &reply);
    CHECK(status.error_code() == grpc::StatusCode::FAILED_PRECONDITION);
    CHECK_THAT(status.error_message(), Catch::Contains("does not relay"));
  }
  {
    RawCall call(g.server->address());
    pb::OutcomeRequest request;
    request.set_job("job");
    request.set_step(4);
    request.set_node_rank(1);
    request.add_shares_for(7);
    pb::OutcomeReply reply;
    grpc::Status status = call.stub->GetOutcome(&call.ctx, request, &reply);
    CHECK(status.error_code() == grpc::StatusCode::INVALID_ARGUMENT);
    CHECK_THAT(status.error_message(), Catch::Contains("shares_for 7"));
  }
  {
    // A node asks for the shares of nodes below it only (here, at fan-out 32, none is).
    RawCall call(g.server->address());
    pb::OutcomeRequest request;
    request.set_job("job");
    request.set_step(4);
    request.set_node_rank(1);
    request.add_shares_for(2);
    pb::OutcomeReply reply;
    grpc::Status status = call.stub->GetOutcome(&call.ctx, request, &reply);
    CHECK(status.error_code() == grpc::StatusCode::INVALID_ARGUMENT);
    CHECK_THAT(status.error_message(), Catch::Contains("shares_for 2 is not below node 1"));
  }
}

// ---- mutual TLS ----

namespace {

bool Run(const std::string& command) { return std::system((command + " >/dev/null 2>&1").c_str()) == 0; }

std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

// A CA and a certificate it signs for 127.0.0.1, in `dir`.
bool MakeCa(const std::string& dir, const std::string& name) {
  return Run(fmt::format(
      "openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -days 1 "
      "-subj /CN={1} -keyout {0}/{1}.key -out {0}/{1}.pem "
      "-addext basicConstraints=critical,CA:TRUE -addext keyUsage=critical,keyCertSign",
      dir, name));
}

bool MakeCert(const std::string& dir, const std::string& ca, const std::string& name) {
  std::ofstream(dir + "/ext.cnf")
      << "subjectAltName=IP:127.0.0.1\nbasicConstraints=CA:FALSE\n"
         "keyUsage=digitalSignature,keyAgreement\nextendedKeyUsage=serverAuth,clientAuth\n";
  return Run(fmt::format(
             "openssl req -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -subj /CN={2} "
             "-keyout {0}/{2}.key -out {0}/{2}.csr",
             dir, ca, name)) &&
         Run(fmt::format(
             "openssl x509 -req -in {0}/{2}.csr -CA {0}/{1}.pem -CAkey {0}/{1}.key "
             "-CAcreateserial -days 1 -extfile {0}/ext.cnf -out {0}/{2}.pem",
             dir, ca, name));
}

void UseTls(GroupOptions& o, const std::string& dir, const std::string& ca,
            const std::string& cert) {
  o.tls_ca_pem = ReadFile(dir + "/" + ca + ".pem");
  o.tls_cert_pem = ReadFile(dir + "/" + cert + ".pem");
  o.tls_key_pem = ReadFile(dir + "/" + cert + ".key");
}

}  // namespace

TEST_CASE("rpc: mutual TLS admits nodes with the group's certificates only") {
  if (!Run("command -v openssl")) {
    WARN("openssl CLI not found: skipping the TLS test");
    return;
  }
  testing::TempDir certs;
  const std::string& d = certs.path();
  REQUIRE(MakeCa(d, "ca"));
  REQUIRE(MakeCert(d, "ca", "server"));
  REQUIRE(MakeCert(d, "ca", "node1"));
  REQUIRE(MakeCa(d, "rogue-ca"));
  REQUIRE(MakeCert(d, "rogue-ca", "rogue"));

  GroupOptions o = NodeOptions(0, 2, "");
  UseTls(o, d, "ca", "server");
  Group g(2, o);

  GroupOptions node = g.options;
  node.node_rank = 1;
  node.coordinator = g.server->address();
  UseTls(node, d, "ca", "node1");
  auto client = MakeGrpcGroupClient(node, 31, "127.0.0.1:9001");
  REQUIRE(client.ok());
  REQUIRE((*client)->Join(Clock::now() + 3s).ok());
  REQUIRE((*client)->Gather("tls", 0, 1, "hello", 1s).ok());

  // A certificate from another CA: the handshake fails, the call never arrives.
  GroupOptions rogue = node;
  UseTls(rogue, d, "ca", "rogue");
  auto rogue_client = MakeGrpcGroupClient(rogue, 32, "x");
  REQUIRE(rogue_client.ok());
  auto refused = (*rogue_client)->Join(Clock::now() + 500ms);
  CHECK_FALSE(refused.ok());
  CHECK_FALSE(absl::IsUnauthenticated(refused.status()));  // refused before the token check

  // No client certificate at all.
  grpc::SslCredentialsOptions server_only;
  server_only.pem_root_certs = node.tls_ca_pem;
  auto stub = pb::Group::NewStub(
      grpc::CreateChannel(g.server->address(), grpc::SslCredentials(server_only)));
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + 1s);
  ctx.AddMetadata("x-ckptd-group-token", kToken);
  pb::PingReply reply;
  CHECK_FALSE(stub->Ping(&ctx, pb::PingRequest(), &reply).ok());

  // Plaintext to a TLS server.
  GroupOptions plain = node;
  plain.tls_ca_pem = plain.tls_cert_pem = plain.tls_key_pem = "";
  auto plain_client = MakeGrpcGroupClient(plain, 33, "x");
  REQUIRE(plain_client.ok());
  CHECK_FALSE((*plain_client)->Join(Clock::now() + 500ms).ok());
}

TEST_CASE("rpc: a part's rank values travel as one packed column, with metadata only for ranks that have it") {
  format::PartValues values;
  values.step = 7;
  values.run = 42;
  values.wall_time = "2026-11-27T00:00:00Z";
  values.ranks = {{100, {}}, {200, {{"ckptd.aliases", "a=b"}}}, {300, {}}};
  values.xxh3 = {1, 2, 3};
  pb::PartValues wire;
  ToProto(values, &wire);
  CHECK(wire.ranks_size() == 0);
  CHECK(wire.rank_bytes_size() == 3);
  REQUIRE(wire.rank_metadata_size() == 1);
  CHECK(wire.rank_metadata(0).index() == 1);
  absl::StatusOr<format::PartValues> back = FromProto(wire, 7);
  REQUIRE(back.ok());
  REQUIRE(back->ranks.size() == 3);
  CHECK(back->ranks[1].bytes == 200);
  CHECK(back->ranks[1].metadata.at("ckptd.aliases") == "a=b");
  CHECK(back->ranks[2].metadata.empty());
  CHECK(back->xxh3 == values.xxh3);

  // What older nodes send: a message per rank.
  pb::PartValues old;
  auto* r = old.add_ranks();
  r->set_bytes(5);
  (*r->mutable_metadata())["k"] = "v";
  absl::StatusOr<format::PartValues> from_old = FromProto(old, 1);
  REQUIRE(from_old.ok());
  CHECK(from_old->ranks.at(0).bytes == 5);
  CHECK(from_old->ranks.at(0).metadata.at("k") == "v");

  // Malformed: both forms, metadata of a rank not sent, one rank's metadata twice.
  pb::PartValues both = wire;
  both.add_ranks()->set_bytes(1);
  CHECK_THAT(std::string(FromProto(both, 7).status().message()), Catch::Contains("ranks and rank_bytes"));
  pb::PartValues beyond = wire;
  beyond.mutable_rank_metadata(0)->set_index(3);
  CHECK_THAT(std::string(FromProto(beyond, 7).status().message()), Catch::Contains("index 3"));
  pb::PartValues twice = wire;
  *twice.add_rank_metadata() = wire.rank_metadata(0);
  CHECK_THAT(std::string(FromProto(twice, 7).status().message()), Catch::Contains("twice"));
}
