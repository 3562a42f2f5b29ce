"""The reference policy ``π_ref`` of the KL penalty: the policy as RL starts, frozen, kept without doubling memory.

``π_ref`` is the initial policy: the weights when RL starts, after the supervised warm start. The module loads it from
the same folder the policy was loaded from (the warm-started copy, or the base policy), in ``loss.reference_dtype``
(the policy's dtype by default; ``bfloat16`` halves an fp32 copy), and keeps it where ``loss.reference_device`` says:

- ``cpu`` (default): the weights live in host memory. On a CPU run the forward runs there; on an accelerator
  ``accelerate.cpu_offload`` streams each module's weights to the policy's device for its forward and drops them
  after, so the accelerator holds about one layer of the reference at a time.
- ``same``: the weights live on the policy's device (fastest forward; one more copy there). Under the ``logra_fsdp``
  strategy the copy is sharded like the policy (:meth:`LoGRAStrategy.shard_reference`), so a rank holds ``1/N``.

Its log-probs are computed once per rollout, without grad, in the same microbatches as the pre-update trainer
log-probs (:class:`~logra_pl.train.passes.TrainerPasses`); the loss never runs a second forward of it. Only a run that
trains loads it (``logra-pl validate`` of the same config does not).

**Resume.** The reference is not saved in checkpoints: a checkpoint would carry a second full model (LoGRA's
checkpoints otherwise hold one copy of the weights and small optimizer state). It is rebuilt from the run's source —
the warm start is cached by its settings and rebuilt deterministically when the cache is gone — and the checkpoint
keeps its digest (:func:`weights_digest`). A resume whose rebuilt reference differs from the one the run started
with is refused (:class:`~logra_pl.errors.ResumeMismatchError`), so a resumed run penalises the KL to exactly the
same policy or does not run.
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch
from torch import nn

from logra_pl.errors import ResumeMismatchError
from logra_pl.runtime.dtypes import DTYPES
from logra_pl.sketch.memory import local_state_bytes
from logra_pl.train.logprobs import PackedResponses, response_logprobs


def weights_digest(model: nn.Module) -> str:
    """32 hex digits over every tensor of ``model``'s state dict (names, dtypes, shapes and bytes, in name order)."""
    h = hashlib.blake2b(digest_size=16)
    for name, tensor in sorted(model.state_dict().items()):
        t = tensor.detach().cpu().contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


class ReferencePolicy:
    """A frozen copy of the initial policy and how it is kept (see the module docstring).

    Arguments:
        model: the loaded causal LM (frozen here: no grad, eval mode).
        source: the folder (or name) it was loaded from: the policy as RL starts.
        dtype_name: its dtype, as a name (``float32``, ``bfloat16``...).
        placement: ``cpu`` or ``same`` (``loss.reference_device``).
    """

    def __init__(self, model: nn.Module, source: str, dtype_name: str, placement: str) -> None:
        model.requires_grad_(False)
        model.eval()
        self.model = model
        self.source = source
        self.dtype_name = dtype_name
        self.placement = placement
        self.digest = weights_digest(model)
        self.nbytes = local_state_bytes(model)  # this process's bytes (the strategy recounts a sharded copy)
        self.sharded = False  # set by the strategy that shards it
        self.streamed_to: torch.device | None = None  # the execution device of a streamed (cpu) copy
        self._placed = False

    @classmethod
    def load(
        cls, source: str, dtype_name: str, placement: str, attn_implementation: str | None = None
    ) -> ReferencePolicy:
        """Load ``source`` (a folder, or any name :func:`~logra_pl.models.load.load_policy` takes) as the reference."""
        from logra_pl.models.load import load_policy

        model, _ = load_policy(source, dtype=DTYPES[dtype_name], attn_implementation=attn_implementation)
        return cls(model, source, dtype_name, placement)

    @classmethod
    def of_loss(
        cls, loss: Any, source: str, dtype_name: str, attn_implementation: str | None = None
    ) -> ReferencePolicy:
        """The reference a loss's KL penalty asks for: ``source`` in ``loss.shared.reference_dtype`` (None: the
        policy's ``dtype_name``), placed where ``loss.shared.reference_device`` says."""
        shared = loss.shared
        return cls.load(source, shared.reference_dtype or dtype_name, shared.reference_device, attn_implementation)

    # ------------------------------------------------------------------------------------------- placement
    def place(self, device: torch.device) -> None:
        """Make the forward run on ``device`` (once): ``same`` moves the weights there; ``cpu`` keeps them in host
        memory and, for an accelerator, streams them per module (:meth:`stream`). A sharded copy is in place."""
        if self._placed or self.sharded:
            self._placed = True
            return
        if self.placement == "same":
            self.model.to(device)
        elif torch.device(device).type != "cpu":
            self.stream(torch.device(device))
        self._placed = True

    def stream(self, device: torch.device) -> None:
        """Keep the weights in host memory and move each module's to ``device`` only for its forward
        (``accelerate.cpu_offload``: one host copy of the state dict, hooks that load and drop it per module)."""
        from accelerate import cpu_offload

        cpu_offload(self.model, execution_device=device)
        self.streamed_to = device

    @property
    def device(self) -> torch.device:
        """Where the forward's inputs must be."""
        if self.streamed_to is not None:
            return self.streamed_to
        return next(iter(self.model.parameters())).device

    # --------------------------------------------------------------------------------------------- scoring
    @torch.no_grad()
    def logprobs(self, packed: PackedResponses, temperature: float) -> torch.Tensor:
        """``log π_ref`` of each response token of one microbatch, on the CPU: ``(B, R)``, zero where padded."""
        return response_logprobs(self.model, packed.to(self.device), temperature).float().cpu()

    # -------------------------------------------------------------------------------------------- resumes
    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps of the reference: where it came from, its dtype and its digest (not weights)."""
        return {"source": self.source, "dtype": self.dtype_name, "digest": self.digest}

    def check(self, saved: dict[str, Any], hint: str | None = None) -> None:
        """Refuse a resume whose rebuilt reference is not the one the run started with."""
        if saved.get("digest") == self.digest:
            return
        where = f" (checkpoint {hint})" if hint else ""
        raise ResumeMismatchError(
            f"the KL penalty's reference policy rebuilt from {self.source!r} ({self.dtype_name}) is not the one this "
            f"run started with{where}: digest {self.digest} here, {saved.get('digest')} in the checkpoint (source "
            f"{saved.get('source')!r}, {saved.get('dtype')}). The warm start or base policy it is rebuilt from has "
            "changed (a rebuilt cache, another model revision or reference_dtype). Restore that folder, or start a "
            "new run (without --ckpt_path) to take the current weights as the reference"
        )
