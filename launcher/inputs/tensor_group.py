"""The unit every architecture is described in: a group of identical tensors, with how vLLM
shards it and what it belongs to (see launcher/inputs/arch.py for the meaning of each field).

Its own module so the architectures, the vision towers and the budget model share one
definition without importing each other.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Tensor:
    """A group of `count` identical tensors of shape (rows, cols)."""

    name: str
    rows: int
    cols: int = 1
    count: int = 1
    shard: str = "replicated"  # column | row | kv | vocab | replicated | expert_column | expert_row
    part: str = "norm"
    layer: int | None = None
    quant: bool = False  # a linear weight the checkpoint's quantization format covers
    dtype: str | None = None  # stored dtype when it differs from the model's (fp32 biases)
    heads: int = 0  # kv: number of KV heads, for replication once TP exceeds them
    loaded: bool = True  # False: stored in the checkpoint, not loaded by vLLM (MTP)

    @property
    def elements(self) -> int:
        return self.rows * self.cols * self.count


def linear(name: str, out: int, inp: int, shard: str, part: str, layer: int | None,
            count: int = 1, quant: bool = True, loaded: bool = True, heads: int = 0) -> Tensor:
    return Tensor(name, out, inp, count, shard, part, layer, quant, None, heads, loaded)


def vec(name: str, size: int, part: str, layer: int | None, count: int = 1,
         dtype: str | None = None, loaded: bool = True, shard: str = "replicated") -> Tensor:
    return Tensor(name, size, 1, count, shard, part, layer, False, dtype, 0, loaded)
