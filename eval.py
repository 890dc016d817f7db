"""Evaluate a checkpoint: `python eval.py ckpt_path=...`. The checkpoint carries its own config."""

from trainkit.runtime import imports_frozen

with imports_frozen():  # faster start and exit: runtime.py
    import sys

    import hydra
    from omegaconf import DictConfig

    import trainkit.startup  # noqa: F401  first: before Lightning imports torchmetrics
    from trainkit.config import did_you_mean, expand_shorthands
    from trainkit.console import one_line_refusals
    from trainkit.evaluate import run
    from trainkit.launch import end_process


@hydra.main(version_base="1.3", config_path="conf", config_name="eval")
def main(cfg: DictConfig) -> None:
    run(cfg)


if __name__ == "__main__":
    sys.argv = expand_shorthands(sys.argv, "eval")  # a library key an older eval.yaml lacks: ++
    # a line naming the closest key where Hydra refused an unknown one; a refusal as its line
    with did_you_mean("eval"), one_line_refusals():
        main()
    end_process()  # a rank > 0 ends here, without the interpreter's teardown (launch.py)
