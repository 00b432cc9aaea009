"""Reading a run's TensorBoard event files back, as a user's TensorBoard would: the tests' view of what a run
logged."""
from __future__ import annotations


def tensorboard_scalars(logdir: str) -> dict[str, list[float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(logdir)
    acc.Reload()
    return {tag: [e.value for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def tensorboard_steps(logdir: str) -> dict[str, list[tuple[int, float]]]:
    """(step, value) of every scalar; a step logged again by a resumed run keeps its last value."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(logdir)
    acc.Reload()
    return {tag: sorted({e.step: e.value for e in acc.Scalars(tag)}.items()) for tag in acc.Tags()["scalars"]}
