"""transformers backend: batched `generate` on a local model directory (CPU or one GPU).

Invariants (on top of the contract in `rollout.backends`):
- Prompts are left-padded and the attention mask is the prompt mask followed by ones, so each
  sampled sequence sees exactly what a separate forward pass over prompt + response sees.
- The model's own generation_config (a Hub checkpoint's temperature, top_k, repetition penalty)
  never leaks in: sampling uses exactly the arguments given, with top_k disabled.
- Log-probs are recorded by a logits processor that runs before the temperature/top-p warpers and
  keeps one step's [batch, vocab] rows at a time: memory is O(batch × vocab), never
  O(batch × steps × vocab). In fp32 the same processor gives the untempered `policy_logprobs` and
  `entropies` of the contract, so the loop needs no second forward pass to score its rollouts.
- The torch RNG is seeded with `seed` inside `fork_rng`, so the caller's RNG state is untouched
  and the same call gives the same tokens.
"""

from __future__ import annotations

import numpy as np
import torch
from transformers import AutoModelForCausalLM, GenerationConfig, LogitsProcessor, LogitsProcessorList

from . import (
    Generation,
    check_sampling,
    cut_at_first_eos,
    eos_token_ids,
    finalize_logprobs,
    load_tokenizer,
)


class _SampledTokenLogprobs(LogitsProcessor):
    """Records, one step behind the sampler, the sampled token's log_softmax(raw logits / T), its
    untempered log_softmax(raw logits) and the untempered entropy of each position."""

    def __init__(self, temperature: float, prompt_width: int):
        self.temperature = temperature if temperature > 0 else 1.0
        self.prompt_width = prompt_width
        self.prev: tuple[torch.Tensor, torch.Tensor] | None = None  # (tempered, untempered) log-probs
        self.values: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.entropies: list[torch.Tensor] = []

    def _take(self, tokens: torch.Tensor) -> None:
        tempered, policy = self.prev
        self.values.append((tempered.gather(1, tokens).squeeze(1), policy.gather(1, tokens).squeeze(1)))

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if self.prev is not None:  # the token sampled from the previous row is input_ids[:, -1]
            self._take(input_ids[:, -1:])
        policy = torch.log_softmax(scores.float(), dim=-1)
        p = policy.exp()
        self.entropies.append(-torch.where(p > 0, p * policy, torch.zeros_like(p)).sum(dim=-1))
        tempered = policy if self.temperature == 1.0 else torch.log_softmax(scores.float() / self.temperature, dim=-1)
        self.prev = (tempered, policy)
        return scores

    def finish(self, sequences: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """[batch, new_tokens] tempered log-probs, untempered log-probs and entropies, aligned with
        sequences[:, prompt_width:]."""
        new = sequences.shape[1] - self.prompt_width
        if len(self.values) < new and self.prev is not None:
            self._take(sequences[:, self.prompt_width + len(self.values)].unsqueeze(1))
        if new == 0:
            empty = torch.zeros((sequences.shape[0], 0))
            return empty, empty, empty
        values = self.values[:new]
        return (torch.stack([v[0] for v in values], dim=1), torch.stack([v[1] for v in values], dim=1),
                torch.stack(self.entropies[:new], dim=1))


class HFBackend:
    name = "hf"

    def __init__(
        self,
        model_dir: str,
        device: str = "cpu",
        dtype: str | torch.dtype | None = None,
        batch_size: int = 512,
    ):
        self.device = torch.device(device)
        self.dtype = dtype
        self.batch_size = batch_size
        self.load_weights(model_dir)

    def load_weights(self, model_dir: str) -> None:
        dtype = self.dtype or (torch.float32 if self.device.type == "cpu" else "auto")
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
        self._adopt(model, load_tokenizer(model_dir), model_dir)

    @classmethod
    def from_model(cls, model: torch.nn.Module, tokenizer, device: str = "cpu", batch_size: int = 512) -> "HFBackend":
        """A backend over an in-memory model and tokenizer (e.g. one being trained); it samples from
        that very object (switched to eval mode; the caller switches it back)."""
        be = cls.__new__(cls)
        be.device, be.dtype, be.batch_size = torch.device(device), None, batch_size
        be._adopt(model, tokenizer, None)
        return be

    def _adopt(self, model, tokenizer, model_dir: str | None) -> None:
        self.tokenizer = tokenizer
        self.eos_ids = eos_token_ids(model.generation_config, self.tokenizer)
        pad = self.tokenizer.pad_token_id
        self.pad_id = int(pad) if pad is not None else self.eos_ids[0]
        model.generation_config = GenerationConfig(
            eos_token_id=self.eos_ids, pad_token_id=self.pad_id, bos_token_id=self.tokenizer.bos_token_id
        )
        self.model = model.to(self.device).eval()
        self.model_dir = model_dir

    def sync_weights(self, model: torch.nn.Module, model_dir: str) -> None:
        """Take the weights of an in-memory copy of `model_dir` (the checkpoint just published from it).

        What a loop uses instead of `load_weights` after each checkpoint: same weights, no reload.
        """
        self.model.load_state_dict(model.state_dict())
        self.model_dir = model_dir

    def _generation_config(self, max_new_tokens: int, temperature: float, top_p: float) -> GenerationConfig:
        common = dict(
            max_new_tokens=max_new_tokens,
            eos_token_id=self.eos_ids,
            pad_token_id=self.pad_id,
            num_beams=1,
            repetition_penalty=1.0,
            use_cache=True,
        )
        if temperature == 0:
            return GenerationConfig(do_sample=False, **common)
        return GenerationConfig(do_sample=True, temperature=temperature, top_p=top_p, top_k=0, **common)

    @torch.inference_mode()
    def generate(
        self,
        prompts: list[str],
        group_size: int,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_p: float = 1.0,
        seed: int = 0,
    ) -> list[list[Generation]]:
        check_sampling(group_size, max_new_tokens, temperature, top_p)
        prompt_ids = [list(self.tokenizer(p)["input_ids"]) for p in prompts]
        rows = [(i, k) for i in range(len(prompts)) for k in range(group_size)]
        out: list[list[Generation]] = [[] for _ in prompts]
        config = self._generation_config(max_new_tokens, temperature, top_p)
        devices = [self.device] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(seed)
            for start in range(0, len(rows), self.batch_size):
                chunk = rows[start : start + self.batch_size]
                for (i, _), (tokens, lps, reason, policy, ent) in zip(
                    chunk, self._generate_batch([prompt_ids[i] for i, _ in chunk], config, temperature)
                ):
                    text = self.tokenizer.decode(tokens, skip_special_tokens=True)
                    out[i].append(Generation(prompt_ids[i], tokens, text, lps, reason, policy, ent))
        return out

    def _generate_batch(self, batch_ids: list[list[int]], config: GenerationConfig, temperature: float):
        width = max(len(p) for p in batch_ids)
        input_ids = torch.full((len(batch_ids), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(batch_ids), width), dtype=torch.long)
        for r, p in enumerate(batch_ids):  # left padding
            input_ids[r, width - len(p) :] = torch.tensor(p, dtype=torch.long)
            mask[r, width - len(p) :] = 1
        recorder = _SampledTokenLogprobs(temperature, width)
        sequences = self.model.generate(
            input_ids=input_ids.to(self.device),
            attention_mask=mask.to(self.device),
            generation_config=config,
            logits_processor=LogitsProcessorList([recorder]),
        )
        logprobs, policy, entropies = (t.cpu().numpy() for t in recorder.finish(sequences))
        new_tokens = sequences[:, width:].cpu().tolist()
        max_new = config.max_new_tokens
        fp32 = next(self.model.parameters()).dtype == torch.float32
        for r in range(len(batch_ids)):
            tokens, lps, reason = cut_at_first_eos(new_tokens[r], logprobs[r], self.eos_ids, max_new)
            n = len(tokens)
            if fp32:  # the sampler's forward is the policy's: its untempered stats are the scores
                yield (tokens, finalize_logprobs(lps), reason, finalize_logprobs(policy[r, :n]),
                       np.maximum(entropies[r, :n], 0).astype(np.float32))
            else:
                yield tokens, finalize_logprobs(lps), reason, None, None
