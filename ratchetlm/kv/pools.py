"""A cache layout's persistent storage: named pools of rows, written through one sink.

Every cache layout keeps its state as *pools*. Pool ``p`` is one tensor
``[num_layers(p), num_rows(p), *row_shape(p)]``: its layers stacked, so that a commit copies a
token row into every layer of a pool with one copy. A layer is named by a key (an int for a
decoder layer, ``"mtp0"`` for DeepSeek-V4's MTP module). Each pool is addressed by one slot
mapping, named by the pool's *group*: pools written at the same slots share a group.

* the llama family (kv/cache.py): pools ``k`` and ``v``, rows ``[kv_heads, head_dim]``, one group
  ``kv`` (a token's K and V sit at the same slot);
* DeepSeek-V4 (models/deepseek_v4/layout.py): seven pools — the raw-KV ring ``ori``, compressed
  KV ``csa_cmp`` / ``hca_cmp``, indexer keys ``idx``, compressor state ``csa_state`` /
  ``inner_state`` / ``hca_state`` — each its own group, over the layers of its kind.

Writes go through :class:`~ratchetlm.kv.staging.StepSink` (one per forward), never by indexing
the tensors.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence

import torch

from ratchetlm.memory import huge_pages


class Pools:
    def __init__(self) -> None:
        self.stacked: dict[str, torch.Tensor] = {}  # pool -> [num_layers(p), num_rows(p), *row_shape]
        self.group: dict[str, str] = {}  # pool -> the slot mapping that addresses it
        self._layer: dict[str, dict[Hashable, int] | None] = {}  # pool -> layer key -> index (None: key == index)
        self.bytes_written = 0  # bytes scattered into persistent rows (direct writes and commits)

    def add(self, pool: str, layers: Sequence[Hashable] | int, rows: int, row_shape: tuple[int, ...],
            dtype: torch.dtype, device: torch.device | str, group: str | None = None) -> torch.Tensor:
        """A zeroed pool; ``layers``: the layer keys, or a count ``n`` for keys ``0..n-1``."""
        n = layers if isinstance(layers, int) else len(layers)
        shape = (n, rows, *row_shape)
        # on the CPU in huge pages: attention reads rows scattered over the pool (memory/huge_pages.py)
        t = huge_pages.zeros(shape, dtype) if torch.device(device).type == "cpu" else \
            torch.zeros(shape, dtype=dtype, device=device)
        self.register(pool, t, None if isinstance(layers, int) else layers, group)
        return t

    def register(self, pool: str, stacked: torch.Tensor, layers: Sequence[Hashable] | None = None,
                 group: str | None = None) -> None:
        """Adopt an existing ``[layers, rows, ...]`` tensor as pool ``pool`` (``layers`` None: keys
        ``0..n-1``)."""
        assert pool not in self.stacked, pool
        if layers is not None:
            assert len(layers) == stacked.shape[0], (pool, len(layers), stacked.shape)
        self.stacked[pool] = stacked
        self.group[pool] = group or pool
        identity = layers is None or list(layers) == list(range(len(layers)))
        self._layer[pool] = None if identity else {k: i for i, k in enumerate(layers)}  # type: ignore[arg-type]

    @property
    def groups(self) -> set[str]:
        return set(self.group.values())

    def layer_index(self, pool: str, layer: Hashable) -> int:
        m = self._layer[pool]
        return layer if m is None else m[layer]  # type: ignore[return-value]

    def layers(self, pool: str) -> Iterable[Hashable]:
        m = self._layer[pool]
        return range(self.stacked[pool].shape[0]) if m is None else m.keys()

    def get(self, pool: str, layer: Hashable) -> torch.Tensor:  # [num_rows, *row_shape] view
        return self.stacked[pool][self.layer_index(pool, layer)]

    @property
    def tensors(self) -> dict[tuple[str, Hashable], torch.Tensor]:
        """Every (pool, layer) as a view ``[num_rows, *row_shape]`` (readers, tests)."""
        return {(p, k): self.get(p, k) for p in self.stacked for k in self.layers(p)}

    def row_bytes(self, pool: str) -> int:
        """Bytes of one row of ``pool`` over all its layers."""
        t = self.stacked[pool]
        return t.numel() // t.shape[1] * t.element_size() if t.shape[1] else 0

    def write(self, pool: str, layer: Hashable, values: torch.Tensor, slots: torch.Tensor | slice) -> None:
        """values ``[n, *row_shape]`` into rows ``slots`` ``[n]`` (all >= 0, or a slice of ``n`` rows) of one layer."""
        t = self.stacked[pool]
        m = self._layer[pool]
        dst = t[layer if m is None else m[layer]]  # type: ignore[index]
        if isinstance(slots, slice):
            dst[slots].copy_(values)
        else:
            dst.index_copy_(0, slots, values if values.dtype == t.dtype else values.to(t.dtype))
        self.bytes_written += values.numel() * t.element_size()

    def copy_rows(self, pool: str, values: torch.Tensor, slots: torch.Tensor | slice) -> None:
        """values ``[upto, n, *row_shape]`` into rows ``slots`` of layers ``[0, upto)`` at once. ``slots``:
        ``[n]`` int64 (all >= 0), or a slice of ``n`` consecutive rows: one strided copy, converting as
        it goes (an ``index_copy_`` and its converted source cost ~4x that at a few rows)."""
        t = self.stacked[pool]
        if isinstance(slots, slice):
            t[: values.shape[0], slots].copy_(values)
        else:
            t[: values.shape[0]].index_copy_(1, slots, values.to(t.dtype))
        self.bytes_written += values.numel() * t.element_size()

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.stacked.values())
