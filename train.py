"""Train a model: `python train.py [group=option ...] [key=value ...]`. See conf/train.yaml."""

import hydra
from omegaconf import DictConfig

import trainkit.startup  # noqa: F401  first: before Lightning imports torchmetrics
from trainkit.runtime import freeze_imports
from trainkit.train import run


@hydra.main(version_base="1.3", config_path="conf", config_name="train")
def main(cfg: DictConfig) -> float | None:
    return run(cfg)


if __name__ == "__main__":
    freeze_imports()
    main()
