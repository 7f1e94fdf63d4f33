"""Rollout generation: prompt datasets and the built-in arithmetic task, generation backends
(transformers; vLLM as an optional extra), rewards (math-verify in a process pool), and assembly
of rows in the `rollouts` schema.

Invariant: this package imports only `storage` among rollstore's packages, never `learner`.
"""
