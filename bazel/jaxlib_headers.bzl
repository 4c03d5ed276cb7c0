"""Repository rule: the XLA FFI headers shipped in the jaxlib wheel (jax.ffi.include_dir()).

The Python interpreter that has jaxlib installed is $HISPARSE_PYTHON, else python3.
"""

def _jaxlib_headers_impl(ctx):
    python = ctx.os.environ.get("HISPARSE_PYTHON", "python3")
    if "/" in python and not python.startswith("/"):
        # A relative path means relative to the workspace root, where the user typed it.
        python = str(ctx.path(Label("//:WORKSPACE")).dirname) + "/" + python
    result = ctx.execute([python, "-c", "import jaxlib, os; print(os.path.join(os.path.dirname(jaxlib.__file__), 'include'))"])
    if result.return_code != 0:
        fail("cannot locate jaxlib's include dir with %s (set HISPARSE_PYTHON to a python with jaxlib): %s" % (python, result.stderr))
    ctx.symlink(result.stdout.strip() + "/xla", "xla")
    ctx.file("BUILD", """
filegroup(
    name = "ffi_api_headers",
    srcs = glob(["xla/ffi/api/*.h"]),
    visibility = ["//visibility:public"],
)

cc_library(
    name = "ffi_api",
    hdrs = glob(["xla/ffi/api/*.h"]),
    includes = ["."],
    visibility = ["//visibility:public"],
)
""")

jaxlib_headers = repository_rule(
    implementation = _jaxlib_headers_impl,
    environ = ["HISPARSE_PYTHON"],
    local = True,
)
