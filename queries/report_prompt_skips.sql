-- Report: pre-rollout prompt selection (docs/curation.md §Before generation), per run and step: the
-- prompts examined before generating, how many were skipped, how many generated although drawn to be
-- skipped because the pool ran out (filled), the skip share and the step's exploration rates.
SELECT run_id, step, count(*) AS examined,
       count(*) FILTER (WHERE decision = 'skip') AS skipped,
       count(*) FILTER (WHERE reason = 'filled') AS filled,
       round(count(*) FILTER (WHERE decision = 'skip') / count(*), 4) AS skip_share,
       round(any_value(explore_easy), 4) AS explore_easy,
       round(any_value(explore_hard), 4) AS explore_hard
FROM prompt_selections
GROUP BY run_id, step
ORDER BY run_id, step
