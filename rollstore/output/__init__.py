"""What leaves a buffer as files: output paths written atomically and checked first (`outfile`),
query results as a table, CSV, JSON or Parquet (`formats`), and a snapshot as a plain Parquet
dataset (`export`)."""
