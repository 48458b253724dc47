// A deterministic stand-in for a training loop that checkpoints through ckptd. Its
// parameters and optimizer state are float32 tensors in shared memory; every step
// mutates them from an RNG whose state is saved as train state. A run that is killed
// and resumed prints the same final checksum as one that never stopped.
#include <sys/stat.h>
#include <unistd.h>
#include <xxhash.h>

#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include <chrono>
#include <cstring>
#include <future>
#include <iostream>
#include <map>
#include <thread>
#include <vector>

#include "client/ckpt_client.h"
#include "common/status.h"

namespace {

struct Flags {
  std::string socket = "/run/ckptd/ckptd.sock";
  std::string job = "example";
  uint32_t rank = 0;
  uint32_t world_size = 1;
  uint64_t steps = 100;
  uint64_t save_every = 10;
  uint64_t state_bytes = 8u << 20;
  bool resume = false;
  uint32_t step_sleep_ms = 0;
};

struct State {
  float* params = nullptr;
  float* momentum = nullptr;
  size_t n = 0;
  uint64_t rng = 0;
};

void Initialize(State& s, uint32_t rank) {
  for (size_t i = 0; i < s.n; ++i) {
    s.params[i] = static_cast<float>((i * 2654435761u + rank) % 1000) * 1e-3f;
    s.momentum[i] = 0.0f;
  }
  s.rng = 0x9E3779B97F4A7C15ULL ^ rank;
}

void TrainStep(State& s) {
  s.rng = s.rng * 6364136223846793005ULL + 1442695040888963407ULL;
  float lr = static_cast<float>(s.rng >> 40) * 1e-9f;
  for (size_t i = 0; i < s.n; ++i) {
    float grad = s.params[i] * 0.01f - lr * static_cast<float>(i % 7);
    s.momentum[i] = 0.9f * s.momentum[i] + grad;
    s.params[i] -= 0.05f * s.momentum[i];
  }
}

std::string Checksum(const State& s) {
  XXH3_state_t* h = XXH3_createState();
  XXH3_64bits_reset(h);
  XXH3_64bits_update(h, s.params, s.n * sizeof(float));
  XXH3_64bits_update(h, s.momentum, s.n * sizeof(float));
  XXH3_64bits_update(h, &s.rng, sizeof s.rng);
  std::string out = fmt::format("{:016x}", XXH3_64bits_digest(h));
  XXH3_freeState(h);
  return out;
}

std::string RngBytes(uint64_t rng) { return std::string(reinterpret_cast<const char*>(&rng), sizeof rng); }

// How long a trainer without ckptd waits before asking again (the Python client's pace):
// a ckptd that starts, restarts or joins its group after the trainer gets its checkpoints.
constexpr auto kRetryEvery = std::chrono::seconds(2);

absl::StatusOr<std::unique_ptr<ckpt::Client>> Connect(const Flags& f) {
  return ckpt::Client::Connect({.socket = f.socket, .job = f.job, .rank = f.rank, .world_size = f.world_size});
}

// Moves the state into tensors `client` shares with ckptd (the values, if any, come along)
// and registers them. An error when ckptd refuses (e.g. not joined to its group yet); the
// state is then untouched.
absl::Status Adopt(ckpt::Client& client, State& state) {
  const std::vector<int64_t> shape = {static_cast<int64_t>(state.n)};
  CKPT_ASSIGN_OR_RETURN(auto params, client.AllocateTensor("model.params", "F32", shape));
  CKPT_ASSIGN_OR_RETURN(auto momentum, client.AllocateTensor("optim.momentum", "F32", shape));
  auto* p = static_cast<float*>(params->data);
  auto* m = static_cast<float*>(momentum->data);
  if (state.params != nullptr) {
    std::memcpy(p, state.params, state.n * sizeof(float));
    std::memcpy(m, state.momentum, state.n * sizeof(float));
  }
  CKPT_RETURN_IF_ERROR(client.Register());
  state.params = p;
  state.momentum = m;
  return absl::OkStatus();
}

// A trainer without ckptd asks again in the background (connecting may take seconds) and
// adopts the connection at its next save point: training is never held up by the asking.
class Reconnector {
 public:
  explicit Reconnector(const Flags& f) : f_(f) {}
  // A client registered with `state`, once ckptd answers; nullptr until then.
  std::unique_ptr<ckpt::Client> Poll(State& state) {
    const auto now = std::chrono::steady_clock::now();
    if (pending_.valid() && pending_.wait_for(std::chrono::seconds(0)) == std::future_status::ready) {
      auto connected = pending_.get();
      if (connected.ok() && Adopt(**connected, state).ok()) return std::move(*connected);
      next_ = now + kRetryEvery;
    } else if (!pending_.valid() && now >= next_) {
      struct stat st {};
      if (::stat(f_.socket.c_str(), &st) == 0) {  // no socket: nothing to ask yet
        pending_ = std::async(std::launch::async, [f = f_] { return Connect(f); });
      } else {
        next_ = now + kRetryEvery;
      }
    }
    return nullptr;
  }

 private:
  Flags f_;
  std::future<absl::StatusOr<std::unique_ptr<ckpt::Client>>> pending_;
  std::chrono::steady_clock::time_point next_ = std::chrono::steady_clock::now() + kRetryEvery;
};

}  // namespace

int main(int argc, char** argv) {
  Flags f;
  CLI::App app{"example_trainer: a deterministic training loop that checkpoints through ckptd"};
  app.add_option("--socket", f.socket, "ckptd socket")->capture_default_str();
  app.add_option("--job", f.job, "job name")->capture_default_str();
  app.add_option("--rank", f.rank, "this rank")->capture_default_str();
  app.add_option("--world-size", f.world_size, "number of ranks")->capture_default_str();
  app.add_option("--steps", f.steps, "last step to train")->capture_default_str();
  app.add_option("--save-every", f.save_every, "snapshot every K steps (0: never)")->capture_default_str();
  app.add_option("--state-bytes", f.state_bytes, "bytes of float32 state (params + momentum)")
      ->capture_default_str();
  app.add_flag("--resume", f.resume, "restore the latest checkpoint first");
  app.add_option("--step-sleep-ms", f.step_sleep_ms, "sleep after each step (tests)");
  CLI11_PARSE(app, argc, argv);

  State state;
  state.n = std::max<uint64_t>(f.state_bytes / 8, 1);
  std::vector<float> local;  // the state while ckptd is unavailable
  std::unique_ptr<ckpt::Client> client;
  absl::Status attached = absl::OkStatus();
  if (auto connected = Connect(f); !connected.ok()) {
    attached = connected.status();
  } else if (attached = Adopt(**connected, state); attached.ok()) {
    client = std::move(*connected);
  }
  if (!attached.ok() && f.resume) {
    // Never start over silently: a checkpoint may exist that this run cannot see.
    std::cerr << "error: cannot resume: ckptd refused or is unavailable (" << ckpt::Message(attached)
              << "); not starting from step 0 while a checkpoint may exist\n";
    return 1;
  }
  Reconnector reconnector(f);
  if (!client) {
    std::cerr << "warning: ckptd unavailable (" << ckpt::Message(attached)
              << "); training without checkpoints until it answers (asked again every 2 s)\n";
    local.assign(2 * state.n, 0.0f);
    state.params = local.data();
    state.momentum = local.data() + state.n;
  }
  Initialize(state, f.rank);

  uint64_t start = 0;
  if (f.resume && client) {
    auto restored = client->Restore();
    if (!restored.ok()) {
      std::cerr << "error: restore failed: " << ckpt::Message(restored.status()) << "\n";
      return 1;
    }
    if (restored->found) {
      start = restored->step;
      const std::string& rng = restored->train_state["rng"];
      if (rng.size() != sizeof state.rng) {
        std::cerr << "error: checkpoint has no valid rng train state\n";
        return 1;
      }
      std::memcpy(&state.rng, rng.data(), sizeof state.rng);
      std::cout << fmt::format("resumed step={} source={}\n", start,
                               ckpt::RestoreSourceName(restored->source))
                << std::flush;
    } else {
      std::cout << "no checkpoint to resume from; starting at step 0\n" << std::flush;
    }
  }

  std::map<uint64_t, uint64_t> outstanding;  // ticket -> step, until committed or failed
  uint64_t last_ticket = 0;
  auto report = [&](bool wait) {
    for (auto it = outstanding.begin(); it != outstanding.end();) {
      ckpt::TicketStatus st = client->Poll(it->first);
      if (wait && st.state != ckpt::TicketState::kCommitted && st.state != ckpt::TicketState::kFailed &&
          st.state != ckpt::TicketState::kRejected && st.state != ckpt::TicketState::kAbandoned) {
        auto waited = client->WaitCommitted(it->first, std::chrono::minutes(10));
        st = waited.ok() ? *waited : ckpt::TicketStatus{ckpt::TicketState::kFailed, ckpt::Message(waited.status())};
      }
      if (st.state == ckpt::TicketState::kCommitted) {
        std::cout << fmt::format("committed step={}\n", it->second) << std::flush;
      } else if (st.state == ckpt::TicketState::kFailed || st.state == ckpt::TicketState::kRejected ||
                 st.state == ckpt::TicketState::kAbandoned || st.state == ckpt::TicketState::kUnknown) {
        std::cerr << fmt::format("warning: checkpoint of step {} {}: {}\n", it->second,
                                 ckpt::ToString(st.state), st.error);
      } else {
        ++it;
        continue;
      }
      it = outstanding.erase(it);
    }
  };

  std::string session = client ? client->session_id() : "";
  for (uint64_t step = start + 1; step <= f.steps; ++step) {
    if (client && last_ticket != 0) {
      // The next update mutates registered buffers: the last snapshot must be staged.
      auto staged = client->WaitStaged(last_ticket);
      if (!staged.ok()) std::cerr << "warning: " << ckpt::Message(staged.status()) << "\n";
      last_ticket = 0;
    }
    TrainStep(state);
    const bool save = f.save_every != 0 && step % f.save_every == 0;
    if (!client && save) {
      if ((client = reconnector.Poll(state))) {
        session = client->session_id();
        local.clear();
        std::cout << fmt::format("registered with ckptd at step {} (session {})\n", step, session) << std::flush;
      }
    }
    if (client && save) {
      auto ticket = client->Snapshot(step, {{"trainer", "example_trainer"}},
                                     {{"rng", RngBytes(state.rng)}});
      if (client->session_id() != session) {
        // ckptd restarted and the client registered again: tickets start over, and those
        // of the old session died with that ckptd.
        std::cout << fmt::format("registered again with ckptd (session {})\n", client->session_id())
                  << std::flush;
        for (const auto& [old_ticket, old_step] : outstanding) {
          std::cerr << fmt::format("warning: checkpoint of step {} lost: ckptd restarted\n", old_step);
        }
        outstanding.clear();
        session = client->session_id();
      }
      if (ticket.ok()) {
        last_ticket = *ticket;
        outstanding[*ticket] = step;
      } else {
        std::cerr << fmt::format("warning: snapshot of step {} not taken: {}\n", step,
                                 ckpt::Message(ticket.status()));
      }
    }
    if (client) report(false);
    if (f.step_sleep_ms) std::this_thread::sleep_for(std::chrono::milliseconds(f.step_sleep_ms));
  }
  if (client) report(true);
  std::cout << fmt::format("final checksum={}\n", Checksum(state)) << std::flush;
  return 0;
}
