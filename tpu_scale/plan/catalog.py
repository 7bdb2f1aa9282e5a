"""The planner's catalog: model sizes, TPU and GPU hardware figures with their sources, `Hardware`
builders.

Every hardware figure is listed with its source, or labelled as an assumption, in `TPU_GENERATIONS`
and `GPU_TYPES`; a built `Hardware` carries the ones it uses in `sources`, which the plan prints.
"""

import dataclasses
import math

import numpy as np

from tpu_scale.distribute.mesh import ReplicaMesh

_GBIT = 1e9 / 8  # bytes/s in one Gbit/s
_US = 1e-6

# --------------------------------------------------------------------------- models and dtypes

# Trainable parameters (the gradient a step sums), counted from keras.applications (weights=None)
# unless noted.
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
            raise ValueError(
                f"Unknown model {model!r}; known models: {sorted(MODELS)} (or pass params=N)."
            )
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
class Hardware:
    """A machine to plan for: its replica mesh, how replicas sit on nodes, the links between them.

    Attributes:
      name: e.g. `"v3-2048"` or `"32x8 a100"`.
      kind: `"tpu"`, `"gpu"` or `"cpu"`.
      mesh: the `ReplicaMesh` the schedules are built on.
      replicas_per_node: replicas on one node (replica `(r, c)` on node `(r, c // it)`).
      node: what a node is: `"chip"` or `"host"` (or `"replica"`).
      links: remote `Link` for each phase dimension (`"rows"`, `"columns"`, `"all"`).
      local: the `Link` between replicas of one node (per replica).
      nodes_per_host: chips per host (1 when the node is the host).
      node_shape: the physical shape of the nodes (chips `(x, y[, z])`, or `(hosts,)`).
      images_per_sec_per_node: training throughput of one node, for the input-rate estimate.
      sources: the hardware figures and where they come from (or that they are assumptions).
      flat_rings: True when a group spanning several nodes runs one flat ring through all its
        replicas (NCCL on GPUs); False when a node's replicas combine first and the nodes form the
        ring (TPU chips).
      phase_overhead: seconds to launch one collective (one phase), on top of its steps; fitted on
        CPU replicas, where it dominates; 0 for the TPU and GPU figures, whose alpha covers it.
      host_memory: for CPU hosts, the `Link` of a host's shared memory (`alpha`: seconds of the
        host's cores per hand-off of a value between two of its CPU devices; `bandwidth`: bytes/s
        of memory traffic): a phase whose groups sit on one host is then priced as the plain ops
        the executor builds (`cost.in_graph_load`). None: every phase is a collective (TPU, GPU).
      replicas_per_host: replicas on one host, for `host_memory` (the mesh's rows are hosts).
      memory_bandwidth: bytes/s of memory one replica's optimizer update runs at (its share of
        its chip's or host's memory); 0 when unknown (the plan then prices no weight update).
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
    host_memory: Link = None
    replicas_per_host: int = 0
    memory_bandwidth: float = 0.0

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

    @property
    def replicas_on_host(self):  # replicas on one host
        return self.replicas_per_host or self.replicas_per_node * self.nodes_per_host

    def host_ids(self):
        """int `[num_replicas]`: the host each replica sits on."""
        return np.arange(self.num_replicas) // self.replicas_on_host

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
    bandwidth = (
        link.bandwidth if math.isfinite(link.bandwidth) else None
    )  # strict JSON has no Infinity
    return {"name": link.name, "alpha_seconds": link.alpha, "bandwidth_bytes_per_sec": bandwidth}


# TPU generations. Link bandwidth is per direction of one inter-chip link; the v3 and v4 figures
# check against the documented pod all-reduce bandwidth: 1024 chips x 4 links x 82 GB/s = 336 TB/s
# (~340 TB/s), 1.1 PB/s / (4096 chips x 6 links) = 45 GB/s.
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
        "hbm_bandwidth": 700e9,
        "shapes": {8: (2, 2), 32: (4, 4), 128: (8, 8), 256: (16, 8), 512: (16, 16)},
        "sources": (
            "TPU v2: 4 inter-chip links per chip at 496 Gbit/s each way (Jouppi et al. 2020, CACM, "
            "'A Domain-Specific Supercomputer for Training Deep Neural Networks'); 256-chip pod "
            "as a 16x16 2-D torus; 2 cores and 700 GB/s HBM per chip (same source).",
            "TPU v2 slice shapes (8->2x2, 32->4x4, 128->8x8, 256->16x8, 512->16x16 chips): "
            "assumption, by the v3 pattern of the notes.",
            "TPU v2 input rate 1025 img/s x 45/123 TFLOPS = ~375 img/s per chip: assumption (v3 "
            "paper rate scaled by peak bf16 FLOPs).",
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
        "hbm_bandwidth": 900e9,
        "shapes": {
            8: (2, 2),
            32: (4, 4),
            64: (8, 4),
            128: (8, 8),
            256: (16, 8),
            512: (16, 16),
            1024: (32, 16),
            2048: (32, 32),
        },
        "sources": (
            "TPU v3: 4 inter-chip links per chip at ~656 Gbit/s each way; 1024-chip pod as a "
            "32x32 2-D torus; pod all-reduce bandwidth documented as 340 TB/s (Jouppi et al. "
            "2020; project notes).",
            "TPU v3 slice shapes: 8->2x2, 32->4x4, 128->8x8, 256->16x8, 512->16x16, 1024->32x16, "
            "2048->32x32 chips (project notes); 64->8x4 is an assumption by the same pattern.",
            "TPU v3: ~1,025 img/s per chip, 4 chips per host for ResNet-50 (Ying et al. 2018).",
            "TPU v3 on-chip core-to-core path priced at half the chip's 900 GB/s HBM: assumption.",
            "TPU v3: 900 GB/s HBM per chip, 2 cores (Jouppi et al. 2020, CACM); each core's "
            "optimizer update at half of it.",
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
        "hbm_bandwidth": 1200e9,
        "shapes": {
            8: (2, 2, 1),
            16: (2, 2, 2),
            32: (2, 2, 4),
            64: (2, 4, 4),
            128: (4, 4, 4),
            256: (4, 4, 8),
            512: (4, 8, 8),
            1024: (8, 8, 8),
            2048: (8, 8, 16),
            4096: (8, 16, 16),
            8192: (16, 16, 16),
        },
        "sources": (
            "TPU v4: 4096-chip pod, 3-D mesh/torus, 6 links per chip, all-reduce bandwidth 1.1 "
            "PB/s per pod (Cloud TPU v4 documentation); per link 1.1 PB/s / (4096 x 6) = 45 GB/s "
            "each way, derived.",
            "TPU v4: one replica per chip (megacore); the 3-D shape is folded to a 2-D mesh of "
            "rows = y*z, cols = x, as ReplicaMesh.from_topology does; a dimension wraps when it "
            "is a multiple of 4: assumption from the documented torus shapes.",
            "TPU v4 slice shapes (v4-8 -> 2x2x1 ... v4-8192 -> 16x16x16 chips): default "
            "topologies, assumption.",
            "TPU v4 input rate 1025 img/s x 275/123 TFLOPS = ~2,290 img/s per chip: assumption.",
            "TPU v4: 1,200 GB/s HBM per chip (Jouppi et al. 2023, ISCA, 'TPU v4: An Optically "
            "Reconfigurable Supercomputer ...'), all of it for the chip's one replica.",
        ),
    },
}

_TORUS_ASSUMPTION = (
    "Sub-pod TPU v2/v3 slices: only a dimension spanning the whole pod has wrap-around links; a "
    "shorter dimension is a line, whose ring gets one direction's bandwidth: assumption."
)
_ALPHA_ASSUMPTION = (
    "Per-step latency (alpha) of 1 us per inter-chip step and 0.5 us per on-chip step: assumption "
    "(order of magnitude of a hop plus synchronisation); override with alpha_us."
)

# GPU clusters: NVLink per GPU per direction; network per host, all NICs together.
GPU_TYPES = {
    "v100": {
        "nvlink_bandwidth": 150e9,
        "network_bandwidth": 4 * 100 * _GBIT,
        "images_per_sec": 1200.0,
        "hbm_bandwidth": 900e9,
        "source": "V100 SXM2: NVLink 300 GB/s (150 GB/s each way), 900 GB/s HBM2;"
        " DGX-1: 4x 100 Gbit/s EDR InfiniBand per host (NVIDIA datasheets).",
    },
    "a100": {
        "nvlink_bandwidth": 300e9,
        "network_bandwidth": 8 * 200 * _GBIT,
        "images_per_sec": 2500.0,
        "hbm_bandwidth": 1555e9,
        "source": "A100 SXM4: NVLink 600 GB/s (300 GB/s each way), 1,555 GB/s HBM2;"
        " DGX A100: 8x 200 Gbit/s HDR InfiniBand per host (NVIDIA datasheets).",
    },
    "h100": {
        "nvlink_bandwidth": 450e9,
        "network_bandwidth": 8 * 400 * _GBIT,
        "images_per_sec": 5000.0,
        "hbm_bandwidth": 3350e9,
        "source": "H100 SXM5: NVLink 900 GB/s (450 GB/s each way), 3.35 TB/s HBM3;"
        " DGX H100: 8x 400 Gbit/s NDR InfiniBand per host (NVIDIA datasheets).",
    },
}
_GPU_ASSUMPTIONS = (
    "GPU per-step latency: 2 us over NVLink, 5 us over the network: assumption (order of NCCL "
    "step latency).",
    "GPU ResNet-50 training rate per GPU (v100 1,200, a100 2,500, h100 5,000 img/s): rough "
    "assumption; pass "
    "target_images_per_sec for a real target.",
    "A GPU group spanning several hosts is priced as one flat ring through all its GPUs (as NCCL "
    "runs it): "
    "of its 2(N-1) steps 2(H-1) cross hosts and the rest stay on NVLink; each host sends 2(N-1)/N "
    "of the "
    "gradient on the network.",
)


def slice_names(generation=None):
    """Every known TPU slice name, e.g. `["v2-8", ..., "v3-2048", ...]`."""
    gens = [generation] if generation else list(TPU_GENERATIONS)
    return [f"{g}-{cores}" for g in gens for cores in TPU_GENERATIONS[g]["shapes"]]


def _parse_slice(name):
    if not isinstance(name, str) or "-" not in name:
        raise ValueError(
            f"Bad TPU slice name {name!r}: expected '<generation>-<cores>', one of {slice_names()}."
        )
    generation, _, cores = name.partition("-")
    if generation not in TPU_GENERATIONS:
        raise ValueError(f"Unknown TPU generation {generation!r} in slice {name!r}; known generations: {sorted(TPU_GENERATIONS)}. Valid slices: {slice_names()}.")
    shapes = TPU_GENERATIONS[generation]["shapes"]
    if not cores.isdigit() or int(cores) not in shapes:
        raise ValueError(f"Unknown {generation} slice {name!r} (the number is TensorCores); valid: {slice_names(generation)}.")
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
    """Link directions a ring over a (folded) block of chips drives: 2 on a cycle, 1 on a line."""
    extents = [e for e in extents if e > 1]
    if not extents:
        return 1
    if len(extents) == 1:
        return 2 if wraps[0] else 1
    # A grid of at least two dimensions has a Hamiltonian cycle when it has an even number of chips
    # or wraps.
    return 2 if (math.prod(extents) % 2 == 0 or any(wraps)) else 1


def tpu_slice(name, alpha_us=None, wraparound="pod"):
    """The `Hardware` of a TPU slice, e.g. `tpu_slice("v3-2048")`.

    The mesh is rows x (cols * cores), as `ReplicaMesh.from_topology` builds it: rows follow the
    torus's second dimension (folded with the third on v4), columns the first dimension times the
    cores of a chip.

    Args:
      name: `"<generation>-<cores>"`, one of `slice_names()`.
      alpha_us: per-step latency of an inter-chip step in microseconds, instead of the default
        assumption.
      wraparound: `"pod"` (the assumption: on v2/v3 only a dimension spanning the whole pod wraps,
        on v4 a multiple of 4) or `"all"` (every dimension is a torus ring), to see what the
        assumption is worth.

    Returns:
      A `Hardware`.
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
        "all": Link(
            "ici_ring", alpha, _ring_directions(list(shape), [wrap_x] + wrap_rest) * bandwidth
        ),
    }
    local = Link("on_chip", spec["onchip_alpha"], spec["onchip_bandwidth"])
    torus_note = (
        _TORUS_ASSUMPTION if wraparound == "pod" else "Every slice dimension taken as a torus ring."
    )
    sources = spec["sources"] + (torus_note, _ALPHA_ASSUMPTION)
    return Hardware(
        name,
        "tpu",
        mesh,
        per_chip,
        "chip",
        links,
        local,
        spec["chips_per_host"],
        tuple(shape),
        spec["images_per_sec_per_chip"],
        sources,
        memory_bandwidth=spec["hbm_bandwidth"] / per_chip,
    )


def gpu_cluster(hosts, gpus_per_host, gpu="a100", alpha_us=None):
    """The `Hardware` of `hosts` GPU hosts with `gpus_per_host` GPUs each (mesh rows = hosts).

    Args:
      hosts: number of hosts.
      gpus_per_host: GPUs per host, joined by NVLink.
      gpu: one of `GPU_TYPES`.
      alpha_us: per-step latency over the network in microseconds, instead of the default
        assumption.

    Returns:
      A `Hardware`.
    """
    for label, value in (("hosts", hosts), ("gpus_per_host", gpus_per_host)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
            raise ValueError(f"{label} must be a positive integer, got {value!r}.")
    if gpu not in GPU_TYPES:
        raise ValueError(f"Unknown GPU type {gpu!r}; choose one of {sorted(GPU_TYPES)}.")
    spec = GPU_TYPES[gpu]
    mesh = ReplicaMesh.for_workers(int(hosts), int(gpus_per_host))
    alpha = 5 * _US if alpha_us is None else _checked_alpha(alpha_us)
    # Rows are hosts and columns a host's GPUs, so a row group never leaves its host; every group
    # that does crosses the same NICs, hence one shared "network" resource.
    network = Link("network", alpha, spec["network_bandwidth"])
    links = {"rows": network, "columns": network, "all": network}
    local = Link("nvlink", 2 * _US, spec["nvlink_bandwidth"])
    return Hardware(
        f"{hosts}x{gpus_per_host} {gpu}",
        "gpu",
        mesh,
        int(gpus_per_host),
        "host",
        links,
        local,
        1,
        (int(hosts),),
        spec["images_per_sec"] * gpus_per_host,
        (spec["source"],) + _GPU_ASSUMPTIONS,
        flat_rings=True,
        memory_bandwidth=spec["hbm_bandwidth"],
    )


def uniform_cluster(
    mesh, alpha, bandwidth, shared=False, name="uniform", kind="cpu", phase_overhead=0.0
):
    """`Hardware` where every replica is its own node and every link costs the same.

    Args:
      mesh: a `ReplicaMesh`.
      alpha: seconds per step.
      bandwidth: bytes/s per replica around a ring.
      shared: True when all phases share one resource (CPU replicas on the same memory), False when
        rows and columns have their own links (an ideal torus).
      name: a label.
      kind: a label: `"cpu"`, or anything else.
      phase_overhead: seconds to launch each collective.

    Returns:
      A `Hardware`.
    """
    names = ("shared",) * 3 if shared else ("rows", "columns", "all")
    links = {dim: Link(n, alpha, bandwidth) for dim, n in zip(("rows", "columns", "all"), names)}
    return Hardware(
        name,
        kind,
        mesh,
        1,
        "replica",
        links,
        Link("local", 0.0, math.inf),
        1,
        mesh.shape,
        0.0,
        ("Uniform links: alpha and bandwidth given by the caller.",),
        phase_overhead=float(phase_overhead),
    )


# CPU hosts: the defaults `"auto"` prices CPU options with, fitted by `python -m tpu_scale.plan
# --calibrate` (8 virtual CPU replicas, BFC allocator; the run and its held-out check are in
# benchmarks/README.md, Planner); `tpu_scale.plan.calibrate` fits another machine's own. Loopback
# figures: `benchmarks/all_reduce.py`'s two-process part.
CPU_FIGURES = {
    "call_seconds": 0.00501,
    "collective_launch_seconds": 0.000647,
    "collective_alpha": 0.0,
    "collective_bandwidth": 616000000.0,
    "handoff_seconds": 1.36e-05,
    "memory_bandwidth": 14700000000.0,
    "network_alpha": 1.0e-3,
    "network_bandwidth": 0.35e9,
    "sources": (
        "CPU collective ops (per launch, bandwidth) and in-graph sums (per hand-off between CPU "
        "devices, memory bandwidth): fitted on the development machine by "
        "tpu_scale.plan.calibration (2-core VM, 8 virtual CPU replicas, TensorFlow's BFC CPU "
        "allocator); another machine needs its own calibration.",
        "CPU between worker processes: gRPC over loopback, fitted from benchmarks/all_reduce.py's "
        "two-process run on the same machine: assumption for real networks.",
    ),
}


def cpu_cluster(hosts, replicas_per_host, figures=None, mesh_shape=None):
    """The `Hardware` of `hosts` CPU hosts (or worker processes) with `replicas_per_host` replicas
    each.

    Phases inside a host are priced as the plain in-graph ops the executor builds there (memory
    traffic plus a per-op cost), collectives inside a host with the fitted collective figures, and
    phases between hosts on the network figures.

    Args:
      hosts: number of hosts (mesh rows).
      replicas_per_host: replicas per host (mesh columns).
      figures: a dict like `CPU_FIGURES` (the default) with this machine's own calibration.
      mesh_shape: one host's `(rows, cols)` (default `(1, replicas_per_host)`); several hosts are
        one row each.

    Returns:
      A `Hardware`.
    """
    f = dict(CPU_FIGURES, **(figures or {}))
    if hosts == 1:
        rows, cols = mesh_shape or (1, replicas_per_host)
        mesh = ReplicaMesh.from_shape(int(rows), int(cols))
    else:
        mesh = ReplicaMesh.for_workers(int(hosts), int(replicas_per_host))
    per_node = 1 if hosts == 1 else int(replicas_per_host)
    shared = Link("cpu_collective", f["collective_alpha"], f["collective_bandwidth"])
    if hosts > 1:
        network = Link("network", f["network_alpha"], f["network_bandwidth"])
        links = {"rows": shared, "columns": network, "all": network}
    else:
        links = {"rows": shared, "columns": shared, "all": shared}
    memory = Link("memory", f["handoff_seconds"], f["memory_bandwidth"])
    name = f"{hosts}x{replicas_per_host} cpu" if hosts > 1 else f"1 host, {mesh.shape} cpu mesh"
    return Hardware(
        name,
        "cpu",
        mesh,
        per_node,
        "host" if hosts > 1 else "replica",
        links,
        shared,
        1,
        (int(hosts),),
        0.0,
        tuple(f["sources"]),
        phase_overhead=f["collective_launch_seconds"],
        host_memory=memory,
        replicas_per_host=int(replicas_per_host),
        memory_bandwidth=f["memory_bandwidth"] / replicas_per_host,  # the host's, shared
    )


def _checked_alpha(alpha_us):
    if not isinstance(alpha_us, (int, float)) or alpha_us < 0 or not math.isfinite(alpha_us):
        raise ValueError(
            f"alpha_us must be a non-negative number of microseconds, got {alpha_us!r}."
        )
    return alpha_us * _US
