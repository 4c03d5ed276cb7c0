"""The device mesh and the parameter shardings: one rule table of logical axis names.

A serving mesh has two named axes, ``("dp", "tp")`` of sizes (dp_size, tp_size):

    dp  data-parallel attention groups: each group decodes its own requests, and its KV (pools, hot buffers,
        page tables) lives with its devices (SGLang's ``--enable-dp-attention``)
    tp  tensor parallelism inside a group: MLA up-projections and ``o_proj`` split over heads, dense MLPs over
        their intermediate width, the vocabulary of embedding and lm_head over tp

Routed experts are split over ``ep_size`` devices: the tp axis (ep = tp), the dp axis (ep = dp), both
(ep = dp x tp: SGLang's ``--tp 8 --dp 8 --enable-dp-attention --ep 8``), or not at all (ep = 1; then each
expert's intermediate width is split over tp).

Parameters are matched by path (``layers/3/self_attn/q_b_proj/kernel``) against ``LOGICAL_RULES``, which gives
each dimension a logical axis name; ``MeshConfig.logical_to_mesh`` maps names to mesh axes. A parameter no
rule names is replicated: ``q_a_proj``, ``kv_a_proj_with_mqa``, every norm, the router and the whole lightning
indexer, so every rank that serves a request computes the same indexer scores and picks the same top-k (a
rank that picked a slightly different top-k would let its hot buffer diverge). The same shape of rule table
as MaxText's ``logical_axis_rules`` and sglang-jax's model shardings.

XLA's SPMD partitioner (GSPMD) partitions the model math from these parameter shardings; the KV memory ops
that must run on local shards (the swap-in and backup FFI calls) use ``shard_map`` (memory/views.py).
"""

from __future__ import annotations

import dataclasses
import math
import re

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from models.loader import param_path
from models.moe import ExpertParallel

AXES = ("dp", "tp")

# (path regex, logical axis name per dimension); the first match wins; no match: replicated. The 128 x 128
# block scales of FP8-resident weights (``kernel_scale``, ``<stack>_scale``: one entry per block) are split
# like their weights, where their block counts divide (``MeshConfig.spec``).
LOGICAL_RULES: tuple[tuple[str, tuple[str | None, ...]], ...] = (
  (r"^embed_tokens$", ("vocab", "embed")),
  (r"^lm_head/weight$", ("vocab", "embed")),
  (r"self_attn/q_b_proj/kernel(_scale)?$", ("q_lora", "heads")),
  (r"self_attn/kv_b_proj/kernel(_scale)?$", ("kv_lora", "heads")),
  (r"self_attn/o_proj/kernel(_scale)?$", ("heads", "embed")),
  (r"mlp/(shared_experts/)?(gate|up)_proj/kernel(_scale)?$", ("embed", "mlp")),
  (r"mlp/(shared_experts/)?down_proj/kernel(_scale)?$", ("mlp", "embed")),
  (r"mlp/(gate|up)_proj(_scale)?$", ("expert", "embed", "moe_mlp")),
  (r"mlp/down_proj(_scale)?$", ("expert", "moe_mlp", "embed")),
)
FP8_BLOCK = 128  # rows and columns of an FP8 weight block (models/fp8.py)


class MeshError(ValueError):
  """A mesh that cannot work with these devices or this model (the message names the flag)."""


def logical_axes(path: str, ndim: int) -> tuple[str | None, ...]:
  """The logical axis name of each dimension of the parameter at ``path`` (None: not named)."""
  for pattern, names in LOGICAL_RULES:
    if re.search(pattern, path):
      if len(names) != ndim:
        raise ValueError(f"sharding rule {pattern!r} names {len(names)} dimensions; {path} has {ndim}")
      return names
  return (None,) * ndim


@dataclasses.dataclass(frozen=True)
class MeshConfig:
  """Sizes of the serving mesh (flags ``--dp-size``, ``--tp-size``, ``--ep-size``).

  The mesh takes the first dp_size x tp_size devices of ``jax.devices()``.
  """

  dp_size: int = 1
  tp_size: int = 1
  ep_size: int = 1

  @property
  def num_devices(self) -> int:
    return self.dp_size * self.tp_size

  @property
  def expert_axes(self) -> tuple[str, ...]:
    """Mesh axes the routed experts are split over (ep_size = their product)."""
    if self.ep_size == 1:
      return ()
    if self.ep_size == self.tp_size:
      return ("tp",)
    if self.ep_size == self.dp_size:
      return ("dp",)
    return AXES if self.ep_size == self.num_devices else ()  # any other size: validate() refuses it

  def expert_parallel(self) -> ExpertParallel | None:
    """How each MoE layer runs its experts on this mesh (the model's ``expert_parallel`` argument): None with
    ep = 1 (GSPMD splits each expert's width over tp). With data-parallel attention each group works on its own
    tokens; with experts over dp too (ep = dp or dp x tp) the tokens go to their experts and back by
    all-to-all (``models.moe.all_to_all_ffn``), else every device of a group sees its group's tokens and a
    psum adds the devices' parts."""
    experts = self.expert_axes
    if not experts:
      return None
    return ExpertParallel(
      experts, width_axis=self.logical_to_mesh()["moe_mlp"], token_axis="dp" if self.dp_size > 1 else None
    )

  def logical_to_mesh(self) -> dict:
    """Logical axis name -> mesh axes (None: replicated along that dimension)."""
    experts = self.expert_axes
    tp = "tp" if self.tp_size > 1 else None
    return {
      "heads": tp,
      "mlp": tp,
      "vocab": tp,
      "expert": (experts if len(experts) > 1 else experts[0]) if experts else None,
      "moe_mlp": None if "tp" in experts else tp,
      "embed": None,
      "q_lora": None,
      "kv_lora": None,
    }

  def spec(self, path: str, shape: int | tuple[int, ...]) -> P:
    """The ``PartitionSpec`` of the parameter at ``path`` of ``shape`` (or just its number of dimensions).
    An FP8 block-scale parameter (path ending in ``_scale``) of known shape stays whole along a dimension
    whose block count its mesh axes do not divide (XLA then slices the scales each device needs)."""
    ndim = shape if isinstance(shape, int) else len(shape)
    table = self.logical_to_mesh()
    axes = [table.get(name) if name else None for name in logical_axes(path, ndim)]
    if path.endswith("_scale") and not isinstance(shape, int):
      axes = [a if a is None or shape[d] % self.shards(P(a)) == 0 else None for d, a in enumerate(axes)]
    return P(*axes)

  def shards(self, spec: P) -> int:
    """How many pieces a parameter of this spec is cut into (each device holds one)."""
    sizes = {"dp": self.dp_size, "tp": self.tp_size}
    n = 1
    for entry in spec:
      for axis in entry if isinstance(entry, tuple) else (entry,):
        if axis is not None:
          n *= sizes[axis]
    return n

  def validate(self, model_cfg=None, num_devices: int | None = None, fp8_weights: bool = False) -> None:
    """Raises MeshError naming the flag when the sizes cannot work: a size < 1; dp x tp more devices than
    there are, or not dividing them; ep not one of 1, tp, dp, dp x tp; tp not dividing the attention heads,
    the MLP widths or the vocabulary; ep not dividing the routed experts; with FP8-resident weights
    (fp8_weights) and experts split over dp with their width over tp, a per-device expert width that is not
    a whole number of 128-wide blocks."""
    for flag, v in (("--dp-size", self.dp_size), ("--tp-size", self.tp_size), ("--ep-size", self.ep_size)):
      if not isinstance(v, (int, np.integer)) or v < 1:
        raise MeshError(f"{flag} must be an integer >= 1, got {v!r}")
    if num_devices is not None and (self.num_devices > num_devices or num_devices % self.num_devices):
      raise MeshError(
        f"--dp-size {self.dp_size} x --tp-size {self.tp_size} = {self.num_devices} devices does not "
        f"divide the {num_devices} device{'s' if num_devices != 1 else ''} here (on CPU, "
        "XLA_FLAGS=--xla_force_host_platform_device_count=N simulates N devices)"
      )
    if self.ep_size not in {1, self.tp_size, self.dp_size, self.num_devices}:
      raise MeshError(
        f"--ep-size {self.ep_size}: experts are split over the tp axis, the dp axis or both, so it "
        f"must be one of 1, --tp-size {self.tp_size}, --dp-size {self.dp_size}, or their product "
        f"{self.num_devices}"
      )
    if model_cfg is None:
      return
    c = model_cfg
    checks = [
      ("--tp-size", self.tp_size, c.num_attention_heads, "attention heads"),
      ("--tp-size", self.tp_size, c.vocab_size, "vocabulary entries"),
      ("--ep-size", self.ep_size, c.n_routed_experts, "routed experts"),
    ]
    if any(not c.is_moe_layer(l) for l in range(c.num_hidden_layers)):
      checks.append(("--tp-size", self.tp_size, c.intermediate_size, "dense MLP width (intermediate_size)"))
    if c.n_shared_experts:
      checks.append(("--tp-size", self.tp_size, c.moe_intermediate_size * c.n_shared_experts, "shared-expert width"))
    if "tp" not in self.expert_axes:
      checks.append(("--tp-size", self.tp_size, c.moe_intermediate_size, "expert width (moe_intermediate_size)"))
    for flag, size, dim, what in checks:
      if dim % size:
        raise MeshError(f"{flag} {size} does not divide the model's {dim} {what}")
    if fp8_weights and self.expert_axes and self.logical_to_mesh()["moe_mlp"] is not None:
      width = c.moe_intermediate_size // self.tp_size
      if width % FP8_BLOCK:
        raise MeshError(
          f"--weight-dtype fp8 with --ep-size {self.ep_size} = --dp-size: each expert's width is split "
          f"over --tp-size {self.tp_size} into {width} columns, not a whole number of {FP8_BLOCK}-wide "
          f"FP8 blocks; use --ep-size {self.num_devices} (or {self.tp_size})"
        )

  def make_mesh(self) -> Mesh:
    """A ``Mesh`` of the first dp x tp devices, axes ``("dp", "tp")`` (auto sharding: GSPMD propagates)."""
    devices = jax.devices()
    self.validate(num_devices=len(devices))
    grid = np.asarray(devices[: self.num_devices]).reshape(self.dp_size, self.tp_size)
    return Mesh(grid, AXES, axis_types=(jax.sharding.AxisType.Auto,) * len(AXES))


def placer(mesh_cfg: MeshConfig, mesh: Mesh):
  """(parameter path, shape) -> its NamedSharding on ``mesh``: the ``sharding`` argument of
  ``models.convert.load_model``, so that each parameter goes straight to its devices as it loads."""
  return lambda path, shape: NamedSharding(mesh, mesh_cfg.spec(path, shape))


def param_specs(mesh_cfg: MeshConfig, state):
  """A pytree like ``state`` (an ``nnx.State`` or any pytree of arrays / shape structs) of PartitionSpecs."""
  return jax.tree_util.tree_map_with_path(lambda path, x: mesh_cfg.spec(param_path(path), tuple(x.shape)), state)


def shard_params(mesh_cfg: MeshConfig, mesh: Mesh, state):
  """``state`` placed on ``mesh``: each device gets its slice of every parameter (``jax.device_put`` with the
  rule table's ``NamedSharding``s)."""
  specs = param_specs(mesh_cfg, state)
  return jax.device_put(
    state, jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda x: isinstance(x, P))
  )


def bytes_per_device(mesh_cfg: MeshConfig, state, itemsize=None) -> int:
  """Bytes of ``state``'s parameters each device holds under the rule table (shapes divided by the axes
  their dimensions are split over; replicated parameters counted whole). itemsize: a function
  (path, shape, dtype) -> bytes of the whole parameter (default: size x dtype itemsize)."""
  total = 0
  for path, x in jax.tree_util.tree_flatten_with_path(state)[0]:
    name = param_path(path)
    nbytes = itemsize(name, x.shape, x.dtype) if itemsize else math.prod(x.shape) * np.dtype(x.dtype).itemsize
    total += nbytes // mesh_cfg.shards(mesh_cfg.spec(name, tuple(x.shape)))
  return total
