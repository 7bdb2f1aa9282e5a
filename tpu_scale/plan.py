"""The pod-scale planner: what a slice, a batch and a BN span cost before the money is spent.

An alpha-beta cost model prices the gradient-summation schedules of `tpu_scale.torus` (the same `Schedule`
objects the executor runs): the 1-D ring, the 2-D torus (reduce-scatter along rows, all-reduce of the shard
along columns, all-gather along rows) and the paper's bidirectional 2-D form, for TPU slices by name and for
GPU clusters. It also says how many images per second each host must feed and which BN group size gives a
span of 64-128 examples.

    python -m tpu_scale.plan --slice v3-2048 --model resnet50 --per_core_batch 16
    python -m tpu_scale.plan --hosts 32 --gpus_per_host 8 --gpu a100 --json
    python -m tpu_scale.plan --slice v3-2048 --plot scaling.png
    python -m tpu_scale.plan --calibrate          # fits alpha/beta on this machine's 8 CPU replicas

The model, in brief (details in `price_schedule`):

* A *node* is what the remote links connect: a TPU chip, or a GPU host. Its replicas (the cores of a chip,
  the GPUs of a host) are joined by *local* links (on-chip paths, NVLink).
* On a TPU, a phase over a group spanning `k` chips with `m` replicas on each is priced as a two-level ring:
  the `m` cores combine over the on-chip path (`m - 1` steps each way), the chips form a ring over the
  inter-chip links (`k - 1` steps for a reduce-scatter or all-gather, `2 (k - 1)` for an all-reduce). That is
  how a chip's cores join the chip's place in the ring, so step counts are in chips, as in the paper (124 vs
  2046 on 32x32). On GPUs a group is one flat ring through all its GPUs, as NCCL runs it: `2 (H - 1)` of its
  steps cross hosts, the rest stay on NVLink.
* Each step costs its link's `alpha`; bytes cost `bytes / bandwidth`, where a chip's bandwidth on a torus
  ring counts both directions (the ring's data is split in two halves sent opposite ways) and a line without
  wrap-around counts one.
* Streams of a schedule run at the same time: phases that use the same links share their bandwidth (an
  event simulation with fair sharing), phases on different links do not. So the bidirectional form, whose two
  halves run on the rows' and the columns' links at once, gets the bandwidth of both dimensions.

Every hardware figure is listed with its source, or labelled as an assumption, in `TPU_GENERATIONS` and
`GPU_TYPES`; `assumptions()` of a cluster lists them with the plan.

Reference:
  Ying et al., "Image Classification at Supercomputer Scale", 2018 (arXiv:1811.06992), section 3.3.
"""

import argparse
import dataclasses
import json
import math
import sys
import time

import numpy as np

from tpu_scale import torus
from tpu_scale.mesh import ReplicaMesh

_GBIT = 1e9 / 8  # bytes/s in one Gbit/s
_US = 1e-6

# --------------------------------------------------------------------------- models and dtypes

# Trainable parameters (the gradient a step sums), counted from keras.applications (weights=None) unless noted.
MODELS = {
    "resnet50": 25_583_592,  # keras.applications.ResNet50; the paper's "about 25.6 M"
    "resnet101": 44_601_832,  # keras.applications.ResNet101
    "resnet152": 60_268_520,  # keras.applications.ResNet152
    "mobilenet_v2": 3_504_872,  # keras.applications.MobileNetV2
    "efficientnet_b0": 5_288_548,  # keras.applications.EfficientNetB0
    "vit_b16": 86_567_656,  # ViT-B/16 at 224 px (Dosovitskiy et al. 2020: "86M")
    "bert_large": 340_000_000,  # BERT-Large (Devlin et al. 2018: "340M"), rounded
}

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def gradient_bytes(model=None, params=None, dtype="float32"):
    """Bytes of gradient each replica contributes per step.

    Args:
      model: a name from `MODELS`, or None when `params` is given.
      params: number of trainable parameters, instead of a model name.
      dtype: `"float32"`, `"bfloat16"` or `"float16"`: the dtype the gradients are summed in.

    Returns:
      `(num_params, num_bytes)`.
    """
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"dtype={dtype!r} is not supported; choose one of {sorted(DTYPE_BYTES)}.")
    if (model is None) == (params is None):
        raise ValueError("Give exactly one of model (a name) or params (a parameter count).")
    if model is not None:
        if model not in MODELS:
            raise ValueError(f"Unknown model {model!r}; known models: {sorted(MODELS)} (or pass params=N).")
        params = MODELS[model]
    if isinstance(params, bool) or not isinstance(params, (int, np.integer)) or params <= 0:
        raise ValueError(f"params must be a positive integer number of parameters, got {params!r}.")
    return int(params), int(params) * DTYPE_BYTES[dtype]


# --------------------------------------------------------------------------- hardware


@dataclasses.dataclass(frozen=True)
class Link:
    """One class of links, as a ring of nodes sees it.

    Attributes:
      name: the shared resource: concurrent phases on links of the same name share `bandwidth`.
      alpha: seconds per sequential step (hop latency plus the step's synchronisation).
      bandwidth: bytes/s one node pushes around a ring on these links, all directions the ring uses.
    """

    name: str
    alpha: float
    bandwidth: float


@dataclasses.dataclass(frozen=True)
class Cluster:
    """A machine to plan for: its replica mesh, how replicas sit on nodes, and the links between them.

    Attributes:
      name: e.g. `"v3-2048"` or `"32x8 a100"`.
      kind: `"tpu"`, `"gpu"` or `"cpu"`.
      mesh: the `ReplicaMesh` the schedules are built on.
      replicas_per_node: replicas on one node; node of replica `(r, c)` is `(r, c // replicas_per_node)`.
      node: what a node is: `"chip"` or `"host"` (or `"replica"`).
      links: remote `Link` for each phase dimension (`"rows"`, `"columns"`, `"all"`).
      local: the `Link` between replicas of one node (per replica).
      nodes_per_host: chips per host (1 when the node is the host).
      node_shape: the physical shape of the nodes (chips `(x, y[, z])`, or `(hosts,)`).
      images_per_sec_per_node: training throughput of one node, for the input-rate estimate.
      sources: the hardware figures and where they come from (or that they are assumptions).
      flat_rings: True when a group spanning several nodes runs one flat ring through all its replicas (NCCL
        on GPUs); False when a node's replicas combine first and the nodes form the ring (TPU chips).
      phase_overhead: seconds to launch one collective (one phase), on top of its steps; fitted on CPU
        replicas, where it dominates; 0 for the TPU and GPU figures, whose alpha covers it.
    """

    name: str
    kind: str
    mesh: ReplicaMesh
    replicas_per_node: int
    node: str
    links: dict
    local: Link
    nodes_per_host: int
    node_shape: tuple
    images_per_sec_per_node: float
    sources: tuple = ()
    flat_rings: bool = False
    phase_overhead: float = 0.0

    @property
    def num_replicas(self):
        return self.mesh.num_replicas

    @property
    def num_nodes(self):
        return self.num_replicas // self.replicas_per_node

    @property
    def num_hosts(self):
        return max(1, math.ceil(self.num_nodes / self.nodes_per_host))

    def node_ids(self):
        """int `[num_replicas]`: the node each replica sits on."""
        rows, cols = self.mesh.shape
        per_row = cols // self.replicas_per_node
        ids = np.empty(self.num_replicas, dtype=np.int64)
        for (r, c), rid in np.ndenumerate(self.mesh.grid):
            ids[rid] = r * per_row + c // self.replicas_per_node
        return ids

    def describe(self):
        """A JSON-ready summary."""
        return {
            "name": self.name,
            "kind": self.kind,
            "replicas": self.num_replicas,
            "mesh_shape": list(self.mesh.shape),
            "node": self.node,
            "nodes": self.num_nodes,
            "node_shape": list(self.node_shape),
            "hosts": self.num_hosts,
            "links": {dim: _link_dict(link) for dim, link in self.links.items()},
            "local_link": _link_dict(self.local),
            "flat_rings": self.flat_rings,
            "sources": list(self.sources),
        }


def _link_dict(link):
    bandwidth = link.bandwidth if math.isfinite(link.bandwidth) else None  # strict JSON has no Infinity
    return {"name": link.name, "alpha_seconds": link.alpha, "bandwidth_bytes_per_sec": bandwidth}


# TPU generations. Link bandwidth is per direction of one inter-chip link; the v3 and v4 figures check
# against the documented pod all-reduce bandwidth: 1024 chips x 4 links x 82 GB/s = 336 TB/s (~340 TB/s),
# 1.1 PB/s / (4096 chips x 6 links) = 45 GB/s.
TPU_GENERATIONS = {
    "v2": {
        "cores_per_chip": 2,
        "replicas_per_chip": 2,
        "link_bandwidth": 496 * _GBIT,
        "link_alpha": 1.0 * _US,
        "onchip_bandwidth": 350e9,
        "onchip_alpha": 0.5 * _US,
        "pod": (16, 16),
        "chips_per_host": 4,
        "images_per_sec_per_chip": 1025 * 45 / 123,
        "shapes": {8: (2, 2), 32: (4, 4), 128: (8, 8), 256: (16, 8), 512: (16, 16)},
        "sources": (
            "TPU v2: 4 inter-chip links per chip at 496 Gbit/s each way (Jouppi et al. 2020, CACM, "
            "'A Domain-Specific Supercomputer for Training Deep Neural Networks'); 256-chip pod as a 16x16 "
            "2-D torus; 2 cores and 700 GB/s HBM per chip (same source).",
            "TPU v2 slice shapes (8->2x2, 32->4x4, 128->8x8, 256->16x8, 512->16x16 chips): assumption, by "
            "the v3 pattern of the notes.",
            "TPU v2 input rate 1025 img/s x 45/123 TFLOPS = ~375 img/s per chip: assumption (v3 paper rate "
            "scaled by peak bf16 FLOPs).",
        ),
    },
    "v3": {
        "cores_per_chip": 2,
        "replicas_per_chip": 2,
        "link_bandwidth": 656 * _GBIT,
        "link_alpha": 1.0 * _US,
        "onchip_bandwidth": 450e9,
        "onchip_alpha": 0.5 * _US,
        "pod": (32, 32),
        "chips_per_host": 4,
        "images_per_sec_per_chip": 1025.0,
        "shapes": {8: (2, 2), 32: (4, 4), 64: (8, 4), 128: (8, 8), 256: (16, 8), 512: (16, 16),
                   1024: (32, 16), 2048: (32, 32)},
        "sources": (
            "TPU v3: 4 inter-chip links per chip at ~656 Gbit/s each way; 1024-chip pod as a 32x32 2-D torus; "
            "pod all-reduce bandwidth documented as 340 TB/s (Jouppi et al. 2020; project notes).",
            "TPU v3 slice shapes: 8->2x2, 32->4x4, 128->8x8, 256->16x8, 512->16x16, 1024->32x16, 2048->32x32 "
            "chips (project notes); 64->8x4 is an assumption by the same pattern.",
            "TPU v3: ~1,025 img/s per chip, 4 chips per host for ResNet-50 (Ying et al. 2018).",
            "TPU v3 on-chip core-to-core path priced at half the chip's 900 GB/s HBM: assumption.",
        ),
    },
    "v4": {
        "cores_per_chip": 2,
        "replicas_per_chip": 1,  # megacore: one device per chip
        "link_bandwidth": 1.1e15 / (4096 * 6),
        "link_alpha": 1.0 * _US,
        "onchip_bandwidth": 1200e9,
        "onchip_alpha": 0.5 * _US,
        "pod": (16, 16, 16),
        "chips_per_host": 4,
        "images_per_sec_per_chip": 1025 * 275 / 123,
        "shapes": {8: (2, 2, 1), 16: (2, 2, 2), 32: (2, 2, 4), 64: (2, 4, 4), 128: (4, 4, 4),
                   256: (4, 4, 8), 512: (4, 8, 8), 1024: (8, 8, 8), 2048: (8, 8, 16), 4096: (8, 16, 16),
                   8192: (16, 16, 16)},
        "sources": (
            "TPU v4: 4096-chip pod, 3-D mesh/torus, 6 links per chip, all-reduce bandwidth 1.1 PB/s per pod "
            "(Cloud TPU v4 documentation); per link 1.1 PB/s / (4096 x 6) = 45 GB/s each way, derived.",
            "TPU v4: one replica per chip (megacore); the 3-D shape is folded to a 2-D mesh of rows = y*z, "
            "cols = x, as ReplicaMesh.from_topology does; a dimension wraps when it is a multiple of 4: "
            "assumption from the documented torus shapes.",
            "TPU v4 slice shapes (v4-8 -> 2x2x1 ... v4-8192 -> 16x16x16 chips): default topologies, assumption.",
            "TPU v4 input rate 1025 img/s x 275/123 TFLOPS = ~2,290 img/s per chip: assumption.",
        ),
    },
}

_TORUS_ASSUMPTION = (
    "Sub-pod TPU v2/v3 slices: only a dimension spanning the whole pod has wrap-around links; a shorter "
    "dimension is a line, whose ring gets one direction's bandwidth: assumption."
)
_ALPHA_ASSUMPTION = (
    "Per-step latency (alpha) of 1 us per inter-chip step and 0.5 us per on-chip step: assumption (order of "
    "magnitude of a hop plus synchronisation); override with alpha_us."
)

# GPU clusters: NVLink per GPU per direction; network per host, all NICs together.
GPU_TYPES = {
    "v100": {
        "nvlink_bandwidth": 150e9,
        "network_bandwidth": 4 * 100 * _GBIT,
        "images_per_sec": 1200.0,
        "source": "V100 SXM2: NVLink 300 GB/s total (150 GB/s each way); DGX-1: 4x 100 Gbit/s EDR InfiniBand "
                  "per host (NVIDIA datasheets).",
    },
    "a100": {
        "nvlink_bandwidth": 300e9,
        "network_bandwidth": 8 * 200 * _GBIT,
        "images_per_sec": 2500.0,
        "source": "A100 SXM4: NVLink 600 GB/s total (300 GB/s each way); DGX A100: 8x 200 Gbit/s HDR "
                  "InfiniBand per host (NVIDIA datasheets).",
    },
    "h100": {
        "nvlink_bandwidth": 450e9,
        "network_bandwidth": 8 * 400 * _GBIT,
        "images_per_sec": 5000.0,
        "source": "H100 SXM5: NVLink 900 GB/s total (450 GB/s each way); DGX H100: 8x 400 Gbit/s NDR "
                  "InfiniBand per host (NVIDIA datasheets).",
    },
}
_GPU_ASSUMPTIONS = (
    "GPU per-step latency: 2 us over NVLink, 5 us over the network: assumption (order of NCCL step latency).",
    "GPU ResNet-50 training rate per GPU (v100 1,200, a100 2,500, h100 5,000 img/s): rough assumption; pass "
    "target_images_per_sec for a real target.",
    "A GPU group spanning several hosts is priced as one flat ring through all its GPUs (as NCCL runs it): "
    "of its 2(N-1) steps 2(H-1) cross hosts and the rest stay on NVLink; each host sends 2(N-1)/N of the "
    "gradient on the network.",
)


def slice_names(generation=None):
    """Every known TPU slice name, e.g. `["v2-8", ..., "v3-2048", ...]`."""
    gens = [generation] if generation else list(TPU_GENERATIONS)
    return [f"{g}-{cores}" for g in gens for cores in TPU_GENERATIONS[g]["shapes"]]


def _parse_slice(name):
    if not isinstance(name, str) or "-" not in name:
        raise ValueError(f"Bad TPU slice name {name!r}: expected '<generation>-<cores>', one of {slice_names()}.")
    generation, _, cores = name.partition("-")
    if generation not in TPU_GENERATIONS:
        raise ValueError(
            f"Unknown TPU generation {generation!r} in slice {name!r}; known generations: "
            f"{sorted(TPU_GENERATIONS)}. Valid slices: {slice_names()}."
        )
    shapes = TPU_GENERATIONS[generation]["shapes"]
    if not cores.isdigit() or int(cores) not in shapes:
        raise ValueError(
            f"Unknown {generation} slice {name!r} (the number is TensorCores); valid: {slice_names(generation)}."
        )
    return generation, int(cores)


WRAPAROUND = ("pod", "all")


def _wraps(extent, pod_extent, generation, wraparound):
    if extent <= 1:
        return False
    if wraparound == "all":
        return True
    if generation == "v4":
        return extent % 4 == 0
    return extent == pod_extent


def _ring_directions(extents, wraps):
    """How many link directions a ring over a (folded) block of chips can drive: 2 on a cycle, 1 on a line."""
    extents = [e for e in extents if e > 1]
    if not extents:
        return 1
    if len(extents) == 1:
        return 2 if wraps[0] else 1
    # A grid of at least two dimensions has a Hamiltonian cycle when it has an even number of chips or wraps.
    return 2 if (math.prod(extents) % 2 == 0 or any(wraps)) else 1


def tpu_slice(name, alpha_us=None, wraparound="pod"):
    """The `Cluster` of a TPU slice, e.g. `tpu_slice("v3-2048")`.

    The mesh is rows x (cols * cores), as `ReplicaMesh.from_topology` builds it: rows follow the torus's
    second dimension (folded with the third on v4), columns the first dimension times the cores of a chip.

    Args:
      name: `"<generation>-<cores>"`, one of `slice_names()`.
      alpha_us: per-step latency of an inter-chip step in microseconds, instead of the default assumption.
      wraparound: `"pod"` (the assumption: on v2/v3 only a dimension spanning the whole pod wraps, on v4 a
        multiple of 4) or `"all"` (every dimension is a torus ring), to see what the assumption is worth.

    Returns:
      A `Cluster`.
    """
    if wraparound not in WRAPAROUND:
        raise ValueError(f"wraparound={wraparound!r}; choose one of {WRAPAROUND}.")
    generation, cores = _parse_slice(name)
    spec = TPU_GENERATIONS[generation]
    shape = spec["shapes"][cores]
    per_chip = spec["replicas_per_chip"]
    x, rest = shape[0], shape[1:]
    rows = math.prod(rest)
    mesh = ReplicaMesh.from_shape(rows, x * per_chip, cores_per_chip=per_chip, is_torus=True)
    pod = spec["pod"]
    wrap_x = _wraps(x, pod[0], generation, wraparound)
    wrap_rest = [_wraps(e, p, generation, wraparound) for e, p in zip(rest, pod[1:])]
    alpha = spec["link_alpha"] if alpha_us is None else _checked_alpha(alpha_us)
    bandwidth = spec["link_bandwidth"]
    links = {
        "rows": Link("ici_x", alpha, _ring_directions([x], [wrap_x]) * bandwidth),
        "columns": Link("ici_yz", alpha, _ring_directions(list(rest), wrap_rest) * bandwidth),
        "all": Link("ici_ring", alpha, _ring_directions(list(shape), [wrap_x] + wrap_rest) * bandwidth),
    }
    local = Link("on_chip", spec["onchip_alpha"], spec["onchip_bandwidth"])
    torus_note = _TORUS_ASSUMPTION if wraparound == "pod" else "Every slice dimension taken as a torus ring."
    sources = spec["sources"] + (torus_note, _ALPHA_ASSUMPTION)
    return Cluster(name, "tpu", mesh, per_chip, "chip", links, local, spec["chips_per_host"], tuple(shape),
                   spec["images_per_sec_per_chip"], sources)


def gpu_cluster(hosts, gpus_per_host, gpu="a100", alpha_us=None):
    """The `Cluster` of `hosts` GPU hosts with `gpus_per_host` GPUs each (mesh rows = hosts).

    Args:
      hosts: number of hosts.
      gpus_per_host: GPUs per host, joined by NVLink.
      gpu: one of `GPU_TYPES`.
      alpha_us: per-step latency over the network in microseconds, instead of the default assumption.

    Returns:
      A `Cluster`.
    """
    for label, value in (("hosts", hosts), ("gpus_per_host", gpus_per_host)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
            raise ValueError(f"{label} must be a positive integer, got {value!r}.")
    if gpu not in GPU_TYPES:
        raise ValueError(f"Unknown GPU type {gpu!r}; choose one of {sorted(GPU_TYPES)}.")
    spec = GPU_TYPES[gpu]
    mesh = ReplicaMesh.for_workers(int(hosts), int(gpus_per_host))
    alpha = 5 * _US if alpha_us is None else _checked_alpha(alpha_us)
    # Rows are hosts and columns a host's GPUs, so a row group never leaves its host; every group that does
    # crosses the same NICs, hence one shared "network" resource.
    network = Link("network", alpha, spec["network_bandwidth"])
    links = {"rows": network, "columns": network, "all": network}
    local = Link("nvlink", 2 * _US, spec["nvlink_bandwidth"])
    return Cluster(f"{hosts}x{gpus_per_host} {gpu}", "gpu", mesh, int(gpus_per_host), "host", links, local, 1,
                   (int(hosts),), spec["images_per_sec"] * gpus_per_host, (spec["source"],) + _GPU_ASSUMPTIONS,
                   flat_rings=True)


def uniform_cluster(mesh, alpha, bandwidth, shared=False, name="uniform", kind="cpu", phase_overhead=0.0):
    """A cluster where every replica is its own node and every link costs the same.

    Args:
      mesh: a `ReplicaMesh`.
      alpha: seconds per step.
      bandwidth: bytes/s per replica around a ring.
      shared: True when all phases share one resource (CPU replicas on the same memory), False when rows
        and columns have their own links (an ideal torus).
      name: a label.
      kind: a label: `"cpu"`, or anything else.
      phase_overhead: seconds to launch each collective.

    Returns:
      A `Cluster`.
    """
    names = ("shared",) * 3 if shared else ("rows", "columns", "all")
    links = {dim: Link(n, alpha, bandwidth) for dim, n in zip(("rows", "columns", "all"), names)}
    return Cluster(name, kind, mesh, 1, "replica", links, Link("local", 0.0, math.inf), 1,
                   mesh.shape, 0.0, ("Uniform links: alpha and bandwidth given by the caller.",),
                   phase_overhead=float(phase_overhead))


def _checked_alpha(alpha_us):
    if not isinstance(alpha_us, (int, float)) or alpha_us < 0 or not math.isfinite(alpha_us):
        raise ValueError(f"alpha_us must be a non-negative number of microseconds, got {alpha_us!r}.")
    return alpha_us * _US


# --------------------------------------------------------------------------- pricing


@dataclasses.dataclass(frozen=True)
class _Part:
    """A piece of a phase: its latency, then `nbytes` over `link` (the link that bounds the transfer).

    `steps` and `local_steps` count the critical path's steps between nodes and inside a node;
    `remote_bytes` is what each node sends to other nodes, `local_bytes` what each replica sends inside its node.
    """

    latency: float
    link: Link
    nbytes: float
    steps: int
    local_steps: int
    remote_bytes: float
    local_bytes: float


def _group_layout(phase, node_ids):
    """`(k, m, groups_per_node)`: nodes a group spans, replicas per node in it, groups touching a node."""
    nodes = node_ids[phase.groups]
    k = max(len(np.unique(row)) for row in nodes)
    m = max(int(np.bincount(row).max()) for row in nodes)
    touching = np.zeros(int(node_ids.max()) + 1, dtype=np.int64)
    for row in nodes:
        touching[np.unique(row)] += 1
    return k, m, int(touching.max())


def _local_part(cluster, m, full):
    """A ring of the `m` replicas of one node: `m - 1` steps, `(m - 1) / m` of the data per replica."""
    nbytes = (m - 1) / m * full
    return _Part((m - 1) * cluster.local.alpha, cluster.local, nbytes, 0, m - 1, 0.0, nbytes)


def _phase_parts(phase, cluster, node_ids):
    """The parts of one phase, in execution order.

    Two-level (TPU): a chip's replicas combine on chip, the chips form a ring, so a group of `k` chips costs
    `k - 1` steps per pass whatever the cores per chip. Flat (`cluster.flat_rings`, NCCL-style GPU rings): one
    ring through every replica, `g - 1` steps per pass, `k - 1` of them between hosts and `g - k` over NVLink,
    each host sending `(g - 1) / g` of the data per pass on its one outgoing network edge.
    """
    k, m, per_node = _group_layout(phase, node_ids)
    g = phase.group_size
    # The data one group moves around its ring: the whole vector for a reduce-scatter or an all-reduce, the
    # gathered vector for an all-gather.
    full = phase.bytes_out if phase.kind == torus.ALL_GATHER else phase.bytes_in
    passes = 2 if phase.kind == torus.ALL_REDUCE else 1
    remote = cluster.links[phase.dimension]
    if cluster.flat_rings and k > 1 and m > 1:
        remote_bytes = per_node * passes * (g - 1) / g * full
        local_bytes = passes * (g - 1) / g * full
        steps, local_steps = passes * (k - 1), passes * (g - k)
        latency = steps * remote.alpha + local_steps * cluster.local.alpha
        # Both kinds of link carry the ring's chunks at the same time; the slower one bounds the transfer.
        if remote_bytes / remote.bandwidth >= local_bytes / cluster.local.bandwidth:
            link, nbytes = remote, remote_bytes
        else:
            link, nbytes = cluster.local, local_bytes
        return [_Part(latency, link, nbytes, steps, local_steps, remote_bytes, local_bytes)]
    parts = []
    if m > 1 and phase.kind in (torus.REDUCE_SCATTER, torus.ALL_REDUCE):
        parts.append(_local_part(cluster, m, full))
    if k > 1:
        steps = passes * (k - 1)
        nbytes = per_node * passes * (k - 1) / k * full
        parts.append(_Part(steps * remote.alpha, remote, nbytes, steps, 0, nbytes, 0.0))
    if m > 1 and phase.kind in (torus.ALL_GATHER, torus.ALL_REDUCE):
        parts.append(_local_part(cluster, m, full))
    return parts


def _simulate(streams):
    """Seconds until every stream is done; concurrent transfers on one link name share its bandwidth fairly.

    Args:
      streams: list of lists of segments `("delay", seconds)` or `("send", link, bytes)`.
    """
    cursor = [0] * len(streams)
    left = [None] * len(streams)

    def load(i):
        while cursor[i] < len(streams[i]):
            seg = streams[i][cursor[i]]
            amount = seg[1] if seg[0] == "delay" else seg[2]
            if amount > 0:
                left[i] = amount
                return
            cursor[i] += 1
        left[i] = None

    for i in range(len(streams)):
        load(i)
    now = 0.0
    while True:
        active = [i for i in range(len(streams)) if left[i] is not None]
        if not active:
            return now
        users = {}
        for i in active:
            seg = streams[i][cursor[i]]
            if seg[0] == "send":
                users[seg[1].name] = users.get(seg[1].name, 0) + 1
        rate = {}
        for i in active:
            seg = streams[i][cursor[i]]
            rate[i] = 1.0 if seg[0] == "delay" else seg[1].bandwidth / users[seg[1].name]
        dt = min(left[i] / rate[i] for i in active)
        now += dt
        for i in active:
            left[i] -= rate[i] * dt
            if left[i] <= 1e-12 * max(1.0, rate[i] * dt) or left[i] / rate[i] <= 1e-15:
                cursor[i] += 1
                load(i)


def price_schedule(schedule, cluster):
    """Predicted cost of one `torus.Schedule` on `cluster`.

    Args:
      schedule: a `Schedule` from `torus.build_schedule` on `cluster.mesh`.
      cluster: a `Cluster`.

    Returns:
      dict with `steps` (sequential steps between nodes on the critical path: 2(N-1) for a ring over N
      nodes, 2(X-1)+2(Y-1) for the 2-D forms), `local_steps` (on-chip / NVLink steps), `bytes_per_node`
      (bytes each node sends to other nodes), `local_bytes_per_replica`, `seconds` (all streams done),
      `latency_seconds` (the critical path's steps times alpha) and `transfer_seconds` (the rest).
    """
    if schedule.mesh.num_replicas != cluster.num_replicas:
        raise ValueError(
            f"The schedule's mesh has {schedule.mesh.num_replicas} replicas but the cluster {cluster.name!r} "
            f"has {cluster.num_replicas}; build the schedule on cluster.mesh."
        )
    node_ids = cluster.node_ids()
    steps, local_steps, latency = 0, 0, 0.0
    remote_bytes, local_bytes = 0.0, 0.0
    segments = []
    for stream in schedule.streams:
        s_steps = s_local = 0
        s_latency = 0.0
        segs = []
        for phase in stream:
            if cluster.phase_overhead:
                segs.append(("delay", cluster.phase_overhead))
                s_latency += cluster.phase_overhead
            for part in _phase_parts(phase, cluster, node_ids):
                segs.append(("delay", part.latency))
                segs.append(("send", part.link, part.nbytes))
                s_latency += part.latency
                s_steps += part.steps
                s_local += part.local_steps
                remote_bytes += part.remote_bytes
                local_bytes += part.local_bytes
        segments.append(segs)
        steps, local_steps = max(steps, s_steps), max(local_steps, s_local)
        latency = max(latency, s_latency)
    seconds = _simulate(segments)
    return {
        "steps": int(steps),
        "local_steps": int(local_steps),
        "bytes_per_node": float(remote_bytes),
        "local_bytes_per_replica": float(local_bytes),
        "seconds": float(seconds),
        "latency_seconds": float(latency),
        "transfer_seconds": float(max(seconds - latency, 0.0)),
    }


def price_algorithms(cluster, num_bytes, algorithms=torus.ALGORITHMS):
    """`{algorithm: price_schedule(...)}` for `num_bytes` of gradient per replica on `cluster`."""
    if isinstance(num_bytes, bool) or not isinstance(num_bytes, (int, np.integer)) or num_bytes < 0:
        raise ValueError(f"num_bytes must be a non-negative integer, got {num_bytes!r}.")
    return {alg: price_schedule(torus.build_schedule(cluster.mesh, int(num_bytes), alg), cluster)
            for alg in algorithms}


# --------------------------------------------------------------------------- input rate and BN groups


def input_rate(cluster, target_images_per_sec=None):
    """Images per second each host must decode and feed.

    Args:
      cluster: a `Cluster`.
      target_images_per_sec: the whole job's target; default: the node's known training rate times nodes
        (for TPU v3 the paper's ~1,025 img/s per chip).

    Returns:
      dict with the target, and the rate per host, per node and per replica.
    """
    if target_images_per_sec is None:
        target = cluster.images_per_sec_per_node * cluster.num_nodes
        basis = f"{cluster.images_per_sec_per_node:,.0f} img/s per {cluster.node} (see sources)"
    else:
        if not isinstance(target_images_per_sec, (int, float)) or not target_images_per_sec > 0:
            raise ValueError(f"target_images_per_sec must be positive, got {target_images_per_sec!r}.")
        target, basis = float(target_images_per_sec), "given target"
    return {
        "target_images_per_sec": float(target),
        "basis": basis,
        "hosts": cluster.num_hosts,
        "per_host": target / cluster.num_hosts,
        f"per_{cluster.node}": target / cluster.num_nodes,
        "per_replica": target / cluster.num_replicas,
    }


def suggest_bn_group(mesh, per_core_batch, span=(64, 128)):
    """The smallest topology-tiled BN group whose span (per-core batch x group size) reaches `span[0]`.

    Args:
      mesh: a `ReplicaMesh`; groups come from `mesh.group_assignment(g, tiled=True)`.
      per_core_batch: examples per replica per step.
      span: `(low, high)` examples normalized together; the authors' team ran 64-128.

    Returns:
      dict with `group_size`, `span`, `in_range`, `tile_replicas` (rows, cols of one group), `tile_chips`,
      `num_groups`, `first_group` and a `note`.
    """
    if isinstance(per_core_batch, bool) or not isinstance(per_core_batch, (int, np.integer)) or per_core_batch < 1:
        raise ValueError(f"per_core_batch must be a positive integer, got {per_core_batch!r}.")
    low, high = span
    n = mesh.num_replicas
    for g in (d for d in range(1, n + 1) if n % d == 0):
        if g * per_core_batch < low and g < n:
            continue
        try:
            groups = mesh.group_assignment(g, tiled=True)
        except ValueError:
            continue
        coords = np.array([mesh.coordinates(int(r)) for r in groups[0]])
        tile = (int(np.ptp(coords[:, 0])) + 1, int(np.ptp(coords[:, 1])) + 1)
        chips = (tile[0], max(1, tile[1] // mesh.cores_per_chip))
        s = g * int(per_core_batch)
        if s < low:
            note = f"even all {n} replicas span only {s} < {low} examples"
        elif s > high and g == 1:
            note = f"the per-core batch alone spans {s} > {high}: plain per-replica batch norm"
        elif s > high:
            note = f"no tiled group spans {low}-{high}; the smallest reaching {low} spans {s}"
        else:
            note = f"span {s} in {low}-{high}"
        return {
            "per_core_batch": int(per_core_batch),
            "group_size": int(g),
            "span": s,
            "in_range": low <= s <= high,
            "tile_replicas": list(tile),
            "tile_chips": list(chips),
            "num_groups": int(groups.shape[0]),
            "first_group": groups[0].tolist(),
            "note": note,
        }
    raise AssertionError("unreachable: the whole mesh is always a valid group")


# --------------------------------------------------------------------------- the plan


def plan(cluster, model=None, params=None, dtype="float32", per_core_batch=None, target_images_per_sec=None):
    """Everything the CLI prints, as a JSON-ready dict.

    Args:
      cluster: a `Cluster` (`tpu_slice`, `gpu_cluster`).
      model, params, dtype: the gradient (see `gradient_bytes`); default model `"resnet50"`.
      per_core_batch: examples per replica, for the BN group and the step-time share; optional.
      target_images_per_sec: the job's target; default the node's known rate.

    Returns:
      dict with `cluster`, `model`, `algorithms` (per algorithm: `steps`, `seconds`, ...), `best`, `input`,
      `bn_group` (or None), `step` (or None) and `sources`.
    """
    if model is None and params is None:
        model = "resnet50"
    num_params, num_bytes = gradient_bytes(model, params, dtype)
    algorithms = price_algorithms(cluster, num_bytes)
    rate = input_rate(cluster, target_images_per_sec)
    result = {
        "cluster": cluster.describe(),
        "model": {"name": model or "custom", "params": num_params, "dtype": dtype, "bytes": num_bytes},
        "algorithms": algorithms,
        "best": min(algorithms, key=lambda a: algorithms[a]["seconds"]),
        "input": rate,
        "bn_group": None,
        "step": None,
        "sources": list(cluster.sources),
    }
    if per_core_batch is not None:
        bn = suggest_bn_group(cluster.mesh, per_core_batch)
        bn[f"{cluster.node}s_per_group"] = len(np.unique(cluster.node_ids()[bn["first_group"]]))
        result["bn_group"] = bn
        global_batch = per_core_batch * cluster.num_replicas
        step_seconds = global_batch / rate["target_images_per_sec"] if rate["target_images_per_sec"] else None
        result["step"] = {
            "global_batch": int(global_batch),
            "seconds_at_target": step_seconds,
            "gradient_sum_share": {a: (v["seconds"] / step_seconds if step_seconds else None)
                                   for a, v in algorithms.items()},
        }
    return result


def _fmt_bytes(n):
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n:.0f} B"


def _fmt_seconds(s):
    if s >= 1:
        return f"{s:.2f} s"
    if s >= 1e-3:
        return f"{s * 1e3:.2f} ms"
    return f"{s * 1e6:.1f} us"


def format_plan(result):
    """The plan as a human-readable table and notes."""
    c, m = result["cluster"], result["model"]
    node = c["node"]
    lines = [
        f"{c['name']}: {c['replicas']} replicas on {c['nodes']} {node}s "
        f"({'x'.join(map(str, c['node_shape']))}), {c['hosts']} host(s), mesh {c['mesh_shape'][0]}x"
        f"{c['mesh_shape'][1]}",
        f"gradient: {m['name']} {m['params']:,} params in {m['dtype']} = {_fmt_bytes(m['bytes'])} per replica",
        "",
        f"{'algorithm':<24}{'steps':>7}{'local':>7}{'bytes/' + node:>13}{'latency':>11}{'transfer':>11}"
        f"{'predicted':>11}",
    ]
    for name, a in result["algorithms"].items():
        lines.append(
            f"{name:<24}{a['steps']:>7}{a['local_steps']:>7}{_fmt_bytes(a['bytes_per_node']):>13}"
            f"{_fmt_seconds(a['latency_seconds']):>11}{_fmt_seconds(a['transfer_seconds']):>11}"
            f"{_fmt_seconds(a['seconds']):>11}"
        )
    lines.append(f"fastest: {result['best']}")
    r = result["input"]
    lines += ["", f"input: {r['target_images_per_sec']:,.0f} img/s ({r['basis']}) -> {r['per_host']:,.0f} img/s "
                  f"per host over {r['hosts']} host(s), {r[f'per_{node}']:,.0f} per {node}"]
    if result["bn_group"]:
        b = result["bn_group"]
        lines.append(
            f"BN group for per-core batch {b['per_core_batch']}: {b['group_size']} replicas "
            f"(a {b['tile_replicas'][0]}x{b['tile_replicas'][1]} tile of the mesh on {b[f'{node}s_per_group']} "
            f"{node}(s)), {b['num_groups']} groups; {b['note']}"
        )
    if result["step"] and result["step"]["seconds_at_target"]:
        s = result["step"]
        share = s["gradient_sum_share"][result["best"]]
        lines.append(
            f"step: global batch {s['global_batch']:,} -> {_fmt_seconds(s['seconds_at_target'])} per step at the "
            f"target rate; {result['best']} takes {share:.1%} of it if not overlapped"
        )
    lines += ["", "figures and assumptions:"] + [f"  - {s}" for s in result["sources"]]
    return "\n".join(lines)


# --------------------------------------------------------------------------- plot


def scaling_series(generation="v3", num_bytes=None, alpha_us=None, wraparound="pod"):
    """Predicted seconds per algorithm for every slice of a TPU generation.

    Returns:
      dict: `chips` (list) and `{algorithm: [seconds]}` under `seconds`, plus `slices`.
    """
    if num_bytes is None:
        num_bytes = gradient_bytes("resnet50")[1]
    if generation not in TPU_GENERATIONS:
        raise ValueError(f"Unknown TPU generation {generation!r}; choose one of {sorted(TPU_GENERATIONS)}.")
    names = slice_names(generation)
    clusters = [tpu_slice(n, alpha_us, wraparound) for n in names]
    prices = [price_algorithms(c, num_bytes) for c in clusters]
    return {
        "slices": names,
        "chips": [c.num_nodes for c in clusters],
        "seconds": {a: [p[a]["seconds"] for p in prices] for a in torus.ALGORITHMS},
        "steps": {a: [p[a]["steps"] for p in prices] for a in torus.ALGORITHMS},
    }


def plot_scaling(path, generation="v3", num_bytes=None, label="ResNet-50 float32", alpha_us=None, mark=None):
    """Draws predicted gradient-summation time against chip count for each algorithm (log-log), to `path`.

    Solid lines use the default wrap-around assumption; thin dashed lines take every slice as a full torus, so
    the plot shows what that assumption is worth.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, LogLocator

    pod = scaling_series(generation, num_bytes, alpha_us, "pod")
    full = scaling_series(generation, num_bytes, alpha_us, "all")
    fig, ax = plt.subplots(figsize=(8, 5), dpi=120)
    styles = {"ring": ("tab:red", "o"), "torus_2d": ("tab:blue", "s"), "torus_2d_bidirectional": ("tab:green", "^")}
    for alg in torus.ALGORITHMS:
        color, marker = styles[alg]
        ax.plot(pod["chips"], [s * 1e3 for s in pod["seconds"][alg]], marker=marker, color=color, label=alg)
        ax.plot(full["chips"], [s * 1e3 for s in full["seconds"][alg]], linestyle="--", linewidth=1,
                color=color, alpha=0.6)
    ax.plot([], [], linestyle="--", linewidth=1, color="gray", label="same, every slice a full torus")
    if mark in pod["slices"]:
        ax.axvline(pod["chips"][pod["slices"].index(mark)], color="gray", linestyle=":", linewidth=1)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(pod["chips"])
    ax.set_xticklabels([f"{c}\n{n}" for c, n in zip(pod["chips"], pod["slices"])], fontsize=8)
    ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    ax.yaxis.set_minor_locator(LogLocator(base=10, subs=(1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0)))
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax.yaxis.set_minor_formatter(FuncFormatter(lambda v, _: ""))
    ax.set_xlabel(f"TPU {generation} chips (slice)")
    ax.set_ylabel("predicted gradient summation (ms)")
    ax.set_title(f"Predicted gradient summation per step, {label}, TPU {generation}")
    ax.grid(True, which="major", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


# --------------------------------------------------------------------------- calibration


def pack_sizes(tensor_bytes, pack_bytes=torus.DEFAULT_PACK_BYTES):
    """Bytes of the buffers `torus.all_reduce_sum` fuses a list of same-dtype gradients into (its own rule)."""
    tensor_bytes = list(tensor_bytes)
    return [sum(tensor_bytes[p] for p in pack) for pack in torus.pack_indices(tensor_bytes, pack_bytes)]


def _padded(nbytes, itemsize, num_replicas, num_streams):
    quantum = num_replicas * num_streams
    length = nbytes // itemsize
    return -(-length // quantum) * quantum * itemsize


def _median_time(fn, repeats):
    fn()  # trace and warm up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return float(np.median(times)), float(min(times)), float(max(times))


def calibrate(sizes=(2 ** 12, 2 ** 18, 2 ** 21, 2 ** 23), repeats=5, model="resnet50", log=print):
    """Fits alpha and bandwidth on this machine's 8 CPU replicas and checks the fit against a real summation.

    Times `collectives.group_sum` (float32) in one `strategy.run` call: over groups of 2, 4 and 8 replicas of a
    `(2, 4)` mesh at several sizes, and 1 or 8 small sums in a row. Fits
    `T = call + collectives * (launch + alpha * steps) + ring_bytes / bandwidth` by non-negative least squares.
    Then sums the model's real gradient shapes with `torus.all_reduce_sum` (each algorithm) and with one native
    `group_sum` per tensor, and reports predicted over measured time (ratio < 1: the model is optimistic).

    Must run before TensorFlow starts anything else in the process (it creates the 8 logical CPUs).

    Returns:
      dict with the fitted figures, the fit points and, per method, predicted and measured seconds and ratio.
    """
    from tpu_scale.strategy import create_strategy

    strategy = create_strategy(num_cpu_replicas=8, mesh_shape=(2, 4), gradient_reduction="native")
    import tensorflow as tf

    from tpu_scale import collectives

    mesh = strategy.mesh
    n = mesh.num_replicas

    def timed(step_fn, shapes):
        values = strategy.experimental_distribute_values_from_function(
            lambda ctx: [tf.fill(s, tf.cast(ctx.replica_id_in_sync_group + 1, tf.float32)) for s in shapes])

        @tf.function
        def run(v):
            out = tf.nest.flatten(strategy.run(step_fn, args=(v,)))
            return strategy.experimental_local_results(out[0])[0][:1]

        return _median_time(lambda: run(values).numpy(), repeats)

    def fit_point(groups, size, count):
        g = groups.shape[1]
        elements = size // 4

        def step(v):
            x = v[0]
            for _ in range(count):
                x = collectives.group_sum(x, groups) * 0.5
            return [x]

        med, lo, hi = timed(step, [[elements]])
        log(f"  fit point: {count} sum(s) over groups of {g}, {_fmt_bytes(size)}: {_fmt_seconds(med)} "
            f"(min {_fmt_seconds(lo)}, max {_fmt_seconds(hi)})")
        return {"group_size": g, "bytes": size, "collectives": count, "steps": 2 * (g - 1),
                "ring_bytes": 2 * (g - 1) / g * size, "seconds": med, "min": lo, "max": hi}

    everyone = np.arange(n).reshape(1, n)
    points = [fit_point(everyone, sizes[0], count) for count in (1, 8)]
    for size in sizes:
        for groups in (mesh.column_groups(), mesh.row_groups(), everyone):
            points.append(fit_point(groups, size, 1))
    a = np.array([[1.0, p["collectives"], p["collectives"] * p["steps"], p["collectives"] * p["ring_bytes"]]
                  for p in points])
    t = np.array([p["seconds"] for p in points])
    coef = _nonnegative_lstsq(a, t)
    call, launch, alpha, beta = (float(c) for c in coef)
    bandwidth = 1.0 / beta if beta > 0 else math.inf
    residual = a @ coef - t
    fit = {"call_seconds": call, "launch_seconds": launch, "alpha_seconds": alpha,
           "bandwidth_bytes_per_sec": bandwidth, "rms_relative_error": float(np.sqrt(np.mean((residual / t) ** 2)))}
    log(f"  fit: {_fmt_seconds(call)} per call, {_fmt_seconds(launch)} per collective, alpha "
        f"{_fmt_seconds(alpha)} per step, bandwidth {bandwidth / 1e9:.2f} GB/s per replica "
        f"(rms relative error {fit['rms_relative_error']:.0%})")

    # The model's real gradient: its trainable variables' shapes.
    shapes = _model_shapes(model)
    tensor_bytes = [int(np.prod(s)) * 4 for s in shapes]
    # Eight replicas share this machine's memory and cores: one resource for every phase.
    cluster = uniform_cluster(mesh, alpha, bandwidth, shared=True, name="8 CPU replicas (fitted)",
                              phase_overhead=launch)
    comparisons = {}

    def compare(label, predicted, step_fn):
        med, lo, hi = timed(step_fn, shapes)
        comparisons[label] = {"predicted_seconds": predicted, "measured_seconds": med, "measured_min": lo,
                              "measured_max": hi, "ratio": predicted / med}
        log(f"  {model} via {label}: predicted {_fmt_seconds(predicted)}, measured {_fmt_seconds(med)} "
            f"(min {_fmt_seconds(lo)}, max {_fmt_seconds(hi)}), predicted/measured {predicted / med:.2f}")

    for alg in torus.ALGORITHMS:
        streams = len(torus.build_schedule(mesh, 0, alg).streams)
        predicted = call + sum(
            price_schedule(torus.build_schedule(mesh, _padded(pack, 4, n, streams), alg), cluster)["seconds"]
            for pack in pack_sizes(tensor_bytes))
        compare(f"torus.all_reduce_sum/{alg}", predicted, lambda v, alg=alg: torus.all_reduce_sum(v, algorithm=alg))
    # One native group sum per tensor: each a ring all-reduce over everyone, one after another.
    predicted = call + sum(price_schedule(torus.build_schedule(mesh, b, "ring"), cluster)["seconds"]
                           for b in tensor_bytes)
    compare("group_sum per tensor", predicted, lambda v: [collectives.group_sum(x, everyone) for x in v])
    return {
        "machine": "8 virtual CPU replicas (mesh 2x4) on this host, float32",
        "model": model,
        "gradient_bytes": int(sum(tensor_bytes)),
        "num_tensors": len(shapes),
        "repeats": repeats,
        "fit": fit,
        "points": points,
        "comparisons": comparisons,
    }


def _nonnegative_lstsq(a, t):
    """Least squares with every coefficient >= 0 (drops negative ones and refits)."""
    keep = list(range(a.shape[1]))
    while True:
        coef = np.zeros(a.shape[1])
        sol, *_ = np.linalg.lstsq(a[:, keep], t, rcond=None)
        coef[keep] = sol
        negative = [i for i in keep if coef[i] < 0]
        if not negative:
            return coef
        keep.remove(min(negative, key=lambda i: coef[i]))


def _model_shapes(model):
    """Trainable variable shapes of a known Keras model, or one flat tensor of `MODELS[model]` parameters."""
    builders = {"resnet50": "ResNet50", "resnet101": "ResNet101", "resnet152": "ResNet152",
                "mobilenet_v2": "MobileNetV2", "efficientnet_b0": "EfficientNetB0"}
    if model not in MODELS:
        raise ValueError(f"Unknown model {model!r}; known models: {sorted(MODELS)}.")
    if model not in builders:
        return [[MODELS[model]]]
    import keras

    net = getattr(keras.applications, builders[model])(weights=None)
    shapes = [list(v.shape) for v in net.trainable_variables]
    del net
    keras.backend.clear_session()
    return shapes


# --------------------------------------------------------------------------- CLI


def _parser():
    p = argparse.ArgumentParser(
        prog="python -m tpu_scale.plan",
        description="Predict gradient-summation time, input rate and BN group size for a TPU slice or GPU cluster.",
    )
    hw = p.add_argument_group("hardware (one of --slice, or --hosts with --gpus_per_host)")
    hw.add_argument("--slice", help=f"TPU slice, one of: {', '.join(slice_names())}")
    hw.add_argument("--hosts", type=int, help="GPU hosts")
    hw.add_argument("--gpus_per_host", type=int, help="GPUs per host")
    hw.add_argument("--gpu", default="a100", help=f"GPU type, one of {sorted(GPU_TYPES)} (default a100)")
    hw.add_argument("--alpha_us", type=float, help="per-step latency between nodes, microseconds")
    hw.add_argument("--wraparound", default="pod", choices=WRAPAROUND,
                    help="TPU: 'pod' (only full-pod dimensions wrap: the default assumption) or 'all'")
    g = p.add_argument_group("gradient")
    g.add_argument("--model", help=f"one of {sorted(MODELS)} (default resnet50)")
    g.add_argument("--params", type=int, help="parameter count instead of --model")
    g.add_argument("--dtype", default="float32", help=f"one of {sorted(DTYPE_BYTES)} (default float32)")
    p.add_argument("--per_core_batch", type=int, help="examples per replica: suggests a BN group size")
    p.add_argument("--target_images_per_sec", type=float, help="job target, for the per-host input rate")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.add_argument("--plot", metavar="PNG", help="draw predicted time against chip count to this file")
    p.add_argument("--calibrate", action="store_true",
                   help="fit alpha/beta on this machine's 8 CPU replicas and compare predicted with measured")
    p.add_argument("--repeats", type=int, default=5, help="timing repeats for --calibrate")
    p.add_argument("--quick", action="store_true", help="--calibrate with fewer sizes and 3 repeats")
    p.add_argument("--output", metavar="JSON", help="also write the JSON result (plan or calibration) here")
    return p


def _cluster_from_args(args):
    if args.slice and (args.hosts or args.gpus_per_host):
        raise ValueError("Give either --slice (TPU) or --hosts/--gpus_per_host (GPU), not both.")
    if args.slice:
        return tpu_slice(args.slice, args.alpha_us, args.wraparound)
    if args.hosts or args.gpus_per_host:
        if not (args.hosts and args.gpus_per_host):
            raise ValueError(
                "A GPU cluster needs both --hosts and --gpus_per_host (e.g. --hosts 32 --gpus_per_host 8).")
        return gpu_cluster(args.hosts, args.gpus_per_host, args.gpu, args.alpha_us)
    return tpu_slice("v3-2048", args.alpha_us, args.wraparound)


def main(argv=None):
    args = _parser().parse_args(argv)
    try:
        if args.calibrate:
            sizes = (2 ** 12, 2 ** 20, 2 ** 23) if args.quick else (2 ** 12, 2 ** 18, 2 ** 21, 2 ** 23)
            result = calibrate(sizes, repeats=3 if args.quick else args.repeats, model=args.model or "resnet50",
                               log=(lambda *a: None) if args.json else print)
            if args.json:
                print(json.dumps(result, indent=2))
        else:
            cluster = _cluster_from_args(args)
            result = plan(cluster, args.model, args.params, args.dtype, args.per_core_batch,
                          args.target_images_per_sec)
            if args.plot:
                generation = args.slice.split("-")[0] if args.slice else "v3"
                label = f"{result['model']['name']} {args.dtype}"
                result["plot"] = plot_scaling(args.plot, generation, result["model"]["bytes"], label,
                                              args.alpha_us, mark=cluster.name)
            print(json.dumps(result, indent=2) if args.json else format_plan(result))
            if args.plot and not args.json:
                print(f"\nplot: {args.plot}")
        if args.output:
            with open(args.output, "w") as f:
                json.dump(result, f, indent=2)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
