"""The console's first lines wait for the run to be set up (``console.held_until_accepted``)."""

from lightning.pytorch import Callback

from trainkit.console import run_started


class RunAccepted(Callback):
    """Shows the console's held lines, the run's directory first, once the stage starts: its
    data prepared and set up, its model built and wrapped, where a missing dataset or a module a
    strategy cannot run is refused (and its directory removed) with no line but the refusal."""

    def on_fit_start(self, trainer, pl_module) -> None:
        run_started()

    def on_validation_start(self, trainer, pl_module) -> None:
        run_started()

    def on_test_start(self, trainer, pl_module) -> None:
        run_started()

    def on_predict_start(self, trainer, pl_module) -> None:
        run_started()
