"""Minimal @rules_java for Debian's offline Bazel 4: the native Java rules under their rules_java names.

Only needed because Bazel 4 registers its JDK toolchains from @bazel_tools,
which load these names; the project builds no Java.
"""

java_binary = native.java_binary
java_import = native.java_import
java_library = native.java_library
java_runtime = native.java_runtime
java_toolchain = native.java_toolchain
