"""No host-device synchronisation per training step in the default recipe: between logging
intervals, nothing reads a tensor's value on the host (``helpers.TensorReads`` counts the reads
per step in a real run), so on a GPU the template's per-step work overlaps the kernels. The GPU
version, with CUDA's sync debug mode: e2e/test_gpu.py."""

import json

LOG_EVERY = 10


def reads_per_step(run_here, overrides, *extra: str) -> dict[int, int]:
    run_dir = run_here(
        "train.py", *overrides, "trainer.max_epochs=1", "data.batch_size=16",
        f"trainer.log_every_n_steps={LOG_EVERY}", "+callbacks.reads._target_=helpers.TensorReads",
        *extra,
    )  # fmt: skip
    return {int(k): v for k, v in json.loads((run_dir / "reads.json").read_text()).items()}


def between_logging(reads: dict[int, int], steps: int) -> dict[int, int]:
    """The reads at steps that are neither a logging step, nor next to one, nor the epoch's last."""
    quiet = [s for s in range(1, steps - 1) if min(s % LOG_EVERY, -s % LOG_EVERY) > 1]
    assert len(quiet) > steps // 2
    return {s: reads.get(s, 0) for s in quiet}


def test_the_default_recipe_reads_no_tensor_between_logging_steps(
    run_here, overrides: tuple[str, ...]
) -> None:
    reads = reads_per_step(run_here, overrides)
    assert sum(reads.values()) > 0  # the logging steps and the epoch's end do read
    assert set(between_logging(reads, 50).values()) == {0}, reads


def test_a_step_path_that_reads_every_step_is_caught(run_here, overrides: tuple[str, ...]) -> None:
    reads = reads_per_step(run_here, overrides, "+callbacks.reads.every_step=true")
    assert all(count >= 1 for count in between_logging(reads, 50).values()), reads
