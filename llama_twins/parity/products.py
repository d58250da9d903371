"""torch's bfloat16 matrix products on a CPU without a bfloat16 matrix kernel.

Where the CPU has AVX-512 BF16, AMX or AVX-512 (BW, VL, DQ), torch multiplies bfloat16 matrices with
oneDNN: float32 accumulation, one rounding to bfloat16. An AVX2-only CPU (AMD Zen 1-3, Intel
before Skylake-SP) has none of these, and torch falls back to a loop that reads one operand with a
stride: on SmolLM2 the tied head's input gradient, (30 x 49,152) @ (49,152 x 576), takes 1.8 s
against 9 ms, and one training step (forward and backward) 5.3 s, 0.65 s with float32_products()
(2-core AMD EPYC Zen 4 under ONEDNN_MAX_CPU_ISA=AVX2; 0.3 s with its AVX-512 oneDNN).

float32_products() computes those products as (a.float() @ b.float()).to(bfloat16): the same
arithmetic (float32 accumulation, one rounding), summed in another order. It is on only where torch
says it has no bfloat16 kernel (torch.ops.mkldnn._is_mkldnn_bf16_supported()), which is what
ONEDNN_MAX_CPU_ISA=AVX2 reports on an AVX-512 machine too.
"""

from __future__ import annotations

NOTE = ("torch's bfloat16 matrix products in float32, rounded once to bfloat16 (torch has no "
        "bfloat16 matrix kernel on this CPU, and its fallback is about 10x slower)")


def torch_lacks_bfloat16_kernel() -> bool:
    import torch

    return not torch.ops.mkldnn._is_mkldnn_bf16_supported()


def float32_products():
    """A context in which torch's bfloat16 mm / addmm / bmm / baddbmm run in float32 and round
    once to bfloat16 (a dispatch mode: it sees the backward pass's products too)."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    aten = torch.ops.aten
    products = {aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default}

    class Float32Products(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func in products and args[0].dtype == torch.bfloat16:
                wide = [a.float() if isinstance(a, torch.Tensor) else a for a in args]
                return func(*wide, **kwargs).to(torch.bfloat16)
            return func(*args, **kwargs)
    return Float32Products()
