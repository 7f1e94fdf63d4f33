"""What a buffer says back to a person: `rollstore report` (`page`, one HTML page with the inline
charts of `svg`), `rollstore audit` and the front door's `compare`/`why` (`audit`), and token ids as
text for both (`token_text`). Every number comes from a SQL file of `queries/`."""
