-- `rollstore audit --skips`: pre-rollout prompt selection of run $run, one row per step: prompts
-- examined, generated, skipped and filled (skipped by the draw, generated because the pool ran out),
-- the step's exploration rates, and of the prompts skipped at that step, how many were generated again
-- later in the run and how many of those groups were informative (the predictor was wrong).
WITH outcomes AS (
    SELECT skipped_at AS step, count(*) AS later_sampled, count(*) FILTER (WHERE next_informative) AS later_informative
    FROM ({outcomes})
    WHERE run_id = $run
    GROUP BY skipped_at
)
SELECT p.step, count(*) AS examined,
       count(*) FILTER (WHERE decision = 'generate') AS generated,
       count(*) FILTER (WHERE decision = 'skip') AS skipped,
       count(*) FILTER (WHERE reason = 'filled') AS filled,
       round(count(*) FILTER (WHERE decision = 'skip') / count(*), 3) AS skip_share,
       round(any_value(explore_easy), 3) AS explore_easy, round(any_value(explore_hard), 3) AS explore_hard,
       coalesce(any_value(o.later_sampled), 0) AS later_sampled,
       coalesce(any_value(o.later_informative), 0) AS later_informative
FROM prompt_selections p LEFT JOIN outcomes o USING (step)
WHERE p.run_id = $run
GROUP BY p.step
ORDER BY p.step
