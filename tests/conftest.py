"""Test-suite ordering: the longest modules first, so that under ``pytest -n 2 --dist loadfile`` (the Makefile's
``make test``) no worker is left alone with a long module at the end."""

# Slowest first (seconds on 2 cores, make test): mesh ~420, throughput benchmarks ~260, multiprocess ~200,
# benchmark scripts ~200, disaggregation ~100.
FIRST = ("test_mesh.py", "test_throughput_benchmark.py", "test_multiprocess.py", "test_benchmark_scripts.py",
         "test_disaggregation.py", "test_lossless.py")


def pytest_collection_modifyitems(session, config, items):
  def rank(item):
    name = item.path.name
    return FIRST.index(name) if name in FIRST else len(FIRST)
  items.sort(key=rank)  # stable: the order inside a module is kept
