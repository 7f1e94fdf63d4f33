-- `rollstore compare A B`: the runs of the buffer (any table that names one), to refuse an unknown name.
SELECT DISTINCT run_id FROM (
    SELECT run_id FROM rollouts
    UNION SELECT run_id FROM checkpoints
    UNION SELECT run_id FROM evaluations WHERE run_id IS NOT NULL
)
ORDER BY run_id;
