"""The TensorFlow seam: the one module that imports TensorFlow's private API (`tensorflow.python`).

Every other module takes these names from here. `check_tensorflow()` runs in `create_strategy()`
and fails there, naming the missing name, the supported range and the fix, when this TensorFlow
lacks one: never an `AttributeError` deep inside `fit`. Where TensorFlow publishes a way to do the
same thing, the package uses it instead (`tf.device`, `tf.init_scope`,
`tf.compat.v1.get_default_graph`, the collective and TPU ops of `tf.raw_ops`,
`tf.distribute.cluster_resolver.SlurmClusterResolver`).

Every private name (TensorFlow versions seen on: 2.21.0, 2.23.0.dev20261026):

  name (tensorflow.python. ...)          what, and where                  why no public way
  distribute.device_util                 the device the replica's ops     `tf.distribute` gives a
    .canonicalize, .current              are placed on: the collective    replica its id, not its
                                         launch's device; the in-graph    device; nothing public
                                         sums' CPU test (collectives)     reads the current device
  distribute.values                      a merge call's per-replica       public values are built
    .PerReplica, .Mirrored               results (collectives), the       from a function of the
                                         sharded update's outputs         replica id, not from
                                         (sharded_update), the sums       tensors already built
                                         `TorusAllReduce` returns (torus)
  ops.resource_variable_ops              the ordering token of a device   `tf.Variable` goes
    .ResourceVariable                    (collective_launch)              through the strategy's
                                                                          and Keras's creators
  eager.context                          the coordination service: the    no public API for the
    .context, .Context.wait_at_barrier,  sharded save's barrier           service's barrier and
    .Context.get_config_key_value,       (weight_update), the             key-value store
    .Context.set_config_key_value        preemption notice (checkpointing
                                         .preemption)
  data.ops.multi_device_iterator_ops     the per-replica datasets of      built inside the
    ._create_device_dataset              `distribute_datasets_from_       distributed iterator:
                                         function`, untuned               no option reaches them
                                         (_workarounds)
  distribute.collective_all_reduce_strategy
    .CollectiveAllReduceExtended,        MultiWorkerMirroredStrategy's    the strategy has no
    its ._initialize_local_devices       extended, with several local     argument for local CPU
                                         CPUs (_workarounds)              devices
    its ._cross_device_ops (set, on      `TorusAllReduce` in place on     nor one for cross-device
    the package's own extended)          several workers (strategy)       ops
  distribute.cross_device_ops           `TorusAllReduce` hands gathers,  TensorFlow's strategies
    .CrossDeviceOps._gather_implementation, XLA's no-merge-call sums and   call these on their
    .CollectiveAllReduce._all_reduce,    the workers' count to its        cross-device ops; the
    .CollectiveAllReduce                 fallback, TensorFlow's own ops   package calls them on
      ._num_between_graph_workers        (torus)                          TensorFlow's own object
  autograph.core.ag_ctx                  the caller's AutoGraph status    `tf.autograph` has no
    .control_status_ctx                  in `strategy.run` (strategy)     public status accessor
  autograph.impl.api                     converts the replica function    nor a public
    .tf_convert                          as the caller's status says,     `tf_convert`
                                         as TensorFlow's own `run` does
                                         (strategy)
  ops.control_flow_util                  whether a step is compiled with  no public test for an
    .GraphOrParentsInXlaContext          XLA (keras_hook)                 XLA context

A module of TensorFlow's that cannot be imported is None here, and reported by the check as its
names are. The names of `OBJECT_ONLY`'s modules are called on TensorFlow's own objects, never
imported from here; the check still tells when this TensorFlow lacks one.
"""

import importlib

import tensorflow as tf

# The TensorFlow releases the package is tested on (CI: the current release and tf-nightly).
TESTED_TENSORFLOW = ("2.21.0", "2.23.0.dev20261026")
SUPPORTED_TENSORFLOW = ">=2.21,<2.24"

# The seam's name of each TensorFlow module -> that module.
MODULES = {
    "device_util": "tensorflow.python.distribute.device_util",
    "distribute_values": "tensorflow.python.distribute.values",
    "resource_variable_ops": "tensorflow.python.ops.resource_variable_ops",
    "eager_context": "tensorflow.python.eager.context",
    "multi_device_iterator_ops": "tensorflow.python.data.ops.multi_device_iterator_ops",
    "collective_all_reduce_strategy": "tensorflow.python.distribute.collective_all_reduce_strategy",
    "cross_device_ops": "tensorflow.python.distribute.cross_device_ops",
    "ag_ctx": "tensorflow.python.autograph.core.ag_ctx",
    "autograph_api": "tensorflow.python.autograph.impl.api",
    "control_flow_util": "tensorflow.python.ops.control_flow_util",
}

# Modules whose names the package only calls on TensorFlow's own objects (no import from here).
OBJECT_ONLY = ("cross_device_ops",)

# What the package uses of each module: (the seam's module name, the dotted name in it).
NAMES = (
    ("device_util", "canonicalize"),
    ("device_util", "current"),
    ("distribute_values", "PerReplica"),
    ("distribute_values", "Mirrored"),
    ("resource_variable_ops", "ResourceVariable"),
    ("eager_context", "context"),
    ("eager_context", "Context.wait_at_barrier"),
    ("eager_context", "Context.get_config_key_value"),
    ("eager_context", "Context.set_config_key_value"),
    ("multi_device_iterator_ops", "_create_device_dataset"),
    ("collective_all_reduce_strategy", "CollectiveAllReduceExtended"),
    ("collective_all_reduce_strategy", "CollectiveAllReduceExtended._initialize_local_devices"),
    ("cross_device_ops", "CrossDeviceOps._gather_implementation"),
    ("cross_device_ops", "CollectiveAllReduce._all_reduce"),
    ("cross_device_ops", "CollectiveAllReduce._num_between_graph_workers"),
    ("ag_ctx", "control_status_ctx"),
    ("autograph_api", "tf_convert"),
    ("control_flow_util", "GraphOrParentsInXlaContext"),
)


def _load(path):
    try:
        return importlib.import_module(path)
    except ImportError:
        return None


device_util = _load(MODULES["device_util"])
distribute_values = _load(MODULES["distribute_values"])
resource_variable_ops = _load(MODULES["resource_variable_ops"])
eager_context = _load(MODULES["eager_context"])
multi_device_iterator_ops = _load(MODULES["multi_device_iterator_ops"])
collective_all_reduce_strategy = _load(MODULES["collective_all_reduce_strategy"])
cross_device_ops = _load(MODULES["cross_device_ops"])
ag_ctx = _load(MODULES["ag_ctx"])
autograph_api = _load(MODULES["autograph_api"])
control_flow_util = _load(MODULES["control_flow_util"])


def missing_names():
    """The private names (full dotted names) this TensorFlow lacks, in the table's order."""
    missing = []
    for module, name in NAMES:
        found = globals().get(module)
        for part in name.split("."):
            found = getattr(found, part, None)
        if found is None:
            missing.append(f"{MODULES[module]}.{name}")
    return missing


def check_tensorflow():
    """Checks, at start-up, that this TensorFlow has every private name the package uses.

    Raises:
      ImportError: naming the missing names, the supported range, the tested versions and the fix.
    """
    missing = missing_names()
    if missing:
        raise ImportError(f"tpu_scale cannot train with TensorFlow {tf.__version__}: {', '.join(missing)} not found (TensorFlow's private API, which the package uses where TensorFlow has no public way; see tpu_scale.tf_seam). The package supports tensorflow{SUPPORTED_TENSORFLOW} (tested with {', '.join(TESTED_TENSORFLOW)}): pip install 'tensorflow{SUPPORTED_TENSORFLOW}'.")
