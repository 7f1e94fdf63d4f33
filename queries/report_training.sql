-- Report, training: the learner's metrics per optimiser step, each a mean over the kept tokens of
-- the step: `clip_fraction` (tokens whose term was clipped), `approx_kl` ((ρ − 1) − log ρ, the k3
-- estimate of KL(old ‖ new) with ρ = π_θ / π_old) and `entropy` (of the policy at kept tokens).
SELECT
    run_id,
    step,
    version,
    curation_id,
    loss,
    clip_fraction,
    approx_kl,
    entropy,
    grad_norm,
    tokens,
    samples,
    lr
FROM training
ORDER BY run_id, step;
