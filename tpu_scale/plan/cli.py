"""The planner's command line: `python -m tpu_scale.plan --slice v3-2048 --per_core_batch 16`."""

import argparse
import json
import sys

from tpu_scale.plan.catalog import (
    DTYPE_BYTES,
    GPU_TYPES,
    MODELS,
    WRAPAROUND,
    gpu_cluster,
    slice_names,
    tpu_slice,
)
from tpu_scale.plan.report import format_plan, plan
from tpu_scale.plan.update import OPTIMIZERS


def _parser():
    p = argparse.ArgumentParser(
        prog="python -m tpu_scale.plan",
        description="Predict gradient-summation time, input rate and BN group size for a TPU "
        "slice or GPU cluster.",
    )
    hw = p.add_argument_group("hardware (one of --slice, or --hosts with --gpus_per_host)")
    hw.add_argument("--slice", help=f"TPU slice, one of: {', '.join(slice_names())}")
    hw.add_argument("--hosts", type=int, help="GPU hosts")
    hw.add_argument("--gpus_per_host", type=int, help="GPUs per host")
    hw.add_argument(
        "--gpu", default="a100", help=f"GPU type, one of {sorted(GPU_TYPES)} (default a100)"
    )
    hw.add_argument("--alpha_us", type=float, help="per-step latency between nodes, microseconds")
    hw.add_argument(
        "--wraparound",
        default="pod",
        choices=WRAPAROUND,
        help="TPU: 'pod' (only full-pod dimensions wrap: the default assumption) or 'all'",
    )
    g = p.add_argument_group("gradient")
    g.add_argument("--model", help=f"one of {sorted(MODELS)} (default resnet50)")
    g.add_argument("--params", type=int, help="parameter count instead of --model")
    g.add_argument(
        "--dtype", default="float32", help=f"one of {sorted(DTYPE_BYTES)} (default float32)"
    )
    p.add_argument(
        "--per_core_batch", type=int, help="examples per replica: suggests a BN group size"
    )
    p.add_argument(
        "--target_images_per_sec", type=float, help="job target, for the per-host input rate"
    )
    p.add_argument(
        "--optimizer",
        default="lars",
        choices=OPTIMIZERS,
        help="the weight update to price, replicated and sharded (default lars)",
    )
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.add_argument(
        "--plot", metavar="PNG", help="draw predicted time against chip count to this file"
    )
    p.add_argument(
        "--calibrate",
        action="store_true",
        help="fit alpha/beta on this machine's 8 CPU replicas and compare predicted with measured",
    )
    p.add_argument("--repeats", type=int, default=5, help="timing repeats for --calibrate")
    p.add_argument(
        "--quick", action="store_true", help="--calibrate with fewer sizes and 3 repeats"
    )
    p.add_argument(
        "--output", metavar="JSON", help="also write the JSON result (plan or calibration) here"
    )
    return p


def _hardware_from_args(args):
    if args.slice and (args.hosts or args.gpus_per_host):
        raise ValueError("Give either --slice (TPU) or --hosts/--gpus_per_host (GPU), not both.")
    if args.slice:
        return tpu_slice(args.slice, args.alpha_us, args.wraparound)
    if args.hosts or args.gpus_per_host:
        if not (args.hosts and args.gpus_per_host):
            raise ValueError("A GPU cluster needs both --hosts and --gpus_per_host (e.g. --hosts 32 --gpus_per_host 8).")
        return gpu_cluster(args.hosts, args.gpus_per_host, args.gpu, args.alpha_us)
    return tpu_slice("v3-2048", args.alpha_us, args.wraparound)


def main(argv=None):
    args = _parser().parse_args(argv)
    try:
        if args.calibrate:
            # `import tpu_scale` has selected the allocator the training runs with.
            from tpu_scale.plan.calibration import calibrate  # starts TensorFlow

            sizes = (2**12, 2**20, 2**23) if args.quick else (2**12, 2**18, 2**21, 2**23)
            result = calibrate(
                sizes,
                repeats=3 if args.quick else args.repeats,
                model=args.model or "resnet50",
                log=(lambda *a: None) if args.json else print,
            )
            if args.json:
                print(json.dumps(result, indent=2))
        else:
            hardware = _hardware_from_args(args)
            result = plan(
                hardware,
                args.model,
                args.params,
                args.dtype,
                args.per_core_batch,
                args.target_images_per_sec,
                args.optimizer,
            )
            if args.plot:
                from tpu_scale.plan.plot import plot_scaling  # imports matplotlib

                generation = args.slice.split("-")[0] if args.slice else "v3"
                label = f"{result['model']['name']} {args.dtype}"
                result["plot"] = plot_scaling(
                    args.plot,
                    generation,
                    result["model"]["bytes"],
                    label,
                    args.alpha_us,
                    mark=hardware.name,
                )
            print(json.dumps(result, indent=2) if args.json else format_plan(result))
            if args.plot and not args.json:
                print(f"\nplot: {args.plot}")
        if args.output:
            with open(args.output, "w") as f:
                json.dump(result, f, indent=2)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0
