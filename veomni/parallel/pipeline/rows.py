"""Pipeline micro-batches: packed rows joined, padded to a fixed length, or made empty.

What a row holds is the task's batch contract (``veomni.tasks``). A pipeline micro-batch is one
packed row (``pack_rows`` joins loader rows) padded to a fixed length (``pad_row``): the
schedule's point-to-point buffers are sized once, from the first micro-batch, so every
micro-batch must send the same shape. Padding sits after ``cu_seqlens[-1]`` (attention gives it
zero output) and carries the contract's pad values (labels: no target).
"""

from __future__ import annotations

from typing import Any

import torch

from veomni.contract.media import join_media
from veomni.tasks.base import BatchContract


def pack_rows(rows: list[dict[str, Any]], contract: BatchContract) -> dict[str, Any]:
    """Join packed rows into one (sequence fields concatenated, sample boundaries and media
    positions shifted); ``[rows[0]]`` is returned as is."""
    if len(rows) == 1:
        return rows[0]
    out = {k: torch.cat([r[k] for r in rows]) for k in contract.sequence_fields}
    out.update({k: v for k, v in rows[0].items() if k not in out and k not in ("cu_seqlens", "max_seqlen")})
    offsets, total = [], 0
    for row in rows:
        offsets.append(total)
        total += contract.row_length(row)
    if contract.media:
        out[contract.media] = join_media([r.get(contract.media) for r in rows], offsets)
    if "cu_seqlens" in rows[0]:
        out["cu_seqlens"] = torch.cat([rows[0]["cu_seqlens"]] + [r["cu_seqlens"][1:] + o
                                                                 for r, o in zip(rows[1:], offsets[1:])])
        out["max_seqlen"] = max(int(r["max_seqlen"]) for r in rows)
    return out


def pad_row(row: dict[str, Any], length: int, contract: BatchContract) -> dict[str, Any]:
    """Pad a packed row to ``length`` with the contract's pad values after its last sample; its
    ``valid_tokens`` counts the real rows (MoE layers route only those)."""
    n = contract.row_length(row)
    row = {**row, "valid_tokens": row.get("valid_tokens", n)}
    if n > length:
        raise ValueError(f"a pipeline micro-batch of {n} {contract.unit}s exceeds its fixed size {length}; "
                         "raise data.tokens_per_micro_batch")
    if n == length:
        return row
    pad = length - n
    for key in contract.sequence_fields:
        value = row[key]
        row[key] = torch.cat([value, value.new_full((pad, *value.shape[1:]), contract.pad_value(key))])
    return row


def empty_row(template: dict[str, Any], contract: BatchContract) -> dict[str, Any]:
    """A row without loss units, shaped like ``template``: one element of pad values per sequence
    field (padding once padded); it fills a short group of eval rows, and attention kernels
    want at least one sample."""
    row = {k: template[k][:1].clone().fill_(contract.pad_value(k)) for k in contract.sequence_fields}
    if "cu_seqlens" in template:
        row["cu_seqlens"] = torch.tensor([0, 1], dtype=torch.int32, device=template["cu_seqlens"].device)
        row["max_seqlen"] = 1
    return row
