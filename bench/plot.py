"""The results plot: samples/s and data stall per epoch, one line per variant."""

from __future__ import annotations

from pathlib import Path


def draw(results: dict, path: Path) -> bool:
    """Write the PNG; False when there is nothing to draw."""
    import matplotlib

    matplotlib.use("Agg")  # no display on a benchmark machine
    import matplotlib.pyplot as plt

    measured = [v for v in results["variants"] if v["epochs"]]
    if not measured:
        return False
    settings = results["settings"]
    fig, (speed, stall) = plt.subplots(1, 2, figsize=(13, 5.5))
    colors = plt.get_cmap("tab20").colors  # more variants than the default cycle has colors
    for i, v in enumerate(measured):
        epochs = [e["epoch"] for e in v["epochs"]]
        # Dashed: cachefs without hints; solid: everything else.
        style = "-" if v["hints"] or v["kind"] != "cachefs" else "--"
        color = colors[(2 * i) % len(colors) + (2 * i) // len(colors)]
        speed.plot(epochs, [e["samples_per_second"] for e in v["epochs"]], style, marker="o",
                   color=color, label=v["variant"])
        # Without the step, a loop does nothing but wait: stall is shown for paced epochs only.
        paced = [e for e in v["epochs"] if e["paced"]]
        stall.plot([e["epoch"] for e in paced], [100 * e["stall_fraction"] for e in paced], style,
                   marker="o", color=color, label=v["variant"])
    speed.axhline(settings["pace"], color="grey", linestyle=":", label="pace")
    speed.set(xlabel="epoch", ylabel="samples/s", title="Training throughput", yscale="log")
    stall.axhline(5, color="grey", linestyle=":", label="5 % stall")
    stall.set(xlabel="epoch", ylabel="% of the epoch blocked on data", title="Data stall",
              ylim=(0, 100))
    if settings["unpaced_epochs"]:
        for axis in (speed,):
            axis.axvspan(settings["epochs"] + 0.5, settings["epochs"] + settings["unpaced_epochs"]
                         + 0.5, color="grey", alpha=0.12, label="unpaced")
    speed.set_xticks(range(1, settings["epochs"] + settings["unpaced_epochs"] + 1))
    stall.set_xticks(range(1, settings["epochs"] + 1))
    for axis in (speed, stall):
        axis.grid(alpha=0.3)
    if settings["unpaced_epochs"]:
        speed.legend(handles=speed.patches[:1], fontsize=8, loc="upper left")
    stall.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.0, 0.5))
    machine = results["machine"]
    fig.suptitle(f"{results['dataset']['name']}, {settings['profile']} remote, batch "
                 f"{settings['batch']}, {settings['workers']} workers, pace {settings['pace']:.0f}"
                 f" samples/s; {machine['cores']} cores ({machine['cpu']}), {machine['date']}",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
