// A TCP proxy that a test controls: listens on 127.0.0.1:<ephemeral> and forwards every
// connection to a target. Cut() simulates a network partition (drops every connection and
// refuses or silently swallows new ones), Answer() a server that answers every request with
// an error; Heal() ends either. One thread, poll(), bounded buffers.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <string>
#include <thread>

namespace ckpt::testing {

class TcpProxy {
 public:
  enum class CutMode {
    kRefuse,     // new connections are accepted and reset at once
    kBlackhole,  // new connections are accepted and never answered (bytes read and dropped)
  };

  // Forwards to target_host:target_port (an IPv4 address such as 127.0.0.1).
  TcpProxy(std::string target_host, int target_port);
  ~TcpProxy();
  TcpProxy(const TcpProxy&) = delete;
  TcpProxy& operator=(const TcpProxy&) = delete;

  int port() const { return port_; }
  std::string address() const { return "127.0.0.1:" + std::to_string(port_); }

  // Resets every open connection (both sides) and applies `mode` to new ones; returns once
  // the connections are closed.
  void Cut(CutMode mode = CutMode::kRefuse);
  // Like Cut, but each new connection gets `response` (bytes of an HTTP answer, say a 503)
  // and whatever it sends is dropped: a server that is up and refuses every request.
  void Answer(std::string response);
  // Closes any blackholed or answered connections and forwards new connections again.
  void Heal();

  bool cut() const { return cut_; }
  // Connections accepted and forwarded to the target since the start.
  uint64_t forwarded_connections() const { return forwarded_; }
  // Bytes forwarded in either direction since the start.
  uint64_t forwarded_bytes() const { return bytes_; }
  // Connections accepted while cut (refused or blackholed).
  uint64_t refused_connections() const { return refused_; }

 private:
  void Loop();
  void Submit(int command);  // waits until the loop thread has applied it

  const std::string target_host_;
  const int target_port_;
  int listen_fd_ = -1;
  int wake_[2] = {-1, -1};
  int port_ = 0;

  std::mutex mu_;
  std::condition_variable cv_;
  int pending_command_ = 0;  // 0: none
  uint64_t commands_submitted_ = 0, commands_done_ = 0;
  std::atomic<bool> cut_{false};
  std::atomic<bool> blackhole_{false};
  std::string answer_;  // Answer()'s response; written before the loop applies the cut
  std::atomic<bool> stopping_{false};
  std::atomic<uint64_t> forwarded_{0}, bytes_{0}, refused_{0};
  std::thread thread_;
};

}  // namespace ckpt::testing
