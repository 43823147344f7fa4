"""Weight prediction for asynchronous pipelines: a stage's weights s
updates ahead of its live ones, from the optimizer's view of the gradients.

- ``adam`` (XPipe, formulas (3) and (4)): s Adam steps with the current
  bias-corrected moments, W - s * lr * m_hat / (sqrt(v_hat) + eps). With
  Adam as the optimizer these are its own moments; with another optimizer
  the predictor keeps Adam's moments of the stage's gradients itself
  (beta1 0.9, beta2 0.999, eps 1e-8, torch's Adam defaults; the paper's
  values were lost with its formulas), updated with each mini-batch's
  reduced gradient before the optimizer steps.
- ``momentum`` (SpecTrain): s steps along momentum SGD's buffer, W - s * lr
  * buf, which is how far torch's SGD with momentum moves the weights in s
  steps if the buffer stays as it is.

Before the first update there is nothing to extrapolate, and the prediction
is the live weights. Which schedule uses which predictor is the core's
(``SCHEDULE_PREDICTORS``).
"""

from __future__ import annotations

import torch
from torch import nn

BETAS = (0.9, 0.999)
EPS = 1e-8


class AdamPrediction:
    """XPipe's predictor over ``params``, driven by ``optimizer``."""

    def __init__(self, params: list[nn.Parameter], optimizer):
        self.params = params
        self.optimizer = optimizer
        self.own = not isinstance(optimizer, torch.optim.Adam)
        # Moments kept here when the optimizer has none of Adam's.
        self.step = 0
        self.exp_avg = [torch.zeros_like(p) for p in params] if self.own else []
        self.exp_avg_sq = [torch.zeros_like(p) for p in params] if self.own else []

    def observe(self) -> None:
        """Take this mini-batch's gradients (in ``p.grad``) into the moments."""
        if not self.own:
            return  # Adam updates its own moments in its step
        self.step += 1
        b1, b2 = BETAS
        for p, m, v in zip(self.params, self.exp_avg, self.exp_avg_sq):
            g = p.grad if p.grad is not None else torch.zeros_like(p)
            m.mul_(b1).add_(g, alpha=1 - b1)
            v.mul_(b2).addcmul_(g, g, value=1 - b2)

    def _moments(self, i: int, p: nn.Parameter):
        """(step, exp_avg, exp_avg_sq, beta1, beta2, eps, lr) for parameter i."""
        group = self.optimizer.param_groups[0]
        if self.own:
            return self.step, self.exp_avg[i], self.exp_avg_sq[i], *BETAS, EPS, group["lr"]
        state = self.optimizer.state.get(p, {})
        if not state:
            return 0, None, None, *group["betas"], group["eps"], group["lr"]
        return int(state["step"]), state["exp_avg"], state["exp_avg_sq"], *group["betas"], group["eps"], group["lr"]

    @torch.no_grad()
    def predict(self, updates: int) -> list[torch.Tensor]:
        """The weights ``updates`` Adam steps ahead, as new tensors."""
        out = []
        for i, p in enumerate(self.params):
            step, m, v, b1, b2, eps, lr = self._moments(i, p)
            if updates == 0 or step == 0:
                out.append(p.detach().clone())
                continue
            m_hat = m / (1 - b1**step)
            v_hat = v / (1 - b2**step)
            out.append(p - updates * lr * m_hat / (v_hat.sqrt() + eps))
        return out

    def state_dict(self) -> dict:
        """What a checkpoint keeps: the own moments (Adam's are the optimizer's)."""
        return {"step": self.step, "exp_avg": self.exp_avg, "exp_avg_sq": self.exp_avg_sq}

    def load_state_dict(self, state: dict) -> None:
        self.step = int(state["step"])
        for mine, saved in ((self.exp_avg, state["exp_avg"]), (self.exp_avg_sq, state["exp_avg_sq"])):
            for t, s in zip(mine, saved):
                t.copy_(s)


class MomentumPrediction:
    """SpecTrain's predictor over ``params``: needs SGD with momentum."""

    def __init__(self, params: list[nn.Parameter], optimizer):
        group = optimizer.param_groups[0] if optimizer is not None else {}
        if params and not (isinstance(optimizer, torch.optim.SGD) and group.get("momentum", 0) > 0):
            raise ValueError("SpecTrain's prediction needs SGD with momentum")
        self.params = params
        self.optimizer = optimizer

    def observe(self) -> None:
        """The optimizer's momentum buffer is the state; nothing to keep."""

    @torch.no_grad()
    def predict(self, updates: int) -> list[torch.Tensor]:
        out = []
        for p in self.params:
            buf = self.optimizer.state.get(p, {}).get("momentum_buffer")
            if updates == 0 or buf is None:
                out.append(p.detach().clone())
                continue
            out.append(p - updates * self.optimizer.param_groups[0]["lr"] * buf)
        return out

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


#: Predictor classes by the core's predictor names.
PREDICTORS = {"adam": AdamPrediction, "momentum": MomentumPrediction}
