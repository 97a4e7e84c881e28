"""A ragged batch over one Hugging Face KV cache: holes instead of per-row lengths.

Requests in a batch draft and accept different numbers of tokens, but a Hugging Face cache has one
length for the whole batch. Here every forward appends the same number of slots to every row; each
row keeps a boolean mask of which slots hold its real, kept tokens. Rejected or padding slots are
masked out for good (never attended again), positions are passed explicitly (a row's position is
the count of its valid slots), and `compact` gathers the valid slots once holes dominate, so memory
tracks the longest current request rather than everything ever drafted.

This module owns cache bookkeeping only: it knows nothing of sampling or requests.
"""

from __future__ import annotations

import inspect
from typing import Sequence

import torch
from transformers import DynamicCache


class RaggedKV:
    """Rows of a batch over one `DynamicCache` of full-attention layers."""

    def __init__(self, model: torch.nn.Module, compact_slack: int = 32, compact_ratio: float = 1.5):
        self.model = model
        self.cache: DynamicCache | None = None
        self.valid = torch.zeros(0, 0, dtype=torch.bool)  # [rows, slots]
        self.compact_slack = compact_slack
        self.compact_ratio = compact_ratio
        parameters = inspect.signature(model.forward).parameters
        # transformers 5.2x renamed `past_key_values` to `cache`; accept either.
        self._cache_arg = "cache" if "cache" in parameters else "past_key_values"
        self._takes_logits_to_keep = "logits_to_keep" in parameters
        self.attention_window = attention_window(model.config)

    # --- shape -------------------------------------------------------------------------------
    @property
    def num_rows(self) -> int:
        return self.valid.shape[0]

    @property
    def num_slots(self) -> int:
        return self.valid.shape[1]

    @property
    def lengths(self) -> torch.Tensor:
        """[rows] long: tokens each row holds, which is also its next position id."""
        return self.valid.sum(dim=1)

    # --- forward -----------------------------------------------------------------------------
    @torch.no_grad()
    def forward(
        self,
        blocks: Sequence[Sequence[int]] | torch.Tensor,
        logits_to_keep: int = 0,
        real: torch.Tensor | None = None,  # [rows, T] bool with a dense block: False = padding (a hole from the start)
    ) -> torch.Tensor:
        """Feed each row its own tokens and cache them.

        `blocks` is one token list per row (ragged: left-padded into one block) or a dense
        [rows, T] tensor, optionally with a `real` mask. A new batch (no rows yet) takes one row
        per block. Returns logits [rows, T', vocab] for the block's last T' columns
        (T' = `logits_to_keep`, or the whole block when 0).

        Atomic: if the model raises, the bookkeeping is as before the call. Slot indices may
        change inside (a sliding-window model compacts first), so callers roll back with
        `truncate(lengths)`, never with slot indices.
        """
        rows = self.num_rows or len(blocks)
        assert len(blocks) == rows, (len(blocks), rows)
        if isinstance(blocks, torch.Tensor):
            input_ids = blocks.long().cpu()
            real = torch.ones_like(input_ids, dtype=torch.bool) if real is None else real.bool().cpu()
        else:
            input_ids, real = _left_pad_block(blocks)
        valid = self.valid if self.num_rows else torch.zeros(rows, 0, dtype=torch.bool)
        if self.attention_window and valid.shape[1] + input_ids.shape[1] > self.attention_window:
            self.compact()  # sliding layers window over slots, so keep slots within the window
            valid = self.valid
            if valid.shape[1] + input_ids.shape[1] > self.attention_window:
                raise RuntimeError(f"a row outgrew the model's attention window of {self.attention_window} tokens")
        device = self._device()
        # A row's position is the count of its valid slots. Padding slots are masked, so their
        # position is immaterial: 0 keeps it inside any position table.
        lengths = valid.sum(dim=1)
        position_ids = torch.where(real, lengths[:, None] + real.long().cumsum(dim=1) - 1, 0)
        new_valid = torch.cat([valid, real], dim=1)
        cache = self.cache if self.cache is not None else DynamicCache()
        kwargs = {self._cache_arg: cache}
        if self._takes_logits_to_keep:
            kwargs["logits_to_keep"] = logits_to_keep
        slots = [_width(layer) for layer in cache.layers]
        try:
            out = self.model(
                input_ids=input_ids.to(device),
                attention_mask=new_valid.long().to(device),
                position_ids=position_ids.to(device),
                use_cache=True,
                **kwargs,
            )
        except BaseException:
            _crop_layers(cache, slots)  # layers the failed call already extended
            raise
        self.cache, self.valid = cache, new_valid
        logits = out.logits
        return logits if self._takes_logits_to_keep or not logits_to_keep else logits[:, -logits_to_keep:]

    # --- bookkeeping -------------------------------------------------------------------------
    def truncate(self, lengths: torch.Tensor) -> None:
        """Row i keeps its first lengths[i] valid slots; later ones become holes.

        Counting valid slots rather than slot indices makes a rollback correct even when a
        forward compacted the cache in between (sliding-window models do)."""
        rank = self.valid.long().cumsum(dim=1)  # 1-based rank of each valid slot in its row
        self.valid = self.valid & (rank <= lengths.cpu()[:, None])
        self._maybe_compact()

    def select_rows(self, rows: Sequence[int]) -> None:
        index = torch.as_tensor(list(rows), dtype=torch.long)
        self.valid = self.valid[index]
        if self.cache is not None:
            device_index = index.to(self._device())
            for layer in self.cache.layers:
                layer.keys = layer.keys[device_index]
                layer.values = layer.values[device_index]
        self._maybe_compact()

    def append_rows(self, other: "RaggedKV") -> None:
        """Add `other`'s rows after ours; the side with fewer slots gets leading holes."""
        if other.num_rows == 0:
            return
        if self.num_rows == 0:
            self.cache, self.valid = other.cache, other.valid
            return
        width = max(self.num_slots, other.num_slots)
        self._pad_slots_left(width)
        other._pad_slots_left(width)
        for layer, new in zip(self.cache.layers, other.cache.layers):
            layer.keys = torch.cat([layer.keys, new.keys])
            layer.values = torch.cat([layer.values, new.values])
        self.valid = torch.cat([self.valid, other.valid])

    def compact(self) -> None:
        """Gather each row's valid slots to the right end; the new width is the longest row."""
        lengths = self.lengths
        width = int(lengths.max()) if self.num_rows else 0
        if width == self.num_slots:
            return
        # Sort slots so holes come first and valid slots keep their order: key = valid * slots + index.
        slot_index = torch.arange(self.num_slots)
        key = self.valid.long() * self.num_slots + slot_index
        gather = key.argsort(dim=1)[:, self.num_slots - width:]  # [rows, width]
        self.valid = self.valid.gather(1, gather)
        if self.cache is not None:
            for layer in self.cache.layers:
                index = gather.to(layer.keys.device)[:, None, :, None].expand(-1, layer.keys.shape[1], -1, layer.keys.shape[3])
                layer.keys = layer.keys.gather(2, index)
                layer.values = layer.values.gather(2, index)

    def _maybe_compact(self) -> None:
        if self.num_rows == 0:
            self.cache, self.valid = None, torch.zeros(0, 0, dtype=torch.bool)
            return
        longest = int(self.lengths.max())
        if self.num_slots > self.compact_ratio * longest + self.compact_slack:
            self.compact()

    def _pad_slots_left(self, width: int) -> None:
        """Grow to `width` slots by adding holes on the left."""
        if width == self.num_slots:
            return
        for layer in self.cache.layers:
            layer.keys = _pad_left(layer.keys, width, dim=2)
            layer.values = _pad_left(layer.values, width, dim=2)
        self.valid = _pad_left(self.valid, width)

    def _device(self) -> torch.device:
        return next(self.model.parameters()).device


def attention_window(config) -> int | None:
    """The sliding-attention window if any layer slides, else None.

    The cache here holds every slot in full layers and the model masks its sliding layers by slot
    distance; that equals true sliding attention only while a row's slots fit in the window, so
    `forward` compacts to stay inside it and the engine refuses requests that could not fit.
    """
    layer_types = getattr(config, "layer_types", None) or []
    window = getattr(config, "sliding_window", None)
    return int(window) if window and any("sliding" in str(t) for t in layer_types) else None


def same_length_groups(sequences: Sequence[Sequence[int]]) -> list[list[int]]:
    """Indices of `sequences` grouped by length (first-seen order), so each group prefills unpadded."""
    groups: dict[int, list[int]] = {}
    for index, sequence in enumerate(sequences):
        groups.setdefault(len(sequence), []).append(index)
    return list(groups.values())


def _left_pad_block(blocks: Sequence[Sequence[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Ragged token lists -> (input_ids [rows, T], real [rows, T] bool), right-aligned."""
    width = max(len(block) for block in blocks)
    input_ids = torch.zeros(len(blocks), width, dtype=torch.long)
    real = torch.zeros(len(blocks), width, dtype=torch.bool)
    for row, block in enumerate(blocks):
        if len(block):
            input_ids[row, width - len(block):] = torch.as_tensor(block, dtype=torch.long)
            real[row, width - len(block):] = True
    return input_ids, real


def _crop_layers(cache: DynamicCache, slots: list[int]) -> None:
    """Cut each cache layer back to the slot count it had before a failed forward."""
    for layer, width in zip(cache.layers, slots):
        if _width(layer) > width:
            layer.keys, layer.values = layer.keys[:, :, :width], layer.values[:, :, :width]
    del cache.layers[len(slots):]


def _width(layer) -> int:
    keys = layer.keys
    return keys.shape[2] if keys is not None and keys.dim() == 4 else 0


def _pad_left(tensor: torch.Tensor, width: int, dim: int = 1) -> torch.Tensor:
    extra = width - tensor.shape[dim]
    if extra <= 0:
        return tensor
    shape = list(tensor.shape)
    shape[dim] = extra
    return torch.cat([tensor.new_zeros(shape), tensor], dim=dim)
