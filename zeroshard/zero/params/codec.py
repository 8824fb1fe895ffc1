"""How a stage-3 unit may travel in its all-gather in another form than its compute
dtype (the seam of ``fp8.enable_fsdp_float8_all_gather``: ``zeroshard/fp8/gather.py``
implements it). No communication of its own: :meth:`UnitCodec.encode` is handed the
unit's group and may issue small collectives on it (fp8: one all-reduce (max) of one
float32 amax) before the gatherer all-gathers what it returns.

A unit with a codec is gathered *encoded* when the module hooks ask for it (forward,
backward, prefetch): its parameters then stay released (they refuse value reads, as
when only the shard is held) but take their whole shape, so autograd can give them
gradients; the module computes from the codec's gathered form instead. For
``GatheredParameters`` and teardown, which need the values themselves, the unit is
gathered in its compute dtype as any other (``units.py``).
"""

from __future__ import annotations

from typing import Protocol

import torch

from zeroshard.distributed.comm import Comm


class UnitCodec(Protocol):
    """One unit's encoded all-gather (one parameter alone in its unit)."""

    #: how the unit travels, for errors: "in fp8 (fp8.enable_fsdp_float8_all_gather)"
    gathered_as: str

    def encode(self, chunk: torch.Tensor, valid: int, comm: Comm) -> torch.Tensor:
        """This rank's chunk (compute dtype, on the device; its first ``valid`` elements
        are the parameter's, the rest padding) as 1-D ``uint8``, every rank's the same
        length; may all-reduce over ``comm`` (every rank calls it in the same order)."""
        ...

    def receive(self, numel: int) -> torch.Tensor:
        """The ``uint8`` buffer the all-gather fills (``numel`` chunks' bytes in all),
        allocated; its storage is freed by :meth:`release`."""
        ...

    def landed(self) -> None:
        """The all-gather into :meth:`receive`'s buffer has landed: the module may use it."""
        ...

    def release(self) -> None:
        """The unit is freed: drop the gathered form (storage resized to zero)."""
        ...
