"""Lightning callbacks of lit-hbp, importable as ``lit_hbp.callbacks``."""
