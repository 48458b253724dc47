// A trainer built against the installed client alone: g++ trainer.cc $(pkg-config --cflags --libs ckpt_client),
// or with CMake (CMakeLists.txt beside it: find_package(ckpt_client CONFIG)).
#include <ckpt/ckpt_client.h>

#include <cstdio>
#include <cstring>

int main(int argc, char** argv) {
  auto client = ckpt::Client::Connect({.socket = argv[1], .job = "packaged", .rank = 0, .world_size = 1});
  if (!client.ok()) return std::printf("connect: %s\n", std::string(client.status().message()).c_str()), 1;
  ckpt::Tensor* w = *(*client)->AllocateTensor("w", "F32", {1024});
  if (!(*client)->Register().ok()) return 1;
  if (argc > 2 && std::strcmp(argv[2], "save") == 0) {
    for (int i = 0; i < 1024; ++i) static_cast<float*>(w->data)[i] = i * 0.5f;
    auto ticket = (*client)->Snapshot(7);
    auto state = (*client)->WaitCommitted(*ticket);
    return std::printf("save: %s\n", ckpt::ToString(state->state)), state->state == ckpt::TicketState::kCommitted ? 0 : 1;
  }
  auto r = (*client)->Restore();
  bool same = r.ok() && r->found && r->step == 7 && static_cast<float*>(w->data)[1023] == 1023 * 0.5f;
  return std::printf("restore: step %llu %s\n", r.ok() ? static_cast<unsigned long long>(r->step) : 0ULL,
                     same ? "bit-exact" : "WRONG"), same ? 0 : 1;
}
