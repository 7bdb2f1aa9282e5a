"""The pod-scale planner: what a slice, a batch and a BN span cost before the money is spent.

An alpha-beta cost model prices the gradient-summation schedules of `tpu_scale.torus.all_reduce` (the same
`Schedule` objects the executor runs): the 1-D ring, the 2-D torus (reduce-scatter along rows,
all-reduce of the shard along columns, all-gather along rows) and the paper's bidirectional 2-D
form, for TPU slices by name and for GPU clusters, and `choose_algorithm` decides what `"auto"` runs
(see `tpu_scale.plan.choice`). It also says how many images per second each host must feed and which
BN group size gives a span of 64-128 examples, and what the optimizer update costs per step with
every replica updating every weight and with the update sharded (`weight_update_sharding=True`):
its time, its share of the step, the predicted step-time gain and the optimizer state per replica
(`tpu_scale.plan.update`).

    python -m tpu_scale.plan --slice v3-2048 --model resnet50 --per_core_batch 16
    python -m tpu_scale.plan --hosts 32 --gpus_per_host 8 --gpu a100 --json
    python -m tpu_scale.plan --slice v3-2048 --plot scaling.png
    python -m tpu_scale.plan --calibrate          # fits alpha/beta on this machine's 8 CPU replicas

The model, in brief (details in `price_schedule`):

* A *node* is what the remote links connect: a TPU chip, or a GPU host. Its replicas (the cores of a
  chip, the GPUs of a host) are joined by *local* links (on-chip paths, NVLink).
* On a TPU, a phase over a group spanning `k` chips with `m` replicas on each is priced as a
  two-level ring: the `m` cores combine over the on-chip path (`m - 1` steps each way), the chips
  form a ring over the inter-chip links (`k - 1` steps for a reduce-scatter or all-gather, `2 (k -
  1)` for an all-reduce). That is how a chip's cores join the chip's place in the ring, so step
  counts are in chips, as in the paper (124 vs 2046 on 32x32). On GPUs a group is one flat ring
  through all its GPUs, as NCCL runs it: `2 (H - 1)` of its steps cross hosts, the rest stay on
  NVLink.
* Each step costs its link's `alpha`; bytes cost `bytes / bandwidth`, where a chip's bandwidth on a
  torus ring counts both directions (the ring's data is split in two halves sent opposite ways) and
  a line without wrap-around counts one.
* Streams of a schedule run at the same time: phases that use the same links share their bandwidth
  (an event simulation with fair sharing), phases on different links do not. So the bidirectional
  form, whose two halves run on the rows' and the columns' links at once, gets the bandwidth of both
  dimensions.

Every hardware figure is listed with its source, or labelled as an assumption, in `TPU_GENERATIONS`
and `GPU_TYPES`; a `Hardware`'s `sources` lists the ones it uses, and the plan prints them.

The parts: `catalog` (models, hardware figures, `Hardware` builders), `cost` (the pricing),
`sizing` (input rate, BN groups), `update` (the weight update), `report` (the plan and its table),
`cli`; `plot` (matplotlib) and `calibration` (TensorFlow) are imported only when used, so `import
tpu_scale.plan` needs neither.

Reference:
  Ying et al., "Image Classification at Supercomputer Scale", 2018 (arXiv:1811.06992), section 3.3.
"""

from tpu_scale import _lazy
from tpu_scale.plan.catalog import (
    CPU_FIGURES,
    DTYPE_BYTES,
    GPU_TYPES,
    MODELS,
    TPU_GENERATIONS,
    WRAPAROUND,
    Hardware,
    Link,
    cpu_cluster,
    gpu_cluster,
    gradient_bytes,
    slice_names,
    tpu_slice,
    uniform_cluster,
)
from tpu_scale.plan.choice import Choice, choose_algorithm, hardware_cluster, price_option
from tpu_scale.plan.cli import main
from tpu_scale.plan.cost import pack_sizes, price_algorithms, price_schedule
from tpu_scale.plan.report import format_plan, plan, sharding_advice
from tpu_scale.plan.sizing import input_rate, suggest_bn_group
from tpu_scale.plan.update import UPDATE_BYTES_PER_PARAM, weight_update

# matplotlib and TensorFlow only when the plot or the calibration is asked for.
__getattr__ = _lazy.attributes(
    __name__,
    {
        "plot_scaling": "tpu_scale.plan.plot",
        "scaling_series": "tpu_scale.plan.plot",
        "calibrate": "tpu_scale.plan.calibration",
    },
)


__all__ = [
    "CPU_FIGURES",
    "Choice",
    "choose_algorithm",
    "cpu_cluster",
    "hardware_cluster",
    "price_option",
    "DTYPE_BYTES",
    "GPU_TYPES",
    "MODELS",
    "TPU_GENERATIONS",
    "WRAPAROUND",
    "Hardware",
    "Link",
    "calibrate",
    "format_plan",
    "gpu_cluster",
    "gradient_bytes",
    "input_rate",
    "main",
    "pack_sizes",
    "plan",
    "plot_scaling",
    "price_algorithms",
    "price_schedule",
    "scaling_series",
    "sharding_advice",
    "slice_names",
    "suggest_bn_group",
    "tpu_slice",
    "uniform_cluster",
    "UPDATE_BYTES_PER_PARAM",
    "weight_update",
]
