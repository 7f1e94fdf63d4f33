"""The built-ins: `builtin:tiny` and `builtin:arith` resolved to a model directory and prompts
(`resolve`, which builds and caches the tiny policy), and synthetic rollouts for tests, benchmarks
and examples (`synthetic`)."""
