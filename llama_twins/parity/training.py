"""The training figures: one step's loss and gradients and the parameters after a few AdamW steps
in both twins, and both optimizers on the same gradients (the optimizer alone)."""

from __future__ import annotations

import copy

import numpy as np

from .judgement import _compare, _compare_tensors, _global_norm

# 5 (10 before): the twins' AdamW steps were two thirds of a report's time on SmolLM2 (torch_llama's
# AdamW, which rounds as optax does, takes 2 s a step there).
ADAMW_STEPS = 5
# The training figures run the project's own recipe (jax_llama.training.step.TrainConfig defaults: lr
# 3e-3, b1 0.9, b2 0.95, weight decay 0.1 on 2-D weights, clipping at 1.0, warmup then cosine)
# but for eps. With eps = 1e-8 Adam divides by sqrt(nu), so a gradient entry that is a cancelling
# sum, near zero and with a relative rounding error of order 1 (its sign, even), steps by up to lr
# differently in the two twins: nothing bounds the figure below ~lr per step, about what a wrong
# decay mask or missing clipping gives (0.5 lr and 1.5 lr measured after 10 steps), though tiny
# models measure 1e-3 - 7e-3 lr. eps = 1e-3, a fraction of a typical clipped gradient entry of a
# small model, keeps Adam's normalisation for the large entries while a near-zero one steps by
# ~lr * g / eps, smooth in g: rounding then moves parameters by 4e-5 lr (tests/test_train.py
# uses eps = 1 for the same reason).
ADAMW_EPS = 1e-3
# The perturbed float64 runs beside the plain one (llama_twins.float64.Perturbation), whose
# spread the trajectory is judged against: two, so that one run's luck in where its noise fell
# does not set the bound (on SmolLM2 two runs' spreads differ by 1-40%).
PERTURBED_RUNS = 2


def perturbation(config, dtype: str, seed: int):
    """The perturbed runs of a report in `dtype`: each step's gradient entries moved by up to
    U x (blocks + 1) of their tensor's largest entry (one rounding of the dtype for each block
    a gradient passes through, forward and back, and the head: a fraction of the budget of the
    gradients figure, BUDGET[dtype]["grad"] per op; the twins' own first gradients measure 1-4
    U per op on SmolLM2 in float32), the weights rounded to `dtype` after each step."""
    from ..float64 import Perturbation
    from .judgement import U

    return Perturbation(runs=PERTURBED_RUNS, size=U[dtype] * (config.n_layers + 1),
                        stored=dtype, seed=seed)


def _training_checks(model, params, tmodel, tokens, tc, truth, dtype: str
                     ) -> tuple[list[dict], dict[str, np.ndarray]]:
    """(rows, JAX's gradients of the first step by canonical name). Loss and gradients of one
    step of mean next-token cross-entropy on the batch (the same ids, no padding:
    jax_llama.training.step.loss_fn takes no attention mask), then the parameters after
    tc.steps steps on that batch of jax_llama.training.step's optimizer and of torch_llama.AdamW with the
    same hyperparameters and schedule; each against the float64 run of the same (`truth`).
    Memory: one twin trains at a time, and only its first gradients and its last parameters
    outlive its run; the figures are reduced tensor by tensor."""
    import jax
    import optax
    import torch
    import torch_llama
    from jax_llama.checkpoint import tensor_specs
    from jax_llama.training.step import loss_fn, make_optimizer

    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:],
             "mask": np.ones(tokens[:, 1:].shape, np.int32)}
    grad_fn = jax.jit(jax.value_and_grad(lambda p, b: loss_fn(p, model, b)))
    optimizer = make_optimizer(tc)

    def step(grads, opt_state, trained):
        updates, opt_state = optimizer.update(grads, opt_state, trained)
        return optax.apply_updates(trained, updates), opt_state
    # the step's inputs are consumed (params, the caller's, is copied first)
    step = jax.jit(step, donate_argnums=(1, 2))  # the state and the parameters
    trained = jax.tree.map(lambda x: x.copy(), params)
    opt_state = optimizer.init(trained)
    for i in range(tc.steps):
        loss, grads = grad_fn(trained, batch)
        if i == 0:
            jax_loss = float(loss)
            jax_grads = jax.tree.map(np.array, grads)
        trained, opt_state = step(grads, opt_state, trained)
    del opt_state
    jax_grads = tensor_specs(jax_grads, model.config)[1]
    jax_trained = tensor_specs(jax.tree.map(np.asarray, trained), model.config)[1]

    twin = copy.deepcopy(tmodel).train()  # the caller's model stays as it was
    weights = list(twin.parameters())
    opt = _torch_optimizer(weights, tc)
    inputs = torch.as_tensor(batch["inputs"])
    targets = torch.as_tensor(batch["targets"], dtype=torch.long).flatten()
    for i in range(tc.steps):
        loss = torch.nn.functional.cross_entropy(twin(inputs).flatten(0, 1), targets)  # all real
        loss.backward()
        if i == 0:
            torch_loss = float(loss.detach())
            torch_grads = {name: p.grad.detach().clone() for name, p in twin.named_parameters()}
        torch_llama.clip_by_global_norm(weights, tc.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
    del opt, weights
    torch_trained = twin.state_dict()

    names = list(torch_grads)
    compared, exact = "torch vs JAX", truth is not None
    depth = model.config.n_layers + 1  # the blocks and the head, forward then backward
    t_loss = truth.loss if exact else None
    norms = {"JAX": _global_norm(jax_grads, names), "torch": _global_norm(torch_grads.get, names)}
    t_norm = _global_norm(truth.grads.get, names) if exact else None
    grads = _compare_tensors("gradients", compared, names, {"JAX": jax_grads,
                                                             "torch": torch_grads.get},
                             truth.grads.get if exact else None, dtype, "grad", ops=depth)
    grads["detail"] = f"relative to the largest; max abs {grads['max_abs']:.2e}"
    spreads = [s["max"] / tc.lr for s in truth.spreads] if exact and truth.spreads else None
    detail = f"max abs / lr; lr {tc.lr:g}, eps {tc.eps:g}"
    if spreads:
        detail += (f"; perturbed float64 runs {', '.join(f'{x:.2e}' for x in spreads)} lr from "
                   f"the plain one (in {truth.spreads[int(np.argmax(spreads))]['tensor']})")
    return [
        _compare("loss, one step", compared, {"JAX": jax_loss, "torch": torch_loss}, t_loss, dtype,
                 "loss", detail=f"relative; loss {jax_loss:.6f}", ops=depth),
        _compare("gradient norm", compared, norms, t_norm, dtype, "grad_norm",
                 detail=f"relative; norm {norms['JAX']:.4g}", ops=depth),
        grads,
        _compare_tensors(f"parameters after {tc.steps} AdamW steps", compared, names,
                         {"JAX": jax_trained, "torch": torch_trained.get},
                         truth.trained.get if exact else None, dtype, "adamw", scale=tc.lr,
                         detail=detail, ops=tc.steps,
                         storage=_storage(dtype, tc, _largest(jax_trained, names)),
                         spread=max(spreads) if spreads else None),
    ], {name: np.asarray(jax_grads(name)) for name in names}


def _optimizer_check(model, tmodel, tc, held: dict[str, np.ndarray], grads0: dict,
                     reference_f64: bool) -> dict:
    """Both twins' optimizers (jax_llama.training.step.make_optimizer; torch_llama's clipping and AdamW
    with its decay mask) for tc.steps steps from `held` (the checkpoint in the report's dtype),
    held in float32 as training keeps its master weights, each step given the same gradients: grads0
    (the float64 run's first gradients) scaled at step k to a global norm of (k + 2) x the
    clipping threshold, so that clipping acts at every step, by a different factor. The model's
    own gradients do not enter, so the figure sees the optimizer alone and is judged as float32 in
    every report: in bfloat16 a wrong decay mask or missing clipping moves the parameters less
    than their rounding, and the figure of the training steps cannot see it."""
    import jax
    import optax
    import torch

    import torch_llama
    from jax_llama.checkpoint import params_from_tensors, tensor_specs
    from jax_llama.training.step import make_optimizer

    names = list(held)
    norm = _global_norm(grads0.__getitem__, names)
    factor = (tc.grad_clip or 1.0) / norm if norm > 0 else 0.0
    scales = [np.float32((k + 2) * factor) for k in range(tc.steps)]
    # step k's gradients: base * scales[k] rounded to float32, the same numbers for all three
    base = {n: np.asarray(grads0[n], np.float32) for n in names}

    optimizer = make_optimizer(tc)

    def step(grads, scale, state, trained):  # g * scale: one float32 rounding
        grads = jax.tree.map(lambda g: g * scale, grads)
        updates, state = optimizer.update(grads, state, trained)
        return optax.apply_updates(trained, updates), state
    step = jax.jit(step, donate_argnums=(2, 3))
    trained = params_from_tensors(lambda n: held[n].astype(np.float32), model.config,
                                  dtype="float32")
    state = optimizer.init(trained)
    grads = params_from_tensors(base.__getitem__, model.config, dtype="float32")
    for k in range(tc.steps):
        trained, state = step(grads, scales[k], state, trained)
    del state, grads
    jax_trained = tensor_specs(jax.tree.map(np.asarray, trained), model.config)[1]

    twin = copy.deepcopy(tmodel).float()  # float32 master weights; the caller's model stays
    twin.load_state_dict({n: torch.from_numpy(held[n].astype(np.float32)) for n in names})
    weights = dict(twin.named_parameters())
    opt = _torch_optimizer(list(weights.values()), tc)
    for k in range(tc.steps):
        for n, p in weights.items():
            p.grad = torch.mul(torch.from_numpy(base[n]), float(scales[k]))
        torch_llama.clip_by_global_norm(list(weights.values()), tc.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
    del opt, weights
    torch_trained = twin.state_dict()

    truth = None
    if reference_f64:
        from ..float64 import adamw_steps
        recipe = _float64_recipe(tc)
        # the global norm of step k's gradients is scales[k] x norm (to float32 rounding), so
        # the float64 optimizer runs one tensor at a time
        norms = [float(scale) * norm for scale in scales]

        def truth(n):
            return adamw_steps(held[n], base[n], scales, norms, recipe)
    row = _compare_tensors(f"AdamW on shared gradients, {tc.steps} steps", "torch vs JAX", names,
                           {"JAX": jax_trained, "torch": torch_trained.get}, truth, "float32",
                           "optimizer", scale=tc.lr, ops=tc.steps,
                           storage=_storage("float32", tc, _largest(jax_trained, names)),
                           detail="max abs / lr; float32 master weights in every dtype, the same "
                                  "gradients in both")
    return row


def _storage(dtype: str, tc, largest: float) -> float:
    """What keeping the weights in `dtype` costs a trajectory of tc.steps steps, in learning
    rates: one rounding (U x |w|) of the largest weight per step."""
    from .judgement import U

    return tc.steps * U[dtype] * largest / tc.lr


def _largest(get, names) -> float:
    return max(float(np.abs(np.asarray(get(n), np.float32)).max()) for n in names)


def _torch_optimizer(weights, tc):
    """torch_llama.AdamW with tc's hyperparameters, schedule and the decay mask (clipping is the
    caller's, torch_llama.clip_by_global_norm before each step)."""
    import torch_llama

    schedule = torch_llama.warmup_cosine_decay_schedule(0.0, tc.lr, tc.warmup_steps, tc.steps,
                                                        tc.lr * tc.end_lr_ratio)
    return torch_llama.AdamW(weights, lr=schedule, betas=(tc.b1, tc.b2), eps=tc.eps,
                             weight_decay=tc.weight_decay, mask=torch_llama.decay_mask)


def _float64_recipe(tc):
    """tc's optimizer as the float64 run takes it (llama_twins.float64.AdamW)."""
    from ..float64 import AdamW

    return AdamW(steps=tc.steps, lr=tc.lr, warmup_steps=tc.warmup_steps,
                 end_lr_ratio=tc.end_lr_ratio, b1=tc.b1, b2=tc.b2, eps=tc.eps,
                 weight_decay=tc.weight_decay, grad_clip=tc.grad_clip)
