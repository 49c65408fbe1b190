"""Data side of lit-hbp: sources -> tokenized samples -> plan -> per-rank packed micro-batches."""
