"""Train a model: `python train.py [group=option ...] [key=value ...]`. See conf/train.yaml."""

from trainkit.runtime import imports_frozen

with imports_frozen():  # faster start and exit: runtime.py
    import sys

    import hydra
    from omegaconf import DictConfig

    import trainkit.startup  # noqa: F401  first: before Lightning imports torchmetrics
    from trainkit.config import did_you_mean, expand_shorthands
    from trainkit.console import one_line_refusals
    from trainkit.launch import end_process
    from trainkit.sweep import newest_sweep_named
    from trainkit.train import run


@hydra.main(version_base="1.3", config_path="conf", config_name="train")
def main(cfg: DictConfig) -> float | None:
    return run(cfg)


if __name__ == "__main__":
    # plan=true is plan.show=true; ++ where train.yaml lacks a key; hydra.sweep.dir=last is the
    # newest sweep directory of this command's sweep
    sys.argv = newest_sweep_named(expand_shorthands(sys.argv))
    # a line naming the closest key where Hydra refused an unknown one; a refusal as its line
    with did_you_mean("train"), one_line_refusals():
        main()
    end_process()  # a rank > 0 ends here, without the interpreter's teardown (launch.py)
