"""The scaling plot: predicted gradient-sum time against chip count (matplotlib is imported only
here)."""

from tpu_scale.plan.catalog import TPU_GENERATIONS, gradient_bytes, slice_names, tpu_slice
from tpu_scale.plan.cost import price_algorithms
from tpu_scale.torus import schedule as torus_schedule


def scaling_series(generation="v3", num_bytes=None, alpha_us=None, wraparound="pod"):
    """Predicted seconds per algorithm for every slice of a TPU generation.

    Returns:
      dict: `chips` (list) and `{algorithm: [seconds]}` under `seconds`, plus `slices`.
    """
    if num_bytes is None:
        num_bytes = gradient_bytes("resnet50")[1]
    if generation not in TPU_GENERATIONS:
        raise ValueError(
            f"Unknown TPU generation {generation!r}; choose one of {sorted(TPU_GENERATIONS)}."
        )
    names = slice_names(generation)
    clusters = [tpu_slice(n, alpha_us, wraparound) for n in names]
    prices = [price_algorithms(c, num_bytes) for c in clusters]
    return {
        "slices": names,
        "chips": [c.num_nodes for c in clusters],
        "seconds": {a: [p[a]["seconds"] for p in prices] for a in torus_schedule.ALGORITHMS},
        "steps": {a: [p[a]["steps"] for p in prices] for a in torus_schedule.ALGORITHMS},
    }


def plot_scaling(
    path, generation="v3", num_bytes=None, label="ResNet-50 float32", alpha_us=None, mark=None
):
    """Draws predicted gradient-summation time against chip count for each algorithm (log-log), to
    `path`.

    Solid lines use the default wrap-around assumption; thin dashed lines take every slice as a full
    torus, so the plot shows what that assumption is worth.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, LogLocator

    pod = scaling_series(generation, num_bytes, alpha_us, "pod")
    full = scaling_series(generation, num_bytes, alpha_us, "all")
    fig, ax = plt.subplots(figsize=(8, 5), dpi=120)
    styles = {
        "ring": ("tab:red", "o"),
        "torus_2d": ("tab:blue", "s"),
        "torus_2d_bidirectional": ("tab:green", "^"),
        "flat": ("tab:gray", "x"),
    }
    for alg in torus_schedule.ALGORITHMS:
        color, marker = styles[alg]
        ax.plot(
            pod["chips"],
            [s * 1e3 for s in pod["seconds"][alg]],
            marker=marker,
            color=color,
            label=alg,
        )
        ax.plot(
            full["chips"],
            [s * 1e3 for s in full["seconds"][alg]],
            linestyle="--",
            linewidth=1,
            color=color,
            alpha=0.6,
        )
    ax.plot(
        [], [], linestyle="--", linewidth=1, color="gray", label="same, every slice a full torus"
    )
    if mark in pod["slices"]:
        ax.axvline(
            pod["chips"][pod["slices"].index(mark)], color="gray", linestyle=":", linewidth=1
        )
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(pod["chips"])
    ax.set_xticklabels([f"{c}\n{n}" for c, n in zip(pod["chips"], pod["slices"])], fontsize=8)
    ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    ax.yaxis.set_minor_locator(
        LogLocator(base=10, subs=(1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0))
    )
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax.yaxis.set_minor_formatter(FuncFormatter(lambda v, _: ""))
    ax.set_xlabel(f"TPU {generation} chips (slice)")
    ax.set_ylabel("predicted gradient summation (ms)")
    ax.set_title(f"Predicted gradient summation per step, {label}, TPU {generation}")
    ax.grid(True, which="major", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
