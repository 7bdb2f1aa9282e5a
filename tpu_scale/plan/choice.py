"""The planner's prices: which gradient summation is cheapest for the machine at hand.

`choose_algorithm(hardware, tensors)` prices every option the executor (`tpu_scale.torus.all_reduce`) can run
for the gradient's real tensors, with the executor's own fusion and padding rules, and picks the
cheapest; `hardware_cluster(...)` builds the `Hardware` of the machine a strategy runs on (from the
`hardware` that `create_strategy` records in `strategy.auto_algorithm`). A training run does not
ask it: `"auto"` is `torus.resolve_algorithm`'s fixed rule, which agrees with these prices on the
clusters the benchmarks measured (`tests/test_torus_schedule.py`).

What it picks, and why (ResNet-50's 214 float32 tensors, 32 MiB packs; `tests/test_plan.py` pins
it):

* One CPU host (virtual replicas): `"flat"`, summed on one device in the step graph. The replicas
  share one memory and a tensor handed between CPU devices is not copied, so a sum is one pass over
  the members' values; a reduce-scatter's shards must be copied together again, and collective ops
  (TensorFlow's default included) pay a launch and a hand-off per step. TensorFlow's
  `ReductionToOneDevice` is the same form.
* CPU worker processes (a row of replicas per process): `"torus_2d"`, the hierarchical sum: its row
  phases are plain ops inside each process and only the column all-reduce of a `1/cols` shard
  crosses between processes. With `gradient_dtype="bfloat16"` the phases between processes cost
  half, and the choice may move to a form with more of them (the bidirectional one).
* GPU hosts: for large gradients TensorFlow's own NCCL all-reduce (`"native"`, one fused buffer: one
  ring's latency, where 32 MiB packs pay it per pack); for small gradients across hosts
  `"torus_2d"`, whose `2 (hosts - 1)` network steps beat a flat ring's.
* TPU slices: the 2-D forms on full-pod and wrapped dimensions (bidirectional on v3-512 and larger,
  on v4); on sub-pod v2/v3 slices the 1-D forms (`"ring"`, or `"flat"`: XLA's all-reduce over every
  core), because the catalog assumes, labelled, that only full-pod dimensions wrap around: a sub-pod
  slice's rows and columns are lines with one direction's bandwidth, the ring through the slice a
  cycle with two. Cloud TPU documentation states the wrap-around rule for v4 (a torus where every
  dimension is a multiple of 4) but none for v2/v3 slices. TensorFlow's native TPU reduction is
  XLA's own, not documented, so it is not priced.
"""

import dataclasses

from tpu_scale.plan.catalog import cpu_cluster, gpu_cluster, slice_names, tpu_slice
from tpu_scale.plan.cost import price_schedule
from tpu_scale.torus import schedule as torus_schedule

ITEMSIZE = {"float16": 2, "bfloat16": 2, "float32": 4, "float64": 8}


@dataclasses.dataclass(frozen=True)
class Choice:
    """A decision: the option to run and every option's predicted seconds (None: not priced)."""

    algorithm: str
    predicted: dict
    hardware: str

    def summary(self):
        """One line: the choice and the predicted times, cheapest first."""
        priced = sorted((s, a) for a, s in self.predicted.items() if s is not None)
        times = ", ".join(f"{a} {s * 1e3:.1f} ms" for s, a in priced)
        return f"{self.algorithm} on {self.cluster} (predicted: {times})"


def _by_dtype(tensors):
    groups = {}
    for nbytes, dtype in tensors:
        groups.setdefault(dtype, []).append(int(nbytes))
    return groups


def _host_of(hardware):
    hosts = hardware.host_ids()
    return lambda replica: int(hosts[replica])


def price_option(
    hardware, tensors, algorithm, pack_bytes=torus_schedule.DEFAULT_PACK_BYTES, gradient_dtype=None
):
    """Predicted seconds of one option for the gradient `tensors` on `hardware`.

    Args:
      hardware: a `Hardware` (`hardware_cluster`, `tpu_slice`, `gpu_cluster`, `cpu_cluster`).
      tensors: `[(num_bytes, dtype_name), ...]`, one per gradient tensor.
      algorithm: one of `torus_schedule.ALGORITHMS_AND_NATIVE`.
      pack_bytes: the executor's fused buffer size.
      gradient_dtype: dtype name of the phases between hosts (e.g. `"bfloat16"`), or None.

    Returns:
      Seconds, or None when the option cannot be priced (TensorFlow's own reduction on TPU).
    """
    mesh = hardware.mesh
    host_of = _host_of(hardware)
    total = 0.0
    if algorithm == "native":
        if hardware.kind == "tpu":
            return None
        # TensorFlow's all-reduce: one collective all-reduce over everyone per tensor on CPU (what
        # CollectiveAllReduce launched here, timed in benchmarks/all_reduce.py), one fused NCCL
        # buffer per dtype on GPUs (MirroredStrategy's NcclAllReduce with one pack).
        for sizes in _by_dtype(tensors).values():
            for nbytes in sizes if hardware.kind == "cpu" else [sum(sizes)]:
                schedule = torus_schedule.build_schedule(mesh, nbytes, "flat")
                total += price_schedule(schedule, hardware, in_graph=False)["seconds"]
        return total
    for dtype, sizes in _by_dtype(tensors).items():
        itemsize = ITEMSIZE.get(dtype, 4)
        phases = [p for s in torus_schedule.build_schedule(mesh, 0, algorithm).streams for p in s]
        in_graph = (
            hardware.host_memory is not None
            and bool(phases)
            and all(torus_schedule.phase_within_hosts(p, host_of) for p in phases)
        )
        packs = (
            [[b] for b in sizes]
            if in_graph
            else [
                [sizes[i] for i in pack] for pack in torus_schedule.pack_indices(sizes, pack_bytes)
            ]
        )
        transport = ITEMSIZE.get(gradient_dtype, itemsize) if gradient_dtype else itemsize
        for pack in packs:
            schedule = torus_schedule.buffer_schedule(mesh, sum(pack), itemsize, algorithm)
            schedule = torus_schedule.transport_schedule(schedule, host_of, itemsize, transport)
            total += price_schedule(schedule, hardware)["seconds"]
            if transport < itemsize and hardware.host_memory is not None:
                # Casting there and back: read and write the shard of every phase between hosts.
                crossing = sum(
                    p.bytes_in
                    for s in schedule.streams
                    for p in s
                    if torus_schedule.phase_between_hosts(p, host_of)
                )
                per_host = hardware.replicas_per_host or hardware.num_replicas
                total += 3 * crossing * per_host / hardware.host_memory.bandwidth
            if len(pack) > 1 and hardware.host_memory is not None:
                # Fusing copies every tensor into the buffer on every replica of a host.
                per_host = hardware.replicas_per_host or hardware.num_replicas
                total += 2 * sum(pack) * per_host / hardware.host_memory.bandwidth
    return total


def choose_algorithm(
    hardware,
    tensors,
    pack_bytes=torus_schedule.DEFAULT_PACK_BYTES,
    gradient_dtype=None,
    options=torus_schedule.ALGORITHMS_AND_NATIVE,
):
    """The cheapest option for summing `tensors` on `hardware`, by the cost model.

    Args:
      hardware: a `Hardware`.
      tensors: `[(num_bytes, dtype_name), ...]`, one per gradient tensor.
      pack_bytes: the executor's fused buffer size.
      gradient_dtype: dtype name of the phases between hosts, or None.
      options: the options to price (default `torus_schedule.ALGORITHMS_AND_NATIVE`: every
        algorithm and `"native"`).

    Returns:
      A `Choice`. Ties keep the earlier option of `options`.
    """
    if not tensors:
        raise ValueError(
            "choose_algorithm needs at least one gradient tensor [(num_bytes, dtype)]."
        )
    predicted = {a: price_option(hardware, tensors, a, pack_bytes, gradient_dtype) for a in options}
    priced = [a for a in options if predicted[a] is not None]
    best = min(priced, key=lambda a: predicted[a])
    return Choice(best, predicted, hardware.name)


def hardware_cluster(
    kind,
    hosts=1,
    replicas_per_host=1,
    gpu=None,
    tpu_slice_name=None,
    cpu_figures=None,
    mesh_shape=None,
):
    """The `Hardware` of the machine a strategy runs on, from what `create_strategy` detects.

    Args:
      kind: `"cpu"`, `"gpu"` or `"tpu"`.
      hosts: hosts (worker processes); the mesh has one row per host off TPU.
      replicas_per_host: replicas on each host.
      gpu: a `catalog.GPU_TYPES` name; unknown or None prices as `"a100"` (an assumption).
      tpu_slice_name: e.g. `"v3-32"`; must be one of `catalog.slice_names()`.
      cpu_figures: this machine's own calibration, instead of `catalog.CPU_FIGURES`.
      mesh_shape: one CPU host's `(rows, cols)`.

    Returns:
      A `Hardware`, or None when the hardware is not in the catalog (then `"auto"` keeps the fixed
      rule of `torus_schedule.resolve_algorithm`).
    """
    if kind == "tpu":
        return tpu_slice(tpu_slice_name) if tpu_slice_name in slice_names() else None
    if kind == "gpu":
        return gpu_cluster(
            int(hosts), int(replicas_per_host), gpu if gpu in ("v100", "a100", "h100") else "a100"
        )
    if kind == "cpu":
        return cpu_cluster(int(hosts), int(replicas_per_host), cpu_figures, mesh_shape)
    raise ValueError(f"kind={kind!r}; choose 'cpu', 'gpu' or 'tpu'.")
