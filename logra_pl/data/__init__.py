"""LightningDataModules of prompts for RL, all emitting one item schema.

Every data module yields items (plain dicts) with:

- ``messages``: the chat the policy sees, a list of ``{"role": str, "content": str}``: an optional system message
  first, then at least one user message;
- ``answer``: the gold answer as a string (``""`` for reasoning-gym tasks without a single gold answer, whose scorers
  read ``metadata``);
- ``task``: the task or source name (reasoning-gym task, ``dapo_math``, ``math500``, file stem, hub id);
- ``id``: a stable string, unique within a split (``f"{task}/{index}"``);
- ``metadata``: a free dict (the source's other fields).

Modules may keep keys of their own: reasoning-gym items keep reasoning-gym's ``question``, ``answer`` and
``metadata`` (``source_dataset``, ``source_index``, …) unchanged, because its scorers read the whole entry;
:class:`HFPromptDataModule` items carry ``question`` (the prompt key). :func:`prompt_key` (the first user message's
content) is the key of dedup, train/eval disjointness and per-prompt sampling seeds. :func:`make_item` builds an
item, :func:`validate_item` checks one (a :class:`~logra_pl.errors.ConfigError` names the missing or ill-typed key).

Modules: :class:`ReasoningGymDataModule` (weighted reasoning-gym task mixtures), :class:`HFPromptDataModule` (any
Hugging Face dataset or local parquet / jsonl / json / csv / arrow file or folder) and its paper recipes
:class:`DapoMath7_5kDataModule` and :class:`Math500DataModule` (:mod:`logra_pl.data.recipes` states their exact rules).
"""

from logra_pl.data.hf import HFPromptDataModule
from logra_pl.data.reasoning_gym import ReasoningGymDataModule
from logra_pl.data.recipes import DapoMath7_5kDataModule, Math500DataModule, dapo_math_7_5k, math500
from logra_pl.data.schema import item_task, make_item, prompt_key, validate_item

__all__ = [
    "DapoMath7_5kDataModule",
    "HFPromptDataModule",
    "Math500DataModule",
    "ReasoningGymDataModule",
    "dapo_math_7_5k",
    "item_task",
    "make_item",
    "math500",
    "prompt_key",
    "validate_item",
]
