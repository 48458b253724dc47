// What ThreadSanitizer must not report (--config=tsan): races it sees inside Debian's
// uninstrumented gRPC, protobuf, Abseil and OpenSSL (gRPC's TLS), whose own
// synchronization (atomics and spinlocks in code TSan never saw) it cannot see. Every test
// that starts a group server was reported: gRPC's poller (epoll_create1 on one thread,
// epoll_wait on another), Abseil's mutex lock graph, StrCat (memcpy under gRPC's locks) and
// Status payloads (freed when the last reference, counted atomically inside Abseil, goes),
// and gRPC's callback tags, whose inline header code is compiled into ckptd's instrumented
// objects but handed between threads by the uninstrumented core. Reports with a frame in
// those libraries or in gRPC's own namespaces, and reports from interceptors called inside
// them, are suppressed; a race between frames of ckptd's own code still is one.
//
// Built into every test binary (third_party:catch2_main) and ckptd, so that a TSan run needs
// no file: `bazel test --config=tsan //tests/unit/...` (tools/test.sh runs it in CI).
#ifdef CKPTD_TSAN
// Interceptors (memcpy, read, ...) called from any uninstrumented library (libstdc++'s
// string appends, protobuf's parser, gRPC) check nothing, as called_from_lib below does for
// the libraries it names. Without it, every received gRPC message was a race to TSan (the
// parser's and the reactor's memcpy on gRPC's two callback threads, handed over by
// synchronization TSan cannot see), suppressed only after a report: each report scanned a
// list of every racy address seen so far under TSan's global lock, so a 1.5 MB fragment took
// seconds to receive, more the longer the process ran (replicator_test's patch sequence: 94 s
// with the reports, 1.2 s without), and the daemons' gRPC threads starved. Synchronization
// called from those libraries (a condition variable's wait in libstdc++) is still seen.
extern "C" const char* __tsan_default_options() { return "ignore_noninstrumented_modules=1"; }

extern "C" const char* __tsan_default_suppressions() {
  return "race:libgrpc.so\n"
         "race:libgrpc++.so\n"
         "race:libgpr.so\n"
         "race:libprotobuf.so\n"
         "race:libabsl_*\n"
         "race:libcrypto.so\n"
         "race:libssl.so\n"
         "race:grpc::internal::\n"
         "race:grpc_core::\n"
         "race:grpc_event_engine::\n"
         // ckptd's one deliberate race: PeerTable (daemon/session/peer_identity.cc) fstat()s
         // a connection's descriptor number, which gRPC may have closed and another thread
         // reused meanwhile (an arena received with recvmsg), and compares the inode it
         // recorded: a reused number is found out by that comparison. TSan reports the
         // reuse itself as a race on the descriptor.
         "race:ckpt::daemon::(anonymous namespace)::SocketInode\n"
         // Descriptors accept4() returns are handed to gRPC, which closes them where TSan does
         // not look (called_from_lib below): to TSan such a number stays the accepted socket,
         // so another thread's later use of the reused number (a directory a listing opens
         // and closes, group_test under load) is reported as a race on it.
         "race:accept4\n"
         // called_from_lib: one library per line (a pattern matching two is an error).
         "called_from_lib:libgrpc.so\n"
         "called_from_lib:libgrpc++.so\n"
         "called_from_lib:libgpr.so\n"
         "called_from_lib:libcrypto.so\n"
         "called_from_lib:libssl.so\n"
         "called_from_lib:libabsl_graphcycles_internal.so\n"
         "called_from_lib:libabsl_status.so\n"
         "called_from_lib:libabsl_cord.so\n"
         "called_from_lib:libabsl_strings.so\n"
         "called_from_lib:libabsl_synchronization.so\n";
}
#endif
