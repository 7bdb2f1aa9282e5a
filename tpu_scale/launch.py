"""Starts a multi-worker training script as N worker processes on this host.

    python -m tpu_scale.launch --num_workers 2 [--num_cpu_replicas 2] [--network loopback] \
        -- SCRIPT.py ARGS...

Each worker is a process of its own with a `TF_CONFIG` naming every worker at a free localhost
port and its own task index, which is what `tpu_scale.create_strategy()` (and any
`tf.distribute.MultiWorkerMirroredStrategy`) reads on a real cluster. A script written for several
hosts then runs unchanged on one machine, and the same script runs on Slurm (`srun`) or Kubernetes
(an indexed Job) with the `TF_CONFIG` or `SLURM_*` variables those set (`examples/README.md`).

The launcher
* prefixes every line a worker prints with `[worker i]`;
* forwards SIGINT and SIGTERM to every worker (a SIGTERM makes a run with
  `tpu_scale.training.run_callbacks` save a backup and exit with code 143, as on a preemption; the
  same command then resumes);
* when a worker fails, stops the others (SIGTERM, then SIGKILL after `--grace_seconds`), names the
  worker and prints its last lines, and exits with its code (128 + N for a worker ended by signal
  N). It exits with 0 when every worker does.

`--num_cpu_replicas K` gives each worker K logical CPU devices (exported as
`TPU_SCALE_CPUS_PER_WORKER`, which `create_strategy()` reads when it is not given
`num_cpu_replicas`).

The workers' network (`--network`). Each worker runs TensorFlow's distributed runtime, a gRPC
server that binds every interface of its host and has no authentication: TensorFlow's security
guidance says to run it on trusted networks only, since anyone who reaches its port can run graph
operations as the training user. With `--network loopback` (the default) the launcher runs the
workers in a network namespace of their own that holds only the loopback device
(`unshare --net`, with `--map-root-user` when not root), so nothing outside the job can reach
them, and neither can they reach any other host (no `gs://` folders, no downloads). Where the
kernel refuses a namespace (user namespaces disabled), the launcher says so and runs them on the
host's network; so does `--network host`, asked for by name. Then keep the host behind a firewall.

The process and `TF_CONFIG` helpers here (`free_ports`, `tf_config`, `Workers`) also run the test
suite's multi-process clusters (`tpu_scale.testing.multiworker`).
"""

import argparse
import collections
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

CPUS_PER_WORKER = "TPU_SCALE_CPUS_PER_WORKER"
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
NETWORKS = ("loopback", "host")
# Set in the launcher that runs inside the workers' own network namespace.
_IN_NAMESPACE = "TPU_SCALE_LAUNCH_NAMESPACE"


def free_ports(count):
    """`count` distinct free localhost ports (bound at once, then released).

    Args:
      count: how many ports.

    Returns:
      A list of port numbers.
    """
    sockets = []
    try:
        for _ in range(count):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("localhost", 0))
            sockets.append(s)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def tf_config(workers, index):
    """The `TF_CONFIG` of worker `index` in a cluster of `workers`.

    Args:
      workers: localhost port numbers, or `"address:port"` strings, one per worker.
      index: this worker's task index.

    Returns:
      The JSON text.
    """
    addresses = [w if isinstance(w, str) else f"localhost:{w}" for w in workers]
    return json.dumps(
        {"cluster": {"worker": addresses}, "task": {"type": "worker", "index": index}}
    )


def exit_code(returncode):
    """A process's exit status as a shell reports it: 128 + N for an end by signal N."""
    return 128 - returncode if returncode < 0 else returncode


def _parent_death_signal():
    """A function for the child to run before exec, so that a SIGKILL of the launcher takes its
    workers with it (Linux `prctl(PR_SET_PDEATHSIG)`); None elsewhere.

    The library call is looked up here, in the parent: the child only calls it.
    """
    if not sys.platform.startswith("linux"):
        return None
    try:
        import ctypes

        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    return lambda: prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


class Workers:
    """N worker processes, their output read line by line, stopped together.

    Each worker runs in a session of its own, so a Ctrl-C in the terminal reaches the workers only
    through `signal_all` (once), and stopping a worker stops whatever it started. Its standard
    output and error are merged; each line goes to `on_line(index, line)` and the last
    `keep_lines` are kept for the report of a failure.

    Args:
      commands: one argv list per worker.
      envs: one environment dict per worker.
      on_line: called with (worker index, line without its newline) from a reader thread; None to
        keep the lines only.
      keep_lines: how many of each worker's last lines `tail` can return.
      die_with_parent: on Linux, the workers are killed when this process dies, even by SIGKILL.
        It runs code in the child before exec, which Python warns against in a process with many
        threads (e.g. one that runs TensorFlow): the launcher's own process has none.
    """

    def __init__(self, commands, envs, on_line=None, keep_lines=60, die_with_parent=False):
        if len(commands) != len(envs):
            raise ValueError(f"{len(commands)} commands for {len(envs)} environments.")
        self._on_line = on_line
        self._lock = threading.Lock()
        self._tails = [collections.deque(maxlen=keep_lines) for _ in commands]
        self.procs, self._readers = [], []
        before_exec = _parent_death_signal() if die_with_parent else None
        try:
            for index, (command, env) in enumerate(zip(commands, envs)):
                proc = subprocess.Popen(
                    command,
                    env=env,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    start_new_session=True,
                    preexec_fn=before_exec,
                )
                self.procs.append(proc)
                reader = threading.Thread(target=self._read, args=(index, proc), daemon=True)
                reader.start()
                self._readers.append(reader)
        except BaseException:
            self.kill()
            raise

    def _read(self, index, proc):
        for raw in iter(proc.stdout.readline, b""):
            line = raw.decode(errors="replace").rstrip("\r\n")
            with self._lock:
                self._tails[index].append(line)
                if self._on_line is not None:
                    self._on_line(index, line)
        proc.stdout.close()

    def tail(self, index):
        """The last lines worker `index` printed, as one text."""
        self._readers[index].join(timeout=5)  # the pipe's last lines, once the worker has ended
        with self._lock:
            return "\n".join(self._tails[index])

    def returncodes(self):
        return [p.poll() for p in self.procs]

    def signal_all(self, signum):
        """Sends `signum` to every worker still running (and to what it started)."""
        for proc in self.procs:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signum)
                except ProcessLookupError:
                    pass

    def wait(self, timeout=None, poll_seconds=0.1):
        """Waits until every worker has ended, one has failed, or `timeout` seconds pass.

        Returns:
          The index of the first worker seen to exit with a non-zero code, else None (all ended
          with 0, or the time is up: `returncodes()` tells which).
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            codes = self.returncodes()
            failed = [i for i, code in enumerate(codes) if code not in (None, 0)]
            if failed:
                return failed[0]
            if all(code is not None for code in codes):
                return None
            if deadline is not None and time.monotonic() > deadline:
                return None
            time.sleep(poll_seconds)

    def stop(self, grace_seconds):
        """SIGTERM to every worker still running, SIGKILL to any left after `grace_seconds`."""
        if grace_seconds > 0:
            self.signal_all(signal.SIGTERM)
            deadline = time.monotonic() + grace_seconds
            while time.monotonic() < deadline and None in self.returncodes():
                time.sleep(0.1)
        self.kill()

    def kill(self):
        """SIGKILL to every worker still running; waits for them."""
        self.signal_all(signal.SIGKILL)
        for proc in self.procs:
            proc.wait()


def worker_environments(num_workers, cpus_per_worker=None, base=None, addresses=None):
    """The environment of each worker: `base` (default: this process's) plus its `TF_CONFIG`.

    Args:
      num_workers: how many workers.
      cpus_per_worker: logical CPU devices per worker, exported as `TPU_SCALE_CPUS_PER_WORKER`;
        None leaves it unset.
      base: the environment to start from.
      addresses: `"address:port"` per worker; default: free localhost ports.

    Returns:
      A list of environment dicts, in task order.
    """
    env = dict(os.environ if base is None else base)
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    env.setdefault("PYTHONUNBUFFERED", "1")  # lines reach the launcher as they are printed
    if cpus_per_worker is not None:
        env[CPUS_PER_WORKER] = str(cpus_per_worker)
    workers = addresses or free_ports(num_workers)
    return [dict(env, TF_CONFIG=tf_config(workers, i)) for i in range(num_workers)]


def _parse(argv):
    parser = argparse.ArgumentParser(
        prog="python -m tpu_scale.launch",
        description="Runs SCRIPT as N worker processes on this host, each with its TF_CONFIG.",
        usage="%(prog)s --num_workers N [--num_cpu_replicas K] [--grace_seconds S] "
        "[--network loopback|host] -- SCRIPT [ARGS...]",
    )
    parser.add_argument("--num_workers", type=int, required=True, help="worker processes")
    parser.add_argument(
        "--num_cpu_replicas", type=int, default=None, help="logical CPU devices per worker"
    )
    parser.add_argument(
        "--grace_seconds",
        type=float,
        default=30.0,
        help="after a failure, how long the other workers get to stop before SIGKILL",
    )
    parser.add_argument(
        "--network",
        choices=NETWORKS,
        default="loopback",
        help="loopback: the workers in a network namespace of their own, reachable by nothing "
        "outside the job (and reaching nothing outside it); host: the host's network, where "
        "TensorFlow's unauthenticated servers listen on every interface",
    )
    parser.add_argument("command", nargs=argparse.REMAINDER, help="SCRIPT and its arguments")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("name the script after --, e.g. -- examples/train_imagenet.py --epochs 2")
    if args.num_workers < 1:
        parser.error(f"--num_workers={args.num_workers}: give 1 or more workers.")
    if args.num_cpu_replicas is not None and args.num_cpu_replicas < 1:
        parser.error(f"--num_cpu_replicas={args.num_cpu_replicas}: give 1 or more.")
    # A Python file runs under this interpreter; anything else (an executable) as given.
    if command[0].endswith(".py"):
        if not os.path.isfile(command[0]):
            parser.error(f"no script {command[0]!r} (from {os.getcwd()}).")
        command = [sys.executable] + command
    elif not shutil.which(command[0]):
        parser.error(f"{command[0]!r} is neither a .py script nor a program on the PATH.")
    return args, command


def _bring_up_loopback():
    """Sets the loopback device up in this (new) network namespace, where it starts down."""
    import fcntl
    import struct

    siocgifflags, siocsifflags, iff_up = 0x8913, 0x8914, 0x1
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        request = struct.pack("16sH", b"lo", 0)
        flags = struct.unpack("16sH", fcntl.ioctl(s, siocgifflags, request)[:18])[1]
        fcntl.ioctl(s, siocsifflags, struct.pack("16sH", b"lo", flags | iff_up))


def _in_own_network(argv):
    """Runs this launcher again inside a network namespace that holds only the loopback device;
    returns its exit code, or None (with the reason written to stderr) where none can be made."""
    unshare = shutil.which("unshare")
    if unshare is None or not sys.platform.startswith("linux"):
        reason = "no unshare command" if sys.platform.startswith("linux") else "not Linux"
    else:
        command = [unshare, "--net"] + (["--map-root-user"] if os.geteuid() != 0 else [])
        probe = subprocess.run(command + ["true"], capture_output=True, text=True)
        if probe.returncode == 0:
            env = dict(os.environ, **{_IN_NAMESPACE: "1"})
            inner = subprocess.Popen(
                command + ["--", sys.executable, "-m", "tpu_scale.launch"] + list(argv),
                env=env,
                preexec_fn=_parent_death_signal(),
            )
            previous = {s: signal.getsignal(s) for s in STOP_SIGNALS}
            for s in STOP_SIGNALS:
                signal.signal(s, lambda signum, frame: inner.send_signal(signum))
            try:
                return exit_code(inner.wait())
            finally:
                for s, handler in previous.items():
                    signal.signal(s, handler)
        reason = (probe.stderr.strip().splitlines() or [f"exit code {probe.returncode}"])[-1]
    sys.stderr.write(
        f"tpu_scale.launch: cannot give the workers a network of their own ({reason}); they run on "
        "this host's network, where TensorFlow's servers listen on every interface without "
        "authentication. Keep the host behind a firewall, or enable user namespaces "
        "(sysctl kernel.unprivileged_userns_clone=1). --network host says this is intended.\n"
    )
    return None


def main(argv=None):
    """Runs the launcher; returns its exit code."""
    argv = sys.argv[1:] if argv is None else argv
    args, command = _parse(argv)
    if args.network == "loopback":
        if os.environ.get(_IN_NAMESPACE):
            _bring_up_loopback()
        else:
            code = _in_own_network(argv)
            if code is not None:
                return code
    envs = worker_environments(args.num_workers, args.num_cpu_replicas)
    for env in envs:
        env.pop(_IN_NAMESPACE, None)
    out = sys.stdout

    def on_line(index, line):
        out.write(f"[worker {index}] {line}\n")
        out.flush()

    received = []

    def forward(signum, frame):
        del frame
        received.append(signum)
        # The first signal asks every worker to save and stop; a second one ends them at once.
        workers.signal_all(signum if len(received) == 1 else signal.SIGKILL)

    previous = {s: signal.getsignal(s) for s in STOP_SIGNALS}
    workers = Workers([command] * args.num_workers, envs, on_line, die_with_parent=True)
    for s in STOP_SIGNALS:
        signal.signal(s, forward)
    try:
        failed = workers.wait()
        if failed is not None and received:
            # Every worker was signalled and saves on its own: none is stopped early.
            while None in workers.returncodes():
                time.sleep(0.1)
        if received:
            codes = [exit_code(c) for c in workers.returncodes()]
            sys.stderr.write(
                f"tpu_scale.launch: {signal.Signals(received[0]).name} forwarded to every worker; "
                f"exit codes {codes}\n"
            )
        if failed is None:
            return 0
        code = exit_code(workers.returncodes()[failed])
        if not received:
            workers.stop(args.grace_seconds)
            sys.stderr.write(
                f"tpu_scale.launch: worker {failed} failed with exit code {code}; stopped the "
                f"other {args.num_workers - 1}. Its last lines:\n{workers.tail(failed)}\n"
            )
        return code
    finally:
        workers.kill()
        for s, handler in previous.items():
            signal.signal(s, handler)


if __name__ == "__main__":
    sys.exit(main())
