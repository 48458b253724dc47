#include "daemon/metrics/http_exporter.h"

#include <fmt/format.h>
#include <sys/socket.h>

#include <atomic>
#include <boost/asio/ip/tcp.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <condition_variable>
#include <mutex>
#include <map>
#include <thread>

namespace ckpt::metrics {
namespace {

namespace asio = boost::asio;
namespace beast = boost::beast;
namespace http = beast::http;
using tcp = asio::ip::tcp;

constexpr int kMaxConnections = 4;
constexpr auto kDeadline = std::chrono::seconds(10);
constexpr char kContentType[] = "text/plain; version=0.0.4; charset=utf-8";

class BeastExporter final : public HttpExporter {
 public:
  explicit BeastExporter(std::function<std::string()> render) : render_(std::move(render)) {}
  ~BeastExporter() override {
    stopping_ = true;
    // A blocking accept() or read() wakes when its socket is shut down.
    if (acceptor_.is_open()) ::shutdown(acceptor_.native_handle(), SHUT_RDWR);
    if (thread_.joinable()) thread_.join();
    std::unique_lock lock(mu_);
    for (const auto& [fd, since] : open_) ::shutdown(fd, SHUT_RDWR);
    idle_.notify_all();  // the watchdog
    idle_.wait(lock, [this] { return serving_ == 0; });
    lock.unlock();
    if (watchdog_.joinable()) watchdog_.join();
  }

  absl::Status Listen(const std::string& addr) {
    auto colon = addr.rfind(':');
    if (colon == std::string::npos) return absl::InvalidArgumentError(fmt::format("\"{}\" is not HOST:PORT", addr));
    std::string host = addr.substr(0, colon);
    if (host.size() >= 2 && host.front() == '[' && host.back() == ']') host = host.substr(1, host.size() - 2);
    beast::error_code ec;
    const auto ip = asio::ip::make_address(host, ec);
    if (ec) return absl::InvalidArgumentError(fmt::format("\"{}\" is not an IP address", host));
    int port = 0;
    try {
      port = std::stoi(addr.substr(colon + 1));
    } catch (const std::exception&) {
      port = -1;
    }
    if (port < 0 || port > 65535) {
      return absl::InvalidArgumentError(fmt::format("\"{}\" is not a port", addr.substr(colon + 1)));
    }
    tcp::endpoint endpoint(ip, static_cast<unsigned short>(port));
    acceptor_.open(endpoint.protocol(), ec);
    if (!ec) acceptor_.set_option(asio::socket_base::reuse_address(true), ec);
    if (!ec) acceptor_.bind(endpoint, ec);
    if (!ec) acceptor_.listen(asio::socket_base::max_listen_connections, ec);
    if (ec) return absl::UnavailableError(fmt::format("cannot listen on {}: {}", addr, ec.message()));
    port_ = acceptor_.local_endpoint().port();
    thread_ = std::thread([this] { AcceptLoop(); });
    watchdog_ = std::thread([this] { Watchdog(); });
    return absl::OkStatus();
  }

  int port() const override { return port_; }

 private:
  // Reads here block (Beast's deadlines apply to asynchronous calls only): a connection
  // still open kDeadline after it was accepted, idle or dripping bytes, is shut down.
  void Watchdog() {
    std::unique_lock lock(mu_);
    while (!stopping_) {
      idle_.wait_for(lock, std::chrono::milliseconds(250));
      const auto now = std::chrono::steady_clock::now();
      for (const auto& [fd, since] : open_) {
        if (now - since > kDeadline) ::shutdown(fd, SHUT_RDWR);
      }
    }
  }

  void AcceptLoop() {
    while (!stopping_) {
      tcp::socket socket(io_);
      beast::error_code ec;
      acceptor_.accept(socket, ec);
      if (ec) {
        if (stopping_ || ec == asio::error::bad_descriptor) return;
        // Out of descriptors (EMFILE) leaves the connection queued: wait, do not spin.
        std::this_thread::sleep_for(std::chrono::milliseconds(100));
        continue;
      }
      std::unique_lock lock(mu_);
      if (serving_ >= kMaxConnections || stopping_) continue;  // closed: the scraper retries
      ++serving_;
      const int fd = socket.native_handle();
      open_[fd] = std::chrono::steady_clock::now();
      lock.unlock();
      std::thread([this, fd, s = std::move(socket)]() mutable {
        {
          beast::tcp_stream stream(std::move(s));
          Serve(stream);
          // Closed while no one can shut its number down: the number may be reused at once.
          std::lock_guard closing(mu_);
          open_.erase(fd);
          beast::error_code ignored;
          stream.socket().close(ignored);
        }
        std::lock_guard done(mu_);
        if (--serving_ == 0) idle_.notify_all();
      }).detach();
    }
  }

  void Serve(beast::tcp_stream& stream) {
    beast::flat_buffer buffer;
    for (int requests = 0; requests < 16 && !stopping_; ++requests) {
      http::request_parser<http::empty_body> parser;
      parser.header_limit(8 * 1024);
      beast::error_code ec;
      http::read(stream, buffer, parser, ec);
      if (ec) return;
      const auto& request = parser.get();
      http::response<http::string_body> response;
      response.version(request.version());
      response.keep_alive(request.keep_alive());
      response.set(http::field::server, "ckptd");
      const std::string target(request.target());
      const std::string path = target.substr(0, target.find('?'));
      if (request.method() != http::verb::get && request.method() != http::verb::head) {
        response.result(http::status::method_not_allowed);
        response.set(http::field::allow, "GET, HEAD");
        response.body() = "only GET and HEAD\n";
      } else if (path == "/metrics") {
        response.result(http::status::ok);
        response.set(http::field::content_type, kContentType);
        response.body() = render_();
      } else if (path == "/") {
        response.result(http::status::ok);
        response.set(http::field::content_type, "text/plain; charset=utf-8");
        response.body() = "ckptd: metrics at /metrics\n";
      } else {
        response.result(http::status::not_found);
        response.body() = fmt::format("no {} here: metrics are at /metrics\n", path.substr(0, 200));
      }
      response.prepare_payload();
      if (request.method() == http::verb::head) {
        http::response_serializer<http::string_body> header_only(response);
        http::write_header(stream, header_only, ec);
      } else {
        http::write(stream, response, ec);
      }
      if (ec || !response.keep_alive()) break;
    }
    beast::error_code ignored;
    stream.socket().shutdown(tcp::socket::shutdown_send, ignored);
  }


  const std::function<std::string()> render_;
  asio::io_context io_;
  tcp::acceptor acceptor_{io_};
  int port_ = 0;
  std::atomic<bool> stopping_{false};
  std::thread thread_;
  std::mutex mu_;
  std::condition_variable idle_;
  int serving_ = 0;
  // The serving connections' descriptors and when each was accepted, guarded by mu_.
  std::map<int, std::chrono::steady_clock::time_point> open_;
  std::thread watchdog_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<HttpExporter>> HttpExporter::Start(const std::string& addr,
                                                                  std::function<std::string()> render) {
  auto exporter = std::make_unique<BeastExporter>(std::move(render));
  if (absl::Status listening = exporter->Listen(addr); !listening.ok()) return listening;
  return exporter;
}

}  // namespace ckpt::metrics
