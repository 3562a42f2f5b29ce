"""``PackedResponses``: a step's prompt+response rows as one padded batch, the shape every trainer pass reads
(the log-probs, the chunked log-probs, the backward)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class PackedResponses:
    """Prompt+response rows right-padded into one batch, and where each response token sits.

    ``input_ids``/``attention_mask``/``position_ids``: ``(B, T)``; ``response_mask``: ``(B, R)`` with
    ``R = max response length``, 1 at the response tokens the policy sampled (0 where padded, and at tokens an
    environment inserted into a multi-turn response: ``Rollout.response_masks``); ``targets``: the response tokens
    ``(B, R)`` (0 where padded); ``starts[b]``: index in ``input_ids`` of the position whose logits predict response
    token 0.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    position_ids: torch.Tensor
    targets: torch.Tensor
    response_mask: torch.Tensor
    starts: torch.Tensor

    @property
    def lengths(self) -> torch.Tensor:
        """Sampled response tokens per row ``(B,)`` (a multi-turn row's inserted tokens not counted)."""
        return self.response_mask.sum(dim=1)

    @property
    def extents(self) -> torch.Tensor:
        """Response positions per row ``(B,)`` up to and including its last sampled token (``lengths`` for a
        one-turn row; more when an environment inserted tokens before it)."""
        columns = torch.arange(1, self.response_mask.shape[1] + 1, device=self.response_mask.device)
        return (self.response_mask > 0).long().mul(columns).amax(dim=1)

    def to(self, device: torch.device | str) -> PackedResponses:
        """The same batch on ``device``."""
        return PackedResponses(*(getattr(self, f).to(device) for f in self.__dataclass_fields__))
