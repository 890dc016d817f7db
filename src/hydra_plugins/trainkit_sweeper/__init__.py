"""``hydra.sweeper`` of an Optuna sweep that continues when stopped: Hydra's Optuna sweeper with its
study stored in the sweep directory (``trainkit.study``). Hydra takes sweepers from this package
only, and imports every module of it at each start: Optuna is imported once the sweeper is built."""

from typing import Any

try:
    from hydra_plugins.hydra_optuna_sweeper.optuna_sweeper import OptunaSweeper
except ImportError:  # not installed: no Optuna sweeps (Hydra then refuses hparams_search, naming
    # hydra/sweeper=optuna), and no "Error importing ... Plugin is incompatible" at every start
    OptunaSweeper = None

if OptunaSweeper is not None:

    class StoredOptunaSweeper(OptunaSweeper):
        """The plugin's ``OptunaSweeper``, its study in ``<sweep dir>/optuna.db`` (or
        ``storage``), ``n_trials`` the study's total, a stopped trial resumed in its own job
        (trainkit.study)."""

        def __init__(self, **settings: Any) -> None:
            from trainkit.study import StoredStudySweep

            self.sweeper = StoredStudySweep(**settings)
