-- Tokens kept by the whole curation (the record's tokens_kept): the sum of curate_tokens_kept.sql's
-- counts. With a token stage it must equal the budget K exactly (the threshold's proof).
SELECT coalesce(sum(tokens_kept), 0)::BIGINT AS tokens_kept
FROM kept_counts;
