"""Composing the project's Hydra configs outside ``@hydra.main`` (benchmark, tests, notebooks)."""

from collections.abc import Sequence
from pathlib import Path

from hydra import compose, initialize_config_dir
from omegaconf import DictConfig

import trainkit.resolvers  # noqa: F401  registers the resolvers that conf/ uses

ROOT_DIR = Path(__file__).resolve().parents[2]
CONF_DIR = ROOT_DIR / "conf"


def compose_config(
    config_name: str, output_dir: str | Path, overrides: Sequence[str] = ()
) -> DictConfig:
    """The config ``python <config_name>.py <overrides>`` would run with, writing to ``output_dir``.

    Outside ``@hydra.main`` there is no ``hydra:runtime``, so the paths it feeds are given here.
    """
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose(
            config_name,
            overrides=[
                f"paths.root_dir='{ROOT_DIR}'",
                f"paths.output_dir='{Path(output_dir).resolve()}'",
                *overrides,
            ],
        )
