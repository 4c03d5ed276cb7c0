"""KV memory: host-side backends that own pools, page tables and accounting (``backend``), their free
lists (``allocator``), and the in-jit arrays and per-batch caches the model calls (``views``)."""
