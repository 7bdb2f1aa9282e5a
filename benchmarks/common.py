"""What every benchmark shares: machine info, interleaved timing, summaries, child processes.

    from common import machine_info, summarize, timed_rounds, run_child

Figures are ratios against a baseline measured in the same run, on a shared and noisy machine:
methods run in interleaved rounds (so a slow spell hits all of them), and summaries give the median
with the spread (min, max) of the rounds.
"""

import importlib.metadata
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
RESULTS = os.path.join(HERE, "results")
# The checkout's package first: the benchmarks measure the code beside them, installed or not.
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

# The benchmarks ask for the BFC CPU allocator by name (tpu_scale.process), as the example does:
# they import this module before TensorFlow starts, their child processes inherit the setting, and
# `machine_info` records it. TF_CPU_ALLOCATOR_USE_BFC=0 measures TensorFlow's default.
import tpu_scale.process  # noqa: E402

tpu_scale.process.use_bfc_cpu_allocator()


def cpu_allocator():
    """The CPU allocator TensorFlow starts with in this process: "bfc" or "default"."""
    use_bfc = os.environ.get("TF_CPU_ALLOCATOR_USE_BFC", "").lower() in ("1", "true")
    return "bfc" if use_bfc else "default"


def _cpu_model():
    """The CPU's model name from /proc/cpuinfo (Linux), else None."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def machine_info():
    """The machine, Python, TensorFlow and Keras versions, the CPU allocator and the load average
    (no TF import)."""

    def version(package):
        try:
            return importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            return None

    return {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        # Figures move with the CPU model (one machine kind here has had several): name it.
        "cpu_model": _cpu_model(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "tensorflow": version("tensorflow"),
        "keras": version("keras"),
        "cpu_allocator": cpu_allocator(),
        "load_average": [round(x, 2) for x in os.getloadavg()],
    }


def summarize(values, baseline=None):
    """Median, min and max of `values`, and the ratio of medians to `baseline` when given."""
    result = {
        "median": statistics.median(values),
        "min": min(values),
        "max": max(values),
        "n": len(values),
    }
    if baseline is not None:
        result["ratio"] = result["median"] / statistics.median(baseline)
    return result


def spread(values):
    """Median, min and max of `values` (e.g. per-round ratios)."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def save_result(name, result):
    """Writes `result` to `results/<name>.json` and prints it."""
    os.makedirs(RESULTS, exist_ok=True)
    with open(os.path.join(RESULTS, f"{name}.json"), "w") as f:
        json.dump(result, f, indent=2)
    print(json.dumps(result, indent=2))


def load_runs(path):
    """The results file of a benchmark that adds one run at a time (`{"runs": [...]}`), or an
    empty one."""
    if not os.path.exists(path):
        return {"runs": []}
    with open(path) as f:
        return json.load(f)


def record_run(out, run, same, summarize, path):
    """Adds `run` to `out["runs"]` in place of any run equal to it in the keys `same`, summarizes
    the runs again (`summarize(runs)`) and writes `out` to `path`: a run cut short keeps what
    finished."""
    out["runs"] = [r for r in out["runs"] if any(r[k] != run[k] for k in same)] + [run]
    out["summary"] = summarize(out["runs"])
    out["machine"] = machine_info()
    with open(path, "w") as f:
        json.dump(out, f, indent=1)


def folder_files(folder):
    """{file name: bytes} of the files in `folder` (not its sub-folders), e.g. a writer's output,
    to check that two writers wrote the same files."""
    out = {}
    for name in sorted(os.listdir(folder)):
        with open(os.path.join(folder, name), "rb") as f:
            out[name] = f.read()
    return out


def timed_rounds(methods, rounds, warmup=1):
    """Seconds per call of each method, in `rounds` interleaved rounds after `warmup` untimed calls
    each.

    Args:
      methods: dict name -> zero-argument callable that blocks until its work is done.
      rounds: timed calls of each method; round k calls every method once, in turn.
      warmup: untimed calls of each method first (tracing, caches).

    Returns:
      dict name -> list of seconds, one per round.
    """
    for fn in methods.values():
        for _ in range(warmup):
            fn()
    times = {name: [] for name in methods}
    for _ in range(rounds):
        for name, fn in methods.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return times


def run_child(script, args, timeout):
    """Runs `python script --_child_output PATH *args` and returns the JSON the child wrote to PATH.

    Each part that must not share a process (several TensorFlow runtimes, device counts) runs this
    way; the child calls `write_child_output(args._child_output, result)`.

    Raises:
      RuntimeError: the child failed or timed out; the message holds the end of its output.
    """
    with tempfile.TemporaryDirectory(prefix="tpu_scale_bench_") as workdir:
        out = os.path.join(workdir, "result.json")
        command = [sys.executable, script, "--_child_output", out, *args]
        try:
            completed = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired as e:
            raise RuntimeError(f"{' '.join(command)} did not finish within {timeout} s") from e
        if completed.returncode != 0 or not os.path.exists(out):
            tail = "\n".join((completed.stdout + completed.stderr).splitlines()[-40:])
            raise RuntimeError(f"{' '.join(command)} failed (exit {completed.returncode}):\n{tail}")
        with open(out) as f:
            return json.load(f)


def write_child_output(path, result):
    """The child's half of `run_child`."""
    with open(path, "w") as f:
        json.dump(result, f)
