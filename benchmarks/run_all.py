"""Runs every benchmark of the package and collects the results in `benchmarks/results/all.json`.

    python benchmarks/run_all.py --quick        # every benchmark (target: 10 minutes on 2 cores)
    python benchmarks/run_all.py --only plan_scaling plan_calibration

Each benchmark runs as its own subprocess (TensorFlow fixes its logical devices at start-up, and one
benchmark's crash must not take the others down), one after another so they do not compete for the
cores. A benchmark script writes `benchmarks/results/<name>.json`; this runner reads it back only if
it was written during this run, so a stale file never passes for a fresh result. Anything that
fails, times out, is missing or writes no result is listed at the end, and the exit status is 1.
"""

import argparse
import json
import os
import signal
import subprocess
import sys
import time

from common import HERE, RESULTS, machine_info  # noqa: E402

ROOT = os.path.dirname(HERE)

# name -> (command, result file); `{results}` is the results directory, `{quick}` the quick flag (or
# nothing).
BENCHMARKS = {
    "plan_scaling": (
        [
            "-m",
            "tpu_scale.plan",
            "--slice",
            "v3-2048",
            "--model",
            "resnet50",
            "--per_core_batch",
            "16",
            "--plot",
            "{results}/plan_scaling.png",
            "--output",
            "{results}/plan_scaling.json",
        ],
        "plan_scaling.json",
    ),
    "batchnorm": (["benchmarks/batchnorm.py", "{quick}"], "batchnorm.json"),
    "all_reduce": (["benchmarks/all_reduce.py", "{quick}"], "all_reduce.json"),
    "input_pipeline": (["benchmarks/input_pipeline.py", "{quick}"], "input_pipeline.json"),
    "input_pipeline_floor": (
        ["benchmarks/input_pipeline_floor.py", "{quick}"],
        "input_pipeline_floor.json",
    ),
    "scaled_decode": (["benchmarks/scaled_decode.py", "{quick}"], "scaled_decode.json"),
    "plan_calibration": (
        [
            "-m",
            "tpu_scale.plan",
            "--calibrate",
            "{quick}",
            "--output",
            "{results}/plan_calibration.json",
        ],
        "plan_calibration.json",
    ),
}


def _command(name, quick):
    args, _ = BENCHMARKS[name]
    filled = [a.format(results=RESULTS, quick="--quick" if quick else "") for a in args]
    return [sys.executable] + [a for a in filled if a]


def _tail(text, lines=15):
    return "\n".join(text.strip().splitlines()[-lines:])


def _run(name, quick, timeout):
    """Runs one benchmark; returns its record for all.json."""
    command = _command(name, quick)
    script = command[1]
    record = {
        "command": " ".join(os.path.relpath(c, ROOT) if c.startswith(ROOT) else c for c in command)
    }
    if script != "-m" and not os.path.exists(os.path.join(ROOT, script)):
        return dict(record, status="missing", seconds=0.0, error=f"{script} does not exist yet")
    result_path = os.path.join(RESULTS, BENCHMARKS[name][1])
    start = time.time()
    # A session of its own, so a timeout can stop the benchmark and anything it started, and nothing
    # else.
    proc = subprocess.Popen(
        command,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
        status = "ok" if proc.returncode == 0 else "failed"
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        status = "timeout"
    record.update(
        seconds=round(time.time() - start, 1),
        returncode=proc.returncode,
        stdout_tail=_tail(stdout),
        stderr_tail=_tail(stderr),
    )
    if os.path.exists(result_path) and os.path.getmtime(result_path) >= start:
        with open(result_path) as f:
            try:
                record["results"] = json.load(f)
            except json.JSONDecodeError as e:
                status = "failed" if status == "ok" else status
                record["error"] = f"{os.path.relpath(result_path, ROOT)} is not valid JSON: {e}"
    elif status == "ok":
        status = "no_results"
        record["error"] = f"exited 0 but did not write {os.path.relpath(result_path, ROOT)}"
    record["status"] = status
    return record


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--quick", action="store_true", help="each benchmark's quick mode; 10-minute budget"
    )
    parser.add_argument(
        "--only", nargs="+", choices=list(BENCHMARKS), help="run only these benchmarks"
    )
    parser.add_argument(
        "--budget", type=float, help="seconds for the whole run (default 570 quick, 3600 full)"
    )
    args = parser.parse_args(argv)
    budget = args.budget or (570.0 if args.quick else 3600.0)
    names = args.only or list(BENCHMARKS)
    os.makedirs(RESULTS, exist_ok=True)

    started = time.time()
    records = {}
    for name in names:
        left = budget - (time.time() - started)
        if left < 20:
            records[name] = {
                "status": "skipped",
                "seconds": 0.0,
                "error": f"the {budget:.0f} s budget ran out",
            }
            print(f"[{name}] skipped: budget spent", flush=True)
            continue
        print(f"[{name}] running (up to {left:.0f} s) ...", flush=True)
        records[name] = _run(name, args.quick, left)
        r = records[name]
        print(
            f"[{name}] {r['status']} in {r['seconds']:.0f} s"
            + (f": {r['error']}" if "error" in r else ""),
            flush=True,
        )
        if r["status"] in ("failed", "timeout") and r.get("stderr_tail"):
            print("    " + r["stderr_tail"].replace("\n", "\n    "), flush=True)

    failed = [n for n, r in records.items() if r["status"] != "ok"]
    summary = {
        "started": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(started)),
        "seconds": round(time.time() - started, 1),
        "quick": args.quick,
        "machine": machine_info(),
        "benchmarks": records,
        "plots": sorted(
            os.path.relpath(os.path.join(RESULTS, f), ROOT)
            for f in os.listdir(RESULTS)
            if f.endswith(".png") and os.path.getmtime(os.path.join(RESULTS, f)) >= started
        ),
        "failed": failed,
    }
    out = os.path.join(RESULTS, "all.json")
    with open(out, "w") as f:
        json.dump(summary, f, indent=2)
    print(
        f"\n{len(records) - len(failed)}/{len(records)} benchmarks ok in {summary['seconds']:.0f} "
        "s; "
        f"results in {os.path.relpath(out, ROOT)}"
    )
    for name in failed:
        r = records[name]
        print(f"  NOT OK {name}: {r['status']}" + (f" ({r['error']})" if "error" in r else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
