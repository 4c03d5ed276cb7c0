"""Minimal @rules_cc for Debian's offline Bazel 4: the native C++ rules under their rules_cc names.

Bazel 4's @bazel_tools//tools/cpp loads these from @rules_cc; the real
rules_cc would be downloaded, and Debian's packaged one is too new for Bazel 4.
"""

cc_binary = native.cc_binary
cc_import = native.cc_import
cc_library = native.cc_library
cc_test = native.cc_test
cc_toolchain = native.cc_toolchain
cc_toolchain_suite = native.cc_toolchain_suite
