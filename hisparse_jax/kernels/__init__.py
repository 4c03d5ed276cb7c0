"""The HiSparse XLA FFI kernels: swap-in and backup (``ops``) and their NumPy executable spec
(``reference``). The C++/CUDA sources are in ``xla_ffi/``."""
