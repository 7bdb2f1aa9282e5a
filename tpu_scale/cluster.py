"""Where a run's cluster comes from: an argument, a TPU, `TF_CONFIG`, or a Slurm step.

`create_strategy()` asks `discover` which cluster this process belongs to, in this order:

1. an explicit `cluster_resolver=` (any `tf.distribute.cluster_resolver.ClusterResolver`; a
   `TPUClusterResolver` means a TPU);
2. a TPU: `tpu=` or `TPU_NAME`;
3. `TF_CONFIG` naming more than one worker (Kubeflow's TFJob, GKE, an indexed Kubernetes Job that
   sets it, `python -m tpu_scale.launch`): TensorFlow's `TFConfigClusterResolver`;
4. a Slurm job step of more than one task (`srun`): TensorFlow's `SlurmClusterResolver`, with the
   tasks per node, the GPUs per node (`SLURM_GPUS_ON_NODE`) and per task (`SLURM_GPUS_PER_TASK`)
   from Slurm, on GPU and on CPU-only nodes (`_workarounds.slurm_cluster_resolver`). Worker ports
   start at `TPU_SCALE_SLURM_PORT_BASE` (default 8888, TensorFlow's), one per task on a node.
   Task i (`SLURM_PROCID` i) is the i-th task of the step's node list taken node by node, as
   Slurm's default block distribution numbers them (`_workarounds.slurm_node_order`: TensorFlow
   sorts the hosts as strings); a task that Slurm placed otherwise (`--distribution=cyclic`, a
   `SLURM_HOSTFILE`) is an error naming its node and the fix;
5. otherwise this host alone.

A second source that also names a cluster (a TPU and `TF_CONFIG`, `TF_CONFIG` and a Slurm step of
several tasks) is an error naming both, and so is a half-set environment: a `TF_CONFIG` of several
workers without its own task, or with a task that is not in its cluster; a Slurm step missing one
of the variables its resolver reads; a Slurm job of several tasks (`SLURM_NTASKS`) whose script was
started without `srun`. The choice is logged by `create_strategy`.
"""

import dataclasses
import json
import os
from typing import Any, Optional

SLURM_PORT_BASE = "TPU_SCALE_SLURM_PORT_BASE"
DEFAULT_SLURM_PORT_BASE = 8888  # TensorFlow's
_SLURM_STEP = ("SLURM_PROCID", "SLURM_STEP_NODELIST", "SLURM_STEP_TASKS_PER_NODE")
_MULTI_WORKER_JOBS = ("chief", "worker")


@dataclasses.dataclass(frozen=True)
class Cluster:
    """The cluster this process belongs to.

    Attributes:
      source: `"cluster_resolver"`, `"tpu"`, `"TF_CONFIG"`, `"Slurm"` or `"local"`.
      num_workers: worker processes in the cluster (1 for this host alone or a TPU).
      description: what was found, for the log.
      tpu: the TPU name (`tpu` source without a resolver), else None.
      resolver: the cluster resolver to build the strategy with, else None.
    """

    source: str
    num_workers: int
    description: str
    tpu: Optional[str] = None
    resolver: Any = None

    @property
    def is_tpu(self):
        return self.source == "tpu"

    @property
    def is_multi_worker(self):
        return self.resolver is not None and not self.is_tpu


def tf_config_workers(text):
    """Checks a `TF_CONFIG` and counts the workers it names (its `worker` and `chief` tasks).

    Args:
      text: the `TF_CONFIG` JSON; empty for none.

    Returns:
      The number of workers; 0 for an empty `TF_CONFIG`.

    Raises:
      ValueError: it is not JSON, names no cluster for its task, uses parameter servers, or names
        several workers but no task of its own, or a task that is not in the cluster.
    """
    if not text:
        return 0
    try:
        config = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"TF_CONFIG is not valid JSON ({e}): {text!r}") from e
    if not isinstance(config, dict):
        raise ValueError(f'TF_CONFIG must be a JSON object with "cluster" and "task": {text!r}')
    cluster, task = config.get("cluster") or {}, config.get("task") or {}
    if "ps" in cluster:
        raise ValueError(
            'TF_CONFIG has "ps" tasks: parameter-server training is not what create_strategy builds; give every process a "worker" (or one "chief") task.'
        )
    workers = sum(len(cluster.get(job, [])) for job in _MULTI_WORKER_JOBS)
    if task and not cluster:
        raise ValueError(
            f'TF_CONFIG has a "task" but no "cluster": {text!r}. Name every worker\'s address, e.g. {{"cluster": {{"worker": ["host1:2222", "host2:2222"]}}, "task": {{"type": "worker", "index": 0}}}}.'
        )
    if workers > 1:
        kind, index = task.get("type"), task.get("index")
        if kind is None or index is None:
            raise ValueError(
                f'TF_CONFIG names {workers} workers but not this process\'s "task" (its "type" and "index"): {text!r}. Each worker needs its own, e.g. "task": {{"type": "worker", "index": 0}}.'
            )
        tasks = cluster.get(kind)
        if tasks is None or not isinstance(index, int) or not 0 <= index < len(tasks):
            raise ValueError(
                f"TF_CONFIG's task {kind}:{index} is not in its cluster {json.dumps(cluster)}: the index must be one of the {kind!r} tasks."
            )
    return workers


def _int_variable(environ, name):
    value = environ.get(name)
    try:
        return int(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name}={value!r} is not a whole number.") from None


def slurm_tasks(environ):
    """The number of tasks of the Slurm job step this process runs in, after checking the step.

    Args:
      environ: the environment.

    Returns:
      The step's task count; 0 outside Slurm, or in a job of one task that was not started with
      `srun`.

    Raises:
      ValueError: a step of several tasks misses a variable its resolver reads, or a job of several
        tasks runs this script outside `srun` (it would train on one host only).
    """
    if "SLURM_STEP_NUM_TASKS" not in environ:
        tasks = environ.get("SLURM_NTASKS")
        if tasks is not None and _int_variable(environ, "SLURM_NTASKS") > 1:
            raise ValueError(
                f"This runs in a Slurm job of SLURM_NTASKS={tasks} tasks but not in a job step (no SLURM_STEP_NUM_TASKS): the script was started without srun and would train on this host alone. Start it with `srun python SCRIPT ...` (one task per worker), or unset SLURM_NTASKS for a one-host run."
            )
        return 0
    tasks = _int_variable(environ, "SLURM_STEP_NUM_TASKS")
    if tasks > 1:
        missing = [name for name in _SLURM_STEP if not environ.get(name)]
        if missing:
            raise ValueError(
                f"A Slurm step of SLURM_STEP_NUM_TASKS={tasks} tasks without {', '.join(missing)}: start the script with srun, which sets them all, or unset SLURM_STEP_NUM_TASKS for a one-host run."
            )
        _int_variable(environ, "SLURM_PROCID")
    return tasks


def _slurm_gpus(environ):
    """GPUs per node and per task from Slurm's variables; None where Slurm does not say."""
    per_node = per_task = None
    if environ.get("SLURM_GPUS_ON_NODE"):
        per_node = _int_variable(environ, "SLURM_GPUS_ON_NODE")
    if environ.get("SLURM_GPUS_PER_TASK"):  # "2", or "a100:2" with a GPU type
        count = environ["SLURM_GPUS_PER_TASK"].rsplit(":", 1)[-1]
        per_task = _int_variable({"SLURM_GPUS_PER_TASK": count}, "SLURM_GPUS_PER_TASK")
    return per_node, per_task


def slurm_resolver(environ=None):
    """TensorFlow's `SlurmClusterResolver` for this step, working on CPU-only nodes too.

    Args:
      environ: the environment (default: this process's). The resolver itself reads
        `os.environ`.

    Returns:
      A `tf.distribute.cluster_resolver.SlurmClusterResolver`.
    """
    from tpu_scale import _workarounds

    environ = os.environ if environ is None else environ
    per_node, per_task = _slurm_gpus(environ)
    return _workarounds.slurm_cluster_resolver(
        port_base=_slurm_port_base(environ), gpus_per_node=per_node, gpus_per_task=per_task
    )


def _slurm_port_base(environ):
    if not environ.get(SLURM_PORT_BASE):
        return DEFAULT_SLURM_PORT_BASE
    return _int_variable(environ, SLURM_PORT_BASE)


def check_slurm_task(environ, address):
    """Checks that this Slurm task's address in the cluster is on its own node, at its own port.

    TensorFlow's resolver gives task `SLURM_PROCID` the address the default block distribution
    puts it at (the step's tasks numbered node by node). Slurm tells each task where it really
    runs: its node (`SLURMD_NODENAME`) and its index among the node's tasks (`SLURM_LOCALID`,
    port base + that index). Where either is unset there is nothing to compare.

    Args:
      environ: the task's environment.
      address: `"host:port"`, the task's address in the resolved cluster.

    Raises:
      ValueError: the address is another task's; the message names the node and the fix.
    """
    host, port = address.rsplit(":", 1)
    node, local = environ.get("SLURMD_NODENAME"), environ.get("SLURM_LOCALID")
    runs_on = None
    if node and node != host:
        runs_on = node
    elif local and int(port) != _slurm_port_base(environ) + _int_variable(environ, "SLURM_LOCALID"):
        runs_on = f"{host} as its task {local} there"
    if runs_on:
        raise ValueError(
            f"Slurm task SLURM_PROCID={environ.get('SLURM_PROCID')} runs on {runs_on}, but the step's node list {environ.get('SLURM_STEP_NODELIST')} with {environ.get('SLURM_STEP_TASKS_PER_NODE')} tasks per node puts it at {address}: the cluster needs Slurm's default block distribution (tasks numbered node by node). Start srun with --distribution=block (no cyclic or arbitrary distribution, no SLURM_HOSTFILE)."
        )


def _is_tpu_resolver(resolver):
    import tensorflow as tf

    return isinstance(resolver, tf.distribute.cluster_resolver.TPUClusterResolver)


def discover(tpu=None, cluster_resolver=None, environ=None):
    """Finds the cluster of this process (the order and the errors: the module docstring).

    Args:
      tpu: a TPU name or address, or `"local"`; None reads `TPU_NAME`.
      cluster_resolver: a `tf.distribute.cluster_resolver.ClusterResolver`, used as given.
      environ: the environment (default: this process's).

    Returns:
      A `Cluster`.

    Raises:
      ValueError: two sources name a cluster, or one is half set; the message names the variables.
    """
    return _discover(tpu, cluster_resolver, environ)


def _discover(tpu, cluster_resolver, environ):
    environ = os.environ if environ is None else environ
    if cluster_resolver is not None:
        if tpu is not None:
            raise ValueError("Give create_strategy tpu= or cluster_resolver=, not both.")
        if _is_tpu_resolver(cluster_resolver):
            return Cluster("tpu", 1, "a TPUClusterResolver", resolver=cluster_resolver)
        spec = cluster_resolver.cluster_spec().as_dict()
        workers = sum(len(spec.get(job, [])) for job in _MULTI_WORKER_JOBS)
        name = type(cluster_resolver).__name__
        return Cluster("cluster_resolver", workers, f"a {name}", resolver=cluster_resolver)

    tpu_from = "tpu=" if tpu is not None else "TPU_NAME"
    tpu = tpu if tpu is not None else (environ.get("TPU_NAME") or None)
    workers = tf_config_workers(environ.get("TF_CONFIG", ""))
    tasks = slurm_tasks(environ)
    named = [
        f"{tpu_from}={tpu!r}" if tpu is not None else None,
        f"TF_CONFIG ({workers} workers)" if workers > 1 else None,
        f"SLURM_STEP_NUM_TASKS={tasks}" if tasks > 1 else None,
    ]
    named = [n for n in named if n]
    if len(named) > 1:
        raise ValueError(
            f"Both {' and '.join(named)} name a cluster; this process can join only one. Unset the one that does not describe this run (or pass cluster_resolver= to choose)."
        )
    if tpu is not None:
        return Cluster("tpu", 1, f"{tpu!r} from {tpu_from}", tpu=tpu)
    if workers > 1:
        import tensorflow as tf

        resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
        task = f"{resolver.task_type} {resolver.task_id}"
        return Cluster("TF_CONFIG", workers, f"task {task}", resolver=resolver)
    if tasks > 1:
        resolver = slurm_resolver(environ)
        spec = resolver.cluster_spec()  # sets the task type and index
        check_slurm_task(environ, spec.task_address(resolver.task_type, resolver.task_id))
        description = (
            f"a step of {tasks} tasks on {environ['SLURM_STEP_NODELIST']}, SLURM_PROCID "
            f"{environ['SLURM_PROCID']}: task {resolver.task_type} {resolver.task_id}"
        )
        return Cluster("Slurm", tasks, description, resolver=resolver)
    return Cluster("local", 1, "this host alone")


def cpus_per_worker(environ=None):
    """The launcher's logical CPUs per worker (`TPU_SCALE_CPUS_PER_WORKER`), or None."""
    from tpu_scale.launch import CPUS_PER_WORKER as name

    environ = os.environ if environ is None else environ
    if not environ.get(name):
        return None
    count = _int_variable(environ, name)
    if count < 1:
        raise ValueError(f"{name}={count}: give 1 or more logical CPUs per worker.")
    return count
