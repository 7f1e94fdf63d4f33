"""Policy losses of the learner, registered by name (docs/curation.md §Losses; verl `core_algos.py` style).

Every loss has one signature, `loss(inputs, *, config, norm)`: a `LossInputs` of per-token
tensors [B, T] `logp` (the policy being trained, with grad), `old_logp` (the trainer's log-probs at
the sampling version), `mask` (bool: the kept tokens), per-sequence tensors [B] `advantages` and
`weights`, and optional per-token `ref_logp` (reference model, for the k3 KL term), `gen_logp`
(sampler log-probs, for the truncated importance weight), `prox_logp` (the proximal policy of the
decoupled objective, no grad), `entropy` (metrics only); a `LossConfig` and a `Normalizer`.
`compute_loss(name, logp, old_logp, mask, advantages, weights, **kw)` builds the `LossInputs`.

Invariants:
- A token outside `mask` contributes exactly nothing to the loss and receives exactly zero
  gradient, whatever values (even ±inf / NaN-free garbage) its log-probs hold: masked positions are
  replaced with `torch.where` before any exp or product, never multiplied by 0.
- A sequence with an all-false mask contributes nothing and is not counted in any per-sequence
  denominator; it is not counted in `samples` either.
- `weights[i]` multiplies sequence i's whole contribution (never the denominators).
- Denominators come from the `Normalizer`: by default the batch itself; the trainer passes the
  whole optimiser step's counts so that the micro-batch losses of one step sum to exactly the loss
  of the step's full batch (gradient accumulation changes no weighting).
- Adding a loss is one decorated function: `@register_loss(name, clip_low, clip_high)`; the
  decoupled off-policy correction (`config.decoupled`, `prox_logp`) applies to every loss through
  `_ratio_base` / `_decoupled_weight` (token losses) or their sequence-level forms (GSPO).
- Decoupled, a row whose `prox_logp` equals its `old_logp` contributes exactly what it does without
  the correction: the ratio is against the same values, and its weight is exp(0) = 1 exactly.
- `prox_logp` never carries gradient (it is detached here): the trainer passes `logp.detach()` for
  its lagged rows (the training forward runs the weights at the start of the optimiser step), so
  their ρ is 1 in value and the gradient of their PPO term is −w·A·∇log π_θ (GSPO: of the
  sequence's mean log π_θ over its kept tokens), the clip not binding.
- Metrics are returned as sums (`LossStats`, mergeable across micro-batches with `+`) and turned
  into means by `LossStats.metrics()`: clip fraction and approx KL are over kept tokens.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from typing import Callable, Protocol

import torch
from torch import Tensor


@dataclass(frozen=True)
class LossConfig:
    """Knobs shared by every loss. `None` clips take the registered loss's defaults."""

    clip_low: float | None = None
    clip_high: float | None = None
    dual_clip: float | None = None  # c > 1 (3.0 in verl/DAPO): caps the loss at c·|A| for A < 0
    kl_beta: float = 0.0  # coefficient of the k3 KL to `ref_logp`
    tis_cap: float | None = None  # C (2.0): truncated importance weight min(exp(old − gen), C)
    max_len: int | None = None  # dr_grpo's length constant (the generation budget); None: longest response
    # The decoupled objective (AReaL, arXiv 2505.24298) for rows sampled by an older policy: the clip
    # ratio against `prox_logp` (the weights at the start of the optimiser step), each token weighted
    # by min(π_prox / π_behav, C) with π_behav the row's `old_logp`. Rows whose prox_logp equals
    # old_logp (no lag) get exactly today's loss.
    decoupled: bool = True  # without prox_logp (or without lagged rows) nothing changes
    decoupled_cap: float = 2.0  # C


@dataclass(frozen=True)
class Normalizer:
    """Denominators of one optimiser step: kept sequences, kept tokens, longest response."""

    sequences: int
    tokens: int
    max_len: int

    @classmethod
    def of(cls, mask: Tensor, lengths: Tensor | None = None) -> "Normalizer":
        """Counts of a [B, T] mask; `max_len` is the longest of `lengths` or, without them, the
        longest response the mask shows (last kept position + 1 per row, max over rows; 0 when
        nothing is kept) — never the mask's padded width."""
        kept = mask.sum(dim=1)
        if lengths is not None and lengths.numel():
            max_len = int(lengths.max())
        elif mask.numel():
            ends = torch.arange(1, mask.shape[1] + 1, device=mask.device)
            max_len = int(torch.where(mask.bool(), ends, torch.zeros_like(ends)).max())
        else:
            max_len = 0
        return cls(int((kept > 0).sum()), int(kept.sum()), max_len)

    def __add__(self, other: "Normalizer") -> "Normalizer":
        return Normalizer(
            self.sequences + other.sequences, self.tokens + other.tokens, max(self.max_len, other.max_len)
        )


@dataclass
class LossStats:
    """Sums over kept tokens / sequences; `+` merges micro-batches, `metrics()` gives means."""

    tokens: int = 0
    samples: int = 0
    clipped: float = 0.0  # kept tokens whose term was clipped (ratio clip or dual clip)
    approx_kl: float = 0.0  # Σ (ρ − 1) − log ρ over kept tokens
    entropy: float | None = None  # Σ entropy over kept tokens, when given
    ref_kl: float | None = None  # Σ k3(ref ‖ π) over kept tokens, when given

    def __add__(self, other: "LossStats") -> "LossStats":
        def opt(a, b):
            return None if a is None and b is None else (a or 0.0) + (b or 0.0)

        return LossStats(
            self.tokens + other.tokens,
            self.samples + other.samples,
            self.clipped + other.clipped,
            self.approx_kl + other.approx_kl,
            opt(self.entropy, other.entropy),
            opt(self.ref_kl, other.ref_kl),
        )

    def metrics(self) -> dict[str, float | int | None]:
        n = self.tokens

        def mean(x):
            return None if x is None or n == 0 else x / n

        return {
            "clip_fraction": mean(self.clipped) if n else 0.0,
            "approx_kl": mean(self.approx_kl) if n else 0.0,
            "entropy": mean(self.entropy),
            "ref_kl": mean(self.ref_kl),
            "tokens": self.tokens,
            "samples": self.samples,
        }


@dataclass
class LossOutput:
    loss: Tensor  # scalar, differentiable
    stats: LossStats


@dataclass(frozen=True)
class LossInputs:
    """The tensors of one micro-batch a loss reads (see the module docstring)."""

    logp: Tensor
    old_logp: Tensor
    mask: Tensor
    advantages: Tensor
    weights: Tensor
    ref_logp: Tensor | None = None
    gen_logp: Tensor | None = None
    prox_logp: Tensor | None = None
    entropy: Tensor | None = None


class LossFn(Protocol):
    def __call__(self, x: LossInputs, *, config: LossConfig = ..., norm: Normalizer | None = ...) -> LossOutput: ...


@dataclass(frozen=True)
class LossSpec:
    name: str
    fn: LossFn
    clip_low: float
    clip_high: float


LOSSES: dict[str, LossSpec] = {}


def register_loss(name: str, clip_low: float, clip_high: float) -> Callable[[Callable], LossFn]:
    """Register a loss; the wrapper fills the config's unset clips with these defaults."""

    def decorate(fn: Callable) -> LossFn:
        @functools.wraps(fn)
        def wrapper(x: LossInputs, *, config: LossConfig = LossConfig(), norm: Normalizer | None = None):
            config = replace(
                config,
                clip_low=clip_low if config.clip_low is None else config.clip_low,
                clip_high=clip_high if config.clip_high is None else config.clip_high,
            )
            x = replace(x, mask=x.mask.bool())
            return fn(x, config=config, norm=Normalizer.of(x.mask) if norm is None else norm)

        if name in LOSSES:
            raise ValueError(f"loss {name!r} registered twice")
        LOSSES[name] = LossSpec(name, wrapper, clip_low, clip_high)
        return wrapper

    return decorate


def get_loss(name: str) -> LossFn:
    try:
        return LOSSES[name].fn
    except KeyError:
        raise ValueError(f"unknown loss {name!r} (one of {', '.join(sorted(LOSSES))})") from None


# ---- shared pieces (plumbing) -----------------------------------------------------------------


def _masked(x: Tensor, mask: Tensor) -> Tensor:
    """x where kept, 0 elsewhere; no gradient reaches x at masked positions."""
    return torch.where(mask, x, torch.zeros((), dtype=x.dtype, device=x.device))


def _clipped_surrogate(ratio: Tensor, adv: Tensor, c: LossConfig) -> tuple[Tensor, Tensor]:
    """ℓ = −min(ρA, clip(ρ, 1−ε_low, 1+ε_high)A), dual-clipped at c·|A| for A < 0; and where clipped."""
    unclipped = -adv * ratio
    clipped = -adv * torch.clamp(ratio, 1.0 - c.clip_low, 1.0 + c.clip_high)
    loss = torch.maximum(unclipped, clipped)
    was_clipped = clipped > unclipped
    if c.dual_clip is not None:
        cap = -adv * c.dual_clip
        dual = (adv < 0) & (loss > cap)
        loss = torch.where(adv < 0, torch.minimum(loss, cap), loss)
        was_clipped = was_clipped | dual
    return loss, was_clipped


def _k3(log_q_over_p: Tensor) -> Tensor:
    """k3 estimator of KL(p‖q) from samples of p: (r − 1) − log r with log r = x = log q − log p."""
    return torch.exp(log_q_over_p) - log_q_over_p - 1.0


def _stats(
    log_ratio: Tensor, mask: Tensor, clipped_tokens: Tensor, entropy: Tensor | None, ref_kl: Tensor | None
) -> LossStats:
    with torch.no_grad():
        kept = mask.sum(dim=1)
        return LossStats(
            tokens=int(kept.sum()),
            samples=int((kept > 0).sum()),
            clipped=float(_masked(clipped_tokens.float(), mask).sum()),
            approx_kl=float(_masked(_k3(log_ratio.float()), mask).sum()),  # (ρ − 1) − log ρ
            entropy=None if entropy is None else float(_masked(entropy.float(), mask).sum()),
            ref_kl=None if ref_kl is None else float(_masked(ref_kl.float(), mask).sum()),
        )


def _ratio_base(old_logp: Tensor, prox_logp: Tensor | None, config: LossConfig) -> Tensor:
    """What the ratio is taken against: π_old, or with the decoupled objective π_prox."""
    if config.decoupled and prox_logp is not None:
        return prox_logp.float().detach()
    return old_logp.float()


def decoupled_weight(prox_logp: Tensor, behav_logp: Tensor, mask: Tensor, cap: float, sequence: bool = False) -> Tensor:
    """The decoupled objective's weight min(π_prox / π_behav, C), without gradient: per token [B, T]
    (exp(0) = 1 where masked, so a masked token's weight is 1, capped); with `sequence`, one weight
    per row [B], the capped geometric mean over its kept tokens (GSPO's sequence-level form).
    The one definition: the learner's losses and the TRL plug-in's replay both use it."""
    diff = _masked(prox_logp.float() - behav_logp.float(), mask)
    if sequence:
        diff = diff.sum(dim=1) / mask.sum(dim=1).clamp(min=1)
    return torch.clamp(torch.exp(diff), max=cap).detach()


def _decoupled_weight(old_logp: Tensor, prox_logp: Tensor | None, mask: Tensor, config: LossConfig) -> Tensor | None:
    """Per-token min(π_prox / π_behav, C), π_behav = the row's stored `old_logp` (None: not decoupled)."""
    if not config.decoupled or prox_logp is None:
        return None
    return decoupled_weight(prox_logp, old_logp, mask, config.decoupled_cap)


def _token_losses(x: LossInputs, config: LossConfig) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    """Per-token loss [B, T] (0 where masked), the log ratio, where clipped, the reference k3."""
    logp, old_logp, mask = x.logp.float(), x.old_logp, x.mask
    ref_logp, gen_logp, prox_logp = x.ref_logp, x.gen_logp, x.prox_logp
    log_ratio = _masked(logp - _ratio_base(old_logp, prox_logp, config), mask)
    adv = x.advantages.float()[:, None].expand_as(logp)
    loss, clipped = _clipped_surrogate(torch.exp(log_ratio), adv, config)
    weight = _decoupled_weight(old_logp, prox_logp, mask, config)
    if weight is not None:
        loss = loss * weight
    if gen_logp is not None and config.tis_cap is not None:
        tis = torch.clamp(torch.exp(_masked(old_logp.float() - gen_logp.float(), mask)), max=config.tis_cap)
        loss = loss * tis.detach()
    ref_kl = None
    if ref_logp is not None:
        ref_kl = _k3(_masked(ref_logp.float() - logp, mask))
        if config.kl_beta:
            loss = loss + config.kl_beta * ref_kl
    return _masked(loss, mask), log_ratio, clipped, ref_kl


def _kept_sequences(mask: Tensor) -> tuple[Tensor, Tensor]:
    n = mask.sum(dim=1)
    return n, n > 0


# ---- the losses (algorithm) -------------------------------------------------------------------


@register_loss("grpo", clip_low=0.2, clip_high=0.2)
def grpo(x: LossInputs, *, config: LossConfig, norm: Normalizer) -> LossOutput:
    """Token mean within each sequence, then mean over (non-empty) sequences."""
    tok, log_ratio, clipped, ref_kl = _token_losses(x, config)
    n, _ = _kept_sequences(x.mask)
    per_seq = tok.sum(dim=1) / n.clamp(min=1)
    loss = (x.weights.float() * per_seq).sum() / max(norm.sequences, 1)
    return LossOutput(loss, _stats(log_ratio, x.mask, clipped, x.entropy, ref_kl))


@register_loss("dapo", clip_low=0.2, clip_high=0.28)
def dapo(x: LossInputs, *, config: LossConfig, norm: Normalizer) -> LossOutput:
    """Mean over all kept tokens of the batch (token-level, DAPO arXiv 2503.14476)."""
    tok, log_ratio, clipped, ref_kl = _token_losses(x, config)
    loss = (x.weights.float() * tok.sum(dim=1)).sum() / max(norm.tokens, 1)
    return LossOutput(loss, _stats(log_ratio, x.mask, clipped, x.entropy, ref_kl))


@register_loss("dr_grpo", clip_low=0.2, clip_high=0.2)
def dr_grpo(x: LossInputs, *, config: LossConfig, norm: Normalizer) -> LossOutput:
    """Sum over kept tokens / (non-empty sequences × max response length) (Dr. GRPO arXiv
    2503.20783); the length is `config.max_len` (a constant budget, as in the paper) when set, else
    the longest response of the step."""
    tok, log_ratio, clipped, ref_kl = _token_losses(x, config)
    max_len = config.max_len if config.max_len is not None else norm.max_len
    loss = (x.weights.float() * tok.sum(dim=1)).sum() / max(norm.sequences * max_len, 1)
    return LossOutput(loss, _stats(log_ratio, x.mask, clipped, x.entropy, ref_kl))


@register_loss("gspo", clip_low=3e-4, clip_high=4e-4)
def gspo(x: LossInputs, *, config: LossConfig, norm: Normalizer) -> LossOutput:
    """One clipped term per sequence with s_i = exp(mean_t(logπ − old)) over its kept tokens
    (GSPO arXiv 2507.18071); decoupled, s_i is against π_prox and weighted by the geometric mean
    of min-capped π_prox/π_old (the sequence-level variant); the truncated importance weight is the sequence's geometric mean
    min(exp(mean_t(old − gen)), C); the KL term is the token mean of k3 per sequence."""
    logp, old_logp, mask = x.logp.float(), x.old_logp, x.mask
    ref_logp, gen_logp, prox_logp = x.ref_logp, x.gen_logp, x.prox_logp
    n, has = _kept_sequences(mask)
    denom = n.clamp(min=1)
    log_ratio = _masked(logp - _ratio_base(old_logp, prox_logp, config), mask)
    seq_log_ratio = log_ratio.sum(dim=1) / denom
    seq_loss, seq_clipped = _clipped_surrogate(torch.exp(seq_log_ratio), x.advantages.float(), config)
    if config.decoupled and prox_logp is not None:  # the geometric mean of the token weights, capped
        seq_loss = seq_loss * decoupled_weight(prox_logp, old_logp, mask, config.decoupled_cap, sequence=True)
    if gen_logp is not None and config.tis_cap is not None:
        seq_tis = _masked(old_logp.float() - gen_logp.float(), mask).sum(dim=1) / denom
        seq_loss = seq_loss * torch.clamp(torch.exp(seq_tis), max=config.tis_cap).detach()
    ref_kl = None
    if ref_logp is not None:
        ref_kl = _k3(_masked(ref_logp.float() - logp, mask))
        if config.kl_beta:
            seq_loss = seq_loss + config.kl_beta * _masked(ref_kl, mask).sum(dim=1) / denom
    seq_loss = torch.where(has, seq_loss, torch.zeros((), device=seq_loss.device))
    loss = (x.weights.float() * seq_loss).sum() / max(norm.sequences, 1)
    clipped_tokens = seq_clipped[:, None].expand_as(mask)
    return LossOutput(loss, _stats(log_ratio, mask, clipped_tokens, x.entropy, ref_kl))


def compute_loss(
    name: str,
    logp: Tensor,
    old_logp: Tensor,
    mask: Tensor,
    advantages: Tensor,
    weights: Tensor,
    *,
    config: LossConfig = LossConfig(),
    norm: Normalizer | None = None,
    **optional: Tensor | None,
) -> LossOutput:
    """Look up `name` and call it on these tensors; `optional`: `LossInputs`' optional ones
    (ref_logp, gen_logp, prox_logp, entropy)."""
    return get_loss(name)(LossInputs(logp, old_logp, mask, advantages, weights, **optional), config=config, norm=norm)
