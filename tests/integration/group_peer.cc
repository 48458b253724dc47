// A hostile (or merely misconfigured) peer of the daemons' group for integration tests:
// makes one group call with whatever token it is given (or none) and prints the answer.
//   group_peer --addr HOST:PORT [--token T] abort --job J --step N
//   group_peer --addr HOST:PORT [--token T] join --node-rank R --num-nodes K
// Prints "code=<grpc code> message=<text>"; exits 0 when the call succeeded, 1 otherwise.
#include <CLI/CLI.hpp>
#include <grpcpp/grpcpp.h>

#include <chrono>
#include <iostream>

#include "proto/group.grpc.pb.h"

namespace pb = ckptd::group::v1;

int main(int argc, char** argv) {
  std::string addr, token, job = "g";
  bool send_token = false;
  uint64_t step = 0;
  uint32_t node_rank = 1, num_nodes = 2;
  CLI::App app{"group_peer"};
  app.require_subcommand(1);
  app.add_option("--addr", addr)->required();
  app.add_option("--token", token)->each([&](const std::string&) { send_token = true; });
  auto* abort = app.add_subcommand("abort");
  abort->add_option("--job", job);
  abort->add_option("--step", step)->required();
  auto* join = app.add_subcommand("join");
  join->add_option("--node-rank", node_rank);
  join->add_option("--num-nodes", num_nodes);
  for (auto* sub : {abort, join}) sub->fallthrough();
  CLI11_PARSE(app, argc, argv);

  auto stub = pb::Group::NewStub(grpc::CreateChannel(addr, grpc::InsecureChannelCredentials()));
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  if (send_token) ctx.AddMetadata("x-ckptd-group-token", token);
  grpc::Status status;
  if (abort->parsed()) {
    pb::AbortRequest request;
    request.set_node_rank(1);
    request.set_job(job);
    request.set_step(step);
    request.set_reason("group_peer says so");
    pb::AbortReply reply;
    status = stub->Abort(&ctx, request, &reply);
  } else {
    pb::JoinRequest request;
    request.set_node_rank(node_rank);
    request.set_num_nodes(num_nodes);
    request.set_address("127.0.0.1:1");
    request.set_incarnation(0x5eed);
    pb::JoinReply reply;
    status = stub->Join(&ctx, request, &reply);
  }
  std::cout << "code=" << status.error_code() << " message=" << status.error_message() << std::endl;
  return status.ok() ? 0 : 1;
}
