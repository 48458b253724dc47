#include "storage/s3_store.h"

#include <curl/curl.h>
#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <charconv>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <map>
#include <mutex>
#include <optional>
#include <random>
#include <semaphore>
#include <sstream>
#include <thread>
#include <utility>
#include <vector>

#include <boost/property_tree/ptree.hpp>
#include <boost/property_tree/xml_parser.hpp>

#include "common/parallel.h"
#include "common/status.h"
#include "storage/aligned_buffer.h"

namespace ckpt::storage {
namespace {

using Query = std::vector<std::pair<std::string, std::string>>;

// S3's URI encoding: every byte but unreserved ones (and '/' in a key's path) as %XX.
std::string Encode(std::string_view s, bool keep_slash) {
  std::string out;
  for (unsigned char c : s) {
    if (std::isalnum(c) || c == '-' || c == '_' || c == '.' || c == '~' || (keep_slash && c == '/')) {
      out.push_back(static_cast<char>(c));
    } else {
      out += fmt::format("%{:02X}", c);
    }
  }
  return out;
}

// What an S3 error body says: "<Code>: <Message>", or the HTTP status.
std::string ErrorOf(long status, const std::string& body) {
  auto field = [&](const char* tag) {
    std::string open = fmt::format("<{}>", tag), close = fmt::format("</{}>", tag);
    size_t b = body.find(open);
    if (b == std::string::npos) return std::string();
    b += open.size();
    size_t e = body.find(close, b);
    return e == std::string::npos ? std::string() : body.substr(b, e - b);
  };
  std::string code = field("Code"), message = field("Message");
  if (code.empty()) return fmt::format("HTTP {}", status);
  return message.empty() ? fmt::format("HTTP {} {}", status, code)
                         : fmt::format("HTTP {} {}: {}", status, code, message);
}

boost::property_tree::ptree ParseXml(const std::string& body) {
  std::istringstream in(body);
  boost::property_tree::ptree tree;
  boost::property_tree::read_xml(in, tree);
  return tree;
}

struct Response {
  long status = 0;
  std::string body;
  std::map<std::string, std::string> headers;  // names lower case
};

struct Request {
  const char* method = "GET";
  std::string key;  // within the bucket; empty: the bucket itself
  Query query;      // sorted by name (SigV4 signs them in order), values not yet encoded
  std::vector<std::string> headers;
  const char* body = nullptr;  // uploaded
  size_t body_size = 0;
  char* into = nullptr;  // GET straight into caller memory, exactly into_size bytes
  size_t into_size = 0;
  size_t max_body = size_t{1} << 30;  // a 2xx answer kept in Response::body: at most this
  // Clean-up (aborting a multipart upload): still sent after Cancel(), once, for at most
  // kCleanupTimeout, so that a stop does not leave stored, billed parts behind.
  bool cleanup = false;
};

constexpr std::chrono::milliseconds kCleanupTimeout{3000};

// Everything a transfer's callbacks touch.
struct Transfer {
  const Request* request;
  Response* response;
  const std::atomic<bool>* cancelled;  // the client's
  size_t sent = 0;
  size_t received = 0;
  bool overflow = false;
};

size_t OnBody(char* data, size_t size, size_t n, void* user) {
  auto* t = static_cast<Transfer*>(user);
  const size_t bytes = size * n;
  if (t->request->into != nullptr && t->response->status / 100 == 2) {
    if (t->received + bytes > t->request->into_size) {
      t->overflow = true;
      return 0;  // aborts: the server sent more than the range asked for
    }
    std::memcpy(t->request->into + t->received, data, bytes);
  } else {
    // An error's XML body is never large; the cap is for what was asked for.
    const size_t cap = t->response->status / 100 == 2 ? t->request->max_body : size_t{1} << 20;
    if (t->response->body.size() + bytes > cap) {
      t->overflow = true;
      return 0;
    }
    t->response->body.append(data, bytes);
  }
  t->received += bytes;
  return bytes;
}

size_t OnHeader(char* data, size_t size, size_t n, void* user) {
  auto* t = static_cast<Transfer*>(user);
  std::string_view line(data, size * n);
  if (line.rfind("HTTP/", 0) == 0) {
    t->response->headers.clear();  // a new response (after a 100 Continue)
    size_t sp = line.find(' ');
    if (sp != std::string_view::npos) t->response->status = std::atol(std::string(line.substr(sp + 1, 3)).c_str());
    return size * n;
  }
  size_t colon = line.find(':');
  if (colon != std::string_view::npos) {
    std::string name(line.substr(0, colon));
    std::transform(name.begin(), name.end(), name.begin(), [](unsigned char c) { return std::tolower(c); });
    std::string value(line.substr(colon + 1));
    value.erase(0, value.find_first_not_of(" \t"));
    value.erase(value.find_last_not_of(" \t\r\n") + 1);
    t->response->headers[name] = value;
  }
  return size * n;
}

size_t OnSend(char* buffer, size_t size, size_t n, void* user) {
  auto* t = static_cast<Transfer*>(user);
  const size_t bytes = std::min(size * n, t->request->body_size - t->sent);
  std::memcpy(buffer, t->request->body + t->sent, bytes);
  t->sent += bytes;
  return bytes;
}

class S3Client {
 public:
  explicit S3Client(S3Options options)
      : options_(std::move(options)), in_flight_(std::clamp(options_.max_requests, 1, kMaxRequests)) {
    static std::once_flag once;
    std::call_once(once, [] { curl_global_init(CURL_GLOBAL_DEFAULT); });
    sigv4_ = fmt::format("aws:amz:{}:s3", options_.region);
    if (!options_.path_style) {
      // https://bucket.host[:port]
      const size_t scheme = options_.endpoint.find("://") + 3;
      host_base_ = options_.endpoint.substr(0, scheme) + options_.bucket + "." + options_.endpoint.substr(scheme);
    }
  }
  ~S3Client() {
    for (CURL* h : idle_) curl_easy_cleanup(h);
  }

  const S3Options& options() const { return options_; }

  // The object's key in the bucket (under the store's prefix).
  std::string Key(std::string_view key) const {
    if (options_.prefix.empty()) return std::string(key);
    if (key.empty()) return options_.prefix;
    return options_.prefix + "/" + std::string(key);
  }
  std::string Url(std::string_view key) const {
    return fmt::format("s3://{}/{}", options_.bucket, Key(key));
  }

  // Sends `r`, retried with jittered exponential back-off on 5xx, 429 and transport
  // failures; the final answer, or why there is none. `what` names it in errors.
  absl::StatusOr<Response> Send(const Request& r, std::string_view what) {
    std::mt19937_64 random(std::random_device{}());
    for (int attempt = 1;; ++attempt) {
      if (cancelled_ && !r.cleanup) return Cancelled(what);
      Response response;
      Transfer t{&r, &response, &cancelled_};
      CURL* h = Acquire();
      struct curl_slist* headers = Configure(h, r, t);
      in_flight_.acquire();
      CURLcode code = curl_easy_perform(h);
      in_flight_.release();
      long status = 0;
      curl_easy_getinfo(h, CURLINFO_RESPONSE_CODE, &status);
      curl_easy_setopt(h, CURLOPT_HTTPHEADER, nullptr);
      curl_slist_free_all(headers);
      Release(h, code == CURLE_OK);
      const bool stopping = cancelled_;
      if (stopping && !r.cleanup) return Cancelled(what);
      response.status = status;
      bool retry = false;
      std::string why;
      if (code != CURLE_OK) {
        why = t.overflow ? fmt::format("the server sent more than the {} bytes asked for (does it ignore Range?)",
                                       r.into != nullptr ? r.into_size : r.max_body)
                         : curl_easy_strerror(code);
        retry = !t.overflow;
      } else if (status >= 500 || status == 429 || status == 408) {
        why = ErrorOf(status, response.body);
        retry = true;
      } else if (r.into != nullptr && status / 100 == 2 && t.received != r.into_size) {
        why = fmt::format("{} bytes arrived, {} asked for", t.received, r.into_size);
        retry = true;
      } else {
        return response;
      }
      if (!retry || attempt >= options_.attempts || stopping) {
        return absl::UnavailableError(fmt::format(
            "S3 {}: {}{}", what, why, retry ? fmt::format(" (after {} attempts)", attempt) : ""));
      }
      // 100 ms, 200 ms, ... up to 5 s, each jittered over [half, whole].
      const auto cap = std::min<int64_t>(5000, int64_t{100} << std::min(attempt - 1, 6));
      std::uniform_int_distribution<int64_t> jitter(cap / 2, cap);
      std::unique_lock lock(mu_);
      cancel_cv_.wait_for(lock, std::chrono::milliseconds(jitter(random)), [this] { return cancelled_.load(); });
    }
  }

  void Cancel() {
    cancelled_ = true;
    std::lock_guard lock(mu_);  // a Send between its check and its wait sees it there
    cancel_cv_.notify_all();
  }

  // Send, and an error status for any answer but 2xx (404: NotFound, 403: PermissionDenied).
  absl::StatusOr<Response> SendOk(const Request& r, std::string_view what) {
    CKPT_ASSIGN_OR_RETURN(Response response, Send(r, what));
    if (response.status / 100 == 2) return response;
    return StatusOf(response, what);
  }

  // What an answer other than 2xx means.
  absl::Status StatusOf(const Response& response, std::string_view what) const {
    std::string message = fmt::format("S3 {}: {}", what, ErrorOf(response.status, response.body));
    switch (response.status) {
      case 404:
        if (response.body.find("<Code>NoSuchBucket</Code>") != std::string::npos) {
          return absl::NotFoundError(fmt::format(
              "{} (the bucket {} does not exist: create it, or correct the s3:// URL)", message,
              options_.bucket));
        }
        return absl::NotFoundError(message);
      case 401:
      case 403:
        return absl::PermissionDeniedError(message + " (check the S3 credentials and the bucket's policy)");
      case 400: return absl::InvalidArgumentError(message);
      case 409: return absl::FailedPreconditionError(message);
      default: return absl::UnknownError(message);
    }
  }

 private:
  std::string UrlFor(const Request& r) const {
    std::string url = options_.path_style
                          ? fmt::format("{}/{}", options_.endpoint, options_.bucket)
                          : host_base_;
    if (!r.key.empty()) url += "/" + Encode(r.key, /*keep_slash=*/true);
    else if (!options_.path_style) url += "/";
    for (size_t i = 0; i < r.query.size(); ++i) {
      url += i == 0 ? "?" : "&";
      url += Encode(r.query[i].first, false) + "=" + Encode(r.query[i].second, false);
    }
    return url;
  }

  // Sets `h` up for `r`; returns its header list, to be freed after the transfer.
  struct curl_slist* Configure(CURL* h, const Request& r, Transfer& t) {
    curl_easy_setopt(h, CURLOPT_URL, UrlFor(r).c_str());
    curl_easy_setopt(h, CURLOPT_AWS_SIGV4, sigv4_.c_str());
    curl_easy_setopt(h, CURLOPT_USERNAME, options_.credentials.access_key.c_str());
    curl_easy_setopt(h, CURLOPT_PASSWORD, options_.credentials.secret_key.c_str());
    curl_easy_setopt(h, CURLOPT_NOSIGNAL, 1L);
    curl_easy_setopt(h, CURLOPT_TCP_KEEPALIVE, 1L);
    curl_easy_setopt(h, CURLOPT_CONNECTTIMEOUT_MS, static_cast<long>(options_.connect_timeout.count()));
    // A connection that moves nothing for stall_timeout is dropped (and the request retried).
    curl_easy_setopt(h, CURLOPT_LOW_SPEED_LIMIT, 1L);
    curl_easy_setopt(h, CURLOPT_LOW_SPEED_TIME, static_cast<long>(std::max<int64_t>(1, options_.stall_timeout.count() / 1000)));
    if (!options_.ca_bundle.empty()) curl_easy_setopt(h, CURLOPT_CAINFO, options_.ca_bundle.c_str());
    curl_easy_setopt(h, CURLOPT_WRITEFUNCTION, OnBody);
    curl_easy_setopt(h, CURLOPT_WRITEDATA, &t);
    curl_easy_setopt(h, CURLOPT_HEADERFUNCTION, OnHeader);
    curl_easy_setopt(h, CURLOPT_HEADERDATA, &t);
    curl_easy_setopt(h, CURLOPT_NOPROGRESS, 0L);
    curl_easy_setopt(h, CURLOPT_XFERINFOFUNCTION, OnProgress);
    curl_easy_setopt(h, CURLOPT_XFERINFODATA, &t);
    if (r.cleanup) curl_easy_setopt(h, CURLOPT_TIMEOUT_MS, static_cast<long>(kCleanupTimeout.count()));
    struct curl_slist* headers = nullptr;
    // curl does not add it, and RGW and S3 refuse a signature without it.
    headers = curl_slist_append(headers, "x-amz-content-sha256: UNSIGNED-PAYLOAD");
    if (!options_.credentials.session_token.empty()) {
      headers = curl_slist_append(
          headers, ("x-amz-security-token: " + options_.credentials.session_token).c_str());
    }
    for (const std::string& header : r.headers) headers = curl_slist_append(headers, header.c_str());
    const std::string method = r.method;
    if (method == "PUT" || (method == "POST" && r.body != nullptr)) {
      curl_easy_setopt(h, CURLOPT_UPLOAD, 1L);
      curl_easy_setopt(h, CURLOPT_READFUNCTION, OnSend);
      curl_easy_setopt(h, CURLOPT_READDATA, &t);
      curl_easy_setopt(h, CURLOPT_INFILESIZE_LARGE, static_cast<curl_off_t>(r.body_size));
      // Not "Expect:" to skip the 100-continue round trip: curl 7.88 signs the emptied header
      // and the server, which never sees it, refuses the signature.
      if (method == "POST") curl_easy_setopt(h, CURLOPT_CUSTOMREQUEST, "POST");
    } else if (method == "POST") {
      curl_easy_setopt(h, CURLOPT_POST, 1L);
      curl_easy_setopt(h, CURLOPT_POSTFIELDSIZE, 0L);
      curl_easy_setopt(h, CURLOPT_POSTFIELDS, "");
    } else if (method == "HEAD") {
      curl_easy_setopt(h, CURLOPT_NOBODY, 1L);
    } else if (method == "DELETE") {
      curl_easy_setopt(h, CURLOPT_CUSTOMREQUEST, "DELETE");
    }
    curl_easy_setopt(h, CURLOPT_HTTPHEADER, headers);
    return headers;
  }

  // Handles are reused, and with them their connections.
  CURL* Acquire() {
    std::lock_guard lock(mu_);
    if (!idle_.empty()) {
      CURL* h = idle_.back();
      idle_.pop_back();
      curl_easy_reset(h);
      return h;
    }
    return curl_easy_init();
  }
  void Release(CURL* h, bool keep) {
    std::lock_guard lock(mu_);
    if (keep && idle_.size() < 64) {
      idle_.push_back(h);
    } else {
      curl_easy_cleanup(h);
    }
  }

  static absl::Status Cancelled(std::string_view what) {
    return absl::CancelledError(fmt::format("S3 {}: ckptd is stopping", what));
  }
  // libcurl asks about once a second, whether bytes move or not.
  static int OnProgress(void* transfer, curl_off_t, curl_off_t, curl_off_t, curl_off_t) {
    const auto* t = static_cast<const Transfer*>(transfer);
    return *t->cancelled && !t->request->cleanup ? 1 : 0;  // nonzero: abort
  }

  const S3Options options_;
  std::string sigv4_;
  std::string host_base_;
  std::atomic<bool> cancelled_ = false;
  std::condition_variable cancel_cv_;  // with mu_: a back-off ends at Cancel()
  std::mutex mu_;
  std::vector<CURL*> idle_;  // guarded by mu_
  static constexpr int kMaxRequests = 1024;
  std::counting_semaphore<kMaxRequests> in_flight_;  // S3Options::max_requests
};

// One multipart upload of an object: begun, its parts sent from any thread in any order,
// then completed; aborted if it goes before that (an unfinished upload is invisible, but
// stored and billed until aborted).
class MultipartUpload {
 public:
  MultipartUpload(std::shared_ptr<S3Client> client, std::string key)
      : client_(std::move(client)), key_(std::move(key)) {}
  // Resumes an upload begun earlier, with the parts it already holds.
  MultipartUpload(std::shared_ptr<S3Client> client, std::string key, std::string id,
                  std::map<int, std::string> etags)
      : client_(std::move(client)), key_(std::move(key)), id_(std::move(id)), etags_(std::move(etags)) {}
  ~MultipartUpload() {
    if (!id_.empty() && !completed_) {
      Request r{.method = "DELETE", .key = client_->Key(key_), .query = {{"uploadId", id_}},
                .cleanup = true};
      (void)client_->Send(r, "abort upload " + client_->Url(key_));
    }
  }

  absl::Status Begin() {
    Request r{.method = "POST", .key = client_->Key(key_), .query = {{"uploads", ""}}};
    CKPT_ASSIGN_OR_RETURN(Response created, client_->SendOk(r, "create upload " + client_->Url(key_)));
    try {
      id_ = ParseXml(created.body).get<std::string>("InitiateMultipartUploadResult.UploadId");
    } catch (const std::exception& e) {
      return absl::DataLossError(fmt::format("S3 create upload {}: no UploadId in the answer", client_->Url(key_)));
    }
    return absl::OkStatus();
  }

  // Any thread, once Begin() returned.
  absl::Status SendPart(int number, const char* data, size_t size) {
    Request r{.method = "PUT", .key = client_->Key(key_),
              .query = {{"partNumber", std::to_string(number)}, {"uploadId", id_}},
              .body = data, .body_size = size};
    CKPT_ASSIGN_OR_RETURN(Response sent, client_->SendOk(r, fmt::format("PUT {} part {}", client_->Url(key_), number)));
    auto etag = sent.headers.find("etag");
    if (etag == sent.headers.end()) {
      return absl::DataLossError(fmt::format("S3 PUT {} part {}: no ETag in the answer", client_->Url(key_), number));
    }
    std::lock_guard lock(mu_);
    etags_[number] = etag->second;
    return absl::OkStatus();
  }

  bool HasPart(int number) {
    std::lock_guard lock(mu_);
    return etags_.count(number) > 0;
  }
  // Leaves the upload unfinished (not aborted) for a later copy to resume: its id and parts.
  std::pair<std::string, std::map<int, std::string>> Release() {
    std::lock_guard lock(mu_);
    return {std::exchange(id_, ""), std::move(etags_)};
  }

  // Once every part was sent.
  absl::Status Complete() {
    const std::string what = "complete PUT " + client_->Url(key_);
    std::string xml = "<CompleteMultipartUpload>";
    {
      std::lock_guard lock(mu_);
      for (const auto& [number, etag] : etags_) {
        xml += fmt::format("<Part><PartNumber>{}</PartNumber><ETag>{}</ETag></Part>", number, etag);
      }
    }
    xml += "</CompleteMultipartUpload>";
    Request r{.method = "POST", .key = client_->Key(key_), .query = {{"uploadId", id_}},
              .headers = {"Content-Type: application/xml"}, .body = xml.data(), .body_size = xml.size()};
    CKPT_ASSIGN_OR_RETURN(Response done, client_->SendOk(r, what));
    // S3 may answer 200 and an error in the body.
    if (done.body.find("<Error>") != std::string::npos) {
      return absl::UnavailableError(fmt::format("S3 {}: {}", what, ErrorOf(done.status, done.body)));
    }
    completed_ = true;
    return absl::OkStatus();
  }

 private:
  std::shared_ptr<S3Client> client_;
  const std::string key_;
  std::string id_;
  bool completed_ = false;
  std::mutex mu_;
  std::map<int, std::string> etags_;  // guarded by mu_
};

// Part buffers of one copy, reused: a fresh buffer per part cost the kernel's page faults
// and frees on every part (a tenth of an upload's CPU here, taken from the gateway).
class PartBuffers {
 public:
  struct Buffer {
    AlignedBuffer data;  // null when no memory was to be had
    size_t capacity = 0;
  };
  Buffer Take(size_t bytes) {
    {
      std::lock_guard lock(mu_);
      for (auto it = free_.begin(); it != free_.end(); ++it) {
        if (it->capacity >= bytes) {
          Buffer taken = std::move(*it);
          free_.erase(it);
          return taken;
        }
      }
      // Parts grew (every 1,000): the smaller buffers are of no more use.
      free_.clear();
    }
    return {AllocateAligned(bytes), bytes};
  }
  void Give(Buffer buffer) {
    std::lock_guard lock(mu_);
    free_.push_back(std::move(buffer));
  }

 private:
  std::mutex mu_;
  std::vector<Buffer> free_;  // guarded by mu_
};

// S3 allows 10,000 parts: parts grow as an object does (doubling every 1,000), so any size fits.
size_t PartBytes(size_t first, int number) { return first << ((number - 1) / 1000); }

class S3ObjectWriter final : public ObjectWriter {
 public:
  S3ObjectWriter(std::shared_ptr<S3Client> client, std::string key)
      : client_(std::move(client)), key_(std::move(key)), upload_(client_, key_),
        parts_(client_->options().parallel) {
    buffer_.reserve(client_->options().part_bytes);
  }
  ~S3ObjectWriter() override { (void)parts_.Wait(); }  // before upload_ aborts

  absl::Status Append(const char* data, size_t size) override {
    while (size > 0) {
      const size_t part_bytes = PartBytes(client_->options().part_bytes, parts_sent_ + 1);
      const size_t n = std::min(size, part_bytes - buffer_.size());
      buffer_.append(data, n);
      data += n;
      size -= n;
      size_ += n;
      if (buffer_.size() == part_bytes) CKPT_RETURN_IF_ERROR(SendPart());
    }
    return absl::OkStatus();
  }

  absl::StatusOr<uint64_t> Finish() override {
    if (parts_sent_ == 0) {
      Request r{.method = "PUT", .key = client_->Key(key_), .body = buffer_.data(), .body_size = buffer_.size()};
      CKPT_RETURN_IF_ERROR(client_->SendOk(r, "PUT " + client_->Url(key_)).status());
      return size_;
    }
    if (!buffer_.empty()) CKPT_RETURN_IF_ERROR(SendPart());
    CKPT_RETURN_IF_ERROR(parts_.Wait());
    CKPT_RETURN_IF_ERROR(upload_.Complete());
    return size_;
  }

 private:
  absl::Status SendPart() {
    if (parts_sent_ == 0) CKPT_RETURN_IF_ERROR(upload_.Begin());
    const int number = ++parts_sent_;
    auto part = std::make_shared<std::string>(std::move(buffer_));
    buffer_ = std::string();
    buffer_.reserve(PartBytes(client_->options().part_bytes, number + 1));
    return parts_.Run([this, number, part] { return upload_.SendPart(number, part->data(), part->size()); });
  }

  std::shared_ptr<S3Client> client_;
  const std::string key_;
  std::string buffer_;
  uint64_t size_ = 0;
  int parts_sent_ = 0;
  MultipartUpload upload_;
  Parallel parts_;  // last: waited for before the rest goes
};

class S3ObjectReader final : public ObjectReader {
 public:
  // `head`: the object's first bytes, fetched when it was opened.
  S3ObjectReader(std::shared_ptr<S3Client> client, std::string key, uint64_t size, std::string head)
      : client_(std::move(client)), key_(std::move(key)), name_(client_->Url(key_)), size_(size),
        head_(std::move(head)) {}

  uint64_t size() const override { return size_; }
  const std::string& name() const override { return name_; }

  absl::Status ReadAt(void* data, size_t size, uint64_t offset) const override {
    if (offset > size_ || size > size_ - offset) {
      return absl::OutOfRangeError(fmt::format("{}: {} bytes at {} are past its end ({} bytes)",
                                               name_, size, offset, size_));
    }
    if (size == 0) return absl::OkStatus();
    if (offset + size <= head_.size()) {  // a file's header: no round trip
      std::memcpy(data, head_.data() + offset, size);
      return absl::OkStatus();
    }
    const uint64_t piece = client_->options().part_bytes;
    Parallel gets(client_->options().parallel);
    for (uint64_t done = 0; done < size; done += piece) {
      const uint64_t n = std::min<uint64_t>(piece, size - done);
      char* into = static_cast<char*>(data) + done;
      const uint64_t at = offset + done;
      CKPT_RETURN_IF_ERROR(gets.Run([this, into, n, at]() -> absl::Status {
        Request r{.method = "GET", .key = client_->Key(key_),
                  .headers = {fmt::format("Range: bytes={}-{}", at, at + n - 1)}, .into = into,
                  .into_size = n};
        return client_->SendOk(r, fmt::format("GET {} bytes {}-{}", name_, at, at + n - 1)).status();
      }));
    }
    return gets.Wait();
  }

 private:
  std::shared_ptr<S3Client> client_;
  const std::string key_;
  const std::string name_;
  const uint64_t size_;
  const std::string head_;
};

class S3Store final : public Store {
 public:
  explicit S3Store(std::shared_ptr<S3Client> client) : client_(std::move(client)) {}

  std::string Describe(std::string_view key) const override { return client_->Url(key); }

  absl::StatusOr<std::unique_ptr<ObjectWriter>> Create(const std::string& key) override {
    return std::unique_ptr<ObjectWriter>(new S3ObjectWriter(client_, key));
  }

  // Each part is read on the thread that sends it, into memory of its own (4 KiB-aligned:
  // a local file reads into it with O_DIRECT, no copy): a part starts as soon as any other
  // ends, where one reader thread per object refilled the slots that ended together one
  // read at a time (an upload kept 11-12 of its 16 requests in flight, not 16).
  absl::StatusOr<uint64_t> CopyFrom(const ObjectReader& from, const std::string& key,
                                    const CopyProgress& progress, std::string_view version) override {
    const uint64_t size = from.size();
    if (size <= client_->options().part_bytes) return Store::CopyFrom(from, key, progress, version);  // one PUT
    if (std::optional<Unfinished> left = TakeUnfinished(key, version, size)) {
      MultipartUpload upload(client_, key, std::move(left->id), std::move(left->etags));
      absl::StatusOr<uint64_t> resumed = CopyParts(from, key, progress, version, upload);
      // Done, stopped, or cut short again (kept for the next try): that is the answer. Any
      // other refusal of the resumed upload (gone meanwhile with its step or by a lifecycle
      // rule, a part the gateway will not take): it is aborted, and the copy starts over.
      if (resumed.ok() || absl::IsCancelled(resumed.status()) || Transient(resumed.status())) return resumed;
    }
    MultipartUpload upload(client_, key);
    CKPT_RETURN_IF_ERROR(upload.Begin());
    return CopyParts(from, key, progress, version, upload);
  }

  ~S3Store() override {
    // Unfinished uploads nobody will resume now: aborted (all at once: a stop waits at most
    // one abort's time), not left stored and billed.
    std::vector<std::thread> aborts;
    for (Unfinished& u : unfinished_) aborts.emplace_back([this, &u] { Abort(u); });
    for (std::thread& t : aborts) t.join();
  }


  // One round trip: a GET of the object's first kOpenBytes tells its size (Content-Range)
  // and holds what a reader asks for first, a safetensors file's header. Where each request
  // costs a round trip to another building, a HEAD and two small GETs per shard add up.
  absl::StatusOr<std::unique_ptr<ObjectReader>> Open(const std::string& key) override {
    CKPT_ASSIGN_OR_RETURN(Start start, GetStart(key, kOpenBytes));
    return std::unique_ptr<ObjectReader>(new S3ObjectReader(client_, key, start.size, std::move(start.bytes)));
  }

  absl::StatusOr<bool> Exists(const std::string& key) override {
    absl::StatusOr<uint64_t> size = Head(key);
    if (absl::IsNotFound(size.status())) return false;
    CKPT_RETURN_IF_ERROR(size.status());
    return true;
  }

  absl::StatusOr<std::vector<ListEntry>> List(const std::string& prefix) override {
    std::vector<ListEntry> entries;
    const std::string base = client_->Key(prefix);
    const std::string listed = base.empty() ? "" : base + "/";
    CKPT_RETURN_IF_ERROR(ListKeys(listed, /*delimited=*/true, [&](ListEntry e) {
      if (!e.name.empty()) entries.push_back(std::move(e));
    }));
    std::sort(entries.begin(), entries.end(),
              [](const ListEntry& a, const ListEntry& b) { return a.name < b.name; });
    return entries;
  }

  absl::Status Put(const std::string& key, std::string_view contents) override {
    Request r{.method = "PUT", .key = client_->Key(key), .body = contents.data(), .body_size = contents.size()};
    return client_->SendOk(r, "PUT " + client_->Url(key)).status();
  }

  absl::StatusOr<std::string> Get(const std::string& key, size_t max_bytes) override {
    // One byte more than allowed tells a larger object from one of exactly max_bytes.
    CKPT_ASSIGN_OR_RETURN(Start start, GetStart(key, std::min(max_bytes, kMaxGetBytes) + 1));
    if (start.size > max_bytes) {
      return absl::OutOfRangeError(fmt::format("{} is {} bytes; at most {} expected", client_->Url(key), start.size, max_bytes));
    }
    if (start.bytes.size() != start.size) {  // more than one GET of kMaxGetBytes holds
      return absl::OutOfRangeError(fmt::format("{} is {} bytes: too large to get whole (read it with Open)",
                                               client_->Url(key), start.size));
    }
    return std::move(start.bytes);
  }

  std::string StagingPrefix(const std::string& published) const override { return published; }

  absl::Status Publish(const std::string& staging, const std::string& published,
                       const std::string& marker, std::string_view contents) override {
    if (staging != published) {
      return absl::InvalidArgumentError(fmt::format(
          "{}: an S3 store publishes objects where they were written (StagingPrefix)", Describe(published)));
    }
    CKPT_ASSIGN_OR_RETURN(bool there, Exists(published + "/" + marker));
    if (there) return absl::AlreadyExistsError(fmt::format("{} already exists", Describe(published)));
    return Put(published + "/" + marker, contents);  // the last object: now it is complete
  }

  absl::Status Retract(const std::string& published, const std::string& marker) override {
    CKPT_ASSIGN_OR_RETURN(bool there, Exists(published + "/" + marker));
    if (!there) return absl::NotFoundError(fmt::format("{} holds no {}", Describe(published), marker));
    // The marker first: from then on the step is incomplete to every reader.
    CKPT_RETURN_IF_ERROR(DeleteKey(client_->Key(published + "/" + marker)));
    return RemovePrefix(published);
  }

  void Cancel() override { client_->Cancel(); }

  absl::Status Remove(const std::string& key) override { return DeleteKey(client_->Key(key)); }

  absl::Status RemovePrefix(const std::string& prefix) override {
    std::vector<std::string> keys;
    const std::string base = client_->Key(prefix);
    CKPT_RETURN_IF_ERROR(ListKeys(base.empty() ? "" : base + "/", /*delimited=*/false,
                                  [&](ListEntry e) { keys.push_back(e.name); }));
    // And multipart uploads never completed under it (a kill mid-upload): invisible to a
    // listing, but stored and billed until aborted.
    std::vector<std::pair<std::string, std::string>> unfinished;  // (bucket key, upload id)
    CKPT_RETURN_IF_ERROR(ListUnfinished(base.empty() ? "" : base + "/", unfinished));
    Parallel deletes(client_->options().parallel);
    const std::string full = base.empty() ? "" : base + "/";
    for (const std::string& name : keys) {
      CKPT_RETURN_IF_ERROR(deletes.Run([this, key = full + name] { return DeleteKey(key); }));
    }
    for (auto& [key, id] : unfinished) {
      CKPT_RETURN_IF_ERROR(deletes.Run([this, key = key, id = id] { return AbortBucketUpload(key, id); }));
    }
    return deletes.Wait();
  }

  absl::StatusOr<std::vector<UnfinishedUpload>> ListUnfinishedUploads(const std::string& prefix) override {
    const std::string base = client_->Key(prefix);
    std::vector<std::pair<std::string, std::string>> unfinished;  // (bucket key, upload id)
    CKPT_RETURN_IF_ERROR(ListUnfinished(base.empty() ? "" : base + "/", unfinished));
    // Keys as the store names them: without the store's own prefix in the bucket.
    const std::string root = client_->Key("");
    const std::string strip = root.empty() ? "" : root + "/";
    std::vector<UnfinishedUpload> out;
    for (auto& [key, id] : unfinished) {
      if (key.compare(0, strip.size(), strip) != 0) continue;  // the listing's prefix holds it
      out.push_back({key.substr(strip.size()), std::move(id)});
    }
    return out;
  }

  absl::Status AbortUpload(const UnfinishedUpload& upload) override {
    return AbortBucketUpload(client_->Key(upload.key), upload.id);
  }

 private:
  static constexpr size_t kOpenBytes = 64 << 10;
  static constexpr int kPartsReadAhead = 2;
  static constexpr size_t kMaxGetBytes = size_t{1} << 30;
  // Failed uploads kept for a copy to resume: one per file a step's upload has in flight.
  static constexpr size_t kMaxUnfinished = 16;

  // A failure the next attempt may not meet (the gateway unreachable or overloaded after
  // every retry, a request timed out): worth keeping the parts for. Anything the gateway
  // refused outright is not: resuming it would fail the same way every time.
  static bool Transient(const absl::Status& s) { return absl::IsUnavailable(s) || absl::IsDeadlineExceeded(s); }

  // A multipart upload a failed copy left for the next copy of the same version to resume.
  struct Unfinished {
    std::string key;
    std::string version;
    uint64_t size = 0;
    std::string id;
    std::map<int, std::string> etags;  // the parts it holds
  };

  // Sends the parts `upload` lacks, then completes it. A failure other than a stop leaves the
  // upload unfinished, for the next copy of `version` (when there is one) to resume.
  absl::StatusOr<uint64_t> CopyParts(const ObjectReader& from, const std::string& key,
                                     const CopyProgress& progress, std::string_view version,
                                     MultipartUpload& upload) {
    const uint64_t size = from.size();
    const size_t first = client_->options().part_bytes;
    absl::Status sent = [&]() -> absl::Status {
      // A part's read (tens of ms from a local disk) is not a request: two parts more than
      // `parallel` are read ahead, so a request ending is followed by the next at once.
      PartBuffers buffers;
      Parallel parts(client_->options().parallel + kPartsReadAhead);
      int number = 0;
      for (uint64_t offset = 0; offset < size;) {
        const size_t n = static_cast<size_t>(std::min<uint64_t>(PartBytes(first, ++number), size - offset));
        offset += n;
        if (upload.HasPart(number)) {  // resumed: sent before
          CKPT_RETURN_IF_ERROR(progress(n));
          continue;
        }
        CKPT_RETURN_IF_ERROR(parts.Run([&, number, at = offset - n, n]() -> absl::Status {
          CKPT_RETURN_IF_ERROR(progress(0));  // stopping: no part starts after
          PartBuffers::Buffer part = buffers.Take(n);
          if (part.data == nullptr) {
            return absl::ResourceExhaustedError(fmt::format("no memory for a {}-byte part of {}", n, client_->Url(key)));
          }
          absl::Status one = from.ReadAt(part.data.get(), n, at);
          if (one.ok()) one = upload.SendPart(number, part.data.get(), n);
          buffers.Give(std::move(part));
          CKPT_RETURN_IF_ERROR(one);
          return progress(n);
        }));
      }
      CKPT_RETURN_IF_ERROR(parts.Wait());
      return upload.Complete();
    }();
    if (sent.ok()) return size;
    if (!version.empty() && Transient(sent)) {
      auto [id, etags] = upload.Release();
      if (!id.empty()) KeepUnfinished({key, std::string(version), size, std::move(id), std::move(etags)});
    }
    return sent;
  }

  std::optional<Unfinished> TakeUnfinished(const std::string& key, std::string_view version, uint64_t size) {
    Unfinished found;
    {
      std::lock_guard lock(unfinished_mu_);
      auto it = std::find_if(unfinished_.begin(), unfinished_.end(),
                             [&](const Unfinished& u) { return u.key == key; });
      if (it == unfinished_.end()) return std::nullopt;
      found = std::move(*it);
      unfinished_.erase(it);
    }
    if (!version.empty() && found.version == version && found.size == size) return found;
    Abort(found);  // another version of the object: its parts are of no use
    return std::nullopt;
  }
  void KeepUnfinished(Unfinished u) {
    Unfinished oldest;
    {
      std::lock_guard lock(unfinished_mu_);
      unfinished_.push_back(std::move(u));
      if (unfinished_.size() <= kMaxUnfinished) return;
      oldest = std::move(unfinished_.front());
      unfinished_.erase(unfinished_.begin());
    }
    Abort(oldest);
  }
  void Abort(Unfinished& u) {
    MultipartUpload dropped(client_, u.key, std::move(u.id), {});  // its destructor aborts it
  }

  // An object's size and its first bytes (all of it when it has no more), in one GET.
  struct Start {
    uint64_t size = 0;
    std::string bytes;
  };
  absl::StatusOr<Start> GetStart(const std::string& key, size_t bytes) {
    const std::string what = "GET " + client_->Url(key);
    Request r{.method = "GET", .key = client_->Key(key),
              .headers = {fmt::format("Range: bytes=0-{}", bytes - 1)}, .max_body = bytes};
    CKPT_ASSIGN_OR_RETURN(Response got, client_->Send(r, what));
    Start start;
    if (got.status == 206) {
      CKPT_ASSIGN_OR_RETURN(start.size, TotalOf(got, what));
    } else if (got.status == 200) {
      // All of an object smaller than the range (a larger one from a server that ignores
      // Range overflows max_body: ckptd's ranged reads need Range anyway).
      start.size = got.body.size();
    } else if (got.status == 416) {
      // An empty object has no byte 0 to range over; RGW names no size in this answer, so
      // a HEAD confirms it (empty objects are rare: one more round trip for those alone).
      CKPT_ASSIGN_OR_RETURN(start.size, Head(key));
      if (start.size != 0) {
        return absl::DataLossError(fmt::format("S3 {}: refused the range 0-{} of a {}-byte object", what,
                                               bytes - 1, start.size));
      }
      got.body.clear();
    } else {
      return client_->StatusOf(got, what);
    }
    if (got.body.size() > start.size || (got.body.size() < std::min<uint64_t>(bytes, start.size))) {
      return absl::DataLossError(fmt::format("S3 {}: {} bytes arrived of the first {} of a {}-byte object",
                                             what, got.body.size(), bytes, start.size));
    }
    start.bytes = std::move(got.body);
    return start;
  }

  // The object's size from a 206 answer to a range from byte 0: "Content-Range: bytes
  // 0-LAST/SIZE", LAST the answer's last byte (bytes elsewhere in the object would be taken
  // for its start, and served from the reader's copy without another look).
  static absl::StatusOr<uint64_t> TotalOf(const Response& got, const std::string& what) {
    auto bad = [&] {
      return absl::DataLossError(fmt::format("S3 {}: a partial answer that does not say it holds the object's "
                                             "first {} bytes and its size", what, got.body.size()));
    };
    auto range = got.headers.find("content-range");
    if (range == got.headers.end()) return bad();
    const std::string& v = range->second;
    constexpr std::string_view kFrom = "bytes 0-";
    const size_t slash = v.find('/');
    uint64_t last = 0, size = 0;
    if (v.rfind(kFrom, 0) != 0 || slash == std::string::npos ||
        std::from_chars(v.data() + kFrom.size(), v.data() + slash, last) != std::from_chars_result{v.data() + slash, {}} ||
        std::from_chars(v.data() + slash + 1, v.data() + v.size(), size) != std::from_chars_result{v.data() + v.size(), {}} ||
        last + 1 != got.body.size() || last >= size) {
      return bad();
    }
    return size;
  }

  absl::StatusOr<uint64_t> Head(const std::string& key) {
    Request r{.method = "HEAD", .key = client_->Key(key)};
    CKPT_ASSIGN_OR_RETURN(Response head, client_->SendOk(r, "HEAD " + client_->Url(key)));
    auto length = head.headers.find("content-length");
    if (length == head.headers.end()) {
      return absl::DataLossError(fmt::format("S3 HEAD {}: no Content-Length", client_->Url(key)));
    }
    return std::stoull(length->second);
  }

  // Aborts the multipart upload `id` of `bucket_key`; Ok when it is gone already.
  absl::Status AbortBucketUpload(const std::string& bucket_key, const std::string& id) {
    Request r{.method = "DELETE", .key = bucket_key, .query = {{"uploadId", id}}};
    absl::StatusOr<Response> aborted =
        client_->SendOk(r, fmt::format("abort upload s3://{}/{}", client_->options().bucket, bucket_key));
    return absl::IsNotFound(aborted.status()) ? absl::OkStatus() : aborted.status();
  }

  absl::Status DeleteKey(const std::string& bucket_key) {
    Request r{.method = "DELETE", .key = bucket_key};
    absl::StatusOr<Response> deleted = client_->SendOk(r, fmt::format("DELETE s3://{}/{}", client_->options().bucket, bucket_key));
    if (absl::IsNotFound(deleted.status())) return absl::OkStatus();
    return deleted.status();
  }

  // ListMultipartUploads under `listed` (a bucket prefix ending in '/', or empty), every page.
  absl::Status ListUnfinished(const std::string& listed,
                              std::vector<std::pair<std::string, std::string>>& out) {
    std::string key_marker, id_marker;
    while (true) {
      Query query;  // sorted by name
      if (!key_marker.empty()) query.push_back({"key-marker", key_marker});
      query.push_back({"prefix", listed});
      if (!id_marker.empty()) query.push_back({"upload-id-marker", id_marker});
      query.push_back({"uploads", ""});
      Request r{.method = "GET", .key = "", .query = std::move(query)};
      const std::string what = fmt::format("list uploads s3://{}/{}", client_->options().bucket, listed);
      CKPT_ASSIGN_OR_RETURN(Response page, client_->SendOk(r, what));
      try {
        boost::property_tree::ptree tree = ParseXml(page.body);
        const auto& result = tree.get_child("ListMultipartUploadsResult");
        for (const auto& [tag, node] : result) {
          if (tag == "Upload") out.emplace_back(node.get<std::string>("Key"), node.get<std::string>("UploadId"));
        }
        if (result.get<std::string>("IsTruncated", "false") != "true") return absl::OkStatus();
        key_marker = result.get<std::string>("NextKeyMarker", "");
        id_marker = result.get<std::string>("NextUploadIdMarker", "");
        if (key_marker.empty()) return absl::DataLossError(fmt::format("S3 {}: truncated without a next marker", what));
      } catch (const std::exception& e) {
        return absl::DataLossError(fmt::format("S3 {}: unreadable answer ({})", what, e.what()));
      }
    }
  }

  // ListObjectsV2 under `listed` (a bucket prefix ending in '/', or empty), page by page:
  // names relative to it; with `delimited`, one level (sub-prefixes as is_prefix).
  absl::Status ListKeys(const std::string& listed, bool delimited, const std::function<void(ListEntry)>& each) {
    std::string token;
    do {
      Query query;
      if (!token.empty()) query.push_back({"continuation-token", token});
      if (delimited) query.push_back({"delimiter", "/"});
      query.push_back({"list-type", "2"});
      query.push_back({"prefix", listed});
      Request r{.method = "GET", .key = "", .query = std::move(query)};
      CKPT_ASSIGN_OR_RETURN(Response page, client_->SendOk(r, fmt::format("list s3://{}/{}", client_->options().bucket, listed)));
      token.clear();
      try {
        boost::property_tree::ptree tree = ParseXml(page.body);
        const auto& result = tree.get_child("ListBucketResult");
        for (const auto& [tag, node] : result) {
          if (tag == "Contents") {
            std::string key = node.get<std::string>("Key");
            if (key.size() <= listed.size()) continue;  // the prefix itself
            each({key.substr(listed.size()), false, node.get<uint64_t>("Size", 0)});
          } else if (tag == "CommonPrefixes") {
            std::string p = node.get<std::string>("Prefix");
            if (p.size() <= listed.size() + 1) continue;
            each({p.substr(listed.size(), p.size() - listed.size() - 1), true, 0});
          }
        }
        if (result.get<std::string>("IsTruncated", "false") == "true") {
          token = result.get<std::string>("NextContinuationToken", "");
          if (token.empty()) return absl::DataLossError("S3 list: truncated without a continuation token");
        }
      } catch (const std::exception& e) {
        return absl::DataLossError(fmt::format("S3 list s3://{}/{}: unreadable answer ({})",
                                               client_->options().bucket, listed, e.what()));
      }
    } while (!token.empty());
    return absl::OkStatus();
  }

  std::shared_ptr<S3Client> client_;
  std::mutex unfinished_mu_;
  std::vector<Unfinished> unfinished_;  // oldest first; guarded by unfinished_mu_
};

}  // namespace

absl::StatusOr<StorePtr> MakeS3Store(S3Options options) {
  if (options.part_bytes < (5u << 20)) {
    return absl::InvalidArgumentError(fmt::format(
        "S3 part size {} is below S3's minimum of 5 MiB", options.part_bytes));
  }
  if (options.credentials.access_key.empty() || options.credentials.secret_key.empty()) {
    return absl::UnauthenticatedError("no S3 credentials (see ResolveS3Environment)");
  }
  if (options.bucket.empty()) return absl::InvalidArgumentError("no S3 bucket");
  return StorePtr(std::make_shared<S3Store>(std::make_shared<S3Client>(std::move(options))));
}

}  // namespace ckpt::storage
