"""Train a model: `python train.py [group=option ...] [key=value ...]`. See conf/train.yaml."""

from trainkit.runtime import collector_resumed, imports_frozen

with imports_frozen():  # faster start and exit: runtime.py
    import sys

    import hydra
    from omegaconf import DictConfig

    import trainkit.startup  # first: before anything imports torchmetrics
    from trainkit.config import LAST_SWEEP, command_line, did_you_mean
    from trainkit.console import one_line_refusals

    # torch and Lightning load once Hydra has composed the run (a typo is refused in a second);
    # a rank that ddp_spawn starts imports this file as a module, then runs its job
    if __name__ != "__main__":
        import trainkit.train  # noqa: F401


@hydra.main(version_base="1.3", config_path="conf", config_name="train")
def main(cfg: DictConfig) -> float | None:
    from trainkit.train import run

    collector_resumed()  # paused below, through Hydra's start and these imports
    return run(cfg)


if __name__ == "__main__":
    sys.argv = command_line(sys.argv)  # ++ where train.yaml lacks a key; plan=true; -m first
    if LAST_SWEEP in sys.argv:  # the newest directory of this command's sweep
        from trainkit.sweep import newest_sweep_named

        sys.argv = newest_sweep_named(sys.argv)
    # a line naming the closest key where Hydra refused an unknown one; a refusal as its line
    with imports_frozen(), did_you_mean("train"), one_line_refusals():
        main()
    if "trainkit.train" in sys.modules:  # a job ran (not --help, --cfg or shell completion)
        from trainkit.launch import end_process

        end_process()  # a rank > 0 ends here, without the interpreter's teardown (launch.py)
