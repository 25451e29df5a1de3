"""The optimiser of a LayerSkip run, its learning-rate schedule, the running statistics between two log lines and
the parameter digest that checks replicas stay identical (used by ``train/layerskip.py``)."""

from __future__ import annotations

import hashlib
import math
import time

from train.config import TrainConfig


def param_digest(model) -> str:
    """sha256 of every parameter's bytes: equal on all ranks iff DDP kept the replicas identical."""
    h = hashlib.sha256()
    for name, p in sorted(model.named_parameters()):
        h.update(name.encode())
        h.update(p.detach().float().cpu().numpy().tobytes())
    return h.hexdigest()


def make_optimizer(model, cfg: TrainConfig):
    import torch

    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": cfg.optim.weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.optim.lr, betas=tuple(cfg.optim.betas), eps=cfg.optim.eps)


def lr_factor(step: int, cfg: TrainConfig) -> float:
    """Multiplier of the peak lr at optimiser step ``step``: linear warm-up, then the chosen decay."""
    o = cfg.optim
    if step < o.warmup_steps:
        return (step + 1) / (o.warmup_steps + 1)
    if o.schedule == "constant":
        return 1.0
    progress = (step - o.warmup_steps) / max(1, o.max_steps - o.warmup_steps)
    shape = 0.5 * (1 + math.cos(math.pi * progress)) if o.schedule == "cosine" else 1.0 - progress
    return o.min_lr_ratio + (1.0 - o.min_lr_ratio) * shape


class RunningStats:
    """Sums between two log lines, kept as tensors so the hot loop never calls ``.item()``."""

    def __init__(self, num_layers: int):
        import torch

        self.loss = torch.zeros(())
        self.kl = torch.zeros(())
        self.exit_sum: dict[int, object] = {}
        self.exit_n: dict[int, int] = {}
        self.skipped = torch.zeros(num_layers, dtype=torch.long)
        self.rows = self.micro = self.tokens = 0
        self.grad_norm = None
        self.t0 = time.perf_counter()

    def add(self, out: dict, rows: int, tokens: int) -> None:
        self.loss = self.loss.to(out["loss"].device) + out["loss"].detach().float()  # stays on the device
        if "keep_final_kl" in out:
            self.kl = self.kl.to(out["keep_final_kl"].device) + out["keep_final_kl"].float()
        for j, e in enumerate(out["exits"].tolist()):  # "exits" and "skipped" are CPU tensors
            self.exit_sum[e] = self.exit_sum.get(e, 0.0) + out["exit_losses"][j]
            self.exit_n[e] = self.exit_n.get(e, 0) + 1
        self.skipped += out["skipped"]
        self.rows += rows
        self.micro += 1
        self.tokens += tokens

    def record(self, step: int, lr: float, rates: list[float], world: int) -> dict:
        dt = time.perf_counter() - self.t0
        return {
            "step": step, "lr": lr, "loss": float(self.loss) / max(1, self.micro),
            "exit_loss": {str(e): float(s) / self.exit_n[e] for e, s in sorted(self.exit_sum.items())},
            "skip_rate": [round(float(s) / max(1, self.rows), 4) for s in self.skipped],
            "p_layer": [round(p, 4) for p in rates],
            "keep_final_kl": float(self.kl) / max(1, self.micro),
            "grad_norm": None if self.grad_norm is None else float(self.grad_norm),
            "tokens_per_s": self.tokens * world / dt if dt > 0 else 0.0,
        }
