"""Whether a comparison's runs converged, judged on their development split, and what the report says of it and of
their time."""

CONVERGENCE_TOLERANCE = 0.01  # a run still improves while its last evaluation lowers the best development loss by more


def converged(development_losses: list[float]) -> bool | None:
    """Whether a run had stopped improving: its last evaluation on the development split did not lower the best
    development loss before it by more than `CONVERGENCE_TOLERANCE` (relative); None with fewer than two
    evaluations."""
    if len(development_losses) < 2:
        return None
    *before, last = development_losses
    return not last < min(before) * (1 - CONVERGENCE_TOLERANCE)


def convergence_sentence(runs: list[dict]) -> str:
    """Whether every run converged, or how many were still improving (a budget of training was compared)."""
    still = [run for run in runs if run.get("converged") is False]
    if any(run.get("converged") is None for run in runs):
        return "Runs without a development split are not judged for convergence."
    if still:
        return (
            f"**{len(still)} of {len(runs)} runs were still improving** at their last evaluation (their development "
            "loss fell by more than 1% there): this compared a budget of training, not converged runs."
        )
    return (
        "Every run had converged: its last evaluation on the development split lowered the best development loss by "
        "1% or less."
    )


def time_sentence(runs: list[dict]) -> str:
    """A run's mean time and its parts (empty for runs that did not record it)."""
    timed = [run["seconds"] for run in runs if run.get("seconds")]
    if not timed:
        return ""
    mean = {part: sum(t[part] for t in timed) / len(timed) for part in timed[0]}
    return (
        f"A run took {sum(mean.values()) - mean['development']:.1f} s on average: building the model "
        f"{mean['build']:.1f} s, training {mean['train']:.1f} s (development evaluations {mean['development']:.1f} s "
        f"of it), the final evaluation {mean['evaluation']:.1f} s."
    )
