"""What a policy module keeps in a checkpoint beyond weights and optimizer state, and the checks a resume makes.

``checkpoint["logra_pl"]`` holds the format, the update method's kind and class path, the baseline, the verifier's
counts (and its own state when it keeps one: ``verifier_state``), the failing updates in a row, the guard's rejection
counts, the module's settings, the CLI's resolved config, each logger's run (its id: what a resume continues,
:mod:`logra_pl.runs.stores`) and — with a KL penalty — the reference policy's source and digest (not its weights: it
is rebuilt on resume and must match, :mod:`logra_pl.train.reference`). A checkpoint written under structurally
different settings (another method, LoGRA rank, loss, data…) is refused with the list of differences
(:mod:`logra_pl.runs.resume`).
"""

from __future__ import annotations

from typing import Any

from logra_pl import methods
from logra_pl.config import class_path_of
from logra_pl.errors import ResumeMismatchError
from logra_pl.runs import resume, stores
from logra_pl.runtime import compat

CHECKPOINT_FORMAT = "logra-pl/module/v2"


def module_state(module: Any) -> dict[str, Any]:
    """The module's own state, for ``checkpoint["logra_pl"]``."""
    state = {
        "format": CHECKPOINT_FORMAT,
        "optimizer": module.method.name,
        "method": class_path_of(module.method),  # the class that wrote it (a resume under another one is refused)
        "baseline": module.baseline.state_dict(),
        "verifier_errors": module.scorer.errors,
        "scoring": module.scorer.state_dict(),
        **module.rejections.state_dict(),
        **module.failures.state_dict(),
        "settings": resume.plain(module.hparams),
        "run_config": module.run_config,  # the CLI's resolved config (None outside the CLI)
        "loggers": stores.records(compat.trainer_of(module)),  # each logger's run, for --ckpt_path last
    }
    if callable(getattr(module.verifier, "state_dict", None)):  # e.g. a reward model's running normalisation
        state["verifier_state"] = module.verifier.state_dict()
    env = getattr(module, "env", None)
    if callable(getattr(env, "state_dict", None)):  # e.g. a multi-turn environment's tool counters
        state["env_state"] = env.state_dict()
    reference = getattr(module, "reference_policy", None)
    if reference is not None:
        state["reference"] = reference.state_dict()
    return state


def restore_module_state(module: Any, checkpoint: dict[str, Any]) -> None:
    """Refuse a structurally different checkpoint; otherwise restore what :func:`module_state` saved."""
    state = checkpoint.get("logra_pl") or {}
    trainer = compat.trainer_of(module)
    hint = getattr(trainer, "ckpt_path", None) if trainer is not None else None
    saved_kind = methods.checkpoint_kind(checkpoint)
    if saved_kind is not None and not methods.same_method(saved_kind, module.method):
        now = class_path_of(module.method) if "." in saved_kind else module.method.name
        raise ResumeMismatchError(resume.mismatch_message([("model.method", saved_kind, now)], hint))
    saved = state.get("settings") or checkpoint.get("hyper_parameters")
    if saved is not None and not module.resume_checked:  # the CLI already compared (and printed the changes)
        resume.check_resume({"model": saved}, {"model": module.hparams}, hint)
    if state:
        module.baseline.load_state_dict(state["baseline"])
        module.scorer.errors = int(state.get("verifier_errors", 0))
        if "scoring" in state:
            module.scorer.load_state_dict(state["scoring"])
        module.rejections.load_state_dict(state)
        module.failures.load_state_dict(state)
        if "verifier_state" in state and callable(getattr(module.verifier, "load_state_dict", None)):
            module.verifier.load_state_dict(state["verifier_state"])
        env = getattr(module, "env", None)
        if "env_state" in state and callable(getattr(env, "load_state_dict", None)):
            env.load_state_dict(state["env_state"])
    reference = getattr(module, "reference_policy", None)
    if reference is not None and "reference" in state:
        reference.check(state["reference"], hint)
