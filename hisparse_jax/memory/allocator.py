"""Free lists of pages and request slots: host-side bookkeeping, apart from the arrays that hold KV.

A ``FreeList`` hands out integer ids (page ids of a paged pool, or request slots that own a hot buffer)
and takes them back. It never touches device memory: the arrays live in ``memory/views.py`` and are
updated inside jitted calls. Ids freed here may be handed out at once, because every later jitted call
that writes them is ordered after every earlier call that used them through the data dependencies of
the donated pool arrays.
"""

from __future__ import annotations


class OutOfPages(Exception):
  """A ``FreeList`` has fewer free ids than asked for (nothing was allocated)."""


class FreeList:
  """Ids 0..capacity-1, allocated lowest-first from a fresh list, reused last-freed-first.

  Args:
    capacity: number of ids (>= 0).
    name: for messages ("index pages", "request slots", ...).

  Raises (on use):
    OutOfPages: ``alloc`` of more ids than are free.
    ValueError: ``free`` of an id that is not allocated (a double free or a foreign id).
  """

  def __init__(self, capacity: int, name: str):
    if capacity < 0:
      raise ValueError(f"{name}: capacity must be >= 0, got {capacity}")
    self.capacity = int(capacity)
    self.name = name
    self._free = list(range(self.capacity - 1, -1, -1))  # a stack: pop() gives the lowest id first
    self._used = bytearray(self.capacity)

  @property
  def num_free(self) -> int:
    return len(self._free)

  @property
  def num_used(self) -> int:
    return self.capacity - len(self._free)

  def alloc(self, n: int) -> list[int]:
    """n ids, or OutOfPages (allocating nothing) when fewer are free."""
    if n > len(self._free):
      raise OutOfPages(f"{self.name}: {n} needed, {len(self._free)} free of {self.capacity}")
    ids = [self._free.pop() for _ in range(n)]
    for i in ids:
      self._used[i] = 1
    return ids

  def free(self, ids) -> None:
    """Returns ids to the list; ValueError (freeing none of them) if one is not allocated."""
    ids = list(ids)
    seen = set()
    for i in ids:
      if not (0 <= i < self.capacity) or not self._used[i] or i in seen:
        raise ValueError(f"{self.name}: id {i} is not allocated")
      seen.add(i)
    for i in ids:
      self._used[i] = 0
      self._free.append(i)
