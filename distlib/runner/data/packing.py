"""Documents into rows of one fixed length: best-fit decreasing packing (each document, longest
first, into the open row with the least room that still holds it), or one document per row
padded. A row holds ``input_ids``, ``position_ids`` (restarting at 0 at each document) and the
targets ``labels`` (the next token where it is trained, ``IGNORED`` elsewhere: the last token of
each document predicts nothing, so the first label of the next document is masked).
"""

from __future__ import annotations

import bisect
import heapq
from collections.abc import Sequence

import numpy as np

from distlib.runner.data.text import IGNORED


def labels_of(ids: np.ndarray, trained: np.ndarray) -> np.ndarray:
    """The targets of one document: ``labels[j] = ids[j + 1]`` where token ``j + 1`` is trained,
    ``IGNORED`` elsewhere and at the last position."""
    labels = np.full(len(ids), IGNORED, dtype=np.int64)
    labels[:-1] = np.where(trained[1:], ids[1:], IGNORED)
    return labels


def best_fit_decreasing(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Bins of document indices, each summing to at most ``capacity``: documents taken longest
    first (ties in index order), each into the open bin with the least room left that holds it
    (the first such bin), else a new bin. Deterministic; no document is split or lost (each must fit ``capacity``)."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    bins: list[list[int]] = []
    room: list[int] = []  # room left of each bin
    by_room: dict[int, list[int]] = {}  # room -> a heap of the bins with it
    rooms: list[int] = []  # the distinct rooms present, sorted
    for i in order:
        n = lengths[i]
        if n > capacity:
            raise ValueError(f"a document of {n} tokens is longer than the rows' {capacity}")
        k = bisect.bisect_left(rooms, n)
        if k < len(rooms):
            r = rooms[k]
            b = heapq.heappop(by_room[r])  # the first bin with this room: a stable choice
            if not by_room[r]:
                del by_room[r]
                rooms.pop(k)
        else:
            b, r = len(bins), capacity
            bins.append([])
            room.append(capacity)
        bins[b].append(i)
        room[b] = r - n
        if room[b] > 0:
            if room[b] not in by_room:
                bisect.insort(rooms, room[b])
                by_room[room[b]] = []
            heapq.heappush(by_room[room[b]], b)
    return bins


def build_rows(docs: Sequence[tuple[np.ndarray, np.ndarray]], length: int, packing: bool,
               pad_id: int = 0) -> dict[str, np.ndarray]:  # fmt: skip
    """``(N, length)`` int32 arrays ``input_ids``, ``position_ids``, ``labels`` of ``docs`` (each
    ``(ids, labels)``, at most ``length`` tokens), packed or one per row; pads: ``pad_id``,
    ``IGNORED`` targets, positions going on (attention being causal, no real token sees a pad)."""
    groups = best_fit_decreasing([len(d[0]) for d in docs], length) if packing else [[i] for i in range(len(docs))]
    ids = np.full((len(groups), length), pad_id, dtype=np.int32)
    labels = np.full((len(groups), length), IGNORED, dtype=np.int32)
    pos = np.zeros((len(groups), length), dtype=np.int32)
    for r, group in enumerate(groups):
        at = 0
        for i in group:
            d_ids, d_labels = docs[i]
            n = len(d_ids)
            ids[r, at : at + n] = d_ids
            labels[r, at : at + n] = d_labels
            pos[r, at : at + n] = np.arange(n)
            at += n
        last = len(docs[group[-1]][0]) if group else 0
        pos[r, at:] = np.arange(last, last + length - at)  # the last document's positions go on over the pads
    return {"input_ids": ids, "position_ids": pos, "labels": labels}


__all__ = ["best_fit_decreasing", "build_rows", "labels_of"]
