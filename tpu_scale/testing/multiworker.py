"""Runs a function in N localhost worker processes under `TF_CONFIG`: a real multi-host cluster
on one machine.

Each worker is a fresh Python process (a `MultiWorkerMirroredStrategy` must be created before any
other TensorFlow op, and only once per process) with its own `TF_CONFIG` naming free localhost
ports. The target function creates the strategy itself, e.g. with
`tpu_scale.create_strategy(num_cpu_replicas=...)`, and returns a picklable value; `run_workers`
returns every worker's value, or raises with every worker's output when one fails or the cluster
does not finish in time.

    results = run_workers("test_strategy:worker_fit", num_workers=2, cpus_per_worker=2)

Workers see `TPU_SCALE_CPUS_PER_WORKER` in their environment, which `create_strategy` uses when
not given `num_cpu_replicas`. The processes, their `TF_CONFIG` and their output are handled by the
launcher's helpers (`tpu_scale.launch`), as a `python -m tpu_scale.launch` run would handle them.
"""

import os
import pickle
import sys
import tempfile

from tpu_scale.launch import Workers, free_ports, tf_config, worker_environments

__all__ = ["free_ports", "run_workers", "tf_config"]


def run_workers(
    target,
    num_workers=2,
    cpus_per_worker=2,
    kwargs=None,
    timeout=300,
    addresses=None,
    launch_prefixes=None,
):
    """Runs `target(**kwargs)` in `num_workers` localhost worker processes; returns their results.

    Args:
      target: `"package.module:function"`, importable in a fresh process (the caller's `sys.path` is
        passed on).
      num_workers: worker processes, each with its own `TF_CONFIG`.
      cpus_per_worker: logical CPUs each worker should create (exported as
        `TPU_SCALE_CPUS_PER_WORKER`).
      kwargs: keyword arguments for the target; must be picklable.
      timeout: seconds for the whole cluster; on expiry every worker is killed.
      addresses: `"address:port"` of each worker, for workers that are not on localhost (e.g.
        each in a network namespace of its own); default: free localhost ports.
      launch_prefixes: per worker, the command its process starts under (e.g. `["ip", "netns",
        "exec", NAME]`); it must exec the worker, so that killing the process kills the worker.

    Returns:
      The list of the workers' return values, in task order.

    Raises:
      RuntimeError: a worker failed or the cluster timed out; the message holds every worker's
        output.
    """
    if ":" not in target:
        raise ValueError(f"target must look like 'package.module:function', got {target!r}.")
    for given, name in ((addresses, "addresses"), (launch_prefixes, "launch_prefixes")):
        if given is not None and len(given) != num_workers:
            raise ValueError(f"{name} has {len(given)} entries for {num_workers} workers.")
    workers = addresses or [f"localhost:{p}" for p in free_ports(num_workers)]
    prefixes = launch_prefixes or [[]] * num_workers
    # The workers' logs and results live only as long as the call: their text is in any error
    # raised.
    with tempfile.TemporaryDirectory(prefix="tpu_scale_workers_") as workdir:
        return _run_in(workdir, target, workers, prefixes, cpus_per_worker, kwargs, timeout)


def _run_in(workdir, target, workers, prefixes, cpus_per_worker, kwargs, timeout):
    num_workers = len(workers)
    with open(os.path.join(workdir, "kwargs.pkl"), "wb") as f:
        pickle.dump(kwargs or {}, f)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([p for p in sys.path if p] + [env.get("PYTHONPATH", "")])
    envs = worker_environments(num_workers, cpus_per_worker, base=env, addresses=workers)
    module = [sys.executable, "-m", "tpu_scale.testing.multiworker", target, workdir]
    cluster = Workers([list(prefixes[i]) + module + [str(i)] for i in range(num_workers)], envs)
    try:
        failed = cluster.wait(timeout)
        codes = cluster.returncodes()
        if failed is not None:
            # The others would wait for it until the collective timeout.
            failed = "a worker failed"
        elif None in codes:
            failed = f"the cluster did not finish within {timeout} s"
    finally:
        cluster.kill()
    if failed:
        report = [
            f"--- worker {i} (exit code {code}) ---\n{cluster.tail(i)}"
            for i, code in enumerate(cluster.returncodes())
        ]
        raise RuntimeError(f"Multi-worker run of {target}: {failed}.\n" + "\n".join(report))
    results = []
    for i in range(num_workers):
        with open(os.path.join(workdir, f"result{i}.pkl"), "rb") as f:
            results.append(pickle.load(f))
    return results


def _worker_main(target, workdir, index):
    import importlib

    module_name, function_name = target.split(":")
    function = getattr(importlib.import_module(module_name), function_name)
    with open(os.path.join(workdir, "kwargs.pkl"), "rb") as f:
        kwargs = pickle.load(f)
    result = function(**kwargs)
    with open(os.path.join(workdir, f"result{index}.pkl"), "wb") as f:
        pickle.dump(result, f)


if __name__ == "__main__":
    _worker_main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
