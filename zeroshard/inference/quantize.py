"""Weight-only quantization of Linear layers, computed by torch's own kernels. No collectives.

* **int8**: one scale per output channel (``w ≈ scale·q``, q in [-127, 127]); asymmetric
  adds an offset per channel (``w ≈ scale·q + offset``, q in [-128, 127]), applied as
  ``sum(x)·offset`` after the matmul. Kernel: ``torch._weight_int8pack_mm``.
* **int4**: groups of ``group_size`` input features share a scale and an offset
  (``w ≈ scale·(u - 8) + offset``, u in [0, 15]; symmetric: offset 0, scale absmax/7).
  Kernels: ``torch._convert_weight_to_int4pack_for_cpu`` / ``_weight_int4pack_mm_for_cpu``
  on CPU, ``_convert_weight_to_int4pack`` / ``_weight_int4pack_mm`` on CUDA.

Torch's int8/int4 kernels run fast with bf16 activations only (on this project's CPU,
fp32 activations take a scalar path 10-30x slower, measured), so activations enter the
quantized matmul in bf16 and the result is cast back to the input's dtype. Where a kernel
does not take a shape (int8: in_features not a multiple of 16, where the CPU kernel
crashes; int4 on CPU: out_features not a multiple of 16), the layer dequantizes its weight
for each call instead (kernel ``dequant``): same numbers, slower. Each layer's
``kernel`` is one of :meth:`QuantLinear.kernels`; on a GPU, ``kernels.py`` measures them
per layer shape and picks the fastest (int8's ``dequant`` is the form ``torch.compile``
fuses into one matmul, gpt-fast's); on the CPU the defaults stay.

The portable form, which ``state_dict`` holds and safetensors files store, is the same on
every device: ``qweight`` (int8 [N, K], or uint8 [N, K/2] with two 4-bit values a byte,
the even input index in the high nibble), ``scale`` and ``offset`` (int4: [N, K/g] bf16;
int8: [N] fp32), ``bias``. A CPU int4 layer keeps only the kernel's packed weight in
memory and recovers the portable one for ``state_dict`` through the kernel itself (an
identity matmul, exact).
"""

from __future__ import annotations

import fnmatch
import logging

import torch
import torch.nn.functional as F
from torch import nn

from zeroshard import ZeroshardError

COMPUTE_DTYPE = torch.bfloat16
log = logging.getLogger("zeroshard")


class QuantizationError(ZeroshardError, ValueError):
    """A layer that cannot be quantized as asked (the message names it)."""


def quantize_int8(w: torch.Tensor, symmetric: bool = True):
    """Per-output-channel int8 of ``w`` [N, K]: ``(q, scale, offset or None)``; scales are
    rounded to bf16 first, as the kernel uses them."""
    w = w.detach().float()
    if symmetric:
        scale = (w.abs().amax(1) / 127).clamp_min(1e-12).to(COMPUTE_DTYPE).float()
        q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
        return q, scale, None
    lo, hi = w.amin(1), w.amax(1)
    scale = ((hi - lo) / 255).clamp_min(1e-12).to(COMPUTE_DTYPE).float()
    offset = lo + 128 * scale
    q = torch.round((w - offset[:, None]) / scale[:, None]).clamp(-128, 127).to(torch.int8)
    return q, scale, offset


def quantize_int4(w: torch.Tensor, group_size: int, symmetric: bool = True):
    """Group-wise int4 of ``w`` [N, K]: ``(u, scale, offset)`` with u uint8 [N, K] in
    [0, 15] (unpacked) and scale/offset bf16 [N, K/group_size]."""
    n, k = w.shape
    g = w.detach().float().reshape(n, k // group_size, group_size)
    if symmetric:
        scale = (g.abs().amax(-1) / 7).clamp_min(1e-12).to(COMPUTE_DTYPE)
        offset = torch.zeros_like(scale)
    else:
        lo, hi = g.amin(-1), g.amax(-1)
        s = ((hi - lo) / 15).clamp_min(1e-12)
        scale, offset = s.to(COMPUTE_DTYPE), (lo + 8 * s).to(COMPUTE_DTYPE)
    u = torch.round((g - offset.float()[..., None]) / scale.float()[..., None]) + 8
    return u.clamp(0, 15).to(torch.uint8).reshape(n, k), scale, offset


def pack_nibbles(u: torch.Tensor) -> torch.Tensor:
    """[N, K] values in [0, 15] -> uint8 [N, K/2], even index in the high nibble."""
    u = u.to(torch.uint8)
    return (u[:, ::2] << 4) | u[:, 1::2]


def unpack_nibbles(p: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_nibbles`: uint8 [N, K/2] -> uint8 [N, K]."""
    return torch.stack([p >> 4, p & 15], dim=-1).reshape(p.shape[0], -1)


def _inner_k_tiles(k: int) -> int:
    return next((t for t in (8, 4, 2) if k % (t * 16) == 0), 0)


#: int4 group sizes torch's int4 kernels take (CPU and CUDA)
KERNEL_GROUPS = (32, 64, 128, 256)


def fit_group_size(in_features: int, group_size: int) -> int:
    """The int4 group size for a layer of ``in_features`` inputs: ``group_size`` if it
    divides them, else the largest kernel group size below it that does (1856 inputs at
    128: 64), else the largest divisor below it (no kernel: the layer dequantizes per
    call)."""
    if in_features % group_size == 0:
        return group_size
    for g in sorted(KERNEL_GROUPS, reverse=True):
        if g < group_size and in_features % g == 0:
            return g
    return max(d for d in range(1, min(group_size, in_features) + 1) if in_features % d == 0)


def warn_refitted(refitted: list[tuple[str, int, int]], group_size: int) -> None:
    """Say once which layers took another int4 group size than asked, and which."""
    if not refitted:
        return
    shown = ", ".join(f"{n} ({k} inputs: {g})" for n, k, g in refitted[:8])
    more = f" and {len(refitted) - 8} more" if len(refitted) > 8 else ""
    log.warning(
        "zeroshard: int4 group_size %d does not divide the input features of %d layer(s): "
        "%s%s; each uses the largest group size below it that does (quant.weight.group_size "
        "sets the others)",
        group_size,
        len(refitted),
        shown,
        more,
    )


class QuantLinear(nn.Module):
    """A Linear layer with int8 or int4 weights (see the module docstring)."""

    qweight: torch.Tensor  # buffers (register_buffer)
    scale: torch.Tensor
    offset: torch.Tensor | None  # None: int8 symmetric

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        bits: int,
        group_size: int = 128,
        symmetric: bool = True,
        bias: bool = True,
        device: torch.device | str | None = None,
        name: str = "",
    ) -> None:
        super().__init__()
        if bits not in (4, 8):
            raise QuantizationError(f"{name or 'layer'}: num_bits must be 8 or 4, got {bits}")
        if bits == 4 and in_features % group_size:
            raise QuantizationError(
                f"{name or 'layer'}: int4 group_size {group_size} does not divide in_features "
                f"{in_features}; choose a group size among 32, 64, 128, 256 that divides it, "
                "or leave the layer unquantized (quant.skip)"
            )
        self.in_features, self.out_features = in_features, out_features
        self.bits, self.group_size, self.symmetric = bits, group_size, symmetric
        self.name = name
        dev = torch.device(device or "cpu")
        k, n = in_features, out_features
        if bits == 8:
            self.register_buffer("qweight", torch.zeros(n, k, dtype=torch.int8, device=dev))
            self.register_buffer("scale", torch.ones(n, device=dev))
            self.offset = None if symmetric else torch.zeros(n, device=dev)
        else:
            self.register_buffer("qweight", torch.zeros(n, k // 2, dtype=torch.uint8, device=dev))
            groups = k // group_size
            self.register_buffer("scale", torch.ones(n, groups, dtype=COMPUTE_DTYPE, device=dev))
            self.offset = torch.zeros(n, groups, dtype=COMPUTE_DTYPE, device=dev)
        self.bias = nn.Parameter(torch.zeros(n, device=dev), requires_grad=False) if bias else None
        self._prepare()

    # -- construction ------------------------------------------------------------------
    @classmethod
    def from_float(cls, weight: torch.Tensor, bias: torch.Tensor | None, *, bits: int,
                   group_size: int = 128, symmetric: bool = True, name: str = "") -> QuantLinear:  # fmt: skip
        """Quantize a [out_features, in_features] weight (and keep ``bias`` as it is)."""
        n, k = weight.shape
        layer = cls(k, n, bits=bits, group_size=group_size, symmetric=symmetric,
                    bias=bias is not None, device=weight.device, name=name)  # fmt: skip
        layer.set_portable(*layer.quantize_weight(weight))
        if bias is not None:
            layer.bias = nn.Parameter(bias.detach().clone(), requires_grad=False)
        return layer

    def quantize_weight(self, weight: torch.Tensor):
        """The portable (qweight, scale, offset) of a float weight, for this layer's format."""
        if self.bits == 8:
            return quantize_int8(weight, self.symmetric)
        u, scale, offset = quantize_int4(weight, self.group_size, self.symmetric)
        return pack_nibbles(u), scale, offset

    def set_portable(self, qweight, scale, offset) -> None:
        """Install portable tensors (as ``state_dict`` holds them) and build the kernel form."""
        # a fresh, aligned copy: the CPU int8 kernel crashes on a tensor read in place from
        # a safetensors file (unaligned data, seen with torch 2.13)
        self.qweight = qweight.contiguous().clone()
        self.scale = scale.to(self.scale.dtype).contiguous()
        if offset is not None:
            self.offset = offset.to(self.scale.dtype).contiguous()
        self._prepare()

    def _prepare(self) -> None:
        """Derive the kernels' tensors from the portable ones; the default kernel is
        torch's int8/int4 one where it takes the shape, else "dequant"."""
        dev, n, k = self.qweight.device, self.out_features, self.in_features
        self._packed_ok = False
        if self.bits == 8:
            self._scale_c = self.scale.to(COMPUTE_DTYPE)
            self.kernel = "int8pack" if k % 16 == 0 else "dequant"
            return
        off = self.offset if self.offset is not None else torch.zeros_like(self.scale)
        self._sz = torch.stack([self.scale.t(), off.t()], dim=-1).contiguous()  # [K/g, N, 2]
        self.scale, self.offset = self._sz[..., 0].t(), self._sz[..., 1].t()  # views, no copies
        if self.group_size not in KERNEL_GROUPS:
            pass  # a group size the kernels do not take: dequantize per call
        elif dev.type == "cpu" and n % 16 == 0:
            u = unpack_nibbles(self.qweight).to(torch.int32)
            self._packed, self._packed_ok = torch._convert_weight_to_int4pack_for_cpu(u, 1), True
        elif dev.type == "cuda" and n % 8 == 0 and _inner_k_tiles(k):
            self._packed = torch._convert_weight_to_int4pack(self.qweight, _inner_k_tiles(k))
            self._packed_ok = True
        if self._packed_ok and dev.type == "cpu":
            self.qweight = torch.empty(0, dtype=torch.uint8, device=dev)  # the packed form only
        self.kernel = "int4pack" if self._packed_ok else "dequant"

    def kernels(self) -> tuple[str, ...]:
        """The kernels that can compute this layer (``kernels.py`` measures them):
        torch's int8 (``int8pack``: in_features a multiple of 16) or int4 (``int4pack``:
        a kernel group size, out_features a multiple of 16 on CPU, 8 on CUDA) matmul, and
        ``dequant``: the weight dequantized per call (int8: ``linear(x, q) * scale``,
        which ``torch.compile`` fuses into one matmul)."""
        if self.bits == 8:
            return ("int8pack", "dequant") if self.in_features % 16 == 0 else ("dequant",)
        return ("int4pack", "dequant") if self._packed_ok else ("dequant",)

    def set_kernel(self, kernel: str) -> None:
        if kernel not in self.kernels():
            raise QuantizationError(
                f"{self.name or 'layer'}: kernel {kernel!r} cannot compute this layer "
                f"(it takes {', '.join(self.kernels())})"
            )
        self.kernel = kernel

    # -- portable form for state_dict ----------------------------------------------------
    def portable(self) -> dict[str, torch.Tensor]:
        """qweight, scale, offset (asymmetric), bias: what a safetensors file stores."""
        out = {"qweight": self._portable_qweight(), "scale": self.scale.contiguous()}
        if not self.symmetric:
            assert self.offset is not None  # asymmetric layers always hold one
            out["offset"] = self.offset.contiguous()
        if self.bias is not None:
            out["bias"] = self.bias.detach()
        return out

    def _portable_qweight(self) -> torch.Tensor:
        if self.bits == 8 or self.qweight.numel():
            return self.qweight
        # recover u from the packed CPU form: scale 1, offset 8 makes the kernel return u
        k, g = self.in_features, self.group_size
        sz = torch.zeros_like(self._sz)
        sz[..., 0], sz[..., 1] = 1, 8
        rows = []
        for start in range(0, k, 256):
            eye = torch.eye(k, dtype=COMPUTE_DTYPE, device=self._sz.device)[start : start + 256]
            rows.append(torch._weight_int4pack_mm_for_cpu(eye, self._packed, g, sz))
        return pack_nibbles(torch.cat(rows).t().round().to(torch.uint8))

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        for key, value in self.portable().items():
            destination[prefix + key] = value

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing, unexpected, errors):  # fmt: skip
        keys = ["qweight", "scale"] + ([] if self.symmetric else ["offset"])
        keys += ["bias"] if self.bias is not None else []
        found = {k: state_dict[prefix + k] for k in keys if prefix + k in state_dict}
        missing.extend(prefix + k for k in keys if k not in found)
        if "qweight" in found and "scale" in found:
            dev = self.scale.device
            q, s = found["qweight"].to(dev), found["scale"].to(dev)
            want = (self.out_features, self.in_features // (2 if self.bits == 4 else 1))
            if tuple(q.shape) != want:
                errors.append(f"{prefix}qweight: shape {tuple(q.shape)}, expected {want}")
                return
            self.set_portable(q, s, found.get("offset"))
        if "bias" in found:
            self.bias = nn.Parameter(found["bias"].detach().clone(), requires_grad=False)

    # -- compute ---------------------------------------------------------------------------
    def dequantize(self) -> torch.Tensor:
        """The float weight [N, K] these numbers stand for (fp32)."""
        if self.bits == 8:
            w = self.qweight.float() * self._scale_c.float()[:, None]
            return w if self.offset is None else w + self.offset[:, None]
        u = unpack_nibbles(self._portable_qweight()).float() - 8
        u = u.view(self.out_features, -1, self.group_size)
        return (u * self._sz[..., 0].t().float()[..., None] + self._sz[..., 1].t().float()[..., None]).flatten(1)  # fmt: skip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape, dtype = x.shape, x.dtype
        x2 = x.reshape(-1, self.in_features).to(COMPUTE_DTYPE)
        kernel = self.kernel
        if self.bits == 8:
            if kernel == "int8pack":
                y = torch._weight_int8pack_mm(x2.contiguous(), self.qweight, self._scale_c)
            else:  # the form torch.compile fuses into one matmul (gpt-fast's)
                y = F.linear(x2, self.qweight.to(COMPUTE_DTYPE)) * self._scale_c
            if self.offset is not None:
                y = y.float() + x2.float().sum(-1, keepdim=True) * self.offset
        elif kernel == "dequant":
            y = F.linear(x2, self.dequantize().to(COMPUTE_DTYPE))
        elif x2.device.type == "cpu":
            y = torch._weight_int4pack_mm_for_cpu(x2.contiguous(), self._packed, self.group_size, self._sz)  # fmt: skip
        else:
            y = torch._weight_int4pack_mm(x2.contiguous(), self._packed, self.group_size, self._sz)  # fmt: skip
        y = y.to(dtype).reshape(*shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias.to(dtype)

    def weight_bytes(self) -> int:
        """Bytes held for the weight and its scales/offsets (bias excluded)."""
        held = [self.qweight, self.scale, self.offset, getattr(self, "_packed", None)]
        held += [getattr(self, "_sz", None), getattr(self, "_scale_c", None)]
        storages = {}
        for t in held:
            if t is not None and t.numel():
                st = t.untyped_storage()
                storages[st.data_ptr()] = st.nbytes()
        return sum(storages.values())

    def extra_repr(self) -> str:
        kind = f"int{self.bits}" + (f", group_size={self.group_size}" if self.bits == 4 else "")
        sym = "symmetric" if self.symmetric else "asymmetric"
        return f"in_features={self.in_features}, out_features={self.out_features}, {kind}, {sym}, kernel={self.kernel}"  # fmt: skip


def linear_weight_bias(module: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """(weight [out, in], bias) of a Linear, or of transformers' GPT-2 Conv1D; else None."""
    if type(module) is nn.Linear:
        return module.weight, module.bias
    if type(module).__name__ == "Conv1D" and hasattr(module, "nf"):
        return module.weight.t(), module.bias  # type: ignore[operator, return-value]
    return None


def quantize_model(
    model: nn.Module,
    *,
    bits: int,
    group_size: int = 128,
    symmetric: bool = True,
    skip: tuple[str, ...] | list[str] = (),
) -> list[str]:
    """Replace the Linear layers of ``model`` in place by :class:`QuantLinear`; returns
    the names replaced. A layer whose weight is shared with another module (a tied head)
    or whose name matches a ``skip`` pattern keeps its weight. Under int4, a layer whose
    in_features ``group_size`` does not divide takes the next group size that does
    (:func:`fit_group_size`), said once for all such layers."""
    counts: dict[int, int] = {}
    for _, p in model.named_parameters(remove_duplicate=False):
        counts[id(p)] = counts.get(id(p), 0) + 1
    chosen = []
    for name, module in model.named_modules():
        wb = linear_weight_bias(module)
        if wb is None or any(fnmatch.fnmatchcase(name, pat) for pat in skip):
            continue
        raw = module.weight
        if counts.get(id(raw), 0) > 1:
            continue
        chosen.append((name, wb))
    refitted = []
    for name, (weight, bias) in chosen:
        group = fit_group_size(weight.shape[1], group_size) if bits == 4 else group_size
        if group != group_size:
            refitted.append((name, weight.shape[1], group))
        layer = QuantLinear.from_float(weight, bias, bits=bits, group_size=group,
                                       symmetric=symmetric, name=name)  # fmt: skip
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, layer)
    warn_refitted(refitted, group_size)
    return [name for name, _ in chosen]


def weight_bytes(model: nn.Module) -> tuple[int, int]:
    """(bytes held by the Linear-layer weights incl. scales, fp32 bytes of the same weights)."""
    held = fp32 = 0
    for module in model.modules():
        if isinstance(module, QuantLinear):
            held += module.weight_bytes()
            fp32 += 4 * module.in_features * module.out_features
        elif (wb := linear_weight_bias(module)) is not None:
            held += wb[0].numel() * wb[0].element_size()
            fp32 += 4 * wb[0].numel()
    return held, fp32
