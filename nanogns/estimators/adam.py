"""
The Adam-preconditioned gradient noise scale of the normalisation layers (--gns_adam=True).

Adam moves each parameter along P g, P = 1 / (sqrt(v_hat) + eps) with v_hat the bias-corrected
exp_avg_sq (with amsgrad, the running maximum max_exp_avg_sq), so the noise that sets how far a
step goes is that of P g, not of g (AdaptDL/Pollux, Qiao et al. 2021, measure the GNS of the
preconditioned gradient for this reason). The update of step t divides by the state after it
has taken in g_t itself; P is taken from the state before (after step t-1), which does not
depend on this step's gradient, so that it is one fixed diagonal for every example and
micro-step of the step. With it, McCandlish's two squared norms (App. A, B_small = 1) become

    |P G_B|^2 = sum_d P_d^2 G_d^2                       from p.grad, after the last micro-step,
    |P G_1|^2 = (1/B) sum_b ||P g_b||^2 = B sum_d P_d^2 S_d,  S_d = sum_b (g_bd / B)^2,

and since P is diagonal, S (one float32 per coordinate, summed over micro-steps) is all the layers
must keep: P is applied when the step is measured. The normalisation layers' per-example
gradients are small materialised vectors (dgamma_b, dbeta_b), so keeping S costs a square and a
sum over [B, D] per layer (nanogns.layers.register_coordinate_buffers); a weight matrix would need its
per-example gradient itself, which is why only the normalisation layers are measured here.
Under DDP the ranks' S are summed and divided by W^2 as the exact estimator's sums are; under a
float16 GradScaler both norms carry s^2. The first step has no optimizer state: nothing is logged. Only torch.optim.Adam and AdamW are
taken (other optimizers have no such preconditioner, or another one): anything else is refused.

Logged as its own estimator under train/adam_gns/<parameter>/norm, /pegn and /batch_size (the
columns of every per-parameter estimator: gns-analysis.py analyses it like the others).
"""
import math

import torch

from nanogns.layers import allreduce_buffers, layer_kinds, register_coordinate_buffers
from nanogns.estimators.base import Estimator, current_scale, unwrap
from nanogns.maths import EMA_BETA, NORM_KINDS, PREFIXES, GradientNoiseScale, parameter_columns


class AdamGNS(Estimator):
    """The Adam-preconditioned GNS of the model's measured normalisation layers (module docstring),
    from `optimizer` (torch.optim.Adam or AdamW: its exp_avg_sq or, with amsgrad, max_exp_avg_sq,
    step, betas and eps)."""
    name = PREFIXES["adam"]
    label = "adam gns"
    deferred = False  # its sums are read when collected, each step

    def __init__(self, model, optimizer, world_size=1, beta=EMA_BETA):
        if not isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
            raise ValueError(f"the Adam-preconditioned GNS needs torch.optim.Adam or AdamW, whose update it "
                             f"measures; {type(optimizer).__name__} keeps no such preconditioner")
        self.model, self.optimizer, self.world_size = unwrap(model), optimizer, int(world_size)
        kinds = layer_kinds(self.model)
        norm_params = {id(p) for name, p in self.model.named_parameters() if kinds.get(name) in NORM_KINDS}
        self.entries = register_coordinate_buffers(self.model, norm_params)  # (name, parameter, buffer)
        if not self.entries:
            raise ValueError("the Adam-preconditioned GNS measures the normalisation layers, and this model has no "
                             "measured LayerNorm or RMSNorm that keeps per-coordinate sums (use --lnclass=shim, "
                             "or measure(model, norm='shim'))")
        self.groups = {id(p): group for group in optimizer.param_groups for p in group["params"]}
        missing = [name for name, p, _ in self.entries if id(p) not in self.groups]
        if missing:
            raise ValueError(f"the optimizer does not update {missing[0]}: its preconditioner is unknown")
        self.gns = GradientNoiseScale(beta=beta)
        self.skipped_steps = 0

    def preconditioner(self, p):
        """P = 1 / (sqrt(v_hat) + eps) of parameter p from the optimizer's state, or None before its first step."""
        state = self.optimizer.state.get(p) or {}
        group = self.groups[id(p)]
        second = "max_exp_avg_sq" if group.get("amsgrad") else "exp_avg_sq"  # what the update divides by
        if second not in state:
            return None
        step = state["step"]  # a tensor, on the GPU for fused AdamW: float() of it would wait for the GPU
        step = step.float() if isinstance(step, torch.Tensor) else step
        v_hat = state[second].float() / (1 - group["betas"][1] ** step)
        return 1 / (v_hat.sqrt() + group["eps"])

    @torch.no_grad()
    def sums(self, step, examples, scaler, skipped=None):
        if self.world_size > 1:  # every rank's per-coordinate sums, as the exact estimator's buffers
            allreduce_buffers([buffer for _, _, buffer in self.entries])
        live = [(name, p, buffer, self.preconditioner(p)) for name, p, buffer in self.entries if p.grad is not None]
        live = [entry for entry in live if entry[3] is not None]
        if not live or examples < 2:
            return None, None
        scale = current_scale(scaler)
        # P has the parameter's shape, the per-coordinate sums are flat (any normalized_shape)
        squares = torch.stack([(P.square() * p.grad.float().square()).sum() for _, p, _, P in live] +
                              [(P.square().reshape(-1) * buffer).sum() for _, _, buffer, P in live])
        if isinstance(scale, torch.Tensor):
            squares = torch.cat([squares, scale.float().reshape(1).to(squares.device)])
        return squares, ([name for name, _, _, _ in live], examples, scale)

    def finish(self, host, context):
        if context is None:
            return {}
        names, examples, scale = context
        n = len(names)
        s = host[2 * n] if isinstance(scale, torch.Tensor) else scale
        row, small_total, big_total = {}, 0.0, 0.0
        finite = all(math.isfinite(v) for v in host) and s > 0
        self.skipped_steps += not finite
        for name, big, small in zip(names, host[:n], host[n:2 * n]):
            big_norm = small_norm = math.inf
            if finite:
                big_norm = math.sqrt(big / s ** 2)
                small_norm = math.sqrt(max(examples * small / s ** 2 / self.world_size ** 2, 0.0))
                big_total, small_total = big_total + big_norm ** 2, small_total + small_norm ** 2
            row.update(parameter_columns(self.name, name, big_norm, small_norm, examples))
        if finite:
            self.gns.update(small_total, big_total, 1, examples)
        return row

    def reset(self):
        torch._foreach_zero_([buffer for _, _, buffer in self.entries])

