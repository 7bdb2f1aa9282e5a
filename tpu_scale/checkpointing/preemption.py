"""Preemption: workers agree through TensorFlow's coordination service on the step to save at."""

import dataclasses
import logging
import signal
import threading

import tensorflow as tf

from tpu_scale.distribute import context
from tpu_scale.tf_seam import eager_context as tf_context

logger = logging.getLogger(__name__)

KEY_PREFIX = "tpu_scale/checkpointing"
_STOP = "stop"


@dataclasses.dataclass(frozen=True)
class PreemptionCluster:
    """This process's place in a multi-worker cluster."""

    tasks: tuple  # ("/job:worker/replica:0/task:0", ...), the chief first
    addresses: dict  # task name -> "host:port"
    me: str

    @property
    def chief(self):
        return self.tasks[0]

    @property
    def is_chief(self):
        return self.me == self.chief

    @classmethod
    def of(cls, strategy):
        """The cluster of `strategy`, or `None` for a single process (or a task that is neither the
        chief nor a worker)."""
        me, tasks = context.task_of(strategy)
        if len(tasks) < 2 or me not in tasks:
            return None
        spec = strategy.cluster_resolver.cluster_spec()
        names = tuple(context.task_name(task) for task in tasks)
        addresses = {name: spec.task_address(*task) for name, task in zip(names, tasks)}
        return cls(names, addresses, context.task_name(me))

    def describe(self, task):
        return f"{task} ({self.addresses.get(task, 'unknown address')})"


def is_chief(strategy):
    """Whether this process is the one that writes a run's files under `strategy`.

    The chief task if the cluster has one, else worker 0; the only process when there is no
    cluster (one host, a TPU). Other task types (an evaluator, a parameter server) are not.

    Args:
      strategy: a `tf.distribute` strategy.

    Returns:
      A bool.
    """
    if context.is_tpu_strategy(strategy):
        return True
    me, tasks = context.task_of(strategy)
    return me is None or (bool(tasks) and me == tasks[0])


def kv_get(key, timeout_seconds):
    return tf_context.context().get_config_key_value(key, int(timeout_seconds * 1000))


def kv_set(key, value):
    tf_context.context().set_config_key_value(key, value)


# --------------------------------------------------------------------------- preemption


class PreemptionNotice:
    """Turns SIGTERM into "save at train step N", the same N on every worker.

    The signalled worker claims a key in the coordination service with the step after its current
    one and waits until every worker has acknowledged it; a watcher thread on each worker reads the
    key. Workers of a synchronous `fit` are at most one step apart (each step's all-reduce needs all
    of them), so every worker learns N before it finishes step N. One process alone saves at the
    step it is in.
    """

    def __init__(self, cluster, prefix, ack_timeout):
        self._cluster = cluster
        self._key = f"{prefix}/preempt"
        self._ack_prefix = f"{prefix}/preempt_ack"
        self._ack_timeout = ack_timeout
        self._signalled = threading.Event()
        self._agreed = threading.Event()
        self._claimed = False
        self.save_at = None
        self.origin = None
        self._previous_handler = None
        self._installed = False
        self._thread = None

    def start(self):
        if threading.current_thread() is not threading.main_thread():
            logger.warning(
                "BackupAndRestore: fit runs outside the main thread, where no SIGTERM "
                "handler can be installed; a preemption notice will not save a backup."
            )
            return
        self._previous_handler = signal.getsignal(signal.SIGTERM)
        signal.signal(signal.SIGTERM, self._on_sigterm)
        self._installed = True
        if self._cluster is not None:
            self._thread = threading.Thread(
                target=self._watch, daemon=True, name="tpu_scale-preemption-watcher"
            )
            self._thread.start()

    def _on_sigterm(self, signum, frame):
        del signum, frame
        self._signalled.set()

    @property
    def signalled(self):
        return self._signalled.is_set()

    def _watch(self):
        try:
            value = kv_get(self._key, 0)  # blocks until a notice or the end of training
        except Exception:  # noqa: BLE001  the cluster is going down; the main thread reports that
            return
        if value == _STOP:
            return
        step, origin = value.split("|", 1)
        self.save_at, self.origin = int(step), origin
        self._agreed.set()
        try:
            kv_set(f"{self._ack_prefix}/{self._cluster.me}", "1")
        except Exception as e:  # noqa: BLE001
            logger.warning("Could not acknowledge the preemption notice of %s: %s", origin, e)

    def due(self, steps_done, may_claim=True):
        """Whether to save now, after `steps_done` train steps of this `fit`."""
        if self._agreed.is_set():
            return steps_done >= self.save_at
        if not self._signalled.is_set():
            return False
        if self._cluster is None:
            self.save_at, self.origin = steps_done, "this process"
            return True
        if self._claimed or not may_claim:
            return False
        self._claimed = True
        me = self._cluster.me
        try:
            kv_set(self._key, f"{steps_done + 1}|{me}")
        except tf.errors.AlreadyExistsError:
            return False  # another worker's notice came first; its step applies to everyone
        logger.warning(
            "SIGTERM on %s: every worker saves a backup after train step %d.", me, steps_done + 1
        )
        for task in self._cluster.tasks:
            try:
                kv_get(f"{self._ack_prefix}/{task}", self._ack_timeout)
            except tf.errors.OpError as e:
                logger.warning(
                    "%s did not acknowledge the preemption notice within %d s (%s); saving anyway.",
                    self._cluster.describe(task),
                    self._ack_timeout,
                    type(e).__name__,
                )
        return False

    def stop(self):
        if self._thread is not None:
            try:
                kv_set(self._key, _STOP)
            except tf.errors.OpError:
                pass  # a notice or another worker's stop is there already: the watcher has returned
            self._thread.join(timeout=5)
            self._thread = None
        if self._installed:
            previous = self._previous_handler
            # None: a handler installed outside Python (TensorFlow's own, which saves nothing).
            signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)
            self._installed = False
