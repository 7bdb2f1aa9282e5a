"""Collective-op plumbing for `tpu_scale.distribute.collectives`: private keys, ordering tokens, V2 ops.

On CPU/GPU, the collective V2 ops need a group key per group (ours live in a private range far above
the strategies' own), an instance key fetched at every call of the traced function, and one
ordering token per device and channel: without the token, automatic control dependencies chain
every replica's collective in one sequence and the replicas wait on each other forever. No V2 op
has a registered gradient, so each has a custom one here. Only `tpu_scale.distribute.collectives` uses this
module.
"""

import contextlib
import os
import threading
import zlib

import numpy as np
import tensorflow as tf

from tpu_scale.tf_seam import device_util, resource_variable_ops

# Every tf.distribute strategy numbers its group keys from 1; ours live far above them.
PRIVATE_KEY_BASE = 1 << 30
# No timeout by default: the runtime parks one thread per launched op for the whole timeout, so a
# 300 s timeout on every batch-norm sum grew a training process to thousands of sleeping threads.
# Mismatched groups are caught before launch instead (`_checked_groups`).
_DEFAULT_TIMEOUT_SECONDS = 0.0

_lock = threading.Lock()
_group_keys = {}  # group key -> sorted member tuple, to detect a (very unlikely) hash collision
_instance_counters = {}  # (group key, device) -> next instance key
_ordering_tokens = {}  # (device, channel) -> resource variable
_override = threading.local()


def timeout_seconds():
    """Seconds a CPU/GPU collective may wait for its peers before failing; 0 waits forever.

    Set `TPU_SCALE_COLLECTIVE_TIMEOUT` to debug a suspected hang: each op then holds a runtime
    thread for up to that long, so keep it off in long training runs.
    """
    return float(os.environ.get("TPU_SCALE_COLLECTIVE_TIMEOUT", _DEFAULT_TIMEOUT_SECONDS))


# --------------------------------------------------------------------------- ordering


@contextlib.contextmanager
def ordering_channel(channel):
    """Collectives launched inside are ordered only against others of the same `channel` on their
    device.

    On CPU/GPU every collective op takes a per-device ordering token, which runs the device's
    collectives one after another in program order. Independent sequences (e.g. the two halves of a
    bidirectional torus sum) can take different channels so both can be in flight at once. Each
    channel must still launch the same collectives in the same order on every replica. No effect on
    TPU, where XLA schedules the ops.

    Args:
      channel: a hashable name; `0` is the default channel.
    """
    previous = getattr(_override, "channel", 0)
    _override.channel = channel
    try:
        yield
    finally:
        _override.channel = previous


def _group_key(members):
    """A private group key derived from the members alone, so every worker picks the same key."""
    members = tuple(sorted(int(m) for m in members))
    key = PRIVATE_KEY_BASE + zlib.crc32(np.asarray(members, np.int64).tobytes()) % (1 << 30)
    with _lock:
        known = _group_keys.setdefault(key, members)
    if known != members:
        raise RuntimeError(f"Private collective group key {key} is shared by groups {known} and {members}. Use a different group size.")
    return key


def _next_instance_key(group_key, device):
    with _lock:
        key = _instance_counters.get((group_key, device), 1)
        _instance_counters[(group_key, device)] = key + 1
    return key


def _instance_key(group_key, device):
    """An instance key fetched at every call of the traced function, as TensorFlow's own launcher
    does.

    Keys handed out while tracing would diverge between workers that retrace at different times;
    keys taken at call time stay in step because every replica runs the same collectives in the same
    order.
    """
    graph = tf.compat.v1.get_default_graph()
    while getattr(graph, "is_control_flow_graph", False):
        graph = graph.outer_graph
    if not graph.building_function:
        return _next_instance_key(group_key, device)
    with graph.as_default():
        return graph.capture_call_time_value(
            lambda: _next_instance_key(group_key, device), tf.TensorSpec([], tf.int32)
        )


def _ordering_token(device, channel=0):
    with _lock:
        token = _ordering_tokens.get((device, channel))
        if token is None:
            # A plain ResourceVariable (not tf.Variable) so no strategy or Keras variable creator
            # sees it.
            with tf.init_scope(), tf.device(device):
                token = resource_variable_ops.ResourceVariable(
                    0.0, trainable=False, name="collective_token"
                )
            _ordering_tokens[(device, channel)] = token
    return token.handle


class Launch:
    """What a replica needs to launch a collective op in its group."""

    def __init__(self, members):
        self.group_size = len(members)
        self.group_key = _group_key(members)
        self.device = device_util.canonicalize(device_util.current())
        self.channel = getattr(_override, "channel", 0)

    def kwargs(self):
        """The keywords every collective V2 op of `tf.raw_ops` takes, for one launch."""
        return dict(
            group_size=self.group_size,
            group_key=self.group_key,
            instance_key=_instance_key(self.group_key, self.device),
            ordering_token=[_ordering_token(self.device, self.channel)],
            timeout_seconds=timeout_seconds(),
        )


def collective_sum(x, launch):
    @tf.custom_gradient
    def summed(x):
        with tf.device(launch.device):
            y = tf.raw_ops.CollectiveReduceV2(
                input=x, merge_op="Add", final_op="Id", **launch.kwargs()
            )
        return y, lambda dy: collective_sum(dy, launch)

    return summed(x)


def collective_all_to_all(x, launch):
    @tf.custom_gradient
    def exchanged(x):
        # The CPU/GPU kernel wants axis 0 to be exactly the group size: one row per rank.
        with tf.device(launch.device):
            rows = tf.reshape(x, [launch.group_size, -1])
            y = tf.raw_ops.CollectiveAllToAllV2(input=rows, **launch.kwargs())
            y = tf.reshape(y, tf.shape(x))
        return y, lambda dy: collective_all_to_all(dy, launch)

    return exchanged(x)


def collective_all_gather(x, launch):
    @tf.custom_gradient
    def gathered(x):
        with tf.device(launch.device):
            if x.dtype == tf.bfloat16:
                # The gather kernel has no bfloat16; it only copies bytes, so send the bits as
                # float16.
                y = tf.bitcast(
                    tf.raw_ops.CollectiveGatherV2(
                        input=tf.bitcast(x, tf.float16), **launch.kwargs()
                    ),
                    tf.bfloat16,
                )
            else:
                y = tf.raw_ops.CollectiveGatherV2(input=x, **launch.kwargs())

        def grad(dy):
            return local_shard_sum(collective_all_to_all(dy, launch), launch.group_size)

        return y, grad

    return gathered(x)


def local_shard_sum(received, group_size):
    """Sums the `group_size` equal chunks along axis 0: the local half of a reduce-scatter."""
    shape = tf.shape(received)
    chunks = tf.reshape(received, tf.concat([[group_size, shape[0] // group_size], shape[1:]], 0))
    return tf.reduce_sum(chunks, axis=0)
