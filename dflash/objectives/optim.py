"""The drafter's optimizer: AdamW, or Muon for its weight matrices with AdamW for the rest.

Muon (torch.optim.Muon) orthogonalises each update of a 2-D weight matrix; it is meant for the hidden
layers' matrices only, so, as the peers do, the parameters it does not take go to AdamW: norms and
biases (not 2-D), and the vocabulary-indexed tables (rows looked up or scored per token, not a map
applied): any 2-D parameter that is not a linear layer's weight (DFlash2's codebooks, DSpark's Markov
embedding) and a linear layer marked ``not_for_muon`` (DSpark's Markov projection, [V, r]). Those tables
are AdamW's but at Muon's learning rate, in a group of their own: they replace what Muon would have
trained, and at AdamW's base rate a 10x lower ``--muon-lr`` left DSpark's Markov head all but untrained
(speculators' finding). The drafter's own embedding and LM head are the target's, frozen, and not here.

``--muon-lr`` defaults to ``--lr``: the update is scaled to AdamW's RMS (``match_rms_adamw``), so the
same peak rate means the same step size per matrix (speculators' default since its lr defaults moved
to lr 1e-3, muon_lr = lr).

Both run with the non-finite guard's contract (dflash/train/health/nonfinite.py): a step is skipped on the
device when ``found_inf`` is 1, with no host sync. Fused AdamW reads ``found_inf`` itself; torch's
Muon does not, so ``GuardedMuon`` takes the same step with the skip folded into its arithmetic.

torch's Muon lives in a private module (``torch.optim._muon``), imported only when Muon is asked for
(``muon_classes``): a torch without it refuses ``--optimizer muon`` in one line and runs AdamW as ever.

The learning-rate schedule scales every group's ``lr`` from its ``lr_scale`` (the Muon group's and the
tables' ``muon_lr / lr``), so one schedule drives all.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from dflash.model.drafter import NOT_FOR_MUON

#: the names ``--optimizer`` takes
OPTIMIZERS = ("adamw", "muon")
#: the peers' Muon settings (speculators' defaults): momentum, Newton-Schulz steps, and the update scaled
#: to AdamW's RMS so that AdamW's learning rate and weight decay carry over
MUON_MOMENTUM = 0.95
MUON_NS_STEPS = 5
MUON_ADJUST_LR = "match_rms_adamw"
#: --muon-lr's default, as a multiple of --lr (speculators' default: the RMS-matched update needs no
#: multiplier)
MUON_LR_SCALE = 1.0
ADAMW_BETAS = (0.9, 0.95)


class MuonUnavailable(RuntimeError):
    """This torch has no Muon to run ``--optimizer muon`` with."""


def guarded_muon() -> type:
    """The GuardedMuon class, importing torch's private Muon module now; MuonUnavailable, one line
    naming this torch, where it has none."""
    try:
        return _guarded_muon()
    except (ImportError, AttributeError):
        raise MuonUnavailable(f"optimizer: --optimizer muon needs torch.optim.Muon (torch 2.9 or later), and "
                              f"this torch ({torch.__version__}) has none; use --optimizer adamw") from None


def orthogonalise_f32(grad: torch.Tensor, coefficients: tuple[float, float, float], steps: int,
                      eps: float) -> torch.Tensor:
    """Muon's Newton-Schulz orthogonalisation (the quintic iteration torch's Muon runs: ``X <- aX +
    (bA + cA^2)X`` with ``A = XX^T``, on the wide orientation, from ``X / ||X||``) in float32 rather than
    bfloat16: on a CPU bfloat16 matmuls are ten times slower than float32 ones, which made a tiny
    drafter's Muon step cost more than its forward and backward together."""
    a, b, c = coefficients
    x = grad.float()
    tall = x.shape[0] > x.shape[1]
    if tall:
        x = x.T
    x = x / x.norm().clamp(min=eps)
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + torch.addmm(gram, gram, gram, beta=b, alpha=c) @ x
    return x.T if tall else x


@functools.cache
def _guarded_muon() -> type:
    from torch.optim._muon import _adjust_lr, _zeropower_via_newtonschulz

    class GuardedMuon(torch.optim.Muon):
        """torch's Muon whose step honours ``found_inf`` (a 0-dim float tensor on the parameters' device,
        1 = skip) without reading it on the host: the gradient is replaced by zeros, and the momentum's
        blend, the weight decay and the update are multiplied by ``1 - found_inf``, so a skipped step
        leaves weights and momentum bit for bit as they were. With ``found_inf`` unset it is torch's step.
        The state dict is torch's Muon's. ``float32_ns``: orthogonalise in float32 (``orthogonalise_f32``);
        by default on the CPU only, torch's bfloat16 iteration elsewhere."""

        float32_ns: bool | None = None  # None: float32 on the CPU
        honours_found_inf = True  # what skips_on_device asks, without importing this class

        @torch.no_grad()
        def step(self, closure: Any = None) -> Any:
            found_inf = getattr(self, "found_inf", None)
            if found_inf is None:
                return super().step(closure)
            loss = None
            if closure is not None:
                with torch.enable_grad():
                    loss = closure()
            ok = found_inf == 0
            keep = ok.float()
            for group in self.param_groups:
                lr, wd, mu = group["lr"], group["weight_decay"], group["momentum"]
                decay = torch.where(ok, 1 - lr * wd, 1.0)  # scalars, not a tensor copied to the device
                for p in group["params"]:
                    if p.grad is None:
                        continue
                    grad = torch.where(ok, p.grad, 0)
                    state = self.state[p]
                    if "momentum_buffer" not in state:
                        state["momentum_buffer"] = torch.zeros_like(p.grad, memory_format=torch.preserve_format)
                    buf = state["momentum_buffer"]
                    buf.lerp_(grad, keep * (1 - mu))
                    update = grad.lerp(buf, mu) if group["nesterov"] else buf
                    f32 = self.float32_ns if self.float32_ns is not None else p.device.type == "cpu"
                    ns = orthogonalise_f32 if f32 else _zeropower_via_newtonschulz
                    update = ns(update, group["ns_coefficients"], group["ns_steps"], group["eps"])
                    p.mul_(decay)
                    # in the parameter's dtype, as torch's own step adds it (the update is bf16)
                    p.add_(update.to(p.dtype).mul_(keep * -_adjust_lr(lr, group["adjust_lr_fn"], p.shape)))
            return loss

    return GuardedMuon


def __getattr__(name: str) -> Any:
    # ``from dflash.objectives.optim import GuardedMuon`` still works; the import happens then, not here
    if name == "GuardedMuon":
        return guarded_muon()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def muon_takes(module: nn.Module, name: str, p: nn.Parameter) -> bool:
    """Whether Muon optimises parameter ``name`` of ``module``: a linear layer's 2-D weight with both
    sides above 1 (a [1, N] row is a vector to orthogonalise nothing of), unless the layer is marked
    ``not_for_muon`` (a vocabulary-indexed table)."""
    return (isinstance(module, nn.Linear) and name == "weight" and p.dim() == 2 and min(p.shape) > 1
            and not getattr(module, NOT_FOR_MUON, False))


def split_for_muon(model: nn.Module) -> tuple[list[nn.Parameter], list[nn.Parameter], list[nn.Parameter]]:
    """(Muon's parameters, the tables AdamW takes at Muon's rate, AdamW's others) of ``model``'s
    trainable parameters, each parameter once. A table: a 2-D parameter with both sides above 1 that
    Muon does not take."""
    muon, seen = [], set()
    for module in model.modules():
        for name, p in module.named_parameters(recurse=False):
            if p.requires_grad and muon_takes(module, name, p) and id(p) not in seen:
                muon.append(p)
                seen.add(id(p))
    others = [p for p in model.parameters() if p.requires_grad and id(p) not in seen]
    tables = [p for p in others if p.dim() == 2 and min(p.shape) > 1]
    rest = [p for p in others if not (p.dim() == 2 and min(p.shape) > 1)]
    return muon, tables, rest


def _adamw(params: Iterable[nn.Parameter], lr: float, weight_decay: float, device: torch.device,
           tables: Iterable[nn.Parameter] = (), tables_lr_scale: float = 1.0) -> torch.optim.AdamW:
    """Fused AdamW, weight decay on matrices only; every group carries ``lr_scale``. ``tables`` (with
    Muon: the vocabulary-indexed tables) get a group of their own at ``tables_lr_scale`` x ``lr``."""
    params = list(params)
    decay = [p for p in params if p.dim() >= 2]
    other = [p for p in params if p.dim() < 2]
    groups = [g for g in ({"params": decay, "weight_decay": weight_decay, "lr_scale": 1.0},
                          {"params": other, "weight_decay": 0.0, "lr_scale": 1.0},
                          {"params": list(tables), "weight_decay": weight_decay, "lr_scale": tables_lr_scale,
                           "lr": lr * tables_lr_scale})
              if g["params"]]
    # Fused AdamW keeps its step counters on the parameters' device and never reads them back (the
    # foreach/for-loop versions call `.item()` on them every step), and it reads `found_inf`.
    return torch.optim.AdamW(groups, lr=lr, betas=ADAMW_BETAS, fused=device.type in ("cuda", "cpu"))


class Optimizers:
    """Several optimizers over disjoint parameters stepped as one (Muon + AdamW): what the trainer, the
    guard and the checkpoint see of an optimizer (``param_groups``, ``step``, ``zero_grad``,
    ``state_dict``, ``found_inf``). The state dict is one entry per optimizer by name."""

    def __init__(self, named: dict[str, torch.optim.Optimizer]) -> None:
        self.named = named

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return [g for opt in self.named.values() for g in opt.param_groups]

    @property
    def found_inf(self) -> torch.Tensor | None:
        return next(iter(self.named.values())).__dict__.get("found_inf")

    @found_inf.setter
    def found_inf(self, value: torch.Tensor) -> None:
        for opt in self.named.values():
            opt.found_inf = value  # type: ignore[attr-defined]

    def step(self) -> None:
        for opt in self.named.values():
            opt.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.named.values():
            opt.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return {name: opt.state_dict() for name, opt in self.named.items()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if set(state) != set(self.named):
            raise ValueError(f"optimizer state holds {sorted(state)}, this run's optimizer {sorted(self.named)}")
        for name, opt in self.named.items():
            opt.load_state_dict(state[name])


def skips_on_device(optimizer: Any) -> bool:
    """Whether ``optimizer`` takes the guard's ``found_inf`` on the device (fused AdamW, GuardedMuon)."""
    if isinstance(optimizer, Optimizers):
        return all(skips_on_device(o) for o in optimizer.named.values())
    return bool(getattr(optimizer, "honours_found_inf", False) or optimizer.defaults.get("fused"))


def build_optimizer(model: nn.Module, settings: Any, device: torch.device) -> torch.optim.Optimizer | Optimizers:
    """The optimizer ``settings`` (an OptimSettings: optimizer, lr, muon_lr, weight_decay) names for
    ``model`` on ``device``. Every param group carries ``lr_scale``: its peak lr over ``settings.lr``."""
    if settings.optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer: unknown optimizer {settings.optimizer!r}; choose from {', '.join(OPTIMIZERS)}")
    if settings.optimizer == "adamw":
        return _adamw(model.parameters(), settings.lr, settings.weight_decay, device)
    muon_cls = guarded_muon()
    muon_params, tables, rest = split_for_muon(model)
    muon_lr = settings.muon_lr if settings.muon_lr is not None else MUON_LR_SCALE * settings.lr
    named: dict[str, torch.optim.Optimizer] = {}
    if muon_params:
        named["muon"] = muon_cls(muon_params, lr=muon_lr, weight_decay=settings.weight_decay,
                                 momentum=MUON_MOMENTUM, ns_steps=MUON_NS_STEPS, adjust_lr_fn=MUON_ADJUST_LR)
        for g in named["muon"].param_groups:
            g["lr_scale"] = muon_lr / settings.lr
    if rest or tables:
        named["adamw"] = _adamw(rest, settings.lr, settings.weight_decay, device, tables, muon_lr / settings.lr)
    return Optimizers(named)


def describe(optimizer: Any) -> str:
    """One line: which optimizer takes how many parameters."""
    if not isinstance(optimizer, Optimizers):
        return f"{type(optimizer).__name__} over {_count(optimizer)} parameters"
    return ", ".join(f"{name} over {_count(opt)} parameters" for name, opt in optimizer.named.items())


def _count(opt: torch.optim.Optimizer) -> str:
    n = sum(p.numel() for g in opt.param_groups for p in g["params"])
    return f"{n / 1e6:.2f}M" if n >= 100_000 else f"{n:,}"
