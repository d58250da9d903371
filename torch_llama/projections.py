"""How the torch twin's projections store and multiply their weights: float, or int8 with
float32 scales (torch_llama.quantize), and the LoRA adapter slot of a projection
(torch_llama.lora). torch_llama.model builds its projections from Linear and its embedding from
Embedding, and names none of this: a projection's storage is its weight's dtype, its adapter
what torch_llama.lora gave it (`lora_of` reads the settings back); jax_llama.model.projections
is the twin.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from bridge.formats.torch_files import to_numpy
from bridge.int4 import GROUP, activations, quantize_int4
from bridge.lora import LoraConfig
from bridge.quantize import Quantization, quantize_weight


class Int8Weight:
    """What a module whose `weight` (out, in) can be int8 shares (Linear, Embedding): Q as a
    frozen int8 `weight` beside float32 scales (out, G), the buffer `weight_scale`."""

    def quantize(self, quantization: Quantization, name: str = "weight") -> None:
        """Replace W by int8 Q (a frozen `weight`) and float32 scales (`weight_scale`, a buffer):
        bridge.quantize.quantize_weight's numbers, the JAX twin's."""
        q_OI, scale_OG = quantize_weight(to_numpy(self.weight.detach()), quantization.group_size,
                                         name)
        self.make_int8(scale_OG.shape[1])
        with torch.no_grad():
            self.weight.copy_(torch.from_numpy(q_OI))
            self.weight_scale.copy_(torch.from_numpy(scale_OG))

    def _scale_in(self, dtype: torch.dtype) -> torch.Tensor | None:
        """The per-channel scales (G = 1) as an (out,) vector in `dtype`, what torch's int8
        kernel multiplies by: converted once, not at every call (a decode step makes one call per
        projection), and again whenever weight_scale changes (a load writes it in place, .to()
        replaces it). None for group-wise scales."""
        scale = self.weight_scale
        if scale.shape[1] != 1:
            return None
        try:
            key = (dtype, scale.data_ptr(), scale._version)
        except RuntimeError:  # an inference tensor keeps no version: convert every call
            return scale[:, 0].to(dtype)
        if getattr(self, "_scale_key", None) != key:
            self._scale_vec, self._scale_key = scale[:, 0].to(dtype), key
        return self._scale_vec

    def make_int8(self, groups: int) -> None:
        """Turn W into an (uninitialised) int8 weight with `groups` scales per row, on W's
        device (meta included): what loading a quantised checkpoint fills."""
        device = self.weight.device
        self.weight = nn.Parameter(torch.empty(self.weight.shape, dtype=torch.int8, device=device),
                                   requires_grad=False)
        self.register_buffer("weight_scale", torch.empty(self.weight.shape[0], groups,
                                                         dtype=torch.float32, device=device))


class Linear(Int8Weight, nn.Linear):
    """x W^T (+ b, with bias=True; W (out, in) and b keep nn.Linear's names), plus, once
    add_adapter is called, a LoRA update scale * B A dropout(x) with A (rank, in) and B (out,
    rank) in float32 as `lora_A.weight` and `lora_B.weight`: the canonical adapter names."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__(in_features, out_features, bias=bias)
        self.lora: LoraConfig | None = None

    def add_adapter(self, lora: LoraConfig) -> None:
        """A as PEFT initialises it (nn.Linear's Kaiming-uniform, U(+-1/sqrt(in))), B zero: the
        output is unchanged until B trains. Drawn on the CPU, so that a seed gives the same A on
        every device, then moved to W's device."""
        a = nn.Linear(self.in_features, lora.rank, bias=False, device="cpu", dtype=torch.float32)
        b = nn.Linear(lora.rank, self.out_features, bias=False, device="cpu", dtype=torch.float32)
        nn.init.kaiming_uniform_(a.weight, a=math.sqrt(5))
        nn.init.zeros_(b.weight)
        self.lora_A, self.lora_B = a.to(self.weight.device), b.to(self.weight.device)
        self.lora_dropout = nn.Dropout(lora.dropout)  # active in train() only
        self.lora = lora

    def merge_adapter(self) -> None:
        """W + scale * B A, summed in float32 (float64 for float64 W) and rounded once to W's
        dtype (bridge.lora.merge_weight's arithmetic); then a plain projection again."""
        wide = torch.promote_types(self.weight.dtype, torch.float32)
        with torch.no_grad():
            update = self.lora.scale * (self.lora_B.weight.to(wide) @ self.lora_A.weight.to(wide))
            self.weight.copy_(self.weight.to(wide) + update)
        del self.lora_A, self.lora_B, self.lora_dropout
        self.lora = None

    def quantize_int4(self, name: str = "weight") -> None:
        """Replace W by 4-bit weights (bridge.int4): a frozen uint8 `weight` (out, in / 2), two
        weights a byte, beside float16 buffers `weight_scale` and `weight_min` (out, in / 32):
        the JAX twin's numbers."""
        quantised = quantize_int4(to_numpy(self.weight.detach()), name)
        self.make_int4()
        with torch.no_grad():
            for tensor, value in zip((self.weight, self.weight_scale, self.weight_min), quantised):
                tensor.copy_(torch.from_numpy(value))

    def make_int4(self, minima: bool = True) -> None:
        """Turn W into (uninitialised) 4-bit weights on W's device (meta included): what
        quantize_int4 and a 4-bit load fill. minima=False: no `weight_min`, each taken as -8
        times its scale (llama.cpp's Q4_0, as a load of one holds it: bridge.int4.minima_implied)."""
        O, I = self.weight.shape
        device = self.weight.device
        self.weight = nn.Parameter(torch.empty(O, I // 2, dtype=torch.uint8, device=device),
                                   requires_grad=False)
        for buffer in ("weight_scale", "weight_min") if minima else ("weight_scale",):
            self.register_buffer(buffer, torch.empty(O, I // GROUP, dtype=torch.float16,
                                                     device=device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight.dtype == torch.uint8:
            y = int4_linear(x, self.weight, self.weight_scale, getattr(self, "weight_min", None))
        elif self.weight.dtype == torch.int8:
            # x rounded to bfloat16 where those are the activations chosen (generation's
            # default): jax_llama.model.projections.int8_input's twin; the tied head takes x as is
            xq = round_to_bfloat16(x) if activations() == "bfloat16" else x
            y = int8_linear(xq, self.weight, self.weight_scale, self._scale_in(x.dtype))
        else:
            y = super().forward(x)  # x W^T (+ bias)
        if self.bias is not None and not self.weight.is_floating_point():
            y = y + self.bias.to(y.dtype)
        if self.lora is None:
            return y
        # The float32 adapters run in x's dtype, as the projection itself does.
        a, b = self.lora_A.weight.to(x.dtype), self.lora_B.weight.to(x.dtype)
        return y + F.linear(F.linear(self.lora_dropout(x), a), b) * self.lora.scale


def int8_linear(x: torch.Tensor, q_OI: torch.Tensor, scale_OG: torch.Tensor,
                scale_O: torch.Tensor | None = None) -> torch.Tensor:
    """x Q^T scaled, for int8 Q (out, in) and float32 scales (out, G) (bridge.quantize), in x's
    dtype: jax_llama.model.projections.int8_matmul's twin. Per channel (G = 1), (x Q^T) * s -
    through torch's int8 weight kernel when x is bfloat16 on a CPU or CUDA device, which reads
    the int8 weight as it multiplies; group-wise, each group dequantised in float32, rounded once.
    scale_O: the per-channel scales already in x's dtype (Linear keeps them), else converted."""
    O, I = q_OI.shape
    G = scale_OG.shape[1]
    if G == 1:
        scale_O = scale_OG[:, 0].to(x.dtype) if scale_O is None else scale_O
        if x.dtype == torch.bfloat16 and x.device.type in ("cpu", "cuda"):
            y = torch._weight_int8pack_mm(x.reshape(-1, I), q_OI, scale_O)
            return y.reshape(*x.shape[:-1], O)
        return F.linear(x, q_OI.to(x.dtype)) * scale_O
    w_OGi = q_OI.view(O, G, I // G).to(torch.float32) * scale_OG[..., None]
    return F.linear(x, w_OGi.view(O, I).to(x.dtype))


def int4_linear(x: torch.Tensor, packed_OJ: torch.Tensor, scale_OG: torch.Tensor,
                min_OG: torch.Tensor | None) -> torch.Tensor:
    """x W^T for 4-bit W (bridge.int4): packed (out, in / 2) uint8 and float16 scales and minima
    (out, in / 32; float32 from checkpoints saved before them; min None: -8 scale, Q4_0's form);
    W = q * scale + min in float32, rounded once to x's dtype, dequantised per call.
    jax_llama.model.projections.int4_matmul's twin."""
    O, J = packed_OJ.shape
    G = scale_OG.shape[1]
    if activations() == "int8":  # x rounded to 8 bits per group, as JAX's twin does
        x = quantise_activations(x)
    elif activations() == "bfloat16":  # x rounded to bfloat16 (to nearest, ties to even)
        x = round_to_bfloat16(x)
    q_OI = torch.stack([packed_OJ & 0xF, packed_OJ >> 4], dim=-1).view(O, 2 * J)
    min_OG = scale_OG.float() * -8 if min_OG is None else min_OG.float()  # -8 d: exact
    w_OGi = (q_OI.view(O, G, 2 * J // G).to(torch.float32) * scale_OG[..., None].float()
             + min_OG[..., None])
    return F.linear(x, w_OGi.view(O, 2 * J).to(x.dtype))


def quantise_activations(x: torch.Tensor) -> torch.Tensor:
    """x rounded to 8 bits per group of 32 inputs (bridge.int4.activations' rule), in x's dtype,
    computed in float32; the gradient passes straight through.
    jax_llama.model.kernels.quantise_activations' twin."""
    xg = x.to(torch.float32).unflatten(-1, (x.shape[-1] // 32, 32))
    dx = xg.abs().amax(dim=-1, keepdim=True) * torch.tensor(1 / 127, dtype=torch.float32)
    safe = torch.where(dx > 0, dx, torch.ones_like(dx))
    inv = torch.where(dx > 0, 1 / safe, torch.zeros_like(dx))
    xq = (torch.clamp(torch.round(xg * inv), -127, 127) * dx).flatten(-2).to(x.dtype)
    return xq.detach() + (x - x.detach())  # exactly xq


def round_to_bfloat16(x: torch.Tensor) -> torch.Tensor:
    """x rounded to the nearest bfloat16 (ties to even), in x's dtype; the gradient passes straight
    through. jax_llama.model.kernels.round_to_bfloat16's twin."""
    return x.to(torch.bfloat16).to(x.dtype).detach() + (x - x.detach())


def lora_of(model: nn.Module) -> LoraConfig | None:
    """The settings of the LoRA adapters `model`'s projections carry (torch_llama.lora.add_lora
    gives every adapted Linear the same), None when none does."""
    return next((m.lora for m in model.modules() if isinstance(m, Linear) and m.lora is not None),
                None)


class Embedding(Int8Weight, nn.Embedding):
    """The token embedding (vocab, dim) as `weight`: a lookup, and the LM head of a tied model
    (`head`, x W^T). Int8 once quantised (torch_llama.quantize of a tied model): a token's row is
    Q[t] * s[t] in float32 (bridge.quantize.dequantize_weight's numbers), and the head multiplies
    by Q as an int8 Linear does; jax_llama.model.projections.Embed is the twin."""

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if self.weight.dtype != torch.int8:
            return super().forward(tokens)
        q_D, s_G = self.weight[tokens], self.weight_scale[tokens]
        rows = q_D.view(*q_D.shape[:-1], s_G.shape[-1], -1).to(torch.float32) * s_G[..., None]
        return rows.view(q_D.shape)

    def head(self, h: torch.Tensor) -> torch.Tensor:
        if self.weight.dtype != torch.int8:
            return F.linear(h, self.weight.to(h.dtype))
        return int8_linear(h, self.weight, self.weight_scale, self._scale_in(h.dtype))
