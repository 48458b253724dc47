"""grpc_cc_library: protoc + grpc_cpp_plugin from Debian, run in a genrule (no @com_google_protobuf)."""

load("@rules_cc//cc:defs.bzl", "cc_library")

def grpc_cc_library(name, srcs, deps = [], visibility = None):
    """Generates C++ messages and gRPC stubs for `srcs` (.proto files in this package)."""
    stems = [s[:-len(".proto")] for s in srcs]
    outs = []
    for s in stems:
        outs += [s + ".pb.h", s + ".pb.cc", s + ".grpc.pb.h", s + ".grpc.pb.cc"]
    native.genrule(
        name = name + "_codegen",
        srcs = srcs,
        outs = outs,
        cmd = " ".join([
            "protoc",
            "--proto_path=.",
            "--cpp_out=$(GENDIR)",
            "--grpc_out=$(GENDIR)",
            "--plugin=protoc-gen-grpc=$$(command -v grpc_cpp_plugin)",
        ] + ["$(location %s)" % s for s in srcs]),
    )
    cc_library(
        name = name,
        srcs = [o for o in outs if o.endswith(".cc")],
        hdrs = [o for o in outs if o.endswith(".h")],
        visibility = visibility,
        deps = deps + ["//third_party:grpc", "//third_party:protobuf"],
    )
