"""logra-pl: memory-lean full-weight RL post-training of LLMs with LoGRA gradient sketches, on Lightning.

The top level shows the design: :mod:`~logra_pl.module` (the LightningModule: hooks and orchestration),
:mod:`~logra_pl.strategy` (FSDP with sketch hooks), :mod:`~logra_pl.callbacks` (step control, mismatch, sync,
export...) and :mod:`~logra_pl.cli`; every other concept has one wing (``docs/architecture.md`` draws the map).
"""

from logra_pl import _graveyard  # noqa: F401  (old module paths and deprecated names keep resolving)
