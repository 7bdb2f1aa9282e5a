"""Peer failures: collective errors after a worker died or froze, turned into errors naming it."""

import contextlib
import re
import socket
import time

import tensorflow as tf

from tpu_scale.checkpointing.preemption import PreemptionCluster


class PeerFailureError(RuntimeError):
    """Training stopped because another worker died, froze or became unreachable.

    Attributes:
      tasks: the task names the runtime or a probe points at (may be empty when nothing is known).
    """

    def __init__(self, message, tasks=()):
        super().__init__(message)
        self.tasks = tuple(tasks)


_PEER_ERRORS = (
    tf.errors.UnavailableError,
    tf.errors.DeadlineExceededError,
    tf.errors.AbortedError,
    tf.errors.InternalError,
    tf.errors.CancelledError,
)
_PEER_MARKERS = ("ollective", "heartbeat", "CoordinationService", "WorkerService", "/job:")
_TASK = r"/job:\w+/replica:\d+/task:\d+"
_SECOND_LOOK_SECONDS = 1.0


def probe_task(address, timeout=2.0):
    """Whether the gRPC server at `address` is alive: `"answers"`, `"refused"`, `"silent"`, ...

    Opens a TCP connection and sends the HTTP/2 preface. A live server answers with its settings at
    once; a dead process's port refuses the connection; a stopped or hung process's kernel still
    accepts it, but nothing answers.

    Args:
      address: `"host:port"`.
      timeout: seconds for the connection and for the answer.

    Returns:
      `"answers"`, `"refused"` (no process listens), `"reset"` (the process is exiting),
      `"silent"` (frozen), `"closed"` or `"unreachable: <error>"`.
    """
    host, port = address.rsplit(":", 1)
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout) as s:
            s.settimeout(timeout)
            s.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes([0, 0, 0, 4, 0, 0, 0, 0, 0]))
            return "answers" if s.recv(9) else "closed"
    except ConnectionRefusedError:
        return "refused"
    except (ConnectionResetError, BrokenPipeError):
        return "reset"
    except socket.timeout:
        return "silent"
    except OSError as e:
        return f"unreachable: {e}"


_PROBE_WORDS = {
    "refused": "is not running (its port refuses connections)",
    "reset": "is not running (its port resets connections: the process is exiting)",
    "silent": "accepts connections but does not answer: frozen (stopped, hung or overloaded)",
    "closed": "closes connections at once (shutting down)",
}


def explain_peer_failure(error, cluster, probe_timeout=2.0):
    """A `PeerFailureError` for `error`, naming the failed task(s) of `cluster`.

    Args:
      error: the `tf.errors.OpError` from a collective or from the coordination service.
      cluster: the `PreemptionCluster` this process belongs to.
      probe_timeout: seconds per liveness probe of each other task.

    Returns:
      The `PeerFailureError` (not raised).
    """
    message = error.message or str(error)
    blamed = []

    def blame(task, why):
        task = re.sub(r"^/job:(\w+)/task:", r"/job:\1/replica:0/task:", task)
        if task != cluster.me:
            blamed.append((task, why))

    unhealthy = re.search(
        r"unhealthy \(stopped sending heartbeats\):\s*((?:" + _TASK + r"\s*)+)", message
    )
    if unhealthy:
        for task in re.findall(_TASK, unhealthy.group(1)):
            blame(task, "stopped sending heartbeats to the coordination service")
    for task in re.findall(r"from remote target (" + _TASK + ")", message):
        blame(task, "failed an RPC from this task")
    if "CoordinationService/Heartbeat" in message:
        blame(cluster.chief, "hosts the coordination service, which stopped answering heartbeats")
    probes = {
        task: probe_task(cluster.addresses[task], probe_timeout)
        for task in cluster.tasks
        if task != cluster.me
    }
    # A killed process frees its memory before it closes its sockets, and meanwhile its port still
    # accepts connections that nothing answers: look once more before calling a silent task frozen.
    silent = [task for task, state in probes.items() if state == "silent"]
    if silent:
        time.sleep(_SECOND_LOOK_SECONDS)
        probes.update({task: probe_task(cluster.addresses[task], probe_timeout) for task in silent})
    for task, state in probes.items():
        if state != "answers":
            blame(task, _PROBE_WORDS.get(state, state))
    tasks = list(dict.fromkeys(task for task, _ in blamed))
    lines = [
        f"{cluster.describe(task)}: " + "; ".join(why for t, why in blamed if t == task)
        for task in tasks
    ]
    first_line = next(
        (line for line in message.splitlines() if "aborted by" in line),
        message.splitlines()[0] if message else "",
    )
    first_line = re.sub(r"\{\{[^}]*\}\}\s*", "", first_line)  # the op's own device
    headline = f"Training on {cluster.me} stopped because " + (
        f"{'a peer' if len(tasks) == 1 else 'peers'} failed:\n  " + "\n  ".join(lines)
        if tasks
        else "of a failure the runtime could not attribute to a task (every "
        "other task still answers)"
    )
    return PeerFailureError(
        f"{headline}\nRuntime error ({type(error).__name__}): {first_line.strip()}\n"
        f"What to do: read the log of the task named above (an earlier error, an out-of-memory "
        f"kill or the scheduler's preemption); then relaunch every worker with the same command, "
        f"which resumes from the last backup in backup_dir.",
        tasks,
    )


@contextlib.contextmanager
def peer_failures_explained(strategy=None, probe_timeout=2.0):
    """Turns collective errors caused by another worker into a `PeerFailureError` that names it.

    Around `model.fit` (or any training loop) under `MultiWorkerMirroredStrategy`. The runtime
    reports a dead or frozen peer as an `UnavailableError`, `DeadlineExceededError`, `AbortedError`
    or `InternalError` that often names no task, or only this one; this names the failed task(s)
    from what the message says and from a liveness probe of every other task, keeping the original
    as `__cause__`. Other errors, and every error of a single-process strategy, pass through
    unchanged.

    Args:
      strategy: the strategy training runs under; default: the current one.
      probe_timeout: seconds per liveness probe of each other task.

    Raises:
      PeerFailureError: training failed because of another task.
    """
    try:
        yield
    except _PEER_ERRORS as e:
        cluster = PreemptionCluster.of(strategy or tf.distribute.get_strategy())
        message = e.message or ""
        if cluster is None or not any(marker in message for marker in _PEER_MARKERS):
            raise
        raise explain_peer_failure(e, cluster, probe_timeout) from e
