"""Private helpers shared across zinfjax: byte sizes, strict JSON/YAML mapping files, the config's choices (tiers,
precisions, compute dtypes) and the DeepSpeed config reader. Not part of the public API."""
