"""Evaluate a checkpoint: `python eval.py ckpt_path=...`. The checkpoint carries its own config."""

from trainkit.runtime import collector_resumed, imports_frozen

with imports_frozen():  # faster start and exit: runtime.py
    import sys

    import hydra
    from omegaconf import DictConfig

    import trainkit.startup  # first: before anything imports torchmetrics
    from trainkit.config import command_line, did_you_mean
    from trainkit.console import one_line_refusals

    # torch and Lightning load once Hydra has composed the run (as train.py: a typo is refused in
    # a second); a rank that ddp_spawn starts imports this file as a module, then runs its job
    if __name__ != "__main__":
        import trainkit.evaluate  # noqa: F401


@hydra.main(version_base="1.3", config_path="conf", config_name="eval")
def main(cfg: DictConfig) -> None:
    from trainkit.evaluate import run

    collector_resumed()  # paused below, through Hydra's start and these imports
    run(cfg)


if __name__ == "__main__":
    sys.argv = command_line(sys.argv, "eval")  # a library key an older eval.yaml lacks: ++
    # a line naming the closest key where Hydra refused an unknown one; a refusal as its line
    with imports_frozen(), did_you_mean("eval"), one_line_refusals():
        main()
    if "trainkit.evaluate" in sys.modules:  # a job ran (not --help, --cfg or shell completion)
        from trainkit.launch import end_process

        end_process()  # a rank > 0 ends here, without the interpreter's teardown (launch.py)
