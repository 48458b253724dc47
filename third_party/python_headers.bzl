"""CPython's headers of one version, for the pybind11 extension of the wheel built for it.

python_headers(name = "python310_headers", version = "3.10") finds python3.10's include
directory in, first to last: $CKPTD_PYTHON3_10_INCLUDE, each pyenv version 3.10.* under
$PYENV_ROOT (default ~/.pyenv), /usr/local/include/python3.10 and /usr/include/python3.10.
Where none holds Python.h, the repository's :headers target fails to build with a sentence
naming the places looked at: nothing but the wheel of that version needs it
(//client/python:wheel_cp310, tools/wheels.sh), so every other target builds without it.
"""

def _version_key(name):
    # "3.10.13" -> [3, 10, 13]: the newest patch release of a version first.
    return [int(p) if p.isdigit() else 0 for p in name.split(".")]

def _python_headers_impl(ctx):
    version = ctx.attr.version
    env_name = "CKPTD_PYTHON" + version.replace(".", "_") + "_INCLUDE"
    candidates = []
    if ctx.os.environ.get(env_name):
        candidates.append(ctx.os.environ[env_name])
    pyenv = ctx.os.environ.get("PYENV_ROOT") or (ctx.os.environ.get("HOME", "/root") + "/.pyenv")
    versions = ctx.path(pyenv + "/versions")
    if versions.exists:
        found = [d.basename for d in versions.readdir() if d.basename.startswith(version + ".")]
        for name in sorted(found, key = _version_key, reverse = True):
            candidates.append("%s/versions/%s/include/python%s" % (pyenv, name, version))
    candidates += ["/usr/local/include/python" + version, "/usr/include/python" + version]
    include = None
    for c in candidates:
        if ctx.path(c + "/Python.h").exists:
            include = c
            break
    if include:
        ctx.symlink(include, "include")
        ctx.file("BUILD.bazel", """\
load("@rules_cc//cc:defs.bzl", "cc_library")

# CPython {version}'s headers, from {include}.
cc_library(
    name = "headers",
    hdrs = glob(["include/**/*.h"]),
    includes = ["include"],
    visibility = ["//visibility:public"],
)
""".format(version = version, include = include))
    else:
        message = "no headers of Python %s (Python.h) in any of: %s, nor in a pyenv version %s.* under %s/versions. Install that Python (e.g. pyenv install %s) or set %s to its include directory." % (
            version,
            ", ".join(candidates),
            version,
            pyenv,
            version,
            env_name,
        )
        ctx.file("BUILD.bazel", """\
load("@rules_cc//cc:defs.bzl", "cc_library")

genrule(
    name = "missing",
    outs = ["Python.h"],
    cmd = "echo '{message}' >&2; exit 1",
)

cc_library(
    name = "headers",
    hdrs = [":missing"],
    visibility = ["//visibility:public"],
)
""".format(message = message.replace("'", "").replace("$", "$$")))

python_headers = repository_rule(
    implementation = _python_headers_impl,
    attrs = {"version": attr.string(mandatory = True)},
    environ = ["PYENV_ROOT", "HOME", "CKPTD_PYTHON3_10_INCLUDE", "CKPTD_PYTHON3_12_INCLUDE", "CKPTD_PYTHON3_13_INCLUDE"],
    local = True,
)
