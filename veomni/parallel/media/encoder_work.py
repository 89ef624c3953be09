"""The media-encoder work a rank actually ran, priced by the family's own cost model.

Balancing (``assign.py``) places items by their predicted cost; this is the other side,
what each rank's encoders then ran: the check behind the colocation parity tests ("no rank
encoded more than its share") and the imbalance the colocation benchmark reports. One forward
pre-hook per encoder records each real call: an input run whole adds its ``MediaKind.flops``;
a long input run sequence-parallel (``veomni/parallel/media/encoder_sp.py``) adds the fraction of
those FLOPs that its share of the rows is; the dummy input (all zeros, run by a rank with no
item so that it joins the encoder's collectives) adds nothing.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from veomni.contract.media import MediaHost


class EncoderWork:
    """What the watched encoders ran since the last ``reset``: ``whole`` FLOPs of the inputs run
    whole, ``shared`` FLOPs of this rank's shares of inputs run sequence-parallel (prorated by
    rows), and ``share_rows``, the rows of those shares."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.whole, self.shared, self.share_rows = 0.0, 0.0, 0

    @property
    def flops(self) -> float:
        return self.whole + self.shared


def _is_dummy(inputs: dict[str, torch.Tensor]) -> bool:
    return not any(bool(t.abs().sum() > 0) for t in inputs.values() if t.is_floating_point())


def watch_encoder_work(modules: Iterable[nn.Module], modality: str) -> EncoderWork:
    """Hook the ``modality`` encoder of each ``MediaHost`` among ``modules`` (a model, or a
    pipeline's parts: a stage's hollow stand-in, without parameters, is skipped) and return the
    ``EncoderWork`` the hooks add to."""
    work = EncoderWork()
    for module in modules:
        if not isinstance(module, MediaHost) or modality not in module.media_config().encoder_configs:
            continue
        encoder = module.media_encoder(modality)
        if next(encoder.parameters(), None) is None:
            continue
        kind = module.media_config().media_kinds()[modality]

        def record(encoder: nn.Module, args: tuple, kwargs: dict[str, Any], kind: Any = kind) -> None:
            share = kwargs.get("share")
            inputs = {k: v for k, v in kwargs.items() if k != "share"}
            if _is_dummy(inputs):
                return
            flops = kind.flops(encoder, inputs)
            if share is None:
                work.whole += flops
            else:
                rows = share.stop - share.start
                work.share_rows += rows
                work.shared += flops * rows / encoder.sequence_rows(inputs)

        encoder.register_forward_pre_hook(record, with_kwargs=True)
    return work
