"""AdamW, global-norm clipping and learning-rate schedules with optax's exact semantics.

jax_llama trains with `optax.chain(optax.clip_by_global_norm(c), optax.adamw(schedule, ...))`; these
are the torch twins of those pieces: the same formulas, evaluated in the same order and dtype. In
float32 on CPU, given the same gradients, parameters and learning rates equal optax's bit for bit
when optax runs op by op; inside `jax.jit`, XLA fuses a*b+c into FMAs and turns x/const into
x*(1/const), which moves optax itself by an ulp or so per step.

Bit-exactness needs the same float32 cos and pow as XLA on CPU, which calls the C library's
`cosf`/`powf` (the cosine schedule, Adam's bias correction 1 - b**t): we call them through ctypes.
Where no C math library loads, float64 math rounded to float32 stands in (1 ulp off at times).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import math
from typing import Callable, Iterable

import numpy as np
import torch

_f32 = np.float32
Schedule = Callable[[int], float]


@functools.lru_cache(maxsize=None)
def _libm():
    try:
        lib = ctypes.CDLL(ctypes.util.find_library("m") or "libm.so.6")
        for name in ("cosf", "powf"):
            getattr(lib, name).restype = ctypes.c_float
        lib.cosf.argtypes = [ctypes.c_float]
        lib.powf.argtypes = [ctypes.c_float, ctypes.c_float]
        return lib
    except (OSError, AttributeError):
        return None


def _cosf(x) -> np.float32:
    lib = _libm()
    return _f32(lib.cosf(x) if lib else math.cos(x))


def _powf(x, y) -> np.float32:
    lib = _libm()
    return _f32(lib.powf(x, y) if lib else float(_f32(x)) ** float(_f32(y)))


def _power(x: np.float32, y) -> np.float32:
    """x**y as jnp.power evaluates it: a Python int exponent by binary exponentiation
    (lax.integer_pow), any other exponent by powf."""
    if not isinstance(y, (int, np.integer)):
        return _powf(x, y)
    n, acc = abs(y), _f32(1) if y == 0 else None
    while n:
        if n & 1:
            acc = x if acc is None else acc * x
        n >>= 1
        x = x * x if n else x
    return _f32(1) / acc if y < 0 else acc


# -- schedules: plain functions of the 0-based update count, float32 like optax's ----------------

def linear_schedule(init_value: float, end_value: float, transition_steps: int,
                    transition_begin: int = 0) -> Schedule:
    """optax.linear_schedule: init_value -> end_value over transition_steps, after transition_begin."""
    if transition_steps <= 0:
        return lambda count: float(_f32(init_value))
    transition_begin = max(transition_begin, 0)

    def schedule(count: int) -> float:
        count = min(max(int(count) - transition_begin, 0), transition_steps)
        frac = _f32(1) - _f32(count) / _f32(transition_steps)
        # optax: (init - end) is Python float arithmetic, then weakly typed into float32
        return float(_f32(init_value - end_value) * frac + _f32(end_value))

    return schedule


def cosine_decay_schedule(init_value: float, decay_steps: int, alpha: float = 0.0,
                          exponent: float = 1.0) -> Schedule:
    """optax.cosine_decay_schedule: init_value * ((1 - alpha) * c**exponent + alpha), with
    c = (1 + cos(pi * min(count, decay_steps) / decay_steps)) / 2."""
    if not decay_steps > 0:
        raise ValueError(f"cosine_decay_schedule: decay_steps must be positive (got {decay_steps})")

    def schedule(count: int) -> float:
        count = min(_f32(count), _f32(decay_steps))
        cosine = _f32(0.5) * (_f32(1) + _cosf(_f32(math.pi) * count / _f32(decay_steps)))
        decayed = _f32(1 - alpha) * _power(cosine, exponent) + _f32(alpha)
        return float(_f32(init_value) * decayed)

    return schedule


def warmup_cosine_decay_schedule(init_value: float, peak_value: float, warmup_steps: int,
                                 decay_steps: int, end_value: float = 0.0,
                                 exponent: float = 1.0) -> Schedule:
    """optax.warmup_cosine_decay_schedule: linear init_value -> peak_value over warmup_steps, then
    cosine decay to end_value; decay_steps counts the warmup too (optax's join_schedules)."""
    alpha = 0.0 if peak_value == 0.0 else end_value / peak_value
    warmup = linear_schedule(init_value, peak_value, warmup_steps)
    decay = cosine_decay_schedule(peak_value, decay_steps - warmup_steps, alpha, exponent)
    return lambda count: warmup(count) if count < warmup_steps else decay(count - warmup_steps)


# -- clipping ------------------------------------------------------------------------------------

@torch.no_grad()
def clip_by_global_norm(parameters_or_grads: torch.Tensor | Iterable[torch.Tensor],
                        max_norm: float) -> torch.Tensor:
    """optax.clip_by_global_norm, in place. Returns the global norm before clipping (0-dim tensor).

    Takes parameters (their .grad is clipped; those with grad None are skipped) or plain gradient
    tensors (no requires_grad; clipped themselves). norm = sqrt(sum_i sum(g_i * g_i)); if
    norm < max_norm the grads are left untouched, else each g becomes (g / norm) * max_norm.
    Unlike torch.nn.utils.clip_grad_norm_, which multiplies every grad by
    min(1, max_norm / (norm + 1e-6)), there is no 1e-6 and a clipped norm is max_norm itself.
    """
    items = [parameters_or_grads] if isinstance(parameters_or_grads, torch.Tensor) else parameters_or_grads
    grads = []
    for x in items:
        g = x.grad if isinstance(x, torch.nn.Parameter) or x.requires_grad else x
        if g is not None:
            grads.append(g)
    if not grads:
        return torch.zeros(())
    device = grads[0].device
    total = 0  # optax: a left fold from 0 over per-leaf sums, each leaf summed in >= float32
    for g in grads:
        total = total + (g * g).sum(dtype=torch.promote_types(g.dtype, torch.float32)).to(g.dtype).to(device)
    norm = torch.sqrt(total)
    if bool(norm < max_norm):  # one host sync a step; the grads are left as they are
        return norm
    for g in grads:  # g / norm, then * max_norm: two roundings, as optax's
        g.div_(norm.to(g.device, g.dtype)).mul_(max_norm)
    return norm


# -- AdamW ---------------------------------------------------------------------------------------

def decay_mask(param: torch.Tensor) -> bool:
    """The project's weight-decay rule: 2-D weights (linear layers, embeddings) decay; RMSNorm gains,
    biases and other vectors do not (jax_llama.training.step.decay_mask, kernels and embeddings)."""
    return param.ndim == 2


# --8<-- [start:adamw]
class AdamW(torch.optim.Optimizer):
    """optax.adamw(lr, b1, b2, eps, eps_root, weight_decay=, mask=) as a torch optimizer.

    lr: a float, or a schedule(count) -> float of the 0-based number of updates already done (the
    first step uses schedule(0), as optax's scale_by_learning_rate). mask: None (decay every
    parameter, optax's default), a bool, or a callable(param) -> bool such as `decay_mask`. Each param
    group may override lr, betas, eps, eps_root, weight_decay and mask (e.g. mask=False).
    Per step t = 1, 2, ... (state: count, mu, nu in the parameter's dtype):
        mu = (1 - b1) * g + b1 * mu                   nu = (1 - b2) * (g * g) + b2 * nu
        u = (mu / (1 - b1**t)) / (sqrt(nu / (1 - b2**t) + eps_root) + eps)
        u = u + weight_decay * p   (where mask says so)          p = p + (-lr) * u
    with 1 - b**t computed in float32 and cast to the moment's dtype, as optax does.

    torch.optim.AdamW is the same method in exact arithmetic but rounds differently: it decays
    first (p *= 1 - lr * wd), updates mu with lerp and nu with addcmul, takes the bias corrections
    in float64, folds lr / (1 - b1**t) into one step size and divides sqrt(nu) by sqrt(1 - b2**t)
    before adding eps; it has no eps_root, no mask (use param groups) and defaults to
    weight_decay=1e-2 (optax: 1e-4). Use this class when a run must reproduce jax_llama's.
    Bit-exactness is for float32 parameters: in bfloat16/float16 XLA rounds the scalars (lr, eps)
    to the parameter dtype and torch computes with them in float32.
    """

    def __init__(self, params, lr: float | Schedule = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8,
                 eps_root: float = 0.0, weight_decay: float = 1e-4, mask=None):
        if not callable(lr) and not lr >= 0.0:
            raise ValueError(f"AdamW: lr must be >= 0 or a schedule (got {lr})")
        if not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"AdamW: betas must lie in [0, 1) (got {betas})")
        if not (eps >= 0.0 and eps_root >= 0.0):
            raise ValueError(f"AdamW: eps and eps_root must be >= 0 (got {eps}, {eps_root})")
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, eps_root=eps_root,
                        weight_decay=weight_decay, mask=mask)
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            b1, b2 = group["betas"]
            lr, wd, mask = group["lr"], group["weight_decay"], group["mask"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("AdamW: sparse gradients are not supported")
                g, state = p.grad, self.state[p]
                if not state:
                    state["count"] = 0
                    state["mu"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["nu"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                step_size = float(_f32(lr(state["count"]) if callable(lr) else lr))
                state["count"] += 1
                t, mu, nu = state["count"], state["mu"], state["nu"]

                # No add_(x, alpha=) anywhere: torch may fuse that into an FMA, optax rounds twice.
                # a and b: scratch the size of p, reused by every parameter and step (fresh
                # temporaries of a large model cost more in page faults than the arithmetic).
                a, b = self._scratch(p)
                mu.mul_(b1).add_(torch.mul(g, 1 - b1, out=a))
                nu.mul_(b2).add_(torch.mul(g, g, out=a).mul_(1 - b2))
                denominator = _sqrt(torch.div(nu, _correction(b2, t, nu), out=a)
                                    .add_(group["eps_root"])).add_(group["eps"])
                u = torch.div(mu, _correction(b1, t, mu), out=b).div_(denominator)
                decays = mask(p) if callable(mask) else (True if mask is None else bool(mask))
                if decays and not (isinstance(wd, (int, float)) and wd == 0.0):
                    u.add_(torch.mul(p, wd, out=a))
                p.add_(u.mul_(-step_size))
        return loss

    def _scratch(self, p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Two scratch tensors shaped like p, views of two flat buffers per dtype and device
        that grow to the largest parameter (not kept in state_dict)."""
        buffers = self.__dict__.setdefault("_buffers", {})
        key, n = (p.dtype, p.device), p.numel()
        if key not in buffers or buffers[key][0].numel() < n:
            buffers[key] = (torch.empty(n, dtype=p.dtype, device=p.device),
                            torch.empty(n, dtype=p.dtype, device=p.device))
        return tuple(flat[:n].view(p.shape) for flat in buffers[key])
# --8<-- [end:adamw]


def _correction(decay: float, count: int, moment: torch.Tensor) -> torch.Tensor:
    """1 - decay**count in float32, as a 0-dim tensor on the moment's device and in its dtype (a
    tensor, not a Python number: CUDA divides by a host scalar as a multiply by its reciprocal)."""
    value = _f32(1) - _powf(decay, count)
    return torch.full((), float(value), dtype=moment.dtype, device=moment.device)


def _sqrt(x: torch.Tensor) -> torch.Tensor:
    """IEEE (correctly rounded) sqrt, as XLA's, in place (x is a temporary of the step). torch's
    CPU float32 sqrt goes through MKL's vector math, which is off by 1 ulp for ~0.7% of inputs;
    numpy's float32 sqrt is the instruction itself (sqrtps), correctly rounded, and 20x cheaper
    than a float64 sqrt rounded back."""
    if x.device.type == "cpu" and x.dtype == torch.float32 and x.is_contiguous():
        values = x.numpy()
        np.sqrt(values, out=values)
        return x
    return torch.sqrt(x)
