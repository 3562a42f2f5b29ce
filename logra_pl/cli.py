"""``logra-pl``: the LightningCLI entry point (``logra-pl fit --config configs/tiny_cpu.yaml``)."""

from __future__ import annotations

import os
import sys

from lightning.pytorch.cli import LightningCLI

from logra_pl.data import ReasoningGymDataModule
from logra_pl.module import LoGRAPolicyModule
from logra_pl.strategy import LoGRAStrategy  # noqa: F401  (registers `--trainer.strategy logra_fsdp`)

TRAINER_DEFAULTS = {
    "logger": {
        "class_path": "lightning.pytorch.loggers.TensorBoardLogger",
        "init_args": {"save_dir": "runs", "name": "logra"},
    },
    "log_every_n_steps": 1,
    "num_sanity_val_steps": 0,
}


class LoGRACLI(LightningCLI):
    """LightningCLI for :class:`LoGRAPolicyModule` and :class:`ReasoningGymDataModule`.

    TensorBoard logging under ``runs/`` by default; every run saves its resolved ``config.yaml`` next to its
    event files (LightningCLI's ``SaveConfigCallback``).
    """

    def __init__(self, args: list[str] | None = None, run: bool = True) -> None:
        super().__init__(
            LoGRAPolicyModule,
            ReasoningGymDataModule,
            trainer_defaults=TRAINER_DEFAULTS,
            save_config_kwargs={"overwrite": True},
            args=args,
            run=run,
            auto_configure_optimizers=False,
        )


def main(args: list[str] | None = None) -> None:
    """Console-script entry point: LightningCLI subcommands (``fit``, ``validate``) and ``plan`` (memory planner)."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    argv = sys.argv[1:] if args is None else list(args)
    if argv[:1] == ["plan"]:
        from logra_pl.memory import main as plan_main

        plan_main(argv[1:])
        return
    LoGRACLI(args=args)


if __name__ == "__main__":
    main()
